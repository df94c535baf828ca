"""Arrays of other libraries in and out of a kernel call: torch and CuPy through DLPack.

torch is the ``torch`` extra (CPU build in CI); CuPy is tested where installed (it needs a GPU)
and skipped with the reason otherwise. JAX, in the ``dev`` extra, is tests/test_jax.py. Every comparison is against NumPy inputs holding the same
values, or against the float64 reference, never against numbers the backend produced.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends.numpy import random_arguments
from napkin_dsl.errors import NapkinCallError
from napkin_dsl.reference import reference

from .conftest import EXAMPLES

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")

BF16 = np.dtype(ml_dtypes.bfloat16)
SIZES = {"b": 1, "h": 2, "q": 40, "x": 70, "d": 16}


@pytest.fixture(scope="module")
def attention():
    return napkin.load(EXAMPLES / "attention.napkin")["attention"]


@pytest.fixture(scope="module")
def qkv(attention):
    arrays, _ = random_arguments(attention.diagram, SIZES, 0)
    return arrays["Q"], arrays["K"], arrays["V"]


def as_torch(array: np.ndarray):
    """A torch tensor of the same values and dtype, built without napkin (bits viewed as bf16)."""
    if array.dtype == BF16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def test_attention_with_torch_bf16_tensors_returns_a_torch_bf16_tensor(attention, qkv):
    tensors = [as_torch(a) for a in qkv]
    out = attention(*tensors)
    assert isinstance(out, torch.Tensor)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == qkv[0].shape and out.device.type == "cpu"
    got = out.float().numpy().astype(np.float64)
    # Same values as the NumPy call, bit for bit, and within bf16 rounding of the float64 reference.
    np.testing.assert_array_equal(got, attention(*qkv).astype(np.float64))
    want = reference(attention, *qkv).astype(np.float64)
    assert np.max(np.abs(got - want)) <= 2**-7 * np.max(np.abs(want))


def test_torch_inputs_are_copied_not_kept_or_written(attention, qkv):
    tensors = [as_torch(a) for a in qkv]
    before = [t.clone() for t in tensors]
    out = attention(*tensors)
    out.zero_()  # the output owns its memory: writing it leaves the inputs alone
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=False))


def test_strided_tensors_are_read_through_their_strides():
    (softmax,) = napkin.load(EXAMPLES / "softmax.napkin").values()
    x = np.random.default_rng(1).standard_normal((24, 40)).astype(np.float32)
    want = softmax(x)
    transposed = torch.from_numpy(x.T.copy()).T  # strides (1, 24) elements
    sliced = torch.from_numpy(np.concatenate([x, x], axis=1))[:, ::2]  # every other column
    np.testing.assert_array_equal(softmax(transposed).numpy(), want)
    np.testing.assert_array_equal(softmax(sliced).numpy(), softmax(np.ascontiguousarray(np.concatenate([x, x], 1)[:, ::2])))


def test_fp8_tensors_map_through_their_dlpack_codes():
    kernel = napkin.load("kernel scale(X: fp8e4m3[n], Y: fp8e5m2[n]) -> Z: f32[n]:\n    Z[n] = X * Y\n")["scale"]
    x = np.array([0.5, 1.5, -2.0, 448.0], ml_dtypes.float8_e4m3fn)
    y = np.array([2.0, -0.25, 3.0, 0.5], ml_dtypes.float8_e5m2)
    tx = torch.tensor(x.astype(np.float32)).to(torch.float8_e4m3fn)
    ty = torch.tensor(y.astype(np.float32)).to(torch.float8_e5m2)
    out = kernel(tx, ty)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    np.testing.assert_array_equal(out.numpy(), x.astype(np.float32) * y.astype(np.float32))


def test_a_bf16_output_of_f32_inputs_comes_back_as_torch_bf16():
    kernel = napkin.load("kernel half(X: f32[n]) -> Y: bf16[n]:\n    Y[n] = X * 0.5\n")["half"]
    out = kernel(torch.tensor([1.0, 3.0, 1e-3]))
    assert out.dtype == torch.bfloat16
    np.testing.assert_array_equal(out.float().numpy(), np.array([0.5, 1.5, 5e-4], np.float32).astype(BF16).astype(np.float32))


def test_requires_grad_records_the_call_and_no_grad_just_runs(attention, qkv):
    q, k, v = (as_torch(a) for a in qkv)
    q = q.float().requires_grad_()
    with torch.no_grad():
        plain = attention(q, k, v, cast=True)
    assert plain.grad_fn is None
    out = attention(q, k, v, cast=True)  # recorded for autograd: the derived backward runs on NumPy
    assert out.grad_fn is not None
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32 and q.grad.shape == q.shape
    assert torch.isfinite(q.grad).all() and q.grad.abs().max() > 0


def test_wrong_dtype_names_both_dtypes_and_cast_converts(attention, qkv):
    q, k, v = (as_torch(a) for a in qkv)
    with pytest.raises(NapkinCallError, match=r"Q must be bf16 .*got float32") as info:
        attention(q.float(), k, v)
    assert "Tensor torch.float32(1, 2, 40, 16)" in str(info.value)
    out = attention(q.float(), k, v, cast=True)
    assert out.dtype == torch.bfloat16
    np.testing.assert_array_equal(out.float().numpy(), attention(*qkv).astype(np.float32))


def test_wrong_rank_and_axis_mismatch_are_reported_for_tensors(attention, qkv):
    q, k, v = (as_torch(a) for a in qkv)
    with pytest.raises(NapkinCallError, match=r"axis d is 16 in Q \(dim 3\) but 8 in K \(dim 3\)"):
        attention(q, k[..., :8].contiguous(), v)
    with pytest.raises(NapkinCallError, match=r"Q is declared bf16\[b h q d\] \(4 axes\) but got an array of shape \(2, 40, 16\)"):
        attention(q[0], k, v)


def test_several_outputs_come_back_as_tensors():
    kernel = napkin.load("kernel two(X: f32[n]) -> (A: f32[n], B: f16[n]):\n    A[n] = X * 2\n    B[n] = X + 1\n")["two"]
    out = kernel(torch.tensor([1.0, 2.0]))
    assert set(out) == {"A", "B"} and out["B"].dtype == torch.float16
    np.testing.assert_array_equal(out["A"].numpy(), [2.0, 4.0])


def test_cupy_arrays_in_and_out():
    cupy = pytest.importorskip("cupy", reason="cupy is not installed (it needs a CUDA GPU)")
    from napkin_dsl.backends import driver

    if not driver.cuda_available():
        pytest.skip("no CUDA GPU for cupy arrays")
    (softmax,) = napkin.load(EXAMPLES / "softmax.napkin").values()
    x = np.random.default_rng(2).standard_normal((24, 40)).astype(np.float32)
    out = softmax(cupy.asarray(x), backend="cuda")
    assert isinstance(out, cupy.ndarray)
    np.testing.assert_allclose(cupy.asnumpy(out), softmax(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(NapkinCallError, match="CUDA device memory, which the host backends"):
        softmax(cupy.asarray(x), backend="numpy")
