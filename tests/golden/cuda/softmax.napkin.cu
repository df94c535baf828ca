/*
 * napkin kernel softmax_rows on H100
 *
 * diagram:
 *   Y[r c] = softmax[c](X[r c])
 *
 * relabelling:
 *   smem: group r 16
 *   l2: group r 16  (derived)
 *
 * instruction paths:
 *   napkin_softmax_rows_0: fma
 *     Y: fma (no contraction)
 *
 * cost of softmax_rows on H100 with r=37 c=200
 *   level  per     H (values)  H (bytes)  M (values)  M (bytes)  capacity    N  FLOP/B  transfer time
 *   l2     device  14,800      59,200     6,400       25,600     52,428,800  3  0.6     0.0177 us
 *   smem   block   14,800      59,200     3,200       12,800     232,448     3  0.6     0.00592 us
 *   FLOPs: fma 29,600, special 7,400  (total 37,000)
 *   predicted time: 2.49 us overlapped (compute-bound), 2.51 us serial; compute 0.463 us, 1 wave of 1056 blocks (8 per SM, bound by threads)
 *   compute by unit, at each unit's peak, in turn: FP32 (FMA pipe) 0.000479 us, MUFU (exp, rcp) 0.00191 us; the most: MUFU (exp, rcp)
 *   fixed costs (in the time above): launch 2 us, fill 0.0115 us, drain 0.0115 us
 *   predicted throughput: 0.0 TFLOP/s
 *   note: group r 16 does not divide r = 37: 3 groups, the last one masked (5 of 16)
 *   note: the l2 groups are derived: co-resident thread blocks in a swizzled launch order share L2 (docs: method, the L2 level)
 */

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// NVRTC defines no INFINITY.
#define NK_INF __int_as_float(0x7f800000)
__device__ __forceinline__ float nk_f(float v) { return v; }
__device__ __forceinline__ float nk_f(double v) { return (float)v; }
__device__ __forceinline__ float nk_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float nk_f(__nv_bfloat16 v) { return __bfloat162float(v); }
#define NK_FAST_FN __device__ __forceinline__
#define NK_EXPF(x) __expf(x)
#define NK_RCPF(x) __fdividef(1.0f, (x))
// Fast forms of sigmoid, silu and gelu in float (elementwise.py: their error bounds).
NK_FAST_FN float nk_fast_sigmoid(float x) { return NK_RCPF(1.0f + NK_EXPF(-x)); }
NK_FAST_FN float nk_fast_silu(float x) { return x * NK_RCPF(1.0f + NK_EXPF(-x)); }
NK_FAST_FN float nk_fast_gelu(float x) {
    const float z = fabs(x) * 0.70710678118654752f;
    const float t = NK_RCPF(1.0f + 0.5f * z);
    const float e = t * NK_EXPF(-z * z + (((((((((0.17087277f * t + -0.82215223f) * t + 1.48851587f) * t + -1.13520398f) * t + 0.27886807f) * t + -0.18628806f) * t + 0.09678418f) * t + 0.37409196f) * t + 1.00002368f) * t + -1.26551223f));  // the fit of erfc at z >= 0
    return 0.5f * x * (x > 0.0f ? 2.0f - e : e);
}
__device__ __forceinline__ float nk_warp_add(float v) {
    for (int o = 16; o > 0; o >>= 1) v = (v + __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float nk_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float nk_warp_min(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

#define NK_THREADS 256
extern "C" __global__ void __launch_bounds__(256, 1) napkin_softmax_rows_0(const float* __restrict__ g_X, float* __restrict__ g_Y) {
    extern __shared__ __align__(16) unsigned char nk_smem[];
    const int nk_tid = threadIdx.x;
    int nk_block = blockIdx.x;
    const int grp_r = nk_block % 3; nk_block /= 3;
    const int o_r = grp_r * 16;
    const int n_r = min(16, 37 - o_r);
    (void)nk_block;
    float* s_X = reinterpret_cast<float*>(nk_smem + 0);
    float* s_Y = reinterpret_cast<float*>(nk_smem + 0);
    // load X[r c] l2 -> smem
    {
        for (int t1 = nk_tid; t1 < 16 * 50; t1 += NK_THREADS) {
            int r2 = t1;
            const int i_c = (r2 % 50) * 4; r2 /= 50;
            const int i_r = r2 % 16; r2 /= 16;
            if (i_r < n_r) { *reinterpret_cast<uint4*>(&s_X[(i_r) * 200 + i_c]) = *reinterpret_cast<const uint4*>(&g_X[((o_r + i_r)) * 200 + (i_c)]); } else { *reinterpret_cast<uint4*>(&s_X[(i_r) * 200 + i_c]) = make_uint4(0u, 0u, 0u, 0u); }
        }
    }
    __syncthreads();
    // Y[r c] = softmax[c](X[r c])
    {
        for (int row3 = (nk_tid / 32); row3 < (n_r); row3 += (NK_THREADS / 32)) {
            int r4 = row3;
            const int i_r = r4 % (n_r); r4 /= (n_r);
            (void)r4;
            float m = -NK_INF;
            for (int e5 = (nk_tid % 32); e5 < (200); e5 += 32) {
                int r6 = e5;
                const int i_c = r6 % (200); r6 /= (200);
                (void)r6;
                m = fmaxf(m, nk_f(s_X[(i_r) * 200 + i_c]));
            }
            m = nk_warp_max(m);
            float l = 0.0f;
            for (int e7 = (nk_tid % 32); e7 < (200); e7 += 32) {
                int r8 = e7;
                const int i_c = r8 % (200); r8 /= (200);
                (void)r8;
                l += expf(nk_f(s_X[(i_r) * 200 + i_c]) - m);
            }
            l = nk_warp_add(l);
            for (int e9 = (nk_tid % 32); e9 < (200); e9 += 32) {
                int r10 = e9;
                const int i_c = r10 % (200); r10 /= (200);
                (void)r10;
                s_Y[(i_r) * 200 + i_c] = (m == -NK_INF) ? 0.0f : expf(nk_f(s_X[(i_r) * 200 + i_c]) - m) / l;
            }
        }
    }
    __syncthreads();
    // save Y[r c] smem -> l2
    {
        for (int t11 = nk_tid; t11 < (n_r) * (200); t11 += NK_THREADS) {
            int r12 = t11;
            const int i_c = r12 % (200); r12 /= (200);
            const int i_r = r12 % (n_r); r12 /= (n_r);
            (void)r12;
            g_Y[((o_r + i_r)) * 200 + (i_c)] = nk_f(s_Y[(i_r) * 200 + i_c]);
        }
    }
    __syncthreads();
}
