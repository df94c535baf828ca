"""The warp-specialized wgmma lowering (sm_90a): a plan with :class:`~napkin_dsl.paths.wgmma.Roles`
-> a kernel of a producer warpgroup and consumer warpgroups around a ring of full and empty
mbarriers (issue 43), printed once as roles and rendered for CUDA and for the OpenCL roles runtime.

The roles, as CUTLASS's ``PipelineTmaAsync`` and FlashAttention-3's producer warp order them:

* the **producer** (the warpgroup after the consumers) gives up registers
  (``setmaxnreg.dec``); one of its threads, for each chunk c on stage s = c mod S, waits on
  ``empty[s]`` for the parity of the ring's previous pass (``(c / S) & 1 ^ 1``: the first pass
  does not wait), arrives on ``full[s]`` with ``expect_tx`` of the chunk's bytes, and issues the
  chunk's TMA boxes, whose ``complete_tx`` completes ``full[s]``;
* each **consumer** warpgroup takes the registers (``setmaxnreg.inc``), waits on ``full[s]`` for
  the pass's parity, issues its products and commits them, waits until at most ``wait_depth``
  of its groups are in flight (``wgmma.wait_group``), and then releases the stage the previous
  chunk's products read: one arrival a warpgroup on its ``empty`` mbarrier (initialised with
  the consumer count). After the stream it waits for every group and runs the epilogue from its
  accumulators. No block-wide barrier runs after the mbarriers are initialised: a barrier among
  the consumers (a plain operand's load, a staged save) is a named one (``bar.sync 1, threads``).

A role's code is a list of *operations*: lines of C, :class:`Wait` (a blocking point: an
mbarrier's phase, the role's wgmma groups, or both) and :class:`Loop` (the stream's chunks, with
the lines each chunk derives from its index). The CUDA rendering prints them as straight code
with real waits. The OpenCL rendering runs them on ``roles.py``'s runtime: each role is a
resumable state machine, a ``switch`` over the segments between its blocking points, inside the
runtime's uniform loop of rounds; a loop's index and the fragments are the role's state across
segments, and each segment derives the chunk's stage, parity and origin again. The consumer
warpgroups are one role of every work-item there, in lockstep, so that a segment's lane exchanges
(the emulated shuffles) and barriers meet every work-item of the work-group; the producer's
segments run on the first warpgroup's work-items in a phase of their own (it has no lane
exchange). There:

* a TMA box is queued when issued (``nk_role_tensor_copy``: its destination poisoned with 0xFF
  bytes) and lands in a round the seeded adversary draws, copied by the TMA emulation
  (``wgmma.py``'s ``nk_tma_box``, which decodes the tensor map's words) and completing the bytes
  it wrote on its barrier;
* a committed group (``nk_role_commit``) is the product's deferred work: its accumulator's values
  move to a shadow and the fragment holds NaN until the group lands, when the emulated wgmma runs
  on the shadow with the stage it was issued on (so that its reads of shared memory happen as
  late as the hardware may make them) and, with the accumulator's last group, the fragment takes
  the shadow back. A stage released before its group was waited is refilled, and poisoned,
  before the group reads it; an accumulator read before its wait reads NaN;
* a round in which no role can run and nothing is in flight is a deadlock: the run ends, and
  ``opencl.run`` names the role, the barrier and the phase it waits on.

* a register A operand (attention's P) is posted by the warp's lanes to local memory at the issue
  (``nk_asnap``), and the product reads it from there when it lands; a lane whose registers
  changed in between makes the result NaN. A one-shot copy (attention's Q) is the producer's,
  before the ring, on its own mbarrier, waited for once by the consumers.

* a masked stream (causal attention, a window) runs both roles over the chunks the block visits
  (``visited_chunks``, printed before the roles split), the ring's stages and phases counted
  from the first of them; every visited chunk is tested.

* an 8-bit register A (fp8 attention's P) is exchanged within quads on the consumers' lanes
  before it is posted, as the synchronous ring does; a plain tile loaded each chunk (fp8's
  per-key scales) sits between two barriers among the consumers (``chunk_vectors``). The
  consumers run in lockstep here, so a race between two consumer warpgroups (the first of those
  barriers dropped) is not one this emulation can show: that barrier is argued, not tested.

* the consumers pipelined (``Roles.order``, FlashAttention-3's intra-warpgroup order,
  :meth:`RolesPrinter.pipelined_chunks`): chunk c's S and chunk c - 1's P V committed as two
  groups, S waited at depth 1 and the softmax run while P V may still be in flight, P V waited
  at depth 0 and only then P packed again; the first and the last chunk peeled. A product
  printed twice shares its posted register A slots (its groups are never in flight at once).

* pingpong (``Roles.pingpong``, :meth:`RolesPrinter.turns`): the consumer warpgroups take
  turns issuing their products, a ``bar.sync`` on their own named barrier before a phase of
  issues and a ``bar.arrive`` on the next one's after it (the last's next is the first). The
  consumers run in lockstep here, so the turns are comments in the OpenCL kernel, and
  ``barriers.run_turns`` runs them (the PTX ISA's named barriers, apart from this printer)
  whenever such a kernel is printed.

Deliberately not here (issue 43's next steps): the K-major copy of fp8 attention's V [.. x d]; a
masked stream's full chunks in a loop of their own, untested; a TMA store epilogue and a
persistent tile scheduler. ``paths.wgmma.roles_of`` refuses them by name, and
they keep the synchronous ring of ``wgmma.py``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ..layouts import WARPGROUP_THREADS, wgmma_k
from ..paths.plan import staged_slot
from ..paths.wgmma import PINGPONG_BARRIERS, WgmmaPlan, pipeline_parts
from .barriers import BarrierOp, run_turns
from ..pseudocode import walk
from .lowering import KernelSource, ident
from .roles import PRELUDE as ROLES_PRELUDE
from .roles import STATUS_STORE, STATUS_WORDS
from .wgmma import WgmmaPrinter, a_registers


@dataclass
class Wait:
    """A role's blocking point: ``bar`` (an mbarrier's index in the ring, a C expression) for the
    phase of parity ``parity``, and/or until at most ``groups`` of its wgmma groups are pending."""

    bar: str | None = None
    parity: str = "0"
    groups: int | None = None
    note: str = ""
    # The accumulators known landed after it (CUDA pins their registers there), where a group is
    # left in flight: None, every accumulator (at depth 0)
    landed: tuple | None = None


@dataclass
class Loop:
    """``for (var = start; var < stop; ++var) body``, where each chunk first derives ``derived``."""

    var: str
    stop: str
    derived: list = field(default_factory=list)
    body: list = field(default_factory=list)
    start: str = "0"
    once: bool = False  # at most one trip (a peeled chunk): straight code under a test on CUDA
    # Which of the n chunks a block visits it runs: "all", or the pipelined order's "first",
    # "later" (all but the first) and "last" (barriers.run_turns's trips)
    chunks: str = "all"


@dataclass
class Bar:
    """A named barrier of pingpong (``paths.wgmma.PINGPONG_BARRIERS``): ``bar.sync`` (``kind``
    "sync") or ``bar.arrive`` on this warpgroup's barrier (``barrier`` "own") or the next
    one's ("next": warpgroup w + 1 modulo the consumers), by every consumer warpgroup or by
    ``who`` only. ``phase``: the sync that opens a phase of product issues (RolesPrinter.turns
    closes it with an arrive at the next wait). A phase of a barrier is its warpgroup's sync and
    the previous warpgroup's arrival: :data:`TURN_THREADS`."""

    kind: str
    barrier: str
    who: int | None = None
    phase: bool = False
    note: str = ""

    def barrier_id(self, warpgroup: int, consumers: int) -> int:
        return PINGPONG_BARRIERS[warpgroup if self.barrier == "own" else (warpgroup + 1) % consumers]


TURN_THREADS = 2 * WARPGROUP_THREADS  # a turn's barrier: the warpgroup taking it and the one giving it


# The runtime's roles on OpenCL (the consumer warpgroups in lockstep, one role), by index.
CONSUMERS, PRODUCER = 0, 1
ROLE_NAMES = ("consumers", "producer")
POSTED_MARK = "/* nk_asnap */"  # where the posted register A words are declared, once their count is known

_CUDA = r"""
// ---- roles (backends/pipeline.py): setmaxnreg (PTX ISA 9.7.17.1), mbarrier.arrive (9.7.13.15.13) ----
#define NK_SETMAXNREG_DEC(n) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(n))
#define NK_SETMAXNREG_INC(n) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(n))
__device__ __forceinline__ void nk_mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
#define NK_MBAR_ARRIVE(bar) nk_mbar_arrive(nk_sbase + (bar))
// a barrier among the consumer warpgroups only (PTX ISA 9.7.13.1 bar.sync a, b: b threads, id a > 0);
// bar.arrive a, b arrives without waiting (pingpong's turns)
#define NK_BAR_SYNC(id, threads) asm volatile("bar.sync %0, %1;\n" :: "n"(id), "n"(threads) : "memory")
#define NK_BAR_ARRIVE(id, threads) asm volatile("bar.arrive %0, %1;\n" :: "n"(id), "n"(threads) : "memory")
"""


def prelude(dialect: str) -> str:
    """What a translation unit with warp-specialized launches adds: on CUDA setmaxnreg and the
    consumers' arrive; on OpenCL the roles runtime and its status words."""
    return _CUDA if dialect == "cuda" else ROLES_PRELUDE + STATUS_STORE


class RolesPrinter(WgmmaPrinter):
    """Prints one launch of a :class:`~napkin_dsl.paths.wgmma.WgmmaPlan` with roles."""

    def __init__(self, program, launch, dialect, plan: WgmmaPlan):
        super().__init__(program, launch, dialect, plan)
        assert plan.roles is not None and self.tma, "napkin bug: paths.wgmma.roles_of takes this plan"
        self.roles = plan.roles
        self.consumers = plan.roles.consumers
        # The consumers' cooperative loops (a plain operand's load, a staged save) run over their
        # threads; the block has the producer's too on CUDA, and on OpenCL only the consumers'
        # work-items (the producer's segments run on the first warpgroup's, in a phase of their own).
        self.threads = self.consumers * WARPGROUP_THREADS
        self.block_threads = plan.threads if not self.opencl else self.threads
        self.ring_node = None  # the stream's loop node and its streamed operands (stream_loop)
        self.sites: list[list[str]] = []  # OpenCL: each product's deferred work, by its group's site
        self.site_operands: list[list[str]] = []  # ... and the shared tiles it reads
        self.site_registers: dict[int, tuple] = {}  # ... and its register A's posted k steps: (array, first, count)
        self.held: list[str] = []  # the accumulators the products write (their shadows, on OpenCL)
        self.drained: set[str] = set()  # products a later step of the chunk reads: waited to depth 0
        self.hoisted: list[str] = []  # register A's declarations: they live across the consumers' segments
        self.register_arrays: list[str] = []  # ... and their arrays (wgmma.a_registers), pinned after a wait to depth 0
        self.posted = 0  # OpenCL: the k steps of register A the products post (their slots in nk_asnap)
        self.post_slots: dict[str, int] = {}  # ... the first slot of each product's
        self.step_wait: Wait | None = None  # a product's wait, placed after its step's block (mma)
        self.visits = ("0", "0")  # the first and past-the-last chunk the block visits (stream_loop)
        self.preamble: list[str] = []  # what both roles read, before they split: a masked stream's bounds
        self.placed_waits = False  # the pipelined order places the products' waits itself (pipelined_chunks)

    @property
    def opencl(self) -> bool:
        return self.dialect.name == "opencl"

    def open_kernel(self, entry: str, arrays, scalars, extra=()):
        consumers, self.threads = self.threads, self.block_threads  # the launch bounds are the block's
        super().open_kernel(entry, arrays, scalars, extra)
        self.threads = consumers

    def print(self, entry: str) -> KernelSource:
        kernel = super().print(entry)
        kernel.block = self.block_threads
        kernel.roles = ROLE_NAMES
        stages = self.plan.stages
        kernel.barriers = tuple([f"full[{s}]" for s in range(stages)] + [f"empty[{s}]" for s in range(stages)]
                                + [f"{name}'s copy" for name in self.once])
        if self.opencl:  # the register A words the products post, now that their count is known
            words = max(1, self.posted * self.plan.warps * WARPGROUP_THREADS)
            kernel.text = kernel.text.replace(POSTED_MARK, f"__local uint nk_asnap[{words}];  // register A, posted at each issue")
        return kernel

    def extra_parameters(self, entry: str) -> list[str]:
        params = super().extra_parameters(entry)
        return params + ["__global int* nk_status"] if self.opencl else params

    def full(self, stage: str) -> str:
        return stage

    def empty(self, stage: str) -> str:
        return f"{self.plan.stages} + {stage}" if not stage.isdigit() else str(self.plan.stages + int(stage))

    # -- the kernel's frame
    def lane_constants(self):
        """The warpgroup's first row and the ring's mbarriers: ``full[s]`` expects the producer's
        one arrival (with its bytes), ``empty[s]`` one arrival a consumer warpgroup. On OpenCL the
        runtime's state and mbarriers, at the kernel's scope as local memory must be."""
        self.lanes = {}
        stages, w = self.plan.stages, self.consumers
        self.emit(f"const int nk_wg = nk_warp >> 2;  // this thread's warpgroup: consumers 0 .. {w - 1}, then the producer")
        self.emit("NK_DESC_BASE();  // the descriptors' start address field of the arena's base")
        counts = [1] * stages + [w] * stages + [1] * len(self.once)
        if self.opencl:
            self.emit("__local nk_rounds nk_rs;")
            self.emit(f"__local nk_mbar nk_bars[{len(counts)}];  // full[0 .. {stages}), empty[0 .. {stages}), the one-shot copies'")
            self.emit(POSTED_MARK)
            self.emit(f"const int nk_lane0 = nk_tid % {WARPGROUP_THREADS} == 0, nk_lead = nk_tid == 0;  // a warpgroup's first work-item; the role's")
            inits = " ".join(f"nk_mbar_start(nk_bars + {b}, {count});" for b, count in enumerate(counts))
            self.emit(f"if (nk_tid == 0) {{ {inits} }}")
            return
        inits = " ".join(f"NK_MBAR_INIT({self.bar(str(b))}, {count});" for b, count in enumerate(counts))
        self.emit(f"if (nk_tid == 0) {{ {inits} NK_FENCE_MBAR_INIT(); }}")
        self.emit("NK_SYNC();  // the mbarriers are initialised before any thread waits on one; no block barrier after")

    def compute(self):
        """The consumers' code (the fragments, the Program's nodes with the stream as a ring loop)
        and the producer's, as operations; then rendered for the dialect."""
        start, depth = len(self.lines), self.depth
        self.depth = 0
        self.declare_fragments()
        declared = len(self.lines)
        self.nodes(self.launch.body)
        declarations, consumer = self.lines[start:declared] + self.hoisted, self.lines[declared:]
        del self.lines[start:]
        self.depth = depth
        assert self.ring_node is not None, "napkin bug: a roles plan streams"
        if self.roles.pingpong:
            consumer = self.turns(consumer)
        producer = self.producer_ops()
        for line in self.preamble:
            self.emit(line)
        if self.opencl:
            self.rounds(declarations, consumer, producer)
            return
        w = self.consumers
        with self.block(f"if (nk_wg == {w}) {{  // the producer warpgroup: one thread fills the ring"):
            self.emit(f"NK_SETMAXNREG_DEC({self.roles.producer_registers});")
            with self.block(f"if (nk_tid == {w * WARPGROUP_THREADS}) {{"):
                self.straight(producer)
        with self.block(f"else {{  // the consumer warpgroups: rows {64} * nk_wg of the tile"):
            self.emit(f"NK_SETMAXNREG_INC({self.roles.consumer_registers});")
            for line in declarations:
                self.emit(line)
            # a barrier among the consumers is a named one: the producer does not take part
            self.straight(consumer, sync=f"NK_BAR_SYNC(1, {self.threads});")

    # -- pingpong's turns
    def turns(self, consumer: list) -> list:
        """:meth:`turn_ops`, run for every visited chunk count up to 3 (``barriers.run_turns``):
        a protocol that deadlocks or leaves arrivals is a napkin bug, raised here."""
        ops = self.turn_ops(consumer)
        for chunks in range(4):
            run_turns(turn_programs(ops, chunks, self.consumers))
        return ops

    def turn_ops(self, consumer: list) -> list:
        """The consumers' operations with pingpong's named barriers (FlashAttention-3's
        ``warp_scheduler_barrier``): a phase of product issues (the products committed between
        two waits) opens with a ``bar.sync`` on the warpgroup's own barrier and closes with a
        ``bar.arrive`` on the next one's; the last warpgroup arrives on warpgroup 0's once before
        its first, so that 0 goes first, and warpgroup 0 waits on its own once after its last,
        which takes the last one's last arrival."""

        def close(ops: list) -> list:
            out, open_ = [], False
            for op in ops:
                if isinstance(op, Bar) and op.phase:
                    if not open_:
                        out.append(op)
                        open_ = True
                    continue
                if isinstance(op, Wait) and open_:
                    out.append(Bar("arrive", "next", note="the products are issued: the next warpgroup's turn"))
                    open_ = False
                if isinstance(op, Loop):
                    op = Loop(op.var, op.stop, op.derived, close(op.body), op.start, op.once, op.chunks)
                out.append(op)
            assert not open_, "napkin bug: a phase of product issues with no wait after it"
            return out

        last = self.consumers - 1
        return ([Bar("arrive", "next", who=last, note="warpgroup 0 takes the first turn")] + close(consumer)
                + [Bar("sync", "own", who=0, note=f"warpgroup {last}'s last arrival")])

    # -- the roles' operations
    def chunk_derived(self, axis: str, var: str) -> list[str]:
        """What a chunk derives from its index ``var``: its stage and the ring's pass parity (from
        the first chunk the block visits), its origin."""
        x, stages = ident(axis), self.plan.stages
        first, _ = self.visits
        filled = var if first == "0" else f"({var} - {first})"  # the ring's fills before this chunk
        return [f"const int nk_stage = {filled} % {stages};",
                f"const unsigned nk_parity = (unsigned)({filled} / {stages}) & 1u;  // the ring's pass, mod 2",
                f"const int o_{x} = {self.chunk_origin(axis, var)};"]

    def stream_loop(self, node):
        """The consumers' loop over the chunks: wait for the stage to be full, the chunk's steps
        (the products committed, then waited down to the wait depth), then release the stage
        the previous chunk read. After it, every group is waited for."""
        axis = node.axis
        x = ident(axis)
        streamed = [s.array for s, _ in walk(node.body) if s.op == "load" and s.level == self.level
                    and s.array in self.plan.operands]
        assert set(streamed) == set(self.ring), "napkin bug: the ring holds the stream's operands"
        self.ring_node = (node, streamed)
        self.drained = set(self.roles.drained)
        chunks = -(-self.sizes[axis] // self.tile[axis])
        self.emit(f"// for {axis} in {chunks} chunks of {self.tile[axis]}: a {self.plan.stages}-stage ring the producer fills")
        start, depth = len(self.lines), self.depth
        if node.mask is not None:  # the chunks this block visits: both roles' bounds, before they split
            self.visits = self.visited_chunks(node.mask, chunks)
            self.preamble = [line.strip() for line in self.lines[start:]]
            del self.lines[start:]
        else:
            self.visits = ("0", str(chunks))
        self.depth = 0
        saved_valid = dict(self.valid)
        self.set_origin(axis, f"o_{x}")
        origin = [line.strip() for line in self.lines[start:]]  # the chunk's extent: derived in every segment
        del self.lines[start:]
        if self.roles.order == "pipelined":
            self.pipelined_chunks(node, streamed, origin, saved_valid)
            return
        self.lines.append(Wait(self.full("nk_stage"), "nk_parity", note="the chunk's boxes have landed"))
        self.chunk_steps(node, streamed, "nk_stage", full=False)  # every visited chunk tested, the diagonal's and the others alike
        self.valid = saved_valid
        del self.origin[axis]
        stages = self.plan.stages
        first, stop = self.visits
        self.emit(f"if (c_{x} > {first}) {self.arrive(self.empty(f'(nk_stage + {stages - 1}) % {stages}'))}"
                  "  // the previous chunk's products have landed: its stage is empty")
        body = self.lines[start:]
        del self.lines[start:]
        self.depth = depth
        self.lines.append(Loop(f"c_{x}", stop, self.chunk_derived(axis, f"c_{x}") + origin, body, first, chunks="all"))
        self.lines.append(Wait(groups=0, note="every product has landed"))

    def pipelined_chunks(self, node, streamed: list, origin: list[str], saved_valid: dict):
        """The consumers' chunks in FlashAttention-3's intra-warpgroup order
        (``paths.wgmma.pipeline_parts``), the first and the last peeled:

        * chunk ``first``: wait for its stage, issue S, wait for it (depth 0), its softmax, and
          P packed into the register A;
        * each later chunk c: wait for its stage, issue S(c), rescale O by the previous chunk's
          scale, issue P(c - 1) V(c - 1) from the previous chunk's stage; wait until S(c) has
          landed (depth 1: the other still runs) and run c's softmax under it; wait for it
          (depth 0), release the previous chunk's stage and pack P(c);
        * after them, O rescaled by the last chunk's scale and its P V, waited for.

        As FlashAttention-3 orders it: the pack writes the register A the previous product
        reads, after that product has landed, and O is rescaled only once it has. ptxas still
        schedules the depth-0 wait right after the softmax's row maximum, before the
        exponentials (no PTX dependency orders a wait after ALU work): the chain prices P V's
        drain as waited on (``napkin_dsl/chain.py``), and tests/test_pipelined.py reads the
        wait's place in the SASS."""
        axis, x, stages = node.axis, ident(node.axis), self.plan.stages
        parts = pipeline_parts(self.plan, self.launch, self.tile)
        body = list(node.body)

        def part(name: str) -> list:
            return [st for st, p in zip(body, parts.parts, strict=True) if p == name]
        behind = self.plan.mmas[parts.behind]
        ahead_out = self.fragment_of(parts.ahead)
        first, stop = self.visits
        self.placed_waits = True
        start, depth = len(self.lines), self.depth

        def take() -> list:
            ops = self.lines[start:]
            del self.lines[start:]
            return ops

        def issue_behind(stage: str):
            saved = dict(self.buffers)
            self.buffers.update({name: stage for name in streamed})
            self.nodes(part("behind"))
            self.buffers = saved

        # the first chunk: S, waited for, its softmax, P packed
        self.lines.append(Wait(self.full("nk_stage"), "nk_parity", note="the chunk's boxes have landed"))
        self.chunk_begin(node, streamed, "nk_stage", full=False)
        self.nodes(part("ahead"))
        self.lines.append(Wait(groups=0, note=f"{parts.ahead}'s product has landed"))
        self.nodes(part("softmax"))
        self.register_a(behind)
        self.chunk_end(streamed)
        derived = self.chunk_derived(axis, f"c_{x}") + origin
        prologue = take()
        # chunk c: S(c) ahead, the rescale and P V(c - 1) behind, c's softmax under it
        self.lines.append(Wait(self.full("nk_stage"), "nk_parity", note="the chunk's boxes have landed"))
        self.chunk_begin(node, streamed, "nk_stage", full=False)
        self.nodes(part("ahead"))
        self.nodes(part("rescale"))
        issue_behind("nk_pstage")
        self.lines.append(Wait(groups=1, landed=(ahead_out,),
                               note=f"{parts.ahead}'s product has landed; the previous chunk's {parts.behind} runs under the softmax"))
        self.nodes(part("softmax"))
        self.lines.append(Wait(groups=0, note=f"the previous chunk's {parts.behind} product has landed"))
        self.emit(f"{self.arrive(self.empty('nk_pstage'))}  // the previous chunk's products have landed: its stage is empty")
        self.register_a(behind)
        self.chunk_end(streamed)
        steady = take()
        # the last chunk's rescale and P V
        self.nodes(part("rescale"))
        issue_behind("nk_stage")
        self.lines.append(Wait(groups=0, note=f"the last chunk's {parts.behind} product has landed"))
        last = take()
        self.valid = saved_valid
        del self.origin[axis]
        self.depth = depth
        self.placed_waits = False
        previous = f"const int nk_pstage = (nk_stage + {stages - 1}) % {stages};  // the previous chunk's stage"
        self.lines.append(Loop(f"c_{x}", stop, derived, prologue, first, once=True, chunks="first"))
        self.lines.append(Loop(f"c_{x}", stop, derived + [previous], steady, f"{first} + 1", chunks="later"))
        self.lines.append(Loop(f"c_{x}", stop, self.chunk_derived(axis, f"c_{x}")[:1], last, f"max({first}, {stop} - 1)",
                               once=True, chunks="last"))

    def fragment_of(self, target: str) -> str:
        """The fragment product ``target`` accumulates into (its statement's output: O.acc for O)."""
        op = next(st.op for st, _ in walk(self.launch.body) if st.statement is not None and st.statement.target == target
                  and st.level == self.level and st.op in ("compute", "accumulate"))
        return target if op == "compute" else f"{target}.acc"  # as tc_compute and tc_accumulate name it

    def extents(self, name: str) -> list[int]:
        """Fragment ``name``'s dimensions, as it is declared (``dims``)."""
        return [int(e) for e in re.findall(r"\[(\d+)\]", self.dims(name))]

    def each_value(self, name: str, body):
        """``body(index)`` for every value of fragment ``name``, in loops over its dimensions."""
        extents = self.extents(name)

        def level(depth: int, index: str):
            if depth == len(extents):
                body(index)
                return
            with self.block(f"for (int v{depth} = 0; v{depth} < {extents[depth]}; ++v{depth}) {{"):
                level(depth + 1, f"{index}[v{depth}]")
        with self.block("{"):
            level(0, "")

    def arrive(self, bar: str) -> str:
        """One arrival of this warpgroup on ``bar`` (a consumer releasing a stage)."""
        if self.opencl:
            return f"nk_role_arrive(&nk_rs, {CONSUMERS}, nk_lane0, {bar}, 0);"
        return f"if (nk_tid % {WARPGROUP_THREADS} == 0) NK_MBAR_ARRIVE({self.bar(bar)});"

    def step(self, step):
        """A step; a product's wait follows the step's braces, so that a segment never ends inside
        a block."""
        super().step(step)
        if self.step_wait is not None:
            self.lines.append(self.step_wait)
            self.step_wait = None

    def mma(self, target: str, out: str):
        """The chunk's products of ``target``, committed as one group, then a wait until at most
        the wait depth of the warpgroup's groups are pending (0 where a later step reads them:
        ``Roles.drained``). On OpenCL the group is the runtime's: the accumulator moves to its
        shadow (the fragment holds NaN until the group lands), a register A is posted to the
        warp's words, and the products run when the group lands, on the stage it was issued on,
        from the posted A, NaN where a shared operand's bytes or a lane's A registers changed in
        between."""
        m = self.plan.mmas[target]
        acc = "f_" + ident(out)
        if out not in self.held:
            self.held.append(out)
        depth = 0 if target in self.drained else self.roles.wait_depth
        wait = Wait(groups=depth, note=f"{out}'s product has landed" if depth == 0 else "the previous chunk's products have landed")
        if m.a_in_registers and not self.placed_waits:  # the pipelined order packs it after the previous product's wait
            self.register_a(m)
        if self.roles.pingpong:  # this warpgroup's turn on the tensor cores (turns)
            self.lines.append(Bar("sync", "own", phase=True, note="this warpgroup's turn to issue its products"))
        if self.placed_waits:  # ... and places the waits (pipelined_chunks)
            wait = None
        if not self.opencl:
            self.products(target, f"&{acc}[0][0][0]")
            self.emit("NK_WG_COMMIT();")
            self.step_wait = wait
            return
        site = len(self.sites)
        a_words = None
        if m.a_in_registers:
            k_steps = self.tile[m.k] // wgmma_k(m.dtype)
            # one set of slots a product: its sites (the pipelined order prints it twice) never
            # have groups in flight at once, the next issued only after the last was waited for
            if target not in self.post_slots:
                self.post_slots[target], self.posted = self.posted, self.posted + k_steps
            first = self.post_slots[target]
            a = a_registers(m)
            self.site_registers[site] = (a, first, k_steps)
            self.emit("// issue: the warp's lanes post A's registers, which the product reads when it lands")
            self.loop("kk", k_steps, lambda: self.loop("j", 4, lambda: self.emit(f"{self.posted_word(f'{first} + kk', 'nk_lane')}[j] = {a}[kk][j];")))

            def a_words(kk):
                return self.posted_word(first + kk, "0")
        start, depth_now = len(self.lines), self.depth
        self.depth = 0
        saved = dict(self.buffers)
        self.buffers = {name: "nk_gstage" for name in self.buffers}
        self.products(target, f"&nk_sh_{ident(out)}[0][0][0]", a_words)
        self.buffers = saved
        shadow = f"nk_sh_{ident(out)}"
        self.emit("if (!nk_held)  // the operands changed between the issue and the landing: the result is undefined")
        self.each_value(out, lambda at: self.emit(f"{shadow}{at} = NAN;"))
        self.emit(f"if (--nk_pend_{ident(out)} == 0)  // the accumulator's last group: its fragment takes the values")
        self.each_value(out, lambda at: self.emit(f"{acc}{at} = {shadow}{at};"))
        self.sites.append(self.lines[start:])
        del self.lines[start:]
        self.depth = depth_now
        self.emit(f"// issue: {out}'s values move to its shadow, and its fragment reads NaN until the group lands")
        self.each_value(out, lambda at: self.emit(f"if (nk_pend_{ident(out)} == 0) {shadow}{at} = {acc}{at}; {acc}{at} = NAN;"))
        self.emit(f"nk_pend_{ident(out)} += 1;")
        self.site_operands.append([m.b] if m.a_in_registers else [staged_slot(m.a), m.b] if m.staged else [m.a, m.b])
        stage = self.buffers.get(m.b, "nk_stage")  # the stage its products read: the previous chunk's for a product issued behind
        self.emit(f"nk_role_commit(&nk_rs, {CONSUMERS}, nk_wg, nk_lane0, {site}, {stage}, nk_lane0 ? {self.operand_sum(site, stage)} : 0u);")
        self.step_wait = wait

    def chunk_vectors(self, node):
        """The chunk's plain tiles (fp8's per-key scales), between two barriers among the
        consumers: no chunk barrier opens a consumer's chunk here (the producer is not in step),
        so the first keeps a warp from overwriting the previous chunk's vectors while another
        warpgroup still reads them (``Roles.vectors``, which the model's chain prices)."""
        start = len(self.lines)
        super().chunk_vectors(node)
        if len(self.lines) > start:
            self.emit("NK_SYNC();  // every consumer warp is done with the previous chunk's vectors")
            self.lines.insert(start, self.lines.pop())

    def posted_word(self, slot, lane: str) -> str:
        """The words the warp posted for register A's k step ``slot`` (a C expression), from lane ``lane``'s four."""
        return f"(nk_asnap + (({slot}) * {self.plan.warps} + nk_warp) * {WARPGROUP_THREADS} + 4 * {lane})"

    def register_a(self, m):
        """The wgmma printer's packing of a register A (P; P and dS in the backward), its declaration hoisted: the registers live across the
        consumers' segments (the product reads them until it lands)."""
        start = len(self.lines)
        super().register_a(m)
        declared = f"unsigned {a_registers(m)}["
        (at,) = [i for i in range(start, len(self.lines)) if isinstance(self.lines[i], str) and self.lines[i].lstrip().startswith(declared)]
        declaration = self.lines.pop(at).strip()
        if declaration not in self.hoisted:
            self.hoisted.append(declaration)
            self.register_arrays.append(a_registers(m))

    def producer_ops(self) -> list:
        """The producer's loop: wait for the stage to be empty, then expect the chunk's bytes on
        its full mbarrier and issue the chunk's boxes."""
        node, streamed = self.ring_node
        axis = node.axis
        x = ident(axis)
        full = self.full("nk_stage")
        expect = sum(self.tma[name].bytes for name in streamed)
        once: list = []
        for name, bar in self.once.items():  # before the ring: the consumers wait on them once
            once.append(self.expect(str(bar), self.tma[name].bytes))
            once += self.issue(name, None, None, str(bar))
        body: list = [Wait(self.empty("nk_stage"), "nk_parity ^ 1u", note="the consumers released the stage")]
        body.append(self.expect(full, expect))
        for name in streamed:
            body += self.issue(name, f"o_{x}", "nk_stage", full)
        first, stop = self.visits
        return once + [Loop(f"p_{x}", stop, self.chunk_derived(axis, f"p_{x}"), body, first)]

    def expect(self, bar: str, expect: int) -> str:
        """The producer's arrive on ``bar`` with expect_tx of ``expect`` bytes."""
        if self.opencl:
            return f"nk_role_arrive(&nk_rs, {PRODUCER}, nk_lead, {bar}, {expect});  // expect_tx of the boxes' bytes, then arrive"
        return f"NK_MBAR_EXPECT_TX({self.bar(bar)}, {expect});  // the boxes' bytes, out-of-bounds fill included"

    def issue(self, name: str, origin: str | None, stage: str | None, bar: str) -> list[str]:
        """The producer's TMA boxes of operand ``name``, completing on ``bar``."""
        load = self.tma[name]
        lines = []
        for box, dst, coords in self.tma_boxes(name, origin, stage):
            if self.opencl:
                padded = coords + ["0"] * (5 - len(coords))
                lines.append(f"nk_role_tensor_copy(&nk_rs, nk_smem, nk_tid, {WARPGROUP_THREADS}, {list(self.tma).index(name)}, "
                             f"{dst}, {box.rows * box.cols * load.element_bytes}, {bar}, {', '.join(padded)});"
                             f"  // {name}: {box.rows} x {box.cols} from ({load.rows}, {load.cols} + {box.col})")
            else:
                lines.append(self.tma_copy(name, box, dst, coords, self.bar(bar)))
        return lines

    def load(self, name: str, origin: str | None = None, stage: str | None = None, commit: bool = True):
        """A one-shot TMA operand (attention's Q): the producer issues it before the ring, and
        the consumers wait for it here; any other load is the wgmma printer's."""
        if name in self.once:
            self.lines.append(Wait(str(self.once[name]), "0", note=f"{name} has landed"))
            return
        super().load(name, origin, stage, commit)

    # -- CUDA: straight code
    def straight(self, ops: list, sync: str = "NK_SYNC();"):
        """Operations as straight code, a block barrier among them printed as ``sync``."""
        for op in ops:
            if isinstance(op, Loop) and op.once:  # not a loop ptxas would unroll
                with self.block(f"if ({op.start} < {op.stop}) {{"):
                    self.emit(f"const int {op.var} = {op.start};")
                    for line in op.derived:
                        self.emit(line)
                    self.straight(op.body, sync)
            elif isinstance(op, Loop):
                with self.block(f"for (int {op.var} = {op.start}; {op.var} < {op.stop}; ++{op.var}) {{"):
                    for line in op.derived:
                        self.emit(line)
                    self.straight(op.body, sync)
            elif isinstance(op, Bar):
                self.emit(self.bar_line(op))
            elif isinstance(op, Wait):
                if op.bar is not None:
                    self.emit(f"NK_MBAR_WAIT({self.bar(op.bar)}, {op.parity});  // {op.note}")
                if op.groups is not None:
                    self.emit(f"NK_WG_WAIT({op.groups});  // {op.note}")
                if op.groups is not None and (op.groups == 0 or op.landed):
                    # the products landed: their registers are read and reused after this, never before
                    for acc in (self.held if op.groups == 0 else op.landed):
                        self.loop("nk_v", math.prod(self.extents(acc)), lambda acc=acc: self.emit(f"NK_WG_PIN_F((&f_{ident(acc)}[0][0][0])[nk_v]);"))
                    for a in self.register_arrays if op.groups == 0 else ():  # a register A in flight stays unpinned
                        self.emit("NK_UNROLL")
                        self.emit(f"for (int kk = 0; kk < (int)(sizeof({a}) / sizeof({a}[0])); ++kk) {{ "
                                  + " ".join(f"NK_WG_PIN_R({a}[kk][{j}]);" for j in range(4)) + " }")
            else:
                self.emit(op.replace("NK_SYNC();", sync))

    def bar_line(self, op: Bar) -> str:
        """A pingpong barrier: on CUDA its ``bar.sync`` or ``bar.arrive`` for the two warpgroups of
        a turn (:data:`TURN_THREADS`), with each warpgroup's id as an immediate; on OpenCL, where
        the consumers run in lockstep, a comment (``turns`` runs the protocol)."""
        macro = "NK_BAR_SYNC" if op.kind == "sync" else "NK_BAR_ARRIVE"
        what = f"{'bar.sync' if op.kind == 'sync' else 'bar.arrive'} on the {op.barrier} warpgroup's barrier: {op.note}"
        if self.opencl:
            return f"// pingpong: {what} (run by barriers.run_turns: PoCL runs the consumers in lockstep)"

        def call(w: int) -> str:
            return f"{macro}({op.barrier_id(w, self.consumers)}, {TURN_THREADS});"

        if op.who is not None:
            return f"if (nk_wg == {op.who}) {call(op.who)}  // {what}"
        branches = [f"if (nk_wg == {w}) {call(w)}" for w in range(self.consumers - 1)]
        return " else ".join(branches + [call(self.consumers - 1)]) + f"  // {what}"

    # -- OpenCL: the roles runtime's rounds
    def rounds(self, declarations: list[str], consumer: list, producer: list):
        """The roles on the runtime's rounds. The consumers are one role of every work-item, in
        lockstep, so that a segment's lane exchanges (the emulated shuffles and register A) and a
        barrier among them meet every work-item; the producer's segments run on the first
        warpgroup's work-items, in a phase of their own before the consumers'."""
        for line in declarations:
            self.emit(line)
        for out in self.held:
            self.emit(f"float nk_sh_{ident(out)}{self.dims(out)};  // {out} while its groups are in flight")
            self.emit(f"int nk_pend_{ident(out)} = 0;  // its groups in flight")
        x = ident(self.ring_node[0].axis)
        self.emit(f"int c_{x} = 0, p_{x} = 0;  // the consumers' chunk, the producer's")
        self.emit(f"nk_rounds_start(&nk_rs, {len(ROLE_NAMES)});")
        with self.block("for (;;) {"):
            self.emit("nk_rounds_settle(&nk_rs, nk_bars, (__global const uchar*)0, nk_smem);")
            self.land_copies()
            self.emit("barrier(CLK_LOCAL_MEM_FENCE);  // the boxes have landed before the groups read them")
            self.land_groups()
            self.emit("if (nk_rounds_retire(&nk_rs, nk_bars)) break;")
            self.emit(f"const int nk_segment = nk_rounds_guard(&nk_rs, nk_bars, {CONSUMERS}), nk_produce = nk_rs.ready[{PRODUCER}];")
            with self.block(f"if (nk_produce >= 0 && nk_tid < {WARPGROUP_THREADS}) {{  // the producer"):
                self.machine(producer, PRODUCER, "nk_produce")
            self.emit("barrier(CLK_LOCAL_MEM_FENCE);  // the producer's copies are queued, their stages poisoned")
            with self.block("if (nk_segment >= 0) {  // the consumers, every work-item"):
                self.machine(consumer, CONSUMERS, "nk_segment")
            self.emit("nk_rounds_next(&nk_rs);")
        self.emit(f"nk_rounds_status(&nk_rs, nk_status + {len(STATUS_WORDS)} * get_group_id(0));")

    def land_copies(self):
        """The tensor copies that land this round, by the first work-item: the box the map's words
        give, and the bytes it wrote (complete_tx takes them; a map the emulation refuses takes
        none, so the stage never completes)."""
        with self.block("if (nk_tid == 0) for (int c = 0; c < nk_rs.copies; ++c) {"):
            self.emit("if (!nk_rs.copy_landing[c] || nk_rs.copy_kind[c] != 1) continue;")
            self.emit("__constant const ulong* map = 0; __global const uchar* base = 0;")
            with self.block("switch (nk_rs.copy_arg[c][0]) {"):
                for index, name in enumerate(self.tma):
                    self.emit(f"case {index}: map = {self.map_name(name)}; base = (__global const uchar*)g_{ident(name)}; break;")
            self.emit("const int bytes = nk_tma_box(nk_smem, map, base, nk_rs.copy_dst[c], nk_rs.copy_arg[c][1], "
                      "nk_rs.copy_arg[c][2], nk_rs.copy_arg[c][3], nk_rs.copy_arg[c][4], nk_rs.copy_arg[c][5]);")
            self.emit("nk_rs.copy_bytes[c] = bytes < 0 ? 0 : bytes;")

    def operand_sum(self, site: int, stage: str) -> str:
        """The sum of the bytes of the shared tiles site ``site``'s products read on ``stage``."""
        sums = []
        for name in self.site_operands[site]:
            slot = self.smem[name]
            at = f"{slot.offset} + ({stage}) * {slot.stage_bytes}" if slot.stages > 1 else str(slot.offset)  # a one-shot tile: no stage
            sums.append(f"nk_bytes_sum(nk_smem, {at}, {slot.stage_bytes})")
        return "(" + " ^ 31u * ".join(sums) + ")"

    def land_groups(self):
        """The groups that land this round: whether their operands' bytes held since the issue (by
        the first work-item, for every role), then each role's own, in the order committed: their
        products, NaN where the bytes did not hold."""
        with self.block("if (nk_tid == 0) for (int g = 0; g < nk_rs.groups; ++g) {"):
            self.emit("if (!nk_rs.group_landing[g]) continue;")
            with self.block("switch (nk_rs.group_arg[g][0]) {"):
                for site in range(len(self.sites)):
                    self.emit(f"case {site}: nk_rs.group_sum[g] = {self.operand_sum(site, 'nk_rs.group_arg[g][1]')} "
                              "== nk_rs.group_sum[g]; break;")
        self.emit("barrier(CLK_LOCAL_MEM_FENCE);")
        if self.site_registers:  # each lane's A registers, still the ones it posted at the issue
            with self.block("for (int g = 0; g < nk_rs.groups; ++g) {"):
                self.emit("if (!nk_rs.group_landing[g] || nk_rs.group_owner[g] != nk_wg) continue;")
                with self.block("switch (nk_rs.group_arg[g][0]) {"):
                    for site, (a, first, count) in self.site_registers.items():
                        self.emit(f"case {site}: for (int kk = 0; kk < {count}; ++kk) for (int j = 0; j < 4; ++j) "
                                  f"if ({a}[kk][j] != {self.posted_word(f'{first} + kk', 'nk_lane')}[j]) "
                                  "atomic_and(&nk_rs.group_sum[g], 0u); break;")
            self.emit("barrier(CLK_LOCAL_MEM_FENCE);")
        with self.block("for (int g = 0; g < nk_rs.groups; ++g) {"):
            self.emit("if (!nk_rs.group_landing[g] || nk_rs.group_owner[g] != nk_wg) continue;")
            self.emit("const int nk_gstage = nk_rs.group_arg[g][1], nk_held = nk_rs.group_sum[g];")
            with self.block("switch (nk_rs.group_arg[g][0]) {"):
                for site, lines in enumerate(self.sites):
                    with self.block(f"case {site}: {{"):
                        for line in lines:
                            self.emit(line)
                        self.emit("break;")

    def machine(self, ops: list, role: int, segment: str):
        """A role's operations as a ``switch`` over its segments: a segment ends at each blocking
        point by naming the next segment and what it waits on; a loop's head tests its index, and
        its end goes back to the head."""
        cases: list[list[str]] = [[]]
        after_marks: list[tuple[str, int]] = []  # a loop's exit, named before its index is known

        def goto(pc: int | str, wait: Wait | None = None) -> list[str]:
            bar, parity = (wait.bar, wait.parity) if wait is not None and wait.bar is not None else ("-1", "0")
            lines = [f"nk_role_next(&nk_rs, {role}, nk_lead, {pc}, {bar}, {parity});"]
            if wait is not None and wait.groups is not None:
                lines.append(f"nk_role_wait_groups(&nk_rs, {role}, nk_lead, {wait.groups});")
            return lines

        def compile_ops(ops: list, derived: list[str]):
            for op in ops:
                if isinstance(op, Wait):
                    cases[-1] += goto(len(cases), op) + [f"break;  // wait: {op.note}"]
                    cases.append(list(derived))
                elif isinstance(op, Loop):
                    cases[-1] += [f"{op.var} = {op.start};"] + goto(len(cases)) + ["break;"]
                    head = len(cases)
                    inner = derived + op.derived
                    mark = f"@after{head}@"
                    cases.append(inner + [f"if ({op.var} >= {op.stop}) {{ {' '.join(goto(mark))} break; }}"])
                    compile_ops(op.body, inner)
                    cases[-1] += (goto(mark) if op.once else [f"++{op.var};"] + goto(head)) + ["break;"]
                    after_marks.append((mark, len(cases)))
                    cases.append(list(derived))
                elif isinstance(op, Bar):
                    cases[-1].append(self.bar_line(op))
                else:
                    cases[-1].append(op)

        compile_ops(ops, [])
        cases[-1] += [f"nk_role_finish(&nk_rs, {role}, nk_lead);", "break;"]
        with self.block(f"switch ({segment}) {{"):
            for pc, lines in enumerate(cases):
                with self.block(f"case {pc}: {{"):
                    for line in lines:
                        for mark, after in after_marks:
                            line = line.replace(mark, str(after))
                        self.emit(line)


def turn_programs(ops: list, chunks: int, consumers: int) -> dict[int, list[BarrierOp]]:
    """Each of the ``consumers`` warpgroups' pingpong barrier operations (:class:`Bar`) in the
    order it runs them, for a block that visits ``chunks`` chunks (each chunk loop run the trips
    its ``Loop.chunks`` gives): what ``barriers.run_turns`` runs."""
    trips = {"all": chunks, "first": min(chunks, 1), "later": max(chunks - 1, 0), "last": min(chunks, 1)}
    programs: dict[int, list[BarrierOp]] = {w: [] for w in range(consumers)}

    def walk_ops(ops: list, where: str):
        for op in ops:
            if isinstance(op, Loop):
                for c in range(trips[op.chunks]):
                    walk_ops(op.body, f"{op.chunks} chunk loop, trip {c}")
            elif isinstance(op, Bar):
                for w, program in programs.items():
                    if op.who is None or op.who == w:
                        program.append(BarrierOp(op.kind == "sync", op.barrier_id(w, consumers), TURN_THREADS,
                                                 f"{op.note}; {where}"))
    walk_ops(ops, "before the chunks")
    return programs
