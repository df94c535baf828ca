"""The NumPy backend: a Program executed step by step on any machine, counting what it moves.

:func:`execute` interprets a :class:`~napkin_dsl.pseudocode.Program` (the paper's looped
pseudocode) exactly as it is written: per launch, its group loops in order (one group after
another; on a GPU they run in parallel), its stream loops as loops, and every step on whole
tiles with NumPy, never element by element. It returns the outputs and a :class:`Counts` of
every value it moved between levels and every FLOP it performed, which must equal the
:class:`~napkin_dsl.cost.CostReport` read off the same Program (the tests check this for every
example and for random relabellings).

How the steps run:

* buffers live per ``(level, name)``; the top level holds whole arrays (the inputs, and the
  outputs and materialised intermediates, allocated at their first save); lower levels hold
  tiles. A tile remembers where it starts along each of its axes, so a load from a level
  that holds a larger tile takes the right slice of it;
* **masked tails hold only the valid part**: a tile that would run past the end of an axis
  (or past the end of the enclosing tile) is smaller, so nothing is padded and counts are of
  valid elements only;
* ``load`` copies a tile down, converting to the array's dtype; ``save`` copies it up,
  converting to the array's dtype (for outputs that is the declared dtype, so this is where
  bf16 and fp8 results are rounded; ml_dtypes rounds to nearest even, fp8 saturating as
  ``types.convert`` says: the largest finite value, never NaN or inf); ``alloc`` makes an
  empty tile (filled with NaN, so a tile some save forgot would show);
* ``compute`` evaluates one box on the tiles of the compute level in the step's dtype (f32,
  or f64 when an input is f64): contractions as batched matrix products (BLAS, accumulating
  in that dtype), maps by broadcasting over named axes with the table of elementwise
  functions (``elementwise.py``: each one's tile definition, which is the reference's float64
  one but for GELU, see :func:`gelu`), reductions, a numerically stable softmax, opaque boxes
  through ``impls`` (same calling convention as the reference, on tiles in the compute dtype). A contraction's
  scalar factor is its own step, ``S *= scale``;
* streams run the Program's state machine literally: ``init`` (0, -inf or +inf),
  ``accumulate`` (running sum, max or min; a contraction adds its chunk), the online
  softmax's ``rescale`` (``m' = max(m, rowmax(S))``, ``scale = exp(m - m')``, ``m = m'``)
  and ``online`` (``P = exp(S - m)``, ``l = l * scale + rowsum(P)``), the contraction's
  ``rescale`` (``O.acc *= scale``) and ``accumulate`` (``O.acc += P V``), ``finalise``
  (``O = O.acc / l``; ``mean`` divides by the reduced size). State is in the dtype the
  Program gives it (``pseudocode.compute_dtype``: f64 when an operand is f64, else f32).

Counting: a transfer adds the values it moved to the H of the step's level (loads into it,
saves out of it), and bytes by the array's dtype. FLOPs are counted as the steps evaluate them,
never read off the Program: every arithmetic operation, special function, comparison or select
the interpreter evaluates on n values adds n times its count to its unit (a function's, from
the table of elementwise functions; special for a fractional power, fma for the other
operators; a contraction 2 per multiply-add on its launch's unit, tensor or fma; an opaque box its symbol per copy). Two
conventions, which the model shares: an operation inside an elementwise expression counts once
per element of the step's tile even where NumPy broadcasting computes it on fewer values (the
generated GPU code evaluates it per element), and a reduction of n values counts n (each value
combined into a result that starts at 0, -inf or +inf). The guards of a fully masked row (its
max -inf, its sum 0) are tests of a row's state, not arithmetic on values: neither counts them.
A loop runs every trip its Program says. When a tile of an upper
level is a masked tail, an inner loop over the same axis can have trips that are entirely
past its end (``Loop.trips`` is computed from the full upper tile): those trips still run,
as the Program says, and the values they move are also counted apart in
:attr:`Counts.empty_H` so that the waste is visible.

What it deliberately does not do: run groups in parallel, model timing, check capacities
(a tile larger than shared memory runs fine here; ``cost.py`` refuses it), or run anything
but a Program (``reference.py`` evaluates diagrams directly).

Also here, because every caller of a backend needs them: :func:`run_program` (this backend,
or ``cuda.run`` / ``opencl.run``, which ``Kernel.__call__`` uses), the host-memory guard
(:func:`estimate_bytes`, :func:`check_memory`), and :func:`check_run` (a backend against the
reference, its counts against the report), which the ``napkin run`` and ``napkin report``
commands (``cli.py``) call.
"""

from __future__ import annotations

import functools
import math
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from .. import algebra
from ..binding import format_gib as _gib
from ..binding import memory_limit
from ..cost import contraction_unit, fma_register_launches, plain_tiles, tensor_launches, vector_reads
from ..boxes import SCAN_FOLDS, accumulated, opaque_flops, reduction
from ..dtypes import DTYPE_BYTES, FP8_DTYPES
from ..diagram import (
    Apply, Const, Contract, Index, Map, Opaque, Read, Reduce, ScalarParam, Scan, Softmax, Statement, indices,
    operation_count, operation_unit, reads,
)
from .. import elementwise
from ..errors import NapkinCallError, NapkinError
from ..isel import ProgramSelection, select_program
from ..paths.plan import shared_reads
from ..pseudocode import Loop, Program, Step, walk, compute_dtype
from ..reference import ELEMENTWISE, logsumexp, masked_softmax
from ..reference import Evaluator as _Evaluator
from ..reference import NamedArray as _Named
from ..reference import ReferenceFailure as _Failure
from ..types import convert, numpy_dtype
from ..windows import completed_sizes, gather, tile_footprint

__all__ = ["Counts", "check_memory", "check_run", "estimate_bytes", "execute", "gelu", "run_program"]


# ---- counts --------------------------------------------------------------------------------


@dataclass
class Counts:
    """What one execution moved and computed.

    ``H`` and ``H_bytes``: per level below the top, values (and bytes) loaded into it or saved
    out of it. ``flops``: per compute unit. ``empty_tiles``: loop trips that ran with nothing
    left along their axis (see the module docstring); ``empty_H``: values those trips moved.
    """

    H: dict = field(default_factory=dict)
    H_bytes: dict = field(default_factory=dict)
    flops: dict = field(default_factory=dict)
    empty_tiles: int = 0
    empty_H: dict = field(default_factory=dict)
    steps: int = 0

    @property
    def total_flops(self):
        return sum(self.flops.values())

    def differences(self, report) -> list[str]:
        """Where these counts differ from a CostReport's H per level and FLOPs per unit (empty: equal)."""
        problems = []
        for level, cost in report.levels.items():
            counted = self.H.get(level, 0)
            if cost.H - counted != 0:
                problems.append(f"H at {level}: counted {counted}, predicted {cost.H}")
            counted = self.H_bytes.get(level, 0)
            if cost.H_bytes - counted != 0:
                problems.append(f"H bytes at {level}: counted {counted}, predicted {cost.H_bytes}")
        for unit in set(report.flops) | set(self.flops):
            predicted, counted = report.flops.get(unit, 0), self.flops.get(unit, 0)
            if algebra.as_expr(predicted) - counted != 0:
                problems.append(f"{unit} FLOPs: counted {counted}, predicted {predicted}")
        return problems


# ---- elementwise functions -------------------------------------------------------------------


gelu = elementwise.tile(elementwise.function("gelu"))
"""GELU in its exact erf form, x/2 (1 + erf(x/sqrt 2)), vectorised, in the input's dtype: the
``gelu`` entry's tile definition in the table of elementwise functions, written as
x/2 erfc(-x/sqrt 2) so that large negative x keeps its relative accuracy. In f64 (and on Python
floats) erfc is ``math.erfc``, accurate to the last bits, as the reference's. Below f64 it is a
rational fit (relative error below 1.2e-7, about 2 ulp of f32, as CUDA's ``erff`` and OpenCL's
``erf`` in float are), evaluated in float64."""


def _definition(fn: str) -> Callable | None:
    """What a tile step evaluates for ``Apply.fn``: the table's tile definition of a function
    (read when asked, so an entry added at run time runs here too), else the operator's."""
    entry = elementwise.function(fn)
    return elementwise.tile(entry) if entry is not None else ELEMENTWISE.get(fn)


class _TileEvaluator(_Evaluator):
    """The reference's evaluator, over tiles, keeping the tiles' dtype.

    Constants and scalar parameters become Python floats, which NumPy 2 treats as "weak":
    an f32 tile times ``d^-0.5`` stays f32 (a NumPy float64 scalar, as the reference uses,
    would promote the tile to float64). Size expressions use the whole axis sizes, never the
    tile's (``d^-0.5`` is the same in every tile).
    """

    def __init__(self, diagram, sizes, scalars, impls, ranges: dict | None = None, count=None):
        super().__init__(diagram, sizes, scalars, impls)
        self._constants: dict = {}
        # count(unit, n): each operation evaluated adds the elements of the step's tile
        # (``elements``, set before each evaluation), however few values NumPy computes it on.
        self.count = count
        self.elements = 0
        # The interpreter's current tile, [start, stop) per axis: an axis index (q in
        # where(q >= x, S, -inf)) is the whole array's index, offset by the tile's start.
        self.ranges = ranges if ranges is not None else {axis: (0, size) for axis, size in sizes.items()}

    def expression(self, expr) -> _Named:
        if isinstance(expr, Index):
            start, stop = self.ranges[expr.axis]
            # f32 holds every index below 2^24 exactly and keeps an f32 tile f32 (ALiBi's
            # slope[h] * (x - q)); longer axes count in f64, and so does an f64 statement (its
            # operand tiles are f64: i / 7 must not be rounded to f32 there).
            wide = self.sizes[expr.axis] > 2**24 or any(t.dtype == np.float64 for t in self.arrays.values())
            dtype = np.float64 if wide else np.float32
            return _Named(np.arange(start, stop, dtype=dtype), (expr.axis,))
        if isinstance(expr, Const):
            if expr not in self._constants:  # evaluated once per constant
                self._constants[expr] = self.constant(expr.value)
            return _Named(self._constants[expr], ())
        if isinstance(expr, ScalarParam):
            return _Named(float(self.scalars[expr.name]), ())
        if isinstance(expr, Apply):
            definition = _definition(expr.fn)
            if definition is None:
                raise _Failure(f"the NumPy backend has no definition of the elementwise function {expr.fn!r}")
            args = [self.expression(a) for a in expr.args]
            axes = tuple(dict.fromkeys(a for arg in args for a in arg.axes))
            if not axes:
                result = _Named(float(definition(*(arg.values for arg in args))), ())
            else:
                result = _Named(definition(*(arg.aligned(axes) if arg.axes else arg.values for arg in args)), axes)
            # on numbers only (d^-0.5) it is folded, as a compiler folds it; on an array (one
            # without axes too) it runs for every element
            if self.count is not None and (reads(expr) or indices(expr)):
                self.count(operation_unit(expr), operation_count(expr) * self.elements)
            return result
        return super().expression(expr)


def _softmax(values: np.ndarray, along: int, count) -> np.ndarray:
    """:func:`napkin_dsl.reference.masked_softmax`, counting its operations: the max, the
    subtraction, exp, the sum and the division, each over every value."""
    result = masked_softmax(values, along)
    for unit in ("fma", "fma", "special", "fma", "fma"):  # max, subtract, exp, sum, divide
        count(unit, values.size)
    return result


def _logsumexp(values: np.ndarray, axis, count) -> np.ndarray:
    """:func:`napkin_dsl.reference.logsumexp`, counting its operations: the max, the
    subtraction, exp and the sum over every value, the log and the max added back per result."""
    result = logsumexp(values, axis)
    for unit in ("fma", "fma", "special", "fma"):
        count(unit, values.size)
    count("special", result.size)  # the log, per result
    count("fma", result.size)  # the max added back
    return result


# ---- contractions ----------------------------------------------------------------------------


def _contraction(operand_axes: list[tuple[str, ...]], out_axes: tuple[str, ...]) -> Callable:
    """A function of the operand tiles computing their contraction into ``out_axes`` order.

    Two operands (every contraction of the examples) become one batched ``numpy.matmul``:
    axes in both operands and the output are the batch, axes in both but not the output are
    contracted, the rest are the rows and columns. That is what ``einsum(optimize=True)``
    does too, without its per-call path search, which dominates on small tiles.
    """
    letters = {a: string.ascii_letters[i] for i, a in enumerate(dict.fromkeys(a for axes in operand_axes for a in axes))}
    spec = ",".join("".join(letters[a] for a in axes) for axes in operand_axes) + "->" + "".join(letters[a] for a in out_axes)
    if len(operand_axes) != 2 or any(len(set(axes)) != len(axes) for axes in operand_axes):
        return lambda *arrays: np.einsum(spec, *arrays, optimize=True)
    a, b = operand_axes
    if any(x not in b and x not in out_axes for x in a) or any(x not in a and x not in out_axes for x in b):
        return lambda *arrays: np.einsum(spec, *arrays, optimize=True)  # an axis summed within one operand
    batch = [x for x in out_axes if x in a and x in b]
    rows = [x for x in out_axes if x in a and x not in b]
    cols = [x for x in out_axes if x in b and x not in a]
    summed = [x for x in a if x in b and x not in out_axes]
    perm_a = [a.index(x) for x in batch + rows + summed]
    perm_b = [b.index(x) for x in batch + summed + cols]
    result_axes = batch + rows + cols
    perm_out = [result_axes.index(x) for x in out_axes]
    nb, nr, nc = len(batch), len(rows), len(cols)

    def contract(first: np.ndarray, second: np.ndarray) -> np.ndarray:
        left = first.transpose(perm_a)
        right = second.transpose(perm_b)
        batch_shape = left.shape[:nb]
        row_shape = left.shape[nb : nb + nr]
        col_shape = right.shape[right.ndim - nc :]
        k = math.prod(left.shape[nb + nr :])
        product = np.matmul(left.reshape(math.prod(batch_shape), math.prod(row_shape), k),
                            right.reshape(math.prod(batch_shape), k, math.prod(col_shape)))
        return product.reshape(batch_shape + row_shape + col_shape).transpose(perm_out)

    return contract


# ---- the interpreter -------------------------------------------------------------------------


def _integer(value, what: str) -> int:
    value = algebra.as_expr(value)
    if not value.is_number:
        names = ", ".join(sorted(s.name for s in value.free_symbols))
        raise NapkinError(f"cannot execute: {what} is {value}, which depends on unbound sizes ({names})",
                          hint=f"bind them when building the Program, e.g. kernel.program(hardware, {names.split(',')[0]}=64)")
    return int(value)


@functools.cache
def _aligner(source: tuple[str, ...], target: tuple[str, ...]) -> Callable[[np.ndarray], np.ndarray]:
    """A function putting values with dimensions ``source`` into ``target`` order, with size-1
    dimensions where ``source`` lacks an axis (for broadcasting). The same as the reference's
    ``_Named.aligned``, with the index work done once per pair of axis tuples, not per tile."""
    assert set(source) <= set(target), (source, target)
    order = [source.index(a) for a in target if a in source]
    transpose = order != sorted(order)
    expand = tuple(slice(None) if a in source else None for a in target)
    if None not in expand:
        return (lambda values: values.transpose(order)) if transpose else (lambda values: values)
    if transpose:
        return lambda values: values.transpose(order)[expand]
    return lambda values: values[expand]


class Interpreter:
    """The state of one execution: tile ranges, buffers per level, counts."""

    def __init__(self, program: Program, inputs: dict, scalars: dict, impls: dict | None, progress=None,
                 selected: ProgramSelection | None = None):
        self.program = program
        # Instruction selection for the profile's own target, as the model prices it by default:
        # the registers level and each contraction's unit below are read off it.
        self.selected = selected if selected is not None else select_program(program)
        self.diagram = program.diagram
        schedule = program.schedule
        self.levels = program.levels
        self.top = self.levels[0]
        self.sizes = {axis: _integer(schedule.axis_size(axis), f"axis {axis}") for axis in self.diagram.axes}
        # A split's part axes (x#): the number of parts, which the parts' saved states carry.
        self.sizes |= {part: _integer(schedule.axis_size(part), f"the parts of {part}") for part in schedule.parts}
        # The current tile: per axis, the [start, stop) its enclosing loops have narrowed it to.
        self.ranges = {axis: (0, size) for axis, size in self.sizes.items()}
        self.values: dict[str, dict[str, np.ndarray]] = {level: {} for level in self.levels}
        self.starts: dict[str, dict[str, tuple]] = {level: {} for level in self.levels}
        self.scalars = scalars
        self.impls = dict(impls or {})
        self.evaluator = _TileEvaluator(self.diagram, self.sizes, scalars, self.impls, self.ranges, self.count)
        below = self.levels[1:]
        # Tensor-core launches (isel.py) read contraction operands from shared memory into
        # registers with ldmatrix: counted as transfers at the registers level, as the model does.
        self.tensor = {} if program.hardware.symbolic else tensor_launches(program, self.selected)
        # FMA launches that keep accumulators in registers put the level in the report too (H 0).
        if self.tensor or fma_register_launches(program, self.selected):
            below = below + ("registers",)
        # Contractions count on the unit their launch's instruction path uses, as the model prices them.
        self.products = {launch.index: contraction_unit(program, launch, self.selected) for launch in program.launches}
        self.counts = Counts({lv: 0 for lv in below}, {lv: 0 for lv in below}, {}, 0, {lv: 0 for lv in below})
        self.empty_depth = 0  # how many enclosing loop trips are past the end of their axis
        # progress(done, total), if given, hears how many blocks (trips of the innermost group loops) are done.
        self.progress = progress
        self.block_loops, self.blocks_total = block_loops(program) if progress is not None else (set(), 0)
        self.blocks_done = self.next_report = 0
        self.chunk_status = None  # in a masked stream loop: "partial" or "full" (Mask.status)
        for array in self.diagram.input_arrays:
            self.values[self.top][array.name] = inputs[array.name]
            self.starts[self.top][array.name] = (0,) * len(array.axes)

    # -- helpers
    def extents(self, axes) -> tuple[int, ...]:
        ranges = self.ranges
        return tuple(ranges[a][1] - ranges[a][0] for a in axes)

    def origin(self, axes) -> tuple[int, ...]:
        ranges = self.ranges
        return tuple(ranges[a][0] for a in axes)

    def window(self, axes, starts) -> tuple[slice, ...]:
        """The current tile of ``axes`` inside a buffer whose tile starts at ``starts``."""
        ranges = self.ranges
        return tuple(slice(ranges[a][0] - s, ranges[a][1] - s) for a, s in zip(axes, starts, strict=False))

    def count_transfer(self, level: str, values: int, nbytes: int) -> None:
        counts = self.counts
        counts.H[level] += values
        counts.H_bytes[level] += values * nbytes
        if self.empty_depth:
            counts.empty_H[level] += values

    def count(self, unit: str, n) -> None:
        """``n`` operations evaluated on ``unit`` (see the module docstring)."""
        flops = self.counts.flops
        flops[unit] = flops.get(unit, 0) + n

    def block_done(self) -> None:
        self.blocks_done += 1
        if self.blocks_done >= self.next_report or self.blocks_done == self.blocks_total:
            self.progress(self.blocks_done, self.blocks_total)
            # About 200 reports a run: a bar has no use for more, and each costs a redraw.
            self.next_report = self.blocks_done + max(1, self.blocks_total // 200)

    # -- compiling the Program into closures (their set-up runs once, not once per trip)
    def run(self) -> tuple[dict, Counts]:
        with np.errstate(all="ignore"):  # NaN and inf propagate as IEEE says; producing them is not an error here
            for launch in self.program.launches:
                self.launch = launch
                roles = launch.launch.streams[0].roles if launch.launch.streams else {}
                self.roles = roles
                for node in self.compile(launch.body):
                    node()
                if id(launch) in self.block_loops:  # a launch of one block
                    self.block_done()
        outputs = {name: self.values[self.top][name] for name in self.diagram.outputs}
        return outputs, self.counts

    def compile(self, nodes) -> list[Callable[[], None]]:
        return [self.compile_loop(node) if isinstance(node, Loop) else self.compile_step(node) for node in nodes]

    def compile_loop(self, loop: Loop) -> Callable[[], None]:
        body = self.compile(loop.body)
        axis = loop.axis
        tile = _integer(loop.tile, f"the {loop.kind} size of {axis} at {loop.level}")
        trips = _integer(loop.trips, f"the trip count of {axis} at {loop.level}")
        ranges = self.ranges
        if loop.mask is not None:
            return self.masked_loop(loop, body, tile, trips)
        block = id(loop) in self.block_loops
        part = loop.part  # a split's loop also numbers its parts along the part axis

        def run_loop():
            start, stop = ranges[axis]
            if part is not None:
                held = ranges[part]
            for trip in range(trips):
                first = min(start + trip * tile, stop)
                last = min(first + tile, stop)
                empty = first == last
                if empty:
                    self.counts.empty_tiles += 1
                    self.empty_depth += 1
                ranges[axis] = (first, last)
                if part is not None:
                    ranges[part] = (start // tile + trip, start // tile + trip + 1)
                for node in body:
                    node()
                if empty:
                    self.empty_depth -= 1
                if block:
                    self.block_done()
            ranges[axis] = (start, stop)
            if part is not None:
                ranges[part] = held

        return run_loop

    def masked_loop(self, loop: Loop, body, tile: int, trips: int) -> Callable[[], None]:
        """A stream loop with a Mask: chunks the mask hides in full are never visited (no load,
        no step, nothing counted), as the Program says; the others record whether the mask
        holds them in part, where the softmax's test is counted."""
        axis, mask, ranges = loop.axis, loop.mask, self.ranges
        constants = mask.constants(lambda a: self.sizes[a])
        others = [a for a in mask.axes if a != axis]

        def run_loop():
            start, stop = ranges[axis]
            if any(ranges[a][0] >= ranges[a][1] for a in others):
                return  # an empty group visits nothing
            for trip in range(trips):
                first = min(start + trip * tile, stop)
                last = min(first + tile, stop)
                if first == last:
                    continue  # past the end of the axis: no chunk, as the model counts
                ranges[axis] = (first, last)
                status = mask.status(ranges, constants)
                if status == "masked":
                    continue
                self.chunk_status = status
                for node in body:
                    node()
                self.chunk_status = None
            ranges[axis] = (start, stop)

        return run_loop

    def compile_step(self, step: Step) -> Callable[[], None]:
        handler = getattr(self, f"step_{step.op}", None)
        if handler is None:
            raise AssertionError(f"napkin bug: the NumPy backend has no step {step.op!r}")
        run_step = handler(step)
        count_fragments = self.fragment_counter(step)
        counts = self.counts

        def run():
            run_step()
            count_fragments()
            counts.steps += 1

        return run

    def fragment_counter(self, step: Step) -> Callable[[], None]:
        """ldmatrix traffic of a tensor-core contraction (``paths.plan.shared_reads``, as the model
        counts it); and an elementwise step's reads of plain shared tiles, one a fragment element."""
        s = step.statement
        entry = self.tensor.get(self.launch.index)
        level = self.program.schedule.compute_level
        if entry is not None and (names := vector_reads(self.program, step, entry[0], plain_tiles(self.launch, level))):
            sizes = [DTYPE_BYTES[self.program.diagram.arrays[name].dtype] for name in names]

            def count_vectors():
                elements = math.prod(self.extents(step.axes))
                for size in sizes:
                    self.count_transfer("registers", elements, size)

            return count_vectors
        if (entry is None or s is None or step.op not in ("compute", "accumulate") or s.target not in entry[0].mmas
                or (step.level, s.target) in step.reads):
            return lambda: None
        plan = entry[0]
        nbytes = DTYPE_BYTES[plan.mmas[s.target].dtype]

        def count():
            values = shared_reads(plan, s.target, lambda axes: math.prod(self.extents(axes)))
            self.count_transfer("registers", values, nbytes)

        return count

    # -- transfers
    def step_load(self, step: Step) -> Callable[[], None]:
        name, axes, source, dest, level = step.array, step.axes, step.source, step.dest, step.level
        dtype = numpy_dtype(step.dtype)
        nbytes = DTYPE_BYTES[step.dtype]
        upper_values, upper_starts = self.values[source], self.starts[source]
        lower_values, lower_starts = self.values[dest], self.starts[dest]
        view = self.diagram.arrays.get(name)  # not a split's part array (O.acc.part)
        if view is not None and view.window is not None and source == self.top:
            # A window read's tile is gathered from its source, as the kernels gather it: what it
            # moves from device memory is the box of the source its indices span, found from the indices.
            shape = tuple(self.sizes[a] for a in self.diagram.arrays[view.window.source].axes)

            def moved() -> int:
                return tile_footprint(view, {a: self.ranges[a] for a in view.axes}, shape, self.sizes)

            def fetch():
                return gather(view, upper_values[view.window.source], self.sizes, {a: self.ranges[a] for a in view.axes})
        else:
            moved = None

            def fetch():
                return upper_values[name][self.window(axes, upper_starts[name])]

        def load():
            tile = fetch().astype(dtype)  # a copy, converted
            lower_values[name] = tile
            lower_starts[name] = self.origin(axes)
            self.count_transfer(level, tile.size if moved is None else moved(), nbytes)

        return load

    def step_save(self, step: Step) -> Callable[[], None]:
        name, axes, source, dest, level = step.array, step.axes, step.source, step.dest, step.level
        held_name = step.reads[0][1]  # a split's part saves a state (O.acc) as its part array (O.acc.part)
        dtype = numpy_dtype(step.dtype)
        nbytes = DTYPE_BYTES[step.dtype]
        lower_values = self.values[source]
        upper_values, upper_starts = self.values[dest], self.starts[dest]
        held = self.launch.buffers[(source, held_name)].axes  # a computed tile is in its statement's axis order
        # a part's state lacks the part axis, one part long here: put it in front
        missing = tuple(a for a in axes if a not in held)
        held = missing + tuple(held)
        order = None if tuple(held) == tuple(axes) else [held.index(a) for a in axes]
        full_shape = tuple(self.sizes[a] for a in self.launch.buffers[(dest, name)].axes)

        def save():
            tile = lower_values[held_name]
            if missing:
                tile = tile.reshape((1,) * len(missing) + tile.shape)
            if order is not None:
                tile = tile.transpose(order)
            if name not in upper_values:  # the top level: the whole array, at its first save
                # a sum over groups adds into zeros (the launcher zeroes the output: tensorcore, lowering)
                upper_values[name] = np.zeros(full_shape, dtype) if step.add else _empty(full_shape, dtype)
                upper_starts[name] = (0,) * len(axes)
            if dtype != tile.dtype:
                # as the reference converts: integers rounded (f32 rounding error must not truncate
                # 2.9999 to 2), fp8 saturating (the largest finite value, never NaN or inf)
                tile = convert(tile, step.dtype)
            if step.add:  # a group's partial sum, added to the others' (relabel.summed_over_groups)
                upper_values[name][self.window(axes, upper_starts[name])] += tile
            else:
                upper_values[name][self.window(axes, upper_starts[name])] = tile
            self.count_transfer(level, tile.size * step.passes, nbytes)

        return save

    def step_alloc(self, step: Step) -> Callable[[], None]:
        name, axes, level = step.array, step.axes, step.level
        dtype = numpy_dtype(step.dtype)
        values, starts = self.values[level], self.starts[level]

        def alloc():
            values[name] = np.zeros(self.extents(axes), dtype) if step.add else _empty(self.extents(axes), dtype)
            starts[name] = self.origin(axes)

        return alloc

    # -- compute-level state and operands
    def store(self, level: str, name: str, axes, tile: np.ndarray) -> None:
        # asarray: a reduction to no axes yields a NumPy scalar; buffers are always arrays
        # (0-d ones included), so every later step may update them in place.
        self.values[level][name] = np.asarray(tile)
        self.starts[level][name] = self.origin(axes)

    def product(self, box: Contract, operands, out_axes):
        """A closure computing a contraction's product of the current operand tiles, counting
        2 operations (a multiply-add) per element of its iteration space, read off the tiles."""
        contract = _contraction([r.axes for r in box.operands], out_axes)
        names = [r.array for r in box.operands]
        reads = [(r.array, r.axes) for r in box.operands]
        unit = self.products[self.launch.index]

        def product():
            tiles = operands()
            lengths = {axis: length for name, axes in reads for axis, length in zip(axes, tiles[name].shape, strict=False)}
            self.count(unit, 2 * math.prod(lengths.values()))
            return contract(*(tiles[n] for n in names))

        return product

    def operands(self, s: Statement, level: str, dtype: np.dtype) -> Callable[[], dict]:
        """A function returning the statement's input tiles in the compute dtype, by name (a
        contraction's operands: its factor's arrays are its scale step's, :meth:`scale_step`)."""
        names = tuple(dict.fromkeys(r.array for r in s.box.operands)) if isinstance(s.box, Contract) else s.inputs
        values = self.values[level]

        def operands():
            tiles = {}
            for name in names:
                tile = values[name]
                tiles[name] = tile if tile.dtype == dtype else tile.astype(dtype)
            return tiles

        return operands

    def named_operand(self, s: Statement, operands: Callable[[], dict]) -> Callable[[], np.ndarray]:
        """The box's operand expression evaluated on the tiles, aligned to the statement's iteration axes."""
        evaluator = self.evaluator
        expr = s.box.operand
        axes = s.iteration_axes
        if isinstance(expr, Read) and set(expr.axes) == set(axes):  # the common case, softmax[x](S): no evaluator
            align = _aligner(expr.axes, axes)
            name = expr.array
            return lambda: align(operands()[name])
        untested = self.untested(s, expr)

        def operand():
            evaluator.arrays = operands()
            evaluator.elements = math.prod(self.extents(axes))
            chosen = untested if untested is not None and self.chunk_status == "full" else expr
            values = self.evaluate(s, lambda: evaluator.expression(chosen).aligned(axes))
            return np.broadcast_to(values, self.extents(axes))

        return operand

    def untested(self, s: Statement, expr):
        """A = the then-branch of where(COND, A, -inf) when ``s`` tests a mask of this launch's
        stream (Mask.tested): on a chunk the mask holds in full the test is skipped, as the
        Program counts it; None otherwise."""
        tested = any(loop.mask is not None and loop.mask.tested == s.target
                     for _, loops in walk(self.launch.body) for loop in loops)
        return expr.args[1] if tested and isinstance(expr, Apply) and expr.fn == "where" else None

    def evaluate(self, s: Statement, compute: Callable):
        try:
            return compute()
        except _Failure as failure:
            raise NapkinCallError(failure.message, s.span, failure.hint or f"while computing {s.target} = {s.describe()}") from None

    def state(self, s: Statement | str, suffix: str, level: str) -> tuple[str, tuple[str, ...], np.dtype]:
        """A piece of streaming state of statement ``s`` (or of the statement with that target)."""
        target = s if isinstance(s, str) else s.target
        buffer = self.launch.buffers[(level, f"{target}.{suffix}")]
        return buffer.name, buffer.axes, numpy_dtype(buffer.dtype)

    # -- compute
    def step_compute(self, step: Step) -> Callable[[], None]:
        s, level = step.statement, step.level
        box = s.box
        dtype = numpy_dtype(step.dtype)
        target, axes = s.target, s.axes
        if isinstance(box, Contract) and step.writes[0] in step.reads:
            return self.scale_step(step)
        operands = self.operands(s, level, dtype)
        if isinstance(box, Contract):
            product = self.product(box, operands, axes)

            def compute():
                self.store(level, target, axes, product().astype(dtype, copy=False))

            return compute
        if isinstance(box, Map):
            evaluator = self.evaluator
            untested = self.untested(s, box.expr)

            def compute():
                evaluator.arrays = operands()
                evaluator.elements = math.prod(self.extents(axes))
                chosen = untested if untested is not None and self.chunk_status == "full" else box.expr
                result = self.evaluate(s, lambda: evaluator.expression(chosen).aligned(axes))
                self.store(level, target, axes, np.broadcast_to(result, self.extents(axes)).astype(dtype))

            return compute
        if isinstance(box, Reduce):
            operand = self.named_operand(s, operands)
            along = tuple(s.iteration_axes.index(a) for a in box.axes)
            kept = tuple(a for a in s.iteration_axes if a not in box.axes)
            count = self.count
            entry = reduction(box.op)
            if entry.combine is None:
                reduce = functools.partial(_logsumexp, count=count)
            else:  # one operation per value reduced; a mean divides each result by the count
                fold = ELEMENTWISE[entry.combine]  # a ufunc: reduce from the table's start
                divisor = math.prod(self.sizes[a] for a in box.axes) if entry.divides else None

                def reduce(values, axis):
                    count("fma", values.size)
                    result = fold.reduce(values, axis=axis, initial=entry.start)
                    if divisor is None:
                        return result
                    count("fma", np.size(result))
                    return result / values.dtype.type(divisor)

            align = _aligner(kept, axes)

            def compute():
                result = align(reduce(operand(), axis=along))
                self.store(level, target, axes, np.broadcast_to(result, self.extents(axes)).astype(dtype))

            return compute
        if isinstance(box, Softmax):
            operand = self.named_operand(s, operands)
            along = s.iteration_axes.index(box.axis)

            def compute():
                # The reference's softmax: the maximum subtracted first, a fully masked row 0.
                self.store(level, target, axes, _softmax(operand(), along, self.count).astype(dtype, copy=False))

            return compute
        if isinstance(box, Scan):
            operand = self.named_operand(s, operands)
            along = s.iteration_axes.index(box.axis)
            scan = np.cumsum if box.op == "sum" else np.cumprod
            streamed = (level, f"{target}.carry") in step.reads
            if streamed:
                carry_name, carry_axes, _ = self.state(s, "carry", level)
                rows = tuple(a for a in s.iteration_axes if a != box.axis)
                align_carry = _aligner(carry_axes, rows)

            def compute():
                values = operand()
                self.count("fma", values.size)  # one add (or multiply) an element into the running value
                if not streamed:
                    self.store(level, target, axes, scan(values, axis=along).astype(dtype, copy=False))
                    return
                # the chunk's scan starts from the carry, in order: the carry first, then the chunk
                carry = np.expand_dims(align_carry(self.values[level][carry_name]), along).astype(values.dtype)
                result = np.delete(scan(np.concatenate([carry, values], axis=along), axis=along), 0, axis=along)
                self.store(level, target, axes, result.astype(dtype, copy=False))
                last = np.take(result, result.shape[along] - 1, axis=along)
                self.store(level, carry_name, carry_axes, _aligner(rows, carry_axes)(last).astype(self.values[level][carry_name].dtype))

            return compute
        if isinstance(box, Opaque):
            flops = opaque_flops(box)  # declared by signature only: its FLOPs are a symbol per copy

            def compute():
                self.count("opaque", flops * math.prod(self.extents(s.woven)))
                evaluator = _TileEvaluator(self.diagram, dict(zip(self.ranges, self.extents(self.ranges), strict=False)), self.scalars, self.impls)
                evaluator.arrays = operands()
                self.store(level, target, axes, self.evaluate(s, lambda: evaluator.opaque(s, box)).astype(dtype))

            return compute
        raise AssertionError(f"napkin bug: unknown box {box!r}")

    def scale_step(self, step: Step) -> Callable[[], None]:
        """``S *= scale``: a contraction's factor (a number, or arrays over its output's axes
        such as ``O *= sV[b h]``), applied to its (finalised) output, counting one multiplication
        per output and the factor's own operations per output (the evaluator's count)."""
        s, level = step.statement, step.level
        values, evaluator, target = self.values[level], self.evaluator, s.target
        scale = s.box.scale
        held = self.launch.buffers[(level, target)].axes
        names = tuple(name for lv, name in step.reads if lv == level and name != target)

        def apply():
            dtype = values[target].dtype
            evaluator.arrays = {name: values[name] if values[name].dtype == dtype else values[name].astype(dtype) for name in names}
            evaluator.elements = values[target].size
            factor = self.evaluate(s, lambda: evaluator.expression(scale))
            tile = values[target]
            # Written back, not `tile *= factor`: a result with no axes (D[] = R[z] * A[z] * 2
            # after a streamed softmax) can be a NumPy scalar, which `*=` rebinds instead of
            # updating, and the factor would be lost.
            values[target] = np.asarray(tile * (factor.values if not factor.axes else factor.aligned(held)), dtype=tile.dtype)
            self.count("fma", values[target].size)

        return apply

    # -- streams
    def step_init(self, step: Step) -> Callable[[], None]:
        s, level = step.statement, step.level
        role = self.roles[s.index]
        if role == "online":
            states = [self.state(s, "max", level) + (-np.inf,), self.state(s, "sum", level) + (0.0,)]
        elif role == "scan":  # the carry: the running value before the first chunk
            states = [self.state(s, "carry", level) + (SCAN_FOLDS[s.box.op][0],)]
        else:  # accumulate (a running sum, max or min) or rescaled (a contraction's running sum)
            start = accumulated(s.box).start
            states = [self.state(s, "acc", level) + (start,)]

        def init():
            for name, axes, dtype, start in states:
                self.store(level, name, axes, np.full(self.extents(axes), start, dtype))

        return init

    def step_rescale(self, step: Step) -> Callable[[], None]:
        s, level = step.statement, step.level
        values, count = self.values[level], self.count
        if self.roles[s.index] == "online":
            # m' = max(m, max over the chunk); scale = exp(m - m'); m = m'
            operand = self.named_operand(s, self.operands(s, level, numpy_dtype(step.dtype)))
            along = s.iteration_axes.index(s.box.axis)
            chunk_axes = tuple(a for a in s.iteration_axes if a != s.box.axis)
            m_name, m_axes, _ = self.state(s, "max", level)
            scale_name, scale_axes, _ = self.state(s, "scale", level)

            align_max = _aligner(chunk_axes, m_axes)

            def rescale():
                chunk = operand()
                chunk_max = align_max(np.max(chunk, axis=along, initial=-np.inf))
                m = values[m_name]
                m_new = np.maximum(m, chunk_max)
                # A row masked so far (m = -inf) has nothing to rescale: its factor is 0, not NaN.
                self.store(level, scale_name, scale_axes, np.where(m == -np.inf, 0.0, np.exp(m - m_new)).astype(m.dtype))
                self.store(level, m_name, m_axes, m_new)
                count("fma", chunk.size)  # the chunk's max
                count("fma", 2 * m.size)  # the new max, old - new
                count("special", m.size)  # exp(old - new)

            return rescale
        # a contraction consuming the online softmax: O.acc *= scale
        acc_name, acc_axes, _ = self.state(s, "acc", level)
        scale_name, scale_axes, _ = self.state(step.online, "scale", level)  # the link the Program stores

        align_scale = _aligner(scale_axes, acc_axes)

        def rescale():
            values[acc_name] *= align_scale(values[scale_name])
            count("fma", values[acc_name].size)

        return rescale

    def step_online(self, step: Step) -> Callable[[], None]:
        # P = exp(S - m); l = l * scale + sum over the chunk of P
        s, level = step.statement, step.level
        values = self.values[level]
        operand = self.named_operand(s, self.operands(s, level, numpy_dtype(step.dtype)))
        axes = s.iteration_axes
        along = axes.index(s.box.axis)
        chunk_axes = tuple(a for a in axes if a != s.box.axis)
        m_name, m_axes, _ = self.state(s, "max", level)
        l_name, l_axes, _ = self.state(s, "sum", level)
        scale_name, scale_axes, _ = self.state(s, "scale", level)
        held = self.launch.buffers[(level, s.target)].axes
        dtype = numpy_dtype(self.launch.buffers[(level, s.target)].dtype)

        align_max, align_sum = _aligner(m_axes, axes), _aligner(chunk_axes, l_axes)
        align_scale, align_p = _aligner(scale_axes, l_axes), _aligner(axes, held)

        count = self.count

        def online():
            m = align_max(values[m_name])
            # Masked entries are -inf and become 0; a row masked so far subtracts 0, not -inf.
            p = np.subtract(operand(), np.where(m == -np.inf, 0.0, m).astype(m.dtype))
            np.exp(p, out=p)
            values[l_name] = values[l_name] * align_scale(values[scale_name]) + align_sum(np.sum(p, axis=along))
            count("fma", 2 * p.size)  # subtract the max, sum
            count("special", p.size)  # exp
            count("fma", 2 * values[l_name].size)  # sum * factor + the chunk's sum
            self.store(level, s.target, held, align_p(p).astype(dtype, copy=False))

        return online

    def step_accumulate(self, step: Step) -> Callable[[], None]:
        s, level = step.statement, step.level
        box = s.box
        values = self.values[level]
        dtype = numpy_dtype(step.dtype)
        acc_name, acc_axes, _ = self.state(s, "acc", level)
        operands = self.operands(s, level, dtype)
        if isinstance(box, Contract):
            product = self.product(box, operands, acc_axes)

            def accumulate():
                values[acc_name] += product()

            return accumulate
        operand = self.named_operand(s, operands)
        along = tuple(s.iteration_axes.index(a) for a in box.axes)
        kept = tuple(a for a in s.iteration_axes if a not in box.axes)
        # each chunk folded from the reduction's start, then into the running result; a mean
        # accumulates a sum that finalise divides by the reduced size
        entry = reduction(box.op)
        fold = ELEMENTWISE[entry.combine]

        align = _aligner(kept, acc_axes)

        count = self.count

        def accumulate():
            chunk = operand()
            part = align(fold.reduce(chunk, axis=along, initial=entry.start))
            acc = values[acc_name]
            fold(acc, part, out=acc)
            count("fma", chunk.size + acc.size)  # the chunk reduced, then combined with the running result

        return accumulate

    def step_finalise(self, step: Step) -> Callable[[], None]:
        s, level = step.statement, step.level
        values = self.values[level]
        if self.roles[s.index] == "lse":
            return self.lse_finalise(step)
        acc_name, acc_axes, _ = self.state(s, "acc", level)
        out = self.launch.buffers[(level, s.target)]
        dtype = numpy_dtype(out.dtype)
        if self.roles[s.index] == "rescaled":
            l_name, l_axes, _ = self.state(step.online, "sum", level)

            align_sum, align_out = _aligner(l_axes, acc_axes), _aligner(acc_axes, out.axes)

            def finalise():
                total = align_sum(values[l_name])
                # A fully masked row summed nothing: its output is 0 (the reference's convention).
                result = np.where(total == 0, 0.0, values[acc_name] / np.where(total == 0, 1.0, total)).astype(total.dtype)
                self.count("fma", values[acc_name].size)  # the division by the sum
                self.store(level, s.target, out.axes, align_out(result).astype(dtype, copy=False))

            return finalise
        # a mean divides by the count (by 1 too: the division is the model's, as the GPU code's)
        divisor = math.prod(self.sizes[a] for a in s.box.axes) if isinstance(s.box, Reduce) and reduction(s.box.op).divides else None

        align_out = _aligner(acc_axes, out.axes)

        def finalise():
            result = values[acc_name]
            if divisor is not None:
                result = result / divisor
                self.count("fma", result.size)
            self.store(level, s.target, out.axes, align_out(result).astype(dtype))

        return finalise

    def step_merge(self, step: Step) -> Callable[[], None]:
        """One part's states merged into the running ones (the combine launch of a split)."""
        s, level = step.statement, step.level
        values, count = self.values[level], self.count
        role = self.roles[s.index]
        buffers = self.launch.buffers

        def squeeze(name: str) -> np.ndarray:
            return values[name].reshape(values[name].shape[1:])  # the part axis, one part long here

        if role == "accumulate":
            (_, acc), (_, incoming) = step.reads
            fold = ELEMENTWISE["add" if isinstance(s.box, Contract) or reduction(s.box.op).divides else reduction(s.box.op).combine]
            align = _aligner(buffers[(level, incoming)].axes[1:], buffers[(level, acc)].axes)

            def merge():
                values[acc] = np.asarray(fold(values[acc], align(squeeze(incoming))), dtype=values[acc].dtype)
                count("fma", values[acc].size)

            return merge
        if role == "online":
            (_, m_name), (_, l_name), (_, m_part), (_, l_part) = step.reads
            _, _, (_, scale), (_, scale_part) = step.writes
            m_axes = buffers[(level, m_name)].axes
            align = _aligner(buffers[(level, m_part)].axes[1:], m_axes)

            def merge():
                m, l_ = values[m_name], values[l_name]
                mp, lp = align(squeeze(m_part)), align(squeeze(l_part))
                m_new = np.maximum(m, mp)
                # a side that saw only masked entries (max -inf) weighs 0, not exp(-inf + inf)
                a = np.where(m == -np.inf, 0.0, np.exp(m - m_new)).astype(m.dtype)
                b = np.where(mp == -np.inf, 0.0, np.exp(mp - m_new)).astype(m.dtype)
                values[l_name] = (l_ * a + lp * b).astype(l_.dtype)
                values[m_name] = m_new
                self.store(level, scale, m_axes, a)
                self.store(level, scale_part, m_axes, b)
                count("fma", 6 * m.size)  # the max, two differences, l a + l_p b
                count("special", 2 * m.size)  # the two factors

            return merge
        # an output the online softmax rescales: O = O a + O_p b
        (_, acc), (_, incoming), (_, scale), (_, scale_part) = step.reads
        acc_axes = buffers[(level, acc)].axes
        align_in = _aligner(buffers[(level, incoming)].axes[1:], acc_axes)
        align_a = _aligner(buffers[(level, scale)].axes, acc_axes)
        align_b = _aligner(buffers[(level, scale_part)].axes, acc_axes)

        def merge():
            o = values[acc]
            values[acc] = (o * align_a(values[scale]) + align_in(squeeze(incoming)) * align_b(values[scale_part])).astype(o.dtype)
            count("fma", 3 * o.size)

        return merge

    def lse_finalise(self, step: Step) -> Callable[[], None]:
        """L = P.max + log(P.sum): the log-sum-exp from the online softmax's state after the
        stream (-inf for a fully masked row, whose sum is 0 and max -inf)."""
        s, level = step.statement, step.level
        values = self.values[level]
        (_, m_name), (_, l_name) = step.reads
        m_axes, l_axes = self.launch.buffers[(level, m_name)].axes, self.launch.buffers[(level, l_name)].axes
        out = self.launch.buffers[(level, s.target)]
        align_m, align_l = _aligner(m_axes, out.axes), _aligner(l_axes, out.axes)
        dtype = numpy_dtype(out.dtype)

        def finalise():
            m = align_m(values[m_name])
            result = np.where(m == -np.inf, -np.inf, m + np.log(align_l(values[l_name])))
            self.count("fma", m.size)  # max + log(sum)
            self.count("special", m.size)
            self.store(level, s.target, out.axes, result.astype(dtype, copy=False))

        return finalise

def _empty(shape, dtype: np.dtype) -> np.ndarray:
    """A new tile whose every value shows it was never written: NaN for floats, 0 otherwise."""
    if dtype.kind in "iub":
        return np.zeros(shape, dtype)
    return np.full(shape, np.nan, dtype)


def block_loops(program: Program) -> tuple[set, int]:
    """The innermost group loops outside every stream loop (by ``id``: one trip of one is one block
    of a GPU's grid), and the launches without a group loop (one block each, as the model counts
    them), with how many blocks the whole Program runs: the unit of progress."""
    loops: set[int] = set()
    total = 0

    def visit(nodes, outer: int) -> bool:
        nonlocal total
        found = False
        for node in nodes:
            if isinstance(node, Loop) and node.kind == "group":
                found = True
                trips = outer * _integer(node.trips, f"the trip count of {node.axis} at {node.level}")
                if not visit(node.body, trips):
                    loops.add(id(node))
                    total += trips
        return found

    for launch in program.launches:
        if not visit(launch.body, 1):
            loops.add(id(launch))
            total += 1
    return loops, total


def execute(program: Program, inputs: dict[str, np.ndarray], scalars: dict | None = None,
            impls: dict | None = None, progress=None, selected: ProgramSelection | None = None) -> tuple[dict[str, np.ndarray], Counts]:
    """Run a Program with NumPy; return ``(outputs by name, Counts)``.

    ``program`` must have every size bound (``kernel.program(hardware, q=..., ...)``).
    ``inputs`` maps each input array of the diagram to a NumPy array of the Program's sizes
    (converted to the declared dtype if it is not already; never written); ``scalars`` maps
    scalar parameters to numbers; ``impls`` maps opaque box names to callables (the
    reference's calling convention, on tiles). Outputs are new arrays in their declared dtypes.
    ``progress``, if given, is called as ``progress(done, total)`` with the blocks run so far (a
    :class:`napkin_dsl.progress.Progress` draws it; a Program without group loops reports nothing).
    ``selected``: the instruction selection the counts follow (``isel.select_program``; default:
    the profile's own target's, as :func:`~napkin_dsl.cost.cost_of` prices by default).
    """
    diagram = program.diagram
    scalars = dict(scalars or {})
    checked = {}
    for array in diagram.input_arrays:
        if array.name not in inputs:
            raise NapkinCallError(f"execute({diagram.name}) is missing input {array.name}")
        value = np.asarray(inputs[array.name])
        expected = tuple(_integer(program.schedule.axis_size(a), f"axis {a}") for a in array.axes)
        if value.shape != expected:
            raise NapkinCallError(f"input {array.name}[{' '.join(array.axes)}] has shape {value.shape}, "
                                  f"but the Program was built for {expected}")
        checked[array.name] = value.astype(numpy_dtype(array.dtype), copy=False)
    missing = [name for name in diagram.scalars if name not in scalars]
    if missing:
        raise NapkinCallError(f"execute({diagram.name}) is missing scalar {', '.join(missing)}")
    return Interpreter(program, checked, scalars, impls, progress, selected).run()


# ---- memory ------------------------------------------------------------------------------------


def _buffer_bytes(program: Program, level: str, axes, dtype: str) -> int:
    """The largest tile of a buffer at a level over the launches (partitions may be scoped)."""
    return max(math.prod(_integer(launch.schedule.extent(a, level), f"axis {a}") for a in axes)
               for launch in program.launches) * numpy_dtype(dtype).itemsize


def estimate_bytes(program: Program, tiles: bool = True) -> int:
    """Host memory one call needs, about: the copies of the inputs, the arrays kept at the top
    level (outputs, materialised intermediates), and with ``tiles`` the NumPy backend's buffers
    at the lower levels, twice over for the temporaries a step makes."""
    diagram = program.diagram
    top = program.levels[0]
    whole = 0
    for array in diagram.arrays.values():
        if array.role == "input" or array.role == "output" or any(
                (top, array.name) in launch.buffers for launch in program.launches):
            whole += _buffer_bytes(program, top, array.axes, array.dtype)
    below = 0
    if tiles:
        for launch in program.launches:
            held = sum(_buffer_bytes(program, level, b.axes, b.dtype) for (level, _), b in launch.buffers.items() if level != top)
            below = max(below, 2 * held)
    return whole + below


def check_memory(program: Program, limit: float | None = None, tiles: bool = True) -> int:
    """Raise NapkinCallError before anything is allocated if a call would need more than
    ``limit`` bytes (default: 25% of physical memory, as the reference's guard); return the estimate."""
    need = estimate_bytes(program, tiles)
    limit, source = memory_limit(limit, given="the limit given")
    if need > limit:
        diagram = program.diagram
        schedule = program.schedule
        shown = ", ".join(f"{a}={schedule.axis_size(a)}" for a in diagram.axes)
        raise NapkinCallError(
            f"running {diagram.name} on the host would need about {need:,} bytes ({_gib(need)}) at {shown}, "
            f"more than {int(limit):,} ({source})",
            hint="call it with smaller arrays, or on a GPU backend",
        )
    return need


# ---- checking a kernel: backend against reference, counts against report ----------------------

# ---- the tolerance of a check run ------------------------------------------------------------
#
# A run is compared with the float64 reference by max |error| / max |reference| over the outputs.
# The error a right Program makes comes from where it rounds, so the tolerance is read off the
# Program: as FlashAttention's tests allow an implementation at most twice the error of a plain
# one in the same precision, every rounding may cost twice its unit roundoff u (half an ulp,
# relative), times how much the rest of the kernel amplifies it:
#
# * a value rounded to a narrow dtype (an output, an array saved to the top level in a narrower
#   dtype than it was computed in, a tensor-core operand packed to bf16/f16 in registers) errs
#   by u relative to itself. Sums and contractions downstream average such independent errors
#   (their relative error stays about u), but an exponential turns the absolute error of its
#   argument into relative error of its result: exp(S (1 + u)) = exp(S) (1 + u S). So a rounded
#   value that reaches a softmax or exp counts sqrt(n) times, where sqrt(n) is the magnitude of
#   that exponential's argument for the run's unit-normal inputs: n the product of the lengths
#   summed on the way (S = Q * K over d has |S| ~ sqrt(d)), the magnitudes of terms added in the
#   argument added and of factors multiplied. A value the same statement reads outside the
#   argument (P in the backward's dS = P * (dP - D) + dL * exp(S - L)) is not amplified there;
# * the compute dtype's own arithmetic (f32) accumulates over each statement's reduction length
#   n_s (about sqrt(n_s) u, probabilistically), amplified the same way; below a floor for
#   library functions (the backends' exp, erf) that are not correctly rounded.
#
# Measured on random kernels with bf16/f16 intermediates, errors stay within half of this;
# a bug such as a dropped factor 0.5 (relative error 0.5 or 1) stays far outside it.

UNIT_ROUNDOFF = {"f64": 2.0**-53, "f32": 2.0**-24, "f16": 2.0**-11, "bf16": 2.0**-8,
                 "fp8e4m3": 2.0**-4, "fp8e5m2": 2.0**-3, "i32": 0.0, "i64": 0.0}
# What one rounding to a dtype may cost before amplification: twice its unit roundoff. Integer
# results are rounded to the nearest integer by the reference too: they must be exact.
TOLERANCE = {dtype: 2 * u for dtype, u in UNIT_ROUNDOFF.items()}
# The least tolerance of a Program computing in a dtype: its libm and, in f32, the NumPy
# backend's GELU fit (relative error 1.2e-7, see gelu) are not correctly rounded. In f64 every
# backend computes in double with functions good to a few ulp (1e-12 is thousands of them), and
# arithmetic done in f32 instead (errors of 1e-8 to 1e-6) fails the check.
ARITHMETIC_FLOOR = {"f32": 1e-5, "f64": 1e-12}
# Elementwise functions whose result's relative error is their argument's absolute error.
EXPONENTIAL = {"exp"}
DEFAULT_AXIS_SIZE = 64
DEFAULT_PARTITION_SIZE = 16


def tolerance(program: Program) -> float:
    """The relative error a right run of ``program`` may show against the float64 reference
    (max |error| / max |reference|), from the dtypes the Program rounds to and the reduction
    lengths (see the comment above): ``max(floor, sum over statements of 2 u_c sqrt(n_s) a_s)
    + sum over rounded arrays R of TOLERANCE[dtype of R] a_R``, where ``a`` is the magnitude
    of the largest exponential argument a value reaches (1 if it reaches none)."""
    diagram = program.diagram
    schedule = program.schedule
    sizes = {axis: _integer(schedule.axis_size(axis), f"axis {axis}") for axis in diagram.axes}

    def length(axes) -> int:
        return math.prod(sizes[a] for a in axes)

    # Typical magnitudes for unit-normal inputs: a sum of n terms grows by sqrt(n).
    magnitude = {array.name: 1.0 for array in diagram.input_arrays}

    def operands(s: Statement) -> float:
        return math.prod(magnitude.get(name, 1.0) for name in s.inputs)

    for s in diagram.statements:
        box = s.box
        if isinstance(box, Softmax):
            magnitude[s.target] = 1.0
        elif isinstance(box, Contract) or (isinstance(box, (Reduce, Scan)) and box.op == "sum"):
            magnitude[s.target] = math.sqrt(length(s.consumed)) * operands(s)
        else:  # maps, max/min/mean, opaque boxes: as large as their operands
            magnitude[s.target] = operands(s)

    def exponents(s: Statement) -> list:
        """The arguments of the statement's exponentials: a softmax's operand, a map's exp calls'."""
        if isinstance(s.box, Softmax):
            return [s.box.operand]
        return _arguments(s.box.expr, EXPONENTIAL) if isinstance(s.box, Map) else []

    def size(expr) -> float:
        """An exponential argument's magnitude: its absolute error is about u times it. Terms added
        or subtracted add their magnitudes (so do their absolute errors), factors multiply theirs;
        where(c, a, b) is the larger branch's; any other function, the product of what it reads."""
        if isinstance(expr, Read):
            return magnitude.get(expr.array, 1.0)
        if not isinstance(expr, Apply):
            return 1.0  # a constant or an index: no rounded input of the run's
        if expr.fn in ("add", "sub"):
            return sum(size(a) for a in expr.args)
        if expr.fn in ("mul", "neg"):
            return math.prod(size(a) for a in expr.args)
        if expr.fn == "where":
            return max(size(a) for a in expr.args[1:])
        return math.prod(magnitude.get(r.array, 1.0) for r in reads(expr))

    # amplification[name]: the largest exponential argument the array's values reach. An array
    # read inside an exponential's argument reaches that argument's magnitude; one the statement
    # reads outside it (P in dS = P * (dP - D) + dL * exp(S - L)) errs linearly there, and
    # reaches only what the statement's own values reach.
    amplification: dict[str, float] = {}
    for s in reversed(diagram.statements):
        arguments = exponents(s)
        here = max((size(a) for a in arguments), default=1.0)
        inside = {r.array for a in arguments for r in reads(a)}
        below = amplification.get(s.target, 1.0)
        for name in s.inputs:
            reach = max(here, below) if name in inside else below
            amplification[name] = max(amplification.get(name, 1.0), reach)

    compute = {s.target: compute_dtype(diagram, s) for s in diagram.statements}
    # Where the Program rounds: a computed array held in a dtype less precise than it was computed in.
    rounded: set[tuple[str, str]] = set()
    for launch in program.launches:
        for (_, name), buffer in launch.buffers.items():
            if name in compute and UNIT_ROUNDOFF.get(buffer.dtype, 0) > UNIT_ROUNDOFF[compute[name]]:
                rounded.add((name, buffer.dtype))
    if not program.hardware.symbolic:
        for plan, _ in tensor_launches(program).values():
            for mma in plan.mmas.values():
                if mma.a_in_registers or mma.staged:  # P or dS, computed in f32, packed to the mma's 16-bit type
                    rounded.add((mma.a, mma.dtype))
    if not rounded and all(diagram.arrays[n].dtype.startswith("i") for n in diagram.outputs):
        return 0.0  # integers, exactly

    # A sum's rounding errors grow as the square root of its length; a running product's, each
    # factor rounding the whole product, with its length.
    arithmetic = sum(2 * UNIT_ROUNDOFF[compute[s.target]] * amplification.get(s.target, 1.0)
                     * (length(s.consumed) if isinstance(s.box, Scan) and s.box.op == "prod" else math.sqrt(length(s.consumed)))
                     for s in diagram.statements)
    floor = max(ARITHMETIC_FLOOR.get(dtype, ARITHMETIC_FLOOR["f32"]) for dtype in compute.values()) if compute else 0.0
    roundings = sum(TOLERANCE.get(dtype, TOLERANCE["bf16"]) * amplification.get(name, 1.0) for name, dtype in rounded)
    # The printers' fast forms in float (elementwise.FAST_PRELUDE) err by their derived bound,
    # relative plus absolute (the outputs' largest values are about 1 or more for these inputs).
    fast = sum(sum(elementwise.function(fn).fast_error) * amplification.get(s.target, 1.0)
               for s in diagram.statements if isinstance(s.box, Map) and compute[s.target] == "f32"
               for fn in _fast_calls(s.box.expr))
    return max(floor, arithmetic) + fast + roundings


def _fast_calls(expr) -> set[str]:
    """The functions with a fast form (elementwise.FAST_PRELUDE) an elementwise expression calls."""
    if not isinstance(expr, Apply):
        return set()
    entry = elementwise.function(expr.fn)
    found = {expr.fn} if entry is not None and entry.fast else set()
    for a in expr.args:
        found |= _fast_calls(a)
    return found


def _arguments(expr, functions) -> list:
    """The arguments of every call of one of ``functions`` in an elementwise expression."""
    if not isinstance(expr, Apply):
        return []
    found = list(expr.args) if expr.fn in functions else []
    for a in expr.args:
        found += _arguments(a, functions)
    return found




def default_sizes(kernel, given: dict | None = None) -> dict[str, int]:
    """Small sizes for a check run: ``given`` first; an axis partitioned by ``s`` gets
    ``s + s // 2 + 3`` (two tiles, the second a masked tail; 2 where ``s`` is 1); any other axis
    64; a symbolic partition size 16."""
    given = dict(given or {})
    diagram = kernel.diagram
    partition_sizes: dict[str, list[int]] = {}
    symbols: set[str] = set()
    for level in (kernel.relabel.levels if kernel.relabel is not None else ()):
        for p in level.partitions:
            if isinstance(p.size, int):
                partition_sizes.setdefault(p.axis, []).append(p.size)
            else:
                symbols.add(p.size)
    sizes = {}
    for axis, info in diagram.axes.items():
        if axis in given:
            sizes[axis] = given[axis]
        elif info.size.is_Integer:
            sizes[axis] = int(info.size)
        elif axis in partition_sizes:
            s = max(partition_sizes[axis])
            sizes[axis] = 2 if s == 1 else s + s // 2 + 3
        else:
            sizes[axis] = DEFAULT_AXIS_SIZE
    for name in sorted(symbols):
        sizes[name] = given.get(name, DEFAULT_PARTITION_SIZE)
    for name, value in given.items():
        sizes.setdefault(name, value)
    return _window_sizes(diagram, sizes, set(given) | set(partition_sizes))


def _window_sizes(diagram, sizes: dict, kept: set) -> dict:
    """Default sizes of a kernel's window reads: a window's own axis (one beside another in an
    index, in no output: ``i`` of ``(2*p + i)``) 3, as a convolution's kernel; an output's
    axis there the length the window implies (windows.completed_sizes), unless ``kept``."""
    if not diagram.views:
        return sizes
    outputs = {a for name in diagram.outputs for a in diagram.arrays[name].axes}
    shared = {a for view in diagram.views for index in view.window.indices if len(index.terms) > 1 for a in index.axes}
    sizes = dict(sizes)
    for axis in shared - kept:
        if axis in outputs:
            del sizes[axis]
        elif not diagram.axes[axis].size.is_Integer:
            sizes[axis] = 3
    return completed_sizes(diagram, sizes)


def random_arguments(diagram, sizes: dict, seed: int) -> tuple[dict, dict]:
    """Seeded inputs: normal values (never zero: each is kept 0.05 away) in each array's
    dtype, and scalars uniform in [0.5, 1.5] (positive, so eps-like scalars behave)."""
    values, scalars = unrounded_arguments(diagram, sizes, seed)
    return {a.name: values[a.name].astype(numpy_dtype(a.dtype)) for a in diagram.input_arrays}, scalars


def unrounded_arguments(diagram, sizes: dict, seed: int) -> tuple[dict, dict]:
    """:func:`random_arguments` before each array is rounded to its dtype: float64 values (an
    integer array's already integers), from which a quantized kernel's error is measured."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for array in diagram.input_arrays:
        values = rng.standard_normal([sizes[a] for a in array.axes])
        values = np.where(np.abs(values) < 0.05, np.copysign(0.05, values), values)
        if numpy_dtype(array.dtype).kind in "iu":
            values = np.rint(values * 4) + np.sign(values)  # integers, none zero
        arrays[array.name] = values
    scalars = {}
    for name, scalar in diagram.scalars.items():
        value = rng.uniform(0.5, 1.5)
        scalars[name] = numpy_dtype(scalar.dtype).type(round(value) if numpy_dtype(scalar.dtype).kind in "iu" else value)
    return arrays, scalars


def opaque_boxes(diagram) -> list[str]:
    return sorted({s.box.box.name for s in diagram.statements if isinstance(s.box, Opaque)})


def reference_error(got, want) -> tuple[float, float]:
    """``(max |got - want|, max |want|)`` of one output against its reference, as a check run
    judges it. An entry equal to its reference counts 0, equal infinities included (the lse or
    max of a fully masked row is -inf on both sides, and -inf - -inf is NaN, not 0); any other
    entry that is not finite on either side counts inf: a NaN, an infinity where the reference is
    finite, or a finite value where it is infinite, is wrong. The magnitude is over the
    reference's finite entries, so that an infinite entry does not hide every finite error."""
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    finite = np.isfinite(got) & np.isfinite(want)
    with np.errstate(invalid="ignore", over="ignore"):
        error = np.where(finite, np.abs(got - want), np.where(got == want, 0.0, np.inf))
    magnitude = np.abs(want[np.isfinite(want)])
    return float(np.max(error, initial=0.0)), float(np.max(magnitude, initial=0.0))


def check_run(kernel, hardware: str | None = None, sizes: dict | None = None, seed: int = 0, backend: str = "numpy",
              impls: dict | None = None, progress=None, arch: str | None = None) -> dict:
    """Run ``kernel`` on seeded random inputs and compare with the reference and the report.

    Returns a dict: ``hardware``, ``sizes``, ``backend``, ``max_abs_error``, ``max_rel_error``
    (max |error| / max |reference|, over every output; an fp8 output against the reference rounded
    and saturated to its dtype, as it is stored), ``rounded_outputs`` (those outputs: name ->
    dtype) and ``unrounded_rel_error`` (their error against the float64 reference, or None), ``tolerance``, ``counted`` and
    ``predicted`` (per level below the top: ``H``; the compute level also has ``flops``, the
    total), ``count_differences``, ``wall_s`` (the backend run alone) and ``ok``. ``progress``,
    a ``(done, total)`` callback, hears of the NumPy backend's blocks as :func:`execute` runs them;
    ``arch`` goes to :func:`run_program` (the OpenCL emulation's instruction paths).
    """
    from ..cost import cost_of
    from ..reference import evaluate

    diagram = kernel.diagram
    missing = [name for name in opaque_boxes(diagram) if name not in (impls or {})]
    if missing:
        raise NapkinError(
            f"cannot run {kernel.name}: box {', '.join(missing)} is opaque (declared by signature only) and has no implementation",
            hint=f"call it from Python with impls={{{missing[0]!r}: function}} (see napkin_dsl.reference for the calling convention)",
        )
    sizes = default_sizes(kernel, sizes)
    axis_sizes = {a: sizes[a] for a in diagram.axes}
    program = kernel.program(hardware, **sizes)
    from ..binding import check_reference_memory

    check_reference_memory(diagram, axis_sizes)  # before any input is allocated
    check_memory(program)
    arrays, scalars = random_arguments(diagram, axis_sizes, seed)
    expected = evaluate(diagram, arrays, scalars, axis_sizes, impls, keep_float64=True)
    started = time.perf_counter()
    outputs, counts = run_program(backend, program, arrays, scalars, impls, progress, arch)
    wall = time.perf_counter() - started
    report = cost_of(program, check=False)
    # An fp8 output is stored rounded to nearest even and saturated (types.convert), as the notation
    # says: the reference is rounded as the dtype does before comparing, and its error against the
    # float64 reference itself is reported beside (``unrounded_rel_error``).
    stored = {name: diagram.arrays[name].dtype for name in diagram.outputs if diagram.arrays[name].dtype in FP8_DTYPES}
    max_abs, scale = 0.0, 0.0
    unrounded_abs, unrounded_scale = 0.0, 0.0
    for name in diagram.outputs:
        want = expected[name]
        if name in stored:
            error, magnitude = reference_error(outputs[name], want)
            unrounded_abs, unrounded_scale = max(unrounded_abs, error), max(unrounded_scale, magnitude)
            want = convert(want, stored[name]).astype(np.float64)
        error, magnitude = reference_error(outputs[name], want)
        max_abs, scale = max(max_abs, error), max(scale, magnitude)
    max_rel = max_abs / scale if scale > 0 else max_abs
    unrounded_rel = (unrounded_abs / unrounded_scale if unrounded_scale > 0 else unrounded_abs) if stored else None
    compute_level = program.schedule.compute_level
    predicted = {level: {"H": _json_number(cost.H)} for level, cost in report.levels.items()}
    predicted[compute_level]["flops"] = _json_number(report.total_flops)
    counted = None
    differences: list[str] = []
    if counts is not None:
        counted = {level: {"H": int(counts.H.get(level, 0))} for level in report.levels}
        counted[compute_level]["flops"] = _json_number(counts.total_flops)
        differences = counts.differences(report)
    limit = tolerance(program)
    accuracy = quantization_accuracy(kernel, hardware, sizes, axis_sizes, seed, backend, impls, arch, outputs)
    return {
        "accuracy": accuracy,
        "hardware": program.hardware.name,
        "sizes": {k: int(v) for k, v in sizes.items()},
        "backend": backend,
        "max_abs_error": max_abs,
        "max_rel_error": max_rel,
        "rounded_outputs": stored,
        "unrounded_rel_error": unrounded_rel,
        "tolerance": limit,
        "counted": counted,
        "predicted": predicted,
        "count_differences": differences,
        "empty_tiles": counts.empty_tiles if counts is not None else None,
        "wall_s": wall,
        "ok": max_rel <= limit and not differences,
    }


# A kernel with an input of an 8-bit float type (dtypes.FP8_DTYPES) is quantized: its run reports
# its error against the unquantized inputs' reference beside the same kernel's in bf16.


def quantization_accuracy(kernel, hardware, sizes: dict, axis_sizes: dict, seed: int, backend: str,
                          impls: dict | None, arch: str | None, outputs: dict) -> dict | None:
    """A quantized kernel's error as a measured trade-off, or None for a kernel with no 8-bit
    input and no intermediate stored in 8 bits (FA3's incoherent processing: Q rotated, then
    stored as e4m3). The reference is evaluated in float64 on the inputs as drawn, before
    rounding to their dtypes (:func:`unrounded_arguments`), and keeps every intermediate in
    float64: what the kernel approximates, quantization included.
    Per output, the RMSE and max error of this run (``outputs``) against it, and of the same
    kernel with every 8-bit type declared bf16 (its text retyped, relabelled and run on the same
    backend from the same unrounded inputs) where that kernel builds; ``bf16_skipped`` says why not."""
    from ..reference import evaluate

    diagram = kernel.diagram
    stored = [a for a in diagram.arrays.values() if a.role == "input" or (a.role == "intermediate" and a.level is not None)]
    quantized = sorted({a.dtype for a in stored if a.dtype in FP8_DTYPES})
    if not quantized:
        return None
    values, scalars = unrounded_arguments(diagram, axis_sizes, seed)
    exact = evaluate(diagram, values, scalars, axis_sizes, impls, keep_float64=True)
    label = "+".join(quantized)  # this run's row: the 8-bit types of its inputs and stored intermediates
    result = {"inputs": quantized, "outputs": {name: {label: _rmse_max(outputs[name], exact[name])} for name in diagram.outputs},
              "bf16_skipped": None}
    try:
        retyped = kernel.retyped({dtype: "bf16" for dtype in FP8_DTYPES})
        program = retyped.program(hardware, **sizes)
        cast = {a.name: values[a.name].astype(numpy_dtype(a.dtype)) for a in retyped.diagram.input_arrays}
        got, _ = run_program(backend, program, cast, scalars, impls, None, arch)
    except NapkinError as why:  # a kernel whose text does not retype: its own run still counts
        result["bf16_skipped"] = str(why).splitlines()[0]
        return result
    for name in diagram.outputs:
        result["outputs"][name]["bf16"] = _rmse_max(got[name], exact[name])
    return result


def _rmse_max(got, want) -> dict:
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    finite = np.isfinite(got) & np.isfinite(want)
    error = np.abs(got - want)[finite]
    return {"rmse": float(np.sqrt(np.mean(error ** 2))) if error.size else 0.0,
            "max_error": float(np.max(error, initial=0.0)),
            "not_finite": int(np.size(got) - np.count_nonzero(finite))}


def _json_number(value):
    value = algebra.as_expr(value)
    return int(value) if value.is_Integer else (float(value) if value.is_number else str(value))


def run_program(backend: str, program: Program, inputs: dict, scalars: dict, impls: dict | None = None,
                progress=None, arch: str | None = None, selected: ProgramSelection | None = None) -> tuple[dict, Counts | None]:
    """Run a Program on a backend: ``(outputs, Counts)`` here with NumPy, ``(outputs, None)`` through
    ``napkin_dsl.backends.cuda.run`` or ``napkin_dsl.backends.opencl.run``. ``progress`` goes to
    :func:`execute` (the GPU backends say nothing of how far they are). ``arch`` picks the
    instruction paths the OpenCL emulation prints (``sm_90a``: wgmma where selection takes it);
    the CUDA backend compiles for the GPU it runs on, and NumPy runs the Program itself, its
    counts following ``selected`` where the caller has the selection (a kernel call keeps it).

    A missing GPU backend raises NotImplementedError naming what is missing; ``cuda`` without a
    GPU raises :class:`~napkin_dsl.backends.driver.NoCudaDevice`.
    """
    if backend == "numpy":
        return execute(program, inputs, scalars, impls, progress, selected)
    if backend == "cuda":
        from . import driver

        if not driver.cuda_available():
            raise driver.NoCudaDevice(driver._probe()[1])
    elif backend != "opencl":
        raise NapkinError(f"unknown backend {backend!r}", hint="use numpy, cuda, opencl or auto")
    import importlib

    try:
        module = importlib.import_module(f"napkin_dsl.backends.{backend}")
    except ImportError as error:
        raise NotImplementedError(f"the {backend} backend is not available: napkin_dsl.backends.{backend} cannot be imported ({error})") from None
    run = getattr(module, "run", None)
    if run is None:
        raise NotImplementedError(f"the {backend} backend is not available: napkin_dsl.backends.{backend} has no run(program, inputs, scalars)")
    result = run(program, inputs, scalars, arch=arch) if arch is not None else run(program, inputs, scalars)
    outputs = result[0] if isinstance(result, tuple) else result
    return {name: np.asarray(value) for name, value in outputs.items()}, None


def format_check(name: str, result: dict) -> str:
    """A few lines: errors against the tolerance, counted beside predicted transfers, FLOPs, time."""
    status = "ok" if result["ok"] else "FAILED"
    sizes = " ".join(f"{k}={v}" for k, v in result["sizes"].items())
    lines = [f"run {name} on {result['backend']} ({result['hardware']} program) with {sizes}: {status}",
             (f"  max abs error {result['max_abs_error']:.3g}, max rel error {result['max_rel_error']:.3g} "
             f"(tolerance {result['tolerance']:g})")]
    if result.get("rounded_outputs"):
        outputs = ", ".join(f"{name} to {dtype}" for name, dtype in result["rounded_outputs"].items())
        lines.append(f"  (against the reference rounded and saturated as stored: {outputs}; max rel error "
                     f"{result['unrounded_rel_error']:.3g} against the float64 reference itself)")
    rows = [("level", "H counted", "H predicted", "FLOPs counted", "FLOPs predicted")]
    for level, predicted in result["predicted"].items():
        counted = (result["counted"] or {}).get(level, {})
        rows.append((level, _cell(counted.get("H")), _cell(predicted["H"]), _cell(counted.get("flops")), _cell(predicted.get("flops"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in rows]
    accuracy = result.get("accuracy")
    if accuracy:
        lines.append(f"  accuracy against float64 on the inputs before rounding to {', '.join(accuracy['inputs'])}:")
        for name, rows in accuracy["outputs"].items():
            for dtype, row in rows.items():
                what = "this kernel" if dtype != "bf16" else "the same kernel in bf16"
                extra = f", {row['not_finite']} not finite" if row["not_finite"] else ""
                lines.append(f"    {name} {dtype:<9} RMSE {row['rmse']:.3g}, max error {row['max_error']:.3g}{extra}  ({what})")
        if accuracy["bf16_skipped"]:
            lines.append(f"    (no bf16 row: {accuracy['bf16_skipped']})")
    for difference in result["count_differences"]:
        lines.append(f"  count mismatch: {difference}")
    if result.get("empty_tiles"):
        lines.append(f"  note: {result['empty_tiles']} loop trips ran past the end of their axis (a masked tail of an outer tile)")
    lines.append(f"  wall time {result['wall_s'] * 1e3:.1f} ms")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:,}" if isinstance(value, int) else str(value)


def report_check(kernel, hardware: str | None) -> tuple[str, bool]:
    """The run check of ``napkin report``: text and whether it passed (skipped counts as passed)."""
    boxes = opaque_boxes(kernel.diagram)
    if boxes:
        return f"run: skipped ({kernel.name} uses opaque box {', '.join(boxes)}, which has no implementation here)", True
    result = check_run(kernel, hardware)
    return format_check(kernel.name, result), result["ok"]
