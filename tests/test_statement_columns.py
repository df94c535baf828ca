"""cost.statement_columns: the paper's per-column M and H (Figs. 9, 11, 12), read off the Program.

The per-statement H must add up to the CostReport's H at every level exactly, and the
largest per-statement M must be the report's M: one source of truth, split by statement.
"""

from __future__ import annotations

import pytest
import sympy

import napkin_dsl as napkin
from napkin_dsl.cost import cost_of, level_costs, statement_columns

from .conftest import EXAMPLES, NAPKIN_EXAMPLES, example_id

KERNELS = [(f"{example_id(path)}:{name}", k) for path in NAPKIN_EXAMPLES for name, k in napkin.load(path).items()]
IDS = [name for name, _ in KERNELS]

# Sizes the docs show the examples at (docs/hooks/napkin_docs.py), and small ones for the
# paper's figures, whose relabel blocks leave group sizes symbolic.
BOUND = {
    "attention": {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128},
    "causal_attention": {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128},
    "sliding_window": {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128},
    "attention_lse": {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128},
    "attention_unfused": {"q": 1024, "x": 1024, "d": 128},
    "gqa": {"b": 4, "kv": 8, "r": 4, "q": 8192, "x": 8192, "d": 128},
    "matmul": {"m": 8192, "n": 8192, "k": 8192},
    "mlp": {"b": 8192, "k": 4096, "n": 14336},
    "swiglu": {"t": 512, "m": 1024, "f": 2816, "e": 1024},
    "rmsnorm": {"t": 16384, "d": 4096},
    "softmax_rows": {"r": 32768, "c": 1000},
    "fig9": {"q": 300, "x": 200, "d": 64},
    "fig11": {"a": 1000, "x": 8, "y": 16, "w": 32, "g_a": 64},
    "fig12": {"a": 100, "b": 70, "x": 8, "y": 16, "w": 32, "g_a": 16, "g_b": 32},
    "decode": {"b": 1, "kv": 8, "r": 4, "x": 32768, "d": 128},  # a split: its parts and combine launches
    "splitk": {"m": 512, "n": 512, "k": 65536},
    "fp8_attention": {"b": 1, "h": 2, "qb": 4, "qi": 128, "x": 1024, "d": 128},
    "fp8_attention_vt": {"b": 1, "h": 2, "qb": 4, "qi": 128, "x": 1024, "d": 128},
    "fp8_matmul": {"m": 512, "n": 512, "k": 512},
}

def same(expr, text: str) -> bool:
    """Whether a cost equals the formula ``text``, written with the Program's own symbols."""
    expr = sympy.sympify(expr)
    expected = sympy.sympify(text, locals={s.name: s for s in expr.free_symbols})
    return expr == expected or sympy.expand(expr - expected) == 0


def by_label(program) -> dict:
    return {c["label"]: c for c in statement_columns(program)}


def test_one_column_per_statement_in_order():
    for _, kernel in KERNELS:
        columns = statement_columns(kernel.program())
        assert [c["label"] for c in columns] == [s.target for s in kernel.diagram.statements]
        levels = kernel.program().levels[1:]
        assert all(set(c["M"]) == set(levels) and set(c["H"]) == set(levels) for c in columns)


@pytest.mark.parametrize("kernel", [k for _, k in KERNELS], ids=IDS)
def test_columns_add_up_to_the_report_symbolically(kernel):
    program = kernel.program()
    columns = statement_columns(program)
    for level, cost in level_costs(program).items():
        total = sympy.Add(*(c["H"][level] for c in columns))
        assert sympy.expand(total - cost.H) == 0, f"H at {level}: columns sum to {total}, the report says {cost.H}"


@pytest.mark.parametrize("kernel", [k for _, k in KERNELS], ids=IDS)
def test_columns_add_up_to_the_report_at_bound_sizes(kernel):
    program = kernel.program(**BOUND[kernel.name])
    columns = statement_columns(program)
    report = cost_of(program, check=False)
    for level, cost in report.levels.items():
        assert all(c["H"][level].is_Integer and c["M"][level].is_Integer for c in columns)
        assert sum(int(c["H"][level]) for c in columns) == int(cost.H)
        assert max(int(c["M"][level]) for c in columns) == int(cost.M)


def test_fig9_columns_are_the_papers():
    """Fig. 9: load S, softmax, save P | load P and V, contract, save O (METHOD.md section 2)."""
    kernel = napkin.load(EXAMPLES / "paper" / "fig9.napkin")["fig9"]
    columns = by_label(kernel.program())
    assert same(columns["P"]["M"]["l1"], "q*x")
    assert same(columns["P"]["H"]["l1"], "2*q*x")
    # The paper prints qx + xd; the save column holds only O[q d], hence the Max.
    assert same(columns["O"]["M"]["l1"], "Max(d*q, q*x + x*d)")
    assert same(columns["O"]["H"]["l1"], "q*x + x*d + q*d")


def test_fig11_and_fig12_columns_are_the_papers():
    fig11 = by_label(napkin.load(EXAMPLES / "paper" / "fig11.napkin")["fig11"].program())["Y"]
    assert same(fig11["M"]["l1"], "Max(g_a*x + w, g_a*y)")
    assert same(fig11["H"]["l1"], "a*x + a*y + a*w/g_a")
    fig12 = by_label(napkin.load(EXAMPLES / "paper" / "fig12.napkin")["fig12"].program())["Y"]
    assert same(fig12["M"]["l1"], "Max(g_a*x + g_b*w, g_a*g_b*y)")
    assert same(fig12["H"]["l1"], "a*b*x/g_b + a*b*w/g_a + a*b*y")


def test_loads_go_to_the_first_reader_and_saves_to_the_producer():
    kernel = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    columns = by_label(kernel.program())
    # Q and K are loaded for S; V for O; P never leaves the chip; O is saved by O.
    assert same(columns["S"]["H"]["smem"], "b*h*q*d + b*h*x*d * q/128")
    assert columns["P"]["H"]["smem"] == 0
    assert same(columns["O"]["H"]["smem"], "b*h*x*d * q/128 + b*h*q*d")
    # At l2 (device-wide, one group): Q and K enter for S, V enters and O leaves for O.
    assert same(columns["S"]["H"]["l2"], "b*h*q*d + b*h*x*d")
    assert same(columns["O"]["H"]["l2"], "b*h*x*d + b*h*q*d")


def test_an_array_materialised_between_launches_is_saved_by_its_producer_and_loaded_by_its_reader():
    kernel = napkin.load(EXAMPLES / "attention_unfused.napkin")["attention_unfused"]
    columns = by_label(kernel.program())
    assert same(columns["S"]["H"]["smem"], "q*d + x*d + q*x")  # load Q, K; save S
    assert same(columns["P"]["H"]["smem"], "2*q*x")  # load S; save P
    assert same(columns["O"]["H"]["smem"], "q*x + x*d + q*d")  # load P, V; save O


TWO_READERS = """
kernel two(A: f32[q x], V: f32[x d]) -> O: f32[q d], R: f32[q d]:
    O[q d] = A * V
    E[q x] = exp(A)
    R[q d] = E * V

relabel two on H100:
    smem: group q 64; stream x 32
"""


def test_a_chunk_is_loaded_once_for_every_streamed_reader():
    """Chunks of A and V (which carry the streamed x) are loaded once per chunk, by their first
    reader, and stay resident for the later readers of the same iteration."""
    program = napkin.load(TWO_READERS)["two"].program()
    columns = by_label(program)
    assert same(columns["O"]["H"]["smem"], "q*x + (q/64)*x*d + q*d")  # A, V chunks; save O
    assert same(columns["E"]["H"]["smem"], "0")  # A's chunk is already there
    assert same(columns["R"]["H"]["smem"], "q*d")  # V's chunk too; save R
    total = sympy.Add(*(c["H"]["smem"] for c in columns.values()))
    assert sympy.expand(total - level_costs(program)["smem"].H) == 0


def test_statement_columns_do_not_change_the_program():
    kernel = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    program = kernel.program()
    before = cost_of(program, check=False).levels["smem"].H
    statement_columns(program)
    statement_columns(program)
    assert cost_of(program, check=False).levels["smem"].H == before
