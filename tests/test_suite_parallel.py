"""The suite's own contract (issue 41): the README's test command runs every test on every core,
CI runs that command, and a pytest-xdist worker that dies fails the run instead of losing tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from .conftest import ROOT


def _readme_test_command() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("Run the tests:", 1)[1].split("```", 2)[1].strip()


def test_the_readme_and_ci_run_every_test_on_every_core():
    readme = _readme_test_command()
    assert readme.endswith("NAPKIN_REQUIRE_OPENCL=1 pytest -n auto"), readme
    ci = (ROOT / ".ci" / "run").read_text()
    runs = [line for line in ci.splitlines() if re.match(r"\s*NAPKIN_REQUIRE_OPENCL=1 pytest\b", line)]
    assert runs == ["NAPKIN_REQUIRE_OPENCL=1 pytest -q -n auto"], runs
    # nothing deselected: no -k, -m, --deselect or --ignore in either command or in pytest's addopts
    for command in (readme, runs[0]):
        assert not re.search(r"\s(-k|-m|--deselect|--ignore)\b", command), command
    pyproject = (ROOT / "pyproject.toml").read_text()
    addopts = re.findall(r"^addopts\s*=.*$", pyproject, flags=re.MULTILINE)
    assert all(not re.search(r"(-k|-m|--deselect|--ignore)\b", line) for line in addopts), addopts


def test_a_worker_that_dies_fails_the_run(tmp_path):
    """A test that kills its worker process (a segfault in a driver, an abort in PoCL) is reported
    as a failure under ``-n``, and the tests after it still run on a new worker."""
    (tmp_path / "test_dies.py").write_text(
        "import os\n\n\ndef test_dies():\n    os._exit(3)\n\n\ndef test_runs():\n    pass\n")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this run's worker
    finished = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "test_dies.py"],
                              cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120, check=False)
    output = finished.stdout + finished.stderr
    assert finished.returncode == 1, output
    assert "crashed" in output and "1 failed, 1 passed" in output, output
