"""Progress on stderr: drawn on a terminal for tasks past the delay, silent otherwise and with --json."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time

import pytest

from napkin_dsl import progress as progress_module
from napkin_dsl.cli import main
from napkin_dsl.progress import Progress, wanted

from .conftest import EXAMPLES, ROOT

pytest.importorskip("tqdm", reason="tqdm draws the progress line")


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_wanted_only_on_a_terminal_and_never_for_json(monkeypatch):
    monkeypatch.delenv("NAPKIN_PROGRESS", raising=False)
    assert wanted(stream=Terminal())
    assert not wanted(stream=io.StringIO())
    assert not wanted(json_output=True, stream=Terminal())
    monkeypatch.setenv("NAPKIN_PROGRESS", "0")
    assert not wanted(stream=Terminal())


def test_a_task_shows_its_elapsed_time_then_its_bar_and_erases_the_line():
    stream = Terminal()
    with Progress("tune attention", enabled=True, stream=stream, delay_s=0.0) as progress:
        time.sleep(0.2)
        assert "tune attention: 00:00" in stream.getvalue()
        progress(3, 10)
        assert "3/10" in stream.getvalue() and "30%" in stream.getvalue()
    assert stream.getvalue().endswith("\r") or stream.getvalue().endswith("\x1b[A")  # erased: leave=False


def test_quick_tasks_and_disabled_progress_draw_nothing():
    stream = Terminal()
    with Progress("run softmax", enabled=True, stream=stream, delay_s=5.0) as progress:
        progress(1, 2)
    assert stream.getvalue() == ""
    with Progress("run softmax", enabled=False, stream=stream, delay_s=0.0) as progress:
        progress(1, 2)
        time.sleep(0.1)
    assert stream.getvalue() == ""


@pytest.mark.parametrize("json_flag", [False, True])
def test_commands_draw_on_a_terminal_stderr_unless_json(monkeypatch, json_flag):
    monkeypatch.delenv("NAPKIN_PROGRESS", raising=False)
    monkeypatch.setattr(progress_module, "DELAY_S", 0.0)
    err, out = Terminal(), io.StringIO()
    argv = ["run", str(EXAMPLES / "softmax.napkin"), "--set", "r=64", "c=64"] + (["--json"] if json_flag else [])
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        assert main(argv) == 0
    assert ("run softmax_rows on numpy:" in err.getvalue()) is not json_flag
    assert "run softmax_rows on numpy:" not in out.getvalue()


def test_a_real_terminal_sees_progress_and_a_pipe_does_not():
    """The napkin command itself, its stderr a pseudo-terminal, then a pipe."""
    script = ("import napkin_dsl.progress as p, sys; p.DELAY_S = 0.0\n"
              "from napkin_dsl.cli import main\n"
              f"sys.exit(main(['run', {str(EXAMPLES / 'softmax.napkin')!r}, '--set', 'r=64', 'c=64']))\n")
    env = {**os.environ, "NAPKIN_PROGRESS": "1"}
    try:
        leader, follower = pty.openpty()
    except OSError as error:  # a sandbox without /dev/pts
        pytest.skip(f"no pseudo-terminal here: {error}")
    # A terminal 100 columns wide (a fresh pseudo-terminal has 0, and tqdm would fit its line into that).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with os.fdopen(leader, "rb", buffering=0) as terminal:
        done = subprocess.run([sys.executable, "-c", script], check=False, stdout=subprocess.PIPE, stderr=follower, env=env, cwd=ROOT, timeout=300)
        os.close(follower)
        drawn = b""
        with contextlib.suppress(OSError):  # EIO once the child's side is closed and read out
            while chunk := terminal.read(4096):
                drawn += chunk
    assert done.returncode == 0 and b"run softmax_rows on numpy" in done.stdout
    assert b"run softmax_rows on numpy:" in drawn
    piped = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, env=env, cwd=ROOT, timeout=300)
    assert piped.returncode == 0 and b"run softmax_rows on numpy:" not in piped.stderr


def test_tune_draws_a_bar_over_the_fusion_choices(monkeypatch):
    monkeypatch.delenv("NAPKIN_PROGRESS", raising=False)
    monkeypatch.setattr(progress_module, "DELAY_S", 0.0)
    err, out = Terminal(), io.StringIO()
    argv = ["tune", str(EXAMPLES / "mlp.napkin"), "--top", "1", "--set", "b=256", "k=256", "n=256"]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        assert main(argv) == 0
    drawn = err.getvalue()
    assert "tune mlp:" in drawn
    # The tuner said how many fusion choices it weighs, and the bar counted up to all of them.
    counts = re.findall(r"(\d+)/(\d+)", drawn)
    assert counts and counts[-1][0] == counts[-1][1]
