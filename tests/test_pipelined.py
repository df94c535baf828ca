"""FlashAttention-3's intra-warpgroup pipeline, built (issue 48, item 1): the consumers issue chunk
c's S = Q K^T, then chunk c - 1's O += P V, wait for S at depth 1 and run c's softmax while P V is
on the tensor cores (``paths.wgmma.pipeline_parts``, ``backends/pipeline.py``'s
``pipelined_chunks``).

The OpenCL rendering runs on the roles runtime, whose groups land in rounds a seeded adversary
draws, each accumulator NaN until its group lands, a stage's bytes poisoned when it is refilled, a
register A checked unchanged at the landing: each variant matches float64 at ragged sizes and
masked, under three seeds, and each ordering bug planted in the printer fails the run. The CUDA
rendering is checked in its SASS; the model prices the chain of the order built.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import opencl, pipeline
from napkin_dsl.isel import select_program
from napkin_dsl.paths import wgmma as wgmma_path

from .conftest import EXAMPLES, compiled_listing

CASES = [("attention", dict(b=1, h=2, q=200, x=600, d=32)),  # 10 chunks: the ring wraps; two warpgroups
         ("attention", dict(b=1, h=1, q=64, x=64, d=64)),  # one chunk: the first and the last are one
         ("gqa", dict(b=1, kv=2, r=2, q=130, x=150, d=64)),  # rank-5 Q
         ("attention_lse", dict(b=1, h=1, q=130, x=150, d=32)),
         ("causal_attention", dict(b=1, h=1, q=330, x=600, d=32)),  # each block from its first visited chunk
         ("sliding_window", dict(b=1, h=1, q=600, x=700, d=32))]
BIG = dict(b=4, h=32, q=8192, x=8192, d=128)


def _kernel(name):
    return napkin.load(EXAMPLES / f"{name}.napkin")[name]


def _plan(name, order="pipelined", **sizes):
    program = _kernel(name).gpu_program("H100", **sizes)
    return select_program(program, "sm_90a", schedule=order)[0].plan


def _run(name, sizes, seed, monkeypatch):
    from napkin_dsl.reference import evaluate

    from .test_tensorcore import random_inputs

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    kernel = _kernel(name)
    program = kernel.gpu_program("H100", **sizes)
    assert select_program(program, "sm_90a", schedule="pipelined")[0].plan.roles.order == "pipelined", "napkin bug in the test"
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    monkeypatch.setenv("NAPKIN_EMULATE_SEED", str(seed))
    return program, opencl.run(program, inputs, scalars, arch="sm_90a", overlap="pipelined"), evaluate(kernel.diagram, inputs, scalars, sizes)


# ---- the plan -----------------------------------------------------------------------------------


def test_attention_takes_the_pipelined_order_and_says_so():
    program = _kernel("attention").gpu_program("H100", **BIG)
    chosen = select_program(program, "sm_90a", schedule="pipelined")[0]
    plan = chosen.plan
    assert plan.roles.order == "pipelined" and plan.roles.drained == ("S",) and not plan.order_declined
    parts = wgmma_path.pipeline_parts(plan, program.launches[0], chosen.tile)
    assert (parts.ahead, parts.behind) == ("S", "O") and parts.packed_registers == 16  # 64 keys of bf16 P, 16 rows a warp
    assert parts.parts.count("ahead") >= 1 and parts.parts.count("rescale") == 1 and parts.parts[-1] == "behind"
    source, _ = opencl.generate(_kernel("attention").gpu_program("H100", b=1, h=2, q=256, x=256, d=128), arch="sm_90a",
                                overlap="pipelined")
    assert "pipelined: a chunk's first product issued before the previous chunk's last, which runs under its softmax" in source
    assert "wait: S's product has landed; the previous chunk's O runs under the softmax" in source
    # the default stays serial
    assert _plan("attention", order="serial", **BIG).roles.order == "serial"


@pytest.mark.parametrize("name, reason", [
    ("matmul", "the chunk has 1 products"),
    ("fp8_attention_vt", "a plain tile loaded each chunk (fp8's per-key scales)")])
def test_a_launch_the_order_does_not_fit_keeps_the_serial_one_and_says_why(name, reason):
    kernel = napkin.load(EXAMPLES / f"{name}.napkin")[name]
    sizes = {"matmul": dict(m=1024, n=1024, k=1024), "fp8_attention_vt": dict(b=1, h=2, qb=2, qi=128, x=208, d=64)}[name]
    program = kernel.gpu_program("H100", **sizes)
    plan = select_program(program, "sm_90a", schedule="pipelined")[0].plan
    assert plan.roles.order == "serial" and plan.order_declined.startswith("not pipelined: ") and reason in plan.order_declined
    report = kernel.cost("H100", arch="sm_90a", overlap="pipelined", **sizes)
    assert report.time["overlap"] == "serial" and report.time["chain"][0]["build"] == "roles"
    assert any(note.startswith("launch 0's consumers are built serial, not pipelined") for note in report.notes)


def test_a_tile_whose_packed_p_does_not_fit_is_refused_by_its_registers():
    """The budget is 21/25 of the consumers' setmaxnreg share (paths.wgmma.PIPELINED_SHARE, 201
    of 240): at 128 and 160 keys the packed P fits (166 and 190 registers, which compile with no
    spills), at FA3's 176 not (202: 104 bytes of spills)."""
    for keys, fits in ((128, True), (160, True), (176, False)):
        kernel = _kernel("attention").relabelled(f"smem: group b 1, h 1, q 128; stream x {keys}")
        plan = select_program(kernel.gpu_program("H100", **BIG), "sm_90a", schedule="pipelined")[0].plan
        assert (plan.roles.order == "pipelined") is fits, plan.order_declined
    assert "with P of the previous chunk packed beside S (44 of them; budget 201)" in plan.order_declined


def test_an_unknown_schedule_is_refused_by_name():
    with pytest.raises(napkin.NapkinError, match="no warpgroup schedule 'zigzag' to build"):
        _kernel("attention").compile("sm_90a", hardware="H100", overlap="zigzag", **BIG)
    with pytest.raises(napkin.NapkinError, match="no warpgroup schedule 'zigzag'"):
        opencl.generate(_kernel("attention").gpu_program("H100", **BIG), arch="sm_90a", overlap="zigzag")


# ---- the emulation --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name, sizes", CASES, ids=[f"{c[0]}-{c[1]['x']}" for c in CASES])
def test_every_variant_runs_pipelined_under_every_seed(name, sizes, seed, monkeypatch):
    from .conftest import assert_matches_reference

    program, outputs, expected = _run(name, sizes, seed, monkeypatch)
    assert_matches_reference(program, outputs, expected, name)


def _steady_waits(self):
    """The Wait operations of the steady loop (the second of the three chunk loops)."""
    loops = [op for op in self.lines if isinstance(op, pipeline.Loop)]
    return [op for op in loops[-2].body if isinstance(op, pipeline.Wait) and op.groups is not None]


def _plant(monkeypatch, change):
    original = pipeline.RolesPrinter.pipelined_chunks

    def planted(self, *args):
        original(self, *args)
        change(self)
    monkeypatch.setattr(pipeline.RolesPrinter, "pipelined_chunks", planted)


def _s_read_before_its_wait(monkeypatch):
    # the wait before the softmax lets both groups stay pending: S(c) is read in flight
    def change(self):
        (depth1, _) = _steady_waits(self)
        depth1.groups = 2
    _plant(monkeypatch, change)


def _p_overwritten_before_its_wait(monkeypatch):
    # the packed P's registers changed while P V(c - 1) is in flight, before the wait after the softmax
    def change(self):
        loops = [op for op in self.lines if isinstance(op, pipeline.Loop)]
        body = loops[-2].body
        (_, depth0) = _steady_waits(self)
        body.insert(body.index(depth0), "nk_a_P[0][1] ^= 0x00010001u;")
    _plant(monkeypatch, change)


def _stage_released_before_pv_landed(monkeypatch):
    # the previous chunk's stage released before its P V has read V: the producer refills it
    def change(self):
        loops = [op for op in self.lines if isinstance(op, pipeline.Loop)]
        body = loops[-2].body
        (depth1, _) = _steady_waits(self)
        (release,) = [op for op in body if isinstance(op, str) and "its stage is empty" in op]
        body.remove(release)
        body.insert(body.index(depth1), release)
    _plant(monkeypatch, change)


BUGS = {"S(c) read before its wait": _s_read_before_its_wait,
        "P(c - 1) overwritten before its product was waited": _p_overwritten_before_its_wait,
        "the stage released before P V read it": _stage_released_before_pv_landed}


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_planted_ordering_bug_fails_the_run(bug, seed, monkeypatch):
    BUGS[bug](monkeypatch)
    try:
        # 10 chunks: the ring of 8 wraps, so a stage released early is refilled (and poisoned)
        _, outputs, expected = _run("attention", dict(b=1, h=2, q=130, x=600, d=32), seed, monkeypatch)
    except opencl.RolesFailure as failure:
        assert "deadlock: " in str(failure), failure
        return
    assert not np.allclose(np.nan_to_num(outputs["O"].astype(np.float64), nan=1e9), expected["O"], atol=1e-2)


# ---- the CUDA build and the model -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["attention", "causal_attention"])
def test_the_consumer_loop_issues_both_products_then_waits_s_at_depth_1_and_pv_at_0(name):
    """S(c) and P V(c - 1) committed, then a wait to depth 1 (S landed) and the softmax's row
    maximum, then the wait to depth 0. ptxas places that wait before the exponentials: no PTX
    dependency orders a wait after ALU work, and its scheduler fills the row maximum's latency
    with it. The chain (napkin_dsl/chain.py) prices P V's drain as waited on because of this: if
    ptxas ever runs the exponentials under the product, this test says so."""
    from napkin_dsl.backends import sass

    compiled, instructions = compiled_listing(_kernel(name), overlap="pipelined", **BIG)
    from napkin_dsl.backends import cuda

    # ptxas did not fall back to serializing the products (its C7513 "wgmma ... serialized" remark)
    assert "C7513" not in cuda._compiler("sm_90a", False).compile(compiled.source, "pipelined.cu").log
    consumer = max(sass.innermost_loops(instructions), key=lambda body: sum(i.opcode.startswith("HGMMA") for i in body))
    hot = collections.Counter(i.opcode for i in consumer)
    assert hot["HGMMA.64x64x16.F32.BF16"] == 8 and hot["HGMMA.64x128x16.F32.BF16"] == 4, hot
    waits = [n for n, i in enumerate(consumer) if i.opcode == "WARPGROUP.DEPBAR.LE"]
    assert [consumer[n].operands for n in waits] == ["gsb0, 0x1", "gsb0, 0x0"]
    assert not any(i.opcode.startswith("HGMMA") for i in consumer[waits[0]:])  # both issued before the first wait
    under = collections.Counter(i.opcode.split(".")[0] for i in consumer[waits[0] + 1:waits[1]])
    assert under["FMNMX"] >= 16 and under["MUFU"] == 0, under
    assert not any(op.startswith(("UTMALDG", "BAR.")) for op in hot), hot
    (entry,) = sass.sass_report(compiled)["launches"]
    ceiling = entry["ceiling"]
    wait, drain = (compiled.program.hardware.latency_clocks(n) for n in ("mbarrier_wait", "wgmma_drain"))
    assert ceiling["loop"]["clocks"]["chain"] == pytest.approx(ceiling["loop"]["clocks"]["tensor"] + wait + drain, abs=0.01), ceiling
    assert ceiling["model_tflops"] <= ceiling["tflops"], ceiling


def test_the_model_prices_the_chain_of_the_order_built():
    kernel = _kernel("attention")
    serial = kernel.cost("H100", arch="sm_90a", **BIG)
    pipelined = kernel.cost("H100", arch="sm_90a", overlap="pipelined", **BIG)
    assert pipelined.time["overlap"] == "pipelined"
    chain = pipelined.time["chain"][0]
    assert chain["build"] == "roles, pipelined"
    assert [link["latency"] for link in chain["links"]] == ["mbarrier_wait", "wgmma_drain"]
    assert chain["hidden"] == ["S's drain, under the previous chunk's O product issued behind it (wait_group 1)"]
    assert serial.time["compute_by_unit_s"] == pipelined.time["compute_by_unit_s"]  # the same work
    # the serial order waits on S's drain, its full-barrier wait under P V; the pipelined one on
    # the full barrier and P V's drain, S's under P V
    wait = kernel.program("H100", **BIG).hardware.latency_clocks("mbarrier_wait")
    assert chain["chunk_clocks"] - serial.time["chain"][0]["chunk_clocks"] == pytest.approx(wait, abs=0.2)
    assert "chain of launch 0 (roles, pipelined)" in pipelined.table()


def test_the_cli_builds_the_pipelined_order(capsys):
    from napkin_dsl.cli import main

    sets = ["--set", *(f"{a}={n}" for a, n in dict(b=1, h=2, q=256, x=256, d=64).items())]
    assert main(["cost", str(EXAMPLES / "attention.napkin"), *sets, "--overlap", "pipelined"]) == 0
    assert "chain of launch 0 (roles, pipelined)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["cuda", str(EXAMPLES / "attention.napkin"), *sets, "--overlap", "zigzag"])
    assert exit_.value.code == 2


def test_the_pipelined_consumers_are_clean_under_oclgrind():
    """oclgrind (data races, uninitialized reads) finds nothing in a pipelined run: one consumer
    warpgroup, three chunks (the first, a steady one and the last), a ring that fits oclgrind's
    32 KiB of local memory."""
    from .conftest import assert_clean_under_oclgrind

    assert_clean_under_oclgrind(
        "import numpy as np\n"
        "import napkin_dsl as napkin\n"
        "from napkin_dsl.backends import opencl\n"
        "from napkin_dsl.reference import evaluate\n"
        "from tests.test_tensorcore import random_inputs\n"
        f"kernel = napkin.load({str(EXAMPLES / 'attention.napkin')!r})['attention'].relabelled("
        "'smem: group b 1, h 1, q 64; stream x 64')\n"
        "sizes = dict(b=1, h=1, q=64, x=150, d=16)\n"
        "program = kernel.gpu_program('H100', **sizes)\n"
        "inputs, scalars = random_inputs(kernel.diagram, sizes)\n"
        "out = opencl.run(program, inputs, scalars, arch='sm_90a', overlap='pipelined')['O']\n"
        "want = evaluate(kernel.diagram, inputs, scalars, sizes)['O']\n"
        "print('@@ error', float(np.abs(out.astype(np.float64) - want).max()))\n", 1e-2)
