"""The wgmma lowering (sm_90a): a launch with a :class:`~napkin_dsl.paths.wgmma.WgmmaPlan` -> a kernel.

Contractions ``out[row, n] (+)= A[row, k] B[k, n]``: one a launch (matmul's), several followed
by elementwise maps of their accumulators (mlp's bias and GELU; swiglu's G and U, which share X's
tiles, then silu(G) * U), or an online softmax's two (attention's S = Q K^T and O += P V), on
``wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}`` (PTX ISA 9.7.15, "Asynchronous Warpgroup
Level Matrix Multiply-Accumulate"):

* the block's 64 to 256 rows are 1 to 4 warpgroups of four warps; the accumulator is the
  instruction's D fragment (``layouts.wgmma_d``), which gives warp w of a group rows 16w..16w+15
  as mma.sync's C fragments of its N/8 n-tiles in order, so the tensor-core printer's loops over
  fragment elements (init, finalise, the epilogue to global memory with its ragged-tail masks)
  serve unchanged;
* A and B are shared-memory tiles in the canonical swizzled layouts (``layouts.CanonicalTile``:
  K-major for an operand whose fastest axis is k, MN-major, the instruction's transpose
  immediate set, for one whose fastest axis is m or n), written 16 bytes at a time by
  ``cp.async`` behind the same double-buffered pipeline as the mma.sync path, and read by the
  tensor cores through 64-bit matrix descriptors (``layouts.MatrixDescriptor``);
* A from registers (attention's P; P and dS of its backward, ``Mma.a_in_registers``), each
  product's an array of its own (``a_registers``): the ``d, a, b-desc, ...`` form, A
  four .b32 registers of 16-bit pairs. Its register fragment (``layouts.wgmma_a``) is, per warp,
  mma.sync's m16n8k16 A fragment of the warp's 16 rows, so the D fragment of S packs into it with
  no lane crossing (``layouts.p_to_a_registers``), every k step's registers packed before the
  ``wgmma.fence``; the softmax and the other steps run on the D fragments as the mma.sync printer
  runs them on C fragments (the quad shuffles included);
* a product with rows of its own (``Mma.staged``: the backward's dQ = dS^T K in the launch
  grouped over the keys) is computed as its transpose (``TensorPlan.swapped``): dQ^T = K^T dS^T,
  its n axis (d) on the warpgroups' rows, A' = K by descriptor at the warpgroup's 64 rows of d,
  B' = dS written by every thread to a canonical tile of its own (:meth:`WgmmaPrinter.stage_written`,
  fenced for the async proxy before the barrier that publishes it) by descriptor, MN-major;
* every chunk, each thread between its ``cp.async.wait_group`` and the barrier:
  ``fence.proxy.async`` (its copies, written through the generic proxy, are seen by the async
  proxy wgmma reads through); every product: ``wgmma.fence`` (the accumulator and A registers were
  written by other instructions), one wgmma per 16 values of k, ``wgmma.commit_group`` and
  ``wgmma.wait_group 0`` before anything reads the accumulator (the softmax reads S, the next
  chunk rescales O) or the stage is refilled; in a two-product launch the accumulator and A
  registers are then pinned (``NK_WG_PIN_F``/``_R``: an empty asm that reads and writes each), so
  the compiler neither reads them before the wait nor reuses P's registers while wgmma may read
  them.
* the 8-bit shape (``m64nNk32 .e4m3/.e5m2``, fp8 attention): P's register A fragment holds 4
  consecutive keys a register where the D fragment holds pairs, and V, by descriptor, is read in
  the ISA's key order, so P's bytes are exchanged within each quad (``register_a8``:
  ``layouts.p_words8``, ``QUAD_SOURCE``, ``QUAD_HALF``; two shuffles and a byte permute a
  register). The shape has no transpose: a V stored ``[.. x d]`` is copied each chunk into a
  K-major tile of its own (``transpose``, ``isel.kmajor_name``), fenced for the async proxy
  and published by a barrier before the products read it.
* where the plan has TMA copies (``plan.tma``, ``paths.wgmma.tma_loads``), every shared-memory operand
  comes instead by ``cp.async.bulk.tensor.<rank>d`` (PTX ISA 9.7.9.25; rank 2 to 5, the
  coordinates innermost first: attention's K and V ``[b h x d]`` by rank-4 maps whose box is one
  (b, h) and one chunk of keys, gqa's Q ``[b kv r q d]`` by a rank-5 map), one box per atom column
  of the canonical tile (``CanonicalTile.tma_boxes``: the tensor map's swizzle span is the atom's
  width, so TMA writes the bytes the descriptor's swizzle reads), issued by thread 0. The
  streamed operands fill an s-stage ring whose stages each have an mbarrier (``mbarrier.init``
  count 1, one ``mbarrier.arrive.expect_tx`` of the stage's bytes, the copies' ``complete_tx``);
  the ring is ``TensorPrinter.stream_loop`` (its masked loops for causal and windowed attention
  included) with its synchronisation hooks on mbarriers: a chunk passes the block barrier, thread
  0 refills the previous chunk's stage, every thread waits with ``mbarrier.try_wait.parity`` on
  its own stage, the parity bit s of ``nk_phase_<x>``, flipped at each wait, so that chunks a mask
  skips (neither filled nor waited for) keep every stage's phase. An operand that is not streamed
  (attention's Q) is one copy before the stream on its own mbarrier, waited for at phase 0 once
  the ring's first stages are in flight. Ragged tails are the map's out-of-bounds zero fill. The
  tensor maps are ``const __grid_constant__ CUtensorMap`` parameters after the scalars, one per
  TMA operand in ``plan.tma`` order, that the host encodes from :func:`tensor_maps`
  (``driver.encode_tiled``). TMA and wgmma both go through the async proxy: no
  ``fence.proxy.async`` in that loop.

OpenCL prints the same kernel; its prelude emulates wgmma per work-item by decoding the
descriptors' bit fields and the canonical layouts' address swizzle as the PTX ISA defines them,
the TMA copy by decoding the tensor map's words at its rank (the box dense innermost first, then
swizzled, zeros out of bounds) and the mbarriers' phases,
and A from registers by the ISA's register fragment (each work-item reads A(row, k) from the lane,
register and half the ISA names, through the warp's scratch), written here apart from
``layouts.py``'s encoder and the printer's packing, so that a CPU run through PoCL checks the
encoding.

Deliberately not here: choosing the path (``isel.py``), a reduction before a contraction in a
wgmma launch, wgmma left in flight across steps (the softmax of one chunk under the products
of the next), clusters and TMA multicast, TMA stores, pingpong; the warp-specialized schedule
(a producer warpgroup, consumers' "empty" mbarriers, ``setmaxnreg``: ``pipeline.py``, which
extends this printer, for the plans ``paths.wgmma.roles_of`` takes; here thread 0 of the
consumers issues the copies, behind the chunk's block barrier); the mma.sync printer
(``tensorcore.py``), whose node walk, pipeline, copies, masks, softmax and epilogue this printer
inherits.
"""

from __future__ import annotations

from dataclasses import replace

from ..dtypes import FP8_DTYPES
from ..isel import MBARRIER_BYTES, kmajor_name, mbarrier_count
from ..paths.plan import staged_slot
from ..paths.wgmma import TmaLoad, WgmmaPlan
from ..layouts import MMA_A8, MMA_N, WARPGROUP_THREADS, WGMMA_K, WGMMA_K8, WGMMA_M, descriptor, p_to_a_registers, transpose_split, wgmma_k
from .driver import TiledTensorMap, tiled_tensor_map
from .lowering import KernelSource, ident
from .tensorcore import TensorPrinter


_CUDA_HEAD = r"""
// ---- wgmma primitives (PTX ISA 9.7.15: wgmma.mma_async, wgmma.fence, commit_group, wait_group;
// 9.7.12.15 membar/fence: fence.proxy.async) ----
// A descriptor's constant fields (leading and stride byte offsets, swizzle mode) with its start
// address: matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4 in bits 0-13. The arena's base is
// encoded once (NK_DESC_BASE); a tile's address is base + off, both multiples of 16 and inside the
// shared window (under 2^18 bytes), so its field is the base's plus off >> 4 with no carry out of
// bit 13: one 64-bit add of a constant a descriptor, which ptxas folds into the stage's offsets.
#define NK_DESC_BASE() const unsigned long long nk_dbase = (unsigned long long)((nk_sbase & 0x3FFFFu) >> 4)
#define NK_DESC(fields, off) ((unsigned long long)(fields) + nk_dbase + (unsigned long long)((unsigned)(off) >> 4))
#define NK_FENCE_PROXY_ASYNC() asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory")
#define NK_WG_FENCE() asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory")
#define NK_WG_COMMIT() asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory")
#define NK_WG_WAIT(n) asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(n) : "memory")
// A register the asynchronous product reads or writes, pinned after its wait: the compiler may
// neither read an accumulator before the product has landed nor reuse an A register while the
// tensor cores may still read it (it does not know the asm is asynchronous).
#define NK_WG_PIN_F(x) asm volatile("" : "+f"(x) :: "memory")
#define NK_WG_PIN_R(x) asm volatile("" : "+r"(x) :: "memory")
"""

_OPENCL_HEAD = r"""
/* ---- wgmma emulated per work-item (PTX ISA 9.7.15), written from the ISA apart from napkin's
   encoder: the descriptor's fields are decoded from their bits, each element's byte address is
   formed from the canonical layout's strides and then swizzled as the swizzle mode says. */
#define NK_DESC_BASE()
#define NK_DESC(fields, off) ((ulong)(fields) | (ulong)((((uint)(off)) & 0x3FFFFu) >> 4))
#define NK_FENCE_PROXY_ASYNC()
#define NK_WG_FENCE()
#define NK_WG_COMMIT()
#define NK_WG_WAIT(n)
#define NK_WG_PIN_F(x)
#define NK_WG_PIN_R(x)
/* The byte address of element (mn, k) of an operand read through descriptor `desc` (PTX ISA
   9.7.15.5.1.2: "Shared Memory Matrix Layout", "Strides", "Matrix Descriptor Format"). K-major:
   8-row groups of the M/N dimension `stride` bytes apart, rows `width` bytes apart in a group,
   k contiguous within the swizzle atom. MN-major: atoms of `width` bytes of M/N `leading` bytes
   apart, 8-row groups of k `stride` bytes apart, rows of k `width` bytes apart. Then bits
   [4, 4 + b) of the address are XORed with bits [7, 7 + b), b = log2(width / 16). A mode napkin
   does not lay out (no swizzle) or a nonzero base offset gives -1. */
inline int nk_wgmma_addr(ulong desc, int mn_major, int mn, int k, int eb) {
    const int start = (int)((desc & 0x3FFFul) << 4);
    const int leading = (int)(((desc >> 16) & 0x3FFFul) << 4);
    const int stride = (int)(((desc >> 32) & 0x3FFFul) << 4);
    const int base_offset = (int)((desc >> 49) & 0x7ul);
    const int mode = (int)((desc >> 62) & 0x3ul);
    const int width = mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 0;
    if (width == 0 || base_offset != 0) return -1;
    int addr;
    if (mn_major) {
        addr = start + ((mn * eb) / width) * leading + (k / 8) * stride + (k % 8) * width + (mn * eb) % width;
    } else {
        addr = start + (mn / 8) * stride + (mn % 8) * width + k * eb;
    }
    const int bits = width == 128 ? 7 : width == 64 ? 3 : 1;
    return addr ^ (((addr >> 7) & bits) << 4);
}
/* An 8-bit operand's value, decoded from the formats' definitions (OCP 8-bit floating point,
   the PTX ISA's .e4m3 and .e5m2): sign, exponent (bias 7 or 15), mantissa (3 or 2 bits); an
   exponent field of zero is subnormal; e5m2's all-ones exponent is infinity or NaN, e4m3's only
   NaN is S.1111.111 (it has no infinity). */
inline float nk_wg_fp8(uint c, int e5m2) {
    const int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    const uint field = (c >> mbits) & (e5m2 ? 31u : 15u), man = c & ((1u << mbits) - 1u);
    const float sign = (c & 0x80u) ? -1.0f : 1.0f;
    if (e5m2 && field == 31u) return man ? NAN : sign * INFINITY;
    if (!e5m2 && field == 15u && man == 7u) return NAN;
    if (field == 0u) return sign * ldexp((float)man, 1 - bias - mbits);
    return sign * ldexp((float)(man | (1u << mbits)), (int)field - bias - mbits);
}
/* D += A B for one thread of the warpgroup: its value v is row 16 * (warp % 4) + groupID (+ 8 for
   v % 4 in 2, 3), column 8 * (v / 4) + 2 * threadID_in_group + v % 2 (PTX ISA 9.7.15.5.1.1.1,
   the accumulator D figure, which depends on M and N only). A is 64 x K (rows x k), B is K x n
   (k x cols), of operand type `kind`: 0 bf16, 1 f16 (K = 16, .m64nNk16), 2 e4m3, 3 e5m2 (K = 32
   bytes of k a row, .m64nNk32, whose operands are K-major: no transpose). */
inline void nk_wgmma_k(float* d, ulong da, ulong db, int n, int trans_a, int trans_b, int kind,
                       __local const uchar* smem, int thread) {
    const int warp = thread / 32, lane = thread % 32, group = lane / 4, tig = lane % 4;
    const int eight = kind >= 2, depth = eight ? 32 : 16, eb = eight ? 1 : 2;
    for (int v = 0; v < n / 2; ++v) {
        const int row = 16 * (warp % 4) + group + 8 * ((v / 2) % 2);
        const int col = 8 * (v / 4) + 2 * tig + v % 2;
        float acc = d[v];
        for (int k = 0; k < depth; ++k) {
            const int a = nk_wgmma_addr(da, trans_a, row, k, eb);
            const int b = nk_wgmma_addr(db, trans_b, col, k, eb);
            if (a < 0 || b < 0) { acc = NAN; continue; }
            acc += eight ? nk_wg_fp8(smem[a], kind == 3) * nk_wg_fp8(smem[b], kind == 3)
                         : nk_b16f(nk_lds16(smem, a), kind) * nk_b16f(nk_lds16(smem, b), kind);
        }
        d[v] = acc;
    }
}
/* .m64nNk16 with bf16 (f16 = 0) or f16 operands */
inline void nk_wgmma(float* d, ulong da, ulong db, int n, int trans_a, int trans_b, int f16,
                     __local const uchar* smem, int thread) {
    nk_wgmma_k(d, da, db, n, trans_a, trans_b, f16, smem, thread);
}
/* .m64nNk32 with e4m3 (e5m2 = 0) or e5m2 operands, both K-major */
inline void nk_wgmma8(float* d, ulong da, ulong db, int n, int e5m2, __local const uchar* smem, int thread) {
    nk_wgmma_k(d, da, db, n, 0, 0, 2 + e5m2, smem, thread);
}
/* D += A B with A from registers. The register fragment of matrix A (PTX ISA 9.7.15.5.1.1):
   .m64nNk16 .f16/.bf16 (Figure 148): a thread's a0..a7, two 16-bit values in each of its four
   .b32 registers, low half first, are row 16 * (warp % 4) + groupID (+ 8 for a2, a3, a6, a7),
   column 2 * threadID_in_group + i % 2 (+ 8 for a4..a7) of the 64 x 16 A; .m64nNk32 .e4m3/.e5m2:
   a0..a15, four to a register, lowest byte first, are row 16 * (warp % 4) + groupID (+ 8 for
   a4..a7, a12..a15), column 4 * threadID_in_group + i % 4 (+ 16 for a8..a15) of the 64 x 32 A.
   With p values a register (2 or 4) both are: column p * threadID_in_group + i % p (+ 4p for i
   >= 2p), row + 8 for (i / p) odd. A row's values are its warp's, so the warp's lanes post their
   registers to the warp's scratch and each reads the lane and element holding A(row, k) by the
   inverse of that map. B is K x n (k x cols) by descriptor, of operand type `kind` as nk_wgmma_k's
   (the 8-bit types K-major only). */
inline void nk_wgmma_rs_words(float* d, __local const uint* ws, ulong db, int n, int trans_b, int kind,
                              __local const uchar* smem, int thread);
inline void nk_wgmma_rs_k(float* d, const uint a[4], ulong db, int n, int trans_b, int kind,
                          __local const uchar* smem, __local uint* ws, int thread) {
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int j = 0; j < 4; ++j) ws[4 * (thread % 32) + j] = a[j];
    barrier(CLK_LOCAL_MEM_FENCE);
    nk_wgmma_rs_words(d, ws, db, n, trans_b, kind, smem, thread);
}
/* The product from the A registers the warp's lanes posted, lane l's four at ws[4 l .. 4 l + 3]
   (the roles emulation posts them when the product is issued, and runs this when it lands). */
inline void nk_wgmma_rs_words(float* d, __local const uint* ws, ulong db, int n, int trans_b, int kind,
                              __local const uchar* smem, int thread) {
    const int lane = thread % 32, group = lane / 4, tig = lane % 4;
    const int eight = kind >= 2, per = eight ? 4 : 2, eb = eight ? 1 : 2;
    for (int v = 0; v < n / 2; ++v) {
        const int row = group + 8 * ((v / 2) % 2);  /* within the warp's 16 rows */
        const int col = 8 * (v / 4) + 2 * tig + v % 2;
        float acc = d[v];
        for (int k = 0; k < 8 * per; ++k) {
            const int holder = 4 * (row % 8) + (k % (4 * per)) / per;
            const int i = k % per + per * (row / 8) + 2 * per * (k / (4 * per));
            const uint word = ws[4 * holder + i / per];
            const int b = nk_wgmma_addr(db, trans_b, col, k, eb);
            if (b < 0) { acc = NAN; continue; }
            acc += eight ? nk_wg_fp8((word >> (8 * (i % 4))) & 0xffu, kind == 3) * nk_wg_fp8(smem[b], kind == 3)
                         : nk_b16f(i % 2 ? word >> 16 : word, kind) * nk_b16f(nk_lds16(smem, b), kind);
        }
        d[v] = acc;
    }
}
/* .m64nNk16, A from registers, bf16 (f16 = 0) or f16 operands */
inline void nk_wgmma_rs(float* d, const uint a[4], ulong db, int n, int trans_b, int f16,
                        __local const uchar* smem, __local uint* ws, int thread) {
    nk_wgmma_rs_k(d, a, db, n, trans_b, f16, smem, ws, thread);
}
/* .m64nNk32, A from registers, e4m3 (e5m2 = 0) or e5m2 operands, B K-major */
inline void nk_wgmma_rs8(float* d, const uint a[4], ulong db, int n, int e5m2,
                         __local const uchar* smem, __local uint* ws, int thread) {
    nk_wgmma_rs_k(d, a, db, n, 0, 2 + e5m2, smem, ws, thread);
}
"""


_CUDA_TMA = r"""
// ---- TMA and mbarriers (PTX ISA 9.7.9.25 cp.async.bulk.tensor; 9.7.13.15 mbarrier) ----
// The tensor map is opaque: 128 bytes, 64-byte aligned, encoded on the host (cuTensorMapEncodeTiled).
struct __align__(64) CUtensorMap { unsigned long long opaque[16]; };
__device__ __forceinline__ void nk_mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void nk_mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void nk_mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
__device__ __forceinline__ void nk_tma_2d(const CUtensorMap* map, unsigned dst, int c0, int c1, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
// .3d .. .5d: the tensor coordinates innermost first, one .s32 a dimension of the map
__device__ __forceinline__ void nk_tma_3d(const CUtensorMap* map, unsigned dst, int c0, int c1, int c2, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
                 :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
__device__ __forceinline__ void nk_tma_4d(const CUtensorMap* map, unsigned dst, int c0, int c1, int c2, int c3, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
__device__ __forceinline__ void nk_tma_5d(const CUtensorMap* map, unsigned dst, int c0, int c1, int c2, int c3, int c4, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n"
                 :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar) : "memory");
}
#define NK_MBAR_INIT(bar, count) nk_mbar_init(nk_sbase + (bar), (count))
#define NK_FENCE_MBAR_INIT() asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory")
#define NK_MBAR_EXPECT_TX(bar, bytes) nk_mbar_arrive_expect_tx(nk_sbase + (bar), (bytes))
#define NK_MBAR_WAIT(bar, parity) nk_mbar_wait(nk_sbase + (bar), (parity))
#define NK_TMA_2D(map, g, dst, c0, c1, bar) nk_tma_2d(&(map), nk_sbase + (dst), (c0), (c1), nk_sbase + (bar))
#define NK_TMA_3D(map, g, dst, c0, c1, c2, bar) nk_tma_3d(&(map), nk_sbase + (dst), (c0), (c1), (c2), nk_sbase + (bar))
#define NK_TMA_4D(map, g, dst, c0, c1, c2, c3, bar) nk_tma_4d(&(map), nk_sbase + (dst), (c0), (c1), (c2), (c3), nk_sbase + (bar))
#define NK_TMA_5D(map, g, dst, c0, c1, c2, c3, c4, bar) nk_tma_5d(&(map), nk_sbase + (dst), (c0), (c1), (c2), (c3), (c4), nk_sbase + (bar))
"""

_OPENCL_TMA = r"""
/* ---- TMA and mbarriers emulated, written from the PTX ISA (9.7.9.25 cp.async.bulk.tensor, 9.7.13.15
   mbarrier) and the driver API (cuTensorMapEncodeTiled), apart from napkin's encoder. A tensor map
   is the words of that call in its order: data type, rank, globalDim[rank] (elements, innermost
   first), globalStrides[rank - 1] (bytes), boxDim[rank], elementStrides[rank], interleave, swizzle,
   l2Promotion, oobFill, with the enums' values of cuda.h. */
inline int nk_tmap_element_bytes(ulong type) {  /* CUtensorMapDataType: UINT8 .. TFLOAT32_FTZ */
    switch (type) { case 0: return 1; case 1: case 6: case 9: return 2; case 4: case 5: case 8: return 8; default: return 4; }
}
/* An mbarrier in 16 bytes: completed phases, pending arrivals, tx-count, expected arrivals. A
   phase completes when its pending arrivals and its tx-count are both zero. */
inline void nk_mbar_init(__local uchar* smem, int bar, int count) {
    __local int* m = (__local int*)(smem + bar);
    m[0] = 0; m[1] = count; m[2] = 0; m[3] = count;
}
inline void nk_mbar_step(__local int* m) {
    if (m[1] == 0 && m[2] == 0) { m[0] += 1; m[1] = m[3]; }
}
inline void nk_mbar_arrive_expect_tx(__local uchar* smem, int bar, int bytes) {
    __local int* m = (__local int*)(smem + bar);
    m[2] += bytes;  /* expect-tx, then arrive-on */
    m[1] -= 1;
    nk_mbar_step(m);
}
inline void nk_mbar_complete_tx(__local uchar* smem, int bar, int bytes) {
    __local int* m = (__local int*)(smem + bar);
    m[2] -= bytes;
    nk_mbar_step(m);
}
/* try_wait.parity P succeeds once the phase of parity P has completed: the current phase's parity
   ((completed phases) & 1) is not P. The emulation copies when a copy is issued, and every wait
   follows a barrier after its stage's copies: a wait that would block (a wrong parity, bytes still
   expected) poisons the arena with 0xFF bytes (NaN) so the run's result is wrong. */
inline void nk_mbar_wait(__local uchar* smem, int bar, int parity) {
    __local int* m = (__local int*)(smem + bar);
    if ((m[0] & 1) == parity || m[2] != 0) for (int i = 0; i < bar; ++i) smem[i] = (uchar)0xFF;
}
/* cp.async.bulk.tensor.1d .. .5d: the box at tensor coordinates c[0..rank) (innermost first) to
   shared byte dst. The map's words are decoded by its rank r: globalDim[r] at word 2,
   globalStrides[r - 1] (bytes of dimensions 1 .. r-1; dimension 0's is the element) after them,
   then boxDim[r], elementStrides[r], interleave, swizzle, l2Promotion, oobFill. The box holds
   ceil(boxDim[i] / elementStrides[i]) elements along dimension i (its index j at coordinate
   c[i] + j elementStrides[i]), dense in shared memory innermost first; each byte address is then
   swizzled by the map's span (bits [4, 4 + b) XOR bits [7, 7 + b), b = log2(span / 16)).
   Elements outside globalDim in any dimension read as zeros (oobFill NONE) or NaN
   (NAN_REQUEST_ZERO_FMA). nk_tma_box writes the box and returns its bytes, or -1 for a map the
   emulation does not take (rank outside 1 .. 5, interleaved, another swizzle, an inner box over
   the span); nk_tma then completes the bytes on bar, or poisons the arena. */
inline int nk_tma_box(__local uchar* smem, __constant const ulong* map, __global const uchar* base,
                      int dst, int c0, int c1, int c2, int c3, int c4) {
    const int rank = (int)map[1];
    if (rank < 1 || rank > 5) return -1;
    const int eb = nk_tmap_element_bytes(map[0]);
    const int at[5] = {c0, c1, c2, c3, c4};
    long dim[5], stride[5];
    int count[5], step[5];
    for (int i = 0; i < 5; ++i) {
        const int in = i < rank;
        dim[i] = in ? (long)map[2 + i] : 1;
        stride[i] = i == 0 ? eb : in ? (long)map[2 + rank + i - 1] : 0;
        step[i] = in ? (int)map[2 + 3 * rank - 1 + i] : 1;
        const int box = in ? (int)map[2 + 2 * rank - 1 + i] : 1;
        count[i] = (box + step[i] - 1) / step[i];
    }
    const int tail = 2 + 4 * rank - 1;
    const int interleave = (int)map[tail], swizzle = (int)map[tail + 1], oob = (int)map[tail + 3];
    const int span = swizzle == 1 ? 32 : swizzle == 2 ? 64 : swizzle == 3 ? 128 : 0;
    if (interleave != 0 || swizzle > 3 || (span && count[0] * eb > span)) return -1;
    int e = 0;  /* the element's place in the dense box, innermost fastest */
    for (int j4 = 0; j4 < count[4]; ++j4)
    for (int j3 = 0; j3 < count[3]; ++j3)
    for (int j2 = 0; j2 < count[2]; ++j2)
    for (int j1 = 0; j1 < count[1]; ++j1)
    for (int j0 = 0; j0 < count[0]; ++j0, ++e) {
        const int j[5] = {j0, j1, j2, j3, j4};
        int inside = 1;
        long from = 0;
        for (int i = 0; i < 5; ++i) {
            const long x = (long)at[i] + (long)j[i] * step[i];
            inside = inside && x >= 0 && x < dim[i];
            from += x * stride[i];
        }
        int addr = dst + e * eb;
        if (span) addr ^= ((addr >> 7) & (span / 16 - 1)) << 4;
        for (int b = 0; b < eb; ++b)
            smem[addr + b] = inside ? base[from + b] : (oob ? (uchar)0xFF : (uchar)0);
    }
    return e * eb;
}
inline void nk_tma(__local uchar* smem, __constant const ulong* map, __global const uchar* base,
                   int dst, int c0, int c1, int c2, int c3, int c4, int bar) {
    const int bytes = nk_tma_box(smem, map, base, dst, c0, c1, c2, c3, c4);
    if (bytes < 0) { for (int i = 0; i < bar; ++i) smem[i] = (uchar)0xFF; return; }
    nk_mbar_complete_tx(smem, bar, bytes);
}
#define NK_MBAR_INIT(bar, count) nk_mbar_init(nk_smem, (bar), (count))
#define NK_FENCE_MBAR_INIT()
#define NK_MBAR_EXPECT_TX(bar, bytes) nk_mbar_arrive_expect_tx(nk_smem, (bar), (bytes))
#define NK_MBAR_WAIT(bar, parity) nk_mbar_wait(nk_smem, (bar), (parity))
#define NK_TMA_2D(map, g, dst, c0, c1, bar) nk_tma(nk_smem, (map), (__global const uchar*)(g), (dst), (c0), (c1), 0, 0, 0, (bar))
#define NK_TMA_3D(map, g, dst, c0, c1, c2, bar) nk_tma(nk_smem, (map), (__global const uchar*)(g), (dst), (c0), (c1), (c2), 0, 0, (bar))
#define NK_TMA_4D(map, g, dst, c0, c1, c2, c3, bar) nk_tma(nk_smem, (map), (__global const uchar*)(g), (dst), (c0), (c1), (c2), (c3), 0, (bar))
#define NK_TMA_5D(map, g, dst, c0, c1, c2, c3, c4, bar) \
    nk_tma(nk_smem, (map), (__global const uchar*)(g), (dst), (c0), (c1), (c2), (c3), (c4), (bar))
"""


def tensor_maps(plan: WgmmaPlan, diagram, sizes: dict) -> dict[str, TiledTensorMap]:
    """The tensor map of each TMA operand of ``plan`` (``plan.tma`` order), over the whole array
    in memory at ``sizes``: what the host encodes and the OpenCL emulation is given."""
    maps = {}
    for load in plan.tma:
        array = diagram.arrays[load.array]
        shape = tuple(int(sizes[a]) for a in array.axes)
        maps[load.array] = tiled_tensor_map(array.dtype, shape, load.box(), load.swizzle)
    return maps


# The PTX type of an operand dtype in a wgmma's name (.bf16, .f16; .e4m3, .e5m2 for the 8-bit shape).
PTX_TYPE = {"bf16": "bf16", "f16": "f16", "fp8e4m3": "e4m3", "fp8e5m2": "e5m2"}


def wrapper_name(n: int, dtype: str, trans_a: bool, trans_b: bool, a_regs: bool = False) -> str:
    k, ptx = wgmma_k(dtype), PTX_TYPE[dtype]
    if a_regs:  # A from registers: no transpose of A
        return f"nk_wgmma_m64n{n}k{k}_{ptx}_r{int(trans_b)}"
    return f"nk_wgmma_m64n{n}k{k}_{ptx}_{int(trans_a)}{int(trans_b)}"


def wgmma_call(dialect: str, accumulators: str, a: str, db: str, n: int, dtype: str, trans_a: bool, trans_b: bool,
               a_regs: bool = False, posted: bool = False) -> str:
    """One wgmma into ``accumulators`` (the address of the fragment's first register), B by
    descriptor ``db``, A by descriptor or (``a_regs``) from the four registers ``a``. On CUDA the
    inline-PTX wrapper :func:`cuda_wrapper` defines; on OpenCL the emulation the prelude above
    defines, one work-item's values of the warpgroup's: ``nk_wgmma`` (16-bit, descriptors),
    ``nk_wgmma8`` (8-bit: K-major operands, no transposes) and their ``_rs`` forms with A from
    registers, which exchange lanes through the warp's scratch ``nk_ws``; ``posted``: on OpenCL, ``a``
    is the warp's posted A words instead (``nk_wgmma_rs_words``, no lane exchange: the roles
    emulation's products when they land)."""
    if dialect == "cuda":
        return f"{wrapper_name(n, dtype, trans_a, trans_b, a_regs)}({accumulators}, {a}, {db});"
    thread = f"nk_tid % {WARPGROUP_THREADS}"
    if dtype in FP8_DTYPES and a_regs and posted:  # nk_wgmma_rs_words' operand kinds: 2 e4m3, 3 e5m2 (K-major B)
        return f"nk_wgmma_rs_words({accumulators}, {a}, {db}, {n}, 0, {2 + int(dtype == 'fp8e5m2')}, nk_smem, {thread});"
    if dtype in FP8_DTYPES:
        operands = f"{accumulators}, {a}, {db}, {n}, {int(dtype == 'fp8e5m2')}"
        return f"nk_wgmma_rs8({operands}, nk_smem, nk_ws, {thread});" if a_regs else f"nk_wgmma8({operands}, nk_smem, {thread});"
    if a_regs and posted:
        return f"nk_wgmma_rs_words({accumulators}, {a}, {db}, {n}, {int(trans_b)}, {int(dtype == 'f16')}, nk_smem, {thread});"
    if a_regs:
        return f"nk_wgmma_rs({accumulators}, {a}, {db}, {n}, {int(trans_b)}, {int(dtype == 'f16')}, nk_smem, nk_ws, {thread});"
    return f"nk_wgmma({accumulators}, {a}, {db}, {n}, {int(trans_a)}, {int(trans_b)}, {int(dtype == 'f16')}, nk_smem, {thread});"


def cuda_wrapper(n: int, dtype: str, trans_a: bool, trans_b: bool, a_regs: bool = False) -> str:
    """``wgmma.mma_async.sync.aligned.m64nNk16.f32.<dtype>.<dtype> d, a-desc, b-desc, scale-d,
    imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b`` (PTX ISA 9.7.15.5.2): D is N/2 .f32
    registers, read and written ("+f"); the descriptors are 64-bit ("l"); scale-d 1 (D = A B + D),
    the scales 1, the transposes 1 for an MN-major operand. With A from registers (``a_regs``),
    ``d, a, b-desc, scale-d, imm-scale-a, imm-scale-b, imm-trans-b``: A is four .b32 registers of
    16-bit pairs ("r") and has no transpose. The 8-bit shape (``m64nNk32``, four bytes a register
    of A) is the same without the transpose immediates."""
    values = n // 2
    d = ", ".join(f"%{i}" for i in range(values))
    outputs = ", ".join(f'"+f"(d[{i}])' for i in range(values))
    name = wrapper_name(n, dtype, trans_a, trans_b, a_regs)
    k, ptx = wgmma_k(dtype), PTX_TYPE[dtype]
    eight = k != WGMMA_K
    # the 8-bit shape (m64nNk32 .e4m3/.e5m2) has no transpose immediates (PTX ISA 9.7.15.5.2:
    # imm-trans-a and imm-trans-b are for .f16/.bf16): both shared operands K-major
    assert not (eight and (trans_b or (trans_a and not a_regs))), "napkin bug: isel builds the 8-bit wgmma K-major"
    if a_regs:  # A: four .b32 registers ("r"), and no transpose of its own
        a_param, a_text = "const unsigned a[4]", "{" + ", ".join(f"%{values + j}" for j in range(4)) + "}"
        inputs, b_text = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db)', f"%{values + 4}"
        transposes = [] if eight else [int(trans_b)]
    else:
        a_param, a_text = "unsigned long long da", f"%{values}"
        inputs, b_text = '"l"(da), "l"(db)', f"%{values + 1}"
        transposes = [] if eight else [int(trans_a), int(trans_b)]
    immediates = ", ".join(str(x) for x in [1, 1, 1] + transposes)
    return (f"__device__ __forceinline__ void {name}(float d[{values}], {a_param}, unsigned long long db) {{\n"
            f'    asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ptx}.{ptx} {{{d}}}, {a_text}, {b_text}, '
            f'{immediates};\\n"\n'
            f"                 : {outputs}\n"
            f'                 : {inputs} : "memory");\n'
            f"}}\n")


def instruction_shapes(plan: WgmmaPlan, tile: dict) -> dict:
    """Each product's instruction, by target: (N, dtype, A transposed, B transposed, A from
    registers). An operand copied K-major each chunk (``plan.transposed``) is read untransposed from its copy."""
    shapes = {}
    for target, m in plan.mmas.items():
        if plan.swapped(target):  # A' = B, B' = the staged tile (MN-major: its rows are k)
            shapes[target] = (tile[plan.staged_rows(target)], m.dtype, m.b_trans, True, False)
            continue
        shapes[target] = (tile[m.n], m.dtype, m.a_trans and m.a not in plan.transposed, m.b_trans and m.b not in plan.transposed,
                          m.a_in_registers)
    return shapes


def prelude(dialect: str, shapes, tma: bool) -> str:
    """The wgmma primitives a translation unit's wgmma launches use: on CUDA one inline-PTX
    wrapper per instruction shape (:func:`instruction_shapes`' tuples), and the TMA and mbarrier
    primitives where a launch copies by TMA (``tma``)."""
    if dialect != "cuda":
        return _OPENCL_HEAD + (_OPENCL_TMA if tma else "")
    return _CUDA_HEAD + (_CUDA_TMA if tma else "") + "".join(cuda_wrapper(*shape) for shape in sorted(set(shapes)))


class WgmmaPrinter(TensorPrinter):
    """Prints one launch of a :class:`~napkin_dsl.paths.wgmma.WgmmaPlan`."""

    # The canonical tiles' swizzle repeats every 8 rows x width bytes from the shared window's
    # address (isel.smem_layout places each on a multiple of 1024 from the arena's base).
    arena_alignment = 1024

    def __init__(self, program, launch, dialect, plan: WgmmaPlan):
        assert isinstance(plan, WgmmaPlan), "napkin bug: the wgmma printer takes the plans isel builds on wgmma"
        super().__init__(program, launch, dialect, plan)
        self.shapes = instruction_shapes(plan, self.tile)
        self.tma: dict[str, TmaLoad] = {load.array: load for load in plan.tma}
        # the ring's operands (filled a stage at a time, in the stream's load order) and the
        # one-shot copies before the stream (attention's Q), each on its own mbarrier after the ring's
        self.ring = [name for name, load in self.tma.items() if load.streamed]
        ring = 2 * plan.stages if plan.roles is not None else plan.stages  # full (and, with roles, empty) mbarriers
        self.once = {name: ring + i for i, name in enumerate(n for n, load in self.tma.items() if not load.streamed)}
        self.awaiting: list[str] = []  # one-shot copies issued and not yet waited for
        if self.tma:  # the mbarriers after the tiles, one a stage and one a one-shot copy (isel.smem_layout)
            assert len(self.once) + ring == mbarrier_count(plan), "napkin bug: the layout's mbarriers"
            self.bars = self.arena - MBARRIER_BYTES * mbarrier_count(plan)
            self.maps = tensor_maps(plan, self.diagram, self.sizes)

    def print(self, entry: str) -> KernelSource:
        """The launch's kernel, with the tensor maps its TMA operands take (``plan.tma`` order):
        the launcher encodes them as they are, and selects, plans and sizes nothing."""
        self.entry = entry
        source = super().print(entry)
        return replace(source, tensor_maps=tuple((name, self.maps[name]) for name in self.tma)) if self.tma else source

    @property
    def rolled_stream(self) -> bool:
        return False  # the stream loop is unrolled by the stages, whatever the fragments

    @property
    def tma_ring(self) -> bool:
        return bool(self.tma)

    def extra_parameters(self, entry: str) -> list[str]:
        """The tensor maps, one per TMA operand in ``plan.tma`` order, as the dialect passes
        them: CUDA's follow the arrays and scalars; OpenCL's are program-scope constants of the
        encoder's words, which the emulation decodes, declared before the kernel."""
        if not self.tma:
            return []
        params, before = self.dialect.tensor_maps({self.map_name(name): m.words() for name, m in self.maps.items()})
        self.lines[:0] = before
        return params

    def map_name(self, name: str) -> str:
        return self.dialect.tensor_map_name(self.entry, name)

    def lane_constants(self):
        """No ldmatrix: the tensor cores read both operands by descriptor. The warpgroup's first
        row; with TMA, the ring's mbarriers initialised (one arrival each: thread 0's
        arrive.expect_tx) and made visible to the async proxy before any copy."""
        self.lanes = {}
        self.emit(f"const int nk_wg = nk_warp >> 2;  // this thread's warpgroup: rows {WGMMA_M} * nk_wg of the {self.plan.row} tile")
        assert self.arena < 1 << 18, "napkin bug: a descriptor's start address field holds 18 bits of the shared window"
        self.emit("NK_DESC_BASE();  // the descriptors' start address field of the arena's base")
        if self.tma:
            inits = " ".join(f"NK_MBAR_INIT({self.bar(str(s))}, 1);" for s in range(self.plan.stages + len(self.once)))
            self.emit(f"if (nk_tid == 0) {{ {inits} NK_FENCE_MBAR_INIT(); }}")
            self.emit("NK_SYNC();  // the mbarriers are initialised before any thread waits on one")

    def copy_constants(self):
        """With TMA every operand comes by tensor map: no thread's cp.async constants."""
        if self.tma:
            self.copies = {}
            return
        super().copy_constants()

    def copies_landed(self):  # (TMA: ring_landed emits none of this)
        """Each thread's cp.async writes (the generic proxy) ordered before the async proxy wgmma
        reads through, by the writing thread itself and before the barrier that publishes them to
        the warpgroups (with TMA the copies are the async proxy's already: no cp.async here)."""
        self.emit("NK_FENCE_PROXY_ASYNC();  // this thread's copies, seen by the async proxy wgmma reads through")

    def save_tile(self, step):
        """The mma.sync printer's staged output tile, kept below the mbarriers: their memory is
        not reused for other data (the PTX ISA asks for ``mbarrier.inval`` first), so an output
        staged in the arena stops where they start."""
        tile = super().save_tile(step)
        if tile is not None and self.tma and tile.bytes > self.bars:
            return None
        return tile

    def bar(self, stage: str) -> str:
        return f"{self.bars + MBARRIER_BYTES * int(stage)}" if stage.isdigit() else f"{self.bars} + {MBARRIER_BYTES} * ({stage})"

    # -- the TMA ring: TensorPrinter's stream loop (its masked loops included), with the ring's
    # synchronisation on mbarriers. A chunk on stage s: the barrier (every warp is done with the
    # previous chunk's stage), thread 0 refills that stage, then every thread waits on stage s's
    # mbarrier for the parity of its phase. Each stage's phase parity is one bit of nk_phase_<x>,
    # flipped at each wait: a stage is filled and waited for alternately, in chunk order, whatever
    # chunks a mask skips, so its bit is the parity of the fills it has had.
    def stream_loop(self, node):
        if not self.tma:
            return super().stream_loop(node)
        x = ident(node.axis)
        self.ring_axis = x
        self.emit(f"unsigned nk_phase_{x} = 0;  // bit s: the parity of stage s's current phase")
        super().stream_loop(node)

    def load(self, name: str, origin: str | None = None, stage: str | None = None, commit: bool = True):
        """A TMA operand's tile, issued by thread 0: the stage's mbarrier (or a one-shot copy's
        own) expects the boxes' bytes (the first of the ring's operands arrives for them all),
        then one ``cp.async.bulk.tensor`` per box."""
        load = self.tma.get(name)
        if load is None:
            return super().load(name, origin, stage, commit)
        if load.streamed:
            assert stage is not None, "napkin bug: a ring operand is loaded into a stage"
            bar = self.bar(stage)
            expect = sum(self.tma[n].bytes for n in self.ring) if name == self.ring[0] else 0
        else:
            assert not self.buffers, f"napkin bug: the one-shot TMA copy of {name} is issued inside the stream"
            bar = self.bar(str(self.once[name]))
            expect = load.bytes
            self.awaiting.append(name)
        with self.block("if (nk_tid == 0) {"):
            if expect:
                self.emit(f"NK_MBAR_EXPECT_TX({bar}, {expect});  // the boxes' bytes, out-of-bounds fill included")
            for box, dst, coords in self.tma_boxes(name, origin, stage):
                self.emit(self.tma_copy(name, box, dst, coords, bar))

    def tma_copy(self, name: str, box, dst: str, coords: list[str], bar: str) -> str:
        """One box of operand ``name`` by ``cp.async.bulk.tensor``, completing on mbarrier offset ``bar``."""
        load = self.tma[name]
        return (f"NK_TMA_{load.rank}D({self.map_name(name)}, g_{ident(name)}, {dst}, {', '.join(coords)}, {bar});"
                f"  // {name}: {box.rows} x {box.cols} from ({load.rows}, {load.cols} + {box.col})")

    def tma_boxes(self, name: str, origin: str | None, stage: str | None) -> list[tuple]:
        """Each box of operand ``name``'s tile: (the box, its shared destination, its tensor
        coordinates innermost first), the streamed axis at ``origin`` and the tile in ``stage``."""
        load, slot = self.tma[name], self.smem[name]
        boxes = []
        for box in slot.tile.tma_boxes():
            coords = []
            for axis in reversed(load.axes):  # innermost first
                at = origin if axis == self.plan.stream and origin is not None else self.origin.get(axis, "0")
                if axis == load.cols and box.col:
                    at = f"{at} + {box.col}" if at != "0" else str(box.col)
                coords.append(str(at))
            if stage is None:
                dst = str(slot.offset + box.offset)
            elif stage.isdigit():
                dst = str(slot.offset + int(stage) * slot.stage_bytes + box.offset)
            else:
                dst = f"{slot.offset + box.offset} + ({stage}) * {slot.stage_bytes}"
            boxes.append((box, dst, coords))
        return boxes

    def await_once(self):
        """Every thread waits for the one-shot copies issued (phase 0 of their mbarriers), behind a
        barrier after thread 0 issued them."""
        if not self.awaiting:
            return
        self.emit("NK_SYNC();  // thread 0 has issued the one-shot copies")
        for name in self.awaiting:
            self.emit(f"NK_MBAR_WAIT({self.bar(str(self.once[name]))}, 0);  // {name} has landed")
        self.awaiting = []

    def wait(self):
        self.await_once()
        super().wait()

    def ring_commit(self, comment: str = ""):
        if not self.tma:
            super().ring_commit(comment)

    def ring_started(self):
        """With the ring's first stages in flight: the one-shot copies (Q) have landed."""
        self.await_once()

    def ring_landed(self):
        if not self.tma:
            super().ring_landed()

    def ring_ready(self, stage: str):
        """This chunk's stage has landed: its mbarrier's phase of the parity in its bit."""
        if not self.tma:
            return
        x = self.ring_axis
        bit = stage if stage.isdigit() else f"({stage})"
        self.emit(f"NK_MBAR_WAIT({self.bar(stage)}, (nk_phase_{x} >> {bit}) & 1u);  // this chunk's boxes have landed")
        self.emit(f"nk_phase_{x} ^= 1u << {bit};")

    def ring_drained(self):
        """Every copy the ring issued was waited for (a chunk is filled only if it is visited)."""
        if not self.tma:
            super().ring_drained()

    def descriptor_expr(self, name: str, k_major: bool, row0: str, k0: int) -> str:
        """The descriptor of the 64 (A) or N (B) rows from ``row0`` (a C expression, M or N) at k
        ``k0`` of operand ``name``, in the current stage."""
        slot = self.smem[name]
        tile = slot.tile
        fields = descriptor(tile, k_major).encode()
        eb = tile.element_bytes
        base = f"{slot.offset}"
        stage = self.buffers.get(name)
        if stage is not None:
            base = f"{slot.offset} + ({stage}) * {slot.stage_bytes}"
        if k_major:  # rows are M or N: row0 * width, k0 within its atom column
            k_part = tile.start(0, k0)
            offset = f"{base} + {k_part}" + (f" + ({row0}) * {tile.width}" if row0 != "0" else "")
        else:  # rows are k: the M or N origin a multiple of the atom's width
            offset = f"{base} + {tile.start(k0, 0)}"
            if row0 != "0":
                offset += f" + (({row0}) * {eb} / {tile.width}) * {tile.rows * tile.width}"
        return f"NK_DESC({fields:#x}ull, {offset})"

    def mma(self, target: str, out: str):
        """``out[row, n] += A[row, k] B[k, n]`` over the chunk's k tile: one wgmma per 16 of k,
        complete (``wait_group 0``) before anything reads ``out`` or refills the stage. A by
        descriptor, or from registers (P: ``register_a``)."""
        m = self.plan.mmas[target]
        out_var = "f_" + ident(out)  # the fragment array TensorPrinter declares for it
        n = self.shapes[target][0]
        if m.a_in_registers:
            self.register_a(m)
        self.products(target, f"&{out_var}[0][0][0]")
        self.emit("NK_WG_COMMIT();")
        self.emit("NK_WG_WAIT(0);  // the product has landed, and this stage is read, before any use or refill")
        if len(self.plan.mmas) > 1:  # a later step reads the accumulator (S) or rescales it (O)
            self.loop("nk_v", n // 2, lambda: self.emit(f"NK_WG_PIN_F({out_var}[0][nk_v / 4][nk_v % 4]);"))
        if m.a_in_registers:
            k_steps = self.tile[m.k] // wgmma_k(m.dtype)
            self.loop("kk", k_steps, lambda: self.loop("j", 4, lambda: self.emit(f"NK_WG_PIN_R({a_registers(m)}[kk][j]);")))

    def products(self, target: str, accumulators: str, a_words=None):
        """The chunk's wgmmas of product ``target`` into ``accumulators`` (the address of its D
        fragment's first register), after ``wgmma.fence``; its B copied K-major first where the
        plan copies it (``transpose``). A register A from its array (:func:`a_registers`), or on OpenCL from the words
        ``a_words(kk)`` names (the warp's posted registers of k step kk)."""
        m = self.plan.mmas[target]
        d = self.dialect
        k = wgmma_k(m.dtype)
        k_steps = self.tile[m.k] // k
        n = self.shapes[target][0]
        a_name, a_trans, b_name, b_trans = m.a, m.a_trans, m.b, m.b_trans
        if self.plan.swapped(target):  # its transpose: A' = B over the warpgroups' rows of n, B' = the staged tile
            a_name, a_trans, b_name, b_trans = m.b, m.b_trans, staged_slot(m.a), True
        copied = [name for name in (m.a, m.b) if name in self.plan.transposed]
        for name in copied:
            self.transpose(name)
        if copied:
            self.emit("NK_FENCE_PROXY_ASYNC();  // the copy, written through the generic proxy, seen by the async proxy")
            self.emit(f"NK_SYNC();  // every thread's part of {' and '.join(copied)}'s K-major copy is written before any warpgroup reads it")
        if m.a in copied:
            a_name, a_trans = kmajor_name(m.a), False
        if m.b in copied:
            b_name, b_trans = kmajor_name(m.b), False
        self.emit("NK_WG_FENCE();  // the accumulator (and A) registers were written by other instructions")
        # A: this warpgroup's 64 rows; B: all N columns (K-major unless stored with k as rows)
        a_row = f"nk_wg * {WGMMA_M}"
        for kk in range(k_steps):
            db = self.descriptor_expr(b_name, not b_trans, "0", kk * k)
            if m.a_in_registers:
                a = a_words(kk) if a_words is not None else f"{a_registers(m)}[{kk}]"
                self.emit(wgmma_call(d.name, accumulators, a, db, n, m.dtype, False, b_trans, True, a_words is not None))
                continue
            da = self.descriptor_expr(a_name, not a_trans, a_row, kk * k)
            self.emit(wgmma_call(d.name, accumulators, da, db, n, m.dtype, a_trans, b_trans))

    def stage_written(self):
        """A staged tile (dS, a canonical tile here, which the swapped product reads by
        descriptor): each thread's writes, through the generic proxy, fenced for the async proxy
        before the barrier that publishes them."""
        self.emit("NK_FENCE_PROXY_ASYNC();  // this thread's writes, seen by the async proxy wgmma reads through")

    def transpose(self, name: str):
        """An operand's chunk (``plan.transposed``: V [x d] under an fp8 P, a GEMM's B [k n] or A
        [k m], MN-major as TMA wrote it) copied into its K-major tile (``isel.kmajor_name``) for
        the 8-bit shape, which has no transpose: every thread of the block takes 4 x 4 blocks of
        bytes (a warp a skewed patch of them, shaped by ``layouts.transpose_split`` for the
        fewest bank conflicts), reads four 32-bit words (4 consecutive n of 4 rows of k, each
        within one 16-byte unit of the swizzled tile), swaps rows and columns with byte
        permutes, and writes four words (4 consecutive k of 4 rows of n) at the copy's swizzled
        offsets (``CanonicalTile.layout`` of each tile). The barrier before this chunk's products
        already ordered the previous chunk's reads of the copy; :meth:`products` fences the
        copies' generic-proxy writes for the async proxy and publishes them with one barrier."""
        src, dst = self.smem[name], self.smem[kmajor_name(name)]
        k_rows, n_cols = src.tile.rows, src.tile.cols  # the stage: k (x) rows, n (d) or m columns
        assert (dst.tile.rows, dst.tile.cols) == (n_cols, k_rows), "napkin bug: the K-major copy's shape"
        stage = self.buffers.get(name)
        base = f"{src.offset}" if stage is None else f"{src.offset} + ({stage}) * {src.stage_bytes}"
        blocks = (k_rows // 4) * (n_cols // 4)
        threads = self.plan.threads
        assert threads % 32 == 0, "napkin bug: the copy hands blocks out a warp at a time"
        split = transpose_split(src.tile, dst.tile)
        n_bits, patches = split.n_bits, split.n_blocks >> split.n_bits
        self.emit(f"// {name}'s chunk, K-major for the 8-bit wgmma: {blocks} blocks of 4 x 4 bytes over {threads} threads, "
                  f"a warp's lanes {1 << (5 - n_bits)} (k) x {1 << n_bits} (n) blocks, k rotated by {split.skew} x n"
                  + (", odd n blocks' rows written in swapped pairs" if split.swap else "")
                  + f" (layouts.transpose_split: {split.wavefronts} wavefronts a chunk, {split.conflict:.2f}x the conflict-free {split.ideal})")
        trips = -(-blocks // threads)
        # a loop of a known trip count, unrolled: a thread's blocks are the same every chunk, so
        # their lane arithmetic is loop-invariant and the compiler hoists it out of the stream
        with self.block(f"NK_UNROLL for (int nk_tt = 0; nk_tt < {trips}; ++nk_tt) {{"):
            self.emit(f"const int nk_tb = nk_tid + nk_tt * {threads};")
            if blocks % threads:
                self.emit(f"if (nk_tb >= {blocks}) break;  // the last trip's threads past the chunk's blocks")
            self.emit("const int nk_tw = nk_tb >> 5, nk_tl = nk_tb & 31;  // the block's warp patch and lane in it")
            n_block = f"((nk_tw % {patches}) << {n_bits} | (nk_tl & {(1 << n_bits) - 1}))"
            k_block = f"((nk_tw / {patches}) << {5 - n_bits} | (nk_tl >> {n_bits}))"
            if split.skew:
                k_block = f"(({k_block} + {split.skew} * {n_block}) % {split.k_blocks})"
            self.emit(f"const int nk_tn = {n_block} * 4, nk_tk = {k_block} * 4;  // the block's first n column, k row")
            for i in range(4):
                offset = src.tile.layout.c_expr(f"(nk_tk + {i})" if i else "nk_tk", "nk_tn")
                self.emit(f"const unsigned nk_tw{i} = {self.dialect.shared_word(f'{base} + {offset}')};  // k row nk_tk + {i}, n nk_tn..+3")
            # rows <-> columns of the 4 x 4 bytes: pairs interleaved (0x5140, 0x7362), then halves (0x5410, 0x7632)
            self.emit("const unsigned nk_tp0 = NK_PRMT(nk_tw0, nk_tw1, 0x5140u), nk_tp1 = NK_PRMT(nk_tw0, nk_tw1, 0x7362u);")
            self.emit("const unsigned nk_tp2 = NK_PRMT(nk_tw2, nk_tw3, 0x5140u), nk_tp3 = NK_PRMT(nk_tw2, nk_tw3, 0x7362u);")
            even, odd = "0x5410u", "0x7632u"  # the selectors of n rows 0 and 2, 1 and 3 of the block
            if split.swap:  # an odd n block's i-th store writes row i ^ 1: its selectors trade places
                self.emit("const int nk_ts = (nk_tn >> 2) & 1;  // the block's n parity: its rows go in swapped pairs")
                self.emit("const unsigned nk_tse = nk_ts ? 0x7632u : 0x5410u, nk_tso = nk_ts ? 0x5410u : 0x7632u;")
                even, odd = "nk_tse", "nk_tso"
            outs = [f"NK_PRMT(nk_tp0, nk_tp2, {even})", f"NK_PRMT(nk_tp0, nk_tp2, {odd})",
                    f"NK_PRMT(nk_tp1, nk_tp3, {even})", f"NK_PRMT(nk_tp1, nk_tp3, {odd})"]
            for j, value in enumerate(outs):
                row = (f"(nk_tn + ({j} ^ nk_ts))" if j else "(nk_tn + nk_ts)") if split.swap else (f"(nk_tn + {j})" if j else "nk_tn")
                offset = dst.tile.layout.c_expr(row, "nk_tk")
                self.emit(f"{self.dialect.shared_word(f'{dst.offset} + {offset}')} = {value};  // n row {row}, k nk_tk..+3")

    def register_a(self, m):
        """Every k step's A fragment of a register operand (P), packed to the operands' 16-bit
        type before the fence: wgmma's register A fragment is, per warp, mma.sync's m16n8k16 A
        fragment of the warp's 16 rows (PTX ISA Figure 148 and the m16n8k16 A figure), so the
        accumulator pair of n-tiles 2kk, 2kk + 1 packs into it with no lane crossing
        (``layouts.p_to_a_registers``), as on mma.sync."""
        if m.dtype in PTX_FP8:
            return self.register_a8(m)
        src = "f_" + ident(m.a)
        kind = "BF16" if m.dtype == "bf16" else "F16"
        k_steps = self.tile[m.k] // WGMMA_K
        repack = p_to_a_registers()
        tiles_per_k = WGMMA_K // MMA_N
        a = a_registers(m)
        self.emit(f"unsigned {a}[{k_steps}][{len(repack)}];  // {m.a} as wgmma's register A, one fragment per 16 of {m.k}")

        def pack():
            for j, halves in enumerate(repack):
                lo, hi = (f"{src}[0][{tiles_per_k} * kk + {nt}][{c}]" for nt, c in halves)
                self.emit(f"{a}[kk][{j}] = NK_PACK_{kind}({lo}, {hi});")

        self.loop("kk", k_steps, pack)

    def register_a8(self, m):
        """Every k step's 8-bit A fragment of P (wgmma m64nNk32: per warp, mma.sync m16n8k32's A
        fragment of the warp's 16 rows), in the ISA's own key order, since B (V, K-major by
        descriptor) is read in it: each lane packs its accumulator pairs into words
        (``layouts.p_words8``, saturating to the 8-bit type), and each register is the 16-bit
        halves of one word of two lanes of its quad (``layouts.QUAD_SOURCE``, ``QUAD_HALF``): two
        shuffles and a byte permute. (mma.sync's byte gather reads V's rows in a permuted key
        order instead, ``layouts.KEY_ORDER8``, and needs no exchange.)"""
        k_steps = self.tile[m.k] // WGMMA_K8
        tiles_per_k = WGMMA_K8 // MMA_N
        src = "f_" + ident(m.a)
        a = a_registers(m)
        self.emit(f"unsigned {a}[{k_steps}][{MMA_A8.extent('i') // 4}];  // {m.a} as wgmma's 8-bit register A, one fragment per {WGMMA_K8} of {m.k}")
        self.loop("kk", k_steps, lambda: self.exchange_p8(
            lambda nt, c: f"{src}[0][{tiles_per_k} * kk" + (f" + {nt}" if nt else "") + f"][{c}]",
            lambda j: f"{a}[kk][{j}]", PTX_FP8[m.dtype].upper()))


def a_registers(m) -> str:
    """The array of product ``m``'s register A fragments (P of attention, P and dS of its
    backward's key launch): one per operand, since two products of a chunk may each read one."""
    return f"nk_a_{ident(m.a)}"


# the 8-bit operand types of the m64nNk32 shape, as NK_PACK_<type> names them
PTX_FP8 = {"fp8e4m3": "e4m3", "fp8e5m2": "e5m2"}


__all__ = ["WgmmaPrinter", "a_registers", "prelude", "cuda_wrapper", "wrapper_name", "tensor_maps"]
