"""Errors napkin reports to its users.

Every user mistake is a :class:`NapkinError`. An error carries where it happened (a
:class:`Span`: file, line, column and the source line) and prints that line with a caret
under the offending column, the way a compiler does:

    attention.napkin:3:23: error: cannot group-partition x: ...
        P[b h q x] = softmax[x](S)
                              ^
      hint: stream x 64

The checker collects every problem it finds and raises them together as one
:class:`NapkinErrors`, which is itself a ``NapkinError``; the CLI prints it and exits 2.
Bugs in napkin itself are never ``NapkinError``s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A place in a source text: 1-based line and column, and the text of that line."""

    file: str
    line: int
    column: int
    source_line: str = ""
    end_column: int | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"

    def excerpt(self) -> str:
        """The source line with a caret (or a run of carets) under the span."""
        if not self.source_line:
            return ""
        line = self.source_line.rstrip("\n").expandtabs(4)
        prefix = self.source_line[: self.column - 1].expandtabs(4)
        width = 1
        if self.end_column and self.end_column > self.column:
            width = len(self.source_line[self.column - 1 : self.end_column - 1].expandtabs(4))
        return f"    {line}\n    {' ' * len(prefix)}{'^' * max(width, 1)}"


class NapkinError(Exception):
    """A mistake in a napkin program or in how it is used.

    ``message`` names what is wrong (axis, array, sizes, level); ``span`` says where;
    ``hint`` says what to do about it.
    """

    kind = "error"

    def __init__(self, message: str, span: Span | None = None, hint: str | None = None):
        self.message = message
        self.span = span
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        where = f"{self.span}: " if self.span else ""
        parts = [f"{where}{self.kind}: {self.message}"]
        if self.span and self.span.excerpt():
            parts.append(self.span.excerpt())
        if self.hint:
            parts.append(f"  hint: {self.hint}")
        return "\n".join(parts)

    def to_dict(self) -> dict:
        out: dict = {"kind": type(self).__name__, "message": self.message}
        if self.span:
            out.update(file=self.span.file, line=self.span.line, column=self.span.column)
        if self.hint:
            out["hint"] = self.hint
        return out


class NapkinSyntaxError(NapkinError):
    """The text does not follow the notation's grammar."""

    kind = "syntax error"


class NapkinTypeError(NapkinError):
    """Axes, sizes, dtypes, names or levels are inconsistent."""


class RelabelError(NapkinError):
    """A group or stream partition is illegal, or the result does not fit a level."""


class NapkinCallError(NapkinError):
    """A kernel was called with arrays that do not match its signature."""


class NapkinErrors(NapkinError):
    """Several errors found in one pass, reported together."""

    def __init__(self, errors: list[NapkinError]):
        self.errors = list(errors)
        first = self.errors[0] if self.errors else None
        super().__init__(
            first.message if first else "no errors",
            first.span if first else None,
            first.hint if first else None,
        )

    def render(self) -> str:
        rendered = [error.render() for error in self.errors]
        count = len(self.errors)
        summary = f"{count} error{'s' if count != 1 else ''}"
        return "\n\n".join(rendered) + f"\n\n{summary}"

    def to_dict(self) -> dict:
        return {"errors": [error.to_dict() for error in self.errors]}


def raise_collected(errors: list[NapkinError]) -> None:
    """Raise nothing, the one error, or all of them together in source order.

    Checks run declaration by declaration (boxes, relabel blocks, then kernels), but a
    reader fixes a file top to bottom; errors without a place come last.
    """
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise NapkinErrors(sorted(errors, key=_source_order))


def _source_order(error: NapkinError) -> tuple:
    span = error.span
    return (1, "", 0, 0) if span is None else (0, span.file, span.line, span.column)
