"""wgmma on sm_90a (issue 27, step 1): matmul by descriptor, operands staged by cp.async.

The PTX ISA's definitions are written out here, apart from ``layouts.py``'s encoder, and the
layouts and descriptors are held against them: the descriptor's bit fields (9.7.15.5.1.2.2,
"Matrix Descriptor Format"), the D fragment (9.7.15.5.1.1.1, the m64nNk16 accumulator figure),
the canonical swizzled layouts (9.7.15.5.1.2, "Shared Memory Matrix Layout": atoms of 8 rows of
the swizzle width, address bits [4, 4+b) XOR bits [7, 7+b)). Then NVRTC compiles the generated
matmul for sm_90a (HGMMA in the hot loop, no spills, no local memory), and PoCL runs its OpenCL
printing, whose wgmma emulation decodes the descriptors the kernel forms from their bits, against
A @ B at ragged sizes; a swapped stride field must fail that run.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import layouts
from napkin_dsl.isel import selection
from napkin_dsl.paths import MmaSyncPlan

from .conftest import EXAMPLES

MATMUL = EXAMPLES / "matmul.napkin"


# ---- the PTX ISA, written here --------------------------------------------------------------


def isa_fields(desc: int) -> dict:
    """The descriptor's fields as the ISA's table lays them out; addresses and offsets in bytes."""
    return {"start": (desc & ((1 << 14) - 1)) << 4, "leading": ((desc >> 16) & ((1 << 14) - 1)) << 4,
            "stride": ((desc >> 32) & ((1 << 14) - 1)) << 4, "base_offset": (desc >> 49) & 0b111,
            "swizzle": {0: None, 1: 128, 2: 64, 3: 32}[desc >> 62], "reserved": desc & (0b11 << 14 | 0b11 << 30 | 0b111 << 46 | (1 << 10) - 1 << 52)}


def isa_d(thread: int, v: int) -> tuple[int, int]:
    """wgmma .m64nNk16 accumulator D, f32: (row, col) of d_v of a thread of the warpgroup."""
    warp, lane = thread // 32, thread % 32
    group, tig = lane >> 2, lane % 4
    row = 16 * (warp % 4) + group + (8 if v % 4 >= 2 else 0)
    col = 8 * (v // 4) + 2 * tig + (v % 2)
    return row, col


def isa_swizzled(address: int, width: int) -> int:
    """The swizzle of a byte address: 128B XORs bits 4-6 with bits 7-9, 64B bits 4-5 with 7-8, 32B bit 4 with 7."""
    mask = {128: 7, 64: 3, 32: 1}[width]
    return address ^ (((address >> 7) & mask) << 4)


def isa_canonical(rows: int, cols: int, eb: int, row: int, col: int) -> int:
    """The canonical layout as the ISA draws it: atoms of 8 rows x ``width`` bytes, one after another
    down the rows of an atom column, atom columns one after another; then the address swizzle."""
    width = min(128, cols * eb)
    atom_col, byte = divmod(col * eb, width)
    linear = atom_col * rows * width + (row // 8) * 8 * width + (row % 8) * width + byte
    return isa_swizzled(linear, width)


# ---- the layouts against the ISA ------------------------------------------------------------


@pytest.mark.parametrize("n", [8, 16, 64, 128, 256])
def test_the_d_fragment_is_the_isas_figure_and_each_warp_holds_mma_syncs_c_fragments(n):
    d = layouts.wgmma_d(n)
    assert d.extent("thread") == 128 and d.extent("v") == n // 2
    cells = set()
    for thread in range(128):
        for v in range(n // 2):
            assert d(thread, v) == isa_d(thread, v)
            cells.add(d(thread, v))
            # warp w of the group: rows 16 w.., value 4 nt + i is mma.sync's c_i of n-tile nt
            row, col = layouts.mma_c(thread % 32, v % 4)
            assert d(thread, v) == (16 * (thread // 32) + row, 8 * (v // 4) + col)
    assert cells == {(r, c) for r in range(64) for c in range(n)}


def test_descriptor_fields_are_where_the_isa_puts_them():
    for start, leading, stride, swizzle in [(0x400, 16, 1024, 1), (0x3FFF0, 4096, 512, 2), (0x12340, 0x3FFF0, 16, 3)]:
        desc = layouts.MatrixDescriptor(start, leading, stride, swizzle).encode()
        assert desc < 1 << 64
        fields = isa_fields(desc)
        assert (fields["start"], fields["leading"], fields["stride"]) == (start, leading, stride)
        assert fields["swizzle"] == {1: 128, 2: 64, 3: 32}[swizzle] and fields["base_offset"] == 0
        assert fields["reserved"] == 0
    # matrix-descriptor-encode keeps bits 4-17 of an address: the shared window is 256 KiB
    assert isa_fields(layouts.MatrixDescriptor(0x40010, 16, 16, 1).encode())["start"] == 0x10


@pytest.mark.parametrize("rows, cols", [(128, 64), (128, 32), (64, 16), (32, 128), (16, 256), (64, 192)])
def test_the_canonical_tile_is_a_bijection_and_the_isas_drawing(rows, cols):
    tile = layouts.CanonicalTile(rows, cols, 2)
    seen = set()
    for r in range(rows):
        for c in range(0, cols, 8):  # 16-byte units: cp.async's grain
            offset = tile.offset(r, c)
            assert offset == isa_canonical(rows, cols, 2, r, c)
            assert offset % 16 == 0 and tile.offset(r, c + 7) == offset + 14
            seen.add(offset)
    assert seen == set(range(0, tile.bytes, 16))
    assert tile.width == min(128, cols * 2) and tile.alignment == 8 * tile.width


def test_descriptor_strides_step_8_rows_and_an_atom_column_as_the_isa_defines_them():
    tile = layouts.CanonicalTile(32, 128, 2)  # matmul's B chunk: k 32 rows of n 128 (MN-major, two 128B atoms)
    fields = isa_fields(layouts.descriptor(tile, k_major=False).encode())
    assert fields["swizzle"] == 128
    # MN-major: leading = the next atom of n (64 values on), stride = the next 8 rows of k
    assert tile.offset(0, 64) == fields["leading"] and tile.offset(8, 0) == fields["stride"]
    a = layouts.CanonicalTile(128, 32, 2)  # matmul's A chunk: m 128 rows of k 32 (K-major, 64B atoms)
    fields = isa_fields(layouts.descriptor(a, k_major=True).encode())
    assert fields["swizzle"] == 64 and a.offset(8, 0) == fields["stride"] and fields["leading"] == 16  # unused: "assumed 1"


# ---- selection ------------------------------------------------------------------------------


def _program(**sizes):
    return napkin.load(MATMUL)["matmul"].gpu_program("H100", **sizes)


def test_matmul_is_planned_on_wgmma_for_sm_90a_only():
    program = _program(m=256, n=256, k=256)
    (launch,) = program.launches
    built = selection(program, launch, "sm_90a")
    # two consumer warpgroups of 64 rows, and a producer warpgroup (tests/test_pipeline.py)
    assert built.path == "wgmma" and built.plan.shape == "m64n128k16" and built.plan.warps == 8 and built.plan.threads == 384
    assert selection(program, launch, "sm_90").path == "mma.sync"
    assert type(selection(program, launch, "sm_90").plan) is MmaSyncPlan
    from napkin_dsl.cost import cost_of, instruction_path
    from napkin_dsl.isel import select_program

    assert instruction_path(program, launch, select_program(program, "sm_90a")) == "wgmma"
    # the products at the wgmma path's rate: half the time of mma.sync's
    assert cost_of(program, arch="sm_90a").time["compute_s"] < 0.6 * cost_of(program, arch="sm_90").time["compute_s"]


# ---- the compiled kernel --------------------------------------------------------------------


def test_matmul_compiles_for_sm_90a_with_hgmma_in_the_hot_loop_and_no_spills():
    pytest.importorskip("cuda.bindings")
    from napkin_dsl.backends import sass

    compiled = napkin.load(MATMUL)["matmul"].compile("sm_90a", hardware="H100", m=8192, n=8192, k=8192)
    (resources,) = compiled.resources.values()
    assert resources["spill_bytes"] == 0
    assert "wgmma.mma_async" in compiled.source and "ldmatrix" not in compiled.source.split("napkin_matmul_0(")[1]
    assert compiled.launches[0].path == "wgmma"
    try:
        listing = sass.disassemble(compiled.image)
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm")
    (instructions,) = listing.values()
    opcodes = collections.Counter(i.opcode.split(".")[0] for i in instructions)
    assert opcodes["LDL"] == opcodes["STL"] == 0  # no local memory
    # the chunk loop: the smallest loop holding HGMMA (with TMA, ptxas wraps each UTMALDG in a
    # one-trip ELECT loop inside it; tests/test_tma.py counts those)
    ranges = [(s, e) for s, e in sass.loop_ranges(instructions)
              if any(s <= i.address <= e and i.opcode.startswith("HGMMA") for i in instructions)]
    start, end = min(ranges, key=lambda r: r[1] - r[0])
    body = [i for i in instructions if start <= i.address <= end]
    hot = collections.Counter(i.opcode for i in body)
    # nvdisasm: HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16].tnspB, R24 (B by descriptor, transposed: MN-major)
    hgmma = [i for i in body if i.base == "HGMMA"]
    assert len(hgmma) >= 2 and all(i.opcode == "HGMMA.64x128x16.F32.BF16" and "gdesc[" in i.operands
                                   and "tnspB" in i.operands and "tnspA" not in i.operands for i in hgmma), hot
    assert not any(op.startswith(("LDSM", "HMMA")) for op in hot)  # A and B go by descriptor
    # no shared loads but ptxas's zero-register LDS RZ, [RZ] of a proxy fence
    assert all(i.operands.replace(" ", "") == "RZ,[RZ]" for i in body if i.opcode.startswith("LDS"))


# ---- the emulation: PoCL runs the sm_90a kernel's OpenCL printing ---------------------------


def _bf16(rng, shape):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return rng.standard_normal(shape).astype(np.float32).astype(ml_dtypes.bfloat16)


def _run_opencl(sizes):
    from napkin_dsl.backends import opencl

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    program = _program(**sizes)
    rng = np.random.default_rng(sum(sizes.values()))
    a, b = _bf16(rng, (sizes["m"], sizes["k"])), _bf16(rng, (sizes["k"], sizes["n"]))
    source, _ = opencl.generate(program, arch="sm_90a")
    assert "nk_wgmma(" in source and "NK_LDSM" not in source.split("__kernel")[1]
    out = opencl.run(program, {"A": a, "B": b}, arch="sm_90a")["C"]
    return out, a.astype(np.float64) @ b.astype(np.float64)


@pytest.mark.parametrize("sizes", [dict(m=200, n=136, k=72), dict(m=64, n=16, k=16), dict(m=130, n=264, k=40)], ids=str)
def test_the_emulated_sm_90a_kernel_computes_a_times_b_at_ragged_sizes(sizes):
    out, reference = _run_opencl(sizes)
    assert np.abs(out - reference).max() <= 1e-4 * max(1.0, np.abs(reference).max())


def test_the_emulation_sees_a_swapped_stride_field(monkeypatch):
    """The emulator decodes the fields as the ISA lays them out: an encoder that swaps the leading and
    stride byte offsets (or gets either wrong) computes something else than A @ B."""

    original = layouts.CanonicalTile.strides
    monkeypatch.setattr(layouts.CanonicalTile, "strides", lambda self, k_major: original(self, k_major)[::-1])
    out, reference = _run_opencl(dict(m=128, n=128, k=64))
    assert not np.allclose(out, reference, atol=1e-2)
