// flash_attn_sm90_sched.cuh: the tile schedulers of the Hopper attention kernel (flash_attn_sm90.cu),
// as their own piece: what one tile of work is (Fa3Work), the order tiles come in and how a block
// gets them (Fa3Sched: get_initial_work / get_next_work), and the scheduler warp's loop that
// publishes them (fa3_schedule). The mainloop and the epilogue never know which scheduler feeds them.
//
//   SCHED         a block computes                         impl
//   FA3_GRID      tile blockIdx.x, then stops (grid =      "wgmma" (attention())
//                 tiles; the hardware dispatches blocks
//                 in index order as SMs free up)
//   FA3_PERSIST   tile blockIdx.x, then: dynamic (a        "wgmma_persistent" (attention,
//                 counter in global memory) tiles claimed  attention_varlen, attention_paged)
//                 by one relaxed atomic add while the
//                 consumers compute, or static (no
//                 counter: tiles i, i + grid, ...)
//
// One order for both (Fa3Sched::work, modelled by cupyattn/kv_traffic.py): sequence after sequence;
// within one, query heads in sections of `heads_per_section` (whose K/V fit in L2 together: the
// traffic model picks it); within a section, query-tile ranks across its heads, heaviest rank
// first when a right bound (causal) makes tiles unequal. A section's heads are then read by the
// blocks in flight together and come from L2, not DRAM, for all but their first tile.
//
// Extents: offsets and lengths read from device memory (cu_q, cu_k, kv_lens) are clamped to the
// arrays the host passed (total_q rows of q / out / lse, total_k rows of k / v, the block table's
// width in keys), so a wrong offset can make a tile compute garbage but never read or write past
// an array.
#pragma once
#include "sm90.cuh"
#include "flash_attn_sm90.cuh"

constexpr int FA3_GRID = 0, FA3_PERSIST = 1;

// --- the work of one tile, as the scheduler publishes it ----------------------------------------
struct Fa3Work {
    int b, h;              // sequence and query head; b < 0: no more work
    int m0;                // first query row of the tile, in its sequence
    int q0, k0;            // packed rows of the sequence's query 0 / key 0 (cu_q / cu_k), or 0
    int sq, sk;            // the sequence's queries and keys (diag = sk - sq: bottom-right)
    int k_end;             // keys from here on are hidden (key_lengths / seq_lens; <= sk)
    int n_lo, n_tiles;     // key tiles n_lo + j BLOCK_N, j < n_tiles, are seen by some row
    int j_left, j_right;   // key tiles [0, j_left) and [j_right, n_tiles) need masking
    int v_zero_from;       // V rows from here on hold data of others: zeroed (INT_MAX: none)
};

// What every part of the kernel reads from the arguments.
struct Fa3Args {
    const int* kv_lens;    // dense: key_lengths [B] or null; paged: seq_lens [B]
    const int* cu_q;       // [B + 1] packed query offsets or null
    const int* cu_k;       // [B + 1] packed key offsets or null
    const int* table;      // [B, bt_stride] page ids or null
    int bt_stride, log2_page, num_pages;
    int B, Hq, Hkv, Sq, Sk, heads_per_section;  // Sq / Sk: dense rows per sequence; packed total_q / total_k
    int win_left, win_right;   // -1: unbounded; causal is right = 0
    bool all_masked;       // a mask tensor, a negative scale or a softcap: every key tile masked
};

__device__ __forceinline__ int fa3_ceil_div(int a, int b) { return (a + b - 1) / b; }
__device__ __forceinline__ int fa3_clamp(int x, int lo, int hi) { return min(max(x, lo), hi); }

// Packed sequence b's rows [first, end) of an array of `total` rows: offsets from device memory,
// clamped to it (a decreasing or out-of-range offset gives an empty or shortened sequence).
__device__ __forceinline__ void fa3_rows(const int* cu, int b, int total, int& first, int& end) {
    first = fa3_clamp(cu[b], 0, total);
    end = fa3_clamp(cu[b + 1], first, total);
}

// Query tiles of sequence b (packed: from cu_q; dense: every sequence has Sq rows).
__device__ __forceinline__ int fa3_m_tiles(const Fa3Args& a, int b) {
    int sq = a.Sq;
    if (a.cu_q) {
        int first, end;
        fa3_rows(a.cu_q, b, a.Sq, first, end);
        sq = end - first;
    }
    return sq > 0 ? fa3_ceil_div(sq, FA3_BLOCK_M) : 0;
}

__device__ __forceinline__ int fa3_warp_max(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// --- tile scheduler (FlashAttention-3's hopper/tile_scheduler.hpp, in this kernel's terms) --------
// Run by the scheduler warp (all 32 lanes, uniformly). get_initial_work / get_next_work give tile
// indices; work(t) turns one into a Fa3Work. Packed queries: the sequence of tile t is found by a
// warp scan over 32 sequences at a time, resumed from where the last search stopped (a block's
// tiles come in increasing order).
template <int SCHED>
struct Fa3Sched {
    unsigned* counter;     // FA3_PERSIST: dynamic, claim by atomic add; null: static stride
    int total;             // tiles of the launch
    int seq0, base;        // packed: first sequence of the scan window, tiles before it

    __device__ int get_initial_work() const { return blockIdx.x; }
    __device__ int get_next_work(int t) {
        if constexpr (SCHED == FA3_GRID) {
            return total;                                 // one tile per block
        } else {
            if (counter == nullptr) return t + gridDim.x;
            unsigned old = 0;
            if (threadIdx.x % 32 == 0) {
                old = atomic_add_relaxed(counter, 1u);
                if (old == (unsigned)total - 1u) atomic_add_relaxed(counter, 0u - (unsigned)total);  // the launch's last add
            }
            return (int)__shfl_sync(0xffffffffu, old, 0) + (int)gridDim.x;
        }
    }

    // Tiles of the launch: dense B * Hq * m_tiles; packed, summed over the sequences by the warp.
    __device__ void init(const Fa3Args& a, unsigned* ctr) {
        counter = ctr;
        seq0 = base = 0;
        if (a.cu_q == nullptr) {
            total = a.B * a.Hq * fa3_m_tiles(a, 0);
            return;
        }
        int sum = 0;
        for (int b = threadIdx.x % 32; b < a.B; b += 32) sum += a.Hq * fa3_m_tiles(a, b);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        total = sum;
    }

    // Sequence of tile t (< total) and the tile's rank inside it.
    __device__ void find(const Fa3Args& a, int t, int& b, int& r) {
        if (a.cu_q == nullptr) {
            const int per = a.Hq * fa3_m_tiles(a, 0);
            b = t / per;
            r = t - b * per;
            return;
        }
        const int lane = threadIdx.x % 32;
        for (;;) {
            const int sb = seq0 + lane;
            const int n = sb < a.B ? a.Hq * fa3_m_tiles(a, sb) : 0;
            int incl = n;                                  // inclusive prefix over the window
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            const int window = __shfl_sync(0xffffffffu, incl, 31);
            if (t < base + window) {                       // in this window: the lane whose range holds t
                const int hit = fa3_warp_max(t >= base + incl - n && t < base + incl ? lane : -1);
                b = seq0 + hit;
                r = t - base - (__shfl_sync(0xffffffffu, incl - n, hit));
                return;
            }
            base += window;                                // t < total: a later window holds it
            seq0 += 32;
        }
    }

    template <int BLOCK_N>
    __device__ Fa3Work work(const Fa3Args& a, int t);
};

// Tile t -> its sequence, head, query tile and key range. All arithmetic on positions that a
// window can push past int32 is done in 64 bits (scheduler warp only).
template <int SCHED>
template <int BLOCK_N>
__device__ Fa3Work Fa3Sched<SCHED>::work(const Fa3Args& a, int t) {
    Fa3Work w;
    if (t >= total) {
        w.b = -1;
        return w;
    }
    int b, r;
    find(a, t, b, r);
    w.b = b;
    // the sequence, clamped to the arrays' extents
    w.q0 = 0;
    w.sq = a.Sq;
    if (a.cu_q) {
        int end;
        fa3_rows(a.cu_q, b, a.Sq, w.q0, end);
        w.sq = end - w.q0;
    }
    w.k0 = 0;
    if (a.cu_k) {
        int end;
        fa3_rows(a.cu_k, b, a.Sk, w.k0, end);
        w.sk = end - w.k0;
    } else if (a.table) {
        w.sk = fa3_clamp(a.kv_lens[b], 0, a.bt_stride << a.log2_page);  // never past the table's row
    } else {
        w.sk = a.Sk;
    }
    w.k_end = a.table == nullptr && a.kv_lens ? fa3_clamp(a.kv_lens[b], 0, w.sk) : w.sk;
    // head and query tile: sections of heads, ranks across a section's heads, heaviest first
    const int nm = fa3_ceil_div(w.sq, FA3_BLOCK_M), sec = a.heads_per_section;
    const int s = r / (sec * nm), h0 = s * sec, len = min(sec, a.Hq - h0);
    const int in_sec = r - s * sec * nm, rank = in_sec / len;
    w.h = h0 + in_sec % len;
    w.m0 = (a.win_right >= 0 ? nm - 1 - rank : rank) * FA3_BLOCK_M;
    // keys: row i sees [i + diag - left, i + diag + right] within [0, k_end)
    const long long diag = (long long)w.sk - w.sq, first = w.m0 + diag, last = min(w.m0 + FA3_BLOCK_M, w.sq) - 1 + diag;
    const long long hi = a.win_right < 0 ? w.k_end : min((long long)w.k_end, last + a.win_right + 1);
    const long long lo = a.win_left < 0 ? 0 : max(first - a.win_left, 0ll) / BLOCK_N * BLOCK_N;
    w.n_lo = (int)min(lo, max(hi, 0ll));
    w.n_tiles = hi > w.n_lo ? fa3_ceil_div((int)hi - w.n_lo, BLOCK_N) : 0;
    if (a.all_masked) {
        w.j_left = w.j_right = w.n_tiles;
    } else {
        // left: tiles starting below the last row's first key; right: tiles past the first row's
        // last key or the key end. [j_left, j_right) is seen whole by every row: no masking there.
        const long long lo_last = a.win_left < 0 ? 0 : last - a.win_left;
        w.j_left = (int)min(max((lo_last - w.n_lo + BLOCK_N - 1) / BLOCK_N, 0ll), (long long)w.n_tiles);
        const long long hi_first = a.win_right < 0 ? w.k_end : first + a.win_right + 1;
        const long long free_end = min(hi_first, (long long)w.k_end) - BLOCK_N;  // last start needing no mask
        const long long c = free_end < w.n_lo ? 0 : (free_end - w.n_lo) / BLOCK_N + 1;
        w.j_right = (int)max((long long)w.j_left, min(c, (long long)w.n_tiles));
    }
    // V rows past k_end that TMA does not zero-fill (map extent: Sk dense, total_k packed)
    const bool zero_fill = a.table == nullptr && (a.cu_k ? w.k0 + w.k_end >= a.Sk : w.k_end >= a.Sk);
    w.v_zero_from = zero_fill ? 0x7fffffff : w.k_end;
    return w;
}

// --- scheduler: warp 1 of the producer warpgroup --------------------------------------------------
// Publishes tile after tile in the work ring, then the end (b < 0). A slot is free once the loader
// and the consumers are done with the tile two back; only then is the next tile claimed, so a
// block holds the tile it computes and the one it loads next (the loader prefetches it while the
// consumers finish this one), never more: the counter's tiles go, longest first, to whichever
// block frees a slot first.
template <int SCHED, int BLOCK_N>
__device__ __forceinline__ void fa3_schedule(StageRing<2>& wring, Fa3Work* slots, const Fa3Args& a, unsigned* counter) {
    Fa3Sched<SCHED> sched;
    sched.init(a, counter);
    int t = sched.get_initial_work();
    for (bool first = true;; first = false) {
        wring.acquire();                                  // the loader and both consumer warpgroups are done with it
        if (!first) t = sched.get_next_work(t);
        const Fa3Work w = sched.template work<BLOCK_N>(a, t);
        if (threadIdx.x % 32 == 0) {
            slots[wring.stage] = w;
            mbar_arrive(wring.full_bar());                // release: the stores above come with it
        }
        wring.advance();
        if (w.b < 0) return;
    }
}
