// emu_sm90_barriers.h: the barriers of kernels_cu/ptx_sm90.cuh for the CPU emulator, part of
// emu_ptx_sm90.h (which includes it after the per-block state): mbarriers (PTX ISA 9.7.13.15) with
// their arrival accounting and the hold-back of a thread that releases a ring slot, and named
// barriers (bar.sync / bar.arrive, 9.7.13.1). Each arrival releases what its thread knows into the
// barrier, each wait that sees the phase complete acquires it (EmuKnow, emu_hb.h).
#pragma once

// --- mbarrier (PTX ISA 9.7.13.15) ---------------------------------------------------------------
// The 8 bytes of a barrier hold a tag while it is valid, so a store over it shows.
inline uint64_t emu_mbar_tag(unsigned addr) { return 0x4D42415200000000ull | addr; }
// A barrier as the source names it, for messages: "mbarrier `kempty[1]` (static __shared__) at shared 0x..".
inline std::string emu_mbar_name(unsigned addr) { return "mbarrier " + emu_smem_name(addr, 8) + " at shared " + emu_hex(addr); }
inline EmuMbar* emu_mbar_find(unsigned addr, std::string* err) {
    auto it = emu_sm90.bars.find(addr);
    uint64_t tag;
    std::memcpy(&tag, emu_shared_ptr(addr), 8);
    if (it == emu_sm90.bars.end()) {
        *err = emu_mbar_name(addr) + " used before mbarrier.init";
        return nullptr;
    }
    if (tag != emu_mbar_tag(addr)) {
        *err = emu_mbar_name(addr) + " was overwritten by an ordinary store";
        return nullptr;
    }
    return &it->second;
}
inline EmuMbar& emu_mbar(unsigned addr) {
    std::string err;
    EmuMbar* b = emu_mbar_find(addr, &err);
    if (!b) emu_sm90_fail(err);
    return *b;
}
// Arrival accounting: each phase records who arrived. A ring's barrier is completed by the same
// threads in every phase (the consumers that release a slot, the producer that fills it), so a
// phase completed by other threads than the one before (a surplus arrival that spilled over from
// it, a missing one taken from the next) means a count that does not match the threads arriving:
// an error at once, naming the barrier and the threads, not after as many uses as the count.
inline std::string emu_mbar_threads(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
    std::vector<uint16_t> d;  // in a, not in b (as multisets)
    std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(d));
    std::string out;
    for (size_t i = 0; i < d.size() && i < 4; ++i) out += (i ? ", " : "") + std::to_string(d[i]);
    if (d.size() > 4) out += " and " + std::to_string(d.size() - 4) + " more";
    return d.empty() ? "none" : out;
}
inline std::string emu_mbar_account(EmuMbar& b, unsigned addr) {
    std::sort(b.arrived.begin(), b.arrived.end());
    std::string err;
    if (b.completed && b.arrived != b.last)
        err = emu_mbar_name(addr) + " (count " + std::to_string(b.count) + "): phase " + std::to_string(b.phase) +
              " was completed by other threads than phase " + std::to_string(b.phase - 1) + " (thread(s) " +
              emu_mbar_threads(b.arrived, b.last) + " arrived in it but not in the one before, " +
              emu_mbar_threads(b.last, b.arrived) + " the other way round): its arrival count does not match the "
              "threads that arrive on it, and the surplus or missing arrival moves from phase to phase";
    b.last.swap(b.arrived);
    b.arrived.clear();
    b.completed = true;
    return err;
}
// A phase completes when no arrival is pending and tx-count is 0: the phase advances and the
// pending count is reset to the expected count. What its arrivals released is what a wait on it
// acquires (EmuKnow). Returns an accounting error, or "".
inline std::string emu_mbar_try_complete(EmuMbar& b, unsigned addr) {
    if (b.pending != 0 || b.tx != 0) return "";
    std::string err = emu_mbar_account(b, addr);
    ++b.phase;
    b.pending = b.count;
    b.done.join(b.kn);
    b.kn.clear();
    return err;
}
inline void emu_mbar_complete_tx(unsigned addr, unsigned bytes) {
    std::string err;
    EmuMbar* b = emu_mbar_find(addr, &err);
    if (!b) {
        if (emu_sm90.error.empty()) emu_sm90.error = "complete_tx of a TMA copy: " + err;
        return;
    }
    b->tx -= bytes;
    err = emu_mbar_try_complete(*b, addr);
    if (!err.empty() && emu_sm90.error.empty()) emu_sm90.error = err;  // (maybe the scheduler's stack: no throw)
}

inline void mbar_init(unsigned long long* bar, unsigned count) {
    const unsigned addr = smem_u32(bar);
    if (addr % 8) emu_sm90_fail("mbarrier.init: address " + emu_hex(addr) + " is not 8-byte aligned");
    if (count < 1 || count > (1u << 20) - 1) emu_sm90_fail("mbarrier.init: count outside [1, 2^20 - 1]");
    EmuMbar& b = emu_sm90.bars[addr];
    b = EmuMbar();
    b.count = b.pending = count;
    const uint64_t tag = emu_mbar_tag(addr);
    std::memcpy(emu_shared_ptr(addr), &tag, 8);
}
inline void mbar_fence_init() {
    for (auto& kv : emu_sm90.bars) kv.second.async_ok = true;
}
// One arrival of the running thread (a release: what it knows goes into the phase). Returns whether
// it was a lone producer's publication: the arrival that completes a phase of a count-1 barrier.
inline bool emu_mbar_arrive(unsigned addr, const char* what) {
    emu_hb_flush();
    EmuMbar& b = emu_mbar(addr);
    if (b.pending == 0)
        emu_sm90_fail(std::string(what) + ": " + emu_mbar_name(addr) + " got more arrivals than its count (" +
                      std::to_string(b.count) + ") in one phase");
    if (emu_s->sources) emu_hb_give(*emu_s, emu_tid(), b.kn);
    b.arrived.push_back((uint16_t)emu_tid());
    --b.pending;
    const unsigned phase = b.phase;
    const std::string err = emu_mbar_try_complete(b, addr);
    if (!err.empty()) {
        emu_sm90.error = err;
        emu_sm90_fail(err);
    }
    return b.phase != phase && b.count == 1;
}
// A plain arrival releases a resource (a stage's empty barrier, a work slot): the arriving thread
// lags (emu_lag) while the rest of its block, the producer that refills the slot included, runs
// on. Not a lone producer's publication (a count-1 barrier: a work item's scheduler, the loader
// lane that zeroed a V slot's tail): held, it would hide a consumer that released its slot early
// (held consumers could resume before the publisher refills the slot). Either way the thread
// steps aside before it arrives (emu_interleave): other lanes of its warp may run first, as
// independent thread scheduling allows.
inline void mbar_arrive(unsigned long long* bar) {
    emu_interleave();
    if (!emu_mbar_arrive(smem_u32(bar), "mbarrier.arrive")) emu_lag();
}
inline void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    EmuMbar& b = emu_mbar(smem_u32(bar));
    b.tx += bytes;  // expect-tx first, then the arrive-on (9.7.13.15.13)
    if (b.tx >= (1ll << 20)) emu_sm90_fail("mbarrier.expect_tx: tx-count passes 2^20 - 1");
    emu_mbar_arrive(smem_u32(bar), "mbarrier.arrive.expect_tx");
}

void emu_sm90_complete_tma(const EmuTmaLoad& op);
// Deliver every TMA load still in flight towards barrier `addr` (all of them if addr is ~0u).
inline void emu_sm90_deliver_loads(unsigned addr) {
    for (size_t i = 0; i < emu_sm90.loads.size();) {
        if (addr == ~0u || emu_sm90.loads[i].bar == addr) {
            const EmuTmaLoad op = emu_sm90.loads[i];
            emu_sm90.loads.erase(emu_sm90.loads.begin() + (long)i);
            emu_sm90_complete_tma(op);
        } else {
            ++i;
        }
    }
}

// try_wait.parity: true once the phase with that parity has completed, i.e. the current
// (incomplete) phase has the other parity. The copies the phase waits for land now, at the latest.
struct EmuMbarWait : EmuWaitable {
    unsigned addr, parity;
    EmuMbarWait(unsigned a, unsigned p) : addr(a), parity(p) {}
    bool ready() override {
        std::string err;
        EmuMbar* b = emu_mbar_find(addr, &err);
        if (!b) return true;  // the caller re-checks and throws
        if ((b->phase & 1u) != parity) return true;
        emu_sm90_deliver_loads(addr);
        return (b->phase & 1u) != parity;
    }
    std::string what() const override {
        if (!emu_sm90.error.empty()) return emu_sm90.error;
        auto it = emu_sm90.bars.find(addr);
        if (it == emu_sm90.bars.end()) return "mbarrier " + emu_hex(addr) + " (not initialised)";
        const EmuMbar& b = it->second;
        return emu_mbar_name(addr) + " waited on for parity " + std::to_string(parity) + " never completes its phase " +
               std::to_string(b.phase) + " (" + std::to_string(b.pending) + " of " + std::to_string(b.count) +
               " arrivals pending, tx-count " + std::to_string(b.tx) + ")";
    }
};
// The wait acquires what the completed phases' arrivals released (PTX: try_wait is .acquire.cta).
inline bool mbar_try_wait(unsigned long long* bar, unsigned parity) {
    if (parity > 1) emu_sm90_fail("mbarrier.try_wait.parity: parity must be 0 or 1");
    const unsigned addr = smem_u32(bar);
    emu_mbar(addr);
    EmuMbarWait w(addr, parity);
    emu_wait_until(w);
    EmuMbar& b = emu_mbar(addr);  // still a barrier (not overwritten while waiting)
    if (!emu_sm90.error.empty()) emu_sm90_fail(emu_sm90.error);
    if (emu_s->sources) emu_s->f[emu_tid()].kn.join(b.done);
    return true;
}

// --- named barriers (bar.sync / bar.arrive, PTX ISA 9.7.13.1) ---------------------------------------
// Barrier id counts arriving threads; when `threads` have arrived (sync and arrive alike) it
// completes and releases the threads waiting in bar.sync. Every arrival of one phase must name the
// same count. Arrivals left at the end of a block are allowed (a final hand-off nobody takes).
// The barriers are the block's own (blocks in flight together never share one); a waiter keeps a
// pointer to its block's barrier, since the scheduler polls it while another block may be current.
struct EmuNamedWait : EmuWaitable {
    const EmuNamedBar* bar;
    int id;
    unsigned gen;
    EmuNamedWait(const EmuNamedBar* b, int i, unsigned g) : bar(b), id(i), gen(g) {}
    bool ready() override { return bar->gen != gen; }
    std::string what() const override {
        const EmuNamedBar& b = *bar;
        return "named barrier " + std::to_string(id) + " waits for " + std::to_string(b.expected) + " threads, " +
               std::to_string(b.arrived) + " arrived";
    }
};
// An arrival releases (EmuKnow) into the barrier's phase; bar.sync acquires what the phase released.
inline void emu_named_bar(int id, int threads, bool wait, const char* what) {
    emu_hb_flush();
    if (id < 1 || id > 15) emu_sm90_fail(std::string(what) + ": barrier id " + std::to_string(id) + " outside 1..15");
    if (threads <= 0 || threads % 32 || threads > emu_sm90.threads)
        emu_sm90_fail(std::string(what) + ": thread count " + std::to_string(threads) +
                      " is not a positive multiple of 32 within the block");
    EmuNamedBar& b = emu_sm90.named[id];
    if (b.arrived == 0) b.expected = threads;
    else if (b.expected != threads)
        emu_sm90_fail(std::string(what) + ": barrier " + std::to_string(id) + " named with " + std::to_string(threads) +
                      " threads while its phase counts " + std::to_string(b.expected));
    const unsigned gen = b.gen;
    EmuSched& S = *emu_s;
    if (S.sources) emu_hb_give(S, emu_tid(), b.kn);
    if (++b.arrived == b.expected) {
        b.arrived = 0;
        ++b.gen;
        b.done.join(b.kn);
        b.kn.clear();
    } else if (wait) {
        EmuNamedWait w(&b, id, gen);
        emu_wait_until(w);
    }
    if (wait && S.sources) S.f[emu_tid()].kn.join(b.done);
}
inline void named_bar_sync(int id, int threads) { emu_named_bar(id, threads, true, "bar.sync"); }
inline void named_bar_arrive(int id, int threads) { emu_named_bar(id, threads, false, "bar.arrive"); }

