"""The documentation site builds with zero warnings, and every example has a generated page
that shows its pseudocode as napkin prints it now."""

from __future__ import annotations

import html
import importlib.util
import re
import sys

import pytest

from .conftest import ROOT

pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")


def _hook():
    """The mkdocs hook module, for the example -> page mapping and the sizes it uses."""
    path = ROOT / "docs" / "hooks" / "napkin_docs.py"
    spec = importlib.util.spec_from_file_location("napkin_docs_hook", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _text(page_html: str) -> str:
    """The visible text of a built page: tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", page_html))


@pytest.fixture(scope="module")
def site(site_build):
    out, status, log = site_build  # tests/conftest.py: one build a run
    assert status == 0, f"mkdocs build --strict failed:\n{log}"
    warnings = [line for line in log.splitlines() if line.startswith("WARNING")]
    assert not warnings, "\n".join(warnings)
    return out


def _built_page(site, page: str):
    """site/examples/attention/index.html for the docs page examples/attention.md."""
    return site / page[: -len(".md")] / "index.html"


def test_every_example_has_a_page_with_its_pseudocode(site):
    hook = _hook()
    examples = hook.examples()
    assert {e.source.suffix for e in examples} == {".napkin", ".py"}
    for example in examples:
        built = _built_page(site, example.page)
        assert built.exists(), f"no page for {example.rel} (expected {built})"
        text = _text(built.read_text())
        kernels = hook.kernels_of(example)
        assert kernels, f"{example.rel} defines no kernel"
        setup = hook.setup_for(example)
        for kernel in kernels.values():
            pseudocode = kernel.pseudocode("text", setup.hardware)
            for line in pseudocode.splitlines():
                assert line.strip() in text, f"{example.page}: pseudocode line missing: {line!r}"
            assert f"napkin check {example.cli_path}" in text or example.source.suffix == ".py"


def test_example_pages_show_cost_and_tuning_at_their_sizes(site):
    hook = _hook()
    for example in hook.examples():
        if example.source.suffix != ".napkin":
            continue
        text = _text(_built_page(site, example.page).read_text())
        setup = hook.setup_for(example)
        assert f"$ napkin cost {example.cli_path} --hardware {setup.hardware}{setup.set_args()}" in text
        assert f"$ napkin tune {example.cli_path} --hardware {setup.hardware}{setup.set_args()}" in text
        assert "Traceback" not in text, f"{example.page} shows a traceback"


def test_generated_reference_pages(site):
    from napkin_dsl.cli import build_parser
    from napkin_dsl.hardware import hardware_names

    cli = _text((site / "cli" / "index.html").read_text())
    commands = next(a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict)).choices
    for name in commands:
        assert f"usage: napkin {name}" in cli, f"CLI reference lacks napkin {name}"
    hardware = _text((site / "hardware" / "index.html").read_text())
    for name in hardware_names():
        assert f"napkin_dsl/hardware/{name}.toml" in hardware
    notation = _text((site / "notation" / "index.html").read_text())
    assert "syntax error: missing '=' in a statement" in notation
    assert "cannot group-partition x" in notation
    api = (site / "api" / "index.html").read_text()
    for module in ("napkin_dsl.kernel", "napkin_dsl.cost", "napkin_dsl.tune", "napkin_dsl.reference"):
        assert f'id="{module}"' in api, f"API reference lacks {module}"


def _table_rows(page_html: str) -> list[list[str]]:
    """Every row of every table of a built page, as the visible text of its cells."""
    rows = []
    for row in re.findall(r"<tr>(.*?)</tr>", page_html, re.S):
        rows.append([_text(cell).strip() for cell in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S)])
    return rows


def test_tensor_core_page_follows_method_in_the_nav(site):
    home = (site / "index.html").read_text()
    nav = home[home.index("md-nav--primary"):]
    links = [href for href in re.findall(r'<a href="([^"]+)" class="md-nav__link', nav) if not href.startswith("#")]
    assert links[links.index("method/") + 1] == "tensor-cores/", links
    assert (site / "tensor-cores" / "index.html").exists()


def test_tensor_core_page_shows_the_swizzle_and_wavefronts_of_napkin_dsl_layouts(site):
    from napkin_dsl.layouts import SwizzledTile

    hook = _hook()
    page = (site / "tensor-cores" / "index.html").read_text()
    text = _text(page)
    assert "Traceback" not in text
    rows = _table_rows(page)
    # The 64 x 128 bf16 tile: logical unit u of row r is stored at unit u XOR (r mod 8).
    tile = SwizzledTile(*hook.TC_EXAMPLE_TILE, 2)
    assert (tile.rows, tile.cols) == (64, 128)
    for r in range(8):
        physical = [tile.unit_offset(r, u) % tile.pitch // 16 for u in range(8)]
        assert physical == [u ^ r for u in range(8)]
        assert [str(r), str(tile.key(r))] + [str(p) for p in physical] in rows, f"swizzle row {r} missing"
    # Wavefronts: one per ldmatrix phase with the swizzle; without it, the 8 rows of a phase
    # (same column) fall into 128 / pitch bank groups below a 128-byte pitch and into one from
    # there on: min(8, pitch / 16) wavefronts. A warp's 32 cp.async units are 512 bytes: 4.
    for shape in hook.TC_TILES:
        tile = SwizzledTile(*shape, 2)
        want = [f"{shape[0]} x {shape[1]}", f"{tile.pitch} B", "1", str(min(8, tile.pitch // 16)), "4", "4"]
        assert want in rows, f"wavefront row {want} missing"
    # The generated listing, the cost report and SASS (or the note saying nvdisasm is missing).
    assert "NK_CP_WAIT(" in text and "ldmatrix.x4.trans from V" in text
    for example in hook.TC_EPILOGUE_EXAMPLES:
        assert any(row and row[0].startswith(f"{example} at ") for row in rows), f"no epilogue row for {example}"
    assert "$ napkin cost examples/attention.napkin --set b=4 h=32 q=8192 x=8192 d=128" in text
    assert "registers  thread" in text
    assert "SASS of matmul" in text or "nvdisasm was not installed" in text


def test_every_tutorial_step_runs_on_its_own(tmp_path):
    """A reader copies one step's Python, not the page: each python-run block of the tutorial runs
    in a fresh namespace, given only the files the page has written by then (a step that used
    the previous step's ``softcap`` raised NameError)."""
    hook = _hook()
    page = (ROOT / "docs" / "tutorial.md").read_text()
    ran = 0
    for match in hook._FENCE.finditer(page):
        body = match["body"]
        if match["kind"] == "napkin-source":
            (tmp_path / re.search(r"file=(\S+)", match["attrs"])[1]).write_text(body)
        elif match["kind"] == "python-run":
            outcome = hook.run_python(body, {"__name__": "tutorial_step"}, tmp_path)
            assert not outcome.bug, f"this tutorial step does not run on its own:\n{body}\n{outcome.text}"
            if "expect=" not in match["attrs"]:
                assert outcome.ok, f"{body}\n{outcome.text}"
            ran += 1
    assert ran >= 5


def test_tutorial_draw_commands_are_shown_as_written(site):
    """The page shows the command its source says (with -o: without it the SVG fills the terminal)."""
    hook = _hook()
    shown = _text(_built_page(site, "tutorial.md").read_text()).splitlines()
    draws = [m["body"].strip() for m in hook._FENCE.finditer((ROOT / "docs" / "tutorial.md").read_text())
             if m["kind"] == "napkin-draw"]
    assert len(draws) == 2
    for line in draws:
        assert re.search(r"\s-o \S+\.svg\b", line), line
        assert f"$ {line}" in shown, f"the tutorial page does not show {line!r} as written"


def test_api_attributes_have_docstrings_and_fields_their_types(site):
    """No attribute entry of the API page is a bare name: each has a docstring (its own, or the
    comment on its line, docs/hooks/griffe_attributes.py); a dataclass field without either is
    left to the class signature, with its type."""
    api = (site / "api" / "index.html").read_text()
    entries = re.findall(r'<div class="doc doc-object doc-attribute">\s*<h\d id="([^"]+)".*?'
                         r'<div class="doc doc-contents ">(.*?)</div>\s*</div>', api, re.S)
    assert entries
    bare = [name for name, contents in entries if not _text(contents).strip()]
    assert not bare, f"{len(bare)} of {len(entries)} attribute entries show only a name: {bare[:10]}"
    documented = dict(entries)
    # configurations: list  # best first
    assert "best first" in _text(documented["napkin_dsl.tune.TuneResult.configurations"])
    signature = _text(api[api.index('id="napkin_dsl.tune.TuneResult"'):][:4000])
    assert "kernel: str" in signature and "evaluated: int" in signature


def test_attribute_comments_are_read_as_docstrings():
    spec = importlib.util.spec_from_file_location("griffe_attributes", ROOT / "docs" / "hooks" / "griffe_attributes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines = ["X = 1  # the first part (and", "# the rest of it)", "# Next: about Y", "Y = {",
             "    1: 2,", "}  # a dict", 'Z = "# not a comment"', "W = 3  # w,", "       # aligned under it"]
    assert module.trailing_comment(lines, 1, 1) == "the first part (and the rest of it)"
    assert module.trailing_comment(lines, 4, 6) == "a dict"
    assert module.trailing_comment(lines, 7, 7) is None
    assert module.trailing_comment(lines, 8, 8) == "w, aligned under it"


# Two shapes of a two-stage cp.async loop, as tc_stream_skeleton prints them (four spaces a level).
_COMPUTE_THEN_WAIT = """for (int c_x = 0; c_x < 8; c_x += 1) {
    NK_CP_WAIT(0);
    NK_SYNC();
    if (c_x + 1 < 8) {
        NK_CP16(...);
    }
    NK_CP_COMMIT();
    NK_MMA_BF16(...);
}""".splitlines()
_WAIT_THEN_COMPUTE = """for (int c_x = 0; c_x < 8; c_x += 1) {
    if (c_x + 1 < 8) {
        NK_CP16(...);
    }
    NK_CP_COMMIT();
    NK_CP_WAIT(0);
    NK_SYNC();
    NK_MMA_BF16(...);
}""".splitlines()


def test_the_pipeline_summary_tells_an_overlapping_loop_from_one_that_waits_for_its_prefetch():
    """The tensor-cores page reads the pipeline off the printed loop: a chunk that computes before
    the next wait overlaps the copies it just issued; one that waits for everything first does not."""
    summary = _hook().tc_pipeline_summary
    assert "in flight while it computes" in summary(_COMPUTE_THEN_WAIT)
    assert "does not yet overlap copies with compute" in summary(_WAIT_THEN_COMPUTE)
