/*
 * napkin kernel attention on H100
 *
 * diagram:
 *   S[b h q x] = Q[b h q d] * K[b h x d] * 1/sqrt(d)
 *   P[b h q x] = softmax[x](S[b h q x])
 *   O[b h q d] = P[b h q x] * V[b h x d]
 *
 * relabelling:
 *   smem: group b 1
 *   smem: group h 1
 *   smem: group q 128
 *   smem: stream x 64
 *   l2: group b 1  (derived)
 *   l2: group h 1  (derived)
 *   l2: group q 256  (derived)
 *
 * cost of attention on H100 with b=1 h=3 q=200 x=150 d=128
 *   level  per     H (values)  H (bytes)  M (values)  M (bytes)  capacity    N  FLOP/B  transfer time
 *   l2     device  268,800     537,600    89,600      179,200    52,428,800  3  87.0    0.16 us
 *   smem   block   384,000     768,000    49,536      148,992    232,448     6  60.9    0.0768 us
 *   FLOPs: tensor 46,080,000, fma 580,800, special 91,800  (total 46,752,600)
 *   predicted time: 1.7 us overlapped (compute-bound), 1.94 us serial; compute 1.7 us, 1 wave of 132 blocks
 *   predicted throughput: 27.5 TFLOP/s
 *   note: group q 128 does not divide q = 200: 2 groups, the last one masked (72 of 128)
 *   note: stream x 64 does not divide x = 150: 3 chunks, the last one masked (22 of 64)
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
__device__ __forceinline__ float nk_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float nk_warp_min(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float nk_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#define NK_THREADS 256
extern "C" __global__ void __launch_bounds__(256, 1) napkin_attention_0(const __nv_bfloat16* __restrict__ g_Q, const __nv_bfloat16* __restrict__ g_K, const __nv_bfloat16* __restrict__ g_V, __nv_bfloat16* __restrict__ g_O) {
    extern __shared__ __align__(16) unsigned char nk_smem[];
    const int nk_tid = threadIdx.x;
    int nk_block = blockIdx.x;
    int nk_inner = nk_block % 2; nk_block /= 2;  // the block within its L2 group
    const int g_q = (nk_block % 1) * 2 + nk_inner % 2; nk_block /= 1; nk_inner /= 2;
    const int o_q = g_q * 128;
    const int n_q = min(128, 200 - o_q);
    const int g_h = nk_block % 3; nk_block /= 3;
    const int o_h = g_h * 1;
    const int g_b = nk_block % 1; nk_block /= 1;
    const int o_b = g_b * 1;
    (void)nk_block;
    __nv_bfloat16* s_Q = reinterpret_cast<__nv_bfloat16*>(nk_smem + 0);
    float* s_O = reinterpret_cast<float*>(nk_smem + 0);
    float* s_P_max = reinterpret_cast<float*>(nk_smem + 32768);
    float* s_P_sum = reinterpret_cast<float*>(nk_smem + 33280);
    float* s_O_acc = reinterpret_cast<float*>(nk_smem + 33792);
    __nv_bfloat16* s_K = reinterpret_cast<__nv_bfloat16*>(nk_smem + 99328);
    float* s_S = reinterpret_cast<float*>(nk_smem + 99328);
    float* s_P = reinterpret_cast<float*>(nk_smem + 99328);
    float* s_P_scale = reinterpret_cast<float*>(nk_smem + 132096);
    __nv_bfloat16* s_V = reinterpret_cast<__nv_bfloat16*>(nk_smem + 132608);
    // load Q[b h q d] l2 -> smem
    {
        for (int t1 = nk_tid; t1 < 1 * 1 * 128 * 16; t1 += NK_THREADS) {
            int r2 = t1;
            const int i_d = (r2 % 16) * 8; r2 /= 16;
            const int i_q = r2 % 128; r2 /= 128;
            const int i_h = r2 % 1; r2 /= 1;
            const int i_b = r2 % 1; r2 /= 1;
            if (i_q < n_q) { *reinterpret_cast<uint4*>(&s_Q[(((i_b) * 1 + i_h) * 128 + i_q) * 128 + i_d]) = *reinterpret_cast<const uint4*>(&g_Q[((((o_b + i_b)) * 3 + (o_h + i_h)) * 200 + (o_q + i_q)) * 128 + (i_d)]); } else { *reinterpret_cast<uint4*>(&s_Q[(((i_b) * 1 + i_h) * 128 + i_q) * 128 + i_d]) = make_uint4(0u, 0u, 0u, 0u); }
        }
    }
    __syncthreads();
    // P.max[b h q] = -inf; P.sum[b h q] = 0
    {
        for (int t3 = nk_tid; t3 < (1) * (1) * (n_q); t3 += NK_THREADS) {
            int r4 = t3;
            const int i_q = r4 % (n_q); r4 /= (n_q);
            const int i_h = r4 % (1); r4 /= (1);
            const int i_b = r4 % (1); r4 /= (1);
            (void)r4;
            s_P_max[((i_b) * 1 + i_h) * 128 + i_q] = -NK_INF;
        }
        for (int t5 = nk_tid; t5 < (1) * (1) * (n_q); t5 += NK_THREADS) {
            int r6 = t5;
            const int i_q = r6 % (n_q); r6 /= (n_q);
            const int i_h = r6 % (1); r6 /= (1);
            const int i_b = r6 % (1); r6 /= (1);
            (void)r6;
            s_P_sum[((i_b) * 1 + i_h) * 128 + i_q] = 0.0f;
        }
    }
    __syncthreads();
    // O.acc[b h q d] = 0
    {
        for (int t7 = nk_tid; t7 < (1) * (1) * (n_q) * (128); t7 += NK_THREADS) {
            int r8 = t7;
            const int i_d = r8 % (128); r8 /= (128);
            const int i_q = r8 % (n_q); r8 /= (n_q);
            const int i_h = r8 % (1); r8 /= (1);
            const int i_b = r8 % (1); r8 /= (1);
            (void)r8;
            s_O_acc[(((i_b) * 1 + i_h) * 128 + i_q) * 128 + i_d] = 0.0f;
        }
    }
    __syncthreads();
    for (int c_x = 0; c_x < 3; ++c_x) {
        const int o_x = c_x * 64;
        const int n_x = min(64, 150 - o_x);
        // load K[b h x d] l2 -> smem
        {
            for (int t9 = nk_tid; t9 < 1 * 1 * 64 * 16; t9 += NK_THREADS) {
                int r10 = t9;
                const int i_d = (r10 % 16) * 8; r10 /= 16;
                const int i_x = r10 % 64; r10 /= 64;
                const int i_h = r10 % 1; r10 /= 1;
                const int i_b = r10 % 1; r10 /= 1;
                if (i_x < n_x) { *reinterpret_cast<uint4*>(&s_K[(((i_b) * 1 + i_h) * 64 + i_x) * 128 + i_d]) = *reinterpret_cast<const uint4*>(&g_K[((((o_b + i_b)) * 3 + (o_h + i_h)) * 150 + (o_x + i_x)) * 128 + (i_d)]); } else { *reinterpret_cast<uint4*>(&s_K[(((i_b) * 1 + i_h) * 64 + i_x) * 128 + i_d]) = make_uint4(0u, 0u, 0u, 0u); }
            }
        }
        __syncthreads();
        // S[b h q x] = Q[b h q d] * K[b h x d]
        {
            float stage[32];
            int k = 0;
            for (int t11 = nk_tid; t11 < (1) * (1) * (((n_q) + 3) / 4) * (((n_x) + 3) / 4); t11 += NK_THREADS) {
                int r12 = t11;
                const int b_x = r12 % (((n_x) + 3) / 4); r12 /= (((n_x) + 3) / 4);
                const int b_q = r12 % (((n_q) + 3) / 4); r12 /= (((n_q) + 3) / 4);
                const int i_h = r12 % (1); r12 /= (1);
                const int i_b = r12 % (1); r12 /= (1);
                (void)r12;
                float acc[4][4];
                for (int u = 0; u < 4; ++u) for (int v = 0; v < 4; ++v) acc[u][v] = 0.0f;
                for (int i_d = 0; i_d < 128; ++i_d) {
                    float a[4], b[4];
                    for (int u = 0; u < 4; ++u) {
                        const int i_q = b_q * 4 + u;
                        a[u] = (i_q < n_q) ? nk_f(s_Q[(((i_b) * 1 + i_h) * 128 + i_q) * 128 + i_d]) : 0.0f;
                    }
                    for (int v = 0; v < 4; ++v) {
                        const int i_x = b_x * 4 + v;
                        b[v] = (i_x < n_x) ? nk_f(s_K[(((i_b) * 1 + i_h) * 64 + i_x) * 128 + i_d]) : 0.0f;
                    }
                    for (int u = 0; u < 4; ++u) for (int v = 0; v < 4; ++v) acc[u][v] += a[u] * b[v];
                }
                for (int u = 0; u < 4; ++u) for (int v = 0; v < 4; ++v) {
                    const int i_q = b_q * 4 + u;
                    const int i_x = b_x * 4 + v;
                    if (i_q < n_q && i_x < n_x) {
                        stage[k++] = acc[u][v];
                    }
                }
            }
            __syncthreads();
            k = 0;
            for (int t13 = nk_tid; t13 < (1) * (1) * (((n_q) + 3) / 4) * (((n_x) + 3) / 4); t13 += NK_THREADS) {
                int r14 = t13;
                const int b_x = r14 % (((n_x) + 3) / 4); r14 /= (((n_x) + 3) / 4);
                const int b_q = r14 % (((n_q) + 3) / 4); r14 /= (((n_q) + 3) / 4);
                const int i_h = r14 % (1); r14 /= (1);
                const int i_b = r14 % (1); r14 /= (1);
                (void)r14;
                for (int u = 0; u < 4; ++u) for (int v = 0; v < 4; ++v) {
                    const int i_q = b_q * 4 + u;
                    const int i_x = b_x * 4 + v;
                    if (i_q < n_q && i_x < n_x) {
                        s_S[(((i_b) * 1 + i_h) * 128 + i_q) * 64 + i_x] = stage[k++];
                    }
                }
            }
        }
        __syncthreads();
        // S *= 1/sqrt(d)
        {
            for (int t15 = nk_tid; t15 < (1) * (1) * (n_q) * (n_x); t15 += NK_THREADS) {
                int r16 = t15;
                const int i_x = r16 % (n_x); r16 /= (n_x);
                const int i_q = r16 % (n_q); r16 /= (n_q);
                const int i_h = r16 % (1); r16 /= (1);
                const int i_b = r16 % (1); r16 /= (1);
                (void)r16;
                s_S[(((i_b) * 1 + i_h) * 128 + i_q) * 64 + i_x] = nk_f(s_S[(((i_b) * 1 + i_h) * 128 + i_q) * 64 + i_x]) * 0.08838834764831845f;
            }
        }
        __syncthreads();
        // m' = max(P.max, max[x](S[b h q x])); P.scale[b h q] = exp(P.max - m'); P.max = m'
        {
            for (int row17 = (nk_tid / 32); row17 < (1) * (1) * (n_q); row17 += (NK_THREADS / 32)) {
                int r18 = row17;
                const int i_q = r18 % (n_q); r18 /= (n_q);
                const int i_h = r18 % (1); r18 /= (1);
                const int i_b = r18 % (1); r18 /= (1);
                (void)r18;
                float chunk = -NK_INF;
                for (int e19 = (nk_tid % 32); e19 < (n_x); e19 += 32) {
                    int r20 = e19;
                    const int i_x = r20 % (n_x); r20 /= (n_x);
                    (void)r20;
                    chunk = fmaxf(chunk, nk_f(s_S[(((i_b) * 1 + i_h) * 128 + i_q) * 64 + i_x]));
                }
                chunk = nk_warp_max(chunk);
                const float old = nk_f(s_P_max[((i_b) * 1 + i_h) * 128 + i_q]);
                const float fresh = fmaxf(old, chunk);
                __syncwarp();
                if ((nk_tid % 32) == 0) {
                    s_P_scale[((i_b) * 1 + i_h) * 128 + i_q] = (old == -NK_INF) ? 0.0f : expf(old - fresh);
                    s_P_max[((i_b) * 1 + i_h) * 128 + i_q] = fresh;
                }
            }
        }
        __syncthreads();
        // P[b h q x] = exp(S[b h q x] - P.max); P.sum = P.sum * P.scale + sum[x](P)
        {
            for (int row21 = (nk_tid / 32); row21 < (1) * (1) * (n_q); row21 += (NK_THREADS / 32)) {
                int r22 = row21;
                const int i_q = r22 % (n_q); r22 /= (n_q);
                const int i_h = r22 % (1); r22 /= (1);
                const int i_b = r22 % (1); r22 /= (1);
                (void)r22;
                const float m = nk_f(s_P_max[((i_b) * 1 + i_h) * 128 + i_q]);
                float l = 0.0f;
                for (int e23 = (nk_tid % 32); e23 < (n_x); e23 += 32) {
                    int r24 = e23;
                    const int i_x = r24 % (n_x); r24 /= (n_x);
                    (void)r24;
                    const float p = expf(nk_f(s_S[(((i_b) * 1 + i_h) * 128 + i_q) * 64 + i_x]) - m);
                    s_P[(((i_b) * 1 + i_h) * 128 + i_q) * 64 + i_x] = p;
                    l += p;
                }
                l = nk_warp_sum(l);
                if ((nk_tid % 32) == 0) { s_P_sum[((i_b) * 1 + i_h) * 128 + i_q] = nk_f(s_P_sum[((i_b) * 1 + i_h) * 128 + i_q]) * nk_f(s_P_scale[((i_b) * 1 + i_h) * 128 + i_q]) + l; }
            }
        }
        __syncthreads();
        // load V[b h x d] l2 -> smem
        {
            for (int t25 = nk_tid; t25 < 1 * 1 * 64 * 16; t25 += NK_THREADS) {
                int r26 = t25;
                const int i_d = (r26 % 16) * 8; r26 /= 16;
                const int i_x = r26 % 64; r26 /= 64;
                const int i_h = r26 % 1; r26 /= 1;
                const int i_b = r26 % 1; r26 /= 1;
                if (i_x < n_x) { *reinterpret_cast<uint4*>(&s_V[(((i_b) * 1 + i_h) * 64 + i_x) * 128 + i_d]) = *reinterpret_cast<const uint4*>(&g_V[((((o_b + i_b)) * 3 + (o_h + i_h)) * 150 + (o_x + i_x)) * 128 + (i_d)]); } else { *reinterpret_cast<uint4*>(&s_V[(((i_b) * 1 + i_h) * 64 + i_x) * 128 + i_d]) = make_uint4(0u, 0u, 0u, 0u); }
            }
        }
        __syncthreads();
        // O.acc *= P.scale
        {
            for (int t27 = nk_tid; t27 < (1) * (1) * (n_q) * (128); t27 += NK_THREADS) {
                int r28 = t27;
                const int i_d = r28 % (128); r28 /= (128);
                const int i_q = r28 % (n_q); r28 /= (n_q);
                const int i_h = r28 % (1); r28 /= (1);
                const int i_b = r28 % (1); r28 /= (1);
                (void)r28;
                s_O_acc[(((i_b) * 1 + i_h) * 128 + i_q) * 128 + i_d] = nk_f(s_O_acc[(((i_b) * 1 + i_h) * 128 + i_q) * 128 + i_d]) * nk_f(s_P_scale[((i_b) * 1 + i_h) * 128 + i_q]);
            }
        }
        __syncthreads();
        // O.acc += P[b h q x] * V[b h x d]
        {
            for (int t29 = nk_tid; t29 < (1) * (1) * (((n_q) + 3) / 4) * (((128) + 3) / 4); t29 += NK_THREADS) {
                int r30 = t29;
                const int b_d = r30 % (((128) + 3) / 4); r30 /= (((128) + 3) / 4);
                const int b_q = r30 % (((n_q) + 3) / 4); r30 /= (((n_q) + 3) / 4);
                const int i_h = r30 % (1); r30 /= (1);
                const int i_b = r30 % (1); r30 /= (1);
                (void)r30;
                float acc[4][4];
                for (int u = 0; u < 4; ++u) for (int v = 0; v < 4; ++v) acc[u][v] = 0.0f;
                for (int i_x = 0; i_x < n_x; ++i_x) {
                    float a[4], b[4];
                    for (int u = 0; u < 4; ++u) {
                        const int i_q = b_q * 4 + u;
                        a[u] = (i_q < n_q) ? nk_f(s_P[(((i_b) * 1 + i_h) * 128 + i_q) * 64 + i_x]) : 0.0f;
                    }
                    for (int v = 0; v < 4; ++v) {
                        const int i_d = b_d * 4 + v;
                        b[v] = (i_d < 128) ? nk_f(s_V[(((i_b) * 1 + i_h) * 64 + i_x) * 128 + i_d]) : 0.0f;
                    }
                    for (int u = 0; u < 4; ++u) for (int v = 0; v < 4; ++v) acc[u][v] += a[u] * b[v];
                }
                for (int u = 0; u < 4; ++u) for (int v = 0; v < 4; ++v) {
                    const int i_q = b_q * 4 + u;
                    const int i_d = b_d * 4 + v;
                    if (i_q < n_q && i_d < 128) {
                        s_O_acc[(((i_b) * 1 + i_h) * 128 + i_q) * 128 + i_d] = nk_f(s_O_acc[(((i_b) * 1 + i_h) * 128 + i_q) * 128 + i_d]) + acc[u][v];
                    }
                }
            }
        }
        __syncthreads();
    }
    // O = O.acc / P.sum
    {
        float stage[64];
        {
            int k = 0;
            for (int t31 = nk_tid; t31 < (1) * (1) * (n_q) * (128); t31 += NK_THREADS) {
                int r32 = t31;
                const int i_d = r32 % (128); r32 /= (128);
                const int i_q = r32 % (n_q); r32 /= (n_q);
                const int i_h = r32 % (1); r32 /= (1);
                const int i_b = r32 % (1); r32 /= (1);
                (void)r32;
                stage[k++] = nk_f(s_O_acc[(((i_b) * 1 + i_h) * 128 + i_q) * 128 + i_d]) / nk_f(s_P_sum[((i_b) * 1 + i_h) * 128 + i_q]);
            }
        }
        __syncthreads();
        {
            int k = 0;
            for (int t33 = nk_tid; t33 < (1) * (1) * (n_q) * (128); t33 += NK_THREADS) {
                int r34 = t33;
                const int i_d = r34 % (128); r34 /= (128);
                const int i_q = r34 % (n_q); r34 /= (n_q);
                const int i_h = r34 % (1); r34 /= (1);
                const int i_b = r34 % (1); r34 /= (1);
                (void)r34;
                s_O[(((i_b) * 1 + i_h) * 128 + i_q) * 128 + i_d] = stage[k++];
            }
        }
    }
    __syncthreads();
    // save O[b h q d] smem -> l2
    {
        for (int t35 = nk_tid; t35 < (1) * (1) * (n_q) * (128); t35 += NK_THREADS) {
            int r36 = t35;
            const int i_d = r36 % (128); r36 /= (128);
            const int i_q = r36 % (n_q); r36 /= (n_q);
            const int i_h = r36 % (1); r36 /= (1);
            const int i_b = r36 % (1); r36 /= (1);
            (void)r36;
            g_O[((((o_b + i_b)) * 3 + (o_h + i_h)) * 200 + (o_q + i_q)) * 128 + (i_d)] = __float2bfloat16(nk_f(s_O[(((i_b) * 1 + i_h) * 128 + i_q) * 128 + i_d]));
        }
    }
    __syncthreads();
}
