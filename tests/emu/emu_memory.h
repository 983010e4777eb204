// emu_memory.h: global memory as blocks see it (issue 37), part of emu_runtime.h. The model, what
// it catches and what it cannot: tests/emu/README.md, "The memory model". In short, for launches
// fakecupy arms (modules that use atomics, fences, __nanosleep or the counter helpers of
// ptx_insn.cuh), and for the allocations the launch reaches through its non-const pointer
// arguments (the "regions"):
//   - each block in flight has its own view of the regions; its plain stores stay in it (a store
//     buffer) until the block releases them (PTX ISA, Memory Consistency Model, "Release and
//     Acquire Patterns": a fence.acq_rel / fence.sc, or a .release operation);
//   - a block sees another block's store only once it has acquired a release that covers it: a
//     strong read (an atomic, ld.acquire, the RMWs of a counter) observes the releases the
//     location's writes carried ("Causality order": release sequences of RMWs join), and the
//     block's next acquire (a fence, or the .acquire of the operation itself) makes them visible;
//   - until then it reads its old view, and where another block has written since (a data race:
//     undefined in CUDA C++), poison (0xFF: NaN, -1), so a missing fence or acquire fails every
//     run, whatever the schedule;
//   - atomics act on the latest value of the location (coherence order) and are relaxed unless
//     named otherwise; __ldcg (ld.global.cg) is a weak load.
// Granularity is the block: a fence by any thread releases and acquires for the whole block (the
// kernels order their threads' accesses around one thread's fence with bar.sync, which the PTX
// model makes cumulative). Fence-SC order (two fence.sc seeing each other without a flag between
// them) is not modelled: a fence acquires only releases its block observed.
#pragma once
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>
#include <unordered_map>

constexpr unsigned char EMU_GM_POISON = 0xFF;
constexpr unsigned EMU_GM_UNPUBLISHED = ~0u;
enum EmuSem { EMU_RELAXED = 0, EMU_ACQUIRE = 1, EMU_RELEASE = 2, EMU_ACQ_REL = 3 };

// Which release of each block is known here (block ids count from 1; releases from 1).
struct EmuClock {
    std::unordered_map<unsigned, unsigned> c;
    bool join(const EmuClock& o) {
        bool grew = false;
        for (const auto& [b, r] : o.c) {
            unsigned& x = c[b];
            if (r > x) { x = r; grew = true; }
        }
        return grew;
    }
    unsigned at(unsigned b) const {
        const auto it = c.find(b);
        return it == c.end() ? 0u : it->second;
    }
};
struct EmuGmRegion { unsigned char* base; size_t size, off; };  // off: its first byte's index
struct EmuGmView {                      // the block in one slot
    unsigned id = 0;                    // its index in the grid + 1; 0: the slot is empty
    unsigned rel = 0;                   // its releases so far
    EmuClock vc;                        // releases it has acquired
    EmuClock obs;                       // releases its strong reads saw, not acquired yet
    EmuClock carry;                     // what its strong writes carry: vc at its last release + that release
    std::vector<size_t> dirty;          // bytes it wrote and has not released
    std::vector<unsigned char> img;     // its view (while it runs: the view it was switched in with)
};
struct EmuGm {
    bool on = false;
    bool paged = false;                 // the regions' pages hold nothing else: stores found by mprotect
    std::vector<EmuGmRegion> regions;   // sorted by address
    size_t bytes = 0;
    std::vector<unsigned char> latest;  // each byte's last write (coherence order's end)
    std::vector<unsigned> wblk, wrel;   // who wrote it in this launch (0: nobody) and which release published it
    std::vector<size_t> written;        // the bytes written in this launch (wblk != 0), in first-write order:
    std::vector<unsigned char*> at;     // the only bytes where views differ; and their addresses
    std::vector<std::pair<size_t, size_t>> runs;  // `written` as sorted (first byte, length) runs, none across regions
    size_t runs_of = 0;                 // how many bytes of `written` the runs hold
    std::unordered_map<size_t, EmuClock> sync;  // per location of strong writes: the releases they carried
    std::vector<EmuGmView> views;       // per slot
    int cur = -1;                       // the slot whose view is in memory
    unsigned long long gen = 0;         // bumped by strong writes: wakes threads parked on global values
};
inline EmuGm emu_gm;

// --- which pages the running block wrote (TreadMarks' twins, with mprotect) -------------------------
// When the regions' pages hold nothing but the regions (fakecupy allocates device arrays on pages
// of their own), they are read-only while a block runs: its first store to one faults, the
// handler makes the page writable and notes it, and a capture compares only the noted pages
// against the block's view (its twin), then makes them all read-only again. A launch that writes
// a few rows of a large array (a KV cache) then costs what it writes, not the array's size, at
// every fence. Otherwise (arrays NumPy allocated on the heap, beside the emulator's own state) a
// capture compares the whole regions.
struct EmuGmPages {
    uintptr_t size = 4096;
    std::vector<std::pair<uintptr_t, uintptr_t>> spans;  // page-aligned [lo, hi) over the regions, merged
    uintptr_t* dirty = nullptr;         // pages written since the last capture: mmap'd, so the handler's
    size_t ndirty = 0, cap = 0;         // own stores never land on a page it watches
    struct sigaction saved;             // the SIGSEGV handler before this launch
};
inline EmuGmPages emu_gm_pages;
// read_only: only once every store noted so far is captured (the notes are dropped).
inline void emu_gm_protect(bool read_only) {
    if (!emu_gm.paged) return;
    for (const auto& [lo, hi] : emu_gm_pages.spans)
        mprotect(reinterpret_cast<void*>(lo), hi - lo, read_only ? PROT_READ : PROT_READ | PROT_WRITE);
    if (read_only) emu_gm_pages.ndirty = 0;
}
inline void emu_gm_on_fault(int, siginfo_t* si, void*) {
    EmuGmPages& p = emu_gm_pages;
    const uintptr_t a = reinterpret_cast<uintptr_t>(si->si_addr);
    for (const auto& [lo, hi] : p.spans)
        if (a >= lo && a < hi && p.ndirty < p.cap) {
            const uintptr_t page = a & ~(p.size - 1);
            mprotect(reinterpret_cast<void*>(page), p.size, PROT_READ | PROT_WRITE);
            p.dirty[p.ndirty++] = page;
            return;
        }
    sigaction(SIGSEGV, &p.saved, nullptr);  // not ours: the store faults again, under the handler before ours
}
inline void emu_gm_pages_begin() {
    EmuGmPages& p = emu_gm_pages;
    p.size = (uintptr_t)sysconf(_SC_PAGESIZE);
    p.spans.clear();
    for (const EmuGmRegion& r : emu_gm.regions) {
        const uintptr_t lo = reinterpret_cast<uintptr_t>(r.base) & ~(p.size - 1);
        const uintptr_t hi = (reinterpret_cast<uintptr_t>(r.base) + r.size + p.size - 1) & ~(p.size - 1);
        if (!p.spans.empty() && lo <= p.spans.back().second) p.spans.back().second = std::max(p.spans.back().second, hi);
        else p.spans.push_back({lo, hi});
    }
    size_t pages = 0;
    for (const auto& [lo, hi] : p.spans) pages += (hi - lo) / p.size;
    if (pages > p.cap) {
        if (p.dirty) munmap(p.dirty, p.cap * sizeof(uintptr_t));
        void* m = mmap(nullptr, pages * sizeof(uintptr_t), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) throw std::runtime_error("emulator: mmap of the memory model's page list failed");
        p.dirty = static_cast<uintptr_t*>(m);
        p.cap = pages;
    }
    p.ndirty = 0;
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = emu_gm_on_fault;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &p.saved);
    emu_gm_protect(true);
}
inline void emu_gm_pages_end() {
    emu_gm_protect(false);
    sigaction(SIGSEGV, &emu_gm_pages.saved, nullptr);
    emu_gm_pages.ndirty = 0;
}

// Byte index of [p, p + n) in the regions, or -1 when it is not inside one.
inline long emu_gm_index(const void* p, size_t n) {
    const unsigned char* a = static_cast<const unsigned char*>(p);
    for (const EmuGmRegion& r : emu_gm.regions)
        if (a >= r.base && a + n <= r.base + r.size) return (long)(r.off + (size_t)(a - r.base));
    return -1;
}
inline unsigned char* emu_gm_addr(size_t i) {
    for (const EmuGmRegion& r : emu_gm.regions)
        if (i < r.off + r.size) return r.base + (i - r.off);
    return nullptr;
}

// What block `v` may read at byte i: its own stores, bytes nobody wrote in this launch, and
// stores of releases it has acquired; poison where another block wrote and it has not.
inline unsigned char emu_gm_seen(const EmuGmView& v, size_t i) {
    const unsigned w = emu_gm.wblk[i];
    if (w == 0 || w == v.id) return emu_gm.latest[i];
    const unsigned r = emu_gm.wrel[i];
    return r != EMU_GM_UNPUBLISHED && v.vc.at(w) >= r ? emu_gm.latest[i] : EMU_GM_POISON;
}

// Slot s wrote value x at byte i (found by a capture, or an atomic): it is the latest value; other
// blocks in flight lose it from their views (they read it racily now) unless it was their own store.
inline void emu_gm_record(int s, size_t i, unsigned char x) {
    EmuGmView& me = emu_gm.views[s];
    const unsigned prev = emu_gm.wblk[i];
    const bool mine = prev == me.id && emu_gm.wrel[i] == EMU_GM_UNPUBLISHED;
    me.img[i] = x;
    emu_gm.latest[i] = x;
    if (prev == 0) {
        emu_gm.written.push_back(i);
        emu_gm.at.push_back(emu_gm_addr(i));
    }
    if (!mine) {
        me.dirty.push_back(i);
        for (size_t t = 0; t < emu_gm.views.size(); ++t) {
            EmuGmView& o = emu_gm.views[t];
            if ((int)t != s && o.id && !(prev == o.id && emu_gm.wrel[i] == EMU_GM_UNPUBLISHED)) o.img[i] = EMU_GM_POISON;
        }
    }
    emu_gm.wblk[i] = me.id;
    emu_gm.wrel[i] = EMU_GM_UNPUBLISHED;
}
// The plain stores slot s (in memory now) made to bytes [i0, i0 + n) of one region since its view
// was last compared: memory against the view, 64 bytes at a time, then bytes where they differ.
inline void emu_gm_capture_range(int s, size_t i0, size_t n) {
    EmuGmView& me = emu_gm.views[s];
    const unsigned char* m = emu_gm_addr(i0);
    const unsigned char* v = me.img.data() + i0;
    for (size_t k = 0; k < n; k += 64) {
        const size_t len = std::min<size_t>(64, n - k);
        if (!std::memcmp(m + k, v + k, len)) continue;
        for (size_t j = k; j < k + len; ++j)
            if (m[j] != v[j]) emu_gm_record(s, i0 + j, m[j]);
    }
}
// Every store of the running slot s since its last capture: on the pages it wrote, or anywhere.
inline void emu_gm_capture(int s) {
    if (s != emu_gm.cur) return;  // a slot out of memory has stored nothing since
    if (!emu_gm.paged) {
        for (const EmuGmRegion& r : emu_gm.regions)
            for (size_t k = 0; k < r.size; k += 4096) {
                const size_t n = std::min<size_t>(4096, r.size - k);
                if (std::memcmp(r.base + k, emu_gm.views[s].img.data() + r.off + k, n)) emu_gm_capture_range(s, r.off + k, n);
            }
        return;
    }
    EmuGmPages& p = emu_gm_pages;
    if (!p.ndirty) return;
    emu_gm_protect(false);  // the bookkeeping below may store to the same pages
    for (size_t k = 0; k < p.ndirty; ++k) {
        const uintptr_t lo = p.dirty[k], hi = lo + p.size;
        for (const EmuGmRegion& r : emu_gm.regions) {
            const uintptr_t b = reinterpret_cast<uintptr_t>(r.base), e = b + r.size;
            if (e > lo && b < hi) emu_gm_capture_range(s, r.off + (std::max(b, lo) - b), std::min(e, hi) - std::max(b, lo));
        }
    }
    emu_gm_protect(true);
}
// The written bytes as runs (EmuGm::runs): the bytes new since the last call are sorted and
// merged in. Kernels write rows, so there are few runs, and copying a view is a few memcpy.
inline bool emu_gm_region_start(size_t i) {
    for (const EmuGmRegion& r : emu_gm.regions)
        if (r.off == i) return true;
    return false;
}
inline const std::vector<std::pair<size_t, size_t>>& emu_gm_runs() {
    EmuGm& g = emu_gm;
    if (g.runs_of == g.written.size()) return g.runs;
    std::vector<std::pair<size_t, size_t>> all(g.runs);
    std::vector<size_t> fresh(g.written.begin() + (long)g.runs_of, g.written.end());
    std::sort(fresh.begin(), fresh.end());
    for (size_t i : fresh) all.push_back({i, 1});
    std::inplace_merge(all.begin(), all.begin() + (long)g.runs.size(), all.end());
    g.runs.clear();
    for (const auto& r : all) {  // a byte enters `written` once: the runs are disjoint
        if (!g.runs.empty() && g.runs.back().first + g.runs.back().second == r.first && !emu_gm_region_start(r.first))
            g.runs.back().second += r.second;
        else
            g.runs.push_back(r);
    }
    g.runs_of = g.written.size();
    return g.runs;
}
// Memory takes slot s's view (the previous slot's view in it all captured): views differ only at
// bytes written in this launch.
inline void emu_gm_load_view(int s) {
    emu_gm_protect(false);
    const unsigned char* v = emu_gm.views[s].img.data();
    for (const auto& [i, n] : emu_gm_runs()) std::memcpy(emu_gm_addr(i), v + i, n);
    emu_gm_protect(true);
    emu_gm.cur = s;
}
// Before a pass of the block in slot s: its view into memory (the previous block's stores captured).
inline void emu_gm_switch(int s) {
    if (!emu_gm.on || s == emu_gm.cur) return;
    if (emu_gm.cur >= 0) emu_gm_capture(emu_gm.cur);
    emu_gm_load_view(s);
}

// --- launch, block start and end -------------------------------------------------------------------
// spans: (address, bytes) pairs of the regions (fakecupy: the non-const pointer arguments' arrays);
// none: the model is off for this launch (stores visible to every block at once). paged: their
// pages hold nothing else (fakecupy's own allocations).
inline void emu_gm_begin(const unsigned long long* spans, int n, bool paged) {
    EmuGm& g = emu_gm;
    g = EmuGm();
    for (int k = 0; k < n; ++k)
        if (spans[2 * k + 1]) g.regions.push_back({reinterpret_cast<unsigned char*>(spans[2 * k]), spans[2 * k + 1], 0});
    std::sort(g.regions.begin(), g.regions.end(), [](const EmuGmRegion& a, const EmuGmRegion& b) { return a.base < b.base; });
    for (EmuGmRegion& r : g.regions) {
        r.off = g.bytes;
        g.bytes += r.size;
    }
    g.on = !g.regions.empty();
    g.paged = g.on && paged;
    g.latest.resize(g.bytes);
    for (const EmuGmRegion& r : g.regions) std::memcpy(g.latest.data() + r.off, r.base, r.size);
    g.wblk.assign(g.bytes, 0);
    g.wrel.assign(g.bytes, 0);
    if (g.paged) emu_gm_pages_begin();
}
// A block starts in slot s: it sees what was there before the launch, poison where blocks of this
// launch have written (nothing orders it after them).
inline void emu_gm_block_start(int s, unsigned long long block) {
    if (!emu_gm.on) return;
    if ((int)emu_gm.views.size() <= s) emu_gm.views.resize(s + 1);
    EmuGmView& v = emu_gm.views[s];
    v = EmuGmView();
    v.id = (unsigned)block + 1;
    v.img = emu_gm.latest;
    // it has acquired nothing: every byte a block of this launch wrote is poison to it (emu_gm_seen)
    for (const auto& [i, n] : emu_gm_runs()) std::memset(v.img.data() + i, EMU_GM_POISON, n);
    if (emu_gm.cur == s) emu_gm_load_view(s);
}
// A block ended: its stores are captured; those it never released stay unpublished (poison to
// every other block) until the launch ends.
inline void emu_gm_block_end(int s) {
    if (!emu_gm.on) return;
    emu_gm_capture(s);
    emu_gm.views[s].id = 0;
}
// The launch ended (kernel completion orders everything): every store lands.
inline void emu_gm_end() {
    if (!emu_gm.on) return;
    if (emu_gm.cur >= 0 && emu_gm.views[emu_gm.cur].id) emu_gm_capture(emu_gm.cur);
    if (emu_gm.paged) emu_gm_pages_end();
    for (const EmuGmRegion& r : emu_gm.regions) std::memcpy(r.base, emu_gm.latest.data() + r.off, r.size);
    emu_gm = EmuGm();
}

// --- release, acquire, strong operations (the running block: slot emu_gm.cur) ---------------------
inline void emu_gm_release() {
    const int s = emu_gm.cur;
    EmuGmView& me = emu_gm.views[s];
    emu_gm_capture(s);
    ++me.rel;
    for (size_t i : me.dirty)
        if (emu_gm.wblk[i] == me.id && emu_gm.wrel[i] == EMU_GM_UNPUBLISHED) emu_gm.wrel[i] = me.rel;
    me.dirty.clear();
    me.carry = me.vc;
    me.carry.c[me.id] = me.rel;
}
inline void emu_gm_acquire() {
    const int s = emu_gm.cur;
    EmuGmView& me = emu_gm.views[s];
    emu_gm_capture(s);
    const bool grew = me.vc.join(me.obs);
    me.obs.c.clear();
    if (!grew) return;  // nothing new acquired: the view already is what it may see
    emu_gm_protect(false);
    for (size_t k = 0; k < emu_gm.written.size(); ++k) {  // bytes nobody wrote are in the view as they were
        const size_t i = emu_gm.written[k];
        if (!(emu_gm.wblk[i] == me.id && emu_gm.wrel[i] == EMU_GM_UNPUBLISHED)) *emu_gm.at[k] = me.img[i] = emu_gm_seen(me, i);
    }
    emu_gm_protect(true);
}
// fence.acq_rel / fence.sc (__threadfence) at gpu scope: a release, then an acquire.
inline void emu_gm_fence() {
    if (!emu_gm.on) return;
    emu_gm_release();
    emu_gm_acquire();
}
// The byte index of a strong operation's location, or -1 (off, or shared memory: plain there).
// `global_only`: the operation names .global (the counter helpers), so an address outside the
// regions is an error, not silently unmodelled.
inline long emu_gm_strong_index(const void* p, size_t n, const char* what, bool global_only) {
    if (!emu_gm.on) return -1;
    const long i = emu_gm_index(p, n);
    if (i < 0 && global_only)
        throw std::runtime_error(std::string(what) + ": the counter is not inside an array the launch passes as a "
                                 "non-const pointer argument, the only global memory the emulator's memory model "
                                 "tracks (tests/emu/README.md)");
    if (i >= 0 && emu_gm.cur != emu_slot) throw std::runtime_error("emulator: memory model out of step with the scheduler");
    return i;
}
// A read-modify-write f(old) -> new on the latest value (coherence order), with ordering `sem`.
template <typename T, typename F>
T emu_gm_rmw(T* p, F f, int sem, const char* what, bool global_only = false) {
    const long i = emu_gm_strong_index(p, sizeof(T), what, global_only);
    if (i < 0) {  // plain: visible to every block at once
        const T old = *p, nv = f(old);
        *p = nv;
        if (std::memcmp(&old, &nv, sizeof(T))) ++emu_gm.gen;
        return old;
    }
    const int s = emu_gm.cur;
    EmuGmView& me = emu_gm.views[s];
    if (sem & EMU_RELEASE) emu_gm_release();
    emu_gm_capture_range(s, (size_t)i, sizeof(T));  // its own plain store to it comes first
    T old;
    std::memcpy(&old, emu_gm.latest.data() + i, sizeof(T));
    const T nv = f(old);
    unsigned char b[sizeof(T)];
    std::memcpy(b, &nv, sizeof(T));
    for (size_t k = 0; k < sizeof(T); ++k) emu_gm_record(s, (size_t)i + k, b[k]);
    std::memcpy(p, &nv, sizeof(T));
    EmuClock& loc = emu_gm.sync[(size_t)i];
    me.obs.join(loc);    // the read part observes the releases the chain carried so far
    loc.join(me.carry);  // the write part carries this block's last release (fence + strong write)
    if (std::memcmp(&old, &nv, sizeof(T))) ++emu_gm.gen;
    if (sem & EMU_ACQUIRE) emu_gm_acquire();
    return old;
}
// A strong load (ld.relaxed / ld.acquire) of the latest value.
template <typename T>
T emu_gm_load(const T* p, int sem, const char* what) {
    const long i = emu_gm_strong_index(p, sizeof(T), what, false);
    if (i < 0) return *p;
    emu_gm_capture_range(emu_gm.cur, (size_t)i, sizeof(T));
    T v;
    std::memcpy(&v, emu_gm.latest.data() + i, sizeof(T));
    emu_gm.views[emu_gm.cur].obs.join(emu_gm.sync[(size_t)i]);
    if (sem & EMU_ACQUIRE) emu_gm_acquire();
    return v;
}

// --- waiting on other blocks ------------------------------------------------------------------------
// A thread parked until the unsigned counter at p (latest value) reaches target, (int)(v - target)
// >= 0; other blocks run meanwhile (emu_launch starts more, up to the device's resident blocks,
// when every block in flight waits so).
struct EmuCounterWait : EmuWaitable {
    const unsigned* p;
    long i;
    unsigned target;
    EmuCounterWait(const unsigned* q, long idx, unsigned t) : p(q), i(idx), target(t) {}
    unsigned now() const {
        unsigned v;
        if (i < 0) return *p;
        std::memcpy(&v, emu_gm.latest.data() + i, sizeof v);
        return v;
    }
    bool ready() override { return (int)(now() - target) >= 0; }
    bool global() const override { return true; }
    std::string what() const override {
        return "wait_acquire: a counter holds " + std::to_string(now()) + ", waits for " + std::to_string(target);
    }
};
// __nanosleep in a spin loop: parked until a strong write somewhere changes a value, so a spin on
// a value that never comes is a deadlock report, not a hang (a spin on a plain store of its own
// block would never wake: spin with the counter helpers).
struct EmuSleep : EmuWaitable {
    unsigned long long gen;
    EmuSleep() : gen(emu_gm.gen) {}
    bool ready() override { return emu_gm.gen != gen; }
    bool global() const override { return true; }
    std::string what() const override { return "__nanosleep in a spin loop: the value it waits for never comes"; }
};
inline void __nanosleep(unsigned) {
    EmuSleep w;
    emu_wait_until(w);
}

// --- CUDA's fences, atomics and cache-hinted loads ----------------------------------------------------
inline void __threadfence() { emu_gm_fence(); }
inline void __threadfence_block() {}  // a block's threads share one view: nothing to order here
// ld.global.cg: a weak load with a cache hint (L2 only), not an acquire.
template <typename T> T __ldcg(const T* p) { return *p; }
template <typename T> T atomicAdd(T* p, T v) { return emu_gm_rmw(p, [v](T o) { return (T)(o + v); }, EMU_RELAXED, "atomicAdd"); }
template <typename T> T atomicSub(T* p, T v) { return emu_gm_rmw(p, [v](T o) { return (T)(o - v); }, EMU_RELAXED, "atomicSub"); }
template <typename T> T atomicMax(T* p, T v) { return emu_gm_rmw(p, [v](T o) { return v > o ? v : o; }, EMU_RELAXED, "atomicMax"); }
template <typename T> T atomicMin(T* p, T v) { return emu_gm_rmw(p, [v](T o) { return v < o ? v : o; }, EMU_RELAXED, "atomicMin"); }
template <typename T> T atomicExch(T* p, T v) { return emu_gm_rmw(p, [v](T) { return v; }, EMU_RELAXED, "atomicExch"); }
template <typename T> T atomicCAS(T* p, T cmp, T v) {
    return emu_gm_rmw(p, [cmp, v](T o) { return o == cmp ? v : o; }, EMU_RELAXED, "atomicCAS");
}
