// emu_hb.h: happens-before between the threads of a block, part of emu_runtime.h (tests/emu/README.md,
// "Inside a block"): the knowledge a thread holds (EmuKnow) and the operations at the points where
// threads synchronise. Templates over the block (EmuSched, defined after this in emu_runtime.h: a
// fiber holds an EmuKnow).
#pragma once
#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

// ---- happens-before inside a block (PTX ISA, Memory Consistency Model: "Causality order") --------
// The events the emulator orders between the threads of a block are the generic-proxy stores to
// dynamic shared memory and the fence.proxy.async that hand them to the async proxy (emu_ptx_sm90.h;
// TMA and wgmma read through it). A thread that has made one is a *source*; its events carry its
// epoch, which grows at each of its releases. What a thread knows, EmuKnow, is per source the first
// epoch it does not cover: a source's event of epoch e happens before the thread's next operation
// iff the thread knows more than e of that source. Knowledge passes at the synchronising points
// (emu_hb_meet): __syncthreads (every thread: the block's floor), __syncwarp and the warp's other
// meeting points (shuffles, votes, ldmatrix, mma, stmatrix), a warpgroup's wgmma collectives, named
// barriers (bar.arrive releases, bar.sync acquires) and mbarriers (an arrival releases into its
// phase, a wait that sees the phase complete acquires it). Nothing is tracked while no source exists.
struct EmuKnow {
    using Vec = std::vector<std::pair<unsigned, unsigned>>;  // (source thread, epochs covered), by thread
    // Shared and never changed once made (copy on write): the threads of a warpgroup that met hold
    // one list, and their next meeting finds them equal by the pointer alone.
    std::shared_ptr<const Vec> p;
    bool empty() const { return !p || p->empty(); }
    unsigned at(unsigned t) const {
        if (p)
            for (const auto& [s, e] : *p)
                if (s >= t) return s == t ? e : 0u;
        return 0u;
    }
    void join(const EmuKnow& o) {  // the larger epoch of each source
        if (o.empty() || o.p == p) return;
        if (empty()) { p = o.p; return; }
        const Vec &a = *p, &b = *o.p;
        bool a_more = false, b_more = false;  // whether a or b knows something the other does not
        for (size_t i = 0, j = 0; (i < a.size() || j < b.size()) && !(a_more && b_more);) {
            if (j == b.size() || (i < a.size() && a[i].first < b[j].first)) { a_more = true; ++i; }
            else if (i == a.size() || b[j].first < a[i].first) { b_more = true; ++j; }
            else { a_more |= a[i].second > b[j].second; b_more |= b[j].second > a[i].second; ++i; ++j; }
        }
        if (!b_more) return;
        if (!a_more) { p = o.p; return; }
        auto m = std::make_shared<Vec>();
        for (size_t i = 0, j = 0; i < a.size() || j < b.size();) {
            if (j == b.size() || (i < a.size() && a[i].first < b[j].first)) m->push_back(a[i++]);
            else if (i == a.size() || b[j].first < a[i].first) m->push_back(b[j++]);
            else { m->push_back({a[i].first, std::max(a[i].second, b[j].second)}); ++i; ++j; }
        }
        p = std::move(m);
    }
    void raise(unsigned t, unsigned e) {
        if (at(t) >= e) return;
        auto m = p ? std::make_shared<Vec>(*p) : std::make_shared<Vec>();
        auto it = std::lower_bound(m->begin(), m->end(), std::make_pair(t, 0u));
        if (it != m->end() && it->first == t) it->second = e;
        else m->insert(it, {t, e});
        p = std::move(m);
    }
    void clear() { p.reset(); }
};
// Thread t becomes a source (its next event is ordered).
template <typename Sched> void emu_hb_source(Sched& S, int t) {
    if (!S.f[t].source) { S.f[t].source = true; ++S.sources; }
}
// No ordered event is left to ask about (the module says so: the async proxy overwrote every
// tracked store): tracking stops until the next one. Knowledge kept elsewhere (a barrier's) names
// only epochs of events gone now, and epochs never repeat, so it cannot vouch for a later event.
template <typename Sched> void emu_hb_forget(Sched& S) {
    if (!S.sources) return;
    S.sources = 0;
    S.floor.clear();
    for (auto& f : S.f) { f.source = false; f.kn.clear(); }
}
// Thread t releases: what it knows, and its own events so far (its epoch then advances), into `into`.
template <typename Sched> void emu_hb_give(Sched& S, int t, EmuKnow& into) {
    auto& f = S.f[t];
    into.join(f.kn);
    if (f.source) into.raise((unsigned)t, ++f.epoch);
}
// Whether source `src`'s event of epoch e happens before thread t's next operation.
template <typename Sched> bool emu_hb_knows(const Sched& S, int t, unsigned src, unsigned e) {
    return src == (unsigned)t || S.f[t].kn.at(src) > e || S.floor.at(src) > e;
}
// What thread t knows now, whole (floor, its knowledge, its own events): a snapshot that an
// asynchronous operation it issues keeps (a wgmma's or TMA store's reads are ordered after it).
template <typename Sched> EmuKnow emu_hb_snapshot(Sched& S, int t) {
    EmuKnow k = S.floor;
    k.join(S.f[t].kn);
    if (S.f[t].source) k.raise((unsigned)t, S.f[t].epoch + 1);
    return k;
}
// The threads [lo, hi) meet (a warp's meeting point: those whose bit is set in `lanes`, relative to
// lo; a warpgroup's collective: all of them): each releases, each acquires all. Returns what they
// know together.
template <typename Sched> EmuKnow emu_hb_meet(Sched& S, int lo, int hi, unsigned lanes = ~0u) {
    EmuKnow all;
    if (!S.sources) return all;
    auto takes_part = [&](int t) { return hi - lo > 32 || (lanes >> (t - lo) & 1u); };
    for (int t = lo; t < hi; ++t)
        if (takes_part(t)) emu_hb_give(S, t, all);
    for (int t = lo; t < hi; ++t)
        if (takes_part(t) && S.f[t].kn.p != all.p) S.f[t].kn = all;
    return all;
}
