"""The named steps of the tuner's fast estimate (tune._score), one at a time.

Each legality step returns its reason for a bad case and None for a good one, so that a caller
can say why (as Exo's checks do); the pricing steps give what _score compiles.
"""

from __future__ import annotations

import pytest

import napkin_dsl as napkin
from napkin_dsl.hardware import load_hardware
from napkin_dsl.tune import (
    _compulsory_seconds,
    _compulsory_skip_reason,
    _fma_only_reason,
    _memory_exprs,
    _score,
    _symbolic_program,
    knob_sets,
)

MATMUL = "kernel mm(A: {t}[m k], B: {t}[k n]) -> C: f32[m n]:\n    C[m n] = A[m k] * B[k n]\n"
ATTENTION = """kernel att(Q: bf16[b h q d], K: bf16[b h x d], V: bf16[b h x d]) -> O: bf16[b h q d]:
    S[b h q x] = Q[b h q d] * K[b h x d] * d^-0.5
    P[b h q x] = softmax[x]({scores})
    O[b h q d] = P[b h q x] * V[b h x d]
"""
MM_SIZES = dict(m=512, n=512, k=512)
ATT_SIZES = dict(b=1, h=2, q=256, x=256, d=64)


def diagram_of(text: str):
    (kernel,) = napkin.load(text).values()
    return kernel.diagram


def symbolic(diagram, sizes, profile):
    knobs = knob_sets(diagram, profile, None, sizes)[0]
    return knobs, *_symbolic_program(diagram, profile, knobs, sizes, None)


@pytest.fixture(scope="module")
def h100():
    return load_hardware("H100")


def test_fma_only_reason_names_an_operand_tensor_cores_do_not_take(h100):
    f32 = diagram_of(MATMUL.format(t="f32"))
    _, schedule, program = symbolic(f32, MM_SIZES, h100)
    (launch,) = program.launches
    reason = _fma_only_reason(f32, launch, schedule.compute_level, h100)
    assert reason is not None and "operand A is f32" in reason and "bf16, f16" in reason
    bf16 = diagram_of(MATMUL.format(t="bf16"))
    _, schedule, program = symbolic(bf16, MM_SIZES, h100)
    assert _fma_only_reason(bf16, program.launches[0], schedule.compute_level, h100) is None
    # 8-bit operands: tensor cores where the profile's arch has an 8-bit path (wgmma's on sm_90a,
    # mma.sync's on sm_89), the FMA path on A100's sm_80, which has none
    fp8 = diagram_of(MATMUL.format(t="fp8e4m3"))
    for name, taken in (("H100", True), ("L40S", True), ("A100", False)):
        profile = load_hardware(name)
        _, schedule, program = symbolic(fp8, MM_SIZES, profile)
        reason = _fma_only_reason(fp8, program.launches[0], schedule.compute_level, profile)
        assert (reason is None) == taken, (name, reason)


def test_compulsory_skip_reason_leaves_out_masked_launches_only(h100):
    causal = diagram_of(ATTENTION.format(scores="where(q >= x, S, -inf)"))
    _, schedule, program = symbolic(causal, ATT_SIZES, h100)
    assert _compulsory_skip_reason(program.launches[0]) == "a masked loop may skip elements"
    assert _compulsory_seconds(causal, h100, program, schedule.compute_level, ATT_SIZES) == 0.0
    plain = diagram_of(ATTENTION.format(scores="S"))
    _, schedule, program = symbolic(plain, ATT_SIZES, h100)
    assert _compulsory_skip_reason(program.launches[0]) is None
    # Q, K and V read and O written once each, 2 bytes a value, over the link under device memory.
    values = 4 * 1 * 2 * 256 * 64
    expected = values * 2 / h100.levels[1].bandwidth
    assert _compulsory_seconds(plain, h100, program, schedule.compute_level, ATT_SIZES) == pytest.approx(expected)


def test_memory_exprs_constrain_every_bounded_level_but_the_shared_cache(h100):
    from napkin_dsl.cost import columns
    from napkin_dsl.plan import shared_cache_level

    diagram = diagram_of(MATMUL.format(t="bf16"))
    _, schedule, program = symbolic(diagram, MM_SIZES, h100)
    n_levels, exprs, capacity = _memory_exprs(h100, schedule, columns(program))
    shared = shared_cache_level(schedule)
    bounded = [lv for lv in h100.levels[1:] if lv.capacity is not None and lv.name != shared]
    assert n_levels == len(exprs) == len(capacity) == len(bounded) > 0


def test_score_keeps_only_fitting_candidates_best_first(h100):
    diagram = diagram_of(MATMUL.format(t="bf16"))
    knobs = knob_sets(diagram, h100, None, MM_SIZES)[0]
    scored, evaluated, required, estimate = _score(diagram, h100, knobs, MM_SIZES, 20000)
    assert 0 < len(scored) <= evaluated
    assert [s for s, _ in scored] == sorted(s for s, _ in scored)
    assert all(estimate(combo) == s for s, combo in scored[:20])
    assert required["k"] % 16 == 0 and required["m"] % 16 == 0
