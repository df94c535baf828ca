"""What every tensor-core instruction path shares: the plan's common fields, its refusals, the
interface a path module implements, and the register budget its fragments are held to.

A **plan** (:class:`TensorPlan`) says how one launch runs on tensor cores: the row axis and its
warp tiles, the shared-memory operands, the register fragments and the products. Each path
module (``mma_sync.py``, ``wgmma.py``) subclasses it with the fields only that path has, so that a
consumer dispatches on the plan's type instead of asking a field whether the plan is of a path.

A **path** (:class:`TensorPath`) is one instruction family: the instruction a profile's
``[path.*]`` tables name it by, whether the profile offers it on an architecture, its legality
(``build``: the plan on this path, or a :class:`Refusal` saying why not), and the lines that
describe its products. Instruction selection (``isel.py``) asks the paths in order
(``paths.PATHS``) and takes the first that accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

from ..dtypes import FP8_DTYPES
from ..layouts import MMA_K, MMA_K8, MMA_M, MMA_N
from ..pseudocode import LaunchProgram, liveness, released_by, walk

TENSOR_DTYPES = ("bf16", "f16")
MAX_WARPS = 8
WARPGROUP = 4  # warps of one wgmma
# Fragment registers one thread may hold at once; the rest of the 255 hold addresses, operand
# fragments and temporaries (an FA2-class attention loop at d = 128 compiles to ~184 with ~100 here).
FRAGMENT_BUDGET = 160
MAX_REGISTERS = 255  # registers one thread may have (the register level's capacity, 1020 bytes)
STAGES = 2  # cp.async buffers per streamed operand: the next chunk is in flight while this one is used


class Refusal(Exception):
    """Why a launch does not take a path: its text is the reason the kernel header prints."""


def refuse_if(reason: str | None) -> None:
    if reason is not None:
        raise Refusal(reason)


@dataclass(frozen=True)
class Operand:
    """A shared-memory tile a contraction reads with ldmatrix: ``rows`` x ``cols`` (fastest).

    An implicit GEMM's operand (a convolution's window read, or its weights) holds one such
    swizzled sub-tile per value of its ``taps``, the contracted axes beside k the tile holds whole
    (a 3 x 3 window's i and j), one after another in the order of the taps. Such an operand (and a
    window read's, whose elements come from its parameter at the window's indices, with the pad
    value outside it: ``lowering.view_element``) is ``indexed``: copied 16 bytes at a time by
    cp.async, each unit's address through the taps and the window, where a unit of a sub-tile's
    row is 16 contiguous bytes in memory (a channels-last convolution's); else ``gathered``,
    element by element (``tensorcore.TensorPrinter.gather``)."""

    array: str
    rows: str
    cols: str
    streamed: bool
    taps: tuple = ()
    gathered: bool = False
    indexed: bool = False


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
    # An implicit GEMM's further contracted axes, held whole in both operands' tiles: the product
    # runs over k once per value of the taps, each on its own sub-tile (Operand.taps)
    taps: tuple = ()
    # A is a register fragment over (the plan's row, this product's rows), written to a shared tile
    # of its own (staged_slot) and read back k-major by ldmatrix .trans: a product whose rows are
    # not the plan's, which contracts the plan's row axis (FlashAttention-2's dQ = dS^T K in the
    # launch grouped over keys). Its output is laid out on a warp grid of its own (TensorPlan.grids).
    staged: bool = False

    @property
    def contracted(self) -> tuple:
        """Every contracted axis the product runs over: k, then the taps."""
        return (self.k, *self.taps)


def staged_slot(name: str) -> str:
    """The shared-memory slot a staged product's A fragment ``name`` is written to (``Mma.staged``)."""
    return f"{name}.staged"


@dataclass(frozen=True)
class WarpGrid:
    """How the block's warps split the output tile of a staged product (``Mma.staged``), whose rows
    are not the plan's row axis: ``rows`` x ``cols`` in warp tiles of ``warp_rows`` x ``warp_cols``,
    every warp of the block holding one."""

    rows: str
    row_tile: int
    warp_rows: int
    cols: str
    col_tile: int
    warp_cols: int


@dataclass(frozen=True)
class TensorPlan:
    """The fields every path's plan has. A path's plan type adds its own (:class:`TensorPath`)."""

    # The instruction the plan's path builds, as the profiles name it; a plan whose ``instruction``
    # is another is a what-if, priced as that instruction and not built (:attr:`built`).
    INSTRUCTION: ClassVar[str] = ""

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
    # The tensor-core instruction the model prices the plan as (the profile's [path.*] tables
    # name it): its path's own, or for a what-if another (an mma.sync plan priced as "wgmma":
    # four warps share one read of the B tile from shared memory).
    instruction: str = "mma.sync"
    grids: dict = field(default_factory=dict)  # a staged product's target -> its WarpGrid (Mma.staged)

    def laid_out(self, name: str) -> TensorPlan:
        """The plan as fragment ``name`` is laid out: this one, or for a staged product's output
        the same plan with its grid's rows and column split (one warp grid, the fields the
        fragment loops and the ldmatrix counts read)."""
        grid = self.grids.get(name)
        if grid is None:
            return self
        return replace(self, row=grid.rows, row_tile=grid.row_tile, warp_rows=grid.warp_rows, split=grid.cols,
                       col_tile=grid.col_tile, warp_cols=grid.warp_cols)

    def swapped(self, target: str) -> bool:
        """Whether staged product ``target`` (``Mma.staged``) is computed as its transpose: its
        grid's rows are its n axis, its columns its own rows (wgmma's dQ^T = K^T dS^T in the key
        launch, as FlashAttention-3 computes it: the consumers' 64-row warpgroups split d, and the
        staged dS is B, read by descriptor)."""
        grid = self.grids.get(target)
        return grid is not None and grid.rows == self.mmas[target].n

    def staged_rows(self, target: str) -> str:
        """Staged product ``target``'s own row axis (the queries of dQ = dS^T K): its grid's rows,
        or its columns where it is computed :meth:`swapped`."""
        grid = self.grids[target]
        return grid.cols if self.swapped(target) else grid.rows

    @property
    def built(self) -> bool:
        """Whether the printers build this plan: it is priced as its own path's instruction."""
        return self.instruction == self.INSTRUCTION

    def common_fields(self) -> dict:
        """The fields of :class:`TensorPlan` (not a path's own), to build another path's plan from."""
        return {f.name: getattr(self, f.name) for f in fields(TensorPlan)}

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


class TensorPath:
    """One tensor-core instruction family. A path module defines a subclass and one instance of
    it; ``paths.PATHS`` lists the instances in the order selection asks them."""

    instruction: str = ""  # as the profiles' [path.*] tables name it
    plan_type: type = TensorPlan

    def offered(self, hardware, arch: str, dtype: str) -> bool:
        """Whether ``hardware``'s profile builds this path for ``dtype`` operands on ``arch``."""
        found = hardware.find_path(self.instruction, dtype, arch)
        return found is not None and arch in found.archs

    def build(self, plan, launch: LaunchProgram, tile: dict, sizes: dict, warp_tiles: dict, arch: str) -> TensorPlan:
        """The launch's plan on this path, from the mma.sync-laid-out ``plan`` instruction
        selection analysed it into (``isel._plan``), or a :class:`Refusal`."""
        raise NotImplementedError(f"the {self.instruction} path builds no plan")

    def product_line(self, plan, target: str, mma: Mma) -> str:
        """The kernel header's line for the product computing ``target``."""
        raise NotImplementedError(f"the {self.instruction} path describes no product")

    def warp_line(self, plan) -> str:
        """The register level as a line of pseudocode: a parallel loop over the block's warps."""
        raise NotImplementedError(f"the {self.instruction} path prints no register level")

    def schedule_lines(self, plan) -> list[str]:
        """The kernel header's lines for how the plan's stream is scheduled, after its products'."""
        return []


def fragment_values(plan: TensorPlan, name: str, tile: dict) -> int:
    """Registers (4-byte values) one thread holds for a register-resident array."""
    plan = plan.laid_out(name)
    fragment = plan.fragments[name]
    if fragment.col is None:
        return plan.m_tiles * 2  # rows g and g + 8 of each 16-row fragment
    return plan.m_tiles * (plan.cols_per_warp(fragment.col, tile) // MMA_N) * 4


def shared_reads(plan: TensorPlan, target: str, extent) -> int:
    """Values product ``target`` moves between shared memory and registers, ``extent(axes)`` being
    the elements a tile over ``axes`` covers: its B tile once per warp row on mma.sync (each warp
    loads its own fragments by ldmatrix), once per warpgroup on wgmma (``TensorPlan.b_readers``);
    its A tile once per warp column, unless A is a fragment already; a staged A (``Mma.staged``)
    once more, as the fragments written to its shared tile. A staged product computed as its
    transpose (:meth:`TensorPlan.swapped`, wgmma) reads its B tile once, as A' split over the
    warpgroups, and its staged tile once per warpgroup, as B'. The model and the NumPy backend
    both count this."""
    mma = plan.mmas[target]
    laid = plan.laid_out(target)
    if plan.swapped(target):  # B read as A', each warpgroup its own rows of n; the staged tile as B', by each warpgroup
        rows = plan.staged_rows(target)
        return extent((*mma.contracted, mma.n)) + extent((rows, *mma.contracted)) * (laid.b_readers + 1)
    moved = extent((*mma.contracted, mma.n)) * laid.b_readers
    if not mma.a_in_registers:
        moved += extent((laid.row, *mma.contracted)) * laid.col_warps
    if mma.staged:
        moved += extent((laid.row, *mma.contracted))
    return moved


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
    return most + gather_registers(plan, tile) + zero_mask_registers(launch)


# Registers a stream that skips the chunks adding zero (pseudocode._zero_mask) takes beyond the
# fragments: its condition is tested in every chunk it visits, an element's indices live beside
# the fragments. Measured on the causal backward's key launch at d = 128 (sm_90): with 32-query
# chunks, 160 fragment registers, it spills 28 bytes at 255 registers; with 16-query chunks, 144,
# it compiles to 251 with none (sm_80: 254). Counted, the 32-query chunk is refused by name.
ZERO_MASK_REGISTERS = 8


def zero_mask_registers(launch: LaunchProgram) -> int:
    """:data:`ZERO_MASK_REGISTERS` where a stream loop of ``launch`` skips the chunks adding zero
    (a Mask that no step tests apart: ``Mask.tested`` None), else 0."""
    masked = any(lp.mask is not None and lp.mask.tested is None for _, loops in walk(launch.body) for lp in loops)
    return ZERO_MASK_REGISTERS if masked else 0


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


def budget_refusal(plan: TensorPlan, launch: LaunchProgram, tile: dict, budget: int, path: str | None) -> str | None:
    """Fragments one thread would hold at once over ``budget``: napkin's (what its printer compiles
    without spills), or for a what-if path the register file's."""
    held = live_fragment_values(plan, launch, tile)
    if held <= budget:
        return None
    what = (f"budget {budget}" if path is None
            else f"the register file's {MAX_REGISTERS} registers per thread")
    return (f"a thread would hold {held} fragment registers at once with {plan.warp_rows}-row warp tiles "
            f"({what}); use smaller tiles{fitting_tile_hint(plan, launch, tile, budget if path is None else MAX_REGISTERS)}")


def fitting_stream_tile(plan: TensorPlan, launch: LaunchProgram, tile: dict, budget: int,
                        extra: int = 0) -> tuple[int, int] | None:
    """The largest halving of the plan's stream tile at which a thread's fragments (and ``extra``
    registers) fit ``budget``: (that tile, the registers held), or None where the plan streams
    nothing or no halving down to one instruction's k fits. Counted as the budget counts them
    (:func:`live_fragment_values`), so a refusal can name the tile that would have fitted."""
    axis = plan.stream
    if axis is None or axis not in tile:
        return None
    least = MMA_K8 if plan.dtype in FP8_DTYPES else MMA_K
    n = tile[axis]
    while n % 2 == 0 and n // 2 >= least and (n // 2) % least == 0:
        n //= 2
        held = live_fragment_values(plan, launch, dict(tile, **{axis: n})) + extra
        if held <= budget:
            return n, held
    return None


def fitting_tile_hint(plan: TensorPlan, launch: LaunchProgram, tile: dict, budget: int, extra: int = 0) -> str:
    """`` (stream x 32 would hold 150)``: the tile :func:`fitting_stream_tile` finds, or ""."""
    found = fitting_stream_tile(plan, launch, tile, budget, extra)
    return "" if found is None else f" (stream {plan.stream} {found[0]} would hold {found[1]})"
