"""A split (`split AXIS SIZE`, issue 28) printed for OpenCL and run on PoCL: the parts launch (one
work-group per part and group, each streaming its part and saving its states to the part arrays)
and the combine launch (the merges, then the finalise steps), against the float64 reference.
Ragged tails everywhere: the axis not a multiple of the split, the split not of the stream."""

from __future__ import annotations

import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import opencl
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES, assert_matches_reference
from .test_opencl import random_inputs


def kernel_of(source: str):
    (kernel,) = napkin.load(source).values()
    return kernel


def run_split(kernel, sizes: dict, seed: int = 0):
    """The kernel on PoCL at ``sizes``, checked against the reference; the Program it ran."""
    inputs, scalars = random_inputs(kernel.diagram, sizes, seed)
    program = kernel.gpu_program(None, **sizes)
    assert [launch.combine for launch in program.launches][-1] is not None, "not a split"
    outputs = opencl.run(program, inputs, scalars)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), kernel.diagram.name)
    return program


@pytest.mark.parametrize("op", ["sum", "max", "min", "mean"])
def test_reductions_merge_on_opencl(op, opencl_device):
    kernel = kernel_of(f"""kernel red(X: f32[a c]) -> Y: f32[a]:
    Y[a] = {op}[c](X * 2)

relabel red on H100:
    smem: group a 4; split c 100; stream c 32
""")
    run_split(kernel, dict(a=10, c=250))  # 3 parts (the last 50 long), chunks of 32 (each part's last short)
    run_split(kernel, dict(a=8, c=400))  # parts and chunks that divide


def test_a_map_after_the_merge_runs_in_the_combine_launch(opencl_device):
    kernel = kernel_of("""kernel rms(X: f32[t d]) -> Y: f32[t]:
    M[t] = mean[d](X * X)
    Y[t] = sqrt(M + 1)

relabel rms on H100:
    smem: group t 8; split d 96; stream d 32
""")
    program = run_split(kernel, dict(t=13, d=300))
    assert len(program.launches) == 2


def test_decode_online_softmax_and_contraction_merge_on_opencl(opencl_device):
    source = (EXAMPLES / "decode.napkin").read_text().replace("split x 1024; stream x 64", "split x 100; stream x 32")
    kernel = kernel_of(source)
    run_split(kernel, dict(b=2, kv=2, r=4, x=333, d=64))  # ragged parts and chunks
    run_split(kernel, dict(b=1, kv=2, r=3, x=400, d=48), seed=1)  # parts that divide x, chunks that do not divide a part


def test_the_decode_example_on_opencl(opencl_device):
    (kernel,) = napkin.load(EXAMPLES / "decode.napkin").values()
    run_split(kernel, dict(b=1, kv=2, r=4, x=2500, d=64))  # split x 1024: the last part 452 long


def test_lse_is_read_off_the_merged_softmax_state(opencl_device):
    (kernel,) = napkin.load(EXAMPLES / "attention_lse.napkin").values()
    split = kernel.relabelled("relabel attention_lse on H100:\n    smem: group b 1, h 1, q 8; split x 100; stream x 32\n")
    run_split(split, dict(b=1, h=2, q=20, x=250, d=16))
    whole = kernel.relabelled("relabel attention_lse on H100:\n    smem: group b 1, h 1, q 8; split x 100\n")
    run_split(whole, dict(b=1, h=2, q=20, x=250, d=16), seed=2)  # each part streamed whole


def test_splitk_on_the_fma_path(opencl_device):
    kernel = kernel_of("""kernel splitk(A: f32[m k], B: f32[k n]) -> C: f32[m n]:
    C[m n] = A * B

relabel splitk on H100:
    smem: group m 16, n 8; split k 300; stream k 64
""")
    run_split(kernel, dict(m=40, n=24, k=1000))
    run_split(kernel, dict(m=32, n=16, k=600), seed=3)


def test_a_split_lse_keeps_its_parts_launch_on_the_fma_path_with_the_reason():
    """Selection puts a split's parts launch on tensor cores only where the parts compute every
    statement of the launch (tests/test_split_tensorcore.py): attention_lse's L is read off the
    merged state in the combine launch, so selection says why, and the FMA printer prints the
    parts (the combine launch after them)."""
    from napkin_dsl.isel import selection

    (kernel,) = napkin.load(EXAMPLES / "attention_lse.napkin").values()
    split = kernel.relabelled("relabel attention_lse on H100:\n    smem: group b 1, h 1, q 32; split x 128; stream x 32\n")
    program = split.gpu_program(None, b=1, h=2, q=80, x=600, d=64)
    parts = selection(program, program.launches[0], "sm_90")
    assert parts.plan is None and "computes every statement of the launch" in parts.reason
    source, kernels = opencl.generate(program)
    assert len(kernels) == 2 and "nk_mma(" not in source
