"""Malformed and ill-typed programs: each names what is wrong, where, and what to do.

Every case is a small napkin file with one mistake. The test checks the exception class, the
line and column the error points at, and the key words of its message (the axis, array,
level or hardware involved) and of its hint. Syntax mistakes must use the curated messages of
``syntax._CURATED``; a meta-test makes sure every curated message is exercised here.
"""

from __future__ import annotations

import pytest

import napkin_dsl as napkin
from napkin_dsl.errors import NapkinError, NapkinErrors, NapkinSyntaxError, NapkinTypeError, Span
from napkin_dsl.syntax import _CURATED

# A kernel header used by many cases; statements start on line 2, column 5.
K = "kernel k(A: f32[i]) -> B: f32[i]:\n"
KIJ = "kernel k(A: f32[i j], s: f32) -> B: f32[i j]:\n"
BOX = "box F(f32[x], f32[w]) -> f32[y]\n"
REL = "kernel k(A: f32[i]) -> B: f32[i]:\n    B[i] = A\n\n"  # a valid kernel; a relabel block follows on line 4


def case(id, source, cls, line, column, message, hint=None):
    """One row of the table: ``message`` and ``hint`` are substrings (or lists of them)."""
    message = [message] if isinstance(message, str) else list(message)
    hint = [hint] if isinstance(hint, str) else list(hint or [])
    return pytest.param(source, cls, line, column, message, hint, id=id)


SYNTAX = [
    case("missing-equals", K + "    B[i] A[i]\n", NapkinSyntaxError, 2, 10, ["missing '=' in a statement", "'A'"], "TARGET[axes] = expression"),
    case("missing-operator", K + "    B[i] = A[i] A[i]\n", NapkinSyntaxError, 2, 17, "missing operator between two operands", "A * B"),
    case("unclosed-bracket-type", "kernel k(A: f32[i) -> B: f32[i]:\n    B[i] = A[i]\n", NapkinSyntaxError, 1, 18,
         ["unclosed '[' in an axis list", "')'"], "']'"),
    case("unclosed-bracket-target", K + "    B[i = A[i]\n", NapkinSyntaxError, 2, 9, "unclosed '[' in an axis list"),
    case("commas-in-axes", K + "    B[i, j] = A[i]\n", NapkinSyntaxError, 2, 8, "axis lists are separated by spaces, not commas", "A[i j]"),
    case("header-missing-colon", "kernel k(A: f32[i]) -> B: f32[i]\n    B[i] = A[i]\n", NapkinSyntaxError, 1, 33,
         ["missing ':' at the end of the kernel header", "end of line"]),
    case("statement-on-header-line", "kernel k(A: f32[i]) -> B: f32[i]: B[i] = A[i]\n", NapkinSyntaxError, 1, 35,
         "statements go on their own lines below the kernel header"),
    case("header-missing-outputs", "kernel k(A: f32[i]):\n    B[i] = A[i]\n", NapkinSyntaxError, 1, 20,
         "missing '->' and outputs in the kernel header", "OUT: f32[axes]"),
    case("param-missing-colon", "kernel k(A f32[i]) -> B: f32[i]:\n    B[i] = A[i]\n", NapkinSyntaxError, 1, 12,
         "missing ':' between a name and its type", "NAME: DTYPE[axes]"),
    case("unknown-dtype", "kernel k(A: float32[i]) -> B: f32[i]:\n    B[i] = A[i]\n", NapkinSyntaxError, 1, 13,
         ["missing or unknown dtype in a type", "'float32'"], "bf16"),
    case("unknown-output-dtype", "kernel k(A: f32[i]) -> B: int8[i]:\n    B[i] = A[i]\n", NapkinSyntaxError, 1, 27,
         ["missing or unknown dtype in a type", "'int8'"]),
    case("box-missing-arrow", "box F(f32[x]) f32[y]\n", NapkinSyntaxError, 1, 15, "missing '->' in a box declaration", "box NAME("),
    case("unbalanced-open", K + "    B[i] = exp(A[i]\n", NapkinSyntaxError, 2, 20, "unbalanced parentheses in an expression"),
    case("unbalanced-close", K + "    B[i] = A[i] + 1)\n", NapkinSyntaxError, 2, 20, ["unbalanced parentheses in an expression", "')'"]),
    case("python-power", K + "    B[i] = A[i] ** 2\n", NapkinSyntaxError, 2, 18, "napkin writes powers as a^b, not a**b", "d^-0.5"),
    case("dangling-operator", K + "    B[i] = A[i] *\n", NapkinSyntaxError, 2, 18, "an operator is missing an operand"),
    case("double-operator", K + "    B[i] = A[i] + * A[i]\n", NapkinSyntaxError, 2, 19, ["an operator is missing an operand", "'*'"]),
    case("relabel-clause-no-level", REL + "relabel k on H100:\n    group i 128\n", NapkinSyntaxError, 5, 5,
         "a relabel clause needs a level name, then 'group' or 'stream'", "smem: group q 128; stream x 64"),
    case("relabel-clause-no-size", REL + "relabel k on H100:\n    smem: group i\n", NapkinSyntaxError, 5, 18,
         "a relabel clause needs a level name"),
    case("relabel-missing-semicolon", REL + "relabel k on H100:\n    smem: group i 128 stream i 64\n", NapkinSyntaxError, 5, 23,
         "separate the 'group' and 'stream' lists of a level with ';'"),
    case("relabel-negative-size", REL + "relabel k on H100:\n    smem: group i -1\n", NapkinSyntaxError, 5, 19,
         "a partition size is a positive integer or a symbol"),
    case("relabel-missing-on", REL + "relabel k H100:\n    smem: group i 128\n", NapkinSyntaxError, 4, 11,
         ["a relabel block needs 'on HARDWARE'", "'H100'"]),
    case("relabel-header-colon", REL + "relabel k on H100\n    smem: group i 128\n", NapkinSyntaxError, 4, 18,
         "missing ':' at the end of the relabel header"),
    case("reserved-word-param", "kernel k(group: f32[i]) -> B: f32[i]:\n    B[i] = group\n", NapkinSyntaxError, 1, 10,
         ["a reserved word is used as a name", "'group'"], "reserved"),
    case("reserved-word-axis", "kernel k(A: f32[stream]) -> B: f32[i]:\n    B[i] = A\n", NapkinSyntaxError, 1, 17,
         ["a reserved word is used as a name", "'stream'"]),
    case("reserved-word-target", K + "    on[i] = A[i]\n", NapkinSyntaxError, 2, 5, ["a reserved word is used as a name", "'on'"]),
    case("stray-character", K + "    B[i] = A[i] % 2\n", NapkinSyntaxError, 2, 17, "unexpected character '%'", "end of line"),
    case("integer-too-long", K + "    B[i] = A * " + "9" * 5000 + "\n", NapkinSyntaxError, 2, 16, "5,000 digits", "smaller"),
    case("nested-too-deep", K + "    B[i] = " + "(" * 100 + "A" + ")" * 100 + "\n", NapkinSyntaxError, 2, 76,
         "nested more than 64 levels deep", "several statements"),
    case("chain-too-deep", K + "    B[i] = A" + " + A" * 300 + "\n", NapkinSyntaxError, 2, 12,
         "more than 200 operations deep", "several statements"),
    case("comparison-chain", K + "    B[i] = where(0 < i < 2, A, 0)\n", NapkinSyntaxError, 2, 24,
         "comparisons do not chain", "a < b and b < c"),
]

NAMES = [
    case("unknown-name", K + "    B[i] = Aa[i]\n", NapkinTypeError, 2, 12, "unknown name 'Aa'", "did you mean 'A'?"),
    case("use-before-definition", K + "    B[i] = T[i]\n    T[i] = A\n", NapkinTypeError, 2, 12,
         "'T' is used before it is defined", "assigned later, at <string>:3:5"),
    case("output-never-assigned", "kernel k(A: f32[i]) -> B: f32[i], C: f32[i]:\n    B[i] = A\n", NapkinTypeError, 1, 35,
         "output 'C' is never assigned", "C[i] = ..."),
    case("assigned-twice", K + "    B[i] = A\n    B[i] = A * 2\n", NapkinTypeError, 3, 5, "'B' is assigned twice", "first assigned at <string>:2:5"),
    case("assign-parameter", K + "    A[i] = A * 2\n    B[i] = A\n", NapkinTypeError, 2, 5, "cannot assign to parameter 'A'", "read-only"),
    case("parameter-declared-twice", "kernel k(A: f32[i], A: f32[i]) -> B: f32[i]:\n    B[i] = A\n", NapkinTypeError, 1, 21,
         "'A' is declared twice in kernel 'k'", "first declared at <string>:1:10"),
    case("output-named-like-parameter", "kernel k(A: f32[i]) -> A: f32[i]:\n    B[i] = A\n", NapkinTypeError, 1, 24,
         "output 'A' has the name of a parameter"),
    case("output-declared-twice", "kernel k(A: f32[i]) -> B: f32[i], B: f32[i]:\n    B[i] = A\n", NapkinTypeError, 1, 35,
         "output 'B' is declared twice"),
    case("scalar-output", "kernel k(A: f32[i]) -> B: f32:\n    B[i] = A\n", NapkinTypeError, 1, 24, "output 'B' needs axes", "B: f32[axes]"),
    case("empty-kernel", K, NapkinTypeError, 1, 8, "kernel 'k' has no statements", "Y[i] = X[i]"),
    case("unknown-function", K + "    B[i] = expp(A)\n", NapkinTypeError, 2, 12, "unknown function 'expp'", "did you mean 'exp'?"),
    case("unknown-function-no-match", K + "    B[i] = frobnicate(A)\n", NapkinTypeError, 2, 12,
         "unknown function 'frobnicate'", ["softmax", "declare others with 'box'"]),
    case("duplicate-kernel", K + "    B[i] = A\n" + K + "    B[i] = A\n", NapkinTypeError, 3, 8,
         "kernel 'k' is defined twice", "first defined at <string>:1:8"),
    case("duplicate-box", BOX + BOX + K + "    B[i] = A\n", NapkinTypeError, 2, 5, "box 'F' is declared twice", "first declared at <string>:1:5"),
    case("box-named-like-builtin", "box exp(f32[x]) -> f32[y]\n" + K + "    B[i] = A\n", NapkinTypeError, 1, 5,
         "box 'exp' has the name of a built-in function"),
]

AXES = [
    case("axis-twice-in-parameter", "kernel k(A: f32[i i]) -> B: f32[i]:\n    B[i] = A\n", NapkinTypeError, 1, 13,
         ["axis 'i' appears twice", "'A'", "[i i]"], "two names"),
    case("axis-twice-in-target", K + "    T[i i] = A\n    B[i] = A\n", NapkinTypeError, 2, 5, ["axis 'i' appears twice", "'T'"]),
    case("wrong-axes-on-reference", KIJ + "    B[i j] = A[i k]\n", NapkinTypeError, 2, 14,
         ["A has axes [i j]", "A[i k]", "missing [j]"], "spell its axes as A[i j]"),
    case("axis-repeated-on-reference", KIJ + "    B[i j] = A[i i]\n", NapkinTypeError, 2, 14, "axis repeated in A[i i]"),
    case("scalar-with-axes", KIJ + "    B[i j] = A * s[i]\n", NapkinTypeError, 2, 18, "'s' is a scalar and has no axes", "write s"),
    case("axis-used-as-array", KIJ + "    B[i j] = A * i[i]\n", NapkinTypeError, 2, 18, "'i' is an axis (a size), not an array"),
    case("output-axes-differ", KIJ + "    B[i] = sum[j](A)\n", NapkinTypeError, 2, 5,
         ["output 'B' is declared with axes [i j]", "B[i]"], "declared at <string>:1:34"),
    case("reduce-missing-axis", "kernel k(A: f32[i j]) -> B: f32[i]:\n    B[i] = sum[k](A)\n", NapkinTypeError, 2, 12,
         ["sum[k] reduces axis 'k'", "[i j]"]),
    case("reduce-missing-axis-near-miss", "kernel k(A: f32[q x]) -> B: f32[q]:\n    B[q] = max[xx](A)\n", NapkinTypeError, 2, 12,
         "max[xx] reduces axis 'xx'", "did you mean 'x'?"),
    case("reduce-no-axis", KIJ + "    B[i j] = sum[](A)\n", NapkinTypeError, 2, 14, "sum[] names no axis", "sum[AXIS]"),
    case("reduce-target-axes", "kernel k(A: f32[i j]) -> B: f32[i]:\n    T[j] = sum[j](A)\n    B[i] = sum[j](A)\n", NapkinTypeError, 2, 5,
         ["T[j] does not match sum[j]", "the result has axes [i]"], "write T[i]"),
    case("softmax-no-axis", KIJ + "    B[i j] = softmax(A)\n", NapkinTypeError, 2, 14, ["softmax needs exactly one axis", "got none"]),
    case("softmax-two-axes", KIJ + "    B[i j] = softmax[i j](A)\n", NapkinTypeError, 2, 14,
         ["softmax needs exactly one axis", "got [i j]"], "softmax[AXIS]"),
    case("softmax-missing-axis", KIJ + "    B[i j] = softmax[x](A)\n", NapkinTypeError, 2, 14, ["softmax[x]", "axis 'x'", "[i j]"]),
    case("contraction-axis-in-one-operand", "kernel k(A: f32[i j], C: f32[k]) -> B: f32[i k]:\n    B[i k] = A[i j] * C[k]\n",
         NapkinTypeError, 2, 14, ["axis 'j' is contracted but appears only in A[i j]"], "sum[j](A)"),
    case("contraction-extra-target-axis", "kernel k(A: f32[i j], C: f32[j k]) -> B: f32[i k z]:\n    B[i k z] = A * C\n",
         NapkinTypeError, 2, 5, ["axis 'z' of B[i k z]", "no operand"]),
    case("non-product-drops-axis", "kernel k(A: f32[i j], C: f32[i j]) -> B: f32[i]:\n    B[i] = A + C\n", NapkinTypeError, 2, 12,
         ["axis 'j' of A[i j] is not an axis of B[i]", "only a product"], ["sum[j]", "max[j]"]),
    case("product-without-target-axes", "kernel k(A: f32[i j], C: f32[j k]) -> B: f32[i k]:\n    T = A * C\n    B[i k] = T\n",
         NapkinTypeError, 2, 5, "name the axes of 'T'", "T[i j k]"),
    case("reduction-nested", "kernel k(A: f32[i j]) -> B: f32[i]:\n    B[i] = sum[j](A) * 2\n", NapkinTypeError, 2, 12,
         "sum[j](...) must be the whole right-hand side", "statement of its own"),
    case("softmax-nested", KIJ + "    B[i j] = exp(softmax[j](A))\n", NapkinTypeError, 2, 18, "softmax[j](...) must be the whole right-hand side"),
    case("axes-on-plain-function", KIJ + "    B[i j] = exp[i](A)\n", NapkinTypeError, 2, 14, "exp takes no axis list"),
    case("binary-function-arity", KIJ + "    B[i j] = max(A)\n", NapkinTypeError, 2, 14, "max(a, b) takes two arguments, got 1", "max[AXIS]"),
    case("unary-function-arity", KIJ + "    B[i j] = exp(A, A)\n", NapkinTypeError, 2, 14, "exp takes one argument, got 2"),
    # a scale over an axis its fp8 array lacks (sK's keys on Q's blocks), named as a scale, not a contraction
    case("fp8-scale-wrong-axis", "kernel k(Q: fp8e4m3[qb qi d], sK: f32[xb]) -> Qf: f32[qb qi d]:\n    Qf[qb qi d] = Q * sK\n",
         NapkinTypeError, 2, 23, ["sK[xb] scales the fp8e4m3 array Q[qb qi d], which has no axis 'xb'", "a scale's axes are axes of the array it scales"],
         ["per row", "per block of rows"]),
]

CONSTANTS = [
    case("division-by-zero", K + "    B[i] = A * (1/0)\n", NapkinTypeError, 2, 17, ["1 / 0", "division by zero"]),
    case("zero-to-negative-power", K + "    B[i] = A * 0^-1\n", NapkinTypeError, 2, 16, "division by zero"),
    case("array-over-zero", K + "    B[i] = A * 2/0\n", NapkinTypeError, 2, 18, "division by the constant 0"),
    case("number-out-of-range", K + "    B[i] = A * 1e400\n", NapkinTypeError, 2, 16, "number 1e400 is out of floating-point range"),
    case("power-out-of-range", K + "    B[i] = A * 10^(10^8)\n", NapkinTypeError, 2, 16, ["10^100000000", "out of floating-point range"]),
    case("imaginary-constant", K + "    B[i] = A * (-1)^0.5\n", NapkinTypeError, 2, 16, "is not a real number"),
]

BOXES = [
    case("box-arity", BOX + "kernel k(X: f32[a x]) -> Y: f32[a y]:\n    Y[a y] = F(X)\n", NapkinTypeError, 3, 14,
         "box F takes 2 inputs, got 1", "declared at <string>:1:5"),
    case("box-axes", BOX + "kernel k(X: f32[a x], W: f32[v]) -> Y: f32[a y]:\n    Y[a y] = F(X, W)\n", NapkinTypeError, 3, 19,
         ["input 2 of box F needs axis 'w'", "f32[w]", "W has axes [v]"]),
    case("box-dtype", BOX + "kernel k(X: f32[a x], W: f16[w]) -> Y: f32[a y]:\n    Y[a y] = F(X, W)\n", NapkinTypeError, 3, 19,
         ["input 2 of box F is f32", "W is f16"], "convert it"),
    case("box-target-axes", BOX + "kernel k(X: f32[a x], W: f32[w]) -> Y: f32[a y]:\n    T[a] = F(X, W)\n    Y[a y] = F(X, W)\n",
         NapkinTypeError, 3, 5, ["T[a] does not match box F", "[a y]"], "write T[a y]"),
    case("box-expression-argument", BOX + "kernel k(X: f32[a x], W: f32[w]) -> Y: f32[a y]:\n    Y[a y] = F(X * 2, W)\n",
         NapkinTypeError, 3, 16, "input 1 of box F must be an array name"),
    case("box-with-axis-list", BOX + "kernel k(X: f32[a x], W: f32[w]) -> Y: f32[a y]:\n    Y[a y] = F[a](X, W)\n",
         NapkinTypeError, 3, 14, "box F takes no axis list"),
]

LEVELS = [
    case("unknown-level", K + "    T[i] @gmme = A\n    B[i] = T\n", NapkinTypeError, 2, 10,
         ["unknown level @gmme", "'T'"], "did you mean 'gmem'?"),
    case("level-not-of-hardware", K + "    T[i] @l0 = A\n    B[i] = T\n\nrelabel k on H100:\n    smem: group i 128\n",
         NapkinTypeError, 2, 10, ["unknown level @l0", "hardware H100 has levels gmem, l2, smem, registers"], "T[...] @gmem"),
    case("unknown-hardware", REL + "relabel k on H101:\n    smem: group i 128\n", NapkinTypeError, 4, 14,
         "unknown hardware 'H101'", "did you mean 'H100' or 'H100x8'?"),
    case("unknown-hardware-no-match", REL + "relabel k on TPU:\n    smem: group i 128\n", NapkinTypeError, 4, 14,
         "unknown hardware 'TPU'", ["known hardware", "H100", "two_level"]),
    case("relabel-unknown-kernel", REL + "relabel kk on H100:\n    smem: group i 128\n", NapkinTypeError, 4, 15,
         "relabel names unknown kernel 'kk'", "did you mean 'k'?"),
    case("relabel-level-not-in-hardware", REL + "relabel k on H100:\n    l1: group i 128\n", NapkinTypeError, 5, 5,
         ["hardware H100 has no level 'l1'", "gmem, l2, smem, registers"], "l2, smem, registers"),
    case("relabel-level-near-miss", REL + "relabel k on H100:\n    smen: group i 128\n", NapkinTypeError, 5, 5,
         "has no level 'smen'", "did you mean 'smem'?"),
    case("relabel-twice", REL + "relabel k on H100:\n    smem: group i 1\nrelabel k on H100:\n    smem: group i 2\n",
         NapkinTypeError, 6, 14, "kernel 'k' is relabelled twice", "first relabelled at <string>:4:14"),
    case("unnamed-relabel-two-kernels", REL + K.replace("k(", "k2(") + "    B[i] = A\nrelabel on H100:\n    smem: group i 1\n",
         NapkinTypeError, 6, 12, "a relabel block without a kernel name needs exactly one kernel", "relabel KERNEL on HARDWARE"),
]

# A float value stored as an integer (issue 26): the backends would round it, and napkin has no
# cast to ask for that; the caret is at the dtype written after the level, or at an output's statement.
INTEGERS = [
    case("float-stored-as-i32", K + "    H[i] @gmem i32 = A * 2\n    B[i] = H + 0.5\n", NapkinTypeError, 2, 16,
         ["H is stored as i32", "its value is a float", "computed from A (f32)"], ["@gmem f32", "drop 'i32'", "no cast"]),
    case("float-stored-as-i64-through-chip", "kernel k(N: i32[i], A: f32[i]) -> B: f32[i]:\n    T[i] = N * A\n"
         "    H[i] @gmem i64 = T + N\n    B[i] = H\n", NapkinTypeError, 3, 16, ["H is stored as i64", "computed from A (f32)"]),
    case("float-scalar-stored-as-i32", "kernel k(N: i32[i], s: f32) -> B: f32[i]:\n    H[i] @gmem i32 = N * s\n    B[i] = H\n",
         NapkinTypeError, 2, 16, ["H is stored as i32", "computed from s (f32)"]),
    case("float-output-declared-i32", "kernel k(A: f32[i]) -> B: i32[i]:\n    B[i] = A * 2\n", NapkinTypeError, 2, 5,
         ["output B is declared i32", "computed from A (f32)"], ["declare B as f32", "<string>:1:"]),
]

TABLE = SYNTAX + NAMES + AXES + CONSTANTS + BOXES + LEVELS + INTEGERS


def single_error(source: str) -> NapkinError:
    """The one error napkin.load raises for a source with one mistake."""
    with pytest.raises(NapkinError) as info:
        napkin.load(source)
    error = info.value
    assert not isinstance(error, NapkinErrors), f"expected one error, got:\n{error.render()}"
    return error


@pytest.mark.parametrize("source, cls, line, column, message, hint", TABLE)
def test_error_table(source, cls, line, column, message, hint):
    error = single_error(source)
    assert type(error) is cls, error.render()
    assert error.span is not None, error.render()
    assert (error.span.line, error.span.column) == (line, column), error.render()
    for needle in message:
        assert needle in error.message, f"{needle!r} not in message:\n{error.render()}"
    for needle in hint:
        assert error.hint and needle in error.hint, f"{needle!r} not in hint:\n{error.render()}"
    rendered = error.render()
    assert rendered.startswith(f"<string>:{line}:{column}: ")
    assert "^" in rendered, "the source line and a caret are shown"
    assert "Traceback" not in rendered and "lark" not in rendered.lower()


def test_table_is_large():
    assert len(TABLE) >= 35


def test_every_curated_message_is_exercised():
    """Each curated syntax message of syntax._CURATED is produced by some case of the table."""
    produced = set()
    for param in SYNTAX:
        source = param.values[0]
        with pytest.raises(NapkinSyntaxError) as info:
            napkin.load(source)
        produced.add(info.value.message)
    for message, _, _ in _CURATED:
        assert any(text.startswith(message) for text in produced), f"no case produces the curated message {message!r}"


def test_every_curated_example_gets_its_own_message():
    """The curated examples are consistent: each fails with the message it illustrates."""
    from napkin_dsl.syntax import _curated_examples, parse

    for start in ("file", "body"):
        for label, example in _curated_examples(start):
            try:
                parse(example, start=start)
            except NapkinSyntaxError as error:
                assert error.message.startswith(_CURATED[label][0]), (start, example, error.message)


def test_curated_message_inside_docstring_body():
    """Docstring bodies (start='body') get curated messages too."""
    from napkin_dsl.syntax import parse

    with pytest.raises(NapkinSyntaxError) as info:
        parse("B[i] = sum[j](A\n", start="body")
    assert info.value.message.startswith("unbalanced parentheses")
    with pytest.raises(NapkinSyntaxError) as info:
        parse("kernel k(A: f32[i]) -> B: f32[i]:\n    B[i] = A\n", start="body")
    assert "docstring holds only its statements" in info.value.message


# ---- several errors at once -----------------------------------------------------------------

MANY = """\
kernel k(A: f32[i j]) -> B: f32[i], C: f32[i]:
    T[i j] = Aa
    U[i j] = expp(A)
    B[i] = sum[z](A)

relabel k on H101:
    smem: group i 128
"""


def test_several_errors_reported_together_in_line_order():
    with pytest.raises(NapkinErrors) as info:
        napkin.load(MANY)
    errors = info.value.errors
    summary = [(e.span.line, e.span.column, e.message) for e in errors]
    assert [(line, column) for line, column, _ in summary] == [(1, 37), (2, 14), (3, 14), (4, 12), (6, 14)], summary
    assert "output 'C' is never assigned" in summary[0][2]
    assert "unknown name 'Aa'" in summary[1][2]
    assert "unknown function 'expp'" in summary[2][2]
    assert "sum[z]" in summary[3][2]
    assert "unknown hardware 'H101'" in summary[4][2]
    rendered = info.value.render()
    assert rendered.endswith("5 errors")
    assert rendered.index("never assigned") < rendered.index("'Aa'") < rendered.index("'expp'") < rendered.index("H101")
    # The aggregate reads like its first error, so code that catches NapkinError sees a place.
    assert info.value.span == errors[0].span
    assert [e["line"] for e in info.value.to_dict()["errors"]] == [1, 2, 3, 4, 6]


def test_a_failed_statement_does_not_cascade():
    """Using an array whose own statement was wrong reports the first mistake only."""
    source = "kernel k(A: f32[i j]) -> B: f32[i]:\n    T[i] = A + 1\n    B[i] = T * 2\n"
    error = single_error(source)
    assert error.span.line == 2 and "axis 'j'" in error.message


def test_errors_in_two_kernels_are_both_reported():
    source = K + "    B[i] = X\n" + K.replace("k(", "k2(") + "    B[i] = Y\n"
    with pytest.raises(NapkinErrors) as info:
        napkin.load(source)
    assert [(e.span.line, e.message) for e in info.value.errors] == [(2, "unknown name 'X'"), (4, "unknown name 'Y'")]


# ---- rendering -------------------------------------------------------------------------------


def test_render_shows_file_line_column_source_caret_and_hint():
    error = single_error(KIJ + "    B[i j] = A[i k]\n")
    lines = error.render().splitlines()
    assert lines[0] == "<string>:2:14: error: A has axes [i j] but is used as A[i k] (missing [j])"
    assert lines[1] == "        B[i j] = A[i k]"
    assert lines[2] == "             " + "    ^"
    assert lines[3].startswith("  hint: A is defined at <string>:1:10")


def test_caret_under_tabs():
    """Tabs in the source line expand the same way above and below the caret."""
    error = single_error("kernel k(A: f32[i]) -> B: f32[i]:\n\tB[i] =\tZ\n")
    source_line, caret = error.render().splitlines()[1:3]
    assert source_line[caret.index("^")] == "Z"


def test_span_caret_run_covers_the_name():
    span = Span("f.napkin", 1, 5, "abc defgh", 10)
    assert span.excerpt().splitlines()[1] == "        ^^^^^"
    assert str(span) == "f.napkin:1:5"


def test_to_dict_of_one_error():
    error = single_error(K + "    B[i] = Aa\n")
    assert error.to_dict() == {
        "kind": "NapkinTypeError", "message": "unknown name 'Aa'", "file": "<string>", "line": 2, "column": 12,
        "hint": "did you mean 'A'?",
    }
