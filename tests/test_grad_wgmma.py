"""The derived backward on wgmma (issue 47, item 3): a map computed in registers between two
products is a later product's register A, as attention's P is in the forward.

* The deterministic backward's two tensor-core launches build on sm_90a: the key launch's dV takes
  P = exp(S - L) and its dK takes dS = P * (dP - D) from registers, S and dP by descriptor; dQ's
  launch takes its dS the same way. Each product's register A is an array of its own
  (``backends.wgmma.a_registers``): on the warp-specialized schedule both live across the
  consumers' segments, and the emulator checks each against what its product was issued with.
* On H100 the model prefers this to summing dQ in the key launch, whose dQ product (rows of its
  own, staged through shared memory) stays on mma.sync.
* Correctness: PoCL runs of the wgmma emulation (synchronous ring and roles, three interleaving
  seeds) against the float64 reference at ragged sizes, causal too; planted bugs fail them.
* SASS: HGMMA in both launches' hot loops, the roles' setmaxnreg, no spills, no local memory, and
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
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES, assert_matches_reference, has_nvdisasm
from .test_grad_tensorcore import consistent_inputs

LONG = dict(b=4, h=32, q=8192, x=8192, d=128)
# two key groups, the second 67 keys; three query chunks of 64, the last 16 (the key launch), and
# two query groups of 128, the second 16 (dQ's launch)
RAGGED = dict(b=1, h=1, q=144, x=195, d=64)


def _forward(name: str = "attention_lse"):
    (kernel,) = napkin.load(EXAMPLES / f"{name}.napkin").values()
    return kernel


def test_on_h100_the_model_builds_both_backward_launches_on_wgmma():
    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    backward = kernel.grad(**LONG)
    schedule = backward.derivation.schedule
    assert schedule.summed == {} and schedule.key_stream == 32  # deterministic: dQ's launch recomputes
    selected = select_program(backward.gpu_program(None, **LONG))
    assert selected.paths == ("fma", "wgmma", "wgmma")
    key, query = selected[1].plan, selected[2].plan
    assert key.roles is not None and query.roles is not None  # a producer warpgroup and consumers
    assert (key.mmas["dV"].a, key.mmas["dK"].a) == ("P", "dS") and key.mmas["dV"].a_in_registers and key.mmas["dK"].a_in_registers
    assert not key.mmas["S"].a_in_registers and not key.mmas["dP"].a_in_registers
    assert query.mmas["dQ"].a == "dS_1" and query.mmas["dQ"].a_in_registers
    # the model's pick: cheaper than the atomic sums, whose key launch stays on mma.sync
    options = kernel.backward_options(**LONG)
    assert not options[0].sum_dq
    summed = min(o.seconds for o in options if o.sum_dq)
    assert options[0].seconds < summed
    atomic = kernel.grad(sum_dq=True, **LONG)
    refused = select_program(atomic.gpu_program(None, **LONG))[1]
    assert refused.path == "mma.sync" and "dQ_f32's rows are not x" in refused.declined


def _run(backward, sizes, synchronous: bool, seed: int, monkeypatch):
    program = backward.gpu_program(None, **sizes)
    selected = select_program(program, "sm_90a", synchronous=synchronous)
    assert selected.paths[1:] == ("wgmma", "wgmma"), [s.reason for s in selected.launches.values()]
    assert (selected[1].plan.roles is None) == synchronous
    inputs = consistent_inputs(backward, sizes, seed)
    monkeypatch.setenv("NAPKIN_EMULATE_SEED", str(seed))
    outputs = opencl.run(program, inputs, {}, arch="sm_90a", synchronous=synchronous)
    return program, inputs, outputs


def _assert_right(program, inputs, outputs, sizes: dict, context: str):
    """Within the Program's tolerance of the float64 reference, and within 4 bf16 units of the
    largest value of the NumPy backend running the same Program (which packs P and dS to bf16 as
    the register A does): the tolerance read off a backward's Program is loose (its exponentials'
    worst case), so the second is the check that catches a wrong operand."""
    assert_matches_reference(program, outputs, evaluate(program.diagram, inputs, {}, sizes), context)
    interpreted, _ = numpy_backend.execute(program, inputs, {})
    for name in program.diagram.outputs:
        got, want = outputs[name].astype(np.float64), interpreted[name].astype(np.float64)
        assert np.abs(got - want).max() <= 4 * 2.0**-8 * np.abs(want).max(), f"{context}: {name}"


@pytest.mark.parametrize("synchronous, seed", [(True, 1), (False, 1), (False, 2), (False, 3)])
def test_the_deterministic_backward_on_wgmma_matches_the_reference_on_pocl(synchronous, seed, monkeypatch, opencl_device):
    backward = _forward().grad(key_stream=64, sum_dq=False)
    program, inputs, outputs = _run(backward, RAGGED, synchronous, seed, monkeypatch)
    _assert_right(program, inputs, outputs, RAGGED, f"synchronous={synchronous} seed={seed}")


def test_the_causal_backward_on_wgmma_matches_the_reference_on_pocl(monkeypatch, opencl_device):
    """The key launch skips the query chunks before its keys, on the roles' ring."""
    backward = _forward("causal_attention").grad(save_lse=True, key_stream=64, sum_dq=False)
    sizes = dict(b=1, h=1, q=208, x=195, d=64)
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


@pytest.mark.parametrize("plant", [_pack_dk_from_p, _clobber_ds_in_flight])
def test_a_planted_bug_in_the_register_operands_fails_the_run(plant, monkeypatch, opencl_device):
    plant(monkeypatch)
    backward = _forward().grad(key_stream=64, sum_dq=False)
    program, inputs, outputs = _run(backward, RAGGED, False, 1, monkeypatch)
    with pytest.raises(AssertionError):
        _assert_right(program, inputs, outputs, RAGGED, "planted")


def test_the_backward_compiles_on_wgmma_with_no_spills_and_the_model_under_each_ceiling():
    pytest.importorskip("cuda.bindings")
    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    built = kernel.grad(**LONG).compile("sm_90a", "H100", **LONG)
    table = built.launch_table()
    assert [row["path"] for row in table] == ["fma", "wgmma", "wgmma"]
    assert all(row["spill_bytes"] == 0 for row in table), table
    if not has_nvdisasm():
        return
    from napkin_dsl.backends.sass import hot_loop, sass_report

    report = sass_report(built)
    for launch in report["launches"][1:]:
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
