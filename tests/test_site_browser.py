"""The built documentation site, seen in a real browser (Debian's chromium through selenium).

Every page at a desktop and a phone width: the page body never scrolls sideways, every image
loads, every internal link resolves. At 1400 px: every diagram's text renders at least 10 px
high, no output block of the tutorial or example pages is cut while the window has unused width
to its right, and no copy button covers text (scripts/site_check.py says how). With
``--update-golden`` the two reference screenshots under tests/golden/site/ (home.png,
attention.png; kept out of docs/, which is published) are taken again. Skipped, with the
reason, where chromium, chromedriver or selenium is missing.

Also here, without a browser: the generated sections committed between their markers in
docs/*.md are current, and generated Markdown keeps its headings out of a page's contents.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from types import SimpleNamespace

import pytest

from .conftest import ROOT

pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")


def _load(name: str, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while classes are built
    spec.loader.exec_module(module)
    return module


site_check = _load("napkin_site_check", ROOT / "scripts" / "site_check.py")


@pytest.fixture(scope="module")
def hook():
    return _load("napkin_docs_hook_for_browser_tests", ROOT / "docs" / "hooks" / "napkin_docs.py")


@pytest.fixture(scope="module")
def built_site(site_build):
    out, status, log = site_build  # tests/conftest.py: one build a run
    assert status == 0, f"mkdocs build --strict failed:\n{log}"
    return out


@pytest.mark.skipif(site_check.browser_missing() is not None, reason=str(site_check.browser_missing()))
def test_every_page_in_a_real_browser(built_site, request, tmp_path):
    update = request.config.getoption("--update-golden")
    shots = tmp_path / "screenshots"
    report = site_check.check_site(built_site, shots)
    # Images are checked where there are any (diagrams are inline SVG, not images).
    assert len(report.pages) >= 20 and report.links > 0
    # Every example page draws its kernel three ways, the tutorial twice, the home page once:
    # the legibility check saw them all (a diagram it could not find would pass unmeasured).
    pages_with_diagrams = {page for page, _, _ in report.diagrams}
    assert {"", "tutorial/", "examples/attention/"} <= pages_with_diagrams and len(report.diagrams) >= 30
    assert all(low is not None for _, _, low in report.diagrams) and report.blocks > 100
    assert not report.problems, "\n".join(report.problems)
    assert {p.name for p in shots.iterdir()} == set(site_check.SCREENSHOTS)
    committed = ROOT / "tests" / "golden" / "site"
    if update:
        committed.mkdir(parents=True, exist_ok=True)
        for shot in shots.iterdir():
            shutil.copyfile(shot, committed / shot.name)
    missing = [name for name in site_check.SCREENSHOTS if not (committed / name).exists()]
    assert not missing, f"tests/golden/site/ lacks {', '.join(missing)}: run pytest tests/test_site_browser.py --update-golden"


def test_reference_screenshots_are_not_published(built_site):
    """They are the test's, not the reader's: no PNG of them in the built site."""
    published = {path.name for path in built_site.rglob("*.png")}
    assert not published & set(site_check.SCREENSHOTS), sorted(published)


def test_the_checker_finds_overflow_broken_images_and_dead_links(tmp_path):
    """The browser check itself, on a page made to fail each way."""
    if site_check.browser_missing() is not None:
        pytest.skip(site_check.browser_missing())
    (tmp_path / "index.html").write_text(
        '<!doctype html><html><body style="margin:0">'
        '<div style="width:3000px">too wide</div>'
        '<pre style="width:100%;overflow-x:auto"><code>' + "x" * 2000 + '</code></pre>'
        '<img src="missing.png" alt="gone">'
        '<a href="/nowhere/">dead</a> <a href="/#nothing-here">no anchor</a> <a href="/#here" id="here">fine</a>'
        '</body></html>')
    report = site_check.check_site(tmp_path)
    text = "\n".join(report.problems)
    assert "the page scrolls sideways" in text and "div" in text
    assert "missing.png did not load" in text
    assert "link /nowhere/: HTTP 404" in text
    assert "link /#nothing-here: no element with id 'nothing-here'" in text
    assert "#here" not in text.replace("#nothing-here", "")
    assert "pre" not in text  # a wide block that scrolls inside itself is not a problem


# A page made to fail each legibility check once, beside a case of each that passes. The window
# is 1400 px; the page lives at tutorial/, where blocks are checked for cuts. The second tab is
# hidden until the checker opens it (as Material's tabs do, with :checked).
_WIDE_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" width="1500" height="100" viewBox="0 0 1500 100" font-size="10">'
             '<text x="10" y="50">{label}</text></svg>')
_ILLEGIBLE_PAGE = """<!doctype html><html><head><style>
body {{ margin: 0; font: 16px monospace; }}
.md-content {{ margin-right: 20px; }}
pre {{ position: relative; margin: 1em 0; }}
pre > code {{ display: block; overflow: auto; white-space: pre; }}
.md-code__nav {{ position: absolute; top: 0; right: 0; width: 40px; height: 30px; }}
.tabbed-content > div {{ display: none; }}
.tabbed-set > input:nth-child(1):checked ~ .tabbed-content > :nth-child(1),
.tabbed-set > input:nth-child(2):checked ~ .tabbed-content > :nth-child(2) {{ display: block; }}
</style></head><body><div class="md-content">
<img src="../wide.svg" alt="scaled down" style="width: 300px">
<div style="overflow-x: auto" aria-label="natural size">{natural}</div>
<div class="tabbed-set"><input type="radio" name="t" checked><input type="radio" name="t">
<div class="tabbed-content"><div>first tab</div><div><div aria-label="in the second tab">{hidden}</div></div></div></div>
<pre style="width: 600px"><code>cut short {long}</code></pre>
<pre><code>wide and scrolling to the window's edge {long}</code></pre>
<pre><nav class="md-code__nav"></nav><code>under the button {long}</code></pre>
<pre style="padding-right: 50px"><nav class="md-code__nav"></nav><code>beside the button {long}</code></pre>
</div></body></html>"""


def test_the_checker_finds_illegible_diagrams_cut_blocks_and_covered_text(tmp_path):
    """The legibility check itself, at 1400 px, on a page made to fail each way."""
    if site_check.browser_missing() is not None:
        pytest.skip(site_check.browser_missing())
    (tmp_path / "wide.svg").write_text(_WIDE_SVG.format(label="scaled to 300 px"))
    (tmp_path / "tutorial").mkdir()
    (tmp_path / "tutorial" / "index.html").write_text(_ILLEGIBLE_PAGE.format(
        natural=_WIDE_SVG.format(label="at natural size"), hidden=_WIDE_SVG.format(label="squeezed into 200 px").replace("<svg ", '<svg style="width: 200px; height: auto" '),
        long="x" * 400))
    report = site_check.Report(pages=["tutorial/"])
    with site_check.serve(tmp_path) as base:
        site_check.check_legibility(tmp_path, report, base)
    heights = {name: low for _, name, low in report.diagrams}
    assert set(heights) == {"scaled down", "natural size", "in the second tab"}, heights
    # 10 px type at 300/1500 and 200/1500 of its size; at its own size it is legible.
    assert heights["scaled down"] < 5 and heights["in the second tab"] < 5 and heights["natural size"] >= 10
    text = "\n".join(report.problems)
    assert "diagram scaled down: text" in text and "diagram in the second tab: text" in text
    assert "natural size" not in text
    assert "block 'cut short" in text and "px of the window to its right are unused" in text
    assert "block 'wide and scrolling" not in text  # cut, but at the window's edge: nothing left to grow into
    assert "the copy button covers text of block 'under the button" in text
    assert "beside the button" not in text
    assert len(report.problems) == 4, text


def test_committed_generated_sections_are_current(hook):
    stale = []
    makers = hook.section_makers()
    for page in sorted((ROOT / "docs").glob("*.md")):
        for match in hook._COMMENT.finditer(page.read_text()):
            if match["what"] not in hook.COMMITTED:
                continue
            committed = match["body"]
            if committed is None or hook._dedent_by(committed, match["indent"]).strip() != makers[match["what"]]().strip():
                stale.append(f"{page.name}: <!-- napkin:{match['what']} -->")
    assert not stale, f"out of date (run {hook.UPDATE_COMMAND}): {', '.join(stale)}"


def test_update_rewrites_only_between_the_markers(hook, tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Page\n\nBefore.\n\n<!-- napkin:dtypes -->\nold table\n<!-- /napkin:dtypes -->\n\nAfter.\n\n"
                    "<!-- napkin:tc-sass -->\n")
    assert hook.update_committed(tmp_path) == [page]
    text = page.read_text()
    assert text.startswith("# Page\n\nBefore.\n\n<!-- napkin:dtypes -->\n") and text.endswith("\n\nAfter.\n\n<!-- napkin:tc-sass -->\n")
    assert "old table" not in text and hook.dtypes_section().strip() in text
    assert hook.update_committed(tmp_path) == []  # current now: nothing to write


def test_generated_markdown_keeps_its_headings_out_of_the_contents(hook):
    assert hook._no_headings("## softcap on H100\n\n| a |\n|---|\n") == "**softcap on H100**\n\n| a |\n|---|\n"


def test_diagrams_are_inline_svg_with_a_link_to_their_file(hook):
    slot = hook._diagram_slot('a "quoted" <name>', "examples/x.costs.svg")
    assert "<svg" not in slot and "\n" not in slot  # one line of Markdown, so that it survives inside a tab
    content = f"<h2>Diagram</h2>\n<p>{slot}</p>\n<p>after</p>"
    hook._state["diagrams"] = {"examples/x.costs.svg": '<?xml version="1.0"?>\n<svg width="1500"><text>M</text></svg>'}
    try:
        html = hook.on_page_content(content, SimpleNamespace(url="examples/x/"), None, None)
    finally:
        hook._state.pop("diagrams")
    assert html.startswith("<h2>Diagram</h2>\n<div class=\"napkin-diagram\">") and html.endswith("</div>\n<p>after</p>")
    assert '<svg width="1500"><text>M</text></svg>' in html and "<?xml" not in html and "<p><div" not in html
    assert 'aria-label="a &quot;quoted&quot; &lt;name&gt;"' in html
    assert '<a class="napkin-diagram__file" href="../x.costs.svg">a &quot;quoted&quot; &lt;name&gt; (SVG file)</a>' in html
    # The link is from the page's URL (raw HTML is not rewritten by mkdocs), with and without directory URLs.
    assert hook._page_link("", "examples/x.svg") == "examples/x.svg"
    assert hook._page_link("tutorial/", "tutorial.softcap.svg") == "../tutorial.softcap.svg"
    assert hook._page_link("examples/x.html", "examples/x.costs.svg") == "x.costs.svg"


def test_docstrings_keep_napkin_brackets_as_text(hook):
    """softmax[x](M) in a docstring is napkin, not a Markdown link; code and indented blocks stay as written."""
    run = hook._DocstringMarkup(None).run
    assert run(["P = softmax[x](M) is prose", "see [the docs](x.md)"]) == ["P = softmax\\[x](M) is prose", "see [the docs](x.md)"]
    assert run(["in code `softmax[x](where(COND,", "S, -inf))` here", "after s[i](j)"]) == [
        "in code `softmax[x](where(COND,", "S, -inf))` here", "after s\\[i](j)"]
    assert run(["", "    P[b h q x] = softmax[x](S)"]) == ["", "    P[b h q x] = softmax[x](S)"]
