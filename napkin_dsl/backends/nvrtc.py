"""CUDA C++ source to cubin (or PTX) with NVRTC, with resource usage and a two-level cache.

:class:`NvrtcCompiler` takes the text of one CUDA C++ translation unit and returns a
:class:`CompiledModule`: the cubin for one real architecture (``sm_80``, ``sm_90``), or PTX
when asked, NVRTC's log, and per-kernel resources (registers, static shared memory, spill
bytes) read from ptxas's ``-v`` report. It runs on any machine NVRTC runs on; no GPU and no
CUDA toolkit are needed: the pip wheel ``nvidia-cuda-nvrtc>=13.3`` carries the compiler and,
through ``--use-bundled-headers``, ``cuda_fp16.h``, ``cuda_bf16.h`` and ``mma.h``. An older
NVRTC (a GPU image's own CUDA 12.x/13.0) gets those headers from the nvidia-cuda-runtime /
nvidia-cuda-crt wheels or a system CUDA instead, found by ``cuda.pathfinder``.

NVRTC keeps no cache of its own, so this module keeps two, both keyed by the sha256 of the
source, the architecture, the output kind, the options, the header source and the NVRTC
version: a dict per compiler (a hit costs a hash of the source) and one file per module in
the user cache directory (``$NAPKIN_CACHE_DIR``, else the platform's user cache directory
for "napkin"), written to a temporary file and renamed into place so that processes compiling
the same kernel at once never see half a file. :func:`clear_cache` (``napkin cache clear``)
empties it, and the cache of ``compiled.py``, which finds a compiled kernel before its source
is even generated.

Two kinds of failure, two kinds of exception. :class:`NvrtcNotAvailable` is a
:class:`~napkin_dsl.errors.NapkinError`: the user's environment lacks a usable NVRTC, and the
message says what to install. :class:`NvrtcCompileError` is a plain ``RuntimeError``: napkin
generated CUDA that does not compile, which is a bug in napkin; it shows NVRTC's log and the
generated lines around each error, not the whole source.

Deliberately not here: generating CUDA source (``backends/cuda.py``), loading or launching
(``backends/driver.py``), linking several programs, name expressions for C++ templates
(kernels are ``extern "C"``), and any choice of optimisation flags beyond what the caller
passes in ``options``.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..cache import cache_root
from ..errors import NapkinError
from ..hardware import DEFAULT_ARCH

PIP_NVRTC = "nvidia-cuda-nvrtc>=13.3"
INSTALL_HINT = f"pip install 'cuda-python' '{PIP_NVRTC}'"
# NVRTC 12.0 is the oldest with cubin output for every architecture napkin targets; the
# bundled headers (and the --use-bundled-headers option) arrived in 13.3.
MIN_NVRTC_VERSION = (12, 0)
BUNDLED_HEADERS_VERSION = (13, 3)
# Bumped when the cache file layout or the key's recipe changes, so old files are never read.
CACHE_FORMAT = 1
KERNEL_CACHE_SUBDIR = "nvrtc-kernels"
HEADER_CACHE_SUBDIR = "nvrtc-headers"
CACHE_FILE_SUFFIX = ".nvrtc.json"
ELF_MAGIC = b"\x7fELF"
# How many error locations NvrtcCompileError quotes source for, and how many lines around each.
ERROR_EXCERPTS = 8
ERROR_CONTEXT_LINES = 2


class NvrtcNotAvailable(NapkinError):
    """NVRTC (or the headers it needs) is missing or too old on this machine.

    A problem with the user's environment, not with napkin or the kernel, hence a
    ``NapkinError``: the CLI prints it without a traceback, and the hint names the pip
    package to install.
    """


class NvrtcCompileError(RuntimeError):
    """NVRTC rejected CUDA source that napkin generated.

    This is a bug in napkin's code generation, never the user's mistake, so it is a plain
    ``RuntimeError`` (it keeps its traceback). The message holds NVRTC's log and, for each
    error NVRTC reports, the generated source lines around it with line numbers.
    """

    def __init__(self, name: str, arch: str, options: list[str], log: str, source: str, status: str = "NVRTC_ERROR_COMPILATION"):
        self.name = name
        self.arch = arch
        self.options = list(options)
        self.log = log
        self.source = source
        self.status = status
        excerpts = source_excerpts(source, log, name)
        parts = [
            (
                f"NVRTC could not compile {name} for {arch} ({status}). This is a bug in napkin's CUDA "
                "code generation; please report it with this message."
            ),
            "options: " + " ".join(self.options),
            "NVRTC log:\n" + _indent(log.strip() or "(empty)"),
        ]
        if excerpts:
            parts.append("generated source around each error:\n" + excerpts)
        super().__init__("\n\n".join(parts))


@dataclass(frozen=True)
class CompiledModule:
    """What NVRTC produced for one source and one architecture.

    ``cubin`` is set for a real-architecture compile (the default), ``ptx`` (text without its
    trailing NUL) when the compiler was made with ``ptx=True``; :attr:`image` is whichever is
    set, in the form ``cuModuleLoadData`` takes. ``resources`` maps each kernel (entry) name
    to ``{"registers", "shared_bytes", "spill_bytes"}``; shared_bytes is static shared
    memory, spill_bytes is spill stores plus spill loads. It is empty for PTX, because ptxas
    does not run. ``key`` is the cache key.
    """

    arch: str
    log: str
    resources: dict[str, dict[str, int]]
    key: str
    cubin: bytes | None = None
    ptx: bytes | None = None

    @property
    def image(self) -> bytes:
        if self.cubin is not None:
            return self.cubin
        # The driver reads PTX as a C string.
        return (self.ptx or b"") + b"\0"

    @property
    def kind(self) -> str:
        return "cubin" if self.cubin is not None else "ptx"


# ---- NVRTC itself ----------------------------------------------------------------------------


def _nvrtc_module():
    """cuda.bindings.nvrtc, imported on first use so that napkin imports without cuda-python."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as error:
        raise NvrtcNotAvailable(f"cuda-python is not installed ({error})", hint=INSTALL_HINT) from None
    return nvrtc


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library cuda-python loads; raises NvrtcNotAvailable."""
    nvrtc = _nvrtc_module()
    try:
        status, major, minor = nvrtc.nvrtcVersion()
    except (RuntimeError, OSError) as error:  # cuda.pathfinder's DynamicLibNotFoundError when libnvrtc is missing
        raise NvrtcNotAvailable(f"the NVRTC library could not be loaded: {error}", hint=INSTALL_HINT) from None
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcNotAvailable(f"nvrtcVersion failed with {status.name}", hint=INSTALL_HINT)
    if (major, minor) < MIN_NVRTC_VERSION:
        need = ".".join(map(str, MIN_NVRTC_VERSION))
        raise NvrtcNotAvailable(f"NVRTC {major}.{minor} is too old: napkin needs NVRTC {need} or newer", hint=INSTALL_HINT)
    return major, minor


def nvrtc_library() -> tuple[str, str]:
    """(absolute path, how cuda.pathfinder found it) of the libnvrtc this process uses.

    cuda.bindings loads NVRTC through cuda.pathfinder, whose answer is cached per process, so
    asking again after a compile names the library that actually compiled.
    """
    nvrtc_version()
    from cuda.pathfinder import load_nvidia_dynamic_lib

    loaded = load_nvidia_dynamic_lib("nvrtc")
    return loaded.abs_path, loaded.found_via


@functools.cache
def supported_archs() -> tuple[int, ...]:
    """The compute capabilities (75, 80, 90, ...) this NVRTC can compile for."""
    nvrtc = _nvrtc_module()
    nvrtc_version()
    status, archs = nvrtc.nvrtcGetSupportedArchs()
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcNotAvailable(f"nvrtcGetSupportedArchs failed with {status.name}", hint=INSTALL_HINT)
    return tuple(archs)


def _program_log(nvrtc, program) -> str:
    status, size = nvrtc.nvrtcGetProgramLogSize(program)
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    buffer = b" " * size
    nvrtc.nvrtcGetProgramLog(program, buffer)
    return buffer.rstrip(b"\0").decode(errors="replace")


def _program_output(nvrtc, program, ptx: bool) -> bytes:
    get_size, get = (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if ptx else (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)
    status, size = get_size(program)
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{get_size.__name__} failed with {status.name}")
    buffer = b" " * size
    (status,) = get(program, buffer)
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{get.__name__} failed with {status.name}")
    # NVRTC counts PTX's terminating NUL in its size; the cubin has none.
    return buffer.rstrip(b"\0") if ptx else buffer


def run_nvrtc(source: str, program_name: str, options: list[str], ptx: bool = False) -> tuple[str, bytes | None, str]:
    """One uncached NVRTC compile: (status name, output or None on failure, log)."""
    nvrtc = _nvrtc_module()
    status, program = nvrtc.nvrtcCreateProgram(source.encode(), program_name.encode(), 0, [], [])
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcCreateProgram failed with {status.name}")
    try:
        encoded = [option.encode() for option in options]
        (status,) = nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)
        log = _program_log(nvrtc, program)
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return status.name, None, log
        return status.name, _program_output(nvrtc, program, ptx), log
    finally:
        nvrtc.nvrtcDestroyProgram(program)


# ---- ptxas report and error excerpts ---------------------------------------------------------

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_USAGE = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_resources(log: str) -> dict[str, dict[str, int]]:
    """Registers, static shared memory and spill bytes per kernel, from ptxas's -v report.

    >>> report = '''ptxas info    : Compiling entry function 'k' for 'sm_90'
    ... ptxas info    : Function properties for k
    ... ptxas         .     0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
    ... ptxas info    : Used 40 registers, used 1 barriers, 1088 bytes smem'''
    >>> parse_ptxas_resources(report)
    {'k': {'registers': 40, 'shared_bytes': 1088, 'spill_bytes': 12}}
    """
    resources: dict[str, dict[str, int]] = {}
    entry = None  # the kernel whose report we are reading
    properties_of = None  # ptxas also reports non-inlined device functions; skip their spills
    for line in log.splitlines():
        if match := _ENTRY.search(line):
            entry = match.group(1)
            resources[entry] = {"registers": 0, "shared_bytes": 0, "spill_bytes": 0}
        elif match := _PROPERTIES.search(line):
            properties_of = match.group(1)
        elif (match := _SPILLS.search(line)) and properties_of in resources:
            resources[properties_of]["spill_bytes"] = int(match.group(1)) + int(match.group(2))
        elif (match := _USAGE.search(line)) and entry is not None:
            resources[entry]["registers"] = int(match.group(1))
            if smem := _SMEM.search(line):
                resources[entry]["shared_bytes"] = int(smem.group(1))
    return resources


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def source_excerpts(source: str, log: str, program_name: str) -> str:
    """For each error NVRTC reports in ``program_name``, that line and its neighbours, numbered."""
    pattern = re.compile(rf"^{re.escape(program_name)}\((\d+)\): (?:catastrophic )?error[^:]*: (.*)$", re.MULTILINE)
    errors = [(int(m.group(1)), m.group(2).strip()) for m in pattern.finditer(log)]
    lines = source.splitlines()
    width = len(str(len(lines)))
    blocks = []
    for number, message in errors[:ERROR_EXCERPTS]:
        first = max(1, number - ERROR_CONTEXT_LINES)
        last = min(len(lines), number + ERROR_CONTEXT_LINES)
        block = [f"{program_name}:{number}: error: {message}"]
        for n in range(first, last + 1):
            marker = ">" if n == number else " "
            block.append(f"  {marker} {n:>{width}} | {lines[n - 1]}")
        blocks.append("\n".join(block))
    if len(errors) > ERROR_EXCERPTS:
        blocks.append(f"... and {len(errors) - ERROR_EXCERPTS} more errors (see the log above)")
    return "\n\n".join(blocks)


# ---- headers ----------------------------------------------------------------------------------


def _toolkit_include_dirs() -> list[str]:
    """Directories holding cuda_fp16.h, crt/ and cccl for an NVRTC without bundled headers.

    cuda.pathfinder looks in the nvidia-cuda-runtime/-crt/-cccl wheels first, then conda,
    $CUDA_PATH/$CUDA_HOME and a system CUDA.
    """
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        return []
    found: list[str] = []
    for library in ("cudart", "cccl", "nvcc"):  # nvcc: the CUDA 12 wheels keep crt/ there
        try:
            directory = find_nvidia_header_directory(library)
        except (RuntimeError, ValueError, OSError):  # a name an older pathfinder lacks, or a failed probe
            directory = None
        if directory and directory not in found:
            found.append(directory)
    return found


def _writable_dir(directory: Path) -> Path:
    """``directory`` created, or a per-user temporary one when the cache is read-only."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return directory
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"napkin-{os.getuid() if hasattr(os, 'getuid') else 'user'}" / directory.name
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


# ---- the cache --------------------------------------------------------------------------------


def clear_cache(headers: bool = False) -> int:
    """Remove every compiled module (and compiled kernel, ``compiled.py``) from the disk cache;
    return how many files went.

    The NVRTC headers extracted beside it (about 26 MB, one copy per NVRTC version) stay
    unless ``headers`` is true: they are not compiled kernels, and re-extracting them costs
    every later first compile a few tenths of a second.
    """
    from .compiled import COMPILED_CACHE_SUBDIR, SASS_CACHE_SUBDIR  # the compiled kernels keyed before lowering, their listings

    root = cache_root()
    removed = 0
    subdirs = [KERNEL_CACHE_SUBDIR, COMPILED_CACHE_SUBDIR, SASS_CACHE_SUBDIR] + ([HEADER_CACHE_SUBDIR] if headers else [])
    for subdir in subdirs:
        directory = root / subdir
        if not directory.is_dir():
            continue
        removed += sum(1 for path in directory.rglob("*") if path.is_file() or path.is_symlink())
        shutil.rmtree(directory, ignore_errors=True)
    return removed


def _encode_module(module: CompiledModule) -> str:
    return json.dumps(
        {
            "format": CACHE_FORMAT,
            "key": module.key,
            "arch": module.arch,
            "kind": module.kind,
            "image": base64.b64encode(module.cubin if module.cubin is not None else module.ptx or b"").decode(),
            "log": module.log,
            "resources": module.resources,
        }
    )


def _decode_module(text: str, key: str) -> CompiledModule | None:
    try:
        data = json.loads(text)
        if data["format"] != CACHE_FORMAT or data["key"] != key:
            return None
        image = base64.b64decode(data["image"], validate=True)
        kind = data["kind"]
        if kind == "cubin" and not image.startswith(ELF_MAGIC):
            return None
        return CompiledModule(
            arch=data["arch"],
            log=data["log"],
            resources=data["resources"],
            key=key,
            cubin=image if kind == "cubin" else None,
            ptx=image if kind == "ptx" else None,
        )
    except (ValueError, KeyError, TypeError):
        return None


# ---- the compiler -----------------------------------------------------------------------------

_ARCH = re.compile(r"^sm_(\d+)([af]?)$")


@dataclass
class CacheStats:
    """How each compile() call was answered."""

    compiled: int = 0
    memory_hits: int = 0
    disk_hits: int = 0


class NvrtcCompiler:
    """Compiles CUDA C++ for one architecture with NVRTC, through an in-process and a disk cache.

    ``arch`` is a real architecture (``sm_80``, ``sm_90``, ``sm_90a``); ``ptx=True`` returns PTX
    for the matching virtual architecture instead of a cubin (for reading: load cubins, as a
    driver older than this NVRTC rejects its PTX). ``options`` are extra NVRTC options, one
    flag per string. ``headers`` picks where cuda_fp16.h and friends come from: ``"bundled"``
    (NVRTC >= 13.3 extracts its own copy into the cache), ``"toolkit"`` (``--include-path`` to
    the CUDA wheels or a system CUDA) or ``"auto"`` (bundled when the NVRTC has them).
    ``cache_dir`` overrides :func:`cache_root`.

    Keep one compiler per architecture for the life of the process: the in-process cache
    lives on the instance.

    Raises :class:`NvrtcNotAvailable` on construction when NVRTC is missing, too old, or
    cannot compile for ``arch``.
    """

    def __init__(
        self,
        arch: str = DEFAULT_ARCH,
        ptx: bool = False,
        options: Iterable[str] = (),
        *,
        headers: str = "auto",
        cache_dir: str | os.PathLike | None = None,
    ):
        match = _ARCH.match(arch)
        if not match:
            raise ValueError(f"arch must look like 'sm_90' or 'sm_90a', not {arch!r}")
        self.arch = arch
        self.ptx = ptx
        self.options = tuple(options)
        for option in self.options:
            if option.startswith(("-arch", "--gpu-architecture", "--use-bundled-headers")):
                raise ValueError(f"{option!r}: pass arch= and headers= to NvrtcCompiler instead")
        self.version = nvrtc_version()
        capability = int(match.group(1))
        if capability not in supported_archs():
            listed = ", ".join(f"sm_{a}" for a in supported_archs())
            raise NvrtcNotAvailable(
                f"NVRTC {self.version[0]}.{self.version[1]} cannot compile for {arch}; it supports {listed}",
                hint=f"a newer NVRTC may: {INSTALL_HINT}",
            )
        self.cache_root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
        self.kernel_cache_dir = self.cache_root / KERNEL_CACHE_SUBDIR
        self.header_mode, self.header_options = self._choose_headers(headers)
        virtual_arch = "compute_" + arch[len("sm_") :]
        self.nvrtc_options = [f"--gpu-architecture={virtual_arch if ptx else arch}"]
        if not ptx:
            # One flag per option: NVRTC hands the value to ptxas, whose -v report is the
            # source of `resources`. PTX compiles do not run ptxas.
            self.nvrtc_options.append("--ptxas-options=-v")
        self.nvrtc_options += self.header_options + list(self.options)
        self._memory: dict[str, CompiledModule] = {}
        self.stats = CacheStats()
        # Everything in the key except the source, hashed once; compile() copies and extends it.
        key_parts = [
            f"napkin-nvrtc-cache-{CACHE_FORMAT}",
            f"nvrtc-{self.version[0]}.{self.version[1]}",
            arch,
            "ptx" if ptx else "cubin",
            # the header *source*, not the extraction path, so moving the cache keeps its keys
            "bundled" if self.header_mode == "bundled" else "toolkit:" + os.pathsep.join(self.header_options),
            "\x1f".join(self.options),
        ]
        self._key_prefix = hashlib.sha256("\0".join(key_parts).encode() + b"\0")

    def _choose_headers(self, mode: str) -> tuple[str, list[str]]:
        if mode not in ("auto", "bundled", "toolkit"):
            raise ValueError(f"headers must be 'auto', 'bundled' or 'toolkit', not {mode!r}")
        has_bundled = self.version >= BUNDLED_HEADERS_VERSION
        if mode == "bundled" and not has_bundled:
            raise NvrtcNotAvailable(
                f"NVRTC {self.version[0]}.{self.version[1]} has no bundled headers (they came with 13.3)",
                hint=INSTALL_HINT,
            )
        if mode == "bundled" or (mode == "auto" and has_bundled):
            # NVRTC extracts its headers into this directory on first use (under a file lock,
            # so concurrent processes are safe) and reuses them while its version matches.
            version = f"{self.version[0]}.{self.version[1]}"
            directory = _writable_dir(self.cache_root / HEADER_CACHE_SUBDIR) / version
            return "bundled", [f"--use-bundled-headers={directory}"]
        return "toolkit", [f"--include-path={directory}" for directory in _toolkit_include_dirs()]

    def cache_key(self, source: str) -> str:
        """sha256 of the source, arch, output kind, options, header source and NVRTC version."""
        digest = self._key_prefix.copy()
        digest.update(source.encode())
        return digest.hexdigest()

    def compile(self, source: str, name: str) -> CompiledModule:
        """Compile ``source`` (one translation unit); ``name`` names it in NVRTC's messages.

        Returns the cached module when the same source was compiled before with the same
        settings: the very same object within this compiler, a copy read from disk otherwise.
        Raises :class:`NvrtcCompileError` when NVRTC rejects the source.
        """
        key = self.cache_key(source)
        if (module := self._memory.get(key)) is not None:
            self.stats.memory_hits += 1
            return module
        if (module := self._read_disk(key)) is not None:
            self.stats.disk_hits += 1
        else:
            module = self._compile_uncached(source, name, key)
            self.stats.compiled += 1
            self._write_disk(module)
        self._memory[key] = module
        return module

    def _compile_uncached(self, source: str, name: str, key: str) -> CompiledModule:
        program_name = name if name.endswith((".cu", ".cuh")) else f"{name}.cu"
        status, output, log = run_nvrtc(source, program_name, self.nvrtc_options, ptx=self.ptx)
        if output is None:
            if self.header_mode == "toolkit" and not self.header_options and "could not open source file" in log:
                raise NvrtcNotAvailable(
                    f"NVRTC {self.version[0]}.{self.version[1]} has no bundled headers and no CUDA headers "
                    "(cuda_fp16.h, cuda_bf16.h) were found in the nvidia-cuda-runtime wheel or a system CUDA",
                    hint=INSTALL_HINT,
                )
            raise NvrtcCompileError(program_name, self.arch, self.nvrtc_options, log, source, status)
        return CompiledModule(
            arch=self.arch,
            log=log,
            resources={} if self.ptx else parse_ptxas_resources(log),
            key=key,
            cubin=None if self.ptx else output,
            ptx=output if self.ptx else None,
        )

    def _cache_path(self, key: str) -> Path:
        return self.kernel_cache_dir / f"{key}{CACHE_FILE_SUFFIX}"

    def _read_disk(self, key: str) -> CompiledModule | None:
        try:
            text = self._cache_path(key).read_text()
        except (OSError, UnicodeDecodeError):
            return None
        # A file that does not decode (another format, a disk that filled up) is a miss; the
        # compile that follows replaces it.
        return _decode_module(text, key)

    def _write_disk(self, module: CompiledModule) -> None:
        """Write the module to a temporary file beside its final name and rename it into place.

        os.replace is atomic within a directory, so a concurrent reader sees the old file, no
        file, or the whole new one; two writers of the same key both succeed and the last
        rename wins with identical content. No fsync: a file lost to a crash is a cache miss.
        """
        try:
            self.kernel_cache_dir.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.kernel_cache_dir, prefix=f".{module.key[:16]}.", suffix=".tmp")
            try:
                with os.fdopen(handle, "w") as file:
                    file.write(_encode_module(module))
                os.replace(temporary, self._cache_path(module.key))
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        except OSError as error:
            warnings.warn(f"napkin: could not write the NVRTC cache in {self.kernel_cache_dir}: {error}", stacklevel=3)
