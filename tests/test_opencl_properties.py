"""The generated GPU kernel (OpenCL printing, run on PoCL) over random sizes and relabellings.

The CUDA and OpenCL kernels come from one lowering, so this exercises what the GPU would run:
block-to-tile mapping, masked tails, the shared-memory arena's aliasing (results staged in
registers when they reuse a released input's bytes), streamed loops and the online softmax.
Each case compiles a new OpenCL program (about a second on PoCL), so examples are few.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from napkin_dsl.backends import opencl
from napkin_dsl.reference import evaluate

from .conftest import assert_matches_reference, example_id
from .fuzz_programs import check_case_within, tensor_core_programs
from .test_cuda_codegen import NOT_PRINTED
from .test_numpy_backend import RUNNABLE, only_kernel, random_arguments, relabelled
from .test_properties import configurations


# The examples the printers refuse yet (tests/test_cuda_codegen.py holds each to its refusal).
PRINTED = [p for p in RUNNABLE if example_id(p) not in NOT_PRINTED]


@pytest.mark.parametrize("path", PRINTED, ids=example_id)
def test_generated_kernel_equals_reference_on_random_relabellings(path, opencl_device):
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
        assert_matches_reference(program, outputs, expected, f"{sizes} {partitions}")

    check()


@pytest.mark.usefixtures("opencl_device")
@settings(max_examples=6, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(tensor_core_programs())
def test_tensor_core_programs_run_right_on_numpy_and_opencl(case):
    """The fuzzer's invariants (fuzz_programs.check_case: NumPy and OpenCL within the derived
    error bound of the reference, counts equal to the model) on programs that reach the
    tensor-core path: fragment-multiple tiles over ragged sizes, large-magnitude inputs."""
    import napkin_dsl as napkin
    from napkin_dsl import isel

    (kernel,) = napkin.load(case.text).values()
    program = kernel.program(None, **case.sizes)
    assert [isel.selection(program, launch).path for launch in program.launches] == ["mma.sync"], case.describe()
    outcome = check_case_within(case, 60.0, opencl=True)
    assert not outcome.failures, "\n".join([f"{f.kind} ({f.signature}):\n{f.message}" for f in outcome.failures]
                                           + ["case:", case.describe(), f"Case.from_json({case.to_json()!r})"])
