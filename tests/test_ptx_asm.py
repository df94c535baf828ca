"""The CUDA code's inline PTX tied to the PTX ISA, on a CPU (issue 25, item 5).

NVRTC compiles a swapped operand without complaint and the SASS counts do not change: only the
numbers would, on a GPU. So this test parses every inline ``asm`` statement in the backends'
source (the CUDA prelude of ``tensorcore.py`` and any asm added anywhere under
``napkin_dsl/backends``), and checks it against the PTX ISA's operand lists written here:

* each instruction is one this file knows (a new one, wgmma or TMA, fails until its operand list
  and its checks are added here);
* its operand groups have the ISA's sizes, each operand the register class the ISA's type needs
  ("r" for .b32 and 32-bit shared addresses, "l" for 64-bit global addresses, "f" for .f32,
  "n" for immediates), and the C arguments bound in the ISA's order;
* what one warp computes with the printer's code: ldmatrix emulated from the ISA's wording with
  the addresses the printer's lanes give, the registers passed through the asm's operand binding
  into mma, the mma emulated from the ISA's fragment formulas (written below, from the PTX ISA,
  "Matrix Fragments for mma.m16n8k16 with floating point type", not from napkin's layouts), and
  the accumulators read back where the printer reads them: the product must be A B, for A from
  shared memory (plain and .trans), A from registers (P packed from accumulators, as the printer
  packs it), and B plain and .trans.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import layouts
from napkin_dsl.backends import cuda, pipeline, tensorcore, wgmma

from .conftest import EXAMPLES
from .test_layouts import isa_a, isa_b, isa_c

BACKENDS = Path(tensorcore.__file__).resolve().parent

# ---- the PTX ISA: its fragment formulas, written out once in tests/test_layouts.py -------------
# lane = %laneid, g = lane >> 2, t = lane % 4


# Operand lists: (group name, registers in the group, constraint). A group of 1 without braces is
# a scalar operand; "addr" is a [bracketed] address; "imm" an immediate written in the template.
FP8_TYPES = ("e4m3", "e5m2")  # the 8-bit types tensorcore.py prints its fp8 wrappers for
ISA = {
    "ldmatrix.sync.aligned.m8n8.x4.shared.b16": [("d", 4, "=r"), ("addr", 1, "r")],
    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16": [("d", 4, "=r"), ("addr", 1, "r")],
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32": [("d", 4, "+f"), ("a", 4, "r"), ("b", 2, "r"), ("c", 4, "+f")],
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32": [("d", 4, "+f"), ("a", 4, "r"), ("b", 2, "r"), ("c", 4, "+f")],
    # cp.async.cg.shared.global [dst], [src], cp-size{, src-size}: .cg copies exactly 16 bytes;
    # a src-size below cp-size fills the rest of dst with zeros
    "cp.async.cg.shared.global": [("dst", 1, "r"), ("src", 1, "l"), ("cp-size", 1, "imm"), ("src-size", 1, "r")],
    "cp.async.commit_group": [],
    "cp.async.wait_group": [("N", 1, "n")],
    "ex2.approx.ftz.f32": [("d", 1, "=f"), ("a", 1, "f")],
    # PTX ISA 9.7.9.21 mma with .e4m3/.e5m2 (sm_89+): m16n8k32 .row.col, A four .b32 registers of
    # four 8-bit values each, B two, C and D four f32; {t} is e4m3 or e5m2 (printed per plan)
    **{f"mma.sync.aligned.m16n8k32.row.col.f32.{t}.{t}.f32": [("d", 4, "+f"), ("a", 4, "r"), ("b", 2, "r"), ("c", 4, "+f")]
       for t in FP8_TYPES},
    # PTX ISA 9.7.9.21 cvt: cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 d, a, b; d a .b16 of two 8-bit
    # values (a's in the upper byte), a and b f32
    **{f"cvt.rn.satfinite.{t}x2.f32": [("d", 1, "=h"), ("a", 1, "f"), ("b", 1, "f")] for t in FP8_TYPES},
    # PTX ISA 9.7.15: fence.proxy.async (9.7.13.4 membar/fence), wgmma.fence, commit_group, wait_group N
    "fence.proxy.async.shared::cta": [],
    "wgmma.fence.sync.aligned": [],
    "wgmma.commit_group.sync.aligned": [],
    "wgmma.wait_group.sync.aligned": [("N", 1, "n")],
    # PTX ISA 9.7.13.15 mbarrier: mbarrier.init.shared::cta.b64 [addr], count;
    # mbarrier.arrive.expect_tx.shared::cta.b64 state, [addr], txCount (state the sink _);
    # mbarrier.try_wait.parity.shared::cta.b64 waitComplete, [addr], phaseParity (a predicate,
    # which the block's selp.u32 d, 1, 0, p turns into a register); fence.mbarrier_init.release.cluster
    "mbarrier.init.shared::cta.b64": [("addr", 1, "r"), ("count", 1, "r")],
    "mbarrier.arrive.expect_tx.shared::cta.b64": [("state", 1, "imm"), ("addr", 1, "r"), ("txCount", 1, "r")],
    "mbarrier.try_wait.parity.shared::cta.b64": [("waitComplete", 1, "pred"), ("addr", 1, "r"), ("phaseParity", 1, "r")],
    "selp.u32": [("d", 1, "=r"), ("a", 1, "imm"), ("b", 1, "imm"), ("c", 1, "pred")],
    "fence.mbarrier_init.release.cluster": [],
    # a consumer's release of a stage (9.7.13.15.13): mbarrier.arrive.shared::cta.b64 state, [addr]
    # (state the sink _); setmaxnreg.{inc,dec}.sync.aligned.u32 imm-reg-count (9.7.17.1)
    "mbarrier.arrive.shared::cta.b64": [("state", 1, "imm"), ("addr", 1, "r")],
    "setmaxnreg.inc.sync.aligned.u32": [("imm-reg-count", 1, "n")],
    "setmaxnreg.dec.sync.aligned.u32": [("imm-reg-count", 1, "n")],
    # a barrier among the consumer warpgroups (9.7.13.1): bar.sync a, b; a the barrier's id, b the threads;
    # bar.arrive a, b the same operands, arriving without waiting (pingpong's turns)
    "bar.sync": [("a", 1, "n"), ("b", 1, "n")],
    "bar.arrive": [("a", 1, "n"), ("b", 1, "n")],
    # PTX ISA 9.7.9.25 cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes
    # [dstMem], [tensorMap, {tensorCoords}], [mbar]: the map a 64-bit generic address, two 32-bit coordinates
    "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes": [
        ("dst", 1, "r"), ("tensor", 3, ("l", "r", "r")), ("mbar", 1, "r")],
}
# .3d .. .5d: as .2d, one more 32-bit coordinate a dimension in the {tensorCoords} vector
for _rank in (3, 4, 5):
    ISA[f"cp.async.bulk.tensor.{_rank}d.shared::cluster.global.mbarrier::complete_tx::bytes"] = [
        ("dst", 1, "r"), ("tensor", 1 + _rank, ("l",) + ("r",) * _rank), ("mbar", 1, "r")]
ADDRESSES = ("addr", "dst", "src", "mbar", "tensor")  # operands written [in brackets]
# wgmma.mma_async.sync.aligned.m64nNk16.f32.atype.btype d, a-desc, b-desc, scale-d, imm-scale-a,
# imm-scale-b, imm-trans-a, imm-trans-b (PTX ISA 9.7.15.5.2): d is N/2 .f32 registers, the
# descriptors 64-bit, the rest immediates. The shapes the printer's wrapper is printed for here:
WGMMA_SHAPES = [(128, "bf16", False, True), (8, "f16", False, False), (256, "bf16", True, True)]
for _n, _dtype, _ta, _tb in WGMMA_SHAPES:
    ISA[f"wgmma.mma_async.sync.aligned.m64n{_n}k16.f32.{_dtype}.{_dtype}"] = [
        ("d", _n // 2, "+f"), ("a-desc", 1, "l"), ("b-desc", 1, "l"), ("scale-d", 1, "imm"), ("imm-scale-a", 1, "imm"),
        ("imm-scale-b", 1, "imm"), ("imm-trans-a", 1, "imm"), ("imm-trans-b", 1, "imm")]

# With A from registers (P of attention): d, a, b-desc, scale-d, imm-scale-a, imm-scale-b,
# imm-trans-b; a is four .b32 registers of 16-bit pairs, and A has no transpose.
WGMMA_RS_SHAPES = [(64, "bf16", False, True, True), (16, "f16", False, False, True)]
for _n, _dtype, _ta, _tb, _ in WGMMA_RS_SHAPES:
    ISA[f"wgmma.mma_async.sync.aligned.m64n{_n}k16.f32.{_dtype}.{_dtype}"] = [
        ("d", _n // 2, "+f"), ("a", 4, "r"), ("b-desc", 1, "l"), ("scale-d", 1, "imm"), ("imm-scale-a", 1, "imm"),
        ("imm-scale-b", 1, "imm"), ("imm-trans-b", 1, "imm")]


WGMMA_PRELUDE = wgmma.prelude("cuda", WGMMA_SHAPES + WGMMA_RS_SHAPES, tma=True)  # the TMA and mbarrier wrappers too


# ---- parsing the asm statements of the C source ------------------------------------------------


def balanced(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at ``start``."""
    depth, quoted = 0, False
    for i in range(start, len(text)):
        ch = text[i]
        if quoted:
            quoted = not (ch == '"' and text[i - 1] != "\\")
        elif ch == '"':
            quoted = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    raise AssertionError(f"unbalanced parentheses from {text[start:start + 80]!r}")


def top_level_split(text: str, sep: str) -> list[str]:
    parts, depth, quoted, current = [], 0, False, ""
    for i, ch in enumerate(text):
        if quoted:
            quoted = not (ch == '"' and text[i - 1] != "\\")
        elif ch == '"':
            quoted = True
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += ch
    parts.append(current)
    return parts


def asm_statements(source: str) -> list[dict]:
    """Every ``asm [volatile] ("template" : outputs : inputs)`` in C source: the instruction, its
    operand groups (lists of %N indices, or a literal), and the (constraint, expression) of each %N."""
    found = []
    for match in re.finditer(r"\basm\s*(?:volatile\s*)?\(", source):
        start = match.end() - 1
        body = source[start + 1:balanced(source, start) - 1]
        sections = top_level_split(body, ":")
        template = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', sections[0])).replace("\\n", "").strip().rstrip(";")
        operands = []
        for section in sections[1:3]:
            for item in top_level_split(section, ","):
                item = item.strip()
                if item:
                    constraint, expression = re.fullmatch(r'"([^"]*)"\s*\((.*)\)', item, re.S).groups()
                    operands.append((constraint, " ".join(expression.split())))
        # A { scoped block } (a predicate declared and turned into a register) is its instructions,
        # each a statement of the block's operands; the .reg declarations are not instructions.
        block = template.startswith("{")
        instructions = [t.strip() for t in template.strip("{}").split(";")] if block else [template]
        for text in instructions:
            if not text or text.startswith(".reg"):
                continue
            instruction, _, rest = text.partition(" ")
            groups = []
            for part in top_level_split(rest, ","):
                part = part.strip()
                if not part:
                    continue
                indices = [int(n) for n in re.findall(r"%(\d+)", part)]
                kind = "addr" if part.startswith("[") else ("vector" if part.startswith("{") else ("imm" if not indices else "scalar"))
                groups.append((kind, indices, part))
            found.append({"instruction": instruction, "groups": groups, "operands": operands, "template": text,
                          "block": template if block else None, "function": enclosing_function(source, match.start())})
    return found


def enclosing_function(source: str, at: int) -> tuple[str, list[str]] | None:
    """(name, parameter names) of the C function the asm at ``at`` is in, or None (a macro)."""
    heads = list(re.finditer(r"__device__ __forceinline__ \w+\s+(\w+)\(([^)]*)\)\s*\{", source[:at]))
    if not heads or source.rfind("\n}", heads[-1].end(), at) != -1:
        return None
    params = [re.findall(r"(\w+)\s*(?:\[\d*\])?$", p.strip())[0] for p in heads[-1].group(2).split(",") if p.strip()]
    return heads[-1].group(1), params


def all_asm() -> list[dict]:
    statements = []
    for path in sorted(BACKENDS.glob("*.py")):
        # wgmma.py prints its wrappers per shape (an f-string in its source): read them printed
        text = WGMMA_PRELUDE if path.name == "wgmma.py" else path.read_text()
        for s in asm_statements(text):
            # tensorcore.py's fp8 wrappers are an f-string over the 8-bit types: one each
            for t in FP8_TYPES if "{t}" in s["instruction"] else (None,):
                statements.append({**s, "file": path.name} if t is None
                                  else {**s, "instruction": s["instruction"].replace("{t}", t), "file": path.name})
    return statements


CUDA_ASM = (asm_statements(tensorcore.CUDA_PRELUDE) + asm_statements(tensorcore.FP8_PRELUDES["cuda"])
            + asm_statements(WGMMA_PRELUDE) + asm_statements(pipeline.prelude("cuda")))


def by_function(name: str) -> dict:
    (found,) = [s for s in CUDA_ASM if s["function"] and s["function"][0] == name]
    return found


def macros(source: str) -> dict:
    return {m.group(1): m.group(3).strip() for m in re.finditer(r"#define (\w+)\(([^)]*)\) (.*)", source)}


# ---- the operand lists --------------------------------------------------------------------------


def test_every_inline_asm_is_an_instruction_this_test_checks():
    """A new asm (wgmma, TMA, ...) fails here until its ISA operand list is written above."""
    statements = all_asm()
    assert {s["instruction"] for s in statements} == set(ISA), sorted({s["instruction"] for s in statements})
    assert all(s["file"] in ("tensorcore.py", "wgmma.py", "pipeline.py") for s in statements)  # where CUDA_ASM reads them from
    assert len(CUDA_ASM) == len(statements)


@pytest.mark.parametrize("statement", CUDA_ASM, ids=lambda s: s["instruction"] + (f"@{s['function'][0]}" if s["function"] else ""))
def test_operands_have_the_isas_groups_and_register_classes(statement):
    spec = ISA[statement["instruction"]]
    groups = statement["groups"]
    assert len(groups) == len(spec), statement["template"]
    operands = statement["operands"]
    used = set()
    for (name, count, constraint), (kind, indices, text) in zip(spec, groups, strict=True):
        if constraint == "imm":
            assert kind == "imm" and not indices, (name, text)
            continue
        if constraint == "pred":  # the block's own predicate register
            assert statement["block"] and ".reg .pred p;" in statement["block"] and text == "p", (name, text)
            continue
        assert len(indices) == count, (name, text)
        assert kind == ("addr" if name in ADDRESSES else "vector" if count > 1 else "scalar"), (name, text)
        constraints = constraint if isinstance(constraint, tuple) else (constraint,) * count
        for index, wanted in zip(indices, constraints, strict=True):
            assert operands[index][0] == wanted, (name, index, operands[index])
        used.update(indices)
    if statement["block"]:  # the block's instructions share its operands: together they bind them all
        used = {int(n) for n in re.findall(r"%(\d+)", statement["block"])}
    assert used == set(range(len(operands))), "every bound operand appears in the template"


def test_mma_binds_d_a_b_c_to_the_arguments_in_the_isas_order():
    for name in ("nk_mma_bf16", "nk_mma_f16"):
        s = by_function(name)
        (_, d, _), (_, a, _), (_, b, _), (_, c, _) = s["groups"]
        expr = [e for _, e in s["operands"]]
        assert [expr[i] for i in d] == ["c[0]", "c[1]", "c[2]", "c[3]"]
        assert [expr[i] for i in a] == ["a[0]", "a[1]", "a[2]", "a[3]"]
        assert [expr[i] for i in b] == ["b0", "b1"]
        assert c == d  # accumulate in place: C is D
        assert s["function"][1] == ["c", "a", "b0", "b1"]
    assert ".bf16.bf16." in by_function("nk_mma_bf16")["instruction"] and ".f16.f16." in by_function("nk_mma_f16")["instruction"]


def test_ldmatrix_binds_its_four_registers_in_order_and_trans_only_where_named():
    for name, trans in (("nk_ldsm_x4", False), ("nk_ldsm_x4_t", True)):
        s = by_function(name)
        (_, d, _), (_, addr, _) = s["groups"]
        expr = [e for _, e in s["operands"]]
        assert [expr[i] for i in d] == ["r[0]", "r[1]", "r[2]", "r[3]"]
        assert [expr[i] for i in addr] == ["addr"] and s["function"][1] == ["r", "addr"]
        assert (".trans." in s["instruction"]) == trans
    defined = macros(tensorcore.CUDA_PRELUDE)
    assert defined["NK_LDSM"] == "nk_ldsm_x4((r), nk_sbase + (off))"
    assert defined["NK_LDSM_T"] == "nk_ldsm_x4_t((r), nk_sbase + (off))"
    assert defined["NK_MMA_BF16"] == "nk_mma_bf16((c), (a), (b0), (b1))"
    assert defined["NK_MMA_F16"] == "nk_mma_f16((c), (a), (b0), (b1))"


def test_cp_async_copies_16_bytes_to_the_shared_address_zero_filling_the_masked_tail():
    s = by_function("nk_cp16")
    (_, dst, _), (_, src, _), (_, _, size), (_, src_size, _) = s["groups"]
    expr = [e for _, e in s["operands"]]
    assert s["function"][1] == ["dst", "src", "valid"]
    assert [expr[i] for i in dst] == ["dst"] and [expr[i] for i in src] == ["src"]
    assert size == "16"  # .cg: cp-size 16 only
    (src_size_expr,) = [expr[i] for i in src_size]
    # src-size 16 for a valid chunk, 0 (all zeros, nothing read) for one past the end of the array
    assert re.fullmatch(r"(\w+) \? (\d+) : (\d+)", src_size_expr).groups() == ("valid", "16", "0")
    assert macros(tensorcore.CUDA_PRELUDE)["NK_CP16"] == "nk_cp16(nk_sbase + (off), (src), (valid))"  # dst: the shared window
    waits = [s for s in CUDA_ASM if s["instruction"] == "cp.async.wait_group"]
    assert [s["operands"] for s in waits] == [[("n", "n")]]  # an immediate: the groups left in flight


@pytest.mark.parametrize("shape", WGMMA_SHAPES, ids=str)
def test_wgmma_binds_d_in_order_the_descriptors_and_the_transposes_it_was_printed_for(shape):
    n, dtype, trans_a, trans_b = shape
    (s,) = [s for s in asm_statements(wgmma.cuda_wrapper(*shape))]
    (_, d, _), (_, a, _), (_, b, _), (_, _, scale_d), (_, _, scale_a), (_, _, scale_b), (_, _, ta), (_, _, tb) = s["groups"]
    expr = [e for _, e in s["operands"]]
    assert [expr[i] for i in d] == [f"d[{v}]" for v in range(n // 2)]  # value v of the D fragment (layouts.wgmma_d)
    assert [expr[i] for i in a] == ["da"] and [expr[i] for i in b] == ["db"]
    assert s["function"] == (wgmma.wrapper_name(*shape), ["d", "da", "db"])
    assert (scale_d, scale_a, scale_b) == ("1", "1", "1")  # D = A B + D, no negation
    assert (ta, tb) == (str(int(trans_a)), str(int(trans_b)))  # 1: the operand is MN-major in shared memory
    assert f".f32.{dtype}.{dtype}" in s["instruction"] and f".m64n{n}k16." in s["instruction"]
    waits = [s for s in CUDA_ASM if s["instruction"] == "wgmma.wait_group.sync.aligned"]
    assert [s["operands"] for s in waits] == [[("n", "n")]]


@pytest.mark.parametrize("shape", WGMMA_RS_SHAPES, ids=str)
def test_wgmma_with_a_from_registers_binds_d_a_in_order_and_the_b_transpose(shape):
    n, dtype, _, trans_b, _ = shape
    (s,) = [s for s in asm_statements(wgmma.cuda_wrapper(*shape))]
    (_, d, _), (_, a, _), (_, b, _), (_, _, scale_d), (_, _, scale_a), (_, _, scale_b), (_, _, tb) = s["groups"]
    expr = [e for _, e in s["operands"]]
    assert [expr[i] for i in d] == [f"d[{v}]" for v in range(n // 2)]
    assert [expr[i] for i in a] == [f"a[{j}]" for j in range(4)]  # a0..a7 low to high: register j holds a_2j, a_2j+1
    assert [expr[i] for i in b] == ["db"]
    assert s["function"] == (wgmma.wrapper_name(*shape), ["d", "a", "db"])
    assert (scale_d, scale_a, scale_b, tb) == ("1", "1", "1", str(int(trans_b)))
    assert f".f32.{dtype}.{dtype}" in s["instruction"] and f".m64n{n}k16." in s["instruction"]


def test_ex2_writes_its_result_and_reads_its_argument():
    s = by_function("nk_exp2")
    (_, d, _), (_, a, _) = s["groups"]
    expr = [e for _, e in s["operands"]]
    assert [expr[i] for i in d] == ["y"] and [expr[i] for i in a] == ["x"]


# ---- one warp, emulated: the printer's registers through the asm into the ISA's mma -----------


def ldmatrix(stored: np.ndarray, operand: str, trans: bool, origin=(0, 0)) -> list[list[tuple]]:
    """What ldmatrix.x4 (.trans) gives each lane (PTX ISA, "ldmatrix"): lanes 8j..8j+7 supply the
    addresses of the eight 16-byte rows of matrix j (here: the rows napkin's lanes point at,
    layouts.ldmatrix_source); without .trans lane l receives in register j row l >> 2, elements
    2(l % 4) and 2(l % 4) + 1 of matrix j; with .trans, element l >> 2 of rows 2(l % 4) and
    2(l % 4) + 1. A register is (low half, high half)."""
    r0, c0 = origin
    rows = {}
    for lane in range(32):
        row, col = layouts.ldmatrix_source(lane, operand, trans)
        rows[lane] = stored[r0 + row, c0 + col:c0 + col + 8]
    # the C registers r[0..3] each PTX destination d_j is bound to, in the prelude's asm
    statement = by_function("nk_ldsm_x4_t" if trans else "nk_ldsm_x4")
    expr = [e for _, e in statement["operands"]]
    targets = [int(re.fullmatch(r"r\[(\d)\]", expr[index]).group(1)) for index in statement["groups"][0][1]]
    regs = []
    for lane in range(32):
        mine = [None] * 4
        for j in range(4):
            if not trans:
                row = rows[8 * j + (lane >> 2)]
                mine[targets[j]] = (row[2 * (lane % 4)], row[2 * (lane % 4) + 1])
            else:
                mine[targets[j]] = (rows[8 * j + 2 * (lane % 4)][lane >> 2], rows[8 * j + 2 * (lane % 4) + 1][lane >> 2])
        regs.append(mine)
    return regs


def bound(statement: dict, group: int, arguments: dict) -> list:
    """The values the asm's operand group ``group`` receives, given the C arguments by name."""
    expr = [e for _, e in statement["operands"]]
    values = []
    for index in statement["groups"][group][1]:
        name, _, subscript = expr[index].partition("[")
        values.append(arguments[name][int(subscript.rstrip("]"))] if subscript else arguments[name])
    return values


def mma_warp(statement: dict, a_regs, b_regs, c_init) -> list[list[float]]:
    """The warp's mma through ``statement``'s operand binding: per lane the C arguments
    (a[4] registers, b0 and b1, c[4]) -> the PTX operands -> the fragments by the ISA's formulas
    -> D = A B + C -> back to c[0..3] through the binding."""
    A = np.full((16, 16), np.nan)
    B = np.full((16, 8), np.nan)
    C = np.full((16, 8), np.nan)
    for lane in range(32):
        args = {"a": a_regs[lane], "b0": b_regs[lane][0], "b1": b_regs[lane][1], "c": c_init[lane]}
        for k, (lo, hi) in enumerate(bound(statement, 1, args)):  # register k holds a_2k (low), a_2k+1
            A[isa_a(lane, 2 * k)], A[isa_a(lane, 2 * k + 1)] = lo, hi
        for k, (lo, hi) in enumerate(bound(statement, 2, args)):
            B[isa_b(lane, 2 * k)], B[isa_b(lane, 2 * k + 1)] = lo, hi
        for i, value in enumerate(bound(statement, 3, args)):
            C[isa_c(lane, i)] = value
    assert not (np.isnan(A).any() or np.isnan(B).any() or np.isnan(C).any()), "a fragment element no register fills"
    D = A @ B + C
    out = []
    expr = [e for _, e in statement["operands"]]
    for lane in range(32):
        c = [None] * 4
        for i, index in enumerate(statement["groups"][0][1]):
            name, _, subscript = expr[index].partition("[")
            assert name == "c"
            c[int(subscript.rstrip("]"))] = D[isa_c(lane, i)]
        out.append(c)
    return out


def read_back(c_regs) -> np.ndarray:
    """The 16 x 8 tile as the printer reads its accumulators: c[i] of a lane at layouts.mma_c."""
    tile = np.full((16, 8), np.nan)
    for lane in range(32):
        for i in range(4):
            tile[layouts.mma_c(lane, i)] = c_regs[lane][i]
    return tile


def printed_calls(source: str) -> dict:
    """From a printed kernel: which ldmatrix registers feed each n-tile's mma, and how P's
    accumulators are packed into A registers."""
    calls = re.findall(r"NK_MMA_BF16\(\w+\[mt\]\[2 \* np( \+ 1)?\], a\[mt\], b\[(\d)\], b\[(\d)\]\);", source)
    pairs = {1 if plus else 0: (int(b0), int(b1)) for plus, b0, b1 in calls}
    packs = {}
    for reg, n1, i1, n2, i2 in re.findall(r"a\[mt\]\[(\d)\] = NK_PACK_BF16\(\w+\[mt\]\[2 \* kk( \+ 1)?\]\[(\d)\], "
                                          r"\w+\[mt\]\[2 \* kk( \+ 1)?\]\[(\d)\]\);", source):
        packs[int(reg)] = ((1 if n1 else 0, int(i1)), (1 if n2 else 0, int(i2)))
    # P packed by its exponentials (TensorPrinter.packed_fragments): pk = pack(p0, p1), p_e the value
    # i = <expr in h> of the pair h, stored as P[mt][nt][h]; the product takes P[mt][2 kk (+ 1)][h]
    values = re.findall(r"const int i = ([^;]+);\s*p(\d) = ", source)
    if not packs and values and "= NK_PACK_BF16(p0, p1);" in source:
        pair = {int(e): expr for expr, e in values[:2]}
        for reg, n, h in re.findall(r"a\[mt\]\[(\d)\] = \w+\[mt\]\[2 \* kk( \+ 1)?\]\[(\d)\];", source):
            lo, hi = (eval(pair[e], {"h": int(h)}) for e in (0, 1))
            packs[int(reg)] = ((1 if n else 0, lo), (1 if n else 0, hi))
    return {"pairs": pairs, "packs": packs}


@pytest.fixture(scope="module")
def attention_source():
    (kernel,) = napkin.load(EXAMPLES / "attention.napkin").values()
    # mma.sync's fragments: the H100 profile's own arch, sm_90a, builds wgmma for attention
    source, _ = cuda.generate(kernel.gpu_program(None, b=1, h=1, q=128, x=64, d=64), arch="sm_90")
    return source


@pytest.mark.parametrize("b_trans", [False, True])
@pytest.mark.parametrize("a_source", ["smem", "smem .trans", "registers"])
def test_one_warps_product_through_the_printed_code_and_the_asm_is_a_times_b(a_source, b_trans, attention_source):
    rng = np.random.default_rng(7)
    A = rng.integers(-4, 5, size=(16, 16)).astype(np.float64)
    B = rng.integers(-4, 5, size=(16, 16)).astype(np.float64)  # k x n: two n-tiles of 8
    C = rng.integers(-4, 5, size=(16, 16)).astype(np.float64)
    printed = printed_calls(attention_source)
    assert printed["pairs"] == {0: (0, 1), 1: (2, 3)} and len(printed["packs"]) == 4
    if a_source == "registers":
        # P: the accumulators of a previous product over two n-tiles (16 columns = this k step),
        # packed as the printer packs them
        acc = [[[A[layouts.mma_c(lane, i)[0], 8 * nt + layouts.mma_c(lane, i)[1]] for i in range(4)] for nt in range(2)]
               for lane in range(32)]
        a_regs = [[(acc[lane][n1][i1], acc[lane][n2][i2]) for _, ((n1, i1), (n2, i2)) in sorted(printed["packs"].items())]
                  for lane in range(32)]
    else:  # stored m x k, or k x m (.trans)
        trans = a_source.endswith(".trans")
        a_regs = ldmatrix(A.T.copy() if trans else A, "a", trans)
    # B stored n x k (K[x d]: its rows are the product's columns), or k x n (V[x d]: .trans)
    b_regs = ldmatrix(B if b_trans else B.T.copy(), "b", b_trans)
    for name in ("nk_mma_bf16", "nk_mma_f16"):
        statement = by_function(name)
        for nt in range(2):
            first, second = printed["pairs"][nt]
            mine = [(regs[first], regs[second]) for regs in b_regs]
            c_init = [[C[layouts.mma_c(lane, i)[0], 8 * nt + layouts.mma_c(lane, i)[1]] for i in range(4)] for lane in range(32)]
            got = read_back(mma_warp(statement, a_regs, mine, c_init))
            np.testing.assert_array_equal(got, A @ B[:, 8 * nt:8 * nt + 8] + C[:, 8 * nt:8 * nt + 8], err_msg=name)


def test_the_emulation_sees_a_swapped_operand():
    """The harness itself: a[1] and a[2] swapped in the binding gives a wrong product."""
    statement = by_function("nk_mma_bf16")
    swapped = dict(statement)
    d, a, b, c = statement["groups"]
    swapped["groups"] = [d, (a[0], [a[1][0], a[1][2], a[1][1], a[1][3]], a[2]), b, c]
    rng = np.random.default_rng(1)
    A, B = rng.integers(-4, 5, size=(16, 16)).astype(np.float64), rng.integers(-4, 5, size=(16, 8)).astype(np.float64)
    a_regs, b_regs = ldmatrix(A, "a", False), ldmatrix(np.concatenate([B, B], axis=1).T.copy(), "b", False)
    zero = [[0.0] * 4 for _ in range(32)]
    mine = [(regs[0], regs[1]) for regs in b_regs]
    assert np.array_equal(read_back(mma_warp(statement, a_regs, mine, zero)), A @ B)
    assert not np.array_equal(read_back(mma_warp(swapped, a_regs, mine, zero)), A @ B)


def test_tma_and_mbarrier_wrappers_bind_the_isas_operands_in_order():
    """cp.async.bulk.tensor.2d [dst], [map, {c0, c1}], [mbar]: the wrapper's shared destination,
    the tensor map's address, the innermost coordinate first, and the mbarrier; try_wait.parity
    tests the barrier's address with the parity argument, and its predicate becomes the output."""
    for rank in (2, 3, 4, 5):
        copy = by_function(f"nk_tma_{rank}d")
        assert [copy["operands"][i][1] for i in copy["groups"][0][1] + copy["groups"][1][1] + copy["groups"][2][1]] == [
            "dst", "reinterpret_cast<unsigned long long>(map)", *(f"c{i}" for i in range(rank)), "bar"]
    wait = [s for s in CUDA_ASM if s["instruction"] == "mbarrier.try_wait.parity.shared::cta.b64"][0]
    assert [wait["operands"][i][1] for _, indices, _ in wait["groups"] for i in indices] == ["bar", "parity"]
    assert wait["operands"][0] == ("=r", "done")
    expect = by_function("nk_mbar_arrive_expect_tx")
    assert [expect["operands"][i][1] for _, indices, _ in expect["groups"] for i in indices] == ["bar", "bytes"]
