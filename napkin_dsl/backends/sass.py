"""SASS inspection: what the GPU will actually execute, read off a compiled kernel's cubin.

:func:`disassemble` runs NVIDIA's ``nvdisasm`` on a cubin and parses its listing into
:class:`Instruction`\\ s per kernel function (address, full opcode, predicate, branch target).
:func:`instruction_class` sorts an opcode into a handful of classes that say where the time
goes (tensor-core MMAs, float math, shared-memory loads by width, async copies, global and
local memory, barriers, integer address arithmetic, ...), from a table of opcodes
(:data:`OPCODE_CLASSES`), not from a chain of tests. :func:`innermost_loops` finds the loops
that contain no other loop (backward branches), which is where a tiled kernel spends its
time, and :func:`sass_report` puts it together for a
:class:`~napkin_dsl.backends.cuda.CompiledKernel`: per launch, a histogram of the whole
kernel and of each innermost loop, and instructions per tensor instruction in each loop.
``napkin cuda FILE --sass`` prints :func:`format_sass_report` (``--json``: the dict).

``nvdisasm`` is not part of NVRTC: it comes from the ``nvidia-cuda-nvdisasm`` wheel
(``pip install 'napkin-dsl[sass]'``) or a CUDA toolkit on ``PATH``; without it
:class:`NoDisassembler` (a :class:`~napkin_dsl.errors.NapkinError`) says what to install.
No GPU is needed.

The one claim about speed is a *ceiling*: :func:`loop_ceiling` prices each hot loop's
instructions against the per-SM rates of the resources they occupy (tensor cores at the hardware
profile's per-path rate, issue slots, shared-memory bandwidth, MUFU, the FP32 pipe), names the
resource that binds, and :func:`launch_ceiling` turns that into the TFLOP/s no run of the launch
can beat, beside the model's prediction for the same launch (``sass_report``'s ``ceiling``).
It is an upper bound, never an estimate: every instruction costs its best case (one issue slot,
no bank conflict, no stall, no latency).

Deliberately not here: timing or any estimate of speed (static instruction counts weigh an
instruction once however often it runs, and say nothing about latency or stalls: that is a
profiler's job), register liveness and dependency analysis, control flow beyond backward
branches (loops are address ranges, not a CFG), PTX (it is not what runs), and any assertion
about what a kernel ought to contain: the report counts, tests and people judge.
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..cache import cache_root, write_atomically
from ..chain import MissingLatency, chain_of
from ..cost import busy_fraction, flops_by_unit
from ..errors import NapkinError
from ..paths.wgmma import WgmmaPlan
from ..pseudocode import blocks_per_unit, walk
from .compiled import SASS_CACHE_SUBDIR

if TYPE_CHECKING:
    from .compiled import CompiledKernel

INSTALL_HINT = "pip install 'napkin-dsl[sass]'  (the nvidia-cuda-nvdisasm wheel), or put a CUDA toolkit's nvdisasm on PATH"
# Where the nvidia-cuda-nvdisasm wheel puts the binary inside the ``nvidia`` namespace
# package: CUDA 13 wheels share one cu13/ tree, CUDA 12 wheels had a directory per component.
WHEEL_BINARIES = ("cu13/bin/nvdisasm", "cuda_nvdisasm/bin/nvdisasm")
NVDISASM_TIMEOUT_S = 120
CACHE_FORMAT = 1  # bumped when a listing's key or file changes
_LISTINGS: dict[str, str] = {}  # the process's listings by key (run_nvdisasm)


class NoDisassembler(NapkinError):
    """No usable ``nvdisasm`` on this machine.

    The user's environment, not napkin or the kernel, hence a ``NapkinError``: the CLI prints
    it without a traceback and the hint names the package to install.
    """


# ---- finding and running nvdisasm ---------------------------------------------------------------


def find_nvdisasm() -> str:
    """The path of ``nvdisasm``: the pip wheel's first, else the one on ``PATH``.

    The wheel comes first because it is the one ``napkin-dsl[sass]`` pins: a toolkit on
    ``PATH`` may be older than the architectures NVRTC compiles for.
    """
    suffix = ".exe" if os.name == "nt" else ""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for relative in WHEEL_BINARIES:
            candidate = Path(root) / (relative + suffix)
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    found = shutil.which("nvdisasm")
    if found:
        return found
    raise NoDisassembler("nvdisasm, the SASS disassembler, is not installed", hint=INSTALL_HINT)


def _listing_key(binary: str, cubin: bytes) -> str:
    """The cache key of a listing: the cubin's bytes and the nvdisasm that reads them (its path,
    size and modification time: another version may print another listing)."""
    status = os.stat(binary)
    identity = f"{CACHE_FORMAT}\0{binary}\0{status.st_size}\0{status.st_mtime_ns}\0".encode()
    return hashlib.sha256(identity + cubin).hexdigest()


def run_nvdisasm(cubin: bytes) -> str:
    """nvdisasm's listing of the code sections of a cubin (``-c``: no ELF headers, no data).

    No ``-g`` (line info), ``-hex`` (encodings) or ``-cfg`` (a graphviz graph instead of a
    listing): the parser wants one instruction per line and nothing else on it.

    Listings are cached like NVRTC's output (``cache.py``): in the process and on disk under
    ``sass-listings/``, by :func:`_listing_key`. The same cubin is read by every report, test
    and docs page that inspects its kernel, and a large one takes nvdisasm a second or more.
    """
    if cubin[:4] != b"\x7fELF":
        raise NapkinError("nvdisasm reads cubins (ELF images), and this image is not one", hint="compile without ptx=True / --ptx")
    binary = find_nvdisasm()
    key = _listing_key(binary, cubin)
    if key in _LISTINGS:
        return _LISTINGS[key]
    path = cache_root() / SASS_CACHE_SUBDIR / f"{key}.sass"
    try:
        listing = path.read_text()
    except (OSError, UnicodeDecodeError):
        listing = _disassemble_uncached(binary, cubin)
        try:
            write_atomically(path, listing.encode(), create_parents=True)
        except OSError:
            pass  # a read-only cache is a miss next time, never an error
    if len(_LISTINGS) >= 256:  # a long-lived process reads many kernels: keep the memo bounded
        _LISTINGS.clear()
    _LISTINGS[key] = listing
    return listing


def _disassemble_uncached(binary: str, cubin: bytes) -> str:
    with tempfile.TemporaryDirectory(prefix="napkin-sass-") as directory:
        path = Path(directory) / "kernel.cubin"
        path.write_bytes(cubin)
        finished = subprocess.run([binary, "-c", str(path)], capture_output=True, text=True, timeout=NVDISASM_TIMEOUT_S, check=False)
    if finished.returncode != 0:
        # An nvdisasm older than the cubin's architecture is the usual cause: the user's setup.
        raise NoDisassembler(f"{binary} could not disassemble the cubin: {(finished.stderr or finished.stdout).strip()[:500]}",
                             hint=f"a newer nvdisasm: {INSTALL_HINT}")
    return finished.stdout


# ---- parsing the listing ------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction: its byte offset in the function, opcode with every modifier
    (``LDS.U16``, ``HMMA.16816.F32.BF16``), guard predicate (``@!P0``, or ``""``), operands,
    and, for instructions that name a label (branches, ``BSSY``), the label's address."""

    address: int
    opcode: str
    operands: str = ""
    predicate: str = ""
    target: int | None = None

    @property
    def base(self) -> str:
        """The opcode without modifiers: ``LDS`` for ``LDS.U16``."""
        return self.opcode.split(".", 1)[0]

    @property
    def modifiers(self) -> tuple[str, ...]:
        return tuple(self.opcode.split(".")[1:])

    @property
    def kind(self) -> str:
        return instruction_class(self.opcode)

    def __str__(self) -> str:
        guard = f"{self.predicate} " if self.predicate else ""
        return f"/*{self.address:04x}*/ {guard}{self.opcode} {self.operands}".rstrip()


# nvdisasm's function header is a comment line `//---- .text.NAME ----`; cuobjdump's listing
# says `Function : NAME`. Either starts a function.
_FUNCTION = re.compile(r"^\s*(?://-+\s*\.text\.(?P<text>\S+)\s*-*\s*$|\s*Function\s*:\s*(?P<function>\S+)\s*$)")
_LABEL = re.compile(r"^\s*(?P<label>[A-Za-z_.$][\w.$]*):\s*$")
_INSTRUCTION = re.compile(
    r"^\s*/\*(?P<address>[0-9a-fA-F]+)\*/\s*"
    r"(?:(?P<predicate>@!?U?P(?:T|\d+))\s+)?"
    # a warpgroup MMA's shape has lowercase x's (HGMMA.64x128x16.F32.BF16): part of the opcode
    r"(?P<opcode>[A-Z][A-Z0-9_.]*(?:x[0-9][A-Z0-9_.x]*)?)"
    r"\s*(?P<operands>[^;]*?)\s*;"
)
# Branch targets are printed as labels, `(.L_x_4)`, in backquotes; a raw address is accepted too.
_LABEL_OPERAND = re.compile(r"`\((?P<label>[^)]+)\)")
_ADDRESS_OPERAND = re.compile(r"^(?:.*,\s*)?(?P<address>0x[0-9a-fA-F]+)\s*$")
BRANCHES = frozenset({"BRA", "JMP"})


def parse_listing(text: str) -> dict[str, list[Instruction]]:
    """nvdisasm's (or cuobjdump's) text listing -> instructions per function, in address order."""
    functions: dict[str, list[tuple]] = {}
    labels: dict[str, dict[str, int]] = {}
    current = None
    pending: list[str] = []  # labels seen since the last instruction: they name the next one
    for line in text.splitlines():
        header = _FUNCTION.match(line)
        if header:
            current = header.group("text") or header.group("function")
            functions.setdefault(current, [])
            labels.setdefault(current, {})
            pending = []
            continue
        if current is None:
            continue
        label = _LABEL.match(line)
        if label:
            pending.append(label.group("label"))
            continue
        found = _INSTRUCTION.match(line)
        if not found:
            continue
        address = int(found.group("address"), 16)
        for name in pending:
            labels[current][name] = address
        pending = []
        functions[current].append((address, found.group("opcode"), found.group("operands"), found.group("predicate") or ""))

    parsed = {}
    for name, rows in functions.items():
        own = labels[name]
        instructions = []
        for address, opcode, operands, predicate in rows:
            target = None
            named = _LABEL_OPERAND.search(operands)
            if named:
                # Addresses are offsets within a function, so only its own labels resolve (a CALL
                # to another function keeps no target).
                target = own.get(named.group("label"))
            elif opcode.split(".", 1)[0] in BRANCHES:
                raw = _ADDRESS_OPERAND.match(operands)
                target = int(raw.group("address"), 16) if raw else None
            instructions.append(Instruction(address, opcode, operands, predicate, target))
        parsed[name] = sorted(instructions, key=lambda i: i.address)
    return parsed


def disassemble(cubin: bytes) -> dict[str, list[Instruction]]:
    """The instructions of every function in a cubin, by function (kernel entry) name."""
    return parse_listing(run_nvdisasm(cubin))


# ---- instruction classes ------------------------------------------------------------------------

# Classes, and the order reports show them in.
CLASSES = ("tensor", "float", "ldsm", "ldgsts", "lds", "sts", "global", "local", "barrier", "async_wait",
           "shuffle", "mufu", "integer", "convert", "control", "other")

# Base opcode (before the first dot) -> class. Classifying by the base opcode matters:
# HFMA2.MMA is a half-precision FMA issued on the MMA pipe (the compiler's way to move
# constants), not tensor-core work, and LDSM is not an LDS.
OPCODE_CLASSES: dict[str, str] = {
    # tensor cores: warp-level MMA (sm_80+; QMMA: 8-bit floats, sm_89), warpgroup MMA (sm_90), tcgen05 MMA (sm_100)
    **dict.fromkeys(["HMMA", "QMMA", "IMMA", "DMMA", "BMMA", "HGMMA", "IGMMA", "QGMMA", "BGMMA",
                     "UTCHMMA", "UTCIMMA", "UTCQMMA", "UTCOMMA", "UTCMMA"], "tensor"),
    **dict.fromkeys(["FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "FSWZADD", "FFMA2", "FMUL2", "FADD2",
                     "HFMA2", "HADD2", "HMUL2", "HMNMX2", "HSETP2", "HSET2",
                     "DFMA", "DMUL", "DADD", "DMNMX", "DSETP"], "float"),
    "LDSM": "ldsm",
    # asynchronous global -> shared copies: cp.async (sm_80) and the Hopper bulk/tensor (TMA) copies
    **dict.fromkeys(["LDGSTS", "UBLKCP", "UTMALDG"], "ldgsts"),
    "LDS": "lds",
    **dict.fromkeys(["STS", "STSM"], "sts"),
    # Generic LD/ST count as global: the listing cannot tell the space, and shared memory that
    # napkin declares __shared__ compiles to LDS/STS.
    **dict.fromkeys(["LDG", "STG", "LD", "ST", "ATOM", "ATOMG", "RED", "REDG", "UTMASTG"], "global"),
    **dict.fromkeys(["LDL", "STL"], "local"),
    **dict.fromkeys(["BAR", "MEMBAR", "ERRBAR", "SYNCS"], "barrier"),
    # waits on asynchronous copies and MMAs (cp.async.wait_group, wgmma.wait_group)
    **dict.fromkeys(["DEPBAR", "LDGDEPBAR", "WARPGROUP", "ARRIVES"], "async_wait"),
    "SHFL": "shuffle",
    "MUFU": "mufu",
    **dict.fromkeys(["IMAD", "IMUL", "IADD", "IADD3", "IADD32I", "ISCADD", "LOP", "LOP3", "LOP32I", "PLOP3", "SHF", "SHL", "SHR",
                     "LEA", "ISETP", "IMNMX", "VIMNMX", "VIMNMX3", "VIADD", "VIADDMNMX", "IABS", "SEL", "MOV", "MOV32I", "PRMT",
                     "POPC", "FLO", "BREV", "BMSK", "SGXT", "IDP", "IDP4A", "VABSDIFF", "VABSDIFF4", "P2R", "R2P", "XMAD"], "integer"),
    **dict.fromkeys(["F2F", "F2FP", "F2I", "F2IP", "I2F", "I2FP", "I2I", "I2IP", "FRND"], "convert"),
    **dict.fromkeys(["BRA", "BRX", "JMP", "JMX", "EXIT", "BSSY", "BSYNC", "NOP", "RET", "CALL", "BREAK", "BPT", "KILL",
                     "WARPSYNC", "ENDCOLLECTIVE", "YIELD", "NANOSLEEP", "ELECT"], "control"),
}

_LDS_WIDTHS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "32": 32, "64": 64, "128": 128}


def instruction_class(opcode: str) -> str:
    """The class of an opcode (full, with modifiers), one of :data:`CLASSES`.

    >>> [instruction_class(op) for op in ("HMMA.16816.F32.BF16", "HFMA2.MMA", "LDSM.16.M88.4", "UIADD3", "S2R")]
    ['tensor', 'float', 'ldsm', 'integer', 'other']
    """
    base = opcode.split(".", 1)[0]
    found = OPCODE_CLASSES.get(base)
    # Uniform-datapath twins (UIADD3, UMOV, ULOP3, ...) do the same work as their vector forms.
    if found is None and base.startswith("U"):
        found = OPCODE_CLASSES.get(base[1:])
    return found or "other"


def histogram_key(opcode: str) -> str:
    """The column an opcode counts in: its class, except that shared-memory loads are split by
    width (``lds.16`` .. ``lds.128``: 128-bit loads move four times the bytes per instruction)
    and FFMA, the two-FLOP float op, counts as ``ffma`` apart from the rest of ``float``.

    >>> [histogram_key(op) for op in ("LDS", "LDS.U16", "LDS.U.128", "FFMA.SAT", "FMUL")]
    ['lds.32', 'lds.16', 'lds.128', 'ffma', 'float']
    """
    klass = instruction_class(opcode)
    base, *modifiers = opcode.split(".")
    if klass == "lds":
        width = next((_LDS_WIDTHS[m] for m in modifiers if m in _LDS_WIDTHS), 32)
        return f"lds.{width}"
    if base == "FFMA":
        return "ffma"
    return klass


def _key_order(key: str) -> tuple:
    klass, _, width = key.partition(".")
    if key == "ffma":
        return (CLASSES.index("float"), -1)
    return (CLASSES.index(klass) if klass in CLASSES else len(CLASSES), int(width) if width.isdigit() else 0)


def histogram(instructions: list[Instruction]) -> collections.Counter:
    """How many instructions fall in each :func:`histogram_key`."""
    return collections.Counter(histogram_key(i.opcode) for i in instructions)


# ---- loops --------------------------------------------------------------------------------------


def _backward_branches(instructions: list[Instruction]) -> list[Instruction]:
    found = []
    for i in instructions:
        if i.base not in BRANCHES or i.target is None or i.target > i.address:
            continue
        # `.L_x_N: BRA .L_x_N` after the last EXIT is the compiler's end-of-function trap,
        # never taken: an unconditional branch to itself is not a loop.
        if i.target == i.address and not i.predicate:
            continue
        found.append(i)
    return found


def loop_ranges(instructions: list[Instruction]) -> list[tuple[int, int]]:
    """(first, last) address of every loop: a backward branch and its target. Backward branches
    to one target (a loop with a `continue`) are one loop, up to the last of them."""
    ends: dict[int, int] = {}
    for branch in _backward_branches(instructions):
        ends[branch.target] = max(ends.get(branch.target, branch.address), branch.address)
    return sorted(ends.items())


def closed_loops(instructions: list[Instruction]) -> list[list[Instruction]]:
    """The loops closed by a conditional branch back: an unconditional one is a wait's retry that
    ptxas moved out of line, whose range is no loop."""
    at = {i.address: i for i in instructions}
    return [[i for i in instructions if start <= i.address <= end] for start, end in loop_ranges(instructions)
            if at[end].predicate]


def innermost_loops(instructions: list[Instruction]) -> list[list[Instruction]]:
    """The instructions of every loop that contains no other loop, in address order."""
    ranges = loop_ranges(instructions)
    innermost = [(start, end) for start, end in ranges
                 if not any((s, e) != (start, end) and start <= s and e <= end for s, e in ranges)]
    return [[i for i in instructions if start <= i.address <= end] for start, end in innermost]


def tensor_loops(instructions: list[Instruction]) -> list[list[Instruction]]:
    """The loops holding tensor-core instructions that hold no smaller such loop, and are not
    innermost: with TMA, ptxas wraps each UTMALDG in a one-trip ``ELECT`` loop and each
    mbarrier wait in a spin loop inside the chunk loop, which then contains loops without being
    any less the loop the MMAs run in. Its body is counted whole, the nested loops once."""
    ranges = loop_ranges(instructions)

    def has_tensor(start: int, end: int) -> bool:
        return any(start <= i.address <= end and i.kind == "tensor" for i in instructions)

    at = {i.address: i for i in instructions}

    def out_of_line(start: int, end: int) -> bool:
        # ptxas may move an mbarrier wait's retry past the function's end: its unconditional branch
        # back into the chunk loop spans the epilogue, and crosses the chunk loop's range (real
        # loops nest or are disjoint). That span is no loop the MMAs run in.
        return not at[end].predicate and any(s < start <= e < end or start < s <= end < e for s, e in ranges)

    holding = [(s, e) for s, e in ranges if has_tensor(s, e) and not out_of_line(s, e)]
    found = []
    for start, end in holding:
        nested = [(s, e) for s, e in ranges if (s, e) != (start, end) and start <= s and e <= end]
        if nested and not any(r in holding for r in nested):
            found.append([i for i in instructions if start <= i.address <= end])
    return found


# ---- the static ceiling -------------------------------------------------------------------------

# An SM of sm_80 and sm_90 has four sub-partitions (SMSPs), each with one warp scheduler that
# issues one warp instruction per clock (CUDA C++ Programming Guide, "Compute Capability 8.x" and
# "9.0": "4 warp schedulers" per SM). A block's warps are assigned to the sub-partitions when it
# starts and stay there (NVIDIA's forum answer on SMSPs, forums.developer.nvidia.com/t/259827), and
# each sub-partition has its own quarter of the tensor cores, FP32 lanes and MUFU units.
SUBPARTITIONS = 4
ISSUE_PER_CLOCK = 1  # warp instructions per clock per sub-partition
WARP_LANES = 32
# Shared memory: 32 banks of 4 bytes, each serving one 4-byte word per clock (Programming Guide,
# "Shared Memory", compute capability 5.x and later): 128 B/clk/SM. The GPU profiles encode it as
# the registers level's bandwidth (32 x 4 B x SMs x clock); this is the fallback for one that does not.
SHARED_BYTES_PER_CLOCK = 128
# ldmatrix moves 8x8 matrices of 16-bit values, 128 bytes each (PTX ISA, "ldmatrix"): .x1, .x2, .x4.
LDSM_MATRIX_BYTES = 128
# HMMA shapes as the SASS opcode names them (HMMA.16816: m16n8k16) -> (m, n, k).
HMMA_SHAPES = {"16816": (16, 8, 16), "1688": (16, 8, 8), "1684": (16, 8, 4), "884": (8, 8, 4), "16832": (16, 8, 32)}
_GMMA_SHAPE = re.compile(r"^(\d+)x(\d+)x(\d+)$")  # HGMMA.64x128x16
_OPERAND_DTYPES = {"BF16": "bf16", "TF32": "f32", "E4M3": "fp8e4m3", "E5M2": "fp8e5m2"}
FP32_PIPE = frozenset({"FFMA", "FMUL", "FADD"})  # one FP32 lane each (FFMA: 2 FLOPs)
# FP32 FLOPs per lane, as the model counts them (a max is one FLOP, an FMA two).
FP32_FLOPS = {"FFMA": 2, "FMUL": 1, "FADD": 1, "FMNMX": 1}
RESOURCES = ("tensor", "issue", "shared", "mufu", "fp32", "chain")


def tensor_work(opcode: str) -> tuple[int, str, str] | None:
    """(FLOPs of one warp's instruction, PTX instruction, operand dtype) of a tensor-core opcode,
    None for anything else (or a shape this table does not know).

    >>> tensor_work("HMMA.16816.F32.BF16"), tensor_work("HMMA.1688.F32.TF32")
    ((4096, 'mma.sync', 'bf16'), (2048, 'mma.sync', 'f32'))

    sm_89 names mma.sync m16n8k32 on e4m3 QMMA (sm_90 has none: ptxas converts the operands to
    f16, F2FP.F16.E4M3.UNPACK_B, and issues two HMMA.16816.F32):

    >>> tensor_work("QMMA.16832.F32.E4M3.E4M3")
    (8192, 'mma.sync', 'fp8e4m3')

    A warpgroup MMA (HGMMA, wgmma) is issued by each of its four warps, each for 16 of its 64 rows:

    >>> tensor_work("HGMMA.64x128x16.F32.BF16")
    (65536, 'wgmma', 'bf16')

    and sm_90a names wgmma's 8-bit shape (m64nNk32 .e4m3) QGMMA:

    >>> tensor_work("QGMMA.64x128x32.F32.E4M3.E4M3")
    (131072, 'wgmma', 'fp8e4m3')
    """
    base, *modifiers = opcode.split(".")
    dtype = next((_OPERAND_DTYPES[m] for m in modifiers if m in _OPERAND_DTYPES), "f16")
    if base in ("HMMA", "QMMA") and modifiers and modifiers[0] in HMMA_SHAPES:
        m, n, k = HMMA_SHAPES[modifiers[0]]
        return 2 * m * n * k, "mma.sync", dtype
    if base in ("HGMMA", "QGMMA") and modifiers and _GMMA_SHAPE.match(modifiers[0]):
        m, n, k = (int(g) for g in _GMMA_SHAPE.match(modifiers[0]).groups())
        return 2 * m * n * k // 4, "wgmma", dtype
    return None


def shared_bytes(opcode: str) -> int:
    """Bytes one warp's instruction moves through shared memory: ``ldmatrix`` (LDSM, and STSM)
    128 B per matrix (``.4``: 512 B); LDS, STS and the shared side of ``cp.async`` (LDGSTS) their
    width times 32 lanes (LDS.128: 512 B). 0 for anything else.

    >>> [shared_bytes(op) for op in ("LDSM.16.M88.4", "LDSM.16.MT88.2", "LDS.U16", "LDS", "STS.128", "LDGSTS.E.BYPASS.128", "FFMA")]
    [512, 256, 64, 128, 512, 512, 0]
    """
    base, *modifiers = opcode.split(".")
    if base in ("LDSM", "STSM"):
        matrices = next((int(m) for m in modifiers if m in ("1", "2", "4")), 1)
        return LDSM_MATRIX_BYTES * matrices
    if base in ("LDS", "STS", "LDGSTS"):
        width = next((_LDS_WIDTHS[m] for m in modifiers if m in _LDS_WIDTHS), 32)
        return width // 8 * WARP_LANES
    return 0


@dataclass(frozen=True)
class SMRates:
    """What one SM does per clock, read off a GPU's hardware profile (the model's own numbers):
    tensor FLOPs per instruction path and dtype (``hardware.peak``), shared-memory bytes (the
    registers level's bandwidth: shared memory to registers), MUFU results (``special``) and FP32
    lanes (``fma`` f32 / 2 FLOPs)."""

    hardware: object
    clock_hz: float
    sms: int
    shared_bytes: float
    mufu: float
    fp32: float

    def tensor(self, instruction: str, dtype: str) -> float | None:
        rate = self.hardware.peak(instruction, dtype)
        return None if rate is None else rate / (self.sms * self.clock_hz)


def sm_rates(hardware) -> SMRates:
    """The per-SM, per-clock rates of a GPU profile (a :class:`~napkin_dsl.hardware.Hardware`)."""
    if hardware.symbolic or not hardware.clock_hz:
        raise NapkinError(f"{hardware.name} is not a GPU profile with a clock: the ceiling prices instructions per clock",
                          hint="compile for a GPU profile (A100, H100, H200)")
    clock = float(hardware.clock_hz)
    sms = next(level.units for level in hardware.levels if level.compute)
    per_sm = clock * sms
    registers = next((level for level in hardware.levels if level.name == "registers"), None)
    shared = (float(registers.bandwidth) / per_sm if registers is not None and isinstance(registers.bandwidth, (int, float))
              else SHARED_BYTES_PER_CLOCK)
    special = hardware.peak("special", "f32")
    fma = hardware.peak("fma", "f32")
    return SMRates(hardware, clock, sms, shared,
                   mufu=special / per_sm if special else float("inf"),
                   fp32=fma / 2 / per_sm if fma else float("inf"))


def _least_imbalance(warps: int, blocks_per_sm: int) -> float:
    """How much longer the busiest sub-partition works than the average, at the best residency
    from 1 to ``blocks_per_sm`` blocks of ``warps`` warps (a block's warps spread evenly)."""
    return min(-(-k * warps // SUBPARTITIONS) / (k * warps / SUBPARTITIONS) for k in range(1, max(blocks_per_sm, 1) + 1))


def loop_ceiling(body: list[Instruction], rates: SMRates, warps: int, blocks_per_sm: int = 1, unit: str = "tensor",
                 tma_ring: tuple[int, int] = (0, 1), fills: int | None = None, chain=None) -> dict:
    """The clocks one iteration of a loop takes on each resource of an SM, for every warp of a
    block running it once, and the FLOP rate that implies.

    Per warp: ``tensor`` is its MMAs' FLOPs at the profile's per-path rate; ``issue`` one slot
    per instruction; ``mufu`` 32 results per MUFU instruction; ``fp32`` 32 lanes per FFMA, FMUL
    or FADD. Those four run on the warp's sub-partition, a quarter of the SM, and the busiest
    sub-partition holds ``ceil(warps / 4)`` of a block's warps (:func:`_least_imbalance`).
    ``shared`` is every warp's shared-memory bytes (:func:`shared_bytes`) at the SM's bytes per
    clock, plus TMA's box writes into shared memory once a block: ``tma_ring`` is the (bytes,
    boxes) of one fill of the plan's TMA ring, whose whole fills the loop's UTMALDGs are (the
    instruction names no size), or where another warp issues them (a producer's: ``fills``) the
    fills one iteration consumes. ``chain`` (a wgmma launch's :class:`~napkin_dsl.chain.Chain`)
    adds the ``chain`` resource: each chunk the iteration runs (its fills, else 1) takes the
    chain's clocks with its products' tensor clocks as the units' time, over the blocks an SM
    runs side by side, the least the model's chain allows (never more than the model charges: the
    units' time it stretches is at least the products'). The binding resource is the one
    with the most clocks; ``unit`` says which FLOPs the
    rate counts: ``tensor`` (the MMAs') or ``fp32`` (2 per FFMA, 1 per FMUL, FADD, FMNMX, times
    32 lanes: an FMA-path launch).

    Each count is a best case (one issue slot an instruction, no bank conflict, no stall; an
    instruction under a predicate costs only its issue slot, and one under ``@!PT`` nothing), so
    the rate is an upper bound on what the loop can run at, never an estimate of it.
    """
    tensor_clocks = 0.0
    tensor_flops = 0
    unpriced = collections.Counter()
    counts = collections.Counter()
    nbytes = 0
    copies = 0  # UTMALDG: TMA's box writes, once a block, not once a warp
    issued = 0
    for instruction in body:
        if instruction.predicate == "@!PT":
            continue  # never executes: the compiler's padding (`@!PT LDS RZ, [RZ]` beside cp.async)
        issued += 1
        if instruction.predicate:
            continue  # may not execute: an upper bound charges it only its issue slot
        base = instruction.base
        work = tensor_work(instruction.opcode)
        if work is not None:
            flops, path, dtype = work
            rate = rates.tensor(path, dtype)
            if rate is None:
                unpriced[instruction.opcode] += 1
            else:
                tensor_flops += flops
                tensor_clocks += flops / (rate / SUBPARTITIONS)
        elif instruction.kind == "tensor":
            unpriced[instruction.opcode] += 1
        nbytes += shared_bytes(instruction.opcode)
        copies += base == "UTMALDG"
        counts["mufu"] += base == "MUFU"
        counts["fp32"] += base in FP32_PIPE
        counts["fp32_flops"] += FP32_FLOPS.get(base, 0)
    block_bytes = (fills if fills is not None else copies / tma_ring[1]) * tma_ring[0]
    imbalance = _least_imbalance(warps, blocks_per_sm)
    per_partition = warps / SUBPARTITIONS * imbalance  # warps of a block on the busiest sub-partition, on average
    clocks = {
        "tensor": per_partition * tensor_clocks,
        "issue": per_partition * issued / ISSUE_PER_CLOCK,
        "shared": (warps * nbytes + block_bytes) / rates.shared_bytes,
        "mufu": per_partition * counts["mufu"] * WARP_LANES / (rates.mufu / SUBPARTITIONS),
        "fp32": per_partition * counts["fp32"] * WARP_LANES / (rates.fp32 / SUBPARTITIONS),
    }
    chunks = max(fills if fills is not None else copies / tma_ring[1] if copies else 1, 1)
    clocks["chain"] = (chunks * chain.chunk_clocks(clocks["tensor"] / chunks) / max(blocks_per_sm, 1)
                       if chain is not None and clocks["tensor"] else 0.0)
    flops = warps * (tensor_flops if unit == "tensor" else counts["fp32_flops"] * WARP_LANES)
    binding = max(RESOURCES, key=lambda r: clocks[r])
    longest = clocks[binding]
    rate = flops / longest * rates.sms * rates.clock_hz if flops and longest else None
    return {
        "start": body[0].address if body else None,
        "end": body[-1].address if body else None,
        "warps": warps,
        "blocks_per_sm": blocks_per_sm,
        "imbalance": round(imbalance, 4),
        "unit": unit,
        "flops": flops,
        "shared_bytes": warps * nbytes + block_bytes,
        "clocks": {r: round(c, 2) for r, c in clocks.items()},
        "binding": binding,
        "tflops": None if rate is None else rate / 1e12,
        "unpriced": dict(unpriced),
    }


def launch_ceiling(compiled: CompiledKernel, index: int, body: list[Instruction] | None,
                   function: list[Instruction], rates: SMRates | None = None) -> dict:
    """The static ceiling of one launch of a compiled kernel beside the model's prediction.

    The hot loop's rate (:func:`loop_ceiling`, at the blocks per SM its compiled resources allow)
    is applied to all of the launch's work on the loop's unit, the Program's FLOPs on tensor
    cores (a tensor-core launch) or on the FMA pipe (an FMA launch), spread over the SMs as its
    blocks allow (the busiest SM runs ceil(blocks / SMs) of them; a masked launch, whose blocks
    do unequal work, is given every SM). That is ``floor_s``, the least time the launch can take
    in its hot loop's code (the whole function where no loop holds the unit's instructions: a fully
    unrolled launch); ``tflops`` is the launch's FLOPs (every unit) over it, the same
    measure as ``model_tflops``, the model's FLOPs over its time for the launch (the roofline,
    without the fixed costs). Code outside the hot loop, latency and stalls only add time.
    """
    program, report = compiled.program, compiled.cost
    rates = rates or sm_rates(program.hardware)
    kernel = compiled.launches[index]
    launch = program.launches[index]
    row = compiled.launch_table()[index]
    selected = compiled.selection
    plan = selected[launch.index].plan
    roles = isinstance(plan, WgmmaPlan) and plan.roles is not None
    # warp-specialized: the hot loop is the consumers' warps'; the producer warpgroup runs its own
    warps = plan.warps if roles else -(-kernel.block // WARP_LANES)
    resident = blocks_per_unit(program.schedule, row["shared_bytes"], kernel.block, row["registers"])
    blocks_per_sm = resident[0] if resident else 1
    unit = "fp32" if kernel.path == "fma" else "tensor"
    _, priced = flops_by_unit(program, selected)
    mine = [(rate, float(amount)) for at, rate, _, amount in priced if at == launch.index]
    total = sum(amount for _, amount in mine)
    on_unit = sum(amount for rate, amount in mine if (rate == "fma") == (unit == "fp32") and rate != "special")
    time = report.time
    if "launch_s" in time:
        model_s = time["launch_s"][index]
    else:
        model_s = time["overlapped_s"] - sum((time.get("fixed_s") or {}).values()) if time.get("overlapped_s") else None
    out = {"unit": unit, "loop": None, "binding": None, "busy": None, "floor_s": None, "tflops": None,
           "model_s": model_s, "model_tflops": total / model_s / 1e12 if model_s and total else None,
           "flops": total, "unit_flops": on_unit,
           "tensor_in_loop": sum(i.kind == "tensor" for i in body or []),
           "tensor_in_kernel": sum(i.kind == "tensor" for i in function), "whole_function": False, "inner_loops": 0}
    def works(code):
        return any((i.kind == "tensor") if unit == "tensor" else (i.base in FP32_FLOPS) for i in code or [])

    if not works(body) and works(function):
        # the MMAs (or FP32 math) are in no loop, unrolled: the function is the one iteration
        body, out["whole_function"] = function, True
    if not body:
        return out
    # Loops inside the priced code (an implicit GEMM's gathers, tensorcore.TensorPrinter.gather; an
    # epilogue's passes where the function is priced whole) may run more than once an iteration and
    # are counted once: the ceiling is then an upper bound.
    first, last = body[0].address, body[-1].address
    out["inner_loops"] = sum(1 for start, end in loop_ranges(function)
                             if first <= start and end <= last and (start, end) != (first, last))
    ring = [load for load in (plan.tma if isinstance(plan, WgmmaPlan) else ()) if load.streamed]
    fill = (sum(load.bytes for load in ring), sum(load.boxes for load in ring)) if ring else (0, 1)
    # with roles the producer's loop issues the boxes: the consumers' loop takes a fill a full-barrier wait
    fills = sum(i.opcode.startswith("SYNCS.PHASECHK") for i in body) if roles else None
    loop = loop_ceiling(body, rates, warps, blocks_per_sm, unit, fill, fills, launch_chain(plan, program.hardware))
    out["loop"] = loop
    out["binding"] = loop["binding"]
    if loop["tflops"] is None or not on_unit:
        return out
    masked = any(lp.mask is not None for _, loops in walk(launch.body) for lp in loops)
    busy = 1.0 if masked else busy_fraction(kernel.grid, rates.sms)
    floor_s = on_unit / (loop["tflops"] * 1e12 * busy)
    out.update(busy=round(busy, 4), floor_s=floor_s, tflops=total / floor_s / 1e12)
    return out


def launch_chain(plan, hardware):
    """The chain the model prices a launch's plan with (:func:`napkin_dsl.chain.chain_of`), or None
    (no wgmma stream, or a profile whose ``[latency]`` table cannot price it: nor does the model)."""
    try:
        return chain_of(plan, hardware)
    except MissingLatency:
        return None


# ---- the report ---------------------------------------------------------------------------------


def _loop_summary(body: list[Instruction]) -> dict:
    counts = histogram(body)
    tensor = counts.get("tensor", 0)
    return {
        "start": body[0].address,
        "end": body[-1].address,
        "instructions": len(body),
        "classes": _ordered(counts),
        "per_tensor": round(len(body) / tensor, 2) if tensor else None,
    }


def _ordered(counts: collections.Counter) -> dict:
    return {key: counts[key] for key in sorted(counts, key=_key_order)}


def sass_report(compiled: CompiledKernel, ceiling: bool = True) -> dict:
    """Per launch of a compiled kernel: the class histogram of the whole function and of each
    innermost loop, each loop's instructions per tensor-core instruction (None without any), and
    (``ceiling``) the static ceiling of its hot loop beside the model (:func:`launch_ceiling`).

    Counts are static: an instruction counts once however many times it runs.
    """
    if compiled.ptx:
        raise NapkinError(f"kernel {compiled.name} was compiled to PTX, and SASS inspection reads a cubin",
                          hint="compile without ptx=True (drop --ptx)")
    functions = disassemble(compiled.image)
    launches = []
    rates = None if not ceiling else sm_rates(compiled.program.hardware)
    for index, launch in enumerate(compiled.launches):
        if launch.entry not in functions:
            raise RuntimeError(f"nvdisasm listed no function {launch.entry!r} (it listed {sorted(functions)}): a napkin bug")
        instructions = functions[launch.entry]
        used = compiled.resources.get(launch.entry, {})
        bodies = [body for body in innermost_loops(instructions) + tensor_loops(instructions) if body]
        bodies.sort(key=lambda body: body[0].address)
        entry = {
            "entry": launch.entry,
            "registers": used.get("registers"),
            "spill_bytes": used.get("spill_bytes"),
            "instructions": len(instructions),
            "whole": _ordered(histogram(instructions)),
            "loops": [_loop_summary(body) for body in bodies],
        }
        hottest = hot_loop(entry)
        body = bodies[entry["loops"].index(hottest)] if hottest is not None else None
        if launch.roles:
            entry["roles"] = roles_summary(instructions, body)
        if ceiling:
            entry["ceiling"] = launch_ceiling(compiled, index, body, instructions, rates)
        launches.append(entry)
    out = {"kernel": compiled.name, "arch": compiled.arch, "launches": launches}
    if ceiling:
        out["hardware"] = compiled.program.hardware.name
    return out


def roles_summary(instructions: list[Instruction], consumer: list[Instruction] | None) -> dict:
    """A warp-specialized launch's roles in its SASS (backends/pipeline.py): the register moves
    (``USETMAXREG``: the producer's DEALLOC, the consumers' TRY_ALLOC, each with its count), the
    consumers' loop (the hot loop: its HGMMAs or QGMMAs, the depths its ``WARPGROUP.DEPBAR``
    waits leave in flight, the UTMALDGs and block barriers it should not have, and the named
    barriers among the consumers its chunk's vectors take) and the producer's (the loop, closed by
    a conditional branch, with the most UTMALDGs and no wgmma)."""
    moves = {i.opcode.split(".")[1]: int(i.operands.split(",")[-1].strip(), 16)
             for i in instructions if i.base == "USETMAXREG"}
    out: dict = {"setmaxnreg": moves}
    if consumer:
        out["consumer_loop"] = {
            "start": consumer[0].address, "end": consumer[-1].address, "instructions": len(consumer),
            "hgmma": sum(i.base in WARPGROUP_MMA for i in consumer),
            "wait_depths": [int(i.operands.split(",")[-1].strip(), 16) for i in consumer if i.opcode == "WARPGROUP.DEPBAR.LE"],
            "utmaldg": sum(i.base == "UTMALDG" for i in consumer),
            "block_barriers": sum(i.base == "BAR" and _barrier_id(i) == 0 for i in consumer),
            "consumer_barriers": sum(i.base == "BAR" and _barrier_id(i) != 0 for i in consumer)}
    producers = [body for body in closed_loops(instructions) if not any(i.base in WARPGROUP_MMA for i in body)
                 and any(i.base == "UTMALDG" for i in body)]
    if producers:
        body = max(producers, key=lambda b: (sum(i.base == "UTMALDG" for i in b), -len(b)))
        out["producer_loop"] = {"start": body[0].address, "end": body[-1].address, "instructions": len(body),
                                "utmaldg": sum(i.base == "UTMALDG" for i in body)}
    return out


WARPGROUP_MMA = ("HGMMA", "QGMMA")  # wgmma in SASS: 16-bit and 8-bit operands


def _barrier_id(instruction: Instruction) -> int | None:
    """A BAR's barrier: 0 (``BAR.SYNC 0x0`` or no operand), the block's; else a named one (the
    consumers' ``bar.sync 1, n``); None where the operand is a register."""
    first = instruction.operands.split(",")[0].strip()
    if not first:
        return 0
    try:
        return int(first, 16)
    except ValueError:
        return None


def format_roles(roles: dict) -> list[str]:
    """The roles of :func:`roles_summary` as lines of text."""
    moves = " and ".join(f"USETMAXREG.{kind} {count}" for kind, count in roles["setmaxnreg"].items()) or "no USETMAXREG"
    lines = [f"  roles: {moves}"]
    consumer = roles.get("consumer_loop")
    if consumer:
        depths = ", ".join(str(d) for d in consumer["wait_depths"]) or "none"
        lines.append(f"    consumers' loop {consumer['start']:04x}-{consumer['end']:04x}: {consumer['instructions']} instructions, "
                     f"{consumer['hgmma']} HGMMA/QGMMA, wgmma waits to depth {depths}, {consumer['utmaldg']} UTMALDG, "
                     f"{consumer['block_barriers']} block barriers, {consumer['consumer_barriers']} among the consumers")
    producer = roles.get("producer_loop")
    if producer:
        lines.append(f"    producer's loop {producer['start']:04x}-{producer['end']:04x}: {producer['instructions']} instructions, "
                     f"{producer['utmaldg']} UTMALDG")
    return lines


def hot_loop(report_entry: dict) -> dict | None:
    """The main loop of one launch of :func:`sass_report`: the innermost loop (or the loop the MMAs
    run in around nested copy loops, :func:`tensor_loops`) with the most
    tensor-core instructions, then the most FFMAs, then the most instructions; None when the
    function has no loop.

    Contraction work comes first because the longest loop is not the main one: without tensor
    cores, matmul's epilogue store loop (address arithmetic per element) is longer than its
    FFMA loop over the k tile, and attention's softmax loop (FMNMX, FADD, MUFU, shuffles) is
    longer than its Q K^T and P V loops, which run far more often.
    """
    def weight(loop: dict) -> tuple:
        return loop["classes"].get("tensor", 0), loop["classes"].get("ffma", 0), loop["instructions"]

    return max(report_entry["loops"], key=weight, default=None)


def format_sass_report(report: dict) -> str:
    """A plain-text table per launch: the whole function, then each innermost loop (the
    hottest marked ``*``), one column per class that occurs."""
    lines = [f"SASS of {report['kernel']} for {report['arch']} (static counts: each instruction once)"]
    for entry in report["launches"]:
        lines.append("")
        lines.append(f"{entry['entry']}: {entry['instructions']} instructions, {entry['registers']} registers, "
                     f"{entry['spill_bytes']} B spilled, {len(entry['loops'])} innermost loop{'s' if len(entry['loops']) != 1 else ''}")
        keys = sorted(set(entry["whole"]).union(*(loop["classes"] for loop in entry["loops"])), key=_key_order)
        hottest = hot_loop(entry)
        rows = [["", "instrs", *keys, "per tensor"]]
        tensor = entry["whole"].get("tensor", 0)
        per_tensor = f"{entry['instructions'] / tensor:.2f}" if tensor else "-"
        rows.append(["whole", str(entry["instructions"]), *(str(entry["whole"].get(k, "")) for k in keys), per_tensor])
        for loop in entry["loops"]:
            mark = "*" if loop is hottest else " "
            per_tensor = "-" if loop["per_tensor"] is None else f"{loop['per_tensor']:.2f}"
            rows.append([f"{mark}loop {loop['start']:04x}-{loop['end']:04x}", str(loop["instructions"]),
                         *(str(loop["classes"].get(k, "")) for k in keys), per_tensor])
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        for row in rows:
            cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=False)]
            lines.append("  " + "  ".join(cells).rstrip())
        if hottest is not None:
            lines.append("  * the hot loop: the innermost loop with the most tensor, then FFMA, instructions")
        if "roles" in entry:
            lines.extend(format_roles(entry["roles"]))
        if entry.get("ceiling") is not None:
            lines.extend(format_ceiling(entry["ceiling"], report.get("hardware")))
    return "\n".join(lines)


def _tflops(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_ceiling(ceiling: dict, hardware: str | None = None) -> list[str]:
    """The lines ``napkin cuda --sass`` prints for one launch's :func:`launch_ceiling`: clocks per
    iteration on each resource, the binding one (``*``), and the ceiling beside the model."""
    loop = ceiling["loop"]
    on = f" on {hardware}" if hardware else ""
    if loop is None:
        return [f"  static ceiling{on}: none (no loop, and no {ceiling['unit']} instructions to price)"]
    where = "the whole function (no loop holds them)" if ceiling["whole_function"] else f"loop {loop['start']:04x}-{loop['end']:04x}"
    lines = [f"  static ceiling{on}, {where}: clocks per iteration of the block's {loop['warps']} warps on one SM "
             f"({loop['blocks_per_sm']} block{'s' if loop['blocks_per_sm'] != 1 else ''} per SM"
             + (f", busiest sub-partition {loop['imbalance']:.2f}x the mean" if loop["imbalance"] != 1 else "") + ")"]
    for resource in RESOURCES:
        mark = "*" if resource == loop["binding"] else " "
        lines.append(f"   {mark}{resource:<7}{loop['clocks'][resource]:>10.1f}")
    flops = f"{loop['flops']:,} {'tensor' if loop['unit'] == 'tensor' else 'FP32'} FLOPs an iteration"
    lines.append(f"    bound by {loop['binding']}: {flops}, {_tflops(loop['tflops'])} TFLOP/s in this code")
    if ceiling["tflops"] is not None:
        lines.append(f"    the launch: at most {_tflops(ceiling['tflops'])} TFLOP/s ({ceiling['busy']:.2f} of the SMs busy); "
                     f"the model predicts {_tflops(ceiling['model_tflops'])}")
    if ceiling.get("inner_loops"):
        lines.append(f"    {ceiling['inner_loops']} loop{'s' if ceiling['inner_loops'] != 1 else ''} inside it, counted once each here "
                     f"(an implicit GEMM's gathers, an epilogue's passes): the clocks are at least these, the ceiling at most this")
    if loop["unpriced"]:
        lines.append(f"    not priced (no rate in the profile): {', '.join(f'{n} {op}' for op, n in loop['unpriced'].items())}")
    return lines
