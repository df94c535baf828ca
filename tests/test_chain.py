"""The warpgroup chain (napkin_dsl/chain.py): what a chunk of a built wgmma launch waits on beyond
its units' time, read off the plan (the roles or the synchronous ring) and the profile's
[latency] table, priced by the model (cost.predict_time) and the static ceiling alike."""

from __future__ import annotations

import re

import pytest

import napkin_dsl as napkin
from napkin_dsl.chain import Chain, Link, MissingLatency, chain_of
from napkin_dsl.cost import cost_of
from napkin_dsl.hardware import load_hardware
from napkin_dsl.isel import select_program

from .conftest import EXAMPLES

ATTENTION = dict(b=4, h=32, q=8192, x=8192, d=128)


def _kernel(name: str):
    return napkin.load(EXAMPLES / f"{name}.napkin")[name]


def _priced(name: str, synchronous: bool = False, overlap: str | None = None, hardware="H100", **sizes):
    program = _kernel(name).gpu_program(hardware, **sizes)
    selected = select_program(program, "sm_90a", synchronous=synchronous)
    return selected, cost_of(program, arch="sm_90a", selected=selected, overlap=overlap)


def _copy(clocks: float) -> Link:
    return Link("a chunk's copy", "copy", clocks)


# ---- the chain's arithmetic ------------------------------------------------------------------


def test_a_chunk_takes_its_units_and_links_or_the_rings_pace_whichever_is_longer():
    drain = Link("S's drain", "wgmma_drain", 100.0)
    roles = Chain("roles", (drain,), (), _copy(1000.0), 4)
    assert roles.chunk_clocks(2000.0) == 2100.0  # the ring keeps up: (1000 + 2100) / 4 < 2100
    assert roles.ring_clocks(200.0) == (1000 + 200 + 100) / 4
    assert roles.chunk_clocks(200.0) == 325.0  # a small chunk waits on its copy: Little's law over 4 stages
    synchronous = Chain("synchronous ring", (drain,), (), _copy(1000.0), 2)
    assert synchronous.chunk_clocks(200.0) == 1000.0  # one chunk ahead: the copy's latency a chunk
    assert synchronous.chunk_clocks(2000.0) == 2100.0


def test_a_deeper_ring_hides_the_copy_and_more_blocks_an_sm_hide_the_links():
    drain = Link("S's drain", "wgmma_drain", 100.0)
    paces = [Chain("roles", (drain,), (), _copy(1000.0), s).chunk_clocks(256.0) for s in (2, 4, 6, 8)]
    assert paces == sorted(paces, reverse=True) and paces[-1] == 356.0
    chain = Chain("roles", (drain,), (), _copy(1000.0), 8)
    assert chain.factor(256.0, 1) == pytest.approx(356 / 256)
    assert chain.factor(256.0, 2) == 1.0  # two blocks' chains side by side cover one's drain
    assert chain.factor(0.0, 1) == 1.0


# ---- read off the plan -----------------------------------------------------------------------


def test_matmuls_roles_expose_nothing_the_products_in_flight_cover_the_wait():
    program = _kernel("matmul").gpu_program("H100", m=8192, n=8192, k=8192)
    plan = select_program(program, "sm_90a")[0].plan
    chain = chain_of(plan, program.hardware)
    assert chain.build == "roles" and chain.links == () and chain.stages == plan.stages
    assert chain.hidden == ("the full-barrier wait, under C's products in flight (wait_group 1)",)


def test_attentions_roles_drain_s_and_the_synchronous_ring_drains_both_behind_a_barrier():
    program = _kernel("attention").gpu_program("H100", **ATTENTION)
    roles = chain_of(select_program(program, "sm_90a")[0].plan, program.hardware)
    assert [(link.what, link.latency) for link in roles.links] == [
        ("S's drain (wait_group 0: a later step reads it)", "wgmma_drain")]
    synchronous = chain_of(select_program(program, "sm_90a", synchronous=True)[0].plan, program.hardware)
    assert [link.latency for link in synchronous.links] == ["bar_sync", "mbarrier_wait", "wgmma_drain", "wgmma_drain"]
    assert synchronous.stages == 2 and synchronous.hidden == ()
    hardware = program.hardware
    assert synchronous.link_clocks == sum(hardware.latency_clocks(n) for n in ("bar_sync", "mbarrier_wait")) + \
        2 * hardware.latency_clocks("wgmma_drain")


def test_an_mma_sync_launch_has_no_chain():
    program = _kernel("attention").gpu_program("H100", **ATTENTION)
    assert chain_of(select_program(program, "sm_90")[0].plan, program.hardware) is None


# ---- the model prices the schedule built -----------------------------------------------------


def test_the_synchronous_attention_is_priced_below_its_units_sum_from_its_chain():
    """Issue 43's done-when: the serial build (kept as a choice) is priced from its chain, below
    what the units' sum alone says (578 TFLOP/s before the chain), and below the roles build."""
    _, synchronous = _priced("attention", synchronous=True, **ATTENTION)
    _, units_only = _priced("attention", synchronous=True, overlap="pingpong", **ATTENTION)  # the sum, no chain
    _, roles = _priced("attention", **ATTENTION)
    chain = synchronous.time["chain"][0]
    assert chain["build"] == "synchronous ring" and chain["factor"] > 1.1
    assert synchronous.time["compute_s"] == pytest.approx(units_only.time["compute_s"] * chain["factor"], rel=1e-9)
    flops = float(synchronous.total_flops)
    rate = {name: flops / report.time["overlapped_s"] / 1e12 for name, report in
            (("synchronous", synchronous), ("roles", roles), ("sum", units_only))}
    assert rate["synchronous"] < rate["roles"] < rate["sum"], rate
    assert chain["chunk_clocks"] == pytest.approx(chain["units_clocks"] + sum(link["clocks"] for link in chain["links"]), abs=0.1)


def test_the_report_shows_each_chain_its_links_and_each_latencys_source():
    _, report = _priced("attention", synchronous=True, **ATTENTION)
    table = report.table()
    line = next(line for line in table.splitlines() if line.startswith("  chain of launch 0 (synchronous ring)"))
    assert "the block barrier 24" in line and "S's drain (wait_group 0) 128" in line and re.search(r"compute x1\.\d{3}$", line)
    for name in ("copy", "wgmma_drain", "mbarrier_wait", "bar_sync"):
        source = report.time["chain"][0]["sources"][name]
        assert f"  latency {name}: {source}" in table and source.startswith("estimate")
    assert report.to_dict()["time"]["chain"][0]["links"][0]["latency"] == "bar_sync"


def test_a_what_if_overlap_has_no_chain():
    _, report = _priced("attention", overlap="pingpong+pipelined", **ATTENTION)
    assert "chain" not in report.time and "chain of launch" not in report.table()


def test_the_tuned_matmul_keeps_its_tensor_rate():
    """The roles' matmul exposes no link: its chain costs nothing where the ring keeps pace."""
    source = (EXAMPLES / "matmul.napkin").read_text().split("relabel")[0]
    kernel = napkin.load(source)["matmul"]
    program = kernel.gpu_program("H100", m=8192, n=8192, k=8192)
    selected = select_program(program, "sm_90a")
    chain = cost_of(program, arch="sm_90a", selected=selected).time["chain"][0]
    assert chain["links"] == [] and chain["factor"] == 1.0 and chain["ring_clocks"] < chain["units_clocks"]


# ---- the profile's [latency] table -------------------------------------------------------------


def _profile_without(tmp_path, *names: str):
    text = (EXAMPLES.parent / "napkin_dsl" / "hardware" / "H100.toml").read_text()
    kept = [line for line in text.splitlines() if not any(line.startswith(f"{n} = ") for n in names)]
    path = tmp_path / "H100_nolatency.toml"
    path.write_text("\n".join(kept).replace('name = "H100"', 'name = "H100_nolatency"') + "\n")
    return path


def test_a_profile_without_a_latency_prices_no_chain_and_says_so(tmp_path):
    path = _profile_without(tmp_path, "wgmma_drain")
    program = _kernel("attention").gpu_program(str(path), **ATTENTION)
    plan = select_program(program, "sm_90a")[0].plan
    with pytest.raises(MissingLatency, match="wgmma_drain"):
        chain_of(plan, program.hardware)
    report = cost_of(program, arch="sm_90a")
    assert "chain" not in report.time
    assert any("the warpgroup chain is not priced" in n and "no wgmma_drain entry" in n for n in report.notes), report.notes


@pytest.mark.parametrize("entry, message", [
    ('mystery = { clocks = 5, source = "x" }', "has an entry 'mystery'"),
    ('copy = { clocks = -1, source = "x" }', "copy must be"),
    ('copy = 1000', "copy must be"),
    ('copy = { clocks = 1000, source = " " }', "copy must be"),
])
def test_a_bad_latency_entry_is_refused_by_name(tmp_path, entry, message):
    path = _profile_without(tmp_path, "copy")
    path.write_text(path.read_text().replace("[latency]", f"[latency]\n{entry}", 1))
    with pytest.raises((ValueError, napkin.NapkinError), match=re.escape(message)):
        load_hardware(str(path))
