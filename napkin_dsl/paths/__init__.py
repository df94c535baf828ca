"""Instruction paths as types: one module per tensor-core instruction family.

Each module holds, side by side, what one family is to napkin: its plan type (a frozen dataclass
with only its own fields, subclassing :class:`~napkin_dsl.paths.plan.TensorPlan`), its legality
(``build``: the plan, or the :class:`~napkin_dsl.paths.plan.Refusal` that says why not), the
lines that describe its products, and the profile's ``[path.*]`` tables its rates come from (its
``instruction``). Its printer is the one ``backends/translate.py`` maps its plan type to; its
layouts are ``layouts.py``'s objects.

* ``mma_sync.py``: ``mma.sync.m16n8k16`` and 8-bit ``m16n8k32`` (sm_80 and later);
* ``wgmma.py``: ``wgmma.mma_async.m64nNk16`` and 8-bit ``m64nNk32`` with TMA (sm_90a).

The FMA path has no plan: a launch no path accepts stays on it, with the reason.

:data:`PATHS` is the order instruction selection asks them in (``isel.select``): the first path
the profile offers on the target architecture (``TensorPath.offered``) that accepts the launch
builds it; a path ahead of it that refused is named in the kernel header ("not wgmma: ...").
A new path is one module and one ``[path.*]`` table in a profile (docs/architecture.md, "Adding
an instruction path"); :func:`register` puts it in the order.
"""

from __future__ import annotations

from .mma_sync import MMA_SYNC, MmaSyncPath, MmaSyncPlan
from .plan import Refusal, TensorPath, TensorPlan
from .wgmma import WGMMA, TmaLoad, WgmmaPath, WgmmaPlan

# Asked in this order: the warpgroup instruction where the target has it, else mma.sync.
PATHS: list[TensorPath] = [WGMMA, MMA_SYNC]


def register(path: TensorPath, before: TensorPath = MMA_SYNC) -> None:
    """Put a new path in the order selection asks, ahead of ``before`` (default: mma.sync, which
    accepts every launch the analysis lays out)."""
    if path in PATHS:
        raise ValueError(f"the {path.instruction} path is registered already")
    if any(p.instruction == path.instruction for p in PATHS):
        raise ValueError(f"a path of instruction {path.instruction!r} is registered already")
    PATHS.insert(PATHS.index(before), path)


def unregister(path: TensorPath) -> None:
    PATHS.remove(path)


def path_of(plan: TensorPlan) -> TensorPath:
    """The registered path whose plan type ``plan`` is."""
    for path in PATHS:
        if type(plan) is path.plan_type:
            return path
    raise AssertionError(f"napkin bug: no registered path builds a {type(plan).__name__}")


def offered_paths(hardware, arch: str, dtype: str) -> list[TensorPath]:
    """The paths ``hardware``'s profile offers on ``arch`` for ``dtype`` operands, in :data:`PATHS` order."""
    return [path for path in PATHS if path.offered(hardware, arch, dtype)]


__all__ = ["MMA_SYNC", "PATHS", "WGMMA", "MmaSyncPath", "MmaSyncPlan", "Refusal", "TensorPath", "TensorPlan", "TmaLoad",
           "WgmmaPath", "WgmmaPlan", "offered_paths", "path_of", "register", "unregister"]
