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


def test_the_built_schedule_is_serial_and_only_fa3s_hides_a_unit():
    assert BUILT_OVERLAP == "serial" and BUILT_OVERLAPS == ("serial", "pipelined")
    assert {name: o.hidden for name, o in OVERLAPS.items()} == {
        "serial": (), "pipelined": (), "pingpong": (), "pingpong+pipelined": ("fma",)}


def test_fa3s_schedule_prices_the_wgmma_launch_at_mufu_plus_the_tensor_cores(attention):
    serial = attention.cost("H100", arch="sm_90a", **SIZES)
    fa3 = attention.cost("H100", arch="sm_90a", overlap="pingpong+pipelined", **SIZES)
    assert serial.time["overlap"] == "serial" and fa3.time["overlap"] == "pingpong+pipelined"
    units = serial.time["compute_by_unit_s"]
    assert units == fa3.time["compute_by_unit_s"]  # the same work, at the same peaks
    # the busy fraction and the balance scale both alike: compare the ratio of the two computes; the
    # built schedule's is also stretched by its warpgroup chain (napkin_dsl/chain.py), a what-if's is not
    ratio = fa3.time["compute_s"] / serial.time["compute_s"]
    factor = serial.time["chain"][0]["factor"]
    assert factor > 1 and "chain" not in fa3.time
    assert ratio == pytest.approx((units["tensor"] + units["special"]) / sum(units.values()) / factor, rel=1e-9)
    assert fa3.time["overlapped_s"] < serial.time["overlapped_s"]
    assert any(note.startswith("priced with the pingpong+pipelined warpgroup schedule") and "what-if" in note
               for note in fa3.notes)
    assert not any("warpgroup schedule" in note for note in serial.notes)
    assert "pingpong+pipelined runs FP32 (FMA pipe) under the tensor cores" in fa3.table()
    assert "at each unit's peak, in turn" in serial.table()


def test_the_single_overlaps_price_as_the_sum(attention):
    """Either overlap alone prices the units in turn, as the serial build does. pingpong is a
    what-if, without a chain; pipelined is built, and its chain (tests/test_pipelined.py) waits on
    the full barrier and P V's drain where the serial one waits on S's."""
    serial = attention.cost("H100", arch="sm_90a", **SIZES).time
    single = {name: attention.cost("H100", arch="sm_90a", overlap=name, **SIZES).time for name in ("pipelined", "pingpong")}
    assert single["pingpong"]["overlapped_s"] < serial["overlapped_s"] < single["pipelined"]["overlapped_s"]
    assert serial["compute_s"] == pytest.approx(single["pingpong"]["compute_s"] * serial["chain"][0]["factor"], rel=1e-9)
    assert "chain" not in single["pingpong"] and single["pipelined"]["chain"][0]["build"] == "roles, pipelined"
    assert single["pipelined"]["compute_s"] == pytest.approx(single["pingpong"]["compute_s"] * single["pipelined"]["chain"][0]["factor"],
                                                             rel=1e-9)


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
