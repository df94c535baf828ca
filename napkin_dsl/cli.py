"""The ``napkin`` command.

Each subcommand is a thin layer over the Python API: it loads kernels, calls one stage and
prints text or JSON. User mistakes (any :class:`NapkinError`) print on stderr and exit 2,
never as a traceback; anything else is a napkin bug and keeps its traceback.

Every command takes a ``.napkin`` file or a ``.py`` file (:func:`load_file`): a Python file is
imported as a module and its ``@napkin.kernel`` functions (any :class:`Kernel` it defines at
module level) are the kernels, ``--kernel NAME`` choosing among several. An import that fails
is one napkin error naming the file, the line and the exception, not a traceback. What the
module does under ``if __name__ == "__main__":`` does not run.

This module owns every command: the stages (``kernel``, ``tune``, ``render``, the backends)
expose functions and know nothing of argparse. It is the last stop of the pipeline; nothing in
napkin imports it. Each command imports the stages it calls when it runs, so that ``napkin
check`` does not load the code generators, NumPy kernels or CUDA.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import sys
import traceback
from pathlib import Path

from .check import MAX_SIZE_TEXT, check_size
from .errors import NapkinError, Span
from .formatting import json_value
from .hardware import BUILT_OVERLAP, BUILT_OVERLAPS, DEFAULT_ARCH, OVERLAPS, gpu_archs, gpu_paths, hardware_names, load_hardware
from .kernel import Kernel, load
from .progress import Progress, wanted

EXIT_USER_ERROR = 2


def load_file(file: str | Path, hardware: str | None = None) -> dict[str, Kernel]:
    """The kernels of a file by name: a ``.napkin`` file's, or those a ``.py`` file defines."""
    path = Path(file)
    if path.suffix == ".py":
        return _load_python(path)
    return load(path, hardware=hardware)


def _load_python(path: Path) -> dict[str, Kernel]:
    """Import a Python file as a module and collect the Kernel objects it defines at module level.

    ``--hardware`` is not applied here: a decorated kernel carries its own, and the commands
    pass ``--hardware`` to each stage they call.
    """
    if not path.is_file():
        raise NapkinError(f"no such file: {path}" if not path.exists() else f"{path} is not a file",
                          hint="name a .napkin file or a Python file with @napkin.kernel functions")
    # A private module name per path: importing never replaces a module the user has (or napkin's own).
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"_napkin_file_{path.stem if path.stem.isidentifier() else 'module'}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise NapkinError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and typing look modules up while their classes are made
    sys.path.insert(0, str(path.resolve().parent))  # the file's own sibling imports, as `python FILE` finds them
    try:
        spec.loader.exec_module(module)
    except NapkinError:
        raise  # a kernel that does not check: the error already points into the file
    except SystemExit as exit_:
        raise NapkinError(f"{path} called sys.exit({exit_.code!r}) while being imported",
                          hint='napkin imports the file; put script code under if __name__ == "__main__":') from None
    except Exception as exc:  # noqa: BLE001 - any failure of the user's code is reported as theirs
        raise NapkinError(f"cannot import {path}: {type(exc).__name__}: {exc}", _failing_line(path, exc),
                          f"napkin imports the file to find its @napkin.kernel functions; `python {path}` shows the traceback") from None
    finally:
        sys.modules.pop(name, None)
        with contextlib.suppress(ValueError):  # the module may have taken its directory off sys.path itself
            sys.path.remove(str(path.resolve().parent))
    kernels: dict[str, Kernel] = {}
    for value in vars(module).values():
        if isinstance(value, Kernel):
            kernels.setdefault(value.name, value)
    if not kernels:
        raise NapkinError(f"{path} defines no napkin kernel",
                          hint="decorate a function with @napkin.kernel, or assign napkin.load(...)[NAME] to a module-level name")
    return kernels


def _failing_line(path: Path, exc: BaseException) -> Span | None:
    """Where in the file an import failed: the deepest frame in it, or a syntax error's place."""
    if isinstance(exc, SyntaxError) and exc.lineno:
        return Span(str(path), exc.lineno, max(exc.offset or 1, 1), exc.text or "")
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    if not frames:
        return None
    frame = frames[-1]
    return Span(str(path), frame.lineno or 1, 1, frame.line or "")


def _load_all(files: list[str], kernel: str | None = None, hardware: str | None = None) -> list[tuple[str, Kernel]]:
    found, names = [], []
    for file in files:
        kernels = load_file(file, hardware=hardware)
        names += list(kernels)
        for name, k in kernels.items():
            if kernel is None or name == kernel:
                found.append((file, k))
    if kernel is not None and not found:
        raise NapkinError(f"no kernel named {kernel!r} in {', '.join(files)}", hint=f"kernels there: {', '.join(names)}")
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
        **{f"{key}_flops": {unit: json_value(v) for unit, v in value.items()}
           for key, value in flops_beyond_diagram(k).items() if key != "error"},
    }


def format_check(k: Kernel) -> str:
    d = k.diagram
    summary = check_summary(k)
    lines = [f"kernel {k.signature()}"]
    lines.append("  axes: " + "  ".join(f"{name}={axis.size}" for name, axis in d.axes.items()))
    lines.append(f"  relabel: {k.relabel_text()}")
    rows = [("line", "statement", "box", "woven", "consumed", "FLOPs")]
    for s, info in zip(d.statements, summary["statements"], strict=False):
        target = f"{s.target}[{' '.join(s.axes)}]" + (f" @{s.level}" if s.level else "")
        rows.append((str(info["line"]), target, s.box.kind, " ".join(s.woven) or "-", " ".join(s.consumed) or "-", str(s.total_flops)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip())
    lines.append(f"  total FLOPs: {d.flops}")
    beyond = flops_beyond_diagram(k)
    for key, what in (("bookkeeping", "online bookkeeping of the streams"), ("recomputed", "recomputed in every group or chunk")):
        if beyond.get(key):
            lines.append(f"  {what} (napkin cost adds it): " + ", ".join(f"{unit} {v}" for unit, v in beyond[key].items()))
    if "error" in beyond:
        lines.append(f"  no pseudocode to compare FLOPs with: {beyond['error']}")
    return "\n".join(lines)


def flops_beyond_diagram(k: Kernel) -> dict:
    """What the Program (``napkin cost``) counts beyond the diagram's FLOPs (``napkin check``):
    the online bookkeeping of its streams and the work it repeats per group or chunk, by unit
    (cost.bookkeeping_flops, cost.recomputed_flops); empty without a relabel block."""
    if k.relabel is None:
        return {}
    from .cost import bookkeeping_flops, recomputed_flops

    try:
        program = k.program()
    except NapkinError as error:
        return {"error": error.message}
    return {"bookkeeping": bookkeeping_flops(program), "recomputed": recomputed_flops(program)}


def cmd_check(args) -> int:
    """Check every file, reporting each file's errors; exit 2 if any file has one."""
    kernels, failures = [], []
    for file in args.files:
        try:
            kernels += [(file, k) for _, k in _load_all([file])]
        except NapkinError as error:
            failures.append((file, error))
    if args.json:
        out: dict = {"kernels": {k.name: check_summary(k) for _, k in kernels}}
        if failures:
            out["errors"] = {file: error.to_dict() for file, error in failures}
        print(json.dumps(out, indent=2))
    else:
        for file in args.files:
            in_file = [k for f, k in kernels if f == file]
            if any(f == file for f, _ in failures):
                continue
            print(f"{file}: ok ({len(in_file)} kernel{'s' if len(in_file) != 1 else ''})")
            for k in in_file:
                print(format_check(k))
    for _, error in failures:
        print(error.render(), file=sys.stderr)
    return EXIT_USER_ERROR if failures else 0


# ---- pseudo, cost, tune, report ----------------------------------------------------------------


def _common(parser: argparse.ArgumentParser, hardware: bool = False) -> None:
    parser.add_argument("file", metavar="FILE")
    parser.add_argument("--kernel", metavar="K", help="only this kernel of the file")
    if hardware:
        parser.add_argument("--hardware", metavar="HW", help=f"a profile ({', '.join(hardware_names())}) or a .toml file")
    add_set(parser, "bind a size symbol (axis or group/stream size)")


def add_set(parser: argparse.ArgumentParser, what: str) -> None:
    """The --set option: several bindings per --set, repeatable. FILE may come before or after
    it (main moves a FILE that --set took back in front, :func:`parse_args`)."""
    parser.add_argument("--set", nargs="+", action="append", default=[], metavar="NAME=INT",
                        help=f"{what}; several per --set and repeatable, each name once (--set q=4096 d=128 --set x=8192); "
                             "before or after FILE")


def _files_out_of_set(argv: list[str]) -> list[str]:
    """``argv`` with each FILE that a ``--set`` took as one of its values moved in front of the
    subcommand's options, where argparse reads positionals.

    ``--set`` takes every value up to the next option (``nargs="+"``), so ``napkin cost --set
    q=4 FILE`` would leave no FILE. A value that is no ``NAME=INT`` and names a file (a
    ``.napkin`` or ``.py`` name, or any file that exists) is a FILE; anything else stays where
    it is, for ``--set`` to refuse with its own message.
    """
    if not argv or argv[0].startswith("-"):
        return list(argv)
    kept, files, in_set = [argv[0]], [], False
    for index, token in enumerate(argv[1:], 1):
        if token == "--":  # everything after it is positional already
            kept += argv[index:]
            break
        if token.startswith("-"):
            in_set = len(token) >= 4 and "--set".startswith(token)  # --set, or argparse's abbreviation --se
        elif in_set and "=" not in token and _names_file(token):
            files.append(token)
            continue
        kept.append(token)
    return kept[:1] + files + kept[1:]


def _names_file(token: str) -> bool:
    path = Path(token)
    if path.suffix in (".napkin", ".py"):
        return True
    try:
        return path.is_file()
    except (OSError, ValueError):  # too long for the file system, or a NUL in it: no file
        return False


def parse_sets(groups: list[list[str]]) -> dict[str, int]:
    """--set q=4096 d=128 --set x=8192 -> {"q": 4096, "d": 128, "x": 8192}; a name bound twice
    is an error (which value was meant is not for napkin to guess)."""
    sizes: dict[str, int] = {}
    for item in (entry for group in groups for entry in group):
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise NapkinError(f"--set expects NAME=INT, got {_cut(item)}", hint="e.g. --set q=4096 d=128")
        digits = value.strip().lstrip("+")
        if digits.isdigit() and len(digits) > 30:
            # Refused before int(), which Python limits to 4300 digits: the size bound is 19.
            raise NapkinError(f"--set {name}: a {len(digits):,}-digit size is larger than napkin takes: at most {MAX_SIZE_TEXT}",
                              hint=f"e.g. --set {name}=1024")
        try:
            number = int(value)
        except ValueError:
            raise NapkinError(f"--set {name}: {_cut(value)} is not an integer", hint=f"e.g. --set {name}=1024") from None
        if number <= 0:
            raise NapkinError(f"--set {name}={number}: sizes must be positive")
        check_size(f"--set {name}", number)
        if name in sizes:
            raise NapkinError(f"--set binds {name} twice: {name}={sizes[name]} and {name}={number}",
                              hint=f"bind each size once, e.g. --set {name}={number}")
        sizes[name] = number
    return sizes


def size_symbols(k: Kernel, hardware: str | None = None) -> set[str]:
    """The names ``--set`` may bind for ``k`` planned on ``hardware``: its axes, the symbolic group
    and stream sizes of its relabel block, and the symbolic capacities and bandwidths of the
    profile it plans on (the paper's ``M``, ``B_l1``)."""
    names = set(k.diagram.axes) | k.partition_symbols
    for level in load_hardware(k._target(hardware)).levels:
        for value in (level.capacity, level.bandwidth):  # a number, None, or a size expression
            names |= {symbol.name for symbol in getattr(value, "free_symbols", ())}
    return names


def check_symbols(sizes: dict[str, int], kernels: list[Kernel], hardware: str | None = None) -> dict[str, int]:
    """``sizes``, once every name in it is a size symbol of at least one of ``kernels`` (a file's
    kernels share one --set); else a :class:`NapkinError` naming the symbols there are."""
    import difflib

    known = set().union(*(size_symbols(k, hardware) for k in kernels)) if kernels else set()
    unknown = [name for name in sizes if name not in known]
    if unknown and kernels:
        name = unknown[0]
        of = " or ".join(k.name for k in kernels)
        close = difflib.get_close_matches(name, sorted(known), n=1)
        raise NapkinError(f"--set {name}={sizes[name]}: {name} is no size symbol of {of} "
                          f"(its symbols: {' '.join(sorted(known, key=_symbol_order(kernels)))})",
                          hint=f"did you mean {close[0]}?" if close else "bind an axis, or a symbolic group or stream size")
    return sizes


def _symbol_order(kernels: list[Kernel]):
    """Axes in the kernels' order first (b h q x d reads as the signature does), then the rest by name."""
    axes = list(dict.fromkeys(a for k in kernels for a in k.diagram.axes))
    return lambda name: (axes.index(name), "") if name in axes else (len(axes), name)


def _positive_count(text: str) -> int:
    """An argparse type: a count of 1 or more (``--top``)."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive count, got {_cut(text)}") from None
    if count <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive count (1 or more), got {count}")
    return count


def _cut(text: str) -> str:
    """A command-line value as messages quote it: long ones cut, with their length."""
    return repr(text) if len(text) <= 80 else f"{text[:60]!r}... ({len(text):,} characters)"


def _selected(args) -> list[Kernel]:
    return [k for _, k in _load_all([args.file], args.kernel, getattr(args, "hardware", None))]


def cost_json(k: Kernel, hardware: str | None, sizes: dict, path: str | None = None, arch: str | None = None,
              overlap: str | None = None) -> dict:
    return k.cost(hardware, path=path, arch=arch, overlap=overlap, **sizes).to_dict()


def cmd_pseudo(args) -> int:
    sizes = parse_sets(args.set)
    kernels = _selected(args)
    check_symbols(sizes, kernels, args.hardware)
    for k in kernels:
        print(k.pseudocode(args.format, args.hardware, **sizes), end="")
    return 0


def cmd_grad(args) -> int:
    sizes = parse_sets(args.set)
    kernels = [k for _, k in _load_all([args.file], args.kernel, None)]
    check_symbols(sizes, kernels)
    sum_dq = False if args.deterministic else True if args.atomic else None
    for i, k in enumerate(kernels):
        bound = {a: n for a, n in sizes.items() if a in k.diagram.axes}
        backward = k.grad(rewrite_d=True if args.rewrite_d else None, sum_dq=sum_dq, **bound)
        print(("\n" if i else "") + backward.source, end="")
        if set(k.diagram.axes) <= set(bound):
            print("".join(f"{line}\n" for line in _backward_price(k, backward, bound)), end="")
            print("".join(f"{line}\n" for line in _other_dq_choice(k, backward, bound, args.rewrite_d)), end="")
    return 0


def _other_dq_choice(forward, backward, sizes: dict, rewrite_d: bool) -> list[str]:
    """The price of the dQ choice not taken (Kernel.grad's ``sum_dq``), the model's best backward
    with it, as comment lines: the deterministic launch beside the atomic sums, or the atomic
    sums beside it; none where the backward has no key launch that can sum dQ."""
    keyed = backward.derivation.schedule
    if keyed is None:
        return []
    other = forward.grad(rewrite_d=True if rewrite_d else None, sum_dq=not keyed.summed, **sizes)
    if other.derivation.schedule is None or bool(other.derivation.schedule.summed) == bool(keyed.summed):
        return []
    names = ", ".join(keyed.query_outputs)
    what = (f"deterministic: {names} in a launch of its own, recomputing what it reads" if keyed.summed
            else f"{names} summed over the groups of {keyed.keys} by atomic adds, in the key launch")
    how = "--deterministic picks it" if keyed.summed else "--atomic picks it"
    return [f"# the other choice ({what}; {how}):"] + _backward_price(forward, other, sizes)


def _backward_price(forward, backward, sizes: dict) -> list[str]:
    """The derived backward's predicted time and throughput, as comment lines: in napkin's own
    FLOPs (what the backward computes), and for an attention-shaped forward in FlashAttention's
    convention (2.5 times the forward's products), which published backward rows use."""
    from .grad import FLASH_BACKWARD_FACTOR, flash_backward_flops

    at = " ".join(f"{a}={n}" for a, n in sizes.items())
    try:
        report = backward.cost(**sizes)
    except NapkinError as why:  # the derived relabelling does not fit these sizes: the text stands, unpriced
        reason = re.sub(r"^(.*?:\d+:\d+: )?error: ", "", str(why).splitlines()[0])
        return [f"# not priced at {at}: {reason}"]
    seconds, flops = report.time["overlapped_s"], float(report.total_flops)
    lines = [f"# priced on {report.hardware} at {at}: {seconds * 1e3:.3g} ms, "
             f"{flops / seconds / 1e12:.0f} TFLOP/s in napkin's FLOPs ({flops / 1e12:.4g} TFLOP, what it computes)"]
    flash = flash_backward_flops(forward.diagram, sizes)
    if flash is not None:
        lines.append(f"#   {flash / seconds / 1e12:.0f} TFLOP/s in FlashAttention's convention ({FLASH_BACKWARD_FACTOR}x the "
                     f"forward's products: {flash / 1e12:.4g} TFLOP), as published backward rows count it")
    return lines


def cmd_cost(args) -> int:
    sizes = parse_sets(args.set)
    kernels = _selected(args)
    check_symbols(sizes, kernels, args.hardware)
    if args.hardware is not None and args.arch is not None:
        load_hardware(args.hardware).check_arch(args.arch)  # before any kernel is planned
    if args.json:
        print(json.dumps({"kernels": {k.name: cost_json(k, args.hardware, sizes, args.path, args.arch, args.overlap)
                                      for k in kernels}}, indent=2))
        return 0
    for k in kernels:
        print(k.cost(args.hardware, path=args.path, arch=args.arch, overlap=args.overlap, **sizes).table())
    return 0


def cmd_tune(args) -> int:
    sizes = parse_sets(args.set)
    results = {}
    kernels = _selected(args)
    check_symbols(sizes, kernels, args.hardware)
    for k in kernels:
        with Progress(f"tune {k.name}", enabled=wanted(args.json)) as progress:
            result = k.tune(args.hardware, top=args.top, progress=progress, **sizes)
        results[k.name] = result
        if not args.json:
            print(result.table())
            print("as a relabel block:")
            print(result.relabel_block())
    _use_tuned(args, results)
    if args.json:
        print(json.dumps({"kernels": {name: r.to_dict() for name, r in results.items()}}, indent=2))
    return 0


def _use_tuned(args, results: dict) -> None:
    """napkin tune --write FILE (the tuned copy of the source) and --plot FILE.svg."""
    from .tune import plot_svg, write_tuned

    if args.write:
        kernels = {k.name: k for k in _selected(args)}
        if len(results) != 1:
            raise NapkinError(f"--write writes one tuned kernel; {args.file} has {', '.join(results)}",
                              hint="choose one with --kernel NAME")
        (name, result), = results.items()
        write_tuned(kernels[name], result, args.write)
        if not args.json:
            print(f"wrote {args.write}")
    if args.plot:
        svgs = [plot_svg(result) for result in results.values()]
        try:
            Path(args.plot).write_text(svgs[0] if len(svgs) == 1 else _stacked(svgs), encoding="utf-8")
        except OSError as error:
            raise NapkinError(f"cannot write {args.plot}: {error.strerror or error}") from None
        if not args.json:
            print(f"wrote {args.plot}")


def _stacked(svgs: list[str]) -> str:
    """Several SVG documents one above the other (a file with several kernels)."""
    import re

    heights = [int(re.search(r'height="(\d+)"', svg).group(1)) for svg in svgs]
    widths = [int(re.search(r'width="(\d+)"', svg).group(1)) for svg in svgs]
    inner, y = [], 0
    for svg, height in zip(svgs, heights, strict=False):
        inner.append(svg.replace("<svg ", f'<svg y="{y}" ', 1))
        y += height
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{max(widths)}" height="{y}">\n' + "".join(inner) + "</svg>\n"


def cmd_compare(args) -> int:
    """Files and relabellings side by side: time, bound, H and M per level."""
    from .tune import compare, compare_table

    sizes = parse_sets(args.set)
    entries = []
    found = _load_all(args.files, args.kernel, args.hardware)
    per_file = collections.Counter(file for file, _ in found)  # without --kernel: every kernel of the file
    for file, k in found:
        label = f"{file}:{k.name}" if len(args.files) > 1 or args.kernel is None and per_file[file] > 1 else file
        entries.append((label, k))
        for index, text in enumerate(args.relabel, 1):
            entries.append((f"{label} relabel {index}", k.relabelled(text)))
    check_symbols(sizes, [k for _, k in entries], args.hardware)
    columns = compare(entries, args.hardware, sizes)
    if args.json:
        print(json.dumps({"columns": columns}, indent=2))
    else:
        print(compare_table(columns))
    return 0


def cmd_report(args) -> int:
    from .backends.cuda import report_resources
    from .backends.numpy import report_check

    sizes = parse_sets(args.set)
    kernels = _selected(args)
    check_symbols(sizes, kernels, args.hardware)
    print(f"{args.file}: {len(kernels)} kernel{'s' if len(kernels) != 1 else ''}")
    failed = False
    for k in kernels:
        hardware = k._target(args.hardware)
        print()
        print(format_check(k))
        print()
        print(k.pseudocode("text", hardware, **sizes), end="")
        print()
        print(k.cost(hardware, **sizes).table())
        if not any(s.box.kind == "opaque" for s in k.diagram.statements):
            print()
            print(report_resources(k, sizes))
        # The same kernel run at small sizes: NumPy against the reference, counts against the report.
        with Progress(f"run {k.name} (report)", enabled=wanted()):
            text, passed = report_check(k, hardware)
        print()
        print(text)
        failed = failed or not passed
    return 1 if failed else 0


# ---- napkin run --------------------------------------------------------------------------------


def cmd_run(args) -> int:
    from .backends import numpy as numpy_backend

    given = parse_sets(args.set)
    kernels = _selected(args)
    check_symbols(given, kernels, args.hardware)
    opaque = {k.name: numpy_backend.opaque_boxes(k.diagram) for k in kernels if numpy_backend.opaque_boxes(k.diagram)}
    if opaque:
        named = "; ".join(f"{name} uses opaque box {', '.join(boxes)}" for name, boxes in opaque.items())
        runnable = [k.name for k in kernels if k.name not in opaque]
        raise NapkinError(
            f"napkin run cannot run kernels with opaque boxes without implementations: {named}",
            hint=("call them from Python with impls={'BOX': function}"
                  + (f"; run the others with --kernel ({', '.join(runnable)})" if runnable else "")),
        )
    backend = args.backend
    if backend == "auto":
        from .backends.driver import cuda_available

        backend = "cuda" if cuda_available() else "numpy"
    if args.arch is not None:
        if backend != "opencl":
            raise NapkinError(f"--arch {args.arch} applies to --backend opencl, not {backend}",
                              hint="the OpenCL emulation prints the instruction paths of --arch; the cuda backend compiles "
                                   "for the GPU it runs on (the profile's arch where that GPU runs it), and numpy runs the Program itself")
        for k in kernels:
            load_hardware(k._target(args.hardware)).check_arch(args.arch)
    if args.emulate_seed is not None:
        if backend != "opencl":
            raise NapkinError(f"--emulate-seed applies to --backend opencl, not {backend}",
                              hint="the seed draws when the OpenCL emulation lands a warp-specialized kernel's copies and products")
        os.environ["NAPKIN_EMULATE_SEED"] = str(args.emulate_seed)  # read where the emulation is built (opencl.roles_seed)
    if args.devices is not None:
        return _run_devices(args, kernels, given, backend)
    results = {}
    for k in kernels:
        try:
            with Progress(f"run {k.name} on {backend}", enabled=wanted(args.json)) as progress:  # drawn on a terminal after ~1 s
                results[k.name] = numpy_backend.check_run(k, args.hardware, given, args.seed, backend, progress=progress,
                                                          arch=args.arch)
        except NotImplementedError as error:  # a backend that is not written yet: the user's choice, not a napkin bug
            raise NapkinError(str(error), hint="use --backend numpy") from None
        if not args.json:
            print(numpy_backend.format_check(k.name, results[k.name]))
    if args.json:
        keys = ("max_abs_error", "max_rel_error", "rounded_outputs", "unrounded_rel_error", "counted", "predicted", "wall_s",
                "tolerance", "ok", "sizes", "hardware", "backend", "accuracy")
        print(json.dumps({"kernels": {name: {key: r[key] for key in keys} for name, r in results.items()}}, indent=2))
    return 0 if all(r["ok"] for r in results.values()) else 1


def _run_devices(args, kernels, given: dict, backend: str) -> int:
    """``napkin run --devices N``: each kernel across N processes (backends/distributed.py)."""
    from .backends import distributed
    from .backends import numpy as numpy_backend

    if backend not in ("numpy", "opencl"):
        raise NapkinError(f"--devices runs on --backend numpy or opencl, not {backend}",
                          hint="NCCL on GPUs: call kernel.distributed() inside a torchrun job")
    results = {}
    for k in kernels:
        sizes = numpy_backend.default_sizes(k, given)
        try:
            results[k.name] = r = distributed.launch(k, args.devices, args.hardware, sizes, args.seed, backend)
        except NotImplementedError as error:
            raise NapkinError(str(error), hint="use --backend numpy") from None
        if not args.json:
            print(f"{k.name} on {r['devices']} processes ({r['hardware']}, {r['partition']}, {r['parts']} parts, {backend}): "
                  f"max relative error {r['max_rel_error']:.3g} (tolerance {r['tolerance']:.3g}) "
                  f"{'ok' if r['ok'] else 'FAILED'}; sent {r['transfers']:,} bytes between processes, "
                  f"model NVLink H {r['predicted_transfers']:,}")
            if r["chosen"]:
                print(f"  {r['chosen']}")
    if args.json:
        print(json.dumps({"kernels": results}, indent=2))
    ok = all(r["ok"] and r["transfers"] == r["predicted_transfers"] for r in results.values())
    return 0 if ok else 1


def add_run_command(subparsers) -> None:
    run = subparsers.add_parser(
        "run", help="run kernels on seeded random inputs; compare with the reference and the cost report",
        description="Run each kernel of FILE on seeded random inputs, compare its outputs with the float64 reference "
                    "and its counted transfers and FLOPs with the cost report. Exit 1 when an error (relative to the largest "
                    "reference value) exceeds the tolerance read off the Program, or a count differs: twice the unit roundoff "
                    "of every dtype a value is rounded to (bf16 2^-7, f16 2^-10, ...), times the magnitude of any exponential "
                    "argument that value reaches (sqrt of the lengths summed into it), plus the compute dtype's own error "
                    "(at least 1e-5 for f32). Unset axes get small sizes: an axis partitioned by s "
                    "gets s + s/2 + 3 (two tiles, one masked), others 64. A quantized kernel (an fp8 input) also reports "
                    "each output's RMSE and max error against the float64 reference of the inputs before rounding, beside "
                    "the same kernel's with its fp8 types declared bf16. In --json, FLOPs (the total) are under the compute level.",
    )
    run.add_argument("file", metavar="FILE")
    run.add_argument("--kernel", metavar="K", help="only this kernel of the file")
    run.add_argument("--backend", choices=["numpy", "cuda", "opencl", "auto"], default="numpy")
    run.add_argument("--hardware", metavar="HW", help=f"a profile ({', '.join(hardware_names())}) or a .toml file")
    run.add_argument("--arch", help="with --backend opencl: emulate the code built for this architecture, one the profile "
                                    "runs (sm_90a: wgmma where selection takes it; sm_90: mma.sync); default: the profile's own")
    add_set(run, "bind a size (axis or group/stream size)")
    run.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    run.add_argument("--emulate-seed", type=_positive_count, metavar="N",
                     help="with --backend opencl: the seed of the roles emulation's adversary, which draws the round each "
                          "TMA copy and wgmma group of a warp-specialized kernel lands in (NAPKIN_EMULATE_SEED; default 1)")
    run.add_argument("--devices", type=_positive_count, metavar="N",
                     help="run across N processes (torch.distributed, gloo) as the GPUs of a node profile (--hardware H100x8): "
                          "the relabel block's gmem clause, else napkin's best partition for N; rank 0 compares")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    run.set_defaults(run=cmd_run)


# ---- napkin cuda -------------------------------------------------------------------------------


def cmd_cuda(args) -> int:
    from .backends.cuda import format_resources, resources_json
    from .cache import write_atomically

    sizes = parse_sets(args.set)
    if args.hardware is not None and args.arch is not None:
        load_hardware(args.hardware).check_arch(args.arch)  # before any kernel is loaded or planned
    results = {}
    kernels = _selected(args)
    check_symbols(sizes, kernels, args.hardware)
    for kernel in kernels:
        compiled = kernel.compile(args.arch, args.hardware, ptx=args.ptx, synchronous=args.synchronous, overlap=args.overlap,
                                  **sizes)
        results[kernel.name] = compiled
        text = compiled.image.rstrip(b"\0").decode() if args.ptx else compiled.source
        if args.output:
            write_atomically(args.output, text.encode())
        elif not args.resources and not args.sass:
            sys.stdout.write(text)
    if args.sass:
        # Imported here: nvdisasm is an optional extra, and only --sass needs it.
        from .backends.sass import format_sass_report, sass_report

        reports = {name: sass_report(c) for name, c in results.items()}
        if args.json:
            kernels = {name: ({**resources_json(results[name]), "sass": report} if args.resources else report)
                       for name, report in reports.items()}
            print(json.dumps({"kernels": kernels}, indent=2))
            return 0
        for name, report in reports.items():
            if args.resources:
                print(format_resources(results[name]))
            print(format_sass_report(report))
        return 0
    if args.resources:
        if args.json:
            print(json.dumps({"kernels": {name: resources_json(c) for name, c in results.items()}}, indent=2))
        else:
            for compiled in results.values():
                print(format_resources(compiled))
    return 0


def add_cuda_command(subparsers) -> None:
    cuda = subparsers.add_parser("cuda", help="generate CUDA C++ and compile it with NVRTC (no GPU needed)")
    _common(cuda, hardware=True)
    cuda.add_argument("--arch", help=f"the GPU architecture to compile for, one the profile runs ({gpu_archs()}); "
                                     f"default: the profile's own (without --hardware, the relabel block's GPU's, else {DEFAULT_ARCH})")
    cuda.add_argument("-o", "--output", metavar="FILE.cu", help="write the source (or PTX) here instead of stdout")
    cuda.add_argument("--ptx", action="store_true", help="emit PTX instead of the CUDA source")
    cuda.add_argument("--synchronous", action="store_true",
                      help="sm_90a: build wgmma launches on the synchronous ring, without the producer and consumer "
                           "warpgroups (the build to compare the roles with)")
    cuda.add_argument("--overlap", metavar="SCHEDULE", choices=list(BUILT_OVERLAPS),
                      help=f"sm_90a: the consumer warpgroups' schedule to build ({', '.join(BUILT_OVERLAPS)}; pipelined: "
                           "FlashAttention-3's intra-warpgroup pipeline, pingpong: its warpgroups' turns on the tensor cores, "
                           f"each where a launch takes it); default {BUILT_OVERLAP}")
    cuda.add_argument("--resources", action="store_true", help="print registers, shared memory and spills per launch")
    cuda.add_argument("--sass", action="store_true",
                      help="disassemble the cubin (nvdisasm) and print instruction classes per launch and innermost loop, "
                           "and each launch's static ceiling: its hot loop's clocks per resource, the binding one, "
                           "and the TFLOP/s it allows beside the model's")
    cuda.add_argument("--json", action="store_true", help="with --resources or --sass: one JSON object")
    cuda.set_defaults(run=cmd_cuda)


# ---- napkin cache clear ------------------------------------------------------------------------


def cmd_cache_clear(args) -> int:
    from .backends.nvrtc import clear_cache
    from .cache import cache_root

    removed = clear_cache(headers=args.headers)
    print(f"removed {removed} file{'s' if removed != 1 else ''} from {cache_root()}")
    return 0


def add_cache_command(subparsers) -> None:
    cache = subparsers.add_parser("cache", help="manage napkin's on-disk cache of compiled kernels")
    actions = cache.add_subparsers(dest="cache_command", required=True)
    clear = actions.add_parser("clear", help="remove every cached compiled kernel")
    clear.add_argument("--headers", action="store_true", help="also remove the CUDA headers NVRTC extracted")
    clear.set_defaults(run=cmd_cache_clear)


# ---- napkin draw -------------------------------------------------------------------------------


def cmd_draw(args) -> int:
    from .cache import write_atomically
    from .render import render

    sizes = parse_sets(args.set)
    if sizes and not args.costs:
        raise NapkinError("--set binds the sizes the cost rows are read at; without --costs nothing is drawn at sizes",
                          hint="add --costs, or drop --set")
    kernels = load_file(args.file, hardware=args.hardware)  # a .napkin file, or a .py file's @napkin.kernel functions
    if args.kernel is not None:
        if args.kernel not in kernels:
            raise NapkinError(f"no kernel named {args.kernel!r} in {args.file}", hint=f"kernels there: {', '.join(kernels)}")
        kernel = kernels[args.kernel]
    elif len(kernels) == 1:
        kernel = next(iter(kernels.values()))
    else:
        raise NapkinError(f"{args.file} has {len(kernels)} kernels; say which to draw",
                          hint=f"add --kernel NAME, one of: {', '.join(kernels)}")
    check_symbols(sizes, [kernel], args.hardware)
    svg = render(kernel, relabelled=args.relabelled, costs=args.costs, hardware=args.hardware if args.costs else None, sizes=sizes)
    if args.output is None:
        sys.stdout.write(svg)
    else:
        write_atomically(Path(args.output), svg.encode("utf-8"))
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def add_draw_command(subparsers) -> None:
    """``napkin draw FILE [--kernel K] [--relabelled] [--costs [--hardware HW] [--set NAME=INT ...]] [-o OUT.svg]``."""
    draw = subparsers.add_parser("draw", help="draw a kernel's neural circuit diagram as SVG")
    draw.add_argument("file", metavar="FILE")
    draw.add_argument("--kernel", metavar="K", help="the kernel to draw when the file has several")
    draw.add_argument("--relabelled", action="store_true", help="mark the relabel block's group and stream partitions")
    draw.add_argument("--costs", action="store_true",
                      help="add rows of memory M and transfers H per column, read off the pseudocode at the compute level")
    draw.add_argument("--hardware", metavar="HW",
                      help=f"a profile ({', '.join(hardware_names())}) or a .toml file: the levels drawn for a "
                           "kernel without a relabel block, and where --costs are read; default: the relabel block's")
    add_set(draw, "with --costs: bind sizes (axes, symbolic group/stream sizes) so that the rows are numbers")
    draw.add_argument("-o", "--output", metavar="OUT.svg", help="write the SVG to a file (atomically) instead of stdout")
    draw.set_defaults(run=cmd_draw)


# ---- entry point -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="napkin", description="Neural circuit diagrams as GPU kernels.")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="check diagrams: axes, sizes, dtypes, levels, FLOPs")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(run=cmd_check)

    pseudo = sub.add_parser("pseudo", help="the paper's looped pseudocode of a relabelled kernel")
    _common(pseudo, hardware=True)
    pseudo.add_argument("--format", choices=["text", "markdown"], default="text")
    pseudo.set_defaults(run=cmd_pseudo)

    grad = sub.add_parser("grad", help="the backward kernel, derived from the diagram, as napkin text")
    grad.add_argument("file", metavar="FILE")
    grad.add_argument("--kernel", metavar="K", help="the kernel of the file to differentiate (default: every kernel)")
    grad.add_argument("--rewrite-d", action="store_true",
                      help="compute a softmax's row sum as FA2's D = sum[d](dO * O), from the saved output")
    summed = grad.add_mutually_exclusive_group()
    summed.add_argument("--deterministic", action="store_true",
                        help="compute dQ in a launch of its own, which recomputes what it reads, instead of summing it "
                             "over the key groups by atomic adds (whose order varies from run to run)")
    summed.add_argument("--atomic", action="store_true",
                        help="sum dQ over the key groups by atomic adds in the key launch (five products, its order of "
                             "adds varying from run to run), where the model would pick the deterministic launch")
    add_set(grad, "bind an axis; with every axis bound, the model picks FA2's D or not, the key launch's "
                  "query chunk and how dQ is summed (Kernel.backward_options), and prices the other dQ choice")
    grad.set_defaults(run=cmd_grad)

    cost = sub.add_parser("cost", help="transfers H, memory M, groups N, FLOPs and predicted time per level")
    _common(cost, hardware=True)
    cost.add_argument("--json", action="store_true", help="print one JSON object")
    # No fixed choices: the profile says which instructions it has (a user's .toml may list others),
    # and cost_of refuses one it lacks, naming those it has.
    cost.add_argument("--path", metavar="INSTRUCTION",
                      help=f"price the tensor-core launches on this instruction, one the profile lists ({gpu_paths()}); "
                           "a what-if: napkin builds what --arch selects")
    cost.add_argument("--arch", help=f"price the code built for this architecture, one the profile runs ({gpu_archs()}; "
                                     "sm_90a: wgmma where selection takes it; sm_90: mma.sync); default: the profile's own")
    cost.add_argument("--overlap", metavar="SCHEDULE", choices=list(OVERLAPS),
                      help=f"build and price the wgmma warpgroups under this schedule ({', '.join(OVERLAPS)}; "
                           "pingpong+pipelined: FlashAttention-3's), each part where a launch takes it (the notes say "
                           "which does not)")
    cost.set_defaults(run=cmd_cost)

    tune = sub.add_parser("tune", help="choose group/stream sizes minimising predicted time")
    _common(tune, hardware=True)
    tune.add_argument("--top", type=_positive_count, default=5, help="how many configurations to show (1 or more)")
    tune.add_argument("--json", action="store_true", help="print one JSON object")
    tune.add_argument("--write", metavar="FILE", help="write a copy of the source with the tuned relabel block (and @gmem) to FILE")
    tune.add_argument("--plot", metavar="FILE.svg", help="draw predicted time against the tile sizes searched")
    tune.set_defaults(run=cmd_tune)

    compare = sub.add_parser("compare", help="files and relabellings side by side: time, bound, H and M per level")
    compare.add_argument("files", nargs="+", metavar="FILE")
    compare.add_argument("--kernel", metavar="K", help="only this kernel of each file")
    gpus = ", ".join(name for name in hardware_names() if load_hardware(name).archs)
    compare.add_argument("--hardware", metavar="HW", help=f"a GPU profile ({gpus}) or a .toml file")
    compare.add_argument("--relabel", action="append", default=[], metavar="TEXT",
                         help="also cost each kernel with this relabelling (clause lines, or a whole block); repeatable")
    add_set(compare, "bind a size symbol")
    compare.add_argument("--json", action="store_true", help="print one JSON object")
    compare.set_defaults(run=cmd_compare)

    report = sub.add_parser("report", help="check, relabel, pseudocode and cost table of every kernel in a file")
    _common(report, hardware=True)
    report.set_defaults(run=cmd_report)
    add_cache_command(sub)
    add_cuda_command(sub)
    add_draw_command(sub)
    add_run_command(sub)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line parsed, with FILE accepted before or after ``--set`` (:func:`_files_out_of_set`)."""
    return build_parser().parse_args(_files_out_of_set(list(sys.argv[1:] if argv is None else argv)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return args.run(args)
    except NapkinError as error:
        if getattr(args, "json", False):
            print(json.dumps(error.to_dict(), indent=2))
        print(error.render(), file=sys.stderr)
        return EXIT_USER_ERROR
    except NotImplementedError as error:  # what napkin does not build yet, named: a refusal, not a crash
        refusal = NapkinError(str(error))
        if getattr(args, "json", False):
            print(json.dumps(refusal.to_dict(), indent=2))
        print(refusal.render(), file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
