// paged.cuh: the addressing and masking the serving variants of the attention kernels share
// (flash_attn.cu, decode.cu and kvcache.cu; cupyattn/varlen.py, cupyattn/paged.py).
//
//   KvRows<T, PAGED>   where key j of one (sequence, kv head) lives: contiguous rows (PAGED = false,
//                      or a null table) base + j * stride, or through a block table
//                      (flash_attn_with_kvcache's convention, page_size a power of 2):
//                      base + (table[j / page] * page_rows + j % page) * stride
//   Page layouts       NHD pages [num_pages, page_size, Hkv, D] (vLLM, flash-attention: one head's
//                      rows Hkv * D apart) or HND pages [num_pages, Hkv, page_size, D] (FlashInfer's
//                      kv_layout="HND": one head's rows of a page contiguous). A page holds
//                      page_size * Hkv * D elements either way: page_rows = page_size rows of
//                      stride Hkv * D (NHD) or Hkv * page_size rows of stride D (HND); the layouts
//                      also differ in the kv head's offset inside a page (paged_rows)
//   PageWindow         the page ids of one decode split's keys staged in shared memory before
//                      its K/V ring needs them (decode.cu STAGED): a row address is then a shared
//                      read, a shift and a multiply-add, with no global load in front of its copy
//   Window             flash-attention's window=(left, right) seen from one query row: key j is
//                      visible when i + diag - left <= j <= i + diag + right (-1: unbounded), with
//                      diag = Sk - Sq (bottom-right alignment); causal is (left, 0)
//   softcap_log2       s -> C tanh(s / C) with s and C = softcap * log2(e) both in log2 units,
//                      which is softcap * tanh(s_nat / softcap) (Gemma 2) taken to log2 units
#pragma once

// One (sequence, kv head)'s keys or values. `table` points at the sequence's block-table row; page
// ids are clamped to [0, num_pages) so a corrupt table reads some page of the cache, never past it.
template <typename T, bool PAGED>
struct KvRows {
    const T* base;          // row 0 of this kv head (in page 0 when paged)
    long long stride;       // elements between consecutive rows (of one page when paged)
    const int* table;       // block-table row of the sequence (PAGED only; null: contiguous)
    int log2_page;          // log2(page_size)
    int max_page;           // num_pages - 1
    int page_rows;          // rows of `stride` elements from one page to the next (paged only)
    __device__ __forceinline__ const T* row(int j) const {
        long long p = j;
        if (PAGED && table != nullptr) {
            const int pg = min(max(table[j >> log2_page], 0), max_page);
            p = (long long)pg * page_rows + (j & ((1 << log2_page) - 1));
        }
        return base + p * stride;
    }
};

// The rows of kv head hk of a sequence whose block-table row is `table`, in pages of either
// layout (hnd: 0 NHD, 1 HND). (PAGED = false instantiates it for kernels that never call it.)
template <typename T, bool PAGED>
__device__ __forceinline__ KvRows<T, PAGED> paged_rows(const T* pages, const int* table, int hk, int Hkv, int D,
                                                       int log2_page, int num_pages, int hnd) {
    return hnd ? KvRows<T, PAGED>{pages + ((long long)hk * D << log2_page), D, table, log2_page, num_pages - 1,
                                  Hkv << log2_page}
               : KvRows<T, PAGED>{pages + (long long)hk * D, (long long)Hkv * D, table, log2_page, num_pages - 1,
                                  1 << log2_page};
}

// The page ids of keys [lo, hi) of one sequence, staged in shared memory a window at a time.
// Window w covers keys [lo + w * keys_per_win, lo + (w + 1) * keys_per_win) (keys_per_win a
// multiple of the ring's BN, so a K/V tile never straddles two windows) and lives in buffer
// w & 1 of ids [2][CAP], entry e = the page of position (first page of the window + e), clamped
// as KvRows clamps. keys_per_win is the most keys whose pages always fit CAP entries:
// keys [a, a + n) touch at most ceil((n - 1) / page) + 1 pages, <= CAP when n <= (CAP - 1) * page.
// A thread fetches its entries (e = tid, tid + NT, ...) into registers with plain global loads and
// stores them later, so the loads' latency overlaps other work; the caller orders the store after
// the last read of that buffer, and before the first read of the window, with a block barrier.
template <int CAP, int NT, int BN>
struct PageWindow {
    static constexpr int PER_THREAD = (CAP + NT - 1) / NT;
    int* ids;                // shared [2][CAP]
    const int* table;        // the sequence's block-table row
    int lo, hi, log2_page, max_page, keys_per_win;
    __device__ __forceinline__ void init(int* ids_s, const int* table_row, int lo_, int hi_, int log2_page_,
                                         int num_pages) {
        ids = ids_s; table = table_row; lo = lo_; hi = hi_; log2_page = log2_page_; max_page = num_pages - 1;
        keys_per_win = max(BN, ((CAP - 1) << log2_page) / BN * BN);
    }
    __device__ __forceinline__ int tiles_per_win() const { return keys_per_win / BN; }
    __device__ __forceinline__ int first_page(int w) const { return (lo + w * keys_per_win) >> log2_page; }
    // this thread's entries of window w (none past hi) -> r; touches no shared memory. Not
    // inlined: a rare call (once per window) that, inlined into the ring loop, took the SIMT decode
    // kernel from 92 to 158 registers (ptxas, sm_90, fp16 D=128).
    __device__ __noinline__ void fetch(int w, int (&r)[PER_THREAD]) const {
        const bool live = (long long)w * keys_per_win < hi - lo;
        const int p0 = live ? first_page(w) : 0;
        const int last = live ? (min((long long)hi, lo + (long long)(w + 1) * keys_per_win) - 1) >> log2_page : -1;
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int e = threadIdx.x + i * NT;
            r[i] = e < CAP && p0 + e <= last ? min(max(table[p0 + e], 0), max_page) : 0;
        }
    }
    __device__ __forceinline__ void store(int w, const int (&r)[PER_THREAD]) const {
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int e = threadIdx.x + i * NT;
            if (e < CAP) ids[(w & 1) * CAP + e] = r[i];
        }
    }
    // the entry index of key j's page is idx0(w) + (j >> log2_page), for j in window w
    __device__ __forceinline__ int idx0(int w) const { return (w & 1) * CAP - first_page(w); }
};

// The K/V rows of one tile of window w through a PageWindow (STAGED decode): the same rows as
// KvRows::row, with the page id read from shared memory.
template <typename T>
struct StagedRows {
    const T* base;           // the kv head's row 0 in page 0 (KvRows::base)
    long long stride;
    const int* ids;          // PageWindow::ids
    int idx0, log2_page, page_rows;
    __device__ __forceinline__ const T* row(int j) const {
        const int pg = ids[idx0 + (j >> log2_page)];
        return base + ((long long)pg * page_rows + (j & ((1 << log2_page) - 1))) * stride;
    }
};

// The visible key range [lo, hi] of query row i (inclusive; hi < lo means none), before the
// clamp to the sequence's keys.
struct Window {
    int left, right, diag;   // -1: that side is unbounded
    __device__ __forceinline__ int lo(int i) const { return left < 0 ? 0 : i + diag - left; }
    __device__ __forceinline__ int hi(int i) const { return right < 0 ? 0x7fffffff : i + diag + right; }
};

// Score capping in log2 units (softcap_log2 = softcap * log2(e) > 0; 0 turns it off). tanh keeps
// the sign and saturates, so huge scores stay finite; NaN stays NaN.
__device__ __forceinline__ float soft_cap(float s_log2, float softcap_log2) {
    return softcap_log2 > 0.f ? softcap_log2 * tanhf(s_log2 / softcap_log2) : s_log2;
}
