"""Reverse mode on diagrams: a checked kernel -> its backward kernel, as napkin text.

:func:`backward_text` derives, from a forward :class:`~napkin_dsl.diagram.Diagram`, the text of
a napkin kernel ``NAME_grad`` that computes a cotangent for every float array input of the
forward. Its parameters are the forward's inputs (those the backward reads), the forward
outputs it reads (**saved**: the forward computed and stored them anyway), and one cotangent
per output (``dO`` for an output ``O``; ``dL`` for an ``lse`` output ``L``). Its outputs are
``dX`` for each float input ``X``, in ``X``'s dtype (computed in f32 on chip, as every napkin
intermediate, and rounded where it is saved). The text then goes through the normal front end
(``napkin.load``), so the backward checks, prices, draws, tunes and runs like any kernel.

The rules, one per kind of box (the box table's kinds, ``diagram.py``):

* a **contraction** gives contractions: the cotangent of each operand is the product of the
  output cotangent with the other operands (and the scalar factor), contracted over the axes
  the operand lacks;
* a **map** gives a map: reverse mode through the expression tree, each elementwise function's
  partials read from the table of elementwise functions (``elementwise.Elementwise.grad``,
  notation templates), the operators' and ``where``'s written here (``where`` masks its
  cotangent; a condition has none);
* **sum** broadcasts its cotangent, **mean** divides it by the reduced size, **max** and
  **min** route it through the arg-max (``where(E == M, dM, 0)``: ties all receive it; M is
  the backward's own max of E where the forward's M is saved, since the two kernels may round E
  differently),
  **lse** gives its softmax (``dE = dL * exp(E - L)``);
* **softmax** gives ``dS = P * (dP - sum[x](dP * P))``;
* an operand missing an axis of its statement (broadcast) gets the cotangent summed along it;
* an **opaque box** has no backward: a :class:`~napkin_dsl.errors.NapkinError` names it.

Saving and recomputation are a fixed rule here: forward outputs the backward reads are saved
(parameters of the backward), every intermediate it reads is recomputed by re-emitting its
forward statement; and a softmax ``P = softmax[x](E)`` beside an output ``L = lse[x](E)`` of
the same operand is recomputed as ``P = exp(E - L)``, from the saved L (FlashAttention's
recomputation), with no max or sum over x (``where(L > -inf, ..., 0)`` around it where E is
masked: a row masked out entirely has ``L = -inf``, and its P is 0, as the forward's). With
``rewrite_d=True`` a softmax that is no output, whose only consumer is a contraction
``O = P * V`` into a forward output keeping every other axis of P's, uses FA2's identity
``sum[x](dP * P) = sum[d](dO * O)`` (the saved O, and O's whole cotangent) instead of
contracting over x.

Deliberately not here: gradients of scalar parameters (a :class:`NotImplementedError` names
them when asked), the choice between saving and recomputing as a priced tuner decision (issue
24 item 2; the rule above is fixed), and the backward's schedule beyond the forward's groups:
the emitted relabel block keeps the forward's group partitions on axes every backward
statement is woven over (batch and heads for attention) and leaves keys, queries and the dQ
split over keys to ``napkin tune`` (a comment in the text says so). Integer inputs get no
cotangent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from fractions import Fraction

from . import algebra, elementwise
from . import syntax as syn
from .check import check_module
from .dtypes import INTEGER_DTYPES
from .diagram import (
    Apply, Const, Contract, Diagram, Expression, Index, Map, Opaque, Read, Reduce, ScalarParam, Scan, Softmax, Statement,
    expression_axes, reads,
)
from .errors import NapkinError
from .pseudocode import kept_fraction
from .relabel import SUMMED_DTYPE, make_schedule

# ---- notation text of expressions -----------------------------------------------------------

_OPERATOR_TEXT = {"add": "+", "sub": "-", "mul": "*", "div": "/", "ge": ">=", "gt": ">", "le": "<=", "lt": "<",
                  "eq": "==", "ne": "!=", "and": "and", "or": "or"}


def _number_text(value) -> str:
    if isinstance(value, Fraction):
        return f"({value.numerator}/{value.denominator})" if value.denominator != 1 else str(value.numerator)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def size_notation(value: algebra.Expr) -> str:
    """A size expression in the notation, every size spelled ``len(x)`` (valid in any statement,
    whether or not it iterates over x) and powers with ``^``; a sum or a product parenthesised,
    so that it stays one operand where it is written (a mean's cotangent over two axes divides
    by their product)."""
    if value in (algebra.oo, -algebra.oo):
        return "inf" if value > 0 else "-inf"
    terms = []
    for monomial, coefficient in value.terms.items():
        factors = [] if coefficient == 1 and monomial else [_number_text(coefficient)]
        for atom, exponent in monomial:
            factors.append(_atom_text(atom) + ("" if exponent == 1 else f"^{_number_text(Fraction(exponent))}"))
        terms.append(" * ".join(factors) if factors else "1")
    if len(terms) == 1 and " * " in terms[0]:
        # a product is one operand wherever it is written: after a division, dR / (len(i) * len(j))
        return f"({terms[0]})"
    return "(" + " + ".join(terms) + ")" if len(terms) > 1 else (terms[0] if terms else "0")


def _atom_text(atom) -> str:
    if isinstance(atom, algebra.Symbol):
        return f"len({atom.name})"
    if isinstance(atom, algebra.Root):
        return str(atom.base)
    if isinstance(atom, algebra.Group):
        return f"({size_notation(atom.base)})"
    raise NotImplementedError(f"the backward cannot spell the size expression {atom} in the notation")


def notation(expr: Expression) -> str:
    """An elementwise expression as notation text, fully parenthesised."""
    if isinstance(expr, Read):
        return f"{expr.array}[{' '.join(expr.axes)}]"
    if isinstance(expr, Const):
        return size_notation(expr.value)
    if isinstance(expr, ScalarParam):
        return expr.name
    if isinstance(expr, Index):
        return expr.axis
    args = [notation(a) for a in expr.args]
    if expr.fn in _OPERATOR_TEXT and len(args) == 2:
        return f"({args[0]} {_OPERATOR_TEXT[expr.fn]} {args[1]})"
    if expr.fn == "pow":
        return f"({args[0]} ^ {args[1]})"
    if expr.fn == "not":
        return f"(not {args[0]})"
    return f"{expr.fn}({', '.join(args)})"


def statement_text(s: Statement, dtype: str | None = None, body: str | None = None) -> str:
    """A forward statement as notation (``body`` replaces its right-hand side)."""
    box = s.box
    if body is None:
        if isinstance(box, Contract):
            body = " * ".join(notation(r) for r in box.operands)
            if box.scale is not None:
                body += f" * {notation(box.scale)}"
        elif isinstance(box, Map):
            body = notation(box.expr)
        elif isinstance(box, Reduce):
            body = f"{box.op}[{' '.join(box.axes)}]({notation(box.operand)})"
        elif isinstance(box, Softmax):
            body = f"softmax[{box.axis}]({notation(box.operand)})"
        else:
            raise NapkinError(f"opaque box {box.box.name} has no declared backward", s.span,
                              "napkin derives backward kernels of contractions, maps, reductions and softmax only")
    level = f" @{s.level} {dtype}" if s.level and dtype else (f" @{s.level}" if s.level else "")
    return f"{s.target}[{' '.join(s.axes)}]{level} = {body}"


# ---- reverse mode through an expression tree -----------------------------------------------------


def _expression_partials(expr: Expression, g: str, g_axes: tuple[str, ...]) -> list[tuple[Read, str, tuple[str, ...]]]:
    """(leaf read, its cotangent as text, the axes that text varies along) for every array read
    of ``expr``, given the cotangent ``g`` of the whole expression, a text varying along
    ``g_axes``. The axes say where a leaf's cotangent must be summed (an axis it varies along
    that the read lacks) and where it is constant along an axis the read lacks (it is then
    scaled by that axis's size: summing an expression along an axis it lacks is no statement
    the checker accepts)."""
    if isinstance(expr, Read):
        return [(expr, g, g_axes)]
    if not isinstance(expr, Apply) or not reads(expr):
        return []  # constants, scalars, indices: no array below

    def times(*factors: Expression) -> tuple[str, ...]:  # the axes of g times these factors
        return _union(g_axes, *(expression_axes(f) for f in factors))

    fn, args = expr.fn, expr.args
    a = args[0]
    if fn == "add":
        return _expression_partials(a, g, g_axes) + _expression_partials(args[1], g, g_axes)
    if fn == "sub":
        return _expression_partials(a, g, g_axes) + _expression_partials(args[1], f"(-{g})", g_axes)
    if fn == "mul":
        b = args[1]
        return (_expression_partials(a, f"({g} * {notation(b)})", times(b))
                + _expression_partials(b, f"({g} * {notation(a)})", times(a)))
    if fn == "div":
        b = args[1]
        return (_expression_partials(a, f"({g} / {notation(b)})", times(b))
                + _expression_partials(b, f"((-{g}) * {notation(a)} / ({notation(b)} * {notation(b)}))", times(a, b)))
    if fn == "pow":
        b = args[1]
        found = _expression_partials(a, f"({g} * {notation(b)} * ({notation(a)} ^ ({notation(b)} - 1)))", times(a, b))
        return found + _expression_partials(b, f"({g} * log({notation(a)}) * {notation(expr)})", times(a, b))
    if fn == "where":
        condition = notation(a)
        return (_expression_partials(args[1], f"where({condition}, {g}, 0)", times(a))
                + _expression_partials(args[2], f"where({condition}, 0, {g})", times(a)))
    if fn in ("eq", "ne", "ge", "gt", "le", "lt", "and", "or", "not"):
        return []  # a condition has no cotangent
    entry = elementwise.function(fn)
    if entry is None:
        raise NotImplementedError(f"the backward has no rule for the elementwise operation {fn!r}")
    if len(entry.grad) != len(args):
        raise NotImplementedError(f"the elementwise function {fn} has no derivative in the notation "
                                  f"(elementwise.Elementwise.grad) for the backward to use")
    texts = {"x": notation(args[0]), "y": notation(args[-1]), "r": notation(expr)}
    found = []
    operands = {"x": args[0], "y": args[-1], "r": expr}
    for arg, template in zip(args, entry.grad, strict=True):
        used = [operands[key] for key in operands if "{" + key + "}" in template]
        found += _expression_partials(arg, f"({g} * ({template.format(**texts)}))", times(*used))
    return found


def _union(*axes_lists) -> tuple[str, ...]:
    """The axes of several factors, in order of first appearance."""
    seen: list[str] = []
    for axes in axes_lists:
        seen += [a for a in axes if a not in seen]
    return tuple(seen)


# ---- the backward kernel ----------------------------------------------------------------------


@dataclass
class _Contribution:
    """One term of an array's cotangent: a map expression over the array's own axes
    (``kind == "map"``) or a whole right-hand side (a reduction or contraction)."""

    kind: str
    text: str


@dataclass
class Backward:
    """A derived backward kernel: its text, and what it saves, recomputes and returns."""

    text: str
    name: str
    saved: tuple[str, ...]  # forward outputs read by the backward (its parameters)
    recomputed: tuple[str, ...]  # forward intermediates the backward recomputes
    cotangents: dict = field(default_factory=dict)  # forward output -> its cotangent's parameter name
    gradients: dict = field(default_factory=dict)  # forward input -> the backward output holding its cotangent
    schedule: "KeySchedule | None" = None  # FA2's launches, when derived (_keys_schedule)
    auxiliary: tuple[str, ...] = ()  # outputs of lse_forward's forward that it reads (saved L), no cotangent


def _names(diagram: Diagram):
    taken = set(diagram.arrays) | set(diagram.scalars) | set(diagram.axes)

    def fresh(base: str) -> str:
        name, n = base, 1
        while name in taken:
            name, n = f"{base}_{n}", n + 1
        taken.add(name)
        return name

    return fresh


def _lse_of(diagram: Diagram, softmax: Statement) -> Statement | None:
    """An lse output over the same axis and operand as this softmax, whose value recomputes it."""
    for s in diagram.statements:
        if (isinstance(s.box, Reduce) and s.box.op == "lse" and s.box.axes == (softmax.box.axis,)
                and s.box.operand == softmax.box.operand and s.target in diagram.outputs):
            return s
    return None


def backward(diagram: Diagram, rewrite_d: bool = False, save: tuple[str, ...] = (),
             auxiliary: tuple[str, ...] = ()) -> Backward:
    """The backward kernel of ``diagram`` (see the module docstring). ``save``: forward
    intermediates the forward is taken to have saved at the top level (in their dtypes): the
    backward reads them as parameters instead of recomputing them (``P``: save the
    probabilities rather than recompute them from L). ``auxiliary``: outputs the forward returns
    only for its backward (the lse of :func:`lse_forward`): they carry no cotangent.

    The steps: refuse what has no backward; sweep the statements in reverse, each box's rule
    adding terms to its operands' cotangents (:class:`_ReverseSweep`); finish the inputs'
    gradients; find what the backward reads of the forward (:func:`_recomputation`); write the
    kernel's text (:func:`_backward_text`)."""
    _check_differentiable(diagram, save)
    sweep = _ReverseSweep(diagram, save, auxiliary, rewrite_d)
    for s in reversed(diagram.statements):
        sweep.differentiate(s)
    gradients = sweep.gradients()
    recompute, recompute_lines, saved = _recomputation(diagram, sweep, save)
    return _backward_text(diagram, sweep, gradients, recompute, recompute_lines, saved, auxiliary)


def _check_differentiable(diagram: Diagram, save: tuple[str, ...]) -> None:
    """Refuse a ``save`` naming no intermediate, and an opaque box (it declares no backward)."""
    for name in save:
        if name not in diagram.arrays or diagram.arrays[name].role != "intermediate":
            raise NapkinError(f"save={name!r}: {diagram.name} has no intermediate {name!r} to save "
                              f"(intermediates: {', '.join(a for a, v in diagram.arrays.items() if v.role == 'intermediate')})")
    for s in diagram.statements:
        if isinstance(s.box, Scan):
            raise NotImplementedError(
                f"the backward of {s.box.name}[{s.box.axis}] ({s.target}, line {s.span.line if s.span else s.index + 1}) is not "
                f"derived yet: its gradient is a scan in the reverse order along {s.box.axis}, which the notation has no box for")
    for view in diagram.views:
        source = diagram.arrays[view.window.source]
        raise NotImplementedError(
            f"the backward of a window read ({view.window.text(source.axes)}) is not derived yet: {source.name}'s "
            f"gradient scatters the view's back through the window (a transposed convolution), which napkin does "
            f"not build; differentiate {diagram.name} with torch, or write it without the window read")
    for s in diagram.statements:
        if isinstance(s.box, Opaque):
            raise NapkinError(f"opaque box {s.box.box.name} has no declared backward, so {diagram.name} has no derived "
                              f"backward", s.span, "napkin derives the backward of contractions, maps, reductions and "
                              "softmax; write the kernel without the opaque box to differentiate it")


class _ReverseSweep:
    """Reverse mode over a diagram's statements, last first: each array's cotangent is the sum of
    the terms its readers' rules contribute, written as backward statements (``lines``) once
    every reader has contributed (:meth:`finish`, when the sweep reaches the array's producer)."""

    def __init__(self, diagram: Diagram, save: tuple[str, ...], auxiliary: tuple[str, ...], rewrite_d: bool):
        self.diagram, self.save, self.rewrite_d = diagram, save, rewrite_d
        self.fresh = _names(diagram)
        self.cotangent: dict[str, str] = {}  # forward array -> the backward array holding its cotangent
        self.contributions: dict[str, list[_Contribution]] = {}
        self.lines: list[str] = []  # backward statements, in order
        self.cotangent_params: dict[str, str] = {}  # forward output -> its cotangent's parameter
        self.uses_saved_o: set[str] = set()  # outputs FA2's D reads (saved O)
        for output in diagram.outputs:
            if output in auxiliary:
                continue
            name = self.fresh(f"d{output}")
            self.cotangent_params[output] = name
            if diagram.arrays[output].dtype not in INTEGER_DTYPES:
                array = diagram.arrays[output]
                self.contributions.setdefault(output, []).append(_Contribution("map", f"{name}[{' '.join(array.axes)}]"))

    def add(self, array: str, kind: str, text: str) -> None:
        """One more term of ``array``'s cotangent (an integer array has none)."""
        if self.diagram.arrays[array].dtype in INTEGER_DTYPES:
            return
        self.contributions.setdefault(array, []).append(_Contribution(kind, text))

    def finish(self, array: str, name: str | None = None) -> str | None:
        """Emit the statements of ``array``'s cotangent; its name, or None when it has none."""
        terms = self.contributions.get(array, [])
        if not terms:
            return None
        if name is None and array in self.cotangent_params and len(terms) == 1:
            self.cotangent[array] = self.cotangent_params[array]  # an output read by nothing: its cotangent as given
            return self.cotangent[array]
        name = name or self.fresh(f"d{array}")
        axes = " ".join(self.diagram.arrays[array].axes)
        if all(t.kind == "map" for t in terms):
            self.lines.append(f"{name}[{axes}] = " + " + ".join(t.text for t in terms))
        elif len(terms) == 1:
            self.lines.append(f"{name}[{axes}] = {terms[0].text}")
        else:
            parts = []
            for term in terms:
                if term.kind == "map":
                    parts.append(term.text)
                else:
                    part = self.fresh(f"{name}_part")
                    self.lines.append(f"{part}[{axes}] = {term.text}")
                    parts.append(f"{part}[{axes}]")
            self.lines.append(f"{name}[{axes}] = " + " + ".join(parts))
        self.cotangent[array] = name
        return name

    def add_leaves(self, partials: list[tuple[Read, str, tuple[str, ...]]], iteration: tuple[str, ...]) -> None:
        """Each read's partial, summed along the iteration axes the read lacks."""
        for read, text, axes in partials:
            missing = [a for a in iteration if a not in read.axes]
            # Along an axis the read lacks, its cotangent sums; where the cotangent does not
            # vary along that axis (abs(c) + X[s] summed over s, for a scalar c), the sum is
            # the cotangent times the axis's size.
            constant = [a for a in missing if a not in axes]
            if constant:
                text = f"({text} * {size_notation(algebra.Mul(*(self.diagram.size(a) for a in constant)))})"
            summed = [a for a in missing if a in axes]
            if not summed:
                self.add(read.array, "map", text)  # a map broadcasts it along any axis of the read it lacks
                continue
            kept = [a for a in read.axes if a in axes]
            if len(kept) == len(read.axes):
                self.add(read.array, "sum", f"sum[{' '.join(summed)}]({text})")
            else:  # constant along an axis of the read too: sum first, then broadcast (a sum cannot)
                reduced = self.fresh("t")
                self.lines.append(f"{reduced}[{' '.join(kept)}] = sum[{' '.join(summed)}]({text})")
                self.add(read.array, "map", f"{reduced}[{' '.join(kept)}]")

    def differentiate(self, s: Statement) -> None:
        """Finish ``s``'s target's cotangent, then apply its box's rule to its operands."""
        if self.finish(s.target) is None:
            return  # nothing downstream depends on this value
        g = f"{self.cotangent[s.target]}[{' '.join(s.axes)}]"
        if isinstance(s.box, Map):
            self.add_leaves(_expression_partials(s.box.expr, g, s.axes), s.axes)
        elif isinstance(s.box, Reduce):
            self.reduce(s, g)
        elif isinstance(s.box, Softmax):
            self.softmax(s, g)
        elif isinstance(s.box, Contract):
            self.contract(s, g)
        else:  # pragma: no cover - refused by _check_differentiable
            raise AssertionError(s.box)

    def reduce(self, s: Statement, g: str) -> None:
        """sum and mean spread g; max and min route it to the arg-max; lse weighs it by exp."""
        box, diagram = s.box, self.diagram
        operand = notation(box.operand)
        value = f"{s.target}[{' '.join(s.axes)}]"
        if box.op == "sum":
            g_operand = g
        elif box.op == "mean":
            g_operand = f"({g} / {size_notation(algebra.Mul(*(diagram.size(a) for a in box.axes)))})"
        elif box.op in ("max", "min"):
            if s.target in diagram.outputs or s.target in self.save:
                # The arg-max test compares the operand as this kernel computes it with a
                # max it computes too: the saved M came from the forward's own rounding
                # (another order, another fusion), and E == M could then hold nowhere.
                value = f"{self.fresh(f'{s.target}_b')}[{' '.join(s.axes)}]"
                self.lines.append(f"{value} = {box.op}[{' '.join(box.axes)}]({operand})")
            g_operand = f"where({operand} == {value}, {g}, 0)"
        elif box.op == "lse":
            g_operand = f"({g} * exp({operand} - {value}))"
        else:
            raise NotImplementedError(f"the backward has no rule for the reduction {box.op}[...]")
        # where(operand == value, g, 0) and exp(operand - value) vary along the operand's axes too
        g_axes = s.axes if box.op in ("sum", "mean") else _union(s.axes, expression_axes(box.operand))
        self.add_leaves(_expression_partials(box.operand, g_operand, g_axes), s.iteration_axes)

    def softmax(self, s: Statement, g: str) -> None:
        """P (g - D) with D = rowsum(g P), or FA2's D = rowsum(dO O) where the rewrite applies."""
        box, diagram = s.box, self.diagram
        kept = [a for a in s.axes if a != box.axis]
        value = f"{s.target}[{' '.join(s.axes)}]"
        d_name = self.fresh("D" if s.target == "P" else f"D{s.target}")
        fa2 = _fa2_rewrite(diagram, s) if self.rewrite_d else None
        if fa2 is not None:
            out = diagram.arrays[fa2]
            contracted = [a for a in out.axes if a not in kept]
            # O's whole cotangent (the given dO plus any reader of O's), finished before P's
            product = f"{self.cotangent[fa2]}[{' '.join(out.axes)}] * {fa2}[{' '.join(out.axes)}]"
            # an output with no axis beyond the softmax's kept ones: D is the product itself
            self.lines.append(f"{d_name}[{' '.join(kept)}] = " + (f"sum[{' '.join(contracted)}]({product})" if contracted else product))
            self.uses_saved_o.add(fa2)
        else:
            self.lines.append(f"{d_name}[{' '.join(kept)}] = sum[{box.axis}]({g} * {value})")
        g_operand = f"({value} * ({g} - {d_name}[{' '.join(kept)}]))"
        self.add_leaves(_expression_partials(box.operand, g_operand, s.axes), s.axes)

    def contract(self, s: Statement, g: str) -> None:
        """The product's operands, then its factor's arrays (a scale over the output's axes,
        sV[b h] in O = P * V * sV): each one's cotangent is the product of all the others."""
        box, diagram = s.box, self.diagram
        scale = _product_terms(box.scale) if box.scale is not None else []
        scale_reads = [f for f in scale if isinstance(f, Read)]
        numbers = [notation(f) for f in scale if not isinstance(f, Read)]
        members = list(box.operands) + scale_reads
        for i, operand in enumerate(members):
            if diagram.arrays[operand.array].dtype in INTEGER_DTYPES:
                continue
            factors = [(g, s.axes)] + [(notation(o), o.axes) for j, o in enumerate(members) if j != i]
            # An axis summed away that only one factor carries is summed on that factor first
            # (a contraction joins two wires: it cannot cap a wire that only one array has).
            for k, (text, axes) in enumerate(factors):
                lonely = [a for a in axes if a not in operand.axes
                          and sum(a in other for _, other in factors) == 1]
                if lonely:
                    kept_axes = [a for a in axes if a not in lonely]
                    reduced = self.fresh("t")
                    self.lines.append(f"{reduced}[{' '.join(kept_axes)}] = sum[{' '.join(lonely)}]({text})")
                    factors[k] = (f"{reduced}[{' '.join(kept_axes)}]", tuple(kept_axes))
            others = [text for text, _ in factors] + numbers
            self.add(operand.array, "contract", " * ".join(others))

    def gradients(self) -> dict[str, str]:
        """Forward input -> the backward output holding its gradient (0 where nothing reads it)."""
        gradients = {}
        for name in self.diagram.params:
            if name in self.diagram.scalars:
                continue
            array = self.diagram.arrays[name]
            if array.dtype in INTEGER_DTYPES:
                continue
            grad_name = self.fresh(f"d{name}")
            if self.finish(name, grad_name) is None:
                self.lines.append(f"{grad_name}[{' '.join(array.axes)}] = 0")
            gradients[name] = grad_name
        return gradients


def _recomputation(diagram: Diagram, sweep: _ReverseSweep, save: tuple[str, ...]) -> tuple[list[Statement], list[str], list[str]]:
    """What the backward reads of the forward: the intermediates it recomputes (closed under
    their reads; a softmax with a saved lse from it), their lines, and the saved arrays."""
    referenced = set(re.findall(r"[^\W\d]\w*", "\n".join(sweep.lines)))
    kept = set(save)
    needed = {n for n in referenced if n in diagram.arrays and diagram.arrays[n].role == "intermediate" and n not in kept}
    needed_outputs = {n for n in referenced if n in diagram.outputs}
    lse_for = _close_recomputed(diagram, needed, needed_outputs, kept)
    recompute: list[Statement] = []
    recompute_lines = []
    for s in diagram.statements:
        if s.target not in needed:
            continue
        recompute.append(s)
        array = diagram.arrays[s.target]
        if s.target in lse_for:
            lse = lse_for[s.target]
            saved_lse = f"{lse.target}[{' '.join(lse.axes)}]"
            body = f"exp({notation(s.box.operand)} - {saved_lse})"
            if _masked(s.box.operand):
                # a row masked out entirely has L = -inf, and exp(-inf - -inf) is NaN where the
                # forward's softmax gives that row 0
                body = f"where({saved_lse} > -inf, {body}, 0)"
            recompute_lines.append(statement_text(s, array.dtype, body)
                                   + f"    # recomputed from the saved {lse.target}: no max or sum over {s.box.axis}")
        else:
            recompute_lines.append(statement_text(s, array.dtype) + "    # recomputed")
    saved = [o for o in diagram.outputs if o in needed_outputs or o in sweep.uses_saved_o]
    saved += [n for n in save if n in referenced or any(n in s.inputs for s in recompute)]
    return recompute, recompute_lines, saved


def _close_recomputed(diagram: Diagram, needed: set[str], needed_outputs: set[str], kept: set[str]) -> dict:
    """Close the recomputed set (``needed``, in place) under the forward statements' reads,
    adding the outputs they read to ``needed_outputs``; softmax target -> its saved lse."""
    lse_for = {}
    changed = True
    while changed:
        changed = False
        for s in diagram.statements:
            if s.target not in needed:
                continue
            lse = _lse_of(diagram, s) if isinstance(s.box, Softmax) else None
            reads_ = set(s.inputs) | ({lse.target} if lse is not None else set())
            if lse is not None:
                lse_for[s.target] = lse
            for r in reads_:
                array = diagram.arrays.get(r)
                if array is None:
                    continue
                if array.role == "intermediate" and r not in needed and r not in kept:
                    needed.add(r)
                    changed = True
                elif array.role == "output" and r not in needed_outputs:
                    needed_outputs.add(r)
                    changed = True
    return lse_for


def _backward_text(diagram: Diagram, sweep: _ReverseSweep, gradients: dict, recompute: list[Statement],
                   recompute_lines: list[str], saved: list[str], auxiliary: tuple[str, ...]) -> Backward:
    """The backward kernel as napkin text: parameters (the inputs it reads, the saved arrays, the
    cotangents it reads), the gradients as outputs, a header saying what is saved and recomputed."""
    referenced = set(re.findall(r"[^\W\d]\w*", "\n".join(sweep.lines)))
    used = referenced | {n for s in recompute for n in s.inputs} | set(saved)
    params = []
    for name in diagram.params:
        if name in diagram.arrays and name in used:
            array = diagram.arrays[name]
            params.append(f"{name}: {array.dtype}[{' '.join(array.axes)}]")
        elif name in diagram.scalars and (name in used or any(
                isinstance(leaf, ScalarParam) and leaf.name == name for leaf in _scalar_leaves(recompute))):
            params.append(f"{name}: {diagram.scalars[name].dtype}")
    for name in saved:
        array = diagram.arrays[name]
        params.append(f"{name}: {array.dtype}[{' '.join(array.axes)}]")
    cotangents = {}
    for output, name in sweep.cotangent_params.items():
        if name in referenced:
            array = diagram.arrays[output]
            params.append(f"{name}: {array.dtype}[{' '.join(array.axes)}]")
            cotangents[output] = name
    outputs = [f"{g}: {diagram.arrays[x].dtype}[{' '.join(diagram.arrays[x].axes)}]" for x, g in gradients.items()]
    if not outputs:
        raise NapkinError(f"{diagram.name} has no float array input to differentiate")
    kernel_name = sweep.fresh(f"{diagram.name}_grad")
    header = [
        f"# The backward of {diagram.name}, derived by `napkin grad` (reverse mode on the diagram).",
        "# saved by the forward (read here): " + (", ".join(f"{n} (an lse output the forward adds for this backward)"
                                                           if n in auxiliary else n for n in saved)
                                                 if saved else "nothing beyond the inputs"),
        "# recomputed here: " + (", ".join(s.target for s in recompute) if recompute else "nothing"),
        f"kernel {kernel_name}({', '.join(params)}) -> ({', '.join(outputs)}):",
    ]
    body = ["    " + line for line in recompute_lines + sweep.lines]
    return Backward("\n".join(header + body) + "\n", kernel_name, tuple(saved), tuple(s.target for s in recompute),
                    cotangents, gradients)


# ---- the forward that saves each softmax's log-sum-exp ------------------------------------------


def lse_forward(diagram: Diagram, block_text: str = "") -> tuple[str, tuple[str, ...]] | None:
    """The forward as napkin text with one more output per softmax that has no lse output:
    ``L[kept] = lse[x](operand)`` over the softmax's axis and operand, right after it, so the
    backward reads L and recomputes P as ``exp(S - L)`` (FA2 saves it: one value a row). The
    text is the diagram's own, statement by statement (``block_text``: its relabel block, whose
    clauses then cover L's statement too); the added outputs' names are returned with it. None
    when every softmax has its lse, or a box has no text (an opaque box, which has no backward)."""
    softmaxes = [s for s in diagram.statements if isinstance(s.box, Softmax) and _lse_of(diagram, s) is None]
    if not softmaxes or any(isinstance(s.box, Opaque) for s in diagram.statements):
        return None
    fresh = _names(diagram)
    added: dict[str, tuple[str, str]] = {}  # softmax target -> (lse name, its axes)
    for s in softmaxes:
        added[s.target] = (fresh("L" if s.target == "P" else f"L{s.target}"), " ".join(a for a in s.axes if a != s.box.axis))
    head, outputs = diagram.signature().split(" -> ", 1)
    # f32, as FA2 saves it (the values on chip are f32), or f64 for a float64 kernel, whose P it recomputes
    dtype = "f64" if any(a.dtype == "f64" for a in diagram.input_arrays) else "f32"
    extra = ", ".join(f"{name}: {dtype}[{axes}]" for name, axes in added.values())
    lines = [f"kernel {head} -> ({outputs}, {extra}):"]
    for s in diagram.statements:
        # an intermediate materialised with @level has its dtype written there; an output's is the declaration's
        written = diagram.arrays[s.target].dtype if s.level and s.target not in diagram.outputs else None
        lines.append("    " + statement_text(s, written))
        if s.target in added:
            name, axes = added[s.target]
            lines.append(f"    {name}[{axes}] = lse[{s.box.axis}]({notation(s.box.operand)})"
                         f"    # saved for the backward: {s.target} = exp({notation(s.box.operand)} - {name})")
    text = "\n".join(lines) + "\n" + (f"\n{block_text}" if block_text else "")
    return text, tuple(name for name, _ in added.values())


def backward_with_relabel(diagram: Diagram, relabel: syn.RelabelBlock | None, hardware: str | None,
                          rewrite_d: bool = False, save: tuple[str, ...] = (), key_stream: int | None = None,
                          auxiliary: tuple[str, ...] = (), sum_dq: bool = True, key_group: int | None = None) -> Backward:
    """:func:`backward`, with a relabel block when the forward has one: the forward's group
    partitions on axes that every statement of the backward is woven over (batch and heads for
    attention), at the same levels, on the same hardware. Streams and splits are not derived
    (the text says so; ``napkin tune`` sizes the backward). The block is kept only if the
    backward accepts it (:func:`~napkin_dsl.relabel.make_schedule`). ``key_stream`` sizes the
    query chunks of FA2's key launch (:func:`_keys_schedule`) instead of the forward's stream;
    ``sum_dq`` computes dQ there too, summed over the key groups (else in a launch of its own);
    ``key_group`` sizes its groups of keys instead of the forward's group of queries.
    ``auxiliary``: outputs the forward returns for its backward only (:func:`lse_forward`)."""
    derived = replace(backward(diagram, rewrite_d, save, auxiliary), auxiliary=auxiliary)
    if relabel is None:
        return derived
    checked = check_module(syn.parse(derived.text, "<backward>"), hardware=hardware)[derived.name]
    woven = set(checked.diagram.axes)
    for s in checked.diagram.statements:
        woven &= set(s.woven)
    clauses = []
    for level in relabel.levels:
        groups = [p for p in level.partitions if p.kind == "group" and p.axis in woven and p.targets is None]
        if groups:
            clauses.append(f"    {level.level}: group " + ", ".join(f"{p.axis} {p.size}" for p in groups))
    note = ("# relabelling: the forward's groups on the axes every backward statement is woven over; grouping keys, "
            "streaming queries and splitting dQ over keys are not derived yet (napkin tune sizes the backward)")
    if clauses:
        block = f"\nrelabel {derived.name} on {relabel.hardware}:\n" + "\n".join(clauses) + "\n"
        try:
            with_block = check_module(syn.parse(derived.text + block, "<backward>"), hardware=hardware)[derived.name]
            make_schedule(with_block.diagram, with_block.relabel.hardware, with_block.relabel)
        except NapkinError:
            block = ""
    else:
        block = ""
    if not block:
        note = ("# relabelling: none derived (no group of the forward is woven over by every backward statement); "
                "napkin tune sizes the backward")
    keyed = _keys_schedule(derived, relabel, hardware, key_stream, sum_dq, key_group)
    if keyed is not None:
        return replace(keyed, auxiliary=auxiliary)
    lines = derived.text.splitlines()
    text = "\n".join(lines[:3] + [note] + lines[3:]) + "\n" + block
    return Backward(text, derived.name, derived.saved, derived.recomputed, derived.cotangents, derived.gradients,
                    auxiliary=auxiliary)


# ---- FA2's schedule: group the keys, stream the queries ---------------------------------------


@dataclass(frozen=True)
class KeySchedule:
    """How :func:`_keys_schedule` split a backward into launches: the grouped key axis, the
    streamed query axis, and the targets of each launch (row statistics, keys, queries)."""

    keys: str
    queries: str
    statistics: tuple[str, ...]  # statements each in a launch of its own (FA2's D), saved @gmem
    key_outputs: tuple[str, ...]  # gradients woven over the keys (dK, dV): grouped over keys
    query_outputs: tuple[str, ...]  # gradients contracting the keys (dQ): grouped over queries
    renamed: dict = field(default_factory=dict)  # statement recomputed in the query launch -> its name there
    key_stream: int = 0  # the key launch's query chunk
    key_group: int = 0  # the key launch's group of keys
    # A query gradient the key launch computes instead (FA2's dQ), each key group adding its
    # product into it in device memory, in f32 (relabel.summed_over_groups) -> that sum's name
    # (the gradient itself when it is f32; else cast by a launch of its own). Empty: the query
    # launch recomputes what the query gradients read.
    summed: dict = field(default_factory=dict)


def _key_axes(diagram: Diagram, prefer=()) -> tuple[str, str] | None:
    """(keys, queries): an axis ``x`` that some gradients contract and the others are woven over,
    those others all contracting one axis ``q`` that the first ones are woven over (attention:
    dQ contracts x; dK and dV are woven over x and contract q). ``prefer``: axes tried first as
    the keys (the forward's streamed axes: the keys of attention's forward)."""
    outputs = [s for s in diagram.statements if s.target in diagram.outputs]
    for x in [*(a for a in prefer if a in diagram.axes), *(a for a in diagram.axes if a not in prefer)]:
        contracting = [s for s in outputs if x in s.consumed]
        woven = [s for s in outputs if x in s.woven]
        if not contracting or not woven or len(contracting) + len(woven) != len(outputs):
            continue
        common = set.intersection(*(set(s.consumed) for s in woven))
        for q in diagram.axes:
            if q in common and all(q in s.woven for s in contracting):
                return x, q
    return None


def _needed(diagram: Diagram, targets, stop=frozenset()) -> list[Statement]:
    """The statements ``targets`` depend on (themselves included), in order; ``stop``: arrays
    loaded from the top level instead of computed."""
    wanted, frontier = set(), list(targets)
    while frontier:
        name = frontier.pop()
        if name in wanted or name in stop:
            continue
        producer = diagram.producer(name)
        if producer is None:
            continue
        wanted.add(name)
        frontier += list(producer.inputs)
    return [s for s in diagram.statements if s.target in wanted]


def _rename(text: str, names: dict) -> str:
    if not names:
        return text
    pattern = re.compile(r"(?<![\w])(" + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) + r")(?=\[)")
    return pattern.sub(lambda m: names[m.group(1)], text)


def _keys_schedule(derived: Backward, relabel: syn.RelabelBlock, hardware: str | None,
                   key_stream: int | None = None, sum_dq: bool = True, key_group: int | None = None) -> Backward | None:
    """FA2's schedule of a backward whose gradients split into those woven over a key axis and
    those contracting it (:func:`_key_axes`), as launches the front end accepts, or None.

    * each statement that the key gradients read and that contracts the keys (D when it is
      ``sum[x](dP * P)``) or only reads parameters (FA2's ``D = sum[d](dO * O)``) is saved
      ``@gmem`` in a launch of its own, grouped over the queries (and streaming the keys when
      it contracts them): FA2's preprocess;
    * the key launch computes the key gradients (dK, dV) grouped over the keys and streaming the
      queries: each key group accumulates its gradients over every query chunk;
    * dQ contracts the keys, so no key group owns it. With ``sum_dq`` (FA2's choice), the key
      launch computes it too, from the dS it holds, and each key group adds its product for the
      query chunk into an f32 sum in device memory (``dQ_f32 @gmem f32``, the sum over groups of
      relabel.summed_over_groups), which a launch of its own casts to dQ's type: five products.
      Without (or where the key launch does not hold everything dQ reads), dQ gets a launch of
      its own that recomputes what it reads (renamed ``S_1``...) grouped over the queries and
      streaming the keys, as the forward does: seven products, and no atomic adds.

    The sizes are the forward's: its group size of the queries groups the keys (or
    ``key_group``), its stream size streams the queries (or ``key_stream``; both
    :meth:`Kernel.backward_options` prices: the key launch holds dK and dV whole, so its query
    chunk is what fits the rest of its fragments, and on wgmma a summed dQ's d is the key group's
    rows);
    ``napkin tune`` resizes them. None when the forward has no block, the
    gradients do not split so, or the front end refuses the block (a softmax that must see whole
    rows, as attention's without a saved lse)."""
    checked = check_module(syn.parse(derived.text, "<backward>"), hardware=hardware)[derived.name]
    diagram = checked.diagram
    found = _key_axes(diagram, [p.axis for lv in relabel.levels for p in lv.partitions if p.kind == "stream"])
    if found is None:
        return None
    x, q = found
    key_outputs = [s.target for s in diagram.statements if s.target in diagram.outputs and x in s.woven]
    query_outputs = [s.target for s in diagram.statements if s.target in diagram.outputs and x in s.consumed]
    params = set(diagram.params)
    statistics = [s for s in _needed(diagram, key_outputs)
                  if s.target not in diagram.outputs and len(s.woven) < len(diagram.axes)
                  and (x in s.consumed or set(s.inputs) <= params) and x not in s.woven]
    stats = {s.target for s in statistics}
    # the forward's sizes, and its level for the stream
    levels = [level for level in relabel.levels if level.partitions]
    if not levels:
        return None
    level = next((lv.level for lv in levels if any(p.kind == "stream" for p in lv.partitions)), levels[-1].level)
    forward = {(p.kind, p.axis): p.size for lv in relabel.levels for p in lv.partitions if p.targets is None}
    group_size = forward.get(("group", q), 128)
    stream_size = forward.get(("stream", x), 64)
    key_chunk = key_stream or stream_size
    keys = key_group or group_size
    unit = [(p.axis, p.size) for lv in relabel.levels for p in lv.partitions
            if p.kind == "group" and p.targets is None and p.axis not in (x, q)
            and all(p.axis in s.woven for s in diagram.statements)]

    comments, written = {}, {}
    for text in derived.text.splitlines():
        match = re.match(r"    (\w+)(\[.*?)(    # .*)?$", text)
        if match:
            written[match.group(1)] = match.group(1) + match.group(2)
            comments[match.group(1)] = match.group(3) or ""
    fresh = _names(diagram)

    def line(s: Statement, names: dict, at_top: bool, first: str | None = None, note: str = "") -> str:
        box = s.box
        text = written[s.target]
        if isinstance(box, Contract) and first is not None and first not in box.operands[0].axes:
            # the first operand carries the group axis: the tensor-core path takes its rows from it (isel.py)
            operands = sorted(box.operands, key=lambda o: first not in o.axes)
            text = statement_text(s, body=" * ".join(notation(o) for o in operands)
                                  + (f" * {notation(box.scale)}" if box.scale is not None else ""))
        if at_top:
            head, rest = text.split(" = ", 1)
            dtype = "" if s.target in diagram.outputs else f" {diagram.arrays[s.target].dtype}"
            text = f"{head} @gmem{dtype} = {rest}"
        return _rename(text, names) + (note or comments.get(s.target, ""))

    units = ", ".join(f"{a} {n}" for a, n in unit)
    unit_prefix = f"group {units}, " if units else "group "
    body: list[str] = []
    clauses: list[str] = []
    for s in statistics:
        body.append(f"# launch: {s.target}, FA2's preprocess, saved for the key launch to load")
        chain = _needed(diagram, [s.target], stop=frozenset())
        names = {c.target: fresh(c.target) for c in chain if c is not s}
        for c in chain:
            body.append(line(c, names, c is s))
        clause = f"    {level} for {s.target}: {unit_prefix}{q} {group_size}"
        if x in s.consumed:
            clause += f"; stream {x} {stream_size}"
        clauses.append(clause)
    key_chain = _needed(diagram, key_outputs, stop=frozenset(stats))
    query_chain = _needed(diagram, query_outputs, stop=frozenset(stats))
    computed = {c.target for c in key_chain}
    summed = {}
    # an f64 gradient keeps its launch: the sums add in f32 (relabel.SUMMED_DTYPE)
    if sum_dq and len(query_outputs) == 1 and all(c.target in computed for c in query_chain if c.target not in query_outputs) \
            and isinstance(diagram.producer(query_outputs[0]).box, Contract) and diagram.arrays[query_outputs[0]].dtype != "f64":
        (dq,) = query_outputs
        summed = {dq: dq if diagram.arrays[dq].dtype == SUMMED_DTYPE else fresh(f"{dq}_{SUMMED_DTYPE}")}
    renamed = {c.target: fresh(c.target) for c in query_chain
               if c.target in computed and c.target not in diagram.outputs and not summed}
    launched = [*key_outputs, *summed.values()]
    body.append(f"# launch: {', '.join(launched)}, grouped over the keys {x}, streaming the queries {q}"
                + (f"; each key group adds its {', '.join(summed)} product for the chunk into {', '.join(summed.values())}"
                   if summed else ""))
    for c in key_chain:
        body.append(line(c, {}, c is key_chain[-1] and not summed, first=x))
    for dq, total in summed.items():
        head, rest = _rename(written[dq], {dq: total}).split(" = ", 1)
        dtype = "" if total == dq else f" {SUMMED_DTYPE}"  # an output's dtype is its signature's
        body.append(f"{head} @gmem{dtype} = {rest}    # summed over the groups of {x}, atomically")
    clauses.append(f"    {level} for {', '.join(launched)}: {unit_prefix}{x} {keys}; stream {q} {key_chunk}")
    if summed:
        casts = [dq for dq, total in summed.items() if total != dq]
        if casts:
            body.append(f"# launch: {', '.join(casts)}, cast from the f32 sums")
        for dq in casts:
            head = written[dq].split(" = ", 1)[0]
            body.append(f"{head} = {_rename(head, {dq: summed[dq]})}")
            clauses.append(f"    {level} for {dq}: {unit_prefix}{q} {group_size}")
    else:
        body.append(f"# launch: {', '.join(query_outputs)}, grouped over the queries {q}, streaming the keys {x}; "
                    f"it contracts {x}, so it recomputes what it reads")
        for c in query_chain:
            note = "    # recomputed for " + ", ".join(query_outputs) if c.target in renamed else ""
            body.append(line(c, renamed, False, note=note))
        clauses.append(f"    {level} for {', '.join(query_outputs)}: {unit_prefix}{q} {group_size}; stream {x} {stream_size}")
    placed = {c.target for c in key_chain} | {c.target for c in query_chain} | stats
    if placed != {s.target for s in diagram.statements}:
        return None  # a statement none of the launches needs: keep the plain text

    lines = derived.text.splitlines()
    if summed:
        plan = (f"# schedule (FA2's): {', '.join(key_outputs)} in groups of the keys {x} streaming the queries {q}; "
                f"{', '.join(query_outputs)} contracts {x}: each key group adds its part into "
                f"{', '.join(summed.values())} in device memory, atomically (so the sum's order, and its last bits, "
                f"vary from run to run)")
    else:
        plan = (f"# schedule: {', '.join(key_outputs)} in groups of the keys {x} streaming the queries {q}; "
                f"{', '.join(query_outputs)} contracts {x}, so it has a launch of its own grouped over {q}, which "
                f"recomputes what it reads (deterministic: no atomic adds)")
    header = lines[:3] + [plan, lines[3]]
    text = "\n".join(header + ["    " + b for b in body]) + "\n"
    block = f"\nrelabel {derived.name} on {relabel.hardware}:\n" + "\n".join(clauses) + "\n"
    try:
        with_block = check_module(syn.parse(text + block, "<backward>"), hardware=hardware)[derived.name]
        make_schedule(with_block.diagram, with_block.relabel.hardware, with_block.relabel)
    except NapkinError:
        return None
    schedule = KeySchedule(x, q, tuple(sorted(stats, key=list(diagram.arrays).index)), tuple(key_outputs),
                           tuple(query_outputs), renamed, key_chunk, keys, summed)
    return Backward(text + block, derived.name, derived.saved, derived.recomputed, derived.cotangents,
                    derived.gradients, schedule)


def _scalar_leaves(statements):
    found = []
    for s in statements:
        box = s.box
        exprs = {Map: lambda b: [b.expr], Reduce: lambda b: [b.operand], Softmax: lambda b: [b.operand],
                 Contract: lambda b: [b.scale] if b.scale is not None else []}[type(box)](box)
        for e in exprs:
            found += _leaves_of(e)
    return found


def _product_terms(expr) -> list:
    """The factors of a product tree (a contraction's scale: numbers and arrays multiplied)."""
    if isinstance(expr, Apply) and expr.fn == "mul":
        return [term for a in expr.args for term in _product_terms(a)]
    return [expr]


def _leaves_of(expr):
    if isinstance(expr, Apply):
        return [leaf for a in expr.args for leaf in _leaves_of(a)]
    return [expr]


def _masked(expr: Expression) -> bool:
    """Whether an expression can be -inf: it holds the constant -inf (a mask's fill)."""
    if isinstance(expr, Const):
        return expr.value == -algebra.oo
    return isinstance(expr, Apply) and any(_masked(a) for a in expr.args)


# FlashAttention's FLOP convention for attention's backward: 2.5 times the forward's products
# (its five matrix products to the forward's two), whatever the backward computes.
FLASH_BACKWARD_FACTOR = 2.5


def flash_backward_flops(diagram: Diagram, sizes: dict) -> float | None:
    """The FLOPs FlashAttention counts for the backward of ``diagram`` at ``sizes``: 2.5 times
    the forward's tensor FLOPs, where the forward is attention-shaped (a softmax whose only
    consumer contracts it with V into an output: :func:`_fa2_rewrite`), over the pairs a masked
    softmax's mask keeps (``pseudocode.kept_fraction``: causal's half); None elsewhere, where the
    convention says nothing (a matmul's backward is twice its forward, not 2.5 times)."""
    softmax = next((s for s in diagram.statements if isinstance(s.box, Softmax) and _fa2_rewrite(diagram, s)), None)
    if softmax is None:
        return None
    tensor = sum(float(algebra.as_expr(s.flops.get("tensor", 0)).subs(sizes)) for s in diagram.statements)
    condition = _mask_condition(diagram, softmax)
    if condition is not None:  # over the pairs the mask keeps: causal's (n + 1) / 2n, as FA's n / 2
        kept = kept_fraction(condition, sizes)
        if kept is None:
            return None  # a mask the convention does not count
        tensor *= kept
    return FLASH_BACKWARD_FACTOR * tensor


def _mask_condition(diagram: Diagram, softmax: Statement):
    """The condition of a masked softmax's where(COND, S, -inf) (its operand, or the map it reads), or None."""
    operand = softmax.box.operand
    if isinstance(operand, Read):
        producer = diagram.producer(operand.array)
        operand = producer.box.expr if producer is not None and isinstance(producer.box, Map) else None
    if isinstance(operand, Apply) and operand.fn == "where" and operand.args[2] == Const(-algebra.oo):
        return operand.args[0]
    return None


def _fa2_rewrite(diagram: Diagram, softmax: Statement) -> str | None:
    """The forward output O when ``softmax``'s only consumer is ``O = P * V`` (a contraction over
    the softmax axis into an output that keeps every other axis of P's): then
    sum[x](dP * P) = sum[d](dO * O), FA2's D."""
    consumers = diagram.consumers(softmax.target)
    if len(consumers) != 1 or softmax.target in diagram.outputs:
        return None  # P's cotangent has a term of its own (P an output): D needs sum[x](dP * P)
    c = consumers[0]
    if not (isinstance(c.box, Contract) and c.target in diagram.outputs and softmax.box.axis in c.box.contracted
            and c.box.scale is None and len(c.box.operands) == 2
            and sum(o.array == softmax.target for o in c.box.operands) == 1
            and diagram.arrays[c.target].dtype not in INTEGER_DTYPES):
        return None
    kept = [a for a in softmax.axes if a != softmax.box.axis]
    if any(a not in diagram.arrays[c.target].axes for a in kept):
        return None  # O sums over a row of P's (H[] = X * P): sum[d](dO * O) would mix the rows' D
    return c.target
