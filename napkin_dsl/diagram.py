"""The typed diagram: axes with sizes, arrays with dtypes and levels, one box per statement.

A :class:`Diagram` is what the checker (``check.py``) builds from the syntax of one kernel.
Every statement is one box of the paper's diagrams:

* :class:`Contract`: a product of array references that sums away the axes missing from
  its target (a wire cap), optionally scaled by a scalar;
* :class:`Map`: an elementwise expression, broadcasting operands over missing axes;
* :class:`Reduce`: ``sum/max/min/mean[axes](expr)``;
* :class:`Softmax`: ``softmax[axis](expr)``;
* :class:`Opaque`: an application of a ``box`` declared by signature only.

Each statement records the axes it is woven over (they pass over the box) and the axes it
consumes (the box acts along them), its FLOPs per compute unit as size expressions (``algebra.py``), and the
arrays it reads. This module holds data and small queries only; it does not check anything
(``check.py``), and it knows nothing of memory levels beyond the ``@level`` a statement names.

What each kind of box computes, streams as and reduces with is the table of box kinds
(``boxes.py``), which reads these types.

Elementwise expressions are a small tree (:class:`Read`, :class:`Const`, :class:`ScalarParam`,
:class:`Index`, :class:`Apply`) that backends evaluate with broadcasting over named axes. An
:class:`Index` is the element's index along an axis (masks: ``where(q >= x, S, -inf)``);
comparisons and ``and``/``or``/``not`` yield conditions (:func:`is_boolean`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from . import algebra, elementwise
from .dtypes import DTYPE_BYTES, INTEGER_DTYPES
from .errors import Span

# ---- dtypes (their table: dtypes.py) -------------------------------------------------------


def accumulation_dtype(dtypes) -> str:
    """The dtype a box computes in: f64 if any operand is f64, else f32.

    f16/bf16/fp8 products and reductions accumulate in f32, as tensor cores do.
    """
    return "f64" if "f64" in set(dtypes) else "f32"


def intermediate_dtype(operand_dtypes, source_dtypes, materialised: bool) -> str:
    """The dtype of an intermediate written without one: when materialised (saved and read
    back), stored at the width of the widest stored array it is computed from
    (:func:`source_dtypes`), else computed in the accumulation dtype of its operands.

    Stored arrays, not operands: in ``H = silu(G) * U`` with G and U contractions of bf16 inputs
    kept on chip (f32 accumulators), a materialised H is bf16, as it is when G and U are
    materialised too; so every fusion choice the tuner compares stores the same precision.
    The checker and plan.materialise both follow it.

    An integer source counts only when every source is an integer: ``X + N`` of an f32 X and
    an i32 N is a float value, stored as f32 (i32 is as wide, and would round it)."""
    if materialised:
        source_dtypes = list(source_dtypes)
        floats = [d for d in source_dtypes if d not in INTEGER_DTYPES]
        candidates = floats or source_dtypes
        return max(candidates, key=lambda d: DTYPE_BYTES[d]) if candidates else "f32"
    return accumulation_dtype(operand_dtypes)


def source_dtypes(inputs, arrays: dict, producers: dict) -> list[str]:
    """The dtypes of the stored arrays a statement reading ``inputs`` is computed from: kernel
    inputs, outputs and materialised intermediates, followed back through the intermediates
    that are not materialised (their values exist only on chip). ``arrays``: name -> Array;
    ``producers``: name -> the Statement computing it."""
    found, seen, pending = [], set(), list(inputs)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        array = arrays[name]
        if array.role == "intermediate" and array.level is None and name in producers:
            pending.extend(producers[name].inputs)
        else:
            found.append(array.dtype)
    return found


# ---- elementwise functions ---------------------------------------------------------------

# The functions a kernel calls by name are the table of elementwise functions
# (elementwise.FUNCTIONS: arity, unit, definitions, spellings); every reader asks the table, so a
# function added to it at run time is known everywhere. The operators are the notation's own.
OPERATORS = {"+": "add", "-": "sub", "*": "mul", "/": "div", "^": "pow"}
# Masks: comparisons yield booleans, and/or/not combine them, where(cond, a, b) picks a number.
COMPARISONS = {">=": "ge", ">": "gt", "<=": "le", "<": "lt", "==": "eq", "!=": "ne"}
LOGICAL = {"and", "or", "not"}
BOOLEAN_FUNCTIONS = set(COMPARISONS.values()) | LOGICAL  # Apply.fn values whose result is a boolean
# The reductions (sum, max, ..., lse) are named in the table of box kinds (boxes.REDUCTION_OPS).


@dataclass(frozen=True)
class Axis:
    """A wire: a named axis with one size across the kernel (a size symbol or integer)."""

    name: str
    size: algebra.Expr
    span: Span | None = field(default=None, repr=False)  # where the axis first appeared; out of reprs, as every span

    @staticmethod
    def symbol(name: str) -> algebra.Symbol:
        return algebra.Symbol(name, positive=True, integer=True)


@dataclass(frozen=True)
class AffineIndex:
    """One index of a window read: ``offset + sum(coefficient * axis)``, each coefficient and
    the offset an integer or a size expression (``len(c)``)."""

    terms: tuple[tuple[str, algebra.Expr], ...]
    offset: algebra.Expr = algebra.Integer(0)

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(axis for axis, _ in self.terms)

    def __str__(self) -> str:
        parts = []
        for axis, coefficient in self.terms:
            shown = axis if coefficient == 1 else f"{size_text(coefficient)}*{axis}"
            parts.append(("- " + shown[1:] if shown.startswith("-") else "+ " + shown) if parts else shown)
        if self.offset != 0 or not parts:
            shown = size_text(algebra.as_expr(self.offset))
            parts.append(("- " + shown[1:] if shown.startswith("-") else "+ " + shown) if parts else shown)
        return " ".join(parts)


@dataclass(frozen=True)
class Window:
    """How a view array reads its source: one :class:`AffineIndex` per axis of ``source``, in
    its storage order. ``pad``: the value read where an index falls outside the source (a
    padded convolution's 0, a pooling's -inf); None where every index must stay inside."""

    source: str
    indices: tuple[AffineIndex, ...]
    pad: float | None = None

    def text(self, source_axes: tuple[str, ...]) -> str:
        """As written: ``X[b c (2*p + i)]``, with ``pad(..., 0)`` around it where padded."""
        items = [axis if index.terms == ((axis, 1),) and index.offset == 0 else f"({index})"
                 for axis, index in zip(source_axes, self.indices, strict=True)]
        read = f"{self.source}[{' '.join(items)}]"
        return read if self.pad is None else f"pad({read}, {self.pad:g})"


@dataclass(frozen=True)
class Array:
    """An array of the kernel: a parameter, an output or an intermediate.

    A **view** (``window`` set, role "input") is a window read of a parameter: an array over
    the axes the read's indices use, ``X_win[b c p i]`` for ``X[b c (2*p + i)]``, whose
    values the binding gathers from the parameter before a launch (windows.py)."""

    name: str
    dtype: str
    axes: tuple[str, ...]
    role: str  # "input", "output" or "intermediate"
    level: str | None = None  # the level it lives at when materialised; None = on chip
    span: Span | None = field(default=None, repr=False)
    window: Window | None = None

    @property
    def bytes_per_value(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class ScalarParameter:
    name: str
    dtype: str
    span: Span | None = field(default=None, repr=False)


# ---- elementwise expression tree -----------------------------------------------------------


@dataclass(frozen=True)
class Read:
    """A read of a whole array; ``axes`` are its axes in storage order."""

    array: str
    axes: tuple[str, ...]
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Const:
    """A number or a size expression such as ``d^-0.5`` (``algebra.py``)."""

    value: algebra.Expr


@dataclass(frozen=True)
class ScalarParam:
    name: str


@dataclass(frozen=True)
class Index:
    """The index of the current element along ``axis`` (0 to size - 1), as a number: ``q`` in
    ``where(q >= x, S, -inf)`` or ``x - q`` in an ALiBi bias. Always the whole array's index,
    never a tile's."""

    axis: str


@dataclass(frozen=True)
class Apply:
    """An elementwise function or operator: ``fn`` a name in ``elementwise.FUNCTIONS``, OPERATORS' values,
    COMPARISONS' values, LOGICAL, or ``where`` (three arguments: condition, then, else)."""

    fn: str
    args: tuple["Expression", ...]


Expression = Union[Read, Const, ScalarParam, Index, Apply]


def _leaves(expr: Expression, kind: type) -> list:
    """Every leaf of type ``kind`` in an expression, left to right."""
    if isinstance(expr, kind):
        return [expr]
    if isinstance(expr, Apply):
        return [leaf for arg in expr.args for leaf in _leaves(arg, kind)]
    return []


def reads(expr: Expression) -> list[Read]:
    """Every array read in an expression, left to right."""
    return _leaves(expr, Read)


def indices(expr: Expression) -> list[Index]:
    """Every axis index in an expression, left to right."""
    return _leaves(expr, Index)


def expression_axes(expr: Expression) -> tuple[str, ...]:
    """Axes of an elementwise expression: the union of its reads' and its indices', in order of
    appearance (``where(q >= x, S[q x], 0)`` varies along q and x)."""
    seen: dict[str, None] = {}
    for read in reads(expr):
        for axis in read.axes:
            seen.setdefault(axis)
    for index in indices(expr):
        seen.setdefault(index.axis)
    return tuple(seen)


def is_boolean(expr: Expression) -> bool:
    """Whether an expression is a condition (a comparison or a logical combination of them)."""
    return isinstance(expr, Apply) and expr.fn in BOOLEAN_FUNCTIONS


def count_operations(expr: Expression) -> dict[str, int]:
    """Elementwise operations per output element, by compute unit ("fma" or "special").

    Operations on scalars only (``d^-0.5``) are folded at compile time and cost nothing.
    """
    counts = {"fma": 0, "special": 0}
    if isinstance(expr, Apply):
        if not reads(expr) and not indices(expr):
            return counts
        for arg in expr.args:
            for unit, n in count_operations(arg).items():
                counts[unit] += n
        counts[operation_unit(expr)] += operation_count(expr)
    return counts


def operation_unit(expr: Apply) -> str:
    """The unit one elementwise operation runs on: a function's, from the table of elementwise
    functions; a power with a non-integer exponent runs as exp/log on the special-function
    unit; every other operator on the FMA pipe."""
    entry = elementwise.function(expr.fn)
    if entry is not None:
        return entry.unit
    fractional_power = expr.fn == "pow" and not (isinstance(expr.args[1], Const) and expr.args[1].value.is_integer)
    return "special" if fractional_power else "fma"


def operation_count(expr: Apply) -> int:
    """The operations one evaluation of an elementwise operation counts on its unit."""
    entry = elementwise.function(expr.fn)
    return entry.operations if entry is not None else 1


def format_expression(expr: Expression) -> str:
    return _format(expr, indexed=bool(indices(expr)))


def size_text(value: algebra.Expr) -> str:
    """A size expression where axis names would read as indices: each size spelled len(x)."""
    return str(value.subs({sym: algebra.Symbol(f"len({sym.name})") for sym in value.free_symbols if sym.is_positive}))


def _format(expr: Expression, indexed: bool) -> str:
    """``indexed``: the expression reads axis indices, so sizes print as len(x), not x."""
    if isinstance(expr, Read):
        return f"{expr.array}[{' '.join(expr.axes)}]"
    if isinstance(expr, Const):
        if expr.value in (algebra.oo, -algebra.oo):
            return "inf" if expr.value > 0 else "-inf"
        return size_text(expr.value) if indexed else str(expr.value)
    if isinstance(expr, ScalarParam):
        return expr.name
    if isinstance(expr, Index):
        return expr.axis
    symbols = {v: k for k, v in OPERATORS.items()} | {v: k for k, v in COMPARISONS.items()} | {"and": "and", "or": "or"}
    if expr.fn in symbols and len(expr.args) == 2:
        left, right = (_format(a, indexed) for a in expr.args)
        return f"({left} {symbols[expr.fn]} {right})"
    if expr.fn == "not":
        return f"(not {_format(expr.args[0], indexed)})"
    return f"{expr.fn}({', '.join(_format(a, indexed) for a in expr.args)})"


# ---- boxes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Contract:
    operands: tuple[Read, ...]
    contracted: tuple[str, ...]
    scale: Expression | None = None
    kind = "contract"


@dataclass(frozen=True)
class Map:
    expr: Expression
    kind = "map"


@dataclass(frozen=True)
class Reduce:
    op: str  # sum, max, min, mean
    axes: tuple[str, ...]
    operand: Expression
    kind = "reduce"


@dataclass(frozen=True)
class Softmax:
    axis: str
    operand: Expression
    kind = "softmax"


@dataclass(frozen=True)
class Scan:
    """``cumsum[x](E)``, ``cumprod[x](E)``: along ``axis``, each element the sum (``op`` "sum")
    or product ("prod") of the operand's elements up to and including it. It keeps its axis, as
    a softmax does, and acts along it (the axis is consumed, never woven)."""

    op: str  # "sum" or "prod"
    axis: str
    operand: Expression
    kind = "scan"

    @property
    def name(self) -> str:
        return f"cum{self.op}"


# A scan's name in the notation -> its op (Scan.op)
SCAN_OPS = {"cumsum": "sum", "cumprod": "prod"}


@dataclass(frozen=True)
class BoxSignature:
    name: str
    inputs: tuple[tuple[str, tuple[str, ...]], ...]  # (dtype, axes) per input
    outputs: tuple[tuple[str, tuple[str, ...]], ...]
    span: Span | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Opaque:
    box: BoxSignature
    args: tuple[Read, ...]
    kind = "opaque"


Box = Union[Contract, Map, Reduce, Softmax, Scan, Opaque]


@dataclass(frozen=True)
class Statement:
    """One box of the diagram, producing one array."""

    index: int
    target: str
    axes: tuple[str, ...]  # the target's axes
    box: Box
    woven: tuple[str, ...]  # axes passing over the box
    consumed: tuple[str, ...]  # axes the box acts along (contracted, reduced, softmaxed, box-internal)
    inputs: tuple[str, ...]  # names of arrays read, without repeats
    flops: dict  # unit ("tensor", "fma", "special") -> size expression, for the whole statement
    dtype: str  # dtype of the result as computed
    span: Span | None = field(default=None, repr=False)
    level: str | None = None  # @level materialisation

    @property
    def total_flops(self) -> algebra.Expr:
        return algebra.Add(*self.flops.values())

    @property
    def iteration_axes(self) -> tuple[str, ...]:
        """Target axes followed by the consumed axes that disappear from the target."""
        return self.axes + tuple(a for a in self.consumed if a not in self.axes)

    def __repr__(self) -> str:
        # The statement as written; its box tree, FLOPs and spans made the dataclass repr unreadable.
        level = f" @{self.level}" if self.level else ""
        return f"<Statement {self.index}: {self.target}[{' '.join(self.axes)}]{level} {self.dtype} = {self.describe()}>"

    def describe(self) -> str:
        box = self.box
        if isinstance(box, Contract):
            text = " * ".join(format_expression(r) for r in box.operands)
            if box.scale is not None:
                text += f" * {format_expression(box.scale)}"
            return text
        if isinstance(box, Map):
            return format_expression(box.expr)
        if isinstance(box, Reduce):
            return f"{box.op}[{' '.join(box.axes)}]({format_expression(box.operand)})"
        if isinstance(box, Softmax):
            return f"softmax[{box.axis}]({format_expression(box.operand)})"
        if isinstance(box, Scan):
            return f"{box.name}[{box.axis}]({format_expression(box.operand)})"
        return f"{box.box.name}({', '.join(format_expression(r) for r in box.args)})"


@dataclass(frozen=True)
class Diagram:
    """A checked kernel: its axes, arrays, scalars and statements (boxes), in order."""

    name: str
    axes: dict  # name -> Axis
    arrays: dict  # name -> Array
    scalars: dict  # name -> ScalarParameter
    params: tuple[str, ...]  # parameter names in signature order (arrays and scalars)
    outputs: tuple[str, ...]
    statements: tuple[Statement, ...]
    span: Span | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        n = len(self.statements)
        return f"<Diagram {self.signature()}, {n} statement{'s' if n != 1 else ''}>"

    def size(self, axis: str) -> algebra.Expr:
        return self.axes[axis].size

    def sizes(self, axes) -> algebra.Expr:
        return algebra.Mul(*(self.axes[a].size for a in axes))

    @property
    def flops(self) -> algebra.Expr:
        return algebra.Add(*(s.total_flops for s in self.statements))

    def producer(self, array: str) -> Statement | None:
        for statement in self.statements:
            if statement.target == array:
                return statement
        return None

    def consumers(self, array: str) -> list[Statement]:
        return [s for s in self.statements if array in s.inputs]

    def signature(self) -> str:
        """``attention(Q: bf16[b h q d], ...) -> O: bf16[b h q d]``"""
        params = []
        for name in self.params:
            if name in self.arrays:
                params.append(f"{name}: {self.arrays[name].dtype}[{' '.join(self.arrays[name].axes)}]")
            else:
                params.append(f"{name}: {self.scalars[name].dtype}")
        outputs = [f"{n}: {self.arrays[n].dtype}[{' '.join(self.arrays[n].axes)}]" for n in self.outputs]
        return f"{self.name}({', '.join(params)}) -> {', '.join(outputs)}"

    @property
    def input_arrays(self) -> list[Array]:
        return [self.arrays[p] for p in self.params if p in self.arrays]

    @property
    def views(self) -> list[Array]:
        """The window reads' views (:class:`Window`), which the binding gathers from their sources."""
        return [a for a in self.arrays.values() if a.window is not None]
