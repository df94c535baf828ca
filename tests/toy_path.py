"""A toy instruction path that exists only in the tests: mma.sync restricted to one form (bf16
operands, both from shared memory) under another name, ``toy.mma``.

It is the whole of what adding a path takes (docs/architecture.md, "Adding an instruction path"):
this module (its plan type, its legality, the lines that describe it) and a ``[path.toy]`` table
in a profile (its rates). Its plan extends mma.sync's, so mma.sync's printers build it
(``backends.translate.PRINTERS``). ``tests/test_toy_path.py`` registers it and checks that
selection, the model, both printers and ``napkin cuda --resources`` use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from napkin_dsl.paths.mma_sync import MmaSyncPath, MmaSyncPlan
from napkin_dsl.paths.plan import refuse_if

# The profile entry: a [path.*] table whose instruction is this path's.
PROFILE_ENTRY = """
[path.toy]
instruction = "toy.mma"
shape = "m16n8k16"
dtypes = ["bf16"]
archs = ["{arch}"]
rates = {{ bf16 = {rate} }}
"""


@dataclass(frozen=True)
class ToyPlan(MmaSyncPlan):
    """A plan on the toy path: mma.sync's fields, priced as ``toy.mma``."""

    INSTRUCTION = "toy.mma"

    instruction: str = "toy.mma"


class ToyPath(MmaSyncPath):
    instruction = "toy.mma"
    plan_type = ToyPlan

    def build(self, plan, launch, tile, sizes, warp_tiles, arch) -> ToyPlan:
        held = [m.a for m in plan.mmas.values() if m.a_in_registers]
        refuse_if(f"the toy reads A from shared memory only, not {', '.join(held)} from registers" if held else None)
        built = super().build(plan, launch, tile, sizes, warp_tiles, arch)  # mma.sync's own legality
        return ToyPlan(**{**built.common_fields(), "instruction": "toy.mma"}, rolled=built.rolled)

    def product_line(self, plan, target, mma) -> str:
        return f"{target}: toy.mma (mma.sync.m16n8k16) {mma.dtype} -> f32, A = {mma.a}, B = {mma.b}"

    def warp_line(self, plan) -> str:
        return f"parallel for warp in {plan.warps} warps of {plan.warp_rows} {plan.row} rows @registers:  # toy.mma"


TOY = ToyPath()
