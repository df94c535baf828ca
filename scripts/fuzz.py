#!/usr/bin/env python3
"""The long profile of the grammar fuzzer (issue 13): 10^4 and more programs through the API.

    python scripts/fuzz.py --examples 10000 [--seed N] [--timeout-per-program S]
    python scripts/fuzz.py --examples 2000 --max-seconds 300 --out fuzz-out   # keep the reproducers
    python scripts/fuzz.py --replay fuzz-out/failure_1.json                  # rerun one, in this process

Programs come from the hypothesis strategies of ``tests/fuzz_programs.py``: 70% valid kernels
from the notation with random relabellings, 20% their token mutants, 10% valid kernels bound to
absurd sizes (planned and costed only). Hypothesis only generates here (seeded, no database, no
shrinking); each case runs in one of ``--workers`` worker processes (``check_case``: load,
program, pseudocode, cost, the reference, the NumPy backend and its counts, sometimes
``kernel(..., backend="numpy")``, and OpenCL on ``--opencl-fraction`` of the valid programs,
about 1 s each on PoCL). A worker that has not answered ``--timeout-per-program`` seconds
after it took a case is killed and the case counted as a hang (with the stage it was in).

The report gives the counts of programs with a traceback, a hang, a wrong result and a count
mismatch (the figures of issue 13), what the rest did (loaded, refused with a NapkinError and
where, ran on NumPy, ran on OpenCL), and each distinct failure (its signature: the kind, the
stage and, for tracebacks, the exception and the innermost napkin_dsl function) with how
often it occurred, the issue-13 item it matches (``known_item``), and its first case
minimised (lines, then token spans, then sizes dropped while the same signature still
fails; ``--minimise-budget`` runs at most). Exit status 1 when anything failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fuzz_programs import Case, Failure, cases, check_case, known_item, minimise

KINDS = ("traceback", "hang", "wrong result", "count mismatch")


# ---- workers ---------------------------------------------------------------------------------------


def _worker(conn, stage) -> None:
    """Run cases from ``conn`` until None; the current stage is written to ``stage`` for hangs."""
    warnings.simplefilter("ignore")

    def on_stage(name: str) -> None:
        stage.value = name.encode()[:60]

    while True:
        case = conn.recv()
        if case is None:
            return
        stage.value = b"start"
        try:
            outcome = check_case(case, on_stage=on_stage).to_dict()
        except BaseException as error:  # noqa: BLE001 - the harness itself failed: report it
            outcome = {"stages": [], "rejected": None, "message": "",
                       "failures": [Failure("traceback", "harness", f"harness: {type(error).__name__}", repr(error)).to_dict()]}
        conn.send(outcome)


class Pool:
    """Worker processes, each one case at a time, killed and replaced when a case overruns."""

    def __init__(self, workers: int, timeout: float, on_result):
        self.context = multiprocessing.get_context("spawn")
        self.timeout = timeout
        self.on_result = on_result
        self.slots = [self._start() for _ in range(workers)]

    def _start(self) -> dict:
        parent, child = self.context.Pipe()
        stage = self.context.Array("c", 64)
        process = self.context.Process(target=_worker, args=(child, stage), daemon=True)
        process.start()
        child.close()
        return {"process": process, "conn": parent, "stage": stage, "case": None, "since": 0.0}

    def submit(self, case: Case) -> None:
        while True:
            idle = [slot for slot in self.slots if slot["case"] is None]
            if idle:
                slot = idle[0]
                slot["case"], slot["since"] = case, time.monotonic()
                slot["conn"].send(case)
                return
            self.collect()

    def collect(self) -> None:
        busy = [slot for slot in self.slots if slot["case"] is not None]
        if not busy:
            return
        now = time.monotonic()
        wait = max(0.0, min(slot["since"] + self.timeout - now for slot in busy))
        ready = multiprocessing.connection.wait([slot["conn"] for slot in busy], timeout=wait + 0.05)
        for slot in busy:
            if slot["conn"] in ready:
                try:
                    outcome = slot["conn"].recv()
                except (EOFError, OSError):
                    code = slot["process"].exitcode
                    outcome = {"stages": [], "rejected": None, "message": "", "failures": [
                        Failure("traceback", self._stage(slot), f"{self._stage(slot)}: worker died (exit {code})",
                                f"the worker process ended with exit code {code}").to_dict()]}
                    self._replace(slot)
                self._finish(slot, outcome)
            elif time.monotonic() - slot["since"] > self.timeout:
                stage = self._stage(slot)
                outcome = {"stages": [], "rejected": None, "message": "", "failures": [
                    Failure("hang", stage, f"hang in {stage}", f"no answer after {self.timeout:g} s (stage {stage})").to_dict()]}
                self._replace(slot)
                self._finish(slot, outcome)

    def _stage(self, slot) -> str:
        return slot["stage"].value.decode(errors="replace") or "start"

    def _replace(self, slot) -> None:
        slot["process"].kill()
        slot["process"].join()
        slot.update(self._start(), case=slot["case"], since=slot["since"])

    def _finish(self, slot, outcome) -> None:
        case = slot["case"]
        slot["case"] = None
        self.on_result(case, outcome)

    def drain(self) -> None:
        while any(slot["case"] is not None for slot in self.slots):
            self.collect()

    def run_one(self, case: Case) -> dict:
        """One case on a worker, synchronously (for minimising)."""
        got = {}
        previous = self.on_result
        self.on_result = lambda c, outcome: got.setdefault("outcome", outcome)
        try:
            self.submit(case)
            self.drain()
        finally:
            self.on_result = previous
        return got["outcome"]

    def close(self) -> None:
        for slot in self.slots:
            try:
                slot["conn"].send(None)
            except OSError:
                pass
        for slot in self.slots:
            slot["process"].join(timeout=5)
            if slot["process"].is_alive():
                slot["process"].kill()


# ---- the run ------------------------------------------------------------------------------------------


class Tally:
    def __init__(self):
        self.counts = collections.Counter()
        self.rejected = collections.Counter()
        self.failures: dict[str, list] = collections.OrderedDict()  # signature -> [(case, failure)]
        self.started = time.monotonic()

    def __call__(self, case: Case, outcome: dict) -> None:
        c = self.counts
        c["programs"] += 1
        c[f"kind {case.kind}"] += 1
        if outcome["rejected"] and not {"numpy", "opencl"} & set(outcome["stages"]):
            self.rejected[outcome["rejected"]] += 1
        if "load" in outcome["stages"]:
            c["loaded"] += 1
        if "numpy" in outcome["stages"]:
            c["ran numpy"] += 1
        if "opencl" in outcome["stages"]:
            c["ran opencl"] += 1
        kinds = set()
        for f in outcome["failures"]:
            failure = Failure(**f)
            kinds.add(failure.kind)
            self.failures.setdefault(failure.signature, []).append((case, failure))
        for kind in kinds:
            c[kind] += 1
        if c["programs"] % 500 == 0:
            print(f"  {c['programs']} programs, {time.monotonic() - self.started:.0f} s: "
                  + ", ".join(f"{k} {c[k]}" for k in KINDS), flush=True)


class _Enough(KeyboardInterrupt):
    """Time is up: stop hypothesis generating."""


def generate(args, pool: Pool) -> int:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seed_of

    chooser = random.Random(args.seed)
    deadline = time.monotonic() + args.max_seconds if args.max_seconds else None
    submitted = 0

    @seed_of(args.seed)
    @settings(max_examples=args.examples, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(cases(max_size=args.max_size))
    def one(case: Case):
        nonlocal submitted
        if deadline is not None and time.monotonic() > deadline:
            raise _Enough()
        if case.kind == "valid":
            case = case.replace(opencl=chooser.random() < args.opencl_fraction)
        pool.submit(case)
        submitted += 1

    try:
        one()
    except _Enough:
        pass
    pool.drain()
    return submitted


def reproduces(pool: Pool, signature: str, kind: str):
    def check(case: Case) -> bool:
        outcome = pool.run_one(case)
        return any(f["signature"] == signature or (kind == "hang" and f["kind"] == "hang") for f in outcome["failures"])

    return check


def report(args, tally: Tally, pool: Pool | None, elapsed: float) -> dict:
    c = tally.counts
    print()
    print(f"fuzz: {c['programs']} programs in {elapsed:.0f} s (seed {args.seed}, {args.workers} workers, "
          f"time limit {args.timeout_per_program:g} s per program): valid {c['kind valid']}, mutants {c['kind mutant']}, "
          f"absurd sizes {c['kind absurd']}")
    print(f"  loaded {c['loaded']}; ran on NumPy against the reference {c['ran numpy']}; on OpenCL {c['ran opencl']}")
    print("  refused with a NapkinError: " + (", ".join(f"{k} {v}" for k, v in tally.rejected.most_common()) or "none"))
    print("  programs with a  " + "   ".join(f"{k}: {c[k]}" for k in KINDS))
    summary = {"programs": c["programs"], "seconds": round(elapsed), "seed": args.seed, "counts": dict(c),
               "rejected": dict(tally.rejected), "failures": []}
    if not tally.failures:
        print("  no failures")
        return summary
    print(f"\n{len(tally.failures)} distinct failures:")
    for number, (signature, found) in enumerate(tally.failures.items(), start=1):
        case, failure = found[0]
        items = collections.Counter(known_item(case, f) or "new" for case, f in found)
        first = case
        if pool is not None and args.minimise_budget:
            started = time.monotonic()
            case = minimise(case, reproduces(pool, signature, failure.kind), budget=args.minimise_budget)
            outcome = pool.run_one(case)
            failure = next((Failure(**f) for f in outcome["failures"] if f["signature"] == signature), failure)
            shrink = f" (minimised in {time.monotonic() - started:.0f} s)"
        else:
            shrink = ""
        item = known_item(case, failure) or known_item(first, found[0][1]) or "new"
        label = ", ".join(f"{k} x{v}" for k, v in items.most_common())
        print(f"\n[{number}] {signature}: {len(found)} occurrences; issue 13: {label}")
        print(f"  reproducer{shrink}:")
        print(case.describe())
        message = failure.message.strip().split("\n")
        print("  " + "\n  ".join(message[-8:]))
        entry = {"signature": signature, "kind": failure.kind, "occurrences": len(found), "item": item, "items": dict(items),
                 "case": json.loads(case.to_json()), "message": failure.message}
        summary["failures"].append(entry)
        if args.out:
            Path(args.out, f"failure_{number}.json").write_text(case.to_json())
    return summary


def replay(path: str) -> int:
    case = Case.from_json(Path(path).read_text())
    print(case.describe())
    outcome = check_case(case)
    print(json.dumps(outcome.to_dict(), indent=2))
    for f in outcome.failures:
        print(f"issue 13: {known_item(case, f) or 'new'}")
    return 1 if outcome.failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=10000, help="programs to generate (default 10000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-per-program", type=float, default=30.0, help="seconds before a program counts as a hang (default 30)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--max-seconds", type=float, default=None, help="stop generating after this long (the report says how many ran)")
    parser.add_argument("--opencl-fraction", type=float, default=0.03, help="share of valid programs also run on OpenCL (default 0.03)")
    parser.add_argument("--max-size", type=int, default=12, help="largest axis size (default 12)")
    parser.add_argument("--minimise-budget", type=int, default=150, help="runs per distinct failure to minimise it (0: don't)")
    parser.add_argument("--out", help="write summary.json and failure_N.json (replayable) here")
    parser.add_argument("--replay", help="run one case from a failure_N.json in this process and print what happened")
    args = parser.parse_args(argv)
    if args.replay:
        return replay(args.replay)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    tally = Tally()
    pool = Pool(args.workers, args.timeout_per_program, tally)
    started = time.monotonic()
    try:
        generate(args, pool)
        elapsed = time.monotonic() - started
        summary = report(args, tally, pool, elapsed)
    finally:
        pool.close()
    if args.out:
        Path(args.out, "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
