"""The Program's step kinds are a closed set: a step of another kind cannot be made, every
backend handles every kind, and the link from a rescaled contraction (or a log-sum-exp) to its
online softmax is stored once, by the stream's roles, on the steps that read its state."""

from __future__ import annotations

import pytest

import napkin_dsl as napkin
from napkin_dsl.backends.lowering import Printer
from napkin_dsl.backends.numpy import Interpreter
from napkin_dsl.pseudocode import STEP_KINDS, Step, walk

from .conftest import EXAMPLES


def test_a_step_of_an_unknown_kind_cannot_be_made():
    with pytest.raises(ValueError, match="unknown kind 'rescael'"):
        Step("rescael", "smem", ("q",))


@pytest.mark.parametrize("backend", [Interpreter, Printer])
def test_every_backend_handles_every_step_kind(backend):
    assert [kind for kind in STEP_KINDS if not callable(getattr(backend, f"step_{kind}", None))] == []


def test_the_online_link_is_on_the_steps_that_read_the_softmax_state():
    (kernel,) = napkin.load(EXAMPLES / "attention_lse.napkin").values()
    program = kernel.program("H100", b=1, h=2, q=256, x=256, d=64)
    linked = {(step.op, step.array): step.online for launch in program.launches
              for step, _ in walk(launch.body) if step.online is not None}
    assert linked == {("rescale", "O"): "P", ("finalise", "O"): "P", ("finalise", "L"): "P"}
    for launch in program.launches:
        for step, _ in walk(launch.body):
            if step.online is not None:  # the state it names is among what it reads
                assert any(name.startswith(f"{step.online}.") for _, name in step.reads), step
