"""How long napkin's NVRTC layer takes: cold compile, raw NVRTC, in-process and disk cache hits.

Runs on a CPU-only machine (NVRTC needs no GPU). The kernel is a hand-written, attention-sized
stand-in for what napkin will generate: FlashAttention-2 order, bf16 tiles in shared memory,
WMMA for both products, an online softmax, and the key loop kept rolled (``#pragma unroll 1``;
unrolling it is what turned a 0.3 s compile into 127 s, see DESIGN.md).

    python benchmarks/bench_nvrtc.py [--repeat 5] [--arch sm_90 --arch sm_80]

Not a test: it asserts nothing except that a memory hit stays under 0.5 ms.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from napkin_dsl.backends import nvrtc
from napkin_dsl.backends.nvrtc import NvrtcCompiler

ATTENTION_SOURCE = r"""
#include <cuda_bf16.h>
#include <mma.h>

using namespace nvcuda;

// NVRTC does not define INFINITY.
#define NEG_INF (-1.0e30f)

constexpr int HEAD_DIM = 64;     // d
constexpr int BLOCK_Q = 32;      // query rows per block (group q 32)
constexpr int BLOCK_X = 64;      // keys per step of the rolled loop (stream x 64)
constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int FRAG = 16;         // WMMA tile edge
constexpr int LANES_PER_ROW = THREADS / BLOCK_Q;        // 4 threads share one softmax row
constexpr int COLS_PER_LANE = BLOCK_X / LANES_PER_ROW;  // 16 scores each
constexpr int OUT_COLS_PER_LANE = HEAD_DIM / LANES_PER_ROW;

struct __align__(16) Tiles {
    __nv_bfloat16 q[BLOCK_Q][HEAD_DIM];
    __nv_bfloat16 k[BLOCK_X][HEAD_DIM];
    __nv_bfloat16 v[BLOCK_X][HEAD_DIM];
    float s[BLOCK_Q][BLOCK_X];
    __nv_bfloat16 p[BLOCK_Q][BLOCK_X];
    float o[BLOCK_Q][HEAD_DIM];
    float row_max[BLOCK_Q];
    float row_sum[BLOCK_Q];
};

__device__ __forceinline__ void load_tile(__nv_bfloat16 (*dst)[HEAD_DIM], const __nv_bfloat16* src, int rows) {
    // 8 bf16 per 16-byte vector; consecutive threads take consecutive vectors (coalesced).
    const int vectors = rows * HEAD_DIM / 8;
    for (int i = threadIdx.x; i < vectors; i += THREADS) {
        reinterpret_cast<uint4*>(&dst[0][0])[i] = reinterpret_cast<const uint4*>(src)[i];
    }
}

__device__ __forceinline__ float group_max(float value) {
    #pragma unroll
    for (int offset = LANES_PER_ROW / 2; offset > 0; offset /= 2)
        value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    return value;
}

__device__ __forceinline__ float group_sum(float value) {
    #pragma unroll
    for (int offset = LANES_PER_ROW / 2; offset > 0; offset /= 2)
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

extern "C" __global__ void __launch_bounds__(THREADS)
attention_fwd(const __nv_bfloat16* __restrict__ Q, const __nv_bfloat16* __restrict__ K,
              const __nv_bfloat16* __restrict__ V, __nv_bfloat16* __restrict__ O,
              int seq_q, int seq_x, float scale) {
    __shared__ Tiles t;
    const int bh = blockIdx.y;                       // group b 1, h 1
    const int q0 = blockIdx.x * BLOCK_Q;
    const __nv_bfloat16* q_base = Q + ((size_t)bh * seq_q + q0) * HEAD_DIM;
    const __nv_bfloat16* k_base = K + (size_t)bh * seq_x * HEAD_DIM;
    const __nv_bfloat16* v_base = V + (size_t)bh * seq_x * HEAD_DIM;
    const int warp = threadIdx.x / 32;
    const int row = threadIdx.x / LANES_PER_ROW;     // softmax row owned by this thread's group
    const int lane_in_row = threadIdx.x % LANES_PER_ROW;

    load_tile(t.q, q_base, BLOCK_Q);
    for (int i = threadIdx.x; i < BLOCK_Q * HEAD_DIM; i += THREADS) (&t.o[0][0])[i] = 0.0f;
    if (threadIdx.x < BLOCK_Q) { t.row_max[threadIdx.x] = NEG_INF; t.row_sum[threadIdx.x] = 0.0f; }
    __syncthreads();

    #pragma unroll 1
    for (int x0 = 0; x0 < seq_x; x0 += BLOCK_X) {
        load_tile(t.k, k_base + (size_t)x0 * HEAD_DIM, BLOCK_X);
        load_tile(t.v, v_base + (size_t)x0 * HEAD_DIM, BLOCK_X);
        __syncthreads();

        // S = Q K^T: 2 x 4 fragments, two per warp.
        #pragma unroll
        for (int f = 0; f < 2; ++f) {
            const int tile = warp * 2 + f;
            const int fr = tile / (BLOCK_X / FRAG), fc = tile % (BLOCK_X / FRAG);
            wmma::fragment<wmma::accumulator, FRAG, FRAG, FRAG, float> acc;
            wmma::fill_fragment(acc, 0.0f);
            #pragma unroll
            for (int kk = 0; kk < HEAD_DIM; kk += FRAG) {
                wmma::fragment<wmma::matrix_a, FRAG, FRAG, FRAG, __nv_bfloat16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, FRAG, FRAG, FRAG, __nv_bfloat16, wmma::col_major> b;
                wmma::load_matrix_sync(a, &t.q[fr * FRAG][kk], HEAD_DIM);
                wmma::load_matrix_sync(b, &t.k[fc * FRAG][kk], HEAD_DIM);
                wmma::mma_sync(acc, a, b, acc);
            }
            wmma::store_matrix_sync(&t.s[fr * FRAG][fc * FRAG], acc, BLOCK_X, wmma::mem_row_major);
        }
        __syncthreads();

        // Online softmax: the head of the stream sets the max, the rest rescale by alpha.
        float local_max = NEG_INF;
        #pragma unroll
        for (int c = 0; c < COLS_PER_LANE; ++c)
            local_max = fmaxf(local_max, t.s[row][lane_in_row * COLS_PER_LANE + c] * scale);
        const float old_max = t.row_max[row];
        const float new_max = fmaxf(old_max, group_max(local_max));
        const float alpha = __expf(old_max - new_max);
        float local_sum = 0.0f;
        #pragma unroll
        for (int c = 0; c < COLS_PER_LANE; ++c) {
            const int col = lane_in_row * COLS_PER_LANE + c;
            const float p = __expf(t.s[row][col] * scale - new_max);
            local_sum += p;
            t.p[row][col] = __float2bfloat16(p);
        }
        #pragma unroll
        for (int c = 0; c < OUT_COLS_PER_LANE; ++c)
            t.o[row][lane_in_row * OUT_COLS_PER_LANE + c] *= alpha;
        const float tile_sum = group_sum(local_sum);
        __syncwarp();
        if (lane_in_row == 0) {
            t.row_sum[row] = t.row_sum[row] * alpha + tile_sum;
            t.row_max[row] = new_max;
        }
        __syncthreads();

        // O += P V: 2 x 4 fragments, two per warp, accumulated through shared memory.
        #pragma unroll
        for (int f = 0; f < 2; ++f) {
            const int tile = warp * 2 + f;
            const int fr = tile / (HEAD_DIM / FRAG), fc = tile % (HEAD_DIM / FRAG);
            wmma::fragment<wmma::accumulator, FRAG, FRAG, FRAG, float> acc;
            wmma::load_matrix_sync(acc, &t.o[fr * FRAG][fc * FRAG], HEAD_DIM, wmma::mem_row_major);
            #pragma unroll
            for (int kk = 0; kk < BLOCK_X; kk += FRAG) {
                wmma::fragment<wmma::matrix_a, FRAG, FRAG, FRAG, __nv_bfloat16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, FRAG, FRAG, FRAG, __nv_bfloat16, wmma::row_major> b;
                wmma::load_matrix_sync(a, &t.p[fr * FRAG][kk], BLOCK_X);
                wmma::load_matrix_sync(b, &t.v[kk][fc * FRAG], HEAD_DIM);
                wmma::mma_sync(acc, a, b, acc);
            }
            wmma::store_matrix_sync(&t.o[fr * FRAG][fc * FRAG], acc, HEAD_DIM, wmma::mem_row_major);
        }
        __syncthreads();
    }

    // Tail: divide by the softmax denominator and write bf16.
    __nv_bfloat16* o_base = O + ((size_t)bh * seq_q + q0) * HEAD_DIM;
    const float inverse = 1.0f / t.row_sum[row];
    #pragma unroll
    for (int c = 0; c < OUT_COLS_PER_LANE; ++c) {
        const int col = lane_in_row * OUT_COLS_PER_LANE + c;
        o_base[row * HEAD_DIM + col] = __float2bfloat16(t.o[row][col] * inverse);
    }
}
"""


def raw_nvrtc_seconds(source: str, options: list[str]) -> float:
    """create + compile + get cubin + destroy, straight through cuda.bindings.nvrtc."""
    from cuda.bindings import nvrtc as raw

    start = time.perf_counter()
    status, program = raw.nvrtcCreateProgram(source.encode(), b"attention_fwd.cu", 0, [], [])
    encoded = [option.encode() for option in options]
    (status,) = raw.nvrtcCompileProgram(program, len(encoded), encoded)
    assert status == raw.nvrtcResult.NVRTC_SUCCESS, status
    status, size = raw.nvrtcGetCUBINSize(program)
    cubin = b" " * size
    raw.nvrtcGetCUBIN(program, cubin)
    raw.nvrtcDestroyProgram(program)
    return time.perf_counter() - start


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:9.3f} ms"


def bench(arch: str, root: Path, repeat: int) -> list[tuple[str, str]]:
    kernels = root / nvrtc.KERNEL_CACHE_SUBDIR
    rows = []

    start = time.perf_counter()
    first = NvrtcCompiler(arch, cache_dir=root).compile(ATTENTION_SOURCE, "attention_fwd")
    rows.append(("first compile, empty cache dir (extracts headers once)", milliseconds(time.perf_counter() - start)))

    cold = []
    for _ in range(repeat):
        clear_dir(kernels)
        compiler = NvrtcCompiler(arch, cache_dir=root)
        start = time.perf_counter()
        module = compiler.compile(ATTENTION_SOURCE, "attention_fwd")
        cold.append(time.perf_counter() - start)
        assert compiler.stats.compiled == 1
    rows.append((f"cold compile via NvrtcCompiler (median of {repeat})", milliseconds(statistics.median(cold))))

    raw = [raw_nvrtc_seconds(ATTENTION_SOURCE, compiler.nvrtc_options) for _ in range(repeat)]
    rows.append((f"raw NVRTC, same source and options (median of {repeat})", milliseconds(statistics.median(raw))))

    hits = []
    for _ in range(1000):
        start = time.perf_counter()
        again = compiler.compile(ATTENTION_SOURCE, "attention_fwd")
        hits.append(time.perf_counter() - start)
    assert again is module
    memory_hit = statistics.median(hits)
    rows.append(("in-process cache hit (median of 1000)", milliseconds(memory_hit)))
    assert memory_hit < 0.5e-3, f"in-process cache hit took {memory_hit * 1e3:.3f} ms"

    disk = []
    for _ in range(50):
        fresh = NvrtcCompiler(arch, cache_dir=root)
        start = time.perf_counter()
        fresh.compile(ATTENTION_SOURCE, "attention_fwd")
        disk.append(time.perf_counter() - start)
        assert fresh.stats.disk_hits == 1
    rows.append(("disk cache hit, new compiler (median of 50)", milliseconds(statistics.median(disk))))

    usage = first.resources["attention_fwd"]
    rows.append(("cubin size", f"{len(first.cubin):9d} B"))
    rows.append(("registers / static smem / spill bytes", f"{usage['registers']} / {usage['shared_bytes']} / {usage['spill_bytes']}"))
    return rows


def clear_dir(directory: Path) -> None:
    for path in directory.glob("*"):
        path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", help="architecture(s) to compile for (default: sm_90, sm_80)")
    parser.add_argument("--repeat", type=int, default=5, help="cold compiles per architecture")
    args = parser.parse_args()
    archs = args.arch or ["sm_90", "sm_80"]
    major, minor = nvrtc.nvrtc_version()
    path, found_via = nvrtc.nvrtc_library()
    lines = ATTENTION_SOURCE.strip().count("\n") + 1
    print(f"NVRTC {major}.{minor} from {path} ({found_via}); kernel source: {lines} lines")
    with tempfile.TemporaryDirectory(prefix="napkin-bench-") as temporary:
        for arch in archs:
            rows = bench(arch, Path(temporary) / arch, args.repeat)
            width = max(len(label) for label, _ in rows)
            print(f"\n{arch}")
            for label, value in rows:
                print(f"  {label:<{width}}  {value}")


if __name__ == "__main__":
    main()
