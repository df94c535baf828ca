"""Lowering: a :class:`~napkin_dsl.pseudocode.Program` -> one GPU kernel per launch, as text.

The same lowering prints CUDA C++ and OpenCL C; a :class:`Dialect` supplies the spelling
(qualifiers, thread ids, barriers, conversions, math functions, row reductions, the arena and
pointers into it, and the tensor-core printers' per-dialect pieces), so no printer asks which
dialect it prints. :class:`KernelWriter` is what the two printers share (lines, the kernel's
entry, the block order, origins and masks, device-memory indexing, expressions); the FMA
printer (:class:`Printer`, here) and the tensor-core printer (``tensorcore.TensorPrinter``)
each derive from it and own their steps.

How a Program maps onto a GPU:

* one thread block (work-group) per group at the compute level (SMEM); the block index is
  decomposed row-major over the grouped axes into tile origins;
* every buffer the Program keeps at the compute level lives in one shared-memory arena at an
  offset chosen from the Program's own liveness (the paper's columns), so the arena's size is
  the cost report's M for that level; an output that reuses the space of an input released by
  the same step is computed into registers first (contractions) or in place (maps, softmax);
* except a streamed contraction's running sum (``O.acc``), which each thread keeps in
  registers across the stream loop, for the 4 x 4 blocks of the output it owns
  (``isel.fma_accumulators``; the model counts it at ``registers``), unless it needs over
  ``isel.FMA_ACCUMULATOR_BUDGET`` registers a thread;
* loads and saves are cooperative loops in which consecutive threads touch consecutive
  elements of the array's last axis (coalesced), 16 bytes at a time when the tile allows it;
  tiles that run past the end of an axis are masked: loads pad with zero and every loop runs
  over the valid extent only;
* a stream partition is a sequential loop with the Program's init / rescale / online /
  accumulate / finalise steps; row reductions (reductions, softmax, the online softmax's
  running max and sum) give a warp per row and reduce with warp shuffles in CUDA, and a
  work-item per row in OpenCL;
* an unstreamed softmax evaluates its operand once per element, as the model counts it: its
  max pass keeps each value (in the target, or in registers) for the sum and the division;
* a result that takes bytes other threads may still read waits in registers, in one shape
  (``Printer.staged``): a per-thread ``stage`` array, a barrier, the write;
* transfers between device memory and the L2 level are the hardware's business (a cache):
  they print nothing.

Deliberately not here: choosing a printer per launch and joining the kernels into one
translation unit (``translate.py``), compiling (``nvrtc.py``), launching (``cuda.py``, ``opencl.py``),
tensor-core instructions (contractions are per-thread loops, in f32, or in f64 where the
Program computes in f64: every step is printed in the C type of its dtype), opaque boxes (they
have no body to print). fp8 arrays (``fp8e4m3``, ``fp8e5m2``) are their bytes in memory, decoded
exactly where they are read and encoded saturating where they are stored (:func:`fp8_prelude`).
"""

from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from .. import algebra
from ..algebra import as_number
from ..boxes import REDUCTION_TABLE, SCAN_FOLDS, accumulated, reduction
from .. import elementwise
from ..dtypes import DTYPE_BYTES, INTEGER_DTYPES
from ..diagram import Apply, Const, Contract, Index, Map, Opaque, Read, Reduce, ScalarParam, Scan, Softmax
from ..errors import NapkinError
from ..isel import FMA_THREADS, REGISTER_TILE, FmaAccumulator, register_tile_axes
from ..pseudocode import Loop, Program, Step, liveness, released_by, split_loop, walk
from ..reference import ReferenceFailure as _Failure
from ..windows import index_bounds
from ..windows import integer_at as window_value
from ..reference import constant_value
from .compiled import KernelSource

THREADS = FMA_THREADS
ALIGN = 16


class LoweringError(NapkinError):
    """The Program cannot be printed as a GPU kernel (unbound sizes, opaque boxes)."""


# ---- fp8 in memory ---------------------------------------------------------------------------

# The OCP 8-bit formats: (mantissa bits, exponent bias, IEEE-like specials, largest finite code,
# the NaN code types.convert stores). e4m3 has no infinity and its only NaN is S.1111.111; e5m2
# has infinity at S.11111.00 and NaN at S.11111.xx.
FP8_FORMATS = {"fp8e4m3": (3, 7, False, 0x7E, 0x7F), "fp8e5m2": (2, 15, True, 0x7B, 0x7E)}
FP8_C = {"fp8e4m3": "e4m3", "fp8e5m2": "e5m2"}


def fp8_prelude(inline: str, as_float: str, as_uint: str, rint: str, half_bits_to_float: str) -> str:
    """C (one text for both dialects, with their spelling of the bit casts, ``rint`` and the f16
    conversion ``half_bits_to_float(bits)``) that decodes an fp8 byte to float exactly
    (``nk_e4m3``, ``nk_e5m2``) and encodes a float as ``types.convert`` does (``nk_to_e4m3``,
    ``nk_to_e5m2``): round to nearest even, saturating (a value past the largest finite one, an
    infinity included, becomes it with its sign), NaN stays NaN.

    The decode goes through f16, branch-free: an e5m2 byte is the top byte of the f16 of the same
    value (infinities and NaN included), and an e4m3 byte moved into f16's exponent and mantissa
    fields is its value / 2^8, subnormals included (f16's exponent field is one bit wider, its
    bias 15 = 7 + 8), so the hardware's f16 conversion and an exact multiply decode it; e4m3's NaN
    (S.1111.111, a finite f16 there) is selected apart. Portable C rather than sm_89's
    cvt.f16x2.e4m3x2: one text runs on every arch and on the OpenCL device. The encode is bit
    arithmetic; a conversion outside the hot loop of a kernel costs nothing that matters."""
    out = []
    for dtype, (mbits, bias, ieee, largest, nan) in FP8_FORMATS.items():
        name = FP8_C[dtype]
        shift = 23 - mbits
        if ieee:
            decode = f"    return {half_bits_to_float('(unsigned int)c << 8')};  /* e5m2 is f16's top byte */\n"
        else:
            scale = 2.0 ** (15 - bias)
            decode = (f"    unsigned int b = c;\n"
                      f"    float v = {half_bits_to_float(f'((b & 0x80u) << 8) | ((b & 0x7fu) << {10 - mbits})')} * {scale!r}f;\n"
                      f"    return ((b & 0x7fu) == 0x7fu) ? {as_float}(0x7fc00000u) : v;  /* S.1111.111: NaN */\n")
        # 2^(bias - 1 + mbits): the inverse of the least subnormal; 2^(1 - bias): the least normal.
        out.append(f"""{inline} float nk_{name}(unsigned char c) {{
{decode}}}
{inline} unsigned char nk_to_{name}(float v) {{
    unsigned int bits = {as_uint}(v), sign = (bits >> 24) & 0x80u, a = bits & 0x7fffffffu, code;
    if (a > 0x7f800000u) return (unsigned char)(sign | {nan:#x}u); /* NaN */
    if (a < {(127 + 1 - bias) << 23:#x}u) {{ /* below the least normal: a multiple of the least subnormal */
        code = (unsigned int){rint}({as_float}(a) * {2.0 ** (bias - 1 + mbits)!r}f); /* exact product; rint ties to even */
    }} else {{ /* the mantissa rounded to {mbits} bits, ties to even; a carry moves to the exponent */
        code = ((a + {(1 << (shift - 1)) - 1}u + ((a >> {shift}) & 1u)) >> {shift}) - {(127 - bias) << mbits}u;
        if (code > {largest:#x}u) code = {largest:#x}u; /* saturate (an infinity too) */
    }}
    return (unsigned char)(sign | code);
}}
""")
    return "".join(out)


# ---- dialects -------------------------------------------------------------------------------


class Dialect:
    name = "abstract"
    storage = {}  # napkin dtype -> element type in memory

    float_suffix = ""  # libm spelling for float: CUDA's expf, OpenCL's overloaded exp
    # dtypes whose values a kernel may copy as they are, element to element, without widening
    # them (an implicit GEMM's gather, tensorcore.TensorPrinter.gather)
    bit_copied = ("f32", "f64", "f16", "bf16", "fp8e4m3", "fp8e5m2", "i32", "i64")
    prelude_f64 = ""  # what kernels computing in double need besides the prelude
    prelude_fp8 = ""  # what kernels with an fp8 array need besides the prelude

    def math(self, fn: str, args: list[str], real: str = "float") -> str:
        """An elementwise function or operator on expressions of C type ``real``: float, or
        double where the step computes in f64 (CUDA's double functions have no suffix). A
        function called by name is spelled by its entry in the table of elementwise functions
        (``elementwise.py``), with this dialect's libm suffix; the operators here."""
        entry = elementwise.function(fn)
        if entry is not None:
            return entry.spell(args, self.float_suffix, real)
        x, y = args[0], args[-1]
        table = {
            "pow": f"pow{self.float_suffix if real == 'float' else ''}({x}, {y})",
            "add": f"({x} + {y})", "sub": f"({x} - {y})", "mul": f"({x} * {y})", "div": f"({x} / {y})",
            # Masks: comparisons and logic are C ints (0 or 1), where is the conditional operator.
            "ge": f"({x} >= {y})", "gt": f"({x} > {y})", "le": f"({x} <= {y})", "lt": f"({x} < {y})",
            "eq": f"({x} == {y})", "ne": f"({x} != {y})", "and": f"({x} && {y})", "or": f"({x} || {y})",
            "not": f"(!({x}))", "where": f"(({x}) ? ({args[1 % len(args)]}) : ({y}))",
        }
        return table[fn]


class CudaDialect(Dialect):
    name = "cuda"
    float_suffix = "f"
    storage = {"f32": "float", "f64": "double", "f16": "__half", "bf16": "__nv_bfloat16",
               "fp8e4m3": "unsigned char", "fp8e5m2": "unsigned char", "i32": "int", "i64": "long long"}
    prelude_fp8 = fp8_prelude("__device__ __forceinline__", "__uint_as_float", "__float_as_uint", "rintf",
                              lambda bits: f"__half2float(__ushort_as_half((unsigned short)({bits})))")
    base_prelude = """#include <cuda_fp16.h>
#include <cuda_bf16.h>

// NVRTC defines no INFINITY.
#define NK_INF __int_as_float(0x7f800000)
__device__ __forceinline__ float nk_f(float v) { return v; }
__device__ __forceinline__ float nk_f(double v) { return (float)v; }
__device__ __forceinline__ float nk_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float nk_f(__nv_bfloat16 v) { return __bfloat162float(v); }
"""

    # The fast forms' primitives (elementwise.FAST_PRELUDE): CUDA's intrinsics, at their documented error.
    fast_macros = ("#define NK_FAST_FN __device__ __forceinline__\n#define NK_EXPF(x) __expf(x)\n"
                   "#define NK_RCPF(x) __fdividef(1.0f, (x))\n")

    @property
    def prelude(self) -> str:
        return self.base_prelude + self.fast_macros + elementwise.FAST_PRELUDE + self.warp_folds("float")

    @property
    def prelude_f64(self) -> str:
        return self.warp_folds("double")

    def warp_folds(self, real: str) -> str:
        """One warp-wide fold (butterfly shuffles) per function a reduction folds with
        (boxes.REDUCTION_TABLE; the softmax's max and sum are two of them): a new reduction
        gets its fold here without a line of C of its own."""
        folds = sorted({entry.combine for entry in REDUCTION_TABLE.values() if entry.combine is not None})
        shuffled = "__shfl_xor_sync(0xffffffffu, v, o)"
        return "".join(f"""__device__ __forceinline__ {real} nk_warp_{fn}({real} v) {{
    for (int o = 16; o > 0; o >>= 1) v = {self.math(fn, ['v', shuffled], real)};
    return v;
}}
""" for fn in folds)

    # One block per SM is what the arenas allow anyway; it also leaves ptxas all the registers.
    kernel_qualifier = 'extern "C" __global__ void __launch_bounds__({threads}, 1)'
    global_const = "const {t}* __restrict__"
    global_mut = "{t}* __restrict__"
    local_ptr = "{t}*"
    thread_id = "threadIdx.x"
    block_id = "blockIdx.x"
    barrier = "__syncthreads();"
    rows_per_pass = "(NK_THREADS / 32)"
    row_start = "(nk_tid / 32)"
    lane_start = "(nk_tid % 32)"
    lane_step = "32"
    lanes = 32  # threads sharing one row
    # Lanes read the running max before lane 0 overwrites it (independent thread scheduling).
    warp_sync = "__syncwarp();"
    lane_zero = "(nk_tid % 32) == 0"  # the lane that writes a row's result

    def arena(self, align: int) -> str:
        """The shared-memory arena's declaration, its base aligned to ``align`` bytes (dynamic:
        its size is the launch's)."""
        return f"extern __shared__ __align__({align}) unsigned char nk_smem[];"

    def load(self, ptr: str, index: str, dtype: str, real: str = "float") -> str:
        if dtype in INTEGER_DTYPES:  # an index or a count: converted as C converts it
            return f"(({real}){ptr}[{index}])"
        # fp8 is a byte in memory: nk_f cannot tell e4m3 from e5m2, so each has its decoder.
        read = f"nk_{FP8_C[dtype]}({ptr}[{index}])" if dtype in FP8_C else f"nk_f({ptr}[{index}])"
        if real == "double":  # f64 as it is; narrower values widened before any arithmetic
            return f"{ptr}[{index}]" if dtype == "f64" else f"((double){read})"
        return read

    def atomic_add(self, ptr: str, index: str, value: str) -> str:
        """Add f32 ``value`` into ``ptr[index]`` in device memory, atomically: a group's partial sum
        (relabel.summed_over_groups). The result is not read: on sm_60 and later ptxas makes it
        RED.E.ADD.F32, which L2 performs."""
        return f"atomicAdd(&{ptr}[{index}], {value});"

    def store(self, ptr: str, index: str, value: str, dtype: str, real: str = "float") -> str:
        if dtype in INTEGER_DTYPES:  # an integer-valued float (check.py refuses any other), rounded as types.convert does
            return f"{ptr}[{index}] = ({self.storage[dtype]}){'rint' if real == 'double' else 'rintf'}({value});"
        if real == "double" and dtype != "f64":
            value = f"(float)({value})"
        convert = {"f32": "{v}", "f64": "(double)({v})", "f16": "__float2half({v})", "bf16": "__float2bfloat16({v})",
                   "fp8e4m3": "nk_to_e4m3({v})", "fp8e5m2": "nk_to_e5m2({v})"}[dtype]
        return f"{ptr}[{index}] = {convert.format(v=value)};"

    def row_reduce(self, fn: str, value: str) -> str:
        """``value`` folded by ``fn`` (an elementwise function: add, max, ...) over the warp."""
        return f"nk_warp_{fn}({value})"

    def vector_copy(self, dst: str, src: str) -> str | None:
        return f"*reinterpret_cast<uint4*>(&{dst}) = *reinterpret_cast<const uint4*>(&{src});"

    def vector_zero(self, dst: str) -> str | None:
        return f"*reinterpret_cast<uint4*>(&{dst}) = make_uint4(0u, 0u, 0u, 0u);"

    def arena_pointer(self, t: str, offset: int) -> str:
        return f"reinterpret_cast<{t}*>(nk_smem + {offset})"

    def shared_pointer(self, t: str, offset, const: bool = False) -> str:
        """A pointer to ``t`` at byte ``offset`` of the arena, as one operand."""
        return f"reinterpret_cast<{'const ' if const else ''}{t}*>(nk_smem + {offset})"

    def shared_word(self, offset) -> str:
        """The 32-bit word at byte ``offset`` of the arena, as an lvalue."""
        return f"*reinterpret_cast<unsigned*>(nk_smem + {offset})"

    def warp_scratch(self, words: str, warps: int) -> list[str]:
        """What the tensor-core primitives need per thread: the arena's shared-window address
        (ldmatrix, cp.async and wgmma descriptors take shared addresses). ``words``: the
        emulation's scratch a warp (OpenCL), unused here."""
        return ["const unsigned nk_sbase = (unsigned)__cvta_generic_to_shared(nk_smem);"]

    def tensor_map_name(self, entry: str, array: str) -> str:
        return f"nk_tmap_{ident(array)}"  # a kernel parameter: local to its kernel

    def tensor_maps(self, maps: dict) -> tuple[list[str], list[str]]:
        """The tensor maps (C name -> the encoder's words) as (kernel parameters, lines before
        the kernel): ``const __grid_constant__`` parameters the host encodes."""
        return [f"const __grid_constant__ CUtensorMap {name}" for name in maps], []

    fmin = "min"
    unroll = "#pragma unroll"


class OpenCLDialect(Dialect):
    name = "opencl"
    # bf16 lives in memory as its 16 raw bits; f16 as `half`, read with vload_half.
    storage = {"f32": "float", "f64": "double", "f16": "half", "bf16": "ushort", "fp8e4m3": "uchar", "fp8e5m2": "uchar",
               "i32": "int", "i64": "long"}
    bit_copied = tuple(t for t in Dialect.bit_copied if t != "f16")  # a `half` is loaded and stored by vload_half, vstore_half only
    prelude_fp8 = ("inline float nk_half_bits(uint bits) { ushort h = (ushort)bits; return vload_half(0, (const __private half*)&h); }\n"
                   + fp8_prelude("inline", "as_float", "as_uint", "rint", lambda bits: f"nk_half_bits({bits})"))
    prelude = """#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#define NK_INF INFINITY
/* A float added atomically (Dialect.atomic_add): retried until no other work-item changed it between. */
inline void nk_atomic_add_f32(volatile __global float* p, float v) {
    volatile __global uint* u = (volatile __global uint*)p;
    uint seen = atomic_or(u, 0u); /* read atomically: a plain read races with the other groups' adds */
    for (;;) {
        const uint was = atomic_cmpxchg(u, seen, as_uint(as_float(seen) + v));
        if (was == seen) break;
        seen = was;
    }
}
inline float nk_bf16(ushort v) { return as_float(((uint)v) << 16); }
inline ushort nk_to_bf16(float v) {
    uint bits = as_uint(v);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (ushort)0x7fc0u; /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (ushort)(bits >> 16);
}
/* The fast forms' primitives (elementwise.FAST_PRELUDE): OpenCL's precise exp and division. */
#define NK_FAST_FN inline
#define NK_EXPF(x) exp(x)
#define NK_RCPF(x) (1.0f / (x))
""" + elementwise.FAST_PRELUDE
    kernel_qualifier = "__kernel __attribute__((reqd_work_group_size({threads}, 1, 1))) void"
    global_const = "__global const {t}* restrict"
    global_mut = "__global {t}* restrict"
    local_ptr = "__local {t}*"
    thread_id = "(int)get_local_id(0)"
    block_id = "(int)get_group_id(0)"
    barrier = "barrier(CLK_LOCAL_MEM_FENCE);"
    # OpenCL has no portable warp shuffles: one work-item per row, reducing serially.
    rows_per_pass = "NK_THREADS"
    row_start = "nk_tid"
    lane_start = "0"
    lane_step = "1"
    lanes = 1
    warp_sync = ""
    lane_zero = "true"  # a work-item is its row's only lane

    def arena(self, align: int) -> str:
        return f"__local uchar nk_smem[NK_ARENA_BYTES] __attribute__((aligned({align})));"

    def load(self, ptr, index, dtype, real="float"):
        if dtype in INTEGER_DTYPES:  # an index or a count: converted as C converts it
            return f"(({real}){ptr}[{index}])"
        if dtype == "f64":
            return f"{ptr}[{index}]" if real == "double" else f"(float)({ptr}[{index}])"
        value = {"f16": f"vload_half({index}, {ptr})", "bf16": f"nk_bf16({ptr}[{index}])",
                 "fp8e4m3": f"nk_e4m3({ptr}[{index}])", "fp8e5m2": f"nk_e5m2({ptr}[{index}])"}.get(dtype, f"{ptr}[{index}]")
        # In a double step, narrower values are widened before any arithmetic sees them.
        return f"((double){value})" if real == "double" else value

    def atomic_add(self, ptr, index, value):
        # OpenCL 1.2 adds no floats atomically: a compare-and-swap loop on the value's bits (prelude)
        return f"nk_atomic_add_f32(&{ptr}[{index}], {value});"

    def store(self, ptr, index, value, dtype, real="float"):
        if dtype in INTEGER_DTYPES:  # an integer-valued float (check.py refuses any other), rounded as types.convert does
            return f"{ptr}[{index}] = ({self.storage[dtype]})rint({value});"
        if real == "double" and dtype != "f64":
            value = f"(float)({value})"
        if dtype == "f16":
            return f"vstore_half({value}, {index}, {ptr});"
        if dtype == "bf16":
            return f"{ptr}[{index}] = nk_to_bf16({value});"
        if dtype in FP8_C:
            return f"{ptr}[{index}] = nk_to_{FP8_C[dtype]}({value});"
        if dtype == "f64":
            return f"{ptr}[{index}] = (double)({value});"
        return f"{ptr}[{index}] = {value};"

    def row_reduce(self, op, value):
        return value

    def vector_copy(self, dst, src):
        return None

    def vector_zero(self, dst):
        return None

    def arena_pointer(self, t, offset):
        return f"(__local {t}*)(nk_smem + {offset})"

    def shared_pointer(self, t, offset, const=False):
        return f"((__local {'const ' if const else ''}{t}*)(nk_smem + {offset}))"

    def shared_word(self, offset):
        return f"*(__local uint*)(nk_smem + {offset})"

    def warp_scratch(self, words, warps):
        """The emulated primitives exchange lanes' values through a scratch of ``words`` words a
        warp in local memory (``tensorcore.OPENCL_PRELUDE``)."""
        return [f"__local uint nk_scratch[{warps} * {words}];", f"__local uint* nk_ws = nk_scratch + nk_warp * {words};"]

    def tensor_map_name(self, entry, array):
        return f"nk_tmap_{entry}_{ident(array)}"  # program scope: one per kernel

    def tensor_maps(self, maps):
        """Program-scope constants holding the encoder's words, which the emulation decodes."""
        return [], [f"__constant ulong {name}[{len(words)}] = {{{', '.join(map(str, words))}}};" for name, words in maps.items()]

    fmin = "min"
    unroll = ""


# ---- identifiers ----------------------------------------------------------------------------


def ident(name: str) -> str:
    """A napkin name (array, axis, scalar, kernel, or a state buffer such as ``O.acc``) as the
    ASCII tail of a C identifier; the printers put a fixed prefix per kind in front (``g_`` global
    arrays, ``s_`` shared buffers, ``f_`` fragments, ``r_`` register accumulators, ``p_``
    scalars, ``i_ o_ n_ c_ b_ grp_`` per axis, ``nk_c?_`` copy offsets, ``napkin_`` entries), and
    no prefix is a prefix of another.

    The notation allows any Unicode letters in names (``f32[Δ]``); NVRTC does not, in
    identifiers. The mapping is deterministic and injective, so distinct names never meet:

    * a *plain* name (ASCII letters, digits and single underscores, starting with a letter)
      is itself, so every ordinary kernel prints as before;
    * any other name is ``_`` followed by its characters, ASCII letters and digits as they
      are and every other character as ``_<hex code point>_`` (``Δ`` -> ``__394_``): it starts
      with ``_``, which no plain name does, and it reads back one way only;
    * a state buffer ``X.acc`` (``.max .sum .scale``) is ``ident(X)`` + ``__`` + ``acc``:
      a plain name has no ``__``, and in an escaped one ``__`` is followed by hex digits
      closed by ``_``, never by the end of the name (``acc``, ``max``, ``sum``, ``scale``),
      so no array's identifier equals a state's (``S_acc``'s is ``S_acc``, ``S.acc``'s
      ``S__acc``).
    """
    if "." in name:
        array, state = name.split(".", 1)
        return f"{ident(array)}__{state.replace('.', '_')}"  # a part's state (O.acc.part): O__acc_part
    plain = name[:1].isascii() and name[:1].isalpha() and "__" not in name and all(
        c.isascii() and (c.isalnum() or c == "_") for c in name)
    if plain:
        return name
    return "_" + "".join(c if c.isascii() and c.isalnum() else f"_{ord(c):x}_" for c in name)


# ---- elementwise expressions ----------------------------------------------------------------


def scalar_ctype(diagram, name: str) -> str:
    """A scalar parameter's C type: double for an f64 scalar (the launchers pass it unrounded),
    float for every other."""
    return "double" if diagram.scalars[name].dtype == "f64" else "float"


def literal(value: float, real: str = "float") -> str:
    """A constant as a C literal of type ``real``: a float one rounds to float, as the
    NumPy backend's f32 tiles do; a double one keeps every bit of the reference's value.
    Infinities are the prelude's NK_INF (NVRTC defines no INFINITY)."""
    if math.isinf(value):
        return "NK_INF" if value > 0 else "-NK_INF"
    return f"{value!r}f" if real == "float" else repr(value)


def print_expression(expr, sizes: dict, dialect: Dialect, read, index=None, real: str = "float",
                     scalars: dict | None = None) -> str:
    """An elementwise expression as a float expression; ``read(Read)`` spells array reads and
    ``index(axis)`` the whole array's index of the current element along an axis (an int)."""
    if isinstance(expr, Read):
        return read(expr)
    if isinstance(expr, Index):
        # both printers give every expression its element's indices
        assert index is not None, f"napkin bug: the index of axis {expr.axis} printed with no element"
        return f"(({real})({index(expr.axis)}))"
    if isinstance(expr, Const) and expr.value in (algebra.oo, -algebra.oo):
        return "NK_INF" if expr.value > 0 else "(-NK_INF)"
    if isinstance(expr, Const):
        # The reference's evaluation: the same float, and the same refusal of a power that no
        # float holds (substituting the sizes into i^-4294967296 would compute it exactly).
        try:
            value = constant_value(expr.value, sizes)
        except _Failure as failure:
            raise LoweringError(failure.message, hint=failure.hint) from None
        return literal(value, real)
    if isinstance(expr, ScalarParam):
        # Every operand in the step's type: OpenCL's fmax(double, float) does not compile.
        # ``scalars``: each scalar's declared C type (scalar_ctype), where it may differ.
        declared = (scalars or {}).get(expr.name, "float")
        return f"p_{ident(expr.name)}" if declared == real else f"(({real})p_{ident(expr.name)})"
    if isinstance(expr, Apply) and expr.fn in COMPARISON_FNS:
        # An index compared with an index (q >= x, q - x < 256): both sides are integers, so the
        # test is integer arithmetic, exact at any size, with no conversion to floating point.
        sides = [integer_expression(a, sizes, index) for a in expr.args]
        if all(side is not None for side in sides):
            return dialect.math(expr.fn, sides, real)
    if isinstance(expr, Apply):
        return dialect.math(expr.fn, [print_expression(a, sizes, dialect, read, index, real, scalars) for a in expr.args], real)
    raise AssertionError(f"napkin bug: expression {expr!r}")


COMPARISON_FNS = frozenset(("ge", "gt", "le", "lt", "eq", "ne"))
INTEGER_FNS = {"add": "+", "sub": "-", "mul": "*"}


def integer_expression(expr, sizes: dict, index) -> str | None:
    """An expression of indices and integer constants joined by +, - and * as a C int
    expression, or None when it is anything else (a read, a fraction, a function)."""
    if isinstance(expr, Index):
        return None if index is None else f"({index(expr.axis)})"
    if isinstance(expr, Const):
        if expr.value in (algebra.oo, -algebra.oo):
            return None
        try:
            value = constant_value(expr.value, sizes)
        except _Failure:
            return None
        return str(int(value)) if value == int(value) and abs(value) < 2 ** 31 else None
    if isinstance(expr, Apply) and (expr.fn in INTEGER_FNS or expr.fn == "neg"):
        args = [integer_expression(a, sizes, index) for a in expr.args]
        if any(a is None for a in args):
            return None
        return f"(-{args[0]})" if expr.fn == "neg" else f"({args[0]} {INTEGER_FNS[expr.fn]} {args[1]})"
    return None


# ---- shared-memory arena --------------------------------------------------------------------


@dataclass
class Slot:
    name: str
    offset: int
    size: int
    first: float
    last: float
    dtype: str
    axes: tuple




def plan_arena(program: Program, launch, registers=()) -> tuple[dict[str, Slot], int]:
    """Offsets in the shared-memory arena from the Program's liveness at the compute level.

    Buffers whose lifetimes overlap never share bytes. A buffer read for the last time by a
    computing step is free from that step on (the paper's column convention); the step then
    either works in place or stages its result in registers. Buffers named in ``registers``
    (the FMA path's register accumulators, ``isel.fma_accumulators``) take no bytes here: the
    model counts them at the ``registers`` level.
    """
    schedule = launch.schedule
    level = schedule.compute_level
    sequence, spans = liveness(launch.body)
    slots: dict[str, Slot] = {}
    order = []
    for ref, (first, last) in spans.items():
        if ref[0] != level or ref[1] in registers:
            continue
        end = last - 0.5 if released_by(sequence, spans, ref, last) else float(last)
        buffer = launch.buffers[ref]
        values = 1
        for axis in buffer.axes:
            values *= int(schedule.extent(axis, level))
        order.append((first, ref[1], values * DTYPE_BYTES[buffer.dtype], end, buffer))
    order.sort(key=lambda item: (item[0], item[1]))
    placed: list[Slot] = []
    for first, name, size, end, buffer in order:
        alive = [s for s in placed if not (s.last < first or end < s.first)]
        # An elementwise successor takes its dead input's place (same size: in place).
        step = sequence[int(first)][0] if first == int(first) else None
        preferred = None
        if step is not None and step.op in ("compute", "online", "finalise") and step.statement is not None and not isinstance(step.statement.box, Contract):
            for ref in step.reads:
                dead = slots.get(ref[1])
                if dead is not None and dead.size == size and dead.last < first and dead.axes == buffer.axes:
                    preferred = dead.offset
        candidates = ([preferred] if preferred is not None else []) + [0] + sorted(_align(s.offset + s.size, _slot_alignment(size, buffer.dtype)) for s in alive)
        for offset in candidates:
            if all(offset + size <= s.offset or s.offset + s.size <= offset for s in alive):
                break
        slot = Slot(name, offset, size, first, end, buffer.dtype, buffer.axes)
        slots[name] = slot
        placed.append(slot)
    arena = max((s.offset + s.size for s in placed), default=0)
    if arena > _peak(placed):
        # First fit in program order left holes (buffers of mixed sizes: fp8 tiles, f32 scales and
        # statistics); the arena must be the model's M, the largest column. Placing the largest
        # buffers first, each at the lowest offset free over its lifetime, closes them; the
        # program-order layout stays wherever it already is the column's size.
        packed = _pack_by_size(placed)
        if max(s.offset + s.size for s in packed.values()) < arena:
            return packed, max(s.offset + s.size for s in packed.values())
    return slots, arena


def _peak(placed: list[Slot]) -> int:
    """The most bytes live at once: the model's M at the level (its largest column)."""
    return max((sum(s.size for s in placed if s.first <= t.first <= s.last) for t in placed), default=0)


def _pack_by_size(placed: list[Slot]) -> dict[str, Slot]:
    """The same buffers placed largest first (ties in program order), each at the lowest offset
    (aligned as :func:`_slot_alignment` says) where no buffer alive at the same time lies."""
    out: dict[str, Slot] = {}
    for slot in sorted(placed, key=lambda s: (-s.size, s.first, s.name)):
        alive = [s for s in out.values() if not (s.last < slot.first or slot.last < s.first)]
        for offset in [0] + sorted(_align(s.offset + s.size, _slot_alignment(slot.size, slot.dtype)) for s in alive):
            if all(offset + slot.size <= s.offset or s.offset + s.size <= offset for s in alive):
                break
        out[slot.name] = Slot(slot.name, offset, slot.size, slot.first, slot.last, slot.dtype, slot.axes)
    return {s.name: out[s.name] for s in placed}  # in program order, as the printers read them


def _align(value: int, alignment: int = ALIGN) -> int:
    return (value + alignment - 1) // alignment * alignment


def _slot_alignment(size: int, dtype: str) -> int:
    """A buffer's alignment in the arena: 16 bytes where its size is whole 16-byte units (the
    copies move 16 bytes at a time only from a 16-byte aligned slot of whole units: step_load), else
    its values' own (a per-head scale sV[b h] is one f32 a block, which 16-byte alignment beside
    another such would pad past the model's M)."""
    return ALIGN if size % ALIGN == 0 else DTYPE_BYTES[dtype]


def state_start(name: str, statement, real: str = "float") -> str:
    """The value a piece of streaming state starts from: an online softmax's running max at
    -inf and its sum at 0, an accumulator at its reduction's start (boxes.accumulated: a
    contraction's running sum at 0)."""
    suffix = name.split(".")[-1]
    if suffix == "max":
        return literal(-math.inf, real)
    if suffix == "carry":  # a scan's running value before the first chunk
        return literal(SCAN_FOLDS[statement.box.op][0], real)
    if suffix == "acc":
        return literal(accumulated(statement.box).start, real)
    return literal(0.0, real)


def bound_sizes(program: Program) -> dict[str, int]:
    """Every axis size as an integer, or a LoweringError naming the first that is symbolic."""
    sizes = {}
    for axis in program.diagram.axes:
        value = as_number(program.schedule.axis_size(axis))
        if value is None:
            raise LoweringError(f"code generation needs every size bound; {axis!r} is not",
                                hint=f"pass sizes, e.g. --set {axis}=1024 (or call the kernel with arrays)")
        sizes[axis] = int(value)
    return sizes


# ---- the printer ----------------------------------------------------------------------------


@dataclass
class LoweredProgram:
    dialect: str
    source: str
    kernels: list = field(default_factory=list)


def walk_steps(body):
    """The steps of a body in program order."""
    return (step for step, _ in walk(body))


def is_split(launch) -> bool:
    """Whether ``launch`` is a split's parts launch or its combine launch."""
    return launch.combine is not None or split_loop(launch) is not None


def global_arrays(program: Program) -> dict[str, tuple[tuple[str, ...], str]]:
    """Every array a kernel of ``program`` may take in device memory -> (axes, dtype): the
    diagram's arrays and a split's part arrays (``O.acc.part[x# ...]``), which the parts launch
    saves and the combine launch loads (the runners allocate them)."""
    out = {name: (tuple(a.axes), a.dtype) for name, a in program.diagram.arrays.items()}
    top = program.levels[0]
    for launch in program.launches:
        for (level, name), buffer in launch.buffers.items():
            if level == top and name not in out:
                out[name] = (tuple(buffer.axes), buffer.dtype)
    return out


def global_sizes(program: Program) -> dict[str, int]:
    """Every axis a device-memory array has, as an integer: the diagram's and the part axes."""
    sizes = bound_sizes(program)
    for part in program.schedule.parts:
        sizes[part] = int(as_number(program.schedule.axis_size(part)))
    return sizes


def floor_div(n: str, d: int) -> str:
    """floor(n / d) in C for a positive constant ``d`` (C's division truncates toward zero)."""
    if d == 1:
        return f"({n})"
    return f"((({n}) >= 0) ? ({n}) / {d} : (({n}) - {d - 1}) / {d})"


def ceil_div(n: str, d: int) -> str:
    """ceil(n / d) in C for a positive constant ``d``: -floor(-n / d)."""
    return f"({n})" if d == 1 else f"(-{floor_div(f'-({n})', d)})"


class KernelWriter:
    """What both printers write with: the FMA printer (:class:`Printer`) and the tensor-core
    printer (``tensorcore.TensorPrinter``) each derive from it and own their steps; neither
    derives from the other.

    It holds the lines and fresh names of one kernel, its entry and signature (the arrays a
    launch takes in device memory, a split's part arrays included, and the scalars), the block
    order (grouped axes, the L2 swizzle, a split's part blocks), the tiles' origins and valid
    extents, indexing into device memory, the masks of a masked stream (the chunks a block
    visits, those held in full) and expression printing. Dialect differences are the
    dialect's (:class:`Dialect`); what a launch computes, and where its values live (the
    arena, registers, fragments), is each printer's.
    """

    def __init__(self, program: Program, launch, dialect: Dialect, threads: int):
        self.program = program
        self.schedule = launch.schedule  # the launch's view: only the partitions that apply to it
        self.diagram = program.diagram
        self.launch = launch
        self.dialect = dialect
        self.threads = threads
        self.level = self.schedule.compute_level
        self.lines: list[str] = []
        self.depth = 1
        self.sizes = global_sizes(program)  # with a split's part axes (x#): the number of parts
        self.tile = {axis: int(self.schedule.extent(axis, self.level)) for axis in self.sizes}
        # A split's parts launch: its parallel loop over the parts (one block per part and group),
        # the axis it cuts -> the part size; the part's origin and valid extent along that axis.
        self.cut = split_loop(launch)
        self.part_tile = {self.cut.axis: int(as_number(self.cut.tile))} if self.cut is not None else {}
        self.part_origin: dict[str, str] = {}
        self.part_valid: dict[str, str] = {}
        self.globals = global_arrays(program)
        self.grouped = self._grouped_axes()
        self.origin: dict[str, str] = {}
        self.valid: dict[str, str] = {}
        self.counter = 0
        # In a masked stream: the where(COND, A, -inf) the mask tests -> the flag of a chunk the
        # mask holds in full, where A is taken without the test (as the Program counts it).
        self.unmasked: dict = {}
        self.scalar_types = {n: scalar_ctype(self.diagram, n) for n in self.diagram.scalars}

    # -- the kernel's entry
    def kernel_arrays(self) -> tuple[list[tuple[str, str, str]], list[str]]:
        """(array, dtype, "in" or "out") for every array the kernel takes, in signature order,
        and the scalars; a LoweringError for an array of a dtype no GPU backend stores."""
        inputs, outputs = self.launch_arrays()
        arrays = [(n, self.globals[n][1], "in") for n in inputs]
        arrays += [(n, self.globals[n][1], "out") for n in outputs]
        for name, dtype, _ in arrays:
            if dtype not in self.dialect.storage:
                raise LoweringError(f"array {name} is {dtype}; the GPU backends do not support {dtype} yet",
                                    hint="use f32, f16 or bf16")
        return arrays, [n for n in self.diagram.params if n in self.diagram.scalars]

    def open_kernel(self, entry: str, arrays, scalars, extra=()):
        """The kernel's first line: qualifiers, entry, the arrays, the scalars and ``extra``
        parameters (wgmma's tensor maps)."""
        d = self.dialect
        params = [f"{(d.global_const if role == 'in' else d.global_mut).format(t=d.storage[dtype])} g_{ident(name)}"
                  for name, dtype, role in arrays]
        params += [f"{scalar_ctype(self.diagram, n)} p_{ident(n)}" for n in scalars]
        params += list(extra)
        self.lines.append(f"{d.kernel_qualifier.format(threads=self.threads)} {entry}({', '.join(params)}) {{")

    def close_kernel(self, entry: str, arrays, scalars) -> KernelSource:
        self.depth = 0
        self.emit("}")
        grid = math.prod(self.groups(a) for a in self.grouped) if self.grouped else 1
        zeroed = tuple(dict.fromkeys(step.array for step, _ in walk(self.launch.body) if step.op == "save" and step.add))
        return KernelSource(entry, "\n".join(self.lines) + "\n", grid, self.threads, self.arena, arrays, scalars, zeroed=zeroed)

    def global_offset(self, name: str, coords: dict, origins: dict) -> str:
        """The element index into device array ``name`` (row-major over its axes) of the tile
        element at ``coords`` (axis -> C expression within the tile) from ``origins`` (axis ->
        the tile's origin); an axis in neither is 0."""
        index = ""
        for axis in self.globals[name][0]:
            parts = [p for p in (origins.get(axis), coords.get(axis)) if p]
            term = " + ".join(parts) or "0"
            index = f"({term})" if not index else f"({index}) * {self.sizes[axis]} + ({term})"
        return index or "0"

    def printed(self, expr, read, index, real: str = "float") -> str:
        """An elementwise expression in C (``print_expression``): ``read(Read)`` spells a read,
        ``index(axis)`` the current element's index along an axis."""
        return print_expression(expr, self.sizes, self.dialect, read, index, real=real, scalars=self.scalar_types)

    # -- blocks, tiles and masks
    def emit(self, line: str = ""):
        self.lines.append(("    " * self.depth + line) if line else "")

    @contextmanager
    def block(self, opening: str):
        """A braced block: ``opening`` (the line that ends in ``{``: a loop, a test, a bare
        scope), what is emitted inside one level deeper, then ``}``. A return inside the
        ``with`` still closes the block; an exception restores the depth without closing it."""
        self.emit(opening)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        self.emit("}")

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def _grouped_axes(self) -> list[str]:
        axes = []
        for name in self.schedule.levels[1:]:
            for p in self.schedule.partitions_at(name, "group"):
                if p.axis not in axes and p.axis in self.launch.launch.axes:
                    axes.append(p.axis)
        if self.cut is not None:  # the parts: innermost, as the Program nests them
            axes.append(self.cut.axis)
        return axes

    def groups(self, axis: str) -> int:
        return -(-self.sizes[axis] // self.part_tile.get(axis, self.tile[axis]))

    def l2_sides(self) -> dict[str, int]:
        """Blocks per derived L2 group along each grouped axis (1 where there is none)."""
        sides = {}
        for p in self.schedule.partitions:
            if p.derived and p.kind == "group" and p.axis in self.grouped:
                l2_extent = int(self.schedule.extent(p.axis, p.level))  # clipped to the axis: round up
                side = max(1, min(-(-l2_extent // self.tile[p.axis]), self.groups(p.axis)))
                if self.groups(p.axis) % side == 0:  # plan.py picks such sides; anything else stays row-major
                    sides[p.axis] = side
        return sides

    def block_order(self):
        """Block index -> tile origins. Consecutive blocks fill one derived L2 group (a box of
        the block grid) before the next, the swizzled order the L2 model assumes; the sides
        divide the group counts (plan.py), so the grid has no holes."""
        sides = self.l2_sides()
        inner = math.prod(sides.values()) if sides else 1
        heavy = self.heavy_last()
        if inner > 1:
            self.emit(f"int nk_inner = nk_block % {inner}; nk_block /= {inner};  // the block within its L2 group")
        for axis in reversed(self.grouped):
            side = sides.get(axis, 1)
            outer = self.groups(axis) // side if side > 1 else self.groups(axis)
            if side > 1:
                group = f"(nk_block % {outer}) * {side} + nk_inner % {side}"
                tail = f" nk_block /= {outer}; nk_inner /= {side};"
            else:
                group, tail = f"nk_block % {outer}", f" nk_block /= {outer};"
            if axis in heavy:  # the heaviest blocks first: the last wave is the lightest
                self.emit(f"const int grp_{ident(axis)} = {self.groups(axis) - 1} - ({group});{tail}  // longest rows first")
            else:
                self.emit(f"const int grp_{ident(axis)} = {group};{tail}")
            if axis in self.part_tile:
                self.part_block(axis)
                continue
            self.emit(f"const int o_{ident(axis)} = grp_{ident(axis)} * {self.tile[axis]};")
            self.set_origin(axis, f"o_{ident(axis)}")

    def part_block(self, axis: str):
        """The part of a split axis this block streams: its number is the block's origin along
        the part axis (``x#``, one part a block), its range [origin, origin + valid) along the
        axis the stream loop walks in chunks (the last part may be ragged)."""
        size, tile = self.sizes[axis], self.part_tile[axis]
        part = self.cut.part
        self.origin[part] = f"grp_{ident(axis)}"
        self.valid[part] = "1"
        self.emit(f"const int op_{ident(axis)} = grp_{ident(axis)} * {tile};  // this block's part of {axis}")
        self.part_origin[axis] = f"op_{ident(axis)}"
        if size % tile == 0:
            self.part_valid[axis] = str(tile)
        else:
            self.emit(f"const int np_{ident(axis)} = {self.dialect.fmin}({tile}, {size} - op_{ident(axis)});")
            self.part_valid[axis] = f"np_{ident(axis)}"

    def heavy_last(self) -> set[str]:
        """Grouped axes whose later tiles visit more chunks of a masked stream: those with a
        positive coefficient in an inequality that bounds the streamed index from above (causal
        q >= x: a later q tile sees more keys). Their blocks run in reverse, longest first."""
        heavy: set[str] = set()

        def visit(nodes):
            for node in nodes:
                if isinstance(node, Loop):
                    if node.mask is not None:
                        for constraint in node.mask.constraints:
                            coefficients = dict(constraint.coefficients)
                            if coefficients.get(node.mask.axis, 0) < 0:
                                heavy.update(a for a, k in coefficients.items() if k > 0 and a in self.grouped)
                    visit(node.body)

        visit(self.launch.body)
        return heavy

    def extent_expr(self, axis: str) -> str:
        """The valid extent of an axis in the current tile (a constant when the tile divides it)."""
        return self.valid.get(axis, str(self.tile[axis]))

    def held_in_full(self, mask) -> str:
        """Declare the flag of a chunk the mask holds in full (every inequality at the tile's
        worst element: Mask.status's "full") and note the where it lets skip; the flag's name."""
        tests = []
        for constraint in mask.constraints:
            terms = [f"{k} * (long)({self.axis_end(axis, k < 0)})" for axis, k in constraint.coefficients]
            tests.append(f"({' + '.join(terms) or '0'} >= {self.threshold(constraint)})")
        flag = f"nk_full_{ident(mask.axis)}"
        self.emit(f"const int {flag} = {' && '.join(tests)};  // no element of this chunk is masked")
        where = self.mask_where(mask)
        if where is not None:
            self.unmasked[where] = flag
        return flag

    def mask_where(self, mask):
        """The where(COND, A, -inf) expression the mask tests in this loop, or None."""
        tested = self.diagram.producer(mask.tested) if mask.tested is not None else None
        if tested is None:
            return None
        return tested.box.expr if isinstance(tested.box, Map) else tested.box.operand

    def threshold(self, constraint) -> int:
        """The least integer the constraint's index terms must reach: with integer indices and
        coefficients, ``sum(k i) + constant >= 0`` is ``sum(k i) >= ceil(-constant)`` and the
        strict form ``sum(k i) >= floor(-constant) + 1``, so every mask bound is integer
        arithmetic (no conversion to floating point)."""
        try:
            constant = constant_value(constraint.constant, self.sizes) if constraint.constant.free_symbols else float(constraint.constant)
        except _Failure as failure:
            raise LoweringError(failure.message, hint=failure.hint) from None
        return math.floor(-constant) + 1 if constraint.strict else math.ceil(-constant)

    def axis_end(self, axis: str, last: bool) -> str:
        """The tile's first or last index along ``axis`` (the whole axis where it has no origin)."""
        first = self.origin.get(axis, "0")
        if not last:
            return first
        return f"({first} + {self.extent_expr(axis) if axis in self.origin else self.sizes[axis]} - 1)"

    def launch_arrays(self) -> tuple[list[str], list[str]]:
        """The arrays the kernel takes: the launch's inputs and outputs, or, for a split's parts
        or combine launch, what it loads from and saves to device memory (the part arrays)."""
        if not is_split(self.launch):
            return self.sources(self.launch.launch.inputs), list(self.launch.launch.outputs)
        top = self.schedule.levels[0]
        inputs, outputs = [], []
        for step in walk_steps(self.launch.body):
            if step.op == "load" and step.source == top and step.array not in inputs:
                inputs.append(step.array)
            if step.op == "save" and step.dest == top and step.array not in outputs:
                outputs.append(step.array)
        return self.sources(inputs), outputs

    def sources(self, names) -> list[str]:
        """``names`` with each window read's view replaced by its parameter, which the kernel
        gathers the view's tiles from (:meth:`view_element`)."""
        arrays = self.diagram.arrays
        return list(dict.fromkeys(arrays[n].window.source if n in arrays and arrays[n].window is not None else n
                                  for n in names))

    def view_element(self, name: str, index_of=None) -> tuple[list[str], str, str]:
        """Where the current element (i_<axis> from the tile's origin; ``index_of(axis)`` where
        given) of window read ``name`` is in its parameter: (lines computing its index along each
        of the parameter's axes, the condition that it lies inside the parameter, "" for an
        unpadded window, which the binding holds inside; its flat index)."""
        window = self.diagram.arrays[name].window
        source = self.diagram.arrays[window.source]
        index_of = index_of or self.index
        lines, inside, flat = [], [], ""
        for axis, index in zip(source.axes, window.indices, strict=True):
            terms = [f"{window_value(c, self.sizes)} * ({index_of(a)})" for a, c in index.terms]
            offset = window_value(index.offset, self.sizes)
            at = self.fresh("w")
            lines.append(f"const int {at} = {' + '.join(terms + ([str(offset)] if offset or not terms else []))};")
            low, high = index_bounds(index, self.sizes)
            if window.pad is not None and (low < 0 or high >= self.sizes[axis]):  # else it never leaves
                inside.append(f"{at} >= 0 && {at} < {self.sizes[axis]}")
            flat = at if not flat else f"({flat}) * {self.sizes[axis]} + {at}"
        return lines, " && ".join(inside), flat or "0"

    def set_origin(self, axis: str, origin: str):
        self.origin[axis] = origin
        if self.sizes[axis] % self.tile[axis] == 0:
            self.valid[axis] = str(self.tile[axis])
        else:
            self.emit(f"const int n_{ident(axis)} = {self.dialect.fmin}({self.tile[axis]}, {self.sizes[axis]} - {origin});")
            self.valid[axis] = f"n_{ident(axis)}"

    def visited_chunks(self, mask, chunks: int) -> tuple[str, str]:
        """The first and past-the-last chunk of the streamed axis this block visits, as the
        Program says (Mask.status): each inequality bounds the chunk index from one side at the
        block's best element (its tile's last index along an axis with a positive coefficient,
        its first along a negative one). The bounds are the block's alone, so every thread runs
        the same trips and reaches the same barriers (a test around the loop's body instead
        miscompiles on PoCL: barriers inside a condition inside a loop)."""
        x = mask.axis
        tile, size = self.tile[x], self.sizes[x]
        self.emit(f"int nk_first_{ident(x)} = 0, nk_stop_{ident(x)} = {chunks};  // masked by {mask.condition}")
        for constraint in mask.constraints:
            coefficients = dict(constraint.coefficients)
            a_x = coefficients.pop(x, 0)
            # the other axes' best: the inequality reads a_x * x + best >= t, all integers
            best = " + ".join(f"{k} * (long)({self.axis_end(axis, k > 0)})" for axis, k in coefficients.items()) or "0"
            t = self.threshold(constraint)
            if a_x == 0:  # the block's rows alone decide: all chunks or none
                self.emit(f"if ({best} < {t}) nk_stop_{ident(x)} = 0;")
                continue
            if a_x > 0:
                # the chunk's last index reaches x >= ceil((t - best) / a_x)
                self.emit(f"{{ const long nk_least = {ceil_div(f'{t} - ({best})', a_x)};")
                self.emit(f"  if (nk_least > {size - 1}) nk_stop_{ident(x)} = 0;")
                # chunk c ends at c * tile + tile - 1 >= nk_least from c = floor(nk_least / tile) on
                self.emit(f"  else if (nk_least > 0) nk_first_{ident(x)} = max(nk_first_{ident(x)}, (int)(nk_least / {tile})); }}")
            else:
                # the chunk's first index stays within x <= floor((best - t) / -a_x)
                most = floor_div(f"({best}) - {t}", -a_x)
                self.emit(f"{{ const long nk_most = {most};")
                self.emit(f"  if (nk_most < 0) nk_stop_{ident(x)} = 0;")
                self.emit(f"  else nk_stop_{ident(x)} = min(nk_stop_{ident(x)}, (int)(nk_most / {tile}) + 1); }}")
        return f"nk_first_{ident(x)}", f"nk_stop_{ident(x)}"

    def full_chunks(self, mask, first: str, stop: str) -> tuple[str, str]:
        """The chunks of [first, stop) the mask holds in full, [lo, hi), in integers: each
        inequality at the chunk's worst element (its first index along x for a positive
        coefficient, the chunk's last, counted as a whole tile, for a negative one; the other
        axes' worst ends as in held_in_full) bounds the chunk index from one side. A chunk left
        out is run masked, which is always right: the bounds only decide which body runs."""
        x = ident(mask.axis)
        tile = self.tile[mask.axis]
        lo, hi = f"nk_flo_{x}", f"nk_fhi_{x}"
        self.emit(f"int {lo} = {first}, {hi} = {stop};  // the chunks no element of which is masked")
        for constraint in mask.constraints:
            coefficients = dict(constraint.coefficients)
            a_x = coefficients.pop(mask.axis, 0)
            worst = " + ".join(f"{k} * (long)({self.axis_end(axis, k < 0)})" for axis, k in coefficients.items()) or "0"
            t = self.threshold(constraint)
            if a_x == 0:
                self.emit(f"if ({worst} < {t}) {hi} = {lo};")
            elif a_x > 0:  # a_x * c * tile + worst >= t
                self.emit(f"{lo} = max({lo}, (int)({ceil_div(f'{t} - ({worst})', a_x * tile)}));")
            else:  # -a_x * (c * tile + tile - 1) <= worst - t
                last = floor_div(f"({worst}) - {t}", -a_x)
                self.emit(f"{hi} = min({hi}, (int)({floor_div(f'{last} - {tile - 1}', tile)}) + 1);")
        self.emit(f"{lo} = min({lo}, {stop}); {hi} = max({lo}, min({hi}, {stop}));")
        return lo, hi


class Printer(KernelWriter):
    """The FMA printer: one launch as per-thread loops over the shared-memory arena
    (``plan_arena``), with streamed contractions' running sums in registers
    (``isel.fma_accumulators``) and row reductions a warp (CUDA) or a work-item (OpenCL) a row."""

    def __init__(self, program: Program, launch, dialect: Dialect, threads: int = THREADS,
                 accumulators: dict | None = None):
        super().__init__(program, launch, dialect, threads)
        # Streamed contractions' running sums this thread keeps in registers from init to
        # finalise (isel.fma_accumulators): name -> FmaAccumulator; the rest are in the arena.
        self.accumulators: dict[str, FmaAccumulator] = dict(accumulators or {})
        self.slots, self.arena = plan_arena(program, launch, set(self.accumulators))
        # Staged results wait in a per-thread array; indexed by the trip numbers of the loops
        # that fill it (compile-time after unrolling), it stays in registers, not local memory.
        self.trip_vars: list = []  # (variable, trips) of enclosing loops; None where not counted
        self.stage_depth: int | None = None
        self.stage_values = 0  # the size of the stage being filled or written (staged)
        # The C type the current step computes in (real_type): double where the Program says f64.
        self.real = "float"
    # -- helpers
    def buffer_index(self, name: str, axes) -> str:
        slot = self.slots[name]
        index = ""
        for axis in slot.axes:
            term = f"i_{ident(axis)}" if axis in axes else "0"
            index = term if not index else f"({index}) * {self.tile[axis]} + {term}"
        return index or "0"

    def global_index(self, array: str) -> str:
        """The device-memory index of the current element (i_<axis> of every axis) of ``array``."""
        return self.global_offset(array, {axis: f"i_{ident(axis)}" for axis in self.globals[array][0]}, self.origin)

    def ptr(self, name: str) -> str:
        return f"s_{ident(name)}"

    def read(self, name: str, axes) -> str:
        slot = self.slots[name]
        return self.dialect.load(self.ptr(name), self.buffer_index(name, axes), slot.dtype, self.real)

    def write(self, name: str, axes, value: str) -> str:
        slot = self.slots[name]
        return self.dialect.store(self.ptr(name), self.buffer_index(name, axes), value, slot.dtype, self.real)

    def expression(self, expr, axes) -> str:
        def printed(e):
            return self.printed(e, lambda r: self.read(r.array, axes), self.index, self.real)

        if expr in self.unmasked:  # a chunk held in full skips the test
            return f"({self.unmasked[expr]} ? ({printed(expr.args[1])}) : ({printed(expr)}))"
        return printed(expr)

    def index(self, axis: str) -> str:
        """The whole array's index of the current element along ``axis``: the tile's origin
        plus the element's place in the tile (the same sum global_index uses)."""
        i = f"i_{ident(axis)}"
        return f"{self.origin[axis]} + {i}" if axis in self.origin else i

    def flat_loop(self, axes, body):
        """for each valid element of the tile over `axes`, spread over the block: body()."""
        self.strided_loop(axes, "nk_tid", "NK_THREADS", "t", body)

    def decompose(self, variable: str, axes):
        rest = self.fresh("r")
        self.emit(f"int {rest} = {variable};")
        for axis in reversed(axes):
            self.emit(f"const int i_{ident(axis)} = {rest} % ({self.extent_expr(axis)}); {rest} /= ({self.extent_expr(axis)});")
        self.emit(f"(void){rest};")

    # -- the kernel
    def print(self, entry: str) -> KernelSource:
        d = self.dialect
        arrays, scalars = self.kernel_arrays()
        for s in self.launch.launch.statements:
            if isinstance(s.box, Opaque):
                raise LoweringError(f"box {s.box.box.name} is opaque: it has no body to compile", s.span,
                                    "opaque boxes are for the cost model; run them with the NumPy backend and impls=")
        self.open_kernel(entry, arrays, scalars)
        self.emit(d.arena(ALIGN))
        self.emit(f"const int nk_tid = {d.thread_id};")
        self.emit(f"int nk_block = {d.block_id};")
        self.block_order()
        self.emit("(void)nk_block;")
        for slot in sorted(self.slots.values(), key=lambda s: s.offset):
            t = d.storage[slot.dtype]
            self.emit(f"{d.local_ptr.format(t=t)} {self.ptr(slot.name)} = {d.arena_pointer(t, slot.offset)};")
        for acc in self.accumulators.values():
            # Every index into it is a constant once the loops over it are unrolled: registers.
            self.emit(f"{'double' if acc.dtype == 'f64' else 'float'} {self.register(acc.name)}[{acc.values}];  "
                      f"// {acc.name}: {acc.blocks} block(s) of {acc.rm} {acc.am} x {acc.rn} {acc.an} a thread, across the stream loop")
        self.nodes(self.launch.body)
        return self.close_kernel(entry, arrays, scalars)
    def nodes(self, nodes):
        for node in nodes:
            if isinstance(node, Loop):
                if node.kind == "group":
                    self.nodes(node.body)  # the block index already selected this group
                    continue
                # the relabel checker puts every stream on the compute level's line
                assert node.level == self.level, f"napkin bug: a stream partition at {node.level}, not {self.level}"
                if node.axis in self.part_origin:
                    self.part_stream(node)
                    continue
                chunks = -(-self.sizes[node.axis] // self.tile[node.axis])
                first, stop = "0", str(chunks)
                if node.mask is not None:
                    first, stop = self.visited_chunks(node.mask, chunks)
                with self.block(f"for (int c_{ident(node.axis)} = {first}; c_{ident(node.axis)} < {stop}; ++c_{ident(node.axis)}) {{"):
                    self.emit(f"const int o_{ident(node.axis)} = c_{ident(node.axis)} * {self.tile[node.axis]};")
                    saved_valid = dict(self.valid)
                    self.set_origin(node.axis, f"o_{ident(node.axis)}")
                    if node.mask is not None:
                        self.held_in_full(node.mask)
                    self.nodes(node.body)
                    self.unmasked = {}
                    self.valid = saved_valid
                    del self.origin[node.axis]
                continue
            self.step(node)

    def part_stream(self, node: Loop):
        """A split's stream loop: the chunks of this block's part (part_block), from the part's
        origin; a chunk ends at the part's end (the Program's ranges: a part that the chunk size
        does not divide ends in a short chunk, as does the last part of a ragged axis). The trip
        count is the block's own, so every thread reaches the same barriers."""
        axis, tile = node.axis, self.tile[node.axis]
        x = ident(axis)
        origin, valid = self.part_origin[axis], self.part_valid[axis]
        exact = valid == str(self.part_tile[axis]) and self.part_tile[axis] % tile == 0
        stop = str(self.part_tile[axis] // tile) if exact else f"(({valid}) + {tile - 1}) / {tile}"
        with self.block(f"for (int c_{x} = 0; c_{x} < {stop}; ++c_{x}) {{"):
            self.emit(f"const int o_{x} = {origin} + c_{x} * {tile};")
            saved_valid = dict(self.valid)
            self.origin[axis] = f"o_{x}"
            if exact:
                self.valid[axis] = str(tile)
            else:
                self.emit(f"const int n_{x} = {self.dialect.fmin}({tile}, {origin} + ({valid}) - o_{x});")
                self.valid[axis] = f"n_{x}"
            self.nodes(node.body)
            self.valid = saved_valid
            del self.origin[axis]

    # -- steps
    def step(self, step: Step):
        if step.level != self.level:
            return  # transfers into or out of L2, allocations there: the cache's business
        self.real = self.real_type(step)
        self.emit(f"// {step.text}")
        with self.block("{"):
            getattr(self, f"step_{step.op}")(step)
        self.emit(self.dialect.barrier)

    def step_alloc(self, step: Step):
        """An output's tile at a level: the Program allocates only above the compute level (the
        cache's business, skipped in `step`); at the compute level the arena already holds it."""

    def real_type(self, step: Step) -> str:
        """double where the Program computes the step in f64 (pseudocode.compute_dtype: an f64
        operand) or a transfer moves f64 values in or out, float otherwise."""
        if step.op in ("load", "save"):
            held = self.slots.get(step.array)
            dtypes = {step.dtype, held.dtype if held is not None else step.dtype}
        else:
            dtypes = {step.dtype}
        return "double" if "f64" in dtypes else "float"

    @property
    def zero(self) -> str:
        return literal(0.0, self.real)

    def step_load(self, step: Step):
        name = step.array
        axes, dtype = self.globals[name]
        d = self.dialect
        window = self.diagram.arrays[name].window if name in self.diagram.arrays else None
        if window is not None and dtype in FP8_C and window.pad not in (None, 0.0):
            raise NotImplementedError(f"a padded window read of an 8-bit array pads with {window.pad:g}; the kernels "
                                      f"copy fp8 bytes as they are, and only 0 is a byte they can write")
        vector = 16 // DTYPE_BYTES[dtype]
        last = axes[-1] if axes else None
        can_vector = (
            window is None and last is not None and d.vector_copy("a", "b") is not None
            and self.tile[last] % vector == 0 and self.sizes[last] % vector == 0 and self.sizes[last] % self.tile[last] == 0
            and all(self.slots[name].size % 16 == 0 for _ in [0]) and self.slots[name].offset % 16 == 0
        )
        if can_vector:
            # 16-byte copies along the last axis; rows past the end of another axis are zeroed.
            outer = axes[:-1]
            count = " * ".join([f"{self.tile[a]}" for a in outer] + [f"{self.tile[last] // vector}"])
            t = self.fresh("t")
            with self.block(f"for (int {t} = nk_tid; {t} < {count}; {t} += NK_THREADS) {{"):
                rest = self.fresh("r")
                self.emit(f"int {rest} = {t};")
                self.emit(f"const int i_{ident(last)} = ({rest} % {self.tile[last] // vector}) * {vector}; {rest} /= {self.tile[last] // vector};")
                for axis in reversed(outer):
                    self.emit(f"const int i_{ident(axis)} = {rest} % {self.tile[axis]}; {rest} /= {self.tile[axis]};")
                valid = " && ".join(f"i_{ident(a)} < {self.extent_expr(a)}" for a in outer if self.extent_expr(a) != str(self.tile[a])) or "true"
                dst = f"{self.ptr(name)}[{self.buffer_index(name, axes)}]"
                src = f"g_{ident(name)}[{self.global_index(name)}]"
                self.emit(f"if ({valid}) {{ {d.vector_copy(dst, src)} }} else {{ {d.vector_zero(dst)} }}")
            return
        # Scalar path: every element of the tile, zero past the end of the axis. A window read's
        # view is gathered from its source (view_element), the window's pad value outside it.
        t = self.fresh("t")
        count = " * ".join(str(self.tile[a]) for a in axes) or "1"
        with self.block(f"for (int {t} = nk_tid; {t} < {count}; {t} += NK_THREADS) {{"):
            rest = self.fresh("r")
            self.emit(f"int {rest} = {t};")
            for axis in reversed(axes):
                self.emit(f"const int i_{ident(axis)} = {rest} % {self.tile[axis]}; {rest} /= {self.tile[axis]};")
            valid = " && ".join(f"i_{ident(a)} < {self.extent_expr(a)}" for a in axes if self.extent_expr(a) != str(self.tile[a])) or "true"
            source, at, inside = f"g_{ident(name)}", self.global_index(name), ""
            if window is not None:
                lines, inside, at = self.view_element(name)
                for line in lines:
                    self.emit(line)
                source = f"g_{ident(window.source)}"
            if dtype in FP8_C and self.slots[name].dtype == dtype:
                # fp8 bytes are copied as they are: a decode and a saturating encode would turn an
                # e5m2 infinity into the largest finite value before the kernel reads it.
                self.emit(f"{self.ptr(name)}[{self.buffer_index(name, axes)}] = ({valid}{' && ' + inside if inside else ''}) ? "
                          f"{source}[{at}] : 0;")
                return
            value = d.load(source, at, dtype, self.real)
            if window is None:
                self.emit(f"const {self.real} v = ({valid}) ? {value} : {self.zero};")
            else:
                pad = literal(window.pad, self.real) if window.pad is not None else self.zero
                read = f"({inside}) ? {value} : {pad}" if inside else value
                self.emit(f"const {self.real} v = ({valid}) ? ({read}) : {self.zero};")
            self.emit(self.write(name, axes, "v"))

    def step_save(self, step: Step):
        name = step.array
        axes, dtype = self.globals[name]
        held = step.reads[0][1]  # a split's part saves a state (O.acc) as its part array (O.acc.part)
        d = self.dialect
        def store(value: str) -> str:
            if step.add:  # a group's partial sum (relabel.summed_over_groups), into the output the launcher zeroed
                return d.atomic_add(f"g_{ident(name)}", self.global_index(name), value)
            return d.store(f"g_{ident(name)}", self.global_index(name), value, dtype, self.real)

        if held in self.accumulators:  # straight from this thread's registers, one part long
            acc = self.accumulators[held]
            for axis in axes:
                if axis not in step.statement.axes:
                    self.emit(f"const int i_{ident(axis)} = 0;")
            self.owned_outputs(acc, step.statement.axes, lambda r: self.emit(store(r)))
            return
        self.flat_loop(axes, lambda: self.emit(store(self.read(held, axes))))

    def step_init(self, step: Step):
        s = step.statement
        for _, name in step.writes:
            start = state_start(name, s, self.real)
            if name in self.accumulators:
                acc = self.accumulators[name]
                if self.dialect.unroll:
                    self.emit(self.dialect.unroll)
                self.emit(f"for (int e = 0; e < {acc.values}; ++e) {self.register(name)}[e] = {start};")
                continue
            axes = self.slots[name].axes
            self.flat_loop(axes, lambda name=name, axes=axes, start=start: self.emit(self.write(name, axes, start)))

    def step_compute(self, step: Step):
        s = step.statement
        box = s.box
        target = s.target
        if isinstance(box, Contract):
            if (step.level, target) in step.reads:  # the scalar factor, in place
                scale = self.expression(box.scale, s.axes)
                self.flat_loop(s.axes, lambda: self.emit(self.write(target, s.axes, f"{self.read(target, s.axes)} * {scale}")))
                return
            self.contraction(step, target, accumulate=False)
            return
        if isinstance(box, Map):
            self.elementwise(step, target, s.axes, lambda: self.expression(box.expr, s.axes))
            return
        if isinstance(box, Reduce):
            if not self.hazard(step, target):
                self.row_reduction(s.axes, box.axes, box.op, box.operand,
                                   lambda total: self.emit(self.write(target, s.axes, self.mean(total, box))))
                return
            # Rows are read by every warp while others write: results wait in registers.
            self.staged(self.per_thread_rows(s.axes, ()),
                        lambda: self.row_reduction(s.axes, box.axes, box.op, box.operand,
                                                   lambda total: self.emit(f"stage[{self.stage_index()}] = {self.mean(total, box)};")),
                        lambda write: self.row_loop(s.axes, write), target, s.axes)
            return
        if isinstance(box, Softmax):
            self.softmax(s, box, staged=self.hazard(step, target))
            return
        if isinstance(box, Scan):
            self.scan(step, s, box)
            return
        raise AssertionError(f"napkin bug: the FMA printer has no step for box {box!r}")

    def scan(self, step: Step, s, box: Scan):
        """Y = cumsum[axis](operand) (or cumprod), unstreamed: a row to a thread, which walks the
        row in order, folding each value into its running one and writing it. A thread reads an
        element before it writes the target's, and only its own row's: in place is safe where
        the target shares the operand's slot element for element (hazard says when not)."""
        if self.hazard(step, s.target):
            raise LoweringError(f"{s.target} = {box.name}[{box.axis}](...) shares shared memory with an operand it is still "
                                f"reading", hint="napkin bug: the arena placed a scan's target over its operand")
        start, fn = SCAN_FOLDS[box.op]
        axis = box.axis
        rows = tuple(s.woven)
        all_axes = rows + (axis,)
        carry = f"{s.target}.carry"
        streamed = (step.level, carry) in step.reads  # a chunk of a stream: start from the carry, leave it

        def row():
            self.emit(f"{self.real} run = {self.read(carry, rows) if streamed else literal(start, self.real)};")
            with self.block(f"for (int i_{ident(axis)} = 0; i_{ident(axis)} < {self.extent_expr(axis)}; ++i_{ident(axis)}) {{"):
                self.emit(self.fold("run", fn, self.expression(box.operand, all_axes)))
                self.emit(self.write(s.target, all_axes, "run"))
            if streamed:
                self.emit(self.write(carry, rows, "run"))

        self.flat_loop(rows, row)

    def hazard(self, step: Step, out: str) -> bool:
        """Does `out` share bytes with an input of the step other than in place, element for element?"""
        out_slot = self.slots[out]
        return any(
            ref[1] != out and ref[1] in self.slots and _overlaps(self.slots[ref[1]], out_slot)
            and not (self.slots[ref[1]].offset == out_slot.offset and self.slots[ref[1]].axes == out_slot.axes
                     and self.slots[ref[1]].dtype == out_slot.dtype)
            for ref in step.reads
        )

    def per_thread(self, axes) -> int:
        return -(-math.prod(self.tile[a] for a in axes) // self.threads)

    def per_thread_rows(self, rows, reduced) -> int:
        """Stage slots a thread needs when rows go to groups of `lanes` threads and lanes stride a row."""
        lanes = self.dialect.lanes
        row_groups = self.threads // lanes
        per_row = -(-math.prod(self.tile[a] for a in reduced) // lanes)
        return -(-math.prod(self.tile[a] for a in rows) // row_groups) * per_row

    def elementwise(self, step: Step, out: str, axes, value):
        """out[i] = value() over the tile, through registers when out overlaps an input elsewhere."""
        if not self.hazard(step, out):
            self.flat_loop(axes, lambda: self.emit(self.write(out, axes, value())))
            return
        self.staged(self.per_thread(axes), lambda: self.flat_loop(axes, lambda: self.emit(f"stage[{self.stage_index()}] = {value()};")),
                    lambda write: self.flat_loop(axes, write), out, axes)

    def staged(self, size: int, fill, each, out: str, axes):
        """A result that waits in registers until every thread has read the inputs whose bytes it
        takes (Printer.hazard), the one shape every such step prints: fill() computes this
        thread's values into a per-thread ``stage[size]`` at ``stage[self.stage_index()]``, a
        barrier, then ``out[axes] = stage[...]`` in the loop nest ``each(write)``, which visits the
        thread's elements in fill's order. Both run under `staging`: the index is the loops'
        trip numbers (registers once unrolled) where they are counted, else a running count
        ``k`` that restarts for the write."""
        self.emit(f"{self.real} stage[{size}];")
        self.emit("int k = 0;")
        self.stage_values = size
        self.staging(fill)
        self.emit(self.dialect.barrier)
        self.emit("k = 0;")
        self.staging(lambda: each(lambda: self.emit(self.write(out, axes, f"stage[{self.stage_index()}]"))))
        self.stage_values = 0
        self.emit("(void)k;")

    def mean(self, total: str, box: Reduce) -> str:
        if not reduction(box.op).divides:
            return total
        count = math.prod(self.sizes[a] for a in box.axes)
        return f"({total}) / {literal(float(count), self.real)}"

    def contraction(self, step: Step, target: str, accumulate: bool):
        """A contraction on per-thread register tiles: each thread owns a REGISTER_TILE x
        REGISTER_TILE block of outputs (along an axis only the first operand has and one only the
        second has), so every operand value read from shared memory feeds several products."""
        s = step.statement
        box = s.box
        name = f"{target}.acc" if accumulate else target
        if accumulate and name in self.accumulators:
            self.register_contraction(s, box, self.accumulators[name])
            return
        staged = not accumulate and self.hazard(step, name)
        tile_axes = self.register_tile_axes(box, s.axes)
        if tile_axes is None:
            self.scalar_contraction(s, box, name, accumulate, staged)
            return
        am, an = tile_axes
        rm, rn = (min(REGISTER_TILE, self.tile[am]), min(REGISTER_TILE, self.tile[an]))

        def blocked(body):
            # The tile's extents along am and an counted in register blocks.
            saved = dict(self.valid)
            blocks = {am: f"(({self.extent_expr(am)}) + {rm - 1}) / {rm}", an: f"(({self.extent_expr(an)}) + {rn - 1}) / {rn}"}
            count = " * ".join(f"({blocks.get(a, self.extent_expr(a))})" for a in s.axes)
            t = self.fresh("t")
            with self.block(f"for (int {t} = nk_tid; {t} < {count}; {t} += NK_THREADS) {{"):
                rest = self.fresh("r")
                self.emit(f"int {rest} = {t};")
                for axis in reversed(s.axes):
                    extent = blocks.get(axis, self.extent_expr(axis))
                    variable = f"b_{ident(axis)}" if axis in blocks else f"i_{ident(axis)}"
                    self.emit(f"const int {variable} = {rest} % ({extent}); {rest} /= ({extent});")
                self.emit(f"(void){rest};")
                self.trip_vars.append(None)  # trips not counted: a staged value waits at a running count
                body()
                self.trip_vars.pop()
            self.valid = saved

        def compute(store):
            self.emit(f"{self.real} acc[{rm}][{rn}];")
            self.emit(f"for (int u = 0; u < {rm}; ++u) for (int v = 0; v < {rn}; ++v) acc[u][v] = {self.zero};")
            self.block_products(s, box, am, an, rm, rn, "acc[u][v]")
            self.each_output(am, an, rm, rn, store)

        if not staged:
            if accumulate:
                blocked(lambda: compute(lambda: self.emit(self.write(name, s.axes, f"{self.read(name, s.axes)} + acc[u][v]"))))
            else:
                blocked(lambda: compute(lambda: self.emit(self.write(name, s.axes, "acc[u][v]"))))
            return
        # The result reuses the bytes of an input released by this step: keep it in registers
        # until every thread has finished reading, then write it in the same order.
        per_thread = -(-math.prod(self.tile[a] for a in s.axes if a not in (am, an)) * -(-self.tile[am] // rm)
                       * -(-self.tile[an] // rn) // self.threads) * rm * rn
        self.staged(per_thread, lambda: blocked(lambda: compute(lambda: self.emit(f"stage[{self.stage_index()}] = acc[u][v];"))),
                    lambda write: blocked(lambda: self.each_output(am, an, rm, rn, write)), name, s.axes)

    def each_output(self, am, an, rm, rn, store):
        """for each (u, v) of a register block whose output lies inside the valid tile: store()."""
        with self.block(f"for (int u = 0; u < {rm}; ++u) for (int v = 0; v < {rn}; ++v) {{"):
            self.emit(f"const int i_{ident(am)} = {self.interleaved(am, rm, 'u')};")
            self.emit(f"const int i_{ident(an)} = {self.interleaved(an, rn, 'v')};")
            with self.block(f"if (i_{ident(am)} < {self.extent_expr(am)} && i_{ident(an)} < {self.extent_expr(an)}) {{"):
                store()

    def interleaved(self, axis: str, per: int, k: str) -> str:
        """Element `k` of a thread's register block along `axis`: blocks interleave (block b owns
        b, b + blocks, ...), so consecutive threads touch consecutive elements: shared-memory
        reads of the other operand fall in distinct banks and output stores coalesce."""
        if per == 1:
            return f"b_{ident(axis)}"
        return f"b_{ident(axis)} + {k} * ((({self.extent_expr(axis)}) + {per - 1}) / {per})"

    def register_tile_axes(self, box: Contract, target_axes):
        return register_tile_axes(box, target_axes, self.tile)

    # -- accumulators in registers (the FMA path)
    def register(self, name: str) -> str:
        return f"r_{ident(name)}"

    def owned_blocks(self, acc: FmaAccumulator, axes, body):
        """for each register block of the tile this thread owns: body(j), j its number among the
        thread's blocks. Blocks are dealt to threads in turn (thread t owns t, t + NK_THREADS,
        ...), as in the unregistered product; the loop has a constant trip count and is unrolled,
        so every register index is a compile-time constant."""
        blocks = {acc.am: f"(({self.extent_expr(acc.am)}) + {acc.rm - 1}) / {acc.rm}",
                  acc.an: f"(({self.extent_expr(acc.an)}) + {acc.rn - 1}) / {acc.rn}"}
        count = " * ".join(f"({blocks.get(a, self.extent_expr(a))})" for a in axes)
        j, t = self.fresh("j"), self.fresh("t")
        if self.dialect.unroll:
            self.emit(self.dialect.unroll)
        with self.block(f"for (int {j} = 0; {j} < {acc.blocks}; ++{j}) {{"):
            self.emit(f"const int {t} = nk_tid + {j} * NK_THREADS;")
            self.emit(f"if ({t} >= {count}) break;")
            rest = self.fresh("r")
            self.emit(f"int {rest} = {t};")
            for axis in reversed(axes):
                extent = blocks.get(axis, self.extent_expr(axis))
                variable = f"b_{ident(axis)}" if axis in blocks else f"i_{ident(axis)}"
                self.emit(f"const int {variable} = {rest} % ({extent}); {rest} /= ({extent});")
            self.emit(f"(void){rest};")
            body(j)

    def owned_outputs(self, acc: FmaAccumulator, axes, body):
        """for each valid output this thread accumulates: body(register), the register's spelling."""
        self.owned_blocks(acc, axes, lambda j: self.each_output(
            acc.am, acc.an, acc.rm, acc.rn, lambda: body(f"{self.register(acc.name)}[({j} * {acc.rm} + u) * {acc.rn} + v]")))

    def register_contraction(self, s, box: Contract, acc: FmaAccumulator):
        """X.acc += A * B with X.acc in this thread's registers: the products of every chunk go
        straight into the running sums, which never touch shared memory until finalise."""
        am, an, rm, rn = acc.am, acc.an, acc.rm, acc.rn
        r = self.register(acc.name)
        self.owned_blocks(acc, s.axes, lambda j: self.block_products(s, box, am, an, rm, rn, f"{r}[({j} * {rm} + u) * {rn} + v]"))

    def block_products(self, s, box: Contract, am: str, an: str, rm: int, rn: int, sum_uv: str):
        """The products of one rm x rn register block over the contracted axes, added into
        ``sum_uv`` (spelled with u and v): each operand value is read from shared memory once per
        block (a[u] along am, b[v] along an), zero past the tile's valid extent."""
        first, second = box.operands
        with self.contracted_loops(box):
            self.emit(f"{self.real} a[{rm}], b[{rn}];")
            self.emit(f"for (int u = 0; u < {rm}; ++u) {{")
            self.emit(f"    const int i_{ident(am)} = {self.interleaved(am, rm, 'u')};")
            self.emit(f"    a[u] = (i_{ident(am)} < {self.extent_expr(am)}) ? {self.read(first.array, s.iteration_axes)} : {self.zero};")
            self.emit("}")
            self.emit(f"for (int v = 0; v < {rn}; ++v) {{")
            self.emit(f"    const int i_{ident(an)} = {self.interleaved(an, rn, 'v')};")
            self.emit(f"    b[v] = (i_{ident(an)} < {self.extent_expr(an)}) ? {self.read(second.array, s.iteration_axes)} : {self.zero};")
            self.emit("}")
            self.emit(f"for (int u = 0; u < {rm}; ++u) for (int v = 0; v < {rn}; ++v) {sum_uv} += a[u] * b[v];")

    @contextmanager
    def contracted_loops(self, box: Contract):
        """One loop per contracted axis of ``box`` (i_axis over its valid extent), nested in the
        box's order; what is emitted inside the ``with`` is the innermost body."""
        with ExitStack() as loops:
            for axis in box.contracted:
                loops.enter_context(self.block(f"for (int i_{ident(axis)} = 0; i_{ident(axis)} < {self.extent_expr(axis)}; ++i_{ident(axis)}) {{"))
            yield

    def finalise_registers(self, step: Step, acc: FmaAccumulator, value):
        """X = value(X.acc) from this thread's registers into X's tile. Where X takes the bytes
        of another input of the step (a denominator released here), every thread computes into
        its registers first and writes after a barrier."""
        s = step.statement
        target = s.target
        if not self.hazard(step, target):
            self.owned_outputs(acc, s.axes, lambda r: self.emit(self.write(target, s.axes, value(r))))
            return
        self.owned_outputs(acc, s.axes, lambda r: self.emit(f"{r} = {value(r)};"))
        self.emit(self.dialect.barrier)
        self.owned_outputs(acc, s.axes, lambda r: self.emit(self.write(target, s.axes, r)))

    def scalar_contraction(self, s, box, name, accumulate, staged):
        def product():
            return " * ".join(self.read(r.array, s.iteration_axes) for r in box.operands)

        def body(store):
            self.emit(f"{self.real} acc = {self.zero};")
            with self.contracted_loops(box):
                self.emit(f"acc += {product()};")
            store()

        if not staged:
            if accumulate:
                self.flat_loop(s.axes, lambda: body(lambda: self.emit(self.write(name, s.axes, f"{self.read(name, s.axes)} + acc"))))
            else:
                self.flat_loop(s.axes, lambda: body(lambda: self.emit(self.write(name, s.axes, "acc"))))
            return
        self.staged(self.per_thread(s.axes), lambda: self.flat_loop(s.axes, lambda: body(lambda: self.emit(f"stage[{self.stage_index()}] = acc;"))),
                    lambda write: self.flat_loop(s.axes, write), name, s.axes)

    def strided_loop(self, axes, start: str, step: str, prefix: str, body):
        """for each valid element over `axes` from `start` in strides of `step`: body().

        Inside a staged region the loop counts its trips (a bound known at print time) so that
        the stage index is a constant once the loop is unrolled."""
        count = " * ".join(f"({self.extent_expr(a)})" for a in axes) or "1"
        variable = self.fresh(prefix)
        trips = self.trips(axes, step)
        counted = self.stage_depth is not None and trips is not None
        if counted:
            trip = self.fresh("j")
            self.emit(self.dialect.unroll)
            opening = f"for (int {trip} = 0; {trip} < {trips}; ++{trip}) {{"
        else:
            opening = f"for (int {variable} = {start}; {variable} < {count}; {variable} += {step}) {{"
        with self.block(opening):
            if counted:
                self.emit(f"const int {variable} = {start} + {trip} * {step};")
                self.emit(f"if ({variable} >= {count}) break;")
                self.trip_vars.append((trip, trips))
            else:
                self.trip_vars.append(None)
            self.decompose(variable, axes)
            body()
            self.trip_vars.pop()

    MAX_UNROLLED_TRIPS = 64
    # A staged result waits in registers only where its index is a constant: every loop of the
    # stage counted and unrolled. Every kernel is launch_bounds(threads, 1), so a thread may hold
    # 255 registers; a stage of up to 128 values leaves room for the rest (rmsnorm's 8 x 4096 f32
    # tile over 256 threads: 141 registers and no local memory, where a running index had put
    # its 128 values in local memory).
    MAX_STAGED_VALUES = 128

    def trips(self, axes, step: str) -> int | None:
        """The most trips a strided loop over the tile of `axes` makes, when small and known."""
        steps = {"NK_THREADS": self.threads, "(NK_THREADS / 32)": self.threads // 32, "32": 32, "1": 1}
        if step not in steps:
            return None
        trips = -(-math.prod(self.tile[a] for a in axes) // steps[step])
        staged = self.stage_depth is not None and self.stage_values <= self.MAX_STAGED_VALUES
        return trips if trips <= (self.MAX_STAGED_VALUES if staged else self.MAX_UNROLLED_TRIPS) else None

    def stage_index(self) -> str:
        """Where the current element waits in `stage`: its loops' trip numbers, row-major, or
        a running count when a loop's trips are not counted."""
        loops = self.trip_vars[self.stage_depth:]
        if any(loop is None for loop in loops):
            return "k++"
        index = ""
        for variable, trips in loops:
            index = variable if not index else f"({index}) * {trips} + {variable}"
        return index or "0"

    def stage_slot(self) -> str:
        """The current element's place in `stage`, to spell more than once: a running count is
        taken once."""
        index = self.stage_index()
        if index != "k++":
            return index
        self.emit("const int ks = k++;")
        return "ks"

    def stage_counted(self, axes, step: str) -> bool:
        """Whether a strided loop over `axes` by `step` nested here indexes `stage` by trip
        numbers (strided_loop counts its trips) rather than by a running count."""
        return all(loop is not None for loop in self.trip_vars[self.stage_depth:]) and self.trips(axes, step) is not None

    def staging(self, fill):
        """Run fill() with trip-indexed loops: the stage index is read off the loop nest."""
        saved = self.stage_depth
        self.stage_depth = len(self.trip_vars)
        fill()
        self.stage_depth = saved

    def row_loop(self, rows, body):
        """Rows to groups of `lanes` threads (a warp in CUDA, one work-item in OpenCL)."""
        self.strided_loop(rows, self.dialect.row_start, self.dialect.rows_per_pass, "row", body)

    def lane_loop(self, axes, body):
        """The elements of one row, strided over the lanes sharing it."""
        self.strided_loop(axes, self.dialect.lane_start, self.dialect.lane_step, "e", body)

    def row_reduction(self, rows, reduced, op, operand, finish):
        """Reduce `operand` over `reduced` for every row as the table of reductions defines
        ``op`` (boxes.REDUCTION_TABLE: folded from its start); finish(total) stores the result."""
        entry = reduction(op)
        if entry.combine is None:  # the log-sum-exp's stable form
            self.lse_reduction(rows, reduced, operand, finish)
            return
        all_axes = tuple(rows) + tuple(reduced)

        def body():
            self.emit(f"{self.real} total = {literal(entry.start, self.real)};")
            self.lane_loop(reduced, lambda: self.emit(self.fold("total", entry.combine, self.expression(operand, all_axes))))
            self.emit(f"total = {self.dialect.row_reduce(entry.combine, 'total')};")
            finish("total")

        self.row_loop(rows, body)

    def fold(self, into: str, fn: str, value: str) -> str:
        """``into`` folded with ``value`` by the elementwise function ``fn`` (a sum as +=)."""
        if fn == "add":
            return f"{into} += {value};"
        return f"{into} = {self.dialect.math(fn, [into, value], self.real)};"

    def lse_reduction(self, rows, reduced, operand, finish):
        """log(sum(exp(operand))) over `reduced` for every row, unstreamed: the row's max first,
        then the sum of exp(v - max); -inf for a row whose every entry is -inf (a masked row)."""
        d = self.dialect
        all_axes = tuple(rows) + tuple(reduced)

        def body():
            # in the step's type (double for an f64 step), as the softmax beside it
            self.emit(f"{self.real} top = -NK_INF;")
            self.lane_loop(reduced, lambda: self.emit(f"top = {d.math('max', ['top', self.expression(operand, all_axes)], self.real)};"))
            self.emit(f"top = {d.row_reduce('max', 'top')};")
            self.emit(f"const {self.real} shift = (top == -NK_INF) ? {self.zero} : top;")
            self.emit(f"{self.real} total = {self.zero};")
            self.lane_loop(reduced, lambda: self.emit(f"total += {d.math('exp', [self.expression(operand, all_axes) + ' - shift'], self.real)};"))
            self.emit(f"total = {d.row_reduce('add', 'total')};")
            finish(f"((top == -NK_INF) ? -NK_INF : shift + {d.math('log', ['total'], self.real)})")

        self.row_loop(rows, body)

    def softmax(self, s, box: Softmax, staged: bool = False):
        """P = softmax[axis](operand), unstreamed, a row to a group of lanes (Printer.row_loop) in
        three passes over the row: its max, the sum of exp(v - max), then exp(v - max) / sum.

        The operand is evaluated once per element, as the model and the NumPy backend count it:
        the first pass keeps each value where the thread reads it back in the other two, in the
        target's element (each lane visits the same elements in every pass, so a thread reads
        only what it wrote) or in the per-thread ``stage`` where the result waits in registers
        anyway (``staged``) or where the target's type would round it (a guard: the Program
        keeps a computed tile in the step's type, pseudocode.compute_dtype). A plain read is read
        again instead: it costs no FLOPs, and keeping it would cost a store."""
        rows = s.woven
        axis = box.axis
        all_axes = tuple(rows) + (axis,)
        d = self.dialect
        reread = isinstance(box.operand, Read)
        kept_in = self.slots[s.target].dtype
        exact = kept_in == "f64" or (kept_in == "f32" and self.real == "float")  # the target holds v as it is
        in_stage = staged or (not reread and not exact)

        def keep(value):  # first pass: the operand's value, kept for the other two
            if in_stage:
                self.emit(f"stage[{self.stage_index()}] = {value};")
            else:
                self.emit(self.write(s.target, all_axes, value))

        def kept() -> str:  # the value the first pass kept, or the read itself
            if reread:
                return self.expression(box.operand, all_axes)
            return f"stage[{self.stage_index()}]" if in_stage else self.read(s.target, all_axes)

        def first():
            if reread:
                self.emit(f"m = {d.math('max', ['m', self.expression(box.operand, all_axes)], self.real)};")
                return
            self.emit(f"const {self.real} v = {self.expression(box.operand, all_axes)};")
            keep("v")
            self.emit(f"m = {d.math('max', ['m', 'v'], self.real)};")

        def probability(value: str) -> str:
            # A fully masked row (every entry -inf) is 0, as in the reference, not exp(NaN).
            return f"(m == -NK_INF) ? {self.zero} : {d.math('exp', [value + ' - m'], self.real)} / l"

        def last():
            if not in_stage:
                self.emit(self.write(s.target, all_axes, probability(kept())))
            elif reread:
                self.emit(f"stage[{self.stage_index()}] = {probability(kept())};")
            else:  # stage[i] = f(stage[i]) spells the index twice
                at = self.stage_slot()
                self.emit(f"stage[{at}] = {probability(f'stage[{at}]')};")

        def body():
            # A running count (trips not counted at print time) restarts at the row's first value
            # in each pass; trip numbers index the same value in every pass by themselves.
            rewind = in_stage and not reread and not self.stage_counted((axis,), d.lane_step)
            if rewind:
                self.emit("const int k_row = k;")
            self.emit(f"{self.real} m = -NK_INF;")
            self.lane_loop((axis,), first)
            self.emit(f"m = {d.row_reduce('max', 'm')};")
            self.emit(f"{self.real} l = {self.zero};")
            if rewind:
                self.emit("k = k_row;")
            self.lane_loop((axis,), lambda: self.emit(f"l += {d.math('exp', [kept() + ' - m'], self.real)};"))
            self.emit(f"l = {d.row_reduce('add', 'l')};")
            if rewind:
                self.emit("k = k_row;")
            self.lane_loop((axis,), last)

        if not in_stage:
            self.row_loop(rows, body)
            return
        # The output reuses the input's bytes at another offset (written once every row is read),
        # or it would round the values kept (then the barrier is not needed: one a step).
        self.staged(self.per_thread_rows(rows, (axis,)), lambda: self.row_loop(rows, body),
                    lambda write: self.row_loop(rows, lambda: self.lane_loop((axis,), write)), s.target, all_axes)

    def step_merge(self, step: Step):
        """One part's states, loaded along the part axis (one part long here), merged into the
        running ones, as the Program's merge step says (pseudocode._LaunchElaborator.merge): a
        fold for sums, max and min; for the online softmax m' = max(m, m_p), each side's factor
        exp(m - m') and exp(m_p - m') (0 for a side that saw only masked entries), l = l a + l_p b;
        an output it rescales O = O a + O_p b. Every element is its own: no barrier inside."""
        s = step.statement
        d = self.dialect
        if len(step.reads) == 2:  # an accumulator: acc = fold(acc, acc.part)
            (_, acc), (_, incoming) = step.reads
            box = s.box
            fn = "add" if isinstance(box, Contract) or reduction(box.op).divides else reduction(box.op).combine

            def folded(current: str) -> str:
                value = self.read(incoming, s.axes)
                return f"{current} + {value}" if fn == "add" else d.math(fn, [current, value], self.real)

            if acc in self.accumulators:
                self.owned_outputs(self.accumulators[acc], s.axes, lambda r: self.emit(f"{r} = {folded(r)};"))
                return
            self.flat_loop(s.axes, lambda: self.emit(self.write(acc, s.axes, folded(self.read(acc, s.axes)))))
            return
        if step.online is None:  # the online softmax's (max, sum)
            (_, m), (_, total), (_, m_part), (_, total_part) = step.reads
            _, _, (_, scale), (_, scale_part) = step.writes
            rows = s.woven

            def row():
                self.emit(f"const {self.real} m = {self.read(m, rows)}, mp = {self.read(m_part, rows)};")
                self.emit(f"const {self.real} fresh = {d.math('max', ['m', 'mp'], self.real)};")
                self.emit(f"const {self.real} a = (m == -NK_INF) ? {self.zero} : {d.math('exp', ['m - fresh'], self.real)};")
                self.emit(f"const {self.real} b = (mp == -NK_INF) ? {self.zero} : {d.math('exp', ['mp - fresh'], self.real)};")
                self.emit(self.write(total, rows, f"{self.read(total, rows)} * a + {self.read(total_part, rows)} * b"))
                self.emit(self.write(m, rows, "fresh"))
                self.emit(self.write(scale, rows, "a"))
                self.emit(self.write(scale_part, rows, "b"))

            self.flat_loop(rows, row)
            return
        # an output the online softmax rescales
        (_, acc), (_, incoming), (_, scale), (_, scale_part) = step.reads

        def rescaled(current: str) -> str:
            return (f"{current} * {self.read(scale, s.axes)} + "
                    f"{self.read(incoming, s.axes)} * {self.read(scale_part, s.axes)}")

        if acc in self.accumulators:
            self.owned_outputs(self.accumulators[acc], s.axes, lambda r: self.emit(f"{r} = {rescaled(r)};"))
            return
        self.flat_loop(s.axes, lambda: self.emit(self.write(acc, s.axes, rescaled(self.read(acc, s.axes)))))

    def step_rescale(self, step: Step):
        s = step.statement
        d = self.dialect
        if isinstance(s.box, Softmax):
            axis = s.box.axis
            all_axes = tuple(s.woven) + (axis,)
            m, scale = f"{s.target}.max", f"{s.target}.scale"

            def body():
                self.emit(f"{self.real} chunk = -NK_INF;")
                self.lane_loop((axis,), lambda: self.emit(f"chunk = {d.math('max', ['chunk', self.expression(s.box.operand, all_axes)], self.real)};"))
                self.emit(f"chunk = {d.row_reduce('max', 'chunk')};")
                self.emit(f"const {self.real} old = {self.read(m, s.woven)};")
                self.emit(f"const {self.real} fresh = {d.math('max', ['old', 'chunk'], self.real)};")
                if d.warp_sync:
                    self.emit(d.warp_sync)
                with self.block(f"if ({self.dialect.lane_zero}) {{"):
                    self.emit(self.write(scale, s.woven, f"(old == -NK_INF) ? {self.zero} : {d.math('exp', ['old - fresh'], self.real)}"))
                    self.emit(self.write(m, s.woven, "fresh"))

            self.row_loop(s.woven, body)
            return
        # A contraction's running sum, rescaled by the online softmax's factor.
        acc = f"{s.target}.acc"
        scale_ref = f"{step.online}.scale"  # the online softmax the Program links it to
        if acc in self.accumulators:  # each thread its own outputs, in the order accumulate visits them
            self.owned_outputs(self.accumulators[acc], s.axes, lambda r: self.emit(f"{r} *= {self.read(scale_ref, s.axes)};"))
            return
        self.flat_loop(s.axes, lambda: self.emit(self.write(acc, s.axes, f"{self.read(acc, s.axes)} * {self.read(scale_ref, s.axes)}")))

    def step_online(self, step: Step):
        s = step.statement
        d = self.dialect
        axis = s.box.axis
        all_axes = tuple(s.woven) + (axis,)
        m, total, scale = f"{s.target}.max", f"{s.target}.sum", f"{s.target}.scale"
        # The chunk may take the bytes of its operand in another axis order (S[x q] -> P[q x]):
        # then every row is read before any is written (found by the fuzzer: wrong on OpenCL).
        staged = self.hazard(step, s.target)

        def body():
            self.emit(f"const {self.real} m = {self.read(m, s.woven)};")
            self.emit(f"{self.real} l = {self.zero};")

            def element():
                # Masked entries are -inf, exp makes them 0; a row masked so far has m = -inf too.
                self.emit(f"const {self.real} p = (m == -NK_INF) ? {self.zero} : {d.math('exp', [self.expression(s.box.operand, all_axes) + ' - m'], self.real)};")
                self.emit(f"stage[{self.stage_index()}] = p;" if staged else self.write(s.target, all_axes, "p"))
                self.emit("l += p;")

            self.lane_loop((axis,), element)
            self.emit(f"l = {d.row_reduce('add', 'l')};")
            self.emit(f"if ({self.dialect.lane_zero}) {{ {self.write(total, s.woven, f'{self.read(total, s.woven)} * {self.read(scale, s.woven)} + l')} }}")

        if not staged:
            self.row_loop(s.woven, body)
            return
        self.staged(self.per_thread_rows(s.woven, (axis,)), lambda: self.row_loop(s.woven, body),
                    lambda write: self.row_loop(s.woven, lambda: self.lane_loop((axis,), write)), s.target, all_axes)

    def step_accumulate(self, step: Step):
        s = step.statement
        box = s.box
        if isinstance(box, Contract):
            self.contraction(step, s.target, accumulate=True)
            return
        acc = f"{s.target}.acc"
        fn = reduction(box.op).combine  # the chunk's result folded into the running one

        def finish(total):
            current = self.read(acc, s.axes)
            value = f"{current} + {total}" if fn == "add" else self.dialect.math(fn, [current, total], self.real)
            self.emit(f"if ({self.dialect.lane_zero}) {{ {self.write(acc, s.axes, value)} }}")

        self.row_reduction(s.axes, box.axes, box.op, box.operand, finish)

    def step_finalise(self, step: Step):
        s = step.statement
        box = s.box
        if isinstance(box, Reduce) and reduction(box.op).combine is None:
            # L = P.max + log(P.sum), the online softmax's state; -inf for a fully masked row
            (_, m), (_, total) = step.reads
            self.elementwise(step, s.target, s.axes, lambda: f"({self.read(m, s.axes)} == -NK_INF) ? -NK_INF : "
                                                             f"{self.read(m, s.axes)} + {self.dialect.math('log', [self.read(total, s.axes)], self.real)}")
            return
        acc = f"{s.target}.acc"
        denominators = [f"{step.online}.sum"] if step.online is not None else []  # a rescaled contraction's
        if isinstance(box, Contract) and acc in self.accumulators:
            total = self.read(denominators[0], s.axes) if denominators else None

            def value(r):  # a fully masked row summed nothing: 0, as in the reference
                return r if total is None else f"({total} == {self.zero}) ? {self.zero} : {r} / {total}"

            self.finalise_registers(step, self.accumulators[acc], value)
            return
        if isinstance(box, Contract) and denominators:  # the online softmax's normalisation
            # A fully masked row summed nothing: 0, as in the reference (not 0 / 0).
            self.elementwise(step, s.target, s.axes, lambda: f"({self.read(denominators[0], s.axes)} == {self.zero}) ? {self.zero} : "
                                                             f"{self.read(acc, s.axes)} / {self.read(denominators[0], s.axes)}")
            return
        if isinstance(box, Contract):
            self.elementwise(step, s.target, s.axes, lambda: self.read(acc, s.axes))
            return
        self.elementwise(step, s.target, s.axes, lambda: self.mean(self.read(acc, s.axes), box))



def _overlaps(a: Slot, b: Slot) -> bool:
    return a.offset < b.offset + b.size and b.offset < a.offset + a.size
