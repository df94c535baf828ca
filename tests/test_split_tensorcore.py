"""A split's parts launch on tensor cores (issue 28): split-K's parts on mma.sync.

Each block of the parts launch streams its part of k through the cp.async pipeline from the
part's origin to its end (the last part of a ragged k shorter), accumulates in mma.sync
fragments, and saves the fragments as its part state (``C.acc.part[k# m n]``), which the
combine launch (on the FMA path: it has no contraction) loads and adds. Checked here: the
selection and its reasons, NVRTC's cubins for sm_80 and sm_90 (HMMA in the hot loop, no
spills, the model under the static ceiling of the code built), the OpenCL emulation of the same
plan on PoCL against the float64 reference at ragged m, n and k; a split attention's parts
(flash-decoding), which save the online softmax's row max and sum too; and what stays on the
FMA path (a statement computed after the merge, a part that is not whole chunks of its stream,
decode's 4 rows).
"""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import opencl
from napkin_dsl.isel import selection
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES, assert_matches_reference, has_nvdisasm
from .test_opencl import random_inputs

SPLITK = EXAMPLES / "splitk.napkin"
# A small split-K the emulation runs in seconds: tiles of 32 x 32 (two warps of 16 rows), parts
# of 256 of k streamed in chunks of 32.
SMALL = """kernel splitk(A: bf16[m k], B: bf16[k n]) -> C: f32[m n]:
    C[m n] = A * B

relabel splitk on H100:
    smem: group m 32, n 32; split k 256; stream k 32
"""


def splitk():
    (kernel,) = napkin.load(SPLITK).values()
    return kernel


def small():
    (kernel,) = napkin.load(SMALL).values()
    return kernel


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_parts_launch_selects_mma_sync_and_the_combine_stays_on_fma(arch):
    program = splitk().gpu_program(None, m=512, n=512, k=65536)
    parts, combine = (selection(program, launch, arch) for launch in program.launches)
    assert program.launches[1].combine is not None  # the second launch is the split's combine
    assert parts.path == "mma.sync" and parts.plan is not None and parts.plan.stream == "k"
    assert combine.path == "fma" and combine.plan is None  # it loads part states and adds them: no mma


@pytest.mark.parametrize("sizes", [dict(m=512, n=512, k=65536), dict(m=200, n=136, k=20000)])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_parts_launch_compiles_with_hmma_in_its_hot_loop_no_spills_and_the_model_under_its_ceiling(arch, sizes):
    pytest.importorskip("cuda.bindings")
    from napkin_dsl.backends.sass import hot_loop, sass_report

    compiled = splitk().compile(arch, **sizes)
    table = compiled.launch_table()
    assert [row["path"] for row in table] == ["mma.sync", "fma"]
    assert all(row["spill_bytes"] == 0 for row in table), table
    parts = -(-sizes["k"] // 8192)  # the example's split k 8192, the last part short at k = 20000
    groups = -(-sizes["m"] // 128) * -(-sizes["n"] // 128)
    assert table[0]["grid"][0] == groups * parts
    if has_nvdisasm():  # the SASS checks need nvdisasm; the compile checks above do not
        report = sass_report(compiled)
        entry = report["launches"][0]
        loop = hot_loop(entry)
        assert loop["classes"].get("tensor", 0) > 0 and loop["classes"].get("ldsm", 0) > 0, loop
        assert entry["whole"].get("local", 0) == 0  # no local memory
        ceiling = entry["ceiling"]
        assert ceiling["unit"] == "tensor" and ceiling["tensor_in_loop"] > 0
        # the model never promises more than the code built allows (tests/test_static_ceiling.py)
        assert ceiling["model_s"] >= ceiling["floor_s"] * (1 - 1e-9), ceiling
        assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9)


def test_the_part_state_is_saved_from_the_fragments_at_the_parts_place():
    program = splitk().gpu_program(None, m=200, n=136, k=20000)
    source, kernels = opencl.generate(program)
    parts = kernels[0].text
    assert kernels[0].path == "mma.sync" and "nk_mma(" in source
    assert "g_C__acc_part" in parts.split("{")[0]  # the part array is the parts launch's output
    # each block streams its own part: chunks from the part's origin, as many as the part holds
    assert "const int op_k = grp_k * 8192;" in parts and "const int np_k = min(8192, 20000 - op_k);" in parts
    assert "for (int c_k = 0; c_k < ((np_k) + 63) / 64; c_k += 2)" in parts
    assert "const int o_k = op_k + c_k * 64;" in parts


def run_small(sizes: dict, seed: int):
    kernel = small()
    inputs, scalars = random_inputs(kernel.diagram, sizes, seed)
    program = kernel.gpu_program(None, **sizes)
    assert selection(program, program.launches[0], "sm_90").path == "mma.sync"
    source, _ = opencl.generate(program)
    assert "nk_mma(" in source  # the emulation of the CUDA kernel's mma.sync, not the FMA path
    outputs = opencl.run(program, inputs, scalars)
    expected = evaluate(kernel.diagram, inputs, scalars, sizes)
    assert_matches_reference(program, outputs, expected, "split-K on mma.sync")
    return inputs, outputs, expected


@pytest.mark.parametrize("sizes, seed", [
    # ragged m and n tiles (50 = 32 + 18, 40 = 32 + 8), 3 parts of k, the last 200 long: 6 chunks
    # of 32 and a short one of 8
    (dict(m=50, n=40, k=712), 0),
    # tiles, parts and chunks that divide
    (dict(m=64, n=32, k=512), 1),
])
def test_split_k_on_mma_sync_matches_the_reference_on_pocl(sizes, seed, opencl_device):
    run_small(sizes, seed)


def test_every_part_is_counted_once(opencl_device):
    """A part's chunks stop at its end: with A's k columns of one part scaled by 1000, the sum
    changes by exactly that part's share (a chunk reaching into the next part would count a
    neighbour's columns twice, or miss its own)."""
    kernel = small()
    # the sizes of the first reference case above, so that PoCL compiles one kernel for both
    sizes = dict(m=50, n=40, k=712)
    inputs, _ = random_inputs(kernel.diagram, sizes, 5)
    program = kernel.gpu_program(None, **sizes)
    base = opencl.run(program, inputs)["C"].astype(np.float64)
    scaled = dict(inputs)
    a = inputs["A"].astype(np.float32).copy()
    a[:, 256:512] = 0.0  # the second part contributes nothing
    scaled["A"] = a.astype(inputs["A"].dtype)
    without = opencl.run(program, scaled)["C"].astype(np.float64)
    b = inputs["B"].astype(np.float64)
    share = inputs["A"].astype(np.float64)[:, 256:512] @ b[256:512]
    assert np.allclose(base - without, share, rtol=1e-3, atol=1e-2 * np.abs(share).max())


def split_attention(name: str, tiles: str):
    (kernel,) = napkin.load(EXAMPLES / f"{name}.napkin").values()
    return kernel.relabelled(f"relabel {kernel.diagram.name} on H100:\n    smem: {tiles}\n")


@pytest.mark.parametrize("name", ["attention", "causal_attention"])
def test_a_split_attention_saves_its_softmax_state_from_the_fragments_and_matches_on_pocl(name, opencl_device):
    """Flash-decoding's parts on mma.sync: each part saves O's accumulator, the online softmax's
    row max (kept in the log2 domain, times the folded d^-0.5: back to the scaled values' max)
    and its row sum (each thread's columns, summed over the quad first); the combine merges them.
    Ragged q (80 = 64 + 16), 3 parts of x (the last 88 long: a chunk of 64 and one of 24)."""
    kernel = split_attention(name, "group b 1, h 1, q 64; split x 256; stream x 64")
    sizes = dict(b=1, h=2, q=80, x=600, d=64)
    program = kernel.gpu_program(None, **sizes)
    assert selection(program, program.launches[0], "sm_90").path == "mma.sync"
    source, kernels = opencl.generate(program)
    parts = kernels[0].text
    assert "nk_mma(" in source and all(f"g_{state}_part" in parts.split("{")[0] for state in ("P__max", "P__sum", "O__acc"))
    inputs, scalars = random_inputs(kernel.diagram, sizes, 2)
    outputs = opencl.run(program, inputs, scalars)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), f"split {name} on mma.sync")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_a_split_attention_compiles_with_hmma_no_spills_and_the_model_under_its_ceiling(arch):
    pytest.importorskip("cuda.bindings")
    from napkin_dsl.backends.sass import hot_loop, sass_report

    kernel = split_attention("attention", "group b 1, h 1, q 64; split x 4096; stream x 64")
    compiled = kernel.compile(arch, b=1, h=8, q=256, x=32768, d=128)
    table = compiled.launch_table()
    assert [row["path"] for row in table] == ["mma.sync", "fma"] and all(row["spill_bytes"] == 0 for row in table)
    if has_nvdisasm():
        entry = sass_report(compiled)["launches"][0]
        assert hot_loop(entry)["classes"].get("tensor", 0) > 0
        ceiling = entry["ceiling"]
        assert ceiling["model_s"] >= ceiling["floor_s"] * (1 - 1e-9), ceiling


def test_a_statement_computed_after_the_merge_keeps_the_parts_on_the_fma_path_with_the_reason():
    """attention_lse's L is read off the merged softmax state in the combine launch: the parts
    launch names it but does not compute it, and the tensor-core plan has no fragment for it."""
    kernel = split_attention("attention_lse", "group b 1, h 1, q 32; split x 128; stream x 32")
    program = kernel.gpu_program(None, b=1, h=2, q=80, x=600, d=64)
    chosen = selection(program, program.launches[0], "sm_90")
    assert chosen.path == "fma" and "computes every statement of the launch" in chosen.reason


def test_decode_keeps_the_fma_path_its_rows_do_not_fill_an_mma():
    (kernel,) = napkin.load(EXAMPLES / "decode.napkin").values()
    program = kernel.gpu_program(None, b=1, kv=8, r=4, x=32768, d=128)
    chosen = selection(program, program.launches[0], "sm_90")
    assert chosen.path == "fma" and chosen.reason == "the r tile (4) is not a multiple of 16"


def test_a_part_of_partial_chunks_keeps_the_fma_path_with_the_reason():
    """A part that is not whole chunks of its stream would need a chunk masked at the part's end:
    the tensor-core pipeline streams whole chunks, so selection keeps the FMA path."""
    kernel = napkin.load(SMALL.replace("split k 256", "split k 240"))["splitk"]
    program = kernel.gpu_program(None, m=64, n=64, k=1024)
    chosen = selection(program, program.launches[0], "sm_90")
    assert chosen.path == "fma" and "whole unmasked chunks" in chosen.reason
