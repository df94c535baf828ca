"""The built documentation site, seen in a real browser (Debian's chromium through selenium).

Every page at a desktop and a phone width: the page body never scrolls sideways, every image
loads, every internal link resolves (scripts/site_check.py says how). With ``--update-golden``
the two screenshots committed under docs/img/ (home.png, attention.png) are taken again.
Skipped, with the reason, where chromium, chromedriver or selenium is missing.

Also here, without a browser: the generated sections committed between their markers in
docs/*.md are current, and generated Markdown keeps its headings out of a page's contents.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

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
def built_site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


@pytest.mark.skipif(site_check.browser_missing() is not None, reason=str(site_check.browser_missing()))
def test_every_page_in_a_real_browser(built_site, request, tmp_path):
    update = request.config.getoption("--update-golden")
    shots = tmp_path / "screenshots"
    report = site_check.check_site(built_site, shots)
    assert len(report.pages) >= 20 and report.images > 0 and report.links > 0
    assert not report.problems, "\n".join(report.problems)
    assert {p.name for p in shots.iterdir()} == set(site_check.SCREENSHOTS)
    committed = ROOT / "docs" / "img"
    if update:
        for shot in shots.iterdir():
            shutil.copyfile(shot, committed / shot.name)
    missing = [name for name in site_check.SCREENSHOTS if not (committed / name).exists()]
    assert not missing, f"docs/img/ lacks {', '.join(missing)}: run pytest tests/test_site_browser.py --update-golden"


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
    assert hook._linked_image("d", "x.svg") == '[![d](x.svg)](x.svg){ .napkin-diagram title="open at full size" }'


def test_docstrings_keep_napkin_brackets_as_text(hook):
    """softmax[x](M) in a docstring is napkin, not a Markdown link; code and indented blocks stay as written."""
    run = hook._DocstringMarkup(None).run
    assert run(["P = softmax[x](M) is prose", "see [the docs](x.md)"]) == ["P = softmax\\[x](M) is prose", "see [the docs](x.md)"]
    assert run(["in code `softmax[x](where(COND,", "S, -inf))` here", "after s[i](j)"]) == [
        "in code `softmax[x](where(COND,", "S, -inf))` here", "after s\\[i](j)"]
    assert run(["", "    P[b h q x] = softmax[x](S)"]) == ["", "    P[b h q x] = softmax[x](S)"]
