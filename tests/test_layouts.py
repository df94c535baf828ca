"""Every layout object of ``napkin_dsl/layouts.py`` against the PTX ISA, and the layout algebra.

The ISA's fragment and ldmatrix formulas are written out again here (PTX ISA, "Matrix
Fragments for mma.m16n8k16 with floating point type" and "ldmatrix"), independently of
``layouts.py``, so that a wrong table there cannot agree with itself. ``tests/test_tensorcore.py``
holds the emulated primitives (printed from these layouts) against the same formulas on PoCL.
lane = %laneid, g = lane >> 2, t = lane % 4.
"""

from __future__ import annotations


import numpy as np
import pytest

from napkin_dsl import layouts
from napkin_dsl.paths.mma_sync import mma_shape
from napkin_dsl.layouts import (
    LDMATRIX_DELIVERS,
    LDMATRIX_DELIVERS_T,
    LDMATRIX_SOURCE,
    MMA_A,
    MMA_B,
    MMA_C,
    MMA_C_PAIR,
    MMA_C_VALUE,
    PACK16,
    Layout,
    Mode,
    SwizzledTile,
    compose,
    ldmatrix_b_registers,
    ldmatrix_delivers,
    ldmatrix_keyed_lane_expr,
    ldmatrix_keyed_offset_expr,
    ldmatrix_lane_terms,
    ldmatrix_offset_expr,
    ldmatrix_phases,
    offset_expr,
    p_to_a_registers,
    wavefronts,
)

# ---- the PTX ISA, written here ----------------------------------------------------------------


def isa_a(lane, i):
    """A (16 x 16, .row), a0..a7: row g for i in {0, 1, 4, 5}, else g + 8; col 2t + (i & 1), + 8 for i >= 4."""
    g, t = lane >> 2, lane % 4
    row = g if i in (0, 1, 4, 5) else g + 8
    col = 2 * t + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def isa_b(lane, i):
    """B (16 x 8, .col), b0..b3: row (k) 2t + (i & 1), + 8 for i >= 2; col (n) g."""
    g, t = lane >> 2, lane % 4
    return 2 * t + (i & 1) + (8 if i >= 2 else 0), g


def isa_c(lane, i):
    """C/D (16 x 8, f32), c0..c3: row g for i in {0, 1}, else g + 8; col 2t + (i & 1)."""
    g, t = lane >> 2, lane % 4
    return (g if i in (0, 1) else g + 8), 2 * t + (i & 1)


def isa_register(i):
    """A 16-bit fragment's elements two to a .b32 register: a0, a1 in the first (a0 low), ..."""
    return i // 2, i % 2


def isa_ldmatrix(lane, j, h, trans):
    """ldmatrix.x4: lanes 8j..8j+7 give the rows of matrix j (row r from lane 8j + r). Lane l
    receives in register j row l >> 2, columns 2(l % 4) and 2(l % 4) + 1 of matrix j; .trans
    delivers the transpose: column l >> 2 of rows 2(l % 4) and 2(l % 4) + 1. Returns (the lane
    that supplied the row, the element of that row)."""
    if not trans:
        return 8 * j + (lane >> 2), 2 * (lane % 4) + h
    return 8 * j + 2 * (lane % 4) + h, lane >> 2


LANES = range(32)


def test_fragment_layouts_are_the_ptx_isas():
    for lane in LANES:
        assert [MMA_A(lane, i) for i in range(8)] == [isa_a(lane, i) for i in range(8)]
        assert [MMA_B(lane, i) for i in range(4)] == [isa_b(lane, i) for i in range(4)]
        assert [MMA_C(lane, i) for i in range(4)] == [isa_c(lane, i) for i in range(4)]
        # pair h is c_2h, c_2h+1: the row of both and the first one's column
        assert [MMA_C_PAIR(lane, h) for h in range(2)] == [isa_c(lane, 2 * h) for h in range(2)]
    assert [MMA_C_VALUE(h, e) for h in range(2) for e in range(2)] == [0, 1, 2, 3]
    assert [PACK16(i) for i in range(8)] == [isa_register(i) for i in range(8)]
    assert (MMA_A.extent("lane"), MMA_A.extent("i"), MMA_B.extent("i"), MMA_C.extent("i")) == (32, 8, 4, 4)


def test_the_row_shuffle_masks_reach_exactly_the_lanes_holding_a_row():
    """A row reduction over the accumulator XORs lanes by layouts.ROW_LANE_MASKS: by the ISA's C
    layout (isa_c), the lanes that hold a row's columns are lane's group, all four of them."""
    for lane in LANES:
        row = isa_c(lane, 0)[0]
        holders = {other for other in LANES for i in range(4) if isa_c(other, i)[0] == row}
        reached = {lane}
        for mask in layouts.ROW_LANE_MASKS:
            reached |= {other ^ mask for other in reached}
        assert reached == holders and len(holders) == 4


def test_the_fragments_cover_the_instruction_shape_isel_plans_for():
    m, n, k = layouts.MMA_M, layouts.MMA_N, layouts.MMA_K
    assert mma_shape("bf16") == f"m{m}n{n}k{k}" and mma_shape("fp8e4m3") == f"m{m}n{n}k{layouts.MMA_K8}"
    assert sorted(MMA_A.table().values()) == [(r, c) for r in range(m) for c in range(k)]
    assert sorted(MMA_B.table().values()) == [(r, c) for r in range(k) for c in range(n)]
    assert sorted(MMA_C.table().values()) == [(r, c) for r in range(m) for c in range(n)]


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_delivery_is_the_isas(trans):
    layout = LDMATRIX_DELIVERS_T if trans else LDMATRIX_DELIVERS
    for lane in LANES:
        for j in range(4):
            for h in range(2):
                assert layout(lane, j, h) == isa_ldmatrix(lane, j, h, trans), (lane, j, h)


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("operand", ["a", "b"])
def test_ldmatrix_fills_the_mma_operand_fragments(operand, trans):
    """What ldmatrix.x4 delivers from the rows napkin's lanes give it (LDMATRIX_SOURCE) is the
    mma operand fragment: A's a_2j, a_2j+1 in register j; B's two n-tiles, registers as
    ldmatrix_b_registers says."""
    b_registers = ldmatrix_b_registers()
    for lane in LANES:
        for register in range(4):
            for half in range(2):
                supplier, element = isa_ldmatrix(lane, register, half, trans)
                row, col = LDMATRIX_SOURCE[(operand, trans)](supplier)
                stored = (row, col + element)
                assert ldmatrix_delivers(lane, register, half, operand, trans) == stored
                if operand == "a":
                    want = isa_a(lane, 2 * register + half)  # (m, k)
                else:
                    (nt, position), = [(nt, regs.index(register)) for nt, regs in enumerate(b_registers) if register in regs]
                    k, n = isa_b(lane, 2 * position + half)
                    want = (n + 8 * nt, k)  # (n, k)
                assert (stored[::-1] if trans else stored) == want, (lane, register, half)
    assert b_registers == [(0, 1), (2, 3)]  # what the printed mma calls read (b[0], b[1]), (b[2], b[3])


def test_p_to_a_repack_is_an_accumulator_pair_of_two_n_tiles():
    """P (16 x 16, two 16 x 8 accumulator tiles by the ISA's C layout) packed by
    p_to_a_registers is, register by register, the A fragment of the ISA: no lane exchanges."""
    rng = np.random.default_rng(0)
    P = rng.integers(0, 1000, size=(16, 16))
    for lane in LANES:
        acc = [[P[isa_c(lane, i)[0], 8 * nt + isa_c(lane, i)[1]] for i in range(4)] for nt in range(2)]
        for j, ((nt0, c0), (nt1, c1)) in enumerate(p_to_a_registers()):
            assert (acc[nt0][c0], acc[nt1][c1]) == (P[isa_a(lane, 2 * j)], P[isa_a(lane, 2 * j + 1)])


# ---- the algebra -------------------------------------------------------------------------------

ALL = {"MMA_A": MMA_A, "MMA_B": MMA_B, "MMA_C": MMA_C, "MMA_C_PAIR": MMA_C_PAIR, "MMA_C_VALUE": MMA_C_VALUE, "PACK16": PACK16,
       "LDMATRIX_DELIVERS": LDMATRIX_DELIVERS, "LDMATRIX_DELIVERS_T": LDMATRIX_DELIVERS_T,
       **{f"LDMATRIX_SOURCE{key}": layout for key, layout in LDMATRIX_SOURCE.items()},
       **{f"tile{shape}": SwizzledTile(*shape).layout for shape in [(32, 8, 2), (64, 32, 2), (64, 128, 2), (16, 192, 2), (16, 64, 4)]}}


def as_tuple(value):
    return value if isinstance(value, tuple) else (value,)


@pytest.mark.parametrize("name", sorted(ALL))
def test_printed_c_evaluates_to_the_layout_and_numpy_agrees(name):
    layout = ALL[name]
    names = [f"x{k}" for k in range(len(layout.inputs))]
    exprs = as_tuple(layout.c_expr(*names))
    points = list(layout.domain())
    for xs in points:
        scope = dict(zip(names, xs, strict=True))
        assert tuple(eval(e, scope) for e in exprs) == as_tuple(layout(*xs)), (name, xs)
    columns = [np.array(c) for c in zip(*points, strict=True)]
    vectorised = as_tuple(layout(*columns))
    for o, out in enumerate(vectorised):
        assert list(out) == [as_tuple(layout(*xs))[o] for xs in points]


def test_given_digits_and_origins_print_in_place_of_the_lane():
    row, n = MMA_C.tiled("nt", 2, (0, 8)).tiled("mt", 2, (16, 0)).c_expr("mt", "nt", "lane", "i", given={"g": "G", "t": "T"},
                                                                       origin=("W", None))
    assert "lane" not in row + n and "G" in row and "T" in n
    for mt in range(2):
        for nt in range(2):
            for lane in LANES:
                for i in range(4):
                    scope = {"mt": mt, "nt": nt, "i": i, "G": lane >> 2, "T": lane % 4, "W": 100}
                    want = isa_c(lane, i)
                    assert (eval(row, scope), eval(n, scope)) == (100 + 16 * mt + want[0], 8 * nt + want[1])


@pytest.mark.parametrize("name", ["MMA_A", "MMA_B", "MMA_C", "LDMATRIX_DELIVERS", "LDMATRIX_DELIVERS_T", "PACK16"])
def test_inverse_undoes_the_layout_and_prints(name):
    layout = ALL[name]
    inverse = layout.inverse()
    exprs = as_tuple(inverse.c_expr(*inverse.inputs))
    for xs in layout.domain():
        ys = as_tuple(layout(*xs))
        assert as_tuple(inverse(*ys)) == xs
        assert tuple(eval(e, dict(zip(inverse.inputs, ys, strict=True))) for e in exprs) == xs


def test_inverse_refuses_what_is_not_a_bijection():
    two_to_one = Layout(("x",), ("y",), (Mode(0, 1, 2, (1,)), Mode(0, 2, 2, (1,))))  # 0, 1, 1, 2
    with pytest.raises(AssertionError):
        two_to_one.inverse()
    with pytest.raises(AssertionError):  # one-to-one, but only onto the even columns
        MMA_C_PAIR.inverse()
    with pytest.raises(AssertionError):
        SwizzledTile(8, 64, 2).layout.inverse()


def test_composition_chains_and_prints():
    chained = compose(MMA_A.inverse(), MMA_A)  # the identity on (lane, i)
    exprs = chained.c_expr("lane", "i")
    for lane, i in MMA_A.domain():
        assert chained(lane, i) == (lane, i)
        assert tuple(eval(e, {"lane": lane, "i": i}) for e in exprs) == (lane, i)
    # ldmatrix then the A fragment: the value a lane gets, found by where its supplier points
    for lane in LANES:
        via = compose(LDMATRIX_SOURCE[("a", False)], Layout(("s",), ("lane",), (Mode(0, 1, 32, (1,)),)))
        supplier, element = LDMATRIX_DELIVERS(lane, 1, 0)
        row, col = via(supplier)
        assert (row, col + element) == isa_a(lane, 2)


def test_tiled_layouts_step_by_their_stride():
    tiled = MMA_C.tiled("nt", 3, (0, 8))
    assert tiled.extent("nt") == 3
    for nt in range(3):
        for lane in LANES:
            assert tiled(nt, lane, 1) == (isa_c(lane, 1)[0], 8 * nt + isa_c(lane, 1)[1])


# ---- shared tiles: the swizzle -----------------------------------------------------------------


def isa_key(rows_per_line_pitch, row):
    """The swizzle (docs/tensor-cores.md): unit u of row r at u ^ key(r), key(r) = (r // rows that
    share a 128-byte line) mod (units of that line one row owns)."""
    pitch = rows_per_line_pitch
    return (row // max(1, 128 // pitch)) % min(8, pitch // 16)


@pytest.mark.parametrize("cols, element_bytes", [(8, 2), (16, 2), (32, 2), (64, 2), (128, 2), (192, 2), (256, 2), (64, 4)])
def test_swizzled_tile_is_a_bijection_by_the_documented_key(cols, element_bytes):
    tile = SwizzledTile(32, cols, element_bytes)
    expr = offset_expr(tile, "r", "c")
    offsets = []
    for r in range(tile.rows):
        for c in range(cols):
            byte = c * element_bytes
            want = r * tile.pitch + ((byte // 16) ^ isa_key(tile.pitch, r)) * 16 + byte % 16
            assert tile.offset(r, c) == want == eval(expr, {"r": r, "c": c})
            offsets.append(want)
    assert sorted(offsets) == list(range(0, tile.bytes, element_bytes))  # a permutation of the tile


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("operand", ["a", "b"])
def test_ldmatrix_lane_terms_split_the_tile_offset(operand, trans):
    """The printer's hoisted per-lane constants plus each origin's part are the tile's offset."""
    for tile in [SwizzledTile(64, 64, 2), SwizzledTile(64, 16, 2), SwizzledTile(32, 192, 2)]:
        base, x = ldmatrix_lane_terms(tile, operand, trans)
        for lane in LANES:
            lb, lx = eval(base, {"lane": lane}), eval(x, {"lane": lane})
            lr, lc = LDMATRIX_SOURCE[(operand, trans)](lane)
            for row0 in range(0, tile.rows - 15, 8):
                for col0 in range(0, tile.cols - 15, 16):
                    u0 = col0 * tile.element_bytes // 16
                    offset = eval(ldmatrix_offset_expr(tile, str(row0), str(u0), str(lb), str(lx)))
                    assert offset == tile.offset(row0 + lr, col0 + lc), (tile, lane, row0, col0)


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("operand", ["a", "b"])
def test_keyed_ldmatrix_offsets_are_the_tile_offset_with_a_buffer_added_after_the_xor(operand, trans):
    """The keyed lane constant (row offset plus swizzle key) XOR-ed by the unit, then any multiple
    of 128 bytes (a buffer) added before or after the XOR, is the tile's offset: the form the
    tensor printer emits."""
    for tile in [SwizzledTile(64, 64, 2), SwizzledTile(64, 16, 2), SwizzledTile(32, 192, 2), SwizzledTile(64, 128, 2)]:
        base, x = ldmatrix_lane_terms(tile, operand, trans)
        for lane in LANES:
            keyed = eval(ldmatrix_keyed_lane_expr(base, x), {"lane": lane})
            lr, lc = LDMATRIX_SOURCE[(operand, trans)](lane)
            for row0 in range(0, tile.rows - 15, 8):
                for col0 in range(0, tile.cols - 15, 16):
                    u0 = col0 * tile.element_bytes // 16
                    offset = eval(ldmatrix_keyed_offset_expr(tile, str(row0), str(u0), str(keyed)))
                    assert offset == tile.offset(row0 + lr, col0 + lc), (tile, lane, row0, col0)
                    buffer = 3 * 128 * tile.rows  # a later stage's buffer: the XOR leaves it as added before
                    moved = eval(ldmatrix_keyed_offset_expr(tile, str(row0), str(u0), str(keyed + buffer)))
                    assert moved == offset + buffer


# ---- bank conflicts ---------------------------------------------------------------------------

TILES = [SwizzledTile(rows, cols, 2) for rows, cols in [(64, 16), (128, 32), (64, 64), (64, 128), (32, 256)]]


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t.rows}x{t.cols}")
def test_ldmatrix_reads_are_free_of_bank_conflicts(tile):
    for operand in "ab":
        for trans in (False, True):
            outer_extent, k_extent = (tile.cols, tile.rows) if trans else (tile.rows, tile.cols)
            if outer_extent < 16 or k_extent < 16:
                continue
            for outer in range(0, outer_extent, 16):
                for k in range(0, k_extent, 16):
                    for phase in ldmatrix_phases(tile, operand, trans, outer, k):
                        assert wavefronts(phase) == 1, (operand, trans, outer, k)


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t.rows}x{t.cols}")
def test_cp_async_writes_are_free_of_bank_conflicts(tile):
    """Each warp writes 32 consecutive 16-byte units, as the printed copy loop hands them out."""
    units = tile.units_per_row
    total = tile.rows * units
    for first in range(0, total, 32):
        addresses = [tile.unit_offset(u // units, u % units) for u in range(first, min(first + 32, total))]
        assert wavefronts(addresses) == -(-len(addresses) // 8)


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t.rows}x{t.cols}")
def test_epilogue_writes_of_accumulator_pairs_are_free_of_bank_conflicts(tile):
    """The staged epilogue: lane (g, t) writes columns 2t, 2t + 1 of row g (then g + 8) as 4 bytes."""
    for row0 in range(0, tile.rows, 16):
        for n0 in range(0, tile.cols, 8):
            for half in range(2):
                addresses = [tile.offset(row0 + isa_c(lane, 2 * half)[0], n0 + isa_c(lane, 2 * half)[1]) for lane in LANES]
                assert wavefronts(addresses, width=4) == 1


def test_the_bank_conflict_test_finds_conflicts_without_the_swizzle():
    class Unswizzled(SwizzledTile):
        def key(self, row):
            return 0

    tile = Unswizzled(64, 128, 2)
    phase = ldmatrix_phases(tile, "a", False, 0, 0)[0]
    assert wavefronts(phase) == 8  # eight 256-byte rows at one column: one bank group


# ---- the printers read these objects ------------------------------------------------------------


def test_the_opencl_emulation_is_printed_from_the_layouts():
    from napkin_dsl.backends.tensorcore import OPENCL_PRELUDE

    for expr in (*LDMATRIX_DELIVERS.c_expr("lane", "j", "h"), *LDMATRIX_DELIVERS_T.c_expr("lane", "j", "h"),
                 *MMA_A.inverse().c_expr("row", "k"), *MMA_B.inverse().c_expr("k", "n"), *MMA_C.c_expr("lane", "i")):
        assert expr in OPENCL_PRELUDE, expr


def test_a_named_digit_prints_as_the_isas_group_and_thread():
    for lane in LANES:
        assert eval(MMA_C.digit_expr("g", "lane", "i")) == lane >> 2
        assert eval(MMA_C.digit_expr("t", "lane", "i")) == lane % 4


# ---- mma.sync m16n8k32 with e4m3 / e5m2 operands ---------------------------------------------
# PTX ISA, "Matrix Fragments for mma.m16n8k32" (.e4m3 / .e5m2 multiplicands, f32 accumulators),
# written out again here.


def isa_a8(lane, i):
    """A (16 x 32), a0..a15: row g for 0 <= i < 4 or 8 <= i < 12, else g + 8;
    col (k) 4t + (i & 3), + 16 for i >= 8."""
    g, t = lane >> 2, lane % 4
    row = g if (i < 4 or 8 <= i < 12) else g + 8
    col = 4 * t + (i & 3) + (16 if i >= 8 else 0)
    return row, col


def isa_b8(lane, i):
    """B (32 x 8), b0..b7: row (k) 4t + (i & 3), + 16 for i >= 4; col (n) g."""
    g, t = lane >> 2, lane % 4
    return 4 * t + (i & 3) + (16 if i >= 4 else 0), g


def test_the_fp8_fragments_are_the_ptx_isas():
    from napkin_dsl.layouts import MMA_A8, MMA_B8, MMA_K8, PACK8

    for lane in range(32):
        assert [MMA_A8(lane, i) for i in range(16)] == [isa_a8(lane, i) for i in range(16)]
        assert [MMA_B8(lane, i) for i in range(8)] == [isa_b8(lane, i) for i in range(8)]
    # four 8-bit elements per .b32 register, the lowest-indexed in the low byte
    assert [PACK8(i) for i in range(16)] == [(i // 4, i % 4) for i in range(16)]
    assert (MMA_A8.extent("i"), MMA_B8.extent("i"), MMA_K8) == (16, 8, 32)
    # each covers its matrix once: 16 x 32 of A, 32 x 8 of B
    assert sorted(MMA_A8(lane, i) for lane in range(32) for i in range(16)) == [(r, k) for r in range(16) for k in range(32)]
    assert sorted(MMA_B8(lane, i) for lane in range(32) for i in range(8)) == [(k, n) for k in range(32) for n in range(8)]


def test_a_k_contiguous_fp8_fragment_is_the_16_bit_fragment_of_the_same_bytes():
    """Why ldmatrix (16-bit) loads the fp8 A fragment, and B from a k-contiguous tile: read as
    bytes, register j of the ISA's 16-bit fragment (16 x 16 A, 16 x 8 B) holds what register j of
    the ISA's 8-bit fragment (16 x 32, 32 x 8) holds. Computed from the formulas above; and a B
    stored n-contiguous ([k n]) is not so: no 16-bit transpose gives its 4 consecutive k."""
    from napkin_dsl.layouts import MMA_A8, MMA_B8, fp8_fragment_is_b16_bytes

    for lane in range(32):
        for i in range(16):
            register, byte = i // 4, i % 4
            row, k16 = isa_a(lane, 2 * register + byte // 2)
            assert isa_a8(lane, i) == (row, 2 * k16 + byte % 2)
        for i in range(8):
            register, byte = i // 4, i % 4
            k16, n = isa_b(lane, 2 * register + byte // 2)
            assert isa_b8(lane, i) == (2 * k16 + byte % 2, n)
    assert fp8_fragment_is_b16_bytes(MMA_A8, MMA_A) and fp8_fragment_is_b16_bytes(MMA_B8, MMA_B)
    # the checker sees a wrong layout: a fragment with its row halves swapped is not the bytes
    swapped = Layout(MMA_A8.inputs, MMA_A8.outputs, MMA_A8.modes[:3] + (Mode(1, 4, 2, (0, 16)), Mode(1, 8, 2, (8, 0))))
    assert not fp8_fragment_is_b16_bytes(swapped, MMA_A)


@pytest.mark.parametrize("name", ["MMA_A8", "MMA_B8"])
def test_the_fp8_fragments_invert_and_print(name):
    layout = getattr(layouts, name)
    inverse = layout.inverse()
    outs = inverse.c_expr(*layout.outputs)
    for lane, i in layout.domain():
        x, y = layout(lane, i)
        assert inverse(x, y) == (lane, i)
        env = dict(zip(layout.outputs, (x, y), strict=True))
        assert tuple(eval(e, {}, env) for e in outs) == (lane, i)


def test_p_feeds_the_fp8_a_fragment_in_a_permuted_key_order():
    """layouts.KEY_ORDER8 is a permutation of a 32-key step under which every register of the
    ISA's 8-bit A fragment is four accumulators of the same lane (the ISA's C fragment, four
    n-tiles side by side): key(16h + 4t + e) = 16h + 2t + (e & 1) + 8 (e >> 1), written here."""
    from napkin_dsl.layouts import KEY_ORDER8, p_to_a8_registers

    def key(k):
        h, t, e = k // 16, (k % 16) // 4, k % 4
        return 16 * h + 2 * t + (e & 1) + 8 * (e >> 1)

    assert [KEY_ORDER8(k) for k in range(32)] == [key(k) for k in range(32)]
    assert sorted(key(k) for k in range(32)) == list(range(32))
    registers = p_to_a8_registers()
    for lane in range(32):
        for i in range(16):
            row, k = isa_a8(lane, i)
            nt, c = registers[i // 4][i % 4]
            c_row, c_col = isa_c(lane, c)
            assert (c_row, 8 * nt + c_col) == (row, key(k)), (lane, i)
    # in the ISA's own k order no such repack exists: some A register needs another lane's value
    held = {(isa_c(lane, c)[0], 8 * nt + isa_c(lane, c)[1]): lane for lane in range(32) for nt in range(4) for c in range(4)}
    assert any(held[isa_a8(lane, i)] != lane for lane in range(32) for i in range(16))
