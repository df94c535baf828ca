"""isel.py: what mutation testing found unchecked (benchmarks/mutation.md).

Each refusal is checked on a warp tile that breaks exactly one of its rules, and the plan's
derived counts (warps, threads, B-tile readers) against the arithmetic of the mma.sync and
wgmma instructions.
"""

from __future__ import annotations

import dataclasses

import pytest

import napkin_dsl as napkin
from napkin_dsl import isel
from napkin_dsl.paths import MmaSyncPlan

from .conftest import EXAMPLES


ARCH = "sm_90"  # the mma.sync rules (the H100 profile's own arch, sm_90a, builds wgmma where it can)


def attention(group_q: int, warp_q: int):
    source = (EXAMPLES / "attention.napkin").read_text().replace("q 128", f"q {group_q}") + f"    registers: group q {warp_q}\n"
    (kernel,) = napkin.load(source).values()
    program = kernel.gpu_program(None, b=1, h=1, q=512, x=128, d=64)
    return isel.selection(program, program.launches[0], ARCH)


@pytest.mark.parametrize(
    "group_q, warp_q, broken",
    [
        (96, 24, "24 rows are not whole 16-row fragments (96 = 4 x 24 warps)"),
        (128, 48, "48 rows do not divide 128 (48 is 3 fragments; 2 warps)"),
        (256, 16, "256 / 16 = 16 warps, over the 8 of a block"),
    ],
)
def test_a_warp_tile_breaking_one_rule_is_refused(group_q, warp_q, broken):
    chosen = attention(group_q, warp_q)
    assert chosen.path == "fma", broken
    assert chosen.reason.startswith(f"warp tiles of {warp_q} rows do not split the q tile of {group_q}"), chosen.reason


@pytest.mark.parametrize("group_q, warp_q", [(128, 16), (128, 32), (256, 32), (96, 32), (64, 16)])
def test_a_warp_tile_keeping_every_rule_is_taken(group_q, warp_q):
    chosen = attention(group_q, warp_q)
    assert chosen.path == "mma.sync", chosen.reason
    assert chosen.plan.warp_rows == warp_q
    assert chosen.plan.row_warps == group_q // warp_q
    assert chosen.plan.threads == 32 * (group_q // warp_q)  # one warp of 32 threads per warp tile


@pytest.mark.parametrize("row_tile, mma_sync, wgmma", [(16, 1, 1), (64, 4, 1), (80, 5, 2), (96, 6, 2), (128, 8, 2)])
def test_b_tiles_are_read_once_per_warp_on_mma_sync_and_once_per_warpgroup_of_four_on_wgmma(row_tile, mma_sync, wgmma):
    # 16-row warp tiles: row_tile / 16 warps; a wgmma warpgroup is 4 warps, so ceil(warps / 4) readers
    plan = isel.TensorPlan(row="q", row_tile=row_tile, warp_rows=16, dtype="bf16")
    assert plan.row_warps == row_tile // 16
    assert plan.b_readers == mma_sync
    assert dataclasses.replace(plan, instruction="wgmma").b_readers == wgmma == -(-(row_tile // 16) // 4)


def test_plan_pieces_are_hashable_values():
    mma = isel.Mma(a="Q", a_in_registers=False, a_trans=False, b="K", b_trans=False, k="d", n="x", dtype="bf16")
    assert {mma, dataclasses.replace(mma)} == {mma}
    with pytest.raises(dataclasses.FrozenInstanceError):
        mma.k = "x"
    operand = isel.Operand(array="K", rows="x", cols="d", streamed=True)
    assert {operand, dataclasses.replace(operand)} == {operand}


def test_operands_carrying_the_streamed_axis_are_the_streamed_ones():
    # attention streams x: K[x d] and V[x d] arrive chunk by chunk (double-buffered), Q[q d] once
    plan = attention(128, 16).plan
    assert plan.stream == "x"
    assert {name: operand.streamed for name, operand in plan.operands.items()} == {"Q": False, "K": True, "V": True}
    assert {name: (operand.rows, operand.cols) for name, operand in plan.operands.items()} == {
        "Q": ("q", "d"), "K": ("x", "d"), "V": ("x", "d")}


def test_attention_mmas_read_k_by_rows_and_v_transposed():
    # S[q x] = Q[q d] K[x d]: B = K is the (k = d, n = x) operand stored n-major, read as is;
    # O[q d] = P[q x] V[x d]: B = V is (k = x, n = d) stored k-major, read with ldmatrix .trans;
    # P is the S accumulator, already in registers as the A fragment.
    mmas = attention(128, 16).plan.mmas
    got = {t: (m.a, m.a_in_registers, m.a_trans, m.b, m.b_trans, m.k, m.n, m.dtype) for t, m in mmas.items()}
    assert got == {"S": ("Q", False, False, "K", False, "d", "x", "bf16"), "O": ("P", True, False, "V", True, "x", "d", "bf16")}


def matmul_plan(group_m: int, group_n: int):
    source = (EXAMPLES / "matmul.napkin").read_text().replace("group m 128, n 128", f"group m {group_m}, n {group_n}")
    (kernel,) = napkin.load(source).values()
    program = kernel.gpu_program(None, m=512, n=512, k=64)
    return isel.selection(program, program.launches[0], ARCH)


# The 2-D warp grid minimises the tile reads, row_tile x warp columns + col_tile x warp rows, over
# grids of whole fragments (warp rows multiples of 16, warp columns of 16) with at most 8 warps whose
# f32 accumulators fit the budget of 160 per thread, preferring 4 or more warps. Worked by hand:
#  128 x 16:  columns 16 only; 8 x 1 warps read 128 + 16 x 8 = 256, 4 x 1 read 128 + 64 = 192 -> 32 x 16
#  32 x 32:   4 warps only as 2 x 2 (16 x 16 each)
#  128 x 256: 32768 accumulators need 8 warps (4 would hold 256 a thread); of the 8-warp grids
#             8x1: 128 + 2048, 4x2: 256 + 1024, 2x4: 512 + 512, 1x8: 1024 + 256 -> 2 x 4 of 64 x 64
@pytest.mark.parametrize("group_m, group_n, warp_rows, warp_cols, warps",
                         [(128, 16, 32, 16, 4), (32, 32, 16, 16, 4), (128, 256, 64, 64, 8)])
def test_the_warp_grid_minimises_tile_reads(group_m, group_n, warp_rows, warp_cols, warps):
    chosen = matmul_plan(group_m, group_n)
    assert chosen.path == "mma.sync", chosen.reason
    plan = chosen.plan
    assert (plan.split, plan.warp_rows, plan.warp_cols, plan.warps) == ("n", warp_rows, warp_cols, warps)


def test_a_tile_no_grid_of_eight_warps_holds_is_refused():
    # 256 x 256 f32 accumulators over at most 8 warps: 256 a thread, over the budget of 160
    chosen = matmul_plan(256, 256)
    assert chosen.path == "fma"
    assert chosen.reason.startswith("no warp grid of whole fragments splits the 256 x 256 tile")


def test_mlp_shared_memory_layout_by_hand():
    # mlp on H100: group b 128, n 128; stream k 32. X[b k] and W[k n] stream (three cp.async
    # stages each, swizzled, 128-byte aligned: a 512-clock chunk, isel.stage_count); bias[n] is
    # read elementwise: one plain row-major tile.
    from napkin_dsl.cost import columns

    (kernel,) = napkin.load(EXAMPLES / "mlp.napkin").values()
    program = kernel.gpu_program(None, b=256, k=64, n=256)
    plan = isel.selection(program, program.launches[0], ARCH).plan
    assert plan.plain == ("bias",)
    slots, total = isel.smem_layout(plan, isel.launch_tiles(program.launches[0])[0], program.diagram)
    bf16 = 2
    w = x = 32 * 128 * bf16
    assert {n: (s.offset, s.stage_bytes, s.stages) for n, s in slots.items()} == {
        "W": (0, w, 3), "X": (3 * w, x, 3), "bias": (3 * w + 3 * x, 128 * bf16, 1)}
    assert total == 3 * w + 3 * x + 128 * bf16
    shown = {row["resident"].get("smem") for row in columns(program, isel.select_program(program, ARCH))}
    assert shown == {"W[32 128] x3 + X[128 32] x3 + bias[128]"}


MATVEC = """
kernel mv(A: f32[a b], v: f32[b]) -> y: f32[a]:
    y[a] = A[a b] * v[b]
"""


def test_register_blocks_need_a_free_axis_of_each_operand():
    # C[m n] = A[m k] B[k n]: m only in A, n only in B -> register blocks over (m, n);
    # y[a] = A[a b] v[b]: v has no free axis -> no register block (single outputs per thread)
    (matmul,) = napkin.load(EXAMPLES / "matmul.napkin").values()
    (s,) = matmul.diagram.statements
    assert isel.register_tile_axes(s.box, s.axes, {"m": 64, "n": 64, "k": 32}) == ("m", "n")
    assert isel.register_tile_axes(s.box, s.axes, {"m": 1, "n": 64, "k": 32}) is None  # m not tiled
    (mv,) = napkin.load(MATVEC).values()
    (s,) = mv.diagram.statements
    assert isel.register_tile_axes(s.box, s.axes, {"a": 64, "b": 32}) is None


def test_a_warp_grid_holding_exactly_the_fragment_budget_is_taken():
    # registers: group m 16, n 320 -> each warp holds 16 x 320 f32 accumulators over 32 lanes:
    # 160 a thread, the budget exactly (isel.FRAGMENT_BUDGET); 32 x 256 would hold 256 and is refused
    source = (EXAMPLES / "matmul.napkin").read_text().replace("group m 128, n 128", "group m 64, n 320")
    (kernel,) = napkin.load(source + "    registers: group m 16, n 320\n").values()
    program = kernel.gpu_program(None, m=512, n=640, k=64)
    chosen = isel.selection(program, program.launches[0], ARCH)
    assert chosen.path == "mma.sync", chosen.reason
    assert 16 * 320 // 32 == isel.FRAGMENT_BUDGET
    source = (EXAMPLES / "matmul.napkin").read_text().replace("group m 128, n 128", "group m 64, n 256")
    (kernel,) = napkin.load(source + "    registers: group m 32, n 256\n").values()
    program = kernel.gpu_program(None, m=512, n=640, k=64)
    assert isel.selection(program, program.launches[0], ARCH).path == "fma"


def test_a_priced_path_is_described_as_priced_not_built():
    """A what-if path (attention on sm_90 priced as wgmma) keeps mma.sync's layout: its header
    line says it is priced and not built, not which mma.sync instruction would print."""
    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    program = kernel.gpu_program(None, b=1, h=1, q=512, x=128, d=64)
    chosen = isel.select_program(program, ARCH, path="wgmma")[0]
    assert type(chosen.plan) is MmaSyncPlan and not chosen.plan.built
    assert isel.describe(chosen, program.launches[0])[0] == (
        "S: wgmma (priced, not built) bf16 -> f32, A = Q from shared memory, B = K from shared memory")


def test_a_tma_box_of_256_rows_is_the_largest_taken():
    """A 256-row tile of A (four warpgroups of 64 rows) is one TMA box of 256 rows, the limit
    (MAX_TMA_BOX inclusive); the wgmma plan copies it by TMA."""
    source = (EXAMPLES / "matmul.napkin").read_text()
    (kernel,) = napkin.load(source).values()
    wide = kernel.relabelled("smem: group m 256, n 64; stream k 32")
    program = wide.gpu_program(None, m=512, n=128, k=128)
    chosen = isel.select_program(program, "sm_90a")[0]
    assert chosen.path == "wgmma" and chosen.plan.row_tile == 256, chosen.declined or chosen.reason
    assert not chosen.plan.tma_declined and {load.array: load.box_rows for load in chosen.plan.tma}["A"] == 256
