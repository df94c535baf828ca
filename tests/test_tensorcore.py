"""The tensor-core path without a GPU: the emulated primitives, PoCL runs, oclgrind, SASS.

The OpenCL emulation of mma and ldmatrix is printed from ``napkin_dsl/layouts.py``; it is held
here against the PTX ISA's formulas as ``tests/test_layouts.py`` writes them out, independently
of that module. The layouts themselves, the swizzle and bank conflicts are tested there.

These are mma.sync's tests: the H100 programs here are selected, printed and run for ``ARCH``
(sm_90), since the H100 profile's own arch, sm_90a, builds wgmma (tests/test_wgmma*.py).
"""

from __future__ import annotations

import re
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import napkin_dsl as napkin
from napkin_dsl import isel
from napkin_dsl.paths.plan import live_fragment_values
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES, assert_matches_reference

ARCH = "sm_90"  # mma.sync on an H100 (its profile's default, sm_90a, is wgmma's)
from .test_layouts import isa_a as ptx_a
from .test_layouts import isa_b as ptx_b
from .test_layouts import isa_c as ptx_c
from .test_opencl import random_inputs

# ---- the emulated primitives on PoCL against NumPy ---------------------------------------------

EMULATION_KERNEL = """
__kernel __attribute__((reqd_work_group_size(32, 1, 1)))
void mma_test(__global const uint* a, __global const uint* b, __global float* c, __global const int* rows,
              __global const ushort* tile, __global uint* loaded) {
    __local uchar nk_smem[4096] __attribute__((aligned(16)));
    __local uint scratch[NK_WS];
    __local uint* nk_ws = scratch;
    const int nk_lane = get_local_id(0);
    uint af[4], bf[2], lf[4], tf[4];
    float cf[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int j = 0; j < 4; ++j) af[j] = a[4 * nk_lane + j];
    for (int j = 0; j < 2; ++j) bf[j] = b[2 * nk_lane + j];
    NK_MMA_BF16(cf, af, bf[0], bf[1]);
    for (int i = 0; i < 4; ++i) c[4 * nk_lane + i] = cf[i];
    for (int u = nk_lane; u < 2048; u += 32) ((__local ushort*)nk_smem)[u] = tile[u];
    barrier(CLK_LOCAL_MEM_FENCE);
    NK_LDSM(lf, rows[nk_lane] * 64);
    NK_LDSM_T(tf, rows[nk_lane] * 64);
    for (int j = 0; j < 4; ++j) { loaded[8 * nk_lane + j] = lf[j]; loaded[8 * nk_lane + 4 + j] = tf[j]; }
}
"""


def bf16_bits(values):
    import ml_dtypes

    return np.asarray(values, dtype=ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)


def test_emulated_mma_and_ldmatrix_match_numpy(opencl_device):
    import ml_dtypes
    import pyopencl as cl

    from napkin_dsl.backends.lowering import OpenCLDialect
    from napkin_dsl.backends.tensorcore import OPENCL_PRELUDE

    rng = np.random.default_rng(3)
    A = rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)
    B = rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16)
    a = np.zeros((32, 4), np.uint32)
    b = np.zeros((32, 2), np.uint32)
    for lane in range(32):
        for i in range(8):
            a[lane, i // 2] |= bf16_bits(A[ptx_a(lane, i)]) << (16 * (i % 2))
        for i in range(4):
            b[lane, i // 2] |= bf16_bits(B[ptx_b(lane, i)]) << (16 * (i % 2))
    tile = rng.integers(0, 65535, size=(64, 32), dtype=np.uint16)  # 64 rows of 64 bytes, unswizzled
    rows = rng.permutation(64)[:32].astype(np.int32)  # each lane names the row it supplies
    ctx, queue = opencl_device
    program = cl.Program(ctx, OpenCLDialect.prelude + OPENCL_PRELUDE + EMULATION_KERNEL).build()
    flags = cl.mem_flags
    buffers = [cl.Buffer(ctx, flags.READ_ONLY | flags.COPY_HOST_PTR, hostbuf=x) for x in (a, b)]
    c = np.zeros((32, 4), np.float32)
    loaded = np.zeros((32, 8), np.uint32)
    out_c = cl.Buffer(ctx, flags.WRITE_ONLY, c.nbytes)
    extra = [cl.Buffer(ctx, flags.READ_ONLY | flags.COPY_HOST_PTR, hostbuf=x) for x in (rows, tile)]
    out_l = cl.Buffer(ctx, flags.WRITE_ONLY, loaded.nbytes)
    program.mma_test(queue, (32,), (32,), *buffers, out_c, *extra, out_l)
    cl.enqueue_copy(queue, c, out_c)
    cl.enqueue_copy(queue, loaded, out_l)
    product = A.astype(np.float32) @ B.astype(np.float32)
    for lane in range(32):
        for i in range(4):
            assert c[lane, i] == pytest.approx(product[ptx_c(lane, i)], rel=1e-5, abs=1e-5)
    for lane in range(32):
        for j in range(4):
            source = [rows[8 * j + r] for r in range(8)]  # matrix j: row r from lane 8j + r
            lo, hi = (tile[source[lane // 4], 2 * (lane % 4) + h] for h in range(2))
            assert loaded[lane, j] == lo | (hi.astype(np.uint32) << 16)
            lo, hi = (tile[source[2 * (lane % 4) + h], lane // 4] for h in range(2))  # .trans
            assert loaded[lane, 4 + j] == lo | (hi.astype(np.uint32) << 16)


# ---- whole kernels through the tensor-core path on PoCL -----------------------------------------

TENSOR_CASES = {
    "attention.napkin": [dict(b=1, h=2, q=200, x=150, d=32), dict(b=1, h=1, q=128, x=128, d=64)],
    "gqa.napkin": [dict(b=1, kv=2, r=2, q=130, x=70, d=32)],
    "matmul.napkin": [dict(m=300, n=200, k=104), dict(m=256, n=256, k=128)],
    "mlp.napkin": [dict(b=256, k=48, n=136)],
    # masked streams: full chunks in their own loop, the diagonal and the window's edge masked
    "causal_attention.napkin": [dict(b=1, h=1, q=200, x=150, d=32)],
    "sliding_window.napkin": [dict(b=1, h=1, q=330, x=400, d=32)],
    "attention_lse.napkin": [dict(b=1, h=1, q=130, x=150, d=32)],
}


def tensor_kernel(name):
    (kernel,) = napkin.load(EXAMPLES / name).values()
    return kernel


@pytest.mark.parametrize("name, sizes", [(n, s) for n, ss in TENSOR_CASES.items() for s in ss],
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{x}" for k, x in v.items()))
def test_tensor_core_kernels_match_the_reference_on_pocl(name, sizes, opencl_device):
    from napkin_dsl.backends import opencl

    kernel = tensor_kernel(name)
    program = kernel.gpu_program(None, **sizes)
    assert [isel.selection(program, launch, ARCH).path for launch in program.launches] == ["mma.sync"]
    source, _ = opencl.generate(program, arch=ARCH)
    assert "NK_MMA_" in source and "NK_LDSM" in source and "NK_CP16" in source
    # the epilogue: staged in shared memory, 16-byte stores (matmul's f32 C tile, over the arena,
    # a fragment row of every warp row at a time)
    assert "NK_ST16(g_" in source
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(program, inputs, scalars, arch=ARCH)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), name)


def test_the_softmax_folds_its_scale_and_reduces_its_sum_once():
    """FlashAttention-2's loop: d^-0.5 and log2(e) in the one FFMA of each exp2 argument, the
    rescale on ex2.approx with -inf tested once per row, the running sum per thread with the
    quad's shuffles after the stream, one reciprocal per row in the epilogue."""
    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    source = kernel.compile("sm_90", b=1, h=2, q=256, x=256, d=64).source
    loop = source[source.index("for (int c_x"):source.index("// O = O.acc / P.sum")]
    scale_log2 = 64 ** -0.5 * 1.4426950408889634
    assert f"* {scale_log2!r}f - top)" in loop and "*= 0.125f" not in loop
    assert not re.search(r"(?<![\w])expf\(", source) and "nk_exp2(old - top)" in loop  # no precise expf (the fast prelude's __expf is not one)
    assert loop.count("== -NK_INF") == 2  # one test per row and chunk: one in each of the two unrolled chunk bodies
    assert "NK_SHFL_XOR(part" not in loop and "NK_SHFL_XOR(f_P__sum" in source
    epilogue = source[source.index("// O = O.acc / P.sum"):]
    assert "1.0f / f_P__sum" in epilogue and "/ f_P__sum[mt][i" not in epilogue


def test_fully_masked_rows_are_zero_on_tensor_cores(opencl_device):
    """Rows whose every key is masked (x >= q + 100 leaves queries 50 and on with none): -inf max
    through the rescale and the exponent, a zero sum, and 0 out, as in the reference; the stream
    starts past the first chunk for the early rows (the masked loop before the full ones)."""
    from napkin_dsl.backends import opencl

    (kernel,) = napkin.load("""
kernel late(Q: bf16[h q d], K: bf16[h x d], V: bf16[h x d]) -> O: bf16[h q d]:
    S[h q x] = Q * K * d^-0.5
    P[h q x] = softmax[x](where(x >= q + 100, S, -inf))
    O[h q d] = P * V

relabel late on H100:
    smem: group h 1, q 32; stream x 16
""").values()
    sizes = dict(h=1, q=96, x=150, d=32)
    program = kernel.gpu_program(None, **sizes)
    assert [isel.selection(program, launch, ARCH).path for launch in program.launches] == ["mma.sync"]
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(program, inputs, scalars, arch=ARCH)
    assert not np.isnan(outputs["O"]).any() and np.all(outputs["O"][:, 50:] == 0)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), "late")


ATTENTION = """
kernel attn(Q: {dt}[h q d], K: {dt}[h x d], V: {dt}[h x d]) -> O: {dt}[h q d]:
    S[h q x] = Q * K * d^-0.5
    P[h q x] = softmax[x](S)
    O[h q d] = P * V

relabel attn on H100:
    smem: group h 1, q {gq}; stream x {sx}
    registers: group q {wq}
"""


@settings(max_examples=6, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    q=st.integers(1, 150), x=st.integers(1, 150), d=st.sampled_from([16, 32, 64]),
    gq=st.sampled_from([16, 32, 64]), sx=st.sampled_from([16, 32, 64]), warps=st.sampled_from([1, 2]),
    dt=st.sampled_from(["bf16", "f16"]),
)
def test_random_attention_relabellings_on_tensor_cores(q, x, d, gq, sx, warps, dt, opencl_device):
    from napkin_dsl.backends import opencl

    wq = max(16, gq // warps)
    (kernel,) = napkin.load(ATTENTION.format(dt=dt, gq=gq, sx=sx, wq=wq)).values()
    sizes = dict(h=2, q=q, x=x, d=d)
    program = kernel.gpu_program(None, **sizes)
    chosen = isel.selection(program, program.launches[0], ARCH)
    if min(q, gq) % 16 or min(x, sx) % 16:  # a tile clipped to a size that is not a fragment multiple
        assert chosen.path == "fma"
    elif chosen.path == "fma":  # tall warp tiles over wide chunks, or a clipped tile they do not divide
        assert "budget" in chosen.reason or "do not split" in chosen.reason, chosen.reason
    else:
        assert chosen.plan.warp_rows == min(wq, chosen.plan.row_tile)
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(program, inputs, scalars, arch=ARCH)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), "attn")


def test_a_copy_with_more_threads_than_tile_units_writes_nothing_past_the_tile(opencl_device):
    """Found by the property test above: two warps copying a 16 x 16 K chunk (32 units) once
    zero-filled rows 16..31, which are the next stage's bytes."""
    from napkin_dsl.backends import opencl

    (kernel,) = napkin.load(ATTENTION.format(dt="bf16", gq=32, sx=16, wq=16)).values()
    sizes = dict(h=2, q=32, x=32, d=16)
    program = kernel.gpu_program(None, **sizes)
    assert isel.selection(program, program.launches[0], ARCH).plan.warps == 2
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(program, inputs, scalars, arch=ARCH)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), "attn")


@pytest.mark.parametrize("clause, grid", [("", (2, 2)), ("    registers: group m 32, n 64\n", (4, 2)),
                                          ("    registers: group m 64, n 32\n", (2, 4))])
def test_matmul_runs_on_a_two_dimensional_warp_grid(clause, grid, opencl_device):
    """Without a row reduction warps split the columns too; the relabel block may choose the grid."""
    from napkin_dsl.backends import opencl

    source = (EXAMPLES / "matmul.napkin").read_text() + clause
    (kernel,) = napkin.load(source).values()
    sizes = dict(m=200, n=136, k=48)
    program = kernel.gpu_program(None, **sizes)
    plan = isel.selection(program, program.launches[0], ARCH).plan
    assert (plan.split, (plan.row_warps, plan.col_warps)) == ("n", grid)
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(program, inputs, scalars, arch=ARCH)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), "matmul")


def test_a_warp_tile_on_an_axis_warps_cannot_split_is_refused():
    source = (EXAMPLES / "attention.napkin").read_text() + "    registers: group q 16, h 1\n"
    (kernel,) = napkin.load(source).values()
    program = kernel.gpu_program(None, b=1, h=1, q=128, x=128, d=64)
    chosen = isel.selection(program, program.launches[0])
    assert chosen.path == "fma" and chosen.reason.startswith("warp tiles split q here, not h")


def test_fma_path_is_kept_with_a_reason():
    (kernel,) = napkin.load(EXAMPLES / "softmax.napkin").values()
    program = kernel.gpu_program(None, r=64, c=64)
    assert isel.selection(program, program.launches[0]).reason == "no contraction"
    (kernel,) = napkin.load(EXAMPLES / "matmul.napkin").values()
    program = kernel.gpu_program(None, m=256, n=256, k=100)  # A's rows are 200 bytes
    assert "cp.async copies 16-byte units" in isel.selection(program, program.launches[0]).reason
    assert "has no mma.sync m16n8k16 on sm_75" in isel.selection(program, program.launches[0], "sm_75").reason


def test_a_row_reduction_of_a_shared_tile_alone_keeps_the_fma_path():
    """The tensor-core path reduces rows of register fragments (quad shuffles); S[m] = sum[k](A)
    beside C = A B reduces an operand tile no fragment holds. Selection keeps the launch on FMA
    and says why, and it compiles (the printer once raised a LoweringError here)."""
    text = ("kernel k(A: bf16[m k], B: bf16[k n]) -> (C: f32[m n], S: f32[m]):\n"
            "    C[m n] = A * B\n    S[m] = sum[k](A)\n\nrelabel k on H100:\n    smem: group m 64, n 64\n")
    (kernel,) = napkin.load(text).values()
    program = kernel.gpu_program(None, m=128, n=128, k=64)
    assert isel.selection(program, program.launches[0]).reason == (
        "S reduces A, which holds no fragment: the tensor-core path reduces rows of one fragment's columns")
    assert [launch.path for launch in kernel.compile("sm_90", "H100", m=128, n=128, k=64).launches] == ["fma"]


# ---- oclgrind: races and out-of-bounds accesses of the emulated kernels -------------------------

OCLGRIND_CASES = [("examples/attention.napkin", ["b=1", "h=1", "q=32", "x=80", "d=16"]),
                  ("examples/matmul.napkin", ["m=48", "n=32", "k=48"]),
                  # fp8 on m16n8k32: ldmatrix A, B gathered by byte loads
                  ("examples/fp8_matmul.napkin", ["m=48", "n=32", "k=64"])]


def oclgrind(example: str, sizes: list, *extra: str):
    import os
    import shutil
    import subprocess

    if shutil.which("oclgrind") is None:
        if os.environ.get("NAPKIN_REQUIRE_OPENCL"):
            pytest.fail("no oclgrind, and NAPKIN_REQUIRE_OPENCL is set (CI installs it)")
        pytest.skip("no oclgrind (apt-get install oclgrind)")
    root = EXAMPLES.parent
    # optimized: oclgrind interprets the kernel's LLVM IR, and the suite's PoCL runs build
    # unoptimized (tests/conftest.py); sm_90a attention's ragged two-warpgroup case took 33 s
    # under oclgrind at -cl-opt-disable and 12 s optimized. Optimized is also what users run.
    env = dict(os.environ, PYTHONPATH=str(root), NAPKIN_OPENCL_OPTIMIZE="1")
    return subprocess.run(["oclgrind", "--data-races", "python", "-m", "tests.oclgrind_case", example, *sizes, *extra],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("example, sizes", OCLGRIND_CASES, ids=["attention", "matmul", "fp8_matmul"])
def test_oclgrind_finds_no_race_or_bad_access_on_the_tensor_core_path(example, sizes):
    result = oclgrind(example, sizes, "--arch", ARCH)
    assert result.returncode == 0, result.stderr[-2000:]
    report = result.stdout + result.stderr
    assert "data race" not in report and "Invalid" not in report and "error" in report, report[-2000:]
    errors = [float(line.split()[-1]) for line in result.stdout.splitlines() if " error " in line]
    assert errors and max(errors) < 0.02, result.stdout


def test_oclgrind_reports_the_race_a_missing_barrier_leaves():
    """The control: without the barrier between the epilogue's shared writes and reads, warps
    read units other warps have not written yet, and oclgrind says so."""
    result = oclgrind(*OCLGRIND_CASES[0], "--drop-staging-barrier", "--arch", ARCH)
    assert "Read-write data race at local memory" in result.stdout + result.stderr


# ---- the model reads the same plan ------------------------------------------------------------


def test_smem_of_a_tensor_core_launch_is_its_operand_tiles_and_stages():
    kernel = tensor_kernel("attention.napkin")
    report = kernel.cost(None, arch=ARCH, b=1, h=1, q=1024, x=1024, d=128)
    # Q 128x128 once, K and V 64x128 twice each (two stages), bf16: S, P and O live in registers.
    assert report.levels["smem"].M_bytes == (128 * 128 + 2 * 2 * 64 * 128) * 2
    registers = report.levels["registers"]
    # A thread of a 32-row warp (4 warps, the rolled budget on sm_90): O.acc 32x128 (128 values),
    # S 32x64 (64), max/sum/scale (4 each).
    assert registers.M == 128 + 64 + 12 == isel.ROLLED_FRAGMENT_BUDGET
    assert registers.M_bytes <= registers.capacity


# ---- SASS: the instructions are really there ----------------------------------------------------

SASS_SIZES = {
    "attention.napkin": dict(b=1, h=2, q=1024, x=1024, d=128),
    "gqa.napkin": dict(b=1, kv=2, r=2, q=512, x=512, d=128),
    "matmul.napkin": dict(m=1024, n=1024, k=1024),
    "mlp.napkin": dict(b=512, k=768, n=1024),
}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", sorted(SASS_SIZES))
def test_hot_loops_run_hmma_ldsm_and_ldgsts_without_local_memory(name, arch):
    from napkin_dsl.backends import sass

    try:
        sass.find_nvdisasm()
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm (pip install 'napkin-dsl[sass]')")
    compiled = tensor_kernel(name).compile(arch, **SASS_SIZES[name])
    (entry,) = sass.sass_report(compiled)["launches"]
    assert entry["spill_bytes"] == 0
    assert entry["whole"].get("local", 0) == 0, entry["whole"]
    loop = sass.hot_loop(entry)
    assert loop is not None
    for kind in ("tensor", "ldsm", "ldgsts"):
        assert loop["classes"].get(kind, 0) > 0, (kind, loop["classes"])


FMA_CASES = [("softmax.napkin", dict(r=37, c=200)), ("rmsnorm.napkin", dict(t=20, d=250)),
             ("attention_unfused.napkin", dict(q=512, x=512, d=64)), ("attention_unfused.napkin", dict(q=100, x=90, d=32)),
             ("paper/fig9.napkin", dict(q=40, x=64, d=16)), ("matmul.napkin", dict(m=300, n=200, k=100))]


@pytest.mark.parametrize("name, sizes", FMA_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(FMA_CASES)])
def test_fma_path_keeps_staged_results_in_registers_not_local_memory(name, sizes):
    """Results that wait for every thread to finish reading (a hazard in the arena) are indexed
    by their loops' trip numbers, so ptxas keeps them in registers (once 46 LDL/STL in
    attention_unfused's softmax launch)."""
    from napkin_dsl.backends import sass

    try:
        sass.find_nvdisasm()
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm (pip install 'napkin-dsl[sass]')")
    compiled = tensor_kernel(name).compile("sm_90", **sizes)
    for entry in sass.sass_report(compiled)["launches"]:
        assert entry["whole"].get("local", 0) == 0, (entry["entry"], entry["whole"])


# ---- occupancy --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["attention.napkin", "matmul.napkin", "mlp.napkin", "softmax.napkin", "gqa.napkin",
                                  "attention_unfused.napkin", "rmsnorm.napkin"])
def test_blocks_per_sm_are_the_limit_of_ptxas_registers_threads_and_shared_memory(name):
    """The compiled kernel's report counts ptxas's registers: per SM 64K registers allocated per
    warp in units of 256, 2048 threads, 32 blocks, the profile's shared memory per block."""
    from .test_cuda_codegen import SIZES

    compiled = tensor_kernel(name).compile("sm_90", **SIZES[name][0])
    smem_capacity = compiled.program.hardware.level("smem").capacity
    expected = []
    for row in compiled.launch_table():
        threads, registers = row["block"][0], row["registers"]
        per_warp = -(-registers * 32 // 256) * 256
        expected.append(min(smem_capacity // row["shared_bytes"], 2048 // threads,
                            65536 // (per_warp * (threads // 32)), 32))
    assert compiled.cost.time["blocks_per_sm"] == min(expected)


# ---- the cp.async pipeline's stage count -----------------------------------------------------


@pytest.mark.parametrize("arch, hardware", [("sm_80", "A100"), ("sm_90", "H100")])
def test_selection_stages_a_short_chunk_three_deep_and_a_long_one_two_deep(arch, hardware):
    """matmul's 128 x 128 x 32 chunk is 512 clocks of mma.sync on an SM, under a copy's
    latency (isel.copy_latency: the profile's [latency] copy): 3 stages, 2 chunks in flight; attention's d = 128 chunk
    (two 128 x 64 x 128 products, 2048 clocks) covers it alone: 2. The arena and the model's
    shared-memory M count every stage."""
    matmul = tensor_kernel("matmul.napkin").gpu_program(hardware, m=8192, n=8192, k=8192)
    chosen = isel.select_program(matmul, arch)[0]
    assert chosen.plan.stages == 3
    # A 128 x 32 and B 32 x 128, bf16, each three deep
    assert chosen.slots["A"].stages == chosen.slots["B"].stages == 3
    assert chosen.smem_bytes == 3 * (128 * 32 + 32 * 128) * 2
    from napkin_dsl.cost import cost_of
    assert cost_of(matmul, arch=arch, selected=isel.select_program(matmul, arch)).levels["smem"].M_bytes == chosen.smem_bytes
    attention = tensor_kernel("attention.napkin").gpu_program(hardware, b=4, h=32, q=8192, x=8192, d=128)
    assert isel.select_program(attention, arch)[0].plan.stages == 2


def test_the_stage_count_asked_for_is_the_plans_and_never_under_two():
    program = tensor_kernel("matmul.napkin").gpu_program("H100", m=1024, n=1024, k=1024)
    launch = program.launches[0]
    chosen = isel.select_program(program)[0]
    for asked in (2, 3, 5):
        assert isel.stage_count(chosen.plan, launch, chosen.tile, program.diagram, "sm_90", asked) == asked
    with pytest.raises(ValueError, match="at least 2"):
        isel.stage_count(chosen.plan, launch, chosen.tile, program.diagram, "sm_90", 1)


def test_more_stages_are_not_taken_where_they_lower_the_blocks_an_sm_holds():
    """64 x 64 x 32 chunks (128 clocks) would take isel.MAX_STAGES; each stage the arena gains is
    checked against the blocks per SM two stages allow (pseudocode.blocks_per_unit)."""
    from napkin_dsl.pseudocode import blocks_per_unit

    source = (EXAMPLES / "matmul.napkin").read_text().replace("group m 128, n 128; stream k 32", "group m 64, n 64; stream k 32")
    (kernel,) = napkin.load(source).values()
    program = kernel.gpu_program("A100", m=4096, n=4096, k=4096)
    launch = program.launches[0]
    chosen = isel.select_program(program, "sm_80")[0]
    plan = chosen.plan
    registers = isel.estimated_registers(plan, launch, chosen.tile)

    def blocks(stages):
        arena = isel.smem_layout(isel.replace(plan, stages=stages), chosen.tile, program.diagram)[1]
        return blocks_per_unit(launch.schedule, arena, plan.threads, registers)[0]

    assert 3 <= plan.stages <= isel.MAX_STAGES
    assert blocks(plan.stages) >= blocks(2)
    assert plan.stages == isel.MAX_STAGES or blocks(plan.stages + 1) < blocks(2)


@pytest.mark.parametrize("sizes", [dict(m=200, n=136, k=40), dict(m=130, n=144, k=32), dict(m=130, n=136, k=136)],
                         ids=["k2chunks", "k1chunk", "k5chunks"])
def test_a_three_stage_stream_matches_the_reference_with_ragged_and_few_chunks(sizes, opencl_device):
    """Fewer chunks than stages (the prologue's copies past the last chunk are never issued),
    and more, the stages not dividing them (the chunks after the whole groups), at ragged m, n
    and k, on PoCL against the float64 reference. The refill of chunk c + 2 goes to the buffer
    chunk c - 1 read: into any other, the emulation's synchronous copy overwrites a chunk still
    to be read."""
    from .test_opencl import run_on_pocl

    program, _ = run_on_pocl((EXAMPLES / "matmul.napkin").read_text(), "matmul", ["mma.sync"], arch=ARCH, **sizes)
    assert isel.select_program(program, ARCH)[0].plan.stages == 3


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_hot_loop_waits_for_its_own_chunk_and_no_later_one(arch):
    """cp.async.wait_group N lets N groups stay pending; chunk c's wait, with stages - 1 chunks
    committed ahead of it, must leave at most stages - 2 (its own group has landed), and the
    pipeline is shallower than its stages with fewer. The SASS of the hot loop (DEPBAR.LE SB0,
    N) is what the GPU waits on; the arena ptxas reports is the plan's."""
    from napkin_dsl.backends import sass

    try:
        sass.find_nvdisasm()
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm (pip install 'napkin-dsl[sass]')")
    kernel = tensor_kernel("matmul.napkin")
    compiled = kernel.compile(arch, {"sm_80": "A100", "sm_90": "H100"}[arch], m=1024, n=1024, k=1024)
    chosen = isel.select_program(compiled.program, arch)[0]
    assert chosen.plan.stages == 3
    (row,) = compiled.launch_table()
    assert row["shared_bytes"] == chosen.smem_bytes and row["stages"] == 3
    assert compiled.cost.levels["smem"].M_bytes == chosen.smem_bytes
    functions = sass.disassemble(compiled.image)
    (body,) = [b for b in sass.innermost_loops(functions[row["entry"]]) if any(sass.tensor_work(i.opcode) for i in b)]
    waits = [str(i) for i in body if i.opcode.startswith("DEPBAR")]
    assert len(waits) == 3 and all(w.rstrip(";").endswith(f"0x{chosen.plan.stages - 2:x}") for w in waits), waits


# ---- the epilogue's 16-byte stores ------------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_an_output_tile_over_the_arena_is_stored_16_bytes_a_thread_in_passes(arch):
    """matmul's f32 C (128 x 128, 64 KiB) is over its 48 KiB arena: each fragment row of the
    warps goes through a 32 x 128 shared tile in turn, and leaves by STG.E.128 alone, no
    scalar store (the fragments' pairs at stride 2 used half of each sector)."""
    from napkin_dsl.backends import sass

    try:
        sass.find_nvdisasm()
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm (pip install 'napkin-dsl[sass]')")
    compiled = tensor_kernel("matmul.napkin").compile(arch, {"sm_80": "A100", "sm_90": "H100"}[arch], m=1024, n=1024, k=1024)
    assert "staged 32 rows at a time" in compiled.source and "NK_ST16(g_C" in compiled.source
    (instructions,) = sass.disassemble(compiled.image).values()
    stores = [i.opcode for i in instructions if i.opcode.startswith("STG")]
    assert stores and set(stores) == {"STG.E.128"}, sorted(set(stores))
    assert sum(op.startswith("STS") for op in (i.opcode for i in instructions)) > 0


@pytest.mark.parametrize("sizes", [dict(m=300, n=200, k=64), dict(m=72 + 128, n=136, k=96)], ids=["ragged-mn", "ragged-m-n8"])
def test_the_staged_passes_store_ragged_tails_masked(sizes, opencl_device):
    """The passes' rows past m and units past n are not stored; the rest match float64 on PoCL."""
    from .test_opencl import run_on_pocl

    program, outputs = run_on_pocl((EXAMPLES / "matmul.napkin").read_text(), "matmul", ["mma.sync"], arch=ARCH, **sizes)
    from napkin_dsl.backends import opencl
    assert "staged 32 rows at a time" in opencl.generate(program, arch=ARCH)[0]
    assert outputs["C"].shape == (sizes["m"], sizes["n"])


# ---- 32-row warps at d = 128 (issue 22): FA2's 4 warps of 32 query rows, the loop rolled ---------

TALL = {"attention.napkin": dict(b=4, h=32, q=8192, x=8192, d=128),
        "gqa.napkin": dict(b=4, kv=8, r=4, q=8192, x=8192, d=128)}


@pytest.mark.parametrize("name", sorted(TALL))
def test_d128_attention_takes_four_warps_of_32_rows_on_sm80_and_sm90_and_keeps_16_elsewhere(name):
    """At d = 128 and chunks of 64 keys a 32-row warp holds 204 fragment registers: over
    FRAGMENT_BUDGET, within the rolled budget, which sm_80 and sm_90 (255 registers a thread
    both) take for a stream of products and softmaxes: causal and sliding-window attention too,
    where the chunks divide the keys (a ragged masked stream spills at 32 rows and keeps 16), and
    attention_lse (a further output) keeps 8 warps of 16 rows."""
    program = tensor_kernel(name).gpu_program(None, **TALL[name])
    (launch,) = program.launches
    for arch in ("sm_90", "sm_80"):
        plan = isel.selection(program, launch, arch).plan
        assert (plan.warps, plan.warp_rows, plan.rolled) == (4, 32, True), arch
        assert live_fragment_values(plan, launch, isel.launch_tiles(launch)[0]) == isel.ROLLED_FRAGMENT_BUDGET
    kept = tensor_kernel("attention_lse.napkin").gpu_program(None, **TALL["attention.napkin"])
    assert isel.selection(kept, kept.launches[0], "sm_90").plan.warp_rows == 16
    for masked in ("causal_attention.napkin", "sliding_window.napkin"):
        program = tensor_kernel(masked).gpu_program(None, **TALL["attention.napkin"])
        for arch in ("sm_90", "sm_80"):
            assert isel.selection(program, program.launches[0], arch).plan.warp_rows == 32, (masked, arch)
        ragged = tensor_kernel(masked).gpu_program(None, **dict(TALL["attention.napkin"], x=8100))
        assert isel.selection(ragged, ragged.launches[0], "sm_90").plan.warp_rows == 16, masked


@pytest.mark.parametrize("name", sorted(TALL))
@pytest.mark.parametrize("arch, hardware", [("sm_90", "H100"), ("sm_80", "A100")])
def test_d128_hot_loop_reads_at_most_035_ldsm_per_hmma_without_spills(name, arch, hardware):
    """The point of taller warps: each warp reads every K and V chunk by ldmatrix once for 32 rows,
    so the hot loop has 80 LDSM per 256 HMMA (was 144 with 16-row warps) and its static ceiling is
    tensor-bound, not shared-bound; 0 spill bytes and no local memory, on H100 and on A100."""
    from napkin_dsl.backends import sass

    try:
        sass.find_nvdisasm()
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm (pip install 'napkin-dsl[sass]')")
    compiled = tensor_kernel(name).compile(arch, hardware, **TALL[name])
    (entry,) = sass.sass_report(compiled)["launches"]
    assert entry["spill_bytes"] == 0 and entry["whole"].get("local", 0) == 0, entry["whole"]
    loop = sass.hot_loop(entry)
    assert loop["classes"].get("ldsm", 0) <= 0.35 * loop["classes"]["tensor"], loop["classes"]
    assert entry["ceiling"]["binding"] == "tensor", entry["ceiling"]["loop"]["clocks"]


@pytest.mark.parametrize("name", ["causal_attention.napkin", "sliding_window.napkin"])
@pytest.mark.parametrize("arch, hardware", [("sm_90", "H100"), ("sm_80", "A100")])
def test_masked_d128_takes_32_row_warps_its_full_loop_within_5_percent_of_attentions(name, arch, hardware):
    """A masked chunk tests the mask once, on S in place, from one value a lane holds per
    inequality (mask_in_place), and each chunk's buffer follows from its index (no running
    counter); causal attention (x <= q, no lower edge) prints no loop of chunks before the full
    ones. That leaves room for FA2's 4 warps of 32 rows: 0 spill bytes, at most 0.35 LDSM per
    HMMA in every tensor loop, and the loop over the full chunks (the leanest: no selects; it
    runs for all but the diagonal's chunks) within 5% of attention's hot loop in instructions
    per HMMA, on H100 and on A100."""
    from napkin_dsl.backends import sass

    try:
        sass.find_nvdisasm()
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm (pip install 'napkin-dsl[sass]')")
    sizes = TALL["attention.napkin"]
    kernel = tensor_kernel(name)
    program = kernel.gpu_program(None, **sizes)
    assert isel.selection(program, program.launches[0], arch).plan.warp_rows == 32
    compiled = kernel.compile(arch, hardware, **sizes)
    before = "before the ones the mask holds in full" in compiled.source
    assert before == (name == "sliding_window.napkin")
    assert compiled.source.count("the chunk's mask, once") == 1 + before
    (entry,) = sass.sass_report(compiled)["launches"]
    assert entry["spill_bytes"] == 0 and entry["whole"].get("local", 0) == 0, entry["whole"]
    loops = [loop for loop in entry["loops"] if loop["classes"].get("tensor", 0) == 256]
    assert len(loops) == 2 + before, [loop["classes"] for loop in entry["loops"]]
    assert all(loop["classes"].get("ldsm", 0) <= 0.35 * 256 for loop in loops)
    full = min(loops, key=lambda loop: loop["instructions"])
    (attention,) = sass.sass_report(tensor_kernel("attention.napkin").compile(arch, hardware, **sizes))["launches"]
    assert full["per_tensor"] <= 1.05 * sass.hot_loop(attention)["per_tensor"], (full["per_tensor"], attention)


def test_a_launch_ptxas_spills_at_255_registers_is_compiled_again_under_a_cap_and_only_then():
    """32-row warps at d = 128 are on a knife edge of ptxas's schedule (gqa at q = x = 512 on sm_80
    has spilled at __launch_bounds__(128, 1)): a spilling launch is compiled again under
    __maxnreg__ (cuda.REGISTER_CAPS) until it does not spill. Every launch built keeps 0 spills,
    and one that carries a cap spills without it."""
    from napkin_dsl.backends.cuda import REGISTER_CAPS, _compiler

    compiled = tensor_kernel("gqa.napkin").compile("sm_80", "H100", b=1, kv=2, r=4, q=512, x=512, d=128)
    (row,) = compiled.launch_table()
    assert row["spill_bytes"] == 0 and row["registers"] <= 255
    caps = re.findall(r"__maxnreg__\((\d+)\)", compiled.source)
    assert all(int(cap) in REGISTER_CAPS for cap in caps)
    if caps:  # the cap was needed: the launch bounds alone spill
        bounded = re.sub(r"__maxnreg__\(\d+\)", "__launch_bounds__(128, 1)", compiled.source)
        module = _compiler("sm_80", False).compile(bounded, "napkin_gqa.cu")
        assert module.resources[row["entry"]]["spill_bytes"] > 0
        assert row["registers"] <= int(caps[0])


@pytest.mark.parametrize("name, sizes", [("attention.napkin", dict(b=1, h=2, q=200, x=150, d=128)),
                                         ("attention.napkin", dict(b=1, h=1, q=128, x=64, d=128)),
                                         ("gqa.napkin", dict(b=1, kv=1, r=2, q=130, x=200, d=128)),
                                         ("causal_attention.napkin", dict(b=1, h=2, q=200, x=192, d=128)),
                                         ("causal_attention.napkin", dict(b=1, h=1, q=130, x=256, d=128)),
                                         ("sliding_window.napkin", dict(b=1, h=1, q=330, x=448, d=128))],
                         ids=["attention-ragged", "attention-one-chunk", "gqa-ragged", "causal-ragged-q",
                              "causal-wide", "window-ragged-q"])
def test_32_row_warps_match_the_reference_on_pocl(name, sizes, opencl_device):
    """The rolled loop (each chunk's buffer from its index), P packed from its exponentials and
    its row sum of the packed values, on 4 warps of 32 rows, against the float64 reference at
    ragged sizes; for causal and sliding-window attention the masked chunks' mask applied once
    in place (a masked stream takes 32 rows where the chunks divide the keys)."""
    from napkin_dsl.backends import opencl

    kernel = tensor_kernel(name)
    program = kernel.gpu_program(None, **sizes)
    plan = isel.selection(program, program.launches[0], "sm_90").plan
    assert (plan.warp_rows, plan.rolled) == (32, True)
    source, _ = opencl.generate(program, arch="sm_90")
    assert "NK_ROLLED" in source and "NK_LO_BF16" in source
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(program, inputs, scalars, arch="sm_90")
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), name)
