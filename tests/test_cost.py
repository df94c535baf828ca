"""The performance model against the paper's formulas (METHOD.md sections 2-5), symbolically."""

from __future__ import annotations

from pathlib import Path

import pytest
import sympy

import napkin_dsl as napkin
from napkin_dsl.errors import RelabelError

from .conftest import EXAMPLES

PROFILES = Path(__file__).parent / "profiles"


def symbols(names: str):
    return sympy.symbols(names, positive=True, integer=True)


def level(report, name="l1"):
    return report.levels[name]


def same(a, b) -> bool:
    return sympy.simplify(sympy.expand(a) - sympy.expand(b)) == 0


def test_fig9_unfused_softmax_contraction():
    q, x, d = symbols("q x d")
    report = napkin.load(EXAMPLES / "paper" / "fig9.napkin")["fig9"].cost()
    l1 = level(report)
    # Exact: 3qx + xd + qd. The paper prints 4qx + xd: its last column lists qx for O (q d).
    assert same(l1.H, 3 * q * x + x * d + q * d)
    # M = max(qx + xd, qd); with x > d (the paper's case) that is qx + xd.
    e = sympy.Symbol("e", positive=True)
    assert same(l1.M.subs(x, d + e), ((q + d) * x).subs(x, d + e))


def test_fig11_woven_box_with_shared_input():
    a, x, y, w, g_a = symbols("a x y w g_a")
    report = napkin.load(EXAMPLES / "paper" / "fig11.napkin")["fig11"].cost()
    l1 = level(report)
    assert same(l1.H, a * x + a * y + a * w / g_a)
    assert l1.M == sympy.Max(g_a * x + w, g_a * y)
    assert same(l1.N, a / g_a)


def test_fig12_inner_broadcasting():
    a, b, x, y, w, g_a, g_b = symbols("a b x y w g_a g_b")
    report = napkin.load(EXAMPLES / "paper" / "fig12.napkin")["fig12"].cost()
    l1 = level(report)
    assert same(l1.H, a * b * x / g_b + a * b * w / g_a + a * b * y)
    assert same(l1.N, a * b / (g_a * g_b))
    assert l1.M == sympy.Max(g_a * x + g_b * w, g_a * g_b * y)


MATMUL_TWO_LEVEL = """
kernel mm(A: f32[a b], B: f32[b c]) -> C: f32[a c]:
    C[a c] = A[a b] * B[b c]

relabel mm on two_level:
    l1: group a g_a, c g_c; stream b s_b
"""


def test_matmul_grouped_and_streamed():
    a, b, c, g_a, g_c, s_b = symbols("a b c g_a g_c s_b")
    l1 = level(napkin.load(MATMUL_TWO_LEVEL)["mm"].cost())
    assert same(l1.H, a * b * c * (1 / g_a + 1 / g_c) + a * c)
    assert same(l1.M, g_a * g_c + g_a * s_b + s_b * g_c)


def test_matmul_tuner_square_tiles_and_beta_half():
    result = napkin.load(MATMUL_TWO_LEVEL)["mm"].tune()
    assert result.beta == sympy.Rational(1, 2)
    sizes = result.best.sizes
    assert abs(float(sizes["a"]) / float(sizes["c"]) - 1) < 0.2  # square


ATTENTION_TWO_LEVEL = """
kernel attn(Q: f32[q d], K: f32[x d], V: f32[x d]) -> O: f32[q d]:
    S[q x] = Q * K
    P[q x] = softmax[x](S)
    O[q d] = P * V

relabel attn on two_level:
    l1: group q g_q; stream x s_x
"""


def test_flash_attention_transfers_flops_and_beta():
    q, x, d, g_q = symbols("q x d g_q")
    kernel = napkin.load(ATTENTION_TWO_LEVEL)["attn"]
    report = kernel.cost()
    assert same(level(report).H, 2 * q * d + 2 * q * x * d / g_q)
    assert same(report.flops["tensor"], 4 * q * x * d)
    assert kernel.tune().beta == 1


MATMUL_ABSTRACT = MATMUL_TWO_LEVEL.replace("f32", "f16")
ATTENTION_ABSTRACT = ATTENTION_TWO_LEVEL.replace("f32", "f16")


def _bytes_moved_at_fixed_byte_capacity(source: str, bytes_per_value: int, capacity_bytes: float, sizes: dict) -> float:
    """Re-tune at a byte capacity: q bytes per value leave capacity / q values; bytes moved = q H*."""
    from napkin_dsl.hardware import load_hardware
    from napkin_dsl.tune import AbstractOptimum

    (kernel,) = napkin.load(source).values()
    model = AbstractOptimum(kernel.diagram, load_hardware("two_level"), kernel.relabel, sizes)
    best, _ = model.at(capacity_bytes / bytes_per_value)
    return bytes_per_value * best


QUANTIZATION_CASES = [
    (MATMUL_ABSTRACT, 2**1.5, dict(a=2**16, b=2**16, c=2**16)),
    # x long enough that the output write 2qd (beta = 0) is negligible beside 2qxd/g_q
    (ATTENTION_ABSTRACT, 4.0, dict(q=2**12, x=2**22, d=64)),
]


@pytest.mark.parametrize("source, law, sizes", QUANTIZATION_CASES, ids=["matmul", "attention"])
def test_quantization_fp16_to_fp8_at_fixed_byte_capacity(source, law, sizes):
    # Bytes moved scale as q^(1 + beta): attention (beta 1) by 4, matmul (beta 1/2) by 2^1.5.
    capacity = 2.0**20
    fp16 = _bytes_moved_at_fixed_byte_capacity(source, 2, capacity, sizes)
    fp8 = _bytes_moved_at_fixed_byte_capacity(source, 1, capacity, sizes)
    ratio = fp16 / fp8
    assert ratio == pytest.approx(law, rel=0.05)


def test_a_level_of_infinite_bandwidth_changes_no_time():
    source = MATMUL_ABSTRACT.replace("on two_level", "on H100").replace("l1: group a g_a, c g_c; stream b s_b", "smem: group a 64, c 128; stream b 64")
    kernel = napkin.load(source)["mm"]
    sizes = dict(a=4096, b=4096, c=4096)
    one = kernel.cost(str(PROFILES / "bytes_one_level.toml"), **sizes)
    free = kernel.cost(str(PROFILES / "bytes_with_free_level.toml"), **sizes)
    assert one.time["overlapped_s"] == pytest.approx(free.time["overlapped_s"])
    assert one.time["serial_s"] == pytest.approx(free.time["serial_s"])
    # A single level reproduces the matmul formula H = abc(1/g_a + 1/g_c) + ac, in bytes.
    a = b = c = 4096
    assert one.levels["smem"].H == a * b * c * (sympy.Rational(1, 64) + sympy.Rational(1, 128)) + a * c


def test_group_on_a_consumed_axis_is_refused():
    source = (EXAMPLES / "attention.napkin").read_text().replace("stream x 64", "group x 64")
    with pytest.raises(RelabelError) as info:
        napkin.load(source)["attention"].cost()
    message = str(info.value)
    assert "cannot group-partition x" in message
    assert "softmax[x] P (line 5)" in message and "contract O (line 6)" in message
    assert "stream x 64" in message


def test_stream_of_a_softmax_kept_at_gmem_is_refused():
    source = """
kernel attention_unfused(Q: f16[q d], K: f16[x d], V: f16[x d]) -> O: f16[q d]:
    S[q x] @gmem = Q[q d] * K[x d]
    P[q x] @gmem = softmax[x](S)
    O[q d] = P[q x] * V[x d]

relabel attention_unfused on H100:
    smem: group q 64; stream x 64
"""
    with pytest.raises(RelabelError) as info:
        napkin.load(source)["attention_unfused"].cost()
    assert "softmax[x] (line 4) keeps axis 'x'" in str(info.value)
    assert "saved to the top level" in str(info.value)


def test_over_capacity_lists_buffers_and_suggests_a_size():
    source = (EXAMPLES / "matmul.napkin").read_text().replace("group m 128, n 128", "group m 512, n 512")
    with pytest.raises(RelabelError) as info:
        napkin.load(source)["matmul"].cost(m=4096, n=4096, k=4096)
    message = str(info.value)
    assert "over its capacity of 232,448" in message
    assert "C.acc[512 512] f32 = 1,048,576 B" in message
    assert "try 'group" in message


def test_two_pass_stream_is_refused():
    source = (EXAMPLES / "rmsnorm.napkin").read_text().replace("group t 8", "group t 8; stream d 64")
    with pytest.raises(RelabelError) as info:
        napkin.load(source)["rmsnorm"].cost()
    assert "complete only after the whole of 'd'" in str(info.value)


def test_masked_tails_are_reported_and_counted_exactly():
    kernel = napkin.load(EXAMPLES / "matmul.napkin")["matmul"]
    report = kernel.cost(m=1000, n=1000, k=1000)
    assert any("does not divide m = 1000" in note for note in report.notes)
    # A and B are each read once per group of the other operand's axis: ceil(1000/128) = 8.
    assert report.levels["smem"].H == 1000 * 1000 * 8 * 2 + 1000 * 1000


def test_h100_predictions_are_compute_bound_at_the_hbm_level():
    matmul = napkin.load(EXAMPLES / "matmul.napkin")["matmul"].tune("H100", m=8192, n=8192, k=8192).best.report
    hbm = matmul.time["transfer_s"]["l2"]
    assert matmul.time["compute_s"] > hbm
    attention = napkin.load(EXAMPLES / "attention.napkin")["attention"].cost(b=4, h=32, q=8192, x=8192, d=128)
    assert attention.time["transfer_s"]["l2"] < attention.time["compute_s"]
    # On tensor cores with 16-row warp tiles every warp reads all of K and V by ldmatrix: the
    # shared-memory-to-register traffic, not HBM, is what bounds it.
    assert attention.time["bound"] in ("compute", "registers transfer")


def test_launches_take_their_own_times_one_after_another():
    """A Program of several launches takes the sum of each launch's time, costed alone: a
    launch of 16 blocks (SwiGLU's down projection at e 256) keeps 16 of H100's 132 SMs busy,
    whatever the launch beside it (one busy fraction for both hid it: 70 us priced as 26)."""
    from napkin_dsl.cost import cost_of
    from napkin_dsl.pseudocode import Program

    kernel = napkin.load(EXAMPLES / "swiglu.napkin")["swiglu"]
    sizes = dict(t=512, m=1024, f=2816, e=1024)
    for relabel in (None, "smem for G, U, H: group t 96, f 64; stream m 64 | smem for Y: group t 128, e 256; stream f 64"):
        program = (kernel.relabelled(relabel) if relabel else kernel).program(**sizes)
        assert len(program.launches) == 2
        alone = [cost_of(Program(program.schedule, (launch,)), check=False).time for launch in program.launches]
        time = cost_of(program, check=False).time
        assert time["overlapped_s"] == pytest.approx(sum(t["overlapped_s"] for t in alone))
        assert time["launch_s"] == pytest.approx([t["overlapped_s"] - sum(t["fixed_s"].values()) for t in alone])


def test_the_report_of_several_launches_is_json():
    """time['launch_s'] is a list: to_dict and `napkin cost --json` print it (the fuzzer found
    to_dict raising on it)."""
    import json

    kernel = napkin.load(EXAMPLES / "swiglu.napkin")["swiglu"]
    report = kernel.cost(t=512, m=1024, f=2816, e=1024)
    data = json.loads(json.dumps(report.to_dict()))
    assert len(data["time"]["launch_s"]) == 2 and sum(data["time"]["launch_s"]) <= data["time_s"]
