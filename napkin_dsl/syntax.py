"""Parsing: napkin text -> syntax dataclasses that carry source spans.

This pass only reads. It knows the shape of the notation (declarations, statements,
expressions, relabel clauses) and turns lark's parse tree into small frozen dataclasses,
each with the :class:`~napkin_dsl.errors.Span` it came from. It deliberately does not know
what any name means: axes, sizes, dtypes and relabel legality are the checker's and the
relabeller's business.

Syntax mistakes become :class:`NapkinSyntaxError` with curated messages for the common
ones (see ``_CURATED``), never a lark exception.

>>> module = parse("kernel double(X: f32[n]) -> Y: f32[n]:\\n    Y[n] = X[n] * 2\\n")
>>> module.kernels[0].statements[0].target
'Y'
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import lark
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from .errors import NapkinSyntaxError, Span

GRAMMAR_PATH = Path(__file__).parent / "grammar" / "napkin.lark"

# Large inputs are refused before parsing: a diagram is a few hundred lines, and lark's
# pure-Python LALR parser reads only some 50 KB a second (measured: 100 KB in 1.5-2.5 s),
# so a megabyte would look like a hang. 100,000 characters is ~3,000 statements.
MAX_SOURCE_CHARS = 100_000
# Deep nesting would exhaust Python's recursion in the tree walk; no real diagram nests
# more than a handful of parentheses.
MAX_NESTING = 64
# Every later stage walks expression trees recursively, so a long chain of operators
# (``A + A + ... + A``: one tree level per operator) is bounded too, well below Python's
# recursion limit of 1000 frames.
MAX_EXPRESSION_DEPTH = 200


# ---- syntax dataclasses ------------------------------------------------------------------


@dataclass(frozen=True)
class Number:
    value: float
    text: str
    span: Span


@dataclass(frozen=True)
class Ref:
    """A name in an expression: an array (``S``, ``S[q x]``), a scalar or a size (``d``).

    A window read, ``X[b c (2*p + i)]``, indexes some axis through an expression in
    parentheses: ``axes`` is None and ``window`` holds one item per written position, an axis
    name or the expression."""

    name: str
    axes: tuple[str, ...] | None
    span: Span
    window: tuple | None = None


@dataclass(frozen=True)
class Call:
    """``exp(S)``, ``max(a, b)``, ``softmax[x](S)``, ``sum[x](E)``, ``F(X, W)``."""

    name: str
    axes: tuple[str, ...] | None
    args: tuple["Expr", ...]
    span: Span


@dataclass(frozen=True)
class BinOp:
    op: str  # one of + - * / ^
    left: "Expr"
    right: "Expr"
    span: Span


@dataclass(frozen=True)
class Neg:
    operand: "Expr"
    span: Span


@dataclass(frozen=True)
class Compare:
    """``q >= x``: a comparison of two numbers, a boolean (masks; see ``where``)."""

    op: str  # one of >= > <= < == !=
    left: "Expr"
    right: "Expr"
    span: Span


@dataclass(frozen=True)
class Logic:
    """``a and b``, ``a or b``, ``not a`` on booleans (``right`` is None for ``not``)."""

    op: str  # and, or, not
    left: "Expr"
    right: "Expr | None"
    span: Span


Expr = Union[Number, Ref, Call, BinOp, Neg, Compare, Logic]


@dataclass(frozen=True)
class TypeSyntax:
    """``bf16[b h q d]`` (axes is a tuple) or ``f32`` (a scalar: axes is None)."""

    dtype: str
    axes: tuple[str, ...] | None
    span: Span


@dataclass(frozen=True)
class Param:
    name: str
    type: TypeSyntax
    span: Span


@dataclass(frozen=True)
class Statement:
    target: str
    axes: tuple[str, ...] | None
    level: str | None
    expr: Expr
    span: Span
    level_span: Span | None = None  # where the @level is written, for errors about it
    dtype: str | None = None  # the storage dtype written after @level (H[b n] @gmem bf16 = ...)
    dtype_span: Span | None = None


@dataclass(frozen=True)
class KernelDef:
    name: str
    params: tuple[Param, ...]
    outputs: tuple[Param, ...]
    statements: tuple[Statement, ...]
    span: Span


@dataclass(frozen=True)
class BoxDecl:
    name: str
    inputs: tuple[TypeSyntax, ...]
    outputs: tuple[TypeSyntax, ...]
    span: Span


@dataclass(frozen=True)
class Partition:
    kind: str  # "group", "stream" or "split"
    axis: str
    size: int | str
    span: Span
    targets: tuple[str, ...] | None = None  # `smem for O:` applies to the launch computing O only


@dataclass(frozen=True)
class LevelClauses:
    level: str
    partitions: tuple[Partition, ...]
    span: Span


@dataclass(frozen=True)
class RelabelBlock:
    kernel: str | None
    hardware: str
    levels: tuple[LevelClauses, ...]
    span: Span
    # `overlap: SCHEDULE`: the warpgroup schedule to build (hardware.OVERLAPS), and where
    overlap: str | None = None
    overlap_span: Span | None = None


@dataclass(frozen=True)
class Module:
    """Everything one source text declares, in order."""

    file: str
    source: str
    boxes: tuple[BoxDecl, ...] = ()
    kernels: tuple[KernelDef, ...] = ()
    relabels: tuple[RelabelBlock, ...] = ()
    statements: tuple[Statement, ...] = field(default=())  # docstring bodies only


# ---- parser ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _parser(start: str) -> lark.Lark:
    """The LALR parser for a start rule. Building its tables takes ~0.3 s, so they are kept
    in napkin's disk cache, keyed by the grammar text and the lark version."""
    import hashlib
    import io

    from .cache import cache_root, write_atomically

    grammar = GRAMMAR_PATH.read_text()
    key = hashlib.sha256(f"{lark.__version__}\0{start}\0{grammar}".encode()).hexdigest()[:24]
    path = cache_root() / "parsers" / f"{start}-{key}.lark"
    try:
        with open(path, "rb") as cached:
            return lark.Lark.load(cached)
    except Exception:  # missing, unreadable or from another lark: rebuild it
        pass
    parser = lark.Lark(grammar, start=start, parser="lalr", propagate_positions=True, maybe_placeholders=True)
    try:
        buffer = io.BytesIO()
        parser.save(buffer)
        write_atomically(path, buffer.getvalue(), create_parents=True)
    except OSError:
        pass  # a read-only cache directory only costs the rebuild next time
    return parser


class _Builder:
    """Walks a lark tree and builds syntax dataclasses with spans."""

    def __init__(self, file: str, lines: list[str], line_offset: int, first_column_offset: int):
        self.file = file
        self.lines = lines
        self.line_offset = line_offset
        self.first_column_offset = first_column_offset

    def span(self, item, end_item=None) -> Span:
        meta = item if isinstance(item, lark.Token) else item.meta
        line = getattr(meta, "line", 1) or 1
        column = getattr(meta, "column", 1) or 1
        end_column = getattr(end_item or meta, "end_column", None)
        if getattr(end_item or meta, "end_line", line) != line:
            end_column = None
        return make_span(self.file, self.lines, line, column, end_column, self.line_offset, self.first_column_offset)

    # -- declarations
    def module(self, tree: lark.Tree, source: str) -> Module:
        boxes, kernels, relabels, statements = [], [], [], []
        for child in tree.children:
            if not isinstance(child, lark.Tree):
                continue
            if child.data == "box_decl":
                boxes.append(self.box_decl(child))
            elif child.data == "kernel_def":
                kernels.append(self.kernel_def(child))
            elif child.data == "relabel_block":
                relabels.append(self.relabel_block(child))
            elif child.data == "statement":
                statements.append(self.statement(child))
        return Module(self.file, source, tuple(boxes), tuple(kernels), tuple(relabels), tuple(statements))

    def box_decl(self, tree: lark.Tree) -> BoxDecl:
        name, *types = tree.children
        types = [t for t in types if t is not None]
        # The grammar puts inputs before "->" and outputs after; lark drops the arrow, so
        # count the inputs from the token positions.
        arrow_line, arrow_col = _arrow_position(tree, self.lines)
        inputs = [t for t in types if (t.meta.line, t.meta.column) < (arrow_line, arrow_col)]
        outputs = [t for t in types if (t.meta.line, t.meta.column) > (arrow_line, arrow_col)]
        return BoxDecl(
            str(name),
            tuple(self.type_syntax(t) for t in inputs),
            tuple(self.type_syntax(t) for t in outputs),
            self.span(name),
        )

    def kernel_def(self, tree: lark.Tree) -> KernelDef:
        name = tree.children[0]
        params = [self.param(c) for c in tree.children[1:] if isinstance(c, lark.Tree) and c.data == "param"]
        outputs = [self.param(c) for c in tree.children[1:] if isinstance(c, lark.Tree) and c.data == "output"]
        statements = [self.statement(c) for c in tree.children[1:] if isinstance(c, lark.Tree) and c.data == "statement"]
        return KernelDef(str(name), tuple(params), tuple(outputs), tuple(statements), self.span(name))

    def param(self, tree: lark.Tree) -> Param:
        name, type_tree = tree.children
        return Param(str(name), self.type_syntax(type_tree), self.span(name))

    def type_syntax(self, tree: lark.Tree) -> TypeSyntax:
        dtype = str(tree.children[0])
        axes = self.axis_names(tree.children[1]) if tree.data == "array_type" else None
        return TypeSyntax(dtype, axes, self.span(tree))

    @staticmethod
    def axis_names(tree: lark.Tree) -> tuple[str, ...]:
        return tuple(str(token) for token in tree.children)

    def index_names(self, index: lark.Tree | None, what: str) -> tuple[str, ...] | None:
        """The axis names of an index that may hold names only (a target's, a box's axes)."""
        if index is None:
            return None
        for item in index.children:
            if isinstance(item, lark.Tree):
                raise NapkinSyntaxError(f"an index expression in parentheses is a window read's, not {what}'s",
                                        self.span(item), "write axis names here; index an array you read through "
                                                         "an expression: X[b c (2*p + i)]")
        return tuple(str(token) for token in index.children)

    def read_index(self, index: lark.Tree | None, depth: int) -> tuple[tuple | None, tuple | None]:
        """(axes, window) of a read's index: its names, or, where an item is an expression in
        parentheses, None and each item (a name or the expression)."""
        if index is None:
            return None, None
        if not any(isinstance(item, lark.Tree) for item in index.children):
            return tuple(str(token) for token in index.children), None
        return None, tuple(self.expr(item.children[0], depth + 1) if isinstance(item, lark.Tree) else str(item)
                           for item in index.children)

    def statement(self, tree: lark.Tree) -> Statement:
        name, index, level, dtype, expr = tree.children
        axes = self.index_names(index, "a target")
        return Statement(
            str(name),
            axes,
            str(level)[1:] if level is not None else None,
            self.expr(expr, depth=0),
            self.span(name),
            self.span(level) if level is not None else None,
            str(dtype) if dtype is not None else None,
            self.span(dtype) if dtype is not None else None,
        )

    def relabel_block(self, tree: lark.Tree) -> RelabelBlock:
        kernel, hardware, *levels = tree.children
        schedules = [level for level in levels if isinstance(level.children[-1], lark.Tree)
                     and level.children[-1].data == "schedule_name"]
        overlap = overlap_span = None
        for clause in schedules:
            name, scope, value = clause.children
            written = "+".join(str(part) for part in value.children)
            if str(name) != "overlap":
                raise NapkinSyntaxError(f"'{name}: {written}' names no partitions: a level's clause is "
                                        f"'{name}: group AXIS SIZE' (or stream, split)", self.span(name),
                                        f"the warpgroup schedule is written 'overlap: {written}'")
            if scope is not None:
                raise NapkinSyntaxError("the warpgroup schedule is the kernel's: 'overlap' takes no 'for'", self.span(name),
                                        f"write 'overlap: {written}'")
            if overlap is not None:
                raise NapkinSyntaxError(f"the relabelling names its warpgroup schedule twice ('{overlap}' and '{written}')",
                                        self.span(name), "keep one 'overlap:' line")
            overlap, overlap_span = written, self.span(value)
        return RelabelBlock(
            str(kernel) if kernel is not None else None,
            str(hardware),
            tuple(self.level_clauses(level) for level in levels if level not in schedules),
            self.span(hardware),
            overlap,
            overlap_span,
        )

    def level_clauses(self, tree: lark.Tree) -> LevelClauses:
        level, scope, *lists = tree.children
        if str(level) == "overlap":
            raise NapkinSyntaxError("'overlap' takes a warpgroup schedule, not partitions", self.span(level),
                                    "write 'overlap: pingpong+pipelined' (or serial, pipelined, pingpong)")
        targets = tuple(str(name) for name in scope.children) if scope is not None else None
        partitions = []
        for partition_list in lists:
            kind, *items = partition_list.children
            for item in items:
                axis, size = item.children
                value = self.integer(size.children[0]) if size.data == "int_size" else str(size.children[0])
                partitions.append(Partition(str(kind), str(axis), value, self.span(axis), targets))
        return LevelClauses(str(level), tuple(partitions), self.span(level))

    def integer(self, token: lark.Token) -> int:
        """An integer literal, refused beyond 4300 digits as Python 3.11+ refuses to convert them
        (checked here too so that every Python, and a lowered sys limit, gives the same error)."""
        text = str(token)
        try:
            if len(text) > 4300:
                raise ValueError(text)
            return int(text)
        except ValueError:
            raise NapkinSyntaxError(f"integer literal with {len(text):,} digits is too long", self.span(token),
                                    "write a smaller number") from None

    # -- expressions
    def expr(self, tree, depth: int):
        if depth > MAX_EXPRESSION_DEPTH:
            raise NapkinSyntaxError(
                f"expression is more than {MAX_EXPRESSION_DEPTH} operations deep "
                f"(each operator of a chain such as A + A + ... adds a level)",
                self.span(tree),
                "split it into several statements",
            )
        kind = tree.data
        if kind == "number":
            token = tree.children[0]
            text = str(token)
            value = float(text) if any(c in text for c in ".eE") else self.integer(token)
            return Number(value, text, self.span(token))
        if kind == "ref":
            name, index = tree.children
            axes, window = self.read_index(index, depth)
            return Ref(str(name), axes, self.span(name), window)
        if kind == "call":
            name, index, *args = tree.children
            axes = self.index_names(index, "a box")
            return Call(str(name), axes, tuple(self.expr(a, depth + 1) for a in args if a is not None), self.span(name))
        if kind == "neg":
            return Neg(self.expr(tree.children[0], depth + 1), self.span(tree))
        if kind == "compare":
            left, op, right = tree.children
            return Compare(str(op), self.expr(left, depth + 1), self.expr(right, depth + 1), self.span(op))
        if kind in ("and_", "or_"):
            left, right = tree.children
            return Logic(kind[:-1], self.expr(left, depth + 1), self.expr(right, depth + 1), self.span(tree))
        if kind == "not_":
            return Logic("not", self.expr(tree.children[0], depth + 1), None, self.span(tree))
        operators = {"add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "^"}
        if kind in operators:
            left, right = tree.children
            return BinOp(operators[kind], self.expr(left, depth + 1), self.expr(right, depth + 1), self.span(tree))
        raise AssertionError(f"napkin bug: unknown expression node {kind}")


def _arrow_position(tree: lark.Tree, lines: list[str]) -> tuple[int, int]:
    """Line and column of the '->' of a box declaration (lark drops anonymous tokens)."""
    line = tree.meta.line
    text = lines[line - 1] if 0 < line <= len(lines) else ""
    column = text.find("->", tree.meta.column - 1)
    return line, column + 1


def make_span(file, lines, line, column, end_column=None, line_offset=0, first_column_offset=0) -> Span:
    text = lines[line - 1] if 0 < line <= len(lines) else ""
    if line == 1 and first_column_offset:
        column += first_column_offset
        if end_column:
            end_column += first_column_offset
        text = " " * first_column_offset + text
    return Span(file, line + line_offset, column, text, end_column)


# ---- curated syntax errors ------------------------------------------------------------------

# (message, hint, examples that trigger it). A syntax error gets the curated message of an
# example that fails in the same parser state on the same kind of token (see _curated_label),
# so the examples need only resemble the user's mistake. Examples are written as whole files;
# _curated_examples derives their docstring-body forms and the forms that follow a kernel.
_K = "kernel k(A: f32[i]) -> B: f32[i]:\n"
_CURATED: list[tuple[str, str, list[str]]] = [
    (
        "missing '=' in a statement",
        "a statement reads TARGET[axes] = expression",
        [_K + "    B[i] A[i]\n", _K + "    B A[i]\n", _K + "    B[i] 2\n", _K + "    B[i] (A)\n"],
    ),
    (
        "missing operator between two operands",
        "write the operator: A * B, A + B, ... (a product needs its '*')",
        [_K + "    B[i] = A[i] A[i]\n", _K + "    B[i] = A[i] 2\n", _K + "    B[i] = 2 A[i]\n"],
    ),
    (
        "unclosed '[' in an axis list",
        "close the axis list with ']'",
        ["kernel k(A: f32[i) -> B: f32[i]:\n    B[i] = A[i]\n", _K + "    B[i = A[i]\n", _K + "    B[i] = A[i\n"],
    ),
    (
        "axis lists are separated by spaces, not commas",
        "write A[i j], not A[i, j]",
        ["kernel k(A: f32[i, j]) -> B: f32[i]:\n    B[i] = A[i]\n", _K + "    B[i, j] = A[i]\n", _K + "    B[i] = A[i, j]\n"],
    ),
    (
        "missing ':' at the end of the kernel header",
        "a kernel header ends with ':' and its statements follow on the next lines",
        ["kernel k(A: f32[i]) -> B: f32[i]\n    B[i] = A[i]\n"],
    ),
    (
        "statements go on their own lines below the kernel header",
        "end the header with ':' and a line break, then indent the statements",
        ["kernel k(A: f32[i]) -> B: f32[i]: B[i] = A[i]\n"],
    ),
    (
        "missing '->' and outputs in the kernel header",
        "declare outputs after the parameters: kernel NAME(PARAMS) -> OUT: f32[axes]:",
        ["kernel k(A: f32[i]):\n    B[i] = A[i]\n"],
    ),
    (
        "missing ':' between a name and its type",
        "parameters and outputs read NAME: DTYPE[axes], e.g. Q: bf16[q d]",
        ["kernel k(A f32[i]) -> B: f32[i]:\n    B[i] = A[i]\n", "kernel k(A: f32[i]) -> B f32[i]:\n    B[i] = A[i]\n"],
    ),
    (
        "missing or unknown dtype in a type",
        "types read DTYPE[axes] with DTYPE one of f64 f32 f16 bf16 fp8 fp8e4m3 fp8e5m2 i32 i64",
        [
            "kernel k(A: [i]) -> B: f32[i]:\n    B[i] = A[i]\n",
            "kernel k(A: float32[i]) -> B: f32[i]:\n    B[i] = A[i]\n",
            "kernel k(A: f32[i]) -> B: int8[i]:\n    B[i] = A[i]\n",
            "kernel k(A: f32[i]) -> B: [i]:\n    B[i] = A[i]\n",
            "box F(float[x]) -> f32[y]\n",
            "box F(f32[x]) -> float[y]\n",
        ],
    ),
    (
        "missing '->' in a box declaration",
        "a box reads: box NAME(INPUT TYPES) -> OUTPUT TYPES, e.g. box F(f32[x], f32[w]) -> f32[y]",
        ["box F(f32[x]) f32[y]\n"],
    ),
    (
        "unbalanced parentheses in an expression",
        "check that every '(' has its ')'",
        [
            _K + "    B[i] = exp(A[i]\n",
            _K + "    B[i] = (A[i]\n",
            _K + "    B[i] = exp(A\n",
            _K + "    B[i] = (A\n",
            _K + "    B[i] = (2\n",
            _K + "    B[i] = max(A, A\n",
            _K + "    B[i] = sum[i](A\n",
            _K + "    B[i] = sum[i](A[i]\n",
            _K + "    B[i] = A[i] + 1)\n",
            _K + "    B[i] = A[i])\n",
            _K + "    B[i] = A)\n",
        ],
    ),
    (
        "napkin writes powers as a^b, not a**b",
        "write for example d^-0.5",
        [_K + "    B[i] = A[i] ** 2\n"],
    ),
    (
        "an operator is missing an operand",
        "write both sides of + - * / ^",
        [
            _K + "    B[i] = A[i] *\n",
            _K + "    B[i] = * A[i]\n",
            _K + "    B[i] = A[i] + * A[i]\n",
            _K + "    B[i] = A[i] - / A[i]\n",
            _K + "    B[i] = (A[i] +)\n",
            _K + "    B[i] =\n",
        ],
    ),
    (
        "a relabel clause needs a level name, then 'group' or 'stream' (or 'split') with AXIS SIZE pairs",
        "write for example:  smem: group q 128; stream x 64",
        [
            "relabel k on H100:\n    group q 128\n",
            "relabel k on H100:\n    smem: q 128\n",
            "relabel k on H100:\n    smem: grop q 128\n",
            "relabel k on H100:\n    smem: group q\n",
            "relabel k on H100:\n    smem: group q 128,\n",
        ],
    ),
    (
        "separate the 'group' and 'stream' lists of a level with ';' (and a 'split' list)",
        "write for example:  smem: group q 128; stream x 64",
        ["relabel k on H100:\n    smem: group q 128 stream x 64\n"],
    ),
    (
        "a partition size is a positive integer or a symbol",
        "write for example:  group q 128  or  group q g_q",
        ["relabel k on H100:\n    smem: group q -1\n", "relabel k on H100:\n    smem: group q 1.5\n"],
    ),
    (
        "a relabel block needs 'on HARDWARE'",
        "write: relabel KERNEL on H100:",
        ["relabel k H100:\n    smem: group q 128\n", "relabel k:\n    smem: group q 128\n"],
    ),
    (
        "missing ':' at the end of the relabel header",
        "write: relabel KERNEL on HARDWARE:  and the level clauses on the next lines",
        ["relabel k on H100\n    smem: group q 128\n"],
    ),
    (
        "comparisons do not chain",
        "write a < b and b < c, not a < b < c",
        [_K + "    B[i] = where(i >= 1 >= 0, A, 0)\n", _K + "    B[i] = where(0 < i < 2, A, 0)\n"],
    ),
    (
        "a reserved word is used as a name",
        "kernel, relabel, box, on, group, stream, split, for, and, or and not are reserved",
        [
            "kernel k(group: f32[i]) -> B: f32[i]:\n    B[i] = A[i]\n",
            "kernel k(A: f32[on]) -> B: f32[i]:\n    B[i] = A[i]\n",
            "kernel k(A: f32[stream]) -> B: f32[i]:\n    B[i] = A[i]\n",
            "kernel k(on: f32[i]) -> B: f32[i]:\n    B[i] = A[i]\n",
            _K + "    on[i] = A[i]\n",
            _K + "    group[i] = A[i]\n",
            _K + "    B[i] = A[i] * stream\n",
            _K + "    B[i on] = A[i]\n",
            "kernel k(and: f32[i]) -> B: f32[i]:\n    B[i] = A[i]\n",
            "kernel k(or: f32[i]) -> B: f32[i]:\n    B[i] = A[i]\n",
            "kernel k(not: f32[i]) -> B: f32[i]:\n    B[i] = A[i]\n",
        ],
    ),
]

# Docstring bodies hold statements only; the header comes from the Python signature.
_DOCSTRING_HEADER = (
    "a kernel's docstring holds only its statements (and relabel blocks)",
    "the parameters and outputs come from the Python signature and its annotations; drop the 'kernel ...:' line",
)


def _curated_examples(start: str) -> list[tuple[int, str]]:
    """(label, example) pairs for a start rule.

    A relabel mistake fails in a different parser state when a kernel precedes it, so
    relabel examples are also tried after one. A docstring body is a file's statements
    without the kernel header line, so for ``start="body"`` the header is dropped.
    """
    pairs = []
    for label, (_, _, examples) in enumerate(_CURATED):
        for example in examples:
            variants = [example]
            if example.startswith("relabel"):
                variants.append(_K + "    B[i] = A[i]\n\n" + example)
            if start == "body":
                if example.startswith("box"):
                    continue  # a docstring cannot declare boxes
                variants = [v.split("\n", 1)[1] if v.startswith("kernel") else v for v in variants]
                variants += ["B[i] = A[i]\n" + v for v in variants if v.startswith("relabel")]
            pairs += [(label, v) for v in variants]
    return pairs


def _failure_key(exc: UnexpectedInput) -> tuple:
    """What identifies a mistake: the LALR state and the kind of token found there.

    lark hands over a ParserState, whose equality also compares stack depths; the state
    number alone lets one example match a mistake however deep in a file it sits.
    """
    state = getattr(exc, "state", None)
    state = getattr(state, "position", state)
    if isinstance(exc, UnexpectedToken):
        return state, exc.token.type
    if isinstance(exc, UnexpectedEOF):
        return state, "$END"
    return state, "<character>"


@functools.lru_cache(maxsize=None)
def _curated_table(start: str) -> dict[tuple, list[int]]:
    """Failure key -> curated labels, computed once per start rule from the examples."""
    table: dict[tuple, list[int]] = {}
    for label, example in _curated_examples(start):
        try:
            _parser(start).parse(example)
        except UnexpectedInput as exc:
            labels = table.setdefault(_failure_key(exc), [])
            if label not in labels:
                labels.append(label)
    return table


def _fits_context(label: int, before: str) -> bool:
    """Whether the text before the error on its line agrees with a curated message.

    LALR merges the state after a statement's target (``B[i]``) with the state after an
    operand (``... = A[i]``), so an unexpected name there is a missing '=' only when the
    line has none yet, and a missing operator only when it has.
    """
    message = _CURATED[label][0]
    if message.startswith("missing '=' "):
        return "=" not in before
    if message.startswith("missing operator "):
        return "=" in before
    return True


def _curated_label(exc: UnexpectedInput, start: str, before: str) -> int | None:
    """The curated message for a failure, if an example fails the same way.

    Stricter than lark's ``match_examples``, which settles for the same parser state: a
    comma and a stray ')' after an expression fail in one state, and only the token tells
    a misplaced comma from an unbalanced parenthesis.
    """
    labels = _curated_table(start).get(_failure_key(exc), [])
    return next((label for label in labels if _fits_context(label, before)), None)


def _found_text(exc: UnexpectedInput, text: str) -> str:
    """What the parser found where it failed, in words."""
    if isinstance(exc, UnexpectedCharacters):
        char = text[exc.pos_in_stream] if 0 <= exc.pos_in_stream < len(text) else "?"
        return f"unexpected character {char!r}"
    if isinstance(exc, UnexpectedEOF):
        return "unexpected end of input"
    if isinstance(exc, UnexpectedToken):
        token = exc.token
        if token.type == "_NL":
            return "unexpected end of line"
        if token.type == "$END":
            return "unexpected end of input"
        return f"unexpected {str(token)!r}"
    return "unexpected input"


def _expected_text(exc: UnexpectedInput, start: str) -> str | None:
    """'expected a name, ']'' from lark's expected terminals, in readable words."""
    expected = sorted(getattr(exc, "expected", None) or getattr(exc, "allowed", None) or [])
    literals = {t.name: repr(t.pattern.value) for t in _parser(start).terminals if t.pattern.type == "str"}
    readable = [_TOKEN_NAMES.get(name) or literals.get(name, name) for name in expected]
    return f"expected {', '.join(dict.fromkeys(readable))}" if readable else None


def _syntax_error(exc: UnexpectedInput, text: str, start: str, file: str, lines, line_offset, first_column_offset) -> NapkinSyntaxError:
    line = getattr(exc, "line", None) or max(len(lines), 1)
    column = getattr(exc, "column", None) or 1
    if line < 0:
        line, column = max(len(lines), 1), max(len(lines[-1]) + 1 if lines else 1, 1)
    span = make_span(file, lines, line, column, None, line_offset, first_column_offset)
    found = _found_text(exc, text)
    source_line = lines[line - 1] if 0 < line <= len(lines) else ""
    if start == "body" and source_line[column - 1 :].startswith(("kernel", "box")):
        message, hint = _DOCSTRING_HEADER
        return NapkinSyntaxError(f"{message} ({found})", span, hint)
    glued = _glued_keyword(exc, source_line, column)
    if glued is not None:
        word, rest, start = glued  # the caret runs under the whole glued word
        span = make_span(file, lines, line, start, start + len(word) + len(rest), line_offset, first_column_offset)
        return NapkinSyntaxError(f"missing space after the keyword '{word}' in '{word}{rest}'", span,
                                 f"write '{word} {rest}': a keyword is a word of its own")
    try:
        label = _curated_label(exc, start, source_line[: column - 1])
    except Exception:  # the examples are ours; a broken one must never hide the user's error
        label = None
    if label is not None:
        message, hint, _ = _CURATED[label]
        return NapkinSyntaxError(f"{message} ({found})", span, hint)
    return NapkinSyntaxError(found, span, _expected_text(exc, start))


_TOKEN_NAMES = {
    "NAME": "a name",
    "DTYPE": "a dtype",
    "NUMBER": "a number",
    "INT": "an integer",
    "_NL": "end of line",
    "$END": "end of input",
    "LSQB": "'['",
    "RSQB": "']'",
    "LPAR": "'('",
    "RPAR": "')'",
    "COLON": "':'",
    "COMMA": "','",
    "EQUAL": "'='",
    "SEMICOLON": "';'",
    "PLUS": "'+'",
    "MINUS": "'-'",
    "STAR": "'*'",
    "SLASH": "'/'",
    "CIRCUMFLEX": "'^'",
    "RARROW": "'->'",
    "LEVEL": "'@level'",
    "PARTITION_KIND": "'group', 'stream' or 'split'",
    "_KERNEL": "'kernel'",
    "_RELABEL": "'relabel'",
    "_BOX": "'box'",
    "_ON": "'on'",
    "_FOR": "'for'",
    "COMPARISON": "a comparison (>= > <= < == !=)",
    "_AND": "'and'",
    "_OR": "'or'",
    "_NOT": "'not'",
}

# The keyword terminals of the grammar and the words they match. Keywords need a word
# boundary, so a keyword glued to a name (`kernelfoo`, `forY`, `groupi`) lexes as a name.
_KEYWORDS = {"_KERNEL": ("kernel",), "_RELABEL": ("relabel",), "_BOX": ("box",), "_ON": ("on",), "_FOR": ("for",),
             "_AND": ("and",), "_OR": ("or",), "_NOT": ("not",),
             "PARTITION_KIND": ("group", "stream", "split")}
# Lines that can only be a declaration with its keyword glued to the name: no statement's
# target is followed by '(' and none holds the reserved word 'on'.
_GLUED_DECLARATION = re.compile(r"\s*(?:(kernel|box)(\w+)\s*\(|(relabel)(\w+)(?:\s+\w+)?\s+on(?!\w))")
# A level clause whose first partition kind runs into its axis (`smem: groupi 4`): the
# glued word first reads as a schedule's name (`overlap: pingpong`), and the size after it
# is what the parser refuses.
_GLUED_PARTITION = re.compile(r"\s*\w+(?:\s+for\s+[\w\s,]+?)?\s*:\s*(group|stream|split)(\w+)\s+\w")


def _glued_keyword(exc: UnexpectedInput, source_line: str, column: int) -> tuple[str, str, int] | None:
    """(keyword, name, column of the glued word) when the mistake is a keyword written without
    its space: the parser wanted the keyword and found a name that starts with it (``smem
    forY:``), or the line is a declaration whose keyword runs into its name (``kernelfoo(...)``
    after a kernel, where ``kernelfoo`` first reads as a statement's target)."""
    token = getattr(exc, "token", None)
    if isinstance(exc, UnexpectedToken) and token is not None and token.type == "NAME":
        text = str(token)
        for terminal in exc.expected or ():
            for word in _KEYWORDS.get(terminal, ()):
                if text.startswith(word) and len(text) > len(word):
                    return word, text[len(word):], column
    match = _GLUED_DECLARATION.match(source_line)
    if match:
        group = 1 if match.group(1) else 3
        return match.group(group), match.group(group + 1), match.start(group) + 1
    match = _GLUED_PARTITION.match(source_line)
    if match:
        return match.group(1), match.group(2), match.start(1) + 1
    return None


def _normalize(text: str) -> tuple[str, list[str]]:
    """The text lark parses, and its lines as lark counts them.

    A byte-order mark (Windows editors write one) is dropped, and CRLF and lone CR line
    ends become LF, so that every editor's files parse alike. The lines are split on LF
    only: ``str.splitlines`` also splits on form feeds, U+2028 and other separators that
    lark does not count, and the caret would then sit under the wrong source line.
    """
    text = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    source = text if text.endswith("\n") else text + "\n"
    return source, source[:-1].split("\n")


def _check_nesting(source: str, file: str, lines, line_offset: int, first_column_offset: int) -> None:
    """Refuse parentheses nested deeper than MAX_NESTING, pointing at the one too many.

    Counted before lark sees the text: the tree walk is recursive, and a pathological nest
    would otherwise end in a RecursionError.
    """
    depth, line, column = 0, 1, 0
    for char in source:
        column += 1
        if char == "\n":
            line, column = line + 1, 0
        elif char in "([":
            depth += 1
            if depth > MAX_NESTING:
                raise NapkinSyntaxError(
                    f"parentheses and brackets nested more than {MAX_NESTING} levels deep",
                    make_span(file, lines, line, column, None, line_offset, first_column_offset),
                    "split the expression into several statements",
                )
        elif char in ")]":
            depth = max(depth - 1, 0)  # a stray ')' is lark's to report, not a license to nest


def parse(text: str, file: str = "<string>", *, start: str = "file", line_offset: int = 0, first_column_offset: int = 0) -> Module:
    """Parse napkin text into a :class:`Module`.

    ``start="body"`` parses the docstring of a ``@napkin.kernel`` function (statements, then
    relabel blocks). ``line_offset`` and ``first_column_offset`` shift spans so that errors in
    a docstring point into the enclosing Python file.
    """
    if not isinstance(text, str):
        raise NapkinSyntaxError(f"expected napkin source text, got {type(text).__name__}")
    if len(text) > MAX_SOURCE_CHARS:
        raise NapkinSyntaxError(
            f"{file}: source is {len(text):,} characters; napkin reads at most {MAX_SOURCE_CHARS:,}",
            hint="a diagram is a few hundred lines: is this the right file?",
        )
    if "\x00" in text:
        raise NapkinSyntaxError(f"{file}: not a text file (it contains NUL bytes)", hint="napkin reads UTF-8 text")
    source, lines = _normalize(text)
    _check_nesting(source, file, lines, line_offset, first_column_offset)
    try:
        tree = _parser(start).parse(source)
    except UnexpectedInput as exc:
        raise _syntax_error(exc, source, start, file, lines, line_offset, first_column_offset) from None
    except lark.exceptions.VisitError as exc:  # pragma: no cover - we use no transformer callbacks
        raise exc.orig_exc from None
    return _Builder(file, lines, line_offset, first_column_offset).module(tree, text)
