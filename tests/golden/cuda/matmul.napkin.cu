/*
 * napkin kernel matmul on H100
 *
 * diagram:
 *   C[m n] = A[m k] * B[k n]
 *
 * relabelling:
 *   smem: group m 128
 *   smem: group n 128
 *   smem: stream k 32
 *   l2: group m 384  (derived)
 *   l2: group n 256  (derived)
 *
 * instruction paths:
 *   napkin_matmul_0: fma
 *     C: fma (A's rows in memory (k = 100) are not a multiple of 16 bytes: cp.async copies 16-byte units)
 *
 * cost of matmul on H100 with m=300 n=200 k=100
 *   level      per     H (values)  H (bytes)  M (values)  M (bytes)  capacity    N    FLOP/B  transfer time
 *   l2         device  110,000     340,000    110,000     340,000    52,428,800  1    35.3    0.101 us
 *   smem       block   180,000     480,000    16,384      65,536     232,448     6    25.0    0.048 us
 *   registers  thread  0           0          64          256        1,020       256  -       0 us
 *   FLOPs: fma 12,000,000  (total 12,000,000)
 *   predicted time: 22.2 us overlapped (compute-bound), 22.3 us serial; compute 20 us, 1 wave of 396 blocks (3 per SM, bound by shared memory)
 *   fixed costs (in the time above): launch 2 us, fill 0.0293 us, drain 0.117 us
 *   predicted throughput: 0.5 TFLOP/s
 *   note: group m 128 does not divide m = 300: 3 groups, the last one masked (44 of 128)
 *   note: group n 128 does not divide n = 200: 2 groups, the last one masked (72 of 128)
 *   note: stream k 32 does not divide k = 100: 4 chunks, the last one masked (4 of 32)
 *   note: launch 0 stays on the FMA path: A's rows in memory (k = 100) are not a multiple of 16 bytes: cp.async copies 16-byte units
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
extern "C" __global__ void __launch_bounds__(256, 1) napkin_matmul_0(const __nv_bfloat16* __restrict__ g_A, const __nv_bfloat16* __restrict__ g_B, float* __restrict__ g_C) {
    extern __shared__ __align__(16) unsigned char nk_smem[];
    const int nk_tid = threadIdx.x;
    int nk_block = blockIdx.x;
    int nk_inner = nk_block % 6; nk_block /= 6;  // the block within its L2 group
    const int grp_n = (nk_block % 1) * 2 + nk_inner % 2; nk_block /= 1; nk_inner /= 2;
    const int o_n = grp_n * 128;
    const int n_n = min(128, 200 - o_n);
    const int grp_m = (nk_block % 1) * 3 + nk_inner % 3; nk_block /= 1; nk_inner /= 3;
    const int o_m = grp_m * 128;
    const int n_m = min(128, 300 - o_m);
    (void)nk_block;
    __nv_bfloat16* s_A = reinterpret_cast<__nv_bfloat16*>(nk_smem + 0);
    float* s_C = reinterpret_cast<float*>(nk_smem + 0);
    __nv_bfloat16* s_B = reinterpret_cast<__nv_bfloat16*>(nk_smem + 8192);
    float r_C__acc[64];  // C.acc: 4 block(s) of 4 m x 4 n a thread, across the stream loop
    // C.acc[m n] = 0
    {
        #pragma unroll
        for (int e = 0; e < 64; ++e) r_C__acc[e] = 0.0f;
    }
    __syncthreads();
    for (int c_k = 0; c_k < 4; ++c_k) {
        const int o_k = c_k * 32;
        const int n_k = min(32, 100 - o_k);
        // load A[m k] l2 -> smem
        {
            for (int t1 = nk_tid; t1 < 128 * 32; t1 += NK_THREADS) {
                int r2 = t1;
                const int i_k = r2 % 32; r2 /= 32;
                const int i_m = r2 % 128; r2 /= 128;
                const float v = (i_m < n_m && i_k < n_k) ? nk_f(g_A[((o_m + i_m)) * 100 + (o_k + i_k)]) : 0.0f;
                s_A[(i_m) * 32 + i_k] = __float2bfloat16(v);
            }
        }
        __syncthreads();
        // load B[k n] l2 -> smem
        {
            for (int t3 = nk_tid; t3 < 32 * 128; t3 += NK_THREADS) {
                int r4 = t3;
                const int i_n = r4 % 128; r4 /= 128;
                const int i_k = r4 % 32; r4 /= 32;
                const float v = (i_k < n_k && i_n < n_n) ? nk_f(g_B[((o_k + i_k)) * 200 + (o_n + i_n)]) : 0.0f;
                s_B[(i_k) * 128 + i_n] = __float2bfloat16(v);
            }
        }
        __syncthreads();
        // C.acc += A[m k] * B[k n]
        {
            #pragma unroll
            for (int j5 = 0; j5 < 4; ++j5) {
                const int t6 = nk_tid + j5 * NK_THREADS;
                if (t6 >= (((n_m) + 3) / 4) * (((n_n) + 3) / 4)) break;
                int r7 = t6;
                const int b_n = r7 % (((n_n) + 3) / 4); r7 /= (((n_n) + 3) / 4);
                const int b_m = r7 % (((n_m) + 3) / 4); r7 /= (((n_m) + 3) / 4);
                (void)r7;
                for (int i_k = 0; i_k < n_k; ++i_k) {
                    float a[4], b[4];
                    for (int u = 0; u < 4; ++u) {
                        const int i_m = b_m + u * (((n_m) + 3) / 4);
                        a[u] = (i_m < n_m) ? nk_f(s_A[(i_m) * 32 + i_k]) : 0.0f;
                    }
                    for (int v = 0; v < 4; ++v) {
                        const int i_n = b_n + v * (((n_n) + 3) / 4);
                        b[v] = (i_n < n_n) ? nk_f(s_B[(i_k) * 128 + i_n]) : 0.0f;
                    }
                    for (int u = 0; u < 4; ++u) for (int v = 0; v < 4; ++v) r_C__acc[(j5 * 4 + u) * 4 + v] += a[u] * b[v];
                }
            }
        }
        __syncthreads();
    }
    // C = C.acc
    {
        #pragma unroll
        for (int j8 = 0; j8 < 4; ++j8) {
            const int t9 = nk_tid + j8 * NK_THREADS;
            if (t9 >= (((n_m) + 3) / 4) * (((n_n) + 3) / 4)) break;
            int r10 = t9;
            const int b_n = r10 % (((n_n) + 3) / 4); r10 /= (((n_n) + 3) / 4);
            const int b_m = r10 % (((n_m) + 3) / 4); r10 /= (((n_m) + 3) / 4);
            (void)r10;
            for (int u = 0; u < 4; ++u) for (int v = 0; v < 4; ++v) {
                const int i_m = b_m + u * (((n_m) + 3) / 4);
                const int i_n = b_n + v * (((n_n) + 3) / 4);
                if (i_m < n_m && i_n < n_n) {
                    s_C[(i_m) * 128 + i_n] = r_C__acc[(j8 * 4 + u) * 4 + v];
                }
            }
        }
    }
    __syncthreads();
    // save C[m n] smem -> l2
    {
        for (int t11 = nk_tid; t11 < (n_m) * (n_n); t11 += NK_THREADS) {
            int r12 = t11;
            const int i_n = r12 % (n_n); r12 /= (n_n);
            const int i_m = r12 % (n_m); r12 /= (n_m);
            (void)r12;
            g_C[((o_m + i_m)) * 200 + (o_n + i_n)] = nk_f(s_C[(i_m) * 128 + i_n]);
        }
    }
    __syncthreads();
}
