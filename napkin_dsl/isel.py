"""Instruction selection: which launches of a Program run on tensor cores, and how.

For one launch of a :class:`~napkin_dsl.pseudocode.Program` and a target architecture,
:func:`select` decides once, for every consumer (the CUDA and OpenCL printers, the cost
model, the kernel header, ``napkin cuda --resources``), whether the launch takes a
**tensor-core path** or the **FMA path**, and returns the plan of the path that builds it (a
``paths`` module's plan type: ``MmaSyncPlan``, ``WgmmaPlan``) or the reason none does:

* the tensor-core path is FlashAttention's register level: the block's tile of the **row
  axis** (q, m, ...) is split into warp tiles of ``warp_rows`` rows (``registers: group q 16``
  in a relabel block, or chosen here); every array the launch computes (S, P, the online max
  and sum, the O accumulator) lives in registers as ``mma.sync.m16n8k16`` accumulator
  fragments of the warp that owns its rows; only the tiles that contractions read from
  shared memory (Q, K, V) are there, swizzled (``layouts.py``), and those carrying
  the streamed axis are ``stages`` deep behind ``cp.async`` (:func:`stage_count`: 3 or more
  where a chunk's products are shorter than a copy's latency, 2 where not);
* everything else (f32 operands, extents that are not multiples of the fragment, arrays that
  are not two-dimensional after the block's unit axes, a target whose hardware profile gives it
  no mma.sync m16n8k16 path for the operands' dtype) stays on the FMA path, whose
  arena and costs are the Program's own columns.

The launch is analysed into that mma.sync layout (:func:`_plan`); then the paths the profile
offers on the architecture are asked in ``paths.PATHS`` order (wgmma on sm_90a, then mma.sync),
and the first whose ``build`` accepts takes it.

:func:`select_program` is the pass: it selects every launch of a Program once for a target and
returns a :class:`ProgramSelection`, each launch's :class:`Selection` carrying what the
consumers read with the plan (its tile extents and sizes, warp tiles, shared-memory layout,
and on the FMA path the accumulators kept in registers and those refused, with why). They are
handed that object; none selects again or derives tiles of its own. :func:`selection` decides
one launch the same way, for a look at it where no pass result is at hand.

It does not print anything and does not price anything; it reads the Program, its hardware
profile's instruction paths and sizes only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from .dtypes import DTYPE_BYTES, FP8_DTYPES
from .diagram import Contract, Map, Read, Reduce, Softmax, reads
from .layouts import MMA_K, MMA_M, MMA_N, CanonicalTile, SwizzledTile
from .paths import offered_paths, path_of
from .paths.mma_sync import MmaSyncPlan, converted_fp8_refusal, mma_k, mma_shape
from .paths.plan import (FRAGMENT_BUDGET, MAX_REGISTERS, MAX_WARPS, STAGES, TENSOR_DTYPES, Fragment, Mma, Operand, Refusal,
                         TensorPlan, WarpGrid, budget_refusal, gather_registers, live_fragment_values, refuse_if,
                         staged_slot)
from .paths.wgmma import WgmmaPlan, scheduled_roles
from .pseudocode import LaunchProgram, Program, blocks_per_unit, split_loop, walk
from .relabel import bind
from .windows import integer_at

# The plans, their paths and what every path shares are paths/'s (one module a path); this module
# analyses a launch into mma.sync's layout and asks the paths in order (select). The mma.sync
# shapes (MMA_M, MMA_N, MMA_K; MMA_K8 for 8-bit operands) are the layouts' fragments' (layouts.py).
FMA_THREADS = 256  # threads per block of a launch on the FMA path
# ... where the printer keeps the stream loop rolled, one chunk a trip (TensorPlan.rolled), and P
# packed from its exponentials on (tensorcore.TensorPrinter.packed_fragments): 32-row warps of
# attention at d = 128 and chunks of 64 keys hold 204 (O.acc 128, S 64, the row max, sum and
# scale 12) and compile for sm_80 and sm_90 to 251-255 registers without spills; unrolled by the
# stages they spill (220 bytes). Only for the launches it was measured on (_rollable). At 255
# registers ptxas's schedule of that loop is on a knife edge (sm_80 spills 52 bytes for gqa at
# q = x = 512 and none at 8192): a spilling launch is compiled again under a register cap
# (backends.cuda.REGISTER_CAPS), and 254 compiles every measured shape without spills.
ROLLED_FRAGMENT_BUDGET = 204
# The least compute capability ROLLED_FRAGMENT_BUDGET was measured on (8.0: sm_80, sm_90, sm_90a;
# A100 has the same 255 registers a thread as H100); below it FRAGMENT_BUDGET stays.
ROLLED_MIN_CAPABILITY = 80
MIN_WARPS = 4  # the SM's four schedulers: a block of fewer warps leaves some idle
MAX_STAGES = 4  # the deepest cp.async pipeline selection picks (stage_count)
# Clocks a cp.async copy from global memory takes to land under load, for a profile whose
# [latency] table names no ``copy`` (the GPU profiles do, with its reasoning: copy_latency). The
# chunks in flight (stages - 1) must cover it for the copies to hide behind the products
# (stage_count).
COPY_LATENCY_CLOCKS = 1000


def copy_latency(hardware) -> float:
    """The clocks a chunk's copy takes to land: the profile's ``[latency] copy``, else
    :data:`COPY_LATENCY_CLOCKS`."""
    clocks = hardware.latency_clocks("copy")
    return COPY_LATENCY_CLOCKS if clocks is None else clocks









@dataclass(frozen=True)
class Selection:
    """The path of one launch: a plan for tensor cores, or why the FMA path was kept; and, as
    the selection pass (:func:`select_program`) fills them in, the tiles it was decided on and
    what the launch holds where, which every consumer reads rather than derive again."""

    plan: TensorPlan | None
    reason: str = ""
    declined: str = ""  # why the plan is not on a path selection asked first (wgmma on sm_90a), which refused
    declined_path: str = ""  # that path's instruction
    tile: dict | None = None  # axis -> tile extent at the compute level (launch_tiles); None: a size is symbolic
    sizes: dict | None = None  # axis -> size (launch_tiles); None with tile
    warp_tiles: dict = field(default_factory=dict)  # the warp tiles the relabelling asks for (warp_tiles_of)
    slots: dict = field(default_factory=dict)  # a plan's shared-memory tiles by array (smem_layout)
    smem_bytes: int = 0  # a plan's shared-memory arena in bytes (smem_layout)
    kept: dict = field(default_factory=dict)  # an FMA launch's accumulators in registers (fma_accumulators)
    refused: dict = field(default_factory=dict)  # an FMA launch's accumulators left in shared memory -> why

    @property
    def path(self) -> str:
        return self.plan.instruction if self.plan is not None else "fma"


# The instruction and shape napkin's tensor-core printer builds. Which GPU has it, for which
# operand dtypes, is its hardware profile's to say ([path.*] tables, hardware.InstructionPath).
BUILT_INSTRUCTION = "mma.sync"
BUILT_SHAPE = f"m{MMA_M}n{MMA_N}k{MMA_K}"


def _target_path(hardware, arch: str, path: str | None, dtype: str | None = None):
    """The profile's path for the launch: ``path`` (a what-if instruction), else what napkin
    builds; for ``dtype`` operands where given, else for any dtype napkin builds fragments of.
    Refuses, naming the profile's paths, where the profile gives ``arch`` none."""
    instruction = path if path is not None else BUILT_INSTRUCTION
    shape = None
    for wanted in ([dtype] if dtype is not None else TENSOR_DTYPES + FP8_DTYPES):
        shape = None if path is not None else mma_shape(wanted)
        found = hardware.find_path(instruction, wanted, arch, shape)
        if found is not None:
            return found
    shape = None if path is not None else shape if dtype is not None else BUILT_SHAPE
    what = f"{instruction} {shape or ''}".rstrip() + (f" for {dtype}" if dtype is not None else "")
    raise Refusal(f"{hardware.name} has no {what} on {arch} (its paths: {hardware.paths_text()})")


def select(launch: LaunchProgram, arch: str, tile: dict, sizes: dict, warp_tiles: dict | None = None,
           path: str | None = None) -> Selection:
    """The instruction path of ``launch`` on ``arch`` given its compute-level tile extents and
    the warp tiles a relabel block asks for (axis -> extent at ``registers``).

    ``path`` None selects what napkin builds: the launch is analysed into mma.sync's layout within
    the fragment budget its printer compiles without spills (:func:`_plan`), then the paths the
    profile offers on ``arch`` are asked in order (``paths.PATHS``: wgmma, then mma.sync), and
    the first that accepts builds it; a path asked before it that refused is ``declined``. Where
    every path refuses the launch stays on the FMA path, with the last refusal and the others'.
    A named path ("mma.sync", "wgmma") is a what-if for pricing: the same register level priced
    as that instruction, whose fragments must fit the register file's 255 registers per thread
    (``MAX_REGISTERS``), not napkin's budget."""
    hardware = launch.schedule.hardware
    warp_tiles = dict(warp_tiles or {})
    try:
        # a path's own legality (mma.sync's converted fp8 among it) is its build's, below
        plan = _plan(launch, arch, tile, sizes, warp_tiles, path, converted=path is not None)
    except Refusal as refusal:
        if path is not None:
            return Selection(None, str(refusal))
        return _warpgroup_selection(launch, arch, tile, sizes, warp_tiles, str(refusal))
    if path is not None:
        return Selection(plan)  # priced as `path` on mma.sync's layout; wgmma is built only where the target has it
    return _built_selection(launch, arch, tile, sizes, warp_tiles, plan, offered_paths(hardware, arch, plan.dtype))


def _warpgroup_selection(launch: LaunchProgram, arch: str, tile: dict, sizes: dict, warp_tiles: dict,
                         refusal: str) -> Selection:
    """The launch on wgmma where mma.sync's layout refused it (``refusal``) and the target has
    wgmma: its warps hold 16 rows each whatever the tile's height, where mma.sync's at most
    ``MAX_WARPS`` warps would hold 32 or more (FlashAttention-3's 192-row tiles), and wgmma's
    build checks its own budget. Else the FMA path, with mma.sync's refusal."""
    try:
        plan = _plan(launch, arch, tile, sizes, dict(warp_tiles), warpgroup_rows=True)
    except Refusal:
        return Selection(None, refusal)  # a step before the budget refused: mma.sync's text says it
    wgmma = [p for p in offered_paths(launch.schedule.hardware, arch, plan.dtype) if p.instruction == "wgmma"]
    if not wgmma:
        return Selection(None, refusal)
    selection = _built_selection(launch, arch, tile, sizes, warp_tiles, plan, wgmma)
    if selection.plan is None:
        return Selection(None, f"{refusal}; not wgmma either: {selection.reason}")
    return selection


def _built_selection(launch: LaunchProgram, arch: str, tile: dict, sizes: dict, warp_tiles: dict, plan: MmaSyncPlan,
                     paths: list) -> Selection:
    """The first of ``paths`` that builds ``plan``, with the refusals of those asked before it, or
    the FMA path with every refusal."""
    hardware = launch.schedule.hardware
    refused: list[tuple[str, str]] = []  # (instruction, why), in the order asked
    for candidate in paths:
        try:
            built = candidate.build(plan, launch, tile, sizes, warp_tiles, arch)
        except Refusal as refusal:
            refused.append((candidate.instruction, str(refusal)))
            continue
        first = refused[0] if refused else ("", "")
        return Selection(built, declined=first[1], declined_path=first[0])
    if not refused:
        raise AssertionError(f"napkin bug: {hardware.name} offers no path on {arch} for the analysed {plan.dtype} plan")
    last = refused.pop()[1]
    return Selection(None, last + "".join(f"; not {name} either: {why}" for name, why in refused))


def _plan(launch: LaunchProgram, arch: str, tile: dict, sizes: dict, warp_tiles: dict, path: str | None = None,
          converted: bool = True, warpgroup_rows: bool = False) -> MmaSyncPlan:
    """The analysis of ``launch`` into mma.sync's layout (the plan every path builds from), step
    by step; each step refuses (:class:`Refusal`) with the reason the launch stays on the FMA
    path, the first that fails deciding the text. ``converted`` False leaves mma.sync's converted
    fp8 check (``paths.mma_sync.converted_fp8_refusal``) to that path's build, which ``select``
    asks after wgmma. ``warpgroup_rows``: the layout wgmma's warps hold whatever the tile's
    height (16 rows each, up to ``WGMMA_MAX_GROUPS`` warpgroups: FlashAttention-3's 192-row tiles
    at d = 64 are 12 warps), with the budget left to that path's build."""
    hardware = launch.schedule.hardware
    _target_path(hardware, arch, path)  # before anything else: a target without the instruction says so
    refuse_if(_launch_refusal(launch, tile))
    site = _Site(launch, tile, sizes)
    row = _row_axis(site)
    warp_rows, warp_tiles = _warp_rows(site, row, warp_tiles)
    stream, loaded = _stream_and_loaded(launch)
    staged = _staged_products(site, row)
    fragments = _fragments(site, row, loaded, staged)
    refuse_if(_reduction_refusal(site, fragments))
    operands, mmas, dtype = _products(site, row, fragments, loaded, stream, staged)
    plain = _plain_tiles(site, row, operands, loaded, stream)
    refuse_if(_window_refusal(site, plain))
    _target_path(hardware, arch, path, dtype)
    statements = launch.launch.statements
    split = _column_split(statements, fragments, mmas, stream)
    refuse_if(_warp_tiles_refusal(row, split, warp_tiles))
    if warpgroup_rows:
        return MmaSyncPlan(row, tile[row], MMA_M, dtype, operands, plain, fragments, mmas, stream)
    budget = FRAGMENT_BUDGET if path is None else MAX_REGISTERS
    if split is None:
        def rows_plan(rows: int) -> MmaSyncPlan:
            plan = MmaSyncPlan(row, tile[row], rows, dtype, operands, plain, fragments, mmas, stream,
                               instruction=path or "mma.sync")
            return replace(plan, grids=_staged_grids(plan, staged, tile)) if staged else plan

        def fits(rows: int) -> bool:
            # a what-if wgmma keeps 16-row warps (each warp of a warpgroup holds 16 of its 64 rows), and
            # so does a launch taller warps were not measured on (_measured_taller)
            if path == "wgmma" or not _measured_taller(launch):
                return False
            try:
                return _budgeted(rows_plan(rows), launch, tile, budget, path, arch)[1] is None
            except Refusal:  # fewer warps than a staged product's grid takes (_staged_grids)
                return False

        rows = warp_rows or _default_warp_rows(tile[row], fits)
        plan, refusal = _budgeted(rows_plan(rows), launch, tile, budget, path, arch, converted)
        refuse_if(refusal)
        return plan
    plan = _grid(row, split, tile, warp_rows, warp_tiles.get(split), launch, budget, dtype, operands, plain,
                 fragments, mmas, stream)
    plan = replace(plan, instruction=path or "mma.sync")
    refuse_if(budget_refusal(plan, launch, tile, budget, path))
    if converted:
        refuse_if(converted_fp8_refusal(plan, launch, tile, budget, arch))
    return plan


def _measured_taller(launch: LaunchProgram) -> bool:
    """Whether isel may choose warps taller than 16 rows for ``launch`` by itself (a relabelling may
    always ask): a stream of products and softmaxes only, the launches it was measured on
    (attention, GQA), masked ones too (causal and sliding-window attention, whose masked
    chunks test the mask once, on S in place: tensorcore.TensorPrinter.mask_in_place) where
    the chunks divide the streamed axis. What else a launch holds spills at 32 rows at
    d = 128: a ragged masked stream's short chunk, tested per element for its extent as well
    as its mask (causal at q = 200, x = 150: 172 bytes on sm_80; sliding_window at q = 330,
    x = 400: 268 on sm_90), and a further output (attention_lse's L, which reads the f32 row
    sum) 40 bytes at q = x = 128."""
    masked = [lp.axis for _, loops in walk(launch.body) for lp in loops if lp.kind == "stream" and lp.mask is not None]
    if masked:
        tiles = launch_tiles(launch)
        if tiles is None or any(tiles[1][axis] % tiles[0][axis] for axis in masked):
            return False
    return all(isinstance(s.box, (Contract, Softmax)) for s in launch.launch.statements)


def _rollable(plan: TensorPlan, launch: LaunchProgram, arch: str) -> bool:
    """Whether a built plan of row warps may take ROLLED_FRAGMENT_BUDGET, its loop rolled: one that
    streams, on 16-bit or 8-bit operands, with a product reading its A operand from registers
    (attention's P), for an architecture it was measured on (ROLLED_MIN_CAPABILITY), in a launch
    measured taller (:func:`_measured_taller`). At 204 fragments ptxas leaves a register or two
    to spare, and what else a launch holds spills (the figures there). 8-bit: FA3's fp8 tile (128 x
    128 at d = 128, 182 fragments) on sm_89's native m16n8k32 compiles rolled in 237 registers with
    no spills (tests/test_fp8_issue.py); where the arch converts 8-bit operands (sm_90), the path's
    own check keeps FRAGMENT_BUDGET (paths.mma_sync.converted_fp8_refusal)."""
    streams = plan.stream is not None and any(op.streamed for op in plan.operands.values())
    capability = re.match(r"sm_(\d+)", arch)
    return (capability is not None and int(capability.group(1)) >= ROLLED_MIN_CAPABILITY and streams
            and _measured_taller(launch) and plan.split is None
            and (plan.dtype in TENSOR_DTYPES or plan.dtype in FP8_DTYPES) and any(m.a_in_registers for m in plan.mmas.values()))


def _budgeted(plan: TensorPlan, launch: LaunchProgram, tile: dict, budget: int, path: str | None,
              arch: str, converted: bool = True) -> tuple[TensorPlan, str | None]:
    """``plan`` within the fragment budget, rolled where it is over FRAGMENT_BUDGET and within
    ROLLED_FRAGMENT_BUDGET (:func:`_rollable`), or the refusal that keeps it off tensor cores."""
    if path is None and _rollable(plan, launch, arch) and FRAGMENT_BUDGET < live_fragment_values(plan, launch, tile) <= ROLLED_FRAGMENT_BUDGET:
        plan, budget = replace(plan, rolled=True), ROLLED_FRAGMENT_BUDGET
    return plan, budget_refusal(plan, launch, tile, budget, path) or (
        converted_fp8_refusal(plan, launch, tile, budget, arch) if converted else None)




class _Site:
    """What every step of :func:`_plan` reads: the launch, its tile extents at the compute level
    and the axes' sizes."""

    def __init__(self, launch: LaunchProgram, tile: dict, sizes: dict):
        self.launch, self.tile, self.sizes = launch, tile, sizes
        self.statements = launch.launch.statements
        self.contractions = [s for s in self.statements if isinstance(s.box, Contract)]
        self.diagram = launch.schedule.diagram
        self.level = launch.schedule.compute_level

    def wide(self, axes) -> list[str]:
        """The axes of ``axes`` the tile does not hold at one value."""
        return [a for a in axes if self.tile[a] > 1]


def _launch_refusal(launch: LaunchProgram, tile: dict) -> str | None:
    """What keeps the whole launch off tensor cores before its tiles are looked at."""
    statements = launch.launch.statements
    if not any(isinstance(s.box, Contract) for s in statements):
        return "no contraction"
    return _split_parts_refusal(launch, tile) or _box_refusal(statements) or _f64_refusal(launch)


def _window_refusal(site: _Site, plain: tuple) -> str | None:
    """A window read that a launch on tensor cores reads elementwise (a plain tile, not a
    product's operand) stays on the FMA path: the tensor-core printers gather a window read's
    elements only into a product's swizzled sub-tiles (an implicit GEMM's, tensorcore.gather)."""
    arrays = site.diagram.arrays
    view = next((arrays[n] for n in plain if arrays[n].window is not None), None)
    if view is None:
        return None
    return (f"{view.name} is the window read {view.window.text(arrays[view.window.source].axes)}, read elementwise: "
            f"tensor cores gather a window read only as a product's operand (implicit GEMM)")


def _split_parts_refusal(launch: LaunchProgram, tile: dict) -> str | None:
    """Why a split's parts launch stays on the FMA path, where the tensor-core printer cannot
    print it (selection never chooses what the printers cannot print, tests/test_fuzz_reproducers.py):
    its epilogue saves contractions' accumulator fragments and online softmaxes' row max and
    sum as part states, for parts that stream the split axis in whole unmasked chunks."""
    cut = split_loop(launch)
    if cut is None:
        return None
    steps = list(walk(launch.body))
    level = launch.schedule.compute_level
    streams_whole_chunks = (any(lp.kind == "stream" and lp.axis == cut.axis and lp.mask is None for _, loops in steps for lp in loops)
                            and int(cut.tile) % tile[cut.axis] == 0)
    saves_fragments = not any(step.op == "save" and step.level == level
                              and not (step.statement is not None and isinstance(step.statement.box, (Contract, Softmax)))
                              for step, _ in steps)  # an add of a sum over groups has no statement: not a part state
    computes_every_statement = not ({s.target for s in launch.launch.statements}
                                    - {step.statement.target for step, _ in steps if step.statement is not None})
    if streams_whole_chunks and saves_fragments and computes_every_statement:
        return None
    return (f"the parts launch of split {cut.axis} is printed on tensor cores only where each part streams "
            f"{cut.axis} in whole unmasked chunks, computes every statement of the launch and saves "
            f"contractions' sums and online softmaxes' row max and sum alone (the fragments its epilogue saves)")


def _box_refusal(statements) -> str | None:
    for s in statements:
        if not isinstance(s.box, (Contract, Map, Reduce, Softmax)):
            return f"{s.target} is a {s.box.kind} box"
    return None


def _f64_refusal(launch: LaunchProgram) -> str | None:
    doubles = sorted(name for (_, name), buffer in launch.buffers.items() if buffer.dtype == "f64")
    if doubles:  # the Program computes these in f64 (pseudocode.compute_dtype); fragments are f32
        return f"{doubles[0]} is f64; the tensor-core path computes in f32"
    return None


def _row_axis(site: _Site) -> str:
    """The row axis: woven through every statement, read by the first contraction's first
    operand, its tile whole fragments of MMA_M rows. Where none is, one woven through every
    statement but products that may be staged (:func:`_staged_candidates`: their rows are
    their own, ``Mma.staged``)."""
    rows = _woven_rows(site, site.statements)
    if not rows:
        candidates = _staged_candidates(site)
        rest = [s for s in site.statements if s.target not in candidates]
        rows = _woven_rows(site, rest) if candidates and rest else []
    if not rows:
        raise Refusal("no axis is woven through every statement and read by the first contraction's first operand")
    row = rows[0]
    if site.tile[row] % MMA_M:
        raise Refusal(f"the {row} tile ({site.tile[row]}) is not a multiple of {MMA_M}")
    return row


def _woven_rows(site: _Site, statements) -> list[str]:
    """The wide axes of every one of ``statements`` that the first contraction's first operand reads."""
    common = set(site.wide(statements[0].axes))
    for s in statements[1:]:
        common &= set(site.wide(s.axes))
    first = site.contractions[0].box.operands[0]
    return [a for a in site.wide(statements[0].axes) if a in common and a in first.axes]


def _staged_candidates(site: _Site) -> set[str]:
    """Products that may have rows of their own (``Mma.staged``): two operands, one of them
    computed in the launch, over a two-dimensional output tile."""
    computed = {s.target for s in site.statements}
    return {s.target for s in site.contractions
            if len(s.box.operands) == 2 and sum(r.array in computed for r in s.box.operands) == 1
            and len(site.wide(s.axes)) == 2}


@dataclass(frozen=True)
class _Staged:
    """A staged product as the analysis finds it: ``target[rows, n] = sum over the plan's row of
    fragment[row, rows] * b[row, n]`` (``Mma.staged``)."""

    target: str
    fragment: str
    b: str
    rows: str
    n: str


def _staged_products(site: _Site, row: str) -> dict[str, _Staged]:
    """The products of the launch whose output does not carry the row axis, each checked to be
    one mma.sync can run with A staged through shared memory (FlashAttention-2's dQ = dS^T K in
    the launch grouped over keys): it contracts the row axis alone; its A is a fragment computed
    here over (row, its rows); its B a loaded tile over (row, its columns); its output is saved,
    not read by another statement here, and computed afresh each time (not accumulated over a
    stream), its tiles whole fragments."""
    staged = {}
    computed = {s.target for s in site.statements}
    candidates = _staged_candidates(site)
    read_here = {r.array for s in site.statements for r in _reads(s)}
    accumulated = {step.statement.target for step, _ in walk(site.launch.body)
                   if step.op == "accumulate" and step.statement is not None}
    for s in site.contractions:
        out = site.wide(s.axes)
        if row in out:
            continue
        name = f"{s.target} ({s.target}[{' '.join(s.axes)}] does not carry the row axis {row})"
        if s.target not in candidates:
            raise Refusal(f"{name} is not a product of a fragment computed here and a loaded tile, over two axes")
        if site.wide(s.box.contracted) != [row]:
            raise Refusal(f"{name} contracts {' '.join(site.wide(s.box.contracted))}: a product staged through "
                          f"shared memory contracts the row axis {row} alone")
        a = next(r for r in s.box.operands if r.array in computed)
        b = next(r for r in s.box.operands if r is not a)
        rows = next((x for x in site.wide(a.axes) if x != row), None)
        n = next((x for x in out if x != rows), None)
        if rows is None or set(site.wide(a.axes)) != {row, rows} or set(out) != {rows, n} \
                or set(site.wide(b.axes)) != {row, n}:
            raise Refusal(f"{name} is not ({rows or '?'} x {row}) fragments times a ({row} x columns) tile")
        if s.target in read_here:
            raise Refusal(f"{name} is read here by another statement; a staged product's output is saved only")
        if s.target in accumulated:
            raise Refusal(f"{name} accumulates over a stream; a staged product is computed afresh each time")
        for axis in (rows, n):
            if site.tile[axis] % (2 * MMA_N):
                raise Refusal(f"{name}: its {axis} tile ({site.tile[axis]}) is not a multiple of {2 * MMA_N}")
        dtype = site.diagram.arrays[b.array].dtype
        if dtype not in TENSOR_DTYPES:  # ldmatrix .trans moves 16-bit values (before sm_100)
            raise Refusal(f"{name}: its B operand {b.array} is {dtype}; a staged product takes {', '.join(TENSOR_DTYPES)}")
        if not SwizzledTile.supports(site.tile[rows], DTYPE_BYTES[dtype]):
            raise Refusal(f"{name}: {a.array} is staged in rows of {site.tile[rows]} {rows} ({dtype}), which no swizzle "
                          f"covers (rows of 32, 64 or a multiple of 128 bytes)")
        staged[s.target] = _Staged(s.target, a.array, b.array, rows, n)
    return staged


def _staged_grids(plan: TensorPlan, staged: dict, tile: dict) -> dict:
    """Each staged product's warp grid (``TensorPlan.grids``): warp tiles of whole fragment pairs
    over the output, one for every warp of the block, the grid that reads the fewest values from
    shared memory (the staged A once per warp column, B once per warp row), or a refusal. No warp
    sits a product out: the emulated warp primitives (tensorcore.OPENCL_PRELUDE) wait at block
    barriers, which every work-item of the block must reach."""
    grids = {}
    for found in staged.values():
        rows, cols = tile[found.rows], tile[found.n]
        options = []
        for wr in range(MMA_M, rows + 1, MMA_M):
            for wc in range(2 * MMA_N, cols + 1, 2 * MMA_N):
                if rows % wr or cols % wc or (rows // wr) * (cols // wc) != plan.warps:
                    continue
                traffic = rows * (cols // wc) + cols * (rows // wr)
                options.append((traffic, -wr, WarpGrid(found.rows, rows, wr, found.n, cols, wc)))
        if not options:
            raise Refusal(f"{found.target}'s {rows} x {cols} tile of {found.rows} x {found.n} has no grid of warp tiles of "
                          f"whole fragment pairs for each of the {plan.warps} warps (a longer {found.rows} chunk has)")
        grids[found.target] = min(options, key=lambda o: o[:2])[2]
    return grids


def _warp_rows(site: _Site, row: str, warp_tiles: dict) -> tuple[int | None, dict]:
    """The rows of a warp the relabelling asks for (None: chosen later), and its other warp tiles."""
    tile = site.tile
    # A warp tile larger than the block's (a size smaller than its partition) is clipped, as tiles are.
    warp_tiles = {axis: min(size, tile[axis]) for axis, size in warp_tiles.items()}
    warp_rows = warp_tiles.pop(row, None)
    if warp_rows is not None and (warp_rows % MMA_M or tile[row] % warp_rows or tile[row] // warp_rows > MAX_WARPS):
        raise Refusal(f"warp tiles of {warp_rows} rows do not split the {row} tile of {tile[row]} into at most {MAX_WARPS} warps of whole fragments")
    return warp_rows, warp_tiles


def _stream_and_loaded(launch: LaunchProgram) -> tuple[str | None, set]:
    """The axis streamed at the compute level (None), and the arrays loaded into it."""
    level = launch.schedule.compute_level
    stream = None
    for _, loops in walk(launch.body):
        for lp in loops:
            if lp.kind == "stream" and lp.level == level:
                stream = lp.axis
    loaded = {step.array for step, _ in walk(launch.body) if step.op == "load" and step.level == level}
    return stream, loaded


def _fragments(site: _Site, row: str, loaded: set, staged: dict) -> dict[str, Fragment]:
    """Register fragments: everything computed at the compute level, each a tile of rows by at
    most one other axis of whole 16-column fragment pairs (a staged product's output: of its own
    rows by its columns, laid out on its grid)."""
    fragments: dict[str, Fragment] = {}
    for (lvl, name), buffer in site.launch.buffers.items():
        if lvl != site.level or name in loaded:
            continue
        if name in staged:
            fragments[name] = Fragment(name, staged[name].n)
            continue
        axes = site.wide(buffer.axes)
        if row not in axes or len(axes) > 2:
            raise Refusal(f"{name}[{' '.join(buffer.axes)}] is not a tile of {row} rows by at most one other axis")
        col = next((a for a in axes if a != row), None)
        if col is not None and site.tile[col] % (2 * MMA_N):
            raise Refusal(f"the {col} tile of {name} ({site.tile[col]}) is not a multiple of {2 * MMA_N}")
        fragments[name] = Fragment(name, col)
    return fragments


def _reduction_refusal(site: _Site, fragments: dict) -> str | None:
    """A row reduction (a reduce or a softmax) on this path reduces rows of register fragments
    along one column axis (the printer's quad shuffles): one that reads no such fragment, a
    shared-memory tile alone (S[m] = sum[k](A) beside C = A B), stays on the FMA path."""
    for s in site.statements:
        if not isinstance(s.box, (Reduce, Softmax)):
            continue
        cols = {fragments[r.array].col for r in reads(s.box.operand) if r.array in fragments} - {None}
        if len(cols) != 1:
            read = ", ".join(sorted({r.array for r in reads(s.box.operand)}))
            held = "no fragment" if not cols else f"fragments along {' and '.join(sorted(cols))}"
            return f"{s.target} reduces {read}, which holds {held}: the tensor-core path reduces rows of one fragment's columns"
    return None


def _operand_refusal(site: _Site, name: str, role: str, loaded: set, taps: tuple = ()) -> str | None:
    """Why array ``name`` cannot be a contraction's ``role`` operand read by ldmatrix from a
    swizzled shared tile (one a value of ``taps``, an implicit GEMM's: :class:`Operand`)."""
    array = site.diagram.arrays[name]
    tile, sizes = site.tile, site.sizes
    if name not in loaded:
        return f"{role} operand {name} is not loaded into shared memory"
    if array.dtype not in TENSOR_DTYPES + FP8_DTYPES:
        return f"{name} is {array.dtype}; tensor cores here take {', '.join(TENSOR_DTYPES + FP8_DTYPES)}"
    axes = [a for a in site.wide(array.axes) if a not in taps]
    if _indexed(array, taps):
        if array.dtype in FP8_DTYPES:
            return (f"{name} is an implicit GEMM's operand, a sub-tile a tap copied through its window, which is "
                    f"built for 16-bit operands ({', '.join(TENSOR_DTYPES)}), not {array.dtype}")
        if len(axes) != 2:
            return f"{name} is not a two-dimensional tile beside the contracted axes {' '.join(taps)}"
    elif len(axes) != 2 or array.axes[-1] != axes[-1]:
        return f"{name} is not a two-dimensional tile whose fastest axis is its last"
    if not SwizzledTile.supports(tile[axes[1]], DTYPE_BYTES[array.dtype]):
        return (f"{name}'s tile rows ({tile[axes[1]]} values of {axes[1]}, "
                f"{tile[axes[1]] * DTYPE_BYTES[array.dtype]} bytes) are not 32, 64 or a multiple of 128 bytes: no swizzle covers them")
    if not _indexed(array, taps) and sizes[axes[1]] % (16 // DTYPE_BYTES[array.dtype]):
        return (f"{name}'s rows in memory ({axes[1]} = {sizes[axes[1]]}) are not a multiple of 16 bytes: "
                f"cp.async copies 16-byte units")
    return None


def _indexed(array, taps: tuple) -> bool:
    """Whether an operand's tiles are an implicit GEMM's (:class:`Operand`): a window read's, or
    one with taps, each sub-tile of the taps' copied on its own."""
    return array.window is not None or bool(taps)


def _gathered(site: _Site, array, cols: str, taps: tuple) -> bool:
    """Whether an implicit GEMM's operand is gathered element by element, where a 16-byte unit
    of a sub-tile's row (along ``cols``) is not 16 contiguous bytes in memory: ``cols`` is not
    its array's last axis (or a window read's parameter's, indexed by ``cols`` alone), that
    axis's size is not whole units, or a window pads with a value other than 0 (cp.async fills
    zeros)."""
    if not _indexed(array, taps):
        return False
    per = 16 // DTYPE_BYTES[array.dtype]
    window = array.window
    if window is None:
        return array.axes[-1] != cols or site.sizes[cols] % per != 0
    source = site.diagram.arrays[window.source]
    last = window.indices[-1]
    alone = (len(last.terms) == 1 and last.terms[0][0] == cols and integer_at(last.terms[0][1], site.sizes) == 1
             and integer_at(last.offset, site.sizes) == 0)
    elsewhere = any(cols in index.axes for index in window.indices[:-1])
    return (not alone or elsewhere or site.sizes[source.axes[-1]] % per != 0 or site.sizes[cols] % per != 0
            or window.pad not in (None, 0.0))


def _contraction_axes(site: _Site, s, row: str):
    """(A, B, k, n, taps) of contraction ``s`` as ``out[row, n] = sum over taps of A[row, k] B[k, n]``,
    or a refusal. Of several contracted axes (a convolution's channels and window: implicit
    GEMM), k is the streamed one, else the last of B's whose tile is whole fragments; the
    others are taps, each a product of its own sub-tiles."""
    reads_ = s.box.operands
    if len(reads_) != 2:
        # A factor over the output's axes alone has left the product already (a post-scale,
        # check.py): each one left carries a contracted axis, so none can be applied after it.
        held = ", ".join(f"{r.array}[{' '.join(r.axes)}]" for r in reads_)
        raise Refusal(f"{s.target} contracts {len(reads_)} operands, each over a contracted axis ({held}); mma takes two "
                      f"(a factor leaves the product, to scale its result, only where its axes are all axes of {s.target})")
    contracted = site.wide(s.box.contracted)
    if not contracted:
        raise Refusal(f"{s.target} contracts no tiled axis")
    step = max(mma_k(site.diagram.arrays[r.array].dtype) for r in reads_ if r.array in site.diagram.arrays)
    k = _contracted_k(site, contracted, reads_, step)
    if site.tile[k] % step:
        raise Refusal(f"the contracted {k} tile ({site.tile[k]}) is not a multiple of {step}")
    taps = tuple(a for a in contracted if a != k)
    with_row = [r for r in reads_ if row in r.axes]
    if len(with_row) != 1:
        raise Refusal(f"{s.target}: exactly one operand must carry {row}")
    a, b = with_row[0], next(r for r in reads_ if r is not with_row[0])
    out = site.wide(s.axes)
    n = next((x for x in out if x != row), None)
    if n is None or set(site.wide(b.axes)) != {k, n, *taps} or set(site.wide(a.axes)) != {row, k, *taps}:
        raise Refusal(f"{s.target} is not (rows x {' '.join((k, *taps))}) times ({' '.join((k, *taps))} x columns)")
    return a, b, k, n, taps


def _contracted_k(site: _Site, contracted: list, reads_, step: int) -> str:
    """The contracted axis mma's k runs along (:func:`_contraction_axes`)."""
    if len(contracted) == 1:
        return contracted[0]
    streamed = _stream_and_loaded(site.launch)[0]
    if streamed in contracted:
        return streamed
    b_axes = site.diagram.arrays[reads_[1].array].axes if reads_[1].array in site.diagram.arrays else reads_[1].axes
    whole = [a for a in b_axes if a in contracted and site.tile[a] % step == 0]
    if not whole:
        raise Refusal(f"none of the contracted tiles ({', '.join(f'{a} {site.tile[a]}' for a in contracted)}) is a multiple of {step}")
    return whole[-1]


def _products(site: _Site, row: str, fragments: dict, loaded: set, stream: str | None,
              staged: dict) -> tuple[dict, dict, str]:
    """The contractions as mma.sync products: (shared operands by array, in the order they are
    first read, B before A; mma by statement target; the one operand dtype they run in)."""
    operands: dict[str, Operand] = {}
    mmas: dict[str, Mma] = {}
    dtypes = set()

    def operand(name: str, role: str, taps: tuple) -> Operand:
        refuse_if(_operand_refusal(site, name, role, loaded, taps))
        array = site.diagram.arrays[name]
        axes = [a for a in site.wide(array.axes) if a not in taps]
        found = Operand(name, axes[0], axes[1], stream is not None and stream in array.axes, taps,
                        _gathered(site, array, axes[1], taps), _indexed(array, taps))
        if operands.get(name, found) != found:
            raise Refusal(f"{name} is read by two products with different taps or layouts")
        operands[name] = found
        return found

    for s in site.contractions:
        if s.target in staged:
            found = staged[s.target]
            if fragments[found.fragment].col != found.rows:
                raise Refusal(f"{found.fragment} in registers is not laid out along {found.rows}")
            b_tile = operand(found.b, "B", ())
            dtype = site.diagram.arrays[found.b].dtype
            dtypes.add(dtype)
            mmas[s.target] = Mma(found.fragment, False, True, found.b, b_tile.rows == row, row, found.n, dtype,
                                 staged=True)
            continue
        a, b, k, n, taps = _contraction_axes(site, s, row)
        b_tile = operand(b.array, "B", taps)
        if a.array in fragments:
            if fragments[a.array].col != k or taps:
                raise Refusal(f"{a.array} in registers is not laid out along {' '.join((k, *taps))}")
            a_trans, a_regs = False, True
        else:
            a_tile = operand(a.array, "A", taps)
            a_trans, a_regs = a_tile.cols == row, False
            dtypes.add(site.diagram.arrays[a.array].dtype)
        dtype = site.diagram.arrays[b.array].dtype
        dtypes.add(dtype)
        mmas[s.target] = Mma(a.array, a_regs, a_trans, b.array, b_tile.rows == k, k, n, dtype, taps)
    if len(dtypes) != 1:
        raise Refusal(f"contractions mix {' and '.join(sorted(dtypes))} operands")
    return operands, mmas, dtypes.pop()


def _plain_tiles(site: _Site, row: str, operands: dict, loaded: set, stream: str | None) -> tuple:
    """The loaded arrays read elementwise (row-major shared tiles), after checking that every
    reduction runs along a row's columns and every elementwise read stays within the tile."""
    diagram = site.diagram
    plain = []
    for name in sorted(loaded):
        if name in operands:
            continue
        plain.append(name)
    for s in site.statements:
        if isinstance(s.box, (Reduce, Softmax)):
            reduced = site.wide(s.box.axes if isinstance(s.box, Reduce) else (s.box.axis,))
            if len(reduced) > 1 or any(a == row for a in reduced):
                raise Refusal(f"{s.target} reduces along {' '.join(reduced)}, not along the columns of a row")
        for r in _reads(s):
            if r.array in plain and not set(site.wide(diagram.arrays[r.array].axes)) <= set(site.wide(s.iteration_axes)):
                raise Refusal(f"{s.target} reads {r.array} across axes it does not iterate")
    return tuple(plain)


def _warp_tiles_refusal(row: str, split: str | None, warp_tiles: dict) -> str | None:
    """Warp tiles the relabelling asks for beyond the rows split a column axis warps may split."""
    if not warp_tiles or (split is not None and set(warp_tiles) == {split}):
        return None
    axis = next(iter(warp_tiles))
    return (f"warp tiles split {row}{f' and {split}' if split else ''} here, not {axis}"
            + ("" if split else ": a row reduction or a fragment fed to mma needs whole rows in one warp"))












def _column_split(statements, fragments: dict, mmas: dict, stream: str | None) -> str | None:
    """The column axis warps may split too: one shared by every 2-D fragment, along which nothing
    reduces (softmax, max, sum need a whole row in one warp's quads) and which no fragment
    carries into an mma as its A operand (P's columns are the next product's k)."""
    cols = {f.col for f in fragments.values() if f.col is not None}
    if len(cols) != 1 or any(isinstance(s.box, (Reduce, Softmax)) for s in statements):
        return None
    if any(m.a_in_registers or m.staged for m in mmas.values()):
        return None
    col = cols.pop()
    return None if col == stream else col


def _grid(row, col, tile, warp_rows, warp_cols, launch, budget, *rest) -> MmaSyncPlan:
    """A 2-D warp grid. Each warp reads its rows of A and its columns of B by ldmatrix, so the
    block reads A once per warp column and B once per warp row: the grid minimising that
    traffic (row_tile x warp columns + col_tile x warp rows) within the fragment budget, with
    4 to 8 warps where possible (fewer leave the SM's schedulers idle)."""
    rows_options = [warp_rows] if warp_rows else [r for r in (16, 32, 64, 128) if tile[row] % r == 0]
    cols_options = [warp_cols] if warp_cols else [c for c in (16, 32, 64, 128, 256) if tile[col] % c == 0]
    candidates = []
    for r in rows_options:
        for c in cols_options:
            if r % MMA_M or c % (2 * MMA_N) or tile[row] % r or tile[col] % c:
                continue
            plan = MmaSyncPlan(row, tile[row], r, *rest, split=col, col_tile=tile[col], warp_cols=c)
            if plan.warps > MAX_WARPS or live_fragment_values(plan, launch, tile) > budget:
                continue
            # B gathered by byte loads (an fp8 [k n] B) costs each warp row an instruction a
            # byte where ldmatrix moves 16 a lane: weighted double, the grid shares it over more
            # m-tiles (fp8_matmul: 64 x 32 warp tiles, tensor-bound in SASS, not 32 x 64, issue-bound)
            gathered = 2 if gather_registers(plan, tile) else 1
            traffic = tile[row] * plan.col_warps + tile[col] * plan.row_warps * gathered
            candidates.append((plan.warps < 4, traffic, -plan.warps, plan))
    if not candidates:
        raise Refusal(f"no warp grid of whole fragments splits the {tile[row]} x {tile[col]} tile of {row} x {col} "
                      f"into at most {MAX_WARPS} warps within the fragment budget")
    return min(candidates, key=lambda c: c[:3])[3]


def _reads(s) -> list[Read]:
    box = s.box
    if isinstance(box, Contract):
        return list(box.operands)
    return reads(box.expr if isinstance(box, Map) else box.operand)


def _default_warp_rows(row_tile: int, fits) -> int:
    """The tallest warp tile of whole fragments that splits the row tile into MIN_WARPS to MAX_WARPS
    warps and ``fits`` (rows -> whether a plan of that many rows a warp is within its budget), else
    the shortest of at most MAX_WARPS warps (whose budget refusal then says why). A warp reads
    every B tile (K, V) by ldmatrix for its own rows, so taller warps read each of its values fewer
    times: FA2's 4 warps of 32 rows at d = 128 read K and V half as often as 8 warps of 16, and
    fit the rolled budget (ROLLED_FRAGMENT_BUDGET) with chunks of 64 keys."""
    rows = MMA_M
    while row_tile // rows > MAX_WARPS:
        rows *= 2
    taller = 2 * rows
    while row_tile % taller == 0 and row_tile // taller >= MIN_WARPS and fits(taller):
        rows, taller = taller, 2 * taller
    return rows


def launch_tiles(launch: LaunchProgram) -> tuple[dict, dict] | None:
    """Bound tile extents at the compute level and axis sizes, or None when a size is symbolic."""
    schedule = launch.schedule
    level = schedule.compute_level
    tile, sizes = {}, {}
    for axis in schedule.diagram.axes:
        extent, size = schedule.extent(axis, level), schedule.axis_size(axis)
        if not (extent.is_number and size.is_number):
            return None
        tile[axis], sizes[axis] = int(extent), int(size)
    return tile, sizes


def warp_tiles_of(launch: LaunchProgram) -> dict:
    """The warp tiles a relabel block asks for (``registers: group q 16`` or ``group m 64, n 64``)."""
    tiles = {}
    for p in launch.schedule.partitions:
        if p.level == "registers" and p.kind == "group":
            size = bind(p.size, launch.schedule.sizes)
            if size.is_number:
                tiles[p.axis] = int(size)
    return tiles


@dataclass(frozen=True)
class ProgramSelection:
    """Instruction selection for every launch of a Program on one target: the pass's result
    (:func:`select_program`). ``arch`` is the target it was decided for (the profile's where
    none was asked for), ``path`` the what-if instruction path it prices (None: what napkin
    builds), ``launches`` the :class:`Selection` of each launch by its index in the Program."""

    arch: str | None
    path: str | None
    launches: dict = field(default_factory=dict)

    def __getitem__(self, index: int) -> Selection:
        if index not in self.launches:
            raise AssertionError(f"napkin bug: the selection has no launch {index} (it has {sorted(self.launches)})")
        return self.launches[index]

    def tensor(self) -> dict[int, Selection]:
        """The launches on tensor cores, by index."""
        return {index: chosen for index, chosen in self.launches.items() if chosen.plan is not None}

    @property
    def paths(self) -> tuple[str, ...]:
        """Each launch's path ("mma.sync", "wgmma", "fma"), in launch order."""
        return tuple(self.launches[index].path for index in sorted(self.launches))


def select_program(program: Program, arch: str | None = None, path: str | None = None,
                   stages: int | None = None, synchronous: bool = False, schedule: str | None = None) -> ProgramSelection:
    """Instruction selection as one pass: the :class:`Selection` of every launch of ``program``
    for ``arch`` (default: its hardware profile's), with its tiles, shared-memory layout and FMA
    register accumulators. ``path`` prices a what-if instruction path (:func:`select`); ``stages``
    sets every streamed tensor-core launch's cp.async stages (:func:`stage_count`);
    ``synchronous`` keeps every wgmma launch on the synchronous ring, without roles (the build
    before warp specialization, kept to compare with); ``schedule`` (default: the relabel
    block's ``overlap:`` line, else "serial") orders the consumer warpgroups where a launch has
    them (``paths.wgmma.SCHEDULES``: "pipelined" is FlashAttention-3's intra-warpgroup
    pipeline, "pingpong" its named-barrier turns; a launch
    keeps what does not apply to it serial and says why, ``order_declined``). The model, the
    printers, the NumPy counts and the kernel header read the result; none asks again."""
    arch = arch or program.hardware.arch
    schedule = schedule or program.schedule.overlap or "serial"  # asked for, else the relabel block's
    return ProgramSelection(arch, path, {launch.index: _select_launch(program, launch, arch, path, stages, synchronous, schedule)
                                         for launch in program.launches})


def selection(program: Program, launch: LaunchProgram, arch: str | None = None, path: str | None = None) -> Selection:
    """The :class:`Selection` of one launch, decided afresh (as :func:`select_program` decides it):
    for a look at one launch, where no pass result is at hand."""
    return _select_launch(program, launch, arch or program.hardware.arch, path)


def _select_launch(program: Program, launch: LaunchProgram, arch: str | None, path: str | None,
                   stages: int | None = None, synchronous: bool = False, schedule: str = "serial") -> Selection:
    bound = launch_tiles(launch)
    tile, sizes = bound if bound is not None else (None, None)
    warp_tiles = warp_tiles_of(launch)
    if arch is None:
        chosen = Selection(None, "the hardware profile names no architecture")
    elif bound is None:
        chosen = Selection(None, "sizes are symbolic")
    else:
        chosen = select(launch, arch, tile, sizes, warp_tiles=warp_tiles, path=path)
    if synchronous and isinstance(chosen.plan, WgmmaPlan) and chosen.plan.roles is not None:
        chosen = replace(chosen, plan=replace(chosen.plan, roles=None, roles_declined="the synchronous ring was asked for"))
    if schedule != "serial" and isinstance(chosen.plan, WgmmaPlan):
        plan, declined = scheduled_roles(chosen.plan, launch, tile, schedule)
        chosen = replace(chosen, plan=replace(plan, order_declined=declined))
    if chosen.plan is not None:
        chosen = replace(chosen, plan=replace(chosen.plan, stages=stage_count(chosen.plan, launch, tile, program.diagram, arch, stages,
                                                                               sizes)))
    slots, smem_bytes = smem_layout(chosen.plan, tile, program.diagram) if chosen.plan is not None else ({}, 0)
    kept, refused = {}, {}
    hardware = program.hardware
    # An FMA launch's accumulators count at the registers level: a profile without one has none.
    if chosen.plan is None and bound is not None and not hardware.symbolic and "registers" in hardware.level_names():
        kept, refused = fma_accumulators(launch, tile)
    return replace(chosen, tile=tile, sizes=sizes, warp_tiles=warp_tiles, slots=slots, smem_bytes=smem_bytes,
                   kept=kept, refused=refused)


__all__ = ["Fragment", "Mma", "Operand", "ProgramSelection", "Selection", "TensorPlan", "select", "select_program", "selection"]


# ---- what the plan occupies -----------------------------------------------------------------


@dataclass(frozen=True)
class SmemSlot:
    """A shared-memory tile of the tensor-core path: swizzled (operands) or row-major (plain)."""

    name: str
    offset: int
    stage_bytes: int
    stages: int
    tile: SwizzledTile | None  # None: a row-major tile over `axes`
    axes: tuple[str, ...] = ()

    @property
    def bytes(self) -> int:
        return self.stage_bytes * self.stages


MBARRIER_BYTES = 16  # one mbarrier's slot at the arena's end (the object is 8 bytes; the emulation keeps 4 counters)


def mbarrier_count(plan: TensorPlan) -> int:
    """The mbarriers a TMA plan keeps after its tiles: one a stage of the ring (two with roles: full
    and empty), one a one-shot copy."""
    if not isinstance(plan, WgmmaPlan) or not plan.tma:
        return 0
    ring = 2 * plan.stages if plan.roles is not None else plan.stages  # full (and, with roles, empty) per stage
    return ring + sum(1 for load in plan.tma if not load.streamed)


def kmajor_name(name: str) -> str:
    """The slot of operand ``name``'s K-major copy (``WgmmaPlan.transposed``): no array's name."""
    return f"{name}.kmajor"


def slot_array(slot: str) -> str:
    """The array a shared-memory slot holds: its own name, a K-major copy's operand, or a staged
    product's A fragment (``paths.plan.staged_slot``)."""
    return slot.removesuffix(".kmajor").removesuffix(".staged")


def smem_layout(plan: TensorPlan, tile: dict, diagram) -> tuple[dict[str, SmemSlot], int]:
    """Offsets of the plan's shared-memory tiles and the arena's size in bytes, a TMA plan's
    mbarriers included (:func:`mbarrier_count` of them, at the end, 16-byte aligned).

    Swizzled tiles start on 128-byte boundaries: the swizzle permutes 16-byte units within
    128-byte lines, which are the banks' period only when the tile's base is one. A wgmma plan's
    canonical tiles start where their swizzle pattern repeats (1024 bytes for 128B), so that
    every descriptor's base offset is 0; the arena itself is aligned to 1024 by the printer.
    """
    slots: dict[str, SmemSlot] = {}
    offset = 0
    canonical = isinstance(plan, WgmmaPlan)  # wgmma's canonical layouts, each on its swizzle's period
    for name, op in plan.operands.items():
        array = diagram.arrays[name]
        swizzled = (CanonicalTile if canonical else SwizzledTile)(tile[op.rows], tile[op.cols], DTYPE_BYTES[array.dtype])
        stages = plan.stages if op.streamed else 1
        align = swizzled.alignment if canonical else 128
        offset = -(-offset // align) * align
        taps = math.prod(tile[a] for a in op.taps)  # an implicit GEMM's sub-tiles, one after another
        slots[name] = SmemSlot(name, offset, swizzled.bytes * taps, stages, swizzled)
        offset += swizzled.bytes * taps * stages
    # A staged product's A fragment (Mma.staged): the plan's rows by the product's, one stage; on
    # wgmma a canonical tile, which the product reads by descriptor as its B (MN-major).
    for target, mma in plan.mmas.items():
        if mma.staged and staged_slot(mma.a) not in slots:
            swizzled = (CanonicalTile if canonical else SwizzledTile)(tile[plan.row], tile[plan.staged_rows(target)],
                                                                      DTYPE_BYTES[mma.dtype])
            align = swizzled.alignment if canonical else 128
            offset = -(-offset // align) * align
            slots[staged_slot(mma.a)] = SmemSlot(staged_slot(mma.a), offset, swizzled.bytes, 1, swizzled)
            offset += swizzled.bytes
    # A wgmma plan's K-major copies (plan.transposed): rows and columns swapped, one stage.
    for name in plan.transposed if canonical else ():
        op = plan.operands[name]
        copy = CanonicalTile(tile[op.cols], tile[op.rows], DTYPE_BYTES[diagram.arrays[name].dtype])
        offset = -(-offset // copy.alignment) * copy.alignment
        slots[kmajor_name(name)] = SmemSlot(kmajor_name(name), offset, copy.bytes, 1, copy)
        offset += copy.bytes
    # Plain tiles after the swizzled ones, widest values first: no padding between them.
    for name in sorted(plan.plain, key=lambda n: -DTYPE_BYTES[diagram.arrays[n].dtype]):
        array = diagram.arrays[name]
        size = DTYPE_BYTES[array.dtype]
        for axis in array.axes:
            size *= tile[axis]
        slots[name] = SmemSlot(name, offset, size, 1, None, array.axes)
        offset += size
    if mbarrier_count(plan):
        offset = -(-offset // MBARRIER_BYTES) * MBARRIER_BYTES + MBARRIER_BYTES * mbarrier_count(plan)
    return slots, offset


def chunk_clocks(plan: TensorPlan, launch: LaunchProgram, tile: dict, arch: str) -> float | None:
    """Clocks one chunk of the stream takes an SM at the plan's tensor rate: its products'
    FLOPs (each contraction's tile extents, the streamed axis at its chunk) over the profile's
    mma.sync FLOP per clock per SM. A lower bound (the softmax and the copies are left out), so
    it asks for at least as many stages as the chunk needs. None where the profile gives no
    clock, SM count or rate."""
    hardware = launch.schedule.hardware
    found = hardware.find_path(BUILT_INSTRUCTION, plan.dtype, arch, BUILT_SHAPE)
    rate = found.rates.get(plan.dtype) if found is not None else None
    units = hardware.level(launch.schedule.compute_level).units
    if not (rate and hardware.clock_hz and isinstance(units, int) and units > 0):
        return None
    flops = 0
    for s in launch.launch.statements:
        if s.target in plan.mmas:
            extent = 2
            for axis in set(s.axes) | set(s.box.contracted):
                extent *= tile[axis]
            flops += extent
    return flops / (rate / (units * hardware.clock_hz))


def stage_count(plan: TensorPlan, launch: LaunchProgram, tile: dict, diagram, arch: str, stages: int | None = None,
                sizes: dict | None = None) -> int:
    """The cp.async stages of a built mma.sync plan that streams: ``stages`` where asked for (the
    tuner's and the user's knob, at least 2), else enough chunks in flight to cover a copy's
    latency (:func:`copy_latency`), ``1 + ceil(latency / chunk_clocks)`` between 3 and ``MAX_STAGES`` (at
    least 3: a 2-stage pipeline has one chunk in flight), and 2 where the chunk alone covers it
    (attention at d = 128: 2048 clocks of products a chunk; a third stage there also spills, as
    ptxas compiles the three unrolled chunks). Fewer, down to 2, where the arena of that many
    stages exceeds the profile's shared memory per block or lowers the blocks an SM holds at 2
    stages (shared memory, threads and the estimated registers: occupancy). wgmma plans and
    what-if paths keep ``STAGES``: their printer's ring and pricing are their own."""
    if plan.stream is None or not any(op.streamed for op in plan.operands.values()):
        return plan.stages
    if stages is not None:
        if stages < 2:
            raise ValueError(f"{stages} cp.async stages: the pipeline needs at least 2")
        return stages
    if isinstance(plan, WgmmaPlan) and plan.roles is not None:
        return ring_stages(plan, launch, tile, sizes, diagram)
    if plan.instruction != BUILT_INSTRUCTION:  # a wgmma plan's instruction is its own
        return plan.stages
    clocks = chunk_clocks(plan, launch, tile, arch)
    if clocks is None or clocks <= 0:
        return plan.stages
    hardware = launch.schedule.hardware
    latency = copy_latency(hardware)
    wanted = STAGES if clocks >= latency else min(MAX_STAGES, max(3, 1 + -(-int(latency) // int(clocks))))
    capacity = hardware.level(launch.schedule.compute_level).capacity
    registers = estimated_registers(plan, launch, tile)

    def blocks(count: int):
        arena = smem_layout(replace(plan, stages=count), tile, diagram)[1]
        if isinstance(capacity, int) and arena > capacity:
            return None
        found = blocks_per_unit(launch.schedule, arena, plan.threads, registers)
        return found[0] if found is not None else 1

    floor = blocks(STAGES)
    while wanted > STAGES and (blocks(wanted) is None or (floor is not None and blocks(wanted) < floor)):
        wanted -= 1
    return wanted


RING_MAX_STAGES = 8  # the deepest ring a producer warpgroup fills (ring_stages)


def ring_stages(plan: WgmmaPlan, launch: LaunchProgram, tile: dict, sizes: dict, diagram) -> int:
    """The stages of a warp-specialized plan's ring: the producer runs ahead of the consumers by as
    many chunks as the ring holds, so the ring is as deep as the profile's shared memory per block
    takes, up to ``RING_MAX_STAGES`` (one block an SM: a deeper ring costs no occupancy), but no
    deeper than the stream's chunks (at least 2)."""
    chunks = -(-sizes[plan.stream] // tile[plan.stream])
    capacity = launch.schedule.hardware.level(launch.schedule.compute_level).capacity
    wanted = max(2, min(RING_MAX_STAGES, chunks))
    while wanted > 2 and isinstance(capacity, int) and smem_layout(replace(plan, stages=wanted), tile, diagram)[1] > capacity:
        wanted -= 1
    return wanted


def describe(selection_: Selection, launch: LaunchProgram) -> list[str]:
    """One line per statement of the launch: the instruction path it runs on, and why (a product's
    line is its path's, ``TensorPath.product_line``)."""
    plan = selection_.plan
    if plan is None:
        return [f"{s.target}: fma ({selection_.reason})" for s in launch.launch.statements]
    lines = [f"not {selection_.declined_path}: {selection_.declined}"] if selection_.declined else []
    path = path_of(plan)
    for s in launch.launch.statements:
        mma = plan.mmas.get(s.target)
        if mma is None:
            lines.append(f"{s.target}: fma on {plan.row} x {plan.fragments[s.target].col or '1'} fragments in registers")
            continue
        lines.append(path.product_line(plan, s.target, mma))
    return lines + path.schedule_lines(plan)


def plan_summary(plan: TensorPlan) -> str:
    """The register level in one line: warp tiles, warps, pipeline stages."""
    streamed = [name for name, op in plan.operands.items() if op.streamed]
    tma = plan.tma if isinstance(plan, WgmmaPlan) else ()
    copier = "TMA" if tma else "cp.async"
    gathered = [name for name in streamed if plan.operands[name].gathered]
    if any(plan.operands[name].indexed for name in streamed):  # an implicit GEMM's (tensorcore.TensorPrinter.gather)
        mixed = 0 < len(gathered) < len(streamed)
        copier = "cp.async and gathered" if mixed else "gathered" if gathered else copier

        def detail(name: str) -> str:
            op = plan.operands[name]
            said = (["gathered"] if mixed and op.gathered else []) + ([f"a sub-tile per {' '.join(op.taps)}"] if op.taps else [])
            return f"{name} ({', '.join(said)})" if said else name

        streamed = [detail(name) for name in streamed]
    pipeline = f"; {copier} {plan.stages} stages for {', '.join(streamed)}" if streamed else "; cp.async, 1 stage"
    once = [load.array for load in tma if not load.streamed]
    if once:  # copied once before the stream, each on its own mbarrier
        pipeline += f"; {', '.join(once)} by one TMA copy"
    if isinstance(plan, WgmmaPlan) and plan.roles is not None:
        consumers = plan.roles.consumers
        pipeline += f"; a producer warpgroup, {consumers} consumer warpgroup{'s' if consumers > 1 else ''}"
    if getattr(plan, "rolled", False):  # why: the fragments are over FRAGMENT_BUDGET (_budgeted)
        pipeline += (f"; the stream loop rolled, one chunk a trip (fragments over {FRAGMENT_BUDGET} registers, "
                     f"within {ROLLED_FRAGMENT_BUDGET})")
    tiles = f"group {plan.row} {plan.warp_rows}" + (f", {plan.split} {plan.warp_cols}" if plan.split else "")
    shape = f"{plan.warp_rows} {plan.row}" + (f" x {plan.warp_cols} {plan.split}" if plan.split else " rows")
    return f"registers: {tiles} ({plan.warps} warps of {shape}){pipeline}"


def warp_line(plan: TensorPlan) -> str:
    """The register level as a line of pseudocode: a parallel loop over the block's warps (its path's)."""
    return path_of(plan).warp_line(plan)


# Registers a tensor-core kernel needs beyond its fragments (addresses, operand fragments,
# loop state), fitted on napkin's own sm_90 kernels as ptxas compiles them: attention d = 128
# (192 registers for 102 fragment values) and matmul 128 x 128 (210 for 128). The compiled
# kernel's report uses ptxas's count instead (cost_of(resources=...)).
REGISTER_OVERHEAD = 86


def estimated_registers(plan: TensorPlan, launch: LaunchProgram, tile: dict) -> int:
    """Registers per thread before ptxas has counted them: live fragments plus the overhead."""
    return min(MAX_REGISTERS, live_fragment_values(plan, launch, tile) + REGISTER_OVERHEAD)


# ---- the FMA path's register accumulators ---------------------------------------------------

REGISTER_TILE = 4  # outputs per thread along each of an FMA contraction's two free axes
# Accumulator registers (4-byte) one thread of an FMA launch may keep across its stream loop. A
# 128 x 128 f32 tile on 256 threads is 64; more would crowd out the operands and addresses of the
# product loop (ptxas spills), so such an accumulator stays in shared memory.
FMA_ACCUMULATOR_BUDGET = 64


@dataclass(frozen=True)
class FmaAccumulator:
    """A streamed contraction's running sum that the FMA path keeps in registers: each thread
    owns ``blocks`` register blocks of ``rm`` x ``rn`` outputs along ``am`` (an axis of the first
    operand only) and ``an`` (of the second only), the blocks of the tile dealt to the threads
    in turn, so it holds ``values`` accumulators (of ``dtype``) from init to finalise."""

    name: str  # the state buffer, "O.acc"
    am: str
    an: str
    rm: int
    rn: int
    blocks: int
    dtype: str

    @property
    def values(self) -> int:
        return self.blocks * self.rm * self.rn

    @property
    def registers(self) -> int:
        """4-byte registers: an f64 accumulator takes two."""
        return self.values * DTYPE_BYTES[self.dtype] // 4


def register_tile_axes(box: Contract, target_axes, tile: dict):
    """The two free axes of a contraction's register blocks: the last tiled output axis only the
    first operand carries and the last only the second carries; None when one is missing (a
    matrix-vector product), where the FMA printer gives each thread single outputs."""
    if len(box.operands) != 2:
        return None
    first, second = box.operands
    only_first = [a for a in target_axes if a in first.axes and a not in second.axes and tile[a] > 1]
    only_second = [a for a in target_axes if a in second.axes and a not in first.axes and tile[a] > 1]
    if not only_first or not only_second:
        return None
    return only_first[-1], only_second[-1]


def fma_accumulators(launch: LaunchProgram, tile: dict, threads: int = FMA_THREADS) -> tuple[dict, dict]:
    """For a launch on the FMA path: the streamed contractions' accumulators kept in registers
    (buffer name -> :class:`FmaAccumulator`) and those left in shared memory (name -> why).

    A contraction streamed along its contracted axis keeps ``X.acc`` from its init before the
    stream loop to its finalise after it. In registers, every step that touches it (init, the
    online softmax's rescale, accumulate, finalise) visits the outputs in the same order, the
    register blocks of the product; so it needs register blocks, and at most
    ``FMA_ACCUMULATOR_BUDGET`` registers a thread."""
    level = launch.schedule.compute_level
    kept, refused = {}, {}
    for s in launch.launch.statements:
        name = f"{s.target}.acc"
        if not isinstance(s.box, Contract) or (level, name) not in launch.buffers:
            continue
        axes = register_tile_axes(s.box, s.axes, tile)
        if axes is None:
            refused[name] = "no register blocks (an output axis of one operand only, and one of the other): one output a thread"
            continue
        am, an = axes
        rm, rn = min(REGISTER_TILE, tile[am]), min(REGISTER_TILE, tile[an])
        others = 1
        for a in s.axes:
            if a not in axes:
                others *= tile[a]
        blocks = -(-others * -(-tile[am] // rm) * -(-tile[an] // rn) // threads)
        found = FmaAccumulator(name, am, an, rm, rn, blocks, launch.buffers[(level, name)].dtype)
        if found.registers > FMA_ACCUMULATOR_BUDGET:
            refused[name] = f"{found.registers} accumulator registers a thread, over the FMA path's {FMA_ACCUMULATOR_BUDGET}"
            continue
        kept[name] = found
    return kept, refused


def thread_line(kept: dict, refused: dict, threads: int = FMA_THREADS) -> str | None:
    """The register level of an FMA launch as a line of pseudocode: a parallel loop over the
    block's threads, saying which accumulators they keep in registers and which stay in shared
    memory, and why; None when the launch streams no contraction."""
    if not kept and not refused:
        return None
    held = [f"{a.name} in registers, {a.blocks} block{'s' if a.blocks > 1 else ''} of {a.rm} {a.am} x {a.rn} {a.an} a thread"
            for a in kept.values()]
    held += [f"{name} in smem: {why}" for name, why in refused.items()]
    return f"parallel for thread in {threads} threads @registers:  # fma; {'; '.join(held)}"
