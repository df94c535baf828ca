"""The wgmma lowering (sm_90a): a launch with a wgmma :class:`~napkin_dsl.isel.TensorPlan` -> a kernel.

One contraction ``out[row, n] (+)= A[row, k] B[k, n]`` per launch (matmul's), on
``wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}`` (PTX ISA 9.7.15, "Asynchronous Warpgroup
Level Matrix Multiply-Accumulate"):

* the block's 64 or 128 rows are one or two warpgroups of four warps; the accumulator is the
  instruction's D fragment (``layouts.wgmma_d``), which gives warp w of a group rows 16w..16w+15
  as mma.sync's C fragments of its N/8 n-tiles in order, so the tensor-core printer's loops over
  fragment elements (init, finalise, the epilogue to global memory with its ragged-tail masks)
  serve unchanged;
* A and B are shared-memory tiles in the canonical swizzled layouts (``layouts.CanonicalTile``:
  K-major for an operand whose fastest axis is k, MN-major, the instruction's transpose
  immediate set, for one whose fastest axis is m or n), written 16 bytes at a time by
  ``cp.async`` behind the same double-buffered pipeline as the mma.sync path, and read by the
  tensor cores through 64-bit matrix descriptors (``layouts.MatrixDescriptor``);
* every chunk: ``fence.proxy.async`` (the copies, written through the generic proxy, are seen by
  the async proxy wgmma reads through), ``wgmma.fence`` (the accumulator registers were written
  by other instructions), one wgmma per 16 values of k, ``wgmma.commit_group`` and
  ``wgmma.wait_group 0`` before the stage may be refilled.

OpenCL prints the same kernel; its prelude emulates wgmma per work-item by decoding the
descriptors' bit fields and the canonical layouts' address swizzle as the PTX ISA defines them,
written here apart from ``layouts.py``'s encoder, so that a CPU run through PoCL checks the
encoding.

Deliberately not here: choosing the path (``isel.py``), A from registers, more than one
contraction a launch (attention), TMA, mbarriers, warp specialization and ``setmaxnreg`` (issue
27, later steps); the mma.sync printer (``tensorcore.py``), whose node walk, pipeline, copies and
epilogue this printer inherits.
"""

from __future__ import annotations

from ..isel import TensorPlan
from ..layouts import WARPGROUP_THREADS, WGMMA_K, WGMMA_M, descriptor
from .lowering import KernelSource, ident
from .tensorcore import TensorPrinter

_CUDA_HEAD = r"""
// ---- wgmma primitives (PTX ISA 9.7.15: wgmma.mma_async, wgmma.fence, commit_group, wait_group;
// 9.7.12.15 membar/fence: fence.proxy.async) ----
// A descriptor's constant fields (leading and stride byte offsets, swizzle mode) with its start
// address: matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4 in bits 0-13.
__device__ __forceinline__ unsigned long long nk_desc(unsigned long long fields, unsigned addr) {
    return fields | (unsigned long long)((addr & 0x3FFFFu) >> 4);
}
#define NK_DESC(fields, off) nk_desc((fields), nk_sbase + (off))
#define NK_FENCE_PROXY_ASYNC() asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory")
#define NK_WG_FENCE() asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory")
#define NK_WG_COMMIT() asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory")
#define NK_WG_WAIT(n) asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(n) : "memory")
"""

_OPENCL_HEAD = r"""
/* ---- wgmma emulated per work-item (PTX ISA 9.7.15), written from the ISA apart from napkin's
   encoder: the descriptor's fields are decoded from their bits, each element's byte address is
   formed from the canonical layout's strides and then swizzled as the swizzle mode says. */
#define NK_DESC(fields, off) ((ulong)(fields) | (ulong)((((uint)(off)) & 0x3FFFFu) >> 4))
#define NK_FENCE_PROXY_ASYNC()
#define NK_WG_FENCE()
#define NK_WG_COMMIT()
#define NK_WG_WAIT(n)
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
/* D += A B for one thread of the warpgroup: its value v is row 16 * (warp % 4) + groupID (+ 8 for
   v % 4 in 2, 3), column 8 * (v / 4) + 2 * threadID_in_group + v % 2 (PTX ISA 9.7.15.5.1.1.1,
   the accumulator D figure of wgmma .m64nNk16). A is 64 x 16 (rows x k), B is 16 x n (k x cols). */
inline void nk_wgmma(float* d, ulong da, ulong db, int n, int trans_a, int trans_b, int f16,
                     __local const uchar* smem, int thread) {
    const int warp = thread / 32, lane = thread % 32, group = lane / 4, tig = lane % 4;
    for (int v = 0; v < n / 2; ++v) {
        const int row = 16 * (warp % 4) + group + 8 * ((v / 2) % 2);
        const int col = 8 * (v / 4) + 2 * tig + v % 2;
        float acc = d[v];
        for (int k = 0; k < 16; ++k) {
            const int a = nk_wgmma_addr(da, trans_a, row, k, 2);
            const int b = nk_wgmma_addr(db, trans_b, col, k, 2);
            if (a < 0 || b < 0) { acc = NAN; continue; }
            acc += nk_b16f(nk_lds16(smem, a), f16) * nk_b16f(nk_lds16(smem, b), f16);
        }
        d[v] = acc;
    }
}
"""


def wrapper_name(n: int, dtype: str, trans_a: bool, trans_b: bool) -> str:
    return f"nk_wgmma_m64n{n}k16_{dtype}_{int(trans_a)}{int(trans_b)}"


def cuda_wrapper(n: int, dtype: str, trans_a: bool, trans_b: bool) -> str:
    """``wgmma.mma_async.sync.aligned.m64nNk16.f32.<dtype>.<dtype> d, a-desc, b-desc, scale-d,
    imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b`` (PTX ISA 9.7.15.5.2): D is N/2 .f32
    registers, read and written ("+f"); the descriptors are 64-bit ("l"); scale-d 1 (D = A B + D),
    the scales 1, the transposes 1 for an MN-major operand."""
    values = n // 2
    d = ", ".join(f"%{i}" for i in range(values))
    outputs = ", ".join(f'"+f"(d[{i}])' for i in range(values))
    return (f"__device__ __forceinline__ void {wrapper_name(n, dtype, trans_a, trans_b)}(float d[{values}], "
            f"unsigned long long da, unsigned long long db) {{\n"
            f'    asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{dtype}.{dtype} {{{d}}}, %{values}, %{values + 1}, '
            f'1, 1, 1, {int(trans_a)}, {int(trans_b)};\\n"\n'
            f"                 : {outputs}\n"
            f'                 : "l"(da), "l"(db) : "memory");\n'
            f"}}\n")


def prelude(dialect: str, kernels) -> str:
    """The wgmma primitives the wgmma kernels of a translation unit use."""
    if dialect != "cuda":
        return _OPENCL_HEAD
    shapes = sorted({k.wgmma for k in kernels if getattr(k, "wgmma", None)})
    return _CUDA_HEAD + "".join(cuda_wrapper(*shape) for shape in shapes)


class WgmmaPrinter(TensorPrinter):
    """Prints one launch of a wgmma plan (``plan.shape`` set by ``isel``)."""

    def __init__(self, program, launch, dialect, plan: TensorPlan):
        if not plan.shape or len(plan.mmas) != 1:
            raise NotImplementedError("napkin bug: the wgmma printer takes the one-contraction plans isel builds on wgmma")
        super().__init__(program, launch, dialect, plan)
        (self.target, self.m), = plan.mmas.items()
        self.n = self.tile[self.m.n]

    def print(self, entry: str) -> KernelSource:
        kernel = super().print(entry)
        # The canonical tiles' swizzle repeats every 8 rows x width bytes from the shared window's
        # address (isel.smem_layout places each on a multiple of 1024 from the arena's base).
        kernel.text = kernel.text.replace("__align__(128)", "__align__(1024)", 1)
        kernel.wgmma = (self.n, self.m.dtype, self.m.a_trans, self.m.b_trans)
        return kernel

    def lane_constants(self):
        """No ldmatrix: the tensor cores read both operands by descriptor. The warpgroup's first row."""
        self.lanes = {}
        self.emit(f"const int nk_wg = nk_warp >> 2;  // this thread's warpgroup: rows {WGMMA_M} * nk_wg of the {self.plan.row} tile")

    def descriptor_expr(self, name: str, k_major: bool, row0: str, k0: int) -> str:
        """The descriptor of the 64 (A) or N (B) rows from ``row0`` (a C expression, M or N) at k
        ``k0`` of operand ``name``, in the current stage."""
        slot = self.smem[name]
        tile = slot.tile
        fields = descriptor(tile, k_major).encode()
        eb = tile.element_bytes
        base = f"{slot.offset}"
        stage = self.stage.get(name)
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
        """``out[row, n] += A[row, k] B[k, n]`` over the chunk's k tile: one wgmma per 16 of k."""
        m = self.m
        d = self.dialect
        out_var = "f_" + ident(out)  # the fragment array TensorPrinter declares for it
        k_steps = self.tile[m.k] // WGMMA_K
        # A: this warpgroup's 64 rows; B: all N columns (K-major unless stored with k as rows)
        a_row = f"nk_wg * {WGMMA_M}"
        self.emit("NK_FENCE_PROXY_ASYNC();  // the cp.async writes, seen by the async proxy wgmma reads through")
        self.emit("NK_WG_FENCE();  // the accumulator registers were written by other instructions")
        for kk in range(k_steps):
            da = self.descriptor_expr(m.a, not m.a_trans, a_row, kk * WGMMA_K)
            db = self.descriptor_expr(m.b, not m.b_trans, "0", kk * WGMMA_K)
            if d.name == "cuda":
                self.emit(f"{wrapper_name(self.n, m.dtype, m.a_trans, m.b_trans)}(&{out_var}[0][0][0], {da}, {db});")
            else:
                f16 = int(m.dtype == "f16")
                self.emit(f"nk_wgmma(&{out_var}[0][0][0], {da}, {db}, {self.n}, {int(m.a_trans)}, {int(m.b_trans)}, {f16}, "
                          f"nk_smem, nk_tid % {WARPGROUP_THREADS});")
        self.emit("NK_WG_COMMIT();")
        self.emit("NK_WG_WAIT(0);  // done reading this stage before any thread refills it")


__all__ = ["WgmmaPrinter", "prelude", "cuda_wrapper", "wrapper_name"]
