"""The static ceiling read off each compiled kernel's SASS, and the model held under it.

Every runnable example (test_cuda_codegen.SIZES) is compiled for sm_80 on A100, and sm_90 and sm_90a
(wgmma where isel takes it: matmul, attention) on H100;
``sass.launch_ceiling`` prices its hot loop's instructions at the profile's per-SM rates. The model's
prediction for the built kernel (``compiled.cost``, with ptxas's resources) must not promise more
than that code can run at, wherever the ceiling is a bound: launches on tensor cores whose MMAs
run in a loop, and launches on the FMA path whose FP32 work runs in a loop (the model prices their
issue slots and shared-memory port: ``cost.fma_issue``). Straight-line code with branches, a fully
unrolled launch, counts code a run may skip, and is reported only.
"""

from __future__ import annotations

import pytest

import napkin_dsl as napkin
from napkin_dsl.backends.sass import (
    hot_loop,
    RESOURCES,
    Instruction,
    format_sass_report,
    loop_ceiling,
    sass_report,
    shared_bytes,
    sm_rates,
    tensor_work,
)
from napkin_dsl.cost import (
    LOOP_STEP,
    OPERAND_GUARD,
    cost_of,
    fma_issue,
    fma_issue_seconds,
    subpartition_balance,
)
from napkin_dsl.isel import REGISTER_TILE, select_program
from napkin_dsl.pseudocode import walk

from .conftest import EXAMPLES, needs_nvdisasm
from .test_cuda_codegen import CASES, SIZES

TARGETS = [("sm_80", "A100"), ("sm_90", "H100"), ("sm_90a", "H100"), ("sm_89", "L40S")]  # sm_90a: wgmma where isel takes it


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
    fma_bounded = []
    for index, (launch, entry) in enumerate(zip(built.launches, report["launches"], strict=True)):
        ceiling = entry["ceiling"]
        assert ceiling["unit"] == ("fp32" if launch.path == "fma" else "tensor")
        assert ceiling["model_tflops"] is not None and ceiling["model_tflops"] > 0
        loop = ceiling["loop"]
        if loop is not None:
            assert loop["binding"] in RESOURCES and loop["clocks"][loop["binding"]] == max(loop["clocks"].values())
        if ceiling["whole_function"] or ceiling["tflops"] is None:
            continue
        if launch.path == "fma":
            if products_elsewhere(built.program.launches[index], entry):
                continue
            # an FMA launch whose FP32 work runs in a loop: its issue slots and port are priced
            assert ceiling["model_s"] >= ceiling["floor_s"] * (1 - 1e-9), (entry["entry"], ceiling)
            assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9)
            fma_bounded.append(entry["entry"])
            continue
        # a tensor-core launch whose MMAs run in its hot loop: the ceiling is a bound
        assert ceiling["tensor_in_loop"] > 0 and not loop["unpriced"]
        assert ceiling["model_s"] >= ceiling["floor_s"] * (1 - 1e-9), (entry["entry"], ceiling)
        assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9)
        # ... and no launch's tensor-core work beats the tensor rate of its path. (``tflops`` counts
        # every unit's FLOPs: the softmax's FP32 work runs beside the MMAs, so a launch whose loop
        # keeps the tensor cores at peak reads a few percent above it, more at small d.)
        tensor_rate = ceiling["unit_flops"] / ceiling["floor_s"] / 1e12
        assert tensor_rate <= built.program.hardware.peak(launch.path, "bf16") / 1e12 * (1 + 1e-6), ceiling
        assert ceiling["tflops"] == pytest.approx(tensor_rate * ceiling["flops"] / ceiling["unit_flops"])
        bounded += 1
    if any(k.path != "fma" for k in built.launches) and name not in ("attention_unfused.napkin",) and which == 0:
        assert bounded, "every large tensor-core example has a hot loop that bounds it"
    if all(k.path == "fma" for k in built.launches) and name in ("matmul.napkin", "rmsnorm.napkin", "softmax.napkin"):
        assert fma_bounded, "an example on the FMA path alone is held under its ceiling"
    text = format_sass_report(report)
    assert text.count("static ceiling on " + hardware) == len(built.launches)


def products_elsewhere(launch, entry) -> bool:
    """The ceiling prices all of a launch's FP32 FLOPs at its hot loop's rate (the loop with the
    most FFMAs). Where the launch has products but that loop stores to shared memory, it is an
    epilogue (``H = silu(G) * U``, GELU) unrolled past the products' loop (which keeps its sums in
    registers and, ragged, does not unroll): the products run at another loop's rate, and the
    ceiling is no bound on them (swiglu and mlp at their ragged sizes)."""
    has_products = any(unit == "tensor" for step, _ in walk(launch.body) for unit, _ in step.flops)
    return has_products and hot_loop(entry)["classes"].get("sts", 0) > 0


# ---- the FMA path's issue slots, by hand --------------------------------------------------------

MATMUL_F32 = """
kernel mm(A: f32[m k], B: f32[k n]) -> C: f32[m n]:
    C[m n] = A[m k] * B[k n]

relabel mm on H100:
    smem: group m 64, n 64; stream k 32
"""


@pytest.mark.parametrize("m, n, k", [(128, 128, 64), (120, 128, 48)], ids=["full", "ragged"])
def test_the_fma_issue_term_is_the_product_loop_counted_by_hand(m, n, k):
    (kernel,) = napkin.load(MATMUL_F32).values()
    program = kernel.program(m=m, n=n, k=k)
    (launch,) = program.launches
    # f32 operands stay on the FMA path: each thread owns 4 x 4 register blocks of C's 64 x 64
    # tile (256 threads, 4 blocks each); per k step a block loads 4 values of A (a column of its
    # rows) and 4 of B (a row of its columns) for its 16 FFMAs.
    rm = rn = REGISTER_TILE
    products = m * n * k
    per_product = 1 + 1 / rn + 1 / rm  # the FFMA, and its share of the two operands' LDS
    if m % 64:  # A's rows are ragged: each value of A is guarded, indexed and addressed at run time
        per_product += OPERAND_GUARD / rn
    if n % 64:
        per_product += OPERAND_GUARD / rm
    if k % 32:  # a ragged k chunk: the k loop does not unroll
        per_product += LOOP_STEP / (rm * rn)
    slots, nbytes = fma_issue(program, launch, select_program(program, "sm_90"))
    assert slots == pytest.approx(products * per_product, abs=1)
    assert nbytes == products * (1 / rn + 1 / rm) * 4
    # the model's compute takes at least the issue slots at 4 x 32 thread instructions a clock
    hardware = program.hardware
    sms = hardware.level("smem").units
    issue_s, port_s = fma_issue_seconds(program, launch, select_program(program, "sm_90"))
    assert issue_s == pytest.approx(products * per_product / (128 * sms * hardware.clock_hz), rel=1e-6)
    report = cost_of(program, arch="sm_90")
    assert report.time["compute_s"] >= issue_s * (1 - 1e-9)
    assert report.time["compute_s"] >= port_s * (1 - 1e-9)
    # on H100 the FP32 lanes match the issue rate, so any LDS makes issue, not FLOPs, bind
    assert issue_s > 2 * products / hardware.peak("fma", "f32")

