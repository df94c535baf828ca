"""The table of box kinds (``boxes.py``) is the one place a reduction is defined.

The proof: a reduction napkin does not have, ``prod[j](X)``, added by one entry in
``boxes.REDUCTION_TABLE`` (and its name in ``REDUCTION_OPS``), with nothing else changed. It
checks, counts its FLOPs, streams as an accumulator, and computes the product on the float64
reference, on the NumPy backend (unstreamed and streamed, its counts equal to the model) and in
the generated OpenCL, and compiles to CUDA with a warp fold of its own. The table's own entries are checked against NumPy's definitions too.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import boxes
from napkin_dsl.backends.numpy import execute, random_arguments
from napkin_dsl.boxes import REDUCTION_OPS, REDUCTION_TABLE, Reduction, reduction
from napkin_dsl.cost import cost_of
from napkin_dsl.reference import ELEMENTWISE, evaluate, reduce_along

PRODUCT = """
kernel products(X: f32[i j]) -> Y: f32[i]:
    Y[i] = prod[j](X)
"""
STREAMED = PRODUCT + """
relabel products on H100:
    smem: group i 32; stream j 8
"""
SIZES = {"i": 70, "j": 37}  # ragged: neither tile divides its axis


@pytest.fixture
def with_prod(monkeypatch):
    """napkin with one more reduction: the product, from 1, folded by multiplication."""
    monkeypatch.setitem(REDUCTION_TABLE, "prod", Reduction("prod", 1.0, "mul"))
    monkeypatch.setitem(REDUCTION_OPS, "prod", "prod")


def arguments(kernel, seed: int):
    arrays, scalars = random_arguments(kernel.diagram, SIZES, seed)
    # values near 1, so that a product of 37 of them stays well inside f32's range and precision
    arrays["X"] = (1.0 + 0.05 * arrays["X"]).astype(np.float32)
    return arrays, scalars


def test_without_the_entry_prod_is_unknown():
    with pytest.raises(napkin.NapkinError, match="prod"):
        napkin.load(PRODUCT)


def test_a_new_reduction_checks_and_counts_from_its_entry(with_prod):
    kernel = napkin.load(PRODUCT)["products"]
    box = kernel.diagram.producer("Y").box
    assert box.op == "prod"
    i, j = (kernel.diagram.axes[a].size for a in "ij")
    assert kernel.diagram.flops == i * j  # one multiplication per value folded in


@pytest.mark.parametrize("source", [PRODUCT, STREAMED], ids=["unstreamed", "streamed"])
def test_a_new_reduction_runs_on_the_reference_and_numpy(with_prod, source):
    kernel = napkin.load(source)["products"]
    arrays, scalars = arguments(kernel, 0)
    want = np.prod(arrays["X"].astype(np.float64), axis=1)
    reference = evaluate(kernel.diagram, arrays, scalars, SIZES, keep_float64=True)["Y"]
    np.testing.assert_allclose(reference, want, rtol=1e-12)
    program = kernel.program("H100" if source is STREAMED else None, **SIZES)
    if source is STREAMED:
        roles = program.launches[0].launch.streams[0].roles
        assert set(roles.values()) == {"accumulate"}
    outputs, counts = execute(program, arrays, scalars)
    np.testing.assert_allclose(outputs["Y"], want, rtol=1e-5)
    assert counts.differences(cost_of(program, check=False)) == []


def test_a_new_reduction_runs_in_the_generated_opencl(with_prod, opencl_device):
    from napkin_dsl.backends import opencl

    kernel = napkin.load(STREAMED)["products"]
    arrays, scalars = arguments(kernel, 1)
    outputs = opencl.run(kernel.gpu_program(None, **SIZES), arrays, scalars)
    np.testing.assert_allclose(outputs["Y"], np.prod(arrays["X"].astype(np.float64), axis=1), rtol=1e-5)


def test_a_new_reduction_compiles_to_cuda_with_its_own_warp_fold(with_prod):
    """NVRTC (no GPU needed): the CUDA prelude folds a warp with every function of the table."""
    compiled = napkin.load(STREAMED)["products"].compile("sm_90", **SIZES)
    assert "nk_warp_mul(" in compiled.source and "(v * __shfl_xor_sync" in compiled.source
    assert all(row["spill_bytes"] == 0 for row in compiled.launch_table())


@pytest.mark.parametrize("op", [op for op in REDUCTION_TABLE if REDUCTION_TABLE[op].combine is not None])
def test_each_entry_is_numpys_reduction(op):
    """The table's start is the identity of its fold, and the fold is NumPy's reduction."""
    entry = reduction(op)
    values = np.random.default_rng(0).standard_normal((5, 6))
    numpy_reduction = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op]
    np.testing.assert_allclose(reduce_along(op, values, (1,)), numpy_reduction(values, axis=1), rtol=1e-12)
    fold = ELEMENTWISE[entry.combine]
    assert np.all(fold(values, entry.start) == values)  # the start changes no value it is folded with
    assert entry.divides == (op == "mean")


def test_every_name_is_an_entry():
    assert all(op in REDUCTION_TABLE for op in REDUCTION_OPS.values())
    assert all(REDUCTION_OPS[op] == op for op in REDUCTION_TABLE)  # each entry callable by its own name
    assert boxes.reduction("sum").start_text == "0" and boxes.reduction("max").start_text == "-inf"
    assert math.isinf(boxes.reduction("min").start) and boxes.reduction("min").start_text == "+inf"
