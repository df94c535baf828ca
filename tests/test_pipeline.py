"""Warp-specialized wgmma kernels (issue 43, step 2): matmul as a producer warpgroup and consumer
warpgroups around a ring of full and empty mbarriers, printed once as roles (backends/pipeline.py).

The CUDA rendering is checked in its SASS: ``USETMAXREG`` in both roles, the only block barrier
before the roles split, and a consumer hot loop of HGMMA with a wait depth of 1 (``WARPGROUP.DEPBAR.LE
gsb0, 0x1``), its try_wait on the full mbarrier and its arrive on the empty one, and no UTMALDG;
the producer's loop issues the boxes. The OpenCL rendering runs on the roles runtime
(backends/roles.py), whose copies and wgmma groups land in rounds a seeded adversary draws, with
their destinations and accumulators poisoned until then: it must match the float64 product at
ragged sizes under several seeds with a ring that wraps, and each ordering bug planted in the
printer must fail the run, by a wrong or poisoned result or by a deadlock named in the error.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import driver, opencl, pipeline
from napkin_dsl.isel import mbarrier_count, selection
from napkin_dsl.paths import wgmma as wgmma_path

from .conftest import EXAMPLES, compiled_listing

MATMUL = EXAMPLES / "matmul.napkin"
# 11 chunks of 32 (the last one 8 deep): the ring (at most 8 stages) wraps, so every stage is
# filled again after the consumers release it, on the next phase.
WRAPPING = dict(m=130, n=136, k=328)


def _program(**sizes):
    return napkin.load(MATMUL)["matmul"].gpu_program("H100", **sizes)


def _run(sizes, seed=1, monkeypatch=None):
    """matmul's output and float64 product on the emulator (tests/test_wgmma.py's run), a roles kernel."""
    from .test_wgmma import _run_opencl

    program = _program(**sizes)
    assert selection(program, program.launches[0], "sm_90a").plan.roles is not None, "napkin bug in the test: not a roles kernel"
    if monkeypatch is not None:
        monkeypatch.setenv("NAPKIN_EMULATE_SEED", str(seed))
    return _run_opencl(sizes)


def _right(out, reference) -> bool:
    return bool(np.isfinite(out).all() and np.abs(out - reference).max() <= 1e-4 * max(1.0, np.abs(reference).max()))


# ---- the plan ---------------------------------------------------------------------------------


def test_matmul_on_sm_90a_is_planned_with_a_producer_and_two_consumers():
    program = _program(m=8192, n=8192, k=8192)
    chosen = selection(program, program.launches[0], "sm_90a")
    plan = chosen.plan
    assert plan.roles == wgmma_path.Roles(consumers=2, wait_depth=1, producer_registers=24, consumer_registers=240)
    assert plan.threads == 384 and plan.stages >= 4
    assert mbarrier_count(plan) == 2 * plan.stages  # a full and an empty mbarrier a stage
    source, (kernel,) = opencl.generate(program, arch="sm_90a")
    # on OpenCL the two consumer warpgroups run in lockstep, one role; the producer on the first's work-items
    assert kernel.roles == ("consumers", "producer") and kernel.block == 256 and len(kernel.barriers) == 2 * plan.stages
    assert f"roles: a producer warpgroup (setmaxnreg.dec 24; one thread issues TMA) and 2 consumer warpgroups " \
           f"(setmaxnreg.inc 240), a {plan.stages}-stage ring of full and empty mbarriers, wgmma.wait_group 1" in source


@pytest.mark.parametrize("consumers", [1, 2, 3, 4])
def test_the_setmaxnreg_budgets_fit_the_register_file(consumers):
    """setmaxnreg takes a multiple of 8 in 24 .. 256 (PTX ISA 9.7.17.1), and the roles' registers
    together fit the SM's 65,536 at one block an SM."""
    program = napkin.load(MATMUL)["matmul"].relabelled(f"smem: group m {64 * consumers}, n 64; stream k 32") \
        .gpu_program("H100", m=1024, n=1024, k=1024)
    roles = selection(program, program.launches[0], "sm_90a").plan.roles
    assert roles.consumers == consumers
    for count in (roles.producer_registers, roles.consumer_registers):
        assert count % 8 == 0 and 24 <= count <= 256
    assert 128 * (roles.producer_registers + consumers * roles.consumer_registers) <= 65536


def test_roles_of_names_what_it_does_not_take():
    from dataclasses import replace

    program = napkin.load(EXAMPLES / "attention.napkin")["attention"].gpu_program("H100", b=1, h=2, q=256, x=256, d=128)
    plan = selection(program, program.launches[0], "sm_90a").plan
    with pytest.raises(wgmma_path.Refusal, match="no TMA ring"):
        wgmma_path.roles_of(replace(plan, tma=(), tma_declined="a test"), program.launches[0])


# ---- the emulation ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("sizes", [WRAPPING, dict(m=200, n=136, k=72), dict(m=64, n=16, k=16)], ids=str)
def test_the_roles_compute_a_times_b_at_ragged_sizes_under_every_seed(sizes, seed, monkeypatch):
    out, reference = _run(sizes, seed, monkeypatch)
    assert _right(out, reference), np.abs(out - reference).max()


def _drop_empty_arrive(monkeypatch):
    monkeypatch.setattr(pipeline.RolesPrinter, "arrive", lambda self, bar: ";")


def _release_the_stage_in_flight(monkeypatch):
    # the stage the product just issued reads, before its group was waited, for the previous one
    original = pipeline.RolesPrinter.arrive
    monkeypatch.setattr(pipeline.RolesPrinter, "arrive", lambda self, bar: original(self, self.empty("nk_stage")))


def _phase_not_flipped(monkeypatch):
    original = pipeline.RolesPrinter.chunk_derived
    monkeypatch.setattr(pipeline.RolesPrinter, "chunk_derived",
                        lambda self, axis, var: [line.replace(f"(unsigned)({var} / {self.plan.stages}) & 1u", "0u")
                                                 for line in original(self, axis, var)])


def _swizzle_differs(monkeypatch):
    # the tensor maps say 64B where the descriptors (and the tiles) say 128B
    monkeypatch.setitem(driver.TENSOR_MAP_SWIZZLE, 128, driver.TENSOR_MAP_SWIZZLE[64])


def _accumulator_read_before_its_wait(monkeypatch):
    original = pipeline.RolesPrinter.stream_loop

    def without_last_wait(self, node):
        original(self, node)
        (at,) = [i for i, op in enumerate(self.lines) if isinstance(op, pipeline.Wait) and op.groups == 0]
        del self.lines[at]
    monkeypatch.setattr(pipeline.RolesPrinter, "stream_loop", without_last_wait)


def _expect_tx_short(monkeypatch):
    monkeypatch.setattr(wgmma_path.TmaLoad, "bytes", property(lambda self: self.boxes * self.box_rows * self.box_cols))


BUGS = {"empty arrive dropped": _drop_empty_arrive, "stage released before its product was waited": _release_the_stage_in_flight,
        "phase not flipped at the wrap": _phase_not_flipped, "tensor map swizzle differs from the descriptor's": _swizzle_differs,
        "accumulator read before its wait": _accumulator_read_before_its_wait, "expect_tx short of the boxes": _expect_tx_short}


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_planted_ordering_bug_fails_the_run(bug, seed, monkeypatch):
    BUGS[bug](monkeypatch)
    try:
        out, reference = _run(WRAPPING, seed, monkeypatch)
    except opencl.RolesFailure as failure:
        assert "deadlock: " in str(failure) and "(seed " in str(failure), failure
        return
    assert not _right(out, reference)


def test_a_deadlock_is_named_by_role_barrier_and_phase(monkeypatch):
    _drop_empty_arrive(monkeypatch)
    with pytest.raises(opencl.RolesFailure, match=r"napkin_matmul_0, block 0 of 4 \(seed 1\): deadlock: consumers wait on "
                                                   r"full\[0\], phase 1; producer waits on empty\[0\], phase 0; 3 more blocks"):
        _run(WRAPPING, 1, monkeypatch)


def test_a_bad_seed_is_a_napkin_error(monkeypatch):
    from napkin_dsl.errors import NapkinError

    monkeypatch.setenv("NAPKIN_EMULATE_SEED", "zero")
    with pytest.raises(NapkinError, match="NAPKIN_EMULATE_SEED is 'zero'; it takes a positive integer"):
        opencl.build_options()


def test_the_roles_are_clean_under_oclgrind():
    """oclgrind (data races, uninitialized reads) finds nothing in a run of the roles kernel: a
    64 x 64 tile (one consumer) whose ring fits oclgrind's 32 KiB of local memory."""
    from .conftest import assert_clean_under_oclgrind

    assert_clean_under_oclgrind(
        "import numpy as np, ml_dtypes\n"
        "import napkin_dsl as napkin\n"
        "from napkin_dsl.backends import opencl\n"
        f"kernel = napkin.load({str(MATMUL)!r})['matmul'].relabelled('smem: group m 64, n 64; stream k 16')\n"
        "program = kernel.gpu_program('H100', m=64, n=64, k=56)\n"
        "assert opencl.generate(program, arch='sm_90a')[1][0].roles\n"
        "rng = np.random.default_rng(0)\n"
        "a = rng.standard_normal((64, 56)).astype(ml_dtypes.bfloat16)\n"
        "b = rng.standard_normal((56, 64)).astype(ml_dtypes.bfloat16)\n"
        "out = opencl.run(program, {'A': a, 'B': b}, arch='sm_90a')['C']\n"
        "print('@@ error', float(np.abs(out - a.astype(np.float64) @ b.astype(np.float64)).max()))\n", 1e-3)


# ---- the CUDA rendering, in its SASS ------------------------------------------------------------


def test_matmul_8192_has_a_producer_and_a_consumer_loop_with_wait_depth_1_and_one_block_barrier():
    from napkin_dsl.backends import sass

    compiled, instructions = compiled_listing(napkin.load(MATMUL)["matmul"], m=8192, n=8192, k=8192)
    # what `napkin cuda --sass` and benchmarks/bench_sass.py report of the roles
    (entry,) = sass.sass_report(compiled, ceiling=False)["launches"]
    roles = entry["roles"]
    assert roles["setmaxnreg"] == {"DEALLOC": 24, "TRY_ALLOC": 240}
    assert roles["consumer_loop"]["hgmma"] == 2 and roles["consumer_loop"]["wait_depths"] == [1]
    assert roles["consumer_loop"]["utmaldg"] == roles["consumer_loop"]["block_barriers"] == 0
    assert roles["producer_loop"]["utmaldg"] == 3
    assert "consumers' loop" in "\n".join(sass.format_roles(roles))
    opcodes = collections.Counter(i.opcode for i in instructions)
    assert opcodes["USETMAXREG.DEALLOC.CTAPOOL"] == 1 and opcodes["USETMAXREG.TRY_ALLOC.CTAPOOL"] == 1, opcodes
    # one block barrier (the mbarriers' initialisation, before the roles split); the epilogue's
    # staged save passes barriers among the 256 consumer threads only (id 1)
    barriers = collections.Counter(i.operands for i in instructions if i.opcode.startswith("BAR."))
    assert barriers["0x0"] == 1 and set(barriers) == {"0x0", "0x1, 0x100"}, barriers
    assert not any(op.startswith(("LDL", "STL", "LDGSTS")) for op in opcodes)
    loops = sass.innermost_loops(instructions)
    consumer = max(loops, key=lambda body: sum(i.opcode.startswith("HGMMA") for i in body))
    hot = collections.Counter(i.opcode for i in consumer)
    assert sum(n for op, n in hot.items() if op.startswith("HGMMA")) == 2  # k 32: two m64n128k16
    assert [i.operands for i in consumer if i.opcode == "WARPGROUP.DEPBAR.LE"] == ["gsb0, 0x1"]
    assert hot["SYNCS.PHASECHK.TRANS64.TRYWAIT"] == 1 and hot["SYNCS.ARRIVE.TRANS64.A1T0"] == 1, hot  # full's wait, empty's arrive
    assert not any(op.startswith(("UTMALDG", "BAR.")) for op in hot), hot
    # the producer's loop: A's box and B's two a chunk, and no product
    assert any(sum(i.opcode.startswith("UTMALDG") for i in instructions if start <= i.address <= end) == 3
               and not any(i.opcode.startswith("HGMMA") for i in instructions if start <= i.address <= end)
               for start, end in sass.loop_ranges(instructions))


# ---- the epilogue launches: mlp's bias and GELU, swiglu's dual GEMM and its down projection -------


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name, sizes", [("mlp", dict(b=130, k=328, n=136)), ("swiglu", dict(t=200, m=328, f=136, e=136))])
def test_the_epilogue_launches_run_as_roles(name, sizes, seed, monkeypatch):
    """Under three seeds: mlp reads its bias elementwise from shared memory behind a barrier among the consumers (a
    named one on CUDA, ``bar.sync 1, 256``); swiglu's first launch commits two products a chunk
    (G and U on one stage of X) and its second reads H."""
    from napkin_dsl.reference import evaluate

    from .conftest import assert_matches_reference
    from .test_opencl import random_inputs

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    kernel = napkin.load(EXAMPLES / f"{name}.napkin")[name]
    program = kernel.gpu_program("H100", **sizes)
    assert all(k.roles for k in opencl.generate(program, arch="sm_90a")[1])
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    monkeypatch.setenv("NAPKIN_EMULATE_SEED", str(seed))
    assert_matches_reference(program, opencl.run(program, inputs, scalars, arch="sm_90a"),
                             evaluate(kernel.diagram, inputs, scalars, sizes))


# ---- attention: the softmax between its two products, P from registers, Q by one copy ----------


ATTENTION_CASES = [("attention", dict(b=1, h=2, q=200, x=600, d=32)),  # 10 chunks: the ring wraps; two warpgroups
                   ("gqa", dict(b=1, kv=2, r=2, q=130, x=150, d=64)),  # rank-5 Q
                   ("attention_lse", dict(b=1, h=1, q=130, x=150, d=32)),
                   # masked: each block's ring from the first chunk it visits to its last
                   ("causal_attention", dict(b=1, h=1, q=330, x=600, d=32)),
                   ("sliding_window", dict(b=1, h=1, q=600, x=700, d=32))]


def _attention(name, sizes, seed, monkeypatch):
    """An attention example on the emulator under ``seed`` (tests/test_wgmma_attention.py's run), a roles kernel."""
    from .test_wgmma_attention import _run as run_attention

    monkeypatch.setenv("NAPKIN_EMULATE_SEED", str(seed))
    program, outputs, expected = run_attention(name, sizes)
    assert selection(program, program.launches[0], "sm_90a").plan.roles is not None, "napkin bug in the test: not a roles kernel"
    return program, outputs, expected


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name, sizes", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_attention_runs_as_roles_under_every_seed(name, sizes, seed, monkeypatch):
    from .conftest import assert_matches_reference

    program, outputs, expected = _attention(name, sizes, seed, monkeypatch)
    assert_matches_reference(program, outputs, expected, name)


def test_the_softmax_waits_for_s_and_the_consumers_leave_pv_in_flight():
    program = napkin.load(EXAMPLES / "attention.napkin")["attention"].gpu_program("H100", b=1, h=2, q=256, x=256, d=128)
    source, _ = opencl.generate(program, arch="sm_90a")
    assert "wait: S's product has landed" in source and "wait: the previous chunk's products have landed" in source


def _clobber_p(monkeypatch):
    # P's registers overwritten after its product was issued and before it was waited for
    original = pipeline.RolesPrinter.mma

    def clobbered(self, target, out):
        original(self, target, out)
        if self.plan.mmas[target].a_in_registers:
            self.emit("nk_a_P[0][1] ^= 0x00010001u;")
    monkeypatch.setattr(pipeline.RolesPrinter, "mma", clobbered)


def _s_left_in_flight(monkeypatch):
    # a wait depth of 1 after S, which the softmax reads: the depth 0 it needs, dropped
    from napkin_dsl.paths import wgmma as wgmma_path

    monkeypatch.setattr(wgmma_path, "drained_products", lambda plan, launch: ())


def _q_parity(monkeypatch):
    original = pipeline.RolesPrinter.load

    def parity_one(self, name, origin=None, stage=None, commit=True):
        start = len(self.lines)
        original(self, name, origin, stage, commit)
        for op in self.lines[start:]:
            if isinstance(op, pipeline.Wait):
                op.parity = "1"
    monkeypatch.setattr(pipeline.RolesPrinter, "load", parity_one)


def _coordinates_outermost_first(monkeypatch):
    from napkin_dsl.backends import wgmma

    original = wgmma.WgmmaPrinter.tma_boxes
    monkeypatch.setattr(wgmma.WgmmaPrinter, "tma_boxes",
                        lambda self, name, origin, stage: [(box, dst, coords[::-1]) for box, dst, coords in original(self, name, origin, stage)])


ATTENTION_BUGS = {"P's registers overwritten before its wait": _clobber_p, "S read at a wait depth of 1": _s_left_in_flight,
                  "coordinates outermost first": _coordinates_outermost_first}


def _attention_fails(seed, monkeypatch) -> bool:
    try:
        _, outputs, expected = _attention("attention", dict(b=1, h=2, q=130, x=330, d=32), seed, monkeypatch)
    except opencl.RolesFailure as failure:
        assert "deadlock: " in str(failure), failure
        return True
    return not np.allclose(np.nan_to_num(outputs["O"].astype(np.float64), nan=1e9), expected["O"], atol=1e-2)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("bug", sorted(ATTENTION_BUGS))
def test_each_planted_attention_bug_fails_the_run(bug, seed, monkeypatch):
    ATTENTION_BUGS[bug](monkeypatch)
    assert _attention_fails(seed, monkeypatch)


# ---- fp8 attention on the roles: an 8-bit register A, and a per-key scale loaded each chunk -------

FP8_SIZES = dict(b=1, h=2, qb=2, qi=128, x=208, d=64)  # two consumer warpgroups; the last of 4 chunks 16 keys


def _fp8_attention(seed, monkeypatch, sizes=FP8_SIZES):
    from napkin_dsl.backends.numpy import random_arguments
    from napkin_dsl.reference import evaluate

    (kernel,) = napkin.load(EXAMPLES / "fp8_attention_vt.napkin").values()
    program = kernel.gpu_program("H100", **sizes)
    arrays, scalars = random_arguments(kernel.diagram, sizes, seed)
    monkeypatch.setenv("NAPKIN_EMULATE_SEED", str(seed))
    outputs = opencl.run(program, arrays, scalars, arch="sm_90a")
    return program, outputs, evaluate(kernel.diagram, arrays, scalars, sizes)


def test_fp8_attention_with_v_keys_fastest_is_planned_on_the_roles():
    """V [d x]: read as stored, no K-major copy. P's 8-bit register A is exchanged within quads
    on the consumers' lanes, and sK, a vector a chunk, sits between two consumer barriers."""
    (kernel,) = napkin.load(EXAMPLES / "fp8_attention_vt.napkin").values()
    program = kernel.gpu_program("H100", **FP8_SIZES)
    plan = selection(program, program.launches[0], "sm_90a").plan
    assert plan.roles is not None and plan.roles.consumers == 2
    assert plan.roles.drained == ("S",) and plan.roles.vectors == ("sK",)
    # V stored [x d] under an 8-bit P: a K-major copy each chunk, which the roles do not take yet
    (other,) = napkin.load(EXAMPLES / "fp8_attention.napkin").values()
    program = other.gpu_program("H100", **FP8_SIZES)
    assert "K-major copy" in selection(program, program.launches[0], "sm_90a").plan.roles_declined


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fp8_attention_runs_as_roles_under_every_seed(seed, monkeypatch):
    from .conftest import assert_matches_reference

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    program, outputs, expected = _fp8_attention(seed, monkeypatch)
    assert_matches_reference(program, outputs, expected, "fp8_attention_vt")


def test_an_8_bit_p_overwritten_before_its_wait_fails_the_run(monkeypatch):
    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    _clobber_p(monkeypatch)
    _, outputs, expected = _fp8_attention(1, monkeypatch)
    assert not np.allclose(np.nan_to_num(outputs["O"].astype(np.float64), nan=1e9), expected["O"], atol=5e-2)


def test_fp8_attentions_consumer_loop_has_qgmma_and_only_the_consumers_barriers():
    from napkin_dsl.backends import sass

    (kernel,) = napkin.load(EXAMPLES / "fp8_attention_vt.napkin").values()
    compiled, instructions = compiled_listing(kernel, b=4, h=32, qb=64, qi=128, x=8192, d=128)
    (entry,) = sass.sass_report(compiled)["launches"]
    consumer = entry["roles"]["consumer_loop"]
    assert entry["roles"]["setmaxnreg"] == {"DEALLOC": 24, "TRY_ALLOC": 240}
    assert consumer["hgmma"] > 0 and consumer["wait_depths"] == [0, 1], consumer
    assert consumer["utmaldg"] == consumer["block_barriers"] == 0 and consumer["consumer_barriers"] == 2, consumer
    ceiling = entry["ceiling"]
    assert ceiling["model_tflops"] <= ceiling["tflops"], ceiling
    assert [link["latency"] for link in compiled.cost.time["chain"][0]["links"]] == ["wgmma_drain", "bar_sync", "bar_sync"]


def test_q_waited_at_the_wrong_phase_fails_where_the_adversary_lands_q_late(monkeypatch):
    """The wait passes at once and the products may read Q before it lands: a race the adversary
    exposes where it lands Q after the first K stage (some seeds; the hardware, some runs)."""
    _q_parity(monkeypatch)
    assert any(_attention_fails(seed, monkeypatch) for seed in (1, 2, 3, 4))


@pytest.mark.parametrize("name, sizes", [("attention", dict(b=4, h=32, q=8192, x=8192, d=128)),
                                         ("gqa", dict(b=4, kv=8, r=4, q=8192, x=8192, d=128)),
                                         ("causal_attention", dict(b=4, h=32, q=8192, x=8192, d=128)),
                                         ("sliding_window", dict(b=4, h=32, q=8192, x=8192, d=128))])
def test_attentions_consumer_loop_waits_s_to_depth_0_and_pv_to_1_with_no_copy_or_block_barrier(name, sizes):
    from napkin_dsl.backends import sass

    compiled, instructions = compiled_listing(napkin.load(EXAMPLES / f"{name}.napkin")[name], **sizes)
    opcodes = collections.Counter(i.opcode for i in instructions)
    assert opcodes["USETMAXREG.DEALLOC.CTAPOOL"] == 1 and opcodes["USETMAXREG.TRY_ALLOC.CTAPOOL"] == 1, opcodes
    consumer = max(sass.innermost_loops(instructions), key=lambda body: sum(i.opcode.startswith("HGMMA") for i in body))
    hot = collections.Counter(i.opcode for i in consumer)
    # a chunk: S's 8 HGMMA.64x64x16 (d 128), O's 4 HGMMA.64x128x16 (64 keys)
    assert hot["HGMMA.64x64x16.F32.BF16"] == 8 and hot["HGMMA.64x128x16.F32.BF16"] == 4, hot
    assert [i.operands for i in consumer if i.opcode == "WARPGROUP.DEPBAR.LE"] == ["gsb0, 0x0", "gsb0, 0x1"]
    assert hot["SYNCS.PHASECHK.TRANS64.TRYWAIT"] == 1 and hot["SYNCS.ARRIVE.TRANS64.A1T0"] == 1, hot
    assert not any(op.startswith(("UTMALDG", "BAR.")) for op in hot), hot
    # the static ceiling holds S's drain as the model does (the chain), and the model is under it
    (entry,) = sass.sass_report(compiled)["launches"]
    ceiling = entry["ceiling"]
    drain = compiled.program.hardware.latency_clocks("wgmma_drain")
    assert ceiling["loop"]["clocks"]["chain"] == pytest.approx(ceiling["loop"]["clocks"]["tensor"] + drain, abs=0.01), ceiling
    assert ceiling["model_tflops"] <= ceiling["tflops"], ceiling


def test_the_tuned_matmul_8192_is_predicted_over_700_tflops_and_under_its_own_ceiling():
    """matmul with no relabel block takes the tuner's tiles (128 x 256, k chunks of 64 on H100:
    FlashAttention-3's and CUTLASS's two consumer warpgroups of 64 x 256): on the roles, with
    at least 4 stages, the model predicts at least 700 TFLOP/s, and no more than the static
    ceiling of the kernel it builds."""
    from napkin_dsl.backends import sass

    source = MATMUL.read_text().split("relabel")[0]
    kernel = napkin.load(source)["matmul"]
    compiled, _ = compiled_listing(kernel, m=8192, n=8192, k=8192)
    plan = compiled.selection[0].plan
    assert plan.roles is not None and plan.roles.consumers == 2 and plan.stages >= 4, plan
    (entry,) = sass.sass_report(compiled)["launches"]
    ceiling = entry["ceiling"]
    assert ceiling["binding"] == "tensor", ceiling
    assert 700 <= ceiling["model_tflops"] <= ceiling["tflops"], ceiling
    roles = entry["roles"]
    assert roles["setmaxnreg"] == {"DEALLOC": 24, "TRY_ALLOC": 240}
    consumer = roles["consumer_loop"]
    assert consumer["wait_depths"] == [1] and consumer["utmaldg"] == consumer["block_barriers"] == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_tuned_tile_runs_as_roles_at_ragged_sizes(seed, monkeypatch):
    """The tuner's 128 x 256 tile, k chunks of 64: B in four 64-column boxes a stage, the ring wrapping."""
    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    sizes = dict(m=130, n=264, k=584)  # 10 chunks of 64, the last one 8 deep
    program = napkin.load(MATMUL)["matmul"].relabelled("smem: group m 128, n 256; stream k 64").gpu_program("H100", **sizes)
    plan = selection(program, program.launches[0], "sm_90a").plan
    assert plan.roles is not None and -(-sizes["k"] // 64) > plan.stages
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((sizes["m"], sizes["k"])).astype(np.float32).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((sizes["k"], sizes["n"])).astype(np.float32).astype(ml_dtypes.bfloat16)
    monkeypatch.setenv("NAPKIN_EMULATE_SEED", str(seed))
    out = opencl.run(program, {"A": a, "B": b}, arch="sm_90a")["C"]
    assert _right(out, a.astype(np.float64) @ b.astype(np.float64))


# ---- the synchronous ring, kept as a choice (the build to compare the roles with) -------------


def test_the_synchronous_ring_is_a_choice_that_says_so():
    from napkin_dsl.isel import select_program

    program = napkin.load(EXAMPLES / "attention.napkin")["attention"].gpu_program("H100", b=1, h=2, q=256, x=256, d=128)
    plan = select_program(program, "sm_90a", synchronous=True)[0].plan
    assert plan.roles is None and plan.roles_declined == "the synchronous ring was asked for" and plan.stages == 2
    assert plan.threads == 256  # no producer warpgroup
    source, (kernel,) = opencl.generate(program, arch="sm_90a", synchronous=True)
    assert not kernel.roles and "synchronous ring, no producer warpgroup: the synchronous ring was asked for" in source


@pytest.mark.parametrize("name, sizes", [("attention", dict(b=1, h=2, q=130, x=150, d=32)),
                                         ("causal_attention", dict(b=1, h=1, q=200, x=150, d=32))])
def test_the_synchronous_ring_still_runs_on_pocl(name, sizes):
    from napkin_dsl.reference import evaluate

    from .conftest import assert_matches_reference
    from .test_opencl import random_inputs

    if not opencl.opencl_available():
        pytest.skip("no OpenCL device")
    kernel = napkin.load(EXAMPLES / f"{name}.napkin")[name]
    program = kernel.gpu_program("H100", **sizes)
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(program, inputs, scalars, arch="sm_90a", synchronous=True)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), name)


def test_the_synchronous_build_issues_its_copies_in_the_loop_it_computes_in():
    """What the roles replaced, in the SASS: no USETMAXREG, and the chunk loop of the HGMMAs holds
    the UTMALDGs and a block barrier."""
    from napkin_dsl.backends import sass

    pytest.importorskip("cuda.bindings")
    compiled = napkin.load(MATMUL)["matmul"].compile("sm_90a", hardware="H100", synchronous=True, m=8192, n=8192, k=8192)
    try:
        (instructions,) = sass.disassemble(compiled.image).values()
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm")
    assert not any(i.base == "USETMAXREG" for i in instructions)
    assert compiled.launches[0].block == 256 and not compiled.launches[0].roles
    loop = max(sass.tensor_loops(instructions), key=lambda body: sum(i.base == "HGMMA" for i in body))
    assert any(i.base == "UTMALDG" for i in loop) and any(i.base == "BAR" for i in loop)
    # its chain (napkin_dsl/chain.py) binds the static ceiling and the model alike: one chunk in
    # flight, a chunk waits on its copy; the model is at most that ceiling
    (entry,) = sass.sass_report(compiled)["launches"]
    ceiling = entry["ceiling"]
    assert ceiling["binding"] == "chain", ceiling
    assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9), ceiling
    assert compiled.cost.time["chain"][0]["build"] == "synchronous ring"
