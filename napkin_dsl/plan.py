"""Planning: relabel, elaborate and, on GPUs, derive the L2 grouping.

``plan`` is the one function every later stage calls to get a
:class:`~napkin_dsl.pseudocode.Program` for a diagram on a hardware profile with bound sizes.
It adds one decision the user does not write: on profiles with a device-wide L2 between
device memory and the compute level, the thread blocks running at the same time share what
they load through L2. napkin models them as a group partition at the L2 level (see
``pseudocode.l2_candidates``) and picks the grouping that moves the fewest bytes from device
memory while its tiles fit in L2.

It does not price the result (``cost.py``) or search user-visible sizes (``tune.py``).
"""

from __future__ import annotations

import math

from . import syntax as syn
from .cost import as_number, columns, max_of
from .diagram import Diagram
from .hardware import Hardware, load_hardware
from .pseudocode import Program, co_resident_blocks, elaborate, l2_candidates
from .relabel import Partition, Schedule, make_schedule


def shared_cache_level(schedule: Schedule) -> str | None:
    """The device-wide level between the top and the compute level, if the profile has one."""
    hardware = schedule.hardware
    for name in schedule.levels[1:-1]:
        level = hardware.level(name)
        if level.per == "device" and not schedule.partitions_at(name):
            return name
    return None


def _l2_traffic(schedule: Schedule, candidate: tuple[Partition, ...]) -> tuple[int, int]:
    """(bytes moved into L2, bytes resident in L2 per group) for a candidate L2 grouping."""
    diagram = schedule.diagram
    moved = resident = 0
    for launch in schedule.launches:
        view = schedule.for_launch(launch.index)
        streamed = {p.axis: int(view.extent(p.axis, view.compute_level)) for p in view.partitions_at(view.compute_level, "stream")}
        here = set(launch.axes)
        parts = [p for p in candidate if p.axis in here]
        for name in tuple(launch.inputs) + tuple(launch.outputs):
            array = diagram.arrays[name]
            nbytes = array.bytes_per_value
            size = nbytes
            tile = nbytes
            for axis in array.axes:
                full = int(schedule.axis_size(axis))
                size *= full
                extent = next((int(p.size) for p in parts if p.axis == axis), full)
                # Co-resident blocks walk a stream together: L2 holds the chunks in flight,
                # not the whole streamed axis.
                if axis in streamed:
                    extent = min(extent, streamed[axis])
                tile *= min(extent, full)
            for p in parts:
                if p.axis not in array.axes:
                    size *= math.ceil(int(schedule.axis_size(p.axis)) / int(p.size))
            moved += size
            resident += tile
    return moved, resident


def plan(diagram: Diagram, hardware: str | Hardware, block: syn.RelabelBlock | None = None, sizes: dict | None = None) -> Program:
    """Schedule and elaborate ``diagram``; on GPUs with bound sizes, add the derived L2 grouping."""
    profile = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    schedule = make_schedule(diagram, profile, block, sizes)
    program = elaborate(schedule)
    level = shared_cache_level(schedule)
    if level is None or not all(as_number(schedule.axis_size(a)) is not None for a in diagram.axes):
        return program
    smem_bytes = max_of(row["M_bytes"].get(schedule.compute_level, 0) for row in columns(program))
    if as_number(smem_bytes) is None:
        return program
    blocks = co_resident_blocks(schedule, smem_bytes)
    candidates = l2_candidates(schedule, level, blocks) if blocks else []
    capacity = profile.level(level).capacity
    best = None
    for candidate in candidates:
        moved, resident = _l2_traffic(schedule, candidate)
        if isinstance(capacity, int) and resident > capacity:
            continue
        key = (moved, resident)
        if best is None or key < best[0]:
            best = (key, candidate)
    if best is None:
        return program
    derived = make_schedule(diagram, profile, block, sizes, extra_partitions=best[1])
    return elaborate(derived)
