"""Planning: relabel, elaborate and, on GPUs, derive the L2 grouping.

``plan`` is the one function every later stage calls to get a
:class:`~napkin_dsl.pseudocode.Program` for a diagram on a hardware profile with bound sizes.
It adds one decision the user does not write: on profiles with a device-wide L2 between
device memory and the compute level, the thread blocks running at the same time share what
they load through L2. napkin models them as a group partition at the L2 level (see
``pseudocode.l2_candidates``) and picks the grouping that moves the fewest bytes from device
memory while its tiles fit in L2. It weighs the candidates with :func:`l2_traffic`, a closed
form of what the Program elaborated with each would move (proven equal to it by a test), so
the choice and the report count the same bytes.

It also builds the variants of a diagram the tuner compares when it decides fusion
(:func:`materialise`): the same statements with a different set of intermediates
materialised at the top level, as if ``@gmem`` had been written on them.

It does not price the result (``cost.py``) or search user-visible sizes (``tune.py``).
"""

from __future__ import annotations

import dataclasses

from . import syntax as syn
from .check import check_size_bounds
from .algebra import as_number
from .cost import columns, max_of
from .dtypes import DTYPE_BYTES
from .diagram import Diagram, intermediate_dtype, source_dtypes
from .errors import NapkinError
from .hardware import Hardware, load_hardware
from .pseudocode import LaunchProgram, Program, co_resident_blocks, elaborate, l2_candidates
from .relabel import Partition, Schedule, is_top, make_schedule
from .windows import completed_sizes


def split_points(diagram: Diagram, profile: Hardware) -> tuple[str, ...]:
    """The statements whose materialisation at the top level is a fusion choice: every one but
    the last that is not written at a level below the top (``@smem`` stays as written)."""
    return tuple(s.target for s in diagram.statements[:-1] if s.level is None or is_top(s.level, profile))


def materialised(diagram: Diagram, profile: Hardware) -> frozenset:
    """The statements the diagram materialises at the top level, as written."""
    return frozenset(s.target for s in diagram.statements if is_top(s.level, profile))


def materialise(diagram: Diagram, profile: Hardware, chosen) -> Diagram:
    """``diagram`` with exactly the split points in ``chosen`` materialised at the top level.

    Dtypes follow the checker's rule (check.py, ``_KernelChecker.statement``): a materialised
    intermediate is stored at the width of the widest stored array it is computed from
    (diagram.intermediate_dtype), one kept on chip is computed in
    the accumulation dtype; outputs keep their declared dtype. A change propagates to the
    statements that read it. The input diagram is not changed.
    """
    chosen = frozenset(chosen)
    points = set(split_points(diagram, profile))
    unknown = chosen - points
    if unknown:
        raise NapkinError(f"cannot materialise {', '.join(sorted(unknown))} of {diagram.name}: the split points are "
                          f"{', '.join(sorted(points)) or 'none'}", hint="the last statement and @level writes below the top stay as written")
    if chosen == materialised(diagram, profile) & points:
        return diagram
    top = profile.top.name
    arrays = dict(diagram.arrays)
    producers = {s.target: s for s in diagram.statements}
    statements = []
    for s in diagram.statements:
        level = s.level
        if s.target in points:
            level = top if s.target in chosen else None
        array = arrays[s.target]
        if array.role != "output":
            # A dtype written on a materialisation (H @gmem bf16 = ...) stays while H stays there.
            default = intermediate_dtype((diagram.arrays[n].dtype for n in s.inputs),
                                         source_dtypes(s.inputs, diagram.arrays, producers), True)
            written = s.level is not None and array.dtype != default
            kept = written and level == s.level
            dtype = array.dtype if kept else intermediate_dtype((arrays[name].dtype for name in s.inputs),
                                                               source_dtypes(s.inputs, arrays, producers), level is not None)
            arrays[s.target] = dataclasses.replace(array, dtype=dtype, level=level)
        else:
            arrays[s.target] = dataclasses.replace(array, level=level)
        statements.append(dataclasses.replace(s, level=level, dtype=arrays[s.target].dtype))
    return dataclasses.replace(diagram, arrays=arrays, statements=tuple(statements))


def shared_cache_level(schedule: Schedule) -> str | None:
    """The device-wide level between the top and the compute level, if the profile has one."""
    hardware = schedule.hardware
    for name in schedule.levels[1:-1]:
        level = hardware.level(name)
        if level.per == "device" and not schedule.partitions_at(name):
            return name
    return None


def l2_traffic(view: Schedule, launch: LaunchProgram, candidate: tuple[Partition, ...]) -> tuple[int, int]:
    """(bytes moved into and out of L2, bytes resident in L2 per group) of one launch of a
    Program under a candidate L2 grouping; ``view`` is the schedule as that launch sees it.

    A closed form, kept because :func:`plan` weighs every candidate grouping of every launch
    (up to a few hundred) and elaborating each costs 10 to 20 times as much. It is the
    Program's count, not a model of its own: the bytes moved are what the Program elaborated
    with the candidate loads into and saves out of L2 (each input and output in full, times
    the L2 groups over axes it does not carry, ``cost.level_costs``' H in bytes), and the bytes
    resident are the Program's L2 buffers at their L2 tile, except along a streamed axis, where
    the co-resident blocks hold only the chunks in flight (the Program's L2 columns hold whole
    tiles; a cache holds what is in use). tests/test_one_source.py proves both equal to the
    Program's on every example, GPU profile and candidate.

    The arrays are the launch's own, read off its buffers at the top level: a split's parts
    launch saves its part states (``O.acc.part``, along the part axis) instead of the outputs
    it merges into, and its combine launch loads them; neither has the schedule launch's
    inputs and outputs.
    """
    return L2Traffic(view, launch)(candidate)


class L2Traffic:
    """:func:`l2_traffic` of one launch, its arrays and sizes read once: :func:`plan` weighs
    hundreds of candidates a launch, and the tuner plans hundreds of configurations."""

    def __init__(self, view: Schedule, launch: LaunchProgram):
        self.view = view
        self.streamed = {p.axis: int(view.extent(p.axis, view.compute_level)) for p in view.partitions_at(view.compute_level, "stream")}
        self.here = set(launch.launch.axes)
        self.full: dict[str, int] = {}
        top = view.levels[0]
        # (bytes of an element, the array's axes, their full sizes) of each array at the top level
        self.arrays = [(DTYPE_BYTES[array.dtype], tuple(array.axes), tuple(self.size(axis) for axis in array.axes))
                       for (level, _), array in launch.buffers.items() if level == top]

    def size(self, axis: str) -> int:
        if axis not in self.full:
            self.full[axis] = int(self.view.axis_size(axis))
        return self.full[axis]

    def __call__(self, candidate: tuple[Partition, ...]) -> tuple[int, int]:
        parts = [(p.axis, int(p.size)) for p in candidate if p.axis in self.here]
        extents: dict[str, int] = {}
        for axis, size in parts:
            extents.setdefault(axis, size)  # the first partition of an axis, as written
        moved = resident = 0
        for width, axes, fulls in self.arrays:
            size = tile = width
            for axis, full in zip(axes, fulls, strict=True):
                size *= full
                extent = extents.get(axis, full)
                # Co-resident blocks walk a stream together: L2 holds the chunks in flight,
                # not the whole streamed axis.
                if axis in self.streamed:
                    extent = min(extent, self.streamed[axis])
                tile *= min(extent, full)
            for axis, group in parts:
                if axis not in axes:
                    size *= -(-self.size(axis) // group)  # ceiling, in integers: exact at any size
            moved += size
            resident += tile
        return moved, resident


def scoped(partitions, program: Program, launch: LaunchProgram) -> list[Partition]:
    """``partitions`` scoped to one launch of ``program``. Partitions name the schedule's
    launches; a split launch of the schedule is two of the Program (its parts, then their
    combine, which see the same schedule launch), so they also name which of the two."""
    several = len(program.schedule.launches) > 1
    shared = sum(other.launch.index == launch.launch.index for other in program.launches) > 1
    return [dataclasses.replace(p, launches=frozenset({launch.launch.index}) if several else None,
                                combine=(launch.combine is not None) if shared else None) for p in partitions]


def plan(diagram: Diagram, hardware: str | Hardware, block: syn.RelabelBlock | None = None, sizes: dict | None = None) -> Program:
    """Schedule and elaborate ``diagram``; on GPUs with bound sizes, add the derived L2 grouping.

    Each launch has its own block grid, so each gets its own L2 grouping (partitions scoped to
    that launch). Sizes past ``check.MAX_SIZE`` (2^63 - 1, for one size or one statement's
    iteration space) are refused first, with an error naming them.
    """
    profile = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    check_size_bounds(diagram, block, sizes or {})  # before any count is formed from them
    sizes = completed_sizes(diagram, sizes or {})  # a convolution's output length, from its window read
    schedule = make_schedule(diagram, profile, block, sizes)
    program = elaborate(schedule)
    level = shared_cache_level(schedule)
    if level is None or not all(as_number(schedule.axis_size(a)) is not None for a in diagram.axes):
        return program
    rows = columns(program)
    capacity = profile.level(level).capacity
    derived: list[Partition] = []
    notes: list[str] = []
    for launch in program.launches:
        smem_bytes = max_of(row["M_bytes"].get(schedule.compute_level, 0) for row in rows if row["launch"] == launch.index)
        if as_number(smem_bytes) is None:
            continue
        blocks = co_resident_blocks(launch.schedule, smem_bytes)
        best = smallest = None
        traffic = L2Traffic(launch.schedule, launch)
        for candidate in (l2_candidates(launch.schedule, level, blocks) if blocks else []):
            moved, resident = traffic(candidate)
            if smallest is None or (resident, moved) < smallest[0]:
                smallest = ((resident, moved), candidate)
            if isinstance(capacity, int) and resident > capacity:
                continue
            if best is None or (moved, resident) < best[0]:
                best = ((moved, resident), candidate)
        if best is None and smallest is not None:
            # L2 is a cache: when no box of co-resident blocks keeps its chunks in it, nothing
            # loaded by one block is assumed to survive for the next. The smallest box (one
            # block per group, on a grid) charges every block's loads from HBM.
            best = ((smallest[0][1], smallest[0][0]), smallest[1])
            notes.append(f"warning: {level} ({capacity:,} B) cannot hold what co-resident blocks share in launch "
                         f"{launch.index}: the smallest working set is {smallest[0][0]:,} B; no reuse through {level} "
                         f"is assumed, each block's loads are charged from {profile.top.name}")
        if best is not None:
            derived += scoped(best[1], program, launch)
    if not derived:
        return _with_notes(program, notes)
    return _with_notes(elaborate(make_schedule(diagram, profile, block, sizes, extra_partitions=tuple(derived))), notes)


def _with_notes(program: Program, notes: list[str]) -> Program:
    if not notes:
        return program
    schedule = dataclasses.replace(program.schedule, notes=tuple(program.schedule.notes) + tuple(notes))
    return dataclasses.replace(program, schedule=schedule)
