"""Neural circuit diagrams as SVG: well-formed, complete, deterministic, readable, golden."""

from __future__ import annotations

import io
import os
import xml.etree.ElementTree as ET

import pytest

import napkin_dsl as napkin
from napkin_dsl.cli import main
from napkin_dsl.diagram import Apply, Contract, Opaque, Reduce, Softmax, reads
from napkin_dsl.render import layout, plan_levels, render

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
    for level in plan_levels(kernel).drawn:
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
    for column, box in zip(FIG9_COLUMNS, drawing.box_rects):
        for key in ("label", "M", "H"):
            cell = cells[column[key]]
            assert abs((cell[0] + cell[2]) / 2 - (box[0] + box[2]) / 2) < 0.5, f"{column[key]} is not under its box"
            assert cell[1] > box[3]
    text = texts(render(kernel, columns=FIG9_COLUMNS))
    for head in ("step", "M", "H"):
        assert head in text.split()


def test_costs_without_columns_is_not_implemented_yet():
    kernel = napkin.load(EXAMPLES / "paper" / "fig9.napkin")["fig9"]
    with pytest.raises(NotImplementedError, match="columns"):
        render(kernel, costs=True)
    assert "qx + xd" in render(kernel, costs=True, columns=FIG9_COLUMNS)


def test_columns_must_match_the_statements():
    kernel = napkin.load(EXAMPLES / "paper" / "fig9.napkin")["fig9"]
    with pytest.raises(ValueError, match="2 statements"):
        render(kernel, columns=FIG9_COLUMNS[:1])


# ---- golden files and pictures ---------------------------------------------------------------


@pytest.mark.parametrize("path", ["attention.napkin", "matmul.napkin", "paper/fig12.napkin"])
def test_svg_golden(path, golden):
    (kernel,) = napkin.load(EXAMPLES / path).values()
    golden(f"svg/{path.replace('/', '__').replace('.napkin', '')}.relabelled.svg", render(kernel, relabelled=True))


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
    with pytest.raises(NotImplementedError):
        kernel.render(costs=True)


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
    (["--costs"], "--costs is not available yet"),
    (["--kernel", "nope"], "no kernel named 'nope'"),
    (["-o", "/nonexistent/dir/out.svg"], "cannot write"),
])
def test_draw_reports_user_errors_cleanly(argv, message, capsys):
    assert main(["draw", str(EXAMPLES / "matmul.napkin"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_draw_asks_which_kernel(tmp_path, capsys):
    source = tmp_path / "two.napkin"
    source.write_text("kernel one(X: f32[n]) -> Y: f32[n]:\n    Y[n] = X * 2\n\nkernel two(X: f32[n]) -> Y: f32[n]:\n    Y[n] = X + 1\n")
    assert main(["draw", str(source)]) == 2
    assert "--kernel" in capsys.readouterr().err
    assert main(["draw", str(source), "--kernel", "two"]) == 0
    assert "X + 1" in texts(capsys.readouterr().out)
