"""griffe extension for the API page (mkdocstrings, see mkdocs.yml): attributes with something to say.

napkin documents most fields with a comment on their line (``configurations: list  # best first``),
which griffe does not read, so the page showed hundreds of attribute entries that were only a
name in a code block. Here:

- an attribute without a docstring takes its trailing comment as one, with the comment lines
  after it that continue it;
- an attribute with neither is left out of the page: a dataclass field still shows, with its
  type, in the class's signature (griffe's dataclasses extension builds ``__init__`` first, so
  mkdocs.yml lists it before this one), and other attributes are described in their class's
  docstring or on the API page.
"""

from __future__ import annotations

import io
import tokenize

import griffe


def trailing_comment(lines: list[str], lineno: int, endlineno: int) -> str | None:
    """The comment at the end of the statement on lines ``lineno..endlineno`` (1-based), joined
    with the comment-only lines after it that continue it; None when there is none."""
    statement = "\n".join(lines[lineno - 1:endlineno]) + "\n"
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(statement).readline))
    except (tokenize.TokenError, SyntaxError):  # a statement griffe cut oddly: no comment, not a crash
        return None
    comments = [token for token in tokens if token.type == tokenize.COMMENT and token.start[0] == endlineno - lineno + 1]
    if not comments:
        return None
    column = comments[-1].start[1]
    statement_column = len(lines[lineno - 1]) - len(lines[lineno - 1].lstrip())
    parts = [comments[-1].string[1:].strip()]
    for line in lines[endlineno:]:
        indent, text = len(line) - len(line.lstrip()), line.strip()[1:].strip()
        if not line.lstrip().startswith("#"):
            break
        # Aligned under the comment, it goes on; at the statement's indent too when it goes on
        # the sentence (lower case: "(and twice as many" / "masked ones planned ..."), while a
        # capitalised one there is taken to begin the next statement's comment.
        if not (indent == column or (indent == statement_column and text[:1] and not text[:1].isupper())):
            break
        parts.append(text)
    text = " ".join(part for part in parts if part)
    return text or None


def _objects(obj: griffe.Object):
    """The modules, classes and attributes under ``obj`` (not aliases: those belong elsewhere)."""
    for member in list(obj.members.values()):
        if member.is_alias:
            continue
        yield member
        if member.is_module or member.is_class:
            yield from _objects(member)


class AttributeComments(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for obj in list(_objects(pkg)):
            if not obj.is_attribute or obj.docstring is not None:
                continue
            try:
                lines = obj.lines_collection[obj.filepath] if obj.lineno else None
            except KeyError:  # compiled or generated: no source to read a comment from
                lines = None
            comment = trailing_comment(lines, obj.lineno, obj.endlineno or obj.lineno) if lines else None
            if comment:
                obj.docstring = griffe.Docstring(comment, lineno=obj.lineno, endlineno=obj.endlineno, parent=obj)
            else:
                del obj.parent.members[obj.name]
