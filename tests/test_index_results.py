"""An integer result computed from indices is an integer (issue 46, defect 1): a condition's
operands do not pass their values on, so torch.argmax written as the least index where X reaches
its row maximum, ``min[i](where(X == M, i, len(i)))``, checks as i64 and runs, while a float value
stored in an integer array is still refused."""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends.numpy import check_run
from napkin_dsl.errors import NapkinError

ARGMAX = """kernel argmax(X: f32[b j i]) -> Y: i64[b j]:
    M[b j] = max[i](X)
    Y[b j] = min[i](where(X == M, i, len(i)))
"""


def test_argmax_as_the_least_index_of_the_maximum_is_torchs():
    kernel = napkin.load(ARGMAX)["argmax"]
    X = np.random.default_rng(0).standard_normal((2, 3, 17)).astype(np.float32)
    X[1, 2, 5] = X[1, 2, 9] = X[1, 2].max() + 1  # a tie: the first index, as torch.argmax and numpy take
    got = kernel(X)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.argmax(X, axis=-1))
    assert check_run(kernel, sizes={"b": 2, "j": 3, "i": 17})["ok"]


@pytest.mark.parametrize("value", ["where(X == M, X, 0)", "where(X == M, i, 0) * X", "where(X > 0, i, s)"])
def test_a_float_value_stored_as_an_integer_is_still_refused(value):
    text = ARGMAX.replace("-> Y", "s: f32 -> Y" if "s)" in value else "-> Y").replace(
        "(X: f32[b j i]) s: f32", "(X: f32[b j i], s: f32)").replace("where(X == M, i, len(i))", value)
    with pytest.raises(NapkinError, match="output Y is declared i64, but its value is a float"):
        napkin.load(text)


PICK = """kernel pick(X: f32[b c], T: {dtype}[b]) -> Y: f32[b]:
    Y[b] = sum[c](where(c == T, X, 0))

relabel pick on H100:
    smem: group b 16; stream c 64
"""
ARGMAX_H100 = ARGMAX + "\nrelabel argmax on H100:\n    smem: group b 1, j 16\n"


@pytest.mark.parametrize("dtype", ["i32", "i64"])
def test_integer_inputs_and_outputs_run_on_the_gpu_printers(dtype, opencl_device):
    """Class indices in (cross-entropy's pick of the target's logit) and an index out (argmax):
    the printers store integers as int / long (long long in CUDA), read them as C converts, and
    round an integer-valued result as types.convert does (issue 46, defect 2). OpenCL runs them
    at ragged sizes against the reference, counts and all."""
    pick = napkin.load(PICK.format(dtype=dtype))["pick"]
    assert check_run(pick, sizes={"b": 300, "c": 1000}, backend="opencl")["ok"]
    argmax = napkin.load(ARGMAX_H100.replace("i64", dtype))["argmax"]
    assert check_run(argmax, sizes={"b": 4, "j": 100, "i": 1000}, backend="opencl")["ok"]


def test_integer_arrays_compile_through_nvrtc():
    pytest.importorskip("cuda.bindings.nvrtc")
    pick = napkin.load(PICK.format(dtype="i64"))["pick"].compile(b=300, c=1000)
    assert "const long long* __restrict__ g_T" in pick.source
    argmax = napkin.load(ARGMAX_H100)["argmax"].compile(b=4, j=100, i=1000)
    assert "long long* __restrict__ g_Y" in argmax.source and "= (long long)rintf(" in argmax.source
    assert all(row["spill_bytes"] == 0 for compiled in (pick, argmax) for row in compiled.launch_table())
