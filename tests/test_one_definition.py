"""One definition per fact (issue 42): the facts every stage reads are written in one module, and
every other module imports them. Each test greps the package's source for a second spelling, so a
module that writes the fact out again fails here, by file and line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import napkin_dsl
from napkin_dsl.dtypes import FP8_DTYPES
from napkin_dsl.hardware import DEFAULT_ARCH, DEFAULT_GPU, load_hardware
from napkin_dsl.layouts import wgmma_k

PACKAGE = Path(napkin_dsl.__file__).parent


def spelled(pattern: str, package: Path = PACKAGE) -> list[str]:
    """``file:line: text`` of every line of the package matching ``pattern``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(pattern, line):
                found.append(f"{path.relative_to(package).as_posix()}:{number}: {line.strip()}")
    return found


def files(lines: list[str]) -> set[str]:
    return {line.split(":")[0] for line in lines}


def test_the_grep_finds_a_second_spelling(tmp_path):
    """The patterns see a second definition planted in a package (so "once" can fail)."""
    (tmp_path / "a.py").write_text('FP8 = ["fp8e5m2", "fp8e4m3"]\ndef f(arch="sm_90"): pass\n')
    assert spelled(FP8_SET, tmp_path) == ['a.py:1: FP8 = ["fp8e5m2", "fp8e4m3"]']
    assert spelled(ARCH_DEFAULT, tmp_path) == ['a.py:2: def f(arch="sm_90"): pass']


def test_the_mma_shape_is_defined_once():
    """layouts.py defines the mma.sync shape; every other module imports it."""
    defined = spelled(r"^\s*(MMA_[MNK]\w*(\s*,\s*MMA_[MNK]\w*)*)\s*=")
    assert [line.split(": ", 1)[1] for line in defined] == [
        "MMA_M, MMA_N, MMA_K = 16, 8, 16  # the instruction's shape; isel reads the same numbers",
        "MMA_K8 = 32  # m16n8k32: k per instruction for 8-bit operands"], defined
    assert files(defined) == {"layouts.py"}


# The two 8-bit float types written as a collection, in either order.
FP8_SET = r"""[(\[{]\s*["']fp8e(4m3|5m2)["']\s*,\s*["']fp8e(4m3|5m2)["']\s*,?\s*[)\]}]"""


def test_the_fp8_dtypes_are_defined_once():
    """dtypes.FP8_DTYPES is the set; no module lists the two types again or asks by prefix."""
    assert files(spelled(FP8_SET)) == {"dtypes.py"}, spelled(FP8_SET)
    assert not spelled(r"""startswith\(\s*["']fp8"""), "ask `dtype in FP8_DTYPES`, not a prefix"
    assert set(FP8_DTYPES) == {"fp8e4m3", "fp8e5m2"} and wgmma_k(FP8_DTYPES[1]) == 2 * wgmma_k("bf16")


# An architecture given as a default value or assigned: `arch: str = "sm_90"`, `X = "sm_90a"`.
ARCH_DEFAULT = r"""=\s*["']sm_\d+a?["']"""


def test_the_default_arch_is_defined_once():
    """hardware.DEFAULT_ARCH is the one default architecture: NVRTC's compiler takes it too, and it
    is the default GPU's newest arch."""
    defaults = spelled(ARCH_DEFAULT)
    assert files(defaults) == {"hardware.py"}, defaults
    from napkin_dsl.backends.nvrtc import NvrtcCompiler
    import inspect
    assert inspect.signature(NvrtcCompiler).parameters["arch"].default == DEFAULT_ARCH
    assert load_hardware(DEFAULT_GPU).archs[-1] == DEFAULT_ARCH


@pytest.mark.parametrize("function", ["nk_wgmma", "nk_wgmma8", "nk_wgmma_rs", "nk_wgmma_rs8"])
def test_the_opencl_wgmma_signature_is_spelled_in_one_module(function):
    """The emulated wgmma's C signature and every call of it live in wgmma.py, beside each other."""
    assert files(spelled(rf"\b{function}\(")) == {"backends/wgmma.py"}
