"""Regression tests for the front-end failures of issue 13 (items 6 to 10), found by fuzzing.

Each failure is exercised through the Python API and, where a user meets it on the command
line, through ``napkin``'s entry point: a user mistake exits 2 with the message on stderr
naming the offending thing, and never prints a traceback (an exception that is not a
``NapkinError`` escapes ``main`` and fails the test).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sympy

import napkin_dsl as napkin
from napkin_dsl.cli import main
from napkin_dsl.errors import NapkinError

ELEMENTWISE = "kernel k(X: f32[i]) -> Y: f32[i]:\n    Y[i] = X * 2\n"


def write(tmp_path: Path, source: str, name: str = "k.napkin") -> str:
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def cli_fails(capsys, *args: str) -> str:
    """The command must exit 2 and explain on stderr."""
    code, out, err = cli(capsys, *args)
    assert code == 2, (out, err)
    assert err.strip()
    return err


# ---- 6: tuning an elementwise kernel on an abstract model ----------------------------------


@pytest.mark.parametrize("hardware", ["two_level", "three_level"])
def test_tune_elementwise_kernel_has_beta_zero(hardware):
    # H = 2i whatever the tiles: the fit's two optima are equal and their difference from H0 is 0.
    result = napkin.load(ELEMENTWISE)["k"].tune(hardware)
    assert result.beta == 0
    assert result.optimum == 2 * sympy.Symbol("i", positive=True, integer=True)
    assert result.relabel_block().splitlines()[1].strip().startswith(("l1: group i", "l2: group i"))


def test_tune_elementwise_kernel_cli(tmp_path, capsys):
    code, out, _ = cli(capsys, "tune", write(tmp_path, ELEMENTWISE))
    assert code == 0
    assert "beta = 0" in out
    # The configuration is written out as a relabel block (it used to come out empty).
    assert "l1: group i" in out.split("as a relabel block:")[1]


def test_tune_softmax_rows_example_on_an_abstract_model(capsys):
    from .conftest import EXAMPLES

    code, out, _ = cli(capsys, "tune", str(EXAMPLES / "softmax.napkin"), "--hardware", "two_level", "--json")
    assert code == 0
    assert '"beta": 0' in out
