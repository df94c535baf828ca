"""Relabelling: group and stream partitions per memory level, and their legality.

A relabel block says, for levels below the top, which axes are split into **groups**
(independent tiles, each on its own core: a parallel loop) and which are fed in **streams**
(chunks through a sequential loop, with an accumulator carrying state). This pass turns a
checked :class:`~napkin_dsl.diagram.Diagram` plus a relabel block into a :class:`Schedule`:
the partitions, the levels involved, the launches (materialised intermediates split the
kernel), and for each stream the role every statement plays in it.

Legality (METHOD.md sections 3-4):

* a group partition needs an axis no statement consumes (every box is woven over it), or one
  only contractions consume whose results are outputs of their launch in f32 that nothing in
  the launch reads: each group adds its partial sum into the output in device memory
  (:func:`summed_over_groups`; split-K without a combine launch, FlashAttention's dQ);
* a stream partition needs an axis that arrives by a transfer and is consumed by a
  streamable chain: running sums (contractions, ``sum``, ``mean``), running ``max``/``min``,
  stateless maps, or ``softmax`` followed by a contraction over the same axis (the online
  softmax). By the fusion theorem the chain may contain further maps, as long as nothing
  that still carries the axis needs a value that is only complete after the stream ends;
* sizes that do not divide the axis are allowed: trip counts round up and tails are masked.

What this pass deliberately does not do: decide loop bodies, residency or costs
(``pseudocode.py``), or check capacities (that needs the elaborated memory per level;
``cost.py`` raises capacity errors).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from . import algebra
from . import syntax as syn
from .boxes import StreamSite, box_kind, line_of
from .diagram import Contract, Diagram, Softmax, Statement
from .errors import RelabelError, Span, raise_collected
from .hardware import Hardware, load_hardware


@dataclass(frozen=True)
class Partition:
    level: str
    kind: str  # "group", "stream" or "split"
    axis: str
    size: algebra.Expr
    span: Span | None = None
    derived: bool = False  # chosen by napkin (the L2 grouping), not written by the user
    launches: frozenset | None = None  # indices of the launches it applies to; None: all
    targets: tuple[str, ...] | None = None  # as written: `smem for O:`
    # In a split launch (one launch of the schedule, two of the Program: the parts, then their
    # combine), the one it applies to: False the parts, True the combine; None: both. A derived
    # L2 grouping is weighed per Program launch, so it is scoped to one of them.
    combine: bool | None = None

    def applies_to(self, launch_index: int, combine: bool | None = None) -> bool:
        """Whether it applies to schedule launch ``launch_index`` (``combine``: as its parts'
        launch, False, or its combine launch, True; None: either)."""
        return ((self.launches is None or launch_index in self.launches)
                and (self.combine is None or combine is None or self.combine == combine))

    def __repr__(self) -> str:
        # As a relabel clause reads: the dataclass repr spelled out the span's whole source line.
        scope = f" for {', '.join(self.targets)}" if self.targets else ""
        launches = f" (launches {', '.join(map(str, sorted(self.launches)))})" if self.launches is not None else ""
        if self.combine is not None:
            launches += " (combine launch)" if self.combine else " (parts launch)"
        return f"<Partition {self.level}{scope}: {self.kind} {self.axis} {self.size}{' (derived)' if self.derived else ''}{launches}>"


@dataclass(frozen=True)
class StreamRoles:
    """How each statement of a launch takes part in a stream over ``axis``.

    Roles: ``pre`` (before the loop), ``body`` (per chunk, stateless along the axis), ``scan``
    (a cumsum or cumprod along the axis, each chunk's starting from the carry the one before left),
    ``accumulate`` (consumes the axis with a running sum/max/min), ``online`` (softmax along
    the axis feeding contractions: running max and sum with rescaling), ``rescaled`` (a
    contraction consuming an online softmax), ``lse`` (the log-sum-exp read off an online
    softmax's state), ``post`` (after the loop).

    ``sources`` links each ``rescaled`` and ``lse`` statement to the online softmax whose state
    (scale, sum, max) it reads: decided here once, read by the Program and every backend.
    """

    axis: str
    roles: dict  # statement index -> role
    sources: dict = field(default_factory=dict)  # statement index -> index of its online softmax


@dataclass(frozen=True)
class Launch:
    """Statements that run in one kernel launch (split by materialisation at the top level)."""

    index: int
    statements: tuple[Statement, ...]
    inputs: tuple[str, ...]  # arrays loaded from the top level
    outputs: tuple[str, ...]  # arrays saved to the top level
    streams: tuple[StreamRoles, ...] = ()

    @property
    def axes(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for s in self.statements:
            for a in s.iteration_axes:
                seen.setdefault(a)
        return tuple(seen)

    def __repr__(self) -> str:
        # Statement targets, not the statements: their box trees made one launch thousands of characters.
        streams = f"; streams {', '.join(r.axis for r in self.streams)}" if self.streams else ""
        return (f"<Launch {self.index}: {' '.join(s.target for s in self.statements)}; loads {' '.join(self.inputs) or 'nothing'}; "
                f"saves {' '.join(self.outputs) or 'nothing'}{streams}>")


@dataclass(frozen=True)
class Schedule:
    """A diagram, the hardware, the partitions per level and the launches."""

    diagram: Diagram
    hardware: Hardware
    partitions: tuple[Partition, ...]
    levels: tuple[str, ...]  # levels involved, top first, compute level last
    launches: tuple[Launch, ...]
    sizes: dict = field(default_factory=dict)  # bound symbol name -> int
    notes: tuple[str, ...] = ()
    # The parts of each split axis: part axis (`x#`) -> (the axis, the split size). Kept by
    # every launch's view, so that the combine launch (which has no split) still sizes them.
    parts: dict = field(default_factory=dict)
    # Partitions across the GPUs of a node (hardware.Hardware.device), from clauses at the top
    # level: one group or split at most. Each GPU runs this Schedule's Program on its share
    # (backends/distributed.py); cost.device_cost prices what crosses the links.
    device: tuple[Partition, ...] = ()
    # The warpgroup schedule the relabel block asks to build (its `overlap:` line), or None:
    # isel.select_program's default
    overlap: str | None = None

    def __repr__(self) -> str:
        return f"<Schedule {self.summary()}; {self.partitions_text() or 'no partitions'}>"

    def summary(self, launches=None) -> str:
        """One line: kernel, hardware, bound sizes, the statements of each launch and the levels
        (the reprs of the Schedule and of the Program built from it: ``launches``, the Program's,
        has a split's combine launch too)."""
        sizes = f" with {' '.join(f'{k}={v}' for k, v in self.sizes.items())}" if self.sizes else ""
        launches = self.launches if launches is None else launches
        n = len(launches)
        launches = " ".join(f"[{' '.join(s.target for s in launch.statements)}]" for launch in launches)
        return (f"{self.diagram.name} on {self.hardware.name}{sizes}: {n} launch{'es' if n != 1 else ''} {launches}, "
                f"levels {' > '.join(self.levels)}")

    def partitions_text(self) -> str:
        """The partitions as relabel clauses, one level after another: ``smem: group q 128, stream x 64``."""
        by_level: dict[str, list[str]] = {}
        for p in self.partitions:
            scope = f" for {', '.join(p.targets)}" if p.targets else ""
            by_level.setdefault(f"{p.level}{scope}", []).append(f"{p.kind} {p.axis} {p.size}{' (derived)' if p.derived else ''}")
        return "; ".join(f"{level}: {', '.join(parts)}" for level, parts in by_level.items())

    @property
    def compute_level(self) -> str:
        return self.levels[-1]

    def for_launch(self, index: int, combine: bool | None = None) -> "Schedule":
        """The schedule as one launch sees it: only the partitions that apply to it (``combine``:
        of a split launch, as its parts' launch, False, or its combine launch, True)."""
        return dataclasses.replace(self, partitions=tuple(p for p in self.partitions if p.applies_to(index, combine)))

    def partitions_at(self, level: str, kind: str | None = None) -> list[Partition]:
        return [p for p in self.partitions if p.level == level and (kind is None or p.kind == kind)]

    # extent() is asked for every buffer of every column, and axis_size() for every step: both
    # read tables built once per Schedule (a replaced Schedule, as for_launch makes, builds its
    # own), since the fields they derive from are frozen.

    @functools.cached_property
    def axis_sizes(self) -> dict[str, algebra.Expr]:
        """Every axis's size, bound where ``sizes`` binds it, and each split's number of parts
        (its part axis, ``x#``)."""
        table = {axis: bind(self.diagram.size(axis), self.sizes) for axis in self.diagram.axes}
        for part, (split, size) in self.parts.items():
            table[part] = trips(table[split], smaller(bind(size, self.sizes), table[split]))
        return table

    @functools.cached_property
    def tile_extents(self) -> dict[tuple[str, str], algebra.Expr]:
        """(axis, level) -> the tile extent of the axis at the level, for every axis of
        :attr:`axis_sizes` and every level of the schedule (:meth:`extent`)."""
        return {(axis, level): self._extent(axis, level) for axis in self.axis_sizes for level in self.levels}

    def axis_size(self, axis: str) -> algebra.Expr:
        found = self.axis_sizes.get(axis)
        return found if found is not None else bind(self.diagram.size(axis), self.sizes)

    def extent(self, axis: str, level: str) -> algebra.Expr:
        """The tile extent of an axis at a level: its innermost partition at or above it."""
        found = self.tile_extents.get((axis, level))
        return found if found is not None else self._extent(axis, level)

    def _extent(self, axis: str, level: str) -> algebra.Expr:
        extent = self.axis_size(axis)
        for name in self.levels[1 : self.levels.index(level) + 1]:
            for p in self.partitions_at(name):
                if axis in self.parts and p.kind == "split" and p.axis == self.parts[axis][0]:
                    extent = algebra.Integer(1)  # below its split, a tile holds one part
                elif p.axis == axis and p.kind != "split":
                    # a split's part is the stream's range, not a tile: the tile is the stream's chunk
                    extent = smaller(bind(p.size, self.sizes), extent)
        return extent


def bind(expr, sizes: dict):
    """Substitute bound sizes (by symbol name) into an expression."""
    expr = algebra.as_expr(expr)
    if not sizes or not expr.free_symbols:
        return expr
    return expr.subs({s: sizes[s.name] for s in expr.free_symbols if s.name in sizes})


def smaller(size, extent):
    """The extent of a partition of size ``size`` of an axis of extent ``extent``."""
    if size.is_number and extent.is_number:
        return size if size <= extent else extent
    return size


def trips(extent, tile):
    """Trip count of a loop over ``extent`` in tiles of ``tile``: ceil when both are numbers.

    Symbolic trip counts assume the tile divides the extent (the paper's a / g_a).
    """
    if extent.is_number and tile.is_number:
        return algebra.Integer(-(-int(extent) // int(tile)))
    return extent / tile


def part_axis(axis: str) -> str:
    """The axis that numbers the parts of a split of ``axis`` (``x#``): not a name the notation
    can spell, so it never meets a kernel's own axis."""
    return f"{axis}#"


def split_of(schedule: Schedule, launch: Launch) -> Partition | None:
    """The split partition that applies to ``launch`` (``schedule``: its view), or None."""
    axes = set(launch.axes)
    return next((p for p in schedule.partitions if p.kind == "split" and p.axis in axes and p.applies_to(launch.index)), None)


# What a consumer of a split axis merges by, per stream role: the parts' states combine because
# these accumulators are associative (sums add, max and min fold, the online softmax merges its
# running max and sum with the outputs it rescales; a log-sum-exp is read off that merged state).
MERGEABLE_ROLES = ("accumulate", "online", "rescaled", "lse")


def size_expr(value) -> algebra.Expr:
    if isinstance(value, int):
        return algebra.Integer(value)
    return algebra.Symbol(value, positive=True, integer=True)


# ---- launches ------------------------------------------------------------------------------


def is_top(level: str | None, profile: Hardware) -> bool:
    """Is ``@level`` the top of ``profile``? The top level of another profile counts too
    (``@l0`` of the abstract model is device memory on a GPU), unless ``profile`` has that level."""
    if level is None:
        return False
    if level == profile.top.name:
        return True
    if level in profile.level_names():
        return False
    from .hardware import hardware_names

    return any(load_hardware(name).top.name == level for name in hardware_names())


def split_launches(diagram: Diagram, profile: Hardware) -> list[tuple[list[Statement], list[str], list[str]]]:
    """Split statements into launches at each materialisation to the top level.

    A launch saves its kernel outputs, its ``@top`` arrays, and every other array it computes
    that a later launch reads (:func:`carried_across`): nothing stays on chip from one launch
    to the next, so such an array goes through the top level like a materialised one.
    """
    groups: list[list[Statement]] = [[]]
    for statement in diagram.statements:
        groups[-1].append(statement)
        if is_top(statement.level, profile) and statement is not diagram.statements[-1]:
            groups.append([])
    launches = []
    for index, statements in enumerate(groups):
        produced = {s.target for s in statements}
        inputs = []
        for s in statements:
            for name in s.inputs:
                if name not in produced and name not in inputs:
                    inputs.append(name)
        read_later = {name for later in groups[index + 1:] for s in later for name in s.inputs}
        outputs = [
            s.target for s in statements
            if s.target in diagram.outputs or is_top(s.level, profile) or s.target in read_later
        ]
        launches.append((statements, inputs, outputs))
    return launches


def carried_across(diagram: Diagram, profile: Hardware, split: list | None = None) -> list[tuple[Statement, Statement]]:
    """(producer, first later reader) of each array written without ``@top`` but read by a later
    launch: napkin saves it to the top level at the end of its launch and loads it in the reader's.
    ``split``: the diagram's split_launches, when the caller has it."""
    split = split if split is not None else split_launches(diagram, profile)
    found = []
    for index, (statements, _, outputs) in enumerate(split):
        for s in statements:
            if s.target in outputs and s.target not in diagram.outputs and not is_top(s.level, profile):
                reader = next(r for later, _, _ in split[index + 1:] for r in later if s.target in r.inputs)
                found.append((s, reader))
    return found


# ---- streams -------------------------------------------------------------------------------


def stream_roles(statements: list[Statement], inputs: list[str], outputs: list[str], diagram: Diagram, axis: str, span) -> StreamRoles:
    """Classify each statement's part in a stream over ``axis``, or raise why it cannot stream."""
    roles: dict[int, str] = {}
    sources: dict[int, int] = {}
    carries: dict[str, bool] = {}  # array -> carries the streamed axis (per chunk)
    complete_after: set[str] = set()  # arrays complete only after the stream ends
    for name in inputs:
        carries[name] = axis in diagram.arrays[name].axes
    if not any(carries.values()):
        raise RelabelError(
            f"cannot stream {axis}: no array loaded by this launch has axis {axis!r}",
            span, f"stream an axis of a kernel input ({', '.join(sorted({a for n in inputs for a in diagram.arrays[n].axes}))})",
        )
    consumers = {s.target: [c for c in statements if s.target in c.inputs] for s in statements}
    for s in statements:
        reads_chunk = any(carries.get(name, False) for name in s.inputs)
        needs_complete = [name for name in s.inputs if name in complete_after]
        consumes = axis in s.consumed
        if not reads_chunk and axis not in s.axes:
            roles[s.index] = "post" if needs_complete else "pre"
            carries[s.target] = False
            if needs_complete:
                complete_after.add(s.target)
            continue
        if needs_complete:
            first = diagram.producer(needs_complete[0])
            raise RelabelError(
                f"cannot stream {axis}: {s.target}[{' '.join(s.axes)}] ({line_of(s)}) still carries {axis!r} but needs "
                f"{needs_complete[0]}, which is complete only after the whole of {axis!r} has streamed past ({line_of(first)})",
                s.span or span, f"that would take a second pass over {axis}; leave {axis} unpartitioned or group another axis",
            )
        if not consumes:
            roles[s.index] = "body"
            carries[s.target] = True
            if s.target in outputs and axis in s.axes:
                pass  # a stateless map along the axis: saved chunk by chunk
            continue
        # The box's own conditions and role come from the table of box kinds (boxes.py).
        site = StreamSite(axis, span, diagram, tuple(statements), roles, consumers, tuple(outputs))
        role, source = box_kind(s.box).stream_role(s, site)
        roles[s.index] = role
        if source is not None:
            sources[s.index] = source
        if role in ("online", "scan"):  # the chunk flows on: the softmax's to the contraction, a scan's to any reader
            carries[s.target] = True
            continue
        carries[s.target] = False
        complete_after.add(s.target)
    return StreamRoles(axis, roles, sources)


# ---- splits --------------------------------------------------------------------------------


def split_errors(p: Partition, partitions: list, split: list, compute_level: str) -> list[RelabelError]:
    """What is wrong with split partition ``p`` before its streams are classified: its level, an
    axis nothing consumes, a second split or a stream of another axis in the same launch."""
    errors = []
    if p.level != compute_level:
        errors.append(RelabelError(
            f"split partitions run at the compute level ({compute_level}); {p.axis!r} is split at {p.level}",
            p.span, f"write it on the {compute_level}: line"))
        return errors
    launches = [(i, statements) for i, (statements, _, _) in enumerate(split)
                if p.applies_to(i) and p.axis in {a for s in statements for a in s.iteration_axes}]
    if not any(p.axis in s.consumed for _, statements in launches for s in statements):
        errors.append(RelabelError(
            f"cannot split {p.axis}: no statement consumes it; a split cuts a reduced, contracted or streamed axis "
            f"into parts whose states merge", p.span, f"did you mean 'group {p.axis} {p.size}'?"))
        return errors
    for index, statements in launches:
        others = [q for q in partitions if q is not p and q.applies_to(index) and q.level == p.level
                  and ((q.kind == "split") or (q.kind == "stream" and q.axis != p.axis
                                               and q.axis in {a for s in statements for a in s.iteration_axes}))]
        if others:
            q = others[0]
            errors.append(RelabelError(
                f"cannot split {p.axis}: the launch computing {', '.join(s.target for s in statements)} also "
                f"{'splits' if q.kind == 'split' else 'streams'} {q.axis}; napkin splits one axis per launch, and streams "
                f"within its parts only that axis", q.span, f"stream {p.axis} within the split, or split {q.axis} instead"))
    return errors


def merge_errors(p: Partition, statements, roles: StreamRoles, diagram: Diagram) -> list[RelabelError]:
    """Why the parts of split ``p`` cannot merge in the launch of ``statements``: a consumer of
    the axis without an associative merge, or a statement after the merge that reads a value the
    parts computed and did not merge."""
    errors = []
    merged = set()
    for s in statements:
        role = roles.roles[s.index]
        if p.axis in s.consumed and role not in MERGEABLE_ROLES:
            errors.append(RelabelError(
                f"cannot split {p.axis}: {s.target}[{' '.join(s.axes)}] ({line_of(s)}) consumes {p.axis!r} as "
                f"{role}, which has no merge of its parts' states",
                s.span or p.span, f"leave {p.axis} unsplit, or stream it: 'stream {p.axis} {p.size}'"))
        if role in MERGEABLE_ROLES:
            merged.add(s.target)
    for s in statements:
        if roles.roles[s.index] != "post":
            continue
        unmerged = [n for n in s.inputs if diagram.producer(n) is not None and n not in merged
                    and any(n == t.target for t in statements) and roles.roles[diagram.producer(n).index] != "post"]
        if unmerged:
            errors.append(RelabelError(
                f"cannot split {p.axis}: {s.target} ({line_of(s)}) runs after the parts merge and reads {unmerged[0]}, "
                f"which each part computes on its own and nothing merges",
                s.span or p.span, f"compute {unmerged[0]} after the merge, or leave {p.axis} unsplit"))
    return errors


# ---- building a schedule ------------------------------------------------------------------


def make_schedule(
    diagram: Diagram,
    hardware: str | Hardware,
    block: syn.RelabelBlock | None = None,
    sizes: dict | None = None,
    extra_partitions: tuple[Partition, ...] = (),
) -> Schedule:
    """Check a relabelling of ``diagram`` on ``hardware`` and build its :class:`Schedule`.

    ``sizes`` binds symbols (axes and partition sizes) to integers. All problems are
    reported together as :class:`RelabelError`, in the order of the steps below.
    """
    profile = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    sizes = dict(sizes or {})
    split = split_launches(diagram, profile)
    partitions, device, errors = _clause_partitions(diagram, profile, block, split)
    partitions += list(extra_partitions)
    levels, warp_tiles = _levels_involved(profile, partitions)
    for p in partitions:
        errors += _partition_errors(p, partitions, split, levels[-1], warp_tiles, diagram)
    partitions += _split_streams(partitions, split)
    errors += _stream_count_errors(partitions, split)
    launches, launch_errors = _launches(diagram, partitions, split)
    errors += launch_errors
    errors += _materialisation_errors(diagram, profile)
    errors += _window_source_errors(diagram, profile)
    raise_collected(errors)
    parts = {part_axis(p.axis): (p.axis, p.size) for p in partitions if p.kind == "split"}
    notes = _carried_notes(diagram, profile, split) + _ragged_notes(diagram, partitions, sizes) + _window_notes(diagram)
    return Schedule(diagram, profile, tuple(partitions), levels, tuple(launches), sizes, tuple(notes), parts,
                    device=tuple(device), overlap=block.overlap if block is not None else None)


def _clause_partitions(diagram: Diagram, profile: Hardware, block, split: list) -> tuple[list, list, list]:
    """The relabel block's clauses as partitions: (partitions below the top, partitions across
    the GPUs of a node, errors), each clause held to the checks below in turn."""
    launch_of = {s.target: index for index, (statements, _, _) in enumerate(split) for s in statements}
    clauses = [(c.level, p) for c in (block.levels if block else ()) for p in c.partitions]
    partitions: list[Partition] = []
    seen: dict[tuple[str, str], list[Partition]] = {}
    device: list[Partition] = []  # clauses at the device level (profile.device): across the GPUs
    errors: list[RelabelError] = []
    unknown_levels: set[str] = set()
    for level, p in clauses:
        if level not in profile.level_names():
            if level not in unknown_levels:  # one error per level the profile lacks
                unknown_levels.add(level)
                errors.append(RelabelError(
                    f"the relabelling names level {level!r}, which {profile.name} does not have (levels: {', '.join(profile.level_names())})",
                    p.span, f"relabel the kernel for {profile.name}, or plan it on {block.hardware}",
                ))
            continue
        error = _unknown_axis_error(diagram, p)
        if error is None and level == profile.top.name and profile.device is not None:
            # A clause at the top level of a node of GPUs partitions across its GPUs (the device level).
            reason = device_partition_error(p, device, profile)
            if reason is None:
                device.append(Partition(level, p.kind, p.axis, size_expr(p.size), p.span))
                continue
            error = RelabelError(reason[0], p.span, reason[1])
        error = error or _top_clause_error(level, p, profile)
        launches_of = None
        if error is None and p.targets is not None:
            error = _targets_error(diagram, level, p, launch_of, split)
            launches_of = frozenset(launch_of[t] for t in p.targets) if error is None else None
        error = error or _twice_error(level, p, seen.get((level, p.axis), []), launches_of) or _size_error(p)
        if error is not None:
            errors.append(error)
            continue
        partition = Partition(level, p.kind, p.axis, size_expr(p.size), p.span, launches=launches_of, targets=p.targets)
        seen.setdefault((level, p.axis), []).append(partition)
        partitions.append(partition)
    return partitions, device, errors


def _unknown_axis_error(diagram: Diagram, p) -> RelabelError | None:
    """A clause partitions an axis the kernel has."""
    if p.axis in diagram.axes:
        return None
    import difflib

    close = difflib.get_close_matches(p.axis, list(diagram.axes), n=2)
    return RelabelError(
        f"cannot {p.kind}-partition {p.axis!r}: kernel {diagram.name} has no such axis (axes: {' '.join(diagram.axes)})",
        p.span, f"did you mean {' or '.join(close)}?" if close else None,
    )


def _top_clause_error(level: str, p, profile: Hardware) -> RelabelError | None:
    """On one GPU nothing partitions the top level: it holds whole arrays."""
    top = profile.top.name
    if level != top:
        return None
    return RelabelError(f"cannot partition at the top level {top!r}: it holds whole arrays", p.span,
                        f"partition at a level below, e.g. {profile.levels[1].name}"
                        + "; or plan on a node of GPUs (H100x8), where a clause at gmem partitions across them")


def _targets_error(diagram: Diagram, level: str, p, launch_of: dict, split: list) -> RelabelError | None:
    """A scoped clause (`smem for O:`) names arrays the kernel computes, in a launch that has its axis."""
    unknown = [t for t in p.targets if t not in launch_of]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], list(launch_of), n=2)
        return RelabelError(
            f"'{level} for {', '.join(p.targets)}' names {unknown[0]!r}, which no statement of {diagram.name} computes",
            p.span, f"did you mean {' or '.join(close)}?" if close else f"name arrays the kernel computes: {', '.join(launch_of)}",
        )
    launches_of = frozenset(launch_of[t] for t in p.targets)
    if not any(p.axis in {a for s in split[i][0] for a in s.iteration_axes} for i in launches_of):
        return RelabelError(
            f"cannot {p.kind}-partition {p.axis!r} for {', '.join(p.targets)}: the launch computing it has no axis {p.axis!r}",
            p.span, "scope the clause to a launch that has the axis",
        )
    return None


def _twice_error(level: str, p, earlier: list, launches_of) -> RelabelError | None:
    """An axis is partitioned once per level and launch (a split's parts are streamed by a
    stream of its axis, which is not a clash)."""
    clash = [q for q in earlier
             if (q.launches is None or launches_of is None or q.launches & launches_of)
             and {q.kind, p.kind} != {"split", "stream"}]
    if not clash:
        return None
    return RelabelError(f"axis {p.axis!r} is partitioned twice at level {level} for the same launch", p.span,
                        f"first partitioned at {clash[0].span}")


def _size_error(p) -> RelabelError | None:
    if isinstance(p.size, int) and p.size <= 0:
        return RelabelError(f"{p.kind} size of {p.axis!r} must be positive, got {p.size}", p.span)
    return None


def _levels_involved(profile: Hardware, partitions: list) -> tuple[tuple[str, ...], list]:
    """The levels involved (the top, every level down to the compute level or the lowest
    partitioned level, whichever is lower) and the warp tiles among the partitions.

    A group partition at a per-thread level below the compute level (`registers: group q 16`)
    is the warp tile of the tensor-core path (isel.py): it splits a block's rows among warps
    and does not move the compute level."""
    names = profile.level_names()
    below_compute = set(names[names.index(profile.compute_level.name) + 1:])
    warp_tiles = [p for p in partitions if p.level in below_compute and profile.level(p.level).per == "thread"]
    lowest = max([names.index(profile.compute_level.name)] + [names.index(p.level) for p in partitions if p not in warp_tiles])
    return tuple(names[: lowest + 1]), warp_tiles


def _partition_errors(p: Partition, partitions: list, split: list, compute_level: str, warp_tiles: list,
                      diagram: Diagram) -> list[RelabelError]:
    """What is wrong with partition ``p`` by its kind: a group of an axis some statement
    consumes (other than a sum over the groups: :func:`summed_over_groups`), a split
    (:func:`split_errors`), a stream below or above the compute level."""
    if p.kind == "group":
        # each consumer of the axis, with why its groups cannot sum (None: they can)
        refused = [(s, why) for i, (statements, _, outputs) in enumerate(split) if p.applies_to(i)
                   for s in statements if p.axis in s.consumed
                   if (why := _summed_refusal(s, statements, outputs, diagram, partitions, i, p.axis)) is not None]
        if not refused:
            return []
        consumers = [s for s, _ in refused]
        if all(isinstance(s.box, Contract) for s in consumers):
            s, why = refused[0]
            return [RelabelError(
                f"cannot group-partition {p.axis}: {s.target} ({line_of(s)}) contracts it, and its groups' partial sums "
                f"add into {s.target} only where {why}",
                p.span, f"did you mean 'stream {p.axis} {p.size}'?",
            )]
        described = ", ".join(
            f"{s.box.kind if not isinstance(s.box, Softmax) else f'softmax[{s.box.axis}]'} {s.target} ({line_of(s)})"
            for s in consumers
        )
        return [RelabelError(
            f"cannot group-partition {p.axis}: it is consumed by {described}; "
            f"group partitions need an axis the algorithm is woven over",
            p.span, f"did you mean 'stream {p.axis} {p.size}'?",
        )]
    if p.kind == "split":
        return split_errors(p, partitions, split, compute_level)
    if p.level == compute_level:
        return []
    if p in warp_tiles:
        return [RelabelError(
            f"{p.level} takes warp tiles (group partitions) only; streams run at the compute level ({compute_level})",
            p.span, f"stream {p.axis} on the {compute_level}: line",
        )]
    return [RelabelError(
        f"stream partitions run at the compute level ({compute_level}); {p.axis!r} is streamed at {p.level}",
        p.span, f"write it on the {compute_level}: line",
    )]


# The dtype a sum over groups adds in: each group adds its partial sum into the output in device
# memory (atomicAdd on f32 in CUDA, a compare-and-swap loop in OpenCL).
SUMMED_DTYPE = "f32"


def _summed_refusal(s: Statement, statements: list, outputs: list, diagram: Diagram, partitions: list, index: int,
                    axis: str) -> str | None:
    """Why contraction ``s`` cannot sum over the groups of ``axis`` (None: it can). A group
    partition of an axis a contraction consumes leaves each group a partial sum; each adds it into
    the output in device memory (pseudocode.Step.add), which starts at zero: the contraction's
    target must be an output of its launch, in ``SUMMED_DTYPE``, that nothing in the launch reads
    (it holds a partial sum until every group has added), and the axis must not also be streamed or
    split in the launch."""
    if not isinstance(s.box, Contract):
        return f"a {s.box.kind} box consumes it"
    if s.target not in outputs:
        return f"{s.target} is saved to device memory by its launch (mark it @gmem, or make it an output)"
    if diagram.arrays[s.target].dtype != SUMMED_DTYPE:
        return (f"{s.target} is {SUMMED_DTYPE} (it is {diagram.arrays[s.target].dtype}: the groups add atomically in {SUMMED_DTYPE}; "
                f"compute it {SUMMED_DTYPE} @gmem and cast it in a statement of its own)")
    readers = [r.target for r in statements if s.target in r.inputs]
    if readers:
        return f"nothing in its launch reads it ({', '.join(readers)} does, before every group has added)"
    # a group of an axis the contraction does not iterate computes it again, and would add it again
    again = next((q.axis for q in partitions if q.kind == "group" and not q.derived and q.applies_to(index)
                  and q.axis not in s.iteration_axes), None)
    if again is not None:
        return f"every group computes it once ({again} is grouped, and {s.target} is computed again in each group of {again})"
    # the kernels stream an axis over its whole size, never over a group's range of it
    other = next((q for q in partitions if q.axis == axis and q.kind in ("stream", "split") and q.applies_to(index)), None)
    if other is not None:
        return f"{axis} is not also {'streamed' if other.kind == 'stream' else 'split'} in its launch"
    return None


def summed_over_groups(schedule: Schedule, launch: Launch) -> dict[str, tuple[str, ...]]:
    """The contractions of ``launch`` that sum over the groups of an axis they consume: target ->
    those axes. Each group adds its partial sum into the target (``pseudocode.Step.add``)."""
    grouped = {p.axis for p in schedule.partitions if p.kind == "group" and not p.derived and p.applies_to(launch.index)}
    return {s.target: tuple(a for a in s.box.contracted if a in grouped) for s in launch.statements
            if isinstance(s.box, Contract) and grouped & set(s.box.contracted)}


def _split_streams(partitions: list, split: list) -> list[Partition]:
    """A split streams its axis within each part: by the launch's stream of that axis, or by one
    napkin adds, of the split's size (each part one chunk). Returns the streams it adds."""
    added: list[Partition] = []
    for p in [q for q in partitions if q.kind == "split"]:
        for index, (statements, _, _) in enumerate(split):
            if not p.applies_to(index) or p.axis not in {a for s in statements for a in s.iteration_axes}:
                continue
            if not any(q.kind == "stream" and q.axis == p.axis and q.applies_to(index) for q in partitions + added):
                added.append(Partition(p.level, "stream", p.axis, p.size, p.span, launches=frozenset({index}), targets=p.targets))
    return added


def _stream_count_errors(partitions: list, split: list) -> list[RelabelError]:
    """A launch streams one axis per level: one error per second stream, once per clause."""
    errors = []
    reported: set[Span | None] = set()
    for index, (statements, _, _) in enumerate(split):
        axes_here = {a for s in statements for a in s.iteration_axes}
        streams = [p for p in partitions if p.kind == "stream" and p.applies_to(index) and p.axis in axes_here]
        if len(streams) > 1 and streams[1].span not in reported:
            reported.add(streams[1].span)
            errors.append(RelabelError(
                f"{streams[0].level} streams {len(streams)} axes ({', '.join(p.axis for p in streams)}) in the launch computing "
                f"{', '.join(s.target for s in statements)}; napkin streams one axis per level",
                streams[1].span, "keep one stream and group or leave unpartitioned the others, or scope them to different launches "
                                 f"(e.g. '{streams[0].level} for {statements[-1].target}: ...')",
            ))
    return errors


def _launches(diagram: Diagram, partitions: list, split: list) -> tuple[list[Launch], list[RelabelError]]:
    """Each launch with the roles its statements play in its streams (:func:`stream_roles`),
    and why a stream cannot run (as its split's refusal where the stream is a split's) or a
    split's parts cannot merge (:func:`merge_errors`)."""
    launches, errors = [], []
    for index, (statements, inputs, outputs) in enumerate(split):
        axes_here = {a for s in statements for a in s.iteration_axes}
        roles = []
        for p in partitions:
            if p.kind != "stream" or p.axis not in axes_here or not p.applies_to(index):
                continue
            cut = next((q for q in partitions if q.kind == "split" and q.axis == p.axis and q.applies_to(index)), None)
            try:
                found = stream_roles(statements, inputs, outputs, diagram, p.axis, p.span)
            except RelabelError as error:
                if cut is None:
                    errors.append(error)
                else:  # the split's parts could not even stream: say so as the split's refusal
                    errors.append(RelabelError(
                        f"cannot split {p.axis}: its parts stream, and {error.message.removeprefix(f'cannot stream {p.axis}: ')}",
                        error.span, error.hint))
                continue
            if cut is not None:
                errors += merge_errors(cut, statements, found, diagram)
            roles.append(found)
        launches.append(Launch(index, tuple(statements), tuple(inputs), tuple(outputs), tuple(roles)))
    return launches, errors


def _materialisation_errors(diagram: Diagram, profile: Hardware) -> list[RelabelError]:
    """napkin materialises at the top level only (``@gmem``)."""
    top = profile.top.name
    return [RelabelError(
        f"{statement.target} is materialised at @{statement.level}; napkin materialises only at the top level {top!r}",
        statement.span, f"write @{top}, or drop the @level to keep {statement.target} on chip",
    ) for statement in diagram.statements if statement.level is not None and not is_top(statement.level, profile)]


def _carried_notes(diagram: Diagram, profile: Hardware, split: list) -> list[str]:
    """A note for each array a later launch reads that napkin saves to the top level for it."""
    top = profile.top.name
    return [f"{producer.target} ({line_of(producer)}) is read by {reader.target} ({line_of(reader)}) after a launch boundary: "
            f"napkin saves it to {top} and loads it there, as if it were written {producer.target}[{' '.join(producer.axes)}] @{top}"
            for producer, reader in carried_across(diagram, profile, split)]


def _window_source_errors(diagram: Diagram, profile: Hardware) -> list[RelabelError]:
    """A window read of an intermediate gathers from device memory: the intermediate must be
    materialised at the top level of ``profile``, not at a level below it."""
    errors = []
    for view in diagram.views:
        source = diagram.arrays[view.window.source]
        if source.role == "intermediate" and not is_top(source.level, profile):
            errors.append(RelabelError(
                f"{view.window.source} is read through a window ({view.window.text(source.axes)}), which gathers from "
                f"device memory, but it is " + (f"materialised at @{source.level}, below {profile.name}'s top level"
                                                 if source.level else "kept on chip"),
                source.span, f"materialise it at the top: @{profile.top.name}"))
    return errors


def _window_notes(diagram: Diagram) -> list[str]:
    """A note for each window read's view: what it is, and how a launch loads it."""
    return [f"{view.name}[{' '.join(view.axes)}] is {view.window.text(diagram.arrays[view.window.source].axes)}: "
            f"each tile is gathered from {view.window.source}, reading from device memory the box of "
            f"{view.window.source} its indices span (halo included), and holding the view's tile on chip"
            for view in diagram.views]


def _ragged_notes(diagram: Diagram, partitions: list, sizes: dict) -> list[str]:
    """A note for each partition of the user's whose size does not divide its axis (one of the
    kernel's: partitions of a split's part axis are the combine launch's, made in pseudocode.py):
    the last group or chunk is masked."""
    notes = []
    for p in partitions:
        if p.derived:
            continue  # napkin's own L2 grouping: its tails are whole groups, not worth a note
        axis_size = bind(diagram.size(p.axis), sizes)
        size = bind(p.size, sizes)
        if axis_size.is_number and size.is_number and axis_size % size != 0:
            notes.append(
                f"{p.kind} {p.axis} {size} does not divide {p.axis} = {axis_size}: "
                f"{algebra.ceiling(axis_size / size)} {'groups' if p.kind == 'group' else 'chunks'}, the last one masked "
                f"({axis_size - (algebra.ceiling(axis_size / size) - 1) * size} of {size})"
            )
    return notes


def device_partition_error(p, device: list, profile: Hardware) -> tuple[str, str] | None:
    """Why clause ``p`` (at the top level of ``profile``, a node of GPUs) cannot partition across
    its GPUs, as (message, hint); None where it can: one ``group`` (tensor parallelism: each GPU
    holds SIZE of the axis) or one ``split`` (context parallelism: each GPU streams a part of a
    consumed axis, and the parts' states merge on GPU 0)."""
    top = profile.top.name
    if p.kind not in ("group", "split"):
        return (f"cannot {p.kind} {p.axis} at {top} on {profile.name}: a clause at {top} partitions across the "
                f"{profile.device.units} GPUs of the {profile.device.name}, in parallel; a {p.kind} runs in sequence",
                f"'{top}: group {p.axis} SIZE' (each GPU holds SIZE of {p.axis}) or '{top}: split {p.axis} SIZE'")
    if device:
        return (f"{profile.name} partitions one axis across its GPUs; {top} already has {device[0].kind} {device[0].axis}",
                f"keep one clause at {top}, and partition further at {profile.levels[1].name} or below")
    if isinstance(p.size, int) and p.size <= 0:
        return f"{p.kind} size of {p.axis!r} must be positive, got {p.size}", "a positive size"
    return None
