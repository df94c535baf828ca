"""TMA of rank 3-5 for attention on sm_90a (issue 27): K and V into the mbarrier ring, Q by one box.

The driver API's rules for ``cuTensorMapEncodeTiled`` at rank 4 and 5 are written out here from
its documentation, apart from napkin's encoder, and held against the maps the host encodes for
attention's K, V and Q and gqa's five-axis Q. The emulated ``cp.async.bulk.tensor`` (the OpenCL
prelude's ``nk_tma``, which decodes the map's words by its rank) is run alone on PoCL against a
NumPy slice of the array with zeros out of bounds, laid out dense and swizzled as the PTX ISA's
swizzle modes say. Then PoCL runs of the sm_90a attention kernels (masked streams included) with
their K, V and Q by TMA, encoder and phase mutations that must fail them, and NVRTC's SASS.
"""

from __future__ import annotations


import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import driver
from napkin_dsl.isel import select_program, selection

from .conftest import EXAMPLES, assert_matches_reference
from .test_tma import tma_write

BIG = dict(b=4, h=32, q=8192, x=8192, d=128)


def _program(name, **sizes):
    (kernel,) = napkin.load(EXAMPLES / f"{name}.napkin").values()
    return kernel.gpu_program("H100", **sizes)


# ---- the driver API's rules, written here -------------------------------------------------------


def follows_the_driver_apis_rules(m, shape, eb):
    """cuTensorMapEncodeTiled (CUDA driver API, "Tensor Map Object Management"): tensorRank 1..5
    (3..5 if interleaved); globalDim[i] non-zero and at most 2^32; globalStrides, the byte stride of
    each of the lower tensorRank - 1 dimensions above the first, a multiple of 16 below 2^40;
    boxDim[i] non-zero, at most 256, and boxDim[0] * elementSize a multiple of 16 bytes (without
    interleave); elementStrides[i] non-zero, at most 8; with interleave NONE and a swizzle, the inner
    box dimension in bytes at most the swizzle span (32, 64 or 128)."""
    dims = tuple(reversed(shape))
    strides = [eb]
    for d in dims[:-1]:
        strides.append(strides[-1] * d)
    span = {0: None, 1: 32, 2: 64, 3: 128}[m.swizzle]
    return (1 <= m.rank <= 5 and m.global_dim == dims and all(1 <= d <= 2 ** 32 for d in m.global_dim)
            and m.global_strides == tuple(strides[1:]) and all(s % 16 == 0 and s < 2 ** 40 for s in m.global_strides)
            and len(m.box_dim) == m.rank and all(1 <= b <= 256 for b in m.box_dim) and m.box_dim[0] * eb % 16 == 0
            and len(m.element_strides) == m.rank and all(1 <= e <= 8 for e in m.element_strides)
            and m.interleave == 0 and (span is None or m.box_dim[0] * eb <= span))


@pytest.mark.parametrize("name, sizes, ranks", [
    ("attention", dict(b=2, h=3, q=200, x=150, d=64), {"K": 4, "V": 4, "Q": 4}),
    ("attention", dict(b=1, h=2, q=130, x=70, d=128), {"K": 4, "V": 4, "Q": 4}),
    ("gqa", dict(b=1, kv=2, r=3, q=130, x=70, d=32), {"K": 4, "V": 4, "Q": 5}),
    ("causal_attention", dict(b=1, h=2, q=200, x=150, d=64), {"K": 4, "V": 4, "Q": 4}),
])
def test_attentions_maps_follow_the_driver_apis_rules_with_a_box_of_one_head(name, sizes, ranks):
    from napkin_dsl.backends import cuda

    program = _program(name, **sizes)
    plan = selection(program, program.launches[0], "sm_90a").plan
    (maps,) = cuda.tensor_map_arguments(program, select_program(program, "sm_90a"))
    assert {array: m.rank for array, m in maps} == ranks
    d = sizes["d"]
    for array, m in maps:
        shape = tuple(sizes[a] for a in program.diagram.arrays[array].axes)
        assert follows_the_driver_apis_rules(m, shape, 2), (array, m)
        rows = 128 if array == "Q" else 64  # the block's q tile, the stream's x chunk
        atom = min(d, 64)  # a 128-byte swizzle atom of bf16, or the whole row below it
        assert m.box_dim == (atom, rows) + (1,) * (m.rank - 2), (array, m.box_dim)
        assert m.swizzle == driver.TENSOR_MAP_SWIZZLE[atom * 2] and m.oob_fill == driver.OOB_FILL_ZEROS
    loads = {load.array: load for load in plan.tma}
    assert loads["K"].streamed and loads["V"].streamed and not loads["Q"].streamed
    # the printer's coordinates, innermost first: d (its atom column), the rows, then the heads
    source, kernels = cuda.generate(program, arch="sm_90a")
    assert f"TMA {plan.stages} stages for K, V; Q by one TMA copy" in kernels[0].paths[0], kernels[0].paths
    kernel = source.split("__global__")[-1]
    outer = ", o_h, o_b" if name != "gqa" else ", o_kv, o_b"
    # the synchronous ring refills the stage for chunk c + 1; the producer (roles) fills chunk c's
    chunk = "(o_x + 64)" if plan.roles is None else "o_x"
    assert "NK_TMA_4D(nk_tmap_K, g_K, " in kernel and f", 0, {chunk}{outer}, " in kernel
    assert "cp.async.cg" not in kernel and "NK_FENCE_PROXY_ASYNC" not in kernel


# ---- the emulated copy, alone on PoCL --------------------------------------------------------


def _emulated_box(m: driver.TiledTensorMap, data: np.ndarray, coords, box_bytes):
    import pyopencl as cl

    from napkin_dsl.backends import opencl, wgmma

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    ctx, queue = opencl.context()
    words = ", ".join(f"{w}ul" for w in m.words())
    bar = -(-box_bytes // 16) * 16
    source = wgmma._OPENCL_TMA + f"""
__constant ulong nk_map[{len(m.words())}] = {{{words}}};
__kernel void copy(__global const uchar* g, __global uchar* out, __global int* state, int c0, int c1, int c2, int c3, int c4) {{
    __local uchar nk_smem[{bar + 16}];
    if (get_local_id(0) == 0) {{
        for (int i = 0; i < {bar}; ++i) nk_smem[i] = (uchar)0xA5;
        nk_mbar_init(nk_smem, {bar}, 1);
        nk_mbar_arrive_expect_tx(nk_smem, {bar}, {box_bytes});
        nk_tma(nk_smem, nk_map, g, 0, c0, c1, c2, c3, c4, {bar});
        for (int i = 0; i < {bar}; ++i) out[i] = nk_smem[i];
        for (int i = 0; i < 4; ++i) state[i] = ((__local int*)(nk_smem + {bar}))[i];
    }}
}}
"""
    program = cl.Program(ctx, source).build(options=["-cl-std=CL1.2"])
    mf = cl.mem_flags
    g = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(data).view(np.uint8))
    out, state = np.zeros(bar, np.uint8), np.zeros(4, np.int32)
    out_buf, state_buf = cl.Buffer(ctx, mf.WRITE_ONLY, out.nbytes), cl.Buffer(ctx, mf.WRITE_ONLY, state.nbytes)
    c = list(coords) + [0] * (5 - len(coords))
    program.copy(queue, (1,), (1,), g, out_buf, state_buf, *(np.int32(v) for v in c))
    cl.enqueue_copy(queue, out, out_buf)
    cl.enqueue_copy(queue, state, state_buf)
    queue.finish()
    return out[:box_bytes], state


def numpy_box(data: np.ndarray, coords, box, span):
    """The box at ``coords`` (innermost first) of ``data`` (outermost first), zeros outside it, as
    bytes dense innermost first, then each byte moved where the swizzle puts it (tma_write)."""
    starts = list(reversed(coords))
    extent = list(reversed(box))
    block = np.zeros(extent, data.dtype)
    src, dst = [], []
    for axis, (start, n) in enumerate(zip(starts, extent, strict=True)):
        lo, hi = max(start, 0), min(start + n, data.shape[axis])
        src.append(slice(lo, max(lo, hi)))
        dst.append(slice(lo - start, max(lo, hi) - start))
    block[tuple(dst)] = data[tuple(src)]
    dense = block.reshape(-1).view(np.uint8)
    if not span:
        return dense
    row = box[0] * data.itemsize
    placed = np.empty_like(dense)
    for a in range(dense.size):
        placed[tma_write(0, a // row, a % row, row, span)] = dense[a]
    return placed


@pytest.mark.parametrize("shape, box, swizzle, coords", [
    ((2, 3, 150, 64), (1, 1, 64, 64), 128, (0, 128, 2, 1)),     # K's last chunk of one (b, h): rows 150.. zero
    ((2, 3, 150, 32), (1, 1, 64, 32), 64, (0, 64, 1, 0)),       # a whole chunk inside
    ((1, 2, 3, 130, 128), (1, 1, 1, 128, 64), 128, (64, 64, 2, 1, 0)),  # gqa's Q: the second atom column, rows 130.. zero
    ((4, 70, 16), (1, 64, 16), 32, (0, 32, 3)),                 # rank 3, a 32-byte swizzle
    ((3, 40, 24), (1, 32, 8), 0, (16, -8, 1)),                  # no swizzle, rows before 0 zero
])
def test_the_emulated_box_copy_is_a_numpy_slice_swizzled(shape, box, swizzle, coords):
    rng = np.random.default_rng(len(shape) + sum(shape))
    data = rng.integers(1, 1 << 16, size=shape, dtype=np.uint16)  # no zeros: a filled zero is the fill
    m = driver.tiled_tensor_map("bf16", shape, box, swizzle)
    box_bytes = int(np.prod(box)) * 2
    got, state = _emulated_box(m, data, coords, box_bytes)
    expected = numpy_box(data, coords, m.box_dim, swizzle)
    np.testing.assert_array_equal(got, expected)
    assert list(state) == [1, 1, 0, 1]  # the phase completed: its arrival and every byte
    if coords[1] + box[-2] > shape[-2] or coords[1] < 0:
        assert (got == 0).any()  # the out-of-bounds rows are zeros


# ---- PoCL: the sm_90a attention kernels with K, V and Q by TMA ----------------------------------

ONE_WARPGROUP = """
kernel a(Q: bf16[b h q d], K: bf16[b h x d], V: bf16[b h x d]) -> O: bf16[b h q d]:
    S[b h q x] = Q * K * d^-0.5
    P[b h q x] = softmax[x](where(q >= x, S, -inf))
    O[b h q d] = P * V

relabel a on H100:
    smem: group b 1, h 1, q 64; stream x 64
"""


def _run(kernel, sizes):
    from napkin_dsl.backends import opencl
    from napkin_dsl.reference import evaluate

    from .test_tensorcore import random_inputs

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    program = kernel.gpu_program("H100", **sizes)
    plan = selection(program, program.launches[0], "sm_90a").plan
    assert {load.array for load in plan.tma} == {"Q", "K", "V"}, plan.tma_declined
    source, _ = opencl.generate(program, arch="sm_90a")
    body = source.split("__kernel")[1]
    # the synchronous ring's copies, or the producer's through the roles runtime's queue
    assert ("NK_TMA_" in body and "NK_MBAR_WAIT(" in body or "nk_role_tensor_copy(" in body) and "NK_CP16(" not in body
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(program, inputs, scalars, arch="sm_90a")
    return program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes)


@pytest.mark.parametrize("name, sizes", [
    ("attention", dict(b=2, h=2, q=130, x=100, d=32)),        # two warpgroups, ragged q and x, two heads of two batches
    ("gqa", dict(b=1, kv=2, r=2, q=130, x=70, d=32)),         # rank-5 Q, rank-4 K and V shared by r heads
    ("causal_attention", dict(b=1, h=2, q=130, x=190, d=64)),  # masked: chunks past the diagonal skipped
    ("sliding_window", dict(b=1, h=1, q=200, x=330, d=32)),    # masked on both sides: the ring starts late
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{n}" for k, n in v.items()))
def test_attention_by_tma_on_pocl_matches_the_reference(name, sizes):
    (kernel,) = napkin.load(EXAMPLES / f"{name}.napkin").values()
    program, outputs, expected = _run(kernel, sizes)
    assert_matches_reference(program, outputs, expected, name)


def test_causal_attention_of_one_warpgroup_by_tma_on_pocl_matches_the_reference():
    program, outputs, expected = _run(napkin.load(ONE_WARPGROUP)["a"], dict(b=1, h=2, q=150, x=170, d=32))
    plan = selection(program, program.launches[0], "sm_90a").plan
    assert plan.warps == 4 and plan.roles.consumers == 1  # one consumer warpgroup, and the producer
    assert_matches_reference(program, outputs, expected, "causal, one warpgroup")


def _swapped_strides(original):
    def wrong(dtype, shape, box, swizzle, *rest):
        from dataclasses import replace

        m = original(dtype, shape, box, swizzle, *rest)
        s = m.global_strides
        return replace(m, global_strides=(s[0], s[2], s[1], *s[3:])) if len(s) >= 3 else m
    return wrong


def test_attention_on_pocl_sees_a_map_encoder_bug(monkeypatch):
    """A tensor map whose h and b strides are swapped reads another head's keys. (The ring's and
    Q's phase bugs and coordinates outermost first, on the roles that attention builds:
    tests/test_pipeline.py.)"""
    from napkin_dsl.backends import wgmma

    monkeypatch.setattr(wgmma, "tiled_tensor_map", _swapped_strides(driver.tiled_tensor_map))
    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    program, outputs, expected = _run(kernel, dict(b=2, h=2, q=130, x=100, d=32))
    assert not np.allclose(outputs["O"].astype(np.float64), expected["O"].astype(np.float64), atol=1e-2)


# ---- NVRTC: the sm_90a SASS -------------------------------------------------------------------


def test_an_out_of_line_wait_retry_is_not_the_loop_the_mmas_run_in():
    """ptxas may move a try_wait's retry past the epilogue; its unconditional branch back into the
    chunk loop makes a range that crosses the chunk loop's end. ``tensor_loops`` keeps the chunk
    loop and drops that span (which would count the epilogue's stores as the hot loop's)."""
    from napkin_dsl.backends.sass import Instruction, tensor_loops

    code = [Instruction(0x00, "BAR.SYNC"),
            Instruction(0x10, "ELECT"), Instruction(0x20, "UTMALDG.4D"), Instruction(0x30, "BRA.U.ANY", predicate="@P0", target=0x10),
            Instruction(0x40, "SYNCS.PHASECHK.TRANS64.TRYWAIT"), Instruction(0x50, "BRA", predicate="@!P1", target=0xc0),
            Instruction(0x60, "HGMMA.64x64x16.F32.BF16"), Instruction(0x70, "BRA", predicate="@P2", target=0x00),
            Instruction(0x80, "STG.E"), Instruction(0x90, "STG.E"), Instruction(0xa0, "EXIT"),
            Instruction(0xb0, "NOP"),
            Instruction(0xc0, "SYNCS.PHASECHK.TRANS64.TRYWAIT"), Instruction(0xd0, "BRA", predicate="@!P1", target=0xc0),
            Instruction(0xe0, "BRA", target=0x60)]
    assert [[i.address for i in body] for body in tensor_loops(code)] == [list(range(0x00, 0x80, 0x10))]


@pytest.mark.parametrize("name, sizes", [("causal_attention", dict(b=1, h=1, q=330, x=400, d=32)),
                                         ("sliding_window", dict(b=1, h=1, q=330, x=400, d=32))], ids=lambda v: v if isinstance(v, str) else "")
def test_a_three_stage_ring_keeps_every_stages_phase(monkeypatch, name, sizes):
    """The ring's stage count is a plan field (others may change it): at three stages, which the
    chunks a masked block visits do not fill evenly, each fill must still pair with its wait, from
    the first chunk the block visits (a wrong parity reads a stage in flight: NaN)."""
    from napkin_dsl import isel

    monkeypatch.setattr(isel, "ring_stages", lambda *args: 3)
    (kernel,) = napkin.load(EXAMPLES / f"{name}.napkin").values()
    program, outputs, expected = _run(kernel, sizes)
    plan = selection(program, program.launches[0], "sm_90a").plan
    assert plan.stages == 3 and plan.tma and plan.roles is not None
    assert_matches_reference(program, outputs, expected, name)


def test_a_batched_matmul_by_rank_3_maps_on_pocl_matches_a_times_b():
    """Rank 3: the box is one batch of A's and B's tiles; ragged m, n and k read zeros."""
    from napkin_dsl.backends import opencl

    from .test_tma import BMM

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    program = napkin.load(BMM.replace("m 128, n 128; stream k 32", "m 64, n 64; stream k 16"))["bmm"].gpu_program(
        "H100", b=3, m=70, n=72, k=40)
    plan = selection(program, program.launches[0], "sm_90a").plan
    assert sorted((load.array, load.rank) for load in plan.tma) == [("A", 3), ("B", 3)]
    assert "NK_TMA_3D(" in opencl.generate(program, arch="sm_90a")[0]
    rng = np.random.default_rng(7)
    a, b = (rng.integers(-4, 5, size=s).astype(np.float32) for s in ((3, 70, 40), (3, 40, 72)))
    out = opencl.run(program, {"A": a, "B": b}, arch="sm_90a")["C"]
    np.testing.assert_allclose(out, a.astype(np.float64) @ b.astype(np.float64), atol=1e-4)


def test_the_static_ceiling_counts_tmas_writes_into_shared_memory_once_a_block():
    """UTMALDG names no byte count: the ceiling takes the ring's boxes from the plan. Attention's
    consumers take a 64 x 128 bf16 box of K and one of V a chunk (32 KiB), once a block, whatever
    the warps: a fill for each wait on a full barrier in their loop (the producer issues them);
    and the model stays under the ceiling."""
    pytest.importorskip("cuda.bindings")
    from napkin_dsl.backends import sass

    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    compiled = kernel.compile("sm_90a", hardware="H100", **BIG)
    try:
        (entry,) = sass.sass_report(compiled)["launches"]
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm")
    loop = entry["ceiling"]["loop"]
    (instructions,) = sass.disassemble(compiled.image).values()
    body = [i for i in instructions if loop["start"] <= i.address <= loop["end"]]
    chunks = sum(i.opcode.startswith("SYNCS.PHASECHK") for i in body)
    lds = sum(sass.shared_bytes(i.opcode) for i in body if not i.predicate) * loop["warps"]
    assert chunks == 1 and not any(i.base == "UTMALDG" for i in body)
    assert loop["shared_bytes"] == lds + chunks * 2 * 64 * 128 * 2, loop
    assert entry["ceiling"]["model_tflops"] <= entry["ceiling"]["tflops"]
