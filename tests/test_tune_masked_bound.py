"""The tuner's fast estimate is a lower bound of the exact model, masks included.

``_Search._verified`` prunes by branch and bound on the estimate: a candidate whose estimate is no
lower than the worst of the best it verified is set aside unchecked, which is sound only while no
estimate exceeds the exact predicted time (``cost_of(plan(...))``). The exact model skips the
chunks a causal mask hides; the estimate, elaborated with symbolic tiles, cannot enumerate them
and counts the unmasked share of the elements instead. These tests cost every candidate the search
scores exactly (or a random sample of them, to keep the file quick) and compare.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.cost import cost_of, instruction_path
from napkin_dsl.errors import RelabelError
from napkin_dsl.hardware import load_hardware
from napkin_dsl.plan import plan
from napkin_dsl.pseudocode import elaborate
from napkin_dsl.relabel import make_schedule
from napkin_dsl.tune import VERIFIED, _block, _score, _unmasked_count, _unmasked_elements, knob_sets, tune

from .conftest import EXAMPLES

HEADER = "kernel {name}(Q: {t}[b h q d], K: {t}[b h x d], V: {t}[b h x d]) -> O: {t}[b h q d]:\n"
BODY = """    S[b h q x] = Q[b h q d] * K[b h x d] * d^-0.5
    P[b h q x] = {softmax}
    O[b h q d] = P[b h q x] * V[b h x d]
"""
MASKS = {  # as in tests/test_masks.py, and one that hides nothing
    "causal": "q >= x",
    "window": "q >= x and q - x < 5",
    "decode": "q + (len(x) - len(q)) >= x",
    "none hidden": "q + len(x) >= x",
}


def attention(mask: str | None, dtype: str = "bf16"):
    softmax = f"softmax[x](where({MASKS[mask]}, S, -inf))" if mask is not None else "softmax[x](S)"
    (kernel,) = napkin.load(HEADER.format(name="k", t=dtype) + BODY.format(softmax=softmax)).values()
    return kernel


def example(name: str):
    return napkin.load(EXAMPLES / f"{name}.napkin")[name]


def visible(mask: str, q: int, x: int) -> np.ndarray:
    """The mask by hand (NumPy, not napkin): which keys each query sees."""
    rows, cols = np.arange(q)[:, None], np.arange(x)[None, :]
    return {"causal": rows >= cols, "window": (rows >= cols) & (rows - cols < 5),
            "decode": rows + (x - q) >= cols, "none hidden": rows + x >= cols}[mask]


def symbolic_program(diagram, profile, sizes):
    """The Program the search elaborates for the first knob set: partition sizes symbolic."""
    knobs = knob_sets(diagram, profile, None, sizes)[0]
    return elaborate(make_schedule(diagram, profile, _block(diagram, profile, knobs, {}), sizes))


def scored_against_exact(diagram, profile, sizes, sample: int | None = None, seed: int = 0):
    """(estimate, exact time) of the candidates the search scores, each estimate priced on the
    path instruction selection takes with its numeric tiles, as _Search._verified re-prices it."""
    pairs = []
    for knobs in knob_sets(diagram, profile, None, sizes):
        scored, _, _, estimate = _score(diagram, profile, knobs, sizes, 20000)
        if sample is not None and len(scored) > sample:
            scored = random.Random(seed).sample(scored, sample)
        for value, combo in scored:
            try:
                program = plan(diagram, profile, _block(diagram, profile, knobs, dict(zip(knobs, combo, strict=True))), sizes)
                exact = cost_of(program).time["overlapped_s"]
            except RelabelError:
                continue  # over a level's capacity once the plan lays out its buffers: never a candidate
            on_fma = frozenset(launch.index for launch in program.launches if instruction_path(program, launch) == "fma")
            pairs.append((estimate(combo, on_fma) if on_fma else value, exact, combo))
    return pairs


# ---- the estimate against the exact model --------------------------------------------------------


@pytest.mark.parametrize("name, sizes, sample", [
    ("causal_attention", dict(b=1, h=16, q=256, x=256, d=128), 60),  # short: tiles up to the whole axis, few masked
    ("causal_attention", dict(b=1, h=8, q=1000, x=1000, d=128), 60),  # tiles that do not divide the sequence
    ("causal_attention", dict(b=2, h=8, q=8192, x=8192, d=128), 30),  # long: most tiles masked
    ("causal_attention", dict(b=1, h=4, q=300, x=700, d=128), 40),  # more keys than queries: a band of x never visited
    ("sliding_window", dict(b=1, h=16, q=2048, x=2048, d=128), 30),
], ids=["causal-256", "causal-1000", "causal-8192", "causal-300x700", "window-2048"])
def test_estimate_is_a_lower_bound_of_the_exact_time_with_a_mask(name, sizes, sample):
    pairs = scored_against_exact(example(name).diagram, load_hardware("H100"), sizes, sample)
    assert len(pairs) >= 10
    over = [(combo, value, exact) for value, exact, combo in pairs if value > exact * (1 + 1e-9)]
    assert not over, f"{len(over)} of {len(pairs)} estimates above the exact time, e.g. {over[:3]}"


@pytest.mark.parametrize("mask", ["causal", "window", "decode"])
def test_estimate_is_a_lower_bound_on_the_fma_path_and_with_fully_masked_rows(mask):
    # f32 keeps the contractions on the FMA path whatever the tiles, so only the mask's count
    # separates the estimate from the exact time; the decode offset x - q = -256 masks whole
    # rows (query groups that visit no chunk at all).
    sizes = dict(b=1, h=8, q=1280 if mask == "decode" else 1024, x=1024, d=32)
    pairs = scored_against_exact(attention(mask, "f32").diagram, load_hardware("H100"), sizes, sample=30)
    assert pairs
    assert all(value <= exact * (1 + 1e-9) for value, exact, _ in pairs), [p for p in pairs if p[0] > p[1]][:3]


def test_unmasked_attention_estimate_is_a_lower_bound():
    # Its P (f32) is a register fragment the tensor cores take converted, as the exact model
    # prices it: the launch is not on the FMA path for its dtype.
    pairs = scored_against_exact(example("attention").diagram, load_hardware("H100"), dict(b=1, h=16, q=1024, x=1024, d=128), 40)
    assert all(value <= exact * (1 + 1e-9) for value, exact, _ in pairs)


# ---- branch and bound --------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [dict(b=1, h=16, q=512, x=512, d=128), dict(b=1, h=16, q=4096, x=4096, d=128)],
                         ids=["512", "4096"])
def test_branch_and_bound_sets_aside_no_candidate_faster_than_its_bound(sizes):
    """The search checks candidates best estimate first and stops once VERIFIED of them stand
    whose worst estimate is no higher than the next one's: every candidate after the first
    VERIFIED is then at least that bound in estimate, and must be at least that in exact time."""
    diagram, profile = example("causal_attention").diagram, load_hardware("H100")
    result = tune(diagram, profile, None, sizes, fusion=False)
    (searched,) = result.best.searched
    bound = searched[VERIFIED - 1][0]
    set_aside = []
    later = [item for item in searched[VERIFIED:] if item[0] >= bound]  # under the bound: checked, not set aside
    for _, _, knobs, combo in random.Random(1).sample(later, min(40, len(later))):
        try:
            exact = cost_of(plan(diagram, profile, _block(diagram, profile, knobs, dict(zip(knobs, combo, strict=True))),
                                 sizes)).time["overlapped_s"]
        except RelabelError:
            continue
        set_aside.append((exact, combo))
    assert set_aside
    faster = [(combo, exact) for exact, combo in set_aside if exact < bound]
    assert not faster, f"set aside with an exact time under the bound {bound:.4g} s: {faster[:5]}"


# ---- the unmasked share ------------------------------------------------------------------------------


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_unmasked_count_is_the_masks_by_hand(mask):
    sizes = dict(b=1, h=2, q=37, x=53, d=8)
    program = symbolic_program(attention(mask).diagram, load_hardware("H100"), sizes)
    (counted,) = _unmasked_elements(program).values()
    assert counted == int(visible(mask, sizes["q"], sizes["x"]).sum())


def test_unmasked_count_past_the_probe_stays_a_close_lower_bound():
    sizes = dict(b=1, h=1, q=10000, x=10000, d=64)  # more query rows than the probe enumerates one by one
    program = symbolic_program(attention("causal").diagram, load_hardware("H100"), sizes)
    (mask,) = _unmasked_elements(program)
    counted = _unmasked_count(program, mask)
    exact = 10000 * 10001 // 2
    assert 0.99 * exact <= counted <= exact


@pytest.mark.parametrize("name", ["attention", "matmul", "mlp"])
def test_unmasked_kernels_take_no_masked_path(name):
    kernel = example(name)
    sizes = {a: 512 for a in kernel.diagram.axes}
    assert _unmasked_elements(symbolic_program(kernel.diagram, load_hardware("H100"), sizes)) == {}


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_a_mask_that_hides_nothing_estimates_as_no_mask(dtype):
    """Its unmasked share is exactly 1: the bound is the plain count, candidate for candidate
    (b = h = 1 keeps every candidate within one round of blocks, where the masked and the
    unmasked busy fractions agree)."""
    sizes = dict(b=1, h=1, q=1024, x=1024, d=64)
    profile = load_hardware("H100")
    compared = 0
    masked, plain = attention("none hidden", dtype).diagram, attention(None, dtype).diagram
    (counted,) = _unmasked_elements(symbolic_program(masked, profile, sizes)).values()
    assert counted == sizes["q"] * sizes["x"]
    for masked_knobs, plain_knobs in zip(knob_sets(masked, profile, None, sizes), knob_sets(plain, profile, None, sizes), strict=True):
        if not any(k.kind == "stream" for k in masked_knobs):
            continue  # no stream, no Mask: the where is computed on every element, work the plain kernel does not do
        found, _, _, masked_estimate = _score(masked, profile, masked_knobs, sizes, 20000)
        expected, _, _, plain_estimate = _score(plain, profile, plain_knobs, sizes, 20000)
        assert [combo for _, combo in sorted(found, key=lambda t: t[1])] == [combo for _, combo in sorted(expected, key=lambda t: t[1])]
        for _, combo in expected:
            assert masked_estimate(combo) == pytest.approx(plain_estimate(combo), rel=1e-12)
            assert masked_estimate(combo, frozenset({0})) == pytest.approx(plain_estimate(combo, frozenset({0})), rel=1e-12)
            compared += 1
    assert compared >= 20
