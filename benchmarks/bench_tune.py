"""Benchmark: the tuner with fusion choices (issue 14).

Prints one table: `tune` on attention (examples/attention.napkin, b=4 h=32 q=x=8192 d=128) and
on a 4-statement MLP (SwiGLU, examples/swiglu.napkin, t=512 m=1024 f=2816 e=1024) on each GPU profile: candidates
scored, fusion choices searched (sets of intermediates materialised at device memory), seconds,
the best predicted time beside the relabelling written in the file (as written; "does not fit"
when it exceeds a level), and what the best materialises. Each search is timed cold (a new
Kernel, nothing memoised) and must score at least 10,000 candidates in under 2 s.

    python benchmarks/bench_tune.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # napkin is the working tree: run without installing

import napkin_dsl as napkin
from napkin_dsl.errors import NapkinError

EXAMPLES = ROOT / "examples"


CASES = [
    ("attention", lambda: napkin.load(EXAMPLES / "attention.napkin")["attention"], dict(b=4, h=32, q=8192, x=8192, d=128)),
    ("swiglu (4-statement MLP)", lambda: napkin.load(EXAMPLES / "swiglu.napkin")["swiglu"], dict(t=512, m=1024, f=2816, e=1024)),
]
HARDWARE = ["A100", "H100", "H200"]
MIN_CANDIDATES, MAX_SECONDS = 10_000, 2.0


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4g} ms"


def main() -> int:
    rows = []
    failed = []
    for name, make, sizes in CASES:
        for hardware in HARDWARE:
            kernel = make()  # a new Kernel: nothing memoised from the previous search
            try:
                written = kernel.cost(hardware, **sizes).time["overlapped_s"] if kernel.relabel is not None else None
                written_text = _ms(written) if written is not None else "no relabel block"
            except NapkinError:
                written_text = "does not fit"
            start = time.perf_counter()
            result = kernel.tune(hardware, **sizes)
            seconds = time.perf_counter() - start
            best = result.best
            chosen = best.materialised if best.materialised is not None else result.written
            rows.append((name, hardware, f"{result.evaluated:,}", str(result.fusion_choices), f"{seconds:.2f} s",
                         _ms(best.time_s), written_text, ", ".join(sorted(chosen)) or "none", best.origin))
            if result.evaluated < MIN_CANDIDATES or seconds >= MAX_SECONDS:
                failed.append(f"{name} on {hardware}: {result.evaluated:,} candidates in {seconds:.2f} s")
    header = ("kernel", "hardware", "candidates", "fusion choices", "tune time", "best", "as written", "at gmem", "from")
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip())
    print(f"\ntarget: >= {MIN_CANDIDATES:,} candidates in < {MAX_SECONDS:g} s per search")
    if failed:
        print("MISSED: " + "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
