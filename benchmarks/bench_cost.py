"""Benchmark: the numeric cost model and the tuner (issue: relabelling, pseudocode, cost model).

Prints one table: numeric cost of examples/attention.napkin on H100 (cold, then warm: a new
binding each time so nothing is served from the Kernel's cache, only the grammar is warm),
and `tune` over at least 1,000 candidate configurations, with the H100 predictions for
matmul 8192^3 bf16 and attention b=4 h=32 q=x=8192 d=128 beside public measurements.

    python benchmarks/bench_cost.py
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import napkin_dsl as napkin

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def timed(fn, repeat=1):
    times = []
    result = None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, times


def main() -> None:
    attention = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    matmul = napkin.load(EXAMPLES / "matmul.napkin")["matmul"]
    sizes = dict(b=4, h=32, q=8192, x=8192, d=128)

    _, cold = timed(lambda: attention.cost("H100", **sizes))
    warm = []
    for q in range(8192 + 128, 8192 + 128 * 21, 128):  # new bindings: no cached Program
        _, t = timed(lambda q=q: attention.cost("H100", **{**sizes, "q": q}))
        warm += t
    tune_matmul, t_matmul = timed(lambda: matmul.tune("H100", m=8192, n=8192, k=8192))
    tune_attention, t_attention = timed(lambda: attention.tune("H100", **sizes))
    best_matmul = tune_matmul.best.report
    attention_report = attention.cost("H100", **sizes)

    rows = [
        ("cost attention H100, cold (first call)", f"{cold[0] * 1e3:.1f} ms", "-"),
        ("cost attention H100, warm (median of 20 bindings)", f"{statistics.median(warm) * 1e3:.1f} ms", "< 20 ms"),
        (f"tune matmul 8192^3 H100 ({tune_matmul.evaluated} configurations)", f"{t_matmul[0] * 1e3:.0f} ms", "< 2 s"),
        (f"tune attention H100 ({tune_attention.evaluated} configurations)", f"{t_attention[0] * 1e3:.0f} ms", "< 2 s"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measurement'.ljust(width)}  {'time':>10}  target")
    for name, value, target in rows:
        print(f"{name.ljust(width)}  {value:>10}  {target}")
    print()
    flops = float(best_matmul.total_flops)
    print(f"matmul 8192^3 bf16 on H100, tuned ({tune_matmul.best.relabel_line(tune_matmul.knobs)}):")
    print(f"  predicted {best_matmul.time['overlapped_s'] * 1e3:.3f} ms = {flops / best_matmul.time['overlapped_s'] / 1e12:.0f} TFLOP/s"
          f" ({best_matmul.time['bound']}-bound; HBM {best_matmul.time['transfer_s']['l2'] * 1e3:.3f} ms,"
          f" L2->SMEM {best_matmul.time['transfer_s']['smem'] * 1e3:.3f} ms, compute {best_matmul.time['compute_s'] * 1e3:.3f} ms)")
    print("  measured (public): cuBLAS bf16 GEMM ~740-800 TFLOP/s at 6144-8192")
    flops = float(attention_report.total_flops)
    t = attention_report.time
    print("attention b=4 h=32 q=x=8192 d=128 bf16 on H100 (group q 128, stream x 64):")
    print(f"  predicted {t['overlapped_s'] * 1e3:.3f} ms = {flops / t['overlapped_s'] / 1e12:.0f} TFLOP/s ({t['bound']}-bound;"
          f" HBM {t['transfer_s']['l2'] * 1e3:.3f} ms, L2->SMEM {t['transfer_s']['smem'] * 1e3:.3f} ms, compute {t['compute_s'] * 1e3:.3f} ms)")
    print("  measured (public): FlashAttention-2 ~370 TFLOP/s, FlashAttention-3 ~660 TFLOP/s (d=128, N=8k, non-causal)")


if __name__ == "__main__":
    main()
