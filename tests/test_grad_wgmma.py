"""The derived backward on wgmma (issue 47, item 3): FlashAttention-3's key launch.

* A map computed in registers between two products is a later product's register A, as
  attention's P is in the forward: the key launch's dV takes P = exp(S - L) and its dK takes
  dS = P * (dP - D) from registers, S and dP by descriptor; the deterministic choice's dQ launch
  takes its dS the same way. Each product's register A is an array of its own
  (``backends.wgmma.a_registers``): on the warp-specialized schedule both live across the
  consumers' segments, and the emulator checks each against what its product was issued with.
* dQ summed over the key groups is computed transposed, as FA3 computes it: dQ^T = K^T dS^T, d on
  the consumers' 64-row warpgroups, the query chunk as N, K read as A' and dS staged to a
  canonical tile of its own and read as B', both by descriptor (``TensorPlan.swapped``); each
  thread adds its fragment into dQ_f32 atomically. On H100 the model picks this: five products.
* Correctness: PoCL runs of the wgmma emulation (synchronous ring and roles, three interleaving
  seeds) against the float64 reference and the NumPy backend at ragged sizes, causal too; planted
  bugs fail them.
* SASS: HGMMA in the key launch's hot loop, the roles' setmaxnreg, no spills, no local memory, and
  the model under each launch's static ceiling.
"""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import numpy as numpy_backend
from napkin_dsl.backends import opencl
from napkin_dsl.backends.wgmma import WgmmaPrinter
from napkin_dsl.isel import select_program
from napkin_dsl.paths.plan import WarpGrid
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES, assert_matches_reference, has_nvdisasm
from .test_grad_tensorcore import consistent_inputs

LONG = dict(b=4, h=32, q=8192, x=8192, d=128)
# two key groups, the second 67 keys; query chunks of 32, the last 16 (the key launch), and query
# groups of 128, the last 16 (dQ's launch). d = 128: the summed dQ's rows of d are the x tile's.
RAGGED = dict(b=1, h=1, q=144, x=195, d=128)


def _forward(name: str = "attention_lse"):
    (kernel,) = napkin.load(EXAMPLES / f"{name}.napkin").values()
    return kernel


def test_on_h100_the_model_builds_fa3s_key_launch_on_wgmma():
    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    backward = kernel.grad(**LONG)
    schedule = backward.derivation.schedule
    assert schedule.summed == {"dQ": "dQ_f32"} and schedule.key_stream == 32  # five products
    selected = select_program(backward.gpu_program(None, **LONG))
    assert selected.paths == ("fma", "wgmma", "fma")  # D, the key launch, dQ's cast
    key = selected[1].plan
    assert key.roles is not None and not key.roles.pingpong  # a producer warpgroup and two consumers
    assert (key.mmas["dV"].a, key.mmas["dK"].a) == ("P", "dS") and key.mmas["dV"].a_in_registers and key.mmas["dK"].a_in_registers
    assert not key.mmas["S"].a_in_registers and not key.mmas["dP"].a_in_registers
    assert key.swapped("dQ_f32") and key.grids["dQ_f32"] == WarpGrid("d", 128, 16, "q", 32, 32)
    assert key.shapes["dQ_f32"] == "m64n32k16" and "dQ_f32" in key.roles.drained  # its adds read it
    # the deterministic choice runs both its launches on wgmma too, and costs more (seven products)
    options = kernel.backward_options(**LONG)
    assert options[0].sum_dq
    deterministic = kernel.grad(sum_dq=False, **LONG)
    assert select_program(deterministic.gpu_program(None, **LONG)).paths == ("fma", "wgmma", "wgmma")
    assert options[0].seconds < min(o.seconds for o in options if not o.sum_dq)
    # FlashAttention's convention: at least the done-when's 450 TFLOP/s
    seconds = backward.cost(**LONG).time["overlapped_s"]
    assert 2.5 * 4 * 4 * 32 * 8192 * 8192 * 128 / seconds / 1e12 >= 450

def _run(backward, sizes, synchronous: bool, seed: int, monkeypatch):
    program = backward.gpu_program(None, **sizes)
    selected = select_program(program, "sm_90a", synchronous=synchronous)
    want = ("wgmma", "fma") if backward.derivation.schedule.summed else ("wgmma", "wgmma")
    assert selected.paths[1:] == want, [s.reason or s.declined for s in selected.launches.values()]
    assert (selected[1].plan.roles is None) == synchronous
    inputs = consistent_inputs(backward, sizes, seed)
    monkeypatch.setenv("NAPKIN_EMULATE_SEED", str(seed))
    outputs = opencl.run(program, inputs, {}, arch="sm_90a", synchronous=synchronous)
    return program, inputs, outputs


def _assert_right(program, inputs, outputs, sizes: dict, context: str):
    """Within the Program's tolerance of the float64 reference, and within 4 bf16 units of the
    largest value of the NumPy backend running the same Program (which packs P and dS to bf16 as
    the register A does, and rounds where the emulation rounds)."""
    assert_matches_reference(program, outputs, evaluate(program.diagram, inputs, {}, sizes), context)
    interpreted, _ = numpy_backend.execute(program, inputs, {})
    for name in program.diagram.outputs:
        got, want = outputs[name].astype(np.float64), interpreted[name].astype(np.float64)
        assert np.abs(got - want).max() <= 4 * 2.0**-8 * np.abs(want).max(), f"{context}: {name}"


@pytest.mark.parametrize("sum_dq", [True, False], ids=["summed", "deterministic"])
@pytest.mark.parametrize("synchronous, seed", [(True, 1), (False, 1), (False, 2), (False, 3)])
def test_the_backward_on_wgmma_matches_the_reference_on_pocl(sum_dq, synchronous, seed, monkeypatch, opencl_device):
    backward = _forward().grad(key_stream=32, sum_dq=sum_dq)
    program, inputs, outputs = _run(backward, RAGGED, synchronous, seed, monkeypatch)
    _assert_right(program, inputs, outputs, RAGGED, f"sum_dq={sum_dq} synchronous={synchronous} seed={seed}")


@pytest.mark.parametrize("sum_dq", [True, False], ids=["summed", "deterministic"])
def test_the_causal_backward_on_wgmma_matches_the_reference_on_pocl(sum_dq, monkeypatch, opencl_device):
    """The key launch skips the query chunks before its keys, on the roles' ring."""
    backward = _forward("causal_attention").grad(save_lse=True, key_stream=32, sum_dq=sum_dq)
    sizes = dict(RAGGED, q=208)
    program, inputs, outputs = _run(backward, sizes, False, 1, monkeypatch)
    _assert_right(program, inputs, outputs, sizes, "causal")


def _pack_dk_from_p(monkeypatch):
    # dK's register A packed from P's fragment instead of dS's
    original = WgmmaPrinter.register_a

    def packed(self, m):
        start = len(self.lines)
        original(self, m)
        if m.a == "dS":
            self.lines[start:] = [line.replace("f_dS[", "f_P[") if isinstance(line, str) else line for line in self.lines[start:]]
    monkeypatch.setattr(WgmmaPrinter, "register_a", packed)


def _clobber_ds_in_flight(monkeypatch):
    # dS's registers changed after dK's product was issued and before it was waited for
    from napkin_dsl.backends import pipeline

    original = pipeline.RolesPrinter.mma

    def clobbered(self, target, out):
        original(self, target, out)
        if target == "dK":
            self.emit("nk_a_dS[0][1] ^= 0x00010001u;")
    monkeypatch.setattr(pipeline.RolesPrinter, "mma", clobbered)


def _stage_dp_for_ds(monkeypatch):
    # the summed dQ's staged tile written from dP's fragment instead of dS's
    original = WgmmaPrinter.stage

    def staged(self, name, dtype):
        start = len(self.lines)
        original(self, name, dtype)
        self.lines[start:] = [line.replace("f_dS[", "f_dP[") if isinstance(line, str) else line for line in self.lines[start:]]
    monkeypatch.setattr(WgmmaPrinter, "stage", staged)


@pytest.mark.parametrize("plant, sum_dq", [(_pack_dk_from_p, False), (_clobber_ds_in_flight, False),
                                           (_pack_dk_from_p, True), (_stage_dp_for_ds, True)],
                         ids=["dK from P", "dS clobbered in flight", "dK from P, summed", "dP staged for dS"])
def test_a_planted_bug_in_the_register_operands_fails_the_run(plant, sum_dq, monkeypatch, opencl_device):
    plant(monkeypatch)
    backward = _forward().grad(key_stream=32, sum_dq=sum_dq)
    program, inputs, outputs = _run(backward, RAGGED, False, 1, monkeypatch)
    with pytest.raises(AssertionError):
        _assert_right(program, inputs, outputs, RAGGED, "planted")


def test_the_numpy_backend_counts_the_transposed_products_traffic_as_the_model_prices_it():
    from napkin_dsl.cost import cost_of

    from .test_numpy_backend import assert_counts_equal_report

    backward = _forward().grad(key_stream=32, sum_dq=True)
    program = backward.gpu_program(None, **RAGGED)
    selected = select_program(program, "sm_90a")
    assert selected[1].plan.swapped("dQ_f32")
    inputs = consistent_inputs(backward, RAGGED)
    _, counts = numpy_backend.execute(program, inputs, {}, selected=selected)
    assert_counts_equal_report(counts, cost_of(program, arch="sm_90a", selected=selected, check=False))


def test_the_backward_compiles_on_wgmma_with_no_spills_and_the_model_under_each_ceiling():
    pytest.importorskip("cuda.bindings")
    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    built = kernel.grad(**LONG).compile("sm_90a", "H100", **LONG)
    table = built.launch_table()
    assert [row["path"] for row in table] == ["fma", "wgmma", "fma"]
    assert all(row["spill_bytes"] == 0 for row in table), table
    if not has_nvdisasm():
        return
    from napkin_dsl.backends.sass import hot_loop, sass_report

    report = sass_report(built)
    launch = report["launches"][1]
    loop = hot_loop(launch)
    assert loop["classes"].get("tensor", 0) > 0, launch["entry"]  # HGMMA
    assert launch["whole"].get("local", 0) == 0, launch["entry"]
    ceiling = launch["ceiling"]
    assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9), (launch["entry"], ceiling)


# dK from S's own accumulator, packed as its register A: no map between the products
PACKED = """kernel keys(Q: bf16[q d], K: bf16[x d]) -> dK: bf16[x d]:
    S[q x] = K[x d] * Q[q d]
    dK[x d] = S[q x] * Q[q d]

relabel keys on H100:
    smem: group x 64; stream q 32
"""


@pytest.mark.parametrize("synchronous", [True, False], ids=["synchronous", "roles"])
def test_a_products_accumulator_packed_as_a_later_register_a_is_waited_for(synchronous, opencl_device):
    """The roles wait for S to depth 0 before dK packs it (paths.wgmma.drained_products): left in
    flight, its fragment reads NaN in the emulation."""
    from napkin_dsl.paths.wgmma import drained_products

    from .test_opencl import random_inputs

    (kernel,) = napkin.load(PACKED).values()
    sizes = dict(q=50, x=100, d=64)
    program = kernel.gpu_program(None, **sizes)
    selected = select_program(program, "sm_90a", synchronous=synchronous)
    assert selected.paths == ("wgmma",) and "S" in drained_products(selected[0].plan, program.launches[0])
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(program, inputs, scalars, arch="sm_90a", synchronous=synchronous)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), "packed")


def test_at_d64_the_model_groups_64_keys_so_that_the_summed_dq_runs_on_wgmma():
    """A summed dQ computed transposed takes d on the key group's rows: at d = 64, one warpgroup
    of 64 keys (Kernel.backward_options prices the forward's 128 and 64)."""
    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    sizes = dict(LONG, d=64)
    backward = kernel.grad(**sizes)
    schedule = backward.derivation.schedule
    assert schedule.summed and schedule.key_group == 64
    selected = select_program(backward.gpu_program(None, **sizes))
    assert selected.paths == ("fma", "wgmma", "fma") and selected[1].plan.row_tile == 64
    assert selected[1].plan.swapped("dQ_f32")
    options = kernel.backward_options(**sizes)
    assert (options[0].sum_dq, options[0].key_group) == (True, 64)
    wide = [o for o in options if o.sum_dq and o.key_group == 128 and o.key_stream == options[0].key_stream]
    assert wide and min(o.seconds for o in wide) > options[0].seconds  # 128 keys: dQ on mma.sync


def test_the_summed_backward_with_64_keys_matches_the_reference_on_pocl(monkeypatch, opencl_device):
    backward = _forward().grad(key_stream=32, sum_dq=True, key_group=64)
    sizes = dict(RAGGED, d=64)
    program, inputs, outputs = _run(backward, sizes, False, 2, monkeypatch)
    assert select_program(program, "sm_90a")[1].plan.row_tile == 64
    _assert_right(program, inputs, outputs, sizes, "64 keys")
