"""FlashAttention-3's pingpong, built (issue 48, item 2): the two consumer warpgroups take turns
issuing their products, ordered by named barriers (``bar.sync`` on a warpgroup's own before it
issues, ``bar.arrive`` on the other's after), warpgroup 0 first.

PoCL runs the consumers in lockstep (``backends/roles.py``), so the emulation runs the data of a
pingpong kernel with its turns as comments, the same kernel the serial and pipelined schedules
run; the turns themselves run on ``backends/barriers.py``, the PTX ISA's ``bar.sync`` and
``bar.arrive`` written apart from the printer, every time a pingpong kernel is printed. Each
protocol bug planted in the printer fails there, by a named deadlock or an unbalanced barrier.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import barriers, opencl, pipeline
from napkin_dsl.backends.barriers import BarrierOp, BarrierProtocolError, run_turns
from napkin_dsl.isel import select_program

from .conftest import EXAMPLES, compiled_listing
from .test_pipelined import BIG, CASES

SCHEDULES = ("pingpong", "pingpong+pipelined")


def _kernel(name):
    return napkin.load(EXAMPLES / f"{name}.napkin")[name]


def _plan(name, schedule, **sizes):
    return select_program(_kernel(name).gpu_program("H100", **sizes), "sm_90a", schedule=schedule)[0].plan


# ---- the ISA's named barriers, apart from the printer ---------------------------------------------


def _op(wait, barrier, threads=256):
    return BarrierOp(wait, barrier, threads, "test")


def test_a_sync_completes_once_its_threads_have_arrived():
    # warpgroup 0 waits on 2 until warpgroup 1's arrival; 1 waits on 3 until 0's
    run_turns({0: [_op(True, 2), _op(False, 3)], 1: [_op(False, 2), _op(True, 3)]})


def test_two_warpgroups_waiting_on_each_others_barrier_first_deadlock_by_name():
    with pytest.raises(BarrierProtocolError, match="deadlock: warpgroup 0 at barrier 2, warpgroup 1 at barrier 3"):
        run_turns({0: [_op(True, 2), _op(False, 3)], 1: [_op(True, 3), _op(False, 2)]})


def test_an_arrival_no_one_takes_is_unbalanced():
    with pytest.raises(BarrierProtocolError, match="unbalanced: barrier 2 is left with 128 arrivals of 256"):
        run_turns({0: [_op(False, 2)], 1: []})


def test_a_warpgroup_arriving_twice_at_one_phase_is_refused():
    # its two arrivals would complete a barrier of 256 threads that the other never reached
    with pytest.raises(BarrierProtocolError, match="warpgroup 1 arrives twice at one phase of barrier 2"):
        run_turns({0: [], 1: [_op(False, 2), _op(True, 2)]})


def test_arrivals_naming_different_thread_counts_are_refused():
    with pytest.raises(BarrierProtocolError, match="for 384 threads where this phase's arrivals named 256"):
        run_turns({0: [_op(False, 2)], 1: [_op(True, 2, 384)]})


# ---- the plan -------------------------------------------------------------------------------------


def test_attention_takes_pingpong_and_says_so():
    plan = _plan("attention", "pingpong+pipelined", **BIG)
    assert plan.roles.pingpong and plan.roles.order == "pipelined" and plan.roles.schedule == "pingpong+pipelined"
    assert not plan.order_declined
    source, _ = opencl.generate(_kernel("attention").gpu_program("H100", b=1, h=2, q=256, x=256, d=64), arch="sm_90a",
                                overlap="pingpong")
    assert "pingpong: the two consumer warpgroups take turns issuing their products (named barriers 2 and 3)" in source


@pytest.mark.parametrize("name, relabel, reason", [
    ("matmul", None, "no step of the chunk reads a product"),
    ("attention", "smem: group b 1, h 1, q 64; stream x 64", "pingpong takes turns among two or more consumer warpgroups: this tile has 1"),
    ("fp8_attention_vt", None, "sK, loaded each chunk between the consumers' barriers")])
def test_a_launch_pingpong_does_not_fit_keeps_its_turns_free_and_says_why(name, relabel, reason):
    kernel = napkin.load(EXAMPLES / f"{name}.napkin")[name]
    kernel = kernel.relabelled(relabel) if relabel else kernel
    sizes = {"matmul": dict(m=1024, n=1024, k=1024), "attention": dict(b=1, h=2, q=256, x=256, d=64),
             "fp8_attention_vt": dict(b=1, h=2, qb=2, qi=128, x=208, d=64)}[name]
    plan = select_program(kernel.gpu_program("H100", **sizes), "sm_90a", schedule="pingpong")[0].plan
    assert not plan.roles.pingpong and reason in plan.order_declined


# ---- the printed turns, and the bugs planted in them ------------------------------------------------


def _ids_swapped(monkeypatch):
    """Each phase waits on the other warpgroup's barrier and passes the turn on its own."""
    original = pipeline.RolesPrinter.turn_ops

    def swap(ops):
        for op in ops:
            if isinstance(op, pipeline.Loop):
                swap(op.body)
            elif isinstance(op, pipeline.Bar) and op.who is None:
                op.barrier = "next" if op.barrier == "own" else "own"
        return ops
    monkeypatch.setattr(pipeline.RolesPrinter, "turn_ops", lambda self, consumer: swap(original(self, consumer)))


def _dropping(monkeypatch, which):
    """The turns printed without the barrier operations ``which`` selects (at the top level and
    in the chunk loops)."""
    original = pipeline.RolesPrinter.turn_ops

    def drop(ops):
        kept = []
        for op in ops:
            if isinstance(op, pipeline.Loop):
                op.body = drop(op.body)
            if not (isinstance(op, pipeline.Bar) and which(op)):
                kept.append(op)
        return kept
    monkeypatch.setattr(pipeline.RolesPrinter, "turn_ops", lambda self, consumer: drop(original(self, consumer)))


def captured_turns(monkeypatch) -> dict:
    """What the printer's turn_ops returns, under "ops", for each kernel printed after this."""
    captured = {}
    original = pipeline.RolesPrinter.turn_ops

    def capture(self, consumer):
        captured["ops"] = ops = original(self, consumer)
        return ops
    monkeypatch.setattr(pipeline.RolesPrinter, "turn_ops", capture)
    return captured


BUGS = {"the barrier ids swapped": _ids_swapped,
        "warpgroup 0 not given the first turn": lambda mp: _dropping(mp, lambda op: op.who is not None and op.kind == "arrive"),
        "the last warpgroup's last arrival not taken": lambda mp: _dropping(mp, lambda op: op.who is not None and op.kind == "sync"),
        "the turn not passed after the products": lambda mp: _dropping(mp, lambda op: op.kind == "arrive" and op.who is None)}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_planted_protocol_bug_fails_when_the_kernel_is_printed(bug, schedule, monkeypatch):
    BUGS[bug](monkeypatch)
    program = _kernel("attention").gpu_program("H100", b=1, h=2, q=200, x=600, d=32)
    with pytest.raises(BarrierProtocolError, match="deadlock: |unbalanced: |arrives twice"):
        opencl.generate(program, arch="sm_90a", overlap=schedule)


def test_the_printed_turns_give_each_warpgroup_a_phase_a_product_serial_and_one_a_chunk_pipelined(monkeypatch):
    """Each consumer warpgroup's barrier operations for a block of 3 chunks, as run_turns runs them."""
    captured = captured_turns(monkeypatch)
    program = _kernel("attention").gpu_program("H100", b=1, h=2, q=200, x=600, d=32)
    for schedule, phases in (("pingpong", 2 * 3), ("pingpong+pipelined", 3 + 1)):
        opencl.generate(program, arch="sm_90a", overlap=schedule)
        programs = pipeline.turn_programs(captured["ops"], 3, 2)
        # warpgroup 0: a sync on 2 and an arrive on 3 a phase, then the sync that takes 1's last arrival
        assert [(op.wait, op.barrier) for op in programs[0]] == [(True, 2), (False, 3)] * phases + [(True, 2)]
        assert [(op.wait, op.barrier) for op in programs[1]] == [(False, 2)] + [(True, 3), (False, 2)] * phases
        assert programs[0][0].threads == 2 * barriers.WARPGROUP_THREADS


# ---- the emulation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name, sizes", CASES, ids=[f"{c[0]}-{c[1]['x']}" for c in CASES])
def test_the_emulated_kernel_is_the_one_without_turns(name, sizes, schedule):
    """On OpenCL a pingpong kernel is its order's kernel with the turns as comments: its data path
    is the one tests/test_pipelined.py and tests/test_pipeline.py run under three seeds."""
    program = _kernel(name).gpu_program("H100", **sizes)
    order = "pipelined" if schedule.endswith("pipelined") else "serial"
    with_turns, _ = opencl.generate(program, arch="sm_90a", overlap=schedule)
    without, _ = opencl.generate(program, arch="sm_90a", overlap=order)

    def body(source):
        return [line for line in source[source.index("__kernel"):].splitlines() if "// pingpong: " not in line]
    assert body(with_turns) == body(without)
    plan = select_program(program, "sm_90a", schedule=schedule)[0].plan
    if plan.roles.pingpong:
        assert sum("// pingpong: " in line for line in with_turns.splitlines()) >= 4
    else:  # a 64-row tile: one consumer warpgroup
        assert plan.roles.consumers == 1 and "pingpong takes turns among two or more consumer warpgroups" in plan.order_declined


@pytest.mark.parametrize("name, sizes", CASES, ids=[f"{c[0]}-{c[1]['x']}" for c in CASES])
def test_every_variant_runs_with_pingpong_and_the_pipeline(name, sizes, monkeypatch):
    from napkin_dsl.reference import evaluate

    from .conftest import assert_matches_reference
    from .test_tensorcore import random_inputs

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    kernel = _kernel(name)
    program = kernel.gpu_program("H100", **sizes)
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    monkeypatch.setenv("NAPKIN_EMULATE_SEED", "2")
    outputs = opencl.run(program, inputs, scalars, arch="sm_90a", overlap="pingpong+pipelined")
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), name)


# ---- the CUDA build and the model ---------------------------------------------------------------


@pytest.mark.parametrize("name, sizes", [("attention", BIG), ("gqa", dict(b=4, kv=8, r=4, q=8192, x=8192, d=128)),
                                         ("causal_attention", BIG), ("attention_lse", BIG)])
def test_fa3s_schedule_has_named_barriers_and_the_pipeline_in_its_consumer_loop(name, sizes):
    """Issue 48's static done-when, with pingpong+pipelined at d = 128 (b4 h32 8k): named barriers
    (ids 2 and 3) in the consumer loop, a wait to depth 1 before the softmax, no spills, and a
    static ceiling at least the model's prediction, itself at least 620 TFLOP/s on H100."""
    from napkin_dsl.backends import sass

    compiled, instructions = compiled_listing(_kernel(name), overlap="pingpong+pipelined", **sizes)
    consumer = max(sass.innermost_loops(instructions), key=lambda body: sum(i.opcode.startswith("HGMMA") for i in body))
    barriers_used = collections.Counter((i.opcode, i.operands) for i in consumer if i.opcode.startswith("BAR"))
    assert barriers_used == {("BAR.SYNC.DEFER_BLOCKING", "0x2, 0x100"): 1, ("BAR.SYNC.DEFER_BLOCKING", "0x3, 0x100"): 1,
                             ("BAR.ARV", "0x2, 0x100"): 1, ("BAR.ARV", "0x3, 0x100"): 1}, barriers_used
    waits = [i.operands for i in consumer if i.opcode == "WARPGROUP.DEPBAR.LE"]
    assert waits == ["gsb0, 0x1", "gsb0, 0x0"]
    (entry,) = sass.sass_report(compiled)["launches"]
    assert entry["roles"]["consumer_loop"]["block_barriers"] == 0
    ceiling = entry["ceiling"]
    assert ceiling["model_tflops"] <= ceiling["tflops"], ceiling
    report = compiled.cost
    assert report.time["overlap"] == "pingpong+pipelined"
    assert float(report.total_flops) / report.time["overlapped_s"] / 1e12 >= 620


def test_the_chain_waits_on_a_named_barrier_a_phase():
    report = _kernel("attention").cost("H100", arch="sm_90a", overlap="pingpong", **BIG)
    chain = report.time["chain"][0]
    assert chain["build"] == "roles, pingpong" and [link["latency"] for link in chain["links"]] == ["bar_sync", "bar_sync"]
    fa3 = _kernel("attention").cost("H100", arch="sm_90a", overlap="pingpong+pipelined", **BIG).time["chain"][0]
    assert [link["latency"] for link in fa3["links"]] == ["bar_sync"]
    assert "under the other consumer warpgroups' products" in fa3["hidden"][0]
    assert np.isfinite(chain["chunk_clocks"])
