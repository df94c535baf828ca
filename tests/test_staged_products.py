"""Products whose rows are not the plan's (issue 47): FlashAttention-2's dQ = dS^T K in the launch
grouped over the keys x. The plan's rows are x (dK, dV and the fragments S, P, dS); dQ's are the
streamed queries q. Its A operand, dS, is a fragment over (x, q): each thread writes its values to
a shared tile of their own (``paths.plan.staged_slot``), and the product reads them back k-major by
ldmatrix .trans, on a warp grid of its own over (q, d) (``TensorPlan.grids``); each key group adds
its product into dQ in device memory (``relabel.summed_over_groups``).
"""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import isel
from napkin_dsl.backends import opencl
from napkin_dsl.backends.numpy import execute, random_arguments
from napkin_dsl.backends.tensorcore import TensorPrinter
from napkin_dsl.cost import columns, cost_of
from napkin_dsl.paths.plan import WarpGrid, shared_reads, staged_slot
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES, assert_matches_reference
from .test_numpy_backend import assert_counts_equal_report
from .test_opencl import run_on_pocl

# The key launch in miniature: S over (q, x), dK from S in registers, dQ from S staged.
KEYS = """kernel keys(Q: bf16[q d], K: bf16[x d]) -> (dK: bf16[x d], dQ: f32[q d]):
    S[q x] = K[x d] * Q[q d]
    dK[x d] = S[q x] * Q[q d]
    dQ[q d] @gmem = S[q x] * K[x d]

relabel keys on H100:
    smem: group x 64; stream q 32
"""


def _kernel(text: str = KEYS) -> napkin.Kernel:
    (kernel,) = napkin.load(text).values()
    return kernel


def _plan(text: str = KEYS, **sizes):
    program = _kernel(text).gpu_program(None, **sizes)
    chosen = isel.select_program(program, "sm_80")[0]
    return program, chosen


def test_the_plan_stages_s_for_dq_on_a_grid_of_its_own():
    _, chosen = _plan(q=256, x=256, d=64)
    plan = chosen.plan
    assert chosen.path == "mma.sync" and plan.row == "x" and plan.warps == 4
    dq = plan.mmas["dQ"]
    assert dq.staged and dq.a == "S" and dq.a_trans and not dq.a_in_registers and dq.k == "x" and dq.n == "d"
    assert dq.b == "K" and dq.b_trans  # K[x d]: k rows, n fastest
    assert not plan.mmas["dK"].staged and plan.mmas["dK"].a_in_registers
    # 32 x 64 over 4 warps: 32 x 16 tiles read K once and S four times, as 16 x 32 tiles do
    assert plan.grids == {"dQ": WarpGrid("q", 32, 16, "d", 64, 32)} or plan.grids == {"dQ": WarpGrid("q", 32, 32, "d", 64, 16)}
    laid = plan.laid_out("dQ")
    assert (laid.row, laid.split, laid.warps) == ("q", "d", plan.warps) and plan.laid_out("dK") is plan
    slot = chosen.slots[staged_slot("S")]
    assert (slot.tile.rows, slot.tile.cols, slot.tile.element_bytes, slot.stages) == (64, 32, 2, 1)


def test_the_arena_holds_the_staged_tile_as_the_model_counts_it():
    program, chosen = _plan(q=256, x=256, d=64)
    selected = isel.select_program(program, "sm_80")
    report = cost_of(program, arch="sm_80", selected=selected, check=False)
    assert int(report.levels["smem"].M_bytes) == chosen.smem_bytes
    assert all("S.staged[32 64]" in row["resident"]["smem"] for row in columns(program, selected))


def test_the_staged_products_traffic_is_counted_once_by_the_model_and_the_numpy_backend():
    """ldmatrix reads of the staged S (once per warp column of dQ's grid) and of K (once per warp
    row), and the staging writes of S: the NumPy backend counts what the model prices."""
    program, chosen = _plan(q=50, x=100, d=32)
    plan = chosen.plan
    extent = {"q": 32, "x": 64, "d": 32}
    values = shared_reads(plan, "dQ", lambda axes: int(np.prod([extent[a] for a in axes])))
    laid = plan.laid_out("dQ")
    assert values == 64 * 32 * laid.row_warps + 32 * 64 * laid.col_warps + 32 * 64
    kernel = _kernel()
    sizes = dict(q=50, x=100, d=32)
    selected = isel.select_program(program, "sm_80")
    arrays, scalars = random_arguments(kernel.diagram, sizes, 0)
    outputs, counts = execute(program, arrays, scalars, selected=selected)
    want = evaluate(kernel.diagram, arrays, scalars, sizes, keep_float64=True)
    np.testing.assert_allclose(outputs["dQ"].astype(np.float64), want["dQ"], rtol=2e-2, atol=2e-2)
    assert_counts_equal_report(counts, cost_of(program, arch="sm_80", selected=selected, check=False))


@pytest.mark.parametrize("sizes", [dict(q=50, x=100, d=32), dict(q=64, x=128, d=64), dict(q=33, x=70, d=32)],
                         ids=["ragged", "whole", "one-row-tail"])
def test_the_staged_product_matches_the_reference_on_pocl(sizes, opencl_device):
    program, outputs = run_on_pocl(KEYS, "keys", ["mma.sync"], arch="sm_80", **sizes)
    source, _ = opencl.generate(program, arch="sm_80")
    assert "NK_LDSM_T(a[mt], " in source and "nk_atomic_add_f32(&g_dQ[" in source


def test_the_key_launch_grouped_by_x_never_reads_s_non_transposed():
    source, _ = opencl.generate(_kernel().gpu_program(None, q=64, x=128, d=64), arch="sm_80")
    staged = source.split("// dQ[q d] = S[q x] * K[x d]", 1)[1].split("// add dQ", 1)[0]
    assert staged.count("NK_SYNC();") == 2  # the tile is free before the writes, whole before the reads
    assert "const int nk_wrow = (nk_warp / " in staged and "NK_LDSM(" not in staged


def _plant(monkeypatch, old: str, new: str):
    emit = TensorPrinter.emit

    def planted(self, line=""):
        emit(self, line.replace(old, new))

    monkeypatch.setattr(TensorPrinter, "emit", planted)


@pytest.mark.parametrize("old, new", [
    ("NK_LDSM_T(a[mt], ", "NK_LDSM(a[mt], "),  # the staged S read with its rows as the product's
    ("= NK_PACK_BF16(f_S[mt][nt][2 * h], f_S[mt][nt][2 * h + 1]);",
     "= NK_PACK_BF16(f_S[mt][nt][2 * h], f_S[mt][nt][2 * h]);"),  # a pair staged with its first value twice
    ("const int nk_wrow = (nk_warp / ", "const int nk_wrow_unused = (nk_warp / "),  # the plan's rows as dQ's grid's
], ids=["not transposed", "pair's first value twice", "the plan's warp origin"])
def test_a_planted_bug_in_the_staged_product_is_caught(old, new, monkeypatch, opencl_device):
    _plant(monkeypatch, old, new)
    with pytest.raises(AssertionError):
        run_on_pocl(KEYS, "planted", ["mma.sync"], arch="sm_80", q=64, x=128, d=64)


def test_oclgrind_finds_no_race_or_bad_access_in_the_staging(tmp_path):
    from .test_tensorcore import oclgrind

    source = tmp_path / "keys.napkin"
    source.write_text(KEYS)
    result = oclgrind(str(source), ["q=50", "x=100", "d=32"], "--arch", "sm_80")
    assert result.returncode == 0, result.stderr[-2000:]
    report = result.stdout + result.stderr
    assert "data race" not in report and "Invalid" not in report, report[-2000:]
    errors = [float(line.split()[-1]) for line in result.stdout.splitlines() if " error " in line]
    assert errors and max(errors) < 0.02, result.stdout


# x whole in the block (no group to sum over), and dQ read again in the launch, by F
READ_AGAIN = """kernel keys(Q: bf16[q d], K: bf16[x d]) -> (dK: bf16[x d], F: f32[x d]):
    S[q x] = K[x d] * Q[q d]
    dK[x d] = S[q x] * Q[q d]
    dQ[q d] = S[q x] * K[x d]
    F[x d] = S[q x] * dQ[q d]

relabel keys on H100:
    smem: stream q 32
"""


@pytest.mark.parametrize("text, message", [
    (KEYS.replace("stream q 32", "stream q 16"), "dQ's 16 x 32 tile of q x d has no grid of warp tiles"),
    (READ_AGAIN, "dQ (dQ[q d] does not carry the row axis x) is read here by another statement"),
], ids=["fewer tiles than warps", "read again"])
def test_a_staged_product_that_cannot_be_built_says_why(text, message):
    program = _kernel(text).gpu_program(None, q=64, x=64, d=32)
    reason = isel.select_program(program, "sm_80")[0].reason
    assert message in reason, reason


def test_wgmma_computes_a_staged_product_transposed():
    """On wgmma (FlashAttention-3's dQ): dQ^T = K^T S^T, d on the warpgroup's 64 rows, the chunk's
    queries as N, K read as A' and the staged S as B', both by descriptor, MN-major."""
    program = _kernel().gpu_program(None, q=256, x=256, d=64)
    chosen = isel.select_program(program, "sm_90a")[0]
    plan = chosen.plan
    assert chosen.path == "wgmma" and plan.swapped("dQ") and not plan.swapped("dK")
    assert plan.grids == {"dQ": WarpGrid("d", 64, 16, "q", 32, 32)} and plan.staged_rows("dQ") == "q"
    assert plan.fragments["dQ"].col == "q" and plan.shapes["dQ"] == "m64n32k16"
    slot = chosen.slots[staged_slot("S")]
    assert type(slot.tile).__name__ == "CanonicalTile" and (slot.tile.rows, slot.tile.cols) == (64, 32)
    assert slot.offset % slot.tile.alignment == 0
    # K once, as A' over the warpgroups' rows of d; the staged S written once and read by the one warpgroup
    values = shared_reads(plan, "dQ", lambda axes: int(np.prod([dict(q=32, x=64, d=64)[a] for a in axes])))
    assert values == 64 * 64 + 32 * 64 * 2
    wide = _kernel(KEYS.replace("group x 64", "group x 128")).gpu_program(None, q=256, x=256, d=64)
    refused = isel.select_program(wide, "sm_90a")[0]
    assert refused.path == "mma.sync" and "its d tile (64) is not the x tile (128)" in refused.declined


@pytest.mark.parametrize("synchronous", [True, False], ids=["synchronous", "roles"])
@pytest.mark.parametrize("sizes", [dict(q=50, x=100, d=64), dict(q=33, x=70, d=64)], ids=["ragged", "one-row-tail"])
def test_the_transposed_product_matches_the_reference_on_pocl(sizes, synchronous, opencl_device):
    from .test_opencl import random_inputs

    kernel = _kernel()
    program = kernel.gpu_program(None, **sizes)
    assert isel.select_program(program, "sm_90a", synchronous=synchronous).paths == ("wgmma",)
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(program, inputs, scalars, arch="sm_90a", synchronous=synchronous)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), "keys")
    # no emulation sees a missing proxy fence: each thread fences its staging writes before the barrier
    source, _ = opencl.generate(program, arch="sm_90a", synchronous=synchronous)
    staged = source.split("// dQ[q d] = S[q x] * K[x d]", 1)[1].split("const int nk_wrow", 1)[0]
    assert staged.index("= NK_PACK_BF16(f_S") < staged.index("NK_FENCE_PROXY_ASYNC();") < staged.rindex("NK_SYNC();")


@pytest.mark.parametrize("old, new", [
    ("* 2 / 128) * ", "* 0 / 128) * "),  # every warpgroup reads the first rows of d as A'
    ("= NK_PACK_BF16(f_S[mt][nt][2 * h], f_S[mt][nt][2 * h + 1]);",
     "= NK_PACK_BF16(f_S[mt][nt][2 * h + 1], f_S[mt][nt][2 * h]);"),  # a pair staged in the wrong order
], ids=["one warpgroup's d", "pair swapped"])
def test_a_planted_bug_in_the_transposed_product_is_caught(old, new, monkeypatch, opencl_device):
    from napkin_dsl.backends.wgmma import WgmmaPrinter

    emit = WgmmaPrinter.emit

    def planted(self, line=""):
        emit(self, line.replace(old, new) if isinstance(line, str) else line)

    monkeypatch.setattr(WgmmaPrinter, "emit", planted)
    with pytest.raises(AssertionError):
        run_on_pocl(KEYS.replace("group x 64", "group x 128"), "planted", ["wgmma"], arch="sm_90a", q=64, x=128, d=128)


def test_the_causal_backward_sums_dq_and_matches_the_reference_on_pocl(opencl_device):
    """Masked chunks too: causal attention's backward, dQ summed over the key groups, at ragged
    sizes, its O and L from the forward on the same Q, K and V (random ones overflow exp(S - L))."""
    (forward,) = napkin.load(EXAMPLES / "causal_attention.napkin").values()
    backward = forward.grad(key_stream=32, save_lse=True)
    assert backward.derivation.schedule.summed
    sizes = dict(b=1, h=1, q=70, x=150, d=64)
    program = backward.gpu_program(None, **sizes)
    assert isel.select_program(program).paths[1] == "mma.sync"
    rng = np.random.default_rng(3)
    Q, K, V = (rng.standard_normal((1, 1, sizes[a], 64)).astype(np.float32) for a in "qxx")
    out = evaluate(forward.lse_forward().diagram, dict(Q=Q, K=K, V=V), {}, sizes)
    inputs = dict(Q=Q, K=K, V=V, O=out["O"].astype(np.float32), L=out["L"].astype(np.float32),
                  dO=rng.standard_normal(Q.shape).astype(np.float32))
    inputs = {name: inputs[name] for name in backward.diagram.params}
    outputs = opencl.run(program, inputs, {})
    assert_matches_reference(program, outputs, evaluate(backward.diagram, inputs, {}, sizes), "causal")


def test_a_split_of_the_streamed_queries_beside_the_adds_stays_on_fma_and_says_why():
    """Found by `napkin tune` on the backward: the parts launch of a split q beside dQ's adds (a
    save with no statement) crashed the parts check; it stays on the FMA path, by name."""
    text = KEYS.replace("smem: group x 64; stream q 32", "smem: group x 64; split q 64; stream q 32")
    program = _kernel(text).gpu_program(None, q=256, x=128, d=64)
    chosen = isel.select_program(program, "sm_80")[0]
    assert chosen.path == "fma" and "the parts launch of split q" in chosen.reason, chosen.reason
