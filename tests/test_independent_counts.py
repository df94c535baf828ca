"""Counts derived by hand from the loop structure, not read off the Program (issue 25, item 3).

"The NumPy backend's counted transfers equal the report" is weaker than it reads: both take the
loop trips, the tile sizes, the contraction's unit and the register-level traffic from the same
Program and the same helpers, so a mistake in any of them shows in both at once. Here every
expected number is derived in the test from what the kernel does: the tiles are the relabel
block's (written here again), the trips are ceil-divisions of the sizes by the tiles, a
contraction is 2 FLOPs per multiply-add, what a block loads is written out per array, and the
ldmatrix traffic follows from the warp tiling (each warp reads its rows of A and its columns of
B for every product). The sizes are ragged (no tile divides them), and each kernel runs on both
instruction paths: bf16 on tensor cores, f32 on the FMA path. Both the model
(``kernel.cost``) and the NumPy backend's counts are compared with the hand counts.

The per-element FLOP conventions of the streamed softmax are the model's documented ones
(docs/method.md, boxes.py): per score, one multiply by d^-0.5, one compare for the chunk's max,
one subtract, one exp (special) and one add to the running sum; per row and chunk, the new max,
old - new, exp(old - new) (special), sum * factor and + chunk sum; per output element and
chunk, O.acc *= factor; per output element, one divide at the end.
"""

from __future__ import annotations

import math

import pytest

import napkin_dsl as napkin
from napkin_dsl import isel
from napkin_dsl.backends.numpy import execute, random_arguments
from napkin_dsl.hardware import load_hardware

from .conftest import EXAMPLES

H100 = load_hardware("H100")
SMS = 132  # H100 SMs (the whitepaper's count, written here, not read from the profile)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tiles(size: int, tile: int) -> list[tuple[int, int]]:
    """[start, stop) of each tile of an axis, the last one ragged."""
    return [(start, min(start + tile, size)) for start in range(0, size, tile)]


def example(name: str, dtype: str | None = None, extra: str = ""):
    text = (EXAMPLES / name).read_text()
    if dtype is not None:
        text = text.replace("bf16", dtype)
    (kernel,) = napkin.load(text + extra).values()
    return kernel


# The hand counts follow mma.sync's warps (each warp reads its B tiles by ldmatrix): sm_90, not
# the H100 profile's own sm_90a, where wgmma reads B once per warpgroup.
ARCH = "sm_90"


def counted(kernel, sizes, arch: str = ARCH):
    """The NumPy backend's counts: the values it moved and the FLOPs it evaluated."""
    program = kernel.program("H100", **sizes)
    arrays, scalars = random_arguments(kernel.diagram, sizes, 0)
    _, counts = execute(program, arrays, scalars, selected=isel.select_program(program, arch))
    return program, counts


def paths(program) -> list[str]:
    return [isel.selection(program, launch, ARCH).path for launch in program.launches]


def flops_of(report) -> dict:
    return {unit: int(value) for unit, value in report.flops.items() if int(value)}


def check(kernel, sizes, want: dict, arch: str = ARCH):
    """The model and the NumPy backend against the hand counts ``want``: H per level, M per
    level (values), FLOPs by unit (units absent from ``want["flops"]`` must be absent or 0)."""
    report = kernel.cost("H100", arch=arch, **sizes)
    for level, H in want["H"].items():
        assert int(report.levels[level].H) == H, (level, "H", int(report.levels[level].H), H)
    for level, M in want.get("M", {}).items():
        assert int(report.levels[level].M) == M, (level, "M", int(report.levels[level].M), M)
    assert flops_of(report) == want["flops"]
    program, counts = counted(kernel, sizes, arch)
    for level, H in want["H"].items():
        assert counts.H.get(level, 0) == H, (level, "counted H", counts.H.get(level, 0), H)
    assert {u: int(n) for u, n in counts.flops.items() if int(n)} == want["flops"]
    return report, program


# ---- attention (and causal attention): smem group b 1, h 1, q 128; stream x 64 ------------------

Q_TILE, X_TILE = 128, 64  # the relabel block of examples/attention.napkin and causal_attention.napkin
# Query rows a warp owns (the tensor-core plan): 32, 4 warps over the 128-row tile, for the unmasked
# stream (isel takes the tallest warp tile within the budget); 16, 8 warps, for causal attention's
# masked stream, which keeps 16-row warps.
WARP_ROWS = {False: 32, True: 16}


def attention_counts(b, h, q, x, d, causal: bool, tensor: bool, b_readers: int | None = None,
                     warp_rows: int | None = None, stages: int = 2) -> dict:
    """``b_readers``: how many times a block reads each K and V chunk into the tensor cores (None:
    once per warp, mma.sync's ldmatrix); ``warp_rows``: the rows a warp holds (None: mma.sync's,
    WARP_ROWS); ``stages``: the K and V chunks the block holds at once."""
    warp_rows = warp_rows or WARP_ROWS[causal]
    groups, chunks = tiles(q, Q_TILE), tiles(x, X_TILE)

    def visited(g):  # causal: a chunk whose first key is after the group's last query is never visited
        q0, q1 = g
        return [c for c in chunks if not causal or c[0] <= q1 - 1]

    def partial(g, c):  # causal: some key of the chunk is after some query of the group
        return causal and c[1] - 1 > g[0]

    bh = b * h
    rows_x_width = bh * sum((g1 - g0) * sum(c1 - c0 for c0, c1 in visited((g0, g1))) for g0, g1 in groups)  # scores
    rows_x_chunks = bh * sum((g1 - g0) * len(visited((g0, g1))) for g0, g1 in groups)  # (row, chunk) pairs
    keys_per_group = bh * sum(sum(c1 - c0 for c0, c1 in visited(g)) for g in groups)  # keys a block loads
    tested = bh * sum((g1 - g0) * sum(c1 - c0 for c0, c1 in visited((g0, g1)) if partial((g0, g1), (c0, c1)))
                      for g0, g1 in groups)
    # smem: Q and O once per query; K and V once per visited chunk of every query group
    H_smem = bh * q * d + 2 * keys_per_group * d + bh * q * d
    # l2: everything fits (a few hundred KB), so the derived L2 group is the whole problem:
    # each input crosses once, the output once
    H_l2 = bh * q * d + 2 * bh * x * d + bh * q * d
    products = 2 * rows_x_width * d + 2 * rows_x_width * d  # S = Q K (over d), O = P V (over x)
    fma = (4 * rows_x_width  # scale, chunk max, subtract, running sum
           + 4 * rows_x_chunks  # new max, old - new, sum * factor, + chunk sum
           + rows_x_chunks * d  # O.acc *= factor
           + bh * q * d)  # O = O.acc / sum
    special = rows_x_width + rows_x_chunks  # exp(S - m), exp(old - new)
    if causal:  # where(q >= x, S, -inf): a compare and a select, on the chunks the mask holds in part,
        fma += 2 * 2 * tested  # in the rescale (the chunk's max) and again in the online step
    want = {"H": {"smem": H_smem, "l2": H_l2}, "flops": {"fma": fma, "special": special}}
    if tensor:
        want["flops"]["tensor"] = products
        warps = Q_TILE // warp_rows
        # ldmatrix: per visited chunk every warp reads its rows of Q (A, once: one warp column),
        # and every warp reads the whole K chunk and the whole V chunk (B); P stays in registers
        readers = warps if b_readers is None else b_readers
        want["H"]["registers"] = rows_x_chunks * d + readers * 2 * keys_per_group * d
        # smem per block: the Q tile, and `stages` K and V chunks (double-buffered behind cp.async)
        # registers per thread: S (then P, in place) over warp_rows x 64, O.acc over warp_rows x d,
        # and the running max, sum and factor of the thread's two rows (g and g + 8) per 16
        want["M"] = {"smem": Q_TILE * d + stages * X_TILE * d + stages * X_TILE * d,
                     "registers": (warp_rows * X_TILE + warp_rows * d) // 32 + 3 * 2 * (warp_rows // 16),
                     "l2": 2 * q * d + 2 * x * d}  # one (b, h): Q, K, V, O whole
    else:
        want["flops"]["fma"] += products
        want["H"]["registers"] = 0  # the FMA path moves nothing through ldmatrix
        want["M"] = {"registers": Q_TILE * d // 256}  # O.acc: the 256 threads' register blocks
    return want


@pytest.mark.parametrize("dtype, tensor", [(None, True), ("f32", False)], ids=["bf16-tensor", "f32-fma"])
@pytest.mark.parametrize("name, causal", [("attention.napkin", False), ("causal_attention.napkin", True)])
def test_attention_counts_are_derived_from_the_loops(name, causal, dtype, tensor):
    sizes = dict(b=1, h=2, q=200, x=150, d=64)  # 2 query groups (the last 72 rows), 3 chunks (the last 22 keys)
    kernel = example(name, dtype)
    report, program = check(kernel, sizes, attention_counts(**sizes, causal=causal, tensor=tensor))
    assert paths(program) == (["mma.sync"] if tensor else ["fma"])
    assert int(report.levels["smem"].N) == sizes["b"] * sizes["h"] * cdiv(sizes["q"], Q_TILE)  # thread blocks


@pytest.mark.parametrize("name, causal", [("attention.napkin", False), ("causal_attention.napkin", True)])
def test_attention_counts_on_wgmma_read_k_and_v_once_per_warpgroup(name, causal):
    """The H100 profile's own arch, sm_90a: the same loops on wgmma, whose tensor cores read each K
    and V chunk from shared memory once per warpgroup of four warps: 8 warps of 16 rows, 2 readers."""
    sizes = dict(b=1, h=2, q=200, x=150, d=64)
    kernel = example(name, None)
    warpgroups = Q_TILE // 16 // 4  # a wgmma warp holds 16 rows of its warpgroup's 64
    ring = min(8, cdiv(sizes["x"], X_TILE))  # the producer's ring: every chunk, up to 8 stages
    report, program = check(kernel, sizes, attention_counts(**sizes, causal=causal, tensor=True, b_readers=warpgroups,
                                                            warp_rows=16, stages=ring),
                            arch="sm_90a")
    assert [isel.selection(program, launch, "sm_90a").path for launch in program.launches] == ["wgmma"]


# ---- matmul: smem group m 128, n 128; stream k 32; registers: group m 64, n 32 -----------------

M_TILE, N_TILE, K_TILE = 128, 128, 32
WARP_M, WARP_N = 64, 32  # written in the relabel block below: a 2 x 4 grid of warps


def matmul_counts(m, n, k, tensor: bool, stages: int = 2) -> dict:
    m_groups, n_groups = cdiv(m, M_TILE), cdiv(n, N_TILE)
    # a block (m group, n group) streams its rows of A and its columns of B over every k chunk
    H_smem = m * k * n_groups + k * n * m_groups + m * n
    want = {"H": {"smem": H_smem, "l2": m * k + k * n + m * n}, "flops": {}}
    if tensor:
        want["flops"]["tensor"] = 2 * m * n * k
        row_warps, col_warps = M_TILE // WARP_M, N_TILE // WARP_N
        # each warp reads its WARP_M rows of the A chunk and its WARP_N columns of the B chunk:
        # the block reads A once per warp column and B once per warp row
        want["H"]["registers"] = m * k * n_groups * col_warps + k * n * m_groups * row_warps
        want["M"] = {"smem": stages * (M_TILE * K_TILE + K_TILE * N_TILE),  # A and B chunks, one a stage
                     "registers": WARP_M * WARP_N // 32}  # the warp's f32 C tile, per thread
    else:
        want["flops"]["fma"] = 2 * m * n * k
    return want


@pytest.mark.parametrize("dtype, tensor", [(None, True), ("f32", False)], ids=["bf16-tensor", "f32-fma"])
def test_matmul_counts_are_derived_from_the_loops(dtype, tensor):
    sizes = dict(m=200, n=136, k=72)  # 2 x 2 blocks, both ragged; 3 chunks of k, the last 8 wide
    kernel = example("matmul.napkin", dtype, f"    registers: group m {WARP_M}, n {WARP_N}\n")
    # the cp.async stages are instruction selection's choice (isel.stage_count), not a count: the
    # hand count takes them from the plan and multiplies the chunk it derives
    program = kernel.program("H100", **sizes)
    stages = isel.selection(program, program.launches[0], ARCH).plan.stages if tensor else 2
    assert 2 <= stages <= isel.MAX_STAGES
    report, program = check(kernel, sizes, matmul_counts(**sizes, tensor=tensor, stages=stages))
    assert paths(program) == (["mma.sync"] if tensor else ["fma"])
    if tensor:
        plan = isel.selection(program, program.launches[0]).plan
        assert (plan.row_warps, plan.col_warps) == (M_TILE // WARP_M, N_TILE // WARP_N)


# ---- swiglu: two launches ---------------------------------------------------------------------
# smem for G, U, H: group t 192, f 64; stream m 64 -- smem for Y: group t 64, e 64; stream f 64

T1, F1, M1 = 192, 64, 64
T2, E2, F2 = 64, 64, 64
# The warp tiling of the tensor-core plans: launch 1 splits its 192 rows among 6 warps of 32
# (16-row warps would be 12, over the 8 a block has), each warp the whole 64-wide f tile;
# launch 2 is a 2 x 2 grid of 32 x 32 warp tiles.
GRID1, GRID2 = (6, 1), (2, 2)


def swiglu_counts(t, m, f, e, tensor: bool) -> dict:
    t1, f1 = cdiv(t, T1), cdiv(f, F1)
    t2, e2 = cdiv(t, T2), cdiv(e, E2)
    H1 = t * m * f1 + 2 * m * f * t1 + t * f  # X per f group; W1, W3 per t group; H saved
    H2 = t * f * e2 + f * e * t2 + t * e  # H per e group; W2 per t group; Y saved
    products = 2 * (2 * t * f * m) + 2 * t * e * f  # G, U (over m), Y (over f)
    want = {"H": {"smem": H1 + H2, "l2": (t * m + 2 * m * f + t * f) + (t * f + f * e + t * e)},
            "flops": {"fma": t * f, "special": t * f}}  # H = silu(G) * U: one silu, one multiply
    if tensor:
        want["flops"]["tensor"] = products
        (r1, c1), (r2, c2) = GRID1, GRID2
        # A (X, then H) read once per warp column, B (W1 and W3, then W2) once per warp row
        want["H"]["registers"] = (t * m * f1 * c1 * 2 + 2 * m * f * t1 * r1) + (t * f * e2 * c2 + f * e * t2 * r2)
    else:
        want["flops"]["fma"] += products
    return want


@pytest.mark.parametrize("dtype, tensor", [(None, True), ("f32", False)], ids=["bf16-tensor", "f32-fma"])
def test_swiglu_counts_are_derived_from_the_loops(dtype, tensor):
    sizes = dict(t=200, m=136, f=136, e=72)
    kernel = example("swiglu.napkin", dtype)
    report, program = check(kernel, sizes, swiglu_counts(**sizes, tensor=tensor))
    assert paths(program) == (["mma.sync", "mma.sync"] if tensor else ["fma", "fma"])
    if tensor:
        grids = [(p.row_warps, p.col_warps) for p in (isel.selection(program, lp, ARCH).plan for lp in program.launches)]
        assert grids == [GRID1, GRID2]


# ---- the busy fraction: blocks over SMs, the busiest SM runs ceil(blocks / SMs) blocks ----------


@pytest.mark.parametrize("h", [66, 132, 2, 67])
def test_compute_time_is_the_flops_over_the_peaks_over_the_busy_fraction(h):
    """compute_s = sum over units of FLOPs / peak, over blocks / (ceil(blocks / SMs) x SMs).
    132 and 264 blocks (h = 66, 132; two query groups each) are exact multiples of the SM count,
    where floor + 1 is not ceil; 4 and 134 blocks are not."""
    sizes = dict(b=1, h=h, q=200, x=150, d=64)
    kernel = example("attention.napkin")
    report = kernel.cost("H100", arch=ARCH, **sizes)
    want = attention_counts(**sizes, causal=False, tensor=True)["flops"]
    blocks = h * cdiv(sizes["q"], Q_TILE)
    assert paths(kernel.program("H100", **sizes)) == ["mma.sync"]
    busy = blocks / (math.ceil(blocks / SMS) * SMS)
    seconds = (want["tensor"] / H100.peak("mma.sync", "bf16") + want["fma"] / H100.peak("fma", "f32")
               + want["special"] / H100.peak("special", "f32"))
    assert int(report.levels["smem"].N) == blocks
    assert report.time["compute_s"] == pytest.approx(seconds / busy, rel=1e-9)
