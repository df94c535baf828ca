"""Attention on wgmma with P from registers, on sm_90a (issue 27, step 3).

The online softmax's two products on ``wgmma.mma_async.m64nNk16``: S = Q K^T with A = Q and B = K
by descriptor (both K-major), and O += P V with A = P from registers and B = V by descriptor
(MN-major: the transpose immediate). The PTX ISA's register fragment of A (9.7.15.5.1.1.1,
Figure 148) is written here, apart from napkin's layouts and the printer's packing, and held
against them: the D fragment of S packed to bf16 pairs is P's A fragment. Then selection (wgmma
for sm_90a only, the declines with their reasons), NVRTC's sm_90a SASS (HGMMA of both shapes in
the hot loop, register A for PV, no ldmatrix or HMMA, no spills, no local memory, its static
ceiling above the model), PoCL runs of the OpenCL printing, whose emulation decodes the register
fragment by the ISA's map, against the float64 reference at ragged sizes, and mutations of the
register A encoding that must fail those runs.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import layouts
from napkin_dsl.backends import wgmma as wgmma_backend
from napkin_dsl.isel import describe, selection

from .conftest import EXAMPLES, assert_matches_reference
from .test_wgmma import isa_d

ATTENTION = EXAMPLES / "attention.napkin"
BIG = dict(b=4, h=32, q=8192, x=8192, d=128)


# ---- the PTX ISA, written here --------------------------------------------------------------


def isa_a(thread: int, i: int) -> tuple[int, int]:
    """wgmma .m64nNk16, A in registers, .f16/.bf16 (Figure 148): (row, k) of a_i (i in 0..7, two a
    .b32 register, low half first) of a thread of the warpgroup. Warp w holds rows 16w..16w+15;
    groupID = lane >> 2, threadID_in_group = lane % 4; row = groupID (+ 8 for a2, a3, a6, a7),
    k = 2 threadID_in_group + (i & 1) (+ 8 for a4..a7): per warp, the m16n8k16 A figure."""
    warp, lane = thread // 32, thread % 32
    group, tig = lane >> 2, lane % 4
    row = 16 * (warp % 4) + group + (8 if i in (2, 3, 6, 7) else 0)
    k = 2 * tig + (i & 1) + (8 if i >= 4 else 0)
    return row, k


def test_the_register_a_fragment_covers_64_x_16_and_is_mma_syncs_a_per_warp():
    cells = {isa_a(thread, i) for thread in range(128) for i in range(8)}
    assert cells == {(r, k) for r in range(64) for k in range(16)}
    a = layouts.wgmma_a()
    assert a.extent("thread") == 128 and a.extent("i") == 8
    for thread in range(128):
        for i in range(8):
            assert a(thread, i) == isa_a(thread, i)
            row, k = layouts.mma_a(thread % 32, i)  # napkin's m16n8k16 A fragment
            assert (16 * (thread // 32) + row, k) == isa_a(thread, i)


@pytest.mark.parametrize("n", [16, 64, 128, 256])
def test_the_d_fragment_of_s_packed_to_pairs_is_ps_register_a_fragment(n):
    """The printer packs A register j of k step kk from values (n-tile 2 kk + nt, c) of the D
    fragment (``layouts.p_to_a_registers``): each half must be the element of S the ISA's A
    fragment puts there, for every thread of the warpgroup."""
    repack = layouts.p_to_a_registers()
    assert len(repack) == 4
    for thread in range(128):
        for kk in range(n // 16):
            for j, halves in enumerate(repack):
                for half, (nt, c) in enumerate(halves):
                    v = 4 * (2 * kk + nt) + c  # value v of the m64nN D fragment
                    row, k = isa_a(thread, 2 * j + half)
                    assert isa_d(thread, v) == (row, 16 * kk + k)


# ---- selection ------------------------------------------------------------------------------


def _program(path=ATTENTION, **sizes):
    (kernel,) = napkin.load(path).values()
    return kernel.gpu_program("H100", **sizes)


def test_attention_is_planned_on_wgmma_for_sm_90a_only():
    program = _program(**BIG)
    (launch,) = program.launches
    built = selection(program, launch, "sm_90a")
    plan = built.plan
    # two consumer warpgroups, and a producer warpgroup (backends/pipeline.py)
    assert built.path == "wgmma" and plan.warps == 8 and plan.roles.consumers == 2 and plan.row_tile == 128
    assert plan.shapes == {"S": "m64n64k16", "O": "m64n128k16"}
    s, o = plan.mmas["S"], plan.mmas["O"]
    assert (s.a, s.b, s.a_in_registers, s.a_trans, s.b_trans) == ("Q", "K", False, False, False)  # K-major by descriptor
    assert (o.a, o.b, o.a_in_registers, o.b_trans) == ("P", "V", True, True)  # P from registers, V MN-major
    # K and V by TMA into the ring, Q by one TMA copy before it: rank-4 maps, a box of one (b, h)
    assert {load.array: (load.streamed, load.rank) for load in plan.tma} == {"K": (True, 4), "V": (True, 4), "Q": (False, 4)}
    assert not plan.tma_declined
    lines = describe(built, launch)
    assert any("O: wgmma.mma_async.m64n128k16" in line and "P from registers" in line and "MN-major" in line for line in lines)
    assert selection(program, launch, "sm_90").path == "mma.sync"
    assert selection(program, launch, "sm_80").path == "mma.sync"


@pytest.mark.parametrize("name, sizes", [("gqa", dict(b=1, kv=2, r=2, q=200, x=136, d=64)),
                                         ("attention_lse", dict(b=1, h=1, q=64, x=100, d=32)),
                                         ("causal_attention", dict(b=1, h=1, q=256, x=256, d=64)),
                                         ("sliding_window", dict(b=1, h=1, q=256, x=512, d=64))])
def test_the_other_online_softmax_examples_are_on_wgmma(name, sizes):
    program = _program(EXAMPLES / f"{name}.napkin", **sizes)
    built = selection(program, program.launches[0], "sm_90a")
    assert built.path == "wgmma" and built.plan.mmas["O"].a_in_registers


RELABELLED = """
kernel a(Q: bf16[q d], K: bf16[x d], V: bf16[x d]) -> O: bf16[q d]:
    S[q x] = Q * K * d^-0.5
    P[q x] = softmax[x](S)
    O[q d] = P * V

relabel a on H100:
    smem: group q {q}; stream x {x}
"""


@pytest.mark.parametrize("what, program, reason", [
    ("warp tiles", lambda: napkin.load(RELABELLED.format(q=128, x=64) + "    registers: group q 16\n")["a"].gpu_program(
        "H100", q=512, x=256, d=64), "asks for warp tiles"),
    ("a warpgroup and a half", lambda: napkin.load(RELABELLED.format(q=96, x=32))["a"].gpu_program("H100", q=192, x=256, d=64),
     "1 to 4 warpgroups"),
])
def test_what_wgmma_does_not_take_stays_on_mma_sync_with_the_reason(what, program, reason):
    program = program()
    chosen = selection(program, program.launches[0], "sm_90a")
    assert chosen.path == "mma.sync" and reason in chosen.declined, (what, chosen.declined)
    assert describe(chosen, program.launches[0])[0] == f"not wgmma: {chosen.declined}"


def test_the_model_prices_the_wgmma_plan_at_the_wgmma_rate():
    from napkin_dsl.cost import cost_of, instruction_path
    from napkin_dsl.isel import select_program

    program = _program(**BIG)
    assert instruction_path(program, program.launches[0], select_program(program, "sm_90a")) == "wgmma"
    on_wgmma, on_mma = cost_of(program, arch="sm_90a"), cost_of(program, arch="sm_90")
    # the products at twice mma.sync's rate, and K and V read from shared memory once a warpgroup
    assert on_wgmma.time["compute_s"] < 0.75 * on_mma.time["compute_s"]
    assert on_wgmma.time["overlapped_s"] < on_mma.time["overlapped_s"]


def test_napkin_cost_prices_the_arch_it_is_given(capsys):
    import json

    from napkin_dsl.cli import main
    from napkin_dsl.cost import cost_of

    sets = ["--set", *(f"{k}={v}" for k, v in BIG.items())]
    by_arch = {}
    for arch in ("sm_90", "sm_90a"):
        assert main(["cost", str(ATTENTION), "--hardware", "H100", "--arch", arch, "--json", *sets]) == 0
        by_arch[arch] = json.loads(capsys.readouterr().out)["kernels"]["attention"]
        assert by_arch[arch] == json.loads(json.dumps(cost_of(_program(**BIG), arch=arch).to_dict()))
    assert main(["cost", str(ATTENTION), "--hardware", "H100", "--json", *sets]) == 0
    assert json.loads(capsys.readouterr().out)["kernels"]["attention"] == by_arch["sm_90a"]  # the profile's own arch
    assert by_arch["sm_90a"] != by_arch["sm_90"]
    assert main(["cost", str(ATTENTION), "--hardware", "A100", "--arch", "sm_90a", *sets]) != 0
    assert "sm_90a" in capsys.readouterr().err


# ---- the compiled kernel --------------------------------------------------------------------


@pytest.mark.parametrize("name, sizes", [("attention", BIG), ("gqa", dict(b=4, kv=8, r=4, q=8192, x=8192, d=128)),
                                         ("causal_attention", BIG), ("attention", dict(b=1, h=8, q=4096, x=4096, d=64))],
                         ids=["attention-d128", "gqa-d128", "causal-d128", "attention-d64"])
def test_attention_compiles_for_sm_90a_with_hgmma_for_both_products_and_no_spills(name, sizes):
    pytest.importorskip("cuda.bindings")
    from napkin_dsl.backends import sass

    (kernel,) = napkin.load(EXAMPLES / f"{name}.napkin").values()
    compiled = kernel.compile("sm_90a", hardware="H100", **sizes)
    (resources,) = compiled.resources.values()
    assert resources["spill_bytes"] == 0 and compiled.launches[0].path == "wgmma"
    assert "ldmatrix" not in compiled.source.split(f"napkin_{name}_0(")[1]
    try:
        report = sass.sass_report(compiled)
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm")
    (instructions,) = sass.disassemble(compiled.image).values()
    opcodes = collections.Counter(i.base for i in instructions)
    assert opcodes["LDL"] == opcodes["STL"] == 0  # no local memory
    assert opcodes["UTMALDG"] > 0 and opcodes["SYNCS"] > 0 and opcodes["LDGSTS"] == 0  # K, V and Q by TMA: no cp.async
    (entry,) = report["launches"]
    hot = sass.hot_loop(entry)
    body = [i for i in instructions if hot["start"] <= i.address <= hot["end"]]
    d, x = sizes["d"], compiled.program.launches[0].schedule.extent("x", "smem")
    x = int(x)
    # nvdisasm: HGMMA.64x64x16.F32.BF16 R88, gdesc[UR12], R88 (A and B by one descriptor pair);
    # HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR8].tnspB, R24 (A in R88..R91, B transposed)
    hgmma = [(i.opcode, [o.strip() for o in i.operands.split(",")]) for i in body if i.base == "HGMMA"]
    qk, pv = f"HGMMA.64x{x}x16.F32.BF16", f"HGMMA.64x{d}x16.F32.BF16"
    by_descriptor = [ops for opcode, ops in hgmma if opcode == qk and ops[1].startswith("gdesc[")]
    from_registers = [ops for opcode, ops in hgmma if opcode == pv and ops[1].startswith("R") and ops[2].startswith("gdesc[")]
    assert len(by_descriptor) + len(from_registers) == len(hgmma), hgmma  # nothing else on the tensor cores
    chunks = len(by_descriptor) // (d // 16)  # the loop runs the ring's stages unrolled
    assert chunks >= 1 and len(by_descriptor) == chunks * (d // 16) and len(from_registers) == chunks * (x // 16), hgmma
    assert all("tnsp" not in ops[1] for ops in by_descriptor)  # Q and K: K-major
    assert all(ops[2].endswith(".tnspB") for ops in from_registers)  # V: MN-major
    assert not any(i.base in ("LDSM", "HMMA") for i in body)
    ceiling = entry["ceiling"]
    clocks = ceiling["loop"]["clocks"]
    # the consumers' chain: a chunk's products, then S's drain before the softmax reads it (napkin_dsl/chain.py)
    drain = compiled.program.hardware.latency_clocks("wgmma_drain")
    assert clocks["chain"] == pytest.approx(clocks["tensor"] + chunks * drain, abs=0.1), clocks
    if d == 128:  # each consumer warp's instructions issue under the tensor clocks of its HGMMAs; S's drain follows them
        assert ceiling["binding"] == "chain" and clocks["issue"] < clocks["tensor"], clocks
    else:  # at d = 64 the products take half the clocks a chunk: the softmax's issue and MUFU come near the chain
        assert ceiling["binding"] == "chain" and clocks["tensor"] < min(clocks["issue"], clocks["mufu"]), clocks
    assert not ceiling["loop"]["unpriced"]
    # ... and the model promises no more than the code can run at
    assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9)
    assert ceiling["model_s"] >= ceiling["floor_s"] * (1 - 1e-9)


# ---- the emulation: PoCL runs the sm_90a kernel's OpenCL printing ---------------------------


def _run(name, sizes, source=None):
    from napkin_dsl.backends import opencl
    from napkin_dsl.reference import evaluate

    from .test_tensorcore import random_inputs

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    (kernel,) = napkin.load(source or EXAMPLES / f"{name}.napkin").values()
    program = kernel.gpu_program("H100", **sizes)
    assert selection(program, program.launches[0], "sm_90a").path == "wgmma"
    source, _ = opencl.generate(program, arch="sm_90a")
    body = source.split("__kernel")[1]
    # register A by the warp's lanes, posted at the issue where the products land later (roles)
    assert ("nk_wgmma_rs(" in body or "nk_wgmma_rs_words(" in body) and "nk_wgmma(" in body
    assert "NK_LDSM" not in body and "NK_MMA_" not in body
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(program, inputs, scalars, arch="sm_90a")
    return program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes)


@pytest.mark.parametrize("name, sizes", [
    ("attention", dict(b=1, h=2, q=200, x=150, d=32)),   # ragged q and x, 64-byte swizzle
    ("attention", dict(b=1, h=1, q=64, x=80, d=128)),    # one warpgroup, two 128-byte atoms of d
    ("attention", dict(b=1, h=1, q=130, x=70, d=128)),   # two warpgroups: the second's Q rows 64 on in each atom
    ("gqa", dict(b=1, kv=2, r=2, q=130, x=70, d=64)),
    ("attention_lse", dict(b=1, h=1, q=130, x=150, d=32)),
    # masked streams: the chunks the mask holds in full in their own loop, on constant stages; the
    # diagonal and the window's edge masked, on a running stage index in the descriptors
    ("causal_attention", dict(b=1, h=1, q=200, x=150, d=32)),
    ("sliding_window", dict(b=1, h=1, q=330, x=400, d=32)),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{n}" for k, n in v.items()))
def test_the_emulated_sm_90a_attention_matches_the_reference(name, sizes):
    program, outputs, expected = _run(name, sizes)
    assert_matches_reference(program, outputs, expected, name)


def test_the_emulated_sm_90a_attention_in_f16_matches_the_reference():
    from napkin_dsl.backends import opencl

    source = RELABELLED.format(q=128, x=64).replace("bf16", "f16")
    program, outputs, expected = _run("a", dict(q=130, x=70, d=64), source)
    assert "NK_PACK_F16" in opencl.generate(program, arch="sm_90a")[0]  # P packed to f16, read back as f16
    assert_matches_reference(program, outputs, expected, "f16 attention")


def _swapped_rows(registers):
    return [registers[1], registers[0], registers[3], registers[2]]  # rows g and g + 8 exchanged


def _swapped_halves(registers):
    return [(hi, lo) for lo, hi in registers]  # a_2j in the high half


@pytest.mark.parametrize("mutation", [_swapped_rows, _swapped_halves], ids=["register-order", "half-order"])
def test_the_emulation_sees_a_wrong_register_a_encoding(monkeypatch, mutation):
    """The emulator reads A(row, k) from the lane, register and half the ISA names: a printer that
    packs P into the registers in another order computes something else than the reference."""
    original = wgmma_backend.p_to_a_registers
    monkeypatch.setattr(wgmma_backend, "p_to_a_registers", lambda: mutation(original()))
    program, outputs, expected = _run("attention", dict(b=1, h=1, q=64, x=64, d=32))
    assert not np.allclose(outputs["O"].astype(np.float64), expected["O"].astype(np.float64), atol=1e-2)


def test_the_emulation_sees_a_wrong_transpose_immediate(monkeypatch):
    """V is MN-major: the instruction's transpose immediate says so, and the emulation reads B
    through it. A printer that clears it reads V's tile as K-major."""
    from napkin_dsl.paths.wgmma import WgmmaPath

    original = WgmmaPath.build

    def cleared(self, plan, *args):
        built = original(self, plan, *args)
        from dataclasses import replace

        return replace(built, mmas={t: replace(m, b_trans=False) if m.a_in_registers else m for t, m in built.mmas.items()})

    monkeypatch.setattr(WgmmaPath, "build", cleared)
    program, outputs, expected = _run("attention", dict(b=1, h=1, q=64, x=64, d=64))
    assert not np.allclose(outputs["O"].astype(np.float64), expected["O"].astype(np.float64), atol=1e-2)


@pytest.mark.parametrize("example, sizes", [("attention", ["b=1", "h=1", "q=64", "x=80", "d=16"])], ids=["one-warpgroup"])
def test_oclgrind_finds_no_race_or_bad_access_in_the_emulated_sm_90a_attention(example, sizes):
    """Attention's roles with one consumer warpgroup: two, with the runtime's state and the posted
    register A words, need more than oclgrind's 32 KiB of local memory (PoCL runs them:
    tests/test_pipeline.py)."""
    from .test_tensorcore import oclgrind

    result = oclgrind(f"examples/{example}.napkin", sizes, "--arch", "sm_90a")
    assert result.returncode == 0, result.stderr[-2000:]
    report = result.stdout + result.stderr
    assert "data race" not in report and "Invalid" not in report and "error" in report, report[-2000:]
    errors = [float(line.split()[-1]) for line in result.stdout.splitlines() if " error " in line]
    assert errors and max(errors) < 0.02, result.stdout


def test_the_hot_loop_is_the_loop_the_mmas_run_in_around_nested_copy_loops():
    """With TMA, ptxas puts each UTMALDG in a one-trip ELECT loop inside the chunk loop: the loop
    holding the HGMMAs is then not innermost, and is the one ``sass.tensor_loops`` finds."""
    from napkin_dsl.backends.sass import Instruction, innermost_loops, tensor_loops

    code = [Instruction(0x00, "IADD3"),
            Instruction(0x10, "ELECT"), Instruction(0x20, "UTMALDG.2D"), Instruction(0x30, "BRA.U.ANY", predicate="@P0", target=0x10),
            Instruction(0x40, "HGMMA.64x128x16.F32.BF16"), Instruction(0x50, "HGMMA.64x128x16.F32.BF16"),
            Instruction(0x60, "SYNCS.PHASECHK.TRANS64.TRYWAIT"), Instruction(0x70, "BRA", predicate="@!P1", target=0x60),
            Instruction(0x80, "BRA", predicate="@P2", target=0x00),
            Instruction(0x90, "HMMA.16816.F32.BF16"), Instruction(0xa0, "BRA", predicate="@P3", target=0x90),
            Instruction(0xb0, "EXIT")]
    assert [[i.address for i in body] for body in innermost_loops(code)] == [[0x10, 0x20, 0x30], [0x60, 0x70], [0x90, 0xa0]]
    # the chunk loop (its nested loops counted once); the HMMA loop is innermost already
    assert [[i.address for i in body] for body in tensor_loops(code)] == [list(range(0x00, 0x90, 0x10))]


def test_an_hgmmas_shape_is_part_of_its_opcode():
    from napkin_dsl.backends.sass import parse_listing, tensor_work

    listing = ("//--------------------- .text.k --------------------------\n"
               "        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR8].tnspB, R24, gsb0 ;\n"
               "        /*0050*/              @P0  HGMMA.64x64x16.F32.BF16 R88, gdesc[UR12], RZ, !UPT ;\n")
    (first, second), = parse_listing(listing).values()
    assert (first.opcode, first.operands) == ("HGMMA.64x128x16.F32.BF16", "R24, R88, gdesc[UR8].tnspB, R24, gsb0")
    assert (second.opcode, second.predicate, second.operands) == ("HGMMA.64x64x16.F32.BF16", "@P0", "R88, gdesc[UR12], RZ, !UPT")
    # a warp's quarter of the warpgroup's 64 x N x 16 product, priced on the wgmma path
    assert tensor_work(first.opcode) == (2 * 64 * 128 * 16 // 4, "wgmma", "bf16") and first.kind == "tensor"
