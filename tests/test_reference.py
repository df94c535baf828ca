"""The NumPy reference evaluator against independent hand-written NumPy formulas.

Each example kernel is evaluated on small seeded random inputs (never zeros) and compared
with a formula written out by hand (explicit loops over heads, ``@`` products, ``math.erf``),
twice: in float64 at tight tolerance (``keep_float64=True``) and in the declared output dtype
at that dtype's tolerance.
"""

from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.binding import bind, estimate_reference_bytes
from napkin_dsl.errors import NapkinCallError, NapkinError
from napkin_dsl.reference import ELEMENTWISE, evaluate, reference
from napkin_dsl.types import numpy_dtype

from .conftest import EXAMPLES, NAPKIN_EXAMPLES

BF16 = np.dtype(ml_dtypes.bfloat16)
# Relative tolerance of a comparison after rounding to the declared dtype: two ulps.
DTYPE_RTOL = {"bf16": 2 * 2.0**-8, "f16": 2 * 2.0**-11, "f32": 2 * 2.0**-24, "f64": 1e-12}


def load(relative: str) -> napkin.Kernel:
    (kernel,) = napkin.load(EXAMPLES / relative).values()
    return kernel


def random_inputs(kernel, sizes: dict, seed: int) -> dict[str, np.ndarray]:
    """Seeded normal values in each input's declared dtype; none is zero."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for array in kernel.diagram.input_arrays:
        values = rng.standard_normal([sizes[a] for a in array.axes])
        values = np.where(np.abs(values) < 0.05, 0.05, values)  # keep every value away from zero
        arrays[array.name] = values.astype(numpy_dtype(array.dtype))
    return arrays


def f64(array) -> np.ndarray:
    return np.asarray(array).astype(np.float64)


def softmax_rows(s: np.ndarray) -> np.ndarray:
    """Softmax along the last axis, written plainly (no max subtraction: inputs are small)."""
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """GELU, exact erf form: x/2 (1 + erf(x/sqrt 2)) = x/2 erfc(-x/sqrt 2), one math.erfc per
    element (1 + erf cancels for negative x)."""
    return np.array([v / 2 * math.erfc(-v / math.sqrt(2)) for v in x.ravel()]).reshape(x.shape)


def check(kernel, arrays, expected: dict, *, scalars=None, sizes=None, impls=None):
    """Reference == expected in float64 (tight) and in the declared dtypes (two ulps)."""
    binding = bind(kernel.diagram, arrays, scalars or {}, sizes=sizes)
    exact = evaluate(kernel, binding.inputs, binding.scalars, binding.sizes, impls, keep_float64=True)
    declared = evaluate(kernel, binding.inputs, binding.scalars, binding.sizes, impls)
    for name, want in expected.items():
        array = kernel.diagram.arrays[name]
        np.testing.assert_allclose(exact[name], want, rtol=1e-10, atol=1e-12, err_msg=f"{kernel.name}: {name} in float64")
        got = declared[name]
        assert got.dtype == numpy_dtype(array.dtype), name
        assert got.shape == tuple(binding.sizes[a] for a in array.axes), name
        assert got.flags.c_contiguous
        rounded = f64(np.asarray(want).astype(numpy_dtype(array.dtype)))
        np.testing.assert_allclose(f64(got), rounded, rtol=DTYPE_RTOL[array.dtype], atol=1e-6,
                                   err_msg=f"{kernel.name}: {name} in {array.dtype}")
    return declared


# ---- every example ---------------------------------------------------------------------------


def test_every_example_is_covered():
    covered = {"attention.napkin", "attention_unfused.napkin", "gqa.napkin", "matmul.napkin", "mlp.napkin",
               "rmsnorm.napkin", "softmax.napkin", "paper/fig9.napkin", "paper/fig11.napkin", "paper/fig12.napkin",
               "causal_attention.napkin", "sliding_window.napkin", "attention_lse.napkin", "swiglu.napkin",
               "decode.napkin", "splitk.napkin", "fp8_attention.napkin", "fp8_matmul.napkin",
               "fp8_attention_vt.napkin"}
    assert {str(p.relative_to(EXAMPLES)) for p in NAPKIN_EXAMPLES} == covered


def test_attention():
    kernel = load("attention.napkin")
    sizes = {"b": 2, "h": 3, "q": 5, "x": 7, "d": 8}
    arrays = random_inputs(kernel, sizes, seed=1)
    Q, K, V = (f64(arrays[n]) for n in "QKV")
    O = np.empty((2, 3, 5, 8))
    for b in range(2):
        for h in range(3):
            O[b, h] = softmax_rows(Q[b, h] @ K[b, h].T / math.sqrt(8)) @ V[b, h]
    check(kernel, arrays, {"O": O})


def test_decode():
    """One query per head, r query heads sharing each key/value head (the split is a schedule:
    the reference computes the diagram whole)."""
    kernel = load("decode.napkin")
    arrays = random_inputs(kernel, {"b": 2, "kv": 2, "r": 3, "x": 9, "d": 8}, seed=31)
    Q, K, V = (f64(arrays[n]) for n in "QKV")
    O = np.empty((2, 2, 3, 8))
    for b in range(2):
        for g in range(2):
            O[b, g] = softmax_rows(Q[b, g] @ K[b, g].T / math.sqrt(8)) @ V[b, g]
    check(kernel, arrays, {"O": O})


def test_splitk():
    kernel = load("splitk.napkin")
    arrays = random_inputs(kernel, {"m": 5, "k": 40, "n": 6}, seed=32)
    check(kernel, arrays, {"C": f64(arrays["A"]) @ f64(arrays["B"])})


def test_fp8_matmul():
    """The e4m3 product in f32, dequantized by a scale per row of A and per column of B."""
    kernel = load("fp8_matmul.napkin")
    arrays = random_inputs(kernel, {"m": 5, "k": 12, "n": 6}, seed=33)
    A, sA, B, sB = (f64(arrays[n]) for n in ("A", "sA", "B", "sB"))
    check(kernel, arrays, {"C": (A @ B) * sA[:, None] * sB[None, :]})


def test_fp8_attention():
    """Q scaled per block of qi queries, K per key: S's scales before the softmax; V per head,
    its scale multiplying O after the product (FA3's descale)."""
    kernel = load("fp8_attention.napkin")
    sizes = {"b": 1, "h": 2, "qb": 2, "qi": 3, "x": 5, "d": 4}
    arrays = random_inputs(kernel, sizes, seed=34)
    Q, sQ, K, sK, V, sV = (f64(arrays[n]) for n in ("Q", "sQ", "K", "sK", "V", "sV"))
    O = np.empty((1, 2, 2, 3, 4))
    for h in range(2):
        for qb in range(2):
            S = Q[0, h, qb] @ K[0, h].T / math.sqrt(4) * sQ[0, h, qb] * sK[0, h][None, :]
            E = np.exp(S - S.max(axis=-1, keepdims=True))
            O[0, h, qb] = E / E.sum(axis=-1, keepdims=True) @ V[0, h] * sV[0, h]
    check(kernel, arrays, {"O": O})


def test_fp8_attention_with_v_stored_keys_fastest():
    """The same sum as fp8_attention's, V indexed [b h d x]."""
    kernel = load("fp8_attention_vt.napkin")
    sizes = {"b": 1, "h": 2, "qb": 2, "qi": 3, "x": 5, "d": 4}
    arrays = random_inputs(kernel, sizes, seed=35)
    Q, sQ, K, sK, V, sV = (f64(arrays[n]) for n in ("Q", "sQ", "K", "sK", "V", "sV"))
    assert V.shape == (1, 2, 4, 5)
    O = np.empty((1, 2, 2, 3, 4))
    for h in range(2):
        for qb in range(2):
            S = Q[0, h, qb] @ K[0, h].T / math.sqrt(4) * sQ[0, h, qb] * sK[0, h][None, :]
            E = np.exp(S - S.max(axis=-1, keepdims=True))
            O[0, h, qb] = E / E.sum(axis=-1, keepdims=True) @ V[0, h].T * sV[0, h]
    check(kernel, arrays, {"O": O})


def masked_attention(Q, K, V, visible):
    """Attention where query i sees key j only if visible[i, j], written plainly per head."""
    O = np.empty(Q.shape[:-1] + V.shape[-1:])
    for b in range(Q.shape[0]):
        for h in range(Q.shape[1]):
            S = Q[b, h] @ K[b, h].T / math.sqrt(Q.shape[-1])
            E = np.where(visible, np.exp(S), 0.0)
            O[b, h] = E / E.sum(axis=-1, keepdims=True) @ V[b, h]
    return O


def test_causal_attention():
    kernel = load("causal_attention.napkin")
    arrays = random_inputs(kernel, {"b": 1, "h": 2, "q": 6, "x": 6, "d": 8}, seed=21)
    Q, K, V = (f64(arrays[n]) for n in "QKV")
    check(kernel, arrays, {"O": masked_attention(Q, K, V, np.tril(np.ones((6, 6), bool)))})


def test_sliding_window():
    kernel = load("sliding_window.napkin")  # a window of 256 keys
    arrays = random_inputs(kernel, {"b": 1, "h": 1, "q": 300, "x": 300, "d": 4}, seed=22)
    Q, K, V = (f64(arrays[n]) for n in "QKV")
    i, j = np.arange(300)[:, None], np.arange(300)[None, :]
    check(kernel, arrays, {"O": masked_attention(Q, K, V, (j <= i) & (j > i - 256))})


def test_attention_lse():
    kernel = load("attention_lse.napkin")
    arrays = random_inputs(kernel, {"b": 1, "h": 2, "q": 5, "x": 7, "d": 8}, seed=23)
    Q, K, V = (f64(arrays[n]) for n in "QKV")
    S = np.einsum("bhqd,bhxd->bhqx", Q, K) / math.sqrt(8)
    check(kernel, arrays, {"O": masked_attention(Q, K, V, np.ones((5, 7), bool)), "L": np.log(np.exp(S).sum(axis=-1))})


def test_attention_unfused():
    kernel = load("attention_unfused.napkin")
    arrays = random_inputs(kernel, {"q": 6, "x": 9, "d": 4}, seed=2)
    Q, K, V = (f64(arrays[n]) for n in "QKV")
    # No scale in this example: the paper's Fig. 8/9 contracts Q and K directly.
    check(kernel, arrays, {"O": softmax_rows(Q @ K.T) @ V})


def test_gqa_broadcasts_keys_and_values_over_query_heads():
    kernel = load("gqa.napkin")
    sizes = {"b": 2, "kv": 2, "r": 3, "q": 4, "x": 5, "d": 8}
    arrays = random_inputs(kernel, sizes, seed=3)
    Q, K, V = (f64(arrays[n]) for n in "QKV")
    O = np.empty((2, 2, 3, 4, 8))
    for b in range(2):
        for kv in range(2):
            for r in range(3):  # every query head r of group kv uses the same K and V
                O[b, kv, r] = softmax_rows(Q[b, kv, r] @ K[b, kv].T / math.sqrt(8)) @ V[b, kv]
    check(kernel, arrays, {"O": O})


def test_matmul():
    kernel = load("matmul.napkin")
    arrays = random_inputs(kernel, {"m": 5, "k": 7, "n": 3}, seed=4)
    check(kernel, arrays, {"C": f64(arrays["A"]) @ f64(arrays["B"])})


def test_mlp_uses_exact_erf_gelu():
    kernel = load("mlp.napkin")
    arrays = random_inputs(kernel, {"b": 4, "k": 6, "n": 5}, seed=5)
    X, W, bias = (f64(arrays[n]) for n in ("X", "W", "bias"))
    check(kernel, arrays, {"Y": gelu_erf(X @ W + bias)})


def test_swiglu_gates_one_projection_by_the_silu_of_the_other():
    kernel = load("swiglu.napkin")
    arrays = random_inputs(kernel, {"t": 4, "m": 6, "f": 5, "e": 3}, seed=6)
    X, W1, W3, W2 = (f64(arrays[n]) for n in ("X", "W1", "W3", "W2"))
    G, U = X @ W1, X @ W3
    check(kernel, arrays, {"Y": (G / (1 + np.exp(-G)) * U) @ W2})


def test_gelu_is_the_erf_form_not_the_tanh_approximation():
    gelu = ELEMENTWISE["gelu"]
    x = np.array([-3.0, -1.0, 0.5, 1.0, 2.0])
    np.testing.assert_allclose(gelu(x), gelu_erf(x), rtol=1e-14)  # sqrt(1/2) vs 1/sqrt(2): a few ulps
    assert gelu(np.array([1.0]))[0] == pytest.approx(0.8413447460685429, rel=1e-15)
    tanh_form = 0.5 * (1 + math.tanh(math.sqrt(2 / math.pi) * (1 + 0.044715)))
    assert abs(gelu(np.array([1.0]))[0] - tanh_form) > 1e-4


def test_gelu_keeps_its_relative_accuracy_far_below_zero():
    """At x = -10 GELU is -7.6e-23; x/2 (1 + erf(x/sqrt 2)) rounds 1 + erf to 0 there, so the
    reference (what every backend is judged against) computes it as x/2 erfc(-x/sqrt 2)."""
    gelu = ELEMENTWISE["gelu"]
    x = np.array([-10.0, -20.0, -30.0])
    # erfc(z) ~ e^-z^2 / (z sqrt(pi)) (1 - 1/(2 z^2) + 3/(4 z^4)): its asymptotic series
    z = -x / math.sqrt(2)
    series = np.exp(-z**2) / (z * math.sqrt(math.pi)) * (1 - 1 / (2 * z**2) + 3 / (4 * z**4) - 15 / (8 * z**6))
    np.testing.assert_allclose(gelu(x), 0.5 * x * series, rtol=1e-4)


def test_rmsnorm_with_a_scalar_parameter():
    kernel = load("rmsnorm.napkin")
    arrays = random_inputs(kernel, {"t": 4, "d": 6}, seed=6)
    eps = float(np.float32(1e-5))  # eps is declared f32: the kernel sees its f32 value
    X, G = f64(arrays["X"]), f64(arrays["G"])
    Y = X / np.sqrt((X**2).mean(axis=1, keepdims=True) + eps) * G
    check(kernel, arrays, {"Y": Y}, scalars={"eps": 1e-5})


def test_softmax_rows():
    kernel = load("softmax.napkin")
    arrays = random_inputs(kernel, {"r": 3, "c": 8}, seed=7)
    check(kernel, arrays, {"Y": softmax_rows(f64(arrays["X"]))})


def test_softmax_is_stable_for_large_inputs():
    kernel = load("softmax.napkin")
    X = np.array([[1000.0, 1000.0, 998.0], [-1000.0, -1001.0, -1000.0]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Y = reference(kernel, X)
    np.testing.assert_allclose(Y, softmax_rows(f64(X) - f64(X).max(axis=1, keepdims=True)), rtol=1e-6)


def test_fig9():
    kernel = load("paper/fig9.napkin")
    arrays = random_inputs(kernel, {"q": 4, "x": 6, "d": 3}, seed=8)
    check(kernel, arrays, {"O": softmax_rows(f64(arrays["S"])) @ f64(arrays["V"])})


def fig_box(y: int, x: int, w: int):
    """A simple F(f32[x], f32[w]) -> f32[y] for one copy: tanh(M x) * sum(w)."""
    M = np.cos(np.arange(y)[:, None] + 0.5 * np.arange(x)[None, :])
    single = lambda xv, wv: np.tanh(M @ xv) * wv.sum()
    vectorised = lambda X, W: np.tanh(np.einsum("yx,...x->...y", M, X)) * W.sum(axis=-1, keepdims=True)
    return single, vectorised


def test_fig11_opaque_box_is_woven_over_a_with_w_shared():
    kernel = load("paper/fig11.napkin")
    sizes = {"a": 4, "x": 3, "w": 5, "y": 2}
    arrays = random_inputs(kernel, sizes, seed=9)
    single, vectorised = fig_box(2, 3, 5)
    seen = []

    def F(X, W):
        seen.append((X.shape, W.shape, X.flags.writeable, W.flags.writeable))
        return vectorised(X, W)

    X, W = f64(arrays["X"]), f64(arrays["W"])
    Y = np.stack([single(X[a], W) for a in range(4)])
    check(kernel, arrays, {"Y": Y}, sizes={"y": 2}, impls={"F": F})
    # Woven axes first, the box's own axes last; W is broadcast over a; nothing writable.
    assert seen[0] == ((4, 3), (4, 5), False, False)


def test_fig12_opaque_box_is_woven_over_a_and_b():
    kernel = load("paper/fig12.napkin")
    sizes = {"a": 3, "b": 4, "x": 2, "w": 5, "y": 6}
    arrays = random_inputs(kernel, sizes, seed=10)
    single, vectorised = fig_box(6, 2, 5)
    shapes = []

    def F(X, W):
        shapes.append((X.shape, W.shape))
        return vectorised(X, W)

    X, W = f64(arrays["X"]), f64(arrays["W"])
    Y = np.empty((3, 6, 4))  # declared Y[a y b]
    for a in range(3):
        for b in range(4):
            Y[a, :, b] = single(X[a], W[:, b])
    check(kernel, arrays, {"Y": Y}, sizes={"y": 6}, impls={"F": F})
    assert shapes[0] == ((3, 4, 2), (3, 4, 5))  # (a, b) woven, in Statement.woven order


# ---- opaque boxes: errors ---------------------------------------------------------------------


def fig11_call(**kwargs):
    kernel = load("paper/fig11.napkin")
    X, W = np.ones((2, 3), np.float32), np.ones(4, np.float32)
    return reference(kernel, X, W, sizes={"y": 5}, **kwargs)


def test_missing_box_implementation_names_the_box_and_the_call():
    with pytest.raises(NapkinCallError) as info:
        fig11_call()
    text = str(info.value)
    assert "box F has no implementation" in text
    assert "F(X(a=2, x=3), W(a=2, w=4))" in text and "(a=2, y=5)" in text
    assert "impls={'F': function}" in text
    assert "fig11.napkin:5" in text  # points at the statement


def test_box_implementation_of_the_wrong_shape():
    with pytest.raises(NapkinCallError, match=r"box F returned shape \(2, 3\); expected \(a=2, y=5\) = \(2, 5\)"):
        fig11_call(impls={"F": lambda X, W: X})


def test_box_implementation_returning_nonsense():
    with pytest.raises(NapkinCallError, match="box F returned str"):
        fig11_call(impls={"F": lambda X, W: "nonsense"})


def test_an_exception_in_a_box_implementation_keeps_its_type_and_gains_context():
    def F(X, W):
        raise ZeroDivisionError("inside F")

    with pytest.raises(ZeroDivisionError) as info:
        fig11_call(impls={"F": F})
    assert any("implementation of box F" in note for note in info.value.__notes__)


def test_box_implementation_cannot_write_into_the_evaluators_arrays():
    def F(X, W):
        X[...] = 0
        return X

    with pytest.raises(ValueError, match="read-only"):
        fig11_call(impls={"F": F})


# ---- elementwise functions, reductions, sizes, dtypes ---------------------------------------------


def one_statement(statement: str, params: str = "X: f32[n]", output: str = "Y: f32[n]") -> napkin.Kernel:
    (kernel,) = napkin.load(f"kernel k({params}) -> {output}:\n    {statement}\n").values()
    return kernel


X_VALUES = np.array([-2.5, -0.75, 0.3, 1.5, 4.0])


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


@pytest.mark.parametrize("expression, formula", [
    ("exp(X)", np.exp), ("log(abs(X))", lambda x: np.log(np.abs(x))), ("sqrt(abs(X))", lambda x: np.sqrt(np.abs(x))),
    ("rsqrt(abs(X))", lambda x: np.abs(x) ** -0.5), ("tanh(X)", np.tanh), ("sigmoid(X)", sigmoid),
    ("silu(X)", lambda x: x * sigmoid(x)), ("relu(X)", lambda x: np.where(x > 0, x, 0.0)), ("abs(X)", np.abs),
    ("neg(X)", lambda x: -x), ("-X", lambda x: -x), ("gelu(X)", gelu_erf),
    ("max(X, 0.5)", lambda x: np.maximum(x, 0.5)), ("min(X, 0.5)", lambda x: np.minimum(x, 0.5)),
    ("X + 1", lambda x: x + 1), ("X - 1", lambda x: x - 1), ("2 * X", lambda x: 2 * x), ("X / 4", lambda x: x / 4),
    ("X ^ 2", lambda x: x**2), ("X / len(n)", lambda x: x / 5), ("X * len(n)^-0.5", lambda x: x / math.sqrt(5)),
    ("X * n", lambda x: x * np.arange(5)),  # a bare axis name of the target is the element's index
])
def test_elementwise_functions(expression, formula):
    kernel = one_statement(f"Y[n] = {expression}", "X: f64[n]", "Y: f64[n]")
    np.testing.assert_allclose(reference(kernel, X_VALUES), formula(X_VALUES), rtol=1e-14)


def test_functions_of_constants_alone():
    kernel = one_statement("Y[n] = X * gelu(2) + exp(len(n) / 5)", "X: f64[n]", "Y: f64[n]")
    np.testing.assert_allclose(reference(kernel, X_VALUES), X_VALUES * gelu_erf(np.array([2.0]))[0] + math.e, rtol=1e-14)


def test_contraction_scaled_by_a_scalar_parameter_and_a_size_expression():
    kernel = one_statement("C[m n] = A * B * alpha * k^-0.5", "A: f64[m k], B: f64[k n], alpha: f32", "C: f64[m n]")
    rng = np.random.default_rng(17)
    A, B = rng.standard_normal((2, 9)), rng.standard_normal((9, 3))
    alpha = float(np.float32(0.3))  # alpha is declared f32: the kernel sees its f32 value
    np.testing.assert_allclose(reference(kernel, A, B, 0.3), A @ B * alpha / 3, rtol=1e-14)


def test_sigmoid_does_not_overflow():
    kernel = one_statement("Y[n] = sigmoid(X) + silu(X)", "X: f64[n]", "Y: f64[n]")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Y = reference(kernel, np.array([-1000.0, 1000.0]))
    np.testing.assert_array_equal(Y, [0.0, 1001.0])


@pytest.mark.parametrize("op, formula", [("sum", np.sum), ("max", np.max), ("min", np.min), ("mean", np.mean)])
def test_reductions(op, formula):
    kernel = one_statement(f"Y[j] = {op}[i](X)", "X: f64[i j]", "Y: f64[j]")
    X = np.arange(1, 13, dtype=np.float64).reshape(3, 4) ** 1.5
    np.testing.assert_allclose(reference(kernel, X), formula(X, axis=0), rtol=1e-14)


def test_reduction_over_several_axes_to_a_single_value():
    kernel = one_statement("Y = sum[i j](X)", "X: f64[i j]", "Y: f64[]")
    result = reference(kernel, np.arange(1.0, 7.0).reshape(2, 3))
    assert result.shape == () and result == 21.0


def test_outputs_come_back_in_their_declared_axis_order():
    kernel = one_statement("B[i j] = A * 2", "A: f32[i j]", "B: f32[j i]")
    A = np.arange(6, dtype=np.float32).reshape(2, 3)
    B = reference(kernel, A)
    np.testing.assert_array_equal(B, 2 * A.T)
    assert B.flags.c_contiguous


def test_map_broadcasts_onto_an_axis_bound_by_sizes():
    kernel = one_statement("Y[n m] = X * 2", "X: f32[n]", "Y: f32[n m]")
    np.testing.assert_array_equal(reference(kernel, np.array([1, 2, 3], np.float32), sizes={"m": 2}),
                                  [[2, 2], [4, 4], [6, 6]])


def test_several_outputs_come_back_by_name():
    (kernel,) = napkin.load("kernel two(X: f32[i j]) -> A: f32[i], B: f32[j i]:\n"
                            "    A[i] = sum[j](X)\n    B[i j] = X * 2\n").values()
    X = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = reference(kernel, X)
    assert set(out) == {"A", "B"}
    np.testing.assert_array_equal(out["A"], X.sum(axis=1))
    np.testing.assert_array_equal(out["B"], 2 * X.T)


def test_outputs_are_rounded_to_bf16_once():
    kernel = one_statement("Y[n] = X / 3", "X: f32[n]", "Y: bf16[n]")
    X = np.array([1.0, 2.0, 10.0], np.float32)
    Y = reference(kernel, X)
    assert Y.dtype == BF16
    np.testing.assert_array_equal(Y, (X.astype(np.float64) / 3).astype(BF16))


def test_integer_outputs_are_rounded_not_truncated():
    kernel = one_statement("B[n] = A * 0.1 * 10", "A: i32[n]", "B: i32[n]")
    B = reference(kernel, np.array([3, 7, -9], np.int32))
    assert B.dtype == np.int32
    np.testing.assert_array_equal(B, [3, 7, -9])


def test_intermediates_are_not_rounded_to_their_storage_dtype():
    # attention_unfused stores S and P as f16 at gmem; the reference keeps float64 throughout.
    kernel = load("attention_unfused.napkin")
    arrays = random_inputs(kernel, {"q": 3, "x": 4, "d": 2}, seed=11)
    binding = bind(kernel, arrays)
    O = evaluate(kernel, binding.inputs, {}, binding.sizes, keep_float64=True)["O"]
    Q, K, V = (f64(arrays[n]) for n in "QKV")
    np.testing.assert_allclose(O, softmax_rows(Q @ K.T) @ V, rtol=1e-13)


# ---- inputs: never modified; any layout; NaN ------------------------------------------------------


def test_inputs_are_not_mutated():
    kernel = load("attention.napkin")
    arrays = random_inputs(kernel, {"b": 1, "h": 2, "q": 3, "x": 4, "d": 8}, seed=12)
    before = {name: array.copy() for name, array in arrays.items()}
    reference(kernel, **arrays)
    binding = bind(kernel, arrays)
    bound_before = {name: array.copy() for name, array in binding.inputs.items()}
    evaluate(kernel, binding.inputs, {}, binding.sizes)
    for name in arrays:
        np.testing.assert_array_equal(arrays[name], before[name])
        np.testing.assert_array_equal(binding.inputs[name], bound_before[name])


def test_read_only_non_contiguous_and_fortran_order_inputs():
    kernel = load("matmul.napkin")
    rng = np.random.default_rng(13)
    A = rng.standard_normal((5, 7)).astype(BF16)
    B = rng.standard_normal((7, 3)).astype(BF16)
    expected = reference(kernel, A, B)
    read_only = A.copy()
    read_only.flags.writeable = False
    strided = np.repeat(A, 2, axis=1)[:, ::2]  # a non-contiguous view with the same values
    assert not strided.flags.c_contiguous
    fortran = np.asfortranarray(B)
    transposed = np.ascontiguousarray(B.T).T  # a Fortran-order view of a C array
    for a, b in [(read_only, B), (strided, B), (A, fortran), (A, transposed), (strided, transposed)]:
        np.testing.assert_array_equal(reference(kernel, a, b), expected)


def test_nan_and_inf_propagate_without_exceptions_or_warnings():
    kernel = load("attention.napkin")
    arrays = random_inputs(kernel, {"b": 1, "h": 2, "q": 3, "x": 4, "d": 8}, seed=14)
    arrays["Q"][0, 1, 2, 5] = np.nan  # one query of head 1
    arrays["V"][0, 0, 1, 3] = np.inf  # one value feature of head 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        O = f64(reference(kernel, **arrays))
    assert np.isnan(O[0, 1, 2]).all()
    assert np.isfinite(np.delete(O[0, 1], 2, axis=0)).all()
    assert np.isinf(O[0, 0, :, 3]).all()
    assert np.isfinite(np.delete(O[0, 0], 3, axis=1)).all()


def test_softmax_of_a_row_of_minus_infinity_is_zero_the_mask_convention():
    # A fully masked row (causal attention with a decode offset masks whole rows) is 0, not
    # the formula's 0/0: every backend follows this convention (tests/test_masks.py).
    kernel = load("softmax.napkin")
    X = np.array([[-np.inf, -np.inf], [0.0, -np.inf]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Y = reference(kernel, X)
    np.testing.assert_array_equal(Y[0], [0.0, 0.0])
    np.testing.assert_array_equal(Y[1], [1.0, 0.0])


# ---- the convenience call and evaluate's own checks ---------------------------------------------


def test_reference_takes_positional_and_named_arguments():
    kernel = load("rmsnorm.napkin")
    arrays = random_inputs(kernel, {"t": 2, "d": 3}, seed=15)
    by_position = reference(kernel, arrays["X"], arrays["G"], 1e-5)
    by_name = reference(kernel, eps=1e-5, G=arrays["G"], X=arrays["X"])
    mixed = reference(kernel.diagram, arrays["X"], G=arrays["G"], eps=1e-5)
    np.testing.assert_array_equal(by_position, by_name)
    np.testing.assert_array_equal(by_position, mixed)


def test_reference_argument_errors():
    kernel = load("matmul.napkin")
    A, B = np.ones((2, 3), BF16), np.ones((3, 4), BF16)
    with pytest.raises(NapkinCallError, match=r"matmul takes 2 arguments \(A, B\), got 3 positional"):
        reference(kernel, A, B, A)
    with pytest.raises(NapkinCallError, match="got A both by position and by name"):
        reference(kernel, A, A=A, B=B)
    with pytest.raises(NapkinCallError, match="missing array B"):
        reference(kernel, A)


def test_reference_with_cast_converts_lists():
    kernel = load("matmul.napkin")
    C = reference(kernel, [[1.0, 2.0]], [[3.0], [4.0]], cast=True)
    np.testing.assert_array_equal(C, [[11.0]])
    assert C.dtype == np.float32


def test_evaluate_checks_what_it_relies_on():
    kernel = load("matmul.napkin")
    A, B = np.ones((2, 3)), np.ones((3, 4))
    with pytest.raises(NapkinCallError, match="needs a size for every axis; missing n"):
        evaluate(kernel, {"A": A, "B": B}, {}, {"m": 2, "k": 3})
    with pytest.raises(NapkinCallError, match="missing input B"):
        evaluate(kernel, {"A": A}, {}, {"m": 2, "k": 3, "n": 4})
    with pytest.raises(NapkinCallError, match=r"B\[k n\] has shape \(3, 4\), but the sizes give \(3, 5\)"):
        evaluate(kernel, {"A": A, "B": B}, {}, {"m": 2, "k": 3, "n": 5})
    with pytest.raises(NapkinCallError, match="missing scalar eps"):
        evaluate(load("rmsnorm.napkin"), {"X": A, "G": A[0]}, {}, {"t": 2, "d": 3})


def test_the_memory_guard_refuses_before_allocating():
    kernel = load("attention.napkin")
    sizes = {"b": 1, "h": 1, "q": 4, "x": 4, "d": 2}
    arrays = random_inputs(kernel, sizes, seed=16)
    need = estimate_reference_bytes(kernel, sizes)
    assert reference(kernel, **arrays, memory_limit=need).shape == (1, 1, 4, 2)
    with pytest.raises(NapkinCallError) as info:
        reference(kernel, **arrays, memory_limit=need - 1)
    assert "the largest array is" in str(info.value) and "memory_limit=" in str(info.value)


def test_errors_are_napkin_errors():
    assert issubclass(NapkinCallError, NapkinError)
