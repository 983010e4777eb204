// emu_memory.h: global memory as blocks see it, part of emu_runtime.h. The model, what
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
    // Where img may differ from what a block that has just started sees (the bytes written in this
    // launch poisoned, the others as before it): bytes it wrote or acquired, as indices into
    // EmuGm::written, each once (`owned`: which are in). Elsewhere the views of the blocks in
    // flight are equal, so a switch between two blocks copies these bytes of theirs only.
    std::vector<size_t> own;
    std::vector<unsigned char> owned;
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
    std::vector<size_t> windex;         // each written byte's index in `written`
    std::vector<unsigned char> fresh;   // what a block starting now sees: `latest`, the bytes written in this launch poisoned
    std::unordered_map<size_t, EmuClock> sync;  // per location of strong writes: the releases they carried
    std::vector<EmuGmView> views;       // per slot
    int cur = -1;                       // the slot whose view is in memory
    unsigned long long gen = 0;         // bumped by strong writes: wakes threads parked on global values
};
extern EmuGm emu_gm;  // (emu_memory.cpp)
// The emulator's one SIGSEGV handler (emu_runtime.cpp) serves the pages this model watches and the
// tracked dynamic shared memory (emu_runtime.h, EmuHooks::smem_store): installed while either needs it.
void emu_fault_handler(bool install);
bool emu_gm_fault(uintptr_t addr);  // a store fault on a page of the regions: noted

// Slot s wrote value x at byte i (found by a capture, or an atomic): it is the latest value; other
// blocks in flight lose it from their views (they read it racily now) unless it was their own store.
void emu_gm_record(int s, size_t i, unsigned char x);
// The plain stores slot s (in memory now) made to bytes [i0, i0 + n) of one region since its view
// was last compared: memory against the view, 64 bytes at a time, then bytes where they differ.
void emu_gm_capture_range(int s, size_t i0, size_t n);
// Before a pass of the block in slot s: its view into memory (the previous block's stores captured).
void emu_gm_switch(int s);

// --- launch, block start and end -------------------------------------------------------------------
// spans: (address, bytes) pairs of the regions (fakecupy: the non-const pointer arguments' arrays);
// none: the model is off for this launch (stores visible to every block at once). paged: their
// pages hold nothing else (fakecupy's own allocations).
void emu_gm_begin(const unsigned long long* spans, int n, bool paged);
// A block starts in slot s: it sees what was there before the launch, poison where blocks of this
// launch have written (nothing orders it after them).
void emu_gm_block_start(int s, unsigned long long block);
// A block ended: its stores are captured; those it never released stay unpublished (poison to
// every other block) until the launch ends.
void emu_gm_block_end(int s);
// The launch ended (kernel completion orders everything): every store lands.
void emu_gm_end();

// --- release, acquire, strong operations (the running block: slot emu_gm.cur) ---------------------
void emu_gm_release();
void emu_gm_acquire();
// fence.acq_rel / fence.sc (__threadfence) at gpu scope: a release, then an acquire.
void emu_gm_fence();
// The byte index of a strong operation's location, or -1 (off, or shared memory: plain there).
// `global_only`: the operation names .global (the counter helpers), so an address outside the
// regions is an error, not silently unmodelled.
long emu_gm_strong_index(const void* p, size_t n, const char* what, bool global_only);
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
// ld.global.cg: a weak load with a cache hint (L2 only), not an acquire. The other coherent cache
// hints (ld.global.ca / .cs / .lu / .cv, st.global.wb / .cg / .cs / .wt) are weak loads and stores of
// the block's view as well.
template <typename T> T __ldcg(const T* p) { return *p; }
template <typename T> T __ldca(const T* p) { return *p; }
template <typename T> T __ldcs(const T* p) { return *p; }
template <typename T> T __ldlu(const T* p) { return *p; }
template <typename T> T __ldcv(const T* p) { return *p; }
template <typename T> void __stwb(T* p, T v) { *p = v; }
template <typename T> void __stcg(T* p, T v) { *p = v; }
template <typename T> void __stcs(T* p, T v) { *p = v; }
template <typename T> void __stwt(T* p, T v) { *p = v; }
// ld.global.nc (__ldg): the non-coherent path, for data that stays read-only while the kernel runs
// (PTX ISA, ld.global.nc). An SM may hold a stale line of it whatever it acquired, so a byte another
// block of the launch wrote reads as poison here, acquired or not; the rest as the block's view.
void emu_gm_load_nc(const void* p, void* out, size_t n);
template <typename T> T __ldg(const T* p) {
    T v;
    emu_gm_load_nc(p, &v, sizeof(T));
    return v;
}
template <typename T> T atomicAdd(T* p, T v) { return emu_gm_rmw(p, [v](T o) { return (T)(o + v); }, EMU_RELAXED, "atomicAdd"); }
template <typename T> T atomicSub(T* p, T v) { return emu_gm_rmw(p, [v](T o) { return (T)(o - v); }, EMU_RELAXED, "atomicSub"); }
template <typename T> T atomicMax(T* p, T v) { return emu_gm_rmw(p, [v](T o) { return v > o ? v : o; }, EMU_RELAXED, "atomicMax"); }
template <typename T> T atomicMin(T* p, T v) { return emu_gm_rmw(p, [v](T o) { return v < o ? v : o; }, EMU_RELAXED, "atomicMin"); }
template <typename T> T atomicExch(T* p, T v) { return emu_gm_rmw(p, [v](T) { return v; }, EMU_RELAXED, "atomicExch"); }
template <typename T> T atomicCAS(T* p, T cmp, T v) {
    return emu_gm_rmw(p, [cmp, v](T o) { return o == cmp ? v : o; }, EMU_RELAXED, "atomicCAS");
}
