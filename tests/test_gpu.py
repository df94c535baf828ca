"""scripts/gpu_check.py and the CUDA backend on a GPU.

Without a GPU (CI): ``gpu_check.py --dry-run --sweep`` compiles every runnable example and
every sweep point and prints both tables (the path, bound and instr/HMMA columns filled, attention
and matmul on wgmma for the H200 profile's sm_90a, on mma.sync for sm_90); the sweep points and the sanitizer's small cases are valid cases (the
small ones on the tensor-core path); the reference check on sampled rows passes on correct
outputs and catches a wrong one; the per-example GPU flow (``gpu_case``: compile, ``cuda.run``,
reference check, device buffers, event timing, the timed runs' output against ``run``'s, and
its check-only form) runs end to end with a stand-in device and stand-in driver events, the
kernels' values coming from the NumPy backend; the sanitizer's verdicts on the tools' summary
lines, its plumbing with a stand-in compute-sanitizer, and its absence (said, not failed). What
that cannot show (the launches themselves, real events, torch, the real sanitizer) is what the
``gpu`` tests and the script on a GPU show.

With a GPU (marked ``gpu``, skipped without one): examples through
``napkin_dsl.backends.cuda.run`` against the float64 reference, and ``gpu_case`` for real at
small sizes (timed, and check-only on the sanitizer's sizes).

Not here: the timings' values (the script reports them; nothing asserts a speed).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import driver
from napkin_dsl.backends.driver import DeviceBuffer
from napkin_dsl.backends.numpy import default_sizes, execute, tolerance
from napkin_dsl.reference import evaluate

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", module)
    spec.loader.exec_module(module)
    return module


gpu_check = _load_script()


def small(case):
    """The case at check-run sizes: two tiles per partitioned axis, the second a masked tail."""
    kernel = gpu_check.load_case(case)
    sizes = {a: v for a, v in default_sizes(kernel).items() if a in kernel.diagram.axes}
    return replace(case, sizes=sizes)


# ---- without a GPU ----------------------------------------------------------------------------------


def _has_nvdisasm() -> bool:
    from napkin_dsl.backends import sass

    try:
        sass.find_nvdisasm()
    except sass.NoDisassembler:
        return False
    return True


def _column(header_line: str, line: str, name: str) -> str:
    """The first word of a left-aligned column's cell."""
    words = line[header_line.index(name):].split()
    return words[0] if words else ""


def test_dry_run_compiles_every_example_and_prints_one_table(tmp_path):
    environment = dict(os.environ, OUT=str(tmp_path))
    finished = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--sweep"], capture_output=True, text=True,
                              cwd=tmp_path, env=environment, timeout=300, check=False)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    lines = finished.stdout.splitlines()
    assert lines[0].startswith("napkin gpu_check: dry run") and "arch sm_90a;" in lines[0] and "H200" in lines[0]
    assert lines[1].split()[:2] == ["kernel", "sizes"]
    body = lines[3:3 + len(gpu_check.CASES)]
    assert [line.split()[0] for line in body] == [c.label for c in gpu_check.CASES]
    assert all(line.rstrip().endswith("compiled") for line in body)
    by_label = dict(zip([c.label for c in gpu_check.CASES], body, strict=False))
    for label, path in (("attention", "wgmma"), ("matmul", "wgmma"), ("attention_sm90", "mma.sync"), ("matmul_sm90", "mma.sync")):
        assert _column(lines[1], by_label[label], "path") == path, by_label[label]
        assert _column(lines[1], by_label[label], "bound")
    for label in ("attention", "attention_sm90"):
        assert "b=4 h=32 q=8192 x=8192 d=128" in by_label[label]  # the headline sizes
    for label in ("matmul", "matmul_sm90"):
        assert "m=8192 k=8192 n=8192" in by_label[label]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["dry_run"] is True and data["ok"] is True
    for row in data["rows"]:
        assert row["status"] == "compiled"
        assert row["predicted_s"] > 0 and row["flops"] > 0 and row["launches"]
        assert row["measured_s"] is None and row["torch_s"] is None and row["max_error"] is None
        assert all(launch["spill_bytes"] == 0 for launch in row["launches"])
        assert len(row["paths"]) == len(row["launches"]) and row["bound"]
        assert all(p["path"] in ("mma.sync", "wgmma", "fma") and (p["path"] != "fma") == (p["reason"] == "") for p in row["paths"])
    rows = {row["kernel"]: row for row in data["rows"]}
    # The H200 profile's default, sm_90a, where matmul and attention take wgmma; sm_90 builds mma.sync.
    for label in ("attention", "matmul", "matmul_sm90a_ragged"):
        assert rows[label]["arch"] == "sm_90a" and [p["path"] for p in rows[label]["paths"]] == ["wgmma"], rows[label]
    for label in ("attention_sm90", "matmul_sm90"):
        assert rows[label]["arch"] == "sm_90" and [p["path"] for p in rows[label]["paths"]] == ["mma.sync"], rows[label]
    if _has_nvdisasm():  # static hot-loop instructions per HMMA: a number on the tensor-core path
        for label in ("attention", "attention_sm90"):
            assert rows[label]["instr_per_tensor"][0] > 1 and rows[label]["sass"] == "", rows[label]
    else:
        assert rows["attention"]["instr_per_tensor"] == [] and "nvdisasm" in rows["attention"]["sass"]

    # the sweep: its own header and table, one row per point, compiled, without timings
    points = gpu_check.sweep_cases()
    start = next(i for i, line in enumerate(lines) if line.startswith("napkin gpu_check sweep: dry run"))
    assert lines[start + 1].split()[:2] == ["kernel", "sizes"] and "meas/pred" in lines[start + 1]
    sweep_body = lines[start + 3:start + 3 + len(points)]
    for case, line in zip(points, sweep_body, strict=True):
        assert line.startswith(case.label + " ") and " ".join(f"{k}={v}" for k, v in case.sizes.items()) in line
        assert _column(lines[start + 1], line, "path") == sweep_path(case), line
        assert line.rstrip().endswith("compiled")
        assert line[lines[start + 1].index("measured"):].split()[0] == "compiled"  # measured, meas/pred, torch: empty
    sweep = json.loads((tmp_path / "gpu_sweep.json").read_text())
    assert sweep["dry_run"] is True and len(sweep["rows"]) == len(points)
    assert sweep["sweep"]["attention"]["sequences"] == [512, 1024, 2048, 4096, 8192, 16384]
    for row in sweep["rows"]:
        assert row["status"] == "compiled" and row["predicted_s"] > 0
        assert row["measured_s"] is None and row["measured_over_predicted"] is None and row["torch_s"] is None


def sweep_path(case) -> str:
    """The path of a sweep point on the H200 profile's sm_90a: wgmma, but mma.sync where wgmma
    declines (a relabelling that asks for warp tiles, which are mma.sync's): the relabelling
    of 32-row warps too, within the rolled budget (isel.ROLLED_FRAGMENT_BUDGET) on sm_90a. An m
    tile of 256 is four warpgroups, and mlp's bias and GELU run on the accumulator: wgmma."""
    relabel = case.relabel or ""
    if "registers:" in relabel:
        return "mma.sync"
    return "wgmma"


def test_sweep_points_take_the_paths_the_dry_run_table_shows():
    """sweep_path against selection itself, with the reasons wgmma declines."""
    from napkin_dsl.isel import select_program

    declined = {"mma.sync": ("a relabelling asks for warp tiles",)}
    for case in gpu_check.sweep_cases():
        program = gpu_check.load_case(case).gpu_program("H200", **case.sizes)
        (chosen,) = select_program(program, "sm_90a").launches.values()
        assert chosen.path == sweep_path(case), (case.label, chosen.declined or chosen.reason)
        if chosen.path == "mma.sync":
            assert chosen.declined.startswith(declined["mma.sync"]), (case.label, chosen.declined)


def test_sweep_points():
    points = gpu_check.sweep_cases()
    attention = [c for c in points if c.label == "attention"]
    assert [c.sizes["q"] for c in attention] == [512, 1024, 2048, 4096, 8192, 16384]
    assert all(c.sizes["x"] == c.sizes["q"] and c.sizes["d"] == 128 and c.sizes["b"] == 1 for c in attention)
    assert {c.sizes["h"] * c.sizes["q"] for c in attention} == {32 * 8192}  # constant data, work grows with q
    assert [c.sizes for c in points if c.label == "matmul"] == [{"m": n, "k": n, "n": n} for n in (1024, 2048, 4096, 8192)]


@pytest.mark.parametrize("label", gpu_check.SANITIZER_CASES)
def test_the_sanitizers_small_cases_take_the_tensor_core_path_with_tails(label):
    from napkin_dsl.isel import selection

    case = next(c for c in gpu_check.sanitizer_cases() if c.label == label)
    assert case.sizes == gpu_check.SMALL_SIZES[label]
    assert all(case.sample[a] == case.sizes[a] for a in case.sample)  # every row checked
    arch = case.arch or "sm_90a"  # the H200 profile's own
    path = "wgmma" if arch == "sm_90a" else "mma.sync"
    compiled = gpu_check.load_case(case).compile(arch, hardware="H200", **case.sizes)
    assert [selection(compiled.program, k, arch).path for k in compiled.program.launches] == [path]
    row = gpu_check.dry_run_case(case, None, "H200")
    assert row.status == "compiled" and row.path_text == path and row.arch == arch


def test_a_sweep_point_the_table_measured_reuses_its_row():
    matmul = next(c for c in gpu_check.sweep_cases() if c.label == "matmul" and c.sizes["m"] == 8192)
    measured = gpu_check.Row("matmul", dict(matmul.sizes), status="pass", measured_s=0.003, predicted_s=0.002)
    reuse = gpu_check.reuse_from([measured, gpu_check.Row("attention", {"b": 1}, status="ERROR")])
    row = reuse(matmul)
    assert row is not None and row is not measured and row.measured_s == 0.003 and row.over_predicted == pytest.approx(1.5)
    assert any("table" in note for note in row.notes) and not measured.notes
    assert reuse(replace(matmul, sizes={"m": 1024, "k": 1024, "n": 1024})) is None
    assert gpu_check.reuse_from([replace(measured, status="ERROR")])(matmul) is None


MEMCHECK_CLEAN = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"
MEMCHECK_DIRTY = ("========= COMPUTE-SANITIZER\n========= Invalid __global__ read of size 16 bytes\n"
                  "=========     at napkin_attention_0+0x1a0\n========= ERROR SUMMARY: 3 errors\n")
RACECHECK_WARNINGS = "========= RACECHECK SUMMARY: 2 hazards displayed (0 errors, 2 warnings)\n"
RACECHECK_ERRORS = "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n"


def _passed(label):
    return gpu_check.Row(label, {}, status="pass", paths=[{"entry": "e", "path": "mma.sync", "reason": ""}])


def test_sanitizer_verdicts():
    verdict = gpu_check.sanitizer_verdict
    two = [_passed("attention"), _passed("matmul")]
    status, summary = verdict("memcheck", 0, MEMCHECK_CLEAN, two, 2)
    assert status == "pass" and "0 errors" in summary and "attention mma.sync pass" in summary
    status, summary = verdict("memcheck", gpu_check.SANITIZER_ERROR_EXIT, MEMCHECK_DIRTY, two, 2)
    assert status == "FAIL" and "3 errors" in summary
    assert verdict("racecheck", 0, RACECHECK_WARNINGS, two, 2)[0] == "pass"  # warnings are shown, not failed
    assert "2 warnings" in verdict("racecheck", 0, RACECHECK_WARNINGS, two, 2)[1]
    assert verdict("racecheck", gpu_check.SANITIZER_ERROR_EXIT, RACECHECK_ERRORS, two, 2)[0] == "FAIL"
    assert verdict("memcheck", gpu_check.SANITIZER_ERROR_EXIT, "no summary", two, 2)[0] == "FAIL"
    assert verdict("memcheck", None, "", two[:1], 2)[0] == "TIMEOUT"
    status, summary = verdict("memcheck", 0, MEMCHECK_CLEAN, two[:1], 2)
    assert status == "FAIL" and "1 of 2 cases left no result" in summary
    wrong = replace(_passed("matmul"), status="FAIL", error="max error 0.5 over tolerance 0.01")
    status, summary = verdict("memcheck", 0, MEMCHECK_CLEAN, [two[0], wrong], 2)
    assert status == "FAIL" and "matmul FAIL (max error 0.5" in summary
    assert verdict("memcheck", 1, MEMCHECK_CLEAN, two, 2)[0] == "FAIL"


def _sanitizer_args():
    return argparse.Namespace(profile=None, case_timeout=60.0)


def test_without_compute_sanitizer_the_check_says_so_and_fails_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "find_sanitizer", lambda: None)
    assert gpu_check.run_sanitizer(_sanitizer_args(), tmp_path, 60.0) == []
    printed = capsys.readouterr().out
    assert "compute-sanitizer not found" in printed and "NOT run" in printed
    data = json.loads((tmp_path / "gpu_sanitizer.json").read_text())
    assert data["sanitizer"] is None and data["results"] == []


STAND_IN_SANITIZER = """#!/bin/sh
# compute-sanitizer's stand-in: note the options, run the command after them, print a summary
echo "$@" > "$0.args"
tool=memcheck
while [ "${1#--}" != "$1" ]; do
    if [ "$1" = --tool ]; then tool=$2; fi
    shift 2
done
echo "========= COMPUTE-SANITIZER"
"$@"
status=$?
if [ "$tool" = racecheck ]; then
    echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
else
    echo "========= ERROR SUMMARY: 0 errors"
fi
exit $status
"""


def test_the_sanitizer_runs_the_small_cases_in_one_child_per_tool(tmp_path, monkeypatch, capsys):
    tool = tmp_path / "compute-sanitizer"
    tool.write_text(STAND_IN_SANITIZER)
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(gpu_check, "find_sanitizer", lambda: str(tool))
    results = gpu_check.run_sanitizer(_sanitizer_args(), tmp_path / "out", 60.0)
    assert [r["tool"] for r in results] == ["memcheck", "racecheck"]
    arguments = (tmp_path / "compute-sanitizer.args").read_text()  # the last run's: racecheck
    assert arguments.startswith("--tool racecheck --error-exitcode") and "--child" in arguments and "--check-only" in arguments
    for result in results:
        assert [row["kernel"] for row in result["rows"]] == list(gpu_check.SANITIZER_CASES)
        assert all(row["sizes"] == gpu_check.SMALL_SIZES[row["kernel"]] for row in result["rows"])
        # Here the children find no GPU (their rows say so) and the verdict fails; on a GPU they pass.
        assert result["status"] == ("pass" if driver.cuda_available() else "FAIL"), result["summary"]
        assert (tmp_path / "out" / f"sanitizer_{result['tool']}.log").read_text().startswith("========= COMPUTE-SANITIZER")
    printed = capsys.readouterr().out
    assert f"sanitizer: {tool} on attention b=1 h=2 q=200 x=200 d=128, matmul m=200 k=104 n=200" in printed
    assert "\nmemcheck: " in printed and "\nracecheck: " in printed and "  | ========= ERROR SUMMARY: 0 errors" in printed
    data = json.loads((tmp_path / "out" / "gpu_sanitizer.json").read_text())
    assert data["sanitizer"] == str(tool) and len(data["results"]) == 2


def test_no_runnable_example_is_left_out():
    """Every example file's kernels are cases, except the opaque-box figures and the examples the
    printers refuse yet (tests/test_cuda_codegen.py holds each to its refusal)."""
    from .test_cuda_codegen import NOT_PRINTED

    covered = {(c.path, c.kernel) for c in gpu_check.CASES}
    for path in sorted((ROOT / "examples").rglob("*.napkin")):
        relative = str(path.relative_to(ROOT / "examples"))
        for name, kernel in napkin.load(path).items():
            opaque = any(type(s.box).__name__ == "Opaque" for s in kernel.diagram.statements)
            if relative in NOT_PRINTED:
                assert (relative, name) not in covered, f"{relative} is not printed yet: gpu_check.py cannot run it"
                continue
            assert opaque or (relative, name) in covered, f"{relative}:{name} is not checked by gpu_check.py"


def test_without_a_gpu_the_script_says_so_and_exits_2():
    if driver.cuda_available():
        pytest.skip("this machine has a CUDA GPU")
    finished = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, check=False)
    assert finished.returncode == 2
    assert "no CUDA GPU" in finished.stderr and "--dry-run" in finished.stderr


@pytest.mark.parametrize("case", gpu_check.CASES + gpu_check.sweep_cases() + gpu_check.sanitizer_cases(),
                         ids=lambda c: c.label + "-" + "-".join(str(v) for v in c.sizes.values()))
def test_sample_axes_are_woven_everywhere(case):
    gpu_check.check_sample_axes(gpu_check.load_case(case), case)
    indices = gpu_check.sample_indices(case)
    for axis, chosen in indices.items():
        assert chosen[0] == 0 and chosen[-1] == case.sizes[axis] - 1
        assert len(chosen) == min(case.sample[axis], case.sizes[axis]) and np.all(np.diff(chosen) > 0)


def test_a_consumed_axis_cannot_be_sampled():
    case = replace(gpu_check.CASES[0], sample={"x": 4})
    with pytest.raises(ValueError, match="not woven over"):
        gpu_check.check_sample_axes(gpu_check.load_case(case), case)


def _numpy_outputs(case):
    kernel = gpu_check.load_case(case)
    program = kernel.gpu_program("H200", **case.sizes)
    inputs = gpu_check.random_inputs(kernel.diagram, case.sizes)
    outputs, _ = execute(program, inputs, case.scalars)
    return kernel, program, inputs, outputs


@pytest.mark.parametrize("label", ["attention", "rmsnorm", "attention_unfused"])
def test_reference_on_sampled_rows_passes_a_right_output_and_fails_a_wrong_one(label):
    case = small(next(c for c in gpu_check.CASES if c.label == label))
    kernel, program, inputs, outputs = _numpy_outputs(case)
    assert all(np.all(v != 0) for v in inputs.values())
    indices = gpu_check.sample_indices(case)
    error, limit = gpu_check.compare_with_reference(kernel, program, inputs, case.scalars, outputs, indices)
    assert limit == tolerance(program) and error <= limit
    name = kernel.diagram.outputs[0]
    wrong = {name: outputs[name].copy()}
    wrong[name].reshape(-1)[-1] = wrong[name].reshape(-1)[-1] * 3 + 1  # the last row is always checked
    assert gpu_check.compare_with_reference(kernel, program, inputs, case.scalars, wrong, indices)[0] > limit
    wrong[name].reshape(-1)[-1] = np.nan
    assert gpu_check.compare_with_reference(kernel, program, inputs, case.scalars, wrong, indices)[0] == np.inf


@pytest.mark.parametrize("label", ["attention_backward", "attention_backward_deterministic"])
def test_a_backward_case_reads_its_forwards_outputs_and_its_check_catches_a_wrong_gradient(label):
    """O and L come from the forward run on the same Q, K and V (backward_inputs, here through the
    NumPy backend as cuda.run on a GPU), so exp(S - L) stays finite; the sampled reference check
    passes the NumPy backend's gradients and fails a wrong one."""
    case = next(c for c in gpu_check.CASES if c.label == label)
    case = replace(case, sizes=dict(b=2, h=3, q=150, x=131, d=128), sample={"b": 2, "h": 2})
    kernel = gpu_check.load_case(case)
    assert bool(kernel.derivation.schedule.summed) == case.grad["sum_dq"]
    inputs = gpu_check.random_inputs(kernel.diagram, case.sizes)
    inputs = gpu_check.backward_inputs(case, inputs, lambda program, arrays: execute(program, arrays, {})[0])
    forward = gpu_check.load_forward(case)
    want = evaluate(forward.diagram, {n: inputs[n] for n in ("Q", "K", "V")}, {}, {a: case.sizes[a] for a in forward.diagram.axes})
    assert np.abs(inputs["L"].astype(np.float64) - want["L"]).max() < 1e-3 * np.abs(want["L"]).max()
    program = kernel.gpu_program("H200", **case.sizes)
    outputs, _ = execute(program, inputs, {})
    indices = gpu_check.sample_indices(case)
    error, limit = gpu_check.compare_with_reference(kernel, program, inputs, {}, outputs, indices)
    assert error <= limit < 0.1, (error, limit)
    wrong = dict(outputs, dK=outputs["dK"].copy())
    wrong["dK"][-1, -1] = wrong["dK"][-1, -1] * 1.5  # the last head of the last batch is checked
    assert gpu_check.compare_with_reference(kernel, program, inputs, {}, wrong, indices)[0] > limit


class _Event:
    recorded = None


class _StandInDriver:
    """cuda.bindings.driver's event calls, timed with the host clock."""

    def __init__(self):
        from cuda.bindings import driver as real

        self.CUresult, self.CUevent_flags, self.CUstream = real.CUresult, real.CUevent_flags, real.CUstream
        self.ok = real.CUresult.CUDA_SUCCESS

    def cuEventCreate(self, flags):
        return self.ok, _Event()

    def cuEventRecord(self, event, stream):
        event.recorded = time.perf_counter()
        return (self.ok,)

    def cuEventElapsedTime(self, start, end):
        return self.ok, (end.recorded - start.recorded) * 1e3

    def cuStreamSynchronize(self, stream):
        return (self.ok,)

    def cuEventDestroy(self, event):
        return (self.ok,)


class _StandInDevice:
    """Device's interface over host memory; a launch writes the outputs it is told to write."""

    name = "NVIDIA H200 (stand-in)"
    arch = "sm_90"
    writes: ClassVar[dict] = {}  # entry -> {argument position: array}, set by the test

    def __init__(self, ordinal=0):
        self.memory: dict[int, bytearray] = {}
        self.addresses = itertools.count(4096, 4096)
        self.launched: list[str] = []

    def load(self, image):
        assert bytes(getattr(image, "image", image))[:4] == b"\x7fELF"
        return object()

    def function(self, module, name):
        return name

    def alloc(self, nbytes):
        buffer = DeviceBuffer(next(self.addresses), int(nbytes), None)
        self.memory[buffer.ptr] = bytearray(max(int(nbytes), 1))
        return buffer

    def to_device(self, array, stream=None):
        buffer = self.alloc(array.nbytes)
        self.memory[buffer.ptr][: array.nbytes] = np.ascontiguousarray(array).tobytes()
        return buffer

    def copy_to_host(self, buffer, out, stream=None):
        out.reshape(-1).view(np.uint8)[:] = np.frombuffer(bytes(self.memory[buffer.ptr][: out.nbytes]), np.uint8)
        return out

    def free(self, buffer):
        del self.memory[buffer.ptr]

    def launch(self, function, grid, block, args, shared_bytes=0, stream=None):
        self.launched.append(function)
        for position, value in self.writes.get(function, {}).items():
            self.memory[args[position].ptr][: value.nbytes] = np.ascontiguousarray(value).tobytes()

    def synchronize(self, stream=None):
        pass


@pytest.mark.parametrize("label", ["attention", "rmsnorm", "attention_unfused"])
def test_gpu_case_flow_with_a_stand_in_device(label, monkeypatch):
    """gpu_case end to end with the NumPy backend's values: a pass row with times and errors."""
    from napkin_dsl.backends import cuda

    case = small(next(c for c in gpu_check.CASES if c.label == label))
    kernel, _, _, outputs = _numpy_outputs(case)
    compiled = kernel.compile("sm_90a", hardware="H200", **case.sizes)  # what gpu_case compiles on an sm_90 GPU
    writes = {}
    for k in compiled.launches:
        writes[k.entry] = {i: outputs[name] for i, (name, _, _) in enumerate(k.arrays) if name in outputs}
    monkeypatch.setattr(_StandInDevice, "writes", writes)
    monkeypatch.setattr(driver, "Device", _StandInDevice)
    monkeypatch.setattr(cuda, "run", lambda program, inputs, scalars, arch=None: execute(program, inputs, scalars)[0])
    real_timer = gpu_check.EventTimer
    monkeypatch.setattr(gpu_check, "EventTimer", lambda device, handle=0: real_timer(device, handle, driver=_StandInDriver()))

    row = gpu_check.gpu_case(case, None, timing_budget_s=0.5)
    assert row.status == "pass", (row.error, row.notes)
    assert row.profile == "H200" and row.arch == "sm_90a"  # the profile's own on the stand-in's sm_90
    assert row.measured_s is not None and row.measured_s >= 0 and row.runs >= gpu_check.FEWEST_RUNS
    assert row.max_error <= row.tolerance and row.predicted_s > 0
    assert len(row.launches) == len(compiled.launches) == len(row.paths) and row.bound
    assert [p["entry"] for p in row.paths] == [k.entry for k in compiled.launches]
    assert len(row.instr_per_tensor) == len(compiled.launches) or "nvdisasm" in row.sass
    table = gpu_check.format_table([row])
    assert label in table and "pass" in table and row.path_text in table
    again = gpu_check.Row.from_json(json.loads(json.dumps(row.to_json())))
    assert again.cells() == row.cells()

    # Check only (--small, the sanitizer's child): the same check, nothing timed.
    checked = gpu_check.gpu_case(case, None, timing_budget_s=0.5, check_only=True)
    assert checked.status == "pass" and checked.max_error == row.max_error
    assert checked.measured_s is None and checked.runs is None and checked.torch_s is None
    assert checked.paths == row.paths

    # A timed run that writes nothing leaves the output buffer unwritten: the row fails.
    monkeypatch.setattr(_StandInDevice, "writes", {})
    row = gpu_check.gpu_case(case, None, timing_budget_s=0.5)
    assert row.status == "FAIL" and any("differs between run()" in note for note in row.notes)


def test_an_error_in_one_case_is_its_row(monkeypatch):
    class NoDevice:
        def __init__(self, ordinal=0):
            raise driver.NoCudaDevice("stand-in: no GPU")

    monkeypatch.setattr(driver, "Device", NoDevice)
    row = gpu_check.gpu_case(gpu_check.CASES[0], None, timing_budget_s=0.5)
    assert row.status == "ERROR" and "no CUDA GPU" in row.error
    assert "ERROR" in gpu_check.format_table([row])


def test_profile_by_device_name():
    assert gpu_check.profile_for("NVIDIA H200", "sm_90")[0] == "H200"
    assert gpu_check.profile_for("NVIDIA H100 80GB HBM3", "sm_90")[0] == "H100"
    assert gpu_check.profile_for("NVIDIA A100-SXM4-80GB", "sm_80")[0] == "A100"
    assert gpu_check.profile_for("NVIDIA L40S", "sm_89")[0] == "L40S"
    profile, how = gpu_check.profile_for("NVIDIA L4", "sm_89")  # Ada, no profile of its own: the L40S, by its arch
    assert profile == "L40S" and "no profile" in how
    profile, how = gpu_check.profile_for("NVIDIA A10", "sm_86")  # no profile runs sm_86: the newest of its major version
    assert profile == "A100" and "no profile" in how
    # A GPU no profile lists runs the cubin of its profile's newest arch of its major version.
    assert gpu_check.compile_arch("A100", "sm_89") == "sm_80"
    # The profile's own arch where the GPU runs it: sm_90a (wgmma, as the model prices it) on sm_90.
    assert gpu_check.compile_arch("H200", "sm_90") == "sm_90a"
    assert gpu_check.compile_arch("A100", "sm_80") == "sm_80"
    assert gpu_check.case_arch(next(c for c in gpu_check.CASES if c.label == "attention_sm90"), "H200", "sm_90") == "sm_90"
    assert gpu_check.compile_arch("H100", "sm_86") == "sm_80"


def test_a_gpu_of_an_architecture_no_profile_runs_is_refused_by_name():
    from napkin_dsl.errors import NapkinError

    with pytest.raises(NapkinError, match="no hardware profile runs 'sm_100'"):
        gpu_check.profile_for("NVIDIA B200", "sm_100")


# ---- with a GPU -------------------------------------------------------------------------------------



@pytest.mark.parametrize("example, name", [("attention.napkin", "attention"), ("rmsnorm.napkin", "rmsnorm"),
                                           ("attention_unfused.napkin", "attention_unfused")])
@pytest.mark.gpu
@pytest.mark.skipif(not driver.cuda_available(), reason="no CUDA GPU")
def test_cuda_run_matches_the_reference(example, name):
    from napkin_dsl.backends import cuda

    kernel = napkin.load(ROOT / "examples" / example)[name]
    sizes = {a: v for a, v in default_sizes(kernel).items() if a in kernel.diagram.axes}
    program = kernel.gpu_program(None, **sizes)
    inputs = gpu_check.random_inputs(kernel.diagram, sizes)
    scalars = {"eps": 1e-6} if "eps" in kernel.diagram.scalars else {}
    outputs = cuda.run(program, inputs, scalars)
    expected = evaluate(kernel.diagram, inputs, scalars, sizes, keep_float64=True)
    for output in kernel.diagram.outputs:
        got = outputs[output].astype(np.float64)
        assert got.shape == expected[output].shape and np.all(np.isfinite(got))
        error = np.max(np.abs(got - expected[output])) / np.max(np.abs(expected[output]))
        assert error <= tolerance(program), f"{name}: max relative error {error:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not driver.cuda_available(), reason="no CUDA GPU")
def test_gpu_case_on_the_gpu_at_small_sizes():
    case = small(next(c for c in gpu_check.CASES if c.label == "attention"))
    row = gpu_check.gpu_case(case, None, timing_budget_s=1.0)
    assert row.status == "pass", (row.error, row.notes)
    assert row.measured_s > 0 and row.runs >= gpu_check.MIN_RUNS


@pytest.mark.gpu
@pytest.mark.skipif(not driver.cuda_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("case", gpu_check.sanitizer_cases(), ids=lambda c: c.label)
def test_the_sanitizers_small_cases_on_the_gpu(case):
    row = gpu_check.gpu_case(case, None, timing_budget_s=1.0, check_only=True)
    assert row.status == "pass", (row.error, row.notes)
    assert row.path_text == ("wgmma" if row.arch == "sm_90a" else "mma.sync") and row.measured_s is None


def test_an_axis_whose_index_a_mask_reads_is_not_sampled():
    from dataclasses import replace

    causal = next(c for c in gpu_check.CASES if c.label == "causal_attention")
    with pytest.raises(ValueError, match="an expression reads its index"):
        gpu_check.check_sample_axes(gpu_check.load_case(causal), replace(causal, sample={"q": 32}))
