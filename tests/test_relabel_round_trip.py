"""Relabellings survive a round trip (issue 45, item 5): a relabel block written back as text
(``Kernel.relabelled``'s source, ``Kernel.lse_forward``'s block) parses to the same block, every
clause (group, split, stream) and scope in the order written. Before, the text kept group and
stream only: a split written in ``relabelled(...)``, and decode's ``split x`` in the forward a
``save_lse`` backward runs, were dropped without a word."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

import napkin_dsl as napkin
from napkin_dsl.kernel import _block_text
from napkin_dsl.tune import parse_relabel

from .conftest import EXAMPLES


def clauses(block) -> tuple:
    """A block without its spans: its hardware and each level's (kind, axis, size, scope) in order."""
    return (block.hardware, tuple((level.level, tuple((p.kind, p.axis, p.size, p.targets) for p in level.partitions))
                                  for level in block.levels))


def relabelled_kernels():
    for path in sorted(Path(EXAMPLES).rglob("*.napkin")):
        for kernel in napkin.load(path).values():
            if kernel.relabel is not None and kernel.relabel.levels:
                yield path.name, kernel


def test_every_examples_relabelling_survives_the_round_trip():
    seen = 0
    for name, kernel in relabelled_kernels():
        text = _block_text(kernel.relabel, kernel.name)
        assert clauses(parse_relabel(text, kernel.name, None)) == clauses(kernel.relabel), (name, text)
        seen += 1
    assert seen >= 10


def test_a_split_written_in_relabelled_stays_in_its_source():
    (kernel,) = napkin.load(EXAMPLES / "splitk.napkin").values()
    relabelled = kernel.relabelled("smem: group m 128, n 128; split k 4096; stream k 64")
    (again,) = napkin.load(relabelled.source).values()
    assert clauses(again.relabel) == clauses(relabelled.relabel)
    assert ("split", "k", 4096, None) in clauses(again.relabel)[1][0][1]


def test_decodes_lse_forward_keeps_its_split():
    """The forward a save_lse backward (and the torch autograd call) runs is decode's own schedule:
    flash-decoding's split of the keys, priced and run as written."""
    (kernel,) = napkin.load(EXAMPLES / "decode.napkin").values()
    forward = kernel.lse_forward()
    assert clauses(forward.relabel) == clauses(kernel.relabel)
    assert any(p.kind == "split" for level in forward.relabel.levels for p in level.partitions)


KINDS = st.sampled_from(["group", "split", "stream"])
AXES = st.sampled_from(["b", "h", "q", "x", "d"])
SIZES = st.one_of(st.sampled_from([1, 16, 64, 128, 4096]), st.sampled_from(["g", "t"]))
PARTITION_LIST = st.tuples(KINDS, st.lists(st.tuples(AXES, SIZES), min_size=1, max_size=3))
LINE = st.tuples(st.sampled_from(["smem", "registers", "l2"]), st.sampled_from([None, ("O",), ("S", "P")]),
                 st.lists(PARTITION_LIST, min_size=1, max_size=4))


@settings(max_examples=200, deadline=None)
@given(st.lists(LINE, min_size=1, max_size=3))
def test_generated_relabellings_survive_the_round_trip(lines):
    text = "relabel k on H100:\n" + "".join(
        f"    {level}{f' for {chr(44).join(scope)}' if scope else ''}: "
        + "; ".join(f"{kind} " + ", ".join(f"{axis} {size}" for axis, size in items) for kind, items in lists) + "\n"
        for level, scope, lists in lines)
    block = parse_relabel(text, "k", None)
    assert clauses(parse_relabel(_block_text(block, "k"), "k", None)) == clauses(block), text
