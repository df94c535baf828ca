"""Every Python example in examples/ runs as a script on a CPU-only machine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import EXAMPLES, ROOT

SCRIPTS = sorted(EXAMPLES.glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_example_script_runs(script):
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip()
    assert "Traceback" not in result.stderr


def test_tensor_cores_example_reports_the_paths_it_printed():
    result = subprocess.run([sys.executable, str(EXAMPLES / "tensor_cores.py")], capture_output=True, text=True,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count(": mma.sync,") == 2  # attention and matmul both on tensor cores
    assert "4 warps of 32 q rows @registers" in result.stdout  # FA2's warp tile at d = 128 on sm_90 (isel's rolled budget)
    assert "4 warps of 64 m x 64 n @registers" in result.stdout
