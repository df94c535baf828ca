"""mkdocs hook: every command output, error text, table and example page of the site, generated
while it builds, so that no page can drift from the tool.

Pages are Markdown with a few fenced blocks that this hook replaces by real output:

``napkin-cli``  one command per line, shown as ``$ COMMAND`` and what it prints. ``napkin ...``
    runs the CLI in this process; ``cat FILE`` shows a file; ``python FILE`` runs a script.
    Attributes: ``expect=ok`` (the default), ``expect=error`` or ``expect=any``.
``napkin-md``   one napkin command whose output is Markdown (``--format markdown``): inserted as is.
``napkin-draw``  one ``napkin draw ... -o NAME.svg`` command, shown and run as written; the SVG it
    writes becomes a file of the site beside the page and is shown in the page (``alt=`` names it).
``napkin-source file=NAME``  napkin text saved as NAME in the page's scratch directory and shown
    under that name, so that later commands on the page can use it.
``python-run``  Python executed in one namespace per page; shown with what it prints. A
    NapkinError is shown the way Python reports it (``expect=error`` says one is wanted).
    ``figure=NAME.svg``: the SVG the block writes, shown under it as napkin-draw's are.

and HTML comments replaced by generated sections: ``<!-- napkin:grammar -->``,
``<!-- napkin:functions -->``, ``<!-- napkin:dtypes -->``, ``<!-- napkin:hardware -->``,
``<!-- napkin:cli -->``, ``<!-- napkin:modules -->`` (the module map of the architecture page),
``<!-- napkin:examples -->``, and for the tensor-core page
``<!-- napkin:tc-swizzle -->``, ``<!-- napkin:tc-wavefronts -->``, ``<!-- napkin:tc-pipeline -->``,
``<!-- napkin:tc-epilogue -->``, ``<!-- napkin:tc-sass -->`` (a one-line note instead of SASS when nvdisasm is not installed).
The text of the sections in ``COMMITTED`` is also committed in the page, between the comment and
a closing ``<!-- /napkin:NAME -->``, so that the raw Markdown reads well; the build regenerates
it and warns (failing ``--strict``) when the committed text is out of date, and
``python docs/hooks/napkin_docs.py --update`` rewrites it. Diagrams are inline SVG at their
natural size, in a box that scrolls sideways where the column is narrower, with a link to the
SVG file under each.

Commands run in a scratch directory per page that holds ``examples`` and ``benchmarks`` (links
to the repository's), so paths in their output read as they do from the repository root.

Failures: a NapkinError is part of the output (the page shows it). A block whose outcome is not
the one it expects, or any other exception (a napkin bug), is logged as a warning, which fails
``mkdocs build --strict``: a page must never claim an error the checker no longer gives, or
show a traceback.

One page per file in ``examples/`` is generated (``examples/NAME.md``), with the diagram as
SVG before and after relabelling when ``Kernel.render`` exists.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import io
import logging
import os
import posixpath
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from markdown.extensions import Extension
from markdown.preprocessors import Preprocessor
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
log = logging.getLogger("mkdocs.hooks.napkin_docs")


# ---- which sizes each example is shown at ------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """How an example page shows costs: on which hardware, at which sizes, and why those."""

    hardware: str
    sizes: dict = field(default_factory=dict)
    why: str = ""

    def set_args(self) -> str:
        return (" --set " + " ".join(f"{k}={v}" for k, v in self.sizes.items())) if self.sizes else ""

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.sizes.items())


# Keyed by path under examples/. Sizes are ones these kernels run at in practice.
SETUPS = {
    "attention.napkin": Setup("H100", {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128},
                              "4 sequences of 8k tokens, 32 heads of dimension 128 (the FlashAttention-2/3 benchmark shape)."),
    "attention.py": Setup("H100", {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128},
                          "the same sizes as `attention.napkin`."),
    "attention_unfused.napkin": Setup("H100", {"q": 1024, "x": 1024, "d": 128},
                                      "one head of 1k tokens: materialising S and P at gmem limits how far this form goes "
                                      "(see the cost section)."),
    "causal_attention.napkin": Setup("H100", {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128},
                                     "the FlashAttention benchmark shape, causal: about half the tiles are visited."),
    "sliding_window.napkin": Setup("H100", {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128},
                                   "8k tokens with a 256-token window: a band of tiles along the diagonal."),
    "attention_lse.napkin": Setup("H100", {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128},
                                  "the same sizes as `attention.napkin`; L adds one value per query."),
    "gqa.napkin": Setup("H100", {"b": 4, "kv": 8, "r": 4, "q": 8192, "x": 8192, "d": 128},
                        "8 key/value heads each serving 4 query heads (32 query heads), 8k tokens, d = 128."),
    "matmul.napkin": Setup("H100", {"m": 8192, "n": 8192, "k": 8192}, "the square 8192 GEMM cuBLAS is usually measured at."),
    "mlp.napkin": Setup("H100", {"b": 8192, "k": 4096, "n": 14336},
                        "8192 tokens through the up-projection of a 4096-wide model with a 14336-wide hidden layer."),
    "rmsnorm.napkin": Setup("H100", {"t": 16384, "d": 4096}, "16k tokens of a 4096-wide model."),
    "swiglu.napkin": Setup("H100", {"t": 512, "m": 1024, "f": 2816, "e": 1024},
                           "512 tokens through the gated MLP of a 1024-wide model with a 2816-wide hidden layer."),
    "softmax.napkin": Setup("H100", {"r": 32768, "c": 1024}, "32k rows of 1024."),
    "paper/fig9.napkin": Setup("two_level", {}, "the paper's abstract two-level model, symbolically."),
    "paper/fig11.napkin": Setup("two_level", {}, "an opaque box has no FLOP rate on a GPU: the paper's two-level model, symbolically."),
    "paper/fig12.napkin": Setup("two_level", {}, "an opaque box has no FLOP rate on a GPU: the paper's two-level model, symbolically."),
}
DEFAULT_SIZE = 4096  # for an example added without a Setup entry


@dataclass(frozen=True)
class Example:
    source: Path  # under examples/
    page: str  # docs-relative path of its page

    @property
    def rel(self) -> str:
        return self.source.relative_to(EXAMPLES).as_posix()

    @property
    def cli_path(self) -> str:
        return f"examples/{self.rel}"

    @property
    def stem(self) -> str:
        return self.page.rsplit("/", 1)[-1][: -len(".md")]


def examples() -> list[Example]:
    """Every example file, with the page it gets: attention.napkin -> examples/attention.md."""
    found = []
    for path in sorted(EXAMPLES.rglob("*.napkin")) + sorted(EXAMPLES.rglob("*.py")):
        rel = path.relative_to(EXAMPLES).with_suffix("")
        name = rel.as_posix() + ("_py" if path.suffix == ".py" else "")
        found.append(Example(path, f"examples/{name}.md"))
    return found


def kernels_of(example: Example) -> dict:
    """The kernels an example defines, by name."""
    import napkin_dsl as napkin

    if example.source.suffix == ".napkin":
        return napkin.load(example.source)
    namespace = runpy.run_path(str(example.source), run_name="napkin_docs")
    return {value.name: value for value in namespace.values() if isinstance(value, napkin.Kernel)}


def setup_for(example: Example) -> Setup:
    if example.rel in SETUPS:
        return SETUPS[example.rel]
    try:
        axes = sorted({a for k in kernels_of(example).values() for a in k.diagram.axes})
    except Exception:  # the page shows the error
        axes = []
    return Setup("H100", {a: DEFAULT_SIZE for a in axes}, f"every axis at {DEFAULT_SIZE} (no sizes chosen for this example yet).")


# ---- running things ------------------------------------------------------------------------------


class Workspace:
    """A scratch directory per page, holding links to the examples and the benchmarks."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="napkin-docs-"))
        self.pages: dict[str, Path] = {}

    def for_page(self, src_uri: str) -> Path:
        if src_uri not in self.pages:
            path = self.root / re.sub(r"[^A-Za-z0-9_.-]", "_", src_uri)
            path.mkdir()
            for linked in (EXAMPLES, ROOT / "benchmarks"):
                try:
                    (path / linked.name).symlink_to(linked, target_is_directory=True)
                except OSError:  # no symlinks here: copy
                    shutil.copytree(linked, path / linked.name)
            self.pages[src_uri] = path
        return self.pages[src_uri]

    def remove(self):
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def _in_directory(path: Path):
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@dataclass
class Outcome:
    ok: bool  # exit status 0 / no exception
    text: str
    bug: bool = False  # an exception that is not a NapkinError


def run_napkin(argv: list[str], cwd: Path) -> Outcome:
    """The ``napkin`` CLI, in this process: what it prints on stdout and stderr, in order."""
    from napkin_dsl.cli import main

    buffer = io.StringIO()
    with _in_directory(cwd), contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            status = main(argv)
        except SystemExit as exit_:  # argparse: a usage error
            status = exit_.code if isinstance(exit_.code, int) else 1
        except Exception:  # a napkin bug: the CLI lets it through with its traceback
            return Outcome(False, buffer.getvalue() + traceback.format_exc(), bug=True)
    return Outcome(status == 0, buffer.getvalue())


def run_command(line: str, cwd: Path) -> Outcome:
    words = shlex.split(line)
    if not words:
        return Outcome(True, "")
    if words[0] == "napkin":
        return run_napkin(words[1:], cwd)
    if words[0] == "cat":
        try:
            return Outcome(True, "".join((cwd / w).read_text() for w in words[1:]))
        except OSError as exc:
            return Outcome(False, f"cat: {exc}", bug=True)
    if words[0] == "python":
        result = subprocess.run([sys.executable, *words[1:]], cwd=cwd, capture_output=True, text=True, timeout=600)
        return Outcome(result.returncode == 0, result.stdout + result.stderr, bug=result.returncode != 0)
    return Outcome(False, f"napkin docs: cannot run {line!r} (only napkin, cat and python)", bug=True)


def run_python(code: str, namespace: dict, cwd: Path) -> Outcome:
    from napkin_dsl.errors import NapkinError

    buffer = io.StringIO()
    with _in_directory(cwd), contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            exec(compile(code, "<docs>", "exec"), namespace)
        except NapkinError as error:
            return Outcome(False, buffer.getvalue() + "".join(traceback.format_exception_only(type(error), error)))
        except Exception:
            return Outcome(False, buffer.getvalue() + traceback.format_exc(), bug=True)
    return Outcome(True, buffer.getvalue())


# ---- expanding a page --------------------------------------------------------------------------

_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<kind>napkin-cli|napkin-md|napkin-draw|napkin-source|python-run)(?P<attrs>[^\n]*)\n"
    r"(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.M | re.S,
)
_COMMENT = re.compile(r"^(?P<indent>[ \t]*)<!-- napkin:(?P<what>[a-z-]+)(?P<args>[^>]*?)\s*-->[ \t]*$"
                      r"(?:\n(?P<body>.*?)^(?P=indent)<!-- /napkin:(?P=what) -->[ \t]*$)?", re.M | re.S)
# Generated sections whose text is committed between their markers, so that the Markdown reads
# well on its own (on a forge); the build checks the committed text is current. The others
# depend on the machine (tc-sass: whether nvdisasm is installed) or are links (diagram).
COMMITTED = ("grammar", "functions", "dtypes", "hardware", "cli", "modules", "tc-swizzle", "tc-wavefronts", "tc-pipeline", "tc-epilogue")
UPDATE_COMMAND = "python docs/hooks/napkin_docs.py --update"


def _fenced(text: str, lang: str = "text", title: str | None = None) -> str:
    text = text.rstrip("\n")
    ticks = "```"
    while ticks in text:
        ticks += "`"
    head = f"{ticks}{lang}" + (f' title="{title}"' if title else "")
    return f"{head}\n{text}\n{ticks}"


def _indent(text: str, indent: str) -> str:
    return "\n".join(indent + line if line else line for line in text.split("\n"))


def _dedent_by(text: str, indent: str) -> str:
    return "\n".join(line.removeprefix(indent) for line in text.split("\n"))


def _diagram_slot(alt: str, svg: str) -> str:
    """Where a diagram goes: a paragraph of its own that :func:`on_page_content` replaces by the
    SVG itself (:func:`_inline_diagram`). ``svg`` is the SVG file's path in the site (the key of
    ``_state["diagrams"]``). A placeholder rather than the SVG in the Markdown: Markdown would
    read the indented SVG inside a tab as a code block."""
    attrs = " ".join(f'data-{name}="{html.escape(value, quote=True)}"' for name, value in (("svg", svg), ("alt", alt)))
    return f'<span class="napkin-diagram-slot" {attrs}></span>'


_SLOT = re.compile(r'(?:<p>\s*)?<span class="napkin-diagram-slot" (?P<attrs>[^>]*)></span>(?:\s*</p>)?')


def _page_link(url: str, target: str) -> str:
    """A link from the page at ``url`` (mkdocs' page.url: ``examples/attention/``, ``""``) to the
    site file ``target``: raw HTML put in after Markdown is not rewritten by mkdocs."""
    base = url if url.endswith("/") or not url else posixpath.dirname(url)
    return posixpath.relpath(target, base.rstrip("/") or ".")


def _inline_diagram(alt: str, svg: str, href: str) -> str:
    """A diagram in the page at its natural size, in a box that scrolls sideways where the column
    is narrower. Scaled to the column, a 1500 px drawing set its labels 5 px high; inline (not an
    ``<img>``), its boxes show their statements on hover and its labels can be found and copied.
    The link under it opens the SVG file by itself."""
    svg = re.sub(r"^\s*<\?xml[^>]*\?>\s*", "", svg)
    label = html.escape(alt, quote=True)
    return (f'<div class="napkin-diagram">\n<div class="napkin-diagram__view" tabindex="0" role="group" '
            f'aria-label="{label}">\n{svg.strip()}\n</div>\n'
            f'<a class="napkin-diagram__file" href="{html.escape(href, quote=True)}">{html.escape(alt)} (SVG file)</a>\n</div>')


def _no_headings(markdown: str) -> str:
    """Generated Markdown inside a page: its headings become bold lines, so that they do not
    enter the page's table of contents (a tutorial's "softcap on H100")."""
    return re.sub(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", r"**\1**", markdown, flags=re.M)


class Page:
    """Expands the blocks of one page; complains (warnings) about what went wrong."""

    def __init__(self, src_uri: str, workspace: Workspace, config=None, files=None):
        self.src_uri = src_uri
        self.cwd = workspace.for_page(src_uri)
        self.namespace: dict = {"__name__": "napkin_docs_page"}
        self.config, self.files = config, files

    def complain(self, what: str, outcome: Outcome | None = None):
        detail = f"\n{outcome.text.rstrip()}" if outcome is not None and outcome.text else ""
        log.warning(f"{self.src_uri}: {what}{detail}")

    def judge(self, expect: str, outcome: Outcome, what: str):
        if outcome.bug:
            self.complain(f"{what} failed inside napkin (a bug, not a user error)", outcome)
        elif expect == "ok" and not outcome.ok:
            self.complain(f"{what} was expected to succeed", outcome)
        elif expect == "error" and outcome.ok:
            self.complain(f"{what} was expected to report an error, and did not", outcome)

    def fence(self, match: re.Match) -> str:
        kind, body, indent = match["kind"], textwrap.dedent(match["body"]), match["indent"]
        attrs = dict(part.split("=", 1) if "=" in part else (part, "") for part in shlex.split(match["attrs"]))
        expect = attrs.get("expect", "ok")
        if kind == "napkin-source":
            name = attrs.get("file")
            if not name:
                self.complain("a napkin-source block needs file=NAME")
                return match[0]
            (self.cwd / name).write_text(body)
            return _indent(_fenced(body, "text", title=name), indent)
        if kind == "python-run":
            outcome = run_python(body, self.namespace, self.cwd)
            self.judge(expect, outcome, "a python-run block")
            shown = _fenced(body, "python")
            if outcome.text.strip():
                shown += "\n\n" + _fenced(outcome.text, "text", title="output")
            figure = attrs.get("figure")
            if figure and outcome.ok and self.files is not None:
                if not figure.endswith(".svg") or "/" in figure or not (self.cwd / figure).is_file():
                    self.complain(f"a python-run block with figure={figure} must write NAME.svg in its directory")
                else:
                    shown += "\n\n" + self.publish(figure, attrs.get("alt", figure))
            return _indent(shown, indent)
        if kind == "napkin-md":
            line = body.strip()
            outcome = run_command(line, self.cwd)
            self.judge(expect, outcome, f"'{line}'")
            return _indent(_no_headings(outcome.text.rstrip("\n")) if outcome.ok else _fenced(f"$ {line}\n{outcome.text}"), indent)
        if kind == "napkin-draw":
            return _indent(self.draw(body.strip(), attrs), indent)
        # napkin-cli
        parts = []
        for line in (raw.strip() for raw in body.splitlines()):
            if not line:
                continue
            outcome = run_command(line, self.cwd)
            self.judge(expect, outcome, f"'{line}'")
            parts.append(f"$ {line}\n{outcome.text.rstrip()}")
        return _indent(_fenced("\n\n".join(parts), "text", title=attrs.get("title")), indent)

    def comment(self, match: re.Match) -> str:
        what, args = match["what"], match["args"].split()
        if what == "diagram":
            return _indent(self.diagram(*args), match["indent"])
        makers = section_makers()
        if what not in makers:
            self.complain(f"unknown generated section <!-- napkin:{what} -->")
            return match[0]
        try:
            generated = makers[what]()
        except Exception:
            self.complain(f"generating <!-- napkin:{what} --> failed", Outcome(False, traceback.format_exc(), bug=True))
            return ""
        if what in COMMITTED:
            committed = match["body"]
            if committed is None:
                self.complain(f"<!-- napkin:{what} --> has no committed text and no <!-- /napkin:{what} --> marker; "
                              f"run {UPDATE_COMMAND}")
            elif _dedent_by(committed, match["indent"]).strip() != generated.strip():
                self.complain(f"the committed text of <!-- napkin:{what} --> is out of date; run {UPDATE_COMMAND}")
        return _indent(generated, match["indent"])

    def draw(self, line: str, attrs: dict) -> str:
        """``napkin-draw``: one ``napkin draw ... -o NAME.svg`` command, shown and run as written;
        the SVG it writes becomes a file of the site beside the page, shown in the page under the
        command. The ``-o`` is part of the source, so that a reader who copies the command gets a
        file, not 20 KB of SVG on the terminal."""
        words = shlex.split(line)
        name = next((words[i + 1] for i, word in enumerate(words[:-1]) if word in ("-o", "--output")), None)
        if words[:2] != ["napkin", "draw"] or not name or not name.endswith(".svg") or "/" in name or self.files is None:
            self.complain(f"a napkin-draw block needs one 'napkin draw ... -o NAME.svg' line, not {line!r}")
            return ""
        outcome = run_command(line, self.cwd)
        self.judge("ok", outcome, f"'{line}'")
        shown = _fenced(f"$ {line}\n{outcome.text.rstrip()}", "text")
        if not outcome.ok:
            return shown
        return f"{shown}\n\n{self.publish(name, attrs.get('alt', name))}"

    def publish(self, name: str, alt: str) -> str:
        """The SVG file ``name`` a block wrote in the page's scratch directory, made a file of the
        site beside the page, and its slot in the page (:func:`_diagram_slot`)."""
        directory = self.src_uri.rsplit("/", 1)[0] + "/" if "/" in self.src_uri else ""
        stem = self.src_uri.rsplit("/", 1)[-1][: -len(".md")]
        site_name = f"{stem}.{name}"
        svg = (self.cwd / name).read_text()
        self.files.append(File.generated(self.config, directory + site_name, content=svg))
        _state.setdefault("diagrams", {})[directory + site_name] = svg
        return _diagram_slot(alt, directory + site_name)

    def diagram(self, source: str = "", variant: str = "relabelled") -> str:
        """``<!-- napkin:diagram examples/X.napkin [written|relabelled] -->``: the example's drawing,
        or nothing when napkin cannot draw it."""
        example = next((e for e in examples() if e.cli_path == source), None)
        if example is None:
            self.complain(f"<!-- napkin:diagram {source} --> names no example")
            return ""
        if (example.page, variant) not in _state.get("svgs", {}):
            return ""
        target = example.page[: -len(".md")] + f".{variant}.svg"
        return _diagram_slot(f"{example.rel}, {variant}", target)

    def expand(self, markdown: str) -> str:
        markdown = _FENCE.sub(self.fence, markdown)
        return _COMMENT.sub(self.comment, markdown)


# ---- generated sections ----------------------------------------------------------------------


def section_makers() -> dict:
    """``<!-- napkin:NAME -->`` -> the function that generates its Markdown."""
    return {
        "grammar": grammar_section,
        "functions": functions_section,
        "dtypes": dtypes_section,
        "hardware": hardware_section,
        "cli": cli_section,
        "modules": modules_section,
        "examples": examples_section,
        "tc-swizzle": tc_swizzle_section,
        "tc-wavefronts": tc_wavefronts_section,
        "tc-pipeline": tc_pipeline_section,
        "tc-epilogue": tc_epilogue_section,
        "tc-sass": tc_sass_section,
    }


def update_committed(docs: Path = ROOT / "docs") -> list[Path]:
    """Write the current text of every committed section between its markers; the files changed."""
    makers, changed = section_makers(), []

    def replace(match: re.Match) -> str:
        what, indent = match["what"], match["indent"]
        if what not in COMMITTED:
            return match[0]
        opening = match[0].split("\n", 1)[0]
        return f"{opening}\n{_indent(makers[what]().strip(), indent)}\n{indent}<!-- /napkin:{what} -->"

    for page in sorted(docs.glob("*.md")):
        text = page.read_text()
        updated = _COMMENT.sub(replace, text)
        if updated != text:
            page.write_text(updated)
            changed.append(page)
    return changed


def grammar_section() -> str:
    from napkin_dsl.syntax import GRAMMAR_PATH

    return _fenced(GRAMMAR_PATH.read_text(), "text", title="napkin_dsl/grammar/napkin.lark")


def functions_section() -> str:
    from napkin_dsl import elementwise
    from napkin_dsl.boxes import REDUCTION_OPS
    from napkin_dsl.diagram import OPERATORS

    def names(items):
        return ", ".join(f"`{n}`" for n in sorted(items))

    # Read off the table of elementwise functions (elementwise.FUNCTIONS), as the checker and the model read it.
    rows = [
        ("| kind | names | counted on |", "|---|---|---|"),
        (f"| unary maps | {names(elementwise.names(arity=1, unit='special'))} | special-function unit (one op per element) |",),
        (f"| unary maps | {names(elementwise.names(arity=1, unit='fma'))} | FMA pipe |",),
        (f"| binary maps | {names(elementwise.names(arity=2))}, written `max(a, b)` | FMA pipe |",),
        (f"| operators | {', '.join(f'`{o}`' for o in OPERATORS)} | FMA pipe; `^` with a non-integer exponent: special-function unit |",),
        (f"| reductions | {', '.join(f'`{n}[AXES]`' for n in sorted(REDUCTION_OPS))} | FMA pipe |",),
        ("| softmax | `softmax[AXIS]` | FMA pipe and special-function unit (`exp`) |",),
    ]
    note = ("\n\nEach operation counts one FLOP per element of the result; operations on scalars alone (`d^-0.5`) "
            "are folded when the kernel is checked and cost nothing.")
    return "\n".join(line for row in rows for line in row) + note


def dtypes_section() -> str:
    from napkin_dsl.dtypes import DTYPE_ALIASES, DTYPE_BYTES

    lines = ["| dtype | bytes per value |", "|---|---|"]
    lines += [f"| `{name}` | {size} |" for name, size in DTYPE_BYTES.items()]
    lines += [f"| `{alias}` | an alias of `{target}` |" for alias, target in DTYPE_ALIASES.items()]
    return "\n".join(lines)


def _toml_comments(path: Path) -> tuple[str, dict]:
    """The header comment of a profile, and the comment of each value by (section, key): the
    comment lines just above it (a source too long for one line) and the one beside it."""
    header, comments = [], {}
    section, level_index, started = "", -1, False
    above: list[str] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not started and line.startswith("#"):
            header.append(line.lstrip("#").strip())
            continue
        started = started or bool(line)
        if line.startswith("#"):
            above.append(line.lstrip("#").strip())
            continue
        if line.startswith("[[level]]"):
            level_index += 1
            section = f"level{level_index}"
        elif line.startswith("["):
            section = line.split("]")[0].strip("[ ")
            said = above + ([line.split("#", 1)[1].strip()] if "#" in line else [])  # a table's source sits above it
            if said:
                comments[(section, "")] = " ".join(said)
        elif "=" in line:
            key = line.split("=", 1)[0].strip()
            said = above + ([line.split("#", 1)[1].strip()] if "#" in line else [])
            if said:
                comments[(section, key)] = " ".join(said)
        above = []
    return " ".join(header), comments


def _quantity(value, unit: str) -> str:
    """A rate with a decimal prefix (``3.35 TB/s``), or a symbol of the abstract models."""
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= factor:
                return f"{value / factor:.4g} {prefix}{unit}"
        return f"{value:,} {unit}"
    return f"`{value}`"


def _capacity(value, counts_values: bool) -> str:
    """A capacity in bytes with its binary unit (``227 KiB (232,448 B)``), or values, or a symbol."""
    if value is None:
        return "-"
    if not isinstance(value, int):
        return f"`{value}` values" if counts_values else f"`{value}`"
    if counts_values:
        return f"{value:,} values"
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if value >= 1024**power and value % 1024**power == 0:
            return f"{value // 1024**power:,} {unit} ({value:,} B)"
    return f"{value:,} B"


def hardware_section() -> str:
    from napkin_dsl.hardware import PROFILE_DIR, hardware_names, load_hardware

    out = []
    gpus = [load_hardware(n) for n in hardware_names() if not load_hardware(n).symbolic]
    out += ["## At a glance", "",
            "| profile | arch (runs) | SMs | SMEM per block | L2 | HBM -> L2 | L2 -> SMEM | bf16 tensor | f32 FMA | special functions |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for hw in gpus:
        l2, smem = hw.level("l2"), hw.compute_level
        special = hw.peak_flops.get("special")
        out.append(
            f"| [{hw.name}](#{hw.name.lower()}) | {hw.arch} ({', '.join(hw.archs)}) | {smem.units} | {_capacity(smem.capacity, False)} "
            f"| {_capacity(l2.capacity, False)} | {_quantity(l2.bandwidth, 'B/s')} | {_quantity(smem.bandwidth, 'B/s')} "
            f"| {_quantity(hw.peak('tensor', 'bf16'), 'FLOP/s')} | {_quantity(hw.peak('fma', 'f32'), 'FLOP/s')} "
            f"| {_quantity(special, 'ops/s') if not isinstance(special, dict) else '-'} |"
        )
    out += ["", "Rates are dense (no sparsity). The tensor-core rate listed for `f32` is TF32's: napkin prices an "
            "f32 contraction at it.", ""]
    for name in hardware_names():
        hw = load_hardware(name)
        path = PROFILE_DIR / f"{name}.toml"
        header, comments = _toml_comments(path)
        out += [f"## {hw.name}", "", f"**{hw.description}.** File: `napkin_dsl/hardware/{path.name}`; "
                f"counts {'values (sizes are symbols; no time is predicted)' if hw.symbolic else 'bytes'}"
                + (f"; `{hw.arch}`; clock {hw.clock_hz / 1e9:.3g} GHz" if hw.arch and hw.clock_hz else "") + ".", ""]
        if header:
            out += [f"Sources and notes, from the file: {header}", ""]
        out += ["| level | per | capacity | bandwidth into it | units | compute | source |", "|---|---|---|---|---|---|---|"]
        # A node profile's device level (the GPUs, NVLink between them) is the file's first [[level]].
        levels = ([hw.device] if hw.device is not None else []) + list(hw.levels)
        for index, level in enumerate(levels):
            notes = [comments.get((f"level{index}", key)) for key in ("capacity", "bandwidth", "units", "threads_per_unit")]
            top = index == (1 if hw.device is not None else 0)
            capacity = "unbounded (top)" if top and level.capacity is None else _capacity(level.capacity, hw.symbolic)
            bandwidth = _quantity(level.bandwidth, "values/s" if hw.symbolic else "B/s")
            if level is hw.device:
                units, capacity, bandwidth = f"{level.units} GPUs", "-", f"{bandwidth} each way (between GPUs)"
            elif level.threads_per_unit:
                units = f"{level.threads_per_unit:,} threads per SM"
            elif level.units > 1:
                units = f"{level.units} SMs" if level.per == "block" else str(level.units)
            else:
                units = "-"
            out.append(f"| `{level.name}` | {level.per} | {capacity} | {bandwidth} | {units} | {'yes' if level.compute else ''} "
                       f"| {'; '.join(n for n in notes if n)} |")
        out.append("")
        if hw.peak_flops:
            out += ["| unit | peak rate by dtype | source |", "|---|---|---|"]
            for unit, rates in hw.peak_flops.items():
                if isinstance(rates, dict):
                    shown = ", ".join(f"{d} {_quantity(r, 'FLOP/s')}" for d, r in rates.items())
                else:
                    shown = _quantity(rates, "ops/s")
                source = comments.get(("peak_flops", unit)) or comments.get(("peak_flops", ""), "")
                out.append(f"| {unit} | {shown} | {source} |")
            out.append("")
        if hw.paths:  # the tensor-core instruction paths, as instruction selection and the model read them
            out += ["| path | instruction | shape | operands | archs | peak rate by dtype | source |", "|---|---|---|---|---|---|---|"]
            for key, p in hw.paths.items():
                rates = ", ".join(f"{d} {_quantity(r, 'FLOP/s')}" for d, r in p.rates.items())
                source = " ".join(c for c in (comments.get((f"path.{key}", "")), comments.get((f"path.{key}", "rates"))) if c)
                out.append(f"| `{key}` | `{p.instruction}` | `{p.shape}` | {', '.join(p.dtypes)} | {', '.join(p.archs)} "
                           f"| {rates} | {source} |")
            out.append("")
    return "\n".join(out)


def _parser_sections(parser: argparse.ArgumentParser, prog: str, depth: int) -> list[str]:
    out = []
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if prog != "napkin":
        out += [f"{'#' * depth} `{prog}`", ""]
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100, max_help_position=32)
    out += [_fenced(parser.format_help(), "text"), ""]
    for action in subparsers:
        descriptions = {c.dest: c.help for c in action._choices_actions}
        for name, child in action.choices.items():
            if descriptions.get(name):
                child.description = child.description or descriptions[name]
            out += _parser_sections(child, f"{prog} {name}", min(depth + 1, 4) if prog != "napkin" else depth)
    return out


def cli_section() -> str:
    from napkin_dsl.cli import build_parser

    return "\n".join(_parser_sections(build_parser(), "napkin", 2))


def examples_section() -> str:
    lines = ["| file | kernels | what it shows | costed on |", "|---|---|---|---|"]
    for example in examples():
        try:
            names = ", ".join(f"`{n}`" for n in kernels_of(example))
        except Exception as exc:  # shown on its page
            names = f"({type(exc).__name__})"
        setup = setup_for(example)
        lines.append(f"| [`{example.rel}`]({example.page.removeprefix('examples/')}) | {names} | {describe(example, first_line=True)} "
                     f"| {setup.hardware}{(' at ' + setup.label()) if setup.sizes else ''} |")
    return "\n".join(lines)


# ---- the architecture page (architecture.md) -----------------------------------------------------


def package_imports() -> dict[str, tuple[str, set[str]]]:
    """Every module of napkin_dsl -> (first line of its docstring, the napkin modules it imports).

    Read from the source with ``ast``: imports at module level and inside functions alike, as
    tests/test_imports.py reads them (the map shows what a module needs, lazily or not)."""
    import ast

    package = ROOT / "napkin_dsl"
    files = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    out = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names if alias.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    imported.add(target if target in files else source)
        doc = (ast.get_docstring(tree) or "").strip().splitlines()
        out[name] = (doc[0] if doc else "", {m for m in imported if m in files and m != name})
    return out


def _short(module: str) -> str:
    return module.removeprefix("napkin_dsl.") if module != "napkin_dsl" else "napkin_dsl (the package)"


def _inline(text: str) -> str:
    """A docstring line in a table cell: Sphinx roles as code, no table-breaking bars."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")
    return text.replace("|", "\\|")


def modules_section() -> str:
    """The module map: napkin_dsl's modules in layers, each importing only modules of layers above it."""
    graph = package_imports()
    layer: dict[str, int] = {}

    def depth(module: str, path: tuple = ()) -> int:
        if module in path:  # tests/test_imports.py fails on a cycle; the map must still build
            return 0
        if module not in layer:
            layer[module] = 1 + max((depth(m, path + (module,)) for m in graph[module][1]), default=-1)
        return layer[module]

    for module in graph:
        depth(module)
    lines = ["| layer | module | what it is | imports |", "|---|---|---|---|"]
    for module in sorted(graph, key=lambda m: (layer[m], m)):
        doc, imports = graph[module]
        shown = ", ".join(f"`{_short(m)}`" for m in sorted(imports, key=lambda m: (layer[m], m))) or "-"
        lines.append(f"| {layer[module]} | `{_short(module)}` | {_inline(doc)} | {shown} |")
    return "\n".join(lines)


# ---- the tensor-core page (tensor-cores.md) -----------------------------------------------------

# bf16 operand tiles (rows x cols) with row pitches of 32, 64, 128, 256 and 512 bytes.
TC_TILES = ((64, 16), (64, 32), (64, 64), (64, 128), (32, 256))
TC_EXAMPLE_TILE = (64, 128)  # a K or V chunk of 64 keys at d = 128
# The launch whose printed stream loop the page shows, and the SASS command it runs.
TC_PIPELINE = ("examples/attention.napkin", {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128})
# The tensor-core page's generated sections describe the mma.sync path: sm_90, not the H100
# profile's own arch (sm_90a, whose wgmma lowering docs/tensor-cores.md describes in prose).
TC_ARCH = "sm_90"
TC_SASS_COMMAND = f"napkin cuda examples/matmul.napkin --set m=1024 n=1024 k=1024 --arch {TC_ARCH} --sass"


def _unswizzled(tile):
    """The same tile without the XOR: every row's key is 0."""
    from napkin_dsl.layouts import SwizzledTile

    class Unswizzled(SwizzledTile):
        def key(self, row):
            return 0

    return Unswizzled(tile.rows, tile.cols, tile.element_bytes)


def _key_text(tile) -> str:
    if tile.bits == 0:
        return "0"
    row = "r" if tile.rows_per_line == 1 else f"floor(r / {tile.rows_per_line})"
    return f"{row} mod {1 << tile.bits}"


def _bank_groups(tile, rows=8) -> str:
    """The bank group (which of the eight groups of four 4-byte banks) of logical unit 0 of rows 0..7."""
    from napkin_dsl.layouts import LINE, UNIT

    return " ".join(str(tile.unit_offset(r, 0) % LINE // UNIT) for r in range(rows))


def tc_swizzle_section() -> str:
    """How each supported row pitch is swizzled, and the permutation of one 64 x 128 bf16 tile."""
    from napkin_dsl.layouts import SwizzledTile

    out = ["| row pitch | example tile (bf16) | rows sharing a 128-byte line | key(r) | bank groups of unit 0, rows 0-7 "
           "| ... without the swizzle |", "|---|---|---|---|---|---|"]
    for rows, cols in TC_TILES:
        tile = SwizzledTile(rows, cols, 2)
        out.append(f"| {tile.pitch} B | {rows} x {cols} | {tile.rows_per_line} | `{_key_text(tile)}` "
                   f"| {_bank_groups(tile)} | {_bank_groups(_unswizzled(tile))} |")
    tile = SwizzledTile(*TC_EXAMPLE_TILE, 2)
    out += ["", f"The {tile.rows} x {tile.cols} bf16 tile ({tile.pitch}-byte rows, {tile.units_per_row} units a row): "
            "the physical 16-byte unit of logical units 0-7 of rows 0-7 (units 8-15 are permuted the same way "
            "within the row's second 128 bytes).", "",
            "| row | key | " + " | ".join(f"unit {u}" for u in range(8)) + " |", "|---" * 10 + "|"]
    for r in range(8):
        out.append(f"| {r} | {tile.key(r)} | " + " | ".join(str(tile.unit_offset(r, u) % tile.pitch // 16) for u in range(8)) + " |")
    return "\n".join(out)


def tc_ldmatrix_wavefronts(tile) -> int:
    """The most wavefronts one 8-lane phase of any ldmatrix.x4 the printer issues on ``tile`` takes:
    A and B operands, with and without .trans, at every fragment origin."""
    from napkin_dsl.layouts import ldmatrix_phases, wavefronts

    worst = 0
    for operand in "ab":
        for trans in (False, True):
            outer_extent, k_extent = (tile.cols, tile.rows) if trans else (tile.rows, tile.cols)
            for outer in range(0, outer_extent - 15, 16):
                for k in range(0, k_extent - 15, 16):
                    for addresses in ldmatrix_phases(tile, operand, trans, outer, k):
                        worst = max(worst, wavefronts(addresses))
    return worst


def tc_cp_async_wavefronts(tile) -> int:
    """The most wavefronts one warp's cp.async writes take: 32 consecutive 16-byte units of the
    tile, in the order the printed copy loop hands them out."""
    from napkin_dsl.layouts import wavefronts

    units = tile.units_per_row
    total = tile.rows * units
    return max(wavefronts([tile.unit_offset(u // units, u % units) for u in range(first, min(first + 32, total))])
               for first in range(0, total, 32))


def tc_wavefronts_section() -> str:
    from napkin_dsl.layouts import SwizzledTile

    out = ["| tile (bf16) | row pitch | ldmatrix phase (8 rows of 16 B) | ... without the swizzle "
           "| cp.async, one warp (32 x 16 B) | ... without the swizzle |", "|---|---|---|---|---|---|"]
    for rows, cols in TC_TILES:
        tile = SwizzledTile(rows, cols, 2)
        plain = _unswizzled(tile)
        out.append(f"| {rows} x {cols} | {tile.pitch} B | {tc_ldmatrix_wavefronts(tile)} | {tc_ldmatrix_wavefronts(plain)} "
                   f"| {tc_cp_async_wavefronts(tile)} | {tc_cp_async_wavefronts(plain)} |")
    return "\n".join(out)


_TC_KEEP = re.compile(r"^(for \(int c_|if \(c_|NK_CP_COMMIT|NK_CP_WAIT|NK_SYNC|// )")
_TC_PRIMITIVES = {  # macro -> what it is, for the abbreviated lines of the skeleton
    "NK_CP16": "cp.async 16 B of {array} into its swizzled tile",
    "NK_LDSM": "ldmatrix.x4 from {array}",
    "NK_LDSM_T": "ldmatrix.x4.trans from {array}",
    "NK_PACK_BF16": "two f32 accumulators -> one bf16x2 A register",
    "NK_PACK_F16": "two f32 accumulators -> one f16x2 A register",
    "NK_MMA_BF16": "mma.sync.m16n8k16, bf16 operands, f32 accumulators",
    "NK_MMA_F16": "mma.sync.m16n8k16, f16 operands, f32 accumulators",
    "NK_SHFL_XOR": "shuffle across the quad of lanes that holds a row",
}


def tc_stream_skeleton(source: str, smem_names: dict | None = None) -> list[str]:
    """The printed stream loop with only its pipeline left: the chunk loop, commit, wait and
    barriers, the step comments, and each primitive once per run (``smem_names``: shared-memory
    offset -> array, to name what ldmatrix reads). A loop unrolled by its stages shows its first
    stage in full and the others by their opening comment."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\s*// for \w+ in \d+ chunks", line))
    out, stack, last, skipping = [], [], None, None
    for line in lines[start:]:
        text = line.strip()
        # a line opens a block where it ends in "{", or in "{" and a comment (the rolled loop's)
        opens = text.endswith("{") or text.startswith("{") or bool(re.search(r"\{\s*//[^{}]*$", text))
        closes = text.startswith("}")
        if skipping is not None:  # inside a later stage: only its end matters
            skipping += opens - closes
            if skipping == 0:
                skipping = None
            continue
        if closes:
            if not stack:
                break
            kept = stack.pop()
            if kept:
                out.append("    " * sum(stack) + "}")
                if not stack:  # the chunk loop is closed
                    break
            continue
        stage = re.match(r"\{\s*// stage (\d+)", text)
        if stage and int(stage[1]) > 0:
            out.append("    " * sum(stack) + f"{{ /* stage {stage[1]}: the same steps, on its own buffers */ }}")
            skipping = 1
            continue
        keep = bool(_TC_KEEP.match(text)) or stage is not None
        primitive = re.search(r"\b(NK_[A-Z0-9_]+)\(", text)
        if primitive and primitive[1] in _TC_PRIMITIVES:
            array = re.search(r"\bg_(\w+)", text)
            offset = re.match(r"[\w\[\]]+, (\d+) ", text[primitive.end():])
            name = array[1] if array else (smem_names or {}).get(int(offset[1]), "?") if offset else "?"
            text = f"{primitive[1]}(...);  // {_TC_PRIMITIVES[primitive[1]].format(array=name)}"
            keep = text != last
            last = text
        elif keep:
            last = None
        if keep:
            out.append("    " * sum(stack) + text)
        if opens:
            stack.append(keep)
    return out


def _depth(line: str) -> int:
    return len(line) - len(line.lstrip())


def tc_pipeline_summary(skeleton: list[str]) -> str:
    """What the skeleton's commit groups and wait leave in flight while a chunk computes."""
    prefetch = next((i for i, s in enumerate(skeleton) if re.match(r"\s*if \(\(?c_", s)), None)
    waits = [i for i, s in enumerate(skeleton) if s.strip().startswith("NK_CP_WAIT")]
    if prefetch is None or not waits:
        return "This launch streams no operand through cp.async."
    # The wait the copies just issued meet next: later in the body, or at the top of the next trip.
    wait = next((i for i in waits if i > prefetch), len(skeleton))
    depth = _depth(skeleton[prefetch])  # the chunk's own level
    after = sum(1 for s in skeleton[prefetch:wait] if s.strip().startswith("NK_CP_COMMIT"))
    pending = int(re.search(r"NK_CP_WAIT\((\d+)\)", skeleton[wait if wait < len(skeleton) else waits[0]])[1])
    barriers = 0
    for s in skeleton[prefetch:]:
        if _depth(s) < depth:
            break
        barriers += _depth(s) == depth and s.strip().startswith("NK_SYNC")
    if not barriers:  # a loop of one chunk a trip: its barrier is at the trip's top, before the prefetch
        top = max(i for i in range(prefetch) if re.match(r"\s*for \(int c_", skeleton[i]) or i == 0)
        barriers = sum(1 for s in skeleton[top:prefetch] if _depth(s) == depth and s.strip().startswith("NK_SYNC"))
    computes = next((i for i in range(prefetch, wait) if skeleton[i].strip().startswith(("NK_MMA", "NK_WGMMA"))), None)
    if computes is not None:  # the chunk computes before the next wait: the copies just issued are in flight meanwhile
        verdict = ("and this chunk computes before that wait, so the next chunk's copies are in flight while it "
                   "computes")
    elif after <= pending:
        verdict = "so the next chunk's copies are still in flight while this chunk computes"
    else:
        verdict = ("so `cp.async.wait_group` also waits for the next chunk's copies before this chunk computes: "
                   "the second stage does not yet overlap copies with compute")
    return (f"Per chunk, this kernel commits {after} `cp.async` group{'s' if after != 1 else ''} from the issue of the next "
            f"chunk's copies to the wait, and waits until at most {pending} {'is' if pending == 1 else 'are'} pending, {verdict}. "
            f"It passes {barriers} barrier{'s' if barriers != 1 else ''} per chunk.")


def tc_pipeline_section() -> str:
    import napkin_dsl as napkin
    from napkin_dsl.backends import cuda
    from napkin_dsl.isel import launch_tiles, selection, smem_layout

    path, sizes = TC_PIPELINE
    (kernel,) = napkin.load(ROOT / path).values()
    program = kernel.gpu_program(None, **sizes)
    source, _ = cuda.generate(program, arch=TC_ARCH)
    smem_names = {}
    for launch in program.launches:
        plan = selection(program, launch, TC_ARCH).plan
        if plan is not None:
            slots, _ = smem_layout(plan, launch_tiles(launch)[0], program.diagram)
            smem_names.update({slot.offset: name for name, slot in slots.items()})
    skeleton = tc_stream_skeleton(source, smem_names)
    label = " ".join(f"{k}={v}" for k, v in sizes.items())
    return "\n".join([_fenced("\n".join(skeleton), "c", title=f"the stream loop of {path} at {label}, pipeline and primitives only"), "",
                      tc_pipeline_summary(skeleton)])


TC_EPILOGUE_EXAMPLES = ("attention.napkin", "gqa.napkin", "matmul.napkin", "mlp.napkin")


def tc_epilogue_section() -> str:
    """How each tensor-core example's outputs leave the block, read off its printed CUDA."""
    import napkin_dsl as napkin
    from napkin_dsl.backends import cuda
    from napkin_dsl.dtypes import DTYPE_BYTES
    from napkin_dsl.isel import launch_tiles, selection, smem_layout

    out = ["| example | output | output tile | shared memory of the launch | epilogue |", "|---|---|---|---|---|"]
    for rel in TC_EPILOGUE_EXAMPLES:
        setup = SETUPS[rel]
        (kernel,) = napkin.load(EXAMPLES / rel).values()
        program = kernel.gpu_program(None, **setup.sizes)
        source, _ = cuda.generate(program, arch=TC_ARCH)
        if "#define NK_ST16" not in source:
            raise RuntimeError("the tensor-core prelude no longer defines NK_ST16: update tc_epilogue_section")
        for launch in program.launches:
            plan = selection(program, launch, TC_ARCH).plan
            if plan is None:
                raise RuntimeError(f"{rel} at {setup.label()} is no longer on the tensor-core path")
            tile = launch_tiles(launch)[0]
            arena = smem_layout(plan, tile, program.diagram)[1]
            for name in launch.launch.outputs:
                array = program.diagram.arrays[name]
                col = plan.fragments[name].col
                size = plan.row_tile * (tile[col] if col else 1) * DTYPE_BYTES[array.dtype]
                staged = re.search(rf"NK_ST16\(g_{name}\b", source) is not None
                passes = re.search(r"// staged (\d+) rows at a time", source)
                how = ("stored straight from the fragments, two adjacent columns a thread per fragment row" if not staged
                       else f"staged {passes[1]} rows at a time (a fragment row of every warp row: the tile is over the "
                            "arena) in a swizzled shared tile, stored 16 bytes a thread" if passes
                       else "staged in a swizzled shared tile, stored 16 bytes a thread")
                shape = f"{plan.row_tile} x {tile[col]}" if col else str(plan.row_tile)
                out.append(f"| `{rel}` at {setup.label()} | {name} ({array.dtype}) | {shape}, {size / 1024:g} KiB "
                           f"| {arena / 1024:g} KiB | {how} |")
    return "\n".join(out)


def tc_sass_section() -> str:
    """``napkin cuda --sass`` on matmul, or a one-line note when nvdisasm is not installed."""
    from napkin_dsl.backends import sass

    try:
        sass.find_nvdisasm()
    except sass.NoDisassembler:
        log.info("napkin docs: no nvdisasm; the tensor-core page shows a note instead of SASS")
        return (f"*Not shown: `nvdisasm` was not installed when this site was built; run `{TC_SASS_COMMAND}` "
                "after `pip install 'napkin-dsl[sass]'`.*")
    outcome = run_napkin(shlex.split(TC_SASS_COMMAND)[1:], ROOT)
    if not outcome.ok:
        raise RuntimeError(f"{TC_SASS_COMMAND} failed:\n{outcome.text}")
    return _fenced(f"$ {TC_SASS_COMMAND}\n{outcome.text.rstrip()}", "text")


# ---- example pages ----------------------------------------------------------------------------


def describe(example: Example, first_line: bool = False) -> str:
    """The comment at the top of an example file (or its module docstring), as prose."""
    text = example.source.read_text()
    if example.source.suffix == ".py":
        import ast

        doc = ast.get_docstring(ast.parse(text)) or ""
        paragraphs = [p for p in doc.split("\n\n") if p.strip()]
    else:
        lines = []
        for line in text.splitlines():
            if not line.startswith("#"):
                break
            lines.append(line.lstrip("#").strip())
        paragraphs = [" ".join(lines)]
    # Comments are prose with napkin in it, not Markdown: `sum[x](exp(S))` must not become a link.
    paragraphs = [re.sub(r"([\[\]])", r"\\\1", p) for p in paragraphs]
    if first_line:
        return paragraphs[0].replace("\n", " ").replace("|", "\\|") if paragraphs else ""
    return "\n\n".join(paragraphs)


def _relative(page: str, target: str) -> str:
    """A link from one docs page to another, relative to the first."""
    return os.path.relpath(target, os.path.dirname(page) or ".").replace(os.sep, "/")


def _tabs(tabs: list[tuple[str, str]]) -> str:
    out = []
    for title, body in tabs:
        out += [f'=== "{title}"', "", _indent(body, "    "), ""]
    return "\n".join(out)


def _cli(command: str, expect: str = "any") -> str:
    return f"```napkin-cli expect={expect}\n{command}\n```"


def _svg_section(example: Example, svgs: dict) -> str:
    if not svgs:
        return ""
    stem = example.stem
    directory = example.page.rsplit("/", 1)[0]
    tabs = [(title, _diagram_slot(f"{example.rel} {title.lower()}", f"{directory}/{stem}.{suffix}.svg"))
            for suffix, title in
            (("written", "As written"), ("relabelled", "Relabelled"), ("costs", "With M and H per column"))
            if (example.page, suffix) in svgs]
    return "\n".join(["## Diagram", "",
                      "Drawn by `Kernel.render` (`napkin draw`): wires are axes, colours are memory levels; "
                      "the relabelled drawing marks group partitions with a boxed label and stream partitions with a dashed wire; "
                      "the last tab adds the paper's cost rows, memory M and transfers H per column at the compute level.",
                      "", _tabs(tabs)])


def napkin_page(example: Example, svgs: dict) -> str:
    setup = setup_for(example)
    path = example.cli_path
    on = f" --hardware {setup.hardware}"
    sized = f"{on}{setup.set_args()}"
    at = f"{setup.hardware} at {setup.label()}" if setup.sizes else f"{setup.hardware} (symbolic)"
    out = [f"# {example.rel}", "", describe(example), "",
           f"Costs below are on **{at}**: {setup.why} Every block on this page is real output, generated "
           f"when the site was built; the commands run from the repository root.", "",
           "## Source", "", _cli(f"cat {path}", "ok"), ""]
    out += [_svg_section(example, svgs), ""]
    out += ["## Check", "", _cli(f"napkin check {path}", "any"), ""]
    pseudo_tabs = [("Text", _cli(f"napkin pseudo {path}{on}"))]
    if setup.sizes:
        pseudo_tabs.append((f"Text at {setup.label()}", _cli(f"napkin pseudo {path}{sized}")))
    pseudo_tabs.append(("Columns (Markdown)", f"```napkin-md expect=any\nnapkin pseudo --format markdown {path}{on}\n```"))
    out += ["## Pseudocode", "",
            "The paper's looped pseudocode, elaborated from the diagram and its relabelling: a parallel loop per group "
            "partition, a sequential loop per stream partition, the transfers between levels and the operations, each with "
            "its tile shape. The columns table lists, per step, what is resident at each level.", "",
            _tabs(pseudo_tabs), ""]
    cost_tabs = [(at, _cli(f"napkin cost {path}{sized}"))]
    if setup.sizes:
        cost_tabs.append(("Symbolic", _cli(f"napkin cost {path}{on}")))
    out += ["## Cost", "",
            "Read off the pseudocode: transfers H and memory M per level, the number of groups N, FLOPs per unit, "
            f"and on a GPU the predicted time (see [the performance model]({_relative(example.page, 'method.md')}#the-performance-model)).",
            "", _tabs(cost_tabs), ""]
    out += ["## Tuned configuration", "", f"The tuner's best group and stream sizes on {at}:", "",
            _cli(f"napkin tune {path}{sized}"), ""]
    tuned = _tuned_block(example, setup)
    if tuned:
        name = f"{example.stem}_tuned.napkin"
        out += [f"As written, the kernel does not fit {setup.hardware} at these sizes (see the cost above). "
                "With the tuner's relabel block in place of the file's:", "",
                f"```napkin-source file={name}\n{tuned}```", "", _cli(f"napkin cost {name}{sized}"), ""]
    return "\n".join(out)


def _tuned_block(example: Example, setup: Setup) -> str | None:
    """The file with the tuner's relabel block, when the file's own relabelling does not fit."""
    from napkin_dsl.errors import NapkinError

    if not setup.sizes or example.source.suffix != ".napkin":
        return None
    try:
        kernels = kernels_of(example)
        if len(kernels) != 1:
            return None
        (kernel,) = kernels.values()
        try:
            kernel.cost(setup.hardware, **setup.sizes)
            return None
        except NapkinError:
            pass
        block = kernel.tune(setup.hardware, **setup.sizes).relabel_block()
    except NapkinError:
        return None
    text = example.source.read_text()
    text = re.split(r"^relabel\b", text, flags=re.M)[0].rstrip() + "\n"
    return f"{text}\n{block}"


def python_page(example: Example, svgs: dict) -> str:
    setup = setup_for(example)
    path = example.cli_path
    try:
        names = list(kernels_of(example))
    except Exception:
        names = []
    sizes = ", ".join(f"{k}={v}" for k, v in setup.sizes.items())
    kind = ("A kernel written in Python with `@napkin.kernel`: the annotations give the parameters, the docstring the "
            "statements." if "@napkin.kernel" in example.source.read_text() else "Kernels loaded from text with `napkin.load`.")
    out = [f"# {example.rel}", "", describe(example), "",
           f"{kind} Every block on this page is real output, generated when the site was built.", "",
           "## Source", "", _cli(f"cat {path}", "ok"), "",
           "## Running it", "", _cli(f"python {path}", "ok"), ""]
    out += [_svg_section(example, svgs), ""]
    for name in names:
        out += [f"## `{name}` through the Python API", "",
                f"Costs are on {setup.hardware} at {setup.label()}: {setup.why}", "",
                "```python-run expect=any",
                "import runpy",
                f'{name} = runpy.run_path("{path}")["{name}"]',
                f"print({name})",
                "```", "",
                "### Pseudocode", "",
                "```python-run expect=any", f"print({name}.pseudocode())", "```", "",
                "### Cost", "",
                "```python-run expect=any", f'print({name}.cost("{setup.hardware}", {sizes}).table())', "```", "",
                "### Tuned configuration", "",
                "```python-run expect=any", f'result = {name}.tune("{setup.hardware}", {sizes})',
                "print(result.table())", "print(result.relabel_block())", "```", ""]
    return "\n".join(out)


def render_svgs(example: Example) -> dict:
    """(page, "written" | "relabelled") -> SVG text, when napkin can draw (Kernel.render)."""
    svgs = {}
    try:
        kernels = kernels_of(example)
    except Exception:
        return svgs
    if len(kernels) != 1:
        return svgs
    (kernel,) = kernels.values()
    if not hasattr(kernel, "render"):
        return svgs
    for suffix, relabelled, costs in (("written", False, False), ("relabelled", True, False), ("costs", True, True)):
        try:
            svgs[(example.page, suffix)] = kernel.render(relabelled=relabelled, costs=costs)
        except Exception as exc:  # drawing is optional on a page; say why it is missing
            log.info(f"napkin docs: no {suffix} diagram for {example.rel}: {type(exc).__name__}: {exc}")
    return svgs


# ---- docstrings: reST-isms as Markdown ---------------------------------------------------------

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def _not_links(line: str, in_code: bool) -> tuple[str, bool]:
    """Outside inline code, a bracket glued to a name (``softmax[x](M)``, ``S[q x]``) is napkin, not
    the start of a Markdown link: escape it (a link's ``[`` follows a space or starts the text).
    ``in_code``: whether an inline code span opened on an earlier line is still open; returned
    for the next line."""
    parts = re.split(r"(`+)", line)
    for index in range(0, len(parts), 2):
        if not in_code:
            parts[index] = re.sub(r"(?<=[\w\]])\[", r"\\[", parts[index])
        if index + 1 < len(parts):
            in_code = not in_code
    return "".join(parts), in_code


class _DocstringMarkup(Preprocessor):
    """napkin's docstrings are reST-flavoured: show ``:class:`~a.B``` as ``B`` in code, and
    doctest examples (``>>>`` lines up to a blank line) as Python console blocks instead of
    letting Markdown read ``softmax[c](X)`` as a link."""

    def run(self, lines):
        out, fence, block = [], None, None
        in_code, indented, previous_blank = False, False, True
        for line in lines:
            stripped = line.lstrip()
            # An indented code block (four spaces after a blank line) is shown as written.
            indent = len(line) - len(stripped)
            indented = bool(stripped) and indent >= 4 and (indented or previous_blank) and not in_code
            previous_blank = not stripped
            if not stripped:
                in_code = False  # an inline code span does not cross a paragraph
            if block is not None:
                if stripped:
                    out.append(line)
                    continue
                out += [block + "```", ""]
                block = None
            if stripped.startswith(("```", "~~~")):
                marker = stripped[:3]
                fence = None if fence == marker else (fence or marker)
            if fence is None and stripped.startswith(">>>"):
                block = line[: len(line) - len(stripped)]
                out += ["", block + "```pycon", line]
                continue
            if fence or indented:
                out.append(line)
                continue
            line, in_code = _not_links(_ROLE.sub(lambda m: f"`{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}`", line), in_code)
            out.append(line)
        if block is not None:
            out += [block + "```", ""]
        return out


class DocstringMarkupExtension(Extension):
    def extendMarkdown(self, md):
        md.preprocessors.register(_DocstringMarkup(md), "napkin_docstring_markup", 40)


# ---- mkdocs events ------------------------------------------------------------------------------

_state: dict = {}


@event_priority(100)  # before mkdocstrings reads the Markdown extensions in its own on_config
def on_config(config):
    """Add the docstring markup extension; expand the nav entry ``examples/index.md`` into a
    section with one page per example."""
    config.markdown_extensions.append(DocstringMarkupExtension())
    def expand(items):
        result = []
        for item in items:
            if isinstance(item, dict):
                (title, value), = item.items()
                if value == "examples/index.md":
                    pages = [{"Overview": "examples/index.md"}]
                    pages += [{example.rel: example.page} for example in examples()]
                    result.append({title: pages})
                elif isinstance(value, list):
                    result.append({title: expand(value)})
                else:
                    result.append(item)
            else:
                result.append(item)
        return result

    if config.get("nav"):
        config["nav"] = expand(config["nav"])
    return config


def on_pre_build(config):
    _state["workspace"] = Workspace()


def on_files(files, config):
    index = "\n".join([
        "# Examples", "",
        "One page per file in `examples/`, generated when the site is built: the source, the diagram, "
        "`napkin check`, the pseudocode as text and as the columns table, the cost table and the tuned configuration. "
        "Kernels with opaque boxes, or written for the paper's abstract models, are shown on `two_level` "
        "(symbolic costs); the others on H100 at the sizes listed.", "",
        "<!-- napkin:examples -->", "",
    ])
    files.append(File.generated(config, "examples/index.md", content=index))
    _state["svgs"] = {}
    _state["diagrams"] = {}  # site path -> SVG text, for the pages that show it inline
    for example in examples():
        svgs = render_svgs(example)
        _state["svgs"].update(svgs)
        for (page, suffix), svg in svgs.items():
            path = page[: -len(".md")] + f".{suffix}.svg"
            files.append(File.generated(config, path, content=svg))
            _state["diagrams"][path] = svg
        content = python_page(example, svgs) if example.source.suffix == ".py" else napkin_page(example, svgs)
        files.append(File.generated(config, example.page, content=content))
    return files


def on_page_markdown(markdown, page, config, files):
    return Page(page.file.src_uri, _state["workspace"], config, files).expand(markdown)


def on_page_content(html_text, page, config, files):
    """Put each diagram's SVG where its placeholder paragraph is (see :func:`_diagram_slot`)."""
    def inline(match: re.Match) -> str:
        attrs = {name: html.unescape(value) for name, value in re.findall(r'data-(\w+)="([^"]*)"', match["attrs"])}
        svg = _state.get("diagrams", {}).get(attrs.get("svg", ""))
        if svg is None:
            log.warning(f"{page.file.src_uri}: no diagram {attrs.get('svg')!r} was drawn for this page")
            return ""
        return _inline_diagram(attrs.get("alt", ""), svg, _page_link(page.url, attrs["svg"]))

    return _SLOT.sub(inline, html_text)


def on_post_build(config):
    workspace = _state.pop("workspace", None)
    if workspace is not None:
        workspace.remove()


def on_build_error(error):
    on_post_build(None)


if __name__ == "__main__":
    # python docs/hooks/napkin_docs.py --update: refresh the committed generated sections.
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python docs/hooks/napkin_docs.py --update")
    for path in update_committed():
        print(f"updated {path.relative_to(ROOT)}")
