"""Overlap of the compute units under a warpgroup schedule (hardware.OVERLAPS, cost.overlapped_compute):
which units run under the tensor cores, the what-if it prices, and the errors for a schedule that
does not apply. The schedules' evidence (FA3's ablation) is held in tests/test_published_model.py."""

from __future__ import annotations

import json

import pytest

import napkin_dsl as napkin
from napkin_dsl.cli import main
from napkin_dsl.cost import overlapped_compute
from napkin_dsl.hardware import BUILT_OVERLAP, BUILT_OVERLAPS, OVERLAPS

from .conftest import EXAMPLES

SIZES = {"b": 4, "h": 16, "q": 8448, "x": 8448, "d": 128}


@pytest.fixture(scope="module")
def attention():
    return napkin.load((EXAMPLES / "attention.napkin").read_text())["attention"]


def test_a_schedule_that_hides_nothing_sums_the_units():
    assert overlapped_compute({"tensor": 2.0, "fma": 0.5, "special": 1.25}, ()) == 3.75


def test_a_schedule_that_hides_the_fma_pipe_runs_it_under_the_tensor_cores_and_mufu_after():
    # MUFU's seconds, plus the longer of the tensor cores' and the FMA pipe's
    assert overlapped_compute({"tensor": 2.0, "fma": 0.5, "special": 1.25}, ("fma",)) == 3.25
    assert overlapped_compute({"tensor": 0.25, "fma": 0.5, "special": 1.0}, ("fma",)) == 1.5
    assert overlapped_compute({"fma": 0.5, "special": 1.0}, ("fma",)) == 1.5  # no products: nothing to hide under


def test_every_schedule_is_built_and_only_fa3s_hides_a_unit():
    assert BUILT_OVERLAP == "serial" and BUILT_OVERLAPS == ("serial", "pipelined", "pingpong", "pingpong+pipelined")
    assert {name: o.hidden for name, o in OVERLAPS.items()} == {
        "serial": (), "pipelined": (), "pingpong": (), "pingpong+pipelined": ("fma",)}


def _units_only(report) -> float:
    """A launch's compute seconds without its chain's stretch."""
    return report.time["compute_s"] / report.time["chain"][0]["factor"]


def test_fa3s_schedule_prices_the_wgmma_launch_at_mufu_plus_the_tensor_cores(attention):
    serial = attention.cost("H100", arch="sm_90a", **SIZES)
    fa3 = attention.cost("H100", arch="sm_90a", overlap="pingpong+pipelined", **SIZES)
    assert serial.time["overlap"] == "serial" and fa3.time["overlap"] == "pingpong+pipelined"
    units = serial.time["compute_by_unit_s"]
    assert units == fa3.time["compute_by_unit_s"]  # the same work, at the same peaks
    # the busy fraction and the balance scale both alike: compare the two computes without the
    # chains each built schedule stretches its own by (napkin_dsl/chain.py)
    ratio = _units_only(fa3) / _units_only(serial)
    assert ratio == pytest.approx((units["tensor"] + units["special"]) / sum(units.values()), rel=1e-9)
    assert fa3.time["chain"][0]["build"] == "roles, pingpong+pipelined"
    assert fa3.time["overlapped_s"] < serial.time["overlapped_s"]
    assert not any("warpgroup schedule" in note for note in serial.notes + fa3.notes)  # both built: no what-if
    assert "pingpong+pipelined runs FP32 (FMA pipe) under the tensor cores" in fa3.table()
    assert "at each unit's peak, in turn" in serial.table()


def test_the_single_overlaps_price_as_the_sum(attention):
    """Either overlap alone prices the units in turn, as the serial build does; each adds its own
    chain: pipelined waits on the full barrier and P V's drain (tests/test_pipelined.py),
    pingpong on a named barrier a product, where the serial order waits on S's drain."""
    serial = attention.cost("H100", arch="sm_90a", **SIZES)
    single = {name: attention.cost("H100", arch="sm_90a", overlap=name, **SIZES) for name in ("pipelined", "pingpong")}
    for report in single.values():
        assert _units_only(report) == pytest.approx(_units_only(serial), rel=1e-9)
    assert [single[n].time["chain"][0]["build"] for n in ("pipelined", "pingpong")] == ["roles, pipelined", "roles, pingpong"]
    seconds = {name: report.time["overlapped_s"] for name, report in single.items()}
    assert seconds["pingpong"] < serial.time["overlapped_s"] < seconds["pipelined"]


def test_a_schedule_needs_a_wgmma_launch(attention):
    with pytest.raises(napkin.NapkinError, match="no launch here is on wgmma.*mma.sync"):
        attention.cost("H100", arch="sm_90", overlap="pingpong+pipelined", **SIZES)
    with pytest.raises(napkin.NapkinError, match="no warpgroup schedule 'zigzag'"):
        attention.cost("H100", arch="sm_90a", overlap="zigzag", **SIZES)
    # the built schedule is no what-if: any path takes it
    assert attention.cost("H100", arch="sm_90", overlap="serial", **SIZES).time["overlap"] == "serial"


def test_the_cli_prices_a_schedule_and_refuses_an_unknown_one(capsys):
    sets = ["--set", *(f"{a}={n}" for a, n in SIZES.items())]
    assert main(["cost", str(EXAMPLES / "attention.napkin"), *sets, "--overlap", "pingpong+pipelined", "--json"]) == 0
    time = json.loads(capsys.readouterr().out)["kernels"]["attention"]["time"]
    assert time["overlap"] == "pingpong+pipelined"
    with pytest.raises(SystemExit) as exit_:
        main(["cost", str(EXAMPLES / "attention.napkin"), *sets, "--overlap", "zigzag"])
    assert exit_.value.code == 2
    assert "invalid choice: 'zigzag'" in capsys.readouterr().err
    assert main(["cost", str(EXAMPLES / "attention.napkin"), *sets, "--arch", "sm_90", "--overlap", "pingpong"]) == 2
    err = capsys.readouterr().err
    assert "no launch here is on wgmma" in err and "Traceback" not in err
