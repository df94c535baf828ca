"""Adding an instruction path is one module and one profile entry (issue 42): the toy path of
tests/toy_path.py (mma.sync restricted to one shape, under the name ``toy.mma``), registered, on a
user profile with a ``[path.toy]`` table, is what selection takes, what the model prices at the
table's rate, what both printers build (the OpenCL build runs and matches the reference) and what
``napkin cuda --resources`` reports. Unregistered, the same kernel is mma.sync's again."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import paths
from napkin_dsl.backends import cuda
from napkin_dsl.isel import describe, select_program, warp_line

from .conftest import EXAMPLES
from .test_user_profile import L40S, profile_text
from .toy_path import PROFILE_ENTRY, TOY, ToyPlan

TOY_RATE = 100e12  # not the profile's mma.sync rate: the model must read the toy's table
SIZES = dict(m=128 * L40S["sms"], n=128, k=1024)  # one 128 x 128 block per SM


@pytest.fixture
def toy():
    paths.register(TOY)
    yield TOY
    paths.unregister(TOY)


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "toy_gpu.toml"
    path.write_text(profile_text("toy_gpu") + PROFILE_ENTRY.format(arch="sm_89", rate=TOY_RATE))
    return path


def matmul():
    (kernel,) = napkin.load(EXAMPLES / "matmul.napkin").values()
    return kernel


def test_registering_puts_the_path_before_mma_sync_and_once():
    paths.register(TOY)
    try:
        assert paths.PATHS == [paths.WGMMA, TOY, paths.MMA_SYNC]
        with pytest.raises(ValueError, match="registered already"):
            paths.register(TOY)
    finally:
        paths.unregister(TOY)
    assert paths.PATHS == [paths.WGMMA, paths.MMA_SYNC]


def test_selection_takes_the_toy_where_the_profile_offers_it(toy, profile):
    program = matmul().gpu_program(profile, **SIZES)
    chosen = select_program(program, "sm_89")[0]
    assert chosen.path == "toy.mma" and type(chosen.plan) is ToyPlan and chosen.plan.built
    assert describe(chosen, program.launches[0]) == ["C: toy.mma (mma.sync.m16n8k16) bf16 -> f32, A = A, B = B"]
    assert warp_line(chosen.plan).endswith("# toy.mma")
    # a plan the toy refuses (attention's P, an A from registers) is mma.sync's, and the kernel
    # header names the toy's refusal
    (attention,) = napkin.load(EXAMPLES / "attention.napkin").values()
    program = attention.gpu_program(profile, b=1, h=2, q=128, x=256, d=64)
    chosen = select_program(program, "sm_89")[0]
    assert chosen.path == "mma.sync" and chosen.declined_path == "toy.mma"
    assert describe(chosen, program.launches[0])[0] == "not toy.mma: the toy reads A from shared memory only, not P from registers"


def test_the_model_prices_the_toy_at_its_tables_rate(toy, profile):
    m, n, k = SIZES.values()
    report = matmul().cost(profile, **SIZES)
    assert report.time["compute_s"] == pytest.approx(2 * m * n * k / TOY_RATE, rel=1e-12)
    paths.unregister(TOY)
    try:
        again = matmul().cost(profile, **SIZES)  # the same kernel, mma.sync's again
        assert again.time["compute_s"] == pytest.approx(2 * m * n * k / L40S["mma_bf16"], rel=1e-12)
    finally:
        paths.register(TOY)


def test_both_printers_build_the_toy_and_the_opencl_build_matches_the_reference(toy, profile):
    from napkin_dsl.backends import opencl
    from napkin_dsl.backends.numpy import random_arguments
    from napkin_dsl.reference import evaluate

    sizes = dict(m=64, n=64, k=64)
    program = matmul().gpu_program(profile, **sizes)
    source, kernels = cuda.generate(program, arch="sm_89")
    assert [k.path for k in kernels] == ["toy.mma"] and "mma.sync.aligned.m16n8k16" in source
    assert "C: toy.mma (mma.sync.m16n8k16)" in source  # the header's instruction paths
    text, kernels = opencl.generate(program, arch="sm_89")
    assert [k.path for k in kernels] == ["toy.mma"]
    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    arrays, scalars = random_arguments(program.diagram, sizes, 0)
    got = opencl.run(program, arrays, scalars, arch="sm_89")
    want = evaluate(program.diagram, arrays, scalars, sizes)
    assert np.allclose(got["C"], want["C"], rtol=2e-2, atol=2e-2)


def test_napkin_cuda_resources_reports_the_toy(toy, profile):
    from napkin_dsl.backends import nvrtc
    from napkin_dsl.cli import main

    pytest.importorskip("cuda.bindings.nvrtc")
    if 89 not in nvrtc.supported_archs():
        pytest.skip("this NVRTC does not compile for sm_89")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["cuda", str(EXAMPLES / "matmul.napkin"), "--hardware", str(profile), "--arch", "sm_89",
                     "--set", "m=256", "n=256", "k=256", "--resources"]) == 0
    assert ", toy.mma" in out.getvalue() and "C: toy.mma (mma.sync.m16n8k16)" in out.getvalue()


def test_the_architecture_pages_worked_example_is_the_toy():
    """docs/architecture.md's "Adding an instruction path" shows the toy's code as it is."""
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    section = page.split("## Adding an instruction path", 1)[1].split("\n## ", 1)[0]
    shown = section.split("```python\n", 1)[1].split("```", 1)[0]
    module = (Path(__file__).resolve().parent / "toy_path.py").read_text()
    missing = [line for line in shown.splitlines() if line.strip() and line not in module.splitlines()]
    assert not missing, missing
    for step in ("paths.PATHS", "[path.NAME]", "PRINTERS"):
        assert step in section
