"""FA2's backward on tensor cores (issue 24): the key launch of a derived backward (dK and dV
grouped over the keys, streaming the queries) runs on mma.sync.

* Selection: the per-query vectors the key launch streams with the queries (the saved lse L,
  FA2's D, the lse cotangent dL) are plain shared tiles read elementwise by the fragments, which
  the tensor-core printer loads (it used to refuse them); the model picks the key launch's query
  chunk (``Kernel.backward_options``), and at d=128 only a 16-query chunk lets S and dP fit
  beside the whole dK and dV accumulators.
* The printer loads a chunk's vectors together at its top behind one barrier
  (``TensorPrinter.chunk_vectors``).
* Correctness: PoCL runs of the OpenCL emulation against the float64 reference and against the
  NumPy backend running the same Program, at odd chunk counts and a ragged query tail (one
  barrier per vector there was miscompiled by PoCL's default work-group method at odd chunk
  counts: dK came out wrong on some rows).
* SASS: HMMA in the key launch's hot loop, no spills, no local memory, and the model's
  prediction under each launch's static ceiling, vectors' shared-memory reads included
  (``cost.register_vector_reads``).
"""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import numpy as numpy_backend
from napkin_dsl.backends import opencl
from napkin_dsl.isel import select_program
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES, assert_matches_reference, has_nvdisasm

LONG = dict(b=4, h=32, q=8192, x=8192, d=128)


def forward():
    (kernel,) = napkin.load(EXAMPLES / "attention_lse.napkin").values()
    return kernel


def consistent_inputs(backward, sizes: dict, seed: int = 0) -> dict:
    """The backward's inputs as training gives them: O and L from the forward on the same Q, K, V,
    and random cotangents (random O and L would make exp(S - L) overflow)."""
    rng = np.random.default_rng(seed)
    shape = {a: sizes[a] for a in sizes}
    Q, K, V = (rng.standard_normal((shape["b"], shape["h"], shape[a], shape["d"])).astype(np.float32) for a in "qxx")
    out = evaluate(forward().diagram, dict(Q=Q, K=K, V=V), {}, sizes)
    inputs = dict(Q=Q, K=K, V=V, O=out["O"].astype(np.float32), L=out["L"].astype(np.float32),
                  dO=rng.standard_normal(Q.shape).astype(np.float32),
                  dL=rng.standard_normal(out["L"].shape).astype(np.float32))
    return {name: inputs[name] for name in backward.diagram.params}


def key_clause(backward) -> str:
    (line,) = [line for line in backward.source.splitlines() if "for dK, dV" in line]
    return line.strip()


def test_the_model_picks_a_query_chunk_that_puts_the_key_launch_on_tensor_cores():
    """On A100 (mma.sync; on H100 both launches run on wgmma: tests/test_grad_wgmma.py)."""
    backward = forward().grad(hardware="A100", **LONG)
    assert key_clause(backward).endswith("stream q 16")
    selected = select_program(backward.gpu_program(None, **LONG), "sm_80")
    assert selected.paths == ("fma", "mma.sync", "fma")  # D, the key launch (dQ summed there too), dQ's cast
    # the forward's 64-query chunk would hold S and dP beside dK and dV: over the budget, on FMA
    wide = forward().grad(key_stream=64)
    assert key_clause(wide).endswith("stream q 64")
    refused = select_program(wide.gpu_program(None, **LONG), "sm_80")[1]
    assert refused.path == "fma" and "fragment registers" in refused.reason
    options = forward().backward_options("A100", **LONG)
    assert options[0].key_stream == 16 and options[0].rewrite_d
    by_chunk = {o.key_stream: o.seconds for o in options if o.rewrite_d and not o.save and o.sum_dq}
    assert by_chunk[16] < by_chunk[32] and by_chunk[16] < by_chunk[64]


def test_the_chunk_loads_its_vectors_together_behind_one_barrier():
    backward = forward().grad(key_stream=16, sum_dq=False)  # dQ's staging has barriers of its own
    program = backward.gpu_program(None, b=1, h=1, q=48, x=195, d=64)
    _, kernels = opencl.generate(program, arch="sm_80")
    body = kernels[1].text.split("// buffer 0", 1)[1].split("// buffer 1", 1)[0]
    loads = [name for name in ("L", "dL", "D") if f"// load {name} of this chunk" in body]
    assert loads == ["L", "dL", "D"]
    # the chunk's top barrier and the vectors' one: none between the vectors' loads
    first, last = body.index("// load L of this chunk"), body.index("// load D of this chunk")
    assert "barrier(" not in body[first:last] and "NK_SYNC" not in body[first:last]
    assert body.count("NK_SYNC();") == 2


# 16-query chunks: 3 with a ragged tail, 3 full, 4; dQ summed over the key groups in the key launch
# (its 32 x 64 tile gives each of the 8 warps a 16 x 16 one): 2 chunks with a ragged tail, 2 full
@pytest.mark.parametrize("q, sum_dq", [(40, False), (48, False), (64, False), (40, True), (64, True)])
def test_the_key_launch_on_mma_sync_matches_the_reference_and_the_numpy_backend_on_pocl(q, sum_dq, opencl_device):
    backward = forward().grad(key_stream=32 if sum_dq else 16, sum_dq=sum_dq)
    assert bool(backward.derivation.schedule.summed) == sum_dq
    sizes = dict(b=1, h=1, q=q, x=195, d=64)
    program = backward.gpu_program(None, **sizes)
    assert select_program(program, "sm_80")[1].path == "mma.sync"
    inputs = consistent_inputs(backward, sizes)
    outputs = opencl.run(program, inputs, {}, arch="sm_80")
    assert_matches_reference(program, outputs, evaluate(backward.diagram, inputs, {}, sizes), f"q={q}")
    # the NumPy backend runs the same Program itself: the two agree to the bf16 outputs' rounding
    # and the tensor-core path's bf16 packing of P and dS
    interpreted, _ = numpy_backend.execute(program, inputs, {})
    for name in ("dQ", "dK", "dV"):
        got, want = outputs[name].astype(np.float64), interpreted[name].astype(np.float64)
        assert np.abs(got - want).max() <= 4 * 2.0**-8 * np.abs(want).max(), name


def attention_backward():
    """examples/attention.napkin's backward as the model picks it at LONG on A100: the forward adds
    L, and the key launch sums dQ."""
    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    return kernel.grad(hardware="A100", **LONG)


@pytest.mark.parametrize("which", ["attention_lse", "attention"])
@pytest.mark.parametrize("arch, hardware", [("sm_80", "A100"), ("sm_90", "H100")])
def test_the_backward_compiles_with_hmma_no_spills_and_the_model_under_each_ceiling(arch, hardware, which):
    """Issue 24's done-when: the attention backward compiles for sm_80 and sm_90 with HMMA, LDSM and
    LDGSTS in its hot loops, 0 spills and no local memory."""
    pytest.importorskip("cuda.bindings")
    backward = forward().grad(key_stream=16) if which == "attention_lse" else attention_backward()
    built = backward.compile(arch, hardware, **LONG)
    table = built.launch_table()
    assert [row["path"] for row in table] == ["fma", "mma.sync", "fma"]  # D, the key launch summing dQ, dQ's cast
    assert all(row["spill_bytes"] == 0 for row in table), table
    if not has_nvdisasm():
        return
    from napkin_dsl.backends.sass import hot_loop, sass_report

    report = sass_report(built)
    for launch in report["launches"][1:2]:
        loop = hot_loop(launch)
        assert loop["classes"].get("tensor", 0) > 0, launch["entry"]
        assert loop["classes"].get("ldsm", 0) > 0 and loop["classes"].get("ldgsts", 0) > 0, (launch["entry"], loop["classes"])
        assert launch["whole"].get("local", 0) == 0
        ceiling = launch["ceiling"]
        assert not ceiling["whole_function"], launch["entry"]  # the chunk loop is the hot loop
        assert ceiling["model_tflops"] <= ceiling["tflops"] * (1 + 1e-9), (launch["entry"], ceiling)


def test_the_numpy_backend_counts_the_vectors_reads_as_the_model_prices_them():
    """The key launch's L, D and dL reads from shared memory, one a fragment element, counted by
    the NumPy backend running the Program equal the model's register-level H."""
    from napkin_dsl.backends.numpy import check_run

    backward = forward().grad(key_stream=32)  # dQ summed in the key launch: its adds and its staged dS counted too
    assert backward.derivation.schedule.summed
    sizes = dict(b=1, h=1, q=40, x=195, d=64)
    result = check_run(backward, sizes=sizes, seed=2)
    assert not result["count_differences"], result["count_differences"]
    # ... and the vectors' reads are in what both count: the key launch's elementwise steps read L, D
    from napkin_dsl.cost import plain_tiles, register_vector_reads
    from napkin_dsl.pseudocode import walk

    program = backward.gpu_program(None, **sizes)
    key = program.launches[1]
    plan = select_program(program)[1].plan
    loaded = plain_tiles(key, program.schedule.compute_level)
    assert {"L", "D"} <= loaded
    reads = [r for step, loops in walk(key.body) for r in register_vector_reads(program, step, loops, plan, loaded)]
    assert reads and all(size == 4 for _, size in reads)  # f32 vectors, one value a fragment element
