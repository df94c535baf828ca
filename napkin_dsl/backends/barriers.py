"""Named barriers between warpgroups, run as the PTX ISA defines them: pingpong's turns (issue 48).

The check of pingpong that the OpenCL emulation cannot make.

PoCL runs a work-group's work-items in turn, and the roles runtime (``roles.py``) runs the
consumer warpgroups of a kernel in lockstep, as one role, so that their lane exchanges meet
every work-item. Pingpong's barriers order one consumer warpgroup's products after the other's:
in lockstep both would wait at once. So the emulation runs the data of a pingpong kernel with its
turns left out, and this module runs the turns: each warpgroup's sequence of ``bar.sync`` and
``bar.arrive`` operations, read off the printed roles (``pipeline.Bar`` inside the chunk loops,
each loop run the trips its chunks give), against the semantics of PTX ISA 9.7.13.1 ("bar,
barrier"), written here apart from the printer:

* ``bar.sync a, b`` and ``bar.arrive a, b``: the executing warps' threads arrive at barrier a,
  which completes once b threads have arrived; ``bar.sync`` then waits for it, ``bar.arrive``
  does not. Every arrival at one phase of a barrier names the same b, and a warp arrives at a
  phase once (the barrier counts arrivals, not distinct threads: a warp arriving twice would
  complete it early).
* A completed barrier starts its next phase with no arrivals.

A warpgroup that waits while no other can move is a deadlock, named by the warpgroup, the
barrier and its arrivals; a barrier left with arrivals when every warpgroup is done is an
unbalanced protocol (the next kernel on the SM would inherit them), named too.
"""

from __future__ import annotations

from dataclasses import dataclass

WARPGROUP_THREADS = 128


class BarrierProtocolError(Exception):
    """The turns of a warpgroup protocol deadlock, or leave a barrier with arrivals."""


@dataclass(frozen=True)
class BarrierOp:
    """One warpgroup's ``bar.sync`` (``wait``) or ``bar.arrive`` on barrier ``barrier`` for
    ``threads`` threads; ``where`` says where the printer put it."""

    wait: bool
    barrier: int
    threads: int
    where: str = ""


def run_turns(programs: dict[int, list[BarrierOp]]) -> None:
    """Run each warpgroup's barrier operations (by warpgroup) to the end, or raise
    :class:`BarrierProtocolError` naming the deadlock or the unbalanced barrier."""
    at = {w: 0 for w in programs}
    arrived: dict[int, int] = {}  # barrier -> threads arrived at its current phase
    expected: dict[int, int] = {}  # barrier -> the b its current phase's arrivals named
    phase: dict[int, int] = {}  # barrier -> phases completed
    waiting: dict[int, tuple[int, int]] = {}  # warpgroup -> (barrier, the phase it waits to complete)
    arrivers: dict[int, set] = {}  # barrier -> the warpgroups arrived at its current phase

    def arrive(w: int, op: BarrierOp):
        b = op.barrier
        if w in arrivers.setdefault(b, set()):
            raise BarrierProtocolError(f"warpgroup {w} arrives twice at one phase of barrier {b} ({op.where})")
        arrivers[b].add(w)
        if b in expected and expected[b] != op.threads:
            raise BarrierProtocolError(f"warpgroup {w} arrives at barrier {b} for {op.threads} threads where this phase's "
                                       f"arrivals named {expected[b]} ({op.where})")
        expected[b] = op.threads
        arrived[b] = arrived.get(b, 0) + WARPGROUP_THREADS
        if arrived[b] > op.threads:
            raise BarrierProtocolError(f"barrier {b} has {arrived[b]} arrivals for {op.threads} threads ({op.where})")
        if arrived[b] == op.threads:
            phase[b] = phase.get(b, 0) + 1
            del arrived[b], expected[b], arrivers[b]

    moved = True
    while moved:
        moved = False
        for w, program in programs.items():
            if w in waiting:
                b, awaited = waiting[w]
                if phase.get(b, 0) <= awaited:
                    continue
                del waiting[w]
            while at[w] < len(program):
                op = program[at[w]]
                at[w] += 1
                moved = True
                awaited = phase.get(op.barrier, 0)
                arrive(w, op)
                if op.wait and phase.get(op.barrier, 0) <= awaited:
                    waiting[w] = (op.barrier, awaited)
                    break
    if waiting:
        w, (b, _) = next(iter(waiting.items()))
        stuck = ", ".join(f"warpgroup {v} at barrier {c}" for v, (c, _) in waiting.items())
        op = programs[w][at[w] - 1]
        raise BarrierProtocolError(f"deadlock: {stuck}; barrier {b} has {arrived.get(b, 0)} of its {op.threads} arrivals "
                                   f"({op.where})")
    left = {b: n for b, n in arrived.items() if n}
    if left:
        raise BarrierProtocolError("unbalanced: " + ", ".join(f"barrier {b} is left with {n} arrivals of {expected[b]}"
                                                             for b, n in left.items()) + " when every warpgroup is done")
