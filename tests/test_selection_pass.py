"""Instruction selection as one pass (issue 21, item 3): ``isel.select_program`` decides every
launch of a Program once for a target, and the model, the printers and the NumPy backend read
that result rather than select again or derive tiles of their own.

The examples cover a tensor-core launch with register fragments fed to a second product
(attention), a 2-D warp grid (matmul) and a split (split-K: a parts launch on tensor cores, and
a combine launch on the FMA path that merges the parts' states)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import isel
from napkin_dsl.backends import cuda
from napkin_dsl.backends.lowering import CudaDialect, OpenCLDialect
from napkin_dsl.backends.numpy import execute, random_arguments
from napkin_dsl.backends.translate import lower
from napkin_dsl.cost import contraction_unit, cost_of, instruction_path, tensor_launches

from .conftest import EXAMPLES

CASES = {
    "attention": ("attention.napkin", dict(b=1, h=2, q=256, x=256, d=64)),
    "matmul": ("matmul.napkin", dict(m=256, n=256, k=256)),
    "splitk": ("splitk.napkin", dict(m=128, n=128, k=16384)),
}


def _program(case: str):
    name, sizes = CASES[case]
    (kernel,) = napkin.load(EXAMPLES / name).values()
    return kernel.gpu_program(**sizes), sizes


@pytest.fixture
def select_calls(monkeypatch):
    """Counts isel.select's calls per (launch index, arch), as the pass makes them."""
    calls = collections.Counter()
    select = isel.select

    def counted(launch, arch, *args, **kwargs):
        calls[(launch.index, arch)] += 1
        return select(launch, arch, *args, **kwargs)

    monkeypatch.setattr(isel, "select", counted)
    return calls


@pytest.mark.parametrize("case", sorted(CASES))
def test_cost_of_selects_each_launch_once(case, select_calls):
    program, _ = _program(case)
    select_calls.clear()  # planning weighs the L2 groupings on the columns, with a selection of its own
    cost_of(program)
    arch = program.hardware.arch
    assert select_calls == {(launch.index, arch): 1 for launch in program.launches}
    select_calls.clear()
    cost_of(program, arch="sm_80")
    assert select_calls == {(launch.index, "sm_80"): 1 for launch in program.launches}


@pytest.mark.parametrize("case", sorted(CASES))
def test_lowering_with_its_report_selects_each_launch_once(case, select_calls):
    program, _ = _program(case)
    select_calls.clear()
    cuda.generate(program, arch="sm_90")  # the report (cost_of) and the printers
    assert select_calls == {(launch.index, "sm_90"): 1 for launch in program.launches}


@pytest.fixture
def launch_selections(monkeypatch):
    """Counts isel.select's calls per launch object: a Program's launches apart from the
    candidates planning weighs (the L2 grouping builds and prices Programs of its own)."""
    calls = collections.Counter()
    select = isel.select

    def counted(launch, arch, *args, **kwargs):
        calls[id(launch)] += 1
        return select(launch, arch, *args, **kwargs)

    monkeypatch.setattr(isel, "select", counted)
    return calls


@pytest.mark.parametrize("case", ["attention", "splitk"])
def test_a_cuda_build_selects_each_launch_once(case, launch_selections, tmp_path, monkeypatch):
    """What `napkin cuda --resources --sass` and a launch read of a build, from the compile to
    the TMA operands' tensor maps, is the one selection the source was printed with
    (``CompiledKernel.selection``): each launch is selected once. After a disk-cache hit, in a
    kernel loaded afresh, once again (the cubin is read back; the selection is made when asked)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from napkin_dsl.backends.sass import sass_report

    monkeypatch.setenv("NAPKIN_CACHE_DIR", str(tmp_path))  # a compile, not a hit of another test's
    name, sizes = CASES[case]
    for fresh in (True, False):
        (kernel,) = napkin.load(EXAMPLES / name).values()
        program = kernel.gpu_program(None, **sizes)  # planning, and the Program compile builds on
        launch_selections.clear()
        compiled = kernel.compile("sm_90a", **sizes)
        assert (compiled.selected is not None) == fresh  # a hit has selected nothing yet
        assert compiled.program is program and compiled.selection.arch == "sm_90a"
        compiled.cost, cuda.format_resources(compiled), sass_report(compiled)
        maps = cuda.tensor_map_arguments(compiled.program, compiled.selection)  # what cuda.run passes
        assert len(maps) == len(program.launches) and any(maps) == (case == "attention")
        assert launch_selections == {id(launch): 1 for launch in program.launches}, case


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_selections_tiles_are_the_schedules(case):
    program, sizes = _program(case)
    selected = isel.select_program(program)
    assert selected.arch == program.hardware.arch and selected.path is None
    assert sorted(selected.launches) == [launch.index for launch in program.launches]
    for launch in program.launches:
        chosen, schedule = selected[launch.index], launch.schedule
        level = schedule.compute_level
        assert chosen.sizes == {a: sizes[a] for a in program.diagram.axes}
        assert chosen.tile == {a: int(schedule.extent(a, level)) for a in program.diagram.axes}
        assert chosen.warp_tiles == isel.warp_tiles_of(launch)
        if chosen.plan is not None:
            assert (chosen.slots, chosen.smem_bytes) == isel.smem_layout(chosen.plan, chosen.tile, program.diagram)
            assert (chosen.kept, chosen.refused) == ({}, {})
        else:
            assert (chosen.kept, chosen.refused) == isel.fma_accumulators(launch, chosen.tile)


def test_the_paths_the_examples_take():
    # What each case is here to cover on sm_90 (mma.sync): a tensor-core launch with P fed from
    # registers, a 2-D warp grid, and a split whose parts run on tensor cores (the epilogue saves
    # the accumulator fragments as part states) beside a combine launch that reads those states,
    # not the operands.
    attention = isel.select_program(_program("attention")[0], "sm_90")
    assert attention.paths == ("mma.sync",)
    assert any(m.a_in_registers for m in attention[0].plan.mmas.values())
    matmul = isel.select_program(_program("matmul")[0], "sm_90")
    assert matmul.paths == ("mma.sync",) and matmul[0].plan.col_warps > 1
    splitk = isel.select_program(_program("splitk")[0], "sm_90")
    assert splitk.paths == ("mma.sync", "fma") and splitk[0].reason == ""
    assert splitk[1].reason == "B operand B is not loaded into shared memory"  # the combine adds the parts' states


def test_the_paths_the_examples_take_on_the_profiles_sm_90a():
    # The H100 profile's default: attention and matmul on wgmma (P from registers, A and B by
    # descriptor); a split's parts stay on mma.sync, with the reason wgmma declines them.
    attention = isel.select_program(_program("attention")[0])
    assert attention.arch == "sm_90a" and attention.paths == ("wgmma",)
    assert any(m.a_in_registers for m in attention[0].plan.mmas.values())
    matmul = isel.select_program(_program("matmul")[0])
    assert matmul.arch == "sm_90a" and matmul.paths == ("wgmma",)
    splitk = isel.select_program(_program("splitk")[0])
    assert splitk.paths == ("mma.sync", "fma") and splitk[0].reason == ""
    assert splitk[0].declined == "a split's parts launch: the wgmma epilogue that saves its part states is not written"


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dialect", [CudaDialect, OpenCLDialect])
@pytest.mark.parametrize("arch", ["sm_90", "sm_90a"])
def test_the_printers_print_the_selected_paths(case, dialect, arch):
    program, _ = _program(case)
    selected = isel.select_program(program, arch)
    lowered = lower(program, dialect(), cost_of(program, arch=arch, selected=selected), arch=arch, selected=selected)
    assert [k.path for k in lowered.kernels] == list(selected.paths)
    for launch, kernel in zip(program.launches, lowered.kernels, strict=True):
        chosen = selected[launch.index]
        if chosen.plan is not None:
            # with roles, OpenCL's work-group is the consumers' (the producer runs on their work-items)
            emulated = dialect is OpenCLDialect and getattr(chosen.plan, "roles", None) is not None
            assert kernel.block == chosen.plan.threads - (128 if emulated else 0)
            # the selection's layout is the printed arena, a TMA plan's mbarriers included
            assert kernel.shared_bytes == chosen.smem_bytes
            if isel.mbarrier_count(chosen.plan):
                assert chosen.smem_bytes % isel.MBARRIER_BYTES == 0 and isel.mbarrier_count(chosen.plan) >= chosen.plan.stages
        else:
            assert kernel.block == isel.FMA_THREADS
            assert [line for line in kernel.paths if "fma (" in line] == [
                f"{s.target}: fma ({chosen.reason})" for s in launch.launch.statements]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_model_prices_the_selected_paths(case):
    program, _ = _program(case)
    selected = isel.select_program(program)
    report = cost_of(program, selected=selected)
    assert [instruction_path(program, launch, selected) for launch in program.launches] == list(selected.paths)
    assert set(tensor_launches(program, selected)) == set(selected.tensor())
    registers = any(chosen.plan is not None or chosen.kept for chosen in selected.launches.values())
    assert ("registers" in report.levels) == registers
    refused = {name for chosen in selected.launches.values() for name in chosen.refused}
    assert {name for name in refused if any(f"{name} stays in shared memory" in n for n in report.notes)} == refused
    # the same report as the one cost_of selects for itself
    assert report.to_dict() == cost_of(program).to_dict()


def test_a_selection_for_another_target_is_not_priced_as_this_one():
    program, _ = _program("matmul")
    with pytest.raises(AssertionError, match="napkin bug"):
        cost_of(program, arch="sm_80", selected=isel.select_program(program, "sm_90"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_numpy_backend_counts_products_on_the_selected_unit(case):
    program, sizes = _program(case)
    selected = isel.select_program(program)
    units = {launch.index: contraction_unit(program, launch, selected) for launch in program.launches}
    assert units == {index: "fma" if path == "fma" else "tensor" for index, path in enumerate(selected.paths)}
    arrays, scalars = random_arguments(program.diagram, sizes, 0)
    outputs, counts = execute(program, arrays, scalars, selected=selected)
    on_tensor = any(unit == "tensor" for unit in units.values())
    assert (counts.flops.get("tensor", 0) > 0) == on_tensor
    report = cost_of(program, selected=selected)
    assert counts.flops.get("tensor", 0) == int(report.flops.get("tensor", 0))
    assert all(np.isfinite(value).all() for value in outputs.values())
