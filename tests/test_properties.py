"""Properties of the NumPy backend over random sizes and random legal relabellings (hypothesis).

For each runnable example, on H100 (with its derived L2 level) and on the paper's two-level
model: random axis sizes (tiles often do not divide them), random group sizes for any subset
of the axes no statement consumes, and the example's stream partition with a random size (or
none). On three_level, groups of one axis at
two levels nest (inner tiles inside the outer tiles' masked tails). The backend must equal the float64 reference within the tolerance of the dtypes the
Program rounds to (f32 1e-5, bf16/f16 1e-2, relative to the largest value), and its counts must
equal the cost report exactly.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import example_id
from .test_numpy_backend import RUNNABLE, assert_counts_equal_report, only_kernel, relabelled, run_and_compare

MAX_TRIPS = 5  # per partitioned axis, to keep each run short


def groupable(kernel) -> list[str]:
    """Axes every box is woven over: the legal group partitions."""
    consumed = {a for s in kernel.diagram.statements for a in s.consumed}
    return [a for a in kernel.diagram.axes if a not in consumed]


def streamed(kernel) -> list[str]:
    return [p.axis for level in (kernel.relabel.levels if kernel.relabel else ()) for p in level.partitions if p.kind == "stream"]


def batch_like(kernel) -> set[str]:
    """Axes the example groups by 1 (batch, heads): kept small."""
    return {p.axis for level in (kernel.relabel.levels if kernel.relabel else ()) for p in level.partitions if p.size == 1}


@st.composite
def configurations(draw, kernel):
    sizes = {}
    for axis in kernel.diagram.axes:
        sizes[axis] = draw(st.integers(1, 3)) if axis in batch_like(kernel) else draw(st.integers(1, 40))
    partitions = []
    written = [p for level in (kernel.relabel.levels if kernel.relabel else ()) for p in level.partitions]
    if any(p.targets for p in written):
        # Clauses scoped to launches (LEVEL for G, U: ...): each written partition, in its scope,
        # most of the time, with a drawn size.
        for p in written:
            if draw(st.sampled_from([True, True, True, False])):
                partitions.append((p.kind, p.axis, draw(st.integers(math.ceil(sizes[p.axis] / MAX_TRIPS), sizes[p.axis] + 3)), p.targets))
        return sizes, partitions
    # Partition most of the time: an unpartitioned axis is the easy case.
    for kind, axes in (("group", groupable(kernel)), ("stream", streamed(kernel))):
        for axis in axes:
            if draw(st.sampled_from([True, True, True, False])):
                partitions.append((kind, axis, draw(st.integers(math.ceil(sizes[axis] / MAX_TRIPS), sizes[axis] + 3))))
    return sizes, partitions


@pytest.mark.parametrize("hardware", ["H100", "two_level"])
@pytest.mark.parametrize("path", RUNNABLE, ids=example_id)
def test_backend_equals_reference_and_counts_equal_report(path, hardware):
    kernel = only_kernel(path)

    @settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(configurations(kernel), st.sampled_from([None, "f32"]), st.integers(0, 2**16))
    def check(configuration, dtype, seed):
        sizes, partitions = configuration
        relabelled_kernel = relabelled(path, hardware, partitions, dtype=dtype)
        counts, report = run_and_compare(relabelled_kernel, sizes, seed=seed)
        assert_counts_equal_report(counts, report)

    check()


@st.composite
def nested_configurations(draw, kernel):
    """Groups of the same axis at l1 and l2 of three_level: inner tiles inside the outer tiles' tails."""
    sizes, partitions = draw(configurations(kernel))
    outer = []
    for kind, axis, _size in partitions:
        if kind == "group" and draw(st.booleans()):
            outer.append((axis, draw(st.integers(1, sizes[axis] + 2))))
    return sizes, partitions, outer


NESTED = [p for p in RUNNABLE if example_id(p) in ("attention.napkin", "matmul.napkin", "mlp.napkin", "rmsnorm.napkin")]


@pytest.mark.parametrize("path", NESTED, ids=example_id)
def test_nested_groups_on_three_levels(path):
    kernel = only_kernel(path)

    @settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(nested_configurations(kernel), st.integers(0, 2**16))
    def check(configuration, seed):
        sizes, partitions, outer = configuration
        relabelled_kernel = relabelled(path, "three_level", partitions, dtype="f32", outer=outer)
        counts, report = run_and_compare(relabelled_kernel, sizes, seed=seed)
        assert_counts_equal_report(counts, report)

    check()
