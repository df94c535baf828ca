"""JAX arrays in and out of a kernel call, through DLPack (binding.py).

jax's CPU build comes with the ``dev`` extra, so these run on every machine CI runs on. Every
comparison is against the NumPy call on the same values, never against numbers the backend
produced for the jax call alone.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends.numpy import random_arguments
from napkin_dsl.errors import NapkinCallError

from .conftest import EXAMPLES

jax = pytest.importorskip("jax", reason="jax is not installed (pip install -e '.[dev]')")
jnp = jax.numpy

BF16 = np.dtype(ml_dtypes.bfloat16)
SIZES = {"b": 1, "h": 2, "q": 40, "x": 70, "d": 16}


def is_jax(value) -> bool:
    return isinstance(value, jax.Array)


@pytest.fixture(scope="module")
def attention():
    return napkin.load(EXAMPLES / "attention.napkin")["attention"]


@pytest.fixture(scope="module")
def qkv(attention):
    arrays, _ = random_arguments(attention.diagram, SIZES, 0)
    return arrays["Q"], arrays["K"], arrays["V"]


def test_jax_bf16_arrays_in_give_a_jax_bf16_array_out(attention, qkv):
    out = attention(*(jnp.asarray(a) for a in qkv))
    assert is_jax(out) and out.dtype == BF16 and out.shape == qkv[0].shape
    np.testing.assert_array_equal(np.asarray(out).astype(np.float32), attention(*qkv).astype(np.float32))


def test_several_outputs_come_back_as_jax_arrays_in_their_dtypes():
    kernel = napkin.load("kernel two(X: f32[n]) -> (A: f32[n], B: f16[n]):\n    A[n] = X * 2\n    B[n] = X + 1\n")["two"]
    out = kernel(jnp.asarray([1.0, 2.0], jnp.float32))
    assert set(out) == {"A", "B"} and all(is_jax(v) for v in out.values())
    assert out["A"].dtype == np.float32 and out["B"].dtype == np.float16
    np.testing.assert_array_equal(np.asarray(out["A"]), [2.0, 4.0])
    np.testing.assert_array_equal(np.asarray(out["B"]), np.array([2.0, 3.0], np.float16))


def test_a_jax_input_after_a_numpy_one_still_gives_jax_out():
    kernel = napkin.load("kernel add(X: f32[n], Z: f32[n]) -> Y: f32[n]:\n    Y[n] = X + Z\n")["add"]
    out = kernel(np.ones(3, np.float32), jnp.arange(3, dtype=jnp.float32))
    assert is_jax(out)
    np.testing.assert_array_equal(np.asarray(out), [1.0, 2.0, 3.0])


def test_a_jax_scalar_is_a_scalar():
    """jnp.float32(2) is a 0-d jax array: it was refused as "not a real number" (NumPy's 0-d
    arrays were always accepted)."""
    kernel = napkin.load("kernel scale(X: f32[n], a: f32, k: i32) -> Y: f32[n]:\n    Y[n] = X * a + k\n")["scale"]
    x = np.arange(4, dtype=np.float32)
    want = kernel(x, np.float32(2.0), 3)
    np.testing.assert_array_equal(np.asarray(kernel(jnp.asarray(x), jnp.float32(2.0), jnp.int32(3))), want)
    np.testing.assert_array_equal(np.asarray(kernel(jnp.asarray(x), jnp.asarray(2.0), jnp.asarray(3))), want)
    with pytest.raises(NapkinCallError, match="scalar k is i32 .* but got float32"):
        kernel(jnp.asarray(x), 2.0, jnp.float32(3.5))


def test_a_traced_value_is_refused_with_what_to_do_instead():
    """Under jax.jit an argument is a tracer with no data: the error said to pass cast=True, with
    which the call then failed inside JAX."""
    kernel = napkin.load("kernel scale(X: f32[n], a: f32) -> Y: f32[n]:\n    Y[n] = X * a\n")["scale"]
    for cast in (False, True):
        with pytest.raises(NapkinCallError, match="X is a traced JAX value .*call the kernel outside the transformation"):
            jax.jit(lambda x, cast=cast: kernel(x, 2.0, cast=cast))(jnp.ones(3, jnp.float32))
    with pytest.raises(NapkinCallError, match="a is a traced JAX value"):
        jax.jit(lambda a: kernel(np.ones(3, np.float32), a))(jnp.float32(2.0))


def test_a_jax_array_of_another_dtype_needs_cast():
    kernel = napkin.load("kernel half(X: bf16[n]) -> Y: bf16[n]:\n    Y[n] = X * 2\n")["half"]
    with pytest.raises(NapkinCallError, match=r"X must be bf16 .*got float32; convert it first or pass cast=True"):
        kernel(jnp.ones(3, jnp.float32))
    out = kernel(jnp.ones(3, jnp.float32), cast=True)
    assert is_jax(out) and out.dtype == BF16 and np.asarray(out).astype(np.float32).tolist() == [2.0, 2.0, 2.0]


def test_jax_without_x64_refuses_a_64_bit_output_instead_of_halving_it():
    if jax.config.jax_enable_x64:
        pytest.skip("JAX runs with 64-bit types here")
    kernel = napkin.load("kernel d(X: f32[n]) -> Y: f64[n]:\n    Y[n] = X * 2\n")["d"]
    with pytest.raises(NapkinCallError, match="JAX runs without 64-bit types"):
        kernel(jax.numpy.ones(3, np.float32))
