"""Derived backward kernels of random programs (issue 24): gradients against finite differences.

The test suite's program generator (``fuzz_programs.programs`` and ``attention_programs``)
draws kernels napkin has never seen: maps over every elementwise function, reductions, softmax
and lse, contractions with broadcast operands, masks, relabellings with groups and streams. Each
is made float64 throughout (every float dtype replaced by f64, so that the oracle is exact to
many digits), called with torch tensors that require grad, and ``loss = sum(out * W)`` is
differentiated by the derived backward kernel on the NumPy backend (``Kernel.grad``, through
the ``torch.autograd.Function`` of ``kernel.py``).

The oracle shares no code with ``grad.py``: central finite differences of the float64 reference
evaluator (``reference.evaluate``) along a random direction, ``(loss(x + eV) - loss(x - eV)) / 2e``,
against ``sum(grad * V)``. The step is halved once and the two differences Richardson-combined,
so that the truncation error is O(e^4); the tolerance is relative to ``sum(|grad * V|)``, the
size of the terms that cancel.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import napkin_dsl as napkin
from napkin_dsl.errors import NapkinError
from napkin_dsl.reference import evaluate

from .fuzz_programs import attention_programs, fuzz_inputs, kernel_sizes, programs

torch = pytest.importorskip("torch")

FLOAT_DTYPES = r"\b(bf16|f16|f32|fp8e4m3|fp8e5m2|fp8)\b"  # every float dtype name and alias (diagram.py)
STEP = 1e-4


def _float64(text: str) -> str:
    return re.sub(FLOAT_DTYPES, "f64", text)


def _loss(diagram, inputs: dict, scalars: dict, sizes: dict, weights: dict) -> float:
    outputs = evaluate(diagram, inputs, scalars, sizes, keep_float64=True)
    with np.errstate(invalid="ignore"):  # 0 * inf where an output is weighted 0
        return float(sum(np.sum(np.where(weights[name] != 0, outputs[name] * weights[name], 0)) for name in weights))


def _directional(diagram, inputs, scalars, sizes, weights, direction, step: float) -> float:
    def at(sign: float) -> float:
        moved = {name: value + sign * step * direction[name] if name in direction else value
                 for name, value in inputs.items()}
        return _loss(diagram, moved, scalars, sizes, weights)

    return (at(1.0) - at(-1.0)) / (2 * step)


def _check_gradients(case, backend: str = "numpy") -> None:
    try:
        kernels = napkin.load(_float64(case.text))
    except NapkinError:
        assume(False)  # float64 doubles every tile: a relabelling drawn for f32 may no longer fit
        return
    for kernel in kernels.values():
        diagram = kernel.diagram
        sizes = kernel_sizes(kernel, case)
        try:
            kernel.program(case.hardware, **sizes)
        except NapkinError:
            continue  # refused where it is planned (a level the hardware lacks): the fuzz suite's rejection
        axis_sizes = {a: sizes[a] for a in diagram.axes}
        inputs, scalars = fuzz_inputs(diagram, axis_sizes, case.seed)
        floats = [a.name for a in diagram.input_arrays if a.dtype == "f64"]
        if not floats:
            continue
        try:
            kernel.grad()
        except NapkinError as error:  # only an opaque box has no backward (grad.py)
            assert "opaque box" in str(error), str(error)
            continue
        except NotImplementedError as error:  # a scan's or a window read's: refused by name (grad.py)
            assert "is not derived yet" in str(error), str(error)
            continue
        rng = np.random.default_rng(case.seed + 1)
        # An output that is infinite (the lse of a row masked out entirely) carries no
        # gradient: it is weighted 0, and the loss leaves it out rather than reading 0 * inf.
        forward = evaluate(diagram, inputs, scalars, axis_sizes, keep_float64=True)
        weights = {name: np.where(np.isfinite(forward[name]), rng.standard_normal(forward[name].shape), 0.0)
                   for name in diagram.outputs if diagram.arrays[name].dtype == "f64"}
        if not weights:
            continue
        direction = {name: rng.standard_normal(inputs[name].shape) for name in floats}

        tensors = {name: torch.from_numpy(value.copy()) for name, value in inputs.items()}
        for name in floats:
            tensors[name].requires_grad_()
        carried = {a for array in diagram.input_arrays for a in array.axes}
        extra = {k: v for k, v in sizes.items() if k not in carried}
        args = [tensors[p] if p in tensors else scalars[p] for p in diagram.params]
        try:
            result = kernel(*args, backend=backend, hardware=case.hardware, sizes=extra or None)
        except NapkinError as error:  # what a GPU backend refuses (an i32 array), it refuses clearly
            assert backend != "numpy", str(error)
            continue
        outputs = result if isinstance(result, dict) else {diagram.outputs[0]: result}
        loss = sum(torch.where(torch.from_numpy(np.asarray(w != 0)), outputs[name] * torch.from_numpy(np.asarray(w)), 0).sum()
                   for name, w in weights.items())
        loss.backward()

        terms = sum(float(np.sum(np.abs(tensors[n].grad.numpy() * direction[n])))
                    for n in floats if tensors[n].grad is not None)
        derived = sum(float(np.sum(tensors[n].grad.numpy() * direction[n]))
                      for n in floats if tensors[n].grad is not None)
        coarse = _directional(diagram, inputs, scalars, axis_sizes, weights, direction, STEP)
        fine = _directional(diagram, inputs, scalars, axis_sizes, weights, direction, STEP / 2)
        difference = (4 * fine - coarse) / 3
        scale = max(terms, abs(difference), 1e-12)
        assert abs(derived - difference) <= 1e-5 * scale, (
            f"{diagram.name}: the backward's directional derivative {derived!r} differs from the "
            f"finite difference {difference!r} (terms {terms:.3g}; sizes {axis_sizes})\n{case.describe()}\n"
            f"--- backward:\n{kernel.grad().source}")


SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


@SETTINGS
@given(programs(max_size=4, opencl=False))
def test_random_programs_backward_matches_finite_differences(case):
    _check_gradients(case)


@SETTINGS
@given(attention_programs(max_size=5, opencl=False))
def test_random_attention_backward_matches_finite_differences(case):
    _check_gradients(case)


@settings(max_examples=12, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(case=attention_programs(max_size=5, opencl=True))
def test_random_attention_backward_on_pocl_matches_finite_differences(case, opencl_device):
    """The same on PoCL: the forward and its derived backward printed as OpenCL kernels (f64)."""
    _check_gradients(case, "opencl")


@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@given(st.integers(1, 4), st.integers(1, 4))
def test_a_sum_of_an_operand_that_lacks_the_axis_scales_by_the_size(s, t):
    """``sum[s](abs(c) + X[s])`` with a scalar ``c``: c's cotangent is the sum's cotangent times
    len(s) (summing an expression along an axis it lacks is no statement the checker accepts)."""
    (kernel,) = napkin.load("kernel k(c: f64[], X: f64[s], Y: f64[t]) -> O: f64[t]:\n"
                            "    R[] = sum[s](abs(c) + X[s])\n"
                            "    O[t] = R * Y[t]\n").values()
    c = torch.tensor(-1.5, dtype=torch.float64, requires_grad=True)
    X = torch.randn(s, dtype=torch.float64, requires_grad=True)
    Y = torch.randn(t, dtype=torch.float64, requires_grad=True)
    kernel(c, X, Y).sum().backward()
    np.testing.assert_allclose(c.grad.numpy(), -s * Y.detach().sum().numpy(), rtol=1e-12)
    np.testing.assert_allclose(X.grad.numpy(), np.full(s, Y.detach().sum().numpy()), rtol=1e-12)
