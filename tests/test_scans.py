"""Scans (issue 46, item 4): cumsum[x] and cumprod[x] as boxes that keep their axis.

Each is checked against torch's cumsum and cumprod in float64 on the reference, the NumPy
backend and OpenCL, at ragged sizes, whole and with the rows grouped; the NumPy backend's
counts equal the model's; a stream of the scanned axis is refused by name, as is the backward.
"""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends.numpy import execute, random_arguments, tolerance
from napkin_dsl.cost import cost_of
from napkin_dsl.errors import NapkinTypeError, RelabelError

from .test_numpy_backend import assert_counts_equal_report

torch = pytest.importorskip("torch")


def _kernel(text: str) -> napkin.Kernel:
    (kernel,) = napkin.load(text).values()
    return kernel


CASES = {
    "cumsum along the last axis": (
        """kernel k(X: f32[b x]) -> Y: f32[b x]:
    Y[b x] = cumsum[x](X)
""", (7, 37), lambda X: torch.cumsum(X, 1)),
    "cumsum along the first axis, of an expression": (
        """kernel k(X: f32[x b]) -> Y: f32[x b]:
    Y[x b] = cumsum[x](X * X - 0.5)
""", (29, 5), lambda X: torch.cumsum(X * X - 0.5, 0)),
    "cumprod near 1": (
        """kernel k(X: f32[b x]) -> Y: f32[b x]:
    Y[b x] = cumprod[x](1 + 0.1 * X)
""", (6, 23), lambda X: torch.cumprod(1 + 0.1 * X, 1)),
    "masked cumsum (exclusive of the first two)": (
        """kernel k(X: f32[b x]) -> Y: f32[b x]:
    Y[b x] = cumsum[x](where(x >= 2, X, 0))
""", (5, 19), lambda X: torch.cumsum(torch.where(torch.arange(19) >= 2, X, torch.zeros(())), 1)),
    "cumsum feeding a map": (
        """kernel k(X: f32[b x]) -> Y: f32[b x]:
    C[b x] = cumsum[x](X)
    Y[b x] = C / (x + 1)
""", (4, 17), lambda X: torch.cumsum(X, 1) / torch.arange(1, 18)),
}


@pytest.mark.parametrize("backend", ["reference", "numpy", "opencl"])
@pytest.mark.parametrize("case", list(CASES))
def test_scans_match_torch(case, backend, request):
    text, shape, torch_op = CASES[case]
    if backend == "opencl":
        request.getfixturevalue("opencl_device")
    kernel = _kernel(text)
    X = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    want = torch_op(torch.tensor(X, dtype=torch.float64)).numpy()
    got = napkin.reference.reference(kernel, X) if backend == "reference" else kernel(X, backend=backend)
    limit = tolerance(kernel.program(None, **napkin.binding.bind(kernel, {"X": X}).sizes))
    error = float(np.max(np.abs(got.astype(np.float64) - want)))
    assert error <= limit * float(np.max(np.abs(want))), f"{case} on {backend}: max error {error:.3g}"


GROUPED = """kernel k(X: f32[b x]) -> Y: f32[b x]:
    Y[b x] = cumsum[x](X * 2)

relabel k on H100:
    smem: group b 4
"""


def test_grouped_rows_count_what_the_model_prices():
    kernel = _kernel(GROUPED)
    program = kernel.program("H100", b=10, x=37)
    arrays, scalars = random_arguments(kernel.diagram, {"b": 10, "x": 37}, 0)
    outputs, counts = execute(program, arrays, scalars)
    np.testing.assert_allclose(outputs["Y"], np.cumsum(arrays["X"].astype(np.float64) * 2, axis=1), rtol=1e-5, atol=1e-5)
    report = cost_of(program, check=False)
    assert_counts_equal_report(counts, report)
    assert int(report.flops["fma"]) == 2 * 10 * 37  # the operand's multiply and the running add, per element


def test_grouped_rows_on_opencl(opencl_device):
    kernel = _kernel(GROUPED)
    X = np.random.default_rng(2).standard_normal((10, 37)).astype(np.float32)
    np.testing.assert_allclose(kernel(X, backend="opencl"), np.cumsum(X.astype(np.float64) * 2, axis=1), rtol=1e-5, atol=1e-5)


def test_a_scan_compiles_for_cuda():
    kernel = _kernel(GROUPED.replace("f32", "bf16"))
    compiled = kernel.compile(arch="sm_80", b=1024, x=4096)
    (resources,) = compiled.resources.values()
    assert resources["spill_bytes"] == 0
    assert "run += " in compiled.source


def test_a_scan_is_not_woven_over_its_axis():
    with pytest.raises(RelabelError, match="cannot group-partition x: it is consumed by scan Y"):
        _kernel(GROUPED.replace("group b 4", "group b 4, x 8")).program("H100", b=8, x=64)


def test_a_stream_of_the_scanned_axis_is_refused_by_name():
    with pytest.raises(RelabelError, match=r"cannot stream x: cumsum\[x\] \(line 2\) carries its running sum along 'x'"):
        _kernel(GROUPED.replace("group b 4", "group b 4; stream x 8")).program("H100", b=8, x=64)


@pytest.mark.parametrize("text, message", [
    ("    Y[b x] = cumsum(X)\n", "cumsum needs exactly one axis, got none"),
    ("    Y[b x] = cumsum[b x](X)\n", r"cumsum needs exactly one axis, got \[b x\]"),
    ("    Y[b x] = cumsum[q](X)\n", "cumsum\\[q\\] acts along axis 'q', but its operand has axes \\[b x\\]"),
    ("    Y[b x] = 1 + cumsum[x](X)\n", "must be the whole right-hand side of a statement"),
])
def test_scan_mistakes(text, message):
    with pytest.raises(NapkinTypeError, match=message):
        napkin.load("kernel k(X: f32[b x]) -> Y: f32[b x]:\n" + text)


def test_the_backward_of_a_scan_is_refused_by_name():
    with pytest.raises(NotImplementedError, match=r"the backward of cumsum\[x\] \(Y, line 2\) is not derived yet"):
        _kernel(GROUPED).grad()


def test_the_tuner_spreads_the_rows():
    result = _kernel(GROUPED).tune("H100", top=1, b=4096, x=4096)
    assert result.configurations and result.best.time_s > 0
    assert "x" not in result.best.relabel_line()  # never a group or stream of the scanned axis


def test_a_scan_draws():
    svg = _kernel(GROUPED).render()
    assert "cumsum[x]" in svg
