"""tensorcore.py (the mma.sync printer): what mutation testing found unchecked
(benchmarks/mutation.md).

Each test holds the printed kernel to a behaviour, not to its text: a run of the tensor-core
path on PoCL (the OpenCL emulation of mma, ldmatrix and cp.async) against the float64
reference, or a property of the SASS that NVRTC and nvdisasm make of the CUDA kernel.
"""

from __future__ import annotations

import napkin_dsl as napkin
from napkin_dsl import isel
from napkin_dsl.backends import opencl
from napkin_dsl.reference import evaluate

from .conftest import assert_matches_reference
from .test_opencl import random_inputs


def kernel_of(source: str):
    (kernel,) = napkin.load(source).values()
    return kernel


def run_on_pocl(source: str, name: str, **sizes):
    """``source``'s kernel on the tensor-core path on PoCL at ``sizes``, held to the reference."""
    kernel = kernel_of(source)
    program = kernel.gpu_program(None, **sizes)
    assert [isel.selection(program, launch).path for launch in program.launches] == ["mma.sync"]
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(program, inputs, scalars)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), name)
    return program, outputs


def test_an_epilogue_reads_a_shared_tile_and_the_index_of_an_axis_grouped_by_one(opencl_device):
    """A dense layer per head: the bias tile bias[h n] sits in shared memory with h grouped by 1
    (its element is the fragment's column along n and 0 along h), and the map reads the index
    h, which every lane of a block holds at the block's origin."""
    source = """kernel heads(X: bf16[h b k], W: bf16[h k n], bias: bf16[h n]) -> Y: bf16[h b n]:
    H[h b n] = X * W
    Y[h b n] = gelu(H + bias) + h

relabel heads on H100:
    smem: group h 1, b 64, n 64; stream k 32
"""
    run_on_pocl(source, "heads", h=3, b=64, k=32, n=64)
