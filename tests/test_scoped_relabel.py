"""Relabel clauses scoped to launches: `smem for O: stream x 64` partitions only the launch computing O."""

from __future__ import annotations

import numpy as np
import pytest
import sympy

import napkin_dsl as napkin
from napkin_dsl.backends import opencl
from napkin_dsl.backends.numpy import execute
from napkin_dsl.cost import cost_of, smem_bytes_by_launch
from napkin_dsl.errors import RelabelError
from napkin_dsl.reference import evaluate

UNFUSED = """
kernel attention_unfused(Q: f16[q d], K: f16[x d], V: f16[x d]) -> O: f16[q d]:
    S[q x] @gmem = Q[q d] * K[x d]
    P[q x] @gmem = softmax[x](S)
    O[q d] = P[q x] * V[x d]

relabel attention_unfused on H100:
    smem for S: group q 128, x 128; stream d 64
    smem for P: group q 4
    smem for O: group q 128; stream x 64
"""

SYMBOLIC = """
kernel unfused(S: f32[q x], V: f32[x d]) -> O: f32[q d]:
    P[q x] @l0 = softmax[x](S)
    O[q d] = P[q x] * V[x d]

relabel unfused on two_level:
    l1 for P: group q g_p
    l1 for O: group q g_o; stream x s_x
"""


def test_each_launch_sees_only_its_partitions():
    program = napkin.load(UNFUSED)["attention_unfused"].program(q=1024, x=1024, d=128)
    views = [[(p.kind, p.axis, int(p.size)) for p in launch.schedule.partitions if not p.derived] for launch in program.launches]
    assert views == [[("group", "q", 128), ("group", "x", 128), ("stream", "d", 64)], [("group", "q", 4)],
                     [("group", "q", 128), ("stream", "x", 64)]]
    text = napkin.load(UNFUSED)["attention_unfused"].pseudocode(q=1024, x=1024, d=128)
    assert "for x in 16 streams of 64 @smem" in text and "for d in 2 streams of 64 @smem" in text


def test_scoped_costs_symbolically():
    q, x, d, g_p, g_o, s_x = sympy.symbols("q x d g_p g_o s_x", positive=True, integer=True)
    l1 = napkin.load(SYMBOLIC)["unfused"].cost().levels["l1"]
    # softmax launch: S in, P out; contraction launch: P once, V once per q group, O out.
    assert sympy.expand(l1.H - (2 * q * x + q * x + q * x * d / g_o + q * d)) == 0
    assert l1.M == sympy.Max(g_p * x, g_o * d + g_o * s_x + s_x * d) or sympy.simplify(
        l1.M - sympy.Max(g_p * x, g_o * d + g_o * s_x + s_x * d)) == 0


def test_group_on_an_axis_consumed_only_in_other_launches():
    # x is consumed by softmax and by the contraction, but not in the launch computing S.
    program = napkin.load(UNFUSED)["attention_unfused"].program(q=256, x=256, d=64)
    assert any(p.axis == "x" and p.kind == "group" for p in program.launches[0].schedule.partitions)
    unscoped = UNFUSED.replace("smem for S: group q 128, x 128; stream d 64", "smem: group x 128")
    with pytest.raises(napkin.NapkinError, match="cannot group-partition x"):
        napkin.load(unscoped)


@pytest.mark.parametrize("change, message", [
    ("smem for T: group q 4", "names 'T', which no statement"),
    ("smem for P: stream d 4", "the launch computing it has no axis 'd'"),
    ("smem for P: group q 4\n    smem: group q 8", "partitioned twice at level smem for the same launch"),
])
def test_scoping_mistakes(change, message):
    source = UNFUSED.replace("smem for P: group q 4", change)
    with pytest.raises(RelabelError, match=message):
        napkin.load(source)


def test_numpy_counts_equal_report_and_the_generated_kernel_matches():
    kernel = napkin.load(UNFUSED)["attention_unfused"]
    sizes = dict(q=300, x=200, d=64)
    program = kernel.program(**sizes)
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal([sizes[a] for a in kernel.diagram.arrays[n].axes]).astype(np.float16) for n in "QKV"}
    outputs, counts = execute(program, arrays, {})
    report = cost_of(program)
    assert {level: counts.H[level] for level in report.levels} == {level: int(c.H) for level, c in report.levels.items()}
    expected = evaluate(kernel.diagram, arrays, {}, sizes)["O"].astype(np.float64)
    assert np.max(np.abs(outputs["O"].astype(np.float64) - expected)) < 0.05
    compiled = kernel.compile("sm_90", q=1024, x=1024, d=128)
    assert [row["shared_bytes"] for row in compiled.launch_table()] == smem_bytes_by_launch(compiled.program, "sm_90")
    assert all(row["spill_bytes"] == 0 for row in compiled.launch_table())
    if opencl.opencl_available():
        got = opencl.run(program, arrays, {})["O"].astype(np.float64)
        assert np.max(np.abs(got - expected)) < 0.05


def test_tuner_sizes_each_launch_of_an_unrelabelled_kernel_on_its_own():
    from .conftest import EXAMPLES

    from napkin_dsl.tune import tune

    kernel = napkin.load(EXAMPLES / "attention_unfused.napkin")["attention_unfused"]
    # The launches the file writes (S and P at gmem), as compile tunes them; free to fuse, the
    # tuner fuses attention (kernel.tune), which test_tune_fusion covers.
    result = tune(kernel.diagram, "H100", None, dict(q=8192, x=8192, d=128), keep_written=True)
    lines = result.best.relabel_lines()
    assert [line.split(":")[0] for line in lines] == ["smem for S", "smem for P", "smem for O"]
    assert "stream x" in lines[2]  # the contraction streams x; the softmax launch cannot
    compiled = kernel.compile("sm_90", q=8192, x=8192, d=128)  # tuned, since there is no relabel block
    assert len(compiled.launches) == 3 and all(row["spill_bytes"] == 0 for row in compiled.launch_table())
