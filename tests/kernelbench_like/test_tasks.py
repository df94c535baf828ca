"""The corpus of PyTorch-module-style tasks (tasks.py): each napkin kernel against its module's
float64 forward on NumPy and OpenCL at ragged sizes, and tuned for H100 at realistic sizes."""

from __future__ import annotations

import math

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends.numpy import tolerance

torch = pytest.importorskip("torch")

from .tasks import TASKS, Task, weight, weight_name  # noqa: E402  (after the skip: tasks.py imports torch)

IDS = [task.name for task in TASKS]


def _kernel(task: Task) -> napkin.Kernel:
    (kernel,) = napkin.load(task.napkin).values()
    return kernel


def _arguments(task: Task, seed: int = 0) -> tuple[dict, list]:
    """The kernel's arguments by name (float32, int64) and the module's inputs (float64): the
    same values, the module's weights rounded to float32 first so that both read the same."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for parameter in task.module.parameters():
            parameter.copy_(parameter.float().double())
    arrays, inputs = {}, []
    for name, shape in task.shapes.items():
        if name in task.integers:
            value = rng.integers(0, task.integers[name], size=shape).astype(np.int64)
            inputs.append(torch.tensor(value))
        else:
            value = rng.standard_normal(shape).astype(np.float32)
            inputs.append(torch.tensor(value, dtype=torch.float64))
        arrays[name] = value
    for name in task.weights:
        arrays[weight_name(name)] = weight(task, name).detach().float().numpy()
    return arrays, inputs


def test_the_corpus_is_large_enough():
    assert len(TASKS) >= 30
    assert len(set(IDS)) == len(IDS)


@pytest.mark.parametrize("backend", ["numpy", "opencl"])
@pytest.mark.parametrize("task", TASKS, ids=IDS)
def test_task_matches_its_module(task, backend, request):
    if backend == "opencl":
        request.getfixturevalue("opencl_device")
    kernel = _kernel(task)
    arrays, inputs = _arguments(task)
    with torch.no_grad():
        want = task.module(*inputs).numpy()
    got = kernel(**arrays, backend=backend, sizes=task.sizes)
    assert got.size == want.size, f"{task.name}: {got.shape} against torch's {want.shape}"
    want = want.reshape(got.shape)  # a grouped convolution's [b (g o) p q] is the kernel's [b g o p q]
    if np.issubdtype(got.dtype, np.integer):
        assert np.array_equal(got, want)
        return
    # the tolerance napkin derives for the Program (the dtypes it rounds to, its reduction lengths)
    limit = tolerance(kernel.program(None, **{a: n for a, n in _sizes(kernel, arrays, task).items()}))
    scale = max(float(np.max(np.abs(want))), 1e-30)
    error = float(np.max(np.abs(got.astype(np.float64) - want)))
    assert error <= limit * scale, f"{task.name} on {backend}: max error {error:.3g}, {error / scale:.3g} of the largest value"


def _sizes(kernel: napkin.Kernel, arrays: dict, task: Task) -> dict:
    """Every axis's size at this call, as the binding reads them off the arrays."""
    return napkin.binding.bind(kernel, arrays, sizes=task.sizes).sizes


@pytest.mark.parametrize("task", TASKS, ids=IDS)
def test_task_tunes_for_h100(task):
    """The tuner finds a schedule at the task's realistic sizes, and its predicted time is a
    positive, finite number."""
    result = _kernel(task).tune("H100", top=1, **task.realistic)
    assert result.configurations, f"{task.name}: no configuration"
    seconds = result.best.time_s
    assert seconds is not None and 0 < seconds and math.isfinite(seconds)
