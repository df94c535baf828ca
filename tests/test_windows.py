"""Window reads (issue 46, item 1): convolutions and pooling windows in the notation.

A read may index an axis through an affine expression of axes, ``X[b c (2*p + i - 1)]``,
padded with ``pad(READ, VALUE)``. Each kernel below is checked against torch's own operator in
float64, on the reference, the NumPy backend and OpenCL, at ragged sizes, with the output's
length read off the window as torch computes it.
"""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends.numpy import execute, random_arguments
from napkin_dsl.cost import cost_of
from napkin_dsl.isel import select_program
from napkin_dsl.errors import NapkinCallError, NapkinError, NapkinSyntaxError, NapkinTypeError
from napkin_dsl.reference import evaluate

from .test_numpy_backend import assert_counts_equal_report

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _kernel(text: str) -> napkin.Kernel:
    (kernel,) = napkin.load(text).values()
    return kernel


def _t(array) -> "torch.Tensor":
    return torch.tensor(np.asarray(array, dtype=np.float64))


# Each case: the kernel, the inputs' shapes, sizes= for axes no input carries, and torch's
# float64 result from the same inputs (shaped as the kernel's output).
CASES = {
    "conv1d stride 2, padding 1, dilation 2": (
        """kernel conv(X: f32[b c h], W: f32[o c i]) -> Y: f32[b o p]:
    Y[b o p] = pad(X[b c (2*p + 2*i - 1)], 0) * W[o c i]
""", {"X": (2, 3, 13), "W": (5, 3, 3)}, {},
        lambda X, W: F.conv1d(_t(X), _t(W), stride=2, padding=1, dilation=2)),
    "conv2d 3x3, padding 1": (
        """kernel conv(X: f32[b c h w], W: f32[o c i j]) -> Y: f32[b o p q]:
    Y[b o p q] = pad(X[b c (p + i - 1) (q + j - 1)], 0) * W[o c i j]
""", {"X": (2, 3, 7, 9), "W": (4, 3, 3, 3)}, {},
        lambda X, W: F.conv2d(_t(X), _t(W), padding=1)),
    "conv2d 3x2, stride 2 by 3, no padding": (
        """kernel conv(X: f32[b c h w], W: f32[o c i j]) -> Y: f32[b o p q]:
    Y[b o p q] = X[b c (2*p + i) (3*q + j)] * W[o c i j]
""", {"X": (1, 2, 11, 10), "W": (3, 2, 3, 2)}, {},
        lambda X, W: F.conv2d(_t(X), _t(W), stride=(2, 3))),
    "conv3d 2x2x2, stride 2": (
        """kernel conv(X: f32[b c t h w], W: f32[o c k i j]) -> Y: f32[b o s p q]:
    Y[b o s p q] = X[b c (2*s + k) (2*p + i) (2*q + j)] * W[o c k i j]
""", {"X": (1, 2, 5, 6, 7), "W": (3, 2, 2, 2, 2)}, {},
        lambda X, W: F.conv3d(_t(X), _t(W), stride=2)),
    "grouped conv1d, 3 groups": (
        """kernel conv(X: f32[b e h], W: f32[g o c i]) -> Y: f32[b g o p]:
    Y[b g o p] = pad(X[b (len(c)*g + c) (p + i - 1)], 0) * W[g o c i]
""", {"X": (2, 6, 9), "W": (3, 2, 2, 3)}, {},
        lambda X, W: F.conv1d(_t(X), _t(W).reshape(6, 2, 3), padding=1, groups=3).reshape(2, 3, 2, -1)),
    "depthwise conv1d": (
        """kernel conv(X: f32[b c h], W: f32[c i]) -> Y: f32[b c p]:
    Y[b c p] = pad(X[b c (p + i - 2)], 0) * W[c i]
""", {"X": (2, 4, 10), "W": (4, 5)}, {},
        lambda X, W: F.conv1d(_t(X), _t(W)[:, None, :], padding=2, groups=4)),
    "transposed conv1d, stride 1": (
        """kernel conv(X: f32[b c h], W: f32[c o i]) -> Y: f32[b o p]:
    Y[b o p] = pad(X[b c (p - i)], 0) * W[c o i]
""", {"X": (2, 3, 10), "W": (3, 4, 4)}, {},
        lambda X, W: F.conv_transpose1d(_t(X), _t(W))),
    "max pooling 3x3, stride 2, padding 1": (
        """kernel pool(X: f32[b c h w]) -> Y: f32[b c p q]:
    Y[b c p q] = max[i j](pad(X[b c (2*p + i - 1) (2*q + j - 1)], -inf))
""", {"X": (2, 3, 9, 8)}, {"i": 3, "j": 3},
        lambda X: F.max_pool2d(_t(X), 3, stride=2, padding=1)),
    "average pooling 2x2, stride 2": (
        """kernel pool(X: f32[b c h w]) -> Y: f32[b c p q]:
    Y[b c p q] = mean[i j](X[b c (2*p + i) (2*q + j)])
""", {"X": (2, 3, 9, 8)}, {"i": 2, "j": 2},
        lambda X: F.avg_pool2d(_t(X), 2, stride=2)),
}


def _inputs(shapes: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


@pytest.mark.parametrize("backend", ["reference", "numpy", "opencl"])
@pytest.mark.parametrize("case", list(CASES))
def test_window_reads_match_torch(case, backend, request):
    text, shapes, sizes, torch_op = CASES[case]
    if backend == "opencl":
        request.getfixturevalue("opencl_device")
    kernel = _kernel(text)
    inputs = _inputs(shapes)
    want = torch_op(*inputs.values()).numpy()
    if backend == "reference":
        got = napkin.reference.reference(kernel, **inputs, sizes=sizes)
    else:
        got = kernel(**inputs, backend=backend, sizes=sizes)
    assert got.shape == want.shape  # the output's length, read off the window as torch computes it
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-5, atol=1e-5)


# ---- tiled: the view is loaded tile by tile, masked past its ends -------------------------------

TILED = """kernel conv(X: f32[b c h w], W: f32[o c i j]) -> Y: f32[b o p q]:
    Y[b o p q] = pad(X[b c (2*p + i - 1) (q + j - 1)], 0) * W[o c i j]

relabel conv on H100:
    smem: group b 1, o 4, p 4, q 8; stream c 2
"""


def test_tiled_window_read_counts_equal_the_model():
    """At sizes no tile divides, the NumPy backend's counted transfers and FLOPs equal the
    model's, read off the same Program (the view priced as an input)."""
    kernel = _kernel(TILED)
    sizes = {"b": 2, "c": 5, "h": 11, "w": 13, "o": 6, "i": 3, "j": 3}
    program = kernel.program("H100", **sizes)
    bound = program.schedule.sizes
    assert (bound["p"], bound["q"]) == (6, 13)  # (11 + 2 - 3) // 2 + 1, and 13: a 'same' padding
    axis_sizes = {a: bound[a] for a in kernel.diagram.axes}
    arrays, scalars = random_arguments(kernel.diagram, axis_sizes, 0)
    outputs, counts = execute(program, arrays, scalars)
    want = F.conv2d(_t(arrays["X"]), _t(arrays["W"]), stride=(2, 1), padding=1).numpy()
    np.testing.assert_allclose(outputs["Y"].astype(np.float64), want, rtol=1e-5, atol=1e-5)
    assert_counts_equal_report(counts, cost_of(program, check=False))
    expected = evaluate(kernel.diagram, arrays, scalars, axis_sizes, keep_float64=True)["Y"]
    np.testing.assert_allclose(expected, want, rtol=1e-12, atol=1e-12)


def test_a_tiles_halo_is_what_it_moves():
    """Each tile of a window read moves its box of the parameter, halo included: groups of 4
    outputs of a 3-wide window read 4 - 1 + 3 = 6 rows of X each. Counted by the NumPy backend
    from the indices it gathers, and priced by the model, against that arithmetic."""
    kernel = _kernel("""kernel conv(X: f32[b h], W: f32[i]) -> Y: f32[b p]:
    Y[b p] = X[b (p + i)] * W[i]

relabel conv on two_level:
    l1: group p 4
""")
    program = kernel.program("two_level", b=2, h=10, i=3)  # p = 8: two groups of 4
    arrays, scalars = random_arguments(kernel.diagram, {"b": 2, "h": 10, "i": 3, "p": 8}, 0)
    _, counts = execute(program, arrays, scalars)
    x_rows, w, y = 2 * (2 * 6), 2 * 3, 2 * 8  # two groups, each 6 rows of both batches; W per group; Y
    assert counts.H["l1"] == x_rows + w + y
    assert_counts_equal_report(counts, cost_of(program, check=False))


def test_a_window_read_moves_its_parameter_from_device_memory_once():
    """On H100 the whole view is one tile at L2: device memory gives each element of X once
    (its box is all of X), not once per window position as the view's 9 x would."""
    kernel = _kernel(CASES["conv2d 3x3, padding 1"][0])
    sizes = {"b": 4, "c": 16, "h": 20, "w": 20, "o": 32, "i": 3, "j": 3}
    report = cost_of(kernel.program("H100", **sizes), check=False)
    x, w, y = 4 * 16 * 20 * 20, 32 * 16 * 3 * 3, 4 * 32 * 20 * 20
    assert int(report.levels["l2"].H) == x + w + y


def test_the_kernel_gathers_from_the_parameter():
    """The generated kernel takes X, not a view: each element of a tile is read from X at the
    window's indices, with the pad value outside; it compiles with NVRTC and runs on OpenCL."""
    kernel = _kernel(CASES["conv2d 3x3, padding 1"][0].replace("f32", "bf16"))
    compiled = kernel.compile(arch="sm_80", b=4, c=16, h=20, w=20, o=32, i=3, j=3)
    source = compiled.source
    assert "g_X_win" not in source and "const __nv_bfloat16* __restrict__ g_X," in source
    assert "g_X[" in source
    (resources,) = compiled.resources.values()
    assert resources["spill_bytes"] == 0


def test_a_convolution_tiled_along_two_row_axes_stays_off_tensor_cores_by_name():
    """A tile of 16 x 16 outputs (p and q): tensor cores take one row axis (an implicit GEMM's
    q, tests/test_implicit_gemm.py), so the launch stays on the FMA path and says why."""
    kernel = _kernel(CASES["conv2d 3x3, padding 1"][0].replace("f32", "bf16") + """
relabel conv on H100:
    smem: group b 1, o 64, p 16, q 16; stream c 16
""")
    selection = select_program(kernel.program("H100", b=4, c=32, h=32, w=32, o=64, i=3, j=3), "sm_90a")[0]
    assert selection.plan is None
    assert "Y.acc[b o p q] is not a tile of p rows by at most one other axis" in selection.reason


def test_an_axis_indexes_one_axis_of_the_array():
    with pytest.raises(NapkinTypeError, match="axis 'p' indexes two axes of X in one window read"):
        napkin.load("""kernel k(X: f32[h w]) -> Y: f32[p]:
    Y[p] = sum[i](X[(p + i) (p)])
""")


def test_tiled_window_read_on_opencl(opencl_device):
    kernel = _kernel(TILED)
    inputs = _inputs({"X": (2, 5, 11, 13), "W": (6, 5, 3, 3)}, seed=1)
    got = kernel(**inputs, backend="opencl")
    want = F.conv2d(_t(inputs["X"]), _t(inputs["W"]), stride=(2, 1), padding=1).numpy()
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-5, atol=1e-5)


def test_window_read_leaves_its_inputs_alone():
    kernel = _kernel(CASES["conv2d 3x3, padding 1"][0])
    inputs = _inputs({"X": (1, 2, 5, 5), "W": (2, 2, 3, 3)})
    kept = {name: value.copy() for name, value in inputs.items()}
    kernel(**inputs)
    for name, value in inputs.items():
        assert np.array_equal(value, kept[name])


# ---- the checker -----------------------------------------------------------------------------------


def test_a_window_read_is_a_view_of_its_parameter():
    kernel = _kernel(CASES["conv1d stride 2, padding 1, dilation 2"][0])
    (view,) = kernel.diagram.views
    assert view.axes == ("b", "c", "p", "i")
    assert view.window.source == "X" and view.window.pad == 0
    assert view.window.text(("b", "c", "h")) == "pad(X[b c (2*p + 2*i - 1)], 0)"
    (statement,) = kernel.diagram.statements
    assert statement.consumed == ("c", "i") or set(statement.consumed) == {"c", "i"}


def test_two_reads_through_one_window_share_a_view():
    kernel = _kernel("""kernel twice(X: f32[b h]) -> Y: f32[b p]:
    Y[b p] = max[i](X[b (p + i)] * X[b (p + i)])
""")
    assert len(kernel.diagram.views) == 1


@pytest.mark.parametrize("text, message, column", [
    ("    Y[b p] = sum[i](X[b (p * i)])\n", "a product of two axes", 26),
    ("    Y[b p] = sum[i](X[b (p + 0.5)])\n", "0.5, not an integer", 30),
    ("    Y[b p] = sum[i](X[(p + i)])\n", "X has 2 axes [b h] but its window read gives 1 index", 21),
    ("    Y[b p] = sum[i](pad(X[b h], 0))\n", "pad takes a window read", 21),
    ("    Y[b p] = sum[i](pad(X[b (p + i)], Z))\n", "unknown name 'Z'", 39),
    ("    Y[b p] = sum[i](X[b (p + n)])\n", "a window index adds integer multiples of axes and a constant; n, a scalar", 30),
])
def test_window_mistakes_get_a_caret(text, message, column):
    source = "kernel k(X: f32[b h], n: f32) -> Y: f32[b p]:\n" + text
    with pytest.raises(NapkinError) as caught:
        napkin.load(source)
    shown = str(caught.value)
    assert message in shown
    error = caught.value.errors[0] if hasattr(caught.value, "errors") else caught.value
    assert error.span is not None and error.span.line == 2 and error.span.column == column, shown


def test_a_window_of_an_array_on_chip_is_refused():
    with pytest.raises(NapkinTypeError, match="a window read reads a kernel parameter or an array materialised in device memory; "
                                              "H is neither"):
        napkin.load("""kernel k(X: f32[b h]) -> Y: f32[b p]:
    H[b h] = exp(X)
    Y[b p] = sum[i](H[b (p + i)])
""")


@pytest.mark.parametrize("text", [
    "    Y[b (p)] = X[b p]\n",
    "    Y[b] = sum[(h)](X[b h])\n",
])
def test_an_index_expression_is_a_reads_only(text):
    with pytest.raises(NapkinSyntaxError, match="an index expression in parentheses is a window read's"):
        napkin.load("kernel k(X: f32[b p]) -> Y: f32[b p]:\n" + text)


def test_a_read_outside_its_array_is_refused_with_its_range():
    kernel = _kernel("""kernel k(X: f32[b h], W: f32[i]) -> Y: f32[b p]:
    Y[b p] = X[b (p + i)] * W[i]
""")
    inputs = _inputs({"X": (2, 8), "W": (3,)})
    assert kernel(**inputs).shape == (2, 6)  # a valid convolution: 8 - 3 + 1
    with pytest.raises(NapkinError, match=r"reads X's axis h at p \+ i from 0 to 8 \(p=7, i=3\), outside 0 to 7"):
        kernel(**inputs, sizes={"p": 7})
    with pytest.raises(NapkinCallError, match=r"reads X's axis h at p \+ i from 0 to 8"):
        napkin.binding.bind(kernel, inputs, sizes={"p": 7})
    with pytest.raises(NapkinTypeError, match="outside 0 to 7") as caught:
        kernel.program("H100", b=2, h=8, i=3, p=7)
    assert caught.value.span.line == 2 and caught.value.span.column == 14


def test_a_window_below_zero_names_its_offset():
    kernel = _kernel("""kernel k(X: f32[h], W: f32[i]) -> Y: f32[p]:
    Y[p] = X[(p + i - 1)] * W[i]
""")
    with pytest.raises(NapkinTypeError, match="from -1 to .* or raise its offset"):
        kernel.program("H100", h=8, i=3)


def test_a_pooling_window_needs_its_size():
    kernel = _kernel(CASES["average pooling 2x2, stride 2"][0])
    with pytest.raises(NapkinCallError, match=r"axis i is not carried by any input .* sizes=\{'i': N\}"):
        kernel(**_inputs({"X": (1, 1, 4, 4)}))


def test_a_torch_op_of_a_window_read_registers_its_forward_alone():
    kernel = _kernel(CASES["conv1d stride 2, padding 1, dilation 2"][0])
    with pytest.raises(NotImplementedError, match=r"torch_op\(grad=False\) registers the forward alone"):
        kernel.torch_op()
    op = kernel.torch_op(grad=False)
    inputs = _inputs({"X": (2, 3, 13), "W": (5, 3, 3)})
    X, W = (torch.tensor(v) for v in inputs.values())
    want = F.conv1d(X.double(), W.double(), stride=2, padding=1, dilation=2)
    assert torch.allclose(op(X, W).double(), want, rtol=1e-5, atol=1e-5)


def test_a_window_read_compiles_in_a_torch_graph():
    """Under torch.compile with no graph break, the fake implementation gives the output's length
    as the window implies it (windows.inferred_sizes), and the op runs."""
    op = _kernel(CASES["conv2d 3x3, padding 1"][0]).torch_op(grad=False)

    @torch.compile(fullgraph=True, backend="eager")
    def layer(X, W):
        return torch.relu(op(X, W))

    inputs = _inputs({"X": (2, 3, 7, 9), "W": (4, 3, 3, 3)})
    X, W = (torch.tensor(v) for v in inputs.values())
    want = torch.relu(F.conv2d(X.double(), W.double(), padding=1))
    assert torch.allclose(layer(X, W).double(), want, rtol=1e-5, atol=1e-5)


# ---- a window read of a materialised intermediate: convolution, then pooling ------------------

CONV_POOL = """kernel conv_pool(X: f32[b c h w], W: f32[o c i j]) -> Y: f32[b o s t]:
    C[b o p q] = pad(X[b c (p + i - 1) (q + j - 1)], 0) * W[o c i j]
    R[b o p q] @gmem = relu(C)
    Y[b o s t] = max[k l](R[b o (2*s + k) (2*t + l)])
"""


@pytest.mark.parametrize("backend", ["reference", "numpy", "opencl"])
def test_a_window_read_of_a_materialised_intermediate(backend, request):
    """Convolution, ReLU, then 2x2 max pooling of the materialised result: the pooling's output
    length is read off the convolution's, itself read off X."""
    if backend == "opencl":
        request.getfixturevalue("opencl_device")
    kernel = _kernel(CONV_POOL)
    inputs = _inputs({"X": (2, 3, 9, 7), "W": (4, 3, 3, 3)})
    X, W = (_t(v) for v in inputs.values())
    want = F.max_pool2d(torch.relu(F.conv2d(X, W, padding=1)), 2).numpy()
    sizes = {"k": 2, "l": 2}
    if backend == "reference":
        got = napkin.reference.reference(kernel, **inputs, sizes=sizes)
    else:
        got = kernel(**inputs, backend=backend, sizes=sizes)
    assert got.shape == want.shape == (2, 4, 4, 3)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-5, atol=1e-5)


def test_a_window_read_of_an_intermediate_counts_what_the_model_prices():
    kernel = _kernel(CONV_POOL + """
relabel conv_pool on H100:
    smem for C, R: group b 1, o 2, p 4, q 4; stream c 2
    smem for Y: group b 1, o 2, s 2, t 2
""")
    program = kernel.program("H100", b=2, c=3, h=9, w=7, o=4, i=3, j=3, k=2, l=2)
    arrays, scalars = random_arguments(kernel.diagram, {a: program.schedule.sizes[a] for a in ("b", "c", "h", "w", "o", "i", "j")}, 0)
    outputs, counts = execute(program, arrays, scalars)
    want = F.max_pool2d(torch.relu(F.conv2d(_t(arrays["X"]), _t(arrays["W"]), padding=1)), 2).numpy()
    np.testing.assert_allclose(outputs["Y"].astype(np.float64), want, rtol=1e-5, atol=1e-5)
    assert_counts_equal_report(counts, cost_of(program, check=False))


def test_a_window_reads_an_array_in_device_memory():
    with pytest.raises(NapkinTypeError, match="a window read reads a kernel parameter or an array materialised in device "
                                              "memory; R is neither") as caught:
        napkin.load(CONV_POOL.replace(" @gmem", ""))
    assert "materialise it: R[b o p q] @gmem = ..." in str(caught.value)
    kernel = _kernel(CONV_POOL.replace("@gmem", "@l2"))
    with pytest.raises(NapkinError, match="R is read through a window .* materialised at @l2, below H100's top level"):
        kernel.program("H100", b=2, c=3, h=9, w=7, o=4, i=3, j=3, k=2, l=2)


# Found by the program generator once it drew window reads: the model's count of a view's loads
# from device memory against the NumPy backend's, where they differed.
@pytest.mark.parametrize("text, sizes", [
    # a strided index inside a short array: of 2 * r for r = 0, 1 only 0 lies in X2 (2 long); the
    # box is the values inside, not the span [0, 2] clipped to [0, 1]
    ("""kernel k(X2: f32[b]) -> U3: f32[r s]:
    U3 = cumprod[r](pad(X2[(s)], 0) * pad(X2[(2*r)], 0))
""", {"b": 2, "r": 2, "s": 1}),
    # a relabel clause scoped to another launch partitions nothing in the view's launch
    ("""kernel k(X2: f32[d], X5: f32[d c m], X6: f32[c d m], X8: f32[c m], X9: f32[m d]) -> Y12: f32[c d]:
    U3[m c] = cumsum[m](pad(X2[(m + c)], 0))
    C7[m] @l0 = X5[m d c] * X6
    H11[c d] = X8[c m] * X9
    Y12[c d] = H11

relabel on two_level:
    l1 for Y12, H11: group d 1; stream m 1
""", {"d": 2, "c": 2, "m": 2}),
])
def test_a_views_loads_count_what_the_model_prices(text, sizes):
    kernel = _kernel(text)
    program = kernel.program("two_level", **sizes)
    arrays, scalars = random_arguments(kernel.diagram, sizes, 0)
    outputs, counts = execute(program, arrays, scalars)
    assert_counts_equal_report(counts, cost_of(program, check=False))
    expected = evaluate(kernel.diagram, arrays, scalars, sizes, keep_float64=True)
    for name, want in expected.items():
        np.testing.assert_allclose(outputs[name].astype(np.float64), want, rtol=1e-5, atol=1e-5)


def test_a_tiles_box_along_an_index_is_the_values_it_takes_inside_the_array():
    """windows.inside_span against the values enumerated: contiguous indices (p + i, 2*p + i)
    take the clipped span's arithmetic, strided ones (2*p, 3*p + i) are enumerated; both give
    the least to the greatest value inside the array, over random tiles and offsets."""
    import random

    from napkin_dsl import algebra
    from napkin_dsl.diagram import AffineIndex
    from napkin_dsl.windows import inside_span

    rng = random.Random(0)
    for _ in range(500):
        coefficients = [rng.choice([-2, -1, 1, 2, 3]) for _ in range(rng.randint(1, 2))]
        axes = ["p", "i"][:len(coefficients)]
        index = AffineIndex(tuple((a, algebra.Integer(c)) for a, c in zip(axes, coefficients, strict=True)),
                            algebra.Integer(rng.randint(-4, 4)))
        ranges = {}
        for a in axes:
            start = rng.randint(0, 6)
            ranges[a] = (start, start + rng.randint(1, 5))
        length = rng.randint(1, 12)
        values = [int(index.offset)]
        for (a, c) in zip(axes, coefficients, strict=True):
            values = [v + c * t for v in values for t in range(*ranges[a])]
        inside = [v for v in values if 0 <= v < length]
        want = max(inside) - min(inside) + 1 if inside else 0
        assert inside_span(index, ranges, length, {}) == want, (coefficients, ranges, length, index)
