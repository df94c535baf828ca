"""The derived backward priced in both FLOP conventions (issue 47, item 4): `napkin grad` with
every axis bound ends with the model's time for the backward and its throughput in napkin's own
FLOPs (what the backward computes) and, for an attention-shaped forward, in FlashAttention's
(2.5 times the forward's products), the convention published backward rows use.
"""

from __future__ import annotations

import re

import pytest

import napkin_dsl as napkin
from napkin_dsl.cli import main

from .conftest import EXAMPLES

BIG = dict(b=4, h=32, q=8192, x=8192, d=128)


def _grad(capsys, file, **sizes):
    assert main(["grad", str(file), "--set", *(f"{a}={n}" for a, n in sizes.items())]) == 0
    return capsys.readouterr().out


def test_attentions_backward_is_priced_in_napkins_flops_and_flashattentions(capsys):
    out = _grad(capsys, EXAMPLES / "attention.napkin", **BIG)
    forward = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    report = forward.grad(**BIG).cost(**BIG)
    seconds = report.time["overlapped_s"]
    b, h, q, x, d = (BIG[a] for a in "bhqxd")
    own = re.search(r"# priced on H100 at b=4 h=32 q=8192 x=8192 d=128: ([\d.]+) ms, (\d+) TFLOP/s in napkin's FLOPs", out)
    assert own and float(own.group(1)) == float(f"{seconds * 1e3:.3g}")
    assert int(own.group(2)) == round(float(report.total_flops) / seconds / 1e12)
    flash = re.search(r"#   (\d+) TFLOP/s in FlashAttention's convention \(2.5x the forward's products", out)
    assert flash and int(flash.group(1)) == round(2.5 * 4 * b * h * q * x * d / seconds / 1e12)
    assert int(flash.group(1)) < int(own.group(2))  # FA2's five products, and napkin's FLOPs count the maps too


def test_the_other_dq_choice_is_priced_after_the_one_printed(capsys):
    """Issue 47, item 2: dQ summed by atomic adds (the model's pick) and the deterministic launch
    of its own, each printed with the other's price; --deterministic and --atomic pick one."""
    summed = _grad(capsys, EXAMPLES / "attention.napkin", **BIG)
    assert "dQ_f32[b h q d] @gmem f32 = " in summed and "S_1" not in summed
    prices = [float(m) for m in re.findall(r"# priced on H100 at [^:]*: ([\d.]+) ms", summed)]
    assert "# the other choice (deterministic: dQ in a launch of its own, recomputing what it reads; --deterministic picks it)" in summed
    assert len(prices) == 2 and prices[0] < prices[1]
    assert main(["grad", str(EXAMPLES / "attention.napkin"), "--atomic", "--set", *(f"{a}={n}" for a, n in BIG.items())]) == 0
    assert capsys.readouterr().out == summed
    assert main(["grad", str(EXAMPLES / "attention.napkin"), "--deterministic",
                 "--set", *(f"{a}={n}" for a, n in BIG.items())]) == 0
    fixed = capsys.readouterr().out
    assert "S_1[b h q x] = " in fixed and "dQ_f32" not in fixed.split("# the other choice")[0]
    assert "# the other choice (dQ summed over the groups of x by atomic adds, in the key launch; --atomic picks it)" in fixed
    assert [float(m) for m in re.findall(r"# priced on H100 at [^:]*: ([\d.]+) ms", fixed)] == prices[::-1]


def test_atomic_and_deterministic_are_one_choice(capsys):
    with pytest.raises(SystemExit):
        main(["grad", str(EXAMPLES / "attention.napkin"), "--atomic", "--deterministic"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_matmuls_backward_has_no_flashattention_figure(capsys):
    out = _grad(capsys, EXAMPLES / "matmul.napkin", m=4096, n=4096, k=64)
    assert "TFLOP/s in napkin's FLOPs" in out and "FlashAttention" not in out


def test_a_backward_whose_relabelling_does_not_fit_is_printed_and_says_why_it_is_unpriced(capsys):
    out = _grad(capsys, EXAMPLES / "matmul.napkin", m=512, n=512, k=512)
    assert "kernel matmul_grad(" in out
    line = next(line for line in out.splitlines() if line.startswith("# not priced"))
    assert re.match(r"# not priced at m=512 n=512 k=512: matmul_grad needs [\d,]+ bytes at smem per block", line), line


def test_a_causal_backward_is_priced_over_the_pairs_its_mask_keeps(capsys):
    """FlashAttention counts causal attention's FLOPs over half the (q, x) pairs: napkin counts the
    pairs the mask keeps, exactly ((n + 1) / 2n at q = x = n)."""
    out = _grad(capsys, EXAMPLES / "causal_attention.napkin", **BIG)
    flash = re.search(r"#   \d+ TFLOP/s in FlashAttention's convention \(2.5x the forward's products: ([\d.]+) TFLOP\)", out)
    n = BIG["q"]
    want = 2.5 * 4 * BIG["b"] * BIG["h"] * n * n * BIG["d"] * (n + 1) / (2 * n)
    assert flash and float(flash.group(1)) == float(f"{want / 1e12:.4g}")


def test_the_kept_fraction_of_a_mask_is_its_count_of_pairs():
    import numpy as np

    from napkin_dsl.diagram import Apply, Const, Index
    from napkin_dsl.pseudocode import kept_fraction

    q, x = Index("q"), Index("x")
    window = Apply("and", (Apply("ge", (q, x)), Apply("lt", (Apply("sub", (q, x)), Const(5)))))
    rows, cols = np.meshgrid(np.arange(37), np.arange(23), indexing="ij")
    assert kept_fraction(window, {"q": 37, "x": 23}) == ((rows >= cols) & (rows - cols < 5)).mean()
    assert kept_fraction(Apply("ge", (q, x)), {"q": 8, "x": 8}) == 36 / 64
