// emu_memory.cpp: the memory model of emu_memory.h, in the emulator's runtime library
// (emu_runtime.cpp says why).
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>
#include "emu_runtime.h"

EmuGm emu_gm;

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
};
static EmuGmPages emu_gm_pages;

// read_only: only once every store noted so far is captured (the notes are dropped).
static void emu_gm_protect(bool read_only) {
    if (!emu_gm.paged) return;
    for (const auto& [lo, hi] : emu_gm_pages.spans)
        mprotect(reinterpret_cast<void*>(lo), hi - lo, read_only ? PROT_READ : PROT_READ | PROT_WRITE);
    if (read_only) emu_gm_pages.ndirty = 0;
}

// A store fault on a watched page: noted (true), or not ours (false). Called by the emulator's one
// SIGSEGV handler (emu_runtime.cpp, emu_fault_handler).
bool emu_gm_fault(uintptr_t a) {
    EmuGmPages& p = emu_gm_pages;
    if (!emu_gm.paged) return false;
    for (const auto& [lo, hi] : p.spans)
        if (a >= lo && a < hi && p.ndirty < p.cap) {
            const uintptr_t page = a & ~(p.size - 1);
            mprotect(reinterpret_cast<void*>(page), p.size, PROT_READ | PROT_WRITE);
            p.dirty[p.ndirty++] = page;
            return true;
        }
    return false;
}

static void emu_gm_pages_begin() {
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
    emu_fault_handler(true);
    emu_gm_protect(true);
}

static void emu_gm_pages_end() {
    emu_gm_protect(false);
    emu_fault_handler(false);
    emu_gm_pages.ndirty = 0;
}

// Byte index of [p, p + n) in the regions, or -1 when it is not inside one.
static long emu_gm_index(const void* p, size_t n) {
    const unsigned char* a = static_cast<const unsigned char*>(p);
    for (const EmuGmRegion& r : emu_gm.regions)
        if (a >= r.base && a + n <= r.base + r.size) return (long)(r.off + (size_t)(a - r.base));
    return -1;
}

static unsigned char* emu_gm_addr(size_t i) {
    for (const EmuGmRegion& r : emu_gm.regions)
        if (i < r.off + r.size) return r.base + (i - r.off);
    return nullptr;
}

// What block `v` may read at byte i: its own stores, bytes nobody wrote in this launch, and
// stores of releases it has acquired; poison where another block wrote and it has not.
static unsigned char emu_gm_seen(const EmuGmView& v, size_t i) {
    const unsigned w = emu_gm.wblk[i];
    if (w == 0 || w == v.id) return emu_gm.latest[i];
    const unsigned r = emu_gm.wrel[i];
    return r != EMU_GM_UNPUBLISHED && v.vc.at(w) >= r ? emu_gm.latest[i] : EMU_GM_POISON;
}

// Byte written[k] of view v may differ from a fresh block's (EmuGmView::own).
static void emu_gm_own(EmuGmView& v, size_t k) {
    if (v.owned.size() <= k) v.owned.resize(emu_gm.written.size(), 0);
    if (!v.owned[k]) {
        v.owned[k] = 1;
        v.own.push_back(k);
    }
}

void emu_gm_record(int s, size_t i, unsigned char x) {
    EmuGmView& me = emu_gm.views[s];
    const unsigned prev = emu_gm.wblk[i];
    const bool mine = prev == me.id && emu_gm.wrel[i] == EMU_GM_UNPUBLISHED;
    me.img[i] = x;
    emu_gm.latest[i] = x;
    if (prev == 0) {
        emu_gm.fresh[i] = EMU_GM_POISON;
        emu_gm.windex[i] = emu_gm.written.size();
        emu_gm.written.push_back(i);
        emu_gm.at.push_back(emu_gm_addr(i));
    }
    emu_gm_own(me, emu_gm.windex[i]);
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

void emu_gm_capture_range(int s, size_t i0, size_t n) {
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
static void emu_gm_capture(int s) {
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

// Memory takes slot s's view at the bytes `own` lists (indices into `written`).
static void emu_gm_put(const EmuGmView& v, const std::vector<size_t>& own) {
    for (size_t k : own) *emu_gm.at[k] = v.img[emu_gm.written[k]];
}
// Memory takes slot s's view (the previous slot's view in it all captured). The two differ only
// where either block wrote or acquired (EmuGmView::own).
static void emu_gm_load_view(int s) {
    emu_gm_protect(false);
    if (emu_gm.cur >= 0) emu_gm_put(emu_gm.views[s], emu_gm.views[emu_gm.cur].own);
    emu_gm_put(emu_gm.views[s], emu_gm.views[s].own);
    emu_gm_protect(true);
    emu_gm.cur = s;
}

void emu_gm_switch(int s) {
    if (!emu_gm.on || s == emu_gm.cur) return;
    if (emu_gm.cur >= 0) emu_gm_capture(emu_gm.cur);
    emu_gm_load_view(s);
}

void emu_gm_begin(const unsigned long long* spans, int n, bool paged) {
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
    g.windex.resize(g.bytes);
    g.fresh = g.latest;
    if (g.paged) emu_gm_pages_begin();
}

void emu_gm_block_start(int s, unsigned long long block) {
    if (!emu_gm.on) return;
    if ((int)emu_gm.views.size() <= s) emu_gm.views.resize(s + 1);
    EmuGmView& v = emu_gm.views[s];
    const std::vector<size_t> before = std::move(v.own);  // where memory may hold the slot's last block's view
    std::vector<unsigned char> img = std::move(v.img);    // (its allocation, reused)
    v = EmuGmView();
    v.id = (unsigned)block + 1;
    // it has acquired nothing: every byte a block of this launch wrote is poison to it (emu_gm_seen)
    img.assign(emu_gm.fresh.begin(), emu_gm.fresh.end());
    v.img = std::move(img);
    if (emu_gm.cur == s) {
        emu_gm_protect(false);
        emu_gm_put(v, before);
        emu_gm_protect(true);
    }
}

void emu_gm_block_end(int s) {
    if (!emu_gm.on) return;
    emu_gm_capture(s);
    emu_gm.views[s].id = 0;
}

void emu_gm_end() {
    if (!emu_gm.on) return;
    if (emu_gm.cur >= 0 && emu_gm.views[emu_gm.cur].id) emu_gm_capture(emu_gm.cur);
    if (emu_gm.paged) emu_gm_pages_end();
    for (const EmuGmRegion& r : emu_gm.regions) std::memcpy(r.base, emu_gm.latest.data() + r.off, r.size);
    emu_gm = EmuGm();
}

void emu_gm_release() {
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

void emu_gm_acquire() {
    const int s = emu_gm.cur;
    EmuGmView& me = emu_gm.views[s];
    emu_gm_capture(s);
    const bool grew = me.vc.join(me.obs);
    me.obs.c.clear();
    if (!grew) return;  // nothing new acquired: the view already is what it may see
    emu_gm_protect(false);
    for (size_t k = 0; k < emu_gm.written.size(); ++k) {  // bytes nobody wrote are in the view as they were
        const size_t i = emu_gm.written[k];
        if (emu_gm.wblk[i] == me.id && emu_gm.wrel[i] == EMU_GM_UNPUBLISHED) continue;
        *emu_gm.at[k] = me.img[i] = emu_gm_seen(me, i);
        if (me.img[i] != EMU_GM_POISON) emu_gm_own(me, k);
    }
    emu_gm_protect(true);
}

void emu_gm_fence() {
    if (!emu_gm.on) return;
    emu_gm_release();
    emu_gm_acquire();
}

long emu_gm_strong_index(const void* p, size_t n, const char* what, bool global_only) {
    if (!emu_gm.on) return -1;
    const long i = emu_gm_index(p, n);
    if (i < 0 && global_only)
        throw std::runtime_error(std::string(what) + ": the counter is not inside an array the launch passes as a "
                                 "non-const pointer argument, the only global memory the emulator's memory model "
                                 "tracks (tests/emu/README.md)");
    if (i >= 0 && emu_gm.cur != emu_slot) throw std::runtime_error("emulator: memory model out of step with the scheduler");
    return i;
}

void emu_gm_load_nc(const void* p, void* out, size_t n) {
    std::memcpy(out, p, n);
    if (!emu_gm.on) return;
    const long i = emu_gm_index(p, n);
    if (i < 0) return;  // outside the regions: nothing of it is written in the launch
    const int s = emu_gm.cur;
    emu_gm_capture_range(s, (size_t)i, n);  // its own stores so far are known as its own
    const unsigned me = emu_gm.views[s].id;
    for (size_t k = 0; k < n; ++k) {
        const unsigned w = emu_gm.wblk[(size_t)i + k];
        if (w != 0 && w != me) static_cast<unsigned char*>(out)[k] = EMU_GM_POISON;
    }
}
