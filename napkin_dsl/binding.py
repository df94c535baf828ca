"""Call-time binding: the arrays and scalars of one call, checked against a diagram.

:func:`bind` takes the arrays and scalars a user passes to a kernel and returns a
:class:`Binding`: one integer size per axis of the kernel, read off the array shapes (or
given by ``sizes=`` for axes that no input carries), and private, C-contiguous copies of the
inputs in their declared dtypes. Every backend starts from a Binding, so every backend
reports a bad call the same way.

What it checks, all at once: missing and unexpected arguments; that each array argument is an
array: a NumPy array, or anything that speaks DLPack or ``__cuda_array_interface__`` (torch,
JAX, CuPy; other array-likes need ``cast=True``); its rank against the declared axes; one
size per axis across all arguments and ``sizes=``; no zero-size axis; the dtype against the
declared one (``cast=True`` converts instead, but never from complex, text or objects, and
never floats into integers); scalar parameters are real numbers (a 0-d array of NumPy, JAX, torch
or CuPy is one); no JAX tracer (napkin runs outside jax.jit, grad and vmap). Every problem found is
reported in one :class:`~napkin_dsl.errors.NapkinCallError` whose message names the
parameter, its declared axes and the array's shape and dtype, with a summary of the whole call
(the einops way: the error says what was called with what).

Arrays of other frameworks come in through DLPack: the DLPack dtype code (bf16 is code 4,
fp8 e4m3fn 10, e5m2 12) maps to the ml_dtypes type napkin's CPU backends store, and the values
are copied out of the producer's memory, so a torch bf16 tensor needs no ``cast=True``. A tensor
that requires grad is read through its values (``detach()``): ``Kernel.__call__`` records
the call for torch.autograd, or, under ``torch.no_grad()``, runs it on the values. Arrays on a CUDA device are
kept in place for the CUDA backend (``keep_on_device=True``: the kernel reads them through
their device pointers, zero-copy) and refused by the host backends, which cannot read them.
:meth:`Binding.deliver` gives the outputs back in the caller's array type and on its device:
torch in, torch out, in the declared dtype.

What it deliberately does not do: look at values (NaN and inf are accepted and propagate, as
they would through the arithmetic), keep or mutate the caller's host arrays (inputs are
copied, so a later change to a user array cannot reach a running kernel and a kernel cannot
write into a user array; device arrays kept for the CUDA backend are only read), or decide how
outputs are allocated (each backend does).

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

import ctypes
import decimal
import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import windows
from .diagram import Diagram
from .errors import NapkinCallError
from .types import convert, numpy_dtype

__all__ = [
    "Binding",
    "DeviceArray",
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
    ml_dtypes), or, bound with ``keep_on_device=True``, the caller's CUDA arrays themselves
    (objects with ``__cuda_array_interface__``, such as a :class:`DeviceArray`); ``scalars``
    are NumPy scalars of the declared dtypes. ``caller`` says which array type the outputs go
    back as (:meth:`deliver`).
    """

    sizes: dict[str, int]
    inputs: dict[str, Any]
    scalars: dict[str, np.generic]
    caller: _Caller | None = field(default=None, compare=False)

    def deliver(self, outputs: dict[str, np.ndarray]) -> dict[str, Any]:
        """The outputs as the caller's arrays: NumPy in, NumPy out; torch in, torch tensors out
        (same dtype, on the input's device); JAX in, JAX arrays out; CuPy in, CuPy arrays out."""
        if self.caller is None:
            return dict(outputs)
        return {name: self.caller.convert(array) for name, array in outputs.items()}


def diagram_of(kernel_or_diagram) -> Diagram:
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
    by_name = dict(zip(diagram.params, positional, strict=False))
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
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # torch, JAX, CuPy arrays
        return f"{type(value).__name__} {value.dtype}{tuple(value.shape)}"
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

    def extend(self, lines):
        self.lines.extend(lines)

    def raise_if_any(self, diagram: Diagram, arrays: dict, scalars: dict):
        if not self.lines:
            return
        called = ", ".join(f"{k}: {_describe_value(v)}" for k, v in {**arrays, **scalars}.items()) or "no arguments"
        message = (f"cannot call {_signature(diagram)}:\n" + "\n".join(f"  - {line}" for line in self.lines)
                   + f"\n  called with {called}")
        raise NapkinCallError(message)


# ---- arrays of other frameworks: DLPack and __cuda_array_interface__ ---------------------------

# DLPack device types (dlpack.h, DLDeviceType) napkin reads: host memory, and CUDA device memory.
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_DL_HOST_READABLE = (_DL_CPU, _DL_CUDA_HOST, _DL_CUDA_MANAGED)

# DLPack dtype codes (dlpack.h, DLDataTypeCode) by the NumPy type napkin stores them as; the
# 8-bit floats and bf16 are ml_dtypes types, as everywhere on napkin's CPU backends.
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_COMPLEX, _DL_BOOL = 0, 1, 2, 4, 5, 6
_DL_FLOAT8 = {7: "float8_e3m4", 8: "float8_e4m3", 9: "float8_e4m3b11fnuz", 10: "float8_e4m3fn",
              11: "float8_e4m3fnuz", 12: "float8_e5m2", 13: "float8_e5m2fnuz", 14: "float8_e8m0fnu"}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    # The head of DLManagedTensor (the unversioned capsule "dltensor"): napkin only reads it.
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


def _capsule_pointer(capsule) -> int | None:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    is_valid = ctypes.pythonapi.PyCapsule_IsValid
    is_valid.restype, is_valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
    return get(capsule, b"dltensor") if is_valid(capsule, b"dltensor") else None


def _dlpack_dtype(code: int, bits: int, lanes: int) -> np.dtype | None:
    """The NumPy dtype of a DLPack dtype, or None for one napkin cannot hold (vectors, fp4, ...)."""
    import ml_dtypes

    if lanes != 1:
        return None
    if code == _DL_BFLOAT and bits == 16:
        return np.dtype(ml_dtypes.bfloat16)
    if code in _DL_FLOAT8 and bits == 8 and hasattr(ml_dtypes, _DL_FLOAT8[code]):
        return np.dtype(getattr(ml_dtypes, _DL_FLOAT8[code]))
    kinds = {_DL_INT: "i", _DL_UINT: "u", _DL_FLOAT: "f", _DL_COMPLEX: "c"}
    if code == _DL_BOOL and bits == 8:
        return np.dtype(np.bool_)
    if code in kinds and bits % 8 == 0:
        try:
            return np.dtype(f"{kinds[code]}{bits // 8}")
        except TypeError:  # f1, i16 and such: no NumPy type
            return None
    return None


@dataclass(frozen=True)
class _DLPackView:
    """What a DLPack capsule says about an array. Valid while ``capsule`` is alive."""

    capsule: Any
    device: tuple[int, int]
    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None  # in elements, as DLPack counts them; None: C-contiguous
    dtype: np.dtype | None
    dtype_text: str

    def host_view(self) -> np.ndarray:
        """A NumPy view of the producer's host memory (read it before the capsule goes)."""
        itemsize = self.dtype.itemsize
        if 0 in self.shape:
            return np.empty(self.shape, self.dtype)
        strides = tuple(s * itemsize for s in self.strides) if self.strides is not None else None
        if strides is None:
            low, high = 0, math.prod(self.shape) * itemsize
        else:
            low = sum(min(0, (n - 1) * s) for n, s in zip(self.shape, strides, strict=False))
            high = sum(max(0, (n - 1) * s) for n, s in zip(self.shape, strides, strict=False)) + itemsize
        memory = (ctypes.c_char * (high - low)).from_address(self.address + low)
        view = np.ndarray(self.shape, self.dtype, buffer=memory, offset=-low, strides=strides)
        view.flags.writeable = False
        return view

    def contiguous(self) -> bool:
        if self.strides is None:
            return True
        expected, step = [], 1
        for extent in reversed(self.shape):
            expected.append(step)
            step *= extent
        return all(n == 1 or s == e for n, s, e in zip(self.shape, self.strides, reversed(expected), strict=False))


def _read_dlpack(value) -> _DLPackView:
    """Ask an array for a DLPack capsule and read its DLTensor. Raises TypeError, BufferError..."""
    device_type, device_id = (int(v) for v in value.__dlpack_device__())
    # On CUDA, stream 1 is the legacy default stream the CUDA backend launches on: the producer
    # makes its pending work visible there before it hands the pointer over.
    capsule = value.__dlpack__(stream=1) if device_type == _DL_CUDA else value.__dlpack__()
    pointer = _capsule_pointer(capsule)
    if pointer is None:
        raise BufferError("its __dlpack__ did not return a DLPack capsule")
    tensor = _DLTensor.from_address(pointer)
    ndim = tensor.ndim
    shape = tuple(int(tensor.shape[i]) for i in range(ndim))
    strides = tuple(int(tensor.strides[i]) for i in range(ndim)) if tensor.strides else None
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    dtype = _dlpack_dtype(code, bits, lanes)
    text = dtype.name if dtype is not None else f"DLPack dtype (code {code}, {bits} bits, {lanes} lanes)"
    address = (tensor.data or 0) + int(tensor.byte_offset)
    return _DLPackView(capsule, (device_type, device_id), address, shape, strides, dtype, text)


@dataclass(frozen=True)
class DeviceArray:
    """A CUDA array handed to the CUDA backend in place: its device pointer, shape and dtype.

    It exposes ``__cuda_array_interface__`` (version 3), which the CUDA backend reads to launch
    on the caller's memory without a copy; ``owner`` is the caller's array, kept alive for as
    long as the pointer is used. bf16 is typestr ``<V2`` (2-byte values the interface cannot name).
    """

    address: int
    shape: tuple[int, ...]
    dtype: np.dtype
    owner: Any = field(repr=False)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.address, True), "strides": None, "version": 3}


def _framework(value) -> str:
    """The library an array comes from: its type's top-level module (torch, jaxlib, cupy, numpy...)."""
    return type(value).__module__.split(".")[0]


_FRAMEWORK_NAMES = {"jaxlib": "jax"}


@dataclass(frozen=True)
class _Caller:
    """The array type outputs go back as: the library of the first non-NumPy input, and its device."""

    framework: str
    device: Any

    def convert(self, array: np.ndarray):
        if self.framework == "torch":
            import torch

            host = np.asarray(array, order="C")  # not ascontiguousarray: it makes a 0-d output 1-d
            if host.dtype.type.__module__.startswith("ml_dtypes"):
                # torch.from_numpy knows no ml_dtypes type: hand over the bits and view them.
                bits = torch.from_numpy(host.view(f"u{host.dtype.itemsize}"))
                tensor = bits.view(getattr(torch, host.dtype.name))
            else:
                tensor = torch.from_numpy(host)
            return tensor if self.device is None or self.device.type == "cpu" else tensor.to(self.device)
        if self.framework == "jax":
            import jax

            return jax.device_put(array, self.device)
        if self.framework == "cupy":
            import cupy

            with cupy.cuda.Device(self.device):
                return cupy.asarray(array)
        return array

    @staticmethod
    def of(value) -> _Caller | None:
        framework = _FRAMEWORK_NAMES.get(_framework(value), _framework(value))
        if framework == "torch":
            return _Caller("torch", value.device)
        if framework == "jax":
            devices = value.devices() if callable(getattr(value, "devices", None)) else ()
            return _Caller("jax", next(iter(devices)) if len(devices) == 1 else None)
        if framework == "cupy":
            return _Caller("cupy", int(value.device.id))
        return None


def _cannot_hold(framework: str, dtype: np.dtype) -> bool:
    """Whether ``framework`` has no array type of this dtype to give an output back as."""
    if framework == "torch":
        import torch

        return not isinstance(getattr(torch, dtype.name, None), torch.dtype)
    if framework == "cupy":
        return dtype.type.__module__.startswith("ml_dtypes")  # CuPy has no bf16 or fp8
    return False


def _jax_x64() -> bool:
    import jax

    return bool(jax.config.jax_enable_x64)


def _shape_text(value) -> str:
    shape = getattr(value, "shape", None)
    return f"{getattr(value, 'dtype', '')}{tuple(shape)}" if shape is not None else ""


def _requires_grad(value) -> bool:
    return getattr(value, "requires_grad", False) is True


def _traced(name: str, value) -> str | None:
    """A problem for a JAX tracer (a value inside jax.jit, grad or vmap), which has no data to
    read: without this, the call said to pass cast=True, which then failed inside JAX."""
    if _framework(value) == "jax" and any(c.__name__ == "Tracer" for c in type(value).__mro__):
        return (f"{name} is a traced JAX value ({type(value).__name__}): napkin kernels run on concrete arrays, "
                f"not inside jax.jit, grad or vmap; call the kernel outside the transformation")
    return None


def _foreign_scalar(name: str, value):
    """A 0-d array of another library (a JAX or torch scalar, a CuPy one) as a NumPy scalar, or a problem.

    NumPy 0-d arrays were always accepted as scalars; ``jnp.float32(2)`` is a 0-d jax array and
    was refused as "not a real number"."""
    problem = _traced(name, value)
    if problem is not None:
        return problem
    if _requires_grad(value):
        value = value.detach()  # the kernel records the call for autograd (kernel.py), or runs it on the value
    try:
        host = np.asarray(value)  # host memory: DLPack or __array__; CPU jax and torch
    except (TypeError, ValueError, RuntimeError):
        return value.item()  # device memory (CuPy): the one value, copied to the host
    return host[()]


def _interface_dtype(typestr: str, target: np.dtype) -> np.dtype:
    """The dtype of a __cuda_array_interface__ typestr; 2-byte opaque values are bf16 when the
    kernel asks for bf16, the interface having no name for it."""
    if typestr in ("<V2", "|V2") and target.name == "bfloat16":
        return target
    return np.dtype(typestr)


def _has_cuda_interface(value) -> bool:
    try:
        return hasattr(value, "__cuda_array_interface__")
    except Exception:  # noqa: BLE001 - torch raises TypeError for dtypes the interface cannot name
        return False


def c_strides(shape: tuple, itemsize: int) -> tuple:
    """The byte strides of a C-contiguous array of ``shape`` (the layout every backend takes)."""
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def _foreign_array(name: str, value, target: np.dtype, keep_on_device: bool) -> tuple[Any, Any] | str | None:
    """A non-NumPy array as ``(array, keepalive)``, or a problem, or None for a plain array-like.

    ``array`` is a read-only NumPy view of host memory (valid while ``keepalive`` lives), or a
    :class:`DeviceArray` for memory on a CUDA device when ``keep_on_device``.
    """
    if _requires_grad(value):
        value = value.detach()  # the kernel records the call for autograd (kernel.py), or runs it on the values
    where = f"{name} ({' '.join(filter(None, (type(value).__name__, _shape_text(value))))})"
    if hasattr(value, "__dlpack__") and hasattr(value, "__dlpack_device__"):
        try:
            view = _read_dlpack(value)
        except (TypeError, ValueError, BufferError, RuntimeError, AttributeError) as exc:
            return f"cannot read {where} through DLPack: {exc}"
        device_type = view.device[0]
        if view.dtype is None:
            return f"{where} holds {view.dtype_text}, which napkin has no type for"
        if device_type in _DL_HOST_READABLE:
            return view.host_view(), view
        if device_type != _DL_CUDA:
            return f"{where} is on DLPack device type {device_type}; napkin reads host memory and CUDA devices"
        contiguous = view.contiguous()
        device = DeviceArray(view.address, view.shape, view.dtype, value)
    elif _has_cuda_interface(value):
        interface = value.__cuda_array_interface__
        shape = tuple(int(n) for n in interface["shape"])
        try:
            dtype = _interface_dtype(interface["typestr"], target)
        except TypeError:
            return f"{where} has __cuda_array_interface__ typestr {interface['typestr']!r}, which napkin has no type for"
        strides = interface.get("strides")
        contiguous = strides is None or tuple(strides) == c_strides(shape, dtype.itemsize)
        device = DeviceArray(int(interface["data"][0]), shape, dtype, value)
    else:
        return None
    if not keep_on_device:
        return (f"{where} is in CUDA device memory, which the host backends (numpy, opencl) cannot read; "
                f"call with backend='cuda', or copy it to the host first")
    if not contiguous:
        return f"{where} is not C-contiguous on its device; the CUDA backend reads it in place: pass a contiguous copy"
    return device, value


def _fixed_size(diagram: Diagram, axis: str) -> int | None:
    """An axis whose size the kernel itself fixes to an integer, or None for a symbol."""
    size = diagram.axes[axis].size
    return int(size) if isinstance(size, int) or size.is_Integer else None


def bind(diagram, arrays: dict, scalars: dict | None = None, cast: bool = False, *, sizes: dict | None = None,
         keep_on_device: bool = False) -> Binding:
    """Check the arguments of one call of ``diagram`` and bind its axes to sizes.

    ``diagram`` is a :class:`~napkin_dsl.diagram.Diagram` or a kernel (anything with a
    ``diagram``). ``arrays`` maps array parameter names to arrays; ``scalars`` maps
    scalar parameter names to real numbers; ``sizes`` gives axes that no input carries (those
    only in outputs or intermediates, such as an opaque box's output axis) and may restate
    others, which must then agree.

    With ``cast=False`` (the default) each array must already be of the declared dtype (byte
    order aside): a ``numpy.ndarray``, or an array of another library read through DLPack or
    ``__cuda_array_interface__`` (a torch bf16 tensor is a bf16 array). A silent conversion
    would hide a float32 array passed to a bf16 kernel. With ``cast=True`` any array-like
    (lists, arrays of other real dtypes, objects with ``__array__``) is converted with
    ``numpy.asarray`` then ``astype``; complex, text and object data, and floats into integer
    dtypes, are still refused. Device memory is never converted: with ``keep_on_device=True``
    (the CUDA backend) a CUDA array must already have the declared dtype and be C-contiguous,
    and it is bound as a :class:`DeviceArray` over the caller's memory; without it, a CUDA
    array is refused.

    The outputs go back as the array type of the first input that is not a NumPy array
    (:meth:`Binding.deliver`); an output dtype that library cannot hold (bf16 for CuPy)
    raises NotImplementedError here, before anything runs.

    Raises :class:`~napkin_dsl.errors.NapkinCallError` listing every problem at once.

    The steps, in order: the arguments against the signature (:func:`_argument_problems`); the
    sizes the kernel fixes; each array read (:func:`_readable_array`), checked and copied, its
    axes bound (:func:`_bind_array`); ``sizes=`` (:func:`_bind_given_sizes`); axes left unbound
    (:func:`_unbound_axis_problems`); each scalar (:func:`_bind_scalar`). Each check returns its
    reasons and this function raises once, with the whole call; then whether the caller's
    library can hold the outputs (:func:`_output_refusal`).
    """
    diagram = diagram_of(diagram)
    scalars = dict(scalars or {})
    arrays = dict(arrays)
    sizes = dict(sizes or {})
    problems = _Problems()
    problems.extend(_argument_problems(diagram, arrays, scalars))

    # Axis sizes: the first argument carrying an axis binds it; every later one must agree.
    bound = _sizes_the_kernel_fixes(diagram)
    converted: dict[str, Any] = {}
    caller: _Caller | None = None
    for name in _array_params(diagram):
        if name not in arrays:
            continue
        argument = _readable_array(name, arrays[name], diagram.arrays[name], cast, keep_on_device)
        if isinstance(argument, str):
            problems.add(argument)
            continue
        if argument.foreign:
            caller = caller or _Caller.of(arrays[name])
        copy, array_problems = _bind_array(name, argument, diagram.arrays[name], cast, bound)
        problems.extend(array_problems)
        if copy is not None:
            converted[name] = copy
        del argument  # with it its keepalive (a DLPack capsule): the producer may release its memory

    problems.extend(_bind_given_sizes(diagram, sizes, bound))
    if diagram.views:  # a convolution's output length, read off its window read
        for axis, found in windows.inferred_sizes(diagram, {a: v[0] for a, v in bound.items()}).items():
            bound.setdefault(axis, found)
    problems.extend(_unbound_axis_problems(diagram, bound))
    if diagram.views and all(axis in bound for axis in diagram.axes):
        problems.extend(message for message, _ in windows.window_problems(diagram, {a: v[0] for a, v in bound.items()}))

    bound_scalars: dict[str, np.generic] = {}
    for name in _scalar_params(diagram):
        if name not in scalars:
            continue
        scalar = _bind_scalar(name, scalars[name], diagram.scalars[name], cast)
        if isinstance(scalar, _Refused):
            problems.add(scalar.reason)
        else:
            bound_scalars[name] = scalar

    problems.raise_if_any(diagram, arrays, scalars)
    if caller is not None and (refusal := _output_refusal(diagram, caller)) is not None:
        raise refusal
    ordered = {axis: bound[axis][0] for axis in diagram.axes}
    return Binding(ordered, converted, bound_scalars, caller)


def _array_params(diagram: Diagram) -> list[str]:
    return [p for p in diagram.params if p in diagram.arrays]


def _scalar_params(diagram: Diagram) -> list[str]:
    return [p for p in diagram.params if p in diagram.scalars]


def _argument_problems(diagram: Diagram, arrays: dict, scalars: dict) -> list[str]:
    """Which parameters the call leaves out, and which arguments the kernel does not take.

    A parameter passed in the wrong one of ``arrays`` and ``scalars`` is named as such, so the
    fix is plain; an unknown name gets its close matches."""
    array_params, scalar_params = _array_params(diagram), _scalar_params(diagram)
    problems = []
    for name in array_params:
        if name not in arrays:
            where = " (it was passed as a scalar)" if name in scalars else ""
            problems.append(f"missing array {name}: {diagram.arrays[name].dtype}[{' '.join(diagram.arrays[name].axes)}]{where}")
    for name in scalar_params:
        if name not in scalars:
            where = " (it was passed as an array)" if name in arrays else ""
            problems.append(f"missing scalar {name}: {diagram.scalars[name].dtype}{where}")
    for kind, given in (("argument", arrays), ("scalar", scalars)):
        for name in given:
            if name not in array_params and name not in scalar_params:
                problems.append(f"unexpected {kind} {name!r}: {diagram.name} takes {', '.join(diagram.params)}"
                                + _did_you_mean(name, diagram.params))
    return problems


def _sizes_the_kernel_fixes(diagram: Diagram) -> dict[str, tuple[int, str]]:
    """axis -> (size, where it came from) for the axes the kernel fixes to an integer: the
    start of the binding, so that an argument disagreeing with the kernel is reported."""
    bound: dict[str, tuple[int, str]] = {}
    for axis in diagram.axes:
        fixed = _fixed_size(diagram, axis)
        if fixed is not None:
            bound[axis] = (fixed, "the kernel")
    return bound


@dataclass(frozen=True)
class _Readable:
    """An array argument napkin can read: a NumPy array or a :class:`DeviceArray`.

    ``foreign``: it came from another library (its outputs go back as that library's arrays);
    ``keepalive`` keeps a foreign array's memory valid until it is copied."""

    value: Any
    foreign: bool
    keepalive: Any = None


def _readable_array(name: str, value, declared, cast: bool, keep_on_device: bool) -> _Readable | str:
    """The argument as an array napkin can read, or why it is not one.

    A foreign array is read through DLPack or ``__cuda_array_interface__``; a masked array is
    refused (its mask would be dropped silently); any other array-like only with ``cast=True``."""
    target = numpy_dtype(declared.dtype)
    foreign = None if isinstance(value, np.ndarray) else _traced(name, value) or _foreign_array(name, value, target, keep_on_device)
    if isinstance(foreign, str):
        return foreign
    if foreign is not None:
        array, keepalive = foreign
        return _Readable(array, True, keepalive)
    if isinstance(value, np.ma.MaskedArray):
        return f"{name} is a masked array; napkin would drop its mask. Pass numpy.ma.filled({name}) instead"
    if not isinstance(value, (np.ndarray, DeviceArray)):
        if not cast:
            return (f"{name} must be a numpy.ndarray of {_dtype_text(declared.dtype)}, got {type(value).__name__}; "
                    f"pass cast=True to convert array-likes")
        try:
            value = np.asarray(value)
        except (TypeError, ValueError) as exc:  # an array-like that cannot become an array (e.g. a GPU array)
            return f"cannot convert {name} ({type(value).__name__}) to an array: {exc}"
    return _Readable(value, False)


def _rank_problem(name: str, value, declared) -> str | None:
    """Why the array's rank does not match its declared axes, or None."""
    if len(value.shape) != len(declared.axes):
        return (f"{name} is declared {declared.dtype}[{' '.join(declared.axes)}] ({len(declared.axes)} axes) "
                f"but got an array of shape {tuple(value.shape)} ({len(value.shape)} axes)")
    return None


def _dtype_problem(name: str, argument: _Readable, declared, cast: bool) -> str | None:
    """Why the array cannot be bound in its declared dtype, or None.

    Without ``cast`` it must already have that dtype (a silent conversion would hide a float32
    array passed to a bf16 kernel); device memory is never converted; with ``cast`` the
    conversion must not lose meaning (:func:`_conversion_problem`)."""
    value, target = argument.value, numpy_dtype(declared.dtype)
    if _same_dtype(value.dtype, target):
        return None
    if isinstance(value, DeviceArray):
        return (f"{name} is {value.dtype} in CUDA device memory but is declared {_dtype_text(declared.dtype)}; "
                f"napkin does not convert on the device: convert it there first")
    if not cast:
        how = "with .astype(...)" if not argument.foreign else "first"
        return f"{name} must be {_dtype_text(declared.dtype)}, got {value.dtype}; convert it {how} or pass cast=True"
    if refusal := _conversion_problem(value.dtype, target):
        return f"{name}: {refusal} ({name} is declared {_dtype_text(declared.dtype)})"
    return None


def _agreement_problem(axis: str, size: int, where: str, bound: dict) -> str | None:
    """Why ``axis`` cannot be ``size`` as ``where`` says: an earlier argument (or the kernel)
    bound it to another size. None when it agrees or is not bound yet."""
    if axis in bound and bound[axis][0] != size:
        return f"axis {axis} is {bound[axis][0]} in {bound[axis][1]} but {size} in {where}"
    return None


def _bind_array(name: str, argument: _Readable, declared, cast: bool, bound: dict) -> tuple[Any, list[str]]:
    """One readable array checked, its axes bound into ``bound``: (its private copy, or the
    device array itself; None when refused) and the problems found.

    A rank mismatch stops there (its dims name no axis); a dtype problem still lets the sizes be
    checked and bound, so that one call reports both."""
    rank = _rank_problem(name, argument.value, declared)
    if rank is not None:
        return None, [rank]
    dtype = _dtype_problem(name, argument, declared, cast)
    problems = [dtype] if dtype is not None else []
    value = argument.value
    for dim, (axis, size) in enumerate(zip(declared.axes, value.shape, strict=False)):
        if size == 0:
            problems.append(f"axis {axis} has size 0 in {name} (dim {dim}); napkin kernels need at least one element along every axis")
            continue
        where = f"{name} (dim {dim})"
        disagreement = _agreement_problem(axis, size, where, bound)
        if disagreement is not None:
            problems.append(disagreement)
        else:
            bound.setdefault(axis, (int(size), where))
    if dtype is not None:
        return None, problems
    if isinstance(value, DeviceArray):
        return value, problems  # read in place by the CUDA backend: zero-copy
    # Always a fresh C-contiguous copy: never a view of, nor a reference to, the user's array;
    # converted (cast=True) as every napkin backend stores the dtype: an fp8 one saturating.
    return convert(value, declared.dtype, order="C"), problems


def _given_size_problem(diagram: Diagram, axis: str, size) -> str | None:
    """Why ``sizes[axis] = size`` is not a size of one of the kernel's axes, or None."""
    if axis not in diagram.axes:
        return (f"sizes= names axis {axis!r}, which {diagram.name} does not have; its axes are "
                f"{' '.join(diagram.axes)}" + _did_you_mean(axis, diagram.axes))
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        return f"sizes[{axis!r}] must be an integer, got {_describe_value(size)}"
    if size <= 0:
        return f"sizes[{axis!r}] is {size}; napkin kernels need at least one element along every axis"
    return None


def _bind_given_sizes(diagram: Diagram, sizes: dict, bound: dict) -> list[str]:
    """``sizes=`` bound into ``bound`` after the arrays (so a disagreement names the array);
    the problems found."""
    problems = []
    for axis, size in sizes.items():
        problem = _given_size_problem(diagram, axis, size) or _agreement_problem(axis, size, "sizes=", bound)
        if problem is not None:
            problems.append(problem)
        else:
            bound.setdefault(axis, (int(size), "sizes="))
    return problems


def _unbound_axis_problems(diagram: Diagram, bound: dict) -> list[str]:
    """The axes that neither an input nor ``sizes=`` gave a size, each with where it appears.

    Axes of an input that failed are reported with that input, not as unbound here."""
    input_axes = {axis for name in _array_params(diagram) for axis in diagram.arrays[name].axes}
    problems = []
    for axis in diagram.axes:
        if axis not in bound and axis not in input_axes:
            holders = [a.name for a in diagram.arrays.values() if axis in a.axes]
            where = f"only in {', '.join(holders)}" if holders else "in no array (an opaque box's axis)"
            problems.append(f"axis {axis} is not carried by any input (it appears {where}); "
                            f"give its size with sizes={{{axis!r}: N}}")
    return problems


@dataclass(frozen=True)
class _Refused:
    """Why a scalar argument was refused (a class, not a bare string, so that no argument value
    can be mistaken for a reason)."""

    reason: str


def _scalar_value(name: str, value):
    """A 0-d array (NumPy's, or another library's) as its one value; other values as they are;
    a :class:`_Refused` for a 0-d array napkin cannot read."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value[()]
    if not isinstance(value, np.generic) and getattr(value, "shape", None) == () and hasattr(value, "item"):
        value = _foreign_scalar(name, value)
        if isinstance(value, str):
            return _Refused(value)
    return value


def _scalar_problem(name: str, value, declared, cast: bool) -> str | None:
    """Why ``value`` cannot be the scalar ``name`` of its declared dtype, or None.

    Booleans are refused (a flag is not a number); an integer scalar takes 3.0 with ``cast``,
    never 2.5 (truncating would change the kernel's result), and only values its dtype holds."""
    target = numpy_dtype(declared.dtype)
    real = isinstance(value, (int, float, np.integer, np.floating)) or (
        isinstance(value, np.generic) and _is_real_numeric(np.dtype(type(value))))
    if isinstance(value, (bool, np.bool_)) or not real:
        return f"scalar {name} must be a real number ({_dtype_text(declared.dtype)}), got {_describe_value(value)}"
    if target.kind in "iu":
        integral = isinstance(value, (int, np.integer)) or (cast and float(value).is_integer())
        if not integral:
            return f"scalar {name} is {_dtype_text(declared.dtype)} but got {_describe_value(value)}; pass an integer"
        info = np.iinfo(target)
        if not info.min <= int(value) <= info.max:
            return f"scalar {name} = {value!r} does not fit {_dtype_text(declared.dtype)}"
    return None


def _bind_scalar(name: str, value, declared, cast: bool) -> np.generic | _Refused:
    """The scalar as a NumPy scalar of its declared dtype, or why it is refused."""
    value = _scalar_value(name, value)
    if isinstance(value, _Refused):
        return value
    problem = _scalar_problem(name, value, declared, cast)
    if problem is not None:
        return _Refused(problem)
    target = numpy_dtype(declared.dtype)
    return target.type(int(value) if target.kind in "iu" else value)


def _output_refusal(diagram: Diagram, caller: _Caller) -> Exception | None:
    """Why the outputs cannot go back as the caller's arrays (the error to raise), or None.

    Checked before anything runs, so that a long kernel is not run for outputs that cannot be
    returned: JAX without 64-bit types would silently halve a 64-bit output, and a library with
    no array type of an output's dtype (CuPy and bf16) cannot hold it at all."""
    for output in diagram.outputs:
        dtype = numpy_dtype(diagram.arrays[output].dtype)
        if caller.framework == "jax" and dtype.itemsize == 8 and not _jax_x64():
            return NapkinCallError(f"{diagram.name}'s output {output} is {_dtype_text(diagram.arrays[output].dtype)}, "
                                   f"but JAX runs without 64-bit types and would return it as 32 bits",
                                   hint="jax.config.update('jax_enable_x64', True), or pass NumPy arrays")
        if _cannot_hold(caller.framework, dtype):
            return NotImplementedError(f"returning {diagram.name}'s output {output} ({_dtype_text(diagram.arrays[output].dtype)}) "
                                       f"as a {caller.framework} array: {caller.framework} has no {dtype.name} type; "
                                       f"pass NumPy arrays to get NumPy outputs")
    return None


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
    diagram = diagram_of(diagram)
    held, _ = _arrays_bytes(diagram, sizes)
    return held + _workspace_bytes(diagram, sizes)


def format_gib(n: int) -> str:
    if n >= 2**1000:  # beyond float64: only sizes past check.MAX_SIZE get here, and the guard must still say it
        return f"{format(decimal.Decimal(n) / 2**30, '.2e')} GiB"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def memory_limit(limit: float | None, given: str) -> tuple[float, str]:
    """The limit a memory guard applies and where it comes from, for its message."""
    if limit is not None:
        return limit, given
    total = physical_memory_bytes()
    return default_memory_limit(), (f"25% of {format_gib(total)} of memory" if total else "the default when memory size is unknown")


def check_reference_memory(diagram, sizes: dict, limit: float | None = None) -> int:
    """Raise NapkinCallError if the reference would need more than ``limit`` bytes; return the estimate.

    ``limit`` defaults to :func:`default_memory_limit` (25% of physical memory); pass
    ``math.inf`` to switch the guard off.
    """
    diagram = diagram_of(diagram)
    need = estimate_reference_bytes(diagram, sizes)
    limit, source = memory_limit(limit, given="memory_limit=")
    if need > limit:
        _, held = _arrays_bytes(diagram, sizes)
        largest_bytes, largest = max(held)
        shown = ", ".join(f"{a}={sizes[a]}" for a in diagram.axes)
        raise NapkinCallError(
            f"the NumPy reference of {diagram.name} would need about {format_gib(need)} at {shown}, more than its limit of "
            f"{format_gib(int(limit))} ({source}); the largest array is {largest}: {format_gib(largest_bytes)}",
            hint="evaluate it at smaller sizes, or pass memory_limit= (bytes) to allow more",
        )
    return need
