"""The CUDA backend: Program -> CUDA C++ -> cubin (NVRTC) -> launch, with the cost model attached.

:func:`compile_program` prints every launch of a Program with the CUDA dialect of
``lowering.py``, compiles the translation unit with :class:`~napkin_dsl.backends.nvrtc.NvrtcCompiler`
for one architecture, and returns a :class:`CompiledKernel` that carries the source (whose
first comment block is the diagram, the relabelling and the cost table), the cubin, the
per-launch resources from ptxas (registers, static shared memory, spills), the launch
geometry and the :class:`~napkin_dsl.cost.CostReport` itself.

:func:`run` launches it on the GPU: NumPy arrays are copied in and out; objects with
``__cuda_array_interface__`` (CuPy, PyTorch CUDA tensors) are used in place. With no GPU it
raises :class:`~napkin_dsl.backends.driver.NoCudaDevice`.

Deliberately not here: choosing sizes (the relabel block or ``tune.py``), the lowering itself
(``lowering.py``), NVRTC and the disk cache (``nvrtc.py``), driver calls (``driver.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from ..cost import CostReport, cost_of
from ..pseudocode import Program
from ..types import numpy_dtype
from .lowering import CudaDialect, KernelSource, lower

DEFAULT_ARCH = "sm_90"


@dataclass
class CompiledKernel:
    """A compiled napkin kernel: source, cubin, resources per launch, and its cost model."""

    name: str
    arch: str
    source: str
    image: bytes
    launches: list[KernelSource]
    resources: dict  # entry -> {"registers", "shared_bytes" (static), "spill_bytes"}
    cost: CostReport
    program: Program = field(repr=False)
    ptx: bool = False

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
            })
        return rows


@functools.lru_cache(maxsize=None)
def _compiler(arch: str, ptx: bool):
    from .nvrtc import NvrtcCompiler

    return NvrtcCompiler(arch, ptx=ptx)


def generate(program: Program, report: CostReport | None = None) -> tuple[str, list[KernelSource]]:
    """The CUDA C++ source of a Program (no compile)."""
    lowered = lower(program, CudaDialect(), report)
    return lowered.source, lowered.kernels


def compile_program(program: Program, arch: str = DEFAULT_ARCH, ptx: bool = False, report: CostReport | None = None) -> CompiledKernel:
    """Generate and compile ``program`` for ``arch``; cached in memory and on disk by source hash."""
    report = report if report is not None else cost_of(program)
    source, kernels = generate(program, report)
    module = _compiler(arch, ptx).compile(source, f"napkin_{program.diagram.name}.cu")
    return CompiledKernel(
        name=program.diagram.name,
        arch=arch,
        source=source,
        image=module.image,
        launches=kernels,
        resources=module.resources,
        cost=report,
        program=program,
        ptx=ptx,
    )


# ---- launching --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _device():
    from .driver import Device

    return Device(0)


def run(program: Program, inputs: dict, scalars: dict | None = None, stream=None) -> dict:
    """Run ``program`` on the GPU. Returns the outputs as NumPy arrays (or in place on device arrays).

    ``inputs`` maps parameter names to NumPy arrays of the declared dtype (or device arrays
    with ``__cuda_array_interface__``). Raises NoCudaDevice without a GPU.
    """
    device = _device()
    compiled = compile_program(program, device.arch)
    module = device.load(compiled.image)
    diagram = program.diagram
    scalars = dict(scalars or {})
    sizes = {a: int(program.schedule.axis_size(a)) for a in diagram.axes}
    held: dict[str, object] = {}  # name -> device pointer (int) or DeviceBuffer
    owned = []
    host_outputs: dict[str, np.ndarray] = {}

    def pointer(name: str):
        if name in held:
            return held[name]
        array = diagram.arrays[name]
        shape = tuple(sizes[a] for a in array.axes)
        value = inputs.get(name)
        if value is not None and hasattr(value, "__cuda_array_interface__"):
            held[name] = int(value.__cuda_array_interface__["data"][0])
            return held[name]
        if value is not None:
            buffer = device.to_device(np.ascontiguousarray(value, dtype=numpy_dtype(array.dtype)))
        else:
            buffer = device.alloc(int(np.prod(shape)) * np.dtype(numpy_dtype(array.dtype)).itemsize)
            host_outputs[name] = np.empty(shape, numpy_dtype(array.dtype))
        owned.append(buffer)
        held[name] = buffer
        return buffer

    try:
        for k in compiled.launches:
            function = device.function(module, k.entry)
            args = [pointer(name) for name, _, _ in k.arrays]
            args += [np.float32(scalars[name]) for name in k.scalars]
            device.launch(function, k.grid, k.block, args, shared_bytes=k.shared_bytes, stream=stream)
        device.synchronize()
        outputs = {}
        for name in diagram.outputs:
            if name in host_outputs:
                outputs[name] = device.copy_to_host(held[name], host_outputs[name])
            else:
                outputs[name] = inputs.get(name)
        return outputs
    finally:
        for buffer in owned:
            device.free(buffer)


# ---- the `napkin cuda` command ------------------------------------------------------------------

# Sizes `napkin report` compiles at when the user binds none: large enough for every example's
# tiles, small enough to compile in a blink (the code does not depend on them beyond constants).
REPORT_SIZE = 128


def _write_atomically(path: str, data: bytes) -> None:
    import os
    import tempfile

    directory = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".napkin-", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def resources_json(compiled: CompiledKernel) -> dict:
    return {"launches": compiled.launch_table(), "cost": compiled.cost.to_dict()}


def format_resources(compiled: CompiledKernel) -> str:
    lines = [f"compiled {compiled.name} for {compiled.arch}: {len(compiled.launches)} launch{'es' if len(compiled.launches) != 1 else ''}"]
    for row in compiled.launch_table():
        lines.append(
            f"  {row['entry']}: grid {row['grid'][0]} x block {row['block'][0]}, {row['registers']} registers, "
            f"{row['shared_bytes']:,} B shared (static + dynamic), {row['spill_bytes']} B spilled"
        )
    return "\n".join(lines)


def report_resources(kernel, sizes: dict, arch: str = "sm_90") -> str:
    """What `napkin report` shows: the kernel compiled for ``arch`` and its resources."""
    from ..errors import NapkinError

    bound = {axis: sizes.get(axis, REPORT_SIZE) for axis in kernel.diagram.axes}
    defaulted = [a for a in kernel.diagram.axes if a not in sizes]
    note = f" (at {' '.join(f'{a}={bound[a]}' for a in defaulted)}; bind sizes with --set)" if defaulted else ""
    try:
        compiled = kernel.compile(arch, **{**sizes, **bound})
    except NapkinError as error:
        return f"CUDA: not compiled: {error.message}"
    return format_resources(compiled) + note


def cmd_cuda(args) -> int:
    import json
    import sys

    from ..cli import _selected, parse_sets

    sizes = parse_sets(args.set)
    results = {}
    for kernel in _selected(args):
        compiled = kernel.compile(args.arch, args.hardware, ptx=args.ptx, **sizes)
        results[kernel.name] = compiled
        text = compiled.image.rstrip(b"\0").decode() if args.ptx else compiled.source
        if args.output:
            _write_atomically(args.output, text.encode())
        elif not args.resources:
            sys.stdout.write(text)
    if args.resources:
        if args.json:
            print(json.dumps({"kernels": {name: resources_json(c) for name, c in results.items()}}, indent=2))
        else:
            for compiled in results.values():
                print(format_resources(compiled))
    return 0


def add_cuda_command(subparsers) -> None:
    from ..cli import _common

    cuda = subparsers.add_parser("cuda", help="generate CUDA C++ and compile it with NVRTC (no GPU needed)")
    _common(cuda, hardware=True)
    cuda.add_argument("--arch", default=DEFAULT_ARCH, help="sm_80 or sm_90 (default sm_90)")
    cuda.add_argument("-o", "--output", metavar="FILE.cu", help="write the source (or PTX) here instead of stdout")
    cuda.add_argument("--ptx", action="store_true", help="emit PTX instead of the CUDA source")
    cuda.add_argument("--resources", action="store_true", help="print registers, shared memory and spills per launch")
    cuda.add_argument("--json", action="store_true", help="with --resources: one JSON object")
    cuda.set_defaults(run=cmd_cuda)
