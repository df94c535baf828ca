"""wgmma with an epilogue, and swiglu's dual GEMM, on sm_90a (issue 27).

A contraction followed by elementwise maps of its accumulator (mlp: ``Y = gelu(H + bias)``), and
two contractions that share their A tiles followed by a map of both (swiglu's first launch: G and
U from X's tiles, then ``H = silu(G) * U``), run their products on ``wgmma.mma_async``: the maps
run on the D fragments as on mma.sync's C fragments (each warp of a warpgroup holds 16 rows of
every accumulator, ``layouts.wgmma_d``). A block takes 1 to 4 warpgroups of 64 rows (swiglu's 192).
Held here: selection (what is taken, what stays on mma.sync and why), NVRTC's sm_90a SASS (HGMMA in
the hot loop, TMA and mbarriers in the kernel, no spills, no local memory) and PoCL runs of the
OpenCL printing, whose wgmma emulation decodes descriptors as the PTX ISA defines them, against the
float64 reference at ragged sizes, and oclgrind on one of them.
"""

from __future__ import annotations

import collections

import pytest

import napkin_dsl as napkin
from napkin_dsl.isel import selection

from .conftest import EXAMPLES, assert_matches_reference

MLP = EXAMPLES / "mlp.napkin"
SWIGLU = EXAMPLES / "swiglu.napkin"


def _program(source, **sizes):
    (kernel,) = napkin.load(source).values()
    return kernel.gpu_program("H100", **sizes)


# ---- selection ------------------------------------------------------------------------------


def test_mlp_and_both_swiglu_launches_are_planned_on_wgmma_for_sm_90a():
    mlp = _program(MLP, b=256, k=64, n=128)
    chosen = selection(mlp, mlp.launches[0], "sm_90a")
    assert chosen.path == "wgmma" and list(chosen.plan.mmas) == ["H"] and chosen.plan.tma
    assert selection(mlp, mlp.launches[0], "sm_90").path == "mma.sync"
    swiglu = _program(SWIGLU, t=512, m=1024, f=2816, e=1024)
    first, second = (selection(swiglu, launch, "sm_90a") for launch in swiglu.launches)
    assert first.path == second.path == "wgmma"
    # the dual GEMM: G and U read the same A (X), each its own B, each its own accumulator
    g, u = first.plan.mmas["G"], first.plan.mmas["U"]
    assert g.a == u.a == "X" and (g.b, u.b) == ("W1", "W3")
    # swiglu's t tile of 192 rows: three consumer warpgroups of four warps, and a producer warpgroup
    assert first.plan.row_tile == 192 and first.plan.warps == 12 and first.plan.roles.consumers == 3 and first.plan.threads == 512


RELABELLED = """
kernel {name}(A: bf16[m k], B: bf16[k n]) -> {out}:
{body}

relabel {name} on H100:
    smem: {smem}
"""


@pytest.mark.parametrize("what, source, reason", [
    ("a reduction after the product",
     RELABELLED.format(name="rowsum", out="s: f32[m]", smem="group m 128; stream k 32",
                      body="    C[m n] = A * B\n    s[m] = sum[n](C)"),
     "also has a reduce"),
    ("five warpgroups",
     RELABELLED.format(name="tall", out="C: bf16[m n]", smem="group m 320, n 64; stream k 32", body="    C[m n] = A * B"),
     "1 to 4 warpgroups"),
])
def test_what_wgmma_does_not_take_stays_on_mma_sync_with_the_reason(what, source, reason):
    program = _program(source, m=640, k=64, n=128)
    chosen = selection(program, program.launches[0], "sm_90a")
    assert chosen.path == "mma.sync" and reason in chosen.declined, (what, chosen.declined)


# ---- the compiled kernels -------------------------------------------------------------------


@pytest.mark.parametrize("source, sizes", [(MLP, dict(b=8192, k=8192, n=8192)),
                                           (SWIGLU, dict(t=512, m=1024, f=2816, e=1024))], ids=["mlp", "swiglu"])
def test_the_epilogue_kernels_compile_for_sm_90a_with_hgmma_tma_and_no_spills(source, sizes):
    pytest.importorskip("cuda.bindings")
    from napkin_dsl.backends import sass

    (kernel,) = napkin.load(source).values()
    compiled = kernel.compile("sm_90a", hardware="H100", **sizes)
    assert [k.path for k in compiled.launches] == ["wgmma"] * len(compiled.launches)
    assert all(r["spill_bytes"] == 0 for r in compiled.resources.values()), compiled.resources
    try:
        listing = sass.disassemble(compiled.image)
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm")
    for entry, instructions in listing.items():
        opcodes = collections.Counter(i.base for i in instructions)
        assert opcodes["LDL"] == opcodes["STL"] == 0, entry  # no local memory
        assert opcodes["UTMALDG"] and opcodes["SYNCS"], (entry, opcodes)  # TMA copies on mbarriers
        ranges = [(s, e) for s, e in sass.loop_ranges(instructions)
                  if any(s <= i.address <= e and i.base == "HGMMA" for i in instructions)]
        assert ranges, f"{entry}: HGMMA in no loop"
        start, end = min(ranges, key=lambda r: r[1] - r[0])
        body = [i for i in instructions if start <= i.address <= end]
        hgmma = [i for i in body if i.base == "HGMMA"]
        # both operands by descriptor, nothing through ldmatrix or mma.sync
        assert hgmma and all(i.operands.split(",")[1].strip().startswith("gdesc[") for i in hgmma), entry
        assert not any(i.base in ("LDSM", "HMMA") for i in body), entry


# ---- the emulation: PoCL runs the sm_90a kernels' OpenCL printing ----------------------------


def _run(source, sizes):
    from napkin_dsl.backends import opencl
    from napkin_dsl.reference import evaluate

    from .test_tensorcore import random_inputs

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    (kernel,) = napkin.load(source).values()
    program = kernel.gpu_program("H100", **sizes)
    assert all(selection(program, launch, "sm_90a").path == "wgmma" for launch in program.launches)
    printed, _ = opencl.generate(program, arch="sm_90a")
    assert "nk_wgmma(" in printed and "NK_LDSM" not in printed.split("__kernel")[1]
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(program, inputs, scalars, arch="sm_90a")
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), str(source))


@pytest.mark.parametrize("source, sizes", [
    (MLP, dict(b=200, k=72, n=136)),                  # ragged on every axis: two blocks of b, three of n
    (MLP, dict(b=64, k=32, n=128)),                   # one block, one chunk
    (SWIGLU, dict(t=200, m=72, f=136, e=80)),         # three warpgroups, a ragged second block; the down projection
    (RELABELLED.format(name="tall", out="C: bf16[m n]", smem="group m 256, n 64; stream k 32", body="    C[m n] = A * B"),
     dict(m=300, k=40, n=72)),                        # four warpgroups, the last one's rows past m
], ids=["mlp-ragged", "mlp-one-block", "swiglu-ragged", "matmul-four-warpgroups"])
def test_the_emulated_sm_90a_epilogue_kernels_match_the_reference(source, sizes):
    _run(source, sizes)


def test_oclgrind_finds_no_race_or_bad_access_in_the_emulated_sm_90a_mlp():
    from .test_tensorcore import oclgrind

    result = oclgrind("examples/mlp.napkin", ["b=80", "k=32", "n=72"], "--arch", "sm_90a")
    assert result.returncode == 0, result.stderr[-2000:]
    report = result.stdout + result.stderr
    assert "data race" not in report and "Invalid" not in report and "error" in report, report[-2000:]
