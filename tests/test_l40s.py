"""The Ada profile (issue 44, item 5): napkin_dsl/hardware/L40S.toml, sm_89, with mma.sync's 16-bit
and native 8-bit shapes. Every example compiles for it and stays under its static ceiling
(tests/test_static_ceiling.py's targets); here, what is particular to it."""

from __future__ import annotations

import pytest

import napkin_dsl as napkin
from napkin_dsl.cli import main
from napkin_dsl.hardware import load_hardware

from .conftest import EXAMPLES


def test_the_profile_lists_mma_syncs_two_shapes_for_sm_89():
    hw = load_hardware("L40S")
    assert (hw.arch, hw.archs) == ("sm_89", ("sm_80", "sm_89"))
    fp8 = hw.find_path("mma.sync", "fp8e4m3", "sm_89")
    assert fp8.shape == "m16n8k32" and not fp8.converts  # QMMA on sm_89: no conversion to f16
    assert hw.find_path("mma.sync", "bf16", "sm_89").shape == "m16n8k16"
    assert hw.find_path("wgmma", "bf16", "sm_89") is None
    # the peaks are the datasheet's, at the clock they imply: 142 SMs x 1024 dense FP16 FLOP a clock
    assert hw.peak("tensor", "bf16") == pytest.approx(142 * 1024 * hw.clock_hz, rel=0.01)
    assert hw.peak("tensor", "fp8e4m3") == pytest.approx(2 * hw.peak("tensor", "bf16"), rel=0.02)


def test_every_example_is_priced_on_it_wherever_it_is_on_h100(capsys):
    """At the sizes the code generation tests use: an example priced on H100 is priced on L40S
    (a block written for H100 that does not fit is tuned again). attention_unfused, whose S is
    whole rows of keys with no partition, fits neither."""
    from .test_cuda_codegen import SIZES

    priced, examples = [], {p.name for p in EXAMPLES.glob("*.napkin")}
    for name, cases in sorted((n, c) for n, c in SIZES.items() if n in examples):
        sets = [f"{axis}={n}" for axis, n in cases[0].items()]
        on_h100 = main(["cost", str(EXAMPLES / name), "--hardware", "H100", "--set", *sets])
        capsys.readouterr()
        if on_h100 != 0:
            continue
        assert main(["cost", str(EXAMPLES / name), "--hardware", "L40S", "--set", *sets]) == 0, name
        out = capsys.readouterr().out
        assert "on L40S" in out and "predicted throughput" in out, out
        priced.append(name)
    assert examples - set(priced) == {"attention_unfused.napkin"}, priced


def test_fp8_matmul_runs_on_native_8_bit_mma():
    pytest.importorskip("cuda.bindings")
    from napkin_dsl.backends import sass

    (kernel,) = napkin.load(EXAMPLES / "fp8_matmul.napkin").values()
    compiled = kernel.compile(hardware="L40S", m=512, n=512, k=512)
    assert compiled.arch == "sm_89" and compiled.launches[0].path == "mma.sync"
    try:
        (instructions,) = sass.disassemble(compiled.image).values()
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm")
    bases = {i.base for i in instructions}
    # the products on the 8-bit shape itself: no HMMA, and no F2FP unpacking an operand to f16
    # (as sm_90's mma.sync does); F2FP here packs the bf16 output
    assert "QMMA" in bases and "HMMA" not in bases, sorted(bases)
    assert not [i.opcode for i in instructions if i.base == "F2FP" and "UNPACK" in i.opcode]


def test_a_block_written_for_another_gpu_that_does_not_fit_is_tuned_again_and_says_so():
    """rmsnorm's block is H100's: 8 rows of 4096 f32 (128 KB) are over the L40S's 99 KB a block.
    Compiled for L40S, the tuner's schedule runs, with the written block among its candidates, and
    the report names why; on H100 the written block runs as written."""
    (kernel,) = napkin.load(EXAMPLES / "rmsnorm.napkin").values()
    sizes = dict(t=1024, d=4096)
    l40s = kernel.gpu_program("L40S", **sizes)
    (note,) = [n for n in l40s.schedule.notes if "relabel block written for H100" in n]
    assert "does not fit L40S" in note and "over its capacity of 101,376" in note
    assert not any("relabel block written" in n for n in kernel.gpu_program("H100", **sizes).schedule.notes)
    # the model prices what is built: the same schedule, the same note
    report = kernel.cost("L40S", **sizes)
    assert note in report.notes and report.time["overlapped_s"] > 0
