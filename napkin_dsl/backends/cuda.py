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

import ctypes
import functools
import re

import numpy as np

from ..binding import c_strides
from ..cost import CostReport, cost_of
from ..hardware import DEFAULT_ARCH
from ..pseudocode import Program
from ..types import numpy_dtype
from .compiled import CompiledKernel, KernelSource
from .lowering import CudaDialect, bound_sizes, global_arrays, global_sizes, ident, scalar_ctype
from .translate import lower


@functools.lru_cache(maxsize=None)
def _compiler(arch: str, ptx: bool):
    from .nvrtc import NvrtcCompiler

    return NvrtcCompiler(arch, ptx=ptx)


def generate(program: Program, report: CostReport | None = None, arch: str | None = None,
             selected=None) -> tuple[str, list[KernelSource]]:
    """The CUDA C++ source of a Program (no compile), with the instruction paths ``arch`` selects
    (``selected``: that selection, ``isel.select_program``, where the caller has it) and the
    model's ``report`` of them at its head (priced here when not given)."""
    from ..isel import select_program

    bound_sizes(program)  # a size the model cannot evaluate is the printer's error, by name
    selected = selected if selected is not None else select_program(program, arch)
    report = report if report is not None else cost_of(program, arch=arch, selected=selected)
    lowered = lower(program, CudaDialect(), report, arch=arch, selected=selected)
    return lowered.source, lowered.kernels


def compile_program(program: Program, arch: str = DEFAULT_ARCH, ptx: bool = False, report: CostReport | None = None,
                    synchronous: bool = False, overlap: str | None = None) -> CompiledKernel:
    """Generate and compile ``program`` for ``arch``; cached in memory and on disk by source hash.
    ``synchronous``: wgmma launches on the synchronous ring, without roles (``isel.select_program``);
    ``overlap``: their consumers' schedule (``cost.build_schedule``)."""
    from ..cost import build_schedule
    from ..isel import select_program

    bound_sizes(program)
    # once: the report, the printers and the compiled report read it
    selected = select_program(program, arch, synchronous=synchronous, schedule=build_schedule(overlap))
    report = report if report is not None else cost_of(program, arch=arch, selected=selected)
    source, kernels = generate(program, report, arch, selected)
    name = f"napkin_{ident(program.diagram.name)}.cu"  # ASCII, as the entries
    source, module = _spill_free(source, _compiler(arch, ptx).compile(source, name), kernels, arch, ptx, name)
    return CompiledKernel(
        name=program.diagram.name,
        arch=arch,
        source=source,
        image=module.image,
        launches=kernels,
        resources=module.resources,
        # costed with ptxas's counts only when asked: cuda.run never reads it
        planned=lambda: (program, compiled_cost(program, arch, kernels, module.resources, report, selected), selected),
        ptx=ptx,
        selected=selected,
    )


# Register caps a launch that ptxas spilled at __launch_bounds__(threads, 1) (its 255 registers) is
# compiled again under, in order, until it compiles without spills (_spill_free).
REGISTER_CAPS = (254, 252, 250, 248)


def _spill_free(source: str, module, kernels: list[KernelSource], arch: str, ptx: bool, name: str):
    """``source`` and its ``module``, or, where ptxas spilled a launch, the source recompiled with
    that launch's ``__launch_bounds__`` replaced by ``__maxnreg__(cap)`` for the first cap of
    REGISTER_CAPS it compiles under without spills. A loop that holds about 204 fragment
    registers (isel.ROLLED_FRAGMENT_BUDGET: attention's 32-row warps at d = 128) is on a knife
    edge of ptxas's schedule: the same source spills 52 bytes at 255 registers on sm_80 for gqa
    at q = x = 512 and none at b = 4, q = x = 8192, and none at ``__maxnreg__(254)`` (it then
    schedules within the cap, where at 255 it spills a few rarely read loop-carried values).
    Each launch keeps the first cap it compiles clean under; one spilling under every cap keeps
    its launch bounds, and its spills are ptxas's report. PTX (no ptxas) is returned as it is."""
    caps: dict[str, int] = {}

    def spilling(module) -> list[str]:
        return [k.entry for k in kernels if module.resources.get(k.entry, {}).get("spill_bytes")]

    if ptx or not spilling(module):
        return source, module
    first = (source, module)
    for cap in REGISTER_CAPS:
        for entry in spilling(module):
            caps[entry] = cap
        trial_source = source
        for entry, entry_cap in caps.items():
            trial_source, count = re.subn(rf"__launch_bounds__\(\d+, 1\) {re.escape(entry)}\(",
                                          f"__maxnreg__({entry_cap}) {entry}(", trial_source)
            assert count == 1, f"napkin bug: no launch bounds on {entry}"
        module = _compiler(arch, ptx).compile(trial_source, name)
        if not spilling(module):
            return trial_source, module
    return first


def compiled_cost(program: Program, arch: str, launches: list[KernelSource], resources: dict,
                  report: CostReport | None = None, selected=None) -> CostReport:
    """The cost report of a compiled program: the model before compiling estimated registers;
    the compiled kernel's report counts what ptxas allocated, the threads of each launch and
    its shared bytes, for occupancy. ``report``: the estimate, ``selected``: the selection the
    kernel was printed with (``isel.select_program``), when the caller has them."""
    counted = {index: (k.block, resources[k.entry]["registers"], resources[k.entry].get("shared_bytes", 0) + k.shared_bytes)
               for index, k in enumerate(launches) if resources.get(k.entry, {}).get("registers")}
    if counted and not program.hardware.symbolic:
        return cost_of(program, arch=arch, resources=counted, check=False, selected=selected)
    return report if report is not None else cost_of(program, arch=arch, check=False, selected=selected)


# ---- launching --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def current_device():
    """The process's CUDA device 0, opened once: its primary context, and the modules loaded on
    it (``_loaded``), serve every later call. Raises NoCudaDevice without a GPU."""
    from .driver import Device

    return Device(0)


_TYPESTR = {"f32": ("<f4",), "f64": ("<f8",), "f16": ("<f2",), "bf16": ("<V2", "<u2", "<i2", "|V2"),
            # fp8 arrives as 1-byte opaque values or its bytes
            "fp8e4m3": ("|V1", "|u1", "|i1", "<V1"), "fp8e5m2": ("|V1", "|u1", "|i1", "<V1"),
            "i32": ("<i4",), "i64": ("<i8",)}


def _device_pointer(name: str, value, dtype: str, shape: tuple) -> ctypes.c_uint64:
    """The device pointer of an object with __cuda_array_interface__, after checking it fits."""
    from ..errors import NapkinCallError

    interface = value.__cuda_array_interface__
    got_shape = tuple(interface["shape"])
    if got_shape != shape:
        raise NapkinCallError(f"device array {name} has shape {got_shape}; the kernel needs {shape}")
    if interface.get("strides") not in (None, c_strides(shape, numpy_dtype(dtype).itemsize)):
        raise NapkinCallError(f"device array {name} is not C-contiguous", hint="pass a contiguous copy")
    if interface["typestr"] not in _TYPESTR.get(dtype, ()):  # bf16 arrives as 2-byte opaque values
        raise NapkinCallError(f"device array {name} has type {interface['typestr']}; the kernel needs {dtype}")
    return ctypes.c_uint64(int(interface["data"][0]))


def _host_array(name: str, value, dtype: str, shape: tuple) -> np.ndarray:
    from ..errors import NapkinCallError

    array = np.asarray(value)
    if array.dtype != numpy_dtype(dtype):
        raise NapkinCallError(f"{name} is {array.dtype}; the kernel needs {dtype} ({numpy_dtype(dtype)})",
                              hint="convert it, or call the kernel with cast=True")
    if array.shape != shape:
        raise NapkinCallError(f"{name} has shape {array.shape}; the kernel was compiled for {shape}")
    return np.ascontiguousarray(array)


def tensor_map_arguments(program: Program, selected) -> list[list]:
    """Per launch, the (array, ``driver.TiledTensorMap``) pairs its kernel takes after the scalars,
    as ``const __grid_constant__ CUtensorMap`` parameters: a wgmma plan's TMA operands
    (``plan.tma``, in order; ``wgmma.tensor_maps``), [] for every other launch. ``selected``: the
    selection the kernel was printed with (``CompiledKernel.selection``)."""
    from ..paths.wgmma import WgmmaPlan
    from .wgmma import tensor_maps

    sizes = {a: int(program.schedule.axis_size(a)) for a in program.diagram.axes}
    out = []
    for launch in program.launches:
        plan = selected[launch.index].plan
        if not isinstance(plan, WgmmaPlan) or not plan.tma:
            out.append([])
            continue
        maps = tensor_maps(plan, program.diagram, sizes)
        out.append([(load.array, maps[load.array]) for load in plan.tma])
    return out


def run(program: Program, inputs: dict, scalars: dict | None = None, stream=None, arch: str | None = None) -> dict:
    """Run ``program`` on the GPU; returns the outputs as NumPy arrays. ``arch`` is what to
    compile for (default: the program's profile's arch where this GPU runs it, ``sm_90a`` on an
    sm_90 GPU planned as H100 or H200, as the model priced it; else the GPU's own;
    ``hardware.Hardware.arch_for_device``). ``sm_90`` on an H100 builds mma.sync.

    ``inputs`` maps each array the kernel reads to a NumPy array of the declared dtype and
    shape, or to a device array (``__cuda_array_interface__``: CuPy, PyTorch CUDA tensors)
    used in place. Outputs and intermediates materialised in device memory are allocated
    here. Raises NoCudaDevice without a GPU, NapkinCallError for a missing or mismatched input.
    """
    device = current_device()
    return launch(compile_program(program, arch or program.hardware.arch_for_device(device.arch)), inputs, scalars, stream)


def launch(compiled: CompiledKernel, inputs: dict, scalars: dict | None = None, stream=None) -> dict:
    """Run a compiled kernel on the GPU (:func:`run`'s inputs and outputs): the module loaded
    once per device, each TMA operand's tensor map encoded once per device address (a caller's
    CUDA tensor keeps its map from call to call), and nothing selected, lowered or priced: each of
    the compiled kernel's launches carries its grid, block, shared bytes and tensor maps
    (``KernelSource``). Its Program gives the arrays' shapes (planned again only after a
    disk-cache hit, once)."""
    from ..errors import NapkinCallError

    device = current_device()
    program = compiled.program
    module = _loaded(device, compiled)
    diagram = program.diagram
    scalars = dict(scalars or {})
    sizes = {a: int(program.schedule.axis_size(a)) for a in diagram.axes}
    arrays = global_arrays(program)  # with a split's part arrays (O.acc.part[x# ...])
    sizes = global_sizes(program)
    produced = {s.target for s in diagram.statements} | (set(arrays) - set(diagram.arrays))
    for name in diagram.params:
        if name in diagram.arrays and name not in inputs:
            raise NapkinCallError(f"input {name} of {diagram.name} is missing")
        if name in diagram.scalars and name not in scalars:
            raise NapkinCallError(f"scalar {name} of {diagram.name} is missing")
    held: dict[str, object] = {}
    owned = []
    host_outputs: dict[str, np.ndarray] = {}

    def argument(name: str):
        if name in held:
            return held[name]
        axes, dtype = arrays[name]
        shape = tuple(sizes[a] for a in axes)
        value = inputs.get(name)
        if name not in produced and hasattr(value, "__cuda_array_interface__"):
            held[name] = _device_pointer(name, value, dtype, shape)
            return held[name]
        if name not in produced:
            buffer = device.to_device(_host_array(name, value, dtype, shape))
        else:  # an output, an intermediate materialised in device memory, a split's part states
            buffer = device.alloc(int(np.prod(shape)) * numpy_dtype(dtype).itemsize)
            if name in diagram.outputs:
                host_outputs[name] = np.empty(shape, numpy_dtype(dtype))
        owned.append(buffer)
        held[name] = buffer
        return buffer

    try:
        for k in compiled.launches:
            function = device.function(module, k.entry)
            args = [argument(name) for name, _, _ in k.arrays]
            args += [(np.float64 if scalar_ctype(diagram, name) == "double" else np.float32)(scalars[name]) for name in k.scalars]
            # TMA operands: the driver encodes each tensor map over the operand's device memory
            args += [_encoded(compiled, name, tensor_map, _address(argument(name))) for name, tensor_map in k.tensor_maps]
            for name in k.zeroed:  # the launch adds its groups' partial sums into it (relabel.summed_over_groups)
                device.zero(held[name], stream)
            device.launch(function, k.grid, k.block, args, shared_bytes=k.shared_bytes, stream=stream)
        device.synchronize(stream)
        return {name: device.copy_to_host(held[name], host) for name, host in host_outputs.items()}
    finally:
        for buffer in owned:
            device.free(buffer)


_maps: dict = {}  # (compiled image, array, address) -> the encoded map


def _encoded(compiled: CompiledKernel, name: str, tensor_map, address: int):
    """A TMA operand's map over ``address``, encoded once: the map is the address and the shape
    and strides the kernel was compiled for."""
    from .driver import encode_tiled

    key = (hash(compiled.image), name, address)
    if key not in _maps:
        _maps[key] = encode_tiled(tensor_map, address)
    return _maps[key]


def _address(value) -> int:
    """The device address of a launch argument: a DeviceBuffer, or a caller's pointer (c_uint64)."""
    return int(value.value) if isinstance(value, ctypes.c_uint64) else int(value)


_modules: dict = {}


def _loaded(device, compiled: CompiledKernel):
    """The module of a compiled kernel, loaded once per device (modules are never unloaded)."""
    key = (id(device), hash(compiled.image))
    if key not in _modules:
        _modules[key] = device.load(compiled.image)
    return _modules[key]


# ---- the `napkin cuda` command ------------------------------------------------------------------

# Sizes `napkin report` compiles at when the user binds none: large enough for every example's
# tiles, small enough to compile in a blink (the code does not depend on them beyond constants).
REPORT_SIZE = 128


def resources_json(compiled: CompiledKernel) -> dict:
    return {"launches": compiled.launch_table(), "cost": compiled.cost.to_dict()}


def format_resources(compiled: CompiledKernel) -> str:
    lines = [f"compiled {compiled.name} for {compiled.arch}: {len(compiled.launches)} launch{'es' if len(compiled.launches) != 1 else ''}"]
    for row in compiled.launch_table():
        lines.append(
            f"  {row['entry']}: grid {row['grid'][0]} x block {row['block'][0]}, {row['registers']} registers, "
            f"{row['shared_bytes']:,} B shared (static + dynamic), {row['spill_bytes']} B spilled, {row['path']}"
        )
        lines.extend(f"    {line}" for line in row["statements"])
    return "\n".join(lines)


def report_resources(kernel, sizes: dict, arch: str | None = None) -> str:
    """What `napkin report` shows: the kernel compiled for ``arch`` (default: its GPU's own) and its resources."""
    from ..errors import NapkinError

    bound = {axis: sizes.get(axis, REPORT_SIZE) for axis in kernel.diagram.axes}
    defaulted = [a for a in kernel.diagram.axes if a not in sizes]
    note = f" (at {' '.join(f'{a}={bound[a]}' for a in defaulted)}; bind sizes with --set)" if defaulted else ""
    try:
        compiled = kernel.compile(arch, **{**sizes, **bound})
    except NapkinError as error:
        return f"CUDA: not compiled: {error.message}"
    return format_resources(compiled) + note
