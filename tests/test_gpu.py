"""scripts/gpu_check.py and the CUDA backend on a GPU.

Without a GPU (CI): ``gpu_check.py --dry-run`` compiles every runnable example and prints its
table; the reference check on sampled rows passes on correct outputs and catches a wrong one;
and the per-example GPU flow (``gpu_case``: compile, ``cuda.run``, reference check, device
buffers, event timing, the timed runs' output against ``run``'s) runs end to end with a stand-in
device and stand-in driver events, the kernels' values coming from the NumPy backend. What that
cannot show (the launches themselves, real events, torch) is what the ``gpu`` tests show.

With a GPU (marked ``gpu``, skipped without one): examples through
``napkin_dsl.backends.cuda.run`` against the float64 reference, and ``gpu_case`` for real at
small sizes.

Not here: the timings' values (the script reports them; nothing asserts a speed).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
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


def test_dry_run_compiles_every_example_and_prints_one_table(tmp_path):
    environment = dict(os.environ, OUT=str(tmp_path))
    finished = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True,
                              cwd=tmp_path, env=environment, timeout=300, check=False)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    lines = finished.stdout.splitlines()
    assert lines[0].startswith("napkin gpu_check: dry run") and "sm_90" in lines[0] and "H200" in lines[0]
    assert lines[1].split()[:2] == ["kernel", "sizes"]
    body = lines[3:3 + len(gpu_check.CASES)]
    assert [line.split()[0] for line in body] == [c.label for c in gpu_check.CASES]
    assert all(line.rstrip().endswith("compiled") for line in body)
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["dry_run"] is True and data["ok"] is True
    for row in data["rows"]:
        assert row["status"] == "compiled"
        assert row["predicted_s"] > 0 and row["flops"] > 0 and row["launches"]
        assert row["measured_s"] is None and row["torch_s"] is None and row["max_error"] is None
        assert all(launch["spill_bytes"] == 0 for launch in row["launches"])


def test_no_runnable_example_is_left_out():
    """Every example file's kernels are cases, except the opaque-box figures."""
    covered = {(c.path, c.kernel) for c in gpu_check.CASES}
    for path in sorted((ROOT / "examples").rglob("*.napkin")):
        relative = str(path.relative_to(ROOT / "examples"))
        for name, kernel in napkin.load(path).items():
            opaque = any(type(s.box).__name__ == "Opaque" for s in kernel.diagram.statements)
            assert opaque or (relative, name) in covered, f"{relative}:{name} is not checked by gpu_check.py"


def test_without_a_gpu_the_script_says_so_and_exits_2():
    if driver.cuda_available():
        pytest.skip("this machine has a CUDA GPU")
    finished = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, check=False)
    assert finished.returncode == 2
    assert "no CUDA GPU" in finished.stderr and "--dry-run" in finished.stderr


@pytest.mark.parametrize("case", gpu_check.CASES, ids=lambda c: c.label)
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
    compiled = kernel.compile("sm_90", hardware="H200", **case.sizes)
    writes = {}
    for k in compiled.launches:
        writes[k.entry] = {i: outputs[name] for i, (name, _, _) in enumerate(k.arrays) if name in outputs}
    monkeypatch.setattr(_StandInDevice, "writes", writes)
    monkeypatch.setattr(driver, "Device", _StandInDevice)
    monkeypatch.setattr(cuda, "run", lambda program, inputs, scalars: execute(program, inputs, scalars)[0])
    real_timer = gpu_check.EventTimer
    monkeypatch.setattr(gpu_check, "EventTimer", lambda device, handle=0: real_timer(device, handle, driver=_StandInDriver()))

    row = gpu_check.gpu_case(case, None, timing_budget_s=0.5)
    assert row.status == "pass", (row.error, row.notes)
    assert row.profile == "H200" and row.arch == "sm_90"
    assert row.measured_s is not None and row.measured_s >= 0 and row.runs >= gpu_check.FEWEST_RUNS
    assert row.max_error <= row.tolerance and row.predicted_s > 0
    assert len(row.launches) == len(compiled.launches)
    table = gpu_check.format_table([row])
    assert label in table and "pass" in table
    again = gpu_check.Row.from_json(json.loads(json.dumps(row.to_json())))
    assert again.cells() == row.cells()

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
    profile, how = gpu_check.profile_for("NVIDIA L4", "sm_89")
    assert profile == "A100" and "no profile" in how


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
