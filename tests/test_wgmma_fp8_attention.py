"""fp8 attention on wgmma's 8-bit shape (sm_90a, issue 23): examples/fp8_attention_vt.napkin.

Both shared operands of ``wgmma.mma_async.m64nNk32.f32.e4m3.e4m3`` are K-major, so PV's B is V
stored keys fastest ([b h d x]), read by descriptor in the ISA's own key order; P is the register
A operand, packed to e4m3 and exchanged within each quad of lanes into that order
(``layouts.QUAD_SOURCE``, ``QUAD_HALF``, ``p_words8``: two shuffles and a byte permute a
register). Held here: the exchange against the ISA's fragment formulas (copied into
tests/test_layouts.py), selection (V [x d] declined by name), the PTX wrapper's form, NVRTC's
SASS (QGMMA with an E4M3 type and a register A in the hot loop, TMA, no spills, no local memory,
the model under the static ceiling), and PoCL runs of the OpenCL printing, whose emulation reads
A from the lanes, registers and bytes the ISA names and emulates shfl.sync and prmt from their
definitions, against the float64 reference at ragged sizes; a wrong exchange fails there.
"""

from __future__ import annotations

import collections
import re

import pytest

import napkin_dsl as napkin
from napkin_dsl import layouts
from napkin_dsl.isel import selection
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES, assert_matches_reference, compiled_listing
from .test_fp8_tensorcore import ATTENTION
from .test_layouts import isa_a8, isa_c

EXAMPLE = (EXAMPLES / "fp8_attention_vt.napkin").read_text()
BENCH = dict(b=4, h=32, qb=64, qi=128, x=8192)
PLAIN = ATTENTION.replace("V: fp8e4m3[x d]", "V: fp8e4m3[d x]")  # V keys fastest


def _kernel(text=EXAMPLE):
    (kernel,) = napkin.load(text).values()
    return kernel


def _selected(text=EXAMPLE, arch="sm_90a", **sizes):
    program = _kernel(text).gpu_program("H100", **sizes)
    return selection(program, program.launches[0], arch)


# ---- the exchange, from the ISA's fragment formulas ------------------------------------------


def test_the_quad_exchange_delivers_the_isas_8_bit_a_fragment_from_the_accumulators():
    """Simulated over a warp: each lane packs words of its accumulators (four n-tiles of
    isa_c side by side: 32 keys), and each byte of its A registers, taken through QUAD_SOURCE and
    QUAD_HALF, is P at the (row, k) isa_a8 names, k in the natural key order."""
    words = layouts.p_words8()
    # P(row, key) for each lane's accumulators: value (nt, c) of lane at (row, 8 nt + col)
    held = {}
    for lane in range(32):
        for nt in range(4):
            for c in range(4):
                row, col = isa_c(lane, c)
                held[(lane, nt, c)] = (row, 8 * nt + col)
    for lane in range(32):
        for i in range(16):
            register, byte = i // 4, i % 4  # the ISA: four 8-bit values a register, a0 lowest
            source = layouts.QUAD_SOURCE(lane, byte >> 1)
            assert source >> 2 == lane >> 2  # within the quad
            nt, c = words[register][2 * layouts.QUAD_HALF(lane) + (byte & 1)]
            assert held[(source, nt, c)] == isa_a8(lane, i), (lane, i)


def test_the_selector_picks_the_half_the_lane_reads():
    # prmt: 0x5410 is bytes 0, 1 of x then 0, 1 of y; 0x7632 their bytes 2, 3
    assert [layouts.QUAD_HALF(lane) for lane in range(4)] == [0, 0, 1, 1]


# ---- selection and the wrapper ----------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 128])
def test_the_example_runs_both_products_on_wgmmas_8_bit_shape_with_p_from_registers(d):
    chosen = _selected(**BENCH, d=d)
    assert chosen.path == "wgmma" and chosen.plan.dtype == "fp8e4m3", (chosen.reason, chosen.declined)
    s, o = chosen.plan.mmas["S"], chosen.plan.mmas["O"]
    assert (s.a_in_registers, s.a_trans, s.b_trans) == (False, False, False)
    assert (o.a, o.a_in_registers, o.b, o.b_trans) == ("P", True, "V", False)
    assert {load.array for load in chosen.plan.tma} == {"Q", "K", "V"}


FA3_FORM = (EXAMPLES / "fp8_attention.napkin").read_text()  # V stored [b h x d]


@pytest.mark.parametrize("d", [64, 128])
def test_v_stored_x_slowest_is_copied_k_major_each_chunk(d):
    """examples/fp8_attention.napkin keeps V [b h x d]: the 8-bit shape reads it from a K-major
    copy (plan.transposed) the block writes each chunk, a slot of its own in the arena."""
    from napkin_dsl.isel import kmajor_name

    chosen = _selected(FA3_FORM, **BENCH, d=d)
    assert chosen.path == "wgmma" and chosen.plan.transposed == ("V",)
    o = chosen.plan.mmas["O"]
    assert (o.a_in_registers, o.b_trans) == (True, True)
    copy, staged = chosen.slots[kmajor_name("V")], chosen.slots["V"]
    assert (copy.tile.rows, copy.tile.cols, copy.stages) == (staged.tile.cols, staged.tile.rows, 1)
    assert copy.offset % copy.tile.alignment == 0 and copy.offset >= staged.offset + staged.bytes


def test_a_b_stored_n_fastest_that_is_not_streamed_is_still_declined_by_name():
    # the copy is written a chunk of the stream at a time: matmul's B [k n] with k whole is declined
    # (a streamed one is copied: tests/test_wgmma_fp8.py)
    text = (EXAMPLES / "fp8_matmul.napkin").read_text().replace("; stream k 64", "")
    chosen = _selected(text, m=512, n=512, k=64)
    assert chosen.path != "wgmma" and "K-major only: B has k outside its fastest axis and is not streamed" in (
        chosen.declined or chosen.reason)


def test_the_8_bit_register_a_wrapper_is_the_isas_form():
    from napkin_dsl.backends.wgmma import cuda_wrapper, wrapper_name

    text = cuda_wrapper(64, "fp8e4m3", False, False, True)
    # PTX ISA 9.7.15.5.2: d, a (four .b32), b-desc, scale-d, imm-scale-a, imm-scale-b: no transpose
    assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" in text
    assert "}, {%32, %33, %34, %35}, %36, 1, 1, 1;" in text and text.count('"+f"') == 32
    assert wrapper_name(64, "fp8e4m3", False, False, True) in text
    with pytest.raises(AssertionError):
        cuda_wrapper(64, "fp8e4m3", False, True, True)


# ---- NVRTC's SASS -----------------------------------------------------------------------------


@pytest.mark.parametrize("text", [EXAMPLE, FA3_FORM], ids=["v-keys-fastest", "v-copied-k-major"])
@pytest.mark.parametrize("d", [64, 128])
def test_the_example_compiles_for_sm_90a_with_qgmma_from_registers_in_the_hot_loop(d, text):
    from napkin_dsl.backends import sass

    compiled, instructions = compiled_listing(_kernel(text), **BENCH, d=d)
    assert compiled.launches[0].path == "wgmma"
    opcodes = collections.Counter(i.base for i in instructions)
    assert opcodes["LDL"] == opcodes["STL"] == 0 and opcodes["UTMALDG"] and opcodes["SYNCS"], opcodes
    (entry,) = sass.sass_report(compiled)["launches"]
    hot = entry["ceiling"]["loop"]
    loop = [i for i in instructions if hot["start"] <= i.address <= hot["end"]]
    qgmma = [i for i in loop if i.base == "QGMMA"]
    assert qgmma and all(i.opcode.startswith("QGMMA.64x") and i.opcode.endswith(".F32.E4M3.E4M3") for i in qgmma), qgmma
    # nvdisasm: S = Q K^T "R24, gdesc[UR8], R24" (A by descriptor), d / 32 a chunk; O += P V "R56,
    # R24, gdesc[UR28], R56" (A from registers), 64 / 32 = 2 a chunk of 64 keys
    from_registers = [i for i in qgmma if i.operands.split(",")[1].strip().startswith("R")]
    by_descriptor = [i for i in qgmma if i.operands.split(",")[1].strip().startswith("gdesc[")]
    assert len(from_registers) + len(by_descriptor) == len(qgmma) and from_registers, [i.operands for i in qgmma]
    assert len(by_descriptor) * 2 == len(from_registers) * (d // 32), [i.operands for i in qgmma]
    assert not any(i.base in ("HMMA", "QMMA", "HGMMA", "LDSM") for i in loop)
    # the exchange: 2 shuffles a register, 4 registers a k step of 32 keys (one QGMMA from registers)
    assert sum(i.base == "SHFL" for i in loop) >= 8 * len(from_registers)
    if text is FA3_FORM:  # V's K-major copy: byte permutes, 32-bit shared loads and stores
        assert sum(i.base == "PRMT" for i in loop) >= 8 * len(from_registers) // 2 + 6
        assert any(i.base == "STS" for i in loop)
    ceiling = entry["ceiling"]
    assert ceiling["unit"] == "tensor" and not ceiling["loop"]["unpriced"]
    assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9)


# ---- PoCL --------------------------------------------------------------------------------------


def _run(text, sizes, seed=0):
    from napkin_dsl.backends import opencl

    from .test_opencl import random_inputs

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    kernel = _kernel(text)
    program = kernel.gpu_program("H100", **sizes)
    assert selection(program, program.launches[0], "sm_90a").path == "wgmma"
    source, _ = opencl.generate(program, arch="sm_90a")
    body = source.split("__kernel")[1]
    # P exchanged within quads, then the 8-bit product from registers: issued (the synchronous ring)
    # or posted and run when its group lands (the roles, V keys-fastest)
    assert ("nk_wgmma_rs8(" in body or "nk_wgmma_rs_words(" in body) and "NK_SHFL_IDX_U(" in body and "NK_PRMT(" in body
    inputs, scalars = random_inputs(kernel.diagram, sizes, seed)
    outputs = opencl.run(program, inputs, scalars, arch="sm_90a")
    return program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes)


@pytest.mark.parametrize("sizes", [dict(b=1, h=2, qb=2, qi=64, x=160, d=64), dict(b=1, h=1, qb=1, qi=128, x=128, d=32),
                                   dict(b=1, h=1, qb=2, qi=128, x=96, d=128)],
                         ids=["ragged-x", "whole", "d128-ragged-x"])
def test_the_example_on_wgmma_matches_the_reference_on_pocl(sizes):
    program, outputs, expected = _run(EXAMPLE, sizes, seed=sum(sizes.values()))
    assert_matches_reference(program, outputs, expected, "fp8_attention_vt")


@pytest.mark.parametrize("sizes", [dict(q=100, x=160, d=64), dict(q=200, x=192, d=128)], ids=["ragged", "ragged-d128"])
def test_plain_fp8_attention_on_wgmma_matches_the_reference_on_pocl(sizes):
    program, outputs, expected = _run(PLAIN, sizes)
    assert_matches_reference(program, outputs, expected, "attn")


@pytest.mark.parametrize("sizes", [dict(b=1, h=2, qb=2, qi=64, x=150, d=64), dict(b=1, h=1, qb=1, qi=128, x=128, d=128),
                                   dict(b=1, h=1, qb=2, qi=64, x=96, d=32)], ids=["ragged-x", "whole-d128", "d32"])
def test_the_fa3_form_with_v_copied_k_major_matches_the_reference_on_pocl(sizes):
    program, outputs, expected = _run(FA3_FORM, sizes, seed=sum(sizes.values()))
    assert_matches_reference(program, outputs, expected, "fp8_attention")


def test_a_copy_that_swaps_the_wrong_bytes_fails_on_pocl(monkeypatch):
    """The K-major copy's row/column swap broken (its second permute's halves exchanged): V's
    values meet the wrong keys and dimensions, and the output no longer matches."""
    from napkin_dsl.backends import wgmma

    original = wgmma.WgmmaPrinter.transpose

    def broken(self, name):
        start = len(self.lines)
        original(self, name)
        swap = {"0x5410u": "0x7632u", "0x7632u": "0x5410u"}
        self.lines[start:] = [re.sub(r"0x5410u|0x7632u", lambda found: swap[found.group(0)], line)
                              for line in self.lines[start:]]

    monkeypatch.setattr(wgmma.WgmmaPrinter, "transpose", broken)
    program, outputs, expected = _run(FA3_FORM, dict(b=1, h=1, qb=1, qi=64, x=64, d=32))
    with pytest.raises(AssertionError):
        assert_matches_reference(program, outputs, expected, "fp8_attention")


def test_an_exchange_that_reads_the_wrong_half_fails_on_pocl(monkeypatch):
    """Every lane reading half 0 of its sources' words (the selector's choice undone): P's
    values meet the wrong keys of V, and the output no longer matches."""
    from napkin_dsl.backends import tensorcore
    from napkin_dsl.layouts import Layout, Mode

    monkeypatch.setattr(tensorcore, "QUAD_HALF", Layout(("lane",), ("half",), (Mode(0, 1, 32, (0,)),)))
    program, outputs, expected = _run(PLAIN, dict(q=64, x=64, d=32))
    with pytest.raises(AssertionError):
        assert_matches_reference(program, outputs, expected, "attn")


def _runs_clean_under_oclgrind(text: str, sizes: list, tmp_path):
    from .test_tensorcore import oclgrind

    path = tmp_path / "attn.napkin"
    path.write_text(text)
    result = oclgrind(str(path), sizes, "--arch", "sm_90a")
    assert result.returncode == 0, result.stderr[-2000:]
    report = result.stdout + result.stderr
    assert "data race" not in report and "Invalid" not in report and "error" in report, report[-2000:]
    errors = [float(line.split()[-1]) for line in result.stdout.splitlines() if " error " in line]
    assert errors and max(errors) < 0.05, result.stdout


def test_oclgrind_finds_no_race_or_bad_access_in_the_exchange_and_the_8_bit_register_wgmma(tmp_path):
    _runs_clean_under_oclgrind(PLAIN, ["q=64", "x=96", "d=32"], tmp_path)


def test_the_cost_table_counts_a_byte_a_value_and_names_the_unit_that_takes_longest():
    """napkin cost of fp8 attention (H100, b4 h32 q=x=8192 d128) on the Hopper path: Q, K and V
    at one byte a value, and each compute unit's time, its FLOPs at the profile's peak, the
    MUFU's exponentials the longest (the model sums them: no pingpong here, issue 27)."""
    from napkin_dsl.cost import cost_of

    program = _kernel().gpu_program("H100", **BENCH, d=128)
    report = cost_of(program, arch="sm_90a")
    hardware = program.hardware
    units = report.time["compute_by_unit_s"]
    assert units["tensor"] == pytest.approx(float(report.flops["tensor"]) / hardware.peak("wgmma", "fp8e4m3"))
    assert units["special"] == pytest.approx(float(report.flops["special"]) / hardware.peak("special", "f32"))
    assert max(units, key=units.get) == "special"
    text = str(report)
    assert "compute by unit, at each unit's peak, in turn:" in text and "; the most: MUFU (exp, rcp)" in text
    # the bytes: Q, K and V one a value (the f32 scales four)
    smem = report.levels["smem"]
    assert float(smem.H_bytes) < 1.1 * float(smem.H)  # nearly all of what moves is e4m3


def test_the_k_major_copy_of_v_is_priced_on_shared_memorys_port():
    """The FA3 form's copy of V (V [b h x d] rewritten K-major each chunk) reads and writes every
    byte of V's tile once for each block that streams it: 2 b h qb x d bytes, through the port the
    registers term prices. The form stored K-major (V [b h d x]) copies nothing, so it has no note
    and a port term that much smaller."""
    from napkin_dsl.cost import copied_bytes, cost_of
    from napkin_dsl.isel import select_program

    def priced(text):
        program = _kernel(text).gpu_program("H100", **BENCH, d=128)
        return program, cost_of(program, arch="sm_90a")

    program, report = priced(FA3_FORM)
    launch = program.launches[0]
    chosen = select_program(program, "sm_90a")
    b, h, qb, x, d = BENCH["b"], BENCH["h"], BENCH["qb"], BENCH["x"], 128
    assert copied_bytes(program, launch, chosen) == 2 * b * h * qb * x * d
    (note,) = [n for n in report.notes if "K-major copy" in n]
    assert note.startswith("launch 0: V's K-major copy") and f"{2 * b * h * qb * x * d:,}" in note
    split = layouts.transpose_split(chosen[0].slots["V"].tile, chosen[0].slots["V.kmajor"].tile)
    assert f"at {split.conflict:.2f}x the conflict-free wavefronts" in note and split.conflict == 1.0
    _, stored_k_major = priced(EXAMPLE)
    assert not [n for n in stored_k_major.notes if "K-major copy" in n]
    port = report.time["transfer_s"]["registers"]
    assert port > stored_k_major.time["transfer_s"]["registers"]


def test_oclgrind_finds_no_race_in_the_k_major_copy_of_v(tmp_path):
    """No race or bad access in the copy and the emulated products. (The emulated wgmma posts A
    through the warp's scratch behind barriers of its own, which would order the copy's writes
    before its reads even without the copy's barrier: that barrier is held on the CUDA source,
    below.)"""
    _runs_clean_under_oclgrind(ATTENTION, ["q=128", "x=96", "d=32"], tmp_path)


def test_the_cuda_copy_is_fenced_for_the_async_proxy_and_published_by_a_barrier_before_the_products():
    """The copy's stores go through the generic proxy and the tensor cores read through the async
    proxy: each thread fences its writes, and a block barrier orders every thread's before any
    warpgroup's PV wgmma; the chunk's barrier orders the previous chunk's reads before the copy."""
    source = _kernel(FA3_FORM).compile("sm_90a", hardware="H100", **BENCH, d=64).source
    body = source[source.index("__global__"):]
    copies = [i for i in range(len(body)) if body.startswith("// V's chunk, K-major", i)]
    assert copies
    for start in copies:
        product = body.index("_e4m3_r0(", start)  # the PV wgmma (A from registers) of that chunk
        between = body[start:product]
        fence, barrier = between.rindex("NK_FENCE_PROXY_ASYNC();"), between.rindex("NK_SYNC();")
        last_store = between.rindex("= NK_PRMT(nk_tp1, nk_tp3, ")
        assert last_store < fence < barrier, between[-600:]
        before = body[:start]
        assert before.rindex("NK_SYNC()") > before.rindex("_e4m3_r0(") if "_e4m3_r0(" in before else True


# ---- the copy's lanes and their bank conflicts, from the ISA's canonical layout ---------------

COPY_TILES = [(x, d) for x in (64, 128) for d in (32, 64, 128, 256)]  # a chunk: x (k) rows of d (n) bytes


def _banked_wavefronts(addresses):
    """Wavefronts of one warp's 4-byte shared accesses: distinct words a bank, the most of any bank."""
    words = collections.defaultdict(set)
    for address in addresses:
        words[(address // 4) % 32].add(address // 4)
    return max(len(w) for w in words.values())


def _split(x, d):
    return layouts.transpose_split(layouts.CanonicalTile(x, d, 1), layouts.CanonicalTile(d, x, 1))


@pytest.mark.parametrize("x, d", COPY_TILES)
def test_the_copys_warps_take_every_block_once(x, d):
    split = _split(x, d)
    blocks = [split.block(warp, lane) for warp in range(x * d // (16 * 32)) for lane in range(32)]
    assert sorted(blocks) == [(k, n) for k in range(0, x, 4) for n in range(0, d, 4)]


@pytest.mark.parametrize("x, d", COPY_TILES)
def test_the_copys_split_counts_the_wavefronts_of_the_isas_swizzle_and_is_conflict_free_at_128_byte_rows(x, d):
    """Every warp's reads (k row k0 + i, n bytes n0..+3) and writes (the split's i-th written n
    row, k bytes k0..+3), addressed by the ISA's canonical layout, take the wavefronts the split
    counts. The chosen split is conflict-free where V's rows are 128 bytes or more (d >= 128, a
    chunk of 64 or 128 keys), and at most 2.5x the conflict-free count on narrower rows. Lanes
    all along n (a whole 128-byte k row, the split the copy first had at d=128) take 8.5x: one n
    row in eight shares a swizzle key; the best unskewed patch took 3x."""
    from .test_wgmma import isa_canonical

    def counted(split):
        total = 0
        for warp in range(x * d // (16 * 32)):
            blocks = [split.block(warp, lane) for lane in range(32)]
            for i in range(4):
                total += _banked_wavefronts([isa_canonical(x, d, 1, k + i, n) for k, n in blocks])
                total += _banked_wavefronts([isa_canonical(d, x, 1, split.written_row(n, i), k) for k, n in blocks])
        return total

    split = _split(x, d)
    assert counted(split) == split.wavefronts and split.ideal == 8 * x * d // (16 * 32)
    assert split.conflict == 1.0 if d >= 128 else split.conflict <= 2.5
    if d == 128:
        along_n = layouts.TransposeSplit(5, d // 4, x // 4, 0, split.ideal)
        assert counted(along_n) / split.ideal == 8.5
        patches = [layouts.TransposeSplit(n_bits, d // 4, x // 4, 0, split.ideal) for n_bits in range(6) if (1 << (5 - n_bits)) <= x // 4]
        assert min(counted(patch) for patch in patches) / split.ideal == 3.0


def assert_printed_copy_is_the_split(text: str, sizes: dict, name: str):
    """The CUDA copy of operand ``name`` hands out the split's blocks: its (nk_tk, nk_tn),
    evaluated for every block index, is the split's block, and its i-th store goes to the
    split's i-th written row."""
    from napkin_dsl.isel import kmajor_name

    source = _kernel(text).compile("sm_90a", hardware="H100", **sizes).source
    copy = source[source.index(f"// {name}'s chunk, K-major"):]
    copy = copy[:copy.index("NK_FENCE_PROXY_ASYNC")]
    line = next(line.strip() for line in copy.splitlines() if line.strip().startswith("const int nk_tn ="))
    tn, tk = line.removeprefix("const int nk_tn = ").split("  //")[0].rstrip(";").split(", nk_tk = ")
    chosen = _selected(text, **sizes)
    split = layouts.transpose_split(chosen.slots[name].tile, chosen.slots[kmajor_name(name)].tile)
    stores = [line.split("// n row ")[1].split(", k nk_tk")[0] for line in copy.splitlines() if "// n row " in line]
    parity = next((line.split("nk_ts = ")[1].split(";")[0] for line in copy.splitlines() if "const int nk_ts = " in line), "0")
    assert len(stores) == 4 and (parity != "0") == split.swap
    rows, cols = chosen.slots[name].tile.rows, chosen.slots[name].tile.cols
    for tb in range(rows * cols // 16):
        scope = {"nk_tw": tb >> 5, "nk_tl": tb & 31}
        scope["nk_tn"] = eval(tn.replace("/", "//"), scope)
        k, n = eval(tk.replace("/", "//"), scope), scope["nk_tn"]
        assert (k, n) == split.block(tb >> 5, tb & 31)
        scope["nk_ts"] = eval(parity, scope)
        assert [eval(row, scope) for row in stores] == [split.written_row(n, i) for i in range(4)]
    return split


def test_the_printed_copy_hands_out_the_splits_blocks_and_rows():
    split = assert_printed_copy_is_the_split(FA3_FORM, dict(BENCH, d=128), "V")
    assert split.conflict == 1.0


@pytest.mark.parametrize("name", ["fp8_attention", "fp8_attention_vt"])
def test_the_tuner_finds_the_fused_fp8_build(name):
    """Issue 44, item 2: with no relabel block, fp8 attention tunes to one fused launch on wgmma,
    as bf16 attention does. The tuner priced a launch loading fp8 operands on the FMA path (its
    tensor dtypes were the 16-bit ones), and held V [d x]'s key chunk to 128 (128 bytes of fp8),
    where the fragments do not fit: it materialised S at 20-27 TFLOP/s."""
    text = (EXAMPLES / f"{name}.napkin").read_text().split("relabel")[0]
    (kernel,) = napkin.load(text).values()
    sizes = dict(b=4, h=32, qb=64, qi=128, x=8192, d=128)
    program = kernel.gpu_program("H100", **sizes)
    (launch,) = program.launches
    assert selection(program, launch, "sm_90a").path == "wgmma"
    best = kernel.tune("H100", **sizes).best
    assert not best.materialised and best.time_s < 0.01, best  # fused: nothing at gmem; a few ms, not 170
