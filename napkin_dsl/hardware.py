"""Hardware profiles: memory hierarchies as data.

A profile is a chain of memory levels from the top (device memory, or the paper's ``l0``)
down to the level where compute happens, with a capacity per unit of each level (per
device, per block, per thread), the bandwidth *into* each level from the one above, the
number of units, and peak compute rates. Profiles live in ``napkin_dsl/hardware/*.toml``,
each number beside its public source.

The abstract profiles (``two_level``, ``three_level``) count values, not bytes, and keep
capacities and bandwidths as symbols, as the paper does.

This module only describes machines; it does not decide what runs where (that is
``relabel.py``) or what anything costs (``cost.py``).

>>> h100 = load_hardware("H100")
>>> [level.name for level in h100.levels]
['gmem', 'l2', 'smem', 'registers']
>>> h100.level("smem").capacity
232448
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from . import algebra
from .dtypes import FP8_DTYPES
from .errors import NapkinError

PROFILE_DIR = Path(__file__).parent / "hardware"
# Defaults only, never a list of what exists (the profiles are): the GPU napkin plans and compiles
# for when none is named, its architecture (tests hold DEFAULT_ARCH to DEFAULT_GPU's arch: the
# constant saves reading a profile where only the name of the default is wanted, as --help does),
# and the paper's model, which a kernel that names no level is planned on.
DEFAULT_GPU = "H100"
DEFAULT_ARCH = "sm_90a"
DEFAULT_MODEL = "two_level"


@dataclass(frozen=True)
class Level:
    """One memory level. ``capacity`` is per unit (``per``), ``bandwidth`` is into this level."""

    name: str
    per: str
    capacity: algebra.Expr | int | None = None
    bandwidth: algebra.Expr | float | None = None
    units: int = 1
    compute: bool = False
    threads_per_unit: int | None = None
    registers_per_unit: int | None = None  # 4-byte registers of one unit (an SM) for its threads
    blocks_per_unit: int | None = None  # resident thread blocks one unit holds at most
    reserved_per_block: int = 0  # bytes the system takes per resident block (shared memory on sm_80+)


@dataclass(frozen=True)
class InstructionPath:
    """One tensor-core instruction path of a GPU, a ``[path.NAME]`` table of its profile: the
    instruction (``mma.sync``, ``wgmma``), its shape as PTX names it (``m16n8k16``), the operand
    dtypes it takes, the architectures that have it and its peak rate per dtype (FLOP/s).

    ``rates`` may price more dtypes than ``dtypes`` lists: ``f32`` is TF32's rate, at which the
    model prices an f32 contraction the path would run converted; instruction selection takes only
    ``dtypes``."""

    name: str  # the table's name: "mma_sync"
    instruction: str
    shape: str
    dtypes: tuple[str, ...]
    archs: tuple[str, ...]
    rates: dict
    # ``converts = true``: the GPU has no such instruction in SASS, and ptxas runs it on its
    # 16-bit tensor cores after converting the operands (mma.sync .e4m3 on sm_90); the
    # conversions hold registers, which instruction selection counts.
    converts: bool = False

    def runs_on(self, arch: str) -> bool:
        """Whether ``arch`` has this path. An arch-specific target (``sm_90a``: sm_90 with the
        features only that GPU has, wgmma among them) is the same GPU as its plain arch, so a
        path listed for ``sm_90a`` is there to price on ``sm_90``: napkin prices such a path as
        a what-if and builds none there (it builds wgmma for ``sm_90a`` itself, isel). And the
        arch-specific target keeps every instruction of its plain arch: a path listed for
        ``sm_90`` runs on ``sm_90a``."""
        return arch in self.archs or f"{arch}a" in self.archs or (arch.endswith("a") and arch[:-1] in self.archs)

    def describe(self) -> str:
        """``mma.sync m16n8k16 (bf16, f16) on sm_80, sm_90``, as messages name a path."""
        return f"{self.instruction} {self.shape} ({', '.join(self.dtypes)}) on {', '.join(self.archs)}"


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    levels: tuple[Level, ...]
    counts: str = "bytes"  # "values" for the paper's abstract models
    arch: str | None = None  # the architecture napkin compiles for on this GPU, by default
    archs: tuple[str, ...] = ()  # every architecture whose code this GPU runs (its own and older ones)
    peak_flops: dict = field(default_factory=dict)  # unit rates: "tensor" (the datasheet's), "fma", "special"
    paths: dict = field(default_factory=dict)  # table name -> InstructionPath, in the profile's order
    clock_hz: float | None = None
    fixed: dict = field(default_factory=dict)  # fixed costs in seconds: launch_s
    # Clocks a warpgroup's chain waits on, by name (``[latency]``, :class:`Latency`): what the model's
    # chain (napkin_dsl/chain.py) and the static ceiling add where the built code serializes.
    latency: dict = field(default_factory=dict)
    # The device level of a node of GPUs (H100x8): a ``[[level]]`` with ``per = "node"`` above the
    # top, whose units are the GPUs and whose bandwidth is the link between them (NVLink, each
    # way per GPU). Not in ``levels``: each GPU's chain is one GPU's, and a relabel clause at the
    # top level (``gmem: split x 4096``) partitions across the units (relabel.device_partitions).
    device: Level | None = None

    def latency_clocks(self, name: str) -> float | None:
        """The profile's ``[latency]`` entry ``name`` in clocks, or None where it names none."""
        entry = self.latency.get(name)
        return None if entry is None else entry.clocks

    @property
    def launch_s(self) -> float:
        """The start of one launch among back-to-back launches (0 where the profile names none)."""
        return float(self.fixed.get("launch_s", 0.0))

    @property
    def top(self) -> Level:
        return self.levels[0]

    @property
    def symbolic(self) -> bool:
        return self.counts == "values"

    @property
    def compute_level(self) -> Level:
        """The level where boxes run by default: the lowest level marked ``compute``."""
        marked = [level for level in self.levels if level.compute]
        return marked[-1] if marked else self.levels[-1]

    def level(self, name: str) -> Level:
        for level in self.levels:
            if level.name == name:
                return level
        raise KeyError(name)

    def level_names(self) -> list[str]:
        return [level.name for level in self.levels]

    def index(self, name: str) -> int:
        return self.level_names().index(name)

    def peak(self, unit: str, dtype: str) -> float | None:
        """Peak FLOP/s of a compute unit for a dtype: "fma", "special", "tensor" (the datasheet's
        tensor peak), or a tensor-core instruction, "mma.sync" or "wgmma": the rate of the path of
        that instruction which prices ``dtype``, else of its first path by the rule below (None
        where the profile has no path of that instruction)."""
        paths = [p for p in self.paths.values() if p.instruction == unit]
        if paths:
            exact = next((p for p in paths if dtype in p.rates), paths[0])
            return self._rate(exact.rates, dtype)
        if unit in self.peak_flops:
            return self._rate(self.peak_flops[unit], dtype)
        return None

    def find_path(self, instruction: str, dtype: str, arch: str, shape: str | None = None) -> InstructionPath | None:
        """The path of ``instruction`` (of ``shape``, where given) that takes ``dtype`` operands
        on ``arch`` (:meth:`InstructionPath.runs_on`), or None."""
        return next((p for p in self.paths.values() if p.instruction == instruction and dtype in p.dtypes
                     and p.runs_on(arch) and shape in (None, p.shape)), None)

    def paths_text(self) -> str:
        """Every path of the profile as messages list them (``none`` where it has none)."""
        return "; ".join(p.describe() for p in self.paths.values()) or "none"

    def arch_for_device(self, device_arch: str) -> str:
        """What to compile for on a GPU whose driver reports ``device_arch`` (``sm_90``): this
        profile's own arch where it is that GPU's arch or its arch-specific variant (``sm_90a``
        on an sm_90 GPU: the code the model prices by default), else ``device_arch`` itself. A
        driver names no arch-specific target, so without this an H100 would build mma.sync."""
        if self.arch is not None and self.arch in self.archs and self.arch.removesuffix("a") == device_arch:
            return self.arch
        return device_arch

    def check_arch(self, arch: str) -> None:
        """Refuse ``arch`` unless this profile's GPU runs code compiled for it (``archs``)."""
        if arch in self.archs:
            return
        if not self.archs:
            raise NapkinError(f"{self.name} is no GPU: it runs no architecture, so nothing is compiled for it",
                              hint=f"name a GPU profile: {gpu_archs()}")
        raise NapkinError(f"{self.name} cannot run {arch}: it runs {', '.join(self.archs)}",
                          hint=f"architectures per profile: {gpu_archs()}")

    def tensor_paths(self) -> list[str]:
        """The tensor-core instructions the profile prices ("mma.sync", "wgmma"), once each, in
        the order of its ``[path.*]`` tables."""
        return list(dict.fromkeys(p.instruction for p in self.paths.values()))

    @staticmethod
    def _rate(rates, dtype: str) -> float | None:
        if isinstance(rates, dict):
            if dtype in rates:
                return float(rates[dtype])
            if dtype in FP8_DTYPES and "f16" in rates:
                return float(rates["f16"])  # no fp8 units: fp8 runs at the f16 rate
            return float(rates["f32"]) if "f32" in rates else None
        return float(rates)


def _size_value(value):
    if value is None:
        return None
    if isinstance(value, str):
        return algebra.Symbol(value, positive=True)
    return value


def load_hardware(name: str | os.PathLike) -> Hardware:
    """Load a profile by name (``H100``) or from a path to a TOML file (a ``str`` or a
    :class:`~pathlib.Path`): a GPU napkin does not ship is a file of one's own, and nothing else.

    Anything else is a :class:`NapkinError` naming what was given: a name that is no profile,
    a path that is not a readable ``.toml`` file (missing, a directory, unreadable, too long
    for the file system, with a NUL in it), or a profile that is not valid.
    """
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str):
        raise NapkinError(f"hardware must be a profile name or a path to a .toml file, got {type(name).__name__} {name!r:.60}",
                          hint=f"known hardware: {', '.join(hardware_names())}")
    return _load_hardware(name)


def _shown(name: str) -> str:
    """A name as messages quote it: a long one is cut, with its length (fuzzers pass thousands)."""
    return repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name):,} characters)"


def _profile_path(name: str) -> Path:
    """The file a hardware name stands for: a bundled profile, else an existing .toml path.

    Only the bundled names are looked up in PROFILE_DIR, so ``../x`` cannot reach beyond it.
    """
    if name in hardware_names():
        return PROFILE_DIR / f"{name}.toml"
    hint = f"known hardware: {', '.join(hardware_names())}, or a path to a .toml profile"
    if not name.endswith(".toml"):
        raise NapkinError(f"unknown hardware {_shown(name)}", hint=hint)
    path = Path(name)
    try:
        # stat() raises OSError for a name too long for the file system (ENAMETOOLONG) and
        # ValueError for one with a NUL byte: neither is a file napkin can read.
        if path.is_file():
            return path
        missing = "is a directory" if path.is_dir() else "does not exist"
    except (OSError, ValueError) as exc:
        missing = f"cannot be a file: {getattr(exc, 'strerror', None) or exc}"
    raise NapkinError(f"hardware profile {_shown(name)} {missing}", hint=hint)


@functools.lru_cache(maxsize=None)
def _load_hardware(name: str) -> Hardware:
    path = _profile_path(name)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise NapkinError(f"cannot read hardware profile {_shown(str(path))}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise NapkinError(f"hardware profile {_shown(str(path))} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise NapkinError(f"hardware profile {path.name} is not valid TOML: {exc}") from None
    try:
        return _profile(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        what = f"missing {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)
        raise NapkinError(f"hardware profile {_shown(str(path))} is malformed: {what}",
                          hint=f"compare it with a bundled profile, e.g. {PROFILE_DIR / 'H100.toml'}") from None


def _profile(data: dict) -> Hardware:
    entries = list(data["level"])
    device = entries.pop(0) if entries and entries[0].get("per") == "node" else None
    if any(entry.get("per") == "node" for entry in entries):
        raise ValueError("a level per node must be the first [[level]] (the device level, above each GPU's top)")
    levels = tuple(
        Level(
            name=entry["name"],
            per=entry.get("per", "core"),
            capacity=_size_value(entry.get("capacity")),
            bandwidth=_size_value(entry.get("bandwidth")),
            units=int(entry.get("units", 1)),
            compute=bool(entry.get("compute", False)),
            threads_per_unit=entry.get("threads_per_unit"),
            registers_per_unit=entry.get("registers_per_unit"),
            blocks_per_unit=entry.get("blocks_per_unit"),
            reserved_per_block=int(entry.get("reserved_per_block", 0)),
        )
        for entry in entries
    )
    if not levels:
        raise ValueError("it has no [[level]] entries")
    arch = data.get("arch")
    # A profile that names only its own architecture runs just that one.
    archs = tuple(data.get("archs", [arch] if arch else []))
    if not all(isinstance(a, str) for a in archs):
        raise ValueError("archs must be a list of architecture names, e.g. [\"sm_80\", \"sm_90\"]")
    if arch is not None and arch not in archs:
        raise ValueError(f"its arch {arch!r} is not among its archs ({', '.join(archs)})")
    paths = {key: _path(key, entry, archs) for key, entry in data.get("path", {}).items()}
    return Hardware(
        name=data["name"],
        description=data.get("description", data["name"]),
        levels=levels,
        counts=data.get("counts", "bytes"),
        arch=arch,
        archs=archs,
        peak_flops=data.get("peak_flops", {}),
        paths=paths,
        clock_hz=data.get("clock_hz"),
        fixed=dict(data.get("fixed", {})),
        latency={name: _latency(name, entry) for name, entry in data.get("latency", {}).items()},
        device=None if device is None else _device_level(device),
    )


@dataclass(frozen=True)
class Latency:
    """One ``[latency]`` entry of a profile: the clocks something takes to complete beyond the
    throughput of the units it uses, and where the figure comes from (a measurement's citation, or
    an estimate and its reasoning: the report prints it beside the chain that uses it)."""

    clocks: float
    source: str


LATENCY_NAMES = {
    "copy": "a chunk's copy from global memory into shared memory under load (TMA or cp.async), issue to landing",
    "wgmma_drain": "a wgmma group's wait_group 0 after its products' tensor time: the pipeline's drain",
    "mbarrier_wait": "an mbarrier try_wait whose phase has completed, to the next instruction",
    "bar_sync": "a block barrier (bar.sync) every warp has reached, to the next instruction",
}


def _latency(name: str, entry) -> Latency:
    if name not in LATENCY_NAMES:
        raise ValueError(f"[latency] has an entry {name!r}; the model reads {', '.join(LATENCY_NAMES)}")
    if not isinstance(entry, dict) or not isinstance(entry.get("clocks"), (int, float)) or entry["clocks"] < 0 \
            or not isinstance(entry.get("source"), str) or not entry["source"].strip():
        raise ValueError(f"[latency] {name} must be {{ clocks = <clocks, 0 or more>, source = \"<where the figure comes from>\" }}")
    return Latency(float(entry["clocks"]), entry["source"])


def _device_level(entry: dict) -> Level:
    """The ``per = "node"`` level: its units (GPUs, 2 or more) and the bandwidth between them."""
    units, bandwidth = int(entry.get("units", 1)), entry.get("bandwidth")
    if units < 2 or not isinstance(bandwidth, (int, float)) or bandwidth <= 0:
        raise ValueError(f"the device level {entry.get('name')!r} needs units >= 2 (GPUs) and a bandwidth in bytes/s "
                         f"(the link between them), got units = {units}, bandwidth = {bandwidth!r}")
    return Level(name=entry["name"], per="node", capacity=_size_value(entry.get("capacity")),
                 bandwidth=float(bandwidth), units=units)


def _path(key: str, entry: dict, archs: tuple[str, ...]) -> InstructionPath:
    """A ``[path.KEY]`` table, checked: every field present, every dtype priced, every arch one
    the profile runs (or its arch-specific variant, ``sm_90a`` of ``sm_90``)."""
    if not isinstance(entry, dict):
        raise ValueError(f"path.{key} must be a table with instruction, shape, dtypes, archs and rates")
    path = InstructionPath(key, str(entry["instruction"]), str(entry["shape"]), tuple(entry["dtypes"]),
                           tuple(entry["archs"]), dict(entry["rates"]), bool(entry.get("converts", False)))
    if not path.dtypes or not all(isinstance(d, str) for d in path.dtypes):
        raise ValueError(f"path.{key}'s dtypes must be a list of operand dtypes, e.g. [\"bf16\", \"f16\"]")
    unpriced = [d for d in path.dtypes if d not in path.rates]
    if unpriced:
        raise ValueError(f"path.{key} has no rate for {', '.join(unpriced)} (its rates: {', '.join(path.rates) or 'none'})")
    foreign = [a for a in path.archs if not isinstance(a, str) or (a not in archs and a.removesuffix("a") not in archs)]
    if not path.archs or foreign:
        raise ValueError(f"path.{key}'s archs ({', '.join(map(str, path.archs)) or 'none'}) must be some the profile runs "
                         f"({', '.join(archs) or 'none'})")
    return path


def hardware_names() -> list[str]:
    """Names of the bundled profiles."""
    return sorted(path.stem for path in PROFILE_DIR.glob("*.toml"))


def profile_for_device(name: str) -> str:
    """The bundled single-GPU profile of a GPU the driver names ``name`` ("NVIDIA H100 80GB
    HBM3": H100): the profile whose name is a word of it. A GPU napkin has no profile for is a
    :class:`NapkinError` naming the profiles and how to add one."""
    import re

    words = {w.upper() for w in re.split(r"[^A-Za-z0-9]+", name) if w}
    found = [p for p in hardware_names() if p.upper() in words and load_hardware(p).archs and load_hardware(p).device is None]
    if len(found) == 1:
        return found[0]
    profiles = ", ".join(p for p in hardware_names() if load_hardware(p).archs and load_hardware(p).device is None)
    raise NapkinError(f"napkin has no hardware profile for the GPU {_shown(name)} (its profiles: {profiles})",
                      hint="pass hardware= a profile file for it: copy one of these and change its figures "
                           "(docs/hardware.md, Adding a GPU)")


def gpu_for_arch(arch: str) -> str:
    """The bundled profile code for ``arch`` is planned on when no GPU is named: the first (by
    name) whose own architecture it is, else the first that runs it (sm_80: A100, sm_90: H100).
    An architecture no profile runs is a :class:`NapkinError` naming those they do."""
    profiles = [load_hardware(name) for name in hardware_names()]
    for found in ([p for p in profiles if p.arch == arch], [p for p in profiles if arch in p.archs]):
        if found:
            return found[0].name
    raise NapkinError(f"no hardware profile runs {_shown(str(arch))}", hint=f"architectures per profile: {gpu_archs()}")


def profile_preference() -> list[str]:
    """The bundled profiles in the order napkin tries them for a kernel that names no hardware:
    the paper's model (``DEFAULT_MODEL``), the default GPU, the other GPUs, the other abstract
    models (each by name)."""
    names = hardware_names()
    gpus = [n for n in names if load_hardware(n).archs]
    first = [n for n in (DEFAULT_MODEL, DEFAULT_GPU) if n in names]
    return first + [n for n in gpus if n not in first] + [n for n in names if n not in gpus and n not in first]


def gpu_paths() -> str:
    """The bundled GPU profiles and the tensor-core instructions each prices, as help lists them:
    ``A100: mma.sync; H100: mma.sync, wgmma; ...``."""
    profiles = [load_hardware(name) for name in hardware_names()]
    return "; ".join(f"{p.name}: {', '.join(p.tensor_paths())}" for p in profiles if p.paths)


def gpu_archs() -> str:
    """The bundled GPU profiles and the architectures each runs, as messages and help list them:
    ``A100: sm_80; H100: sm_80, sm_90; ...``."""
    profiles = [load_hardware(name) for name in hardware_names()]
    return "; ".join(f"{p.name}: {', '.join(p.archs)}" for p in profiles if p.archs)


def all_level_names() -> set[str]:
    return {level.name for name in hardware_names() for level in load_hardware(name).levels}


# ---- warpgroup schedules: which compute units run under the tensor cores (docs/method.md,
# "Overlap of the compute units"; the model applies them, cost.overlapped_compute) --------------


@dataclass(frozen=True)
class Overlap:
    """A schedule of a wgmma launch's warpgroups, and which compute units it runs under the
    tensor cores. ``hidden`` units overlap the products: a launch's compute is then MUFU's time
    plus the longest of the tensor cores' and the hidden units' (``hidden == ()``: every unit
    in turn, the sum). The choice per schedule is the evidence's (``evidence``): the published
    FlashAttention-3 ablation on H100, ``benchmarks/model_vs_published.py``."""

    name: str
    hidden: tuple[str, ...]
    does: str
    evidence: str


OVERLAPS = {o.name: o for o in (
    Overlap("serial", (), "a warpgroup's softmax runs between its own products, and nothing orders it under another "
            "warpgroup's (napkin's default build; the model adds the latencies its chain waits on, napkin_dsl/chain.py)",
            "the sum is within 3% of FA3's ablation rows that drop one of the two overlaps below"),
    Overlap("pipelined", (), "within a warpgroup, chunk j's QK^T is issued before chunk j-1's PV, and chunk j's softmax "
            "is ordered while the latter is on the tensor cores (FA3's intra-warpgroup pipelining; napkin builds it, and "
            "its chain waits on PV's drain, whose wait ptxas places before the exponentials, napkin_dsl/chain.py)",
            "FA3 ablation, no warp specialization: 570 TFLOP/s, the sum's level"),
    Overlap("pingpong", (), "a producer warp fills the ring and two consumer warpgroups take turns on the tensor "
            "cores, one's softmax under the other's products (FA3's warp specialization), without the pipeline",
            "FA3 ablation, no intra-warpgroup pipelining: 582 TFLOP/s, the sum's level"),
    Overlap("pingpong+pipelined", ("fma",), "both (FlashAttention-3): the FMA pipe's softmax work runs under the "
            "products, and the exponentials (MUFU) do not",
            "FA3's full kernel: 661 TFLOP/s in the ablation, and its 12 published rows at d=128"),
)}
BUILT_OVERLAP = "serial"  # the schedule napkin's printers build by default, on wgmma and mma.sync alike
# The schedules napkin builds (paths.wgmma.SCHEDULES: the consumer warpgroups' order, and
# pingpong), each where a launch takes it; elsewhere the report prices them as what-ifs.
BUILT_OVERLAPS = ("serial", "pipelined", "pingpong", "pingpong+pipelined")
