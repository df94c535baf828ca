"""Neural circuit diagrams as SVG: well-formed, complete, deterministic, readable, golden."""

from __future__ import annotations

import io
import os
from collections import Counter
import xml.etree.ElementTree as ET

import pytest
import sympy

import napkin_dsl as napkin
from napkin_dsl.cli import main
from napkin_dsl.diagram import Apply, Contract, Opaque, Reduce, Softmax, reads
from napkin_dsl.render import cost_text, layout, render

from .conftest import EXAMPLES, NAPKIN_EXAMPLES, ROOT, example_id

SVG = "{http://www.w3.org/2000/svg}"


def example_kernels():
    return [(f"{example_id(path)}:{name}", k) for path in NAPKIN_EXAMPLES for name, k in napkin.load(path).items()]


EXAMPLE_KERNELS = example_kernels()
IDS = [name for name, _ in EXAMPLE_KERNELS]


def chain_source(length: int = 50) -> str:
    lines = ["kernel chain(X: f32[a b]) -> Y: f32[a b]:", "    T0[a b] = exp(X)"]
    lines += [f"    T{i}[a b] = T{i - 1} * 2 + X" for i in range(1, length - 1)]
    lines.append(f"    Y[a b] = T{length - 2} - 1")
    return "\n".join(lines) + "\n"


def many_inputs_source(count: int = 9) -> str:
    signature = ", ".join(f"f32[x{i}]" for i in range(count))
    params = ", ".join(f"X{i}: f32[a x{i}]" for i in range(count))
    args = ", ".join(f"X{i}[a x{i}]" for i in range(count))
    return f"box G({signature}) -> f32[y]\n\nkernel many({params}) -> Y: f32[a y]:\n    Y[a y] = G({args})\n"


LONG_AXIS = "a_very_long_axis_name_that_keeps_going_and_going_and_going"
LONG_NAMES = f"""
kernel long_names(Input_array_with_a_very_long_name: f32[{LONG_AXIS} d], W: f32[d n]) -> Output_with_a_long_name_too: f32[{LONG_AXIS} n]:
    Output_with_a_long_name_too[{LONG_AXIS} n] = Input_array_with_a_very_long_name * W

relabel long_names on H100:
    smem: group {LONG_AXIS} 64; stream d 32
"""
# Scalars (an axis-less result), an unused parameter, a scalar parameter, several outputs,
# an output read again, reductions and a three-way contraction.
ODDITIES = """
kernel oddities(X: f32[a b], U: f32[c], A: f32[a k], B: f32[k b], C: f32[k], s: f32) -> T: f32[], Y: f32[a b], Z: f32[a]:
    T[] = sum[a b](X)
    Y[a b] = X / T * s
    m[a] = max[b](Y)
    W[a b] = A * B * C
    w[a] = sum[b](W)
    Z[a] = m + T + w
"""


# Splits: two merged sums read after the merge, and the online softmax with its lse.
SPLITS = """
kernel two_sums(X: f32[a c]) -> Y: f32[a], Z: f32[a], W: f32[a]:
    Y[a] = sum[c](X)
    Z[a] = max[c](X)
    W[a] = Y * 2 + Z

relabel two_sums on H100:
    smem: group a 4; split c 100; stream c 32

kernel split_lse(S: f32[q x], V: f32[x d]) -> O: f32[q d], L: f32[q]:
    P[q x] = softmax[x](S)
    O[q d] = P * V
    L[q] = lse[x](S)

relabel split_lse on H100:
    smem: group q 16; split x 128; stream x 64
"""


def stress_kernels():
    kernels = {}
    for text in (chain_source(), many_inputs_source(), LONG_NAMES):
        kernels.update(napkin.load(text))
    return kernels


def texts(svg: str) -> str:
    """The visible text, one <text> a line (a <title> inside a text is a tooltip, not shown)."""
    root = ET.fromstring(svg)
    return "\n".join((t.text or "") + "".join(child.tail or "" for child in t) for t in root.iter(f"{SVG}text"))


# ---- well-formed and complete ----------------------------------------------------------------


@pytest.mark.parametrize("relabelled", [False, True], ids=["plain", "relabelled"])
@pytest.mark.parametrize("kernel", [k for _, k in EXAMPLE_KERNELS], ids=IDS)
def test_every_example_is_well_formed_svg(kernel, relabelled):
    svg = render(kernel, relabelled=relabelled)
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    assert float(root.get("width")) > 100 and float(root.get("height")) > 100
    assert root.get("viewBox") == f"0 0 {root.get('width')} {root.get('height')}"


def box_words(statement) -> list[str]:
    box = statement.box
    if isinstance(box, Contract):
        return ["contract", *box.contracted]
    if isinstance(box, Softmax):
        return ["softmax"]
    if isinstance(box, Reduce):
        return [box.op]
    if isinstance(box, Opaque):
        return [box.box.name]
    functions = []

    def walk(expr):
        if isinstance(expr, Apply):
            if expr.fn.isalpha() and expr.fn not in ("add", "sub", "mul", "div", "pow", "neg"):
                functions.append(expr.fn)
            for arg in expr.args:
                walk(arg)

    walk(box.expr)
    return functions + [r.array for r in reads(box.expr)]


@pytest.mark.parametrize("relabelled", [False, True], ids=["plain", "relabelled"])
@pytest.mark.parametrize("kernel", [k for _, k in EXAMPLE_KERNELS], ids=IDS)
def test_every_axis_array_box_and_level_is_named(kernel, relabelled):
    text = texts(render(kernel, relabelled=relabelled))
    words = set(text.replace("[", " ").replace("]", " ").replace("(", " ").replace(")", " ").replace(",", " ").split())
    d = kernel.diagram
    for axis in d.axes:
        assert axis in words, f"axis {axis} is not labelled"
    for array in d.arrays:
        assert array in words, f"array {array} is not named"
    for statement in d.statements:
        for word in box_words(statement):
            assert word in text, f"box of {statement.target} does not say {word!r}"
    for level in layout(kernel, relabelled).levels:
        assert level in text, f"level {level} is missing from the legend"


def test_relabelled_marks_groups_and_streams():
    attention = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    plain, relabelled = render(attention), render(attention, relabelled=True)
    assert "g=128" in texts(relabelled) and "s=64" in texts(relabelled)
    assert "g=128" not in texts(plain) and "s=64" not in texts(plain)
    assert 'stroke-dasharray="5 3"' in relabelled  # the streamed wire x is dashed on chip
    assert 'stroke-dasharray="5 3"' not in plain


def test_loads_and_saves_are_marked_where_arrays_change_level():
    unfused = napkin.load(EXAMPLES / "attention_unfused.napkin")["attention_unfused"]
    tags = texts(render(unfused)).splitlines()
    # Q, K; then S saved and loaded; P saved and loaded, V loaded; O saved.
    assert tags.count("load") == 5
    assert tags.count("save") == 3


def program_transfers(kernel, relabelled: bool = True) -> Counter:
    """(kind, array, launch) of the loads and saves into and out of the compute level in the
    Program a drawing shows (the kernel's relabelled one, or the diagram planned as written),
    one per step (a streamed array is loaded chunk by chunk by one step)."""
    from napkin_dsl.pseudocode import walk
    from napkin_dsl.render import cost_program

    program = cost_program(kernel, relabelled)
    compute = program.schedule.compute_level
    return Counter((step.op, step.array, launch.index) for launch in program.launches for step, _ in walk(launch.body)
                   if step.op in ("load", "save") and step.level == compute)


def hard_kernels() -> dict:
    kernels = stress_kernels()
    kernels.update(napkin.load(ODDITIES))
    kernels["chain"] = napkin.load(chain_source(6))["chain"]
    kernels.update(napkin.load(SPLITS))
    return kernels


@pytest.mark.parametrize("relabelled", [False, True], ids=["plain", "relabelled"])
@pytest.mark.parametrize("kernel", [k for _, k in EXAMPLE_KERNELS] + list(hard_kernels().values()),
                         ids=IDS + list(hard_kernels()))
def test_the_drawing_moves_arrays_as_the_program_does(kernel, relabelled):
    """One load per array and launch, at its first reader; a result saved once, after its last
    reader in its launch: the marks drawn (and their tags) are the Program's transfers (a
    split's part states too: saved by the parts launch, loaded by the combine)."""
    drawing = layout(kernel, relabelled)
    assert Counter((kind, array, launch) for kind, array, launch, _ in drawing.transfers) == program_transfers(kernel, relabelled)
    tags = [rect[4] for rect in drawing.label_rects]
    for kind in ("load", "save"):
        assert tags.count(kind) == sum(1 for drawn, *_ in drawing.transfers if drawn == kind)


def test_a_split_draws_its_parts_saves_and_the_combines_merge_box():
    """decode (split x 1024; stream x 64): x is labelled with its parts and chunks; each part's
    O leaves the contraction as O.acc, which nothing reads; the parts' states are saved (launch
    0), then loaded (launch 1) into one merge box over x#, which forms O, saved by launch 1."""
    decode = napkin.load(EXAMPLES / "decode.napkin")["decode"]
    drawing = layout(decode, True)
    assert "x p=1024 s=64" in texts(render(decode, relabelled=True)).splitlines()
    boxes = {target: rect for *rect, target in drawing.box_rects}
    assert list(boxes) == ["S", "P", "O.acc", "O"]
    merge_left = boxes["O"][0]
    states = ("P.max.part", "P.sum.part", "O.acc.part")
    marks = {(kind, array): (launch, x) for kind, array, launch, x in drawing.transfers}
    for state in states:
        (saved_by, saved_at), (loaded_by, loaded_at) = marks[("save", state)], marks[("load", state)]
        assert (saved_by, loaded_by) == (0, 1)
        assert boxes["O.acc"][2] < saved_at < loaded_at < merge_left
    assert marks[("save", "O")][0] == 1 and marks[("save", "O")][1] > boxes["O"][2]
    assert ("save", "O.acc") not in marks
    assert "merge x#" in texts(render(decode, relabelled=True))
    # As written, nothing is split: no merge box, O saved by its one launch.
    plain = layout(decode)
    assert [target for *_, target in plain.box_rects] == ["S", "P", "O"]
    assert {(kind, array, launch) for kind, array, launch, _ in plain.transfers if kind == "save"} == {("save", "O", 0)}


def test_an_array_read_twice_in_a_launch_is_loaded_once_and_copied_on_chip():
    rmsnorm = napkin.load(EXAMPLES / "rmsnorm.napkin")["rmsnorm"]
    drawing = layout(rmsnorm, True)
    loads = [t for t in drawing.label_rects if t[4] == "load"]
    assert len(loads) == 2  # X (before it is copied for ms and Y) and G
    x_load = min(loads, key=lambda t: t[0])
    assert x_load[2] < drawing.box_rects[0][0]
    svg = render(rmsnorm, relabelled=True)
    assert texts(svg).splitlines().count("t g=8") == 4  # X at both readers, ms, Y


def test_a_result_read_again_in_its_launch_is_saved_after_its_last_reader():
    kernel = napkin.load(ODDITIES)["oddities"]
    drawing = layout(kernel)
    saves = sorted((t for t in drawing.label_rects if t[4] == "save"), key=lambda t: t[0])
    boxes = {b[4]: b for b in drawing.box_rects}
    assert len(saves) == 3
    assert boxes["m"][2] < saves[0][0] < boxes["W"][0]  # Y, after m reads it
    assert saves[1][0] > boxes["Z"][2] and saves[2][0] > boxes["Z"][2]  # Z at its exit; T, after Z reads it


def test_levels_have_the_papers_colours():
    svg = render(napkin.load(EXAMPLES / "paper" / "fig9.napkin")["fig9"])
    assert 'stroke="#000000"' in svg  # top level l0: black
    assert 'stroke="#e07b00"' in svg  # l1: orange


def test_render_is_deterministic_and_has_no_ids():
    kernel = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    first = render(kernel, relabelled=True)
    assert first == render(napkin.load(EXAMPLES / "attention.napkin")["attention"], relabelled=True)
    assert " id=" not in first


# ---- layout: nothing overlaps ----------------------------------------------------------------


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _inside(a, b) -> bool:
    return a[0] >= b[0] and a[2] <= b[2] and a[1] >= b[1] and a[3] <= b[3]


def layout_problems(drawing) -> list:
    problems = []
    labels, boxes = drawing.label_rects, drawing.box_rects
    for i, a in enumerate(labels):
        problems += [("labels overlap", a[4], b[4]) for b in labels[i + 1:] if _overlap(a, b)]
        problems += [("label crosses box", a[4], box[4]) for box in boxes if _overlap(a, box) and not _inside(a, box)]
        if a[0] < 0 or a[1] < 0 or a[2] > drawing.width or a[3] > drawing.height:
            problems.append(("label outside the picture", a[4]))
    for i, a in enumerate(boxes):
        problems += [("boxes overlap", a[4], b[4]) for b in boxes[i + 1:] if _overlap(a, b)]
    return problems


@pytest.mark.parametrize("relabelled", [False, True], ids=["plain", "relabelled"])
@pytest.mark.parametrize("kernel", [k for _, k in EXAMPLE_KERNELS], ids=IDS)
def test_example_layout_has_no_overlaps(kernel, relabelled):
    assert layout_problems(layout(kernel, relabelled)) == []


@pytest.mark.parametrize("name", ["chain", "many", "long_names", "oddities"])
def test_hard_layouts_have_no_overlaps(name):
    kernels = stress_kernels()
    kernels.update(napkin.load(ODDITIES))
    kernel = kernels[name]
    for relabelled in (False, True):
        drawing = layout(kernel, relabelled)
        assert layout_problems(drawing) == []
        ET.fromstring(render(kernel, relabelled=relabelled))


def test_fifty_statements_draw_fifty_boxes():
    kernel = napkin.load(chain_source(50))["chain"]
    drawing = layout(kernel)
    assert len(drawing.box_rects) == 50
    assert [b[4] for b in drawing.box_rects] == [s.target for s in kernel.diagram.statements]
    lefts = [b[0] for b in drawing.box_rects]
    assert lefts == sorted(lefts)  # left to right in statement order


def test_long_names_are_cut_with_an_ellipsis_and_kept_in_titles():
    svg = render(napkin.load(LONG_NAMES)["long_names"], relabelled=True)
    lines = texts(svg).splitlines()
    assert "a_very_long_a…" in lines  # a wire label at the top level
    assert "a_very_long_a… g=64" in lines  # and on chip, with its group size
    assert all(LONG_AXIS not in line for line in lines[2:])  # only the title lines spell it out
    assert f"<title>{LONG_AXIS}</title>" in svg


def test_opaque_box_ports_are_named_in_order():
    kernel = napkin.load(many_inputs_source(9))["many"]
    drawing = layout(kernel)
    ports = [t for t in drawing.label_rects if t[4] in {f"x{i}" for i in range(9)} and _inside(t, drawing.box_rects[0])]
    assert [t[4] for t in sorted(ports, key=lambda t: t[1])] == [f"x{i}" for i in range(9)]


# ---- costs -----------------------------------------------------------------------------------


FIG9_COLUMNS = [
    {"label": "load S, softmax, save P", "M": "qx", "H": "2qx"},
    {"label": "load P V, contract, save O", "M": "qx + xd", "H": "qx + xd + qd"},
]


def test_cost_rows_are_drawn_under_their_columns():
    kernel = napkin.load(EXAMPLES / "paper" / "fig9.napkin")["fig9"]
    drawing = layout(kernel, columns=FIG9_COLUMNS)
    assert layout_problems(drawing) == []
    cells = {t[4]: t for t in drawing.label_rects}
    for column, box in zip(FIG9_COLUMNS, drawing.box_rects, strict=False):
        for key in ("label", "M", "H"):
            cell = cells[column[key]]
            assert abs((cell[0] + cell[2]) / 2 - (box[0] + box[2]) / 2) < 0.5, f"{column[key]} is not under its box"
            assert cell[1] > box[3]
    text = texts(render(kernel, columns=FIG9_COLUMNS))
    for head in ("step", "M", "H"):
        assert head in text.split()


def test_given_columns_take_the_place_of_the_programs():
    kernel = napkin.load(EXAMPLES / "paper" / "fig9.napkin")["fig9"]
    assert "qx + xd" in texts(render(kernel, costs=True, columns=FIG9_COLUMNS))
    assert "qx + xd" not in texts(render(kernel, costs=True))


def cost_rows(svg: str) -> dict:
    """Row head -> the cells of that row, left to right, as drawn under the diagram."""
    root = ET.fromstring(svg)
    items = [(float(t.get("y")), float(t.get("x")), (t.text or "") + "".join(c.tail or "" for c in t))
             for t in root.iter(f"{SVG}text")]
    heads = {y: text for y, x, text in items if text in ("column", "step") or text.startswith(("M @", "H @"))}
    return {head: [text for y2, x, text in sorted(items, key=lambda i: i[1]) if y2 == y and text != head] for y, head in heads.items()}


def test_costs_draw_the_programs_columns_fig9():
    """Fig. 9: per column M and H at l1, the totals (the CostReport's) on the right."""
    kernel = napkin.load(EXAMPLES / "paper" / "fig9.napkin")["fig9"]
    rows = cost_rows(render(kernel, relabelled=True, costs=True))
    assert rows["column"] == ["P", "O", "total"]
    assert rows["M @l1"] == ["q*x", "Max(d*q, d*x + q*x)", "Max(d*q, d*x + q*x)"]
    assert rows["H @l1"] == ["2*q*x", "d*q + d*x + q*x", "d*q + d*x + 3*q*x"]
    assert str(kernel.cost().levels["l1"].H) == rows["H @l1"][-1]


def test_cost_cells_sit_under_their_boxes_and_totals_under_the_outputs():
    kernel = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    drawing = layout(kernel, True, costs=True)
    assert layout_problems(drawing) == []
    boxes = drawing.box_rects
    for label, box in zip(("S", "P", "O"), boxes, strict=False):
        cell = next(t for t in drawing.label_rects if t[4] == label and t[1] > box[3])
        assert abs((cell[0] + cell[2]) / 2 - (box[0] + box[2]) / 2) < 0.5
    total = next(t for t in drawing.label_rects if t[4] == "total")
    assert total[0] > max(b[2] for b in boxes)
    assert total[2] <= drawing.width - 16


def test_costs_of_the_diagram_as_written_are_unrelabelled():
    """Fig. 10 before Fig. 11: as written, F gets all of X and W at once (one group)."""
    kernel = napkin.load(EXAMPLES / "paper" / "fig11.napkin")["fig11"]
    written = cost_rows(render(kernel, costs=True))
    assert written["M @l1"][0] in ("Max(a*x + w, a*y)", "Max(a*y, a*x + w)")
    assert written["H @l1"][0] == "a*x + a*y + w"
    relabelled = cost_rows(render(kernel, relabelled=True, costs=True))
    assert relabelled["H @l1"][0] == "a*x + a*y + a*w/g_a"
    assert "as written" in texts(render(kernel, costs=True)) and "relabelled:" in texts(render(kernel, relabelled=True, costs=True))


def test_costs_at_bound_sizes_are_numbers_with_the_exact_value_in_a_title():
    kernel = napkin.load(EXAMPLES / "attention.napkin")["attention"]
    sizes = {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128}
    svg = render(kernel, relabelled=True, costs=True, sizes=sizes)
    rows = cost_rows(svg)
    # On tensor cores smem holds Q (128 x 128) and the ring's stages of K and V (64 x 128) all
    # along, as many as fit the H100's 227 KiB a block (6); S, P and the O accumulator are registers.
    assert rows["M @smem"] == [f"{128 * 128 + 6 * 2 * 64 * 128:,}"] * 4
    h = int(kernel.cost(**sizes).levels["smem"].H)
    assert rows["H @smem"][-1] == f"{h:.3g}".replace("e+", "e")
    assert f"<title>{h:,}</title>" in svg
    assert "at b=4 h=32 q=8192 x=8192 d=128" in texts(svg)


def test_costs_that_do_not_fit_say_so():
    """The drawing does not refuse what cost_of refuses; it says, in red, that the level overflows."""
    kernel = napkin.load(EXAMPLES / "paper" / "fig11.napkin")["fig11"]
    svg = render(kernel, costs=True, hardware="H100", sizes={"a": 1024, "x": 64, "y": 64, "w": 32})
    shown = " ".join(texts(svg).split())
    assert "over capacity: the columns need 262,272 bytes at smem per block; H100's smem holds 232,448" in shown
    with pytest.raises(napkin.NapkinError, match="over its capacity"):
        from napkin_dsl.cost import cost_of
        from napkin_dsl.plan import plan

        cost_of(plan(kernel.diagram, "H100", None, {"a": 1024, "x": 64, "y": 64, "w": 32}))
    fits = render(kernel, relabelled=True, costs=True, sizes={"a": 1024, "x": 64, "y": 64, "w": 32, "g_a": 128})
    assert "over capacity" not in texts(fits)


def test_cost_text_is_compact():
    assert cost_text(sympy.Integer(8576)) == ("8,576", "8,576")
    assert cost_text(sympy.Integer(17448304640)) == ("1.74e10", "17,448,304,640")
    assert cost_text(sympy.Symbol("q") ** 2) == ("q^2", "q^2")
    long = sympy.Add(*(sympy.Symbol(f"a{i}") * sympy.Symbol("x") for i in range(12)))
    shown, full = cost_text(long)
    assert shown.endswith("…") and len(shown) == 40 and full == str(long)


def test_long_cost_cells_are_cut_and_kept_in_titles():
    kernel = napkin.load(many_inputs_source(9))["many"]
    svg = render(kernel, costs=True)
    assert "…" in "".join(cost_rows(svg)["H @l1"])
    assert "<title>a*x0 + a*x1 + a*x2 + a*x3 + a*x4 + a*x5 + a*x6 + a*x7 + a*x8 + a*y</title>" in svg
    assert layout_problems(layout(kernel, costs=True)) == []


@pytest.mark.parametrize("relabelled", [False, True], ids=["written", "relabelled"])
@pytest.mark.parametrize("kernel", [k for _, k in EXAMPLE_KERNELS], ids=IDS)
def test_every_example_draws_its_costs(kernel, relabelled):
    """What the docs draw: every example, opaque boxes included (on two_level), with cost rows."""
    svg = kernel.render(relabelled=relabelled, costs=True)
    assert svg == render(kernel, relabelled=relabelled, costs=True)
    ET.fromstring(svg)
    rows = cost_rows(svg)
    # A split draws a merge box per result its combine forms, after the parts' columns: its
    # costs are its statement's (both launches in one), drawn under the statement's first column.
    merges = [i for i, label in enumerate(rows["column"]) if label.startswith("merge ")]
    split = relabelled and any(launch.combine for launch in kernel.program().launches)
    assert bool(merges) == split
    assert [label for label in rows["column"] if not label.startswith("merge ")] == [s.target for s in kernel.diagram.statements] + ["total"]
    for head, cells in rows.items():
        if head != "column":
            assert all(cells[i] == "-" for i in merges)
    assert layout_problems(layout(kernel, relabelled, costs=True)) == []
    program = kernel.program()
    level = program.schedule.compute_level
    assert f"M @{level}" in rows and f"H @{level}" in rows
    for drawn in layout(kernel, relabelled, costs=True).levels:
        assert drawn in texts(svg), f"level {drawn} is missing from the legend"


@pytest.mark.parametrize("name", ["chain", "many", "long_names", "oddities", "two_sums", "split_lse"])
def test_hard_layouts_with_costs_have_no_overlaps(name):
    kernels = stress_kernels()
    kernels.update(napkin.load(ODDITIES))
    kernels.update(napkin.load(SPLITS))
    for relabelled in (False, True):
        assert layout_problems(layout(kernels[name], relabelled, costs=True)) == []


def test_costs_on_other_hardware():
    matmul = napkin.load(EXAMPLES / "matmul.napkin")["matmul"]
    # As written, any profile will do: the drawing's levels follow it.
    svg = render(matmul, costs=True, hardware="two_level", sizes={"m": 64, "n": 64, "k": 64})
    assert cost_rows(svg)["H @l1"][-1] == "12,288"
    assert "l1: on chip" in texts(svg)
    # Relabelled, the block's partitions name H100's levels: say so instead of failing deep inside.
    with pytest.raises(napkin.NapkinError, match="relabel block of matmul is for H100, not two_level"):
        render(matmul, relabelled=True, costs=True, hardware="two_level")
    with pytest.raises(ValueError, match="costs=True"):
        render(matmul, sizes={"m": 64})


def test_columns_must_match_the_statements():
    kernel = napkin.load(EXAMPLES / "paper" / "fig9.napkin")["fig9"]
    with pytest.raises(ValueError, match="2 statements"):
        render(kernel, columns=FIG9_COLUMNS[:1])


# ---- golden files and pictures ---------------------------------------------------------------


@pytest.mark.parametrize("path", ["attention.napkin", "matmul.napkin", "paper/fig12.napkin", "decode.napkin"])
def test_svg_golden(path, golden):
    (kernel,) = napkin.load(EXAMPLES / path).values()
    golden(f"svg/{path.replace('/', '__').replace('.napkin', '')}.relabelled.svg", render(kernel, relabelled=True))


def test_svg_golden_with_costs(golden):
    kernel = napkin.load(EXAMPLES / "paper" / "fig9.napkin")["fig9"]
    golden("svg/paper__fig9.relabelled.costs.svg", render(kernel, relabelled=True, costs=True))


def test_rasterised_diagram_is_not_blank():
    cairosvg = pytest.importorskip("cairosvg")
    image_module = pytest.importorskip("PIL.Image")
    np = pytest.importorskip("numpy")
    svg = render(napkin.load(EXAMPLES / "attention.napkin")["attention"], relabelled=True)
    png = cairosvg.svg2png(bytestring=svg.encode())
    pixels = np.asarray(image_module.open(io.BytesIO(png)).convert("RGB")).astype(int)
    ink = (pixels < 200).any(axis=2)
    assert ink.mean() > 0.01, "the picture is (almost) blank"
    orange = (pixels[..., 0] > 180) & (pixels[..., 1] > 90) & (pixels[..., 1] < 160) & (pixels[..., 2] < 60)
    assert orange.sum() > 100, "no on-chip (orange) wires in the picture"


# ---- the Kernel and the command ---------------------------------------------------------------


def test_kernel_render_and_notebook_repr():
    kernel = napkin.load(EXAMPLES / "matmul.napkin")["matmul"]
    assert kernel.render() == render(kernel)
    assert kernel.render(relabelled=True) == render(kernel, relabelled=True)
    assert kernel._repr_svg_() == kernel.render()
    assert kernel.render(relabelled=True, costs=True) == render(kernel, relabelled=True, costs=True)


def test_decorated_kernel_renders():
    @napkin.kernel(hardware="H100", relabel="smem: group q 64")
    def scaled(X: napkin.f32["q d"], alpha: napkin.f32) -> napkin.f32["q d"]:
        """Y[q d] = X * alpha"""

    assert "q g=64" in texts(scaled.render(relabelled=True))


def test_draw_prints_svg(capsys):
    os.chdir(ROOT)
    assert main(["draw", "examples/attention.napkin", "--relabelled"]) == 0
    out = capsys.readouterr().out
    assert out == render(napkin.load(EXAMPLES / "attention.napkin")["attention"], relabelled=True)


def test_draw_writes_a_file(tmp_path, capsys):
    target = tmp_path / "fig12.svg"
    assert main(["draw", str(EXAMPLES / "paper" / "fig12.napkin"), "--kernel", "fig12", "-o", str(target)]) == 0
    ET.fromstring(target.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig12.svg"]  # no temporary file left behind
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("argv, message", [
    (["--set", "m=64"], "add --costs"),
    (["--costs", "--set", "m=x"], "is not an integer"),
    (["--costs", "--hardware", "nope"], "unknown hardware 'nope'"),
    (["--costs", "--relabelled", "--hardware", "two_level"], "is for H100, not two_level"),
    (["--kernel", "nope"], "no kernel named 'nope'"),
    (["-o", "/nonexistent/dir/out.svg"], "cannot write"),
])
def test_draw_reports_user_errors_cleanly(argv, message, capsys):
    assert main(["draw", str(EXAMPLES / "matmul.napkin"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_draw_costs_at_sizes(capsys):
    os.chdir(ROOT)
    argv = ["draw", "examples/attention.napkin", "--relabelled", "--costs", "--set", "b=4", "h=32", "--set", "q=8192", "x=8192", "d=128"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    sizes = {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128}
    assert out == render(napkin.load(EXAMPLES / "attention.napkin")["attention"], relabelled=True, costs=True, sizes=sizes)
    assert cost_rows(out)["M @smem"][-1] == f"{128 * 128 + 6 * 2 * 64 * 128:,}"  # Q, 6 stages of K and V


def test_draw_costs_on_a_named_hardware(capsys):
    os.chdir(ROOT)
    assert main(["draw", "examples/attention_unfused.napkin", "--costs", "--hardware", "H100", "--set", "q=1024", "x=1024", "d=128"]) == 0
    out = capsys.readouterr().out
    assert cost_rows(out)["H @smem"] == ["1,310,720", "2,097,152", "1,310,720", "4,718,592"]
    assert "smem: on chip" in texts(out)


def test_draw_asks_which_kernel(tmp_path, capsys):
    source = tmp_path / "two.napkin"
    source.write_text("kernel one(X: f32[n]) -> Y: f32[n]:\n    Y[n] = X * 2\n\nkernel two(X: f32[n]) -> Y: f32[n]:\n    Y[n] = X + 1\n")
    assert main(["draw", str(source)]) == 2
    assert "--kernel" in capsys.readouterr().err
    assert main(["draw", str(source), "--kernel", "two"]) == 0
    assert "X + 1" in texts(capsys.readouterr().out)
