"""Kernel objects, the ``@napkin.kernel`` decorator and ``napkin.load``.

A :class:`Kernel` is a checked diagram plus what the user said about running it (the
relabel block, the hardware). It is the entry point to every later stage: pseudocode,
cost, tuning, running.

Two ways in, one checker:

* ``napkin.load("examples/attention.napkin")`` (or the text itself) returns the kernels of a
  file by name;
* ``@napkin.kernel`` turns a Python function into a kernel: its annotations give the
  parameters and outputs, its docstring the statements (and optionally a relabel block).
  Mistakes raise :class:`~napkin_dsl.errors.NapkinError` when the function is defined, with
  line numbers in the Python file.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path
from typing import Any, Callable

from typeguard import typechecked

from . import syntax as syn
from .check import CheckedKernel, check_module
from .errors import NapkinError, NapkinSyntaxError, Span
from .types import _ArrayTypeMeta, _DTypeMeta


class Kernel:
    """A checked napkin kernel.

    ``diagram`` is the typed diagram, ``source`` the text it came from, ``relabel`` the
    relabel block (syntax) or None, ``hardware`` the profile name it targets.
    """

    def __init__(self, checked: CheckedKernel, hardware: str | None = None, function: Callable | None = None):
        self._checked = checked
        self.diagram = checked.diagram
        self.name = checked.diagram.name
        self.source = checked.source
        self.file = checked.file
        self.relabel = checked.relabel
        self.hardware = checked.relabel.hardware if checked.relabel is not None else hardware
        self.function = function
        self._cache: dict = {}
        if function is not None:
            self.__doc__ = function.__doc__
            self.__wrapped__ = function

    def signature(self) -> str:
        d = self.diagram
        params = []
        for name in d.params:
            if name in d.arrays:
                array = d.arrays[name]
                params.append(f"{name}: {array.dtype}[{' '.join(array.axes)}]")
            else:
                params.append(f"{name}: {d.scalars[name].dtype}")
        outputs = [f"{name}: {d.arrays[name].dtype}[{' '.join(d.arrays[name].axes)}]" for name in d.outputs]
        return f"{self.name}({', '.join(params)}) -> {', '.join(outputs)}"

    def relabel_text(self) -> str:
        if self.relabel is None:
            return "no relabelling"
        clauses = []
        for level in self.relabel.levels:
            kinds: dict[str, list[str]] = {}
            for p in level.partitions:
                kinds.setdefault(p.kind, []).append(f"{p.axis} {p.size}")
            clauses.append(f"{level.level}: " + "; ".join(f"{k} {', '.join(v)}" for k, v in kinds.items()))
        return f"on {self.relabel.hardware}" + (": " + " | ".join(clauses) if clauses else "")

    # -- later stages
    def _target(self, hardware: str | None) -> str:
        """The hardware to plan for: given, else the relabel block's, else the first profile
        (the paper's two_level first, then the GPUs) that has every ``@level`` the kernel names."""
        if hardware or self.hardware:
            return hardware or self.hardware
        from .hardware import load_hardware

        named = {s.level for s in self.diagram.statements if s.level}
        for candidate in ("two_level", "H100", "A100", "H200", "three_level"):
            if named <= set(load_hardware(candidate).level_names()):
                return candidate
        return "two_level"

    def program(self, hardware: str | None = None, **sizes: int):
        """The elaborated pseudocode (:class:`~napkin_dsl.pseudocode.Program`) on a hardware profile."""
        from .plan import plan

        key = ("program", self._target(hardware), tuple(sorted(sizes.items())))
        if key not in self._cache:
            self._cache[key] = plan(self.diagram, self._target(hardware), self.relabel, _check_sizes(sizes))
        return self._cache[key]

    def pseudocode(self, format: str = "text", hardware: str | None = None, **sizes: int) -> str:
        """The paper's looped pseudocode as text (``format="text"``) or a Markdown table of columns."""
        from .pseudocode import render_markdown, render_text

        program = self.program(hardware, **sizes)
        if format == "markdown":
            return render_markdown(program)
        if format == "text":
            return render_text(program)
        raise NapkinError(f"unknown pseudocode format {format!r}", hint="use 'text' or 'markdown'")

    def cost(self, hardware: str | None = None, **sizes: int):
        """The :class:`~napkin_dsl.cost.CostReport` read off the pseudocode; raises if a level overflows."""
        from .cost import cost_of

        return cost_of(self.program(hardware, **sizes))

    def tune(self, hardware: str | None = None, top: int = 5, **sizes: int):
        """Group/stream sizes minimising predicted time on ``hardware`` (a :class:`~napkin_dsl.tune.TuneResult`)."""
        from .tune import tune

        return tune(self.diagram, self._target(hardware), self.relabel if (self.relabel is None or hardware in (None, self.hardware)) else None,
                    _check_sizes(sizes), top=top)

    def render(self, relabelled: bool = False, costs: bool = False) -> str:
        """The kernel's neural circuit diagram as SVG text (see :func:`napkin_dsl.render.render`)."""
        from .render import render

        return render(self, relabelled=relabelled, costs=costs)

    def _repr_svg_(self) -> str:
        return self.render()

    def __repr__(self) -> str:
        n = len(self.diagram.statements)
        return f"<napkin kernel {self.signature()}, {n} statement{'s' if n != 1 else ''}, {self.relabel_text()}>"


def _check_sizes(sizes: dict) -> dict:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise NapkinError(f"size {name}={value!r} must be a positive integer", hint=f"e.g. {name}=1024")
    return dict(sizes)


# ---- loading files ---------------------------------------------------------------------------


def _read_source(path_or_text: str | Path) -> tuple[str, str]:
    """(text, file name) for a path or for source text itself."""
    if isinstance(path_or_text, Path) or (
        isinstance(path_or_text, str) and "\n" not in path_or_text and (path_or_text.endswith(".napkin") or Path(path_or_text).is_file())
    ):
        path = Path(path_or_text)
        if not path.exists():
            raise NapkinError(f"no such file: {path}", hint="check the path; napkin files end in .napkin")
        if path.is_dir():
            raise NapkinError(f"{path} is a directory, not a napkin file")
        data = path.read_bytes()
        try:
            return data.decode("utf-8"), str(path)
        except UnicodeDecodeError as exc:
            raise NapkinSyntaxError(
                f"{path}: not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x})",
                hint="napkin files are UTF-8 text; is this the right file?",
            ) from None
    return path_or_text, "<string>"


@typechecked
def load(path_or_text: str | Path, *, hardware: str | None = None) -> dict[str, Kernel]:
    """The kernels of a napkin file (or of napkin text), by name, in file order.

    >>> kernels = load("kernel twice(X: f32[n]) -> Y: f32[n]:\\n    Y[n] = X * 2\\n")
    >>> kernels["twice"]
    <napkin kernel twice(X: f32[n]) -> Y: f32[n], 1 statement, no relabelling>
    """
    text, file = _read_source(path_or_text)
    module = syn.parse(text, file)
    checked = check_module(module, hardware=hardware)
    return {name: Kernel(kernel, hardware) for name, kernel in checked.items()}


# ---- the decorator -----------------------------------------------------------------------------


def _annotation_type(annotation: Any, name: str, span: Span) -> syn.TypeSyntax:
    if isinstance(annotation, _ArrayTypeMeta):
        return syn.TypeSyntax(annotation.dtype, tuple(annotation.axes), span)
    if isinstance(annotation, _DTypeMeta):
        return syn.TypeSyntax(annotation.dtype, None, span)
    raise NapkinError(
        f"parameter {name!r} needs a napkin type annotation, got {annotation!r}",
        span,
        f'annotate it like {name}: napkin.f32["q d"] (an array) or {name}: napkin.f32 (a scalar)',
    )


def _docstring_position(function: Callable) -> tuple[str, int, int, int]:
    """(file, line of the def, line offset of the docstring, column offset of its first line)."""
    try:
        file = inspect.getsourcefile(function) or "<unknown>"
        lines, first_line = inspect.getsourcelines(function)
    except (OSError, TypeError):
        return "<unknown>", 1, 0, 0
    tree = ast.parse(textwrap.dedent("".join(lines)))
    node = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    indent = len(lines[0]) - len(lines[0].lstrip())
    def_line = first_line + node.lineno - 1
    if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
        doc = node.body[0].value
        # The docstring starts after its opening quotes; napkin ignores indentation, so the
        # raw docstring parses as is and its line numbers map straight into the file.
        quote_line = lines[doc.lineno - 1]
        quote_column = doc.col_offset + indent
        quote_len = 3 if quote_line[quote_column - indent:].lstrip("rRbBuU").startswith(('"""', "'''")) else 1
        prefix_len = len(quote_line[quote_column - indent:]) - len(quote_line[quote_column - indent:].lstrip("rRbBuU"))
        return file, def_line, first_line + doc.lineno - 2, quote_column + prefix_len + quote_len
    return file, def_line, def_line - 1, 0


def _build(function: Callable, hardware: str | None, relabel: str | None) -> Kernel:
    doc = function.__doc__
    file, def_line, line_offset, column_offset = _docstring_position(function)
    def_span = Span(file, def_line, 1, "")
    if not doc or not doc.strip():
        raise NapkinError(f"kernel {function.__name__!r} has no docstring", def_span,
                          "write the diagram's statements in the function's docstring")
    body = syn.parse(doc, file, start="body", line_offset=line_offset, first_column_offset=column_offset)
    try:
        # eval_str resolves annotations written under `from __future__ import annotations`.
        signature = inspect.signature(function, eval_str=True)
    except Exception as exc:
        raise NapkinError(f"cannot evaluate the annotations of {function.__name__!r}: {exc}", def_span) from None
    params = tuple(
        syn.Param(name, _annotation_type(p.annotation, name, def_span), def_span) for name, p in signature.parameters.items()
    )
    returned = signature.return_annotation
    if returned is inspect.Signature.empty:
        raise NapkinError(f"kernel {function.__name__!r} needs a return annotation", def_span,
                          'annotate the result, e.g. -> napkin.f32["q d"], or name several: -> {"O": ..., "L": ...}')
    if isinstance(returned, dict):
        outputs = tuple(syn.Param(n, _annotation_type(a, n, def_span), def_span) for n, a in returned.items())
    else:
        if not body.statements:
            raise NapkinError(f"kernel {function.__name__!r} has no statements", def_span, "write them in the docstring")
        last = body.statements[-1].target
        outputs = (syn.Param(last, _annotation_type(returned, "return", def_span), def_span),)
    kdef = syn.KernelDef(function.__name__, params, outputs, body.statements, def_span)
    relabels = tuple(body.relabels)
    if relabel is not None:
        if relabels:
            raise NapkinError(f"kernel {function.__name__!r} has a relabel block in its docstring and a relabel= argument",
                              def_span, "keep one of them")
        if hardware is None:
            raise NapkinError("relabel= needs hardware= to say which levels it names", def_span, 'add hardware="H100"')
        text = f"relabel {function.__name__} on {hardware}:\n" + textwrap.indent(textwrap.dedent(relabel).strip(), "    ") + "\n"
        relabels = syn.parse(text, f"{file} (relabel= of {function.__name__})").relabels
    module = syn.Module(file, doc, (), (kdef,), relabels)
    checked = check_module(module, hardware=hardware)
    return Kernel(checked[function.__name__], hardware, function)


@typechecked
def kernel(function: Callable | None = None, *, hardware: str | None = None, relabel: str | None = None):
    """Make a napkin kernel of a Python function whose docstring holds the diagram.

    Use it bare (``@napkin.kernel``) or with arguments
    (``@napkin.kernel(hardware="H100", relabel="smem: group q 128; stream x 64")``).

    >>> import napkin_dsl as napkin
    >>> @napkin.kernel
    ... def scale(X: napkin.f32["n"], alpha: napkin.f32) -> napkin.f32["n"]:
    ...     '''Y[n] = X * alpha'''
    >>> scale.diagram.statements[0].target
    'Y'
    """
    if function is None:
        return lambda f: _build(f, hardware, relabel)
    return _build(function, hardware, relabel)
