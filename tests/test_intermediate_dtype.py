"""A dtype for materialised intermediates: ``H[b n] @gmem bf16 = ...``.

The notation sets the array's storage dtype; the model counts its bytes at that width; the
NumPy and OpenCL backends store it rounded to that dtype, and the CUDA source declares its
buffer so. Expected values are computed here with NumPy and ml_dtypes, never read off napkin.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.errors import NapkinError, NapkinSyntaxError

MLP = """
kernel mlp2(X: f32[b k], W: f32[k n], bias: f32[n]) -> Y: f32[b n]:
    H[b n] @gmem{dtype} = X[b k] * W[k n]
    Y[b n] = relu(H + bias)

relabel mlp2 on H100:
    smem: group b 64, n 64; stream k 32
"""
SIZES = {"b": 100, "k": 70, "n": 90}


def kernel(dtype: str = ""):
    return napkin.load(MLP.format(dtype=f" {dtype}" if dtype else ""))["mlp2"]


def inputs():
    """Sixteenths in [-2, 2]: every product and sum of H is exact in f32 (multiples of 2^-8 below
    2^9: 17 bits), so the only rounding is the one to H's storage dtype (8 or 11 bits), and the
    result is exact."""
    rng = np.random.default_rng(3)

    def sixteenths(*shape):
        return (rng.integers(-32, 33, shape) / 16).astype(np.float32)

    return sixteenths(SIZES["b"], SIZES["k"]), sixteenths(SIZES["k"], SIZES["n"]), sixteenths(SIZES["n"])


def expected(X, W, bias, store) -> np.ndarray:
    """relu(H + bias) with H = X W computed in float64 and stored as ``store``."""
    H = (X.astype(np.float64) @ W.astype(np.float64)).astype(store).astype(np.float64)
    return np.maximum(H + bias, 0)


def test_the_written_dtype_is_the_arrays_and_the_default_is_unchanged():
    assert kernel("bf16").diagram.arrays["H"].dtype == "bf16"
    assert kernel("f16").diagram.arrays["H"].dtype == "f16"
    assert kernel().diagram.arrays["H"].dtype == "f32"  # the widest operand's, as before


def test_the_model_counts_the_intermediate_at_its_dtype():
    b, k, n = 256, 256, 256
    narrow = kernel("bf16").cost(b=b, k=k, n=n).levels["smem"]
    wide = kernel().cost(b=b, k=k, n=n).levels["smem"]
    assert narrow.H == wide.H  # the same values move
    # H (b n values) is saved once and loaded once by the next launch: 2 bytes a value fewer each way.
    assert wide.H_bytes - narrow.H_bytes == 2 * (4 - 2) * b * n


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_the_numpy_backend_stores_the_intermediate_in_its_dtype(dtype):
    X, W, bias = inputs()
    store = np.dtype(ml_dtypes.bfloat16) if dtype == "bf16" else np.dtype(np.float16)
    got = kernel(dtype)(X, W, bias).astype(np.float64)
    rounded, unrounded = expected(X, W, bias, store), expected(X, W, bias, np.float64)
    np.testing.assert_array_equal(got, rounded)
    assert not np.array_equal(rounded, unrounded)  # the inputs do exercise the rounding


def test_napkin_run_counts_agree_with_the_model():
    from napkin_dsl.backends.numpy import check_run

    result = check_run(kernel("bf16"), None, SIZES)
    assert result["ok"] and not result["count_differences"]


def test_the_opencl_backend_stores_the_intermediate_in_its_dtype():
    from napkin_dsl.backends.opencl import opencl_available

    if not opencl_available():
        pytest.skip("no OpenCL device (PoCL)")
    X, W, bias = inputs()
    got = kernel("bf16")(X, W, bias, backend="opencl").astype(np.float64)
    np.testing.assert_array_equal(got, expected(X, W, bias, np.dtype(ml_dtypes.bfloat16)))


def test_the_cuda_source_declares_the_buffer_in_its_dtype():
    source = kernel("bf16").compile("sm_90", b=256, k=256, n=256).source
    assert "__nv_bfloat16* __restrict__ g_H" in source
    assert "float* __restrict__ g_H" in kernel().compile("sm_90", b=256, k=256, n=256).source  # f32 when not written


def test_a_dtype_only_on_a_materialised_intermediate():
    text = "kernel k(X: f32[n]) -> Y: f32[n]:\n    T[n] bf16 = X * 2\n    Y[n] = T + 1\n"
    with pytest.raises(NapkinError, match="T is not materialised") as info:
        napkin.load(text)
    assert "T[n] @gmem bf16 = ..." in info.value.render() and "<string>:2:10" in info.value.render()
    output = "kernel k(X: f32[n]) -> Y: f32[n]:\n    Y[n] @gmem bf16 = X * 2\n"
    with pytest.raises(NapkinError, match="Y is an output, declared f32"):
        napkin.load(output)
    with pytest.raises(NapkinSyntaxError):
        napkin.load("kernel k(X: f32[n]) -> Y: f32[n]:\n    T[n] @gmem bf17 = X * 2\n    Y[n] = T\n")


def test_the_decorated_form_takes_the_same_dtype():
    @napkin.kernel
    def mlp3(X: napkin.f32["b k"], W: napkin.f32["k n"]) -> napkin.f32["b n"]:
        """
        H[b n] @gmem f16 = X * W
        Y[b n] = relu(H)
        """

    assert mlp3.diagram.arrays["H"].dtype == "f16"
    X, W, _ = inputs()
    np.testing.assert_array_equal(mlp3(X, W).astype(np.float64),
                                  np.maximum((X.astype(np.float64) @ W).astype(np.float16).astype(np.float64), 0))


def test_the_tuners_fusion_choices_keep_a_written_dtype_while_its_array_stays_materialised():
    from napkin_dsl.hardware import load_hardware
    from napkin_dsl.plan import materialise

    (kernel,) = napkin.load("""
kernel m(X: f32[a k], W: f32[k n], V: f32[n c]) -> Y: f32[a c]:
    H[a n] @gmem bf16 = X[a k] * W[k n]
    G[a n] = gelu(H)
    Y[a c] = G[a n] * V[n c]
""").values()
    h100 = load_hardware("H100")
    both = materialise(kernel.diagram, h100, {"H", "G"})
    assert (both.arrays["H"].dtype, both.arrays["H"].level) == ("bf16", "gmem")
    assert both.arrays["G"].dtype == "bf16"  # stored at its widest operand's width: H's
    fused = materialise(kernel.diagram, h100, {"G"})  # H moved on chip: computed in f32, as unwritten
    assert (fused.arrays["H"].dtype, fused.arrays["H"].level) == ("f32", None)


GATED = """
kernel gated(X: bf16[t m], W1: bf16[m f], W3: bf16[m f], W2: bf16[f e]) -> Y: bf16[t e]:
    G[t f]{g} = X[t m] * W1[m f]
    U[t f] = X[t m] * W3[m f]
    H[t f] @gmem = silu(G) * U
    Y[t e] = H[t f] * W2[f e]
"""


def test_a_materialised_intermediate_is_stored_at_its_stored_sources_width():
    """H = silu(G) * U reads two contractions kept on chip (f32 accumulators), but is computed
    from bf16 inputs: materialised, it is bf16, as when G and U are materialised too. Written
    sources count as written: G stored in f32 makes H f32."""
    (kernel,) = napkin.load(GATED.format(g="")).values()
    assert kernel.diagram.arrays["G"].dtype == "f32"  # on chip: the accumulation dtype
    assert kernel.diagram.arrays["H"].dtype == "bf16"
    (kernel,) = napkin.load(GATED.format(g=" @gmem f32")).values()
    assert kernel.diagram.arrays["H"].dtype == "f32"


def test_every_fusion_choice_stores_the_same_precision():
    """The tuner compares fusion choices (plan.materialise): each intermediate it saves is bf16,
    whichever others it keeps on chip, so a choice is never preferred for rounding less."""
    import itertools

    from napkin_dsl.hardware import load_hardware
    from napkin_dsl.plan import materialise

    (kernel,) = napkin.load(GATED.format(g="")).values()
    h100 = load_hardware("H100")
    for count in range(4):
        for chosen in itertools.combinations(("G", "U", "H"), count):
            diagram = materialise(kernel.diagram, h100, set(chosen))
            stored = {name: diagram.arrays[name].dtype for name in ("G", "U", "H") if diagram.arrays[name].level is not None}
            assert set(stored.values()) <= {"bf16"}, (chosen, stored)
