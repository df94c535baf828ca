"""Layouts as data: swizzled shared-memory tiles and the mma.sync m16n8k16 fragments.

Everything the tensor-core printer (``tensorcore.py``) needs to know about where a value
lives is here, as small functions of (row, column) or (lane, register), so it can be tested
on its own (``tests/test_tensorcore.py``) instead of being trusted inside printed index
arithmetic:

* :class:`SwizzledTile`: a 2-D tile in shared memory, rows of ``pitch`` bytes, whose 16-byte
  units are XOR-permuted within each 128-byte line so that the eight 16-byte rows one
  ``ldmatrix`` phase reads, and the 16-byte chunks one ``cp.async`` wavefront writes, fall in
  eight different bank groups;
* the per-lane fragment layouts of ``mma.sync.aligned.m16n8k16`` (PTX ISA, "Matrix Fragments
  for mma.m16n8k16 with floating point type") and of ``ldmatrix.x4`` (PTX ISA, "ldmatrix");
* :func:`wavefronts`: how many 128-byte shared-memory wavefronts a set of addresses takes,
  the measure the bank-conflict test uses.

Deliberately not here: printing code (the printers turn these formulas into expressions),
wgmma layouts (sm_90a), 8-bit fragments.
"""

from __future__ import annotations

from dataclasses import dataclass

UNIT = 16  # bytes one lane moves with ldmatrix (a row of an 8x8 b16 matrix) or cp.async
LINE = 128  # bytes in one shared-memory wavefront: 32 banks x 4 bytes


# ---- shared-memory tiles --------------------------------------------------------------------


@dataclass(frozen=True)
class SwizzledTile:
    """A rows x cols tile of ``element_bytes`` values, row-major, 16-byte units XOR-swizzled.

    Unit ``u`` of row ``r`` is stored at unit ``u ^ key(r)`` of the same row, where
    ``key(r) = (r // rows_per_line) % 2**bits`` and only the low ``bits`` of ``u`` change, so a
    unit never leaves its 128-byte segment. ``rows_per_line`` rows share one 128-byte line when
    rows are shorter than a line; ``bits`` is log2 of the units in a line that one row owns.
    """

    rows: int
    cols: int
    element_bytes: int

    @property
    def pitch(self) -> int:
        return self.cols * self.element_bytes

    @property
    def units_per_row(self) -> int:
        return self.pitch // UNIT

    @property
    def rows_per_line(self) -> int:
        return max(1, LINE // self.pitch)

    @property
    def bits(self) -> int:
        owned = min(self.units_per_row, LINE // UNIT)
        return owned.bit_length() - 1

    @property
    def bytes(self) -> int:
        return self.rows * self.pitch

    @staticmethod
    def supports(cols: int, element_bytes: int) -> bool:
        """Rows of 16, 32 or 64 bytes, or any multiple of 128: the pitches this swizzle covers."""
        pitch = cols * element_bytes
        return pitch in (16, 32, 64) or (pitch > 0 and pitch % LINE == 0)

    def key(self, row: int) -> int:
        return (row // self.rows_per_line) % (1 << self.bits)

    def unit_offset(self, row: int, unit: int) -> int:
        """Byte offset of logical 16-byte unit ``unit`` of ``row``."""
        return row * self.pitch + (unit ^ self.key(row)) * UNIT

    def offset(self, row: int, col: int) -> int:
        """Byte offset of element (row, col)."""
        byte = col * self.element_bytes
        return self.unit_offset(row, byte // UNIT) + byte % UNIT


# ---- mma.sync m16n8k16 fragments (16-bit operands, f32 accumulators) ------------------------
# lane = %laneid, g = lane >> 2, t = lane % 4.


def mma_a(lane: int, i: int) -> tuple[int, int]:
    """(row, k) of element a_i (i in 0..7) of the 16x16 A fragment held by ``lane``."""
    g, t = lane >> 2, lane % 4
    row = g + 8 * ((i >> 1) & 1)
    k = 2 * t + (i & 1) + 8 * (i >> 2)
    return row, k


def mma_b(lane: int, i: int) -> tuple[int, int]:
    """(k, n) of element b_i (i in 0..3) of the 16x8 B fragment held by ``lane``."""
    g, t = lane >> 2, lane % 4
    return 2 * t + (i & 1) + 8 * (i >> 1), g


def mma_c(lane: int, i: int) -> tuple[int, int]:
    """(row, n) of accumulator c_i (i in 0..3) of the 16x8 C/D fragment held by ``lane``."""
    g, t = lane >> 2, lane % 4
    return g + 8 * (i >> 1), 2 * t + (i & 1)


# ---- ldmatrix.x4 ----------------------------------------------------------------------------
# Lanes 8j..8j+7 give the row addresses of 8x8 matrix j; register j of lane l receives row
# l >> 2, columns 2(l % 4) and 2(l % 4) + 1 of matrix j (the transpose with .trans).


def ldmatrix_source(lane: int, operand: str, trans: bool) -> tuple[int, int]:
    """The (stored row, stored column) of the 16-byte row whose address ``lane`` supplies.

    ``operand`` "a": the four matrices are A's (rows 0-7, k 0-7), (rows 8-15, k 0-7),
    (rows 0-7, k 8-15), (rows 8-15, k 8-15), so registers 0..3 are a0a1, a2a3, a4a5, a6a7.
    ``operand`` "b": two adjacent n-tiles of B at one k-step: (n 0-7, k 0-7), (n 0-7, k 8-15),
    (n 8-15, k 0-7), (n 8-15, k 8-15): registers 0, 1 are the first n-tile's b0b1, b2b3.
    Stored rows are the operand's outer axis: m or n without ``trans``, k with it.
    """
    j, r = lane >> 3, lane % 8
    if operand == "a":
        outer, inner = 8 * (j & 1), 8 * (j >> 1)  # (m, k) offsets of matrix j
    else:
        outer, inner = 8 * (j >> 1), 8 * (j & 1)  # (n, k) offsets of matrix j
    if not trans:
        return outer + r, inner
    return inner + r, outer


def ldmatrix_delivers(lane: int, register: int, half: int, operand: str, trans: bool) -> tuple[int, int]:
    """(stored row, stored column) of the value in half ``half`` of ``register`` of ``lane``."""
    rows_of = {src_lane: ldmatrix_source(src_lane, operand, trans) for src_lane in range(32)}
    if not trans:
        row, col = rows_of[8 * register + (lane >> 2)]
        return row, col + 2 * (lane % 4) + half
    row, col = rows_of[8 * register + 2 * (lane % 4) + half]
    return row, col + (lane >> 2)


def ldmatrix_phases(tile: SwizzledTile, operand: str, trans: bool, outer: int, k: int) -> list[list[int]]:
    """Byte offsets each 8-lane phase of one ldmatrix.x4 reads, at fragment origin (outer, k):
    outer is m (operand "a") or n ("b"); stored rows are k when ``trans``."""
    phases = []
    for j in range(4):
        addresses = []
        for lane in range(8 * j, 8 * j + 8):
            row, col = ldmatrix_source(lane, operand, trans)
            row, col = (row + k, col + outer) if trans else (row + outer, col + k)
            addresses.append(tile.offset(row, col))
        phases.append(addresses)
    return phases


# ---- bank conflicts -------------------------------------------------------------------------


def wavefronts(addresses: list[int], width: int = UNIT) -> int:
    """128-byte wavefronts one warp-wide shared access of ``width`` bytes per lane takes.

    Each wavefront serves at most one distinct 4-byte word per bank; lanes reading the same
    word share it. For 16-byte accesses that is one distinct 16-byte unit per bank group.
    """
    per_bank: dict[int, set[int]] = {}
    for address in addresses:
        for word in range(address // 4, (address + width) // 4):
            per_bank.setdefault(word % 32, set()).add(word)
    return max(len(words) for words in per_bank.values())


# ---- the same formulas as C expressions (the printers' spelling; tests evaluate both) -------

# (stored row, stored column) offsets of the 16-byte row whose address a lane supplies to
# ldmatrix.x4, in terms of `lane`; see ldmatrix_source.
LDMATRIX_SOURCE_EXPR = {
    ("a", False): ("((lane & 7) + (((lane >> 3) & 1) << 3))", "((lane >> 4) << 3)"),
    ("a", True): ("((lane & 7) + ((lane >> 4) << 3))", "(((lane >> 3) & 1) << 3)"),
    ("b", False): ("((lane & 7) + ((lane >> 4) << 3))", "(((lane >> 3) & 1) << 3)"),
    ("b", True): ("((lane & 7) + (((lane >> 3) & 1) << 3))", "((lane >> 4) << 3)"),
}


def offset_expr(tile: SwizzledTile, row: str, col: str) -> str:
    """``tile.offset(row, col)`` as a C expression (non-negative ints: Python evaluates it alike)."""
    eb = tile.element_bytes
    shift = tile.rows_per_line.bit_length() - 1
    mask = (1 << tile.bits) - 1
    byte = f"(({col}) * {eb})"
    key = f"((({row}) >> {shift}) & {mask})" if mask else "0"
    return f"(({row}) * {tile.pitch} + ((({byte} >> 4) ^ {key}) << 4) + ({byte} & 15))"


def ldmatrix_lane_terms(tile: SwizzledTile, operand: str, trans: bool) -> tuple[str, str]:
    """The per-lane constants of an ldmatrix address, as C expressions in ``lane``.

    For a fragment origin (row0, col0) with row0 a multiple of 8 and col0 a multiple of 16
    values (every origin the printer uses), the lane's byte offset splits into

        tile.offset(row0 + lr, col0 + lc) == row0 * pitch + base
                                             + ((u0 & ~mask) << 4) + (((u0 & mask) ^ x) << 4)

    with u0 = col0 * element_bytes / 16, mask = 2**bits - 1 and (base, x) returned here: the
    swizzle key depends on the lane's row only, so a kernel computes both once and every
    ldmatrix in its loops costs one XOR with a constant and additions.
    """
    lr, lc = LDMATRIX_SOURCE_EXPR[(operand, trans)]
    shift = tile.rows_per_line.bit_length() - 1
    mask = (1 << tile.bits) - 1
    base = f"(({lr}) * {tile.pitch})"
    x = f"(((({lc}) * {tile.element_bytes}) >> 4) ^ ((({lr}) >> {shift}) & {mask}))"
    return base, x


def ldmatrix_offset_expr(tile: SwizzledTile, row0: str, u0: str, base: str, x: str) -> str:
    """The offset of :func:`ldmatrix_lane_terms` for origin row ``row0`` and unit ``u0``."""
    mask = (1 << tile.bits) - 1
    return f"(({row0}) * {tile.pitch} + {base} + ((({u0}) & {~mask & 0xFFFF}) << 4) + (((({u0}) & {mask}) ^ {x}) << 4))"
