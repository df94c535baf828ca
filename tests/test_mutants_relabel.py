"""relabel.py: what mutation testing found unchecked (benchmarks/mutation.md).

Stream roles, the top level across profiles, the hints' suggestions, and the schedule's pieces
being values, each against what the notation and METHOD.md say they must be.
"""

from __future__ import annotations

import dataclasses

import pytest

import napkin_dsl as napkin
from napkin_dsl import syntax
from napkin_dsl.errors import RelabelError
from napkin_dsl.hardware import load_hardware
from napkin_dsl.relabel import Partition, is_top, make_schedule

MAP_THEN_SUM = """
kernel rows(X: f32[a b]) -> Y: f32[a]:
    S[a b] = exp(X[a b])
    Y[a] = sum[b](S[a b])

relabel rows on two_level:
    l1: group a 8; stream b 16
"""


def test_a_map_along_the_streamed_axis_feeds_its_chunks_to_the_reduction():
    # S is computed per chunk of b (a body statement); Y sums S over b with a running sum
    schedule = napkin.load(MAP_THEN_SUM)["rows"].program(a=64, b=64).schedule
    (stream,) = schedule.launches[0].streams
    assert stream.axis == "b"
    assert stream.roles == {0: "body", 1: "accumulate"}


def test_the_top_level_of_another_profile_is_the_top_here_too():
    h100, two_level = load_hardware("H100"), load_hardware("two_level")
    assert is_top("gmem", h100) is True
    assert is_top("l0", h100) is True  # the abstract models' device memory, written @l0
    assert is_top("gmem", two_level) is True
    assert is_top("smem", h100) is False
    assert is_top("l1", two_level) is False
    assert is_top(None, h100) is False


def test_a_level_of_this_profile_that_is_another_profiles_top_is_not_the_top():
    # three_level has l0 (top), l1, l2; l2 is H100's cache. On three_level, @l2 is an on-chip level.
    three = load_hardware("three_level")
    assert [lv.name for lv in three.levels][0] == "l0"
    assert is_top("l2", three) is False
    assert is_top("l0", three) is True


def test_partitions_are_hashable_values_and_schedule_pieces_cannot_change():
    schedule = napkin.load(MAP_THEN_SUM)["rows"].program(a=64, b=64).schedule
    group, stream = schedule.partitions
    assert isinstance(group, Partition)
    assert {group, stream, dataclasses.replace(group)} == {group, stream}
    with pytest.raises(dataclasses.FrozenInstanceError):
        group.size = 4
    launch = schedule.launches[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        launch.streams = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        launch.streams[0].axis = "a"


CLOSE_AXES = """
kernel k(X: f32[rows1 rows2 rows3]) -> Y: f32[rows1 rows2 rows3]:
    Y[rows1 rows2 rows3] = exp(X[rows1 rows2 rows3])

relabel k on two_level:
    l1: group rows 8
"""

CLOSE_TARGETS = """
kernel k(X: f32[a]) -> Out3: f32[a]:
    Out1[a] = exp(X[a])
    Out2[a] = exp(Out1[a])
    Out3[a] = exp(Out2[a])

relabel k on two_level:
    l1 for Out: group a 8
"""


def test_an_unknown_axis_hint_suggests_the_two_closest_axes():
    with pytest.raises(RelabelError) as caught:
        napkin.load(CLOSE_AXES)["k"].program()
    hint = next(e.hint for e in getattr(caught.value, "errors", [caught.value]) if e.hint and "did you mean" in e.hint)
    named = [a for a in ("rows1", "rows2", "rows3") if a in hint]
    assert len(named) == 2, hint  # three are close; the hint names two


def test_an_unknown_target_hint_suggests_the_two_closest_arrays():
    with pytest.raises(RelabelError) as caught:
        napkin.load(CLOSE_TARGETS)["k"].program()
    hint = next(e.hint for e in getattr(caught.value, "errors", [caught.value]) if e.hint and "did you mean" in e.hint)
    named = [a for a in ("Out1", "Out2", "Out3") if a in hint]
    assert len(named) == 2, hint


THREAD_LEVEL_ABOVE_COMPUTE = """\
name = "thread_above"
description = "test: a per-thread level above the compute level"
counts = "bytes"

[[level]]
name = "gmem"
per = "device"

[[level]]
name = "lanes"
per = "thread"
units = 1
capacity = 65536
bandwidth = 1.0e12

[[level]]
name = "smem"
per = "block"
units = 1
capacity = 65536
bandwidth = 1.0e12
compute = true

[peak_flops]
fma = { f32 = 1.0e15 }
special = 1.0e15
"""

STREAM_AT_LANES = """
kernel rows(X: f32[a b]) -> Y: f32[a]:
    S[a b] = exp(X[a b])
    Y[a] = sum[b](S[a b])

relabel rows on two_level:
    lanes: stream b 16
"""


def test_only_a_per_thread_level_below_the_compute_level_takes_warp_tiles(tmp_path):
    # A per-thread level above the compute level is an ordinary level: a stream there is refused
    # because streams run at the compute level, not because the level takes only warp tiles.
    profile = tmp_path / "thread_above.toml"
    profile.write_text(THREAD_LEVEL_ABOVE_COMPUTE)
    # the checker reads a relabel block against the profile it names: parse the block alone and
    # schedule the checked diagram on the test profile
    (block,) = syntax.parse(STREAM_AT_LANES).relabels
    diagram = napkin.load(STREAM_AT_LANES.split("relabel")[0])["rows"].diagram
    with pytest.raises(RelabelError) as caught:
        make_schedule(diagram, load_hardware(str(profile)), block)
    message = str(caught.value)
    assert "stream partitions run at the compute level" in message
    assert "takes warp tiles" not in message


TWO_STREAMS = """
kernel chain(A: f32[a b], B: f32[b c], E: f32[c e]) -> D: f32[a e]:
    C[a c] = A[a b] * B[b c]
    D[a e] = C[a c] * E[c e]

relabel chain on two_level:
    l1: stream b 8, c 8
"""


def test_two_streams_in_one_launch_are_refused_once_naming_both_axes():
    with pytest.raises(RelabelError) as caught:
        napkin.load(TWO_STREAMS)["chain"].program()
    errors = getattr(caught.value, "errors", [caught.value])
    one_axis = [e for e in errors if "napkin streams one axis per level" in str(e)]
    assert len(one_axis) == 1
    assert "streams 2 axes (b, c)" in str(one_axis[0])


LEVEL_BELOW_COMPUTE = """\
name = "level_below"
description = "test: a per-block level below the profile's compute level"
counts = "bytes"

[[level]]
name = "gmem"
per = "device"

[[level]]
name = "smem"
per = "block"
units = 1
capacity = 65536
bandwidth = 1.0e12
compute = true

[[level]]
name = "lds"
per = "block"
units = 1
capacity = 16384
bandwidth = 2.0e12

[peak_flops]
fma = { f32 = 1.0e15 }
special = 1.0e15
"""

GROUP_AT_LDS = """
kernel rows(X: f32[a b]) -> Y: f32[a]:
    Y[a] = sum[b](X[a b])

relabel rows on two_level:
    lds: group a 8
"""


def test_a_partition_below_the_compute_level_moves_the_compute_level_down(tmp_path):
    # "every level down to the compute level or the lowest partitioned level, whichever is lower"
    profile = tmp_path / "level_below.toml"
    profile.write_text(LEVEL_BELOW_COMPUTE)
    (block,) = syntax.parse(GROUP_AT_LDS).relabels
    diagram = napkin.load(GROUP_AT_LDS.split("relabel")[0])["rows"].diagram
    schedule = make_schedule(diagram, load_hardware(str(profile)), block)
    assert schedule.levels == ("gmem", "smem", "lds")
    assert schedule.compute_level == "lds"
