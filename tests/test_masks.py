"""Masks (issue 12): axis indices, comparisons and where() in the notation, and their runs.

The reference is checked against masked attention written directly in NumPy (np.tril and
friends, not napkin), then the NumPy and OpenCL backends against the reference, with masked
positions excluded exactly: the check compares whole outputs, and a masked entry that leaked
into a row would move that row's output.
"""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends.cuda import generate
from napkin_dsl.backends.numpy import check_run, execute, random_arguments
from napkin_dsl.cost import cost_of
from napkin_dsl.errors import NapkinError, NapkinErrors, NapkinSyntaxError, NapkinTypeError
from napkin_dsl.pseudocode import walk
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES, assert_matches_reference

# ---- kernels ----------------------------------------------------------------------------------------

HEADER = "kernel {name}(Q: f32[b h q d], K: f32[b h x d], V: f32[b h x d]{extra}) -> O: f32[b h q d]:\n"
BODY = """    S[b h q x] = Q[b h q d] * K[b h x d] * d^-0.5
    P[b h q x] = softmax[x](where({mask}, {logits}, -inf))
    O[b h q d] = P[b h q x] * V[b h x d]
"""
MASKS = {
    "causal": "q >= x",
    "window": "q >= x and q - x < 5",
    "decode": "q + (len(x) - len(q)) >= x",
}


def attention(mask: str, logits: str = "S", extra: str = "", relabel: str = "group b 1, h 1, q 8; stream x 4"):
    text = HEADER.format(name="masked", extra=extra) + BODY.format(mask=MASKS.get(mask, mask), logits=logits)
    text += f"\nrelabel masked on H100:\n    smem: {relabel}\n"
    return napkin.load(text)["masked"]


def inputs(sizes: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    b, h, q, x, d = (sizes[a] for a in "bhqxd")
    return {"Q": rng.standard_normal((b, h, q, d)).astype(np.float32),
            "K": rng.standard_normal((b, h, x, d)).astype(np.float32),
            "V": rng.standard_normal((b, h, x, d)).astype(np.float32)}


def by_hand(arrays: dict, visible: np.ndarray) -> np.ndarray:
    """Masked attention in float64 without napkin: ``visible[q, x]`` says which keys a query sees;
    a query that sees none gets 0 (napkin's convention for a fully masked row)."""
    Q, K, V = (arrays[n].astype(np.float64) for n in "QKV")
    S = np.einsum("bhqd,bhxd->bhqx", Q, K) / np.sqrt(Q.shape[-1])
    S = np.where(visible, S, -np.inf)
    peak = S.max(axis=-1, keepdims=True)
    E = np.where(visible, np.exp(S - np.where(np.isfinite(peak), peak, 0.0)), 0.0)
    total = E.sum(axis=-1, keepdims=True)
    P = np.divide(E, total, out=np.zeros_like(E), where=total > 0)
    return np.einsum("bhqx,bhxd->bhqd", P, V)


def visible(kind: str, q: int, x: int) -> np.ndarray:
    rows, cols = np.arange(q)[:, None], np.arange(x)[None, :]
    return {"causal": rows >= cols, "window": (rows >= cols) & (rows - cols < 5),
            "decode": rows + (x - q) >= cols}[kind]


SIZES = dict(b=1, h=2, q=19, x=23, d=8)


# ---- the reference against masked attention by hand -------------------------------------------------


@pytest.mark.parametrize("kind", sorted(MASKS))
def test_reference_matches_masked_attention_by_hand(kind):
    arrays = inputs(SIZES)
    got = evaluate(attention(kind).diagram, arrays, {}, SIZES, keep_float64=True)["O"]
    np.testing.assert_allclose(got, by_hand(arrays, visible(kind, SIZES["q"], SIZES["x"])), rtol=1e-12, atol=1e-12)


def test_a_fully_masked_row_is_zero_not_nan():
    sizes = dict(b=1, h=1, q=6, x=3, d=4)  # decode offset x - q = -3: the first 3 queries see no key
    arrays = inputs(sizes, seed=3)
    got = evaluate(attention("decode").diagram, arrays, {}, sizes, keep_float64=True)["O"]
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[0, 0, :3], 0.0)
    assert np.abs(got[0, 0, 3:]).min() > 0


def test_alibi_bias_uses_indices_in_arithmetic():
    kernel = attention("causal", logits="S + slope[h] * (x - q)", extra=", slope: f32[h]")
    arrays = inputs(SIZES, seed=5)
    slope = np.array([0.5, 0.25], np.float32)
    got = evaluate(kernel.diagram, {**arrays, "slope": slope}, {}, SIZES, keep_float64=True)["O"]
    # ALiBi by hand: the bias is added to the logits before the mask and the softmax
    Q, K, V = (arrays[n].astype(np.float64) for n in "QKV")
    q, x = np.arange(SIZES["q"])[:, None], np.arange(SIZES["x"])[None, :]
    S = np.einsum("bhqd,bhxd->bhqx", Q, K) / np.sqrt(8) + slope.astype(np.float64)[None, :, None, None] * (x - q)
    S = np.where(q >= x, S, -np.inf)
    P = np.exp(S - S.max(-1, keepdims=True))
    np.testing.assert_allclose(got, np.einsum("bhqx,bhxd->bhqd", P / P.sum(-1, keepdims=True), V), rtol=1e-12)


def test_an_axis_name_is_the_index_in_the_target_and_len_is_the_size():
    kernel = napkin.load("kernel k(X: f64[n], W: f64[m n]) -> Y: f64[n]:\n    Y[n] = X * n + len(n) + m\n")["k"]
    # n is the target's axis: its index; len(n) its size; m is not an axis of Y: its size, as d in d^-0.5
    got = evaluate(kernel.diagram, {"X": np.ones(4), "W": np.zeros((3, 4))}, {}, {"n": 4, "m": 3})["Y"]
    np.testing.assert_array_equal(got, [7.0, 8.0, 9.0, 10.0])


# ---- backends against the reference -----------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(MASKS))
def test_numpy_backend_matches_reference_and_counts_the_model(kind):
    result = check_run(attention(kind), sizes=SIZES)
    assert result["ok"], result
    assert result["count_differences"] == []


def test_numpy_backend_leaves_no_nan_in_fully_masked_rows():
    sizes = dict(b=1, h=1, q=12, x=4, d=4)
    kernel = attention("decode", relabel="group b 1, h 1, q 4; stream x 2")
    arrays = inputs(sizes, seed=2)
    outputs, _ = execute(kernel.program(None, **sizes), arrays)
    np.testing.assert_allclose(outputs["O"], by_hand(arrays, visible("decode", 12, 4)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(outputs["O"][0, 0, :8], 0.0)


@pytest.mark.parametrize("kind", sorted(MASKS))
def test_opencl_matches_reference(kind, opencl_device):
    from napkin_dsl.backends import opencl

    kernel = attention(kind)
    arrays = inputs(SIZES, seed=1)
    program = kernel.gpu_program(None, **SIZES)
    outputs = opencl.run(program, arrays, {})
    expected = evaluate(kernel.diagram, arrays, {}, SIZES)
    assert_matches_reference(program, outputs, expected, kind)
    np.testing.assert_allclose(outputs["O"], by_hand(arrays, visible(kind, SIZES["q"], SIZES["x"])), rtol=1e-4, atol=1e-5)


def test_opencl_fully_masked_rows_are_zero(opencl_device):
    from napkin_dsl.backends import opencl

    sizes = dict(b=1, h=1, q=12, x=4, d=4)
    kernel = attention("decode")
    arrays = inputs(sizes, seed=4)
    outputs = opencl.run(kernel.gpu_program(None, **sizes), arrays, {})
    assert not np.isnan(outputs["O"]).any()
    np.testing.assert_array_equal(outputs["O"][0, 0, :8], 0.0)


def test_cuda_source_prints_the_predicate_with_global_indices():
    source, _ = generate(attention("window").gpu_program("H100", b=1, h=2, q=128, x=128, d=64))
    assert "?" in source and ">=" in source and "(-NK_INF)" in source
    assert "o_q + i_q" in source  # the index is the whole array's, not the tile's


# ---- errors -----------------------------------------------------------------------------------------

K = "kernel k(S: f32[q x], T: f32[y]) -> P: f32[q x]:\n"
ERRORS = [
    # (source, error class, line, column, words of the message, words of the hint)
    (K + "    P[q x] = where(q >= y, S, 0)\n", NapkinTypeError, 2, 25, ["axis 'y'", "not an axis of this statement"], ["len(y)"]),
    (K + "    P[q x] = where(S, S, 0)\n", NapkinTypeError, 2, 20, ["operand of where", "not a condition"], ["compare"]),
    (K + "    P[q x] = S + (q >= x)\n", NapkinTypeError, 2, 21, ["operand of '+'", "condition"], ["where"]),
    (K + "    P[q x] = where(q >= x, S)\n", NapkinTypeError, 2, 14, ["where takes three arguments"], ["where(COND, A, B)"]),
    (K + "    P[q x] = S * len(S)\n", NapkinTypeError, 2, 18, ["len takes one axis name"], ["len(AXIS)"]),
    (K + "    P[q x] = S - inf\n", NapkinTypeError, 2, 14, ["inf is only a value to select"], ["where"]),
    (K + "    P[q x] = exp(-inf)\n", NapkinTypeError, 2, 14, ["inf is only a value to select", "exp"], ["where"]),
    (K + "    P[q x] = where(q >= x and S, S, 0)\n", NapkinTypeError, 2, 31, ["operand of 'and'", "not a condition"], []),
    (K + "    P[q x] = where(not S, S, 0)\n", NapkinTypeError, 2, 24, ["operand of 'not'"], []),
    (K + "    P[q x] = q >= x\n", NapkinTypeError, 2, 5, ["P would be a boolean"], ["where(COND, 1, 0)"]),
    ("kernel k(A: f32[q d], B: f32[x d]) -> P: f32[q x]:\n    P[q x] = A * B * q\n", NapkinTypeError, 2, 5,
     ["scaled by the index of axis 'q'"], ["len(q)"]),
    (K + "    P[q x] = where(q >= x >= 1, S, 0)\n", NapkinSyntaxError, 2, 27, ["comparisons do not chain"], ["a < b and b < c"]),
    (K + "    P[q x] = where(q => x, S, 0)\n", NapkinSyntaxError, 2, 22, ["unexpected '='"], ["comparison"]),
    ("kernel k(and: f32[q]) -> P: f32[q]:\n    P[q] = and\n", NapkinSyntaxError, 1, 10, ["reserved word"], ["and"]),
    ("box where(f32[x]) -> f32[x]\nkernel k(S: f32[x]) -> P: f32[x]:\n    P[x] = S\n", NapkinTypeError, 1, 5,
     ["name of a built-in function"], []),
    # an index as a power base or a divisor: a size was meant (the axis is the target's)
    ("kernel k(X: f32[t d]) -> Y: f32[t d]:\n    Y[t d] = X * d^-0.5\n", NapkinTypeError, 2, 18,
     ["index of axis 'd'", "power base"], ["len(d)"]),
    ("kernel k(X: f32[n]) -> Y: f32[n]:\n    Y[n] = X / n\n", NapkinTypeError, 2, 16, ["index of axis 'n'", "divisor"], ["len(n)"]),
]


@pytest.mark.parametrize("source, cls, line, column, message, hint", ERRORS)
def test_mask_errors_name_the_place(source, cls, line, column, message, hint):
    with pytest.raises(NapkinError) as info:
        napkin.load(source)
    error = info.value
    assert not isinstance(error, NapkinErrors), error.render()
    assert type(error) is cls, error.render()
    assert (error.span.line, error.span.column) == (line, column), error.render()
    for word in message:
        assert word in error.message, error.render()
    for word in hint:
        assert error.hint and word in error.hint, error.render()
    assert "^" in error.render() and "Traceback" not in error.render()


def test_sources_are_not_mutated_and_outputs_may_be_parenthesised():
    text = ("kernel k(S: f32[q x]) -> (P: f32[q x], L: f32[q]):\n"
            "    P[q x] = softmax[x](where(q >= x, S, -inf))\n    L[q] = sum[x](P)\n")
    kernel = napkin.load(text)["k"]
    assert kernel.diagram.outputs == ("P", "L")
    S = np.zeros((3, 3), np.float32)
    before = S.copy()
    result = evaluate(kernel.diagram, {"S": S}, {}, {"q": 3, "x": 3})
    np.testing.assert_array_equal(S, before)
    np.testing.assert_allclose(result["P"], np.tril(np.ones((3, 3))) / np.arange(1, 4)[:, None])


# ---- the Program visits only what the mask shows: counts against hand counts -------------------------


def tiles(size: int, tile: int) -> list[tuple[int, int]]:
    return [(start, min(start + tile, size)) for start in range(0, size, tile)]


def test_causal_8192_counts_equal_a_hand_count_of_visited_tiles():
    """b=4 h=32 q=x=8192 d=128, 128 x 64 tiles: a query tile [q0, q1) sees a key chunk [x0, x1)
    when some q >= x in it, i.e. q1 - 1 >= x0 (the diagonal chunks in full); 2g + 2 chunks for
    group g, 4160 of 8192 per head. Every count below is derived from that, not from the Program."""
    b, h, n, d, gq, sx = 4, 32, 8192, 128, 128, 64
    kernel = attention("causal", relabel=f"group b 1, h 1, q {gq}; stream x {sx}")
    program = kernel.program(None, b=b, h=h, q=n, x=n, d=d)
    report = cost_of(program, check=False)
    heads = b * h
    visited = [(q0, q1, x0, x1) for q0, q1 in tiles(n, gq) for x0, x1 in tiles(n, sx) if q1 - 1 >= x0]
    partial = [t for t in visited if not t[0] >= t[3] - 1]  # some x > q in the tile: the test runs
    assert len(visited) == 4160 and len(partial) == 128  # sum over g of (2g + 2); 2 diagonal chunks per group
    # smem: Q in and O out once per group; K and V chunks per visited tile
    smem = heads * (sum(2 * (q1 - q0) * d for q0, q1 in tiles(n, gq)) + sum(2 * (x1 - x0) * d for *_, x0, x1 in visited))
    # l2: the derived L2 groups (read off the schedule: plan.py chose them) load Q, K, V and save O
    l2_q = int(program.schedule.extent("q", "l2"))
    l2 = heads * (2 * n * d + len(tiles(n, l2_q)) * 2 * n * d)
    # registers: f32 runs on the FMA path, which keeps O.acc there (64 a thread) and moves nothing
    assert {level: int(c.H) for level, c in report.levels.items()} == {"l2": l2, "smem": smem, "registers": 0}
    # FLOPs per visited tile (rows g, keys s): S = QK (2gsd), its scale (gs), the chunk's max (gs)
    # and per row the new max and exp(old - new) (2g, + g exp), exp(S - m) and the row sum (2gs,
    # + gs exp), per row sum = sum * factor + chunk sum (2g), O.acc *= scale (gd), O.acc += PV
    # (2gsd); on partial tiles the test (>= and the select) per element, in the max and again in
    # exp(S - m), which evaluate the operand each; per group the division O = O.acc / sum (gd).
    # f32 contracts on the FMA pipe.
    fma = special = 0
    for q0, q1, x0, x1 in visited:
        g, s = q1 - q0, x1 - x0
        fma += 2 * g * s * d + g * s + g * s + 2 * g + 2 * g * s + 2 * g + g * d + 2 * g * s * d
        special += g + g * s
    fma += sum(2 * 2 * (q1 - q0) * (x1 - x0) for q0, q1, x0, x1 in partial) + sum((q1 - q0) * d for q0, q1 in tiles(n, gq))
    assert {unit: int(v) for unit, v in report.flops.items()} == {"fma": heads * fma, "special": heads * special}
    # half the work of the unmasked kernel, and a little more: the diagonal tiles count in full
    unmasked = cost_of(attention("q >= 0", relabel=f"group b 1, h 1, q {gq}; stream x {sx}").program(None, b=b, h=h, q=n, x=n, d=d), check=False)
    assert 0.5 < report.levels["smem"].H / unmasked.levels["smem"].H < 0.52


def brute_force_smem(kind: str, sizes: dict, gq: int, sx: int) -> int:
    """Values moved into and out of shared memory, from the visibility matrix itself: a chunk is
    loaded for a query tile when any query of the tile sees any key of the chunk."""
    q, x, d = sizes["q"], sizes["x"], sizes["d"]
    seen = visible(kind, q, x)
    moved = sum(2 * (q1 - q0) * d for q0, q1 in tiles(q, gq))
    moved += sum(2 * (x1 - x0) * d for q0, q1 in tiles(q, gq) for x0, x1 in tiles(x, sx) if seen[q0:q1, x0:x1].any())
    return sizes["b"] * sizes["h"] * moved


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None, derandomize=True)
@given(kind=st.sampled_from(["window", "decode", "causal"]), q=st.integers(1, 40), x=st.integers(1, 40),
       gq=st.sampled_from([1, 3, 4, 8, 16]), sx=st.sampled_from([1, 2, 5, 8]), seed=st.integers(0, 3))
def test_masks_on_random_sizes_run_right_and_count_what_they_visit(kind, q, x, gq, sx, seed):
    sizes = dict(b=1, h=2, q=q, x=x, d=4)
    kernel = attention(kind, relabel=f"group b 1, h 1, q {gq}; stream x {sx}")
    result = check_run(kernel, sizes=sizes, seed=seed)
    assert result["ok"], result  # NumPy against the reference, masked rows 0
    assert result["count_differences"] == []  # NumPy's counted transfers and FLOPs equal the model's
    assert result["predicted"]["smem"]["H"] == brute_force_smem(kind, sizes, gq, sx)
    arrays = inputs(sizes, seed)
    outputs, _ = execute(kernel.program(None, **sizes), arrays)
    np.testing.assert_allclose(outputs["O"], by_hand(arrays, visible(kind, q, x)), rtol=1e-4, atol=1e-5)


def test_a_condition_that_is_not_a_conjunction_of_inequalities_skips_nothing_and_stays_right():
    kernel = attention("q >= x or x == 0")
    program = kernel.program(None, **SIZES)
    from napkin_dsl.pseudocode import walk

    assert all(loop.mask is None for _, loops in walk(program.launches[0].body) for loop in loops)
    result = check_run(kernel, sizes=SIZES)
    assert result["ok"] and result["count_differences"] == []


def test_the_pseudocode_prints_the_bounds():
    from napkin_dsl.pseudocode import render_text

    assert "visits only the chunks where x_first <= q_last" in render_text(attention("causal").program(None, **SIZES))
    window = render_text(attention("window").program(None, **SIZES))
    assert "x_first <= q_last and x_last > q_first - 5" in window


# ---- several outputs: attention with its log-sum-exp --------------------------------------------------

LSE_SIZES = dict(b=1, h=2, q=70, x=90, d=16)


def lse_kernel():
    return napkin.load(EXAMPLES / "attention_lse.napkin")["attention_lse"]


def lse_by_hand(arrays: dict) -> np.ndarray:
    Q, K = (arrays[n].astype(np.float64) for n in "QK")
    S = np.einsum("bhqd,bhxd->bhqx", Q, K) / np.sqrt(Q.shape[-1])
    peak = S.max(axis=-1)
    return peak + np.log(np.exp(S - peak[..., None]).sum(axis=-1))


@pytest.mark.parametrize("backend", ["numpy", "opencl"])
def test_attention_lse_returns_o_and_l(backend, request):
    if backend == "opencl":
        request.getfixturevalue("opencl_device")
    kernel = lse_kernel()
    arrays = {k: v.astype(napkin.types.numpy_dtype("bf16")) for k, v in inputs(LSE_SIZES, seed=9).items()}
    outputs = kernel(arrays["Q"], arrays["K"], arrays["V"], backend=backend)
    assert set(outputs) == {"O", "L"} and outputs["L"].shape == (1, 2, 70) and outputs["L"].dtype == np.float32
    want = lse_by_hand(arrays)
    assert np.max(np.abs(outputs["L"] - want) / np.abs(want)) < 1e-3
    reference = evaluate(kernel.diagram, arrays, {}, LSE_SIZES, keep_float64=True)
    np.testing.assert_allclose(reference["L"], want, rtol=1e-12)
    assert np.max(np.abs(outputs["O"].astype(np.float64) - reference["O"])) < 1e-2


def test_lse_is_read_off_the_softmax_state_in_the_finalise_step():
    from napkin_dsl.pseudocode import render_text

    text = render_text(lse_kernel().program(None, **LSE_SIZES))
    loop_end = text.index("O = O.acc / P.sum")
    assert text.index("L = P.max + log(P.sum)") > loop_end  # after the stream, not a second pass over x
    assert check_run(lse_kernel(), sizes=LSE_SIZES)["count_differences"] == []


def test_masked_lse_of_a_fully_masked_row_is_minus_infinity():
    text = ("kernel k(S: f32[q x]) -> (O: f32[q], L: f32[q]):\n"
            "    P[q x] = softmax[x](where(q + len(x) - len(q) >= x, S, -inf))\n"
            "    O[q] = P[q x] * S[q x]\n    L[q] = lse[x](where(q + len(x) - len(q) >= x, S, -inf))\n"
            "relabel k on H100:\n    smem: group q 2; stream x 2\n")
    kernel = napkin.load(text)["k"]
    S = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)
    outputs, _ = execute(kernel.program(None, q=6, x=3), {"S": S})
    reference = evaluate(kernel.diagram, {"S": S}, {}, {"q": 6, "x": 3})
    np.testing.assert_array_equal(outputs["L"][:3], -np.inf)
    np.testing.assert_allclose(outputs["L"][3:], reference["L"][3:], rtol=1e-6)
    np.testing.assert_array_equal(outputs["O"][:3], 0.0)


def test_lse_streamed_without_its_softmax_is_a_relabel_error():
    text = ("kernel k(S: f32[q x]) -> L: f32[q]:\n    L[q] = lse[x](S)\n"
            "relabel k on H100:\n    smem: group q 2; stream x 2\n")
    with pytest.raises(napkin.RelabelError) as info:
        napkin.load(text)["k"].program(None, q=4, x=4)
    assert "lse[x]" in info.value.message and "softmax[x]" in info.value.message and info.value.span.line == 2
    # unstreamed, it is a plain reduction
    unstreamed = napkin.load("kernel k(S: f32[q x]) -> L: f32[q]:\n    L[q] = lse[x](S)\n")["k"]
    S = np.log(np.arange(1, 7, dtype=np.float32).reshape(2, 3))
    np.testing.assert_allclose(unstreamed(S), np.log([6.0, 15.0]), rtol=1e-6)


def test_unequal_groups_fill_waves_as_blocks_issued_longest_first():
    kernel = napkin.load(EXAMPLES / "causal_attention.napkin")["causal_attention"]
    report = cost_of(kernel.program(None, b=4, h=32, q=8192, x=8192, d=128))
    slots = report.time["blocks_per_wave"]
    # by hand: query group g of 64 visits 2g + 2 chunks; 128 heads; the longest blocks go first
    works = sorted([2 * g + 2 for g in range(64)] * 128, reverse=True)
    busy = sum(max(works[i:i + slots]) for i in range(0, len(works), slots))
    assert report.time["masked_wave_efficiency"] == pytest.approx(sum(works) / (slots * busy), rel=1e-12)
    assert any("4160 of 8192 tiles visited" in note for note in report.notes)
    unmasked = cost_of(napkin.load(EXAMPLES / "attention.napkin")["attention"].program(None, b=4, h=32, q=8192, x=8192, d=128))
    assert 0.45 < report.time["overlapped_s"] / unmasked.time["overlapped_s"] < 0.6


def test_a_python_kernel_names_several_outputs_as_a_tuple_or_a_dict():
    @napkin.kernel
    def pair(S: napkin.f32["q x"]) -> tuple[napkin.f32["q x"], napkin.f32["q"]]:
        """
        P[q x] = softmax[x](where(q >= x, S, -inf))
        L[q] = lse[x](where(q >= x, S, -inf))
        """

    @napkin.kernel
    def named(S: napkin.f32["q x"]) -> {"P": napkin.f32["q x"], "L": napkin.f32["q"]}:
        """
        P[q x] = softmax[x](where(q >= x, S, -inf))
        L[q] = lse[x](where(q >= x, S, -inf))
        """

    S = np.random.default_rng(1).standard_normal((4, 4)).astype(np.float32)
    for kernel in (pair, named):
        assert kernel.diagram.outputs == ("P", "L")
        out = kernel(S)
        E = np.tril(np.exp(S.astype(np.float64)))  # row q sees columns x <= q
        np.testing.assert_allclose(out["P"], E / E.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(out["L"], np.log(E.sum(axis=1)), rtol=1e-5)


def test_a_tuple_of_more_outputs_than_statements_is_an_error():
    with pytest.raises(NapkinError) as info:
        @napkin.kernel
        def too_many(S: napkin.f32["q"]) -> tuple[napkin.f32["q"], napkin.f32["q"]]:
            """
            P[q] = S * 2
            """
    assert "tuple" in info.value.message and info.value.hint


@settings(max_examples=6, deadline=None, derandomize=True)
@given(kind=st.sampled_from(["window", "decode"]), q=st.integers(1, 30), x=st.integers(1, 30),
       gq=st.sampled_from([4, 8, 16]), sx=st.sampled_from([4, 8]))
def test_opencl_masks_on_random_sizes(kind, q, x, gq, sx, opencl_device):
    from napkin_dsl.backends import opencl

    sizes = dict(b=1, h=1, q=q, x=x, d=4)
    kernel = attention(kind, relabel=f"group b 1, h 1, q {gq}; stream x {sx}")
    arrays = inputs(sizes, seed=q * 31 + x)
    outputs = opencl.run(kernel.gpu_program(None, **sizes), arrays, {})
    np.testing.assert_allclose(outputs["O"], by_hand(arrays, visible(kind, q, x)), rtol=1e-4, atol=1e-5)


def test_tensor_core_source_tests_each_lanes_fragment_indices_and_bounds_the_stream():
    kernel = napkin.load(EXAMPLES / "causal_attention.napkin")["causal_attention"]
    source = kernel.compile("sm_90", b=1, h=2, q=256, x=256, d=64).source
    # the predicate reads the lane's fragment row (groupID, + 8 for the upper half) and column, in
    # integers: the lane's part of q - x (its warp row, groupID and threadID) is one value computed
    # once a chunk; each element adds only the unrolled constants (mt, nt, i). No index is converted
    # to floating point, and no bound is computed in double
    assert "const int nk_edge0 = 1 * (o_q + (nk_wrow + nk_g)) + -1 * (o_x + 2 * nk_t) - (0);" in source
    assert "((nk_edge0 + 1 * ((mt * 16 + (i >> 1) * 8)) + -1 * ((nt * 8 + (i & 1))) >= 0))" in source
    assert "(float)(o_" not in source and "(double)" not in source
    # the chunks below the diagonal (a chunk's last key at or before the tile's first query):
    # floor((o_q - 63) / 64) + 1 of them, bounded in integers, run first in a loop of their own
    assert "nk_fhi_x = min(nk_fhi_x, (int)(" in source and "(1 * (long)(o_q)) - 0) - 63)" in source
    full = source.index("for (int c_x = nk_flo_x; c_x < nk_fhi_x; c_x += 2) {")
    after = source.index("for (int c_x = nk_fhi_x; c_x < nk_stop_x; ++c_x) {", full)
    assert "nk_edge0" not in source[full:after] and ": -NK_INF;" not in source[full:after]
    assert "nk_edge0" in source[after:]  # the diagonal chunks test each element
    # one barrier a chunk: the unrolled full loop passes two, one per buffer
    assert source[full:after].count("NK_SYNC()") == 2
    # the longest rows first: q tiles in reverse
    assert "const int grp_q = 1 - (" in source


def test_a_softmax_chain_through_a_masked_map_streams_and_skips_alike():
    chain = napkin.load(HEADER.format(name="chain", extra="") + """    S[b h q x] = Q[b h q d] * K[b h x d] * d^-0.5
    M[b h q x] = where(q >= x and q - x < 5, S, -inf)
    P[b h q x] = softmax[x](M)
    O[b h q d] = P[b h q x] * V[b h x d]

relabel chain on H100:
    smem: group b 1, h 1, q 8; stream x 4
""")["chain"]
    result = check_run(chain, sizes=SIZES)
    assert result["ok"] and result["count_differences"] == []
    direct = cost_of(attention("window").program(None, **SIZES), check=False)
    chained = cost_of(chain.program(None, **SIZES), check=False)
    assert {l: c.H for l, c in chained.levels.items()} == {l: c.H for l, c in direct.levels.items()}
    assert chained.levels["smem"].H == brute_force_smem("window", SIZES, 8, 4)


def test_the_diagram_labels_the_mask():
    from napkin_dsl.render import box_label

    kernel = napkin.load("kernel k(S: f32[q x]) -> P: f32[q x]:\n"
                         "    P[q x] = softmax[x](where(q + (len(x) - len(q)) >= x and q - x < 4, S, -inf))\n")["k"]
    assert box_label(kernel.diagram.statements[0]) == "softmax[x](where(q + -len(q) + len(x) >= x and q - x < 4, S, -inf))"


def test_tensor_core_path_on_opencl_leaves_fully_masked_rows_zero(opencl_device):
    """bf16 attention runs the tensor-core printer (mma emulated on OpenCL): a decode offset of
    x - q = -130 masks the first 130 queries in full; their rows are 0, the others right."""
    from napkin_dsl.backends import opencl

    text = (HEADER.format(name="masked", extra="") + BODY.format(mask=MASKS["decode"], logits="S")).replace("f32", "bf16")
    kernel = napkin.load(text + "\nrelabel masked on H100:\n    smem: group b 1, h 1, q 64; stream x 64\n")["masked"]
    sizes = dict(b=1, h=1, q=200, x=70, d=16)
    program = kernel.gpu_program(None, **sizes)
    assert "mma" in opencl.generate(program)[0].lower()
    bf16 = napkin.types.numpy_dtype("bf16")
    arrays = {name: array.astype(bf16) for name, array in inputs(sizes, seed=6).items()}
    out = opencl.run(program, arrays, {})["O"].astype(np.float64)
    np.testing.assert_array_equal(out[0, 0, :130], 0.0)
    np.testing.assert_allclose(out, by_hand(arrays, visible("decode", 200, 70)), atol=2e-2)


def test_too_many_groups_to_enumerate_count_every_chunk_and_say_so():
    from napkin_dsl.pseudocode import MAX_MASK_GROUPS

    n = 2 * MAX_MASK_GROUPS  # q tiles of 1: more group tiles than are enumerated
    kernel = attention("causal", relabel="group b 1, h 1, q 1; stream x 4096")
    report = cost_of(kernel.program(None, b=1, h=1, q=n, x=n, d=8), check=False)
    assert any("group tiles are not enumerated" in note and "upper bound" in note for note in report.notes)
    assert int(report.levels["smem"].H) == 2 * n * 8 + n * 2 * n * 8  # Q in and O out per row, K and V in full


LEAK = """
kernel leak(Q: f32[q d], K: f32[x d], V: f32[x d]) -> (O: f32[q d], S: f32[q x]):
    S[q x] = Q[q d] * K[x d]
    P[q x] = softmax[x](where(q >= x, S, -inf))
    O[q d] = P[q x] * V[x d]

relabel leak on H100:
    smem: group q 16; stream x 16
"""
LEAK_SIZES = {"q": 40, "x": 72, "d": 8}


def _stream_masks(program):
    return [loop.mask for launch in program.launches for _, loops in walk(launch.body) for loop in loops if loop.kind == "stream"]


def test_a_result_the_mask_does_not_cover_keeps_every_chunk():
    """S is saved beside the masked softmax: every chunk of it is needed, so the loop skips
    none (found by the fuzzer: the hidden chunks of S were never computed). Attention alone
    still skips them."""
    kernel = napkin.load(LEAK)["leak"]
    program = kernel.program(**LEAK_SIZES)
    assert _stream_masks(program) and all(mask is None for mask in _stream_masks(program))
    arrays, scalars = random_arguments(kernel.diagram, LEAK_SIZES, 0)
    outputs, counts = execute(program, arrays, scalars)
    want = evaluate(kernel.diagram, arrays, scalars, LEAK_SIZES, keep_float64=True)
    for name in ("O", "S"):
        np.testing.assert_allclose(outputs[name], want[name], rtol=1e-4, atol=1e-5)
    assert counts.differences(cost_of(program, check=False)) == []
    plain = napkin.load(LEAK.replace(" -> (O: f32[q d], S: f32[q x]):", " -> O: f32[q d]:"))["leak"]
    assert any(mask is not None for mask in _stream_masks(plain.program(**LEAK_SIZES)))


def test_a_result_the_mask_does_not_cover_is_right_on_opencl(opencl_device):
    from napkin_dsl.backends import opencl

    kernel = napkin.load(LEAK)["leak"]
    arrays, scalars = random_arguments(kernel.diagram, LEAK_SIZES, 1)
    outputs = opencl.run(kernel.gpu_program(None, **LEAK_SIZES), arrays, scalars)
    want = evaluate(kernel.diagram, arrays, scalars, LEAK_SIZES)
    for name in ("O", "S"):
        np.testing.assert_allclose(outputs[name], want[name], rtol=1e-4, atol=1e-5)
