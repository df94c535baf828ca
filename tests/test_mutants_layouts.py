"""layouts.py: what mutation testing found unchecked (benchmarks/mutation.md)."""

from __future__ import annotations

import pytest

from napkin_dsl import layouts


@pytest.mark.parametrize(
    "expr, stripped",
    [
        ("(a + b)", "a + b"),  # one pair around the whole: dropped
        ("((a))", "(a)"),  # only one pair
        ("(a) + (b)", "(a) + (b)"),  # the first pair closes before the end: not around the whole
        ("(a * (b + c))", "a * (b + c)"),
        ("((a) + (b))", "(a) + (b)"),
        ("a", "a"),
        ("f(a)", "f(a)"),
        ("(a)[i]", "(a)[i]"),
    ],
)
def test_bare_drops_only_a_pair_of_parentheses_around_the_whole(expr, stripped):
    assert layouts.bare(expr) == stripped


def test_a_composition_takes_the_inner_inputs_and_gives_the_outer_outputs():
    # P_TO_A: an A fragment's (lane, i) -> (row, k) -> the accumulator pair that holds it
    composed = layouts.P_TO_A
    assert composed.inputs == layouts.MMA_A.inputs == ("lane", "i")
    assert composed.outputs == composed.outer.outputs
    assert len(composed.outputs) == len(composed.outer.outputs) > 0
    lane, i = 5, 3
    assert composed(lane, i) == composed.outer(*layouts.MMA_A(lane, i))


# The PTX ISA's fragment tables for mma.m16n8k16 with 16-bit operands and f32 accumulators,
# written out here: groupID = lane >> 2, threadID_in_group = lane % 4.
def ptx_a(lane, i):
    g, t = lane >> 2, lane % 4
    row = g + 8 * (i in (2, 3, 6, 7))
    col = t * 2 + (i & 1) + 8 * (i >= 4)
    return row, col


def ptx_b(lane, i):
    g, t = lane >> 2, lane % 4
    return t * 2 + (i & 1) + 8 * (i >= 2), g


def ptx_c(lane, i):
    g, t = lane >> 2, lane % 4
    return g + 8 * (i >= 2), t * 2 + (i & 1)


def test_the_fragment_functions_are_the_ptx_isa_tables():
    for lane in range(32):
        for i in range(8):
            assert layouts.mma_a(lane, i) == ptx_a(lane, i), (lane, i)
        for i in range(4):
            assert layouts.mma_b(lane, i) == ptx_b(lane, i), (lane, i)
            assert layouts.mma_c(lane, i) == ptx_c(lane, i), (lane, i)


@pytest.mark.parametrize("rows, cols, element_bytes", [(32, 128, 2), (128, 32, 2), (64, 64, 2), (16, 8, 2), (8, 16, 4)])
def test_a_swizzled_tile_takes_rows_times_pitch_bytes(rows, cols, element_bytes):
    tile = layouts.SwizzledTile(rows, cols, element_bytes)
    assert tile.pitch == cols * element_bytes
    assert tile.bytes == rows * cols * element_bytes
    # every element lands inside the tile, on a distinct byte offset
    offsets = {tile.offset(r, c) for r in range(rows) for c in range(cols)}
    assert len(offsets) == rows * cols
    assert min(offsets) >= 0 and max(offsets) < tile.bytes


@pytest.mark.parametrize("operand", ["a", "b"])
@pytest.mark.parametrize("trans", [True, False])
@pytest.mark.parametrize("outer, k", [(16, 0), (0, 16), (16, 16), (32, 48)])
def test_ldmatrix_phases_move_with_the_fragment_origin(operand, trans, outer, k):
    # Stored rows are k under .trans, outer (m or n) without it: moving the origin moves every row
    # read by that much (the swizzle only permutes 16-byte units within a row), and every address
    # stays inside the tile and differs from the origin's (the columns move by the other one)
    tile = layouts.SwizzledTile(64, 64, 2)
    at_zero = layouts.ldmatrix_phases(tile, operand, trans, 0, 0)
    moved = layouts.ldmatrix_phases(tile, operand, trans, outer, k)
    row_shift, col_shift = (k, outer) if trans else (outer, k)
    rows_zero = [[a // tile.pitch for a in phase] for phase in at_zero]
    rows_moved = [[a // tile.pitch for a in phase] for phase in moved]
    assert rows_moved == [[r + row_shift for r in phase] for phase in rows_zero]
    assert all(0 <= a < tile.bytes for phase in moved for a in phase)
    if col_shift:
        assert all(a != b for pm, pz in zip(moved, at_zero, strict=True) for a, b in zip(pm, pz, strict=True))


@pytest.mark.parametrize(
    "cols, element_bytes, covered",
    [(8, 2, True), (16, 2, True), (32, 2, True), (64, 2, True), (128, 2, True), (192, 2, True),
     (4, 4, True), (24, 2, False), (48, 2, False), (96, 2, False), (4, 2, False), (0, 2, False)],
)
def test_the_swizzle_covers_rows_of_16_32_64_or_a_multiple_of_128_bytes(cols, element_bytes, covered):
    pitch = cols * element_bytes
    assert covered == (pitch in (16, 32, 64) or (pitch > 0 and pitch % 128 == 0))  # the rule, on this row
    assert layouts.SwizzledTile.supports(cols, element_bytes) is covered
