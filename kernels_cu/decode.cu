// decode.cu: single-token decode attention over a KV cache, with split-KV (flash-decoding).
// The cache and its append kernels: kernels_cu/kvcache.cu.
//
// Variants (reached from cupyattn/decode.py, impl=):
//   v1 simt  decode_kernel<T, D, ...>      any dtype. 128 threads; every query head of the tile
//            (up to GT = 8) is scored against each staged key with float FMAs, online softmax
//            per head by one warp, O accumulated in per-thread (head, chunk) slots
//   v2 mma   decode_mma_kernel<T, D, ...>  fp16/bf16, for GQA groups >= 4 (FlashInfer's idea):
//            the group's query heads are the rows of an m16n8k16 A tile (zero-padded to 16 or
//            32), S = Q K^T and O += P V run on tensor cores; each warp owns a slice of every
//            key tile with its own softmax state, and the slices are merged at the end
//   SERVING = true (either kernel)         the serving variant (cupyattn/paged.py, decode_attention(window=,
//                                          softcap=)): K/V rows through a block table when one is given
//                                          (NHD or HND pages, kernels_cu/paged.cuh), a window's left
//                                          bound moves the first key, softcap caps the scores
//   STAGED = true (with SERVING)           paged addressing off the critical path: the split's page ids
//                                          are staged in shared memory (PageWindow) a window ahead of
//                                          the ring, so no K/V copy waits on a block-table load
//   decode_combine_kernel<T, ...>          merges split partials: O = sum_c exp(lse_c - lse) O_c
//   fused combine (counters != null)       no combine launch: the last split block of each (sequence,
//                                          head tile) to finish, found by an atomic ticket
//                                          (last_block_ticket, ptx.cuh), merges that tile's partials
//                                          (combine_if_last) and resets the counter
// Both decode kernels stream K/V through the same cp.async ring (load_kv_tile) of STAGES slots
// in dynamic shared memory, with one block barrier per tile: wait for tile t, barrier, issue the
// load of tile t + STAGES - 1 into the slot everyone finished with, compute tile t.
// TMA is not used: these kernels run from sm_75 (cp.async becomes plain copies there), a page of
// 1 or 16 rows is smaller than a ring tile, and a tensor map per layer pointer would be host work
// per call; cp.async with staged page ids keeps one loader for every layout and page size.
//
// Layouts (row-major, last dim contiguous):
//   cache (one layer)  k, v: [B, Hkv, max_seq, D]   lengths: int32 [B]
//   q: [B, Hq, 1, D] with strides (q_sb, q_sh, 1) in elements;  out: [B, Hq, 1, D] contiguous
//   partials: o_part float32 [splits, B, Hq, D], lse_part float32 [splits, B, Hq] (natural log)
//
// Split-KV chunking (SeqSplit). Uniform (split_keys = 0; the same as
// reference.decode_split_partials): a sequence of live length len has splits = num_splits chunks
// of ceil(len / splits) keys, split c covering [c*chunk, min((c+1)*chunk, len)). Per sequence
// (SERVING variants only, split_keys > 0: the "waves" rule of cupyattn/decode.py, which launches
// them for any cache; the plain kernels keep the code the H100 measured): splits = min(num_splits,
// ceil(len / split_keys)) and chunk = ceil(len / splits), so a short sequence of a ragged batch
// takes few blocks and a long one many, all of about split_keys keys; the blocks of splits past a
// sequence's count leave at once, and a sequence of one split writes out directly. A chunk may be
// empty (its lse is -inf, its O is 0, and the combine gives it weight 0). Keys at or past the
// split's end are never read from global memory: their ring rows are zero-filled and their
// probabilities set to 0 (not computed and multiplied by 0), so a cache row past a sequence's
// length may hold anything, NaN included.
//
// Tiles (keys per ring slot BN, STAGES, warps, row pitch in bytes, blocks per SM) come from
// cupyattn/config.py (DECODE_SIMT_TILES, DECODE_MMA_TILES, with the reason for each) as template
// arguments; the dynamic shared memory the host launches with is exactly STAGES * 2 * BN * PITCH.
#include "common.cuh"
#include "paged.cuh"
#include "ptx.cuh"

// The serving arguments both decode kernels take after split_keys (null / 0 / -1 when plain).
#define DECODE_SERVING_PARAMS                                                                      \
    const int* __restrict__ block_table,  /* [B, bt_stride] page ids, or null (contiguous cache) */ \
    int bt_stride, int log2_page, int num_pages,                                                   \
    int page_hnd,                         /* pages [N, Hkv, page, D] (1) or [N, page, Hkv, D] (0) */ \
    int win_left,                         /* keys >= len - 1 - win_left; -1 unbounded */           \
    float softcap_log2                    /* softcap * log2(e), 0 = off */
// --- helpers -------------------------------------------------------------------------------
// One 16-byte chunk of T elements -> VEC floats.
__device__ __forceinline__ void chunk_to_float(const uint4& u, float (&f)[4], float) {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void chunk_to_float(const uint4& u, float (&f)[8], __half) {
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 t = __half22float2(h[i]);
        f[2 * i] = t.x; f[2 * i + 1] = t.y;
    }
}
__device__ __forceinline__ void chunk_to_float(const uint4& u, float (&f)[8], __nv_bfloat16) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 t = __bfloat1622float2(h[i]);
        f[2 * i] = t.x; f[2 * i + 1] = t.y;
    }
}

// The keys a decode query of sequence b sees, [start, len), and how they are split (the
// chunking rules in the header). win_left: the window's left bound (-1 unbounded).
struct SeqSplit {
    int start, len, splits;
    bool per_seq;
    __device__ __forceinline__ SeqSplit(const int* lengths, int b, int max_seq, int win_left, int num_splits,
                                        int split_keys) {
        len = min(max(lengths[b], 0), max_seq);
        start = win_left >= 0 ? max(len - 1 - win_left, 0) : 0;
        const int n = len - start;
        per_seq = split_keys > 0;
        splits = per_seq ? min(num_splits, n > 0 ? (n - 1) / split_keys + 1 : 1) : num_splits;
    }
    // whether a block of a launch that writes split partials writes them (else: out directly)
    __device__ __forceinline__ bool partials(int write_partials) const {
        return write_partials && (!per_seq || splits > 1);
    }
    // keys [lo, hi) of split c (c < splits)
    __device__ __forceinline__ void range(int c, int& lo, int& hi) const {
        const int chunk = (len - start + splits - 1) / splits;
        lo = min(start + c * chunk, len);
        hi = min(lo + chunk, len);
    }
};

// Ring slot `slot` ([K, V][BN][PITCH] bytes) <- keys [t0, t0 + BN) of one kv head (kr, vr: its
// rows, any type with row(j): KvRows, contiguous or paged, or StagedRows). Rows at or past `hi`
// are zero-filled without reading global memory.
template <typename T, int D, int BN, int PITCH, int NT, class Rows>
__device__ __forceinline__ void load_kv_tile(unsigned char* slot, const Rows& kr, const Rows& vr, int t0, int hi) {
    constexpr int VEC = 16 / sizeof(T), NC = D / VEC, PER_KV = BN * NC;
#pragma unroll
    for (int it = 0; it < (2 * PER_KV + NT - 1) / NT; ++it) {
        const int i = threadIdx.x + it * NT;
        if (2 * PER_KV % NT == 0 || i < 2 * PER_KV) {
            const int kv = i >= PER_KV, r = i - kv * PER_KV, j = r / NC, c = r - j * NC;
            unsigned char* dst = slot + (kv * BN + j) * PITCH + c * 16;
            if (t0 + j < hi) cp_async<16>(dst, (kv ? vr : kr).row(t0 + j) + c * VEC);
            else cp_async_zfill<16>(dst, kr.base, 0);
        }
    }
}

// The block's share of the cache and its ring: keys [lo, hi) of split `split` (SeqSplit) of kv
// head kvh; kg, vg: its rows ([max_seq, D] of the contiguous cache, or pages through the block
// table: SERVING). STAGED: the rows' page ids come from a PageWindow of PW_CAP entries per buffer,
// enough for the STAGES - 1 tiles in flight at page size 1 (so windows 0 and 1 cover every tile
// of the prologue), in static shared memory of start(); the block-table row is read only by
// PageWindow::fetch. Use: construct, leave
// if the split has no work, start() (the prologue: tiles 0 .. STAGES-2 in flight, one commit
// group each, empty past the end), then per iteration t publish() before the barrier and
// issue(ring, t + STAGES - 1) after it.
template <typename T, int D, int BN, int PITCH, int NT, int STAGES, bool SERVING, bool STAGED>
struct KvStream {
    static constexpr int SLOT_BYTES = 2 * BN * PITCH;
    static constexpr int PW_CAP = (STAGES - 1) * BN + 32;
    using PW = PageWindow<PW_CAP, NT, BN>;
    int lo, hi, ntiles;
    KvRows<T, SERVING> kg, vg;
    PW pw;
    int pend[PW::PER_THREAD], pend_w;  // a fetched window not yet stored (STAGED), -1: none
    __device__ __forceinline__ KvStream(const T* k_cache, const T* v_cache, const SeqSplit& sp, int split, int b,
                                        int kvh, int Hkv, int max_seq, const int* table, int bt_stride,
                                        int log2_page, int num_pages, int page_hnd) {
        sp.range(split, lo, hi);
        ntiles = (hi - lo + BN - 1) / BN;
        pend_w = -1;
        if (SERVING && table != nullptr) {
            const int* row = table + (size_t)b * bt_stride;
            kg = paged_rows<T, SERVING>(k_cache, row, kvh, Hkv, D, log2_page, num_pages, page_hnd);
            vg = paged_rows<T, SERVING>(v_cache, row, kvh, Hkv, D, log2_page, num_pages, page_hnd);
        } else {
            const size_t kv_off = ((size_t)b * Hkv + kvh) * (size_t)max_seq * D;
            kg = {k_cache + kv_off, D, nullptr, 0, 0, 0};
            vg = {v_cache + kv_off, D, nullptr, 0, 0, 0};
        }
    }
    // STAGED (the host launches it with a block table only): windows 0 and 1 staged, one barrier
    __device__ __forceinline__ void start(unsigned char* ring) {
        __shared__ int ids_s[STAGED ? 2 * PW_CAP : 1];  // PageWindow buffers [2][PW_CAP] (STAGED)
        if (STAGED) {
            pw.init(ids_s, kg.table, lo, hi, kg.log2_page, kg.max_page + 1);
            int r0[PW::PER_THREAD], r1[PW::PER_THREAD];
            pw.fetch(0, r0);
            pw.fetch(1, r1);
            pw.store(0, r0);
            pw.store(1, r1);
            __syncthreads();
        }
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) issue(ring, s);
    }
    // tile u into its ring slot (nothing past the last tile), then a commit; STAGED: when u
    // starts window w >= 1, window w + 1 is fetched into registers (its buffer's last reader,
    // window w - 1's last tile, was issued before this iteration's barrier)
    __device__ __forceinline__ void issue(unsigned char* ring, int u) {
        if (u < ntiles) {
            unsigned char* slot = ring + u % STAGES * SLOT_BYTES;
            if (STAGED) {
                const int tpw = pw.tiles_per_win(), w = u / tpw;
                const StagedRows<T> kr{kg.base, kg.stride, pw.ids, pw.idx0(w), kg.log2_page, kg.page_rows};
                const StagedRows<T> vr{vg.base, vg.stride, pw.ids, pw.idx0(w), vg.log2_page, vg.page_rows};
                load_kv_tile<T, D, BN, PITCH, NT>(slot, kr, vr, lo + u * BN, hi);
                if (w >= 1 && u == w * tpw) {
                    pw.fetch(w + 1, pend);
                    pend_w = w + 1;
                }
            } else {
                load_kv_tile<T, D, BN, PITCH, NT>(slot, kg, vg, lo + u * BN, hi);
            }
        }
        cp_async_commit();
    }
    // STAGED: the window fetched by the last issue() to its buffer; call before the iteration's
    // barrier, which publishes it before any tile of it is issued
    __device__ __forceinline__ void publish() {
        if (STAGED && pend_w >= 0) {
            pw.store(pend_w, pend);
            pend_w = -1;
        }
    }
};

// --- split merge ---------------------------------------------------------------------------
// Row r = (b, h) by the whole block: lse = logsumexp_c lse_c, w_c = exp(lse_c - max), out = sum_c
// w_c O_c / sum_c w_c over the row's num_splits partials (zeros when every chunk was empty, NaN
// when one is NaN), as reference.merge_partials. Warp 0 puts the weights in w_s[0, num_splits) and
// 1 / their sum in w_s[num_splits] (smem); the caller syncs before reusing w_s. Partials are read
// through L2 (__ldcg): in the fused combine other blocks of this kernel wrote them.
template <typename T>
__device__ __forceinline__ void combine_row(const float* o_part, const float* lse_part, T* out, int num_splits,
                                            int BH, int D, int r, float* w_s) {
    const int tid = threadIdx.x;
    if (tid < 32) {
        float mx = -CUDART_INF_F;
        for (int c = tid; c < num_splits; c += 32) mx = fmaxf(mx, __ldcg(lse_part + (size_t)c * BH + r));
        mx = warp_reduce_max(mx);
        const float m_safe = mx == -CUDART_INF_F ? 0.f : mx;  // all chunks empty -> weights 0
        float total = 0.f;
        for (int c = tid; c < num_splits; c += 32) {
            const float w = expf(__ldcg(lse_part + (size_t)c * BH + r) - m_safe);  // exp(-inf) = 0
            w_s[c] = w;
            total += w;
        }
        total = warp_reduce_sum(total);
        if (tid == 0) w_s[num_splits] = row_scale(total);  // a NaN split poisons the row
    }
    __syncthreads();
    const float inv_total = w_s[num_splits];
    for (int d = tid; d < D; d += blockDim.x) {
        float o = 0.f;
        for (int c = 0; c < num_splits; ++c) o += w_s[c] * __ldcg(o_part + ((size_t)c * BH + r) * D + d);
        out[(size_t)r * D + d] = from_float<T>(o * inv_total);
    }
}

// Fused combine, at the end of a split block that wrote its partials for rows [r0, r0 + rows): the
// num_splits blocks of one (sequence, head tile) each take a ticket on *counter after their
// partials are written; the last one merges the rows (w_s: num_splits + 1 floats of smem the
// block is done with).
// Not inlined: as a call at the kernel's end it leaves the main loop's register allocation as it
// was (inlined, it pushed the 80-register D=32 mma kernel into spills).
template <typename T>
__device__ __noinline__ void combine_if_last(const float* o_part, const float* lse_part, T* out,
                                                unsigned* counter, int num_splits, int BH, int D, int r0,
                                                int rows, float* w_s) {
    if (!last_block_ticket(counter, (unsigned)num_splits)) return;
    for (int r = r0; r < r0 + rows; ++r) {
        combine_row<T>(o_part, lse_part, out, num_splits, BH, D, r, w_s);
        __syncthreads();  // w_s is rewritten for the next row
    }
}

// --- v1: SIMT -----------------------------------------------------------------------------
// Grid (splits, Hkv * n_head_tiles, B), NT threads (a multiple of 32 that divides GT * 32, so each
// warp owns GT / warps heads in the softmax step). The block owns sequence b, kv head kvh, query
// heads kvh*G + ht*GT + g for g < g_tile, and keys [lo, hi) of its split, streamed in tiles of
// BN through the ring. Per tile (FlashAttention-2 Algorithm 1 with one query row per head, in the
// log2 domain: q is pre-scaled once by scale * log2(e), in fp32, so exp becomes exp2):
//   S_j   = q_g . K_j                    (all heads g share one smem read of K_j)
//   m_new = max(m, max_j S_j);  P_j = exp2(S_j - m_new);  alpha = exp2(m - m_new)
//   l     = alpha * l + sum_j P_j;  O = alpha * O + sum_j P_j V_j;  m = m_new
// At the end O / l (0 when l = 0: empty range) and lse = (m + log2 l) * ln 2.
// Roles: a key's dot products are split over TPK = NT / BN adjacent lanes; warp w runs the
// softmax of heads w, w + warps, ...; PV slot v = tid + s*NT -> (key part, head, 16-byte chunk).
// --- register caps ----------------------------------------------------------------------------
// The __launch_bounds__ minimum of a tile: its MINB (config: blocks/SM on an H100's 228 KB), or
// fewer where the compiled family's shared memory per SM (CUPYATTN_SMEM_PER_SM, config
// GPU_FAMILIES) holds fewer rings of RING_BYTES (+ 1 KB reserved per block): a register cap for
// blocks that can never be resident only spills (sm_120, NVRTC 12.9: 4 B of spill loads at the
// 80 registers of MINB 6 and the 128 of MINB 4, where 3 and 1 blocks fit its 100 KB).
#ifndef CUPYATTN_SMEM_PER_SM
#error "CUPYATTN_SMEM_PER_SM (shared memory per SM of the target family) comes from cupyattn/_loader.py"
#endif
template <int MINB, int RING_BYTES>
__host__ __device__ constexpr int resident_min_blocks() {
    return CUPYATTN_SMEM_PER_SM / (RING_BYTES + 1024) < 1 ? 1
         : (CUPYATTN_SMEM_PER_SM / (RING_BYTES + 1024) < MINB ? CUPYATTN_SMEM_PER_SM / (RING_BYTES + 1024) : MINB);
}

template <typename T, int D, int NT, int GT, int BN, int STAGES, int PITCH, int MINB, bool SERVING = false,
          bool STAGED = false>
__global__ void __launch_bounds__(NT, (resident_min_blocks<MINB, STAGES * 2 * BN * PITCH>())) decode_kernel(
    const T* __restrict__ q,            // [B, Hq, 1, D], element (b,h,d) at b*q_sb + h*q_sh + d
    const T* __restrict__ k_cache,      // [B, Hkv, max_seq, D] (one layer), contiguous
    const T* __restrict__ v_cache,      // [B, Hkv, max_seq, D]
    const int* __restrict__ lengths,    // [B] live length of each sequence
    T* __restrict__ out,                // [B, Hq, 1, D] contiguous (written by a block that does not split)
    float* __restrict__ o_part,         // [splits, B, Hq, D] (when write_partials == 1)
    float* __restrict__ lse_part,       // [splits, B, Hq]
    unsigned* __restrict__ counters,    // [B, gridDim.y], zero, or null: see combine_if_last
    long long q_sb, long long q_sh,
    int B, int Hq, int Hkv, int max_seq, int num_splits, float scale_log2, int write_partials,
    int split_keys,                     // 0: uniform chunks; > 0: per-sequence split counts (SeqSplit)
    DECODE_SERVING_PARAMS) {
    constexpr int WARPS = NT / 32, VEC = 16 / sizeof(T), ROW = D * (int)sizeof(T), NC = ROW / 16;
    constexpr int TPK = NT / BN;                        // lanes sharing one key's dot products
    constexpr int CPT = (NC + TPK - 1) / TPK;           // chunks per lane in a dot product
    constexpr int SLOTS = (GT * NC + NT - 1) / NT;      // PV slots per thread
    constexpr int HPW = GT / WARPS;                     // softmax heads per warp
    constexpr int SLOT_BYTES = 2 * BN * PITCH;
    static_assert(NT % 32 == 0 && GT % WARPS == 0, "heads per warp must be whole");
    static_assert(ROW % 16 == 0 && PITCH % 16 == 0 && PITCH >= ROW, "bad smem row pitch");
    static_assert(NT % BN == 0 && 32 % TPK == 0, "a key's lane group must not straddle warps");
    static_assert(STAGES >= 2, "the ring needs at least two slots");
    // The end-of-kernel O reduction reuses the ring: [KP, n_pairs, VEC] floats, KP*n_pairs <= max(NT, GT*NC).
    static_assert(STAGES * SLOT_BYTES >= 4 * VEC * (NT > GT * NC ? NT : GT * NC), "ring too small for the O reduction");

    extern __shared__ uint4 ring_u4[];                     // dynamic smem, 16-byte aligned
    unsigned char* ring = reinterpret_cast<unsigned char*>(ring_u4);  // [STAGES][K, V][BN][PITCH]
    __shared__ __align__(16) float q_s[GT * D];            // [GT, D] q * scale * log2(e)
    __shared__ float p_s[GT * BN];                         // [GT, BN] scores, then P
    __shared__ float alpha_s[GT];                          // per-head rescale of this tile
    __shared__ float m_fin[GT], l_fin[GT];                 // final m, l per head

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int split = blockIdx.x, b = blockIdx.z;
    const int G = Hq / Hkv;
    const int n_ht = (G + GT - 1) / GT;
    const int kvh = blockIdx.y / n_ht, ht = blockIdx.y - kvh * n_ht;
    const int g_tile = min(GT, G - ht * GT);               // heads in this tile (>= 1)
    const int h0 = kvh * G + ht * GT;                      // first query head of the tile

    // this split's keys (per-sequence splits, serving variants only: a split past the sequence's
    // count has none and leaves); tiles 0 .. STAGES-2 in flight before anything else
    const SeqSplit sp(lengths, b, max_seq, SERVING ? win_left : -1, num_splits, SERVING ? split_keys : 0);
    if (SERVING && split >= sp.splits) return;  // (plain launches have sp.splits = gridDim.x)
    const bool partials = sp.partials(write_partials);
    KvStream<T, D, BN, PITCH, NT, STAGES, SERVING, STAGED> kv(k_cache, v_cache, sp, split, b, kvh, Hkv, max_seq,
                                                              block_table, bt_stride, log2_page, num_pages, page_hnd);
    kv.start(ring);
    const int lo = kv.lo, hi = kv.hi, ntiles = kv.ntiles;

    // q tile -> smem, pre-scaled (made visible by the first tile's barrier)
    for (int i = tid; i < g_tile * D; i += NT) {
        const int g = i / D, d = i - g * D;
        q_s[i] = to_float(q[b * q_sb + (long long)(h0 + g) * q_sh + d]) * scale_log2;
    }

    const int kj = tid / TPK, kpart = tid - kj * TPK;      // score role: key kj, chunk part kpart
    float m_i[HPW], l_i[HPW];                              // softmax role: heads warp + i*WARPS
#pragma unroll
    for (int i = 0; i < HPW; ++i) { m_i[i] = -CUDART_INF_F; l_i[i] = 0.f; }
    // PV role. With few (head, chunk) pairs the keys of a tile are also split KP ways (v = kp *
    // n_pairs + pair); partial O's are summed at the end, which is exact because every part of a
    // head is rescaled by the same alpha.
    const int n_pairs = g_tile * NC;
    const int KP = n_pairs >= NT ? 1 : NT / n_pairs;
    float acc[SLOTS][VEC];                                 // O (unnormalised), per slot
    int slot_g[SLOTS], slot_c[SLOTS], slot_kp[SLOTS];
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
        const int v = tid + s * NT;
        const int pair = v % n_pairs;
        slot_kp[s] = v < n_pairs * KP ? v / n_pairs : KP;  // KP marks an idle slot
        slot_g[s] = pair / NC;
        slot_c[s] = pair - slot_g[s] * NC;
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[s][e] = 0.f;
    }

    for (int t = 0; t < ntiles; ++t) {
        const int tile_n = min(BN, hi - lo - t * BN);       // valid keys in this tile (>= 1)
        kv.publish();                 // (STAGED) a fetched page-id window, before the barrier
        cp_async_wait<STAGES - 2>();  // this thread's copies of tile t have landed
        __syncthreads();              // everyone's have; everyone is done with tile t-1's slot and p_s
        kv.issue(ring, t + STAGES - 1);  // (an empty commit group past the end keeps the wait count uniform)
        const unsigned char* k_s = ring + t % STAGES * SLOT_BYTES;
        const unsigned char* v_s = k_s + BN * PITCH;

        // ---- S_j = q_g . K_j for every head g of the tile (K chunk read once, used g_tile times)
        {
            float s_acc[GT];
#pragma unroll
            for (int g = 0; g < GT; ++g) s_acc[g] = 0.f;
            if (kj < tile_n) {
#pragma unroll
                for (int i = 0; i < CPT; ++i) {
                    const int c = kpart + i * TPK;
                    if (c < NC) {
                        float kf[VEC];
                        chunk_to_float(*reinterpret_cast<const uint4*>(k_s + kj * PITCH + c * 16), kf, T());
#pragma unroll
                        for (int g = 0; g < GT; ++g) {
                            if (g < g_tile) {
                                const float* qg = q_s + g * D + c * VEC;
#pragma unroll
                                for (int e = 0; e < VEC; e += 4) {
                                    const float4 qv = *reinterpret_cast<const float4*>(qg + e);
                                    s_acc[g] += qv.x * kf[e] + qv.y * kf[e + 1] + qv.z * kf[e + 2] + qv.w * kf[e + 3];
                                }
                            }
                        }
                    }
                }
            }
            // sum the TPK partial dots of a key (its lanes are adjacent; all lanes take part)
#pragma unroll
            for (int g = 0; g < GT; ++g) {
                if (g < g_tile) {  // block-uniform, so every lane shuffles or none does
#pragma unroll
                    for (int o = TPK / 2; o > 0; o >>= 1) s_acc[g] += __shfl_xor_sync(0xffffffffu, s_acc[g], o);
                }
            }
            if (kpart == 0 && kj < tile_n) {
#pragma unroll
                for (int g = 0; g < GT; ++g)  // (softcap: scores are in log2 units, as soft_cap takes them)
                    if (g < g_tile) p_s[g * BN + kj] = SERVING ? soft_cap(s_acc[g], softcap_log2) : s_acc[g];
            }
        }
        __syncthreads();

        // ---- online softmax per head: m_new, P = exp2(S - m_new), alpha = exp2(m - m_new), l
#pragma unroll
        for (int i = 0; i < HPW; ++i) {
            const int g = warp + i * WARPS;
            if (g < g_tile) {  // warp-uniform
                float mx = -CUDART_INF_F;
                for (int j = lane; j < tile_n; j += 32) mx = fmaxf(mx, p_s[g * BN + j]);
                mx = warp_reduce_max(mx);
                const float m_new = fmaxf(m_i[i], mx);      // finite: the tile has a valid key
                const float alpha = exp2f(m_i[i] - m_new);  // m = -inf on the first tile -> 0
                float sum = 0.f;
                for (int j = lane; j < BN; j += 32) {
                    const float p = j < tile_n ? exp2f(p_s[g * BN + j] - m_new) : 0.f;
                    p_s[g * BN + j] = p;
                    sum += p;
                }
                sum = warp_reduce_sum(sum);
                l_i[i] = alpha * l_i[i] + sum;
                m_i[i] = m_new;
                if (lane == 0) alpha_s[g] = alpha;
            }
        }
        __syncthreads();  // P and alpha visible

        // ---- O = alpha * O + sum_j P_j V_j   (rescale O by exp(m_old - m_new), then accumulate)
#pragma unroll
        for (int s = 0; s < SLOTS; ++s) {
            if (slot_kp[s] < KP) {
                const int g = slot_g[s], c = slot_c[s];
                const float alpha = alpha_s[g];
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[s][e] *= alpha;
                for (int j = slot_kp[s]; j < tile_n; j += KP) {
                    const float p = p_s[g * BN + j];
                    float vf[VEC];
                    chunk_to_float(*reinterpret_cast<const uint4*>(v_s + j * PITCH + c * 16), vf, T());
#pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[s][e] += p * vf[e];
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // every thread is done with the ring: it becomes the O reduction buffer

    // ---- finalise: sum the KP partial O's (through the ring), divide by l, write
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < HPW; ++i) {
            const int g = warp + i * WARPS;
            if (g < g_tile) { m_fin[g] = m_i[i]; l_fin[g] = l_i[i]; }
        }
    }
    float* red = reinterpret_cast<float*>(ring);  // [KP, n_pairs, VEC]
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
        if (slot_kp[s] < KP) {
            const int v = tid + s * NT;  // == kp * n_pairs + pair
#pragma unroll
            for (int e = 0; e < VEC; ++e) red[v * VEC + e] = acc[s][e];
        }
    }
    __syncthreads();
    for (int pair = tid; pair < n_pairs; pair += NT) {
        const int g = pair / NC, c = pair - g * NC;
        float o[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) o[e] = 0.f;
        for (int kp = 0; kp < KP; ++kp) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) o[e] += red[(kp * n_pairs + pair) * VEC + e];
        }
        const float l = l_fin[g];
        const float inv_l = row_scale(l);  // empty range -> zeros, NaN row -> NaN
        const int h = h0 + g;
        if (partials) {
            float* op = o_part + (((size_t)split * B + b) * Hq + h) * D + c * VEC;
#pragma unroll
            for (int e = 0; e < VEC; ++e) op[e] = o[e] * inv_l;
        } else {
            T* op = out + ((size_t)b * Hq + h) * D + c * VEC;
#pragma unroll
            for (int e = 0; e < VEC; ++e) op[e] = from_float<T>(o[e] * inv_l);
        }
    }
    if (partials && tid < g_tile) {
        const float l = l_fin[tid];
        lse_part[((size_t)split * B + b) * Hq + h0 + tid] =
            row_lse(m_fin[tid], l);
    }
    if (partials && counters != nullptr)
        combine_if_last<T>(o_part, lse_part, out, counters + (size_t)b * gridDim.y + blockIdx.y, sp.splits,
                           B * Hq, D, b * Hq + h0, g_tile, reinterpret_cast<float*>(ring));
}

// --- v2: tensor cores ----------------------------------------------------------------------
// Grid (splits, Hkv * n_head_tiles, B), WARPS * 32 threads. The block owns up to ROWS = 16 * MT
// query heads of one kv head (rows >= g_tile of the A tiles are zero) and keys [lo, hi) of its
// split. Warp w takes A tile mt = w % MT and key slice ks = w / MT: keys [ks*KPW, (ks+1)*KPW) of
// every ring tile. Per tile, for its 16 heads x KPW keys (FlashAttention-2 Algorithm 1, one query
// row per head; the scale is folded into the exp2 FMA: c = |scale| * log2(e), q negated on load
// when scale < 0, so m is kept in the scaled log2 domain while S stays raw fp32 from the mma):
//   S      = Q K_w^T                                  (mma, fp32 accumulators)
//   m_new  = max(m, c * max_j S_j);  P = exp2(c * S - m_new);  alpha = exp2(m - m_new)
//   l      = alpha * l + rowsum(P);  O = alpha * O + P V_w    (P rounded to T for the mma)
// Keys at or past the split's end get P = 0 (selected, never multiplied). At the end the KS =
// WARPS / MT slices of each head are merged: O = sum_s exp2(m_s - m) O_s / sum_s exp2(m_s - m) l_s.
// Fragment layouts are the PTX ISA's (ptx.cuh); g = lane / 4 and tq = lane % 4 below.
template <typename T, int D, int MT, int WARPS, int BN, int STAGES, int PITCH, int MINB, bool SERVING = false,
          bool STAGED = false>
__global__ void __launch_bounds__(WARPS * 32, (resident_min_blocks<MINB, STAGES * 2 * BN * PITCH>())) decode_mma_kernel(
    const T* __restrict__ q,            // [B, Hq, 1, D], element (b,h,d) at b*q_sb + h*q_sh + d
    const T* __restrict__ k_cache,      // [B, Hkv, max_seq, D] (one layer), contiguous
    const T* __restrict__ v_cache,      // [B, Hkv, max_seq, D]
    const int* __restrict__ lengths,    // [B] live length of each sequence
    T* __restrict__ out,                // [B, Hq, 1, D] contiguous (written by a block that does not split)
    float* __restrict__ o_part,         // [splits, B, Hq, D] (when write_partials == 1)
    float* __restrict__ lse_part,       // [splits, B, Hq]
    unsigned* __restrict__ counters,    // [B, gridDim.y], zero, or null: see combine_if_last
    long long q_sb, long long q_sh,
    int B, int Hq, int Hkv, int max_seq, int num_splits, float scale_log2, int write_partials,
    int split_keys,                     // 0: uniform chunks; > 0: per-sequence split counts (SeqSplit)
    DECODE_SERVING_PARAMS) {
    constexpr int NT = WARPS * 32, ROWS = 16 * MT, KS = WARPS / MT, KPW = BN / KS;
    constexpr int QP = D + 8;                 // q tile row pitch (elements): conflict-free ldmatrix
    constexpr int SLOT_BYTES = 2 * BN * PITCH;
    constexpr int ES = sizeof(T);
    static_assert(ES == 2, "tensor-core decode takes fp16 / bf16");
    static_assert(WARPS % MT == 0 && BN % KS == 0 && KPW % 16 == 0 && D % 16 == 0, "bad mma decode tile");
    static_assert(PITCH % 16 == 0 && PITCH >= D * ES, "bad smem row pitch");
    static_assert(STAGES >= 2, "the ring needs at least two slots");
    static_assert(STAGES * SLOT_BYTES >= KS * ROWS * D * 4, "ring too small for the O merge");

    extern __shared__ uint4 ring_u4[];                     // dynamic smem, 16-byte aligned
    unsigned char* ring = reinterpret_cast<unsigned char*>(ring_u4);  // [STAGES][K, V][BN][PITCH]
    __shared__ __align__(16) T q_s[ROWS * QP];             // [ROWS, D] (pitch QP), unscaled
    __shared__ float m_s[KS][ROWS], l_s[KS][ROWS];         // per-slice softmax state at the end

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int mt = warp % MT, ks = warp / MT;
    const int split = blockIdx.x, b = blockIdx.z;
    const int G = Hq / Hkv;
    const int n_ht = (G + ROWS - 1) / ROWS;
    const int kvh = blockIdx.y / n_ht, ht = blockIdx.y - kvh * n_ht;
    const int g_tile = min(ROWS, G - ht * ROWS);
    const int h0 = kvh * G + ht * ROWS;

    // this split's keys, as the SIMT kernel's; tiles 0 .. STAGES-2 in flight first
    const SeqSplit sp(lengths, b, max_seq, SERVING ? win_left : -1, num_splits, SERVING ? split_keys : 0);
    if (SERVING && split >= sp.splits) return;
    const bool partials = sp.partials(write_partials);  // else: this block writes out itself
    KvStream<T, D, BN, PITCH, NT, STAGES, SERVING, STAGED> kv(k_cache, v_cache, sp, split, b, kvh, Hkv, max_seq,
                                                              block_table, bt_stride, log2_page, num_pages, page_hnd);
    kv.start(ring);
    const int lo = kv.lo, hi = kv.hi, ntiles = kv.ntiles;

    // q tile -> smem; padded rows are zeros. Negation is exact, so c = |scale| log2(e) >= 0.
    const bool neg = scale_log2 < 0.f;
    // softcap (SERVING): S is capped in log2 units first (c * S -> C tanh(c S / C)), then taken as is
    const bool cap = SERVING && softcap_log2 > 0.f;
    const float c = cap ? 1.f : fabsf(scale_log2);
    for (int i = tid; i < ROWS * D; i += NT) {
        const int r = i / D, d = i - r * D;
        const float x = r < g_tile ? to_float(q[b * q_sb + (long long)(h0 + r) * q_sh + d]) : 0.f;
        q_s[r * QP + d] = from_float<T>(neg ? -x : x);
    }

    float o[D / 8][4];                  // O of rows g, g+8 (e / 2) and cols dn*8 + 2tq + e % 2
    float m_r[2] = {-CUDART_INF_F, -CUDART_INF_F}, l_r[2] = {0.f, 0.f};  // rows g, g+8; l per lane
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[dn][e] = 0.f;

    // per-lane ldmatrix row offsets (see ptx.cuh): A tile of q, non-trans B of K, trans B of V
    const int a_row = mt * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 8 * (lane >> 4);
    const int kb_row = (lane & 7) + 8 * (lane >> 4), kb_col = 8 * ((lane >> 3) & 1);
    const int vb_row = (lane & 7) + 8 * ((lane >> 3) & 1), vb_col = 8 * (lane >> 4);

    for (int t = 0; t < ntiles; ++t) {
        kv.publish();     // (STAGED) a fetched page-id window, before the barrier
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile t visible to all; tile t-1's slot is free
        kv.issue(ring, t + STAGES - 1);

        const int nvalid = min(KPW, hi - lo - t * BN - ks * KPW);  // this warp's live keys
        if (nvalid <= 0) continue;  // warp-uniform; the next barrier is at the loop head
        const unsigned char* k_w = ring + t % STAGES * SLOT_BYTES + ks * KPW * PITCH;  // [KPW][PITCH]
        const unsigned char* v_w = k_w + BN * PITCH;

        // ---- S = Q K_w^T: KPW / 8 n-tiles of 8 keys, D / 16 k-steps
        float s[KPW / 8][4];
#pragma unroll
        for (int n = 0; n < KPW / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            unsigned a[4];
            ldmatrix<4>(a, q_s + a_row * QP + kk * 16 + a_col);
#pragma unroll
            for (int j = 0; j < KPW / 16; ++j) {
                unsigned r[4];  // matrices: keys 0-7 / 8-15 (lane / 16) x d halves (lane / 8 % 2)
                ldmatrix<4>(r, k_w + (j * 16 + kb_row) * PITCH + (kk * 16 + kb_col) * ES);
                const unsigned b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                mma_m16n8k16<T>(s[2 * j], a, b0);
                mma_m16n8k16<T>(s[2 * j + 1], a, b1);
            }
        }

        if (cap) {
#pragma unroll
            for (int n = 0; n < KPW / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[n][e] = soft_cap(s[n][e] * fabsf(scale_log2), softcap_log2);
        }

        // ---- online softmax of rows g (h = 0) and g+8 (h = 1); a row's 4 lanes share m
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = -CUDART_INF_F;
#pragma unroll
            for (int n = 0; n < KPW / 8; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (n * 8 + 2 * tq + e < nvalid) mx = fmaxf(mx, s[n][2 * h + e]);
            mx = quad_max(mx);
            const float m_new = fmaxf(m_r[h], c * mx);    // finite: key 0 of the slice is live
            const float alpha = exp2f(m_r[h] - m_new);    // 0 on the first tile (m = -inf)
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < KPW / 8; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = n * 8 + 2 * tq + e < nvalid ? exp2f(fmaf(s[n][2 * h + e], c, -m_new)) : 0.f;
                    s[n][2 * h + e] = p;
                    sum += p;
                }
            l_r[h] = alpha * l_r[h] + sum;  // this lane's columns only; summed over the quad at the end
            m_r[h] = m_new;
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn) { o[dn][2 * h] *= alpha; o[dn][2 * h + 1] *= alpha; }
        }

        // ---- O += P V_w: the S accumulators of n-tiles 2j, 2j+1 are the A fragment of keys 16j..16j+15
#pragma unroll
        for (int j = 0; j < KPW / 16; ++j) {
            unsigned pa[4];
            c_pair_to_a<T>(s[2 * j], s[2 * j + 1], pa);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                unsigned r[4];  // .trans: matrices keys 0-7 / 8-15 (lane / 8 % 2) x d 0-7 / 8-15 (lane / 16)
                ldmatrix<4, true>(r, v_w + (j * 16 + vb_row) * PITCH + (dp * 16 + vb_col) * ES);
                const unsigned b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                mma_m16n8k16<T>(o[2 * dp], pa, b0);
                mma_m16n8k16<T>(o[2 * dp + 1], pa, b1);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: it holds the slices' O for the merge

    // ---- merge the KS key slices of each head
    float* red = reinterpret_cast<float*>(ring);  // [KS][ROWS][D]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_r[h] = quad_sum(l_r[h]);
        const int row = mt * 16 + g + 8 * h;
        if (tq == 0) { m_s[ks][row] = m_r[h]; l_s[ks][row] = l_r[h]; }
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn)
            *reinterpret_cast<float2*>(red + (ks * ROWS + row) * D + dn * 8 + 2 * tq) =
                make_float2(o[dn][2 * h], o[dn][2 * h + 1]);
    }
    __syncthreads();
    for (int i = tid; i < g_tile * D; i += NT) {
        const int row = i / D, d = i - row * D;
        float m = -CUDART_INF_F;
#pragma unroll
        for (int sl = 0; sl < KS; ++sl) m = fmaxf(m, m_s[sl][row]);
        float l = 0.f, acc = 0.f;
        if (m != -CUDART_INF_F) {  // some slice saw a key
#pragma unroll
            for (int sl = 0; sl < KS; ++sl) {
                const float w = exp2f(m_s[sl][row] - m);  // 0 for a slice that saw none
                l += w * l_s[sl][row];
                acc += w * red[(sl * ROWS + row) * D + d];
            }
        }
        const float inv_l = row_scale(l);
        const int hq = h0 + row;
        if (partials) {
            o_part[(((size_t)split * B + b) * Hq + hq) * D + d] = acc * inv_l;
            if (d == 0)
                lse_part[((size_t)split * B + b) * Hq + hq] = row_lse(m, l);
        } else {
            out[((size_t)b * Hq + hq) * D + d] = from_float<T>(acc * inv_l);
        }
    }
    if (partials && counters != nullptr)
        combine_if_last<T>(o_part, lse_part, out, counters + (size_t)b * gridDim.y + blockIdx.y, sp.splits,
                           B * Hq, D, b * Hq + h0, g_tile, reinterpret_cast<float*>(ring));
}

// --- combine -------------------------------------------------------------------------------
// Grid (B * Hq), THREADS threads: row blockIdx.x = b * Hq + h (combine_row) over its sequence's
// split count (SeqSplit: num_splits, or per sequence when split_keys > 0; then a sequence of one
// split was written by its decode block and is left alone).
template <typename T, int DEC_MAX_SPLITS, int THREADS>
__global__ void __launch_bounds__(THREADS) decode_combine_kernel(
    const float* __restrict__ o_part,   // [splits, B*Hq, D]
    const float* __restrict__ lse_part, // [splits, B*Hq]
    T* __restrict__ out,                // [B*Hq, D] contiguous
    int num_splits, int BH, int D,
    const int* __restrict__ lengths,    // [B] as the decode launch read them (split_keys > 0)
    int Hq, int max_seq, int win_left, int split_keys) {
    __shared__ float w_s[DEC_MAX_SPLITS + 1];  // weight of each split, then 1 / their sum
    int n = num_splits;
    if (split_keys > 0) {
        n = SeqSplit(lengths, blockIdx.x / Hq, max_seq, win_left, num_splits, split_keys).splits;
        if (n == 1) return;
    }
    combine_row<T>(o_part, lse_part, out, n, BH, D, blockIdx.x, w_s);
}
