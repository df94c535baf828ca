"""backends/numpy.py: what mutation testing found unchecked (benchmarks/mutation.md)."""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends.numpy import execute

INDEX_OVER_SEVEN = """kernel k(X: f64[i]) -> Y: f64[i]:
    Y[i] = X[i] + i / 7
"""


def test_an_f64_statement_computes_with_f64_indices():
    # i / 7 in f32 would be off by about 1e-7 relative; in f64 it is NumPy's own float64 i / 7
    program = napkin.load(INDEX_OVER_SEVEN)["k"].program(None, i=1000)
    outputs, _ = execute(program, {"X": np.zeros(1000)}, {}, None)
    assert outputs["Y"].dtype == np.float64
    assert np.array_equal(outputs["Y"], np.arange(1000, dtype=np.float64) / 7)


def test_the_counted_flops_total_is_the_sum_over_units():
    # one division and one addition per element, both on the FMA pipe: 2 x 1000
    program = napkin.load(INDEX_OVER_SEVEN)["k"].program(None, i=1000)
    _, counts = execute(program, {"X": np.zeros(1000)}, {}, None)
    assert counts.flops == {"fma": 2000}
    assert counts.total_flops == 2000


SPLIT_WITH_AN_EMPTY_ROW = """kernel decode(Q: f32[b kv r d], K: f32[b kv x d], V: f32[b kv x d]) -> O: f32[b kv r d]:
    S[b kv r x] = Q * K * d^-0.5
    P[b kv r x] = softmax[x](where(x < r, S, -inf))
    O[b kv r d] = P * V

relabel decode on H100:
    smem: group b 1, kv 1; split x 300; stream x 64
"""


def test_a_row_every_part_of_a_split_masks_merges_to_zero_weight():
    # query r = 0 sees no key (x < 0 never holds): every part's running max stays -inf, and the
    # merge must weigh each part 0 rather than exp(-inf - -inf) = NaN; the reference gives 0
    from napkin_dsl.backends.numpy import random_arguments, tolerance
    from napkin_dsl.reference import evaluate

    kernel = napkin.load(SPLIT_WITH_AN_EMPTY_ROW)["decode"]
    sizes = dict(b=1, kv=1, r=3, x=1000, d=16)  # 4 parts of 300, the last 100
    program = kernel.program("H100", **sizes)
    arrays, scalars = random_arguments(kernel.diagram, sizes, 0)
    outputs, _ = execute(program, arrays, scalars)
    expected = evaluate(kernel.diagram, arrays, scalars, sizes, None, keep_float64=True)
    assert np.array_equal(outputs["O"][:, :, 0], np.zeros((1, 1, 16)))
    assert np.array_equal(expected["O"][:, :, 0], np.zeros((1, 1, 16)))
    scale = np.max(np.abs(expected["O"]))
    assert np.max(np.abs(outputs["O"] - expected["O"])) <= tolerance(program) * scale


INTEGER_ROW_SUMS = """kernel k(X: i32[a b]) -> Y: i32[a]:
    Y[a] = sum[b](X[a b])

relabel k on three_level:
    l1: group a 4
    l2: group a 2; stream b 8
"""


def test_integer_tiles_run_and_sum_exactly():
    # three levels: Y's tile is allocated at l1 between the two group loops, and saved exactly
    program = napkin.load(INTEGER_ROW_SUMS)["k"].program(None, a=8, b=20)
    x = np.arange(160, dtype=np.int32).reshape(8, 20)
    outputs, _ = execute(program, {"X": x}, {}, None)
    assert outputs["Y"].dtype == np.int32
    assert outputs["Y"].tolist() == [sum(range(20 * row, 20 * row + 20)) for row in range(8)]


MAP_THEN_SUM = """
kernel rows(X: f32[a b]) -> Y: f32[a]:
    S[a b] = exp(X[a b])
    Y[a] = sum[b](S[a b])

relabel rows on two_level:
    l1: group a 8; stream b 16
"""


def test_the_memory_estimate_is_the_whole_arrays_and_twice_the_tiles():
    # whole arrays at l0: X[64 64] and Y[64] in f32; tiles at l1: X and S [8 16], Y.acc and Y [8]
    from napkin_dsl.backends.numpy import estimate_bytes

    program = napkin.load(MAP_THEN_SUM)["rows"].program(a=64, b=64)
    whole = (64 * 64 + 64) * 4
    tiles = (8 * 16 + 8 * 16 + 8 + 8) * 4
    assert estimate_bytes(program, tiles=False) == whole
    assert estimate_bytes(program, tiles=True) == whole + 2 * tiles


DEFAULTS = """
kernel rows(X: f32[a b c]) -> Y: f32[a c]:
    Y[a c] = sum[b](X[a b c])

relabel rows on two_level:
    l1: group a 8, c g_c; stream b 1
"""


def test_default_check_sizes_follow_the_documented_rule():
    # a partitioned by 8: 8 + 8 // 2 + 3 = 15 (two tiles, the second a tail of 7); b by 1: 2;
    # c only by a symbol: 64; the symbol g_c: 16; a given size wins
    from napkin_dsl.backends.numpy import default_sizes

    kernel = napkin.load(DEFAULTS)["rows"]
    assert default_sizes(kernel) == {"a": 15, "b": 2, "c": 64, "g_c": 16}
    assert default_sizes(kernel, {"a": 5}) == {"a": 5, "b": 2, "c": 64, "g_c": 16}


SOFTMAX_TO_BF16 = """kernel sm(S: f32[q x]) -> P: bf16[q x]:
    P[q x] = softmax[x](S)
"""

ROW_SUM_TO_BF16 = """kernel rs(X: f32[a b]) -> Y: bf16[a]:
    Y[a] = sum[b](X[a b])
"""


def test_the_tolerance_of_an_f32_computation_rounded_to_bf16():
    # computed in f32: max(the f32 floor 1e-5, 2 u_f32 sqrt(n) = 2^-23 x 8 for the sum over 64)
    # plus one rounding of the output to bf16, 2 u_bf16 = 2^-7, reaching no exponential (x 1)
    from napkin_dsl.backends.numpy import tolerance

    expected = max(1e-5, 2 * 2.0**-24 * 8) + 2 * 2.0**-8
    assert tolerance(napkin.load(SOFTMAX_TO_BF16)["sm"].program(None, q=8, x=16)) == pytest.approx(expected, rel=1e-12)
    assert tolerance(napkin.load(ROW_SUM_TO_BF16)["rs"].program(None, a=8, b=64)) == pytest.approx(expected, rel=1e-12)


def test_check_run_reports_the_error_relative_to_the_largest_reference_value():
    from napkin_dsl.backends.numpy import check_run, random_arguments
    from napkin_dsl.reference import evaluate

    kernel = napkin.load(ROW_SUM_TO_BF16.replace("bf16", "f32"))["rs"]
    sizes = {"a": 8, "b": 64}
    result = check_run(kernel, None, sizes)
    arrays, scalars = random_arguments(kernel.diagram, sizes, 0)  # check_run's default seed
    scale = float(np.max(np.abs(evaluate(kernel.diagram, arrays, scalars, sizes, None, keep_float64=True)["Y"])))
    assert scale > 1.0  # a sum of 64 unit-normal values: about 8
    assert result["max_abs_error"] > 0  # f32 sums of f32 values differ from the f64 reference
    assert result["max_rel_error"] == pytest.approx(result["max_abs_error"] / scale, rel=1e-12)


ANOTHER_WHERE_IN_A_MASKED_STREAM = """kernel ca(Q: f32[b h q d], K: f32[b h x d], V: f32[b h x d]) -> O: f32[b h q d]:
    S[b h q x] = Q[b h q d] * K[b h x d] * d^-0.5
    P[b h q x] = softmax[x](where(q >= x, S, -inf))
    W[b h x d] = where(x >= 2, V, 0)
    O[b h q d] = P[b h q x] * W[b h x d]

relabel ca on H100:
    smem: group b 1, h 1, q 64; stream x 64
"""


def test_only_the_masks_own_test_is_skipped_on_chunks_it_holds_in_full():
    # The causal mask holds chunk x in [0, 64) in full for the query groups from 64 on, where the
    # softmax skips its test; W's where(x >= 2, ...) is no mask's and must still zero V's rows 0 and 1
    from napkin_dsl.backends.numpy import check_run

    result = check_run(napkin.load(ANOTHER_WHERE_IN_A_MASKED_STREAM)["ca"], "H100", dict(b=1, h=1, q=200, x=200, d=16))
    assert result["ok"], result
    assert result["max_rel_error"] <= result["tolerance"]


def test_the_tolerance_of_a_long_f64_sum_is_its_arithmetic_above_the_floor():
    # f64 throughout, nothing rounded: 2 u_f64 sqrt(n) over n = 10^8 terms, 2^-52 x 10^4, is above
    # the f64 floor of 1e-12 (tolerance reads sizes only: nothing of this size is allocated)
    from napkin_dsl.backends.numpy import tolerance

    program = napkin.load(ROW_SUM_TO_BF16.replace("bf16", "f64").replace("f32", "f64"))["rs"].program(None, a=2, b=10**8)
    expected = 2 * 2.0**-53 * 10**4
    assert expected > 1e-12
    assert tolerance(program) == pytest.approx(expected, rel=1e-12)


SUM_THEN_EXP = """kernel se(X: f64[a b]) -> Z: f64[a]:
    Y[a] = sum[b](X[a b])
    Z[a] = exp(Y[a])
"""


def test_an_exponential_amplifies_the_error_of_the_sum_it_reads():
    # Y sums 10^8 unit-normal terms: |Y| ~ 10^4, and exp turns Y's absolute error into Z's relative
    # error, so Y's 2 u sqrt(n) counts 10^4 times; Z's own exp adds 2 u (no reduction, nothing after)
    from napkin_dsl.backends.numpy import tolerance

    program = napkin.load(SUM_THEN_EXP)["se"].program(None, a=2, b=10**8)
    u = 2.0**-53
    assert tolerance(program) == pytest.approx(2 * u * 10**4 * 10**4 + 2 * u, rel=1e-12)


SOFTMAX_SUM_EXP = """kernel sse(X: f64[a b]) -> Z: f64[a]:
    P[a b] = softmax[b](X[a b])
    T[a] = sum[b](P[a b])
    Z[a] = exp(T[a])
"""

SUM_THEN_DOUBLE = """kernel sd(X: f64[a b]) -> Z: f64[a]:
    Y[a] = sum[b](X[a b])
    Z[a] = Y[a] * 2
"""


def test_a_softmax_is_of_magnitude_one_and_a_value_reaching_no_exponential_is_not_amplified():
    from napkin_dsl.backends.numpy import tolerance

    u, n = 2.0**-53, 10**8
    # P = softmax is at most 1; T sums n of them, |T| ~ sqrt(n) = 10^4, and exp(T) amplifies T's
    # error 10^4 times and P's through T. The softmax reduces over b (its sum of n exponentials),
    # as T does: 2u sqrt(n) 10^4 (P) + 2u sqrt(n) 10^4 (T) + 2u (Z)
    program = napkin.load(SOFTMAX_SUM_EXP)["sse"].program(None, a=2, b=n)
    assert tolerance(program) == pytest.approx(2 * u * (10**4 * 10**4 * 2 + 1), rel=1e-12)
    # without an exponential after it the sum's error counts once: 2u sqrt(n) + 2u (the product)
    program = napkin.load(SUM_THEN_DOUBLE)["sd"].program(None, a=2, b=n)
    assert tolerance(program) == pytest.approx(2 * u * 10**4 + 2 * u, rel=1e-12)
