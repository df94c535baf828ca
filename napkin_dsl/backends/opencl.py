"""The OpenCL printing of the same kernel, run through pyopencl (PoCL on a CPU in CI).

The lowering is the CUDA backend's (``lowering.py``) with the OpenCL dialect: ``__local``
memory for the arena, ``barrier(CLK_LOCAL_MEM_FENCE)`` for ``__syncthreads()``, and the
warp-shuffle row reductions replaced by one work-item per row. Running it executes the
generated parallel code (work-groups, barriers, masked tails, the arena's aliasing) on any
machine with an OpenCL runtime, so CI tests what the GPU would run.

Deliberately not here: performance (PoCL on a CPU is a correctness oracle), device choice
beyond the first available one (``NAPKIN_OPENCL_DEVICE=platform:device`` overrides).
"""

from __future__ import annotations

import functools
import os

import numpy as np

from ..cost import build_schedule, cost_of
from ..dtypes import FP8_DTYPES
from ..errors import NapkinCallError, NapkinError
from ..isel import select_program
from ..paths.plan import STAGES
from ..pseudocode import Program
from ..types import numpy_dtype
from .lowering import OpenCLDialect, bound_sizes, global_arrays, global_sizes, scalar_ctype
from .roles import STATUS_WORDS, read_status
from .translate import lower


class NoOpenCLDevice(NapkinError):
    """No OpenCL runtime or device (install pyopencl and, on Debian, pocl-opencl-icd)."""

    def __init__(self, reason: str):
        super().__init__(f"no OpenCL device: {reason}",
                         hint="pip install pyopencl; on Debian/Ubuntu apt-get install pocl-opencl-icd")


@functools.lru_cache(maxsize=1)
def context():
    """(context, queue) on the first OpenCL device, or NAPKIN_OPENCL_DEVICE=platform:device."""
    try:
        import pyopencl as cl
    except ImportError as exc:
        raise NoOpenCLDevice(f"pyopencl is not installed ({exc})") from None
    try:
        platforms = cl.get_platforms()
    except cl.Error as exc:
        raise NoOpenCLDevice(str(exc)) from None
    choice = os.environ.get("NAPKIN_OPENCL_DEVICE")
    devices = [(p, d) for p in platforms for d in p.get_devices()]
    if not devices:
        raise NoOpenCLDevice("no platform has a device")
    if choice:
        platform_index, device_index = (int(x) for x in choice.split(":"))
        device = platforms[platform_index].get_devices()[device_index]
    else:
        device = devices[0][1]
    ctx = cl.Context([device])
    return ctx, cl.CommandQueue(ctx)


def opencl_available() -> bool:
    try:
        context()
        return True
    except NoOpenCLDevice:
        return False


def generate(program: Program, report=None, arch: str | None = None, stages: int | None = None,
             synchronous: bool = False, overlap: str | None = None) -> tuple[str, list]:
    """OpenCL C of ``program`` with the instruction paths isel picks for ``arch`` (default: the
    profile's): ``sm_90a`` prints the wgmma lowering, wgmma emulated (``backends/wgmma.py``).
    ``stages`` sets the cp.async stages of every streamed mma.sync launch (``isel.stage_count``);
    ``synchronous`` keeps wgmma launches on the synchronous ring, without roles; ``overlap``
    builds their consumers' schedule (``cost.build_schedule``). The model's ``report`` of
    those paths heads the source (priced here when not given)."""
    bound_sizes(program)  # a size the model cannot evaluate is the printer's error, by name
    selected = select_program(program, arch, stages=stages, synchronous=synchronous, schedule=build_schedule(overlap))
    report = report if report is not None else cost_of(program, arch=arch, selected=selected)
    lowered = lower(program, OpenCLDialect(), report, arch=arch, selected=selected)
    return lowered.source, lowered.kernels


class RolesFailure(NapkinError):
    """A warp-specialized kernel's roles did not finish on the emulation (``backends/roles.py``):
    a deadlock, named by the role, the barrier and the phase it waits on, or the round limit."""


def roles_seed() -> int:
    """The seed of the roles runtime's adversary (when each copy and wgmma group lands):
    ``NAPKIN_EMULATE_SEED`` (``napkin run --emulate-seed``), 1 by default."""
    flag = os.environ.get("NAPKIN_EMULATE_SEED", "1").strip()
    if not flag.isdigit() or int(flag) < 1:
        raise NapkinError(f"NAPKIN_EMULATE_SEED is {flag!r}; it takes a positive integer")
    return int(flag)


def build_options() -> tuple[str, ...]:
    """The options every napkin program is built with. ``NAPKIN_OPENCL_OPTIMIZE=0`` adds
    ``-cl-opt-disable``: PoCL then compiles a kernel's work-group function without LLVM's
    optimizations. An emulated tensor-core kernel is large (every mma, ldmatrix and cp.async is
    a loop over a warp's lanes), and optimizing it dominates a small run: split-K on mma.sync at
    m=50 n=40 k=712 took 306 s to compile and 0.8 s to run optimized, 18 s and 0.9 s without.
    The kernel's text is the same either way (the optimizer may contract a multiply and an add
    differently, within the Program's tolerance); the test suite builds unoptimized
    (tests/conftest.py), and a user who runs large sizes keeps the default."""
    flag = os.environ.get("NAPKIN_OPENCL_OPTIMIZE", "1").strip()
    if flag not in ("0", "1"):
        raise NapkinError(f"NAPKIN_OPENCL_OPTIMIZE is {flag!r}; it takes 0 (build with -cl-opt-disable) or 1 (optimize)")
    seed = f"-DNK_ROLES_SEED={roles_seed()}"
    return ("-cl-std=CL1.2", seed) if flag == "1" else ("-cl-std=CL1.2", "-cl-opt-disable", seed)


def _built(source: str):
    """The built program and its kernels by entry name (a kernel object is made once)."""
    return _built_with(source, build_options())


@functools.lru_cache(maxsize=64)
def _built_with(source: str, options: tuple[str, ...]):
    import pyopencl as cl

    ctx, _ = context()
    program = cl.Program(ctx, source).build(options=list(options))
    return {kernel.function_name: kernel for kernel in program.all_kernels()}


def local_memory(kernel, device) -> int:
    """The bytes of local memory a built kernel needs on ``device`` (arena and static arrays)."""
    import pyopencl as cl

    return kernel.get_work_group_info(cl.kernel_work_group_info.LOCAL_MEM_SIZE, device)


def check_fits(kernel, k, device) -> None:
    """A launch the device cannot hold is a napkin error before anything runs: its local memory
    (the arena, static __local arrays) over the device's, or a work-group over the kernel's limit.
    (Devices differ: PoCL offers megabytes of local memory, oclgrind 32 KiB, GPUs 48-228 KiB.)"""
    import pyopencl as cl

    info = cl.kernel_work_group_info
    local = local_memory(kernel, device)
    if local > device.local_mem_size:
        raise NapkinError(f"{k.entry} needs {local:,} bytes of local memory; the OpenCL device {device.name.strip()!r} "
                          f"has {device.local_mem_size:,}",
                          hint="use smaller group or stream sizes at the compute level (or let `napkin tune` choose)")
    largest = kernel.get_work_group_info(info.WORK_GROUP_SIZE, device)
    if k.block > largest:
        raise NapkinError(f"{k.entry} runs {k.block} work-items per group; the OpenCL device {device.name.strip()!r} "
                          f"takes at most {largest} for it")


def run(program: Program, inputs: dict, scalars: dict | None = None, arch: str | None = None,
        synchronous: bool = False, overlap: str | None = None) -> dict:
    """Run every launch of ``program`` on the OpenCL device, printed for ``arch`` (:func:`generate`,
    ``synchronous`` and ``overlap`` as it takes them); returns the outputs (NumPy)."""
    import pyopencl as cl

    missing = [a.name for a in program.diagram.input_arrays if a.name not in inputs]
    if missing:  # its buffer would be allocated and never written: the kernel would read garbage
        raise NapkinCallError(f"opencl.run({program.diagram.name}) is missing input {', '.join(missing)}")
    ctx, queue = context()
    device = queue.device
    source, kernels = generate(program, arch=arch, synchronous=synchronous, overlap=overlap)
    built = _built(source)
    if any(k.stages > STAGES for k in kernels) and any(local_memory(built[k.entry], device) > device.local_mem_size
                                                         for k in kernels):
        # The stages past two are the profile's GPU's latency cover, chosen for its shared memory;
        # a device with less local memory (oclgrind: 32 KiB) runs the same Program double-buffered.
        source, kernels = generate(program, arch=arch, stages=STAGES, synchronous=synchronous, overlap=overlap)
        built = _built(source)
    diagram = program.diagram
    sizes = global_sizes(program)  # with a split's part axes (x#)
    arrays = global_arrays(program)  # with a split's part arrays, which the parts launch saves
    scalars = dict(scalars or {})
    buffers: dict[str, object] = {}
    hosts: dict[str, np.ndarray] = {}
    flags = cl.mem_flags

    def buffer(name: str):
        if name in buffers:
            return buffers[name]
        axes, array_dtype = arrays[name]
        dtype = numpy_dtype(array_dtype)
        if name in inputs:
            host = np.ascontiguousarray(inputs[name], dtype=dtype)
            if array_dtype == "bf16":
                host = host.view(np.uint16)
            elif array_dtype in FP8_DTYPES:  # its bytes, which the kernel decodes
                host = host.view(np.uint8)
            buffers[name] = cl.Buffer(ctx, flags.READ_ONLY | flags.COPY_HOST_PTR, hostbuf=host)
        else:
            shape = tuple(sizes[a] for a in axes)
            hosts[name] = np.empty(shape, dtype)
            buffers[name] = cl.Buffer(ctx, flags.READ_WRITE, size=max(hosts[name].nbytes, 1))
        return buffers[name]

    for k in kernels:
        check_fits(built[k.entry], k, device)
    for k in kernels:
        kernel = built[k.entry]
        args = [buffer(name) for name, _, _ in k.arrays]
        for name in k.zeroed:  # the launch adds its groups' partial sums into it (relabel.summed_over_groups)
            cl.enqueue_fill_buffer(queue, buffers[name], np.zeros(1, np.uint8), 0, max(hosts[name].nbytes, 1))
        args += [(np.float64 if scalar_ctype(diagram, name) == "double" else np.float32)(scalars[name]) for name in k.scalars]
        if not k.roles:
            kernel(queue, (k.grid * k.block,), (k.block,), *args)
            continue
        status = np.zeros((k.grid, len(STATUS_WORDS)), np.int32)
        status_buffer = cl.Buffer(ctx, flags.WRITE_ONLY, size=status.nbytes)
        kernel(queue, (k.grid * k.block,), (k.block,), *args, status_buffer)
        cl.enqueue_copy(queue, status, status_buffer)
        ended = [(block, read_status(words)) for block, words in enumerate(status)]
        failed = [(block, s) for block, s in ended if s.outcome != "finished"]
        if failed:
            block, first = failed[0]
            raise RolesFailure(f"{k.entry}, block {block} of {k.grid} (seed {roles_seed()}): "
                               f"{first.describe(list(k.roles), list(k.barriers))}"
                               + (f"; {len(failed) - 1} more blocks did not finish" if len(failed) > 1 else ""))
    outputs = {}
    for name in diagram.outputs:
        host = hosts[name]
        dtype = diagram.arrays[name].dtype
        target = host.view(np.uint16) if dtype == "bf16" else host.view(np.uint8) if dtype in FP8_DTYPES else host
        cl.enqueue_copy(queue, target, buffers[name])
        outputs[name] = host
    queue.finish()
    return outputs
