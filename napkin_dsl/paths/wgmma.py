"""The wgmma path (sm_90a): a warpgroup's asynchronous ``wgmma.mma_async.m64nNk16`` products
(``m64nNk32`` for 8-bit operands), B (and A, or A from registers) by matrix descriptor from the
canonical swizzled tiles of ``layouts.CanonicalTile``, staged by TMA into a ring of mbarriers where
:func:`tma_loads` takes the operands; printed by ``backends/wgmma.py``, which emulates the
instruction, the descriptors and the tensor maps on OpenCL. Its rates are the profile's
``[path.*]`` tables with ``instruction = "wgmma"``, for the architectures they list itself
(``sm_90a``: on ``sm_90`` wgmma is a what-if, priced on mma.sync's layout and not built).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..diagram import Map, Softmax
from ..dtypes import DTYPE_BYTES, FP8_DTYPES
from ..layouts import MMA_M, WARPGROUP_THREADS, WGMMA_M, WGMMA_MAX_N, CanonicalTile, wgmma_k
from ..pseudocode import LaunchProgram, Loop, split_loop, walk
from .plan import (FRAGMENT_BUDGET, Mma, Refusal, TensorPath, TensorPlan, WarpGrid, budget_refusal, fitting_tile_hint, live_fragment_values,
                   refuse_if)


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


# setmaxnreg (PTX ISA 9.7.17.1): a warpgroup's registers a thread, a multiple of 8 in 24 .. 256.
# The producer issues TMA from one thread and keeps FlashAttention-3's 24; the consumers share
# what the register file leaves, at most 240 (FlashAttention-3's with two consumer warpgroups).
PRODUCER_REGISTERS = 24
CONSUMER_REGISTERS = 240
REGISTER_FILE = 65536  # 32-bit registers of an SM's file: the block's, at one block an SM


@dataclass(frozen=True)
class Roles:
    """A warp-specialized schedule of a wgmma plan's stream (CUTLASS's ``PipelineTmaAsync``,
    FlashAttention-3's producer warp), printed by ``backends/pipeline.py``:

    * a producer warpgroup gives up registers (``setmaxnreg.dec`` to ``producer_registers``) and
      one of its threads fills the ring: for each chunk it waits on the stage's empty mbarrier,
      arrives on its full mbarrier with ``expect_tx`` of the chunk's bytes and issues the TMA
      copies, whose ``complete_tx`` completes it;
    * ``consumers`` warpgroups take the registers (``setmaxnreg.inc`` to ``consumer_registers``);
      each waits on a stage's full mbarrier, issues its products and commits them, waits until at
      most ``wait_depth`` of its groups are in flight, and then releases the stage the earlier
      product read (one arrival a warpgroup on its empty mbarrier). No block-wide barrier runs
      inside the loop. The products in ``drained`` are waited to depth 0 instead
      (:func:`drained_products`: a later step of the chunk reads them, as the softmax reads S).

    The ring's stages are the plan's ``stages`` (isel.ring_stages), with a full and an empty
    mbarrier each."""

    consumers: int
    wait_depth: int = 1
    drained: tuple = ()
    # Plain tiles the consumers load each chunk (fp8's per-key scales sK), between two barriers
    # among the consumers: no warp overwrites the previous chunk's while another still reads them.
    vectors: tuple = ()
    producer_registers: int = PRODUCER_REGISTERS
    consumer_registers: int = CONSUMER_REGISTERS
    # The consumers' order of a chunk's products (:data:`CONSUMER_ORDERS`): "serial", or
    # "pipelined", FlashAttention-3's intra-warpgroup pipeline (:func:`pipeline_parts`).
    order: str = "serial"
    # FlashAttention-3's pingpong (:func:`pingpong_refusal`): the consumer warpgroups take turns
    # issuing their products, ordered by named barriers (:data:`PINGPONG_BARRIERS`).
    pingpong: bool = False

    @property
    def threads(self) -> int:
        return WARPGROUP_THREADS * (self.consumers + 1)

    @property
    def schedule(self) -> str:
        """The warpgroup schedule built, as ``hardware.OVERLAPS`` names it."""
        return "+".join(["pingpong"] * self.pingpong + ["pipelined"] * (self.order == "pipelined")) or "serial"


# How a consumer warpgroup orders a chunk's products (issue 48). "serial": each chunk's steps in
# the Program's order, a product a later step reads waited to depth 0 at once. "pipelined"
# (FlashAttention-3's intra-warpgroup pipelining, its algorithm 2): chunk c's first product (S)
# is issued, then chunk c - 1's last (O += P V), and the softmax of chunk c is ordered while the
# latter may be on the tensor cores (ptxas runs its row maximum there: napkin_dsl/chain.py).
CONSUMER_ORDERS = ("serial", "pipelined")
# The schedules napkin builds (hardware.OVERLAPS's names): an order, with or without pingpong.
SCHEDULES = ("serial", "pipelined", "pingpong", "pingpong+pipelined")
# Named barriers of pingpong (PTX ISA 9.7.13.1, bar.sync and bar.arrive, ids 0 .. 15): consumer
# warpgroup w waits on 2 + w before it issues its products and arrives on the next one's (w + 1
# modulo the consumers: the other of two, FlashAttention-3's WarpSchedulerWG1 .. 3 of three)
# after; id 1 is the consumers' own barrier (a plain tile's load, a staged save) and 0 the block's.
PINGPONG_BARRIERS = (2, 3, 4, 5)
# The fragment registers a consumer thread may hold, by its setmaxnreg registers R: what ptxas
# compiled without spills in sm_90a builds of attention at b4 h32 8k, by schedule (fragments
# held, R: spilled bytes; tests/test_pipelined.py, test_three_consumers.py and test_fp8_issue.py
# hold the edges):
#   serial:    182 at 240: 0 (fp8, 128 x 128, d128), 166: 0 (bf16 128 x 192, d128; 128 x 256,
#              d64), 158: 0 (128 x 176, d128); at 160 (three consumer warpgroups) 102: 0
#              (192 x 128, d64), 118: 0 (192 x 96, d128) and 88 (192 x 160, d64), 134: 304
#              (192 x 192, d64); at 120 (four) 70: 0, 102: 1168
#   pipelined: 190 at 240: 0 (128 x 160, d128), 202: 104 (128 x 176); at 160 134: 0 (192 x 128,
#              d64), 142: 80 (192 x 96, d128), 158: 404; at 120 86: 0, 134: spills
# Neither is R less a constant, nor a share of R: serial keeps 58 spare at 240 but needs more than
# 42 at 160. Serial takes the most measured at 240 and 2/3 of R below it; pipelined 21/25 (201
# of 240, 134 of 160). A synchronous ring of at most two warpgroups (up to 255 registers, fp8
# attention's copy of V [x d]: 182 at 128 x 128, d128, 0 spills) takes serial's budget at 240.
SERIAL_BUDGET = 182  # at CONSUMER_REGISTERS
SERIAL_SHARE = (2, 3)  # below it
PIPELINED_SHARE = (21, 25)


@dataclass(frozen=True)
class PipelineParts:
    """A stream chunk's top-level steps in the pipelined order (:func:`pipeline_parts`): each
    step's part, by its index in the chunk's body.

    * ``ahead``: the loads before it and the product issued ahead (S(c));
    * ``behind``: the product issued a chunk late (P(c - 1) V(c - 1)), from a register A the
      previous chunk's softmax computed, and the loads that only it reads;
    * ``softmax``: the steps between them that do not touch ``behind``'s accumulator, run while
      it is on the tensor cores;
    * ``rescale``: those that do (O *= the chunk's scale), in the next chunk, after the
      previous ``behind`` has landed and before this chunk's is issued."""

    ahead: str
    behind: str
    parts: tuple[str, ...]
    packed_registers: int  # the register A (P(c - 1), packed) a thread holds across the softmax


def pipeline_parts(plan: TensorPlan, launch: LaunchProgram, tile: dict) -> PipelineParts:
    """The pipelined order of a roles plan's chunk, or a refusal naming what it does not take:
    the chunk's steps are two products, the first waited to depth 0 (a later step reads it, as
    the softmax reads S) and the second last, reading a register A (attention's P); the steps
    between them that rescale the second's accumulator read nothing the others write after
    them; no plain tile is loaded each chunk; and the registers of the packed A, held across the
    next chunk's softmax, fit :data:`FRAGMENT_BUDGET` with the fragments."""
    node = stream_loop(launch, plan.stream)
    if node is None:
        raise Refusal("no streamed loop: the pipeline orders a stream's chunks")
    if any(isinstance(st, Loop) for st in node.body):
        raise Refusal("the chunk holds a loop of its own: the pipeline orders a chunk of steps")
    if chunk_vectors(plan, launch):
        raise Refusal("a plain tile loaded each chunk (fp8's per-key scales) sits between the consumers' barriers, "
                      "which the pipeline does not order yet")
    level = launch.schedule.compute_level
    body = list(node.body)
    products = [i for i, st in enumerate(body) if st.level == level and is_product(plan, st)]
    if len(products) != 2:
        raise Refusal(f"the chunk has {len(products)} products: the pipeline issues one ahead of the softmax and one behind it")
    first, second = products
    ahead, behind = body[first].statement.target, body[second].statement.target
    if not plan.mmas[behind].a_in_registers:
        raise Refusal(f"{behind}'s product reads no register A: nothing computed between the products feeds it")
    if any(st.level == level and st.op != "load" for st in body[second + 1:]):
        raise Refusal(f"a step follows {behind}'s product in the chunk: it would read the product in flight")
    if any(st.op != "load" for st in body[:first]):
        raise Refusal(f"a step comes before {ahead}'s product in the chunk")
    accumulator = {name for _, name in body[second].writes}
    parts = []
    for i, st in enumerate(body):
        if i <= first:
            parts.append("ahead")
        elif i >= second or (st.op == "load" and not any((st.level, st.array) in later.reads for later in body[first + 1:second])):
            parts.append("behind")
        elif {name for _, name in st.writes} & accumulator:
            parts.append("rescale")
        else:
            parts.append("softmax")
    rescales = [i for i, part in enumerate(parts) if part == "rescale"]
    for i in rescales:  # a rescale moves after every softmax step: none after it may write what it reads
        reads = {name for _, name in body[i].reads}
        later = [st for j, st in enumerate(body) if j > i and parts[j] == "softmax" and {name for _, name in st.writes} & reads]
        if later:
            raise Refusal(f"{body[i].statement.target}'s rescale reads what a later step writes: it cannot wait for {behind}")
    if any(parts[j] == "softmax" and {name for _, name in body[j].reads} & accumulator for j in range(len(body))):
        raise Refusal(f"a step between the products reads {behind}'s accumulator, which is in flight under it")
    m = plan.mmas[behind]
    per_register = 4 if m.dtype in FP8_DTYPES else 2
    packed = -(-tile[m.k] * plan.warp_rows // (32 * per_register))
    held = live_fragment_values(plan, launch, tile) + packed
    budget = pipelined_budget(plan)
    if held > budget:
        raise Refusal(f"a thread would hold {held} fragment registers at once with {m.a} of the previous chunk packed beside "
                      f"{ahead} ({packed} of them; budget {budget}): use a smaller {m.k} tile or the serial order")
    return PipelineParts(ahead, behind, tuple(parts), packed)


def consumer_budget(roles: "Roles | None", share: tuple[int, int] = SERIAL_SHARE) -> int:
    """Fragment registers a consumer thread may hold: in the serial order :data:`SERIAL_BUDGET` at
    :data:`CONSUMER_REGISTERS` and :data:`SERIAL_SHARE` of fewer setmaxnreg registers; pipelined
    :data:`PIPELINED_SHARE` of them; :data:`FRAGMENT_BUDGET` without roles."""
    if roles is None:
        return FRAGMENT_BUDGET
    if share == SERIAL_SHARE and roles.consumer_registers >= CONSUMER_REGISTERS:
        return SERIAL_BUDGET
    return roles.consumer_registers * share[0] // share[1]


def ring_budget(plan: TensorPlan) -> int:
    """Fragment registers a thread of the synchronous ring (no roles) may hold: with at most two
    warpgroups a thread may have 255 registers, and takes serial's budget at 240 (fp8
    attention's 128 x 128 tile with its copy of V, measured); more warpgroups,
    :data:`FRAGMENT_BUDGET`."""
    return SERIAL_BUDGET if plan.row_tile <= 2 * WGMMA_M else FRAGMENT_BUDGET


def pipelined_budget(plan: TensorPlan) -> int:
    """Fragment registers a pipelined consumer thread may hold (:data:`PIPELINED_SHARE`)."""
    return consumer_budget(getattr(plan, "roles", None), PIPELINED_SHARE)


def pingpong_refusal(plan: "WgmmaPlan", launch: LaunchProgram) -> str | None:
    """Why the consumers cannot take turns (FlashAttention-3's pingpong), or None: pingpong passes
    the tensor cores around two or more consumer warpgroups (each the next its turn, the last
    the first), and what it overlaps is one's softmax with the others' products, so a product a
    later step of the chunk reads (``Roles.drained``: attention's S) must exist; a plain tile
    loaded each chunk keeps its own barrier among the consumers (fp8's scales), which is not
    ordered with the turns yet."""
    roles = plan.roles
    if roles.consumers < 2:
        return f"pingpong takes turns among two or more consumer warpgroups: this tile has {roles.consumers}"
    if not roles.drained:
        return "no step of the chunk reads a product: there is no softmax to run under the other warpgroups' products"
    if roles.vectors:
        return f"{', '.join(roles.vectors)}, loaded each chunk between the consumers' barriers, is not ordered with pingpong's yet"
    staged = [mma.a for mma in plan.mmas.values() if mma.staged]
    if staged:
        return f"{', '.join(staged)}, staged each chunk between the consumers' barriers, is not ordered with pingpong's yet"
    return None


def scheduled_roles(plan: "WgmmaPlan", launch: LaunchProgram, tile: dict, schedule: str) -> tuple["WgmmaPlan", str]:
    """The plan with its consumers in ``schedule`` (:data:`SCHEDULES`), as far as it applies, and
    why a part of it does not ("" where all does): the pipelined order (:func:`pipeline_parts`)
    and pingpong (:func:`pingpong_refusal`) are each taken where they fit."""
    if schedule not in SCHEDULES:
        raise AssertionError(f"napkin bug: no schedule {schedule!r} (the schedules: {', '.join(SCHEDULES)})")
    parts = schedule.split("+")
    if plan.roles is None:
        if schedule == "serial":
            return plan, ""
        return plan, f"not {schedule}: no producer and consumer warpgroups ({plan.roles_declined})"
    order, pingpong, declined = "serial", False, []
    if "pipelined" in parts:
        try:
            pipeline_parts(plan, launch, tile)
            order = "pipelined"
        except Refusal as refusal:
            declined.append(f"not pipelined: {refusal}")
    if "pingpong" in parts:
        reason = pingpong_refusal(plan, launch)
        if reason is None:
            pingpong = True
        else:
            declined.append(f"not pingpong: {reason}")
    return replace(plan, roles=replace(plan.roles, order=order, pingpong=pingpong)), "; ".join(declined)


def roles_of(plan: "WgmmaPlan", launch: LaunchProgram) -> Roles:
    """The warp-specialized schedule of a wgmma plan with a TMA ring, or a refusal naming what the
    roles printer does not take yet (its next step: the K-major copy of an 8-bit B stored
    n-fastest, fp8 attention's V [.. x d])."""
    if not plan.tma:
        raise Refusal(f"no TMA ring ({plan.tma_declined})")
    if plan.transposed:
        raise Refusal("a K-major copy each chunk (8-bit B stored n-fastest) keeps the synchronous ring: its roles are not written")
    consumers = plan.row_tile // WGMMA_M
    share = (REGISTER_FILE - WARPGROUP_THREADS * PRODUCER_REGISTERS) // (WARPGROUP_THREADS * consumers)
    return Roles(consumers, drained=drained_products(plan, launch), vectors=chunk_vectors(plan, launch),
                 consumer_registers=min(CONSUMER_REGISTERS, share // 8 * 8))


def chunk_vectors(plan: TensorPlan, launch: LaunchProgram) -> tuple[str, ...]:
    """The plain (row-major) tiles loaded inside the stream's chunk: vectors along the streamed
    axis, such as fp8 attention's per-key scales, which every warp reads."""
    node = stream_loop(launch, plan.stream)
    if node is None:
        return ()
    level = launch.schedule.compute_level
    return tuple(dict.fromkeys(s.array for s, _ in walk(node.body) if s.op == "load" and s.level == level
                               and s.array in plan.plain and s.array not in plan.operands))


def stream_loop(launch: LaunchProgram, axis: str | None):
    """The launch's loop streaming ``axis`` at its compute level (the ring's), or None."""
    level = launch.schedule.compute_level
    return next((lp for _, loops in walk(launch.body) for lp in loops
                 if lp.kind == "stream" and lp.level == level and lp.axis == axis), None)


def is_product(plan: TensorPlan, st) -> bool:
    """Whether step ``st`` is one of the plan's products (not the scalar factor applied to an
    accumulator in place, ``S *= d^-0.5``)."""
    return (st.statement is not None and st.statement.target in plan.mmas and st.op in ("compute", "accumulate")
            and not (st.op == "compute" and (st.level, st.statement.target) in st.reads))


def drained_products(plan: TensorPlan, launch: LaunchProgram) -> tuple[str, ...]:
    """The products of the stream's chunk that a warp-specialized consumer waits to depth 0: those
    whose accumulator a later step of the chunk reads (the softmax reads S), and those whose
    accumulator a step before them reads with no such product before it (it would read the
    previous chunk's product in flight); a later product that packs one as its register A reads it too. The others (matmul's, attention's O += P V) leave the
    wait depth in flight. In the chunk's order."""
    node = stream_loop(launch, plan.stream)
    if node is None:
        return tuple(plan.mmas)
    level = launch.schedule.compute_level
    # (a save reads too: dQ's add into device memory, a step with no statement)
    steps = [st for st, _ in walk(node.body) if st.level == level and st.op != "load"]
    products = [i for i, st in enumerate(steps) if is_product(plan, st)]
    drained: list[str] = []
    for i in products:
        written = {name for _, name in steps[i].writes}
        # a step reading it, or a product packing it as its register A (dK = S Q with S's own fragment)
        readers = [j for j, st in enumerate(steps) if written & {name for _, name in st.reads}
                   and (j not in products or plan.mmas[st.statement.target].a_in_registers)]
        early = [j for j in readers if j < i]
        covered = not early or any(k < min(early) and steps[k].statement.target in drained for k in products)
        if any(j > i for j in readers) or not covered:
            drained.append(steps[i].statement.target)
    return tuple(dict.fromkeys(drained))


@dataclass(frozen=True)
class WgmmaPlan(TensorPlan):
    """A plan napkin builds on wgmma: 16-row warp tiles, four warps a warpgroup of 64 rows."""

    INSTRUCTION = "wgmma"

    instruction: str = "wgmma"
    # The instruction's shape, ``m64n128k16`` (the products' shapes joined).
    shape: str = ""
    # TMA copies (``TmaLoad`` per operand, the stream's ring of ``stages`` stages behind
    # mbarriers); () where the operands go by cp.async, and why (``tma_declined``).
    tma: tuple = ()
    tma_declined: str = ""
    # The shape per product (statement target -> "m64n64k16"); ``shape`` joins them.
    shapes: dict = field(default_factory=dict)
    # Operands copied into a K-major tile of their own each chunk (the 8-bit shape reads its shared
    # operands K-major only: attention's V stored [.. x d] under an fp8 P, a GEMM's B [k n] or A
    # [k m]; backends/wgmma.py's transpose); their slots are isel.smem_layout's "<name>.kmajor".
    transposed: tuple = ()
    # A producer warpgroup and consumer warpgroups around a ring of full and empty mbarriers
    # (``Roles``), or None and why not (``roles_declined``): the synchronous ring.
    roles: Roles | None = None
    roles_declined: str = ""
    # Why the consumers do not take (all of) the schedule asked for (scheduled_roles)
    order_declined: str = ""

    @property
    def threads(self) -> int:
        return self.roles.threads if self.roles is not None else 32 * self.warps


# Warpgroups a wgmma block holds at most: 4 x 128 threads, half the 1024 a block may have, and as
# many as the SM's 4 sub-partitions keep one warp of each on.
WGMMA_MAX_GROUPS = 4


def swapped_products(plan: TensorPlan, launch: LaunchProgram, tile: dict) -> TensorPlan:
    """The plan with each staged product (``Mma.staged``: dQ = dS^T K, whose rows are the queries,
    in the key launch) computed as its transpose, as FlashAttention-3 computes dQ: dQ^T[n, rows] =
    B^T[n, k] staged^T[k, rows]. Its n axis (d) is the warpgroups' rows, 64 each, so that its tile
    must be the plan's row tile; its own rows (the query chunk) are the instruction's N; B (K,
    read as A' by descriptor, MN-major where it is stored n-fastest) and the staged fragment (dS,
    written to a canonical tile of its own, MN-major, read as B' by descriptor) are contracted over
    the plan's row axis. Its grid (``TensorPlan.grids``) is the warps' 16-row tiles of n by the
    whole chunk, and its fragment is laid out along the chunk. Or a refusal naming what wgmma does
    not take."""
    grids, fragments = dict(plan.grids), dict(plan.fragments)
    for target, mma in plan.mmas.items():
        if not mma.staged:
            continue
        statement = next(s for s in launch.launch.statements if s.target == target)
        (rows,) = [a for a in statement.axes if a != mma.n and tile.get(a, 1) > 1]  # isel._staged_products' rows
        if tile[mma.n] != tile[plan.row]:
            raise Refusal(f"{target}'s rows are not {plan.row}, and its {mma.n} tile ({tile[mma.n]}) is not the {plan.row} "
                          f"tile ({tile[plan.row]}): wgmma computes it transposed, {mma.n} on the warpgroups' "
                          f"{tile[plan.row] // WGMMA_M} x {WGMMA_M} rows")
        eb = DTYPE_BYTES[mma.dtype]
        if not CanonicalTile.supports(tile[rows], eb):
            raise Refusal(f"{mma.a} is staged for wgmma in rows of {tile[rows] * eb} bytes ({rows}): not 32, 64 or a "
                          f"multiple of 128, which no swizzle atom covers")
        if mma.dtype in FP8_DTYPES:
            raise Refusal(f"{target} is an 8-bit product staged through shared memory: the 8-bit shape reads its operands "
                          f"K-major only")
        grids[target] = WarpGrid(mma.n, tile[mma.n], MMA_M, rows, tile[rows], tile[rows])
        fragments[target] = replace(fragments[target], col=rows)
    return replace(plan, grids=grids, fragments=fragments)


def statements_refusal(plan: TensorPlan, statements) -> str | None:
    """Why the wgmma printer does not take a launch's statements, or None: it takes the two
    contractions of an online softmax (attention: the softmax packs P into the second's register
    A), or contractions and elementwise maps of their accumulators, which run on the D fragments
    as on mma.sync's C fragments: after the last (matmul; mlp's bias and GELU; swiglu's dual GEMM
    G, U sharing X's tiles, then silu(G) * U) or between them, a map read by a later product as its
    register A (the backward's key launch: P = exp(S - L) into dV, dS = P * (dP - D) into dK;
    dQ's launch: dS into dQ), each product's register A an array of its own."""
    if any(isinstance(s.box, Softmax) for s in statements):
        return None if len(plan.mmas) == 2 else "wgmma takes an online softmax's two contractions (attention), no more"
    others = [s for s in statements if s.target not in plan.mmas]
    if not all(isinstance(s.box, Map) for s in others):
        kinds = sorted({type(s.box).__name__.lower() for s in others if not isinstance(s.box, Map)})
        return (f"wgmma is built for contractions and elementwise maps of their results, or for attention's two: "
                f"this launch also has a {', a '.join(kinds)}")
    return None


def _transposed_copies(plan: TensorPlan) -> list[str]:
    """The shared operands the 8-bit shape copies K-major each chunk, or a refusal: wgmma's 8-bit
    shape has no transpose immediates, so both shared operands are read K-major. A streamed
    operand stored MN-major (a GEMM's B [k n] or A [k m], V [.. x d] under attention's P) is
    copied into a K-major tile of its own each chunk. An A from registers (attention's P) is
    packed to bytes and exchanged within each quad into the ISA's key order (backends/wgmma.py,
    register_a8), so it needs no copy."""
    copied: list[str] = []
    for mma in plan.mmas.values():
        shared = ((mma.b, mma.b_trans),) if mma.a_in_registers else ((mma.a, mma.a_trans), (mma.b, mma.b_trans))
        for name, trans in shared:
            if not trans:
                continue
            if not plan.operands[name].streamed:
                raise Refusal(f"wgmma's 8-bit shape (m64nNk32) reads its operands K-major only: {name} has {mma.k} "
                              f"outside its fastest axis and is not streamed (napkin copies an operand K-major a chunk "
                              f"of the stream at a time; store it with {mma.k} last, [.. {mma.k}], or stream {mma.k})")
            copied.append(name)
    return list(dict.fromkeys(copied))


def tma_loads(plan: TensorPlan, launch: LaunchProgram, tile: dict, sizes: dict) -> tuple:
    """The TMA copies of a wgmma plan's shared-memory operands, or a refusal (cp.async stays)
    naming what napkin's TMA copies do not take. A streamed operand fills the stream's ring of
    stages (masked streams too: a chunk the mask skips is neither filled nor waited for); one
    that is not (attention's Q) is one copy before the stream, on its own mbarrier. Each is an
    array of 2 to 5 axes in memory (a tensor map's rank is at most 5), its tile's columns its
    innermost axis, its tile's rows at most 256 (a box dimension's limit), every other axis a
    block tile of 1 (the box's extent there: one (b, h) or one head group), and its rows in
    memory a multiple of 16 bytes (the strides of a tensor map's dimensions above the first)."""
    if plan.stream is None:
        raise Refusal("no streamed axis: TMA is built for the stream's ring of stages")
    if plan.stages < 2:
        raise Refusal(f"{plan.stages} stage: the TMA ring needs at least 2")
    level = launch.schedule.compute_level
    streams = [lp for _, loops in walk(launch.body) for lp in loops if lp.kind == "stream" and lp.level == level]
    if len({id(lp) for lp in streams}) > 1:
        raise Refusal("more than one streamed loop: the TMA ring's phases are built for one")
    diagram = launch.schedule.diagram
    loads = []
    for name, op in plan.operands.items():
        array = diagram.arrays[name]
        eb = DTYPE_BYTES[array.dtype]
        if not 2 <= len(array.axes) <= MAX_TMA_RANK:
            raise Refusal(f"{name} has {len(array.axes)} axes in memory: a tensor map has 1 to {MAX_TMA_RANK}")
        if array.axes[-1] != op.cols:
            raise Refusal(f"{name}'s tile columns ({op.cols}) are not its innermost axis in memory")
        wide = [a for a in array.axes if a not in (op.rows, op.cols) and tile.get(a, sizes[a]) != 1]
        if wide:
            raise Refusal(f"{name}'s block tile is more than 1 along {', '.join(wide)}: a TMA box is its rows x columns")
        if tile[op.rows] > MAX_TMA_BOX:
            raise Refusal(f"{name}'s tile has {tile[op.rows]} rows: a TMA box dimension is at most {MAX_TMA_BOX}")
        if sizes[op.cols] * eb % 16:
            raise Refusal(f"{name}'s rows in memory ({sizes[op.cols] * eb} bytes) are not a multiple of 16: a tensor map's stride must be")
        canonical = CanonicalTile(tile[op.rows], tile[op.cols], eb)
        (first, *rest) = canonical.tma_boxes()
        loads.append(TmaLoad(name, op.rows, op.cols, first.rows, first.cols, 1 + len(rest), canonical.tma_swizzle, eb,
                             array.axes, op.streamed))
    return tuple(loads)


class WgmmaPath(TensorPath):
    instruction = "wgmma"
    plan_type = WgmmaPlan

    def build(self, plan, launch, tile, sizes, warp_tiles, arch) -> WgmmaPlan:
        """The mma.sync ``plan`` of a launch rebuilt on ``wgmma.mma_async.m64nNk16`` (sm_90a), or a
        refusal naming what napkin's wgmma printer (``backends/wgmma.py``) does not take: 64 to 256
        rows (1 to ``WGMMA_MAX_GROUPS`` warpgroups of 64; each of their warps holds 16 rows of every
        N-wide accumulator, as mma.sync's 16-row warps do), and each contraction ``out[row, n] (+)= A[row, k]
        B[k, n]`` with N a multiple of 8 up to 256 and the k chunk a multiple of 16, B in shared memory
        (by descriptor, in the canonical swizzled layouts of ``layouts.CanonicalTile``) and A there too
        or in registers (a fragment laid out along k: P of attention, packed to the operands' type as
        the register A fragment, which is mma.sync's m16n8k16 A fragment per warp). The launch's
        statements are the online softmax's two contractions (attention, its GQA and log-sum-exp
        forms) or contractions followed by elementwise maps (:func:`statements_refusal`): the
        register level's other steps (softmax, maxima, sums, an epilogue) run on the D fragments as on
        mma.sync's C."""
        statements = launch.launch.statements
        indexed = next((op for op in plan.operands.values() if op.indexed), None)
        if indexed is not None:  # backends/wgmma.py fills its tiles by TMA or cp.async of whole rows only
            raise Refusal(f"{indexed.array} is an implicit GEMM's operand, a sub-tile a tap copied through its window, which "
                          f"mma.sync's printer builds: wgmma's tiles are copied whole")
        plan = swapped_products(plan, launch, tile)
        copied = _transposed_copies(plan) if plan.dtype in FP8_DTYPES else []
        if split_loop(launch) is not None:  # backends/wgmma.py saves no part state: mma.sync's printer does
            raise Refusal("a split's parts launch: the wgmma epilogue that saves its part states is not written")
        if warp_tiles:
            raise Refusal(f"a relabelling asks for warp tiles ({', '.join(warp_tiles)}): they are mma.sync's")
        refuse_if(statements_refusal(plan, statements))
        if tile[plan.row] % WGMMA_M or tile[plan.row] > WGMMA_MAX_GROUPS * WGMMA_M:
            raise Refusal(f"the {plan.row} tile ({tile[plan.row]}) is not 1 to {WGMMA_MAX_GROUPS} warpgroups of {WGMMA_M} rows")
        shapes = {target: self._shape(plan, launch, tile, target, mma, copied) for target, mma in plan.mmas.items()}
        common = plan.common_fields() | dict(warp_rows=MMA_M, split=None, col_tile=0, warp_cols=0, instruction="wgmma",
                                              row_tile=tile[plan.row])
        built = WgmmaPlan(**common, shape=", ".join(dict.fromkeys(shapes.values())), shapes=shapes, transposed=tuple(copied))
        try:
            built = replace(built, tma=tma_loads(built, launch, tile, sizes))
        except Refusal as refusal:
            built = replace(built, tma_declined=str(refusal))
        try:
            roles = roles_of(built, launch)
        except Refusal as refusal:
            # each warp of a warpgroup holds N/2 f32 of a 64 x N accumulator: mma.sync's 16-row warp tiles
            refuse_if(budget_refusal(built, launch, tile, ring_budget(built), None))
            return replace(built, roles_declined=str(refusal))
        # the consumers' share of the registers setmaxnreg gives them
        held, budget = live_fragment_values(built, launch, tile), consumer_budget(roles)
        if held > budget:
            raise Refusal(f"a thread would hold {held} fragment registers at once, where {roles.consumers} consumer "
                          f"warpgroups take {roles.consumer_registers} registers each (budget {budget}); use a "
                          f"smaller {plan.stream or plan.row} tile{fitting_tile_hint(built, launch, tile, budget)}")
        return replace(built, roles=roles)

    @staticmethod
    def _shape(plan, launch, tile: dict, target: str, mma: Mma, copied: list[str]) -> str:
        """The instruction shape of one product, or a refusal: N, k and the operands' tiles."""
        n_axis = plan.staged_rows(target) if plan.swapped(target) else mma.n
        n = tile[n_axis]
        if n % 8 or n > WGMMA_MAX_N:
            raise Refusal(f"the {n_axis} tile ({n}) of {target} is not a multiple of 8 up to {WGMMA_MAX_N} (m64nNk16)")
        k = wgmma_k(mma.dtype)
        if tile[mma.k] % k:
            raise Refusal(f"the contracted {mma.k} tile ({tile[mma.k]}) is not a multiple of {k}")
        if plan.swapped(target):  # A' = B by descriptor, B' = the staged tile (checked by swapped_products)
            return f"m{WGMMA_M}n{n}k{k}"
        for name in (mma.b,) if mma.a_in_registers else (mma.a, mma.b):
            op = plan.operands[name]
            eb = DTYPE_BYTES[launch.schedule.diagram.arrays[name].dtype]
            if not CanonicalTile.supports(tile[op.cols], eb):
                raise Refusal(f"{name}'s tile rows ({tile[op.cols] * eb} bytes) are not 32, 64 or a multiple of 128: no wgmma swizzle atom covers them")
            if name in copied and not (CanonicalTile.supports(tile[op.rows], eb) and tile[op.rows] % 4 == 0 and tile[op.cols] % 4 == 0):
                raise Refusal(f"{name}'s K-major copy has rows of {tile[op.rows] * eb} bytes: not 32, 64 or a multiple of 128, "
                              "or not whole 4 x 4 blocks of bytes")
        if plan.fragments[target].col != mma.n:
            raise Refusal(f"{target} is not laid out along {mma.n}")
        return f"m{WGMMA_M}n{n}k{k}"

    def product_line(self, plan, target: str, mma: Mma) -> str:
        def major(trans):
            return "MN-major" if trans else "K-major"

        if plan.swapped(target):
            operands = (f"as its transpose: A = {mma.b} by descriptor ({major(mma.b_trans)}), B = {mma.a} written to "
                        f"shared memory by descriptor (MN-major)")
        else:
            a_from = (f"A = {mma.a} from registers (packed to {mma.dtype})" if mma.a_in_registers
                      else f"A = {mma.a} by descriptor ({major(mma.a_trans)})")
            operands = f"{a_from}, B = {mma.b} by descriptor ({major(mma.b_trans)})"
        return (f"{target}: wgmma.mma_async.{plan.shapes.get(target, plan.shape)} {mma.dtype} -> f32, {operands}, staged by "
                + (f"TMA ({plan.stages}-stage mbarrier ring)" if plan.tma else f"cp.async (not TMA: {plan.tma_declined})"))

    def warp_line(self, plan) -> str:
        held = ", ".join(plan.fragments)
        roles = plan.roles
        if roles is not None:
            return (f"parallel for warpgroup in {roles.consumers} consumer warpgroups of {4 * plan.warp_rows} {plan.row} @registers:"
                    f"  # wgmma {plan.shape}; {held} in registers; a producer warpgroup fills the {plan.stages}-stage ring")
        return (f"parallel for warpgroup in {plan.warps // 4} warpgroups of {4 * plan.warp_rows} {plan.row} @registers:"
                f"  # wgmma {plan.shape}; {held} in registers")

    def schedule_lines(self, plan) -> list[str]:
        """The roles, or (for a TMA ring) why the ring is synchronous."""
        roles = plan.roles
        if roles is None:
            return [f"synchronous ring, no producer warpgroup: {plan.roles_declined}"] if plan.tma else []
        order = (", pipelined: a chunk's first product issued before the previous chunk's last, which runs under its softmax"
                 if roles.order == "pipelined" else "")
        if roles.pingpong:
            ids = [str(i) for i in PINGPONG_BARRIERS[:roles.consumers]]
            who = ("the two consumer warpgroups" if roles.consumers == 2
                   else f"the {roles.consumers} consumer warpgroups, each after the one before,")
            order += (f", pingpong: {who} take turns issuing their products (named barriers "
                      f"{', '.join(ids[:-1])} and {ids[-1]})")
        return [(f"roles: a producer warpgroup (setmaxnreg.dec {roles.producer_registers}; one thread issues TMA) and "
                f"{roles.consumers} consumer warpgroup{'s' if roles.consumers > 1 else ''} (setmaxnreg.inc "
                f"{roles.consumer_registers}), a {plan.stages}-stage ring of full and empty mbarriers, "
                f"wgmma.wait_group {roles.wait_depth}{order}")]


WGMMA = WgmmaPath()
