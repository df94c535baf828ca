"""The tensor-core lowering: a launch with a :class:`~napkin_dsl.paths.mma_sync.MmaSyncPlan` -> a kernel.

This is the register level of the napkin method, FlashAttention-2's structure:

* the block's tile of the plan's row axis is split into warp tiles; a warp owns
  ``warp_rows`` rows and keeps every array the launch computes (S, P, the online max and
  sum, accumulators, outputs) in registers as ``mma.sync.m16n8k16`` accumulator fragments
  (``layouts.mma_c``), or as one value per fragment row for arrays of the row axis alone;
* contraction operands are shared-memory tiles (``isel.smem_layout``) laid out by
  ``layouts.SwizzledTile``, written by 16-byte ``cp.async`` and read by ``ldmatrix``
  (``.trans`` where the contracted axis is not the fastest); operands carrying the
  streamed axis are double-buffered: the next chunk is in flight while this one is used;
* a register-resident A operand (P) is packed to the B operand's 16-bit type and fed
  straight into the next mma: an accumulator pair is exactly an A fragment;
* fp8 operands run on ``mma.sync.m16n8k32`` (:meth:`TensorPrinter.mma_fp8`): A by ldmatrix as
  16-bit pairs of the same bytes, B by ldmatrix when k is its fastest axis and by byte loads
  (``layouts.MMA_B8``) when n is; the accumulators are the 16-bit path's; P from registers is
  packed to bytes in ``layouts.KEY_ORDER8``'s key order, and V's rows gathered in it;
* row reductions (max, sum, softmax) reduce in the thread, then across the four lanes of a
  quad with ``xor`` shuffles.

Both dialects print the same code: CUDA spells the primitives with inline PTX; OpenCL
emulates each one with the same per-lane layouts through local memory and barriers (a warp
is 32 consecutive work-items), so a CPU run through PoCL executes every fragment index the
CUDA kernel uses. The primitives are the ``NK_*`` macros of each dialect's prelude.

Outputs leave through a swizzled shared tile and 16-byte stores when the arena is free and
large enough (matmul's f32 128 x 128 tile is not: it is stored from fragments).

A split's parts launch (issue 28; isel plans it here where each part streams the split axis in
whole unmasked chunks and computes every statement of the launch) is one block per part and
tile: its stream runs from the part's origin over the part's chunks (fewer in the short last
part of a ragged axis), and its epilogue saves the part state the combine launch (the FMA
printer's) loads, at the part's place along the part axis: the accumulator fragments, and an
online softmax's row max (back from the log2 domain) and row sum (summed over the quad).

Deliberately not here: deciding whether a launch qualifies (``isel.py``), the FMA lowering
(``lowering.py``), what both printers share (``lowering.KernelWriter``), wgmma (``wgmma.py``), a
split's combine launch (the FMA printer's).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import replace

from ..boxes import reduction
from .. import algebra
from ..dtypes import DTYPE_BYTES, FP8_DTYPES
from ..diagram import Apply, Const, Contract, Map, Read, Reduce, Softmax, format_expression, reads
from ..isel import smem_layout
from ..paths.mma_sync import MmaSyncPlan
from ..paths.plan import TensorPlan, staged_slot
from ..layouts import (
    LDMATRIX_DELIVERS,
    LDMATRIX_DELIVERS_T,
    MMA_A,
    MMA_A8,
    MMA_B,
    MMA_B8,
    MMA_C,
    MMA_C_PAIR,
    MMA_C_VALUE,
    MMA_K,
    MMA_K8,
    MMA_M,
    MMA_N,
    KEY_ORDER8_KN,
    PACK8,
    PACK16,
    ROW_LANE_MASKS,
    SwizzledTile,
    bare,
    ldmatrix_b_registers,
    ldmatrix_keyed_lane_expr,
    ldmatrix_keyed_offset_expr,
    ldmatrix_lane_terms,
    ldmatrix_offset_expr,
    compose,
    offset_expr,
    p_to_a8_registers,
    p_words8,
    QUAD_HALF,
    QUAD_SOURCE,
    p_to_a_registers,
)
from ..pseudocode import Loop, Step, walk
from ..reference import ReferenceFailure, constant_value
from .lowering import KernelSource, KernelWriter, LoweringError, ident, literal, state_start

CUDA_PRELUDE = r"""
// ---- tensor-core primitives (PTX ISA: ldmatrix, mma.m16n8k16, cp.async) ----
__device__ __forceinline__ void nk_ldsm_x4(unsigned r[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void nk_ldsm_x4_t(unsigned r[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void nk_mma_bf16(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void nk_mma_f16(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned nk_pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ unsigned nk_pack_f16(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
// 16 bytes global -> shared; src-size 0 writes zeros (the masked tail) and reads nothing.
__device__ __forceinline__ void nk_cp16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
// 2^x on the special-function unit; softmax arguments are <= 0, where its error is ~2 ulp.
__device__ __forceinline__ float nk_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#define NK_ST16(dst, off) (*reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(nk_smem + (off)))
#define NK_LDSM(r, off) nk_ldsm_x4((r), nk_sbase + (off))
#define NK_LDSM_T(r, off) nk_ldsm_x4_t((r), nk_sbase + (off))
#define NK_MMA_BF16(c, a, b0, b1) nk_mma_bf16((c), (a), (b0), (b1))
#define NK_MMA_F16(c, a, b0, b1) nk_mma_f16((c), (a), (b0), (b1))
#define NK_PACK_BF16(lo, hi) nk_pack_bf16((lo), (hi))
#define NK_PACK_F16(lo, hi) nk_pack_f16((lo), (hi))
// the f32 values of a packed pair's low and high halves (a packed P's row sum)
#define NK_LO_BF16(pk) __uint_as_float((pk) << 16)
#define NK_HI_BF16(pk) __uint_as_float((pk) & 0xffff0000u)
#define NK_LO_F16(pk) __half2float(__ushort_as_half((unsigned short)((pk) & 0xffffu)))
#define NK_HI_F16(pk) __half2float(__ushort_as_half((unsigned short)((pk) >> 16)))
#define NK_CP16(off, src, valid) nk_cp16(nk_sbase + (off), (src), (valid))
#define NK_CP_COMMIT() asm volatile("cp.async.commit_group;\n" ::)
#define NK_CP_WAIT(n) asm volatile("cp.async.wait_group %0;\n" :: "n"(n))
#define NK_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#define NK_SYNC() __syncthreads()
#define NK_UNROLL _Pragma("unroll")
#define NK_ROLLED _Pragma("unroll 1")
"""

_OPENCL_HEAD = r"""
/* ---- tensor-core primitives, emulated per warp (32 consecutive work-items) through local
   memory with the PTX ISA's per-lane layouts; every call is reached by the whole group. */
inline float nk_b16f(uint bits, int f16) {
    ushort h = (ushort)(bits & 0xffffu);
    return f16 ? vload_half(0, (const __private half*)&h) : as_float(((uint)h) << 16);
}
inline ushort nk_to_f16(float v) { ushort h; vstore_half_rte(v, 0, (__private half*)&h); return h; }
inline uint nk_pack_bf16(float lo, float hi) { return (uint)nk_to_bf16(lo) | ((uint)nk_to_bf16(hi) << 16); }
inline uint nk_pack_f16(float lo, float hi) { return (uint)nk_to_f16(lo) | ((uint)nk_to_f16(hi) << 16); }
inline ushort nk_lds16(__local const uchar* smem, int off) { return *(__local const ushort*)(smem + off); }
"""

_OPENCL_TAIL = r"""
inline float nk_shfl_xor(float v, int m, __local uint* ws, int lane) {
    barrier(CLK_LOCAL_MEM_FENCE);
    ws[lane] = as_uint(v);
    barrier(CLK_LOCAL_MEM_FENCE);
    return as_float(ws[lane ^ m]);
}
/* cp.async emulated as a synchronous 16-byte copy (zeros when masked). */
inline void nk_cp16(__local uchar* smem, int off, __global const uchar* src, int valid) {
    *(__local uint4*)(smem + off) = valid ? vload4(0, (__global const uint*)src) : (uint4)(0u);
}
#define nk_exp2(x) exp2(x)
#define NK_ST16(dst, off) vstore4(vload4(0, (__local const uint*)(nk_smem + (off))), 0, (__global uint*)(dst))
#define NK_WS {ws}
#define NK_LDSM(r, off) nk_ldsm_x4((r), nk_smem, (off), 0, nk_ws, nk_lane)
#define NK_LDSM_T(r, off) nk_ldsm_x4((r), nk_smem, (off), 1, nk_ws, nk_lane)
#define NK_MMA_BF16(c, a, b0, b1) nk_mma((c), (a), (b0), (b1), 0, nk_ws, nk_lane)
#define NK_MMA_F16(c, a, b0, b1) nk_mma((c), (a), (b0), (b1), 1, nk_ws, nk_lane)
#define NK_PACK_BF16(lo, hi) nk_pack_bf16((lo), (hi))
#define NK_PACK_F16(lo, hi) nk_pack_f16((lo), (hi))
#define NK_LO_BF16(pk) nk_b16f((pk), 0)
#define NK_HI_BF16(pk) nk_b16f((pk) >> 16, 0)
#define NK_LO_F16(pk) nk_b16f((pk), 1)
#define NK_HI_F16(pk) nk_b16f((pk) >> 16, 1)
#define NK_CP16(off, src, valid) nk_cp16(nk_smem, (off), (__global const uchar*)(src), (valid))
#define NK_CP_COMMIT()
#define NK_CP_WAIT(n)
#define NK_SHFL_XOR(v, m) nk_shfl_xor((v), (m), nk_ws, nk_lane)
#define NK_SYNC() barrier(CLK_LOCAL_MEM_FENCE)
#define NK_UNROLL
#define NK_ROLLED
"""


def _opencl_emulation() -> str:
    """ldmatrix.x4 and mma.m16n8k16 emulated per warp, their index arithmetic printed from the
    layout objects: ldmatrix has each lane post its row address and read, for each register
    half, the element :data:`~napkin_dsl.layouts.LDMATRIX_DELIVERS` names of the row its
    supplier posted; mma has the lanes post their A and B registers and each lane compute its
    accumulators (``MMA_C``) from the registers the inverse fragment layouts name."""
    lane = "lane"
    plain = LDMATRIX_DELIVERS.c_expr(lane, "j", "h")
    trans = LDMATRIX_DELIVERS_T.c_expr(lane, "j", "h")
    a_lane, a_i = MMA_A.inverse().c_expr("row", "k")
    b_lane, b_i = MMA_B.inverse().c_expr("k", "n")
    row, n = MMA_C.c_expr(lane, "i")
    a_regs, b_regs = MMA_A.extent("i") // 2, MMA_B.extent("i") // 2
    b_base = 32 * a_regs  # B's registers follow A's in the warp's scratch
    ar, ah = PACK16.c_expr("ai")
    br, bh = PACK16.c_expr("bi")
    return f"""/* ldmatrix.x4: lanes 8j..8j+7 give the rows of matrix j; half h of register j of a lane is
   element `element` of the row lane `supplier` gave (layouts.LDMATRIX_DELIVERS, _T). */
inline void nk_ldsm_x4(uint r[4], __local const uchar* smem, int off, int trans, __local uint* ws, int lane) {{
    barrier(CLK_LOCAL_MEM_FENCE);
    ws[lane] = (uint)off;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int j = 0; j < {LDMATRIX_DELIVERS.extent("j")}; ++j) {{
        uint v[2];
        for (int h = 0; h < 2; ++h) {{
            const int supplier = trans ? {trans[0]} : {plain[0]};
            const int element = trans ? {trans[1]} : {plain[1]};
            v[h] = nk_lds16(smem, (int)ws[supplier] + 2 * element);
        }}
        r[j] = v[0] | (v[1] << 16);
    }}
}}
/* mma.m16n8k16, f32 accumulators: c_i of a lane is (row, n) of layouts.MMA_C; the lane and value
   holding A(row, k) and B(k, n) are the inverse layouts', in .b32 registers by layouts.PACK16. */
inline void nk_mma(float c[4], const uint a[{a_regs}], uint b0, uint b1, int f16, __local uint* ws, int lane) {{
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int j = 0; j < {a_regs}; ++j) ws[{a_regs} * lane + j] = a[j];
    ws[{b_base} + {b_regs} * lane] = b0;
    ws[{b_base} + {b_regs} * lane + 1] = b1;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int i = 0; i < {MMA_C.extent("i")}; ++i) {{
        const int row = {row}, n = {n};
        float acc = c[i];
        for (int k = 0; k < {MMA_K}; ++k) {{
            const int al = {a_lane}, ai = {a_i};
            const int bl = {b_lane}, bi = {b_i};
            const uint areg = ws[{a_regs} * al + {ar}];
            const uint breg = ws[{b_base} + {b_regs} * bl + {br}];
            acc += nk_b16f({ah} ? areg >> 16 : areg, f16) * nk_b16f({bh} ? breg >> 16 : breg, f16);
        }}
        c[i] = acc;
    }}
}}
"""


# the warp's scratch: 32 lanes' A and B registers (mma), reused by ldmatrix and the shuffles
OPENCL_PRELUDE = (_OPENCL_HEAD + _opencl_emulation()
                  + _OPENCL_TAIL.replace("{ws}", str(32 * (MMA_A.extent("i") + MMA_B.extent("i")) // 2)))

PRELUDES = {"cuda": CUDA_PRELUDE, "opencl": OPENCL_PRELUDE}

def _fp8_pack(inline: str) -> str:
    """P's four f32 values -> one register of the 8-bit A fragment, low byte first (layouts.PACK8),
    each encoded as every fp8 store is (lowering.fp8_prelude: saturating, nearest even)."""
    return "".join(f"""{inline} unsigned nk_pack_{t}(float v0, float v1, float v2, float v3) {{
    return (unsigned)nk_to_{t}(v0) | ((unsigned)nk_to_{t}(v1) << 8) | ((unsigned)nk_to_{t}(v2) << 16) | ((unsigned)nk_to_{t}(v3) << 24);
}}
#define NK_PACK_{t.upper()}(v0, v1, v2, v3) nk_pack_{t}((v0), (v1), (v2), (v3))
""" for t in ("e4m3", "e5m2"))


# CUDA packs with sm_89's cvt.rn.satfinite.{e4m3,e5m2}x2.f32 (d, a, b: a to the upper byte), the
# same rounding (nearest even), saturation and NaN as nk_to_e4m3 in two values an instruction:
# P is packed in attention's hot loop, where the bit encode cost ~10 instructions a value. The
# fp8 prelude is printed only for an fp8 plan, which selection makes for sm_89 and later only.
_FP8_PACK = "".join(rf"""__device__ __forceinline__ unsigned nk_pack_{t}(float v0, float v1, float v2, float v3) {{
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.{t}x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v1), "f"(v0));
    asm("cvt.rn.satfinite.{t}x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v3), "f"(v2));
    return (unsigned)lo | ((unsigned)hi << 16);
}}
#define NK_PACK_{t.upper()}(v0, v1, v2, v3) nk_pack_{t}((v0), (v1), (v2), (v3))
""" for t in ("e4m3", "e5m2"))


# mma.sync m16n8k32 with e4m3/e5m2 operands (sm_89 and later), only in a unit with an fp8 plan.
_CUDA_FP8 = "".join(rf"""__device__ __forceinline__ void nk_mma_{t}(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {{
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.{t}.{t}.f32 {{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}}
#define NK_MMA_{t.upper()}(c, a, b0, b1) nk_mma_{t}((c), (a), (b0), (b1))
""" for t in ("e4m3", "e5m2")) + _FP8_PACK + r"""// P's bytes to the 8-bit A fragment in the ISA's key order (layouts.QUAD_SOURCE): a lane's word
// from another lane of its quad, and two words' 16-bit halves into one register (prmt.b32)
#define NK_SHFL_IDX_U(v, src) __shfl_sync(0xffffffffu, (v), (src))
#define NK_PRMT(x, y, sel) __byte_perm((x), (y), (sel))
"""





def _opencl_fp8_emulation() -> str:
    """mma.m16n8k32 on e4m3/e5m2 emulated per warp, decoded from the ISA's fragment maps
    (layouts.MMA_A8, MMA_B8, PACK8: the lane, register and byte holding A(row, k) and B(k, n)),
    apart from the code that fills the registers; values decoded by the fp8 prelude's exact
    nk_e4m3 / nk_e5m2, products summed in f32 in k order."""
    lane = "lane"
    a_lane, a_i = MMA_A8.inverse().c_expr("row", "k")
    b_lane, b_i = MMA_B8.inverse().c_expr("k", "n")
    row, n = MMA_C.c_expr(lane, "i")
    a_regs, b_regs = MMA_A8.extent("i") // 4, MMA_B8.extent("i") // 4
    b_base = 32 * a_regs
    ar, ab = PACK8.c_expr("ai")
    br, bb = PACK8.c_expr("bi")
    return f"""/* mma.m16n8k32 .e4m3/.e5m2, f32 accumulators: c_i of a lane is (row, n) of layouts.MMA_C;
   A(row, k) and B(k, n) are byte {ab} / {bb} of register {ar} / {br} of the lanes the inverse
   fragment layouts (MMA_A8, MMA_B8) name. */
inline float nk_fp8f(uint byte, int e5m2) {{ return e5m2 ? nk_e5m2((uchar)byte) : nk_e4m3((uchar)byte); }}
inline void nk_mma8(float c[4], const uint a[{a_regs}], uint b0, uint b1, int e5m2, __local uint* ws, int lane) {{
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int j = 0; j < {a_regs}; ++j) ws[{a_regs} * lane + j] = a[j];
    ws[{b_base} + {b_regs} * lane] = b0;
    ws[{b_base} + {b_regs} * lane + 1] = b1;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int i = 0; i < {MMA_C.extent("i")}; ++i) {{
        const int row = {row}, n = {n};
        float acc = c[i];
        for (int k = 0; k < {MMA_K8}; ++k) {{
            const int al = {a_lane}, ai = {a_i};
            const int bl = {b_lane}, bi = {b_i};
            const uint areg = ws[{a_regs} * al + {ar}];
            const uint breg = ws[{b_base} + {b_regs} * bl + {br}];
            acc += nk_fp8f((areg >> (8 * {ab})) & 0xffu, e5m2) * nk_fp8f((breg >> (8 * {bb})) & 0xffu, e5m2);
        }}
        c[i] = acc;
    }}
}}
#define NK_MMA_E4M3(c, a, b0, b1) nk_mma8((c), (a), (b0), (b1), 0, nk_ws, nk_lane)
#define NK_MMA_E5M2(c, a, b0, b1) nk_mma8((c), (a), (b0), (b1), 1, nk_ws, nk_lane)
"""


# the same scratch as the 16-bit emulation's: 32 lanes x (4 A + 2 B) registers
assert MMA_A8.extent("i") // 4 + MMA_B8.extent("i") // 4 == (MMA_A.extent("i") + MMA_B.extent("i")) // 2
_OPENCL_EXCHANGE = r"""
/* shfl.sync.idx: lane `src`'s value, through the warp's scratch */
inline uint nk_shfl_idx_u(uint v, int src, __local uint* ws, int lane) {
    barrier(CLK_LOCAL_MEM_FENCE);
    ws[lane] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    return ws[src & 31];
}
/* prmt.b32 (PTX ISA 9.7.9.7, default mode): bytes 0-3 of x then 4-7 of y; byte i of the result is
   the byte nibble i of the selector names (bits 0-2), or that byte's sign replicated (bit 3). */
inline uint nk_prmt(uint x, uint y, uint sel) {
    const ulong both = (ulong)x | ((ulong)y << 32);
    uint out = 0u;
    for (int i = 0; i < 4; ++i) {
        const uint nib = (sel >> (4 * i)) & 0xfu;
        uint b = (uint)((both >> (8 * (nib & 7u))) & 0xfful);
        if (nib & 8u) b = (b & 0x80u) ? 0xffu : 0u;
        out |= b << (8 * i);
    }
    return out;
}
#define NK_SHFL_IDX_U(v, src) nk_shfl_idx_u((v), (src), nk_ws, nk_lane)
#define NK_PRMT(x, y, sel) nk_prmt((x), (y), (sel))
"""
FP8_PRELUDES = {"cuda": _CUDA_FP8, "opencl": _opencl_fp8_emulation() + _fp8_pack("inline") + _OPENCL_EXCHANGE}
UNIT = 16
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _var(name: str) -> str:
    return "f_" + ident(name)


class TensorPrinter(KernelWriter):
    """Prints one launch on the tensor-core path of ``plan``."""

    # The arena's base alignment: a 128-byte line holds a swizzled tile's 16-byte units.
    arena_alignment = 128

    def __init__(self, program, launch, dialect, plan: TensorPlan):
        super().__init__(program, launch, dialect, plan.threads)
        # A split's parts launch: isel plans it here only where the part streams its axis in
        # whole chunks (isel._plan), so that a chunk never crosses into the next part.
        assert self.cut is None or (self.cut.axis == plan.stream and self.part_tile[self.cut.axis] % self.tile[plan.stream] == 0), \
            f"napkin bug: the parts of split {self.cut.axis} are not streamed in whole chunks"
        self.plan = plan
        self.smem, self.arena = smem_layout(plan, self.tile, self.diagram)
        # A streamed operand -> the pipeline buffer (stage of the cp.async ring) the current
        # chunk reads it from: a constant, or a running index in a masked stream's loops.
        self.buffers: dict[str, str] = {}
        self.chunk_loaded: set[str] = set()  # the chunk's vectors, loaded at its top
        self.pending = False  # cp.async groups issued and not yet waited for
        # A contraction's positive constant scale (S *= d^-0.5) that only softmaxes read: it is
        # not applied to the fragment but folded, with log2(e), into the one FFMA of each exp2
        # argument (FlashAttention-2's scale_log2). target -> the scale.
        self.folded: dict[str, float] = {}
        # A contraction's constant scale that only softmaxes of a product read (fp8's
        # softmax(S * sQ * sK)): not applied to the fragment but multiplied into the product's
        # other factors, which are grouped apart from the fragment (grouped_factors), so that
        # a value takes one multiply by a loop-invariant factor. target -> the scale.
        self.factor_folded: dict[str, object] = {}
        # Online softmaxes whose running max is kept in the log2 domain (max(v) * c, c the
        # exponent's multiplier) and whose rescale leaves this chunk's shift, with a row masked so
        # far (max -inf) shifted by 0, in nk_top_<P>: -inf is tested once per row and chunk.
        self.tops: set[str] = set()
        self.tops_ready: set[str] = set()
        # Streamed axes whose chunks are whole in the loop being printed (a ragged stream's
        # chunks before its last): their extent is the tile, a constant, so no element is tested.
        self.whole_chunk_axes: set[str] = set()
        # Running sums each thread keeps over its own columns only: the quad reduces them once,
        # after the stream, when first read (the scale that multiplies them is the same in the
        # four lanes of a quad, so the sum of partial sums is the row's sum).
        self.partial: set[str] = set()
        # Register A operands kept packed from the exponentials on (packed_fragments): name -> the
        # 16-bit type ("BF16", "F16") of the product that reads them.
        self.packed: dict[str, str] = {}
        # A masked chunk's where(COND, S, -inf) to apply to S's fragment once, in place, before
        # the first step that reads it (masked_in_place): (the where, S), or None.
        self.mask_pending: tuple | None = None
        # The first chunk each stream loop of the kernel visits (a C expression: "0", or a masked
        # block's nk_first_<x>), from which a chunk's buffer follows (buffer_of).
        self.stream_first: dict[str, str] = {}

    # -- the kernel
    def print(self, entry: str) -> KernelSource:
        d, plan = self.dialect, self.plan
        arrays, scalars = self.kernel_arrays()
        self.open_kernel(entry, arrays, scalars, self.extra_parameters(entry))
        self.emit(d.arena(self.arena_alignment))
        self.emit(f"const int nk_tid = {d.thread_id};")
        self.emit("const int nk_warp = nk_tid >> 5, nk_lane = nk_tid & 31;")
        # the lane's digits every fragment reads (layouts.MMA_C: groupID and threadID in group)
        self.emit(f"const int nk_g = {bare(MMA_C.digit_expr('g', 'nk_lane', 'i'))}, nk_t = {bare(MMA_C.digit_expr('t', 'nk_lane', 'i'))};")
        if plan.split:
            self.emit(f"const int nk_wrow = (nk_warp / {plan.col_warps}) * {plan.warp_rows};  // the warp's first row of the {plan.row} tile")
            self.emit(f"const int nk_wcol = (nk_warp % {plan.col_warps}) * {plan.warp_cols};  // ... and its first column of {plan.split}")
        else:
            self.emit(f"const int nk_wrow = nk_warp * {plan.warp_rows};  // the warp's first row of the {plan.row} tile")
        for line in d.warp_scratch("NK_WS", plan.warps):
            self.emit(line)
        self.emit(f"int nk_block = {d.block_id};")
        self.block_order()
        self.emit("(void)nk_block; (void)nk_g; (void)nk_t; (void)nk_wrow;")
        self.lane_constants()
        self.copy_constants()
        self.free_after = self.saves_after_shared_reads()
        self.fold_scales()
        self.packed = self.packed_fragments()
        self.compute()
        return self.close_kernel(entry, arrays, scalars)

    def compute(self):
        """The launch's registers and steps: the fragments declared, then the Program's nodes."""
        self.declare_fragments()
        self.nodes(self.launch.body)

    def declare_fragments(self):
        plan = self.plan
        for name in plan.fragments:
            if name in self.packed:  # two values a register, as the A fragment takes them
                cols = self.plan.cols_per_warp(self.plan.fragments[name].col, self.tile) // MMA_N
                self.emit(f"unsigned {_var(name)}[{plan.m_tiles}][{cols}][{MMA_C_PAIR.extent('h')}];  // packed to {self.packed[name].lower()} pairs")
                continue
            self.emit(f"float {_var(name)}{self.dims(name)};")
        for name in sorted(self.tops):
            self.emit(f"float nk_top_{ident(name)}[{plan.m_tiles}][{MMA_C_PAIR.extent('h')}];  // {name}'s shift this chunk (log2 domain)")

    def extra_parameters(self, entry: str) -> list[str]:
        """Parameters after the arrays and scalars (wgmma's tensor maps): none here."""
        return []

    def copies_landed(self):
        """Between a thread's cp.async wait and the barrier that publishes its copies (wgmma's
        proxy fence): nothing here, where ldmatrix reads through the generic proxy."""

    def fold_scales(self):
        """Find the scales to fold (``self.folded``) and the online softmaxes (``self.tops``).

        A scale folds when it is a positive constant (so max(c v) = c max(v)) and every later
        step that reads the scaled array is a softmax of it, of ``S`` or ``where(COND, S, -inf)``:
        the softmax then takes its max over the unscaled values and multiplies by the scale
        where it already multiplies by log2(e)."""
        sequence = [step for step, _ in walk(self.launch.body) if step.level == self.level]
        for index, step in enumerate(sequence):
            s = step.statement
            if step.op == "rescale" and isinstance(s.box, Softmax):
                self.tops.add(s.target)
            if step.op != "compute" or not isinstance(s.box, Contract) or (step.level, s.target) not in step.reads:
                continue
            scale = self.positive_constant(s.box.scale)
            later = [t for t in sequence[index + 1:] if any(ref[1] == s.target for ref in t.reads)]
            if scale is not None and later and all(self.softmax_of(t) == s.target for t in later):
                self.folded[s.target] = scale
            elif isinstance(s.box.scale, Const) and later and all(self.softmax_of_product(t) == s.target for t in later):
                self.factor_folded[s.target] = s.box.scale

    def packed_fragments(self) -> dict[str, str]:
        """The online softmaxes' outputs (P) that only mma.sync products read, as their A
        operand from registers in a 16-bit type: name -> that type's macro suffix. Such a P is
        packed as its exponentials are computed, two values a register (the A fragment's pairs),
        and its row sum adds the packed values: each f32 exponential is dead once packed, where a
        sum of the f32 values leaves ptxas free to hold all of them until its adds, which it
        schedules after the products (32-row warps at d = 128 then spill). The sum is that of the
        P the product multiplies, so O is the weighted mean of V's rows under the very weights
        it uses; only where that is all the sum is read for (not attention_lse's L, nor a split's
        part state, which are the exact sum's). Not for wgmma plans, whose printer packs P
        itself, nor fp8 (``mma_fp8``)."""
        plan = self.plan
        if not isinstance(plan, MmaSyncPlan):
            return {}
        steps = [step for step, _ in walk(self.launch.body) if step.level == self.level]
        found = {}
        for name in plan.fragments:
            readers = [t for t in steps if (self.level, name) in t.reads]
            writers = [t for t in steps if t.op == "online" and t.statement is not None and t.statement.target == name]
            if not readers or not writers or any(t.op == "save" and t.array == name for t in steps):
                continue
            # its row sum only normalises a product (O = O.acc / P.sum): a log-sum-exp output or a
            # split's part state reads the sum itself, which is the f32 exponentials' there
            sums = [t for t in steps if (self.level, f"{name}.sum") in t.reads and t.op != "online"]
            if not all(t.op == "finalise" and isinstance(t.statement.box, Contract) for t in sums):
                continue
            mmas = [plan.mmas.get(t.statement.target) if t.statement is not None else None for t in readers]
            if all(m is not None and m.a == name and m.a_in_registers and m.dtype in ("bf16", "f16") for m in mmas) \
                    and len({m.dtype for m in mmas}) == 1:
                found[name] = "BF16" if mmas[0].dtype == "bf16" else "F16"
        return found

    def positive_constant(self, expr) -> float | None:
        if not isinstance(expr, Const) or expr.value in (algebra.oo, -algebra.oo):
            return None
        try:
            value = constant_value(expr.value, self.sizes)
        except ReferenceFailure:
            return None
        return value if value > 0 else None

    @staticmethod
    def softmax_operand(step: Step):
        """What a softmax step exponentiates, with a mask ``where(COND, v, -inf)`` taken off:
        ``v``; None for a step that exponentiates nothing."""
        box = step.statement.box if step.statement is not None else None
        if step.op not in ("rescale", "online", "compute") or not isinstance(box, Softmax):
            return None
        operand = box.operand
        if (isinstance(operand, Apply) and operand.fn == "where" and isinstance(operand.args[2], Const)
                and operand.args[2].value == -algebra.oo):
            operand = operand.args[1]
        return operand

    @classmethod
    def softmax_of(cls, step: Step) -> str | None:
        """The array a softmax step exponentiates as ``S`` or ``where(COND, S, -inf)``, else None."""
        operand = cls.softmax_operand(step)
        return operand.array if isinstance(operand, Read) else None

    def softmax_of_product(self, step: Step) -> str | None:
        """The fragment a softmax step exponentiates a product of, ``S * f * ...`` (or that under
        ``where(COND, ..., -inf)``), read once and every other factor no fragment, else None."""
        operand = self.softmax_operand(step)
        if operand is None:
            return None
        factors = _factors(operand)
        held = [f for f in factors if isinstance(f, Read) and f.array in self.plan.fragments]
        return held[0].array if len(factors) > 1 and len(held) == 1 else None

    def grouped_factors(self, expr):
        """``expr`` with each product's factors that are no fragment (constants, scalars,
        vectors in shared memory) multiplied together apart from the fragments, a folded scale
        of a fragment read among them (:attr:`factor_folded`): ``S * (c * sQ * sK)``, whose
        loop-invariant part the compiler computes once, where ``((S * c) * sQ) * sK`` takes
        three multiplies a value (C's order is the source's)."""
        if not isinstance(expr, Apply):
            return expr
        if expr.fn != "mul":
            return Apply(expr.fn, tuple(self.grouped_factors(a) for a in expr.args))
        factors = _factors(expr)
        held = [f for f in factors if isinstance(f, Read) and f.array in self.plan.fragments]
        rest = [self.grouped_factors(f) for f in factors if not (isinstance(f, Read) and f.array in self.plan.fragments)]
        rest = [self.factor_folded[f.array] for f in held if f.array in self.factor_folded] + rest
        if not held or not rest:
            return _product([self.grouped_factors(f) for f in factors])
        return Apply("mul", (_product(held), _product(rest)))

    def exponent_scale(self, operand) -> float:
        """c in exp(v - max) = 2^(v c - max c): log2(e), times the folded scale of the array read."""
        operand_read = operand
        if isinstance(operand, Apply) and operand.fn == "where":
            operand_read = operand.args[1]
        if isinstance(operand_read, Read) and operand_read.array in self.folded:
            return LOG2E * self.folded[operand_read.array]
        return LOG2E

    def saves_after_shared_reads(self) -> set[int]:
        """Saves no later step of the launch follows with a read of shared memory."""
        sequence = [step for step, _ in walk(self.launch.body) if step.level == self.level]
        free, reading_later = set(), False
        for step in reversed(sequence):
            if step.op == "save" and not reading_later:
                free.add(id(step))
            if step.op != "save" and any(ref[1] in self.smem for ref in step.reads):
                reading_later = True
        return free

    def dims(self, name: str) -> str:
        plan = self.plan.laid_out(name)
        fragment = plan.fragments[name]
        if fragment.col is None:
            return f"[{plan.m_tiles}][{MMA_C_PAIR.extent('h')}]"
        return f"[{plan.m_tiles}][{plan.cols_per_warp(fragment.col, self.tile) // MMA_N}][{MMA_C.extent('i')}]"

    # -- loops over fragments
    def loop(self, var: str, count: int, body):
        self.emit("NK_UNROLL")
        with self.block(f"for (int {var} = 0; {var} < {count}; ++{var}) {{"):
            body()

    def each_element(self, col: str | None, body):
        """body() for every fragment element this thread holds: (mt, nt, i) or (mt, h)."""
        if col is None:
            self.loop("mt", self.plan.m_tiles, lambda: self.loop("h", MMA_C_PAIR.extent("h"), body))
            return
        nt = self.plan.cols_per_warp(col, self.tile) // MMA_N
        self.loop("mt", self.plan.m_tiles, lambda: self.loop("nt", nt, lambda: self.loop("i", MMA_C.extent("i"), body)))

    def warp_layout(self, pairs: bool):
        """(mt, nt, lane, i or h) -> (row, col) of the warp's tile: the accumulator fragment
        (``layouts.MMA_C``, or by pairs ``MMA_C_PAIR``) tiled over its m-tiles and n-tiles."""
        fragment = MMA_C_PAIR if pairs else MMA_C
        # the counts only bound the layout's domain: the printed loops bound mt and nt
        return fragment.tiled("nt", 1, (0, MMA_N)).tiled("mt", self.plan.m_tiles, (MMA_M, 0))

    def fragment_expr(self, pairs: bool, col: str | None = None) -> tuple[str, str]:
        """The current element's (row, column) within the block's tile (mt, nt, i or h)."""
        start = "nk_wcol" if col is not None and col == self.plan.split else None
        return self.warp_layout(pairs).c_expr("mt", "nt", "nk_lane", "h" if pairs else "i",
                                              given={"g": "nk_g", "t": "nk_t"}, origin=("nk_wrow", start))

    @staticmethod
    def value_index(e: str) -> str:
        """The accumulator value i of element ``e`` of the pair the loop's ``h`` holds."""
        return bare(MMA_C_VALUE.c_expr("h", e, given={"h": "h"}))

    def row_expr(self, in_rows: bool) -> str:
        return self.fragment_expr(in_rows)[0]

    def col_expr(self, col: str | None = None) -> str:
        """The current element's column within the block's tile of ``col``."""
        return self.fragment_expr(False, col)[1]

    def element(self, name: str, in_rows: bool, var: str | None = None) -> str:
        """The fragment element of ``name`` at the current loop position; ``var``: the same
        element of another array shaped as ``name`` (default: ``name``'s own)."""
        fragment = self.plan.fragments[name]
        var = var or _var(name)
        if fragment.col is None:
            return f"{var}[mt][{'h' if in_rows else bare(MMA_C_VALUE.inverse().c_expr('i')[0])}]"
        return f"{var}[mt][nt][i]"

    def col_valid(self, col: str) -> str | None:
        """A test that the current column is inside the axis (None when the tile divides it)."""
        extent = self.extent_expr(col)
        return None if extent == str(self.tile[col]) else f"({self.col_expr(col)} < {extent})"

    def value(self, expr, col: str | None) -> str:
        """An elementwise expression at the current element (row, col)."""
        in_rows = col is None

        def read(r: Read) -> str:
            if r.array in self.plan.fragments:
                return self.element(r.array, in_rows)
            return self.smem_element(r.array, in_rows)

        def printed(e):
            return self.printed(e, read, lambda axis: self.lane_index(axis, col))

        if expr in self.unmasked:  # a chunk the mask holds in full: the where's value, untested
            return f"({printed(self.grouped_factors(expr.args[1]))})"
        return printed(self.grouped_factors(expr))

    def lane_index(self, axis: str, col: str | None) -> str:
        """The whole array's index along ``axis`` of the fragment element this lane holds: its
        fragment row or column (``warp_layout``), plus the block's origin (an axis index in a mask)."""
        origin = f"{self.origin[axis]} + " if axis in self.origin else ""
        if axis == self.plan.row:
            return f"{origin}{self.row_expr(col is None)}"
        if col is not None and axis == col:
            return f"{origin}{self.col_expr(col)}"
        if self.tile[axis] == 1:
            return origin.removesuffix(" + ") or "0"
        raise LoweringError(f"the tensor-core printer has no per-lane index of axis {axis} here (only of the fragment's "
                            f"row {self.plan.row} and column, and of axes grouped by 1)",
                            hint="use the index in a statement over the fragment's axes, or run on the FMA path")

    def smem_element(self, name: str, in_rows: bool) -> str:
        slot = self.smem[name]
        dtype = self.diagram.arrays[name].dtype
        coords = {self.plan.row: self.row_expr(in_rows)}
        if not in_rows:
            for axis in self.diagram.arrays[name].axes:
                if axis != self.plan.row and self.tile[axis] > 1:
                    coords[axis] = self.col_expr(axis)
        t = self.dialect.storage[dtype]
        pointer = self.typed(t, slot.offset, name)
        if slot.tile is None:
            index = ""
            for axis in slot.axes:
                term = coords.get(axis, "0")
                index = term if not index else f"({index}) * {self.tile[axis]} + {term}"
            return self.dialect.load(pointer, index or "0", dtype)
        op = self.plan.operands[name]
        offset = offset_expr(slot.tile, coords[op.rows], coords[op.cols])
        return self.dialect.load(pointer, f"({offset}) / {DTYPE_BYTES[dtype]}", dtype)

    def typed(self, t: str, offset, name: str) -> str:
        buffer = self.buffers.get(name)
        if buffer is not None:
            offset = f"{offset} + ({buffer}) * {self.smem[name].stage_bytes}"
        return self.dialect.shared_pointer(t, offset, const=True)

    # -- reductions over a row of fragments
    def row_reduce(self, op: str, operand, col: str, into: str):
        """``into = op over the columns of (operand)`` for every row value (mt, h) of the thread."""
        d = self.dialect
        entry = reduction(op)  # its start and the function that folds a value in (boxes.py)
        start = literal(entry.start)

        def per_row():
            self.emit(f"float {into} = {start};")

            def per_element():
                self.emit(f"const int i = {self.value_index('e')};")
                value = self.value(operand, col)
                valid = self.col_valid(col)
                if valid:
                    value = f"({valid} ? {value} : {start})"
                self.emit(f"{into} = {d.math(entry.combine, [into, value])};")

            self.loop("nt", self.tile[col] // MMA_N, lambda: self.loop("e", MMA_C_VALUE.extent("e"), per_element))
            for mask in ROW_LANE_MASKS:  # the four lanes of a quad hold one row's columns
                self.emit(f"{into} = {d.math(entry.combine, [into, f'NK_SHFL_XOR({into}, {mask})'])};")

        return per_row

    # -- nodes and steps
    def nodes(self, nodes):
        for node in nodes:
            if isinstance(node, Loop):
                if node.kind == "group":
                    self.nodes(node.body)
                    continue
                self.stream_loop(node)
                continue
            self.step(node)

    def wait(self):
        if self.pending:
            self.emit("NK_CP_WAIT(0);")
            self.copies_landed()
            self.emit("NK_SYNC();")
            self.pending = False

    def step(self, step: Step):
        if step.level != self.level:
            return
        if self.mask_pending is not None and step.statement is not None and step.op != "load" \
                and self.mask_pending[0] in self.softmax_operands(step):
            self.mask_in_place()
        if step.op == "load":
            if step.array in self.buffers or step.array in self.chunk_loaded:
                return  # a streamed operand (the pipeline issued it) or a vector of the chunk (chunk_vectors)
            self.emit(f"// {step.text}")
            self.load(step.array)
            return
        if any(ref[1] in self.smem for ref in step.reads):
            self.wait()
        self.emit(f"// {step.text}")
        # the fragment a step computes or saves, if it is laid out on a staged product's grid
        held = [step.statement.target] if step.statement is not None else []
        held += [name for _, name in step.reads] if step.op == "save" else []
        target = next((name for name in held if name in self.plan.grids), None)
        with self.block("{"):
            if target is not None:
                self.on_grid(step, target)
                return
            getattr(self, f"tc_{step.op}")(step)

    def on_grid(self, step: Step, target: str):
        """A step of a staged product's output (``Mma.staged``), laid out on the product's warp grid:
        the block declares the grid's origin of this warp under the names the fragment loops read
        (``nk_wrow``, ``nk_wcol``), and the step is printed with the plan as the fragment is laid out
        (``TensorPlan.laid_out``). The product itself first stages its A fragment, laid out on the
        plan's rows."""
        mma = self.plan.mmas[target]
        if step.op == "compute" and (step.level, target) not in step.reads:
            self.stage(mma.a, mma.dtype)
        plan = self.plan
        laid = plan.laid_out(target)
        self.emit(f"const int nk_wrow = (nk_warp / {laid.col_warps}) * {laid.warp_rows};  "
                  f"// this warp's first row of {target}'s {laid.row} tile (its own grid)")
        self.emit(f"const int nk_wcol = (nk_warp % {laid.col_warps}) * {laid.warp_cols};  // ... and its first column of {laid.split}")
        self.plan = laid
        assert laid.warps == plan.warps, f"napkin bug: {target}'s grid leaves warps out (isel._staged_grids)"
        try:
            getattr(self, f"tc_{step.op}")(step)
        finally:
            self.plan = plan

    def stage(self, name: str, dtype: str):
        """Fragment ``name`` (the plan's rows by a staged product's rows) written to its shared tile
        (``paths.plan.staged_slot``) as ``dtype`` pairs, between two barriers: every warp has read
        the tile's last contents before any overwrites it, and it is whole before any reads it."""
        assert name not in self.packed, f"napkin bug: staged fragment {name} is packed"
        slot = self.smem[staged_slot(name)]
        col = self.plan.fragments[name].col
        kind = "BF16" if dtype == "bf16" else "F16"
        self.emit(f"NK_SYNC();  // every warp has read {name}'s staged tile before it is overwritten")

        def write():
            pair = offset_expr(slot.tile, *self.fragment_expr(True, col))
            lo, hi = (f"{_var(name)}[mt][nt][{self.value_index(str(e))}]" for e in range(2))
            self.emit(f"{self.dialect.shared_word(f'{slot.offset} + {pair}')} = NK_PACK_{kind}({lo}, {hi});")

        nt = self.plan.cols_per_warp(col, self.tile) // MMA_N
        self.loop("mt", self.plan.m_tiles, lambda: self.loop("nt", nt, lambda: self.loop("h", MMA_C_PAIR.extent("h"), write)))
        self.stage_written()
        self.emit(f"NK_SYNC();  // {name}'s staged tile is whole before any warp reads it")

    def stage_written(self):
        """After a thread's writes of a staged tile, before the barrier that publishes them
        (ldmatrix reads them through the generic proxy: nothing here)."""

    # -- transfers
    def copy_constants(self):
        """Each operand copy's per-thread part: the row and 16-byte unit this thread moves on the
        first pass, their swizzled shared offset and their global offset, computed once. Later
        passes move whole 8-row groups further down, so the swizzle key stays the thread's."""
        self.copies: dict[str, int] = {}
        for name, op in self.plan.operands.items():
            tile = self.smem[name].tile
            units = tile.units_per_row
            if op.indexed or self.threads % units or (self.threads // units) % 8:
                continue
            per = 16 // tile.element_bytes
            self.emit(f"const int nk_cr_{ident(name)} = nk_tid / {units}, nk_cc_{ident(name)} = (nk_tid % {units}) * {per};  // {name}: this thread's copy")
            self.emit(f"const int nk_cs_{ident(name)} = {offset_expr(tile, f'nk_cr_{ident(name)}', f'nk_cc_{ident(name)}')};")
            origins = {a: o for a, o in self.origin.items() if a != self.plan.stream}
            coords = {op.rows: f"nk_cr_{ident(name)}", op.cols: f"nk_cc_{ident(name)}"}
            self.emit(f"const int nk_cg_{ident(name)} = {self.global_offset(name, coords, origins)};")
            self.copies[name] = self.threads // units

    def stride(self, name: str, axis: str) -> int:
        axes = self.diagram.arrays[name].axes
        stride = 1
        for later in axes[axes.index(axis) + 1:]:
            stride *= self.sizes[later]
        return stride

    def load(self, name: str, origin: str | None = None, stage: str | None = None, commit: bool = True):
        """Issue the copy of ``name``'s tile; swizzled operands by cp.async, plain ones directly."""
        slot = self.smem[name]
        if slot.tile is None:
            self.plain_load(name)
            return
        base = f"{slot.offset}" if stage is None else f"{slot.offset} + ({stage}) * {slot.stage_bytes}"
        if self.plan.operands[name].indexed:
            self.gather(name, base, origin)
        elif name in self.copies:
            self.hoisted_copy(name, base, origin)
        else:
            self.general_copy(name, base, origin)
        if commit:
            self.emit("NK_CP_COMMIT();")
        self.pending = True

    def hoisted_copy(self, name: str, base: str, origin: str | None):
        op = self.plan.operands[name]
        tile = self.smem[name].tile
        step_rows = self.copies[name]
        passes = -(-tile.rows // step_rows)
        stream = self.plan.stream
        offset = f"nk_cg_{ident(name)}"
        if origin is not None and stream in self.diagram.arrays[name].axes:
            offset += f" + ({origin}) * {self.stride(name, stream)}"
        row_origin = origin if op.rows == stream else self.origin.get(op.rows)
        col_origin = origin if op.cols == stream else self.origin.get(op.cols)

        def body():
            row = f"nk_cr_{ident(name)} + v * {step_rows}"
            valid = []
            if self.sizes[op.rows] % self.tile[op.rows]:
                valid.append(f"({row_origin + ' + ' if row_origin else ''}{row} < {self.sizes[op.rows]})")
            if self.sizes[op.cols] % self.tile[op.cols]:
                valid.append(f"({col_origin + ' + ' if col_origin else ''}nk_cc_{ident(name)} < {self.sizes[op.cols]})")
            copy = (f"NK_CP16({base} + nk_cs_{ident(name)} + v * {step_rows * tile.pitch}, "
                    f"g_{ident(name)} + {offset} + v * {step_rows * self.stride(name, op.rows)}, {' && '.join(valid) or 1});")
            # Threads past the tile's last row copy nothing (a masked copy would still write zeros).
            self.emit(f"if ({row} < {tile.rows}) {copy}" if tile.rows % step_rows else copy)

        self.loop("v", passes, body)

    def general_copy(self, name: str, base: str, origin: str | None):
        op = self.plan.operands[name]
        tile = self.smem[name].tile
        array = self.diagram.arrays[name]
        units = tile.units_per_row
        count = tile.rows * units
        per = 16 // DTYPE_BYTES[array.dtype]
        origins = dict(self.origin)
        if origin is not None:
            origins[self.plan.stream] = origin

        def body():
            self.emit(f"const int r = u / {units}, c = (u % {units}) * {per};")
            coords = {op.rows: "r", op.cols: "c"}
            valid = []
            for axis, var in coords.items():
                if self.sizes[axis] % self.tile[axis]:
                    start = origins.get(axis)
                    valid.append(f"({start} + {var} < {self.sizes[axis]})" if start else f"({var} < {self.sizes[axis]})")
            index = self.global_offset(name, coords, origins)
            self.emit(f"NK_CP16({base} + {offset_expr(tile, 'r', 'c')}, g_{ident(name)} + ({index}), {' && '.join(valid) or 1});")

        with self.block(f"for (int u = nk_tid; u < {count}; u += {self.threads}) {{"):
            body()

    def gather(self, name: str, base: str, origin: str | None):
        """Fill an implicit GEMM's operand tile (``Operand.indexed``), one sub-tile a tap: 16 bytes
        at a time by cp.async where a unit of a sub-tile's row is 16 contiguous bytes in memory
        (zeros outside the window and past a ragged axis's end), else element by element
        (``Operand.gathered``) with plain stores, the pad value outside the window; the chunk's
        barrier (``chunk``) makes those visible before any warp reads the buffer, as it does a
        landed copy. Each thread takes a unit (row, col) of a sub-tile, columns fastest so that
        neighbouring threads read neighbouring addresses, and copies it for every tap in
        unrolled loops: the taps are constants there, so each one's address and bounds are the
        unit's plus immediates, and its place in shared memory is the unit's swizzled offset plus
        the tap's sub-tile. The loop over units stays rolled: unrolled, ptxas keeps every trip's
        loads in flight and spills (2 KB at 4 chunks of c = 32 for the 3 x 3 convolution of a
        32 x 64 tile)."""
        op = self.plan.operands[name]
        tile = self.smem[name].tile
        array = self.diagram.arrays[name]
        d = self.dialect
        origins = dict(self.origin)
        if origin is not None:
            origins[self.plan.stream] = origin
        wide = (op.rows, op.cols, *op.taps)
        per = 1 if op.gathered else 16 // tile.element_bytes
        pad = literal(array.window.pad if array.window is not None and array.window.pad is not None else 0.0)
        copied_bits = op.gathered and array.dtype in d.bit_copied

        def index_of(axis: str) -> str:
            parts = [p for p in (origins.get(axis), f"i_{ident(axis)}" if axis in wide else None) if p]
            return " + ".join(parts) or "0"

        def unit():
            # a unit past a ragged axis's end lies wholly past it: the axis's size is whole units (isel._gathered)
            inside = [f"{index_of(a)} < {self.sizes[a]}" for a in wide if self.sizes[a] % self.tile[a]]
            if array.window is not None:
                lines, within, flat = self.view_element(name, index_of)
                for line in lines:
                    self.emit(line)
                inside += [within] if within else []
                source = array.window.source
            else:
                flat = self.global_offset(name, {a: f"i_{ident(a)}" for a in wide}, origins)
                source = name
            tap = "0"
            for axis in op.taps:
                tap = f"i_{ident(axis)}" if tap == "0" else f"({tap}) * {self.tile[axis]} + i_{ident(axis)}"
            at = f"nk_gs + ({tap}) * {tile.bytes}"
            valid = f"({') && ('.join(inside)})" if inside else None
            if not op.gathered:  # a unit outside reads nothing: its address is the array's first
                self.emit(f"NK_CP16({at}, g_{ident(source)} + ({f'{valid} ? {flat} : 0' if valid else flat}), {valid or 1});")
                return
            pointer, element = d.shared_pointer(d.storage[array.dtype], "0"), f"({at}) / {tile.element_bytes}"
            if copied_bits:  # the element's bits as they are: no conversion to f32 and back
                value = f"g_{ident(source)}[{flat}]"
                self.emit(f"{pointer}[{element}] = {f'{valid} ? {value} : nk_gather_pad_{ident(name)}' if valid else value};")
                return
            value = d.load(f"g_{ident(source)}", flat, array.dtype)
            self.emit(d.store(pointer, element, f"({valid} ? {value} : {pad})" if valid else value, array.dtype))

        def taps(rest: tuple):
            if not rest:
                unit()
                return
            self.emit("NK_UNROLL")
            with self.block(f"for (int i_{ident(rest[0])} = 0; i_{ident(rest[0])} < {self.tile[rest[0]]}; ++i_{ident(rest[0])}) {{"):
                taps(rest[1:])

        units = self.tile[op.cols] // per
        count = self.tile[op.rows] * units
        with self.block("{"):
            if copied_bits:
                self.emit(f"{d.storage[array.dtype]} nk_gather_pad_{ident(name)};  // the pad value, converted once")
                self.emit(d.store(f"(&nk_gather_pad_{ident(name)})", "0", pad, array.dtype))
            with self.block(f"for (int v = 0; v < {-(-count // self.threads)}; ++v) {{"):
                self.emit(f"const int u = nk_tid + v * {self.threads};")
                if count % self.threads:
                    self.emit(f"if (u >= {count}) break;")
                self.emit(f"const int i_{ident(op.rows)} = u / {units}, i_{ident(op.cols)} = (u % {units}){f' * {per}' if per > 1 else ''};")
                self.emit(f"const int nk_gs = {base} + {offset_expr(tile, f'i_{ident(op.rows)}', f'i_{ident(op.cols)}')};"
                          f"  // the {'element' if per == 1 else 'unit'}'s byte in the first tap's sub-tile")
                taps(op.taps)

    def plain_load(self, name: str, sync: bool = True):
        array = self.diagram.arrays[name]
        slot = self.smem[name]
        d = self.dialect
        count = 1
        for axis in array.axes:
            count *= self.tile[axis]
        single = count <= self.threads  # one value a thread at most: no loop, so a chunk's loop stays innermost
        opening = f"if (nk_tid < {count}) {{" if single else f"for (int u = nk_tid; u < {count}; u += {self.threads}) {{"
        with self.block(opening):
            if single:
                self.emit("const int u = nk_tid;")
            self.emit("int rest = u;")
            coords = {}
            for axis in reversed(array.axes):
                self.emit(f"const int i_{ident(axis)} = rest % {self.tile[axis]}; rest /= {self.tile[axis]};")
                coords[axis] = f"i_{ident(axis)}"
            valid = " && ".join(f"(i_{ident(a)} < {self.extent_expr(a)})" for a in array.axes if self.extent_expr(a) != str(self.tile[a])) or "1"
            value = d.load(f"g_{ident(name)}", self.global_offset(name, coords, self.origin), array.dtype)
            t = d.storage[array.dtype]
            pointer = d.shared_pointer(t, slot.offset)
            self.emit(d.store(pointer, "u", f"(({valid}) ? {value} : 0.0f)", array.dtype))
        if sync:
            self.emit("NK_SYNC();")

    def chunk_vectors(self, node: Loop):
        """Load the plain (unswizzled) tiles the chunk reads, a streamed vector each (the
        backward's L, D and dL over the query chunk), together at the chunk's top behind one
        barrier, rather than each behind its own where the Program first reads it: the chunk's
        top barrier has already said every warp is done with the previous chunk's values."""
        vectors = [s.array for s, _ in walk(node.body) if s.op == "load" and s.level == self.level
                   and s.array not in self.plan.operands and self.smem[s.array].tile is None]
        for name in dict.fromkeys(vectors):
            self.emit(f"// load {name} of this chunk")
            self.plain_load(name, sync=False)
            self.chunk_loaded.add(name)
        if vectors:
            self.emit("NK_SYNC();  // the chunk's vectors are in shared memory for every warp")

    def stream_loop(self, node: Loop):
        """The streamed loop as a ``stages``-deep cp.async pipeline with one barrier a chunk.

        The prologue issues the first ``stages - 1`` chunks, a commit group each. Chunk c waits
        until its own group has landed (at most ``stages - 2`` later ones pending) and passes
        the chunk's one barrier, which also says that every warp is done with chunk c - 1; only
        then does it issue chunk c + stages - 1 into the buffer chunk c - 1 was read from, so
        no second barrier guards the refill. The buffer a chunk reads follows from its index
        (:meth:`buffer_of`), so a masked stream runs as up to three loops, one body each: the
        chunks before the ones its mask holds in full, those (with no mask code), and those
        after (the diagonal), with the copies of the next chunk in flight across them."""
        axis = node.axis
        streamed = [s.array for s, _ in walk(node.body) if s.op == "load" and s.level == self.level
                    and s.array in self.plan.operands]
        chunks = -(-self.sizes[axis] // self.tile[axis])
        stages = self.plan.stages
        tile = self.tile[axis]
        ahead = "chunk c + 1 loads" if stages == 2 else f"chunks c + 1 .. c + {stages - 1} load"
        first, stop = "0", str(chunks)
        exact = True  # every block runs the same number of chunks, known here
        if axis in self.part_origin:
            # A split's part (part_block): its chunks from the part's origin, as many as the part
            # holds; the last part of a ragged axis holds fewer (the trip count is the block's own,
            # so every thread reaches the same barriers). Parts are whole chunks (isel), so the
            # chunk grid is the axis's and only its last chunk is short (set_origin masks it).
            assert node.mask is None, "napkin bug: isel plans a split's parts on tensor cores for unmasked streams only"
            chunks = self.part_tile[axis] // tile
            valid = self.part_valid[axis]
            exact = valid == str(self.part_tile[axis])
            stop = str(chunks) if exact else f"(({valid}) + {tile - 1}) / {tile}"
            self.emit(f"// for {axis} in the {chunks} chunks of {tile} of this block's part (fewer in a short last part), "
                      f"{stages} stages: {ahead} while chunk c computes")
        else:
            self.emit(f"// for {axis} in {chunks} chunks of {tile}, {stages} stages: {ahead} while chunk c computes")
        if node.mask is not None:  # the chunks the mask does not hide in full: bounds per block
            first, stop = self.visited_chunks(node.mask, chunks)
        self.stream_first[axis] = first
        for ahead in range(stages - 1 if streamed else 0):
            guard = f"{first} + {ahead} < {stop}" if ahead or node.mask is not None or chunks <= ahead else None
            # a block that visits fewer chunks loads none past its last
            with self.block(f"if ({guard}) {{") if guard else nullcontext():
                for name in streamed:
                    self.load(name, origin=self.chunk_origin(axis, f"({first} + {ahead})" if first != "0" else str(ahead)),
                              stage=str(ahead), commit=False)
            self.ring_commit()
        self.ring_started()
        if node.mask is None and exact and self.sizes[axis] % tile and chunks > 1 and self.plan.dtype in FP8_DTYPES:
            # A ragged stream on 8-bit operands: the chunks before the last are whole, and run the
            # loop with no bounds test (there a test per element, `col < n_x`, on S and on each
            # key's scale, cost fp8 attention's loop 40% more instructions); the short last chunk
            # runs after it, straight-line, on its buffer, tested per element. Not on 16-bit
            # operands: attention at d = 128 spills so (104 bytes on sm_80 with 16-row warps, 16
            # on sm_90 with 32-row ones), where its one tested loop does not.
            self.whole_chunk_axes.add(axis)
            self.unrolled(node, axis, streamed, first, str(chunks - 1), (chunks - 1) % stages != 0, stop=stop)
            self.whole_chunk_axes.discard(axis)
            last = chunks - 1
            stage = str(last % stages)
            with self.block(f"{{  // the last chunk, short ({self.sizes[axis] - last * tile} of {tile}): tested per element"):
                self.chunk(node, axis, streamed, stop, str(last), False, stage)
        elif node.mask is None:
            self.unrolled(node, axis, streamed, first, stop, chunks % stages != 0 or not exact)
        else:
            lo, hi = self.full_chunks(node.mask, first, stop)
            # Only a mask that bounds x from below (a window's left edge) cuts chunks before the
            # full ones; without one (causal) the full chunks start at the first, and that loop,
            # which would never run, is not printed (its body held registers the full loop's
            # 32-row warps need).
            lower_edge = node.mask.bounds_below
            if lower_edge:
                # the chunks before the full ones are run masked up to a multiple of the stages, so
                # that the full loop starts on buffer 0 and unrolls with constant buffers
                self.emit(f"{lo} = min({first} + ({lo} - {first} + {stages - 1}) / {stages} * {stages}, {hi});")
            if lower_edge:
                self.runtime_loop(node, axis, streamed, first, lo, stop, "before the ones the mask holds in full")
            self.unrolled(node, axis, streamed, lo, hi, True, stop=stop)
            self.runtime_loop(node, axis, streamed, hi, stop, stop, "after them (the diagonal)")
        if streamed:
            # every copy has landed (the last groups are empty) and no warp still reads a buffer
            # that a later copy into the arena (a staged output, another stream) would overwrite
            self.ring_drained()
            self.emit("NK_SYNC();")
            self.pending = False

    # The ring's synchronisation, which a TMA ring (backends/wgmma.py) replaces by mbarriers.
    def ring_commit(self, comment: str = ""):
        """Close the cp.async group of a stage's copies (wait_group counts groups)."""
        self.emit("NK_CP_COMMIT();" + comment)

    def ring_started(self):
        """After the prologue's copies are issued: nothing for cp.async."""

    def ring_landed(self):
        """Before a chunk's barrier: this thread's copies of the chunk have landed."""
        self.emit(f"NK_CP_WAIT({self.plan.stages - 2});  // this chunk's group has landed")
        self.copies_landed()

    def ring_ready(self, stage: str):
        """After the chunk's barrier and the refill of the previous stage: nothing for cp.async,
        whose wait came before the barrier."""

    def ring_drained(self):
        """After the stream: every copy has landed."""
        self.emit("NK_CP_WAIT(0);")

    def chunk_origin(self, axis: str, index: str) -> str:
        """The first index along the streamed ``axis`` of chunk ``index`` (a C expression): from
        0, or from this block's part's origin in a split's parts launch."""
        tile = self.tile[axis]
        part = self.part_origin.get(axis)
        if index.isdigit():
            return f"{int(index) * tile}" if part is None else f"{part} + {int(index) * tile}"
        return f"{index} * {tile}" if part is None else f"{part} + {index} * {tile}"

    def unrolled(self, node: Loop, axis: str, streamed: list, lo: str, hi: str, guarded: bool, stop: str | None = None):
        """Chunks [lo, hi) with no mask test, unrolled by the stages so that each chunk's
        buffer is a constant (lo is on buffer 0): its ldmatrix and cp.async offsets fold into
        immediates. ``stop`` bounds the prefetch (the loop after this one continues it)."""
        x = ident(axis)
        stages = self.plan.stages
        masked = node.mask is not None
        if self.rolled_stream and streamed:
            self.rolled(node, axis, streamed, lo, hi, stop)
            return
        # A masked stream and a TMA ring (plan.tma) keep the loop below at any stage count: the
        # whole-group loop's untested refills and straight-line last chunks are validated for an
        # unmasked cp.async stream only (a 3-stage ring over a masked stream hung on PoCL with
        # them: a wait with no fill; sliding_window's masked cp.async stream ran for minutes).
        if stages > 2 and streamed and not self.tma_ring and not masked:
            self.whole_groups(node, axis, streamed, lo, hi, stop)
            return
        with self.block(f"for (int c_{x} = {lo}; c_{x} < {hi}; c_{x} += {stages}) {{{'  // chunks the mask holds in full: no test' if masked else ''}"):
            for stage in range(stages):
                index = f"(c_{x} + {stage})" if stage else f"c_{x}"
                with self.block(f"{f'if ({index} < {hi}) ' if stage and guarded else ''}{{  // buffer {stage}"):
                    self.chunk(node, axis, streamed, stop or hi, index, masked, str(stage))

    def rolled(self, node: Loop, axis: str, streamed: list, lo: str, hi: str, stop: str | None):
        """:meth:`unrolled` for a plan whose fragments leave ptxas few registers (``plan.rolled``):
        one chunk a trip on a running buffer, the loop kept rolled. Unrolled by the stages, two
        chunks share a basic block, and ptxas overlaps them (the first's row sums after the
        second's products), holding more values than one chunk's: 32-row warps at d = 128 spill
        there and compile without spills here. The buffer's offset is the block's, so ptxas keeps
        it in a uniform register beside the lanes' ldmatrix rows (:meth:`ldsm_offset`)."""
        x = ident(axis)
        masked = node.mask is not None
        self.emit("NK_ROLLED")
        with self.block(f"for (int c_{x} = {lo}; c_{x} < {hi}; ++c_{x}) {{  // one chunk a trip"
                        f"{', the mask holds them in full: no test' if masked else ''}"):
            self.chunk(node, axis, streamed, stop or hi, f"c_{x}", masked, self.buffer_of(axis, f"c_{x}"))

    def whole_groups(self, node: Loop, axis: str, streamed: list, lo: str, hi: str, stop: str | None):
        """:meth:`unrolled` at 3 stages and more: a loop over whole groups of ``stages`` chunks
        whose refills all fall before the prefetch bound, with no test at all (no chunk test,
        no refill test: one basic block; a test per chunk splits the loop and ptxas then
        recomputes its addresses every chunk), then the last chunks, at most
        ``2 stages - 2``, straight after it on buffers 0, 1, ..., each tested (no loop: the hot
        loop is the one loop). Without a mask and with a chunk count known here, the last chunks
        are counted here and only their refills are tested."""
        x = ident(axis)
        stages = self.plan.stages
        masked = node.mask is not None
        bound = stop or hi
        known = hi.isdigit() and lo.isdigit() and bound == hi
        with self.block("{"):
            self.emit(f"int c_{x} = {lo};")
            note = "; the mask holds them in full" if masked else ""
            whole = (f"c_{x} + {2 * stages - 2} < {hi}" if bound == hi
                     else f"c_{x} + {stages - 1} < {hi} && c_{x} + {2 * stages - 2} < {bound}")
            with self.block(f"for (; {whole}; c_{x} += {stages}) {{  // whole groups of {stages} chunks{note}, every refill in range: no test"):
                for stage in range(stages):
                    index = f"(c_{x} + {stage})" if stage else f"c_{x}"
                    with self.block(f"{{  // buffer {stage}"):
                        self.chunk(node, axis, streamed, bound, index, masked, str(stage), refill_guard=False)
            if known:
                count = int(hi) - int(lo)
                groups = max(0, -(-(count - (2 * stages - 2)) // stages))
                last = count - groups * stages
            else:
                last = 2 * stages - 2
            for ahead in range(last):
                index = f"(c_{x} + {ahead})" if ahead else f"c_{x}"
                test = "" if known else f"if ({index} < {hi}) "
                with self.block(f"{test}{{  // the last chunks: buffer {ahead % stages}"):
                    self.chunk(node, axis, streamed, bound, index, masked, str(ahead % stages))

    def runtime_loop(self, node: Loop, axis: str, streamed: list, lo: str, hi: str, stop: str, what: str):
        """Chunks [lo, hi) that the mask cuts, tested per element, one a trip, on the buffer of
        the chunk's index (buffer_of)."""
        x = ident(axis)
        with self.block(f"for (int c_{x} = {lo}; c_{x} < {hi}; ++c_{x}) {{  // chunks the mask cuts, {what}: tested per element"):
            self.chunk(node, axis, streamed, stop, f"c_{x}", False, self.buffer_of(axis, f"c_{x}"))

    def buffer_of(self, axis: str, index: str) -> str:
        """The buffer chunk ``index`` of a loop one chunk a trip reads: (index - first) mod
        stages, from the loop's own index. A running counter instead is one more register live
        through every loop of the stream, which 32-row warps at d = 128 do not have to spare
        (causal attention spilled 144 bytes on sm_80 with it: 60 without)."""
        first, stages = self.stream_first[axis], self.plan.stages
        chunk = index if first == "0" else f"({index} - {first})"
        return f"({chunk} & {stages - 1})" if stages & (stages - 1) == 0 else f"({chunk} % {stages})"

    def chunk(self, node: Loop, axis: str, streamed: list, stop: str, index: str, full: bool, stage: str,
              refill_guard: bool = True):
        stages = self.plan.stages
        x = ident(axis)
        constant = stage.isdigit()
        refill = str((int(stage) + stages - 1) % stages) if constant else f"({stage} + {stages - 1}) % {stages}"
        self.emit(f"const int o_{x} = {self.chunk_origin(axis, index)};")
        if streamed:
            self.ring_landed()
            self.emit("NK_SYNC();  // ... for every thread, and every warp is done with the previous chunk's buffers")
            # refill_guard is False where the caller knows the refill in range
            with self.block(f"if ({index} + {stages - 1} < {stop}) {{") if refill_guard else nullcontext():
                for name in streamed:
                    self.load(name, origin=f"(o_{x} + {(stages - 1) * self.tile[axis]})",
                              stage=refill, commit=False)
            self.ring_commit("  // one group per chunk, empty near the end: wait_group counts them")
            self.ring_ready(stage)
            self.pending = False
        saved_valid = dict(self.valid)
        if axis in self.whole_chunk_axes:  # a whole chunk of a ragged stream: no extent to test
            self.origin[axis] = f"o_{x}"
            self.valid[axis] = str(self.tile[axis])
        else:
            self.set_origin(axis, f"o_{x}")
        self.chunk_steps(node, streamed, stage, full)
        self.valid = saved_valid
        del self.origin[axis]

    def chunk_steps(self, node: Loop, streamed: list, stage: str, full: bool):
        """A chunk's steps, its origin set, its streamed operands read from ``stage``: the mask
        held in full (``full``) or tested, the chunk's vectors, the body; then the chunk's state
        cleared for the next one."""
        self.chunk_begin(node, streamed, stage, full)
        self.nodes(node.body)
        self.chunk_end(streamed)

    def chunk_begin(self, node: Loop, streamed: list, stage: str, full: bool):
        """A chunk's state before its steps (:meth:`chunk_steps`): the mask, the streamed
        operands' stage, the lanes' rows in it, the chunk's vectors."""
        if node.mask is not None and full:
            where = self.mask_where(node.mask)
            if where is not None:
                self.unmasked[where] = None  # held in full: the where's value, untested
        elif node.mask is not None:
            self.mask_pending = self.masked_in_place(node.mask)
        for name in streamed:
            self.buffers[name] = stage
        if not self.keyed_lanes:
            for (name, _, _), lane in self.lanes.items():
                if name in streamed and not stage.isdigit():  # a running buffer joins the lane's row once a chunk
                    self.emit(f"const int nk_lbs{lane} = nk_lb{lane} + {stage} * {self.smem[name].stage_bytes};")
        self.chunk_vectors(node)

    def chunk_end(self, streamed: list):
        """The chunk's state cleared for the next one (:meth:`chunk_steps`)."""
        self.chunk_loaded.clear()
        self.unmasked = {}
        self.mask_pending = None
        self.tops_ready.clear()  # the next chunk's rescale writes them again
        for name in streamed:
            del self.buffers[name]

    def masked_in_place(self, mask) -> tuple | None:
        """(the where, S) when a chunk the mask cuts may test it once, on S's fragment in place
        (S = COND ? S : -inf), the softmax's reads then taking S untested: the softmax's operand
        is where(COND, S, -inf) itself, S a fragment along the streamed axis that no other
        statement reads. Tested where it is read instead, the condition is printed and
        evaluated twice a chunk (the running max's pass and the exponentials'), which made
        causal attention's diagonal loop about a fifth longer. None where that does not hold."""
        where = self.mask_where(mask)
        tested = self.diagram.producer(mask.tested) if mask.tested is not None else None
        if where is None or tested is None or not isinstance(tested.box, Softmax) or tested.box.operand != where:
            return None
        masked = where.args[1]
        if not isinstance(masked, Read) or masked.array not in self.plan.fragments \
                or self.plan.fragments[masked.array].col != mask.axis or masked.array in self.launch.launch.outputs:
            return None
        if [s.target for s in self.diagram.consumers(masked.array)] != [tested.target]:
            return None
        col = self.plan.fragments[masked.array].col
        if any(self.lane_parts(axis, col) is None for constraint in mask.constraints for axis, _ in constraint.coefficients):
            return None
        return where, masked.array, mask

    @staticmethod
    def softmax_operands(step: Step) -> list:
        """The operand of the softmax ``step`` reads (its rescale, online or compute step), if any."""
        box = step.statement.box
        return [box.operand] if isinstance(box, Softmax) else []

    def mask_in_place(self):
        """S = COND ? S : -inf on the fragment, once (masked_in_place); the where then reads S.

        COND is the mask's inequalities, ``sum(k i) >= t`` each (Mask, threshold). An element's
        index along an axis is the lane's part (the block's origin, the warp's first row, the
        lane's digits) plus the unrolled loops' part (mt, nt, i: a constant once unrolled), so
        each inequality is one value a thread holds, ``sum(k lane) - t``, and a test of it
        plus a constant per element. Printed as the where's expression instead, ptxas kept more
        of the indices live: causal attention's 32-row warps spilled on sm_80 so."""
        where, name, mask = self.mask_pending
        self.mask_pending = None
        col = self.plan.fragments[name].col
        self.emit(f"// {name} = where({format_expression(where.args[0])}, {name}, -inf): the chunk's mask, once")
        with self.block("{"):
            tests = []
            for n, constraint in enumerate(mask.constraints):
                lane = " + ".join(f"{k} * ({self.lane_parts(axis, col)[0]})" for axis, k in constraint.coefficients)
                t = self.threshold(constraint)
                written = " + ".join(f"{k}*{axis}" for axis, k in constraint.coefficients)
                self.emit(f"const int nk_edge{n} = {lane} - ({t});  // {written} >= {t}: this lane's part")
                unrolled = " + ".join(f"{k} * ({self.lane_parts(axis, col)[1]})" for axis, k in constraint.coefficients)
                tests.append(f"nk_edge{n} + {unrolled} >= 0")
            condition = " && ".join(f"({test})" for test in tests)
            self.each_element(col, lambda: self.emit(f"{self.element(name, False)} = ({condition}) ? {self.element(name, False)} : -NK_INF;"))
        self.unmasked[where] = None

    def lane_parts(self, axis: str, col: str) -> tuple[str, str] | None:
        """The index along ``axis`` of the fragment element at (mt, nt, lane, i), as its lane's
        part (with the block's origin: the same every trip of the unrolled loops) and the
        unrolled loops' part, C expressions that sum to :meth:`lane_index`'s (the accumulator
        layout is a sum over its digits); None for an axis with no per-lane index here."""
        origin = self.origin.get(axis)
        layout = self.warp_layout(False)
        start = "nk_wcol" if col == self.plan.split else None
        if axis in (self.plan.row, col):
            out = 0 if axis == self.plan.row else 1
            lane = layout.c_expr("0", "0", "nk_lane", "0", given={"g": "nk_g", "t": "nk_t"}, origin=("nk_wrow", start))[out]
            unrolled = layout.c_expr("mt", "nt", "0", "i")[out]
            return (lane if origin is None else f"{origin} + {lane}"), unrolled
        if self.tile[axis] == 1:
            return (origin or "0"), "0"
        return None

    def saved(self, step: Step) -> tuple[str, str, tuple[str, ...], str]:
        """(array in device memory, the fragment saved into it, the array's axes, its dtype): an
        output is its own fragment; a split's part array (``C.acc.part[k# m n]``) takes the
        state the part accumulated (``C.acc``), at the part's place along the part axis (the
        block's origin there, ``part_block``)."""
        name = step.array
        axes, dtype = self.globals[name]
        return name, step.reads[0][1], axes, dtype

    def tc_save(self, step: Step):
        name, held, _, dtype = self.saved(step)
        fragment = self.plan.fragments[held]
        col = fragment.col
        if not step.add and self.save_tile(step) is not None:  # a group's partial sum adds from the fragments
            self.tiled_save(step)
            return
        in_rows = col is None
        if held in self.partial:  # a split's part state: the row's sum over the quad, once
            self.quad_sum(held)
        value = self.element(held, in_rows)
        s = step.statement
        if s is not None and isinstance(s.box, Softmax) and held == f"{s.target}.max" and s.target in self.tops:
            # the running max is kept times c (tc_rescale: log2(e) times a folded scale); the part
            # state is the max of the scaled values, as the FMA path's combine merges it
            value = f"{value} * {LN2!r}f"
        coords = {self.plan.row: self.row_expr(in_rows)}
        if col is not None:
            coords[col] = self.col_expr(col)
        valid = [f"({self.origin.get(a, '0')} + {coords[a]} < {self.sizes[a]})" for a in coords
                 if self.sizes[a] % self.tile[a] or (a in self.origin and a == self.plan.stream)]
        at = self.global_offset(name, coords, self.origin)
        # a group's partial sum (relabel.summed_over_groups) adds into the output the launcher zeroed
        store = self.dialect.atomic_add(f"g_{ident(name)}", at, value) if step.add else self.dialect.store(f"g_{ident(name)}", at, value, dtype)
        self.each_element(col, lambda: self.emit(f"if ({' && '.join(valid)}) {store}" if valid else store))

    def save_tile(self, step: Step) -> SwizzledTile | None:
        """The shared tile an output goes through on its way out, when it can: a (row, col) tile
        whose rows are 16-byte multiples in memory, that fits in the arena, saved after the last
        step that reads shared memory (the arena is free then). Where the block's whole tile does
        not fit (matmul's 128 x 128 f32 C, 64 KiB, in a 48 KiB arena), a pass's: the 16 rows of
        one fragment row (mt) of every warp row, staged and stored ``m_tiles`` times over
        (:meth:`save_passes`)."""
        _, held, axes, dtype = self.saved(step)
        if held in self.plan.grids:  # a staged product's output (on its own grid): stored from its fragments
            return None
        col = self.plan.fragments[held].col
        eb = DTYPE_BYTES[dtype]
        if eb < 2:  # the staging writes a fragment pair as one 16-bit word or two floats: an 8-bit
            return None  # output is stored a value at a time, each converted (saturating) by the dialect
        if col is None or axes[-1] != col or self.sizes[col] % (16 // eb) or col == self.plan.stream:
            return None
        if not SwizzledTile.supports(self.tile[col], eb) or id(step) not in self.free_after:
            return None
        tile = SwizzledTile(self.plan.row_tile, self.tile[col], eb)
        if tile.bytes <= self.arena:
            return tile
        tile = SwizzledTile(self.plan.row_warps * MMA_M, self.tile[col], eb)
        return tile if self.plan.m_tiles > 1 and tile.bytes <= self.arena else None

    def save_passes(self, tile: SwizzledTile) -> int:
        """How many times the staged tile is filled and stored: 1 (the block's whole tile), or
        each fragment row of the warps in turn."""
        return 1 if tile.rows == self.plan.row_tile else self.plan.m_tiles

    def tiled_save(self, step: Step):
        """Fragments -> a swizzled shared tile (4-byte pairs) -> 16-byte coalesced global stores."""
        tile = self.save_tile(step)
        passes = self.save_passes(tile)
        if passes > 1:
            self.emit(f"// staged {tile.rows} rows at a time ({tile.bytes} bytes: the block's tile is over the arena), "
                      f"fragment row mt of every warp row in pass mt")
            self.emit(f"const int nk_prow = (nk_wrow / {self.plan.warp_rows}) * {MMA_M};  // the warp's rows in a pass's tile")
        for p in range(passes):
            self.tiled_save_pass(step, tile, None if passes == 1 else p)

    def tiled_save_pass(self, step: Step, tile: SwizzledTile, mt: int | None):
        """One fill and store of the staged tile: every fragment row (``mt`` None), or fragment
        row ``mt`` of each warp, at row ``nk_prow`` of the tile, then to the block's rows
        ``nk_wrow + mt * 16 ..`` in memory."""
        name, held, _, dtype = self.saved(step)
        col = self.plan.fragments[held].col
        eb = DTYPE_BYTES[dtype]
        d = self.dialect
        self.emit("NK_SYNC();  // the arena is free: the last reader of shared memory is done" if not mt
                  else "NK_SYNC();  // every thread has stored the previous pass")

        def write():
            if mt is None:
                pair = offset_expr(tile, *self.fragment_expr(True, col))
            else:
                start = "nk_wcol" if col == self.plan.split else None
                at = self.warp_layout(True).c_expr("0", "nt", "nk_lane", "h", given={"g": "nk_g", "t": "nk_t"},
                                                   origin=("nk_prow", start))
                pair = offset_expr(tile, *at)
            lo, hi = (f"{_var(held)}[{'mt' if mt is None else mt}][nt][{self.value_index(str(e))}]" for e in range(2))
            if eb == 2:
                packed = f"NK_PACK_{'BF16' if dtype == 'bf16' else 'F16'}({lo}, {hi})"
                self.emit(f"{d.shared_word(pair)} = {packed};")
            else:
                pointer = d.shared_pointer("float", pair)
                self.emit(f"{pointer}[0] = {lo}; {pointer}[1] = {hi};")

        nt = self.plan.cols_per_warp(col, self.tile) // MMA_N
        pairs = lambda: self.loop("nt", nt, lambda: self.loop("h", MMA_C_PAIR.extent("h"), write))  # noqa: E731
        if mt is None:
            self.loop("mt", self.plan.m_tiles, pairs)
        else:
            pairs()
        self.emit("NK_SYNC();  // the staged tile is whole before any thread reads it")
        units = tile.units_per_row
        per = 16 // eb
        with self.block(f"for (int u = nk_tid; u < {tile.rows * units}; u += {self.threads}) {{"):
            self.emit(f"const int r = u / {units}, c = (u % {units}) * {per};")
            row = "r" if mt is None else f"(r / {MMA_M}) * {self.plan.warp_rows} + {mt * MMA_M} + r % {MMA_M}"
            coords = {self.plan.row: row, col: "c"}
            valid = [f"({self.origin.get(a, '0')} + {v} < {self.sizes[a]})" for a, v in coords.items() if self.sizes[a] % self.tile[a]]
            pointer = f"g_{ident(name)} + ({self.global_offset(name, coords, self.origin)})"
            store = f"NK_ST16({pointer}, {offset_expr(tile, 'r', 'c')});"
            self.emit(f"if ({' && '.join(valid)}) {store}" if valid else store)

    # -- computing steps
    def tc_init(self, step: Step):
        s = step.statement
        for _, name in step.writes:
            start = state_start(name, s)
            col = self.plan.fragments[name].col
            self.each_element(col, lambda name=name, col=col, start=start: self.emit(f"{self.element(name, col is None)} = {start};"))

    def tc_compute(self, step: Step):
        s = step.statement
        box = s.box
        target = s.target
        col = self.plan.fragments[target].col
        if isinstance(box, Contract):
            if (step.level, target) in step.reads:  # the scalar factor, in place
                if target in self.folded:
                    self.emit("// folded into the softmax's exp2 argument: one FFMA a value")
                    return
                if target in self.factor_folded:
                    self.emit("// folded into the softmax operand's loop-invariant factor: one multiply a value")
                    return
                scale = self.value(box.scale, col)
                self.each_element(col, lambda: self.emit(f"{self.element(target, col is None)} *= {scale};"))
                return
            self.each_element(col, lambda: self.emit(f"{self.element(target, False)} = 0.0f;"))
            self.mma(target, target)
            return
        if isinstance(box, Map):
            self.each_element(col, lambda: self.emit(f"{self.element(target, col is None)} = {self.value(box.expr, col)};"))
            return
        if isinstance(box, Reduce) and reduction(box.op).combine is None:
            self.unstreamed_lse(target, box.operand)
            return
        if isinstance(box, Reduce):
            reduced = self.reduced_col(box.operand)
            count = 1
            for axis in box.axes:
                count *= self.sizes[axis]
            finish = f"total / {float(count)!r}f" if reduction(box.op).divides else "total"

            def per_row():
                self.row_reduce(box.op, box.operand, reduced, "total")()
                self.emit(f"{self.element(target, True)} = {finish};")

            self.each_element(None, per_row)
            return
        if isinstance(box, Softmax):

            def per_row():
                self.row_reduce("max", box.operand, col, "top")()
                c = self.exponent_scale(box.operand)
                # exp(v - max) = 2^(v c - max c); a fully masked row (max -inf) subtracts 0
                self.emit(f"top = (top == -NK_INF) ? 0.0f : top * {c!r}f;")
                self.exponentials(target, box.operand, col, "top", "total", c)
                # one reciprocal per row; a fully masked row is 0, as in the reference (its total is 0)
                self.emit("const float inv = (total == 0.0f) ? 0.0f : 1.0f / total;")

                def scale():
                    self.emit(f"const int i = {self.value_index('e')};")
                    self.emit(f"{self.element(target, False)} *= inv;")

                self.loop("nt", self.tile[col] // MMA_N, lambda: self.loop("e", MMA_C_VALUE.extent("e"), scale))

            self.each_element(None, per_row)
            return
        raise AssertionError(f"napkin bug: isel planned box {box!r} on the tensor-core path, which has no step for it")

    def unstreamed_lse(self, target: str, operand):
        """``target = log(sum(exp(operand)))`` over a whole row of fragments, in the stable form
        the FMA path and the reference use: the row's max (quad shuffles), then the sum of
        exp(v - max), then max + log(sum); -inf for a row whose every entry is -inf (masked)."""
        col = self.reduced_col(operand)

        def per_row():
            self.row_reduce("max", operand, col, "top")()
            # 2^(v log2 e - max log2 e) as the softmax computes it; a masked row (max -inf) subtracts 0
            self.emit(f"const float shift = (top == -NK_INF) ? 0.0f : top * {LOG2E!r}f;")
            self.exponentials(None, operand, col, "shift", "total", LOG2E)
            log = self.dialect.math("log", ["total"])
            self.emit(f"{self.element(target, True)} = (top == -NK_INF) ? -NK_INF : top + {log};")

        self.each_element(None, per_row)

    def exponentials(self, target: str | None, operand, col: str, top: str, total: str, c: float,
                     quad: bool = True):
        """``target = exp(operand - max)`` along one fragment row (``top`` is max c, c the
        exponent's multiplier: log2(e), times a folded scale), summed into ``total``, across the
        quad unless ``quad`` is False (the thread's own columns); masked columns are 0. One FFMA
        and one MUFU.EX2 each. Without a target (a log-sum-exp) only the sum is kept."""
        self.emit(f"float {total} = 0.0f;")

        def per_element():
            self.emit(f"const int i = {self.value_index('e')};")
            value = f"nk_exp2({self.value(operand, col)} * {c!r}f - {top})"
            valid = self.col_valid(col)
            self.emit(f"const float p = {f'{valid} ? {value} : 0.0f' if valid else value};")
            if target is not None:
                self.emit(f"{self.element(target, False)} = p;")
            self.emit(f"{total} += p;")

        def per_pair():  # a packed target (packed_fragments): the pair's two values, packed, then summed
            kind = self.packed[target]
            self.emit("float p0, p1;")
            for e in range(MMA_C_VALUE.extent("e")):
                with self.block("{"):
                    self.emit(f"const int i = {self.value_index(str(e))};")
                    value = f"nk_exp2({self.value(operand, col)} * {c!r}f - {top})"
                    valid = self.col_valid(col)
                    self.emit(f"p{e} = {f'{valid} ? {value} : 0.0f' if valid else value};")
            self.emit(f"const unsigned pk = NK_PACK_{kind}(p0, p1);")
            self.emit(f"{_var(target)}[mt][nt][h] = pk;")
            self.emit(f"{total} += NK_LO_{kind}(pk) + NK_HI_{kind}(pk);")

        if target is not None and target in self.packed:
            assert MMA_C_VALUE.extent("e") == 2, "napkin bug: an accumulator pair is two values"
            self.loop("nt", self.tile[col] // MMA_N, per_pair)
        else:
            self.loop("nt", self.tile[col] // MMA_N, lambda: self.loop("e", MMA_C_VALUE.extent("e"), per_element))
        if quad:
            for mask in ROW_LANE_MASKS:
                self.emit(f"{total} += NK_SHFL_XOR({total}, {mask});")

    def reduced_col(self, operand) -> str:
        cols = {self.plan.fragments[r.array].col for r in reads(operand) if r.array in self.plan.fragments}
        cols.discard(None)
        assert len(cols) == 1, f"napkin bug: isel plans a row reduction over fragments along {sorted(cols)} (isel._reduction_refusal)"
        return cols.pop()

    def tc_rescale(self, step: Step):
        s = step.statement
        d = self.dialect
        if isinstance(s.box, Softmax):
            col = s.box.axis
            m, scale = f"{s.target}.max", f"{s.target}.scale"

            c = self.exponent_scale(s.box.operand)

            def per_row():
                self.row_reduce("max", s.box.operand, col, "chunk")()
                # the max is kept times c (the log2 domain of the exponent's argument)
                self.emit(f"const float old = {self.element(m, True)};")
                self.emit(f"const float fresh = {d.math('max', ['old', f'chunk * {c!r}f'])};")
                # -inf once per row: a row masked so far shifts by 0, and 2^(-inf - 0) = 0 rescales
                # its (zero) sum and accumulator without a NaN
                self.emit("const float top = (fresh == -NK_INF) ? 0.0f : fresh;")
                self.emit(f"{self.element(scale, True)} = nk_exp2(old - top);")
                self.emit(f"{self.element(m, True)} = fresh;")
                self.emit(f"nk_top_{ident(s.target)}[mt][h] = top;")

            self.each_element(None, per_row)
            self.tops_ready.add(s.target)
            return
        acc = f"{s.target}.acc"
        scale_ref = f"{step.online}.scale"  # the online softmax the Program links it to
        col = self.plan.fragments[acc].col
        self.each_element(col, lambda: self.emit(f"{self.element(acc, False)} *= {self.element(scale_ref, False)};"))

    def quad_sum(self, name: str):
        """A running sum each thread kept over its own columns (``partial``) -> the row's sum,
        across the lanes holding the row (``layouts.ROW_LANE_MASKS``)."""
        self.partial.discard(name)
        self.each_element(None, lambda: [self.emit(f"{self.element(name, True)} += NK_SHFL_XOR({self.element(name, True)}, {mask});")
                                         for mask in ROW_LANE_MASKS])

    def tc_online(self, step: Step):
        s = step.statement
        col = s.box.axis
        m, total, scale = f"{s.target}.max", f"{s.target}.sum", f"{s.target}.scale"

        c = self.exponent_scale(s.box.operand)

        def per_row():
            # exp(v - max) = 2^(v c - max c), the max already times c (tc_rescale), and 0 for a
            # row masked so far: its entries are 2^-inf = 0
            if s.target in self.tops_ready:
                self.emit(f"const float top = nk_top_{ident(s.target)}[mt][h];")
            else:
                self.emit(f"const float top = ({self.element(m, True)} == -NK_INF) ? 0.0f : {self.element(m, True)};")
            self.exponentials(s.target, s.box.operand, col, "top", "part", c, quad=False)
            self.emit(f"{self.element(total, True)} = {self.element(total, True)} * {self.element(scale, True)} + part;")

        self.each_element(None, per_row)
        self.partial.add(total)

    def tc_accumulate(self, step: Step):
        s = step.statement
        box = s.box
        acc = f"{s.target}.acc"
        if isinstance(box, Contract):
            self.mma(s.target, acc)
            return
        entry = reduction(box.op)
        reduced = self.reduced_col(box.operand)

        def per_row():
            self.row_reduce(box.op, box.operand, reduced, "total")()
            current = self.element(acc, True)
            value = self.dialect.math(entry.combine, [current, "total"])
            self.emit(f"{current} = {value};")

        self.each_element(None, per_row)

    def tc_finalise(self, step: Step):
        s = step.statement
        box = s.box
        acc = f"{s.target}.acc"
        col = self.plan.fragments[s.target].col
        in_rows = col is None
        denominators = [f"{step.online}.sum"] if step.online is not None else []  # a rescaled contraction's
        for _, name in step.reads:
            if name in self.partial:  # the thread's own columns' sum: the quad's sum, once, after the stream
                self.quad_sum(name)
        if isinstance(box, Reduce) and reduction(box.op).combine is None:  # the log-sum-exp
            (_, m), (_, total) = step.reads  # L = P.max + log(P.sum), -inf for a fully masked row
            # an online softmax keeps its max times log2(e) (tc_rescale: c times the unscaled
            # values, c = log2(e) times a folded scale): back to base e
            top = self.element(m, in_rows)
            shown = f"{top} * {LN2!r}f" if step.online in self.tops else top
            value = lambda: (f"({top} == -NK_INF) ? -NK_INF : "
                             f"{shown} + {self.dialect.math('log', [self.element(total, in_rows)])}")
            self.each_element(col, lambda: self.emit(f"{self.element(s.target, in_rows)} = {value()};"))
            return
        if isinstance(box, Contract) and denominators:
            # one reciprocal per row; a fully masked row summed nothing: 0, as in the reference (not 0 / 0)
            self.emit(f"float nk_inv{self.dims(denominators[0])};")
            self.each_element(None, lambda: self.emit(
                f"{self.element(denominators[0], True, 'nk_inv')} = "
                f"({self.element(denominators[0], True)} == 0.0f) ? 0.0f : 1.0f / {self.element(denominators[0], True)};"))
            value = lambda: f"{self.element(acc, False)} * {self.element(denominators[0], False, 'nk_inv')}"
        elif isinstance(box, Reduce) and reduction(box.op).divides:
            count = 1
            for axis in box.axes:
                count *= self.sizes[axis]
            value = lambda: f"{self.element(acc, in_rows)} / {float(count)!r}f"
        else:
            value = lambda: self.element(acc, in_rows)
        self.each_element(col, lambda: self.emit(f"{self.element(s.target, in_rows)} = {value()};"))

    # -- mma
    def mma(self, target: str, out: str):
        """``out[row, n] += A[row, k] * B[k, n]`` over the block's k tile, on mma.sync."""
        m = self.plan.mmas[target]
        if m.dtype in FP8_DTYPES:
            return self.mma_fp8(target, out)
        # an ldmatrix.x4 of B covers two n-tiles at one k step (layouts.ldmatrix_b_registers)
        b_registers = ldmatrix_b_registers()
        n_width = MMA_N * len(b_registers)
        mt_count, k_steps, n_pairs = self.plan.m_tiles, self.tile[m.k] // MMA_K, self.plan.cols_per_warp(m.n, self.tile) // n_width
        n_start = "nk_wcol + " if m.n == self.plan.split else ""
        kind = "BF16" if m.dtype == "bf16" else "F16"
        out_var = _var(out)

        def per_k():
            repack = p_to_a_registers()  # per A register, the accumulators (n-tile, c) it packs
            self.emit(f"unsigned a[{mt_count}][{len(repack)}];")
            if m.a_in_registers:
                src = _var(m.a)
                tiles_per_k = MMA_K // MMA_N  # P's accumulator n-tiles per k step of A

                def tile(nt: int) -> str:
                    return f"{tiles_per_k} * kk" + (f" + {nt}" if nt else "")

                def pack():
                    for j, halves in enumerate(repack):
                        if m.a in self.packed:  # packed by the exponentials: a pair (c, c + 1) is one register
                            (nt, c), (nt_hi, c_hi) = halves
                            assert nt == nt_hi and c % 2 == 0 and c_hi == c + 1, "napkin bug: an A register is not one C pair"
                            self.emit(f"a[mt][{j}] = {src}[mt][{tile(nt)}][{c // 2}];")
                            continue
                        lo, hi = (f"{src}[mt][{tile(nt)}][{c}]" for nt, c in halves)
                        self.emit(f"a[mt][{j}] = NK_PACK_{kind}({lo}, {hi});")

                self.loop("mt", mt_count, pack)
            else:
                slot = staged_slot(m.a) if m.staged else m.a
                offset = self.ldsm_offset(slot, "a", m.a_trans, f"(nk_wrow + mt * {MMA_M})", f"(kk * {MMA_K})", tap)
                self.loop("mt", mt_count, lambda: self.emit(f"{'NK_LDSM_T' if m.a_trans else 'NK_LDSM'}(a[mt], {offset});"))

            def per_pair():
                self.emit(f"unsigned b[{LDMATRIX_DELIVERS.extent('j')}];")
                offset = self.ldsm_offset(m.b, "b", m.b_trans, f"({n_start}np * {n_width})", f"(kk * {MMA_K})", tap)
                self.emit(f"{'NK_LDSM_T' if m.b_trans else 'NK_LDSM'}(b, {offset});")

                def per_m():
                    for nt, (b0, b1) in enumerate(b_registers):
                        n_tile = f"{len(b_registers)} * np" + (f" + {nt}" if nt else "")
                        self.emit(f"NK_MMA_{kind}({out_var}[mt][{n_tile}], a[mt], b[{b0}], b[{b1}]);")

                self.loop("mt", mt_count, per_m)

            self.loop("np", n_pairs, per_pair)

        taps = math.prod(self.tile[a] for a in m.taps)
        tap = "tp" if taps > 1 else None
        # an implicit GEMM: the k steps over each tap's sub-tiles in turn (Operand.taps)
        with self.block(f"for (int tp = 0; tp < {taps}; ++tp) {{  // the taps: {' '.join(m.taps)}") if tap else nullcontext():
            self.loop("kk", k_steps, per_k)

    def lane_constants(self):
        """Each ldmatrix site's per-lane row offset and swizzle key, computed once per thread."""
        self.lanes: dict = {}
        for m in self.plan.mmas.values():
            if m.dtype in FP8_DTYPES and m.b_trans:
                self.gather_constants(m.b, m.a_in_registers)  # mma_fp8: byte loads, no ldmatrix site
            sites = ([] if m.dtype in FP8_DTYPES and m.b_trans else [(m.b, "b", m.b_trans)])
            sites += [] if m.a_in_registers else [(staged_slot(m.a) if m.staged else m.a, "a", m.a_trans)]
            for site in sites:
                if site in self.lanes:
                    continue
                name, operand, trans = site
                base, x = ldmatrix_lane_terms(self.ldsm_tile(name), operand, trans, "nk_lane")
                index = len(self.lanes)
                if self.keyed_lanes:
                    self.emit(f"const int nk_lb{index} = {ldmatrix_keyed_lane_expr(base, x)};  // {name}: this lane's ldmatrix row and swizzle key")
                else:
                    self.emit(f"const int nk_lb{index} = {base};  // {name}: this lane's ldmatrix row")
                    self.emit(f"const int nk_lx{index} = {x};  // ... and its swizzle key")
                self.lanes[site] = index

    @property
    def keyed_lanes(self) -> bool:
        """Whether a lane's ldmatrix constant holds its swizzle key too (one register a site,
        layouts.ldmatrix_keyed_offset_expr) or beside it (two). ptxas allocates the two forms
        differently, and each is the one measured without spills where it is used: the keyed form
        for a rolled plan (attention's 32-row warps at d = 128 spill 72 bytes on sm_80 without it),
        the separate key elsewhere (fp8 attention's 16-row warps at d = 128 on sm_89 spill 8 bytes
        with the keyed form, at 255 registers)."""
        return self.rolled_stream

    @property
    def rolled_stream(self) -> bool:
        """Whether the stream loop runs one chunk a trip (``MmaSyncPlan.rolled``)."""
        return self.plan.rolled

    @property
    def tma_ring(self) -> bool:
        """Whether the streamed operands fill a TMA ring (the wgmma printer's); cp.async here."""
        return False

    def ldsm_offset(self, name: str, operand: str, trans: bool, outer: str, k: str, tap: str | None = None) -> str:
        """Byte offset of this lane's ldmatrix row for the fragment at (outer, k): m or n, and k,
        in the sub-tile of ``tap`` (an implicit GEMM's: a multiple of the swizzled tile's bytes,
        which keeps the swizzle's period).

        Stored rows are k when ``trans``; the lane's share was computed once (lane_constants)."""
        slot = self.smem[name]
        tile = self.ldsm_tile(name)
        if tap is not None:
            slot = replace(slot, offset=f"{slot.offset} + ({tap}) * {slot.tile.bytes}")
        index = self.lanes[(name, operand, trans)]
        row0, col0 = (k, outer) if trans else (outer, k)
        u0 = f"((({col0}) * {tile.element_bytes}) >> 4)"
        stage = self.buffers.get(name)
        if not self.keyed_lanes:
            # a running buffer is in the lane's row already (chunk(): nk_lbs); a constant one is an immediate
            lane = f"nk_lbs{index}" if stage is not None and not stage.isdigit() else f"nk_lb{index}"
            offset = ldmatrix_offset_expr(tile, row0, u0, lane, f"nk_lx{index}")
            base = f"{slot.offset} + ({stage}) * {slot.stage_bytes}" if stage is not None and stage.isdigit() else f"{slot.offset}"
            return f"{base} + {offset}"
        # the buffer adds after the lane's XOR (a multiple of 128 bytes): an immediate, or a
        # running buffer's offset, the same for the block (ptxas keeps it in a uniform register)
        offset = ldmatrix_keyed_offset_expr(tile, row0, u0, f"nk_lb{index}")
        base = f"{slot.offset} + ({stage}) * {slot.stage_bytes}" if stage is not None else f"{slot.offset}"
        return f"{base} + {offset}"

    # -- mma.sync m16n8k32 (e4m3 / e5m2)
    def ldsm_tile(self, name: str) -> SwizzledTile:
        """The tile ldmatrix reads: an fp8 tile as the 16-bit pairs of the same bytes (same pitch
        and swizzle), whose 16-bit fragment is m16n8k32's 8-bit one (layouts.fp8_fragment_is_b16_bytes)."""
        tile = self.smem[name].tile
        return SwizzledTile(tile.rows, tile.cols // 2, 2) if tile.element_bytes == 1 else tile

    def mma_fp8(self, target: str, out: str):
        """``out[row, n] += A[row, k] * B[k, n]`` over the k tile on ``mma.sync.m16n8k32`` with
        e4m3/e5m2 operands and f32 accumulators (the accumulator fragment is m16n8k16's).

        A (k fastest) comes by ldmatrix, as does a B whose fastest axis is k ([n k]: attention's
        K): read as 16-bit pairs, their bytes are the 8-bit fragments. A B whose fastest axis is n
        ([k n]: matmul's B) cannot: ldmatrix .trans transposes 16-bit values (8-bit .trans needs
        sm_100), and the .col B fragment holds 4 consecutive k of one column in a register. Each
        lane gathers its 8 bytes (layouts.MMA_B8, PACK8) from the swizzled tile with byte loads
        instead: 16 an n-pair and k step, shared by the warp's m-tiles. A transposing copy into a
        second shared tile would need its own barrier and bytes in the cp.async pipeline, which
        the byte loads leave as the bf16 path has it."""
        m = self.plan.mmas[target]
        kind = "E4M3" if m.dtype == "fp8e4m3" else "E5M2"
        b_registers = ldmatrix_b_registers()
        n_width = MMA_N * len(b_registers)  # two n-tiles per ldmatrix.x4 of B, or per gather
        mt_count, k_steps = self.plan.m_tiles, self.tile[m.k] // MMA_K8
        n_pairs = self.plan.cols_per_warp(m.n, self.tile) // n_width
        n_start = "nk_wcol + " if m.n == self.plan.split else ""
        out_var = _var(out)
        half_k = MMA_K8 // 2  # k per step in 16-bit pairs (ldsm_tile)

        def per_k():
            self.emit(f"unsigned a[{mt_count}][{MMA_A8.extent('i') // 4}];")
            if m.a_in_registers:
                # P, in f32 accumulator fragments, packed to bytes in the key order of
                # layouts.KEY_ORDER8 (each A register: two accumulator pairs of the lane's own);
                # V's rows are gathered in the same order (gather_constants): the same sum
                src = _var(m.a)
                tiles_per_k = MMA_K8 // MMA_N

                def value(nt, c):
                    return f"{src}[mt][{tiles_per_k} * kk" + (f" + {nt}" if nt else "") + f"][{c}]"

                def pack():
                    if not m.b_trans:  # V by ldmatrix, in the ISA's key order: P's bytes exchanged to it
                        self.exchange_p8(value, lambda j: f"a[mt][{j}]", kind)
                        return
                    for j, values in enumerate(p_to_a8_registers()):
                        self.emit(f"a[mt][{j}] = NK_PACK_{kind}({', '.join(value(nt, c) for nt, c in values)});")

                self.loop("mt", mt_count, pack)
            else:
                offset = self.ldsm_offset(m.a, "a", False, f"(nk_wrow + mt * {MMA_M})", f"(kk * {half_k})")
                self.loop("mt", mt_count, lambda: self.emit(f"NK_LDSM(a[mt], {offset});"))

            def per_pair():
                self.emit(f"unsigned b[{LDMATRIX_DELIVERS.extent('j')}];")
                if m.b_trans:
                    pairs = []
                    n0 = f"({n_start}np * {n_width})"  # a multiple of 16 bytes: the pair's unit
                    for nt in range(len(b_registers)):
                        regs = []
                        for r in range(MMA_B8.extent("i") // 4):
                            self.emit(f"b[{len(b_registers) * nt + r}] = {self.gather_b8(m.b, n0, r, nt * MMA_N)};")
                            regs.append(len(b_registers) * nt + r)
                        pairs.append(tuple(regs))
                else:
                    offset = self.ldsm_offset(m.b, "b", False, f"({n_start}np * {n_width})", f"(kk * {half_k})")
                    self.emit(f"NK_LDSM(b, {offset});")
                    pairs = b_registers

                def per_m():
                    for nt, (b0, b1) in enumerate(pairs):
                        n_tile = f"{len(pairs)} * np" + (f" + {nt}" if nt else "")
                        self.emit(f"NK_MMA_{kind}({out_var}[mt][{n_tile}], a[mt], b[{b0}], b[{b1}]);")

                self.loop("mt", mt_count, per_m)

            self.loop("np", n_pairs, per_pair)

        self.loop("kk", k_steps, per_k)

    def exchange_p8(self, value, dest, kind: str):
        """P's accumulators (``value(n-tile, c)``: the C expression of the lane's value c of
        n-tile nt of the 32-key step) -> the 8-bit A fragment in the ISA's own key order, for a B
        read as stored (ldmatrix of a k-fastest V; wgmma's K-major descriptor): each lane packs
        its pairs into words (``layouts.p_words8``), and register j (``dest(j)``) is the 16-bit
        halves of word j of two lanes of its quad (``layouts.QUAD_SOURCE``, ``QUAD_HALF``): two
        shuffles and a byte permute a register, where KEY_ORDER8's byte gather needs none."""
        words = p_words8()
        low, high = (QUAD_SOURCE.c_expr("nk_lane", str(e)) for e in (0, 1))
        # prmt's selector: bytes 0, 1 of both words (0x5410) or bytes 2, 3 (0x7632)
        self.emit(f"const int nk_qlo = {low}, nk_qhi = {high};  // the quad's lanes holding this lane's keys 4t, 4t + 2")
        self.emit(f"const unsigned nk_qsel = 0x5410u + 0x2222u * {QUAD_HALF.c_expr('nk_lane')};  // ... in this half of their words")
        for j, values in enumerate(words):
            self.emit(f"const unsigned nk_w{j} = NK_PACK_{kind}({', '.join(value(nt, c) for nt, c in values)});")
        for j in range(len(words)):
            self.emit(f"{dest(j)} = NK_PRMT(NK_SHFL_IDX_U(nk_w{j}, nk_qlo), NK_SHFL_IDX_U(nk_w{j}, nk_qhi), nk_qsel);")

    def gather_constants(self, name: str, key_order: bool = False):
        """Per lane, what its B bytes' offsets share in every k step and n-pair: for byte e of a
        register, the row of its k (layouts.MMA_B8: 4t + e; through layouts.KEY_ORDER8 where P
        is the A operand) times the pitch plus its column g (``nk_g<B>_q{e}``), and that row's
        swizzle key (``nk_g<B>_k{e}``). A k step moves the row by a multiple of 16, which leaves
        each key as it is (asserted on the tile) and, through KEY_ORDER8, adds the same 16."""
        if name in getattr(self, "gathered", {}):
            return
        self.gathered = {**getattr(self, "gathered", {}), name: key_order}
        tile = self.smem[name].tile
        assert all(tile.key(16 * step + x) == tile.key(x) for step in range(tile.rows // 16 + 1) for x in range(16)), \
            "napkin bug: a k step of 16 rows changes the swizzle key"
        fragment = compose(KEY_ORDER8_KN, MMA_B8) if key_order else MMA_B8
        assert all(fragment(lane, i + 4)[0] == fragment(lane, i)[0] + 16 for lane in range(32) for i in range(4))
        s = tile.layout.swizzle
        g = f"nk_g{ident(name)}"
        for byte in range(4):
            k, n = fragment.c_expr("nk_lane", str(byte))
            self.emit(f"const int {g}_q{byte} = ({k}) * {tile.pitch} + ({n});  // {name}: this lane's byte {byte} (its k row, n g)")
            self.emit(f"const int {g}_k{byte} = ((({k}) >> {s.shift}) & {(1 << s.bits) - 1});  // ... its row's swizzle key")

    def gather_b8(self, name: str, n0: str, register: int, nt_offset: int = 0) -> str:
        """Register ``register`` of this lane's m16n8k32 B fragment at k step ``kk`` and n-tile
        origin ``n0`` + ``nt_offset`` (``n0`` a multiple of 16: the unit of its 16 bytes), from
        B's [k n] tile: its 4 bytes (layouts.MMA_B8: k 4t + byte, + 16 in register 1; n g), each
        at its swizzled offset (SwizzledTile: row * pitch + ((unit ^ key) << 4) + byte in unit),
        packed low byte first (layouts.PACK8)."""
        slot = self.smem[name]
        tile = slot.tile
        stage = self.buffers.get(name)
        base = f"{slot.offset}" if stage is None else f"{slot.offset} + ({stage}) * {slot.stage_bytes}"
        parts = []
        for byte in range(4):
            i = 4 * register + byte
            assert PACK8(i) == (register, byte) and MMA_B8(0, i)[0] == MMA_B8(0, byte)[0] + 16 * register
            unit = f"(({n0}) >> 4)"
            g = f"nk_g{ident(name)}"
            offset = (f"(kk * {MMA_K8} + {16 * register}) * {tile.pitch} + {g}_q{byte} + "
                      f"(({unit} ^ {g}_k{byte}) << 4) + {nt_offset}")
            parts.append(f"((unsigned)nk_smem[{base} + {offset}] << {8 * byte})")
        return "(" + " | ".join(parts) + ")"


def _factors(expr) -> list:
    """The factors of a product (a chain of ``mul``), or ``[expr]``."""
    if isinstance(expr, Apply) and expr.fn == "mul":
        return [f for a in expr.args for f in _factors(a)]
    return [expr]


def _product(factors: list):
    """The left-nested product of ``factors`` (one of them: itself)."""
    out = factors[0]
    for f in factors[1:]:
        out = Apply("mul", (out, f))
    return out
