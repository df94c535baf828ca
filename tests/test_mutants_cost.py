"""cost.py against counts derived here, for what mutation testing found unchecked (benchmarks/mutation.md).

Each expected value is worked out in the test from the loop structure (tiles, chunks, the
causal mask's triangle), never read off the model's output.
"""

from __future__ import annotations

import math
import re

import pytest

import napkin_dsl as napkin
from napkin_dsl.cost import (
    block_tiles,
    bookkeeping_flops,
    columns,
    masked_elements,
    masked_wave_efficiency,
)
from napkin_dsl.errors import RelabelError
from napkin_dsl.isel import select_program
from napkin_dsl.pseudocode import walk

from .conftest import EXAMPLES

# causal_attention.napkin: smem: group q 128; stream x 64; here q = x = 300 (ragged: 44 and 44)
Q = X = 300
GQ, SX, D = 128, 64, 64


def causal():
    return napkin.load(EXAMPLES / "causal_attention.napkin")["causal_attention"]


def causal_groups(q=Q, x=X, gq=GQ, sx=SX):
    """Per group of queries: its rows, the chunks of keys it visits, and those the mask holds in full.

    A chunk [x0, x1) is visited when some key in it is <= the group's last query, and held in
    full when every key in it is <= the group's first query."""
    groups = []
    for q0 in range(0, q, gq):
        q1 = min(q0 + gq, q)
        visited = [(x0, min(x0 + sx, x)) for x0 in range(0, x, sx) if x0 <= q1 - 1]
        full = [(x0, x1) for x0, x1 in visited if x1 - 1 <= q0]
        groups.append((q1 - q0, visited, full))
    return groups


def the_mask(program):
    return next(lp.mask for launch in program.launches for _, loops in walk(launch.body) for lp in loops if lp.mask is not None)


def test_the_hand_enumeration_of_the_causal_tiles():
    # the helper itself, on the numbers worked out by hand: 2, 4 and 5 chunks; 0, 2 and 4 full
    assert [(rows, len(v), len(f)) for rows, v, f in causal_groups()] == [(128, 2, 0), (128, 4, 2), (44, 5, 4)]


def test_masked_elements_counts_every_visited_tile_by_default():
    program = causal().program("H100", b=1, h=1, q=Q, x=X, d=D)
    mask = the_mask(program)
    rows_times_chunks = sum(rows * len(visited) for rows, visited, _ in causal_groups())
    rows_times_keys = sum(rows * sum(x1 - x0 for x0, x1 in visited) for rows, visited, _ in causal_groups())
    # without `partial` (the tuner's call): every visited chunk, in full
    assert masked_elements(program, mask, ("b", "h", "q")) == rows_times_chunks == 988
    assert masked_elements(program, mask, ("b", "h", "q", "x")) == rows_times_keys


def test_masked_elements_partial_over_axes_without_the_streamed_axis_counts_chunks_held_in_part():
    program = causal().program("H100", b=1, h=1, q=Q, x=X, d=D)
    mask = the_mask(program)
    in_part = sum(rows * (len(visited) - len(full)) for rows, visited, full in causal_groups())
    assert in_part == 128 * 2 + 128 * 2 + 44 * 1
    assert masked_elements(program, mask, ("b", "h", "q"), partial=True) == in_part


def test_bookkeeping_tests_the_mask_again_only_on_chunks_held_in_part():
    b, h = 2, 3
    program = causal().program("H100", b=b, h=h, q=Q, x=X, d=D)
    groups = causal_groups()
    row_chunks = b * h * sum(rows * len(visited) for rows, visited, _ in groups)
    visited_elements = b * h * sum(rows * sum(x1 - x0 for x0, x1 in visited) for rows, visited, _ in groups)
    # elements of the chunks held in part: rows x keys of each such tile
    tested = b * h * sum(rows * (x1 - x0) for rows, visited, full in groups for x0, x1 in visited if (x0, x1) not in full)
    # The streamed softmax's own work, per the Program's steps (docs/method.md, the online softmax):
    # the running max's rescale (2 FMA + 1 exp per row and chunk), the online step (2 FMA per row and
    # chunk, one FMA fewer per element than the unstreamed form), O.acc rescaled per chunk, O divided
    # once per element; and the mask's test (2 FMA per element) again, on the chunks held in part.
    fma = 2 * row_chunks + (-1 * visited_elements + 2 * row_chunks) + row_chunks * D + b * h * Q * D + 2 * tested
    assert bookkeeping_flops(program) == {"fma": fma, "special": row_chunks}


def slots_efficiency(works: list[int], copies: int, slots: int) -> float:
    """Blocks issued longest first, `slots` at a time, each round as long as its longest block."""
    blocks = sorted((w for w in works for _ in range(copies)), reverse=True)
    rounds = [blocks[i : i + slots] for i in range(0, len(blocks), slots)]
    return sum(blocks) / (slots * sum(r[0] for r in rounds))


@pytest.mark.parametrize("b, slots", [(1, 1), (1, 2), (2, 4), (2, 3), (3, 4), (3, 2)])
def test_masked_wave_efficiency_is_the_work_over_rounds_of_longest_blocks(b, slots):
    program = causal().program("H100", b=b, h=1, q=Q, x=X, d=D)
    works = [len(visited) for _, visited, _ in causal_groups()]  # 2, 4, 5 chunks; b copies of each
    expected = slots_efficiency(works, b, slots)
    assert masked_wave_efficiency(program, slots) == pytest.approx(expected, rel=1e-12)


def test_masked_wave_efficiency_by_hand():
    # b = 2: blocks of 5, 5, 4, 4, 2, 2 chunks; three per round: (5 5 4) (4 2 2) -> 22 / (3 x 9)
    program = causal().program("H100", b=2, h=1, q=Q, x=X, d=D)
    assert masked_wave_efficiency(program, 3) == pytest.approx(22 / 27)


def test_a_launch_without_a_mask_has_no_masked_wave_efficiency():
    attention = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    assert masked_wave_efficiency(attention.program("H100", b=1, h=1, q=Q, x=X, d=D), 2) is None


def test_streamed_shared_tiles_show_their_stages_and_others_none():
    # attention on H100 runs on tensor cores: K and V stream through stages, Q is loaded once; on
    # sm_90a (the profile's own arch) a producer's TMA fills them, 8 stages deep, a full and an
    # empty mbarrier a stage and one for Q
    attention = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    rows = columns(attention.program("H100", b=1, h=1, q=1024, x=1024, d=64))
    shown = {row["resident"].get("smem") for row in rows}
    assert "K[1 1 64 64] x8 + Q[1 1 128 64] + V[1 1 64 64] x8 + mbarriers 17 x 16 B" in shown
    program = attention.program("H100", b=1, h=1, q=1024, x=1024, d=64)
    on_sm90 = {row["resident"].get("smem") for row in columns(program, select_program(program, "sm_90"))}
    assert "K[1 1 64 64] x2 + Q[1 1 128 64] + V[1 1 64 64] x2" in on_sm90  # cp.async: no mbarriers
    assert not any("x1" in text for text in shown if text)


def test_table_prints_each_levels_transfer_time_in_readable_units():
    attention = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    report = attention.cost("H100", b=1, h=1, q=1024, x=1024, d=64)
    lines = report.table().splitlines()
    for name, level in report.levels.items():
        seconds = float(level.H_bytes) / float(level.bandwidth)
        assert seconds < 1e-3  # microseconds at these sizes
        row = next(line for line in lines if line.split()[0] == name)
        assert row.endswith(f"{seconds * 1e6:.3g} us"), row


def test_block_tiles_are_one_tile_of_each_array_loaded_first_and_saved_last():
    attention = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    program = attention.program("H100", b=1, h=1, q=1024, x=1024, d=64)
    bf16 = 2
    first = (128 * 64 + 64 * 64 + 64 * 64) * bf16  # Q's group tile, the first chunk of K and of V
    last = 128 * 64 * bf16  # O's group tile
    assert block_tiles(program, program.launches[0]) == (first, last)


def test_block_tiles_count_nothing_when_a_tile_size_is_symbolic():
    # d unbound: the tiles have no number of bytes, so the fixed costs charge no fill or drain
    attention = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    program = attention.program("H100", b=1, h=1, q=1024, x=1024)
    assert block_tiles(program, program.launches[0]) == (0, 0)


MATMUL_WHOLE_B = """
kernel mm(A: f32[a b], B: f32[b c]) -> C: f32[a c]:
    C[a c] = A[a b] * B[b c]

relabel mm on H100:
    smem: group a 64
"""

ROW_SUM = """
kernel rows(A: f32[a b]) -> S: f32[a]:
    S[a] = sum[b](A[a b])

relabel rows on H100:
    smem: group a 64
"""


def test_capacity_hint_names_the_largest_unpartitioned_buffer():
    kernel = napkin.load(MATMUL_WHOLE_B)["mm"]
    with pytest.raises(RelabelError) as caught:
        kernel.cost("H100", a=1024, b=1024, c=1024)
    # B[1024 1024] f32 (4 MiB) is the largest buffer at smem, and group a does not split it
    assert caught.value.hint is not None
    assert "the largest buffer, B, is not partitioned along b or c at smem" in caught.value.hint


@pytest.mark.parametrize("b, group", [(100_000, 1), (8192, 4), (2048, 16)])
def test_capacity_hint_suggests_the_largest_power_of_two_that_fits(b, group):
    # smem holds A's tile of 64 rows of b f32 (and S's 64 values), over the capacity: the hint
    # scales `group a 64` by capacity / used and rounds down to a power of two, at least 1
    kernel = napkin.load(ROW_SUM)["rows"]
    capacity = 232_448  # H100's shared memory per block (hardware/H100.toml)
    used = 64 * b * 4 + 64 * 4
    fits = 64 * capacity / used
    expected = max(1, 2 ** math.floor(math.log2(max(fits, 1))))
    assert expected == group
    with pytest.raises(RelabelError) as caught:
        kernel.cost("H100", a=1024, b=b)
    assert re.search(rf"try 'group a {group}'", caught.value.hint or ""), caught.value.hint


HOISTED_READER = """
kernel k(X: f32[a b], W: f32[a]) -> Y: f32[a]:
    S[a b] = X[a b] * W[a]
    T[a] = exp(W[a])
    U[a] = sum[b](S[a b])
    Y[a] = U[a] * T[a]

relabel k on two_level:
    l1: group a 8; stream b 16
"""


def test_a_load_belongs_to_the_next_statement_that_reads_it_in_program_order():
    # T carries no b, so it runs before the stream loop over b, and the load of W before it is
    # T's, though S comes first in the diagram: S owns X's load (a x b values), T owns W's (a),
    # Y its save (a), U (accumulated on chip) nothing.
    from napkin_dsl.cost import statement_columns

    a, b = 64, 64
    program = napkin.load(HOISTED_READER)["k"].program(a=a, b=b)
    moved = {c["label"]: c["H"]["l1"] for c in statement_columns(program)}
    assert moved == {"S": a * b, "T": a, "U": 0, "Y": a}
