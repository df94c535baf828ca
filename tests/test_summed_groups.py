"""A group partition of an axis a contraction consumes (issue 47, item 1): each group computes a
partial sum, and adds it into the output in device memory, which the launcher zeroes first.

Split-K without a combine launch (``group k`` of a matmul), and FlashAttention-2's dQ in the key
launch: grouped over the keys x, streaming the queries q, each key group adds its dS K product
for the chunk into dQ. The NumPy backend adds the partial sums as the Program says
(``Step.add``) and counts what it moves, which equals the model's count; the OpenCL kernels add
them by a compare-and-swap loop, the CUDA kernels by atomicAdd.
"""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import isel
from napkin_dsl.backends import opencl
from napkin_dsl.backends.lowering import OpenCLDialect
from napkin_dsl.backends.numpy import execute, random_arguments
from napkin_dsl.cost import cost_of
from napkin_dsl.errors import RelabelError
from napkin_dsl.pseudocode import walk
from napkin_dsl.reference import evaluate

from .test_numpy_backend import assert_counts_equal_report
from .test_opencl import run_on_pocl

SPLIT_K = """kernel mm(A: bf16[m k], B: bf16[k n]) -> C: f32[m n]:
    C[m n] = A[m k] * B[k n]

relabel mm on H100:
    smem: group m 32, n 32, k 64
"""

# FlashAttention-2's key launch in miniature: Y (dV's place) accumulates over the streamed q in
# each group of x; Z (dQ's place) is computed per chunk of q and summed over the groups of x.
KEY_LAUNCH = """kernel kq(A: f32[q x], B: f32[x d], C: f32[q d]) -> (Y: f32[x d], Z: f32[q d]):
    Y[x d] = A[q x] * C[q d]
    Z[q d] = A[q x] * B[x d]

relabel kq on H100:
    smem: group x 32; stream q 16
"""

# f32 operands: the FMA path (tensor cores: TENSOR_SPLIT_K below)
CASES = {"split-K by groups": (SPLIT_K.replace("bf16", "f32"), dict(m=64, n=40, k=200)),
         "dQ in the key launch": (KEY_LAUNCH, dict(q=50, x=70, d=24))}


def _kernel(text: str) -> napkin.Kernel:
    (kernel,) = napkin.load(text).values()
    return kernel


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_groups_partial_sums_add_up_and_count_as_the_model_prices(case):
    text, sizes = CASES[case]
    kernel = _kernel(text)
    program = kernel.program("H100", **sizes)
    added = [step for step, _ in walk(program.launches[0].body) if step.add]
    assert {step.op for step in added} == {"alloc", "save"} and all(step.array in ("C", "Z") for step in added)
    arrays, scalars = random_arguments(kernel.diagram, sizes, 0)
    outputs, counts = execute(program, arrays, scalars)
    expected = evaluate(kernel.diagram, arrays, scalars, sizes, keep_float64=True)
    for name, want in expected.items():
        np.testing.assert_allclose(outputs[name].astype(np.float64), want, rtol=1e-5, atol=1e-5)
    assert_counts_equal_report(counts, cost_of(program, check=False))


def test_the_pseudocode_says_each_group_adds():
    text = _kernel(SPLIT_K).pseudocode(hardware="H100", m=64, n=40, k=200)
    assert "allocate C tile, zeroed" in text
    assert "add C[m n] smem -> l2  (each group of k adds its partial sum)" in text


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_opencl_kernels_add_atomically(case, opencl_device):
    text, sizes = CASES[case]
    program, _ = run_on_pocl(text, case, ["fma"], arch="sm_80", **sizes)
    source, _ = opencl.generate(program, arch="sm_80")
    assert "nk_atomic_add_f32(&g_" in source


def test_a_plain_store_in_place_of_the_atomic_add_is_caught(opencl_device, monkeypatch):
    """A planted bug: each group stores its partial sum over the others'. The result is the last
    group's alone, and leaves the reference."""
    monkeypatch.setattr(OpenCLDialect, "atomic_add", lambda self, ptr, index, value: f"{ptr}[{index}] = {value};")
    text, sizes = CASES["split-K by groups"]
    with pytest.raises(AssertionError):
        run_on_pocl(text, "planted", ["fma"], arch="sm_80", **sizes)


def test_the_cuda_kernel_adds_with_atomicadd_into_an_output_the_launcher_zeroes():
    pytest.importorskip("cuda.bindings")
    compiled = _kernel(CASES["split-K by groups"][0]).compile(arch="sm_80", m=64, n=40, k=200)
    assert "atomicAdd(&g_C[" in compiled.source
    (launch,) = compiled.launches
    assert launch.zeroed == ("C",)
    (row,) = compiled.launch_table()
    assert row["path"] == "fma" and row["spill_bytes"] == 0


TENSOR_SPLIT_K = SPLIT_K.replace("group m 32, n 32, k 64", "group m 64, n 64, k 64")


@pytest.mark.parametrize("arch, path", [("sm_80", "mma.sync"), ("sm_90a", "wgmma")])
def test_tensor_cores_add_each_groups_partial_sum_from_their_fragments(arch, path, opencl_device):
    """On tensor cores each thread adds its accumulator fragments' values into C, at ragged sizes
    (k = 400: six groups of 64 and one of 16)."""
    program, _ = run_on_pocl(TENSOR_SPLIT_K, path, [path], arch=arch, m=128, n=72, k=400)
    source, _ = opencl.generate(program, arch=arch)
    assert "nk_atomic_add_f32(&g_C[" in source and "NK_ST16(g_C" not in source


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_tensor_core_kernels_compile_their_atomic_adds(arch):
    pytest.importorskip("cuda.bindings")
    compiled = _kernel(TENSOR_SPLIT_K).compile(arch=arch, m=1024, n=1024, k=8192)
    (row,) = compiled.launch_table()
    assert row["path"] == ("wgmma" if arch == "sm_90a" else "mma.sync") and row["spill_bytes"] == 0, row
    assert "atomicAdd(&g_C[" in compiled.source and compiled.launches[0].zeroed == ("C",)


@pytest.mark.parametrize("text, message", [
    (SPLIT_K.replace("C: f32", "C: bf16"), "C is f32 (it is bf16: the groups add atomically in f32"),
    ("""kernel mm(A: f32[m k], B: f32[k n]) -> D: f32[m n]:
    C[m n] = A[m k] * B[k n]
    D[m n] = C * 2

relabel mm on H100:
    smem: group m 32, n 32, k 64
""", "C is saved to device memory by its launch"),
    ("""kernel mm(A: f32[m k], B: f32[k n]) -> (C: f32[m n], D: f32[m n]):
    C[m n] = A[m k] * B[k n]
    D[m n] = C * 2

relabel mm on H100:
    smem: group m 32, n 32, k 64
""", "nothing in its launch reads it (D does"),
    (SPLIT_K.replace("smem: group m 32, n 32, k 64", "l2: group k 128\n    smem: group m 32, n 32; stream k 32"),
     "k is not also streamed in its launch"),
    ("""kernel s(X: f32[r c]) -> Y: f32[r]:
    Y[r] = sum[c](X)

relabel s on H100:
    smem: group r 1, c 64
""", "cannot group-partition c: it is consumed by"),
])
def test_a_sum_over_groups_is_refused_where_it_cannot_add(text, message):
    with pytest.raises(RelabelError, match=message.replace("(", r"\(")):
        _kernel(text).program("H100", m=64, n=64, k=256, r=4, c=256)


def test_on_tensor_cores_the_counts_equal_the_models():
    kernel = _kernel(TENSOR_SPLIT_K)
    sizes = dict(m=128, n=72, k=400)
    program = kernel.program("H100", **sizes)
    selected = isel.select_program(program, "sm_80")
    assert selected[0].path == "mma.sync"
    arrays, scalars = random_arguments(kernel.diagram, sizes, 0)
    outputs, counts = execute(program, arrays, scalars, selected=selected)
    want = evaluate(kernel.diagram, arrays, scalars, sizes, keep_float64=True)["C"]
    np.testing.assert_allclose(outputs["C"].astype(np.float64), want, rtol=1e-2, atol=1e-2)
    assert_counts_equal_report(counts, cost_of(program, arch="sm_80", selected=selected, check=False))


def test_a_sum_computed_again_in_each_group_of_another_axis_is_refused():
    """Found by the program generator: C contracts w, grouped, and the launch is also grouped over
    j, which C does not iterate, so each group of j computes C again; adding, it would count
    twice. Storing, the copies agreed."""
    text = """kernel k(X1: f32[w2]) -> C7: f32[]:
    T3[w2] @l0 = max(X1, 0.5)
    T5[j w2] = T3[w2]
    C7[] = X1[w2] * T3[w2]

relabel on three_level:
    l2: group w2 1
    l1: group j 1
"""
    with pytest.raises(RelabelError, match=r"C7 is computed again in each group of j"):
        _kernel(text).program("three_level", w2=1, j=2)
