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
 * instruction paths:
 *   napkin_attention_0: mma.sync
 *     registers: group q 32 (4 warps of 32 q rows); cp.async 2 stages for K, V; the stream loop rolled, one chunk a trip (fragments over 160 registers, within 204)
 *     S: mma.sync.m16n8k16 bf16 -> f32, A = Q by ldmatrix, B = K by ldmatrix
 *     P: fma on q x x fragments in registers
 *     O: mma.sync.m16n8k16 bf16 -> f32, A = P from registers (packed to bf16), B = V by ldmatrix.trans
 *
 * cost of attention on H100 with b=1 h=3 q=200 x=150 d=128
 *   level      per     H (values)  H (bytes)  M (values)  M (bytes)  capacity    N    FLOP/B  transfer time
 *   l2         device  268,800     537,600    89,600      179,200    52,428,800  3    87.1    0.16 us
 *   smem       block   384,000     768,000    49,152      98,304     232,448     6    61.0    0.0768 us
 *   registers  thread  1,152,000   2,304,000  204         816        1,020       128  20.3    0.0746 us
 *   FLOPs: tensor 46,080,000, fma 674,400, special 91,800  (total 46,846,200)
 *   predicted time: 4.99 us overlapped (compute-bound), 7.31 us serial; compute 2.81 us, 1 wave of 264 blocks (2 per SM, bound by shared memory)
 *   compute by unit, at each unit's peak, in turn: tensor cores 0.0933 us, FP32 (FMA pipe) 0.0109 us, MUFU (exp, rcp) 0.0237 us; the most: tensor cores
 *   fixed costs (in the time above): launch 2 us, fill 0.117 us, drain 0.0587 us
 *   predicted throughput: 9.4 TFLOP/s
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

#define NK_THREADS 256
extern "C" __global__ void __launch_bounds__(128, 1) napkin_attention_0(const __nv_bfloat16* __restrict__ g_Q, const __nv_bfloat16* __restrict__ g_K, const __nv_bfloat16* __restrict__ g_V, __nv_bfloat16* __restrict__ g_O) {
    extern __shared__ __align__(128) unsigned char nk_smem[];
    const int nk_tid = threadIdx.x;
    const int nk_warp = nk_tid >> 5, nk_lane = nk_tid & 31;
    const int nk_g = nk_lane >> 2, nk_t = nk_lane & 3;
    const int nk_wrow = nk_warp * 32;  // the warp's first row of the q tile
    const unsigned nk_sbase = (unsigned)__cvta_generic_to_shared(nk_smem);
    int nk_block = blockIdx.x;
    int nk_inner = nk_block % 2; nk_block /= 2;  // the block within its L2 group
    const int grp_q = (nk_block % 1) * 2 + nk_inner % 2; nk_block /= 1; nk_inner /= 2;
    const int o_q = grp_q * 128;
    const int n_q = min(128, 200 - o_q);
    const int grp_h = nk_block % 3; nk_block /= 3;
    const int o_h = grp_h * 1;
    const int grp_b = nk_block % 1; nk_block /= 1;
    const int o_b = grp_b * 1;
    (void)nk_block; (void)nk_g; (void)nk_t; (void)nk_wrow;
    const int nk_lb0 = ((((((nk_lane & 7) + (nk_lane >> 4) * 8)) * 256)) + (((((((((nk_lane >> 3) & 1) << 3)) * 2) >> 4) ^ (((((nk_lane & 7) + (nk_lane >> 4) * 8)) >> 0) & 7))) << 4));  // K: this lane's ldmatrix row and swizzle key
    const int nk_lb1 = ((((((nk_lane & 7) + (((nk_lane >> 3) & 1) << 3))) * 256)) + (((((((nk_lane >> 4) * 8) * 2) >> 4) ^ (((((nk_lane & 7) + (((nk_lane >> 3) & 1) << 3))) >> 0) & 7))) << 4));  // Q: this lane's ldmatrix row and swizzle key
    const int nk_lb2 = ((((((nk_lane & 7) + (((nk_lane >> 3) & 1) << 3))) * 256)) + (((((((nk_lane >> 4) * 8) * 2) >> 4) ^ (((((nk_lane & 7) + (((nk_lane >> 3) & 1) << 3))) >> 0) & 7))) << 4));  // V: this lane's ldmatrix row and swizzle key
    const int nk_cr_K = nk_tid / 16, nk_cc_K = (nk_tid % 16) * 8;  // K: this thread's copy
    const int nk_cs_K = ((nk_cr_K) * 256 + (((((nk_cc_K) * 2) >> 4) ^ (((nk_cr_K) >> 0) & 7)) << 4) + (((nk_cc_K) * 2) & 15));
    const int nk_cg_K = ((((o_b)) * 3 + (o_h)) * 150 + (nk_cr_K)) * 128 + (nk_cc_K);
    const int nk_cr_Q = nk_tid / 16, nk_cc_Q = (nk_tid % 16) * 8;  // Q: this thread's copy
    const int nk_cs_Q = ((nk_cr_Q) * 256 + (((((nk_cc_Q) * 2) >> 4) ^ (((nk_cr_Q) >> 0) & 7)) << 4) + (((nk_cc_Q) * 2) & 15));
    const int nk_cg_Q = ((((o_b)) * 3 + (o_h)) * 200 + (o_q + nk_cr_Q)) * 128 + (nk_cc_Q);
    const int nk_cr_V = nk_tid / 16, nk_cc_V = (nk_tid % 16) * 8;  // V: this thread's copy
    const int nk_cs_V = ((nk_cr_V) * 256 + (((((nk_cc_V) * 2) >> 4) ^ (((nk_cr_V) >> 0) & 7)) << 4) + (((nk_cc_V) * 2) & 15));
    const int nk_cg_V = ((((o_b)) * 3 + (o_h)) * 150 + (nk_cr_V)) * 128 + (nk_cc_V);
    float f_P__max[2][2];
    float f_P__sum[2][2];
    float f_O__acc[2][16][4];
    float f_S[2][8][4];
    float f_P__scale[2][2];
    unsigned f_P[2][8][2];  // packed to bf16 pairs
    float f_O[2][16][4];
    float nk_top_P[2][2];  // P's shift this chunk (log2 domain)
    // load Q[b h q d] l2 -> smem
    NK_UNROLL
    for (int v = 0; v < 16; ++v) {
        NK_CP16(32768 + nk_cs_Q + v * 2048, g_Q + nk_cg_Q + v * 1024, (o_q + nk_cr_Q + v * 8 < 200));
    }
    NK_CP_COMMIT();
    // P.max[b h q] = -inf; P.sum[b h q] = 0
    {
        NK_UNROLL
        for (int mt = 0; mt < 2; ++mt) {
            NK_UNROLL
            for (int h = 0; h < 2; ++h) {
                f_P__max[mt][h] = -NK_INF;
            }
        }
        NK_UNROLL
        for (int mt = 0; mt < 2; ++mt) {
            NK_UNROLL
            for (int h = 0; h < 2; ++h) {
                f_P__sum[mt][h] = 0.0f;
            }
        }
    }
    // O.acc[b h q d] = 0
    {
        NK_UNROLL
        for (int mt = 0; mt < 2; ++mt) {
            NK_UNROLL
            for (int nt = 0; nt < 16; ++nt) {
                NK_UNROLL
                for (int i = 0; i < 4; ++i) {
                    f_O__acc[mt][nt][i] = 0.0f;
                }
            }
        }
    }
    // for x in 3 chunks of 64, 2 stages: chunk c + 1 loads while chunk c computes
    NK_UNROLL
    for (int v = 0; v < 8; ++v) {
        NK_CP16(0 + (0) * 16384 + nk_cs_K + v * 2048, g_K + nk_cg_K + (0) * 128 + v * 1024, (0 + nk_cr_K + v * 8 < 150));
    }
    NK_UNROLL
    for (int v = 0; v < 8; ++v) {
        NK_CP16(65536 + (0) * 16384 + nk_cs_V + v * 2048, g_V + nk_cg_V + (0) * 128 + v * 1024, (0 + nk_cr_V + v * 8 < 150));
    }
    NK_CP_COMMIT();
    NK_ROLLED
    for (int c_x = 0; c_x < 3; ++c_x) {  // one chunk a trip
        const int o_x = c_x * 64;
        NK_CP_WAIT(0);  // this chunk's group has landed
        NK_SYNC();  // ... for every thread, and every warp is done with the previous chunk's buffers
        if (c_x + 1 < 3) {
            NK_UNROLL
            for (int v = 0; v < 8; ++v) {
                NK_CP16(0 + (((c_x & 1) + 1) % 2) * 16384 + nk_cs_K + v * 2048, g_K + nk_cg_K + ((o_x + 64)) * 128 + v * 1024, ((o_x + 64) + nk_cr_K + v * 8 < 150));
            }
            NK_UNROLL
            for (int v = 0; v < 8; ++v) {
                NK_CP16(65536 + (((c_x & 1) + 1) % 2) * 16384 + nk_cs_V + v * 2048, g_V + nk_cg_V + ((o_x + 64)) * 128 + v * 1024, ((o_x + 64) + nk_cr_V + v * 8 < 150));
            }
        }
        NK_CP_COMMIT();  // one group per chunk, empty near the end: wait_group counts them
        const int n_x = min(64, 150 - o_x);
        // S[b h q x] = Q[b h q d] * K[b h x d]
        {
            NK_UNROLL
            for (int mt = 0; mt < 2; ++mt) {
                NK_UNROLL
                for (int nt = 0; nt < 8; ++nt) {
                    NK_UNROLL
                    for (int i = 0; i < 4; ++i) {
                        f_S[mt][nt][i] = 0.0f;
                    }
                }
            }
            NK_UNROLL
            for (int kk = 0; kk < 8; ++kk) {
                unsigned a[2][4];
                NK_UNROLL
                for (int mt = 0; mt < 2; ++mt) {
                    NK_LDSM(a[mt], 32768 + (((nk_lb1) ^ (((((((kk * 16)) * 2) >> 4)) & 7) << 4)) + ((nk_wrow + mt * 16)) * 256 + (((((((kk * 16)) * 2) >> 4)) & 65528) << 4)));
                }
                NK_UNROLL
                for (int np = 0; np < 4; ++np) {
                    unsigned b[4];
                    NK_LDSM(b, 0 + ((c_x & 1)) * 16384 + (((nk_lb0) ^ (((((((kk * 16)) * 2) >> 4)) & 7) << 4)) + ((np * 16)) * 256 + (((((((kk * 16)) * 2) >> 4)) & 65528) << 4)));
                    NK_UNROLL
                    for (int mt = 0; mt < 2; ++mt) {
                        NK_MMA_BF16(f_S[mt][2 * np], a[mt], b[0], b[1]);
                        NK_MMA_BF16(f_S[mt][2 * np + 1], a[mt], b[2], b[3]);
                    }
                }
            }
        }
        // S *= 1/sqrt(d)
        {
            // folded into the softmax's exp2 argument: one FFMA a value
        }
        // m' = max(P.max, max[x](S[b h q x])); P.scale[b h q] = exp(P.max - m'); P.max = m'
        {
            NK_UNROLL
            for (int mt = 0; mt < 2; ++mt) {
                NK_UNROLL
                for (int h = 0; h < 2; ++h) {
                    float chunk = -NK_INF;
                    NK_UNROLL
                    for (int nt = 0; nt < 8; ++nt) {
                        NK_UNROLL
                        for (int e = 0; e < 2; ++e) {
                            const int i = 2 * h + e;
                            chunk = fmaxf(chunk, (((nt * 8 + 2 * nk_t + (i & 1)) < n_x) ? f_S[mt][nt][i] : -NK_INF));
                        }
                    }
                    chunk = fmaxf(chunk, NK_SHFL_XOR(chunk, 1));
                    chunk = fmaxf(chunk, NK_SHFL_XOR(chunk, 2));
                    const float old = f_P__max[mt][h];
                    const float fresh = fmaxf(old, chunk * 0.12751743082459868f);
                    const float top = (fresh == -NK_INF) ? 0.0f : fresh;
                    f_P__scale[mt][h] = nk_exp2(old - top);
                    f_P__max[mt][h] = fresh;
                    nk_top_P[mt][h] = top;
                }
            }
        }
        // P[b h q x] = exp(S[b h q x] - P.max); P.sum = P.sum * P.scale + sum[x](P)
        {
            NK_UNROLL
            for (int mt = 0; mt < 2; ++mt) {
                NK_UNROLL
                for (int h = 0; h < 2; ++h) {
                    const float top = nk_top_P[mt][h];
                    float part = 0.0f;
                    NK_UNROLL
                    for (int nt = 0; nt < 8; ++nt) {
                        float p0, p1;
                        {
                            const int i = 2 * h;
                            p0 = ((nt * 8 + 2 * nk_t + (i & 1)) < n_x) ? nk_exp2(f_S[mt][nt][i] * 0.12751743082459868f - top) : 0.0f;
                        }
                        {
                            const int i = 2 * h + 1;
                            p1 = ((nt * 8 + 2 * nk_t + (i & 1)) < n_x) ? nk_exp2(f_S[mt][nt][i] * 0.12751743082459868f - top) : 0.0f;
                        }
                        const unsigned pk = NK_PACK_BF16(p0, p1);
                        f_P[mt][nt][h] = pk;
                        part += NK_LO_BF16(pk) + NK_HI_BF16(pk);
                    }
                    f_P__sum[mt][h] = f_P__sum[mt][h] * f_P__scale[mt][h] + part;
                }
            }
        }
        // O.acc *= P.scale
        {
            NK_UNROLL
            for (int mt = 0; mt < 2; ++mt) {
                NK_UNROLL
                for (int nt = 0; nt < 16; ++nt) {
                    NK_UNROLL
                    for (int i = 0; i < 4; ++i) {
                        f_O__acc[mt][nt][i] *= f_P__scale[mt][i >> 1];
                    }
                }
            }
        }
        // O.acc += P[b h q x] * V[b h x d]
        {
            NK_UNROLL
            for (int kk = 0; kk < 4; ++kk) {
                unsigned a[2][4];
                NK_UNROLL
                for (int mt = 0; mt < 2; ++mt) {
                    a[mt][0] = f_P[mt][2 * kk][0];
                    a[mt][1] = f_P[mt][2 * kk][1];
                    a[mt][2] = f_P[mt][2 * kk + 1][0];
                    a[mt][3] = f_P[mt][2 * kk + 1][1];
                }
                NK_UNROLL
                for (int np = 0; np < 8; ++np) {
                    unsigned b[4];
                    NK_LDSM_T(b, 65536 + ((c_x & 1)) * 16384 + (((nk_lb2) ^ (((((((np * 16)) * 2) >> 4)) & 7) << 4)) + ((kk * 16)) * 256 + (((((((np * 16)) * 2) >> 4)) & 65528) << 4)));
                    NK_UNROLL
                    for (int mt = 0; mt < 2; ++mt) {
                        NK_MMA_BF16(f_O__acc[mt][2 * np], a[mt], b[0], b[1]);
                        NK_MMA_BF16(f_O__acc[mt][2 * np + 1], a[mt], b[2], b[3]);
                    }
                }
            }
        }
    }
    NK_CP_WAIT(0);
    NK_SYNC();
    // O = O.acc / P.sum
    {
        NK_UNROLL
        for (int mt = 0; mt < 2; ++mt) {
            NK_UNROLL
            for (int h = 0; h < 2; ++h) {
                f_P__sum[mt][h] += NK_SHFL_XOR(f_P__sum[mt][h], 1);
                f_P__sum[mt][h] += NK_SHFL_XOR(f_P__sum[mt][h], 2);
            }
        }
        float nk_inv[2][2];
        NK_UNROLL
        for (int mt = 0; mt < 2; ++mt) {
            NK_UNROLL
            for (int h = 0; h < 2; ++h) {
                nk_inv[mt][h] = (f_P__sum[mt][h] == 0.0f) ? 0.0f : 1.0f / f_P__sum[mt][h];
            }
        }
        NK_UNROLL
        for (int mt = 0; mt < 2; ++mt) {
            NK_UNROLL
            for (int nt = 0; nt < 16; ++nt) {
                NK_UNROLL
                for (int i = 0; i < 4; ++i) {
                    f_O[mt][nt][i] = f_O__acc[mt][nt][i] * nk_inv[mt][i >> 1];
                }
            }
        }
    }
    // save O[b h q d] smem -> l2
    {
        NK_SYNC();  // the arena is free: the last reader of shared memory is done
        NK_UNROLL
        for (int mt = 0; mt < 2; ++mt) {
            NK_UNROLL
            for (int nt = 0; nt < 16; ++nt) {
                NK_UNROLL
                for (int h = 0; h < 2; ++h) {
                    *reinterpret_cast<unsigned*>(nk_smem + (((nk_wrow + mt * 16 + nk_g + h * 8)) * 256 + ((((((nt * 8 + 2 * nk_t)) * 2) >> 4) ^ ((((nk_wrow + mt * 16 + nk_g + h * 8)) >> 0) & 7)) << 4) + ((((nt * 8 + 2 * nk_t)) * 2) & 15))) = NK_PACK_BF16(f_O[mt][nt][2 * h], f_O[mt][nt][2 * h + 1]);
                }
            }
        }
        NK_SYNC();  // the staged tile is whole before any thread reads it
        for (int u = nk_tid; u < 2048; u += 128) {
            const int r = u / 16, c = (u % 16) * 8;
            if ((o_q + r < 200)) NK_ST16(g_O + (((((o_b)) * 3 + (o_h)) * 200 + (o_q + r)) * 128 + (c)), ((r) * 256 + (((((c) * 2) >> 4) ^ (((r) >> 0) & 7)) << 4) + (((c) * 2) & 15)));
        }
    }
}
