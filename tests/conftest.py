"""Shared test fixtures: the examples, and golden files with --update-golden."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

# PoCL builds the suite's kernels without LLVM's optimizations (napkin_dsl.backends.opencl.
# build_options): the emulated tensor-core kernels took minutes each to optimize and run in about
# the same time either way at the suite's sizes. tests/test_opencl.py runs one optimized build,
# and tests/test_tensorcore.py's oclgrind runs build optimized (oclgrind interprets the IR).
# Set here, before any test imports napkin, so that xdist workers and subprocesses inherit it.
os.environ.setdefault("NAPKIN_OPENCL_OPTIMIZE", "0")

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


def assert_matches_reference(program, outputs: dict, expected: dict, context="") -> None:
    """Every output of a generated kernel within the Program's tolerance of the reference:
    max |error| / max |reference| per output against ``napkin_dsl.backends.numpy.tolerance``,
    read off the Program (the dtypes it rounds to, its reduction lengths), as ``napkin run``
    checks the NumPy backend. ``program`` is the Program that was run (``kernel.gpu_program``)."""
    import numpy as np

    from napkin_dsl.backends.numpy import reference_error, tolerance

    limit = tolerance(program)
    for name in program.diagram.outputs:
        got = outputs[name].astype(np.float64)
        want = expected[name].astype(np.float64)
        if not want.size:
            continue
        # equal infinities match (the -inf lse of a fully masked row), as napkin run judges them
        error, scale = reference_error(got, want)
        error /= scale if scale > 0 else 1.0
        assert error <= limit, f"{context}: {name} off by {error:.3g} (tolerance {limit:.3g}, read off the Program)"


@pytest.fixture(scope="session")
def opencl_device():
    """The OpenCL context, or a skip; in CI (NAPKIN_REQUIRE_OPENCL set) a missing device fails."""
    import os

    from napkin_dsl.backends import opencl

    if not opencl.opencl_available():
        if os.environ.get("NAPKIN_REQUIRE_OPENCL"):
            pytest.fail("no OpenCL device, and NAPKIN_REQUIRE_OPENCL is set (CI installs pocl-opencl-icd)")
        pytest.skip("no OpenCL device (pip install pyopencl; apt-get install pocl-opencl-icd)")
    return opencl.context()


def has_nvdisasm() -> bool:
    """Whether nvdisasm (the nvidia-cuda-nvdisasm wheel, or a CUDA toolkit's) can disassemble cubins."""
    from napkin_dsl.backends.sass import NoDisassembler, find_nvdisasm

    try:
        find_nvdisasm()
    except NoDisassembler:
        return False
    return True


needs_nvdisasm = pytest.mark.skipif(not has_nvdisasm(), reason="nvdisasm not installed (pip install 'napkin-dsl[sass]')")


def compiled_listing(kernel, arch: str = "sm_90a", hardware: str = "H100", **sizes):
    """A one-launch kernel compiled for ``arch`` on ``hardware`` (``sizes`` may carry compile's
    own options, ``overlap=``), checked to spill nothing, and its SASS instructions:
    (compiled, instructions), or a skip without NVRTC or nvdisasm."""
    pytest.importorskip("cuda.bindings")
    from napkin_dsl.backends import sass

    compiled = kernel.compile(arch, hardware=hardware, **sizes)
    (resources,) = compiled.resources.values()
    assert resources["spill_bytes"] == 0
    try:
        (instructions,) = sass.disassemble(compiled.image).values()
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm")
    return compiled, instructions


@pytest.fixture(scope="session")
def site_build(tmp_path_factory):
    """The documentation site, built once a run by ``mkdocs build --strict``: (site directory,
    the build's exit status, its log). tests/test_docs.py and tests/test_site_browser.py both read
    it (a build is a minute on 2 cores). Under pytest-xdist the workers share the run's base
    temporary directory: the first to take the lock builds, the others read what it left."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out, status, log = root / "site", root / "site.status", root / "site.log"
    with open(root / "site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not status.exists():
            result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                                    cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
            log.write_text(result.stdout + "\n" + result.stderr)
            status.write_text(str(result.returncode))
    return out, int(status.read_text()), log.read_text()


def assert_clean_under_oclgrind(code: str, max_error: float):
    """Run ``code`` (Python that prints ``@@ error <value>``) under ``oclgrind --data-races
    --uninitialized``, unoptimized (oclgrind's uninitialized-value plugin does not take LLVM's
    ``freeze``), and check that it ran, that its error is under ``max_error`` and that oclgrind
    reported nothing. Skipped without oclgrind, unless NAPKIN_REQUIRE_OPENCL is set."""
    import os
    import shutil
    import subprocess
    import sys

    if shutil.which("oclgrind") is None:
        if os.environ.get("NAPKIN_REQUIRE_OPENCL"):
            pytest.fail("no oclgrind, and NAPKIN_REQUIRE_OPENCL is set (CI installs it)")
        pytest.skip("no oclgrind (apt-get install oclgrind)")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root), PYOPENCL_NO_CACHE="1", NAPKIN_OPENCL_OPTIMIZE="0")
    done = subprocess.run(["oclgrind", "--data-races", "--uninitialized", sys.executable, "-c", code],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-2000:]
    errors = [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("@@ error")]
    assert errors and errors[0] < max_error, report[-2000:]
    assert "data race" not in report and "Uninitialized" not in report and "Invalid" not in report, report[-2000:]
