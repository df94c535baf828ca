"""Layouts as data: swizzled shared-memory tiles, the mma.sync m16n8k16 and m16n8k32 fragments, and wgmma's.

Where every value of a fragment or shared tile lives, in the manner of CuTe. A
:class:`Layout` maps named integer inputs (a lane and a value index; a row and a column) to
named outputs (a row and a column; a byte offset). Each input is cut into digits (mixed radix,
``(x * scale // div) % size``, the most significant digit left unreduced), every digit has a
stride in each output, and an optional :class:`Swizzle` XORs bits of one input into one digit
before the strides apply, as the shared tiles do. The same object is evaluated in Python (on
ints or NumPy arrays alike) and printed as a C expression (:meth:`Layout.c_expr`: CUDA and
OpenCL C share the expression; the caller names the inputs), so the CUDA kernel, its OpenCL
emulation and the tests read one definition. :meth:`Layout.inverse` inverts a bijective
layout of bit fields; :func:`compose` chains two.

The objects:

* :data:`MMA_A`, :data:`MMA_B`, :data:`MMA_C`: the per-lane fragments of
  ``mma.sync.aligned.m16n8k16`` for 16-bit operands and f32 accumulators (PTX ISA, "Matrix
  Fragments for mma.m16n8k16 with floating point type"); :data:`MMA_C_PAIR`, an accumulator
  fragment read as its two pairs of adjacent columns; :data:`PACK16`, where value ``i`` of a
  16-bit fragment sits in its ``.b32`` registers; :data:`P_TO_A`, the accumulator pair of two
  n-tiles that becomes an A fragment (P feeds the second product with no shuffle);
* :data:`MMA_A8`, :data:`MMA_B8`: ``mma.sync.aligned.m16n8k32``'s fragments for e4m3/e5m2
  operands (its accumulators are :data:`MMA_C`'s), :data:`PACK8` their bytes in registers, and
  :func:`fp8_fragment_is_b16_bytes`, why ldmatrix loads them from k-contiguous tiles;
  :data:`KEY_ORDER8` and :func:`p_to_a8_registers`, the key order in which P's accumulators
  are an 8-bit A fragment (and V's rows are read);
* :data:`LDMATRIX_SOURCE`: the stored row each lane gives ``ldmatrix.x4`` (plain and
  ``.trans``) for napkin's A and B operands, and :data:`LDMATRIX_DELIVERS` /
  :data:`LDMATRIX_DELIVERS_T`: which supplied row, and which element of it, each register
  half of each lane receives (PTX ISA, "ldmatrix");
* :class:`SwizzledTile`: a 2-D tile in shared memory, rows of ``pitch`` bytes, whose 16-byte
  units are XOR-permuted within each 128-byte line so that the eight 16-byte rows one
  ``ldmatrix`` phase reads, and the 16-byte chunks one ``cp.async`` wavefront writes, fall in
  eight different bank groups; its :attr:`SwizzledTile.layout` is the (row, col) -> byte map;
* :func:`wavefronts`: how many 128-byte shared-memory wavefronts a set of addresses takes,
  the measure the bank-conflict test uses;
* for ``wgmma.mma_async`` (sm_90a): :func:`wgmma_d`, the m64nN f32 accumulator fragment;
  :func:`wgmma_a`, the register fragment of A (attention's P);
  :class:`CanonicalTile`, the canonical 128B/64B/32B-swizzled shared layouts (K-major or
  MN-major); :class:`MatrixDescriptor`, the 64-bit matrix descriptor encoder;
  :func:`transpose_split`, how a warp's lanes share the K-major copy of an 8-bit MN-major
  operand, chosen by counting :func:`wavefronts` on the two canonical tiles.

Deliberately not here: CuTe's full algebra (hierarchical shapes, complements, divides:
napkin's layouts are flat bit fields, and composition is functional), the printers' loops and
origins (``backends/tensorcore.py``), the no-swizzle and interleaved layouts, and wgmma's 8-bit
operands.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache, cached_property
from itertools import product

from .dtypes import FP8_DTYPES

UNIT = 16  # bytes one lane moves with ldmatrix (a row of an 8x8 b16 matrix) or cp.async
LINE = 128  # bytes in one shared-memory wavefront: 32 banks x 4 bytes


# ---- the layout type ------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """One digit of input ``input``: ``(x * scale // div) % size``, stepping each output by
    ``stride``. ``name`` lets a printer substitute a value it already holds (``nk_g``)."""

    input: int
    div: int
    size: int
    stride: tuple[int, ...]
    name: str = ""


@dataclass(frozen=True)
class Swizzle:
    """Digit ``dst`` (a mode index) is XORed with ``(input src >> shift) & (2**bits - 1)``."""

    src: int
    shift: int
    bits: int
    dst: int

    def key(self, x):
        return (x >> self.shift) & ((1 << self.bits) - 1)


def bare(expr: str) -> str:
    """``expr`` without one pair of parentheses around the whole of it (an index, a statement)."""
    if not (expr.startswith("(") and expr.endswith(")")):
        return expr
    depth = 0
    for i, ch in enumerate(expr):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and i < len(expr) - 1:
            return expr
    return expr[1:-1]


def _log2(n: int) -> int | None:
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else None


@dataclass(frozen=True)
class Layout:
    """Named inputs -> named outputs, as digits with strides and an optional swizzle."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    modes: tuple[Mode, ...]
    scale: tuple[int, ...] = ()  # per input, before its digits (bytes per element); () is all 1
    swizzle: Swizzle | None = None

    def _scale(self, k: int) -> int:
        return self.scale[k] if self.scale else 1

    @cached_property
    def _top(self) -> dict[int, int]:
        """Per input, the index of its most significant mode (left unreduced)."""
        top: dict[int, int] = {}
        for index, mode in enumerate(self.modes):
            if mode.input not in top or mode.div > self.modes[top[mode.input]].div:
                top[mode.input] = index
        return top

    def extent(self, name: str) -> int:
        """How many values input ``name`` takes."""
        k = self.inputs.index(name)
        top = self.modes[self._top[k]]
        return top.div * top.size // self._scale(k)

    def domain(self):
        """Every input tuple, first input slowest."""
        return product(*(range(self.extent(name)) for name in self.inputs))

    def digits(self, *xs) -> list:
        out = []
        for index, mode in enumerate(self.modes):
            x = xs[mode.input] * self._scale(mode.input) // mode.div
            out.append(x if self._top[mode.input] == index else x % mode.size)
        return out

    def __call__(self, *xs, key=None):
        """The outputs at ``xs`` (ints or NumPy arrays): a tuple, or the value of a single output.
        ``key`` replaces the swizzle's XOR value (a control test's unswizzled tile)."""
        assert len(xs) == len(self.inputs), (self.inputs, xs)
        digits = self.digits(*xs)
        if self.swizzle is not None:
            s = self.swizzle
            digits[s.dst] = digits[s.dst] ^ (s.key(xs[s.src]) if key is None else key)
        outs = [0] * len(self.outputs)
        for digit, mode in zip(digits, self.modes, strict=True):
            for o, stride in enumerate(mode.stride):
                if stride:
                    outs[o] = outs[o] + digit * stride
        return outs[0] if len(outs) == 1 else tuple(outs)

    def c_expr(self, *names: str, given: dict[str, str] | None = None, origin: tuple[str | None, ...] = ()):
        """The outputs as C expressions of the input expressions ``names`` (inserted as given:
        parenthesise a compound one; an integer literal folds), a tuple or one string.
        ``given`` maps a mode's name to a variable already holding that digit (printed
        coefficient first: ``2 * nk_t``); ``origin`` adds a first term per output (a warp's
        first row). Non-negative ints only, where C's shifts, masks and division agree with
        Python's, so the tests evaluate the same text."""
        given = given or {}
        terms: list[list[str]] = [[o] if o else [] for o in origin] or [[] for _ in self.outputs]
        swizzled = None if self.swizzle is None else self.swizzle.dst
        for index, mode in enumerate(self.modes):
            if not any(mode.stride):
                continue
            literal = names[mode.input].isdigit() and index != swizzled
            if literal:
                x = int(names[mode.input]) * self._scale(mode.input) // mode.div
                value = x if self._top[mode.input] == index else x % mode.size
            elif mode.name in given:
                digit, style = given[mode.name], "given"
            else:
                digit, style = self._digit_expr(index, names)
            if index == swizzled:
                s = self.swizzle
                key = f"(({names[s.src]} >> {s.shift}) & {(1 << s.bits) - 1})" if s.bits else "0"
                digit, style = f"({digit} ^ {key})", "bits"
            for o, stride in enumerate(mode.stride):
                if not stride:
                    continue
                if literal:
                    if value:
                        terms[o].append(str(value * stride))
                elif stride == 1:
                    terms[o].append(digit)
                elif style == "given":
                    terms[o].append(f"{stride} * {digit}")
                elif style == "product" or _log2(stride) is None:
                    terms[o].append(f"{digit} * {stride}" if style == "product" else f"({digit} * {stride})")
                else:
                    terms[o].append(f"({digit} << {_log2(stride)})")
        exprs = tuple("0" if not t else t[0] if len(t) == 1 else f"({' + '.join(t)})" for t in terms)
        return exprs[0] if len(exprs) == 1 else exprs

    def _digit_expr(self, index: int, names) -> tuple[str, str]:
        """Mode ``index``'s digit as C, and how it takes a stride: "product" for a whole input or
        its top digit (``h * 8``, ``(i >> 1) * 8``), "bits" for a masked field (``<< 3``)."""
        mode = self.modes[index]
        k = mode.input
        x = names[k] if self._scale(k) == 1 else f"({names[k]} * {self._scale(k)})"
        top = self._top[k] == index
        if top and mode.div == 1:
            return x, "product"
        if top:
            return f"({x} >> {_log2(mode.div)})", "product"
        if mode.div == 1:
            return f"({x} & {mode.size - 1})", "bits"
        return f"(({x} >> {_log2(mode.div)}) & {mode.size - 1})", "bits"

    def digit_expr(self, name: str, *names: str) -> str:
        """The digit of the mode called ``name`` as C (a lane's g), for a printer to hold once."""
        (index,) = [i for i, mode in enumerate(self.modes) if mode.name == name]
        return self._digit_expr(index, names)[0]

    def xor_masks(self, digit: str) -> tuple[int, ...]:
        """The XOR masks of input 0 (a lane) that step through every value of its digit named
        ``digit`` and change no other digit: the butterfly shuffles that reduce over the lanes
        that digit tells apart (:data:`ROW_LANE_MASKS`)."""
        (mode,) = [m for m in self.modes if m.name == digit and m.input == 0]
        bits = _log2(mode.size)
        assert bits is not None and _log2(mode.div) is not None, f"napkin bug: digit {digit} is not a bit field"
        return tuple(mode.div << b for b in range(bits))

    def table(self) -> dict:
        """Input tuple -> outputs, over the whole domain."""
        return {xs: self(*xs) for xs in self.domain()}

    def tiled(self, name: str, count: int, stride: tuple[int, ...]) -> Layout:
        """``count`` copies side by side (CuTe's blocked product): a new first input ``name``
        whose every step moves the outputs by ``stride`` (the m-tiles of a warp's rows)."""
        assert not self.scale, "napkin bug: tiling a scaled layout"
        shifted = tuple(Mode(m.input + 1, m.div, m.size, m.stride, m.name) for m in self.modes)
        swizzle = None if self.swizzle is None else Swizzle(self.swizzle.src + 1, self.swizzle.shift, self.swizzle.bits,
                                                           self.swizzle.dst + 1)
        return Layout((name,) + self.inputs, self.outputs, (Mode(0, 1, count, stride),) + shifted, swizzle=swizzle)

    def inverse(self) -> Layout:
        """The inverse of a bijection whose digits are bit fields each feeding one output
        (every fragment and ldmatrix map here): each digit becomes a digit of that output,
        striding the input it came from. Raises AssertionError for anything else."""
        assert self.swizzle is None and not self.scale, "napkin bug: inverting a swizzled or scaled layout"
        modes = []
        for mode in self.modes:
            (o,) = [o for o, s in enumerate(mode.stride) if s]
            assert _log2(mode.stride[o]) is not None and _log2(mode.size) is not None, mode
            stride = tuple(mode.div if k == mode.input else 0 for k in range(len(self.inputs)))
            modes.append(Mode(o, mode.stride[o], mode.size, stride, mode.name))
        modes.sort(key=lambda m: (m.input, m.div))
        inverse = Layout(self.outputs, self.inputs, tuple(modes))
        image = set()
        for xs in self.domain():
            ys = self(*xs)
            ys = ys if isinstance(ys, tuple) else (ys,)
            back = inverse(*ys)
            assert (back if isinstance(back, tuple) else (back,)) == xs, f"napkin bug: {self.inputs} -> {self.outputs} is not invertible"
            image.add(ys)
        extents = [inverse.extent(name) for name in inverse.inputs]
        assert len(image) == len(list(self.domain())) == _prod(extents), "napkin bug: a layout that is not onto its outputs"
        return inverse


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


@dataclass(frozen=True)
class Composition:
    """``outer(inner(xs))``: evaluated and printed by substitution."""

    outer: Layout | Composition
    inner: Layout | Composition

    @property
    def inputs(self):
        return self.inner.inputs

    @property
    def outputs(self):
        return self.outer.outputs

    def extent(self, name: str) -> int:
        return self.inner.extent(name)

    def domain(self):
        return self.inner.domain()

    def __call__(self, *xs):
        ys = self.inner(*xs)
        return self.outer(*(ys if isinstance(ys, tuple) else (ys,)))

    def c_expr(self, *names: str):
        ys = self.inner.c_expr(*names)
        return self.outer.c_expr(*(f"({y})" for y in (ys if isinstance(ys, tuple) else (ys,))))

    def table(self) -> dict:
        return {xs: self(*xs) for xs in self.domain()}


def compose(outer, inner) -> Composition:
    """``outer`` after ``inner``: inner's outputs are outer's inputs, in order."""
    assert len(inner.outputs) == len(outer.inputs), (inner.outputs, outer.inputs)
    return Composition(outer, inner)


# ---- mma.sync m16n8k16 fragments (16-bit operands, f32 accumulators) ------------------------
# lane = %laneid; its digits t = lane % 4 (threadID in group) and g = lane >> 2 (groupID).

MMA_M, MMA_N, MMA_K = 16, 8, 16  # the instruction's shape; isel reads the same numbers


def _lane_modes(g_stride, t_stride):
    return (Mode(0, 4, 8, g_stride, "g"), Mode(0, 1, 4, t_stride, "t"))


# A (16 x 16, .row): a0..a7; row g (+8 for a2, a3, a6, a7), k 2t + (i & 1) (+8 for a4..a7).
MMA_A = Layout(("lane", "i"), ("row", "k"), _lane_modes((1, 0), (0, 2))
               + (Mode(1, 1, 2, (0, 1)), Mode(1, 2, 2, (8, 0)), Mode(1, 4, 2, (0, 8))))
# B (16 x 8, .col): b0..b3; k 2t + (i & 1) (+8 for b2, b3), n g.
MMA_B = Layout(("lane", "i"), ("k", "n"), _lane_modes((0, 1), (2, 0)) + (Mode(1, 1, 2, (1, 0)), Mode(1, 2, 2, (8, 0))))
# C/D (16 x 8, f32): c0..c3; row g (+8 for c2, c3), n 2t + (i & 1).
MMA_C = Layout(("lane", "i"), ("row", "n"), _lane_modes((1, 0), (0, 2)) + (Mode(1, 1, 2, (0, 1)), Mode(1, 2, 2, (8, 0))))
# The accumulator fragment as two pairs: pair h is c_2h, c_2h+1 (row g + 8h, columns n, n + 1).
# A row array (one value per fragment row: a softmax's max) keeps one value per pair.
MMA_C_PAIR = Layout(("lane", "h"), ("row", "n"), _lane_modes((1, 0), (0, 2)) + (Mode(1, 1, 2, (8, 0)),))
# The lanes holding one accumulator row differ in threadID_in_group only (its row stride is 0):
# a row reduction across them is a butterfly over that digit's bits (lane ^ 1, lane ^ 2).
assert MMA_C.modes[1].name == "t" and MMA_C.modes[1].stride[0] == 0
ROW_LANE_MASKS = MMA_C.xor_masks("t")
# Which value of a pair: c_i is element e of pair h.
MMA_C_VALUE = Layout(("h", "e"), ("i",), (Mode(0, 1, 2, (2,), "h"), Mode(1, 1, 2, (1,), "e")))
# A 16-bit fragment's value i sits in .b32 register i >> 1, the low half for even i.
PACK16 = Layout(("i",), ("register", "half"), (Mode(0, 2, 4, (1, 0)), Mode(0, 1, 2, (0, 1))))

# Two accumulator n-tiles side by side: value (nt, i) of a lane at (row, 8 nt + n), a 16 x 16 tile.
MMA_C_2 = Layout(("lane", "nt", "i"), ("row", "col"), _lane_modes((1, 0), (0, 2))
                 + (Mode(1, 1, 2, (0, MMA_N)), Mode(2, 1, 2, (0, 1)), Mode(2, 2, 2, (8, 0))))
# P -> A: value i of lane's A fragment is value (nt, c) of the same lane's pair of C n-tiles.
P_TO_A = compose(MMA_C_2.inverse(), MMA_A)


def p_to_a_registers() -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per A register j, the ((n-tile, c), (n-tile, c)) of its low and high halves, the same for
    every lane: the repack moves no value between lanes (asserted)."""
    regs: dict[tuple[int, int], tuple[int, int]] = {}
    for (lane, i), (src_lane, nt, c) in P_TO_A.table().items():
        assert src_lane == lane, "napkin bug: P -> A would cross lanes"
        assert regs.setdefault(PACK16(i), (nt, c)) == (nt, c), "napkin bug: P -> A depends on the lane"
    return [(regs[(j, 0)], regs[(j, 1)]) for j in range(MMA_A.extent("i") // 2)]


def mma_a(lane: int, i: int) -> tuple[int, int]:
    """(row, k) of element a_i (i in 0..7) of the 16x16 A fragment held by ``lane``."""
    return MMA_A(lane, i)


def mma_b(lane: int, i: int) -> tuple[int, int]:
    """(k, n) of element b_i (i in 0..3) of the 16x8 B fragment held by ``lane``."""
    return MMA_B(lane, i)


def mma_c(lane: int, i: int) -> tuple[int, int]:
    """(row, n) of accumulator c_i (i in 0..3) of the 16x8 C/D fragment held by ``lane``."""
    return MMA_C(lane, i)


# ---- mma.sync m16n8k32 fragments (8-bit e4m3/e5m2 operands, f32 accumulators) --------------
# PTX ISA, "Matrix Fragments for mma.m16n8k32" (.e4m3/.e5m2, sm_89 and later); the accumulator
# fragment is MMA_C's. Four 8-bit values share a .b32 register, the lowest-indexed in its low byte.

MMA_K8 = 32  # m16n8k32: k per instruction for 8-bit operands

# A (16 x 32, .row): a0..a15 in four registers; row g (+8 for a4..a7 and a12..a15),
# k 4t + (i & 3) (+16 for a8..a15).
MMA_A8 = Layout(("lane", "i"), ("row", "k"), _lane_modes((1, 0), (0, 4))
                + (Mode(1, 1, 4, (0, 1)), Mode(1, 4, 2, (8, 0)), Mode(1, 8, 2, (0, 16))))
# B (32 x 8, .col): b0..b7 in two registers; k 4t + (i & 3) (+16 for b4..b7), n g.
MMA_B8 = Layout(("lane", "i"), ("k", "n"), _lane_modes((0, 1), (4, 0)) + (Mode(1, 1, 4, (1, 0)), Mode(1, 4, 2, (16, 0))))
# An 8-bit fragment's value i sits in .b32 register i >> 2, byte i & 3.
PACK8 = Layout(("i",), ("register", "byte"), (Mode(0, 4, 4, (1, 0)), Mode(0, 1, 4, (0, 1))))


def fp8_fragment_is_b16_bytes(fp8: Layout, b16: Layout) -> bool:
    """Whether every byte of every register of the 8-bit fragment ``fp8`` (MMA_A8, MMA_B8) holds
    the element the same byte of the 16-bit fragment ``b16`` (MMA_A, MMA_B) holds, when a row of
    8-bit values is read as 16-bit pairs (element c of 16 bits is bytes 2c, 2c + 1). Where it
    does, ldmatrix (a 16-bit load) delivers the 8-bit fragment of a k-contiguous tile unchanged."""
    k_axis = fp8.outputs.index("k")
    for lane, i in fp8.domain():
        register, byte = PACK8(i)
        got = list(fp8(lane, i))
        want = list(b16(lane, 2 * register + byte // 2))  # PACK16: value 2r + h is half h of register r
        want[k_axis] = 2 * want[k_axis] + byte % 2
        if got != want:
            return False
    return True


# P -> the 8-bit A fragment. Packed to bytes, an A register holds 4 consecutive k of one row,
# where a lane's accumulators hold pairs (2t, 2t + 1 of each n-tile): no register of C is an A
# register in the ISA's k order. A contraction is the same sum in any order of k, so P feeds
# m16n8k32 with the key order permuted within each 32-key step, and V's rows read in the same
# order: KEY_ORDER8 maps A's k (and B's) to the key it stands for, 16h + 4t + e -> 16h + 2t +
# (e & 1) + 8 (e >> 1), which puts each A register on two accumulator pairs of its own lane.
KEY_ORDER8 = Layout(("k",), ("key",), (Mode(0, 1, 2, (1,)), Mode(0, 2, 2, (8,)), Mode(0, 4, 4, (2,)), Mode(0, 16, 2, (16,))))
# The same map on B's (k, n): n as it is.
KEY_ORDER8_KN = Layout(("k", "n"), ("k", "n"), KEY_ORDER8.modes + (Mode(1, 1, 8, (0, 1)),))


def p_to_a8_registers() -> list[list[tuple[int, int]]]:
    """Per register j of the 8-bit A fragment, the (n-tile, c) of the same lane's accumulators
    (four n-tiles of MMA_C side by side, 32 keys) its bytes 0..3 take, with A's k read through
    KEY_ORDER8: the same for every lane, and no value crosses lanes (asserted)."""
    held = {}
    for lane in range(32):
        for nt in range(MMA_K8 // MMA_N):
            for c in range(MMA_C.extent("i")):
                row, n = MMA_C(lane, c)
                held[(row, MMA_N * nt + n)] = (lane, nt, c)
    regs: dict[tuple[int, int], tuple[int, int]] = {}
    for lane in range(32):
        for i in range(MMA_A8.extent("i")):
            row, k = MMA_A8(lane, i)
            src_lane, nt, c = held[(row, KEY_ORDER8(k))]
            assert src_lane == lane, "napkin bug: P -> the 8-bit A fragment would cross lanes"
            assert regs.setdefault(PACK8(i), (nt, c)) == (nt, c), "napkin bug: P -> A8 depends on the lane"
    return [[regs[(j, e)] for e in range(4)] for j in range(MMA_A8.extent("i") // 4)]


# P -> the 8-bit A fragment in the ISA's own key order, by quad exchange: where B comes by a
# descriptor (wgmma m64nNk32, whose 8-bit B is K-major: V stored [.. d x]), V's rows cannot be
# read in KEY_ORDER8's order, so P's bytes move to the lanes the ISA names instead. Register j
# of a lane (row half j & 1, keys 16 (j >> 1) + 4t .. + 3) is two 16-bit halves, keys 4t, 4t + 1
# and 4t + 2, 4t + 3 of its 16, each a pair of one accumulator n-tile held by one lane of the
# quad. Every lane packs word j of its own pairs (four bytes: P_WORDS8), and takes half
# QUAD_HALF(lane) of word j of lanes QUAD_SOURCE(lane, 0) (low half) and QUAD_SOURCE(lane, 1)
# (high half): two shuffles and one byte permute a register.
QUAD_SOURCE = Layout(("lane", "e"), ("source",), (Mode(0, 1, 2, (2,)), Mode(0, 4, 8, (4,), "g"), Mode(1, 1, 2, (1,))))
QUAD_HALF = Layout(("lane",), ("half",), (Mode(0, 2, 2, (1,)), Mode(0, 4, 8, (0,), "g")))
# four accumulator n-tiles side by side (32 keys, one k step of the 8-bit shape): value (nt, c)
# of a lane at (row, 8 nt + n)
MMA_C_4 = Layout(("lane", "nt", "i"), ("row", "col"), _lane_modes((1, 0), (0, 2))
                 + (Mode(1, 1, MMA_K8 // MMA_N, (0, MMA_N)), Mode(2, 1, 2, (0, 1)), Mode(2, 2, 2, (8, 0))))


def p_words8() -> list[list[tuple[int, int]]]:
    """Per register j of the 8-bit A fragment, the (n-tile, c) of the same lane's accumulators
    that bytes 0..3 of its word j hold: the same for every lane, and every A byte, read through
    QUAD_SOURCE and QUAD_HALF, is then the accumulator of A's (row, k) in the ISA's k order
    (asserted over every lane, register and byte)."""
    held = {}
    for (lane, nt, c), (row, col) in MMA_C_4.table().items():
        held[(row, col)] = (lane, nt, c)
    words: dict[tuple[int, int], tuple[int, int]] = {}
    for lane in range(32):
        for i in range(MMA_A8.extent("i")):
            row, k = MMA_A8(lane, i)
            register, byte = PACK8(i)
            src_lane, nt, c = held[(row, k)]
            assert src_lane == QUAD_SOURCE(lane, byte >> 1), "napkin bug: the quad exchange reads the wrong lane"
            place = 2 * QUAD_HALF(lane) + (byte & 1)  # the byte of the source's word
            assert words.setdefault((register, place), (nt, c)) == (nt, c), "napkin bug: word j depends on the lane"
    return [[words[(j, b)] for b in range(4)] for j in range(MMA_A8.extent("i") // 4)]


# ---- ldmatrix.x4 ----------------------------------------------------------------------------
# Lanes 8j..8j+7 give the row addresses of 8x8 matrix j; register j of lane l receives row
# l >> 2, columns 2(l % 4) and 2(l % 4) + 1 of matrix j (the transpose with .trans).
#
# The lane's digits: r = lane % 8 (the row of its matrix it supplies), j0, j1 the matrix.
# Operand "a": the four matrices are A's (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7,
# k 8-15), (rows 8-15, k 8-15), so registers 0..3 are a0a1, a2a3, a4a5, a6a7. Operand "b": two
# adjacent n-tiles of B at one k-step: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7),
# (n 8-15, k 8-15): registers 0, 1 are the first n-tile's b0b1, b2b3. Stored rows are the
# operand's outer axis (m or n) without .trans, k with it; the stored column is a multiple of 8.


def _source(row_j0: int, row_j1: int) -> Layout:
    """lane -> (stored row, stored column): j0 and j1 step the row by ``row_j*`` x 8 (else the column)."""
    return Layout(("lane",), ("row", "col"), (Mode(0, 1, 8, (1, 0)), Mode(0, 8, 2, (8 * row_j0, 8 * (1 - row_j0))),
                                               Mode(0, 16, 2, (8 * row_j1, 8 * (1 - row_j1)))))


LDMATRIX_SOURCE = {
    ("a", False): _source(1, 0),  # j0: m + 8, j1: k + 8
    ("a", True): _source(0, 1),
    ("b", False): _source(0, 1),  # j0: k + 8, j1: n + 8
    ("b", True): _source(1, 0),
}
# (lane, register j, half h) -> (the lane that supplied the row, the element of that row).
LDMATRIX_DELIVERS = Layout(("lane", "j", "h"), ("supplier", "element"),
                           (Mode(1, 1, 4, (8, 0)), Mode(0, 4, 8, (1, 0), "g"), Mode(0, 1, 4, (0, 2), "t"), Mode(2, 1, 2, (0, 1))))
LDMATRIX_DELIVERS_T = Layout(("lane", "j", "h"), ("supplier", "element"),
                             (Mode(1, 1, 4, (8, 0)), Mode(0, 1, 4, (2, 0), "t"), Mode(2, 1, 2, (1, 0)), Mode(0, 4, 8, (0, 1), "g")))


def ldmatrix_source(lane: int, operand: str, trans: bool) -> tuple[int, int]:
    """The (stored row, stored column) of the 16-byte row whose address ``lane`` supplies."""
    return LDMATRIX_SOURCE[(operand, trans)](lane)


def ldmatrix_delivers(lane: int, register: int, half: int, operand: str, trans: bool) -> tuple[int, int]:
    """(stored row, stored column) of the value in half ``half`` of ``register`` of ``lane``."""
    supplier, element = (LDMATRIX_DELIVERS_T if trans else LDMATRIX_DELIVERS)(lane, register, half)
    row, col = ldmatrix_source(supplier, operand, trans)
    return row, col + element


def ldmatrix_b_registers() -> list[tuple[int, int]]:
    """Per n-tile of an ldmatrix.x4 B load, its (b0b1, b2b3) registers, read off the source map:
    matrix j (supplied by lanes 8j..8j+7) belongs to the n-tile its stored n says."""
    tiles: dict[int, list[tuple[int, int]]] = {}
    for j in range(4):
        n, k = LDMATRIX_SOURCE[("b", False)](8 * j)
        tiles.setdefault(n // MMA_N, []).append((k, j))
    return [tuple(j for _, j in sorted(tiles[nt])) for nt in sorted(tiles)]


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

    @cached_property
    def layout(self) -> Layout:
        """(row, col) -> byte offset: row by pitch; the column's byte cut into its 16-byte unit
        (swizzled by the row's key) and its byte within the unit."""
        modes = (Mode(0, 1, self.rows, (self.pitch,)), Mode(1, UNIT, self.units_per_row, (UNIT,), "unit"),
                 Mode(1, 1, UNIT, (1,), "byte"))
        swizzle = Swizzle(src=0, shift=self.rows_per_line.bit_length() - 1, bits=self.bits, dst=1)
        return Layout(("row", "col"), ("offset",), modes, scale=(1, self.element_bytes), swizzle=swizzle)

    def key(self, row: int) -> int:
        return self.layout.swizzle.key(row)

    def unit_offset(self, row: int, unit: int) -> int:
        """Byte offset of logical 16-byte unit ``unit`` of ``row``."""
        return self.offset(row, unit * UNIT // self.element_bytes)

    def offset(self, row: int, col: int) -> int:
        """Byte offset of element (row, col); through ``key``, which a control test may replace."""
        return self.layout(row, col, key=self.key(row))


# ---- bank conflicts -------------------------------------------------------------------------


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


# ---- the printers' spellings of the tile and ldmatrix layouts -------------------------------


def offset_expr(tile: SwizzledTile, row: str, col: str) -> str:
    """``tile.offset(row, col)`` as a C expression (non-negative ints: Python evaluates it alike)."""
    return tile.layout.c_expr(f"({row})", f"({col})")


def ldmatrix_lane_terms(tile: SwizzledTile, operand: str, trans: bool, lane: str = "lane") -> tuple[str, str]:
    """The per-lane constants of an ldmatrix address, as C expressions in ``lane``.

    For a fragment origin (row0, col0) with row0 a multiple of 8 and col0 a multiple of 16
    values (every origin the printer uses), the lane's byte offset splits into

        tile.offset(row0 + lr, col0 + lc) == row0 * pitch + base
                                             + ((u0 & ~mask) << 4) + (((u0 & mask) ^ x) << 4)

    with (lr, lc) = LDMATRIX_SOURCE's, u0 = col0 * element_bytes / 16, mask = 2**bits - 1 and
    (base, x) returned here: the swizzle key depends on the lane's row only, so a kernel
    computes both once and every ldmatrix in its loops costs one XOR with a constant and
    additions. lc is a multiple of 8 values, so its byte within a unit is 0.
    """
    lr, lc = LDMATRIX_SOURCE[(operand, trans)].c_expr(lane)
    layout = tile.layout
    row_mode, unit_mode, _ = layout.modes
    s = layout.swizzle
    base = f"(({lr}) * {row_mode.stride[0]})"
    x = f"(((({lc}) * {tile.element_bytes}) >> {_log2(unit_mode.div)}) ^ ((({lr}) >> {s.shift}) & {(1 << s.bits) - 1}))"
    return base, x


def ldmatrix_offset_expr(tile: SwizzledTile, row0: str, u0: str, base: str, x: str) -> str:
    """The offset of :func:`ldmatrix_lane_terms` for origin row ``row0`` and unit ``u0``."""
    mask = (1 << tile.bits) - 1
    shift = _log2(UNIT)
    return f"(({row0}) * {tile.pitch} + {base} + ((({u0}) & {~mask & 0xFFFF}) << {shift}) + (((({u0}) & {mask}) ^ {x}) << {shift}))"


def ldmatrix_keyed_lane_expr(base: str, x: str) -> str:
    """The lane's row offset with its swizzle key in the unit's bits: ``base + (x << 4)`` of
    :func:`ldmatrix_lane_terms`, one constant for :func:`ldmatrix_keyed_offset_expr`."""
    return f"(({base}) + (({x}) << {_log2(UNIT)}))"


def ldmatrix_keyed_offset_expr(tile: SwizzledTile, row0: str, u0: str, keyed: str) -> str:
    """:func:`ldmatrix_offset_expr` from the keyed lane constant (:func:`ldmatrix_keyed_lane_expr`):

        (keyed ^ ((u0 & mask) << 4)) + row0 * pitch + ((u0 & ~mask) << 4)

    The lane's row offset (lr * pitch) has no bit among the unit's swizzled ones (a row owns at
    most a 128-byte line's units, and its pitch is a multiple of their span), so the key added
    there is XOR-ed by the unit as in the tile, and everything after the XOR adds (an
    immediate, or a buffer's offset, on the same 128-byte grid). ptxas then keeps one register a
    lane and distinct unit, where the key XOR-ed inside the sum costs it more (attention's 32-row
    warps at d = 128 spill 72 bytes on sm_80 without this form and none with it)."""
    mask = (1 << tile.bits) - 1
    shift = _log2(UNIT)
    assert tile.pitch % (UNIT << tile.bits) == 0, f"napkin bug: {tile} has a lane row offset in its swizzled bits"
    return f"((({keyed}) ^ ((({u0}) & {mask}) << {shift})) + ({row0}) * {tile.pitch} + ((({u0}) & {~mask & 0xFFFF}) << {shift}))"


# ---- wgmma (sm_90a): the D fragment, the canonical shared layouts, the matrix descriptor ----
# PTX ISA 9.7.15 "Asynchronous Warpgroup Level Matrix Multiply-Accumulate": a warpgroup of four
# consecutive warps (128 threads) computes a 64 x N tile, N a multiple of 8 up to 256, K = 16 for
# 16-bit operands; B (and here A) is read from shared memory through a 64-bit matrix descriptor.

WGMMA_M, WGMMA_K = 64, 16  # m64nNk16 for .f16/.bf16 (PTX ISA 9.7.15.5.1, "Matrix Shape")
WGMMA_K8 = 32  # m64nNk32 for .e4m3/.e5m2: 32 bytes of k a row, as the 16-bit shape's 16 values


def wgmma_k(dtype: str) -> int:
    """The K of one wgmma for operands of ``dtype``: 32 for the 8-bit types, 16 for the 16-bit."""
    return WGMMA_K8 if dtype in FP8_DTYPES else WGMMA_K
WGMMA_MAX_N = 256
WARPGROUP_THREADS = 128


def wgmma_d(n: int) -> Layout:
    """(thread of the warpgroup, value v) -> (row, col) of the f32 accumulator of
    ``wgmma.mma_async.m64nNk16`` (PTX ISA 9.7.15.5.1.1.1, "Matrix Fragments for
    wgmma.mma_async.m64nNk16", the accumulator D figure): N/2 values a thread, row
    16 * (warp % 4) + groupID (+ 8 for v % 4 in 2, 3), column 8 * (v // 4) + 2 * threadID_in_group
    + v % 2. Warp w of the group holds rows 16w..16w+15 as mma.sync's C fragments of its N/8
    n-tiles in order (value 4 nt + i is c_i of n-tile nt): tests/test_wgmma.py holds both."""
    assert n % 8 == 0 and 8 <= n <= WGMMA_MAX_N, n
    return Layout(("thread", "v"), ("row", "col"),
                  (Mode(0, 32, 4, (16, 0), "warp"), Mode(0, 4, 8, (1, 0), "g"), Mode(0, 1, 4, (0, 2), "t"),
                   Mode(1, 1, 2, (0, 1)), Mode(1, 2, 2, (8, 0)), Mode(1, 4, n // 8, (0, 8))))


def wgmma_a() -> Layout:
    """(thread of the warpgroup, value i) -> (row, k) of the 64 x 16 A operand of
    ``wgmma.mma_async.m64nNk16`` read from registers, .f16/.bf16 (PTX ISA 9.7.15.5.1.1.1, Figure
    148): a0..a7 in four .b32 registers, row 16 * (warp % 4) + groupID (+ 8 for a2, a3, a6, a7),
    k 2 * threadID_in_group + i % 2 (+ 8 for a4..a7). Warp w's part is mma.sync's m16n8k16 A
    fragment (:data:`MMA_A`) of rows 16w..16w+15, so an accumulator pair of :func:`wgmma_d` packs
    into it as on mma.sync (:func:`p_to_a_registers`): tests/test_wgmma_attention.py holds both."""
    return Layout(("thread", "i"), ("row", "k"),
                  (Mode(0, 32, 4, (16, 0), "warp"), Mode(0, 4, 8, (1, 0), "g"), Mode(0, 1, 4, (0, 2), "t"),
                   Mode(1, 1, 2, (0, 1)), Mode(1, 2, 2, (8, 0)), Mode(1, 4, 2, (0, 8))))


# The descriptor's swizzling modes (PTX ISA 9.7.15.5.1.2.2, "Matrix Descriptor Format", bits 62-63)
# by the swizzle width in bytes; 0 is no swizzle, which napkin does not lay out.
SWIZZLE_MODE = {128: 1, 64: 2, 32: 3}


@dataclass(frozen=True)
class CanonicalTile:
    """A rows x cols tile of ``element_bytes`` values in a canonical swizzled layout of wgmma
    (PTX ISA 9.7.15.5.1.2, "Shared Memory Matrix Layout"): the columns (the contiguous
    dimension: K of a K-major operand, M or N of an MN-major one) are cut into swizzle atoms
    ``width`` bytes wide (128, 64 or 32, the widest that divides a row); atom column j holds every
    row, ``width`` bytes a row, at ``j * rows * width``; within it the 16-byte unit u of row r sits
    at unit ``u ^ ((r >> log2(128 / width)) % (width / 16))``, the XOR of address bits [4, 4+b)
    with bits [7, 7+b) that the swizzle mode names, when the tile starts on a multiple of 8 rows x
    ``width`` bytes (1024 for 128B: the ``base offset`` is then 0).

    The same object serves either major-ness: a K-major operand's rows are M or N, an MN-major
    one's rows are K. cp.async writes it 16 bytes at a time, as the mma.sync tiles."""

    rows: int
    cols: int
    element_bytes: int

    @staticmethod
    def supports(cols: int, element_bytes: int) -> bool:
        pitch = cols * element_bytes
        return pitch >= 32 and (pitch in (32, 64) or pitch % LINE == 0)

    @property
    def width(self) -> int:
        """The swizzle width in bytes: 128 when rows are a multiple of 128 bytes, else 64 or 32."""
        return min(LINE, self.cols * self.element_bytes)

    @property
    def mode(self) -> int:
        return SWIZZLE_MODE[self.width]

    @property
    def pitch(self) -> int:
        """Bytes from one row to the next within an atom column (the copy loops step rows by it)."""
        return self.width

    @property
    def units_per_row(self) -> int:
        return self.cols * self.element_bytes // UNIT

    @property
    def atoms(self) -> int:
        return self.cols * self.element_bytes // self.width

    @property
    def bytes(self) -> int:
        return self.rows * self.cols * self.element_bytes

    @property
    def alignment(self) -> int:
        """Where the swizzle's repeating pattern starts (PTX ISA, the table under "Matrix
        Descriptor Format"): 8 rows of ``width`` bytes; a tile based there has base offset 0."""
        return 8 * self.width

    @cached_property
    def layout(self) -> Layout:
        """(row, col) -> byte offset."""
        bits = _log2(self.width // UNIT)
        modes = (Mode(0, 1, self.rows, (self.width,)), Mode(1, UNIT, self.width // UNIT, (UNIT,), "unit"),
                 Mode(1, 1, UNIT, (1,), "byte"), Mode(1, self.width, self.atoms, (self.rows * self.width,), "atom"))
        swizzle = Swizzle(src=0, shift=_log2(LINE // self.width), bits=bits, dst=1)
        return Layout(("row", "col"), ("offset",), modes, scale=(1, self.element_bytes), swizzle=swizzle)

    def offset(self, row: int, col: int) -> int:
        return self.layout(row, col)

    def start(self, row: int, col: int) -> int:
        """The unswizzled byte offset of (row, col), a descriptor's start address for a
        sub-matrix there (row a multiple of 8): the hardware swizzles the addresses it forms."""
        cb = col * self.element_bytes
        return (cb // self.width) * self.rows * self.width + row * self.width + cb % self.width

    def strides(self, k_major: bool) -> tuple[int, int]:
        """(leading, stride) dimension byte offsets of a descriptor over this tile (PTX ISA
        9.7.15.5.1.2.1, "Strides"): the stride dimension byte offset steps 8 rows (one 8-row group
        of core matrices, 8 x ``width`` bytes here) in either major-ness; the leading dimension
        byte offset steps one atom column along the contiguous dimension for an MN-major operand,
        and is unused for a swizzled K-major one (an instruction's 16 values of K lie within one
        atom), where the ISA says it is assumed 1: encoded as 1."""
        sbo = 8 * self.width
        return (1 << 4 if k_major else self.rows * self.width), sbo

    # -- the same tile as TMA writes it (cp.async.bulk.tensor with a tensor map's swizzle)
    @property
    def tma_swizzle(self) -> int:
        """The tensor map's swizzle span in bytes: the atom's width. A TMA box whose inner
        dimension is that many bytes, written with that swizzle at an address on the pattern's
        period (``alignment``), lands as this tile's atom column."""
        return self.width

    def tma_boxes(self) -> list[TmaBox]:
        """The TMA copies that fill this tile: one box per atom column, ``rows`` rows (the outer
        box dimension) of ``width`` bytes (the inner one, at most the swizzle span as the driver
        API requires), atom column j from column ``j * width / element_bytes`` at byte ``j * rows *
        width`` of the tile."""
        inner = self.width // self.element_bytes
        return [TmaBox(j * self.rows * self.width, j * inner, inner, self.rows) for j in range(self.atoms)]

    def tma_offset(self, row: int, col: int) -> int:
        """The byte TMA writes element (row, col) to, from the box's side: box j of
        :meth:`tma_boxes` is dense (inner dimension fastest, a row ``width`` bytes), then the
        shared address is swizzled by the tensor map's span (bits [4, 4+b) XOR [7, 7+b))."""
        box = self.tma_boxes()[col * self.element_bytes // self.width]
        linear = box.offset + row * self.width + (col - box.col) * self.element_bytes
        bits = self.width // UNIT - 1
        return linear ^ (((linear >> 7) & bits) << 4)


@dataclass(frozen=True)
class TmaBox:
    """One TMA copy into a :class:`CanonicalTile`: ``rows`` x ``cols`` elements from the tile's
    (0, ``col``), written at byte ``offset`` of the tile."""

    offset: int
    col: int
    cols: int
    rows: int


def _descriptor_field(x: int) -> int:
    """matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4 (PTX ISA 9.7.15.5.1.2.2)."""
    return (x & 0x3FFFF) >> 4


@dataclass(frozen=True)
class MatrixDescriptor:
    """The 64-bit wgmma matrix descriptor (PTX ISA 9.7.15.5.1.2.2, "Matrix Descriptor Format"):
    bits 0-13 the start address, 16-29 the leading dimension byte offset, 32-45 the stride
    dimension byte offset (each through matrix-descriptor-encode), 49-51 the base offset, 62-63
    the swizzle mode (1: 128B, 2: 64B, 3: 32B)."""

    start: int
    leading: int
    stride: int
    swizzle: int
    base_offset: int = 0

    def encode(self) -> int:
        return (_descriptor_field(self.start) | _descriptor_field(self.leading) << 16
                | _descriptor_field(self.stride) << 32 | (self.base_offset & 7) << 49 | (self.swizzle & 3) << 62)


def descriptor(tile: CanonicalTile, k_major: bool, start: int = 0) -> MatrixDescriptor:
    """The descriptor of a sub-matrix of ``tile`` whose (unswizzled) byte address is ``start``."""
    leading, stride = tile.strides(k_major)
    return MatrixDescriptor(start, leading, stride, tile.mode)


# ---- the K-major copy of an 8-bit operand ---------------------------------------------------
# wgmma's 8-bit shape reads its shared operands K-major only, so an MN-major chunk (V [x d], a
# GEMM's B [k n] or A [k m], as TMA wrote it) is copied into a K-major tile by the block: each thread takes a block of 4 k rows
# x 4 n bytes, reads four words (one a k row), swaps bytes, and writes four (one an n row). Which
# blocks a warp's 32 lanes take decides the bank conflicts of both sides: lanes spread along n
# read one k row's consecutive words (conflict-free) but write n rows whose swizzle keys repeat
# every 8 rows (16-way at 128-byte rows); lanes spread along k do the reverse. No rectangular
# patch of lanes serves both (3x the conflict-free wavefronts at best), so the patch is skewed:
# a lane's k block is rotated by its n block (k + skew * n, modulo the chunk's k blocks), which
# spreads the written rows' swizzle keys while the reads stay on distinct words; and where an n
# row holds fewer than 128 bytes (two rows share a line), lanes of odd n blocks write their four
# rows in swapped pairs (row i ^ 1 at the i-th store), so that one store covers both halves of
# the banks. The split of the lane bits, the skew and the swap are chosen here, by counting
# wavefronts on the two tiles' layouts.

TRANSPOSE_BLOCK = 4  # the 4 x 4 bytes one thread swaps with byte permutes
TRANSPOSE_SKEWS = (0, 1, 2, 4)  # the rotations tried: small, so the search stays cheap


@dataclass(frozen=True)
class TransposeSplit:
    """A warp's lanes as a 2**(5 - n_bits) (k blocks) x 2**n_bits (n blocks) patch of the
    copy's blocks, each lane's k block rotated by ``skew`` times its n block (modulo
    ``k_blocks``); warps tile the chunk n-patch fastest. With ``swap``, a lane of an odd n block
    writes its rows in swapped pairs. ``wavefronts`` is what every warp's four reads and four
    writes take over the whole chunk, ``ideal`` that without conflicts."""

    n_bits: int
    n_blocks: int  # the chunk's blocks along n
    k_blocks: int  # the chunk's blocks along k (the skew's modulus)
    wavefronts: int
    ideal: int
    skew: int = 0
    swap: bool = False

    def block(self, warp, lane) -> tuple:
        """The (k, n) origin of the block lane ``lane`` of warp ``warp`` copies (ints, or integer
        arrays of warps and lanes: the arithmetic is elementwise)."""
        return _transpose_block(self.n_bits, self.n_blocks, self.k_blocks, self.skew, warp, lane)

    def written_row(self, n, store: int):
        """The n row (of the block at n: an int, or an integer array) that a lane's ``store``-th
        write goes to."""
        return n + (store ^ (self.swap and (n // TRANSPOSE_BLOCK) & 1))

    @property
    def conflict(self) -> float:
        """Wavefronts over the conflict-free count: the factor the copy's port time takes."""
        return self.wavefronts / self.ideal


def _transpose_block(n_bits: int, n_blocks: int, k_blocks: int, skew: int, warp, lane) -> tuple:
    patches = n_blocks >> n_bits
    n = (warp % patches) << n_bits | (lane & ((1 << n_bits) - 1))
    k = (warp // patches) << (5 - n_bits) | (lane >> n_bits)
    return TRANSPOSE_BLOCK * ((k + skew * n) % k_blocks), TRANSPOSE_BLOCK * n


@cache
def _word_table(tile: CanonicalTile):
    """The 4-byte word index of every (row, 4-byte column) of an 8-bit tile, as an array."""
    import numpy as np

    return np.array([[tile.layout(row, col) // 4 for col in range(0, tile.cols, 4)] for row in range(tile.rows)])


def _warp_wavefronts(words) -> int:
    """The wavefronts of warp-wide 4-byte accesses, one per row of ``words`` (lanes along the
    last axis), summed: each takes the most distinct words any bank is asked for (``wavefronts``)."""
    import numpy as np

    words = np.sort(words, axis=-1)
    distinct = np.ones(words.shape, dtype=bool)
    distinct[..., 1:] = words[..., 1:] != words[..., :-1]
    per_bank = np.zeros((words.shape[0], 32), dtype=np.int64)
    np.add.at(per_bank, (np.arange(words.shape[0])[:, None].repeat(words.shape[1], 1), words % 32), distinct)
    return int(per_bank.max(axis=1).sum())


def _transpose_wavefronts(src: CanonicalTile, dst: CanonicalTile, split: TransposeSplit) -> int:
    import numpy as np

    src_words, dst_words = _word_table(src), _word_table(dst)
    warps = src.rows * src.cols // (TRANSPOSE_BLOCK * TRANSPOSE_BLOCK * 32)
    # the split's own block and row maps, over every (warp, lane) at once (they are elementwise)
    k, n = split.block(np.arange(warps)[:, None], np.arange(32)[None, :])
    reads = np.concatenate([src_words[k + i, n // 4] for i in range(TRANSPOSE_BLOCK)])
    writes = np.concatenate([dst_words[split.written_row(n, i), k // 4] for i in range(TRANSPOSE_BLOCK)])
    return _warp_wavefronts(reads) + _warp_wavefronts(writes)


@cache  # the model and the printer ask for the same tiles' split, the tuner many times
def transpose_split(src: CanonicalTile, dst: CanonicalTile) -> TransposeSplit:
    """The lane map with the fewest wavefronts for copying ``src`` (k rows x n bytes) into
    ``dst`` (n rows x k bytes); among equals the plainest (no swap, the least skew, the fewest
    n bits). Needs 8-bit tiles whose 4 x 4 blocks fill whole warps."""
    assert src.element_bytes == dst.element_bytes == 1 and (dst.rows, dst.cols) == (src.cols, src.rows)
    k_blocks, n_blocks = src.rows // TRANSPOSE_BLOCK, src.cols // TRANSPOSE_BLOCK
    warps = k_blocks * n_blocks // 32
    assert warps * 32 == k_blocks * n_blocks, "the copy's blocks fill whole warps"
    ideal = warps * 2 * TRANSPOSE_BLOCK
    best = None
    for swap in (False, True):
        for skew in (s for s in TRANSPOSE_SKEWS if s < k_blocks):
            for n_bits in (b for b in range(6) if (1 << b) <= n_blocks and (1 << (5 - b)) <= k_blocks):
                split = TransposeSplit(n_bits, n_blocks, k_blocks, 0, ideal, skew, swap)
                counted = replace(split, wavefronts=_transpose_wavefronts(src, dst, split))
                if best is None or counted.wavefronts < best.wavefronts:
                    best = counted
                if best.wavefronts == ideal:
                    return best
    return best
