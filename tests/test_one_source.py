"""One source of truth: the drawing and the L2 grouping read the Program, not a model of their own.

* render's load and save marks are the Program's transfers into and out of the compute level,
  one mark per step, in the launch of that step, drawn where the array changes level (before
  its readers, after its producer), on every example and every profile it can be planned on;
* plan's closed form of L2 traffic (kept for speed) is the Program's count for every candidate
  L2 grouping, and the grouping plan keeps moves the fewest bytes among those that fit.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings

import napkin_dsl as napkin
from napkin_dsl.cli import load_file
from napkin_dsl.cost import columns, level_costs, max_of
from napkin_dsl.dtypes import DTYPE_BYTES
from napkin_dsl.errors import NapkinError
from napkin_dsl.hardware import load_hardware
from napkin_dsl.plan import l2_traffic, plan, scoped, shared_cache_level
from napkin_dsl.pseudocode import Program, co_resident_blocks, elaborate, l2_candidates, walk
from napkin_dsl.relabel import make_schedule
from napkin_dsl.render import drawn_diagram, layout

from .conftest import EXAMPLES, NAPKIN_EXAMPLES, example_id
from .fuzz_programs import programs

PROFILES = ("A100", "H100", "H200", "two_level", "three_level")

# Arrays read by several statements of a launch and again by a later launch; a result read
# again in its launch and by a later one without @gmem (napkin carries it through the top).
ACROSS = """
kernel across(X: f32[a b]) -> Y: f32[a b]:
    E[a b] = exp(X)
    T[a b] @gmem = E + X
    Y[a b] = T * X
"""
# E is saved after T, its last reader in the first launch, and loaded in the same gap for U and
# Y, its readers in the second.
CLASH = """
kernel clash(X: f32[a b]) -> Y: f32[a b]:
    E[a b] = exp(X)
    T[a b] @gmem = E * 2
    U[a b] = E + T
    Y[a b] = U * E
"""
CARRIED = """
kernel carried(X: f32[a b]) -> Y: f32[a b], Z: f32[a]:
    E[a b] = exp(X)
    Z[a] = sum[b](E)
    T[a b] @gmem = E * 2 + Z
    Y[a b] = T + E
"""


def kernels() -> list:
    found = [(f"{example_id(path)}:{name}", k) for path in NAPKIN_EXAMPLES for name, k in napkin.load(path).items()]
    for path in sorted(EXAMPLES.glob("*.py")):  # the @napkin.kernel functions of the Python examples
        found += [(f"{example_id(path)}:{name}", k) for name, k in load_file(str(path)).items()]
    for source in (ACROSS, CARRIED, CLASH):
        found += list(napkin.load(source).items())
    return found


KERNELS = kernels()


def shown_program(kernel, relabelled: bool, hardware: str) -> Program | None:
    """The Program a drawing on ``hardware`` shows, planned here from the kernel (None where
    the drawing is refused: a relabel block is drawn on its own profile only)."""
    block = kernel.relabel
    if relabelled and block is not None and load_hardware(block.hardware).name != load_hardware(hardware).name:
        return None
    try:
        if relabelled or block is None:
            return kernel.program(hardware)
        return plan(kernel.diagram, hardware)
    except NapkinError:
        return None


def program_transfers(program: Program) -> Counter:
    compute = program.schedule.compute_level
    return Counter((step.op, step.array, launch.index) for launch in program.launches for step, _ in walk(launch.body)
                   if step.op in ("load", "save") and step.level == compute)


def assert_marks_are_the_programs(kernel, program: Program, drawing) -> None:
    """The drawing's load and save marks are the Program's transfers at the compute level, one
    each, in its launch, and each sits where the array changes level: a load between the box
    before its first reader in the launch and that reader's box; a save between the box of the
    last statement of its launch that reads the result on chip (or its producer) and the next
    box, so left of every box of a later launch that reads it.

    The boxes are the drawn diagram's columns (render.drawn_diagram): the kernel's statements,
    or, with a split, its parts launch's columns and the combine's merge boxes, where a
    statement's target names it in both launches; a part state the parts launch saves
    (``O.acc.part``) leaves after the last box of that launch."""
    drawn = Counter((kind, array, launch) for kind, array, launch, _ in drawing.transfers)
    assert drawn == program_transfers(program)
    assert drawing.levels[-1] == program.schedule.compute_level or drawing.levels[-1] == "on chip"
    boxes = list(drawing.box_rects)
    view = drawn_diagram(kernel.diagram, program)
    statements = view.diagram.statements
    if view.column_of:
        launch_of = {column: launch for (launch, _), column in view.column_of.items()}
    else:
        by_target = {s.target: launch.index for launch in program.launches for s in launch.launch.statements}
        launch_of = {s.index: by_target[s.target] for s in statements}
    for kind, array, launch, x in drawing.transfers:
        readers = [s.index for s in statements if array in s.inputs and launch_of[s.index] == launch]
        if kind == "load":
            assert readers and x < boxes[readers[0]][0], (array, launch)
            assert readers[0] == 0 or x > boxes[readers[0] - 1][2], (array, launch)
        else:
            if array in view.spawned:
                last = max(column for column, index in launch_of.items() if index == launch)
            else:
                last = max([view.diagram.producer(array).index] + readers)
            assert x > boxes[last][2], array
            assert last + 1 == len(boxes) or x < boxes[last + 1][0], array


@pytest.mark.parametrize("relabelled", [False, True], ids=["written", "relabelled"])
@pytest.mark.parametrize("hardware", PROFILES)
@pytest.mark.parametrize("kernel", [k for _, k in KERNELS], ids=[name for name, _ in KERNELS])
def test_drawn_loads_and_saves_are_the_programs(kernel, hardware, relabelled):
    program = shown_program(kernel, relabelled, hardware)
    if program is None:
        with pytest.raises(NapkinError):
            layout(kernel, relabelled, hardware=hardware)
        return
    drawing = layout(kernel, relabelled, hardware=hardware)
    assert drawing.levels[0] == program.levels[0] and drawing.levels[-1] == program.schedule.compute_level
    assert_marks_are_the_programs(kernel, program, drawing)


@settings(max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(programs(max_size=5, opencl=False))
def test_random_kernels_draw_the_programs_transfers(case):
    """Random kernels (@gmem splits, results read again, several outputs), drawn on their
    relabel block's profile or the case's, relabelled and as written."""
    try:
        kernels = napkin.load(case.text)
    except NapkinError:
        return  # a relabelling the generator drew and napkin refuses: nothing to draw
    for kernel in kernels.values():
        hardware = case.hardware or kernel._target(None)
        for relabelled in (False, True):
            program = shown_program(kernel, relabelled, hardware)
            if program is None:
                continue
            assert_marks_are_the_programs(kernel, program, layout(kernel, relabelled, hardware=hardware))


@pytest.mark.parametrize("hardware", PROFILES)
def test_fig9_draws_three_loads_and_two_saves(hardware):
    """The paper's Fig. 9 (P @l0): S loaded, P saved and loaded again with V, O saved, on every
    profile (@l0 is device memory on a GPU)."""
    fig9 = napkin.load(EXAMPLES / "paper" / "fig9.napkin")["fig9"]
    drawing = layout(fig9, hardware=hardware, costs=True)
    assert sorted((kind, array) for kind, array, _, _ in drawing.transfers) == [
        ("load", "P"), ("load", "S"), ("load", "V"), ("save", "O"), ("save", "P")]


def test_a_drawing_without_hardware_reads_the_same_transfers():
    across = napkin.load(ACROSS)["across"]
    drawing = layout(across)
    assert drawing.levels == ["gmem", "on chip"]
    assert Counter((k, a, n) for k, a, n, _ in drawing.transfers) == program_transfers(across.program())
    # X: loaded once for E and T in the first launch, and again for Y in the second.
    assert sorted((k, n) for k, a, n, _ in drawing.transfers if a == "X") == [("load", 0), ("load", 1)]


# ---- the L2 grouping ---------------------------------------------------------------------------

# Sizes at which the examples have several L2 groupings to choose from (and fit the checker);
# ragged ones leave the last group of a tile (and of an L2 group) short.
L2_SIZES = {"b": 2, "h": 8, "kv": 4, "r": 4, "q": 2048, "x": 2048, "d": 128, "m": 4096, "n": 4096, "k": 4096,
            "t": 4096, "a": 4096, "w": 256, "y": 512}
RAGGED = {**L2_SIZES, "q": 2000, "x": 1999, "m": 4000, "n": 3000, "t": 4001, "a": 4001}


def program_l2(diagram, hardware, block, sizes, level, extra, launch_index) -> tuple[int, int]:
    """(bytes moved, bytes resident) at ``level`` in one launch, read off the Program elaborated
    with the candidate grouping ``extra`` (scoped to that launch: plan.scoped): the moved bytes
    as cost.level_costs counts them; the resident ones as the Program's buffers at that level,
    streamed axes at their chunk."""
    program = elaborate(make_schedule(diagram, hardware, block, sizes, extra_partitions=extra))
    launch = program.launches[launch_index]
    only = Program(program.schedule, (launch,))
    moved = int(level_costs(only, rows=[])[level].H_bytes)  # rows: the columns of M, not compared here
    view = launch.schedule
    streamed = {p.axis for p in view.partitions_at(view.compute_level, "stream")}
    resident = sum(math.prod(int(view.extent(a, view.compute_level if a in streamed else level)) for a in buffer.axes)
                   * DTYPE_BYTES[buffer.dtype] for (where, _), buffer in launch.buffers.items() if where == level)
    return moved, resident


@pytest.mark.parametrize("chosen_sizes", [L2_SIZES, RAGGED], ids=["even", "ragged"])
@pytest.mark.parametrize("hardware", ["A100", "H100", "H200"])
@pytest.mark.parametrize("kernel", [k for _, k in KERNELS], ids=[name for name, _ in KERNELS])
def test_the_l2_closed_form_is_the_programs_count(kernel, hardware, chosen_sizes):
    """For every launch and candidate grouping, plan.l2_traffic equals what the Program elaborated
    with that grouping moves and holds at L2; the grouping plan keeps moves the fewest bytes
    among those that fit, and is what the final Program's report counts."""
    sizes = {axis: chosen_sizes.get(axis, 256) for axis in kernel.diagram.axes}
    block = kernel.relabel if kernel.relabel is not None and load_hardware(kernel.relabel.hardware).name == hardware else None
    schedule = make_schedule(kernel.diagram, hardware, block, sizes)
    level = shared_cache_level(schedule)
    assert level == "l2"
    base = elaborate(schedule)
    rows = columns(base)
    capacity = schedule.hardware.level(level).capacity
    chosen = plan(kernel.diagram, hardware, block, sizes)
    compared = 0
    for launch in base.launches:
        smem = max_of(r["M_bytes"].get(schedule.compute_level, 0) for r in rows if r["launch"] == launch.index)
        blocks = co_resident_blocks(launch.schedule, smem)
        weighed = []
        for candidate in (l2_candidates(launch.schedule, level, blocks) if blocks else []):
            closed = l2_traffic(launch.schedule, launch, candidate)
            extra = tuple(scoped(candidate, base, launch))
            assert closed == program_l2(kernel.diagram, hardware, block, sizes, level, extra, launch.index), candidate
            weighed.append(closed)
            compared += 1
        if not weighed:
            continue
        kept = int(level_costs(Program(chosen.schedule, (chosen.launches[launch.index],)), rows=[])[level].H_bytes)
        fitting = [moved for moved, resident in weighed if resident <= capacity]
        # With no grouping that fits, no reuse through L2: the smallest working set, every block's loads charged.
        assert kept == (min(fitting) if fitting else min(weighed, key=lambda c: (c[1], c[0]))[0])
    assert compared > 0
