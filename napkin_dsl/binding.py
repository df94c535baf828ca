"""Call-time binding: the arrays and scalars of one call, checked against a diagram.

:func:`bind` takes the arrays and scalars a user passes to a kernel and returns a
:class:`Binding`: one integer size per axis of the kernel, read off the array shapes (or
given by ``sizes=`` for axes that no input carries), and private, C-contiguous copies of the
inputs in their declared dtypes. Every backend starts from a Binding, so every backend
reports a bad call the same way.

What it checks, all at once: missing and unexpected arguments; that each array argument is a
NumPy array (other array-likes need ``cast=True``); its rank against the declared axes; one
size per axis across all arguments and ``sizes=``; no zero-size axis; the dtype against the
declared one (``cast=True`` converts instead, but never from complex, text or objects, and
never floats into integers); scalar parameters are real numbers. Every problem found is
reported in one :class:`~napkin_dsl.errors.NapkinCallError` whose message names the
parameter, its declared axes and the array's shape and dtype, with a summary of the whole call
(the einops way: the error says what was called with what).

What it deliberately does not do: look at values (NaN and inf are accepted and propagate, as
they would through the arithmetic), keep or mutate the caller's arrays (inputs are always
copied, so a later change to a user array cannot reach a running kernel and a kernel cannot
write into a user array), or decide how outputs are allocated (each backend does).

It also holds the memory guard of the NumPy reference (:func:`estimate_reference_bytes`,
:func:`check_reference_memory`): the reference materialises every array of a diagram in
float64, which for attention at realistic sizes is more memory than a machine has. The guard
refuses before anything large is allocated.

>>> import numpy as np
>>> from napkin_dsl import load
>>> mm = load("kernel mm(A: f32[m k], B: f32[k n]) -> C: f32[m n]:\\n    C[m n] = A * B\\n")["mm"]
>>> binding = bind(mm.diagram, {"A": np.ones((2, 3), np.float32), "B": np.ones((3, 4), np.float32)})
>>> binding.sizes
{'m': 2, 'k': 3, 'n': 4}
>>> bind(mm.diagram, {"A": np.ones((2, 3), np.float32), "B": np.ones((5, 4), np.float32)})
Traceback (most recent call last):
...
napkin_dsl.errors.NapkinCallError: error: cannot call mm(A: f32[m k], B: f32[k n]) -> C: f32[m n]:
  - axis k is 3 in A (dim 1) but 5 in B (dim 0)
  called with A: float32(2, 3), B: float32(5, 4)
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sympy

from .diagram import Diagram
from .errors import NapkinCallError
from .types import numpy_dtype

__all__ = [
    "Binding",
    "bind",
    "check_reference_memory",
    "default_memory_limit",
    "estimate_reference_bytes",
    "physical_memory_bytes",
]


@dataclass(frozen=True)
class Binding:
    """What one call binds: a size per axis, the input arrays, the scalar parameters.

    ``inputs`` are private C-contiguous copies in the declared dtypes (bf16 and fp8 through
    ml_dtypes); ``scalars`` are NumPy scalars of the declared dtypes.
    """

    sizes: dict[str, int]
    inputs: dict[str, np.ndarray]
    scalars: dict[str, np.generic]


def _diagram_of(kernel_or_diagram) -> Diagram:
    """Accept a Kernel (anything with a ``diagram``) as well as a Diagram."""
    return getattr(kernel_or_diagram, "diagram", kernel_or_diagram)


def _signature(diagram: Diagram) -> str:
    return diagram.signature()


def arguments(diagram: Diagram, positional: tuple, named: dict) -> tuple[dict, dict]:
    """A call's arguments by parameter name, split into arrays and scalars.

    Positional arguments follow the kernel's parameters in signature order; naming one twice,
    or passing too many, is a NapkinCallError.
    """
    if len(positional) > len(diagram.params):
        raise NapkinCallError(f"{diagram.name} takes {len(diagram.params)} arguments ({', '.join(diagram.params)}), "
                              f"got {len(positional)} positional")
    by_name = dict(zip(diagram.params, positional))
    twice = [name for name in named if name in by_name]
    if twice:
        raise NapkinCallError(f"{diagram.name} got {', '.join(twice)} both by position and by name")
    by_name.update(named)
    arrays = {k: v for k, v in by_name.items() if k not in diagram.scalars}
    scalars = {k: v for k, v in by_name.items() if k in diagram.scalars}
    return arrays, scalars


def _describe_value(value) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{tuple(value.shape)}"
    if isinstance(value, (bool, int, float, complex, np.generic)):
        return f"{type(value).__name__} {value!r}"
    return type(value).__name__


def _did_you_mean(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _dtype_text(napkin_dtype: str) -> str:
    """'bf16 (NumPy ml_dtypes.bfloat16)' or 'f32 (NumPy float32)'."""
    dtype = numpy_dtype(napkin_dtype)
    module = "ml_dtypes." if dtype.type.__module__.startswith("ml_dtypes") else ""
    return f"{napkin_dtype} (NumPy {module}{dtype.name})"


def _is_real_numeric(dtype: np.dtype) -> bool:
    """Booleans, integers and real floats, including ml_dtypes' bf16 and fp8 (kind 'V')."""
    return dtype.kind in "biuf" or dtype.type.__module__.startswith("ml_dtypes")


def _conversion_problem(source: np.dtype, target: np.dtype) -> str | None:
    """Why ``cast=True`` still refuses to convert source to target, or None."""
    if not _is_real_numeric(source):
        return f"cannot convert {source} values to numbers"
    if target.kind in "iu" and source.kind not in "biu":
        return f"will not convert {source} to the integer dtype {target} (it would truncate)"
    return None


def _same_dtype(source: np.dtype, target: np.dtype) -> bool:
    # A byte-swapped array ('>f4') holds the same values as a native one; copying converts it.
    return source == target or (source.name == target.name and source.kind == target.kind and source.fields is None)


class _Problems:
    """Every problem of one call, reported together."""

    def __init__(self):
        self.lines: list[str] = []

    def add(self, line: str):
        self.lines.append(line)

    def raise_if_any(self, diagram: Diagram, arrays: dict, scalars: dict):
        if not self.lines:
            return
        called = ", ".join(f"{k}: {_describe_value(v)}" for k, v in {**arrays, **scalars}.items()) or "no arguments"
        message = (f"cannot call {_signature(diagram)}:\n" + "\n".join(f"  - {line}" for line in self.lines)
                   + f"\n  called with {called}")
        raise NapkinCallError(message)


def _fixed_size(diagram: Diagram, axis: str) -> int | None:
    """An axis whose size the kernel itself fixes to an integer, or None for a symbol."""
    size = diagram.axes[axis].size
    return int(size) if isinstance(size, (int, sympy.Integer)) else None


def bind(diagram, arrays: dict, scalars: dict | None = None, cast: bool = False, *, sizes: dict | None = None) -> Binding:
    """Check the arguments of one call of ``diagram`` and bind its axes to sizes.

    ``diagram`` is a :class:`~napkin_dsl.diagram.Diagram` or a kernel (anything with a
    ``diagram``). ``arrays`` maps array parameter names to NumPy arrays; ``scalars`` maps
    scalar parameter names to real numbers; ``sizes`` gives axes that no input carries (those
    only in outputs or intermediates, such as an opaque box's output axis) and may restate
    others, which must then agree.

    With ``cast=False`` (the default) each array must already be a ``numpy.ndarray`` of the
    declared dtype (byte order aside): a silent conversion would hide a float32 array passed
    to a bf16 kernel. With ``cast=True`` any array-like (lists, arrays of other real dtypes,
    objects with ``__array__``) is converted with ``numpy.asarray`` then ``astype``; complex,
    text and object data, and floats into integer dtypes, are still refused.

    Raises :class:`~napkin_dsl.errors.NapkinCallError` listing every problem at once.
    """
    diagram = _diagram_of(diagram)
    scalars = dict(scalars or {})
    arrays = dict(arrays)
    sizes = dict(sizes or {})
    problems = _Problems()

    array_params = [p for p in diagram.params if p in diagram.arrays]
    scalar_params = [p for p in diagram.params if p in diagram.scalars]
    for name in array_params:
        if name not in arrays:
            where = " (it was passed as a scalar)" if name in scalars else ""
            problems.add(f"missing array {name}: {diagram.arrays[name].dtype}[{' '.join(diagram.arrays[name].axes)}]{where}")
    for name in scalar_params:
        if name not in scalars:
            where = " (it was passed as an array)" if name in arrays else ""
            problems.add(f"missing scalar {name}: {diagram.scalars[name].dtype}{where}")
    for name in arrays:
        if name not in array_params and name not in scalar_params:
            problems.add(f"unexpected argument {name!r}: {diagram.name} takes {', '.join(diagram.params)}"
                         + _did_you_mean(name, diagram.params))
    for name in scalars:
        if name not in array_params and name not in scalar_params:
            problems.add(f"unexpected scalar {name!r}: {diagram.name} takes {', '.join(diagram.params)}"
                         + _did_you_mean(name, diagram.params))

    # Axis sizes: the first argument carrying an axis binds it; every later one must agree.
    bound: dict[str, tuple[int, str]] = {}  # axis -> (size, where it came from)
    for axis in diagram.axes:
        fixed = _fixed_size(diagram, axis)
        if fixed is not None:
            bound[axis] = (fixed, "the kernel")

    converted: dict[str, np.ndarray] = {}
    for name in array_params:
        if name not in arrays:
            continue
        declared = diagram.arrays[name]
        target = numpy_dtype(declared.dtype)
        value = arrays[name]
        if not isinstance(value, np.ndarray) or isinstance(value, np.ma.MaskedArray):
            if isinstance(value, np.ma.MaskedArray):
                problems.add(f"{name} is a masked array; napkin would drop its mask. Pass numpy.ma.filled({name}) instead")
                continue
            if not cast:
                problems.add(f"{name} must be a numpy.ndarray of {_dtype_text(declared.dtype)}, got {type(value).__name__}; "
                             f"pass cast=True to convert array-likes")
                continue
            try:
                value = np.asarray(value)
            except (TypeError, ValueError) as exc:  # an array-like that cannot become an array (e.g. a GPU array)
                problems.add(f"cannot convert {name} ({type(value).__name__}) to an array: {exc}")
                continue
        if value.ndim != len(declared.axes):
            problems.add(f"{name} is declared {declared.dtype}[{' '.join(declared.axes)}] ({len(declared.axes)} axes) "
                         f"but got an array of shape {tuple(value.shape)} ({value.ndim} axes)")
            continue
        convertible = True
        if not _same_dtype(value.dtype, target):
            if not cast:
                problems.add(f"{name} must be {_dtype_text(declared.dtype)}, got {value.dtype}; "
                             f"convert it with .astype(...) or pass cast=True")
                convertible = False
            elif refusal := _conversion_problem(value.dtype, target):
                problems.add(f"{name}: {refusal} ({name} is declared {_dtype_text(declared.dtype)})")
                convertible = False
        for dim, (axis, size) in enumerate(zip(declared.axes, value.shape)):
            if size == 0:
                problems.add(f"axis {axis} has size 0 in {name} (dim {dim}); napkin kernels need at least one element along every axis")
                continue
            if axis in bound and bound[axis][0] != size:
                problems.add(f"axis {axis} is {bound[axis][0]} in {bound[axis][1]} but {size} in {name} (dim {dim})")
            else:
                bound.setdefault(axis, (int(size), f"{name} (dim {dim})"))
        if convertible:
            # Always a fresh C-contiguous copy: never a view of, nor a reference to, the user's array.
            converted[name] = np.array(value, dtype=target, order="C", copy=True)

    for axis, size in sizes.items():
        if axis not in diagram.axes:
            problems.add(f"sizes= names axis {axis!r}, which {diagram.name} does not have; its axes are "
                         f"{' '.join(diagram.axes)}" + _did_you_mean(axis, diagram.axes))
            continue
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            problems.add(f"sizes[{axis!r}] must be an integer, got {_describe_value(size)}")
            continue
        if size <= 0:
            problems.add(f"sizes[{axis!r}] is {size}; napkin kernels need at least one element along every axis")
            continue
        if axis in bound and bound[axis][0] != size:
            problems.add(f"axis {axis} is {bound[axis][0]} in {bound[axis][1]} but {size} in sizes=")
        else:
            bound.setdefault(axis, (int(size), "sizes="))

    # Axes of an input that failed above are reported with that input, not as unbound here.
    input_axes = {axis for name in array_params for axis in diagram.arrays[name].axes}
    for axis in diagram.axes:
        if axis not in bound and axis not in input_axes:
            holders = [a.name for a in diagram.arrays.values() if axis in a.axes]
            where = f"only in {', '.join(holders)}" if holders else "in no array (an opaque box's axis)"
            problems.add(f"axis {axis} is not carried by any input (it appears {where}); "
                         f"give its size with sizes={{{axis!r}: N}}")

    bound_scalars: dict[str, np.generic] = {}
    for name in scalar_params:
        if name not in scalars:
            continue
        value = scalars[name]
        declared = diagram.scalars[name]
        target = numpy_dtype(declared.dtype)
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value[()]
        real = isinstance(value, (int, float, np.integer, np.floating)) or (
            isinstance(value, np.generic) and _is_real_numeric(np.dtype(type(value))))
        if isinstance(value, (bool, np.bool_)) or not real:
            problems.add(f"scalar {name} must be a real number ({_dtype_text(declared.dtype)}), got {_describe_value(value)}")
            continue
        if target.kind in "iu":
            # cast=True accepts 3.0 for an integer scalar, never 2.5: truncating would change the kernel's result.
            integral = isinstance(value, (int, np.integer)) or (cast and float(value).is_integer())
            if not integral:
                problems.add(f"scalar {name} is {_dtype_text(declared.dtype)} but got {_describe_value(value)}; pass an integer")
                continue
            info = np.iinfo(target)
            if not info.min <= int(value) <= info.max:
                problems.add(f"scalar {name} = {value!r} does not fit {_dtype_text(declared.dtype)}")
                continue
            value = int(value)
        bound_scalars[name] = target.type(value)

    problems.raise_if_any(diagram, arrays, scalars)
    ordered = {axis: bound[axis][0] for axis in diagram.axes}
    return Binding(ordered, converted, bound_scalars)


# ---- the memory guard of the NumPy reference ---------------------------------------------------

_FLOAT64 = 8


def physical_memory_bytes() -> int | None:
    """The memory this process may use: physical memory, or a smaller container limit."""
    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system
        pass
    # In a container the cgroup limit, not the host's memory, decides when the process is killed.
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and (total is None or int(text) < total):
            total = int(text)
    return total


def default_memory_limit() -> int:
    """25% of :func:`physical_memory_bytes` (4 GiB where it cannot be read)."""
    total = physical_memory_bytes()
    return total // 4 if total else 4 << 30


def _numel(diagram: Diagram, axes, sizes: dict) -> int:
    return math.prod(int(sizes[a]) for a in axes)


def _arrays_bytes(diagram: Diagram, sizes: dict) -> tuple[int, list[tuple[int, str]]]:
    """Bytes the reference holds for whole arrays, and (bytes, description) per array."""
    held = []
    for array in diagram.arrays.values():
        n = _numel(diagram, array.axes, sizes)
        held.append((n * _FLOAT64, f"{array.name}[{' '.join(array.axes)}] ({array.role}, {n:,} values in float64)"))
        if array.role == "output":
            held.append((n * numpy_dtype(array.dtype).itemsize, f"{array.name} converted to {array.dtype}"))
    return sum(b for b, _ in held), held


def _workspace_bytes(diagram: Diagram, sizes: dict) -> int:
    """The largest temporary memory of one statement, beyond the arrays it reads and writes."""
    largest = 0
    for statement in diagram.statements:
        target = _numel(diagram, statement.axes, sizes)
        operands = sum(_numel(diagram, diagram.arrays[name].axes, sizes) for name in statement.inputs)
        iteration = _numel(diagram, statement.iteration_axes, sizes)
        if statement.box.kind == "contract":
            # einsum(optimize=True) may transpose or copy operands for BLAS, plus its result.
            words = operands + target
        elif statement.box.kind == "opaque":
            words = 2 * target  # the implementation's result, then its broadcast into place
        else:
            words = 2 * iteration  # elementwise temporaries: about two live at a time
        largest = max(largest, words * _FLOAT64)
    return largest


def estimate_reference_bytes(diagram, sizes: dict) -> int:
    """Bytes the NumPy reference (``reference.evaluate``) needs for a diagram at these sizes.

    It holds every array in float64 (inputs, intermediates, outputs) until it returns, the
    outputs again in their declared dtypes, and the temporaries of one statement at a time.
    An estimate to refuse hopeless calls early, not an exact count.
    """
    diagram = _diagram_of(diagram)
    held, _ = _arrays_bytes(diagram, sizes)
    return held + _workspace_bytes(diagram, sizes)


def _gib(n: int) -> str:
    if n >= 2**1000:  # beyond float64: only sizes past check.MAX_SIZE get here, and the guard must still say it
        return f"{sympy.N(sympy.Integer(n) / 2**30, 3)} GiB"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def memory_limit(limit: float | None, given: str) -> tuple[float, str]:
    """The limit a memory guard applies and where it comes from, for its message."""
    if limit is not None:
        return limit, given
    total = physical_memory_bytes()
    return default_memory_limit(), (f"25% of {_gib(total)} of memory" if total else "the default when memory size is unknown")


def check_reference_memory(diagram, sizes: dict, limit: float | None = None) -> int:
    """Raise NapkinCallError if the reference would need more than ``limit`` bytes; return the estimate.

    ``limit`` defaults to :func:`default_memory_limit` (25% of physical memory); pass
    ``math.inf`` to switch the guard off.
    """
    diagram = _diagram_of(diagram)
    need = estimate_reference_bytes(diagram, sizes)
    limit, source = memory_limit(limit, given="memory_limit=")
    if need > limit:
        _, held = _arrays_bytes(diagram, sizes)
        largest_bytes, largest = max(held)
        shown = ", ".join(f"{a}={sizes[a]}" for a in diagram.axes)
        raise NapkinCallError(
            f"the NumPy reference of {diagram.name} would need about {_gib(need)} at {shown}, more than its limit of "
            f"{_gib(int(limit))} ({source}); the largest array is {largest}: {_gib(largest_bytes)}",
            hint="evaluate it at smaller sizes, or pass memory_limit= (bytes) to allow more",
        )
    return need
