"""Neural circuit diagrams as SVG, drawn from the same checked kernel that compiles.

``render(kernel)`` draws one kernel in the conventions of the paper (METHOD.md section 1):

* wires are axes, running left to right, labelled with their name (and their size where it
  differs from the name); an array is a bundle of wires headed by its name and dtype;
* each statement is one column holding one box: softmax is a triangle, a contraction is a
  cap joining the wires of the contracted axis, a reduction is a bar that ends the consumed
  wire, an elementwise map is a box labelled with its expression, an opaque box shows its
  name and its ports;
* woven axes pass over the box (drawn above it, across its outline); wires of one axis
  coming from several operands meet at a dot (a shared or broadcast axis), and a dot also
  marks an array copied for a later statement; the operands of a box (a tuple) are
  separated by dashed lines;
* colours are memory levels, top level black, then orange, green, ...: levels, loads, saves
  and residency are read off the kernel's Program (``plan_residency``), not re-derived: kernel
  parameters and every array the Program moves live at its top level, everything else on chip
  (its compute level); a bar tagged ``load`` or ``save`` marks each load or save step of the
  Program into or out of the compute level, in its launch (an array read by several
  statements of a launch is loaded before it is copied, a result read again in its launch is
  saved after its last reader there);
* ``relabelled=True`` marks the partitions of the relabel block on on-chip wires: a group
  partition boxes the wire's label (``q g=128``), a stream partition dashes the wire
  (``x s=64``), a split names its parts (``x p=1024 s=64``) and its combine launch is drawn
  as columns (``drawn_diagram``): each part's accumulator leaves its statement (``O.acc``), the
  parts' states (``O.acc.part[x# ...]``) are saved and loaded again into a ``merge x#`` box per
  result the combine forms;
* ``costs=True`` adds rows of memory M and transfers H per column under the boxes, as in
  the paper's Figures 9, 11 and 12, read off the Program (``cost.statement_columns``) at the
  compute level of the kernel's hardware (or ``hardware=``, with ``sizes=`` bound): the
  relabelled Program when ``relabelled=True``, the diagram as written otherwise; the totals
  over the columns (the CostReport's H and M) close the rows on the right. ``columns`` (one
  dict per statement: ``{"label", "M", "H"}``) draws rows given by the caller instead.

What it deliberately does not do:

* compute costs itself. They are read off the Program that ``pseudocode.elaborate`` builds,
  through ``cost.statement_columns``: one source of truth;
* draw the elaborated pseudocode (loops, per-chunk heads and accumulators) or the open
  circle for split/concatenate: one column per statement, as written;
* hold two copies of one array at two levels: one bundle per array, so a result the Program
  saves as soon as it is computed is drawn saved after its last reader in the launch, and an
  array whose on-chip copy the Program drops at the end of a launch turns back to its own
  level there, without a mark (nothing moves);
* measure fonts. Every label is set in a monospace font so that its width can be estimated
  (0.6 em per character); long names are cut with an ellipsis, their full text kept in a
  ``<title>``.

The output is deterministic (no random ids, fixed float formatting), so it can be kept as a
golden file. It is plain SVG text: no drawing library is needed.

>>> from napkin_dsl import load
>>> svg = render(load("kernel twice(X: f32[n]) -> Y: f32[n]:\\n    Y[n] = X * 2\\n")["twice"])
>>> svg.startswith("<svg")
True
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

from . import algebra
from .diagram import (Apply, Array, BoxSignature, Const, Contract, Diagram, Index, Map, Opaque, Read, Reduce, ScalarParam, Scan,
                      Softmax, Statement)
from .diagram import size_text as diagram_size_text
from .errors import NapkinError
from .hardware import hardware_names, load_hardware
from .pseudocode import Loop, Program, walk

# ---- look ------------------------------------------------------------------------------------

FONT_FAMILY = "DejaVu Sans Mono, Menlo, Consolas, monospace"
CHAR_WIDTH = 0.602  # advance of a DejaVu Sans Mono glyph, in units of the font size
TITLE_SIZE = 13
HEADER_SIZE = 11
LABEL_SIZE = 10
SMALL_SIZE = 9

# Top level black, then orange, green, blue, ... (the paper colours levels the same way).
LEVEL_COLOURS = ("#000000", "#e07b00", "#2c9a45", "#1f6fc9", "#8e44ad", "#b03a2e", "#6b6b6b")
BOX_FILL = "#f4f4ee"
BOX_STROKE = "#333333"
MUTED = "#555555"
WARNING = "#c0392b"
WIRE_WIDTH = 1.6

# ---- geometry --------------------------------------------------------------------------------

MARGIN = 16
PITCH = 16  # vertical distance between two wires of a bundle
HEADER = 20  # room above a bundle's first wire for its name
BUNDLE_GAP = 12
ROUTE_WIDTH = 40  # where wires bend from their bundle to the box's lanes and ports
BOX_MARGIN = 10  # between a box and the edges of its zone
MIN_BOX_WIDTH = 48
GAP_MOVE = 24  # room in a gap for a load or save mark before the bundles bend
LANE_GAP = 6  # between the woven lanes and the box's own ports

# ---- text limits -----------------------------------------------------------------------------

MAX_AXIS_CHARS = 14
MAX_NAME_CHARS = 16
MAX_BOX_CHARS = 32
MAX_COST_CHARS = 40
MAX_TITLE_CHARS = 140
MIN_WIDTH = 480

COST_KEYS = ("label", "M", "H")
COST_HEADS = ("step", "M", "H")
COST_PITCH = 16  # between two rows of costs


# ---- small helpers ---------------------------------------------------------------------------


def fmt(value: float) -> str:
    """A coordinate with at most two decimals and no trailing zeros, the same on every run."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def text_width(text: str, size: float) -> float:
    # Renderers that hint glyphs (cairo) round each advance to whole pixels: take the wider.
    return len(text) * max(size * CHAR_WIDTH, round(size * CHAR_WIDTH))


def truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(limit - 1, 1)] + "…"


def _attributes(attributes: dict) -> str:
    return " ".join(f"{key.replace('_', '-')}={quoteattr(str(value))}" for key, value in attributes.items() if value is not None)


def _element(tag: str, content: str | None = None, **attributes) -> str:
    attrs = _attributes(attributes)
    if content is None:
        return f"<{tag} {attrs}/>"
    return f"<{tag} {attrs}>{content}</{tag}>"


def straight(x0: float, x1: float, y: float) -> str:
    return f"M{fmt(x0)} {fmt(y)}H{fmt(x1)}"


def bend(x0: float, y0: float, x1: float, y1: float) -> str:
    """A wire from (x0, y0) to (x1, y1), leaving and arriving horizontally."""
    if abs(y0 - y1) < 0.01:
        return straight(x0, x1, y0)
    middle = (x0 + x1) / 2
    return f"M{fmt(x0)} {fmt(y0)}C{fmt(middle)} {fmt(y0)} {fmt(middle)} {fmt(y1)} {fmt(x1)} {fmt(y1)}"


def _straight_key(d: str):
    """(x0, y, x1) as written, for a path drawn by :func:`straight`; else None."""
    if not d.startswith("M") or "H" not in d or any(c in d for c in "CVLZ"):
        return None
    start, x1 = d[1:].split("H")
    x0, y = start.split(" ")
    return x0, y, x1


def wire_y(top: float, k: int) -> float:
    """The height of wire k of a bundle whose name sits at ``top``."""
    return top + HEADER + PITCH * k + PITCH / 2


def bundle_height(wire_count: int) -> float:
    return HEADER + max(wire_count, 1) * PITCH


def _unique(items):
    return list(dict.fromkeys(items))


# ---- the drawing: SVG elements in layers, and what tests need to check the layout -----------


@dataclass
class Drawing:
    """SVG elements by layer, plus the rectangles of every label and box (for layout checks)."""

    width: float = 0
    height: float = 0
    layers: dict = field(default_factory=lambda: {name: [] for name in ("boxes", "wires", "marks", "labels")})
    label_rects: list = field(default_factory=list)  # (x0, y0, x1, y1, text)
    box_rects: list = field(default_factory=list)  # (x0, y0, x1, y1, statement target)
    transfers: list = field(default_factory=list)  # (kind, array, launch, x) of every load and save mark
    levels: list = field(default_factory=list)  # the levels drawn, top first
    pieces: list = field(default_factory=list)  # (layer, d, style) of every path
    piece_slots: list = field(default_factory=list)  # where each path sits in its layer
    open_ends: dict = field(default_factory=dict)  # (layer, y, x end, style...) -> piece

    def add(self, layer: str, element: str):
        self.layers[layer].append(element)

    def text(self, x, y, text, *, size=LABEL_SIZE, anchor="start", bold=False, fill="#000000", title=None, background=True):
        """A label with its baseline at y; a white backing keeps wires from striking through it."""
        width = text_width(text, size)
        x0 = {"start": x, "middle": x - width / 2, "end": x - width}[anchor]
        top, bottom = y - 0.8 * size, y + 0.25 * size
        self.label_rects.append((x0, top, x0 + width, bottom, text))
        if background:
            self.add("labels", _element("rect", x=fmt(x0 - 1), y=fmt(top), width=fmt(width + 2), height=fmt(bottom - top),
                                        fill="#ffffff", fill_opacity="0.85"))
        content = escape(text) if title is None else f"<title>{escape(title)}</title>{escape(text)}"
        self.add("labels", _element("text", content, x=fmt(x), y=fmt(y), font_size=size, text_anchor=anchor if anchor != "start" else None,
                                    font_weight="bold" if bold else None, fill=fill if fill != "#000000" else None))

    def path(self, layer, d, *, stroke, width=WIRE_WIDTH, dash=None, fill="none", cap=None, merge=True):
        style = {"fill": fill, "stroke": stroke, "stroke_width": fmt(width), "stroke_dasharray": dash, "stroke_linecap": cap}
        key = _straight_key(d) if merge else None
        if key is not None:
            # A wire runs straight through several zones: extend its last piece rather than
            # abut a new one, so that no seam shows where two pieces meet.
            x0, y, x1 = key
            index = self.open_ends.pop((layer, y, x0, *style.values()), None)
            if index is not None:
                start = _straight_key(self.pieces[index][1])[0]
                d = f"M{start} {y}H{x1}"
                self.pieces[index] = (layer, d, style)
                self.layers[layer][self.piece_slots[index]] = _element("path", d=d, **style)
                self.open_ends[(layer, y, x1, *style.values())] = index
                return
            self.open_ends[(layer, y, x1, *style.values())] = len(self.pieces)
        self.pieces.append((layer, d, style))
        self.piece_slots.append(len(self.layers[layer]))
        self.add(layer, _element("path", d=d, **style))

    def dot(self, x, y, colour, radius=3.0):
        self.add("marks", _element("circle", cx=fmt(x), cy=fmt(y), r=fmt(radius), fill=colour))

    def svg(self, title: str, description: str) -> str:
        size = {"width": fmt(self.width), "height": fmt(self.height), "viewBox": f"0 0 {fmt(self.width)} {fmt(self.height)}"}
        head = f'<svg {_attributes(dict(xmlns="http://www.w3.org/2000/svg", **size, font_family=FONT_FAMILY, font_size=LABEL_SIZE))}>'
        lines = [head, f"<title>{escape(title)}</title>", f"<desc>{escape(description)}</desc>",
                 _element("rect", x=0, y=0, width=fmt(self.width), height=fmt(self.height), fill="#ffffff")]
        for name, elements in self.layers.items():
            lines.append(f'<g class="{name}">')
            lines.extend(elements)
            lines.append("</g>")
        lines.append("</svg>")
        return "\n".join(lines) + "\n"


# ---- levels ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Levels:
    """Which level each array lives at, where boxes run, and the colour of each level."""

    order: tuple  # every level that can be drawn, top first
    top: str
    compute: str  # where boxes run and intermediates stay ("on chip")
    of_array: dict
    hardware: str | None

    @property
    def drawn(self) -> list[str]:
        used = {self.top, self.compute, *self.of_array.values()}
        return [level for level in self.order if level in used]

    def colour(self, level: str) -> str:
        # Colour by rank among the levels drawn, so the on-chip level is orange even on a
        # deep hierarchy whose intermediate levels this kernel never touches.
        rank = self.drawn.index(level)
        return LEVEL_COLOURS[min(rank, len(LEVEL_COLOURS) - 1)]

    def role(self, level: str) -> str:
        if level == self.top:
            return "top level"
        if level == self.compute:
            return "on chip"
        return "materialised"

    def transfer(self, source: str, destination: str) -> str:
        """'load' for a move down the hierarchy, 'save' for a move up."""
        return "load" if self.order.index(source) < self.order.index(destination) else "save"


def plan_levels(kernel, program, hardware: str | None = None, diagram: Diagram | None = None) -> Levels:
    """Levels of the drawing, read off ``program`` (the Program the drawing shows): its top and
    compute levels, and each array's home, the top level for the kernel's parameters and for
    every array the Program moves (loads or saves), the compute level for the rest. Named after
    ``hardware``'s levels when the drawing names one; otherwise as "top level" and "on chip"
    (a top level the kernel writes, ``@gmem`` or ``@l0``, keeps its name). ``diagram``: the
    diagram drawn, when it is not the kernel's (``drawn_diagram``: a split's part arrays)."""
    diagram = diagram or kernel.diagram
    if hardware is not None:
        order = tuple(program.hardware.level_names())
        top, compute = program.levels[0], program.schedule.compute_level
    else:
        tops = {load_hardware(name).top.name for name in hardware_names()}
        top = next((s.level for s in diagram.statements if s.level in tops), "top level")
        compute = "on chip"
        order = (top, compute)
    moved = {step.array for launch in program.launches for step, _ in walk(launch.body) if step.op in ("load", "save")}
    of_array = {name: top if name in diagram.params or name in moved else compute for name in diagram.arrays}
    return Levels(order, top, compute, of_array, hardware)


# ---- labels ----------------------------------------------------------------------------------

# Masks bind looser than arithmetic: or < and < comparisons < + - < * / < ^ (as the grammar reads them).
_PRECEDENCE = {"or": -2, "and": -1, "ge": 0, "gt": 0, "le": 0, "lt": 0, "eq": 0, "ne": 0,
               "add": 1, "sub": 1, "mul": 2, "div": 2, "pow": 3}
_SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "^", "ge": ">=", "gt": ">", "le": "<=", "lt": "<",
            "eq": "==", "ne": "!=", "and": "and", "or": "or"}


def size_text(expr) -> str:
    return str(expr).replace("**", "^")


def expression_text(expr, indexed: bool = False) -> str:
    """An elementwise expression with arrays by name only: ``gelu(H + bias)``. ``indexed``: inside
    a comparison, where an axis name is an index, so a size prints as ``len(x)``."""
    if isinstance(expr, Read):
        return expr.array
    if isinstance(expr, Index):  # the element's index along an axis (a mask's q >= x)
        return expr.axis
    if isinstance(expr, Const) and expr.value.is_infinite:
        return "inf" if expr.value > 0 else "-inf"
    if isinstance(expr, Const) and expr.value.free_symbols and indexed:
        return diagram_size_text(expr.value)  # sizes beside indices read len(x)
    if isinstance(expr, Const):
        return size_text(expr.value)
    if isinstance(expr, ScalarParam):
        return expr.name
    if isinstance(expr, Apply) and expr.fn in _PRECEDENCE and len(expr.args) == 2:
        mine = _PRECEDENCE[expr.fn]
        parts = []
        for position, arg in enumerate(expr.args):
            text = expression_text(arg, indexed or _PRECEDENCE[expr.fn] <= 0)
            theirs = _PRECEDENCE.get(arg.fn, 9) if isinstance(arg, Apply) else 9
            # a - (b - c) and a / (b * c) keep their brackets; a - b - c needs none.
            if theirs < mine or (position == 1 and theirs == mine and expr.fn in ("sub", "div", "pow")):
                text = f"({text})"
            parts.append(text)
        return f"{parts[0]} {_SYMBOLS[expr.fn]} {parts[1]}"
    if isinstance(expr, Apply) and expr.fn == "neg":
        return f"-{expression_text(expr.args[0], indexed)}"
    if isinstance(expr, Apply) and expr.fn == "not":
        return f"not {expression_text(expr.args[0], True)}"
    if isinstance(expr, Apply):
        return f"{expr.fn}({', '.join(expression_text(a, indexed) for a in expr.args)})"
    return str(expr)


def box_label(statement: Statement) -> str:
    """The text inside a box: what it does, in a few characters."""
    box = statement.box
    if isinstance(box, Contract):
        text = f"contract {' '.join(box.contracted)}"
        return text + (f" × {expression_text(box.scale)}" if box.scale is not None else "")
    if isinstance(box, (Softmax, Scan)):
        operand = "" if isinstance(box.operand, Read) else f"({expression_text(box.operand)})"
        return f"{'softmax' if isinstance(box, Softmax) else box.name}[{box.axis}]{operand}"
    if isinstance(box, Reduce):
        operand = "" if isinstance(box.operand, Read) else f"({expression_text(box.operand)})"
        return f"{box.op}[{' '.join(box.axes)}]{operand}"
    if isinstance(box, Opaque):
        return box.box.name
    return expression_text(box.expr)


def axis_text(diagram: Diagram, axis: str) -> str:
    """A wire's label: its name, and its size when the size is not the name itself."""
    if axis == "":
        return "()"
    name = truncate(axis, MAX_AXIS_CHARS)
    size = size_text(diagram.size(axis))
    return name if size == axis else f"{name}={truncate(size, 10)}"


# A wire's label names its partitions by a letter: g(roup), s(tream), and p(arts) for a split,
# whose initial would be a stream's.
PARTITION_LETTERS = {"group": "g", "stream": "s", "split": "p"}


@dataclass(frozen=True)
class Partitions:
    """The relabel block's partitions by axis, when the drawing shows them."""

    by_axis: dict  # axis -> list of (kind, size)

    def mark(self, axis: str) -> str:
        return " ".join(f"{PARTITION_LETTERS[kind]}={size}" for kind, size in self.by_axis.get(axis, ()))

    def grouped(self, axis: str) -> bool:
        return any(kind == "group" for kind, _ in self.by_axis.get(axis, ()))

    def streamed(self, axis: str) -> bool:
        return any(kind == "stream" for kind, _ in self.by_axis.get(axis, ()))


def plan_partitions(kernel, relabelled: bool) -> Partitions:
    by_axis: dict = {}
    if relabelled and kernel.relabel is not None:
        for clauses in kernel.relabel.levels:
            for partition in clauses.partitions:
                by_axis.setdefault(partition.axis, []).append((partition.kind, partition.size))
    return Partitions(by_axis)


# ---- a split: the combine launch drawn as columns ---------------------------------------------


@dataclass(frozen=True)
class DrawnDiagram:
    """The diagram the drawing lays out: the kernel's, or, for a Program with a split, one with
    the combine launch's columns in it (``drawn_diagram``).

    ``column_of`` maps (launch, statement index) of the Program to the column that draws that
    statement's steps in that launch; ``spawned`` are the part arrays, whose bundles begin in the
    gap before their first reader (the parts launch leaves them on chip and saves them there).
    """

    diagram: Diagram
    column_of: dict
    spawned: frozenset = frozenset()
    statements: dict = field(default_factory=dict)  # column -> the kernel's statement it draws (costs)

    def column(self, launch: int, statement: Statement) -> int:
        return self.column_of.get((launch, statement.index), statement.index)

    def first_column(self, launch) -> int:
        """The first column drawing a launch (a ``LaunchProgram``)."""
        drawn = [column for (index, _), column in self.column_of.items() if index == launch.index]
        return min(drawn) if drawn else launch.launch.statements[0].index


def _named_states(diagram: Diagram, steps, statement: Statement) -> set:
    """The statements whose state buffers (``P.max``, ``P.scale``) a statement's steps read."""
    prefixes = {s.target + ".": s for s in diagram.statements}
    used = {statement.index}
    for step in steps:
        for _, name in step.reads:
            used |= {s.index for prefix, s in prefixes.items() if name.startswith(prefix)}
    return used


def drawn_diagram(diagram: Diagram, program: Program) -> DrawnDiagram:
    """The diagram as the drawing shows a Program with splits.

    The parts launch keeps its statements' columns, but a statement whose result the combine
    forms (a sum, a contraction) leaves its column as its accumulator (``O.acc``: each part's
    alone, which nothing after reads). The part arrays the parts launch saves (``O.acc.part``,
    ``P.max.part``, with the part axis ``x#``) are saved in the gap after the parts' columns and
    loaded by a ``merge x#`` box per result the combine forms (the states merged part by part,
    the woven axes passing over the box), which the combine launch saves; the statements after
    the merge follow in their own columns. Without a split, the kernel's diagram.
    """
    combines = [lp for lp in program.launches if lp.combine is not None]
    if not combines:
        return DrawnDiagram(diagram, {})
    compute = program.schedule.compute_level
    arrays, axes = dict(diagram.arrays), dict(diagram.axes)
    order: list = []  # (kind, statement, launch index, part reads) in drawing order
    column_of: dict = {}
    spawned: set = set()
    combined = {lp.index: lp for lp in combines}
    for lp in program.launches:
        if lp.index in combined:
            continue
        if lp.index + 1 not in combined:  # a launch without a split: its statements as written
            order += [("plain", s, lp.index, ()) for s in lp.launch.statements]
            continue
        combine = combined[lp.index + 1]
        part = next(node.part for node in _loops(lp.body) if node.part is not None)
        trips = next(node.trips for node in _loops(combine.body) if node.axis == part)
        axes[part] = dataclasses.replace(diagram.axes[combine.combine], name=part, size=algebra.as_expr(trips))
        parts_steps = [step for step, _ in walk(lp.body)]
        combine_steps = [step for step, _ in walk(combine.body)]
        saved = {}  # statement index -> its part arrays, as the parts launch saves them
        for step in parts_steps:
            if step.op == "save" and step.level == compute and step.statement is not None:
                saved.setdefault(step.statement.index, []).append(step.array)
                arrays[step.array] = Array(step.array, step.dtype, tuple(step.axes), "intermediate")
                spawned.add(step.array)
        in_parts = {step.statement.index for step in parts_steps if step.statement is not None}
        formed = [s for s in lp.launch.statements if any(step.op == "finalise" and step.statement is s for step in combine_steps)]
        merged = {step.statement.index for step in combine_steps if step.op == "merge"}
        post = [s for s in lp.launch.statements if s.index not in in_parts and s.index not in merged and s not in formed]
        for s in lp.launch.statements:
            if s.index not in in_parts:
                continue
            if s in formed:  # each part's accumulator: the combine forms the result
                acc = f"{s.target}.acc"
                arrays[acc] = Array(acc, next(step.dtype for step in parts_steps if step.statement is s), s.axes, "intermediate")
                order.append(("acc", s, lp.index, ()))
            else:
                order.append(("plain", s, lp.index, ()))
        readers: dict = {}
        for s in formed:
            needs = _named_states(diagram, [step for step in combine_steps if step.statement is s], s)
            reads = [name for index in sorted(needs) for name in saved.get(index, [])]
            readers[s.index] = reads
        unread = [name for index in sorted(saved) for name in saved[index] if not any(name in r for r in readers.values())]
        if formed and unread:
            readers[formed[-1].index] = readers[formed[-1].index] + unread
        for s in formed:
            order.append(("merge", s, combine.index, tuple(readers[s.index])))
        # the merged statements the combine forms nothing of: their merge steps are drawn by
        # the merge box that reads their states
        for index in sorted(merged - {s.index for s in formed}):
            reader = next((s for s in formed if any(name in readers[s.index] for name in saved.get(index, []))), formed[-1] if formed else None)
            if reader is not None:
                column_of[(combine.index, index)] = ("merge", reader.index)
        order += [("plain", s, combine.index, ()) for s in post]
    statements, drawn = [], {}
    keys = {}
    for column, (kind, s, launch, reads) in enumerate(order):
        keys[(kind if kind == "merge" else "statement", s.index, launch)] = column
        drawn[column] = s
        if kind == "acc":
            statements.append(dataclasses.replace(s, index=column, target=f"{s.target}.acc"))
        elif kind == "merge":
            part = arrays[reads[0]].axes[0] if reads else ""
            signature = BoxSignature(f"merge {part}", tuple((arrays[r].dtype, (part,)) for r in reads), ((s.dtype, ()),))
            box = Opaque(signature, tuple(Read(r, arrays[r].axes) for r in reads))
            statements.append(dataclasses.replace(s, index=column, box=box, woven=s.axes, consumed=(part,), inputs=tuple(reads),
                                                  flops={}, level=None))
        else:
            statements.append(dataclasses.replace(s, index=column))
    for (_, index, launch), column in keys.items():
        column_of[(launch, index)] = column
    for key, target in list(column_of.items()):
        if isinstance(target, tuple):
            column_of[key] = keys[("merge", target[1], key[0])]
    # a statement's result formed by its merge box: the Program saves it from the combine launch
    drawn_view = dataclasses.replace(diagram, axes=axes, arrays=arrays, statements=tuple(statements))
    return DrawnDiagram(drawn_view, column_of, frozenset(spawned), drawn)


def _loops(body):
    for node in body:
        if isinstance(node, Loop):
            yield node
            yield from _loops(node.body)


# ---- the plan: which bundles sit where in each column -----------------------------------------


@dataclass
class Column:
    """One statement: its operands, the arrays passing under it, and its box's wires."""

    statement: Statement
    inputs: list  # arrays entering the box, top to bottom
    passing: list  # arrays running under the box (including copies of inputs used later)
    lanes: list  # woven axes, passing over the box, top to bottom
    in_ports: list  # (array, axis) wires entering the box
    out_ports: list  # axes leaving the box
    label: str = ""
    # horizontal zones, left to right (set by the layout)
    gap: float = 0
    entry: float = 0
    inner: float = 0
    zone: float = 0
    outer: float = 0
    exit: float = 0
    end: float = 0
    box_width: float = 0
    load_x: float = 0
    save_x: float = 0
    # heights (set by the layout)
    input_tops: list = field(default_factory=list)
    lane_ys: list = field(default_factory=list)
    in_port_ys: list = field(default_factory=list)
    out_port_ys: list = field(default_factory=list)
    label_y: float = 0
    box_top: float = 0
    box_bottom: float = 0


def wires_of(diagram: Diagram, array: str) -> tuple:
    """An array's wires; an array without axes is drawn as one unlabelled wire."""
    return diagram.arrays[array].axes or ("",)


def _ports(diagram: Diagram, statement: Statement, inputs: list) -> tuple[list, list]:
    box = statement.box
    lanes = [a for a in statement.axes if a in statement.woven]
    if isinstance(box, Opaque):
        in_ports = []
        for read, (_, box_axes) in zip(box.args, box.box.inputs, strict=False):
            in_ports += [(read.array, axis) for axis in box_axes]
        produced = box.box.outputs[0][1]
        out_ports = [a for a in produced if a not in lanes]
    else:
        acted_on = list(statement.consumed)
        in_ports = [(array, axis) for axis in acted_on for array in inputs if axis in diagram.arrays[array].axes]
        out_ports = [a for a in statement.axes if a not in lanes]
    # An operand without axes, or with a wire that neither passes over nor enters the box
    # (never produced by the checker today), still needs a way in.
    for array in inputs:
        for axis in wires_of(diagram, array):
            if (array, axis) not in in_ports and (axis == "" or axis not in lanes):
                in_ports.append((array, axis))
    if not statement.axes:
        out_ports = [""]
    return in_ports, out_ports


def plan_columns(diagram: Diagram) -> tuple[list, list, list]:
    """Columns, the bundles at the left edge, and the bundles at the right edge.

    The arrays a box reads move to the top of the column, everything else still needed later
    passes underneath in a stable order; the box's result takes the top on the right.
    """
    statements = diagram.statements
    last_use = {}
    for s in statements:
        for array in s.inputs:
            last_use[array] = s.index

    def live_after(array: str, index: int) -> bool:
        return array in diagram.outputs or last_use.get(array, -1) > index

    params = [p for p in diagram.params if p in diagram.arrays]
    state = [p for p in params if live_after(p, -1)]
    columns = []
    for s in statements:
        if isinstance(s.box, Opaque):
            inputs = _unique(read.array for read in s.box.args)  # the box's port order matters
        else:
            inputs = sorted(s.inputs, key=lambda a: state.index(a) if a in state else len(state))
        passing = [a for a in state if a not in inputs or live_after(a, s.index)]
        in_ports, out_ports = _ports(diagram, s, inputs)
        lanes = [a for a in s.axes if a in s.woven]
        columns.append(Column(s, inputs, passing, lanes, in_ports, out_ports, label=box_label(s)))
        state = ([s.target] if live_after(s.target, s.index) else []) + passing
    unused = [p for p in params if not live_after(p, -1)]
    return columns, unused, state


# ---- residency: where the Program moves each array, column by column ----------------------


@dataclass
class Residency:
    """The Program's loads and saves at the compute level, placed on the drawing's columns.

    Per column (statement): ``gap_moves`` maps an array to the ``(kind, launch)`` of the
    transfers drawn in the gap before the column, in order (a result saved after its last
    reader in one launch and loaded there for several readers of the next has two); ``entry_loads`` maps an array loaded at the column's
    entry (for this column alone) to its launch; ``exit_saves`` is the launch of the column's
    result when it is saved at the exit, else None; ``chip_in`` and ``chip_out`` are the arrays
    homed at the top level whose bundle is on chip as it enters and as it leaves the column.
    ``right_saves`` maps a result saved right of the last column to its launch.
    """

    gap_moves: list
    entry_loads: list
    exit_saves: list
    chip_in: list
    chip_out: list
    right_saves: dict


def plan_residency(program: Program, columns: list, view: DrawnDiagram | None = None) -> Residency:
    """Read the drawing's loads, saves and residency off the Program (one source of truth).

    Each load or save step of the Program into or out of the compute level is one mark, in
    the launch whose steps it is. A load is drawn for the statements whose steps read the
    loaded buffer, up to the next load of the same array: at the entry of its one reader, or,
    with several readers, in the gap before the first, before the array is copied; the bundle
    stays on chip until the last of them. A save is drawn after the last statement of its
    launch that reads the result on chip (the Program saves it when it is computed and keeps
    the on-chip copy for those readers; the drawing has one bundle per array): at the result's
    exit when none does, else in the gap after the last reader, or right of the last column.
    An array read again in a later launch passes at its own level after its last reader in a
    launch: the Program drops the on-chip copy there, and nothing moves. With a split (``view``),
    steps are placed on the columns that draw them, and a part array's save is drawn in the gap
    before its first reader, the merge box that loads it.
    """
    view = view or DrawnDiagram(program.diagram, {})
    drawn = view.diagram
    compute = program.schedule.compute_level
    count = len(columns)
    residency = Residency([{} for _ in range(count)], [{} for _ in range(count)], [None] * count,
                          [set() for _ in range(count)], [set() for _ in range(count)], {})
    for launch in program.launches:
        sequence = [step for step, _ in walk(launch.body)]
        column = functools.partial(view.column, launch.index)
        first_statement = view.first_column(launch)
        for position, step in enumerate(sequence):
            if step.op not in ("load", "save") or step.level != compute:
                continue
            array, here = step.array, launch.index
            if step.op == "save" and array in view.spawned:
                reader = min(s.index for s in drawn.statements if array in s.inputs)
                residency.gap_moves[reader].setdefault(array, []).append(("save", here))
                continue
            if step.op == "load":
                readers = []
                for later in sequence[position + 1:]:
                    if later.op == "load" and later.level == compute and later.array == array:
                        break  # loaded again: later readers read that copy
                    if later.statement is not None and (compute, array) in later.reads:
                        readers.append(column(later.statement))
                readers = sorted(set(readers)) or [next((column(s) for s in launch.launch.statements if array in s.inputs), first_statement)]
                first, last = readers[0], readers[-1]
                if first == last:
                    residency.entry_loads[first][array] = here
                    continue
                residency.gap_moves[first].setdefault(array, []).append(("load", here))
                for index in range(first, last + 1):
                    residency.chip_in[index].add(array)
                for index in range(first, last):
                    residency.chip_out[index].add(array)
                continue
            producer = drawn.producer(array)
            made = producer.index if producer is not None else first_statement
            readers = [column(later.statement) for later in sequence if later.statement is not None
                       and column(later.statement) != made and (compute, array) in later.reads]
            last = max(readers, default=made)
            if last == made:
                residency.exit_saves[made] = here
                continue
            for index in range(made, last + 1):
                residency.chip_out[index].add(array)
            for index in range(made + 1, last + 1):
                residency.chip_in[index].add(array)
            if last + 1 < count:
                residency.gap_moves[last + 1].setdefault(array, []).append(("save", here))
            else:
                residency.right_saves[array] = here
    return residency


# ---- horizontal layout -----------------------------------------------------------------------


def _header(diagram: Diagram, array: str) -> str:
    return f"{truncate(array, MAX_NAME_CHARS)} {diagram.arrays[array].dtype}"


def _max_width(texts, size) -> float:
    return max((text_width(t, size) for t in texts), default=0)


class Renderer:
    """Lays out and draws one kernel: plan, then x positions, then heights, then elements."""

    def __init__(self, kernel, relabelled: bool, program: Program, costs: CostTable | None, hardware: str | None):
        self.kernel = kernel
        self.diagram: Diagram = kernel.diagram
        self.relabelled = relabelled
        self.costs = costs
        self.view = drawn_diagram(kernel.diagram, program)
        self.diagram = self.view.diagram
        self.levels = plan_levels(kernel, program, hardware, self.diagram)
        self.partitions = plan_partitions(kernel, relabelled)
        self.columns, self.unused, self.final = plan_columns(self.diagram)
        self.residency = plan_residency(program, self.columns, self.view)
        residency = self.residency
        self.gap_moves, self.entry_loads, self.exit_saves = residency.gap_moves, residency.entry_loads, residency.exit_saves
        self.chip_in, self.chip_out, self.right_saves = residency.chip_in, residency.chip_out, residency.right_saves
        self.drawing = Drawing()
        self.top = 0.0
        self.pass_top = 0.0
        self.bottom = 0.0
        self.marks: set = set()  # the kinds of mark drawn, which the legend explains

    # -- facts about arrays
    def wire_count(self, array: str) -> int:
        return len(wires_of(self.diagram, array))

    def height(self, array: str) -> float:
        return bundle_height(self.wire_count(array))

    def level_of(self, array: str) -> str:
        return self.levels.of_array[array]

    def loaded(self, array: str) -> bool:
        """Whether an array lives off chip (at the top level or a materialised one)."""
        return self.level_of(array) != self.levels.compute

    def level_in(self, array: str, index: int) -> str:
        """The level of an array's bundle in column ``index`` (after the gap before it)."""
        return self.levels.compute if array in self.chip_in[index] else self.level_of(array)

    def level_leaving(self, array: str, index: int) -> str:
        """The level of an array's bundle as it leaves column ``index`` (-1: the left edge)."""
        return self.levels.compute if index >= 0 and array in self.chip_out[index] else self.level_of(array)

    def wire_labels(self, array: str, level: str) -> list[str]:
        """Labels of an array's wires at a level: on chip, partitioned axes show their parts."""
        on_chip = level != self.levels.top
        labels = []
        for axis in wires_of(self.diagram, array):
            mark = self.partitions.mark(axis) if on_chip and axis else ""
            labels.append(f"{axis_text(self.diagram, axis)} {mark}" if mark else axis_text(self.diagram, axis))
        return labels

    def partitioned(self, array: str) -> bool:
        return any(self.partitions.mark(axis) for axis in wires_of(self.diagram, array) if axis)

    # -- where bundles sit
    def stack(self, arrays: list, start: float) -> list:
        placed, y = [], start
        for array in arrays:
            placed.append((array, y))
            y += self.height(array) + BUNDLE_GAP
        return placed

    def left_edge(self) -> list:
        """(array, top) of the parameters: placed where the first column wants them, each once."""
        if not self.columns:
            return self.stack(self.unused, self.top)
        first = self.columns[0]
        placed = list(zip(first.inputs, first.input_tops, strict=False))
        placed += [(a, t) for a, t in self.stack(first.passing, self.pass_top) if a not in first.inputs]
        below = max((t + self.height(a) + BUNDLE_GAP for a, t in placed), default=self.pass_top)
        return placed + self.stack(self.unused, max(below, self.pass_top))

    def arrival(self, column: Column) -> list:
        """(array, top) of the bundles entering a column: operands first, then the rest."""
        return list(zip(column.inputs, column.input_tops, strict=False)) + self.stack(column.passing, self.pass_top)

    def departure(self, column: Column) -> list:
        """(array, top) of the bundles leaving a column: its result on top, then the rest."""
        result = column.statement.target
        placed = [(result, self.top)] if result in self.after(column) else []
        return placed + self.stack(column.passing, self.pass_top)

    def after(self, column: Column) -> list:
        """The arrays still needed after a column."""
        index = column.statement.index
        if index + 1 < len(self.columns):
            following = self.columns[index + 1]
            return _unique(following.inputs + following.passing)
        return self.final

    def before(self, column: Column) -> list:
        index = column.statement.index
        return self.left_edge() if index == 0 else self.departure(self.columns[index - 1])

    def moved(self, array: str, column: Column) -> bool:
        """Whether an operand arrives from somewhere else than straight ahead (so it needs its name)."""
        starts = [t for a, t in self.before(column) if a == array]
        ends = [t for a, t in self.arrival(column) if a == array]
        return len(ends) > 1 or starts != ends[:1]

    # -- heights
    def layout_y(self, top: float):
        """Heights of every column; ``top`` is where the first bundle's name sits."""
        self.top = top
        core = 0.0
        for column in self.columns:
            column.input_tops = [t for _, t in self.stack(column.inputs, top)]
            inputs_bottom = max((t + self.height(a) for a, t in zip(column.inputs, column.input_tops, strict=False)), default=top)
            column.lane_ys = [wire_y(top, k) for k in range(len(column.lanes))]
            port_top = wire_y(top, len(column.lanes)) + (LANE_GAP if column.lanes else 0)
            box = column.statement.box
            keeps_axis = isinstance(box, (Softmax, Scan))
            rows = len(column.in_ports) if keeps_axis else max(len(column.in_ports), len(column.out_ports))
            column.in_port_ys = [port_top + PITCH * j for j in range(len(column.in_ports))]
            if keeps_axis and column.in_port_ys:
                # Softmax keeps its axis: the wire leaves the triangle where the inputs meet.
                middle = sum(column.in_port_ys) / len(column.in_port_ys)
                column.out_port_ys = [middle for _ in column.out_ports]
            else:
                column.out_port_ys = [port_top + PITCH * j for j in range(len(column.out_ports))]
            label_centre = port_top + PITCH * rows
            column.label_y = label_centre + 3.5
            column.box_top = (column.lane_ys[0] if column.lane_ys else port_top) - PITCH / 2 - 2
            column.box_bottom = label_centre + PITCH / 2 + 2
            output_bottom = top + self.height(column.statement.target)
            core = max(core, inputs_bottom - top, column.box_bottom - top, output_bottom - top)
        self.pass_top = top + core + 2 * BUNDLE_GAP

    # -- widths
    def box_width(self, column: Column) -> float:
        box = column.statement.box
        size = HEADER_SIZE if isinstance(box, Opaque) else LABEL_SIZE
        width = text_width(truncate(column.label, MAX_BOX_CHARS), size) + 16
        if isinstance(box, Contract):
            tallest = max((ys[-1] - ys[0] for ys in self.cap_groups(column).values()), default=0)
            width = max(width, 36 + cap_bulge(tallest))
        elif isinstance(box, (Softmax, Scan)):
            width = max(width, 52)
        elif isinstance(box, Reduce):
            width = max(width, 24 + text_width(box.op, SMALL_SIZE) + 10)
        elif isinstance(box, Opaque):
            ins = _max_width((axis_text(self.diagram, a) for _, a in column.in_ports), SMALL_SIZE)
            outs = _max_width((axis_text(self.diagram, a) for a in column.out_ports), SMALL_SIZE)
            width = max(width, ins + outs + 28)
        return max(width, MIN_BOX_WIDTH)

    def cost_cells(self, index: int) -> list[tuple[str, str]]:
        """(shown, full) text of a column's cost cells: its label, M, H. The costs are per
        statement of the kernel (``cost.statement_columns``, both launches of a split in one):
        a statement drawn in two columns (its parts', then its merge box) has them under the
        first, and the merge box says where they are."""
        if self.costs is None:
            return []
        if not self.view.statements:
            return self.costs.cells[index]
        statement = self.view.statements[index]
        first = min(c for c, s in self.view.statements.items() if s.index == statement.index)
        cells = self.costs.cells[statement.index]
        if first == index:
            return cells
        label = self.columns[index].label
        where = f"counted in column {first + 1} ({statement.target}), with its parts"
        return [(truncate(label, MAX_NAME_CHARS), label)] + [("-", where) for _ in cells[1:]]

    def transfer_tag(self, source: str, destination: str) -> str:
        return self.levels.transfer(source, destination)

    def entry_width(self, column: Column) -> float:
        """Room for the operands' names, their load marks and (relabelled) on-chip labels."""
        named = [a for a in column.inputs if self.moved(a, column)]
        names = _max_width((truncate(a, MAX_NAME_CHARS) for a in named), HEADER_SIZE)
        index = column.statement.index
        loaded = [a for a in column.inputs if a in self.entry_loads[index]]
        if not loaded:
            column.load_x = column.entry
            width = max(8 + names + 8, 10)
            if self.relabelled:  # labels of operands already on chip, loaded for an earlier reader
                held = [lab for a in column.inputs if self.loaded(a) and self.partitioned(a) for lab in self.wire_labels(a, self.levels.compute)]
                width = max(width, 6 + _max_width(held, LABEL_SIZE) + 8)
            return width
        tag = max(text_width(self.transfer_tag(self.level_of(a), self.levels.compute), LABEL_SIZE) for a in loaded)
        offset = 6 + (names + 8 if names else 0) + tag / 2
        column.load_x = column.entry + offset
        width = offset + tag / 2 + 8
        if self.relabelled:
            labels = [lab for a in loaded if self.partitioned(a) for lab in self.wire_labels(a, self.levels.compute)]
            if labels:
                width = max(width, offset + 6 + _max_width(labels, LABEL_SIZE) + 8)
            held = [lab for a in column.inputs if self.loaded(a) and a not in loaded and self.partitioned(a)
                    for lab in self.wire_labels(a, self.levels.compute)]
            width = max(width, 6 + _max_width(held, LABEL_SIZE) + 8)
        return width

    def exit_width(self, column: Column) -> float:
        """Room for the result's name and labels, and its save mark."""
        target = column.statement.target
        texts = self.wire_labels(target, self.levels.compute)
        width = max(text_width(_header(self.diagram, target), HEADER_SIZE), _max_width(texts, LABEL_SIZE))
        if self.exit_saves[column.statement.index] is None:
            return 8 + width + 12
        tag = text_width(self.transfer_tag(self.levels.compute, self.level_of(target)), LABEL_SIZE)
        column.save_x = column.exit + 8 + width + 10 + tag / 2
        return 8 + width + 10 + tag + 8

    def gap_width(self, column: Column) -> float:
        """Bundles that move between columns get room to bend in proportion to how far they go."""
        shift, copies = 0.0, False
        after = self.arrival(column)
        for array, top in self.before(column):
            ends = [t for a, t in after if a == array]
            copies = copies or len(ends) > 1
            shift = max([shift] + [abs(t - top) for t in ends])
        depth = max(map(len, self.gap_moves[column.statement.index].values()), default=0)
        moves = depth * move_step(depth)
        if shift < 0.01 and not copies:
            return 10 + moves
        return route_width(shift) + moves

    def inner_shift(self, column: Column) -> float:
        """How far an operand wire travels to its lane or port."""
        shift = 0.0
        for array, top in zip(column.inputs, column.input_tops, strict=False):
            for k, axis in enumerate(wires_of(self.diagram, array)):
                ends = [y for port, y in zip(column.in_ports, column.in_port_ys, strict=False) if port == (array, axis)]
                if not ends and axis in column.lanes:
                    ends = [column.lane_ys[column.lanes.index(axis)]]
                shift = max([shift] + [abs(y - wire_y(top, k)) for y in ends])
        return shift

    def left_width(self) -> float:
        placed = [a for a, _ in self.left_edge()]
        heads = _max_width((_header(self.diagram, a) for a in placed), HEADER_SIZE)
        labels = _max_width((t for a in placed for t in self.wire_labels(a, self.levels.top)), LABEL_SIZE)
        rows = _max_width(self.costs.heads, LABEL_SIZE) if self.costs is not None else 0
        return max(heads, labels, rows, 24) + 14

    def right_names(self) -> float:
        """Where the outputs' names start, right of the last column (after any save mark)."""
        return 16 + (GAP_MOVE + 8 if self.right_saves else 0)

    def right_width(self) -> float:
        heads = _max_width((_header(self.diagram, a) for a in self.final), HEADER_SIZE)
        labels = _max_width((t for a in self.final for t in self.wire_labels(a, self.level_of(a))), LABEL_SIZE)
        totals = 16 + _max_width((shown for shown, _ in self.costs.totals), LABEL_SIZE) if self.costs is not None else 0
        return max(self.right_names() + max(heads, labels), totals) + 8

    def layout_x(self):
        x = MARGIN + self.left_width()
        for index, column in enumerate(self.columns):
            column.gap = x
            x += self.gap_width(column)
            column.entry = x
            x += self.entry_width(column)
            column.inner = x
            x += route_width(self.inner_shift(column)) if column.inputs else 10
            column.box_width = self.box_width(column)
            column.zone = x
            x += max(column.box_width + 2 * BOX_MARGIN, _max_width((s for s, _ in self.cost_cells(index)), LABEL_SIZE) + 16)
            column.outer = x
            x += ROUTE_WIDTH
            column.exit = x
            x += self.exit_width(column)
            column.end = x
        self.right = x
        self.width = max(x + self.right_width(), *(MARGIN + text_width(t, TITLE_SIZE) for t in self.title_lines()[:1]),
                         MARGIN + _max_width(self.title_lines()[1:], LABEL_SIZE), MIN_WIDTH - MARGIN) + MARGIN

    # -- drawing helpers
    def colour(self, level: str) -> str:
        return self.levels.colour(level)

    def wire(self, d: str, axis: str, level: str, *, over: bool = False):
        """One wire. Streamed axes are dashed on chip; an axis-less array is dotted.

        A wire ``over`` a box never joins other pieces: one drawn before the box's halo would
        vanish under it.
        """
        dash = "5 3" if level != self.levels.top and axis and self.partitions.streamed(axis) else None
        if axis == "":
            dash = "2 2"
        # Round caps let the pieces of one wire overlap, so no hairline shows where they meet.
        self.drawing.path("wires", d, stroke=self.colour(level), dash=dash, cap="round" if dash is None else None, merge=not over)

    def bundle_straight(self, array: str, top: float, x0: float, x1: float, level: str):
        for k, axis in enumerate(wires_of(self.diagram, array)):
            self.wire(straight(x0, x1, wire_y(top, k)), axis, level)

    def name_label(self, array: str, top: float, x: float, *, dtype: bool = True):
        name = truncate(array, MAX_NAME_CHARS)
        self.drawing.text(x, top + 12, name, size=HEADER_SIZE, bold=True, title=array if name != array else None)
        if dtype:
            self.drawing.text(x + text_width(name + " ", HEADER_SIZE), top + 12, self.diagram.arrays[array].dtype, fill=MUTED)

    def axis_labels(self, array: str, top: float, x: float, level: str):
        d = self.drawing
        colour = self.colour(level)
        for k, (axis, text) in enumerate(zip(wires_of(self.diagram, array), self.wire_labels(array, level), strict=False)):
            y = wire_y(top, k) - 4
            d.text(x, y, text, fill=colour, title=axis if axis and truncate(axis, MAX_AXIS_CHARS) != axis else None)
            if level != self.levels.top and axis and self.partitions.grouped(axis):
                # A group partition boxes the label: the wire holds one group per core.
                d.add("labels", _element("rect", x=fmt(x - 2), y=fmt(y - 9), width=fmt(text_width(text, LABEL_SIZE) + 4),
                                         height=12, rx=2, fill="none", stroke=colour, stroke_width="0.8"))

    def dot(self, x: float, y: float, colour: str):
        self.marks.add("dot")
        self.drawing.dot(x, y, colour)

    def transfer_mark(self, x: float, top: float, array: str, kind: str, level: str, launch: int):
        """A bar across a bundle where it changes level, tagged load or save, in the new level's colour."""
        self.marks.add("bar")
        self.drawing.transfers.append((kind, array, launch, x))
        y0, y1 = wire_y(top, 0) - 6, wire_y(top, self.wire_count(array) - 1) + 6
        self.drawing.add("marks", _element("rect", x=fmt(x - 2), y=fmt(y0), width=4, height=fmt(y1 - y0), fill=self.colour(level)))
        self.drawing.text(x, top + 12, kind, anchor="middle", fill=self.colour(level))

    def separator(self, x0: float, x1: float, top: float):
        """The dashed line between two segments of a tuple, just above the lower bundle."""
        self.marks.add("dash")
        self.drawing.path("marks", straight(x0, x1, top - BUNDLE_GAP / 2), stroke=MUTED, width=0.8, dash="3 3")

    def end_caps(self, array: str, top: float, x: float, level: str):
        """A short bar where an array that nothing reads ends."""
        for k in range(self.wire_count(array)):
            y = wire_y(top, k)
            self.drawing.path("marks", f"M{fmt(x)} {fmt(y - 4)}V{fmt(y + 4)}", stroke=self.colour(level), width=1.6)

    # -- the edges
    def draw_left(self):
        x0, x1 = MARGIN, self.columns[0].gap if self.columns else self.right
        for i, (array, top) in enumerate(self.left_edge()):
            level = self.level_of(array)
            if array in self.unused:
                self.bundle_straight(array, top, x0, x1 - 6, level)
                self.end_caps(array, top, x1 - 6, level)
            else:
                self.bundle_straight(array, top, x0, x1, level)
            self.name_label(array, top, x0)
            self.axis_labels(array, top, x0, level)
            if i:
                self.separator(x0, x1, top)
            self.bottom = max(self.bottom, top + self.height(array))

    def draw_right(self):
        x0 = self.right
        last = self.departure(self.columns[-1]) if self.columns else []
        names = x0 + self.right_names()
        for i, (array, top) in enumerate(last):
            level = self.level_of(array)
            if array in self.right_saves:  # kept on chip for later readers: saved at last
                mark = x0 + GAP_MOVE - 6
                self.bundle_straight(array, top, x0, mark, self.levels.compute)
                self.bundle_straight(array, top, mark, self.width - MARGIN, level)
                self.transfer_mark(mark, top, array, self.transfer_tag(self.levels.compute, level), level, self.right_saves[array])
            else:
                self.bundle_straight(array, top, x0, self.width - MARGIN, level)
            self.name_label(array, top, names)
            if self.relabelled and self.partitioned(array):
                self.axis_labels(array, top, names, level)  # back at full size after the save
            if i:
                self.separator(x0, self.width - MARGIN, top)
            self.bottom = max(self.bottom, top + self.height(array))

    def draw_gap(self, column: Column):
        """Bundles bend from where the last column left them to where this one wants them.

        An array loaded once for several readers is loaded here, before it is copied; a result
        kept on chip for later readers is saved here, after the last of them (and may be loaded
        again here, for several readers of the next launch).
        """
        index = column.statement.index
        moves = self.gap_moves[index]
        depth = max(map(len, moves.values()), default=0)
        step, x1 = move_step(depth), column.entry
        after = self.arrival(column)
        before = self.before(column)
        # A split's part arrays begin here, on chip where the parts left them: saved by the
        # parts launch, then loaded by the combine's merge box.
        begun = [(a, t) for a, t in after if a in self.view.spawned and a not in {b for b, _ in before}]
        for array, top in begun:
            self.end_caps(array, top, column.gap, self.levels.compute)
        for array, top in before + begun:
            ends = [t for a, t in after if a == array]
            level = self.levels.compute if (array, top) in begun else self.level_leaving(array, index - 1)
            x0 = column.gap
            for kind, launch in moves.get(array, []):
                arrives = self.levels.compute if kind == "load" else self.level_of(array)
                mark = x0 + step - 8
                self.bundle_straight(array, top, x0, mark, level)
                self.transfer_mark(mark, top, array, kind, arrives, launch)
                x0, level = x0 + step, arrives
                self.bundle_straight(array, top, mark, x0, level)
            if x0 < column.gap + depth * step:  # bundles bend after the marks, all at once
                self.bundle_straight(array, top, x0, column.gap + depth * step, level)
                x0 = column.gap + depth * step
            for k, axis in enumerate(wires_of(self.diagram, array)):
                for end in ends:
                    self.wire(bend(x0, wire_y(top, k), x1, wire_y(end, k)), axis, level)
                if len(ends) > 1:  # the array is copied: one copy for the box, one for later
                    self.dot(x0, wire_y(top, k), self.colour(level))
            self.bottom = max([self.bottom] + [t + self.height(array) for t in ends])

    # -- a column
    def draw_column(self, column: Column):
        compute = self.levels.compute
        index = column.statement.index
        for array, top in self.stack(column.passing, self.pass_top):
            self.bundle_straight(array, top, column.entry, column.end, self.level_in(array, index))
        for i, (array, top) in enumerate(zip(column.inputs, column.input_tops, strict=False)):
            level = self.level_of(array)
            if array in self.entry_loads[index]:
                self.bundle_straight(array, top, column.entry, column.load_x, level)
                self.bundle_straight(array, top, column.load_x, column.inner, compute)
                self.transfer_mark(column.load_x, top, array, self.transfer_tag(level, compute), compute, self.entry_loads[index][array])
                if self.relabelled and self.partitioned(array):
                    self.axis_labels(array, top, column.load_x + 6, compute)
            else:
                self.bundle_straight(array, top, column.entry, column.inner, compute)
                if self.relabelled and self.loaded(array) and self.partitioned(array):
                    self.axis_labels(array, top, column.entry + 6, compute)  # on chip since an earlier load
            if self.moved(array, column):
                self.name_label(array, top, column.entry + 6, dtype=False)
            if i:
                # Operands that did not move continue the dashed line of the previous zone.
                self.separator(column.entry if self.moved(array, column) else column.gap, column.inner, top)
        self.draw_box(column)
        self.draw_routes_in(column)
        self.draw_routes_out(column)
        self.draw_exit(column)

    def draw_routes_in(self, column: Column):
        """Operand wires bend to the lanes over the box (woven axes) or to the box's ports."""
        compute = self.levels.compute
        x0, x1 = column.inner, column.zone
        arrivals: dict = {}
        for array, top in zip(column.inputs, column.input_tops, strict=False):
            for k, axis in enumerate(wires_of(self.diagram, array)):
                y = wire_y(top, k)
                ends = [py for port, py in zip(column.in_ports, column.in_port_ys, strict=False) if port == (array, axis)]
                if not ends and axis in column.lanes:
                    ends = [column.lane_ys[column.lanes.index(axis)]]
                    arrivals[ends[0]] = arrivals.get(ends[0], 0) + 1
                for end in ends:
                    self.wire(bend(x0, y, x1, end), axis, compute)
                if len(ends) > 1:
                    self.dot(x0, y, self.colour(compute))
        # Wires of one axis from several operands meet at a dot: a shared or broadcast axis.
        for lane_y, count in arrivals.items():
            if count > 1:
                self.dot(x1, lane_y, self.colour(compute))

    def draw_routes_out(self, column: Column):
        """Lanes and the box's outputs bend into the result's wire order."""
        compute = self.levels.compute
        for k, axis in enumerate(wires_of(self.diagram, column.statement.target)):
            if axis in column.lanes:
                y = column.lane_ys[column.lanes.index(axis)]
            else:
                y = column.out_port_ys[column.out_ports.index(axis)]
            self.wire(bend(column.outer, y, column.exit, wire_y(self.top, k)), axis, compute)

    def draw_exit(self, column: Column):
        compute = self.levels.compute
        target = column.statement.target
        launch = self.exit_saves[column.statement.index]
        saved = launch is not None
        level = self.level_of(target) if saved else compute
        live = target in self.after(column)
        end = column.end if live else column.end - 6
        if not saved:
            self.bundle_straight(target, self.top, column.exit, end, compute)
        else:
            self.bundle_straight(target, self.top, column.exit, column.save_x, compute)
            self.bundle_straight(target, self.top, column.save_x, end, level)
            self.transfer_mark(column.save_x, self.top, target, self.transfer_tag(compute, level), level, launch)
        if not live:
            self.end_caps(target, self.top, end, level)
        self.name_label(target, self.top, column.exit + 8)
        self.axis_labels(target, self.top, column.exit + 8, compute)

    # -- boxes
    def draw_box(self, column: Column):
        d, s = self.drawing, column.statement
        centre = (column.zone + column.outer) / 2
        x0, x1 = centre - column.box_width / 2, centre + column.box_width / 2
        d.box_rects.append((x0, column.box_top, x1, column.box_bottom, s.target))
        rect = _element("rect", x=fmt(x0), y=fmt(column.box_top), width=fmt(x1 - x0), height=fmt(column.box_bottom - column.box_top),
                        rx=4, fill=BOX_FILL, stroke=BOX_STROKE, stroke_width="1.2")
        d.add("boxes", f"<g><title>{escape(statement_text(s))}</title>{rect}</g>")
        for axis, y in zip(column.lanes, column.lane_ys, strict=False):
            # Woven axes pass over the box: a white halo breaks its outline under them.
            d.path("wires", straight(x0 - 3, x1 + 3, y), stroke="#ffffff", width=5, merge=False)
            self.wire(straight(column.zone, column.outer, y), axis, self.levels.compute, over=True)
        label = truncate(column.label, MAX_BOX_CHARS)
        opaque = isinstance(s.box, Opaque)
        d.text(centre, column.label_y + (0.5 if opaque else 0), label, size=HEADER_SIZE if opaque else LABEL_SIZE, bold=opaque,
               anchor="middle", title=column.label if label != column.label else None, background=False)
        # A map's only wires into the box are axis-less operands; its label is its pictogram.
        pictogram = {Contract: self.draw_caps, Softmax: self.draw_triangle, Scan: self.draw_triangle, Reduce: self.draw_reduction,
                     Opaque: self.draw_ports, Map: self.draw_ports}
        pictogram[type(s.box)](column, x0, x1)

    def cap_groups(self, column: Column) -> dict:
        """Port heights of each contracted axis."""
        groups: dict = {}
        for (_, axis), y in zip(column.in_ports, column.in_port_ys, strict=False):
            if axis in column.statement.consumed:
                groups.setdefault(axis, []).append(y)
        return groups

    def draw_caps(self, column: Column, x0: float, x1: float):
        """A contraction: the wires of each contracted axis run into the box and join in a cap."""
        compute = self.levels.compute
        colour = self.colour(compute)
        start = x0 + 10
        for axis, ys in self.cap_groups(column).items():
            for y in ys:
                self.wire(straight(column.zone, start, y), axis, compute)
            if len(ys) == 1:  # one wire of the axis: a plain sum, drawn as a terminator
                self.drawing.path("marks", f"M{fmt(start)} {fmt(ys[0] - 5)}V{fmt(ys[0] + 5)}", stroke=colour, width=2)
                continue
            bulge = cap_bulge(ys[-1] - ys[0])
            self.wire(f"M{fmt(start)} {fmt(ys[0])}C{fmt(start + bulge)} {fmt(ys[0])} {fmt(start + bulge)} {fmt(ys[-1])} "
                      f"{fmt(start)} {fmt(ys[-1])}", axis, compute)
            for y in ys[1:-1]:  # a third operand of the same axis joins the cap at a dot
                reach = start + 0.75 * bulge
                self.wire(straight(start, reach, y), axis, compute)
                self.dot(reach, y, colour)
        self.draw_ports(column, x0, x1, labelled=False, only_scalars=True)

    def draw_triangle(self, column: Column, x0: float, x1: float):
        """Softmax (and a scan, which also keeps its axis): a triangle on the wire it acts along."""
        compute = self.levels.compute
        axis = column.statement.box.axis
        centre = (x0 + x1) / 2
        y = column.out_port_ys[0] if column.out_port_ys else column.label_y
        for port_y in column.in_port_ys:
            self.wire(bend(column.zone, port_y, centre - 8, y), axis, compute)
        points = f"{fmt(centre - 8)},{fmt(y - 8)} {fmt(centre - 8)},{fmt(y + 8)} {fmt(centre + 9)},{fmt(y)}"
        self.drawing.add("marks", _element("polygon", points=points, fill="#ffffff", stroke=self.colour(compute), stroke_width="1.4"))
        self.wire(straight(centre + 9, column.outer, y), axis, compute)

    def draw_reduction(self, column: Column, x0: float, x1: float):
        """A reduction: the consumed wire ends at a bar marked with the operation."""
        compute = self.levels.compute
        colour = self.colour(compute)
        bar = x0 + 14
        for (_, axis), y in zip(column.in_ports, column.in_port_ys, strict=False):
            if axis in column.statement.consumed:
                self.wire(straight(column.zone, bar, y), axis, compute)
                self.drawing.path("marks", f"M{fmt(bar)} {fmt(y - 5)}V{fmt(y + 5)}", stroke=colour, width=2)
                self.drawing.text(bar + 5, y + 3, column.statement.box.op, size=SMALL_SIZE, fill=colour, background=False)
        self.draw_ports(column, x0, x1, labelled=False, only_scalars=True)

    def draw_ports(self, column: Column, x0: float, x1: float, labelled: bool = True, only_scalars: bool = False):
        """Wires that end at the box's edges: an opaque box's ports (named inside), axis-less operands."""
        compute = self.levels.compute
        for (_, axis), y in zip(column.in_ports, column.in_port_ys, strict=False):
            if only_scalars and axis != "":
                continue
            self.wire(straight(column.zone, x0, y), axis, compute)
            if labelled and axis:
                self.drawing.text(x0 + 4, y + 3, axis_text(self.diagram, axis), size=SMALL_SIZE, fill=MUTED, background=False)
        for axis, y in zip(column.out_ports, column.out_port_ys, strict=False):
            self.wire(straight(x1, column.outer, y), axis, compute)
            if labelled and axis:
                self.drawing.text(x1 - 4, y + 3, axis_text(self.diagram, axis), size=SMALL_SIZE, fill=MUTED, anchor="end", background=False)

    # -- title, legend, costs
    def title_lines(self) -> list[str]:
        lines = [truncate(f"kernel {self.kernel.signature()}", MAX_TITLE_CHARS)]
        if self.relabelled:
            note = self.kernel.relabel_text() if self.kernel.relabel is not None else "nothing: the kernel has no relabel block"
            lines.append(truncate(f"relabelled {note}", MAX_TITLE_CHARS))
        elif self.levels.hardware:
            lines.append(f"on {self.levels.hardware}")
        return lines

    def legend_items(self) -> list:
        items = [("level", level, level if level == self.levels.role(level) else f"{level}: {self.levels.role(level)}")
                 for level in self.levels.drawn]
        explained = {"dot": "shared or copied axis", "dash": "tuple of operands", "bar": "load / save: array changes level"}
        items += [(kind, None, text) for kind, text in explained.items() if kind in self.marks]
        kinds = {kind for parts in self.partitions.by_axis.values() for kind, _ in parts}
        if "group" in kinds:
            items.append(("group", None, "group partition (g=)"))
        if "stream" in kinds:
            items.append(("stream", None, "stream partition (s=)"))
        if "split" in kinds:
            items.append(("split", None, "split into parts (p=), merged by the combine launch"))
        return items

    def legend_rows(self, width: float) -> list:
        rows, row, x = [], [], 0.0
        for item in self.legend_items():
            item_width = 30 + text_width(item[2], LABEL_SIZE) + 18
            if row and x + item_width > width:
                rows.append(row)
                row, x = [], 0.0
            row.append((x, item))
            x += item_width
        return rows + ([row] if row else [])

    def draw_header(self) -> float:
        """Title, relabel line and legend; returns where the diagram starts."""
        d = self.drawing
        lines = self.title_lines()
        y = MARGIN + TITLE_SIZE
        d.text(MARGIN, y, lines[0], size=TITLE_SIZE, bold=True, background=False)
        for line in lines[1:]:
            y += 16
            d.text(MARGIN, y, line, fill=MUTED, background=False)
        y += 10
        for row in self.legend_rows(self.width - 2 * MARGIN):
            y += 16
            for x, (kind, level, text) in row:
                self.legend_sample(MARGIN + x, y - 3.5, kind, level)
                d.text(MARGIN + x + 30, y, text, background=False)
        return y + 14

    def legend_sample(self, x: float, y: float, kind: str, level: str | None):
        d = self.drawing
        colour = self.colour(self.levels.compute)
        if kind == "level":
            d.path("marks", straight(x, x + 24, y), stroke=self.colour(level), width=2.4)
        elif kind == "dot":
            d.path("marks", straight(x, x + 24, y), stroke=colour)
            d.dot(x + 12, y, colour)
        elif kind == "dash":
            d.path("marks", straight(x, x + 24, y), stroke=MUTED, width=0.8, dash="3 3")
        elif kind == "bar":
            d.path("marks", straight(x, x + 24, y), stroke=colour)
            d.add("marks", _element("rect", x=fmt(x + 10), y=fmt(y - 6), width=4, height=12, fill=colour))
        elif kind == "group":
            d.add("marks", _element("rect", x=fmt(x), y=fmt(y - 6), width=24, height=12, rx=2, fill="none", stroke=colour,
                                    stroke_width="0.8"))
        elif kind == "stream":
            d.path("marks", straight(x, x + 24, y), stroke=colour, dash="5 3")
        elif kind == "split":  # the merge box its parts' states meet in
            d.add("marks", _element("rect", x=fmt(x + 4), y=fmt(y - 6), width=16, height=12, rx=4, fill=BOX_FILL,
                                    stroke=BOX_STROKE, stroke_width="1.2"))

    def caption_lines(self) -> list[tuple[str, str]]:
        """(text, colour) of the cost table's caption and warning, wrapped at words to the picture's width."""
        if self.costs is None:
            return []
        room = max(int((self.width - 2 * MARGIN) / text_width("m", SMALL_SIZE)), 20)
        wrapped = []
        for text, colour in ((self.costs.caption, MUTED), (self.costs.warning, WARNING)):
            lines, line = [], ""
            for word in text.split(" "):
                if line and len(line) + 1 + len(word) > room:
                    lines.append(line)
                    line = word
                else:
                    line = f"{line} {word}" if line else word
            wrapped += [(truncate(part, room), colour) for part in lines + [line] if part]
        return wrapped

    def draw_costs(self, y: float) -> float:
        """Rows of the label, memory M and transfers H of every column, under the column's box;
        their totals right of the last column, under the outputs."""
        d = self.drawing
        d.path("marks", straight(MARGIN, self.width - MARGIN, y), stroke="#bbbbbb", width=0.8)
        y += 4
        for line, colour in self.caption_lines():
            y += 13
            d.text(MARGIN, y, line, size=SMALL_SIZE, fill=colour, background=False)
        for row, head in enumerate(self.costs.heads):
            baseline = y + 18 + COST_PITCH * row
            d.text(MARGIN, baseline, head, bold=True, background=False)
            for index, column in enumerate(self.columns):
                shown, full = self.cost_cells(index)[row]
                d.text((column.zone + column.outer) / 2, baseline, shown, anchor="middle", title=full if shown != full else None)
            if self.costs.totals:
                shown, full = self.costs.totals[row]
                d.text(self.right + 16, baseline, shown, bold=row == 0, title=full if shown != full else None)
        bottom = y + 18 + COST_PITCH * (len(self.costs.heads) - 1) + 6
        if self.costs.totals:  # a rule between the columns and their totals
            d.path("marks", f"M{fmt(self.right + 6)} {fmt(y + 4)}V{fmt(bottom)}", stroke="#bbbbbb", width=0.8)
        return bottom

    # -- all of it
    def draw_body(self) -> float:
        """Wires, boxes and marks; returns the lowest point drawn."""
        self.draw_left()
        for column in self.columns:
            self.draw_gap(column)
            self.draw_column(column)
        self.bottom = max([self.bottom] + [c.box_bottom for c in self.columns]
                          + [self.top + self.height(c.statement.target) for c in self.columns])
        self.draw_right()
        return self.bottom

    def draw(self) -> Drawing:
        # Widths need the relative heights (how far bundles move), the header needs the width
        # and the marks the body uses, and the final heights need the header: so the body is
        # drawn once at the top to learn its marks, then again below the header.
        self.layout_y(0)
        self.layout_x()
        self.draw_body()
        self.drawing, self.bottom = Drawing(width=self.width, levels=self.levels.drawn), 0.0
        self.layout_y(self.draw_header())
        bottom = self.draw_body() + BUNDLE_GAP
        if self.costs is not None:
            bottom = self.draw_costs(bottom + 4)
        self.drawing.height = bottom + MARGIN
        return self.drawing


def move_step(depth: int) -> float:
    """Room per load or save mark in a gap: wider when a gap holds two in a row (a save, then a
    load of the same array), so that their tags stay apart."""
    return GAP_MOVE if depth < 2 else GAP_MOVE + 12


def route_width(shift: float) -> float:
    """Room for wires to bend, wider the further they go, so that steep bundles stay apart."""
    return min(max(ROUTE_WIDTH, 24 + 0.3 * shift), 3 * ROUTE_WIDTH)


def cap_bulge(span: float) -> float:
    """How far a contraction's cap reaches into the box: further for wires further apart."""
    return 8 + 0.45 * span


def statement_text(s: Statement) -> str:
    at = f" @{s.level}" if s.level else ""
    return f"{s.target}[{' '.join(s.axes)}]{at} = {s.describe()}"



# ---- costs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostTable:
    """Rows under the columns: heads, one list of (shown, full) cells per column, a caption
    saying what they count, and the totals drawn right of the last column (empty for none)."""

    heads: tuple
    cells: list
    caption: str = ""
    totals: tuple = ()
    warning: str = ""  # drawn under the caption, in red: the columns do not fit the level


def cost_text(value) -> tuple[str, str]:
    """(shown, full) text of a cost cell: the expression's text with ``^`` for powers, cut with an
    ellipsis past MAX_COST_CHARS; numbers of eight digits or more in three significant ones."""
    if isinstance(value, str):
        return truncate(value, MAX_COST_CHARS), value
    expr = algebra.as_expr(value)
    if expr.is_number:
        if expr.is_integer:
            number = int(expr)
            full = f"{number:,}"
            shown = full if abs(number) < 10**7 else f"{number:.3g}".replace("e+0", "e").replace("e+", "e")
            return shown, full
        number = float(expr)
        return f"{number:.4g}".replace("e+0", "e").replace("e+", "e"), repr(number)
    full = str(expr).replace("**", "^")
    return truncate(full, MAX_COST_CHARS), full


def _given_table(columns: list) -> CostTable:
    """A caller's columns, drawn as given (strings, size expressions or sympy expressions)."""
    cells = [[cost_text(cell.get(key, "")) for key in COST_KEYS] for cell in columns]
    return CostTable(COST_HEADS, cells)


def cost_program(kernel, relabelled: bool, hardware: str | None = None, sizes: dict | None = None):
    """The Program a drawing shows (its loads, saves and residency, and its cost rows): the
    kernel's own (relabelled) Program, or, for a drawing as written of a relabelled kernel, the
    diagram planned without its relabel block (one group, nothing streamed), as the drawing
    shows it."""
    from .check import check_sizes
    from .plan import plan

    sizes = check_sizes(dict(sizes or {}))
    block = kernel.relabel
    if block is not None and relabelled and hardware is not None:
        asked, written = load_hardware(hardware).name, load_hardware(block.hardware).name
        if asked != written:
            raise NapkinError(
                f"the relabel block of {kernel.name} is for {written}, not {asked}: its partitions name {written}'s levels",
                hint=f"draw the relabelled costs on {written}, or the costs as written (without relabelled) on {asked}",
            )
    target = kernel._target(hardware)
    if block is None or relabelled:
        return kernel.program(target, **sizes)
    return plan(kernel.diagram, target, None, sizes)


def cost_table(kernel, relabelled: bool, program: Program) -> CostTable:
    """M and H per column at the compute level, from ``cost.statement_columns`` of the Program."""
    from .algebra import as_number
    from .cost import level_costs, max_of, statement_columns
    from .cost import columns as program_columns
    from .isel import select_program

    schedule = program.schedule
    level = schedule.compute_level
    per = schedule.hardware.level(level).per or "unit"
    selected = select_program(program)  # the columns, their statements' share and the report read one selection
    rows = program_columns(program, selected)
    columns = statement_columns(program, rows, selected)
    # A tensor-core launch adds the register level: fragments per thread, ldmatrix traffic.
    shown = [level] + (["registers"] if columns and "registers" in columns[0]["M"] else [])
    cells = [[(truncate(c["label"], MAX_NAME_CHARS), c["label"])]
             + [cost_text(c[key][lv]) for lv in shown for key in ("M", "H")] for c in columns]
    how = "relabelled" if kernel.relabel is not None and relabelled else "as written"
    at = f" at {' '.join(f'{k}={v}' for k, v in schedule.sizes.items())}" if schedule.sizes else ""
    caption = (f"columns at {level} on {schedule.hardware.name}{at}, {how}: M = values resident per {per}, "
               f"H = values moved into and out of {level}")
    totals = (("total", "total"),) + tuple(
        cost_text(max_of(c["M"][lv] for c in columns)) if key == "M" else cost_text(algebra.Add(*(c["H"][lv] for c in columns)))
        for lv in shown for key in ("M", "H"))
    # The drawing does not refuse what cost_of would: it says so.
    report = level_costs(program, rows, selected)[level]
    counts_values = schedule.hardware.counts == "values"
    used, capacity = as_number(report.M if counts_values else report.M_bytes), as_number(report.capacity)
    warning = ""
    if used is not None and capacity is not None and used > capacity:
        unit = "values" if counts_values else "bytes"
        warning = f"over capacity: the columns need {used:,} {unit} at {level} per {per}; {schedule.hardware.name}'s {level} holds {capacity:,}"
    if len(shown) > 1:
        caption += "; @registers: values per thread, and values ldmatrix moves from smem into registers"
    heads = ("column",) + tuple(f"{key} @{lv}" for lv in shown for key in ("M", "H"))
    return CostTable(heads, cells, caption, totals, warning)


# ---- the API ---------------------------------------------------------------------------------


def _check_columns(kernel, columns) -> list | None:
    if columns is None:
        return None
    columns = list(columns)
    count = len(kernel.diagram.statements)
    if len(columns) != count:
        raise ValueError(f"columns has {len(columns)} entries; kernel {kernel.name} has {count} statements (one column each)")
    for index, cell in enumerate(columns):
        if not isinstance(cell, dict):
            raise TypeError(f"columns[{index}] must be a dict with keys label, M, H; got {type(cell).__name__}")
    return columns


def _renderer(kernel, relabelled: bool, costs, columns, hardware, sizes) -> Renderer:
    """A Renderer of the Program the drawing shows (:func:`cost_program`), with its cost rows
    (or the caller's ``columns``) when asked for, and levels named after the hardware drawn
    on: ``hardware``, else the kernel's, else, with cost rows, the one they are read on."""
    columns = _check_columns(kernel, columns)
    if sizes and not (costs and columns is None):
        raise ValueError("sizes= bind the sizes the cost rows are read at: pass costs=True")
    program = cost_program(kernel, relabelled, hardware, sizes)
    table = None
    if columns is not None:
        table = _given_table(columns)
    elif costs:
        table = cost_table(kernel, relabelled, program)
    named = hardware or kernel.hardware or (kernel._target(hardware) if costs and columns is None else None)
    return Renderer(kernel, relabelled, program, table, named)


def layout(kernel, relabelled: bool = False, columns=None, *, costs=None, hardware: str | None = None,
           sizes: dict | None = None) -> Drawing:
    """The laid-out drawing (with the rectangles of its labels and boxes, and its load and save
    marks) behind :func:`render`."""
    return _renderer(kernel, relabelled, costs, columns, hardware, sizes).draw()


def render(kernel, relabelled: bool = False, costs=None, columns=None, *, hardware: str | None = None,
           sizes: dict | None = None) -> str:
    """The neural circuit diagram of a kernel as SVG text.

    Levels, loads, saves and residency are those of the kernel's Program on ``hardware``
    (default: the kernel's; a kernel without one is drawn with abstract levels, "top level"
    and "on chip", from the Program on the first profile that fits it).
    ``relabelled`` marks the relabel block's group and stream partitions on the wires.
    ``costs=True`` draws rows of memory M and transfers H per column (statement) under the
    boxes, with their totals on the right, read off the Program by
    :func:`napkin_dsl.cost.statement_columns` at its compute level: the kernel's Program
    (``kernel.program(hardware, **sizes)``) when ``relabelled``, else the diagram planned as
    written; without ``sizes`` the costs are symbolic.
    ``columns`` (one dict per statement, ``{"label", "M", "H"}``, strings, size expressions or sympy
    expressions) draws the caller's rows instead.
    """
    drawing = _renderer(kernel, relabelled, costs, columns, hardware, sizes).draw()
    d = kernel.diagram
    title = f"napkin diagram of {kernel.name}"
    description = f"kernel {kernel.signature()}; " + "; ".join(
        f"{s.target}[{' '.join(s.axes)}] = {s.describe()}" for s in d.statements
    )
    return drawing.svg(title, description)
