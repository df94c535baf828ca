"""Calling a kernel (``Kernel.__call__``), bad input through it, and the ``napkin run`` command."""
# ruff: noqa: F821, UP037  (axis strings in @napkin.kernel annotations, as for jaxtyping)

from __future__ import annotations

import json
import os
import sys
import tracemalloc
import types

import ml_dtypes
import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import driver
from napkin_dsl.backends.numpy import random_arguments
from napkin_dsl.cli import main
from napkin_dsl.errors import NapkinCallError, NapkinError
from napkin_dsl.reference import reference

from .conftest import EXAMPLES, ROOT

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def attention():
    return napkin.load(EXAMPLES / "attention.napkin")["attention"]


@pytest.fixture(scope="module")
def qkv(attention):
    arrays, _ = random_arguments(attention.diagram, {"b": 1, "h": 2, "q": 150, "x": 70, "d": 16}, 0)
    return arrays["Q"], arrays["K"], arrays["V"]


def close(got, want, rtol=1e-2):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= rtol * np.max(np.abs(want))


# ---- calling ----------------------------------------------------------------------------------


def test_call_returns_the_output_in_its_declared_dtype(attention, qkv):
    out = attention(*qkv)
    assert isinstance(out, np.ndarray) and out.dtype == BF16 and out.shape == qkv[0].shape
    close(out, reference(attention, *qkv))


def test_arguments_by_position_and_by_name(attention, qkv):
    q, k, v = qkv
    np.testing.assert_array_equal(attention(q, k, v).astype(np.float32), attention(V=v, Q=q, K=k).astype(np.float32))
    np.testing.assert_array_equal(attention(q, V=v, K=k).astype(np.float32), attention(q, k, v).astype(np.float32))
    with pytest.raises(NapkinCallError, match="Q both by position and by name"):
        attention(q, k, v, Q=q)
    with pytest.raises(NapkinCallError, match="takes 3 arguments"):
        attention(q, k, v, v)


def test_several_outputs_come_back_as_a_dict():
    (kernel,) = napkin.load("""
kernel both(X: f32[r c]) -> Y: f32[r c], M: f32[r]:
    Y[r c] = exp(X)
    M[r] = max[c](X)

relabel both on H100:
    smem: group r 4; stream c 8
""").values()
    x = np.random.default_rng(0).standard_normal((9, 21)).astype(np.float32)
    out = kernel(x)
    assert set(out) == {"Y", "M"}
    np.testing.assert_allclose(out["Y"], np.exp(x), rtol=1e-6)
    np.testing.assert_array_equal(out["M"], x.max(1))


def test_the_program_is_cached_per_binding(attention, qkv):
    attention(*qkv)
    programs = {key: value for key, value in attention._cache.items() if key[0] == "program"}
    attention(*qkv)
    assert {key: value for key, value in attention._cache.items() if key[0] == "program"} == programs
    small = tuple(a[:, :, :7] for a in qkv)
    attention(*small)
    assert len([key for key in attention._cache if key[0] == "program"]) == len(programs) + 1


def test_kernels_without_a_relabel_block_run_as_one_group():
    kernel = napkin.load(EXAMPLES / "attention_unfused.napkin")["attention_unfused"]
    arrays, _ = random_arguments(kernel.diagram, {"q": 20, "x": 30, "d": 8}, 1)
    out = kernel(**arrays)
    assert out.dtype == np.float16
    close(out, reference(kernel, **arrays))


def test_decorated_kernels_with_scalars_and_hardware():
    @napkin.kernel(hardware="H100", relabel="smem: group t 3")
    def norm(X: napkin.f32["t d"], G: napkin.f32["d"], eps: napkin.f32) -> napkin.f32["t d"]:
        """
        ms[t] = mean[d](X * X)
        Y[t d] = X * rsqrt(ms + eps) * G
        """

    x = np.random.default_rng(2).standard_normal((10, 6)).astype(np.float32)
    g = np.linspace(0.5, 1.5, 6).astype(np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-5) * g
    np.testing.assert_allclose(norm(x, g, 1e-5), want, rtol=1e-5)
    np.testing.assert_allclose(norm(x, g, eps=1e-5, hardware="H100"), want, rtol=1e-5)


def test_opaque_boxes_take_impls_and_sizes_for_axes_and_group_sizes():
    kernel = napkin.load(EXAMPLES / "paper" / "fig11.napkin")["fig11"]
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    w = np.ones(4, np.float32)

    def F(X, W):
        return np.stack([X.sum(-1) + W.sum(-1), X[..., 0]], axis=-1)

    out = kernel(x, w, impls={"F": F}, sizes={"y": 2, "g_a": 4})
    np.testing.assert_allclose(out, np.stack([x.sum(1) + 4, x[:, 0]], 1))
    with pytest.raises(NapkinCallError, match="box F has no implementation"):
        kernel(x, w, sizes={"y": 2, "g_a": 4})
    with pytest.raises(NapkinError, match="g_a"):
        kernel(x, w, impls={"F": F}, sizes={"y": 2})  # the group size is a symbol nobody bound


def test_inputs_are_neither_written_nor_kept(attention, qkv):
    q, k, v = qkv
    copies = [a.copy() for a in qkv]
    before = sys.getrefcount(q), sys.getrefcount(k), sys.getrefcount(v)
    out = attention(q, k, v)
    assert (sys.getrefcount(q), sys.getrefcount(k), sys.getrefcount(v)) == before  # nothing kept a reference
    for array, copy in zip(qkv, copies, strict=False):
        np.testing.assert_array_equal(array.astype(np.float32), copy.astype(np.float32))
        assert not np.shares_memory(out, array)


# ---- backends -----------------------------------------------------------------------------------


@pytest.mark.skipif(driver.cuda_available(), reason="a CUDA GPU is present")
def test_auto_is_numpy_without_a_gpu_and_cuda_says_there_is_none(attention, qkv):
    np.testing.assert_array_equal(attention(*qkv, backend="auto").astype(np.float32), attention(*qkv).astype(np.float32))
    with pytest.raises(driver.NoCudaDevice, match="no CUDA GPU"):
        attention(*qkv, backend="cuda")


def test_a_missing_backend_function_is_not_implemented(attention, qkv, monkeypatch):
    monkeypatch.setitem(sys.modules, "napkin_dsl.backends.opencl", types.ModuleType("napkin_dsl.backends.opencl"))
    with pytest.raises(NotImplementedError, match=r"napkin_dsl.backends.opencl has no run\(program, inputs, scalars\)"):
        attention(*qkv, backend="opencl")


def test_other_backends_get_the_program_and_private_inputs(attention, qkv, monkeypatch):
    calls = []

    def run(program, inputs, scalars):
        calls.append((program, inputs, scalars))
        return {"O": np.zeros(inputs["Q"].shape, BF16)}

    fake = types.ModuleType("napkin_dsl.backends.opencl")
    fake.run = run
    monkeypatch.setitem(sys.modules, "napkin_dsl.backends.opencl", fake)
    out = attention(*qkv, backend="opencl")
    (program, inputs, scalars), = calls
    assert program is attention.program(None, b=1, h=2, q=150, x=70, d=16)
    assert set(inputs) == {"Q", "K", "V"} and scalars == {}
    assert not any(np.shares_memory(inputs[n], a) for n, a in zip("QKV", qkv, strict=False))
    assert out.shape == qkv[0].shape


def test_run_says_when_a_backend_is_missing(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "napkin_dsl.backends.opencl", types.ModuleType("napkin_dsl.backends.opencl"))
    code, _, err = cli(["run", "examples/softmax.napkin", "--backend", "opencl"], capsys)
    assert code == 2
    assert "napkin_dsl.backends.opencl has no run(program, inputs, scalars)" in err


def test_unknown_backend(attention, qkv):
    with pytest.raises(NapkinError, match="unknown backend 'tpu'"):
        attention(*qkv, backend="tpu")


# ---- bad input through __call__ -----------------------------------------------------------------


def test_wrong_rank(attention, qkv):
    q, k, v = qkv
    with pytest.raises(NapkinCallError, match=r"Q is declared bf16\[b h q d\] \(4 axes\) but got an array of shape \(2, 150, 16\)"):
        attention(q[0], k, v)


def test_wrong_dtype_and_cast(attention, qkv):
    as_f32 = [a.astype(np.float32) for a in qkv]
    with pytest.raises(NapkinCallError, match=r"Q must be bf16 \(NumPy ml_dtypes.bfloat16\), got float32; .*cast=True"):
        attention(*as_f32)
    np.testing.assert_array_equal(attention(*as_f32, cast=True).astype(np.float32), attention(*qkv).astype(np.float32))
    lists = [a.astype(np.float64).tolist() for a in qkv]
    np.testing.assert_array_equal(attention(*lists, cast=True).astype(np.float32), attention(*qkv).astype(np.float32))


@pytest.mark.parametrize("layout", ["fortran", "strided", "reversed", "readonly", "broadcast"])
def test_any_layout_gives_the_same_result(attention, qkv, layout):
    q, k, v = qkv
    if layout == "fortran":
        q = np.asfortranarray(q)
    elif layout == "strided":
        q = np.repeat(q, 2, axis=3)[..., ::2]
    elif layout == "reversed":
        flipped = np.ascontiguousarray(q[:, :, ::-1])
        q = flipped[:, :, ::-1]
    elif layout == "readonly":
        q = q.copy()
        q.flags.writeable = False
    elif layout == "broadcast":  # a stride-0 view: one head repeated
        q = np.broadcast_to(q[:, :1], q.shape)
    out = attention(q, k, v)
    np.testing.assert_array_equal(out.astype(np.float32), attention(np.ascontiguousarray(q), k, v).astype(np.float32))


def test_nan_and_inf_propagate_and_never_crash(attention, qkv):
    q, k, v = (a.copy() for a in qkv)
    q[0, 0, 3, 5] = np.nan
    v[0, 1, 10, 2] = np.inf
    out = attention(q, k, v).astype(np.float32)
    assert np.isnan(out[0, 0, 3]).all()  # the NaN row of S spreads over its whole output row
    assert np.isinf(out[0, 1, :, 2]).all() or np.isnan(out[0, 1, :, 2]).any()
    assert np.isfinite(out[0, 0, :3]).all() and np.isfinite(out[0, 1, :, :2]).all()
    k[0, 0] = -np.inf
    out = attention(q, k, v)  # inf - inf inside the softmax: NaN, no exception
    assert out.shape == q.shape


def test_zero_size_axis(attention, qkv):
    q, k, v = qkv
    with pytest.raises(NapkinCallError, match=r"axis q has size 0 in Q \(dim 2\)"):
        attention(q[:, :, :0], k, v)


def test_sizes_too_large_are_refused_before_anything_is_allocated(attention):
    # Stride-0 views: terabytes of logical size, bytes of memory.
    huge = np.broadcast_to(np.ones((), BF16), (1024, 1024, 8192, 128))
    tracemalloc.start()
    try:
        with pytest.raises(NapkinCallError, match=r"running attention on the host would need about .* bytes .* at b=1024, h=1024"):
            attention(huge, huge, huge)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20


# ---- napkin run and napkin report ----------------------------------------------------------------


def cli(args, capsys) -> tuple[int, str, str]:
    os.chdir(ROOT)
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_run_prints_errors_counts_and_time(capsys):
    code, out, err = cli(["run", "examples/attention.napkin", "--set", "q=70", "x=50", "d=16"], capsys)
    assert code == 0, err
    assert "run attention on numpy (H100 program) with b=2 h=2 q=70 d=16 x=50: ok" in out
    assert "max abs error" in out and "wall time" in out
    assert "H counted" in out and "H predicted" in out


def test_run_json(capsys):
    code, out, err = cli(["run", "examples/matmul.napkin", "--set", "m=40", "n=30", "k=20", "--seed", "3", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)["kernels"]["matmul"]
    assert result["max_rel_error"] < 1e-5 and result["wall_s"] > 0
    assert result["counted"] == result["predicted"]
    # n = 30 keeps it off tensor cores; the FMA path's C.acc is at registers, where nothing moves
    assert set(result["predicted"]) == {"l2", "smem", "registers"} and result["predicted"]["registers"]["H"] == 0
    assert result["predicted"]["smem"]["flops"] == 2 * 40 * 30 * 20 and "flops" not in result["predicted"]["l2"]


def test_run_on_other_hardware_and_every_example(capsys):
    for example in ["softmax.napkin", "rmsnorm.napkin", "mlp.napkin", "gqa.napkin", "attention_unfused.napkin", "paper/fig9.napkin"]:
        code, out, err = cli(["run", f"examples/{example}", "--json"], capsys)
        assert code == 0, (example, err)
        (result,) = json.loads(out)["kernels"].values()
        assert result["counted"] == result["predicted"], example


def test_run_exits_1_when_the_error_exceeds_the_tolerance(capsys, monkeypatch):
    from napkin_dsl.backends import numpy as backend

    monkeypatch.setitem(backend.TOLERANCE, "bf16", 1e-9)
    code, out, _ = cli(["run", "examples/attention.napkin", "--set", "q=20", "x=20", "d=8"], capsys)
    assert code == 1
    assert "FAILED" in out


def test_run_refuses_opaque_boxes_with_exit_2(capsys):
    code, _out, err = cli(["run", "examples/paper/fig11.napkin"], capsys)
    assert code == 2
    assert "cannot run kernels with opaque boxes without implementations: fig11 uses opaque box F" in err


def test_report_includes_the_run_check(capsys):
    code, out, err = cli(["report", "examples/softmax.napkin"], capsys)
    assert code == 0, err
    assert "run softmax_rows on numpy" in out and ": ok" in out
    code, out, err = cli(["report", "examples/paper/fig11.napkin"], capsys)
    assert code == 0, err
    assert "run: skipped (fig11 uses opaque box F" in out


def test_the_cuda_backend_gets_cuda_arrays_in_place(monkeypatch):
    """Zero-copy hand-off: a CUDA array reaches the launch as its own device pointer.

    No GPU here: the array poses as CUDA memory through __dlpack_device__, and the driver is
    replaced at its boundary (tests/test_one_road.py's recording device); the pointer is never
    dereferenced. The kernel is compiled through NVRTC as on a GPU."""
    pytest.importorskip("cuda.bindings")
    from napkin_dsl.backends import cuda

    from .test_one_road import RecordingDevice

    class PosingAsCuda:
        def __init__(self, array):
            self.array = array

        def __dlpack__(self, stream=None):
            return self.array.__dlpack__()

        def __dlpack_device__(self):
            return (2, 0)

    device = RecordingDevice()
    launched = []
    monkeypatch.setattr(device, "launch", lambda function, grid, block, args, shared_bytes=0, stream=None: launched.append(args))
    monkeypatch.setattr(cuda, "current_device", lambda: device)
    monkeypatch.setattr(cuda, "_modules", {})
    (softmax,) = napkin.load(EXAMPLES / "softmax.napkin").values()
    X = np.ones((4, 8), np.float32)
    softmax(PosingAsCuda(X), backend="cuda")
    assert [a.value for args in launched for a in args if hasattr(a, "value")] == [X.ctypes.data]
    with pytest.raises(NapkinCallError, match="host backends"):
        softmax(PosingAsCuda(X), backend="numpy")
