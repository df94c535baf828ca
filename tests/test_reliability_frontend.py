"""Regression tests for the front-end failures of issue 13 (items 6 to 10), found by fuzzing.

Each failure is exercised through the Python API and, where a user meets it on the command
line, through ``napkin``'s entry point: a user mistake exits 2 with the message on stderr
naming the offending thing, and never prints a traceback (an exception that is not a
``NapkinError`` escapes ``main`` and fails the test).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sympy

import napkin_dsl as napkin
from napkin_dsl.cli import main
from napkin_dsl.errors import NapkinError, NapkinSyntaxError, NapkinTypeError

ELEMENTWISE = "kernel k(X: f32[i]) -> Y: f32[i]:\n    Y[i] = X * 2\n"


def write(tmp_path: Path, source: str, name: str = "k.napkin") -> str:
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def cli_fails(capsys, *args: str) -> str:
    """The command must exit 2 and explain on stderr."""
    code, out, err = cli(capsys, *args)
    assert code == 2, (out, err)
    assert err.strip()
    return err


# ---- 6: tuning an elementwise kernel on an abstract model ----------------------------------


@pytest.mark.parametrize("hardware", ["two_level", "three_level"])
def test_tune_elementwise_kernel_has_beta_zero(hardware):
    # H = 2i whatever the tiles: the fit's two optima are equal and their difference from H0 is 0.
    result = napkin.load(ELEMENTWISE)["k"].tune(hardware)
    assert result.beta == 0
    assert result.optimum == 2 * sympy.Symbol("i", positive=True, integer=True)
    assert result.relabel_block().splitlines()[1].strip().startswith(("l1: group i", "l2: group i"))


def test_tune_elementwise_kernel_cli(tmp_path, capsys):
    code, out, _ = cli(capsys, "tune", write(tmp_path, ELEMENTWISE))
    assert code == 0
    assert "beta = 0" in out
    # The configuration is written out as a relabel block (it used to come out empty).
    assert "l1: group i" in out.split("as a relabel block:")[1]


def test_tune_softmax_rows_example_on_an_abstract_model(capsys):
    from .conftest import EXAMPLES

    code, out, _ = cli(capsys, "tune", str(EXAMPLES / "softmax.napkin"), "--hardware", "two_level", "--json")
    assert code == 0
    assert '"beta": 0' in out


# ---- 7: a reduction naming one axis twice --------------------------------------------------


@pytest.mark.parametrize("reduction", ["sum", "max", "min", "mean"])
def test_repeated_reduction_axis_is_a_checker_error(reduction):
    source = f"kernel k(X: f32[i j]) -> Y: f32[i]:\n    Y[i] = {reduction}[j j](X)\n"
    with pytest.raises(NapkinTypeError) as info:
        napkin.load(source)
    error = info.value
    assert error.message == f"{reduction}[j j] names axis 'j' twice"
    column = len(f"    Y[i] = {reduction}[j ") + 1
    assert (error.span.line, error.span.column) == (2, column)  # the caret sits under the second j
    assert f"{reduction}[j](...)" in error.hint


def test_repeated_reduction_axis_cli(tmp_path, capsys):
    path = write(tmp_path, "kernel k(X: f32[i j]) -> Y: f32[i]:\n    Y[i] = sum[j j](X)\n")
    err = cli_fails(capsys, "check", path)
    assert f"{path}:2:18: error: sum[j j] names axis 'j' twice" in err
    assert "hint: reduce each axis once: sum[j](...)" in err
    cli_fails(capsys, "run", path, "--set", "i=4", "j=4")  # it used to reach NumPy's ValueError


def test_repeated_box_input_axis_is_a_checker_error():
    source = "box F(f32[x x]) -> f32[y]\nkernel k(X: f32[i x]) -> Y: f32[i y]:\n    Y[i y] = F(X)\n"
    with pytest.raises(NapkinTypeError, match=r"axis 'x' appears twice in input 1 of box F f32\[x x\]") as info:
        napkin.load(source)
    assert (info.value.span.line, info.value.span.column) == (1, 7)


# ---- 8: hardware names that are neither a profile nor a readable .toml file ----------------


LONG_NAME = "a" * 300


@pytest.mark.parametrize("name, message", [
    (LONG_NAME, "unknown hardware 'aaaa"),
    (LONG_NAME + ".toml", "cannot be a file"),  # ENAMETOOLONG from stat()
    ("bad\x00name.toml", "'bad\\x00name.toml'"),
    ("/no/such/profile.toml", "hardware profile '/no/such/profile.toml' does not exist"),
    ("../hardware/H100", "unknown hardware '../hardware/H100'"),  # only bundled names are looked up
    ("", "unknown hardware ''"),
])
def test_load_hardware_refuses_names_it_cannot_read(name, message):
    from napkin_dsl.hardware import load_hardware

    with pytest.raises(NapkinError) as info:
        load_hardware(name)
    assert message in info.value.message
    assert len(info.value.message) < 200  # a 300-character name is cut, with its length
    if name:  # an empty hardware= means the default, as None does
        with pytest.raises(NapkinError):
            napkin.load(ELEMENTWISE)["k"].cost(name)


def test_load_hardware_refuses_unreadable_or_invalid_profiles(tmp_path):
    from napkin_dsl.hardware import load_hardware

    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "syntax.toml").write_text("not toml\n")
    (tmp_path / "levels.toml").write_text('name = "x"\n')
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe\x00")
    cases = {"dir.toml": "is a directory", "syntax.toml": "is not valid TOML", "levels.toml": "missing 'level'",
             "binary.toml": "is not UTF-8 text"}
    for file, message in cases.items():
        with pytest.raises(NapkinError, match=message):
            load_hardware(str(tmp_path / file))
    with pytest.raises(NapkinError, match="got int 7"):
        load_hardware(7)


def test_long_hardware_name_cli(tmp_path, capsys):
    path = write(tmp_path, ELEMENTWISE)
    for command in ("cost", "pseudo", "tune", "report", "run"):
        err = cli_fails(capsys, command, path, "--hardware", LONG_NAME, "--set", "i=64")
        assert "unknown hardware 'aaaa" in err and "(300 characters)" in err, command
    err = cli_fails(capsys, "cost", path, "--hardware", LONG_NAME + ".toml")
    assert "cannot be a file" in err


def test_long_hardware_name_in_a_relabel_block(tmp_path, capsys):
    path = write(tmp_path, ELEMENTWISE + f"\nrelabel k on {LONG_NAME}:\n    smem: group i 4\n")
    err = cli_fails(capsys, "check", path)
    assert f"{path}:4:14: error: unknown hardware 'aaaa" in err


# ---- 10: keywords glued to names ------------------------------------------------------------


RELABELLED = "kernel foo(X: f32[i j]) -> Y: f32[i j]:\n    Y[i j] = X * 2\n\nrelabel foo on H100:\n"


@pytest.mark.parametrize("source, line, column, word, name", [
    ("kernelfoo(X: f32[i]) -> Y: f32[i]:\n    Y[i] = X * 2\n", 1, 1, "kernel", "foo"),
    ("boxF(f32[x]) -> f32[y]\n", 1, 1, "box", "F"),
    ("relabelfoo on H100:\n    smem: group i 4\n", 1, 1, "relabel", "foo"),
    (RELABELLED + "    smem forY: groupi 4; streamj 4\n", 5, 10, "for", "Y"),
    (RELABELLED + "    smem for Y: groupi 4\n", 5, 17, "group", "i"),
    (RELABELLED + "    smem: group i 4; streamj 4\n", 5, 22, "stream", "j"),
    ("kernel foo(X: f32[i]) -> Y: f32[i]:\n    Y[i] = X * 2\n\nrelabel foo onH100:\n    smem: group i 4\n", 4, 13, "on", "H100"),
    # After a kernel, `kernelbar` first reads as a statement's target; the line still says what it is.
    ("kernel foo(X: f32[i]) -> Y: f32[i]:\n    Y[i] = X * 2\nkernelbar(X: f32[i]) -> Y: f32[i]:\n    Y[i] = X\n", 3, 1, "kernel", "bar"),
    ("kernel foo(X: f32[i]) -> Y: f32[i]:\n    Y[i] = X * 2\n\nrelabelfoo on H100:\n    smem: group i 4\n", 4, 1, "relabel", "foo"),
])
def test_keyword_glued_to_a_name_is_a_syntax_error(source, line, column, word, name):
    with pytest.raises(NapkinSyntaxError) as info:
        napkin.load(source)
    error = info.value
    assert error.message == f"missing space after the keyword '{word}' in '{word}{name}'"
    assert (error.span.line, error.span.column) == (line, column)
    assert error.span.end_column == column + len(word + name)  # the caret runs under the glued word
    assert error.hint.startswith(f"write '{word} {name}'")


def test_keyword_glued_to_a_name_cli(tmp_path, capsys):
    path = write(tmp_path, RELABELLED + "    smem forY: groupi 4; streamj 4\n")
    err = cli_fails(capsys, "check", path)
    assert f"{path}:5:10: syntax error: missing space after the keyword 'for' in 'forY'" in err
    path = write(tmp_path, "kernelfoo(X: f32[i]) -> Y: f32[i]:\n    Y[i] = X * 2\n")
    err = cli_fails(capsys, "check", path)
    assert f"{path}:1:1: syntax error: missing space after the keyword 'kernel' in 'kernelfoo'" in err


def test_glued_keyword_in_a_docstring_body():
    from napkin_dsl.syntax import parse

    with pytest.raises(NapkinSyntaxError, match="missing space after the keyword 'for' in 'forY'"):
        parse("Y[i] = X * 2\nrelabel on H100:\n    smem forY: group i 4\n", start="body")


def test_names_that_begin_with_a_keyword_are_names():
    # A keyword needs a word boundary, in both directions: these are all ordinary names.
    source = ("box boxed(f32[onset]) -> f32[forward]\n"
              "kernel kernelize(groups: f32[onset streams], fora: f32) -> relabelled: f32[streams forward]:\n"
              "    boxes[streams forward] = boxed(groups)\n"
              "    relabelled[streams forward] = boxes * fora\n\n"
              "relabel kernelize on H100:\n"
              "    smem for relabelled: group streams 4\n")
    kernel = napkin.load(source)["kernelize"]
    assert kernel.diagram.params == ("groups", "fora")
    assert [s.target for s in kernel.diagram.statements] == ["boxes", "relabelled"]
    assert kernel.relabel.levels[0].partitions[0].targets == ("relabelled",)


# ---- 9: absurd sizes ------------------------------------------------------------------------


HUGE = 10**400  # overflowed float64 in the cost table, the time prediction and the L2 grouping


@pytest.mark.parametrize("call", [
    lambda k: k.cost("H100", i=HUGE),
    lambda k: k.cost("two_level", i=HUGE),
    lambda k: k.pseudocode("text", "H100", i=HUGE),
    lambda k: k.tune("H100", i=HUGE),
    lambda k: k.gpu_program("H100", i=HUGE),
], ids=["cost", "cost-abstract", "pseudocode", "tune", "gpu_program"])
def test_a_size_past_the_bound_is_refused_through_the_api(call):
    kernel = napkin.load(ELEMENTWISE)["k"]
    with pytest.raises(NapkinTypeError) as info:
        call(kernel)
    assert info.value.message == "size i = 1.00e+400 is larger than napkin takes: at most 2^63 - 1 (about 9.2e18, the int64 index space)"


def test_the_bound_itself_is_taken():
    kernel = napkin.load(ELEMENTWISE)["k"]
    assert "i=9223372036854775807" in kernel.cost("two_level", i=2**63 - 1).table()
    assert kernel.tune("H100", i=2**63 - 1).best.time_s > 0
    with pytest.raises(NapkinTypeError, match="size i = 9.22e[+]18 is larger"):
        kernel.cost("two_level", i=2**63)


def test_an_iteration_space_past_the_bound_names_its_statements():
    from .conftest import EXAMPLES

    kernel = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    with pytest.raises(NapkinError) as info:
        kernel.cost("H100", b=2**13, h=2**13, q=2**13, x=2**13, d=2**13)  # each size fine, their product 2^65 not
    text = info.value.render()
    assert "statement S iterates over b=8,192 * h=8,192 * q=8,192 * x=8,192 * d=8,192 = 3.69e+19 elements" in text
    assert "statement O iterates over" in text and "attention.napkin:4:5" in text


def test_a_partition_size_past_the_bound_is_a_checker_error():
    source = "kernel k(X: f32[i j]) -> Y: f32[i j]:\n    Y[i j] = X * 2\n\nrelabel k on H100:\n    smem: group i 4, j %d\n"
    with pytest.raises(NapkinTypeError) as info:
        napkin.load(source % HUGE)
    assert info.value.message.startswith("group size of j = 1.00e+400 is larger than napkin takes")
    assert (info.value.span.line, info.value.span.column) == (5, 22)
    # Each within the bound, but their tiles' product past it (the axes are unbound, so tiles keep them):
    kernel = napkin.load(source % 2**62)["k"]
    with pytest.raises(NapkinTypeError, match=r"statement Y iterates over i=4 \* j=4.61e\+18 = 1.84e\+19 elements"):
        kernel.cost("H100")
    # Bound axes clip their tiles: one masked group of 64, whatever the partition size.
    assert "1 group of 64" in kernel.pseudocode("text", "H100", i=64, j=64)
    assert kernel.cost("H100", i=64, j=64).table()


def test_a_symbolic_partition_size_bound_past_the_bound_is_refused():
    source = "kernel k(X: f32[i]) -> Y: f32[i]:\n    Y[i] = X * 2\n\nrelabel k on H100:\n    smem: group i g\n"
    with pytest.raises(NapkinTypeError) as info:
        napkin.load(source)["k"].cost(i=64, g=HUGE)
    assert info.value.message.startswith("size g = 1.00e+400 is larger")  # one error, not one per mention


@pytest.mark.parametrize("command", [["cost"], ["cost", "--json"], ["pseudo"], ["tune"], ["tune", "--json"], ["report"],
                                     ["run"], ["cuda"], ["draw", "--costs"]], ids=" ".join)
@pytest.mark.parametrize("value, message", [
    (str(HUGE), "--set i: a 401-digit size is larger than napkin takes"),
    ("1" + "0" * 5000, "--set i: a 5,001-digit size is larger than napkin takes"),  # past Python's int() digit limit
    (str(2**64), "size --set i = 1.84e+19 is larger than napkin takes"),
], ids=["400-digits", "5000-digits", "2^64"])
def test_a_size_past_the_bound_cli(tmp_path, capsys, command, value, message):
    path = write(tmp_path, ELEMENTWISE)
    err = cli_fails(capsys, command[0], path, *command[1:], "--hardware", "H100", "--set", f"i={value}")
    assert message in err
    assert len(err) < 1000  # the number is not echoed in full


def test_a_huge_iteration_space_cli(tmp_path, capsys):
    from .conftest import EXAMPLES

    err = cli_fails(capsys, "cost", str(EXAMPLES / "attention.napkin"), "--set", "b=8192", "h=8192", "q=8192", "x=8192", "d=8192")
    assert "attention.napkin:4:5: error: statement S iterates over" in err


def test_formatters_survive_numbers_past_float64():
    # Sizes are refused long before counts get this large; these guards keep a table or an
    # error message printable should a count ever get there another way.
    from napkin_dsl.binding import format_gib as _gib
    from napkin_dsl.cli import json_value
    from napkin_dsl.cost import _fmt

    assert _fmt(HUGE) == "1.000e+400"
    assert _fmt(sympy.Integer(HUGE) / 3) == "3.333e+399"
    assert _gib(HUGE).lower() == "9.31e+390 gib"
    assert json_value(2**1000) == 2**1000
    with pytest.raises(NapkinError, match="too large to print"):
        json_value(10**5000)
