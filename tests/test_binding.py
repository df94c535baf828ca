"""bind(): sizes from shapes, private converted copies, and one clear error per bad call."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.binding import (
    Binding,
    bind,
    check_reference_memory,
    default_memory_limit,
    estimate_reference_bytes,
    physical_memory_bytes,
)
from napkin_dsl.errors import NapkinCallError, NapkinError

from .conftest import EXAMPLES

BF16 = np.dtype(ml_dtypes.bfloat16)


def load(relative: str) -> napkin.Kernel:
    (kernel,) = napkin.load(EXAMPLES / relative).values()
    return kernel


@pytest.fixture
def attention():
    return load("attention.napkin")


def qkv(b=1, h=2, q=3, x=5, d=4, dtype=BF16):
    rng = np.random.default_rng(0)
    return {
        "Q": rng.standard_normal((b, h, q, d)).astype(dtype),
        "K": rng.standard_normal((b, h, x, d)).astype(dtype),
        "V": rng.standard_normal((b, h, x, d)).astype(dtype),
    }


def error_text(diagram, arrays, scalars=None, **kwargs) -> str:
    with pytest.raises(NapkinCallError) as info:
        bind(diagram, arrays, scalars, **kwargs)
    return str(info.value)


# ---- what a good call binds ----------------------------------------------------------------------


def test_sizes_are_read_off_the_shapes(attention):
    binding = bind(attention.diagram, qkv())
    assert isinstance(binding, Binding)
    assert binding.sizes == {"b": 1, "h": 2, "q": 3, "d": 4, "x": 5}
    assert list(binding.sizes) == list(attention.diagram.axes)
    assert all(type(size) is int for size in binding.sizes.values())


def test_bind_accepts_a_kernel_or_its_diagram(attention):
    assert bind(attention, qkv()).sizes == bind(attention.diagram, qkv()).sizes


def test_inputs_are_private_contiguous_copies_of_the_declared_dtype(attention):
    arrays = qkv()
    before = {name: array.copy() for name, array in arrays.items()}
    binding = bind(attention, arrays)
    for name, array in arrays.items():
        bound = binding.inputs[name]
        assert bound.dtype == BF16 and bound.flags.c_contiguous and bound.flags.writeable
        assert bound is not array and not np.shares_memory(bound, array)
        np.testing.assert_array_equal(bound, array)
    binding.inputs["Q"][...] = 7  # writing the binding's copy leaves the user's array alone
    arrays["K"][...] = 9  # and changing the user's array later does not reach the binding
    np.testing.assert_array_equal(arrays["Q"], before["Q"])
    np.testing.assert_array_equal(binding.inputs["K"], before["K"])


@pytest.mark.parametrize("layout", ["read-only", "strided", "fortran", "transposed-view", "byte-swapped"])
def test_any_memory_layout_is_accepted(layout):
    kernel = load("softmax.napkin")  # X: f32[r c]
    X = np.arange(12, dtype=np.float32).reshape(3, 4) + 1
    if layout == "read-only":
        given = X.copy()
        given.flags.writeable = False
    elif layout == "strided":
        given = np.repeat(X, 2, axis=0)[::2]
    elif layout == "fortran":
        given = np.asfortranarray(X)
    elif layout == "transposed-view":
        given = np.ascontiguousarray(X.T).T
    else:
        given = X.astype(">f4")
    binding = bind(kernel, {"X": given})
    bound = binding.inputs["X"]
    assert bound.dtype == np.float32 and bound.dtype.isnative and bound.flags.c_contiguous and bound.flags.writeable
    np.testing.assert_array_equal(bound, X)


def test_nan_and_inf_are_accepted(attention):
    arrays = qkv()
    arrays["Q"][0, 0, 0, 0] = np.nan
    arrays["K"][0, 0, 0, 0] = np.inf
    binding = bind(attention, arrays)
    assert np.isnan(binding.inputs["Q"][0, 0, 0, 0]) and np.isinf(binding.inputs["K"][0, 0, 0, 0])


def test_scalars_become_numpy_scalars_of_their_declared_dtype():
    kernel = load("rmsnorm.napkin")
    arrays = {"X": np.ones((2, 3), BF16), "G": np.ones(3, BF16)}
    for eps in (1e-5, np.float64(1e-5), np.array(1e-5), 1):
        value = bind(kernel, arrays, {"eps": eps}).scalars["eps"]
        assert type(value) is np.float32 and value == np.float32(eps)


def test_sizes_argument_binds_axes_no_input_carries():
    kernel = load("paper/fig11.napkin")  # Y: f32[a y]; y is only the box's output axis
    arrays = {"X": np.ones((2, 3), np.float32), "W": np.ones(4, np.float32)}
    assert bind(kernel, arrays, sizes={"y": 6}).sizes == {"a": 2, "x": 3, "w": 4, "y": 6}
    assert bind(kernel, arrays, sizes={"y": np.int64(6), "a": 2}).sizes["y"] == 6  # restating a is fine


# ---- cast=True ----------------------------------------------------------------------------------------


def test_cast_converts_dtypes_and_array_likes(attention):
    arrays = qkv(dtype=np.float64)
    binding = bind(attention, arrays, cast=True)
    for name, array in arrays.items():
        assert binding.inputs[name].dtype == BF16
        np.testing.assert_array_equal(binding.inputs[name], array.astype(BF16))
    matmul = load("matmul.napkin")
    binding = bind(matmul, {"A": [[1, 2, 3]], "B": ((1.5,), (2,), (3,))}, cast=True)
    assert binding.sizes == {"m": 1, "k": 3, "n": 1} and binding.inputs["B"].dtype == BF16


@pytest.mark.parametrize("value, reason", [
    (np.ones((2, 3), np.complex128), "cannot convert complex128 values to numbers"),
    (np.array([["a", "b", "c"]] * 2), "cannot convert <U1 values to numbers"),
    (np.array([[object()] * 3] * 2), "cannot convert object values to numbers"),
])
def test_cast_still_refuses_values_that_are_not_real_numbers(value, reason):
    kernel = load("softmax.napkin")
    text = error_text(kernel, {"X": value}, cast=True)
    assert reason in text and "f32 (NumPy float32)" in text


def test_cast_refuses_floats_into_integers():
    (kernel,) = napkin.load("kernel k(A: i32[n]) -> B: i32[n]:\n    B[n] = A * 2\n").values()
    assert "will not convert float64 to the integer dtype int32" in error_text(kernel, {"A": np.ones(3)}, cast=True)
    assert bind(kernel, {"A": np.ones(3, np.int64)}, cast=True).inputs["A"].dtype == np.int32


# ---- errors -------------------------------------------------------------------------------------------


def test_wrong_rank_names_the_parameter_its_axes_and_the_shape(attention):
    arrays = qkv()
    arrays["K"] = arrays["K"][0]
    text = error_text(attention, arrays)
    assert "K is declared bf16[b h x d] (4 axes) but got an array of shape (2, 5, 4) (3 axes)" in text
    assert "not carried by any input" not in text  # no follow-on noise about K's axes


def test_axis_mismatch_names_the_axis_both_sizes_and_both_parameters(attention):
    arrays = qkv(d=64)
    arrays["K"] = np.ones((1, 2, 5, 128), BF16)
    assert "axis d is 64 in Q (dim 3) but 128 in K (dim 3)" in error_text(attention, arrays)


def test_wrong_dtype_names_the_napkin_and_numpy_dtypes(attention):
    arrays = qkv()
    arrays["V"] = arrays["V"].astype(np.float32)
    text = error_text(attention, arrays)
    assert "V must be bf16 (NumPy ml_dtypes.bfloat16), got float32" in text
    assert "cast=True" in text


def test_zero_size_axis(attention):
    text = error_text(attention, qkv(q=0))
    assert "axis q has size 0 in Q (dim 2)" in text and "at least one element" in text


def test_missing_and_unexpected_arguments(attention):
    arrays = qkv()
    del arrays["V"]
    arrays["Kv"] = np.ones(3)
    text = error_text(attention, arrays)
    assert "missing array V: bf16[b h x d]" in text
    assert "unexpected argument 'Kv': attention takes Q, K, V" in text and "did you mean 'K'?" in text


def test_missing_scalar_and_scalar_passed_as_array():
    kernel = load("rmsnorm.napkin")
    arrays = {"X": np.ones((2, 3), BF16), "G": np.ones(3, BF16)}
    assert "missing scalar eps: f32" in error_text(kernel, arrays)
    assert "missing scalar eps: f32 (it was passed as an array)" in error_text(kernel, {**arrays, "eps": 1e-5})
    assert "unexpected scalar 'Z'" in error_text(kernel, arrays, {"eps": 1.0, "Z": 2})


@pytest.mark.parametrize("eps, shown", [(True, "bool True"), ("1e-5", "str"), (1 + 2j, "complex"), (np.ones(2), "float64(2,)")])
def test_scalars_must_be_real_numbers(eps, shown):
    kernel = load("rmsnorm.napkin")
    text = error_text(kernel, {"X": np.ones((2, 3), BF16), "G": np.ones(3, BF16)}, {"eps": eps})
    assert "scalar eps must be a real number (f32 (NumPy float32))" in text and shown in text


def test_integer_scalars():
    (kernel,) = napkin.load("kernel k(X: f32[n], s: i32) -> Y: f32[n]:\n    Y[n] = X * s\n").values()
    X = np.ones(2, np.float32)
    assert bind(kernel, {"X": X}, {"s": 3}).scalars["s"] == 3
    assert "pass an integer" in error_text(kernel, {"X": X}, {"s": 2.5})
    assert "pass an integer" in error_text(kernel, {"X": X}, {"s": 3.0})
    assert bind(kernel, {"X": X}, {"s": 3.0}, cast=True).scalars["s"] == 3
    assert "pass an integer" in error_text(kernel, {"X": X}, {"s": 2.5}, cast=True)
    assert "does not fit i32" in error_text(kernel, {"X": X}, {"s": 2**40})


def test_non_arrays_need_cast(attention):
    arrays = qkv()
    arrays["Q"] = arrays["Q"].tolist()
    text = error_text(attention, arrays)
    assert "Q must be a numpy.ndarray of bf16 (NumPy ml_dtypes.bfloat16), got list; pass cast=True" in text


def test_masked_arrays_are_refused_even_with_cast():
    kernel = load("softmax.napkin")
    X = np.ma.masked_array(np.ones((2, 3), np.float32), mask=[[1, 0, 0], [0, 0, 0]])
    assert "masked array" in error_text(kernel, {"X": X}, cast=True)


def test_axis_only_in_outputs_needs_sizes():
    kernel = load("paper/fig11.napkin")
    arrays = {"X": np.ones((2, 3), np.float32), "W": np.ones(4, np.float32)}
    text = error_text(kernel, arrays)
    assert "axis y is not carried by any input (it appears only in Y)" in text and "sizes={'y': N}" in text


@pytest.mark.parametrize("sizes, message", [
    ({"y": 6, "a": 3}, "axis a is 2 in X (dim 0) but 3 in sizes="),
    ({"y": 6, "z": 1}, "sizes= names axis 'z', which fig11 does not have"),
    ({"y": 0}, "sizes['y'] is 0"),
    ({"y": -1}, "sizes['y'] is -1"),
    ({"y": 2.0}, "sizes['y'] must be an integer, got float 2.0"),
    ({"y": True}, "sizes['y'] must be an integer"),
])
def test_bad_sizes(sizes, message):
    kernel = load("paper/fig11.napkin")
    arrays = {"X": np.ones((2, 3), np.float32), "W": np.ones(4, np.float32)}
    assert message in error_text(kernel, arrays, sizes=sizes)


def test_every_problem_is_reported_at_once_with_the_call(attention):
    arrays = qkv()
    arrays["K"] = np.ones((1, 2, 5, 7), np.float32)
    del arrays["V"]
    text = error_text(attention, arrays)
    assert text.count("\n  - ") == 3
    assert text.startswith("error: cannot call attention(Q: bf16[b h q d], K: bf16[b h x d], V: bf16[b h x d]) -> O: bf16[b h q d]:")
    assert "called with Q: bfloat16(1, 2, 3, 4), K: float32(1, 2, 5, 7)" in text


def test_call_errors_are_napkin_errors(attention):
    with pytest.raises(NapkinError):
        bind(attention, {})


# ---- the memory guard -----------------------------------------------------------------------------


def test_estimate_counts_every_array_in_float64_plus_workspace():
    kernel = load("matmul.napkin")
    sizes = {"m": 10, "k": 20, "n": 30}
    arrays_in_float64 = 8 * (10 * 20 + 20 * 30 + 10 * 30)
    output_as_f32 = 4 * 10 * 30
    workspace = 8 * (10 * 20 + 20 * 30 + 10 * 30)
    assert estimate_reference_bytes(kernel, sizes) == arrays_in_float64 + output_as_f32 + workspace


def test_the_guard_names_the_largest_array_and_its_size():
    kernel = load("attention.napkin")
    sizes = {"b": 8, "h": 32, "q": 8192, "x": 8192, "d": 128}
    with pytest.raises(NapkinCallError) as info:
        check_reference_memory(kernel, sizes, limit=2**30)
    text = str(info.value)
    assert "the NumPy reference of attention would need about" in text
    assert "limit of 1.00 GiB (memory_limit=)" in text
    assert "the largest array is S[b h q x] (intermediate, 17,179,869,184 values in float64): 128.00 GiB" in text


def test_the_guard_passes_small_calls_and_can_be_switched_off():
    kernel = load("attention.napkin")
    small = {"b": 1, "h": 1, "q": 4, "x": 4, "d": 4}
    huge = {"b": 64, "h": 64, "q": 2**16, "x": 2**16, "d": 256}
    assert check_reference_memory(kernel, small) == estimate_reference_bytes(kernel, small)
    assert check_reference_memory(kernel, huge, limit=math.inf) > 2**48
    with pytest.raises(NapkinCallError, match="25% of"):
        check_reference_memory(kernel, huge)


def test_default_limit_is_a_quarter_of_memory():
    total = physical_memory_bytes()
    assert total is None or total > 0
    assert default_memory_limit() == (total // 4 if total else 4 << 30)


# ---- arrays of other libraries: DLPack and __cuda_array_interface__ -----------------------------


class DLPackOnly:
    """An array that speaks only DLPack, as a library napkin does not know would.

    ``device`` is what it claims in __dlpack_device__: (2, 0) poses as a CUDA array (its
    memory stays on the host; only its pointer is handed on, never read)."""

    def __init__(self, array: np.ndarray, device=(1, 0)):
        self.array, self.device = array, device

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.device


class CudaInterfaceOnly:
    """An array that speaks only __cuda_array_interface__ (Numba's and older CuPy's way)."""

    def __init__(self, shape, typestr, address=0x7F0000000000, strides=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (address, False),
                                         "strides": strides, "version": 3}


def test_dlpack_arrays_need_no_cast_and_are_copied(attention):
    arrays = qkv(dtype=np.float32)
    f32 = load("softmax.napkin")
    X = np.arange(6, dtype=np.float32).reshape(2, 3)
    binding = bind(f32, {"X": DLPackOnly(X)})
    np.testing.assert_array_equal(binding.inputs["X"], X)
    assert not np.shares_memory(binding.inputs["X"], X)
    # A library napkin does not know gets NumPy outputs back.
    assert binding.deliver({"Y": X}) == {"Y": X}
    text = error_text(attention, {**arrays, "Q": DLPackOnly(arrays["Q"])})
    assert "Q must be bf16 (NumPy ml_dtypes.bfloat16), got float32; convert it first or pass cast=True" in text


@pytest.mark.parametrize(("code", "bits", "name"), [(4, 16, "bfloat16"), (10, 8, "float8_e4m3fn"), (12, 8, "float8_e5m2"),
                                                    (2, 16, "float16"), (2, 32, "float32"), (0, 32, "int32"), (6, 8, "bool")])
def test_dlpack_dtype_codes_map_to_the_types_napkin_stores(code, bits, name):
    from napkin_dsl.binding import _dlpack_dtype

    assert _dlpack_dtype(code, bits, 1).name == name
    assert _dlpack_dtype(code, bits, 4) is None  # vector lanes: no NumPy type


def test_dlpack_f16_arrays_keep_their_dtype():
    # NumPy cannot export bf16 or fp8 through DLPack: torch exercises those codes (test_torch.py).
    f16 = np.array([[1.5, -2.0]], np.float16)
    kernel = napkin.load("kernel k(X: f16[a b]) -> Y: f32[a b]:\n    Y[a b] = X * 2\n")["k"]
    assert bind(kernel, {"X": DLPackOnly(f16)}).inputs["X"].dtype == np.float16


def test_cuda_arrays_are_kept_in_place_for_the_cuda_backend_only():
    from napkin_dsl.binding import DeviceArray

    kernel = load("softmax.napkin")
    X = np.ones((4, 8), np.float32)
    binding = bind(kernel, {"X": DLPackOnly(X, device=(2, 0))}, keep_on_device=True)
    device = binding.inputs["X"]
    assert isinstance(device, DeviceArray) and device.shape == (4, 8) and device.dtype == np.float32
    interface = device.__cuda_array_interface__
    assert interface["data"][0] == X.ctypes.data and interface["typestr"] == "<f4" and interface["strides"] is None
    assert binding.sizes == {"r": 4, "c": 8}
    with pytest.raises(NapkinCallError, match=r"X \(DLPackOnly\) is in CUDA device memory, which the host backends"):
        bind(kernel, {"X": DLPackOnly(X, device=(2, 0))})
    text = error_text(kernel, {"X": DLPackOnly(np.ones((8, 4), np.float32).T, device=(2, 0))}, keep_on_device=True)
    assert "is not C-contiguous on its device" in text
    text = error_text(kernel, {"X": DLPackOnly(np.ones((4, 8), np.float16), device=(2, 0))}, keep_on_device=True, cast=True)
    assert "X is float16 in CUDA device memory but is declared f32" in text and "does not convert on the device" in text


def test_cuda_array_interface_objects():
    kernel = napkin.load("kernel k(X: bf16[a b]) -> Y: f32[a b]:\n    Y[a b] = X * 2\n")["k"]
    binding = bind(kernel, {"X": CudaInterfaceOnly((3, 5), "<V2")}, keep_on_device=True)
    assert binding.inputs["X"].dtype == BF16 and binding.inputs["X"].address == 0x7F0000000000
    assert binding.inputs["X"].__cuda_array_interface__["typestr"] == "<V2"  # what the CUDA backend takes as bf16
    text = error_text(kernel, {"X": CudaInterfaceOnly((3, 5), "<f4")}, keep_on_device=True)
    assert "X is float32 in CUDA device memory but is declared bf16" in text
    text = error_text(kernel, {"X": CudaInterfaceOnly((3, 5), "<V2", strides=(2, 6))}, keep_on_device=True)
    assert "not C-contiguous" in text
    assert "host backends (numpy, opencl) cannot read" in error_text(kernel, {"X": CudaInterfaceOnly((3, 5), "<V2")})


# ---- the legality steps of bind(), one at a time: each returns its reason, or None -------------

from napkin_dsl.binding import (  # noqa: E402 - the private steps, tested apart from bind()
    _agreement_problem,
    _argument_problems,
    _bind_scalar,
    _Caller,
    _dtype_problem,
    _given_size_problem,
    _output_refusal,
    _rank_problem,
    _Readable,
    _readable_array,
    _Refused,
    _scalar_problem,
)


def test_argument_problems_name_the_missing_and_the_unexpected(attention):
    diagram = attention.diagram
    arrays = qkv()
    assert _argument_problems(diagram, arrays, {}) == []
    del arrays["V"]
    arrays["Kk"] = arrays["K"]
    assert _argument_problems(diagram, arrays, {}) == [
        "missing array V: bf16[b h x d]",
        "unexpected argument 'Kk': attention takes Q, K, V (did you mean 'K'?)",
    ]


def test_readable_array_says_why_an_argument_is_not_an_array(attention):
    declared = attention.diagram.arrays["Q"]
    readable = _readable_array("Q", qkv()["Q"], declared, cast=False, keep_on_device=False)
    assert isinstance(readable, _Readable) and not readable.foreign
    assert "pass cast=True" in _readable_array("Q", [[1.0]], declared, cast=False, keep_on_device=False)
    assert isinstance(_readable_array("Q", [[1.0]], declared, cast=True, keep_on_device=False), _Readable)
    masked = np.ma.masked_array(np.ones(2, BF16))
    assert "masked array" in _readable_array("Q", masked, declared, cast=True, keep_on_device=False)


def test_rank_and_dtype_problems(attention):
    declared = attention.diagram.arrays["Q"]
    good = qkv()["Q"]
    assert _rank_problem("Q", good, declared) is None
    assert "(4 axes) but got an array of shape (2, 3) (2 axes)" in _rank_problem("Q", np.ones((2, 3), BF16), declared)
    assert _dtype_problem("Q", _Readable(good, False), declared, cast=False) is None
    wrong = _Readable(good.astype(np.float32), False)
    assert "convert it with .astype(...) or pass cast=True" in _dtype_problem("Q", wrong, declared, cast=False)
    assert _dtype_problem("Q", wrong, declared, cast=True) is None
    complex_values = _Readable(np.ones(good.shape, np.complex64), False)
    assert "cannot convert complex64 values to numbers" in _dtype_problem("Q", complex_values, declared, cast=True)


def test_agreement_and_given_size_problems():
    diagram = load("paper/fig11.napkin").diagram
    bound = {"a": (2, "X (dim 0)")}
    assert _agreement_problem("a", 2, "sizes=", bound) is None
    assert _agreement_problem("y", 7, "sizes=", bound) is None  # not bound yet
    assert _agreement_problem("a", 3, "sizes=", bound) == "axis a is 2 in X (dim 0) but 3 in sizes="
    assert _given_size_problem(diagram, "y", 6) is None
    assert _given_size_problem(diagram, "y", np.int64(6)) is None
    assert _given_size_problem(diagram, "y", 0) == "sizes['y'] is 0; napkin kernels need at least one element along every axis"
    assert _given_size_problem(diagram, "y", True) == "sizes['y'] must be an integer, got bool True"
    assert _given_size_problem(diagram, "z", 1).startswith("sizes= names axis 'z', which fig11 does not have")


def test_scalar_problems_and_binding():
    (kernel,) = napkin.load("kernel s(X: f32[a], n: i32) -> Y: f32[a]:\n    Y[a] = X * n\n").values()
    declared = kernel.diagram.scalars["n"]
    assert _scalar_problem("n", 3, declared, cast=False) is None
    assert _scalar_problem("n", 3.0, declared, cast=True) is None
    assert "pass an integer" in _scalar_problem("n", 3.0, declared, cast=False)
    assert "pass an integer" in _scalar_problem("n", 2.5, declared, cast=True)
    assert "must be a real number" in _scalar_problem("n", True, declared, cast=False)
    assert "does not fit i32" in _scalar_problem("n", 2**40, declared, cast=False)
    assert _bind_scalar("n", np.array(3.0), declared, cast=True) == np.int32(3)
    # A text argument is refused with its reason, never taken for a reason itself.
    refused = _bind_scalar("n", "three", declared, cast=False)
    assert isinstance(refused, _Refused) and refused.reason.startswith("scalar n must be a real number")


def test_output_refusal_when_the_caller_cannot_hold_an_output(attention):
    # CuPy has no bf16: attention's bf16 output could not go back as a CuPy array.
    refusal = _output_refusal(attention.diagram, _Caller("cupy", 0))
    assert isinstance(refusal, NotImplementedError) and "cupy has no bfloat16 type" in str(refusal)
    assert _output_refusal(load("softmax.napkin").diagram, _Caller("cupy", 0)) is None
