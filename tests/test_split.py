"""`split AXIS SIZE`: a consumed axis cut into parallel parts whose states merge (issue 28).

Values are checked against the float64 reference, counts are counted by the NumPy backend's
execution and compared with the report and with counts derived here from the loop structure,
ragged tails included (the axis not a multiple of the split, the split not of the stream)."""

from __future__ import annotations

import pytest

import napkin_dsl as napkin
from napkin_dsl.backends.numpy import check_run, execute, random_arguments
from napkin_dsl.errors import NapkinError, RelabelError
from napkin_dsl.tune import tune

from .conftest import EXAMPLES

DECODE = """kernel decode(Q: f32[b kv r d], K: f32[b kv x d], V: f32[b kv x d]) -> O: f32[b kv r d]:
    S[b kv r x] = Q * K * d^-0.5
    P[b kv r x] = softmax[x](S)
    O[b kv r d] = P * V

relabel decode on H100:
    smem: group b 1, kv 1; split x 300; stream x 64
"""


def kernel_of(source: str, tmp_path):
    path = tmp_path / "k.napkin"
    path.write_text(source)
    (kernel,) = napkin.load(path).values()
    return kernel


def test_decode_split_runs_with_counts_derived_from_its_loops(tmp_path):
    kernel = kernel_of(DECODE, tmp_path)
    sizes = dict(b=1, kv=2, r=3, x=1000, d=16)  # 4 parts of 300 (the last 100), chunks of 64 (ragged)
    program = kernel.program("H100", **sizes)
    assert len(program.launches) == 2 and program.launches[1].combine == "x"
    arrays, scalars = random_arguments(kernel.diagram, sizes, 0)
    _, counts = execute(program, arrays, scalars)
    parts, r, d, x = 4, 3, 16, 1000
    # per (b, kv) block: each part loads Q and its range of K and V, saves (max, sum, O.acc);
    # the combine loads every part's states and saves O
    partial = parts * r * d + 2 * x * d + parts * (r + r + r * d)
    combine = parts * (r + r + r * d) + r * d
    assert counts.H["smem"] == 2 * (partial + combine)
    result = check_run(kernel, "H100", sizes)
    assert result["ok"], result
    assert result["max_rel_error"] <= result["tolerance"]


def test_splitk_ragged_runs_and_the_combine_adds_the_parts(tmp_path):
    source = """kernel splitk(A: f32[m k], B: f32[k n]) -> C: f32[m n]:
    C[m n] = A * B

relabel splitk on H100:
    smem: group m 16, n 8; split k 300; stream k 64
"""
    kernel = kernel_of(source, tmp_path)
    sizes = dict(m=40, n=24, k=1000)
    program = kernel.program("H100", **sizes)
    arrays, scalars = random_arguments(kernel.diagram, sizes, 1)
    _, counts = execute(program, arrays, scalars)
    # FLOPs (f32 operands: the FMA path): the product, 2 m n k, and one add per part and output in the combine
    assert counts.flops["fma"] == 2 * 40 * 24 * 1000 + 4 * 40 * 24
    assert check_run(kernel, "H100", sizes)["ok"]


@pytest.mark.parametrize("op", ["sum", "max", "min", "mean"])
def test_reductions_merge(op, tmp_path):
    source = f"""kernel red(X: f32[a c]) -> Y: f32[a]:
    Y[a] = {op}[c](X * 2)

relabel red on H100:
    smem: group a 4; split c 100; stream c 32
"""
    kernel = kernel_of(source, tmp_path)
    result = check_run(kernel, "H100", dict(a=10, c=250))
    assert result["ok"], result


def test_lse_merges_with_the_online_softmax_and_a_split_alone_streams_each_part_whole():
    (kernel,) = napkin.load(EXAMPLES / "attention_lse.napkin").values()
    split = kernel.relabelled("relabel attention_lse on H100:\n    smem: group b 1, h 1, q 16; split x 100\n")
    program = split.program("H100", b=1, h=2, q=20, x=250, d=16)
    stream = next(lp for _, loops in napkin.pseudocode.walk(program.launches[0].body) for lp in loops if lp.kind == "stream")
    assert stream.axis == "x" and int(stream.tile) == 100
    assert check_run(split, "H100", dict(b=1, h=2, q=20, x=250, d=16))["ok"]


def test_a_consumer_without_a_merge_is_refused_naming_it(tmp_path):
    source = """kernel k(S: f32[q x], V: f32[x d]) -> O: f32[q d]:
    P[q x] = softmax[x](S)
    E[q x] = exp(P)
    O[q d] = E * V

relabel k on H100:
    smem: group q 16; split x 128; stream x 64
"""
    with pytest.raises(NapkinError) as info:
        kernel_of(source, tmp_path).program("H100", q=32, x=512, d=16)
    error = info.value.errors[0] if hasattr(info.value, "errors") else info.value
    assert isinstance(error, RelabelError)
    assert "cannot split x" in error.message and "softmax[x] (line 2)" in error.message
    assert error.span.line == 2 and "^" in str(error)


def test_a_split_of_a_woven_axis_or_above_the_compute_level_is_refused(tmp_path):
    source = DECODE.replace("split x 300", "split r 2")
    with pytest.raises(NapkinError, match="cannot split r: no statement consumes it"):
        kernel_of(source, tmp_path).program("H100", b=1, kv=2, r=4, x=100, d=16)
    source = DECODE.replace("    smem: group b 1, kv 1; split x 300; stream x 64", "    l2: split x 300\n    smem: group b 1, kv 1")
    with pytest.raises(NapkinError, match="split partitions run at the compute level"):
        kernel_of(source, tmp_path).program("H100", b=1, kv=2, r=4, x=100, d=16)


def test_a_split_compiles_to_its_parts_and_combine_launches(tmp_path):
    """The FMA printer prints both launches: one block per part and group, then one per group."""
    kernel = kernel_of(DECODE, tmp_path)
    compiled = kernel.compile("sm_90", b=1, kv=2, r=4, x=1000, d=64)
    parts = -(-1000 // 300)  # the example's split x 300, the last part ragged
    assert [row["grid"][0] for row in compiled.launch_table()] == [1 * 2 * parts, 1 * 2]
    assert all(row["spill_bytes"] == 0 for row in compiled.launch_table())


def test_a_bf16_split_compiles_with_its_parts_on_mma_sync_and_its_combine_on_the_fma_path():
    (kernel,) = napkin.load(EXAMPLES / "splitk.napkin").values()
    compiled = kernel.compile("sm_90", m=512, n=512, k=65536)
    assert [row["path"] for row in compiled.launch_table()] == ["mma.sync", "fma"]


DONE = dict(b=1, kv=8, r=4, x=32768, d=128)


def hbm_fraction(report, sizes) -> float:
    kv_bytes = 2 * sizes["b"] * sizes["kv"] * sizes["x"] * sizes["d"] * 2  # K and V, bf16
    return kv_bytes / report.time["overlapped_s"] / napkin.hardware.load_hardware("H100").level("l2").bandwidth


def test_decode_tunes_to_a_split_at_80_percent_of_hbm_and_without_it_has_b_kv_blocks():
    (kernel,) = napkin.load(EXAMPLES / "decode.napkin").values()
    result = tune(kernel.diagram, "H100", kernel.relabel, DONE)
    best = result.best
    assert any(k.kind == "split" for k in best.knobs)
    assert hbm_fraction(best.report, DONE) >= 0.8
    unsplit = kernel.relabelled("relabel decode on H100:\n    smem: group b 1, kv 1; stream x 64\n").cost("H100", **DONE)
    assert unsplit.levels["smem"].N == 8  # b x kv blocks
    assert best.time_s < unsplit.time["overlapped_s"] / 2


def test_splitk_tunes_to_a_split_with_3x_the_unsplit_throughput():
    (kernel,) = napkin.load(EXAMPLES / "splitk.napkin").values()
    sizes = dict(m=512, n=512, k=65536)
    result = tune(kernel.diagram, "H100", kernel.relabel, sizes)
    assert any(k.kind == "split" for k in result.best.knobs)
    unsplit = kernel.relabelled("relabel splitk on H100:\n    smem: group m 128, n 128; stream k 64\n").cost("H100", **sizes)
    assert unsplit.time["overlapped_s"] >= 3 * result.best.time_s
