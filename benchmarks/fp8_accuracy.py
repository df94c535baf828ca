"""The error of fp8 attention, per quantization scheme, against float64 attention.

FA3 (Shah et al. 2024, section 4.3) measures the RMSE of fp8 attention on inputs with outlier
features: 2.4e-2 for plain per-tensor fp8, 9.1e-3 with block quantization and a Hadamard
rotation of Q and K ("incoherent processing"). This script measures the same trade-off through
napkin's NumPy backend (or the OpenCL one, ``--backend opencl``), with every step written as a
napkin kernel: the quantization (a Hadamard rotation as a contraction with a matrix input, the
amax of each block, its scale amax / 448 and the saturating cast to e4m3) and the attention (dequantization maps, the fp8 products
accumulated in f32, the softmax). Only the random inputs and the Hadamard matrix are made here.

Inputs, as FA3's: every entry of Q, K and V is N(0, 1) + N(0, 10^2) * Bernoulli(0.001), i.e.
standard normal with 0.1% of the entries outliers of standard deviation 10. The reference is
float64 attention (napkin's reference evaluator) of the same unquantized inputs; RMSE is
sqrt(mean((O - O_ref)^2)) over every output entry.

Run: python benchmarks/fp8_accuracy.py [--heads 4] [--length 1024] [--dim 64] [--block 64] [--seed 0] [--backend opencl]
"""

from __future__ import annotations

import argparse
import functools
import math

import numpy as np

import napkin_dsl as napkin
from napkin_dsl.reference import reference

# Quantization, written in the diagram: amax, scale, saturating cast (fp8 conversion saturates).
QUANTIZE = """
kernel quantize_tensor(X: f32[b h n d]) -> (X8: fp8e4m3[b h n d], sX: f32[]):
    amax[] = max[b h n d](abs(X))
    sX[] = max(amax, 1e-30) / 448
    X8[b h n d] = X / sX

kernel quantize_blocks(X: f32[b h nb ni d]) -> (X8: fp8e4m3[b h nb ni d], sX: f32[b h nb]):
    amax[b h nb] = max[ni d](abs(X))
    sX[b h nb] = max(amax, 1e-30) / 448
    X8[b h nb ni d] = X / sX

kernel quantize_rotated(X: f32[b h nb ni d], Hd: f32[d e]) -> (X8: fp8e4m3[b h nb ni e], sX: f32[b h nb]):
    R[b h nb ni e] = X * Hd                      # the Hadamard rotation along d
    amax[b h nb] = max[ni e](abs(R))
    sX[b h nb] = max(amax, 1e-30) / 448
    X8[b h nb ni e] = R / sX

kernel quantize_heads(X: f32[b h n d]) -> (X8: fp8e4m3[b h n d], sX: f32[b h]):
    amax[b h] = max[n d](abs(X))
    sX[b h] = max(amax, 1e-30) / 448
    X8[b h n d] = X / sX

kernel quantize_rows(X: f32[b h n d]) -> (X8: fp8e4m3[b h n d], sX: f32[b h n]):
    amax[b h n] = max[d](abs(X))
    sX[b h n] = max(amax, 1e-30) / 448
    X8[b h n d] = X / sX
"""

# Attention on quantized operands: dequantization maps, fp8 products accumulated in f32.
ATTENTION = """
kernel attention_tensor(Q: fp8e4m3[b h q d], sQ: f32, K: fp8e4m3[b h x d], sK: f32, V: fp8e4m3[b h x d], sV: f32) -> O: f32[b h q d]:
    S[b h q x] = Q * K * d^-0.5
    P[b h q x] = softmax[x](S * sQ * sK)
    Vf[b h x d] = V * sV
    O[b h q d] = P * Vf

relabel attention_tensor on H100:
    smem: group b 1, h 1, q 128; stream x 64

# Per-block scales along x too: x is split as xb xi, so the softmax is written out over both.
kernel attention_blocks(Q: fp8e4m3[b h qb qi d], sQ: f32[b h qb], K: fp8e4m3[b h xb xi d], sK: f32[b h xb], V: fp8e4m3[b h xb xi d], sV: f32[b h xb]) -> O: f32[b h qb qi d]:
    Qf[b h qb qi d] = Q * sQ
    Kf[b h xb xi d] = K * sK
    Vf[b h xb xi d] = V * sV
    S[b h qb qi xb xi] = Qf * Kf * d^-0.5
    m[b h qb qi] = max[xb xi](S)
    E[b h qb qi xb xi] = exp(S - m)
    l[b h qb qi] = sum[xb xi](E)
    U[b h qb qi d] = E * Vf
    O[b h qb qi d] = U / l

relabel attention_blocks on H100:
    smem: group b 1, h 1, qb 1

kernel attention_bf16(Q: bf16[b h q d], K: bf16[b h x d], V: bf16[b h x d]) -> O: f32[b h q d]:
    S[b h q x] = Q * K * d^-0.5
    P[b h q x] = softmax[x](S)
    O[b h q d] = P * V

relabel attention_bf16 on H100:
    smem: group b 1, h 1, q 128; stream x 64

kernel attention_f64(Q: f64[b h q d], K: f64[b h x d], V: f64[b h x d]) -> O: f64[b h q d]:
    S[b h q x] = Q * K * d^-0.5
    P[b h q x] = softmax[x](S)
    O[b h q d] = P * V
"""

SCHEMES = ("bf16 (no quantization)", "fp8 per-tensor", "fp8 Q per block, K per key, V per head (examples/fp8_attention.napkin)",
           "fp8 per-block", "fp8 per-block + Hadamard")


def outlier_inputs(rng, shape) -> np.ndarray:
    """N(0, 1) + N(0, 10^2) * Bernoulli(0.001), float32."""
    values = rng.standard_normal(shape) + 10.0 * rng.standard_normal(shape) * (rng.random(shape) < 0.001)
    return values.astype(np.float32)


def hadamard(d: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix of order d (a power of two): H H^T = I."""
    if d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head dimension, not {d}")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(d)).astype(np.float32)


def rmse(got, want) -> float:
    return float(np.sqrt(np.mean((np.asarray(got, np.float64) - np.asarray(want, np.float64)) ** 2)))


def measure(seed: int = 0, heads: int = 4, length: int = 1024, dim: int = 64, block: int = 64,
            backend: str = "numpy") -> dict[str, float]:
    """The RMSE of each scheme's output against float64 attention, on one batch of outlier inputs,
    every kernel (quantization, rotation and attention) run on ``backend`` (numpy or opencl)."""
    if length % block:
        raise ValueError(f"the length {length} is not a multiple of the block {block}")
    rng = np.random.default_rng(seed)
    shape = (1, heads, length, dim)
    Q, K, V = (outlier_inputs(rng, shape) for _ in range(3))
    quant = _on(napkin.load(QUANTIZE), backend)
    kernels = napkin.load(ATTENTION)
    att = _on(kernels, backend)
    want = reference(kernels["attention_f64"], Q.astype(np.float64), K.astype(np.float64), V.astype(np.float64))
    blocked = (1, heads, length // block, block, dim)
    results = {}

    results[SCHEMES[0]] = rmse(att["attention_bf16"](Q, K, V, cast=True), want)

    tensor = [quant["quantize_tensor"](X) for X in (Q, K, V)]
    (q8, sq), (k8, sk), (v8, sv) = ((t["X8"], float(t["sX"])) for t in tensor)
    results[SCHEMES[1]] = rmse(att["attention_tensor"](q8, sq, k8, sk, v8, sv), want)

    # the example's Q is per block of queries, K per key, V per head (FA3's descale of O)
    qr, kr, vh = quant["quantize_blocks"](Q.reshape(blocked)), quant["quantize_rows"](K), quant["quantize_heads"](V)
    example = _on(napkin.load(_example("fp8_attention.napkin")), backend)["fp8_attention"]
    out = example(qr["X8"], qr["sX"], kr["X8"], kr["sX"], vh["X8"], vh["sX"])
    results[SCHEMES[2]] = rmse(np.asarray(out, np.float64).reshape(shape), want)

    blocks = [quant["quantize_blocks"](X.reshape(blocked)) for X in (Q, K, V)]
    args = [a for b in blocks for a in (b["X8"], b["sX"])]
    results[SCHEMES[3]] = rmse(att["attention_blocks"](*args).reshape(shape), want)

    Hd = hadamard(dim)
    rotated = [quant["quantize_rotated"](X.reshape(blocked), Hd) for X in (Q, K)]  # Q H (K H)^T = Q K^T
    args = [a for b in (*rotated, blocks[2]) for a in (b["X8"], b["sX"])]
    results[SCHEMES[4]] = rmse(att["attention_blocks"](*args).reshape(shape), want)
    return results


def _on(kernels: dict, backend: str) -> dict:
    """Each kernel as a function that runs it on ``backend``."""
    return {name: functools.partial(kernel, backend=backend) for name, kernel in kernels.items()}


def _example(name: str):
    from pathlib import Path

    return Path(__file__).resolve().parent.parent / "examples" / name


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024, help="q = x")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=64, help="rows per scale block")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="numpy", choices=("numpy", "opencl"),
                        help="where every kernel runs (opencl: the OpenCL device, PoCL on a CPU)")
    args = parser.parse_args(argv)
    results = measure(args.seed, args.heads, args.length, args.dim, args.block, args.backend)
    print(f"fp8 (e4m3) attention RMSE against float64, b=1 h={args.heads} q=x={args.length} d={args.dim}, "
          f"blocks of {args.block} rows, seed {args.seed}")
    print(f"inputs: N(0,1) + N(0,10^2) * Bernoulli(0.001) in every entry of Q, K, V; the {args.backend} backend")
    width = max(len(s) for s in SCHEMES)
    print(f"| {'scheme':<{width}} | RMSE     |")
    print(f"|{'-' * (width + 2)}|----------|")
    for scheme, value in results.items():
        print(f"| {scheme:<{width}} | {value:.2e} |")


if __name__ == "__main__":
    main()
