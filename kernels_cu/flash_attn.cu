// flash_attn.cu: fused attention forward, FlashAttention-2 (Dao 2023, Algorithm 1).
//
// Variants (reached through cupyattn.attention(..., impl=...)):
//   v1 flash_attn_fwd   SIMT, fp32/fp16/bf16. One CTA per (query tile Q_i, batch*head); each warp
//                       owns ROWS = BLOCK_M / NUM_WARPS query rows; for S_ij = Q_i K_j^T lane t
//                       takes keys t, t+32, ..; for O_i += P_ij V_j lane t takes columns t, t+32, ..
//                       Online softmax in the log2 domain (scores pre-multiplied by log2(e)), S and
//                       P never leave the chip, one division by l_i at the end. impl="flash".
//   v2 flash_attn_mma   tensor cores, fp16/bf16 only: each warp owns 16 query rows; S_ij = Q_i K_j^T
//                       and O_i += P_ij V_j are mma.sync.m16n8k16 (fp32 accumulate); P_ij goes
//                       from the S accumulator layout straight into A fragments (no smem trip);
//                       same tiling, masking and online softmax as v1. impl="flash_mma".
//                       Fragments come from padded smem by plain 32-bit loads (no ldmatrix, no
//                       cp.async pipelining yet: those are the next steps for speed).
// Both also run on the CPU emulator of the GPU test tier (tests/emu: one fiber per thread, mma.sync
// rebuilt from the PTX ISA fragment tables), which checks their logic on machines without a GPU.
//
// Tile tables: cupyattn/config.py FLASH_SIMT_TILES and FLASH_MMA_TILES, with the reason for each
// entry; the op module (cupyattn/flash_attn.py) instantiates them as template arguments. The
// static_asserts below check that each entry fits the 48 KB of static shared memory.
//
// Masking, all applied to S_ij before the row max (so hidden keys get P = 0 exactly):
//   - keys j >= Sk or j >= key_lengths[b] (clamped to [0, Sk]) and, with CAUSAL, j > i + Sk - Sq
//     (bottom-right aligned) get -inf; key tiles past the last visible key are never loaded;
//   - `mask` is an additive fp32 tensor read through 4 element strides (0 for broadcast dims);
//   - a row that sees no key keeps m_i = -inf, l_i = 0 and is written as zeros, lse = -inf.
#include "common.cuh"
#include "ptx.cuh"

// --- helpers -------------------------------------------------------------------------------
// Two adjacent elements of a shared tile as floats (16-bit types: one 32-bit load).
__device__ __forceinline__ float2 ld2(const float* p) { return make_float2(p[0], p[1]); }
__device__ __forceinline__ float2 ld2(const __half* p) {
    return __half22float2(*reinterpret_cast<const __half2*>(p));
}
__device__ __forceinline__ float2 ld2(const __nv_bfloat16* p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}

// Shared memory the v1 kernel uses for one tile configuration (also used by static_assert).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N>
struct FlashSmem {
    // K rows padded to an odd number of 32-bit words: lanes reading K[lane][d] hit distinct banks.
    static constexpr int KV_STRIDE = HEAD_DIM + (sizeof(T) == 4 ? 1 : 2);
    static constexpr int BYTES = (BLOCK_M * HEAD_DIM + BLOCK_N * KV_STRIDE) * (int)sizeof(T)
                                 + BLOCK_M * BLOCK_N * (int)sizeof(float);
};

// Cooperative copy of `rows` x HEAD_DIM elements (row stride `gstride` elements in global memory)
// into a shared tile with row stride SSTRIDE; rows >= `valid` are zero-filled, so garbage past the
// end of a sequence (e.g. an unwritten KV cache) never reaches the arithmetic.
template <typename T, int HEAD_DIM, int SSTRIDE, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(T* __restrict__ dst, const T* __restrict__ src,
                                          long long gstride, int valid) {
    for (int idx = threadIdx.x; idx < ROWS * HEAD_DIM; idx += THREADS) {
        const int r = idx / HEAD_DIM, c = idx % HEAD_DIM;
        dst[r * SSTRIDE + c] = r < valid ? src[(long long)r * gstride + c] : from_float<T>(0.0f);
    }
}

// --- v1: SIMT FlashAttention-2 forward -----------------------------------------------------
// grid (ceil(Sq / BLOCK_M), min(B*Hq, 65535), ceil(B*Hq / 65535)); block NUM_WARPS * 32.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flash_attn_fwd(const T* __restrict__ q,          // [B, Hq, Sq, D], strides q_sb/q_sh/q_ss, last dim contiguous
               const T* __restrict__ k,          // [B, Hkv, Sk, D], strides k_s*
               const T* __restrict__ v,          // [B, Hkv, Sk, D], strides v_s*
               T* __restrict__ out,              // [B, Hq, Sq, D] C-contiguous
               float* __restrict__ lse,          // [B, Hq, Sq] C-contiguous, natural log; or null
               const float* __restrict__ mask,   // additive, broadcast to [B, Hq, Sq, Sk] by m_s*; or null
               const int* __restrict__ key_lengths,  // [B]; or null
               int B, int Hq, int Hkv, int Sq, int Sk,
               long long q_sb, long long q_sh, long long q_ss,
               long long k_sb, long long k_sh, long long k_ss,
               long long v_sb, long long v_sh, long long v_ss,
               long long m_sb, long long m_sh, long long m_sq, long long m_sk,
               float scale_log2) {                // softmax scale * log2(e)
    constexpr int THREADS = NUM_WARPS * 32;
    constexpr int ROWS = BLOCK_M / NUM_WARPS;      // query rows per warp
    constexpr int KEYS = BLOCK_N / 32;             // keys per lane in S_ij
    constexpr int COLS = (HEAD_DIM + 31) / 32;     // output columns per lane in O_i
    using Smem = FlashSmem<T, HEAD_DIM, BLOCK_M, BLOCK_N>;
    constexpr int KV_STRIDE = Smem::KV_STRIDE;
    static_assert(BLOCK_M % NUM_WARPS == 0 && BLOCK_N % 32 == 0 && HEAD_DIM % 2 == 0, "tile shape");
    static_assert(Smem::BYTES <= 48 * 1024, "tile exceeds 48 KB of static shared memory");

    __shared__ __align__(16) T q_s[BLOCK_M * HEAD_DIM];     // Q_i  [BLOCK_M, D]
    __shared__ __align__(16) T kv_s[BLOCK_N * KV_STRIDE];   // K_j, then V_j  [BLOCK_N, D (+pad)]
    __shared__ float p_s[BLOCK_M * BLOCK_N];                // P_ij [BLOCK_M, BLOCK_N], rows by warp

    const long long bh = (long long)blockIdx.z * gridDim.y + blockIdx.y;
    if (bh >= (long long)B * Hq) return;  // whole CTA leaves together
    const int b = (int)(bh / Hq), h = (int)(bh % Hq);
    const int hk = h / (Hq / Hkv);        // GQA: query head h reads kv head h / group size
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int m0 = blockIdx.x * BLOCK_M;  // first query row of Q_i
    const int row0 = warp * ROWS;         // first row of this warp inside the tile

    q += b * q_sb + h * q_sh + (long long)m0 * q_ss;
    k += b * k_sb + hk * k_sh;
    v += b * v_sb + hk * v_sh;
    if (mask) mask += b * m_sb + h * m_sh;

    // Keys this tile may see: [0, k_end). Causal (bottom-right): row i sees j <= i + Sk - Sq, so
    // key tiles from the last row's limit on are skipped entirely, not computed and masked.
    const int diag = Sk - Sq;
    int k_end = Sk;
    if (key_lengths) k_end = min(k_end, max(key_lengths[b], 0));
    if (CAUSAL) k_end = min(k_end, m0 + BLOCK_M + diag);  // last row's j <= m0 + BLOCK_M - 1 + diag

    // Load Q_i from HBM to SRAM (rows past Sq as zeros; they are computed but never stored).
    load_tile<T, HEAD_DIM, HEAD_DIM, BLOCK_M, THREADS>(q_s, q, q_ss, Sq - m0);

    // On chip: O_i = 0, l_i = 0, m_i = -inf. l holds this lane's partial row sum: the rescale
    // factor is the same for every lane, so one warp reduction at the end suffices.
    float o[ROWS][COLS], m[ROWS], l[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        m[r] = -CUDART_INF_F;
        l[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < COLS; ++c) o[r][c] = 0.0f;
    }

    for (int n0 = 0; n0 < k_end; n0 += BLOCK_N) {
        // Load K_j from HBM to SRAM (the barrier also retires the previous V_j readers).
        __syncthreads();
        load_tile<T, HEAD_DIM, KV_STRIDE, BLOCK_N, THREADS>(kv_s, k + (long long)n0 * k_ss, k_ss,
                                                             k_end - n0);
        __syncthreads();

        // S_ij = Q_i K_j^T on chip; lane owns keys n0 + lane + 32 * jj.
        float s[ROWS][KEYS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int jj = 0; jj < KEYS; ++jj) s[r][jj] = 0.0f;
#pragma unroll 4
        for (int d = 0; d < HEAD_DIM; d += 2) {
            float2 kk[KEYS];
#pragma unroll
            for (int jj = 0; jj < KEYS; ++jj) kk[jj] = ld2(&kv_s[(lane + 32 * jj) * KV_STRIDE + d]);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float2 qq = ld2(&q_s[(row0 + r) * HEAD_DIM + d]);  // broadcast read
#pragma unroll
                for (int jj = 0; jj < KEYS; ++jj)
                    s[r][jj] = fmaf(qq.x, kk[jj].x, fmaf(qq.y, kk[jj].y, s[r][jj]));
            }
        }

#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int i = m0 + row0 + r;
            // Scale to log2 units, add the mask, hide invisible keys.
            float mx = -CUDART_INF_F;
#pragma unroll
            for (int jj = 0; jj < KEYS; ++jj) {
                const int j = n0 + lane + 32 * jj;
                float x = s[r][jj] * scale_log2;
                if (mask && i < Sq && j < k_end) x = fmaf(mask[i * m_sq + j * m_sk], LOG2E_F, x);
                if (j >= k_end || (CAUSAL && j > i + diag)) x = -CUDART_INF_F;
                s[r][jj] = x;
                mx = fmaxf(mx, x);
            }
            // m_i^(j) = max(m_i^(j-1), rowmax(S_ij))
            const float m_new = fmaxf(m[r], warp_reduce_max(mx));
            // Rows that have seen no key yet keep m = -inf; subtract 0 so exp2 gives 0, not NaN.
            const float m_use = m_new == -CUDART_INF_F ? 0.0f : m_new;
            // P_ij = exp(S_ij - m_i^(j)), written to this warp's rows of p_s.
            float rowsum = 0.0f;
#pragma unroll
            for (int jj = 0; jj < KEYS; ++jj) {
                const float p = exp2f(s[r][jj] - m_use);
                p_s[(row0 + r) * BLOCK_N + lane + 32 * jj] = p;
                rowsum += p;
            }
            // l_i^(j) = exp(m_i^(j-1) - m_i^(j)) l_i^(j-1) + rowsum(P_ij); the same factor rescales
            // O_i below (exp2(-inf) = 0 on the first visible tile).
            const float alpha = exp2f(m[r] - m_use);
            l[r] = fmaf(alpha, l[r], rowsum);
            m[r] = m_new;
#pragma unroll
            for (int c = 0; c < COLS; ++c) o[r][c] *= alpha;
        }

        // Load V_j from HBM to SRAM into the buffer K_j used (every warp must be done with K_j).
        __syncthreads();
        load_tile<T, HEAD_DIM, KV_STRIDE, BLOCK_N, THREADS>(kv_s, v + (long long)n0 * v_ss, v_ss,
                                                             k_end - n0);
        __syncthreads();

        // O_i^(j) = diag(exp(m^(j-1) - m^(j))) O_i^(j-1) + P_ij V_j  (rescale done above).
#pragma unroll 2
        for (int j = 0; j < BLOCK_N; ++j) {
            float vv[COLS];
#pragma unroll
            for (int c = 0; c < COLS; ++c) {
                const int d = lane + 32 * c;
                vv[c] = d < HEAD_DIM ? to_float(kv_s[j * KV_STRIDE + d]) : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float p = p_s[(row0 + r) * BLOCK_N + j];  // broadcast read
#pragma unroll
                for (int c = 0; c < COLS; ++c) o[r][c] = fmaf(p, vv[c], o[r][c]);
            }
        }
    }

    // O_i = diag(l_i)^-1 O_i, L_i = m_i + log(l_i) (natural log: m is in log2 units); rows with
    // l_i = 0 saw no key and are written as zeros with L_i = -inf.
    const long long obase = bh * Sq;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float lsum = warp_reduce_sum(l[r]);
        const int i = m0 + row0 + r;
        if (i >= Sq) continue;  // same for the whole warp
        const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
        T* orow = out + (obase + i) * HEAD_DIM;
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const int d = lane + 32 * c;
            if (d < HEAD_DIM) orow[d] = from_float<T>(o[r][c] * inv);
        }
        if (lse && lane == 0) lse[obase + i] = lsum > 0.0f ? m[r] * LN2_F + logf(lsum) : -CUDART_INF_F;
    }
}

// --- v2: tensor-core (mma.sync m16n8k16) FlashAttention-2 forward, fp16 / bf16 -------------
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"),
// g = lane / 4, t = lane % 4, each register holds 2 consecutive elements (low half first):
//   A 16x16 row-major: reg0 (g, 2t..2t+1), reg1 (g+8, 2t..), reg2 (g, 2t+8..), reg3 (g+8, 2t+8..)
//   B 16x8 (k x n):    reg0 (k = 2t..2t+1, n = g), reg1 (k = 2t+8..2t+9, n = g)
//   C/D 16x8 fp32:     c0,c1 (g, 2t..2t+1), c2,c3 (g+8, 2t..2t+1)
// Two 16-bit elements at p (4-byte aligned) as one fragment register.
template <typename T> __device__ __forceinline__ unsigned ld_pair(const T* p) {
    return *reinterpret_cast<const unsigned*>(p);
}
// Two 16-bit elements from different rows (lo = *p0, hi = *p1) as one register.
template <typename T> __device__ __forceinline__ unsigned ld_split(const T* p0, const T* p1) {
    return (unsigned)*reinterpret_cast<const unsigned short*>(p0)
           | ((unsigned)*reinterpret_cast<const unsigned short*>(p1) << 16);
}

// Max / sum over the 4 lanes of a quad (the lanes that share a row of a C fragment).
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// grid and arguments as flash_attn_fwd; block NUM_WARPS * 32, BLOCK_M = 16 * NUM_WARPS.
template <typename T, int HEAD_DIM, int BLOCK_N, int NUM_WARPS, bool CAUSAL>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flash_attn_mma(const T* __restrict__ q,          // [B, Hq, Sq, D], strides q_s*, last dim contiguous
               const T* __restrict__ k,          // [B, Hkv, Sk, D], strides k_s*
               const T* __restrict__ v,          // [B, Hkv, Sk, D], strides v_s*
               T* __restrict__ out,              // [B, Hq, Sq, D] C-contiguous
               float* __restrict__ lse,          // [B, Hq, Sq] or null
               const float* __restrict__ mask,   // additive, broadcast by m_s*; or null
               const int* __restrict__ key_lengths,  // [B] or null
               int B, int Hq, int Hkv, int Sq, int Sk,
               long long q_sb, long long q_sh, long long q_ss,
               long long k_sb, long long k_sh, long long k_ss,
               long long v_sb, long long v_sh, long long v_ss,
               long long m_sb, long long m_sh, long long m_sq, long long m_sk,
               float scale_log2) {
    constexpr int THREADS = NUM_WARPS * 32;
    constexpr int BLOCK_M = 16 * NUM_WARPS;
    constexpr int STRIDE = HEAD_DIM + 8;           // smem row stride (elements)
    constexpr int NT_S = BLOCK_N / 8;              // n-tiles of S_ij (keys)
    constexpr int NT_O = HEAD_DIM / 8;             // n-tiles of O_i (head dim)
    static_assert(HEAD_DIM % 16 == 0 && BLOCK_N % 16 == 0, "mma tile shape");
    static_assert((BLOCK_M + BLOCK_N) * STRIDE * 2 <= 48 * 1024, "tile exceeds 48 KB of static smem");

    __shared__ __align__(16) T q_s[BLOCK_M * STRIDE];    // Q_i  [BLOCK_M, D (+8)]
    __shared__ __align__(16) T kv_s[BLOCK_N * STRIDE];   // K_j, then V_j [BLOCK_N, D (+8)]

    const long long bh = (long long)blockIdx.z * gridDim.y + blockIdx.y;
    if (bh >= (long long)B * Hq) return;
    const int b = (int)(bh / Hq), h = (int)(bh % Hq);
    const int hk = h / (Hq / Hkv);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int m0 = blockIdx.x * BLOCK_M;
    const int rA = warp * 16 + g, rB = rA + 8;   // tile rows of c0,c1 and of c2,c3

    q += b * q_sb + h * q_sh + (long long)m0 * q_ss;
    k += b * k_sb + hk * k_sh;
    v += b * v_sb + hk * v_sh;
    if (mask) mask += b * m_sb + h * m_sh;

    const int diag = Sk - Sq;
    int k_end = Sk;
    if (key_lengths) k_end = min(k_end, max(key_lengths[b], 0));
    if (CAUSAL) k_end = min(k_end, m0 + BLOCK_M + diag);

    // Load Q_i from HBM to SRAM.
    load_tile<T, HEAD_DIM, STRIDE, BLOCK_M, THREADS>(q_s, q, q_ss, Sq - m0);

    // O_i = 0, l_i = 0 (this lane's partial sums), m_i = -inf, for rows rA (index 0) and rB (1).
    float o[NT_O][4], m[2] = {-CUDART_INF_F, -CUDART_INF_F}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[nt][e] = 0.0f;

    for (int n0 = 0; n0 < k_end; n0 += BLOCK_N) {
        // Load K_j from HBM to SRAM.
        __syncthreads();
        load_tile<T, HEAD_DIM, STRIDE, BLOCK_N, THREADS>(kv_s, k + (long long)n0 * k_ss, k_ss, k_end - n0);
        __syncthreads();

        // S_ij = Q_i K_j^T: D/16 k-steps; B[k][n] = K[n][k], so a B register is 2 adjacent d of a key row.
        float s[NT_S][4];
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM; kk += 16) {
            const unsigned a[4] = {ld_pair(&q_s[rA * STRIDE + kk + 2 * tq]), ld_pair(&q_s[rB * STRIDE + kk + 2 * tq]),
                                   ld_pair(&q_s[rA * STRIDE + kk + 2 * tq + 8]),
                                   ld_pair(&q_s[rB * STRIDE + kk + 2 * tq + 8])};
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt) {
                const T* kr = &kv_s[(nt * 8 + g) * STRIDE + kk + 2 * tq];
                const unsigned bb[2] = {ld_pair(kr), ld_pair(kr + 8)};
                mma_m16n8k16<T>(s[nt], a, bb);
            }
        }

        // Scale to log2 units, add the mask, hide invisible keys; element e of n-tile nt is
        // row (e < 2 ? rA : rB), key n0 + nt*8 + 2*tq + (e & 1).
        float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = m0 + (e < 2 ? rA : rB);
                const int j = n0 + nt * 8 + 2 * tq + (e & 1);
                float x = s[nt][e] * scale_log2;
                if (mask && i < Sq && j < k_end) x = fmaf(mask[i * m_sq + j * m_sk], LOG2E_F, x);
                if (j >= k_end || (CAUSAL && j > i + diag)) x = -CUDART_INF_F;
                s[nt][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        float alpha[2], m_use[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float m_new = fmaxf(m[r], quad_max(mx[r]));   // m_i^(j)
            m_use[r] = m_new == -CUDART_INF_F ? 0.0f : m_new;  // nothing seen yet: exp2 -> 0
            alpha[r] = exp2f(m[r] - m_use[r]);                  // exp(m_i^(j-1) - m_i^(j))
            m[r] = m_new;
            l[r] *= alpha[r];
        }
        // P_ij = exp(S_ij - m_i^(j)) kept in the accumulator registers; l_i += rowsum(P_ij).
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = exp2f(s[nt][e] - m_use[e >> 1]);
                l[e >> 1] += s[nt][e];
            }
        // Rescale O_i by exp(m_old - m_new).
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt) {
            o[nt][0] *= alpha[0]; o[nt][1] *= alpha[0];
            o[nt][2] *= alpha[1]; o[nt][3] *= alpha[1];
        }

        // Load V_j from HBM to SRAM into the K_j buffer.
        __syncthreads();
        load_tile<T, HEAD_DIM, STRIDE, BLOCK_N, THREADS>(kv_s, v + (long long)n0 * v_ss, v_ss, k_end - n0);
        __syncthreads();

        // O_i += P_ij V_j: k-step kk covers keys 16kk..16kk+15 = S n-tiles 2kk and 2kk+1, whose C
        // registers are exactly the A registers of a 16x16 tile (P rounded to T here).
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            const unsigned a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                                   pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                   pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                   pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            const T* v0 = &kv_s[(16 * kk + 2 * tq) * STRIDE + g];   // B[k][n] = V[key k][d n]
#pragma unroll
            for (int nt = 0; nt < NT_O; ++nt) {
                const T* vp = v0 + nt * 8;
                const unsigned bb[2] = {ld_split(vp, vp + STRIDE), ld_split(vp + 8 * STRIDE, vp + 9 * STRIDE)};
                mma_m16n8k16<T>(o[nt], a, bb);
            }
        }
    }

    // O_i = O_i / l_i, L_i = m_i + log(l_i); rows that saw no key -> zeros, -inf.
    const long long obase = bh * Sq;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float lsum = quad_sum(l[r]);
        const int i = m0 + (r ? rB : rA);
        if (i >= Sq) continue;
        const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
        T* orow = out + (obase + i) * HEAD_DIM + 2 * tq;
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt) {
            orow[nt * 8] = from_float<T>(o[nt][2 * r] * inv);
            orow[nt * 8 + 1] = from_float<T>(o[nt][2 * r + 1] * inv);
        }
        if (lse && tq == 0) lse[obase + i] = lsum > 0.0f ? m[r] * LN2_F + logf(lsum) : -CUDART_INF_F;
    }
}
