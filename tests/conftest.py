"""Shared test fixtures: the examples, and golden files with --update-golden."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
GOLDEN = Path(__file__).resolve().parent / "golden"
NAPKIN_EXAMPLES = sorted(EXAMPLES.rglob("*.napkin"))


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite golden files from the current output")


@pytest.fixture
def golden(request):
    """golden(name, text): compare text with tests/golden/NAME, or rewrite it with --update-golden."""
    update = request.config.getoption("--update-golden")

    def compare(name: str, text: str):
        path = GOLDEN / name
        if update or not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(text)
            tmp.replace(path)
            if not update:
                pytest.fail(f"golden file {name} did not exist; wrote it. Review it and rerun.")
            return
        expected = path.read_text()
        assert text == expected, f"output differs from golden file {name}; rerun with --update-golden after reviewing the diff"

    return compare


def example_id(path: Path) -> str:
    return str(path.relative_to(EXAMPLES))
