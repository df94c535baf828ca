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

import dataclasses
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


@dataclasses.dataclass
class _Share:
    """One rank's share of a device partition: diagram, sizes, cut axis, every part's (unit, start, stop), rank, link."""

    diagram: object
    sizes: dict
    axis: str
    parts: list
    rank: int
    link: _Link

    @property
    def mine(self) -> list:
        """The parts this rank runs, (part, start, stop) each."""
        return _parts_on(self.parts, self.rank)


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
    profile = _node_profile(kernel, hardware, world)
    diagram = kernel.diagram
    sizes = {a: int(v) for a, v in (sizes or {}).items()}
    block, chosen, schedule = _device_schedule(kernel, profile, sizes, world)
    partition = schedule.device[0]
    axis, kind = partition.axis, partition.kind
    parts = device_parts(partition, sizes[axis], world)
    share = _Share(diagram, sizes, axis, parts, rank, _Link(group))
    arrays = scalars = None
    if rank == 0:
        arrays, scalars = random_arguments(diagram, sizes, seed)
    scalars = _broadcast(scalars, group)
    local, whole = _distribute_inputs(share, arrays, world)
    if kind == "group":
        outputs, counted, predicted_counts = _run_group(share, profile, block, backend, local, whole, scalars, impls)
    else:
        outputs, counted, predicted_counts = _run_split(share, profile, block, partition, backend, local, whole, scalars, impls)
    everyone = _gather((counted, share.link.sent, share.link.received), group)
    if rank != 0:
        return None
    expected = evaluate(diagram, arrays, scalars, sizes, impls, keep_float64=True)
    max_abs, scale = _reference_errors(diagram, outputs, expected)
    total = _summed_counts(counts for counts, _, _ in everyone)
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


def _node_profile(kernel, hardware, world: int):
    """The hardware profile of the node that ``world`` processes run ``kernel`` on."""
    profile = load_hardware(kernel._target(hardware))
    if profile.device is None:
        raise NapkinError(f"{profile.name} has no device level: it is one GPU",
                          hint="name a node of GPUs, e.g. --hardware H100x8")
    if world > profile.device.units:
        raise NapkinError(f"{world} processes, but {profile.name} has {profile.device.units} GPUs")
    return profile


def _device_schedule(kernel, profile, sizes: dict, world: int):
    """The relabel block with a device partition, the line naming napkin's choice (None where the block has one), its schedule."""
    block, chosen = kernel.relabel, None
    if block is not None and block.hardware != profile.name:
        block = dataclasses.replace(block, hardware=profile.name)
    schedule = make_schedule(kernel.diagram, profile, block, sizes)
    if not schedule.device:
        block, chosen = best_partition(kernel, profile, sizes, world)
        schedule = make_schedule(kernel.diagram, profile, block, sizes)
    return block, chosen, schedule


def _parts_on(parts, unit: int) -> list:
    """The parts on ``unit``, (part, start, stop) each."""
    return [(p, start, stop) for p, (u, start, stop) in enumerate(parts) if u == unit]


def _part_cut(array, axis: str, start: int, stop: int) -> tuple:
    """The index of a part's slice of ``array``: start:stop along ``axis``, all of every other axis."""
    return tuple(slice(start, stop) if a == axis else slice(None) for a in array.axes)


def _part_shape(array, axis: str, start: int, stop: int, sizes: dict) -> tuple:
    """The shape of a part's slice of ``array``."""
    return tuple(stop - start if a == axis else sizes[a] for a in array.axes)


def _distribute_inputs(share: _Share, arrays, world: int):
    """This rank's inputs: (part -> name -> its slice of an input with the axis, name -> an input without it)."""
    local: dict[int, dict] = {}
    whole: dict[str, np.ndarray] = {}
    for unit in range(world):
        on_unit = _parts_on(share.parts, unit)
        # Rank 0 sends every rank its pieces; a rank receives only its own.
        if share.rank not in (0, unit) or not on_unit:
            continue
        for array in share.diagram.input_arrays:
            # An input without the axis moves once per rank, whole.
            for p, start, stop in (on_unit if share.axis in array.axes else [(None, 0, 0)]):
                value = _move_input(share, arrays, array, unit, p, start, stop)
                if unit == share.rank:
                    if p is None:
                        whole[array.name] = value
                    else:
                        local.setdefault(p, {})[array.name] = value
    return local, whole


def _move_input(share: _Share, arrays, array, unit: int, p, start: int, stop: int) -> np.ndarray:
    """One piece of an input for ``unit`` (part ``p``, or the whole input where ``p`` is None), sent by rank 0, received by ``unit``."""
    if share.rank == 0:
        value = arrays[array.name][_part_cut(array, share.axis, start, stop)] if p is not None else arrays[array.name]
        if unit != 0:
            share.link.send(value, array.dtype, unit)
        return value
    # An input without the axis has every axis whole: its part's shape is the whole shape.
    return share.link.recv(_part_shape(array, share.axis, start, stop, share.sizes), array.dtype, 0)


def _run_group(share: _Share, profile, block, backend: str, local: dict, whole: dict, scalars, impls):
    """A group on this rank: (the outputs, the counts, the model's counts), the first and last on rank 0 only."""
    one_gpu = device_block(block, profile, None)
    outputs: dict[str, np.ndarray] = {}
    predicted: dict[str, int] = {}
    results, counted = _run_group_parts(share, profile, one_gpu, backend, local, whole, scalars, impls)
    if share.rank == 0:
        outputs = _collect_group_outputs(share, results)
        predicted = _group_predicted_counts(share, profile, one_gpu)
    else:
        _send_group_outputs(share, results)
    return outputs, counted, predicted


def _part_program(share: _Share, profile, one_gpu, start: int, stop: int):
    """The one-GPU Program of a group's part start:stop."""
    return plan(share.diagram, profile, one_gpu, share.sizes | {share.axis: stop - start})


def _run_group_parts(share: _Share, profile, one_gpu, backend: str, local: dict, whole: dict, scalars, impls):
    """The outputs of this rank's parts of a group (part -> name -> array), and their summed counts."""
    results: dict[int, dict] = {}
    counted: dict[str, int] = {}
    for p, start, stop in share.mine:
        program = _part_program(share, profile, one_gpu, start, stop)
        inputs = {a.name: (local[p][a.name] if share.axis in a.axes else whole[a.name]) for a in share.diagram.input_arrays}
        out, counts = run_program(backend, program, inputs, scalars, impls)
        results[p] = out
        _add(counted, counts)
    return results, counted


def _collect_group_outputs(share: _Share, results: dict) -> dict:
    """The whole outputs of a group on rank 0, its own parts' from ``results``, the others' received."""
    diagram, sizes, axis = share.diagram, share.sizes, share.axis
    outputs: dict[str, np.ndarray] = {}
    for name in diagram.outputs:
        array = diagram.arrays[name]
        outputs[name] = np.zeros([sizes[a] for a in array.axes], dtype=numpy_dtype(array.dtype))
    for p, (unit, start, stop) in enumerate(share.parts):
        for name in diagram.outputs:
            array = diagram.arrays[name]
            cut, shape = _part_cut(array, axis, start, stop), _part_shape(array, axis, start, stop, sizes)
            outputs[name][cut] = results[p][name] if unit == 0 else share.link.recv(shape, array.dtype, unit)
    return outputs


def _send_group_outputs(share: _Share, results: dict) -> None:
    """Send rank 0 the outputs of this rank's parts of a group."""
    for p, _, _ in share.mine:
        for name in share.diagram.outputs:
            share.link.send(results[p][name], share.diagram.arrays[name].dtype, 0)


def _group_predicted_counts(share: _Share, profile, one_gpu) -> dict:
    """The model's counts per level of a group, summed over its parts."""
    predicted: dict[str, int] = {}
    for _, start, stop in share.parts:
        _add(predicted, cost_of(_part_program(share, profile, one_gpu, start, stop), check=False))
    return predicted


def _run_split(share: _Share, profile, block, partition, backend: str, local: dict, whole: dict, scalars, impls):
    """A split on this rank: (the outputs, the counts, the model's counts), the first and last on rank 0 only."""
    _check_split_backend(backend)
    program = plan(share.diagram, profile, device_block(block, profile, partition), share.sizes)
    top = profile.top.name
    parts_launches, combine = _split_launches(program, share.axis)
    inputs = _split_inputs(share, local, whole)
    interpreter = _PartsInterpreter(program, inputs, scalars, impls, [p for p, _, _ in share.mine])
    interpreter.run_launches(parts_launches)
    states = _split_states(parts_launches[0], top, share.axis)
    values = interpreter.values[top]
    outputs: dict[str, np.ndarray] = {}
    predicted: dict[str, int] = {}
    if share.rank == 0:
        _receive_states(share, values, states)
        interpreter.run_launches(combine)
        outputs = {name: values[name] for name in share.diagram.outputs}
        _add(predicted, cost_of(program, check=False))
    else:
        _send_states(share, values, states)
    counted: dict[str, int] = {}
    _add(counted, interpreter.counts)
    return outputs, counted, predicted


def _check_split_backend(backend: str) -> None:
    """Refuse a split across GPUs on any backend but NumPy."""
    if backend != "numpy":
        raise NotImplementedError(f"a split across GPUs on the {backend} backend: each GPU runs its own parts of the "
                                  "parts launch, which the NumPy interpreter restricts itself to and a printed launch "
                                  "(one block per part) does not yet; run it with --backend numpy")


def _split_launches(program, axis: str):
    """A split Program's parts launch and its combine launch over ``axis`` (a list of one each)."""
    combine = [launch for launch in program.launches if launch.combine == axis]
    parts_launches = [launch for launch in program.launches if launch.combine is None]
    if len(parts_launches) != 1 or len(combine) != 1 or program.launches[-1] is not combine[0]:
        raise NotImplementedError(f"a split across GPUs of a kernel of {len(program.launches)} launches: napkin runs "
                                  "one parts launch and its combine launch across processes")
    return parts_launches, combine


def _split_inputs(share: _Share, local: dict, whole: dict) -> dict:
    """The inputs of a split Program on this rank: whole-sized, filled only in this rank's parts along the axis."""
    inputs = {}
    for array in share.diagram.input_arrays:
        if share.axis not in array.axes:
            inputs[array.name] = whole[array.name]
            continue
        full = np.zeros([share.sizes[a] for a in array.axes], dtype=numpy_dtype(array.dtype))
        for p, start, stop in share.mine:
            full[_part_cut(array, share.axis, start, stop)] = local[p][array.name]
        inputs[array.name] = full
    return inputs


def _split_states(parts_launch, top: str, axis: str) -> list:
    """The states a split's parts launch saves per part at the top level: sorted (name, (axes, dtype)) pairs."""
    return sorted({step.array: (step.axes, step.dtype) for step, _ in _walk(parts_launch.body)
                   if step.op == "save" and step.dest == top and part_axis(axis) in step.axes}.items())


def _state_index(axes, axis: str, p: int) -> tuple:
    """The index of part ``p`` in a state of ``axes``."""
    return (slice(None),) * axes.index(part_axis(axis)) + (p,)


def _receive_states(share: _Share, values: dict, states: list) -> None:
    """Receive into rank 0's ``values`` the states of the other ranks' parts."""
    for p, (unit, _, _) in enumerate(share.parts):
        if unit == 0:
            continue
        for name, (axes, dtype) in states:
            shape = [share.sizes[a] for a in axes if a != part_axis(share.axis)]
            values[name][_state_index(axes, share.axis, p)] = share.link.recv(shape, dtype, unit)


def _send_states(share: _Share, values: dict, states: list) -> None:
    """Send rank 0 the states of this rank's parts."""
    for p, _, _ in share.mine:
        for name, (axes, dtype) in states:
            share.link.send(values[name][_state_index(axes, share.axis, p)], dtype, 0)


def _reference_errors(diagram, outputs: dict, expected: dict):
    """The largest absolute error of the outputs against the reference, and the largest magnitude of the reference."""
    max_abs = scale = 0.0
    for name in diagram.outputs:
        error, magnitude = reference_error(outputs[name], expected[name])
        max_abs, scale = max(max_abs, error), max(scale, magnitude)
    return max_abs, scale


def _summed_counts(per_rank) -> dict:
    """The counts per level (level -> H) summed over the ranks'."""
    total: dict[str, int] = {}
    for counts in per_rank:
        for level, h in counts.items():
            total[level] = total.get(level, 0) + h
    return total


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
