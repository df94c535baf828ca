"""Every example checks, and `napkin check` output matches its golden file."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys

import pytest

import napkin_dsl as napkin
from napkin_dsl.cli import main

from .conftest import EXAMPLES, NAPKIN_EXAMPLES, ROOT, example_id


@pytest.mark.parametrize("path", NAPKIN_EXAMPLES, ids=example_id)
def test_example_checks(path):
    kernels = napkin.load(path)
    assert kernels, f"{path} defines no kernel"
    for k in kernels.values():
        assert k.diagram.statements


@pytest.mark.parametrize("path", NAPKIN_EXAMPLES, ids=example_id)
def test_check_output_golden(path, golden, capsys):
    os.chdir(ROOT)
    relative = str(path.relative_to(ROOT))
    assert main(["check", relative]) == 0
    golden(f"check/{example_id(path).replace('/', '__')}.txt", capsys.readouterr().out)


@pytest.mark.parametrize("path", NAPKIN_EXAMPLES, ids=example_id)
def test_check_json_golden(path, golden, capsys):
    os.chdir(ROOT)
    assert main(["check", "--json", str(path.relative_to(ROOT))]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert set(data) == {"kernels"}
    golden(f"check/{example_id(path).replace('/', '__')}.json", out)


def test_python_example_runs():
    namespace = runpy.run_path(str(EXAMPLES / "attention.py"), run_name="not_main")
    attention = namespace["attention"]
    assert isinstance(attention, napkin.Kernel)
    assert attention.hardware == "H100"
    assert [s.target for s in attention.diagram.statements] == ["S", "P", "O"]


def test_python_example_as_script():
    result = subprocess.run([sys.executable, str(EXAMPLES / "attention.py")], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "napkin kernel attention" in result.stdout
