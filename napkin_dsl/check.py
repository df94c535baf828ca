"""The checker: syntax -> typed :class:`~napkin_dsl.diagram.Diagram`, or every error at once.

What it checks, per kernel: names (no unknown names, no use before definition, each output
assigned exactly once, nothing assigned twice, parameters never assigned); axes (each array
spelled with its own axes, no axis twice in one array, reductions and softmax name axes of
their operand, each once, implicit contraction only for a product of array references with every
contracted axis in at least two operands, broadcasting only onto axes the target has);
opaque boxes (argument count, axes and dtypes against the ``box`` signature); dtypes (low
precision products accumulate in f32, declared output dtypes convert on save); masks (a
bare axis name is the element's index where the statement iterates over the axis and the
axis's size elsewhere, ``len(x)`` the size anywhere; comparisons take numbers and yield
conditions, ``and``/``or``/``not`` and ``where``'s first argument take conditions, a compared
axis is one the statement iterates over, ``inf`` is only selected, an index is no power base
or divisor, no statement's result is a condition); and ``@level`` names against the hardware
named by the kernel's relabel block.

What it deliberately does not check: the legality of group and stream partitions and
capacities. Those need the whole schedule and live in ``relabel.py``.

Errors are collected, not raised one by one: a user fixing a diagram sees every problem in
one run, each with its line, column, caret and hint.

>>> from napkin_dsl.syntax import parse
>>> kernels = check_module(parse("kernel k(A: f32[i j]) -> B: f32[i]:\\n    B[i] = sum[j](A)\\n"))
>>> kernels["k"].diagram.statements[0].consumed
('j',)
"""

from __future__ import annotations

import dataclasses
import decimal
import difflib
import math
import re
from dataclasses import dataclass

from . import algebra, elementwise
from . import syntax as syn
from .boxes import REDUCTION_OPS, box_kind, statement_flops, work_axes
from .dtypes import FP8_DTYPES, INTEGER_DTYPES, canonical_dtype
from .diagram import (
    COMPARISONS, OPERATORS, AffineIndex, Apply, Array, Axis, BoxSignature, Const, Contract, Diagram, Index, Map, Opaque, Read,
    SCAN_OPS, Reduce, ScalarParam, ScalarParameter, Scan, Softmax, Statement, Window, expression_axes, indices, intermediate_dtype,
    source_dtypes, is_boolean, reads,
)
from .errors import NapkinError, NapkinTypeError, Span, raise_collected
from .hardware import BUILT_OVERLAPS, all_level_names, hardware_names, load_hardware


@dataclass(frozen=True)
class CheckedKernel:
    """A kernel's diagram with the relabel block that names it (if any)."""

    diagram: Diagram
    relabel: syn.RelabelBlock | None
    source: str
    file: str
    definition: syn.KernelDef


class _Collector:
    def __init__(self):
        self.errors: list[NapkinError] = []

    def error(self, message: str, span: Span | None, hint: str | None = None, cls=NapkinTypeError):
        self.errors.append(cls(message, span, hint))


def _did_you_mean(name: str, candidates) -> str | None:
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6)
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else None


def _axes_text(axes) -> str:
    return f"[{' '.join(axes)}]"


class _KernelChecker:
    """Checks one kernel definition; errors go to the shared collector."""

    def __init__(self, kdef: syn.KernelDef, boxes: dict, level_names: set[str] | None, hardware: str | None, out: _Collector):
        self.kdef = kdef
        self.boxes = boxes
        self.level_names = level_names
        self.hardware = hardware
        self.out = out
        self.axes: dict[str, Axis] = {}
        self.arrays: dict[str, Array] = {}
        self.scalars: dict[str, ScalarParameter] = {}
        self.defined_at: dict[str, Span] = {}
        self.statements: list[Statement] = []
        self.declared_outputs: dict[str, syn.Param] = {}
        self.later_targets = {s.target: s.span for s in kdef.statements}
        self.failed: set[str] = set()  # targets of statements already reported as wrong
        # Axes whose bare name is the element's index in the statement being checked (see
        # index_scope); any other axis name is the axis's size, as in d^-0.5.
        self.index_axes: frozenset[str] = frozenset()
        self.comparing = 0  # > 0 while converting the operands of a comparison

    # -- declarations
    def note_axes(self, axes, span: Span, what: str) -> bool:
        ok = True
        seen = set()
        for axis in axes:
            if axis in seen:
                self.out.error(
                    f"axis {axis!r} appears twice in {what} {_axes_text(axes)}",
                    span,
                    "an array has each axis once; use two names for two axes of the same size",
                )
                ok = False
            seen.add(axis)
            if axis not in self.axes:
                self.axes[axis] = Axis(axis, Axis.symbol(axis), span)
        return ok

    def declare(self, param: syn.Param, role: str):
        name, type_ = param.name, param.type
        dtype = canonical_dtype(type_.dtype)
        if name in self.arrays or name in self.scalars:
            self.out.error(f"{name!r} is declared twice in kernel {self.kdef.name!r}", param.span,
                           f"first declared at {self.defined_at[name]}")
            return
        self.defined_at[name] = param.span
        if type_.axes is None:
            if role == "output":
                self.out.error(f"output {name!r} needs axes", param.span, f"write {name}: {type_.dtype}[axes] (use [] for a single value)")
                return
            self.scalars[name] = ScalarParameter(name, dtype, param.span)
            return
        self.note_axes(type_.axes, type_.span, f"the type of {name!r}")
        self.arrays[name] = Array(name, dtype, tuple(type_.axes), role, None, param.span)

    # -- statements
    def run(self) -> Diagram | None:
        errors_before = len(self.out.errors)
        for param in self.kdef.params:
            self.declare(param, "input")
        for output in self.kdef.outputs:
            if output.name in self.arrays or output.name in self.scalars:
                self.out.error(f"output {output.name!r} has the name of a parameter", output.span, "give the output its own name")
                continue
            if output.name in self.declared_outputs:
                self.out.error(f"output {output.name!r} is declared twice", output.span,
                               f"first declared at {self.declared_outputs[output.name].span}")
                continue
            if output.type.axes is None:
                # A kernel's results are arrays; a single value is the array with no axes.
                self.out.error(f"output {output.name!r} needs axes", output.span,
                               f"write {output.name}: {output.type.dtype}[axes] (use [] for a single value)")
                continue
            self.declared_outputs[output.name] = output
            # Register the output's axes now so size expressions and broadcasts can use them.
            self.note_axes(output.type.axes, output.type.span, f"the type of {output.name!r}")
        if not self.kdef.statements:
            self.out.error(f"kernel {self.kdef.name!r} has no statements", self.kdef.span,
                           "write at least one statement assigning each output, e.g. Y[i] = X[i]")
        for statement in self.kdef.statements:
            self.statement(statement)
            if statement.target not in self.arrays and statement.target not in self.scalars:
                self.failed.add(statement.target)
        for name, output in self.declared_outputs.items():
            # An empty kernel was reported above; one error says it better than one per output.
            if self.kdef.statements and name not in self.arrays and name not in self.later_targets:
                axes = _axes_text(output.type.axes) if output.type.axes is not None else "[...]"
                self.out.error(f"output {name!r} is never assigned", output.span, f"add a statement {name}{axes} = ...")
        if len(self.out.errors) > errors_before:
            return None
        return Diagram(
            name=self.kdef.name,
            axes=dict(self.axes),
            arrays=dict(self.arrays),
            scalars=dict(self.scalars),
            params=tuple(p.name for p in self.kdef.params),
            outputs=tuple(o.name for o in self.kdef.outputs),
            statements=tuple(self.statements),
            span=self.kdef.span,
        )

    def statement(self, stmt: syn.Statement):
        name = stmt.target
        if name in self.scalars or (name in self.arrays and self.arrays[name].role == "input"):
            self.out.error(f"cannot assign to parameter {name!r}", stmt.span, "parameters are read-only; assign a new name")
            return
        if name in self.arrays:
            self.out.error(f"{name!r} is assigned twice", stmt.span, f"first assigned at {self.defined_at[name]}; each array is assigned exactly once")
            return
        if stmt.level is not None and not self.level_ok(stmt):
            pass  # reported; keep checking the statement itself
        if stmt.axes is not None:
            if not self.note_axes(stmt.axes, stmt.span, f"the target {name!r}"):
                return
        output = self.declared_outputs.get(name)
        if output is not None and stmt.axes is not None and output.type.axes is not None and set(stmt.axes) != set(output.type.axes):
            self.out.error(
                f"output {name!r} is declared with axes {_axes_text(output.type.axes)} but assigned as {name}{_axes_text(stmt.axes)}",
                stmt.span, f"declared at {output.span}",
            )
            return
        target_axes = stmt.axes if stmt.axes is not None else (tuple(output.type.axes) if output is not None else None)
        built = self.box(stmt, target_axes)
        if built is None:
            return
        box, axes, woven, consumed, operand_dtypes = built
        if stmt.dtype is not None and (output is not None or stmt.level is None):
            written = f"{name}{_axes_text(axes)}"
            if output is not None:
                self.out.error(f"{name} is an output, declared {output.type.dtype}: its dtype is the declaration's",
                               stmt.dtype_span, f"drop {stmt.dtype!r} here, or change the declaration")
            else:
                self.out.error(f"a dtype after the target is the storage dtype of a materialised intermediate; "
                               f"{name} is not materialised", stmt.dtype_span,
                               f"materialise it: {written} @gmem {stmt.dtype} = ..., or drop {stmt.dtype!r}")
            return
        if output is not None:
            dtype, role = canonical_dtype(output.type.dtype), "output"
            axes = tuple(output.type.axes)
        elif stmt.level is not None and stmt.dtype is not None:
            # Written: H[b n] @gmem bf16 = ... stores H in bf16 (computed as usual, converted on save).
            dtype, role = canonical_dtype(stmt.dtype), "intermediate"
        else:
            # A materialised intermediate is stored at the width of the widest stored array it
            # is computed from.
            sources = source_dtypes([r.array for r in _box_reads(box)], self.arrays, {s.target: s for s in self.statements})
            dtype, role = intermediate_dtype(operand_dtypes, sources, stmt.level is not None), "intermediate"
        floats = self.float_sources(box) if dtype in INTEGER_DTYPES else []
        if floats:
            # Arithmetic is float (docs/notation.md); an integer store would round the value, which
            # the notation has no way to ask for (no cast), so it is refused rather than done silently.
            source = floats[0]
            if output is not None:
                self.out.error(f"output {name} is declared {dtype}, but its value is a float: it is computed from {source}",
                               stmt.span, f"declare {name} as f32 (declared at {output.span}); an integer output holds "
                                          f"values computed from integer arrays only, and napkin has no cast to round one")
            else:
                self.out.error(f"{name} is stored as {dtype}, but its value is a float: it is computed from {source}",
                               stmt.dtype_span, f"store it as f32 ({name}{_axes_text(axes)} @{stmt.level} f32 = ...) or drop "
                                                f"{stmt.dtype!r}; an integer array holds values computed from integer arrays "
                                                f"only, and napkin has no cast to round one")
            return
        array = Array(name, dtype, axes, role, stmt.level, stmt.span)
        self.arrays[name] = array
        self.defined_at[name] = stmt.span
        inputs = tuple(dict.fromkeys(r.array for r in _box_reads(box)))
        statement = Statement(len(self.statements), name, axes, box, woven, consumed, inputs, {}, dtype, stmt.span, stmt.level)
        # FLOPs from the table of box kinds (boxes.BOX_KINDS), as the Program counts them
        flops = statement_flops(box_kind(box).flops(box), lambda space: algebra.Mul(*(self.axes[a].size for a in work_axes(statement, space))))
        self.statements.append(dataclasses.replace(statement, flops=flops))

    def float_sources(self, box) -> list[str]:
        """The float arrays and scalars a box's value is computed from ("X (f32)"), followed
        back through the intermediates kept on chip, as :func:`source_dtypes` follows them;
        none for an opaque box, whose signature declares its result's dtype. A condition's
        operands are not among them (:func:`_value_leaves`): ``min[i](where(X == M, i, len(i)))``
        is an index, whatever X is (torch.argmax)."""
        producers = {s.target: s for s in self.statements}
        found, seen, scalars = [], set(), []
        leaves = _box_value_leaves(box)
        pending = [leaf.array for leaf in leaves if isinstance(leaf, Read)]
        scalars += [leaf.name for leaf in leaves if isinstance(leaf, ScalarParam)]
        while pending:
            name = pending.pop(0)
            if name in seen:
                continue
            seen.add(name)
            array = self.arrays[name]
            if array.role == "intermediate" and array.level is None and name in producers:
                held = _box_value_leaves(producers[name].box)
                pending.extend(leaf.array for leaf in held if isinstance(leaf, Read))
                scalars += [leaf.name for leaf in held if isinstance(leaf, ScalarParam)]
            elif array.dtype not in INTEGER_DTYPES:
                found.append(f"{name} ({array.dtype})")
        found += [f"{s} ({self.scalars[s].dtype})" for s in dict.fromkeys(scalars) if self.scalars[s].dtype not in INTEGER_DTYPES]
        return found

    def level_ok(self, stmt: syn.Statement) -> bool:
        names = self.level_names if self.level_names is not None else all_level_names()
        if stmt.level in names:
            return True
        if self.hardware:
            # Name the top level in the hint: materialising there is what @level is usually for.
            profile = load_hardware(self.hardware)
            top = profile.top.name
            message = f"unknown level @{stmt.level} for {stmt.target!r}: hardware {self.hardware} has levels {', '.join(profile.level_names())}"
            fallback = f"materialise at the top level: {stmt.target}[...] @{top} = ..."
        else:
            message = f"unknown level @{stmt.level} for {stmt.target!r}: no hardware profile has it (known levels: {', '.join(sorted(names))})"
            fallback = "use a level of the kernel's hardware, named by its relabel block"
        self.out.error(message, stmt.level_span or stmt.span, _did_you_mean(stmt.level, names) or fallback)
        return False

    # -- boxes
    def index_scope(self, stmt: syn.Statement, target_axes) -> frozenset[str]:
        """The axes a bare axis name indexes in this statement: the target's axes (every axis
        of the iteration space but a contracted one), and the axes a reduction or softmax acts
        along. Without written target axes, the axes of the arrays the statement reads."""
        expr = stmt.expr
        scope = set(target_axes) if target_axes is not None else set(_syntax_array_axes(expr, self.arrays))
        if isinstance(expr, syn.Call) and expr.axes is not None and (expr.name == "softmax" or expr.name in REDUCTION_OPS):
            scope |= set(expr.axes)
        return frozenset(scope)

    def box(self, stmt: syn.Statement, target_axes):
        self.index_axes = self.index_scope(stmt, target_axes)
        try:
            built = self._box(stmt, target_axes)
        finally:
            self.index_axes = frozenset()
        if built is not None:
            operand = built[0]
            value = operand.expr if isinstance(operand, Map) else getattr(operand, "operand", None)
            if value is not None and is_boolean(value):
                self.out.error(f"{stmt.target} would be a boolean: a comparison is a condition, not a value",
                               stmt.span, "turn it into a number with where(COND, 1, 0), or use it in where(COND, A, B)")
                return None
            if isinstance(operand, Contract) and operand.scale is not None and indices(operand.scale):
                axis = indices(operand.scale)[0].axis
                self.out.error(f"the contraction {stmt.target} is scaled by the index of axis {axis!r}; "
                               f"a contraction's factor is one number", stmt.span,
                               f"write len({axis}) for the size of {axis}, or scale in a statement of its own")
                return None
        return built

    def _box(self, stmt: syn.Statement, target_axes):
        expr = stmt.expr
        if isinstance(expr, syn.Call) and (expr.name in ("softmax", *SCAN_OPS) or (expr.name in REDUCTION_OPS and expr.axes is not None) or expr.name in self.boxes):
            if expr.name == "softmax":
                return self.softmax(stmt, expr, target_axes)
            if expr.name in SCAN_OPS:
                return self.scan(stmt, expr, target_axes)
            if expr.name in self.boxes:
                return self.opaque(stmt, expr, target_axes)
            return self.reduce(stmt, expr, target_axes)
        converted = self.expression(expr)
        if converted is None:
            return None
        operand_axes = expression_axes(converted)
        if target_axes is None:
            target_axes = operand_axes
            if _product_factors(converted) is not None and len(reads(converted)) > 1:
                self.out.error(
                    f"name the axes of {stmt.target!r}: a product may contract, so napkin needs to know which axes remain",
                    stmt.span, f"write {stmt.target}{_axes_text(operand_axes)} = ... and drop the axes to contract",
                )
                return None
        missing = [a for a in operand_axes if a not in target_axes]
        dtypes = [self.arrays[r.array].dtype for r in reads(converted)]
        factors = _product_factors(converted)
        if missing:
            if factors is None:
                axis = missing[0]
                holder = next(r for r in reads(converted) if axis in r.axes)
                self.out.error(
                    f"axis {axis!r} of {holder.array}{_axes_text(holder.axes)} is not an axis of {stmt.target}{_axes_text(target_axes)}; "
                    f"only a product of arrays contracts implicitly",
                    holder.span or stmt.span, f"reduce it explicitly: sum[{axis}](...), max[{axis}](...), or add {axis!r} to the target",
                )
                return None
            arrays = [f for f in factors if isinstance(f, Read)]
            operands = _product_operands(arrays, missing, target_axes)
            ok = True
            for axis in missing:
                holders = [r for r in operands if axis in r.axes]
                scaled = [r for r in arrays if self.arrays[r.array].dtype in FP8_DTYPES and axis not in r.axes]
                if len(holders) < 2 and scaled and self.arrays[holders[0].array].dtype not in FP8_DTYPES:
                    # A scale read beside a quantized array it does not fit: say so, not "contraction".
                    scale, data = holders[0], scaled[0]
                    self.out.error(
                        f"{scale.array}{_axes_text(scale.axes)} scales the {self.arrays[data.array].dtype} array "
                        f"{data.array}{_axes_text(data.axes)}, which has no axis {axis!r}; a scale's axes are axes of the array it scales",
                        scale.span or stmt.span,
                        f"a scale is a scalar (per tensor) or an array over some of {data.array}'s axes: per row "
                        f"(every axis but the one a row runs along) or per block of rows (the block axis of a split, "
                        f"{data.array}: {self.arrays[data.array].dtype}[... qb qi ...] with its scale over qb)",
                    )
                    ok = False
                elif len(holders) < 2:
                    self.out.error(
                        f"axis {axis!r} is contracted but appears only in {holders[0].array}{_axes_text(holders[0].axes)}; "
                        f"a contraction joins the same axis of two arrays",
                        holders[0].span or stmt.span, f"to sum one array over {axis!r} write sum[{axis}]({holders[0].array}), or add {axis!r} to the target",
                    )
                    ok = False
            if not ok:
                return None
            extra = [a for a in target_axes if a not in operand_axes]
            if extra:
                self.out.error(
                    f"axis {extra[0]!r} of {stmt.target}{_axes_text(target_axes)} appears in no operand of the contraction",
                    stmt.span, "a contraction's result has only axes of its operands",
                )
                return None
            kept = {id(r) for r in operands}
            scalars = [f for f in factors if not isinstance(f, Read)] + [r for r in arrays if id(r) not in kept]
            scale = None
            for factor in scalars:
                scale = factor if scale is None else Apply("mul", (scale, factor))
            box = Contract(tuple(operands), tuple(missing), scale)
            return box, tuple(target_axes), tuple(target_axes), tuple(missing), dtypes
        self.check_broadcast(stmt, target_axes)
        return Map(converted), tuple(target_axes), tuple(target_axes), (), dtypes

    def check_broadcast(self, stmt, target_axes):
        for axis in target_axes:
            if axis not in self.axes:
                self.axes[axis] = Axis(axis, Axis.symbol(axis), stmt.span)

    def single_operand(self, expr: syn.Call, what: str):
        if len(expr.args) != 1:
            self.out.error(f"{what} takes one operand, got {len(expr.args)}", expr.span, f"write {what}(EXPR)")
            return None
        return self.expression(expr.args[0])

    def reduce(self, stmt, expr: syn.Call, target_axes):
        what = f"{expr.name}[{' '.join(expr.axes)}]"
        if not expr.axes:
            self.out.error(f"{expr.name}[] names no axis to reduce", expr.span, f"write {expr.name}[AXIS](...)")
            return None
        repeated = next((a for i, a in enumerate(expr.axes) if a in expr.axes[:i]), None)
        if repeated is not None:
            # Reducing j twice is not a reduction over j*j elements: the cost would count the
            # axis twice and the backends refuse the duplicate. Caret under the second one.
            kept = " ".join(dict.fromkeys(expr.axes))
            self.out.error(f"{what} names axis {repeated!r} twice", _axis_list_span(expr.span, expr.axes, repeated),
                           f"reduce each axis once: {expr.name}[{kept}](...)")
            return None
        operand = self.single_operand(expr, what)
        if operand is None:
            return None
        operand_axes = expression_axes(operand)
        for axis in expr.axes:
            if axis not in operand_axes:
                self.out.error(
                    f"{what} reduces axis {axis!r}, but its operand has axes {_axes_text(operand_axes)}",
                    expr.span, _did_you_mean(axis, operand_axes) or "reduce an axis the operand has",
                )
                return None
        kept = tuple(a for a in operand_axes if a not in expr.axes)
        if target_axes is None:
            target_axes = kept
        if set(target_axes) != set(kept):
            self.out.error(
                f"{stmt.target}{_axes_text(target_axes)} does not match {what} of an operand with axes {_axes_text(operand_axes)}: "
                f"the result has axes {_axes_text(kept)}",
                stmt.span, f"write {stmt.target}{_axes_text(kept)}",
            )
            return None
        dtypes = [self.arrays[r.array].dtype for r in reads(operand)]
        return Reduce(REDUCTION_OPS[expr.name], tuple(expr.axes), operand), tuple(target_axes), tuple(target_axes), tuple(expr.axes), dtypes

    def softmax(self, stmt, expr: syn.Call, target_axes):
        found = self.along_one_axis(stmt, expr, target_axes, "softmax", "softmax them", "softmax keeps")
        if found is None:
            return None
        axis, operand, target_axes, woven, dtypes = found
        return Softmax(axis, operand), target_axes, woven, (axis,), dtypes

    def scan(self, stmt, expr: syn.Call, target_axes):
        """``cumsum[x](E)``, ``cumprod[x](E)``: one axis, which the result keeps."""
        found = self.along_one_axis(stmt, expr, target_axes, expr.name, "scan them", "a scan keeps")
        if found is None:
            return None
        axis, operand, target_axes, woven, dtypes = found
        return Scan(SCAN_OPS[expr.name], axis, operand), target_axes, woven, (axis,), dtypes

    def along_one_axis(self, stmt, expr: syn.Call, target_axes, name: str, several: str, keeps: str):
        """A box that acts along one axis and keeps it (softmax, a scan): (its axis, its checked
        operand, the target's axes, the axes woven over it, the operands' dtypes), or None where
        reported. ``several`` and ``keeps`` word the hints: "softmax them", "softmax keeps"."""
        if expr.axes is None or len(expr.axes) != 1:
            given = f"got {_axes_text(expr.axes)}" if expr.axes else "got none"
            self.out.error(f"{name} needs exactly one axis, {given}", expr.span,
                           f"write {name}[AXIS](EXPR); for several axes, {several} in separate statements")
            return None
        axis = expr.axes[0]
        operand = self.single_operand(expr, f"{name}[{axis}]")
        if operand is None:
            return None
        operand_axes = expression_axes(operand)
        if axis not in operand_axes:
            self.out.error(
                f"{name}[{axis}] acts along axis {axis!r}, but its operand has axes {_axes_text(operand_axes)}",
                expr.span, _did_you_mean(axis, operand_axes) or "name an axis of the operand",
            )
            return None
        if target_axes is None:
            target_axes = operand_axes
        if set(target_axes) != set(operand_axes):
            self.out.error(
                f"{stmt.target}{_axes_text(target_axes)} does not match {name}[{axis}] of an operand with axes {_axes_text(operand_axes)}",
                stmt.span, f"{keeps} its operand's axes: write {stmt.target}{_axes_text(operand_axes)}",
            )
            return None
        woven = tuple(a for a in target_axes if a != axis)
        dtypes = [self.arrays[r.array].dtype for r in reads(operand)]
        return axis, operand, tuple(target_axes), woven, dtypes

    def opaque(self, stmt, expr: syn.Call, target_axes):
        decl: syn.BoxDecl = self.boxes[expr.name]
        signature = BoxSignature(
            decl.name,
            tuple((canonical_dtype(t.dtype), tuple(t.axes or ())) for t in decl.inputs),
            tuple((canonical_dtype(t.dtype), tuple(t.axes or ())) for t in decl.outputs),
            decl.span,
        )
        if expr.axes is not None:
            self.out.error(f"box {decl.name} takes no axis list", expr.span, f"write {decl.name}(ARGS)")
            return None
        if len(signature.outputs) != 1:
            self.out.error(f"box {decl.name} has {len(signature.outputs)} outputs; a statement assigns exactly one array", expr.span,
                           "declare one box per output")
            return None
        if len(expr.args) != len(signature.inputs):
            self.out.error(f"box {decl.name} takes {len(signature.inputs)} inputs, got {len(expr.args)}", expr.span, f"declared at {decl.span}")
            return None
        args, woven, consumed, dtypes = [], [], [], []
        for position, (arg, (dtype, box_axes)) in enumerate(zip(expr.args, signature.inputs, strict=False), start=1):
            converted = self.expression(arg)
            if converted is None:
                return None
            if not isinstance(converted, Read):
                self.out.error(f"input {position} of box {decl.name} must be an array name", getattr(arg, "span", expr.span),
                               "compute the expression in a statement of its own first")
                return None
            array = self.arrays[converted.array]
            for axis in box_axes:
                if axis not in converted.axes:
                    self.out.error(
                        f"input {position} of box {decl.name} needs axis {axis!r} ({dtype}{_axes_text(box_axes)}), "
                        f"but {converted.array} has axes {_axes_text(converted.axes)}",
                        converted.span or expr.span, f"box {decl.name} is declared at {decl.span}",
                    )
                    return None
            if array.dtype != dtype:
                self.out.error(f"input {position} of box {decl.name} is {dtype}, but {converted.array} is {array.dtype}",
                               converted.span or expr.span, "convert it in a statement first, or change the box signature")
                return None
            woven += [a for a in converted.axes if a not in box_axes and a not in woven]
            consumed += [a for a in box_axes if a not in consumed]
            args.append(converted)
            dtypes.append(array.dtype)
        produced = signature.outputs[0][1]
        self.note_axes(produced, decl.span, f"the output of box {decl.name}")
        expected = tuple(woven) + tuple(a for a in produced if a not in woven)
        if target_axes is None:
            target_axes = expected
        if set(target_axes) != set(expected):
            self.out.error(
                f"{stmt.target}{_axes_text(target_axes)} does not match box {decl.name}: woven over {_axes_text(woven)} "
                f"with outputs {_axes_text(produced)}, the result has axes {_axes_text(expected)}",
                stmt.span, f"write {stmt.target}{_axes_text(expected)}",
            )
            return None
        return (Opaque(signature, tuple(args)), tuple(target_axes), tuple(woven),
                tuple(consumed) + tuple(a for a in produced if a not in consumed), dtypes)

    # -- elementwise expressions
    def expression(self, expr) -> object | None:
        if isinstance(expr, syn.Number):
            if not self.number_in_range(expr):
                return None
            # Rational(text) keeps the number as written (nsimplify would turn 0.333333 into 1/3).
            return Const(algebra.Rational(expr.text) if isinstance(expr.value, float) else algebra.Integer(expr.value))
        if isinstance(expr, syn.Ref):
            return self.reference(expr)
        if isinstance(expr, syn.Neg):
            inner = self.number(expr.operand, "'-'")
            if isinstance(inner, Const):
                return Const(-inner.value)
            return None if inner is None else Apply("neg", (inner,))
        if isinstance(expr, syn.Compare):
            self.comparing += 1
            try:
                left, right = self.number(expr.left, f"'{expr.op}'"), self.number(expr.right, f"'{expr.op}'")
            finally:
                self.comparing -= 1
            if left is None or right is None:
                return None
            return Apply(COMPARISONS[expr.op], (left, right))
        if isinstance(expr, syn.Logic):
            operands = [self.condition(e, f"'{expr.op}'") for e in (expr.left, expr.right) if e is not None]
            if any(o is None for o in operands):
                return None
            return Apply(expr.op, tuple(operands))
        if isinstance(expr, syn.BinOp):
            left, right = self.number(expr.left, f"'{expr.op}'"), self.number(expr.right, f"'{expr.op}'")
            if left is None or right is None:
                return None
            if Const(algebra.oo) in (left, right) or Const(-algebra.oo) in (left, right):
                self.out.error("inf is only a value to select, as in where(COND, S, -inf); it takes no arithmetic",
                               expr.span, "write -inf or inf as a whole argument of where")
                return None
            # The name of an axis the statement iterates over is the element's index, 0 at the
            # first element: as a power's base or a divisor it is almost surely a size meant the
            # way it is written elsewhere (d^-0.5), so it is refused rather than read as 1/0.
            odd = left if expr.op == "^" and isinstance(left, Index) else right if expr.op == "/" and isinstance(right, Index) else None
            if odd is not None:
                operand = expr.left if odd is left else expr.right
                self.out.error(f"{odd.axis!r} here is the index of axis {odd.axis!r} (0 at its first element), used as "
                               f"{'a power base' if odd is left else 'a divisor'}: the statement iterates over {odd.axis!r}",
                               _span_of(operand) or expr.span, f"write len({odd.axis}) for the size of {odd.axis}")
                return None
            if isinstance(left, Const) and isinstance(right, Const):
                return self.fold(expr, left.value, right.value)
            if expr.op == "/" and isinstance(right, Const) and right.value == 0:
                self.out.error("division by the constant 0", _span_of(expr.right) or expr.span, "check the divisor")
                return None
            return Apply(OPERATORS[expr.op], (left, right))
        if isinstance(expr, syn.Call):
            return self.call(expr)
        raise AssertionError(f"napkin bug: unknown syntax {expr!r}")

    def number(self, expr, where: str):
        """An operand that must be a number (of an operator, a function, a comparison)."""
        converted = self.expression(expr)
        if converted is not None and is_boolean(converted):
            self.out.error(f"the operand of {where} is a condition (a boolean), not a number", _span_of(expr),
                           "turn a condition into a number with where(COND, A, B)")
            return None
        return converted

    def condition(self, expr, where: str):
        """An operand that must be a condition (of and/or/not, the first argument of where)."""
        converted = self.expression(expr)
        if converted is not None and not is_boolean(converted):
            self.out.error(f"the operand of {where} is a number, not a condition", _span_of(expr),
                           "compare it first, e.g. q >= x or M > 0")
            return None
        return converted

    def number_in_range(self, number: syn.Number) -> bool:
        """Refuse literals no float holds: an exact 1e99999999 would take minutes."""
        try:
            value = float(number.value)
        except OverflowError:  # an integer literal of hundreds of digits
            value = math.inf
        if math.isinf(value) or (value == 0 and number.text.strip("0.").lower()[:1] not in ("", "e")):
            self.out.error(f"number {number.text} is out of floating-point range", number.span,
                           "napkin computes in floating point: keep numbers between 1e-300 and 1e300")
            return False
        return True

    def fold(self, expr: syn.BinOp, a, b) -> Const | None:
        """Fold an operator on two constants (``d^-0.5``), refusing values no float can hold."""
        text = f"{a} {expr.op} {b}"
        if expr.op == "^" and a.is_number and b.is_number and not power_in_range(a, b):
            # Checked before computing: an exact 10^(10^8) never ends.
            self.out.error(f"constant {a}^{b} is out of floating-point range", expr.span,
                           "napkin computes in floating point: keep constants between 1e-300 and 1e300")
            return None
        if expr.op == "^" and not b.is_Rational:
            self.out.error(f"constant {text}: a power's exponent must be a number", expr.span,
                           "write the exponent as a number, as in d^-0.5")
            return None
        try:
            value = {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b, "^": lambda: a**b}[expr.op]()
        except ZeroDivisionError:
            self.out.error(f"constant {text} is undefined (division by zero)", expr.span, "check the divisor and the exponent's sign")
            return None
        except ValueError:
            self.out.error(f"constant {text} is not a real number", expr.span, "a negative number has no real fractional power")
            return None
        return Const(value)

    def reference(self, ref: syn.Ref):
        name = ref.name
        if ref.window is not None:
            return self.window_read(ref, None)
        if name in self.arrays:
            array = self.arrays[name]
            if ref.axes is not None:
                if len(set(ref.axes)) != len(ref.axes):
                    self.out.error(f"axis repeated in {name}{_axes_text(ref.axes)}", ref.span, "an array has each axis once")
                    return None
                if set(ref.axes) != set(array.axes):
                    missing = [a for a in array.axes if a not in ref.axes]
                    unknown = [a for a in ref.axes if a not in array.axes]
                    detail = f"missing {_axes_text(missing)}" if missing else f"it has no {_axes_text(unknown)}"
                    self.out.error(
                        f"{name} has axes {_axes_text(array.axes)} but is used as {name}{_axes_text(ref.axes)} ({detail})",
                        ref.span, f"{name} is defined at {self.defined_at[name]}; spell its axes as {name}{_axes_text(array.axes)}",
                    )
                    return None
            return Read(name, array.axes, ref.span)
        if name in self.scalars:
            if ref.axes is not None:
                self.out.error(f"{name!r} is a scalar and has no axes", ref.span, f"write {name}")
                return None
            return ScalarParam(name)
        if name in self.axes:
            if ref.axes is not None:
                self.out.error(f"{name!r} is an axis (a size), not an array", ref.span, f"write {name} for its size")
                return None
            if name in self.index_axes:
                return Index(name)
            if self.comparing:
                # A comparison of a size is a constant: the user meant the index, of an axis
                # this statement does not iterate over.
                self.out.error(f"axis {name!r} is compared but is not an axis of this statement "
                               f"(it iterates over {_axes_text(sorted(self.index_axes))})", ref.span,
                               f"add {name!r} to the target's axes, or write len({name}) for its size")
                return None
            return Const(self.axes[name].size)
        if name == "inf":
            return Const(algebra.oo)
        if name in self.failed:
            return None  # its statement was reported already: one mistake, one error
        if name in self.later_targets or name in self.declared_outputs:
            where = self.later_targets.get(name)
            self.out.error(f"{name!r} is used before it is defined", ref.span,
                           f"it is assigned later, at {where}" if where else "assign it before this statement")
            return None
        known = list(self.arrays) + list(self.scalars) + list(self.axes)
        self.out.error(f"unknown name {name!r}", ref.span, _did_you_mean(name, known) or "declare it as a kernel parameter or assign it first")
        return None

    def call(self, call: syn.Call):
        name = call.name
        if name in ("softmax", *SCAN_OPS) or (name in REDUCTION_OPS and call.axes is not None) or name in self.boxes:
            self.out.error(
                f"{name}{_axes_text(call.axes) if call.axes else ''}(...) must be the whole right-hand side of a statement",
                call.span, "give its result a name in a statement of its own, then use that name",
            )
            return None
        if call.axes is not None:
            along = ", ".join(REDUCTION_OPS)  # the reductions of the box table, in its order
            self.out.error(f"{name} takes no axis list", call.span, f"only {along} and softmax act along an axis")
            return None
        if name == "len":
            return self.length(call)
        if name == "pad":
            return self.padded(call)
        if name == "where":
            if len(call.args) != 3:
                self.out.error(f"where takes three arguments, got {len(call.args)}", call.span,
                               "write where(COND, A, B): A where COND holds, else B")
                return None
            cond = self.condition(call.args[0], "where")
            then, other = (self.number(a, "where") for a in call.args[1:])
            if cond is None or then is None or other is None:
                return None
            return Apply("where", (cond, then, other))
        args = [self.number(a, name) for a in call.args]
        if any(a is None for a in args):
            return None
        if Const(algebra.oo) in args or Const(-algebra.oo) in args:
            self.out.error(f"inf is only a value to select, as in where(COND, S, -inf); {name} cannot take it",
                           call.span, "write -inf or inf as a whole argument of where")
            return None
        entry = elementwise.function(name)  # the table of elementwise functions gives its arity
        if entry is not None:
            if len(args) != entry.arity:
                self.out.error(*_arity_error(name, entry.arity, len(args), call.span))
                return None
            return Apply(name, tuple(args))
        functions = sorted(set(elementwise.FUNCTIONS) | set(REDUCTION_OPS) | set(SCAN_OPS) | {"softmax", "where", "len", "pad"}
                           | set(self.boxes))
        self.out.error(f"unknown function {name!r}", call.span,
                       _did_you_mean(name, functions) or f"known: {', '.join(functions)}; declare others with 'box'")
        return None


    # -- window reads: X[b c (2*p + i)], pad(X[b c (p + i - 1)], 0)
    def padded(self, call: syn.Call):
        """``pad(READ, VALUE)``: a window read whose indices may fall outside the array, where
        it reads VALUE (a number, or -inf/inf)."""
        if len(call.args) != 2 or not isinstance(call.args[0], syn.Ref) or call.args[0].window is None:
            self.out.error("pad takes a window read and the value read outside the array", call.span,
                           "write pad(X[b c (p + i - 1)], 0): a read with an index in parentheses, then a number")
            return None
        value = self.number(call.args[1], "pad")
        if value is None:
            return None
        if not isinstance(value, Const) or value.value.free_symbols:
            self.out.error("pad's value is a number, -inf or inf", _span_of(call.args[1]) or call.span,
                           "write pad(X[...], 0) for a convolution's zero padding, -inf for a max pooling's")
            return None
        return self.window_read(call.args[0], float(value.value))

    def window_read(self, ref: syn.Ref, pad: float | None):
        """A window read: the view of a parameter over the axes its indices use (diagram.Window)."""
        name = ref.name
        array = self.arrays.get(name)
        stored = array is not None and array.window is None and (array.role == "input" or array.level is not None)
        if not stored:
            where = (f"{name} is computed on chip (line {self.defined_at[name].line}); " if array is not None
                     and self.defined_at.get(name) is not None else "")
            self.out.error(f"a window read reads a kernel parameter or an array materialised in device memory; "
                           f"{name} is neither", ref.span,
                           f"{where}materialise it: {name}[{' '.join(array.axes)}] @gmem = ..." if array is not None and array.role != "input"
                           else f"{where}read a parameter through the window")
            return None
        if len(ref.window) != len(array.axes):
            self.out.error(f"{name} has {len(array.axes)} axes {_axes_text(array.axes)} but its window read gives "
                           f"{len(ref.window)} {'index' if len(ref.window) == 1 else 'indices'}", ref.span,
                           "a window read lists one index per axis, in the array's order: X[b c (2*p + i)]")
            return None
        indices = []
        for item in ref.window:
            index = self.affine_index(item, ref.span) if not isinstance(item, str) else AffineIndex(((item, algebra.Integer(1)),))
            if index is None:
                return None
            indices.append(index)
        repeated = next((a for n, index in enumerate(indices) for a in index.axes
                         if any(a in other.axes for other in indices[n + 1:])), None)
        if repeated is not None:
            self.out.error(f"axis {repeated!r} indexes two axes of {name} in one window read", ref.span,
                           f"a window read indexes each axis of {name} with axes of its own; use two axes of the same size")
            return None
        window = Window(name, tuple(indices), pad)
        for index in indices:
            for axis in index.axes:
                if axis not in self.axes:
                    self.axes[axis] = Axis(axis, Axis.symbol(axis), ref.span)
        axes = tuple(dict.fromkeys(a for index in indices for a in index.axes))
        view = next((a for a in self.arrays.values() if a.window == window), None)
        if view is None:
            taken = set(self.arrays) | set(self.scalars) | set(self.axes) | set(self.later_targets) | set(self.declared_outputs)
            view_name = next(f"{name}_win{n or ''}" for n in range(len(taken) + 1) if f"{name}_win{n or ''}" not in taken)
            view = Array(view_name, array.dtype, axes, "input", None, ref.span, window)
            self.arrays[view_name] = view
            self.defined_at[view_name] = ref.span
        return Read(view.name, view.axes, ref.span)

    def affine_index(self, expr, span: Span):
        """An index expression as an :class:`AffineIndex`: integers, axes, len(axis), + - and
        products by a constant. None (reported) for anything else."""
        found = self.affine(expr)
        if found is None:
            return None
        terms, offset = found
        return AffineIndex(tuple((axis, c) for axis, c in terms.items() if c != 0), offset)

    def affine(self, expr) -> tuple[dict, algebra.Expr] | None:
        def refuse(what: str):
            self.out.error(f"a window index adds integer multiples of axes and a constant; {what} is not that",
                           _span_of(expr), "write an index such as (2*p + i - 1), (p + 2*i) or (len(c)*g + c)")
            return None

        if isinstance(expr, syn.Number):
            if isinstance(expr.value, float):
                return refuse(f"{expr.text}, not an integer,")
            return {}, algebra.Integer(expr.value)
        if isinstance(expr, syn.Ref) and expr.axes is None and expr.window is None:
            if expr.name in self.arrays or expr.name in self.scalars:
                return refuse(f"{expr.name}, a {'scalar' if expr.name in self.scalars else 'array'},")
            return {expr.name: algebra.Integer(1)}, algebra.Integer(0)
        if isinstance(expr, syn.Call) and expr.name == "len":
            size = self.length(expr)
            return None if size is None else ({}, size.value)
        if isinstance(expr, syn.Neg):
            inner = self.affine(expr.operand)
            return None if inner is None else ({a: -c for a, c in inner[0].items()}, -inner[1])
        if isinstance(expr, syn.BinOp) and expr.op in "+-*":
            left, right = self.affine(expr.left), self.affine(expr.right)
            if left is None or right is None:
                return None
            if expr.op == "*":
                if left[0] and right[0]:
                    return refuse("a product of two axes")
                (terms, offset), factor = (left, right[1]) if left[0] else (right, left[1])
                return {a: c * factor for a, c in terms.items()}, offset * factor
            sign = 1 if expr.op == "+" else -1
            terms = dict(left[0])
            for axis, c in right[0].items():
                terms[axis] = terms.get(axis, algebra.Integer(0)) + sign * c
            return terms, left[1] + sign * right[1]
        return refuse("this expression")

    def length(self, call: syn.Call):
        """``len(x)``: the size of axis x as a number, wherever x is in scope or not."""
        arg = call.args[0] if len(call.args) == 1 else None
        if not isinstance(arg, syn.Ref) or arg.axes is not None or arg.name not in self.axes:
            known = ", ".join(sorted(self.axes)) or "none yet"
            self.out.error("len takes one axis name", call.span, f"write len(AXIS) for the size of an axis; axes here: {known}")
            return None
        return Const(self.axes[arg.name].size)


def _span_of(expr) -> Span | None:
    return getattr(expr, "span", None)


def _syntax_array_axes(expr, arrays: dict) -> list[str]:
    """The axes of the arrays an expression names, read off the syntax (before it is checked)."""
    if isinstance(expr, syn.Ref) and expr.window is not None:  # the axes its indices use
        return [a for item in expr.window for a in ([item] if isinstance(item, str) else _syntax_index_axes(item, arrays))]
    if isinstance(expr, syn.Ref):
        return list(expr.axes or (arrays[expr.name].axes if expr.name in arrays else ()))
    children = []
    if isinstance(expr, (syn.BinOp, syn.Compare)):
        children = [expr.left, expr.right]
    elif isinstance(expr, syn.Logic):
        children = [e for e in (expr.left, expr.right) if e is not None]
    elif isinstance(expr, syn.Neg):
        children = [expr.operand]
    elif isinstance(expr, syn.Call) and expr.name != "len":
        children = list(expr.args)
    return [a for child in children for a in _syntax_array_axes(child, arrays)]


def _syntax_index_axes(expr, arrays: dict) -> list[str]:
    """The axes a window index names (``2*p + i``: p and i), read off the syntax."""
    if isinstance(expr, syn.Ref):
        return [] if expr.name in arrays else [expr.name]
    if isinstance(expr, syn.BinOp):
        return _syntax_index_axes(expr.left, arrays) + _syntax_index_axes(expr.right, arrays)
    if isinstance(expr, syn.Neg):
        return _syntax_index_axes(expr.operand, arrays)
    return []


def _axis_list_span(span: Span | None, axes, axis: str) -> Span | None:
    """The span of the second ``axis`` in the axis list written after a call's name (``sum[j j]``),
    found in the source line; the name's span when the line does not show the list."""
    if span is None or not span.source_line:
        return span
    line = span.source_line
    open_at = line.find("[", span.column - 1)
    close_at = line.find("]", open_at + 1)
    if open_at < 0 or close_at < 0:
        return span
    seen = 0
    for match in re.finditer(r"[^\W\d]\w*", line[open_at + 1 : close_at]):
        if match.group() == axis:
            seen += 1
            if seen == 2:
                start = open_at + 1 + match.start() + 1
                return Span(span.file, span.line, start, span.source_line, start + len(axis))
    return span


def power_in_range(base, exponent) -> bool:
    """Whether base^exponent (two numbers) lies within float range, without computing it."""
    if base == 0 or abs(base) == 1:
        return True
    try:
        return abs(float(exponent) * math.log10(abs(float(base)))) <= 300
    except (OverflowError, TypeError, ValueError):
        return False


def _product_operands(arrays: list, missing, target_axes) -> list:
    """The reads of a contracting product that stay its operands. A factor over the target's axes
    alone (a per-head scale sV[b h], a per-block sQ) reduces nothing: it leaves the product and
    scales its result, as a number does (FA3's descale of O after P V), so the product keeps the
    two operands an mma takes; unless the others would then lack an axis of the target
    (C[i] = X[j] * Y[j] * A[i]: the product's result keeps the target's axes)."""
    operands = list(arrays)
    for factor in reversed(arrays):
        if any(a in missing for a in factor.axes):
            continue
        rest = [r for r in operands if r is not factor]
        if set(target_axes) <= {a for r in rest for a in r.axes}:
            operands = rest
    return operands


def _product_factors(expr):
    """The factors of a pure product tree, or None if the expression is not one.

    Division by a scalar is a scalar factor: Q * K / 8 contracts like Q * K * 0.125.
    """
    if isinstance(expr, Apply) and expr.fn == "mul":
        left, right = (_product_factors(a) for a in expr.args)
        return None if left is None or right is None else left + right
    if isinstance(expr, Apply) and expr.fn == "div" and not reads(expr.args[1]):
        left = _product_factors(expr.args[0])
        divisor = expr.args[1]
        inverse = Const(1 / divisor.value) if isinstance(divisor, Const) else Apply("div", (Const(algebra.Integer(1)), divisor))
        return None if left is None else left + [inverse]
    if isinstance(expr, Read):
        return [expr]
    if not reads(expr):
        return [expr]  # a scalar factor: number, size expression, scalar parameter
    return None


def _value_leaves(expr) -> list:
    """The reads and scalars an expression's value is computed from, left to right. A condition (a
    comparison or a logical combination: ``is_boolean``) is 0 or 1 whatever its operands' values,
    and ``where``'s condition only chooses between its other two arguments: neither passes its
    operands' values on."""
    if isinstance(expr, (Read, ScalarParam)):
        return [expr]
    if not isinstance(expr, Apply) or is_boolean(expr):
        return []
    args = expr.args[1:] if expr.fn == "where" else expr.args
    return [leaf for arg in args for leaf in _value_leaves(arg)]


def _box_parts(box) -> tuple[list, list]:
    """A box's arrays read whole (a contraction's operands, an opaque box's arguments) and its
    expressions (a contraction's scale, a map's, a reduction's or softmax's operand)."""
    if isinstance(box, Contract):
        return list(box.operands), [box.scale] if box.scale is not None else []
    if isinstance(box, Map):
        return [], [box.expr]
    if isinstance(box, (Reduce, Softmax, Scan)):
        return [], [box.operand]
    return list(box.args), []


def _box_value_leaves(box) -> list:
    """The reads and scalars a box's value is computed from (:func:`_value_leaves`); none for an
    opaque box, whose signature declares its result's dtype."""
    if isinstance(box, Opaque):
        return []
    whole, expressions = _box_parts(box)
    return whole + [leaf for expr in expressions for leaf in _value_leaves(expr)]


def _box_reads(box) -> list[Read]:
    whole, expressions = _box_parts(box)
    return whole + [r for expr in expressions for r in reads(expr)]


# ---- module level ----------------------------------------------------------------------------


def _arity_error(name: str, arity: int, got: int, span) -> tuple:
    """The message, span and hint for a call of an elementwise function with ``got`` arguments."""
    if arity == 1:
        return f"{name} takes one argument, got {got}", span, f"write {name}(EXPR)"
    letters = ", ".join("abcdefgh"[:arity])
    # max(a, b) and min(a, b) share their names with reductions: a call of one argument is
    # most likely a reduction missing its axes.
    hint = f"for a reduction write {name}[AXIS](EXPR)" if name in REDUCTION_OPS else f"write {name}({letters})"
    return f"{name}({letters}) takes {_count_word(arity)} arguments, got {got}", span, hint


def _count_word(n: int) -> str:
    return {2: "two", 3: "three"}.get(n, str(n))


def _check_boxes(module: syn.Module, out: _Collector) -> dict:
    boxes = {}
    for decl in module.boxes:
        if decl.name in boxes:
            out.error(f"box {decl.name!r} is declared twice", decl.span, f"first declared at {boxes[decl.name].span}")
            continue
        reserved = set(elementwise.FUNCTIONS) | set(REDUCTION_OPS) | {"softmax", "where", "len"}
        if decl.name in reserved:
            out.error(f"box {decl.name!r} has the name of a built-in function", decl.span, "choose another name")
            continue
        for position, type_ in enumerate(decl.inputs, start=1):
            # An input's axes are what the box consumes: one named twice would be counted twice.
            repeated = next((a for i, a in enumerate(type_.axes or ()) if a in type_.axes[:i]), None)
            if repeated is not None:
                out.error(f"axis {repeated!r} appears twice in input {position} of box {decl.name} "
                          f"{type_.dtype}{_axes_text(type_.axes)}", type_.span,
                          "an array has each axis once; use two names for two axes of the same size")
        boxes[decl.name] = decl
    return boxes


def _relabel_hardware(block: syn.RelabelBlock | None, out: _Collector, hardware: str | None):
    name = block.hardware if block is not None else hardware
    if name is None:
        return None, None
    try:
        profile = load_hardware(name)
    except NapkinError as exc:
        # load_hardware says what is wrong (no such profile, an unreadable or invalid .toml);
        # the checker adds where and, for a misspelt profile name, which one was meant.
        out.error(exc.message, block.span if block else None, _did_you_mean(name, hardware_names()) or exc.hint)
        return None, None
    return name, set(profile.level_names())


def check_module(module: syn.Module, *, hardware: str | None = None, relabels: tuple = ()) -> dict[str, CheckedKernel]:
    """Check every kernel of a module; return them by name or raise all errors together.

    ``hardware`` names the profile that ``@level`` names are checked against for kernels with
    no relabel block; ``relabels`` adds relabel blocks from elsewhere (a decorator argument).
    """
    out = _Collector()
    boxes = _check_boxes(module, out)
    blocks = {}
    kernel_names = [k.name for k in module.kernels]
    for block in tuple(module.relabels) + tuple(relabels):
        target = block.kernel if block.kernel is not None else (kernel_names[0] if len(kernel_names) == 1 else None)
        if target is None:
            out.error("a relabel block without a kernel name needs exactly one kernel in the file", block.span,
                      "write relabel KERNEL on HARDWARE:")
            continue
        if target not in kernel_names:
            out.error(f"relabel names unknown kernel {target!r}", block.span,
                      _did_you_mean(target, kernel_names) or f"kernels here: {', '.join(kernel_names) or 'none'}")
            continue
        if target in blocks:
            out.error(f"kernel {target!r} is relabelled twice", block.span, f"first relabelled at {blocks[target].span}")
            continue
        blocks[target] = block
    results = {}
    seen = {}
    for kdef in module.kernels:
        if kdef.name in seen:
            out.error(f"kernel {kdef.name!r} is defined twice", kdef.span, f"first defined at {seen[kdef.name]}")
            continue
        seen[kdef.name] = kdef.span
        block = blocks.get(kdef.name)
        hardware_name, level_names = _relabel_hardware(block, out, hardware)
        if block is not None:
            if block.overlap is not None and block.overlap not in BUILT_OVERLAPS:
                out.error(f"no warpgroup schedule {block.overlap!r} (the schedules: {', '.join(BUILT_OVERLAPS)})",
                          block.overlap_span, _did_you_mean(block.overlap, BUILT_OVERLAPS)
                          or "docs/method.md, overlap of the compute units")
            for clauses in block.levels:
                if level_names is not None and clauses.level not in level_names:
                    out.error(
                        f"hardware {hardware_name} has no level {clauses.level!r}; its levels are {', '.join(load_hardware(hardware_name).level_names())}",
                        clauses.span, _did_you_mean(clauses.level, level_names)
                        or f"relabel a level below the top: {', '.join(load_hardware(hardware_name).level_names()[1:])}",
                    )
                for p in clauses.partitions:
                    error = size_error(p.axis, p.size, p.span, f"{p.kind} size of") if isinstance(p.size, int) else None
                    if error is not None:
                        out.errors.append(error)
        diagram = _KernelChecker(kdef, boxes, level_names, hardware_name, out).run()
        if diagram is not None:
            results[kdef.name] = CheckedKernel(diagram, block, module.source, module.file, kdef)
    raise_collected(out.errors)
    return results


# ---- size bounds -----------------------------------------------------------------------------

# The largest size napkin takes, and the largest iteration space of a statement (the product
# of its axes' sizes): 2^63 - 1, the int64 index space. NumPy cannot allocate an array of more
# elements and the generated kernels index with 64-bit integers, so nothing larger can run on
# any machine; it is also some 10^8 times the memory of the largest device (an H200 holds
# 141 GB), so no real problem is refused. Bounding every statement's iteration space keeps
# every count the cost model derives from it (elements, bytes, FLOPs, transfers: sums over a
# few arrays and statements of such products times a few bytes per value or operations per
# element) below about 2^100, far inside float64 (2^1024) and far below Python's 4300-digit
# limit on printing integers. Without the bound, sizes like 10^400 overflowed float64 in the
# cost table, the time prediction and the L2 grouping, and 10^5000 could not be printed.
MAX_SIZE = 2**63 - 1
MAX_SIZE_TEXT = "2^63 - 1 (about 9.2e18, the int64 index space)"


def approximate(value: int) -> str:
    """An integer for a message: exact with separators up to 15 digits, else like 1.00e+400
    (a 5000-digit number printed in full helps nobody, and Python refuses to print some)."""
    if value < 10**15:
        return f"{value:,}"
    return format(decimal.Decimal(value), ".2e")


def size_error(name: str, value: int, span: Span | None = None, what: str = "size") -> NapkinTypeError | None:
    """The error for a size above MAX_SIZE, naming it; None for a size napkin takes."""
    if value <= MAX_SIZE:
        return None
    return NapkinTypeError(f"{what} {name} = {approximate(value)} is larger than napkin takes: at most {MAX_SIZE_TEXT}",
                           span, "no machine indexes more elements; use a realistic size")


def check_size(name: str, value: int, span: Span | None = None, what: str = "size") -> None:
    """Refuse a size above MAX_SIZE, naming it."""
    error = size_error(name, value, span, what)
    if error is not None:
        raise error


def check_sizes(sizes: dict) -> dict:
    """A copy of bound sizes ({name: int}), each a positive integer no larger than MAX_SIZE."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise NapkinError(f"size {name}={value!r:.60} must be a positive integer", hint=f"e.g. {name}=1024")
        check_size(name, value)
    return dict(sizes)


def check_size_bounds(diagram: Diagram, block: syn.RelabelBlock | None, sizes: dict) -> None:
    """Refuse bound sizes, partition sizes and statement iteration spaces above MAX_SIZE.

    An axis counts with its size where it is bound (a larger partition is clipped to it), else
    with its largest partition size (a tile of an unbound axis keeps the partition's size).
    """
    errors = [size_error(name, value) for name, value in sizes.items() if isinstance(value, int)]
    magnitude = {axis: sizes[axis] for axis in diagram.axes if isinstance(sizes.get(axis), int)}
    for clauses in (block.levels if block is not None else ()):
        for p in clauses.partitions:
            size = p.size if isinstance(p.size, int) else sizes.get(p.size)
            if isinstance(size, int):
                if isinstance(p.size, int):  # a bound symbol was checked with the sizes above
                    errors.append(size_error(p.axis, size, p.span, f"{p.kind} size of"))
                if not isinstance(sizes.get(p.axis), int):
                    magnitude[p.axis] = max(magnitude.get(p.axis, 1), size)
    errors = [error for error in errors if error is not None]
    if errors:
        raise_collected(errors)  # the products below would only repeat them
    for s in diagram.statements:
        axes = tuple(dict.fromkeys(tuple(s.axes) + tuple(s.consumed)))
        if math.prod(magnitude.get(a, 1) for a in axes) > MAX_SIZE:
            shown = " * ".join(f"{a}={approximate(magnitude[a])}" for a in axes if a in magnitude)
            errors.append(NapkinTypeError(
                f"statement {s.target} iterates over {shown} = {approximate(math.prod(magnitude.get(a, 1) for a in axes))} "
                f"elements, more than napkin takes: at most {MAX_SIZE_TEXT}",
                s.span, "no machine indexes more elements; use realistic sizes"))
    raise_collected(errors)
