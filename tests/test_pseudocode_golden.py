"""Golden files for `napkin pseudo` and `napkin cost --json` of every example, and the CLI's --set."""

from __future__ import annotations

import json
import os

import pytest
import sympy

import napkin_dsl as napkin
from napkin_dsl.cli import main, size_symbols

from .conftest import NAPKIN_EXAMPLES, ROOT, example_id

NUMERIC = {
    "attention.napkin": ["b=4", "h=32", "q=8192", "x=8192", "d=128"],
    "matmul.napkin": ["m=8192", "n=8192", "k=8192"],
    "gqa.napkin": ["b=2", "kv=8", "r=4", "q=4096", "x=4096", "d=128"],
}


def run(args, capsys) -> str:
    os.chdir(ROOT)
    code = main(args)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def golden_name(path, suffix):
    return f"pseudo/{example_id(path).replace('/', '__')}{suffix}"


@pytest.mark.parametrize("path", NAPKIN_EXAMPLES, ids=example_id)
def test_pseudo_text_golden(path, golden, capsys):
    golden(golden_name(path, ".txt"), run(["pseudo", str(path.relative_to(ROOT))], capsys))


@pytest.mark.parametrize("path", NAPKIN_EXAMPLES, ids=example_id)
def test_pseudo_markdown_golden(path, golden, capsys):
    golden(golden_name(path, ".md"), run(["pseudo", "--format", "markdown", str(path.relative_to(ROOT))], capsys))


@pytest.mark.parametrize("path", NAPKIN_EXAMPLES, ids=example_id)
def test_cost_json_golden(path, golden, capsys):
    out = run(["cost", "--json", str(path.relative_to(ROOT))], capsys)
    data = json.loads(out)
    kernels = napkin.load(path)
    assert set(data["kernels"]) == set(kernels)
    for name, kernel in data["kernels"].items():
        assert set(kernel) >= {"hardware", "sizes", "levels", "flops", "time_s"}
        symbols = size_symbols(kernels[name])
        for level in kernel["levels"].values():
            value = {key: sympy.sympify(level[key]) for key in ("H", "M", "N", "H_bytes", "M_bytes")}
            # Each count is an expression of the kernel's own sizes (no stray or internal symbol) ...
            for key, expr in value.items():
                assert {s.name for s in expr.free_symbols} <= symbols, (name, key, expr)
            # ... and its bytes are its values times a dtype's width (1 to 8 bytes), wherever evaluated.
            point = {s: 4096 for expr in value.values() for s in expr.free_symbols}
            for values, in_bytes in (("H", "H_bytes"), ("M", "M_bytes")):
                count, size = (float(value[k].subs(point)) for k in (values, in_bytes))
                assert count <= size <= 8 * count, (name, values, count, size)
    golden(golden_name(path, ".cost.json"), out)


@pytest.mark.parametrize("name", sorted(NUMERIC))
def test_cost_json_numeric_golden(name, golden, capsys):
    path = ROOT / "examples" / name
    out = run(["cost", "--json", str(path.relative_to(ROOT)), "--set", *NUMERIC[name][:2], "--set", *NUMERIC[name][2:]], capsys)
    data = json.loads(out)
    (kernel,) = data["kernels"].values()
    assert kernel["time_s"] > 0
    for level in kernel["levels"].values():
        assert all(isinstance(level[key], int) for key in ("H", "M", "N", "H_bytes", "M_bytes"))
        assert level["intensity"] > 0
    golden(f"pseudo/{name}.numeric.cost.json", out)


def test_set_rejects_bad_values(capsys):
    os.chdir(ROOT)
    assert main(["cost", "examples/matmul.napkin", "--set", "m=abc"]) == 2
    assert "not an integer" in capsys.readouterr().err
    assert main(["cost", "examples/matmul.napkin", "--set", "m"]) == 2
    assert "NAME=INT" in capsys.readouterr().err


def test_tune_cli(capsys):
    out = run(["tune", "examples/matmul.napkin", "--hardware", "H100", "--set", "m=4096", "n=4096", "k=4096"], capsys)
    assert "relabel matmul on H100" in out and "smem: group m" in out


def test_report_is_the_main_job(capsys):
    out = run(["report", "examples/attention.napkin"], capsys)
    assert "kernel attention" in out and "for x in" in out and "cost of attention on H100" in out
