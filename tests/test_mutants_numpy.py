"""backends/numpy.py: what mutation testing found unchecked (benchmarks/mutation.md)."""

from __future__ import annotations

import numpy as np

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
