"""The NumPy backend: outputs against the float64 reference, counts against the cost report.

Every count assertion is exact (integers): the values the backend moved per level and the
FLOPs it performed per unit must equal what ``cost.py`` reads off the same Program.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import sympy

import napkin_dsl as napkin
from napkin_dsl.backends.numpy import (
    Counts,
    check_memory,
    default_sizes,
    estimate_bytes,
    execute,
    gelu,
    random_arguments,
    tolerance,
)
from napkin_dsl.cost import cost_of
from napkin_dsl.errors import NapkinCallError, NapkinError
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES, NAPKIN_EXAMPLES, example_id

OPAQUE = {"paper/fig11.napkin", "paper/fig12.napkin"}
RUNNABLE = [p for p in NAPKIN_EXAMPLES if example_id(p) not in OPAQUE]
LEVEL = {"two_level": "l1", "three_level": "l2", "H100": "smem", "A100": "smem", "H200": "smem"}


# ---- helpers shared with test_properties.py -----------------------------------------------------


def only_kernel(source) -> napkin.Kernel:
    (kernel,) = napkin.load(source).values()
    return kernel


def relabelled(path: Path, hardware: str, partitions, dtype: str | None = None, outer=()) -> napkin.Kernel:
    """The example's kernel with its relabel block replaced: ``partitions`` is [(kind, axis, size)]
    or [(kind, axis, size, targets)] (a clause scoped to those statements' launches: ``LEVEL for
    G, U: ...``) at the compute level of ``hardware``, ``outer`` groups [(axis, size)] at l1 of
    three_level; ``dtype`` replaces every float dtype of the kernel."""
    text = path.read_text()
    head = text.split("\nrelabel ")[0].rstrip("\n") + "\n"
    if dtype is not None:
        head = re.sub(r"\b(bf16|f16|f32|fp8e4m3|fp8e5m2)\[", f"{dtype}[", head)
    head = re.sub(r"@(gmem|l0)\b", f"@{napkin.load_hardware(hardware).top.name}", head)  # materialise at this top level
    name = only_kernel(path).name
    scopes: dict[tuple, list] = {}  # targets (empty: every launch) -> its partitions, in order
    for kind, axis, size, *targets in partitions:
        scopes.setdefault(tuple(targets[0]) if targets and targets[0] else (), []).append((kind, axis, size))
    block = f"\nrelabel {name} on {hardware}:\n"
    for targets, scoped in scopes.items():
        groups = ", ".join(f"{axis} {size}" for kind, axis, size in scoped if kind == "group")
        streams = ", ".join(f"{axis} {size}" for kind, axis, size in scoped if kind == "stream")
        clauses = "; ".join(part for part in (f"group {groups}" if groups else "", f"stream {streams}" if streams else "") if part)
        block += f"    {LEVEL[hardware]}{' for ' + ', '.join(targets) if targets else ''}: {clauses}\n"
    if outer:
        block += "    l1: group " + ", ".join(f"{axis} {size}" for axis, size in outer) + "\n"
    return only_kernel(head + block)


def run_and_compare(kernel, sizes: dict, hardware: str | None = None, seed: int = 0, impls=None, rtol=None):
    """Execute, compare with the reference within the Program's tolerance, and return (Counts, report)."""
    program = kernel.program(hardware, **sizes)
    axis_sizes = {a: sizes[a] for a in kernel.diagram.axes}
    arrays, scalars = random_arguments(kernel.diagram, axis_sizes, seed)
    outputs, counts = execute(program, arrays, scalars, impls)
    expected = evaluate(kernel.diagram, arrays, scalars, axis_sizes, impls, keep_float64=True)
    limit = tolerance(program) if rtol is None else rtol
    for name in kernel.diagram.outputs:
        array = kernel.diagram.arrays[name]
        got = outputs[name]
        assert got.dtype == napkin.types.numpy_dtype(array.dtype), name
        assert got.shape == tuple(axis_sizes[a] for a in array.axes), name
        want = expected[name]
        error = np.max(np.abs(got.astype(np.float64) - want))
        assert error <= limit * np.max(np.abs(want)), f"{kernel.name}.{name}: max error {error} > {limit} x {np.max(np.abs(want))}"
    return counts, cost_of(program, check=False)


def assert_counts_equal_report(counts: Counts, report) -> None:
    """H and H bytes per level and FLOPs per unit, exactly, as Python integers."""
    assert set(counts.H) == set(report.levels)
    for level, cost in report.levels.items():
        assert counts.H[level] == int(cost.H), f"H at {level}: counted {counts.H[level]}, predicted {cost.H}"
        assert counts.H_bytes[level] == int(cost.H_bytes), f"bytes at {level}"
    assert set(counts.flops) == set(report.flops)
    for unit, predicted in report.flops.items():
        counted = counts.flops[unit]
        if sympy.sympify(predicted).is_number:
            assert isinstance(counted, int) and counted == int(predicted), f"{unit}: counted {counted}, predicted {predicted}"
        else:  # an opaque box's FLOPs are a symbol per element
            assert sympy.expand(counted - predicted) == 0
    assert counts.differences(report) == []


# ---- every example ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", RUNNABLE, ids=example_id)
def test_example_at_sizes_tiles_do_not_divide(path):
    kernel = only_kernel(path)
    sizes = default_sizes(kernel)  # an axis partitioned by s gets s + s/2 + 3: a masked tail
    counts, report = run_and_compare(kernel, sizes)
    assert_counts_equal_report(counts, report)
    assert counts.steps > 0


@pytest.mark.parametrize("path", RUNNABLE, ids=example_id)
def test_example_at_sizes_tiles_divide(path):
    kernel = only_kernel(path)
    partitioned = {p.axis: p.size for level in (kernel.relabel.levels if kernel.relabel else ()) for p in level.partitions}
    sizes = {a: 2 * partitioned[a] if a in partitioned else 32 for a in kernel.diagram.axes}
    counts, report = run_and_compare(kernel, sizes)
    assert_counts_equal_report(counts, report)


@pytest.mark.parametrize("path", RUNNABLE, ids=example_id)
def test_example_on_two_level_in_f32(path):
    """The same kernels on the paper's abstract model, relabelled at l1, every array f32 (tight tolerance)."""
    kernel = only_kernel(path)
    partitions = [(p.kind, p.axis, p.size, p.targets) for level in (kernel.relabel.levels if kernel.relabel else ()) for p in level.partitions]
    kernel = relabelled(path, "two_level", partitions, dtype="f32")
    counts, report = run_and_compare(kernel, default_sizes(kernel), rtol=1e-5)
    assert_counts_equal_report(counts, report)


@pytest.mark.parametrize("name, impl_sizes", [("fig11", {"a": 10, "x": 3, "w": 4, "y": 2, "g_a": 4}),
                                               ("fig12", {"a": 5, "b": 7, "x": 3, "w": 4, "y": 2, "g_a": 2, "g_b": 3})])
def test_opaque_examples_with_implementations(name, impl_sizes):
    kernel = napkin.load(EXAMPLES / "paper" / f"{name}.napkin")[name]
    seen = []

    def F(X, W):  # woven axes first, then the box's own: (..., x) and (..., w) -> (..., y)
        seen.append(X.shape[:-1])
        return np.stack([X.sum(-1) * W.sum(-1), X.max(-1) - W.min(-1)], axis=-1)

    counts, report = run_and_compare(kernel, impl_sizes, impls={"F": F}, rtol=1e-5)
    assert_counts_equal_report(counts, report)
    assert "opaque" in counts.flops and not sympy.sympify(counts.flops["opaque"]).is_number
    assert len(seen) > 1  # called once per group, on tiles


def test_derived_l2_groups_leave_no_empty_tiles():
    """m = 2500 over SMEM groups of 128 is 20 groups; the derived L2 grouping takes sides that
    divide 20, so no L2 tile ends in SMEM trips past the end of the axis (they once did: an L2
    side of 8 groups left 4 empty trips, charged by the report and run by the backend)."""
    kernel = only_kernel(EXAMPLES / "matmul.napkin")
    sizes = {"m": 2500, "n": 2500, "k": 40}
    program = kernel.program("H100", **sizes)
    arrays, _ = random_arguments(kernel.diagram, sizes, 0)
    outputs, counts = execute(program, arrays, {})
    assert_counts_equal_report(counts, cost_of(program, check=False))
    assert counts.empty_tiles == 0
    assert not any(counts.empty_H.values())
    want = arrays["A"].astype(np.float64) @ arrays["B"].astype(np.float64)
    assert np.max(np.abs(outputs["C"] - want)) < 1e-4


# ---- semantics of single steps ---------------------------------------------------------------


def check_kernel(text: str, sizes: dict, hardware=None, rtol=1e-5):
    kernel = only_kernel(text)
    counts, report = run_and_compare(kernel, sizes, hardware, rtol=rtol)
    assert_counts_equal_report(counts, report)
    return kernel, counts


@pytest.mark.parametrize("op", ["sum", "max", "min", "mean"])
def test_streamed_reductions(op):
    check_kernel(f"""
kernel red(X: f32[t d]) -> R: f32[t]:
    R[t] = {op}[d](X * X - 1)

relabel red on two_level:
    l1: group t 3; stream d 5
""", {"t": 7, "d": 13})


def test_streamed_contraction_with_a_scale_factor():
    """The factor of a streamed contraction is applied once, after finalise (pseudocode.py dropped it before)."""
    kernel, _ = check_kernel("""
kernel mms(A: f32[m k], B: f32[k n]) -> C: f32[m n]:
    C[m n] = A[m k] * B[k n] * 0.5

relabel mms on H100:
    smem: group m 16, n 16; stream k 8
""", {"m": 33, "n": 20, "k": 27})
    assert any(step.text == "C *= 1/2" for _, step in _steps(kernel.program(m=33, n=20, k=27)))


def test_online_softmax_with_a_scaled_output_and_a_map_in_the_stream():
    check_kernel("""
kernel att(Q: f32[q d], K: f32[x d], V: f32[x d], c: f32) -> O: f32[q d]:
    S[q x] = Q * K * c
    T[q x] = tanh(S) * 3
    P[q x] = softmax[x](T)
    O[q d] = P * V * 2

relabel att on two_level:
    l1: group q 4; stream x 6
""", {"q": 10, "x": 17, "d": 5})


def test_a_map_along_the_streamed_axis_is_saved_chunk_by_chunk():
    check_kernel("""
kernel both(X: f32[r c]) -> Y: f32[r c], M: f32[r]:
    Y[r c] = exp(X) + 1
    M[r] = max[c](X)

relabel both on two_level:
    l1: group r 4; stream c 8
""", {"r": 9, "c": 21})


def test_three_operand_contraction_and_broadcast_map():
    check_kernel("""
kernel three(A: f32[i j], B: f32[j k], C: f32[k l], bias: f32[l]) -> Y: f32[i l]:
    T[i l] = A * B * C
    Y[i l] = relu(T + bias) - sigmoid(bias)
""", {"i": 6, "j": 5, "k": 4, "l": 7})


def test_axis_orders_that_differ_between_operands_and_output():
    check_kernel("""
kernel perm(A: f32[k b m], B: f32[n k b]) -> C: f32[n b m]:
    C[n b m] = A * B

relabel perm on two_level:
    l1: group b 2, m 3; stream k 4
""", {"k": 9, "b": 3, "m": 7, "n": 5})


def test_softmax_and_rmsnorm_style_kernels_with_scalars():
    check_kernel("""
kernel norm(X: f32[t d], G: f32[d], eps: f32) -> Y: f32[t d]:
    ms[t] = mean[d](X * X)
    Y[t d] = X * rsqrt(ms + eps) * G * len(d)^-0.5

relabel norm on H100:
    smem: group t 3
""", {"t": 10, "d": 12})


def test_three_level_nested_groups_with_tails():
    """Groups at l1 and l2 of the same axis: the inner loop's tiles sit inside the outer tile's tail."""
    _kernel, counts = check_kernel("""
kernel mm(A: f32[m k], B: f32[k n]) -> C: f32[m n]:
    C[m n] = A * B

relabel mm on three_level:
    l1: group m 10, n 12
    l2: group m 4, n 5; stream k 3
""", {"m": 23, "n": 26, "k": 8})
    assert counts.empty_tiles > 0  # trips(10, 4) = 3 in the 3-row tail tile of m


@pytest.mark.parametrize("dtype, rtol", [("bf16", 2**-8), ("f16", 2**-11), ("fp8e4m3", 2**-3), ("fp8e5m2", 2**-2)])
def test_outputs_are_rounded_to_their_declared_dtype(dtype, rtol):
    kernel = only_kernel(f"""
kernel mm(A: f32[m k], B: f32[k n]) -> C: {dtype}[m n]:
    C[m n] = A * B

relabel mm on two_level:
    l1: group m 4; stream k 3
""")
    sizes = {"m": 9, "k": 7, "n": 5}
    program = kernel.program(**sizes)
    arrays, _ = random_arguments(kernel.diagram, sizes, 1)
    outputs, _ = execute(program, arrays, {})
    exact = arrays["A"].astype(np.float64) @ arrays["B"].astype(np.float64)
    target = napkin.types.numpy_dtype(dtype)
    assert outputs["C"].dtype == target
    # f32 accumulation, then one rounding: equal to the exact product rounded, but for ties at f32 noise
    rounded = exact.astype(np.float32).astype(target).astype(np.float64)
    assert np.mean(outputs["C"].astype(np.float64) == rounded) > 0.95
    np.testing.assert_allclose(outputs["C"].astype(np.float64), exact, rtol=rtol, atol=1e-6)


def test_materialised_f16_intermediates_are_rounded_where_saved():
    """attention_unfused saves S and P as f16 at gmem: the backend rounds there, the reference does not."""
    kernel = only_kernel(EXAMPLES / "attention_unfused.napkin")
    sizes = {"q": 9, "x": 11, "d": 4}
    program = kernel.program(**sizes)
    arrays, _ = random_arguments(kernel.diagram, sizes, 2)
    q, k, v = (arrays[n].astype(np.float64) for n in "QKV")
    s = (q @ k.T).astype(np.float16).astype(np.float64)
    p = np.exp(s - s.max(1, keepdims=True))
    p = (p / p.sum(1, keepdims=True)).astype(np.float16).astype(np.float64)
    outputs, _ = execute(program, arrays, {})
    np.testing.assert_allclose(outputs["O"].astype(np.float64), p @ v, rtol=2**-10, atol=1e-3)


def test_bf16_inputs_accumulate_in_f32():
    kernel = only_kernel(EXAMPLES / "matmul.napkin")
    sizes = {"m": 40, "n": 30, "k": 300}
    arrays, _ = random_arguments(kernel.diagram, sizes, 3)
    outputs, _ = execute(kernel.program(**sizes), arrays, {})
    exact = arrays["A"].astype(np.float64) @ arrays["B"].astype(np.float64)
    assert np.max(np.abs(outputs["C"] - exact)) < 1e-4  # bf16 accumulation would be off by ~0.1


def test_nan_and_inf_propagate_through_the_online_softmax():
    kernel = only_kernel("""
kernel att(Q: f32[q d], K: f32[x d], V: f32[x d]) -> O: f32[q d]:
    S[q x] = Q * K
    P[q x] = softmax[x](S)
    O[q d] = P * V

relabel att on two_level:
    l1: group q 2; stream x 3
""")
    sizes = {"q": 5, "x": 7, "d": 3}
    arrays, _ = random_arguments(kernel.diagram, sizes, 4)
    arrays["Q"][1, 0] = np.nan
    arrays["V"][6, 2] = np.inf
    with np.errstate(all="raise"):  # the backend silences its own IEEE warnings
        outputs, _ = execute(kernel.program(**sizes), arrays, {})
    expected = evaluate(kernel.diagram, arrays, {}, sizes, keep_float64=True)["O"]
    np.testing.assert_array_equal(np.isnan(outputs["O"]), np.isnan(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(outputs["O"][finite], expected[finite], rtol=1e-5)
    assert np.isnan(outputs["O"][1]).all()


def test_inputs_are_not_written():
    kernel = only_kernel(EXAMPLES / "softmax.napkin")
    sizes = {"r": 20, "c": 9}
    arrays, _ = random_arguments(kernel.diagram, sizes, 5)
    before = arrays["X"].copy()
    arrays["X"].flags.writeable = False
    execute(kernel.program(**sizes), arrays, {})
    np.testing.assert_array_equal(arrays["X"], before)


def test_gelu_matches_math_erf():
    x = np.linspace(-12, 12, 20001)
    # erfc, not 1 + erf: the latter cancels for very negative x, where GELU is tiny
    exact = np.array([v / 2 * math.erfc(-v / math.sqrt(2)) for v in x])
    np.testing.assert_allclose(gelu(x), exact, rtol=2e-7, atol=1e-300)
    np.testing.assert_allclose(gelu(x), [v / 2 * (1 + math.erf(v / math.sqrt(2))) for v in x], rtol=2e-7, atol=1e-15)
    assert gelu(np.float32(1.0) * np.ones(3, np.float32)).dtype == np.float32
    assert isinstance(gelu(0.5), float)


# ---- errors ------------------------------------------------------------------------------------


def test_unbound_sizes_are_a_clear_error():
    kernel = only_kernel(EXAMPLES / "softmax.napkin")
    with pytest.raises(NapkinError, match=r"axis (r|c) is (r|c), which depends on unbound sizes"):
        execute(kernel.program(), {"X": np.ones((2, 2), np.float32)}, {})


def test_wrong_shapes_and_missing_arguments():
    kernel = only_kernel(EXAMPLES / "rmsnorm.napkin")
    program = kernel.program(t=4, d=8)
    good = {"X": np.ones((4, 8), ml_dtypes.bfloat16), "G": np.ones(8, ml_dtypes.bfloat16)}
    with pytest.raises(NapkinCallError, match=r"input X\[t d\] has shape \(4, 9\), but the Program was built for \(4, 8\)"):
        execute(program, {**good, "X": np.ones((4, 9))}, {"eps": 1.0})
    with pytest.raises(NapkinCallError, match="missing input G"):
        execute(program, {"X": good["X"]}, {"eps": 1.0})
    with pytest.raises(NapkinCallError, match="missing scalar eps"):
        execute(program, good, {})


def test_opaque_box_without_implementation_names_the_box():
    kernel = napkin.load(EXAMPLES / "paper" / "fig11.napkin")["fig11"]
    program = kernel.program(a=4, x=2, w=3, y=2, g_a=2)
    with pytest.raises(NapkinCallError, match="box F has no implementation"):
        execute(program, {"X": np.ones((4, 2), np.float32), "W": np.ones(3, np.float32)}, {})


def test_memory_estimate_and_guard():
    kernel = only_kernel(EXAMPLES / "attention.napkin")
    program = kernel.program(b=1, h=2, q=256, x=256, d=64)
    need = estimate_bytes(program)
    whole = (3 * 2 * 256 * 64) * 2 + 2 * 256 * 64 * 2  # Q K V and O in bf16
    assert whole < need < whole + 2 * 2**20
    assert check_memory(program, limit=need) == need
    with pytest.raises(NapkinCallError, match=r"would need about .* bytes .* at b=1, h=2, q=256, d=64, x=256"):
        check_memory(program, limit=need - 1)


def _steps(program):
    from napkin_dsl.pseudocode import walk

    for launch in program.launches:
        for step, loops in walk(launch.body):
            yield loops, step
