"""Scans (issue 46, item 4): cumsum[x] and cumprod[x] as boxes that keep their axis.

Each is checked against torch's cumsum and cumprod in float64 on the reference, the NumPy
backend and OpenCL, at ragged sizes, whole, with the rows grouped and with the scanned axis
streamed (a carry from chunk to chunk); the NumPy backend's counts equal the model's; a split
of the scanned axis and the backward are refused by name.
"""

from __future__ import annotations

import re

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


STREAMED = """kernel k(X: f32[b x]) -> Y: f32[b x]:
    C[b x] = SCAN[x](X)
    Y[b x] = C * 2

relabel k on H100:
    smem: group b 4; stream x 8
"""


@pytest.mark.parametrize("backend", ["numpy", "opencl"])
@pytest.mark.parametrize("scan", ["cumsum", "cumprod"])
def test_a_streamed_scan_carries_its_running_value(scan, backend, request):
    """A stream of the scanned axis: each chunk's scan starts from the carry the chunk before
    left, at sizes no chunk divides (37 in chunks of 8), against torch in float64."""
    if backend == "opencl":
        request.getfixturevalue("opencl_device")
    kernel = _kernel(STREAMED.replace("SCAN", scan))
    X = (1 + 0.1 * np.random.default_rng(3).standard_normal((10, 37))).astype(np.float32)
    want = 2 * (torch.cumsum if scan == "cumsum" else torch.cumprod)(torch.tensor(X, dtype=torch.float64), 1).numpy()
    got = kernel(X, backend=backend)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-5, atol=1e-5)


def test_a_streamed_scan_counts_what_the_model_prices():
    kernel = _kernel(STREAMED.replace("SCAN", "cumsum"))
    program = kernel.program("H100", b=10, x=37)
    arrays, scalars = random_arguments(kernel.diagram, {"b": 10, "x": 37}, 0)
    outputs, counts = execute(program, arrays, scalars)
    np.testing.assert_allclose(outputs["Y"], 2 * np.cumsum(arrays["X"].astype(np.float64), axis=1), rtol=1e-5, atol=1e-5)
    assert_counts_equal_report(counts, cost_of(program, check=False))
    assert any("C.carry = C[last x]" in step.text for step in _steps(program))


def _steps(program):
    from napkin_dsl.pseudocode import walk

    return [step for launch in program.launches for step, _ in walk(launch.body)]


def test_a_streamed_scan_compiles_for_cuda():
    compiled = _kernel(STREAMED.replace("SCAN", "cumsum").replace("f32", "bf16")).compile(arch="sm_80", b=1024, x=4096)
    (resources,) = compiled.resources.values()
    assert resources["spill_bytes"] == 0


def test_a_split_of_the_scanned_axis_is_refused_by_name():
    with pytest.raises(RelabelError, match="consumes 'x' as scan, which has no merge of its parts' states"):
        _kernel(STREAMED.replace("SCAN", "cumsum").replace("stream x 8", "split x 16; stream x 8")).program("H100", b=8, x=64)


def test_a_row_longer_than_shared_memory_streams():
    """A row of a million values (4 MB) fits no tile: the tuner streams it."""
    result = _kernel(GROUPED).tune("H100", top=1, b=64, x=1 << 20)
    assert "stream x" in result.best.relabel_line()


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


def test_the_tuner_never_groups_the_scanned_axis():
    result = _kernel(GROUPED).tune("H100", top=1, b=4096, x=4096)
    assert result.configurations and result.best.time_s > 0
    line = result.best.relabel_line()
    groups = line.split("group", 1)[1].split(";")[0] if "group" in line else ""
    assert not re.search(r"\bx\b", groups), line  # the scanned axis is never grouped


def test_a_scan_draws():
    svg = _kernel(GROUPED).render()
    assert "cumsum[x]" in svg
