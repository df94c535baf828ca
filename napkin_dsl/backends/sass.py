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

Deliberately not here: timing or any claim about speed (static instruction counts weigh an
instruction once however often it runs, and say nothing about latency or stalls: that is a
profiler's job), register liveness and dependency analysis, control flow beyond backward
branches (loops are address ranges, not a CFG), PTX (it is not what runs), and any assertion
about what a kernel ought to contain: the report counts, tests and people judge.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import NapkinError

if TYPE_CHECKING:
    from .compiled import CompiledKernel

INSTALL_HINT = "pip install 'napkin-dsl[sass]'  (the nvidia-cuda-nvdisasm wheel), or put a CUDA toolkit's nvdisasm on PATH"
# Where the nvidia-cuda-nvdisasm wheel puts the binary inside the ``nvidia`` namespace
# package: CUDA 13 wheels share one cu13/ tree, CUDA 12 wheels had a directory per component.
WHEEL_BINARIES = ("cu13/bin/nvdisasm", "cuda_nvdisasm/bin/nvdisasm")
NVDISASM_TIMEOUT_S = 120


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


def run_nvdisasm(cubin: bytes) -> str:
    """nvdisasm's listing of the code sections of a cubin (``-c``: no ELF headers, no data).

    No ``-g`` (line info), ``-hex`` (encodings) or ``-cfg`` (a graphviz graph instead of a
    listing): the parser wants one instruction per line and nothing else on it.
    """
    if cubin[:4] != b"\x7fELF":
        raise NapkinError("nvdisasm reads cubins (ELF images), and this image is not one", hint="compile without ptx=True / --ptx")
    binary = find_nvdisasm()
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
    r"(?P<opcode>[A-Z][A-Z0-9_.]*)"
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
    # tensor cores: warp-level MMA (sm_80+), warpgroup MMA (sm_90), tcgen05 MMA (sm_100)
    **dict.fromkeys(["HMMA", "IMMA", "DMMA", "BMMA", "HGMMA", "IGMMA", "QGMMA", "BGMMA",
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


def innermost_loops(instructions: list[Instruction]) -> list[list[Instruction]]:
    """The instructions of every loop that contains no other loop, in address order."""
    ranges = loop_ranges(instructions)
    innermost = [(start, end) for start, end in ranges
                 if not any((s, e) != (start, end) and start <= s and e <= end for s, e in ranges)]
    return [[i for i in instructions if start <= i.address <= end] for start, end in innermost]


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


def sass_report(compiled: CompiledKernel) -> dict:
    """Per launch of a compiled kernel: the class histogram of the whole function and of each
    innermost loop, and each loop's instructions per tensor-core instruction (None without any).

    Counts are static: an instruction counts once however many times it runs.
    """
    if compiled.ptx:
        raise NapkinError(f"kernel {compiled.name} was compiled to PTX, and SASS inspection reads a cubin",
                          hint="compile without ptx=True (drop --ptx)")
    functions = disassemble(compiled.image)
    launches = []
    for launch in compiled.launches:
        if launch.entry not in functions:
            raise RuntimeError(f"nvdisasm listed no function {launch.entry!r} (it listed {sorted(functions)}): a napkin bug")
        instructions = functions[launch.entry]
        used = compiled.resources.get(launch.entry, {})
        launches.append({
            "entry": launch.entry,
            "registers": used.get("registers"),
            "spill_bytes": used.get("spill_bytes"),
            "instructions": len(instructions),
            "whole": _ordered(histogram(instructions)),
            "loops": [_loop_summary(body) for body in innermost_loops(instructions) if body],
        })
    return {"kernel": compiled.name, "arch": compiled.arch, "launches": launches}


def hot_loop(report_entry: dict) -> dict | None:
    """The main loop of one launch of :func:`sass_report`: the innermost loop with the most
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
    return "\n".join(lines)
