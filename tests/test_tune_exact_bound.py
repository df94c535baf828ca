"""The tuner's answer is the best exact time of the candidates it searches, or says how far it can be.

The estimate a candidate is ranked by is a lower bound of its exact time (``cost_of(plan(...))``,
tests/test_tune_masked_bound.py) but leaves out fixed costs and the unequal work of masked blocks,
so the exact ranking differs. ``tune`` costs candidates exactly in order of a lower bound of the
whole Program's time until the best exact time is no greater than the next bound, or a cap is
reached; ``TuneResult.optimality`` then reports the gap. These tests cost the candidates the
search scored exactly and check that no candidate beats the best by more than the gap reported.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import napkin_dsl as napkin
import napkin_dsl.tune as tuning
from napkin_dsl.cost import cost_of
from napkin_dsl.errors import RelabelError
from napkin_dsl.hardware import load_hardware
from napkin_dsl.plan import plan
from napkin_dsl.tune import Knob, _block, _Search, tune

from .conftest import EXAMPLES

H100 = load_hardware("H100")
SWIGLU_SIZES = dict(t=512, m=1024, f=2816, e=1024)


def exact_time(diagram, picks, sizes):
    """The exact time of one combination of ranked candidates (one per launch scope), or None."""
    knobs = [k for _, _, pick_knobs, _ in picks for k in pick_knobs]
    values = {k: v for _, _, pick_knobs, combo in picks for k, v in zip(pick_knobs, combo, strict=True)}
    try:
        return cost_of(plan(diagram, H100, _block(diagram, H100, knobs, values), sizes)).time["overlapped_s"]
    except RelabelError:
        return None  # over a level once its buffers are laid out: not a candidate


def assert_honest(result, times):
    """No exact time beats the best by more than the gap: with the bound closed, none beats it."""
    optimality = getattr(result, "optimality", None)  # a result that claims nothing claims the optimum
    gap = optimality.gap if optimality is not None else 0.0
    floor = result.best.time_s / (1 + gap)
    faster = [t for t in times if t < floor * (1 - 1e-12)]
    assert not faster, (f"{len(faster)} candidates faster than {floor:.4g} s (best {result.best.time_s:.4g} s, "
                        f"gap {gap:.3g}): {sorted(faster)[:3]}")
    assert optimality is not None and optimality.gap >= 0
    assert optimality.closed == (optimality.gap == 0)


def causal():
    return napkin.load(EXAMPLES / "causal_attention.napkin")["causal_attention"].diagram


def test_causal_attention_best_is_the_exact_optimum_of_the_candidates_scored():
    # b=1 h=16: a few blocks per SM, so fixed costs and the masked blocks' unequal work decide
    # the exact ranking (the old tuner returned 5.5 us where a candidate it scored costs 4.6).
    diagram, sizes = causal(), dict(b=1, h=16, q=256, x=256, d=128)
    result = tune(diagram, H100, None, sizes, fusion=False)
    (searched,) = result.best.searched
    times = [t for item in searched if (t := exact_time(diagram, [item], sizes)) is not None]
    assert len(times) >= 50
    assert_honest(result, times)
    if result.optimality.closed:
        assert result.best.time_s == pytest.approx(min(times), rel=1e-12)


def test_the_lower_bound_of_a_combination_is_below_its_exact_time():
    """Branch and bound is sound only while no bound exceeds the exact time: fixed costs
    included, and with several launches, whose per-launch bounds do not add up to one."""
    cases = [(causal(), dict(b=1, h=16, q=1000, x=1000, d=128))]
    swiglu = napkin.load(EXAMPLES / "swiglu.napkin")["swiglu"]
    cases.append((swiglu.diagram, SWIGLU_SIZES))
    for diagram, sizes in cases:
        search = _Search(H100, sizes, 20000)
        ranked = search.ranked(diagram, None)
        space = search.space(diagram, ranked, "tuned")
        rng = random.Random(0)
        ranks = [tuple(rng.randrange(min(len(s), 60)) for s in ranked) for _ in range(25)]
        for rank in ranks:
            exact = exact_time(diagram, [s[r] for s, r in zip(ranked, rank, strict=True)], sizes)
            if exact is None:
                continue
            assert search.floor(space, rank) <= search.bound(space, rank) <= exact * (1 + 1e-9), (rank, exact)
            refined, _ = search.refined(space, rank, search.bound(space, rank))
            assert refined <= exact * (1 + 1e-9), (rank, refined, exact)


def fused_swiglu():
    """The issue's SwiGLU written fused: no @gmem and no relabel block."""
    source = (EXAMPLES / "swiglu.napkin").read_text()
    source = source.replace("H[t f] @gmem =", "H[t f] =")
    return napkin.load(source[:source.index("relabel swiglu")])["swiglu"]


def test_swiglu_best_is_no_slower_than_a_candidate_beyond_its_gap():
    kernel = fused_swiglu()
    result = kernel.tune("H100", **SWIGLU_SIZES)
    # The colleague's configuration: H at gmem, 128-wide f tiles in the dual GEMM (the old tuner
    # returned a 28.2 us one). Costed exactly here, not taken from the tuner.
    source = kernel.source.replace("H[t f] =", "H[t f] @gmem =") + (
        "\nrelabel swiglu on H100:\n    smem for G, U, H: group t 96, f 128; stream m 64\n"
        "    smem for Y: group t 96, e 64; stream f 64\n")
    times = [napkin.load(source)["swiglu"].cost("H100", **SWIGLU_SIZES).time["overlapped_s"]]
    # And the combinations of the best's search space (H at gmem: two launches) that pair the
    # dual GEMM's first candidate with each of the down projection's first 150 by estimate: the
    # fastest of them ranks far down by estimate, where a search by estimate never looks.
    best = result.best
    assert len(best.searched) == 2
    first, second = best.searched
    for item in second[:150]:
        exact = exact_time(best.diagram, [first[0], item], SWIGLU_SIZES)
        if exact is not None:
            times.append(exact)
    assert len(times) >= 100
    assert_honest(result, times)


def test_the_gap_is_zero_exactly_when_the_bound_closed(monkeypatch):
    assert tuning.Optimality(1.0, 2.0, 3, 10).gap == 0 and tuning.Optimality(1.0, 1.0, 3, 10).closed
    assert tuning.Optimality(1.0, 0.8, 3, 10).gap == pytest.approx(0.25)
    assert not tuning.Optimality(1.0, 0.8, 3, 10).closed and "within 25%" in tuning.Optimality(1.0, 0.8, 3, 10).text()
    assert "optimal under the model" in tuning.Optimality(1.0, float("inf"), 10, 10).text()
    # A cap of one exact costing cannot close the bound on causal attention: the gap says so.
    monkeypatch.setattr(tuning, "MAX_COSTED", 1)
    diagram, sizes = causal(), dict(b=1, h=16, q=1000, x=1000, d=128)
    capped = tune(diagram, H100, None, sizes, fusion=False)
    assert capped.optimality.costed == 1 and capped.optimality.gap > 0 and not capped.optimality.closed
    assert "within" in capped.table() and capped.to_dict()["optimality"]["gap"] == pytest.approx(capped.optimality.gap)
    assert "within" in repr(capped).splitlines()[0]
    monkeypatch.undo()
    full = tune(diagram, H100, None, sizes, fusion=False)
    assert full.optimality.gap >= 0 and full.best.time_s <= capped.best.time_s
    assert full.optimality.closed == (full.optimality.gap == 0) == (full.best.time_s <= full.optimality.lower)


def test_one_axis_partitioned_at_two_levels_tunes():
    # smem: group q 128 with registers: group q 16: two knobs of q, once one symbol (sympy:
    # "duplicate argument 'tune_group_q'").
    source = Path(EXAMPLES / "attention.napkin").read_text().rstrip() + "\n    registers: group q 16\n"
    kernel = napkin.load(source)["attention"]
    result = kernel.tune("H100", b=1, h=4, q=1024, x=1024, d=128)
    assert result.best.time_s > 0
    smem, registers = Knob("smem", "group", "q"), Knob("registers", "group", "q")
    assert smem.symbol != registers.symbol
    assert Knob("smem", "group", "q", ("O",)).symbol != smem.symbol
