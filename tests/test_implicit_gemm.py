"""Convolutions on tensor cores as implicit GEMM (issue 46, item 3).

A contraction over several axes (a convolution's channels c and its window's i and j) runs on
mma.sync with k along one of them (the streamed c) and the others as **taps**: each operand's
tile holds one swizzled sub-tile per tap, gathered element by element, a window read's from its
parameter at the window's indices with the pad value outside it, and the product runs over k
once per tap. Each kernel runs on PoCL, whose emulation of ldmatrix and mma.sync is the
independent check (tests/test_tensorcore.py holds it to NumPy), against the float64 reference.
"""

from __future__ import annotations

import math

import pytest

import napkin_dsl as napkin
from napkin_dsl import isel
from napkin_dsl.backends.numpy import execute, random_arguments
from napkin_dsl.backends.tensorcore import TensorPrinter
from napkin_dsl.cost import cost_of, gather_issue, GATHER_ELEMENT, GATHER_WINDOW_ELEMENT

from .conftest import has_nvdisasm
from .test_opencl import run_on_pocl

CONV2D = """kernel conv(X: bf16[b c h w], W: bf16[o c i j]) -> Y: f32[b o p q]:
    Y[b o p q] = pad(X[b c (p + i - 1) (q + j - 1)], 0) * W[o c i j]

relabel conv on H100:
    smem: group b 1, o {o}, p 1, q {q}; stream c {c}
"""

# Each case: a kernel whose only launch is an implicit GEMM, and ragged sizes.
CASES = {
    "3x3 'same', NCHW": (CONV2D.format(o=32, q=16, c=16), dict(b=2, c=40, h=5, w=21, o=48, i=3, j=3)),
    "3x2, stride 2, dilation 2 along w": ("""kernel conv(X: bf16[b c h w], W: bf16[o c i j]) -> Y: f32[b o p q]:
    Y[b o p q] = pad(X[b c (2*p + i - 1) (2*q + 2*j - 2)], 0) * W[o c i j]

relabel conv on H100:
    smem: group b 1, o 16, p 1, q 16; stream c 32
""", dict(b=1, c=40, h=9, w=40, o=24, i=3, j=2)),
    "3x3 'same', NHWC and weights [o i j c]": ("""kernel conv(X: bf16[b h w c], W: bf16[o i j c]) -> Y: f32[b p q o]:
    Y[b p q o] = pad(X[b (p + i - 1) (q + j - 1) c], 0) * W[o i j c]

relabel conv on H100:
    smem: group b 1, o 32, p 1, q 32; stream c 16
""", dict(b=2, c=24, h=4, w=37, o=40, i=3, j=3)),
    "1D, f16, unpadded": ("""kernel conv(X: f16[b c h], W: f16[o c i]) -> Y: f32[b o p]:
    Y[b o p] = X[b c (p + i)] * W[o c i]

relabel conv on H100:
    smem: group b 1, o 16, p 64; stream c 16
""", dict(b=2, c=33, h=100, o=20, i=5)),
    "grouped, 2 groups": ("""kernel conv(X: bf16[b e h w], W: bf16[g o c i j]) -> Y: f32[b g o p q]:
    Y[b g o p q] = pad(X[b (len(c)*g + c) (p + i - 1) (q + j - 1)], 0) * W[g o c i j]

relabel conv on H100:
    smem: group b 1, g 1, o 16, p 1, q 16; stream c 16
""", dict(b=1, e=64, g=2, c=32, h=3, w=20, o=16, i=3, j=3)),
}


def _kernel(text: str) -> napkin.Kernel:
    (kernel,) = napkin.load(text).values()
    return kernel


def _bound(kernel, sizes) -> dict:
    """``sizes`` with the lengths the window gives the output's axes (p, q)."""
    program = kernel.gpu_program(None, **sizes)
    return {a: program.schedule.sizes[a] for a in kernel.diagram.axes}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_convolution_runs_on_tensor_cores_on_pocl(case, opencl_device):
    text, sizes = CASES[case]
    kernel = _kernel(text)
    program, _ = run_on_pocl(text, case, ["mma.sync"], arch="sm_80", **_bound(kernel, sizes))
    plan = isel.selection(program, program.launches[0], "sm_80").plan
    ((target, mma),) = plan.mmas.items()
    window = {"i", "j"} & set(kernel.diagram.axes)  # the 1D case's window is i alone
    assert mma.k == "c" and set(mma.taps) == window
    assert all(op.indexed and op.taps == mma.taps for op in plan.operands.values())
    # channels last, a unit of 8 channels is 16 contiguous bytes: cp.async; else element by element
    channels_last = kernel.diagram.arrays["W"].axes[-1] == "c"
    assert all(op.gathered != channels_last for op in plan.operands.values())


def test_channels_last_copies_units_by_cp_async_with_zeros_outside_the_window():
    """X[b h w c] and W[o i j c]: each sub-tile's row is copied 16 bytes at a time, its address
    through the window, zero-filled where the window leaves X; no element is stored by hand."""
    text, sizes = CASES["3x3 'same', NHWC and weights [o i j c]"]
    kernel = _kernel(text)
    from napkin_dsl.backends import cuda, opencl

    program = kernel.gpu_program(None, **_bound(kernel, sizes))
    for generate in (cuda.generate, opencl.generate):  # the source each prints, no compile
        source, _ = generate(program, arch="sm_80")
        assert "NK_CP16(nk_gs + ((i_i) * 3 + i_j) * " in source and "nk_gather_pad" not in source


def test_the_plan_holds_one_sub_tile_a_tap():
    kernel = _kernel(CONV2D.format(o=64, q=32, c=32))
    program = kernel.program("H100", b=32, c=64, h=56, w=56, o=64, i=3, j=3)
    selection = isel.select_program(program, "sm_80")[0]
    plan = selection.plan
    assert plan.mmas["Y"].taps == ("i", "j") and plan.mmas["Y"].contracted == ("c", "i", "j")
    x, w = plan.operands["X_win"], plan.operands["W"]
    assert (x.rows, x.cols, w.rows, w.cols) == ("c", "q", "o", "c")
    # 9 swizzled sub-tiles a stage: 32 x 32 of X's view and 64 x 32 of W, 2 bytes a value
    assert selection.slots["X_win"].stage_bytes == 9 * 32 * 32 * 2
    assert selection.slots["W"].stage_bytes == 9 * 64 * 32 * 2


def test_wgmma_declines_a_gathered_tile_by_name():
    kernel = _kernel(CONV2D.format(o=64, q=32, c=32))
    program = kernel.program("H100", b=4, c=64, h=20, w=64, o=64, i=3, j=3)
    selection = isel.select_program(program, "sm_90a")[0]
    assert selection.path == "mma.sync"
    assert selection.declined_path == "wgmma" and "an implicit GEMM's operand" in selection.declined


def test_an_fp8_convolution_stays_on_the_fma_path_by_name():
    kernel = _kernel(CONV2D.format(o=64, q=32, c=32).replace("bf16", "fp8e4m3"))
    program = kernel.program("H100", b=4, c=64, h=20, w=64, o=64, i=3, j=3)
    selection = isel.select_program(program, "sm_90")[0]
    assert selection.path == "fma"
    assert "built for 16-bit operands (bf16, f16), not fp8e4m3" in selection.reason


def test_the_register_level_counts_every_taps_fragments():
    """The NumPy backend's register-level count (ldmatrix's reads: B once a warp row, A once a
    warp column, each over k and the taps) equals the model's, and both equal the hand count."""
    kernel = _kernel(CONV2D.format(o=64, q=32, c=32))
    sizes = dict(b=2, c=64, h=4, w=64, o=64, i=3, j=3)
    program = kernel.program("H100", **sizes)
    selected = isel.select_program(program, "sm_80")
    plan = selected[0].plan
    bound = {a: program.schedule.sizes[a] for a in kernel.diagram.axes}
    arrays, scalars = random_arguments(kernel.diagram, bound, 0)
    _, counts = execute(program, arrays, scalars, selected=selected)
    report = cost_of(program, arch="sm_80", selected=selected, check=False)
    blocks = 2 * 4 * (64 // 32)  # b, p, q groups (o is one group of 64)
    chunk = 32 * 9 * 64 * plan.row_warps + 32 * 32 * 9 * plan.col_warps  # W's (c i j) x o, X's q x (c i j)
    want = blocks * 2 * chunk  # two chunks of c
    assert int(report.levels["registers"].H) == want
    assert counts.H["registers"] == want


def test_the_model_prices_the_gathers_issue():
    """Each gathered element costs the issue slots the model charges: the view's tiles and W's,
    over every chunk of every block, and the launch's compute is at least their time."""
    kernel = _kernel(CONV2D.format(o=64, q=32, c=32))
    sizes = dict(b=32, c=64, h=56, w=56, o=64, i=3, j=3)
    program = kernel.program("H100", **sizes)
    selected = isel.select_program(program, "sm_80")
    blocks = 32 * 56 * 2  # b, p, and q in 2 groups of 32 (the last one 24 wide, gathered whole)
    x = blocks * 2 * (32 * 9 * 32)  # 2 chunks of the view's 32 c x 3 i x 32 q x 3 j
    w = blocks * 2 * (64 * 32 * 9)
    assert gather_issue(program, program.launches[0], selected) == x * GATHER_WINDOW_ELEMENT + w * GATHER_ELEMENT
    report = cost_of(program, arch="sm_80", selected=selected, check=False)
    hardware = program.hardware
    issue_s = (x * GATHER_WINDOW_ELEMENT + w * GATHER_ELEMENT) / (128 * hardware.level("smem").units * hardware.clock_hz)
    assert report.time["compute_s"] >= issue_s * (1 - 1e-9)


def test_a_tap_read_from_another_taps_sub_tile_is_caught(opencl_device, monkeypatch):
    """A planted bug: ldmatrix reads every tap from the first tap's sub-tile. PoCL's result leaves
    the reference."""
    original = TensorPrinter.ldsm_offset

    def first_tap(self, name, operand, trans, outer, k, tap=None):
        return original(self, name, operand, trans, outer, k, None)

    monkeypatch.setattr(TensorPrinter, "ldsm_offset", first_tap)
    text, sizes = CASES["3x3 'same', NCHW"]
    with pytest.raises(AssertionError):
        run_on_pocl(text, "planted", ["mma.sync"], arch="sm_80", **_bound(_kernel(text), sizes))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_resnet_layer_compiles_without_spills(arch):
    """The bf16 3 x 3, 64 to 64 channels, 56 x 56, batch 32 convolution (ResNet-50's conv2_x) on
    mma.sync with its window loads gathered into swizzled tiles: NVRTC compiles it without spills;
    where nvdisasm is at hand, the SASS holds HMMA and LDSM and no local memory."""
    pytest.importorskip("cuda.bindings")
    kernel = _kernel(CONV2D.format(o=64, q=32, c=32))
    compiled = kernel.compile(arch=arch, b=32, c=64, h=56, w=56, o=64, i=3, j=3)
    (row,) = compiled.launch_table()
    assert row["path"] == "mma.sync" and row["spill_bytes"] == 0, row
    source = compiled.source
    assert "for (int tp = 0; tp < 9; ++tp) {  // the taps: i j" in source
    assert "g_X[" in source and "g_X_win" not in source
    if not has_nvdisasm():
        return
    from napkin_dsl.backends.sass import sass_report

    (launch,) = sass_report(compiled)["launches"]
    assert launch["whole"].get("tensor", 0) == 144 and launch["whole"].get("ldsm", 0) > 0
    assert launch["whole"].get("local", 0) == 0
    assert math.isfinite(launch["ceiling"]["tflops"])


def test_oclgrind_finds_no_race_in_the_gathers(tmp_path):
    """The gathers store into a stage's buffer with plain stores while other warps read the other
    stage: oclgrind finds no data race and no invalid access, and the result matches."""
    from .test_tensorcore import oclgrind

    source = tmp_path / "conv.napkin"
    source.write_text(CONV2D.format(o=32, q=16, c=16))
    result = oclgrind(str(source), ["b=1", "c=40", "h=2", "w=20", "o=32", "i=3", "j=3", "p=2", "q=20"], "--arch", "sm_80")
    assert result.returncode == 0, result.stderr[-2000:]
    report = result.stdout + result.stderr
    assert "data race" not in report and "Invalid" not in report, report[-2000:]
    errors = [float(line.split()[-1]) for line in result.stdout.splitlines() if " error " in line]
    assert errors and max(errors) < 0.02, result.stdout


def test_a_unit_copied_into_the_first_taps_sub_tile_is_caught(opencl_device, monkeypatch):
    """A planted bug in the channels-last copy: every tap's unit lands in the first tap's
    sub-tile. PoCL's result leaves the reference."""
    emit = TensorPrinter.emit

    def first_sub_tile(self, line=""):
        emit(self, line.replace("NK_CP16(nk_gs + (", "NK_CP16(nk_gs + 0 * ("))

    monkeypatch.setattr(TensorPrinter, "emit", first_sub_tile)
    text, sizes = CASES["3x3 'same', NHWC and weights [o i j c]"]
    with pytest.raises(AssertionError):
        run_on_pocl(text, "planted", ["mma.sync"], arch="sm_80", **_bound(_kernel(text), sizes))
