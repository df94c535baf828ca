#!/usr/bin/env python3
"""The one script to run on a machine with an NVIDIA GPU: every runnable example, checked and timed.

    python scripts/gpu_check.py --sweep --sanitizer   # everything, in one command (at most ~9 minutes)
    python scripts/gpu_check.py                       # the table alone; a few minutes (at most 285 s)
    python scripts/gpu_check.py --sweep               # the table, then predicted vs measured over sizes
    python scripts/gpu_check.py --dry-run --sweep --sanitizer   # anywhere: compile for the profile's arch, no GPU needed
    python scripts/gpu_check.py --cases attention,matmul

For every example except those with opaque boxes (examples/paper/fig11, fig12), at realistic
sizes (:data:`CASES`; the headline ones are attention at b=4 h=32 q=x=8192 d=128 in bf16 and
matmul at m=n=k=8192, each with its example's relabel block), it

1. compiles the kernel with ``Kernel.compile`` for the napkin profile of the GPU (H200, H100 or
   A100, from the device name) and the profile's architecture where the GPU runs it (sm_90a on
   an H100 or H200, else the GPU's own: ``compile_arch``), and reads off the compiled
   kernel what needs no GPU: the instruction path of each launch (``napkin_dsl.isel.selection``:
   ``wgmma`` or ``mma.sync`` on tensor cores or ``fma``, with the reason for ``fma`` in the JSON), the bound
   the cost report names, and, when nvdisasm is installed (``backends/sass.py``), the static
   instructions per tensor-core instruction (HMMA) in each launch's hot loop;
2. runs it once through ``napkin_dsl.backends.cuda.run`` on seeded normal inputs (never zero);
3. checks it against the float64 NumPy reference (``napkin_dsl.reference.evaluate``) on a
   random subset of output rows: a few indices of axes that every statement is woven over
   (always the first and the last index, so the masked tail tiles are covered), every other
   axis whole. The inputs are sliced along those axes and the reference evaluated on the
   slices, which is exact because no statement reads across a woven axis. The error is
   max |GPU - reference| / max |reference| over the checked rows, against the tolerance
   ``napkin run`` uses for the narrowest dtype the Program rounds to
   (``napkin_dsl.backends.numpy.tolerance``: f32 1e-5, f16/bf16 1e-2);
4. times the kernel's launches alone with CUDA events (driver API) on device buffers
   allocated once: warm-up, then the median of at least 20 runs (fewer only when one run
   takes over a second, and the row says how many). A short spin kernel keeps the GPU busy
   while Python enqueues the runs, so launch latency between runs is not measured. The
   output of the timed runs must equal ``run``'s bit for bit (a race would show here);
5. times the PyTorch counterpart, when torch is importable, the same way on the same stream:
   ``scaled_dot_product_attention`` for attention (and for gqa with ``enable_gqa``),
   ``matmul`` (bf16 out, where napkin writes f32), ``gelu(addmm)`` for the mlp,
   ``softmax``, ``rms_norm``, and the unfused ``softmax(Q K^T) V`` for attention_unfused and
   fig9; "vs torch" is max |napkin - torch| / max |torch| over the whole output (information,
   not a pass criterion);
6. prints one table: launches, their path (``mma.sync+fma``: one per launch, in order),
   registers, shared memory, instr/HMMA ('-' without nvdisasm or without tensor-core
   instructions), the bound, predicted time (the cost report of the compiled Program on the
   GPU's profile, ``CompiledKernel.cost``), measured time, TFLOP/s (the report's FLOPs /
   measured), GB/s (the report's device-memory bytes / measured), torch's time and the ratio
   napkin / torch, the error and pass/fail. With ``$OUT`` set the table is also written to
   ``$OUT/gpu_check.json`` (after every row, so a run cut short leaves what it had).

Two rows are attention's derived backward (``Case.grad``: ``Kernel.grad`` at the case's sizes),
with dQ summed over the key groups by atomic adds and deterministic (dQ in a launch of its own): its inputs O and L come from the forward run on the GPU first
(``backward_inputs``), its gradients on the sampled heads are held to the tolerance as every
row's are, torch's SDPA backward is timed beside it, and the deterministic one's gradients after
the timed runs must equal ``run``'s bit for bit (the summed one's, within the tolerance).

``--sanitizer`` then runs NVIDIA's compute-sanitizer (``--tool memcheck``, then ``--tool
racecheck``; found on ``PATH``, under ``/usr/local/cuda*/bin`` or in the
nvidia-cuda-sanitizer-api wheel) on a child invocation of this script, one per tool, that runs
attention and matmul at small sizes with masked tail tiles (:data:`SMALL_SIZES`, still on the
tensor-core path) through ``cuda.run`` and checks every output row against the reference,
without timing or torch (``--small --cases attention,matmul`` is the same without the tool,
through the usual children). It prints one
pass/fail line per tool with the tail of the tool's output; ``$OUT/gpu_sanitizer.json`` and
``$OUT/sanitizer_<tool>.log`` keep the rest. Without compute-sanitizer it says so and fails
nothing. Held to ``--sanitizer-deadline`` seconds (default 60).

``--sweep`` then times attention (d=128, b=1, h * sequence = 32 * 8192, so every input is
64 MiB and the work grows with the sequence) at q = x = 512, 1k, 2k, 4k, 8k and 16k, and
matmul at 1024, 2048, 4096 and 8192 cubed, each point through the same child process, check
and timing as the table (a shorter timing budget, ``--sweep-timing-budget``), and prints
predicted vs measured time, their ratio (meas/pred) and torch's time; a point equal to a
row of the table reuses that row. Written to ``$OUT/gpu_sweep.json`` when ``$OUT`` is set.
Held to ``--sweep-deadline`` seconds (default 180).

Each example runs in a child process with a timeout, so one that crashes, hangs or leaves the
CUDA context broken (an illegal address is sticky) costs only its own row. The table is held
to ``--deadline`` seconds (default 285), the sanitizer and the sweep to their own deadlines
(so ``--sweep --sanitizer`` takes at most 285 + 60 + 180 s, under 9 minutes); examples left
when a deadline runs out are reported as skipped. The exit status is 1 when any row of the
table or the sweep failed its check, errored, timed out or was skipped, or a sanitizer tool
found errors or timed out; 2 when there is no GPU; 0 otherwise.

``--dry-run`` does everything that needs no GPU, on any machine: it loads and compiles every
example (and, with ``--sweep``, every sweep point; with ``--sanitizer``, the small cases) for
the profile's arch (``--arch``; sm_90a for H200) with the H200 profile (``--profile``), fills the path, bound and instr/HMMA
columns, validates the row sampling, and prints the tables with the measured columns empty.

Deliberately not here: tuning or choosing relabellings (the examples' relabel blocks, or the
tuner through ``Kernel.gpu_program``, decide), L2 flushing between timed runs (each
example's data is a few times the L2 or more), profiler counters, kernels with opaque boxes,
and any assertion about speed: the tables report, people judge.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # napkin is the working tree: run without installing

import numpy as np

EXAMPLES = ROOT / "examples"
SEED = 20240601
DEFAULT_PROFILE = "H200"
DEADLINE_S = 285.0  # the whole run, parent included; the brief allows five minutes
CASE_TIMEOUT_S = 110.0  # one example's child process, at most
TIMING_BUDGET_S = 20.0  # GPU time spent timing one kernel (napkin's; torch's gets a third of it)
MIN_RUNS = 20
MAX_RUNS = 200
FEWEST_RUNS = 5  # when 20 runs of a slow kernel would not fit the budget
REFERENCE_MEMORY_LIMIT = 16 << 30

# --sweep: attention at d = 128, b = 1 and h = SWEEP_HEAD_TOKENS / sequence (each input 64 MiB,
# FLOPs growing with the sequence), then matmul cubes.
SWEEP_SEQUENCES = (512, 1024, 2048, 4096, 8192, 16384)
SWEEP_HEAD_TOKENS = 32 * 8192
SWEEP_MATMUL = (1024, 2048, 4096, 8192)
# ... then relabellings of attention, matmul and mlp at one size each (labelled by relabel_tag):
# tiles, stream chunks and warp tiles the files do not use, predicted against measured.
SWEEP_RELABEL_SIZES = {"attention": {"b": 1, "h": 64, "q": 4096, "x": 4096, "d": 128},
                       "matmul": {"m": 4096, "k": 4096, "n": 4096},
                       "mlp": {"b": 8192, "k": 4096, "n": 4096}}
SWEEP_ATTENTION_RELABELLINGS = tuple(
    f"smem: group b 1, h 1, q {q}; stream x {x}" + (f";; registers: group q {w}" if w else "")
    for q, x, w in ((64, 16, None), (64, 32, None), (64, 64, None), (64, 128, None), (128, 16, None), (128, 32, None),
                    (128, 64, None), (128, 128, None), (64, 64, 32)))  # the last: 32-row warps, over budget: FMA
SWEEP_MATMUL_RELABELLINGS = tuple(
    f"smem: group m {m}, n {n}; stream k {k}" + (f";; registers: {w}" if w else "")
    for m, n, k, w in ((64, 64, 32, None), (64, 128, 32, None), (128, 64, 32, None), (128, 128, 64, None),
                       (128, 256, 32, None), (256, 128, 32, None), (64, 64, 64, None), (64, 256, 32, None),
                       (256, 64, 32, None), (128, 64, 64, None), (64, 128, 64, None),
                       (128, 128, 32, "group m 32, n 64"), (128, 128, 32, "group m 64, n 32"),
                       (128, 128, 32, "group m 128, n 32")))
SWEEP_MLP_RELABELLINGS = tuple(
    f"smem: group b {b}, n {n}; stream k {k}"
    for b, n, k in ((64, 128, 32), (128, 64, 32), (128, 128, 64), (128, 256, 32), (256, 128, 32), (64, 64, 32),
                    (128, 128, 16), (64, 256, 32), (256, 64, 32)))


def relabel_tag(relabel: str) -> str:
    """A sweep label's short form of a relabel block: 'q128 x~64 w32' (group q 128, stream x 64,
    warp tiles of 32 rows)."""
    parts = []
    for clause in relabel.split(";;"):
        level, _, body = clause.partition(":")
        kind = "group"
        for item in re.split(r"[;,]", body):
            words = item.split()
            if len(words) == 3:
                kind = words.pop(0)
            if len(words) == 2 and words[1] != "1":
                mark = "w" if level.strip() == "registers" else "~" if kind == "stream" else ""
                parts.append(f"{mark}{words[0]}{words[1]}")
    return " ".join(parts)


SWEEP_DEADLINE_S = 180.0
SWEEP_TIMING_BUDGET_S = 1.5  # per point; the medians need far less than this at these sizes

# --sanitizer (and --small): sizes with a masked tail tile on every partitioned axis that still
# take the tensor-core path (mma.sync needs 16-byte rows: the fastest axis a multiple of 8).
SMALL_SIZES = {
    "attention": {"b": 1, "h": 2, "q": 200, "x": 200, "d": 128},
    "matmul": {"m": 200, "k": 104, "n": 200},
    "matmul_sm90a_ragged": {"m": 200, "k": 72, "n": 136},  # wgmma's 64-row warpgroups and TMA boxes, all ragged
    "attention_sm90": {"b": 1, "h": 2, "q": 200, "x": 200, "d": 128},  # mma.sync, ragged q and x
}
# the Hopper kernels (the H200 profile's default, sm_90a): TMA, mbarriers, wgmma (matmul); wgmma
# with A from registers (attention); and attention's mma.sync build (sm_90)
SANITIZER_CASES = ("attention", "matmul", "matmul_sm90a_ragged", "attention_sm90")
SANITIZER_TOOLS = ("memcheck", "racecheck")
SANITIZER_DEADLINE_S = 60.0
SANITIZER_ERROR_EXIT = 86  # --error-exitcode: the tool found something
SANITIZER_WHEEL_BINARIES = ("cu13/bin/compute-sanitizer", "cu13/compute-sanitizer/compute-sanitizer",
                            "cuda_sanitizer_api/compute-sanitizer/compute-sanitizer")
SPIN_SOURCE = r"""
extern "C" __global__ void gpu_check_spin(unsigned long long nanoseconds) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < nanoseconds);
}
"""


@dataclass(frozen=True)
class Case:
    """One example at one binding: what to compile, run, sample for the reference, and compare with."""

    label: str
    path: str  # under examples/
    kernel: str
    sizes: dict
    sample: dict  # axis -> how many of its indices the NumPy reference checks
    baseline: str | None  # key of TORCH_BASELINES
    scalars: dict = field(default_factory=dict)
    relabel: str | None = None  # the relabel block's lines, in place of the file's (";;" between lines)
    arch: str | None = None  # compile for this arch instead of the profile's (sm_90: mma.sync), where the GPU runs it
    # sm_90a: wgmma launches on the synchronous ring, without the producer and consumer warpgroups
    # (the build the roles replaced: beside them, what warp specialization buys)
    synchronous: bool = False
    # sm_90a: the consumer warpgroups' schedule to build (cost.consumer_order: "pipelined" is
    # FlashAttention-3's intra-warpgroup order), None the default
    overlap: str | None = None
    # The kernel's derived backward instead (Kernel.grad's keyword arguments; the sizes are added,
    # so the model picks what they leave open): its inputs are as training gives them
    # (backward_inputs), and where it sums dQ by atomic adds the timed runs equal run()'s within
    # the tolerance, not bit for bit
    grad: dict | None = None


CASES: list[Case] = [
    # The headline cases: attention at b=4 h=32 q=x=8192 d=128 (bf16) and matmul at 8192 cubed,
    # both with their example's relabel block, compiled for the profile's arch (H100, H200: sm_90a,
    # wgmma where isel takes it).
    Case("attention", "attention.napkin", "attention", {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128},
         {"b": 2, "q": 32}, "sdpa"),
    # h = kv r = 16 query heads sharing 4 key/value heads
    Case("gqa", "gqa.napkin", "gqa", {"b": 4, "kv": 4, "r": 4, "q": 4096, "x": 4096, "d": 128},
         {"b": 2, "q": 32}, "sdpa_gqa"),
    Case("matmul", "matmul.napkin", "matmul", {"m": 8192, "k": 8192, "n": 8192}, {"m": 64}, "matmul"),
    # The Hopper path: wgmma by descriptor, TMA into an mbarrier ring (sm_90a), at a ragged size.
    Case("matmul_sm90a_ragged", "matmul.napkin", "matmul", {"m": 200, "k": 72, "n": 136}, {"m": 200}, "matmul",
         arch="sm_90a"),
    # The mma.sync builds (sm_90) of the headline cases, beside the default's wgmma
    Case("matmul_sm90", "matmul.napkin", "matmul", {"m": 8192, "k": 8192, "n": 8192}, {"m": 64}, "matmul", arch="sm_90"),
    # The synchronous ring the roles (a producer warpgroup, consumers, full and empty mbarriers) replaced
    Case("matmul_synchronous", "matmul.napkin", "matmul", {"m": 8192, "k": 8192, "n": 8192}, {"m": 64}, "matmul",
         synchronous=True),
    Case("attention_synchronous", "attention.napkin", "attention", {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128},
         {"b": 2, "q": 32}, "sdpa", synchronous=True),
    # FlashAttention-3's overlaps on the roles, beside the serial order (issue 48): the
    # intra-warpgroup pipeline, pingpong, and both (FA3's schedule)
    *(Case(f"attention_{schedule.replace('+', '_')}", "attention.napkin", "attention",
           {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128}, {"b": 2, "q": 32}, "sdpa", overlap=schedule)
      for schedule in ("pipelined", "pingpong", "pingpong+pipelined")),
    Case("attention_sm90", "attention.napkin", "attention", {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128},
         {"b": 2, "q": 32}, "sdpa", arch="sm_90"),
    Case("mlp", "mlp.napkin", "mlp", {"b": 8192, "k": 4096, "n": 4096}, {"b": 64}, "mlp"),
    # group r 16 keeps 16 whole f32 rows in shared memory: c = 2048 is 128 KiB of the 227
    Case("softmax", "softmax.napkin", "softmax_rows", {"r": 32768, "c": 2048}, {"r": 128}, "softmax"),
    Case("rmsnorm", "rmsnorm.napkin", "rmsnorm", {"t": 8192, "d": 4096}, {"t": 256}, "rmsnorm", {"eps": 1e-6}),
    # LLaMA-7B's gated MLP over 8k tokens: the dual GEMM with its gate, H at gmem (bf16), then W2.
    Case("swiglu", "swiglu.napkin", "swiglu", {"t": 8192, "m": 4096, "f": 11008, "e": 4096}, {"t": 64}, "swiglu"),
    # No relabel block: the tuner's. It never streams x here, so x = 1024 is about the largest that fits.
    Case("attention_unfused", "attention_unfused.napkin", "attention_unfused", {"q": 16384, "x": 1024, "d": 128},
         {"q": 128}, "unfused_attention"),
    Case("fig9", "paper/fig9.napkin", "fig9", {"q": 16384, "x": 1024, "d": 128}, {"q": 128}, "softmax_matmul"),
    # Masks read the q and x indices, so whole heads are checked (b and h only are sampled).
    Case("causal_attention", "causal_attention.napkin", "causal_attention", {"b": 4, "h": 16, "q": 2048, "x": 2048, "d": 128},
         {"b": 2, "h": 2}, "sdpa_causal"),
    Case("sliding_window", "sliding_window.napkin", "sliding_window", {"b": 4, "h": 16, "q": 2048, "x": 2048, "d": 128},
         {"b": 2, "h": 2}, "sdpa_window"),
    # Flash-decoding: one query per head, the keys split into parts whose states a combine launch merges
    # (two launches); the reference alone checks it (no torch baseline of this layout).
    Case("decode", "decode.napkin", "decode", {"b": 1, "kv": 8, "r": 4, "x": 32768, "d": 128}, {"kv": 2}, None),
    # Split-K (its parts launch on the FMA path for now) against torch.matmul.
    Case("splitk", "splitk.napkin", "splitk", {"m": 512, "k": 65536, "n": 512}, {"m": 64}, "matmul"),
    # Two outputs: O against torch's attention, and L (the log-sum-exp) against the reference only.
    Case("attention_lse", "attention_lse.napkin", "attention_lse", {"b": 4, "h": 16, "q": 2048, "x": 2048, "d": 128},
         {"b": 2, "q": 32}, "sdpa"),
    # fp8 (issue 23), against the reference only: matmul on mma.sync m16n8k32 (its B [k n] is not
    # K-major, which wgmma's 8-bit shape needs; ptxas converts to f16 on sm_90), attention on
    # wgmma's 8-bit shape for sm_90a (V copied K-major each chunk; the FMA path on sm_90 at d = 128).
    Case("fp8_matmul", "fp8_matmul.napkin", "fp8_matmul", {"m": 8192, "k": 8192, "n": 8192}, {"m": 64}, None),
    # the reference checks the whole output, at a size it computes in seconds
    Case("fp8_attention", "fp8_attention.napkin", "fp8_attention", {"b": 1, "h": 4, "qb": 8, "qi": 128, "x": 1024, "d": 128},
         {}, None),
    # V stored keys fastest: on sm_90a both products on wgmma's 8-bit shape (QGMMA), P exchanged
    # within quads into the ISA's key order
    Case("fp8_attention_vt", "fp8_attention_vt.napkin", "fp8_attention_vt", {"b": 1, "h": 4, "qb": 8, "qi": 128, "x": 1024, "d": 128},
         {}, None),
    # The derived backward of attention (issue 47): dQ summed over the key groups by atomic adds
    # (five products; on sm_90a the key launch on wgmma, dQ computed transposed), and the
    # deterministic choice (dQ in a launch of its own); the rest as the model picks it; O and L from the forward on the GPU, the gradients of 2 x 2 heads checked,
    # torch's SDPA backward timed beside them. The deterministic one's gradients must be the same
    # bits after the timed runs; the summed one's within the tolerance.
    Case("attention_backward", "attention.napkin", "attention", {"b": 4, "h": 32, "q": 4096, "x": 4096, "d": 128},
         {"b": 2, "h": 2}, "sdpa_backward", grad={"sum_dq": True}),
    Case("attention_backward_deterministic", "attention.napkin", "attention", {"b": 4, "h": 32, "q": 4096, "x": 4096, "d": 128},
         {"b": 2, "h": 2}, "sdpa_backward", grad={"sum_dq": False}),
]

COLUMNS = [
    # (header, key, alignment)
    ("kernel", "kernel", "<"),
    ("sizes", "sizes_text", "<"),
    ("launch", "launch_text", ">"),
    ("path", "path_text", "<"),
    ("regs", "registers_text", ">"),
    ("smem KiB", "smem_text", ">"),
    ("instr/HMMA", "sass_text", ">"),
    ("bound", "bound_text", "<"),
    ("predicted", "predicted_text", ">"),
    ("measured", "measured_text", ">"),
    ("runs", "runs_text", ">"),
    ("TFLOP/s", "tflops_text", ">"),
    ("GB/s", "gbps_text", ">"),
    ("torch", "torch_text", ">"),
    ("x torch", "ratio_text", ">"),
    ("max err", "error_text", ">"),
    ("vs torch", "torch_error_text", ">"),
    ("result", "status", "<"),
]

SWEEP_COLUMNS = [
    ("kernel", "kernel", "<"),
    ("sizes", "sizes_text", "<"),
    ("path", "path_text", "<"),
    ("bound", "bound_text", "<"),
    ("predicted", "predicted_text", ">"),
    ("measured", "measured_text", ">"),
    ("meas/pred", "over_predicted_text", ">"),
    ("runs", "runs_text", ">"),
    ("TFLOP/s", "tflops_text", ">"),
    ("torch", "torch_text", ">"),
    ("x torch", "ratio_text", ">"),
    ("max err", "error_text", ">"),
    ("result", "status", "<"),
]

FAILING = ("FAIL", "ERROR", "TIMEOUT", "SKIPPED")


# ---- rows ------------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table; every field is JSON-ready."""

    kernel: str
    sizes: dict
    status: str = "ERROR"  # pass | FAIL | ERROR | TIMEOUT | SKIPPED | compiled (dry run)
    error: str = ""
    notes: list = field(default_factory=list)
    device: str = ""
    arch: str = ""
    profile: str = ""
    launches: list = field(default_factory=list)  # CompiledKernel.launch_table()
    paths: list = field(default_factory=list)  # per launch: {"entry", "path" (mma.sync | fma), "reason" (why fma)}
    bound: str = ""  # the cost report's bound (time["bound"])
    instr_per_tensor: list = field(default_factory=list)  # per launch: hot-loop instructions per HMMA, or None
    sass: str = ""  # why instr_per_tensor is empty ("" when nvdisasm ran)
    flops: float | None = None
    dram_bytes: float | None = None
    predicted_s: float | None = None
    measured_s: float | None = None
    runs: int | None = None
    torch_baseline: str = ""
    torch_s: float | None = None
    max_error: float | None = None  # max |GPU - reference| / max |reference| on the checked rows
    tolerance: float | None = None
    checked: dict = field(default_factory=dict)  # axis -> indices checked against the reference
    torch_error: float | None = None  # max |napkin - torch| / max |torch| over the whole output
    wall_s: float | None = None

    @property
    def tflops(self) -> float | None:
        return self.flops / self.measured_s / 1e12 if self.flops and self.measured_s else None

    @property
    def gbps(self) -> float | None:
        return self.dram_bytes / self.measured_s / 1e9 if self.dram_bytes and self.measured_s else None

    @property
    def ratio(self) -> float | None:
        return self.measured_s / self.torch_s if self.measured_s and self.torch_s else None

    @property
    def over_predicted(self) -> float | None:
        return self.measured_s / self.predicted_s if self.measured_s and self.predicted_s else None

    @property
    def path_text(self) -> str:
        return "+".join(p["path"] for p in self.paths)

    def to_json(self) -> dict:
        data = asdict(self)
        data.update(tflops=self.tflops, gbps=self.gbps, ratio_to_torch=self.ratio,
                    measured_over_predicted=self.over_predicted)
        return data

    @classmethod
    def from_json(cls, data: dict) -> Row:
        known = {name for name in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def cells(self) -> dict:
        def number(value, digits=3):
            return "" if value is None else f"{value:.{digits}g}"

        return {
            "kernel": self.kernel,
            "sizes_text": " ".join(f"{k}={v}" for k, v in self.sizes.items()),
            "launch_text": str(len(self.launches)) if self.launches else "",
            "path_text": self.path_text,
            "registers_text": "/".join(str(k.get("registers")) for k in self.launches),
            "smem_text": "/".join(f"{(k.get('shared_bytes') or 0) / 1024:.0f}" for k in self.launches),
            "sass_text": ("/".join("-" if v is None else f"{v:.2f}" for v in self.instr_per_tensor)
                          if self.instr_per_tensor else ("-" if self.launches else "")),
            "bound_text": self.bound,
            "predicted_text": format_seconds(self.predicted_s),
            "measured_text": format_seconds(self.measured_s),
            "runs_text": "" if self.runs is None else str(self.runs),
            "tflops_text": "" if self.tflops is None else f"{self.tflops:.1f}",
            "gbps_text": "" if self.gbps is None else f"{self.gbps:.0f}",
            "torch_text": format_seconds(self.torch_s),
            "ratio_text": "" if self.ratio is None else f"{self.ratio:.2f}",
            "over_predicted_text": "" if self.over_predicted is None else f"{self.over_predicted:.2f}",
            "error_text": number(self.max_error, 2),
            "torch_error_text": number(self.torch_error, 2),
            "status": self.status,
        }


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def format_table(rows: list[Row], columns: list = COLUMNS) -> str:
    """The table: a header line, one line per row, then each row's error, notes, and the
    reasons of its fma launches (those that have a contraction to put on tensor cores)."""
    cells = [row.cells() for row in rows]
    widths = [max([len(header)] + [len(c[key]) for c in cells]) for header, key, _ in columns]
    lines = ["  ".join(f"{header:{align}{w}}" for (header, _, align), w in zip(columns, widths, strict=False)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for c in cells:
        lines.append("  ".join(f"{c[key]:{align}{w}}" for (_, key, align), w in zip(columns, widths, strict=False)).rstrip())
    for row in rows:
        for p in row.paths:
            if p["path"] == "fma" and p.get("reason") and p["reason"] != "no contraction":
                lines.append(f"{row.kernel}: fma in {p['entry']}: {p['reason']}")
        if row.error:
            first = row.error.strip().splitlines()
            lines.append(f"{row.kernel}: {row.status}: " + (first[0] if first else "") + (" ..." if len(first) > 1 else ""))
        for note in row.notes:
            lines.append(f"{row.kernel}: note: {note}")
    return "\n".join(lines)


# ---- shared by the dry run and the GPU run ------------------------------------------------------


def load_case(case: Case):
    """The napkin Kernel of a case."""
    import napkin_dsl as napkin

    kernels = napkin.load(EXAMPLES / case.path)
    if case.kernel not in kernels:
        raise KeyError(f"{case.path} defines {', '.join(kernels)}, not {case.kernel}")
    kernel = kernels[case.kernel]
    if case.relabel is not None:  # the file's relabel block replaced, clause lines as Kernel.relabelled takes them
        kernel = kernel.relabelled(case.relabel.replace(";;", "\n"))
    if case.grad is not None:
        return kernel.grad(**case.grad, **case.sizes)
    return kernel


def load_forward(case: Case):
    """The forward of a backward case (``Case.grad``), as the backward reads it: with the outputs
    it adds for the backward (attention's lse L, ``Kernel.lse_forward``) where it adds any."""
    import napkin_dsl as napkin

    forward = napkin.load(EXAMPLES / case.path)[case.kernel]
    backward = load_case(case)
    return forward.lse_forward() if backward.derivation.auxiliary else forward


def backward_inputs(case: Case, inputs: dict, run) -> dict:
    """A backward case's inputs as training gives them: the forward's outputs it reads (attention's
    O and L) computed from the same inputs by ``run(program, arrays)`` (``cuda.run`` on the GPU,
    the NumPy backend in the tests), in place of random ones (a random L would overflow
    exp(S - L)); the cotangents and the forward's inputs stay as drawn."""
    backward = load_case(case)
    forward = load_forward(case)
    program = forward.gpu_program(None, **{a: case.sizes[a] for a in forward.diagram.axes})
    outputs = run(program, {a.name: inputs[a.name] for a in forward.diagram.input_arrays})
    saved = {name: np.asarray(outputs[name]).astype(inputs[name].dtype) for name in backward.derivation.saved}
    return dict(inputs, **saved)


def check_sample_axes(kernel, case: Case) -> None:
    """Refuse a sample axis on which slicing would change the answer.

    Slicing inputs along an axis and evaluating the reference on the slices equals slicing
    the full result only when every statement is woven over the axis (nothing contracts,
    reduces or softmaxes along it), no expression reads its index (a mask ``q >= x`` would
    compare the slice's positions, not the array's), and every output carries it.
    """
    diagram = kernel.diagram
    indexed = index_axes(diagram)
    for axis in case.sample:
        if axis not in diagram.axes:
            raise ValueError(f"{case.label}: sample axis {axis!r} is not an axis of {diagram.name}")
        if axis in indexed:
            raise ValueError(f"{case.label}: cannot check a subset of {axis!r}: an expression reads its index")
        across = [s.target for s in diagram.statements if axis not in s.woven]
        if across:
            raise ValueError(f"{case.label}: cannot check a subset of {axis!r}: {', '.join(across)} is not woven over it")
        missing = [name for name in diagram.outputs if axis not in diagram.arrays[name].axes]
        if missing:
            raise ValueError(f"{case.label}: output {', '.join(missing)} does not carry sample axis {axis!r}")


def index_axes(diagram) -> set[str]:
    """Axes whose index some statement's expression reads (``diagram.Index``)."""
    from dataclasses import fields, is_dataclass

    from napkin_dsl.diagram import Index

    found: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, Index):
            found.add(node.axis)
        elif is_dataclass(node) and not isinstance(node, type):
            for f in fields(node):
                visit(getattr(node, f.name))
        elif isinstance(node, (tuple, list)):
            for item in node:
                visit(item)

    for statement in diagram.statements:
        visit(statement.box)
    return found


def sample_indices(case: Case, seed: int = SEED) -> dict[str, np.ndarray]:
    """Sorted indices per sample axis: the first, the last, and random ones between."""
    rng = np.random.default_rng(seed)
    chosen = {}
    for axis, count in case.sample.items():
        size = case.sizes[axis]
        if count >= size:
            chosen[axis] = np.arange(size)
            continue
        between = rng.choice(np.arange(1, size - 1), size=max(count - 2, 0), replace=False)
        chosen[axis] = np.unique(np.concatenate([[0, size - 1], between]).astype(np.int64))
    return chosen


def small_case(case: Case) -> Case:
    """The case at small sizes (:data:`SMALL_SIZES`, else the check-run sizes of
    ``napkin run``), every row of it checked against the reference."""
    sizes = SMALL_SIZES.get(case.label)
    if sizes is None:
        from napkin_dsl.backends.numpy import default_sizes

        kernel = load_case(case)
        sizes = {a: v for a, v in default_sizes(kernel).items() if a in kernel.diagram.axes}
    return replace(case, sizes=dict(sizes), sample={a: sizes[a] for a in case.sample})


def sweep_cases() -> list[Case]:
    """The --sweep points: attention over sequence lengths at constant h * sequence (b = 1),
    then matmul cubes; sampled like the table's cases (attention on a few heads)."""
    attention = next(c for c in CASES if c.label == "attention")
    matmul = next(c for c in CASES if c.label == "matmul")
    points = []
    for sequence in SWEEP_SEQUENCES:
        sizes = {"b": 1, "h": SWEEP_HEAD_TOKENS // sequence, "q": sequence, "x": sequence, "d": 128}
        points.append(replace(attention, sizes=sizes, sample={"h": 8, "q": 32}))
    for n in SWEEP_MATMUL:
        points.append(replace(matmul, sizes={"m": n, "k": n, "n": n}))
    mlp = next(c for c in CASES if c.label == "mlp")
    for relabel in SWEEP_ATTENTION_RELABELLINGS:
        points.append(replace(attention, label=f"attention {relabel_tag(relabel)}", sizes=dict(SWEEP_RELABEL_SIZES["attention"]),
                              sample={"h": 8, "q": 32}, relabel=relabel))
    for relabel in SWEEP_MATMUL_RELABELLINGS:
        points.append(replace(matmul, label=f"matmul {relabel_tag(relabel)}", sizes=dict(SWEEP_RELABEL_SIZES["matmul"]), relabel=relabel))
    for relabel in SWEEP_MLP_RELABELLINGS:
        points.append(replace(mlp, label=f"mlp {relabel_tag(relabel)}", sizes=dict(SWEEP_RELABEL_SIZES["mlp"]), relabel=relabel))
    return points


def take(array: np.ndarray, axes: tuple, indices: dict[str, np.ndarray]) -> np.ndarray:
    """``array`` (dimensions named by ``axes``) restricted to ``indices`` on the axes it has."""
    for position, axis in enumerate(axes):
        if axis in indices:
            array = np.take(array, indices[axis], axis=position)
    return array


def random_inputs(diagram, sizes: dict, seed: int = SEED) -> dict[str, np.ndarray]:
    """Seeded standard normal arrays in each input's dtype, none zero (each kept 0.05 away).

    float32 draws (the float64 ones of ``napkin run`` are slow at a few hundred million values).
    """
    from napkin_dsl.types import numpy_dtype

    rng = np.random.default_rng(seed)
    arrays = {}
    for array in diagram.input_arrays:
        values = rng.standard_normal([sizes[a] for a in array.axes], dtype=np.float32)
        small = np.abs(values) < 0.05
        values[small] = np.copysign(np.float32(0.05), values[small])
        arrays[array.name] = values.astype(numpy_dtype(array.dtype))
    return arrays


def compare_with_reference(kernel, program, inputs: dict, scalars: dict, outputs: dict, indices: dict) -> tuple[float, float]:
    """(max |outputs - reference| / max |reference| over the sampled rows, tolerance).

    NaN or inf in the checked outputs is an infinite error.
    """
    from napkin_dsl.backends.numpy import tolerance
    from napkin_dsl.reference import evaluate

    diagram = kernel.diagram
    sizes = {a: int(program.schedule.axis_size(a)) for a in diagram.axes}
    sliced_sizes = {a: (len(indices[a]) if a in indices else n) for a, n in sizes.items()}
    sliced = {a.name: take(inputs[a.name], a.axes, indices) for a in diagram.input_arrays}
    # The sliced problems need well under 1 GiB; the reference's default guard (25% of MemTotal)
    # could refuse them on a VM whose memory starts small and grows on demand.
    expected = evaluate(diagram, sliced, scalars, sliced_sizes, keep_float64=True, memory_limit=REFERENCE_MEMORY_LIMIT)
    error, scale = 0.0, 0.0
    for name in diagram.outputs:
        got = take(np.asarray(outputs[name]), diagram.arrays[name].axes, indices).astype(np.float64)
        want = expected[name]
        if got.shape != want.shape:
            raise ValueError(f"output {name} has shape {got.shape} on the checked rows; the reference has {want.shape}")
        if not np.all(np.isfinite(got)):
            return math.inf, tolerance(program)
        error = max(error, float(np.max(np.abs(got - want), initial=0.0)))
        scale = max(scale, float(np.max(np.abs(want), initial=0.0)))
    return (error / scale if scale > 0 else error), tolerance(program)


def describe_compiled(row: Row, compiled) -> None:
    """Fill a row's compile-time fields from a CompiledKernel: launches, their instruction
    path (tensor cores or FMA, and why FMA), FLOPs, bytes, the predicted time and its bound."""
    from napkin_dsl.isel import selection

    report = compiled.cost
    row.launches = compiled.launch_table()
    program = compiled.program
    entries = [k.entry for k in compiled.launches]
    row.paths = []
    for index, launch in enumerate(program.launches):
        chosen = selection(program, launch, compiled.arch)
        row.paths.append({"entry": entries[index] if index < len(entries) else f"launch {index}",
                          "path": chosen.path, "reason": chosen.reason})
    row.bound = str(report.time.get("bound") or "")
    row.flops = float(report.total_flops)
    first_level = next(iter(report.levels.values()), None)  # device memory -> the first level below it
    row.dram_bytes = float(first_level.H_bytes) if first_level is not None else None
    predicted = report.time.get("overlapped_s")
    row.predicted_s = float(predicted) if predicted is not None else None
    if report.hardware != row.profile:
        row.notes.append(f"cost report is on {report.hardware}, not {row.profile}")
    spills = {k["entry"]: k["spill_bytes"] for k in row.launches if k.get("spill_bytes")}
    if spills:
        row.notes.append("spills: " + ", ".join(f"{entry} {n} B" for entry, n in spills.items()))


def describe_sass(row: Row, compiled) -> None:
    """Hot-loop instructions per tensor-core instruction of each launch (static counts), when
    nvdisasm is installed; otherwise ``row.sass`` says why not. Never raises."""
    try:
        from napkin_dsl.backends import sass
    except Exception as error:  # noqa: BLE001 - a column, not the check
        row.sass = f"SASS inspection unavailable: {type(error).__name__}: {error}"
        return
    try:
        report = sass.sass_report(compiled)
        loops = [sass.hot_loop(entry) for entry in report["launches"]]
        row.instr_per_tensor = [loop["per_tensor"] if loop else None for loop in loops]
        row.sass = ""
    except sass.NoDisassembler as error:
        row.sass = f"no nvdisasm: {str(error).splitlines()[0]}"
    except Exception as error:  # noqa: BLE001 - a column, not the check
        row.sass = f"SASS inspection failed: {type(error).__name__}: {error}"
        row.notes.append(row.sass)


def dry_run_case(case: Case, arch: str | None, profile: str) -> Row:
    """The case compiled for its own arch, else ``arch``, else the profile's (None: the profile's)."""
    from napkin_dsl.hardware import load_hardware

    arch = case.arch or arch or load_hardware(profile).arch
    row = Row(case.label, dict(case.sizes), arch=arch, profile=profile, device="(dry run)")
    started = time.perf_counter()
    try:
        kernel = load_case(case)
        check_sample_axes(kernel, case)
        row.arch = arch
        compiled = kernel.compile(arch, hardware=profile, synchronous=case.synchronous, overlap=case.overlap, **case.sizes)
        describe_compiled(row, compiled)
        describe_sass(row, compiled)
        row.checked = {a: len(i) for a, i in sample_indices(case).items()}
        row.status = "compiled"
    except Exception as error:  # noqa: BLE001 - one example's failure is its row, not the run's
        row.status = "ERROR"
        row.error = f"{type(error).__name__}: {error}"
    row.wall_s = time.perf_counter() - started
    return row


# ---- the GPU side (child processes) ------------------------------------------------------------


def profile_for(device_name: str, arch: str) -> tuple[str, str]:
    """(napkin hardware profile, how it was chosen) for a GPU."""
    from napkin_dsl.errors import NapkinError
    from napkin_dsl.hardware import gpu_for_arch, hardware_names, load_hardware, profile_for_device

    gpus = [name for name in hardware_names() if load_hardware(name).archs]  # the GPU profiles, not the abstract ones
    try:
        return profile_for_device(device_name), "by device name"  # the one map a kernel call uses too
    except NapkinError:
        pass
    try:
        guess = gpu_for_arch(arch)
    except NapkinError:  # no profile lists this arch: the GPU of its major version (sm_89: A100)
        major, minor = _arch_version(arch)
        near = [name for name in gpus if _arch_version(load_hardware(name).arch)[0] == major
                and _arch_version(load_hardware(name).arch)[1] <= minor]
        if not near:
            raise
        guess = max(near, key=lambda name: _arch_version(load_hardware(name).arch))  # the first by name of the newest
    return guess, f"no profile for {device_name!r}: using {guess} (closest by architecture {arch})"


def _arch_version(arch: str) -> tuple[int, int]:
    """sm_89 -> (8, 9); sm_90a -> (9, 0)."""
    digits = arch.removeprefix("sm_").rstrip("af")
    return int(digits[:-1]), int(digits[-1])


def case_arch(case: Case, profile: str, device_arch: str) -> str:
    """The arch a case compiles for on a GPU of ``device_arch``: the case's own (sm_90, sm_90a) where
    that GPU is its plain arch and the profile runs it, else :func:`compile_arch`'s."""
    from napkin_dsl.hardware import load_hardware

    if case.arch and case.arch.rstrip("a") == device_arch and case.arch in load_hardware(profile).archs:
        return case.arch
    return compile_arch(profile, device_arch)


def compile_arch(profile: str, arch: str) -> str:
    """What to compile for on a GPU of ``arch`` planned as ``profile``: the profile's own arch where
    that GPU runs it (sm_90a on an sm_90 GPU, as the model prices it; ``Hardware.arch_for_device``),
    else ``arch`` itself where the profile runs it, else the profile's newest arch of the same major
    version, whose cubin the GPU runs (an sm_80 cubin runs on sm_86 and sm_89)."""
    from napkin_dsl.hardware import load_hardware

    hardware = load_hardware(profile)
    archs = hardware.archs
    if hardware.arch_for_device(arch) != arch:
        return hardware.arch_for_device(arch)
    if arch in archs:
        return arch
    major, minor = _arch_version(arch)
    near = [a for a in archs if _arch_version(a)[0] == major and _arch_version(a)[1] <= minor]
    return max(near, key=_arch_version) if near else arch  # else: Kernel.compile names the profile's arches


class EventTimer:
    """Times work enqueued on one stream with CUDA driver events.

    Before the timed runs a spin kernel holds the GPU for longer than Python needs to enqueue
    them all, so each start/end event pair brackets only GPU work, not launch latency.
    """

    def __init__(self, device, stream_handle: int = 0, driver=None):
        from napkin_dsl.backends.nvrtc import NvrtcCompiler

        if driver is None:
            from cuda.bindings import driver
        self.driver = driver  # cuda.bindings.driver, or a stand-in with its event calls (tests)
        self.device = device
        self.stream = driver.CUstream(stream_handle)
        module = device.load(NvrtcCompiler(device.arch).compile(SPIN_SOURCE, "gpu_check_spin.cu").image)
        self.spin_function = device.function(module, "gpu_check_spin")

    def _call(self, name: str, *args):
        from napkin_dsl.backends.driver import check

        return check(getattr(self.driver, name)(*args), name)

    def synchronize(self) -> None:
        self._call("cuStreamSynchronize", self.stream)

    def spin(self, seconds: float) -> None:
        self.device.launch(self.spin_function, 1, 1, [ctypes.c_uint64(int(seconds * 1e9))], stream=self.stream)

    def calibrate(self, enqueue, budget_s: float) -> tuple[float, float, int]:
        """Warm up; return (wall seconds per run, CPU seconds to enqueue one run, warm-up runs)."""
        started = time.perf_counter()
        enqueue()
        self.synchronize()
        first = time.perf_counter() - started
        warmups = 1
        per_run, issue = first, first
        # Short kernels get a few more warm-ups (clocks, caches); long ones have had theirs.
        while warmups < 5 and (warmups < 3 or per_run < 0.01) and per_run * (warmups + 1) < budget_s / 4:
            started = time.perf_counter()
            enqueue()
            issued = time.perf_counter()
            self.synchronize()
            per_run, issue = time.perf_counter() - started, issued - started
            warmups += 1
        return per_run, issue, warmups

    def measure(self, enqueue, runs: int, issue_s: float) -> list[float]:
        """Seconds of GPU time of each of ``runs`` runs of ``enqueue``."""
        flags = self.driver.CUevent_flags.CU_EVENT_DEFAULT
        pairs = [(self._call("cuEventCreate", flags), self._call("cuEventCreate", flags)) for _ in range(runs)]
        try:
            self.spin(min(0.2, 0.002 + 3 * issue_s * runs))
            for start, end in pairs:
                self._call("cuEventRecord", start, self.stream)
                enqueue()
                self._call("cuEventRecord", end, self.stream)
            self.synchronize()
            return [self._call("cuEventElapsedTime", start, end) / 1e3 for start, end in pairs]
        finally:
            for start, end in pairs:
                self._call("cuEventDestroy", start)
                self._call("cuEventDestroy", end)

    def time(self, enqueue, budget_s: float) -> tuple[float, int]:
        """(median seconds, runs) of ``enqueue``, within about ``budget_s`` of GPU time."""
        per_run, issue, _ = self.calibrate(enqueue, budget_s)
        runs = int(min(max(MIN_RUNS, 1.0 / max(per_run, 1e-6)), MAX_RUNS))
        if runs * per_run > budget_s:
            runs = max(FEWEST_RUNS, int(budget_s / per_run))
        return statistics.median(self.measure(enqueue, runs, issue)), runs


class NapkinLaunches:
    """A compiled kernel's launches with device buffers allocated once (inputs copied once)."""

    def __init__(self, device, compiled, inputs: dict, scalars: dict, stream):
        from napkin_dsl.types import numpy_dtype

        self.device = device
        self.compiled = compiled
        self.stream = stream
        diagram = compiled.program.diagram
        schedule = compiled.program.schedule
        self.buffers = {}
        for k in compiled.launches:
            for name, _, _ in k.arrays:
                if name in self.buffers:
                    continue
                array = diagram.arrays[name]
                if name in inputs:
                    self.buffers[name] = device.to_device(np.ascontiguousarray(inputs[name]))
                else:
                    values = math.prod(int(schedule.axis_size(a)) for a in array.axes)
                    self.buffers[name] = device.alloc(values * np.dtype(numpy_dtype(array.dtype)).itemsize)
        module = device.load(compiled.image)
        self.calls = []
        for k in compiled.launches:
            args = [self.buffers[name] for name, _, _ in k.arrays] + [np.float32(scalars[name]) for name in k.scalars]
            self.calls.append((device.function(module, k.entry), k, args))

    def enqueue(self) -> None:
        for function, k, args in self.calls:
            self.device.launch(function, k.grid, k.block, args, shared_bytes=k.shared_bytes, stream=self.stream)

    def output(self, name: str) -> np.ndarray:
        from napkin_dsl.types import numpy_dtype

        program = self.compiled.program
        array = program.diagram.arrays[name]
        out = np.empty([int(program.schedule.axis_size(a)) for a in array.axes], numpy_dtype(array.dtype))
        return self.device.copy_to_host(self.buffers[name], out)

    def free(self) -> None:
        for buffer in self.buffers.values():
            self.device.free(buffer)


# torch counterparts: each takes (torch, tensors by parameter name, sizes, scalars) and returns a
# zero-argument callable that computes the output (work that is not the operation, such as
# repeating K/V heads for a torch without enable_gqa, happens outside the callable).


def _torch_sdpa(torch, t, sizes, scalars):
    functional = torch.nn.functional
    return lambda: functional.scaled_dot_product_attention(t["Q"], t["K"], t["V"])


def _torch_sdpa_causal(torch, t, sizes, scalars):
    functional = torch.nn.functional
    return lambda: functional.scaled_dot_product_attention(t["Q"], t["K"], t["V"], is_causal=True)


def _torch_sdpa_window(torch, t, sizes, scalars):
    """The sliding window of examples/sliding_window.napkin: key x is seen by query q when
    q - 256 < x <= q (the mask is built outside the timed callable)."""
    functional = torch.nn.functional
    q = torch.arange(sizes["q"], device=t["Q"].device)[:, None]
    x = torch.arange(sizes["x"], device=t["Q"].device)[None, :]
    visible = (q >= x) & (q - x < 256)
    return lambda: functional.scaled_dot_product_attention(t["Q"], t["K"], t["V"], attn_mask=visible)


def _torch_sdpa_gqa(torch, t, sizes, scalars):
    functional = torch.nn.functional
    b, kv, r, q, d = (sizes[a] for a in ("b", "kv", "r", "q", "d"))
    query = t["Q"].reshape(b, kv * r, q, d)  # head kv * r + r_index: torch's GQA maps it to kv head kv
    try:
        functional.scaled_dot_product_attention(query[:, :, :1], t["K"][:, :, :1], t["V"][:, :, :1], enable_gqa=True)
        return lambda: functional.scaled_dot_product_attention(query, t["K"], t["V"], enable_gqa=True).view(b, kv, r, q, d)
    except TypeError:  # torch < 2.5
        key, value = t["K"].repeat_interleave(r, dim=1), t["V"].repeat_interleave(r, dim=1)
        return lambda: functional.scaled_dot_product_attention(query, key, value).view(b, kv, r, q, d)


def _torch_sdpa_backward(torch, t, sizes, scalars):
    """The backward of scaled_dot_product_attention at the same Q, K, V and cotangent dO (its
    forward run once, outside the timed callable), returning dQ, napkin's first gradient."""
    functional = torch.nn.functional
    q, k, v = (t[name].detach().requires_grad_() for name in ("Q", "K", "V"))
    out = functional.scaled_dot_product_attention(q, k, v)
    return lambda: torch.autograd.grad(out, (q, k, v), grad_outputs=t["dO"], retain_graph=True)[0]


def _torch_matmul(torch, t, sizes, scalars):
    return lambda: torch.matmul(t["A"], t["B"])


def _torch_mlp(torch, t, sizes, scalars):
    functional = torch.nn.functional
    return lambda: functional.gelu(torch.addmm(t["bias"], t["X"], t["W"]))


def _torch_swiglu(torch, t, sizes, scalars):
    functional = torch.nn.functional
    return lambda: torch.matmul(functional.silu(torch.matmul(t["X"], t["W1"])) * torch.matmul(t["X"], t["W3"]), t["W2"])


def _torch_softmax(torch, t, sizes, scalars):
    return lambda: torch.softmax(t["X"], dim=-1)


def _torch_rmsnorm(torch, t, sizes, scalars):
    functional = torch.nn.functional
    eps = float(scalars["eps"])
    if hasattr(functional, "rms_norm"):
        return lambda: functional.rms_norm(t["X"], (sizes["d"],), t["G"], eps)
    x, g = t["X"], t["G"]
    return lambda: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * g.float()).to(x.dtype)


def _torch_unfused_attention(torch, t, sizes, scalars):
    return lambda: torch.matmul(torch.softmax(torch.matmul(t["Q"], t["K"].T), dim=-1), t["V"])


def _torch_softmax_matmul(torch, t, sizes, scalars):
    return lambda: torch.matmul(torch.softmax(t["S"], dim=-1), t["V"])


TORCH_BASELINES = {
    "sdpa": ("F.scaled_dot_product_attention", _torch_sdpa),
    "sdpa_gqa": ("F.scaled_dot_product_attention(enable_gqa=True)", _torch_sdpa_gqa),
    "sdpa_causal": ("F.scaled_dot_product_attention(is_causal=True)", _torch_sdpa_causal),
    "sdpa_window": ("F.scaled_dot_product_attention(attn_mask=window)", _torch_sdpa_window),
    "sdpa_backward": ("F.scaled_dot_product_attention's backward", _torch_sdpa_backward),
    "matmul": ("torch.matmul (bf16 out)", _torch_matmul),
    "mlp": ("F.gelu(torch.addmm)", _torch_mlp),
    "swiglu": ("silu(X @ W1) * (X @ W3) @ W2", _torch_swiglu),
    "softmax": ("torch.softmax", _torch_softmax),
    "rmsnorm": ("F.rms_norm", _torch_rmsnorm),
    "unfused_attention": ("softmax(Q @ K.T) @ V", _torch_unfused_attention),
    "softmax_matmul": ("softmax(S) @ V", _torch_softmax_matmul),
}


def to_torch(torch, array: np.ndarray):
    """A CUDA tensor with the array's values (bf16 through its 16 raw bits: torch has no ml_dtypes)."""
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array)).cuda()


def torch_comparison(row: Row, case: Case, timer_factory, inputs, scalars, napkin_output: np.ndarray, budget_s: float):
    """Time the torch counterpart and compare its output with napkin's; notes instead of failures."""
    if case.baseline is None:
        return
    try:
        import torch
    except ImportError as error:
        row.notes.append(f"torch not available ({error}): no comparison")
        return
    try:
        if not torch.cuda.is_available():
            row.notes.append("torch sees no CUDA GPU: no comparison")
            return
        name, make = TORCH_BASELINES[case.baseline]
        row.torch_baseline = f"{name} (torch {torch.__version__})"
        tensors = {k: to_torch(torch, v) for k, v in inputs.items()}
        compute = make(torch, tensors, case.sizes, scalars)
        result = compute().float().cpu().numpy()  # float32 is enough for a difference shown, not judged
        reference = napkin_output.astype(np.float32).reshape(result.shape)
        scale = float(np.max(np.abs(result), initial=0.0))
        row.torch_error = float(np.max(np.abs(reference - result), initial=0.0)) / (scale or 1.0)
        if row.tolerance is not None and not row.torch_error <= max(10 * row.tolerance, 0.05):
            row.notes.append(f"napkin and torch differ by {row.torch_error:.3g} over the whole output: "
                             "look at the rows the reference did not check")
        timer = timer_factory(torch.cuda.current_stream().cuda_stream)
        row.torch_s, _ = timer.time(compute, budget_s)
        del tensors
        torch.cuda.empty_cache()
    except Exception as error:  # noqa: BLE001 - torch's trouble is a note, not napkin's failure
        row.notes.append(f"torch comparison failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")


def gpu_case(case: Case, profile_override: str | None, timing_budget_s: float, check_only: bool = False) -> Row:
    """Compile, run, check and time one case on the GPU; never raises.

    ``check_only`` (--small, and the sanitizer's child): run and check, no SASS, timing or torch.
    """
    row = Row(case.label, dict(case.sizes))
    started = time.perf_counter()
    launches = None
    device = None
    try:
        from napkin_dsl.backends import cuda
        from napkin_dsl.backends.driver import Device

        device = Device(0)
        row.device, row.arch = device.name, device.arch
        row.profile, how = (profile_override, "given") if profile_override else profile_for(device.name, device.arch)
        if how not in ("given", "by device name"):
            row.notes.append(how)
        kernel = load_case(case)
        check_sample_axes(kernel, case)
        arch = case_arch(case, row.profile, device.arch)
        row.arch = arch
        compiled = kernel.compile(arch, hardware=row.profile, synchronous=case.synchronous, overlap=case.overlap,
                                  **case.sizes)
        program = kernel.gpu_program(row.profile, **case.sizes)
        describe_compiled(row, compiled)
        if not check_only:
            describe_sass(row, compiled)
        diagram = kernel.diagram
        inputs = random_inputs(diagram, case.sizes)
        scalars = dict(case.scalars)
        if case.grad is not None:  # O and L from the forward, on the GPU
            inputs = backward_inputs(case, inputs, lambda forward, arrays: cuda.run(forward, arrays, {}, arch=arch))

        # correctness, through the backend's own run()
        outputs = cuda.run(program, inputs, scalars, arch=arch)
        indices = sample_indices(case)
        row.checked = {a: len(i) for a, i in indices.items()}
        row.max_error, row.tolerance = compare_with_reference(kernel, program, inputs, scalars, outputs, indices)
        passed = row.max_error <= row.tolerance
        if check_only:
            row.status = "pass" if passed else "FAIL"
            if not passed:
                row.error = f"max error {row.max_error:.3g} over tolerance {row.tolerance:g}"
            row.wall_s = time.perf_counter() - started
            return row

        # timing, on buffers allocated once
        launches = NapkinLaunches(device, compiled, inputs, scalars, stream=None)
        timer = EventTimer(device, 0)
        row.measured_s, row.runs = timer.time(launches.enqueue, timing_budget_s)
        summed = case.grad is not None and bool(kernel.derivation.schedule and kernel.derivation.schedule.summed)
        for name in diagram.outputs:
            again = launches.output(name)
            if summed:  # atomic adds in a varying order: equal within the tolerance, not bit for bit
                first = np.asarray(outputs[name]).astype(np.float64)
                apart = float(np.max(np.abs(np.asarray(again).astype(np.float64) - first), initial=0.0))
                if not apart <= row.tolerance * float(np.max(np.abs(first), initial=0.0)):
                    passed = False
                    row.notes.append(f"{name} differs between run() and the timed launches by {apart:.3g}, over the tolerance")
                continue
            if not np.array_equal(again.view(np.uint8), np.ascontiguousarray(outputs[name]).view(np.uint8)):
                passed = False
                row.notes.append(f"{name} differs between run() and the timed launches: a race or uninitialised read")
        if summed:
            row.notes.append("dQ summed by atomic adds: the timed runs equal run()'s within the tolerance, not bit for bit")
        elif case.grad is not None:
            row.notes.append(f"deterministic: the gradients after {row.runs} timed runs equal run()'s bit for bit")
        row.status = "pass" if passed else "FAIL"
        if not passed and row.max_error > row.tolerance:
            row.error = f"max error {row.max_error:.3g} over tolerance {row.tolerance:g}"
        launches.free()
        launches = None

        torch_comparison(row, case, lambda handle: EventTimer(device, handle), inputs, scalars,
                         outputs[diagram.outputs[0]], timing_budget_s / 3)
    except Exception as error:  # noqa: BLE001 - the row says what went wrong
        row.status = "ERROR"
        row.error = f"{type(error).__name__}: {error}"
        row.notes.append("traceback: " + " | ".join(traceback.format_exc().strip().splitlines()[-6:]))
    finally:
        try:
            if launches is not None:
                launches.free()
        except Exception as error:  # noqa: BLE001 - a broken context cannot free; the process ends anyway
            row.notes.append(f"could not free device buffers: {error}")
    row.wall_s = time.perf_counter() - started
    return row


# ---- the parent: one child per case, one table -----------------------------------------------------

_RUNNING: list = []  # the child process now running (its own process group), for the watchdog to end


def kill_group(process) -> None:
    """End a child started with ``start_new_session`` and everything it started (its group)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class ChildResult:
    """What one child process left: the rows it wrote (one per case it finished), its exit
    status (None: killed at the timeout), its output (stdout and stderr interleaved)."""

    rows: list
    returncode: int | None
    output: str
    wall_s: float


def child_command(cases: list[Case], args, row_file: Path, timing_budget: float, check_only: bool) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps([asdict(c) for c in cases]),
               "--row-json", str(row_file), "--timing-budget", str(timing_budget)]
    if check_only:
        command.append("--check-only")
    if args.profile:
        command += ["--profile", args.profile]
    return command


def spawn(cases: list[Case], args, timeout_s: float, *, timing_budget: float, check_only: bool = False,
          wrapper: tuple = ()) -> ChildResult:
    """Run ``cases`` in one child process (under ``wrapper``, e.g. compute-sanitizer), killed
    with all it started after ``timeout_s``."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as directory:
        row_file = Path(directory) / "rows.json"
        command = [*wrapper, *child_command(cases, args, row_file, timing_budget, check_only)]
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   errors="replace", cwd=ROOT, start_new_session=True)
        _RUNNING.append(process)
        try:
            output, _ = process.communicate(timeout=max(timeout_s, 1.0))
            returncode = process.returncode
        except subprocess.TimeoutExpired:
            kill_group(process)
            output, _ = process.communicate()
            returncode = None
        except BaseException:
            kill_group(process)
            raise
        finally:
            _RUNNING.remove(process)
        rows = []
        if row_file.exists():
            try:
                rows = [Row.from_json(r) for r in json.loads(row_file.read_text())["rows"]]
            except (ValueError, KeyError, TypeError):
                pass
        return ChildResult(rows, returncode, output or "", time.perf_counter() - started)


def run_child(case: Case, args, timeout_s: float, timing_budget: float | None = None, check_only: bool = False) -> Row:
    """Run one case in a child process; a crash or a hang becomes the row's status."""
    result = spawn([case], args, timeout_s, timing_budget=args.timing_budget if timing_budget is None else timing_budget,
                   check_only=check_only)
    if result.rows:
        return result.rows[0]
    tail = result.output.strip().splitlines()
    if result.returncode is None:
        row = Row(case.label, dict(case.sizes), status="TIMEOUT", error=f"no result within {timeout_s:.0f} s (child killed)")
        if tail:
            row.notes.append("child output: " + " | ".join(tail[-3:]))
    else:
        row = Row(case.label, dict(case.sizes), status="ERROR",
                  error=f"child exited with status {result.returncode} and no result: " + " | ".join(tail[-5:]))
    row.wall_s = result.wall_s
    return row


def run_cases(cases: list[Case], args, rows: list[Row], *, deadline_s: float, timing_budget: float,
              check_only: bool = False, least_s: float = 20.0, name: str = "", reuse=None, on_row=None) -> None:
    """One child per case, appending each row to ``rows`` as it comes; cases left when fewer
    than ``least_s`` of ``deadline_s`` remain are SKIPPED. ``reuse(case)`` may return a row
    measured before instead."""
    started = time.perf_counter()
    for index, case in enumerate(cases, 1):
        label = f"{name}{case.label} " + " ".join(f"{k}={v}" for k, v in case.sizes.items())
        reused = reuse(case) if reuse else None
        if reused is not None:
            rows.append(reused)
        elif (remaining := deadline_s - (time.perf_counter() - started)) < least_s:
            rows.append(Row(case.label, dict(case.sizes), status="SKIPPED", error=f"the {deadline_s:.0f} s deadline is near"))
        else:
            print(f"[{index}/{len(cases)}] {label} ...", file=sys.stderr, flush=True)
            case_started = time.perf_counter()
            row = run_child(case, args, min(args.case_timeout, remaining - 5), timing_budget, check_only)
            row.wall_s = time.perf_counter() - case_started
            rows.append(row)
            print(f"[{index}/{len(cases)}] {label}: {row.status} in {row.wall_s or 0:.1f} s", file=sys.stderr, flush=True)
        if on_row:
            on_row()


def header(rows: list[Row], dry_run: bool) -> str:
    first = next((r for r in rows if r.device), None)
    versions = []
    try:
        from napkin_dsl.backends.nvrtc import nvrtc_version

        versions.append("NVRTC {}.{}".format(*nvrtc_version()))
    except Exception as error:  # noqa: BLE001 - a header without the version is still a header
        versions.append(f"NVRTC unknown ({type(error).__name__})")
    baseline = next((r.torch_baseline.split("(torch ")[-1].rstrip(")") for r in rows if r.torch_baseline), None)
    if baseline:
        versions.append(f"torch {baseline}")
    no_sass = next((r.sass for r in rows if r.sass and r.launches), None)
    if no_sass and not any(r.instr_per_tensor for r in rows):
        versions.append(f"instr/HMMA '-': {no_sass}")
    where = "dry run: compiled only, nothing launched" if dry_run else (first.device if first else "?")
    text = f"napkin gpu_check: {where}; arch {first.arch if first else '?'}; profile {first.profile if first else '?'}"
    return text + (f"; {', '.join(versions)}" if versions else "")


def write_json(rows: list[Row], dry_run: bool, path: Path, columns: list = COLUMNS, extra: dict | None = None) -> None:
    data = {
        "dry_run": dry_run,
        "ok": not any(r.status in FAILING for r in rows),
        "header": header(rows, dry_run),
        "columns": {header_: key for header_, key, _ in columns},
        **(extra or {}),
        "rows": [r.to_json() for r in rows],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(data, indent=2, default=str) + "\n")


def write_text_atomically(path: Path, text: str) -> None:
    """Write through a temporary file and a rename, so a reader (or a kill) never sees half."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def selected_cases(names: str | None) -> list[Case]:
    if not names:
        return list(CASES)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in {c.label for c in CASES}]
    if unknown:
        raise SystemExit(f"unknown case {', '.join(unknown)}; known: {', '.join(c.label for c in CASES)}")
    return [c for c in CASES if c.label in wanted]


def start_watchdog(seconds: float, on_expiry) -> None:
    """Call ``on_expiry`` and end the process if it is still running after ``seconds``."""

    def expire():
        try:
            running = _RUNNING.copy()  # the main thread may be removing one
            for process in running:
                kill_group(process)
            on_expiry()
        finally:
            os._exit(3)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


# ---- the sweep --------------------------------------------------------------------------------------


def sweep_extra() -> dict:
    return {"sweep": {"attention": {"d": 128, "b": 1, "h_times_sequence": SWEEP_HEAD_TOKENS,
                                    "sequences": list(SWEEP_SEQUENCES)},
                      "matmul_cubes": list(SWEEP_MATMUL)}}


def sweep_header(rows: list[Row], dry_run: bool) -> str:
    where = "dry run: compiled only, nothing launched" if dry_run else (next((r.device for r in rows if r.device), "?"))
    return (f"napkin gpu_check sweep: {where}; attention d=128 b=1 h*sequence={SWEEP_HEAD_TOKENS}, "
            f"matmul m=n=k; meas/pred = measured / predicted")


def sweep_summary(rows: list[Row]) -> str:
    """The model's error over the sweep: the median of |measured / predicted - 1| per kernel
    (the relabellings with their kernel) and over every measured point."""
    errors: dict[str, list[float]] = {}
    for r in rows:
        if r.measured_s and r.predicted_s:
            error = abs(r.measured_s / r.predicted_s - 1)
            errors.setdefault(r.kernel.split()[0], []).append(error)
            errors.setdefault("all", []).append(error)
    if not errors:
        return "median |meas/pred - 1|: no point was measured"
    return "median |meas/pred - 1|: " + ", ".join(
        f"{kernel} {statistics.median(values):.3f} ({len(values)} points)" for kernel, values in errors.items())


def reuse_from(table: list[Row]):
    """A function giving, for a sweep point equal to a case the table measured, that row."""
    measured = {(r.kernel, tuple(sorted(r.sizes.items()))): r for r in table if r.status in ("pass", "FAIL")}

    def reuse(case: Case) -> Row | None:
        row = measured.get((case.label, tuple(sorted(case.sizes.items()))))
        if row is None:
            return None
        copy = Row.from_json(row.to_json())
        copy.notes = [*copy.notes, "measured in the table above"]
        return copy

    return reuse


# ---- compute-sanitizer ------------------------------------------------------------------------------


def find_sanitizer() -> str | None:
    """compute-sanitizer: on PATH, else under /usr/local/cuda*/bin (newest first), else in the
    nvidia-cuda-sanitizer-api wheel; None when there is none."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found

    def version(path: Path) -> tuple:
        return tuple(int(n) for n in re.findall(r"\d+", path.parent.parent.name))

    candidates = [Path("/usr/local/cuda/bin/compute-sanitizer")]
    candidates += sorted(Path("/usr/local").glob("cuda-*/bin/compute-sanitizer"), key=version, reverse=True)
    try:
        import importlib.util

        spec = importlib.util.find_spec("nvidia")
        roots = list(spec.submodule_search_locations or []) if spec else []
    except (ImportError, ValueError):
        roots = []
    candidates += [Path(root) / relative for root in roots for relative in SANITIZER_WHEEL_BINARIES]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def sanitizer_verdict(tool: str, returncode: int | None, output: str, rows: list[Row], expected: int) -> tuple[str, str]:
    """(pass | FAIL | TIMEOUT, one line saying why) for one compute-sanitizer run."""
    found, problems = [], []
    errors = re.findall(r"ERROR SUMMARY: (\d+) errors?", output)
    if errors:
        found.append(f"{errors[-1]} errors")
        if int(errors[-1]):
            problems.append(f"{errors[-1]} errors")
    races = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", output)
    if races:
        hazards, race_errors, warnings = races[-1]
        found.append(f"{hazards} hazards ({race_errors} errors, {warnings} warnings)")
        if int(race_errors):
            problems.append(f"{race_errors} race errors")
    if returncode == SANITIZER_ERROR_EXIT and not problems:
        problems.append(f"{tool} reported errors (exit status {returncode})")
    elif returncode not in (None, 0, SANITIZER_ERROR_EXIT):
        problems.append(f"exit status {returncode}")
    if len(rows) < expected:
        problems.append(f"{expected - len(rows)} of {expected} cases left no result")
    bad = [f"{r.kernel} {r.status}" + (f" ({r.error.strip().splitlines()[0][:100]})" if r.error.strip() else "")
           for r in rows if r.status != "pass"]
    if bad:
        problems.append("under the tool: " + ", ".join(bad))
    cases = ", ".join(f"{r.kernel} {r.path_text or '?'} {r.status}" for r in rows)
    summary = "; ".join(found or ["no summary line from the tool"]) + (f"; {cases}" if cases else "")
    if returncode is None:
        return "TIMEOUT", "killed at its timeout; " + summary
    return ("FAIL" if problems else "pass"), (("; ".join(problems) + " | ") if problems else "") + summary


def sanitizer_cases() -> list[Case]:
    return [small_case(c) for c in CASES if c.label in SANITIZER_CASES]


def describe_cases(cases: list[Case]) -> str:
    return ", ".join(f"{c.label} " + " ".join(f"{k}={v}" for k, v in c.sizes.items()) for c in cases)


def run_sanitizer(args, out: Path | None, deadline_s: float) -> list[dict]:
    """memcheck, then racecheck, each on one child that runs the small cases (check only).
    Prints a line per tool and the tail of its output; returns the results."""
    cases = sanitizer_cases()
    binary = find_sanitizer()
    results = []
    if binary is None:
        print("napkin gpu_check sanitizer: compute-sanitizer not found (not on PATH, not under /usr/local/cuda*/bin, "
              "no nvidia-cuda-sanitizer-api wheel): memcheck and racecheck NOT run; this fails nothing", flush=True)
        if out:
            write_text_atomically(out / "gpu_sanitizer.json", json.dumps(
                {"sanitizer": None, "cases": [asdict(c) for c in cases], "results": []}, indent=2) + "\n")
        return results
    print(f"napkin gpu_check sanitizer: {binary} on {describe_cases(cases)} (every row checked, no timing)", flush=True)
    started = time.perf_counter()
    for index, tool in enumerate(SANITIZER_TOOLS):
        remaining = deadline_s - (time.perf_counter() - started)
        last = index == len(SANITIZER_TOOLS) - 1
        if remaining < 10:
            result = {"tool": tool, "status": "SKIPPED", "summary": f"the {deadline_s:.0f} s deadline is near",
                      "returncode": None, "wall_s": 0.0, "rows": [], "tail": []}
        else:
            print(f"[sanitizer] {tool} ...", file=sys.stderr, flush=True)
            wrapper = (binary, "--tool", tool, "--error-exitcode", str(SANITIZER_ERROR_EXIT))
            child = spawn(cases, args, remaining if last else remaining / 2, timing_budget=0.0, check_only=True,
                          wrapper=wrapper)
            status, summary = sanitizer_verdict(tool, child.returncode, child.output, child.rows, len(cases))
            tail = [line for line in child.output.rstrip().splitlines() if line.strip()][-8:]
            result = {"tool": tool, "status": status, "summary": summary, "returncode": child.returncode,
                      "wall_s": round(child.wall_s, 1), "rows": [r.to_json() for r in child.rows], "tail": tail}
            if out:
                out.mkdir(parents=True, exist_ok=True)
                write_text_atomically(out / f"sanitizer_{tool}.log", child.output)
        results.append(result)
        print(f"{tool}: {result['status']}: {result['summary']} ({result['wall_s']:.1f} s)", flush=True)
        for line in result["tail"]:
            print(f"  | {line[:200]}", flush=True)
        if out:
            write_text_atomically(out / "gpu_sanitizer.json", json.dumps(
                {"sanitizer": binary, "cases": [asdict(c) for c in cases], "results": results}, indent=2, default=str) + "\n")
    return results


def dry_run_sanitizer(args) -> None:
    """What --sanitizer would run, and the small cases compiled (their paths)."""
    binary = find_sanitizer()
    rows = [dry_run_case(c, args.arch, args.profile or DEFAULT_PROFILE) for c in sanitizer_cases()]
    where = binary or "compute-sanitizer not found (it would say so and fail nothing)"
    print(f"napkin gpu_check sanitizer: dry run, nothing launched; {where}")
    for row in rows:
        print(f"{row.kernel} " + " ".join(f"{k}={v}" for k, v in row.sizes.items())
              + f": {row.path_text or '?'}: {row.status}" + (f": {row.error}" if row.error else ""))
    print(f"would run: {', '.join(SANITIZER_TOOLS)} on one child each (check only)")


# ---- main ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="compile everything, launch nothing (no GPU needed)")
    parser.add_argument("--arch", help="architecture for --dry-run (default: the profile's, sm_90a on H200)")
    parser.add_argument("--profile", help="napkin hardware profile (default: from the device name; H200 for --dry-run)")
    parser.add_argument("--cases", help=f"comma-separated subset of: {', '.join(c.label for c in CASES)}")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for the table (default 285)")
    parser.add_argument("--case-timeout", type=float, default=CASE_TIMEOUT_S, help="seconds for one example (default 110)")
    parser.add_argument("--timing-budget", type=float, default=TIMING_BUDGET_S, help="GPU seconds to time one kernel (default 20)")
    parser.add_argument("--json", type=Path, help="also write the table as JSON here (default: $OUT/gpu_check.json when $OUT is set)")
    parser.add_argument("--sweep", action="store_true",
                        help="then time attention over sequence lengths and matmul over sizes, predicted vs measured")
    parser.add_argument("--sweep-deadline", type=float, default=SWEEP_DEADLINE_S, help="seconds for the sweep (default 180)")
    parser.add_argument("--sweep-timing-budget", type=float, default=SWEEP_TIMING_BUDGET_S,
                        help="GPU seconds to time one sweep point (default 3)")
    parser.add_argument("--sanitizer", action="store_true",
                        help="then run compute-sanitizer memcheck and racecheck on attention and matmul at small sizes")
    parser.add_argument("--sanitizer-deadline", type=float, default=SANITIZER_DEADLINE_S,
                        help="seconds for both sanitizer tools (default 60)")
    parser.add_argument("--small", action="store_true", help=argparse.SUPPRESS)  # small sizes, check only
    parser.add_argument("--child", help=argparse.SUPPRESS)  # JSON list of cases to run in this process
    parser.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--row-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:  # cases in this process; the parent reads the row file, rewritten after every case
        rows = []
        for data in json.loads(args.child):
            rows.append(gpu_case(Case(**data), args.profile, args.timing_budget, check_only=args.check_only))
            write_text_atomically(args.row_json, json.dumps({"rows": [r.to_json() for r in rows]}, default=str))
        return 0

    started = time.perf_counter()
    cases = selected_cases(args.cases)
    if args.small:
        cases = [small_case(c) for c in cases]
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    json_path = args.json or (out / "gpu_check.json" if out else None)
    sweep_path = out / "gpu_sweep.json" if out else None
    rows: list[Row] = []
    sweep_rows: list[Row] = []
    sanitized: list[dict] = []

    if args.dry_run:
        for case in cases:
            rows.append(dry_run_case(case, args.arch, args.profile or DEFAULT_PROFILE))
        print(header(rows, True))
        print(format_table(rows))
        print(f"total {time.perf_counter() - started:.1f} s")
        if json_path:
            write_json(rows, True, json_path)
        if args.sanitizer:
            print()
            dry_run_sanitizer(args)
        if args.sweep:
            sweep_started = time.perf_counter()
            for case in sweep_cases():
                sweep_rows.append(dry_run_case(case, args.arch, args.profile or DEFAULT_PROFILE))
            print()
            print(sweep_header(sweep_rows, True))
            print(format_table(sweep_rows, SWEEP_COLUMNS))
            print(f"sweep {time.perf_counter() - sweep_started:.1f} s")
            if sweep_path:
                write_json(sweep_rows, True, sweep_path, SWEEP_COLUMNS, sweep_extra())
        return 1 if any(r.status in FAILING for r in rows + sweep_rows) else 0

    from napkin_dsl.backends.driver import _probe, cuda_available

    if not cuda_available():
        print(f"no CUDA GPU: {_probe()[1]}. Use --dry-run to compile without one.", file=sys.stderr)
        return 2

    phase = {"now": "table"}

    def report_partial():
        print(f"gpu_check: a deadline passed during the {phase['now']}; partial results:", file=sys.stderr)
        if phase["now"] == "table":
            print(header(rows, False))
            print(format_table(rows))
            if json_path:
                write_json(rows, False, json_path)
        elif phase["now"] == "sweep":
            print(sweep_header(sweep_rows, False))
            print(format_table(sweep_rows, SWEEP_COLUMNS))
            if sweep_path:
                write_json(sweep_rows, False, sweep_path, SWEEP_COLUMNS, sweep_extra())
        sys.stdout.flush()

    total_s = args.deadline + (args.sanitizer_deadline if args.sanitizer else 0) + (args.sweep_deadline if args.sweep else 0)
    start_watchdog(total_s + 10, report_partial)

    def table_row_done():
        if json_path:
            write_json(rows, False, json_path)

    run_cases(cases, args, rows, deadline_s=args.deadline, timing_budget=args.timing_budget, check_only=args.small,
              on_row=table_row_done)
    print(header(rows, False))
    print(format_table(rows))
    print(f"total {time.perf_counter() - started:.1f} s", flush=True)
    if json_path:
        write_json(rows, False, json_path)

    if args.sanitizer:
        phase["now"] = "sanitizer"
        print()
        sanitized = run_sanitizer(args, out, args.sanitizer_deadline)

    if args.sweep:
        phase["now"] = "sweep"
        sweep_started = time.perf_counter()

        def sweep_row_done():
            if sweep_path:
                write_json(sweep_rows, False, sweep_path, SWEEP_COLUMNS, sweep_extra())

        run_cases(sweep_cases(), args, sweep_rows, deadline_s=args.sweep_deadline, timing_budget=args.sweep_timing_budget,
                  least_s=15.0, name="sweep: ", reuse=None if args.small else reuse_from(rows), on_row=sweep_row_done)
        print()
        print(sweep_header(sweep_rows, False))
        print(format_table(sweep_rows, SWEEP_COLUMNS))
        print(sweep_summary(sweep_rows))
        print(f"sweep {time.perf_counter() - sweep_started:.1f} s; all {time.perf_counter() - started:.1f} s", flush=True)
        sweep_row_done()

    failed = any(r.status in FAILING for r in rows + sweep_rows) or any(s["status"] in ("FAIL", "TIMEOUT") for s in sanitized)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
