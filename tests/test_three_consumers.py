"""FlashAttention-3's taller tiles (issue 48, item 4): 192 rows, three consumer warpgroups.

At d = 64 FlashAttention-3 runs 192 query rows a block: three consumer warpgroups of 64 rows and
a producer, the consumers at 160 registers a thread (setmaxnreg), taking the tensor cores in turn
around a ring of named barriers. napkin's mma.sync layout holds at most 8 warps, so a 192-row tile
was 32-row warps, over its fragment budget, and the launch fell to the FMA path; wgmma's warps
hold 16 rows whatever the tile's height (``isel._warpgroup_selection``). The consumers' share of
the register file is smaller, and so is the budget their fragments get
(``paths.wgmma.consumer_budget``): a tile over it is refused by name, never built to spill.
"""

from __future__ import annotations

import collections

import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import opencl, pipeline
from napkin_dsl.backends.barriers import BarrierProtocolError
from napkin_dsl.isel import select_program
from napkin_dsl.paths import wgmma as wgmma_path

from .conftest import EXAMPLES, assert_matches_reference, compiled_listing
from .test_pingpong import BUGS, captured_turns

D64 = dict(b=4, h=32, q=8192, x=8192, d=64)
SMALL = dict(b=1, h=2, q=200, x=300, d=32)  # a ragged last row group (8 of 192) and chunk


def _kernel(name: str, rows: int, keys: int) -> napkin.Kernel:
    kernel = napkin.load(EXAMPLES / f"{name}.napkin")[name]
    return kernel.relabelled(f"smem: group b 1, h 1, q {rows}; stream x {keys}")


def _selection(rows, keys, schedule=None, **sizes):
    program = _kernel("attention", rows, keys).gpu_program("H100", **sizes)
    return select_program(program, "sm_90a", schedule=schedule)[0]


# ---- the plan -------------------------------------------------------------------------------------


def test_a_192_row_tile_takes_wgmma_with_three_consumer_warpgroups():
    plan = _selection(192, 128, **D64).plan
    assert plan is not None and plan.instruction == "wgmma", "a 192-row tile fell to the FMA path"
    assert plan.warps == 12 and plan.roles.consumers == 3
    # (65536 - 128 x 24) / (3 x 128), down to a multiple of 8: FlashAttention-3's 160
    assert plan.roles.consumer_registers == 160
    text = _kernel("attention", 192, 128).pseudocode(hardware="H100", arch="sm_90a", **D64)
    assert "parallel for warpgroup in 3 consumer warpgroups of 64 q @registers:" in text


@pytest.mark.parametrize("rows, keys, held, consumers, registers, budget", [
    (192, 192, 134, 3, 160, 106),  # FA3's d = 64 tile: 304 bytes of spills at 160 registers
    (256, 128, 102, 4, 120, 80),  # 1168 bytes of spills at 120
])
def test_a_tile_over_the_consumers_share_is_refused_by_name(rows, keys, held, consumers, registers, budget):
    selection = _selection(rows, keys, **D64)
    # wgmma declines it: the FMA path (192 rows: mma.sync's 32-row warps are over budget too) or mma.sync
    assert selection.path != "wgmma"
    why = selection.declined if selection.plan is not None else selection.reason
    assert (f"a thread would hold {held} fragment registers at once, where {consumers} consumer "
            f"warpgroups take {registers} registers each (budget {budget})") in why


def test_the_pipelined_budget_is_a_share_of_the_consumers_registers():
    # 134 fragments with the packed P at 192 x 128, d = 64: 0 spills at 160 registers; a 128-row
    # tile's 202 at 240 (FA3's 176 keys at d = 128) spill 104 bytes: tests/test_pipelined.py
    plan = _selection(192, 128, "pipelined", **D64).plan
    assert plan.roles.order == "pipelined", plan.order_declined
    assert wgmma_path.pipelined_budget(plan) == 134 and wgmma_path.consumer_budget(plan.roles) == 106


def test_three_consumers_take_pingpong_and_say_so():
    plan = _selection(192, 128, "pingpong+pipelined", **D64).plan
    assert plan.roles.pingpong and plan.roles.order == "pipelined" and not plan.order_declined
    source, _ = opencl.generate(_kernel("attention", 192, 64).gpu_program("H100", **SMALL), arch="sm_90a",
                                overlap="pingpong")
    assert "pingpong: the 3 consumer warpgroups, each after the one before, take turns issuing their products (named barriers 2, 3 and 4)" in source


# ---- the ring of turns ----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule, phases", [("pingpong", 2 * 3), ("pingpong+pipelined", 3 + 1)])
def test_each_warpgroup_waits_on_its_own_barrier_and_passes_the_turn_to_the_next(schedule, phases, monkeypatch):
    captured = captured_turns(monkeypatch)
    opencl.generate(_kernel("attention", 192, 64).gpu_program("H100", **SMALL), arch="sm_90a", overlap=schedule)
    programs = pipeline.turn_programs(captured["ops"], 3, 3)
    assert [(op.wait, op.barrier) for op in programs[0]] == [(True, 2), (False, 3)] * phases + [(True, 2)]
    assert [(op.wait, op.barrier) for op in programs[1]] == [(True, 3), (False, 4)] * phases
    # the last gives warpgroup 0 its first turn, and 0 takes its last arrival
    assert [(op.wait, op.barrier) for op in programs[2]] == [(False, 2)] + [(True, 4), (False, 2)] * phases
    assert {op.threads for ops in programs.values() for op in ops} == {256}  # a turn's two warpgroups


@pytest.mark.parametrize("schedule", ["pingpong", "pingpong+pipelined"])
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_planted_protocol_bug_fails_with_three_consumers(bug, schedule, monkeypatch):
    BUGS[bug](monkeypatch)
    with pytest.raises(BarrierProtocolError, match="deadlock: |unbalanced: |arrives twice"):
        opencl.generate(_kernel("attention", 192, 64).gpu_program("H100", **SMALL), arch="sm_90a", overlap=schedule)


def test_the_ring_without_the_last_warpgroups_turn_deadlocks(monkeypatch):
    """A two-warpgroup protocol on three (the turn passed back from 1 to 0, as pingpong's pair
    does) leaves warpgroup 2 waiting for a turn no one gives."""
    monkeypatch.setattr(pipeline.Bar, "barrier_id", lambda self, w, consumers: (2, 3, 4)[w if self.barrier == "own" else 1 - min(w, 1)])
    with pytest.raises(BarrierProtocolError, match="deadlock: |unbalanced: "):
        opencl.generate(_kernel("attention", 192, 64).gpu_program("H100", **SMALL), arch="sm_90a", overlap="pingpong")


# ---- the emulation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name", ["attention", "causal_attention"])
def test_three_consumer_warpgroups_match_float64_under_every_seed(name, seed, monkeypatch):
    from napkin_dsl.reference import evaluate

    from .test_tensorcore import random_inputs

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    kernel = _kernel(name, 192, 64)
    program = kernel.gpu_program("H100", **SMALL)
    plan = select_program(program, "sm_90a", schedule="pingpong+pipelined")[0].plan
    assert plan.roles.consumers == 3 and plan.roles.schedule == "pingpong+pipelined", "napkin bug in the test"
    inputs, scalars = random_inputs(kernel.diagram, SMALL)
    monkeypatch.setenv("NAPKIN_EMULATE_SEED", str(seed))
    outputs = opencl.run(program, inputs, scalars, arch="sm_90a", overlap="pingpong+pipelined")
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, SMALL), name)


# ---- the CUDA build and the model -----------------------------------------------------------------


def test_fa3s_d64_tile_builds_three_turns_without_spills():
    """192 x 128 at d = 64 with pingpong+pipelined: setmaxnreg 160 for the consumers, each
    consumer loop's turn on its own barrier (2, 3 or 4) and the next's arrival, waits to depth 1
    then 0, no spills (compiled_listing), and a static ceiling at least the model's prediction."""
    from napkin_dsl.backends import sass

    compiled, instructions = compiled_listing(_kernel("attention", 192, 128), overlap="pingpong+pipelined", **D64)
    consumer = max(sass.innermost_loops(instructions), key=lambda body: sum(i.opcode.startswith("HGMMA") for i in body))
    barriers_used = collections.Counter((i.opcode.split(".")[1], i.operands) for i in consumer if i.opcode.startswith("BAR"))
    assert {key for key in barriers_used} >= {("SYNC", "0x2, 0x100"), ("SYNC", "0x3, 0x100"), ("SYNC", "0x4, 0x100"),
                                             ("ARV", "0x2, 0x100"), ("ARV", "0x3, 0x100"), ("ARV", "0x4, 0x100")}, barriers_used
    assert [i.operands for i in consumer if i.opcode == "WARPGROUP.DEPBAR.LE"] == ["gsb0, 0x1", "gsb0, 0x0"]
    (entry,) = sass.sass_report(compiled)["launches"]
    assert entry["roles"]["setmaxnreg"] == {"TRY_ALLOC": 160, "DEALLOC": 24}, entry["roles"]
    assert entry["roles"]["consumer_loop"]["block_barriers"] == 0
    ceiling = entry["ceiling"]
    assert ceiling["model_tflops"] <= ceiling["tflops"], ceiling
    assert compiled.cost.time["overlap"] == "pingpong+pipelined"


def test_the_cost_report_says_why_a_launch_stays_on_the_fma_path():
    """Never a silent fall to a path 100x slower: the report's notes carry the refusals."""
    report = _kernel("attention", 192, 192).cost("H100", **D64)
    (note,) = [n for n in report.notes if n.startswith("launch 0 stays on the FMA path: ")]
    assert "not wgmma either: a thread would hold 134 fragment registers at once" in note
    # a launch on tensor cores gets no such note; an f32 one is told the dtypes they take
    assert not any("FMA path" in n for n in _kernel("attention", 192, 128).cost("H100", **D64).notes)
    f32 = napkin.load("kernel k(A: f32[m k], B: f32[k n]) -> C: f32[m n]:\n    C[m n] = A * B\n")["k"]
    f32 = f32.relabelled("relabel k on H100:\n    smem: group m 64, n 64; stream k 32\n")
    assert "launch 0 stays on the FMA path: B is f32; tensor cores here take bf16" in " ".join(f32.cost("H100", m=256, n=256, k=256).notes)
