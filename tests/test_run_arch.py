"""`napkin run --backend opencl --arch`: the OpenCL emulation of the code built for that architecture."""

from __future__ import annotations

import pytest

from napkin_dsl.backends import opencl
from napkin_dsl.cli import main

from .conftest import EXAMPLES

MATMUL = str(EXAMPLES / "matmul.napkin")
RAGGED = ["--set", "m=130", "n=264", "k=40"]  # tails on every axis of the 128 x 128 x 32 tiles


def printed_sources(monkeypatch) -> list[str]:
    seen = []
    generate = opencl.generate

    def spy(program, report=None, arch=None, **options):
        source, kernels = generate(program, report, arch, **options)
        seen.append(source)
        return source, kernels

    monkeypatch.setattr(opencl, "generate", spy)
    return seen


def test_sm_90a_runs_the_wgmma_emulation_and_matches_the_reference(opencl_device, monkeypatch, capsys):
    seen = printed_sources(monkeypatch)
    assert main(["run", MATMUL, "--backend", "opencl", "--hardware", "H100", "--arch", "sm_90a", *RAGGED]) == 0, capsys.readouterr()
    assert "ok" in capsys.readouterr().out
    assert seen and "nk_wgmma(" in seen[0]  # the descriptor-reading emulation, not mma.sync's


def test_without_arch_the_profiles_own_is_emulated(opencl_device, monkeypatch, capsys):
    """H100's own arch is sm_90a: without --arch, the wgmma build is emulated."""
    seen = printed_sources(monkeypatch)
    assert main(["run", MATMUL, "--backend", "opencl", "--hardware", "H100", *RAGGED]) == 0
    assert "ok" in capsys.readouterr().out
    assert seen and "nk_wgmma(" in seen[0] and " *   napkin_matmul_0: wgmma\n" in seen[0]  # the kernel header says so


def test_sm_90_runs_the_mma_sync_emulation(opencl_device, monkeypatch, capsys):
    seen = printed_sources(monkeypatch)
    assert main(["run", MATMUL, "--backend", "opencl", "--hardware", "H100", "--arch", "sm_90", *RAGGED]) == 0
    assert "ok" in capsys.readouterr().out
    assert seen and "nk_wgmma(" not in seen[0] and "nk_mma(" in seen[0] and " *   napkin_matmul_0: mma.sync\n" in seen[0]


def test_a100_emulates_its_own_sm_80_mma_sync(opencl_device, monkeypatch, capsys):
    seen = printed_sources(monkeypatch)
    assert main(["run", MATMUL, "--backend", "opencl", "--hardware", "A100", *RAGGED]) == 0
    assert "ok" in capsys.readouterr().out
    assert seen and "nk_wgmma(" not in seen[0] and "nk_mma(" in seen[0]


@pytest.mark.parametrize("argv, message", [
    (["--backend", "numpy", "--arch", "sm_90a"], "--arch sm_90a applies to --backend opencl, not numpy"),
    (["--backend", "opencl", "--hardware", "A100", "--arch", "sm_90a"], "A100 cannot run sm_90a"),
])
def test_an_arch_that_does_not_apply_is_refused(argv, message, capsys):
    assert main(["run", MATMUL, *argv, *RAGGED]) == 2
    assert message in capsys.readouterr().err
