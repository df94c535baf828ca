"""NVRTC layer of the CUDA backend: compile, resources, errors, caches; the driver without a GPU.

Everything except the tests marked ``gpu`` runs on a CPU-only machine: NVRTC compiles to
cubin without a GPU. The GPU tests skip when cuda_available() is false.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from napkin_dsl.backends import driver, nvrtc
from napkin_dsl.backends.nvrtc import (
    ELF_MAGIC,
    NvrtcCompileError,
    NvrtcCompiler,
    NvrtcNotAvailable,
    clear_cache,
    parse_ptxas_resources,
)
from napkin_dsl.errors import NapkinError

ROOT = Path(__file__).resolve().parent.parent

# A 16x16 tile transpose through padded shared memory, reading bf16: exercises cuda_bf16.h
# (headers) and static shared memory (16 * 17 * 4 = 1088 bytes).
TRANSPOSE = textwrap.dedent(
    """\
    #include <cuda_bf16.h>

    extern "C" __global__ void transpose16(const __nv_bfloat16* in, float* out, int n) {
        __shared__ float tile[16][17];  // +1 column: no bank conflicts on the transposed read
        int x = blockIdx.x * 16 + threadIdx.x;
        int y = blockIdx.y * 16 + threadIdx.y;
        if (x < n && y < n) tile[threadIdx.y][threadIdx.x] = __bfloat162float(in[y * n + x]);
        __syncthreads();
        x = blockIdx.y * 16 + threadIdx.x;
        y = blockIdx.x * 16 + threadIdx.y;
        if (x < n && y < n) out[y * n + x] = tile[threadIdx.x][threadIdx.y];
    }
    """
)
TILE_SMEM_BYTES = 16 * 17 * 4


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private, empty napkin cache for one test."""
    directory = tmp_path / "napkin-cache"
    monkeypatch.setenv("NAPKIN_CACHE_DIR", str(directory))
    return directory


def cache_files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / nvrtc.KERNEL_CACHE_SUBDIR).glob("*"))


# ---- compiling ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_bf16_shared_memory_kernel_compiles_to_cubin_with_resources(cache_dir, arch):
    module = NvrtcCompiler(arch).compile(TRANSPOSE, "transpose")
    assert module.cubin.startswith(ELF_MAGIC)
    assert module.ptx is None and module.image is module.cubin and module.arch == arch
    assert f"for '{arch}'" in module.log  # ptxas's -v report made it into the log
    usage = module.resources["transpose16"]
    assert usage["registers"] > 0
    assert usage["shared_bytes"] == TILE_SMEM_BYTES
    assert usage["spill_bytes"] == 0


def test_ptx_output_names_its_target(cache_dir):
    module = NvrtcCompiler("sm_90", ptx=True).compile(TRANSPOSE, "transpose")
    text = module.ptx.decode()
    assert ".target sm_90" in text and ".entry transpose16" in text
    assert module.cubin is None and module.resources == {}
    assert module.image.endswith(b"\0")  # cuModuleLoadData reads PTX as a C string


def test_compile_error_quotes_failing_line_and_neighbours_not_whole_source(cache_dir):
    lines = TRANSPOSE.splitlines()
    failing = lines.index("    __syncthreads();") + 1
    lines[failing - 1] = "    __syncthreads(); float lost = undeclared_tile_value;"
    broken = "\n".join(lines) + "\n"
    with pytest.raises(NvrtcCompileError) as caught:
        NvrtcCompiler("sm_90").compile(broken, "attention_fwd")
    error = caught.value
    message = str(error)
    assert isinstance(error, RuntimeError) and not isinstance(error, NapkinError)  # a napkin bug
    assert 'identifier "undeclared_tile_value" is undefined' in message  # NVRTC's log
    assert f"attention_fwd.cu:{failing}: error" in message
    quoted = [line.strip() for line in message.splitlines()]
    assert f"> {failing:>2} | {lines[failing - 1]}".strip() in quoted
    for neighbour in (failing - 2, failing - 1, failing + 1, failing + 2):
        assert f"{neighbour:>2} | {lines[neighbour - 1]}".strip() in quoted
    assert "#include <cuda_bf16.h>" not in message  # line 1: far from the error, not quoted
    assert "bug in napkin" in message
    assert error.log and error.source == broken


def test_excerpts_stop_at_the_edges_of_the_source():
    source = "int a;\nint b = oops;\n"
    log = 'k.cu(2): error: identifier "oops" is undefined\n'
    excerpt = nvrtc.source_excerpts(source, log, "k.cu")
    assert excerpt.splitlines() == ['k.cu:2: error: identifier "oops" is undefined', "    1 | int a;", "  > 2 | int b = oops;"]


def test_parse_ptxas_resources_per_entry_ignoring_device_function_spills():
    log = textwrap.dedent(
        """\
        ptxas info    : 0 bytes gmem
        ptxas info    : Function properties for helper
        ptxas         .     16 bytes stack frame, 24 bytes spill stores, 24 bytes spill loads
        ptxas info    : Compiling entry function 'first' for 'sm_90'
        ptxas info    : Function properties for first
        ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 32 registers, used 1 barriers, 1088 bytes smem
        ptxas info    : Compiling entry function 'second' for 'sm_90'
        ptxas info    : Function properties for second
        ptxas         .     40 bytes stack frame, 40 bytes spill stores, 36 bytes spill loads
        ptxas info    : Used 255 registers, used 0 barriers, 368 bytes cmem[0]
        """
    )
    assert parse_ptxas_resources(log) == {
        "first": {"registers": 32, "shared_bytes": 1088, "spill_bytes": 0},
        "second": {"registers": 255, "shared_bytes": 0, "spill_bytes": 76},
    }


# ---- caching -----------------------------------------------------------------------------------


def test_in_process_cache_returns_the_same_object_fast(cache_dir):
    compiler = NvrtcCompiler("sm_90")
    first = compiler.compile(TRANSPOSE, "transpose")
    timings = []
    for _ in range(200):
        start = time.perf_counter()
        again = compiler.compile(TRANSPOSE, "transpose")
        timings.append(time.perf_counter() - start)
        assert again is first
    assert sorted(timings)[len(timings) // 2] < 0.5e-3
    assert (compiler.stats.compiled, compiler.stats.memory_hits, compiler.stats.disk_hits) == (1, 200, 0)


def test_disk_cache_serves_a_second_compiler(cache_dir):
    first = NvrtcCompiler("sm_90").compile(TRANSPOSE, "transpose")
    assert len(cache_files(cache_dir)) == 1
    second_compiler = NvrtcCompiler("sm_90")
    second = second_compiler.compile(TRANSPOSE, "transpose")
    assert (second_compiler.stats.compiled, second_compiler.stats.disk_hits) == (0, 1)
    assert second is not first and second == first
    assert second.cubin == first.cubin and second.resources == first.resources


def test_unreadable_cache_file_is_a_miss_and_gets_replaced(cache_dir):
    compiler = NvrtcCompiler("sm_90")
    path = compiler._cache_path(compiler.cache_key(TRANSPOSE))
    path.parent.mkdir(parents=True)
    path.write_text('{"format": 1, "truncated')
    module = compiler.compile(TRANSPOSE, "transpose")
    assert compiler.stats.compiled == 1 and module.cubin.startswith(ELF_MAGIC)
    assert NvrtcCompiler("sm_90")._read_disk(module.key) == module


def test_cache_key_covers_source_arch_kind_and_options(cache_dir):
    base = NvrtcCompiler("sm_90")
    key = base.cache_key(TRANSPOSE)
    assert len(key) == 64 and key == NvrtcCompiler("sm_90").cache_key(TRANSPOSE)
    others = {
        NvrtcCompiler("sm_80").cache_key(TRANSPOSE),
        NvrtcCompiler("sm_90", ptx=True).cache_key(TRANSPOSE),
        NvrtcCompiler("sm_90", options=["--use_fast_math"]).cache_key(TRANSPOSE),
        base.cache_key(TRANSPOSE + "\n"),
    }
    assert key not in others and len(others) == 4


def _compile_in_another_process(cache_dir: str, barrier, results) -> None:
    os.environ["NAPKIN_CACHE_DIR"] = cache_dir
    compiler = NvrtcCompiler("sm_90")
    barrier.wait()  # both start compiling, and so writing, at the same moment
    module = compiler.compile(TRANSPOSE, "transpose")
    for _ in range(50):  # and keep renaming over each other's files
        compiler._write_disk(module)
    results.put((compiler.stats.compiled, module.cubin[:4].hex()))


def test_concurrent_processes_share_one_cache_file(cache_dir):
    context = multiprocessing.get_context("spawn")  # fork after NVRTC has threads is unsafe
    barrier = context.Barrier(2)
    results = context.Queue()
    workers = [context.Process(target=_compile_in_another_process, args=(str(cache_dir), barrier, results)) for _ in range(2)]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    print(f"compiles per process: {[compiled for compiled, _ in outcomes]}")
    assert all(magic == ELF_MAGIC.hex() for _, magic in outcomes)
    files = cache_files(cache_dir)
    assert len(files) == 1 and files[0].name.endswith(nvrtc.CACHE_FILE_SUFFIX)  # no temporary left behind
    reader = NvrtcCompiler("sm_90")
    module = reader.compile(TRANSPOSE, "transpose")
    assert reader.stats.disk_hits == 1 and module.resources["transpose16"]["shared_bytes"] == TILE_SMEM_BYTES


def test_clear_cache_removes_compiled_modules_and_counts_them(cache_dir):
    NvrtcCompiler("sm_80").compile(TRANSPOSE, "transpose")
    NvrtcCompiler("sm_90").compile(TRANSPOSE, "transpose")
    assert clear_cache() == 2
    assert cache_files(cache_dir) == []
    assert (cache_dir / nvrtc.HEADER_CACHE_SUBDIR).is_dir()  # headers stay unless asked
    assert clear_cache() == 0
    assert clear_cache(headers=True) > 100  # the extracted CUDA headers
    assert not (cache_dir / nvrtc.HEADER_CACHE_SUBDIR).exists()


def test_napkin_cache_clear_command(cache_dir, capsys):
    from napkin_dsl.cli import main

    NvrtcCompiler("sm_90").compile(TRANSPOSE, "transpose")
    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out.strip() == f"removed 1 file from {cache_dir}"
    assert cache_files(cache_dir) == []


# ---- where NVRTC and its headers come from -----------------------------------------------------

PIP_ONLY_PROBE = textwrap.dedent(
    """\
    import json, sys
    from napkin_dsl.backends import nvrtc
    compiler = nvrtc.NvrtcCompiler("sm_90")
    module = compiler.compile(open(sys.argv[1]).read(), "transpose")
    path, found_via = nvrtc.nvrtc_library()
    with open("/proc/self/maps") as maps:
        mapped = sorted({line.split()[-1] for line in maps if "/" in line})
    print(json.dumps({
        "elf": module.cubin.startswith(nvrtc.ELF_MAGIC),
        "shared_bytes": module.resources["transpose16"]["shared_bytes"],
        "version": list(nvrtc.nvrtc_version()),
        "header_mode": compiler.header_mode,
        "options": compiler.nvrtc_options,
        "pathfinder_path": path,
        "found_via": found_via,
        "nvrtc_mapped": [m for m in mapped if "libnvrtc" in m],
        "system_cuda_mapped": [m for m in mapped if "/usr/local/cuda" in m or "/opt/cuda" in m],
    }))
    """
)
SYSTEM_CUDA_VARIABLES = ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT", "CUDA_TOOLKIT_ROOT_DIR", "CUDAToolkit_ROOT", "CUDACXX")


def test_pip_only_nvrtc_compiles_with_system_cuda_hidden(tmp_path):
    """NVRTC and its headers come from the pip wheel, with every pointer to a system CUDA removed.

    cuda.pathfinder (1.9) has no switch to ignore a system CUDA: its only variables are
    CUDA_PATH/CUDA_HOME (unset here) and CONDA_PREFIX. Hiding means unsetting those and
    stripping CUDA directories from PATH and LD_LIBRARY_PATH; the probe then checks, from the
    process's own memory map, that the libnvrtc that compiled lives in site-packages.
    """
    environment = {name: value for name, value in os.environ.items() if name not in SYSTEM_CUDA_VARIABLES}
    for variable in ("PATH", "LD_LIBRARY_PATH"):
        if variable in environment:
            kept = [entry for entry in environment[variable].split(os.pathsep) if "cuda" not in entry.lower()]
            environment[variable] = os.pathsep.join(kept)
    environment["NAPKIN_CACHE_DIR"] = str(tmp_path / "cache")
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
    source = tmp_path / "transpose.cu"
    source.write_text(TRANSPOSE)
    probe = subprocess.run(
        [sys.executable, "-c", PIP_ONLY_PROBE, str(source)],
        check=False,
        env=environment,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    print(f"pip-only NVRTC {found['version']}: {found['pathfinder_path']} (found via {found['found_via']})")
    assert found["elf"] and found["shared_bytes"] == TILE_SMEM_BYTES
    assert found["found_via"] == "site-packages" and "site-packages" in found["pathfinder_path"]
    assert found["nvrtc_mapped"] and all("site-packages" in path for path in found["nvrtc_mapped"])
    assert found["system_cuda_mapped"] == []
    assert found["header_mode"] == "bundled"
    assert not any("/usr/local/cuda" in option for option in found["options"])


def test_toolkit_headers_fallback_compiles_bf16(cache_dir):
    """The path an NVRTC older than 13.3 takes: --include-path to the CUDA wheels or system CUDA."""
    if not nvrtc._toolkit_include_dirs():
        pytest.skip("no nvidia-cuda-runtime wheel and no system CUDA headers on this machine")
    compiler = NvrtcCompiler("sm_90", headers="toolkit")
    assert compiler.header_mode == "toolkit"
    assert all(option.startswith("--include-path=") for option in compiler.header_options)
    module = compiler.compile(TRANSPOSE, "transpose")
    assert module.resources["transpose16"]["shared_bytes"] == TILE_SMEM_BYTES
    assert compiler.cache_key(TRANSPOSE) != NvrtcCompiler("sm_90").cache_key(TRANSPOSE)


def test_nvrtc_without_bundled_headers_refuses_bundled_mode(cache_dir, monkeypatch):
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (13, 0))
    with pytest.raises(NvrtcNotAvailable) as caught:
        NvrtcCompiler("sm_90", headers="bundled")
    assert isinstance(caught.value, NapkinError)
    assert "nvidia-cuda-nvrtc>=13.3" in str(caught.value)
    assert NvrtcCompiler("sm_90").header_mode == "toolkit"  # auto falls back


class _FakeNvrtc:
    """Stands in for cuda.bindings.nvrtc: an old library, or none at all."""

    class nvrtcResult:
        NVRTC_SUCCESS = 0

    def __init__(self, version=None):
        self.version = version

    def nvrtcVersion(self):
        if self.version is None:
            raise RuntimeError("Unable to load libnvrtc.so.13")
        return (0, *self.version)


@pytest.mark.parametrize("fake", [_FakeNvrtc(version=(11, 8)), _FakeNvrtc(version=None)], ids=["too-old", "missing"])
def test_missing_or_old_nvrtc_is_a_user_environment_error(monkeypatch, fake):
    monkeypatch.setattr(nvrtc, "_nvrtc_module", lambda: fake)
    with pytest.raises(NvrtcNotAvailable) as caught:
        nvrtc.nvrtc_version.__wrapped__()
    assert isinstance(caught.value, NapkinError)
    assert "nvidia-cuda-nvrtc>=13.3" in caught.value.render()


def test_unsupported_arch_is_refused_up_front(cache_dir):
    with pytest.raises(NvrtcNotAvailable, match="cannot compile for sm_35"):
        NvrtcCompiler("sm_35")
    with pytest.raises(ValueError):
        NvrtcCompiler("compute_90")
    with pytest.raises(ValueError):
        NvrtcCompiler("sm_90", options=["--gpu-architecture=sm_80"])


# ---- the driver layer --------------------------------------------------------------------------


@pytest.mark.skipif(driver.cuda_available(), reason="this machine has a CUDA GPU")
def test_without_gpu_cuda_is_unavailable_and_device_says_so():
    assert driver.cuda_available() is False
    with pytest.raises(driver.NoCudaDevice) as caught:
        driver.Device()
    assert isinstance(caught.value, NapkinError)
    assert caught.value.render().startswith("error: no CUDA GPU: ")
    assert "NumPy backend" in caught.value.render()


def test_check_names_the_failing_call():
    from cuda.bindings import driver as cuda_driver

    with pytest.raises(driver.CudaDriverError, match=r"^cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY"):
        driver.check((cuda_driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY,), "cuMemAlloc")
    assert driver.check((cuda_driver.CUresult.CUDA_SUCCESS, 7), "cuDeviceGetCount") == 7
    assert driver.check((cuda_driver.CUresult.CUDA_SUCCESS,), "cuCtxSynchronize") is None


def test_kernel_arguments_need_an_explicit_c_type():
    with pytest.raises(TypeError, match="argument 1 is a int"):
        driver._kernel_parameters([np.int32(3), 3])


@pytest.mark.gpu
@pytest.mark.skipif(not driver.cuda_available(), reason="no CUDA GPU")
def test_gpu_transpose_matches_numpy(cache_dir):
    import ctypes

    import ml_dtypes

    with driver.Device() as device:
        module = device.load(NvrtcCompiler(device.arch).compile(TRANSPOSE, "transpose"))
        kernel = module.function("transpose16")
        n = 48
        host = np.random.default_rng(0).standard_normal((n, n)).astype(ml_dtypes.bfloat16)
        source = device.to_device(host)
        result = device.alloc(n * n * 4)
        device.launch(kernel, grid=(n // 16, n // 16), block=(16, 16), args=[source, result, ctypes.c_int(n)])
        device.synchronize()
        out = device.copy_to_host(result, np.empty((n, n), np.float32))
    np.testing.assert_array_equal(out, host.astype(np.float32).T)
