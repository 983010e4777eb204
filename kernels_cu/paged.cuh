// paged.cuh: the addressing and masking the serving variants of the attention kernels share
// (flash_attn.cu, decode.cu and kvcache.cu; cupyattn/varlen.py, cupyattn/paged.py).
//
//   KvRows<T, PAGED>   where key j of one (sequence, kv head) lives: row base + phys(j) * stride,
//                      phys(j) = j (contiguous, PAGED = false, or a null table) or
//                      table[j / page] * page + j % page (a block table, flash_attn_with_kvcache's
//                      convention: pages [num_pages, page_size, Hkv, D], page_size a power of 2)
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
    const T* base;       // physical row 0 of this kv head
    long long stride;    // elements between consecutive physical rows
    const int* table;    // block-table row of the sequence (PAGED only; null: contiguous)
    int log2_page;       // log2(page_size)
    int max_page;        // num_pages - 1
    __device__ __forceinline__ const T* row(int j) const {
        long long p = j;
        if (PAGED && table != nullptr) {
            const int pg = min(max(table[j >> log2_page], 0), max_page);
            p = ((long long)pg << log2_page) | (j & ((1 << log2_page) - 1));
        }
        return base + p * stride;
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
