"""Benchmark: mutation testing of the spine's core modules (issue 25).

Plants one small bug at a time (a mutant) in a copy of the repository, runs the tests that cover
the mutated module there, and counts a mutant killed when they fail. Survivors are listed with
file:line and the change, so that each can get a test, or a reason it is equivalent in
benchmarks/mutation.md. It is not part of CI (benchmarks/ is not in pytest's testpaths): a full
run of one module is hundreds of test runs.

The mutator is this file's own, over the AST, one change per mutant:

- arithmetic ``+ -`` swapped, ``* -> /``, ``/ -> *``, ``// -> /``, ``% -> //``, ``** -> *``, in
  expressions and in augmented assignments (``+=``);
- comparisons ``< <=``, ``> >=``, ``== !=``, ``in / not in``, ``is / is not`` flipped;
- an integer or float constant plus one, ``True`` and ``False`` swapped;
- ``and`` and ``or`` swapped, a ``not`` dropped, a unary minus dropped;
- ``return X`` as ``return None``.

Strings (the printers' text and every message), docstrings, annotations and ``assert`` statements
are not mutated: a changed string is a golden-file diff, and a changed assert only checks
napkin's own invariants. A line that ends in ``# no mutate`` is skipped.

Nothing is written in the checkout: the files are copied to a temporary directory (tracked and
untracked-but-not-ignored files of the working tree, or a commit with ``--rev``), the mutant is
written there, pytest runs there with the copy first on PYTHONPATH and its own NAPKIN_CACHE_DIR,
and the directory is removed at the end. The unmutated tests run first; the script stops if
they fail, and each mutant's run is cut off at ``--timeout`` (default: twice that run plus 10 s).

One module in a few minutes: sample 40 mutants (about 5 s each on one core for cost)::

    python benchmarks/mutation.py --module cost --sample 40 --seed 1

Other forms::

    python benchmarks/mutation.py --list-modules                  # modules and their tests
    python benchmarks/mutation.py --module relabel --list         # every mutant, numbered
    python benchmarks/mutation.py --module relabel --lines 200-260 --limit 20
    python benchmarks/mutation.py --module cost --only 17,42 --tests tests/test_mutants_cost.py
    python benchmarks/mutation.py --module isel --sample 60 --seed 1 --jobs 2 --json out.json

While other work is in progress in the checkout, mutate the last commit and bring only the new
tests from the working tree::

    python benchmarks/mutation.py --module cost --sample 40 --seed 1 --rev HEAD --overlay tests/test_mutants_cost.py

``--only`` takes mutant numbers from ``--list`` (they are stable while the module's source is).

Each module's default ``-k`` (``SELECT``; ``-k`` replaces it, ``--tests`` drops it) leaves out
tests too slow to run per mutant, and for the two printers (``tensorcore``, ``lowering``) the
golden-file comparison: a mutant that changes only the printed text must be killed by a test of
what the kernel does (PoCL against the reference, NVRTC's resources, SASS, the asm operands), not
by a diff. Their mutants that change every kernel's text make PoCL compile each again, minutes
on shared cores: pass ``--timeout`` (benchmarks/mutation.md says how much), since a timeout counts
as a kill.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each module with the tests that exercise it: chosen to cover it and to run in seconds, so that a
# sample of a module runs in minutes. The module's own doctests are added to its list.
MODULES: dict[str, tuple[str, list[str]]] = {
    "relabel": (
        "napkin_dsl/relabel.py",
        [
            "tests/test_mutants_relabel.py",
            "tests/test_scoped_relabel.py",
            "tests/test_reliability_frontend.py",
            "tests/test_cost.py",
            "tests/test_pseudocode_golden.py",
            "tests/test_bad_input.py",
        ],
    ),
    "pseudocode": (
        "napkin_dsl/pseudocode.py",
        [
            "tests/test_mutants_pseudocode.py",
            "tests/test_split.py",
            "tests/test_independent_counts.py",
            "tests/test_pseudocode_golden.py",
            "tests/test_steps.py",
            "tests/test_cost.py",
            "tests/test_scoped_relabel.py",
            "tests/test_flops.py",
        ],
    ),
    "cost": (
        "napkin_dsl/cost.py",
        [
            "tests/test_mutants_cost.py",
            "tests/test_independent_counts.py",
            "tests/test_cost.py",
            "tests/test_statement_columns.py",
            "tests/test_model_paths.py",
            "tests/test_pseudocode_golden.py",
            "tests/test_published_model.py",
            "tests/test_flops.py",
        ],
    ),
    "isel": (
        "napkin_dsl/isel.py",
        [
            "tests/test_mutants_isel.py",
            "tests/test_tensorcore.py",
            "tests/test_fma_registers.py",
            "tests/test_model_paths.py",
            "tests/test_cost.py",
        ],
    ),
    # The instruction paths (issue 42): selection's tests, and the wgmma path's plans and TMA copies.
    "paths.plan": (
        "napkin_dsl/paths/plan.py",
        [
            "tests/test_mutants_isel.py",
            "tests/test_tensorcore.py",
            "tests/test_model_paths.py",
            "tests/test_selection_pass.py",
        ],
    ),
    "paths.mma_sync": (
        "napkin_dsl/paths/mma_sync.py",
        [
            "tests/test_mutants_isel.py",
            "tests/test_tensorcore.py",
            "tests/test_fp8_tensorcore.py",
            "tests/test_selection_pass.py",
            "tests/test_toy_path.py",
        ],
    ),
    "paths.wgmma": (
        "napkin_dsl/paths/wgmma.py",
        [
            "tests/test_mutants_isel.py",
            "tests/test_wgmma.py",
            "tests/test_wgmma_fp8.py",
            "tests/test_wgmma_fp8_attention.py",
            "tests/test_wgmma_attention.py",
            "tests/test_tma.py",
            "tests/test_selection_pass.py",
            "tests/test_model_paths.py",
        ],
    ),
    "layouts": (
        "napkin_dsl/layouts.py",
        [
            "tests/test_mutants_layouts.py",
            "tests/test_layouts.py",
            "tests/test_ptx_asm.py",
            "tests/test_tensorcore.py",
        ],
    ),
    "numpy": (
        "napkin_dsl/backends/numpy.py",
        [
            "tests/test_mutants_numpy.py",
            "tests/test_numpy_backend.py",
            "tests/test_numerical_stress.py",
            "tests/test_steps.py",
            "tests/test_flops.py",
            "tests/test_logsumexp.py",
        ],
    ),
    "tensorcore": (
        "napkin_dsl/backends/tensorcore.py",
        [
            "tests/test_mutants_tensorcore.py",
            "tests/test_ptx_asm.py",
            "tests/test_tensorcore.py",
            "tests/test_cuda_codegen.py",
        ],
    ),
    "lowering": (
        "napkin_dsl/backends/lowering.py",
        [
            "tests/test_mutants_lowering.py",
            "tests/test_lowering_staging.py",
            "tests/test_fma_registers.py",
            "tests/test_opencl_properties.py",
            "tests/test_cuda_codegen.py",
        ],
    ),
}

# pytest -k per module: kernels run on PoCL take minutes per run, so modules whose decisions the
# model and the printed text already show leave them out. The printers keep their PoCL runs (the
# tensor-core path's longest, sliding_window's, and the random relabellings left out) but never
# the golden-file comparisons (test_generated_cuda_golden): a mutant that changes only the
# printed text would be "killed" there by a diff, with no test understanding it. oclgrind's
# example runs are minutes each; tests/test_mutants_lowering.py runs one small case under it.
SELECT = {
    "isel": "not pocl and not opencl and not random_attention and not two_dimensional_warp_grid and not more_threads and not oclgrind",
    "layouts": "not pocl and not opencl and not random_attention and not two_dimensional_warp_grid and not more_threads and not oclgrind",
    "paths.plan": "not pocl and not opencl and not random_attention and not two_dimensional_warp_grid and not more_threads and not oclgrind",
    "paths.mma_sync": "not pocl and not opencl and not random_attention and not two_dimensional_warp_grid and not more_threads and not oclgrind",
    "paths.wgmma": "not pocl and not opencl and not oclgrind and not emulation",
    "tensorcore": "not golden and not oclgrind and not sliding_window and not random_attention",
    "lowering": "not golden and not oclgrind",
}

ARITHMETIC = {
    ast.Add: [ast.Sub],
    ast.Sub: [ast.Add],
    ast.Mult: [ast.Div],
    ast.Div: [ast.Mult],
    ast.FloorDiv: [ast.Div],
    ast.Mod: [ast.FloorDiv],
    ast.Pow: [ast.Mult],
}
COMPARISON = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
SYMBOL = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
    ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
    ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not",
    ast.And: "and", ast.Or: "or",
}


@dataclass(frozen=True)
class Mutant:
    number: int
    line: int
    start: int  # byte offsets in the file: the mutant replaces source[start:end] with new
    end: int
    old: str
    new: str

    def describe(self) -> str:
        return f"{self.old!r} -> {self.new!r}"


def _line_offsets(source: bytes) -> list[int]:
    offsets = [0]
    for index, byte in enumerate(source):
        if byte == 0x0A:
            offsets.append(index + 1)
    return offsets


def _mask_comments(text: str) -> str:
    # The gap between two operands holds only the operator, brackets, blanks and comments.
    return re.sub(r"#[^\n]*", lambda m: " " * len(m.group()), text)


def _operator_span(gap: str) -> tuple[int, int] | None:
    """Where the operator is in the text between two operands (brackets and blanks stripped)."""
    masked = _mask_comments(gap)
    chars = [i for i, c in enumerate(masked) if c not in " \t\r\n()\\"]
    if not chars:
        return None
    return chars[0], chars[-1] + 1


def _skipped_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes not to mutate: annotations, docstrings, asserts, f-strings and their insides."""
    skipped: set[int] = set()

    def skip(node: ast.AST | None) -> None:
        if node is not None:
            for inner in ast.walk(node):
                skipped.add(id(inner))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assert, ast.JoinedStr)):
            skip(node)
        elif isinstance(node, ast.AnnAssign):
            skip(node.annotation)
        elif isinstance(node, ast.arg):
            skip(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            skip(node.returns)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                skip(first)
        # `if TYPE_CHECKING:` blocks are never run
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skip(node)
    return skipped


def enumerate_mutants(source: bytes) -> list[Mutant]:
    """Every mutant of one module's source, in source order."""
    tree = ast.parse(source)
    offsets = _line_offsets(source)
    lines = source.split(b"\n")
    skipped = _skipped_nodes(tree)
    found: list[tuple[int, int, int, str, str]] = []

    def at(line: int, col: int) -> int:
        return offsets[line - 1] + col

    def start_of(node: ast.AST) -> int:
        return at(node.lineno, node.col_offset)

    def end_of(node: ast.AST) -> int:
        return at(node.end_lineno, node.end_col_offset)

    def operator_between(left: ast.AST, right: ast.AST, old: str, new: str) -> None:
        a, b = end_of(left), start_of(right)
        span = _operator_span(source[a:b].decode())
        if span is None:
            return
        start, end = a + span[0], a + span[1]
        # the span is in characters of the decoded gap; the gap is ASCII (operators and blanks)
        if " ".join(source[start:end].decode().split()) != old:
            return
        found.append((left.end_lineno, start, end, source[start:end].decode(), new))

    for node in ast.walk(tree):
        if id(node) in skipped or not hasattr(node, "lineno"):
            continue
        if lines[node.lineno - 1].rstrip().endswith(b"# no mutate"):
            continue
        if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
            for new in ARITHMETIC[type(node.op)]:
                operator_between(node.left, node.right, SYMBOL[type(node.op)], SYMBOL[new])
        elif isinstance(node, ast.AugAssign) and type(node.op) in ARITHMETIC:
            for new in ARITHMETIC[type(node.op)]:
                operator_between(node.target, node.value, SYMBOL[type(node.op)] + "=", SYMBOL[new] + "=")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for index, op in enumerate(node.ops):
                operator_between(operands[index], operands[index + 1], SYMBOL[type(op)], SYMBOL[COMPARISON[type(op)]])
        elif isinstance(node, ast.BoolOp):
            old = SYMBOL[type(node.op)]
            new = "or" if old == "and" else "and"
            for left, right in zip(node.values, node.values[1:], strict=False):
                operator_between(left, right, old, new)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            # drop the keyword or the sign, keep any bracket between it and the operand: not(x) -> (x)
            a, b = start_of(node), start_of(node.operand)
            text = source[a:b].decode()
            found.append((node.lineno, a, b, text, re.sub(r"^(not|-)\s*", "", text)))
        elif isinstance(node, ast.Constant) and node.lineno == node.end_lineno:
            value = node.value
            a, b = start_of(node), end_of(node)
            if isinstance(value, bool):
                found.append((node.lineno, a, b, source[a:b].decode(), str(not value)))
            elif isinstance(value, (int, float)):
                found.append((node.lineno, a, b, source[a:b].decode(), repr(value + 1)))
        elif isinstance(node, ast.Return) and node.value is not None:
            if isinstance(node.value, ast.Constant) and node.value.value is None:
                continue
            a, b = start_of(node.value), end_of(node.value)
            found.append((node.lineno, a, b, source[a:b].decode(), "None"))
    found.sort(key=lambda item: (item[1], item[2], item[4]))
    return [Mutant(number, line, start, end, old, new) for number, (line, start, end, old, new) in enumerate(found, 1)]


def apply(source: bytes, mutant: Mutant) -> bytes:
    return source[: mutant.start] + mutant.new.encode() + source[mutant.end :]


# --- the copy and the runs ---------------------------------------------------------------------


def files_of_worktree() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    return [name for name in listed.decode().split("\0") if name and (ROOT / name).is_file()]


def make_copy(destination: Path, rev: str | None, overlay: list[str]) -> None:
    destination.mkdir(parents=True)
    if rev:
        archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(destination)], input=archive, check=True)
    names = overlay if rev else files_of_worktree()
    for name in names:
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)


@dataclass
class Outcome:
    status: str  # killed | survived | timeout | error
    seconds: float
    detail: str = ""


RUNNING: set = set()  # pytest processes in flight, killed (with their children) if the script is stopped
STOPPING = threading.Event()


def stop(signum, frame):
    STOPPING.set()
    for process in list(RUNNING):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise KeyboardInterrupt


def run_tests(workspace: Path, tests: list[str], timeout: float, extra: list[str]) -> Outcome:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(workspace) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a same-size mutant written in the same second must not meet a stale .pyc
    env["NAPKIN_CACHE_DIR"] = str(workspace / ".napkin-cache")
    shutil.rmtree(workspace / ".hypothesis", ignore_errors=True)  # no replayed examples from an earlier mutant
    command = [sys.executable, "-m", "pytest", "-x", "-q", "--no-header", "-p", "no:cacheprovider", "--hypothesis-seed=0", *extra, *tests]
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=workspace, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    RUNNING.add(process)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return Outcome("timeout", time.monotonic() - started)
    finally:
        RUNNING.discard(process)
    if STOPPING.is_set():
        return Outcome("stopped", time.monotonic() - started)
    seconds = time.monotonic() - started
    text = output.decode(errors="replace")
    if process.returncode == 0:
        return Outcome("survived", seconds, text)
    if process.returncode in (1, 2, 3):  # tests failed, interrupted (an import error), internal error
        failed = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
        return Outcome("killed", seconds, failed[0] if failed else text[-300:])
    return Outcome("error", seconds, text[-2000:])


def parse_lines(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    first, _, last = text.partition("-")
    return int(first), int(last or first)


def select(mutants: list[Mutant], args) -> list[Mutant]:
    chosen = mutants
    lines = parse_lines(args.lines)
    if lines:
        chosen = [m for m in chosen if lines[0] <= m.line <= lines[1]]
    if args.only:
        wanted = {int(n) for n in args.only.split(",")}
        chosen = [m for m in chosen if m.number in wanted]
    if args.sample is not None and args.sample < len(chosen):
        chosen = sorted(random.Random(args.seed).sample(chosen, args.sample), key=lambda m: m.number)
    if args.limit is not None:
        chosen = chosen[: args.limit]
    return chosen


def run_module(name: str, args) -> dict:
    path, tests = MODULES[name]
    source = (ROOT / path).read_bytes() if not args.rev else subprocess.run(
        ["git", "show", f"{args.rev}:{path}"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    mutants = enumerate_mutants(source)
    chosen = select(mutants, args)
    source_lines = source.decode().splitlines()
    if args.list:
        for m in chosen:
            print(f"{m.number:5d}  {path}:{m.line}  {m.describe():28s}  {source_lines[m.line - 1].strip()}")
        return {}
    tests = args.tests.split(",") if args.tests else tests + [path]
    root = Path(tempfile.mkdtemp(prefix="napkin-mutation-"))
    try:
        jobs = max(1, min(args.jobs, len(chosen) or 1))
        workspaces = [root / f"w{i}" for i in range(jobs)]
        for workspace in workspaces:
            make_copy(workspace, args.rev, args.overlay.split(",") if args.overlay else [])
        missing = [t for t in tests if not (workspaces[0] / t.split("::")[0]).exists()]
        tests = [t for t in tests if t not in missing]
        k = args.k or (None if args.tests else SELECT.get(name))
        extra = ["-k", k] if k else []
        baseline = run_tests(workspaces[0], tests, timeout=1800, extra=extra)
        if baseline.status != "survived":
            print(f"{name}: the unmutated tests do not pass ({baseline.status}); fix that first:\n{baseline.detail}", file=sys.stderr)
            sys.exit(2)
        timeout = args.timeout or 2 * baseline.seconds + 10
        print(
            f"{name}: {len(mutants)} mutants in {path}" + (f" at {args.rev[:12]}" if args.rev else "")
            + f", trying {len(chosen)}; tests {' '.join(tests)}"
            + (f" (missing: {' '.join(missing)})" if missing else "")
            + f"; unmutated run {baseline.seconds:.1f} s, timeout {timeout:.0f} s",
            flush=True,
        )
        free = list(workspaces)
        lock = threading.Lock()
        results: dict[int, Outcome] = {}

        def one(mutant: Mutant) -> None:
            if STOPPING.is_set():
                return
            with lock:
                workspace = free.pop()
            target = workspace / path
            try:
                target.write_bytes(apply(source, mutant))
                outcome = run_tests(workspace, tests, timeout, extra)
            finally:
                target.write_bytes(source)
                with lock:
                    free.append(workspace)
            if outcome.status == "stopped":
                return
            results[mutant.number] = outcome
            if args.verbose or outcome.status in ("survived", "error"):
                print(f"  {mutant.number:5d} {outcome.status:8s} {outcome.seconds:5.1f}s  {path}:{mutant.line}  {mutant.describe()}", flush=True)

        pool = ThreadPoolExecutor(jobs)
        try:
            list(pool.map(one, chosen))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    chosen = [m for m in chosen if m.number in results]  # all of them unless stopped
    counts = {status: sum(1 for o in results.values() if o.status == status) for status in ("killed", "survived", "timeout", "error")}
    survivors = [
        {"number": m.number, "where": f"{path}:{m.line}", "mutation": m.describe(), "line": source_lines[m.line - 1].strip()}
        for m in chosen
        if results[m.number].status == "survived"
    ]
    return {"module": name, "path": path, "rev": args.rev, "mutants": len(mutants), "tried": len(chosen), **counts, "survivors": survivors}


def print_table(reports: list[dict]) -> None:
    print()
    print(f"{'module':12s} {'mutants':>7s} {'tried':>6s} {'killed':>6s} {'survived':>8s} {'timeout':>7s} {'error':>5s} {'killed%':>7s}")
    for r in reports:
        done = r["killed"] + r["timeout"]
        rate = 100.0 * done / r["tried"] if r["tried"] else 0.0
        print(
            f"{r['module']:12s} {r['mutants']:7d} {r['tried']:6d} {r['killed']:6d} {r['survived']:8d} {r['timeout']:7d} {r['error']:5d} {rate:6.1f}%"
        )
    for r in reports:
        if r["survivors"]:
            print(f"\nsurvivors in {r['module']}:")
            for s in r["survivors"]:
                print(f"  {s['number']:5d}  {s['where']}  {s['mutation']:28s}  {s['line']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", action="append", choices=sorted(MODULES), help="a module to mutate (repeatable)")
    parser.add_argument("--list-modules", action="store_true", help="print the modules and their tests")
    parser.add_argument("--list", action="store_true", help="print the selected mutants, run nothing")
    parser.add_argument("--limit", type=int, help="the first N selected mutants")
    parser.add_argument("--sample", type=int, help="N mutants drawn at random (with --seed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lines", help="only mutants on lines A-B of the module")
    parser.add_argument("--only", help="only these mutant numbers, comma separated (numbers from --list)")
    parser.add_argument("--tests", help="comma-separated test paths instead of the module's list")
    parser.add_argument("-k", help="pytest -k expression for the tests")
    parser.add_argument("--timeout", type=float, help="seconds per mutant (default: 2 x the unmutated run + 10)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once, each in its own copy")
    parser.add_argument("--rev", help="mutate this commit's files instead of the working tree's")
    parser.add_argument("--overlay", help="with --rev: comma-separated files of the working tree copied over the commit's (new tests)")
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every mutant's outcome")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if args.rev:  # a fixed commit, printed, so that a later run can try the same mutants (their numbers)
        args.rev = subprocess.run(["git", "rev-parse", args.rev], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    if args.list_modules:
        for name, (path, tests) in MODULES.items():
            print(f"{name:12s} {path:36s} {' '.join(tests)}")
        return 0
    if not args.module:
        parser.error("--module is required (or --list-modules)")
    reports = [r for r in (run_module(name, args) for name in args.module) if r]
    if reports:
        print_table(reports)
    if args.json and reports:
        Path(args.json).write_text(json.dumps(reports, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
