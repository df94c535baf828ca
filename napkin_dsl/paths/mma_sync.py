"""The mma.sync path: one warp's ``mma.sync.m16n8k16`` products (``m16n8k32`` for 8-bit
operands), operands by ldmatrix from swizzled shared tiles, printed by ``backends/tensorcore.py``.

Its plan is what instruction selection's analysis lays every launch out as (``isel._plan``: warp
tiles of 16-row fragments, 2-D warp grids, the cp.async stages); this path accepts it unless the
profile's 8-bit mma.sync ``converts`` and the conversions would not fit the register budget. Its
fragments are ``layouts.MMA_A``, ``MMA_B``, ``MMA_C`` (``MMA_A8``, ``MMA_B8`` for 8-bit operands);
its rates are the profile's ``[path.*]`` tables with ``instruction = "mma.sync"``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import FP8_DTYPES
from ..layouts import MMA_K, MMA_K8, MMA_M, MMA_N
from ..pseudocode import LaunchProgram
from .plan import FRAGMENT_BUDGET, Mma, Refusal, TensorPath, TensorPlan, fitting_tile_hint, live_fragment_values, refuse_if


def mma_k(dtype: str) -> int:
    """The k of one mma.sync instruction for ``dtype`` operands: 16, or 32 for fp8."""
    return MMA_K8 if dtype in FP8_DTYPES else MMA_K


def mma_shape(dtype: str) -> str:
    """The mma.sync shape napkin builds for ``dtype`` operands (``m16n8k16``, fp8's ``m16n8k32``)."""
    return f"m{MMA_M}n{MMA_N}k{mma_k(dtype)}"


@dataclass(frozen=True)
class MmaSyncPlan(TensorPlan):
    """A plan on mma.sync (or, with another ``instruction``, laid out as mma.sync and priced as that)."""

    INSTRUCTION = "mma.sync"

    # The stream loop runs one chunk a trip on a running buffer, not unrolled by the stages: for
    # fragments over FRAGMENT_BUDGET, up to ROLLED_FRAGMENT_BUDGET (tensorcore.TensorPrinter.rolled).
    rolled: bool = False


# Where the profile's fp8 mma.sync path ``converts`` (no 8-bit mma.sync in SASS: ptxas converts
# each operand pair to f16, F2FP.F16.E4M3.UNPACK_B, and issues two HMMA.16816; sm_90, read in
# tests/test_fp8_tensorcore.py) and P is packed in registers as well (attention's PV), the
# conversions hold about this many registers more: measured on fp8 attention at d = 128, where
# sm_89 compiles to 215 registers and sm_90 spills 340 bytes at 255; at d = 64 sm_90 takes 243.
CONVERTED_FP8_REGISTERS = 32


def converted_fp8_refusal(plan: TensorPlan, launch: LaunchProgram, tile: dict, budget: int, arch: str) -> str | None:
    """Why an fp8 plan with a register A does not fit where the profile's 8-bit mma.sync converts, or None."""
    if plan.dtype not in FP8_DTYPES:
        return None
    found = launch.schedule.hardware.find_path("mma.sync", plan.dtype, arch, mma_shape(plan.dtype))
    if found is None or not found.converts:
        return None
    if not any(m.a_in_registers for m in plan.mmas.values()):
        return None
    held = live_fragment_values(plan, launch, tile) + CONVERTED_FP8_REGISTERS
    if held <= budget:
        return None
    hint = fitting_tile_hint(plan, launch, tile, budget, CONVERTED_FP8_REGISTERS)
    return (f"{arch} has no 8-bit mma.sync: ptxas converts the fp8 operands to f16, and with P packed in "
            f"registers a thread would hold {held} fragment registers (budget {budget}); use smaller tiles{hint}")


class MmaSyncPath(TensorPath):
    instruction = "mma.sync"
    plan_type = MmaSyncPlan

    def offered(self, hardware, arch: str, dtype: str) -> bool:
        # sm_90a keeps every instruction of sm_90 (hardware.InstructionPath.runs_on)
        return hardware.find_path(self.instruction, dtype, arch, mma_shape(dtype)) is not None

    def build(self, plan, launch, tile, sizes, warp_tiles, arch) -> MmaSyncPlan:
        for mma in plan.mmas.values():
            if mma.dtype in FP8_DTYPES and mma.a_trans and not mma.a_in_registers:
                # ldmatrix .trans moves 16-bit values (before sm_100): it cannot transpose bytes, and
                # the m16n8k32 A fragment holds 4 consecutive k of one row in a register.
                raise Refusal(f"A operand {mma.a} is {mma.dtype} stored with {plan.row} fastest; an fp8 A is read by "
                              f"ldmatrix, which needs {mma.k} fastest")
        # where the arch converts 8-bit operands to f16, their registers come on top: FRAGMENT_BUDGET, rolled or not
        refuse_if(converted_fp8_refusal(plan, launch, tile, FRAGMENT_BUDGET, arch))
        return plan

    def product_line(self, plan, target: str, mma: Mma) -> str:
        if not plan.built:
            return (f"{target}: {plan.instruction} (priced, not built) {mma.dtype} -> f32, A = {mma.a} from "
                    f"{'registers' if mma.a_in_registers else 'shared memory'}, B = {mma.b} from shared memory")
        a = f"{mma.a} from registers (packed to {mma.dtype})" if mma.a_in_registers else f"{mma.a} by ldmatrix{'.trans' if mma.a_trans else ''}"
        if mma.staged:
            laid = plan.laid_out(target)
            a = (f"{mma.a} staged through shared memory (packed to {mma.dtype}), by ldmatrix.trans; on {laid.warps} warps "
                 f"of {laid.warp_rows} {laid.row} x {laid.warp_cols} {laid.split}")
        if mma.dtype in FP8_DTYPES:  # byte loads for an n-contiguous B (backends/tensorcore.py, mma_fp8)
            b = f"{mma.b} by {'byte loads, 4 k a register' if mma.b_trans else 'ldmatrix'}"
            return f"{target}: mma.sync.{mma_shape(mma.dtype)} {mma.dtype} -> f32, A = {a}, B = {b}"
        return f"{target}: mma.sync.m16n8k16 {mma.dtype} -> f32, A = {a}, B = {mma.b} by ldmatrix{'.trans' if mma.b_trans else ''}"

    def warp_line(self, plan) -> str:
        held = ", ".join(plan.fragments)
        shape = f"{plan.warp_rows} {plan.row}" + (f" x {plan.warp_cols} {plan.split}" if plan.split else " rows")
        return (f"parallel for warp in {plan.warps} warps of {shape} @registers:"
                f"  # mma.sync m16n8k16; {held} in registers")


MMA_SYNC = MmaSyncPath()
