"""fp8 products on mma.sync m16n8k32 (e4m3 / e5m2 operands, f32 accumulators) without a GPU.

Selection plans fp8_matmul's contraction on the 8-bit shape for sm_89 and sm_90 (and keeps it
off sm_80, which has none, and off wgmma, whose 8-bit shape napkin prices but does not build).
The emulated instruction is held against NumPy with the PTX ISA's fragment formulas written in
tests/test_layouts.py; whole kernels run on PoCL at ragged m, n, k against the reference that
rounds the inputs as the dtype does; a mutated fragment layout makes them fail. NVRTC's cubins
for sm_89 and sm_90 are read through nvdisasm (backends/sass.py): what the hot loop issues, its
spills and local memory, and the model held under the static ceiling of the code.
"""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import isel
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES, assert_matches_reference
from .test_layouts import isa_a8, isa_b8, isa_c
from .test_opencl import random_inputs
from .test_user_profile import profile_text

MATMUL = (EXAMPLES / "fp8_matmul.napkin").read_text()
# B stored k-fastest ([n k]): both operands by ldmatrix, as attention's K would be
MATMUL_NK = MATMUL.replace("B: fp8e4m3[k n]", "B: fp8e4m3[n k]")
RAGGED = dict(m=150, n=144, k=80)  # m and n past a 128 tile, k past a 64 chunk (n, k: 16-byte rows)


def kernel_of(text: str):
    (kernel,) = napkin.load(text).values()
    return kernel


def selected(text: str, arch: str, hardware=None, **sizes):
    kernel = kernel_of(text)
    program = kernel.gpu_program(hardware, **sizes)
    return isel.selection(program, program.launches[0], arch)


# ---- selection -----------------------------------------------------------------------------------


def test_fp8_matmul_is_planned_on_m16n8k32_where_the_profile_has_it():
    chosen = selected(MATMUL, "sm_90", m=512, n=512, k=512)
    assert chosen.path == "mma.sync" and chosen.plan.dtype == "fp8e4m3"
    mma = chosen.plan.mmas["Acc"]
    assert (mma.a_trans, mma.b_trans, mma.dtype) == (False, True, "fp8e4m3")
    # the byte-gathered B weighs on the warp grid: 64 x 32 warp tiles, 4 m-tiles sharing each gather
    assert (chosen.plan.warp_rows, chosen.plan.warp_cols) == (64, 32)
    # sm_80 has no 8-bit mma.sync: the FMA path, naming what is missing
    a100 = selected(MATMUL, "sm_80", "A100", m=512, n=512, k=512)
    assert a100.plan is None and "no mma.sync m16n8k32 for fp8e4m3 on sm_80" in a100.reason
    # sm_90a: wgmma's 8-bit shape reads both operands K-major, so it copies the [k n] B K-major
    # each chunk; B stored [n k] needs no copy (tests/test_wgmma_fp8.py)
    hopper = selected(MATMUL, "sm_90a", m=512, n=512, k=512)
    assert hopper.path == "wgmma" and hopper.plan.transposed == ("B",)
    assert selected(MATMUL_NK, "sm_90a", m=512, n=512, k=512).plan.transposed == ()


def test_fp8_operands_that_m16n8k32_cannot_read_are_declined_by_name():
    # A stored m-fastest: ldmatrix .trans moves 16-bit values, no byte transpose
    trans_a = MATMUL.replace("A: fp8e4m3[m k]", "A: fp8e4m3[k m]")
    chosen = selected(trans_a, "sm_90", m=256, n=256, k=256)
    assert chosen.plan is None and "fp8e4m3 stored with m fastest" in chosen.reason
    # a k tile that is not whole instructions of 32
    odd = MATMUL.replace("stream k 64", "stream k 48")
    chosen = selected(odd, "sm_90", m=256, n=256, k=240)
    assert chosen.plan is None and "not a multiple of 32" in chosen.reason


ATTENTION = """kernel attn(Q: fp8e4m3[q d], K: fp8e4m3[x d], V: fp8e4m3[x d]) -> O: bf16[q d]:
    S[q x] = Q * K * d^-0.5
    P[q x] = softmax[x](S)
    O[q d] = P * V

relabel attn on H100:
    smem: group q 64; stream x 64
"""


def test_fp8_attention_runs_both_products_on_m16n8k32():
    """QK^T: K[x d] is k-fastest, so B comes by ldmatrix like A; PV: P from registers, packed to
    e4m3 in layouts.KEY_ORDER8's key order, V's rows gathered in the same order."""
    chosen = selected(ATTENTION, "sm_90", q=128, x=256, d=64)
    assert chosen.path == "mma.sync" and chosen.plan.dtype == "fp8e4m3"
    s, o = chosen.plan.mmas["S"], chosen.plan.mmas["O"]
    assert (s.a_in_registers, s.b_trans) == (False, False)
    assert (o.a_in_registers, o.b_trans) == (True, True)


def test_an_fp8_p_with_v_stored_k_fastest_takes_v_by_ldmatrix_and_exchanges_p():
    """V[d x] is read by ldmatrix in the ISA's key order, which KEY_ORDER8's in-lane packing does
    not give P: P's bytes are exchanged within each quad instead (layouts.QUAD_SOURCE)."""
    text = ATTENTION.replace("V: fp8e4m3[x d]", "V: fp8e4m3[d x]")
    chosen = selected(text, "sm_90", q=128, x=256, d=64)
    assert chosen.path == "mma.sync"
    o = chosen.plan.mmas["O"]
    assert (o.a_in_registers, o.b_trans) == (True, False)
    (kernel,) = napkin.load(text).values()
    source = kernel.compile("sm_90", **dict(q=128, x=256, d=64)).source
    body = source[source.index("__global__"):]
    sites = body.count("NK_PRMT(") // 4  # 4 registers a k step, each from 2 lanes' words
    assert sites and body.count("NK_PRMT(") == 4 * sites and body.count("NK_SHFL_IDX_U(") == 8 * sites
    assert "nk_gV_q0" not in source  # no byte gather of V


def test_an_fp8_p_with_v_stored_k_fastest_matches_the_reference_on_pocl(opencl_device):
    text = ATTENTION.replace("V: fp8e4m3[x d]", "V: fp8e4m3[d x]")
    program, outputs, expected = run_on_pocl(text, dict(q=100, x=160, d=64), arch="sm_90")
    assert_matches_reference(program, outputs, expected, "attn")


EXAMPLE = (EXAMPLES / "fp8_attention.napkin").read_text()  # FA3's form: O = P * V * sV, sV[b h]
BENCH = dict(b=4, h=32, qb=64, qi=128, x=8192)


def test_the_fp8_attention_example_runs_both_products_on_m16n8k32_with_v_descaled_after():
    """sV[b h] left the PV product (a post-scale): O is a two-operand mma with P from registers
    (packed to e4m3 in KEY_ORDER8's key order), and the scale runs on its accumulator fragments."""
    chosen = selected(EXAMPLE, "sm_90", **BENCH, d=64)
    assert chosen.path == "mma.sync" and chosen.plan.dtype == "fp8e4m3"
    s, o = chosen.plan.mmas["S"], chosen.plan.mmas["O"]
    assert (s.a_in_registers, s.b_trans) == (False, False)
    assert (o.a, o.a_in_registers, o.b, o.b_trans, o.k) == ("P", True, "V", True, "x")
    assert "sV" in chosen.plan.plain  # read elementwise from its shared tile by the scale step


def test_sm90_declines_the_example_at_d128_where_the_conversions_would_spill(l40s):
    """The PV product is built; at d = 128 sm_90's f16 conversions of the fp8 operands (no 8-bit
    mma.sync in its SASS) would spill, so selection says so by name; sm_89's QMMA takes it."""
    chosen = selected(EXAMPLE, "sm_90", **BENCH, d=128)
    assert chosen.plan is None and "sm_90 has no 8-bit mma.sync" in chosen.reason
    assert selected(EXAMPLE, "sm_89", l40s, **BENCH, d=128).path == "mma.sync"


# ---- the emulated instruction against NumPy ------------------------------------------------------

EMULATION_KERNEL = """
__kernel __attribute__((reqd_work_group_size(32, 1, 1)))
void mma8_test(__global const uint* a, __global const uint* b, __global float* c, int e5m2) {
    __local uint scratch[NK_WS];
    __local uint* nk_ws = scratch;
    const int nk_lane = get_local_id(0);
    uint af[4], bf[2];
    float cf[4] = {0.5f, -0.25f, 1.0f, 2.0f};
    for (int j = 0; j < 4; ++j) af[j] = a[4 * nk_lane + j];
    for (int j = 0; j < 2; ++j) bf[j] = b[2 * nk_lane + j];
    if (e5m2) { NK_MMA_E5M2(cf, af, bf[0], bf[1]); } else { NK_MMA_E4M3(cf, af, bf[0], bf[1]); }
    for (int i = 0; i < 4; ++i) c[4 * nk_lane + i] = cf[i];
}
"""


@pytest.mark.parametrize("dtype", ["fp8e4m3", "fp8e5m2"])
def test_the_emulated_m16n8k32_is_the_isas_product(dtype, opencl_device):
    """Registers filled by the ISA's formulas (test_layouts.isa_a8, isa_b8; 4 values a .b32, the
    lowest index in the low byte), D = A B + C read back by isa_c: the emulation decodes them
    per the fragment maps and sums in f32."""
    import pyopencl as cl

    from napkin_dsl.backends.lowering import OpenCLDialect
    from napkin_dsl.backends.tensorcore import FP8_PRELUDES, OPENCL_PRELUDE
    from napkin_dsl.types import numpy_dtype

    rng = np.random.default_rng(5)
    A = (rng.standard_normal((16, 32)) * 4).astype(numpy_dtype(dtype))
    B = (rng.standard_normal((32, 8)) * 4).astype(numpy_dtype(dtype))
    a = np.zeros((32, 4), np.uint32)
    b = np.zeros((32, 2), np.uint32)
    for lane in range(32):
        for i in range(16):
            a[lane, i // 4] |= np.uint32(A[isa_a8(lane, i)].view(np.uint8)) << np.uint32(8 * (i % 4))
        for i in range(8):
            b[lane, i // 4] |= np.uint32(B[isa_b8(lane, i)].view(np.uint8)) << np.uint32(8 * (i % 4))
    ctx, queue = opencl_device
    source = (OpenCLDialect.prelude + OpenCLDialect.prelude_fp8 + OPENCL_PRELUDE + FP8_PRELUDES["opencl"]
              + EMULATION_KERNEL)
    program = cl.Program(ctx, source).build()
    flags = cl.mem_flags
    buffers = [cl.Buffer(ctx, flags.READ_ONLY | flags.COPY_HOST_PTR, hostbuf=x) for x in (a, b)]
    c = np.zeros((32, 4), np.float32)
    out = cl.Buffer(ctx, flags.WRITE_ONLY, c.nbytes)
    program.mma8_test(queue, (32,), (32,), *buffers, out, np.int32(dtype == "fp8e5m2"))
    cl.enqueue_copy(queue, c, out)
    product = A.astype(np.float64) @ B.astype(np.float64)
    start = [0.5, -0.25, 1.0, 2.0]
    for lane in range(32):
        for i in range(4):
            assert c[lane, i] == pytest.approx(product[isa_c(lane, i)] + start[i], rel=1e-5, abs=1e-4)


# ---- whole kernels on PoCL -----------------------------------------------------------------------


def run_on_pocl(text: str, sizes: dict, seed: int = 0, arch: str = "sm_90"):
    # sm_90's mma.sync m16n8k32 build (on the profile's own sm_90a, attention and a k-fastest B
    # are wgmma's: tests/test_wgmma_fp8_attention.py, tests/test_wgmma_fp8.py)
    from napkin_dsl.backends import opencl

    kernel = kernel_of(text)
    program = kernel.gpu_program(None, **sizes)
    assert isel.selection(program, program.launches[0], arch).path == "mma.sync"
    inputs, scalars = random_inputs(kernel.diagram, sizes, seed)
    outputs = opencl.run(program, inputs, scalars, arch=arch)
    return program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes)


@pytest.mark.parametrize("text, sizes", [
    (MATMUL, RAGGED), (MATMUL, dict(m=128, n=128, k=128)),
    (MATMUL.replace("fp8e4m3", "fp8e5m2"), RAGGED), (MATMUL_NK, RAGGED),
], ids=["e4m3-ragged", "e4m3-whole", "e5m2-ragged", "b-k-fastest-ragged"])
def test_fp8_matmul_on_m16n8k32_matches_the_reference_on_pocl(text, sizes, opencl_device):
    # sm_90's build: on sm_90a a k-fastest B is wgmma's 8-bit shape (tests/test_wgmma_fp8.py)
    program, outputs, expected = run_on_pocl(text, sizes, arch="sm_90")
    assert_matches_reference(program, outputs, expected, "fp8_matmul")


@pytest.mark.parametrize("sizes", [dict(q=100, x=150, d=64), dict(q=128, x=128, d=32)], ids=["ragged", "whole"])
def test_fp8_attention_on_m16n8k32_matches_the_reference_on_pocl(sizes, opencl_device):
    program, outputs, expected = run_on_pocl(ATTENTION, sizes)
    assert_matches_reference(program, outputs, expected, "attn")


EXAMPLE_SIZES = [dict(b=1, h=2, qb=2, qi=64, x=150, d=64), dict(b=1, h=1, qb=3, qi=48, x=100, d=32),
                 dict(b=1, h=2, qb=1, qi=128, x=128, d=64)]


@pytest.mark.parametrize("sizes", EXAMPLE_SIZES, ids=["ragged-x", "ragged-x-48-rows", "whole"])
def test_the_fp8_attention_example_on_m16n8k32_matches_the_reference_on_pocl(sizes, opencl_device):
    """The sm_90 build (both products on the 8-bit shape, O *= sV on the fragments) against the
    reference that rounds the inputs as e4m3 does, within the Program's dtype-derived tolerance."""
    from napkin_dsl.backends import opencl

    kernel = kernel_of(EXAMPLE)
    program = kernel.gpu_program(None, **sizes)
    assert isel.selection(program, program.launches[0], "sm_90").path == "mma.sync"
    inputs, scalars = random_inputs(kernel.diagram, sizes, 0)
    outputs = opencl.run(program, inputs, scalars, arch="sm_90")
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), "fp8_attention")


def test_the_example_without_its_post_scale_fails_on_pocl(opencl_device, monkeypatch):
    """The printer's scale step dropped (O left undescaled), with per-head scales far from 1: the
    output no longer matches, so the scale step is what the match above rests on."""
    from napkin_dsl.backends import opencl, tensorcore

    printed = tensorcore.TensorPrinter.tc_compute

    def without_post_scale(self, step):
        if step.statement.target == "O" and (step.level, "O") in step.reads:
            return None
        return printed(self, step)

    sizes = EXAMPLE_SIZES[0]
    kernel = kernel_of(EXAMPLE)
    program = kernel.gpu_program(None, **sizes)
    inputs, scalars = random_inputs(kernel.diagram, sizes, 0)
    inputs["sV"] = np.array([[4.0, 0.25]], np.float32)
    expected = evaluate(kernel.diagram, inputs, scalars, sizes)
    assert_matches_reference(program, opencl.run(program, inputs, scalars, arch="sm_90"), expected, "control")
    monkeypatch.setattr(tensorcore.TensorPrinter, "tc_compute", without_post_scale)
    with pytest.raises(AssertionError):
        assert_matches_reference(program, opencl.run(program, inputs, scalars, arch="sm_90"), expected, "fp8_attention")


def test_v_read_in_the_isas_key_order_fails_on_pocl(opencl_device, monkeypatch):
    """P is packed in KEY_ORDER8's order; V's rows read in the ISA's own order (the identity in
    its place) pair P's values with the wrong keys, and the output no longer matches."""
    from napkin_dsl.backends import tensorcore
    from napkin_dsl.layouts import Layout, Mode

    monkeypatch.setattr(tensorcore, "KEY_ORDER8_KN", Layout(("k", "n"), ("k", "n"), (Mode(0, 1, 32, (1, 0)), Mode(1, 1, 8, (0, 1)))))
    program, outputs, expected = run_on_pocl(ATTENTION, dict(q=100, x=150, d=64))
    with pytest.raises(AssertionError):
        assert_matches_reference(program, outputs, expected, "attn")


def test_a_mutated_fragment_layout_fails_on_pocl(opencl_device, monkeypatch):
    """The printer's byte gather of B reads layouts.MMA_B8, the emulation decodes by its own
    copy, printed when the module loaded. With the gather's mutated (k t + 4 (i & 3) where the ISA
    has 4t + (i & 3): still a bijection onto B's 32 x 8, just not the ISA's), the product no
    longer matches the reference."""
    from napkin_dsl.backends import tensorcore
    from napkin_dsl.layouts import MMA_B8, Layout, Mode

    program, outputs, expected = run_on_pocl(MATMUL, RAGGED)
    assert_matches_reference(program, outputs, expected, "fp8_matmul")  # the control
    wrong = Layout(MMA_B8.inputs, MMA_B8.outputs, (Mode(0, 4, 8, (0, 1), "g"), Mode(0, 1, 4, (1, 0), "t"),
                                                   Mode(1, 1, 4, (4, 0)), Mode(1, 4, 2, (16, 0))))
    assert sorted(wrong(lane, i) for lane in range(32) for i in range(8)) == [(k, n) for k in range(32) for n in range(8)]
    assert [wrong(lane, i) for lane in range(32) for i in range(8)] != [isa_b8(lane, i) for lane in range(32) for i in range(8)]
    monkeypatch.setattr(tensorcore, "MMA_B8", wrong)
    program, outputs, expected = run_on_pocl(MATMUL, RAGGED)
    with pytest.raises(AssertionError):
        assert_matches_reference(program, outputs, expected, "fp8_matmul")


# ---- NVRTC cubins for sm_89 and sm_90, through nvdisasm ------------------------------------------


@pytest.fixture
def l40s(tmp_path):
    path = tmp_path / "L40S_like.toml"
    path.write_text(profile_text())
    return path


def _sass(compiled):
    from napkin_dsl.backends import sass

    try:
        sass.find_nvdisasm()
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm (pip install 'napkin-dsl[sass]')")
    (entry,) = sass.sass_report(compiled)["launches"]
    functions = sass.disassemble(compiled.image)
    body = max(sass.innermost_loops(functions[entry["entry"]]), key=lambda b: sum(sass.tensor_work(i.opcode) is not None for i in b))
    return entry, [i.opcode for i in body]


@pytest.mark.parametrize("dtype, opcode", [("fp8e4m3", "QMMA.16832.F32.E4M3.E4M3"), ("fp8e5m2", "QMMA.16832.F32.E5M2.E5M2")])
def test_sm89_runs_qmma_with_the_fp8_type_in_its_hot_loop(dtype, opcode, l40s):
    """sm_89 has the 8-bit instruction: mma.sync m16n8k32 .e4m3 is SASS's QMMA.16832.F32.E4M3.E4M3,
    and nothing converts the operands. 0 spills, no local memory; the model (at the profile's fp8
    mma.sync rate) stays under the static ceiling of this code."""
    compiled = kernel_of(MATMUL.replace("fp8e4m3", dtype)).compile("sm_89", l40s, m=4096, n=4096, k=4096)
    entry, hot = _sass(compiled)
    assert compiled.launches[0].path == "mma.sync"
    assert hot.count(opcode) == 64 and not any(op.startswith("HMMA") for op in hot)
    assert not any(op.startswith("F2FP") and "E4M3" in op for op in hot)
    assert entry["spill_bytes"] == 0 and entry["whole"].get("local", 0) == 0
    ceiling = entry["ceiling"]
    assert ceiling["loop"]["binding"] == "tensor"
    assert ceiling["model_s"] >= ceiling["floor_s"] * (1 - 1e-9)
    assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9)


def test_sm90_has_no_8_bit_mma_sync_ptxas_converts_to_f16():
    """sm_90 has no QMMA: ptxas lowers each mma.sync m16n8k32 .e4m3 to F2FP.F16.E4M3.UNPACK_B
    conversions and two HMMA.16816.F32 (f16), which is why the H100 profile prices the path at
    mma.sync's 16-bit rate. 0 spills, no local memory, the model under the ceiling."""
    compiled = kernel_of(MATMUL).compile("sm_90", m=4096, n=4096, k=4096)
    entry, hot = _sass(compiled)
    assert hot.count("HMMA.16816.F32") == 128 and hot.count("F2FP.F16.E4M3.UNPACK_B") > 0
    assert not any(op.startswith("QMMA") for op in hot)
    assert entry["spill_bytes"] == 0 and entry["whole"].get("local", 0) == 0
    ceiling = entry["ceiling"]
    assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9)
    rate = compiled.program.hardware.paths["mma_sync_fp8"].rates["fp8e4m3"]
    assert rate == compiled.program.hardware.paths["mma_sync"].rates["f16"]


@pytest.mark.parametrize("arch, d", [("sm_89", 64), ("sm_89", 128), ("sm_90", 64)])
def test_fp8_attention_compiles_without_spills_or_local_memory(arch, d, l40s):
    """Both products on the 8-bit instruction (sm_89's QMMA; sm_90's f16 HMMA after ptxas's
    conversions), P packed by cvt.rn.satfinite.e4m3x2 in CUDA; 0 spills, no local memory, and
    the model under the static ceiling of the code."""
    hardware = l40s if arch == "sm_89" else None
    compiled = kernel_of(ATTENTION).compile(arch, hardware, q=8192, x=8192, d=d)
    entry, hot = _sass(compiled)
    assert compiled.launches[0].path == "mma.sync"
    assert entry["spill_bytes"] == 0 and entry["whole"].get("local", 0) == 0
    wanted = "QMMA.16832.F32.E4M3.E4M3" if arch == "sm_89" else "HMMA.16816.F32"
    assert hot.count(wanted) > 0
    assert any(op.startswith("F2FP") and "E4M3" in op and "PACK" in op for op in hot)  # P's cvt to e4m3
    ceiling = entry["ceiling"]
    assert ceiling["model_s"] >= ceiling["floor_s"] * (1 - 1e-9)
    assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9)


@pytest.mark.parametrize("arch, d", [("sm_89", 128), ("sm_90", 64)])
def test_the_fp8_attention_example_compiles_without_spills_or_local_memory(arch, d, l40s):
    """The example at b=4 h=32 qb=64 qi=128 x=8192 (its 128-row blocks on 8 warps): both products
    on the 8-bit instruction (QMMA on sm_89, F2FP + HMMA on sm_90), P packed to e4m3, 0 spills, no
    local memory, the model under the static ceiling. (sm_90 at d = 128 is declined: above.)"""
    hardware = l40s if arch == "sm_89" else None
    compiled = kernel_of(EXAMPLE).compile(arch, hardware, **BENCH, d=d)
    entry, hot = _sass(compiled)
    assert compiled.launches[0].path == "mma.sync"
    assert entry["spill_bytes"] == 0 and entry["whole"].get("local", 0) == 0
    wanted = "QMMA.16832.F32.E4M3.E4M3" if arch == "sm_89" else "HMMA.16816.F32"
    assert hot.count(wanted) > 0
    assert any(op.startswith("F2FP") and "E4M3" in op and "PACK" in op for op in hot)
    ceiling = entry["ceiling"]
    assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9)


def test_sm90_declines_fp8_attention_at_d128_where_the_conversions_would_spill(l40s):
    """sm_90's f16 conversions of the fp8 operands hold registers QMMA does not: at d = 128 the
    kernel spilled 340 bytes, so selection keeps it on the FMA path there and says why; sm_89 keeps it."""
    chosen = selected(ATTENTION, "sm_90", q=8192, x=8192, d=128)
    assert chosen.plan is None and "sm_90 has no 8-bit mma.sync" in chosen.reason
    assert selected(ATTENTION, "sm_89", l40s, q=8192, x=8192, d=128).path == "mma.sync"



@pytest.mark.parametrize("text, sizes", [(MATMUL, RAGGED), (ATTENTION, dict(q=100, x=150, d=64)), (EXAMPLE, EXAMPLE_SIZES[0])],
                         ids=["matmul", "attention", "example"])
def test_the_numpy_backend_counts_what_the_model_prices_on_m16n8k32(text, sizes):
    """The register level's H on the fp8 plan (A once per warp column, B once per warp row, one
    byte a value) counted by the NumPy backend equals the report's, and the run is within tolerance."""
    from napkin_dsl.backends.numpy import check_run

    kernel = kernel_of(text)
    program = kernel.gpu_program(None, **sizes)
    assert isel.selection(program, program.launches[0]).plan.dtype == "fp8e4m3"
    result = check_run(kernel, sizes=sizes, seed=3)
    assert result["ok"] and not result["count_differences"], result


@pytest.mark.parametrize("arch, path", [("sm_90a", "wgmma"), ("sm_90", "mma.sync")])
def test_an_8_bit_output_of_a_tensor_core_product_is_stored_a_value_at_a_time(arch, path, opencl_device):
    """A product saved to an e4m3 output (a rotation stored in 8 bits: examples/incoherent_fp8.napkin).
    The staged save wrote each fragment pair as two floats into a tile laid out for bytes, and C
    came back inf; an 8-bit output is stored a value at a time, converted and saturated."""
    from .test_opencl import run_on_pocl

    source = (EXAMPLES / "matmul.napkin").read_text().replace("C: f32[m n]", "C: fp8e4m3[m n]")
    program, _ = run_on_pocl(source, "matmul", [path], arch=arch, m=256, n=256, k=128)
    assert program.diagram.arrays["C"].dtype == "fp8e4m3"
