"""The chain of a wgmma launch's warpgroups: what one chunk of its stream waits on beyond its
units' time, read off the plan that was built and the profile's ``[latency]`` table.

napkin builds two schedules of a wgmma stream on sm_90a (``paths/wgmma.py``):

* the **roles**: a producer warpgroup fills a ring of full and empty mbarriers, and each consumer
  warpgroup waits on full[s], issues its products, commits them, waits until ``wait_depth`` groups
  are pending and releases the stage;
* the **synchronous ring**: a block barrier a chunk, after which one thread issues the next
  chunk's copy, and every product waited to depth 0;
* the roles **pipelined** (``Roles.order``, FlashAttention-3's intra-warpgroup order): chunk c's
  S issued before chunk c - 1's P V, waited at depth 1 while the latter runs, and the softmax
  of chunk c under it.

A chunk costs a block its units' time U (the model's tensor, FMA and MUFU time in turn,
``cost.overlapped_compute``) plus the links of its chain that nothing runs under:

* synchronous: the block barrier, the full-barrier wait, and a drain per product group;
* roles: a drain per product a later step of the chunk reads (``Roles.drained``: the softmax reads
  S); two barriers among the consumers around the chunk's plain tiles (``Roles.vectors``: fp8's
  per-key scales); the full-barrier wait only where no product stays in flight across chunks (at
  wait depth 1 it runs under the previous chunk's products, as matmul's does);
* pingpong (``Roles.pingpong``, FlashAttention-3's turns): a ``bar.sync`` before each phase of
  product issues (one a chunk pipelined, one a product serial); a warpgroup's drains and its
  full-barrier wait run under the other warpgroups' products;
* pipelined: the full-barrier wait (the chunk starts with nothing in flight) and the previous
  chunk's P V drain: ptxas schedules its depth-0 wait right after the softmax's row maximum,
  before the exponentials, so only the maximum runs under the product (read in the SASS; no
  PTX dependency orders a wait after ALU work). S's drain runs under that P V;

and the copy. With the roles, a ring of s stages holds each chunk from its copy's issue until its
release, so the consumers take a chunk at most every (copy + U + links) / s (Little's law). The
synchronous ring issues a chunk's copy s - 1 chunks ahead, at a barrier: a chunk takes at least
copy / (s - 1).

:meth:`Chain.chunk_clocks` is one block's time a chunk, alone on its SM. r blocks an SM run their
chains side by side, so the SM takes max(r U, chunk_clocks(U)) for their r chunks:
:meth:`Chain.factor` on the launch's compute time (``cost.predict_time``). The static ceiling
(``backends/sass.loop_ceiling``) adds the same chain with U its loop's tensor clocks. Only the
schedule built is priced so: a what-if overlap (``cost_of(overlap=...)``) prices its own
schedule's units without a chain, as FlashAttention-3's hides its latencies.
"""

from __future__ import annotations

from dataclasses import dataclass

from .paths.wgmma import WgmmaPlan


@dataclass(frozen=True)
class Link:
    """One wait of a chunk's chain: what it is, and the ``[latency]`` entry that prices it."""

    what: str
    latency: str
    clocks: float
    source: str = ""


@dataclass(frozen=True)
class Chain:
    """The chain of one wgmma launch's chunk (see the module's docstring)."""

    build: str  # "roles", "roles, <schedule>" (Roles.schedule) or "synchronous ring"
    links: tuple[Link, ...]
    hidden: tuple[str, ...]  # waits that run under a product in flight: named, not priced
    copy_link: Link  # the copy's latency
    stages: int

    @property
    def copy(self) -> float:
        return self.copy_link.clocks

    @property
    def roles(self) -> bool:
        return self.build.startswith("roles")

    @property
    def link_clocks(self) -> float:
        return sum(link.clocks for link in self.links)

    def ring_clocks(self, units: float) -> float:
        """The least time a chunk takes for the ring to keep up with its copies."""
        if self.roles:
            return (self.copy + units + self.link_clocks) / self.stages
        return self.copy / max(self.stages - 1, 1)

    def chunk_clocks(self, units: float) -> float:
        """One block's clocks a chunk, alone on its SM, whose units take ``units`` clocks."""
        return max(units + self.link_clocks, self.ring_clocks(units))

    def factor(self, units: float, resident: int) -> float:
        """How much longer than its units' time a launch takes, ``resident`` blocks to an SM."""
        if units <= 0:
            return 1.0
        return max(1.0, self.chunk_clocks(units) / (max(resident, 1) * units))

    def describe(self, units: float, resident: int) -> dict:
        """The chain at ``units`` clocks a chunk, as the cost report keeps it (JSON-ready)."""
        return {"build": self.build, "units_clocks": round(units, 1), "resident": resident,
                "links": [{"what": link.what, "latency": link.latency, "clocks": link.clocks} for link in self.links],
                "hidden": list(self.hidden), "copy_clocks": self.copy, "stages": self.stages,
                "sources": {link.latency: link.source for link in (*self.links, self.copy_link)},
                "ring_clocks": round(self.ring_clocks(units), 1), "chunk_clocks": round(self.chunk_clocks(units), 1),
                "factor": self.factor(units, resident)}


class MissingLatency(Exception):
    """The profile's ``[latency]`` table lacks an entry the chain needs (its name)."""


def chain_of(plan, hardware) -> Chain | None:
    """The chain of a launch's ``plan`` on ``hardware``: None where the plan is not a wgmma plan
    with a streamed operand (no ring, no chain). Raises :class:`MissingLatency` where the
    profile's ``[latency]`` table lacks an entry it needs."""
    if not isinstance(plan, WgmmaPlan) or plan.stream is None or not any(op.streamed for op in plan.operands.values()):
        return None

    def link(what: str, name: str) -> Link:
        entry = hardware.latency.get(name)
        if entry is None:
            raise MissingLatency(name)
        return Link(what, name, entry.clocks, entry.source)

    copy = link("a chunk's copy", "copy")
    roles = plan.roles
    if roles is None:
        links = [link("the block barrier", "bar_sync")]
        if plan.tma:
            links.append(link("the full-barrier wait", "mbarrier_wait"))
        links += [link(f"{target}'s drain (wait_group 0)", "wgmma_drain") for target in plan.mmas]
        return Chain("synchronous ring", tuple(links), (), copy, plan.stages)
    if roles.pingpong:  # FlashAttention-3's turns (RolesPrinter.turns): a warpgroup waits while the other's products run
        phases = 1 if roles.order == "pipelined" else len(plan.mmas)  # the issue phases of a chunk
        links = tuple(link(f"pingpong's bar.sync before the chunk's issue phase {i + 1} of {phases}", "bar_sync") for i in range(phases))
        hidden = ("the products' drains and the full-barrier wait, under the other consumer warpgroups' products",)
        return Chain(f"roles, {roles.schedule}", links, hidden, copy, plan.stages)
    if roles.order == "pipelined":  # FlashAttention-3's intra-warpgroup order (RolesPrinter.pipelined_chunks)
        ahead, behind = roles.drained[0], next(t for t in plan.mmas if t not in roles.drained)
        hidden = (f"{ahead}'s drain, under the previous chunk's {behind} product issued behind it (wait_group 1)",)
        # The chunk starts with nothing in flight (its full-barrier wait runs under no product),
        # and ptxas places the depth-0 wait right after the softmax's row maximum, before its
        # exponentials (tests/test_pipelined.py reads it in the SASS): the drain is waited on.
        links = (link("the full-barrier wait", "mbarrier_wait"),
                 link(f"the previous chunk's {behind} drain (wait_group 0, which ptxas places before the exponentials)",
                      "wgmma_drain"))
        return Chain("roles, pipelined", links, hidden, copy, plan.stages)
    links = [link(f"{target}'s drain (wait_group 0: a later step reads it)", "wgmma_drain") for target in roles.drained]
    if roles.vectors:  # the consumers' two barriers around the chunk's plain tiles (RolesPrinter.chunk_vectors)
        names = " and ".join(roles.vectors)
        links += [link(f"the consumers' barrier before {names}", "bar_sync"), link(f"the consumers' barrier after {names}", "bar_sync")]
    hidden = []
    if set(roles.drained) >= set(plan.mmas):
        links.insert(0, link("the full-barrier wait", "mbarrier_wait"))
    else:
        in_flight = " and ".join(t for t in plan.mmas if t not in roles.drained)
        hidden.append(f"the full-barrier wait, under {in_flight}'s products in flight (wait_group {roles.wait_depth})")
    return Chain("roles", tuple(links), tuple(hidden), copy, plan.stages)
