"""The tuner: fusion, group and stream sizes that minimise predicted time under the constraints.

For a named GPU the search space is every choice of intermediates materialised at device
memory (``plan.materialise``: launch splits), and per launch its group sizes and stream axis
and size: multiples of the hardware's divisibility constraints (tensor-core fragments
m16n8k16 on the axes a contraction maps to M, N and K; 128-byte coalescing, 128 /
bytes-per-value values, on an array's contiguous last axis; combined by least common
multiple). The relabelling written in the file is costed exactly and is always a candidate.

Each launch is elaborated once with symbolic partition sizes; memory, transfers and FLOPs
become one compiled Python function (``algebra.lambdify``) that scores every candidate, a lower
bound of its time (contractions at the fastest rate the arch builds: mma.sync's, wgmma's on sm_90a; a masked stream's steps on the elements
its mask leaves unmasked, whatever chunks the tiles make it visit). The best are checked with
numeric tiles (instruction selection's path, the plan's buffers), and the combinations of every
fusion choice's launches are planned and costed exactly (masked tails, derived L2 grouping,
occupancy, fixed costs) in order of a lower bound of the whole Program's time, until none left can
beat the best or MAX_COSTED were costed (branch and bound, _Search.branch_and_bound); they are
returned best first, with the gap to the model's optimum that remains (``TuneResult.optimality``).

For the abstract models (values, symbolic capacity ``M``) it fits the paper's optimum
``H* = sum_t alpha_t M^-beta_t``: the leading exponent ``beta`` (1/2 for matmul, 1 for
attention) and the terms that do not depend on ``M``.

A :class:`TuneResult` prints as a short table; ``relabel_text`` is its relabel block,
``Kernel.relabelled(result)`` applies it (fusion included), :func:`write_tuned` writes it into a
copy of the source, :func:`plot_svg` draws predicted time against the tile sizes searched and
:func:`compare` costs kernels and relabellings side by side. It does not change a kernel in
place, and it does not search loop order, pipeline stages (instruction selection picks them:
isel.stage_count) or dtypes.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time as _time
from dataclasses import dataclass, field

from . import algebra
from .algebra import as_number
from . import syntax as syn
from .check import check_size_bounds
from .cost import (CostReport, busy_fraction, columns, cost_of, flops_by_unit, instruction_path,
                   level_costs, masked_elements, masked_wave_efficiency, step_total, tile_values)
from .dtypes import DTYPE_BYTES
from .diagram import Contract, Diagram
from .errors import NapkinError, RelabelError
from .formatting import format_count, json_value
from .hardware import BUILT_OVERLAPS, Hardware, load_hardware
from .isel import select_program
from .paths.plan import TENSOR_DTYPES
from .plan import materialise, materialised, plan, shared_cache_level, split_points
from .pseudocode import Loop, Mask, Program, elaborate, walk
from .relabel import bind, make_schedule, split_launches
from .windows import completed_sizes

FRAGMENT = {"m": 16, "n": 8, "k": 16}  # mma.sync m16n8k16
COALESCE_BYTES = 128
# The coalescing multiple of an 8-bit array's contiguous axis: 64 values, 64 bytes (two whole 32-byte
# sectors, and the 64-byte swizzle span of a TMA box), as many values as a 16-bit array's. 128
# would hold fp8 attention's key chunk to 128 where V is stored keys-fastest, and its S, O and P
# fragments do not fit one thread's registers with 16-row warp tiles at d = 128 (issue 44).
NARROW_COALESCE_VALUES = 64


def coalescing_multiple(bytes_per_value: int) -> int:
    """The values a tile of an array's contiguous axis is a multiple of, for coalesced loads:
    ``COALESCE_BYTES`` of them, and ``NARROW_COALESCE_VALUES`` for 8-bit values."""
    return NARROW_COALESCE_VALUES if bytes_per_value == 1 else max(1, COALESCE_BYTES // bytes_per_value)


@dataclass(frozen=True)
class Knob:
    """A partition the tuner sizes: its level, kind and axis."""

    level: str
    kind: str
    axis: str
    targets: tuple[str, ...] | None = None  # scoped to the launch computing these arrays

    @property
    def symbol(self) -> algebra.Symbol:
        # The level is in the name: a block may partition one axis at two levels (smem: group q
        # 128 with registers: group q 16), two knobs that must not share a symbol.
        scope = "_for_" + "_".join(self.targets) if self.targets else ""
        return algebra.Symbol(f"tune_{self.level}_{self.kind}_{self.axis}{scope}", positive=True, integer=True)


@dataclass
class Configuration:
    sizes: dict  # axis -> size
    time_s: float | None
    report: CostReport | None = None
    knobs: list = field(default_factory=list)
    values: dict = field(default_factory=dict)  # Knob -> size; `sizes` is the same by axis
    origin: str = "tuned"  # "as written", "resized" (the written partitions), "tuned" or "fusion"
    materialised: frozenset | None = None  # arrays at the top level when not as written
    diagram: Diagram | None = field(default=None, repr=False)  # the diagram it was costed on
    searched: list | None = field(default=None, repr=False)  # per launch scope: (estimate, rank, knobs, sizes) searched
    overlap: str | None = None  # the warpgroup schedule it was costed under (schedule_candidates), None the default

    def __repr__(self) -> str:
        where = f", at gmem: {', '.join(sorted(self.materialised)) or 'none'}" if self.materialised is not None else ""
        return f"<Configuration {_fmt_seconds(self.time_s)} {self.bound or ''} ({self.origin}{where}): {self.relabel_line()}>"

    @property
    def bound(self) -> str | None:
        """What bounds the predicted time: compute, or the level whose transfers take longest."""
        return self.report.time.get("bound") if self.report is not None else None

    def size_of(self, knob: Knob):
        return self.values.get(knob, self.sizes.get(knob.axis))

    def relabel_lines(self, knobs=None) -> list[str]:
        """The configuration as relabel clauses, one line per level and launch scope."""
        knobs = self.knobs if knobs is None else knobs
        lines = []
        for level, targets in dict.fromkeys((k.level, k.targets) for k in knobs):
            mine = [k for k in knobs if (k.level, k.targets) == (level, targets) and self.size_of(k) is not None]
            groups = [f"{k.axis} {self.size_of(k)}" for k in mine if k.kind == "group"]
            splits = [f"{k.axis} {self.size_of(k)}" for k in mine if k.kind == "split"]
            streams = [f"{k.axis} {self.size_of(k)}" for k in mine if k.kind == "stream"]
            parts = (([f"group {', '.join(groups)}"] if groups else []) + ([f"split {', '.join(splits)}"] if splits else [])
                     + ([f"stream {', '.join(streams)}"] if streams else []))
            scope = f" for {', '.join(targets)}" if targets else ""
            lines.append(f"{level}{scope}: " + "; ".join(parts))
        if self.overlap is not None:
            lines.append(f"overlap: {self.overlap}")
        return lines

    def relabel_line(self, knobs=None) -> str:
        return " | ".join(self.relabel_lines(knobs))


@dataclass
class TuneResult:
    kernel: str
    hardware: str
    knobs: list
    configurations: list  # best first
    evaluated: int
    seconds: float
    constraints: dict = field(default_factory=dict)  # axis -> the multiples its tiles keep, one per launch searched (sorted)
    beta: object = None
    optimum: object = None
    fusion_choices: int = 1  # sets of materialised intermediates searched
    written: frozenset = frozenset()  # arrays the source materialises at the top level
    curves: dict = field(default_factory=dict, repr=False)  # "group q for O" -> {size: best estimate (s)}
    optimality: Optimality | None = None  # how far the best can be from the model's optimum (a GPU profile)
    units: frozenset = frozenset()  # axes whose tiles may also be 1 (unit_axes): an operand's other free axes hold the fragment

    @property
    def best(self) -> Configuration:
        return self.configurations[0]

    def relabel_block(self) -> str:
        lines = "".join(f"    {line}\n" for line in self.best.relabel_lines())
        return f"relabel {self.kernel} on {self.hardware}:\n{lines}"

    @property
    def relabel_text(self) -> str:
        """The best relabelling as a relabel block. When the best configuration also changes
        which intermediates are materialised, the block alone does not say so:
        :meth:`source_text` and ``Kernel.relabelled(result)`` apply both."""
        return self.relabel_block()

    @property
    def fusion_changed(self) -> bool:
        """Whether the best configuration materialises other intermediates than the source."""
        return self.best.materialised is not None and self.best.materialised != self.written

    def block(self, diagram: Diagram, hardware: Hardware) -> syn.RelabelBlock:
        """The best configuration as a relabel block (syntax), for planning."""
        return _block(diagram, hardware, self.best.knobs, self.best.values or self.best.sizes, self.best.overlap)

    def source_text(self, source: str, diagram: Diagram, relabels=()) -> str:
        """``source`` (a .napkin text defining ``diagram``) with the best configuration applied:
        ``@gmem`` written on (or removed from) the statements whose materialisation it changes,
        the kernel's relabel blocks (``relabels``, syntax) replaced by the tuned one."""
        materialised = self.best.materialised if self.best.materialised is not None else self.written
        return rewrite_source(source, diagram, load_hardware(self.hardware).top.name, materialised, self.written,
                              relabels, self.relabel_block())

    def to_dict(self) -> dict:
        return {
            "hardware": self.hardware,
            "evaluated": self.evaluated,
            "fusion_choices": self.fusion_choices,
            "seconds": self.seconds,
            "multiples": {a: list(ms) for a, ms in self.constraints.items()},
            "or_one": sorted(a for a in self.units if a in self.constraints),
            "beta": json_value(self.beta) if self.beta is not None else None,
            "optimum": str(self.optimum) if self.optimum is not None else None,
            "relabel_text": self.relabel_text,
            "optimality": self.optimality.to_dict() if self.optimality is not None else None,
            "configurations": [
                {"sizes": {a: json_value(v) for a, v in c.sizes.items()}, "relabel": c.relabel_line(), "time_s": c.time_s,
                 "bound": c.bound, "origin": c.origin,
                 "materialised": sorted(c.materialised if c.materialised is not None else self.written)}
                for c in self.configurations
            ],
        }

    def _rows(self) -> list[tuple[str, ...]]:
        rows = []
        for rank, config in enumerate(self.configurations, 1):
            chosen = config.materialised if config.materialised is not None else self.written
            rows.append((str(rank), _fmt_seconds(config.time_s), config.bound or "-", ", ".join(sorted(chosen)) or "none",
                         config.origin, config.relabel_line() or "(no partitions)"))
        return rows

    _HEADER = ("#", "time", "bound", "at gmem", "from", "tiles")

    def __repr__(self) -> str:
        optimal = f"; {self.optimality.text()}" if self.optimality is not None else ""
        head = (f"<TuneResult {self.kernel} on {self.hardware}: {self.evaluated:,} candidates, "
                f"{self.fusion_choices} fusion choice{'s' if self.fusion_choices != 1 else ''}, {self.seconds:.2f} s{optimal}>")
        if self.best.time_s is None:  # an abstract model's fit: no time to tabulate
            return head + "\n" + self.table()
        rows = [self._HEADER] + self._rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(self._HEADER) - 1)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=False)) + "  " + r[-1] for r in rows]
        return head + "\n" + "\n".join("  " + line.rstrip() for line in lines)

    def __str__(self) -> str:
        """The table ``napkin tune`` prints; the repr is the short one above (for the REPL)."""
        return self.table()

    def _repr_html_(self) -> str:
        import html

        def cells(row, tag):
            return "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in row)

        body = "".join(f"<tr>{cells(r, 'td')}</tr>" for r in self._rows())
        return (f"<p>tuning {html.escape(self.kernel)} on {html.escape(self.hardware)}: {self.evaluated:,} candidates, "
                f"{self.fusion_choices} fusion choices, {self.seconds:.2f} s"
                f"{'; ' + html.escape(self.optimality.text()) if self.optimality is not None else ''}</p>"
                f"<table><tr>{cells(self._HEADER, 'th')}</tr>{body}</table>")

    def table(self) -> str:
        choices = f", {self.fusion_choices} fusion choices" if self.fusion_choices > 1 else ""
        lines = [f"tuning {self.kernel} on {self.hardware}: {self.evaluated} configurations{choices} in {self.seconds * 1e3:.0f} ms"]
        if self.constraints:
            # Each launch keeps its own multiples (a fragment's, or coalescing where it loads along
            # the axis); a tile that is the whole axis is searched too.
            by_launch = " (by launch)" if any(len(ms) > 1 for ms in self.constraints.values()) else ""
            ones = sorted(a for a in self.units if a in self.constraints)
            lines.append(f"  multiples{by_launch}: " + ", ".join(f"{a} of {_either([str(m) for m in ms])}"
                                                             for a, ms in self.constraints.items()) + "; or the whole axis"
                         + (f"; or 1 for {', '.join(ones)}" if ones else ""))
        if self.optimality is not None:
            lines.append(f"  the best is {self.optimality.text()}" + (
                f" under the default warpgroup schedule; the {SCHEDULED} best then costed under each schedule napkin builds"
                if any(c.overlap is not None for c in self.configurations) else ""))
        if self.beta is not None:
            lines.append(f"  optimum: H* = {self.optimum}   (beta = {self.beta})")
            lines.append(f"  {getattr(self, 'fit_note', '')}")
        for rank, config in enumerate(self.configurations, 1):
            t = f"{config.time_s * 1e3:.4g} ms" if config.time_s is not None else "-"
            tflops = ""
            if config.report is not None and config.time_s:
                total = as_number(config.report.total_flops)
                if total:
                    tflops = f"  {total / config.time_s / 1e12:.0f} TFLOP/s"
            where = ""
            if config.materialised is not None and config.materialised != self.written:
                where = f"   [at gmem: {', '.join(sorted(config.materialised)) or 'none'}]"
            # The written relabelling is a candidate whatever its sizes: say so where it is off the multiples.
            off = config.origin == "as written" and any(
                isinstance(v, int) and all(v % m for m in self.constraints.get(a, (1,))) for a, v in config.sizes.items())
            lines.append(f"  {rank}. {config.relabel_line()}   predicted {t}{tflops}{where}{'   (as written)' if off else ''}")
        if self.fusion_changed:
            lines.append(f"  the best materialises {', '.join(sorted(self.best.materialised)) or 'nothing'} at gmem "
                         f"(the source: {', '.join(sorted(self.written)) or 'nothing'}): `napkin tune --write` writes both")
        return "\n".join(lines)


def _either(words: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _fmt_seconds(seconds) -> str:
    if seconds is None:
        return "-"
    for unit, scale in (("s", 1), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


_TARGET = r"(?P<indent>\s*)(?P<name>{name})(?P<axes>\s*\[[^\]]*\])?(?P<level>\s*@\s*\w+)?(?P<rest>\s*=)"


def parse_relabel(text: str, kernel: str, hardware: str | None) -> syn.RelabelBlock:
    """A relabel block from text: a whole block (``relabel K on HW:`` and its lines), or just its
    clause lines (``smem: group q 128; stream x 64``, several separated by newlines or `` | `` as
    :meth:`Configuration.relabel_line` prints them) for ``kernel`` on ``hardware``."""
    text = text.strip()
    if not text.startswith("relabel"):
        if hardware is None:
            raise NapkinError(f"relabel text without a header needs the hardware its levels belong to: {kernel} has none",
                              hint=f"write the block in full: relabel {kernel} on H100: ...")
        lines = [line.strip() for part in text.splitlines() for line in part.split(" | ") if line.strip()]
        text = f"relabel {kernel} on {hardware}:\n" + "".join(f"    {line}\n" for line in lines)
    module = syn.parse(text if text.endswith("\n") else text + "\n", "<relabel>")
    if module.kernels or len(module.relabels) != 1:
        raise NapkinError(f"expected one relabel block, got {len(module.relabels)} block(s) and {len(module.kernels)} kernel(s)",
                          hint=f"relabel {kernel} on H100:\n    smem: group ... ; stream ...")
    (block,) = module.relabels
    if block.kernel not in (None, kernel):
        raise NapkinError(f"the relabel block names kernel {block.kernel!r}, not {kernel!r}", block.span)
    return block


def retarget(block: syn.RelabelBlock | None, profile: Hardware) -> syn.RelabelBlock | None:
    """``block`` for another GPU profile when every level it names exists there, else None."""
    if block is None or block.hardware == profile.name:
        return block
    if load_hardware(block.hardware).symbolic or profile.symbolic:
        return None
    if any(c.level not in profile.level_names() for c in block.levels):
        return None
    return dataclasses.replace(block, hardware=profile.name)


def rewrite_source(source: str, diagram: Diagram, top: str, materialised, written, relabels, block_text: str) -> str:
    """``source`` with ``@top`` on exactly the statements in ``materialised`` (among those in
    ``materialised | written``), the relabel blocks ``relabels`` (syntax, with spans into
    ``source``) removed and ``block_text`` written where the first one was, else at the end."""
    import re

    lines = source.splitlines(keepends=True)
    for s in diagram.statements:
        if (s.target in materialised) == (s.target in written) or s.span is None:
            continue
        index = s.span.line - 1
        pattern = re.compile(_TARGET.format(name=re.escape(s.target)))
        match = pattern.match(lines[index]) if 0 <= index < len(lines) else None
        if match is None:
            raise NapkinError(f"cannot find the statement assigning {s.target} at line {s.span.line} to rewrite it",
                              hint="write the relabel block and the @gmem annotations by hand")
        level = f" @{top}" if s.target in materialised else ""
        lines[index] = (match.group("indent") + match.group("name") + (match.group("axes") or "") + level
                        + match.group("rest") + lines[index][match.end():])
    starts = sorted(b.span.line - 1 for b in relabels if b.span is not None)
    removed: set[int] = set()
    for start in starts:
        removed.add(start)
        end = start + 1
        while end < len(lines) and (not lines[end].strip() or lines[end][:1] in " \t"):
            end += 1
        while end > start + 1 and not lines[end - 1].strip():  # keep the blank lines after the block
            end -= 1
        removed.update(range(start, end))
    out = []
    for index, line in enumerate(lines):
        if starts and index == starts[0]:
            out.append(block_text)
        if index not in removed:
            out.append(line)
    if not starts:
        if out and not out[-1].endswith("\n"):
            out.append("\n")
        out.append("\n" + block_text)
    return "".join(out)


def knob_sets(diagram: Diagram, hardware: Hardware, block: syn.RelabelBlock | None, sizes: dict,
              statements=None) -> list[list[Knob]]:
    """The partitions to size: those of the relabel block; else, without one, every axis no
    statement consumes as a group, with each legal stream in turn (and with none).

    With ``statements`` (one launch's), the knobs are scoped to that launch.
    """
    if block is not None and block.levels:
        return [[Knob(c.level, p.kind, p.axis, p.targets) for c in block.levels for p in c.partitions]]
    level = hardware.compute_level.name
    scope = tuple(s.target for s in statements) if statements is not None else None
    statements = diagram.statements if statements is None else statements
    present = {a for s in statements for a in s.iteration_axes}
    consumed = {a for s in statements for a in s.consumed}
    groups = [Knob(level, "group", a, scope) for a in diagram.axes if a in present and a not in consumed]
    sets = []
    for axis in diagram.axes:
        if axis not in consumed:
            continue
        with_stream = groups + [Knob(level, "stream", axis, scope)]
        try:
            make_schedule(diagram, hardware, _block(diagram, hardware, with_stream, {}), sizes)
        except RelabelError:
            continue
        sets.append(with_stream)
    if groups:
        sets.append(groups)
    return sets


def knobs_for(diagram: Diagram, hardware: Hardware, block: syn.RelabelBlock | None, sizes: dict) -> list[Knob]:
    """The first knob set: the relabel block's, or the groups with the first legal stream."""
    sets = knob_sets(diagram, hardware, block, sizes)
    return sets[0] if sets else []


def _block(diagram: Diagram, hardware: Hardware, knobs: list[Knob], values: dict, overlap: str | None = None) -> syn.RelabelBlock:
    """A relabel block for knobs; ``values`` by Knob or by axis, missing ones stay symbols;
    ``overlap`` its warpgroup schedule line."""
    by_level: dict[tuple, list] = {}
    for k in knobs:
        size = values.get(k, values.get(k.axis, k.symbol.name))
        partition = syn.Partition(k.kind, k.axis, int(size) if not isinstance(size, str) else size, None, k.targets)
        by_level.setdefault((k.level, k.targets), []).append(partition)
    clauses = tuple(syn.LevelClauses(level, tuple(ps), None) for (level, _), ps in by_level.items())
    return syn.RelabelBlock(diagram.name, hardware.name, clauses, None, overlap)


def _products(statements) -> list:
    """The contractions of two operands or more: the products a fragment's shape constrains."""
    return [s for s in statements if isinstance(s.box, Contract) and len(s.box.operands) >= 2]


def _own_free_axes(s) -> tuple[list[str], list[str]]:
    """A product's free axes that only its first operand carries (rows: a fragment's m) and those
    only its second carries (columns: n), in the order of its axes."""
    first, second = s.box.operands[0], s.box.operands[1]
    return ([a for a in s.axes if a in first.axes and a not in second.axes],
            [a for a in s.axes if a in second.axes and a not in first.axes])


def divisibility(diagram: Diagram, knobs: list[Knob], statements=None) -> dict[str, int]:
    """Required multiple per tuned axis: fragment shape and coalescing, by least common multiple.

    ``statements`` (default: all) are those the knobs partition: one launch's, for scoped knobs.
    """
    required: dict[str, int] = {}
    statements = diagram.statements if statements is None else statements
    arrays = [n for s in statements for n in s.inputs] if statements is not diagram.statements else list(diagram.params)

    def need(axis, multiple):
        required[axis] = math.lcm(required.get(axis, 1), multiple)

    tuned = {k.axis for k in knobs}
    for s in _products(statements):
        rows, cols = _own_free_axes(s)
        for axis in rows:
            need(axis, FRAGMENT["m"])
        for axis in cols:
            need(axis, FRAGMENT["n"])
        for axis in s.box.contracted:
            need(axis, FRAGMENT["k"])
    present = [diagram.arrays[n] for n in dict.fromkeys(arrays + [s.target for s in statements]) if n in diagram.arrays]
    for name in dict.fromkeys(arrays):  # loaded arrays: coalesce along their contiguous last axis
        array = diagram.arrays.get(name)
        if array is None or not array.axes:
            continue
        # A broadcast array (its axes a strict subset of another's here: BatchNorm's mu[c] beside
        # X[n c h w]) is a few values a tile: its loads need no coalescing, and its multiple would
        # hold the larger array's tile to it (c of 32, where c 1 fits).
        if any(set(array.axes) < set(other.axes) for other in present):
            continue
        need(array.axes[-1], coalescing_multiple(array.bytes_per_value))
    return {a: m for a, m in required.items() if a in tuned}


def unit_axes(diagram: Diagram, knobs: list[Knob], statements=None) -> set[str]:
    """Tuned axes whose fragment multiple (:func:`divisibility`) may also be met by a tile of 1: a
    contraction operand's free axes of its own, where it has several (``A[b i j l]`` of
    ``C[b i j k] = A[b i j l] * B[l k]``). A tile of 1 is not wide (instruction selection reads an operand's tile along its axes over 1), so one
    of the others carries the fragment's rows, as ``group b 1, i 1, j 128`` does. Not an array's
    contiguous last axis, whose tile coalesces the loads."""
    statements = diagram.statements if statements is None else statements
    found: set[str] = set()
    for s in _products(statements):
        for own in _own_free_axes(s):  # the axes divisibility holds to a fragment
            if len(own) > 1:
                found.update(own)
    last = {array.axes[-1] for array in diagram.arrays.values() if array.axes}
    return {k.axis for k in knobs if k.axis in found and k.axis not in last}


def _candidates(size: int, multiple: int, unit: bool = False) -> list[int]:
    """Sizes to try for an axis of ``size`` that must be a multiple of ``multiple``: the multiple
    times powers of two and times three powers of two (48, 96, 192: tiles between the powers of
    two often fit where the next power does not), the whole axis and its largest multiple; and 1
    where ``unit`` (:func:`unit_axes`)."""
    values = set()
    for factor in (1, 3):
        value = multiple * factor
        while value < size:
            values.add(value)
            value *= 2
    values.add(size)
    if multiple > 1 and size >= multiple:
        values.add(min(size, (size // multiple) * multiple) or multiple)
    small = {1, 2, 4} if multiple == 1 else {1} if unit else set()
    return sorted(v for v in values | small if 0 < v <= size)


def tune(diagram: Diagram, hardware: str | Hardware, block: syn.RelabelBlock | None = None, sizes: dict | None = None,
         top: int = 5, max_candidates: int = 20000, fusion: bool = True, progress=None,
         keep_written: bool = False) -> TuneResult:
    """Search group/stream sizes on ``hardware`` for ``diagram`` with every axis bound in ``sizes``.

    On a GPU the search space is: the relabelling as written (``block``, costed exactly: always a
    candidate, so the result is never worse than it); its partitions resized; and, with
    ``fusion``, every choice of intermediates materialised at the top level (which splits the
    kernel into launches), each launch with its own tiles and stream axis. ``progress`` is called
    with (done, total) fusion choices. With ``keep_written`` the choices keep every ``@gmem`` the
    source writes and may only add some (code generation: an unfused kernel stays unfused).
    """
    profile = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    sizes = dict(sizes or {})
    check_size_bounds(diagram, block, sizes)  # the scores below are floats formed from them
    sizes = completed_sizes(diagram, sizes)  # a convolution's output length, from its window read
    started = _time.perf_counter()
    if profile.symbolic:
        return _tune_abstract(diagram, profile, block, sizes, started)
    unbound = [a for a in diagram.axes if a not in sizes]
    if unbound:
        raise NapkinError(f"tuning needs every axis size; unbound: {' '.join(unbound)}",
                          hint=f"pass them, e.g. --set {' '.join(f'{a}=1024' for a in unbound)}")
    search = _Search(profile, sizes, max_candidates)
    written = materialised(diagram, profile)
    candidates: list[Configuration] = []
    spaces = []
    if block is not None and block.levels:
        try:
            report = cost_of(plan(diagram, profile, block, sizes))
            partitions = [(c.level, p) for c in block.levels for p in c.partitions]
            knobs = [Knob(level, p.kind, p.axis, p.targets) for level, p in partitions]
            values = {k: p.size for k, (_, p) in zip(knobs, partitions, strict=False)}
            candidates.append(Configuration({k.axis: v for k, v in values.items()}, report.time.get("overlapped_s"), report,
                                            knobs, values, origin="as written"))
        except RelabelError:
            pass  # the written relabelling does not fit these sizes: the search may find one that does
        unsplit = _without_splits(block)
        if unsplit != block and unsplit.levels:  # the written one with no split: a base for other splits
            try:
                report = cost_of(plan(diagram, profile, unsplit, sizes))
                partitions = [(c.level, p) for c in unsplit.levels for p in c.partitions]
                knobs = [Knob(level, p.kind, p.axis, p.targets) for level, p in partitions]
                values = {k: p.size for k, (_, p) in zip(knobs, partitions, strict=False)}
                candidates.append(Configuration({k.axis: v for k, v in values.items()}, report.time.get("overlapped_s"),
                                                report, knobs, values, origin="as written, unsplit"))
            except RelabelError:
                pass  # the search sizes groups and streams; splits are tried after it
        ranked = search.ranked(diagram, unsplit) if unsplit.levels else None
        if ranked is not None:
            spaces.append(search.space(diagram, ranked, "resized"))
    choices = [written]
    if fusion:
        # an array read through a window stays in device memory: the window gathers from there
        windowed = {view.window.source for view in diagram.views}
        points = [p for p in split_points(diagram, profile) if p not in windowed]
        fixed = written - set(points)
        if len(points) <= MAX_SPLIT_POINTS:
            subsets = itertools.chain.from_iterable(itertools.combinations(points, n) for n in range(len(points) + 1))
        else:  # too many to enumerate: as written, fully fused, fully split, and each single split
            subsets = [(), tuple(points)] + [(p,) for p in points]
        choices += [frozenset(subset) | fixed for subset in subsets if not keep_written or written <= frozenset(subset) | fixed]
    choices = list(dict.fromkeys(choices))
    # Score every fusion choice's launches (memoised: choices share launches).
    for done, chosen in enumerate(choices, 1):
        variant = materialise(diagram, profile, chosen & set(split_points(diagram, profile)))
        ranked = search.ranked(variant, None)
        if ranked is not None:
            spaces.append(search.space(variant, ranked, "tuned" if chosen == written else "fusion",
                                       None if chosen == written else chosen))
        if progress is not None:
            progress(done, len(choices))
    # The estimates leave out what only numeric tiles decide (instruction selection's tile rules,
    # L2 grouping, waves of unequal masked blocks and fixed costs), so the ranking by estimate is
    # not the exact one: the candidates of every choice are costed exactly in order of their lower
    # bound until none left can beat the best (branch and bound), or MAX_COSTED were costed.
    written_time = min((c.time_s for c in candidates if c.time_s is not None), default=math.inf)
    found, optimality = search.branch_and_bound(spaces, written_time, MAX_COSTED)
    candidates += found
    # Code generation tunes with keep_written and is offered no split: the printers print one,
    # but a split adds launches and part arrays that a compile without a relabel block did not
    # ask for. `napkin tune` offers splits, and its relabel block writes the one it picks.
    if not keep_written:
        candidates += split_candidates(diagram, profile, sizes, candidates)
    candidates += schedule_candidates(diagram, profile, sizes, candidates)
    compute_level = profile.compute_level.name
    # Ties in predicted time go to the configuration that moves fewer bytes into the compute level.
    candidates.sort(key=lambda c: (c.time_s if c.time_s is not None else math.inf,
                                   as_number(c.report.levels[compute_level].H_bytes) or 0))
    configurations = []
    for c in candidates:  # the same relabelling found twice (as written and by the search) is listed once
        if all((c.materialised, c.relabel_line()) != (d.materialised, d.relabel_line()) for d in configurations):
            configurations.append(c)
    if not configurations:
        searched = ("with its launches as written" if not fusion else
                    "with the @gmem it writes or more" if keep_written else "fused or split into launches")
        raise RelabelError(f"no configuration of {diagram.name} fits {profile.name} {searched} ({len(choices)} fusion "
                           f"choice{'s' if len(choices) != 1 else ''} searched)", hint="check the sizes")
    best = configurations[0]
    searched = next((c.searched for c in configurations if c.searched is not None), None)
    return TuneResult(diagram.name, profile.name, best.knobs, configurations[:max(top, 1)], search.evaluated,
                      _time.perf_counter() - started, {a: tuple(sorted(ms)) for a, ms in search.required.items() if ms != {1}},
                      units=frozenset(search.units), fusion_choices=len(choices),
                      written=written, curves=_curves(searched or []), optimality=optimality)


# The best configurations (by their time under the default schedule) that the tuner costs under
# each other warpgroup schedule napkin builds: the schedule is a knob of the tiles chosen.
SCHEDULED = 16


def schedule_candidates(diagram: Diagram, profile: Hardware, sizes: dict, candidates: list) -> list[Configuration]:
    """The :data:`SCHEDULED` best configurations costed under each warpgroup schedule napkin builds
    besides the default (``hardware.BUILT_OVERLAPS``: FlashAttention-3's pipelined order and
    pingpong), where one of their launches has consumer warpgroups; a schedule a launch declines
    is not listed (its notes would price the default again)."""
    if profile.symbolic or profile.arch is None:
        return []
    ranked = sorted((c for c in candidates if c.time_s is not None and c.overlap is None), key=lambda c: c.time_s)[:SCHEDULED]
    out = []
    for c in ranked:
        variant = c.diagram or diagram
        try:
            program = plan(variant, profile, _block(variant, profile, c.knobs, c.values or c.sizes), sizes)
        except RelabelError:
            continue
        if not any(getattr(chosen.plan, "roles", None) is not None for chosen in select_program(program).launches.values()):
            continue
        for schedule in BUILT_OVERLAPS[1:]:
            try:
                report = cost_of(program, overlap=schedule)
            except (RelabelError, NapkinError):
                continue
            if report.time.get("overlap") == schedule:
                out.append(dataclasses.replace(c, time_s=report.time.get("overlapped_s"), report=report, overlap=schedule))
    return out


def _without_splits(block: syn.RelabelBlock) -> syn.RelabelBlock:
    """``block`` without its split partitions (a level left with none is dropped)."""
    levels = []
    for clause in block.levels:
        kept = tuple(p for p in clause.partitions if p.kind != "split")
        if kept:
            levels.append(dataclasses.replace(clause, partitions=kept))
    return dataclasses.replace(block, levels=tuple(levels))


# How many of the best configurations the tuner tries splits on, and the most parts a split may
# have: beyond a few thousand parts the combine launch's loads outweigh what the split gains.
SPLIT_BASES = 3
MAX_PARTS = 4096


def split_candidates(diagram: Diagram, profile: Hardware, sizes: dict, candidates: list) -> list:
    """Configurations that split the streamed axis of one of the best few candidates: each part
    size a power of two times the stream's chunk, from two chunks to half the axis, costed
    exactly (the model counts the parts' launch and the combine launch). The candidates
    themselves are the unsplit choice; the caller sorts all of them by predicted time."""
    bases = sorted((c for c in candidates if c.time_s is not None and not any(k.kind == "split" for k in c.knobs)),
                   key=lambda c: c.time_s)[:SPLIT_BASES]
    # Splitting restores the parallelism that larger tiles give up: on the best base, also try its
    # groups two and four times larger (capped at the axis).
    if bases:
        best = bases[0]
        groups = [k for k in best.knobs if k.kind == "group" and isinstance(best.size_of(k), int) and k.axis in sizes]
        for factors in itertools.product((1, 2, 4), repeat=len(groups)) if len(groups) <= 3 else ():
            if all(f == 1 for f in factors):
                continue
            values = dict(best.values or {k: best.size_of(k) for k in best.knobs})
            values |= {k: min(best.size_of(k) * f, sizes[k.axis]) for k, f in zip(groups, factors, strict=True)}
            bases.append(dataclasses.replace(best, values=values, sizes={k.axis: v for k, v in values.items()}))
    out = []
    for base in bases:
        variant = base.diagram if base.diagram is not None else diagram
        for stream in [k for k in base.knobs if k.kind == "stream"]:
            chunk, length = base.size_of(stream), sizes.get(stream.axis)
            if not isinstance(chunk, int) or not isinstance(length, int):
                continue
            part = 2 * chunk
            while part <= length // 2:
                if -(-length // part) <= MAX_PARTS:
                    knob = Knob(stream.level, "split", stream.axis, stream.targets)
                    knobs = [k for k in base.knobs if k != stream] + [knob, stream]
                    values = dict(base.values or {k: base.size_of(k) for k in base.knobs}) | {knob: part}
                    try:
                        report = cost_of(plan(variant, profile, _block(variant, profile, knobs, values), sizes))
                    except RelabelError:
                        part *= 2
                        continue
                    by_axis = {k.axis: v for k, v in values.items() if k.kind != "split"}  # an axis's size: its stream's
                    out.append(Configuration(by_axis, report.time.get("overlapped_s"), report,
                                             knobs, values, origin="split", materialised=base.materialised, diagram=base.diagram))
                part *= 2
    return out


def knob_label(knob: Knob) -> str:
    return f"{knob.level}: {knob.kind} {knob.axis}" + (f" for {', '.join(knob.targets)}" if knob.targets else "")


def _curves(ranked: list) -> dict:
    """The best estimate at each size of each knob searched: the lower envelope of predicted
    time against one tile size, the others free."""
    curves: dict[str, dict] = {}
    for scored in ranked:
        for estimate, _, knobs, combo in scored:
            for knob, size in zip(knobs, combo, strict=False):
                curve = curves.setdefault(knob_label(knob), {})
                if estimate < curve.get(size, math.inf):
                    curve[size] = estimate
    return {label: dict(sorted(curve.items())) for label, curve in curves.items()}


MAX_SPLIT_POINTS = 6  # 2^6 fusion choices at most are enumerated
VERIFIED = 4  # candidates per launch checked with numeric tiles (path, memory) ...
MAX_VERIFIED = 32  # ... checking at most this many
MAX_COSTED = 32  # combinations costed exactly per search: the cap of branch and bound (and twice as many
# masked ones planned to refine their bound)
MAX_EXPANDED = 20000  # heap entries of several launches expanded per search: bounds are cheap, but the
# launches' product is not (one launch's entries, at most its candidates, are always expanded)


class _Search:
    """Scores of every launch the fusion choices produce, memoised: choices share launches
    (SwiGLU's last matmul is the same launch whether G, U or H is materialised)."""

    def __init__(self, profile: Hardware, sizes: dict, max_candidates: int):
        self.profile, self.sizes, self.max_candidates = profile, sizes, max_candidates
        self.memo: dict = {}
        self.scorers: dict = {}  # id(knobs) -> its _Estimate (the knob lists live in the memo)
        self.on_fma: dict = {}  # (id(knobs), combo) -> launches re-priced on the FMA path by _verified
        self.tails: dict = {}  # (id(ranked list), one scope) -> suffix minima (_Search.space)
        self.evaluated = 0
        self.required: dict = {}
        self.units: set = set()  # axes some knob set lets be 1 (unit_axes)

    @staticmethod
    def _key(diagram: Diagram, statements, block) -> tuple:
        """What a launch's scores depend on: its statements, the dtypes and levels of the arrays
        it touches, which of them are kernel outputs (and the relabel block, when one is searched)."""
        names = sorted({n for s in statements for n in (s.target,) + s.inputs})
        arrays = tuple((n, diagram.arrays[n].dtype, diagram.arrays[n].level) for n in names)
        return (id(block) if block is not None else None, tuple((s.index, s.target, s.level) for s in statements),
                arrays, tuple(n for n in diagram.outputs if n in names))

    def ranked(self, diagram: Diagram, block) -> list | None:
        """Per launch scope, its candidates ranked by estimate; None when a launch has none that fits."""
        launches = split_launches(diagram, self.profile)
        if block is None and len(launches) > 1:
            # Launches share nothing but device memory: size each one's partitions on its own.
            scopes = [(index, statements) for index, (statements, _, _) in enumerate(launches)]
        else:
            scopes = [(None, None)]
        ranked = []
        for index, statements in scopes:
            key = self._key(diagram, statements if statements is not None else diagram.statements, block) + (index is None,)
            if key not in self.memo:
                scored, rescore = [], {}
                for knobs in knob_sets(diagram, self.profile, block, self.sizes, statements):
                    found, count, multiples, rescore[id(knobs)] = _score(diagram, self.profile, knobs, self.sizes,
                                                                         self.max_candidates, index)
                    self.scorers[id(knobs)] = rescore[id(knobs)]
                    scored += [(estimate, rank, knobs, combo) for rank, (estimate, combo) in enumerate(found)]
                    self.evaluated += count
                    # Launches and fusion choices require different multiples of one axis (x of 16 as
                    # a fragment, of 64 where a materialised P is loaded along it): keep each (1 where
                    # a knob set leaves the axis free), not the last one scored.
                    for axis in dict.fromkeys(k.axis for k in knobs):
                        self.required.setdefault(axis, set()).add(multiples.get(axis, 1))
                    self.units |= unit_axes(diagram, knobs, statements)
                scored.sort(key=lambda item: item[:2])
                self.memo[key] = self._verified(diagram, index, scored, rescore)
            if not self.memo[key]:
                return None
            ranked.append(self.memo[key])
        return ranked

    def _verified(self, diagram: Diagram, index: int | None, scored: list, rescore: dict) -> list:
        """``scored`` (by the lower-bound estimate) re-ranked at its head with the candidate's
        numeric tiles: the path instruction selection takes (a refused tensor-core plan is
        re-priced on the FMA path) and the memory of the buffers it lays out (pipeline stages
        included; a candidate over a level's capacity is dropped). Candidates are checked best
        first until VERIFIED of them stand and the worst of those is no slower than the next
        unchecked lower bound (branch and bound), or MAX_VERIFIED were checked."""
        checked: list = []
        position = 0
        while position < len(scored) and position < MAX_VERIFIED:
            if len(checked) >= VERIFIED and sorted(item[0] for item in checked)[VERIFIED - 1] <= scored[position][0]:
                break
            estimate, rank, knobs, combo = scored[position]
            position += 1
            on_fma = self._laid_out(diagram, index, knobs, combo)
            if on_fma is None:
                continue
            if on_fma:
                estimate = rescore[id(knobs)](combo, on_fma)
                self.on_fma[id(knobs), combo] = on_fma
            if estimate is not None:
                checked.append((estimate, rank, knobs, combo))
        checked.sort(key=lambda item: item[:2])
        return checked + scored[position:]

    def _laid_out(self, diagram: Diagram, index: int | None, knobs: list, combo: tuple) -> frozenset | None:
        """With these tiles, the launches (of scope ``index``, or all) whose contractions
        instruction selection keeps on the FMA path; None when a level overflows."""
        schedule = make_schedule(diagram, self.profile, _block(diagram, self.profile, knobs, dict(zip(knobs, combo, strict=False))), self.sizes)
        program = elaborate(schedule)
        if index is not None:
            program = Program(schedule, (program.launches[index],))
        shared = shared_cache_level(schedule)  # grouped after the fact (plan.py), as in _score
        selected = select_program(program)  # the columns and the paths below read one selection
        rows = columns(program, selected)
        # M per level, as cost.level_costs reads it off the columns (no H or N needed here).
        for name in {level for row in rows for level in row["M_bytes"]} - {shared}:
            capacity = self.profile.level(name).capacity
            capacity = as_number(bind(capacity, schedule.sizes)) if capacity is not None else None
            used = [as_number(row["M_bytes"].get(name, 0)) for row in rows]
            if capacity is not None and None not in used and max(used) > capacity:
                return None
        return frozenset(launch.index for launch in program.launches
                         if any(isinstance(s.box, Contract) for s in launch.launch.statements)
                         and instruction_path(program, launch, selected) == "fma")

    def parts(self, item) -> tuple:
        """_Estimate.parts of a ranked candidate (lower bound, compute at full occupancy, transfers
        into the compute level, most blocks, compulsory transfers under device memory), on the
        path _verified found for it."""
        _, _, knobs, combo = item
        scorer = self.scorers[id(knobs)]
        on_fma = self.on_fma.get((id(knobs), combo))
        return scorer.parts(combo, on_fma) if on_fma else scorer.details[combo]

    def space(self, diagram: Diagram, ranked: list, origin: str, materialised=None) -> _Space:
        """A search space for branch and bound: the combinations of ``ranked``'s candidates, one
        per launch scope, with the suffix minima that bound every combination at or after given
        ranks (_Search.floor)."""
        tails = []
        for scored in ranked:
            key = (id(scored), len(ranked) == 1)  # the lists live in the memo: choices share launches
            if key not in self.tails:
                if len(ranked) == 1:
                    # One scope prices all its launches together: its estimate and their starts.
                    columns_ = [[item[0] + self.profile.launch_s * self.scorers[id(item[2])].launches for item in scored]]
                else:
                    # Launches run one after another, each on its own roofline (cost.predict_time):
                    # the scopes' bounds, each with its fixed costs, add up.
                    columns_ = [[self.parts(item)[0] + self.scorers[id(item[2])].fixed(item[3]) for item in scored]]
                # Per rank, the suffix minimum of every column: a floor adds rows elementwise.
                self.tails[key] = list(zip(*(_suffix_minima(column) for column in columns_), strict=True))
            tails.append(self.tails[key])
        return _Space(diagram, ranked, origin, materialised, tails)

    def bound(self, space: _Space, ranks: tuple) -> float:
        """A lower bound of the exact time (``cost_of(plan(...))``) of the combination at ``ranks``.

        One launch scope: its estimate (compute over the busy fraction, or its transfers) plus
        the fixed costs' lower bound. Several (one launch each): the exact model runs launches
        one after another, each on its own roofline (cost.predict_time: max(C_l / e_l, T_l)) and
        adds every launch's fixed costs, so the launches' bounds add up: the sum of their
        estimates (each max(C / e, T, X), X what it must move under device memory) and their
        fixed costs' lower bounds; a masked launch's C counts its unmasked elements (_at_least)."""
        picks = [scored[rank] for scored, rank in zip(space.ranked, ranks, strict=True)]
        fixed = sum(self.scorers[id(knobs)].fixed(combo) for _, _, knobs, combo in picks)
        if len(picks) == 1:
            return picks[0][0] + fixed
        return sum(self.parts(item)[0] for item in picks) + fixed

    def floor(self, space: _Space, ranks: tuple) -> float:
        """A lower bound of every combination whose rank in each scope is at least ``ranks``'s
        (the busy fraction at most 1; one scope's fixed costs at least its launches' starts; with
        several, the sum of each scope's least bound from its rank on, _Search.space)."""
        if len(space.ranked) == 1:
            return space.tails[0][ranks[0]][0]
        rows = [tail[rank] for tail, rank in zip(space.tails, ranks, strict=True)]
        return max(map(sum, zip(*rows, strict=True)))

    def refined(self, space: _Space, ranks: tuple, bound: float):
        """A masked candidate (one launch) planned: the busy fraction its blocks' unequal work
        allows (cost.masked_wave_efficiency on the plan the exact model costs), in place of the
        estimate's blocks / SMs. Returns (bound, plan); the plan is kept for the exact cost."""
        picks = [scored[rank] for scored, rank in zip(space.ranked, ranks, strict=True)]
        program = self.plan(space, picks)
        if program is None or len(space.ranked) != 1 or len(program.launches) != 1:
            return bound, program
        efficiency = masked_wave_efficiency(program, self.profile.compute_level.units)
        if efficiency is None:
            return bound, program
        _, compute, traffic, _, compulsory = self.parts(picks[0])
        fixed = self.scorers[id(picks[0][2])].fixed(picks[0][3])
        return max(bound, max(compute / efficiency, traffic, compulsory) + fixed), program

    def plan(self, space: _Space, picks: list):
        """The Program the exact model costs for one combination; None when it does not fit."""
        knobs = [k for _, _, pick_knobs, _ in picks for k in pick_knobs]
        values = {k: v for _, _, pick_knobs, combo in picks for k, v in zip(pick_knobs, combo, strict=False)}
        try:
            return plan(space.diagram, self.profile, _block(space.diagram, self.profile, knobs, values), self.sizes)
        except RelabelError:
            return None

    def configuration(self, space: _Space, ranks: tuple, program) -> Configuration | None:
        """A combination costed exactly; None when a level overflows once its buffers are laid out."""
        picks = [scored[rank] for scored, rank in zip(space.ranked, ranks, strict=True)]
        if program is None:
            return None
        try:
            report = cost_of(program)
        except RelabelError:
            return None
        knobs = [k for _, _, pick_knobs, _ in picks for k in pick_knobs]
        values = {k: v for _, _, pick_knobs, combo in picks for k, v in zip(pick_knobs, combo, strict=False)}
        return Configuration({k.axis: v for k, v in values.items()}, report.time.get("overlapped_s"), report, knobs,
                             values, origin=space.origin, materialised=space.materialised, diagram=space.diagram,
                             searched=space.ranked)

    def branch_and_bound(self, spaces: list, best: float, limit: int) -> tuple[list, Optimality]:
        """Cost combinations exactly in order of their lower bound (self.bound), across every
        space, until the best exact time (``best``: the written relabelling's, or inf) is no
        greater than the next lower bound (the best is then optimal under the model) or
        ``limit`` were costed. The first ranks of every scope form a heap entry whose
        key (self.floor) bounds all combinations at or after them; popping one yields its own
        combination, and one entry per scope it may advance (a scope at or after the last one
        advanced: each combination is reached once). A masked combination is planned, its
        bound refined (self.refined) and pushed back before it is costed."""
        heap: list = []
        counter = itertools.count()

        def push(key, stage, index, ranks, pivot=0, program=None):
            heapq.heappush(heap, (key, next(counter), stage, index, ranks, pivot, program))

        for index, space in enumerate(spaces):
            ranks = (0,) * len(space.ranked)
            push(self.floor(space, ranks), "floor", index, ranks)
        found, refined_count, costed, expanded, parked = [], 0, 0, 0, math.inf
        while heap and heap[0][0] < best:
            key, _, stage, index, ranks, pivot, program = heap[0]
            space = spaces[index]
            if stage == "floor":
                if len(ranks) > 1 and expanded >= MAX_EXPANDED:
                    # Set the unexpanded aside (their least key still bounds every combination
                    # in them) and cost the combinations already bounded, best first. One scope's
                    # entries are at most its candidates: they are always expanded.
                    parked = min(parked, key)
                    heapq.heappop(heap)
                    continue
                expanded += len(ranks) > 1
                heapq.heappop(heap)
                push(max(key, self.bound(space, ranks)), "bound", index, ranks)
                for scope in range(pivot, len(ranks)):
                    if ranks[scope] + 1 < len(space.ranked[scope]):
                        after = ranks[:scope] + (ranks[scope] + 1,) + ranks[scope + 1:]
                        push(self.floor(space, after), "floor", index, after, scope)
                continue
            masked = len(space.ranked) == 1 and self.scorers[id(space.ranked[0][ranks[0]][2])].masked
            if stage == "bound" and masked and refined_count < 2 * limit:
                heapq.heappop(heap)
                refined_count += 1
                refined, program = self.refined(space, ranks, key)
                push(refined, "planned", index, ranks, program=program)
                continue
            if costed >= limit:
                break  # the cap: the heap's least key bounds what was not costed
            heapq.heappop(heap)
            if stage == "bound":
                program = self.plan(space, [scored[rank] for scored, rank in zip(space.ranked, ranks, strict=True)])
            configuration = self.configuration(space, ranks, program)
            costed += 1
            if configuration is not None:
                found.append(configuration)
                if configuration.time_s is not None:
                    best = min(best, configuration.time_s)
        lower = min(heap[0][0] if heap else math.inf, parked)
        size = sum(math.prod(len(scored) for scored in space.ranked) for space in spaces)
        return found, Optimality(best, lower, costed, size)


def _suffix_minima(values: list) -> list:
    out, least = [0.0] * len(values), math.inf
    for i in range(len(values) - 1, -1, -1):
        least = min(least, values[i])
        out[i] = least
    return out


@dataclass
class _Space:
    """One search space: a fusion choice (or the written block resized), its launch scopes'
    candidates ranked by estimate, and their suffix minima (_Search.space)."""

    diagram: Diagram
    ranked: list
    origin: str
    materialised: frozenset | None
    tails: list


@dataclass(frozen=True)
class Optimality:
    """How far the best exact time can be from the model's optimum over the candidates searched:
    ``lower`` is the least lower bound of a candidate not costed exactly (inf when none is left)."""

    best: float
    lower: float
    costed: int  # combinations costed exactly (a plan that overflows a level included)
    candidates: int  # combinations in the search spaces

    @property
    def gap(self) -> float:
        """best / lower - 1, at least 0: 0 exactly when the bound closed (no candidate left
        could be faster than the best)."""
        if not math.isfinite(self.best) or self.best <= self.lower:
            return 0.0 if math.isfinite(self.best) or not math.isfinite(self.lower) else math.inf
        return self.best / self.lower - 1 if self.lower > 0 else math.inf

    @property
    def closed(self) -> bool:
        return self.gap == 0

    def text(self) -> str:
        of = f"{self.costed:,} of {self.candidates:,} candidates costed exactly"
        if self.closed:
            return f"optimal under the model ({of})"
        return f"within {_percent(self.gap)} of the model's optimum: {of}"

    def to_dict(self) -> dict:
        return {"gap": self.gap if math.isfinite(self.gap) else None, "closed": self.closed,
                "lower_bound_s": self.lower if math.isfinite(self.lower) else None,
                "costed": self.costed, "candidates": self.candidates, "text": self.text()}


def _percent(fraction: float) -> str:
    if not math.isfinite(fraction):
        return "an unknown factor"
    # Rounded up: the gap printed is never smaller than the gap.
    for digits in range(0, 4):
        shown = math.ceil(fraction * 100 * 10**digits) / 10**digits
        if shown >= 1 or digits == 3:
            return f"{shown:g}%"
    return f"{fraction:.2%}"


def _score(diagram: Diagram, profile: Hardware, knobs: list[Knob], sizes: dict, max_candidates: int,
           launch_index: int | None = None):
    """Predicted time of every candidate of one knob set, fast: the Program is elaborated once
    with symbolic partition sizes and its costs become Python functions of them. With
    ``launch_index``, only that launch is priced.

    The steps: the symbolic Program (:func:`_symbolic_program`); what each candidate must not
    exceed, memory per level (:func:`_memory_exprs`); the transfers into the compute level
    (:func:`_traffic_expr`); compute per launch and path (:func:`_fma_only_reason`,
    :func:`_compute_terms`); blocks and first tiles per launch (:func:`_block_and_tile_exprs`);
    the compulsory transfers under device memory (:func:`_compulsory_seconds`); these compiled
    into one :class:`_Estimate`, which scores every candidate (:func:`_scored_candidates`).
    Returns (the fitting candidates as (estimate, combo), best first; how many were evaluated;
    the multiple each axis must be; the estimate)."""
    schedule, program = _symbolic_program(diagram, profile, knobs, sizes, launch_index)
    required = divisibility(diagram, knobs, program.launches[0].launch.statements if launch_index is not None else None)
    # With symbolic tiles the visited chunks of a masked stream have no closed form, and the
    # Program counts every chunk (cost.step_total): more than the exact model, which skips the
    # chunks the mask hides. Its steps are counted at a lower bound instead (_at_least).
    unmasked = _unmasked_elements(program)
    priced = _masked_priced(program, unmasked) if unmasked else flops_by_unit(program)[1]
    symbols = [k.symbol for k in knobs]
    compute_level = schedule.compute_level
    n_levels, memory_exprs, capacity = _memory_exprs(profile, schedule, columns(program))
    traffic_expr = _traffic_expr(profile, program, compute_level, unmasked)
    fma_launches = {launch.index for launch in program.launches
                    if _fma_only_reason(diagram, launch, compute_level, profile) is not None}
    terms = _compute_terms(profile, priced, fma_launches)
    launch_indices = sorted({launch for launch, _ in terms})
    compute_keys = [(index, on_fma) for index in launch_indices for on_fma in (False, True)]
    blocks_exprs, tile_exprs = _block_and_tile_exprs(program, compute_level)
    compulsory = _compulsory_seconds(diagram, profile, program, compute_level, sizes)
    # One compiled function per knob set: memory per level, compute per launch and path, traffic,
    # blocks per launch.
    evaluate = algebra.lambdify(symbols, memory_exprs + [algebra.Add(*terms[key]) for key in compute_keys] + [traffic_expr]
                                + blocks_exprs)
    estimate = _Estimate(profile, evaluate, capacity, n_levels, launch_indices, [launch.index for launch in program.launches],
                         bool(unmasked), algebra.lambdify(symbols, blocks_exprs + tile_exprs), compulsory)
    units = unit_axes(diagram, knobs, program.launches[0].launch.statements if launch_index is not None else None)
    options = [_candidates(int(sizes[k.axis]), required.get(k.axis, 1), k.axis in units) for k in knobs]
    scored, evaluated = _scored_candidates(estimate, options, max_candidates)
    return scored, evaluated, required, estimate


def _symbolic_program(diagram: Diagram, profile: Hardware, knobs: list[Knob], sizes: dict,
                      launch_index: int | None) -> tuple:
    """(schedule, Program) with every knob a symbol: elaborated once, so that a candidate is
    priced by evaluating expressions, not by elaborating again. With ``launch_index``, the
    Program holds that launch alone."""
    schedule = make_schedule(diagram, profile, _block(diagram, profile, knobs, {}), sizes)
    program = elaborate(schedule)
    if launch_index is not None:
        program = Program(schedule, (program.launches[launch_index],))
    return schedule, program


def _memory_exprs(profile: Hardware, schedule, rows: list) -> tuple[int, list, list]:
    """(how many levels are constrained, each one's memory expression, each one's capacity):
    what a candidate must not exceed.

    M is read off the same columns as cost.level_costs, but stays the columns' expressions
    whose largest is taken per candidate in Python: a symbolic Max of them is most of the cost
    of a search. The shared L2 is grouped after the fact (plan.py), so its capacity is not a
    constraint here; nor is a level of unbounded capacity."""
    shared = shared_cache_level(schedule)
    memory_exprs, capacity = [], []
    for level in profile.levels[1:]:
        if level.capacity is None or level.name == shared:
            continue
        exprs = list(dict.fromkeys(algebra.as_expr(r["M_bytes"].get(level.name, 0)) for r in rows))
        memory_exprs.append(algebra.Max(tuple(exprs)) if len(exprs) > 1 else exprs[0])  # unsimplified: max() per candidate
        capacity.append(as_number(bind(level.capacity, schedule.sizes)))
    return len(memory_exprs), memory_exprs, capacity


def _traffic_expr(profile: Hardware, program: Program, compute_level: str, unmasked: dict) -> algebra.Expr:
    """Seconds of the loads and saves into the compute level (a masked stream's at their lower
    bound, _at_least), at that level's bandwidth; 0 for a level the profile gives none."""
    moved = algebra.Add(*[_at_least(program, step, loops, step.axes, unmasked) * DTYPE_BYTES[step.dtype]
                        for launch in program.launches for step, loops in walk(launch.body)
                        if step.op in ("load", "save") and step.level == compute_level])
    bandwidth = profile.level(compute_level).bandwidth
    return moved / bandwidth if bandwidth else algebra.Integer(0)


def _fma_only_reason(diagram: Diagram, launch, compute_level: str, profile: Hardware) -> str | None:
    """Why ``launch`` stays on the FMA path whatever its tiles, or None when tensor cores may
    take it.

    While tiles are symbolic the contractions are priced at the tensor-core path napkin builds
    (mma.sync): a lower bound of the time, as the FMA path is slower. A contraction operand the
    launch loads into the compute level of a dtype no tensor-core path of the profile's arch takes
    keeps it on the FMA path (16-bit everywhere, paths.plan.TENSOR_DTYPES; fp8 where the profile
    lists an 8-bit path: instruction selection refuses anything else, as A or B). An operand the
    launch computes (attention's P, f32) is a register fragment that tensor cores take
    converted, as the exact model prices it (cost.flops_by_unit): it does not decide the path.
    The tile-dependent rules of instruction selection are checked lazily (_Search.ranked), and
    a candidate they refuse is re-priced on the FMA path (``rescore``)."""
    loaded = {step.array for step, _ in walk(launch.body) if step.op == "load" and step.level == compute_level}
    taken = set(TENSOR_DTYPES) | {dtype for path in profile.paths.values()
                                  if profile.arch is not None and path.runs_on(profile.arch) for dtype in path.dtypes}
    for s in launch.launch.statements:
        if not (isinstance(s.box, Contract) and len(s.box.operands) >= 2):
            continue
        for r in s.box.operands[:2]:
            if r.array in loaded and (dtype := diagram.arrays[r.array].dtype) not in taken:
                return (f"{s.target}'s operand {r.array} is {dtype}, loaded into {compute_level}; tensor cores take "
                        f"{', '.join(sorted(taken))}")
    return None


def _compute_terms(profile: Hardware, priced: list, fma_launches: set) -> dict[tuple, list]:
    """(launch, on the FMA path) -> the launch's compute time terms, each amount over its rate.

    Every launch is priced both ways, so that a candidate instruction selection refuses can be
    re-priced on the FMA path without compiling again; a launch in ``fma_launches`` is on the
    FMA path either way. A rate the profile lacks is the user's profile's gap: a NapkinError.
    A tensor launch is priced at the fastest instruction napkin builds on the profile's arch
    (mma.sync; wgmma too where the arch itself lists it, sm_90a on H100 and H200, as isel.select
    builds it), so that the score stays a lower bound whichever of them selection takes."""
    built = "mma.sync" if "mma.sync" in profile.tensor_paths() else "tensor"
    faster = [p.instruction for p in profile.paths.values()
              if p.instruction == "wgmma" and profile.arch is not None and profile.arch in p.archs]
    terms: dict[tuple, list] = {}
    for launch_of, unit, dtype, amount in priced:
        for on_fma in (False, True):
            path, path_dtype = unit, dtype
            if unit == "tensor":
                path, path_dtype = ("fma", "f32") if on_fma or launch_of in fma_launches else (built, dtype)
            rate = profile.peak(path, path_dtype)
            if path == built and rate is not None:
                rate = max([rate] + [r for i in faster if (r := profile.peak(i, path_dtype)) is not None])
            if rate is None:
                raise NapkinError(f"{profile.name} has no {path} rate for {path_dtype}")
            terms.setdefault((launch_of, on_fma), []).append(algebra.as_expr(amount) / rate)
    return terms


def _block_and_tile_exprs(program: Program, compute_level: str) -> tuple[list, list]:
    """Per launch, its blocks as the exact model counts them (cost.launch_blocks) and the bytes
    of the first and last tiles a block moves (cost.block_tiles): the fixed costs' lower bound
    and the launches' occupancy read them."""
    blocks_exprs, tile_exprs = [], []
    for launch in program.launches:
        blocks_exprs.append(_blocks(program, launch))
        seen, moved_tiles = set(), algebra.Integer(0)
        for step, _ in walk(launch.body):
            if step.op in ("load", "save") and step.level == compute_level and (step.op, step.array) not in seen:
                seen.add((step.op, step.array))
                moved_tiles += tile_values(launch.schedule, compute_level, step.axes) * DTYPE_BYTES[step.dtype]
        tile_exprs.append(moved_tiles)
    return blocks_exprs, tile_exprs


def _compulsory_skip_reason(launch) -> str | None:
    """Why a launch's elements are not counted as crossing the link under device memory, or None.

    A masked launch may never load some elements (a band of keys no query sees), so counting
    every element would not be a lower bound."""
    if any(loop.mask is not None for _, loops in walk(launch.body) for loop in loops):
        return "a masked loop may skip elements"
    return None


def _compulsory_seconds(diagram: Diagram, profile: Hardware, program: Program, compute_level: str, sizes: dict) -> float:
    """Seconds on the link under device memory that no tiling avoids.

    Every element a launch loads from device memory, or saves there, crosses that link at least
    once (the exact model's first level under device memory counts at least that, whatever its
    L2 grouping): a bound that splitting a kernel into launches pays, and that the transfers
    into the compute level miss. 0 when the compute level is that link's level or its
    bandwidth is symbolic."""
    top_link = profile.levels[1]
    compulsory = 0.0
    if top_link.name == compute_level or not isinstance(top_link.bandwidth, (int, float)):
        return compulsory
    for launch in program.launches:
        if _compulsory_skip_reason(launch) is not None:
            continue
        computed = {s.target for s in launch.launch.statements}
        moved = {(step.op, step.array): step.dtype for step, _ in walk(launch.body)
                 if step.op in ("load", "save") and step.level == compute_level
                 and (step.op == "save" or step.array not in computed)}
        for (_, name), dtype in moved.items():
            array = diagram.arrays[name]
            width = min(DTYPE_BYTES[dtype], DTYPE_BYTES.get(array.dtype, DTYPE_BYTES[dtype]))
            compulsory += math.prod(int(sizes[a]) for a in array.axes) * width / top_link.bandwidth
    return compulsory


def _scored_candidates(estimate: _Estimate, options: list, max_candidates: int) -> tuple[list, int]:
    """(every candidate that fits as (estimate, combo), best first; how many were evaluated):
    the product of the options in order, stopping after ``max_candidates``. Each one's parts
    are kept in ``estimate.details`` for the branch and bound."""
    scored = []
    evaluated = 0
    for combo in itertools.product(*options):
        evaluated += 1
        if evaluated > max_candidates:
            break
        parts = estimate.parts(combo)
        if parts is not None:
            scored.append((parts[0], combo))
            estimate.details[combo] = parts
    scored.sort(key=lambda item: item[0])
    return scored, evaluated


def _blocks(program: Program, launch) -> algebra.Expr:
    """cost.launch_blocks with symbolic tiles: its group loops' trips, each rounded up as the
    numeric tiles round it (a symbolic loop's trips are size / tile)."""
    depth = program.schedule.levels.index(program.schedule.compute_level)
    groups = {id(loop): loop.trips for _, loops in walk(launch.body) for loop in loops
              if loop.kind == "group" and program.schedule.levels.index(loop.level) <= depth}
    return algebra.Mul(*(algebra.ceiling(trips) for trips in groups.values()))


class _Estimate:
    """One knob set's lower bound of a candidate's time (called as ``estimate(combo, on_fma)``:
    None when it does not fit), and the parts the branch and bound combines across launches."""

    def __init__(self, profile: Hardware, evaluate, capacity: list, n_levels: int, launch_indices: list, launch_order: list,
                 masked: bool, tiles, compulsory: float = 0.0):
        self.evaluate, self.capacity, self.n_levels = evaluate, capacity, n_levels
        self.compulsory = compulsory  # seconds on the link under device memory, whatever the tiles
        self.launch_indices, self.masked, self.tiles = launch_indices, masked, tiles
        self.launch_order = launch_order  # the launches' indices in program order (the blocks' order)
        self.launches = len(launch_order)
        self.units = profile.compute_level.units
        self.launch_s = profile.launch_s
        # Fixed costs (cost.fixed_costs) at least: each launch's start, and its first wave's first
        # and last tiles from and to device memory at the slowest link down to the compute level,
        # a wave being at least min(blocks, SMs) blocks (one resident per SM at the least). The
        # later waves' prologue can be 0 (two blocks per SM), so it is left out.
        compute = profile.compute_level
        links = [lv.bandwidth for lv in profile.levels[1:profile.index(compute.name) + 1]]
        numeric = links and all(isinstance(b, (int, float)) for b in links) and isinstance(compute.capacity, int)
        self.below_top = min(links) if numeric else None
        self.details: dict = {}  # combo -> parts, for every candidate scored (on the tensor-core path)
        self.fixed_memo: dict = {}

    def parts(self, combo, on_fma=frozenset()):
        """(lower bound, compute seconds at full occupancy, seconds of transfers into the compute
        level, the most blocks of a launch, seconds under device memory), its launches in
        ``on_fma`` priced on the FMA path; None when it does not fit."""
        values = self.evaluate(*combo)
        for used, limit in zip(values, self.capacity, strict=False):
            if used > limit:
                return None
        n = self.n_levels
        keys = 2 * len(self.launch_indices)
        traffic = values[n + keys]
        blocks = dict(zip(self.launch_order, values[n + keys + 1:], strict=True))
        n_blocks = max(blocks.values()) if blocks else 1
        # Each launch's compute over its own busy fraction, as the exact model prices launches
        # (cost.predict_time: one after another, each on its roofline): their sum, against the
        # transfers summed, is at most the sum of the launches' rooflines.
        compute = raw = 0.0
        for j, index in enumerate(self.launch_indices):
            seconds = values[n + 2 * j + (index in on_fma)]
            count = blocks.get(index, 1)
            efficiency = busy_fraction(count, self.units)  # the exact rule (cost.busy_fraction)
            if self.masked:
                # A masked launch's blocks do unequal work, and the exact model charges each round
                # of blocks its longest (cost.masked_wave_efficiency): with the short blocks in the
                # last round the units are busier than equal blocks would keep them. That fraction
                # is at most 1, and at most blocks / SMs (in one round the longest block, of at
                # least the mean work, sets the time), which busy_fraction never exceeds either.
                efficiency = min(1.0, count / self.units)
            compute += seconds / efficiency
            raw += seconds
        return max(compute, traffic, self.compulsory), raw, traffic, n_blocks, self.compulsory

    def __call__(self, combo, on_fma=frozenset()):
        parts = self.parts(combo, on_fma)
        return None if parts is None else parts[0]

    def fixed(self, combo) -> float:
        """A lower bound of cost.fixed_costs for this candidate's launches (memoised: branch and
        bound asks once per combination a candidate is in)."""
        if combo not in self.fixed_memo:
            self.fixed_memo[combo] = self._fixed(combo)
        return self.fixed_memo[combo]

    def _fixed(self, combo) -> float:
        total = self.launch_s * self.launches
        if self.below_top is not None and self.launches:
            values = self.tiles(*combo)
            for blocks, moved in zip(values[:self.launches], values[self.launches:], strict=True):
                total += min(blocks, self.units) * moved / self.below_top
        return total


class AbstractOptimum:
    """H and M of a kernel on an abstract model as functions of its group sizes.

    ``at(capacity)`` searches group sizes (a log-spaced grid, streams at size 1) for the least
    H with M <= capacity; ``beta()`` fits the exponent of H* = alpha M^-beta + H0 from the
    optima at capacities C and 4C.
    """

    def __init__(self, diagram: Diagram, profile: Hardware, block, sizes: dict):
        knobs = knobs_for(diagram, profile, block, sizes)
        self.groups = [k for k in knobs if k.kind == "group"]
        if not self.groups:
            raise NapkinError(f"kernel {diagram.name} has no group partition to tune on {profile.name}")
        self.knobs = knobs
        self.name = diagram.name
        streams = [k for k in knobs if k.kind == "stream"]
        level = profile.compute_level.name
        schedule = make_schedule(diagram, profile, _block(diagram, profile, knobs, {k.axis: 1 for k in streams}), {})
        costs = level_costs(elaborate(schedule))[level]
        H, M = costs.H, costs.M
        symbols = [k.symbol for k in self.groups]
        self.axis_size = 2**20
        axis_values = {a: sizes.get(a, self.axis_size) for a in diagram.axes}
        # Group sizes H does not depend on (axes every array carries) stay 1: larger ones only cost memory.
        self.relevant = [H.has(symbol) for symbol in symbols]
        self.H = algebra.lambdify(symbols, H.subs(axis_values))
        self.M = algebra.lambdify(symbols, M.subs(axis_values))
        self.H0 = algebra.limit_at_infinity(H, symbols)
        self.H0_value = float(self.H0.subs(axis_values)) if isinstance(self.H0, algebra.Expr) else 0.0

    def at(self, capacity: float) -> tuple[float, tuple]:
        points = max(12, int(25000 ** (1 / max(1, sum(self.relevant)))))
        top = math.log2(self.axis_size)
        grid = [2 ** (top * i / (points - 1)) for i in range(points)]
        best = (math.inf, ())
        self.evaluated = getattr(self, "evaluated", 0)
        for combo in itertools.product(*[grid if relevant else [1.0] for relevant in self.relevant]):
            self.evaluated += 1
            if self.M(*combo) > capacity:
                continue
            value = self.H(*combo)
            if value < best[0]:
                best = (value, combo)
        return best

    @property
    def fit_capacity(self) -> float:
        """A capacity whose optimum lies well inside the grid: the memory of groups of 256."""
        return float(self.M(*[256 if relevant else 1 for relevant in self.relevant]))

    @property
    def memory_bound(self) -> bool:
        """Whether more memory lowers H at all: some group size appears in H. Elementwise
        kernels (``Y[i] = X * 2``) move each value once whatever the tiles: H = H0."""
        return any(self.relevant)

    def beta(self) -> algebra.Expr:
        if not self.memory_bound:
            return algebra.Integer(0)
        capacity = self.fit_capacity
        h1, _ = self.at(capacity)
        h2, _ = self.at(4 * capacity)
        above1, above2 = h1 - self.H0_value, h2 - self.H0_value
        if not (math.isfinite(above1) and math.isfinite(above2)) or above1 <= 0:
            # H already sits at its floor H0 at the fit capacity (or the grid found no
            # fitting tile): memory buys nothing more, which is beta = 0.
            return algebra.Integer(0)
        if above2 <= 0:
            # H reaches its floor H0 between C and 4C: the decline is steeper than any power
            # of M the fit could name, and the log of 0 is undefined.
            raise NapkinError(f"cannot fit H* = alpha M^-beta + H0 for {self.name}: H reaches H0 = {self.H0} "
                              f"between M = {capacity:.4g} and {4 * capacity:.4g} values",
                              hint="bind the axis sizes (--set) so that the tiles stay well inside them")
        return algebra.Rational(round(-math.log(above2 / above1) / math.log(4) * 4), 4)


def _tune_abstract(diagram: Diagram, profile: Hardware, block, sizes: dict, started: float) -> TuneResult:
    """The paper's closed form on the abstract models: fit beta of H* = alpha M^-beta + H0."""
    model = AbstractOptimum(diagram, profile, block, sizes)
    beta = model.beta()
    # With beta = 0 no term falls with M: the optimum is the floor H0 itself (alpha M^0 would
    # be a constant the fit never measured).
    optimum = model.H0 if beta == 0 else algebra.Symbol("alpha") * algebra.Symbol("M", positive=True) ** (-beta) + model.H0
    _, best = model.at(model.fit_capacity)
    sizes_at_fit = {k.axis: round(v) for k, v in zip(model.groups, best, strict=False)}
    sizes_at_fit.update({k.axis: 1 for k in model.knobs if k.kind == "stream"})
    # The knobs travel with the configuration: its relabel line and block are written from them.
    configurations = [Configuration(sizes_at_fit, None, knobs=list(model.knobs),
                                    values={k: sizes_at_fit[k.axis] for k in model.knobs})]
    result = TuneResult(diagram.name, profile.name, model.knobs, configurations, model.evaluated,
                        _time.perf_counter() - started, {}, beta, optimum)
    result.fit_note = (f"group sizes at the fit's capacity M = {model.fit_capacity:.4g} values "
                       f"(every axis {model.axis_size} unless bound, streams of 1)")
    return result


# ---- using a result: write it into a source, plot it, compare relabellings ----------------------


def write_tuned(kernel, result: TuneResult, path) -> str:
    """Write ``kernel``'s source with ``result`` applied (its relabel block, and ``@gmem`` where
    it changes what is materialised) to ``path``, a new file, never the source itself."""
    from pathlib import Path

    if kernel.function is not None or Path(kernel.file).suffix == ".py":
        fusion = ""
        if result.fusion_changed:
            fusion = (f" and write @gmem on {', '.join(sorted(result.best.materialised)) or 'no statement'} "
                      f"(only there) in the docstring")
        raise NapkinError(f"--write rewrites .napkin sources; {kernel.name} is defined in Python",
                          hint=f"pass the block as relabel=... to @napkin.kernel{fusion}:\n" + result.relabel_text)
    target = Path(path)
    if Path(kernel.file).exists() and target.exists() and target.resolve() == Path(kernel.file).resolve():
        raise NapkinError(f"--write {path} would overwrite the source", hint="name another file: the tuned copy goes there")
    text = kernel.relabelled(result).source
    try:
        target.write_text(text, encoding="utf-8")
    except OSError as error:
        raise NapkinError(f"cannot write {path}: {error.strerror or error}") from None
    return text


def plot_svg(result: TuneResult) -> str:
    """Predicted time (the closed-form estimate, best over the other sizes) against each tile size
    searched, one panel per partition, the chosen size marked; SVG text, no plotting library."""
    import html

    curves = {label: curve for label, curve in result.curves.items() if curve}
    if not curves:
        raise NapkinError(f"nothing to plot: tuning {result.kernel} on {result.hardware} searched no tile sizes",
                          hint="the abstract models fit a closed form instead; plot on a GPU profile")
    chosen = {knob_label(k): v for k, v in result.best.values.items()}
    width, height, columns = 320, 220, min(3, len(curves))
    rows = -(-len(curves) // columns)
    left, right, top, bottom = 58, 12, 30, 36
    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{columns * width}" height="{rows * height + 24}" '
              f'font-family="sans-serif" font-size="10">'),
             (f'<text x="6" y="16" font-size="12">{html.escape(result.kernel)} on {html.escape(result.hardware)}: '
              f'predicted time against tile size: the closed form, best over the other sizes ({result.evaluated:,} candidates; '
              f'chosen in red, by exact cost)</text>')]
    for index, (label, curve) in enumerate(curves.items()):
        x0, y0 = (index % columns) * width, 24 + (index // columns) * height
        sizes, times = list(curve), [curve[size] * 1e6 for size in curve]
        lo_x, hi_x = math.log2(min(sizes)), math.log2(max(sizes))
        lo_y, hi_y = math.log10(min(times)), math.log10(max(times))
        span_x, span_y = (hi_x - lo_x) or 1.0, (hi_y - lo_y) or 1.0
        plot_w, plot_h = width - left - right, height - top - bottom

        def at(size, time_us, x0=x0, y0=y0, lo_x=lo_x, lo_y=lo_y, span_x=span_x, span_y=span_y, plot_w=plot_w, plot_h=plot_h):
            return (x0 + left + (math.log2(size) - lo_x) / span_x * plot_w,
                    y0 + top + plot_h - (math.log10(time_us) - lo_y) / span_y * plot_h)

        outside = chosen.get(label) is not None and chosen.get(label) not in curve
        # The written relabelling may win with a size off the grid (not a multiple the tuner requires).
        note = f" (chosen {chosen[label]}: off the grid searched)" if outside else ""
        parts.append(f'<text x="{x0 + left}" y="{y0 + 16}" font-size="11">{html.escape(label + note)}</text>')
        parts.append(f'<rect x="{x0 + left}" y="{y0 + top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>')
        points = [at(size, t) for size, t in zip(sizes, times, strict=False)]
        parts.append('<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="'
                     + " ".join(f"{x:.1f},{y:.1f}" for x, y in points) + '"/>')
        for size, (x, y) in zip(sizes, points, strict=False):
            mark = chosen.get(label) == size
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{4 if mark else 2.5}" fill="{"#d62728" if mark else "#1f77b4"}">'
                         f'<title>{size}: {curve[size] * 1e6:.4g} us{" (chosen)" if mark else ""}</title></circle>')
            if size & (size - 1) == 0 or mark:  # label powers of two and the chosen size
                parts.append(f'<text x="{x:.1f}" y="{y0 + top + plot_h + 12}" text-anchor="middle">{size}</text>')
        for value in sorted({min(times), max(times)}):
            _, y = at(sizes[0], value)
            parts.append(f'<text x="{x0 + left - 4}" y="{y + 3:.1f}" text-anchor="end">{value:.3g} us</text>')
        parts.append(f'<text x="{x0 + left + plot_w / 2}" y="{y0 + height - 6}" text-anchor="middle">tile size (log scale)</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def compare(entries: list, hardware: str | None, sizes: dict) -> list[dict]:
    """Cost each (label, kernel) side by side: predicted time, bound, what is materialised, and
    H and M per level. A relabelling that does not fit is a column with its error, not a failure."""
    columns = []
    for label, kernel in entries:
        column = {"label": label, "kernel": kernel.name, "relabel": kernel.relabel_text()}
        try:
            report = kernel.cost(hardware, **sizes)
        except NapkinError as error:
            column["error"] = error.message if hasattr(error, "message") else str(error)
            columns.append(column)
            continue
        column.update({
            "hardware": report.hardware,
            "time_s": report.time.get("overlapped_s"),
            "bound": report.time.get("bound"),
            "materialised": [s.target for s in kernel.diagram.statements if s.level is not None],
            "levels": {name: {"H_bytes": json_value(c.H_bytes), "M_bytes": json_value(c.M_bytes),
                              "capacity": json_value(c.capacity)} for name, c in report.levels.items()},
            "warnings": [n for n in report.notes if n.startswith("warning:")],
        })
        columns.append(column)
    return columns


def compare_table(columns: list[dict]) -> str:
    """The columns of :func:`compare` as a text table, one column per relabelling or file."""
    levels = list(dict.fromkeys(name for c in columns for name in c.get("levels", {})))
    rows = [("", *[c["label"] for c in columns]),
            ("relabel", *[c["relabel"] for c in columns]),
            ("time", *[_fmt_seconds(c["time_s"]) if "time_s" in c else "error" for c in columns]),
            ("bound", *[str(c.get("bound") or "-") for c in columns]),
            ("at gmem", *[", ".join(c.get("materialised", [])) or "none" for c in columns])]
    for level in levels:
        for key, name in (("H_bytes", "H"), ("M_bytes", "M")):
            cells = []
            for c in columns:
                value = c.get("levels", {}).get(level, {}).get(key)
                cells.append("-" if value is None else f"{format_count(value)} B")
            rows.append((f"{level} {name}", *cells))
    errors = [f"  {c['label']}: {c['error']}" for c in columns if "error" in c]
    warnings = [f"  {c['label']}: {w}" for c in columns for w in c.get("warnings", [])]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(r, widths, strict=False)).rstrip() for r in rows]
    return "\n".join(lines + (["errors:"] + errors if errors else []) + (["warnings:"] + warnings if warnings else []))


# ---- masked streams: a lower bound whatever the tiles -----------------------------------------
#
# A stream loop with a Mask (pseudocode.py) visits, per group tile, only the chunks the mask does
# not hide in full; the exact model counts a masked step over those tiles (cost.masked_elements).
# Every element the mask leaves unmasked lies in a visited tile (a tile holding one is not hidden),
# and a visited tile counts its extent along the mask's axes the step spans (a row's rescale: the
# tile's rows, once per chunk), which is its elements divided by its extent along the others,
# each at most that axis's tile. So the exact count is at least
#     U * prod(1 / tile_a for the mask's axes a the step does not span) * (the other axes and loops)
# with U the elements of the mask's axes (each whole) that it leaves unmasked: a count of the
# mask's constraints over the axes' index ranges, independent of the tiles (pseudocode.py caches the
# enumeration, so the knob sets and launches scored share it).
# With the symbolic trips size / tile this is the unmasked fraction U / prod(sizes of the mask's
# axes) times the Program's count; it is written out from the mask's tiles, as the exact count
# is (step_total replaces every loop over the mask's axes by them), rather than scaled from the
# trips of whichever loops the Program has.


MASK_PROBE_GROUPS = 4096  # tiles of the mask's other axes enumerated to count U: beyond, coarser tiles


def _masked_loop(loops):
    """The stream loop whose Mask decides what a step counts: the first, as in cost.step_total."""
    return next((loop for loop in loops if loop.mask is not None), None)


def _unmasked_elements(program: Program) -> dict:
    """Per Mask of the Program's stream loops, U: the elements of its axes' index space it leaves
    unmasked, or fewer (a lower bound); empty for a Program without a mask."""
    found: dict = {}
    for launch in program.launches:
        for _, loops in walk(launch.body):
            for loop in loops:
                if loop.mask is not None and loop.mask not in found:
                    found[loop.mask] = _unmasked_count(program, loop.mask)
    return found


def _unmasked_count(program: Program, mask: Mask) -> int:
    """U of ``mask``, counted by cost.masked_elements on the same constraints with tiles of one
    element (a tile is then visited exactly when its element is unmasked). Past
    MASK_PROBE_GROUPS tiles of the other axes, those tiles grow and only the elements of the
    tiles the mask holds in full count: fewer than U, still a lower bound."""
    sizes = {a: int(program.schedule.axis_size(a)) for a in mask.axes}
    others = [a for a in mask.axes if a != mask.axis]
    tiles = dict.fromkeys(mask.axes, 1)

    def count(a):
        return -(-sizes[a] // tiles[a])

    while others and math.prod(count(a) for a in others) > MASK_PROBE_GROUPS:
        tiles[max(others, key=count)] *= 2
    probe = dataclasses.replace(mask, tiles=tuple((a, algebra.Integer(tiles[a])) for a in mask.axes))
    visited = masked_elements(program, probe, mask.axes)
    partial = masked_elements(program, probe, mask.axes, partial=True)
    # Unenumerable (cannot happen with every size bound): none counted is still a lower bound.
    return 0 if visited is None or partial is None else visited - partial


def _at_least(program: Program, step, loops: tuple, axes: tuple, unmasked: dict) -> algebra.Expr:
    """A lower bound of ``cost.step_total(program, step, loops, axes)`` for any tiles: the count
    itself outside a masked stream, the bound above inside one (the same axes and loops outside
    the mask's as step_total multiplies in)."""
    masked = _masked_loop(loops)
    if masked is None:
        return step_total(program, step, loops, axes)
    mask, schedule = masked.mask, program.schedule
    involved = set(mask.axes)
    tiles = dict(mask.tiles)
    total = algebra.Integer(unmasked[mask]) / algebra.Mul(*(tiles[a] for a in mask.axes if a not in axes))
    total *= algebra.Mul(*(schedule.axis_size(a) for a in axes if a not in involved))
    for loop in loops:
        if loop.axis not in axes and loop.axis not in involved:
            total *= loop.trips
    return total


def _without_masked(body: tuple) -> tuple:
    """``body`` without its masked stream loops (and all they hold)."""
    return tuple(dataclasses.replace(node, body=_without_masked(node.body)) if isinstance(node, Loop) else node
                 for node in body if not (isinstance(node, Loop) and node.mask is not None))


def _work_parts(step):
    """A masked step's work one term at a time, as a step doing only that term, with the count
    per element and the axes it is counted over. The mask's test (``test_flops``) is left out:
    it runs only on the chunks the mask holds in part, of which the tiles may leave none."""
    bare = dataclasses.replace(step, flops=(), test_flops=(), bookkeeping=(), flops_over=())
    for unit, n in step.flops:
        yield dataclasses.replace(bare, flops=((unit, n),)), n, step.flop_space
    for unit, n, axes in step.flops_over + step.bookkeeping:
        yield dataclasses.replace(bare, flops_over=((unit, n, axes),)), n, axes


def _masked_priced(program: Program, unmasked: dict) -> list:
    """cost.flops_by_unit's priced entries with every term of a masked step at a lower bound of
    its count: the steps outside masked streams priced as they are; each term of a masked one
    priced alone (its path and dtype as flops_by_unit decides them) and counted by _at_least,
    or, for a term that subtracts work (a negative bookkeeping count), by every chunk (the most
    it can subtract)."""
    plain = Program(program.schedule, tuple(dataclasses.replace(launch, body=_without_masked(launch.body))
                                           for launch in program.launches))
    _, priced = flops_by_unit(plain)
    parts, launches = [], []
    for launch in program.launches:
        chains = []
        for step, loops in walk(launch.body):
            if _masked_loop(loops) is None:
                continue
            for part, n, axes in _work_parts(step):
                node = part
                for loop in reversed(loops):  # the part alone inside the step's loops
                    node = dataclasses.replace(loop, body=(node,))
                chains.append(node)
                parts.append((step, loops, n, axes))
        launches.append(dataclasses.replace(launch, body=tuple(chains)))
    _, alone = flops_by_unit(Program(program.schedule, tuple(launches)))
    if len(alone) != len(parts):
        # Each part was priced alone, so flops_by_unit gives one entry per part: otherwise the
        # parts and their prices would pair wrongly. A napkin bug, not the user's.
        raise AssertionError(f"napkin bug: {len(alone)} priced entries for {len(parts)} terms of masked steps")
    for (launch_of, unit, dtype, _), (step, loops, n, axes) in zip(alone, parts, strict=True):
        n = algebra.as_expr(n)
        count = _at_least(program, step, loops, axes, unmasked) if n.is_nonnegative else step_total(program, step, loops, axes)
        priced.append((launch_of, unit, dtype, n * count))
    return priced
