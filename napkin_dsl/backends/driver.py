"""A thin, checked layer over the CUDA driver API (``cuda.bindings.driver``).

:func:`cuda_available` says, without raising, whether a CUDA GPU can be used. :class:`Device`
holds the primary context of one GPU and does the few things napkin's CUDA backend needs:
load a cubin (``cuModuleLoadData``), look up a kernel, allocate, copy and free device memory,
and launch with a grid, a block, dynamic shared memory and an optional stream. Every driver
call goes through :func:`check`, which turns a failing ``CUresult`` into a
:class:`CudaDriverError` that names the call.

Without a GPU (no libcuda, or ``cuInit`` fails, or no device) the answer is one clear
:class:`NoCudaDevice`, a :class:`~napkin_dsl.errors.NapkinError` because it is about the
user's machine; callers that can fall back to the NumPy backend catch it. The probe runs once
per process.

Deliberately not here: compiling (``nvrtc.py``), choosing launch shapes, arrays with shapes
and dtypes (a :class:`DeviceBuffer` is raw bytes), timing, and multi-GPU placement.
Importing this module does not import cuda-python.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import NapkinError

# Above this much dynamic shared memory a kernel must opt in with
# CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (48 KiB on every architecture since sm_70).
DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024


class NoCudaDevice(NapkinError):
    """There is no usable CUDA GPU here (no driver, cuInit failed, or no device)."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(
            f"no CUDA GPU: {reason}",
            hint="napkin can still check, cost and run kernels on the CPU with the NumPy backend",
        )


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; ``call`` names it and ``result`` is the CUresult."""

    def __init__(self, call: str, result: Any):
        self.call = call
        self.result = result
        name = getattr(result, "name", str(result))
        description = _error_string(result)
        super().__init__(f"{call} failed: {name}" + (f" ({description})" if description else ""))


def _driver_module():
    try:
        from cuda.bindings import driver
    except ImportError as error:
        raise NoCudaDevice(f"cuda-python is not installed ({error})") from None
    return driver


def _error_string(result: Any) -> str:
    """The driver's description of a CUresult, or "" when the driver itself cannot be asked."""
    try:
        driver = _driver_module()
        status, text = driver.cuGetErrorString(result)
        if status == driver.CUresult.CUDA_SUCCESS and text:
            return text.decode() if isinstance(text, bytes) else str(text)
    except (RuntimeError, OSError, NapkinError):  # no libcuda: the enum's name alone has to do
        return ""
    return ""


def check(result: Any, call: str) -> Any:
    """Raise CudaDriverError if a cuda.bindings.driver result failed, else return its values.

    cuda.bindings returns ``(CUresult, *values)``: this returns None for no values, the value
    for one, and a tuple for several.
    """
    status, *values = result if isinstance(result, tuple) else (result,)
    driver = _driver_module()
    if status != driver.CUresult.CUDA_SUCCESS:
        raise CudaDriverError(call, status)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _call(name: str, *args) -> Any:
    """Call cuda.bindings.driver.<name>(*args) and check it, naming the call in any error."""
    return check(getattr(_driver_module(), name)(*args), name)


@functools.cache
def _probe() -> tuple[int, str]:
    """(device count, "") or (0, why not); run once per process, never raises."""
    try:
        driver = _driver_module()
    except NoCudaDevice as error:
        return 0, error.reason
    try:
        (status,) = driver.cuInit(0)
    except (RuntimeError, OSError) as error:  # cuda.pathfinder's DynamicLibNotFoundError when libcuda is absent
        return 0, f"the NVIDIA driver (libcuda) could not be loaded: {error}"
    if status != driver.CUresult.CUDA_SUCCESS:
        return 0, f"cuInit failed with {getattr(status, 'name', status)}"
    try:
        count = _call("cuDeviceGetCount")
    except CudaDriverError as error:
        return 0, str(error)
    if count == 0:
        return 0, "the NVIDIA driver reports no CUDA device"
    return count, ""


def cuda_available() -> bool:
    """Whether a CUDA GPU can be used here. Never raises."""
    try:
        return _probe()[0] > 0
    except Exception:  # noqa: BLE001 - the promise is "never raises", whatever the bindings do
        return False


@dataclass
class DeviceBuffer:
    """``nbytes`` of device memory at address ``ptr``; free it with :meth:`Device.free`."""

    ptr: int
    nbytes: int
    handle: Any  # the CUdeviceptr, which the copy calls take

    def __int__(self) -> int:
        return self.ptr


@dataclass(frozen=True)
class LoadedModule:
    """A cubin loaded into a device's context."""

    handle: Any
    device: Device

    def function(self, name: str) -> Any:
        """The CUfunction of the ``extern "C"`` kernel ``name``."""
        return _call("cuModuleGetFunction", self.handle, name.encode())


def _dims(shape: int | Sequence[int], what: str) -> tuple[int, int, int]:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not 1 <= len(dims) <= 3 or any(int(d) < 1 for d in dims):
        raise ValueError(f"{what} must be 1 to 3 positive sizes, not {shape!r}")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))  # type: ignore[return-value]


# ---- tensor maps (TMA) ---------------------------------------------------------------------
# The enums of cuTensorMapEncodeTiled as the driver API numbers them (cuda.h; cuda.bindings.driver
# spells the same values), so that the arguments can be built and checked without libcuda.
# The driver API has no 8-bit float type: TMA moves bytes, so fp8 goes as UINT8.
TENSOR_MAP_DATA_TYPE = {"u8": 0, "u16": 1, "u32": 2, "i32": 3, "u64": 4, "i64": 5, "f16": 6, "f32": 7, "f64": 8, "bf16": 9,
                        "fp8e4m3": 0, "fp8e5m2": 0}
_ELEMENT_BYTES = {"u8": 1, "u16": 2, "u32": 4, "i32": 4, "u64": 8, "i64": 8, "f16": 2, "f32": 4, "f64": 8, "bf16": 2,
                  "fp8e4m3": 1, "fp8e5m2": 1}
TENSOR_MAP_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}  # span in bytes -> CU_TENSOR_MAP_SWIZZLE_{NONE,32B,64B,128B}
INTERLEAVE_NONE = 0  # CU_TENSOR_MAP_INTERLEAVE_NONE
L2_PROMOTION = {0: 0, 64: 1, 128: 2, 256: 3}  # bytes -> CU_TENSOR_MAP_L2_PROMOTION_{NONE,L2_64B,L2_128B,L2_256B}
OOB_FILL_ZEROS = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-bounds elements read as zeros
TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap), aligned to 64


@dataclass(frozen=True)
class TiledTensorMap:
    """The arguments of ``cuTensorMapEncodeTiled`` but the global address, innermost dimension
    first as the driver API takes them: ``global_dim`` elements per dimension, ``global_strides``
    the bytes between consecutive indices of dimensions 1 .. rank-1, ``box_dim`` the elements a
    copy moves per dimension, ``element_strides`` its traversal step, and the enums."""

    data_type: int
    global_dim: tuple
    global_strides: tuple
    box_dim: tuple
    element_strides: tuple
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int

    @property
    def rank(self) -> int:
        return len(self.global_dim)

    def words(self) -> tuple[int, ...]:
        """The arguments flat, in the call's order (data type, rank, dims, strides, box, element
        strides, interleave, swizzle, L2 promotion, OOB fill): what the OpenCL emulation decodes."""
        return (self.data_type, self.rank, *self.global_dim, *self.global_strides, *self.box_dim, *self.element_strides,
                self.interleave, self.swizzle, self.l2_promotion, self.oob_fill)


def tiled_tensor_map(dtype: str, shape: Sequence[int], box: Sequence[int], swizzle: int, l2_promotion: int = 128) -> TiledTensorMap:
    """The tensor map of a C-contiguous ``dtype`` array of ``shape`` (outermost first, as NumPy)
    copied by boxes of ``box`` elements (outermost first) with a ``swizzle`` span of 0, 32, 64 or
    128 bytes; checked against the driver API's rules for cuTensorMapEncodeTiled (rank 1..5,
    dims 1..2^32, strides multiples of 16 below 2^40, boxes 1..256 with an inner extent a
    multiple of 16 bytes and at most the swizzle span). Zeros fill the out-of-bounds."""
    if dtype not in TENSOR_MAP_DATA_TYPE:
        raise ValueError(f"no tensor map data type for {dtype}")
    eb = _ELEMENT_BYTES[dtype]
    dims = tuple(int(d) for d in reversed(shape))
    boxes = tuple(int(b) for b in reversed(box))
    if not 1 <= len(dims) <= 5 or len(boxes) != len(dims):
        raise ValueError(f"a tiled tensor map has rank 1 to 5 and a box of the same rank, not {shape} by {box}")
    if swizzle not in TENSOR_MAP_SWIZZLE or l2_promotion not in L2_PROMOTION:
        raise ValueError(f"no tensor map with swizzle {swizzle} and L2 promotion {l2_promotion}")
    if any(not 1 <= d <= 1 << 32 for d in dims):
        raise ValueError(f"globalDim {dims} must be 1 .. 2^32")
    strides, step = [], eb
    for d in dims[:-1]:
        step *= d
        strides.append(step)
    if any(s % 16 or s >= 1 << 40 for s in strides):
        raise ValueError(f"globalStrides {strides} (bytes) must be multiples of 16 below 2^40")
    if any(not 1 <= b <= 256 for b in boxes) or boxes[0] * eb % 16:
        raise ValueError(f"boxDim {boxes} must be 1 .. 256 with boxDim[0] * {eb} bytes a multiple of 16")
    if swizzle and boxes[0] * eb > swizzle:
        raise ValueError(f"the box's inner dimension ({boxes[0] * eb} bytes) exceeds the {swizzle}-byte swizzle span")
    return TiledTensorMap(TENSOR_MAP_DATA_TYPE[dtype], dims, tuple(strides), boxes, (1,) * len(dims),
                          INTERLEAVE_NONE, TENSOR_MAP_SWIZZLE[swizzle], L2_PROMOTION[l2_promotion], OOB_FILL_ZEROS)


class TensorMap:
    """A ``CUtensorMap`` the driver encoded: 128 bytes at a 64-byte aligned address of host memory
    this object owns, passed to a kernel as a ``const __grid_constant__ CUtensorMap`` parameter
    by value. (cuda-python's own ``CUtensorMap`` objects are not 64-byte aligned, which the
    driver API requires of the map it encodes into: napkin calls the C entry point with its own.)"""

    def __init__(self):
        self._storage = (ctypes.c_uint64 * (TENSOR_MAP_BYTES // 8 + 8))()
        base = ctypes.addressof(self._storage)
        self.address = base + (-base) % 64

    @property
    def words(self) -> ctypes.Array:
        return (ctypes.c_uint64 * (TENSOR_MAP_BYTES // 8)).from_address(self.address)


@functools.lru_cache(maxsize=1)
def _libcuda():
    """The driver library's ``cuTensorMapEncodeTiled`` (NoCudaDevice where there is no driver)."""
    try:
        library = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise NoCudaDevice(f"no libcuda ({error})") from None
    encode = library.cuTensorMapEncodeTiled
    u32, u64p, u32p = ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    # CUresult cuTensorMapEncodeTiled(CUtensorMap*, CUtensorMapDataType, cuuint32_t rank, void* globalAddress,
    #   const cuuint64_t* globalDim, const cuuint64_t* globalStrides, const cuuint32_t* boxDim,
    #   const cuuint32_t* elementStrides, interleave, swizzle, l2Promotion, oobFill) (enums: int)
    encode.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    encode.restype = ctypes.c_int
    return encode


def encode_tiled(tensor_map: TiledTensorMap, address: int) -> TensorMap:
    """``cuTensorMapEncodeTiled`` of ``tensor_map`` over the device memory at ``address`` (16-byte
    aligned). Needs the driver (libcuda): on a machine without one it raises NoCudaDevice."""
    if address % 16:
        raise ValueError(f"a tensor map's global address must be 16-byte aligned, not {address:#x}")
    m = tensor_map
    out = TensorMap()
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    result = _libcuda()(out.address, m.data_type, m.rank, address, (u64 * m.rank)(*m.global_dim),
                        (u64 * max(m.rank - 1, 1))(*m.global_strides), (u32 * m.rank)(*m.box_dim),
                        (u32 * m.rank)(*m.element_strides), m.interleave, m.swizzle, m.l2_promotion, m.oob_fill)
    if result != 0:
        check((_driver_module().CUresult(result),), "cuTensorMapEncodeTiled")
    return out


def _kernel_parameters(args: Sequence[Any]) -> tuple[ctypes.Array, list]:
    """The void*[] cuLaunchKernel reads, and the values it points at (keep them alive).

    Each argument's C type must be explicit, because the driver copies as many bytes as the
    kernel's parameter has and a Python int or float does not say how many that is.
    """
    values: list = []
    for index, arg in enumerate(args):
        if isinstance(arg, TensorMap):  # the driver copies its 128 bytes from the encoded map
            values.append(arg.words)
        elif isinstance(arg, DeviceBuffer):
            values.append(ctypes.c_uint64(arg.ptr))
        elif isinstance(arg, ctypes._SimpleCData):
            values.append(arg)
        elif isinstance(arg, np.generic):
            values.append(np.ctypeslib.as_ctypes_type(arg.dtype)(arg.item()))
        else:
            raise TypeError(
                f"kernel argument {index} is a {type(arg).__name__}; pass a DeviceBuffer, a ctypes value "
                "(ctypes.c_int(n)) or a NumPy scalar (np.float32(x)) so that its C type is explicit"
            )
    pointers = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(value) for value in values])
    return pointers, values


class Device:
    """One CUDA GPU through its primary context. Raises NoCudaDevice when there is none.

    Use as a context manager, or call :meth:`close`, to unload modules, free what is still
    allocated and release the context.
    """

    def __init__(self, ordinal: int = 0):
        count, reason = _probe()
        if count == 0:
            raise NoCudaDevice(reason)
        if not 0 <= ordinal < count:
            raise NoCudaDevice(f"device {ordinal} requested but only {count} CUDA device(s) are present")
        driver = _driver_module()
        self.ordinal = ordinal
        self.handle = _call("cuDeviceGet", ordinal)
        self.context = _call("cuDevicePrimaryCtxRetain", self.handle)
        _call("cuCtxSetCurrent", self.context)
        raw_name = _call("cuDeviceGetName", 256, self.handle)
        self.name = raw_name.split(b"\0", 1)[0].decode(errors="replace")
        attribute = driver.CUdevice_attribute
        self.compute_capability = (
            _call("cuDeviceGetAttribute", attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.handle),
            _call("cuDeviceGetAttribute", attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.handle),
        )
        self._modules: list[LoadedModule] = []
        self._buffers: dict[int, DeviceBuffer] = {}
        self._dynamic_smem_opt_in: dict[int, int] = {}
        self._closed = False

    @property
    def arch(self) -> str:
        """The NVRTC architecture for this GPU, e.g. "sm_90"."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    # -- modules and kernels --

    def load(self, image: bytes | Any) -> LoadedModule:
        """Load a cubin (or a CompiledModule's image) into this device's context."""
        data = getattr(image, "image", image)
        _call("cuCtxSetCurrent", self.context)
        module = LoadedModule(_call("cuModuleLoadData", data), self)
        self._modules.append(module)
        return module

    def function(self, module: LoadedModule, name: str) -> Any:
        return module.function(name)

    # -- memory --

    def alloc(self, nbytes: int) -> DeviceBuffer:
        handle = _call("cuMemAlloc", max(int(nbytes), 1))
        buffer = DeviceBuffer(int(handle), int(nbytes), handle)
        self._buffers[buffer.ptr] = buffer
        return buffer

    def free(self, buffer: DeviceBuffer) -> None:
        if self._buffers.pop(buffer.ptr, None) is not None:
            _call("cuMemFree", buffer.handle)

    def to_device(self, array: np.ndarray, stream: Any = None) -> DeviceBuffer:
        """A new buffer holding a copy of ``array``'s bytes."""
        host = np.ascontiguousarray(array)
        buffer = self.alloc(host.nbytes)
        self.copy_to_device(buffer, host, stream)
        return buffer

    def copy_to_device(self, buffer: DeviceBuffer, array: np.ndarray, stream: Any = None) -> None:
        host = np.ascontiguousarray(array)
        if host.nbytes > buffer.nbytes:
            raise ValueError(f"{host.nbytes} bytes do not fit a {buffer.nbytes}-byte device buffer")
        if stream is None:
            _call("cuMemcpyHtoD", buffer.handle, host.ctypes.data, host.nbytes)
        else:
            _call("cuMemcpyHtoDAsync", buffer.handle, host.ctypes.data, host.nbytes, stream)

    def zero(self, buffer: DeviceBuffer, stream: Any = None) -> None:
        """Set every byte of ``buffer`` to 0 (an output a launch adds partial sums into)."""
        if stream is None:
            _call("cuMemsetD8", buffer.handle, 0, buffer.nbytes)
        else:
            _call("cuMemsetD8Async", buffer.handle, 0, buffer.nbytes, stream)

    def copy_to_host(self, buffer: DeviceBuffer, out: np.ndarray, stream: Any = None) -> np.ndarray:
        """Copy ``out.nbytes`` bytes from the buffer into ``out`` (C-contiguous, writable)."""
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise ValueError("copy_to_host needs a C-contiguous, writable array")
        if out.nbytes > buffer.nbytes:
            raise ValueError(f"the {buffer.nbytes}-byte device buffer cannot fill {out.nbytes} bytes")
        if stream is None:
            _call("cuMemcpyDtoH", out.ctypes.data, buffer.handle, out.nbytes)
        else:
            _call("cuMemcpyDtoHAsync", out.ctypes.data, buffer.handle, out.nbytes, stream)
        return out

    # -- launching --

    def launch(
        self,
        function: Any,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        args: Sequence[Any],
        shared_bytes: int = 0,
        stream: Any = None,
    ) -> None:
        """Launch ``function`` on ``grid`` x ``block`` with ``shared_bytes`` of dynamic shared memory.

        Asynchronous, as in CUDA: call :meth:`synchronize` (or synchronize the stream) before
        reading results.
        """
        driver = _driver_module()
        gx, gy, gz = _dims(grid, "grid")
        bx, by, bz = _dims(block, "block")
        if shared_bytes > DEFAULT_DYNAMIC_SMEM_LIMIT:
            key = int(function)
            if self._dynamic_smem_opt_in.get(key, 0) < shared_bytes:
                attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _call("cuFuncSetAttribute", function, attribute, int(shared_bytes))
                self._dynamic_smem_opt_in[key] = shared_bytes
        pointers, values = _kernel_parameters(args)
        handle = stream if stream is not None else driver.CUstream(0)
        _call("cuLaunchKernel", function, gx, gy, gz, bx, by, bz, int(shared_bytes), handle, ctypes.addressof(pointers), 0)
        del values  # the driver has copied the parameters by the time cuLaunchKernel returns

    def synchronize(self, stream: Any = None) -> None:
        if stream is None:
            _call("cuCtxSynchronize")
        else:
            _call("cuStreamSynchronize", stream)

    # -- lifetime --

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for buffer in list(self._buffers.values()):
            self.free(buffer)
        for module in self._modules:
            _call("cuModuleUnload", module.handle)
        self._modules.clear()
        _call("cuDevicePrimaryCtxRelease", self.handle)

    def __enter__(self) -> Device:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Device({self.ordinal}: {self.name}, {self.arch})"
