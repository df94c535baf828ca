"""What a compiled kernel is, and the disk cache that finds one before any lowering.

:class:`KernelSource` is one launch printed as a kernel (entry, grid, block, arena bytes, the
arrays and scalars it takes); :class:`CompiledKernel` is a whole compiled program: source,
cubin, per-launch resources and, read on demand, the Program and cost report it came from.

The NVRTC cache (``nvrtc.py``) is keyed by the generated source, so reaching it costs a plan,
a cost report and a lowering. This cache is keyed by what the source is made from (see
:func:`compile_key`: the kernel's napkin text and relabelling, the bound sizes, the
architecture, the hardware profile, napkin's own code and the NVRTC packages), so that a
fresh process that compiles a kernel it compiled before reads the cubin back without
elaborating, lowering or importing cuda-python. The Program and the cost report of such a
kernel are built when first read (:attr:`CompiledKernel.program`, :attr:`CompiledKernel.cost`).

Deliberately not here: generating or compiling source (``translate.py``, ``nvrtc.py``),
launching (``cuda.py``). This module imports nothing heavy: a cache hit must not pay for the
code generators.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..cache import cache_root, write_atomically

# Bumped when the entry layout or the key's recipe changes, so that old entries are never read.
COMPILED_FORMAT = 2  # 2: each launch carries its tensor maps (an entry without them would launch a TMA kernel without its maps)
COMPILED_CACHE_SUBDIR = "compiled-kernels"
SASS_CACHE_SUBDIR = "sass-listings"  # nvdisasm's listings of cubins (backends/sass.py), cleared with them
# The packages whose NVRTC builds the cubins: a new one is a new key.
NVRTC_PACKAGES = ("nvidia-cuda-nvrtc", "cuda-bindings")
ELF_MAGIC = b"\x7fELF"


@dataclass
class KernelSource:
    """One launch printed as a kernel: its entry name, grid, block and arena bytes."""

    entry: str
    text: str
    grid: int
    block: int
    shared_bytes: int
    arrays: list  # (name, dtype, role "in"/"out") in parameter order
    scalars: list
    path: str = "fma"  # the instruction path isel chose: "mma.sync" or "fma"
    paths: list = field(default_factory=list)  # per statement: what it runs on (isel.describe)
    stages: int = 0  # the cp.async (or TMA) stages of a streamed tensor-core launch; 0 where it has none
    # A warp-specialized launch (backends/pipeline.py): its roles' and ring barriers' names, by
    # index, with which a run of the OpenCL roles runtime names a deadlock; () for any other.
    roles: tuple = ()
    barriers: tuple = ()
    # The TMA operands' tensor maps, (array, driver.TiledTensorMap) in the kernel's parameter
    # order after the scalars: what the launcher encodes over each operand's address (a wgmma
    # plan's ``plan.tma``, at the sizes printed); () for a launch without TMA.
    tensor_maps: tuple = ()
    # Outputs the launch adds partial sums into (relabel.summed_over_groups, pseudocode.Step.add):
    # the launcher zeroes each before the launch.
    zeroed: tuple = ()

    def __repr__(self) -> str:
        # Without the text: the whole kernel source made the repr of every compiled kernel pages long.
        return (f"<KernelSource {self.entry}: grid {self.grid}, block {self.block}, {self.shared_bytes:,} B dynamic shared, "
                f"{self.path}, {len(self.text):,} characters>")


@dataclass
class CompiledKernel:
    """A compiled napkin kernel: source, cubin, resources per launch, and its cost model.

    ``planned`` returns the (Program, CostReport, ProgramSelection) the kernel was compiled
    from; it runs once, when :attr:`program`, :attr:`cost` or :attr:`selection` is first read
    (after a disk-cache hit it plans, selects and costs the kernel again; after a compile it
    hands back what the compile used). ``selected``: the selection, where the compile has it
    (so that launching reads it without costing anything).
    """

    name: str
    arch: str
    source: str
    image: bytes
    launches: list[KernelSource]
    resources: dict  # entry -> {"registers", "shared_bytes" (static), "spill_bytes"}
    planned: Callable[[], tuple[Any, Any, Any]] = field(repr=False, compare=False)
    ptx: bool = False
    selected: Any = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def _plan_and_cost(self) -> tuple[Any, Any, Any]:
        return self.planned()

    @property
    def selection(self):
        """The :class:`~napkin_dsl.isel.ProgramSelection` the source was printed with: what the
        launcher, the SASS reader and the report read, never selected again."""
        if self.selected is None:
            self.selected = self._plan_and_cost[2]
        return self.selected

    @property
    def program(self):
        """The :class:`~napkin_dsl.pseudocode.Program` the source was lowered from."""
        return self._plan_and_cost[0]

    @property
    def cost(self):
        """The :class:`~napkin_dsl.cost.CostReport`, with the registers ptxas allocated."""
        return self._plan_and_cost[1]

    def __repr__(self) -> str:
        # Name, arch and what each launch uses; the source is `.source`, and `_repr_html_` folds it away.
        kind = "PTX" if self.ptx else "cubin"
        rows = self.launch_table()
        launches = "; ".join(f"{r['entry']} grid {r['grid'][0]} block {r['block'][0]}, {_resources(r)}" for r in rows[:3])
        more = f"; and {len(rows) - 3} more" if len(rows) > 3 else ""
        return (f"<CompiledKernel {self.name} for {self.arch} ({kind}, {len(self.image):,} bytes): "
                f"{len(rows)} launch{'es' if len(rows) != 1 else ''}: {launches}{more}; source {len(self.source):,} characters>")

    def _repr_html_(self) -> str:
        """For Jupyter: arch, the resources of each launch, the model's prediction, and the source
        folded in a ``<details>``."""
        import html

        head = ("entry", "grid", "block", "registers", "shared memory", "spills", "path")
        rows = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in (
                r["entry"], r["grid"][0], r["block"][0], _count(r["registers"]), f"{r['shared_bytes']:,} B",
                _count(r["spill_bytes"], " B"), r["path"])) + "</tr>"
            for r in self.launch_table())
        try:
            report = self.cost
            prediction = f"the model: {report.summary()}"
        except Exception as error:  # noqa: BLE001 - a notebook view shows why, rather than no view at all
            prediction = f"the model could not cost it: {type(error).__name__}: {error}"
        lines = len(self.source.splitlines())
        return (f"<p><b>{html.escape(self.name)}</b> compiled for {html.escape(self.arch)} "
                f"({'PTX' if self.ptx else 'cubin'}, {len(self.image):,} bytes)</p>"
                "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + f"</tr>{rows}</table>"
                f"<p>{html.escape(prediction)}</p>"
                f"<details><summary>CUDA source ({lines:,} lines)</summary><pre>{html.escape(self.source)}</pre></details>")

    def launch_table(self) -> list[dict]:
        """Per launch: entry, grid, block, registers, shared bytes (static + dynamic), spills."""
        rows = []
        for k in self.launches:
            used = self.resources.get(k.entry, {})
            rows.append({
                "entry": k.entry,
                "grid": [k.grid, 1, 1],
                "block": [k.block, 1, 1],
                "registers": used.get("registers"),
                "shared_bytes": used.get("shared_bytes", 0) + k.shared_bytes,
                "spill_bytes": used.get("spill_bytes"),
                "path": k.path,
                "stages": k.stages,
                "statements": list(k.paths),
            })
        return rows


def _count(value, unit: str = "") -> str:
    """A resource count for display; None when ptxas did not say (a PTX-only compile)."""
    return "-" if value is None else f"{value:,}{unit}"


def _resources(row: dict) -> str:
    return f"{_count(row['registers'])} registers, {row['shared_bytes']:,} B shared, {row['path']}"


# ---- the cache keyed before lowering -------------------------------------------------------------


@functools.cache
def code_digest() -> str:
    """sha256 of napkin's own code and data (every .py, .lark and .toml file of the package).

    Any change to the code generators, the model or a profile is a new key: the version
    number does not move with every commit, the files do."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".lark", ".toml") and path.is_file():
            digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def nvrtc_packages() -> dict[str, str | None]:
    """The installed versions of the NVRTC packages, read off their .dist-info directories on
    sys.path (neither the packages nor importlib.metadata, whose import costs more, are loaded)."""
    versions: dict[str, str | None] = {name: None for name in NVRTC_PACKAGES}
    prefixes = {name.replace("-", "_") + "-": name for name in NVRTC_PACKAGES}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for found in names:
            if not found.endswith(".dist-info"):
                continue
            for prefix, name in prefixes.items():
                if found.startswith(prefix) and versions[name] is None:
                    versions[name] = found[len(prefix):-len(".dist-info")]
    return versions


def compile_key(identity: dict) -> str:
    """The cache key of a compile: ``identity`` (JSON-able: the kernel's text, relabelling, bound
    sizes, arch, hardware profile, ...) with napkin's code digest and the NVRTC packages.

    An NVRTC found outside those packages (a system CUDA) is not in the key: after changing
    it, ``napkin cache clear``."""
    recipe = {"format": COMPILED_FORMAT, "identity": identity, "napkin": code_digest(), "nvrtc": nvrtc_packages()}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()


def cache_dir() -> Path:
    return cache_root() / COMPILED_CACHE_SUBDIR


def _entry_path(key: str) -> Path:
    return cache_dir() / f"{key}.json"


def read_compiled(key: str, planned: Callable[[], tuple[Any, Any, Any]]) -> CompiledKernel | None:
    """The compiled kernel stored under ``key``, or None (no entry, or one that cannot be read)."""
    try:
        data = json.loads(_entry_path(key).read_text(encoding="utf-8"))
        if data["format"] != COMPILED_FORMAT or data["key"] != key:
            return None
        image = base64.b64decode(data["image"], validate=True)
        if not data["ptx"] and not image.startswith(ELF_MAGIC):
            return None
        return CompiledKernel(
            name=data["name"], arch=data["arch"], source=data["source"], image=image,
            launches=[_launch(launch) for launch in data["launches"]],
            resources=data["resources"], planned=planned, ptx=data["ptx"],
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _launch(stored: dict) -> KernelSource:
    """A KernelSource read back from JSON, which turned its tuples (arrays, scalars, roles, barriers)
    into lists and its tensor maps into dicts."""
    from .driver import TiledTensorMap

    tupled = {key: [tuple(item) if isinstance(item, list) else item for item in stored[key]] for key in ("arrays", "scalars")}
    named = {key: tuple(stored[key]) for key in ("roles", "barriers", "zeroed") if key in stored}
    maps = tuple((name, TiledTensorMap(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}))
                 for name, fields in stored.get("tensor_maps", ()))
    return KernelSource(**{**stored, **tupled, **named, "tensor_maps": maps})


def write_compiled(key: str, compiled: CompiledKernel) -> None:
    """Store a compiled kernel under ``key``; a cache that cannot be written is a warning."""
    entry = {
        "format": COMPILED_FORMAT, "key": key, "name": compiled.name, "arch": compiled.arch, "ptx": compiled.ptx,
        "source": compiled.source, "image": base64.b64encode(compiled.image).decode(),
        "launches": [asdict(launch) for launch in compiled.launches], "resources": compiled.resources,
    }
    try:
        write_atomically(_entry_path(key), json.dumps(entry).encode(), create_parents=True)
    except OSError as error:
        warnings.warn(f"napkin: could not write the compiled-kernel cache in {cache_dir()}: {error}", stacklevel=3)


def compile_cached(identity: dict, compile: Callable[[], CompiledKernel], planned: Callable[[], tuple[Any, Any, Any]]) -> CompiledKernel:
    """The kernel ``identity`` names: from the disk cache (its Program and cost built by
    ``planned`` when read), else ``compile()``d and stored."""
    key = compile_key(identity)
    found = read_compiled(key, planned)
    if found is not None:
        return found
    compiled = compile()
    write_compiled(key, compiled)
    return compiled
