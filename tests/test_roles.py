"""The roles runtime (backends/roles.py, issue 43's emulator): a producer and a consumer role in one
work-group, a ring of stages with full and empty mbarriers, copies that land in a round the seeded
adversary draws. The ring written right runs to the end under every seed and moves every chunk;
each ordering bug planted in it fails, by a wrong or poisoned (NaN) result or by a deadlock the
status names, and never hangs.

The ring is the one CUTLASS's PipelineTmaAsync keeps (and FlashAttention-3's producer warp):
- the producer waits for stage s to be empty (parity phase ^ 1, so the first pass through the
  ring does not wait), arrives on full[s] with expect_tx of the chunk's bytes and issues the copy,
  which completes the bytes on full[s];
- the consumer waits for full[s] (parity phase), reads the stage and arrives on empty[s];
- each flips its phase when it wraps to stage 0.

A second ring defers the consumer's product to its group (``commit_group``) and releases the stage
after ``wait_group 0``, as the wgmma printer will: released before the wait, the stage is refilled
before the product reads it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from napkin_dsl.backends import opencl, roles

PRODUCER_ITEMS, CONSUMER_ITEMS = 8, 16  # work-items a role

# Both rings: the roles' places in the work-group, the barriers, and the round loop's frame. A
# role's own state (its chunk, stage and phase) lives in each of its work-items' private variables,
# across its segments. NEXT moves a role past a chunk: to the stage after it, flipping the phase at
# the wrap, and on to `pc`, waiting on barrier `base + stage` (or finished after the last chunk).
FRAME = r"""
#define NEXT(ROLE, PC, BASE, PARITY_FLIP) \
    chunk += 1; stage += 1; \
    if (stage == STAGES) { stage = 0; FLIP; } \
    if (chunk == CHUNKS) nk_role_finish(&s, ROLE, lane0); \
    else nk_role_next(&s, ROLE, lane0, PC, (BASE) + stage, phase ^ (PARITY_FLIP))
#define FLIP phase ^= 1
__kernel void ring(__global const float* x, __global float* y, __global int* status) {
    __local nk_rounds s;
    __local nk_mbar bars[2 * STAGES];               /* full[0 .. STAGES), then empty[0 .. STAGES) */
    __local uchar smem[STAGES * CHUNK * 4] __attribute__((aligned(16)));
    const int lid = get_local_id(0), size = get_local_size(0);
    const int role = lid < PRODUCER_ITEMS ? 0 : 1;
    const int rank = role == 0 ? lid : lid - PRODUCER_ITEMS;
    const int items = role == 0 ? PRODUCER_ITEMS : CONSUMER_ITEMS;
    const int lane0 = rank == 0;
    if (lid == 0) for (int b = 0; b < 2 * STAGES; ++b) nk_mbar_start(bars + b, 1);
    nk_rounds_start(&s, 2);
    int chunk = 0, stage = 0, phase = 0;
    for (;;) {
        nk_rounds_settle(&s, bars, (__global const uchar*)x, smem);
        @COMPLETIONS@
        if (nk_rounds_retire(&s, bars)) break;
        const int segment = nk_rounds_guard(&s, bars, role);
        if (segment >= 0) {
            if (role == 0) {                          /* the producer: one segment a chunk */
                nk_role_arrive(&s, 0, lane0, stage, EXPECT_BYTES);
                nk_role_copy(&s, smem, rank, items, chunk * CHUNK * 4, stage * CHUNK * 4, CHUNK * 4, stage);
                NEXT(0, 0, STAGES, 1);
            } else if (segment == 0) {                /* the consumer's first segment: wait for full[0] */
                nk_role_next(&s, 1, lane0, 1, 0, 0);
            } else {
                @CONSUMER@
            }
        }
        nk_rounds_next(&s);
    }
    nk_rounds_status(&s, status);
}
"""


def ring(consumer: str, completions: str = "") -> str:
    return FRAME.replace("@COMPLETIONS@", completions).replace("@CONSUMER@", consumer)


# The consumer reads its stage in the segment its full wait lets run.
RING = ring(r"""
                __local const float* tile = (__local const float*)(smem + stage * CHUNK * 4);
                for (int k = rank; k < CHUNK; k += items) y[chunk * CHUNK + k] = 2.0f * tile[k];
#if BUG != 1                                          /* 1: the empty arrive dropped */
                nk_role_arrive(&s, 1, lane0, STAGES + stage, 0);
#endif
#if BUG == 2                                          /* 2: the phase not flipped at the wrap */
#undef FLIP
#define FLIP
#endif
#if BUG == 3                                          /* 3: the next stage read without waiting for it */
                chunk += 1; stage = (stage + 1) % STAGES;
                if (chunk == CHUNKS) nk_role_finish(&s, 1, lane0); else nk_role_next(&s, 1, lane0, 1, -1, 0);
#else
                NEXT(1, 1, 0, 0);
#endif""")

# The consumer's product as the wgmma emulation will run it: issued (committed as a group) in one
# segment, its reads of the stage deferred to the round the group lands in; the stage is released
# (empty arrive) in the next segment, after wgmma.wait_group 0.
RING_ASYNC = ring(r"""
                if (segment == 1) {                   /* the product of this stage, committed */
                    nk_role_commit(&s, 1, 1, lane0, chunk, stage, 0);
#if BUG == 5                                          /* 5: the stage released before its group was waited */
                    nk_role_arrive(&s, 1, lane0, STAGES + stage, 0);
                    NEXT(1, 1, 0, 0);
#else
                    nk_role_next(&s, 1, lane0, 2, -1, 0);
                    nk_role_wait_groups(&s, 1, lane0, 0);
#endif
                } else {                              /* its group has landed: release the stage */
                    nk_role_arrive(&s, 1, lane0, STAGES + stage, 0);
                    NEXT(1, 1, 0, 0);
                }""", completions=r"""
        for (int g = 0; g < s.groups; ++g) {          /* the groups landing: their products run now */
            if (!s.group_landing[g]) continue;
            __local const float* tile = (__local const float*)(smem + s.group_arg[g][1] * CHUNK * 4);
            for (int k = lid; k < CHUNK; k += size) y[s.group_arg[g][0] * CHUNK + k] = 2.0f * tile[k];
        }""")

BUGS = {None: 0, "empty arrive dropped": 1, "phase not flipped": 2, "full wait skipped": 3, "expect_tx short": 4,
        "stage released before its group was waited": 5}


def run_ring(stages: int, chunks: int, chunk: int, seed: int, bug: str | None = None, kernel: str = RING,
             max_copies: int | None = None):
    """The ring's output and how the run ended (``max_copies``: the runtime's queue of copies)."""
    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    import pyopencl as cl

    expect = chunk * 4 - 4 if bug == "expect_tx short" else chunk * 4
    defines = {"STAGES": stages, "CHUNKS": chunks, "CHUNK": chunk, "PRODUCER_ITEMS": PRODUCER_ITEMS,
               "CONSUMER_ITEMS": CONSUMER_ITEMS, "BUG": BUGS[bug], "EXPECT_BYTES": expect,
               "NK_ROLES_SEED": seed, "NK_ROLES_MAX_ROUNDS": 20 * chunks * stages + 100}
    if max_copies is not None:
        defines["NK_MAX_COPIES"] = max_copies
    head = "".join(f"#define {name} {value}\n" for name, value in defines.items())
    context, queue = opencl.context()
    program = cl.Program(context, head + roles.PRELUDE + roles.STATUS_STORE + kernel).build(options=[o for o in opencl.build_options() if not o.startswith("-DNK_ROLES_SEED")])
    x = np.arange(1, chunks * chunk + 1, dtype=np.float32)
    y = np.zeros_like(x)
    status = np.zeros(len(roles.STATUS_WORDS), dtype=np.int32)
    mf = cl.mem_flags
    buffers = [cl.Buffer(context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x), cl.Buffer(context, mf.WRITE_ONLY, y.nbytes),
               cl.Buffer(context, mf.WRITE_ONLY, status.nbytes)]
    program.ring(queue, (PRODUCER_ITEMS + CONSUMER_ITEMS,), (PRODUCER_ITEMS + CONSUMER_ITEMS,), *buffers)
    cl.enqueue_copy(queue, y, buffers[1])
    cl.enqueue_copy(queue, status, buffers[2])
    queue.finish()
    return x, y, roles.read_status(status)


NAMES = (["producer", "consumer"], lambda stages: [f"full[{s}]" for s in range(stages)] + [f"empty[{s}]" for s in range(stages)])


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("stages, chunks", [(2, 7), (3, 10), (4, 3)])
def test_the_ring_moves_every_chunk_under_every_seed(stages, chunks, seed):
    x, y, status = run_ring(stages, chunks, 40, seed)
    assert status.outcome == "finished", status.describe(NAMES[0], NAMES[1](stages))
    np.testing.assert_array_equal(y, 2 * x)


def test_the_adversary_moves_the_landings():
    """Different seeds land the copies in different rounds: the runs take different numbers of rounds."""
    rounds = {run_ring(3, 10, 40, seed)[2].round for seed in range(1, 7)}
    assert len(rounds) > 1, rounds


def test_a_dropped_empty_arrive_is_a_named_deadlock():
    _, _, status = run_ring(2, 7, 40, 1, "empty arrive dropped")
    # after filling both stages, the producer waits for empty[0] to complete its first phase, and
    # the consumer, having read both, for full[0]'s second
    assert status.describe(NAMES[0], NAMES[1](2)) == \
        "deadlock: producer waits on empty[0], phase 0; consumer waits on full[0], phase 1"


def test_an_expect_tx_short_of_the_copy_is_a_named_deadlock():
    """The copy's complete_tx takes more bytes than expected: the tx-count never returns to zero
    (it is -4 after the landing), so full[0]'s phase never completes."""
    _, _, status = run_ring(2, 5, 40, 2, "expect_tx short")
    assert status.outcome == "deadlock" and "consumer waits on full[0], phase 0" in status.describe(NAMES[0], NAMES[1](2))


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("bug", ["phase not flipped", "full wait skipped"])
def test_a_read_before_its_copy_lands_fails_the_run(bug, seed):
    """A consumer that waits on an already completed phase, or not at all, reads a stage whose copy
    is in flight (0xFF bytes: NaN) or has not been issued (the previous chunk): never 2 x."""
    x, y, status = run_ring(2, 7, 40, seed, bug)
    assert status.outcome == "deadlock" or not np.array_equal(y, 2 * x), status


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("stages, chunks", [(2, 7), (3, 5)])
def test_a_deferred_product_waited_before_its_stage_is_released_is_right(stages, chunks, seed):
    x, y, status = run_ring(stages, chunks, 40, seed, kernel=RING_ASYNC)
    assert status.outcome == "finished", status.describe(NAMES[0], NAMES[1](stages))
    np.testing.assert_array_equal(y, 2 * x)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_stage_released_before_its_group_was_waited_fails_the_run(seed):
    """The producer refills the released stage (poisoning it at issue) before the group's deferred
    reads land: the product reads NaN, or another chunk."""
    x, y, status = run_ring(2, 7, 40, seed, "stage released before its group was waited", kernel=RING_ASYNC)
    assert status.outcome == "finished" and not np.array_equal(y, 2 * x)


def test_a_queue_too_short_for_the_copies_in_flight_ends_the_run_as_an_overflow():
    """Four stages keep up to four copies in flight: a queue of two overflows, and the run says so
    (never writing past the queue)."""
    _, _, status = run_ring(4, 9, 40, 1, max_copies=2)
    assert status.outcome == "queue overflow", status
    _, y, status = run_ring(4, 9, 40, 1, max_copies=4)
    assert status.outcome == "finished", status


def test_the_status_names_every_waiting_role_with_its_barrier_and_phase():
    words = [0] * len(roles.STATUS_WORDS)
    words[:2] = [2, 17]
    words[2 + 3 * 1: 2 + 3 * 2] = [1, 3, 1]  # the consumer waits on empty[1], phase 1
    words[2: 5] = [1, 2, 0]  # the producer on empty[0], phase 0
    status = roles.read_status(words)
    assert status.describe(["producer", "consumer"], ["full[0]", "full[1]", "empty[0]", "empty[1]"]) == \
        "deadlock: producer waits on empty[0], phase 0; consumer waits on empty[1], phase 1"
    words[0] = 1
    assert roles.read_status(words).describe([], []) == "finished after 17 rounds"


def test_the_ring_is_clean_under_oclgrind():
    """oclgrind (data races, uninitialized reads) finds nothing in runs of both rings: the rounds'
    barriers order every role's writes before the next phase's reads."""
    if shutil.which("oclgrind") is None:
        pytest.skip("oclgrind is not installed")
    code = ("from tests.test_roles import RING, RING_ASYNC, run_ring\n"
            "for kernel in (RING, RING_ASYNC):\n"
            "    for seed in (1, 2):\n"
            "        x, y, status = run_ring(3, 5, 24, seed, kernel=kernel)\n"
            "        print('@@', status.outcome, bool((y == 2 * x).all()))\n")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root), PYOPENCL_NO_CACHE="1")
    done = subprocess.run(["oclgrind", "--data-races", "--uninitialized", "--check-api", sys.executable, "-c", code],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("@@ finished True") == 4, done.stdout + done.stderr[-2000:]
    assert "data race" not in done.stderr and "Uninitialized" not in done.stderr and "Invalid" not in done.stderr, done.stderr[-2000:]
