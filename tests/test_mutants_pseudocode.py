"""pseudocode.py: what mutation testing found unchecked (benchmarks/mutation.md)."""

from __future__ import annotations

import pytest

import napkin_dsl as napkin

MAP_THEN_SUM = """
kernel rows(X: f32[a b]) -> Y: f32[a]:
    S[a b] = exp(X[a b])
    Y[a] = sum[b](S[a b])

relabel rows on two_level:
    l1: group a 8; stream b 16
"""


def test_a_loops_repr_counts_the_steps_nested_in_it():
    # Per group of a: Y.acc = 0, then per chunk of b: load X, S = exp(X), Y.acc += sum S;
    # then Y = Y.acc and save Y. 64 / 8 = 8 groups, 64 / 16 = 4 chunks.
    program = napkin.load(MAP_THEN_SUM)["rows"].program(a=64, b=64)
    (group,) = program.launches[0].body
    assert repr(group) == "<Loop group a at l1: tile 8, 8 trips; 6 steps inside>"
    (stream,) = [item for item in group.body if type(item) is type(group)]
    assert repr(stream) == "<Loop stream b at l1: tile 16, 4 trips; 3 steps inside>"


def masked_attention(condition: str, chained: bool = False) -> str:
    """Attention with a where-mask on the scores, written inline or as its own statement M."""
    if chained:
        body = (f"    M[b h q x] = where({condition}, S, -inf)\n"
                "    P[b h q x] = softmax[x](M)\n")
    else:
        body = f"    P[b h q x] = softmax[x](where({condition}, S, -inf))\n"
    return ("kernel ca(Q: f32[b h q d], K: f32[b h x d], V: f32[b h x d]) -> O: f32[b h q d]:\n"
            "    S[b h q x] = Q[b h q d] * K[b h x d] * d^-0.5\n" + body +
            "    O[b h q d] = P[b h q x] * V[b h x d]\n\n"
            "relabel ca on H100:\n"
            "    smem: group b 1, h 1, q 64; stream x 64\n")


def the_mask(program):
    from napkin_dsl.pseudocode import walk

    masks = [lp.mask for launch in program.launches for _, loops in walk(launch.body) for lp in loops if lp.mask is not None]
    return masks[0] if masks else None


def brute_force_visits(keep, q: int, x: int, gq: int = 64, sx: int = 64):
    """Per group of queries: (chunks with some kept element, chunks with every element kept)."""
    out = []
    for q0 in range(0, q, gq):
        rows = range(q0, min(q0 + gq, q))
        visited = full = 0
        for x0 in range(0, x, sx):
            cells = [keep(i, j) for i in rows for j in range(x0, min(x0 + sx, x))]
            visited += any(cells)
            full += all(cells)
        out.append((visited, full))
    return out


def visits(source: str, q: int, x: int = 128):
    from napkin_dsl.pseudocode import mask_visits

    program = napkin.load(source)["ca"].program("H100", b=1, h=1, q=q, x=x, d=16)
    mask = the_mask(program)
    return mask, [(g.visited, g.full) for g in mask_visits(mask, lambda a: program.schedule.axis_size(a))]


@pytest.mark.parametrize("q", [65, 66, 127, 128, 130])
@pytest.mark.parametrize("condition, keep", [("q > x", lambda i, j: i > j), ("q >= x", lambda i, j: i >= j),
                                             ("q >= x + 1", lambda i, j: i >= j + 1), ("q > x + 1", lambda i, j: i > j + 1)])
def test_mask_tiles_are_masked_partial_or_full_as_their_elements_say(condition, keep, q):
    # q = 65: the last group is the single query 64, whose chunk [64, 128) has q - x <= 0 throughout:
    # masked under q > x, held in part under q >= x. q = 66: the group [64, 66) holds the bound exactly.
    mask, got = visits(masked_attention(condition), q)
    assert got == brute_force_visits(keep, q, 128)
    # Mask.status, which the NumPy backend's masked loop asks per chunk, says the same per tile
    constants = mask.constants(lambda a: {"q": q, "x": 128, "b": 1, "h": 1, "d": 16}[a])
    for q0 in range(0, q, 64):
        for x0 in range(0, 128, 64):
            rows, keys = range(q0, min(q0 + 64, q)), range(x0, x0 + 64)
            cells = [keep(i, j) for i in rows for j in keys]
            expected = "full" if all(cells) else "partial" if any(cells) else "masked"
            assert mask.status({"q": (rows.start, rows.stop), "x": (keys.start, keys.stop)}, constants) == expected, (q0, x0)


def test_a_mask_in_its_own_statement_masks_the_stream_too():
    mask, got = visits(masked_attention("q >= x", chained=True), 130)
    assert mask is not None and mask.tested == "M"
    assert got == brute_force_visits(lambda i, j: i >= j, 130, 128) == [(1, 0), (2, 1), (2, 2)]


def test_a_division_by_a_number_in_a_mask_is_linear():
    mask, got = visits(masked_attention("q >= x / 1"), 130)
    assert [(c.coefficients, c.constant, c.strict) for c in mask.constraints] == [((("q", 1), ("x", -1)), 0, False)]
    assert got == brute_force_visits(lambda i, j: i >= j, 130, 128)


def test_a_division_by_a_size_leaves_the_stream_unmasked():
    # x / len(x) has a coefficient that is not an integer: not decided per tile, every chunk visited
    program = napkin.load(masked_attention("q >= x / len(x)"))["ca"].program("H100", b=1, h=1, q=130, x=128, d=16)
    assert the_mask(program) is None


@pytest.mark.parametrize("first, stop, tile, length, span", [
    (0, 2, 64, 300, 128), (4, 5, 64, 300, 44), (1, 5, 64, 300, 236), (2, 2, 64, 300, 0), (3, 1, 64, 300, 0), (0, 1, 64, 10, 10)])
def test_chunk_span_counts_the_elements_of_chunks_first_to_stop(first, stop, tile, length, span):
    from napkin_dsl.pseudocode import chunk_span

    assert chunk_span(first, stop, tile, length) == span == len(range(first * tile, min(stop * tile, length)))


@pytest.mark.parametrize("condition", ["not (q < x)", "q >= x or q < 5"])
def test_a_condition_that_is_not_a_conjunction_of_comparisons_leaves_the_stream_unmasked(condition):
    # napkin decides per tile only conjunctions of linear comparisons; `not` and `or` are tested
    # on every element of every chunk, so the stream visits every chunk
    program = napkin.load(masked_attention(condition))["ca"].program("H100", b=1, h=1, q=130, x=128, d=16)
    assert the_mask(program) is None
