"""Stream loops that skip the chunks adding zero (pseudocode._zero_mask): the backward of causal
attention streams the queries in a launch grouped over the keys, where dS = where(q >= x, ..., 0)
and P = where(L > -inf, exp(where(q >= x, S, -inf) - L), 0) vanish on every chunk of queries
before the group's keys. Those chunks add nothing to dK, dV or dQ's adds, and are never visited:
the model, the NumPy backend and the kernels skip the same chunks.
"""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import opencl
from napkin_dsl.backends.numpy import execute, random_arguments
from napkin_dsl.cost import cost_of
from napkin_dsl.pseudocode import walk
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES, assert_matches_reference
from .test_numpy_backend import assert_counts_equal_report

LONG = dict(b=4, h=32, q=8192, x=8192, d=128)


def _load(text: str) -> napkin.Kernel:
    (kernel,) = napkin.load(text).values()
    return kernel


def _forward(name: str, dtype: str = "bf16") -> napkin.Kernel:
    return _load((EXAMPLES / f"{name}.napkin").read_text().replace("bf16", dtype))


def _masks(program, index: int = 1) -> list:
    loops = {id(lp): lp for _, nest in walk(program.launches[index].body) for lp in nest}
    return [lp.mask for lp in loops.values() if lp.mask is not None]


def _consistent_inputs(forward, backward, sizes: dict, seed: int = 0) -> dict:
    """O and L from the forward with L on the same Q, K and V (random ones overflow exp(S - L))."""
    rng = np.random.default_rng(seed)
    Q, K, V = (rng.standard_normal((sizes["b"], sizes["h"], sizes[a], sizes["d"])).astype(np.float32) for a in "qxx")
    out = evaluate(forward.lse_forward().diagram, dict(Q=Q, K=K, V=V), {}, sizes)
    inputs = dict(Q=Q, K=K, V=V, O=out["O"].astype(np.float32), L=out["L"].astype(np.float32),
                  dO=rng.standard_normal(Q.shape).astype(np.float32))
    return {name: inputs[name] for name in backward.diagram.params}


def test_the_causal_key_launch_skips_the_query_chunks_before_its_keys():
    forward = _forward("causal_attention")
    backward = forward.grad(save_lse=True, key_stream=16)
    program = backward.program("H100", **LONG)
    (mask,) = _masks(program)
    assert (mask.axis, mask.condition, mask.tested) == ("q", "(q >= x)", None) and mask.bounds_below
    assert "masked by (q >= x): visits only the chunks where" in backward.pseudocode(hardware="H100", **LONG)
    # about half the tensor work of the same backward without the mask
    plain = _forward("attention").grad(save_lse=True, key_stream=16)
    causal, full = (k.cost("H100", **LONG).flops["tensor"] for k in (backward, plain))
    assert 0.5 <= float(causal) / float(full) < 0.51


def test_the_test_in_every_chunk_costs_registers_the_budget_counts():
    """With 32-query chunks the causal key launch's 160 fragment registers and its test spill on
    sm_90 (paths.plan.ZERO_MASK_REGISTERS): refused by name; 16-query chunks run on mma.sync."""
    from napkin_dsl.isel import select_program

    forward = _forward("causal_attention")
    wide = select_program(forward.grad(save_lse=True, key_stream=32).gpu_program(None, **LONG), "sm_90")[1]
    assert wide.path == "fma" and "168 fragment registers" in wide.reason, wide.reason
    narrow = select_program(forward.grad(save_lse=True, key_stream=16).gpu_program(None, **LONG), "sm_90")[1]
    assert narrow.path == "mma.sync"
    assert forward.grad(hardware="A100", **LONG).derivation.schedule.key_stream == 16  # the model's pick on mma.sync


@pytest.mark.parametrize("example, sizes", [
    ("causal_attention", dict(b=1, h=2, q=70, x=150, d=16)),
    ("causal_attention", dict(b=1, h=1, q=150, x=70, d=16)),
    ("sliding_window", dict(b=1, h=1, q=300, x=300, d=16)),
])
def test_numpy_skips_the_same_chunks_the_model_prices_and_matches_the_reference(example, sizes):
    forward = _forward(example, "f32")
    backward = forward.grad(save_lse=True, key_stream=16)
    program = backward.program("H100", **sizes)
    assert _masks(program)
    inputs = _consistent_inputs(forward, backward, sizes)
    outputs, counts = execute(program, inputs, {})
    assert_matches_reference(program, outputs, evaluate(backward.diagram, inputs, {}, sizes), example)
    assert_counts_equal_report(counts, cost_of(program, check=False))


def test_the_fma_kernels_skip_the_chunks_on_pocl(opencl_device):
    forward = _forward("causal_attention", "f32")
    backward = forward.grad(save_lse=True, key_stream=16)
    sizes = dict(b=1, h=1, q=70, x=150, d=16)
    program = backward.gpu_program(None, **sizes)
    assert _masks(program)
    inputs = _consistent_inputs(forward, backward, sizes, seed=1)
    outputs = opencl.run(program, inputs, {})
    assert_matches_reference(program, outputs, evaluate(backward.diagram, inputs, {}, sizes), "causal, FMA")


SELECTED = """kernel k(Q: f32[q d], K: f32[x d]) -> Y: f32[x d]:
    S[q x] = K[x d] * Q[q d]
    T[q x] = {T}
    Y[x d] = T[q x] * Q[q d]

relabel k on H100:
    smem: group x 32; stream q 16
"""


@pytest.mark.parametrize("t, skips", [
    ("where(q >= x, S[q x], 0)", True),
    ("exp(where(q >= x, S[q x], -inf))", True),
    ("exp(where(q >= x, S[q x], -inf) * 2 - 1)", True),
    ("where(q >= x, S[q x], 1)", False),  # a hidden chunk adds Q's rows to Y
    ("exp(where(q >= x, S[q x], -inf) - where(q >= x, S[q x], -inf))", False),  # -inf - -inf is NaN, not 0
    ("where(q >= x, S[q x], 0) + 1", False),
])
def test_a_chunk_is_skipped_only_where_it_adds_zero(t, skips):
    _assert_skips_and_runs(SELECTED.format(T=t), skips, scale=0.1)  # exp of the products stays finite


def _assert_skips_and_runs(text: str, skips: bool, scale: float = 1.0):
    """Whether the stream of ``text``'s kernel skips chunks, and its NumPy run against the
    reference with the model's counts, on inputs scaled by ``scale``."""
    kernel = _load(text)
    sizes = dict(q=70, x=50, d=8)
    program = kernel.program("H100", **sizes)
    assert bool(_masks(program, 0)) == skips
    arrays, scalars = random_arguments(kernel.diagram, sizes, 0)
    arrays = {name: value * scale for name, value in arrays.items()}
    outputs, counts = execute(program, arrays, scalars)
    want = evaluate(kernel.diagram, arrays, scalars, sizes, keep_float64=True)["Y"]
    np.testing.assert_allclose(outputs["Y"].astype(np.float64), want, rtol=1e-4, atol=1e-4)
    assert_counts_equal_report(counts, cost_of(program, check=False))


SUMMED = """kernel k(Q: f32[q d], K: f32[x d]) -> Y: f32[x]:
    S[q x] = K[x d] * Q[q d]
    T[q x] = where(q >= x, S[q x], 0)
    Y[x] = sum[q]({Y})

relabel k on H100:
    smem: group x 32; stream q 16
"""


@pytest.mark.parametrize("y, skips", [
    ("where(q >= x, S[q x], 0)", True),  # the sum's own operand masked
    ("T[q x] * 3", True),
    ("T[q x] + 1", False),  # a hidden chunk adds 1 a term: zero in T is not zero in the sum
])
def test_a_sum_over_the_stream_skips_a_chunk_only_where_its_terms_are_zero(y, skips):
    _assert_skips_and_runs(SUMMED.format(Y=y), skips)


def test_a_chunk_saved_plainly_is_not_skipped():
    """T itself an output, saved a chunk at a time: a hidden chunk's zeros must be written."""
    text = SELECTED.format(T="where(q >= x, S[q x], 0)").replace("-> Y: f32[x d]", "-> (Y: f32[x d], T: f32[q x])")
    program = _load(text).program("H100", q=70, x=50, d=8)
    assert not _masks(program, 0)
