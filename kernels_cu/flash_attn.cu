// flash_attn.cu: fused attention forward, FlashAttention-2 (Dao 2023, Algorithm 1).
//
// Variants (reached through cupyattn.attention(..., impl=...)):
//   v1 flash_attn_fwd   SIMT, fp32/fp16/bf16. One CTA per (query tile Q_i, batch*head); each warp
//                       owns ROWS = BLOCK_M / NUM_WARPS query rows; for S_ij = Q_i K_j^T lane t
//                       takes keys t, t+32, ..; for O_i += P_ij V_j lane t takes columns t, t+32, ..
//                       Online softmax in the log2 domain (scores pre-multiplied by log2(e)), S and
//                       P never leave the chip, one division by l_i at the end. impl="flash".
//   v2 flash_attn_mma   tensor cores, fp16/bf16 only (the default for them): FlashAttention-2's
//                       design on mma.sync.m16n8k16 (fp32 accumulate). Each warp owns 16 or 32
//                       query rows; Q_i's fragments stay in registers for the whole key loop (one
//                       ldmatrix.x4 pass); K_j and V_j arrive by 16-byte cp.async in separate
//                       padded shared buffers (two K stages), V_j in flight during S_ij, K_{j+1}
//                       during S_ij and P_ij V_j; K fragments by ldmatrix.x4, V by
//                       ldmatrix.x4.trans; P_ij goes from the S accumulators straight into A
//                       fragments; the scale is folded into the exp2 FMA; masking runs only on
//                       tiles that cross the causal diagonal, k_end or carry a mask tensor; causal
//                       grids start with the heaviest query tiles. impl="flash_mma".
//   SERVING = true      either kernel with the serving features, decided at run time from the
//                       extra arguments (the default instantiations compile them away): packed
//                       variable-length queries (cu_q [B+1]) and keys (cu_k [B+1]) as
//                       flash_attn_varlen_func, or keys/values in pages through a block table
//                       (cu_k then holds each sequence's key count [B]), window=(left, right)
//                       and softcap (kernels_cu/paged.cuh). Causal is passed as the window's
//                       right = 0 (CAUSAL = false). Used by cupyattn/varlen.py, cupyattn/paged.py
//                       and attention(window=, softcap=).
// Both also run on the CPU emulator of the GPU test tier (tests/emu: one fiber per thread, mma.sync
// rebuilt from the PTX ISA fragment tables), which checks their logic on machines without a GPU.
//
// Tile tables: cupyattn/config.py FLASH_SIMT_TILES and FLASH_MMA_TILES, with the reason for each
// entry; the op module (cupyattn/flash_attn.py) instantiates them as template arguments. v1 uses
// static shared memory (a static_assert checks each entry fits 48 KB); v2 dynamic shared memory
// (config.flash_mma_smem_bytes; above 48 KB the loader raises the kernel's limit) and the -D
// constants FLASH_MMA_PAD and FLASH_MMA_K_STAGES from config.
//
// Masking, all applied to S_ij before the row max (so hidden keys get P = 0 exactly):
//   - keys j >= Sk or j >= key_lengths[b] (clamped to [0, Sk]) and, with CAUSAL, j > i + Sk - Sq
//     (bottom-right aligned) get -inf; key tiles past the last visible key are never loaded;
//   - `mask` is an additive fp32 tensor read through 4 element strides (0 for broadcast dims);
//   - a row that sees no key keeps m_i = -inf, l_i = 0 and is written as zeros, lse = -inf.
#include "common.cuh"
#include "paged.cuh"
#include "ptx.cuh"

// --- non-finite semantics (cupyattn/reference.py) -------------------------------------------
// A mask entry of -inf hides its key whatever the score is (a NaN score from a NaN key too).
__device__ __forceinline__ float add_mask(float x_log2, float mask) {
    return mask == -CUDART_INF_F ? -CUDART_INF_F : fmaf(mask, LOG2E_F, x_log2);
}

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
// Source rows first, first + 1, .. of `rows` (KvRows: contiguous or through a block table).
template <typename T, int HEAD_DIM, int SSTRIDE, int ROWS, int THREADS, bool PAGED>
__device__ __forceinline__ void load_tile(T* __restrict__ dst, const KvRows<T, PAGED>& rows, int first,
                                          int valid) {
    for (int idx = threadIdx.x; idx < ROWS * HEAD_DIM; idx += THREADS) {
        const int r = idx / HEAD_DIM, c = idx % HEAD_DIM;
        dst[r * SSTRIDE + c] = r < valid ? rows.row(first + r)[c] : from_float<T>(0.0f);
    }
}

// One CTA's sequence: where its queries, keys, values, output rows and lse entries are. Dense
// (SERVING = false, or no cu_q / cu_k / table): the [B, H, S, D] strided layout of attention().
// Packed queries (cu_q): q and out [total_q, Hq, D] (q through q_ss, q_sh), lse [Hq, total_q]
// (flash_attn_varlen_func's layout) with Sq = total_q. Packed keys (cu_k): [total_k, Hkv, D]
// through k_ss, k_sh. Paged keys (table): cu_k[b] keys in pages of page_size * Hkv * D elements,
// NHD [num_pages, page, Hkv, D] or HND [num_pages, Hkv, page, D] (paged.cuh): k_sh and k_ss are the
// head and row strides inside a page, which say which: page_rows (flash_page_rows).
template <typename T, bool SERVING>
struct FlashSeq {
    int sq, sk;             // this sequence's query rows and keys
    int q0;                 // its first packed query row (cu_q), or -1 (dense)
    const T* q;             // its query row 0 of head h
    KvRows<T, SERVING> k, v;
    // Output row and lse index of query row i (computed at the epilogue, so nothing 64-bit is
    // held across the key loop for them).
    __device__ __forceinline__ long long out_row(int i, long long bh, int h, int Hq, int Sq) const {
        return SERVING && q0 >= 0 ? (long long)(q0 + i) * Hq + h : bh * Sq + i;
    }
    __device__ __forceinline__ long long lse_index(int i, long long bh, int h, int Sq) const {
        return SERVING && q0 >= 0 ? (long long)h * Sq + q0 + i : bh * Sq + i;
    }
    __device__ __forceinline__ FlashSeq(const T* q_, const T* k_, const T* v_, int b, int h, int hk, int Hq,
                                        int Sq, int Sk, long long q_sb, long long q_sh, long long q_ss,
                                        long long k_sb, long long k_sh, long long k_ss, long long v_sb,
                                        long long v_sh, long long v_ss, const int* cu_q, const int* cu_k,
                                        const int* table, int bt_stride, int log2_page, int num_pages,
                                        int page_rows) {
        sq = Sq; sk = Sk; q0 = -1;
        q = q_ + b * q_sb + h * q_sh;
        k = {k_ + b * k_sb + hk * k_sh, k_ss, nullptr, 0, 0};
        v = {v_ + b * v_sb + hk * v_sh, v_ss, nullptr, 0, 0};
        if (!SERVING) return;
        // Device offsets are the caller's: clamped to the packed rows (Sq = total_q, Sk = total_k),
        // so offsets past the end, negative or decreasing give wrong or empty rows, never a read or
        // write outside q, k, v, out or lse.
        if (cu_q != nullptr) {
            q0 = min(max(cu_q[b], 0), Sq);
            sq = min(max(cu_q[b + 1], q0), Sq) - q0;
            q = q_ + q0 * q_ss + h * q_sh;
        }
        if (table != nullptr) {  // key count clamped to the table's capacity: never past its row
            sk = min(max(cu_k[b], 0), bt_stride << log2_page);
            k = {k_ + hk * k_sh, k_ss, table + (long long)b * bt_stride, log2_page, num_pages - 1, page_rows};
            v = {v_ + hk * v_sh, v_ss, k.table, log2_page, num_pages - 1, page_rows};
        } else if (cu_k != nullptr) {
            const int k0 = min(max(cu_k[b], 0), Sk);
            sk = min(max(cu_k[b + 1], k0), Sk) - k0;
            k.base = k_ + k0 * k_ss + hk * k_sh;
            v.base = v_ + k0 * v_ss + hk * v_sh;
        }
    }
};

// Rows of k_ss elements from one page to the next: page elements (Hkv * D << log2_page) / k_ss,
// i.e. Hkv << log2_page for HND (k_ss == D) and 1 << log2_page for NHD (both when Hkv == 1). Two
// ways to compute the same number, because the D=64 serving tile of flash_attn_mma (4 warps, at
// its 255 registers) spills with either on some targets: the division on sm_86/89 (24 B), the
// comparison on sm_75 (8 B). The offline check holds each target to no spill.
__device__ __forceinline__ int flash_page_rows(int Hkv, int D, long long k_ss, int log2_page) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    return (int)((((long long)Hkv * D) << log2_page) / max(k_ss, 1LL));
#else
    return (k_ss == D ? Hkv : 1) << log2_page;
#endif
}

// The serving arguments every flash kernel takes after scale_log2 (null / -1 / 0 in plain calls).
#define FLASH_SERVING_PARAMS                                                                       \
    const int* __restrict__ cu_q,         /* [B+1] packed query offsets, or null */                \
    const int* __restrict__ cu_k,         /* [B+1] packed key offsets / [B] paged key counts */    \
    const int* __restrict__ block_table,  /* [B, bt_stride] page ids, or null */                   \
    int bt_stride, int log2_page, int num_pages,                                                   \
    int win_left, int win_right,          /* window; -1 unbounded */                               \
    float softcap_log2                    /* softcap * log2(e), 0 = off */

// The keys query rows [m0, m0 + BLOCK_M) of a sequence may see, [n_lo, k_end) with n_lo a
// multiple of BLOCK_N (key tiles stay aligned), the one key range of both kernels: the sequence's
// keys, key_lengths[b] clamped to [0, Sk], causal (bottom-right: the last row's j <= m0 + BLOCK_M
// - 1 + diag, so later tiles are skipped, not computed and masked) and a window's right side bound
// k_end; the window's left side at the first row bounds n_lo. Where that lies at or past k_end the
// tile sees no key at all: the range is empty (no key tile is loaded), not a tile of masked keys.
struct KeyRange {
    int n_lo, k_end;
    __device__ __forceinline__ int tiles(int block_n) const {
        return k_end > n_lo ? (k_end - n_lo + block_n - 1) / block_n : 0;
    }
};
template <int BLOCK_M, int BLOCK_N, bool CAUSAL, bool SERVING>
__device__ __forceinline__ KeyRange key_range(const Window& win, int sk, const int* key_lengths, int b, int m0) {
    int k_end = sk;
    if (key_lengths) k_end = min(k_end, max(key_lengths[b], 0));
    if (CAUSAL) k_end = min(k_end, m0 + BLOCK_M + win.diag);
    int n_lo = 0;
    if (SERVING) {
        if (win.right >= 0) k_end = min(k_end, max(win.hi(m0 + BLOCK_M - 1) + 1, 0));
        if (win.left >= 0) {
            const int lo = max(win.lo(m0), 0);
            if (lo >= k_end) return {0, 0};
            n_lo = lo / BLOCK_N * BLOCK_N;
        }
    }
    return {n_lo, k_end};
}

// --- v1: SIMT FlashAttention-2 forward -----------------------------------------------------
// grid (ceil(Sq / BLOCK_M), min(B*Hq, 65535), ceil(B*Hq / 65535)); block NUM_WARPS * 32.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, bool SERVING = false>
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
               float scale_log2,                  // softmax scale * log2(e)
               FLASH_SERVING_PARAMS) {
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

    const FlashSeq<T, SERVING> seq(q, k, v, b, h, hk, Hq, Sq, Sk, q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb,
                                   v_sh, v_ss, cu_q, cu_k, block_table, bt_stride, log2_page, num_pages,
                                   flash_page_rows(Hkv, HEAD_DIM, k_ss, log2_page));
    if (SERVING && m0 >= seq.sq) return;  // a short packed sequence: whole CTA leaves together
    if (mask) mask += b * m_sb + h * m_sh;

    // Keys this tile may see: [n_lo, k_end) (key_range). Causal (bottom-right): row i sees
    // j <= i + Sk - Sq; a window bounds both ends.
    const Window win{SERVING ? win_left : -1, SERVING ? win_right : -1, seq.sk - seq.sq};
    const int diag = win.diag;
    const KeyRange kr = key_range<BLOCK_M, BLOCK_N, CAUSAL, SERVING>(win, seq.sk, key_lengths, b, m0);
    const int n_lo = kr.n_lo, k_end = kr.k_end;

    // Load Q_i from HBM to SRAM (rows past Sq as zeros; they are computed but never stored).
    load_tile<T, HEAD_DIM, HEAD_DIM, BLOCK_M, THREADS>(q_s, KvRows<T, false>{seq.q, q_ss}, m0, seq.sq - m0);

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

    for (int n0 = n_lo; n0 < k_end; n0 += BLOCK_N) {
        // Load K_j from HBM to SRAM (the barrier also retires the previous V_j readers).
        __syncthreads();
        load_tile<T, HEAD_DIM, KV_STRIDE, BLOCK_N, THREADS>(kv_s, seq.k, n0, k_end - n0);
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
            // Scale to log2 units, cap (softcap), add the mask, hide invisible keys.
            float mx = -CUDART_INF_F;
#pragma unroll
            for (int jj = 0; jj < KEYS; ++jj) {
                const int j = n0 + lane + 32 * jj;
                float x = s[r][jj] * scale_log2;
                if (SERVING) x = soft_cap(x, softcap_log2);
                if (mask && i < Sq && j < k_end) x = add_mask(x, mask[i * m_sq + j * m_sk]);
                if (j >= k_end || (CAUSAL && j > i + diag)) x = -CUDART_INF_F;
                if (SERVING && (j < win.lo(i) || j > win.hi(i))) x = -CUDART_INF_F;
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
        load_tile<T, HEAD_DIM, KV_STRIDE, BLOCK_N, THREADS>(kv_s, seq.v, n0, k_end - n0);
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
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float lsum = warp_reduce_sum(l[r]);
        const int i = m0 + row0 + r;
        if (i >= seq.sq) continue;  // same for the whole warp
        const float inv = row_scale(lsum);
        T* orow = out + seq.out_row(i, bh, h, Hq, Sq) * HEAD_DIM;
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const int d = lane + 32 * c;
            if (d < HEAD_DIM) orow[d] = from_float<T>(o[r][c] * inv);
        }
        if (lse && lane == 0) lse[seq.lse_index(i, bh, h, Sq)] = row_lse(m[r], lsum);
    }
}

// --- v2 helpers (quad_max, quad_sum, c_pair_to_a: common.cuh) ------------------------------
// Stage ROWS x HEAD_DIM 16-bit elements (global row stride gstride elements) into a shared tile
// with row stride LDS, in 16-byte chunks. Thread t takes row t / TPR and the chunks
// t % TPR + TPR * i of it (TPR = THREADS / ROWS threads per row read TPR * 16 contiguous bytes
// per instruction), so each thread keeps one row pointer and its chunks are constant offsets
// from it (no per-chunk 64-bit address held across the key loop). Rows >= valid are
// zero-filled (cp.async with src-size 0 reads nothing): whatever lies past the end of a
// sequence (an unwritten KV cache, NaN) never reaches the mma. vec = false (a base or a stride
// not 16-byte aligned) reads element by element and stores synchronously; either way the
// caller's cp_async_wait + __syncthreads publish the tile.
// Source rows first, first + 1, .. of `rows` (KvRows: contiguous or through a block table; the
// page lookup happens once per thread and tile).
template <typename T, int ROWS, int HEAD_DIM, int LDS, int THREADS, bool PAGED>
__device__ __forceinline__ void stage_rows(T* __restrict__ dst, const KvRows<T, PAGED>& rows, int first,
                                           int valid, bool vec) {
    static_assert(THREADS % ROWS == 0, "every row gets the same number of threads");
    constexpr int TPR = THREADS / ROWS, CPR = HEAD_DIM / 8;
    const int r = threadIdx.x / TPR, c0 = threadIdx.x % TPR;
    const bool live = r < valid;
    T* srow = dst + r * LDS;
    const T* src = rows.base;
    const T* grow = live ? rows.row(first + r) : src;
#pragma unroll
    for (int i = 0; i < (CPR + TPR - 1) / TPR; ++i) {
        const int col = (c0 + TPR * i) * 8;
        if (CPR % TPR != 0 && col >= HEAD_DIM) break;
        if (vec) {
            cp_async_zfill<16>(srow + col, live ? grow + col : src, live ? 16 : 0);
        } else {
            const unsigned short* g16 = reinterpret_cast<const unsigned short*>(grow + col);
            unsigned w[4];
#pragma unroll
            for (int e = 0; e < 4; ++e)
                w[e] = live ? (unsigned)g16[2 * e] | ((unsigned)g16[2 * e + 1] << 16) : 0u;
            uint4 u;
            u.x = w[0]; u.y = w[1]; u.z = w[2]; u.w = w[3];
            *reinterpret_cast<uint4*>(srow + col) = u;
        }
    }
}

// --- v2: tensor-core FlashAttention-2 forward (mma.sync m16n8k16), fp16 / bf16 ---------------
// grid (ceil(Sq / BLOCK_M), min(B*Hq, 65535), ceil(B*Hq / 65535)); block NUM_WARPS * 32;
// dynamic shared memory (BLOCK_M + (FLASH_MMA_K_STAGES + 1) * BLOCK_N) * (D + FLASH_MMA_PAD) * 2 B
// (cupyattn.config.flash_mma_smem_bytes). Warp w owns query rows w*WROWS .. +WROWS-1 of the tile,
// WROWS = BLOCK_M / NUM_WARPS = 16 * MT (MT m16 row tiles).
//
// Per CTA (FlashAttention-2 Algorithm 1 for one Q_i, with its load schedule):
//   prologue  cp.async Q_i and K_0; wait; Q_i's A fragments -> registers (ldmatrix.x4), kept for
//             the whole key loop
//   tile j    wait K_j; barrier | cp.async V_j -> V buffer, K_{j+1} -> the other K stage |
//             S_ij = Q_i K_j^T (ldmatrix.x4 B fragments) | online softmax on the S accumulators |
//             wait V_j (K_{j+1} stays in flight); barrier | O_i += P_ij V_j (P from the S
//             accumulators as A fragments, V through ldmatrix.x4.trans)
//   epilogue  O_i / l_i -> shared (the dead Q_i tile) -> 16-byte coalesced stores; lse
// So V_j loads while S_ij and the softmax run, and K_{j+1} while S_ij, softmax and P_ij V_j run.
// Shared rows are padded by FLASH_MMA_PAD elements (one 16-byte unit): with D a multiple of 16
// the row stride is an odd number of 16-byte units, so the 8 row addresses of one ldmatrix phase fall in
// 8 distinct 16-byte bank groups (no conflicts), and every row start stays 16-byte aligned.
//
// vec bits: 1 q, 2 k, 4 v may be staged by 16-byte cp.async (base 16-byte aligned, every stride
// a multiple of 8 elements); 8 out may take 16-byte stores. A clear bit takes the scalar path.
// scale_log2 = scale * log2(e) is folded into the exp2 argument: p = exp2(s * scale_log2 - m)
// with m kept in the same scaled units. Tiles with no masking to do (no mask tensor, scale >= 0,
// every key below the causal diagonal of the tile's first row and inside k_end) skip it.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, bool SERVING = false>
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
               float scale_log2, int vec, FLASH_SERVING_PARAMS) {
    constexpr int THREADS = NUM_WARPS * 32;
    constexpr int WROWS = BLOCK_M / NUM_WARPS;   // query rows per warp
    constexpr int MT = WROWS / 16;               // m16 tiles per warp
    constexpr int LDS = HEAD_DIM + FLASH_MMA_PAD;  // shared row stride (elements)
    constexpr int KSTEPS = HEAD_DIM / 16;        // k-steps of S_ij = Q_i K_j^T
    constexpr int NT_S = BLOCK_N / 8;            // n8 tiles of S_ij (keys)
    constexpr int NT_O = HEAD_DIM / 8;           // n8 tiles of O_i (head dim)
    constexpr int KV_TILE = BLOCK_N * LDS;       // elements of one K or V stage
    static_assert(WROWS % 16 == 0 && BLOCK_M == WROWS * NUM_WARPS, "warps own whole m16 tiles");
    static_assert(HEAD_DIM % 16 == 0 && BLOCK_N % 16 == 0, "x4 fragment loads cover 16 x 16");
    static_assert(FLASH_MMA_PAD % 8 == 0 && (LDS / 8) % 2 == 1, "pad: odd number of 16 B per row");
    static_assert(FLASH_MMA_K_STAGES == 2, "the schedule above prefetches exactly one K tile");

    extern __shared__ __align__(16) uint4 flash_smem[];
    T* q_s = reinterpret_cast<T*>(flash_smem);   // Q_i [BLOCK_M][LDS]; O_i staging at the end
    T* k_s = q_s + BLOCK_M * LDS;                // K_j [K_STAGES][BLOCK_N][LDS]
    T* v_s = k_s + FLASH_MMA_K_STAGES * KV_TILE; // V_j [BLOCK_N][LDS]

    const long long bh = (long long)blockIdx.z * gridDim.y + blockIdx.y;
    if (bh >= (long long)B * Hq) return;
    const int b = (int)(bh / Hq), h = (int)(bh % Hq);
    const int hk = h / (Hq / Hkv);               // GQA: K/V read in place, never repeated
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;      // fragment row group and column pair
    // Causal: the last query tiles see the most keys; blockIdx.x = 0 takes the last one so the
    // heaviest tiles of each head start first and the light ones fill the tail of the grid.
    const int m_blk = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int m0 = m_blk * BLOCK_M;
    const int wrow0 = warp * WROWS;              // first tile row of this warp

    const FlashSeq<T, SERVING> seq(q, k, v, b, h, hk, Hq, Sq, Sk, q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb,
                                   v_sh, v_ss, cu_q, cu_k, block_table, bt_stride, log2_page, num_pages,
                                   flash_page_rows(Hkv, HEAD_DIM, k_ss, log2_page));
    if (SERVING && m0 >= seq.sq) return;  // a short packed sequence: whole CTA leaves together
    if (mask) mask += b * m_sb + h * m_sh;

    // Keys this tile may see: [n_lo, k_end) (key_range); causal (bottom-right) row i sees
    // j <= i + diag; a window (SERVING) bounds both ends.
    const Window win{SERVING ? win_left : -1, SERVING ? win_right : -1, seq.sk - seq.sq};
    const int diag = win.diag;
    const KeyRange kr = key_range<BLOCK_M, BLOCK_N, CAUSAL, SERVING>(win, seq.sk, key_lengths, b, m0);
    const int n_lo = kr.n_lo, k_end = kr.k_end;
    const int n_tiles = kr.tiles(BLOCK_N);
    // Every tile needs the masking step when a mask tensor is given or the scale is negative
    // (the fast path takes the row max of unscaled S, which only a scale >= 0 preserves), and
    // with a window or softcap.
    const bool mask_all = mask != nullptr || scale_log2 < 0.0f ||
                          (SERVING && (win.left >= 0 || win.right >= 0 || softcap_log2 > 0.0f));

    // Prologue: load Q_i and K_0 from HBM to SRAM (one cp.async group each).
    stage_rows<T, BLOCK_M, HEAD_DIM, LDS, THREADS>(q_s, KvRows<T, false>{seq.q, q_ss}, m0, seq.sq - m0, vec & 1);
    cp_async_commit();
    if (n_tiles > 0) stage_rows<T, BLOCK_N, HEAD_DIM, LDS, THREADS>(k_s, seq.k, n_lo, k_end - n_lo, vec & 2);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // Q_i's A fragments, once: matrix i of ldmatrix.x4 = rows (i % 2) * 8.., k half i / 2.
    unsigned qf[MT][KSTEPS][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk)
            ldmatrix<4>(qf[mt][kk], q_s + (wrow0 + mt * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8);

    // On chip: O_i = 0, l_i = 0 (this lane's partial row sums), m_i = -inf (scaled log2 units),
    // for rows g (r = 0) and g + 8 (r = 1) of each m16 tile.
    float o[MT][NT_O][4], m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) { m[mt][r] = -CUDART_INF_F; l[mt][r] = 0.0f; }
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][nt][e] = 0.0f;
    }

    for (int jt = 0; jt < n_tiles; ++jt) {
        const int n0 = n_lo + jt * BLOCK_N;
        if (jt > 0) {  // K_j has landed for every thread; every warp is done with P V_{j-1}
            cp_async_wait<0>();
            __syncthreads();
        }
        // Issue V_j (into the V buffer P V_{j-1} released) and K_{j+1} (into the K stage S_{j-1}
        // released); two groups, so that the V wait below can leave K_{j+1} in flight.
        stage_rows<T, BLOCK_N, HEAD_DIM, LDS, THREADS>(v_s, seq.v, n0, k_end - n0, vec & 4);
        cp_async_commit();
        if (jt + 1 < n_tiles)
            stage_rows<T, BLOCK_N, HEAD_DIM, LDS, THREADS>(k_s + ((jt + 1) % FLASH_MMA_K_STAGES) * KV_TILE,
                                                           seq.k, n0 + BLOCK_N, k_end - n0 - BLOCK_N, vec & 2);
        cp_async_commit();

        // S_ij = Q_i K_j^T. B[k][n] = K[key n][d k]: ldmatrix.x4 matrix i = keys (i / 2) * 8..,
        // d half i % 2, i.e. {b0, b1} of n8 tile 2np, then of 2np + 1.
        const T* kt = k_s + (jt % FLASH_MMA_K_STAGES) * KV_TILE;
        float s[MT][NT_S][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
            for (int np = 0; np < NT_S / 2; ++np) {
                unsigned bf[4];
                ldmatrix<4>(bf, kt + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * LDS + kk * 16
                                    + ((lane >> 3) & 1) * 8);
                const unsigned b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_m16n8k16<T>(s[mt][2 * np], qf[mt][kk], b0);
                    mma_m16n8k16<T>(s[mt][2 * np + 1], qf[mt][kk], b1);
                }
            }

        // Masking, only on tiles that need it: a mask tensor, keys past k_end, or keys above the
        // causal diagonal of the tile's first row. S becomes scaled log2 units (mul = 1); keys
        // j >= lim (row i's visible limit) get -inf, so P is exactly 0 there. Element 2r + h of
        // n8 tile nt: row g + 8r of m16 tile mt, key n0 + nt * 8 + 2 tq + h. The mask's key
        // stride m_sk is 0 or 1 (the op module guarantees it), so a row's mask reads are
        // constant offsets from one row pointer.
        float mul = scale_log2;
        if (mask_all || n0 + BLOCK_N > k_end || (CAUSAL && n0 + BLOCK_N - 1 > m0 + diag)) {
            mul = 1.0f;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int i = m0 + wrow0 + mt * 16 + g + 8 * r;
                    const int lim = CAUSAL ? min(k_end, i + diag + 1) : k_end;
                    const int w_lo = SERVING ? win.lo(i) : 0, w_hi = SERVING ? win.hi(i) : 0;
                    const float* mrow = mask && i < Sq ? mask + i * m_sq + (m_sk ? n0 + 2 * tq : 0) : nullptr;
#pragma unroll
                    for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                        for (int hh = 0; hh < 2; ++hh) {
                            const int j = n0 + nt * 8 + 2 * tq + hh;
                            float x = s[mt][nt][2 * r + hh] * scale_log2;
                            if (SERVING) x = soft_cap(x, softcap_log2);
                            if (mrow && j < lim) x = add_mask(x, mrow[m_sk ? nt * 8 + hh : 0]);
                            const bool vis = j < lim && (!SERVING || (j >= w_lo && j <= w_hi));
                            s[mt][nt][2 * r + hh] = vis ? x : -CUDART_INF_F;
                        }
                }
        }

        // Online softmax (mul >= 0, so max(S) * mul is the max of the scaled row):
        //   m_i^(j) = max(m_i^(j-1), rowmax(S_ij));  P_ij = exp2(S_ij * mul - m_i^(j)) (one FMA
        //   into exp2); l_i^(j) = exp(m_i^(j-1) - m_i^(j)) l_i^(j-1) + rowsum(P_ij); O_i rescaled
        //   by the same factor. P_ij is rounded to T into A fragments: S n8 tiles 2kk, 2kk+1 are
        //   exactly the A registers of the 16 x 16 tile kk of P_ij.
        unsigned pf[MT][BLOCK_N / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[mt][nt][e]);
            float m_use[2], alpha[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float m_new = fmaxf(m[mt][r], quad_max(mx[r]) * mul);
                m_use[r] = m_new == -CUDART_INF_F ? 0.0f : m_new;  // nothing seen yet: exp2 -> 0
                alpha[r] = exp2f(m[mt][r] - m_use[r]);              // exp(m_i^(j-1) - m_i^(j))
                m[mt][r] = m_new;
                l[mt][r] *= alpha[r];
            }
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[mt][nt][e] = exp2f(fmaf(s[mt][nt][e], mul, -m_use[e >> 1]));
                    l[mt][e >> 1] += s[mt][nt][e];
                }
#pragma unroll
            for (int nt = 0; nt < NT_O; ++nt) {
                o[mt][nt][0] *= alpha[0]; o[mt][nt][1] *= alpha[0];
                o[mt][nt][2] *= alpha[1]; o[mt][nt][3] *= alpha[1];
            }
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) c_pair_to_a<T>(s[mt][2 * kk], s[mt][2 * kk + 1], pf[mt][kk]);
        }

        // V_j has landed (K_{j+1}, the newest group, may still be in flight).
        cp_async_wait<1>();
        __syncthreads();

        // O_i += P_ij V_j. B[k][n] = V[key k][d n]: ldmatrix.x4.trans matrix i = keys (i % 2) * 8..,
        // d (i / 2) * 8.., i.e. {b0, b1} of d n8 tile 2dp, then of 2dp + 1.
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)
#pragma unroll
            for (int dp = 0; dp < NT_O / 2; ++dp) {
                unsigned bf[4];
                ldmatrix<4, true>(bf, v_s + (kk * 16 + (lane & 15)) * LDS + dp * 16 + (lane >> 4) * 8);
                const unsigned b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_m16n8k16<T>(o[mt][2 * dp], pf[mt][kk], b0);
                    mma_m16n8k16<T>(o[mt][2 * dp + 1], pf[mt][kk], b1);
                }
            }
    }

    // Epilogue: O_i = diag(l_i)^-1 O_i, L_i = m_i + log(l_i) (natural log; m is in log2 units);
    // rows that saw no key (l_i = 0) give zeros and -inf. Each warp rounds its rows into its own
    // rows of the Q_i tile (no other warp reads them again), then stores them as 16-byte chunks.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float lsum = quad_sum(l[mt][r]);
            const float inv = row_scale(lsum);
            const int row = wrow0 + mt * 16 + g + 8 * r;
            unsigned* srow = reinterpret_cast<unsigned*>(q_s + row * LDS + 2 * tq);
#pragma unroll
            for (int nt = 0; nt < NT_O; ++nt)
                srow[nt * 4] = pack2<T>(o[mt][nt][2 * r] * inv, o[mt][nt][2 * r + 1] * inv);
            if (lse && tq == 0 && m0 + row < seq.sq)
                lse[seq.lse_index(m0 + row, bh, h, Sq)] = row_lse(m[mt][r], lsum);
        }
    __syncwarp();
    constexpr int CPR = HEAD_DIM / 8;
#pragma unroll
    for (int c = lane; c < WROWS * CPR; c += 32) {
        const int row = wrow0 + c / CPR, col = (c % CPR) * 8;
        if (m0 + row >= seq.sq) continue;
        const uint4 w = *reinterpret_cast<const uint4*>(q_s + row * LDS + col);
        T* op = out + seq.out_row(m0 + row, bh, h, Hq, Sq) * HEAD_DIM + col;
        if (vec & 8) {
            *reinterpret_cast<uint4*>(op) = w;
        } else {
            unsigned short* o16 = reinterpret_cast<unsigned short*>(op);
            const unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) { o16[2 * e] = ws[e] & 0xffffu; o16[2 * e + 1] = ws[e] >> 16; }
        }
    }
}
