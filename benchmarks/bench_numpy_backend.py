"""The NumPy backend against a plain float32 einsum attention, in the same run.

    python benchmarks/bench_numpy_backend.py [--repeat 5] [--group 128] [--stream 128] [--hardware H100]
                                             [--blas-threads 1]

Attention with b=1, h=4, q=x=1024, d=64 in f32. The backend executes the Program's loops
(one query group of ``--group`` rows after another, keys and values streamed in chunks of
``--stream`` through the online softmax); the reference is softmax(Q K^T / sqrt d) V with
``numpy.einsum`` on whole arrays in float32. Both take the best of ``--repeat`` runs. The
goal is a ratio of at most 3.

BLAS threads default to 1 (``--blas-threads``, set before NumPy is imported): the backend's
tile-sized products gain nothing from threads, and on a shared or busy machine a threaded
BLAS makes both timings erratic (we saw the ratio swing from 0.7x to 3x between runs).
``--blas-threads 0`` leaves the BLAS default.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _blas_threads(argv: list[str]) -> str:
    """The --blas-threads value, read before NumPy (and its BLAS) is imported."""
    for index, arg in enumerate(argv):
        if arg.startswith("--blas-threads="):
            return arg.split("=", 1)[1]
        if arg == "--blas-threads" and index + 1 < len(argv):
            return argv[index + 1]
    return "1"


if __name__ == "__main__" and _blas_threads(sys.argv[1:]) != "0":
    for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = _blas_threads(sys.argv[1:])

import numpy as np

import napkin_dsl as napkin
from napkin_dsl.backends.numpy import execute

SIZES = {"b": 1, "h": 4, "q": 1024, "x": 1024, "d": 64}

KERNEL = """
kernel attention(Q: f32[b h q d], K: f32[b h x d], V: f32[b h x d]) -> O: f32[b h q d]:
    S[b h q x] = Q * K * d^-0.5
    P[b h q x] = softmax[x](S)
    O[b h q d] = P * V

relabel attention on {hardware}:
    {level}: group b 1, h 1, q {group}; stream x {stream}
"""


def einsum_attention(q, k, v):
    """The float32 reference: whole arrays, one einsum per product."""
    s = np.einsum("bhqd,bhxd->bhqx", q, k, optimize=True) * np.float32(q.shape[-1] ** -0.5)
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return np.einsum("bhqx,bhxd->bhqd", s, v, optimize=True)


def best_of(repeat: int, function) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - started)
    return min(times), result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--group", type=int, default=128, help="query group size")
    parser.add_argument("--stream", type=int, default=128, help="key/value chunk size")
    parser.add_argument("--hardware", default="H100", help="H100 (with its derived L2 level) or two_level")
    parser.add_argument("--blas-threads", default="1", help="BLAS threads (0: the BLAS default)")
    args = parser.parse_args(argv)

    level = "l1" if args.hardware == "two_level" else "smem"
    text = KERNEL.format(hardware=args.hardware, level=level, group=args.group, stream=args.stream)
    (kernel,) = napkin.load(text).values()
    program = kernel.program(**SIZES)
    rng = np.random.default_rng(0)
    shape = {"Q": ("b", "h", "q", "d"), "K": ("b", "h", "x", "d"), "V": ("b", "h", "x", "d")}
    arrays = {name: rng.standard_normal([SIZES[a] for a in axes]).astype(np.float32) for name, axes in shape.items()}

    backend_s, (outputs, counts) = best_of(args.repeat, lambda: execute(program, arrays, {}))
    reference_s, expected = best_of(args.repeat, lambda: einsum_attention(arrays["Q"], arrays["K"], arrays["V"]))
    error = float(np.max(np.abs(outputs["O"] - expected)) / np.max(np.abs(expected)))
    ratio = backend_s / reference_s

    sizes = " ".join(f"{k}={v}" for k, v in SIZES.items())
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    print(f"attention f32 {sizes}; {args.hardware}: group q {args.group}, stream x {args.stream}; "
          f"best of {args.repeat}; BLAS threads {threads}")
    rows = [("", "time", "ratio"),
            ("numpy backend (Program loops)", f"{backend_s * 1e3:.1f} ms", f"{ratio:.2f}x"),
            ("einsum reference (f32, whole arrays)", f"{reference_s * 1e3:.1f} ms", "1.00x")]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)))
    print(f"  steps executed {counts.steps:,}; max rel error vs einsum {error:.2e}; goal ratio <= 3")
    return 0 if ratio <= 3 and error < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
