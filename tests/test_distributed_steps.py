"""The steps of distributed.run_rank on their own, without a process group: a real diagram, and a
link that records what a rank sends and answers what it receives with ones (tests/test_distributed.py
runs the whole, across processes)."""

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import distributed as d
from napkin_dsl.errors import NapkinError

PARTS = [(0, 0, 4), (1, 4, 8), (0, 8, 10)]  # (unit, start, stop) per part: part p on rank p mod 2


class _Recorder:
    """A stand-in link: records sends, answers receives with arrays of ones."""

    def __init__(self):
        self.sent, self.asked = [], []

    def send(self, array, dtype, to):
        self.sent.append((np.asarray(array).copy(), dtype, to))

    def recv(self, shape, dtype, source):
        self.asked.append((tuple(shape), dtype, source))
        return np.ones(shape)


def _diagram():
    return napkin.load("kernel rowdot(A: f32[x d], B: f32[d]) -> O: f32[x]:\n    O[x] = A[x d] * B[d]\n")["rowdot"].diagram


def _share(rank):
    return d._Share(_diagram(), {"x": 10, "d": 3}, "x", PARTS, rank, _Recorder())


def test_parts_and_cuts():
    assert d._parts_on(PARTS, 0) == [(0, 0, 4), (2, 8, 10)] == _share(0).mine
    assert d._parts_on(PARTS, 1) == [(1, 4, 8)] and d._parts_on(PARTS, 2) == []
    a = _diagram().arrays["A"]
    assert d._part_cut(a, "x", 4, 8) == (slice(4, 8), slice(None))
    assert d._part_shape(a, "x", 4, 8, {"x": 10, "d": 3}) == (4, 3)
    assert d._state_index(("x#", "q"), "x", 2) == (2,) and d._state_index(("q", "x#"), "x", 1) == (slice(None), 1)


def test_rank0_sends_each_rank_its_pieces_and_keeps_its_own():
    share = _share(0)
    arrays = {"A": np.arange(30.0).reshape(10, 3), "B": np.arange(3.0)}
    local, whole = d._distribute_inputs(share, arrays, 2)
    assert sorted(local) == [0, 2] and np.array_equal(local[2]["A"], arrays["A"][8:10])
    assert whole["B"] is arrays["B"]
    assert [(s.shape, to) for s, _, to in share.link.sent] == [((4, 3), 1), ((3,), 1)]


def test_other_ranks_receive_only_their_pieces():
    share = _share(1)
    local, whole = d._distribute_inputs(share, None, 2)
    assert share.link.asked == [((4, 3), "f32", 0), ((3,), "f32", 0)]
    assert sorted(local) == [1] and local[1]["A"].shape == (4, 3) and whole["B"].shape == (3,)


def test_group_outputs_gathered_and_sent():
    results = {0: {"O": np.full(4, 2.0)}, 2: {"O": np.full(2, 3.0)}}
    outputs = d._collect_group_outputs(_share(0), results)
    assert outputs["O"].tolist() == [2.0] * 4 + [1.0] * 4 + [3.0] * 2
    share = _share(1)
    d._send_group_outputs(share, {1: {"O": np.zeros(4)}})
    assert [(s.shape, dtype, to) for s, dtype, to in share.link.sent] == [((4,), "f32", 0)]


def test_split_inputs_fill_only_this_ranks_parts():
    local = {1: {"A": np.ones((4, 3))}}
    inputs = d._split_inputs(_share(1), local, {"B": np.arange(3.0)})
    assert inputs["A"].sum() == 12 and inputs["A"][4:8].sum() == 12 and inputs["B"].tolist() == [0, 1, 2]


def test_a_split_runs_on_numpy_only():
    with pytest.raises(NotImplementedError, match="on the opencl backend"):
        d._check_split_backend("opencl")
    d._check_split_backend("numpy")


def test_counts_and_errors():
    assert d._summed_counts([{"gmem": 2}, {"gmem": 3, "smem": 1}]) == {"gmem": 5, "smem": 1}
    max_abs, scale = d._reference_errors(_diagram(), {"O": np.array([1.0, 2.5])}, {"O": np.array([1.0, 2.0])})
    assert max_abs == pytest.approx(0.5) and scale > 0


def test_node_profile_needs_a_node_of_enough_gpus():
    kernel = napkin.load("kernel scale(A: f32[x]) -> B: f32[x]:\n    B[x] = A * 2\n")["scale"]
    with pytest.raises(NapkinError, match="has no device level"):
        d._node_profile(kernel, "H100", 2)
    with pytest.raises(NapkinError, match="9 processes, but H100x8 has 8 GPUs"):
        d._node_profile(kernel, "H100x8", 9)
    assert d._node_profile(kernel, "H100x8", 8).name == "H100x8"
