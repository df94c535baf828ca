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
