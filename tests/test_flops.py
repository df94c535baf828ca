"""FLOPs counted once: ``napkin check`` (the diagram) and ``napkin cost`` (the Program) agree.

Both read the table of box kinds (``boxes.BOX_KINDS``). Without stream partitions their totals
are equal; with streams the Program's total is the diagram's plus the online bookkeeping
(``cost.bookkeeping_flops``: the rescales of the running state, the operand a streamed softmax
evaluates again, the output divided instead of every entry), unless a mask skips chunks.
"""

from __future__ import annotations

import dataclasses

import sympy
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import napkin_dsl as napkin
from napkin_dsl.backends.numpy import execute, random_arguments
from napkin_dsl.cost import bookkeeping_flops, cost_of, recomputed_flops
from napkin_dsl.diagram import Axis
from napkin_dsl.errors import NapkinError
from napkin_dsl.pseudocode import Loop, walk

from .conftest import NAPKIN_EXAMPLES, example_id
from .fuzz_programs import kernel_sizes, programs

PROFILE = {"phases": [Phase.explicit, Phase.generate], "deadline": None, "database": None, "derandomize": True, "suppress_health_check": list(HealthCheck)}


def diagram_flops(kernel, sizes: dict) -> sympy.Expr:
    """What ``napkin check`` reports, at ``sizes``."""
    return sympy.expand(kernel.diagram.flops.subs({Axis.symbol(a): n for a, n in sizes.items()}))


def loops_of(program) -> list[Loop]:
    return [loop for launch in program.launches for _, loops in walk(launch.body) for loop in loops]


def compare(kernel, sizes: dict, hardware: str | None = None) -> tuple[str, sympy.Expr, sympy.Expr, dict, dict]:
    """(kind, the diagram's FLOPs, the Program's, its bookkeeping by unit, its recomputation by
    unit); kind: "plain", "streamed" or "masked"."""
    program = kernel.program(hardware, **sizes)
    report = cost_of(program, check=False)
    loops = loops_of(program)
    kind = "masked" if any(lp.mask is not None for lp in loops) else "streamed" if any(lp.kind == "stream" for lp in loops) else "plain"
    return kind, diagram_flops(kernel, sizes), sympy.expand(report.total_flops), bookkeeping_flops(program), recomputed_flops(program)


def assert_agree(kernel, sizes: dict, hardware: str | None = None) -> str:
    kind, checked, costed, bookkeeping, recomputed = compare(kernel, sizes, hardware)
    extra = sympy.expand(sympy.Add(*bookkeeping.values()) + sympy.Add(*recomputed.values()))
    if kind == "plain":
        assert bookkeeping == {}
    if kind == "masked":  # a mask skips chunks the diagram counts: never more than the diagram and the rest
        assert (costed - extra - checked).is_nonpositive is not False
    else:
        assert sympy.expand(costed - extra - checked) == 0, (
            f"{kernel.name}: check {checked}, cost {costed}, bookkeeping {bookkeeping}, recomputed {recomputed}")
    return kind


EXAMPLE_KERNELS = [(path, name) for path in NAPKIN_EXAMPLES for name in napkin.load(path)]


def test_every_example_check_and_cost_agree():
    kinds = {}
    for path, name in EXAMPLE_KERNELS:
        kernel = napkin.load(path)[name]
        sizes = kernel_sizes(kernel, _NoCase)
        kinds[f"{example_id(path)}:{name}"] = assert_agree(kernel, {a: 2 * n + 5 for a, n in sizes.items()})
    # the examples cover every case: no stream, streams, masked streams
    assert set(kinds.values()) == {"plain", "streamed", "masked"}, kinds


class _NoCase:
    sizes: dict = {}


def test_symbolic_examples_agree_too():
    """With symbolic sizes (trip counts as ceilings), the totals agree as expressions."""
    for name in ("matmul", "attention"):
        kernel = napkin.load(next(p for p in NAPKIN_EXAMPLES if p.name == f"{name}.napkin"))[name]
        assert assert_agree(kernel, {}) == "streamed" if name == "attention" else "plain"


@settings(max_examples=500, **PROFILE)
@given(programs(max_size=5, opencl=False))
def test_random_kernels_check_and_cost_agree(case):
    try:
        kernels = napkin.load(case.text)
    except NapkinError:
        return  # a relabelling the generator drew and napkin refuses: nothing to compare
    for kernel in kernels.values():
        sizes = kernel_sizes(kernel, case)
        try:
            assert_agree(kernel, sizes, case.hardware)
        except NapkinError:
            continue


# ---- streamed and unstreamed softmax over a random operand -------------------------------------

UNARY = ("exp", "log", "sqrt", "tanh", "sigmoid", "gelu", "silu", "relu", "abs")
SPECIAL = {"exp", "log", "sqrt", "tanh", "sigmoid", "gelu", "silu"}


@st.composite
def operands(draw, depth: int = 3) -> tuple[str, int, int, bool]:
    """An expression of S[q x] and T[q] as text, with its operations by unit (fma, special),
    counted here as the expression is built, and whether it reads an array (an operation on
    constants only is folded when compiling: it costs nothing)."""
    choice = draw(st.integers(0, 3 if depth else 1))
    if choice == 0:
        return "S[q x]", 0, 0, True
    if choice == 1:
        leaf = draw(st.sampled_from(["T[q]", "2.5", "S[q x]"]))
        return leaf, 0, 0, leaf != "2.5"
    if choice == 2:
        fn = draw(st.sampled_from(UNARY))
        text, fma, special, reads = draw(operands(depth - 1))
        return f"{fn}({text})", fma + (reads and fn not in SPECIAL), special + (reads and fn in SPECIAL), reads
    op = draw(st.sampled_from(["+", "-", "*", "/"]))
    (left, lf, ls, lr), (right, rf, rs, rr) = draw(operands(depth - 1)), draw(operands(depth - 1))
    return f"({left} {op} {right})", lf + rf + (lr or rr), ls + rs, lr or rr


def softmax_kernel(operand: str, relabel: str) -> object:
    text = (f"kernel k(S: f32[q x], T: f32[q], V: f32[x d]) -> O: f32[q d]:\n"
            f"    P[q x] = softmax[x](S[q x] + {operand})\n"
            f"    O[q d] = P[q x] * V[x d]\n\n"
            f"relabel k on two_level:\n    l1: {relabel}\n")
    return napkin.load(text)["k"]


@settings(max_examples=60, **PROFILE)
@given(operands(), st.integers(1, 9), st.integers(1, 9))
def test_streamed_softmax_agrees_with_unstreamed_up_to_the_bookkeeping(operand, chunk, tail):
    text, fma, special, _ = operand
    fma += 1  # S[q x] + operand
    q, x, d = 3, chunk * 2 + tail, 4  # two chunks and a tail (tail < chunk) or more chunks
    sizes = {"q": q, "x": x, "d": d}
    streamed = softmax_kernel(text, f"group q 2; stream x {chunk}")
    plain = softmax_kernel(text, "group q 2")
    kind, checked, costed, bookkeeping, recomputed = compare(streamed, sizes)
    assert kind == "streamed" and recomputed == {}
    plain_kind, _, plain_costed, plain_bookkeeping, plain_recomputed = compare(plain, sizes)
    assert plain_kind == "plain" and plain_bookkeeping == {} and plain_recomputed == {}
    extra = sympy.Add(*bookkeeping.values())
    assert costed - extra == plain_costed == checked
    # The bookkeeping from first principles: per row and chunk, the new max, exp(old - new) and
    # sum * factor + chunk sum (4 FMA-pipe, 1 special); per output and chunk O.acc *= factor; per
    # output O / sum; per element the operand evaluated again, less the division of every entry.
    chunks = -(-x // chunk)
    assert bookkeeping.get("fma", 0) == q * chunks * 4 + q * d * chunks + q * d + q * x * (fma - 1)
    assert bookkeeping.get("special", 0) == q * chunks + q * x * special


# ---- the NumPy backend counts what it evaluates --------------------------------------------------


def without_flops(program):
    """The Program with every step's FLOPs erased: what a count read off the Program would see."""
    def strip(nodes):
        return tuple(dataclasses.replace(n, body=strip(n.body)) if isinstance(n, Loop)
                     else dataclasses.replace(n, flops=(), bookkeeping=(), flops_over=(), test_flops=()) for n in nodes)

    return dataclasses.replace(program, launches=tuple(dataclasses.replace(lp, body=strip(lp.body)) for lp in program.launches))


def counted_and_predicted(kernel, sizes: dict, seed: int = 0) -> tuple[dict, dict, dict]:
    """FLOPs by unit: counted by the NumPy backend, counted on the Program without its FLOPs, predicted."""
    program = kernel.program(None, **sizes)
    axis_sizes = {a: sizes[a] for a in kernel.diagram.axes}
    arrays, scalars = random_arguments(kernel.diagram, axis_sizes, seed)
    counted = execute(program, arrays, scalars)[1].flops
    blind = execute(without_flops(program), arrays, scalars)[1].flops
    predicted = cost_of(program, check=False).flops
    return counted, blind, {unit: int(v) for unit, v in predicted.items()}


def test_the_numpy_count_does_not_read_the_programs_flops():
    kernel = napkin.load(next(p for p in NAPKIN_EXAMPLES if p.name == "causal_attention.napkin"))["causal_attention"]
    counted, blind, predicted = counted_and_predicted(kernel, {"b": 1, "h": 2, "q": 200, "x": 150, "d": 16})
    assert counted == blind == predicted
    assert counted["special"] > 0 and counted["fma"] > 0


@settings(max_examples=25, **PROFILE)
@given(operands(), st.integers(1, 9), st.integers(1, 9))
def test_numpy_counts_a_streamed_softmax_of_a_random_operand_as_the_model(operand, chunk, tail):
    """The count by evaluation of softmax[x](S + EXPR) streamed over x, then contracted, equals the
    model: the operand evaluated per element for the chunk's max and again for exp."""
    text, fma, special, _ = operand
    sizes = {"q": 3, "x": 2 * chunk + tail, "d": 4}
    counted, blind, predicted = counted_and_predicted(softmax_kernel(text, f"group q 2; stream x {chunk}"), sizes)
    assert counted == blind == predicted
    chunks, q, x, d = -(-sizes["x"] // chunk), sizes["q"], sizes["x"], sizes["d"]
    # from first principles: the operand (S + EXPR) twice per element, max, subtract, exp and sum
    # per element, 4 FMA-pipe and an exp per row and chunk, O.acc *= factor per output and chunk,
    # O / sum per output; the products (2 per multiply-add) on the tensor unit of two_level
    assert counted.get("special", 0) == q * x * (2 * special + 1) + q * chunks
    assert counted["fma"] == q * x * (2 * (fma + 1) + 3) + 4 * q * chunks + q * d * chunks + q * d
    assert counted["tensor"] == 2 * q * x * d


def test_check_shows_the_bookkeeping_on_a_line_of_its_own():
    from napkin_dsl.cli import format_check

    def example(name):
        return napkin.load(next(p for p in NAPKIN_EXAMPLES if p.name == f"{name}.napkin"))[name]

    attention = example("attention")
    lines = format_check(attention).splitlines()
    (line,) = [text for text in lines if "online bookkeeping" in text]
    bookkeeping = bookkeeping_flops(attention.program())
    assert line.endswith(", ".join(f"{unit} {value}" for unit, value in bookkeeping.items()))
    assert lines.index(line) == next(i for i, text in enumerate(lines) if text.startswith("  total FLOPs:")) + 1
    assert not any("bookkeeping" in text or "recomputed" in text for text in format_check(example("matmul")).splitlines())
