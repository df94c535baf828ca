"""Kernels as torch custom ops (napkin_dsl/torch_op.py, issue 45): torch.library.opcheck on every
example (schema, fake tensor, autograd registration, AOT dispatch with dynamic shapes), gradients
against torch's own autograd in float64, and a small model of napkin kernels under
torch.compile(fullgraph=True) with no graph break, forward and backward."""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends.numpy import random_arguments, tolerance
from napkin_dsl.errors import NapkinError

from .conftest import EXAMPLES

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = ("float8_e4m3fn", "float8_e5m2")
ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# torch's own schema check multiplies the inputs, which CPU torch does not do in fp8
# ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'): the other three run there
FP8_CHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
EXAMPLE_FILES = sorted(p.name for p in EXAMPLES.glob("*.napkin"))


def as_torch(array: np.ndarray):
    """A torch tensor of the same values and dtype, built without napkin."""
    if array.dtype == BF16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    if array.dtype.name in FP8:
        return torch.from_numpy(array.astype(np.float32)).to(getattr(torch, array.dtype.name))
    return torch.from_numpy(np.ascontiguousarray(array).copy())


def example_arguments(kernel, requires_grad: bool, seed: int = 0):
    sizes = {a: 8 if a == "d" else 5 for a in kernel.diagram.axes}
    arrays, scalars = random_arguments(kernel.diagram, sizes, seed)
    args = []
    for name in kernel.diagram.params:
        if name in arrays:
            tensor = as_torch(arrays[name])
            if requires_grad and tensor.is_floating_point() and str(tensor.dtype).split(".")[-1] not in FP8:
                tensor.requires_grad_()
            args.append(tensor)
        else:
            args.append(float(scalars[name]))
    return args


@pytest.mark.parametrize("example", EXAMPLE_FILES)
def test_opcheck_passes_for_every_example(example):
    (kernel,) = napkin.load(EXAMPLES / example).values()
    op = kernel.torch_op()
    checks = FP8_CHECKS if "fp8" in example else ALL_CHECKS
    results = torch.library.opcheck(op.forward, tuple(example_arguments(kernel, True)), test_utils=checks)
    assert results == dict.fromkeys(checks, "SUCCESS")
    # the derived backward is an op of its own, checked the same way (it has no second derivative)
    backward = op.backward
    assert backward is not None and backward.backward is None
    args = example_arguments(backward.kernel, False)
    assert torch.library.opcheck(backward.forward, tuple(args), test_utils=checks) == dict.fromkeys(checks, "SUCCESS")


def test_the_op_is_the_kernels_signature_and_made_once():
    (kernel,) = napkin.load(EXAMPLES / "rmsnorm.napkin").values()
    op = kernel.torch_op()
    assert kernel.torch_op() is op  # one registration per text and options: torch.library names are global
    schema = str(op.forward._opoverload._schema)
    assert re.fullmatch(rf"napkin::{op.name}\(Tensor X, Tensor G, float eps\) -> Tensor", schema), schema
    assert kernel.torch_op(backend="opencl") is not op


def test_an_lse_backward_saves_the_lse_the_forward_op_returns_and_the_call_hides_it():
    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    op = kernel.torch_op(save_lse=True)
    assert op.returned == ("O", "L") and op.outputs == ("O",)
    assert "L" in op.backward.kernel.diagram.params
    Q, K, V = example_arguments(kernel, True)
    out = op(Q, K, V)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == Q.shape
    assert op(Q=Q, K=K, V=V).equal(out)


def _f32(example: str):
    (kernel,) = napkin.load((EXAMPLES / example).read_text().replace("bf16", "f32")).values()
    return kernel


def _attention(Q, K, V):
    S = Q @ K.transpose(-1, -2) / math.sqrt(Q.shape[-1])
    return torch.softmax(S, -1) @ V


@pytest.mark.parametrize("save_lse", [False, True])
def test_gradients_match_torch_autograd_in_float64(save_lse):
    kernel = _f32("attention.napkin")
    op = kernel.torch_op(save_lse=save_lse)
    generator = torch.Generator().manual_seed(3)
    sizes = dict(b=1, h=2, q=7, x=9, d=8)
    Q, K, V = (torch.randn(1, 2, n, 8, generator=generator).requires_grad_() for n in (7, 9, 9))
    W = torch.randn(1, 2, 7, 8, generator=generator, dtype=torch.float64)
    (op(Q, K, V).double() * W).sum().backward()
    reference = [t.detach().double().requires_grad_() for t in (Q, K, V)]
    (_attention(*reference) * W).sum().backward()
    allowed = 4 * (tolerance(kernel.program(**sizes)) + tolerance(op.backward.kernel.program(**sizes)))
    for got, want in zip((Q, K, V), reference, strict=True):
        error = (got.grad.double() - want.grad).abs().max() / want.grad.abs().max()
        assert error <= allowed, (error, allowed)


def test_bad_calls_and_options_are_named():
    (kernel,) = napkin.load(EXAMPLES / "softmax.napkin").values()
    op = kernel.torch_op()
    with pytest.raises(NapkinError, match=r"X missing"):
        op()
    with pytest.raises(NapkinError, match=r"no parameter Z"):
        op(torch.ones(2, 3), Z=1)
    with pytest.raises(NapkinError, match="numpy or opencl backend, not 'cuda'"):
        kernel.torch_op(backend="cuda")
    # an output axis no input carries needs its size
    broadcast = napkin.load("kernel spread(X: f32[r]) -> Y: f32[r c]:\n    Y[r c] = X\n")["spread"]
    with pytest.raises(NapkinError, match="output Y's axis c is carried by no input"):
        broadcast.torch_op()
    assert broadcast.torch_op(c=3)(torch.ones(2)).shape == (2, 3)


class Block(torch.nn.Module):
    """A pre-norm transformer block of napkin kernels: RMSNorm, attention, RMSNorm, SwiGLU."""

    def __init__(self, ops: dict, d: int, f: int, generator):
        super().__init__()
        self.ops = ops
        self.norm1, self.norm2 = (torch.nn.Parameter(torch.ones(d)) for _ in range(2))
        self.wq, self.wk, self.wv = (torch.nn.Parameter(torch.randn(d, d, generator=generator) / d ** 0.5) for _ in range(3))
        self.w1, self.w3 = (torch.nn.Parameter(torch.randn(d, f, generator=generator) / d ** 0.5) for _ in range(2))
        self.w2 = torch.nn.Parameter(torch.randn(f, d, generator=generator) / f ** 0.5)

    def forward(self, x, ops=None):
        ops = ops or self.ops
        t, d = x.shape
        h = ops["rmsnorm"](x, self.norm1, 1e-6)
        q, k, v = ((h @ w).view(1, 1, t, d) for w in (self.wq, self.wk, self.wv))
        x = x + ops["attention"](q, k, v).view(t, d)
        return x + ops["swiglu"](ops["rmsnorm"](x, self.norm2, 1e-6), self.w1, self.w3, self.w2)


def _eager_ops():
    def rmsnorm(X, G, eps):
        return X * torch.rsqrt((X * X).mean(-1, keepdim=True) + eps) * G

    def swiglu(X, W1, W3, W2):
        return (torch.nn.functional.silu(X @ W1) * (X @ W3)) @ W2

    return {"rmsnorm": rmsnorm, "attention": _attention, "swiglu": swiglu}


def test_a_block_of_napkin_ops_compiles_fullgraph_with_no_graph_break_forward_and_backward():
    ops = {name: _f32(f"{name}.napkin").torch_op() for name in ("rmsnorm", "attention", "swiglu")}
    generator = torch.Generator().manual_seed(5)
    block = Block(ops, d=16, f=24, generator=generator)
    x = torch.randn(12, 16, generator=generator)
    explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(block, fullgraph=True)
    loss = compiled(x).square().mean()
    loss.backward()
    got = {name: p.grad.clone() for name, p in block.named_parameters()}
    # the same block in float64 torch, eagerly
    block.zero_grad()
    double = {name: p.detach().double().requires_grad_() for name, p in block.named_parameters()}
    reference = Block(_eager_ops(), 16, 24, generator).double()
    reference.load_state_dict(double)
    want_loss = reference(x.double()).square().mean()
    want_loss.backward()
    assert abs(loss.item() - want_loss.item()) <= 1e-4 * abs(want_loss.item())
    for name, p in reference.named_parameters():
        error = (got[name].double() - p.grad).abs().max() / p.grad.abs().max()
        assert error <= 1e-3, (name, error)


def test_a_new_batch_size_recompiles_nothing():
    op = _f32("softmax.napkin").torch_op()
    compiled = torch.compile(lambda x: op(x) * 2, fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    for rows in (3, 5, 8):
        x = torch.randn(rows, 7)
        assert torch.allclose(compiled(x), torch.softmax(x, -1) * 2, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1
