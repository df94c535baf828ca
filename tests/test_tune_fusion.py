"""The tuner decides fusion (issue 14): which intermediates go to device memory, each launch's tiles
and stream, never worse than the relabelling written in the file.

SwiGLU is the issue's case: fused into one launch it needs whole rows of G and U on chip, which
do not fit A100's shared memory at f = 2816; materialising intermediates splits it into launches
that fit.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.cost import cost_of
from napkin_dsl.errors import NapkinError, RelabelError
from napkin_dsl.hardware import hardware_names, load_hardware
from napkin_dsl.plan import materialise, materialised, plan, split_points
from napkin_dsl.reference import evaluate
from napkin_dsl.tune import tune

from .conftest import EXAMPLES, NAPKIN_EXAMPLES, assert_matches_reference, example_id

# The issue's SwiGLU is examples/swiglu.napkin written fused: its kernel, without the @gmem on H
# or the relabel block (the tuner's answer, which the example shows).
SWIGLU = (EXAMPLES / "swiglu.napkin").read_text().split("\nrelabel ")[0].replace(" @gmem", "")
SWIGLU = SWIGLU[SWIGLU.index("kernel "):]
ISSUE_SIZES = dict(t=512, m=1024, f=2816, e=1024)
# Small enough for PoCL on a CPU, with the same obstacle: f = 2816 keeps the fused launch from fitting.
SMALL_SIZES = dict(t=16, m=512, f=2816, e=64)
GPUS = [name for name in hardware_names() if not load_hardware(name).symbolic]


def swiglu():
    (kernel,) = napkin.load(SWIGLU).values()
    return kernel


def with_gmem(source: str, targets) -> str:
    """The source with ``@gmem`` written on the statements assigning ``targets``."""
    for target in targets:
        source = re.sub(rf"(?m)^(\s*{target}\[[^\]]*\])", r"\1 @gmem", source)
    return source


@pytest.mark.parametrize("chosen", [{"H"}, {"G", "H"}, {"G", "U", "H"}, set()])
def test_materialise_is_what_the_checker_gives_for_gmem_written_in_the_source(chosen):
    kernel = swiglu()
    profile = load_hardware("A100")
    variant = materialise(kernel.diagram, profile, chosen)
    (written,) = napkin.load(with_gmem(SWIGLU, chosen)).values()
    assert variant.arrays.keys() == written.diagram.arrays.keys()
    for name, array in written.diagram.arrays.items():
        assert (variant.arrays[name].dtype, variant.arrays[name].level) == (array.dtype, array.level), name
    for mine, theirs in zip(variant.statements, written.diagram.statements, strict=False):
        assert (mine.target, mine.level, mine.dtype, mine.inputs) == (theirs.target, theirs.level, theirs.dtype, theirs.inputs)
    assert materialised(variant, profile) == frozenset(chosen)
    assert kernel.diagram.statements[2].level is None  # the input diagram is unchanged


def test_split_points_leave_the_last_statement_and_other_levels_alone():
    kernel = swiglu()
    assert split_points(kernel.diagram, load_hardware("A100")) == ("G", "U", "H")
    with pytest.raises(NapkinError, match="cannot materialise Y"):
        materialise(kernel.diagram, load_hardware("A100"), {"Y"})


def test_swiglu_fused_does_not_fit_a100_but_the_tuner_finds_launches_that_do():
    kernel = swiglu()
    with pytest.raises(RelabelError, match="no configuration"):
        tune(kernel.diagram, "A100", None, ISSUE_SIZES, fusion=False)
    result = tune(kernel.diagram, "A100", None, ISSUE_SIZES)
    best = result.best
    assert best.materialised, "the fused launch does not fit: some intermediate must go to device memory"
    # The configuration plans and fits exactly as reported (cost_of checks every capacity), and
    # its time is the model's for that configuration.
    report = cost_of(plan(best.diagram, "A100", result.block(best.diagram, load_hardware("A100")), ISSUE_SIZES))
    assert report.time["overlapped_s"] == pytest.approx(best.time_s)
    assert result.fusion_choices == 2 ** 3


def test_swiglu_compiles_for_sm_80_with_the_tuned_launches():
    compiled = swiglu().compile("sm_80", **ISSUE_SIZES)
    assert compiled.image[:4] == b"\x7fELF"
    assert len(compiled.program.launches) >= 2
    for row in compiled.launch_table():
        assert row["spill_bytes"] == 0, row


def test_swiglu_runs_on_pocl_against_the_reference(opencl_device):
    from napkin_dsl.backends import opencl

    from .test_opencl import random_inputs

    kernel = swiglu()
    with pytest.raises(RelabelError):
        tune(kernel.diagram, "A100", None, SMALL_SIZES, fusion=False)
    program = kernel.gpu_program("A100", **SMALL_SIZES)
    assert len(program.launches) >= 2
    inputs, scalars = random_inputs(kernel.diagram, SMALL_SIZES)
    outputs = opencl.run(program, inputs, scalars)
    expected = evaluate(kernel.diagram, inputs, scalars, SMALL_SIZES)
    assert_matches_reference(program, outputs, expected, "swiglu")
    assert np.isfinite(outputs["Y"].astype(np.float64)).all()


def test_a_scoped_relabelling_is_never_made_worse():
    """The issue's second case: a two-launch MLP with a scoped relabelling."""
    source = """\
kernel mlp2(X: bf16[b k], W1: bf16[k n], W2: bf16[n e]) -> Y: bf16[b e]:
    A[b n] @gmem = X[b k] * W1[k n]
    H[b n] @gmem = gelu(A)
    Y[b e] = H[b n] * W2[n e]

relabel mlp2 on A100:
    smem for A: group b 64, n 64; stream k 32
    smem for H: group b 64, n 64
    smem for Y: group b 64, e 64; stream n 32
"""
    (kernel,) = napkin.load(source).values()
    sizes = dict(b=4096, k=4096, n=4096, e=4096)
    written = kernel.cost(**sizes).time["overlapped_s"]
    result = kernel.tune(**sizes)
    assert result.best.time_s <= written
    assert any(c.origin == "as written" for c in result.configurations) or result.best.time_s < written


def _default_sizes(diagram) -> dict:
    return {axis: 256 for axis in diagram.axes}


def _written_time(kernel, profile, sizes):
    """The predicted time of the relabelling written in the file on ``profile`` (its block
    retargeted when it names another GPU), or None when it does not fit or names other levels."""
    block = kernel.relabel
    if block is not None and (load_hardware(block.hardware).symbolic
                              or any(c.level not in profile.level_names() for c in block.levels)):
        block = None
    if block is not None:
        import dataclasses

        block = dataclasses.replace(block, hardware=profile.name)
    try:
        return cost_of(plan(kernel.diagram, profile, block, sizes)).time["overlapped_s"], block
    except NapkinError:
        return None, block


def _opaque(kernel) -> bool:
    return any(s.box.kind == "opaque" for s in kernel.diagram.statements)


# An opaque box has no compute rate on a GPU profile, so a file of opaque kernels has no time to
# compare: those files are the refusal's test below, not parametrizations that always skip.
OPAQUE_EXAMPLES = [path for path in NAPKIN_EXAMPLES if all(_opaque(k) for k in napkin.load(path).values())]


@pytest.mark.parametrize("hardware", GPUS)
@pytest.mark.parametrize("path", [p for p in NAPKIN_EXAMPLES if p not in OPAQUE_EXAMPLES], ids=example_id)
def test_tune_is_never_worse_than_the_relabelling_written_in_the_file(path, hardware):
    profile = load_hardware(hardware)
    kernels = [k for k in napkin.load(path).values() if not _opaque(k)]
    for kernel in kernels:
        sizes = _default_sizes(kernel.diagram)
        written, block = _written_time(kernel, profile, sizes)
        try:
            result = tune(kernel.diagram, profile, block, sizes)
        except RelabelError:
            assert written is None, f"{kernel.name}: the tuner found nothing, but the file's relabelling fits"
            continue
        best = result.best  # its time is the model's for the configuration it names
        chosen = best.diagram or kernel.diagram
        assert cost_of(plan(chosen, profile, result.block(chosen, profile), sizes)).time["overlapped_s"] == pytest.approx(best.time_s)
        if written is not None:
            assert result.best.time_s <= written * (1 + 1e-12), (kernel.name, result.best.time_s, written)


def test_an_opaque_kernel_is_refused_on_every_gpu_not_tuned_on_a_made_up_rate():
    """The paper's opaque boxes cost ``flops_F`` per copy, a symbol no GPU profile has a rate for:
    tuning one there is an error naming the missing rate, on every GPU."""
    assert [p.name for p in OPAQUE_EXAMPLES] == ["fig11.napkin", "fig12.napkin"]
    for path in OPAQUE_EXAMPLES:
        for kernel in napkin.load(path).values():
            for hardware in GPUS:
                with pytest.raises(NapkinError) as refused:
                    tune(kernel.diagram, load_hardware(hardware), None, _default_sizes(kernel.diagram))
                assert refused.value.message == f"{hardware} has no opaque rate for f32"


# ---- L2 as a cache (issue 14, item 2) ---------------------------------------------------------


def _profile_with_l2(tmp_path, capacity: int) -> str:
    """The bundled A100 profile with another L2 capacity, as a .toml file."""
    from napkin_dsl.hardware import PROFILE_DIR

    text = (PROFILE_DIR / "A100.toml").read_text(encoding="utf-8")
    text, count = re.subn(r"(?m)^(capacity = )41_943_040", rf"\g<1>{capacity}", text)
    assert count == 1
    text = text.replace('name = "A100"', 'name = "A100_small_l2"', 1)
    path = tmp_path / "A100_small_l2.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def _mlp():
    (kernel,) = napkin.load(NAPKIN_EXAMPLES[0].parent / "mlp.napkin").values()
    return kernel


MLP_SIZES = dict(b=4096, k=4096, n=4096)


def test_l2_m_over_its_capacity_is_reported_with_a_warning_naming_level_and_bytes():
    report = _mlp().cost("A100", **MLP_SIZES)
    l2 = report.levels["l2"]
    assert l2.M_bytes > l2.capacity  # whole tiles of one L2 group, as the issue found
    warnings = [n for n in report.notes if n.startswith("warning: l2 M")]
    assert len(warnings) == 1 and f"{int(l2.M_bytes):,} B" in warnings[0] and f"{int(l2.capacity):,} B" in warnings[0]
    assert "warning: l2" in report.table()


def test_no_report_shows_a_level_over_capacity_without_a_warning():
    for hardware in GPUS:
        for path in NAPKIN_EXAMPLES:
            for kernel in napkin.load(path).values():
                if kernel.relabel is None or load_hardware(kernel.relabel.hardware).symbolic:
                    continue
                for size in (256, 8192):
                    try:
                        report = kernel.cost(hardware, **{a: size for a in kernel.diagram.axes})
                    except NapkinError:
                        continue  # refused: an error is the other accepted answer
                    for name, level in report.levels.items():
                        if level.capacity is not None and level.M_bytes is not None and level.M_bytes > level.capacity:
                            assert any(n.startswith(f"warning: {name}") for n in report.notes), (path, hardware, size, name)


def test_an_l2_too_small_for_any_shared_working_set_charges_every_blocks_loads_from_hbm(tmp_path):
    kernel = _mlp()
    roomy = kernel.cost("A100", **MLP_SIZES)
    tiny = cost_of(plan(kernel.diagram, _profile_with_l2(tmp_path, 1024), kernel.relabel, MLP_SIZES))
    assert any("cannot hold what co-resident blocks share" in n and "1,024 B" in n for n in tiny.notes)
    # No reuse across blocks: HBM -> L2 moves what every block loads, as SMEM's loads from L2 do.
    assert tiny.levels["l2"].H_bytes > roomy.levels["l2"].H_bytes
    assert tiny.levels["l2"].H_bytes == tiny.levels["smem"].H_bytes
    assert tiny.time["overlapped_s"] >= roomy.time["overlapped_s"]


# ---- Python API (issue 14, item 3) ------------------------------------------------------------


def test_tune_result_repr_is_a_short_table_of_the_best_candidates():
    result = _mlp().tune("H100", top=3, **MLP_SIZES)
    text = repr(result)
    lines = text.splitlines()
    assert len(lines) == 2 + len(result.configurations) <= 5
    assert lines[1].split()[:3] == ["#", "time", "bound"] and "tiles" in lines[1]
    assert result.best.relabel_line() in lines[2] and result.best.bound in lines[2]
    assert "CostReport" not in text and "Knob(" not in text
    html = result._repr_html_()
    assert html.count("<tr>") == 1 + len(result.configurations) and "<th>bound</th>" in html


def test_relabel_text_round_trips_through_relabelled_and_cost():
    """Attention, whose best keeps the source's fusion (relabel text cannot say @gmem; a result
    whose best changes the fusion round-trips as a TuneResult, below)."""
    (kernel,) = napkin.load(NAPKIN_EXAMPLES[0].parent / "attention.napkin").values()
    sizes = dict(b=4, h=32, q=8192, x=8192, d=128)
    result = kernel.tune("H100", **sizes)
    assert not result.best.materialised
    assert result.relabel_text.startswith("relabel attention on H100:\n")
    by_text = kernel.relabelled(result.relabel_text)
    by_result = kernel.relabelled(result)
    assert by_text.cost(**sizes).time["overlapped_s"] == pytest.approx(result.best.time_s)
    assert by_result.cost(**sizes).time["overlapped_s"] == pytest.approx(result.best.time_s)
    assert kernel.cost(relabel=result, **sizes).time["overlapped_s"] == pytest.approx(result.best.time_s)
    # The original kernel is not changed.
    assert kernel.relabel_text() == napkin.load(NAPKIN_EXAMPLES[0].parent / "attention.napkin")["attention"].relabel_text()


def test_a_result_that_changes_the_fusion_round_trips_as_a_tune_result():
    kernel = _mlp()
    result = kernel.tune("H100", **MLP_SIZES)
    by_result = kernel.relabelled(result)
    assert by_result.cost(**MLP_SIZES).time["overlapped_s"] == pytest.approx(result.best.time_s)
    assert kernel.cost(relabel=result, **MLP_SIZES).time["overlapped_s"] == pytest.approx(result.best.time_s)
    assert kernel.relabel_text() == _mlp().relabel_text()  # the original kernel is not changed
    assert "group b 128, n 128; stream k 32" in kernel.source


def test_relabelled_by_clause_lines_and_bad_relabel_input():
    kernel = _mlp()
    lines = kernel.relabelled("smem: group b 64, n 128 | smem: stream k 64")
    assert lines.relabel_text() == "on H100: smem: group b 64, n 128 | smem: stream k 64"
    assert "stream k 64" in lines.source and "stream k 32" not in lines.source
    assert kernel.cost(relabel="smem: group b 64, n 128; stream k 64", **MLP_SIZES).time == lines.cost(**MLP_SIZES).time
    with pytest.raises(NapkinError, match="TuneResult or relabel text"):
        kernel.relabelled(42)
    with pytest.raises(NapkinError, match="names kernel 'other'"):
        kernel.relabelled("relabel other on H100:\n    smem: group b 64\n")
    with pytest.raises(RelabelError):
        kernel.relabelled("smem: group k 64")  # k is contracted: not a legal group
    (bare,) = napkin.load(SWIGLU).values()
    with pytest.raises(NapkinError, match="needs the hardware"):
        bare.relabelled("smem: group t 64")


def test_a_tuned_fusion_is_written_into_the_source_and_reloads_to_the_same_cost():
    kernel = swiglu()
    result = kernel.tune("A100", **ISSUE_SIZES)
    assert result.fusion_changed
    tuned = kernel.relabelled(result)
    for name in result.best.materialised:
        assert re.search(rf"(?m)^\s*{name}\[[^\]]*\] @gmem =", tuned.source)
    (reloaded,) = napkin.load(tuned.source).values()
    assert reloaded.cost(**ISSUE_SIZES).time["overlapped_s"] == pytest.approx(result.best.time_s)
    assert "@gmem" not in kernel.source  # the original is unchanged


# ---- CLI (issue 14, item 4) -------------------------------------------------------------------


def _cli(argv, capsys):
    from napkin_dsl.cli import main

    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _issue_sets():
    return ["--set", *[f"{a}={v}" for a, v in ISSUE_SIZES.items()]]


def test_cli_tune_write_makes_a_tuned_copy_and_refuses_to_overwrite_the_source(tmp_path, capsys):
    source = tmp_path / "swiglu.napkin"
    source.write_text(SWIGLU, encoding="utf-8")
    out_file = tmp_path / "swiglu_tuned.napkin"
    code, out, _ = _cli(["tune", source, "--hardware", "A100", *_issue_sets(), "--write", out_file], capsys)
    assert code == 0 and f"wrote {out_file}" in out
    assert source.read_text(encoding="utf-8") == SWIGLU  # a copy: the source is unchanged
    (tuned,) = napkin.load(out_file).values()
    best = swiglu().tune("A100", **ISSUE_SIZES).best
    assert tuned.cost(**ISSUE_SIZES).time["overlapped_s"] == pytest.approx(best.time_s)
    code, _, err = _cli(["tune", source, "--hardware", "A100", *_issue_sets(), "--write", source], capsys)
    assert code == 2 and "would overwrite the source" in err
    assert source.read_text(encoding="utf-8") == SWIGLU


def test_cli_tune_plot_draws_one_panel_per_partition_searched(tmp_path, capsys):
    import xml.etree.ElementTree as ET

    svg = tmp_path / "tune.svg"
    code, out, _ = _cli(["tune", NAPKIN_EXAMPLES[0].parent / "mlp.napkin", "--hardware", "H100",
                         "--set", "b=4096", "k=4096", "n=4096", "--plot", svg], capsys)
    assert code == 0 and f"wrote {svg}" in out
    root = ET.fromstring(svg.read_text(encoding="utf-8"))
    ns = "{http://www.w3.org/2000/svg}"
    result = _mlp().tune("H100", **MLP_SIZES)
    assert len(root.findall(f"{ns}polyline")) == len(result.curves) >= 3
    marked = sum("(chosen)" in (t.text or "") for t in root.iter(f"{ns}title"))
    off_grid = sum("off the grid searched" in (t.text or "") for t in root.iter(f"{ns}text"))
    assert marked + off_grid == len(result.best.values) and marked >= 1


def test_cli_tune_json_prints_only_json(capsys):
    import json

    code, out, err = _cli(["tune", NAPKIN_EXAMPLES[0].parent / "mlp.napkin", "--hardware", "H100",
                           "--set", "b=4096", "k=4096", "n=4096", "--json"], capsys)
    assert code == 0 and err == ""
    data = json.loads(out)["kernels"]["mlp"]
    assert data["fusion_choices"] == 2 and data["relabel_text"].startswith("relabel mlp on H100")
    assert {"time_s", "bound", "origin", "materialised"} <= set(data["configurations"][0])


def test_cli_compare_shows_files_and_relabellings_side_by_side(tmp_path, capsys):
    import json

    tuned = tmp_path / "tuned.napkin"
    source = tmp_path / "swiglu.napkin"
    source.write_text(SWIGLU, encoding="utf-8")
    assert _cli(["tune", source, "--hardware", "A100", *_issue_sets(), "--write", tuned], capsys)[0] == 0
    code, out, _ = _cli(["compare", source, tuned, "--hardware", "A100", *_issue_sets()], capsys)
    assert code == 0
    lines = out.splitlines()
    assert f"{source}:swiglu" in lines[0] and f"{tuned}:swiglu" in lines[0]
    assert {line.split()[0] for line in lines[1:] if line.strip()} >= {"relabel", "time", "bound", "smem", "l2", "errors:"}
    # The fused source does not fit: its column holds the error, the tuned one the numbers.
    assert "over its capacity" in out
    mlp = NAPKIN_EXAMPLES[0].parent / "mlp.napkin"
    code, out, _ = _cli(["compare", mlp, "--relabel", "smem: group b 64, n 64; stream k 64", "--hardware", "A100",
                         "--set", "b=4096", "k=4096", "n=4096", "--json"], capsys)
    columns = json.loads(out)["columns"]
    assert [c["label"] for c in columns] == [str(mlp), f"{mlp} relabel 1"]
    assert columns[0]["time_s"] == pytest.approx(_mlp().cost("A100", **MLP_SIZES).time["overlapped_s"])
    assert columns[1]["levels"]["smem"]["M_bytes"] < columns[0]["levels"]["smem"]["M_bytes"]


def test_code_generation_keeps_the_gmem_the_source_writes_while_tune_may_fuse_it():
    (kernel,) = napkin.load(NAPKIN_EXAMPLES[0].parent / "attention_unfused.napkin").values()
    sizes = dict(q=512, x=512, d=64)
    written = materialised(kernel.diagram, load_hardware("H100"))
    assert written == {"S", "P"}
    kept = tune(kernel.diagram, "H100", None, sizes, keep_written=True)
    assert all(written <= (c.materialised if c.materialised is not None else kept.written) for c in kept.configurations)
    assert len(kernel.gpu_program("H100", **sizes).launches) == 3
    free = tune(kernel.diagram, "H100", None, sizes)
    assert free.fusion_choices == 4 > kept.fusion_choices == 1
    assert free.best.time_s <= kept.best.time_s


def test_cost_report_html_lists_every_level_and_the_l2_warning():
    report = _mlp().cost("A100", **MLP_SIZES)
    page = report._repr_html_()
    assert page.count("<tr>") == 1 + len(report.levels)
    assert page.index("warning: l2 M") < page.index("the l2 groups are derived")  # warnings first
    assert "compute-bound" in page or "transfer-bound" in page or "-bound" in page


def test_cli_tune_write_refuses_a_python_source_with_the_block_to_paste(tmp_path, capsys):
    script = NAPKIN_EXAMPLES[0].parent / "attention.py"
    code, _, err = _cli(["tune", script, "--set", "b=1", "h=2", "q=256", "x=256", "d=64", "--write", tmp_path / "out.napkin"], capsys)
    assert code == 2 and "defined in Python" in err and "relabel attention on H100:" in err
    assert not (tmp_path / "out.napkin").exists()


def test_the_tuned_launches_run_on_numpy_with_the_counts_the_model_predicts():
    from .test_numpy_backend import assert_counts_equal_report, run_and_compare

    kernel = swiglu()
    result = kernel.tune("A100", **SMALL_SIZES)
    tuned = kernel.relabelled(result)
    assert len(tuned.program(**SMALL_SIZES).launches) >= 2
    counts, report = run_and_compare(tuned, SMALL_SIZES)
    assert_counts_equal_report(counts, report)
    assert report.time["overlapped_s"] == pytest.approx(result.best.time_s)


def test_a_long_chain_searches_the_written_fused_split_and_single_split_choices():
    from napkin_dsl.tune import MAX_SPLIT_POINTS

    n = MAX_SPLIT_POINTS + 2
    lines = ["    A1[i] = X * 2"] + [f"    A{k}[i] = A{k - 1} + 1" for k in range(2, n)] + [f"    Y[i] = A{n - 1} * 3"]
    (kernel,) = napkin.load("kernel chain(X: f32[i]) -> Y: f32[i]:\n" + "\n".join(lines) + "\n").values()
    assert len(split_points(kernel.diagram, load_hardware("H100"))) == n - 1 > MAX_SPLIT_POINTS
    result = kernel.tune("H100", i=4096)
    assert result.fusion_choices == 1 + 1 + (n - 1)  # fused (as written), fully split, each single split
    assert not result.best.materialised  # an elementwise chain is best fused: each split adds a round trip


def test_the_example_is_what_the_tuner_finds():
    """examples/swiglu.napkin says the tuner finds its split and tiles: its relabelling costs
    what the tuner's best of the fused kernel does (to 1%: the top candidates tie)."""
    (example,) = napkin.load(EXAMPLES / "swiglu.napkin").values()
    result = swiglu().tune("H100", **ISSUE_SIZES)
    assert result.best.materialised == frozenset({"H"})
    assert example.cost(**ISSUE_SIZES).time["overlapped_s"] <= 1.01 * result.best.time_s
