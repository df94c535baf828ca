"""Elaboration: a :class:`~napkin_dsl.relabel.Schedule` -> the paper's looped pseudocode.

The :class:`Program` is the single source of truth for costs and execution. Per launch it is
a tree of loops and steps:

* a parallel ``group`` loop per grouped axis at each level (one core per group),
* a sequential ``stream`` loop at the compute level (head/init before it, accumulators in
  it, finalise after it),
* steps: ``load``/``save`` transfers between adjacent levels, ``alloc`` of output tiles at
  intermediate levels, ``init`` of accumulators, ``compute`` (one box on a tile),
  ``online`` (softmax chunk with running max and sum), ``rescale`` (of the running state),
  ``accumulate`` (a running sum/max/min or contraction), ``finalise``.

Every step names the buffers it reads and writes at each level and the axes it spans, so
the paper's **columns** (arrays resident per level at each step) follow by a liveness walk:
an operation's inputs that nothing later uses are released as it produces its output, and
state loaded or initialised before a loop stays resident through it.

Loads are placed just before their first use and hoisted out of a stream loop when the
array does not carry the streamed axis.

A stream loop over the axis of a masked softmax (``softmax[x](where(COND, S, -inf))``, or of
an array computed so) carries a :class:`Mask`: COND as linear inequalities in axis indices,
which decide per group tile and chunk whether the chunk is visited at all, tested, or taken
whole (see "masks" below). The loop's trips are then the visited chunks of each group: cost
and backends enumerate them with :func:`mask_visits` and :meth:`Mask.status`.

Each step carries its FLOPs per element of its space, as the table of box kinds
(``boxes.BOX_KINDS``) gives them for that step, with the streamed form's own work (its
bookkeeping) apart. This module does not price anything (``cost.py`` reads prices off the
Program) and does not execute anything (``backends/``). Renderers for text and Markdown are at
the end.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass, field

from . import algebra
from .boxes import accumulated, box_kind, reduction, work_axes
from .diagram import (
    Apply,
    Const,
    Contract,
    Index,
    Map,
    Read,
    Reduce,
    Scan,
    Softmax,
    Statement,
    accumulation_dtype,
    count_operations,
    format_expression,
    reads,
    size_text,
)
from .relabel import Launch, Partition, Schedule, bind, part_axis, smaller, split_of, summed_over_groups, trips

# ---- the Program ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Buffer:
    """An array (or a piece of streaming state) resident at one level, with its tile axes."""

    name: str
    level: str
    axes: tuple[str, ...]
    dtype: str


# Every kind of step a Program holds. A Step of any other kind cannot be made, and every
# backend has a handler for each (tests/test_steps.py), so no consumer meets an unknown one.
STEP_KINDS = ("load", "save", "alloc", "init", "compute", "online", "rescale", "accumulate", "finalise", "merge")


# An add into device memory moves its tile three times there: the launcher's zeroing write, the
# fetch of the line the first add reads (L2 adds in place, and holds no line of an output far
# larger than it), and the sum written back. Each add between is L2's, on chip.
ADDED_PASSES = 3


@dataclass(frozen=True)
class Step:
    op: str  # one of STEP_KINDS
    level: str
    axes: tuple[str, ...]  # axes the step spans: the array moved, or the iteration space
    reads: tuple[tuple[str, str], ...] = ()  # (level, buffer name)
    writes: tuple[tuple[str, str], ...] = ()
    array: str | None = None  # the array moved or computed
    source: str | None = None  # transfers: from this level ...
    dest: str | None = None  # ... to this one
    dtype: str | None = None  # transfers: dtype of the values moved; compute: dtype computed in
    flops: tuple[tuple[str, int], ...] = ()  # (unit, operations per element of `flop_space`)
    statement: Statement | None = field(default=None, compare=False)
    text: str = ""
    flop_axes: tuple[str, ...] | None = None  # where FLOPs are counted, when not over `axes`
    # A masked softmax's test (its where-predicate and the select), per element, counted only
    # on the chunks its mask leaves partially masked (Mask.status); `flops` leaves it out.
    test_flops: tuple[tuple[str, int], ...] = ()
    # The streamed form's own work (boxes.Work.bookkeeping), apart from `flops`: (unit,
    # operations per element of axes, axes), negative where the streamed form does less.
    bookkeeping: tuple[tuple[str, object, tuple[str, ...]], ...] = ()
    # The step's other work, over other axes than `flop_space` (a mean's division per output):
    # (unit, operations per element of axes, axes).
    flops_over: tuple[tuple[str, object, tuple[str, ...]], ...] = ()
    # The online softmax whose state this step reads (a rescaled contraction's rescale and
    # finalise, a log-sum-exp's finalise): its target, from the stream's roles (relabel.StreamRoles).
    online: str | None = None
    # A save that adds its tile into the destination, and an alloc that zeroes it: the partial
    # sums of a contraction over the groups of an axis it consumes (relabel.summed_over_groups),
    # which every group adds into the output (atomically, on a GPU).
    add: bool = False
    # Times a transfer moves its tile (the model and the backends count each): an add into the
    # top level, ADDED_PASSES; every other transfer, once.
    passes: int = 1

    def __post_init__(self):
        if self.op not in STEP_KINDS:
            raise ValueError(f"napkin bug: a step of unknown kind {self.op!r} (kinds: {', '.join(STEP_KINDS)})")

    def __repr__(self) -> str:
        # The op and its pseudocode line; the dataclass repr spelled out the whole statement.
        what = f" {self.array}" if self.array else ""
        return f"<Step {self.op}{what} at {self.level}{': ' + self.text if self.text else ''}>"

    @property
    def flop_space(self) -> tuple[str, ...]:
        """The axes FLOPs are counted over: an opaque box's cost is per woven copy, not per element."""
        return self.flop_axes if self.flop_axes is not None else self.axes


@dataclass(frozen=True)
class Loop:
    kind: str  # "group" (parallel) or "stream" (sequential)
    level: str
    axis: str
    tile: algebra.Expr
    trips: algebra.Expr
    body: tuple
    derived: bool = False
    mask: "Mask | None" = None  # a stream loop that skips the chunks a softmax's mask hides
    # A split's parallel loop over the parts of `axis` also numbers them along this axis (`x#`),
    # which the parts' saved states carry.
    part: str | None = None

    def __repr__(self) -> str:
        # Not the body: a Loop's repr held every loop and step nested in it.
        n = sum(1 for _ in walk(self.body))
        return (f"<Loop {self.kind} {self.axis}{' split' if self.part else ''} at {self.level}: tile {self.tile}, {self.trips} trips"
                f"{', masked' if self.mask is not None else ''}{', derived' if self.derived else ''}; {n} steps inside>")


@dataclass(frozen=True)
class LaunchProgram:
    index: int
    launch: Launch
    body: tuple
    buffers: dict  # (level, name) -> Buffer
    schedule: Schedule | None = None  # the schedule as this launch sees it (scoped partitions)
    combine: str | None = None  # the split axis whose parts this launch merges (relabel "split")

    def __repr__(self) -> str:
        return f"<LaunchProgram {self.index}: {' '.join(s.target for s in self.launch.statements)}; {_steps(self.body)}>"


@dataclass(frozen=True)
class Program:
    schedule: Schedule
    launches: tuple[LaunchProgram, ...]

    @property
    def diagram(self):
        return self.schedule.diagram

    @property
    def hardware(self):
        return self.schedule.hardware

    @property
    def levels(self) -> tuple[str, ...]:
        return self.schedule.levels

    def __repr__(self) -> str:
        # Short (issue 26): the dataclass repr of a Program of attention was 36,131 characters.
        # The pseudocode itself is kernel.pseudocode() or render_text(program).
        summary = self.schedule.summary([launch.launch for launch in self.launches])
        return f"<Program {summary}; {_steps(b for launch in self.launches for b in launch.body)}>"


def split_loop(launch: LaunchProgram) -> Loop | None:
    """The parallel loop over the parts of a split axis in a split's parts launch, or None."""
    def find(nodes):
        for node in nodes:
            if isinstance(node, Loop):
                if node.part is not None:
                    return node
                found = find(node.body)
                if found is not None:
                    return found
        return None

    return find(launch.body)


def _steps(body) -> str:
    """How many steps a body holds, and how many of them move data (loads and saves)."""
    steps = [step for step, _ in walk(body)]
    moves = sum(step.op in ("load", "save") for step in steps)
    return f"{len(steps)} steps, {moves} loads and saves"


def walk(nodes, loops=()):
    """Yield (step, enclosing loops outermost first) in program order."""
    for node in nodes:
        if isinstance(node, Loop):
            yield from walk(node.body, loops + (node,))
        else:
            yield node, loops


def compute_dtype(diagram, statement: Statement) -> str:
    """The dtype a statement computes in, and keeps its streaming state in (running max, sum,
    accumulator, the online softmax's chunk): f64 when an operand is f64, else f32 (bf16, f16
    and fp8 accumulate in f32, as tensor cores do). Decided here once; every backend reads it
    off the Program's steps and buffers."""
    return accumulation_dtype(diagram.arrays[n].dtype for n in statement.inputs) if statement.inputs else "f32"


def liveness(body) -> tuple[list, dict]:
    """Program-order steps and, per buffer, (first write, last use) with loop-carried extension."""
    sequence = list(walk(body))
    spans: dict = {}
    for index, (step, _) in enumerate(sequence):
        for ref in step.writes:
            first, last = spans.get(ref, (index, index))
            spans[ref] = (min(first, index), max(last, index))
        for ref in step.reads:
            first, last = spans.get(ref, (index, index))
            spans[ref] = (first, max(last, index))
    # A buffer defined before a loop and used inside it stays resident until the loop ends.
    loop_ranges: dict[int, tuple[int, int]] = {}
    for index, (_, loops) in enumerate(sequence):
        for loop in loops:
            start, end = loop_ranges.get(id(loop), (index, index))
            loop_ranges[id(loop)] = (min(start, index), max(end, index))
    for step, loops in sequence:
        for ref in step.reads + step.writes:
            first, last = spans[ref]
            for loop in loops:
                start, end = loop_ranges[id(loop)]
                if first < start:
                    last = max(last, end)
            spans[ref] = (first, last)
    return sequence, spans


def released_by(sequence: list, spans: dict, ref, index: int) -> bool:
    """Is buffer ``ref`` released as step ``index`` produces its output (the paper's column
    convention)? Only when that computing step is its last reader, and no later trip of a loop
    around the step reads it again: a buffer defined outside a loop and read by the loop's last
    step is needed by the next trip (found by the fuzzer: an intermediate took a hoisted input's
    bytes and the next chunk read garbage)."""
    step, loops = sequence[index]
    last = spans[ref][1]
    if step.op in ("load", "save", "alloc") or ref not in step.reads or ref in step.writes or last != index:
        return False
    if step.statement is not None and isinstance(step.statement.box, Scan):
        return False  # a scan reads its operand's row while writing its target's: both are held
    defined_in = {id(lp) for lp in sequence[spans[ref][0]][1]}
    return all(id(lp) in defined_in for lp in loops)


# ---- elaboration ---------------------------------------------------------------------------


class _LaunchElaborator:
    """One launch's loops and steps. With a split (``relabel.split_of``) it elaborates one of
    two launches: ``combine=False``, the parts, each streaming its range of the axis and saving
    its accumulators' states to the top level along the part axis; ``combine=True``, the merge,
    which loads those states part by part, merges them, finalises and runs what comes after."""

    def __init__(self, schedule: Schedule, launch: Launch, combine: bool = False):
        self.schedule = schedule
        self.launch = launch
        self.diagram = schedule.diagram
        self.levels = schedule.levels
        self.buffers: dict = {}
        self.launch_axes = set(launch.axes)
        self.cut = split_of(schedule, launch) if not combine else None
        self.combine = combine
        self.inputs, self.outputs = list(launch.inputs), list(launch.outputs)
        self.states: list = []  # (statement, state buffer, its axes): what the parts save, the combine merges
        self.summed = summed_over_groups(schedule, launch)  # target -> the grouped axes it sums over
        self.extra: dict = {}  # a part array (`O.acc.part`) -> (axes, dtype), as diagram.arrays holds the others
        if self.cut is not None or combine:
            self.split_arrays()

    def split_arrays(self):
        """The part arrays of a split launch, and which inputs and outputs the parts and the
        combine each have."""
        stream = self.launch.streams[0]
        roles = stream.roles
        part = part_axis(stream.axis)
        for s in self.launch.statements:
            role, dtype = roles[s.index], compute_dtype(self.diagram, s)
            names = {"accumulate": [("acc", s.axes)], "rescaled": [("acc", s.axes)],
                     "online": [("max", s.woven), ("sum", s.woven)]}.get(role, [])
            for suffix, axes in names:
                state = f"{s.target}.{suffix}"
                self.states.append((s, state, tuple(axes)))
                self.extra[f"{state}.part"] = ((part,) + tuple(axes), dtype)
        post = [s for s in self.launch.statements if roles[s.index] == "post"]
        merged = [s for s in self.launch.statements if roles[s.index] in ("accumulate", "rescaled", "online", "lse")]
        late = {s.target for s in post + merged}
        # A merged contraction's factor (sV[b h] in O = P * V * sV) scales the finalised output,
        # which the combine computes: the combine reads it, the parts do not.
        factors = {s.index: _factor_arrays(s) for s in merged}
        read_late = {n for s in post for n in s.inputs} | {n for names in factors.values() for n in names}
        read_early = {n for s in self.launch.statements if s not in post for n in s.inputs
                      if n not in factors.get(s.index, ()) or n in _product_arrays(s)}
        if self.combine:
            self.inputs = list(self.extra) + [n for n in self.launch.inputs if n in read_late]
            self.outputs = [n for n in self.launch.outputs if n in late]
        else:
            self.inputs = [n for n in self.launch.inputs if n in read_early]
            self.outputs = [n for n in self.launch.outputs if n not in late] + list(self.extra)

    def buffer(self, name: str, level: str, axes, dtype: str) -> tuple[str, str]:
        self.buffers[(level, name)] = Buffer(name, level, tuple(axes), dtype)
        return (level, name)

    def run(self) -> tuple:
        return tuple(self.level_body(1))

    # -- levels
    def wrap_groups(self, level_index: int, body: list) -> list:
        level = self.levels[level_index]
        parent = self.levels[level_index - 1]
        if self.cut is not None and self.cut.level == level:
            # the parts run in parallel like groups, each on its own range of the axis
            outer = self.schedule.extent(self.cut.axis, parent)
            tile = self.part_size()
            body = [Loop("group", level, self.cut.axis, tile, trips(outer, tile), tuple(body), part=part_axis(self.cut.axis))]
        groups = [p for p in self.schedule.partitions_at(level, "group") if p.axis in self.launch_axes]
        for p in reversed(groups):
            tile = self.schedule.extent(p.axis, level)
            outer = self.schedule.extent(p.axis, parent)
            body = [Loop("group", level, p.axis, tile, trips(outer, tile), tuple(body), p.derived)]
        return body

    def part_size(self):
        return smaller(bind(self.cut.size, self.schedule.sizes), self.schedule.axis_size(self.cut.axis))

    def level_body(self, level_index: int) -> list:
        level = self.levels[level_index]
        parent = self.levels[level_index - 1]
        if level_index == len(self.levels) - 1:
            return self.wrap_groups(level_index, self.compute_body(level, parent))
        body = []
        for name in self.inputs:
            body.append(self.transfer("load", name, parent, level))
        for name in self.outputs:
            axes, dtype = self.array(name)
            ref = self.buffer(name, level, axes, dtype)
            summed = self.summed.get(name)
            body.append(Step("alloc", level, axes, writes=(ref,), array=name, dtype=dtype, add=summed is not None,
                             text=f"allocate {name} tile" + (", zeroed" if summed else "")))
        body += self.level_body(level_index + 1)
        for name in self.outputs:
            body.append(self.transfer("save", name, parent, level))
        return self.wrap_groups(level_index, body)

    def array(self, name: str) -> tuple[tuple[str, ...], str]:
        """An array's axes and dtype: the diagram's, or a split's part array's."""
        if name in self.extra:
            return self.extra[name]
        array = self.diagram.arrays[name]
        return tuple(array.axes), array.dtype

    def transfer(self, kind: str, name: str, upper: str, lower: str, held: str | None = None) -> Step:
        """A load of ``name`` from ``upper`` into ``lower``, or a save of it up; ``held``: the
        buffer a save reads, when it is not ``name`` (a part's state, saved as its part array)."""
        axes, dtype = self.array(name)
        if kind == "load":
            source, dest = upper, lower
            read = (upper, name)
            write = self.buffer(name, lower, axes, dtype)
            if upper == self.levels[0]:
                self.buffer(name, upper, axes, dtype)
        else:
            source, dest = lower, upper
            read = (lower, held or name)
            write = (upper, name)
            if upper == self.levels[0] or held is not None:
                self.buffer(name, upper, axes, dtype)
        summed = self.summed.get(name) if kind == "save" and held is None else None
        text = f"{kind} {held + ' as ' if held else ''}{name}[{' '.join(axes)}] {source} -> {dest}"
        passes = 1
        if summed:
            text = f"add {name}[{' '.join(axes)}] {source} -> {dest}  (each group of {' '.join(summed)} adds its partial sum)"
            if upper == self.levels[0]:
                passes = ADDED_PASSES
                text += f", x{passes}: zeroed, fetched, written back"
        return Step(kind, lower, axes, (read,), (write,), name, source, dest, dtype, text=text, add=summed is not None,
                    passes=passes)

    # -- the compute level
    def compute_body(self, level: str, parent: str) -> list:
        launch = self.launch
        resident: set[str] = set()
        saved: set[str] = set()
        steps: list = []

        chunk_resident: set[str] = set()  # chunks loaded in this iteration of the stream loop

        def load_inputs(statement: Statement, into: list, carrying: str | None = None, hoist_only=False, names=None):
            for name in statement.inputs if names is None else names:
                if name in resident or name in chunk_resident or name not in self.inputs:
                    continue
                has_axis = carrying is not None and carrying in self.diagram.arrays[name].axes
                if hoist_only and has_axis:
                    continue
                into.append(self.transfer("load", name, parent, level))
                (chunk_resident if has_axis else resident).add(name)

        def save_if_output(name: str, into: list):
            if name in self.outputs and name not in saved:
                into.append(self.transfer("save", name, parent, level))
                saved.add(name)

        stream = launch.streams[0] if launch.streams else None
        if stream is None:
            for s in launch.statements:
                load_inputs(s, steps)
                steps.append(self.compute(s, level))
                save_if_output(s.target, steps)
            return steps

        axis = stream.axis
        roles = stream.roles
        by_role = lambda *wanted: [s for s in launch.statements if roles[s.index] in wanted]  # noqa: E731
        if self.combine:
            return self.combine_body(level, parent, by_role, load_inputs, save_if_output)
        for s in by_role("pre"):
            load_inputs(s, steps)
            steps.append(self.compute(s, level))
            save_if_output(s.target, steps)
        streamed = by_role("body", "online", "accumulate", "rescaled", "lse", "scan")
        for s in streamed:  # hoist loads of arrays that do not carry the streamed axis
            load_inputs(s, steps, carrying=axis, hoist_only=True)
        for s in streamed:
            steps += self.init(s, roles[s.index], level, axis)
        loop_body: list = []
        for s in streamed:
            load_inputs(s, loop_body, carrying=axis)
            loop_body += self.streamed(s, roles[s.index], level, axis)
            if roles[s.index] in ("body", "scan"):  # saved chunk by chunk
                save_if_output(s.target, loop_body)
        tile = self.schedule.extent(axis, level)
        outer = self.schedule.extent(axis, parent) if self.cut is None else self.part_size()
        partition = next(p for p in self.schedule.partitions_at(level, "stream") if p.axis == axis)
        steps.append(Loop("stream", level, axis, tile, trips(outer, tile), tuple(loop_body), partition.derived))
        if self.cut is not None:
            # each part saves its accumulators' states, along the part axis, for the combine
            for s, state, _ in self.states:
                step = self.transfer("save", f"{state}.part", parent, level, held=state)
                steps.append(dataclasses.replace(step, statement=s))
            return steps
        for s in streamed:
            steps += self.finalise(s, roles[s.index], level, axis)
            if roles[s.index] not in ("body", "scan"):
                save_if_output(s.target, steps)
        for s in by_role("post"):
            load_inputs(s, steps)
            steps.append(self.compute(s, level))
            save_if_output(s.target, steps)
        return steps

    def combine_body(self, level: str, parent: str, by_role, load_inputs, save_if_output) -> list:
        """The combine launch at the compute level: the merged statements' states initialised,
        a loop over the parts (loading each part's states and merging them in), the finalise
        steps of the unsplit stream, then the statements that come after it."""
        axis = self.launch.streams[0].axis
        roles = self.launch.streams[0].roles
        part = part_axis(axis)
        merged = by_role("accumulate", "online", "rescaled", "lse")
        steps: list = []
        for s in merged:
            steps += self.init(s, roles[s.index], level, axis)
        loop_body: list = [self.transfer("load", name, parent, level) for name in self.extra]
        for s in merged:
            loop_body += self.merge(s, roles[s.index], level, part)
        tile = self.schedule.extent(part, level)
        steps.append(Loop("stream", level, part, tile, trips(self.schedule.extent(part, parent), tile), tuple(loop_body)))
        for s in merged:
            load_inputs(s, steps, names=_factor_arrays(s))  # what its scale step reads after the finalise
            steps += self.finalise(s, roles[s.index], level, axis)
            save_if_output(s.target, steps)
        for s in by_role("post"):
            load_inputs(s, steps)
            steps.append(self.compute(s, level))
            save_if_output(s.target, steps)
        return steps

    def merge(self, s: Statement, role: str, level: str, part: str) -> list:
        """One part's states merged into the running ones (DESIGN.md, "A split of a reduced axis"):
        a fold for sums, max and min; for the online softmax m' = max(m, m_p), each side's factor
        exp(m - m') and exp(m_p - m'), l = l a + l_p b; an output it rescales O = O a + O_p b."""
        dtype = compute_dtype(self.diagram, s)
        t = s.target
        if role == "accumulate":
            box = s.box
            fold = "add" if isinstance(box, Contract) or reduction(box.op).divides else reduction(box.op).combine
            acc = (level, f"{t}.acc")
            return [Step("merge", level, (part,) + s.axes, (acc, (level, f"{t}.acc.part")), (acc,), t, dtype=dtype,
                         statement=s, flops=(("fma", 1),), text=f"{t}.acc = {fold}({t}.acc, {t}.acc.part)")]
        if role == "online":
            m, l_ = (level, f"{t}.max"), (level, f"{t}.sum")
            scale = self.state(s, "scale", level, s.woven)
            scale_part = self.state(s, "scale.part", level, s.woven)  # the current part's factor, per row
            return [Step("merge", level, (part,) + s.woven, (m, l_, (level, f"{t}.max.part"), (level, f"{t}.sum.part")),
                         (m, l_, scale, scale_part), t, dtype=dtype, statement=s, flops=(("fma", 6), ("special", 2)),
                         text=f"m' = max({t}.max, {t}.max.part); {t}.scale = exp({t}.max - m'); "
                              f"{t}.scale.part = exp({t}.max.part - m'); {t}.sum = {t}.sum * {t}.scale + "
                              f"{t}.sum.part * {t}.scale.part; {t}.max = m'")]
        if role == "rescaled":
            online = self.online_source(s).target
            acc = (level, f"{t}.acc")
            return [Step("merge", level, (part,) + s.axes,
                         (acc, (level, f"{t}.acc.part"), (level, f"{online}.scale"), (level, f"{online}.scale.part")), (acc,), t,
                         dtype=dtype, statement=s, online=online, flops=(("fma", 3),),
                         text=f"{t}.acc = {t}.acc * {online}.scale + {t}.acc.part * {online}.scale.part")]
        return []  # lse: read off the merged softmax state when it is finalised

    def operand_refs(self, statement: Statement, level: str):
        """What a statement's computing step reads: its inputs; for a contraction, the operands of
        its product alone (the arrays of its factor are read by its ``scale`` step)."""
        if isinstance(statement.box, Contract):
            return tuple((level, name) for name in dict.fromkeys(r.array for r in statement.box.operands))
        return tuple((level, name) for name in statement.inputs)

    def compute(self, s: Statement, level: str, op: str = "compute") -> Step:
        dtype = compute_dtype(self.diagram, s)
        write = self.buffer(s.target, level, s.axes, dtype)
        return Step(op, level, s.iteration_axes, self.operand_refs(s, level), (write,), s.target, dtype=dtype,
                    statement=s, text=f"{s.target}[{' '.join(s.axes)}] = {_box_text(s)}",
                    **step_work(s, box_kind(s.box).flops(s.box), "compute"))

    def state(self, s: Statement, suffix: str, level: str, axes) -> tuple[str, str]:
        return self.buffer(f"{s.target}.{suffix}", level, axes, compute_dtype(self.diagram, s))

    def init(self, s: Statement, role: str, level: str, axis: str) -> list:
        box = s.box
        dtype = compute_dtype(self.diagram, s)  # the state and the chunk: f64 in, f64 state
        if role == "accumulate":
            acc = self.state(s, "acc", level, s.axes)
            start = accumulated(box).start_text
            return [Step("init", level, s.axes, (), (acc,), s.target, dtype=dtype, statement=s,
                         text=f"{s.target}.acc[{' '.join(s.axes)}] = {start}")]
        if role == "online":
            woven = s.woven
            m = self.state(s, "max", level, woven)
            l_ = self.state(s, "sum", level, woven)
            return [Step("init", level, woven, (), (m, l_), s.target, dtype=dtype, statement=s,
                         text=f"{s.target}.max[{' '.join(woven)}] = -inf; {s.target}.sum[{' '.join(woven)}] = 0")]
        if role == "rescaled":
            acc = self.state(s, "acc", level, s.axes)
            return [Step("init", level, s.axes, (), (acc,), s.target, dtype=dtype, statement=s,
                         text=f"{s.target}.acc[{' '.join(s.axes)}] = 0")]
        if role == "scan":
            carry = self.state(s, "carry", level, s.woven)
            start = "0" if box.op == "sum" else "1"
            return [Step("init", level, s.woven, (), (carry,), s.target, dtype=dtype, statement=s,
                         text=f"{s.target}.carry[{' '.join(s.woven)}] = {start}")]
        return []

    def streamed(self, s: Statement, role: str, level: str, axis: str) -> list:
        if role == "body":
            return [self.compute(s, level)]
        if role == "lse":
            return []  # the softmax's running max and sum, read after the stream (finalise)
        box = s.box
        dtype = compute_dtype(self.diagram, s)  # the state and the chunk: f64 in, f64 state
        operands = self.operand_refs(s, level)
        work = box_kind(box).streamed(box, role)
        if role == "accumulate":
            acc = (level, f"{s.target}.acc")
            if isinstance(box, Contract):
                text = f"{s.target}.acc += {_box_text(s)}"
            else:
                # a reduction that divides (a mean) accumulates the sum it divides at the end
                folded = "sum" if reduction(box.op).divides else box.op
                text = f"{s.target}.acc = {folded}({s.target}.acc, {folded}[{' '.join(box.axes)}]({_operand_text(s)}))"
            return [Step("accumulate", level, s.iteration_axes, operands + (acc,), (acc,), s.target, dtype=dtype,
                         statement=s, text=text, **step_work(s, work, "accumulate"))]
        if role == "online":
            m, l_ = (level, f"{s.target}.max"), (level, f"{s.target}.sum")
            scale = self.state(s, "scale", level, s.woven)
            chunk = self.buffer(s.target, level, s.axes, dtype)
            woven = " ".join(s.woven)
            return [
                Step("rescale", level, s.woven, operands + (m,), (m, scale), s.target, dtype=dtype,
                     statement=s, **step_work(s, work, "rescale"),
                     text=f"m' = max({s.target}.max, max[{axis}]({_operand_text(s)})); "
                          f"{s.target}.scale[{woven}] = exp({s.target}.max - m'); {s.target}.max = m'"),
                Step("online", level, s.axes, operands + (m, l_, scale), (chunk, l_), s.target, dtype=dtype,
                     statement=s, **step_work(s, work, "online"),
                     text=f"{s.target}[{' '.join(s.axes)}] = exp({_operand_text(s)} - {s.target}.max); "
                          f"{s.target}.sum = {s.target}.sum * {s.target}.scale + sum[{axis}]({s.target})"),
            ]
        if role == "scan":
            carry = (level, f"{s.target}.carry")
            chunk = self.buffer(s.target, level, s.axes, dtype)
            return [Step("compute", level, s.iteration_axes, operands + (carry,), (chunk, carry), s.target, dtype=dtype,
                         statement=s, **step_work(s, work, "compute"),
                         text=f"{s.target}[{' '.join(s.axes)}] = {box.name}[{axis}]({s.target}.carry, {_operand_text(s)}); "
                              f"{s.target}.carry = {s.target}[last {axis}]")]
        if role == "rescaled":
            acc = (level, f"{s.target}.acc")
            online = self.online_source(s)
            scale = (level, f"{online.target}.scale")
            return [
                Step("rescale", level, s.axes, (acc, scale), (acc,), s.target, dtype=dtype, statement=s, online=online.target,
                     text=f"{s.target}.acc *= {online.target}.scale", **step_work(s, work, "rescale")),
                Step("accumulate", level, s.iteration_axes, operands + (acc,), (acc,), s.target, dtype=dtype,
                     statement=s, text=f"{s.target}.acc += {_box_text(s)}", **step_work(s, work, "accumulate")),
            ]
        raise AssertionError(f"napkin bug: role {role}")

    def finalise(self, s: Statement, role: str, level: str, axis: str) -> list:
        box = s.box
        dtype = compute_dtype(self.diagram, s)  # the state and the chunk: f64 in, f64 state
        if role == "accumulate":
            acc = (level, f"{s.target}.acc")
            out = self.buffer(s.target, level, s.axes, dtype)
            if isinstance(box, Reduce) and reduction(box.op).divides:
                # The division by the count: one operation per output, like the unstreamed mean's.
                return [Step("finalise", level, s.axes, (acc,), (out,), s.target, dtype=dtype, statement=s,
                             text=f"{s.target} = {s.target}.acc / {' * '.join(box.axes)}",
                             **step_work(s, box_kind(box).streamed(box, role), "finalise"))]
            return [Step("finalise", level, s.axes, (acc,), (out,), s.target, dtype=dtype, statement=s,
                         text=f"{s.target} = {s.target}.acc")]
        if role == "rescaled":
            acc = (level, f"{s.target}.acc")
            online = self.online_source(s)
            denominator = (level, f"{online.target}.sum")
            out = self.buffer(s.target, level, s.axes, dtype)
            return [Step("finalise", level, s.axes, (acc, denominator), (out,), s.target, dtype=dtype, online=online.target,
                         **step_work(s, box_kind(box).streamed(box, role), "finalise"),
                         statement=s, text=f"{s.target} = {s.target}.acc / {online.target}.sum")]
        if role == "lse":
            # log-sum-exp = the online softmax's max + log(sum), once the stream has ended
            online = self.online_source(s)
            m, total = (level, f"{online.target}.max"), (level, f"{online.target}.sum")
            out = self.buffer(s.target, level, s.axes, self.buffers[m].dtype)
            return [Step("finalise", level, s.axes, (m, total), (out,), s.target, dtype=self.buffers[m].dtype, online=online.target,
                         **step_work(s, box_kind(box).streamed(box, role), "finalise"), statement=s,
                         text=f"{s.target} = {online.target}.max + log({online.target}.sum)")]
        return []

    def online_source(self, s: Statement) -> Statement:
        """The online softmax whose state a rescaled contraction or a log-sum-exp reads: the link
        relabel.stream_roles made (StreamRoles.sources)."""
        index = self.launch.streams[0].sources[s.index]
        return next(p for p in self.launch.statements if p.index == index)


def _factor_arrays(s: Statement) -> tuple[str, ...]:
    """The arrays a contraction's factor reads (its scale step's), none for any other box."""
    if not isinstance(s.box, Contract) or s.box.scale is None:
        return ()
    return tuple(dict.fromkeys(r.array for r in reads(s.box.scale)))


def _product_arrays(s: Statement) -> tuple[str, ...]:
    """The arrays a contraction's product reads (its operands), every input for any other box."""
    if not isinstance(s.box, Contract):
        return tuple(s.inputs)
    return tuple(dict.fromkeys(r.array for r in s.box.operands))


def _box_text(s: Statement) -> str:
    """A statement's box without a contraction's scalar factor (that is a step of its own)."""
    if isinstance(s.box, Contract):
        from .diagram import format_expression

        return " * ".join(format_expression(r) for r in s.box.operands)
    return s.describe()


def _operand_text(s: Statement) -> str:
    from .diagram import format_expression

    return format_expression(s.box.operand)


def _flops(**units) -> tuple:
    return tuple((unit, n) for unit, n in units.items() if n)


def step_work(s: Statement, work: tuple, step: str) -> dict:
    """The FLOP fields of one Program step (``flops``, ``flop_axes``, ``bookkeeping``) from the
    table's work of statement ``s`` (boxes.BOX_KINDS) for that step."""
    mine = [w for w in work if w.step == step]
    main = [w for w in mine if not w.bookkeeping]
    fields: dict = {}
    if main:
        space = main[0].space  # the step's own: its other main work (a mean's division per output) in flops_over
        flops: dict = {}
        for w in main:
            if w.space == space:
                for unit, n in w.counts:
                    flops[unit] = flops.get(unit, 0) + n
        fields["flops"] = tuple((u, n) for u, n in flops.items() if n != 0)
        fields["flop_axes"] = work_axes(s, space)
        fields["flops_over"] = tuple((unit, n, work_axes(s, w.space)) for w in main if w.space != space for unit, n in w.counts if n != 0)
    fields["bookkeeping"] = tuple((unit, n, work_axes(s, w.space)) for w in mine if w.bookkeeping for unit, n in w.counts if n != 0)
    return fields


def _expand_contract_scales(body: tuple, elaborator: _LaunchElaborator) -> tuple:
    """Contractions with a factor get an explicit ``scale`` step on their output: a number
    (``S *= 1/sqrt(d)``), or arrays over the output's axes alone (``O *= sV[b h]``, FA3's descale
    after the product), which the step reads where the launch holds them."""
    out = []
    for node in body:
        if isinstance(node, Loop):
            out.append(dataclasses.replace(node, body=_expand_contract_scales(node.body, elaborator)))
            continue
        out.append(node)
        s = node.statement
        # A streamed contraction (accumulate or rescaled role) has no compute step: its factor
        # applies once to the finalised output.
        if node.op in ("compute", "finalise") and s is not None and isinstance(s.box, Contract) and s.box.scale is not None:
            ref = (node.level, s.target)
            factors = tuple((node.level, name) for name in dict.fromkeys(r.array for r in reads(s.box.scale)))
            out.append(Step("compute", node.level, s.axes, (ref,) + factors, (ref,), s.target, dtype=node.dtype,
                            statement=s, text=f"{s.target} *= {_scale_text(s)}", **step_work(s, box_kind(s.box).flops(s.box), "scale")))
    return tuple(out)


def _scale_text(s: Statement) -> str:
    from .diagram import format_expression

    return format_expression(s.box.scale)


def elaborate(schedule: Schedule) -> Program:
    """Expand a schedule into looped pseudocode, one :class:`LaunchProgram` per launch."""
    launches = []
    for launch in schedule.launches:
        view = schedule.for_launch(launch.index, combine=False)  # a split's parts (or an unsplit launch)
        elaborator = _LaunchElaborator(view, launch)
        body = _expand_contract_scales(elaborator.run(), elaborator)
        if elaborator.cut is None:
            body = _mask_streams(body, view, launch)
        # A split's parts do not skip masked chunks: which chunks a mask hides is decided over
        # the whole axis (mask_visits), not per part; every chunk is tested instead.
        launches.append(LaunchProgram(len(launches), launch, body, dict(elaborator.buffers), view))
        if elaborator.cut is not None:
            launches.append(combine_launch(schedule.for_launch(launch.index, combine=True), launch, elaborator.cut, len(launches)))
    return Program(schedule, tuple(launches))


def combine_launch(view: Schedule, launch: Launch, cut: Partition, index: int) -> LaunchProgram:
    """The launch that merges the parts of split ``cut``: ``view`` (the schedule as the combine
    launch sees it) without the split and the stream of its axis, streaming the part axis one
    part at a time instead."""
    part = part_axis(cut.axis)
    partitions = tuple(p for p in view.partitions if p.axis != cut.axis or p.kind == "group")
    partitions += (Partition(view.compute_level, "stream", part, algebra.Integer(1), cut.span),)
    combined = dataclasses.replace(view, partitions=partitions)
    elaborator = _LaunchElaborator(combined, launch, combine=True)
    body = _expand_contract_scales(elaborator.run(), elaborator)
    return LaunchProgram(index, launch, body, dict(elaborator.buffers), combined, combine=cut.axis)


# ---- masks: the chunks a masked softmax skips -------------------------------------------------
#
# A softmax over x of where(COND, A, -inf), streamed over x, gives a masked entry exp(-inf) = 0
# and leaves the running max, sum and accumulator as they were: a chunk whose every entry is
# masked changes nothing and is never visited (no load, no step). COND is read as linear
# inequalities in the axis indices (q >= x, q - x < 256, q + len(x) - len(q) >= x, joined by
# `and`); for the tile a group holds and a chunk of x, each inequality's least and greatest
# value over the tile decide whether the chunk is fully masked (skipped), fully unmasked (the
# test is skipped: the step computes A) or partially masked (the test is applied). A condition
# that is not such a conjunction (or, not, !=, indices times arrays) skips nothing: every chunk
# is tested. The visited chunks of a group are contiguous (each inequality bounds the chunk
# index from one side), so the loop over x has bounds that depend on the group: triangular for
# a causal mask, banded for a sliding window.


@dataclass(frozen=True)
class Constraint:
    """``sum(coefficient * index) + constant >= 0`` (``> 0`` when strict): one inequality of a mask."""

    coefficients: tuple[tuple[str, int], ...]  # (axis, integer coefficient of its index)
    constant: algebra.Expr  # a number or an expression in the axes' sizes (len(x) - len(q))
    strict: bool


@dataclass(frozen=True)
class Mask:
    """The where-predicate of a streamed softmax as linear constraints, with the tiles it is
    decided over: per constrained axis, its tile at the compute level (the stream's chunk for
    the streamed axis, a group's tile for a grouped axis, the whole axis otherwise)."""

    statement: str  # the softmax's target
    axis: str  # the streamed axis
    constraints: tuple[Constraint, ...]
    tiles: tuple[tuple[str, algebra.Expr], ...]  # (axis, tile extent at the compute level)
    condition: str  # the predicate as written
    # The statement whose step tests the condition in this loop (the softmax's rescale, or the
    # compute step of M = where(COND, S, -inf) that the softmax reads); None when it is not here.
    tested: str | None = None

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.tiles)

    @property
    def bounds_below(self) -> bool:
        """Whether an inequality bounds the streamed axis's index from below (a positive
        coefficient: a sliding window's left edge), so that chunks before the ones the mask
        holds in full may be cut. Causal attention's ``x <= q`` bounds it from above only: its
        full chunks start at the first."""
        return any(dict(c.coefficients).get(self.axis, 0) > 0 for c in self.constraints)

    def status(self, ranges: dict, constants: tuple) -> str:
        """"masked", "partial" or "full" for the tile ``ranges`` (axis -> [start, stop), not
        empty), given the constraints' constants as numbers (:meth:`constants`)."""
        full = True
        for constraint, constant in zip(self.constraints, constants, strict=False):
            low = high = constant
            for axis, coefficient in constraint.coefficients:
                start, stop = ranges[axis]
                ends = (coefficient * start, coefficient * (stop - 1))
                low, high = low + min(ends), high + max(ends)
            if (high <= 0) if constraint.strict else (high < 0):
                return "masked"
            if (low <= 0) if constraint.strict else (low < 0):
                full = False
        return "full" if full else "partial"

    def constants(self, sizes) -> tuple | None:
        """Each constraint's constant at ``sizes`` (axis -> size), or None where one is symbolic."""
        values = []
        for constraint in self.constraints:
            value = constraint.constant.subs({sym: sizes(sym.name) for sym in constraint.constant.free_symbols})
            if not value.is_number:
                return None
            values.append(float(value))
        return tuple(values)


def mask_of(statement: Statement, axis: str, tile, producers: dict | None = None) -> Mask | None:
    """The Mask of a softmax along ``axis`` whose operand is where(COND, A, -inf) with COND a
    conjunction of linear inequalities in axis indices, or reads an array M computed so (a
    softmax chain: M[... x] = where(COND, S, -inf); P = softmax[x](M)); None for anything else.
    ``tile(a)`` is axis a's tile extent at the compute level; ``producers`` maps an array to its
    statement when this launch computes it (where the test runs)."""
    box = statement.box
    if not isinstance(box, Softmax) or box.axis != axis:
        return None
    operand, tested = box.operand, statement.target
    if isinstance(operand, Read):
        chain = (producers or {}).get(operand.array)
        operand, tested = (chain.box.expr, chain.target) if chain is not None and isinstance(chain.box, Map) else (None, None)
    if not (isinstance(operand, Apply) and operand.fn == "where" and operand.args[2] == Const(-algebra.oo)):
        return None
    constraints = _constraints(operand.args[0])
    if not constraints or not any(dict(c.coefficients).get(axis) for c in constraints):
        return None
    axes = list(dict.fromkeys(a for c in constraints for a, _ in c.coefficients))
    axes = [axis] + [a for a in axes if a != axis]
    return Mask(statement.target, axis, tuple(constraints), tuple((a, tile(a)) for a in axes),
                format_expression(operand.args[0]), tested)


@functools.lru_cache(maxsize=256)
def _constraints(condition) -> tuple[Constraint, ...] | None:
    """The condition as linear constraints in the axis indices, or None. Cached: it depends on
    the expression alone, and every elaboration (one per tuner candidate) asks again."""
    if isinstance(condition, Apply) and condition.fn == "and":
        parts = [_constraints(a) for a in condition.args]
        return None if any(p is None for p in parts) else tuple(c for p in parts for c in p)
    if not (isinstance(condition, Apply) and condition.fn in ("ge", "gt", "le", "lt", "eq")):
        return None
    left, right = (_linear(a) for a in condition.args)
    if left is None or right is None:
        return None
    difference = algebra.as_expr(left - right)  # ge, gt, eq: difference >= 0 (> 0)
    forms = {"ge": [(difference, False)], "gt": [(difference, True)], "le": [(-difference, False)],
             "lt": [(-difference, True)], "eq": [(difference, False), (-difference, False)]}[condition.fn]
    out = []
    for form, strict in forms:
        symbols = sorted((sym for sym in form.free_symbols if sym.name.startswith(_INDEX)), key=lambda sym: sym.name)
        coefficients = []
        for sym in symbols:
            coefficient = form.coeff(sym)
            if not (coefficient.is_Integer and not (coefficient.free_symbols & set(symbols))):
                return None  # not linear with integer coefficients: not decided per tile
            if coefficient:
                coefficients.append((sym.name[len(_INDEX):], int(coefficient)))
        constant = form.subs({sym: 0 for sym in symbols})
        if constant.free_symbols & set(symbols):
            return None
        out.append(Constraint(tuple(coefficients), constant, strict))
    return tuple(out)


_INDEX = "index:"  # the prefix of the symbol standing for an axis index in a constraint


def kept_fraction(condition, sizes: dict) -> float | None:
    """The share of the index pairs of a mask's two axes that ``condition`` keeps (causal over
    q = x: (n + 1) / 2n), counted exactly, or None where it is not linear inequalities over at
    most two axes bound in ``sizes``. FlashAttention's FLOP convention counts a masked
    attention's products over what its mask keeps."""
    import numpy as np

    constraints = _constraints(condition)
    if not constraints:
        return None
    axes = list(dict.fromkeys(a for c in constraints for a, _ in c.coefficients))
    if not 1 <= len(axes) <= 2 or any(a not in sizes for a in axes):
        return None
    constants = []
    for c in constraints:
        value = c.constant.subs({sym: sizes[sym.name] for sym in c.constant.free_symbols if sym.name in sizes})
        if not value.is_number:
            return None
        constants.append(float(value))
    rows, cols = (sizes[a] for a in axes) if len(axes) == 2 else (sizes[axes[0]], 1)
    col = np.arange(cols, dtype=np.float64)
    kept = 0
    for start in range(0, rows, 1024):  # a block of rows at a time: 8192 x 8192 pairs in 64 MiB steps
        row = np.arange(start, min(start + 1024, rows), dtype=np.float64)[:, None]
        held = np.ones((len(row), cols), dtype=bool)
        for c, constant in zip(constraints, constants, strict=True):
            value = constant + sum(k * (row if a == axes[0] else col) for a, k in c.coefficients)
            held &= (value > 0) if c.strict else (value >= 0)
        kept += int(held.sum())
    return kept / (rows * cols)


def _linear(expr):
    """A number expression of indices, sizes and constants (algebra), or None if it reads arrays."""
    if isinstance(expr, Index):
        return algebra.Symbol(_INDEX + expr.axis, integer=True)
    if isinstance(expr, Const):
        return None if expr.value in (algebra.oo, -algebra.oo) else expr.value
    if isinstance(expr, Apply) and expr.fn in ("add", "sub", "mul", "neg", "div"):
        args = [_linear(a) for a in expr.args]
        if any(a is None for a in args):
            return None
        if expr.fn == "neg":
            return -args[0]
        if expr.fn == "div":
            return args[0] / args[1] if not args[1].free_symbols or not any(
                sym.name.startswith(_INDEX) for sym in args[1].free_symbols) else None
        return {"add": algebra.Add, "sub": lambda a, b: a - b, "mul": algebra.Mul}[expr.fn](*args)
    return None


def _mask_streams(body: tuple, schedule: Schedule, launch: Launch) -> tuple:
    """Stream loops over the axis of a masked softmax get its Mask, and the softmax's rescale
    step (which evaluates the operand for the chunk's max) counts the test apart."""
    out = []
    for node in body:
        if not isinstance(node, Loop):
            out.append(node)
            continue
        inner = _mask_streams(node.body, schedule, launch)
        mask = None
        if node.kind == "stream":
            compute = schedule.compute_level
            producers = {s.target: s for s in launch.statements}
            for step, _ in walk(inner):
                if step.op == "online" and step.statement is not None:
                    mask = mask_of(step.statement, node.axis, lambda a, level=compute: schedule.extent(a, level), producers)
                    if mask is not None:
                        break
        if mask is not None and not _skips_safely(inner, mask, launch, node.axis):
            mask = None  # another result of the loop needs every chunk: none is skipped
        if mask is not None:
            inner = tuple(_untested(n, mask) for n in inner)
        elif node.kind == "stream":
            mask = _zero_mask(inner, schedule, launch, node.axis)
        out.append(dataclasses.replace(node, body=inner, mask=mask))
    return tuple(out)


# ---- zero masks: the chunks whose every contribution is zero -----------------------------------
#
# A stream loop with no masked softmax may still skip chunks: the backward of causal attention
# streams the queries in a launch grouped over the keys, and dS = where(q >= x, ..., 0) and
# P = where(L > -inf, exp(where(q >= x, S, -inf) - L), 0) are zero wherever q < x. A chunk the
# condition hides adds zero to every result the loop computes (dK and dV accumulate products of
# dS and P; dQ's adds are dS K), so it is never visited. Its condition is tested in every chunk
# visited (Mask.tested is None): the skip is the saving. Zero is read off the expressions, with
# the other values finite (0 * inf would be NaN: an array that holds infinities is not assumed).


def _zero_mask(body: tuple, schedule: Schedule, launch: Launch, axis: str) -> Mask | None:
    """The Mask of a stream loop over ``axis`` whose hidden chunks add nothing to any result of
    the loop (see above), or None."""
    steps = [step for step, _ in walk(body) if step.statement is not None]
    computed = list(dict.fromkeys(step.statement.target for step in steps))
    by_target = {s.target: s for s in launch.statements}
    condition = next((c for name in computed for c in _where_conditions(by_target[name].box)
                      if (found := _constraints(c)) and any(dict(k.coefficients).get(axis) for k in found)), None)
    if condition is None:
        return None
    constraints = _constraints(condition)
    zero, minus_infinite = set(), set()
    for name in computed:  # in order: a statement reads what comes before it
        box = by_target[name].box
        if isinstance(box, Map):
            value = _hidden_value(box.expr, constraints, zero, minus_infinite)
            if value is not None:
                (zero if value == ZERO else minus_infinite).add(name)
        elif isinstance(box, Contract) and any(r.array in zero for r in box.operands):
            zero.add(name)
        elif isinstance(box, Reduce) and box.op == "sum" \
                and _hidden_value(box.operand, constraints, zero, minus_infinite) == ZERO:
            zero.add(name)  # its terms' value, not any read's: sum(A + B) with A zero is B's
    added = {step.array for step in (step for step, _ in walk(body)) if step.op == "save" and step.add}
    for name in reversed(computed):
        s = by_target[name]
        readers = [r for r in launch.statements if name in r.inputs]
        if name in zero and (axis in s.consumed or name in added or name not in launch.outputs):
            continue  # a zero term of a sum over the stream, a zero added, or a zero read here
        if name not in launch.outputs and readers and all(r.target in zero for r in readers):
            zero.add(name)  # read only where it is multiplied by zero or selected out
            continue
        return None
    axes = list(dict.fromkeys(a for c in constraints for a, _ in c.coefficients))
    axes = [axis] + [a for a in axes if a != axis]
    compute = schedule.compute_level
    writer = next(name for name in computed if condition in _where_conditions(by_target[name].box))
    return Mask(writer, axis, constraints, tuple((a, schedule.extent(a, compute)) for a in axes),
                format_expression(condition))


def _where_conditions(box) -> list:
    """The conditions of the where(...) selections in a map's expression or a reduction's operand."""
    found = []

    def visit(e):
        if isinstance(e, Apply):
            if e.fn == "where":
                found.append(e.args[0])
            for a in e.args:
                visit(a)

    if isinstance(box, Map):
        visit(box.expr)
    elif isinstance(box, Reduce):
        visit(box.operand)
    return found


def _hides(condition, constraints) -> bool:
    """Whether ``condition`` is false wherever ``constraints`` (a chunk the mask hides) are."""
    return _constraints(condition) == constraints


ZERO, MINUS_INFINITY = "0", "-inf"


def _hidden_value(expr, constraints, zero: set, minus_infinite: set) -> str | None:
    """The value ``expr`` takes at every element of a chunk the mask hides: :data:`ZERO`,
    :data:`MINUS_INFINITY`, or None (another value, or one not known), the values it adds,
    subtracts or multiplies otherwise finite."""
    if isinstance(expr, Const):
        return ZERO if expr.value == 0 else MINUS_INFINITY if expr.value == -algebra.oo else None
    if isinstance(expr, Read):
        return ZERO if expr.array in zero else MINUS_INFINITY if expr.array in minus_infinite else None
    if not isinstance(expr, Apply):
        return None
    args = expr.args
    if expr.fn == "where":
        if _hides(args[0], constraints):
            return _hidden_value(args[2], constraints, zero, minus_infinite)
        taken = {_hidden_value(a, constraints, zero, minus_infinite) for a in args[1:]}
        return taken.pop() if len(taken) == 1 else None
    values = [_hidden_value(a, constraints, zero, minus_infinite) for a in args]
    if expr.fn in ("exp", "exp2"):
        return ZERO if values[0] == MINUS_INFINITY else None
    if expr.fn in ("neg", "div"):
        return ZERO if values[0] == ZERO and MINUS_INFINITY not in values else None
    if expr.fn == "mul":
        if MINUS_INFINITY not in values:
            return ZERO if ZERO in values else None
        # -inf times positive constants only (0 * -inf is NaN)
        others = [a for a, v in zip(args, values, strict=True) if v != MINUS_INFINITY]
        return MINUS_INFINITY if values.count(MINUS_INFINITY) == 1 and all(
            isinstance(a, Const) and a.value > 0 for a in others) else None
    if expr.fn in ("add", "sub"):
        if values.count(MINUS_INFINITY) == 1 and (values[0] == MINUS_INFINITY or expr.fn == "add"):
            return MINUS_INFINITY  # one term -inf (the first, of a difference), the others finite
        return ZERO if all(v == ZERO for v in values) else None
    return None


def _skips_safely(body: tuple, mask: Mask, launch: Launch, axis: str) -> bool:
    """Whether skipping the chunks ``mask`` hides leaves every result of the stream loop
    ``body`` right. The masked softmax gives those entries weight 0, so the contractions it
    feeds and the log-sum-exp read off its state (its stream role's sources) lose nothing, and
    a statement whose result only they read, and which is not saved, loses nothing either. Any
    other result computed in the loop (S saved beside the softmax, a sum over the axis of
    another operand, what is computed from them) needs every chunk. Found by the fuzzer: those
    were skipped too (NaN on NumPy, uninitialised memory on OpenCL)."""
    stream = next((roles for roles in launch.streams if roles.axis == axis), None)
    online = next((s for s in launch.statements if s.target == mask.statement), None)
    if stream is None or online is None:
        return False
    by_index = {s.index: s for s in launch.statements}
    safe = {online.target} | {by_index[i].target for i, source in stream.sources.items() if source == online.index}
    computed = {step.statement.target for step, _ in walk(body) if step.statement is not None}
    for s in reversed(launch.statements):  # a statement's readers come after it
        readers = [r for r in launch.statements if s.target in r.inputs]
        if (s.target in computed and s.target not in safe and s.target not in launch.outputs
                and readers and all(r.target in safe for r in readers)):
            safe.add(s.target)
    return computed <= safe


def _untested(node, mask: Mask):
    """The step that tests the mask (the softmax's rescale, or the compute step of the where it
    reads) with its test's FLOPs apart (Step.test_flops)."""
    if isinstance(node, Loop):
        return dataclasses.replace(node, body=tuple(_untested(n, mask) for n in node.body))
    s = node.statement
    if s is None or s.target != mask.tested or node.op not in (("rescale", "online") if s.target == mask.statement else ("compute",)):
        return node
    where = s.box.operand if s.target == mask.statement else s.box.expr
    masked = count_operations(where)
    unmasked = count_operations(where.args[1])
    test = _flops(fma=masked["fma"] - unmasked["fma"], special=masked["special"] - unmasked["special"])
    if node.op == "online":
        # the online step evaluates the operand again (its bookkeeping per element): the test too
        remaining = [(unit, n - dict(test).get(unit, 0) if axes == node.flop_space else n, axes) for unit, n, axes in node.bookkeeping]
        return dataclasses.replace(node, bookkeeping=tuple(b for b in remaining if b[1] != 0), test_flops=test)
    remaining = {unit: n for unit, n in node.flops}
    for unit, n in test:
        remaining[unit] = remaining.get(unit, 0) - n
    return dataclasses.replace(node, flops=tuple((u, n) for u, n in remaining.items() if n), test_flops=test)


# Masks are decided per group tile; more tiles than this (absurd sizes) are not enumerated: the
# cost then counts every chunk, an upper bound it notes, as for symbolic sizes.
MAX_MASK_GROUPS = 1 << 16


@dataclass(frozen=True)
class GroupVisits:
    """The chunks of the streamed axis one group tile visits: chunk indices [first, stop), of
    which [full_first, full_stop) the mask holds in full (no test); the others are partial."""

    ranges: dict  # axis -> [start, stop): the group's tile of each constrained axis but the streamed one
    first: int
    stop: int
    full_first: int
    full_stop: int

    @property
    def visited(self) -> int:
        return max(self.stop - self.first, 0)

    @property
    def full(self) -> int:
        return max(min(self.full_stop, self.stop) - max(self.full_first, self.first), 0)


def mask_visits(mask: Mask, sizes) -> list[GroupVisits] | None:
    """Per tile of the constrained axes other than the streamed one, the chunks it visits and
    those the mask holds in full; None when a size or tile is symbolic, or there are more than
    MAX_MASK_GROUPS tiles. ``sizes(axis)`` is an axis's size.

    Exactly the chunks Mask.status calls visited and full: each inequality holds at a chunk's
    best (worst) element on a suffix or a prefix of the chunks, so the visited (full) chunks are
    the intersection of those, found by bisection with the same test, O(log chunks) a group."""
    constants = mask.constants(sizes)
    extents = {a: algebra.as_expr(e) for a, e in mask.tiles}
    lengths = {a: algebra.as_expr(sizes(a)) for a in mask.axes}
    if constants is None or not all(v.is_number for v in list(extents.values()) + list(lengths.values())):
        return None
    # the cost asks once per step of the loop: the answer is computed once per mask and sizes
    return _group_visits(mask, constants, tuple((a, int(v)) for a, v in extents.items()),
                         tuple((a, int(v)) for a, v in lengths.items()))


@functools.lru_cache(maxsize=64)
def _group_visits(mask: Mask, constants: tuple, extents: tuple, lengths: tuple) -> list[GroupVisits] | None:
    extents, lengths = dict(extents), dict(lengths)
    x, tile = mask.axis, extents[mask.axis]
    chunks = -(-lengths[x] // tile)
    others = [a for a in mask.axes if a != x]
    if math.prod(-(-lengths[a] // extents[a]) for a in others) > MAX_MASK_GROUPS:
        return None

    def holds(constraint, constant, ranges, chunk: int, best: bool) -> bool:
        """The inequality at the tile's best element (visited) or worst (held in full)."""
        ranges[x] = (chunk * tile, min(chunk * tile + tile, lengths[x]))
        value = constant
        for axis, coefficient in constraint.coefficients:
            start, stop = ranges[axis]
            ends = (coefficient * start, coefficient * (stop - 1))
            value += max(ends) if best else min(ends)
        return value > 0 if constraint.strict else value >= 0

    def interval(ranges, best: bool) -> tuple[int, int]:
        first, stop = 0, chunks
        for constraint, constant in zip(mask.constraints, constants, strict=False):
            slope = dict(constraint.coefficients).get(x, 0)
            if slope == 0:
                if not holds(constraint, constant, ranges, 0, best):
                    return 0, 0
                continue
            # slope > 0: holds from some chunk on (a suffix); slope < 0: up to some chunk (a prefix)
            low, high = 0, chunks  # the answer is in [low, high]
            while low < high:
                middle = (low + high) // 2
                if holds(constraint, constant, ranges, middle, best) == (slope > 0):
                    high = middle
                else:
                    low = middle + 1
            first, stop = (max(first, low), stop) if slope > 0 else (first, min(stop, low))
        return (first, stop) if first < stop else (0, 0)

    def tiles(axis):
        return [(start, min(start + extents[axis], lengths[axis])) for start in range(0, lengths[axis], extents[axis])]

    out = []
    for combo in itertools.product(*(tiles(a) for a in others)):
        ranges = dict(zip(others, combo, strict=False))
        first, stop = interval(dict(ranges), best=True)
        full_first, full_stop = interval(dict(ranges), best=False)
        out.append(GroupVisits(ranges, first, stop, full_first, full_stop))
    return out


def chunk_span(first: int, stop: int, tile: int, length: int) -> int:
    """Elements of the streamed axis in chunks [first, stop) of ``tile`` (the last one may be short)."""
    return max(min(stop * tile, length) - first * tile, 0) if stop > first else 0


def mask_bounds_text(mask: Mask) -> str:
    """The chunks of the streamed axis a group visits, as bounds in the group's tile (``x_first
    <= q_last``: a chunk is visited if its first index is at most the group's last; a causal
    mask's triangle), and the condition tested on the chunks it does not hide in full."""
    x = mask.axis
    bounds = []
    for c in mask.constraints:
        coefficients = dict(c.coefficients)
        a_x = coefficients.get(x, 0)
        # The group's best element for the inequality: the last index of an axis with a
        # positive coefficient, the first of one with a negative coefficient.
        best = c.constant + sum(k * algebra.Symbol(f"{a}_{'last' if k > 0 else 'first'}") for a, k in c.coefficients if a != x)
        if not a_x:
            bounds.append(f"{size_text(best)} {'>' if c.strict else '>='} 0")
        elif a_x > 0:
            bounds.append(f"{x}_last {'>' if c.strict else '>='} {size_text(-best / a_x)}")
        else:
            bounds.append(f"{x}_first {'<' if c.strict else '<='} {size_text(best / -a_x)}")
    return " and ".join(bounds)


# ---- the L2 level --------------------------------------------------------------------------


# Registers are allocated to warps in units of 256 (8 per thread): the CUDA occupancy
# calculator's "register allocation unit size" for compute capability 8.x and 9.x.
REGISTER_ALLOCATION_UNIT = 256


def blocks_per_unit(schedule: Schedule, smem_bytes, threads: int | None = None, registers: int | None = None) -> tuple[int, str] | None:
    """Resident thread blocks per SM and what limits them: shared memory, and, when the launch's
    threads (and registers per thread) are known, threads, registers and the block limit."""
    hardware = schedule.hardware
    compute = hardware.level(schedule.compute_level)
    capacity = compute.capacity
    if not (isinstance(capacity, int) and algebra.as_expr(smem_bytes).is_number):
        return None
    # An SM's shared memory is the largest block's plus what the system reserves per block,
    # and every resident block takes its own bytes plus that reserve.
    reserved = compute.reserved_per_block
    limits = {"shared memory": int((capacity + reserved) // max(int(smem_bytes) + reserved, 1)), "blocks": 32}
    thread_level = next((lv for lv in hardware.levels if lv.registers_per_unit), None)
    if threads and thread_level is not None:
        if thread_level.blocks_per_unit:
            limits["blocks"] = thread_level.blocks_per_unit
        if thread_level.threads_per_unit:
            limits["threads"] = thread_level.threads_per_unit // threads
        if registers:
            per_warp = -(-registers * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
            limits["registers"] = thread_level.registers_per_unit // (per_warp * -(-threads // 32))
    bound = min(limits, key=limits.get)
    return max(1, limits[bound]), bound


def co_resident_blocks(schedule: Schedule, smem_bytes, threads: int | None = None, registers: int | None = None) -> int | None:
    """Thread blocks running at once: SMs x blocks per SM (:func:`blocks_per_unit`)."""
    found = blocks_per_unit(schedule, smem_bytes, threads, registers)
    if found is None:
        return None
    return schedule.hardware.level(schedule.compute_level).units * found[0]


def l2_candidates(schedule: Schedule, level: str, blocks: int) -> list[tuple[Partition, ...]]:
    """Groupings of co-resident blocks at the L2 level: near-box tiles of the block grid.

    Launch order is assumed to be swizzled (as CUTLASS, cuBLAS and Triton's grouped ordering
    do), so the blocks in flight together form a box of the group grid; we try boxes whose
    sides are powers of two dividing the axis's group count, or whole axes, with at most
    ``blocks`` blocks.
    """
    compute = schedule.compute_level
    grouped = [p for p in schedule.partitions_at(compute, "group")]  # `schedule`: one launch's view
    options = []
    for p in grouped:
        count = trips(schedule.axis_size(p.axis), schedule.extent(p.axis, compute))
        if not count.is_number:
            return []
        count = int(count)
        # Sides that divide the group count, so that no L2 group ends in a tail of empty tiles.
        sides = sorted({count} | {2**k for k in range(0, count.bit_length()) if 2**k < count and count % 2**k == 0})
        # each side's partition made once: the product below is hundreds of thousands of combinations
        extent = schedule.extent(p.axis, compute)
        options.append([(side, Partition(level, "group", p.axis, algebra.Integer(side) * extent, None, derived=True)) for side in sides])
    candidates = []
    for combo in itertools.product(*options):
        total = 1
        for side, _ in combo:
            total *= side
        if total > blocks:
            continue
        candidates.append(tuple(partition for _, partition in combo))
    return candidates


# ---- rendering -----------------------------------------------------------------------------


def _tile(schedule: Schedule, axes, level: str) -> str:
    return " ".join(f"{a}:{schedule.extent(a, level)}" for a in axes)


def render_text(program: Program, warps: dict | None = None) -> str:
    """The pseudocode as indented text, with the tile shape of every transfer and operation.

    ``warps`` maps a launch index to the line of its register level (``isel.warp_line``): the
    compute-level body then runs inside that parallel loop over warps."""
    schedule = program.schedule
    lines = [f"kernel {program.diagram.name} on {schedule.hardware.name}: levels {' > '.join(schedule.levels)}"]
    device = schedule.hardware.device
    for d in schedule.device:  # across the GPUs of a node: each runs the launches below on its parts
        shown = "groups" if d.kind == "group" else "parts"
        lines.append(f"parallel for {d.axis} in {shown} of {d.size} @{device.name} ({device.units} GPUs, "
                     f"{device.bandwidth / 1e9:g} GB/s each way):  # {d.kind} across the GPUs: "
                     + ("each GPU runs the launches below on its groups" if d.kind == "group" else
                        "each GPU streams its parts; their states move to GPU 0, whose combine launch merges them"))
    for note in schedule.notes:
        lines.append(f"# note: {note}")
    for launch in program.launches:
        what = ", ".join(s.target for s in launch.launch.statements)
        if launch.combine is not None:
            what = f"the combine of the parts of {launch.combine} for {what}"
        lines.append(f"launch {launch.index + 1} of {len(program.launches)}: {what}")
        _render_nodes(launch.body, launch.schedule, lines, 1, (warps or {}).get(launch.index))
    return "\n".join(lines) + "\n"


def _render_nodes(nodes, schedule, lines, depth, warp_line=None):
    pad = "    " * depth
    for node in nodes:
        if isinstance(node, Loop):
            kind = "parallel for" if node.kind == "group" else "for"
            derived = "  # derived: co-resident blocks share L2" if node.derived else ""
            plural = "" if node.trips == 1 else "s"
            lines.append(f"{pad}{kind} {node.axis} in {node.trips} {node.kind}{plural} of {node.tile} @{node.level}:{derived}")
            if node.mask is not None:
                tests = ("tests only the chunks it does not hold in full" if node.mask.tested is not None
                         else "every other chunk adds zero to each result; tests every chunk it visits")
                lines.append(f"{pad}    # masked by {node.mask.condition}: visits only the chunks where "
                             f"{mask_bounds_text(node.mask)}; {tests}")
            innermost = (warp_line is not None and node.kind == "group" and node.level == schedule.compute_level
                         and not any(isinstance(n, Loop) and n.kind == "group" for n in node.body))
            if innermost:
                lines.append(f"{pad}    {warp_line}")
                _render_nodes(node.body, schedule, lines, depth + 2)
            else:
                _render_nodes(node.body, schedule, lines, depth + 1, warp_line)
        else:
            lines.append(f"{pad}{node.text}    [{_tile(schedule, node.axes, node.level)}]")


def render_markdown(program: Program, columns: list) -> str:
    """The pseudocode as a Markdown table: one row (the paper's column) per step.

    ``columns`` are the rows ``cost.columns(program)`` reads off this Program (what is resident
    per step): the caller passes them, as cost sits above this module."""
    schedule = program.schedule
    rows = columns
    levels = list(schedule.levels[1:]) + (["registers"] if any("registers" in r["resident"] for r in rows) else [])
    out = [f"### {program.diagram.name} on {schedule.hardware.name}", ""]
    for note in schedule.notes:
        out.append(f"> note: {note}")
    header = ["#", "loops", "step"] + [f"resident @{level}" for level in levels]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "---|" * len(header))
    for i, row in enumerate(rows, 1):
        cells = [str(i), row["loops"], f"`{row['text']}`"] + [row["resident"].get(level, "") for level in levels]
        out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(out) + "\n"
