"""Numerical stress of the streamed softmax, its log-sum-exp and masks (issue 25, item 4).

Unit-normal inputs never test what the online softmax is for: logits far apart between chunks
(a running max that must not forget a large earlier chunk: exp(100) overflows f32), chunks that
are entirely -inf inside a row (a chunk max of -inf must leave the running max alone), rows that
are entirely masked (O = 0, L = -inf), and huge magnitudes (1e4: exp of a logit overflows, only
the differences from the running max are small). Here the logits are built exactly: Q's first
columns are constants and K's carry a per-chunk offset, a per-key and a per-query small integer,
so S = Q K^T d^-0.5 is an integer matrix, exact in bf16, f16 and f32 operands and in f32
accumulation; V is random. Each case runs on the NumPy backend and on OpenCL (PoCL), on both
paths (bf16 and f16 on tensor cores, f32 on the FMA path), and is compared with the float64
reference (napkin_dsl/reference.py) within the Program's tolerance (numpy.tolerance), infinities
exactly where the reference has them.
"""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import isel
from napkin_dsl.backends.numpy import execute, tolerance
from napkin_dsl.reference import evaluate
from napkin_dsl.types import numpy_dtype

TEXT = """
kernel attn(Q: {dt}[h q d], K: {dt}[h x d], V: {dt}[h x d]) -> (O: {dt}[h q d], L: f32[h q]):
    S[h q x] = Q * K * d^-0.5
    P[h q x] = softmax[x]({operand})
    O[h q d] = P * V
    L[h q] = lse[x]({operand})

relabel attn on H100:
    smem: group h 1, q 32; stream x 16
"""
SIZES = dict(h=2, q=40, x=56, d=16)  # query groups of 32 (the last 8 rows), chunks of 16 keys (the last 8)
CHUNK = 16
ROOT_D = 4  # sqrt(d): Q's constant columns cancel the d^-0.5 factor

MASKS = {
    "none": "S",
    # chunks 1 and 2 of every row are all -inf, between visible chunks
    "inner chunks": "where(x < 16 or x >= 48, S, -inf)",
    # rows q < 20 see no key at all: O = 0 and L = -inf there
    "masked rows": "where(q >= x + 20, S, -inf)",
    "causal": "where(q >= x, S, -inf)",
}
# Per chunk of x (4 chunks), the offset added to every logit of the chunk: exact in bf16 and f16.
OFFSETS = {
    "falling by 100": [100, 0, -100, -200],  # a running max forgotten: exp(100) overflows f32
    "rising by 100": [-200, -100, 0, 100],
    "huge, alternating": [9984, -9984, 9984, -9984],  # +-1e4: exp(-19968) is 0, exp(9984) is inf
    "huge, close": [9984, 9920, 9984, 9856],  # 1e4 with differences of 64: weights of e^-64 survive
}
PATHS = {"bf16": "mma.sync", "f16": "mma.sync", "f32": "fma"}


def kernel_of(dtype: str, mask: str):
    (kernel,) = napkin.load(TEXT.format(dt=dtype, operand=MASKS[mask])).values()
    return kernel


def logits_inputs(diagram, offsets, seed=0):
    """Q, K, V whose scores S = Q K^T / sqrt(d) are the integers
    offsets[chunk of x] + small[x] + row[q] * key[x]: exact in every operand dtype."""
    h, q, x, d = (SIZES[a] for a in "hqxd")
    rng = np.random.default_rng(seed)
    chunk = np.repeat(np.asarray(offsets, dtype=np.float64), CHUNK)[:x]
    Q = np.zeros((h, q, d))
    K = np.zeros((h, x, d))
    Q[:, :, 0] = ROOT_D
    Q[:, :, 1] = ROOT_D
    Q[:, :, 2] = ROOT_D * rng.integers(-1, 2, size=(h, q))
    K[:, :, 0] = chunk
    K[:, :, 1] = rng.integers(-3, 4, size=(h, x))
    K[:, :, 2] = rng.integers(-2, 3, size=(h, x))
    V = rng.standard_normal((h, x, d))
    dtype = numpy_dtype(diagram.arrays["Q"].dtype)
    arrays = {"Q": Q.astype(dtype), "K": K.astype(dtype), "V": V.astype(dtype)}
    for name, values in (("Q", Q), ("K", K)):  # the construction is exact in the operand dtype
        assert np.array_equal(arrays[name].astype(np.float64), values), name
    return arrays


def assert_close(program, outputs, expected, context):
    """Infinities and NaNs exactly where the reference has them (none of NaN); elsewhere
    max |error| / max |reference| per output within the Program's tolerance."""
    limit = tolerance(program)
    for name in program.diagram.outputs:
        got = np.asarray(outputs[name]).astype(np.float64)
        want = np.asarray(expected[name]).astype(np.float64)
        assert not np.isnan(want).any(), f"{context}: the reference of {name} has NaN"
        finite = np.isfinite(want)
        assert np.array_equal(np.isfinite(got), finite), f"{context}: {name} is not finite where the reference is, or is where it is not"
        assert np.array_equal(got[~finite], want[~finite]), f"{context}: {name}'s infinities differ from the reference's"
        if finite.any():
            scale = float(np.max(np.abs(want[finite]))) or 1.0
            error = float(np.max(np.abs(got[finite] - want[finite]))) / scale
            assert error <= limit, f"{context}: {name} off by {error:.3g} (tolerance {limit:.3g})"


def reference(kernel, arrays):
    return evaluate(kernel.diagram, arrays, {}, SIZES, keep_float64=True)


def check_reference_shape(mask, expected):
    """What each mask must do, checked on the reference: masked rows are 0 and -inf there."""
    if mask == "masked rows":
        assert np.all(expected["L"][:, :20] == -np.inf) and np.all(expected["O"][:, :20] == 0)
        assert np.isfinite(expected["L"][:, 20:]).all()
    else:
        assert np.isfinite(expected["L"]).all()


CASES = [(mask, offsets) for mask in MASKS for offsets in OFFSETS]


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("mask, offsets", CASES, ids=[f"{m}-{o}" for m, o in CASES])
def test_streamed_softmax_under_stress_on_numpy(mask, offsets, dtype):
    kernel = kernel_of(dtype, mask)
    program = kernel.program("H100", **SIZES)
    arrays = logits_inputs(kernel.diagram, OFFSETS[offsets])
    expected = reference(kernel, arrays)
    check_reference_shape(mask, expected)
    outputs, _ = execute(program, arrays, {})
    assert_close(program, outputs, expected, f"numpy {dtype} {mask} {offsets}")


# OpenCL: every mask at the offsets that break a running max, on both paths; the rest on one.
OPENCL_CASES = ([(mask, "falling by 100", dt) for mask in MASKS for dt in ("bf16", "f32")]
                + [("inner chunks", "huge, alternating", "f32"), ("masked rows", "huge, alternating", "bf16"),
                   ("causal", "huge, close", "f16")])


@pytest.mark.parametrize("mask, offsets, dtype", OPENCL_CASES, ids=[f"{m}-{o}-{d}" for m, o, d in OPENCL_CASES])
def test_streamed_softmax_under_stress_on_opencl(mask, offsets, dtype, opencl_device):
    from napkin_dsl.backends import opencl

    kernel = kernel_of(dtype, mask)
    program = kernel.gpu_program(None, **SIZES)
    assert [isel.selection(program, launch).path for launch in program.launches] == [PATHS[dtype]]
    arrays = logits_inputs(kernel.diagram, OFFSETS[offsets])
    expected = reference(kernel, arrays)
    outputs = opencl.run(program, arrays, {})
    assert_close(program, outputs, expected, f"opencl {dtype} {mask} {offsets}")


def test_the_logits_are_as_constructed():
    """The inputs give the scores the cases name: chunk offsets far apart, small differences within."""
    kernel = kernel_of("bf16", "none")
    arrays = logits_inputs(kernel.diagram, OFFSETS["falling by 100"])
    S = np.einsum("hqd,hxd->hqx", arrays["Q"].astype(np.float64), arrays["K"].astype(np.float64)) / ROOT_D
    assert np.array_equal(S, np.rint(S))
    per_chunk = [S[..., c * CHUNK:(c + 1) * CHUNK] for c in range(4)]
    assert [int(round(float(np.median(c)), -2)) for c in per_chunk] == [100, 0, -100, -200]
    assert max(float(np.ptp(c)) for c in per_chunk) <= 2 * (3 + 2)
