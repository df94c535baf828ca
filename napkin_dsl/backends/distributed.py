"""Execution across the GPUs of a node (the device level, ``hardware.Hardware.device``) over
real processes: one per GPU, joined by a torch.distributed process group (gloo on the CPU,
NCCL on GPUs), never a transport of napkin's own.

Rank 0 holds the inputs (seeded, as ``napkin run`` draws them) and the outputs. The device
partition (the relabel block's clause at the top level, ``gmem: split x 4096`` or
``gmem: group h 8``; else :func:`best_partition`'s) cuts one axis into parts, part p on rank
p mod N. Rank 0 sends each other rank the inputs of its parts (a slice where an input has the
axis, else the whole input, once); each rank runs its parts on the chosen backend:

- a **group** runs one GPU's Program (the block without its top-level clause) at the part's
  size, and sends its outputs back;
- a **split** runs the parts launch of the Program with the split at the compute level
  (``cost.device_block``) for its parts only, and sends their states (``O.acc.part``,
  ``P.max.part``, ``P.sum.part``) back; rank 0's combine launch merges them.

The arrays move as their bytes (``uint8`` views of the declared dtype) with send and recv;
``transfers`` counts them, which ``cost.device_cost`` predicts (its ``H``). Scalars and the
per-rank counts travel as Python objects and are not counted: they are no array the model
moves. Only NumPy runs a split across GPUs (each GPU runs its own parts of the parts launch, which
a printed launch, one block per part, cannot be restricted to yet); a group runs on NumPy or OpenCL.
"""

from __future__ import annotations

import math
import os
import tempfile

import numpy as np

from ..cost import cost_of, device_block, device_cost, device_parts
from ..dtypes import DTYPE_BYTES
from ..errors import NapkinError
from ..hardware import load_hardware
from ..plan import plan
from ..relabel import make_schedule, part_axis
from ..types import numpy_dtype
from .numpy import Interpreter, random_arguments, reference_error, run_program, tolerance

class _Link:
    """Point-to-point moves of arrays as the bytes of their declared dtypes (NumPy's, ml_dtypes'
    bfloat16 and fp8 among them), counted."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        # NCCL moves CUDA tensors only (a path run only where there are GPUs); gloo moves CPU ones.
        self.device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        self.sent = self.received = 0  # bytes this rank sent, received

    def send(self, array: np.ndarray, dtype: str, to: int) -> None:
        import torch

        data = np.ascontiguousarray(np.asarray(array).astype(numpy_dtype(dtype), copy=False)).reshape(-1).view(np.uint8)
        self.dist.send(torch.from_numpy(data.copy()).to(self.device), dst=to, group=self.group)
        self.sent += data.size

    def recv(self, shape, dtype: str, source: int) -> np.ndarray:
        import torch

        data = torch.empty(math.prod(shape) * DTYPE_BYTES[dtype], dtype=torch.uint8, device=self.device)
        self.dist.recv(data, src=source, group=self.group)
        self.received += data.numel()
        return data.cpu().numpy().view(numpy_dtype(dtype)).reshape(tuple(shape))


def _with_device_clause(block, profile, kind: str, axis: str, size: int):
    """``block`` (relabel syntax) with the clause ``TOP: KIND AXIS SIZE`` in place of any at the top."""
    import dataclasses

    from .. import syntax as syn

    top = profile.top.name
    span = block.span if block is not None else None
    clause = syn.LevelClauses(top, (syn.Partition(kind, axis, size, span),), span)
    levels = tuple(c for c in (block.levels if block is not None else ()) if c.level != top)
    if block is None:
        return syn.RelabelBlock(None, profile.name, (clause,), span)
    return dataclasses.replace(block, hardware=profile.name, levels=(clause,) + levels)


def best_partition(kernel, profile, sizes: dict, devices: int):
    """The device partition napkin takes where the block has none: over every axis of at least
    ``devices`` that a group (woven by every statement, consumed by none) or a split (consumed)
    may cut into ``devices`` parts, the one whose slowest GPU (one part's predicted time, by
    cost_of of its Program) plus the links' time (cost.device_cost) is least. Returns the block
    with that clause and a line that says which, and the candidates' times."""
    from ..errors import RelabelError

    diagram = kernel.diagram
    best, tried = None, []
    for axis in diagram.axes:
        n = int(sizes[axis])
        if n < devices:
            continue
        consumed = any(axis in s.consumed for s in diagram.statements)
        woven = all(axis in s.iteration_axes for s in diagram.statements) and all(axis in diagram.arrays[o].axes for o in diagram.outputs)
        kinds = ["split"] if consumed else (["group"] if woven else [])
        for kind in kinds:
            size = -(-n // devices)
            block = _with_device_clause(kernel.relabel, profile, kind, axis, size)
            try:
                schedule = make_schedule(diagram, profile, block, sizes)
                local = dict(sizes) | {axis: size}
                one = plan(diagram, profile, device_block(block, profile, None), local)
                seconds = cost_of(one, check=False).time.get("overlapped_s")
                link = device_cost(schedule, devices)
            except (RelabelError, NapkinError, NotImplementedError):
                continue
            if seconds is None or link is None:
                continue
            total = seconds + link["link_s"]
            tried.append((f"{profile.top.name}: {kind} {axis} {size}", total))
            if best is None or total < best[0]:
                best = (total, block, f"{profile.top.name}: {kind} {axis} {size}")
    if best is None:
        raise NapkinError(f"napkin finds no partition of {kernel.name} across {devices} GPUs",
                          hint=f"write one in the relabel block: '{profile.top.name}: group AXIS SIZE' or '{profile.top.name}: split AXIS SIZE'")
    others = ", ".join(f"{name} {t * 1e6:.3g} us" for name, t in sorted(tried, key=lambda c: c[1]))
    return best[1], f"the relabel block has no {profile.top.name} clause: napkin takes {best[2]} for {devices} GPUs ({others})"


class _PartsInterpreter(Interpreter):
    """The Interpreter of a split Program, running chosen launches and, in the parts launch,
    only the parts in ``mine``."""

    def __init__(self, program, inputs, scalars, impls, mine):
        self.mine = frozenset(mine)
        super().__init__(program, inputs, scalars, impls)

    def compile_loop(self, loop):
        if loop.part is None or loop.mask is not None:
            return super().compile_loop(loop)
        body = self.compile(loop.body)
        axis, part, ranges, mine = loop.axis, loop.part, self.ranges, self.mine
        tile, trips = int(loop.tile), int(loop.trips)

        def run_loop():
            start, stop = ranges[axis]
            held = ranges[part]
            for trip in range(trips):
                index = start // tile + trip
                first = min(start + trip * tile, stop)
                if index not in mine or first == stop:
                    continue
                ranges[axis] = (first, min(first + tile, stop))
                ranges[part] = (index, index + 1)
                for node in body:
                    node()
            ranges[axis] = (start, stop)
            ranges[part] = held

        return run_loop

    def run_launches(self, launches):
        with np.errstate(all="ignore"):
            for launch in launches:
                self.launch = launch
                self.roles = launch.launch.streams[0].roles if launch.launch.streams else {}
                for node in self.compile(launch.body):
                    node()
        return self.counts


def run_rank(kernel, hardware: str | None = None, sizes: dict | None = None, seed: int = 0, backend: str = "numpy",
             group=None, impls: dict | None = None) -> dict | None:
    """This process's share of ``kernel`` across the GPUs of a node, inside an initialised
    torch.distributed process group (``group``: None for the default one): every rank calls
    it with the same arguments. Rank 0 returns a dict (errors against the float64 reference,
    ``tolerance``, ``transfers`` in bytes against the model's ``predicted_transfers``, the
    summed counts per level against the model's, ``partition``, ``chosen``); the others None."""
    import torch.distributed as dist

    from ..reference import evaluate

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    profile = load_hardware(kernel._target(hardware))
    if profile.device is None:
        raise NapkinError(f"{profile.name} has no device level: it is one GPU",
                          hint="name a node of GPUs, e.g. --hardware H100x8")
    if world > profile.device.units:
        raise NapkinError(f"{world} processes, but {profile.name} has {profile.device.units} GPUs")
    diagram = kernel.diagram
    sizes = {a: int(v) for a, v in (sizes or {}).items()}
    block, chosen = kernel.relabel, None
    if block is not None and block.hardware != profile.name:
        import dataclasses

        block = dataclasses.replace(block, hardware=profile.name)
    schedule = make_schedule(diagram, profile, block, sizes)
    if not schedule.device:
        block, chosen = best_partition(kernel, profile, sizes, world)
        schedule = make_schedule(diagram, profile, block, sizes)
    partition = schedule.device[0]
    axis, kind = partition.axis, partition.kind
    parts = device_parts(partition, sizes[axis], world)
    mine = [(p, start, stop) for p, (unit, start, stop) in enumerate(parts) if unit == rank]
    link = _Link(group)
    arrays = scalars = None
    if rank == 0:
        arrays, scalars = random_arguments(diagram, sizes, seed)
    scalars = _broadcast(scalars, group)

    # The inputs of each part: rank 0 sends them; the others receive (an input without the axis once).
    local: dict[int, dict] = {}  # part -> input name -> the part's slice of an input with the axis
    whole: dict[str, np.ndarray] = {}  # the inputs without the axis, whole (sent once per rank)
    for unit in range(world):
        if rank not in (0, unit) or not any(u == unit for u, _, _ in parts):
            continue
        for array in diagram.input_arrays:
            pieces = ([(p, start, stop) for p, (u, start, stop) in enumerate(parts) if u == unit]
                      if axis in array.axes else [(None, 0, 0)])
            for p, start, stop in pieces:
                cut = tuple(slice(start, stop) if a == axis else slice(None) for a in array.axes)
                if rank == 0:
                    value = arrays[array.name][cut] if p is not None else arrays[array.name]
                    if unit != 0:
                        link.send(value, array.dtype, unit)
                else:
                    shape = tuple(stop - start if a == axis else sizes[a] for a in array.axes) if p is not None else \
                        tuple(sizes[a] for a in array.axes)
                    value = link.recv(shape, array.dtype, 0)
                if unit == rank:
                    if p is None:
                        whole[array.name] = value
                    else:
                        local.setdefault(p, {})[array.name] = value

    counted: dict[str, int] = {}
    outputs: dict[str, np.ndarray] = {}
    predicted_counts: dict[str, int] = {}
    if kind == "group":
        one_gpu = device_block(block, profile, None)
        results = {}
        for p, start, stop in mine:
            program = plan(diagram, profile, one_gpu, sizes | {axis: stop - start})
            inputs = {a.name: (local[p][a.name] if axis in a.axes else whole[a.name]) for a in diagram.input_arrays}
            out, counts = run_program(backend, program, inputs, scalars, impls)
            results[p] = out
            _add(counted, counts)
        if rank == 0:
            for name in diagram.outputs:
                array = diagram.arrays[name]
                outputs[name] = np.zeros([sizes[a] for a in array.axes], dtype=numpy_dtype(array.dtype))
            for p, (unit, start, stop) in enumerate(parts):
                for name in diagram.outputs:
                    array = diagram.arrays[name]
                    cut = tuple(slice(start, stop) if a == axis else slice(None) for a in array.axes)
                    shape = tuple(stop - start if a == axis else sizes[a] for a in array.axes)
                    outputs[name][cut] = results[p][name] if unit == 0 else link.recv(shape, array.dtype, unit)
        else:
            for p, _, _ in mine:
                for name in diagram.outputs:
                    link.send(results[p][name], diagram.arrays[name].dtype, 0)
        if rank == 0:
            for _, start, stop in parts:
                _add(predicted_counts, cost_of(plan(diagram, profile, one_gpu, sizes | {axis: stop - start}), check=False))
    else:
        if backend != "numpy":
            raise NotImplementedError(f"a split across GPUs on the {backend} backend: each GPU runs its own parts of the "
                                      "parts launch, which the NumPy interpreter restricts itself to and a printed launch "
                                      "(one block per part) does not yet; run it with --backend numpy")
        program = plan(diagram, profile, device_block(block, profile, partition), sizes)
        top = profile.top.name
        combine = [launch for launch in program.launches if launch.combine == axis]
        parts_launches = [launch for launch in program.launches if launch.combine is None]
        if len(parts_launches) != 1 or len(combine) != 1 or program.launches[-1] is not combine[0]:
            raise NotImplementedError(f"a split across GPUs of a kernel of {len(program.launches)} launches: napkin runs "
                                      "one parts launch and its combine launch across processes")
        inputs = {}
        for array in diagram.input_arrays:
            if axis not in array.axes:
                inputs[array.name] = whole[array.name]
                continue
            full = np.zeros([sizes[a] for a in array.axes], dtype=numpy_dtype(array.dtype))
            for p, start, stop in mine:
                full[tuple(slice(start, stop) if a == axis else slice(None) for a in array.axes)] = local[p][array.name]
            inputs[array.name] = full
        interpreter = _PartsInterpreter(program, inputs, scalars, impls, [p for p, _, _ in mine])
        interpreter.run_launches(parts_launches)
        states = sorted({step.array: (step.axes, step.dtype) for step, _ in _walk(parts_launches[0].body)
                         if step.op == "save" and step.dest == top and part_axis(axis) in step.axes}.items())
        values = interpreter.values[top]
        if rank == 0:
            for p, (unit, _, _) in enumerate(parts):
                if unit == 0:
                    continue
                for name, (axes, dtype) in states:
                    at = axes.index(part_axis(axis))
                    shape = [sizes[a] for a in axes if a != part_axis(axis)]
                    index = (slice(None),) * at + (p,)
                    values[name][index] = link.recv(shape, dtype, unit)
            interpreter.run_launches(combine)
            outputs = {name: values[name] for name in diagram.outputs}
            _add(predicted_counts, cost_of(program, check=False))
        else:
            for p, _, _ in mine:
                for name, (axes, dtype) in states:
                    at = axes.index(part_axis(axis))
                    link.send(values[name][(slice(None),) * at + (p,)], dtype, 0)
        _add(counted, interpreter.counts)
    everyone = _gather((counted, link.sent, link.received), group)
    if rank != 0:
        return None
    expected = evaluate(diagram, arrays, scalars, sizes, impls, keep_float64=True)
    max_abs = scale = 0.0
    for name in diagram.outputs:
        error, magnitude = reference_error(outputs[name], expected[name])
        max_abs, scale = max(max_abs, error), max(scale, magnitude)
    total: dict[str, int] = {}
    for counts, _, _ in everyone:
        for level, h in counts.items():
            total[level] = total.get(level, 0) + h
    model = device_cost(schedule, world)
    limit = tolerance(plan(diagram, profile, device_block(block, profile, partition if kind == "split" else None), sizes))
    max_rel = max_abs / scale if scale > 0 else max_abs
    return {
        "partition": f"{profile.top.name}: {kind} {axis} {partition.size}", "chosen": chosen, "devices": world,
        "parts": len(parts), "backend": backend, "hardware": profile.name, "sizes": sizes, "outputs": outputs,
        "max_abs_error": max_abs, "max_rel_error": max_rel, "tolerance": limit, "ok": max_rel <= limit,
        "transfers": sum(sent for _, sent, _ in everyone), "received": sum(r for _, _, r in everyone),
        "predicted_transfers": model["H"], "counted": total if backend == "numpy" else None,
        "predicted": predicted_counts,
    }


def _walk(body):
    from ..pseudocode import walk

    return walk(body)


def _add(into: dict, counts) -> None:
    """Add a run's (Counts) or a report's (CostReport) H per level below the top into ``into``."""
    if counts is None:
        return
    if hasattr(counts, "levels"):
        for level, c in counts.levels.items():
            into[level] = into.get(level, 0) + int(c.H)
    else:
        for level, h in counts.H.items():
            into[level] = into.get(level, 0) + int(h)


def _broadcast(value, group):
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _gather(value, group):
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _worker(rank: int, world: int, init: str, kernel, hardware, sizes, seed, backend, result_path) -> None:
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        result = run_rank(kernel, hardware, sizes, seed, backend)
        if rank == 0:
            result = {k: v for k, v in result.items() if k != "outputs"}
            with open(result_path, "w", encoding="utf-8") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def launch(kernel, devices: int, hardware: str | None = None, sizes: dict | None = None, seed: int = 0,
           backend: str = "numpy") -> dict:
    """Start ``devices`` processes (torch.multiprocessing, a gloo group through a file:// rendezvous)
    that run ``kernel`` across them (:func:`run_rank`); rank 0's result. NCCL's path is a process
    group of its own (``kernel.distributed`` inside a torchrun job), run only where there are GPUs."""
    import json

    import torch.multiprocessing as mp

    if devices < 1:
        raise NapkinError(f"--devices must be 1 or more, got {devices}")
    with tempfile.TemporaryDirectory(prefix="napkin-dist-") as folder:
        init = "file://" + os.path.join(folder, "rendezvous")
        result_path = os.path.join(folder, "result.json")
        mp.spawn(_worker, args=(devices, init, kernel, hardware, dict(sizes or {}), seed, backend,
                                result_path), nprocs=devices, join=True)
        with open(result_path, encoding="utf-8") as f:
            return json.load(f)
