"""Asynchronous roles on a CPU: the OpenCL runtime that schedules them in rounds (issue 43).

A warp-specialized kernel is a set of roles that wait on each other through mbarriers: a producer
that waits for a stage of a ring to be empty and fills it by an asynchronous copy, consumers that
wait for it to be full, compute, and mark it empty again. PoCL runs a work-group's work-items in
turn between barriers, so a role that spin-waits on another deadlocks there. This runtime runs
such a kernel faithfully by scheduling the roles itself (``../shared/DESIGN.md``, "Asynchronous
roles, and how a CPU verifies them"):

* each role's body is a resumable state machine, a ``switch`` over its segments (the code
  between two blocking points), run by every work-item of the role; state that crosses segments
  lives in private or local arrays;
* the kernel is a uniform loop of rounds (:data:`PRELUDE`'s ``nk_rounds_*``). A round lands the
  copies due in it and applies the arrivals the last round's segments made (``nk_rounds_settle``),
  then every role tests the wait its next segment needs without blocking (``nk_rounds_guard``,
  which returns the segment to run, read before any segment of the round moves it), and every
  role whose wait is met runs that segment (the kernel's ``switch``);
* an asynchronous copy (``cp.async.bulk`` into shared memory, completing on an mbarrier with
  ``complete_tx``) is queued when issued and lands in a later round, drawn by a seeded adversary
  (``NK_ROLES_SEED``, ``NK_ROLES_MAX_DELAY``). Until it lands its destination holds 0xFF bytes
  (NaN as f32), so a read before its full barrier completes reads NaN;
* a wgmma group (``commit_group``) is queued too, and completes in a later round after the role's
  earlier groups; its work (the products' reads of shared memory) runs when it lands, from the
  two arguments the kernel committed it with. ``wait_group N`` is a wait on the role's pending
  groups (``nk_role_wait_groups``), so a stage released before its group was waited is refilled,
  and poisoned, before the group reads it;
* a round in which no role can run and nothing is in flight is a deadlock: the run ends, and the
  status words say which role waits on which barrier and parity (:func:`describe_status`). It
  never hangs.

The mbarrier is the PTX ISA's (9.7.13.15): ``mbarrier.init`` with an expected arrival count; a
phase completes when its pending arrivals and its tx-count are both zero, and the next phase
starts with the expected count again; ``expect_tx`` adds bytes to the tx-count and the copy's
``complete_tx`` removes them; ``try_wait.parity P`` succeeds once the phase of parity P has
completed (the current phase's parity is not P). It is written here from the ISA, apart from
``wgmma.py``'s synchronous emulation, which completes a copy when it is issued.

The kernels napkin prints as roles (``pipeline.py``: matmul's producer and consumer warpgroups)
land their own tensor copies (``nk_role_tensor_copy``: the runtime knows no tensor map) and run
their groups' products between ``nk_rounds_settle`` and ``nk_rounds_retire``.

Deliberately not here: named barriers and ``setmaxnreg`` (a no-op here; its budgets are checked
in Python and in the SASS).
"""

from __future__ import annotations

from dataclasses import dataclass

# The status words a run leaves (``nk_status``), in order: the outcome, the round, and for each of
# the runtime's roles whether it had not finished, and the barrier and parity it waited on.
MAX_ROLES = 8  # NK_MAX_ROLES
STATUS_WORDS = ("outcome", "round") + tuple(f"{word}{r}" for r in range(MAX_ROLES) for word in ("waiting", "barrier", "parity"))
OUTCOMES = {0: "running", 1: "finished", 2: "deadlock", 3: "round limit", 4: "queue overflow"}

PRELUDE = r"""
/* ---- roles scheduled in rounds (napkin_dsl/backends/roles.py) ---- */
#ifndef NK_ROLES_SEED
#define NK_ROLES_SEED 1
#endif
#ifndef NK_ROLES_MAX_DELAY
#define NK_ROLES_MAX_DELAY 8      /* a copy or a group lands 1 .. NK_ROLES_MAX_DELAY rounds after it is issued */
#endif
#ifndef NK_ROLES_MAX_ROUNDS
#define NK_ROLES_MAX_ROUNDS 100000
#endif
#define NK_MAX_ROLES 8           /* roles.MAX_ROLES */
#ifndef NK_MAX_COPIES
#define NK_MAX_COPIES 64         /* copies in flight at once */
#endif
#define NK_MAX_ARRIVALS 8        /* arrivals one role records in one segment (one a warpgroup) */
#define NK_MAX_GROUPS 32
#define NK_MAX_OWNERS 8          /* the warpgroups that commit wgmma groups */

/* An mbarrier: completed phases, pending arrivals, tx-count, expected arrivals. */
typedef struct { int completed; int pending; int tx; int expected; } nk_mbar;

/* The scheduler's state, in local memory, shared by every work-item of the work-group. */
typedef struct {
    int round, outcome, ran;
    int pc[NK_MAX_ROLES], done[NK_MAX_ROLES], ready[NK_MAX_ROLES];
    int wait_bar[NK_MAX_ROLES], wait_parity[NK_MAX_ROLES];
    int arrivals[NK_MAX_ROLES], arrive_bar[NK_MAX_ROLES][NK_MAX_ARRIVALS], arrive_tx[NK_MAX_ROLES][NK_MAX_ARRIVALS];
    int copies, issued;
    int copy_src[NK_MAX_COPIES], copy_dst[NK_MAX_COPIES], copy_bytes[NK_MAX_COPIES];
    int copy_bar[NK_MAX_COPIES], copy_due[NK_MAX_COPIES], copy_landing[NK_MAX_COPIES];
    int copy_kind[NK_MAX_COPIES], copy_arg[NK_MAX_COPIES][6];  /* 1: a tensor copy (map, c0 .. c4) the kernel lands */
    int groups, group_ids;
    int group_owner[NK_MAX_GROUPS], group_due[NK_MAX_GROUPS], group_landing[NK_MAX_GROUPS], group_arg[NK_MAX_GROUPS][2];
    uint group_sum[NK_MAX_GROUPS];  /* its operands' bytes at issue (nk_bytes_sum), then whether they held */
    int wait_groups[NK_MAX_ROLES];
    int owner_role[NK_MAX_OWNERS], owner_pending[NK_MAX_OWNERS];  /* an owner's role, and its groups in flight */
} nk_rounds;

inline void nk_mbar_start(__local nk_mbar* m, int count) {
    m->completed = 0; m->pending = count; m->tx = 0; m->expected = count;
}
inline void nk_mbar_settle(__local nk_mbar* m) {
    if (m->pending == 0 && m->tx == 0) { m->completed += 1; m->pending = m->expected; }
}
/* try_wait.parity: the phase of parity P has completed when the current phase's parity is not P. */
inline int nk_mbar_passed(__local const nk_mbar* m, int parity) {
    return (m->completed & 1) != parity;
}

/* A seeded draw: the rounds a copy takes to land. */
inline int nk_rounds_delay(int copy) {
    uint x = (uint)copy * 2654435761u ^ (uint)NK_ROLES_SEED * 40503u;
    x ^= x >> 15; x *= 2246822519u; x ^= x >> 13;
    return 1 + (int)(x % (uint)NK_ROLES_MAX_DELAY);
}

/* Every work-item, once: `roles` roles, each starting at pc 0 with no wait. */
inline void nk_rounds_start(__local nk_rounds* s, int roles) {
    if (get_local_id(0) == 0) {
        s->round = 0; s->outcome = 0; s->ran = 1; s->copies = 0; s->issued = 0;
        s->groups = 0; s->group_ids = 0;
        for (int r = 0; r < NK_MAX_ROLES; ++r) {
            s->pc[r] = 0; s->done[r] = r >= roles; s->ready[r] = 0; s->wait_bar[r] = -1; s->wait_parity[r] = 0;
            s->arrivals[r] = 0; s->wait_groups[r] = -1;
        }
        for (int o = 0; o < NK_MAX_OWNERS; ++o) { s->owner_role[o] = -1; s->owner_pending[o] = 0; }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

/* Every work-item, at the start of a round: the arrivals the last round's segments recorded are
   applied, the copies due this round and the groups that land are flagged (copy_landing[c],
   group_landing[g]), and the flagged flat copies' bytes are copied by every work-item. The kernel
   then lands the flagged tensor copies (a tensor map's box, decoded by the kernel's own emulation,
   which sets copy_bytes[c] to the bytes it wrote) and runs the flagged groups' deferred work, and
   calls nk_rounds_retire. */
inline void nk_rounds_settle(__local nk_rounds* s, __local nk_mbar* bars, __global const uchar* src, __local uchar* smem) {
    const int lid = get_local_id(0), size = get_local_size(0);
    if (lid == 0) {
        if (s->copies > NK_MAX_COPIES || s->groups > NK_MAX_GROUPS) {
            s->outcome = 4;
            s->copies = min(s->copies, NK_MAX_COPIES); s->groups = min(s->groups, NK_MAX_GROUPS);
        }
        for (int r = 0; r < NK_MAX_ROLES; ++r) {
            if (s->arrivals[r] > NK_MAX_ARRIVALS) { s->outcome = 4; s->arrivals[r] = NK_MAX_ARRIVALS; }
            for (int a = 0; a < s->arrivals[r]; ++a) {
                __local nk_mbar* m = bars + s->arrive_bar[r][a];
                m->tx += s->arrive_tx[r][a];   /* expect-tx, then arrive-on */
                m->pending -= 1;
                nk_mbar_settle(m);
            }
            s->arrivals[r] = 0;
        }
        for (int c = 0; c < s->copies; ++c) s->copy_landing[c] = s->copy_due[c] <= s->round;
        /* an owner's groups complete in the order it committed them */
        for (int g = 0; g < s->groups; ++g) {
            int earlier_waits = 0;
            for (int h = 0; h < g; ++h) earlier_waits |= s->group_owner[h] == s->group_owner[g] && !s->group_landing[h];
            s->group_landing[g] = s->group_due[g] <= s->round && !earlier_waits;
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int c = 0; c < s->copies; ++c) {
        if (!s->copy_landing[c] || s->copy_kind[c] != 0) continue;
        for (int i = lid; i < s->copy_bytes[c]; i += size) smem[s->copy_dst[c] + i] = src[s->copy_src[c] + i];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

/* Every work-item, after nk_rounds_settle and the kernel's landings: complete_tx of each landed
   copy's bytes on its barrier; the landed copies and groups leave the queues (a group, its role's
   pending count); and the run ends where every role has finished with nothing in flight, where no
   role ran last round and nothing landed or is in flight (a deadlock, naming the first role still
   waiting), at the round limit, or where a queue overflowed. Returns nonzero when the loop of
   rounds is to stop (uniform across the work-group). */
inline int nk_rounds_retire(__local nk_rounds* s, __local nk_mbar* bars) {
    barrier(CLK_LOCAL_MEM_FENCE);
    if (get_local_id(0) == 0) {
        int kept = 0, landed = 0;
        for (int c = 0; c < s->copies; ++c) {
            if (s->copy_landing[c]) {
                __local nk_mbar* m = bars + s->copy_bar[c];
                m->tx -= s->copy_bytes[c];
                nk_mbar_settle(m);
                landed += 1;
                continue;
            }
            s->copy_src[kept] = s->copy_src[c]; s->copy_dst[kept] = s->copy_dst[c];
            s->copy_bytes[kept] = s->copy_bytes[c]; s->copy_bar[kept] = s->copy_bar[c]; s->copy_due[kept] = s->copy_due[c];
            s->copy_kind[kept] = s->copy_kind[c];
            if (s->copy_kind[c]) for (int a = 0; a < 6; ++a) s->copy_arg[kept][a] = s->copy_arg[c][a];
            s->copy_landing[kept] = 0;
            kept += 1;
        }
        s->copies = kept;
        kept = 0;
        for (int g = 0; g < s->groups; ++g) {
            if (s->group_landing[g]) { s->owner_pending[s->group_owner[g]] -= 1; landed += 1; continue; }
            s->group_owner[kept] = s->group_owner[g]; s->group_due[kept] = s->group_due[g];
            s->group_arg[kept][0] = s->group_arg[g][0]; s->group_arg[kept][1] = s->group_arg[g][1];
            s->group_sum[kept] = s->group_sum[g];
            s->group_landing[kept] = 0;
            kept += 1;
        }
        s->groups = kept;
        int all_done = 1;
        for (int r = 0; r < NK_MAX_ROLES; ++r) all_done &= s->done[r];
        if (s->outcome != 0) {
            /* a queue overflowed (nk_rounds_settle): the run ends with it */
        } else if (all_done && s->copies == 0 && s->groups == 0) {
            s->outcome = 1;
        } else if (!s->ran && !landed && s->copies == 0 && s->groups == 0) {
            s->outcome = 2;  /* nothing ran, landed or is in flight: the status names every waiting role */
        } else if (s->round >= NK_ROLES_MAX_ROUNDS) {
            s->outcome = 3;
        }
        s->ran = 0;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    return s->outcome != 0;
}

/* Every work-item: which roles run a segment this round (their wait is met, or they have none).
   Returns the segment `role` runs (its pc, read here, before any segment moves it), or -1: uniform
   across the role. */
inline int nk_rounds_guard(__local nk_rounds* s, __local nk_mbar* bars, int role) {
    if (get_local_id(0) == 0) {
        for (int r = 0; r < NK_MAX_ROLES; ++r) {
            const int bar = s->wait_bar[r];
            int groups_met = 1;  /* wgmma.wait_group N: each of the role's owners has at most N in flight */
            for (int o = 0; o < NK_MAX_OWNERS && s->wait_groups[r] >= 0; ++o)
                groups_met &= s->owner_role[o] != r || s->owner_pending[o] <= s->wait_groups[r];
            const int met = !s->done[r] && (bar < 0 || nk_mbar_passed(bars + bar, s->wait_parity[r])) && groups_met;
            s->ready[r] = met ? s->pc[r] : -1;
            s->ran |= met;
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    return s->ready[role];
}

/* Every work-item, at the end of a round's segments. */
inline void nk_rounds_next(__local nk_rounds* s) {
    barrier(CLK_LOCAL_MEM_FENCE);
    if (get_local_id(0) == 0) s->round += 1;
    barrier(CLK_LOCAL_MEM_FENCE);
}

/* Inside a segment, every work-item of the role calls these; its first work-item (`lane0`)
   records. A segment ends by naming what the role's next segment waits on (or nothing). */
inline void nk_role_next(__local nk_rounds* s, int role, int lane0, int pc, int bar, int parity) {
    if (lane0) { s->pc[role] = pc; s->wait_bar[role] = bar; s->wait_parity[role] = parity; s->wait_groups[role] = -1; }
}
/* wgmma.wait_group N: the next segment waits, besides its barrier, until each of the role's owners
   has at most `n` committed groups pending (call after nk_role_next). */
inline void nk_role_wait_groups(__local nk_rounds* s, int role, int lane0, int n) {
    if (lane0) s->wait_groups[role] = n;
}
/* wgmma.commit_group: the products issued since the last commit become a group that completes in
   a round the adversary draws, after the role's earlier groups. Its work is deferred to then: the
   kernel runs it from the group's two arguments when the group lands, so that a product's reads of
   shared memory happen as late as the hardware may make them (a stage released before its group
   was waited is refilled, and poisoned, before they happen). The hardware may also read them as
   early as the issue: `sum` is the operands' bytes then (nk_bytes_sum, by the role's first
   work-item), which the kernel sums again when the group lands; bytes that changed in between
   (still landing at the issue, or refilled before the landing) make the group's result NaN. */
inline void nk_role_commit(__local nk_rounds* s, int role, int owner, int lead, int arg0, int arg1, uint sum) {
    if (lead) {  /* the owner's (a warpgroup's) first work-item */
        const int g = atomic_inc(&s->groups);  /* owners commit in the same phase */
        const int id = atomic_inc(&s->group_ids);
        if (g >= NK_MAX_GROUPS) return;        /* the next settle ends the run: queue overflow */
        s->group_owner[g] = owner; s->group_due[g] = s->round + nk_rounds_delay(id ^ 0x5bd1);
        s->group_arg[g][0] = arg0; s->group_arg[g][1] = arg1; s->group_landing[g] = 0; s->group_sum[g] = sum;
        s->owner_role[owner] = role;
        s->owner_pending[owner] += 1;
    }
}
/* A sum of `bytes` bytes of shared memory from `start` (FNV-1a over 4-byte words; both multiples of 4). */
inline uint nk_bytes_sum(__local const uchar* smem, int start, int bytes) {
    __local const uint* words = (__local const uint*)(smem + start);
    uint h = 2166136261u;
    for (int i = 0; i < bytes / 4; ++i) h = (h ^ words[i]) * 16777619u;
    return h;
}
inline void nk_role_finish(__local nk_rounds* s, int role, int lane0) {
    if (lane0) { s->done[role] = 1; s->wait_bar[role] = -1; }
}
inline void nk_role_arrive(__local nk_rounds* s, int role, int lane0, int bar, int tx_bytes) {
    if (lane0) {  /* one arrival: a role of several warpgroups arrives once from each */
        const int a = atomic_inc(&s->arrivals[role]);
        if (a < NK_MAX_ARRIVALS) { s->arrive_bar[role][a] = bar; s->arrive_tx[role][a] = tx_bytes; }
    }
}
/* A queued copy's slot (rank 0 of the issuing role), or -1 where the queue is full (the run ends). */
inline int nk_rounds_enqueue(__local nk_rounds* s, int kind, int dst, int bytes, int bar) {
    const int c = atomic_inc(&s->copies);  /* roles issue in the same phase */
    const int id = atomic_inc(&s->issued);
    if (c >= NK_MAX_COPIES) return -1;      /* the next settle ends the run: queue overflow */
    s->copy_kind[c] = kind; s->copy_dst[c] = dst; s->copy_bytes[c] = bytes; s->copy_bar[c] = bar;
    s->copy_due[c] = s->round + nk_rounds_delay(id); s->copy_landing[c] = 0;
    return c;
}
/* cp.async.bulk.shared.global.mbarrier::complete_tx::bytes: `bytes` from byte `src_byte` of the
   copy's source to shared byte `dst`, landing NK_ROLES_MAX_DELAY rounds at most from now; the
   destination holds 0xFF bytes until then. The role's work-items poison it together; the role
   has `role_size` of them, and `rank` is this one's place among them. */
inline void nk_role_copy(__local nk_rounds* s, __local uchar* smem, int rank, int role_size,
                         int src_byte, int dst, int bytes, int bar) {
    for (int i = rank; i < bytes; i += role_size) smem[dst + i] = (uchar)0xFF;
    if (rank == 0) {
        const int c = nk_rounds_enqueue(s, 0, dst, bytes, bar);
        if (c >= 0) s->copy_src[c] = src_byte;
    }
}
/* cp.async.bulk.tensor.<rank>d ... mbarrier::complete_tx::bytes: the box of tensor map `map` (the
   kernel's index of it) at coordinates c0 .. c4 (innermost first) to shared byte `dst`, its
   `bytes` poisoned (0xFF) until it lands. The kernel lands it (the runtime knows no tensor map):
   in the round it is flagged, it copies the box and sets copy_bytes[c] to the bytes it wrote,
   which complete_tx then takes from bar. */
inline void nk_role_tensor_copy(__local nk_rounds* s, __local uchar* smem, int rank, int role_size,
                                int map, int dst, int bytes, int bar, int c0, int c1, int c2, int c3, int c4) {
    for (int i = rank; i < bytes; i += role_size) smem[dst + i] = (uchar)0xFF;
    if (rank == 0) {
        const int c = nk_rounds_enqueue(s, 1, dst, bytes, bar);
        if (c >= 0) {
            s->copy_src[c] = 0;
            s->copy_arg[c][0] = map; s->copy_arg[c][1] = c0; s->copy_arg[c][2] = c1;
            s->copy_arg[c][3] = c2; s->copy_arg[c][4] = c3; s->copy_arg[c][5] = c4;
        }
    }
}
"""


@dataclass(frozen=True)
class RoundsStatus:
    """How a run of roles ended (the kernel's ``nk_status`` words): the outcome, the round, and
    what each role that had not finished waited on, ``(role, barrier, parity)``."""

    outcome: str
    round: int
    waiting: tuple = ()

    def describe(self, roles: list[str], barriers: list[str]) -> str:
        """``finished after 12 rounds``, or ``deadlock: consumer 0 waits on full[1], phase 1;
        producer waits on empty[1], phase 0`` (every role still waiting, in role order)."""
        if self.outcome != "deadlock":
            return f"{self.outcome} after {self.round} rounds"
        waits = []
        for role, bar, parity in self.waiting:
            name = roles[role] if role < len(roles) else f"role {role}"
            on = barriers[bar] if 0 <= bar < len(barriers) else f"barrier {bar}"
            waits.append(f"{name} {'wait' if name.endswith('s') else 'waits'} on {on}, phase {parity}")
        return "deadlock: " + "; ".join(waits)


def read_status(words) -> RoundsStatus:
    """The status a kernel wrote to its ``nk_status`` words (:data:`STATUS_WORDS` of them)."""
    values = [int(w) for w in words]
    assert len(values) == len(STATUS_WORDS), "napkin bug: a roles kernel's status words"
    waiting = tuple((r, values[2 + 3 * r + 1], values[2 + 3 * r + 2]) for r in range(MAX_ROLES) if values[2 + 3 * r])
    return RoundsStatus(OUTCOMES.get(values[0], f"outcome {values[0]}"), values[1], waiting)


STATUS_STORE = r"""
/* The status words (roles.STATUS_WORDS), written by the first work-item after the rounds. */
inline void nk_rounds_status(__local const nk_rounds* s, __global int* status) {
    if (get_local_id(0) == 0) {
        status[0] = s->outcome; status[1] = s->round;
        for (int r = 0; r < NK_MAX_ROLES; ++r) {
            status[2 + 3 * r] = !s->done[r]; status[3 + 3 * r] = s->wait_bar[r]; status[4 + 3 * r] = s->wait_parity[r];
        }
    }
}
"""
