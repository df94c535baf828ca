"""``logsumexp[x]``: a second name for the streamable log-sum-exp, added by one entry in the box
table (boxes.REDUCTION_OPS). It checks, streams beside a softmax, runs and counts as ``lse``."""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends.numpy import execute, random_arguments
from napkin_dsl.cost import cost_of
from napkin_dsl.diagram import Reduce
from napkin_dsl.errors import NapkinError
from napkin_dsl.pseudocode import walk
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES

LSE = (EXAMPLES / "attention_lse.napkin").read_text()
SIZES = {"b": 1, "h": 2, "q": 150, "x": 100, "d": 16}


def spelled(name: str):
    return napkin.load(LSE.replace("lse[x](S)", f"{name}[x](S)"))["attention_lse"]


def test_logsumexp_is_the_lse_reduction():
    kernel = spelled("logsumexp")
    box = kernel.diagram.producer("L").box
    assert isinstance(box, Reduce) and box.op == "lse" and box.axes == ("x",)
    assert kernel.diagram.flops == spelled("lse").diagram.flops


def test_logsumexp_streams_beside_the_softmax_as_lse_does():
    ours, theirs = spelled("logsumexp").program(None, **SIZES), spelled("lse").program(None, **SIZES)
    assert ours.launches[0].launch.streams[0].roles == theirs.launches[0].launch.streams[0].roles
    assert "lse" in ours.launches[0].launch.streams[0].roles.values()
    # L is read off the softmax's state after the stream: a finalise step, no pass of its own
    computed = [step.op for step, _ in walk(ours.launches[0].body) if step.array == "L" and step.op not in ("alloc", "load", "save")]
    assert computed == ["finalise"]
    assert cost_of(ours, check=False).flops == cost_of(theirs, check=False).flops


@pytest.mark.parametrize("relabel", ["group b 1, h 1, q 128; stream x 64", "group b 1, h 1, q 128"])
def test_logsumexp_runs_on_numpy_as_the_reference_and_counts_as_the_model(relabel):
    kernel = napkin.load(LSE.replace("lse[x](S)", "logsumexp[x](S)").replace("group b 1, h 1, q 128; stream x 64", relabel))["attention_lse"]
    program = kernel.program(None, **SIZES)
    arrays, scalars = random_arguments(kernel.diagram, SIZES, 0)
    outputs, counts = execute(program, arrays, scalars)
    want = evaluate(kernel.diagram, arrays, scalars, SIZES, keep_float64=True)["L"]
    assert np.max(np.abs(outputs["L"] - want)) < 1e-4 * np.max(np.abs(want))
    assert counts.differences(cost_of(program, check=False)) == []


def test_a_misspelt_logsumexp_is_a_napkin_error():
    with pytest.raises(NapkinError, match="logsumexp"):
        napkin.load(LSE.replace("lse[x](S)", "logsumxp[x](S)"))


def test_logsumexp_runs_on_opencl_as_the_reference(opencl_device):
    """The generated parallel code, on the CPU (PoCL): the streamed form's L from the softmax's state."""
    from napkin_dsl.backends import opencl

    from .conftest import assert_matches_reference

    kernel = spelled("logsumexp")
    arrays, scalars = random_arguments(kernel.diagram, SIZES, 1)
    program = kernel.gpu_program(None, **SIZES)
    outputs = opencl.run(program, arrays, scalars)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, arrays, scalars, SIZES), "logsumexp")
