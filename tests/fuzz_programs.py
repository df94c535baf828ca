"""The grammar fuzzer of issue 13: hypothesis strategies for napkin programs, and the invariants.

Strategies (each draws a :class:`Case`: the text of a ``.napkin`` file, the sizes to bind, a seed):

* :func:`programs`: valid kernels built from the notation (docs/notation.md): contractions with
  scalar factors, elementwise maps (every function of the table of elementwise functions,
  ``napkin_dsl.elementwise``: ``exp log sqrt rsqrt tanh sigmoid gelu silu relu abs neg max
  min`` and any entry added to it; ``+ - * / ^``, unary minus), reductions ``sum/max/min/mean/lse/logsumexp``,
  ``softmax``, scans ``cumsum/cumprod`` (a product's operand held to [-1, 1]), padded window reads
  of new inputs (``pad(X[.. (2*p + i - 1) ..], 0)``, a view the error bounds gather exactly), masks (``where(COND, E, -inf)`` in a softmax, an ``lse`` or a ``max``, COND a
  conjunction of linear comparisons of axis indices, sizes ``len(x) - len(q)`` among them,
  some masking whole rows; rarely ``or``, ``!=``, ``not``), ``@gmem`` (``@l0``)
  materialisation, with a dtype written after the level a third of the time
  (``T[i] @gmem bf16 = ...``), scalar parameters and size expressions, broadcasts, and
  the examples' motifs (attention, masked half the time, with its log-sum-exp as an output
  beside the softmax most of the time; RMSNorm, a dense layer, logsumexp, an online softmax
  contracted with its own input and its lse, an opaque ``box`` with inner broadcasting, run with an
  implementation) with random axis names (Unicode ones too) and dtypes; then a random relabel
  block on a random profile (``two_level``, ``three_level``, ``A100``, ``H100``, ``H200``):
  groups on axes no box consumes, a stream on a consumed axis, nested groups on three_level,
  scoped ``LEVEL for T:`` clauses, symbolic sizes. Formatting varies too (indentation, tabs,
  comments, blank lines, backslash continuations, redundant parentheses and spelled-out axes).
  The generator keeps values in range (no ``log`` of a negative, no ``exp`` of 100), so that
  almost every program can be judged against the reference; a rare illegal relabelling is
  drawn on purpose (it must give a NapkinError).
* :func:`attention_programs`: the attention motif first and relabelled to stream its x: the
  streamed mask, the online softmax and the lse read off its state, which :func:`programs`
  reaches only now and then.
* :func:`mutants`: a valid program with token deletions, duplications, swaps, replacements and
  insertions (whitespace included, so keywords glue to names).
* :func:`absurd_sizes`: a valid program bound to huge sizes (up to 10^5000), planned and
  costed only.
* :func:`example_relabellings`: an example with a random relabel block on a GPU profile, half
  the time in fragment multiples the tensor-core path takes (tests/test_oclgrind.py).

:func:`check_case` runs one case through the public API and returns the broken invariants:

* no exception other than :class:`~napkin_dsl.errors.NapkinError` from ``napkin.load``,
  ``Kernel.program/cost/pseudocode``, the NumPy backend (``execute``, and ``kernel(...,
  backend="numpy")``), ``opencl.run`` and the reference;
* NumPy and OpenCL outputs equal :func:`napkin_dsl.reference.evaluate` within a tolerance
  derived from the dtypes: :func:`error_bounds` re-evaluates the diagram in float64 carrying a
  first-order bound of the rounding error per element (each operation in the compute dtype,
  f64 where an operand is f64 and f32 otherwise, on every backend; 16 ulp for
  special functions; every materialised intermediate rounded to
  its dtype, every output to its declared dtype, on-chip operands of a low-precision
  contraction rounded to that precision as the tensor-core path packs them; sums and
  contractions add their length times the unit roundoff; softmax's sensitivity exactly;
  log-sum-exp by its condition, see :func:`_lse_bound`; a mask's comparisons of exact integers
  exact, ``-inf`` exact). A result is wrong where it is further from the reference than 4x that
  bound, or, where the reference is an infinity the bound knows exactly (the lse or max of a
  fully masked row, -inf), where it is anything else;
* the NumPy backend's counted transfers and FLOPs equal the cost report (``Counts.differences``).

Hangs: ``scripts/fuzz.py`` runs each case in a worker process it kills after a time limit;
tests/test_fuzz.py uses :func:`check_case_within` (SIGALRM, tiny sizes). :func:`known_item` names the item of issue 13 a failure matches;
:func:`minimise` shrinks a failing case while it keeps failing the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import re
import signal
import threading
import traceback
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from napkin_dsl import elementwise
from napkin_dsl.hardware import BUILT_OVERLAPS

# ---- profiles and names ----------------------------------------------------------------------

HARDWARE = ("two_level", "three_level", "A100", "H100", "H200")
TOP = {"two_level": "l0", "three_level": "l0", "A100": "gmem", "H100": "gmem", "H200": "gmem"}
COMPUTE = {"two_level": "l1", "three_level": "l2", "A100": "smem", "H100": "smem", "H200": "smem"}
GPUS = ("A100", "H100", "H200")

AXIS_NAMES = ("i", "j", "k", "m", "n", "b", "h", "q", "x", "d", "r", "c", "t", "kv", "s_1", "w2")
UNICODE_NAMES = ("Δ", "é")  # the notation allows Unicode letters in names
DTYPES = ("f32", "bf16", "f16", "f64", "fp8", "fp8e5m2", "i32", "i64")
DTYPE_WEIGHTS = (10, 3, 3, 1, 1, 1, 1, 1)  # inputs; outputs draw from f32, bf16, f16, f64
_WEIGHTED_DTYPES = tuple(d for d, w in zip(DTYPES, DTYPE_WEIGHTS, strict=False) for _ in range(w))


def unary_functions() -> tuple[str, ...]:
    """The functions of one argument the generator calls: the table of elementwise functions'
    (read at each draw, so an entry added at run time is fuzzed too)."""
    return tuple(elementwise.names(arity=1))


def binary_functions() -> tuple[str, ...]:
    return tuple(elementwise.names(arity=2))


# Limits that keep every value far inside f16's range and every function inside its domain.
BIG = 1e3


@dataclass(frozen=True)
class Case:
    """One fuzz case: a napkin source, the hardware to plan it on (None: the relabel block's),
    sizes (axes and symbolic partition sizes; an axis not listed gets 3), the input seed, and
    which backends to run (``opencl``; ``call`` runs ``kernel(..., backend="numpy")`` too)."""

    kind: str  # "valid", "mutant" or "absurd"
    text: str
    sizes: dict = field(default_factory=dict)
    hardware: str | None = None
    seed: int = 0
    opencl: bool = False
    call: bool = False
    scale: float = 1.0  # the inputs' magnitude: fuzz_inputs multiplies every float input by it

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["sizes"] = {k: _size_json(v) for k, v in self.sizes.items()}
        return json.dumps(data, ensure_ascii=False)

    @staticmethod
    def from_json(text: str) -> Case:
        data = json.loads(text)
        data["sizes"] = {k: int(v, 16) if isinstance(v, str) else int(v) for k, v in data["sizes"].items()}
        return Case(**data)

    def replace(self, **changes) -> Case:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """The reproducer as the reports print it."""
        sizes = " ".join(f"{k}={_size_text(v)}" for k, v in self.sizes.items())
        flags = [f"kind={self.kind}", f"sizes: {sizes}", f"seed={self.seed}"]
        if self.hardware:
            flags.append(f"hardware={self.hardware}")
        if self.opencl:
            flags.append("opencl")
        if self.call:
            flags.append("call")
        if self.scale != 1.0:
            flags.append(f"inputs x {self.scale:g}")
        return "\n".join(["    " + line for line in self.text.rstrip("\n").split("\n")] + ["    -- " + ", ".join(flags)])


def _size_json(value: int):
    return value if value.bit_length() < 64 else hex(value)  # hex: no int-to-str digit limit


def _size_text(value: int) -> str:
    if value.bit_length() < 64:
        return str(value)
    for base in (2, 10):
        power = round(math.log(value, base)) if value.bit_length() < 1000 else round(value.bit_length() / math.log2(base))
        for p in (power - 1, power, power + 1):
            for extra in (0, 1):
                if base**p + extra == value:
                    return f"{base}^{p}" + (" + 1" if extra else "")
    return f"<{value.bit_length()} bits>"


# ---- the program builder -----------------------------------------------------------------------


@dataclass
class _Array:
    name: str
    axes: tuple
    lo: float
    hi: float
    dtype: str
    role: str  # "input" or "intermediate"
    # False where a value may be -inf (a masked log-sum-exp or max of a fully masked row): no
    # later statement reads it (-inf - -inf is NaN), so it is only an output.
    reusable: bool = True

    @property
    def bound(self) -> float:
        return max(abs(self.lo), abs(self.hi))


@dataclass
class _Expr:
    text: str
    axes: tuple  # in order of first appearance
    lo: float
    hi: float
    compound: bool = False  # needs parentheses as an operand of * / ^

    @property
    def bound(self) -> float:
        return max(abs(self.lo), abs(self.hi))


def _image(fn: str, *intervals) -> tuple[float, float]:
    """The range of a function of the table over a box of argument intervals, read off its
    float64 definition on a grid of each interval (its ends included, and [-4, 4] finely, where
    activations have their extrema), widened by 5% of its span and 1e-3 (the grid can miss an
    extremum between its points); infinite where the function is not finite there."""
    f = elementwise.float64(elementwise.function(fn))
    grids = [np.unique(np.concatenate([np.linspace(lo, hi, 257), np.clip(np.linspace(-4.0, 4.0, 161), lo, hi)]))
             for lo, hi in intervals]
    with np.errstate(all="ignore"):
        values = np.asarray(f(*np.meshgrid(*grids, indexing="ij")), dtype=np.float64)
    if not np.all(np.isfinite(values)):
        return -math.inf, math.inf
    lo, hi = float(values.min()), float(values.max())
    margin = 0.05 * (hi - lo) + 1e-3
    return lo - margin, hi + margin


def _mul_interval(a, b):
    products = [a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1]]
    return min(products), max(products)


class _Builder:
    """Builds one kernel statement by statement, tracking each value's interval."""

    def __init__(self, draw, hardware: str, max_size: int):
        self.draw = draw
        self.hardware = hardware
        self.max_size = max_size
        pool = list(AXIS_NAMES)
        if draw(st.integers(0, 19)) == 0:
            pool.append(draw(st.sampled_from(UNICODE_NAMES)))
        self.axes = draw(st.lists(st.sampled_from(pool), min_size=2, max_size=5, unique=True))
        self.arrays: dict[str, _Array] = {}
        self.params: list[str] = []  # array and scalar parameters, in order
        self.scalars: dict[str, str] = {}  # name -> dtype
        self.statements: list[dict] = []
        self.consumed: list[str] = []  # axes some box consumes (contracted, reduced, softmaxed)
        self.preferred_streams: list[str] = []
        self.wanted: list[str] = []  # arrays the kernel must output (a streamed log-sum-exp)
        self.focus = False  # attention_programs: S materialised often, P and O never (the stream stays in one launch)
        self.boxes: list[str] = []  # box declarations
        self.names = 0

    # -- names
    def fresh(self, prefix: str) -> str:
        self.names += 1
        if self.draw(st.integers(0, 29)) == 0:
            prefix = self.draw(st.sampled_from(["Acc_", "tile", "Ω", "ä"]))
        return f"{prefix}{self.names}"

    def new_input(self, axes, dtype=None) -> _Array:
        draw = self.draw
        if dtype is None:
            dtype = draw(st.sampled_from(_WEIGHTED_DTYPES))
        name = self.fresh("X")
        lo, hi = (-2.0, 2.0) if dtype not in ("i32", "i64") else (-9.0, 9.0)
        array = _Array(name, tuple(axes), lo, hi, dtype, "input")
        self.arrays[name] = array
        self.params.append(name)
        return array

    def scalar_param(self) -> str:
        for name in self.scalars:
            if self.draw(st.booleans()):
                return name
        name = self.fresh("eps")
        self.scalars[name] = self.draw(st.sampled_from(["f32", "f32", "f64", "bf16"]))
        self.params.append(name)
        return name

    def used_axes(self) -> list:
        """Axes some array carries already: a size expression may name them."""
        return list(_union(*(a.axes for a in self.arrays.values())))

    def some_axes(self, min_size=0, max_size=3):
        return tuple(self.draw(st.lists(st.sampled_from(self.axes), min_size=min_size, max_size=min(max_size, len(self.axes)), unique=True)))

    def array(self, need=(), fresh_ok=True) -> _Array:
        """An existing array carrying the axes ``need``, or a new input with them."""
        candidates = [a for a in self.arrays.values() if set(need) <= set(a.axes) and a.reusable]
        if candidates and (not fresh_ok or self.draw(st.integers(0, 2)) > 0):
            return self.draw(st.sampled_from(candidates))
        extra = [a for a in self.some_axes() if a not in need]
        axes = list(need) + extra
        axes = self.draw(st.permutations(axes)) if axes else axes
        return self.new_input(axes)

    def ref(self, array: _Array) -> str:
        """``X``, or ``X[axes]`` spelled out in storage order or any other order."""
        choice = self.draw(st.integers(0, 3))
        if choice == 0 and array.axes:
            return f"{array.name}[{' '.join(array.axes)}]"
        if choice == 1 and array.axes:
            return f"{array.name}[{' '.join(self.draw(st.permutations(array.axes)))}]"
        return array.name

    # -- expressions
    def leaf(self, allow_scalar=True) -> _Expr:
        draw = self.draw
        kind = draw(st.integers(0, 9)) if allow_scalar else 0
        if kind <= 6:
            if draw(st.integers(0, 9)) == 0 and len(self.axes) >= 3:
                return self.window_read()
            array = self.array()
            return _Expr(self.ref(array), array.axes, array.lo, array.hi)
        if kind == 7:
            value = draw(st.sampled_from(["2", "0.5", ".25", "3", "1e-1", "1.5"]))
            v = float(value)
            return _Expr(value, (), v, v)
        if kind == 8:
            name = self.scalar_param()
            return _Expr(name, (), 0.5, 1.5)
        used = self.used_axes()
        if not used:
            return _Expr("2", (), 2.0, 2.0)
        axis = draw(st.sampled_from(used))
        # len(axis) is the size wherever it stands; a bare axis name of the target would be the
        # element's index (issue 12), which these bounds do not describe.
        size = f"len({axis})"
        form = draw(st.sampled_from([f"{size}^-0.5", f"1 / {size}", size, f"({size} + 1)^-1"]))
        hi = float(self.max_size) if form == size else 1.0
        return _Expr(form, (), 1.0 / self.max_size, hi, compound=True)

    def window_read(self) -> _Expr:
        """``pad(X[.. (s*p + d*i + o) ..], 0)``: a new input X read through a padded window along
        one of its axes, that axis indexed by two others (an output position p and a window
        position i, stride s, dilation d, offset o). Padded, it reads inside X at any sizes;
        the pad value 0 lies inside X's interval."""
        draw = self.draw
        p, i = draw(st.lists(st.sampled_from(self.axes), min_size=2, max_size=2, unique=True))
        others = [a for a in self.axes if a not in (p, i)]
        windowed = draw(st.sampled_from(others))
        rest = [a for a in draw(st.lists(st.sampled_from(others), max_size=2, unique=True)) if a != windowed]
        axes = draw(st.permutations([windowed] + rest))
        array = self.new_input(axes, draw(st.sampled_from(["f32", "f32", "bf16", "f64"])))
        stride, dilation = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
        offset = draw(st.sampled_from([0, -1]))
        index = " + ".join([f"{stride}*{p}" if stride > 1 else p, f"{dilation}*{i}" if dilation > 1 else i])
        index += f" - {-offset}" if offset else ""
        spelled = [f"({index})" if a == windowed else a for a in axes]
        read_axes = tuple(x for a in axes for x in ((p, i) if a == windowed else (a,)))
        return _Expr(f"pad({array.name}[{' '.join(spelled)}], 0)", read_axes, min(array.lo, 0.0), max(array.hi, 0.0))

    def expression(self, depth: int, positive=False) -> _Expr:
        """An elementwise expression with at least one array read."""
        e = self._expression(depth)
        if not e.axes:
            array = self.array(need=(self.draw(st.sampled_from(self.axes)),))
            e = self.combine(e, _Expr(self.ref(array), array.axes, array.lo, array.hi), "+")
        if positive:
            e = self.positive(e)
        return e

    def _expression(self, depth: int) -> _Expr:
        draw = self.draw
        if depth <= 0:
            return self.leaf()
        kind = draw(st.integers(0, 5))
        if kind == 0:
            return self.leaf()
        if kind in (1, 2):
            return self.unary(draw(st.sampled_from(unary_functions())), self._expression(depth - 1))
        if kind == 3:
            a, b = self._expression(depth - 1), self._expression(depth - 1)
            fn = draw(st.sampled_from(binary_functions()))
            if fn not in ("max", "min"):
                return self.generic_binary(fn, a, b)
            lo = max(a.lo, b.lo) if fn == "max" else min(a.lo, b.lo)
            hi = max(a.hi, b.hi) if fn == "max" else min(a.hi, b.hi)
            return _Expr(f"{fn}({a.text}, {b.text})", _union(a.axes, b.axes), lo, hi)
        a, b = self._expression(depth - 1), self._expression(depth - 1)
        return self.combine(a, b, draw(st.sampled_from(["+", "-", "*", "/", "^"])))

    def positive(self, e: _Expr) -> _Expr:
        """``e`` if it is at least 0.1, else a positive expression of it."""
        if e.lo >= 0.1:
            return e
        form = self.draw(st.sampled_from(["abs", "exp", "square"]))
        if form == "exp" and e.hi <= 5 and e.lo >= -50:  # exp(lo) must stay a normal float: rsqrt(0) is inf
            return _Expr(f"exp({e.text})", e.axes, math.exp(e.lo), math.exp(e.hi))
        if form == "square" and e.bound <= 30:
            inner = f"({e.text})" if e.compound else e.text
            return _Expr(f"({inner} * {inner} + 0.5)", e.axes, 0.5, e.bound ** 2 + 0.5)
        return _Expr(f"(abs({e.text}) + 0.5)", e.axes, 0.5, e.bound + 0.5)

    def bounded(self, e: _Expr) -> _Expr:
        if e.bound <= BIG:
            return e
        return _Expr(f"tanh({e.text})", e.axes, -1.0, 1.0)

    def unary(self, fn: str, e: _Expr) -> _Expr:
        if fn == "exp":
            if e.hi > 5:
                e = _Expr(f"tanh({e.text})", e.axes, -1.0, 1.0)
            return _Expr(f"exp({e.text})", e.axes, math.exp(e.lo), math.exp(e.hi))
        if fn in ("log", "sqrt", "rsqrt"):
            p = self.positive(e)
            f = {"log": math.log, "sqrt": math.sqrt, "rsqrt": lambda v: 1 / math.sqrt(v)}[fn]
            lo, hi = sorted((f(p.lo), f(p.hi)))
            return _Expr(f"{fn}({p.text})", p.axes, lo, hi)
        if fn in ("tanh", "sigmoid"):
            return _Expr(f"{fn}({e.text})", e.axes, -1.0 if fn == "tanh" else 0.0, 1.0)
        if fn in ("gelu", "silu", "relu"):
            return _Expr(f"{fn}({e.text})", e.axes, -0.3, max(e.hi, 0.0))
        if fn == "abs":
            return _Expr(f"abs({e.text})", e.axes, 0.0, e.bound)
        if fn == "neg":
            if self.draw(st.booleans()):
                return _Expr(f"neg({e.text})", e.axes, -e.hi, -e.lo)
            inner = f"({e.text})" if e.compound else e.text
            return _Expr(f"-{inner}", e.axes, -e.hi, -e.lo, compound=True)
        return self.generic_unary(fn, e)

    def generic_unary(self, fn: str, e: _Expr) -> _Expr:
        """A function of the table the generator has no rule of its own for: its argument kept
        inside the entry's domain (tanh above it, a positive form below it), its range read off
        its float64 definition (:func:`_image`), squashed by tanh first where that is too wide."""
        low, high = elementwise.function(fn).domain
        for _ in range(2):
            if e.hi >= high:
                e = _Expr(f"tanh({e.text})", e.axes, -1.0, 1.0)
            if e.lo <= low:
                e = self.positive(e)
            lo, hi = _image(fn, (e.lo, e.hi))
            if max(abs(lo), abs(hi)) <= BIG:
                return _Expr(f"{fn}({e.text})", e.axes, lo, hi)
            e = _Expr(f"tanh({e.text})", e.axes, -1.0, 1.0)
        return e  # too wide even on [-1, 1]: the function is left out of this expression

    def generic_binary(self, fn: str, a: _Expr, b: _Expr) -> _Expr:
        """A function of two arguments without a rule of its own: both arguments squashed by
        tanh where they leave the domain, the range read off its float64 definition."""
        low, high = elementwise.function(fn).domain

        def inside(x: _Expr) -> _Expr:
            if x.hi >= high or x.bound > BIG:
                x = _Expr(f"tanh({x.text})", x.axes, -1.0, 1.0)
            return self.positive(x) if x.lo <= low else x

        a, b = inside(a), inside(b)
        lo, hi = _image(fn, (a.lo, a.hi), (b.lo, b.hi))
        if max(abs(lo), abs(hi)) > BIG:
            return a
        return _Expr(f"{fn}({a.text}, {b.text})", _union(a.axes, b.axes), lo, hi)

    def combine(self, a: _Expr, b: _Expr, op: str) -> _Expr:
        def wrap(e, always=False):
            return f"({e.text})" if e.compound or always else e.text

        axes = _union(a.axes, b.axes)
        if op in "+-":
            lo, hi = (a.lo + b.lo, a.hi + b.hi) if op == "+" else (a.lo - b.hi, a.hi - b.lo)
            right = wrap(b) if op == "-" else b.text
            return self.bounded(_Expr(f"{a.text} {op} {right}", axes, lo, hi, compound=True))
        if op == "*":
            lo, hi = _mul_interval((a.lo, a.hi), (b.lo, b.hi))
            return self.bounded(_Expr(f"{wrap(a)} * {wrap(b)}", axes, lo, hi, compound=True))
        if op == "/":
            b = self.positive(b)
            lo, hi = _mul_interval((a.lo, a.hi), (1 / b.hi, 1 / b.lo))
            return self.bounded(_Expr(f"{wrap(a)} / {wrap(b, True) if b.compound else b.text}", axes, lo, hi, compound=True))
        exponent = self.draw(st.sampled_from(["2", "3", "0.5", "-1"]))
        if a.bound > 30:
            a = _Expr(f"tanh({a.text})", a.axes, -1.0, 1.0)
        if exponent in ("0.5", "-1"):
            a = self.positive(a)
        values = [v ** float(exponent) for v in (a.lo, a.hi)] + ([0.0] if exponent == "2" and a.lo < 0 < a.hi else [])
        return _Expr(f"{wrap(a, True) if a.compound or a.text.startswith('-') else a.text}^{exponent}", a.axes, min(values), max(values),
                     compound=True)

    # -- statements
    def level(self) -> str | None:
        roll = self.draw(st.integers(0, 99))
        if roll < 18:
            return TOP[self.hardware]
        if roll < 20:
            return self.draw(st.sampled_from(["smem", "l1", "registers"]))  # below the top: refused when planned
        return None

    def add(self, target: str, axes, rhs: str, lo: float, hi: float, consumed=(), index=True, level="draw", reusable=True):
        level = self.level() if level == "draw" else level
        operands = [self.arrays[n].dtype for n in re.findall(r"\w+", rhs) if n in self.arrays]
        dtype = max(operands, key=_width) if (level and operands) else ("f64" if "f64" in operands else "f32")
        store = None  # a dtype written after the level: `T[i] @gmem bf16 = ...` (docs/notation.md)
        if level == TOP[self.hardware] and self.draw(st.integers(0, 2)) == 0:
            bound = max(abs(lo), abs(hi))
            # each dtype only where the value stays well inside its range (fp8e4m3 ends at 448)
            fits = [d for d, limit in (("bf16", BIG * 10), ("f16", BIG * 10), ("f32", math.inf), ("f64", math.inf),
                                       ("fp8", 200.0), ("fp8e4m3", 200.0), ("fp8e5m2", BIG * 10)) if bound <= limit]
            store = dtype = self.draw(st.sampled_from(fits))
        self.statements.append({"target": target, "axes": tuple(axes), "rhs": rhs, "level": level, "index": index,
                                "consumes": tuple(consumed), "store": store})
        self.arrays[target] = _Array(target, tuple(axes), lo, hi, dtype, "intermediate", reusable)
        for axis in consumed:
            if axis not in self.consumed:
                self.consumed.append(axis)

    def statement(self):
        draw = self.draw
        kind = draw(st.sampled_from(["map", "map", "contract", "contract", "reduce", "softmax", "motif", "motif", "scan"]))
        getattr(self, f"s_{kind}")()

    def s_map(self):
        draw = self.draw
        e = self.expression(draw(st.integers(0, 3)))
        axes = list(e.axes)
        spare = [a for a in self.axes if a not in axes]
        if spare and draw(st.integers(0, 9)) == 0:
            axes.append(draw(st.sampled_from(spare)))  # broadcast to an axis no operand has
        axes = draw(st.permutations(axes))
        explicit = len(axes) != len(e.axes) or "*" in e.text or draw(st.integers(0, 3)) > 0
        self.add(self.fresh("T"), axes, e.text, e.lo, e.hi, index=explicit)

    def s_contract(self):
        draw = self.draw
        first = self.array(need=self.some_axes(1, 2))
        if not first.axes:
            first = self.array(need=self.some_axes(1, 1))
        joined = tuple(draw(st.lists(st.sampled_from(first.axes), min_size=1, max_size=min(2, len(first.axes)), unique=True)))
        operands = [first, self.array(need=joined)]
        if draw(st.integers(0, 4)) == 0:
            operands.append(self.array())
        union = _union(*(o.axes for o in operands))
        shared = [a for a in union if sum(a in o.axes for o in operands) >= 2]
        contracted = [a for a in shared if draw(st.integers(0, 3)) > 0] if shared else []
        target = [a for a in union if a not in contracted]
        length = math.prod(self.max_size for _ in contracted)
        lo, hi = operands[0].lo, operands[0].hi
        for o in operands[1:]:
            lo, hi = _mul_interval((lo, hi), (o.lo, o.hi))
        lo, hi = min(lo * length, lo), max(hi * length, hi)
        factors = [self.ref(o) for o in operands]
        if draw(st.integers(0, 2)) == 0:  # a scalar factor
            scale = draw(st.sampled_from(["2", "0.5", f"len({draw(st.sampled_from(self.used_axes()))})^-0.5", "SCALAR"]))
            if scale == "SCALAR":
                scale = self.scalar_param()
            factors.insert(draw(st.integers(0, len(factors))), scale)
            lo, hi = _mul_interval((lo, hi), (-2.0, 2.0))
        if max(abs(lo), abs(hi)) > BIG * 10:
            return self.s_map()
        self.add(self.fresh("C"), draw(st.permutations(target)), " * ".join(factors), lo, hi, consumed=contracted)

    def s_reduce(self):
        draw = self.draw
        e = self.expression(draw(st.integers(0, 2)))
        op = draw(st.sampled_from(["sum", "max", "min", "mean", "lse", "logsumexp"]))
        reduced = draw(st.lists(st.sampled_from(e.axes), min_size=1, max_size=min(2, len(e.axes)), unique=True))
        kept = [a for a in e.axes if a not in reduced]
        lo, hi = e.lo, e.hi
        n = self.max_size ** len(reduced)
        if op == "sum":
            lo, hi = min(lo, lo * n), max(hi, hi * n)
        if op in ("lse", "logsumexp"):  # max <= lse <= max + log(n)
            hi = hi + math.log(n)
        if max(abs(lo), abs(hi)) > BIG * 10:
            op, lo, hi = "mean", e.lo, e.hi
        operand, reusable = e.text, True
        if op in ("lse", "logsumexp", "max") and draw(st.integers(0, 2)) == 0:
            # masked: a fully masked row's lse and max are -inf, which nothing may read
            operand, reusable = self.masked(e.text, reduced[0], [a for a in e.axes if a != reduced[0]]), False
        elif op == "sum" and draw(st.integers(0, 3)) == 0:
            # zero-masked: streamed along its axis, the chunks the mask hides add nothing (pseudocode._zero_mask)
            operand = f"where({self.condition(reduced[0], [a for a in e.axes if a != reduced[0]])}, {e.text}, 0)"
            lo, hi = min(lo, 0.0), max(hi, 0.0)
        target = self.fresh("R")
        self.add(target, draw(st.permutations(kept)), f"{op}[{' '.join(reduced)}]({operand})", lo, hi, consumed=reduced,
                 index=bool(kept) or draw(st.booleans()), reusable=reusable)
        if not reusable:
            self.wanted.append(target)

    def s_softmax(self):
        draw = self.draw
        e = self.expression(draw(st.integers(0, 2)))
        axis = draw(st.sampled_from(e.axes))
        operand = e.text
        if draw(st.integers(0, 2)) == 0:
            operand = self.masked(operand, axis, [a for a in e.axes if a != axis])
        self.add(self.fresh("P"), draw(st.permutations(e.axes)), f"softmax[{axis}]({operand})", 0.0, 1.0, consumed=[axis],
                 index=draw(st.booleans()))

    def s_scan(self):
        """``cumsum[x](E)`` or ``cumprod[x](E)``: the whole right-hand side, keeping its axis. A
        product's operand is held to [-1, 1] (tanh), so that its running products stay there."""
        draw = self.draw
        e = self.expression(draw(st.integers(0, 2)))
        if not e.axes:
            return self.s_map()
        axis = draw(st.sampled_from(e.axes))
        op = draw(st.sampled_from(["cumsum", "cumprod"]))
        if op == "cumprod":
            if e.bound > 1:
                e = _Expr(f"tanh({e.text})", e.axes, -1.0, 1.0)
            bound = max(abs(e.lo), abs(e.hi))  # at most 1: the running products shrink
            lo, hi = (-bound, bound) if e.lo < 0 else (0.0, e.hi)
        else:
            n = self.max_size
            lo, hi = min(e.lo, e.lo * n), max(e.hi, e.hi * n)
            if max(abs(lo), abs(hi)) > BIG * 10:
                return self.s_map()
        self.add(self.fresh("U"), draw(st.permutations(e.axes)), f"{op}[{axis}]({e.text})", lo, hi, consumed=[axis],
                 index=draw(st.booleans()))

    def masked(self, operand: str, axis: str, others) -> str:
        """``where(COND, operand, -inf)``: COND a condition on the indices of ``axis`` (the one a
        softmax or reduction acts along) and of ``others`` (axes the statement iterates over)."""
        return f"where({self.condition(axis, others)}, {operand}, -inf)"

    def condition(self, axis: str, others) -> str:
        draw = self.draw
        atoms = [self.comparison(axis, others) for _ in range(draw(st.integers(1, 2)))]
        joiner = " or " if len(atoms) > 1 and draw(st.integers(0, 7)) == 0 else " and "  # `or` skips nothing when streamed
        return joiner.join(atoms)

    def comparison(self, x: str, others) -> str:
        """A linear comparison of axis indices (docs/notation.md, Masks): causal, windows, the
        decoding offset ``len(x) - len(q)``, integer coefficients, and forms that mask whole rows
        (``q >= x + 2``, ``x >= len(x)``); rarely ``!=`` or ``not``, tested on every chunk."""
        draw = self.draw
        c = draw(st.integers(0, 3))
        single = [f"{x} < {c + 1}", f"{x} >= {c}", f"{x} <= len({x}) - {c + 1}", f"{x} >= len({x})", f"{x} != {c}"]
        if not others or draw(st.integers(0, 4)) == 0:
            return draw(st.sampled_from(single))
        q = draw(st.sampled_from(others))
        pair = [f"{q} >= {x}", f"{x} <= {q}", f"{q} > {x}", f"{q} - {x} < {c + 1}", f"{q} + (len({x}) - len({q})) >= {x}",
                f"{q} + len({x}) - len({q}) >= {x}", f"2 * {q} >= {x}", f"{q} >= {x} + {c + 1}", f"{x} - {q} <= {c}",
                f"{q} != {x}", f"not ({x} > {q})"]
        return draw(st.sampled_from(pair))

    def s_motif(self, motif: str | None = None):
        draw = self.draw
        motif = motif or draw(st.sampled_from(["attention", "attention", "rmsnorm", "mlp", "logsumexp", "online", "opaque"]))
        if len(self.axes) < 3:
            return self.s_contract()
        names = draw(st.permutations(self.axes))
        if motif == "opaque":
            return self.opaque(names)
        if motif == "attention":
            q, x, d, *rest = names
            batch = tuple(rest[:draw(st.integers(0, min(2, len(rest))))])
            dtype = draw(st.sampled_from(["bf16", "f16", "f32"]))
            Q, K, V = (self.new_input(batch + axes, dtype) for axes in ((q, d), (x, d), (x, d)))
            S, P, O = self.fresh("S"), self.fresh("P"), self.fresh("O")
            bound = 4.0 * math.sqrt(self.max_size)
            level = TOP[self.hardware] if self.focus and draw(st.booleans()) else self.level()
            self.add(S, batch + (q, x), f"{self.ref(Q)} * {self.ref(K)} * {d}^-0.5", -bound, bound, consumed=[d], level=level)
            cond = self.condition(x, [q] * 3 + list(batch)) if draw(st.booleans()) else None

            def operand():  # S spelled anew each time (S, S[q x], S[x q]): the same operand to the notation
                ref = self.ref(self.arrays[S])
                return f"where({cond}, {ref}, -inf)" if cond else ref

            on_chip = None if self.focus else "draw"
            # The log-sum-exp of the softmax's operand (examples/attention_lse.napkin): streamed
            # over x it is the online softmax's state, read after the stream; after P, or after
            # O; rarely before P (refused streamed: the softmax must come first; right unstreamed).
            lse = draw(st.sampled_from([None, "lse", "lse", "logsumexp"]))
            place = draw(st.sampled_from(["after P", "after O", "after P", "after O", "before P"]))
            L = self.fresh("L")

            def add_lse(at: str):
                if lse and place == at:
                    self.add(L, batch + (q,), f"{lse}[{x}]({operand()})", -bound, bound + math.log(self.max_size), consumed=[x],
                             level=None, reusable=cond is None)
                    self.wanted.append(L)

            add_lse("before P")
            self.add(P, batch + (q, x), f"softmax[{x}]({operand()})", 0.0, 1.0, consumed=[x], index=draw(st.booleans()), level=on_chip)
            add_lse("after P")
            self.add(O, batch + (q, d), f"{P} * {self.ref(V)}", -2.0, 2.0, consumed=[x], level=on_chip)
            add_lse("after O")
            self.preferred_streams.append(x)
        elif motif == "rmsnorm":
            t, d = names[:2]
            X, G = self.new_input((t, d)).name, self.new_input((d,)).name
            eps = self.scalar_param()
            ms = self.fresh("ms")
            self.add(ms, (t,), f"mean[{d}]({X} * {X})", 0.0, 4.0, consumed=[d])
            self.add(self.fresh("Y"), (t, d), f"{X} * rsqrt({ms} + {eps}) * {G}", -60.0, 60.0)
        elif motif == "mlp":
            b, k, n = names[:3]
            X, W, bias = self.new_input((b, k)), self.new_input((k, n)), self.new_input((n,)).name
            H = self.fresh("H")
            bound = 4.0 * self.max_size
            self.add(H, (b, n), f"{self.ref(X)} * {self.ref(W)}", -bound, bound, consumed=[k])
            act = draw(st.sampled_from(["gelu", "silu", "relu", "tanh"]))
            self.add(self.fresh("Y"), (b, n), f"{act}({H} + {bias})", -1.0, bound + 2)
            self.preferred_streams.append(k)
        elif motif == "logsumexp":
            r, c = names[:2]
            X = self.new_input((r, c)).name
            M, Z = self.fresh("M"), self.fresh("Z")
            self.add(M, (r,), f"max[{c}]({X})", -2.0, 2.0, consumed=[c])
            self.add(Z, (r,), f"sum[{c}](exp({X} - {M}))", 0.0, float(self.max_size), consumed=[c])
            self.add(self.fresh("L"), (r,), f"log({Z}) + {M}", -2.0, 2.0 + math.log(self.max_size))
            self.preferred_streams.append(c)  # refused: a two-pass stream (a NapkinError)
        else:
            # An online softmax contracted with its own input over more than the streamed axis.
            a, x = names[:2]
            A = self.new_input((a, x), "f32").name
            Z = self.fresh("Z")
            operand = A if draw(st.booleans()) else self.masked(A, x, [a])
            self.add(Z, (a, x), f"softmax[{x}]({operand})", 0.0, 1.0, consumed=[x])
            kept = draw(st.sampled_from([(), (a,)]))
            self.add(self.fresh("H"), kept, f"{A} * {Z}" + draw(st.sampled_from(["", " * 2"])), -2.0 * self.max_size ** 2,
                     2.0 * self.max_size ** 2, consumed=[x] + ([] if kept else [a]))
            if draw(st.integers(0, 2)) == 0:  # the softmax's log-sum-exp, per row a (its state, streamed)
                L = self.fresh("L")
                self.add(L, (a,), f"{draw(st.sampled_from(['lse', 'logsumexp']))}[{x}]({operand})", -2.0, 2.0 + math.log(self.max_size),
                         consumed=[x], level=None, reusable=operand == A)
                self.wanted.append(L)
            self.preferred_streams.append(x)

    def opaque(self, names):
        """An opaque box applied with inner broadcasting (the paper's Fig. 12)."""
        draw = self.draw
        x, w, y, *rest = names
        two = draw(st.booleans())
        box = f"F{len(self.boxes) + 1}"
        self.boxes.append(f"box {box}(f32[{x}]" + (f", f32[{w}]" if two else "") + f") -> f32[{y}]")
        woven_a = tuple(a for a in rest if draw(st.booleans()))
        woven_b = tuple(a for a in rest if draw(st.booleans()))
        args = [self.new_input(woven_a + (x,), "f32")] + ([self.new_input((w,) + woven_b, "f32")] if two else [])
        woven = _union(woven_a, woven_b if two else ())
        target = draw(st.permutations(woven + (y,)))
        self.add(self.fresh("B"), target, f"{box}({', '.join(self.ref(a) for a in args)})", -BIG, BIG,
                 consumed=[x, y] + ([w] if two else []))

    # -- the text
    def kernel_text(self, name: str, outputs: dict) -> str:
        draw = self.draw
        params = []
        for p in self.params:
            if p in self.scalars:
                params.append(f"{p}: {self.scalars[p]}")
            else:
                params.append(f"{p}: {self.arrays[p].dtype}[{' '.join(self.arrays[p].axes)}]")
        outs = [f"{n}: {dtype}[{' '.join(draw(st.permutations(self.arrays[n].axes)))}]" for n, dtype in outputs.items()]
        sep = draw(st.sampled_from([", ", ",", " , "]))
        lines = self.boxes + [""] * bool(self.boxes) + [f"kernel {name}({sep.join(params)}) -> {sep.join(outs)}:"]
        indent = draw(st.sampled_from(["    ", "\t", "  ", "", " \t"]))
        for s in self.statements:
            target = s["target"]
            if s["index"] or not s["axes"] and target not in outputs:
                target += f"[{' '.join(s['axes'])}]"
            if s["level"]:
                target += f" @{s['level']}"
                if s["store"] and s["target"] not in outputs:  # an output has its declared dtype only
                    target += f" {s['store']}"
            rhs = s["rhs"]
            if draw(st.integers(0, 9)) == 0 and " * " in rhs:
                rhs = rhs.replace(" * ", " * \\\n        ", 1)  # a continued line
            line = f"{indent}{target} = {rhs}"
            if draw(st.integers(0, 9)) == 0:
                line += "   # a comment"
            lines.append(line)
            if draw(st.integers(0, 14)) == 0:
                lines.append("")
        return "\n".join(lines) + "\n"


def _union(*axes_lists) -> tuple:
    seen: dict = {}
    for axes in axes_lists:
        for a in axes:
            seen.setdefault(a)
    return tuple(seen)


_WIDTH = {"f64": 8, "f32": 4, "i32": 4, "i64": 8, "f16": 2, "bf16": 2, "fp8": 1, "fp8e4m3": 1, "fp8e5m2": 1}


def _width(dtype: str) -> int:
    return _WIDTH[dtype]


def _launches(b: _Builder) -> list[list[dict]]:
    """The statements of each launch: an @top statement ends its launch."""
    launches = [[]]
    for s in b.statements:
        launches[-1].append(s)
        if s["level"] == TOP[b.hardware]:
            launches.append([])
    return [launch for launch in launches if launch]


def _relabel(draw, b: _Builder, name: str | None, sizes: dict, eager: bool = False) -> str:
    """A relabel block for the builder's kernel on its hardware (mostly legal): groups on axes no
    box consumes, a stream on a consumed axis; per launch with ``for`` clauses sometimes."""
    hardware = b.hardware
    compute = COMPUTE[hardware]
    symbols = 0

    def size(axis):
        nonlocal symbols
        if draw(st.integers(0, 14)) == 0:
            symbols += 1
            symbol = f"g_{symbols}"
            sizes[symbol] = draw(st.integers(1, sizes[axis] + 1))
            return symbol
        return str(draw(st.integers(1, sizes[axis] + 2)))

    def axes_of(statements):
        used = _union(*(s["axes"] for s in statements), *(b.arrays[n].axes for s in statements for n in re.findall(r"\w+", s["rhs"])
                                                              if n in b.arrays))
        consumed = [a for a in b.consumed if a in used and any(a in s["consumes"] for s in statements)]
        return used, consumed, [a for a in used if a not in consumed]

    def clause(level, statements, scope=""):
        used, consumed, groupable = axes_of(statements)
        groups = [a for a in groupable if draw(st.integers(0, 3)) > 0]
        if consumed and draw(st.integers(0, 24)) == 0:
            groups.append(draw(st.sampled_from(consumed)))  # illegal: refused with a RelabelError
        parts = []
        if groups:
            parts.append("group " + ", ".join(f"{a} {size(a)}" for a in groups))
        free = [a for a in used if a not in groups]
        preferred = [a for a in b.preferred_streams if a in free]
        if level == compute and free and (eager and preferred or draw(st.integers(0, 9)) < 7):
            consumed = [a for a in consumed if a in free]
            if preferred and (eager or draw(st.integers(0, 9)) < 7):
                stream = draw(st.sampled_from(preferred))
            elif consumed and draw(st.integers(0, 9)) < 8:
                stream = draw(st.sampled_from(consumed))
            else:
                stream = draw(st.sampled_from(free))
            parts.append(f"stream {stream} {size(stream)}")
        if not parts:
            return None
        return f"    {level}{scope}: " + "; ".join(draw(st.permutations(parts)))

    lines = [f"relabel {name + ' ' if name else ''}on {hardware}:"]
    launches = _launches(b)
    if len(launches) > 1 and draw(st.integers(0, 2)) == 0:
        for launch in launches:
            if draw(st.integers(0, 3)) > 0:
                targets = draw(st.lists(st.sampled_from([s["target"] for s in launch]), min_size=1, max_size=2, unique=True))
                line = clause(compute, launch, " for " + ", ".join(targets))
                if line:
                    lines.append(line)
    else:
        line = clause(compute, b.statements)
        if line:
            lines.append(line)
    _, _, groupable = axes_of(b.statements)
    if hardware == "three_level" and groupable and draw(st.booleans()):
        outer = [a for a in groupable if draw(st.booleans())]
        if outer:
            lines.append("    l1: group " + ", ".join(f"{a} {size(a)}" for a in outer))
    if hardware in GPUS and groupable and draw(st.integers(0, 19)) == 0:
        level = draw(st.sampled_from(["registers", "l2"]))
        axis = draw(st.sampled_from(groupable))
        lines.append(f"    {level}: group {axis} {size(axis)}")
    if hardware in GPUS and draw(st.integers(0, 5)) == 0:
        # a warpgroup schedule (issue 48): built where a launch has consumer warpgroups, a note elsewhere
        lines.append(f"    overlap: {draw(st.sampled_from(BUILT_OVERLAPS))}")
    return "\n".join(lines) + "\n"


@st.composite
def programs(draw, max_size: int = 6, opencl: bool | None = None) -> Case:
    """A valid napkin program (a Case of kind "valid"); ``opencl`` None draws whether to run it there."""
    hardware = draw(st.sampled_from(HARDWARE[:2] + GPUS + ("H100", "H100")))
    b = _Builder(draw, hardware, max_size)
    for _ in range(draw(st.integers(1, 4))):
        b.statement()
    return _program(draw, b, max_size, opencl)


@st.composite
def attention_programs(draw, max_size: int = 6, opencl: bool | None = None) -> Case:
    """The attention motif first (a mask half the time, its log-sum-exp as an output most of
    the time, S materialised at the top level with a dtype sometimes), then up to one statement
    more, relabelled to stream x wherever a launch can: the streamed mask, the online softmax
    and the lse read off its state, which :func:`programs` draws only now and then."""
    hardware = draw(st.sampled_from(HARDWARE[:2] + GPUS))
    b = _Builder(draw, hardware, max_size)
    b.axes += [a for a in AXIS_NAMES if a not in b.axes][:max(0, 3 - len(b.axes))]
    b.focus = True
    b.s_motif("attention")
    b.focus = False
    for _ in range(draw(st.integers(0, 1))):
        b.statement()
    return _program(draw, b, max_size, opencl, eager=True)


def _program(draw, b: _Builder, max_size: int, opencl: bool | None, eager: bool = False) -> Case:
    """The Case of the builder's statements: outputs, sizes, a relabel block (always where
    ``eager``, streaming a preferred axis wherever it can), seed and backends."""
    hardware = b.hardware
    outputs = {}
    last = b.statements[-1]["target"]
    softmaxes = {s["target"] for s in b.statements if s["rhs"].startswith("softmax[")}
    for s in b.statements:
        name = s["target"]
        if eager and name in softmaxes and name != last:
            continue  # an online softmax is never saved
        if name == last or name in b.wanted or draw(st.integers(0, 3)) == 0:
            array = b.arrays[name]
            choices = ["f32", "f32", "f32", "f64", "bf16"] + (["f16"] if array.bound < 1e4 else [])
            outputs[name] = draw(st.sampled_from(choices))
    name = draw(st.sampled_from(["k", "fuzz", "attention", "k_2", "Kernel"]))
    text = b.kernel_text(name, outputs)
    sizes = {a: draw(st.integers(1, max_size)) for a in b.axes}
    case_hardware = None
    if eager or draw(st.integers(0, 4)) > 0:
        text += draw(st.sampled_from(["\n", "\n\n", "\n# relabelled:\n"]))
        text += _relabel(draw, b, draw(st.sampled_from([name, None])), sizes, eager)
    else:
        case_hardware = draw(st.sampled_from([None, hardware]))
    seed = draw(st.integers(0, 2**16))
    run_opencl = draw(st.integers(0, 9)) == 0 if opencl is None else opencl
    return Case("valid", text, sizes, case_hardware, seed, run_opencl, draw(st.integers(0, 7)) == 0)


# ---- the examples, relabelled -------------------------------------------------------------------------


@functools.cache
def _example(text: str):
    import napkin_dsl as napkin

    (kernel,) = napkin.load(text).values()
    return kernel


@st.composite
def example_relabellings(draw, texts: tuple, max_size: int = 40) -> Case:
    """One of the examples (``texts``: their sources) with a random relabel block on a GPU:
    groups on axes no box consumes, the example's stream axis streamed, sizes that often do not
    divide (at most four tiles per axis, to keep simulators quick); half the time fragment multiples (16, 32, 64) that the tensor-core path takes, with
    a ``registers:`` warp tile sometimes. Opaque examples are not drawn."""
    text = draw(st.sampled_from(texts))
    kernel = _example(text)
    diagram = kernel.diagram
    consumed = {a for s in diagram.statements for a in s.consumed}
    declared = {p.axis: p for level in (kernel.relabel.levels if kernel.relabel else ()) for p in level.partitions}
    streams = [a for a, p in declared.items() if p.kind == "stream"]
    if not streams and draw(st.integers(0, 3)) == 0:
        streams = sorted(a for a in consumed if a in diagram.axes)  # mostly refused: a NapkinError
    batch = {a for a, p in declared.items() if p.size == 1}
    fragments = draw(st.booleans())
    sizes, groups = {}, []
    for axis in diagram.axes:
        if axis in batch:
            sizes[axis] = draw(st.integers(1, 2))
        elif fragments:
            sizes[axis] = draw(st.sampled_from([16, 32, 48, 64]))
        else:
            sizes[axis] = draw(st.integers(1, max_size))
        if axis not in consumed and draw(st.integers(0, 3)) > 0:
            size = 1 if axis in batch else draw(st.sampled_from([16, 32, 64]) if fragments else st.integers(-(-sizes[axis] // 4), sizes[axis] + 3))
            groups.append(f"{axis} {size}")
    parts = [f"group {', '.join(groups)}"] if groups else []
    if streams and draw(st.integers(0, 3)) > 0:
        axis = draw(st.sampled_from(streams))
        size = draw(st.sampled_from([16, 32]) if fragments else st.integers(-(-sizes[axis] // 4), sizes[axis] + 3))
        parts.append(f"stream {axis} {size}")
    hardware = draw(st.sampled_from(["H100", "H100", "A100"]))
    head = text.split("\nrelabel ")[0].rstrip("\n") + "\n"
    head = re.sub(r"@(l0)\b", "@gmem", head)  # the paper's top level is gmem on a GPU
    block = f"\nrelabel {kernel.name} on {hardware}:\n" + (f"    smem: {'; '.join(parts)}\n" if parts else "")
    rows = [g.split()[0] for g in groups if g.split()[0] not in batch]
    if fragments and rows and draw(st.integers(0, 3)) == 0:
        block += f"    registers: group {rows[0]} {draw(st.sampled_from([16, 32]))}\n"
    return Case("valid", head + block, sizes, None, draw(st.integers(0, 2**16)), opencl=True)


# ---- tensor-core programs ------------------------------------------------------------------------------

_TENSOR_ATTENTION = """kernel attention(Q: {dt}[h q d], K: {dt}[h x d], V: {dt}[h x d]) -> {outputs}:
    S[h q x] = Q * K * d^-0.5
    P[h q x] = softmax[x]({operand})
    O[h q d] = P * V
{lse}
relabel attention on {hw}:
    smem: group h 1, q {gq}; stream x {sx}
{warps}"""
_TENSOR_MATMUL = """kernel matmul(A: {dt}[m k], B: {dt}[k n]) -> C: {out}[m n]:
    C[m n] = A * B

relabel matmul on {hw}:
    smem: group m {gm}, n {gn}; stream k {sk}
"""
_TENSOR_MASKS = ("S", "where(q >= x, S, -inf)", "where(q >= x + 9, S, -inf)", "where(x < 16 or x >= 40, S, -inf)")


@st.composite
def tensor_core_programs(draw) -> Case:
    """Attention (masked half the time, its lse an output half the time) or a matmul in bf16 or
    f16, relabelled on a GPU in fragment multiples so that instruction selection takes the
    tensor-core path (tests/test_opencl_properties.py checks that it does), at sizes that are
    multiples of 16 plus a ragged tail, with inputs of magnitude up to 2 or up to 2 x 8 (logits in
    the hundreds). The programs the other strategies draw (sizes 1 to 6) never reach that path."""
    dt = draw(st.sampled_from(["bf16", "f16"]))
    hw = draw(st.sampled_from(["H100", "A100"]))

    def size(tile: int, step: int = 1) -> int:  # one or two tiles and a ragged tail of step-multiples
        return tile * draw(st.integers(1, 2)) + step * draw(st.integers(0, (tile - 1) // step))

    if draw(st.booleans()):
        gq, sx = draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32]))
        sizes = {"h": draw(st.integers(1, 2)), "q": size(gq), "x": size(sx), "d": draw(st.sampled_from([16, 32]))}
        operand = draw(st.sampled_from(_TENSOR_MASKS[:1] * 3 + _TENSOR_MASKS[1:]))
        lse = draw(st.booleans())
        outputs = f"(O: {dt}[h q d], L: f32[h q])" if lse else f"O: {dt}[h q d]"
        warps = "    registers: group q 16\n" if gq == 32 and draw(st.booleans()) else ""
        text = _TENSOR_ATTENTION.format(dt=dt, outputs=outputs, operand=operand, hw=hw, gq=gq, sx=sx, warps=warps,
                                        lse=f"    L[h q] = lse[x]({operand})\n" if lse else "")
    else:
        gm, gn, sk = draw(st.sampled_from([16, 32, 64])), draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32]))
        # rows of A (k) and of B (n) are whole 16-byte units in memory: cp.async copies those
        sizes = {"m": size(gm), "n": size(gn, 8), "k": size(sk, 8)}
        text = _TENSOR_MATMUL.format(dt=dt, out=draw(st.sampled_from(["f32", dt])), hw=hw, gm=gm, gn=gn, sk=sk)
    scale = draw(st.sampled_from([1.0, 1.0, 8.0]))
    return Case("valid", text, sizes, None, draw(st.integers(0, 2**16)), opencl=True, scale=scale)


# ---- split relabellings ------------------------------------------------------------------------------

_SPLIT_REDUCE = """kernel red(X: {dt}[a c]) -> {outputs}:
{body}
relabel red on H100:
    smem: group a {ga}; {cut}
"""
_SPLIT_CONTRACT = """kernel splitk(A: {dt}[m k], B: {dt}[k n]) -> C: f32[m n]:
    C[m n] = A * B

relabel splitk on H100:
    smem: group m {gm}, n {gn}; {cut}
"""
_SPLIT_ATTENTION = """kernel decode(S: {dt}[q x], V: {dt}[x d]) -> {outputs}:
    P[q x] = softmax[x](S)
    O[q d] = P * V
{lse}
relabel decode on H100:
    smem: group q {gq}; {cut}
"""


@st.composite
def split_programs(draw) -> Case:
    """A split relabelling (run on NumPy, and on the printers by the split tests): one or two reductions of
    the split axis (sum, max, min, mean; a map of them after the merge half the time), a split-K
    contraction, or the online softmax contracted with V (its lse an output half the time), cut
    into parts of any size (the last part ragged, a part larger than the axis one part) and each
    part streamed in chunks that need not divide it, or streamed whole."""
    dt = draw(st.sampled_from(["f32", "f32", "bf16"]))

    def cut(axis: str, extent: int) -> str:
        part = draw(st.integers(1, extent + 3))
        stream = f"; stream {axis} {draw(st.integers(1, part))}" if draw(st.integers(0, 3)) > 0 else ""
        return f"split {axis} {part}{stream}"

    shape = draw(st.sampled_from(["reduce", "contract", "attention"]))
    if shape == "reduce":
        sizes = {"a": draw(st.integers(1, 5)), "c": draw(st.integers(2, 40))}
        ops = draw(st.lists(st.sampled_from(["sum", "max", "min", "mean"]), min_size=1, max_size=2, unique=True))
        names = ["Y", "Z"][:len(ops)]
        body = [f"    {n}[a] = {op}[c](X)" for n, op in zip(names, ops, strict=True)]
        outputs = [f"{n}: f32[a]" for n in names]
        if draw(st.booleans()):  # read after the merge: the combine launch computes it
            body.append(f"    W[a] = {' + '.join(names)} * 2")
            outputs.append("W: f32[a]")
        text = _SPLIT_REDUCE.format(dt=dt, outputs=", ".join(outputs), body="\n".join(body) + "\n",
                                    ga=draw(st.integers(1, sizes["a"])), cut=cut("c", sizes["c"]))
    elif shape == "contract":
        sizes = {"m": draw(st.integers(1, 6)), "n": draw(st.integers(1, 6)), "k": draw(st.integers(2, 40))}
        text = _SPLIT_CONTRACT.format(dt=dt, gm=draw(st.integers(1, sizes["m"])), gn=draw(st.integers(1, sizes["n"])),
                                      cut=cut("k", sizes["k"]))
    else:
        sizes = {"q": draw(st.integers(1, 5)), "x": draw(st.integers(2, 40)), "d": draw(st.integers(1, 4))}
        lse = draw(st.booleans())
        outputs = f"(O: {dt}[q d], L: f32[q])" if lse else f"O: {dt}[q d]"
        text = _SPLIT_ATTENTION.format(dt=dt, outputs=outputs, lse="    L[q] = lse[x](S)\n" if lse else "",
                                       gq=draw(st.integers(1, sizes["q"])), cut=cut("x", sizes["x"]))
    return Case("valid", text, sizes, None, draw(st.integers(0, 2**16)), scale=draw(st.sampled_from([1.0, 1.0, 8.0])))


# ---- mutants and absurd sizes ------------------------------------------------------------------

_TOKEN = re.compile(r"\\\n|\n|[ \t]+|#[^\n]*|@\w+|->|\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+|\w+|.", re.UNICODE)
_INSERTS = ("kernel", "relabel", "box", "on", "group", "stream", "for", "@gmem", "@smem", "[", "]", "(", ")", ":", ",", ";", "=",
            "->", "^", "-", "+", "*", "/", "\\\n", "\n", "#", " ", "f32", "bf16", "0", "1", "1e9", "sum", "max", "softmax", "exp",
            "i", "j", "x", "[]", "4294967296", "-1", ".5", "Δ")


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


@st.composite
def mutants(draw, max_size: int = 6) -> Case:
    """A valid program with one to three token mutations: it must load or give a NapkinError."""
    case = draw(programs(max_size=max_size, opencl=False))
    toks = tokens(case.text)
    for _ in range(draw(st.integers(1, 3))):
        if not toks:
            break
        mutate(draw, toks, ("delete", "duplicate", "swap", "swap_any", "replace", "insert"))
    return case.replace(kind="mutant", text="".join(toks))


def mutate(draw, toks: list[str], ops: tuple[str, ...]) -> None:
    """One token mutation, in place, drawn from ``ops``; a swap of the last token falls back to
    an insertion when ``ops`` has one, else to a replacement."""
    i = draw(st.integers(0, len(toks) - 1))
    op = draw(st.sampled_from(ops))
    if op == "swap" and i + 1 >= len(toks):
        op = "insert" if "insert" in ops else "replace"
    if op == "delete":
        del toks[i]
    elif op == "duplicate":
        toks.insert(i, toks[i])
    elif op == "swap":
        toks[i], toks[i + 1] = toks[i + 1], toks[i]
    elif op == "swap_any":
        j = draw(st.integers(0, len(toks) - 1))
        toks[i], toks[j] = toks[j], toks[i]
    elif op == "replace":
        toks[i] = draw(st.sampled_from(toks))
    else:
        toks.insert(i, draw(st.sampled_from(_INSERTS)))


HUGE = (2**31, 2**32 + 1, 10**12, 2**62, 2**63, 2**64 + 1, 10**30, 10**300, 10**5000)


@st.composite
def absurd_sizes(draw, max_size: int = 6) -> Case:
    """A valid program bound to huge sizes: planned, costed and printed, never run."""
    case = draw(programs(max_size=max_size, opencl=False))
    sizes = {k: (draw(st.sampled_from(HUGE)) if draw(st.booleans()) else v) for k, v in case.sizes.items()}
    return case.replace(kind="absurd", sizes=sizes, call=False)


@st.composite
def cases(draw, max_size: int = 6) -> Case:
    """The long profile's mix: 70% valid programs (one in seven of them :func:`attention_programs`),
    20% mutants, 10% absurd sizes."""
    kind = draw(st.sampled_from(["valid"] * 6 + ["attention"] + ["mutant"] * 2 + ["absurd"]))
    if kind == "valid":
        return draw(programs(max_size=max_size))
    if kind == "attention":
        return draw(attention_programs(max_size=max_size))
    if kind == "mutant":
        return draw(mutants(max_size=max_size))
    return draw(absurd_sizes(max_size=max_size))


# ---- the tolerance: a first-order error bound per element ------------------------------------------

UNIT_ROUNDOFF = {"f64": 2.0**-53, "f32": 2.0**-24, "f16": 2.0**-11, "bf16": 2.0**-8, "fp8e4m3": 2.0**-4, "fp8e5m2": 2.0**-3}
LARGEST = {"f16": 65504.0, "fp8e4m3": 448.0, "fp8e5m2": 57344.0, "bf16": 3.38e38, "f32": 3.40e38, "f64": math.inf}
# Half the smallest subnormal: the error of rounding a value that underflows.
UNDERFLOW = {"f16": 2.0**-25, "bf16": 2.0**-134, "fp8e4m3": 2.0**-10, "fp8e5m2": 2.0**-17, "f32": 2.0**-150, "f64": 2.0**-1075}
SPECIAL_ULPS = 16  # exp, log, erf... of the OpenCL built-ins, and the NumPy backend's GELU
LOW = ("f16", "bf16", "fp8e4m3", "fp8e5m2")
MARGIN = 4.0


def _canonical(dtype: str) -> str:
    return {"fp8": "fp8e4m3"}.get(dtype, dtype)


def _expand(values: np.ndarray, axes: tuple, target: tuple) -> np.ndarray:
    """``values`` over ``axes`` laid out over ``target`` (missing axes of size 1, to broadcast)."""
    order = [axes.index(a) for a in target if a in axes]
    moved = np.transpose(values, order) if values.ndim else values
    shape = [values.shape[axes.index(a)] if a in axes else 1 for a in target]
    return np.reshape(moved, shape)


def _round(values, errors, dtype: str):
    """Add the rounding of ``values`` to ``dtype`` to ``errors`` (inf where it overflows)."""
    dtype = _canonical(dtype)
    magnitude = np.abs(values)
    if dtype in ("i32", "i64"):
        return errors + 0.5
    infinite = np.isinf(values)  # -inf (a fully masked row's lse) is -inf in every float dtype
    with np.errstate(all="ignore"):
        rounded = errors + UNIT_ROUNDOFF.get(dtype, 2.0**-24) * magnitude + UNDERFLOW.get(dtype, 0.0)
        return np.where(infinite, errors, np.where(magnitude > LARGEST.get(dtype, math.inf) * (1 - 2**-8), np.inf, rounded))


def _spread(f, v, e):
    """max |f(v +- e) - f(v)|: the error of a monotone function's result (inf outside its domain)."""
    with np.errstate(all="ignore"):
        base = f(v)
        spread = np.maximum(np.abs(f(v + e) - base), np.abs(f(v - e) - base))
    return np.where(np.isfinite(spread), spread, np.inf)


def _rounding(r, ea, eb, u):
    """The rounding of a sum or product ``r`` of two operands with errors ``ea``, ``eb``: none
    where both are exact integers and so is ``r`` below 2^24 (f32 holds it: the index arithmetic
    of a mask, ``q - x``, ``q + len(x) - len(q)``, ``2 * q``), else ``u |r|``."""
    exact = (np.asarray(ea) == 0) & (np.asarray(eb) == 0) & (np.abs(r) < 2.0**24) & (np.floor(r) == r)
    return np.where(exact, 0.0, u * np.abs(r))


def _sigmoid(v):
    # 1 / (1 + e^-v), split by sign so neither side cancels: 0.5 * (1 + tanh(v / 2)) loses every
    # digit below v = -37 (1 + tanh rounds to 0), where a backend's sigmoid is still 1e-17.
    v = np.asarray(v, dtype=np.float64)
    with np.errstate(over="ignore"):
        e = np.exp(-np.abs(v))
    return np.where(v >= 0, 1 / (1 + e), e / (1 + e))


def _gelu(v):
    from math import erfc, sqrt

    return 0.5 * v * np.vectorize(erfc)(-v / sqrt(2))  # 1 + erf(v / sqrt 2) would cancel below v = -8


def _lse_bound(x, ex, where: tuple, length: int, u: float):
    """lse along ``where`` of values ``x`` with errors ``ex`` (-inf entries masked, exact), and
    a bound on a backend's error, stable or online (running max, sum rescaled per chunk).

    lse(x) = m + log(s), s = sum_i exp(t_i), t_i = x_i - m, m the row's maximum.

    * Input errors: lse is 1-Lipschitz in the max norm (its gradient is softmax(x), which sums to
      1), so errors e_i move it by at most max_i e_i, exactly and not only to first order. The
      maximum the backend subtracts may be off, but lse does not depend on m: only t_i's rounding.
    * Rounding: the value's absolute error is the relative error of the computed sum s (the
      log's derivative is 1/s), plus the log's own and the last addition's. The terms of s are
      positive, so its relative error is at most the terms' relative errors averaged with weights
      p_i = exp(t_i)/s (at most their maximum), plus the summation's (length - 1) u. A term's:
      t_i rounded (|t_i| u, exp's derivative being exp), exp's SPECIAL_ULPS u, one more u. Online,
      the sum is multiplied once per chunk (at most ``length`` chunks) by exp(m_old - m_new): its
      ulps, its argument's rounding (the arguments sum to at most the row's range, max - min)
      and the product's rounding.
    * A row with every entry masked is exactly -inf (error 0 where the mask is exact): the
      mismatch check wants it equal.
    """
    with np.errstate(all="ignore"):
        peak = np.max(x, axis=where, keepdims=True)
        shift = np.where(peak == -np.inf, 0.0, peak)
        t = x - shift
        w = np.exp(t)
        total = np.sum(w, axis=where, keepdims=True)
        p = w / np.where(total > 0, total, 1.0)
        live = x > -np.inf
        terms = np.sum(np.where(live, p * (np.abs(np.where(live, t, 0.0)) + SPECIAL_ULPS + 1), 0.0), axis=where, keepdims=True)
        low = np.min(np.where(live, x, np.inf), axis=where, keepdims=True)
        spread = np.where(total > 0, peak - low, 0.0)
        relative = (terms + (length - 1) + length * (SPECIAL_ULPS + 2) + spread) * u
        log_total = np.log(np.where(total > 0, total, 1.0))
        v = np.squeeze(np.where(total > 0, log_total + shift, -np.inf), axis=where)
        # masked entries count too: their error is 0 where the mask is exact, inf where it might flip
        worst = np.max(ex, axis=where, keepdims=True)
        e = worst + relative / np.maximum(1 - relative, 0.5) + SPECIAL_ULPS * u * np.abs(log_total) + u * np.abs(shift)
        e = np.squeeze(np.where(total > 0, e, worst), axis=where)
    return v, e


class _Bounds:
    """Evaluates a diagram in float64, each value with a bound on the error a backend may make."""

    def __init__(self, diagram, inputs, scalars, sizes):
        self.diagram = diagram
        self.sizes = sizes
        self.scalars = {k: float(v) for k, v in scalars.items()}
        self.values = {}  # name -> (values, errors) over the array's axes
        for array in diagram.input_arrays:
            v = np.asarray(inputs[array.name]).astype(np.float64)
            self.values[array.name] = (v, np.zeros_like(v))

    def compute_dtype(self, statement) -> str:
        # f64 when an operand is f64 (notation.md), whatever the result is stored in: the
        # statement's arithmetic and its streaming state (running max, sum, accumulator), on
        # the NumPy backend and in the GPU lowering alike; f32 otherwise.
        operands = [self.diagram.arrays[n].dtype for n in statement.inputs]
        return "f64" if "f64" in operands else "f32"

    def expression(self, expr, axes, u):
        from napkin_dsl.diagram import Apply, Const, Index, Read, ScalarParam

        if isinstance(expr, Index):  # the element's index along an axis: exact (below 2^24 in f32)
            index = _expand(np.arange(self.sizes[expr.axis], dtype=np.float64), (expr.axis,), axes)
            return index, np.zeros(index.shape)
        if isinstance(expr, Read):
            if expr.array not in self.values:  # a window read's view: gathered from its source, exactly
                from napkin_dsl.windows import gather

                view = self.diagram.arrays[expr.array]
                source, source_error = self.values[view.window.source]
                self.values[expr.array] = (gather(view, source, self.sizes), gather(view, source_error, self.sizes))
            v, e = self.values[expr.array]
            stored = self.diagram.arrays[expr.array].axes
            return _expand(v, stored, axes), _expand(e, stored, axes)
        if isinstance(expr, Const) and expr.value.is_infinite:  # -inf in where(COND, S, -inf): exact
            return np.float64(float(expr.value)), np.float64(0.0)
        if isinstance(expr, Const):
            value = float(expr.value.subs({s: self.sizes[s.name] for s in expr.value.free_symbols}))
            # a literal of the compute dtype: exact in f64 (the GPU prints double literals there),
            # and in f32 where f32 holds it (2, 0.5, len(x) - len(q): a mask's offsets are exact)
            return np.float64(value), np.float64(0.0 if float(np.float32(value)) == value else abs(value) * u)
        if isinstance(expr, ScalarParam):
            # exact in its own dtype; rounded once where the compute dtype is narrower
            value = self.scalars[expr.name]
            return np.float64(value), np.float64(abs(value) * u)
        assert isinstance(expr, Apply), expr
        args = [self.expression(a, axes, u) for a in expr.args]
        fn = expr.fn
        special = SPECIAL_ULPS * u
        with np.errstate(all="ignore"):
            if fn in ("ge", "gt", "le", "lt", "eq", "ne"):
                # a condition, 0 or 1: exact unless the operands' errors could flip it (then unknown)
                (a, ea), (b, eb) = args
                r = {"ge": np.greater_equal, "gt": np.greater, "le": np.less_equal, "lt": np.less,
                     "eq": np.equal, "ne": np.not_equal}[fn](a, b)
                # exact operands (indices, sums of them) decide exactly, also where they are equal
                return r, np.where((ea + eb > 0) & (np.abs(a - b) <= ea + eb), np.inf, 0.0)
            if fn in ("and", "or", "not"):
                r = {"and": np.logical_and, "or": np.logical_or, "not": np.logical_not}[fn](*(a for a, _ in args))
                return r, functools.reduce(np.maximum, [np.asarray(e, dtype=np.float64) for _, e in args])  # broadcast shapes
            if fn == "where":
                (c, ec), (a, ea), (b, eb) = args
                return np.where(c, a, b), np.where(ec > 0, np.inf, np.where(c, ea, eb))
            if fn in ("add", "sub"):
                (a, ea), (b, eb) = args
                r = a + b if fn == "add" else a - b
                return r, ea + eb + _rounding(r, ea, eb, u)
            if fn == "mul":
                (a, ea), (b, eb) = args
                r = a * b
                return r, np.abs(a) * eb + np.abs(b) * ea + ea * eb + _rounding(r, ea, eb, u)
            if fn == "div":
                (a, ea), (b, eb) = args
                r = a / b
                denominator = np.abs(b) - eb
                e = np.where(denominator > 0, (ea + np.abs(r) * eb) / np.where(denominator > 0, denominator, 1), np.inf)
                return r, e + u * np.abs(r)
            if fn == "pow":
                (a, ea), (p, ep) = args
                if np.ndim(p) or ep:
                    r = np.power(a, p)
                    return r, _spread(lambda x: np.power(x, p), a, ea) + np.abs(r) * (np.abs(np.log(np.abs(a) + 1e-300)) * ep + special)
                r = np.power(a, p)
                return r, _spread(lambda x: np.power(x, p), a, ea) + special * np.abs(r)
            if fn in ("max", "min"):
                (a, ea), (b, eb) = args
                r = np.maximum(a, b) if fn == "max" else np.minimum(a, b)
                return r, np.maximum(ea, eb)
            entry = elementwise.function(fn)
            if fn not in ("neg", "abs", "relu", "gelu", "silu", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid"):
                # a function of the table with no bound of its own: the spread of its float64
                # definition over each argument's error, plus its own rounding
                f = elementwise.float64(entry)
                values = [a for a, _ in args]
                r = f(*values)
                e = sum(_spread(lambda x, i=i: f(*values[:i], x, *values[i + 1:]), v, ev) for i, (v, ev) in enumerate(args))
                return r, e + (special if entry.unit == "special" else u) * np.abs(r)
            (a, ea), = args
            if fn in ("neg", "abs", "relu"):
                f = {"neg": np.negative, "abs": np.abs, "relu": lambda x: np.maximum(x, 0)}[fn]
                return f(a), ea
            if fn in ("gelu", "silu"):
                r = _gelu(a) if fn == "gelu" else a * _sigmoid(a)
                return r, 1.13 * ea + special * np.abs(r) + special
            f = {"exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "tanh": np.tanh,
                 "sigmoid": _sigmoid}[fn]
            r = f(a)
            return r, _spread(f, a, ea) + special * np.abs(r)

    def statement(self, s):
        from napkin_dsl.diagram import Contract, Map, Reduce, Scan, Softmax

        dtype = self.compute_dtype(s)
        u = UNIT_ROUNDOFF[dtype]
        box = s.box
        with np.errstate(all="ignore"):
            if isinstance(box, Map):
                v, e = self.expression(box.expr, s.axes, u)
                shape = tuple(self.sizes[a] for a in s.axes)
                v, e = np.broadcast_to(v, shape).copy(), np.broadcast_to(e, shape).copy()
            elif isinstance(box, Contract):
                letters = {a: chr(ord("a") + i) for i, a in enumerate(dict.fromkeys(a for r in box.operands for a in r.axes))}
                spec = ",".join("".join(letters[a] for a in r.axes) for r in box.operands) + "->" + "".join(letters[a] for a in s.axes)
                low = [d for d in (self.diagram.arrays[r.array].dtype for r in box.operands) if d in LOW]
                values, magnitudes, perturbed = [], [], []
                for r in box.operands:
                    v, e = self.values[r.array]
                    if low and self.diagram.arrays[r.array].dtype not in LOW:
                        e = e + UNIT_ROUNDOFF[low[0]] * np.abs(v)  # packed to the other operand's precision
                    values.append(v)
                    magnitudes.append(np.abs(v))
                    perturbed.append(np.abs(v) + e)
                v = np.einsum(spec, *values)
                absolute = np.einsum(spec, *magnitudes)
                e = np.einsum(spec, *perturbed) - absolute
                length = math.prod(self.sizes[a] for a in box.contracted)
                e = e + (length + len(box.operands)) * u * absolute
                if box.scale is not None:
                    # a number, or arrays over the output's axes (a post-scale such as sV[b h])
                    scale, scale_error = self.expression(box.scale, s.axes, u)
                    e = np.abs(scale) * e + np.abs(v) * scale_error + u * np.abs(v * scale)
                    v = v * scale
            elif isinstance(box, Reduce):
                from napkin_dsl.diagram import expression_axes

                axes = expression_axes(box.operand)
                x, ex = self.expression(box.operand, axes, u)
                shape = tuple(self.sizes[a] for a in axes)
                x, ex = np.broadcast_to(x, shape), np.broadcast_to(ex, shape)
                where = tuple(axes.index(a) for a in box.axes)
                kept = tuple(a for a in axes if a not in box.axes)
                length = math.prod(self.sizes[a] for a in box.axes)
                if box.op == "lse":
                    v, e = _lse_bound(x, ex, where, length, u)
                elif box.op in ("sum", "mean"):
                    v = np.sum(x, axis=where)
                    e = np.sum(ex, axis=where) + (length + 1) * u * np.sum(np.abs(x), axis=where)
                    if box.op == "mean":
                        v, e = v / length, e / length + u * np.abs(v / length)
                else:
                    v = (np.max if box.op == "max" else np.min)(x, axis=where)
                    e = np.max(ex, axis=where)
                v, e = _expand(v, kept, s.axes), _expand(e, kept, s.axes)
            elif isinstance(box, Scan):
                x, ex = self.expression(box.operand, s.axes, u)
                shape = tuple(self.sizes[a] for a in s.axes)
                x, ex = np.broadcast_to(x, shape), np.broadcast_to(ex, shape)
                k = s.axes.index(box.axis)
                # the elements up to each one, in any order of adding or multiplying (a stream's
                # carry adds the chunk's own scan to the running value): n + 1 roundings at most
                count = _expand(np.arange(1, self.sizes[box.axis] + 1, dtype=np.float64), (box.axis,), s.axes)
                if box.op == "sum":
                    v = np.cumsum(x, axis=k)
                    e = np.cumsum(ex, axis=k) + (count + 1) * u * np.cumsum(np.abs(x), axis=k)
                else:
                    v = np.cumprod(x, axis=k)
                    magnitude = np.cumprod(np.abs(x), axis=k)
                    e = np.cumprod(np.abs(x) + ex, axis=k) * (1 + u) ** (count + 1) - magnitude
            elif isinstance(box, Softmax):
                x, ex = self.expression(box.operand, s.axes, u)
                shape = tuple(self.sizes[a] for a in s.axes)
                x, ex = np.broadcast_to(x, shape), np.broadcast_to(ex, shape)
                k = s.axes.index(box.axis)
                peak = np.max(x, axis=k, keepdims=True)  # a fully masked row (all -inf) is 0 (notation.md)
                shifted = np.exp(x - np.where(peak == -np.inf, 0.0, peak))
                total = np.sum(shifted, axis=k, keepdims=True)
                v = np.where(total == 0, 0.0, shifted / np.where(total == 0, 1.0, total))
                worst = np.max(ex, axis=k, keepdims=True)
                e = v * np.expm1(ex + worst) + (self.sizes[box.axis] + 6) * SPECIAL_ULPS * u * v
            else:  # an opaque box: not judged
                shape = tuple(self.sizes[a] for a in s.axes)
                v, e = np.zeros(shape), np.full(shape, np.inf)
            e = np.where(np.isinf(v), e, e + u * np.abs(v))  # -inf (a masked row) is exact
            array = self.diagram.arrays[s.target]
            if array.role == "output" or array.level is not None:
                e = _round(v, e, array.dtype)
        self.values[s.target] = (np.asarray(v, dtype=np.float64), np.asarray(e, dtype=np.float64))

    def run(self) -> dict:
        for s in self.diagram.statements:
            self.statement(s)
        return {name: self.values[name] for name in self.diagram.outputs}


def error_bounds(diagram, inputs: dict, scalars: dict, sizes: dict) -> dict:
    """Per output, (float64 values, bound on a backend's error per element), as the module
    docstring says: the same bound for the NumPy backend and the GPU lowering, which compute
    in the same dtypes (f64 where an operand is f64)."""
    return _Bounds(diagram, inputs, scalars, sizes).run()


def compare(diagram, outputs: dict, want: dict, bounds: dict) -> list[str]:
    """Where a backend's outputs leave the tolerance (empty: they match the reference)."""
    return [text for _, text, _ in mismatches(diagram, outputs, want, bounds)]


def mismatches(diagram, outputs: dict, want: dict, bounds: dict) -> list[tuple[str, str, float]]:
    """(output, description, max error relative to max |reference|) where outputs leave the tolerance."""
    problems = []
    for name in diagram.outputs:
        array = diagram.arrays[name]
        got = np.asarray(outputs.get(name))
        expected = want[name]
        if got.shape != expected.shape:
            problems.append((name, f"{name}: shape {got.shape}, expected {expected.shape}", math.inf))
            continue
        got = got.astype(np.float64)
        _, bound = bounds[name]
        finite = np.isfinite(expected)
        with np.errstate(all="ignore"):
            allowed = MARGIN * bound + 4 * UNIT_ROUNDOFF.get(_canonical(array.dtype), 0.0) * np.abs(np.where(finite, expected, 0)) + 1e-30
            # an infinity the bound knows exactly (-inf: the lse or max of a fully masked row) must be that infinity
            error = np.where(finite, np.abs(got - expected), np.where(got == expected, 0.0, np.inf))
            error = np.where(np.isnan(got), np.inf, error)  # NaN is wrong, and grossly so
        judged = (finite | np.isinf(expected)) & np.isfinite(allowed)
        bad = judged & ~(error <= allowed)  # NaN in got counts as wrong
        if bad.any():
            ratio = np.where(bad, error / allowed, 0)
            at = np.unravel_index(int(np.nanargmax(np.where(np.isnan(ratio), np.inf, ratio))), got.shape)
            scale = float(np.max(np.abs(expected[judged & finite]), initial=0.0))
            relative = float(np.nanmax(np.where(bad, error, 0))) / scale if scale else math.inf
            problems.append((name, (f"{name}: {int(bad.sum())} of {got.size} values wrong; at {tuple(int(i) for i in at)} got "
                                    f"{got[at]:.6g}, reference {expected[at]:.6g}, allowed error {allowed[at]:.3g}; max error relative "
                                    f"to max |reference| {relative:.3g}"), relative))
    return problems


# ---- inputs ------------------------------------------------------------------------------------------


def fuzz_inputs(diagram, sizes: dict, seed: int, scale: float = 1.0) -> tuple[dict, dict]:
    """Seeded inputs: magnitudes uniform in [0.1, 2] with random signs (integers 1..9 for int
    dtypes), times ``scale`` for float dtypes (large-magnitude cases), in each array's dtype;
    scalar parameters in [0.5, 1.5], exactly representable."""
    from napkin_dsl.types import numpy_dtype

    rng = np.random.default_rng(seed)
    arrays = {}
    for array in diagram.input_arrays:
        shape = [sizes[a] for a in array.axes]
        dtype = numpy_dtype(array.dtype)
        signs = rng.choice([-1.0, 1.0], size=shape)
        if dtype.kind in "iu":
            arrays[array.name] = np.array(signs * rng.integers(1, 10, size=shape), dtype=dtype)
        else:
            arrays[array.name] = np.array(scale * signs * rng.uniform(0.1, 2.0, size=shape), dtype=dtype)
    scalars = {}
    for name, scalar in diagram.scalars.items():
        dtype = numpy_dtype(scalar.dtype)
        value = float(np.float16(rng.uniform(0.5, 1.5)))  # exact in every float dtype the scalar might go through
        scalars[name] = dtype.type(round(value) if dtype.kind in "iu" else value)
    return arrays, scalars


# ---- checking one case ---------------------------------------------------------------------------------


@dataclass
class Failure:
    kind: str  # "traceback", "wrong result", "count mismatch", "hang"
    stage: str
    signature: str  # what tells distinct failures apart
    message: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Outcome:
    """What happened to a case: the stages it passed, where a NapkinError stopped it, its failures."""

    stages: list = field(default_factory=list)
    rejected: str | None = None  # "stage: ErrorClass"
    failures: list = field(default_factory=list)
    message: str = ""  # the NapkinError's text

    def to_dict(self) -> dict:
        return {"stages": self.stages, "rejected": self.rejected, "failures": [f.to_dict() for f in self.failures],
                "message": self.message}


class _Stop(Exception):
    pass


def _frame(tb_exc: BaseException) -> str:
    """The innermost napkin_dsl frame of a traceback (else the innermost frame): file:function."""
    frames = traceback.extract_tb(tb_exc.__traceback__)
    ours = [f for f in frames if "napkin_dsl" in f.filename.replace("\\", "/")]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return "?"
    path = frame.filename.replace("\\", "/")
    short = path[path.index("napkin_dsl"):] if "napkin_dsl" in path else path.rsplit("/", 1)[-1]
    return f"{short}:{frame.name}"


class _Runner:
    def __init__(self, case: Case, outcome: Outcome, on_stage=None):
        self.case = case
        self.outcome = outcome
        self.on_stage = on_stage

    def stage(self, name: str, fn, *args, **kwargs):
        from napkin_dsl.errors import NapkinError

        if self.on_stage is not None:
            self.on_stage(name)
        try:
            result = fn(*args, **kwargs)
        except NapkinError as error:
            self.outcome.rejected = f"{name}: {type(error).__name__}"
            self.outcome.message = str(error)
            raise _Stop() from None
        except RecursionError as error:
            self.fail("traceback", name, f"{name}: RecursionError", f"{type(error).__name__}: {error}")
            raise _Stop() from None
        except Exception as error:  # noqa: BLE001 - the invariant is about exactly this
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__)[-6:])
            self.fail("traceback", name, f"{name}: {type(error).__name__} in {_frame(error)}", text.strip())
            raise _Stop() from None
        if name not in self.outcome.stages:
            self.outcome.stages.append(name)
        return result

    def optional(self, name: str, fn, *args, **kwargs):
        """A stage whose NapkinError or failure ends only itself: its result, or None."""
        rejected, message = self.outcome.rejected, self.outcome.message
        try:
            return self.stage(name, fn, *args, **kwargs)
        except _Stop:
            self.outcome.rejected, self.outcome.message = rejected, message
            return None

    def wrong(self, stage: str, kernel, mismatch) -> None:
        """A wrong result, told apart by how wrong (precision: below 1e-4 of the largest value, or
        gross), the box computing the output, whether a stream runs along an axis it consumes,
        and whether it computes in f64."""
        name, text, relative = mismatch
        statement = kernel.diagram.producer(name)
        streams = {p.axis for level in (kernel.relabel.levels if kernel.relabel else ()) for p in level.partitions if p.kind == "stream"}
        traits = ["precision" if relative < 1e-4 else "gross", statement.box.kind]
        if streams & set(statement.consumed):
            traits.append("streamed")
        if any(kernel.diagram.arrays[n].dtype == "f64" for n in statement.inputs):
            traits.append("f64 operand")
        self.fail("wrong result", stage, f"{stage}: wrong result ({', '.join(traits)})", text)

    def fail(self, kind, stage, signature, message):
        self.outcome.failures.append(Failure(kind, stage, signature, message))


def kernel_sizes(kernel, case: Case) -> dict:
    """The sizes to bind: every axis (3 where the case has none) and every symbolic partition size."""
    sizes = {a: int(case.sizes.get(a, 3)) for a in kernel.diagram.axes}
    for level in (kernel.relabel.levels if kernel.relabel is not None else ()):
        for p in level.partitions:
            if isinstance(p.size, str):
                sizes[p.size] = int(case.sizes.get(p.size, 2))
    return sizes


def check_case(case: Case, opencl: bool | None = None, on_stage=None) -> Outcome:
    """Run ``case`` through the API (see the module docstring); ``opencl`` overrides ``case.opencl``;
    ``on_stage(name)`` is called as each stage starts (the long script names the stage of a hang)."""
    import napkin_dsl as napkin

    outcome = Outcome()
    run = _Runner(case, outcome, on_stage)
    try:
        kernels = run.stage("load", napkin.load, case.text)
        for kernel in kernels.values():
            _check_kernel(run, kernel, case, case.opencl if opencl is None else opencl)
    except _Stop:
        pass
    return outcome


def _check_kernel(run: _Runner, kernel, case: Case, opencl: bool) -> None:
    from napkin_dsl.cost import cost_of
    from napkin_dsl.reference import evaluate

    sizes = kernel_sizes(kernel, case)
    hardware = case.hardware
    program = run.stage("program", kernel.program, hardware, **sizes)
    run.stage("pseudocode", kernel.pseudocode, "text", hardware, **sizes)
    run.stage("pseudocode", kernel.pseudocode, "markdown", hardware, **sizes)
    report = run.stage("cost", cost_of, program, check=False)
    # printing the report: a traceback here is recorded and stops nothing (the backends still run)
    run.optional("cost", report.table)
    run.optional("cost", report.to_dict)
    if case.kind == "absurd":
        run.stage("cost", kernel.cost, hardware, **sizes)
        return
    run.optional("cost", kernel.cost, hardware, **sizes)  # a capacity error stops nothing: the backends run any size
    diagram = kernel.diagram
    axis_sizes = {a: sizes[a] for a in diagram.axes}
    impls = implementations(diagram, axis_sizes)
    inputs, scalars = fuzz_inputs(diagram, axis_sizes, case.seed, case.scale)
    want = run.stage("reference", evaluate, diagram, inputs, scalars, axis_sizes, impls, keep_float64=True)
    bounds = error_bounds(diagram, inputs, scalars, axis_sizes)
    # Each backend on its own: a traceback in one does not hide a wrong result in another.
    ran = run.optional("numpy", execute, program, inputs, scalars, impls)
    if ran is not None:
        outputs, counts = ran
        for problem in mismatches(diagram, outputs, want, bounds):
            run.wrong("numpy", kernel, problem)
        differences = counts.differences(report)
        if differences:
            kind = differences[0].split(":")[0]
            run.fail("count mismatch", "numpy", f"numpy: count mismatch ({kind})", "; ".join(differences))
    if case.call:
        carried = {a for array in diagram.input_arrays for a in array.axes}
        extra = {k: v for k, v in sizes.items() if k not in carried}
        args = [inputs[p] if p in inputs else scalars[p] for p in diagram.params]
        result = run.optional("call", kernel, *args, backend="numpy", hardware=hardware, sizes=extra or None, impls=impls or None)
        if result is not None:
            called = result if isinstance(result, dict) else {diagram.outputs[0]: result}
            for problem in mismatches(diagram, called, want, bounds):
                run.wrong("call", kernel, problem)
    if opencl and not impls:
        from napkin_dsl.backends import opencl as backend

        got = run.optional("opencl", backend.run, program, inputs, scalars)
        if got is not None:
            for problem in mismatches(diagram, got, want, bounds):
                run.wrong("opencl", kernel, problem)


def execute(program, inputs, scalars, impls):
    from napkin_dsl.backends.numpy import execute

    return execute(program, inputs, scalars, impls or None)


def implementations(diagram, sizes: dict) -> dict:
    """An implementation of each opaque box (the reference's calling convention): the product of
    each argument summed over its own axes, times a ramp along each output axis."""
    from napkin_dsl.diagram import Opaque

    impls = {}
    for s in diagram.statements:
        if isinstance(s.box, Opaque):
            signature = s.box.box
            own = [len(axes) for _, axes in signature.inputs]
            out = [sizes[a] for a in signature.outputs[0][1]]

            def box(*args, own=own, out=out):
                value = 1.0
                for arg, n in zip(args, own, strict=False):
                    value = value * np.sum(arg, axis=tuple(range(arg.ndim - n, arg.ndim)))
                ramp = np.arange(1, math.prod(out) + 1, dtype=np.float64).reshape(out) / max(1, math.prod(out))
                return np.multiply.outer(value, ramp)

            impls[signature.name] = box
    return impls


class TimeLimit(BaseException):
    """A case ran past its time limit (a hang, to the fuzzer)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise TimeLimit in this (main) thread after ``seconds``; a no-op where SIGALRM is missing.
    Python code is interrupted; a single long C call (a huge integer power) only when it returns."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeLimit(f"no result after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_case_within(case: Case, seconds: float, opencl: bool | None = None) -> Outcome:
    """``check_case`` with a time limit: running past it is a "hang" failure."""
    try:
        with time_limit(seconds):
            return check_case(case, opencl)
    except TimeLimit as error:
        outcome = Outcome()
        outcome.failures.append(Failure("hang", "?", "hang", str(error)))
        return outcome


# ---- the items of issue 13 a failure matches ---------------------------------------------------------------


def _diagram(case: Case):
    import napkin_dsl as napkin

    try:
        return [k for k in napkin.load(case.text).values()]
    except Exception:  # noqa: BLE001
        return []


def _launch_of(kernel) -> dict:
    """Statement target -> launch index (an @top statement ends its launch)."""
    from napkin_dsl.hardware import load_hardware

    top = {load_hardware(h).top.name for h in HARDWARE}
    launch, where = 0, {}
    for s in kernel.diagram.statements:
        where[s.target] = launch
        if s.level in top:
            launch += 1
    return where


def _streams(kernel) -> set:
    return {p.axis for level in (kernel.relabel.levels if kernel.relabel else ()) for p in level.partitions if p.kind == "stream"}


def on_chip_read_after_split(kernel) -> bool:
    """Item 1: an intermediate kept on chip is read in a later launch than the one computing it."""
    where = _launch_of(kernel)
    diagram = kernel.diagram
    for s in diagram.statements:
        for name in s.inputs:
            array = diagram.arrays[name]
            if array.role == "intermediate" and array.level is None and where.get(name, where[s.target]) < where[s.target]:
                return True
    return False


def online_softmax_contracted_over_more(kernel) -> bool:
    """Item 2: a streamed softmax along x whose result a contraction reads while contracting an
    axis besides x (``Z = softmax[x](A)``, ``H[] = A * Z``, ``stream x``)."""
    from napkin_dsl.diagram import Contract, Softmax

    streams = _streams(kernel)
    diagram = kernel.diagram
    softmaxes = {s.target: s.box.axis for s in diagram.statements if isinstance(s.box, Softmax) and s.box.axis in streams}
    return any(isinstance(s.box, Contract) and r.array in softmaxes and set(s.box.contracted) - {softmaxes[r.array]}
               for s in diagram.statements for r in (s.box.operands if isinstance(s.box, Contract) else ()))


def scaled_contraction_to_one_value(kernel) -> bool:
    """Item 3: a contraction with a scalar factor whose result has no axes. The issue found it
    after a streamed softmax; the fuzzer finds it without any stream (``C[] = 2 * X * Y``)."""
    from napkin_dsl.diagram import Contract

    return any(isinstance(s.box, Contract) and s.box.scale is not None and not s.axes for s in kernel.diagram.statements)


def repeated_reduction_axis(text: str) -> bool:
    """Item 7: ``sum[j j](X)``."""
    for axes in re.findall(r"\b(?:sum|max|min|mean|lse|logsumexp|softmax)\s*\[([^\]]*)\]", text):
        names = axes.split()
        if len(names) != len(set(names)):
            return True
    return False


def masked_skip_losers(kernel) -> set:
    """The masked-skip bug (found by this fuzzer on 2026-12-01, fixed in c10a639): in a launch that
    streams x through ``softmax[x](where(COND, ...))``, the chunks of x the mask hides are skipped
    for every statement of the launch, so the arrays computed there that are not the masked
    softmax's (its contractions, the lse of its operand), and what is computed from them, are
    never computed in those chunks: NaN on NumPy (a KeyError when no chunk is visited at all),
    uninitialised memory on OpenCL. The arrays it loses: the targets of those statements that
    carry or consume x, and of their consumers (``S[q x] = Q * K`` saved as an output beside
    ``softmax[x](where(q >= x, S, -inf))``, ``B[q x] = A * 2`` in the same launch; not
    ``B[q] = A * 2``, computed outside the loop over x)."""
    from napkin_dsl.diagram import Apply, Contract, Reduce, Softmax

    streams = _streams(kernel)
    diagram = kernel.diagram
    where = _launch_of(kernel)
    masked = [s for s in diagram.statements if isinstance(s.box, Softmax) and s.box.axis in streams
              and isinstance(s.box.operand, Apply) and s.box.operand.fn == "where"]
    lost: set = set()
    for m in masked:
        family = {m.target}
        for s in diagram.statements:
            if where[s.target] != where[m.target]:
                continue
            if isinstance(s.box, Contract) and m.target in s.inputs or isinstance(s.box, Reduce) and s.box.operand == m.box.operand:
                family.add(s.target)
        x = m.box.axis  # only statements the stream over x passes through: carrying x or consuming it
        lost |= {s.target for s in diagram.statements if where[s.target] == where[m.target] and s.target not in family
                 and (x in s.axes or x in s.consumed)}
    for s in diagram.statements:  # and what is computed from them
        if lost & set(s.inputs):
            lost.add(s.target)
    return lost


def known_item(case: Case, failure: Failure) -> str | None:
    """The item of issue 13 a failure matches, if any (see tests/test_fuzz.py's KNOWN)."""
    if failure.kind == "traceback" and failure.stage == "opencl" and not case.text.isascii():
        return "item 5"
    if repeated_reduction_axis(case.text) and failure.kind in ("traceback", "wrong result", "count mismatch"):
        return "item 7"
    if case.kind == "absurd" and failure.kind == "traceback" and ("OverflowError" in failure.signature or "ValueError" in failure.signature):
        return "item 9"
    kernels = _diagram(case)
    if failure.stage == "cost" and "AttributeError in napkin_dsl/formatting.py:json_value" in failure.signature and any(
            len(set(_launch_of(k).values())) > 1 for k in kernels):
        return "report of several launches"  # CostReport.to_dict from 4443dc0 to 591015f: a list in report.time
    # the masked-skip bug, before the items whose broad patterns it also meets (a contraction to
    # one value over the masked axis is 0): a wrong result ("NAME: ...") or KeyError 'NAME' for an
    # array it loses
    named = re.match(r"(\w+): ", failure.message) if failure.kind == "wrong result" else (
        re.search(r"KeyError: '(\w+)'", failure.message) if "KeyError" in failure.signature else None)
    if named and any(named.group(1) in masked_skip_losers(k) for k in kernels):
        return "masked skip"
    numpy_keyerror = failure.stage in ("numpy", "call") and "KeyError" in failure.signature
    numpy_wrong = failure.stage in ("numpy", "call") and failure.kind == "wrong result" and "gross" in failure.signature
    opencl_wrong = failure.stage == "opencl" and failure.kind == "wrong result"
    # Each item by its structure and the symptoms the issue gives for it.
    if (numpy_keyerror or opencl_wrong) and any(on_chip_read_after_split(k) for k in kernels):
        return "item 1"
    if numpy_wrong and any(scaled_contraction_to_one_value(k) for k in kernels):
        return "item 3"
    aligner = failure.stage in ("numpy", "call") and "AssertionError" in failure.signature
    if (aligner or opencl_wrong) and any(online_softmax_contracted_over_more(k) for k in kernels):
        return "item 2"
    return None


# ---- minimising a failing case --------------------------------------------------------------------------


def normalised(text: str) -> str:
    """The same program without comments, continuations, blank lines or odd indentation."""
    text = re.sub(r"\\[ \t]*\r?\n\s*", " ", text)
    lines = []
    for line in text.split("\n"):
        line = re.sub(r"#.*", "", line).rstrip()
        if not line.strip():
            continue
        head = line.lstrip()
        if head.startswith(("kernel", "relabel", "box")):
            if head.startswith("relabel") and lines:
                lines.append("")
            lines.append(head)
        else:
            lines.append("    " + head)
    return "\n".join(lines) + "\n"


def _header_items(text: str):
    """(start, end) spans of each parameter and each output in the kernel header lines."""
    spans = []
    for m in re.finditer(r"^kernel\s+\w+\s*\((.*)\)\s*->(.*):\s*$", text, re.MULTILINE):
        for group in (1, 2):
            start = m.start(group)
            for item in re.finditer(r"[^,]+", m.group(group)):
                spans.append((start + item.start(), start + item.end()))
    return spans


def _without_span(text: str, start: int, end: int) -> str:
    """``text`` without [start, end) and one adjacent comma."""
    after = text[end:]
    if after.lstrip().startswith(","):
        return text[:start] + after.lstrip()[1:].lstrip()
    before = text[:start].rstrip()
    if before.endswith(","):
        return before[:-1] + after
    return text[:start] + after


def _simplifications(text: str):
    """Smaller variants of the statements: a call replaced by its argument, an operand and its
    operator dropped, a reduced or partitioned axis dropped, a size made 1."""
    header = re.search(r"^(kernel\s+\w+\s*\(.*\)\s*->)(.*):\s*$", text, re.MULTILINE)
    if header:
        for m in re.finditer(r"^\s+(\w+)\s*(?:\[([^\]]*)\])?\s*(?:@\w+\s*)?=", text, re.MULTILINE):
            axes = m.group(2)
            if axes is not None and f" {m.group(1)}:" not in header.group(2) + " ":
                # the statement's target as the kernel's only output
                yield text[:header.start(2)] + f" {m.group(1)}: f32[{axes.strip()}]" + text[header.end(2):]
    for m in re.finditer(rf"\b({'|'.join(unary_functions())})\(", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        yield text[:m.start()] + "(" + text[m.end():i - 1] + ")" + text[i:]
    for m in re.finditer(r"\s*[-+*/^]\s*(?:\w+(?:\[[^\]]*\])?|\d*\.?\d+(?:[eE][+-]?\d+)?)(?=\s|$|\))", text):
        yield text[:m.start()] + text[m.end():]
    for m in re.finditer(r"(?:\w+(?:\[[^\]]*\])?|\d*\.?\d+)\s*[-+*/]\s*", text):
        yield text[:m.start()] + text[m.end():]
    for m in re.finditer(r"\(([^()]*)\)", text):
        if not re.search(r"\w$", text[:m.start()]):
            yield text[:m.start()] + m.group(1) + text[m.end():]
    for m in re.finditer(r",\s*\w+ \w+|\w+ \w+,\s*", text):  # a partition of a clause
        if re.match(r"\s*(group|stream)\b", text[text.rfind(":", 0, m.start()) + 1:]):
            yield text[:m.start()] + text[m.end():]
    for m in re.finditer(r"(?<=[ ,:])(group|stream) (\w+) (\d+)", text):
        if m.group(3) != "1":
            yield text[:m.start(3)] + "1" + text[m.end(3):]


def minimise(case: Case, reproduces, budget: int = 300, seconds: float = 60.0) -> Case:
    """A smaller case for which ``reproduces(case)`` still holds: comments and continuations
    gone, whole lines dropped, parameters and outputs dropped, expressions simplified, token
    spans dropped, sizes shrunk, dtypes made f32; each while it helps, within ``budget``
    calls of ``reproduces`` and about ``seconds``."""
    import time

    calls, deadline = 0, time.monotonic() + seconds
    seen = {case.to_json()}  # a candidate is tried once: rewrites of the outputs may go in circles

    def attempt(candidate: Case) -> bool:
        nonlocal calls
        key = candidate.to_json()
        if calls >= budget or time.monotonic() > deadline or key in seen:
            return False
        seen.add(key)
        calls += 1
        return reproduces(candidate)

    def left() -> bool:
        return calls < budget and time.monotonic() < deadline

    def try_texts(variants) -> bool:
        nonlocal case
        for text in variants:
            if not left():
                return False
            if attempt(case.replace(text=text)):
                case = case.replace(text=text)
                return True
        return False

    try_texts([normalised(case.text)])
    improved = True
    while improved and left():
        improved = False
        lines = case.text.split("\n")
        while try_texts("\n".join(lines[:i] + lines[i + 1:]) for i in reversed(range(len(lines))) if lines[i].strip()):
            improved, lines = True, case.text.split("\n")
        while try_texts(_without_span(case.text, a, b) for a, b in reversed(_header_items(case.text))):
            improved = True
        while try_texts(_simplifications(case.text)):
            improved = True
        while try_texts(re.sub(r"\b(bf16|f16|f64|fp8e5m2|fp8e4m3|fp8|i32|i64)\b", "f32", case.text, count=1) for _ in [0]
                        if re.search(r"\b(bf16|f16|f64|fp8e5m2|fp8e4m3|fp8|i32|i64)\b", case.text)):
            improved = True
        for name, value in sorted(case.sizes.items()):
            for smaller in (1, 2, value // 2):
                if 0 < smaller < value and left() and attempt(case.replace(sizes={**case.sizes, name: smaller})):
                    case, improved = case.replace(sizes={**case.sizes, name: smaller}), True
                    break
        if not improved:
            for width in (2, 1):
                toks = tokens(case.text)
                if try_texts("".join(toks[:i] + toks[i + width:]) for i in reversed(range(len(toks) - width + 1)) if toks[i].strip()):
                    improved = True
                    break
    axes = set(re.findall(r"\w+", case.text))
    unused = {k: v for k, v in case.sizes.items() if k in axes}
    if unused != case.sizes and left() and attempt(case.replace(sizes=unused)):
        case = case.replace(sizes=unused)
    for flag in ("opencl", "call"):
        if getattr(case, flag) and left() and attempt(case.replace(**{flag: False})):
            case = case.replace(**{flag: False})
    return case
