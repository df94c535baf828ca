"""Every ``napkin`` command on every example, and on Python files of ``@napkin.kernel`` functions.

A command ends with exit 0 (done) or 2 (a napkin error, said clearly), never a traceback. The
commands run in-process through ``cli.main``: an exception escaping it is the traceback a user
would see, and fails the test with it.
"""

from __future__ import annotations

import contextlib
import io
import textwrap

import pytest

import napkin_dsl as napkin
from napkin_dsl.cli import load_file, main

from .conftest import EXAMPLES

COMMANDS = ["check", "pseudo", "cost", "tune", "report", "run", "cuda", "draw"]
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.napkin")) + sorted(EXAMPLES.glob("*.py"))
# Small sizes keep the NumPy runs and the tuner quick; a tile larger than an axis is masked.
SMALL = 48


def napkin_cli(*argv: str) -> tuple[int, str]:
    """Run one command; its exit code and everything it printed (stdout and stderr)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main([str(a) for a in argv])
    return code, out.getvalue()


def small_sizes(file) -> list[str]:
    """--set NAME=48 for every axis of every kernel in the file."""
    axes = {axis for kernel in load_file(file).values() for axis in kernel.diagram.axes}
    return [f"{axis}={SMALL}" for axis in sorted(axes)]


def arguments(command: str, file, with_sizes: bool) -> list[str]:
    # With sizes, --set comes before FILE: the order the usage line shows, which --set (it takes
    # several values) once swallowed FILE in.
    argv = [command, "--set", *small_sizes(file), file] if with_sizes else [command, file]
    if with_sizes and command == "draw":
        argv.append("--costs")  # draw reads sizes only for its cost rows
    if command == "draw" and len(load_file(file)) > 1:
        argv += ["--kernel", next(iter(load_file(file)))]
    if command == "cuda":
        argv.append("--resources")  # the source itself is long; the resources show it compiled
    return argv


# check takes no sizes: it runs with its defaults only.
RUNS = [(command, with_sizes) for command in COMMANDS for with_sizes in (False, True) if command != "check" or not with_sizes]


@pytest.mark.parametrize("command, with_sizes", RUNS, ids=[f"{c}-{'set' if s else 'defaults'}" for c, s in RUNS])
@pytest.mark.parametrize("file", EXAMPLE_FILES, ids=lambda p: p.name)
def test_every_command_on_every_example_ends_cleanly(file, command, with_sizes):
    argv = arguments(command, file, with_sizes)
    code, output = napkin_cli(*argv)
    assert "Traceback" not in output
    assert code in (0, 2), output[-2000:]
    if code == 2:
        # A refusal is one napkin error with a hint, not a crash.
        assert "error:" in output and "hint:" in output, output[-2000:]


# ---- Python files ---------------------------------------------------------------------------------

TWO_KERNELS = '''\
"""Two decorated kernels, as a user's model file would hold them."""
import napkin_dsl as napkin


@napkin.kernel(hardware="H100", relabel="smem: group b 1, kv 1, r 1, q 64; stream x 64")
def gqa(Q: napkin.bf16["b kv r q d"], K: napkin.bf16["b kv x d"], V: napkin.bf16["b kv x d"]) -> napkin.bf16["b kv r q d"]:
    """
    S[b kv r q x] = Q * K * d^-0.5
    P[b kv r q x] = softmax[x](S)
    O[b kv r q d] = P * V
    """


@napkin.kernel
def scale(X: napkin.f32["n"]) -> napkin.f32["n"]:
    """Y[n] = X * 2"""


if __name__ == "__main__":
    raise SystemExit("the script part does not run on import")
'''


@pytest.fixture
def gqa_py(tmp_path):
    path = tmp_path / "gqa.py"
    path.write_text(TWO_KERNELS)
    return path


def test_load_file_collects_the_decorated_kernels(gqa_py):
    kernels = load_file(gqa_py)
    assert list(kernels) == ["gqa", "scale"]
    assert all(isinstance(k, napkin.Kernel) for k in kernels.values())
    assert kernels["gqa"].relabel_text() == "on H100: smem: group b 1, kv 1, r 1, q 64; stream x 64"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_a_python_file(gqa_py, command):
    sizes = ["--set", "b=1", "kv=2", "r=2", "q=40", "x=70", "d=16"]
    argv = {
        "check": ["check", gqa_py],
        "pseudo": ["pseudo", gqa_py, "--kernel", "gqa", *sizes],
        "cost": ["cost", gqa_py, "--kernel", "gqa", *sizes],
        "tune": ["tune", gqa_py, "--kernel", "gqa", "--top", "2", *sizes],
        "report": ["report", gqa_py, "--kernel", "gqa", *sizes],
        "run": ["run", gqa_py, "--kernel", "gqa", *sizes],
        "cuda": ["cuda", gqa_py, "--kernel", "gqa", *sizes],
        "draw": ["draw", gqa_py, "--kernel", "gqa"],
    }[command]
    code, output = napkin_cli(*argv)
    assert code == 0, output[-2000:]
    expected = {
        "check": "kernel gqa(Q: bf16[b kv r q d]",
        "pseudo": "for",
        "cost": "predicted",
        "tune": "as a relabel block:",
        "report": "run gqa on numpy",
        "run": "run gqa on numpy",
        "cuda": '__global__',
        "draw": "<svg",
    }[command]
    assert expected in output, output[-2000:]
    if command == "check":
        assert "kernel scale(X: f32[n])" in output


def test_several_kernels_need_kernel_where_one_is_drawn_and_a_wrong_name_lists_them(gqa_py):
    code, output = napkin_cli("draw", gqa_py)
    assert code == 2 and "has 2 kernels; say which to draw" in output and "gqa, scale" in output
    code, output = napkin_cli("cost", gqa_py, "--kernel", "gqaa")
    assert code == 2 and "no kernel named 'gqaa'" in output and "kernels there: gqa, scale" in output


@pytest.mark.parametrize(("source", "message", "line"), [
    ("import napkin_dsl as napkin\nx = 1\ny = x / 0\n", "cannot import {path}: ZeroDivisionError: division by zero", 3),
    ("import napkin_dsl as napkin\nimport not_a_module_napkin_knows\n", "ModuleNotFoundError: No module named 'not_a_module_napkin_knows'", 2),
    ("def broken(:\n    pass\n", "cannot import {path}: SyntaxError", 1),
])
def test_an_import_that_fails_is_one_clear_error_at_its_line(tmp_path, source, message, line):
    path = tmp_path / "model.py"
    path.write_text(source)
    for command in ("check", "cost", "draw"):
        code, output = napkin_cli(command, path)
        assert code == 2 and "Traceback" not in output
        assert message.format(path=path) in output
        assert f"{path}:{line}:" in output
        assert "hint: napkin imports the file" in output


def test_a_file_without_kernels_or_that_exits(tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("import napkin_dsl as napkin\nX = 1\n")
    code, output = napkin_cli("cost", empty)
    assert code == 2 and f"{empty} defines no napkin kernel" in output and "@napkin.kernel" in output
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(3)\n")
    code, output = napkin_cli("pseudo", exits)
    assert code == 2 and "called sys.exit(3) while being imported" in output


def test_a_kernel_that_does_not_check_points_into_the_python_file(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(textwrap.dedent('''\
        import napkin_dsl as napkin


        @napkin.kernel
        def bad(X: napkin.f32["n"]) -> napkin.f32["n"]:
            """Y[n] = X * Z"""
        '''))
    code, output = napkin_cli("check", path)
    assert code == 2 and "Traceback" not in output
    assert f"{path}:6:" in output and "Z" in output


def test_importing_leaves_sys_modules_and_sys_path_as_they_were(gqa_py):
    import sys

    modules, path = set(sys.modules), list(sys.path)
    load_file(gqa_py)
    assert set(sys.modules) - modules <= {m for m in sys.modules if not m.startswith("_napkin_file_")}
    assert not any(m.startswith("_napkin_file_") for m in sys.modules)
    assert sys.path == path


def test_a_module_that_edits_sys_path_still_loads(tmp_path):
    path = tmp_path / "pathy.py"
    path.write_text(TWO_KERNELS.replace("import napkin_dsl as napkin\n",
                                        "import sys\nimport napkin_dsl as napkin\nsys.path[:] = [p for p in sys.path if p != "
                                        f"{str(tmp_path)!r}]\n", 1))
    assert list(load_file(path)) == ["gqa", "scale"]
