"""Derived backward kernels (napkin_dsl/grad.py) against torch's autograd in float64.

Each example is run through a ``Kernel`` call with torch tensors that require grad, and
``loss = (out * W).sum(); loss.backward()`` runs the derived backward kernel on the NumPy
backend. The oracle is torch's autograd of the same computation written here in torch, in
float64. The examples' dtypes are replaced (bf16 by f32, or every dtype by f64) so that the
comparison has a tolerance the dtypes give: ``backends.numpy.tolerance`` of the forward and of
the backward Program. Every elementwise function's notation derivative (``Elementwise.grad``)
is checked against central finite differences and its float64 derivative.
"""

from __future__ import annotations

import contextlib
import io
import math
import re

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import cli, elementwise
from napkin_dsl.backends.numpy import tolerance
from napkin_dsl.diagram import Contract
from napkin_dsl.errors import NapkinError
from napkin_dsl.pseudocode import ADDED_PASSES, walk

from .conftest import EXAMPLES

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _attention(Q, K, V, mask=None):
    S = Q @ K.transpose(-1, -2) / math.sqrt(Q.shape[-1])
    if mask is not None:
        S = S.masked_fill(~mask, -math.inf)
    return torch.softmax(S, -1) @ V


def _causal(Q, K, V):
    q, x = Q.shape[-2], K.shape[-2]
    return _attention(Q, K, V, torch.arange(q)[:, None] >= torch.arange(x)[None, :])


def _attention_lse(Q, K, V):
    S = Q @ K.transpose(-1, -2) / math.sqrt(Q.shape[-1])
    return {"O": torch.softmax(S, -1) @ V, "L": torch.logsumexp(S, -1)}


def _gqa(Q, K, V):  # Q[b kv r q d], K and V [b kv x d]: shared by the r heads
    return _attention(Q, K[:, :, None], V[:, :, None])


def _swiglu(X, W1, W3, W2):
    return (F.silu(X @ W1) * (X @ W3)) @ W2


def _rmsnorm(X, G, eps):
    return X * torch.rsqrt((X * X).mean(-1, keepdim=True) + eps) * G


SIZES = {"b": 1, "h": 2, "kv": 2, "r": 2, "q": 5, "x": 7, "d": 4, "m": 5, "k": 6, "n": 3,
         "t": 6, "f": 5, "e": 3, "c": 9}
# example file -> (the torch forward, its scalar arguments)
EXAMPLE_FORWARDS = {
    "attention": (_attention, {}),
    "causal_attention": (_causal, {}),
    "attention_lse": (_attention_lse, {}),
    "gqa": (_gqa, {}),
    "matmul": (lambda A, B: A @ B, {}),
    "mlp": (lambda X, W, bias: F.gelu(X @ W + bias), {}),
    "swiglu": (_swiglu, {}),
    "rmsnorm": (_rmsnorm, {"eps": 1e-6}),
    "softmax": (lambda X: torch.softmax(X, -1), {}),
}
TORCH_DTYPES = {"f32": torch.float32, "f64": torch.float64}


def _kernel(example: str, dtype: str) -> napkin.Kernel:
    """The example with its dtypes replaced: bf16 by f32 (dtype "f32"), or every float by f64."""
    text = (EXAMPLES / f"{example}.napkin").read_text()
    text = re.sub(r"\bbf16\b", "f32", text)
    if dtype == "f64":
        text = re.sub(r"\bf32\b", "f64", text)
    (kernel,) = napkin.load(text).values()
    return kernel


def _random_inputs(kernel, dtype, generator):
    arrays = {}
    for array in kernel.diagram.input_arrays:
        shape = tuple(SIZES[a] for a in array.axes)
        values = torch.randn(shape, dtype=torch.float64, generator=generator)
        arrays[array.name] = values.to(TORCH_DTYPES[dtype]).requires_grad_()
    return arrays


@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("example", sorted(EXAMPLE_FORWARDS))
def test_gradients_through_a_kernel_call_match_torch_autograd(example, dtype):
    forward, scalars = EXAMPLE_FORWARDS[example]
    kernel = _kernel(example, dtype)
    generator = torch.Generator().manual_seed(24)
    inputs = _random_inputs(kernel, dtype, generator)
    out = kernel(**inputs, **scalars)
    outputs = out if isinstance(out, dict) else {kernel.diagram.outputs[0]: out}
    weights = {name: torch.randn(value.shape, dtype=torch.float64, generator=generator) for name, value in outputs.items()}
    loss = sum((value * weights[name].to(value.dtype)).sum() for name, value in outputs.items())
    loss.backward()

    reference = {name: value.detach().double().requires_grad_() for name, value in inputs.items()}
    expected = forward(*reference.values(), **scalars)
    expected = expected if isinstance(expected, dict) else {kernel.diagram.outputs[0]: expected}
    sum((expected[name] * weights[name]).sum() for name in outputs).backward()

    sizes = {axis: SIZES[axis] for axis in kernel.diagram.axes}
    backward = kernel.grad()
    allowed = 4 * (tolerance(kernel.program(**sizes)) + tolerance(backward.program(**sizes)))
    for name, value in inputs.items():
        assert value.grad is not None, f"{name} got no gradient"
        assert value.grad.dtype == value.dtype, "a gradient has its input's dtype"
        got, want = value.grad.double().numpy(), reference[name].grad.numpy()
        error = np.abs(got - want).max() / np.abs(want).max()
        assert error <= allowed, f"d{name}: relative error {error:.3g} > {allowed:.3g}"


def test_the_bf16_example_trains_with_bf16_gradients():
    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    generator = torch.Generator().manual_seed(0)
    Q, K, V = (torch.randn(1, 2, 5, 8, generator=generator).bfloat16().requires_grad_() for _ in range(3))
    kernel(Q, K, V).float().sum().backward()
    reference = [t.detach().double().requires_grad_() for t in (Q, K, V)]
    _attention(*reference).sum().backward()
    for got, want in zip((Q, K, V), reference, strict=True):
        assert got.grad.dtype == torch.bfloat16
        error = (got.grad.double() - want.grad).abs().max() / want.grad.abs().max()
        assert error < 0.05  # bf16 inputs, cotangent and gradients: a few of bf16's 2^-8 steps


def test_under_no_grad_a_tensor_that_requires_grad_just_runs():
    kernel = _kernel("matmul", "f32")
    A = torch.randn(5, 6, requires_grad=True)
    B = torch.randn(6, 3, requires_grad=True)
    with torch.no_grad():
        C = kernel(A, B)
    assert not C.requires_grad and C.grad_fn is None
    np.testing.assert_allclose(C.numpy(), (A @ B).detach().numpy(), rtol=1e-5, atol=1e-5)
    assert kernel(A, B).grad_fn is not None  # with gradients enabled, the call is recorded


def test_only_the_inputs_that_require_grad_get_one():
    kernel = _kernel("matmul", "f32")
    A = torch.randn(5, 6, requires_grad=True)
    B = torch.randn(6, 3)
    kernel(A, B).sum().backward()
    assert B.grad is None
    np.testing.assert_allclose(A.grad.numpy(), torch.ones(5, 3) @ B.T, rtol=1e-5)


def test_a_scale_over_the_outputs_axes_gets_its_gradient():
    """A factor over the output's axes alone leaves the product (a post-scale: check.py), and the
    backward still differentiates it: ds[m] = sum[n k](dC * A * B) / 2, beside dA and dB, as torch's."""
    text = "kernel scaled(A: f64[m k], B: f64[k n], s: f64[m]) -> C: f64[m n]:\n    C[m n] = A * B * s / 2\n"
    (kernel,) = napkin.load(text).values()
    (statement,) = kernel.diagram.statements
    assert [r.array for r in statement.box.operands] == ["A", "B"]  # s left the product
    generator = torch.Generator().manual_seed(5)
    A, B, s = (torch.randn(shape, dtype=torch.float64, generator=generator).requires_grad_() for shape in ((5, 6), (6, 4), (5,)))
    weights = torch.randn(5, 4, dtype=torch.float64, generator=generator)
    (kernel(A, B, s) * weights).sum().backward()
    reference = [t.detach().clone().requires_grad_() for t in (A, B, s)]
    ((reference[0] @ reference[1] * reference[2][:, None] / 2) * weights).sum().backward()
    for got, want in zip((A, B, s), reference, strict=True):
        np.testing.assert_allclose(got.grad.numpy(), want.grad.numpy(), rtol=1e-10, atol=1e-12)


# ---- the elementwise table ---------------------------------------------------------------------


def _samples(entry, n=11):
    low, high = entry.domain
    low, high = max(low, -2.0), min(high, 2.0)
    if low == 0.0:
        low = 0.3
    values = np.linspace(low, high, n)
    return values[np.abs(values) > 0.05]  # away from the kinks of abs and relu at 0


@pytest.mark.parametrize("name", list(elementwise.FUNCTIONS))
def test_every_table_entry_has_a_notation_derivative_that_matches_finite_differences(name):
    entry = elementwise.FUNCTIONS[name]
    assert len(entry.grad) == entry.arity
    x = _samples(entry)
    args = [x] if entry.arity == 1 else [x, np.linspace(1.9, -1.7, len(x))]  # max/min: a != b
    arguments = ", ".join(["X", "Z"][: entry.arity])
    params = ", ".join(f"{p}: f64[i]" for p in ["X", "Z"][: entry.arity])
    kernel = napkin.load(f"kernel k({params}) -> Y: f64[i]:\n    Y[i] = {name}({arguments})\n")["k"]
    backward = kernel.grad()
    given = dict(zip(["X", "Z"], args, strict=False)) | {"dY": np.ones_like(x)}
    got = backward(**{p: v for p, v in given.items() if p in backward.diagram.params})
    got = got if isinstance(got, dict) else {backward.diagram.outputs[0]: got}
    f = elementwise.float64(entry)
    derivative = elementwise.derivative(entry)(*args, f(*args))
    step = 1e-6
    for i, parameter in enumerate(["X", "Z"][: entry.arity]):
        plus = [a + step if j == i else a for j, a in enumerate(args)]
        minus = [a - step if j == i else a for j, a in enumerate(args)]
        finite = (f(*plus) - f(*minus)) / (2 * step)
        np.testing.assert_allclose(got[f"d{parameter}"], finite, rtol=1e-6, atol=1e-7, err_msg=f"{name}: d{parameter}")
        np.testing.assert_allclose(got[f"d{parameter}"], derivative[i], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("expression,derivative", [
    ("X * X - X / (X + 3)", lambda x: 2 * x - 3 / (x + 3) ** 2),
    ("X ^ 3", lambda x: 3 * x ** 2),
    ("-X + where(X > 0, X, 2 * X)", lambda x: np.where(x > 0, 0.0, 1.0)),
])
def test_operator_rules(expression, derivative):
    kernel = napkin.load(f"kernel k(X: f64[i]) -> Y: f64[i]:\n    Y[i] = {expression}\n")["k"]
    x = np.array([-1.5, -0.4, 0.7, 1.9])
    np.testing.assert_allclose(kernel.grad()(x, np.ones_like(x)), derivative(x), rtol=1e-12)


def test_max_reduction_routes_through_the_arg_max_and_mean_divides():
    text = ("kernel k(X: f64[r c]) -> (M: f64[r], A: f64[r]):\n"
            "    M[r] = max[c](X)\n    A[r] = mean[c](X)\n")
    backward = napkin.load(text)["k"].grad()
    # the backward takes its own max of X for the arg-max test, not the forward's saved M
    assert backward.diagram.params == ("X", "dM", "dA")
    X = np.array([[0.1, 2.0, -1.0], [3.0, 0.5, 0.2]])
    dX = backward(X, np.array([1.0, 10.0]), np.array([3.0, 6.0]))
    np.testing.assert_allclose(dX, [[1.0, 2.0, 1.0], [12.0, 2.0, 2.0]])


# ---- the text, its CLI and its errors ------------------------------------------------------------


def _grad_cli(path) -> str:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert cli.main(["grad", str(path)]) == 0
    return stdout.getvalue()


def test_napkin_grad_prints_a_kernel_that_checks_and_says_what_is_saved():
    text = _grad_cli(EXAMPLES / "attention.napkin")
    backward = napkin.load(text)["attention_grad"]
    assert backward.diagram.outputs == ("dQ", "dK", "dV")
    assert "# recomputed here: S, P" in text
    assert "softmax[x](S[b h q x])" in text  # no lse saved: P is recomputed with its softmax
    assert backward.relabel is not None and backward.relabel.hardware == "H100"
    report = backward.cost(b=1, h=2, q=64, x=64, d=64)  # whole rows per head: it fits at these sizes only
    assert report.to_dict()


def test_the_attention_backward_does_2_5_times_the_forward_tensor_flops():
    # FA convention: S is recomputed, and dP, dQ, dK, dV are four more contractions of q x d.
    (forward,) = napkin.load(EXAMPLES / "attention.napkin").values()

    def tensor(kernel):
        return sum(s.flops.get("tensor", 0) for s in kernel.diagram.statements).subs(SIZES)

    assert tensor(forward.grad()) == 2.5 * tensor(forward)


def test_with_an_lse_p_is_recomputed_from_the_saved_l():
    text = _grad_cli(EXAMPLES / "attention_lse.napkin")
    assert "# saved by the forward (read here): O, L" in text  # O for FA2's D, the default
    assert "P[b h q x] = exp(S[b h q x] - L[b h q])" in text
    pseudocode = napkin.load(text)["attention_lse_grad"].pseudocode(b=1, h=2, q=256, x=256, d=64)
    assert "load L[b h q] gmem" in pseudocode
    assert "P[b h q x] = exp((S[b h q x] - L[b h q]))" in pseudocode
    assert "softmax" not in pseudocode


def test_fa2_d_rewrite_reads_the_saved_output_and_gives_the_same_gradients():
    (kernel,) = napkin.load((EXAMPLES / "attention.napkin").read_text().replace("bf16", "f64")).values()
    rewritten = kernel.grad(rewrite_d=True)
    assert "D[b h q] = sum[d](dO[b h q d] * O[b h q d])" in rewritten.source
    rng = np.random.default_rng(3)
    Q, K, V, dO = (rng.standard_normal((1, 2, 5, 4)) for _ in range(4))
    O = kernel(Q, K, V)
    plain = kernel.grad(rewrite_d=False)(Q, K, V, dO)
    other = rewritten(Q, K, V, O, dO)
    for name in ("dQ", "dK", "dV"):
        np.testing.assert_allclose(other[name], plain[name], rtol=1e-10, atol=1e-12)


def test_an_opaque_box_without_a_backward_is_a_napkin_error():
    (kernel,) = napkin.load(EXAMPLES / "paper" / "fig11.napkin").values() if (EXAMPLES / "paper" / "fig11.napkin").exists() \
        else napkin.load("box F(f32[x], f32[w]) -> f32[y]\nkernel k(X: f32[a x], W: f32[w]) -> Y: f32[a y]:\n"
                         "    Y[a y] = F(X, W)\n").values()
    with pytest.raises(NapkinError, match=r"opaque box F has no declared backward"):
        kernel.grad()


def test_a_scalar_that_requires_grad_is_not_differentiated_silently():
    kernel = _kernel("rmsnorm", "f32")
    X, G = torch.randn(6, 4, requires_grad=True), torch.randn(4)
    with pytest.raises(NotImplementedError, match="scalar eps requires grad"):
        kernel(X, G, torch.tensor(1e-6, requires_grad=True))


# ---- phase B: FA2's schedule, the priced choices, PoCL ------------------------------------------

BIG = dict(b=4, h=32, q=8192, x=8192, d=128)


def test_attention_lse_backward_sums_dq_over_the_key_groups_in_the_key_launch():
    """FA2's five products: the key launch computes dQ too, each key group adding its part into an
    f32 sum in device memory, cast to bf16 by a launch of its own; nothing is recomputed twice."""
    (kernel,) = napkin.load(EXAMPLES / "attention_lse.napkin").values()
    backward = kernel.grad()  # the atomic sum is the default without sizes
    schedule = backward.derivation.schedule
    assert schedule.summed == {"dQ": "dQ_f32"} and schedule.renamed == {}
    assert "dQ_f32[b h q d] @gmem f32 = dS[b h q x] * K[b h x d] * len(d)^(-1/2)" in backward.source
    assert "dQ[b h q d] = dQ_f32[b h q d]" in backward.source and "S_1" not in backward.source
    assert "smem for dK, dV, dQ_f32: group b 1, h 1, x 128; stream q 64" in backward.source
    program = backward.program(**BIG)
    assert [[s.target for s in launch.launch.statements] for launch in program.launches] == [
        ["D"], ["S", "P", "dP", "dS", "dK", "dV", "dQ_f32"], ["dQ"]]
    products = [s for launch in program.launches for s in launch.launch.statements if isinstance(s.box, Contract)]
    assert len(products) == 5
    added = [step for step, _ in walk(program.launches[1].body) if step.add and step.op == "save"]
    assert {step.array for step in added} == {"dQ_f32"}
    assert [step.passes for step in added] == [1, ADDED_PASSES]  # into L2, then device memory's three passes


def test_attention_lse_backward_has_fa2s_launches_and_fits_at_8192():
    (kernel,) = napkin.load(EXAMPLES / "attention_lse.napkin").values()
    backward = kernel.grad(sum_dq=False)  # the rewrite is the default without sizes
    schedule = backward.derivation.schedule
    assert (schedule.keys, schedule.queries) == ("x", "q")
    assert schedule.statistics == ("D",) and schedule.key_outputs == ("dK", "dV") and schedule.query_outputs == ("dQ",)
    assert "D[b h q] @gmem f32 = sum[d](dO[b h q d] * O[b h q d])" in backward.source
    assert "smem for dK, dV: group b 1, h 1, x 128; stream q 64" in backward.source
    assert "smem for dQ: group b 1, h 1, q 128; stream x 64" in backward.source
    program = backward.program(**BIG)
    assert [[s.target for s in launch.launch.statements][-1] for launch in program.launches] == ["D", "dV", "dQ"]
    report = backward.cost(**BIG)  # raised a capacity error before: whole rows of one head on chip
    assert 0 < report.time["overlapped_s"] < 1.0
    # the one-launch FA2 (dQ beside dK and dV in key groups) is what relabel.py refuses
    one_launch = re.sub(r"relabel .*", "", backward.source, flags=re.S).replace(" @gmem f32 = sum", " @gmem f32 = sum") \
        .replace("dV[b h x d] @gmem =", "dV[b h x d] =")
    one_launch = re.sub(r"(D\[b h q\]) @gmem f32", r"\1", one_launch)
    with pytest.raises(NapkinError, match="cannot group-partition x"):
        napkin.load(one_launch + "\nrelabel attention_lse_grad on H100:\n    smem: group b 1, h 1, x 128; stream q 64\n")


def test_the_scheduled_backward_gives_torchs_gradients_in_float64():
    kernel = _kernel("attention_lse", "f64")
    backward = kernel.grad(rewrite_d=True)
    assert backward.derivation.schedule is not None
    generator = torch.Generator().manual_seed(5)
    inputs = _random_inputs(kernel, "f64", generator)
    out = kernel(**{n: v.detach() for n, v in inputs.items()})
    dO, dL = torch.randn(out["O"].shape, dtype=torch.float64), torch.randn(out["L"].shape, dtype=torch.float64)
    got = backward(**{n: v.detach() for n, v in inputs.items()}, O=out["O"], L=out["L"], dO=dO, dL=dL)
    expected = _attention_lse(*inputs.values())
    torch.autograd.backward([expected["O"], expected["L"]], [dO, dL])
    for name in "QKV":
        np.testing.assert_allclose(np.asarray(got[f"d{name}"]), inputs[name].grad.numpy(), rtol=1e-9, atol=1e-11)


def test_the_model_picks_fa2s_save_and_recompute_and_its_d():
    (kernel,) = napkin.load(EXAMPLES / "attention_lse.napkin").values()
    options = kernel.backward_options(**BIG)
    best = options[0]
    assert best.save == () and best.rewrite_d is True  # save O and L, recompute S and P, D from dO . O
    assert {(o.save, o.rewrite_d) for o in options} == {((), True), ((), False), (("P",), True), (("P",), False)}
    saved_p = next(o for o in options if o.save == ("P",) and o.rewrite_d)
    assert saved_p.forward_s > 0 and saved_p.seconds > best.seconds
    chosen = kernel.grad(**BIG)
    assert chosen.derivation.saved == ("O", "L") and chosen.derivation.recomputed == ("S", "P")
    assert kernel.grad(rewrite_d=False, **BIG).derivation.saved == ("L",)  # the override


def _torch_gradients(example, inputs, cotangents):
    forward, scalars = EXAMPLE_FORWARDS[example]
    reference = {n: torch.as_tensor(v, dtype=torch.float64).requires_grad_() for n, v in inputs.items()}
    out = forward(*reference.values(), **scalars)
    outs = tuple(out.values()) if isinstance(out, dict) else (out,)
    torch.autograd.backward(list(outs), [torch.as_tensor(c, dtype=torch.float64) for c in cotangents])
    return {n: v.grad.numpy() for n, v in reference.items()}


@pytest.mark.parametrize("example", ["attention_lse", "matmul", "softmax"])
def test_the_backward_runs_on_pocl(example):
    from napkin_dsl.backends import opencl

    if not opencl.opencl_available():
        pytest.skip("no OpenCL platform (PoCL)")
    kernel = _kernel(example, "f32")
    backward = kernel.grad()
    sizes = {"attention_lse": dict(b=1, h=2, q=37, x=29, d=16), "matmul": dict(m=33, k=20, n=17),
             "softmax": dict(r=9, c=23)}[example]
    rng = np.random.default_rng(11)
    inputs = {a.name: rng.standard_normal([sizes[x] for x in a.axes]).astype(np.float32) for a in kernel.diagram.input_arrays}
    out = kernel(**inputs)
    outputs = out if isinstance(out, dict) else {kernel.diagram.outputs[0]: out}
    cotangents = {o: rng.standard_normal(v.shape).astype(np.float32) for o, v in outputs.items()}
    call = {n: v for n, v in inputs.items() if n in backward.diagram.params}
    call.update({n: outputs[n] for n in backward.derivation.saved})
    call.update({backward.derivation.cotangents[o]: c for o, c in cotangents.items() if o in backward.derivation.cotangents})
    got = opencl.run(backward.program(**sizes), call, {})
    want = _torch_gradients(example, inputs, [cotangents[o] for o in kernel.diagram.outputs])
    for name, gradient in backward.derivation.gradients.items():
        error = np.abs(got[gradient].astype(np.float64) - want[name]).max() / np.abs(want[name]).max()
        assert error < 1e-4, f"{example} {gradient}: {error:.3g}"


@pytest.mark.parametrize("sum_dq", [True, False], ids=["dQ summed over key groups", "dQ in its own launch"])
@pytest.mark.parametrize("example", ["attention_lse", "causal_attention"])
@pytest.mark.parametrize("backend", ["numpy", "opencl"])
def test_fa2s_schedule_gives_torchs_gradients_at_ragged_sizes(example, sum_dq, backend):
    """Issue 47's done-when: both dQ choices of FA2's keyed schedule, on NumPy and PoCL, at sizes
    no tile divides (keys 128 + 22, query chunks 16 x 4 + 6), against float64 torch; causal
    attention's key launch skips the chunks before its keys (pseudocode._zero_mask)."""
    from napkin_dsl.backends import opencl

    if backend == "opencl" and not opencl.opencl_available():
        pytest.skip("no OpenCL platform (PoCL)")
    kernel = _kernel(example, "f32")
    backward = kernel.grad(sum_dq=sum_dq, key_stream=16, save_lse=example != "attention_lse")
    assert bool(backward.derivation.schedule.summed) == sum_dq
    sizes = dict(b=1, h=2, q=70, x=150, d=16)
    key_launch = backward.program(**sizes).launches[1]
    masked = any(loop.mask is not None for _, loops in walk(key_launch.body) for loop in loops)
    assert masked == (example == "causal_attention")
    rng = np.random.default_rng(5)
    inputs = {a.name: rng.standard_normal([sizes[x] for x in a.axes]).astype(np.float32) for a in kernel.diagram.input_arrays}
    forward = kernel.lse_forward() or kernel
    outputs = forward(**inputs)
    cotangents = {o: rng.standard_normal(outputs[o].shape).astype(np.float32) for o in kernel.diagram.outputs}
    call = {n: v for n, v in inputs.items() if n in backward.diagram.params}
    call.update({n: outputs[n] for n in backward.derivation.saved})
    call.update({backward.derivation.cotangents[o]: c for o, c in cotangents.items() if o in backward.derivation.cotangents})
    if backend == "numpy":
        got = backward(**call)
    else:
        got = opencl.run(backward.program(**sizes), call, {})
    want = _torch_gradients(example, inputs, [cotangents[o] for o in kernel.diagram.outputs])
    for name, gradient in backward.derivation.gradients.items():
        error = np.abs(got[gradient].astype(np.float64) - want[name]).max() / np.abs(want[name]).max()
        assert error < 1e-4, f"{example} {gradient}: {error:.3g}"


# ---- the forward that saves the lse (FA2's L for a kernel that returns none) -----------------


@pytest.mark.parametrize("example", ["attention", "causal_attention", "gqa", "softmax", "sliding_window"])
def test_the_lse_forward_returns_the_same_outputs_and_each_softmaxs_lse(example):
    (kernel,) = napkin.load(EXAMPLES / f"{example}.napkin").values()
    augmented = kernel.lse_forward()
    added = [o for o in augmented.diagram.outputs if o not in kernel.diagram.outputs]
    assert augmented.diagram.outputs[:len(kernel.diagram.outputs)] == kernel.diagram.outputs and len(added) == 1
    assert augmented.relabel_text() == kernel.relabel_text()
    sizes = {a: SIZES.get(a, 6) for a in kernel.diagram.axes}
    generator = np.random.default_rng(3)
    inputs = {a.name: generator.standard_normal([sizes[x] for x in a.axes]).astype(np.float32)
              for a in kernel.diagram.input_arrays}
    plain, both = kernel(**inputs, sizes=sizes, cast=True), augmented(**inputs, sizes=sizes, cast=True)
    np.testing.assert_array_equal(np.asarray(both[kernel.diagram.outputs[0]]), np.asarray(plain))
    # L is the log-sum-exp of the softmax's operand over its axis, from the float64 reference
    from napkin_dsl.reference import evaluate

    reference = evaluate(augmented.diagram, inputs, {}, sizes)
    limit = tolerance(augmented.program(**sizes))
    lse = np.asarray(both[added[0]], np.float64)
    assert np.abs(lse - reference[added[0]]).max() <= limit * np.abs(reference[added[0]]).max()


def test_a_kernel_whose_softmaxes_have_their_lse_has_no_lse_forward():
    (kernel,) = napkin.load(EXAMPLES / "attention_lse.napkin").values()
    assert kernel.lse_forward() is None
    with pytest.raises(NapkinError, match="no softmax without an lse"):
        kernel.grad(save_lse=True)


def test_the_model_derives_fa2s_backward_for_attention_without_an_lse_output():
    """The done-when of issue 24: napkin grad examples/attention.napkin at b4 h32 q=x=8192 d128
    on H100 saves O and L (the forward adds L), recomputes P from L, groups the keys and streams
    the queries; issue 47: the key launch sums dQ over the key groups (on H100 on wgmma, dQ
    computed transposed; on A100 on mma.sync, dQ staged onto a warp grid of its own), and a launch
    of its own casts it."""
    from napkin_dsl.isel import select_program

    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    options = kernel.backward_options(**BIG)
    best = options[0]
    assert best.save_lse and best.rewrite_d and best.save == ()
    without = min(o.seconds for o in options if not o.save_lse)
    assert best.seconds < without and best.forward_s > 0  # L's write is priced
    chosen = kernel.grad(**BIG)
    derived = chosen.derivation
    assert derived.auxiliary == ("L",) and derived.saved == ("O", "L") and derived.recomputed == ("S", "P")
    assert "P[b h q x] = exp(S[b h q x] - L[b h q])" in chosen.source
    schedule = derived.schedule
    assert (schedule.keys, schedule.queries) == ("x", "q")
    assert schedule.key_outputs == ("dK", "dV") and schedule.query_outputs == ("dQ",)
    assert schedule.summed == {"dQ": "dQ_f32"}
    assert select_program(chosen.gpu_program(None, **BIG)).paths == ("fma", "wgmma", "fma")
    summing = kernel.grad(hardware="A100", **BIG)
    assert summing.derivation.schedule.summed == {"dQ": "dQ_f32"}
    assert select_program(summing.gpu_program(None, **BIG), "sm_80").paths == ("fma", "mma.sync", "fma")
    # the CLI prints the same kernel
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cli.main(["grad", str(EXAMPLES / "attention.napkin"), "--set", *(f"{a}={n}" for a, n in BIG.items())])
    text, price = printed.getvalue()[:len(chosen.source)], printed.getvalue()[len(chosen.source):]
    assert text == chosen.source  # then the model's price of it, as comments (tests/test_grad_price.py)
    assert price.startswith("# priced on H100 at ") and all(line.startswith("#") for line in price.splitlines())


def test_training_through_attention_runs_the_lse_forward_and_matches_torch():
    kernel = _kernel("attention", "f64")
    sizes = dict(b=1, h=2, q=150, x=99, d=32)
    assert kernel.grad(**sizes).derivation.auxiliary == ("L",)  # the model's pick at this shape too
    generator = torch.Generator().manual_seed(7)
    Q, K, V = (torch.randn(1, 2, n, 32, dtype=torch.float64, generator=generator).requires_grad_() for n in (150, 99, 99))
    out = kernel(Q, K, V)
    assert out.shape == (1, 2, 150, 32)  # the caller's output alone: the added L stays saved
    W = torch.randn(out.shape, dtype=torch.float64, generator=generator)
    (out * W).sum().backward()
    reference = [t.detach().clone().requires_grad_() for t in (Q, K, V)]
    (_attention(*reference) * W).sum().backward()
    # the backward accumulates in f32 on chip (every napkin intermediate is f32)
    allowed = 4 * tolerance(kernel.grad(**sizes).program(**sizes))
    for got, want in zip((Q, K, V), reference, strict=True):
        error = (got.grad - want.grad).abs().max() / want.grad.abs().max()
        assert error <= allowed, float(error)


def test_a_mean_over_two_axes_divides_its_cotangent_by_their_product():
    """Found by tests/test_grad_fuzz.py: the backward wrote a mean's cotangent as dR / len(i) *
    len(j), which the notation reads as (dR / len(i)) * len(j); a size product is one operand."""
    kernel = napkin.load("kernel k(X: f64[i j], A: f64[]) -> R: f64[]:\n    R = mean[i j](max(A, X[i j]))\n")["k"]
    assert "/ (len(i) * len(j))" in kernel.grad().source
    X = torch.tensor([[0.3, -0.5, 0.9]], dtype=torch.float64, requires_grad=True)
    A = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    kernel(X, A).backward()
    X2, A2 = X.detach().clone().requires_grad_(), A.detach().clone().requires_grad_()
    torch.maximum(A2, X2).mean().backward()
    assert torch.allclose(X.grad, X2.grad) and torch.allclose(A.grad, A2.grad)
