"""The documentation site builds with zero warnings, and every example has a generated page
that shows its pseudocode as napkin prints it now."""

from __future__ import annotations

import html
import importlib.util
import re
import subprocess
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
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
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
