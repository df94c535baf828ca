"""How fast napkin starts: three commands, each timed in 10 fresh Python processes.

    python benchmarks/bench_startup.py [--repeat 10]

(a) ``python -c "import napkin_dsl"``; target under 150 ms;
(b) ``napkin check examples/attention.napkin``; target under 400 ms;
(c) a fresh process that loads examples/attention.napkin and gets its cubin from the disk
    cache: ``napkin.load(file)["attention"].compile("sm_90", b=4, h=16, q=4096, x=4096, d=128)``;
    target under 300 ms. The cache is filled once beforehand (a compile with NVRTC); every
    timed process checks that it did not import cuda-python or the lowering, i.e. that it was
    a hit. Without NVRTC, (c) is skipped.

It prints the median wall time of each, and the median CPU time (user + system) of the
process, which says more than wall time on a machine shared with other work. Neither (b) nor
(c) may import sympy (sizes are napkin's own algebra, ``algebra.py``): (c) asserts it in every
timed process, and (b) once beforehand, through the CLI's entry point. Every process
uses one temporary ``NAPKIN_CACHE_DIR``, warmed first (the grammar's parse tables, the
compiled kernel), so no process pays for a one-time cost of a machine. Not a test: it asserts
only that (c) hit the cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "attention.napkin"
TARGETS_MS = {"import": 150, "check": 400, "cubin from the disk cache": 300}
HIT = f"""
import sys
import napkin_dsl as napkin
compiled = napkin.load({str(EXAMPLE)!r})["attention"].compile("sm_90", b=4, h=16, q=4096, x=4096, d=128)
assert compiled.image, "no cubin"
heavy = [m for m in ("cuda", "napkin_dsl.backends.lowering", "napkin_dsl.backends.cuda") if m in sys.modules]
assert not heavy, f"not a disk-cache hit: imported {{heavy}}"
assert "sympy" not in sys.modules, "a disk-cache hit imported sympy"
"""
CHECK_WITHOUT_SYMPY = f"""
import contextlib, io, sys
from napkin_dsl.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    main(["check", {str(EXAMPLE)!r}])
assert "sympy" not in sys.modules, "napkin check imported sympy"
"""


def timed(command: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of ``command`` in a fresh process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    error = process.stderr.read().decode()
    process.stderr.close()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({process.returncode}):\n{error}")
    return wall, usage.ru_utime + usage.ru_stime


def napkin_command() -> list[str]:
    """The ``napkin`` console script beside this Python, else the same entry point through -c."""
    script = Path(sys.executable).parent / "napkin"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from napkin_dsl.cli import main; sys.exit(main())"]


def nvrtc_available(env: dict) -> bool:
    probe = "from napkin_dsl.backends.nvrtc import nvrtc_version; nvrtc_version()"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10, help="fresh processes per command")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="napkin-bench-startup-") as cache:
        env = {**os.environ, "NAPKIN_CACHE_DIR": cache, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        commands = {
            "import": [sys.executable, "-c", "import napkin_dsl"],
            "check": napkin_command() + ["check", str(EXAMPLE)],
        }
        if nvrtc_available(env):
            commands["cubin from the disk cache"] = [sys.executable, "-c", HIT]
            # Fill the cache: the first run compiles (and is not a hit, hence not HIT).
            fill = HIT.split("heavy =")[0]
            subprocess.run([sys.executable, "-c", fill], env=env, cwd=ROOT, check=True)
        else:
            print("cubin from the disk cache: skipped (NVRTC is not available)")
        subprocess.run(commands["check"], env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)  # parse tables
        subprocess.run([sys.executable, "-c", CHECK_WITHOUT_SYMPY], env=env, cwd=ROOT, check=True)
        print(f"median of {args.repeat} fresh processes (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
        for name, command in commands.items():
            runs = [timed(command, env) for _ in range(args.repeat)]
            wall = statistics.median(w for w, _ in runs) * 1e3
            cpu = statistics.median(c for _, c in runs) * 1e3
            target = TARGETS_MS.get(name)
            verdict = f"  (target {target} ms wall: {'ok' if wall < target else 'over'})" if target else ""
            print(f"  {name:<33} wall {wall:6.0f} ms  cpu {cpu:6.0f} ms{verdict}")


if __name__ == "__main__":
    main()
