"""The tuner finds a schedule for an einsum with several free row axes (issue 46, defect 3):
``C[b i j k] = A[b i j l] * B[l k]`` held every free axis of A to a fragment's multiple or the
whole axis, so no tile fit ("no configuration fits"). A tile of 1 is not wide, and one of the
others carries the fragment's rows: the tuner now tries 1 for them (``tune.unit_axes``)."""

from __future__ import annotations

import napkin_dsl as napkin
from napkin_dsl.cost import instruction_path
from napkin_dsl.tune import Knob, unit_axes

from .conftest import EXAMPLES

EINSUM = """kernel einsum(A: bf16[b i j l], B: bf16[l k]) -> C: f32[b i j k]:
    C[b i j k] = A[b i j l] * B[l k]
"""
SIZES = dict(b=8, i=256, j=512, l=256, k=768)


def test_an_einsum_with_three_free_row_axes_tunes_onto_tensor_cores():
    kernel = napkin.load(EINSUM)["einsum"]
    result = kernel.tune("H100", **SIZES)
    assert result.units == {"b", "i", "j"}
    assert "; or 1 for b, i, j" in result.table()
    best = kernel.relabelled(result)
    program = best.program("H100", **SIZES)
    assert [instruction_path(program, launch) for launch in program.launches] in (["mma.sync"], ["wgmma"])
    sizes = result.best.sizes
    assert sorted(sizes[a] == 1 for a in ("b", "i", "j")) == [False, True, True]  # one of them holds the rows


def test_an_operand_with_one_free_axis_of_its_own_gains_no_unit_axis():
    """Where each operand has one free axis of its own (attention's q and x, matmul's m and n),
    nothing changes: the axes both operands share (b, h) were free already. gqa's Q has two of
    its own (r, q), and fp8_attention's two (qb, qi; qb, the scale sQ's last axis, keeps its
    multiple): those may be 1, as the written ``group ... r 1, q 128`` is."""
    found = {}
    for name in ("attention", "matmul", "gqa", "mlp", "fp8_attention"):
        (kernel,) = napkin.load(EXAMPLES / f"{name}.napkin").values()
        knobs = [Knob("smem", "group", axis) for axis in kernel.diagram.axes]
        found[name] = unit_axes(kernel.diagram, knobs)
    assert found == {"attention": set(), "matmul": set(), "gqa": {"q", "r"}, "mlp": set(), "fp8_attention": {"qi"}}


BATCHNORM = """kernel batchnorm(X: f32[n c h w], g: f32[c], b: f32[c]) -> Y: f32[n c h w]:
    mu[c] @gmem = mean[n h w](X)
    var[c] @gmem = mean[n h w]((X - mu)^2)
    Y[n c h w] = (X - mu) / sqrt(var + 0.00001) * g + b
"""


def test_batchnorm_with_its_statistics_in_device_memory_tunes():
    """The launches that read mu[c] (and g, b) held c to a multiple of 32 for coalescing those
    vectors, and a 32-channel tile of X[n c h w] overflows shared memory: 'no configuration fits',
    where `group c 1; stream h 1` fits (issue 46, defect 4). A broadcast array, its axes a strict
    subset of another's in the launch, imposes no coalescing multiple now."""
    kernel = napkin.load(BATCHNORM)["batchnorm"]
    sizes = dict(n=64, c=64, h=128, w=128)
    result = kernel.tune("H100", **sizes)
    written = kernel.relabelled("relabel batchnorm on H100:\n    smem: group c 1; stream h 1\n").cost("H100", **sizes)
    assert result.best.time_s <= written.time["overlapped_s"]
    assert "c" not in result.constraints  # nothing holds c to a multiple
