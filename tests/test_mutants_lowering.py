"""lowering.py (the FMA printer and the dialects): what mutation testing found unchecked
(benchmarks/mutation.md).

Each test holds the printed kernel to a behaviour, not to its text: a run on PoCL against the
float64 reference, or a property of the SASS that NVRTC and nvdisasm make of the CUDA kernel.
"""

from __future__ import annotations

import napkin_dsl as napkin
from napkin_dsl.backends import opencl
from napkin_dsl.reference import evaluate

from .conftest import assert_matches_reference, needs_nvdisasm
from .test_opencl import random_inputs


def kernel_of(source: str):
    (kernel,) = napkin.load(source).values()
    return kernel


def run_on_pocl(source: str, name: str, **sizes):
    """``source``'s kernel on PoCL at ``sizes``, held to the reference; the Program and outputs."""
    kernel = kernel_of(source)
    program = kernel.gpu_program(None, **sizes)
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(program, inputs, scalars)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), name)
    return program, outputs


MATMUL_F32 = """kernel matmul(A: f32[m k], B: f32[k n]) -> C: f32[m n]:
    C[m n] = A[m k] * B[k n]

relabel matmul on H100:
    smem: group m 64, n 64; stream k 32
"""


@needs_nvdisasm
def test_a_tile_of_whole_16_byte_rows_is_loaded_16_bytes_an_instruction():
    """The FMA path's loads move 16 bytes at a time where the tile allows it (rows of 32 and 64
    f32 values, sizes the tiles divide): every global load in the SASS is a 128-bit LDG."""
    from napkin_dsl.backends.cuda import compile_program
    from napkin_dsl.backends.sass import disassemble

    module = compile_program(kernel_of(MATMUL_F32).gpu_program(None, m=256, n=256, k=256), "sm_90")
    (launch,) = module.launches
    loads = [i for i in disassemble(module.image)[launch.entry] if i.base == "LDG"]
    assert loads and all("128" in i.modifiers for i in loads), sorted({i.opcode for i in loads})


def test_an_index_comparison_is_integer_arithmetic_exact_where_f32_is_not(opencl_device):
    """A mask's comparison of indices is computed in C ints, exactly: here 2^24 q + 1 > 2^24 x
    (x <= q), where f32 would round 2^24 q + 1 to 2^24 q and mask the diagonal too."""
    source = """kernel big(Q: f32[q d], K: f32[x d], V: f32[x d]) -> O: f32[q d]:
    S[q x] = Q * K
    P[q x] = softmax[x](where(16777216 * q + 1 > 16777216 * x, S, -inf))
    O[q d] = P * V

relabel big on H100:
    smem: group q 16; stream x 16
"""
    run_on_pocl(source, "big", q=40, x=40, d=8)
