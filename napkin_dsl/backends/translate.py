"""A Program as one translation unit: each launch printed by the printer its path needs.

:func:`lower` asks instruction selection (``isel.py``) for every launch's path, prints the
launch with the tensor-core printer (``tensorcore.py``) or the FMA printer (``lowering.py``),
and joins the kernels after a header comment (the diagram, the relabelling, the paths and the
cost table) and the dialect's prelude. Both printers sit below this module, which is why it is
not part of either.

Deliberately not here: printing a launch (the printers), compiling (``nvrtc.py``), launching
(``cuda.py``, ``opencl.py``).
"""

from __future__ import annotations

from ..dtypes import FP8_DTYPES
from ..isel import FMA_THREADS, ProgramSelection, describe, plan_summary, select_program
from ..paths.mma_sync import MmaSyncPlan
from ..paths.wgmma import WgmmaPlan
from ..pseudocode import Program
from .lowering import THREADS, Dialect, LoweredProgram, Printer, bound_sizes, ident
from .pipeline import RolesPrinter
from .pipeline import prelude as roles_prelude
from .tensorcore import FP8_PRELUDES, PRELUDES, TensorPrinter
from .wgmma import WgmmaPrinter, instruction_shapes
from .wgmma import prelude as wgmma_prelude


# The printer of each plan type (a path's plan, paths/): a plan takes the printer of the first
# type here it is an instance of, so that a path whose plan extends mma.sync's prints as mma.sync.
PRINTERS = [(WgmmaPlan, WgmmaPrinter), (MmaSyncPlan, TensorPrinter)]


def printer_for(plan):
    """The printer class that builds ``plan`` (:data:`PRINTERS`; a wgmma plan with roles, its
    warp-specialized schedule, by ``pipeline.py``)."""
    if isinstance(plan, WgmmaPlan) and plan.roles is not None:
        return RolesPrinter
    for plan_type, printer in PRINTERS:
        if isinstance(plan, plan_type):
            return printer
    raise NotImplementedError(f"no printer builds a {type(plan).__name__}: add one to backends/translate.py's PRINTERS")


def header_comment(program: Program, report, kernels=()) -> str:
    """The diagram, the relabelling, the instruction path of every statement and the cost table."""
    diagram = program.diagram
    lines = [f"napkin kernel {diagram.name} on {program.hardware.name}", "", "diagram:"]
    for s in diagram.statements:
        lines.append(f"  {s.target}[{' '.join(s.axes)}]{' @' + s.level if s.level else ''} = {s.describe()}")
    lines.append("")
    lines.append("relabelling:")
    for p in program.schedule.partitions:
        scope = f" for {', '.join(p.targets)}" if p.targets else ""
        lines.append(f"  {p.level}{scope}: {p.kind} {p.axis} {p.size}{'  (derived)' if p.derived else ''}")
    lines.append("")
    if kernels:
        lines.append("instruction paths:")
        for k in kernels:
            lines.append(f"  {k.entry}: {k.path}")
            lines.extend(f"    {line}" for line in k.paths)
        lines.append("")
    lines.extend(report.table().splitlines())
    body = "\n".join(" * " + line if line else " *" for line in lines)
    return "/*\n" + body.replace("*/", "* /") + "\n */\n"


def lower(program: Program, dialect: Dialect, report, threads: int = THREADS, arch: str | None = None,
          selected: ProgramSelection | None = None) -> LoweredProgram:
    """Print every launch of ``program`` as a kernel in ``dialect``; one translation unit.

    Each launch takes the path instruction selection (``isel.py``) chose for ``arch`` (default:
    the hardware profile's): the tensor-core printer (``tensorcore.py``) or the FMA printer (``lowering.py``).
    ``selected``: that selection (``isel.select_program``), where the caller has it; else it runs
    here once. ``report``: the model's report of the same selection, whose table heads the
    source; the caller prices it (``cost.cost_of``), so that printing never runs the model.
    """
    bound_sizes(program)  # before the arena, which needs numbers
    selected = selected if selected is not None else select_program(program, arch)
    kernels = []
    tensor = False
    for launch in program.launches:
        entry = f"napkin_{ident(program.diagram.name)}_{launch.index}"
        chosen = selected[launch.index]
        if chosen.plan is not None:
            tensor = True
            kernel = printer_for(chosen.plan)(program, launch, dialect, chosen.plan).print(entry)
            kernel.paths = [plan_summary(chosen.plan)] + describe(chosen, launch)
            kernel.stages = chosen.plan.stages if any(op.streamed for op in chosen.plan.operands.values()) else 0
        else:
            # Register accumulators are dealt to FMA_THREADS threads, as the model counts them.
            kept = chosen.kept if threads == FMA_THREADS else {}
            kernel = Printer(program, launch, dialect, threads, kept).print(entry)
            kernel.paths = describe(chosen, launch)
        kernel.path = chosen.path
        kernels.append(kernel)
    wgmma = [chosen for chosen in selected.launches.values() if isinstance(chosen.plan, WgmmaPlan)]
    shapes = [shape for chosen in wgmma for shape in instruction_shapes(chosen.plan, chosen.tile).values()]
    double = any(buffer.dtype == "f64" for launch in program.launches for buffer in launch.buffers.values())
    fp8 = any(array.dtype in FP8_DTYPES for array in program.diagram.arrays.values()) or any(
        buffer.dtype in FP8_DTYPES for launch in program.launches for buffer in launch.buffers.values())
    parts = [header_comment(program, report, kernels),
             dialect.prelude + (dialect.prelude_f64 if double else "") + (dialect.prelude_fp8 if fp8 else "")
             + (PRELUDES[dialect.name] if tensor else "")
             + (FP8_PRELUDES[dialect.name] if any(s.plan is not None and s.plan.dtype in FP8_DTYPES for s in selected.launches.values()) else "")
             + (wgmma_prelude(dialect.name, shapes, any(c.plan.tma for c in wgmma)) if wgmma else "")
             + (roles_prelude(dialect.name) if any(c.plan.roles is not None for c in wgmma) else ""),
             f"#define NK_THREADS {threads}"]
    for k in kernels:
        if dialect.name == "opencl":
            parts.append(f"#undef NK_ARENA_BYTES\n#define NK_ARENA_BYTES {max(k.shared_bytes, 16)}")
        parts.append(k.text)
    return LoweredProgram(dialect.name, "\n".join(parts), kernels)
