"""The FMA path keeps a streamed contraction's accumulator in registers (``isel.fma_accumulators``).

Each thread owns register blocks of the output tile from the accumulator's init to its finalise,
so the running sum never goes through shared memory: the arena drops the accumulator tile, the
model counts it at ``registers`` per thread, and the kernels still match the reference. An
accumulator over ``FMA_ACCUMULATOR_BUDGET`` registers a thread stays in shared memory, with a note.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import isel
from napkin_dsl.backends import opencl
from napkin_dsl.backends.sass import hot_loop, sass_report
from napkin_dsl.cost import columns, cost_of, smem_bytes_by_launch
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES, assert_matches_reference, needs_nvdisasm
from .test_opencl import random_inputs

F32 = 4  # bytes


def matmul(group_m: int, group_n: int, stream_k: int = 32) -> str:
    return f"""kernel matmul(A: f32[m k], B: f32[k n]) -> C: f32[m n]:
    C[m n] = A[m k] * B[k n]

relabel matmul on H100:
    smem: group m {group_m}, n {group_n}; stream k {stream_k}
"""


# Attention whose output is wider than Q: O's tile takes the bytes of P.sum, which finalise
# reads, so the finalised values wait in the registers until every thread has read its sums.
WIDE = """kernel wide(Q: f32[q d], K: f32[x d], V: f32[x e]) -> O: f32[q e]:
    S[q x] = Q[q d] * K[x d]
    P[q x] = softmax[x](S)
    O[q e] = P[q x] * V[x e]

relabel wide on H100:
    smem: group q 64; stream x 32
"""



def f32(example: str) -> str:
    """An example with its 16-bit arrays in f32: the FMA path."""
    return (EXAMPLES / example).read_text().replace("bf16", "f32")


ATTENTION_F32 = f32("attention.napkin")


def kernel_of(source: str):
    (kernel,) = napkin.load(source).values()
    return kernel


def accumulator_values(tile_m: int, tile_n: int, threads: int = isel.FMA_THREADS) -> int:
    """Registers a thread holds for an m x n tile dealt out in 4 x 4 blocks."""
    blocks = (tile_m // 4) * (tile_n // 4)
    return -(-blocks // threads) * 16


# ---- the model -------------------------------------------------------------------------------------


def test_the_accumulator_counts_per_thread_at_registers_not_in_shared_memory():
    program = kernel_of(matmul(128, 64)).gpu_program(m=300, n=200, k=100)
    rows = columns(program)
    assert not any(b.name == "C.acc" for row in rows for b in row["buffers"].get("smem", []))
    assert any(b.name == "C.acc" for row in rows for b in row["buffers"].get("registers", []))
    report = cost_of(program)
    registers = report.levels["registers"]
    assert registers.M == accumulator_values(128, 64) == 32  # 512 blocks on 256 threads
    assert registers.M_bytes == 32 * F32
    assert registers.H == 0  # the FMA path counts no transfers at this level
    # Shared memory: the A and B chunks, or C once they are dead; C.acc is not there.
    a, b, c = 128 * 32 * F32, 32 * 64 * F32, 128 * 64 * F32
    assert report.levels["smem"].M_bytes == max(a + b, c)
    assert smem_bytes_by_launch(program) == [max(a + b, c)]
    assert not any("stays in shared memory" in note for note in report.notes)


def test_f64_accumulators_take_two_registers_each():
    program = kernel_of(matmul(64, 128, 16).replace("f32", "f64")).gpu_program(m=100, n=150, k=40)
    (launch,) = program.launches
    (acc,) = isel.select_program(program)[launch.index].kept.values()
    assert (acc.values, acc.registers) == (accumulator_values(64, 128), 2 * accumulator_values(64, 128))
    registers = cost_of(program).levels["registers"]
    assert (registers.M, registers.M_bytes) == (acc.values, acc.values * 8)


def test_an_accumulator_over_the_budget_stays_in_shared_memory_and_the_report_says_why():
    program = kernel_of(matmul(128, 256)).gpu_program(m=300, n=300, k=100)
    assert accumulator_values(128, 256) > isel.FMA_ACCUMULATOR_BUDGET
    report = cost_of(program)
    assert "registers" not in report.levels
    acc, a, b = 128 * 256 * F32, 128 * 32 * F32, 32 * 256 * F32
    assert report.levels["smem"].M_bytes == acc + a + b
    (note,) = [n for n in report.notes if "stays in shared memory" in n]
    assert "C.acc" in note and "128 accumulator registers" in note


def test_the_pseudocode_says_where_each_accumulator_lives():
    kept = kernel_of(matmul(128, 64)).pseudocode(m=300, n=200, k=100)
    assert "parallel for thread in 256 threads @registers:  # fma; C.acc in registers, 2 blocks of 4 m x 4 n a thread" in kept
    refused = kernel_of(matmul(128, 256)).pseudocode(m=300, n=300, k=100)
    assert "C.acc in smem: 128 accumulator registers a thread, over the FMA path's 64" in refused


def test_a_tensor_core_launch_keeps_no_fma_accumulators():
    program = kernel_of((EXAMPLES / "matmul.napkin").read_text()).gpu_program(m=1024, n=1024, k=1024)
    (launch,) = program.launches
    assert isel.selection(program, launch).plan is not None
    chosen = isel.select_program(program)[launch.index]
    assert (chosen.kept, chosen.refused) == ({}, {})


# ---- on PoCL, against the reference ------------------------------------------------------------------

CASES = {
    # two blocks a thread, ragged tails along every axis
    "matmul-128x64": (matmul(128, 64), dict(m=300, n=200, k=100)),
    # over the budget: shared memory, as before
    "matmul-128x256": (matmul(128, 256), dict(m=150, n=300, k=40)),
    # the online softmax's rescale and normalisation on the registers
    "attention-f32": (ATTENTION_F32, dict(b=1, h=2, q=200, x=150, d=32)),
    "wide": (WIDE, dict(q=100, x=70, d=8, e=64)),
    "fig9": ((EXAMPLES / "paper/fig9.napkin").read_text(), dict(q=40, x=64, d=16)),
    # masked streams (blocks that visit part of the chunks, or none), grouped heads, and an MLP
    # whose hidden accumulator takes the whole budget (64 a thread)
    "causal-f32": (f32("causal_attention.napkin"), dict(b=1, h=2, q=200, x=150, d=32)),
    "window-f32": (f32("sliding_window.napkin"), dict(b=1, h=1, q=330, x=400, d=32)),
    "gqa-f32": (f32("gqa.napkin"), dict(b=1, kv=2, r=2, q=130, x=70, d=32)),
    "mlp-f32": (f32("mlp.napkin"), dict(b=100, k=48, n=130)),
    # double accumulators: two registers each, 32 of them a thread
    "matmul-f64": (matmul(64, 128, 16).replace("f32", "f64"), dict(m=100, n=150, k=40)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_opencl_matches_reference(name, opencl_device):
    source, sizes = CASES[name]
    kernel = kernel_of(source)
    inputs, scalars = random_inputs(kernel.diagram, sizes, seed=3)
    program = kernel.gpu_program(None, **sizes)
    outputs = opencl.run(program, inputs, scalars)
    expected = evaluate(kernel.diagram, inputs, scalars, sizes, keep_float64=True)
    doubles = [n for n in kernel.diagram.outputs if kernel.diagram.arrays[n].dtype == "f64"]
    for out in doubles:  # conftest's tolerances are for the 32- and 16-bit types: doubles are near exact
        error = np.max(np.abs(outputs[out] - expected[out])) / np.max(np.abs(expected[out]))
        assert error < 1e-12, (out, error)
    if doubles:
        return
    assert_matches_reference(program, outputs, expected, name)


# ---- compiled by NVRTC -------------------------------------------------------------------------------


def compiled(source: str, arch: str = "sm_90", **sizes):
    """Lowered and compiled now: Kernel.compile's cache is keyed by the napkin source, which
    the budget-0 comparisons below do not change (NVRTC's, by the CUDA source, is safe)."""
    from napkin_dsl.backends.cuda import compile_program

    return compile_program(kernel_of(source).gpu_program(None, **sizes), arch)


@pytest.mark.parametrize("name", ["matmul-128x64", "attention-f32", "wide", "fig9", "matmul-f64", "causal-f32", "mlp-f32"])
def test_compiles_without_spills_and_shared_memory_is_the_models(name):
    source, sizes = CASES[name]
    module = compiled(source, **sizes)
    assert re.search(r"\b(float|double) r_\w+__acc\[\d+\];", module.source)  # declared in registers
    assert not re.search(r"\bs_\w+__acc\b", module.source)  # and nowhere in shared memory
    table = module.launch_table()
    assert all(row["spill_bytes"] == 0 for row in table)
    assert [row["shared_bytes"] for row in table] == smem_bytes_by_launch(module.program)


def test_registers_instead_of_shared_memory_save_the_accumulator_tile(monkeypatch):
    """The same kernel with the accumulator forced back into shared memory (a budget of 0)
    needs exactly the accumulator's tile more shared memory."""
    sizes = dict(m=1024, n=1024, k=1024)
    in_registers = compiled(matmul(64, 64), **sizes).launch_table()[0]
    monkeypatch.setattr(isel, "FMA_ACCUMULATOR_BUDGET", 0)
    in_shared = compiled(matmul(64, 64), **sizes)
    assert "s_C__acc" in in_shared.source
    assert in_shared.launch_table()[0]["shared_bytes"] - in_registers["shared_bytes"] == 64 * 64 * F32


@needs_nvdisasm
def test_sass_the_product_loop_stores_nothing_to_shared_memory_and_the_kernel_fewer(monkeypatch):
    sizes = dict(m=1024, n=1024, k=1024)
    (registers,) = sass_report(compiled(matmul(64, 64), **sizes))["launches"]
    monkeypatch.setattr(isel, "FMA_ACCUMULATOR_BUDGET", 0)
    (shared,) = sass_report(compiled(matmul(64, 64), **sizes))["launches"]
    loop = hot_loop(registers)
    assert loop["classes"].get("ffma", 0) >= 16 and "sts" not in loop["classes"]
    # The read-modify-write of C.acc per chunk, its zeroing and finalise read: gone.
    assert registers["whole"]["sts"] < shared["whole"]["sts"]
    lds = sum(n for key, n in registers["whole"].items() if key.startswith("lds"))
    assert lds < sum(n for key, n in shared["whole"].items() if key.startswith("lds"))
    assert registers["spill_bytes"] == 0


# ---- under oclgrind ----------------------------------------------------------------------------------


def test_register_accumulators_run_clean_under_oclgrind():
    """No race (the finalise that overwrites the sums it reads), no uninitialised read (registers
    of blocks a thread does not own are never read), and the result within tolerance."""
    from .fuzz_programs import Case
    from .test_oclgrind import case_of, require_oclgrind, run_cases

    require_oclgrind()
    small = {"matmul-128x64": dict(m=150, n=70, k=40), "attention-f32": dict(b=1, h=1, q=40, x=70, d=16),
             "wide": dict(q=70, x=40, d=8, e=24)}
    cases = [case_of(Case("valid", CASES[name][0], sizes, None, 0, opencl=True), name, gpu=True)
             for name, sizes in small.items()]
    found = run_cases(cases)
    assert all(found[name]["result"] == "ok" for name in small), found
