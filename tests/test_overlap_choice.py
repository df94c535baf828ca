"""The warpgroup schedule as a choice (issue 48, item 3): a relabel block's ``overlap:`` line, the
default every road reads (isel.select_program: compile, the OpenCL emulation, the model), and a
knob the tuner sets for the tiles it picks."""

from __future__ import annotations

import pytest

import napkin_dsl as napkin
from napkin_dsl.isel import select_program
from napkin_dsl import tune

from .conftest import EXAMPLES

ATTENTION = (EXAMPLES / "attention.napkin").read_text()
BIG = dict(b=4, h=32, q=8192, x=8192, d=128)


def _with(line: str) -> napkin.Kernel:
    return napkin.load(ATTENTION + line)["attention"]


def test_the_relabel_blocks_schedule_is_every_roads_default():
    kernel = _with("    overlap: pingpong+pipelined\n")
    assert kernel.relabel.overlap == "pingpong+pipelined"
    assert kernel.relabel_text() == "on H100: smem: group b 1, h 1, q 128; stream x 64 | overlap: pingpong+pipelined"
    program = kernel.gpu_program("H100", **BIG)
    assert program.schedule.overlap == "pingpong+pipelined"
    assert select_program(program, "sm_90a")[0].plan.roles.schedule == "pingpong+pipelined"
    assert select_program(program, "sm_90a", schedule="serial")[0].plan.roles.schedule == "serial"  # asked for: overrides
    assert kernel.cost("H100", **BIG).time["overlap"] == "pingpong+pipelined"
    # without the line: the serial default
    assert napkin.load(ATTENTION)["attention"].cost("H100", **BIG).time["overlap"] == "serial"


def test_the_line_round_trips_through_relabelled_and_the_block_text():
    from napkin_dsl.kernel import _block_text

    kernel = napkin.load(ATTENTION)["attention"].relabelled("smem: group b 1, h 1, q 128; stream x 64\noverlap: pingpong")
    assert kernel.relabel.overlap == "pingpong"
    text = _block_text(kernel.relabel, "attention")
    assert text.endswith("    overlap: pingpong\n")
    again = napkin.load(ATTENTION.split("relabel")[0] + text)["attention"]
    assert again.relabel.overlap == "pingpong" and _partitions(again) == _partitions(kernel)


def _partitions(kernel):
    return [(c.level, [(p.kind, p.axis, p.size) for p in c.partitions]) for c in kernel.relabel.levels]


@pytest.mark.parametrize("line, message, caret", [
    ("    overlap: pingpong+pipelind\n", "no warpgroup schedule 'pingpong+pipelind'", "did you mean 'pingpong+pipelined'"),
    ("    overlap: group x 64\n", "'overlap' takes a warpgroup schedule, not partitions", "overlap: pingpong+pipelined"),
    ("    smem: pingpong\n", "'smem: pingpong' names no partitions", "written 'overlap: pingpong'"),
    ("    overlap: serial\n    overlap: pipelined\n", "names its warpgroup schedule twice ('serial' and 'pipelined')", "keep one"),
    ("    overlap for O: pingpong\n", "'overlap' takes no 'for'", "write 'overlap: pingpong'"),
])
def test_a_wrong_overlap_line_is_an_error_with_a_caret(line, message, caret):
    with pytest.raises(napkin.NapkinError) as error:
        _with(line)
    text = str(error.value)
    assert message in text and caret in text and "^" in text


def test_the_tuner_picks_fa3s_schedule_for_attention_and_writes_it():
    kernel = napkin.load(ATTENTION.split("relabel")[0])["attention"]
    result = kernel.tune("H100", **BIG)
    best = result.best
    assert best.overlap == "pingpong+pipelined" and best.report.time["overlap"] == "pingpong+pipelined"
    assert result.relabel_block().endswith("    overlap: pingpong+pipelined\n")
    # the same tiles under the default schedule are slower
    serial = kernel.relabelled("".join(line for line in result.relabel_block().splitlines(True) if "overlap:" not in line))
    assert serial.relabel.overlap is None and serial.cost("H100", **BIG).time["overlapped_s"] > best.time_s
    assert f"the {tune.SCHEDULED} best then costed under each schedule napkin builds" in str(result)
    # code generation tunes a kernel without a relabel block, and builds the schedule it picked
    program = kernel.gpu_program("H100", **BIG)
    assert program.schedule.overlap == "pingpong+pipelined"


def test_the_tuner_leaves_a_launch_without_consumer_roles_to_the_default():
    kernel = napkin.load((EXAMPLES / "matmul.napkin").read_text().split("relabel")[0])["matmul"]
    result = kernel.tune("H100", m=8192, n=8192, k=8192)
    assert all(c.overlap is None for c in result.configurations)  # matmul's products overlap already: nothing declines better
    assert "overlap:" not in result.relabel_block()
