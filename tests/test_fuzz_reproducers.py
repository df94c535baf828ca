"""The three defects issue 26 found by fuzzing, each with its complete reproducer.

1. A fully masked row: the lse is -inf there on both sides, and -inf - -inf is NaN, so the run
   check (``napkin run``) said FAILED on right outputs. Equal infinities now match; an infinity
   or a NaN against a finite reference (or the other way) still fails.
2. An unstreamed lse after selection chose the tensor-core path: the printer refused it. It is
   printed now (a row reduction over the fragments: max, then sum of exp, quad shuffles), and
   every launch selection sends to that path in the examples and here prints.
3. A float value stored as an integer (``H[i] @gmem i32 = X * 2``): the backends rounded it, the
   reference did not. It is refused with a caret (napkin has no cast); integer storage of
   integer values is rounded in the reference as every backend stores it.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import isel
from napkin_dsl.backends import numpy as numpy_backend
from napkin_dsl.backends.lowering import CudaDialect
from napkin_dsl.backends.numpy import check_run, reference_error, run_program
from napkin_dsl.backends.tensorcore import TensorPrinter
from napkin_dsl.cli import main
from napkin_dsl.errors import NapkinError
from napkin_dsl.reference import evaluate

from .conftest import NAPKIN_EXAMPLES, assert_matches_reference
from .test_opencl import random_inputs

INF = np.inf


def napkin_cli(*argv) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main([str(a) for a in argv])
    return code, out.getvalue()


def only(source: str):
    (kernel,) = napkin.load(source).values()
    return kernel


# ---- 1. a fully masked row ------------------------------------------------------------------------

MASKED = """\
kernel attn(Q: f32[q d], K: f32[x d], V: f32[x d]) -> (O: f32[q d], L: f32[q]):
    S[q x] = Q * K
    P[q x] = softmax[x](where(x > q, S, -inf))
    O[q d] = P * V
    L[q] = lse[x](where(x > q, S, -inf))
"""
MASKED_SIZES = {"q": 4, "x": 4, "d": 2}


def test_the_masked_row_is_minus_infinity_and_zero_on_the_backend():
    """The outputs the check used to call wrong are right: row 3 (no x > 3) is fully masked."""
    kernel = only(MASKED)
    program = kernel.program(None, **MASKED_SIZES)
    arrays, scalars = numpy_backend.random_arguments(kernel.diagram, MASKED_SIZES, 0)
    outputs, _ = run_program("numpy", program, arrays, scalars)
    assert outputs["L"][3] == -INF and np.all(outputs["O"][3] == 0)
    assert np.all(np.isfinite(outputs["L"][:3]))


def test_a_fully_masked_row_checks_ok():
    result = check_run(only(MASKED), sizes=MASKED_SIZES)
    assert result["ok"], result
    assert result["max_abs_error"] < 1e-6


@pytest.mark.parametrize("backend", ["numpy", "opencl"])
def test_napkin_run_passes_the_fully_masked_row(backend, tmp_path, request):
    if backend == "opencl":
        request.getfixturevalue("opencl_device")
    path = tmp_path / "masked.napkin"
    path.write_text(MASKED)
    code, out = napkin_cli("run", path, "--backend", backend, "--set", "q=4", "x=4", "d=2")
    assert code == 0, out
    assert ": ok" in out and "FAILED" not in out and "nan" not in out


@pytest.mark.parametrize("got, want, error", [
    ([-INF, 1.0], [-INF, 1.0], 0.0),   # equal infinities match
    ([INF, 2.0], [INF, 2.0], 0.0),
    ([-INF, 1.5], [-INF, 1.0], 0.5),   # and the finite entries are still measured
    ([0.0, 1.0], [-INF, 1.0], INF),    # a finite value where the reference is -inf
    ([-INF, 1.0], [0.0, 1.0], INF),    # -inf where the reference is finite
    ([INF, 1.0], [-INF, 1.0], INF),    # the wrong infinity
    ([np.nan, 1.0], [0.0, 1.0], INF),  # NaN where the reference is finite
    ([0.0, 1.0], [np.nan, 1.0], INF),  # and the other way
    ([np.nan, 1.0], [-INF, 1.0], INF),
])
def test_reference_error_matches_equal_infinities_only(got, want, error):
    measured, _ = reference_error(np.array(got), np.array(want))
    assert measured == error


def test_the_scale_of_the_relative_error_is_over_finite_reference_values():
    # an infinite reference entry must not make every finite error relatively 0
    assert reference_error(np.array([-INF, 3.0]), np.array([-INF, 2.0])) == (1.0, 2.0)


@pytest.mark.parametrize("wrong", ["finite where -inf", "-inf where finite", "nan", "+inf where -inf"])
def test_the_check_still_fails_a_wrong_infinity_or_nan(wrong, monkeypatch):
    """Both directions through check_run itself: the backend's outputs spoiled in one entry."""
    real = numpy_backend.run_program

    def spoiled(*args, **kwargs):
        outputs, counts = real(*args, **kwargs)
        L, O = outputs["L"].copy(), outputs["O"].copy()
        assert L[3] == -INF  # the masked row, which the spoiling relies on
        if wrong == "finite where -inf":
            L[3] = 0.0
        elif wrong == "-inf where finite":
            L[0] = -INF
        elif wrong == "nan":
            O[1, 0] = np.nan
        else:
            L[3] = INF
        return {**outputs, "L": L, "O": O}, counts

    monkeypatch.setattr(numpy_backend, "run_program", spoiled)
    result = check_run(only(MASKED), sizes=MASKED_SIZES)
    assert not result["ok"]
    assert result["max_abs_error"] == INF


def test_the_test_suites_reference_comparison_matches_equal_infinities_only():
    program = only(MASKED).program(None, **MASKED_SIZES)
    want = {"O": np.zeros((4, 2)), "L": np.array([0.5, 1.0, 2.0, -INF])}
    assert_matches_reference(program, {"O": want["O"], "L": want["L"].copy()}, want, "equal")
    for spoiled in ([0.5, 1.0, 2.0, 0.0], [-INF, 1.0, 2.0, -INF], [0.5, np.nan, 2.0, -INF]):
        with pytest.raises(AssertionError):
            assert_matches_reference(program, {"O": want["O"], "L": np.array(spoiled)}, want, "spoiled")


# ---- 2. an unstreamed lse on the tensor-core path ---------------------------------------------------

TENSOR_LSE = """\
kernel attn(Q: bf16[q d], K: bf16[x d], V: bf16[x d]) -> (O: f32[q d], L: f32[q]):
    S[q x] = Q * K
    P[q x] = softmax[x](S)
    O[q d] = P * V
    L[q] = lse[x](S)

relabel attn on H100:
    smem: group q 16
"""
# the same with every row past q = 22 fully masked (no x > q + 40 below x = 64)
TENSOR_LSE_MASKED = TENSOR_LSE.replace("softmax[x](S)", "softmax[x](where(x > q + 40, S, -inf))").replace(
    "lse[x](S)", "lse[x](where(x > q + 40, S, -inf))")
TENSOR_SIZES = {"q": 32, "x": 64, "d": 32}


@pytest.mark.parametrize("source", [TENSOR_LSE, TENSOR_LSE_MASKED], ids=["plain", "masked"])
def test_the_unstreamed_lse_runs_on_the_tensor_core_path_on_pocl(source, opencl_device):
    from napkin_dsl.backends import opencl

    kernel = only(source)
    program = kernel.gpu_program(None, **TENSOR_SIZES)
    assert [isel.selection(program, launch).path for launch in program.launches] == ["mma.sync"]
    inputs, scalars = random_inputs(kernel.diagram, TENSOR_SIZES)
    outputs = opencl.run(program, inputs, scalars)
    expected = evaluate(kernel.diagram, inputs, scalars, TENSOR_SIZES)
    assert_matches_reference(program, outputs, expected, "unstreamed lse")
    if source is TENSOR_LSE_MASKED:
        assert np.all(outputs["L"][23:] == -INF) and np.all(outputs["O"][23:] == 0)
    # the lse itself, to f32 accuracy: its max + log(sum) is not off by a bf16 rounding
    finite = np.isfinite(expected["L"])
    np.testing.assert_allclose(outputs["L"][finite], expected["L"][finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", [TENSOR_LSE, TENSOR_LSE_MASKED], ids=["plain", "masked"])
def test_the_unstreamed_lse_compiles_with_nvrtc_on_the_tensor_core_path(source, arch):
    compiled = only(source).compile(arch, **TENSOR_SIZES)
    assert compiled.image[:4] == b"\x7fELF"
    (row,) = compiled.launch_table()
    assert row["spill_bytes"] == 0, row
    assert "NK_MMA_BF16" in compiled.source and "f_L[mt][h] = (top == -NK_INF) ? -NK_INF" in compiled.source


def test_napkin_cuda_prints_the_unstreamed_lse(tmp_path):
    path = tmp_path / "lse.napkin"
    path.write_text(TENSOR_LSE)
    code, out = napkin_cli("cuda", path, "--set", "q=32", "x=64", "d=32")
    assert code == 0, out
    assert "not implemented" not in out and "NK_MMA_BF16" in out


# Every launch of the corpus (the examples and the reproducers above), at sizes the fragments
# divide, on both archs: what selection sends to the tensor-core path, its printer prints.
CORPUS = [(str(p.name), p.read_text()) for p in NAPKIN_EXAMPLES] + [("TENSOR_LSE", TENSOR_LSE), ("TENSOR_LSE_MASKED", TENSOR_LSE_MASKED)]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name, source", CORPUS, ids=[name for name, _ in CORPUS])
def test_selection_never_chooses_what_the_tensor_core_printer_cannot_print(name, source, arch):
    printed = 0
    for kernel in napkin.load(source).values():
        sizes = {axis: 64 for axis in kernel.diagram.axes}
        try:
            program = kernel.gpu_program(None, **sizes)
        except NapkinError:
            continue  # not plannable at these sizes (an opaque box, a group size to bind): nothing selected
        for launch in program.launches:
            chosen = isel.selection(program, launch, arch)
            if chosen.plan is None:
                continue
            kernel_source = TensorPrinter(program, launch, CudaDialect(), chosen.plan).print("k")
            assert "NK_MMA_" in kernel_source.text
            printed += 1
    if name.startswith("TENSOR_LSE") or name == "attention.napkin":
        assert printed == 1  # on the tensor-core path (the test reaches it), and printed


# ---- 3. a float value stored as an integer ----------------------------------------------------------

INTEGER_OF_FLOAT = """\
kernel k(X: f32[i]) -> (Y: f32[i]):
    H[i] @gmem i32 = X * 2
    Y[i] = H + 0.5
"""


def test_a_float_value_stored_as_i32_is_refused_with_a_caret(tmp_path):
    path = tmp_path / "integer.napkin"
    path.write_text(INTEGER_OF_FLOAT)
    code, out = napkin_cli("run", path, "--set", "i=64")
    assert code == 2, out
    assert "integer.napkin:2:16: error: H is stored as i32, but its value is a float: it is computed from X (f32)" in out
    assert "^^^" in out and "f32" in out.split("hint:")[1] and "Traceback" not in out


@pytest.mark.parametrize("source", [
    # integer storage of integer values: N / 2 of an odd N is rounded, on the backend and in the reference
    "kernel k(N: i32[i]) -> (Y: f32[i]):\n    H[i] @gmem i32 = N / 2\n    Y[i] = H + 0.5\n",
    "kernel k(N: i32[i]) -> (Y: f32[i]):\n    H[i] @gmem = N / 2\n    Y[i] = H * 3\n",
    "kernel k(N: i32[i]) -> (Y: i32[i]):\n    Y[i] = N / 2\n",
    # a float and an integer source: stored as f32 (i32 is as wide, and was chosen when it came last)
    "kernel k(N: i32[i], X: f32[i]) -> (Y: f32[i]):\n    H[i] @gmem = X + N\n    Y[i] = H + 0.25\n",
], ids=["explicit-i32", "inferred-i32", "i32-output", "mixed-sources"])
def test_integer_storage_of_integer_values_checks_exactly(source):
    kernel = only(source)
    result = check_run(kernel, sizes={"i": 64})
    assert result["ok"], result
    if "X + N" in source:
        assert kernel.diagram.arrays["H"].dtype == "f32"
        assert result["max_rel_error"] < 1e-6
    else:
        assert result["max_abs_error"] == 0.0  # rounded alike: nothing for a tolerance to absorb


def test_the_reference_rounds_integer_storage_in_float64_too():
    kernel = only("kernel k(N: i32[i]) -> (Y: i32[i]):\n    Y[i] = N / 2\n")
    N = np.array([1, 3, -5, 4], np.int32)
    kept = evaluate(kernel.diagram, {"N": N}, {}, {"i": 4}, keep_float64=True)["Y"]
    assert kept.dtype == np.float64
    np.testing.assert_array_equal(kept, np.rint(N / 2))  # ties to even, as NumPy stores it
