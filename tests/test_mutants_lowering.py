"""lowering.py (the FMA printer and the dialects): what mutation testing found unchecked
(benchmarks/mutation.md).

Each test holds the printed kernel to a behaviour, not to its text: a run on PoCL against the
float64 reference, or a property of the SASS that NVRTC and nvdisasm make of the CUDA kernel.
"""

from __future__ import annotations

import re

import napkin_dsl as napkin
from napkin_dsl.backends import opencl

from .conftest import needs_nvdisasm
from .test_opencl import run_on_pocl


def kernel_of(source: str):
    (kernel,) = napkin.load(source).values()
    return kernel


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


def test_a_ragged_tile_reads_nothing_past_the_end_of_its_array():
    """The scalar load of a tile that runs past the end of an axis (rows 16..19 of 20 in the
    second block, rows of 50 values: not 16-byte units) pads with zeros and reads nothing past
    the array: oclgrind reports any read out of bounds, and the result is held to the reference."""
    from .fuzz_programs import Case
    from .test_oclgrind import case_of, require_oclgrind, run_cases

    require_oclgrind()
    source = """kernel softmax_rows(X: f32[r c]) -> Y: f32[r c]:
    Y[r c] = softmax[c](X)

relabel softmax_rows on H100:
    smem: group r 16
"""
    found = run_cases([case_of(Case("valid", source, dict(r=20, c=50), None, 0, opencl=True), "ragged", gpu=True)])
    assert found["ragged"]["result"] == "ok", found


def arena_offsets(source: str) -> dict[str, int]:
    """Each shared buffer's byte offset in the arena, as the kernel declares its pointer."""
    return {name: int(offset) for name, offset in re.findall(r"\bs_(\w+) = .*?nk_smem \+ (\d+)\)", source)}


def test_a_map_whose_operand_of_its_own_shape_dies_there_takes_its_bytes_in_place(opencl_device):
    """Y = B + X releases both operands; Y takes the bytes of X, its own shape (element i
    overwrites element i: no stage in registers, no extra barrier), not the first free offset,
    which B (a row of its own) holds: there Y would overlap both, and wait in registers."""
    source = """kernel bias(B: f32[c], X: f32[r c]) -> Y: f32[r c]:
    Y[r c] = B + X

relabel bias on H100:
    smem: group r 16
"""
    program, _ = run_on_pocl(source, "bias", r=40, c=24)
    printed, _ = opencl.generate(program)
    offsets = arena_offsets(printed)
    assert offsets["Y"] == offsets["X"] != offsets["B"], offsets
    assert "stage[" not in printed.split("*/", 1)[1]


def test_a_softmax_of_a_computed_operand_keeps_its_values_in_the_target_not_in_registers():
    """P = softmax(S * 2) over rows of 2048 f32 values: the max pass keeps each value of S * 2
    in P's own element (f32 holds it exactly, and no other thread reads those bytes), so a
    thread holds no copy of its rows in registers: ptxas needs a few dozen registers, where
    a per-thread copy of 2 rows x 64 values each would take all 255."""
    from napkin_dsl.backends.cuda import compile_program

    source = """kernel k(S: f32[q x]) -> P: f32[q x]:
    P[q x] = softmax[x](S * 2)

relabel k on H100:
    smem: group q 16
"""
    module = compile_program(kernel_of(source).gpu_program(None, q=64, x=2048), "sm_90")
    (used,) = module.resources.values()
    assert used["registers"] <= 64 and used["spill_bytes"] == 0, used
