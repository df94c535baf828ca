"""What Python shows of napkin's objects (issue 26): ``print`` of a report is its table, reprs stay
one short line, and Jupyter gets HTML for kernels and compiled kernels.

Each repr test bounds the length and names what the line must hold, so that the dataclass dumps
the objects printed before (a Program of attention: 36,131 characters; a compiled kernel's: its
whole CUDA source) fail here.
"""

from __future__ import annotations

import contextlib
import html
import io

import pytest

import napkin_dsl as napkin
from napkin_dsl import progress as progress_module
from napkin_dsl.backends.compiled import CompiledKernel, KernelSource
from napkin_dsl.backends.numpy import block_loops, default_sizes, random_arguments
from napkin_dsl.cost import cost_of, launch_blocks
from napkin_dsl.errors import NapkinError
from napkin_dsl.isel import select_program
from napkin_dsl.pseudocode import Loop, walk

from .conftest import EXAMPLES, NAPKIN_EXAMPLES, example_id

ATTENTION_SIZES = dict(b=4, h=32, q=8192, x=8192, d=128)


@pytest.fixture(scope="module")
def attention():
    return napkin.load(EXAMPLES / "attention.napkin")["attention"]


# ---- reports: str is the table, repr one line --------------------------------------------------


def test_print_of_a_cost_report_is_its_table(attention):
    report = attention.cost(**ATTENTION_SIZES)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print(report)
    assert out.getvalue() == report.table() + "\n"
    assert str(report) == report.table() and f"{report}" == report.table()
    text = repr(report)
    assert "\n" not in text and len(text) < 200, text
    assert text.startswith("<CostReport attention on H100 with b=4 h=32 q=8192 x=8192 d=128: predicted ")
    assert f"({report.time['bound']}-bound)" in text and "levels l2, smem" in text
    assert "LevelCost(" not in text and "H_bytes" not in text


def test_a_symbolic_report_shows_its_flops_cut_short(attention):
    report = attention.cost()
    assert report.time.get("overlapped_s") is None
    text = repr(report)
    assert "\n" not in text and len(text) < 200 and text.endswith("FLOPs; levels l2, smem>"), text
    assert report.summary(width=20).endswith("... FLOPs") and len(report.summary(width=20)) == len("... FLOPs") + 17
    assert str(report) == report.table()


def test_print_of_a_tune_result_is_the_table_napkin_tune_prints(attention):
    result = attention.tune("H100", top=2, b=1, h=8, q=1024, x=1024, d=64)
    assert str(result) == result.table() and "predicted" in str(result)
    assert repr(result).splitlines()[0].startswith("<TuneResult attention on H100: ")  # the REPL's short form stays
    assert "Configuration(" not in repr(result.best) and "CostReport(" not in repr(result.best)


# ---- short reprs along the pipeline -------------------------------------------------------------


@pytest.mark.parametrize("path", NAPKIN_EXAMPLES, ids=example_id)
def test_the_pipeline_objects_have_one_line_reprs(path):
    for kernel in napkin.load(path).values():
        sizes = default_sizes(kernel)
        program = kernel.program(**sizes)
        schedule, diagram = program.schedule, program.diagram
        n = len(program.launches)
        for obj, limit in ((program, 400), (schedule, 600), (diagram, 300)):
            text = repr(obj)
            assert "\n" not in text and len(text) < limit, (type(obj).__name__, len(text), text[:300])
            assert kernel.name in text
        assert repr(program).startswith(f"<Program {kernel.name} on {program.hardware.name} with ")
        assert f"{n} launch{'es' if n != 1 else ''} " in repr(program) and "steps" in repr(program)
        assert f"{len(diagram.statements)} statement" in repr(diagram) and diagram.signature() in repr(diagram)
        # The parts, as a user meets them in lists and dicts: one short line each.
        parts = [*program.launches, *schedule.launches, *schedule.partitions, *diagram.statements,
                 *diagram.axes.values(), *diagram.arrays.values()]
        parts += [node for launch in program.launches for node in launch.body]
        parts += [step for launch in program.launches for step, _ in walk(launch.body)]
        for part in parts:
            text = repr(part)
            assert "\n" not in text and len(text) < 300, (type(part).__name__, text[:300])
            assert "Span(" not in text and "source_line" not in text


def test_a_program_of_attention_at_full_size_is_one_line_not_36_thousand_characters(attention):
    program = attention.program(**ATTENTION_SIZES)
    text = repr(program)
    assert len(text) < 250, len(text)
    assert text == ("<Program attention on H100 with b=4 h=32 q=8192 x=8192 d=128: 1 launch [S P O], "
                    f"levels gmem > l2 > smem; {text.split('; ', 1)[1]}")
    steps = [step for step, _ in walk(program.launches[0].body)]
    moves = sum(step.op in ("load", "save") for step in steps)
    assert text.endswith(f"; {len(steps)} steps, {moves} loads and saves>")
    assert "smem: group b 1, group h 1, group q 128, stream x 64" in repr(program.schedule)
    loop = program.launches[0].body[0]
    assert isinstance(loop, Loop) and repr(loop).startswith(f"<Loop {loop.kind} {loop.axis} at {loop.level}: tile ")
    statement = program.diagram.statements[1]
    assert repr(statement) == "<Statement 1: P[b h q x] f32 = softmax[x](S[b h q x])>"


def test_short_reprs_keep_dataclass_equality():
    """The reprs are custom or leave spans out; equality still compares every field it compared."""
    first = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    again = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    assert first.diagram == again.diagram and hash(first.diagram.axes["q"]) == hash(again.diagram.axes["q"])
    assert first.program(**ATTENTION_SIZES) == again.program(**ATTENTION_SIZES)
    assert first.program(**ATTENTION_SIZES) != again.program(**{**ATTENTION_SIZES, "q": 4096})
    moved = napkin.load("\n" + (EXAMPLES / "attention.napkin").read_text())["attention"]
    assert moved.diagram.axes["q"] != first.diagram.axes["q"]  # a span still counts where it counted


# ---- compiled kernels -----------------------------------------------------------------------------


def _compiled(source: str) -> CompiledKernel:
    """A compiled kernel as the cache builds one, without NVRTC: the matmul Program and its report."""
    kernel = napkin.load(EXAMPLES / "matmul.napkin")["matmul"]
    program = kernel.gpu_program("H100", m=256, n=256, k=128)
    launch = KernelSource("napkin_matmul_0", source, 4, 128, 32768, [("A", "bf16", "in"), ("B", "bf16", "in"),
                          ("C", "f32", "out")], [], "mma.sync", ["C: mma.sync"])
    return CompiledKernel("matmul", "sm_90", source, b"\x7fELF" + bytes(4000), [launch],
                          {"napkin_matmul_0": {"registers": 168, "shared_bytes": 0, "spill_bytes": 0}},
                          lambda: (program, cost_of(program), select_program(program)))


SOURCE = "// <b>not bold</b> & not an entity\n" + "__global__ void napkin_matmul_0() {}\n" * 300


def test_a_compiled_kernel_repr_leaves_the_source_out():
    compiled = _compiled(SOURCE)
    text = repr(compiled)
    assert "\n" not in text and len(text) < 250 and "__global__" not in text, text
    assert text == ("<CompiledKernel matmul for sm_90 (cubin, 4,004 bytes): 1 launch: napkin_matmul_0 grid 4 block 128, "
                    f"168 registers, 32,768 B shared, mma.sync; source {len(SOURCE):,} characters>")
    launch = repr(compiled.launches[0])
    assert "__global__" not in launch and launch.startswith("<KernelSource napkin_matmul_0: grid 4, block 128, 32,768 B")
    assert compiled == _compiled(SOURCE) and compiled != _compiled(SOURCE + "\n")  # equality unchanged


def test_a_compiled_kernel_in_jupyter_shows_resources_the_prediction_and_the_folded_source():
    compiled = _compiled(SOURCE)
    page = compiled._repr_html_()
    assert "<td>sm_90</td>" not in page and "compiled for sm_90 (cubin, 4,004 bytes)" in page
    row = "<tr><td>napkin_matmul_0</td><td>4</td><td>128</td><td>168</td><td>32,768 B</td><td>0 B</td><td>mma.sync</td></tr>"
    assert row in page
    assert f"the model: {compiled.cost.summary()}" in page and "predicted" in page
    folded = page[page.index("<details>"):]
    assert folded.startswith("<details><summary>CUDA source (301 lines)</summary><pre>") and folded.endswith("</pre></details>")
    assert html.escape(SOURCE) in folded and "<b>not bold</b>" not in page and "&amp; not an entity" in page


def test_a_compiled_kernel_whose_plan_fails_still_has_a_view():
    compiled = _compiled(SOURCE)

    def broken():
        raise NapkinError("no <plan> here")

    compiled.planned = broken
    page = compiled._repr_html_()
    assert "the model could not cost it: NapkinError" in page and "&lt;plan&gt;" in page and "<pre>" in page


def test_a_kernel_compiled_with_nvrtc_has_the_short_repr_and_the_html():
    from napkin_dsl.backends.nvrtc import nvrtc_version

    try:
        nvrtc_version()
    except NapkinError:
        pytest.skip("NVRTC is not available")
    compiled = napkin.load(EXAMPLES / "matmul.napkin")["matmul"].compile("sm_90", m=128, n=128, k=64)
    assert len(repr(compiled)) < 250 and compiled.source not in repr(compiled)
    registers = compiled.launch_table()[0]["registers"]
    assert f"{registers} registers" in repr(compiled) and f"<td>{registers}</td>" in compiled._repr_html_()


# ---- kernels in Jupyter ---------------------------------------------------------------------------


def test_a_kernel_in_jupyter_shows_signature_relabelling_cost_and_the_drawing(attention):
    page = attention._repr_html_()
    assert f"<code>{html.escape(attention.signature())}</code>" in page and "-&gt; O: bf16[b h q d]" in page
    assert f"<p>relabelled {attention.relabel_text()}</p>" in page
    assert attention.cost()._repr_html_() in page  # the cost table, symbolic: sizes are bound at the call
    # Jupyter shows the HTML rather than the SVG when both exist: the drawing is in it.
    assert attention.render() in page and attention._repr_svg_() == attention.render()


def test_a_kernel_without_a_cost_still_has_a_view(monkeypatch):
    kernel = napkin.load(EXAMPLES / "matmul.napkin")["matmul"]

    def refuse(*args, **kwargs):
        raise NapkinError("smem overflows: <tile> & more")

    monkeypatch.setattr(type(kernel), "cost", refuse)
    page = kernel._repr_html_()
    assert "<p>no cost: smem overflows: &lt;tile&gt; &amp; more</p>" in page and "<svg" in page


# ---- progress of a NumPy call from Python ----------------------------------------------------------


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _attention_inputs(attention):
    sizes = dict(b=1, h=2, q=512, x=256, d=32)
    arrays, _ = random_arguments(attention.diagram, sizes, 0)
    return sizes, (arrays["Q"], arrays["K"], arrays["V"])


def test_a_numpy_call_from_python_draws_its_blocks_on_a_terminal(attention, monkeypatch):
    pytest.importorskip("tqdm", reason="tqdm draws the progress line")
    monkeypatch.delenv("NAPKIN_PROGRESS", raising=False)
    monkeypatch.setattr(progress_module, "DELAY_S", 0.0)  # the CLI's delay, shortened for the test
    sizes, qkv = _attention_inputs(attention)
    total = block_loops(attention.program(**sizes))[1]
    err = Terminal()
    with contextlib.redirect_stderr(err):
        attention(*qkv)
    assert "run attention on numpy:" in err.getvalue() and f"{total}/{total}" in err.getvalue()


def test_a_numpy_call_draws_nothing_into_captured_or_piped_stderr(attention, monkeypatch, capsys):
    monkeypatch.delenv("NAPKIN_PROGRESS", raising=False)
    monkeypatch.setattr(progress_module, "DELAY_S", 0.0)
    _, qkv = _attention_inputs(attention)
    attention(*qkv)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("NAPKIN_PROGRESS", "0")
    err = Terminal()
    with contextlib.redirect_stderr(err):
        attention(*qkv)
    assert err.getvalue() == ""


@pytest.mark.parametrize("name", ["attention", "causal_attention", "attention_unfused", "mlp", "swiglu"])
def test_progress_counts_the_blocks_the_model_counts(name):
    (kernel,) = napkin.load(EXAMPLES / f"{name}.napkin").values()
    program = kernel.program("H100", **default_sizes(kernel))
    loops, total = block_loops(program)
    assert total == sum(int(launch_blocks(program, launch)) for launch in program.launches) > 1
    heard = []
    from napkin_dsl.backends.numpy import execute

    arrays, scalars = random_arguments(kernel.diagram, {a: default_sizes(kernel)[a] for a in kernel.diagram.axes}, 0)
    execute(program, arrays, scalars, progress=lambda done, of: heard.append((done, of)))
    assert heard and heard[-1] == (total, total) and all(of == total for _, of in heard)
    assert [done for done, _ in heard] == sorted({done for done, _ in heard})


def test_napkin_run_draws_the_numpy_backends_blocks_on_a_terminal(monkeypatch, tmp_path):
    """`napkin run` hands its progress line to the backend, so it is a bar of blocks, not only a clock."""
    pytest.importorskip("tqdm", reason="tqdm draws the progress line")
    from napkin_dsl.cli import main

    monkeypatch.delenv("NAPKIN_PROGRESS", raising=False)
    monkeypatch.setattr(progress_module, "DELAY_S", 0.0)
    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    sizes = dict(b=1, h=2, q=512, x=256, d=32)
    total = block_loops(kernel.program(**sizes))[1]
    err = Terminal()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["run", str(EXAMPLES / "attention.napkin"), "--set", *(f"{a}={n}" for a, n in sizes.items())])
    assert code == 0
    assert f"{total}/{total}" in err.getvalue()
