"""The OpenCL printing of every example runs on an OpenCL device (PoCL in CI) and matches the reference."""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import opencl
from napkin_dsl.reference import evaluate
from napkin_dsl.types import numpy_dtype

from .conftest import EXAMPLES, assert_matches_reference
from .test_cuda_codegen import CASES, SIZES

# Small bindings for the CPU: the second case of each example has masked tails.
SMALL = {
    "attention.napkin": dict(b=1, h=2, q=200, x=150, d=32),
    "rmsnorm.napkin": dict(t=20, d=250),
    "softmax.napkin": dict(r=37, c=200),
    "gqa.napkin": dict(b=1, kv=2, r=2, q=130, x=70, d=32),
    "attention_unfused.napkin": dict(q=100, x=90, d=32),
    "paper/fig9.napkin": dict(q=40, x=64, d=16),
    "matmul.napkin": dict(m=300, n=200, k=100),
    "mlp.napkin": dict(b=100, k=48, n=130),
    "causal_attention.napkin": dict(b=1, h=2, q=200, x=150, d=32),
    "sliding_window.napkin": dict(b=1, h=1, q=330, x=400, d=32),
    "attention_lse.napkin": dict(b=1, h=2, q=200, x=150, d=32),
    "swiglu.napkin": dict(t=100, m=70, f=130, e=90),
    "decode.napkin": dict(b=1, kv=2, r=4, x=2500, d=48),  # a split: 3 parts of x, the last 452 long
    "splitk.napkin": dict(m=130, n=72, k=17000),  # split-K on the FMA path: 3 parts of k, the last short
    "fp8_attention.napkin": dict(b=1, h=2, qb=2, qi=64, x=99, d=32),  # fp8: a ragged last chunk of keys
    "fp8_attention_vt.napkin": dict(b=1, h=2, qb=2, qi=64, x=112, d=32),  # V[d x]: rows of 16-byte units
    "fp8_matmul.napkin": dict(m=150, n=131, k=99),  # every axis ragged
}
def random_inputs(diagram, sizes, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {}
    for name in diagram.params:
        if name in diagram.arrays:
            array = diagram.arrays[name]
            values = rng.standard_normal([sizes[a] for a in array.axes]) + 0.1
            arrays[name] = values.astype(numpy_dtype(array.dtype))
    scalars = {name: 1e-5 for name in diagram.scalars}
    return arrays, scalars


def run_on_pocl(source: str, name: str, paths: list[str] | None = None, arch: str | None = None, **sizes):
    """The one kernel of ``source`` on PoCL at ``sizes`` (each launch on ``paths``, where given),
    emulating the build for ``arch`` (default: the profile's own), held to the float64 reference
    within the Program's tolerance; the Program and its outputs."""
    from napkin_dsl import isel

    (kernel,) = napkin.load(source).values()
    program = kernel.gpu_program(None, **sizes)
    if paths is not None:
        assert [isel.selection(program, launch, arch).path for launch in program.launches] == paths
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(program, inputs, scalars, arch=arch)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), name)
    return program, outputs


@pytest.mark.parametrize("name", sorted(SMALL))
def test_opencl_matches_reference(name, opencl_device):
    (kernel,) = napkin.load(EXAMPLES / name).values()
    sizes = SMALL[name]
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    program = kernel.gpu_program(None, **sizes)
    outputs = opencl.run(program, inputs, scalars)
    expected = evaluate(kernel.diagram, inputs, scalars, sizes)
    assert_matches_reference(program, outputs, expected, name)


def test_inputs_are_not_modified(opencl_device):
    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    sizes = SMALL["attention.napkin"]
    inputs, scalars = random_inputs(kernel.diagram, sizes, seed=1)
    copies = {k: v.copy() for k, v in inputs.items()}
    opencl.run(kernel.gpu_program(None, **sizes), inputs, scalars)
    for key, value in inputs.items():
        assert np.array_equal(value.view(np.uint8), copies[key].view(np.uint8))


def test_cases_cover_every_example():
    assert set(SMALL) == {name for name, _ in CASES} == set(SIZES)


def test_an_optimized_build_runs_the_same_kernel_right(opencl_device, monkeypatch):
    """The suite builds unoptimized (tests/conftest.py); users build optimized by default. One
    emulated tensor-core kernel (mma.sync, ldmatrix, a cp.async ring) built both ways, each
    within the reference's tolerance, and the option is really passed to the build."""
    from napkin_dsl.isel import selection

    (kernel,) = napkin.load(EXAMPLES / "matmul.napkin").values()
    sizes = dict(m=64, n=32, k=64)
    program = kernel.gpu_program(None, **sizes)
    assert selection(program, program.launches[0], "sm_80").path == "mma.sync"
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    expected = evaluate(kernel.diagram, inputs, scalars, sizes)
    monkeypatch.delenv("NAPKIN_EMULATE_SEED", raising=False)
    for flag, options in (("1", ("-cl-std=CL1.2", "-DNK_ROLES_SEED=1")), ("0", ("-cl-std=CL1.2", "-cl-opt-disable", "-DNK_ROLES_SEED=1"))):
        monkeypatch.setenv("NAPKIN_OPENCL_OPTIMIZE", flag)
        assert opencl.build_options() == options
        assert_matches_reference(program, opencl.run(program, inputs, scalars, arch="sm_80"), expected,
                                 f"NAPKIN_OPENCL_OPTIMIZE={flag}")


def test_a_bad_optimize_setting_is_a_napkin_error(monkeypatch):
    from napkin_dsl.errors import NapkinError

    monkeypatch.setenv("NAPKIN_OPENCL_OPTIMIZE", "fast")
    with pytest.raises(NapkinError, match="NAPKIN_OPENCL_OPTIMIZE is 'fast'; it takes 0"):
        opencl.build_options()


def test_a_launch_over_the_devices_local_memory_is_a_napkin_error_before_it_runs():
    """oclgrind's device has 32 KiB of local memory, PoCL's megabytes: a launch whose arena does
    not fit is refused by name, not left to clEnqueueNDRangeKernel's OUT_OF_RESOURCES."""
    pytest.importorskip("pyopencl")
    from types import SimpleNamespace

    from napkin_dsl.backends.opencl import check_fits
    from napkin_dsl.errors import NapkinError

    class Kernel:
        def __init__(self, local, largest):
            self.info = {"LOCAL_MEM_SIZE": local, "WORK_GROUP_SIZE": largest}

        def get_work_group_info(self, what, device):
            import pyopencl as cl

            names = {cl.kernel_work_group_info.LOCAL_MEM_SIZE: "LOCAL_MEM_SIZE",
                     cl.kernel_work_group_info.WORK_GROUP_SIZE: "WORK_GROUP_SIZE"}
            return self.info[names[what]]

    device = SimpleNamespace(name="Small Device ", local_mem_size=32768)
    launch = SimpleNamespace(entry="napkin_k_0", block=256)
    check_fits(Kernel(32768, 256), launch, device)  # exactly full: runs
    with pytest.raises(NapkinError, match="needs 40,960 bytes of local memory; the OpenCL device 'Small Device' has 32,768"):
        check_fits(Kernel(40960, 256), launch, device)
    with pytest.raises(NapkinError, match="runs 256 work-items per group"):
        check_fits(Kernel(1024, 128), launch, device)


def test_gelu_keeps_its_digits_far_below_zero(opencl_device):
    """The generated kernels' gelu is x/2 erfc(-x/sqrt 2): near x = -12 it is -1e-24 to -1e-43
    in float, where x/2 (1 + erf(x/sqrt 2)) gave -0.0, as the reference and NumPy compute it."""
    kernel = napkin.load("kernel k(X: f32[i]) -> Y: f32[i]:\n    Y[i] = gelu(X - 12)\n")["k"]
    x = np.linspace(-2, 2, 8).astype(np.float32)
    got = np.asarray(kernel(x, backend="opencl"), dtype=np.float64)
    want = np.asarray(kernel(x, backend="numpy"), dtype=np.float64)
    normal = np.abs(want) > np.finfo(np.float32).tiny  # denormals: PoCL may flush them
    assert normal.sum() >= 4 and (got[normal] < 0).all()
    np.testing.assert_allclose(got[normal], want[normal], rtol=1e-4)
