"""Instruction selection: which launches of a Program run on tensor cores, and how.

For one launch of a :class:`~napkin_dsl.pseudocode.Program` and a target architecture,
:func:`select` decides once, for every consumer (the CUDA and OpenCL printers, the cost
model, the kernel header, ``napkin cuda --resources``), whether the launch takes the
**tensor-core path** or the **FMA path**, and returns a :class:`TensorPlan` or the reason it
cannot:

* the tensor-core path is FlashAttention's register level: the block's tile of the **row
  axis** (q, m, ...) is split into warp tiles of ``warp_rows`` rows (``registers: group q 16``
  in a relabel block, or chosen here); every array the launch computes (S, P, the online max
  and sum, the O accumulator) lives in registers as ``mma.sync.m16n8k16`` accumulator
  fragments of the warp that owns its rows; only the tiles that contractions read from
  shared memory (Q, K, V) are there, swizzled (``backends/layouts.py``), and those carrying
  the streamed axis are ``stages`` deep behind ``cp.async`` (:func:`stage_count`: 3 or more
  where a chunk's products are shorter than a copy's latency, 2 where not);
* everything else (f32 operands, extents that are not multiples of the fragment, arrays that
  are not two-dimensional after the block's unit axes, a target whose hardware profile gives it
  no mma.sync m16n8k16 path for the operands' dtype) stays on the FMA path, whose
  arena and costs are the Program's own columns.

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

import re
from dataclasses import dataclass, field, replace

from .dtypes import DTYPE_BYTES, FP8_DTYPES
from .diagram import Contract, Map, Read, Reduce, Softmax, reads
from .layouts import MMA_K, MMA_K8, MMA_M, MMA_N, WGMMA_M, WGMMA_MAX_N, CanonicalTile, SwizzledTile, wgmma_k
from .pseudocode import LaunchProgram, Program, blocks_per_unit, liveness, released_by, split_loop, walk
from .relabel import bind

# The mma.sync shapes (MMA_M, MMA_N, MMA_K; MMA_K8 for 8-bit operands) are the layouts' fragments'
# (layouts.py): one definition, which the plans here are cut to.
TENSOR_DTYPES = ("bf16", "f16")
# 8-bit operands run on mma.sync m16n8k32 (sm_89 and later; layouts.MMA_A8, MMA_B8): the same
# accumulator fragment, 32 values of k an instruction.


def mma_k(dtype: str) -> int:
    """The k of one mma.sync instruction for ``dtype`` operands: 16, or 32 for fp8."""
    return MMA_K8 if dtype in FP8_DTYPES else MMA_K


def mma_shape(dtype: str) -> str:
    """The mma.sync shape napkin builds for ``dtype`` operands (``m16n8k16``, fp8's ``m16n8k32``)."""
    return f"m{MMA_M}n{MMA_N}k{mma_k(dtype)}"
MAX_WARPS = 8
WARPGROUP = 4  # warps of one wgmma
FMA_THREADS = 256  # threads per block of a launch on the FMA path
# Fragment registers one thread may hold at once; the rest of the 255 hold addresses, operand
# fragments and temporaries (an FA2-class attention loop at d = 128 compiles to ~184 with ~100 here).
FRAGMENT_BUDGET = 160
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
MAX_REGISTERS = 255  # registers one thread may have (the register level's capacity, 1020 bytes)
STAGES = 2  # cp.async buffers per streamed operand: the next chunk is in flight while this one is used
MAX_STAGES = 4  # the deepest cp.async pipeline selection picks (stage_count)
# Clocks a cp.async copy from global memory takes to land under load: an estimate, not measured
# here (about 1000 clocks is what issue 22 reads off matmul's one 32-deep chunk in flight; an
# unloaded DRAM access on A100/H100 is some 500-700 ns, 700-1300 clocks). The chunks in flight
# (stages - 1) must cover it for the copies to hide behind the products (stage_count).
COPY_LATENCY_CLOCKS = 1000


@dataclass(frozen=True)
class Operand:
    """A shared-memory tile a contraction reads with ldmatrix: ``rows`` x ``cols`` (fastest)."""

    array: str
    rows: str
    cols: str
    streamed: bool


@dataclass(frozen=True)
class Fragment:
    """A register-resident array: accumulator fragments over (row, col), or a value per row."""

    name: str
    col: str | None


@dataclass(frozen=True)
class Mma:
    """One contraction ``out[row, n] (+)= A[row, k] * B[k, n]`` on mma.sync."""

    a: str  # array name (smem operand) or fragment name (registers)
    a_in_registers: bool
    a_trans: bool  # A stored k-major: ldmatrix .trans
    b: str
    b_trans: bool  # B stored k-major (k rows, n fastest): ldmatrix .trans
    k: str
    n: str
    dtype: str  # operand dtype the mma runs in


@dataclass(frozen=True)
class TmaLoad:
    """One operand a wgmma plan copies by TMA (``cp.async.bulk.tensor.<rank>d``): its tile of ``rows``
    x ``cols`` (``cols`` contiguous in memory and in the box), as ``boxes`` boxes of
    ``box_rows`` x ``box_cols`` elements (``CanonicalTile.tma_boxes``) with the tensor map's
    ``swizzle`` span in bytes. The host's tensor map and the OpenCL emulation read it."""

    array: str
    rows: str
    cols: str
    box_rows: int
    box_cols: int
    boxes: int
    swizzle: int
    element_bytes: int
    # the array's axes in memory, outermost first (the box is 1 along all but rows and cols), and
    # whether the tile fills the stream's ring (else one copy before the stream, its own mbarrier)
    axes: tuple = ()
    streamed: bool = True

    @property
    def rank(self) -> int:
        return len(self.axes)

    def box(self) -> tuple:
        """The box's extent along each of the array's axes, outermost first."""
        return tuple(self.box_rows if a == self.rows else self.box_cols if a == self.cols else 1 for a in self.axes)

    @property
    def bytes(self) -> int:
        """The bytes one stage of this operand brings (the boxes whole: TMA fills out-of-bounds)."""
        return self.boxes * self.box_rows * self.box_cols * self.element_bytes


MAX_TMA_BOX = 256  # cuTensorMapEncodeTiled: every boxDim at most 256
MAX_TMA_RANK = 5  # cuTensorMapEncodeTiled: tensorRank 1 .. 5 (cp.async.bulk.tensor.1d .. .5d)


@dataclass(frozen=True)
class TensorPlan:
    row: str
    row_tile: int
    warp_rows: int
    dtype: str
    operands: dict = field(default_factory=dict)  # array -> Operand (swizzled smem)
    plain: tuple = ()  # loaded arrays read elementwise (row-major smem tiles)
    fragments: dict = field(default_factory=dict)  # buffer name -> Fragment
    mmas: dict = field(default_factory=dict)  # statement target -> Mma
    stream: str | None = None
    stages: int = STAGES
    split: str | None = None  # a column axis also split among warps (a 2-D warp grid), or None
    col_tile: int = 0  # the block's tile of `split`
    warp_cols: int = 0  # columns of `split` a warp owns
    # The tensor-core instruction: "mma.sync" (what napkin builds: one warp's 16 x 8 x 16
    # products, operands by ldmatrix) or "wgmma" (sm_90a's warpgroup products, priced only: four
    # warps share one read of the B tile from shared memory).
    instruction: str = "mma.sync"
    # A plan napkin builds on wgmma (sm_90a, ``backends/wgmma.py``): the instruction's shape,
    # ``m64n128k16``; "" for mma.sync and for the wgmma what-if, which lays fragments out as mma.sync.
    shape: str = ""
    # A wgmma plan's TMA copies (``TmaLoad`` per streamed operand, the stream's ring of
    # ``stages`` stages behind mbarriers); () where the operands go by cp.async, and why.
    tma: tuple = ()
    tma_declined: str = ""
    # A wgmma plan's shape per product (statement target -> "m64n64k16"); ``shape`` joins them.
    shapes: dict = field(default_factory=dict)
    # The stream loop runs one chunk a trip on a running buffer, not unrolled by the stages: for
    # fragments over FRAGMENT_BUDGET, up to ROLLED_FRAGMENT_BUDGET (tensorcore.TensorPrinter.rolled).
    rolled: bool = False
    # Operands a wgmma plan copies into a K-major tile of their own each chunk (the 8-bit shape
    # reads B K-major only: attention's V stored [.. x d] under an fp8 P, backends/wgmma.py's
    # transpose_b); their slots are smem_layout's "<name>.kmajor".
    transposed: tuple = ()

    @property
    def row_warps(self) -> int:
        return self.row_tile // self.warp_rows

    @property
    def col_warps(self) -> int:
        return self.col_tile // self.warp_cols if self.split else 1

    @property
    def warps(self) -> int:
        return self.row_warps * self.col_warps

    def cols_per_warp(self, col: str, tile: dict) -> int:
        """The extent of column axis ``col`` one warp's fragments cover."""
        return self.warp_cols if col == self.split else tile[col]

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def b_readers(self) -> int:
        """How many times the block reads a B tile from shared memory per product: once per warp
        row on mma.sync (each warp loads its own fragments), once per warpgroup of four warps on
        wgmma (the tensor cores read B from shared memory for the whole group)."""
        return -(-self.row_warps // WARPGROUP) if self.instruction == "wgmma" else self.row_warps

    @property
    def m_tiles(self) -> int:
        return self.warp_rows // MMA_M


@dataclass(frozen=True)
class Selection:
    """The path of one launch: a plan for tensor cores, or why the FMA path was kept; and, as
    the selection pass (:func:`select_program`) fills them in, the tiles it was decided on and
    what the launch holds where, which every consumer reads rather than derive again."""

    plan: TensorPlan | None
    reason: str = ""
    declined: str = ""  # why a tensor-core plan is not on wgmma where the target has it (sm_90a)
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


class _Refuse(Exception):
    pass


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
    raise _Refuse(f"{hardware.name} has no {what} on {arch} (its paths: {hardware.paths_text()})")


def select(launch: LaunchProgram, arch: str, tile: dict, sizes: dict, warp_tiles: dict | None = None,
           path: str | None = None) -> Selection:
    """The instruction path of ``launch`` on ``arch`` given its compute-level tile extents and
    the warp tiles a relabel block asks for (axis -> extent at ``registers``).

    ``path`` None selects what napkin builds: mma.sync within the fragment budget its printer
    compiles without spills. A named path ("mma.sync", "wgmma") is a what-if for pricing: the
    same register level priced as that instruction, whose fragments must fit the register
    file's 255 registers per thread (``MAX_REGISTERS``), not napkin's budget."""
    hardware = launch.schedule.hardware
    # where the target builds wgmma (sm_90a), mma.sync's converted fp8 (no 8-bit mma.sync in SASS)
    # is no reason to stay off tensor cores until wgmma has declined the launch as well
    wgmma_here = path is None and any(arch in getattr(hardware.find_path("wgmma", dtype, arch), "archs", ())
                                      for dtype in TENSOR_DTYPES + FP8_DTYPES)
    try:
        plan = _plan(launch, arch, tile, sizes, dict(warp_tiles or {}), path, converted=not wgmma_here)
    except _Refuse as refusal:
        return Selection(None, str(refusal))
    found = hardware.find_path("wgmma", plan.dtype, arch)
    if path is not None or found is None or arch not in found.archs:
        return Selection(plan)  # wgmma is built only where the target itself has it (sm_90a), not for the what-if on sm_90
    try:
        # the wgmma plan is rebuilt from the mma.sync one, whose loop form is its printer's own
        return Selection(_wgmma_plan(replace(plan, rolled=False), launch, tile, sizes, dict(warp_tiles or {})))
    except _Refuse as refusal:
        converted = _converted_fp8_refusal(plan, launch, tile, FRAGMENT_BUDGET, arch)
        if converted is not None:
            return Selection(None, f"{converted}; not wgmma either: {refusal}")
        return Selection(plan, declined=str(refusal))


def _plan(launch: LaunchProgram, arch: str, tile: dict, sizes: dict, warp_tiles: dict, path: str | None = None,
          converted: bool = True) -> TensorPlan:
    """The mma.sync plan of ``launch``, step by step; each step refuses (:class:`_Refuse`) with
    the reason the launch stays on the FMA path, the first that fails deciding the text.
    ``converted`` False leaves :func:`_converted_fp8_refusal` to the caller (``select``, which
    tries wgmma first)."""
    hardware = launch.schedule.hardware
    _target_path(hardware, arch, path)  # before anything else: a target without the instruction says so
    _refuse_if(_launch_refusal(launch, tile))
    site = _Site(launch, tile, sizes)
    row = _row_axis(site)
    warp_rows, warp_tiles = _warp_rows(site, row, warp_tiles)
    stream, loaded = _stream_and_loaded(launch)
    fragments = _fragments(site, row, loaded)
    _refuse_if(_reduction_refusal(site, fragments))
    operands, mmas, dtype = _products(site, row, fragments, loaded, stream)
    plain = _plain_tiles(site, row, operands, loaded, stream)
    _target_path(hardware, arch, path, dtype)
    statements = launch.launch.statements
    split = _column_split(statements, fragments, mmas, stream)
    _refuse_if(_warp_tiles_refusal(row, split, warp_tiles))
    budget = FRAGMENT_BUDGET if path is None else MAX_REGISTERS
    if split is None:
        def rows_plan(rows: int) -> TensorPlan:
            return TensorPlan(row, tile[row], rows, dtype, operands, plain, fragments, mmas, stream,
                              instruction=path or "mma.sync")

        # a what-if wgmma keeps 16-row warps (each warp of a warpgroup holds 16 of its 64 rows), and
        # so does a launch taller warps were not measured on (_measured_taller)
        rows = warp_rows or _default_warp_rows(
            tile[row], lambda rows: path != "wgmma" and _measured_taller(launch)
            and _budgeted(rows_plan(rows), launch, tile, budget, path, arch)[1] is None)
        plan, refusal = _budgeted(rows_plan(rows), launch, tile, budget, path, arch, converted)
        _refuse_if(refusal)
        return plan
    plan = _grid(row, split, tile, warp_rows, warp_tiles.get(split), launch, budget, dtype, operands, plain,
                 fragments, mmas, stream)
    plan = replace(plan, instruction=path or "mma.sync")
    _refuse_if(_budget_refusal(plan, launch, tile, budget, path))
    if converted:
        _refuse_if(_converted_fp8_refusal(plan, launch, tile, budget, arch))
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
    streams, on 16-bit operands, with a product reading its A operand from registers (attention's
    P), for an architecture it was measured on (ROLLED_MIN_CAPABILITY), in a launch measured
    taller (:func:`_measured_taller`). At 204 fragments ptxas leaves a register or two to spare,
    and what else a launch holds spills (the figures there)."""
    streams = plan.stream is not None and any(op.streamed for op in plan.operands.values())
    capability = re.match(r"sm_(\d+)", arch)
    return (capability is not None and int(capability.group(1)) >= ROLLED_MIN_CAPABILITY and streams
            and _measured_taller(launch) and plan.split is None
            and plan.dtype in TENSOR_DTYPES and any(m.a_in_registers for m in plan.mmas.values()))


def _budgeted(plan: TensorPlan, launch: LaunchProgram, tile: dict, budget: int, path: str | None,
              arch: str, converted: bool = True) -> tuple[TensorPlan, str | None]:
    """``plan`` within the fragment budget, rolled where it is over FRAGMENT_BUDGET and within
    ROLLED_FRAGMENT_BUDGET (:func:`_rollable`), or the refusal that keeps it off tensor cores."""
    if path is None and _rollable(plan, launch, arch) and FRAGMENT_BUDGET < live_fragment_values(plan, launch, tile) <= ROLLED_FRAGMENT_BUDGET:
        plan, budget = replace(plan, rolled=True), ROLLED_FRAGMENT_BUDGET
    return plan, _budget_refusal(plan, launch, tile, budget, path) or (
        _converted_fp8_refusal(plan, launch, tile, budget, arch) if converted else None)


def _refuse_if(reason: str | None) -> None:
    if reason is not None:
        raise _Refuse(reason)


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
    saves_fragments = not any(step.op == "save" and step.level == level and not isinstance(step.statement.box, (Contract, Softmax))
                              for step, _ in steps)
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
    operand, its tile whole fragments of MMA_M rows."""
    statements = site.statements
    common = set(site.wide(statements[0].axes))
    for s in statements[1:]:
        common &= set(site.wide(s.axes))
    first = site.contractions[0].box.operands[0]
    rows = [a for a in site.wide(statements[0].axes) if a in common and a in first.axes]
    if not rows:
        raise _Refuse("no axis is woven through every statement and read by the first contraction's first operand")
    row = rows[0]
    if site.tile[row] % MMA_M:
        raise _Refuse(f"the {row} tile ({site.tile[row]}) is not a multiple of {MMA_M}")
    return row


def _warp_rows(site: _Site, row: str, warp_tiles: dict) -> tuple[int | None, dict]:
    """The rows of a warp the relabelling asks for (None: chosen later), and its other warp tiles."""
    tile = site.tile
    # A warp tile larger than the block's (a size smaller than its partition) is clipped, as tiles are.
    warp_tiles = {axis: min(size, tile[axis]) for axis, size in warp_tiles.items()}
    warp_rows = warp_tiles.pop(row, None)
    if warp_rows is not None and (warp_rows % MMA_M or tile[row] % warp_rows or tile[row] // warp_rows > MAX_WARPS):
        raise _Refuse(f"warp tiles of {warp_rows} rows do not split the {row} tile of {tile[row]} into at most {MAX_WARPS} warps of whole fragments")
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


def _fragments(site: _Site, row: str, loaded: set) -> dict[str, Fragment]:
    """Register fragments: everything computed at the compute level, each a tile of rows by at
    most one other axis of whole 16-column fragment pairs."""
    fragments: dict[str, Fragment] = {}
    for (lvl, name), buffer in site.launch.buffers.items():
        if lvl != site.level or name in loaded:
            continue
        axes = site.wide(buffer.axes)
        if row not in axes or len(axes) > 2:
            raise _Refuse(f"{name}[{' '.join(buffer.axes)}] is not a tile of {row} rows by at most one other axis")
        col = next((a for a in axes if a != row), None)
        if col is not None and site.tile[col] % (2 * MMA_N):
            raise _Refuse(f"the {col} tile of {name} ({site.tile[col]}) is not a multiple of {2 * MMA_N}")
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


def _operand_refusal(site: _Site, name: str, role: str, loaded: set, row: str | None = None) -> str | None:
    """Why array ``name`` cannot be a contraction's ``role`` operand read by ldmatrix from a
    swizzled shared tile."""
    array = site.diagram.arrays[name]
    tile, sizes = site.tile, site.sizes
    if name not in loaded:
        return f"{role} operand {name} is not loaded into shared memory"
    if array.dtype not in TENSOR_DTYPES + FP8_DTYPES:
        return f"{name} is {array.dtype}; tensor cores here take {', '.join(TENSOR_DTYPES + FP8_DTYPES)}"
    axes = site.wide(array.axes)
    if len(axes) != 2 or array.axes[-1] != axes[-1]:
        return f"{name} is not a two-dimensional tile whose fastest axis is its last"
    if role == "A" and array.dtype in FP8_DTYPES and row is not None and axes[1] == row:
        # ldmatrix .trans moves 16-bit values (before sm_100): it cannot transpose bytes, and the
        # m16n8k32 A fragment holds 4 consecutive k of one row in a register.
        return f"A operand {name} is {array.dtype} stored with {row} fastest; an fp8 A is read by ldmatrix, which needs k fastest"
    if not SwizzledTile.supports(tile[axes[1]], DTYPE_BYTES[array.dtype]):
        return (f"{name}'s tile rows ({tile[axes[1]]} values of {axes[1]}, "
                f"{tile[axes[1]] * DTYPE_BYTES[array.dtype]} bytes) are not 32, 64 or a multiple of 128 bytes: no swizzle covers them")
    if sizes[axes[1]] % (16 // DTYPE_BYTES[array.dtype]):
        return (f"{name}'s rows in memory ({axes[1]} = {sizes[axes[1]]}) are not a multiple of 16 bytes: "
                f"cp.async copies 16-byte units")
    return None


def _contraction_axes(site: _Site, s, row: str):
    """(A, B, k, n) of contraction ``s`` as ``out[row, n] = A[row, k] B[k, n]``, or a refusal."""
    reads_ = s.box.operands
    if len(reads_) != 2:
        # A factor over the output's axes alone has left the product already (a post-scale,
        # check.py): each one left carries a contracted axis, so none can be applied after it.
        held = ", ".join(f"{r.array}[{' '.join(r.axes)}]" for r in reads_)
        raise _Refuse(f"{s.target} contracts {len(reads_)} operands, each over a contracted axis ({held}); mma takes two "
                      f"(a factor leaves the product, to scale its result, only where its axes are all axes of {s.target})")
    contracted = site.wide(s.box.contracted)
    if len(contracted) != 1:
        raise _Refuse(f"{s.target} contracts {len(contracted)} tiled axes; mma contracts one")
    k = contracted[0]
    step = max(mma_k(site.diagram.arrays[r.array].dtype) for r in reads_ if r.array in site.diagram.arrays)
    if site.tile[k] % step:
        raise _Refuse(f"the contracted {k} tile ({site.tile[k]}) is not a multiple of {step}")
    with_row = [r for r in reads_ if row in r.axes]
    if len(with_row) != 1:
        raise _Refuse(f"{s.target}: exactly one operand must carry {row}")
    a, b = with_row[0], next(r for r in reads_ if r is not with_row[0])
    out = site.wide(s.axes)
    n = next((x for x in out if x != row), None)
    if n is None or set(site.wide(b.axes)) != {k, n} or set(site.wide(a.axes)) != {row, k}:
        raise _Refuse(f"{s.target} is not (rows x {k}) times ({k} x columns)")
    return a, b, k, n


def _products(site: _Site, row: str, fragments: dict, loaded: set, stream: str | None) -> tuple[dict, dict, str]:
    """The contractions as mma.sync products: (shared operands by array, in the order they are
    first read, B before A; mma by statement target; the one operand dtype they run in)."""
    operands: dict[str, Operand] = {}
    mmas: dict[str, Mma] = {}
    dtypes = set()

    def operand(name: str, role: str) -> Operand:
        _refuse_if(_operand_refusal(site, name, role, loaded, row))
        array = site.diagram.arrays[name]
        axes = site.wide(array.axes)
        found = Operand(name, axes[0], axes[1], stream is not None and stream in array.axes)
        operands[name] = found
        return found

    for s in site.contractions:
        a, b, k, n = _contraction_axes(site, s, row)
        b_tile = operand(b.array, "B")
        if a.array in fragments:
            if fragments[a.array].col != k:
                raise _Refuse(f"{a.array} in registers is not laid out along {k}")
            a_trans, a_regs = False, True
        else:
            a_tile = operand(a.array, "A")
            a_trans, a_regs = a_tile.cols == row, False
            dtypes.add(site.diagram.arrays[a.array].dtype)
        dtype = site.diagram.arrays[b.array].dtype
        dtypes.add(dtype)
        mmas[s.target] = Mma(a.array, a_regs, a_trans, b.array, b_tile.rows == k, k, n, dtype)
    if len(dtypes) != 1:
        raise _Refuse(f"contractions mix {' and '.join(sorted(dtypes))} operands")
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
                raise _Refuse(f"{s.target} reduces along {' '.join(reduced)}, not along the columns of a row")
        for r in _reads(s):
            if r.array in plain and not set(site.wide(diagram.arrays[r.array].axes)) <= set(site.wide(s.iteration_axes)):
                raise _Refuse(f"{s.target} reads {r.array} across axes it does not iterate")
    return tuple(plain)


def _warp_tiles_refusal(row: str, split: str | None, warp_tiles: dict) -> str | None:
    """Warp tiles the relabelling asks for beyond the rows split a column axis warps may split."""
    if not warp_tiles or (split is not None and set(warp_tiles) == {split}):
        return None
    axis = next(iter(warp_tiles))
    return (f"warp tiles split {row}{f' and {split}' if split else ''} here, not {axis}"
            + ("" if split else ": a row reduction or a fragment fed to mma needs whole rows in one warp"))


def _budget_refusal(plan: TensorPlan, launch: LaunchProgram, tile: dict, budget: int, path: str | None) -> str | None:
    """Fragments one thread would hold at once over ``budget``: napkin's (what its printer compiles
    without spills), or for a what-if path the register file's."""
    held = live_fragment_values(plan, launch, tile)
    if held <= budget:
        return None
    what = (f"budget {budget}" if path is None
            else f"the register file's {MAX_REGISTERS} registers per thread")
    return (f"a thread would hold {held} fragment registers at once with {plan.warp_rows}-row warp tiles "
            f"({what}); use smaller tiles")


# Warpgroups a wgmma block holds at most: 4 x 128 threads, half the 1024 a block may have, and as
# many as the SM's 4 sub-partitions keep one warp of each on.
WGMMA_MAX_GROUPS = 4


def _wgmma_statements_refusal(plan: TensorPlan, statements) -> str | None:
    """Why the wgmma printer does not take a launch's statements, or None: it takes the two
    contractions of an online softmax (attention: the softmax packs P into the second's register
    A), or contractions whose operands both come from shared memory followed by elementwise maps
    of their accumulators (matmul; mlp's bias and GELU; swiglu's dual GEMM G, U sharing X's tiles,
    then silu(G) * U), which run on the D fragments as on mma.sync's C fragments."""
    if any(isinstance(s.box, Softmax) for s in statements):
        return None if len(plan.mmas) == 2 else "wgmma takes an online softmax's two contractions (attention), no more"
    others = [s for s in statements if s.target not in plan.mmas]
    if not all(isinstance(s.box, Map) for s in others):
        kinds = sorted({type(s.box).__name__.lower() for s in others if not isinstance(s.box, Map)})
        return (f"wgmma is built for contractions and elementwise maps of their results, or for attention's two: "
                f"this launch also has a {', a '.join(kinds)}")
    last_product = max(s.index for s in statements if s.target in plan.mmas)
    if any(s.index < last_product for s in others) or any(m.a_in_registers for m in plan.mmas.values()):
        return "wgmma reads A from registers only as attention's P: a map computed before a contraction stays on mma.sync"
    return None


def _wgmma_plan(plan: TensorPlan, launch: LaunchProgram, tile: dict, sizes: dict, warp_tiles: dict) -> TensorPlan:
    """The mma.sync ``plan`` of a launch rebuilt on ``wgmma.mma_async.m64nNk16`` (sm_90a), or a
    refusal naming what napkin's wgmma printer (``backends/wgmma.py``) does not take: 64 to 256
    rows (1 to ``WGMMA_MAX_GROUPS`` warpgroups of 64; each of their warps holds 16 rows of every
    N-wide accumulator, as mma.sync's 16-row warps do), and each contraction ``out[row, n] (+)= A[row, k]
    B[k, n]`` with N a multiple of 8 up to 256 and the k chunk a multiple of 16, B in shared memory
    (by descriptor, in the canonical swizzled layouts of ``layouts.CanonicalTile``) and A there too
    or in registers (a fragment laid out along k: P of attention, packed to the operands' type as
    the register A fragment, which is mma.sync's m16n8k16 A fragment per warp). The launch's
    statements are the online softmax's two contractions (attention, its GQA and log-sum-exp
    forms) or contractions followed by elementwise maps (:func:`_wgmma_statements_refusal`): the
    register level's other steps (softmax, maxima, sums, an epilogue) run on the D fragments as on
    mma.sync's C."""
    statements = launch.launch.statements
    copied: list[str] = []
    if plan.dtype in FP8_DTYPES:
        # wgmma's 8-bit shape has no transpose immediates: both shared operands K-major. An A from
        # registers (attention's P) is packed to bytes and exchanged within each quad into the
        # ISA's key order (backends/wgmma.py, register_a8), so its B (V) is read as stored; a
        # streamed B stored n-fastest under it (V [.. x d]) is copied K-major each chunk.
        for mma in plan.mmas.values():
            if mma.a_in_registers and mma.b_trans and plan.operands[mma.b].streamed:
                copied.append(mma.b)
                continue
            transposed = [name for name, t in ((mma.a, mma.a_trans), (mma.b, mma.b_trans)) if t]
            if transposed:
                raise _Refuse(f"wgmma's 8-bit shape (m64nNk32) reads its operands K-major only: {', '.join(transposed)} has "
                              f"{mma.k} outside its fastest axis (store it with {mma.k} last, [.. {mma.k}]; napkin transposes "
                              "only a streamed B under a register A in the kernel)")
    if split_loop(launch) is not None:  # backends/wgmma.py saves no part state: mma.sync's printer does
        raise _Refuse("a split's parts launch: the wgmma epilogue that saves its part states is not written")
    if warp_tiles:
        raise _Refuse(f"a relabelling asks for warp tiles ({', '.join(warp_tiles)}): they are mma.sync's")
    _refuse_if(_wgmma_statements_refusal(plan, statements))
    if tile[plan.row] % WGMMA_M or tile[plan.row] > WGMMA_MAX_GROUPS * WGMMA_M:
        raise _Refuse(f"the {plan.row} tile ({tile[plan.row]}) is not 1 to {WGMMA_MAX_GROUPS} warpgroups of {WGMMA_M} rows")
    shapes = {}
    for target, mma in plan.mmas.items():
        n = tile[mma.n]
        if n % 8 or n > WGMMA_MAX_N:
            raise _Refuse(f"the {mma.n} tile ({n}) of {target} is not a multiple of 8 up to {WGMMA_MAX_N} (m64nNk16)")
        k = wgmma_k(mma.dtype)
        if tile[mma.k] % k:
            raise _Refuse(f"the contracted {mma.k} tile ({tile[mma.k]}) is not a multiple of {k}")
        for name in (mma.b,) if mma.a_in_registers else (mma.a, mma.b):
            op = plan.operands[name]
            eb = DTYPE_BYTES[launch.schedule.diagram.arrays[name].dtype]
            if not CanonicalTile.supports(tile[op.cols], eb):
                raise _Refuse(f"{name}'s tile rows ({tile[op.cols] * eb} bytes) are not 32, 64 or a multiple of 128: no wgmma swizzle atom covers them")
            if name in copied and not (CanonicalTile.supports(tile[op.rows], eb) and tile[op.rows] % 4 == 0 and tile[op.cols] % 4 == 0):
                raise _Refuse(f"{name}'s K-major copy has rows of {tile[op.rows] * eb} bytes: not 32, 64 or a multiple of 128, "
                              "or not whole 4 x 4 blocks of bytes")
        if plan.fragments[target].col != mma.n:
            raise _Refuse(f"{target} is not laid out along {mma.n}")
        shapes[target] = f"m{WGMMA_M}n{n}k{k}"
    rows = tile[plan.row]
    built = replace(plan, warp_rows=MMA_M, split=None, col_tile=0, warp_cols=0, instruction="wgmma",
                    shape=", ".join(dict.fromkeys(shapes.values())), shapes=shapes, row_tile=rows, transposed=tuple(copied))
    # each warp of a warpgroup holds N/2 f32 of a 64 x N accumulator: mma.sync's 16-row warp tiles
    _refuse_if(_budget_refusal(built, launch, tile, FRAGMENT_BUDGET, None))
    try:
        return replace(built, tma=_tma_loads(built, launch, tile, sizes))
    except _Refuse as refusal:
        return replace(built, tma_declined=str(refusal))


def _tma_loads(plan: TensorPlan, launch: LaunchProgram, tile: dict, sizes: dict) -> tuple:
    """The TMA copies of a wgmma plan's shared-memory operands, or a refusal (cp.async stays)
    naming what napkin's TMA copies do not take. A streamed operand fills the stream's ring of
    stages (masked streams too: a chunk the mask skips is neither filled nor waited for); one
    that is not (attention's Q) is one copy before the stream, on its own mbarrier. Each is an
    array of 2 to 5 axes in memory (a tensor map's rank is at most 5), its tile's columns its
    innermost axis, its tile's rows at most 256 (a box dimension's limit), every other axis a
    block tile of 1 (the box's extent there: one (b, h) or one head group), and its rows in
    memory a multiple of 16 bytes (the strides of a tensor map's dimensions above the first)."""
    if plan.stream is None:
        raise _Refuse("no streamed axis: TMA is built for the stream's ring of stages")
    if plan.stages < 2:
        raise _Refuse(f"{plan.stages} stage: the TMA ring needs at least 2")
    level = launch.schedule.compute_level
    streams = [lp for _, loops in walk(launch.body) for lp in loops if lp.kind == "stream" and lp.level == level]
    if len({id(lp) for lp in streams}) > 1:
        raise _Refuse("more than one streamed loop: the TMA ring's phases are built for one")
    diagram = launch.schedule.diagram
    loads = []
    for name, op in plan.operands.items():
        array = diagram.arrays[name]
        eb = DTYPE_BYTES[array.dtype]
        if not 2 <= len(array.axes) <= MAX_TMA_RANK:
            raise _Refuse(f"{name} has {len(array.axes)} axes in memory: a tensor map has 1 to {MAX_TMA_RANK}")
        if array.axes[-1] != op.cols:
            raise _Refuse(f"{name}'s tile columns ({op.cols}) are not its innermost axis in memory")
        wide = [a for a in array.axes if a not in (op.rows, op.cols) and tile.get(a, sizes[a]) != 1]
        if wide:
            raise _Refuse(f"{name}'s block tile is more than 1 along {', '.join(wide)}: a TMA box is its rows x columns")
        if tile[op.rows] > MAX_TMA_BOX:
            raise _Refuse(f"{name}'s tile has {tile[op.rows]} rows: a TMA box dimension is at most {MAX_TMA_BOX}")
        if sizes[op.cols] * eb % 16:
            raise _Refuse(f"{name}'s rows in memory ({sizes[op.cols] * eb} bytes) are not a multiple of 16: a tensor map's stride must be")
        canonical = CanonicalTile(tile[op.rows], tile[op.cols], eb)
        (first, *rest) = canonical.tma_boxes()
        loads.append(TmaLoad(name, op.rows, op.cols, first.rows, first.cols, 1 + len(rest), canonical.tma_swizzle, eb,
                             array.axes, op.streamed))
    return tuple(loads)


def _column_split(statements, fragments: dict, mmas: dict, stream: str | None) -> str | None:
    """The column axis warps may split too: one shared by every 2-D fragment, along which nothing
    reduces (softmax, max, sum need a whole row in one warp's quads) and which no fragment
    carries into an mma as its A operand (P's columns are the next product's k)."""
    cols = {f.col for f in fragments.values() if f.col is not None}
    if len(cols) != 1 or any(isinstance(s.box, (Reduce, Softmax)) for s in statements):
        return None
    if any(m.a_in_registers for m in mmas.values()):
        return None
    col = cols.pop()
    return None if col == stream else col


def _grid(row, col, tile, warp_rows, warp_cols, launch, budget, *rest) -> TensorPlan:
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
            plan = TensorPlan(row, tile[row], r, *rest, split=col, col_tile=tile[col], warp_cols=c)
            if plan.warps > MAX_WARPS or live_fragment_values(plan, launch, tile) > budget:
                continue
            # B gathered by byte loads (an fp8 [k n] B) costs each warp row an instruction a
            # byte where ldmatrix moves 16 a lane: weighted double, the grid shares it over more
            # m-tiles (fp8_matmul: 64 x 32 warp tiles, tensor-bound in SASS, not 32 x 64, issue-bound)
            gathered = 2 if gather_registers(plan, tile) else 1
            traffic = tile[row] * plan.col_warps + tile[col] * plan.row_warps * gathered
            candidates.append((plan.warps < 4, traffic, -plan.warps, plan))
    if not candidates:
        raise _Refuse(f"no warp grid of whole fragments splits the {tile[row]} x {tile[col]} tile of {row} x {col} "
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
                   stages: int | None = None) -> ProgramSelection:
    """Instruction selection as one pass: the :class:`Selection` of every launch of ``program``
    for ``arch`` (default: its hardware profile's), with its tiles, shared-memory layout and FMA
    register accumulators. ``path`` prices a what-if instruction path (:func:`select`); ``stages``
    sets every streamed tensor-core launch's cp.async stages (:func:`stage_count`). The model,
    the printers, the NumPy counts and the kernel header read the result; none asks again."""
    arch = arch or program.hardware.arch
    return ProgramSelection(arch, path, {launch.index: _select_launch(program, launch, arch, path, stages)
                                         for launch in program.launches})


def selection(program: Program, launch: LaunchProgram, arch: str | None = None, path: str | None = None) -> Selection:
    """The :class:`Selection` of one launch, decided afresh (as :func:`select_program` decides it):
    for a look at one launch, where no pass result is at hand."""
    return _select_launch(program, launch, arch or program.hardware.arch, path)


def _select_launch(program: Program, launch: LaunchProgram, arch: str | None, path: str | None,
                   stages: int | None = None) -> Selection:
    bound = launch_tiles(launch)
    tile, sizes = bound if bound is not None else (None, None)
    warp_tiles = warp_tiles_of(launch)
    if arch is None:
        chosen = Selection(None, "the hardware profile names no architecture")
    elif bound is None:
        chosen = Selection(None, "sizes are symbolic")
    else:
        chosen = select(launch, arch, tile, sizes, warp_tiles=warp_tiles, path=path)
    if chosen.plan is not None:
        chosen = replace(chosen, plan=replace(chosen.plan, stages=stage_count(chosen.plan, launch, tile, program.diagram, arch, stages)))
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
    """The mbarriers a TMA plan keeps after its tiles: one a stage of the ring, one a one-shot copy."""
    return plan.stages + sum(1 for load in plan.tma if not load.streamed) if plan.tma else 0


def kmajor_name(name: str) -> str:
    """The slot of operand ``name``'s K-major copy (``TensorPlan.transposed``): no array's name."""
    return f"{name}.kmajor"


def slot_array(slot: str) -> str:
    """The array a shared-memory slot holds: its own name, or a K-major copy's operand."""
    return slot.removesuffix(".kmajor")


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
    for name, op in plan.operands.items():
        array = diagram.arrays[name]
        canonical = plan.shape != ""  # wgmma's canonical layouts, each on its swizzle's period
        swizzled = (CanonicalTile if canonical else SwizzledTile)(tile[op.rows], tile[op.cols], DTYPE_BYTES[array.dtype])
        stages = plan.stages if op.streamed else 1
        align = swizzled.alignment if canonical else 128
        offset = -(-offset // align) * align
        slots[name] = SmemSlot(name, offset, swizzled.bytes, stages, swizzled)
        offset += swizzled.bytes * stages
    # A wgmma plan's K-major copies (plan.transposed): rows and columns swapped, one stage.
    for name in plan.transposed:
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
    if plan.tma:
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


def stage_count(plan: TensorPlan, launch: LaunchProgram, tile: dict, diagram, arch: str, stages: int | None = None) -> int:
    """The cp.async stages of a built mma.sync plan that streams: ``stages`` where asked for (the
    tuner's and the user's knob, at least 2), else enough chunks in flight to cover a copy's
    latency, ``1 + ceil(COPY_LATENCY_CLOCKS / chunk_clocks)`` between 3 and ``MAX_STAGES`` (at
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
    if plan.instruction != BUILT_INSTRUCTION or plan.shape:
        return plan.stages
    clocks = chunk_clocks(plan, launch, tile, arch)
    if clocks is None or clocks <= 0:
        return plan.stages
    wanted = STAGES if clocks >= COPY_LATENCY_CLOCKS else min(MAX_STAGES, max(3, 1 + -(-COPY_LATENCY_CLOCKS // int(clocks))))
    hardware = launch.schedule.hardware
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


def fragment_values(plan: TensorPlan, name: str, tile: dict) -> int:
    """Registers (4-byte values) one thread holds for a register-resident array."""
    fragment = plan.fragments[name]
    if fragment.col is None:
        return plan.m_tiles * 2  # rows g and g + 8 of each 16-row fragment
    return plan.m_tiles * (plan.cols_per_warp(fragment.col, tile) // MMA_N) * 4


def live_fragment_values(plan: TensorPlan, launch: LaunchProgram, tile: dict) -> int:
    """The most fragment registers one thread holds at any step: the Program's columns at the
    compute level (an input read for the last time is released as the output is produced),
    restricted to the arrays the plan keeps in registers."""
    level = launch.schedule.compute_level
    sequence, spans = liveness(launch.body)
    most = 0
    for index in range(len(sequence)):
        held = 0
        for (lvl, name), (first, last) in spans.items():
            if lvl != level or name not in plan.fragments or not first <= index <= last:
                continue
            if released_by(sequence, spans, (lvl, name), index):
                continue
            held += fragment_values(plan, name, tile)
        most = max(most, held)
    return most + gather_registers(plan, tile)


# Where the profile's fp8 mma.sync path ``converts`` (no 8-bit mma.sync in SASS: ptxas converts
# each operand pair to f16, F2FP.F16.E4M3.UNPACK_B, and issues two HMMA.16816; sm_90, read in
# tests/test_fp8_tensorcore.py) and P is packed in registers as well (attention's PV), the
# conversions hold about this many registers more: measured on fp8 attention at d = 128, where
# sm_89 compiles to 215 registers and sm_90 spills 340 bytes at 255; at d = 64 sm_90 takes 243.
CONVERTED_FP8_REGISTERS = 32


def _converted_fp8_refusal(plan: TensorPlan, launch: LaunchProgram, tile: dict, budget: int, arch: str) -> str | None:
    if plan.dtype not in FP8_DTYPES:
        return None
    found = launch.schedule.hardware.find_path("mma.sync", plan.dtype, arch, mma_shape(plan.dtype))
    if found is None or not found.converts:
        return None
    if not any(m.a_in_registers for m in plan.mmas.values()):
        return None
    held = live_fragment_values(plan, launch, tile) + CONVERTED_FP8_REGISTERS
    if held <= budget:
        return None
    return (f"{arch} has no 8-bit mma.sync: ptxas converts the fp8 operands to f16, and with P packed in "
            f"registers a thread would hold {held} fragment registers (budget {budget}); use smaller tiles")


# Registers the byte loads of an fp8 B stored n-fastest ([k n]: tensorcore.mma_fp8) take beyond
# the fragments: the bytes ptxas keeps in flight and their per-lane offsets. Measured on
# fp8_matmul (sm_90, 128 x 128 block, k chunk 64): warp tiles holding 128 accumulators spill
# (64 x 64: 176 bytes, 128 x 32: 192 bytes, at 255 registers) where the bf16 kernel takes ~210
# registers; tiles holding 64 compile with none (32 x 64: 211 registers, 64 x 32: 219). Counted
# with the fragments, the warp grid avoids the tiles that spill.
GATHER_REGISTERS = 48


def gather_registers(plan: TensorPlan, tile: dict) -> int:
    """:data:`GATHER_REGISTERS` where a product of the plan gathers an fp8 B by byte loads, or
    exchanges an fp8 register A within quads (P with V stored k-fastest: the packed words and the
    shuffled halves in flight; measured on examples/fp8_attention_vt.napkin at d = 128, sm_90,
    which spills 436 bytes at 255 registers where the gather's build spills 340), else 0."""
    gathers = any(m.dtype in FP8_DTYPES and (m.b_trans or m.a_in_registers) for m in plan.mmas.values())
    return GATHER_REGISTERS if gathers else 0


def describe(selection_: Selection, launch: LaunchProgram) -> list[str]:
    """One line per statement of the launch: the instruction path it runs on, and why."""
    plan = selection_.plan
    if plan is None:
        return [f"{s.target}: fma ({selection_.reason})" for s in launch.launch.statements]
    lines = [f"not wgmma: {selection_.declined}"] if selection_.declined else []
    for s in launch.launch.statements:
        mma = plan.mmas.get(s.target)
        if mma is None:
            lines.append(f"{s.target}: fma on {plan.row} x {plan.fragments[s.target].col or '1'} fragments in registers")
            continue
        a = f"{mma.a} from registers (packed to {mma.dtype})" if mma.a_in_registers else f"{mma.a} by ldmatrix{'.trans' if mma.a_trans else ''}"
        if plan.shape:
            major = lambda trans: "MN-major" if trans else "K-major"
            a_from = (f"A = {mma.a} from registers (packed to {mma.dtype})" if mma.a_in_registers
                      else f"A = {mma.a} by descriptor ({major(mma.a_trans)})")
            lines.append(f"{s.target}: wgmma.mma_async.{plan.shapes.get(s.target, plan.shape)} {mma.dtype} -> f32, {a_from}, "
                         f"B = {mma.b} by descriptor ({major(mma.b_trans)}), staged by "
                         + (f"TMA ({plan.stages}-stage mbarrier ring)" if plan.tma else f"cp.async (not TMA: {plan.tma_declined})"))
            continue
        if plan.instruction == "wgmma":
            lines.append(f"{s.target}: wgmma (priced, not built) {mma.dtype} -> f32, A = {mma.a} from "
                         f"{'registers' if mma.a_in_registers else 'shared memory'}, B = {mma.b} from shared memory")
            continue
        if mma.dtype in FP8_DTYPES:  # byte loads for an n-contiguous B (backends/tensorcore.py, mma_fp8)
            b = f"{mma.b} by {'byte loads, 4 k a register' if mma.b_trans else 'ldmatrix'}"
            lines.append(f"{s.target}: mma.sync.{mma_shape(mma.dtype)} {mma.dtype} -> f32, A = {a}, B = {b}")
            continue
        lines.append(f"{s.target}: mma.sync.m16n8k16 {mma.dtype} -> f32, A = {a}, B = {mma.b} by ldmatrix{'.trans' if mma.b_trans else ''}")
    return lines


def plan_summary(plan: TensorPlan) -> str:
    """The register level in one line: warp tiles, warps, pipeline stages."""
    streamed = [name for name, op in plan.operands.items() if op.streamed]
    copier = "TMA" if plan.tma else "cp.async"
    pipeline = f"; {copier} {plan.stages} stages for {', '.join(streamed)}" if streamed else "; cp.async, 1 stage"
    once = [load.array for load in plan.tma if not load.streamed]
    if once:  # copied once before the stream, each on its own mbarrier
        pipeline += f"; {', '.join(once)} by one TMA copy"
    tiles = f"group {plan.row} {plan.warp_rows}" + (f", {plan.split} {plan.warp_cols}" if plan.split else "")
    shape = f"{plan.warp_rows} {plan.row}" + (f" x {plan.warp_cols} {plan.split}" if plan.split else " rows")
    return f"registers: {tiles} ({plan.warps} warps of {shape}){pipeline}"


def warp_line(plan: TensorPlan) -> str:
    """The register level as a line of pseudocode: a parallel loop over the block's warps."""
    held = ", ".join(plan.fragments)
    shape = f"{plan.warp_rows} {plan.row}" + (f" x {plan.warp_cols} {plan.split}" if plan.split else " rows")
    if plan.shape:
        return (f"parallel for warpgroup in {plan.warps // 4} warpgroups of {4 * plan.warp_rows} {plan.row} @registers:"
                f"  # wgmma {plan.shape}; {held} in registers")
    return (f"parallel for warp in {plan.warps} warps of {shape} @registers:"
            f"  # mma.sync m16n8k16; {held} in registers")


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
