"""The reference evaluator: a diagram computed directly, in float64, with NumPy.

:func:`evaluate` runs the statements of an *unrelabelled* diagram one after another on whole
arrays, indexed by axis name: a contraction is one ``numpy.einsum`` (axis names become
letters; ``optimize=True``), an elementwise map broadcasts its operands over named axes, a
reduction is ``sum``/``max``/``min``/``mean`` over its axes, a softmax is the stable one
(subtract the maximum along the axis first), and an opaque box calls the implementation the
caller provides. Every value is float64 until the outputs, which are converted to their
declared dtypes (bf16 and fp8 through ml_dtypes, with NumPy's round-to-nearest-even; fp8
saturating, see :func:`convert`) and laid out in their declared axis order. :func:`reference` is the convenience form: it binds a
kernel's arguments (``binding.bind``) and evaluates it.

It is the oracle other backends are tested against, so it is deliberately naive: it knows
nothing of relabelling, levels, tiles or streaming, it does not round intermediates to their
storage dtypes (``@gmem`` intermediates declared f16 stay float64 here: compare a backend to
it with a tolerance fit for the declared dtypes), and it materialises every array in full.
Integer storage is the exception: an ``@gmem i32`` intermediate, and with ``keep_float64`` an
integer output, is rounded to the nearest integer (as every backend stores it), because that
rounding is the value, not an error a tolerance could cover (``N / 2`` of an odd N).
That last point makes it memory-hungry at real sizes, so it refuses (``NapkinCallError``)
before allocating when the estimate exceeds a limit (default 25% of physical memory; see
``binding.check_reference_memory``).

Elementwise functions, in float64, as the table of elementwise functions (``elementwise.py``)
defines them: ``exp log sqrt tanh abs neg``, ``rsqrt(x) = 1/sqrt(x)``,
``sigmoid(x) = 1/(1 + exp(-x))`` (computed without overflow), ``silu(x) = x sigmoid(x)``,
``relu(x) = max(x, 0)``, ``max/min(a, b)`` elementwise, ``+ - * / ^``, comparisons
(``>= > <= < == !=``, booleans) combined by ``and or not``, ``where(cond, a, b)``, axis indices
(``q`` in ``where(q >= x, S, -inf)``: 0 to size - 1 along the axis), and GELU in its exact
erf form, ``gelu(x) = x/2 (1 + erf(x / sqrt 2))`` (PyTorch's default, ``approximate="none"``;
not the tanh approximation). NaN and inf propagate as IEEE arithmetic says; NumPy's warnings
about them are silenced because producing them is not an error of the evaluator. One exception,
napkin's convention for masks: a softmax row whose every entry is -inf is 0, not NaN
(:func:`masked_softmax`); every backend does the same.

Opaque boxes: ``impls`` maps a box name to a Python callable, called once per statement,
vectorised over the woven axes. Each argument arrives as a read-only float64 array of shape
``(*woven, *box_axes)``: the statement's woven axes first, in the order of
``Statement.woven``, then the box's own axes for that input in the order of its ``box``
declaration. An input that is not woven over some woven axis is broadcast along it (a
stride-0 view, no copy), so every argument has every woven axis. The callable returns an
array of shape ``(*woven, *output_axes)``; its result is checked. Sizes of axes that only a
box's output carries are not passed in: bind them with ``sizes=`` and close over them.

>>> import numpy as np
>>> from napkin_dsl import load
>>> from napkin_dsl.reference import reference
>>> rows = load("kernel rows(X: f32[r c]) -> Y: f32[r c]:\\n    Y[r c] = softmax[c](X)\\n")["rows"]
>>> reference(rows, np.array([[0.0, 0.0], [0.0, np.log(3.0)]], np.float32))
array([[0.5 , 0.5 ],
       [0.25, 0.75]], dtype=float32)

An opaque box, woven over ``a``; ``y`` is carried by no input, so ``sizes=`` binds it:

>>> text = "box F(f32[x]) -> f32[y]\\nkernel k(X: f32[a x]) -> Y: f32[a y]:\\n    Y[a y] = F(X[a x])\\n"
>>> k = load(text)["k"]
>>> first_two = lambda X: X[..., :2]          # X arrives as (a, x): woven axes first
>>> reference(k, np.arange(6, dtype=np.float32).reshape(2, 3), sizes={"y": 2}, impls={"F": first_two})
array([[0., 1.],
       [3., 4.]], dtype=float32)

Forgetting the implementation names the box and how it would be called:

>>> reference(k, np.ones((2, 3), np.float32), sizes={"y": 2})
Traceback (most recent call last):
...
napkin_dsl.errors.NapkinCallError: <string>:3:5: error: box F has no implementation...
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from . import algebra, elementwise

from .binding import arguments, bind, check_reference_memory, diagram_of
from .boxes import reduction
from .dtypes import INTEGER_DTYPES
from .diagram import Apply, Const, Contract, Diagram, Index, Map, Opaque, Read, Reduce, ScalarParam, Scan, Softmax, Statement
from .errors import NapkinCallError
from .types import convert
from .windows import gather

__all__ = ["ELEMENTWISE", "evaluate", "reference"]


class ReferenceFailure(Exception):
    """A problem inside one statement; :func:`evaluate` re-raises it once, with the statement."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclass(frozen=True)
class NamedArray:
    """Values whose dimensions are the named axes, in order (no axes: a scalar)."""

    values: np.ndarray
    axes: tuple[str, ...]

    def aligned(self, axes: tuple[str, ...]) -> np.ndarray:
        """The values with dimensions in ``axes`` order; size 1 where this has no such axis."""
        order = [self.axes.index(a) for a in axes if a in self.axes]
        values = np.transpose(self.values, order) if self.axes else np.asarray(self.values)
        shape = iter(values.shape)
        return values.reshape([next(shape) if a in self.axes else 1 for a in axes])


# The notation's operators, comparisons, logic and where; the functions called by name are
# the table of elementwise functions (elementwise.FUNCTIONS), read through ELEMENTWISE.
_OPERATORS: dict[str, Callable] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "pow": np.power,
    "ge": np.greater_equal, "gt": np.greater, "le": np.less_equal, "lt": np.less, "eq": np.equal, "ne": np.not_equal,
    "and": np.logical_and, "or": np.logical_or, "not": np.logical_not, "where": np.where,
}


class _Definitions(Mapping):
    """``Apply.fn`` -> its float64 definition: the table's functions (read when asked, so an
    entry added at run time is here too), then the operators."""

    def __getitem__(self, fn: str) -> Callable:
        entry = elementwise.function(fn)
        return elementwise.float64(entry) if entry is not None else _OPERATORS[fn]

    def __iter__(self):
        return iter([*elementwise.FUNCTIONS, *(fn for fn in _OPERATORS if fn not in elementwise.FUNCTIONS)])

    def __len__(self) -> int:
        return len(list(iter(self)))


ELEMENTWISE: Mapping[str, Callable] = _Definitions()
"""The float64 definition of every elementwise function of the notation, by ``Apply.fn``."""

def logsumexp(values: np.ndarray, axis) -> np.ndarray:
    """log(sum(exp(values))) along ``axis``, the maximum subtracted first; -inf where every
    entry is -inf (a fully masked row: its softmax is 0 and sums nothing)."""
    peak = np.max(values, axis=axis, keepdims=True)
    shift = np.where(peak == -np.inf, 0.0, peak)
    total = np.sum(np.exp(values - shift), axis=axis, keepdims=True)
    return np.squeeze(np.log(total) + shift, axis=axis)


def reduce_along(op: str, values: np.ndarray, axis) -> np.ndarray:
    """``values`` reduced along ``axis`` as the table of reductions defines ``op``: folded by its
    elementwise function from its start (then divided by the count for a mean), or the
    log-sum-exp's stable form."""
    entry = reduction(op)
    if entry.combine is None:
        return logsumexp(values, axis)
    result = ELEMENTWISE[entry.combine].reduce(values, axis=axis, initial=entry.start)
    if entry.divides:
        result = result / math.prod(values.shape[a] for a in axis)
    return result


# The float range the checker allows a constant (check.number_in_range, check.power_in_range).
_FLOAT_RANGE = (1e-300, 1e300)


def masked_softmax(values: np.ndarray, along: int) -> np.ndarray:
    """The stable softmax along one dimension, with napkin's convention for masks: a row whose
    every entry is -inf (fully masked, as where(q >= x, S, -inf) makes a causal row of a
    decode window with no visible key) is all 0, not NaN, and so is whatever it weights."""
    peak = np.max(values, axis=along, keepdims=True)
    # Subtracting the maximum keeps exp from overflowing; it cancels in the ratio. A fully
    # masked row subtracts 0 instead of -inf, so its entries are exp(-inf) = 0.
    shifted = np.exp(values - np.where(peak == -np.inf, 0.0, peak))
    total = np.sum(shifted, axis=along, keepdims=True)
    return np.where(total == 0, 0.0, shifted / np.where(total == 0, 1.0, total))


def constant_value(value: algebra.Expr, sizes: dict, kernel: str = "the kernel") -> float:
    """A size expression (``d^-0.5``, ``i^-4294967296``) as a float, at ``sizes`` (axis name -> int).

    Exact arithmetic, but a power is checked before it is computed: ``8^-4294967296`` exactly
    is a number of four billion digits, which never ends. A
    value outside the range the checker allows a literal constant (1e-300 to 1e300, or 0), a
    division by zero or a non-real value raises :class:`ReferenceFailure`, as the checker refuses such
    constants when they are written with numbers.
    """
    if value in (algebra.oo, -algebra.oo):  # -inf in where(q >= x, S, -inf): a masked entry
        return float(value)
    from .check import power_in_range

    shown = str(value).replace("**", "^")  # in the notation's spelling

    def at():
        bound = sorted(s.name for s in value.free_symbols if s.name in sizes)
        return f" at {', '.join(f'{n}={sizes[n]}' for n in bound)}" if bound else ""

    def evaluate(expr):
        total = algebra.ZERO
        for monomial, coefficient in expr.terms.items():
            term = algebra.number(coefficient)
            for atom, exponent in monomial:
                base = evaluate_atom(atom)
                if not power_in_range(base, exponent):
                    raise ReferenceFailure(f"the size expression {shown} is out of floating-point range{at()}: {base}^{exponent}",
                                   "napkin computes in floating point: keep constants between 1e-300 and 1e300")
                term = term * base**exponent
            total = total + term
        return total

    def evaluate_atom(atom):
        if atom.is_Symbol:
            if atom.name not in sizes:
                raise ReferenceFailure(f"the size expression {shown} uses {atom.name}, which is not an axis of {kernel}")
            return algebra.Integer(int(sizes[atom.name]))
        if isinstance(atom, algebra.Root):
            return algebra.Integer(atom.base)
        if isinstance(atom, algebra.Group):
            return evaluate(atom.base)
        return type(atom).of(*(evaluate(a) for a in atom.args))

    try:
        number = evaluate(value)
    except ZeroDivisionError:
        raise ReferenceFailure(f"the size expression {shown} is undefined{at()} (division by zero)",
                       "check the divisor and the exponent's sign") from None
    except ValueError:
        raise ReferenceFailure(f"the size expression {shown} is not a real number{at()}",
                       "a negative number has no real fractional power") from None
    try:
        result = float(number)
    except OverflowError:
        result = math.inf
    if result != 0 and not _FLOAT_RANGE[0] <= abs(result) <= _FLOAT_RANGE[1]:
        raise ReferenceFailure(f"the size expression {shown} is out of floating-point range{at()} ({result:g})",
                       "napkin computes in floating point: keep constants between 1e-300 and 1e300")
    return result


class Evaluator:
    """The state of one evaluation: sizes, scalars, implementations and the arrays so far."""

    def __init__(self, diagram: Diagram, sizes: dict, scalars: dict, impls: dict):
        self.diagram = diagram
        self.sizes = sizes
        self.scalars = scalars
        self.impls = impls
        self.arrays: dict[str, np.ndarray] = {}  # float64, in each array's own axis order
        self.letters = dict(zip(diagram.axes, string.ascii_letters, strict=False))

    def shape(self, axes) -> tuple[int, ...]:
        return tuple(self.sizes[a] for a in axes)

    # -- elementwise expressions
    def constant(self, value: algebra.Expr) -> float:
        return constant_value(value, self.sizes, self.diagram.name)

    def expression(self, expr) -> NamedArray:
        if isinstance(expr, Read):
            return NamedArray(self.arrays[expr.array], expr.axes)
        if isinstance(expr, Const):
            return NamedArray(np.float64(self.constant(expr.value)), ())
        if isinstance(expr, ScalarParam):
            return NamedArray(np.float64(float(self.scalars[expr.name])), ())
        if isinstance(expr, Index):
            return NamedArray(np.arange(self.sizes[expr.axis], dtype=np.float64), (expr.axis,))
        if isinstance(expr, Apply):
            function = ELEMENTWISE.get(expr.fn)
            if function is None:
                raise ReferenceFailure(f"the reference has no definition of the elementwise function {expr.fn!r}")
            args = [self.expression(a) for a in expr.args]
            axes = tuple(dict.fromkeys(a for arg in args for a in arg.axes))
            return NamedArray(function(*(arg.aligned(axes) for arg in args)), axes)
        raise AssertionError(f"napkin bug: unknown expression {expr!r}")

    # -- boxes
    def statement(self, statement: Statement) -> np.ndarray:
        """The statement's result, float64, with dimensions in ``statement.axes`` order."""
        box = statement.box
        if isinstance(box, Opaque):
            return self.opaque(statement, box)
        with np.errstate(all="ignore"):
            if isinstance(box, Contract):
                return self.contract(statement, box)
            if isinstance(box, Map):
                values = self.expression(box.expr).aligned(statement.axes)
                return np.broadcast_to(values, self.shape(statement.axes))
            if isinstance(box, Reduce):
                operand = self.expression(box.operand)
                along = tuple(operand.axes.index(a) for a in box.axes)
                kept = tuple(a for a in operand.axes if a not in box.axes)
                return NamedArray(reduce_along(box.op, operand.values, along), kept).aligned(statement.axes)
            if isinstance(box, Softmax):
                values = np.broadcast_to(self.expression(box.operand).aligned(statement.axes), self.shape(statement.axes))
                along = statement.axes.index(box.axis)
                return masked_softmax(values, along)
            if isinstance(box, Scan):
                values = np.broadcast_to(self.expression(box.operand).aligned(statement.axes), self.shape(statement.axes))
                along = statement.axes.index(box.axis)
                return np.cumsum(values, axis=along) if box.op == "sum" else np.cumprod(values, axis=along)
        raise AssertionError(f"napkin bug: unknown box {box!r}")

    def contract(self, statement: Statement, box: Contract) -> np.ndarray:
        if len(self.letters) < len(self.diagram.axes):
            raise ReferenceFailure(f"einsum has {len(string.ascii_letters)} axis letters; {self.diagram.name} has {len(self.diagram.axes)} axes")
        spec = ",".join("".join(self.letters[a] for a in r.axes) for r in box.operands)
        spec += "->" + "".join(self.letters[a] for a in statement.axes)
        result = np.einsum(spec, *(self.arrays[r.array] for r in box.operands), optimize=True)
        if box.scale is not None:
            result = result * self.expression(box.scale).aligned(statement.axes)
        return result

    def opaque(self, statement: Statement, box: Opaque) -> np.ndarray:
        signature = box.box
        woven = statement.woven
        produced = tuple(a for a in signature.outputs[0][1] if a not in woven)
        expected = self.shape(woven) + self.shape(produced)

        def described(axes):
            return f"({', '.join(f'{a}={self.sizes[a]}' for a in axes)})"

        call = ", ".join(f"{r.array}{described(woven + own)}" for r, (_, own) in zip(box.args, signature.inputs, strict=False))
        implementation = self.impls.get(signature.name)
        if implementation is None:
            raise ReferenceFailure(
                f"box {signature.name} has no implementation; the reference would call {signature.name}({call}) "
                f"and expect shape {described(woven + produced)}",
                f"pass impls={{{signature.name!r}: function}}; the function receives NumPy arrays with the woven axes "
                f"first and the box's own axes last, and returns one array",
            )
        views = []
        for read, (_, own) in zip(box.args, signature.inputs, strict=False):
            axes = woven + tuple(own)
            # broadcast_to returns a read-only view: an implementation cannot write into our arrays.
            views.append(np.broadcast_to(NamedArray(self.arrays[read.array], read.axes).aligned(axes), self.shape(axes)))
        try:
            result = implementation(*views)
        except Exception as exc:
            exc.add_note(f"in the implementation of box {signature.name}, called as {signature.name}({call}) "
                         f"for {statement.target} (line {statement.span.line if statement.span else '?'})")
            raise
        try:
            result = np.asarray(result, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ReferenceFailure(f"the implementation of box {signature.name} returned {type(result).__name__}, "
                           f"which is not an array of numbers: {exc}") from None
        if result.shape != expected:
            raise ReferenceFailure(
                f"the implementation of box {signature.name} returned shape {result.shape}; "
                f"expected {described(woven + produced)} = {expected}",
                "woven axes come first, then the box's output axes",
            )
        return NamedArray(result, woven + produced).aligned(statement.axes)


def _check_call(diagram: Diagram, inputs: dict, scalars: dict, sizes: dict):
    """Arguments that did not come through bind() get the checks evaluate relies on."""
    missing_sizes = [a for a in diagram.axes if a not in sizes]
    if missing_sizes:
        raise NapkinCallError(f"evaluate({diagram.name}) needs a size for every axis; missing {', '.join(missing_sizes)}",
                              hint="bind the arguments with napkin_dsl.binding.bind, which reads sizes off the arrays")
    for array in diagram.input_arrays:
        if array.name not in inputs:
            raise NapkinCallError(f"evaluate({diagram.name}) is missing input {array.name}")
        expected = tuple(int(sizes[a]) for a in array.axes)
        shape = tuple(np.shape(inputs[array.name]))
        if shape != expected:
            raise NapkinCallError(f"input {array.name}[{' '.join(array.axes)}] has shape {shape}, but the sizes give {expected}")
    for name in diagram.scalars:
        if name not in scalars:
            raise NapkinCallError(f"evaluate({diagram.name}) is missing scalar {name}")


def _to_declared(values: np.ndarray, dtype: str) -> np.ndarray:
    return convert(values, dtype, order="C")


def evaluate(
    diagram,
    inputs: dict,
    scalars: dict,
    sizes: dict,
    impls: dict | None = None,
    *,
    memory_limit: float | None = None,
    keep_float64: bool = False,
) -> dict[str, np.ndarray]:
    """Evaluate an unrelabelled diagram in float64; return its outputs by name.

    ``diagram`` is a Diagram or a kernel; ``inputs``, ``scalars`` and ``sizes`` are normally
    a :class:`~napkin_dsl.binding.Binding`'s. ``impls`` maps opaque box names to callables
    (calling convention in the module docstring). The inputs are read, never modified.

    Outputs come back in their declared dtypes and axis order, C-contiguous; with
    ``keep_float64=True`` they stay float64 (for comparisons at tight tolerance). Before
    allocating, :func:`~napkin_dsl.binding.check_reference_memory` refuses sizes that would
    need more than ``memory_limit`` bytes (default 25% of physical memory).
    """
    diagram = diagram_of(diagram)
    _check_call(diagram, inputs, scalars, sizes)
    sizes = {axis: int(sizes[axis]) for axis in diagram.axes}
    check_reference_memory(diagram, sizes, memory_limit)
    evaluator = Evaluator(diagram, sizes, scalars, dict(impls or {}))
    for array in diagram.input_arrays:
        # astype copies: the caller's arrays are never written, nor kept.
        evaluator.arrays[array.name] = np.asarray(inputs[array.name]).astype(np.float64)
    def gather_views():  # a window read's values, gathered from its source once the source has them
        for view in diagram.views:
            if view.name not in evaluator.arrays and view.window.source in evaluator.arrays:
                evaluator.arrays[view.name] = gather(view, evaluator.arrays[view.window.source], sizes)

    gather_views()
    for statement in diagram.statements:
        try:
            values = evaluator.statement(statement)
        except ReferenceFailure as failure:
            hint = failure.hint or f"while evaluating {statement.target} = {statement.describe()}"
            raise NapkinCallError(failure.message, statement.span, hint) from None
        array = diagram.arrays[statement.target]
        if array.role == "intermediate" and array.level is not None and array.dtype in INTEGER_DTYPES:
            with np.errstate(invalid="ignore"):
                values = np.rint(values)  # stored as an integer: every reader sees it rounded
        evaluator.arrays[statement.target] = values
        gather_views()
    outputs = {}
    for name in diagram.outputs:
        values, dtype = evaluator.arrays[name], diagram.arrays[name].dtype
        if keep_float64:
            # float64, but an integer output rounded as it is stored: a rounded value is not an error
            outputs[name] = np.array(np.rint(values) if dtype in INTEGER_DTYPES else values, dtype=np.float64, order="C")
        else:
            outputs[name] = _to_declared(values, dtype)
    return outputs


def reference(kernel, *arrays, sizes: dict | None = None, impls: dict | None = None, cast: bool = False,
              memory_limit: float | None = None, **named):
    """Call a kernel through the reference evaluator: bind the arguments, evaluate, return the outputs.

    Positional arguments follow the kernel's parameters in signature order (arrays and
    scalars alike); keyword arguments name them. ``sizes``, ``impls``, ``cast`` and
    ``memory_limit`` are this function's own (a kernel parameter with one of those names
    can only be passed positionally). Returns the output array for a kernel with one output,
    a dict of them by name for several.
    """
    diagram = diagram_of(kernel)
    array_args, scalar_args = arguments(diagram, arrays, named)
    binding = bind(diagram, array_args, scalar_args, cast, sizes=sizes)
    outputs = evaluate(diagram, binding.inputs, binding.scalars, binding.sizes, impls, memory_limit=memory_limit)
    return outputs[diagram.outputs[0]] if len(diagram.outputs) == 1 else outputs
