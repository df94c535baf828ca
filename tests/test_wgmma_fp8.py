"""wgmma's 8-bit shape on sm_90a (issue 23): fp8 matmul on ``wgmma.mma_async.m64nNk32.f32.e4m3.e4m3``.

The 8-bit shape reads both operands from shared memory by K-major descriptors (it has no
transpose immediates), 32 bytes of k an instruction, into the 16-bit shape's f32 accumulator.
Stored [n k] (a Linear layer's weight), both operands are K-major and the product is wgmma's.
examples/fp8_matmul.napkin stores B [k n], and an A may be stored [k m]: such an operand is
copied K-major each chunk of the stream (issue 44, item 3; the copy's lanes are
tests/test_wgmma_fp8_attention.py's, where V [x d] takes the same copy). Held here: selection
(the example on wgmma; an MN-major operand copied, or declined by name when k is not streamed;
a k tile that is not whole instructions declined by name), the wrapper's PTX,
NVRTC's sm_90a SASS (QGMMA, SASS's name for the 8-bit wgmma, in the hot loop with both operands
by descriptor, TMA and mbarriers, no spills, no local memory, the model under the static
ceiling), and PoCL runs of the OpenCL printing, whose emulation decodes the descriptors and each
fp8 byte from the formats' definitions, against the float64 reference: random operands at ragged
sizes, and every finite byte value against ml_dtypes' decoding of it.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import layouts
from napkin_dsl.isel import selection

from .conftest import EXAMPLES, assert_matches_reference, compiled_listing

# the example with B stored [n k]: k fastest in both operands
EXAMPLE = (EXAMPLES / "fp8_matmul.napkin").read_text().replace("B: fp8e4m3[k n]", "B: fp8e4m3[n k]")
BIG = dict(m=8192, n=8192, k=8192)


def _program(text=EXAMPLE, **sizes):
    (kernel,) = napkin.load(text).values()
    return kernel.gpu_program("H100", **sizes)


# ---- selection ------------------------------------------------------------------------------


def test_the_fp8_matmul_with_a_k_fastest_b_is_planned_on_wgmmas_8_bit_shape_for_sm_90a():
    program = _program(m=512, n=512, k=512)
    chosen = selection(program, program.launches[0], "sm_90a")
    assert chosen.path == "wgmma" and chosen.plan.dtype == "fp8e4m3" and chosen.plan.shape == "m64n128k32"
    mma = chosen.plan.mmas["Acc"]
    assert (mma.a_trans, mma.b_trans, mma.a_in_registers) == (False, False, False)  # both K-major, from shared memory
    assert {load.array: load.element_bytes for load in chosen.plan.tma} == {"A": 1, "B": 1}
    assert selection(program, program.launches[0], "sm_90").path == "mma.sync"  # m16n8k32 there
    from napkin_dsl.cost import instruction_path
    from napkin_dsl.isel import select_program

    assert instruction_path(program, program.launches[0], select_program(program, "sm_90a")) == "wgmma"


@pytest.mark.parametrize("what, text, sizes, reason", [
    ("B stored [k n] with k whole", (EXAMPLES / "fp8_matmul.napkin").read_text().replace("; stream k 64", ""),
     dict(m=512, n=512, k=64), "K-major only: B has k outside its fastest axis and is not streamed"),
    ("a k tile of 48", EXAMPLE.replace("stream k 64", "stream k 48"), dict(m=512, n=512, k=480), "not a multiple of 32"),
])
def test_what_the_8_bit_wgmma_does_not_take_is_declined_by_name(what, text, sizes, reason):
    program = _program(text, **sizes)
    chosen = selection(program, program.launches[0], "sm_90a")
    assert chosen.path != "wgmma" and reason in (chosen.declined or chosen.reason), (what, chosen.declined, chosen.reason)


@pytest.mark.parametrize("dtype, ptx", [("fp8e4m3", "e4m3"), ("fp8e5m2", "e5m2")])
def test_the_8_bit_wrapper_is_the_isas_form_with_no_transpose_immediates(dtype, ptx):
    from napkin_dsl.backends.wgmma import cuda_wrapper

    text = cuda_wrapper(128, dtype, False, False)
    # PTX ISA 9.7.15.5.2: d, a-desc, b-desc, scale-d, imm-scale-a, imm-scale-b (imm-trans-* are .f16/.bf16's)
    assert f"wgmma.mma_async.sync.aligned.m64n128k32.f32.{ptx}.{ptx} {{" in text
    assert "}, %64, %65, 1, 1, 1;" in text and text.count('"+f"') == 64
    with pytest.raises(AssertionError):
        cuda_wrapper(128, dtype, False, True)  # no transposed 8-bit operand


# ---- the compiled kernel --------------------------------------------------------------------


def test_the_k_fastest_fp8_matmul_compiles_for_sm_90a_with_qgmma_in_the_hot_loop():
    from napkin_dsl.backends import sass

    (kernel,) = napkin.load(EXAMPLE).values()
    compiled, instructions = compiled_listing(kernel, **BIG)
    assert compiled.launches[0].path == "wgmma"
    opcodes = collections.Counter(i.base for i in instructions)
    assert opcodes["LDL"] == opcodes["STL"] == 0 and opcodes["UTMALDG"] and opcodes["SYNCS"], opcodes
    ranges = [(s, e) for s, e in sass.loop_ranges(instructions)
              if any(s <= i.address <= e and i.base == "QGMMA" for i in instructions)]
    start, end = min(ranges, key=lambda r: r[1] - r[0])
    body = [i for i in instructions if start <= i.address <= end]
    qgmma = [i for i in body if i.base == "QGMMA"]
    # nvdisasm: QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24 (both by descriptor, no tnsp)
    assert qgmma and len(qgmma) % (64 // 32) == 0, qgmma  # two a chunk of 64 bytes of k, each 32
    assert all(i.opcode == "QGMMA.64x128x32.F32.E4M3.E4M3" and "gdesc[" in i.operands and "tnsp" not in i.operands
               for i in qgmma), collections.Counter(i.opcode for i in body)
    assert not any(i.base in ("LDSM", "HMMA", "QMMA", "HGMMA") for i in body)
    (entry,) = sass.sass_report(compiled)["launches"]
    ceiling = entry["ceiling"]
    assert ceiling["binding"] == "tensor" and not ceiling["loop"]["unpriced"]
    assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9)
    # ... at the profile's 8-bit wgmma rate (about twice the 16-bit one), and above the 16-bit one
    hardware = compiled.program.hardware
    assert hardware.peak("wgmma", "fp8e4m3") == pytest.approx(2 * hardware.peak("wgmma", "bf16"), rel=1e-3)
    assert hardware.peak("wgmma", "bf16") / 1e12 < ceiling["tflops"] <= hardware.peak("wgmma", "fp8e4m3") / 1e12 * 1.001


# ---- the emulation: PoCL runs the sm_90a kernel's OpenCL printing ---------------------------


def _run(text, inputs: dict, sizes: dict):
    from napkin_dsl.backends import opencl

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    program = _program(text, **sizes)
    assert selection(program, program.launches[0], "sm_90a").path == "wgmma"
    source, _ = opencl.generate(program, arch="sm_90a")
    assert "nk_wgmma8(" in source.split("__kernel")[1] and "NK_LDSM" not in source.split("__kernel")[1]
    return program, opencl.run(program, inputs, {}, arch="sm_90a")


@pytest.mark.parametrize("dtype", ["fp8e4m3", "fp8e5m2"])
@pytest.mark.parametrize("sizes", [dict(m=200, n=136, k=96), dict(m=64, n=16, k=32), dict(m=130, n=264, k=160)], ids=str)
def test_the_emulated_8_bit_wgmma_matches_the_reference_at_ragged_sizes(dtype, sizes):
    from napkin_dsl.reference import evaluate

    from .test_tensorcore import random_inputs

    text = EXAMPLE.replace("fp8e4m3", dtype)
    (kernel,) = napkin.load(text).values()
    inputs, _ = random_inputs(kernel.diagram, sizes, seed=sum(sizes.values()))
    program, outputs = _run(text, inputs, sizes)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, {}, sizes), f"{dtype} {sizes}")


@pytest.mark.parametrize("dtype", ["fp8e4m3", "fp8e5m2"])
def test_the_emulation_decodes_every_finite_byte_as_the_format_defines_it(dtype):
    """A holds every finite byte value of the format, B[n k] is the identity: C[m n] = A[m n]
    (scales 1), each byte decoded by the emulation, against ml_dtypes' decoding of it."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    kind = ml_dtypes.float8_e4m3fn if dtype == "fp8e4m3" else ml_dtypes.float8_e5m2
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(kind)
    finite = codes[np.isfinite(values.astype(np.float32))]
    m = 64  # one warpgroup's rows (the first few hold the values, the rest zeros)
    a = np.zeros(m * 64, dtype=np.uint8)
    a[:len(finite)] = finite
    sizes = dict(m=m, n=64, k=64)
    inputs = {"A": a.reshape(m, 64).view(kind), "sA": np.ones(m, np.float32),
              "B": np.eye(64, dtype=np.float32).astype(kind), "sB": np.ones(64, np.float32)}
    _, outputs = _run(EXAMPLE.replace("fp8e4m3", dtype), inputs, sizes)
    got = outputs["C"].astype(np.float64).reshape(-1)[:len(finite)]
    want = finite.view(kind).astype(np.float64)
    # C is bf16: each decoded value rounded to it, as the reference rounds it
    assert np.array_equal(got, want.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64))


def test_the_emulation_sees_a_swapped_stride_field(monkeypatch):
    """The emulation decodes the descriptors' fields: an encoder that swaps the leading and stride
    byte offsets computes something else than the product."""
    from napkin_dsl.reference import evaluate

    from .test_tensorcore import random_inputs

    original = layouts.CanonicalTile.strides
    monkeypatch.setattr(layouts.CanonicalTile, "strides", lambda self, k_major: original(self, k_major)[::-1])
    sizes = dict(m=128, n=128, k=64)
    (kernel,) = napkin.load(EXAMPLE).values()
    inputs, _ = random_inputs(kernel.diagram, sizes)
    _, outputs = _run(EXAMPLE, inputs, sizes)
    expected = evaluate(kernel.diagram, inputs, {}, sizes)["C"].astype(np.float64)
    assert not np.allclose(outputs["C"].astype(np.float64), expected, atol=1e-2)


@pytest.mark.parametrize("layout", ["A [m k], B [n k]", "A [k m], B [k n]"])
def test_oclgrind_finds_no_race_or_bad_access_in_the_emulated_8_bit_wgmma(layout, tmp_path):
    """Both operands K-major as stored, and both copied K-major each chunk (the copies' writes and
    the products' reads ordered by the barrier after them, the next chunk's copy by the one
    before its products)."""
    from .test_tensorcore import oclgrind

    # oclgrind's 32 KB of local memory: the copies' chunk is 32 of k (a test, not a schedule)
    text = EXAMPLE if layout == "A [m k], B [n k]" else MN_MAJOR[layout][0].replace("stream k 64", "stream k 32")
    sizes = dict(m=144, n=80, k=64) if layout == "A [m k], B [n k]" else dict(m=144, n=64, k=96)
    program = _program(text, **sizes)
    assert selection(program, program.launches[0], "sm_90a").path == "wgmma"
    path = tmp_path / "fp8_linear.napkin"
    path.write_text(text)
    result = oclgrind(str(path), [f"{axis}={size}" for axis, size in sizes.items()], "--arch", "sm_90a")
    assert result.returncode == 0, result.stderr[-2000:]
    report = result.stdout + result.stderr
    assert "data race" not in report and "Invalid" not in report and "error" in report, report[-2000:]


# ---- an operand stored MN-major: copied K-major each chunk (issue 44, item 3) --------------

# examples/fp8_matmul.napkin as written stores B [k n]; A may be stored [k m] as well
MN_MAJOR = {
    "B [k n]": ((EXAMPLES / "fp8_matmul.napkin").read_text(), ("B",)),
    "A [k m]": (EXAMPLE.replace("A: fp8e4m3[m k]", "A: fp8e4m3[k m]"), ("A",)),
    "A [k m], B [k n]": ((EXAMPLES / "fp8_matmul.napkin").read_text().replace("A: fp8e4m3[m k]", "A: fp8e4m3[k m]"), ("A", "B")),
}


@pytest.mark.parametrize("layout", MN_MAJOR)
def test_an_mn_major_8_bit_operand_is_copied_k_major_on_wgmma(layout):
    text, copied = MN_MAJOR[layout]
    program = _program(text, m=512, n=512, k=512)
    chosen = selection(program, program.launches[0], "sm_90a")
    assert chosen.path == "wgmma" and chosen.plan.transposed == copied
    assert chosen.plan.shape == "m64n128k32"
    for name in copied:  # the copy: rows and columns swapped, one stage, on the canonical layout
        staged, copy = chosen.slots[name], chosen.slots[f"{name}.kmajor"]
        assert (copy.tile.rows, copy.tile.cols, copy.stages) == (staged.tile.cols, staged.tile.rows, 1)
        assert layouts.transpose_split(staged.tile, copy.tile).conflict == 1.0  # 64 rows of 128 bytes


def test_an_mn_major_8_bit_a_stays_off_mma_sync_by_name():
    """mma.sync's A comes by ldmatrix, whose .trans moves 16-bit values: an fp8 A [k m] is
    refused there by name (on sm_90, where the 8-bit wgmma is not), and the launch says so."""
    text, _ = MN_MAJOR["A [k m]"]
    program = _program(text, m=512, n=512, k=512)
    chosen = selection(program, program.launches[0], "sm_90")
    assert chosen.path != "mma.sync" and "an fp8 A is read by ldmatrix, which needs k fastest" in chosen.reason


# ragged wherever the copies allow: a row in memory is whole 16-byte units (TMA's strides)
@pytest.mark.parametrize("layout, dtype, sizes", [
    ("B [k n]", "fp8e4m3", dict(m=200, n=144, k=96)),
    ("B [k n]", "fp8e5m2", dict(m=64, n=32, k=32)),
    ("A [k m]", "fp8e4m3", dict(m=144, n=264, k=160)),
    ("A [k m], B [k n]", "fp8e4m3", dict(m=144, n=176, k=99)),
], ids=str)
def test_the_emulated_copies_match_the_reference(layout, dtype, sizes):
    from napkin_dsl.reference import evaluate

    from .test_tensorcore import random_inputs

    text = MN_MAJOR[layout][0].replace("fp8e4m3", dtype)
    (kernel,) = napkin.load(text).values()
    inputs, _ = random_inputs(kernel.diagram, sizes, seed=sum(sizes.values()))
    program, outputs = _run(text, inputs, sizes)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, {}, sizes), f"{layout} {dtype} {sizes}")


def test_a_copy_that_writes_its_rows_unswapped_fails_on_pocl(monkeypatch):
    """The example's copy (64 k rows of 128 bytes into 128 n rows of 64) writes odd n blocks'
    rows in swapped pairs, with the selectors traded to match: a printer that trades the
    selectors but keeps the rows in order puts B's values on the wrong n, and C is wrong."""
    from napkin_dsl.backends import wgmma
    from napkin_dsl.reference import evaluate

    from .test_tensorcore import random_inputs

    original = wgmma.WgmmaPrinter.transpose

    def unswapped(self, name):
        start = len(self.lines)
        original(self, name)
        assert any("nk_ts" in line for line in self.lines[start:]), "the split swaps no rows: nothing to plant"
        self.lines[start:] = [line.replace("(nk_tn + nk_ts)", "nk_tn").replace(" ^ nk_ts)", ")") for line in self.lines[start:]]

    monkeypatch.setattr(wgmma.WgmmaPrinter, "transpose", unswapped)
    text = MN_MAJOR["B [k n]"][0]
    sizes = dict(m=64, n=128, k=64)
    (kernel,) = napkin.load(text).values()
    inputs, _ = random_inputs(kernel.diagram, sizes)
    program, outputs = _run(text, inputs, sizes)
    with pytest.raises(AssertionError):
        assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, {}, sizes), "unswapped")


def test_the_example_as_written_compiles_for_sm_90a_on_qgmma_with_a_conflict_free_copy():
    """examples/fp8_matmul.napkin (B [k n]) at 8192^3: QGMMA by descriptor in the hot loop, no
    16-bit product and no conversion of fp8 operands (F2FP: mma.sync's road on sm_90a before
    the copy), no spills, no local memory; the printed copy is the split's, conflict-free; the
    model under the static ceiling, both above the 16-bit peak."""
    from napkin_dsl.backends import sass

    from .test_wgmma_fp8_attention import assert_printed_copy_is_the_split

    text = MN_MAJOR["B [k n]"][0]
    (kernel,) = napkin.load(text).values()
    compiled, instructions = compiled_listing(kernel, **BIG)
    assert compiled.launches[0].path == "wgmma"
    split = assert_printed_copy_is_the_split(text, BIG, "B")
    assert split.conflict == 1.0
    opcodes = collections.Counter(i.base for i in instructions)
    assert opcodes["LDL"] == opcodes["STL"] == 0 and opcodes["QGMMA"], opcodes
    assert not opcodes["HMMA"] and not opcodes["HGMMA"] and not opcodes["QMMA"], opcodes
    ranges = [(s, e) for s, e in sass.loop_ranges(instructions)
              if any(s <= i.address <= e and i.base == "QGMMA" for i in instructions)]
    start, end = min(ranges, key=lambda r: r[1] - r[0])
    body = collections.Counter(i.base for i in instructions if start <= i.address <= end)
    qgmma = [i for i in instructions if start <= i.address <= end and i.base == "QGMMA"]
    assert qgmma and all("gdesc[" in i.operands and "tnsp" not in i.operands for i in qgmma)
    assert not body["F2FP"] and body["PRMT"] and body["STS"], body  # the copy's byte permutes, no conversion
    (entry,) = sass.sass_report(compiled)["launches"]
    ceiling = entry["ceiling"]
    assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9)
    assert ceiling["model_tflops"] > compiled.program.hardware.peak("wgmma", "bf16") / 1e12 * 0.9
