"""SASS inspection without a GPU: NVRTC's cubins disassembled with nvdisasm, classified, loops found."""

from __future__ import annotations

import json

import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import sass
from napkin_dsl.backends.sass import (
    NoDisassembler,
    histogram,
    histogram_key,
    hot_loop,
    innermost_loops,
    instruction_class,
    parse_listing,
    sass_report,
)
from napkin_dsl.cli import main

from .conftest import EXAMPLES, ROOT, has_nvdisasm, needs_nvdisasm

SIZES = {
    "matmul.napkin": {"m": 1024, "n": 1024, "k": 1024},
    "attention.napkin": {"b": 2, "h": 4, "q": 1024, "x": 1024, "d": 64},
}


def compiled(name: str, arch: str = "sm_90", **options):
    (kernel,) = napkin.load(EXAMPLES / name).values()
    return kernel.compile(arch, **SIZES[name], **options)


# ---- classification (no nvdisasm needed) --------------------------------------------------------


@pytest.mark.parametrize("opcode, klass, key", [
    ("HMMA.16816.F32.BF16", "tensor", "tensor"),
    ("HGMMA.64x128x16.F32.BF16", "tensor", "tensor"),
    ("HFMA2.MMA", "float", "float"),  # a move on the MMA pipe, not tensor-core work
    ("LDSM.16.M88.4", "ldsm", "ldsm"),
    ("LDGSTS.E.BYPASS.128", "ldgsts", "ldgsts"),
    ("LDS.U16", "lds", "lds.16"),
    ("LDS", "lds", "lds.32"),
    ("LDS.64", "lds", "lds.64"),
    ("LDS.128", "lds", "lds.128"),
    ("STS.128", "sts", "sts"),
    ("LDG.E.128.CONSTANT", "global", "global"),
    ("STG.E.U16", "global", "global"),
    ("LDL", "local", "local"),
    ("STL.64", "local", "local"),
    ("SHFL.BFLY", "shuffle", "shuffle"),
    ("BAR.SYNC.DEFER_BLOCKING", "barrier", "barrier"),
    ("DEPBAR.LE", "async_wait", "async_wait"),
    ("LDGDEPBAR", "async_wait", "async_wait"),
    ("FFMA", "float", "ffma"),
    ("FFMA.SAT", "float", "ffma"),
    ("FMNMX", "float", "float"),
    ("MUFU.EX2", "mufu", "mufu"),
    ("IMAD.MOV.U32", "integer", "integer"),
    ("UIADD3", "integer", "integer"),
    ("F2FP.BF16.F32.PACK_AB", "convert", "convert"),
    ("BRA.DIV", "control", "control"),
    ("EXIT", "control", "control"),
    ("S2R", "other", "other"),
])
def test_classifier(opcode, klass, key):
    assert instruction_class(opcode) == klass
    assert histogram_key(opcode) == key


# A listing in nvdisasm -c's format (13.x, sm_90): two functions. In `toy`, a loop at 0040-0080
# nested in one at 0020-00b0, a predicated spin loop at 00e0, and the compiler's unconditional
# branch-to-self after EXIT (never a loop); in `twice`, one loop with two back edges.
LISTING = """\
\t.target\tsm_90

\t.elftype\t@"ET_EXEC"


//--------------------- .text.toy                --------------------------
\t.section\t.text.toy,"ax",@progbits
\t.align\t128
        .global         toy
        .type           toy,@function
        .size           toy,(.L_x_5 - toy)
        .other          toy,@"STO_CUDA_ENTRY STV_DEFAULT"
toy:
.text.toy:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   BSSY B0, `(.L_x_3) ;
.L_x_1:
        /*0020*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0030*/                   LDGDEPBAR ;
.L_x_0:
        /*0040*/                   LDSM.16.M88.4 R8, [R3] ;
        /*0050*/                   HMMA.16816.F32.BF16 R12, R8, R10, R12 ;
        /*0060*/                   VIADD R0, R0, 0x1 ;
        /*0070*/                   ISETP.NE.AND P0, PT, R0, R6, PT ;
        /*0080*/               @P0 BRA `(.L_x_0) ;
        /*0090*/                   DEPBAR.LE SB0, 0x0 ;
        /*00a0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00b0*/              @!P1 BRA `(.L_x_1) ;
        /*00c0*/                   BSYNC B0 ;
.L_x_3:
        /*00d0*/                   STG.E desc[UR4][R2.64], R12 ;
.L_x_2:
        /*00e0*/               @P2 BRA `(.L_x_2) ;
        /*00f0*/                   EXIT ;
.L_x_4:
        /*0100*/                   BRA `(.L_x_4);
        /*0110*/                   NOP;
.L_x_5:


//--------------------- .text.twice              --------------------------
\t.section\t.text.twice,"ax",@progbits
twice:
.text.twice:
.L_x_6:
        /*0000*/                   FFMA R0, R1, R2, R0 ;
        /*0010*/               @P0 BRA `(.L_x_6) ;
        /*0020*/                   FADD R0, R0, 1 ;
        /*0030*/              @!PT BRA `(.L_x_6) ;
        /*0040*/                   EXIT ;
"""


def test_parse_listing_functions_opcodes_predicates_and_targets():
    functions = parse_listing(LISTING)
    assert list(functions) == ["toy", "twice"]
    toy = functions["toy"]
    assert [i.address for i in toy] == list(range(0, 0x120, 0x10))
    by_address = {i.address: i for i in toy}
    assert by_address[0x20].opcode == "LDGSTS.E.BYPASS.128" and by_address[0x20].base == "LDGSTS"
    assert (by_address[0x80].predicate, by_address[0x80].opcode, by_address[0x80].target) == ("@P0", "BRA", 0x40)
    assert (by_address[0xb0].predicate, by_address[0xb0].target) == ("@!P1", 0x20)
    assert by_address[0x10].target == 0xd0  # BSSY names its reconvergence point
    assert by_address[0x110].opcode == "NOP"
    assert functions["twice"][3].predicate == "@!PT"


def test_innermost_loops_of_a_listing():
    functions = parse_listing(LISTING)
    loops = innermost_loops(functions["toy"])
    # The outer loop (0020-00b0) contains the inner one; the trap at 0100 is no loop.
    assert [(body[0].address, body[-1].address) for body in loops] == [(0x40, 0x80), (0xe0, 0xe0)]
    assert histogram(loops[0]) == {"ldsm": 1, "tensor": 1, "integer": 2, "control": 1}
    # Two back edges to one header are one loop, up to the later edge.
    (loop,) = innermost_loops(functions["twice"])
    assert [i.opcode for i in loop] == ["FFMA", "BRA", "FADD", "BRA"]


def test_hot_loop_is_the_contraction_not_the_longest_loop():
    epilogue = {"start": 0, "end": 0x500, "instructions": 81, "classes": {"global": 4, "integer": 76, "control": 1}}
    softmax = {"start": 0x600, "end": 0xe80, "instructions": 153, "classes": {"ffma": 29, "float": 33, "mufu": 7, "integer": 84}}
    ffma = {"start": 0x1000, "end": 0x1440, "instructions": 69, "classes": {"ffma": 32, "lds.16": 16, "integer": 20, "control": 1}}
    mma = {"start": 0x2000, "end": 0x2100, "instructions": 17, "classes": {"tensor": 8, "ldsm": 4, "integer": 4, "control": 1}}
    assert hot_loop({"loops": [epilogue, softmax, ffma]}) is ffma
    assert hot_loop({"loops": [epilogue, softmax, ffma, mma]}) is mma
    assert hot_loop({"loops": [epilogue]}) is epilogue
    assert hot_loop({"loops": []}) is None


def test_no_disassembler_is_a_user_error_naming_the_extra(monkeypatch):
    monkeypatch.setattr(sass, "WHEEL_BINARIES", ())
    monkeypatch.setenv("PATH", "")
    with pytest.raises(NoDisassembler) as raised:
        sass.find_nvdisasm()
    assert isinstance(raised.value, napkin.NapkinError)
    assert "napkin-dsl[sass]" in raised.value.hint


# ---- real kernels ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reports():
    if not has_nvdisasm():
        pytest.skip("nvdisasm not installed (pip install 'napkin-dsl[sass]')")
    return {name: sass_report(compiled(name)) for name in SIZES}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_report_of_a_compiled_example(reports, name):
    report = reports[name]
    assert report["arch"] == "sm_90"
    for entry in report["launches"]:
        whole = entry["whole"]
        assert entry["instructions"] > 0 and sum(whole.values()) == entry["instructions"]
        assert whole.get("global", 0) > 0  # the inputs are read from device memory
        assert set(whole) <= {*sass.CLASSES, "ffma", "lds.8", "lds.16", "lds.32", "lds.64", "lds.128"}
        loop = hot_loop(entry)
        assert loop is not None and loop["instructions"] > 0
        # The main loop reads its operands from shared memory.
        assert any(key.startswith("lds") for key in loop["classes"]), loop
        for loop in entry["loops"]:
            assert loop["start"] <= loop["end"] and sum(loop["classes"].values()) == loop["instructions"]
            tensor = loop["classes"].get("tensor", 0)
            assert loop["per_tensor"] == (round(loop["instructions"] / tensor, 2) if tensor else None)


@needs_nvdisasm
@pytest.mark.parametrize("arch, hardware", [("sm_90", "H100"), ("sm_80", "A100")])
def test_rmsnorm_keeps_its_staged_result_in_registers(arch, hardware):
    """Issue 22: rmsnorm at a model's width (8 tokens of 4096 on a block of 256 threads) writes Y
    over X's shared bytes, so each thread holds its 128 values until every thread has read X.
    Held at constant indices they stay in registers: no local memory, no spills."""
    (kernel,) = napkin.load((EXAMPLES / "rmsnorm.napkin").read_text()).values()
    (entry,) = sass_report(kernel.compile(arch, hardware, t=16384, d=4096))["launches"]
    assert entry["whole"].get("local", 0) == 0 and entry["spill_bytes"] == 0
    assert entry["registers"] <= 255


@needs_nvdisasm
def test_sm80_cubin_disassembles():
    (entry,) = sass_report(compiled("matmul.napkin", "sm_80"))["launches"]
    assert entry["instructions"] > 0 and entry["loops"]


@needs_nvdisasm
def test_a_listing_is_disassembled_once_and_cached_on_disk(monkeypatch, tmp_path):
    """The same cubin is read by nvdisasm once: again in the process from memory, in another
    process (the memo emptied) from the disk cache, and a cleared cache disassembles again."""
    monkeypatch.setenv("NAPKIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sass, "_LISTINGS", {})
    cubin = compiled("matmul.napkin", "sm_80").image
    calls = []
    uncached = sass._disassemble_uncached
    monkeypatch.setattr(sass, "_disassemble_uncached", lambda *a: calls.append(1) or uncached(*a))
    first = sass.run_nvdisasm(cubin)
    assert sass.run_nvdisasm(cubin) == first and len(calls) == 1
    assert len(list((tmp_path / sass.SASS_CACHE_SUBDIR).glob("*.sass"))) == 1
    sass._LISTINGS.clear()
    assert sass.run_nvdisasm(cubin) == first and len(calls) == 1  # from disk
    from napkin_dsl.backends.nvrtc import clear_cache

    assert clear_cache() >= 1
    sass._LISTINGS.clear()
    assert sass.run_nvdisasm(cubin) == first and len(calls) == 2
    # another nvdisasm (here: the same file, touched) is another key
    binary = sass.find_nvdisasm()
    key = sass._listing_key(binary, cubin)
    monkeypatch.setattr(sass.os, "stat", lambda path: type("Stat", (), {"st_size": 1, "st_mtime_ns": 2})())
    assert sass._listing_key(binary, cubin) != key


def test_ptx_is_refused():
    with pytest.raises(napkin.NapkinError, match="PTX"):
        sass_report(compiled("matmul.napkin", ptx=True))


@needs_nvdisasm
def test_napkin_cuda_sass_cli(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    args = ["cuda", "examples/matmul.napkin", "--set", "m=256", "n=256", "k=256", "--sass"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "napkin_matmul_0" in text and "instrs" in text and "whole" in text and "loop" in text
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (entry,) = data["kernels"]["matmul"]["launches"]
    assert entry["entry"] == "napkin_matmul_0" and entry["instructions"] > 0
    # the static ceiling: the binding resource's clocks are the most, and the text names it
    ceiling = entry["ceiling"]
    clocks = ceiling["loop"]["clocks"]
    assert clocks[ceiling["binding"]] == max(clocks.values()) and ceiling["tflops"] > 0 and ceiling["model_tflops"] > 0
    assert f"bound by {ceiling['binding']}" in text and "the model predicts" in text
    assert main(args + ["--resources", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["kernels"]["matmul"]
    assert data["launches"][0]["registers"] == data["sass"]["launches"][0]["registers"]
    assert main(args + ["--ptx"]) == 2
    assert "PTX" in capsys.readouterr().err
