"""The table of elementwise functions (``elementwise.py``) is the one place a function is defined.

Every entry is checked here against formulas written out in this file: its float64 value (the
reference's) against ``math``'s, the unit and count the model puts it on against today's model,
its C spelling in both dialects and both C types (the exact text the printers have always
emitted; compiled and run on OpenCL, compiled by NVRTC for CUDA), the NumPy backend's value and
counts, and its derivative against a central finite difference. Then a function napkin does
not have, ``softplus(x) = log(1 + exp(x))``, is added as one entry at run time, with nothing
else changed, and runs end to end: checked, counted, on the reference, the NumPy backend
(unstreamed and streamed, its counts equal to the model), in the generated OpenCL and through
NVRTC, and drawn by the fuzzer.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import elementwise
from napkin_dsl.backends.lowering import CudaDialect, OpenCLDialect
from napkin_dsl.backends.numpy import execute
from napkin_dsl.cost import cost_of
from napkin_dsl.elementwise import FUNCTIONS, Elementwise
from napkin_dsl.reference import ELEMENTWISE, evaluate

from .conftest import EXAMPLES

SIZES = {"i": 37}  # ragged: no tile divides it


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


# Each function as its textbook formula, one Python float at a time (GELU's 1 + erf(x / sqrt 2)
# as erfc(-x / sqrt 2), which does not cancel for negative x).
FORMULAS = {
    "exp": math.exp, "log": math.log, "sqrt": math.sqrt, "rsqrt": lambda x: 1 / math.sqrt(x), "tanh": math.tanh,
    "sigmoid": _sigmoid, "gelu": lambda x: x / 2 * math.erfc(-x / math.sqrt(2)), "silu": lambda x: x * _sigmoid(x),
    "relu": lambda x: x if x > 0 else 0.0, "abs": math.fabs, "neg": lambda x: -x,
    "max": max, "min": min,
}
# The unit each is counted on, as the model has always counted them: one operation each.
SPECIAL = {"exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "gelu", "silu"}
# What the CUDA printer has always written for each in float (x, y the arguments), and writes in
# double; the table must keep it byte for byte, or every golden .cu file changes. In float, the
# functions of FAST_FLOAT print their fast forms instead (elementwise.FAST_PRELUDE).
CUDA_FLOAT = {
    "exp": "expf(x)", "log": "logf(x)", "sqrt": "sqrtf(x)", "rsqrt": "rsqrtf(x)", "tanh": "tanhf(x)",
    "sigmoid": "(1.0f / (1.0f + expf(-(x))))", "gelu": "(0.5f * (x) * erfcf((x) * -0.70710678118654752f))",
    "silu": "((x) / (1.0f + expf(-(x))))", "relu": "fmaxf(x, 0.0f)", "abs": "fabsf(x)", "neg": "(-(x))",
    "max": "fmaxf(x, y)", "min": "fminf(x, y)",
}
FAST_FLOAT = {"sigmoid": "nk_fast_sigmoid(x)", "gelu": "nk_fast_gelu(x)", "silu": "nk_fast_silu(x)"}


def test_every_entry_is_covered_here():
    """A new entry needs its own formula, unit and spelling in this file: nothing goes untested."""
    assert set(FORMULAS) == set(FUNCTIONS) == set(CUDA_FLOAT)
    assert all(entry.name == name and entry.unit in elementwise.UNITS for name, entry in FUNCTIONS.items())
    assert set(ELEMENTWISE) >= set(FUNCTIONS) | {"add", "where", "ge"}  # the reference's names: the table and the operators
    assert len(ELEMENTWISE) == len(set(ELEMENTWISE))


def samples(entry: Elementwise, count: int = 41, seed: int = 0) -> list[np.ndarray]:
    """``count`` float64 points per argument inside the entry's domain, none within 0.05 of a kink
    (0 for relu and abs) or of a tie between the two arguments of max and min."""
    rng = np.random.default_rng(seed)
    low, high = entry.domain
    lo, hi = (max(low, 0.0) + 0.2, min(high, 4.0)) if low > -math.inf else (-4.0, min(high, 4.0))
    args = [rng.uniform(lo, hi, count) for _ in range(entry.arity)]
    args = [np.where(np.abs(a) < 0.05, a + 0.1, a) for a in args]
    if entry.arity == 2:
        args[1] = np.where(np.abs(args[0] - args[1]) < 0.05, args[1] + 0.2, args[1])
    return args


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_the_reference_is_the_formula(name):
    entry = FUNCTIONS[name]
    args = samples(entry)
    want = [FORMULAS[name](*point) for point in zip(*(a.tolist() for a in args), strict=True)]
    np.testing.assert_allclose(ELEMENTWISE[name](*args), want, rtol=1e-14, atol=1e-300)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_the_derivative_is_the_finite_difference(name):
    entry = FUNCTIONS[name]
    args = samples(entry, seed=1)
    result = ELEMENTWISE[name](*args)
    partials = elementwise.derivative(entry)(*args, result)
    assert len(partials) == entry.arity
    for k, partial in enumerate(partials):
        def f(v, k=k):
            return np.array([FORMULAS[name](*point) for point in zip(*(a.tolist() for a in args[:k] + [v] + args[k + 1:]), strict=True)])

        h = 1e-5 * np.maximum(1.0, np.abs(args[k]))
        central = (f(args[k] + h) - f(args[k] - h)) / (2 * h)
        np.testing.assert_allclose(np.broadcast_to(partial, central.shape), central, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_each_is_counted_on_its_unit_as_the_model_always_counted_it(name):
    kernel = napkin.load(one_function(name, "f32"))["k"]
    i = kernel.diagram.axes["i"].size
    unit = "special" if name in SPECIAL else "fma"
    assert FUNCTIONS[name].unit == unit and FUNCTIONS[name].operations == 1
    assert kernel.diagram.producer("Y").flops == {unit: i}


def test_the_spellings_are_the_printers_text():
    cuda, opencl = CudaDialect(), OpenCLDialect()
    for name, text in CUDA_FLOAT.items():
        fast = FAST_FLOAT.get(name)
        assert cuda.math(name, ["x", "y"]) == (fast or text)
        # CUDA's double functions and OpenCL's (overloaded) ones drop the libm suffix; a double's
        # literals drop theirs too; OpenCL's float literals keep theirs
        double = re.sub(r"(\d)f\b", r"\1", text.replace("f(", "("))
        assert cuda.math(name, ["x", "y"], "double") == double
        assert opencl.math(name, ["x", "y"], "double") == double
        assert opencl.math(name, ["x", "y"]) == (fast or text.replace("f(", "("))
    assert opencl.math("gelu", ["v"]) == "nk_fast_gelu(v)"
    assert opencl.math("gelu", ["v"], "double") == "(0.5 * (v) * erfc((v) * -0.70710678118654752))"
    assert cuda.math("pow", ["x", "y"]) == "powf(x, y)" and cuda.math("add", ["x", "y"]) == "(x + y)"


def one_function(name: str, dtype: str) -> str:
    if FUNCTIONS[name].arity == 1:
        return f"kernel k(X: {dtype}[i]) -> Y: {dtype}[i]:\n    Y[i] = {name}(X)\n"
    return f"kernel k(X: {dtype}[i], Z: {dtype}[i]) -> Y: {dtype}[i]:\n    Y[i] = {name}(X, Z)\n"


def every_function(dtype: str) -> str:
    """One kernel calling every function of the table, one output each."""
    outputs = ", ".join(f"Y_{name}: {dtype}[i]" for name in FUNCTIONS)
    lines = "".join(f"    Y_{name}[i] = {name}({'P' if FUNCTIONS[name].domain[0] == 0 else 'X'}{', Z' * (FUNCTIONS[name].arity - 1)})\n"
                    for name in FUNCTIONS)
    return f"kernel k(X: {dtype}[i], Z: {dtype}[i], P: {dtype}[i]) -> ({outputs}):\n{lines}"


def arguments(kernel, dtype: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    n = SIZES["i"]
    real = np.float64 if dtype == "f64" else np.float32
    values = {"X": rng.uniform(-4, 4, n), "Z": rng.uniform(-4, 4, n), "P": rng.uniform(0.2, 4, n)}
    return {name: values[name].astype(real) for name in kernel.diagram.params}


TOLERANCE = {"f32": dict(rtol=2e-5, atol=1e-6), "f64": dict(rtol=1e-12, atol=1e-14)}


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_every_function_runs_on_numpy_with_the_models_counts(dtype):
    kernel = napkin.load(every_function(dtype))["k"]
    arrays = arguments(kernel, dtype)
    want = evaluate(kernel.diagram, arrays, {}, SIZES, keep_float64=True)
    for name in FUNCTIONS:
        inputs = [arrays["P" if FUNCTIONS[name].domain[0] == 0 else "X"].astype(np.float64)] + [arrays["Z"].astype(np.float64)] * (FUNCTIONS[name].arity - 1)
        np.testing.assert_allclose(want[f"Y_{name}"], [FORMULAS[name](*p) for p in zip(*(a.tolist() for a in inputs), strict=True)],
                                   rtol=1e-14, err_msg=name)
    program = kernel.program(None, **SIZES)
    outputs, counts = execute(program, arrays, {})
    for name in FUNCTIONS:
        np.testing.assert_allclose(outputs[f"Y_{name}"], want[f"Y_{name}"], **TOLERANCE[dtype], err_msg=name)
    assert counts.differences(cost_of(program, check=False)) == []
    assert counts.flops == {"special": len(SPECIAL) * SIZES["i"], "fma": (len(FUNCTIONS) - len(SPECIAL)) * SIZES["i"]}


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_every_spelling_compiles_and_runs_in_opencl(opencl_device, dtype):
    """The OpenCL spelling in float and in double (an f64 kernel computes in double), on PoCL."""
    from napkin_dsl.backends import opencl

    kernel = napkin.load(every_function(dtype))["k"]
    arrays = arguments(kernel, dtype, seed=2)
    want = evaluate(kernel.diagram, arrays, {}, SIZES, keep_float64=True)
    program = kernel.gpu_program(None, **SIZES)
    source = opencl.generate(program)[0]
    assert ("double" in source) == (dtype == "f64")
    outputs = opencl.run(program, arrays, {})
    for name in FUNCTIONS:
        np.testing.assert_allclose(outputs[f"Y_{name}"], want[f"Y_{name}"], **TOLERANCE[dtype], err_msg=name)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_every_spelling_compiles_with_nvrtc(dtype):
    """NVRTC (no GPU needed): the CUDA spelling in float and in double compiles, spilling nothing."""
    compiled = napkin.load(every_function(dtype))["k"].compile("sm_90", **SIZES)
    real = "double" if dtype == "f64" else "float"
    for name, entry in FUNCTIONS.items():
        called = re.findall(r"[a-z]\w*\(", entry.spell(["x", "y"], "f", real))  # its libm functions
        assert all(f in compiled.source for f in called), (name, called)
    # in float, gelu is its fast form (the fit, no erfcf); in double, erfc
    assert "erfcf(" not in compiled.source and ("erfc(" in compiled.source) == (dtype == "f64")
    assert (compiled.source.count("nk_fast_gelu(") > 1) == (dtype == "f32")  # called, not only defined
    assert all(row["spill_bytes"] == 0 for row in compiled.launch_table())


# ---- one more function, added at run time ------------------------------------------------------

SOFTPLUS = """
kernel soft(X: f32[i j]) -> (Y: f32[i j], S: f32[i]):
    Y[i j] = softplus(X)
    S[i] = sum[j](softplus(X) * 2)
"""
STREAMED = SOFTPLUS + """
relabel soft on H100:
    smem: group i 32; stream j 8
"""
SOFT_SIZES = {"i": 70, "j": 37}


def softplus_formula(x: float) -> float:
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


@pytest.fixture
def with_softplus(monkeypatch):
    """napkin with one more elementwise function: softplus, on the special-function unit."""
    monkeypatch.setitem(FUNCTIONS, "softplus", Elementwise(
        "softplus", 1, "special", 1, "log1p{f}(exp{f}({x}))",
        float64=lambda np: lambda x: np.logaddexp(0.0, x),
        derivative=lambda np: lambda x, y: (1.0 - np.exp(-y),),  # sigmoid(x) = 1 - exp(-softplus(x))
    ))


def soft_arguments(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"X": rng.uniform(-6, 6, (SOFT_SIZES["i"], SOFT_SIZES["j"])).astype(np.float32)}


def soft_want(arrays) -> dict:
    y = np.vectorize(softplus_formula)(arrays["X"].astype(np.float64))
    return {"Y": y, "S": 2 * y.sum(axis=1)}


def test_without_the_entry_softplus_is_unknown():
    with pytest.raises(napkin.NapkinError, match="unknown function 'softplus'"):
        napkin.load(SOFTPLUS)


def test_a_new_function_checks_and_counts_from_its_entry(with_softplus):
    kernel = napkin.load(SOFTPLUS)["soft"]
    i, j = (kernel.diagram.axes[a].size for a in "ij")
    assert kernel.diagram.producer("Y").flops == {"special": i * j}
    assert kernel.diagram.producer("S").flops == {"special": i * j, "fma": 2 * i * j}  # the product, the sum
    with pytest.raises(napkin.NapkinError, match="softplus takes one argument, got 2"):
        napkin.load("kernel k(X: f32[i]) -> Y: f32[i]:\n    Y[i] = softplus(X, X)\n")
    with pytest.raises(napkin.NapkinError, match="built-in function"):
        napkin.load("box softplus(f32[i]) -> f32[i]\nkernel k(X: f32[i]) -> Y: f32[i]:\n    Y[i] = X\n")


def test_a_new_functions_derivative_is_the_finite_difference(with_softplus):
    x = np.linspace(-5, 5, 23)
    entry = elementwise.function("softplus")
    (partial,) = elementwise.derivative(entry)(x, ELEMENTWISE["softplus"](x))
    h = 1e-5
    central = (np.vectorize(softplus_formula)(x + h) - np.vectorize(softplus_formula)(x - h)) / (2 * h)
    np.testing.assert_allclose(partial, central, rtol=1e-7)


@pytest.mark.parametrize("source", [SOFTPLUS, STREAMED], ids=["unstreamed", "streamed"])
def test_a_new_function_runs_on_the_reference_and_numpy(with_softplus, source):
    kernel = napkin.load(source)["soft"]
    arrays = soft_arguments(0)
    want = soft_want(arrays)
    reference = evaluate(kernel.diagram, arrays, {}, SOFT_SIZES, keep_float64=True)
    for name in want:
        np.testing.assert_allclose(reference[name], want[name], rtol=1e-13)
    program = kernel.program("H100" if source is STREAMED else None, **SOFT_SIZES)
    if source is STREAMED:
        assert "accumulate" in set(program.launches[0].launch.streams[0].roles.values())
    outputs, counts = execute(program, arrays, {})
    for name in want:
        np.testing.assert_allclose(outputs[name], want[name], rtol=2e-5)
    assert counts.differences(cost_of(program, check=False)) == []
    assert counts.flops["special"] == 2 * SOFT_SIZES["i"] * SOFT_SIZES["j"]


def test_a_new_function_runs_in_the_generated_opencl(with_softplus, opencl_device):
    from napkin_dsl.backends import opencl

    kernel = napkin.load(STREAMED)["soft"]
    arrays = soft_arguments(1)
    program = kernel.gpu_program(None, **SOFT_SIZES)
    assert "log1p(exp(" in opencl.generate(program)[0]
    outputs = opencl.run(program, arrays, {})
    want = soft_want(arrays)
    for name in want:
        np.testing.assert_allclose(outputs[name], want[name], rtol=2e-5)


def test_a_new_function_compiles_to_cuda(with_softplus):
    compiled = napkin.load(STREAMED)["soft"].compile("sm_90", **SOFT_SIZES)
    assert "log1pf(expf(" in compiled.source
    assert all(row["spill_bytes"] == 0 for row in compiled.launch_table())


def test_the_fuzzer_draws_a_new_function_inside_its_domain(with_softplus):
    """The fuzzer's generator reads the table: it calls softplus, bounds it by its float64
    definition, and the case it draws is judged against the reference like any other."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests import fuzz_programs

    assert "softplus" in fuzz_programs.unary_functions()
    assert fuzz_programs._image("softplus", (-1.0, 1.0))[0] < math.log1p(math.exp(-1.0)) < math.log1p(math.e) < \
        fuzz_programs._image("softplus", (-1.0, 1.0))[1]
    seen = []

    # derandomized: the same draws every run (random ones drew no softplus once in CI; the first
    # 300 drew none once the generator drew scans and window reads too)
    @settings(max_examples=1000, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def draw(data):
        case = data.draw(fuzz_programs.programs())
        if "softplus(" in case.text and len(seen) < 2:
            seen.append(case)
            outcome = fuzz_programs.check_case_within(case, 60, opencl=False)
            assert not outcome.failures, "\n".join([f.message for f in outcome.failures] + [case.describe()])

    draw()
    assert seen, "1000 programs and no softplus among them"


# ---- the fast forms in float, against float64 -------------------------------------------------

SWEEP_KERNEL = """
__kernel void sweep(__global const float* x, __global float* sigmoid, __global float* silu, __global float* gelu) {
    const int i = get_global_id(0);
    sigmoid[i] = nk_fast_sigmoid(x[i]);
    silu[i] = nk_fast_silu(x[i]);
    gelu[i] = nk_fast_gelu(x[i]);
}
"""


def sweep_points() -> np.ndarray:
    """A dense sweep through the middle, where every form rounds hardest, and out to float's
    largest values both ways (exp overflowing, the reciprocal's argument past 2^126, erfc's
    exponent past -104), and the signed zeros."""
    middle = np.linspace(-30.0, 30.0, 600_001)
    wide = np.logspace(-30, 38, 20_001)
    return np.concatenate([middle, wide, -wide, [0.0, -0.0, np.finfo(np.float32).max, -np.finfo(np.float32).max]]).astype(np.float32)


def test_the_fast_forms_are_within_their_bounds_of_float64_on_a_dense_sweep(opencl_device):
    """The fast forms' formulas as OpenCL prints them (its exp and division precise, PoCL), at
    every point of the sweep within the bound elementwise derives, |fast - f| <= relative |f| +
    absolute, with f the table's float64 definition at the float input. What the bound adds for
    CUDA's intrinsics (__expf, __fdividef) over OpenCL's functions needs a GPU to observe; the
    margin left here is checked to hold at least that much."""
    import pyopencl as cl

    ctx, queue = opencl_device
    program = cl.Program(ctx, OpenCLDialect.prelude + SWEEP_KERNEL).build()
    x = sweep_points()
    flags = cl.mem_flags
    source = cl.Buffer(ctx, flags.READ_ONLY | flags.COPY_HOST_PTR, hostbuf=x)
    outs = {name: np.zeros_like(x) for name in ("sigmoid", "silu", "gelu")}
    buffers = {name: cl.Buffer(ctx, flags.WRITE_ONLY, x.nbytes) for name in outs}
    program.sweep(queue, (x.size,), None, source, *buffers.values())
    for name, out in outs.items():
        cl.enqueue_copy(queue, out, buffers[name])
        want = elementwise.float64(FUNCTIONS[name])(x.astype(np.float64))
        got = out.astype(np.float64)
        relative, absolute = FUNCTIONS[name].fast_error
        finite = np.isfinite(want)
        assert np.array_equal(np.isfinite(got), finite), name  # overflow only where f itself overflows float
        error = np.abs(got[finite] - want[finite])
        bound = relative * np.abs(want[finite]) + absolute
        assert np.all(error <= bound), (name, x[finite][np.argmax(error - bound)], float(np.max(error / bound)))
        # the formula's own error leaves room inside the bound for what CUDA's intrinsics err
        # beyond OpenCL's precise functions: 1.5 ulp more for __expf's 2 and for __fdividef's 2,
        # the reciprocal's amplified 30 times in gelu (e's sensitivity to t)
        extra = 1.5 * 2.0**-23 * (31 if name == "gelu" else 2) * np.abs(want[finite])
        assert np.all(error + extra <= bound), (name, float(np.max((error + extra) / bound)))
    assert outs["gelu"][-2] == np.finfo(np.float32).max and outs["gelu"][-1] == 0.0  # x and 0 in the limits


def test_the_fast_forms_print_for_cuda_with_intrinsics_and_no_slow_path():
    """NVRTC's SASS of mlp (GELU on 128 x 128 outputs, 128 a thread): one MUFU.EX2 and one
    MUFU.RCP an element, no call (the slow path of a correctly rounded division), and no more
    than 12 FFMA an element (the fit's 9 of Horner's rule, 1 + z/2, -z^2 + P, and one spare):
    the precise erfcf's epilogue ran 2560 FFMA and 384 MUFU."""
    from napkin_dsl.backends import sass

    try:
        sass.find_nvdisasm()
    except sass.NoDisassembler:
        pytest.skip("no nvdisasm (pip install 'napkin-dsl[sass]')")
    (kernel,) = napkin.load(EXAMPLES / "mlp.napkin").values()
    compiled = kernel.compile("sm_90", b=512, k=768, n=1024)
    assert "__expf(" in compiled.source and "__fdividef(" in compiled.source and "erfcf(" not in compiled.source
    (instructions,) = sass.disassemble(compiled.image).values()
    opcodes = [i.opcode for i in instructions]
    per_thread = 128 * 128 // compiled.launch_table()[0]["block"][0]
    assert sum(op.startswith("MUFU.EX2") for op in opcodes) == per_thread
    assert sum(op.startswith("MUFU.RCP") for op in opcodes) == per_thread
    assert not any(op.startswith("CALL") for op in opcodes)
    assert sum(op == "FFMA" for op in opcodes) <= 12 * per_thread
