"""The table of box kinds: what each kind of box computes, streams as and reduces with.

One entry per kind of box (:data:`BOX_KINDS`, keyed by the diagram's box classes) says in one
place:

* **its work**, unstreamed (one ``compute`` step, and a contraction's ``scale`` step) and
  streamed, step by step (``init``, ``accumulate``, ``rescale``, ``online``, ``finalise``), per
  element of a named space of its statement (:class:`Work`). ``check.py`` totals the unstreamed
  work over a statement, ``pseudocode.py`` puts each step's work on the Program's steps and
  ``cost.py`` reads it off them;
* **its role in the fusion theorem** when a stream partition passes along an axis it consumes
  (:meth:`BoxKind.stream_role`): an accumulator, the online softmax, the contraction it
  rescales, the log-sum-exp read off a softmax's state, or a refusal that says why.
  ``relabel.py`` classifies the statements of a stream with it;
* for a reduction, **what it reduces with** (:data:`REDUCTION_TABLE`): the running result's
  first value, the elementwise function that folds a value into it, and whether it divides by
  the count. The reference evaluator, the NumPy backend and the printers build their reductions
  from these, each in its own vocabulary (NumPy ufuncs, C expressions), so a new reduction is
  one entry here: the names a kernel may call (:data:`REDUCTION_OPS`) are read off the table.

Deliberately not here: the diagram's data types (``diagram.py``, which this module reads), the
elementwise functions a kernel calls by name (their own table, ``elementwise.py``: arity, unit,
definitions, C spellings, derivatives), and the legality of a stream beyond one statement's own conditions
(the order of statements, which arrays carry the axis: ``relabel.stream_roles``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import algebra
from .diagram import Contract, Diagram, Map, Opaque, Reduce, Scan, Softmax, Statement, count_operations
from .errors import RelabelError, Span

# ---- reductions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reduction:
    """What a reduction computes, in every backend.

    ``start``: the running result's first value, the identity of ``combine`` (what a row of no
    values reduces to). ``combine``: the elementwise function (an ``Apply.fn`` of the notation,
    so every backend already knows how to evaluate or print it) that folds one value into the
    running result; None for the log-sum-exp, whose stable form (the maximum first, then the sum
    of exps) every backend writes out. ``divides``: the result is then divided by the number of
    values reduced (a mean)."""

    op: str
    start: float
    combine: str | None
    divides: bool = False

    @property
    def start_text(self) -> str:
        """``start`` as the pseudocode prints it: 0, -inf, +inf or the number."""
        if math.isinf(self.start):
            return "-inf" if self.start < 0 else "+inf"
        return f"{self.start:g}"


# lse[x](S) = log(sum[x](exp(S))), the log-sum-exp a FlashAttention backward reads (computed
# stably: the maximum subtracted first; -inf when every entry is -inf).
REDUCTION_TABLE: dict[str, Reduction] = {r.op: r for r in (
    Reduction("sum", 0.0, "add"),
    Reduction("mean", 0.0, "add", divides=True),
    Reduction("max", -math.inf, "max"),
    Reduction("min", math.inf, "min"),
    Reduction("lse", -math.inf, None),
)}
# The reductions a statement may call, by name, to the operation it computes (Reduce.op): each
# op under its own name, and a second name for one is one entry here.
REDUCTION_OPS: dict[str, str] = {op: op for op in REDUCTION_TABLE} | {"logsumexp": "lse"}


def reduction(op: str) -> Reduction:
    """The table's entry for ``Reduce.op`` (a contraction's running sum is ``sum``)."""
    try:
        return REDUCTION_TABLE[op]
    except KeyError:
        raise NotImplementedError(f"no entry in the table of reductions for {op!r}") from None


def accumulated(box) -> Reduction:
    """What a box's streamed accumulator reduces with: its reduction, or a running sum (a contraction)."""
    return reduction(box.op) if isinstance(box, Reduce) else REDUCTION_TABLE["sum"]


# ---- streams: each kind's role in the fusion theorem --------------------------------------------


def line_of(statement: Statement) -> str:
    """Where a statement is, for messages: its line, else its position."""
    return f"line {statement.span.line}" if statement.span else f"statement {statement.index + 1}"


@dataclass(frozen=True)
class StreamSite:
    """What a box consuming the streamed axis may ask of its stream (``relabel.stream_roles``):
    the axis, the launch's statements in order, the roles given so far, who reads each array,
    and the arrays the launch saves."""

    axis: str
    span: Span | None
    diagram: Diagram
    statements: tuple
    roles: dict  # statement index -> role, for the statements before this one
    consumers: dict  # array -> the statements of the launch that read it
    outputs: tuple


# ---- work: the operations of each step ------------------------------------------------------

@dataclass(frozen=True)
class Work:
    """Operations of one step of a box, by compute unit, per element of ``space``.

    ``counts``: (unit, operations) with units "tensor", "fma", "special" or "opaque" (a symbol).
    ``bookkeeping``: work of the streamed form beyond the unstreamed algorithm (negative where the
    streamed form does less)."""

    step: str
    space: str  # "elements" (the statement's iteration space), "outputs" (its target's axes), "woven" (see work_axes)
    counts: tuple
    bookkeeping: bool = False


def _work(step: str, space: str, bookkeeping: bool = False, **units) -> Work:
    return Work(step, space, tuple((unit, n) for unit, n in units.items() if n), bookkeeping)


class BoxKind:
    """A kind of box: its name (``Box.kind``) and the work of its steps."""

    name = ""

    def flops(self, box) -> tuple[Work, ...]:
        """The unstreamed box: its ``compute`` step (and a contraction's ``scale`` step)."""
        raise NotImplementedError(f"the FLOPs of a {self.name} box")

    def streamed(self, box, role: str) -> tuple[Work, ...]:
        """The box in a stream, in ``role`` (relabel.stream_roles), one Work per step and space."""
        raise NotImplementedError(f"the FLOPs of a {self.name} box streamed as {role!r}")

    def stream_role(self, s: Statement, site: StreamSite) -> tuple[str, int | None]:
        """Statement ``s``'s role when the stream over ``site.axis``, an axis it consumes, passes
        through it, and the statement whose state it reads (or None); raises RelabelError when
        the fusion theorem gives it none."""
        raise NotImplementedError(f"the role of a {self.name} box in a stream")


class ContractKind(BoxKind):
    name = "contract"

    def flops(self, box) -> tuple[Work, ...]:
        # A k-contraction costs 2k per output: 2 per element of the iteration space. Its factor
        # is a step of its own, per output: one multiplication, and the factor's own operations
        # where it multiplies arrays (sV[b h] * d^-0.5: 2; a number alone is folded).
        return (_work("compute", "elements", tensor=2),) + self.scale(box)

    @staticmethod
    def scale(box) -> tuple[Work, ...]:
        if box.scale is None:
            return ()
        own = count_operations(box.scale)
        return (_work("scale", "outputs", fma=1 + own["fma"], special=own["special"]),)

    def streamed(self, box, role: str) -> tuple[Work, ...]:
        product = _work("accumulate", "elements", tensor=2)
        if role == "accumulate":
            return (product,) + self.scale(box)
        if role == "rescaled":
            # Consuming an online softmax: the running sum is rescaled once per chunk, and the
            # output divided by the softmax's sum once at the end (the unstreamed softmax divides
            # every entry instead: see SoftmaxKind).
            return (_work("rescale", "outputs", True, fma=1), product, _work("finalise", "outputs", True, fma=1)) + self.scale(box)
        return super().streamed(box, role)

    def stream_role(self, s: Statement, site: StreamSite) -> tuple[str, int | None]:
        # A running sum over the chunks; one that consumes an online softmax is rescaled by it.
        online = next((p for p in map(site.diagram.producer, s.inputs) if p is not None and site.roles.get(p.index) == "online"), None)
        return ("rescaled", online.index) if online is not None else ("accumulate", None)


class MapKind(BoxKind):
    name = "map"

    def flops(self, box) -> tuple[Work, ...]:
        return (_work("compute", "elements", **count_operations(box.expr)),)

    def stream_role(self, s: Statement, site: StreamSite) -> tuple[str, int | None]:  # pragma: no cover - maps consume nothing
        raise AssertionError("napkin bug: a map consumed an axis")


class ReduceKind(BoxKind):
    name = "reduce"

    def flops(self, box) -> tuple[Work, ...]:
        counts = count_operations(box.operand)
        if reduction(box.op).combine is None:  # the log-sum-exp,
            # computed stably: per element the max, subtract it, exp, sum; per output the log, plus the max
            return (_work("compute", "elements", fma=counts["fma"] + 3, special=counts["special"] + 1),
                    _work("compute", "outputs", fma=1, special=1))
        # each element combined once into its result (which starts at the reduction's start); a
        # mean then divides each result
        work = (_work("compute", "elements", fma=counts["fma"] + 1, special=counts["special"]),)
        return work + ((_work("compute", "outputs", fma=1),) if reduction(box.op).divides else ())

    def streamed(self, box, role: str) -> tuple[Work, ...]:
        counts = count_operations(box.operand)
        if role == "accumulate" and reduction(box.op).combine is not None:
            # each chunk reduced (from the reduction's start), then combined with the running
            # result, once per output and chunk; a mean divides at the end
            work = (_work("accumulate", "elements", fma=counts["fma"] + 1, special=counts["special"]),
                    _work("accumulate", "outputs", True, fma=1))
            return work + ((_work("finalise", "outputs", fma=1),) if reduction(box.op).divides else ())
        if role == "lse":
            # log-sum-exp read off a streamed softmax of the same operand: its max plus the log of
            # its sum, per output, in place of the unstreamed lse's work (the max, exp and sum per
            # element are the softmax's, not done again)
            unstreamed = tuple(Work("finalise", w.space, w.counts) for w in self.flops(box))
            saved = tuple(Work("finalise", w.space, tuple((unit, -n) for unit, n in w.counts), True) for w in unstreamed)
            return unstreamed + (_work("finalise", "outputs", True, fma=1, special=1),) + saved
        return super().streamed(box, role)

    def stream_role(self, s: Statement, site: StreamSite) -> tuple[str, int | None]:
        box = s.box
        if reduction(box.op).combine is not None:
            return "accumulate", None  # a running result, combined chunk by chunk
        # The log-sum-exp is the online softmax's state after the stream: its running max plus
        # the log of its running sum (read in the finalise step, no state of its own).
        axis = site.axis
        source = next((p for p in site.statements if site.roles.get(p.index) == "online" and p.box.operand == box.operand
                       and set(p.woven) == set(s.axes)), None)
        if source is None or box.axes != (axis,):
            raise RelabelError(
                f"cannot stream {axis}: lse[{' '.join(box.axes)}] ({line_of(s)}) streams only as the state of a softmax[{axis}] "
                f"of the same operand in this launch, computed before it",
                s.span or site.span, f"write P = softmax[{axis}](...) of the same operand above it (and contract P), "
                                     f"or leave {axis} unpartitioned")
        return "lse", source.index


class SoftmaxKind(BoxKind):
    name = "softmax"

    def flops(self, box) -> tuple[Work, ...]:
        # Per element: the operand, running max, subtract, exp, sum, divide.
        counts = count_operations(box.operand)
        return (_work("compute", "elements", fma=counts["fma"] + 4, special=counts["special"] + 1),)

    def streamed(self, box, role: str) -> tuple[Work, ...]:
        if role != "online":
            return super().streamed(box, role)
        counts = count_operations(box.operand)
        return (
            # rescale: the operand for the chunk's max, per element; per row, the new max, the
            # factor exp(old - new)
            _work("rescale", "elements", fma=counts["fma"] + 1, special=counts["special"]),
            _work("rescale", "woven", True, fma=2, special=1),
            # online: the rest of the unstreamed softmax's work per element (subtract, exp, sum,
            # divide); but every backend evaluates the operand again here (it keeps no chunk of
            # it), and divides no entry by the sum (the contraction divides its output instead);
            # per row, sum = sum * factor + chunk sum
            _work("online", "elements", fma=3, special=1),
            _work("online", "elements", True, fma=counts["fma"] - 1, special=counts["special"]),
            _work("online", "woven", True, fma=2),
        )

    def stream_role(self, s: Statement, site: StreamSite) -> tuple[str, int | None]:
        """The online softmax: streams only when contractions over the axis consume it, keep its
        rows apart and are linear in it (each reads it once)."""
        axis = site.axis
        users = site.consumers[s.target]
        ok_users = users and all(isinstance(u.box, Contract) and axis in u.consumed for u in users)
        if s.target in site.outputs or not ok_users:
            where = f"it is saved to the top level as {s.target}[{' '.join(s.axes)}]" if s.target in site.outputs else (
                f"{', '.join(u.target for u in users) or 'nothing'} uses it" + (" without contracting over it" if users else ""))
            raise RelabelError(
                f"cannot stream {axis}: softmax[{axis}] ({line_of(s)}) keeps axis {axis!r} in its output and {where}; "
                f"softmax streams only when a contraction over {axis!r} consumes it (the online softmax)",
                s.span or site.span, f"fuse the contraction over {axis} into this launch (drop the @level), leave {axis} unpartitioned, "
                                     f"or stream it only where it can: '... for TARGET: stream {axis} SIZE'",
            )
        # The running max and sum are per row (the softmax's woven axes): a contraction's
        # accumulator is rescaled and divided row by row, so it must keep every row apart.
        # One that also sums over a woven axis mixes rows whose maxima differ.
        for u in users:
            mixed = [a for a in s.woven if a not in u.axes]
            if mixed:
                raise RelabelError(
                    f"cannot stream {axis}: {u.target}[{' '.join(u.axes)}] ({line_of(u)}) contracts softmax[{axis}] "
                    f"{s.target} ({line_of(s)}) over {' '.join(mixed)} as well as {axis}; the online softmax rescales "
                    f"and normalises per row of {s.target} ({' '.join(s.woven)}), so the contraction must keep "
                    f"{'that axis' if len(mixed) == 1 else 'those axes'} in its result",
                    u.span or site.span, f"leave {axis} unpartitioned, or compute {u.target} in two steps: "
                                         f"keep {' '.join(mixed)} in a first contraction, then sum over {' '.join(mixed)}",
                )
        # The accumulator is rescaled by exp(m - m') once per chunk: that is right for a
        # product linear in the softmax, not for one that reads it twice (P * P scales by the
        # square). Found by the fuzzer (ran wrong on NumPy and OpenCL).
        for u in users:
            reads = [r for r in u.box.operands if r.array == s.target]
            if len(reads) > 1:
                raise RelabelError(
                    f"cannot stream {axis}: {u.target}[{' '.join(u.axes)}] ({line_of(u)}) reads softmax[{axis}] {s.target} "
                    f"({line_of(s)}) {len(reads)} times; the online softmax rescales a contraction that is linear in it",
                    u.span or site.span, f"leave {axis} unpartitioned, or materialise {s.target} (@gmem) and contract it after",
                )
        return "online", None


class ScanKind(BoxKind):
    name = "scan"

    def flops(self, box) -> tuple[Work, ...]:
        # Per element: the operand, then one add (or multiply) into the running value.
        counts = count_operations(box.operand)
        return (_work("compute", "elements", fma=counts["fma"] + 1, special=counts["special"]),)

    def streamed(self, box, role: str) -> tuple[Work, ...]:
        if role != "scan":
            return super().streamed(box, role)
        # A chunk's scan starts from the carry, the running value the chunk before it ended on:
        # the same work per element as the unstreamed scan, and none beside it.
        return self.flops(box)

    def stream_role(self, s: Statement, site: StreamSite) -> tuple[str, int | None]:
        # The running value carried from chunk to chunk, per row: each chunk's scan starts from
        # it, and its last element is the next chunk's carry. Its output carries the axis, chunk by chunk.
        return "scan", None


# What a scan starts from and folds each value in with (an elementwise function, as REDUCTION_TABLE's).
SCAN_FOLDS = {"sum": (0.0, "add"), "prod": (1.0, "mul")}


class OpaqueKind(BoxKind):
    name = "opaque"

    def flops(self, box) -> tuple[Work, ...]:
        # Declared by signature only: its FLOPs are a symbol per copy woven over it.
        return (Work("compute", "woven", (("opaque", opaque_flops(box)),)),)

    def stream_role(self, s: Statement, site: StreamSite) -> tuple[str, int | None]:
        raise RelabelError(
            f"cannot stream {site.axis}: box {s.box.box.name} ({line_of(s)}) consumes {site.axis!r} and napkin knows no accumulator for it",
            s.span or site.span, "only sums, contractions, max/min and softmax followed by a contraction stream",
        )


def opaque_flops(box) -> algebra.Symbol:
    return algebra.Symbol(f"flops_{box.box.name}", positive=True)


BOX_KINDS: dict[type, BoxKind] = {
    Contract: ContractKind(), Map: MapKind(), Reduce: ReduceKind(), Softmax: SoftmaxKind(), Scan: ScanKind(),
    Opaque: OpaqueKind(),
}


def box_kind(box) -> BoxKind:
    try:
        return BOX_KINDS[type(box)]
    except KeyError:
        raise NotImplementedError(f"no entry in the table of box kinds for {type(box).__name__}") from None


def work_axes(statement: "Statement", space: str) -> tuple[str, ...]:
    """The axes of one of a statement's spaces: its iteration space (target axes, then the axes
    it consumes), its target's axes, or the axes woven over it (a softmax's rows, an opaque
    box's copies)."""
    if space == "elements":
        return statement.iteration_axes
    if space == "outputs":
        return statement.axes
    if space == "woven":
        return statement.woven
    raise NotImplementedError(f"the space {space!r} of a statement's work")


def statement_flops(work: tuple[Work, ...], size) -> dict:
    """Total operations by unit of ``work`` over a statement, ``size(space)`` giving the elements of a space."""
    totals: dict = {}
    for item in work:
        for unit, n in item.counts:
            totals[unit] = totals.get(unit, 0) + n * size(item.space)
    return {unit: total for unit, total in totals.items() if total != 0}


