"""The generated GPU kernel (OpenCL printing, run on PoCL) over random sizes and relabellings.

The CUDA and OpenCL kernels come from one lowering, so this exercises what the GPU would run:
block-to-tile mapping, masked tails, the shared-memory arena's aliasing (results staged in
registers when they reuse a released input's bytes), streamed loops and the online softmax.
Each case compiles a new OpenCL program (about a second on PoCL), so examples are few.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from napkin_dsl.backends import opencl
from napkin_dsl.reference import evaluate

from .conftest import example_id
from .test_numpy_backend import RUNNABLE, random_arguments, relabelled
from .test_properties import configurations

TOLERANCE = {"f32": 1e-4, "f16": 1e-2, "bf16": 2e-2}


@pytest.fixture(scope="module")
def device():
    if not opencl.opencl_available():
        if os.environ.get("NAPKIN_REQUIRE_OPENCL"):
            pytest.fail("no OpenCL device, and NAPKIN_REQUIRE_OPENCL is set")
        pytest.skip("no OpenCL device")


@pytest.mark.parametrize("path", RUNNABLE, ids=example_id)
def test_generated_kernel_equals_reference_on_random_relabellings(path, device):
    from .test_numpy_backend import only_kernel

    base = only_kernel(path)

    @settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(configurations(base))
    def check(configuration):
        sizes, partitions = configuration
        kernel = relabelled(path, "H100", partitions)
        program = kernel.program("H100", **sizes)
        arrays, scalars = random_arguments(kernel.diagram, sizes, 0)
        outputs = opencl.run(program, arrays, scalars)
        expected = evaluate(kernel.diagram, arrays, scalars, sizes)
        for name in kernel.diagram.outputs:
            got = outputs[name].astype(np.float64)
            want = expected[name].astype(np.float64)
            scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
            error = float(np.max(np.abs(got - want))) / scale if want.size else 0.0
            assert error < TOLERANCE[kernel.diagram.arrays[name].dtype] * 4, (sizes, partitions, name, error)

    check()
