"""Bad input: empty, binary, huge, deeply nested, odd encodings and line ends, wrong paths.

Each input goes through ``napkin.load`` and through the CLI (``napkin check``), which must
exit 2 with the message on stderr and never print a traceback. Inputs that are odd but valid
(unicode names, tabs, CRLF) must check cleanly through both.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

import napkin_dsl as napkin
from napkin_dsl.cli import main
from napkin_dsl.errors import NapkinError, NapkinErrors, NapkinSyntaxError
from napkin_dsl.syntax import MAX_SOURCE_CHARS

from .conftest import NAPKIN_EXAMPLES

VALID = "kernel k(A: f32[i j]) -> B: f32[i]:\n    B[i] = sum[j](A)\n"


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8", newline="")  # keep \r\n as written
    return path


def cli_fails(capsys, *args: str) -> str:
    """Run `napkin check ARGS`; it must exit 2 and explain on stderr without a traceback."""
    code = main(["check", *args])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err.strip(), "the message goes to stderr"
    assert "Traceback" not in out + err
    return err


def cli_passes(capsys, *args: str) -> str:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Traceback" not in out + err
    return out


def load_fails(source, cls=NapkinError) -> NapkinError:
    with pytest.raises(cls) as info:
        napkin.load(source)
    assert "Traceback" not in info.value.render()
    return info.value


# ---- empty and non-text files ---------------------------------------------------------------


@pytest.mark.parametrize("content", ["", "\n\n", "   \n\t\n", "# only a comment\n  # and another\n"], ids=["empty", "newlines", "whitespace", "comments"])
def test_file_without_kernels(tmp_path, capsys, content):
    path = write(tmp_path, "empty.napkin", content)
    error = load_fails(path)
    assert "defines no kernel" in error.message and error.span.file == str(path)
    assert "kernel NAME(" in error.hint
    err = cli_fails(capsys, str(path))
    assert f"{path}:1:1: error: this file defines no kernel" in err


def test_text_without_kernels():
    assert "defines no kernel" in load_fails("").message
    assert "defines no kernel" in load_fails("# nothing here\n").message


def test_binary_junk_with_nul(tmp_path, capsys):
    rng = random.Random(1)
    junk = bytes(rng.randrange(256) for _ in range(4096)) + b"\x00\x00"
    path = write(tmp_path, "junk.napkin", junk)
    error = load_fails(path, NapkinSyntaxError)
    assert "not UTF-8 text" in error.message
    assert "not UTF-8 text" in cli_fails(capsys, str(path))


def test_utf8_text_with_nul(tmp_path, capsys):
    path = write(tmp_path, "nul.napkin", b"kernel k(A: f32[i]) -> B: f32[i]:\n    B[i] = A\x00\n")
    error = load_fails(path, NapkinSyntaxError)
    assert "NUL bytes" in error.message and str(path) in error.message
    assert "NUL bytes" in cli_fails(capsys, str(path))


def test_control_characters(tmp_path, capsys):
    path = write(tmp_path, "ctl.napkin", "kernel k(A: f32[i]) -> B: f32[i]:\n    B[i] = A\x01\n")
    error = load_fails(path, NapkinSyntaxError)
    assert "unexpected character '\\x01'" in error.message
    assert (error.span.line, error.span.column) == (2, 13)
    cli_fails(capsys, str(path))


def test_not_utf8(tmp_path, capsys):
    path = write(tmp_path, "latin1.napkin", "kernel k(A: f32[i]) -> B: f32[i]:\n    B[i] = A  # café\n".encode("latin-1"))
    error = load_fails(path, NapkinSyntaxError)
    assert "not UTF-8 text (byte 53 is 0xe9)" in error.message
    assert (error.span.file, error.span.line, error.span.column) == (str(path), 2, 20)
    assert f"{path}:2:20: syntax error: not UTF-8 text" in cli_fails(capsys, str(path))


# ---- size and depth -------------------------------------------------------------------------


def many_statements(chars: int) -> str:
    """A valid kernel of about ``chars`` characters: one statement per line."""
    header = "kernel k(A: f32[i j]) -> B: f32[i j]:\n"
    lines, size, n = [], len(header), 0
    while size < chars:
        line = f"    T{n}[i j] = A[i j] * 2\n"
        lines.append(line)
        size += len(line)
        n += 1
    return header + "".join(lines) + "    B[i j] = A[i j]\n"


def test_one_megabyte_is_refused_quickly(tmp_path, capsys):
    text = many_statements(1_000_000)
    path = write(tmp_path, "big.napkin", text)
    for source in (text, path):
        start = time.perf_counter()
        error = load_fails(source, NapkinSyntaxError)
        assert time.perf_counter() - start < 1.0, "refused before parsing"
        assert f"{MAX_SOURCE_CHARS:,}" in error.message and "is this the right file?" in error.hint
    assert "1,000,0" in str(load_fails(text).message)  # the text's own size, in characters
    err = cli_fails(capsys, str(path))
    assert f"at most {MAX_SOURCE_CHARS:,} characters" in err


def test_three_megabytes_is_refused(tmp_path, capsys):
    path = write(tmp_path, "huge.napkin", many_statements(3_000_000))
    error = load_fails(path, NapkinSyntaxError)
    assert "bytes" in error.message and f"{MAX_SOURCE_CHARS:,}" in error.message
    cli_fails(capsys, str(path))


def test_largest_accepted_file_parses_in_seconds(tmp_path, capsys):
    """A file just under the limit checks; measured at 1.5-2.5 s per 100 KB on a slow CI CPU."""
    text = many_statements(MAX_SOURCE_CHARS - 100)
    assert len(text) <= MAX_SOURCE_CHARS
    napkin.load("kernel warm(A: f32[i]) -> B: f32[i]:\n    B[i] = A\n")  # build the parser first
    start = time.perf_counter()
    kernels = napkin.load(text)
    seconds = time.perf_counter() - start
    assert len(kernels["k"].diagram.statements) > 3000
    assert seconds < 15, f"{len(text):,} characters took {seconds:.1f} s"


def test_deep_parentheses(tmp_path, capsys):
    source = "kernel k(A: f32[i]) -> B: f32[i]:\n    B[i] = " + "(" * 200 + "A" + ")" * 200 + "\n"
    error = load_fails(source, NapkinSyntaxError)  # not a RecursionError
    assert "nested more than 64 levels deep" in error.message
    assert (error.span.line, error.span.column) == (2, 76)
    path = write(tmp_path, "deep.napkin", source)
    assert "nested more than 64 levels deep" in cli_fails(capsys, str(path))


def test_parentheses_at_the_limit_are_fine():
    source = "kernel k(A: f32[i]) -> B: f32[i]:\n    B[i] = " + "(" * 60 + "A" + ")" * 60 + "\n"
    assert napkin.load(source)["k"].diagram.statements[0].target == "B"


@pytest.mark.parametrize("expression", ["A" + " + A" * 1000, "-" * 1000 + "A", "A" + "^2" * 1000, "exp(" * 60 + "A" + ")" * 60 + " * 2" * 500])
def test_long_operator_chains(expression):
    source = "kernel k(A: f32[i]) -> B: f32[i]:\n    B[i] = " + expression + "\n"
    error = load_fails(source, NapkinSyntaxError)
    assert "operations deep" in error.message and error.span.line == 2


def test_long_chain_below_the_limit():
    source = "kernel k(A: f32[i]) -> B: f32[i]:\n    B[i] = A" + " + A" * 150 + "\n"
    assert len(napkin.load(source)["k"].diagram.statements) == 1


def test_stray_closing_parentheses_do_not_hide_nesting():
    """Unmatched ')' must not let a later nest go deeper than the limit unnoticed."""
    source = "kernel k(A: f32[i]) -> B: f32[i]:\n    B[i] = " + ")" * 100 + "(" * 100 + "A\n"
    error = load_fails(source, NapkinSyntaxError)
    assert "nested more than 64" in error.message
    assert (error.span.line, error.span.column) == (2, 11 + 100 + 65)


# ---- odd but valid text ---------------------------------------------------------------------

UNICODE = """\
# Greek axes and arrays
kernel attention(Θ: bf16[β κ δ], Κ: bf16[β ξ δ], Φ: bf16[β ξ δ]) -> Ω: bf16[β κ δ]:
    Σ[β κ ξ] = Θ * Κ * δ^-0.5
    Π[β κ ξ] = softmax[ξ](Σ)
    Ω[β κ δ] = Π * Φ

relabel attention on H100:
    smem: group β 1, κ 128; stream ξ 64
"""


def test_unicode_identifiers(tmp_path, capsys):
    kernel = napkin.load(UNICODE)["attention"]
    assert list(kernel.diagram.axes) == ["β", "κ", "δ", "ξ"]
    assert kernel.diagram.statements[1].consumed == ("ξ",)
    path = write(tmp_path, "greek.napkin", UNICODE)
    out = cli_passes(capsys, str(path))
    assert "attention(Θ: bf16[β κ δ]" in out


def test_unicode_error_caret(tmp_path):
    error = load_fails("kernel k(Χ: f32[α β]) -> Υ: f32[α]:\n    Υ[α] = sum[γ](Χ)\n")
    assert "sum[γ] reduces axis 'γ'" in error.message and "[α β]" in error.message
    assert (error.span.line, error.span.column) == (2, 12)


def test_tabs_mixed_with_spaces(tmp_path, capsys):
    source = "kernel k(A: f32[i j])\t->  B: f32[i]:\n\tT[i j] = A * 2\n  \t  B[i] =\tsum[j](T)\t# tab before comment\n"
    assert [s.target for s in napkin.load(source)["k"].diagram.statements] == ["T", "B"]
    cli_passes(capsys, str(write(tmp_path, "tabs.napkin", source)))


def test_crlf_line_endings(tmp_path, capsys):
    source = VALID.replace("\n", "\r\n") + "\r\nrelabel k on H100:\r\n    smem: group i 128\r\n"
    assert napkin.load(source)["k"].relabel.hardware == "H100"
    cli_passes(capsys, str(write(tmp_path, "crlf.napkin", source)))


def test_crlf_error_position(tmp_path, capsys):
    source = "kernel k(A: f32[i j]) -> B: f32[i]:\r\n    B[i] = sum[z](A)\r\n"
    error = load_fails(source)
    assert (error.span.line, error.span.column) == (2, 12)
    assert "\r" not in error.render()
    assert "\r" not in cli_fails(capsys, str(write(tmp_path, "crlf_bad.napkin", source)))


def test_lone_cr_line_endings():
    assert napkin.load(VALID.replace("\n", "\r"))["k"].diagram.statements[0].target == "B"


def test_byte_order_mark(tmp_path, capsys):
    path = write(tmp_path, "bom.napkin", "\ufeff" + VALID)
    assert "k" in napkin.load(path)
    cli_passes(capsys, str(path))


@pytest.mark.parametrize("separator", ["\x0c", "\x0b", "\u2028", "\x85"], ids=["form-feed", "vtab", "line-sep", "nel"])
def test_unicode_line_separators_do_not_shift_lines(separator):
    """Only \\n ends a line for napkin; the caret's source line must be the error's line."""
    source = f"# a comment with a {separator} inside\nkernel k(A: f32[i]) -> B: f32[i]:\n    B[i] = Z\n"
    error = load_fails(source)
    assert error.span.line == 3
    assert error.span.source_line == "    B[i] = Z"


def test_no_trailing_newline():
    assert "k" in napkin.load(VALID.rstrip("\n"))


def test_kernel_with_no_statements(tmp_path, capsys):
    source = "kernel k(A: f32[i]) -> B: f32[i]:\n"
    error = load_fails(source)
    assert not isinstance(error, NapkinErrors), "one error, not one per output"
    assert "kernel 'k' has no statements" in error.message
    assert "kernel 'k' has no statements" in cli_fails(capsys, str(write(tmp_path, "nostmt.napkin", source)))


# ---- paths ----------------------------------------------------------------------------------


def test_missing_file(tmp_path, capsys):
    missing = tmp_path / "missing.napkin"
    for source in (missing, str(missing)):
        error = load_fails(source)
        assert f"no such file: {missing}" in error.message
    assert "no such file" in cli_fails(capsys, str(missing))


def test_missing_file_without_napkin_suffix(tmp_path):
    assert "no such file" in load_fails(str(tmp_path / "nothing" / "here.txt")).message


def test_directory(tmp_path, capsys):
    for source in (tmp_path, str(tmp_path)):
        error = load_fails(source)
        assert "is a directory, not a napkin file" in error.message
    assert "is a directory" in cli_fails(capsys, str(tmp_path))


@pytest.mark.skipif(not Path("/dev/null").exists(), reason="needs /dev/null")
def test_special_file(capsys):
    assert "not a regular file" in load_fails(Path("/dev/null")).message
    cli_fails(capsys, "/dev/null")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads everything")
def test_unreadable_file(tmp_path, capsys):
    path = write(tmp_path, "secret.napkin", VALID)
    path.chmod(0)
    assert "cannot read" in load_fails(path).message
    cli_fails(capsys, str(path))


def test_cli_reports_the_first_bad_file_among_good_ones(tmp_path, capsys):
    good = write(tmp_path, "good.napkin", VALID)
    bad = write(tmp_path, "bad.napkin", VALID.replace("sum[j]", "sum[z]"))
    err = cli_fails(capsys, str(good), str(bad))
    assert f"{bad}:2:12: error: sum[z]" in err


def test_cli_json_error(tmp_path, capsys):
    bad = write(tmp_path, "bad.napkin", VALID.replace("sum[j]", "sum[z]"))
    code = main(["check", "--json", str(bad)])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in out + err
    assert '"line": 2' in out and '"column": 12' in out


def test_console_script_on_a_bad_file(tmp_path):
    """The installed `napkin` command: exit 2, the error on stderr, no traceback."""
    script = Path(sys.executable).parent / "napkin"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "napkin_dsl.cli"]
    bad = write(tmp_path, "bad.napkin", "kernel k(A: f32[i]) -> B: f32[i]:\n    B[i] = (A\n")
    result = subprocess.run([*command, "check", str(bad)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert f"{bad}:2:14: syntax error: unbalanced parentheses" in result.stderr


# ---- mutation fuzzing -----------------------------------------------------------------------

ALPHABET = list("()[]:,;=+-*/^@#\\ \t\n\r0123456789.e_") + [
    "kernel", "box", "relabel", "on", "group", "stream", "softmax", "sum", "max", "exp", "f32", "bf16", "->",
    "x", "q", "S", "α", "\u2028", "\x0c", "1e999", "9" * 30, "@gmem", "d^-0.5",
]


def mutations(seed: int, count: int):
    rng = random.Random(seed)
    sources = [path.read_text() for path in NAPKIN_EXAMPLES]
    for _ in range(count):
        text = list(rng.choice(sources))
        for _ in range(rng.randint(1, 4)):
            position = rng.randrange(len(text) + 1)
            roll = rng.random()
            if roll < 0.4 and text:
                del text[min(position, len(text) - 1)]
            elif roll < 0.8:
                text.insert(position, rng.choice(ALPHABET))
            else:
                a, b = rng.randrange(len(text)), rng.randrange(len(text))
                text[a], text[b] = text[b], text[a]
        yield "".join(text)


@pytest.mark.parametrize("seed", range(4))
def test_mutated_examples_fail_cleanly(seed):
    """Random edits of the examples either check or raise a NapkinError with a place: nothing else."""
    for source in mutations(seed, 150):
        try:
            napkin.load(source)
        except NapkinError as error:
            rendered = error.render()
            assert rendered and "Traceback" not in rendered
            assert error.span is not None or "defines no kernel" in error.message, rendered


def test_file_named_like_a_keyword(tmp_path, monkeypatch):
    """A one-line string is a path when it names a .napkin file, even `kernel.napkin`."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "kernel.napkin", VALID)
    assert "k" in napkin.load("kernel.napkin")
    assert "no such file" in load_fails("relabel.napkin").message


def test_one_line_text_is_text():
    error = load_fails("kernel k(A: f32[i]) -> B: f32[i]: B[i] = A / 2")
    assert "statements go on their own lines" in error.message


def test_lark_visit_error_never_leaks(monkeypatch):
    """Should a transformer ever be added, its wrapped NapkinError surfaces, not lark's VisitError."""
    import lark

    from napkin_dsl import syntax

    inner = NapkinSyntaxError("from a transformer")

    class Failing:
        def parse(self, text):
            raise lark.exceptions.VisitError("rule", lark.Tree("rule", []), inner)

    monkeypatch.setattr(syntax, "_parser", lambda start: Failing())
    with pytest.raises(NapkinSyntaxError) as info:
        syntax.parse(VALID)
    assert info.value is inner
