"""TMA and mbarriers for matmul on sm_90a (issue 27, step 2).

The driver API's rules for ``cuTensorMapEncodeTiled`` and the PTX ISA's TMA swizzle are written
out here, apart from napkin's encoder: the tensor map's arguments (dims innermost first, strides
in bytes of the dimensions above the first, box, element strides, the enums' values) are held
against them and against ``cuda.bindings.driver``'s enums; the TMA boxes of a canonical tile must
write the bytes wgmma's descriptor swizzle reads. PoCL then runs the sm_90a kernel's OpenCL
printing, whose emulation copies each box as the map's words say and tracks mbarrier phases,
against A @ B at ragged sizes (out-of-bounds reads as zeros); encoder bugs must fail that run.
The real ``cuTensorMapEncodeTiled`` needs libcuda: ``scripts/gpu_check.py`` runs it.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import layouts
from napkin_dsl.backends import driver
from napkin_dsl.isel import select_program, selection

from .conftest import EXAMPLES
from .test_wgmma import _run_opencl, isa_canonical

MATMUL = EXAMPLES / "matmul.napkin"


def tma_write(dst: int, row: int, inner_byte: int, inner_bytes: int, span: int) -> int:
    """Where TMA writes byte ``inner_byte`` of box row ``row`` (PTX ISA "Tensor copy", the
    swizzle modes: the box is dense in shared memory, then address bits [4, 4 + b) are XORed with
    bits [7, 7 + b), b = log2(span / 16), the pattern repeating every 8 x span bytes)."""
    address = dst + row * inner_bytes + inner_byte
    return address ^ (((address >> 7) & (span // 16 - 1)) << 4)


@pytest.mark.parametrize("rows, cols", [(128, 32), (32, 128), (64, 64), (16, 256), (64, 16), (64, 192)])
def test_tma_boxes_write_the_canonical_tile_the_descriptor_reads(rows, cols):
    tile = layouts.CanonicalTile(rows, cols, 2)
    boxes = tile.tma_boxes()
    assert len(boxes) == tile.atoms and all(b.rows == rows and b.cols * 2 == tile.width for b in boxes)
    assert all(b.offset % tile.alignment == 0 for b in boxes)  # each box on its swizzle's period
    for r in range(rows):
        for c in range(cols):
            box = boxes[c * 2 // tile.width]
            written = tma_write(box.offset, r, (c - box.col) * 2, box.cols * 2, tile.tma_swizzle)
            assert written == tile.offset(r, c) == isa_canonical(rows, cols, 2, r, c) == tile.tma_offset(r, c)


# ---- the tensor map's arguments, against the driver API -------------------------------------


def test_the_enums_are_the_driver_apis():
    cuda_driver = pytest.importorskip("cuda.bindings.driver")
    swizzle = cuda_driver.CUtensorMapSwizzle
    assert {span: int(v) for span, v in [(0, swizzle.CU_TENSOR_MAP_SWIZZLE_NONE), (32, swizzle.CU_TENSOR_MAP_SWIZZLE_32B),
                                         (64, swizzle.CU_TENSOR_MAP_SWIZZLE_64B), (128, swizzle.CU_TENSOR_MAP_SWIZZLE_128B)]} == driver.TENSOR_MAP_SWIZZLE
    types = cuda_driver.CUtensorMapDataType
    assert driver.TENSOR_MAP_DATA_TYPE["bf16"] == int(types.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)
    assert driver.TENSOR_MAP_DATA_TYPE["f16"] == int(types.CU_TENSOR_MAP_DATA_TYPE_FLOAT16)
    assert driver.TENSOR_MAP_DATA_TYPE["f32"] == int(types.CU_TENSOR_MAP_DATA_TYPE_FLOAT32)
    assert driver.INTERLEAVE_NONE == int(cuda_driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE)
    assert driver.L2_PROMOTION[128] == int(cuda_driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B)
    assert driver.OOB_FILL_ZEROS == int(cuda_driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)


def test_a_tensor_map_is_innermost_first_with_byte_strides_of_the_outer_dimensions():
    m = driver.tiled_tensor_map("bf16", (200, 72), (128, 32), 64)  # A[m k] at m 200, k 72: 128 x 32 boxes
    assert m.rank == 2 and m.global_dim == (72, 200) and m.global_strides == (144,) and m.box_dim == (32, 128)
    assert m.element_strides == (1, 1) and m.swizzle == 2 and m.interleave == 0 and m.oob_fill == 0
    m3 = driver.tiled_tensor_map("f32", (3, 5, 8), (1, 2, 4), 0)
    assert m3.global_dim == (8, 5, 3) and m3.global_strides == (32, 160) and m3.box_dim == (4, 2, 1)
    assert len(m3.words()) == 2 + 3 + 2 + 3 + 3 + 4


@pytest.mark.parametrize("shape, box, swizzle, what", [
    ((64, 256), (64, 128), 128, "exceeds the 128-byte swizzle span"),  # 128 values of bf16 = 256 bytes
    ((64, 36), (64, 32), 64, "multiples of 16"),                       # rows of 72 bytes
    ((64, 64), (300, 64), 128, "1 .. 256"),                            # a box dimension over 256
    ((64, 64), (64, 4), 0, "multiple of 16"),                          # an inner box of 8 bytes
    ((64, 64), (64, 64), 16, "swizzle"),                               # no such span
])
def test_the_driver_apis_rules_refuse_a_map(shape, box, swizzle, what):
    with pytest.raises(ValueError, match=what):
        driver.tiled_tensor_map("bf16", shape, box, swizzle)


def test_encode_tiled_passes_the_arguments_in_the_driver_apis_order(monkeypatch):
    """Without libcuda: the C call napkin makes (a 64-byte aligned map, then the arguments in
    cuTensorMapEncodeTiled's order), recorded by a stand-in for the driver's entry point."""
    import ctypes

    calls = []

    def encode(*args):
        calls.append(args)
        return 0  # CUDA_SUCCESS

    monkeypatch.setattr(driver, "_libcuda", lambda: encode)
    m = driver.tiled_tensor_map("bf16", (72, 136), (32, 64), 128)
    made = driver.encode_tiled(m, 0x7F0000001000)
    (args,) = calls
    where, dtype, rank, address, dims, strides, box, steps, interleave, swizzle, l2, oob = args
    assert where == made.address and where % 64 == 0  # the driver API: "tensorMap address must be aligned to 64 bytes"
    assert (dtype, rank, address) == (9, 2, 0x7F0000001000)  # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    assert list(dims) == [136, 72] and list(strides)[:1] == [272] and list(box) == [64, 32] and list(steps) == [1, 1]
    assert (interleave, swizzle, l2, oob) == (0, 3, 2, 0)  # NONE, 128B, L2_128B, OOB_FILL_NONE
    (value,) = driver._kernel_parameters([made])[1]
    assert ctypes.sizeof(value) == 128 and ctypes.addressof(value) == made.address  # the parameter's bytes are the map
    with pytest.raises(ValueError, match="16-byte aligned"):
        driver.encode_tiled(m, 0x1008)


# ---- the plan and the host's maps -----------------------------------------------------------


def _program(**sizes):
    return napkin.load(MATMUL)["matmul"].gpu_program("H100", **sizes)


def test_matmul_plans_tma_boxes_for_both_operands_and_the_host_encodes_their_maps():
    from napkin_dsl.backends import cuda

    program = _program(m=200, n=136, k=72)
    plan = selection(program, program.launches[0], "sm_90a").plan
    loads = {load.array: load for load in plan.tma}
    # A[m k]: 128 rows of k 32 (64 bytes: 64B swizzle), one box; B[k n]: k 32 rows of n 128, two 128B boxes
    assert (loads["A"].box_rows, loads["A"].box_cols, loads["A"].boxes, loads["A"].swizzle) == (128, 32, 1, 64)
    assert (loads["B"].box_rows, loads["B"].box_cols, loads["B"].boxes, loads["B"].swizzle) == (32, 64, 2, 128)
    assert plan.stages >= 2 and not plan.tma_declined
    (maps,) = cuda.tensor_map_arguments(program, select_program(program, "sm_90a"))
    assert [name for name, _ in maps] == [load.array for load in plan.tma]
    by = dict(maps)
    assert by["A"].global_dim == (72, 200) and by["A"].global_strides == (144,) and by["A"].box_dim == (32, 128)
    assert by["B"].global_dim == (136, 72) and by["B"].global_strides == (272,) and by["B"].box_dim == (64, 32)
    assert by["B"].swizzle == driver.TENSOR_MAP_SWIZZLE[128] and by["A"].swizzle == driver.TENSOR_MAP_SWIZZLE[64]
    assert cuda.tensor_map_arguments(program, select_program(program, "sm_90")) == [[]]


BMM = """kernel bmm(A: bf16[b m k], B: bf16[b k n]) -> C: f32[b m n]:
    C[b m n] = A[b m k] * B[b k n]

relabel bmm on H100:
    smem: group b 1, m 128, n 128; stream k 32
"""


def test_a_batched_operand_goes_by_a_rank_3_map_with_a_box_of_one_batch():
    from napkin_dsl.backends import cuda

    program = napkin.load(BMM)["bmm"].gpu_program("H100", b=2, m=130, n=136, k=72)
    chosen = selection(program, program.launches[0], "sm_90a")
    assert chosen.path == "wgmma" and not chosen.plan.tma_declined
    by = dict(cuda.tensor_map_arguments(program, select_program(program, "sm_90a"))[0])
    assert by["A"].global_dim == (72, 130, 2) and by["A"].global_strides == (144, 144 * 130) and by["A"].box_dim == (32, 128, 1)
    assert by["B"].global_dim == (136, 72, 2) and by["B"].global_strides == (272, 272 * 72) and by["B"].box_dim == (64, 32, 1)
    source, _ = cuda.generate(program, arch="sm_90a")
    kernel = source.split("__global__")[-1]
    assert "NK_TMA_3D(" in kernel and "cp.async.cg" not in kernel


def test_an_array_of_six_axes_keeps_cp_async_saying_why():
    text = """kernel t(A: bf16[a b c e m k], B: bf16[k n]) -> C: f32[a b c e m n]:
    C[a b c e m n] = A[a b c e m k] * B[k n]

relabel t on H100:
    smem: group a 1, b 1, c 1, e 1, m 128, n 128; stream k 32
"""
    program = napkin.load(text)["t"].gpu_program("H100", a=1, b=2, c=1, e=1, m=128, n=128, k=64)
    chosen = selection(program, program.launches[0], "sm_90a")
    assert chosen.path == "wgmma" and not chosen.plan.tma
    assert "6 axes in memory" in chosen.plan.tma_declined
    from napkin_dsl.backends import cuda

    source, kernels = cuda.generate(program, arch="sm_90a")
    assert "cp.async.cg" in source and "NK_TMA_" not in source.split("__global__")[-1]
    assert any("not TMA: " in line and "6 axes in memory" in line for line in kernels[0].paths)


# ---- the compiled kernel --------------------------------------------------------------------


def test_the_sm_90a_kernel_takes_tensor_maps_and_its_producer_loop_issues_the_boxes():
    """The producer warpgroup's loop (backends/pipeline.py; the consumers' is tests/test_pipeline.py's):
    A's box and B's two by UTMALDG, after the wait on the stage's empty mbarrier and the arrive
    with expect_tx on its full one, and no product."""
    pytest.importorskip("cuda.bindings")
    from napkin_dsl.backends import sass

    compiled = napkin.load(MATMUL)["matmul"].compile("sm_90a", hardware="H100", m=8192, n=8192, k=8192)
    (resources,) = compiled.resources.values()
    assert resources["spill_bytes"] == 0
    kernel = compiled.source.split("napkin_matmul_0(")[1]
    assert "const __grid_constant__ CUtensorMap nk_tmap_B, const __grid_constant__ CUtensorMap nk_tmap_A" in kernel.split("{")[0]
    assert "NK_CP16(" not in kernel and "NK_FENCE_PROXY_ASYNC" not in kernel
    try:
        listing = sass.disassemble(compiled.image)
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm")
    (instructions,) = listing.values()
    opcodes = collections.Counter(i.opcode.split(".")[0] for i in instructions)
    assert opcodes["LDL"] == opcodes["STL"] == 0 and opcodes["LDGSTS"] == 0  # no local memory, no cp.async
    body = _chunk_loop(instructions, "UTMALDG")
    hot = collections.Counter(i.opcode.split(".")[0] for i in body)
    assert hot["UTMALDG"] == 3 and hot["HGMMA"] == 0, hot
    syncs = [i.opcode for i in body if i.opcode.startswith("SYNCS")]
    assert sorted(set(syncs)) == ["SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK.TRANS64.TRYWAIT"], syncs
    assert all(i.operands.startswith("2D") or "[" in i.operands for i in body if i.opcode.startswith("UTMALDG"))


def _chunk_loop(instructions, opcode: str = "HGMMA"):
    """The loop the ``opcode`` instructions run in: of the loops (ptxas wraps each UTMALDG in a
    one-trip ELECT loop, and may move a try_wait's retry out of line, whose unconditional branch
    back makes a range that is no loop), the one holding the most of them, the smallest of those."""
    from napkin_dsl.backends import sass

    return max(sass.closed_loops(instructions), key=lambda body: (sum(i.opcode.startswith(opcode) for i in body), -len(body)))


# ---- the emulation: the TMA ring on PoCL ----------------------------------------------------


@pytest.mark.parametrize("sizes", [dict(m=200, n=136, k=72), dict(m=130, n=264, k=40), dict(m=64, n=16, k=16)], ids=str)
def test_the_emulated_tma_ring_computes_a_times_b_at_ragged_sizes(sizes):
    from napkin_dsl.backends import opencl

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    source, _ = opencl.generate(_program(**sizes), arch="sm_90a")
    assert "NK_TMA_2D(" in source and "NK_MBAR_WAIT(" in source and "NK_CP16(" not in source.split("__kernel")[1]
    out, reference = _run_opencl(sizes)
    assert np.abs(out - reference).max() <= 1e-4 * max(1.0, np.abs(reference).max())


def _swap_strides(original):
    def wrong(dtype, shape, box, swizzle, *rest):
        m = original(dtype, shape, box, swizzle, *rest)
        from dataclasses import replace

        return replace(m, global_dim=m.global_dim[::-1])
    return wrong


@pytest.mark.parametrize("bug", ["swapped dims", "128B as 64B", "bytes short"])
def test_the_emulation_sees_an_encoder_bug(monkeypatch, bug):
    """A wrong result, or the roles' deadlock (bytes short: a full barrier's tx-count never
    returns to zero). The ring's phase bugs are tests/test_pipeline.py's."""
    from napkin_dsl.backends import opencl
    from napkin_dsl.backends import wgmma
    from napkin_dsl.paths.wgmma import TmaLoad

    if bug == "swapped dims":
        monkeypatch.setattr(wgmma, "tiled_tensor_map", _swap_strides(driver.tiled_tensor_map))
    elif bug == "128B as 64B":
        monkeypatch.setitem(driver.TENSOR_MAP_SWIZZLE, 128, driver.TENSOR_MAP_SWIZZLE[64])
    else:
        monkeypatch.setattr(TmaLoad, "bytes", property(lambda self: self.box_rows * self.box_cols * self.element_bytes))
    def fails(seed: int) -> bool:
        monkeypatch.setenv("NAPKIN_EMULATE_SEED", str(seed))
        try:
            out, reference = _run_opencl(dict(m=128, n=128, k=320))  # 10 chunks: the ring wraps
        except opencl.RolesFailure as failure:
            assert "deadlock: " in str(failure)
            return True
        return not np.allclose(out, reference, atol=1e-2)
    # bytes short completes a stage's phase before its last box lands: a read the adversary
    # catches where it lands that box in a later round than the others (a seed in three)
    assert any(fails(seed) for seed in (1, 2, 3))
