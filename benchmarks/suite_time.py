"""Benchmark: where the test suite's time goes, by file and by kind of work (issue 41).

Runs pytest (any arguments after ``--`` go to it; by default the README's whole suite) with a
small plugin that times, inside every test and its fixtures, each kind of work the suite pays
for, and prints two tables: seconds by test file and seconds by kind.

    python benchmarks/suite_time.py                          # the README's suite, in parallel
    python benchmarks/suite_time.py --json times.json -- tests/test_split_tensorcore.py -n 0
    python benchmarks/suite_time.py --from times.json        # print a saved run again

The kinds (exclusive: time inside an inner kind is not counted again in the outer one):

- ``nvrtc``: uncached NVRTC compiles (``nvrtc.run_nvrtc``); a cache hit costs nothing here;
- ``pocl build``: OpenCL program builds (``pyopencl.Program.build``) on PoCL;
- ``pocl run``: the rest of ``opencl.run``: buffers, launches, waiting for PoCL's work-items.
  PoCL compiles a kernel's work-group function at its first launch, not in ``Program.build``,
  so that compile (LLVM's optimizer over an emulated tensor-core kernel: the bulk of PoCL's
  time) is counted here;
- ``oclgrind``: subprocesses run under oclgrind;
- ``nvdisasm``: subprocesses of nvdisasm (SASS);
- ``docs build``: ``mkdocs build``, in process or as a subprocess;
- ``browser``: selenium's WebDriver calls (Chromium);
- ``subprocess``: any other subprocess (the ``napkin`` CLI, example scripts);
- ``hypothesis``: the remaining time of a test that hypothesis drives;
- ``python``: everything else: the front end, the model, the tuner, the NumPy backend.

Seconds are summed over tests, so with ``-n 2`` they add up to about twice the wall time; the
wall time of the whole run is printed under the tables. It is not part of CI (``benchmarks/`` is
not in pytest's testpaths); the plugin changes no result, only adds timers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("nvrtc", "pocl build", "pocl run", "oclgrind", "nvdisasm", "docs build", "browser", "subprocess", "hypothesis", "python")

# ---- the plugin (runs in every pytest process, xdist workers included) ------------------------

_stack: list[list] = []  # [kind, started, inner seconds] frames of the running test
_seconds: dict[str, float] = defaultdict(float)


class _Timed:
    """Counts the time of the block as ``kind``, less the time of inner timed blocks."""

    def __init__(self, kind: str):
        self.kind = kind

    def __enter__(self):
        _stack.append([self.kind, time.perf_counter(), 0.0])

    def __exit__(self, *exc):
        kind, started, inner = _stack.pop()
        spent = time.perf_counter() - started
        _seconds[kind] += spent - inner
        if _stack:
            _stack[-1][2] += spent


def _wrap(owner, name: str, kind_of):
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        kind = kind_of(*args, **kwargs)
        if kind is None:
            return original(*args, **kwargs)
        with _Timed(kind):
            return original(*args, **kwargs)

    timed.__wrapped__ = original
    setattr(owner, name, timed)


def _subprocess_kind(args, *rest, **kwargs) -> str:
    argv = args.get("args") if isinstance(args, dict) else args
    words = [str(word) for word in argv] if isinstance(argv, (list, tuple)) else str(argv).split()
    head = " ".join(Path(word).name for word in words[:3])
    for tool, kind in (("oclgrind", "oclgrind"), ("nvdisasm", "nvdisasm"), ("mkdocs", "docs build")):
        if tool in head:
            return kind
    return "subprocess"


def _install_timers() -> None:
    _wrap(subprocess, "run", _subprocess_kind)
    _wrap(subprocess, "check_output", _subprocess_kind)
    from napkin_dsl.backends import nvrtc, opencl

    _wrap(nvrtc, "run_nvrtc", lambda *a, **k: "nvrtc")
    _wrap(opencl, "run", lambda *a, **k: "pocl run")
    try:
        import pyopencl
    except ImportError:
        pass
    else:
        _wrap(pyopencl.Program, "build", lambda *a, **k: "pocl build")
    try:
        import mkdocs.commands.build as mkdocs_build
    except ImportError:
        pass
    else:
        _wrap(mkdocs_build, "build", lambda *a, **k: "docs build")
    try:
        from selenium.webdriver.remote.webdriver import WebDriver
    except ImportError:
        pass
    else:
        _wrap(WebDriver, "execute", lambda *a, **k: "browser")


def pytest_configure(config):
    _install_timers()


def _is_hypothesis(item) -> bool:
    function = getattr(item, "obj", None)
    return bool(getattr(function, "is_hypothesis_test", False))


def pytest_runtest_protocol(item, nextitem):
    _seconds.clear()
    _stack.clear()
    _stack.append(["hypothesis" if _is_hypothesis(item) else "python", time.perf_counter(), 0.0])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # attach the kinds measured to the teardown report, the last of a test's three, before any
    # plugin logs it; under xdist the report carries them to the controller (``_Collector``)
    outcome = yield
    if call.when == "teardown" and _stack:
        kind, started, inner = _stack[0]
        _seconds[kind] += time.perf_counter() - started - inner
        _stack.clear()
        outcome.get_result().user_properties.append(("suite_time", dict(_seconds)))


class _Collector:
    def __init__(self, path: str):
        self.path = path
        self.by_test: dict[str, dict] = {}
        self.started = time.perf_counter()

    def pytest_runtest_logreport(self, report):
        for key, value in report.user_properties:
            if key == "suite_time":
                self.by_test[report.nodeid] = value

    def pytest_sessionfinish(self, session):
        data = {"wall": time.perf_counter() - self.started, "tests": self.by_test}
        Path(self.path).write_text(json.dumps(data, indent=1))


def pytest_addoption(parser):
    parser.addoption("--suite-time-json", default=None, help="write each test's seconds by kind to this file")


def pytest_sessionstart(session):
    path = session.config.getoption("--suite-time-json")
    worker = hasattr(session.config, "workerinput")
    if path and not worker:
        session.config.pluginmanager.register(_Collector(path), "suite_time_collector")


# ---- the report ---------------------------------------------------------------------------------


def tables(data: dict, top: int = 25) -> str:
    by_file: dict[str, float] = defaultdict(float)
    by_kind: dict[str, float] = defaultdict(float)
    file_kind: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for nodeid, kinds in data["tests"].items():
        path = nodeid.split("::")[0]
        for kind, seconds in kinds.items():
            by_file[path] += seconds
            by_kind[kind] += seconds
            file_kind[path][kind] += seconds
    total = sum(by_kind.values())
    lines = ["| file | seconds | share | largest kind |", "|---|---|---|---|"]
    for path, seconds in sorted(by_file.items(), key=lambda item: -item[1])[:top]:
        kind, most = max(file_kind[path].items(), key=lambda item: item[1])
        lines.append(f"| {path} | {seconds:.1f} | {seconds / total:.1%} | {kind} {most:.1f} |")
    lines += ["", "| kind | seconds | share |", "|---|---|---|"]
    for kind in KINDS:
        if by_kind.get(kind):
            lines.append(f"| {kind} | {by_kind[kind]:.1f} | {by_kind[kind] / total:.1%} |")
    lines += ["", f"{len(data['tests'])} tests, {total:.1f} s of test time, {data['wall']:.1f} s of wall time"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else ["-q", "-n", "auto"]  # the README's command
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="keep the per-test seconds by kind in this file")
    parser.add_argument("--from", dest="saved", default=None, help="print the tables of a saved run; run nothing")
    parser.add_argument("--top", type=int, default=25, help="rows of the by-file table")
    options = parser.parse_args(argv)
    if options.saved:
        print(tables(json.loads(Path(options.saved).read_text()), options.top))
        return 0
    path = options.json or str(Path(os.environ.get("TMPDIR", "/tmp")) / f"suite_time_{os.getpid()}.json")
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")])))
    environment.setdefault("NAPKIN_REQUIRE_OPENCL", "1")  # as the README's command: a missing runtime fails, not skips
    code = subprocess.call([sys.executable, "-m", "pytest", "-p", "suite_time", f"--suite-time-json={path}", *pytest_args],
                           cwd=ROOT, env=environment)
    if Path(path).exists():
        print(tables(json.loads(Path(path).read_text()), options.top))
    return code


if __name__ == "__main__":
    sys.exit(main())
