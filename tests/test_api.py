"""The Python API: @napkin.kernel, napkin.load, the annotation types, Kernel objects.

Errors in a decorated function's docstring must point into this file: the tests find the
expected line and column by searching this file's own text for the mistake.
"""

# Linters read the axis strings of napkin.f32["q d"] as forward references ("q d" is not
# Python); the same holds for every user of subscripted string annotations (cf. jaxtyping).
# ruff: noqa: F821, F722

from __future__ import annotations

import inspect
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import typeguard

import napkin_dsl as napkin
from napkin_dsl.errors import NapkinError, NapkinSyntaxError, NapkinTypeError

from .conftest import EXAMPLES

THIS_FILE = Path(__file__).resolve()
ATTENTION_TEXT = (EXAMPLES / "attention.napkin").read_text()


def where(marker: str, occurrence: int = 0) -> tuple[int, int]:
    """(line, column) of ``marker`` in this file: where an error about it must point."""
    lines = THIS_FILE.read_text().splitlines()
    hits = [(number, line.index(marker) + 1) for number, line in enumerate(lines, start=1) if marker in line]
    return hits[occurrence]


def assert_points_at(error: NapkinError, marker: str, occurrence: int = 0):
    assert error.span is not None, error.render()
    assert Path(error.span.file).resolve() == THIS_FILE, error.render()
    assert (error.span.line, error.span.column) == where(marker, occurrence), error.render()


# ---- the decorator --------------------------------------------------------------------------


def test_bare_decorator():
    @napkin.kernel
    def rows(X: napkin.f32["r c"]) -> napkin.f32["r c"]:
        """Y[r c] = softmax[c](X)"""

    assert isinstance(rows, napkin.Kernel)
    assert rows.name == "rows"
    assert rows.signature() == "rows(X: f32[r c]) -> Y: f32[r c]"
    assert rows.hardware is None and rows.relabel is None
    assert rows.diagram.statements[0].consumed == ("c",)


def test_decorator_with_hardware_and_relabel():
    @napkin.kernel(hardware="H100", relabel="smem: group b 1, h 1, q 128; stream x 64")
    def attention(Q: napkin.bf16["b h q d"], K: napkin.bf16["b h x d"], V: napkin.bf16["b h x d"]) -> napkin.bf16["b h q d"]:
        """
        S[b h q x] = Q * K * d^-0.5
        P[b h q x] = softmax[x](S)
        O[b h q d] = P * V
        """

    assert attention.hardware == "H100"
    assert [(p.kind, p.axis, p.size) for p in attention.relabel.levels[0].partitions] == [
        ("group", "b", 1), ("group", "h", 1), ("group", "q", 128), ("stream", "x", 64)]
    # The same diagram as the .napkin example.
    from_file = napkin.load(ATTENTION_TEXT)["attention"]
    assert attention.signature() == from_file.signature()
    assert [s.describe() for s in attention.diagram.statements] == [s.describe() for s in from_file.diagram.statements]


def test_decorator_with_hardware_only_checks_levels():
    @napkin.kernel(hardware="two_level")
    def unfused(S: napkin.f32["q x"], V: napkin.f32["x d"]) -> napkin.f32["q d"]:
        """
        P[q x] @l0 = softmax[x](S)
        O[q d] = P * V
        """

    assert unfused.hardware == "two_level"
    assert unfused.diagram.arrays["P"].level == "l0"


def test_relabel_block_in_docstring():
    @napkin.kernel
    def mm(A: napkin.bf16["m k"], B: napkin.bf16["k n"]) -> napkin.f32["m n"]:
        """
        C[m n] = A * B

        relabel on H100:
            smem: group m 128, n 128; stream k 32
        """

    assert mm.hardware == "H100" and mm.relabel.kernel is None
    assert mm.diagram.arrays["C"].dtype == "f32"


def test_several_named_outputs():
    @napkin.kernel
    def stats(X: napkin.f32["t d"]) -> {"m": napkin.f32["t"], "l": napkin.f32["t"]}:
        """
        m[t] = max[d](X)
        E[t d] = exp(X - m)
        l[t] = sum[d](E)
        """

    assert stats.diagram.outputs == ("m", "l")
    assert stats.signature() == "stats(X: f32[t d]) -> m: f32[t], l: f32[t]"


def test_scalar_parameter():
    @napkin.kernel
    def scale(X: napkin.f32["n"], alpha: napkin.f32) -> napkin.f32["n"]:
        """Y[n] = X * alpha"""

    assert "alpha" in scale.diagram.scalars
    assert scale.signature() == "scale(X: f32[n], alpha: f32) -> Y: f32[n]"


def test_quoted_string_annotations():
    """Annotations written as strings evaluate like __future__ ones (this module uses both)."""

    @napkin.kernel
    def quoted(X: 'napkin.f16["a b"]') -> "napkin.f32['a']":
        """Y[a] = sum[b](X)"""

    assert quoted.signature() == "quoted(X: f16[a b]) -> Y: f32[a]"
    assert isinstance(quoted.function.__annotations__["X"], str), "the function's annotations stay as written"


def test_annotations_may_name_local_aliases():
    Matrix = napkin.f32["i j"]

    @napkin.kernel
    def rowsum(A: Matrix) -> napkin.f32["i"]:
        """B[i] = sum[j](A)"""

    @napkin.kernel(hardware="H100")
    def rowmax(A: Matrix) -> napkin.f32["i"]:
        """B[i] = max[j](A)"""

    assert rowsum.signature() == "rowsum(A: f32[i j]) -> B: f32[i]"
    assert rowmax.hardware == "H100"


def test_kernel_defined_in_a_class_body():
    class Layers:
        @napkin.kernel
        def norm(X: napkin.f32["t d"]) -> napkin.f32["t"]:
            """m[t] = mean[d](X * X)"""

    assert Layers.norm.signature() == "norm(X: f32[t d]) -> m: f32[t]"


def test_kernel_keeps_the_function():
    def plain(X: napkin.f32["n"]) -> napkin.f32["n"]:
        """Y[n] = exp(X)"""

    wrapped = napkin.kernel(plain)
    assert wrapped.function is plain and wrapped.__wrapped__ is plain
    assert wrapped.__doc__ == plain.__doc__


# ---- decoration-time errors point into this file ----------------------------------------------


def test_docstring_mistake_points_to_its_line():
    with pytest.raises(NapkinTypeError) as info:

        @napkin.kernel
        def bad(A: napkin.f32["i j"]) -> napkin.f32["i"]:
            """
            T[i j] = A * 2
            B[i] = sum[zz](T)
            """

    assert "sum[zz] reduces axis 'zz'" in info.value.message
    assert_points_at(info.value, "sum[zz](T)")
    assert info.value.span.line == inspect.getsourcelines(test_docstring_mistake_points_to_its_line)[1] + 7


def test_one_line_docstring_mistake_points_to_its_column():
    with pytest.raises(NapkinTypeError) as info:

        @napkin.kernel
        def bad(A: napkin.f32["i j"]) -> napkin.f32["i"]:
            """B[i] = max[yy](A)"""

    assert_points_at(info.value, "max[yy](A)")


def test_docstring_syntax_error_points_to_its_line():
    with pytest.raises(NapkinSyntaxError) as info:

        @napkin.kernel
        def bad(A: napkin.f32["i j"]) -> napkin.f32["i"]:
            """
            B[i] = sum[j](A + 1
            """

    assert info.value.message.startswith("unbalanced parentheses")
    line, _ = where("B[i] = sum[j](A + 1")
    assert info.value.span.line == line
    assert info.value.span.column == where("B[i] = sum[j](A + 1")[1] + len("B[i] = sum[j](A + 1")


def test_unicode_before_a_one_line_docstring():
    """ast counts columns in bytes; spans count characters."""
    with pytest.raises(NapkinTypeError) as info:

        @napkin.kernel
        def bad(Χ: napkin.f32["α β"]) -> napkin.f32["α"]: """Υ[α] = sum[γγ](Χ)"""

    assert_points_at(info.value, "sum[γγ](Χ)")


def test_kernel_header_in_a_docstring():
    with pytest.raises(NapkinSyntaxError) as info:

        @napkin.kernel
        def bad(A: napkin.f32["i"]) -> napkin.f32["i"]:
            """
            kernel bad(A: f32[i]) -> B: f32[i]:
                B[i] = A
            """

    assert "docstring holds only its statements" in info.value.message
    assert_points_at(info.value, "kernel bad(A: f32[i]) -> B: f32[i]:")


def test_missing_parameter_annotation():
    with pytest.raises(NapkinError) as info:

        @napkin.kernel
        def bad(A_unannotated, B: napkin.f32["i"]) -> napkin.f32["i"]:
            """C[i] = A_unannotated + B"""

    assert info.value.message == "parameter 'A_unannotated' has no annotation"
    assert 'A_unannotated: napkin.f32["q d"]' in info.value.hint
    assert_points_at(info.value, "A_unannotated, B")


def test_missing_return_annotation():
    with pytest.raises(NapkinError) as info:

        @napkin.kernel
        def no_return(A: napkin.f32["i"]):
            """B[i] = A"""

    assert "kernel 'no_return' needs a return annotation" in info.value.message
    assert "->" in info.value.hint
    assert_points_at(info.value, "def no_return(")


def test_non_napkin_annotation():
    with pytest.raises(NapkinError) as info:

        @napkin.kernel
        def bad(A: np.ndarray) -> napkin.f32["i"]:
            """B[i] = A"""

    assert "parameter 'A' is annotated" in info.value.message and "not a napkin type" in info.value.message
    assert_points_at(info.value, "A: np.ndarray")


def test_non_napkin_output_annotation():
    with pytest.raises(NapkinError) as info:

        @napkin.kernel
        def bad(A: napkin.f32["i"]) -> {"B": napkin.f32["i"], "C": float}:
            """
            B[i] = A
            C[i] = A
            """

    assert "output 'C' is annotated" in info.value.message
    assert_points_at(info.value, '{"B": napkin.f32["i"], "C": float}')


def test_unresolvable_annotation():
    with pytest.raises(NapkinError) as info:

        @napkin.kernel
        def bad_names(A: UndefinedType) -> napkin.f32["i"]:  # noqa: F821
            """B[i] = A"""

    assert "cannot evaluate the annotations of 'bad_names'" in info.value.message
    assert "UndefinedType" in info.value.message and "imported" in info.value.hint
    assert_points_at(info.value, "def bad_names(")


def test_variadic_parameters_are_refused():
    with pytest.raises(NapkinError) as info:

        @napkin.kernel
        def bad(*arrays: napkin.f32["i"]) -> napkin.f32["i"]:
            """B[i] = arrays"""

    assert "cannot take *arrays" in info.value.message
    assert_points_at(info.value, "arrays: napkin.f32")


def test_no_docstring():
    with pytest.raises(NapkinError) as info:

        @napkin.kernel
        def empty_doc(A: napkin.f32["i"]) -> napkin.f32["i"]:
            pass

    assert "has no docstring" in info.value.message
    assert_points_at(info.value, "def empty_doc(")


def test_lambda_has_no_docstring():
    with pytest.raises(NapkinError, match="has no docstring"):
        napkin.kernel(lambda A: A)


def test_unknown_hardware_argument():
    with pytest.raises(NapkinError) as info:

        @napkin.kernel(hardware="H1000")
        def wrong_hw(A: napkin.f32["i"]) -> napkin.f32["i"]:
            """B[i] = A"""

    assert "unknown hardware 'H1000'" in info.value.message
    assert "did you mean 'H100'?" == info.value.hint
    assert_points_at(info.value, "def wrong_hw(")


def test_relabel_argument_needs_hardware():
    with pytest.raises(NapkinError, match="relabel= needs hardware="):

        @napkin.kernel(relabel="smem: group i 128")
        def needs_hw(A: napkin.f32["i"]) -> napkin.f32["i"]:
            """B[i] = A"""


def test_relabel_argument_and_block_conflict():
    with pytest.raises(NapkinError, match="relabel block in its docstring and a relabel= argument"):

        @napkin.kernel(hardware="H100", relabel="smem: group i 128")
        def twice(A: napkin.f32["i"]) -> napkin.f32["i"]:
            """
            B[i] = A

            relabel on H100:
                smem: group i 64
            """


def test_relabel_argument_syntax_error():
    with pytest.raises(NapkinSyntaxError) as info:

        @napkin.kernel(hardware="H100", relabel="smem: grop i 128")
        def typo(A: napkin.f32["i"]) -> napkin.f32["i"]:
            """B[i] = A"""

    assert info.value.message.startswith("a relabel clause needs a level name")
    assert "relabel= of typo" in info.value.span.file and "grop" in info.value.span.source_line


def test_unknown_level_in_docstring_with_hardware():
    with pytest.raises(NapkinTypeError) as info:

        @napkin.kernel(hardware="H100")
        def spill(A: napkin.f32["i"]) -> napkin.f32["i"]:
            """
            T[i] @gmme = A
            B[i] = T
            """

    assert "unknown level @gmme" in info.value.message and info.value.hint == "did you mean 'gmem'?"
    assert_points_at(info.value, "@gmme = A")


def test_return_annotation_disagrees_with_last_statement():
    with pytest.raises(NapkinTypeError) as info:

        @napkin.kernel
        def shape(A: napkin.f32["i j"]) -> napkin.f32["i j"]:
            """Bsh[i] = sum[j](A)"""

    assert "output 'Bsh' is declared with axes [i j] but assigned as Bsh[i]" in info.value.message
    assert_points_at(info.value, "Bsh[i] = sum[j](A)")


# ---- annotation types at run time -------------------------------------------------------------


@pytest.mark.parametrize(
    "annotation, dtype",
    [
        (napkin.f64, np.float64), (napkin.f32, np.float32), (napkin.f16, np.float16), (napkin.i32, np.int32),
        (napkin.i64, np.int64), (napkin.bf16, ml_dtypes.bfloat16), (napkin.fp8, ml_dtypes.float8_e4m3fn),
        (napkin.fp8e4m3, ml_dtypes.float8_e4m3fn), (napkin.fp8e5m2, ml_dtypes.float8_e5m2),
    ],
)
def test_array_isinstance_checks_dtype_and_rank(annotation, dtype):
    matrix = annotation["q d"]
    assert isinstance(np.zeros((2, 3), dtype), matrix)
    assert not isinstance(np.zeros((2, 3, 4), dtype), matrix), "rank"
    assert not isinstance(np.zeros(3, dtype), matrix), "rank"
    other = np.float32 if dtype is not np.float32 else np.float64
    assert not isinstance(np.zeros((2, 3), other), matrix), "dtype"
    assert not isinstance([[0.0] * 3] * 2, matrix), "a list is not an array"
    assert matrix.axes == ("q", "d") and matrix.dtype == annotation.dtype


def test_array_types_are_cached_and_readable():
    assert napkin.bf16["q d"] is napkin.bf16["q", "d"] is napkin.bf16["q  d"]
    assert repr(napkin.bf16["b h q d"]) == "napkin.bf16['b h q d']"
    assert repr(napkin.f32) == "napkin.f32"
    assert napkin.f32[""].axes == ()


@pytest.mark.parametrize("bad", ["q-d", "1x", 3, ("q", 4)])
def test_bad_axis_names_in_annotations(bad):
    with pytest.raises(TypeError):
        napkin.f32[bad]


def test_scalar_isinstance():
    assert isinstance(2, napkin.f32) and isinstance(0.5, napkin.f32)
    assert isinstance(np.float32(0.5), napkin.f32) and isinstance(np.array(0.5, np.float32), napkin.f32)
    assert not isinstance(np.float64(0.5), napkin.f32), "NumPy scalars match exactly, as arrays do"
    assert not isinstance(True, napkin.f32) and not isinstance("1", napkin.f32)
    assert not isinstance(np.zeros(2, np.float32), napkin.f32), "an array is not a scalar"
    assert isinstance(3, napkin.i32) and not isinstance(0.5, napkin.i32)
    assert isinstance(ml_dtypes.bfloat16(1.0), napkin.bf16)


def test_typeguard_check_type():
    typeguard.check_type(np.zeros((2, 3), ml_dtypes.bfloat16), napkin.bf16["q d"])
    typeguard.check_type(np.zeros((2, 3), ml_dtypes.float8_e4m3fn), napkin.fp8["q d"])
    with pytest.raises(typeguard.TypeCheckError, match=r"bf16\[q d\]"):
        typeguard.check_type(np.zeros((2, 3), np.float32), napkin.bf16["q d"])
    with pytest.raises(typeguard.TypeCheckError):
        typeguard.check_type(np.zeros(6, ml_dtypes.bfloat16), napkin.bf16["q d"])


# typeguard's @typechecked rewrites string constants inside annotations as forward
# references ("q d" is not Python), so inline napkin.f32["q d"] cannot be instrumented;
# module-level aliases can, and check the same way.
Rows = napkin.f32["q d"]
RowSums = napkin.f32["q"]


@typeguard.typechecked
def _row_sums(x: Rows) -> RowSums:
    return x.sum(axis=1)


def test_typechecked_function():
    assert _row_sums(np.ones((2, 3), np.float32)).tolist() == [3.0, 3.0]
    with pytest.raises(typeguard.TypeCheckError):
        _row_sums(np.ones((2, 3), np.float64))
    with pytest.raises(typeguard.TypeCheckError):
        _row_sums(np.ones(3, np.float32))


# ---- napkin.load -----------------------------------------------------------------------------


def test_load_path_pathlib_and_text():
    path = EXAMPLES / "attention.napkin"
    by_path = napkin.load(path)
    by_str = napkin.load(str(path))
    by_text = napkin.load(ATTENTION_TEXT)
    assert list(by_path) == list(by_str) == list(by_text) == ["attention"]
    assert by_path["attention"].file == str(path) and by_text["attention"].file == "<string>"
    assert by_path["attention"].signature() == by_text["attention"].signature()


def test_load_relative_path(monkeypatch):
    monkeypatch.chdir(EXAMPLES.parent)
    assert "matmul" in napkin.load("examples/matmul.napkin")


def test_load_keeps_file_order():
    text = "".join(f"kernel {name}(A: f32[i]) -> B: f32[i]:\n    B[i] = A\n" for name in ["z", "a", "m"])
    assert list(napkin.load(text)) == ["z", "a", "m"]


def test_load_with_hardware_checks_levels():
    text = "kernel k(A: f32[i]) -> B: f32[i]:\n    T[i] @l0 = A\n    B[i] = T\n"
    assert napkin.load(text, hardware="two_level")["k"].hardware == "two_level"
    with pytest.raises(NapkinTypeError, match="hardware H100 has levels"):
        napkin.load(text, hardware="H100")


def test_load_error_names_the_file(tmp_path):
    path = tmp_path / "bad.napkin"
    path.write_text("kernel k(A: f32[i]) -> B: f32[i]:\n    B[i] = Z\n")
    with pytest.raises(NapkinTypeError) as info:
        napkin.load(path)
    assert info.value.render().startswith(f"{path}:2:12: error: unknown name 'Z'")


def test_load_does_not_touch_its_input(tmp_path):
    path = tmp_path / "attention.napkin"
    path.write_text(ATTENTION_TEXT)
    before = (path.read_bytes(), os.stat(path).st_mtime_ns)
    kernel = napkin.load(path)["attention"]
    assert (path.read_bytes(), os.stat(path).st_mtime_ns) == before
    assert kernel.source == ATTENTION_TEXT
    text = ATTENTION_TEXT.replace("\n", "\r\n")
    copy = str(text)
    assert napkin.load(text)["attention"].source == text == copy


def test_decorator_does_not_touch_the_function():
    relabel = "smem: group i 128"

    def f(A: napkin.f32["i j"]) -> napkin.f32["i"]:
        """
        B[i] = sum[j](A)
        """

    doc, annotations = f.__doc__, dict(f.__annotations__)
    k = napkin.kernel(hardware="H100", relabel=relabel)(f)
    assert f.__doc__ == doc and f.__annotations__ == annotations
    assert relabel == "smem: group i 128"
    assert k.source == doc


# ---- Kernel objects ----------------------------------------------------------------------------


def test_kernel_repr_is_readable():
    kernel = napkin.load(ATTENTION_TEXT)["attention"]
    assert repr(kernel) == (
        "<napkin kernel attention(Q: bf16[b h q d], K: bf16[b h x d], V: bf16[b h x d]) -> O: bf16[b h q d], "
        "3 statements, on H100: smem: group b 1, h 1, q 128; stream x 64>"
    )
    one = napkin.load("kernel twice(X: f32[n]) -> Y: f32[n]:\n    Y[n] = X * 2\n")["twice"]
    assert repr(one) == "<napkin kernel twice(X: f32[n]) -> Y: f32[n], 1 statement, no relabelling>"


def test_public_api():
    for name in ["kernel", "load", "Kernel", "NapkinError", "NapkinErrors", "NapkinSyntaxError", "NapkinTypeError",
                 "f16", "bf16", "f32", "f64", "fp8", "i32", "i64"]:
        assert hasattr(napkin, name), name
    assert issubclass(napkin.NapkinSyntaxError, napkin.NapkinError)
    assert issubclass(napkin.NapkinErrors, napkin.NapkinError)


def test_call_form_annotations_work_under_typechecked():
    """typeguard's @typechecked reads "q d" in napkin.f32["q d"] as a forward reference; the call
    form napkin.f32("q d") is the same type and passes through its instrumentation."""
    from typeguard import TypeCheckError, typechecked

    @typechecked
    def identity(x: napkin.f32("q d")) -> napkin.f32("q d"):
        return x

    assert identity(np.zeros((2, 3), np.float32)).shape == (2, 3)
    with pytest.raises(TypeCheckError):
        identity(np.zeros((2, 3), np.float64))
    assert napkin.bf16("b h") is napkin.bf16["b h"]
