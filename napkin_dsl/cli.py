"""The ``napkin`` command.

Each subcommand is a thin layer over the Python API: it loads kernels, calls one stage and
prints text or JSON. User mistakes (any :class:`NapkinError`) print on stderr and exit 2,
never as a traceback; anything else is a napkin bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import sympy

from .backends.nvrtc import add_cache_command
from .errors import NapkinError
from .kernel import Kernel, load

EXIT_USER_ERROR = 2


def json_value(expr):
    """A number when the expression is numeric, else a string sympy.sympify parses."""
    if expr is None:
        return None
    if isinstance(expr, (int, float)):
        return expr
    expr = sympy.sympify(expr)
    if expr.is_number:
        if expr.is_integer:
            return int(expr)
        return float(expr)
    return str(expr)


def _load_all(files: list[str], kernel: str | None = None, hardware: str | None = None) -> list[tuple[str, Kernel]]:
    found = []
    for file in files:
        kernels = load(Path(file), hardware=hardware)
        for name, k in kernels.items():
            if kernel is None or name == kernel:
                found.append((file, k))
    if kernel is not None and not found:
        raise NapkinError(f"no kernel named {kernel!r} in {', '.join(files)}")
    return found


# ---- napkin check ----------------------------------------------------------------------------


def check_summary(k: Kernel) -> dict:
    d = k.diagram
    return {
        "file": k.file,
        "signature": k.signature(),
        "hardware": k.hardware,
        "axes": {name: json_value(axis.size) for name, axis in d.axes.items()},
        "statements": [
            {
                "line": s.span.line if s.span else None,
                "target": s.target,
                "axes": list(s.axes),
                "box": s.box.kind,
                "dtype": s.dtype,
                "level": s.level,
                "woven": list(s.woven),
                "consumed": list(s.consumed),
                "flops": {unit: json_value(v) for unit, v in s.flops.items()},
            }
            for s in d.statements
        ],
        "flops": json_value(d.flops),
    }


def format_check(k: Kernel) -> str:
    d = k.diagram
    summary = check_summary(k)
    lines = [f"kernel {k.signature()}"]
    lines.append("  axes: " + "  ".join(f"{name}={axis.size}" for name, axis in d.axes.items()))
    lines.append(f"  relabel: {k.relabel_text()}")
    rows = [("line", "statement", "box", "woven", "consumed", "FLOPs")]
    for s, info in zip(d.statements, summary["statements"]):
        target = f"{s.target}[{' '.join(s.axes)}]" + (f" @{s.level}" if s.level else "")
        rows.append((str(info["line"]), target, s.box.kind, " ".join(s.woven) or "-", " ".join(s.consumed) or "-", str(s.total_flops)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    lines.append(f"  total FLOPs: {d.flops}")
    return "\n".join(lines)


def cmd_check(args) -> int:
    kernels = _load_all(args.files)
    if args.json:
        print(json.dumps({"kernels": {k.name: check_summary(k) for _, k in kernels}}, indent=2))
        return 0
    for file in args.files:
        in_file = [k for f, k in kernels if f == file]
        print(f"{file}: ok ({len(in_file)} kernel{'s' if len(in_file) != 1 else ''})")
        for k in in_file:
            print(format_check(k))
    return 0


# ---- napkin report ---------------------------------------------------------------------------


def cmd_report(args) -> int:
    kernels = _load_all([args.file])
    print(f"{args.file}: {len(kernels)} kernel{'s' if len(kernels) != 1 else ''}")
    for _, k in kernels:
        print()
        print(format_check(k))
    return 0


# ---- entry point -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="napkin", description="Neural circuit diagrams as GPU kernels.")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="check diagrams: axes, sizes, dtypes, levels, FLOPs")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(run=cmd_check)

    report = sub.add_parser("report", help="check, relabel, pseudocode and cost table of every kernel in a file")
    report.add_argument("file", metavar="FILE")
    report.set_defaults(run=cmd_report)
    add_cache_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except NapkinError as error:
        if getattr(args, "json", False):
            print(json.dumps(error.to_dict(), indent=2))
        print(error.render(), file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
