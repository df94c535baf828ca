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


# Tolerance of the generated GPU kernels (OpenCL on PoCL) against the float64 reference,
# relative to the largest value (at least 1), by output dtype.
OPENCL_TOLERANCE = {"f32": 4e-4, "f16": 4e-2, "bf16": 8e-2}


def assert_matches_reference(diagram, outputs: dict, expected: dict, context="") -> None:
    """Every output of a generated kernel within its dtype's tolerance of the reference."""
    import numpy as np

    for name in diagram.outputs:
        got = outputs[name].astype(np.float64)
        want = expected[name].astype(np.float64)
        if not want.size:
            continue
        error = float(np.max(np.abs(got - want))) / max(1.0, float(np.max(np.abs(want))))
        assert error < OPENCL_TOLERANCE[diagram.arrays[name].dtype], f"{context}: {name} off by {error:.3g}"


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
