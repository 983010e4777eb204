// emu_ptx_sm90.h: the functions of kernels_cu/ptx_sm90.cuh for the CPU emulator, written from the
// PTX ISA's definitions (sections named beside each), never from the kernels' helpers. fakecupy
// swaps the inlined ptx_sm90.cuh for this file. What it models and checks:
//   - mbarrier: count, pending arrivals, tx-count and phase (9.7.13.15); a try_wait that cannot
//     succeed parks the thread, and a kernel that would hang on a GPU ends with a deadlock report
//     naming the barrier and its state; more arrivals than the count in one phase, a barrier used
//     before mbarrier.init or overwritten by a store, a phase completed by other threads than the
//     phase before it or left part-arrived at the block's end (a count its threads do not match),
//     are errors;
//   - TMA loads (cp.async.bulk.tensor, 9.7.9.25.5): an innermost start coordinate off a 16-byte
//     boundary is an error (measured on the H100: emu_tma_check_coords); the box is read with out-of-bounds elements
//     zero-filled and written in the map's swizzle; the copy lands, with its complete_tx, at a
//     moment the seeded schedule picks (emu_async_due: at issue, at a later scheduling point, or
//     at the latest, when a thread polls the barrier's phase; emu_sm90_complete_tma is the one
//     place that delivers), the destination poisoned (0xFF: NaN) or keeping its old bytes until
//     then; TMA stores land at the bulk wait_group that retires their group, and one never
//     waited for is an error at the end of the block;
//   - wgmma (9.7.15): warpgroup-collective (the 128 threads meet; descriptors, scale-d and shape
//     must agree), the descriptor and swizzle decoded from the ISA's layouts, shared memory read
//     at a moment the schedule picks between issue and the wait (emu_wgmma_compute), the
//     accumulators poisoned (NaN) from issue until the wgmma.wait_group that retires the op
//     (writing them meanwhile is an error; emu_wgmma_complete delivers), ops chained on the same
//     accumulators in issue order;
//   - stmatrix (9.7.14.5.16) as the inverse of ldmatrix; setmaxnreg and the wgmma fences are no-ops;
//   - the async proxy's view of shared memory: a wgmma or TMA store reading what the generic proxy
//     stored with no fence.proxy.async between, or through a fence not ordered before the read
//     (happens-before inside the block: EmuKnow, emu_runtime.h), is an error, as is a TMA load into
//     shared memory an unretired wgmma reads, or completing on an mbarrier whose init was not
//     fenced; a plain mbarrier arrival makes its thread lag (emu_lag), a lone producer's excepted.
// Tensor maps are this emulator's own 128-byte format (EmuTmaDesc), encoded by fakecupy's
// encode_tensor_map_tiled, which applies the driver's documented checks.
#pragma once
#include "emu_ptx.h"
#include <deque>
#include <iterator>
#include <map>
#include <unordered_map>

struct alignas(64) TmaMap { unsigned long long opaque[16]; };

// --- this emulator's tensor map (little-endian; fakecupy.encode_tensor_map_tiled writes it) ----
struct EmuTmaDesc {
    uint32_t magic;           // EMU_TMA_MAGIC
    uint8_t rank, esize, swizzle, oob_nan, interleave;  // swizzle in bytes / 16: 0, 2, 4, 8
    uint8_t pad_[7];
    uint64_t base;            // global address (16-byte aligned)
    uint64_t dims[5];         // elements per dimension, innermost first
    uint64_t strides[4];      // bytes between consecutive indices of dims 1..rank-1
    uint16_t box[5];
    uint8_t estride[5];
};
static_assert(sizeof(EmuTmaDesc) <= sizeof(TmaMap), "EmuTmaDesc must fit a CUtensorMap");
constexpr uint32_t EMU_TMA_MAGIC = 0x4D544D45u;  // "EMTM"
constexpr uint32_t EMU_ACC_POISON = 0x7FBADBADu; // a NaN: an accumulator while its wgmma is in flight

// --- the swizzle (PTX ISA 9.7.15.5.1.2; the same pattern TMA writes) ---------------------------
// W-byte swizzle, W = 32, 64, 128: address bits [4, 4+b) XOR bits [7, 7+b), b = log2(W / 16).
inline unsigned emu_swizzle(unsigned addr, unsigned width_bytes) {
    if (width_bytes <= 16) return addr;
    const unsigned mask = width_bytes / 16 - 1;
    return addr ^ (((addr >> 7) & mask) << 4);
}

inline std::string emu_hex(unsigned v) {
    char b[16];
    std::snprintf(b, sizeof b, "0x%x", v);
    return b;
}

// --- per-block state ----------------------------------------------------------------------------
struct EmuMbar {
    unsigned count = 0, pending = 0, phase = 0;
    long long tx = 0;
    bool async_ok = false;  // its init made visible to the async proxy (fence.mbarrier_init / fence.proxy.async)
    std::vector<uint16_t> arrived, last;  // who arrived in this phase; who completed the last one (sorted)
    bool completed = false; // a phase has completed since its init
    EmuKnow kn, done;       // what this phase's arrivals released; what the completed phases did (EmuKnow)
};
struct EmuTmaLoad { EmuTmaDesc map; int c[5]; unsigned dst, bar, bytes; unsigned long long due; };
struct EmuTmaStore { EmuTmaDesc map; int c[5]; unsigned src; int group; EmuKnow kn; };  // kn: its issuer's, at issue
struct EmuWgOp {                // one wgmma.mma_async of a warpgroup
    EmuKnow kn;                 // what its 128 threads knew at issue: the async reads are ordered after it
    bool rs, bf16;
    int n, trans_a, trans_b, scale_d, group = -1;  // group -1: not committed yet
    bool computed = false;      // shared memory read and the chain advanced (emu_wgmma_compute)
    unsigned long long due = EMU_NEVER;  // when it reads shared memory (emu_async_due)
    unsigned long long desc_a, desc_b;
    float* d[128];              // each thread's accumulator array (N/2 registers)
    unsigned a[128][4];         // RS: each thread's A fragment, read at issue
};
struct EmuWgSlot { const char* what; bool rs, bf16; int n, ta, tb, sd, wait_n; unsigned long long da, db;
                   float* d; unsigned a[4]; };
struct EmuWarpgroup {
    int arrived = 0;
    unsigned gen = 0;
    const char* what = nullptr;  // the collective being met
    EmuWgSlot slot[128];
    std::deque<EmuWgOp> ops;     // in issue order
    int committed = 0;
    EmuKnow kn;                  // what the threads of the collective being completed know together
    std::unordered_map<float*, std::pair<float, int>> acc;  // register -> (value in flight, ops pending on it)
};
// A generic-proxy store to a byte of dynamic shared memory (tracked: EmuHooks::smem_store) and the
// fence.proxy.async that handed it to the async proxy: 1 + the thread, and its epoch (EmuKnow). w = 0:
// the async proxy (a TMA load) wrote the byte last; f = 0: not handed over yet.
struct EmuStoreRec { uint16_t w = 0, f = 0; unsigned we = 0, fe = 0; };
struct EmuNamedBar {  // bar.sync / bar.arrive id
    int expected = 0, arrived = 0; unsigned gen = 0;
    EmuKnow kn, done;    // what this phase's arrivals released; what the completed phases did
};
struct EmuSm90 {
    int threads = 0;
    EmuNamedBar named[16];                      // named barriers 0..15 (0 is __syncthreads')
    std::map<unsigned, EmuMbar> bars;           // by shared address
    std::deque<EmuTmaLoad> loads;               // in flight, issue order
    std::vector<std::vector<EmuTmaStore>> stores;  // per thread
    std::vector<int> store_groups;              // per thread: bulk groups committed
    std::vector<EmuWarpgroup> wgs;
    std::string error;                          // found where nothing can throw (the scheduler)
    std::vector<unsigned> reading;              // per 16 bytes of dynamic smem: in-flight wgmma reads of them
    std::vector<EmuStoreRec> rec;               // per byte of dynamic smem, once a thread stored to it
    // per writer thread, the bytes it stored and no fence has handed to the async proxy yet, in
    // epoch order (a fence takes each writer's prefix it knows of); entries a later write made
    // stale are skipped then
    std::map<int, std::deque<std::pair<unsigned, unsigned>>> unpub;  // writer -> (epoch, byte)
    size_t stored = 0;                          // bytes whose last write is a tracked store (rec[b].w != 0)
    unsigned rec_lo = ~0u, rec_hi = 0;          // while stored > 0: they all lie in [rec_lo, rec_hi)
};
inline EmuSm90 emu_sm90_slots[EMU_MAX_SLOTS];  // one per block in flight
#define emu_sm90 (emu_sm90_slots[emu_slot])
[[noreturn]] inline void emu_sm90_fail(const std::string& m) { throw std::runtime_error(m); }

// --- the async proxy's view of shared memory (PTX ISA, Memory Consistency Model,
// "Proxies") -------------------------------------------------------------------------------------
// TMA and wgmma read and write shared memory through the async proxy; st.shared, stmatrix and
// cp.async through the generic proxy. A generic-proxy store is seen by the async proxy only after
// a fence.proxy.async (fence_proxy_async_shared) that follows it. Here the dynamic shared memory of
// each block has a second image, what the async proxy sees: TMA loads write both; the emulator
// knows which thread made each generic store (EmuHooks::smem_store) and when (EmuKnow), and a
// thread's fence.proxy.async copies into the async image the stores that happen before it (its
// own, and those a barrier, __syncwarp or mbarrier ordered before it), no others. An async-proxy
// read (a wgmma operand, a TMA store's source) is an error where the two images differ, or where
// the fence that handed the byte over does not happen before the read's issue.
alignas(1024) inline unsigned char emu_async_smem_buf[EMU_MAX_SLOTS][EMU_DYN_SMEM];
// The async image of [addr, addr + n) when it lies in the block's dynamic shared memory, else null.
inline unsigned char* emu_async_of(unsigned addr, unsigned n) {
    const unsigned base = smem_u32(emu_dyn_smem);
    if (addr < base || addr + n > base + emu_dyn_smem_bytes) return nullptr;
    return emu_async_smem_buf[emu_slot] + (addr - base);
}
// `known`: what the threads that issued the read knew at its issue, as a table by thread of the
// epochs covered (emu_known_table), or null while no tracked store is in shared memory.
inline std::vector<unsigned> emu_known_table(const EmuKnow& kn) {
    std::vector<unsigned> t(emu_sm90.threads, 0u);
    if (kn.p)
        for (const auto& [src, e] : *kn.p)
            if (src < t.size()) t[src] = e;
    return t;
}
inline void emu_async_check_slow(unsigned addr, unsigned n, const char* reader, const unsigned* known);
inline void emu_async_check(unsigned addr, unsigned n, const char* reader, const unsigned* known) {
    const unsigned char* a = emu_async_of(addr, n);
    if (!a) return;
    bool suspect = std::memcmp(a, emu_shared_ptr(addr), n) != 0;
    const unsigned off = addr - smem_u32(emu_dyn_smem);
    if (known && !suspect && off + n > emu_sm90.rec_lo && off < emu_sm90.rec_hi) {
        const EmuStoreRec* r = emu_sm90.rec.data() + off;
        for (unsigned b = 0; b < n; ++b) suspect |= r[b].f != 0;
    }
    if (suspect) emu_async_check_slow(addr, n, reader, known);
}
__attribute__((noinline)) inline void emu_async_check_slow(unsigned addr, unsigned n, const char* reader,
                                                         const unsigned* known) {
    const unsigned char* a = emu_async_of(addr, n);
    if (!emu_sm90.error.empty()) return;
    if (std::memcmp(a, emu_shared_ptr(addr), n)) {
        emu_sm90.error = std::string(reader) + " reads shared memory at " + emu_hex(addr) + " that the generic proxy "
                         "(st.shared, stmatrix) wrote with no fence.proxy.async (fence_proxy_async_shared) between the "
                         "store and the read (by the storing thread, or by one the store is ordered before), or "
                         "while the read was in flight";
        return;
    }
    const unsigned off = addr - smem_u32(emu_dyn_smem);
    for (unsigned b = off; b < off + n; ++b) {
        const EmuStoreRec& r = emu_sm90.rec[b];
        if (!r.f || known[r.f - 1u] > r.fe) continue;
        emu_sm90.error = std::string(reader) + " reads shared memory at " + emu_hex(addr) + " (byte " +
                         std::to_string(b) + " of dynamic shared memory) that thread " + std::to_string(r.w - 1) +
                         " stored and thread " + std::to_string(r.f - 1) + "'s fence.proxy.async handed to the async "
                         "proxy, but nothing orders that fence before the read's issue: no __syncwarp, barrier or "
                         "mbarrier arrive / wait between the fencing thread and the issuing threads (PTX ISA, Memory "
                         "Consistency Model: causality order, proxies)";
        return;
    }
}
// A TMA load may write its box at any moment from its issue on: none of it may be shared memory
// that a wgmma still in flight reads (wgmma_reads counts them per 16 bytes from issue to the
// wgmma.wait_group that retires it). With the lag after each mbarrier arrival, a stage released
// before its wgmma retired is refilled while the wgmma is in flight, and this fails every run.
inline void emu_wg_check_unread(unsigned addr, unsigned n) {
    const unsigned base = smem_u32(emu_dyn_smem);
    if (emu_sm90.reading.empty() || !n || addr < base || addr + n > base + EMU_DYN_SMEM) return;
    for (unsigned c = (addr - base) / 16; c <= (addr + n - 1 - base) / 16; ++c)
        if (emu_sm90.reading[c])
            emu_sm90_fail("cp.async.bulk.tensor (load): writes shared memory at " + emu_hex(base + 16 * c) + " that a "
                          "wgmma.mma_async in flight still reads (not retired by wgmma.wait_group yet): the stage was "
                          "released to the producer before the wgmma reading it retired");
}

inline int emu_tid() { return emu_s->cur; }

// Thread t's generic stores to bytes [off, off + n) of the dynamic shared memory (EmuHooks::smem_store),
// unpublished to the async proxy until a fence that follows them (fence_proxy_async_shared).
inline void emu_sm90_smem_store(size_t off, size_t n, int t) {
    EmuSm90& H = emu_sm90;
    if (H.rec.size() < emu_dyn_smem_bytes) H.rec.resize(emu_dyn_smem_bytes);
    emu_hb_source(*emu_s, t);
    const unsigned e = emu_s->f[t].epoch;
    auto& mine = H.unpub[t];
    H.rec_lo = std::min(H.rec_lo, (unsigned)off);
    H.rec_hi = std::max(H.rec_hi, (unsigned)std::min(off + n, H.rec.size()));
    for (size_t b = off; b < off + n && b < H.rec.size(); ++b) {
        EmuStoreRec& r = H.rec[b];
        H.stored += !r.w;
        if (r.w != t + 1 || r.f || r.we != e) mine.push_back({e, (unsigned)b});  // else listed already
        r = {(uint16_t)(t + 1), 0, e, 0};
    }
}
// The async proxy (a TMA load) wrote [addr, addr + n) of the dynamic shared memory: no generic store
// is there any more, and the shadow of the tracked buffer follows (emu_runtime.cpp).
unsigned char* emu_smem_shadow(unsigned addr, unsigned n);
inline void emu_sm90_async_wrote(unsigned addr, unsigned n) {
    if (unsigned char* sh = emu_smem_shadow(addr, n)) std::memcpy(sh, emu_shared_ptr(addr), n);
    EmuSm90& H = emu_sm90;
    const unsigned off = addr - smem_u32(emu_dyn_smem);
    if (!H.stored || off + n <= H.rec_lo || off >= H.rec_hi) return;
    for (unsigned b = std::max(off, H.rec_lo); b < std::min(off + n, H.rec_hi); ++b) {
        H.stored -= H.rec[b].w != 0;
        H.rec[b] = EmuStoreRec();
    }
    if (!H.stored) {  // no tracked store left: nothing to order until the next (EmuKnow)
        H.unpub.clear();
        H.rec_lo = ~0u;
        H.rec_hi = 0;
        emu_hb_forget(*emu_s);
    }
}

#include "emu_sm90_barriers.h"  // mbarriers (with their arrival accounting), named barriers

// --- TMA (cp.async.bulk.tensor, PTX ISA 9.7.9.25.5) ---------------------------------------------
inline EmuTmaDesc emu_tma_desc(const TmaMap* map, int rank, const char* what) {
    EmuTmaDesc t;
    std::memcpy(&t, map, sizeof t);
    if (t.magic != EMU_TMA_MAGIC)
        emu_sm90_fail(std::string(what) + ": the tensor map is not one fakecupy encoded");
    if (t.rank != rank)
        emu_sm90_fail(std::string(what) + ": a " + std::to_string(rank) + "-d copy with a tensor map of rank " +
                      std::to_string(t.rank));
    if (t.oob_nan || t.interleave) emu_sm90_fail(std::string(what) + ": NaN fill and interleave are not emulated");
    if (t.swizzle && t.box[0] * t.esize != t.swizzle * 16u)
        emu_sm90_fail(std::string(what) + ": a swizzled box whose inner dimension is not one swizzle span is "
                      "not emulated");
    return t;
}
// The box's innermost start coordinate must lie on a 16-byte boundary of the row. Measured on the
// H100 (2026-11-26, benchmarks/results/2026-11-26-h100/README.md): copies at x = 50 and 60 fp16
// elements (100, 120 bytes) stopped the kernel with an illegal instruction, in 2-d and 4-d maps,
// loads and stores, 32- and 128-byte swizzles, with the rows' extent a multiple of 16 bytes or not;
// each of those boxes also ran past the row's end (an unaligned box inside the row was not tried); the
// same maps at x = 0, and the GEMM's boxes at multiples of 64 elements past a row's end, copied correctly.
// cuTensorMapEncodeTiled cannot see it (the coordinates come at copy time), so neither can tma.py.
inline void emu_tma_check_coords(const EmuTmaDesc& t, const int* c, const char* what) {
    if (((long long)c[0] * t.esize) % 16 != 0)
        emu_sm90_fail(std::string(what) + ": innermost coordinate " + std::to_string(c[0]) + " is " +
                      std::to_string(((long long)c[0] * t.esize) % 16) + " bytes past a 16-byte boundary "
                      "(an illegal instruction on the H100)");
}
// Box elements in order (dimension 0 fastest); f(shared byte offset in the box, global address or
// nullptr when out of bounds). elementStrides: dimension d advances estride[d] elements per step
// (dimension 0 ignores it, as TMA does without interleave). A store (`store`) bounds the innermost
// dimension at its extent rounded up to 16 bytes: measured on the H100 (2026-11-26, second run), a
// box over rows of 100 fp16 elements (200 bytes, pitch 104) also wrote elements 100..103 of each
// row it covered; loads zero-fill from the extent itself (the same cases' load tests passed).
template <typename F>
inline void emu_tma_box(const EmuTmaDesc& t, const int* c, F f, bool store = false) {
    const long long dim0 = store ? ((long long)t.dims[0] * t.esize + 15) / 16 * 16 / t.esize : (long long)t.dims[0];
    long long n[5] = {1, 1, 1, 1, 1};
    for (int d = 0; d < t.rank; ++d) n[d] = d == 0 ? t.box[0] : (t.box[d] + t.estride[d] - 1) / t.estride[d];
    long long off = 0;
    for (long long i4 = 0; i4 < n[4]; ++i4)
    for (long long i3 = 0; i3 < n[3]; ++i3)
    for (long long i2 = 0; i2 < n[2]; ++i2)
    for (long long i1 = 0; i1 < n[1]; ++i1)
    for (long long i0 = 0; i0 < n[0]; ++i0, off += t.esize) {
        const long long idx[5] = {i0, i1, i2, i3, i4};
        bool in = true;
        unsigned long long g = t.base;
        for (int d = 0; d < t.rank; ++d) {
            const long long x = (long long)c[d] + idx[d] * (d == 0 ? 1 : t.estride[d]);
            if (x < 0 || x >= (d == 0 ? dim0 : (long long)t.dims[d])) in = false;
            else g += d == 0 ? (unsigned long long)x * t.esize : (unsigned long long)x * t.strides[d - 1];
        }
        f(off, in ? reinterpret_cast<unsigned char*>(g) : nullptr);
    }
}
inline unsigned emu_tma_bytes(const EmuTmaDesc& t) {
    unsigned b = t.esize;
    for (int d = 0; d < t.rank; ++d) b *= d == 0 ? t.box[0] : (t.box[d] + t.estride[d] - 1) / t.estride[d];
    return b;
}
// The one place a TMA load lands: write the box (swizzled) and complete_tx its bytes.
inline void emu_sm90_complete_tma(const EmuTmaLoad& op) {
    emu_tma_box(op.map, op.c, [&](long long off, const unsigned char* g) {
        const unsigned at = emu_swizzle(op.dst + (unsigned)off, op.map.swizzle * 16u);
        unsigned char* s = emu_shared_ptr(at);
        if (g) std::memcpy(s, g, op.map.esize);
        else std::memset(s, 0, op.map.esize);
        if (unsigned char* a = emu_async_of(at, op.map.esize)) std::memcpy(a, s, op.map.esize);
    });
    emu_sm90_async_wrote(op.dst, op.bytes);  // the box's bytes (the swizzle permutes 16-byte chunks inside them)
    emu_mbar_complete_tx(op.bar, op.bytes);
}

template <int R>
inline void tma_load(void* dst, const TmaMap* map, unsigned long long* bar, const int (&c)[R]) {
    static_assert(R >= 2 && R <= 5, "tma_load: 2 to 5 dimensions");
    EmuTmaLoad op;
    op.map = emu_tma_desc(map, R, "cp.async.bulk.tensor (load)");
    op.dst = smem_u32(dst);
    op.bar = smem_u32(bar);
    if (op.dst % 128) emu_sm90_fail("cp.async.bulk.tensor: shared destination " + emu_hex(op.dst) +
                                    " is not 128-byte aligned");
    emu_mbar(op.bar);
    for (int d = 0; d < 5; ++d) op.c[d] = d < R ? c[d] : 0;
    emu_tma_check_coords(op.map, op.c, "cp.async.bulk.tensor (load)");
    op.bytes = emu_tma_bytes(op.map);
    if (!emu_mbar(op.bar).async_ok)
        emu_sm90_fail("cp.async.bulk.tensor: completes on the mbarrier at shared " + emu_hex(op.bar) + ", whose "
                      "mbarrier.init no fence.mbarrier_init (mbar_fence_init) or fence.proxy.async has made "
                      "visible to the async proxy");
    emu_wg_check_unread(op.dst, op.bytes);
    op.due = emu_async_due();
    if (op.due == 0) {  // lands at issue
        emu_sm90_complete_tma(op);
        return;
    }
    if (emu_pick(2)) {  // in flight: poison, or the old bytes
        std::memset(emu_shared_ptr(op.dst), 0xFF, op.bytes);
        if (unsigned char* a = emu_async_of(op.dst, op.bytes)) std::memset(a, 0xFF, op.bytes);
        emu_sm90_async_wrote(op.dst, op.bytes);
    }
    emu_sm90.loads.push_back(op);
}

template <int R>
inline void tma_store(const TmaMap* map, const void* src, const int (&c)[R]) {
    static_assert(R >= 2 && R <= 5, "tma_store: 2 to 5 dimensions");
    EmuTmaStore op;
    op.map = emu_tma_desc(map, R, "cp.async.bulk.tensor (store)");
    op.src = smem_u32(src);
    if (op.src % 128) emu_sm90_fail("cp.async.bulk.tensor: shared source " + emu_hex(op.src) + " is not 128-byte aligned");
    for (int d = 0; d < 5; ++d) op.c[d] = d < R ? c[d] : 0;
    emu_tma_check_coords(op.map, op.c, "cp.async.bulk.tensor (store)");
    op.group = emu_sm90.store_groups[emu_tid()];
    emu_hb_flush();
    if (emu_s->sources) op.kn = emu_hb_snapshot(*emu_s, emu_tid());
    emu_sm90.stores[emu_tid()].push_back(op);
}
inline void bulk_commit_group() { ++emu_sm90.store_groups[emu_tid()]; }
// Stores of every committed group but the N most recent land (read shared, write global).
inline void emu_bulk_wait(int n) {
    std::vector<EmuTmaStore>& mine = emu_sm90.stores[emu_tid()];
    const int done_below = emu_sm90.store_groups[emu_tid()] - n;
    std::vector<EmuTmaStore> keep;
    for (const EmuTmaStore& op : mine) {
        if (op.group >= done_below) {
            keep.push_back(op);
            continue;
        }
        const std::vector<unsigned> table = emu_sm90.stored ? emu_known_table(op.kn) : std::vector<unsigned>();
        const unsigned* known = table.empty() ? nullptr : table.data();
        emu_tma_box(op.map, op.c, [&](long long off, unsigned char* g) {  // the source through the async proxy
            const unsigned at = emu_swizzle(op.src + (unsigned)off, op.map.swizzle * 16u);
            emu_async_check(at, op.map.esize, "cp.async.bulk.tensor (store)", known);
            const unsigned char* a = emu_async_of(at, op.map.esize);
            if (g) std::memcpy(g, a ? a : emu_shared_ptr(at), op.map.esize);
        }, /*store=*/true);
        if (!emu_sm90.error.empty()) emu_sm90_fail(emu_sm90.error);
    }
    mine.swap(keep);
}
template <int N> inline void bulk_wait_group_read() { emu_bulk_wait(N); }
template <int N> inline void bulk_wait_group() { emu_bulk_wait(N); }
// fence.proxy.async.shared::cta: the generic-proxy stores that happen before it (the thread's own,
// and those ordered before it by a barrier, __syncwarp or mbarrier: EmuKnow) become the async proxy's
// view; other threads' stores stay unseen by it until a fence of theirs (or one they are ordered
// before) follows them. (An mbarrier's init, too.) The thread steps aside first (emu_interleave).
inline void fence_proxy_async_shared() {
    emu_interleave();
    emu_hb_flush();
    EmuSm90& H = emu_sm90;
    EmuSched& S = *emu_s;
    const int t = S.cur;
    if (!H.unpub.empty()) {
        emu_hb_source(S, t);
        const unsigned e = S.f[t].epoch;
        unsigned char* a = emu_async_smem_buf[emu_slot];
        for (auto it = H.unpub.begin(); it != H.unpub.end();) {
            const int w = it->first;
            auto& q = it->second;
            while (!q.empty() && emu_hb_knows(S, t, (unsigned)w, q.front().first)) {
                const auto [we, b] = q.front();
                q.pop_front();
                EmuStoreRec& r = H.rec[b];
                if (r.w != w + 1 || r.we != we || r.f) continue;  // rewritten since, or handed over already
                a[b] = emu_dyn_smem[b];
                r.f = (uint16_t)(t + 1);
                r.fe = e;
            }
            it = q.empty() ? H.unpub.erase(it) : std::next(it);
        }
    }
    for (auto& kv : emu_sm90.bars) kv.second.async_ok = true;
}

// --- warpgroup collectives ----------------------------------------------------------------------
// The 128 threads of a warpgroup meet: each fills its slot, the last to arrive runs `last` for all
// of them (slots of every thread are visible), the others wait until it has.
struct EmuWgWait : EmuWaitable {
    EmuWarpgroup* w;
    unsigned gen;
    int index;
    EmuWgWait(EmuWarpgroup* wg, int i) : w(wg), gen(wg->gen), index(i) {}
    bool ready() override { return w->gen != gen; }
    std::string what() const override {
        return "warpgroup " + std::to_string(index) + " meets at " + (w->what ? w->what : "?") + " with " +
               std::to_string(w->arrived) + " of 128 threads";
    }
};
// The collective synchronises its 128 threads (EmuKnow): w.kn, while `last` runs, is what they know
// together.
template <typename Last>
inline void emu_wg_collective(const EmuWgSlot& mine, Last last) {
    emu_hb_flush();
    if (emu_sm90.threads % 128)
        emu_sm90_fail(std::string(mine.what) + ": the block's " + std::to_string(emu_sm90.threads) +
                      " threads are not whole warpgroups of 128");
    const int wg = emu_tid() / 128;
    EmuWarpgroup& w = emu_sm90.wgs[wg];
    if (w.arrived == 0) w.what = mine.what;
    else if (std::strcmp(w.what, mine.what) != 0)
        emu_sm90_fail(std::string("warpgroup threads diverge: ") + mine.what + " while others are at " + w.what);
    w.slot[emu_tid() % 128] = mine;
    if (++w.arrived < 128) {
        EmuWgWait wait(&w, wg);
        emu_wait_until(wait);
        if (!emu_sm90.error.empty()) emu_sm90_fail(emu_sm90.error);
        return;
    }
    w.arrived = 0;
    w.kn.clear();
    if (emu_s->sources) {
        w.kn = emu_s->floor;
        w.kn.join(emu_hb_meet(*emu_s, 128 * wg, 128 * wg + 128));
    }
    std::string err;
    try {
        last(w);
    } catch (const std::exception& e) {
        err = e.what();
    }
    ++w.gen;
    if (!err.empty()) {
        emu_sm90.error = err;
        emu_sm90_fail(err);
    }
}

// --- wgmma (PTX ISA 9.7.15) ----------------------------------------------------------------------
// Shared address of element (mn, k) of a 16-bit operand (9.7.15.5.1.2): the descriptor's start,
// LBO and SBO (9.7.15.5.1.2.2), then the swizzle. K-major: 8-row atoms of W-byte rows along MN
// (SBO between atoms), K inside a row (LBO between W-byte column blocks: used without swizzle
// only). MN-major swizzled: 8-row atoms of W bytes of MN per K row, SBO between groups of 8 K,
// LBO between W-byte MN blocks; MN-major without swizzle: 16-byte MN chunks SBO apart, 8 K rows
// of 16 bytes, groups of 8 K LBO apart.
// The start field holds bits 4-17 of a shared address: a GPU's shared window is under 256 KB. Here
// shared addresses are offsets in this library's .bss, so the field is resolved inside the dynamic
// shared memory buffer (under 256 KB: one match); operands elsewhere are refused.
inline unsigned emu_desc_start(unsigned long long desc) {
    const unsigned lo = (unsigned)(desc & 0x3FFF) << 4, dyn = smem_u32(emu_dyn_smem);
    unsigned a = (dyn & ~0x3FFFFu) | lo;
    if (a < dyn) a += 0x40000u;
    if (a >= dyn + EMU_DYN_SMEM)
        emu_sm90_fail("wgmma: a descriptor's start address is outside dynamic shared memory (the "
                      "emulator resolves the 18-bit start field there only)");
    return a;
}
inline unsigned emu_wg_addr(unsigned long long desc, bool mn_major, int mn, int k) {
    const unsigned start = emu_desc_start(desc);
    const unsigned lbo = (unsigned)((desc >> 16) & 0x3FFF) << 4, sbo = (unsigned)((desc >> 32) & 0x3FFF) << 4;
    const unsigned mode = (unsigned)(desc >> 62), w = mode == 0 ? 16 : mode == 1 ? 128 : mode == 2 ? 64 : 32;
    if ((desc >> 49) & 7) emu_sm90_fail("wgmma: a descriptor base offset other than 0 is not emulated");
    unsigned a;
    if (!mn_major) {
        const unsigned kb = 2u * k;
        a = start + (mn % 8) * w + (mn / 8) * sbo + (kb / w) * lbo + kb % w;
    } else if (mode == 0) {
        const unsigned mb = 2u * mn;
        a = start + (k % 8) * 16 + (k / 8) * lbo + (mb / 16) * sbo + mb % 16;
    } else {
        const unsigned mb = 2u * mn;
        a = start + (k % 8) * w + (k / 8) * sbo + (mb / w) * lbo + mb % w;
    }
    return emu_swizzle(a, mode == 0 ? 16 : w);
}
// Every shared-memory element op reads (A unless it comes from registers, and B), counted in or
// out (delta) of the in-flight reads of its 16 bytes.
inline void emu_wg_reads(const EmuWgOp& op, int delta) {
    const unsigned base = smem_u32(emu_dyn_smem);
    if (emu_sm90.reading.empty()) emu_sm90.reading.assign(EMU_DYN_SMEM / 16, 0u);
    for (int k = 0; k < 16; ++k) {
        for (int r = 0; r < 64 && !op.rs; ++r) emu_sm90.reading[(emu_wg_addr(op.desc_a, op.trans_a, r, k) - base) / 16] += delta;
        for (int c = 0; c < op.n; ++c) emu_sm90.reading[(emu_wg_addr(op.desc_b, op.trans_b, c, k) - base) / 16] += delta;
    }
}
inline float emu_b16v(unsigned bits, bool bf16) {
    return bf16 ? emu_b16(bits, __nv_bfloat16()) : emu_b16(bits, __half());
}
inline float emu_wg_elem(unsigned addr, bool bf16, const unsigned* known) {
    emu_async_check(addr, 2, "wgmma.mma_async", known);
    uint16_t bits;
    std::memcpy(&bits, emu_shared_ptr(addr), 2);
    return emu_b16v(bits, bf16);
}

// The one place a wgmma reads its operands: D = A B (+ D), chained through `acc` in issue order (the
// ops before it compute first). It runs at a moment the schedule picks between issue and the wait.
// Register d[4j + i] of thread (warp w, lane l) is row 16w + l/4 + 8 (i/2), column 8j + 2(l%4) + i%2.
inline void emu_wgmma_compute(EmuWarpgroup& w, EmuWgOp& op) {
    if (op.computed) return;
    for (EmuWgOp& before : w.ops) {
        if (&before == &op) break;
        emu_wgmma_compute(w, before);
    }
    op.computed = true;
    const std::vector<unsigned> table = emu_sm90.stored ? emu_known_table(op.kn) : std::vector<unsigned>();
    const unsigned* known = table.empty() ? nullptr : table.data();
    float A[64][16], B[16][256];
    for (int r = 0; r < 64; ++r)
        for (int k = 0; k < 16; ++k) {
            if (!op.rs) {
                A[r][k] = emu_wg_elem(emu_wg_addr(op.desc_a, op.trans_a, r, k), op.bf16, known);
                continue;
            }
            // RS: thread 32 (r / 16) + 4 (r % 8) + (k % 8) / 2 holds it in a[(r % 16) / 8 + 2 (k / 8)]
            const int t = 32 * (r / 16) + 4 * (r % 8) + (k % 8) / 2, reg = (r % 16) / 8 + 2 * (k / 8);
            A[r][k] = emu_b16v((op.a[t][reg] >> (16 * (k % 2))) & 0xFFFF, op.bf16);
        }
    for (int k = 0; k < 16; ++k)
        for (int c = 0; c < op.n; ++c) B[k][c] = emu_wg_elem(emu_wg_addr(op.desc_b, op.trans_b, c, k), op.bf16, known);
    for (int t = 0; t < 128; ++t) {
        const int wp = t / 32, l = t % 32;
        for (int j = 0; j < op.n / 2; ++j) {
            const int row = 16 * wp + l / 4 + 8 * ((j % 4) / 2), col = 8 * (j / 4) + 2 * (l % 4) + j % 2;
            float* reg = op.d[t] + j;
            auto& slot = w.acc.at(reg);
            float s = op.scale_d ? slot.first : 0.0f;
            for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];  // products exact in fp32
            slot.first = s;
        }
    }
}
// The one place a wgmma lands: at the wgmma.wait_group that retires it, the registers take their
// values (poisoned from issue until now).
inline void emu_wgmma_complete(EmuWarpgroup& w, EmuWgOp& op) {
    emu_wgmma_compute(w, op);
    emu_wg_reads(op, -1);
    for (int t = 0; t < 128; ++t) {
        for (int j = 0; j < op.n / 2; ++j) {
            float* reg = op.d[t] + j;
            auto& slot = w.acc.at(reg);
            const float s = slot.first;
            if (--slot.second == 0) {
                uint32_t now;
                std::memcpy(&now, reg, 4);
                if (now != EMU_ACC_POISON && emu_sm90.error.empty())
                    emu_sm90.error = "wgmma: an accumulator register was written while its wgmma.mma_async "
                                     "was in flight (before the wgmma.wait_group that retires it)";
                *reg = s;
                w.acc.erase(reg);
            }
        }
    }
}

inline void emu_wgmma_issue(EmuWgSlot s) {
    emu_wg_collective(s, [](EmuWarpgroup& w) {
        const EmuWgSlot& s0 = w.slot[0];
        EmuWgOp op;
        op.rs = s0.rs; op.bf16 = s0.bf16; op.n = s0.n; op.trans_a = s0.ta; op.trans_b = s0.tb;
        op.scale_d = s0.sd; op.desc_a = s0.da; op.desc_b = s0.db;
        op.kn = w.kn;
        for (int t = 0; t < 128; ++t) {
            const EmuWgSlot& s = w.slot[t];
            if (s.rs != op.rs || s.bf16 != op.bf16 || s.n != op.n || s.ta != op.trans_a || s.tb != op.trans_b ||
                s.db != op.desc_b || (!op.rs && s.da != op.desc_a) || (s.sd != 0) != (op.scale_d != 0))
                emu_sm90_fail("wgmma.mma_async: the threads of a warpgroup disagree on the shape, type, "
                              "descriptors or scale-d (.aligned: all must issue the same instruction)");
            op.d[t] = s.d;
            std::memcpy(op.a[t], s.a, sizeof s.a);
        }
        for (int t = 0; t < 128; ++t)
            for (int j = 0; j < op.n / 2; ++j) {
                float* reg = op.d[t] + j;
                auto it = w.acc.find(reg);
                if (it == w.acc.end()) it = w.acc.emplace(reg, std::make_pair(*reg, 0)).first;
                ++it->second.second;
                std::memcpy(reg, &EMU_ACC_POISON, 4);
            }
        op.due = emu_async_due();
        w.ops.push_back(op);
        emu_wg_reads(w.ops.back(), +1);
        if (op.due == 0) emu_wgmma_compute(w, w.ops.back());
    });
}

template <typename T> constexpr bool emu_is_bf16() {
    static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "wgmma: f16 or bf16");
    return std::is_same_v<T, __nv_bfloat16>;
}
template <typename T, int N, int TRANS_A, int TRANS_B>
inline void wgmma_ss(float (&d)[N / 2], unsigned long long desc_a, unsigned long long desc_b, int scale_d) {
    static_assert(N == 16 || N == 32 || N == 64 || N == 128 || N == 176 || N == 256,
                  "wgmma_ss: N = 16, 32, 64, 128, 176 or 256");
    emu_wgmma_issue({"wgmma.mma_async", false, emu_is_bf16<T>(), N, TRANS_A, TRANS_B, scale_d, 0, desc_a, desc_b,
                     d, {0, 0, 0, 0}});
}
template <typename T, int N, int TRANS_B>
inline void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long desc_b, int scale_d) {
    static_assert(N == 16 || N == 32 || N == 64 || N == 128 || N == 176 || N == 256,
                  "wgmma_rs: N = 16, 32, 64, 128, 176 or 256");
    emu_wgmma_issue({"wgmma.mma_async", true, emu_is_bf16<T>(), N, 0, TRANS_B, scale_d, 0, 0, desc_b, d,
                     {a[0], a[1], a[2], a[3]}});
}
inline void keep_before(float) {}   // a scheduling constraint for ptxas: nothing to do here
inline void wgmma_fence() {}
inline void wgmma_commit_group() {
    emu_wg_collective({"wgmma.commit_group"}, [](EmuWarpgroup& w) {
        for (EmuWgOp& op : w.ops)
            if (op.group < 0) op.group = w.committed;
        ++w.committed;
    });
}
template <int N>
inline void wgmma_wait_group() {
    emu_wg_collective({"wgmma.wait_group"}, [](EmuWarpgroup& w) {
        while (!w.ops.empty() && w.ops.front().group >= 0 && w.ops.front().group < w.committed - N) {
            emu_wgmma_complete(w, w.ops.front());
            w.ops.pop_front();
        }
        if (!emu_sm90.error.empty()) emu_sm90_fail(emu_sm90.error);
    });
}
template <int R> inline void wgmma_fence_acc(float (&)[R]) {}
template <int R> inline void wgmma_fence_frag(unsigned (&)[R][4]) {}

// --- setmaxnreg, stmatrix -------------------------------------------------------------------------
template <int R> inline void setmaxnreg_inc() { static_assert(R >= 24 && R <= 256 && R % 8 == 0, "setmaxnreg"); }
template <int R> inline void setmaxnreg_dec() { static_assert(R >= 24 && R <= 256 && R % 8 == 0, "setmaxnreg"); }

// stmatrix: lanes 8i..8i+7 give the row addresses of matrix i; lane l holds (row l/4, cols
// 2(l%4), 2(l%4)+1) of matrix i in r[i], or with TRANS (rows 2(l%4), 2(l%4)+1, col l/4).
template <int NUM, bool TRANS = false>
inline void stmatrix(void* smem, const unsigned (&r)[NUM]) {
    static_assert(NUM == 1 || NUM == 2 || NUM == 4, "stmatrix stores 1, 2 or 4 matrices");
    EmuWarp& w = emu_s->warps[emu_warp];
    if (emu_lane < 8 * NUM) emu_check_align(smem, 16, "stmatrix row address");
    const unsigned b = emu_xchg_begin(w);
    const auto& x = w.xchg[b];
    w.xchg[b][emu_lane][8] = smem_u32(smem);
    emu_warp_barrier(0xffffffffu, -3, "stmatrix");
    const int g = emu_lane / 4, t = emu_lane % 4;
    for (int i = 0; i < NUM; ++i) {
        const uint16_t lo = r[i] & 0xFFFF, hi = r[i] >> 16;
        if (!TRANS) {
            unsigned char* row = emu_shared_ptr(x[8 * i + g][8]);
            std::memcpy(row + 4 * t, &lo, 2);
            std::memcpy(row + 4 * t + 2, &hi, 2);
        } else {
            std::memcpy(emu_shared_ptr(x[8 * i + 2 * t][8]) + 2 * g, &lo, 2);
            std::memcpy(emu_shared_ptr(x[8 * i + 2 * t + 1][8]) + 2 * g, &hi, 2);
        }
    }
    emu_xchg_end(w, b);
    // the warp's stores are all made before any lane goes on (stmatrix is one warp-wide store)
    emu_warp_barrier(0xffffffffu, -3, "stmatrix");
}

// --- block begin / end ----------------------------------------------------------------------------
inline void emu_sm90_block_begin(int threads) {
    emu_sm90.threads = threads;
    emu_sm90.bars.clear();
    emu_sm90.loads.clear();
    emu_sm90.stores.assign(threads, {});
    emu_sm90.store_groups.assign(threads, 0);
    emu_sm90.wgs.clear();
    emu_sm90.wgs.resize((threads + 127) / 128);
    emu_sm90.error.clear();
    for (EmuNamedBar& b : emu_sm90.named) b = EmuNamedBar();
    std::fill(emu_sm90.reading.begin(), emu_sm90.reading.end(), 0u);
    if (emu_sm90.stored) std::fill(emu_sm90.rec.begin(), emu_sm90.rec.end(), EmuStoreRec());
    emu_sm90.unpub.clear();
    emu_sm90.stored = 0;
    emu_sm90.rec_lo = ~0u;
    emu_sm90.rec_hi = 0;
    std::memset(emu_async_smem_buf[emu_slot], 0xFF, emu_dyn_smem_bytes);  // poisoned as the generic image is
}
inline std::string emu_sm90_block_end() {
    if (!emu_sm90.error.empty()) return emu_sm90.error;
    for (const auto& v : emu_sm90.stores)
        if (!v.empty()) return "cp.async.bulk.tensor store never retired by cp.async.bulk.wait_group before the block ended";
    for (size_t i = 0; i < emu_sm90.wgs.size(); ++i)
        if (!emu_sm90.wgs[i].ops.empty())
            return "warpgroup " + std::to_string(i) + " ended with a wgmma.mma_async never retired by wgmma.wait_group";
    if (!emu_sm90.loads.empty()) return "a TMA load was issued and never waited for (its mbarrier phase never polled)";
    for (auto& [addr, b] : emu_sm90.bars)  // arrivals left in a phase: a count its threads do not match
        if (!b.arrived.empty()) {
            std::sort(b.arrived.begin(), b.arrived.end());
            return emu_mbar_name(addr) + " (count " + std::to_string(b.count) + ") ended the block with " +
                   std::to_string(b.arrived.size()) + " arrival(s) in phase " + std::to_string(b.phase) + " that never "
                   "completes (thread(s) " + emu_mbar_threads(b.arrived, {}) + "): its arrival count does not match "
                   "the threads that arrive on it";
        }
    return "";
}
// After every fiber step: TMA loads and wgmma operand reads whose due tick has come happen now.
inline void emu_sm90_tick() {
    for (size_t i = 0; i < emu_sm90.loads.size();) {
        if (emu_sm90.loads[i].due <= emu_tick) {
            const EmuTmaLoad op = emu_sm90.loads[i];
            emu_sm90.loads.erase(emu_sm90.loads.begin() + (long)i);
            emu_sm90_complete_tma(op);
        } else {
            ++i;
        }
    }
    for (EmuWarpgroup& w : emu_sm90.wgs)
        for (EmuWgOp& op : w.ops)
            if (!op.computed && op.due <= emu_tick) emu_wgmma_compute(w, op);
}
static const bool emu_sm90_hooked =
    (emu_module_hooks = {emu_sm90_block_begin, emu_sm90_block_end, emu_sm90_tick, emu_sm90_smem_store}, true);
