"""The performance model, read off a :class:`~napkin_dsl.pseudocode.Program` and nothing else.

Per level below the top (METHOD.md section 5):

* **H** — values moved into and out of the level (loads down into it, saves up from it),
  and the same in bytes by each array's dtype. A step's total is exact, masked tails
  included: the product of the sizes of the axes it moves, times the trip counts of the
  enclosing loops over axes it does not carry (unwoven inputs are charged once per group);
* **M** — memory per unit of the level (per block, per thread, per device): the largest
  total resident in any column of the pseudocode;
* **N** — the number of groups (units of work) at the level;
* FLOPs by unit (tensor cores, FMA pipe, special functions), arithmetic intensity per
  level, and a predicted time: the overlapped roofline (max of compute time and each
  level's transfer time) and the serial sum, with waves of thread blocks over the SMs; and
  the paper's multi-level form, the bandwidth-weighted sum of transfers.

Everything is an expression of napkin's size algebra (``algebra.py``); after sizes are bound they are numbers. This module does
not choose sizes (``tune.py``), and it never looks at the diagram except through the Program.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import algebra
from .algebra import as_number
from .dtypes import DTYPE_BYTES
from .errors import RelabelError
from .formatting import format_count as _fmt
from .formatting import json_value
from .hardware import BUILT_OVERLAP, BUILT_OVERLAPS, OVERLAPS
from .layouts import transpose_split
from .pseudocode import MAX_MASK_GROUPS, Loop, Program, Step, chunk_span, liveness, mask_visits, released_by, split_loop, walk
from .relabel import bind
from .windows import index_span, load_footprint

if TYPE_CHECKING:
    from .isel import ProgramSelection

# ---- small algebra helpers -----------------------------------------------------------------


def max_of(terms) -> algebra.Expr:
    """Max of expressions, 0 of none, dropping terms another provably bounds (so Max(qx, qx + xd)
    = qx + xd): ``algebra.Max``."""
    terms = list(terms)
    return algebra.Max.of(*terms) if terms else algebra.Integer(0)


# ---- totals and columns --------------------------------------------------------------------


def step_total(program: Program, step: Step, loops: tuple[Loop, ...], axes: tuple[str, ...] | None = None,
               partial: bool = False) -> algebra.Expr:
    """Elements a step covers (over ``axes``, default its own) in the whole launch: exact, tails included.

    Inside a stream loop with a Mask, only the chunks each group visits count (their tiles in
    full: a diagonal tile of a causal mask is a whole tile); ``partial`` counts only the chunks
    the mask holds in part (where its test runs). With symbolic sizes the visited chunks have no
    closed form here: every chunk counts, an upper bound the report notes (see masked_note)."""
    schedule = program.schedule
    view = program.diagram.arrays.get(step.array) if axes is None and step.op == "load" else None
    if view is not None and view.window is not None and step.source == schedule.levels[0]:
        return _view_load_total(program, step, loops, view)
    axes = step.axes if axes is None else axes
    masked = next((loop for loop in loops if loop.mask is not None), None)
    if masked is not None:
        counted = masked_elements(program, masked.mask, axes, partial)
        if counted is not None:
            involved = set(masked.mask.axes)
            total = algebra.Integer(counted) * algebra.Mul(*(schedule.axis_size(a) for a in axes if a not in involved))
            for loop in loops:
                if loop.axis not in axes and loop.axis not in involved:
                    total *= loop.trips
            return total
    if partial and masked is None:
        return algebra.Integer(0)
    total = algebra.Mul(*(schedule.axis_size(a) for a in axes))
    for loop in loops:
        # a split's loop over parts counts once for what carries its part axis (a part's state)
        if loop.axis not in axes and loop.part not in axes:
            total *= loop.trips
    return total


def view_tile_box(view, schedule, level: str) -> algebra.Expr:
    """Values of a window read's parameter one tile of ``view`` at ``level`` spans (clipped to
    the parameter where the sizes are bound)."""
    source = schedule.diagram.arrays[view.window.source]
    box = algebra.Integer(1)
    for axis, index in zip(source.axes, view.window.indices, strict=True):
        span = algebra.as_expr(index_span(index, {a: schedule.extent(a, level) for a in index.axes}))
        size = algebra.as_expr(schedule.axis_size(axis))
        box *= min(span, size) if span.is_number and size.is_number else span
    return box


def _view_load_total(program: Program, step: Step, loops: tuple[Loop, ...], view) -> algebra.Expr:
    """What loads of a window read's view from device memory move: each tile's box in its
    parameter (windows.load_footprint), once for every trip of a loop over another axis."""
    schedule = program.schedule
    source = program.diagram.arrays[view.window.source]

    def size(axis):
        value = as_number(schedule.axis_size(axis))
        return int(value) if value is not None else schedule.axis_size(axis)

    # each axis's tile is its innermost loop's (the loops are the launch's own: a relabel clause
    # scoped to another launch partitions nothing here), else the whole axis
    tiles = {}
    for a in view.axes:
        extent = next((loop.tile for loop in reversed(loops) if loop.axis == a), schedule.axis_size(a))
        tiles[a] = int(t) if (t := as_number(extent)) is not None else extent
    total = load_footprint(view, {a: size(a) for a in program.diagram.axes}, tiles, tuple(size(a) for a in source.axes))
    for loop in loops:
        if loop.axis not in view.axes and loop.part not in view.axes:
            total *= loop.trips
    return total


def masked_elements(program: Program, mask, axes, partial: bool = False) -> int | None:
    """Over the tiles of the mask's axes (a group's tile, a chunk of the streamed axis) that a
    masked stream visits (``partial``: only those it holds in part), the sum of the tiles'
    elements along those of ``axes`` the mask constrains; None when a size is symbolic."""
    schedule = program.schedule
    names = set(mask.axes) | {sym.name for c in mask.constraints for sym in c.constant.free_symbols}
    lengths = tuple((name, schedule.axis_size(name)) for name in sorted(names))
    if not all(length.is_number for _, length in lengths):
        return None
    # Every masked step asks, with the same few arguments: the count is a function of them alone.
    return _masked_elements(mask, tuple(axes), partial, tuple((name, int(length)) for name, length in lengths))


@functools.lru_cache(maxsize=256)
def _masked_elements(mask, axes: tuple, partial: bool, lengths: tuple) -> int | None:
    lengths = dict(lengths)
    visits = mask_visits(mask, lambda a: algebra.Integer(lengths[a]))
    if visits is None:
        return None
    tile, length = int(dict(mask.tiles)[mask.axis]), lengths[mask.axis]
    total = 0
    for group in visits:
        rows = math.prod(stop - start for a, (start, stop) in group.ranges.items() if a in axes)
        if mask.axis in axes:
            along = chunk_span(group.first, group.stop, tile, length)
            if partial:  # the visited chunks less those held in full
                held = (max(group.full_first, group.first), min(group.full_stop, group.stop))
                along -= chunk_span(*held, tile, length)
        else:
            along = group.visited - (group.full if partial else 0)
        total += rows * along
    return total


def tile_values(schedule, level: str, axes) -> algebra.Expr:
    """Values in one tile of a buffer at a level (``schedule``: the launch's view)."""
    extents = [schedule.extent(a, level) for a in axes]
    if all(e.is_Integer for e in extents):  # bound sizes: plain integers, no symbolic arithmetic
        return algebra.Integer(math.prod(int(e) for e in extents))
    return algebra.Mul(*extents)


def _total(terms) -> algebra.Expr:
    """Sum of terms, in plain integers when they all are (most of a numeric report)."""
    terms = list(terms)
    if all(t.is_Integer for t in terms):
        return algebra.Integer(sum(int(t) for t in terms))
    return algebra.Add(*terms)


def columns(program: Program, selected: ProgramSelection | None = None) -> list[dict]:
    """The paper's columns: per step, the buffers resident at each level below the top.

    At a step that computes, inputs whose last use is this step are released as the output is
    produced (the paper's convention), so they do not count in its column.

    A launch on tensor cores (``isel.py``) keeps what it computes at the ``registers`` level,
    counted per thread as the fragments its warp tile needs, and holds its shared-memory tiles
    (``stages`` deep where streamed, ``isel.stage_count``) for the whole launch, as the kernel does. A launch on the
    FMA path keeps its streamed contractions' accumulators in registers too, per thread as the
    register blocks each thread owns (``isel.fma_accumulators``), where they fit.

    ``selected`` is the selection pass's result (``isel.select_program``) the columns are read
    for; without one, the pass runs for the profile's own target.
    """
    from .isel import MBARRIER_BYTES, mbarrier_count, slot_array
    from .paths.plan import fragment_values

    selected = _selected(program, selected)
    tensor = tensor_launches(program, selected)
    rows = []
    for launch in program.launches:
        schedule = launch.schedule
        compute = schedule.compute_level
        sequence, spans = liveness(launch.body)
        plan, tile = tensor.get(launch.index, (None, None))
        slots = selected[launch.index].slots if plan is not None else {}
        accumulators = selected[launch.index].kept
        tile_of: dict = {}  # a buffer's tile at its level: the same at every step of the launch
        for index, (step, loops) in enumerate(sequence):
            column = _Column(schedule)
            hold = column.hold
            for ref, (first, last) in spans.items():
                level, name = ref
                if level == schedule.levels[0] or not (first <= index <= last):
                    continue
                if plan is not None and level == compute and name in slots:
                    continue  # held for the whole launch: below
                if released_by(sequence, spans, ref, index):
                    continue
                buffer = launch.buffers[ref]
                if plan is not None and level == compute and name in plan.fragments:
                    held = fragment_values(plan, name, tile)
                    hold("registers", buffer, algebra.Integer(held), 4, f"{name} {held}/thread")
                    continue
                if level == compute and name in accumulators:
                    held = accumulators[name].values
                    hold("registers", buffer, algebra.Integer(held), _bytes(buffer.dtype), f"{name} {held}/thread")
                    continue
                if ref not in tile_of:
                    view = program.diagram.arrays.get(name)
                    if view is not None and view.window is not None and level != compute:
                        # a cache level above the gather holds the parameter's box, not the view
                        tile_of[ref] = view_tile_box(view, schedule, level)
                    else:
                        tile_of[ref] = tile_values(schedule, level, buffer.axes)
                hold(level, buffer, tile_of[ref], _bytes(buffer.dtype))
            for name, slot in slots.items():
                array = slot_array(name)  # a K-major copy (isel.kmajor_name) holds its operand's values again
                buffer = launch.buffers[(compute, array)]
                text = _tile_text(schedule, name, buffer.axes, compute) + (f" x{slot.stages}" if slot.stages > 1 else "")
                # a staged fragment (paths.plan.staged_slot) is held in the product's operand dtype, not its own f32
                size = slot.tile.element_bytes if slot.tile is not None else _bytes(buffer.dtype)
                hold(compute, buffer, algebra.Integer(slot.bytes // size), size, text)
            if plan is not None and mbarrier_count(plan):  # the arena's mbarriers, after the tiles (isel.smem_layout)
                tiles = max((slot.offset + slot.bytes for slot in slots.values()), default=0)
                column.hold_bytes(compute, selected[launch.index].smem_bytes - tiles,
                                  f"mbarriers {mbarrier_count(plan)} x {MBARRIER_BYTES} B")
            resident, shown = column.resident, column.shown
            values = {level: algebra.as_expr(v) for level, v in column.values.items()}
            nbytes = {level: algebra.as_expr(v) for level, v in column.nbytes.items()}
            rows.append({
                "launch": launch.index,
                "step": step,
                "text": step.text,
                "loops": " ".join(f"{lp.axis}/{lp.tile}" for lp in loops) or "-",
                "buffers": resident,
                "resident": _Shown(schedule, shown),
                "M": values,
                "M_bytes": nbytes,
            })
    return rows


class _Column:
    """What one column holds per level: buffers, their display, values and bytes."""

    def __init__(self, schedule):
        self.schedule = schedule
        self.resident: dict[str, list] = {}
        self.shown: dict[str, list] = {}
        self.values: dict = {}
        self.nbytes: dict = {}

    def hold_bytes(self, level, nbytes: int, text: str):
        """Shared memory that holds no array's values (a TMA plan's mbarriers): bytes only."""
        self.shown.setdefault(level, []).append(text)
        self.values.setdefault(level, 0)
        self.nbytes[level] = self.nbytes.get(level, 0) + nbytes

    def hold(self, level, buffer, count, size, text=None):
        self.resident.setdefault(level, []).append(buffer)
        self.shown.setdefault(level, []).append((buffer, level) if text is None else text)  # _Shown formats it
        if count.is_Integer:  # bound sizes: sum plain integers (the tuner reads columns thousands of times)
            count = int(count)
        self.values[level] = self.values.get(level, 0) + count
        self.nbytes[level] = self.nbytes.get(level, 0) + count * size


class _Shown(Mapping):
    """A column's display by level (``"Q[128 64] + K[64 64] x2"``), formatted when it is read: the
    tuner reads the columns of thousands of configurations for their numbers and shows none."""

    def __init__(self, schedule, shown: dict[str, list]):
        self._schedule, self._shown, self._text = schedule, shown, {}

    def __getitem__(self, level: str) -> str:
        if level not in self._text:
            self._text[level] = " + ".join(
                item if isinstance(item, str) else _tile_text(self._schedule, item[0].name, item[0].axes, item[1])
                for item in self._shown[level])
        return self._text[level]

    def __iter__(self):
        return iter(self._shown)

    def __len__(self) -> int:
        return len(self._shown)


def register_transfers(program: Program, step: Step, loops, plan) -> algebra.Expr:
    """Values a tensor-core launch's step moves between shared memory and the tensor cores
    (``paths.plan.shared_reads``)."""
    from .paths.plan import shared_reads

    s = step.statement
    level = program.schedule.compute_level
    if s is None or step.op not in ("compute", "accumulate") or s.target not in plan.mmas or (level, s.target) in step.reads:
        return algebra.Integer(0)
    return shared_reads(plan, s.target, lambda axes: step_total(program, step, loops, axes))


def register_vector_reads(program: Program, step: Step, loops, plan, loaded: frozenset) -> list[tuple[algebra.Expr, int]]:
    """(values, bytes a value) a tensor-core launch's elementwise step reads from plain shared
    tiles (``loaded``: the arrays the launch loads into shared memory that no contraction reads
    by ldmatrix, such as the backward's L, D and dL): each fragment element its thread holds reads
    the value it needs, an upper bound on what the compiler's loads move (it may read a pair of
    elements at once, or reuse a row's value)."""
    from .dtypes import DTYPE_BYTES

    names = vector_reads(program, step, plan, loaded)
    if not names:
        return []
    elements = step_total(program, step, loops)
    return [(elements, DTYPE_BYTES[program.diagram.arrays[name].dtype]) for name in names]


def vector_reads(program: Program, step: Step, plan, loaded: frozenset) -> tuple[str, ...]:
    """The plain shared tiles an elementwise step of a tensor-core launch reads (each counted
    once a fragment element: :func:`register_vector_reads`, and the NumPy backend's count)."""
    level = program.schedule.compute_level
    if step.op != "compute" or step.statement is None:
        return ()
    if step.statement.target in plan.mmas and (step.level, step.statement.target) not in step.reads:
        return ()  # the product itself (ldmatrix's counts); its scale step reads its factor's tiles here
    return tuple(dict.fromkeys(name for lv, name in step.reads
                               if lv == level and name in loaded and name not in plan.operands))


def plain_tiles(launch, level: str) -> frozenset:
    """The arrays a launch loads into shared memory (``level``), for :func:`register_vector_reads`."""
    return frozenset(step.array for step, _ in walk(launch.body) if step.op == "load" and step.level == level)


def statement_columns(program: Program, rows: list[dict] | None = None, selected: ProgramSelection | None = None) -> list[dict]:
    """The paper's columns per statement of the diagram (Figs. 9, 11, 12), read off the Program.

    One dict per statement, in diagram order: ``{"label": target, "M": {level: expr},
    "H": {level: expr}}`` for every level below the top. A statement owns its computing steps
    (init, compute, online, rescale, accumulate, finalise), the loads it reads (a load belongs
    to the next statement in program order that reads the array: the first reader in its
    launch, unless the Program loads the array again for a later reader), and the saves (and
    intermediate-level allocations) of the array it produces. M is the largest residency in
    the columns of its steps; H counts the values its loads and saves move into and out of
    each level, exactly (:func:`step_total`), so the H of all statements adds up to
    :func:`level_costs`' H.
    """
    schedule = program.schedule
    diagram = program.diagram
    selected = _selected(program, selected)
    rows = rows if rows is not None else columns(program, selected)
    tensor = tensor_launches(program, selected)
    held = any("registers" in r["M"] for r in rows)  # an FMA launch's register accumulators
    levels = schedule.levels[1:] + (("registers",) if tensor or held else ())
    order = [s.target for s in diagram.statements]
    memory: dict = {target: {level: [] for level in levels} for target in order}
    moved: dict = {target: {level: algebra.Integer(0) for level in levels} for target in order}
    by_launch: dict = {}
    for row in rows:
        by_launch.setdefault(row["launch"], []).append(row)
    for launch in program.launches:
        statements = launch.launch.statements
        sequence = list(walk(launch.body))
        for index, ((step, loops), row) in enumerate(zip(sequence, by_launch.get(launch.index, []), strict=False)):
            if step.op == "load":
                reader = next((later.statement for later, _ in sequence[index + 1:] if later.statement is not None
                               and any(name == step.array for _, name in later.reads)), None)
                first = next((s for s in statements if step.array in s.inputs), statements[0])
                owner = (reader or first).target
            elif step.statement is not None:
                owner = step.statement.target
            else:  # save, alloc: the statement that produces the array
                producer = diagram.producer(step.array)
                owner = producer.target if producer is not None else statements[0].target
            for level in levels:
                memory[owner][level].append(row["M"].get(level, algebra.Integer(0)))
            if step.op in ("load", "save"):
                moved[owner][step.level] += step_total(program, step, loops) * step.passes
            if launch.index in tensor:
                plan = tensor[launch.index][0]
                moved[owner]["registers"] += register_transfers(program, step, loops, plan)
                for values, _ in register_vector_reads(program, step, loops, plan, plain_tiles(launch, schedule.compute_level)):
                    moved[owner]["registers"] += values
    return [{"label": target,
             "M": {level: max_of(memory[target][level]) for level in levels},
             "H": {level: moved[target][level] for level in levels}}
            for target in order]


def _tile_text(schedule, name: str, axes, level: str) -> str:
    """A buffer's tile as a column shows it: ``Q[128 64]``."""
    return f"{name}[{' '.join(_short(schedule.extent(a, level)) for a in axes)}]"


def _short(value) -> str:
    return str(int(value)) if value.is_Integer else str(value)


def _bytes(dtype: str) -> int:
    return DTYPE_BYTES[dtype]


# ---- the report ----------------------------------------------------------------------------


@dataclass
class LevelCost:
    name: str
    H: algebra.Expr
    H_bytes: algebra.Expr
    M: algebra.Expr
    M_bytes: algebra.Expr
    N: algebra.Expr
    capacity: object = None
    bandwidth: object = None
    per: str = ""
    counts: str = "bytes"  # "values" on the paper's abstract models, whose bandwidths count values

    @property
    def transfer_time(self):
        if self.bandwidth is None:
            return None
        return (self.H if self.counts == "values" else self.H_bytes) / self.bandwidth


def _time_json(value):
    """A time entry as JSON: seconds by level or kind, seconds per launch, a launch's chain, a label
    or a number."""
    if isinstance(value, dict):
        return {name: _time_json(v) for name, v in value.items()}
    if isinstance(value, list):
        return [_time_json(v) for v in value]
    return value if isinstance(value, (str, bool)) or value is None else json_value(value)


@dataclass
class CostReport:
    """Costs of one kernel on one hardware profile, symbolic or numeric.

    ``levels`` maps each level below the top to its :class:`LevelCost`; ``flops`` maps compute
    units to FLOPs; ``time`` holds the predicted times in seconds (None when any size, rate or
    bandwidth is unknown).
    """

    kernel: str
    hardware: str
    sizes: dict
    levels: dict
    flops: dict
    time: dict
    counts: str = "bytes"
    notes: list = field(default_factory=list)
    launches: list = field(default_factory=list)
    device: dict | None = None  # cost.device_cost: what crosses the links of a node of GPUs
    ring: dict | None = None  # cost.ring_condition, on a node of GPUs

    @property
    def total_flops(self) -> algebra.Expr:
        return algebra.Add(*self.flops.values())

    def intensity(self, level: str):
        """Arithmetic intensity at a level: FLOPs per byte moved (per value on the abstract models)."""
        moved = self.levels[level].H if self.counts == "values" else self.levels[level].H_bytes
        if moved == 0:
            return None
        return algebra.cancel(self.total_flops, moved)

    def to_dict(self) -> dict:
        return {
            "hardware": self.hardware,
            "sizes": dict(self.sizes),
            "levels": {
                name: {"H": json_value(c.H), "M": json_value(c.M), "N": json_value(c.N),
                       "H_bytes": json_value(c.H_bytes), "M_bytes": json_value(c.M_bytes),
                       "intensity": json_value(self.intensity(name))}
                for name, c in self.levels.items()
            },
            "flops": json_value(self.total_flops),
            "flops_by_unit": {unit: json_value(v) for unit, v in self.flops.items()},
            "time_s": self.time.get("overlapped_s"),
            "time": {k: _time_json(v) for k, v in self.time.items()},
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        """The table (``print(report)`` shows what ``napkin cost`` prints)."""
        return self.table()

    def __repr__(self) -> str:
        """One line: kernel, hardware, sizes and the prediction (the levels and notes are in the table)."""
        sizes = f" with {_fmt_sizes(self.sizes)}" if self.sizes else ""
        notes = f", {len(self.notes)} note{'s' if len(self.notes) != 1 else ''}" if self.notes else ""
        return f"<CostReport {self.kernel} on {self.hardware}{sizes}: {self.summary()}; levels {', '.join(self.levels)}{notes}>"

    def summary(self, width: int = 60) -> str:
        """The prediction in a few words: ``predicted 5.81 us (compute-bound)``, or, while a size is
        symbolic, the FLOPs (cut to about ``width`` characters). Reprs and notebook views use it."""
        time = self.time.get("overlapped_s")
        if time is not None:
            return f"predicted {_fmt_time(time)} ({self.time.get('bound')}-bound)"
        flops = _fmt(self.total_flops)
        return f"{flops if len(flops) <= width else flops[:width - 3] + '...'} FLOPs"

    def table(self) -> str:
        """A plain-text table: one row per level, then FLOPs and time."""
        unit = "values" if self.counts == "values" else "bytes"
        rows = [("level", "per", "H (values)", f"H ({unit})" if unit == "bytes" else "", "M (values)",
                 "M (bytes)" if unit == "bytes" else "", "capacity", "N", f"FLOP/{'B' if unit == 'bytes' else 'value'}",
                 "transfer time")]
        for name, c in self.levels.items():
            t = c.transfer_time
            intensity = self.intensity(name)
            rows.append((
                name, c.per, _fmt(c.H), _fmt(c.H_bytes) if unit == "bytes" else "", _fmt(c.M),
                _fmt(c.M_bytes) if unit == "bytes" else "", _fmt(c.capacity), _fmt(c.N),
                f"{float(intensity):.1f}" if intensity is not None and intensity.is_number else "-",
                _fmt_time(t) if t is not None and algebra.as_expr(t).is_number else (str(t) if t is not None else "-"),
            ))
        keep = [i for i in range(len(rows[0])) if any(r[i] for r in rows)]
        rows = [tuple(r[i] for i in keep) for r in rows]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"cost of {self.kernel} on {self.hardware}" + (f" with {_fmt_sizes(self.sizes)}" if self.sizes else "")]
        for row in rows:
            lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        lines.append("  FLOPs: " + ", ".join(f"{unit} {_fmt(v)}" for unit, v in self.flops.items()) + f"  (total {_fmt(self.total_flops)})")
        if self.time.get("overlapped_s") is not None:
            t = self.time
            lines.append(
                f"  predicted time: {_fmt_time(t['overlapped_s'])} overlapped ({t['bound']}-bound), "
                f"{_fmt_time(t['serial_s'])} serial; compute {_fmt_time(t['compute_s'])}"
                + (f", {t['waves']} wave{'s' if t['waves'] != 1 else ''} of {t['blocks_per_wave']} blocks"
                   f" ({t['blocks_per_sm']} per SM, bound by {t['occupancy_bound']})" if t.get("waves") else "")
            )
            units = {unit: s for unit, s in (t.get("compute_by_unit_s") or {}).items() if s}
            if len(units) > 1:
                # serial: the model sums them (a warp's softmax runs between its products); a schedule
                # that hides units under the tensor cores says which (Overlap): the largest binds most
                most = max(units, key=units.get)
                schedule = OVERLAPS.get(t.get("overlap") or BUILT_OVERLAP)
                hidden = [UNIT_NAMES.get(u, u) for u in schedule.hidden if u in units] if "tensor" in units else []
                how = (f"; {schedule.name} runs {' and '.join(hidden)} under the tensor cores, the rest after them"
                       if hidden else "")
                lines.append(f"  compute by unit, at each unit's peak{'' if hidden else ', in turn'}: "
                             + ", ".join(f"{UNIT_NAMES.get(u, u)} {_fmt_time(v)}" for u, v in units.items())
                             + how + f"; the most: {UNIT_NAMES.get(most, most)}")
            lines += chain_lines(t.get("chain") or {})
            fixed = {kind: s for kind, s in (t.get("fixed_s") or {}).items() if s}
            if fixed:
                lines.append("  fixed costs (in the time above): " + ", ".join(f"{kind} {_fmt_time(s)}" for kind, s in fixed.items()))
            if self.total_flops != 0:
                lines.append(f"  predicted throughput: {float(self.total_flops) / t['overlapped_s'] / 1e12:.1f} TFLOP/s")
        elif self.time.get("weighted_H") is not None:
            lines.append(f"  bandwidth-weighted transfers: {self.time['weighted_H']}")
        lines += device_lines(self.device, self.ring, self.ring and self.ring.get("held"))
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """The table for Jupyter: one row per level, then time and notes (warnings first)."""
        import html

        unit = "values" if self.counts == "values" else "bytes"
        head = ("level", "per", f"H ({unit})", f"M ({unit})", "capacity", "N", "transfer time")
        body = []
        for name, c in self.levels.items():
            t = c.transfer_time
            cells = (name, c.per, _fmt(c.H if unit == "values" else c.H_bytes), _fmt(c.M if unit == "values" else c.M_bytes),
                     _fmt(c.capacity), _fmt(c.N),
                     _fmt_time(t) if t is not None and algebra.as_expr(t).is_number else (str(t) if t is not None else "-"))
            body.append("<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in cells) + "</tr>")
        time = self.time.get("overlapped_s")
        summary = (f"predicted {_fmt_time(time)} ({html.escape(str(self.time.get('bound')))}-bound)" if time is not None
                   else f"FLOPs {html.escape(_fmt(self.total_flops))}")
        notes = sorted(self.notes, key=lambda n: not n.startswith("warning"))
        return (f"<p>cost of {html.escape(self.kernel)} on {html.escape(self.hardware)}: {summary}</p>"
                "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>" + "".join(body) + "</table>"
                + "".join(f"<p>{html.escape(n)}</p>" for n in notes))


def chain_lines(chains: dict) -> list[str]:
    """The table's lines for each launch's warpgroup chain (``time["chain"]``, chain.Chain.describe):
    a chunk's units, the links its chain exposes, the ring's pace, the factor on the compute time,
    what runs hidden, and each latency's source, once."""
    lines, sources = [], {}
    for index, c in chains.items():
        links = "".join(f" + {link['what']} {link['clocks']:.0f}" for link in c["links"])
        ring = (f"{c['stages']}-stage ring of {c['copy_clocks']:.0f}-clock copies keeps pace at {c['ring_clocks']:.0f}")
        lines.append(f"  chain of launch {index} ({c['build']}): a chunk's units {c['units_clocks']:.0f} clocks{links}; the {ring}; "
                     f"a chunk {c['chunk_clocks']:.0f} clocks, {c['resident']} block{'s' if c['resident'] != 1 else ''} an SM: "
                     f"compute x{c['factor']:.3f}")
        lines += [f"    hidden: {what}" for what in c["hidden"]]
        sources.update(c["sources"])
    lines += [f"  latency {name}: {source}" for name, source in sources.items()]
    return lines


def _fmt_time(seconds) -> str:
    seconds = float(seconds)
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def _fmt_sizes(sizes: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sizes.items())


# ---- computing the report ------------------------------------------------------------------


def _selected(program: Program, selected: ProgramSelection | None) -> ProgramSelection:
    """``selected``, or the selection pass run for the profile's own target where none is given
    (the model's entry, :func:`cost_of`, runs it once and hands it down)."""
    from .isel import select_program

    return selected if selected is not None else select_program(program)


def tensor_launches(program: Program, selected: ProgramSelection | None = None) -> dict:
    """Launch index -> (TensorPlan, tile) for the launches instruction selection
    (``selected``, :func:`napkin_dsl.isel.select_program`) puts on tensor cores."""
    out = {}
    if program.hardware.symbolic or "registers" not in program.hardware.level_names():
        return out
    selected = _selected(program, selected)
    for launch in program.launches:
        chosen = selected[launch.index]
        if chosen.plan is not None:
            out[launch.index] = (chosen.plan, chosen.tile)
    return out


def fma_register_launches(program: Program, selected: ProgramSelection | None = None) -> dict:
    """Launch index -> the accumulators an FMA launch keeps in registers (``isel.fma_accumulators``),
    for launches that keep any: with the tensor launches, what puts a ``registers`` level in the report."""
    selected = _selected(program, selected)
    return {launch.index: selected[launch.index].kept for launch in program.launches if selected[launch.index].kept}


def registers_cost(program: Program, tensor: dict, rows: list[dict]) -> LevelCost:
    """The register level of tensor-core launches: ldmatrix traffic from shared memory (H) and the
    fragments one thread holds at once (M, per thread), read off the Program's steps and columns;
    FMA launches' register accumulators count in M too."""
    from .isel import FMA_THREADS

    hardware = program.hardware
    H = algebra.Integer(0)
    H_bytes = algebra.Integer(0)
    for launch in program.launches:
        if launch.index not in tensor:
            continue
        plan = tensor[launch.index][0]
        loaded = plain_tiles(launch, program.schedule.compute_level)
        for step, loops in walk(launch.body):
            moved = register_transfers(program, step, loops, plan)
            H += moved
            H_bytes += moved * DTYPE_BYTES[plan.dtype]
            for values, size in register_vector_reads(program, step, loops, plan, loaded):
                H += values
                H_bytes += values * size
    M = max_of(r["M"].get("registers", 0) for r in rows)
    M_bytes = max_of(r["M_bytes"].get("registers", 0) for r in rows)
    # An FMA launch holds only accumulators here (its operand reads from shared memory are
    # not counted as transfers at this level): its block's threads.
    fma = {r["launch"] for r in rows if "registers" in r["M"]} - set(tensor)
    threads = max([plan.threads for plan, _ in tensor.values()] + ([FMA_THREADS] if fma else []))
    registers = hardware.level("registers")
    return LevelCost("registers", H, H_bytes, M, M_bytes, algebra.Integer(threads),
                     registers.capacity, registers.bandwidth, registers.per, hardware.counts)


def level_costs(program: Program, rows: list[dict] | None = None, selected: ProgramSelection | None = None) -> dict:
    """H, M and N per level below the top (:class:`LevelCost`), from the columns ``rows``
    (default: :func:`columns` for ``selected``)."""
    schedule = program.schedule
    selected = _selected(program, selected)
    rows = rows if rows is not None else columns(program, selected)
    tensor = tensor_launches(program, selected)
    costs = {}
    for level in schedule.levels[1:]:
        H = algebra.Integer(0)
        H_bytes = algebra.Integer(0)
        N = []
        for launch in program.launches:
            for step, loops in walk(launch.body):
                if step.op in ("load", "save") and step.level == level:  # transfers between level and its parent
                    moved = step_total(program, step, loops) * step.passes
                    H += moved
                    H_bytes += moved * _bytes(step.dtype)
            N.append(launch_blocks(program, launch, level))
        M = max_of(r["M"].get(level, 0) for r in rows)
        M_bytes = max_of(r["M_bytes"].get(level, 0) for r in rows)
        hw_level = schedule.hardware.level(level)
        costs[level] = LevelCost(
            level, H, H_bytes, M, M_bytes, max_of(N),
            bind(hw_level.capacity, schedule.sizes) if hw_level.capacity is not None else None,
            bind(hw_level.bandwidth, schedule.sizes) if hw_level.bandwidth is not None else None,
            hw_level.per,
            schedule.hardware.counts,
        )
    held = any("registers" in r["M"] for r in rows)  # fragments, or an FMA launch's accumulators
    if (tensor or held) and "registers" in [lv.name for lv in schedule.hardware.levels]:
        costs["registers"] = registers_cost(program, tensor, rows)
    return costs


def instruction_path(program: Program, launch, selected: ProgramSelection | None = None) -> str:
    """The instruction path of a launch's contractions: ``mma.sync`` or ``wgmma`` (a tensor-core
    plan, :mod:`napkin_dsl.isel`), ``fma`` where instruction selection, with every size bound,
    kept the launch on the FMA path (its products are FFMAs and are priced as such), and
    ``tensor`` (the datasheet's tensor peak) while sizes are symbolic and the path undecided."""
    if program.hardware.symbolic or program.hardware.arch is None:
        return "tensor"
    chosen = _selected(program, selected)[launch.index]
    return "tensor" if chosen.tile is None else chosen.path


def contraction_unit(program: Program, launch, selected: ProgramSelection | None = None) -> str:
    """The unit a launch's contractions count against: ``tensor`` or ``fma`` (:func:`instruction_path`)."""
    return "fma" if instruction_path(program, launch, selected) == "fma" else "tensor"


# How the cost table names each compute unit's time.
UNIT_NAMES = {"tensor": "tensor cores", "fma": "FP32 (FMA pipe)", "special": "MUFU (exp, rcp)"}


# ---- overlap of the compute units under a warpgroup schedule (hardware.OVERLAPS) -----------




def overlapped_compute(seconds: dict, hidden: tuple[str, ...]) -> float:
    """One launch's compute seconds from its units' (``tensor``, ``fma``, ``special``) under a
    schedule that hides ``hidden`` under the tensor cores (:class:`Overlap`)."""
    if not hidden:
        return sum(seconds.values())
    under = max([seconds.get("tensor", 0.0)] + [seconds.get(unit, 0.0) for unit in hidden])
    return under + sum(s for unit, s in seconds.items() if unit != "tensor" and unit not in hidden)


def flops_by_unit(program: Program, selected: ProgramSelection | None = None) -> tuple[dict, list]:
    """FLOPs per unit (tensor, fma, special), and (launch, rate, dtype, flops) entries for
    pricing, where a contraction's rate is its launch's instruction path (:func:`instruction_path`)."""
    totals: dict = {}
    priced = []
    symbolic = program.hardware.symbolic or program.hardware.arch is None
    selected = None if symbolic else _selected(program, selected)  # symbolic: every path is "tensor"
    for launch in program.launches:
        products = instruction_path(program, launch, selected)
        for step, loops in walk(launch.body):
            if not step.flops and not step.test_flops and not step.bookkeeping and not step.flops_over:
                continue
            elements = step_total(program, step, loops, step.flop_space)
            # a masked softmax's test runs only on the chunks its mask holds in part
            tested = step_total(program, step, loops, step.flop_space, partial=True) if step.test_flops else 0
            merged: dict = {}  # per unit, as one entry: the step's work on every element, the test's on `tested`
            for unit, n in step.flops:
                merged[unit] = merged.get(unit, 0) + n * elements
            for unit, n in step.test_flops:
                merged[unit] = merged.get(unit, 0) + algebra.Integer(n) * tested
            amounts = list(merged.items())
            # the streamed form's own work, each over its own axes (the rows of a softmax's rescale)
            amounts += [(unit, n * step_total(program, step, loops, axes)) for unit, n, axes in step.flops_over + step.bookkeeping]
            for unit, amount in amounts:
                rate = unit
                if unit == "tensor":
                    rate = products
                    unit = "fma" if products == "fma" else "tensor"
                totals[unit] = totals.get(unit, 0) + amount
                dtype = step.dtype or "f32"
                if unit == "tensor" and step.statement is not None:
                    # tensor cores run at the narrowest operand type (P is converted to bf16, as in FA2)
                    from .dtypes import DTYPE_BYTES

                    operand_dtypes = [program.diagram.arrays[n].dtype for n in step.statement.inputs]
                    narrow = [d for d in operand_dtypes if DTYPE_BYTES[d] < 4]
                    dtype = min(narrow, key=lambda d: DTYPE_BYTES[d]) if narrow else min(operand_dtypes, key=lambda d: DTYPE_BYTES[d])
                priced.append((launch.index, rate, dtype, amount))
    return {unit: algebra.as_expr(v) for unit, v in totals.items()}, priced


def bookkeeping_flops(program: Program) -> dict:
    """FLOPs by unit of the streamed steps' own work (Step.bookkeeping: rescaling the running
    state, an operand evaluated again, the output divided instead of every entry; a split's
    merges of its parts' states): the difference
    between the Program's FLOPs and the diagram's (check.py) where no mask skips a chunk."""
    totals: dict = {}
    for launch in program.launches:
        for step, loops in walk(launch.body):
            for unit, n, axes in step.bookkeeping:
                totals[unit] = totals.get(unit, 0) + n * step_total(program, step, loops, axes)
            if step.op == "merge":  # a split's parts merged: state the diagram does not have
                for unit, n in step.flops:
                    totals[unit] = totals.get(unit, 0) + n * step_total(program, step, loops, step.flop_space)
            if step.op == "online" and step.test_flops:
                # the operand evaluated again tests the mask again, on the chunks it holds in part
                tested = step_total(program, step, loops, step.flop_space, partial=True)
                for unit, n in step.test_flops:
                    totals[unit] = totals.get(unit, 0) + n * tested
    return {unit: algebra.as_expr(v) for unit, v in totals.items() if v != 0}


def recomputed_flops(program: Program) -> dict:
    """FLOPs by unit of steps the Program repeats: a step inside a loop over an axis its work does
    not span (a statement without n in a launch grouped by n runs in every group of n; one
    without x inside the stream over x, in every chunk). The diagram (check.py) counts each
    statement once; the Program's FLOPs are the diagram's, plus these, plus the bookkeeping
    (:func:`bookkeeping_flops`), where no mask skips a chunk."""
    schedule = program.schedule
    totals: dict = {}
    for launch in program.launches:
        for step, loops in walk(launch.body):
            for unit, n, axes in tuple((u, n, step.flop_space) for u, n in step.flops) + step.flops_over:
                repeats = algebra.Mul(*(loop.trips for loop in loops if loop.axis not in axes))
                once = algebra.Mul(*(schedule.axis_size(a) for a in axes))
                totals[unit] = totals.get(unit, 0) + n * once * (repeats - 1)
    return {unit: algebra.as_expr(v) for unit, v in totals.items() if v != 0}


def _masked_loop(launch):
    return next((lp for _, loops in walk(launch.body) for lp in loops if lp.mask is not None), None)


# An SM of sm_80 and sm_90 has 4 sub-partitions, each with its own warp scheduler and a quarter of
# the SM's tensor cores, FP32 lanes and MUFU units (CUDA C++ Programming Guide, compute capability
# 8.x and 9.0: "4 warp schedulers"); a block's warps stay on the sub-partition they start on.
SUBPARTITIONS = 4


def subpartition_balance(warps: int, resident: int) -> float:
    """The fraction of an SM's compute units a launch's blocks of ``warps`` warps can keep busy:
    its warps spread over 4 sub-partitions, the busiest holds ceil(k warps / 4) of the k blocks'
    warps; the best k from 1 to ``resident`` blocks per SM (6 warps: 0.75 alone, 1 two at once)."""
    return max(k * warps / (SUBPARTITIONS * -(-k * warps // SUBPARTITIONS)) for k in range(1, max(resident, 1) + 1))


# ---- the FMA path's issue slots and shared-memory port (docs/method.md, "The FMA path") -------
#
# Without tensor cores a launch's products are FFMAs, one instruction each, beside the loads of
# their operands from shared memory and the integer work that addresses them. On sm_90 the FP32
# lanes (128 per SM) match the issue rate (4 schedulers x 1 warp instruction a clock x 32 lanes),
# so every instruction that is not an FFMA takes a slot from one; on sm_80 (64 lanes) an FFMA
# loop with fewer than one other instruction per FFMA still binds on FP32. The counts below are
# read off the Program's steps and the FMA printer's code for them (backends/lowering.py), in
# thread instructions; backends/sass.py's static ceiling counts the same on the compiled loops.

# Thread instructions an SM issues per clock: 4 sub-partitions, one warp instruction each.
ISSUE_LANES = SUBPARTITIONS * 32
# Per operand value a product loads from shared memory where its tile is ragged (a size the
# tile does not divide: the printer spells the extent at run time, `n_m = min(128, m - o_m)`),
# the printer writes `a[u] = (i_m < n_m) ? nk_f(s_A[(i_m) * 32 + i_k]) : 0.0f` with
# `i_m = b_m + u * stride`: the index (IADD), the compare (ISETP), the element offset and byte
# address (IMAD, LEA) and the select (SEL) are 5 integer instructions beside the LDS. Where the
# tile divides the size every extent is a constant: the compare and select fold, the k loop
# unrolls and the offsets become the LDS's immediates (fig9's 256 x 256 x 64 product loop: 4
# integer instructions per 160 FFMA), so nothing is charged.
OPERAND_GUARD = 5
# A 16-bit operand (bf16, f16) is widened to f32 by one instruction per value (nk_f: a shift or
# PRMT for bf16, HADD2.F32 for f16) before its FFMAs.
NARROW_CONVERT = 1
# An fp8 operand is decoded per value (lowering.fp8_prelude): e5m2 by a shift and the f16
# conversion; e4m3 by moving its fields into an f16, the conversion, a multiply and the NaN
# select. Measured on fp8_matmul's FMA loop (sm_80 SASS): 2.1 instructions a value for e5m2,
# 8.6 for e4m3 besides the LDS; charged rounded up.
FP8_DECODE = {"fp8e4m3": 9, "fp8e5m2": 3}
# A k loop whose trip count is set at run time (a ragged stream chunk, `i_k < n_k`) does not
# unroll: each k step of a register block costs its counter, compare and branch.
LOOP_STEP = 3
# A step other than a product (an elementwise map, a reduction, a softmax's passes) runs a flat
# loop over its elements, splitting the flat index into each axis (`i_d = r % 250; r /= 250`:
# a multiply-high, a shift and a multiply-subtract for a constant divisor) ...
INDEX_PER_AXIS = 3
# ... but a ragged axis's extent is a run-time value (`i_f = r % (n_f); r /= (n_f)`), and an
# integer division by a variable is the compiler's reciprocal sequence (I2F, MUFU.RCP, F2I and
# about 15 IMAD, IADD, ISETP and SEL for the quotient's correction, one IMAD for the remainder):
# 20 instructions. swiglu's `H = silu(G) * U` at t=100, f=130 issues 63 an element, 38 of them integer.
RUNTIME_DIVIDE = 20
# The flat loop's bound test and branch per element (`if (t >= n) break` in an unrolled copy).
ELEMENT_LOOP = 2
# ... and reads each operand from shared memory at its offset (`s_X[(i_t) * 250 + i_d]`: an
# IMAD and a LEA beside the LDS), then issues one instruction per FLOP (FMUL, FADD, FMNMX; an
# FFMA that fuses two is counted as two, so this side errs long).
READ_ADDRESS = 2


def _products(step) -> bool:
    return any(unit == "tensor" for unit, _ in step.flops)


def fma_issue(program: Program, launch, selected: ProgramSelection | None = None) -> tuple[int, int] | None:
    """(thread instructions, shared-memory bytes read) of an FMA-path launch's computing steps,
    from the Program's steps and the register blocks the printer gives its products
    (``isel.register_tile_axes``, ``REGISTER_TILE``); None for a launch on tensor cores, on a
    profile without a clock, or with a symbolic size.

    A product (one FFMA) of a thread's ``rm x rn`` register block reads ``1/rn`` of a value of
    its first operand and ``1/rm`` of its second (each loaded value serves a row or a column of
    the block); a launch whose contraction has no register blocks reads both per product. Each
    value loaded costs its LDS, the guard of a ragged tile (``OPERAND_GUARD``) and the widening
    of a 16-bit operand (``NARROW_CONVERT``); a ragged k loop ``LOOP_STEP`` per k step of a block.
    Any other step costs, per element, ``INDEX_PER_AXIS`` per axis it spans, an LDS and
    ``READ_ADDRESS`` per operand it reads from shared memory (plus the widening) and one
    instruction per FLOP."""
    from .isel import REGISTER_TILE, register_tile_axes

    hardware = program.hardware
    if hardware.symbolic or not hardware.clock_hz:
        return None
    chosen = _selected(program, selected)[launch.index]
    if instruction_path(program, launch, selected) != "fma" or chosen.tile is None:
        return None
    tile, sizes = chosen.tile, chosen.sizes
    level = launch.schedule.compute_level
    diagram = program.diagram

    cut = split_loop(launch)

    def ragged(axes) -> bool:
        # A split's part axis (k#) is no tile; the split axis itself is guarded against its part's
        # end in every chunk (the part's bound is a run-time value), whether or not the tile divides.
        return any(a in tile and (sizes[a] % tile[a] or (cut is not None and a == cut.axis)) for a in axes)

    def narrow(name) -> int:
        dtype = diagram.arrays[name].dtype
        return FP8_DECODE[dtype] if dtype in FP8_DECODE else NARROW_CONVERT if DTYPE_BYTES[dtype] < 4 else 0

    slots = nbytes = 0.0
    for step, loops in walk(launch.body):
        s = step.statement
        if s is None or step.level != level:
            continue
        elements = as_number(step_total(program, step, loops, step.flop_space))
        if elements is None:
            return None
        if _products(step) and len(getattr(s.box, "operands", ())) == 2:
            products = elements
            contracted = [a for a in step.flop_space if a not in s.axes]
            axes = register_tile_axes(s.box, s.axes, tile)
            first, second = s.box.operands
            if axes is None:  # one output a thread: both operands per product
                shares = [(op.array, 1.0, [a for a in s.axes if a in op.axes]) for op in (first, second)]
                block = 1
            else:
                am, an = axes
                rm, rn = min(REGISTER_TILE, tile[am]), min(REGISTER_TILE, tile[an])
                shares = [(first.array, 1 / rn, [am]), (second.array, 1 / rm, [an])]
                block = rm * rn
            per_product = 1.0  # the FFMA
            for name, share, guarded in shares:
                per_product += share * (1 + (OPERAND_GUARD if ragged(guarded) else 0) + narrow(name))
                nbytes += products * share * DTYPE_BYTES[diagram.arrays[name].dtype]
            if ragged(contracted):
                per_product += LOOP_STEP / block
            slots += products * per_product
            continue
        work = sum(n for unit, n in step.flops if unit in ("fma", "special"))
        read = [name for lv, name in step.reads if lv == level and name in diagram.arrays]
        written = [name for lv, name in step.writes if lv == level and name in diagram.arrays]
        if not work and not read:
            continue
        per_element = ELEMENT_LOOP + work + sum(RUNTIME_DIVIDE if ragged([a]) else INDEX_PER_AXIS for a in step.axes)
        for name in read + written:  # an LDS (or the STS of the result) at its address
            per_element += 1 + READ_ADDRESS + narrow(name)
            nbytes += elements * DTYPE_BYTES[diagram.arrays[name].dtype]
        slots += elements * per_element
    return int(math.ceil(slots)), int(math.ceil(nbytes))


def fma_issue_seconds(program: Program, launch, selected: ProgramSelection | None = None) -> tuple[float, float] | None:
    """(issue seconds, shared-port seconds) of an FMA-path launch (:func:`fma_issue`): its thread
    instructions at ``ISSUE_LANES`` a clock per SM, its operand reads plus the copies that fill
    its tiles at the registers level's bandwidth (shared memory to registers), as the tensor
    path's port term; None where :func:`fma_issue` is."""
    counted = fma_issue(program, launch, selected)
    if counted is None:
        return None
    hardware = program.hardware
    slots, nbytes = counted
    sms = hardware.level(program.schedule.compute_level).units
    issue = slots / (ISSUE_LANES * sms * float(hardware.clock_hz))
    port = 0.0
    if "registers" in hardware.level_names() and isinstance(hardware.level("registers").bandwidth, (int, float)):
        copied = as_number(loaded_bytes(program, launch, program.schedule.compute_level)) or 0
        port = (nbytes + copied) / hardware.level("registers").bandwidth
    return issue, port


# An implicit GEMM's gathered operand (paths.plan.Operand.gathered) is filled element by element
# (tensorcore.TensorPrinter.gather): per element and tap, a window read's element costs its
# bounds tests, its address, the select of the pad value, the LDG and the STS, measured at 90-92
# instructions for a trip of a 3 x 3 window's 9 taps (sm_90 SASS of the 3 x 3 convolution,
# docs/tensor-cores.md); another operand's element (a convolution's weights W[o c i j]) its address,
# LDG and STS, 144-173 instructions a trip of 36-45 elements, which ptxas unrolls.
GATHER_WINDOW_ELEMENT = 10
GATHER_ELEMENT = 4


def gather_issue(program: Program, launch, selected: ProgramSelection | None = None) -> int | None:
    """Thread instructions a tensor-core launch's gathered operands issue (``GATHER_WINDOW_ELEMENT``
    an element of a window read, ``GATHER_ELEMENT`` of another): each copy of a tile the Program
    loads into the compute level gathers the whole tile; None where it gathers nothing or a size is
    symbolic."""
    hardware = program.hardware
    if hardware.symbolic or not hardware.clock_hz:
        return None
    chosen = _selected(program, selected)[launch.index]
    if chosen.plan is None or not any(op.gathered for op in chosen.plan.operands.values()):
        return None
    level = program.schedule.compute_level
    slots = 0
    for step, loops in walk(launch.body):
        op = chosen.plan.operands.get(step.array) if step.op == "load" and step.level == level else None
        if op is None or not op.gathered:
            continue
        # every copy of the step gathers its whole tile, zeros past a ragged axis's end included
        copies = as_number(step_total(program, step, loops, ()))
        if copies is None or chosen.tile is None:
            return None
        elements = int(copies) * math.prod(chosen.tile[a] for a in (op.rows, op.cols, *op.taps))
        window = program.diagram.arrays[step.array].window is not None
        slots += elements * (GATHER_WINDOW_ELEMENT if window else GATHER_ELEMENT)
    return slots


def gather_issue_seconds(program: Program, launch, selected: ProgramSelection | None = None) -> float | None:
    """:func:`gather_issue` at ``ISSUE_LANES`` thread instructions a clock per SM, or None."""
    slots = gather_issue(program, launch, selected)
    if slots is None:
        return None
    hardware = program.hardware
    sms = hardware.level(program.schedule.compute_level).units
    return slots / (ISSUE_LANES * sms * float(hardware.clock_hz))


def loaded_bytes(program: Program, launch, level: str) -> algebra.Expr:
    """Bytes one launch loads into ``level`` (the copies that fill its tiles), tails included."""
    return _total(step_total(program, step, loops) * _bytes(step.dtype)
                  for step, loops in walk(launch.body) if step.op == "load" and step.level == level)


def _transposed(program: Program, launch, selected) -> tuple:
    """A launch's selection and the operands it copies K-major (``WgmmaPlan.transposed``)."""
    from .paths.wgmma import WgmmaPlan

    chosen = _selected(program, selected)[launch.index]
    return chosen, (chosen.plan.transposed if isinstance(chosen.plan, WgmmaPlan) else ())


def copied_bytes(program: Program, launch, selected) -> int | None:
    """Bytes a launch's K-major copies (``WgmmaPlan.transposed``: an 8-bit wgmma operand stored
    MN-major, rewritten K-major each chunk) move through shared memory's port: each byte of the
    operand's tile is read (LDS) and written back (STS) once a chunk it lands. None without one."""
    _, names = _transposed(program, launch, selected)
    if not names:
        return None
    level = program.schedule.compute_level
    return 2 * _total(step_total(program, step, loops) * _bytes(step.dtype) for step, loops in walk(launch.body)
                      if step.op == "load" and step.level == level and step.array in names)


def copy_conflict(program: Program, launch, selected) -> float:
    """How many times the conflict-free wavefronts a launch's K-major copies take
    (``layouts.transpose_split`` on the staged and copied tiles), the worst of them: the factor
    the copied bytes' port time takes. 1.0 without a copy."""
    from .isel import kmajor_name

    chosen, names = _transposed(program, launch, selected)
    return max((transpose_split(chosen.slots[name].tile, chosen.slots[kmajor_name(name)].tile).conflict for name in names),
               default=1.0)


def busy_fraction(blocks, units: int) -> float:
    """The fraction of the time a launch's blocks keep the compute units busy. The block
    scheduler spreads blocks over the SMs before it doubles any up, and blocks sharing an SM
    share its units: the busiest SM runs ceil(blocks / SMs) blocks' work, whatever blocks per SM
    (which decides waves and latency hiding, not throughput here)."""
    rounds = -(-blocks // units) if isinstance(blocks, int) else math.ceil(blocks / units)
    return blocks / (rounds * units)


def masked_wave_efficiency(program: Program, slots: int) -> float | None:
    """How well a masked launch keeps the SMs busy: thread blocks do unequal work (a causal query
    group near the start visits few chunks, one at the end all of them). Modelled as blocks issued
    longest first (FlashAttention-2's reverse order for causal), each round of ``slots`` blocks
    (one per SM) lasting as long as its longest block (work = chunks visited): efficiency = total
    work / (slots x sum over rounds of the longest). Equal work gives blocks / (rounds x slots),
    the unmasked rule. None for a launch without a mask, several launches, or symbolic sizes."""
    if len(program.launches) != 1:
        return None
    launch = program.launches[0]
    loop = _masked_loop(launch)
    blocks = as_number(launch_blocks(program, launch))
    visits = mask_visits(loop.mask, lambda a: program.schedule.axis_size(a)) if loop is not None else None
    if visits is None or not isinstance(blocks, int) or blocks % len(visits):
        return None
    copies = blocks // len(visits)  # blocks per group tile: the other grouped axes
    busy, issued = 0, 0
    for work in sorted((group.visited for group in visits), reverse=True):
        # blocks issued - 1 .. issued + copies - 1 have this work; a wave starts at each multiple of slots
        starts = (issued + copies - 1) // slots - (issued - 1) // slots if issued else (copies - 1) // slots + 1
        busy += work * starts  # sorted: a wave's first block is its longest
        issued += copies
    total = copies * sum(group.visited for group in visits)
    return total / (slots * busy) if busy else None


def masked_notes(program: Program) -> list[str]:
    """What a mask leaves out, or that symbolic sizes count every chunk (an upper bound)."""
    notes = []
    for launch in program.launches:
        loop = _masked_loop(launch)
        if loop is None:
            continue
        visits = mask_visits(loop.mask, lambda a: program.schedule.axis_size(a))
        if visits is None:
            bound = all(program.schedule.axis_size(a).is_number for a in loop.mask.axes)
            why = (f"more than {MAX_MASK_GROUPS:,} group tiles are not enumerated" if bound
                   else "sizes are symbolic")
            notes.append(f"masked by {loop.mask.condition}: {why}, so every chunk of {loop.axis} is counted "
                         f"(an upper bound){'' if bound else '; bind the sizes for the chunks actually visited'}")
            continue
        chunks = [group.visited for group in visits]
        total = len(visits) * len(tiles_of(loop.mask, program, loop.axis))
        partial = sum(group.visited - group.full for group in visits)
        notes.append(f"masked by {loop.mask.condition}: {sum(chunks)} of {total} tiles visited ({partial} tested in part); "
                     f"a group visits {min(chunks)} to {max(chunks)} chunks of {loop.axis}")
    return notes


def tiles_of(mask, program: Program, axis: str) -> range:
    size, tile = int(program.schedule.axis_size(axis)), int(dict(mask.tiles)[axis])
    return range(0, size, tile)


def predict_time(program: Program, levels: dict, priced: list, occupancy: dict | None = None,
                 launch_levels: dict | None = None, fma: dict | None = None, hidden: dict | None = None,
                 copied: dict | None = None, chains: dict | None = None, gathers: dict | None = None) -> dict:
    """Roofline prediction; None entries where a rate, bandwidth or size is unknown.

    Launches run one after another, each on its own roofline: its compute (over its own busy
    fraction) against its own transfers, then the fixed costs. ``launch_levels`` maps each
    launch's index to its level costs (one launch: ``levels`` itself). ``fma`` maps an FMA-path
    launch to its (issue, shared-port) seconds (:func:`fma_issue_seconds`): its FMA pipe's time
    is the longest of its FLOPs at the FP32 rate and those two, which run at once. ``hidden``
    maps a launch to the units its schedule runs under the tensor cores (:class:`Overlap`);
    a launch it omits takes its units in turn. ``copied`` maps a launch to the bytes its K-major
    copies move through shared memory's port (:func:`copied_bytes`), scaled by their bank
    conflicts (:func:`copy_conflict`), added to the port's term. ``chains`` maps a wgmma launch
    to its :class:`~napkin_dsl.chain.Chain` and the chunks its blocks run (:func:`launch_chains`):
    its compute time is then stretched by the chain's factor, at the blocks an SM holds. ``gathers``
    maps an implicit GEMM's launch to the seconds its gathers issue (:func:`gather_issue_seconds`),
    a unit of its own ("issue"), which its ``hidden`` runs beside the tensor cores."""
    hardware = program.hardware
    schedule = program.schedule
    time: dict = {"overlapped_s": None, "serial_s": None, "compute_s": None}
    weighted = algebra.Integer(0)
    for c in levels.values():
        if c.bandwidth is not None:
            weighted += (c.H if hardware.counts == "values" else c.H_bytes) / c.bandwidth
    time["weighted_H"] = weighted
    if hardware.symbolic:
        return time
    units_s: dict = {launch.index: {} for launch in program.launches}  # launch -> unit -> seconds at its peak
    pipe = {launch.index: 0.0 for launch in program.launches}  # FLOPs on the FMA pipe, seconds
    by_unit: dict = {}  # tensor (any path), fma, special: each one's FLOPs at its rate, every launch
    for launch_of, unit, dtype, amount in priced:
        amount = algebra.as_expr(amount)
        rate = hardware.peak(unit, dtype)
        if not amount.is_number or rate is None:
            return time
        kind = unit if unit in ("fma", "special") else "tensor"
        by_unit[kind] = by_unit.get(kind, 0.0) + float(amount) / rate
        if unit == "fma" and launch_of in (fma or {}):
            pipe[launch_of] += float(amount) / rate
        else:
            units_s[launch_of][kind] = units_s[launch_of].get(kind, 0.0) + float(amount) / rate
    for launch_of, seconds in pipe.items():
        if launch_of in (fma or {}):
            # The FP32 lanes, the schedulers and shared memory's port work at once: the slowest binds.
            units_s[launch_of]["fma"] = units_s[launch_of].get("fma", 0.0) + max(seconds, *fma[launch_of])
    for launch_of, seconds in (gathers or {}).items():
        units_s[launch_of]["issue"] = seconds
    compute = {i: overlapped_compute(s, (hidden or {}).get(i, ())) for i, s in units_s.items()}
    launch_levels = launch_levels or {program.launches[0].index: levels}
    transfer: dict = {}  # level -> seconds over every launch
    per_launch: dict = {}  # launch -> (compute seconds over its busy fraction, {level: seconds})
    units = hardware.level(schedule.compute_level).units
    from .pseudocode import blocks_per_unit

    residents, most_blocks = [], None  # reported: the fewest blocks per SM of any launch, waves of the largest
    for launch in program.launches:
        moved = {}
        for name, c in launch_levels[launch.index].items():
            t = c.transfer_time
            if t is None:
                continue
            t = algebra.as_expr(t)
            if not t.is_number:
                return time
            moved[name] = float(t)
            transfer[name] = transfer.get(name, 0.0) + float(t)
        sub = program if len(program.launches) == 1 else Program(schedule, (launch,))
        blocks = as_number(launch_levels[launch.index][schedule.compute_level].N)
        entry = (occupancy or {}).get(launch.index)
        resident = blocks_per_unit(schedule, *entry) if entry is not None else None
        if not occupancy and as_number(launch_levels[launch.index][schedule.compute_level].M_bytes) is not None:
            resident = blocks_per_unit(schedule, launch_levels[launch.index][schedule.compute_level].M_bytes)
        seconds = compute[launch.index]
        if launch.index in (chains or {}) and seconds > 0:
            chain, visits = chains[launch.index]
            # one block's units a chunk, in clocks of one SM: the launch's units over every chunk it runs
            units_clocks = seconds * float(hardware.clock_hz) * units / visits
            on_sm = resident[0] if resident is not None else 1
            time.setdefault("chain", {})[launch.index] = chain.describe(units_clocks, on_sm)
            seconds *= chain.factor(units_clocks, on_sm)
        own, efficiency = launch_levels[launch.index], 1.0
        if entry is not None and entry[1] and resident is not None:
            seconds /= subpartition_balance(-(-entry[1] // 32), resident[0])
        if blocks and resident is not None:
            efficiency = busy_fraction(blocks, units)
            unequal = masked_wave_efficiency(sub, units)  # masked query groups do unequal work
            if unequal is not None:
                efficiency = time["masked_wave_efficiency"] = unequal
            seconds /= efficiency
            residents.append(resident)
            most_blocks = blocks if most_blocks is None else max(most_blocks, blocks)
        if "registers" in moved and as_number(own["registers"].H_bytes):
            # Shared memory's port, one per SM, carries both the ldmatrix reads (H at registers)
            # and the copies that fill the tiles (loads into the compute level), at the registers
            # level's bandwidth (shared memory to registers) over the SMs the blocks keep busy:
            # one overlapped term, as the SASS ceiling (backends/sass.py) prices it.
            through = own["registers"].H_bytes + loaded_bytes(program, launch, schedule.compute_level)
            port = float((through + (copied or {}).get(launch.index, 0)) / own["registers"].bandwidth) / efficiency
            transfer["registers"] += port - moved["registers"]
            moved["registers"] = port
        per_launch[launch.index] = (seconds, moved)
    if residents:
        per_sm, limit = min(residents)
        blocks = most_blocks
        slots = per_sm * units
        # Integer ceiling for an integer count of blocks: exact, and no float to overflow.
        time["waves"] = -(-blocks // slots) if isinstance(blocks, int) else math.ceil(blocks / slots)
        time["blocks_per_wave"] = slots
        time["blocks_per_sm"] = per_sm
        time["occupancy_bound"] = limit
    compute_s = sum(seconds for seconds, _ in per_launch.values())
    time["compute_s"] = compute_s
    time["compute_by_unit_s"] = by_unit
    time["transfer_s"] = transfer
    fixed = fixed_costs(program, occupancy or {})
    time["fixed_s"] = fixed
    roofline = sum(max([seconds] + list(moved.values())) for seconds, moved in per_launch.values())
    time["overlapped_s"] = roofline + sum(fixed.values())
    time["serial_s"] = compute_s + sum(transfer.values()) + sum(fixed.values())
    # What bounds the launch that takes longest.
    seconds, moved = max(per_launch.values(), key=lambda item: max([item[0]] + list(item[1].values())))
    bound_level = max(moved, key=moved.get) if moved else None
    time["bound"] = "compute" if not moved or seconds >= moved[bound_level] else f"{bound_level} transfer"
    if len(program.launches) > 1:
        time["launch_s"] = [max([seconds] + list(moved.values())) for seconds, moved in per_launch.values()]
    return time


def chunk_visits(program: Program, launch, axis: str) -> int | None:
    """The chunks of ``axis`` a launch's blocks run in all: every block's every chunk, or where a
    mask skips chunks, those each group tile visits (:func:`~napkin_dsl.pseudocode.mask_visits`).
    None where a size is symbolic."""
    from .paths.wgmma import stream_loop

    loop = stream_loop(launch, axis)
    blocks = as_number(launch_blocks(program, launch))
    if loop is None or not isinstance(blocks, int):
        return None
    if loop.mask is not None:
        visits = mask_visits(loop.mask, lambda a: program.schedule.axis_size(a))
        if visits is not None and blocks % len(visits) == 0:
            return blocks // len(visits) * sum(group.visited for group in visits)
    trips = as_number(loop.trips)
    return blocks * trips if isinstance(trips, int) else None


def launch_chains(program: Program, selected: ProgramSelection) -> tuple[dict, list[str]]:
    """Per wgmma launch that streams, its chain (:func:`napkin_dsl.chain.chain_of`) and the chunks
    its blocks run, for :func:`predict_time`; and notes for the launches whose chain the profile
    cannot price (its ``[latency]`` table lacks an entry)."""
    from .chain import MissingLatency, chain_of

    chains, notes = {}, []
    for launch in program.launches:
        plan = selected[launch.index].plan
        try:
            chain = chain_of(plan, program.hardware)
        except MissingLatency as missing:
            notes.append(f"launch {launch.index}: the warpgroup chain is not priced: {program.hardware.name}'s [latency] table "
                         f"has no {missing} entry (docs/method.md, the warpgroup chain)")
            continue
        visits = chunk_visits(program, launch, plan.stream) if chain is not None else None
        if chain is not None and visits:
            chains[launch.index] = (chain, visits)
    return chains, notes


def launch_level_costs(program: Program, rows: list[dict], levels: dict, selected: ProgramSelection | None = None) -> dict:
    """Each launch's level costs (its own transfers, blocks and memory), by launch index: the
    program's own for one launch."""
    if len(program.launches) == 1:
        return {program.launches[0].index: levels}
    selected = _selected(program, selected)
    return {launch.index: level_costs(Program(program.schedule, (launch,)), [r for r in rows if r["launch"] == launch.index], selected)
            for launch in program.launches}


def launch_blocks(program: Program, launch, level: str | None = None) -> algebra.Expr:
    """Groups of one launch at a level (default the compute level: its thread blocks): the
    trips of its group loops at and above that level."""
    schedule = program.schedule
    depth = schedule.levels.index(level or schedule.compute_level)
    groups = {}
    for _, loops in walk(launch.body):
        for lp in loops:
            if lp.kind == "group" and schedule.levels.index(lp.level) <= depth:
                groups[id(lp)] = lp.trips
    return algebra.Mul(*groups.values())


def block_tiles(program: Program, launch) -> tuple[int, int]:
    """Bytes one thread block loads into the compute level before it can start (one tile of
    every array it loads: the first chunk of a streamed one) and bytes it saves last (one tile
    of every array it saves from the compute level)."""
    schedule = launch.schedule
    level = schedule.compute_level
    first = last = 0
    seen = set()
    for step, _ in walk(launch.body):
        if step.op not in ("load", "save") or step.level != level or (step.op, step.array) in seen:
            continue
        seen.add((step.op, step.array))
        tile = as_number(tile_values(schedule, level, step.axes) * _bytes(step.dtype))
        if tile is None:
            return 0, 0
        if step.op == "load":
            first += tile
        else:
            last += tile
    return first, last


def fixed_costs(program: Program, occupancy: dict) -> dict:
    """Seconds that do not shrink with more work (docs/method.md, "Fixed costs"), per kind:

    * ``launch``: each launch starts after the previous one (the profile's ``launch_s``);
    * ``fill``: a launch's first wave of blocks all load their first tiles at once, from
      device memory at the slowest link down to the compute level, before any of them computes;
    * ``prologue``: each later wave on an SM that holds one block at a time starts with that
      block's first tiles at the SM's share of the bandwidth into the compute level (with two
      or more blocks per SM another block computes meanwhile, and nothing is charged);
    * ``drain``: the last wave's output tiles leave for device memory after its last product.
    """
    hardware = program.hardware
    schedule = program.schedule
    out = {"launch": 0.0, "fill": 0.0, "prologue": 0.0, "drain": 0.0}
    if hardware.symbolic:
        return out
    from .pseudocode import blocks_per_unit

    compute = hardware.level(schedule.compute_level)
    # First tiles come from device memory through every level down to the compute level: at the
    # slowest of those links (a level of infinite bandwidth in between changes nothing).
    links = [lv.bandwidth for lv in hardware.levels[1:hardware.index(compute.name) + 1]]
    below_top = min(links) if links and all(isinstance(b, (int, float)) for b in links) else None
    for launch in program.launches:
        out["launch"] += hardware.launch_s
        blocks = as_number(launch_blocks(program, launch))
        resident = blocks_per_unit(launch.schedule, *occupancy[launch.index]) if launch.index in occupancy else None
        if not blocks or resident is None or below_top is None:
            continue
        slots = resident[0] * compute.units
        first, last = block_tiles(program, launch)
        wave = min(blocks, slots)
        out["fill"] += wave * first / below_top
        out["drain"] += wave * last / below_top
        if resident[0] == 1 and isinstance(compute.bandwidth, (int, float)):
            later_waves = -(-blocks // slots) - 1
            out["prologue"] += later_waves * first / (compute.bandwidth / compute.units)
    return out


def launch_occupancy(program: Program, rows: list[dict], selected: ProgramSelection | None = None,
                     resources: dict | None = None) -> dict:
    """Per launch: (shared bytes, threads, registers per thread) that decide how many of its
    blocks an SM holds. Threads and registers come from ``resources`` (the compiled kernel:
    its block size and ptxas's count) where given; a tensor-core launch otherwise has its
    plan's threads and an estimate from its fragments (``isel.estimated_registers``); an FMA
    launch its threads, and registers only once compiled."""
    from .isel import FMA_THREADS, estimated_registers

    level = program.schedule.compute_level
    tensor = tensor_launches(program, selected)
    out = {}
    for launch in program.launches:
        mine = [r for r in rows if r["launch"] == launch.index]
        smem = as_number(max_of(r["M_bytes"].get(level, 0) for r in mine)) if mine else None
        if smem is None:
            continue
        threads = registers = None
        if resources and launch.index in resources:
            threads, registers, *compiled = resources[launch.index]
            smem = compiled[0] if compiled else smem  # the compiled kernel's static + dynamic shared bytes
        elif launch.index in tensor:
            plan, tile = tensor[launch.index]
            threads, registers = plan.threads, estimated_registers(plan, launch, tile)
        elif program.hardware.arch is not None:
            threads = FMA_THREADS  # registers unknown until ptxas has counted them
        out[launch.index] = (smem, threads, registers)
    return out


def cache_warnings(program: Program, levels: dict) -> list[str]:
    """A warning for each shared cache level (L2, not partitioned by the user) whose M is over its
    capacity: check_capacity does not refuse those (M lists whole tiles), so the report says so."""
    schedule = program.schedule
    warnings = []
    for name, c in levels.items():
        if c.capacity is None or schedule.hardware.level(name).per != "device" or name == schedule.compute_level:
            continue
        if any(not p.derived for p in schedule.partitions_at(name)):
            continue  # partitioned by the user: check_capacity refuses an overflow
        used, capacity = as_number(c.M_bytes), as_number(c.capacity)
        if used is None or capacity is None or used <= capacity:
            continue
        warnings.append(f"warning: {name} M = {_fmt(used)} B exceeds its capacity {_fmt(capacity)} B: {name} is modelled as a "
                        f"cache; M lists whole tiles of one {name} group, and HBM reuse is charged only for groups whose "
                        f"chunks in flight fit (docs: method, the L2 level)")
    return warnings


def accumulator_notes(program: Program, selected: ProgramSelection | None = None) -> list[str]:
    """A note for each accumulator an FMA launch keeps in shared memory rather than registers
    (``isel.fma_accumulators``), saying why: the model counts it at the compute level."""
    selected = _selected(program, selected)
    notes = []
    for launch in program.launches:
        for name, why in selected[launch.index].refused.items():
            notes.append(f"launch {launch.index}: {name} stays in shared memory on the FMA path ({why})")
    return notes


def check_capacity(program: Program, levels: dict, rows: list[dict]) -> None:
    """Raise a RelabelError listing the buffers when a level's memory exceeds its capacity."""
    schedule = program.schedule
    counts_values = schedule.hardware.counts == "values"
    for name, c in levels.items():
        shared_cache = (schedule.hardware.level(name).per == "device" and name != schedule.compute_level
                        and not any(not p.derived for p in schedule.partitions_at(name)))
        if c.capacity is None or shared_cache:
            # L2 is a cache the user did not partition: napkin's derived grouping (plan.py) was
            # chosen to fit the chunks co-resident blocks have in flight; M lists whole tiles
            # there, which the cache never holds at once.
            continue
        used = c.M if counts_values else c.M_bytes
        used_n, capacity_n = as_number(used), as_number(c.capacity)
        if used_n is None or capacity_n is None or used_n <= capacity_n:
            continue
        key = "M" if counts_values else "M_bytes"
        worst = max(rows, key=lambda r: as_number(r[key].get(name, 0)) or 0)
        schedule = program.launches[worst["launch"]].schedule  # the overflowing launch's view
        parts = []
        for b in worst["buffers"].get(name, []):
            values = tile_values(schedule, name, b.axes)
            parts.append(f"{b.name}[{' '.join(str(schedule.extent(a, name)) for a in b.axes)}] {b.dtype} = {_fmt(values * _bytes(b.dtype))} B")
        unit = "values" if counts_values else "bytes"
        partitions = [p for p in schedule.partitions_at(name) if not p.derived and as_number(bind(p.size, schedule.sizes))]
        largest_buffer = max(worst["buffers"].get(name, []), key=lambda b: as_number(tile_values(schedule, name, b.axes) * _bytes(b.dtype)) or 0,
                             default=None)
        if largest_buffer is not None:
            # Shrinking a partition helps only if the largest buffer has that axis.
            partitions = [p for p in partitions if p.axis in largest_buffer.axes]
        hint = None
        if largest_buffer is not None and not partitions:
            free = [a for a in largest_buffer.axes if schedule.extent(a, name) == schedule.axis_size(a) and schedule.axis_size(a) != 1]
            hint = (f"the largest buffer, {largest_buffer.name}, is not partitioned along {' or '.join(free) or 'any axis'} at {name}: "
                    f"partition one of them, or let `napkin tune` choose")
        if partitions:
            largest = max(partitions, key=lambda p: as_number(bind(p.size, schedule.sizes)))
            size = as_number(bind(largest.size, schedule.sizes))
            ratio = capacity_n / used_n
            suggestion = max(1, 2 ** int(math.floor(math.log2(max(size * ratio, 1)))))
            hint = f"try '{largest.kind} {largest.axis} {suggestion}' (or let `napkin tune` choose)"
        raise RelabelError(
            f"{schedule.diagram.name} needs {used_n:,} {unit} at {name} per {c.per}, over its capacity of {capacity_n:,} "
            f"({schedule.hardware.name}); resident at step '{worst['text']}': " + "; ".join(parts),
            next((p.span for p in schedule.partitions_at(name) if p.span), None),
            hint,
        )


def cost_of(program: Program, *, check: bool = True, arch: str | None = None, resources: dict | None = None,
            path: str | None = None, selected: ProgramSelection | None = None, overlap: str | None = None) -> CostReport:
    """Read the performance model off a Program, for the instruction paths ``arch`` selects
    (default: the hardware profile's architecture). ``resources`` maps a launch index to the
    compiled kernel's (threads per block, registers per thread), which then decide occupancy.
    A third entry, the compiled kernel's shared bytes, replaces the model's in occupancy.
    ``path`` ("mma.sync", "wgmma") prices the tensor-core launches as if they used that
    instruction, a what-if with mma.sync's fragments: napkin builds what ``arch`` selects (on
    H100 and H200, whose arch is sm_90a, wgmma where isel takes it). ``selected``: the selection
    pass's result for that ``arch`` and ``path`` (``isel.select_program``), where the caller has it (a compile
    prints the same launches); otherwise it runs here, once, and every term reads it. ``overlap``
    (a name in :data:`OVERLAPS`) prices the wgmma launches' warpgroups under that schedule: one
    napkin builds (:data:`BUILT_OVERLAPS`: "pipelined" selects FlashAttention-3's intra-warpgroup
    order where a launch takes it, and prices its chain) or a what-if (the pingpong schedules).
    Without it, the selection's own order is priced."""
    from .isel import select_program

    hardware = program.hardware
    if path is not None and path not in hardware.tensor_paths():
        from .errors import NapkinError
        from .hardware import gpu_paths

        known = ", ".join(hardware.tensor_paths()) or "none"
        raise NapkinError(f"{hardware.name} has no {path!r} tensor-core path to price (its paths: {known})",
                          hint=f"the paths each profile lists ([path.*] tables): {gpu_paths()}")
    if arch is not None and not hardware.symbolic:
        hardware.check_arch(arch)  # an arch the profile does not describe: say which it does
    if selected is None:
        selected = select_program(program, arch, path, schedule=overlap if overlap in BUILT_OVERLAPS else None)
    elif (selected.arch, selected.path) != (arch or hardware.arch, path):
        raise AssertionError(f"napkin bug: a selection for {selected.arch} {selected.path} priced as {arch} {path}")
    built_as = built_schedule(selected)
    if overlap is None:  # the selection's own schedule
        overlap = built_as
    elif overlap != built_as and any(getattr(chosen.plan, "order_declined", "") for chosen in selected.launches.values()):
        overlap = built_as  # the selection asked for it and declined (a part of) it: the notes say why
    rows = columns(program, selected)
    levels = level_costs(program, rows, selected)
    if check:
        check_capacity(program, levels, rows)
    flops, priced = flops_by_unit(program, selected)
    occupancy = launch_occupancy(program, rows, selected, resources) if not hardware.symbolic else None
    fma = {launch.index: seconds for launch in program.launches
           if (seconds := fma_issue_seconds(program, launch, selected)) is not None}
    priced_overlap = OVERLAPS[overlap_name(program, selected, overlap)]
    hidden = {launch.index: priced_overlap.hidden for launch in program.launches if selected[launch.index].path == "wgmma"}
    # An implicit GEMM's gather issues beside its products: other warps' and blocks' products run
    # on the tensor cores while a warp gathers, so the longer of the two binds (the SASS ceiling's max)
    gathers = {launch.index: seconds for launch in program.launches
               if (seconds := gather_issue_seconds(program, launch, selected)) is not None}
    for index in gathers:
        hidden[index] = (*hidden.get(index, ()), "issue")
    copied = {launch.index: n for launch in program.launches
              if not hardware.symbolic and (n := copied_bytes(program, launch, selected)) is not None}
    conflicts = {launch.index: copy_conflict(program, launch, selected) for launch in program.launches if launch.index in copied}
    what_if = priced_overlap.name != built_as
    built = not what_if and not hardware.symbolic
    chains, chain_notes = launch_chains(program, selected) if built else ({}, [])
    time = predict_time(program, levels, priced, occupancy, launch_level_costs(program, rows, levels, selected), fma, hidden,
                        {index: n * conflicts[index] for index, n in copied.items()}, chains, gathers)
    time["overlap"] = priced_overlap.name
    schedule = program.schedule
    notes = (list(schedule.notes) + cache_warnings(program, levels) + masked_notes(program) + accumulator_notes(program, selected)
             + chain_notes)
    for index, n in copied.items():
        names = " and ".join(selected[index].plan.transposed)
        notes.append(f"launch {index}: {names}'s K-major copy (8-bit wgmma reads its shared operands K-major only) moves {_fmt(n)} bytes "
                     f"through shared memory's port, an LDS and an STS a byte, at {conflicts[index]:.2f}x the conflict-free "
                     "wavefronts (layouts.transpose_split), in the registers term")
    if what_if:
        notes.append(f"priced with the {priced_overlap.name} warpgroup schedule: {priced_overlap.does} (a what-if: "
                     f"these launches are built {built_as}; evidence: {priced_overlap.evidence})")
    for index, chosen in selected.launches.items():
        if getattr(chosen.plan, "order_declined", ""):
            notes.append(f"launch {index}'s consumers are built {chosen.plan.roles.schedule if chosen.plan.roles else 'serial'}, "
                         f"{chosen.plan.order_declined}")
    if path is None and not hardware.symbolic:  # never a silent fall to the FMA path: say why
        for launch in program.launches:
            chosen = selected[launch.index]
            if chosen.plan is None and _tensor_refusal(hardware, chosen.reason):
                notes.append(f"launch {launch.index} stays on the FMA path: {chosen.reason}")
    if path is not None:
        built = sorted({c.path for c in select_program(program, arch).launches.values() if c.plan is not None})
        notes.append(f"priced as if the contractions ran on {path} (a what-if: napkin builds "
                     f"{' and '.join(built) or 'the FMA path'} for {arch or hardware.arch})")
        for launch in program.launches:
            chosen = selected[launch.index]
            if chosen.plan is None and chosen.reason not in ("no contraction", "sizes are symbolic"):
                notes.append(f"launch {launch.index} stays on the FMA path under {path}: {chosen.reason}")
    if any(lp.derived for launch in program.launches for _, loops in walk(launch.body) for lp in loops):
        notes.append("the l2 groups are derived: co-resident thread blocks in a swizzled launch order share L2 (docs: method, the L2 level)")
    device = ring = None
    if hardware.device is not None:
        device = device_cost(schedule)
        ring = ring_condition(program, flops, device["axis"] if device and device["kind"] == "split" else None)
        if ring is not None:  # the rows each GPU holds: fewer where the device partition groups a row axis
            cut = device["parts"] if device and device["kind"] == "group" and device["axis"] in ring["rows_axes"] else 1
            ring["held"] = -(-ring["rows"] // cut)
    return CostReport(
        kernel=schedule.diagram.name,
        hardware=schedule.hardware.name,
        sizes=dict(schedule.sizes),
        levels=levels,
        flops=flops,
        time=time,
        counts=schedule.hardware.counts,
        notes=notes,
        device=device,
        ring=ring,
    )


def _tensor_refusal(hardware, reason: str) -> bool:
    """Whether ``reason`` keeps a launch off tensor cores the target has for it: not a launch
    without a contraction, nor one whose dtype or target has no tensor-core path (the FMA
    path is then the only one, and says so in the profile)."""
    return bool(reason) and reason not in ("no contraction", "sizes are symbolic") and not reason.startswith(f"{hardware.name} has no ")


def build_schedule(overlap: str | None) -> str | None:
    """The warpgroup schedule to build for ``overlap`` (a name in :data:`BUILT_OVERLAPS`; None:
    the relabel block's, ``isel.select_program``), or a :class:`NapkinError` naming the schedules."""
    from .errors import NapkinError

    if overlap is None or overlap in BUILT_OVERLAPS:
        return overlap
    raise NapkinError(f"no warpgroup schedule {overlap!r} to build (the schedules: {', '.join(BUILT_OVERLAPS)})",
                      hint="docs/method.md, overlap of the compute units")


def built_schedule(selected: ProgramSelection) -> str:
    """The warpgroup schedule a selection built (``Roles.schedule``): the most a wgmma launch's
    consumers take, "serial" where none has roles."""
    built = [chosen.plan.roles.schedule for chosen in selected.launches.values() if getattr(chosen.plan, "roles", None) is not None]
    return max(built, key=BUILT_OVERLAPS.index, default=BUILT_OVERLAP)


def overlap_name(program: Program, selected, overlap: str | None) -> str:
    """The schedule to price: ``overlap``, checked (a name in :data:`OVERLAPS`, and a launch on
    wgmma for it to schedule), or the one napkin builds."""
    from .errors import NapkinError

    if overlap is None or overlap == BUILT_OVERLAP:
        return BUILT_OVERLAP
    if overlap not in OVERLAPS:
        raise NapkinError(f"no warpgroup schedule {overlap!r} to price (the schedules: {', '.join(OVERLAPS)})",
                          hint="docs/method.md, overlap of the compute units")
    if program.hardware.symbolic or not any(selected[launch.index].path == "wgmma" for launch in program.launches):
        unbound = program.hardware.symbolic or any(selected[launch.index].reason == "sizes are symbolic"
                                                   for launch in program.launches)
        paths = "none: sizes are symbolic" if unbound else ", ".join(sorted({selected[launch.index].path
                                                                             for launch in program.launches}))
        raise NapkinError(f"the {overlap} schedule is of wgmma's warpgroups, and no launch here is on wgmma (paths: {paths})",
                          hint="price the sm_90a build (--arch sm_90a on H100 or H200), bound to sizes")
    return overlap


# ---- the device level: a node of GPUs (hardware.Hardware.device, docs/method.md) --------------


def device_block(block, profile, partition):
    """``block`` (relabel syntax) as one GPU of the node runs it: without its clause at the top
    level, and, for a split across the GPUs, with ``split AXIS SIZE`` at the compute level, so
    that each GPU's Program streams its parts and saves their states as a split on one GPU does
    (the combine launch merges them on GPU 0)."""
    from . import syntax as syn

    top, compute = profile.top.name, profile.compute_level.name
    levels = [c for c in (block.levels if block is not None else ()) if c.level != top]
    if partition is not None and partition.kind == "split":
        if any(p.kind == "split" for c in levels for p in c.partitions):
            raise NotImplementedError(f"a split of {partition.axis} across the GPUs beside a split on each GPU: "
                                      "napkin splits one axis per launch")
        span = partition.span
        extra = syn.Partition("split", partition.axis, int(partition.size), span)
        at = next((i for i, c in enumerate(levels) if c.level == compute and c.partitions and c.partitions[0].targets is None), None)
        if at is None:
            levels.append(syn.LevelClauses(compute, (extra,), span))
        else:
            levels[at] = dataclasses.replace(levels[at], partitions=(extra,) + tuple(levels[at].partitions))
    if block is None:
        return syn.RelabelBlock(None, profile.name, tuple(levels), partition.span) if levels else None
    return dataclasses.replace(block, levels=tuple(levels))


def device_parts(partition, size: int, devices: int) -> list[tuple[int, int, int]]:
    """The parts of a device partition of an axis of ``size``: (unit, start, stop) each, part p
    on unit p mod ``devices`` (GPU 0 holds the inputs and merges)."""
    tile = int(partition.size)
    return [(p % devices, start, min(start + tile, size)) for p, start in enumerate(range(0, size, tile))]


def device_cost(schedule, devices: int | None = None) -> dict | None:
    """What crosses the links between the GPUs of a node (NVLink), for the device partition of
    ``block`` (a clause at the top level): None on one GPU or without one. GPU 0 holds the inputs
    and the outputs: each other GPU receives the inputs of its parts (a slice along the axis where
    an input has it, else the whole input, once per GPU, as a group loads what it reads), and
    sends back its outputs (a group) or its parts' states (a split: the arrays the parts launch
    saves along the part axis, ``O.acc.part``, ``P.max.part``, ``P.sum.part``), which GPU 0's
    combine launch merges. ``H`` is their sum in bytes; ``link_s`` the time through GPU 0's link,
    each way at the device level's bandwidth."""
    from .pseudocode import elaborate
    from .relabel import Partition, make_schedule, part_axis

    diagram, profile, sizes = schedule.diagram, schedule.hardware, schedule.sizes
    if profile.device is None or not schedule.device or any(not isinstance(sizes.get(a), int) for a in diagram.axes):
        return None
    partition = schedule.device[0]
    devices = profile.device.units if devices is None else devices
    axis = partition.axis
    parts = device_parts(partition, int(sizes[axis]), devices)

    def nbytes(axes, dtype, length=None) -> int:
        return math.prod(length if a == axis and length is not None else int(sizes[a]) for a in axes) * DTYPE_BYTES[dtype]

    sent = received = 0
    for unit in sorted({u for u, _, _ in parts} - {0}):
        mine = [(start, stop) for u, start, stop in parts if u == unit]
        for array in diagram.input_arrays:
            if axis in array.axes:
                sent += sum(nbytes(array.axes, array.dtype, stop - start) for start, stop in mine)
            else:
                sent += nbytes(array.axes, array.dtype)
    states = {}
    if partition.kind == "split":
        # One GPU's Program: its partitions, and the split at the compute level (as device_block writes it).
        split = Partition(profile.compute_level.name, "split", axis, partition.size, partition.span)
        own = tuple(p for p in schedule.partitions if not p.derived)
        program = elaborate(make_schedule(diagram, profile, None, sizes, extra_partitions=(split,) + own))
        top = profile.top.name
        states = {step.array: (step.axes, step.dtype) for launch in program.launches if launch.combine is None
                  for step, _ in walk(launch.body) if step.op == "save" and step.dest == top and part_axis(axis) in step.axes}
        per_part = sum(nbytes([a for a in axes if a != part_axis(axis)], dtype) for axes, dtype in states.values())
        received = per_part * sum(1 for u, _, _ in parts if u != 0)
    else:
        for u, start, stop in parts:
            if u != 0:
                received += sum(nbytes(a.axes, a.dtype, stop - start if axis in a.axes else None) for a in (diagram.arrays[n] for n in diagram.outputs))
    bandwidth = profile.device.bandwidth
    return {
        "level": profile.device.name, "partition": f"{profile.top.name}: {partition.kind} {axis} {partition.size}",
        "kind": partition.kind, "axis": axis, "size": int(partition.size), "parts": len(parts),
        "devices": devices, "units": profile.device.units, "bandwidth": bandwidth,
        "sent": sent, "received": received, "H": sent + received, "states": sorted(states),
        "link_s": max(sent, received) / bandwidth,
    }


def ring_condition(program: Program, flops: dict, axis: str | None = None) -> dict | None:
    """The ring-attention condition, read off the kernel: with the keys of ``axis`` (the axis a
    device split cuts, else the one the kernel's softmax or contraction consumes) passing from
    GPU to GPU, a GPU hides a block of c keys' transfer under its compute when its rows (the
    output's axes that no input woven over ``axis`` has: the queries) take at least as long to
    attend to them: ``rows x c x F_pair / F >= c x B_key / BW``, so at least
    ``B_key x F / (BW x F_pair)`` rows per GPU, with F_pair the tensor FLOPs per (row, key),
    B_key the input bytes per key (K and V), F the tensor peak of their dtype and BW the device
    level's bandwidth. For attention that is ``s F h_kv / (2 BW h)``. None where the kernel has
    no such axis, or the sizes are unbound."""
    diagram, profile, sizes = program.diagram, program.hardware, program.schedule.sizes
    if profile.device is None:
        return None
    if axis is None:
        consumed = [a for s in diagram.statements for a in s.consumed]
        # The keys: a consumed axis some inputs have and others (the queries) lack; not d, which all have.
        axis = next((a for a in consumed if any(a in arr.axes for arr in diagram.input_arrays)
                     and not all(a in arr.axes for arr in diagram.input_arrays)), None)
    if axis is None or any(not isinstance(sizes.get(a), int) for a in diagram.axes):
        return None
    keyed = [a for a in diagram.input_arrays if axis in a.axes]
    rows_axes = sorted({a for out in diagram.outputs for a in diagram.arrays[out].axes if all(a not in k.axes for k in keyed)})
    if not keyed or not rows_axes:
        return None
    unit = "tensor" if as_number(flops.get("tensor", 0)) else "fma"  # where the Program's contractions run
    tensor = as_number(flops.get(unit, 0)) or 0
    if not tensor:
        return None
    rows = math.prod(sizes[a] for a in rows_axes)
    pair_flops = tensor / (rows * sizes[axis])
    key_bytes = sum(math.prod(sizes[a] for a in k.axes) * DTYPE_BYTES[k.dtype] for k in keyed) / sizes[axis]
    dtype = keyed[0].dtype
    peak = profile.peak(unit, dtype)
    bandwidth = profile.device.bandwidth
    need = key_bytes * peak / (bandwidth * pair_flops)
    return {"axis": axis, "unit": unit, "rows_axes": rows_axes, "pair_flops": pair_flops, "key_bytes": key_bytes, "peak": peak,
            "dtype": dtype, "bandwidth": bandwidth, "rows_needed": need, "rows": rows}


def device_lines(report_device: dict | None, ring: dict | None, rows_per_gpu: int | None = None) -> list[str]:
    """What ``napkin cost`` prints of the device level."""
    lines = []
    if report_device is not None:
        d = report_device
        lines.append(f"  device level ({d['level']}, {d['devices']} of {d['units']} GPUs, {d['bandwidth'] / 1e9:g} GB/s each way): "
                     f"{d['partition']}, {d['parts']} part{'s' if d['parts'] != 1 else ''}; H {d['H']:,} bytes over the links "
                     f"({d['sent']:,} to the GPUs, {d['received']:,} back to GPU 0"
                     + (f": {', '.join(d['states'])}" if d["states"] else "") + f"), {_fmt_time(d['link_s'])} through GPU 0's link")
    if ring is not None:
        r = ring
        rows = " ".join(r["rows_axes"])
        held = rows_per_gpu if rows_per_gpu is not None else r["rows"]
        verdict = "hidden" if held >= r["rows_needed"] else "not hidden"
        lines.append(f"  ring condition ({r['axis']} passing between GPUs): {rows} >= B_key F / (BW F_pair) = "
                     f"{r['key_bytes']:g} B x {r['peak'] / 1e12:g} TFLOP/s / ({r['bandwidth'] / 1e9:g} GB/s x {r['pair_flops']:g} FLOP) "
                     f"= {r['rows_needed']:,.0f} per GPU; {held:,} per GPU here: {verdict} under compute")
    return lines


def smem_bytes_by_launch(program: Program, arch: str | None = None) -> list[int]:
    """The report's M in bytes at the compute level, per launch (what the arena must equal), for
    the paths selection takes on ``arch`` (default: the profile's; an fp8 product is on tensor
    cores on sm_89 and later only)."""
    from .isel import select_program

    out = []
    for launch in program.launches:
        single = Program(program.schedule, (launch,))
        selected = select_program(single, arch)  # once, for the columns and the costs alike
        rows = columns(single, selected)
        out.append(int(as_number(level_costs(single, rows, selected)[program.schedule.compute_level].M_bytes)))
    return out
