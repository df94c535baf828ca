"""The static ceiling read off each compiled kernel's SASS, and the model held under it.

Every runnable example (test_cuda_codegen.SIZES) is compiled for sm_80 on A100 and sm_90 on H100;
``sass.launch_ceiling`` prices its hot loop's instructions at the profile's per-SM rates. The model's
prediction for the built kernel (``compiled.cost``, with ptxas's resources) must not promise more
than that code can run at, wherever the ceiling is a bound: launches on tensor cores whose MMAs
run in a loop. (Straight-line code with branches, a fully unrolled launch, counts code a run may
skip; an FMA launch's ceiling is reported, and the model does not yet price its issue slots.)
"""

from __future__ import annotations

import pytest

import napkin_dsl as napkin
from napkin_dsl.backends.sass import (
    RESOURCES,
    Instruction,
    format_sass_report,
    loop_ceiling,
    sass_report,
    shared_bytes,
    sm_rates,
    tensor_work,
)
from napkin_dsl.cost import subpartition_balance

from .conftest import EXAMPLES, needs_nvdisasm
from .test_cuda_codegen import CASES, SIZES

TARGETS = [("sm_80", "A100"), ("sm_90", "H100")]


def body(*opcodes: str, predicate: str = "") -> list[Instruction]:
    return [Instruction(16 * i, op, predicate=predicate) for i, op in enumerate(opcodes)]


# ---- pricing single instructions (no nvdisasm) -------------------------------------------------


def test_an_hmma_costs_its_shape_at_the_profiles_path_rate():
    h100 = napkin.load_hardware("H100")
    rates = sm_rates(h100)
    flops, path, dtype = tensor_work("HMMA.16816.F32.BF16")
    assert (flops, path, dtype) == (2 * 16 * 8 * 16, "mma.sync", "bf16")
    per_sm_clock = h100.paths["mma_sync"].rates["bf16"] / (h100.clock_hz * h100.level("smem").units)
    loop = loop_ceiling(body("HMMA.16816.F32.BF16"), rates, warps=4)
    # 4 warps, one per sub-partition, each HMMA on a quarter of the SM's tensor rate
    assert loop["clocks"]["tensor"] == pytest.approx(flops / (per_sm_clock / 4), abs=0.01)
    assert loop["binding"] == "tensor"
    assert loop["tflops"] * 1e12 == pytest.approx(h100.paths["mma_sync"].rates["bf16"], rel=1e-3)


def test_shared_memory_bytes_by_width_and_the_profiles_bytes_per_clock():
    assert [shared_bytes(op) for op in ("LDSM.16.M88.4", "LDSM.16.MT88.4", "LDSM.16.M88", "LDS.64", "STS.U16",
                                        "LDGSTS.E.BYPASS.128", "LDG.E.128")] == [512, 512, 128, 256, 64, 512, 0]
    a100 = napkin.load_hardware("A100")
    rates = sm_rates(a100)
    # the registers level's bandwidth, per SM and clock: 32 banks of 4 bytes
    assert rates.shared_bytes == pytest.approx(128, rel=0.01)
    loop = loop_ceiling(body(*["LDSM.16.M88.4"] * 4, "HMMA.16816.F32.BF16"), rates, warps=8)
    assert loop["clocks"]["shared"] == pytest.approx(8 * 4 * 512 / rates.shared_bytes, abs=0.01)
    assert loop["binding"] == "shared"


def test_issue_mufu_and_imbalance():
    rates = sm_rates(napkin.load_hardware("H100"))
    loop = loop_ceiling(body(*["IADD3"] * 10, "MUFU.EX2"), rates, warps=8, unit="fp32")
    assert loop["clocks"]["issue"] == 2 * 11  # 8 warps: 2 on each sub-partition, 1 instruction a clock
    assert loop["clocks"]["mufu"] == pytest.approx(2 * 32 / (rates.mufu / 4), abs=0.01)
    assert loop["tflops"] is None  # no FP32 FLOPs: no rate
    six = loop_ceiling(body("HMMA.16816.F32.BF16"), rates, warps=6)
    four = loop_ceiling(body("HMMA.16816.F32.BF16"), rates, warps=4)
    # 6 warps: two sub-partitions hold 2, so the busiest works 2 HMMAs while the mean is 1.5
    assert six["imbalance"] == pytest.approx(4 / 3, abs=1e-4)
    assert six["tflops"] == pytest.approx(four["tflops"] * 3 / 4, rel=1e-6)
    assert subpartition_balance(6, 1) == pytest.approx(0.75) and subpartition_balance(6, 2) == 1


def test_predicated_instructions_cost_only_their_issue_slot():
    rates = sm_rates(napkin.load_hardware("A100"))
    plain = loop_ceiling(body("LDGSTS.E.BYPASS.128", "FFMA"), rates, warps=4, unit="fp32")
    guarded = loop_ceiling(body("LDGSTS.E.BYPASS.128", "FFMA", predicate="@P0"), rates, warps=4, unit="fp32")
    never = loop_ceiling(body("LDS", predicate="@!PT"), rates, warps=4, unit="fp32")
    assert plain["shared_bytes"] == 4 * 512 and guarded["shared_bytes"] == 0
    assert guarded["clocks"]["issue"] == plain["clocks"]["issue"] == 2
    assert never["clocks"]["issue"] == 0


# ---- every example, sm_80 and sm_90 ------------------------------------------------------------


def compiled(name: str, which: int, arch: str, hardware: str):
    (kernel,) = napkin.load(EXAMPLES / name).values()
    return kernel.compile(arch, hardware, **SIZES[name][which])


@needs_nvdisasm
@pytest.mark.parametrize("arch, hardware", TARGETS)
@pytest.mark.parametrize("name, which", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_the_model_never_promises_more_than_the_code_that_was_built(name, which, arch, hardware):
    built = compiled(name, which, arch, hardware)
    report = sass_report(built)
    assert report["hardware"] == hardware
    bounded = 0
    for launch, entry in zip(built.launches, report["launches"], strict=True):
        ceiling = entry["ceiling"]
        assert ceiling["unit"] == ("fp32" if launch.path == "fma" else "tensor")
        assert ceiling["model_tflops"] is not None and ceiling["model_tflops"] > 0
        loop = ceiling["loop"]
        if loop is not None:
            assert loop["binding"] in RESOURCES and loop["clocks"][loop["binding"]] == max(loop["clocks"].values())
        if launch.path == "fma" or ceiling["whole_function"] or ceiling["tflops"] is None:
            continue
        # a tensor-core launch whose MMAs run in its hot loop: the ceiling is a bound
        assert ceiling["tensor_in_loop"] > 0 and not loop["unpriced"]
        assert ceiling["model_s"] >= ceiling["floor_s"] * (1 - 1e-9), (entry["entry"], ceiling)
        assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9)
        # ... and no launch beats the tensor rate of its path
        assert ceiling["tflops"] <= built.program.hardware.peak("mma.sync", "bf16") / 1e12 * 1.05
        bounded += 1
    if any(k.path != "fma" for k in built.launches) and name not in ("attention_unfused.napkin",) and which == 0:
        assert bounded, "every large tensor-core example has a hot loop that bounds it"
    text = format_sass_report(report)
    assert text.count("static ceiling on " + hardware) == len(built.launches)
