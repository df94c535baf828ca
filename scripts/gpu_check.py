#!/usr/bin/env python3
"""The one script to run on a machine with an NVIDIA GPU: every runnable example, checked and timed.

    python scripts/gpu_check.py                  # on the GPU machine; about 2-4 minutes
    python scripts/gpu_check.py --dry-run        # anywhere: compile everything for sm_90, no GPU needed
    python scripts/gpu_check.py --cases attention,matmul

For every example except those with opaque boxes (examples/paper/fig11, fig12), at realistic
sizes (:data:`CASES`), it

1. compiles the kernel with ``Kernel.compile`` for the GPU's architecture and the napkin
   profile of the GPU (H200, H100 or A100, from the device name);
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
6. prints one table: predicted time (the cost report of the compiled Program on the GPU's
   profile, ``CompiledKernel.cost``), measured time, TFLOP/s (the report's FLOPs / measured),
   GB/s (the report's device-memory bytes / measured), torch's time and the ratio
   napkin / torch, the error and pass/fail. With ``$OUT`` set the table is also written to
   ``$OUT/gpu_check.json``.

Each example runs in a child process with a timeout, so one that crashes, hangs or leaves the
CUDA context broken (an illegal address is sticky) costs only its own row. The whole run is
held to ``--deadline`` seconds (default 285); examples left when it runs out are reported as
skipped. The exit status is 1 when any row failed its check, errored, timed out or was
skipped, 2 when there is no GPU, 0 otherwise.

``--dry-run`` does everything that needs no GPU, on any machine: it loads and compiles every
example for sm_90 (``--arch``) with the H200 profile (``--profile``), validates the row
sampling, and prints the table with the measured columns empty.

Deliberately not here: tuning or choosing relabellings (the examples' relabel blocks, or the
tuner through ``Kernel.gpu_program``, decide), L2 flushing between timed runs (each
example's data is a few times the L2 or more), profiler counters, kernels with opaque boxes,
and any assertion about speed: the table reports, people judge.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # napkin is the working tree: run without installing

import numpy as np

EXAMPLES = ROOT / "examples"
SEED = 20240601
DEFAULT_ARCH = "sm_90"
DEFAULT_PROFILE = "H200"
DEADLINE_S = 285.0  # the whole run, parent included; the brief allows five minutes
CASE_TIMEOUT_S = 110.0  # one example's child process, at most
TIMING_BUDGET_S = 20.0  # GPU time spent timing one kernel (napkin's; torch's gets a third of it)
MIN_RUNS = 20
MAX_RUNS = 200
FEWEST_RUNS = 5  # when 20 runs of a slow kernel would not fit the budget
REFERENCE_MEMORY_LIMIT = 16 << 30
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


CASES: list[Case] = [
    Case("attention", "attention.napkin", "attention", {"b": 4, "h": 16, "q": 4096, "x": 4096, "d": 128},
         {"b": 2, "q": 32}, "sdpa"),
    # h = kv r = 16 query heads sharing 4 key/value heads
    Case("gqa", "gqa.napkin", "gqa", {"b": 4, "kv": 4, "r": 4, "q": 4096, "x": 4096, "d": 128},
         {"b": 2, "q": 32}, "sdpa_gqa"),
    Case("matmul", "matmul.napkin", "matmul", {"m": 4096, "k": 4096, "n": 4096}, {"m": 64}, "matmul"),
    Case("mlp", "mlp.napkin", "mlp", {"b": 8192, "k": 4096, "n": 4096}, {"b": 64}, "mlp"),
    # group r 16 keeps 16 whole f32 rows in shared memory: c = 2048 is 128 KiB of the 227
    Case("softmax", "softmax.napkin", "softmax_rows", {"r": 32768, "c": 2048}, {"r": 128}, "softmax"),
    Case("rmsnorm", "rmsnorm.napkin", "rmsnorm", {"t": 8192, "d": 4096}, {"t": 256}, "rmsnorm", {"eps": 1e-6}),
    # No relabel block: the tuner's. It never streams x here, so x = 1024 is about the largest that fits.
    Case("attention_unfused", "attention_unfused.napkin", "attention_unfused", {"q": 16384, "x": 1024, "d": 128},
         {"q": 128}, "unfused_attention"),
    Case("fig9", "paper/fig9.napkin", "fig9", {"q": 16384, "x": 1024, "d": 128}, {"q": 128}, "softmax_matmul"),
]

COLUMNS = [
    # (header, key, alignment)
    ("kernel", "kernel", "<"),
    ("sizes", "sizes_text", "<"),
    ("launch", "launch_text", ">"),
    ("regs", "registers_text", ">"),
    ("smem KiB", "smem_text", ">"),
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

    def to_json(self) -> dict:
        data = asdict(self)
        data.update(tflops=self.tflops, gbps=self.gbps, ratio_to_torch=self.ratio)
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
            "registers_text": "/".join(str(k.get("registers")) for k in self.launches),
            "smem_text": "/".join(f"{(k.get('shared_bytes') or 0) / 1024:.0f}" for k in self.launches),
            "predicted_text": format_seconds(self.predicted_s),
            "measured_text": format_seconds(self.measured_s),
            "runs_text": "" if self.runs is None else str(self.runs),
            "tflops_text": "" if self.tflops is None else f"{self.tflops:.1f}",
            "gbps_text": "" if self.gbps is None else f"{self.gbps:.0f}",
            "torch_text": format_seconds(self.torch_s),
            "ratio_text": "" if self.ratio is None else f"{self.ratio:.2f}",
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


def format_table(rows: list[Row]) -> str:
    """The table: a header line, one line per row, then each row's error or notes."""
    cells = [row.cells() for row in rows]
    widths = [max([len(header)] + [len(c[key]) for c in cells]) for header, key, _ in COLUMNS]
    lines = ["  ".join(f"{header:{align}{w}}" for (header, _, align), w in zip(COLUMNS, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for c in cells:
        lines.append("  ".join(f"{c[key]:{align}{w}}" for (_, key, align), w in zip(COLUMNS, widths)).rstrip())
    for row in rows:
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
    return kernels[case.kernel]


def check_sample_axes(kernel, case: Case) -> None:
    """Refuse a sample axis on which slicing would change the answer.

    Slicing inputs along an axis and evaluating the reference on the slices equals slicing
    the full result only when every statement is woven over the axis (nothing contracts,
    reduces or softmaxes along it) and every output carries it.
    """
    diagram = kernel.diagram
    for axis in case.sample:
        if axis not in diagram.axes:
            raise ValueError(f"{case.label}: sample axis {axis!r} is not an axis of {diagram.name}")
        across = [s.target for s in diagram.statements if axis not in s.woven]
        if across:
            raise ValueError(f"{case.label}: cannot check a subset of {axis!r}: {', '.join(across)} is not woven over it")
        missing = [name for name in diagram.outputs if axis not in diagram.arrays[name].axes]
        if missing:
            raise ValueError(f"{case.label}: output {', '.join(missing)} does not carry sample axis {axis!r}")


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
    """Fill a row's compile-time fields from a CompiledKernel."""
    report = compiled.cost
    row.launches = compiled.launch_table()
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


def dry_run_case(case: Case, arch: str, profile: str) -> Row:
    row = Row(case.label, dict(case.sizes), arch=arch, profile=profile, device="(dry run)")
    started = time.perf_counter()
    try:
        kernel = load_case(case)
        check_sample_axes(kernel, case)
        compiled = kernel.compile(arch, hardware=profile, **case.sizes)
        describe_compiled(row, compiled)
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
    upper = device_name.upper()
    for name in ("H200", "H100", "A100"):
        if name in upper:
            return name, "by device name"
    guess = "A100" if arch.startswith("sm_8") else "H100"
    return guess, f"no profile for {device_name!r}: using {guess} (closest by architecture {arch})"


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


def _torch_matmul(torch, t, sizes, scalars):
    return lambda: torch.matmul(t["A"], t["B"])


def _torch_mlp(torch, t, sizes, scalars):
    functional = torch.nn.functional
    return lambda: functional.gelu(torch.addmm(t["bias"], t["X"], t["W"]))


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
    "matmul": ("torch.matmul (bf16 out)", _torch_matmul),
    "mlp": ("F.gelu(torch.addmm)", _torch_mlp),
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


def gpu_case(case: Case, profile_override: str | None, timing_budget_s: float) -> Row:
    """Compile, run, check and time one case on the GPU; never raises."""
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
        compiled = kernel.compile(device.arch, hardware=row.profile, **case.sizes)
        program = kernel.gpu_program(row.profile, **case.sizes)
        describe_compiled(row, compiled)
        diagram = kernel.diagram
        inputs = random_inputs(diagram, case.sizes)
        scalars = dict(case.scalars)

        # correctness, through the backend's own run()
        outputs = cuda.run(program, inputs, scalars)
        indices = sample_indices(case)
        row.checked = {a: len(i) for a, i in indices.items()}
        row.max_error, row.tolerance = compare_with_reference(kernel, program, inputs, scalars, outputs, indices)
        passed = row.max_error <= row.tolerance

        # timing, on buffers allocated once
        launches = NapkinLaunches(device, compiled, inputs, scalars, stream=None)
        timer = EventTimer(device, 0)
        row.measured_s, row.runs = timer.time(launches.enqueue, timing_budget_s)
        for name in diagram.outputs:
            again = launches.output(name)
            if not np.array_equal(again.view(np.uint8), np.ascontiguousarray(outputs[name]).view(np.uint8)):
                passed = False
                row.notes.append(f"{name} differs between run() and the timed launches: a race or uninitialised read")
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


def run_child(case: Case, args, timeout_s: float) -> Row:
    """Run one case in a child process; a crash or a hang becomes the row's status."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as directory:
        row_file = Path(directory) / "row.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--child", case.label, "--row-json", str(row_file),
                   "--timing-budget", str(args.timing_budget)]
        if args.profile:
            command += ["--profile", args.profile]
        started = time.perf_counter()
        try:
            finished = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        except subprocess.TimeoutExpired as expired:
            row = Row(case.label, dict(case.sizes), status="TIMEOUT",
                      error=f"no result within {timeout_s:.0f} s (child killed)")
            tail = (expired.stderr or b"")[-400:] if isinstance(expired.stderr, bytes) else (expired.stderr or "")[-400:]
            if tail:
                row.notes.append("child stderr: " + " | ".join(str(tail).strip().splitlines()[-3:]))
            row.wall_s = time.perf_counter() - started
            return row
        if row_file.exists():
            return Row.from_json(json.loads(row_file.read_text()))
        tail = (finished.stderr or finished.stdout or "").strip().splitlines()[-5:]
        return Row(case.label, dict(case.sizes), status="ERROR",
                   error=f"child exited with status {finished.returncode} and no result: " + " | ".join(tail),
                   wall_s=time.perf_counter() - started)


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
    where = "dry run: compiled only, nothing launched" if dry_run else (first.device if first else "?")
    text = f"napkin gpu_check: {where}; arch {first.arch if first else '?'}; profile {first.profile if first else '?'}"
    return text + (f"; {', '.join(versions)}" if versions else "")


def write_json(rows: list[Row], dry_run: bool, path: Path) -> None:
    data = {
        "dry_run": dry_run,
        "ok": not any(r.status in FAILING for r in rows),
        "header": header(rows, dry_run),
        "columns": {header_: key for header_, key, _ in COLUMNS},
        "rows": [r.to_json() for r in rows],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


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
            on_expiry()
        finally:
            os._exit(3)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="compile everything, launch nothing (no GPU needed)")
    parser.add_argument("--arch", default=DEFAULT_ARCH, help="architecture for --dry-run (default sm_90)")
    parser.add_argument("--profile", help="napkin hardware profile (default: from the device name; H200 for --dry-run)")
    parser.add_argument("--cases", help=f"comma-separated subset of: {', '.join(c.label for c in CASES)}")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for the whole run (default 285)")
    parser.add_argument("--case-timeout", type=float, default=CASE_TIMEOUT_S, help="seconds for one example (default 110)")
    parser.add_argument("--timing-budget", type=float, default=TIMING_BUDGET_S, help="GPU seconds to time one kernel (default 20)")
    parser.add_argument("--json", type=Path, help="also write the table as JSON here (default: $OUT/gpu_check.json when $OUT is set)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--row-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:  # one case, in its own process; the parent reads the row file
        case = selected_cases(args.child)[0]
        row = gpu_case(case, args.profile, args.timing_budget)
        args.row_json.write_text(json.dumps(row.to_json(), default=str))
        return 0

    started = time.perf_counter()
    cases = selected_cases(args.cases)
    json_path = args.json or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else None)
    rows: list[Row] = []

    if args.dry_run:
        for case in cases:
            rows.append(dry_run_case(case, args.arch, args.profile or DEFAULT_PROFILE))
    else:
        from napkin_dsl.backends.driver import _probe, cuda_available

        if not cuda_available():
            print(f"no CUDA GPU: {_probe()[1]}. Use --dry-run to compile without one.", file=sys.stderr)
            return 2

        def report_partial():
            print(f"gpu_check: the {args.deadline:.0f} s deadline passed; partial table:", file=sys.stderr)
            print(header(rows, False))
            print(format_table(rows))
            if json_path:
                write_json(rows, False, json_path)

        start_watchdog(args.deadline + 10, report_partial)
        for index, case in enumerate(cases, 1):
            remaining = args.deadline - (time.perf_counter() - started)
            if remaining < 20:
                rows.append(Row(case.label, dict(case.sizes), status="SKIPPED", error=f"the {args.deadline:.0f} s deadline is near"))
                continue
            print(f"[{index}/{len(cases)}] {case.label} ...", file=sys.stderr, flush=True)
            case_started = time.perf_counter()
            row = run_child(case, args, min(args.case_timeout, remaining - 5))
            row.wall_s = time.perf_counter() - case_started
            rows.append(row)
            print(f"[{index}/{len(cases)}] {case.label}: {row.status} in {row.wall_s or 0:.1f} s", file=sys.stderr, flush=True)

    print(header(rows, args.dry_run))
    print(format_table(rows))
    print(f"total {time.perf_counter() - started:.1f} s")
    if json_path:
        write_json(rows, args.dry_run, json_path)
    return 1 if any(r.status in FAILING for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
