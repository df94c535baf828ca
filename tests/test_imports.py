"""napkin_dsl's imports point one way, and importing the package stays light.

The import graph is read from the source with ``ast``: every ``import`` and ``from ... import``
anywhere in a module (at module level and inside functions, relative and absolute) is an edge.
A function-local import is still a dependency; hiding one in a function does not break a cycle.
The tests assert that the graph has no cycle and that no module imports a ``_private`` name
of another napkin module. They do not check the order of the stages beyond that: the pipeline
order is what acyclicity plus the module map in docs/architecture.md shows.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "napkin_dsl"


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every napkin import in a file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names if alias.name.split(".")[0] == "napkin_dsl"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "napkin_dsl":
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                # `from . import kernel` imports a module; `from .kernel import load` a name of one.
                found.append((submodule, None, node.lineno) if submodule in modules else (source, alias.name, node.lineno))
    return found


def import_graph() -> dict[str, dict[str, set[int]]]:
    """module -> {napkin module it imports: the lines that import it}."""
    modules = module_files()
    graph: dict[str, dict[str, set[int]]] = {name: {} for name in modules}
    for name, path in modules.items():
        for target, _, line in imports_of(name, path, modules):
            # Importing a.b.c runs a and a.b first, but those are the package's __init__ files,
            # which the graph holds as their own nodes: the edge goes to the module named.
            if target != name and target in modules:
                graph[name].setdefault(target, set()).add(line)
    return graph


def find_cycle(graph: dict[str, dict[str, set[int]]]) -> list[str] | None:
    """One cycle of the graph as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    # cli imports the kernel API at module level; every stage imports errors, often relatively.
    assert "napkin_dsl.kernel" in graph["napkin_dsl.cli"]
    assert "napkin_dsl.errors" in graph["napkin_dsl.syntax"]
    assert "napkin_dsl.errors" in graph["napkin_dsl.backends.nvrtc"]  # `from ..errors import`
    # The finder finds a cycle when there is one (so that "no cycle" below can fail).
    assert find_cycle({"a": {"b": {1}}, "b": {"c": {2}}, "c": {"a": {3}}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": {1}}, "b": {}}) is None


def test_imports_have_no_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    if cycle:
        steps = [f"{a} -> {b} (line {', '.join(map(str, sorted(graph[a][b])))})" for a, b in zip(cycle, cycle[1:], strict=False)]
        raise AssertionError("import cycle:\n  " + "\n  ".join(steps))


def test_no_module_imports_another_modules_private_name():
    modules = module_files()
    private = [f"{name} line {line}: from {source} import {taken}"
               for name, path in modules.items()
               for source, taken, line in imports_of(name, path, modules)
               if taken is not None and taken.startswith("_") and source != name]
    assert not private, "private names imported across modules:\n  " + "\n  ".join(private)


def test_importing_napkin_does_not_import_sympy_or_cuda():
    """cuda-python and NVRTC load when a command needs them, not with the package (sympy never)."""
    code = ("import sys, napkin_dsl\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('sympy', 'cuda', 'numpy', 'lark', 'typeguard'))\n"
            "print(' '.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert not out, f"import napkin_dsl imported {', '.join(out[:8])}"


# The pipeline, earliest first: a module imports only modules of earlier groups (and, inside
# backends/, its siblings: the acyclicity test orders those). Every module must be placed here,
# so that a new module is a decision about where it sits.
STAGES = (
    ("errors", "algebra", "dtypes"),
    ("cache", "formatting", "progress", "layouts", "hardware", "elementwise"),
    ("napkin_dsl",),  # the package: errors and hardware eagerly, the rest on first use
    ("syntax",),
    ("diagram",),
    ("boxes", "windows"),  # windows: a window read's arithmetic at bound sizes
    ("types",),
    ("check", "binding"),
    ("relabel",),
    ("pseudocode", "reference"),
    ("grad",),  # the backward kernel as text, checked and relabelled; a mask's kept pairs price it
    ("paths.plan",),  # what every instruction path shares
    ("paths.mma_sync", "paths.wgmma"),  # one module an instruction path
    ("paths",),  # the order selection asks the paths in
    ("isel",),  # cost prices the launches instruction selection puts on tensor cores
    ("chain",),  # the warpgroup chain a built wgmma plan waits on: the model and the static ceiling price it
    ("cost",),
    ("plan",),
    ("tune", "render", "backends", "backends.compiled", "backends.driver", "backends.nvrtc", "backends.sass",
     "backends.lowering", "backends.tensorcore", "backends.wgmma", "backends.pipeline", "backends.translate", "backends.numpy",
     "backends.cuda", "backends.opencl", "backends.distributed", "backends.roles", "backends.barriers"),
    ("torch_op",),  # a kernel as torch custom ops: it calls the kernel it is given, and imports no kernel module
    ("kernel",),
    ("cli",),
)


def test_imports_follow_the_pipeline():
    stage = {("napkin_dsl." + m if m != "napkin_dsl" else m): i for i, group in enumerate(STAGES) for m in group}
    graph = import_graph()
    unplaced = sorted(set(graph) - set(stage))
    assert not unplaced, f"place these modules in STAGES: {', '.join(unplaced)}"
    upward = [f"{a} -> {b} (line {', '.join(map(str, sorted(lines)))})"
              for a, targets in graph.items() for b, lines in targets.items()
              if stage[b] > stage[a] or stage[b] == stage[a] and not (a.startswith("napkin_dsl.backends") and b.startswith("napkin_dsl.backends"))]
    assert not upward, "imports against the pipeline:\n  " + "\n  ".join(upward)


def reachable(graph: dict[str, dict[str, set[int]]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, pending = set(), [start]
    while pending:
        for target in graph[pending.pop()]:
            if target not in seen:
                seen.add(target)
                pending.append(target)
    return seen


PRINTERS = ("backends.lowering", "backends.tensorcore", "backends.wgmma", "backends.pipeline", "backends.translate")


def test_the_printers_do_not_import_the_cost_model():
    """Printing a kernel runs no model: its report is handed to the printers, and sizes are
    evaluated below both (``algebra.as_number``). The launchers, the SASS reader and the NumPy
    backend may import the model, since they attach or check it."""
    graph = import_graph()
    assert "napkin_dsl.cost" in reachable(graph, "napkin_dsl.backends.cuda")  # so that "not in" can fail
    imports = {m: sorted(reachable(graph, f"napkin_dsl.{m}") & {"napkin_dsl.cost", "napkin_dsl.plan", "napkin_dsl.tune"})
               for m in PRINTERS}
    assert imports == {m: [] for m in PRINTERS}


def test_napkin_check_loads_no_backend():
    """The CLI imports each command's stages when the command runs: checking a file (which
    plans the relabelled Program for its bookkeeping line) loads neither sympy, NumPy, the code
    generators nor CUDA."""
    example = PACKAGE.parent / "examples" / "attention.napkin"
    code = ("import contextlib, io, sys\n"
            "from napkin_dsl.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    assert main(['check', {str(example)!r}]) == 0\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('sympy', 'numpy', 'cuda', 'typeguard')\n"
            "               or m.startswith(('napkin_dsl.backends', 'napkin_dsl.tune', 'napkin_dsl.render')))\n"
            "print(' '.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert not out, f"napkin check imported {', '.join(out[:8])}"


def run_fresh(code: str) -> None:
    """Run ``code`` in a fresh Python process (nothing imported yet); its assertions must hold."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_planning_and_costing_need_no_sympy():
    """Sizes, FLOPs and costs are napkin's own algebra: loading every example, planning it on its
    profile (symbolic, then at bound sizes) and printing its cost report imports no sympy."""
    code = ("import sys\n"
            "from pathlib import Path\n"
            "import napkin_dsl as napkin\n"
            f"for path in sorted(Path({str(PACKAGE.parent / 'examples')!r}).rglob('*.napkin')):\n"
            "    for k in napkin.load(path).values():\n"
            "        for report in (k.cost(), k.cost(**{a: 64 for a in k.diagram.axes})):\n"
            "            report.table(), report.to_dict()\n"
            "assert 'sympy' not in sys.modules, 'planning or costing imported sympy'\n")
    run_fresh(code)


def test_napkin_never_imports_sympy():
    """sympy is not a dependency: no module imports it, except the size algebra's conversion to
    sympy (``_sympy_``), which runs only when a caller hands napkin's expressions to sympy."""
    found = []
    for name, path in module_files().items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        allowed = {id(node) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and fn.name.startswith("_sympy")
                   for node in ast.walk(fn)} if name == "napkin_dsl.algebra" else set()
        for node in ast.walk(tree):
            imported = ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(m.split(".")[0] == "sympy" for m in imported) and id(node) not in allowed:
                found.append(f"{name} line {node.lineno}")
    assert not found, f"sympy imported by {', '.join(found)}"


def test_every_public_name_resolves_and_kernel_stays_the_decorator():
    """The package loads its public names on first use; importing the submodule
    napkin_dsl.kernel (as the CLI does) must not replace the decorator napkin.kernel."""
    code = ("import napkin_dsl.kernel, napkin_dsl.cli, napkin_dsl as napkin\n"
            "missing = [n for n in napkin.__all__ if getattr(napkin, n, None) is None]\n"
            "assert not missing, missing\n"
            "assert callable(napkin.kernel) and napkin.kernel.__name__ == 'kernel', napkin.kernel\n"
            "assert set(napkin.__all__) <= set(dir(napkin))\n"
            "from napkin_dsl import f32, load\n"
            "assert f32['q d'].axes == ('q', 'd') and load.__module__ == 'napkin_dsl.kernel'\n")
    run_fresh(code)
