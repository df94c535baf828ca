"""fp8 attention at FlashAttention-3's tile, issued in fewer instructions (issue 44, items 1 and 4).

FA3's fp8 tile at d = 128 is 128 query rows by chunks of 128 keys. Its fragments (182 a
thread) are over the 160 an unspecialized mma.sync warp holds, but within what ptxas compiled
without spills for wgmma's consumers at 240 registers and for the synchronous ring of two
warpgroups (``paths.wgmma.SERIAL_BUDGET``): it builds on QGMMA, and is not refused to FMA.

A chunk's scores were multiplied three times each: by d^-0.5 where S was produced, then by
sQ and by sK in the softmax's operand, in the source's order, which the compiler keeps. The
printer now leaves S unscaled and groups the operand's factors that are no fragment apart from
it, the scale among them (``TensorPrinter.grouped_factors``, ``factor_folded``):
``S * ((d^-0.5 * sQ) * sK)``, whose loop-invariant part is computed once. With per-tensor scales
that is one multiply a score, and an iteration issues at most 1,300 clocks of instructions
against the tensor cores' 1,024, by the static ceiling's count of the SASS. Held here on the
SASS, and on PoCL against the float64 reference, where a fold that drops the scale fails.
"""

from __future__ import annotations

import collections
import re

import pytest

import napkin_dsl as napkin

from .conftest import EXAMPLES, assert_matches_reference, compiled_listing

# FA3's form of fp8 attention with per-tensor scales, V stored keys fastest or as TMA writes it
PER_TENSOR = """kernel fp8_fa3(Q: fp8e4m3[b h q d], sQ: f32, K: fp8e4m3[b h x d], sK: f32, V: fp8e4m3[b h V_AXES], sV: f32) -> O: bf16[b h q d]:
    S[b h q x] = Q * K * d^-0.5
    P[b h q x] = softmax[x](S * sQ * sK)
    O[b h q d] = P * V * sV

relabel fp8_fa3 on H100:
    smem: group b 1, h 1, q 128; stream x 128
"""
LAYOUTS = {"V [d x]": PER_TENSOR.replace("V_AXES", "d x"), "V [x d]": PER_TENSOR.replace("V_AXES", "x d")}
BIG = dict(b=4, h=32, q=8192, x=8192, d=128)


def _kernel(text):
    (kernel,) = napkin.load(text).values()
    return kernel


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fa3s_fp8_tile_is_built_on_wgmma_not_refused_to_fma(layout):
    from napkin_dsl.isel import selection
    from napkin_dsl.paths.plan import live_fragment_values
    from napkin_dsl.paths.wgmma import SERIAL_BUDGET

    program = _kernel(LAYOUTS[layout]).gpu_program("H100", **BIG)
    chosen = selection(program, program.launches[0], "sm_90a")
    assert chosen.path == "wgmma", chosen.reason
    held = live_fragment_values(chosen.plan, program.launches[0], chosen.tile)
    assert 160 < held <= SERIAL_BUDGET  # over mma.sync's budget, within wgmma's measured one
    # V stored keys fastest takes the roles; V [x d] is copied K-major on the synchronous ring
    assert (chosen.plan.roles is not None) == (layout == "V [d x]")
    assert chosen.plan.transposed == (() if layout == "V [d x]" else ("V",))


def test_the_printed_softmax_multiplies_each_score_once_by_the_grouped_invariant_factor():
    source = _kernel(LAYOUTS["V [d x]"]).compile("sm_90a", hardware="H100", **BIG).source
    assert "// folded into the softmax operand's loop-invariant factor: one multiply a value" in source
    exponent = [line.strip() for line in source.splitlines() if "nk_exp2(" in line and "p_sQ" in line]
    assert exponent and all("(f_S[mt][nt][i] * ((0.08838834764831845f * p_sQ) * p_sK))" in line for line in exponent), exponent
    assert "*= 0.08838834764831845f" not in source  # S is not scaled in place


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_iteration_issues_at_most_1300_clocks_against_1024_tensor_clocks(layout):
    """The static ceiling's clocks of the hot loop, per 1,024 tensor clocks (a chunk of 128
    keys): issue at most 1,300 (2,222 with V [x d] and 1,728 with V [d x] when the issue was
    filed, at chunks of 64), QGMMA in the loop, no spills, no local memory, the model under
    the ceiling."""
    from napkin_dsl.backends import sass

    compiled, instructions = compiled_listing(_kernel(LAYOUTS[layout]), **BIG)
    opcodes = collections.Counter(i.base for i in instructions)
    assert opcodes["LDL"] == opcodes["STL"] == 0 and opcodes["QGMMA"], opcodes
    (entry,) = sass.sass_report(compiled)["launches"]
    ceiling = entry["ceiling"]
    clocks = ceiling["loop"]["clocks"]
    assert clocks["issue"] / clocks["tensor"] * 1024 <= 1300, clocks
    assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9)


def _run(text, sizes):
    from napkin_dsl.backends import opencl
    from napkin_dsl.reference import evaluate

    from .test_tensorcore import random_inputs

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    from napkin_dsl.isel import selection

    kernel = _kernel(text)
    program = kernel.gpu_program("H100", **sizes)
    assert selection(program, program.launches[0], "sm_90a").path == "wgmma"
    inputs, scalars = random_inputs(kernel.diagram, sizes, seed=sum(sizes.values()))
    # scales of either sign: the grouped factor multiplies before the max, so no sign is assumed
    scalars.update(sQ=1.75, sK=-0.625, sV=0.5)
    outputs = opencl.run(program, inputs, scalars, arch="sm_90a")
    return program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_folded_scale_matches_the_reference_on_pocl(layout):
    program, outputs, expected = _run(LAYOUTS[layout], dict(b=1, h=1, q=128, x=208, d=32))
    assert_matches_reference(program, outputs, expected, layout)


def test_a_fold_that_drops_the_scale_fails_on_pocl(monkeypatch):
    from napkin_dsl import algebra
    from napkin_dsl.backends.tensorcore import TensorPrinter
    from napkin_dsl.diagram import Const

    original = TensorPrinter.fold_scales

    def dropped(self):
        original(self)
        assert self.factor_folded, "nothing folded: nothing to plant"
        self.factor_folded = {name: Const(algebra.Integer(1)) for name in self.factor_folded}

    monkeypatch.setattr(TensorPrinter, "fold_scales", dropped)
    program, outputs, expected = _run(LAYOUTS["V [d x]"], dict(b=1, h=1, q=128, x=208, d=32))
    with pytest.raises(AssertionError):
        assert_matches_reference(program, outputs, expected, "dropped")


# ---- sm_89: the same tile on mma.sync's native 8-bit shape (QMMA) ----------------------------

L40S = LAYOUTS["V [d x]"].replace("on H100", "on L40S")


def test_fa3s_fp8_tile_builds_rolled_on_qmma_for_sm_89():
    """On an Ada GPU (sm_89, L40S) the tile is mma.sync m16n8k32: 8 warps of 16 rows hold 182
    fragment registers, over FRAGMENT_BUDGET, within the rolled budget (one chunk a trip): no
    spills, no local memory, QMMA in the hot loop, the model under the static ceiling."""
    from napkin_dsl.backends import sass
    from napkin_dsl.isel import plan_summary, selection

    kernel = _kernel(L40S)
    program = kernel.gpu_program("L40S", **BIG)
    chosen = selection(program, program.launches[0], "sm_89")
    assert chosen.path == "mma.sync" and chosen.plan.rolled, chosen.reason
    # --resources says which shape and why
    assert plan_summary(chosen.plan) == ("registers: group q 16 (8 warps of 16 q rows); cp.async 2 stages for K, V; the stream "
                                         "loop rolled, one chunk a trip (fragments over 160 registers, within 204)")
    compiled, instructions = compiled_listing(kernel, "sm_89", "L40S", **BIG)
    opcodes = collections.Counter(i.base for i in instructions)
    assert opcodes["LDL"] == opcodes["STL"] == 0 and opcodes["QMMA"] and not opcodes["HMMA"], opcodes
    (entry,) = sass.sass_report(compiled)["launches"]
    assert entry["ceiling"]["model_tflops"] <= entry["ceiling"]["tflops"] * (1 + 1e-9)


def test_the_rolled_qmma_build_matches_the_reference_on_pocl(opencl_device):
    from napkin_dsl.backends import opencl
    from napkin_dsl.isel import selection
    from napkin_dsl.reference import evaluate

    from .test_tensorcore import random_inputs

    sizes = dict(b=1, h=1, q=200, x=208, d=128)
    kernel = _kernel(L40S)
    program = kernel.gpu_program("L40S", **sizes)
    assert selection(program, program.launches[0], "sm_89").plan.rolled
    inputs, scalars = random_inputs(kernel.diagram, sizes, seed=5)
    scalars.update(sQ=0.75, sK=-1.25, sV=0.5)
    outputs = opencl.run(program, inputs, scalars, arch="sm_89")
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), "sm_89 rolled")


# ---- a register-budget refusal names the tile that would have fitted (item 1) -----------------

FA3_FORM_256 = (EXAMPLES / "fp8_attention.napkin").read_text().replace("stream x 64", "stream x 256")
SHAPE = dict(b=4, h=32, qb=64, qi=128, x=8192, d=128)


def test_a_tile_over_the_register_budget_names_the_stream_tile_that_fits_and_that_tile_builds():
    from napkin_dsl.isel import selection

    program = _kernel(FA3_FORM_256).gpu_program("H100", **SHAPE)
    chosen = selection(program, program.launches[0], "sm_90a")
    assert chosen.path == "fma"
    assert "use smaller tiles (stream x 64 would hold 150)" in chosen.reason  # mma.sync's 160
    assert "not wgmma either: a thread would hold 246 fragment registers" in chosen.reason
    assert "use smaller tiles (stream x 128 would hold 182)" in chosen.reason  # wgmma's 182
    named = _kernel(FA3_FORM_256.replace("stream x 256", "stream x 128")).gpu_program("H100", **SHAPE)
    assert selection(named, named.launches[0], "sm_90a").path == "wgmma"


ARCHES = [("A100", "sm_80"), ("L40S", "sm_89"), ("H100", "sm_90"), ("H100", "sm_90a")]


@pytest.mark.parametrize("hardware, arch", ARCHES)
def test_no_example_falls_to_fma_over_its_registers_where_a_halved_stream_tile_fits(hardware, arch):
    """Every example, on every path napkin builds: a launch with a contraction that stays on FMA
    over a register budget either names a stream tile that fits (and that tile is not refused
    over registers), or none fits: its stream tile halved is refused over registers too."""
    from napkin_dsl.isel import select_program

    from .test_cuda_codegen import SIZES

    checked = 0
    for name, runs in SIZES.items():
        for kernel in napkin.load(EXAMPLES / name).values():
            sizes = {a: n for a, n in runs[0].items() if a in kernel.diagram.axes}
            program = kernel.gpu_program(hardware, **sizes)
            for index, chosen in select_program(program, arch).launches.items():
                if chosen.path != "fma" or "fragment registers" not in (chosen.reason or ""):
                    continue
                checked += 1
                named = re.search(r"stream (\w+) (\d+) would hold", chosen.reason)
                text = (EXAMPLES / name).read_text()
                block = text[text.index(f"relabel {kernel.name} "):]
                written = re.search(r"stream (\w+) (\d+)", block)
                assert written, (name, block)  # every example's launch over its registers streams
                axis = named.group(1) if named else written.group(1)
                assert axis == written.group(1), (name, chosen.reason, block)
                tile = named.group(2) if named else str(int(written.group(2)) // 2)
                smaller = napkin.load(text.replace(block, block.replace(written.group(0), f"stream {axis} {tile}", 1)))[kernel.name]
                program = smaller.gpu_program(hardware, **sizes)
                again = select_program(program, arch).launches[index]
                assert ("fragment registers" not in (again.reason or "")) == bool(named), (name, arch, again.reason)
    assert checked or arch != "sm_90"  # fp8 attention on sm_90's converted 8-bit path is one
