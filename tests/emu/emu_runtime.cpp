// emu_runtime.cpp: the emulator's runtime library (tests/emu/README.md): its state, the static
// shared-memory arenas and the launch's scheduler. fakecupy builds it once (with emu_memory.cpp)
// and links every kernel build to it, so a kernel build compiles only its kernels and the
// inline parts of the headers.
#include <signal.h>
#include <sys/mman.h>
#include "emu_runtime.h"

EmuSched* emu_s = nullptr;
uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
int emu_lane = 0, emu_warp = 0;
unsigned char* emu_dyn_smem = nullptr;
std::mt19937_64 emu_rng;
unsigned long long emu_tick = 0;
size_t emu_dyn_smem_bytes = 0;
int emu_slot = 0;
EmuHooks emu_hooks;

alignas(128) unsigned char emu_shared_origin[128];
// page-aligned, whole pages per slot: a slot's buffer is write-protected on its own (EmuSmemTrack)
alignas(4096) unsigned char emu_dyn_smem_buf[EMU_MAX_SLOTS][EMU_DYN_SMEM];
static_assert(EMU_DYN_SMEM % 4096 == 0, "whole pages per slot");
alignas(1024) unsigned char emu_static_smem_buf[EMU_MAX_SLOTS][EMU_STATIC_SMEM];
struct EmuStaticVar { const void* tag; unsigned off, size; const char* name; };
struct EmuStaticArena { std::vector<EmuStaticVar> vars; size_t top = 0; };
static EmuStaticArena emu_static_arena[EMU_MAX_SLOTS];
// The slot's copy of the static __shared__ variable whose declaration owns `tag`.
void* emu_static_smem(const void* tag, size_t size, size_t align, const char* name) {
    EmuStaticArena& a = emu_static_arena[emu_slot];
    for (const EmuStaticVar& v : a.vars)
        if (v.tag == tag) return emu_static_smem_buf[emu_slot] + v.off;
    const size_t o = (a.top + align - 1) / align * align;
    if (o + size > EMU_STATIC_SMEM)
        throw std::runtime_error("static __shared__ variables exceed 48 KB per block");
    a.vars.push_back({tag, (unsigned)o, (unsigned)size, name});
    a.top = o + size;
    std::memset(emu_static_smem_buf[emu_slot] + o, 0xFF, size);  // placed during this block: poison it now
    return emu_static_smem_buf[emu_slot] + o;
}
std::string emu_smem_name(unsigned addr, unsigned elem) {
    const unsigned char* p = emu_shared_ptr(addr);
    const unsigned char* st = emu_static_smem_buf[emu_slot];
    if (p >= st && p < st + EMU_STATIC_SMEM)
        for (const EmuStaticVar& v : emu_static_arena[emu_slot].vars) {
            const unsigned o = (unsigned)(p - st);
            if (o < v.off || o >= v.off + v.size) continue;
            std::string n = std::string("`") + v.name;
            if (v.size > elem) n += "[" + std::to_string((o - v.off) / elem) + "]";
            return n + "` (static __shared__)";
        }
    const unsigned char* dyn = emu_dyn_smem_buf[emu_slot];
    if (p >= dyn && p < dyn + EMU_DYN_SMEM) return "byte " + std::to_string(p - dyn) + " of dynamic shared memory";
    return "shared address " + std::to_string(addr);
}

// --- the generic stores to a slot's dynamic shared memory (EmuHooks::smem_store) -----------------
// While a launch tracks them, each block's buffer (the launch's bytes, in whole pages) is read-only:
// the first store to a page faults, and the handler makes the page writable and notes it. The page
// stays writable ("hot") while threads keep writing it: whenever the thread that ran stops or
// synchronises (emu_smem_flush), the block's hot pages are compared with a shadow copy of the
// buffer and each changed run is handed to the module as that thread's store; a page unchanged
// for EMU_SMEM_IDLE such checks is read-only again. (A loader warp zeroing rows writes each page
// from every lane: one fault per page, not one per lane and page.) The emulator's own writes of the
// buffer (TMA landing, the poison of a block's start) keep the shadow equal, so they are never
// taken for a thread's stores.
constexpr int EMU_SMEM_IDLE = 32;
struct EmuSmemHot { uintptr_t page; int slot, idle; };
struct EmuSmemTrack {
    bool on = false;
    size_t bytes = 0;                            // per slot: the launch's dynamic bytes in whole pages
    std::vector<std::vector<unsigned char>> shadow;  // per slot
    uintptr_t dirty[EMU_MAX_SLOTS * (EMU_DYN_SMEM / 4096)];  // faulted since the last flush
    std::vector<EmuSmemHot> hot;                 // writable pages, checked at each flush
};
static EmuSmemTrack emu_smem;
int emu_smem_ndirty = 0, emu_smem_nhot = 0;

static void emu_smem_protect(int slot, bool read_only) {
    if (emu_smem.bytes) mprotect(emu_dyn_smem_buf[slot], emu_smem.bytes, read_only ? PROT_READ : PROT_READ | PROT_WRITE);
}
unsigned char* emu_smem_shadow(unsigned addr, unsigned n) {
    if (!emu_smem.on) return nullptr;
    const unsigned char* p = emu_shared_ptr(addr);
    const unsigned char* b = emu_dyn_smem_buf[emu_slot];
    if (p < b || p + n > b + emu_smem.bytes) return nullptr;
    return emu_smem.shadow[emu_slot].data() + (p - b);
}
// A store fault in a tracked buffer: noted (true), or not ours (false).
static bool emu_smem_fault(uintptr_t a) {
    const uintptr_t lo = reinterpret_cast<uintptr_t>(emu_dyn_smem_buf), hi = lo + sizeof emu_dyn_smem_buf;
    if (!emu_smem.on || a < lo || a >= hi || (a - lo) % EMU_DYN_SMEM >= emu_smem.bytes) return false;
    const uintptr_t page = a & ~uintptr_t(4095);
    mprotect(reinterpret_cast<void*>(page), 4096, PROT_READ | PROT_WRITE);
    emu_smem.dirty[emu_smem_ndirty++] = page;
    return true;
}
// The stores on the running block's hot pages since the last flush: `thread`'s.
void emu_smem_flush(int thread) {
    for (int k = 0; k < emu_smem_ndirty; ++k) {
        const size_t at = (size_t)(reinterpret_cast<unsigned char*>(emu_smem.dirty[k]) - &emu_dyn_smem_buf[0][0]);
        emu_smem.hot.push_back({emu_smem.dirty[k], (int)(at / EMU_DYN_SMEM), 0});
    }
    emu_smem_ndirty = 0;
    size_t keep = 0;
    for (EmuSmemHot h : emu_smem.hot) {
        unsigned char* page = reinterpret_cast<unsigned char*>(h.page);
        if (h.slot != emu_slot) { emu_smem.hot[keep++] = h; continue; }  // its block did not run
        const size_t off = (size_t)(page - emu_dyn_smem_buf[h.slot]);
        unsigned char* sh = emu_smem.shadow[h.slot].data() + off;
        bool changed = false;
        for (size_t c = 0; c < 4096 && std::memcmp(page, sh, 4096); c += 64) {
            if (!std::memcmp(page + c, sh + c, 64)) continue;
            for (size_t i = c; i < c + 64;) {  // runs of changed bytes
                if (page[i] == sh[i]) { ++i; continue; }
                size_t j = i;
                while (j < c + 64 && page[j] != sh[j]) sh[j] = page[j], ++j;
                if (emu_hooks.smem_store) emu_hooks.smem_store(off + i, j - i, thread);
                changed = true;
                i = j;
            }
        }
        h.idle = changed ? 0 : h.idle + 1;
        if (h.idle < EMU_SMEM_IDLE) emu_smem.hot[keep++] = h;
        else mprotect(page, 4096, PROT_READ);
    }
    emu_smem.hot.resize(keep);
    emu_smem_nhot = (int)keep;
}

// --- one SIGSEGV handler for the pages the emulator watches (here and emu_memory.cpp) --------------
static struct sigaction emu_fault_saved;
static int emu_fault_users = 0;
static void emu_on_fault(int, siginfo_t* si, void*) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(si->si_addr);
    if (emu_smem_fault(a) || emu_gm_fault(a)) return;
    sigaction(SIGSEGV, &emu_fault_saved, nullptr);  // not ours: the store faults again, under the handler before ours
}
void emu_fault_handler(bool install) {
    if (install && emu_fault_users++ == 0) {
        struct sigaction sa;
        std::memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = emu_on_fault;
        sa.sa_flags = SA_SIGINFO | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &emu_fault_saved);
    } else if (!install && --emu_fault_users == 0) {
        sigaction(SIGSEGV, &emu_fault_saved, nullptr);
    }
}

static void emu_fiber_entry() {
    EmuSched& S = *emu_s;
    try {
        S.call();
        emu_hb_flush();  // its last stores: never released now
    } catch (const std::exception& e) {
        if (!S.failed) { S.failed = true; S.msg = e.what(); }
    }
    // leave the block and the warp: barriers now wait for one thread fewer
    S.f[S.cur].state = EMU_DONE;
    --S.live;
    emu_block_arrive_check();
    EmuWarp& w = S.warps[emu_warp];
    --w.live;
    w.live_mask &= ~(1u << emu_lane);
    emu_warp_arrive_check(w);
    emu_ctx_switch(S.f[S.cur].ctx, S.main);  // back to the scheduler; this fiber is never resumed
}

constexpr size_t EMU_STACK = 256 * 1024;
// The stacks are malloc'd 256 KB apart, so their tops, where every fiber switch lands, would all
// fall in the same cache sets and evict each other; each fiber's stack top is moved down by its
// own multiple of 9 cache lines (up to 64 KB), which spreads them over the sets.
static size_t emu_stack_color(int t) { return (size_t)(t % 113) * 576; }
static std::vector<char*> emu_stacks;  // reused by every launch; pages are touched lazily
constexpr int EMU_MAX_FIBERS = 16384;  // threads of all blocks in flight at once

// The current block is the one in slot S: the globals a kernel reads point at its state.
static void emu_enter_slot(EmuSched& S) {
    emu_s = &S;
    emu_slot = S.slot;
    blockIdx = S.block;
    emu_dyn_smem = emu_dyn_smem_buf[S.slot];
}

// Deliver the cp.async copies of block S whose due tick has come (emu_async_due).
static void emu_deliver_due(EmuSched& S) {
    unsigned long long next = EMU_NEVER;
    for (EmuFiber& f : S.f) {
        if (f.pending.empty()) continue;
        size_t k = 0;
        for (const EmuCopy& c : f.pending) {
            if (c.due <= emu_tick) {
                std::memcpy(c.dst, c.src, (size_t)c.src_bytes);
                std::memset(c.dst + c.src_bytes, 0, (size_t)(c.bytes - c.src_bytes));
            } else {
                next = std::min(next, c.due);
                f.pending[k++] = c;
            }
        }
        f.pending.resize(k);
        if (emu_smem_ndirty | emu_smem_nhot) emu_smem_flush((int)(&f - S.f.data()));  // the thread's stores, landed now
    }
    S.next_due = next;
}

// Start block `blk` in slot S: fresh fibers and warps, the slot's shared memory poisoned (0xFF:
// NaN / -1) as far as the launch uses it, its view of global memory (emu_gm_block_start).
static void emu_block_start(EmuSched& S, uint3 blk, int n, size_t smem, const std::vector<char*>& stacks) {
    S.block = blk;
    emu_enter_slot(S);
    S.live = n; S.block_arrived = 0; S.block_gen = 0; S.next_due = EMU_NEVER;
    S.red[0] = S.red[1] = S.red[2] = 0;
    S.lagging = 0; S.stalled = false;
    S.sources = 0; S.floor.clear();
    for (size_t w = 0; w < S.warps.size(); ++w) {
        EmuWarp& wp = S.warps[w];
        wp.live = std::min(32, n - (int)w * 32);
        wp.live_mask = wp.live == 32 ? 0xffffffffu : (1u << wp.live) - 1;
        wp.arrived = 0; wp.arrived_mask = 0; wp.gen = 0;
        wp.xleft[0] = wp.xleft[1] = 0; wp.xuser[0] = wp.xuser[1] = 0;
        std::memset(wp.xgen, 0xFF, sizeof wp.xgen);  // no part from an earlier block counts
    }
    if (emu_smem.on) {  // the slot's buffer and its shadow poisoned alike, then watched again
        auto& hot = emu_smem.hot;  // the slot's pages, written or hot, forgotten: all read-only again below
        hot.erase(std::remove_if(hot.begin(), hot.end(), [&](const EmuSmemHot& h) { return h.slot == S.slot; }),
                  hot.end());
        emu_smem_nhot = (int)hot.size();
        const uintptr_t lo = reinterpret_cast<uintptr_t>(emu_dyn_smem_buf[S.slot]), hi = lo + EMU_DYN_SMEM;
        emu_smem_ndirty = (int)(std::remove_if(emu_smem.dirty, emu_smem.dirty + emu_smem_ndirty,
                                               [&](uintptr_t pg) { return pg >= lo && pg < hi; }) - emu_smem.dirty);
        emu_smem_protect(S.slot, false);
        std::memset(emu_dyn_smem_buf[S.slot], 0xFF, smem);
        std::memset(emu_smem.shadow[S.slot].data(), 0xFF, emu_smem.bytes);
        emu_smem_protect(S.slot, true);
    } else {
        std::memset(emu_dyn_smem_buf[S.slot], 0xFF, smem);
    }
    std::memset(emu_static_smem_buf[S.slot], 0xFF, emu_static_arena[S.slot].top);
    if (emu_hooks.block_begin) emu_hooks.block_begin(n);
    emu_gm_block_start(S.slot, blk.x + (unsigned long long)gridDim.x * (blk.y + (unsigned long long)gridDim.y * blk.z));
    for (int t = 0; t < n; ++t) {
        EmuFiber& f = S.f[t];
        f.tid = {t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
        f.state = EMU_RUN;
        f.pending.clear();
        f.committed = 0;
        f.waiting_on = nullptr;
        f.lag = 0;
        f.kn.clear(); f.epoch = 0; f.source = false;
        emu_ctx_init(f.ctx, stacks[S.slot * n + t], EMU_STACK - emu_stack_color(t), emu_fiber_entry);
    }
}

static bool emu_fiber_ready(const EmuSched& S, int t) {
    const EmuFiber& f = S.f[t];
    return f.state == EMU_RUN || (f.state == EMU_WAIT_BLOCK && f.gen != S.block_gen) ||
           (f.state == EMU_WAIT_WARP && f.gen != S.warps[t / 32].gen) ||
           (f.state == EMU_WAIT_COND && f.waiting_on->ready());
}
// Run fiber t of block S to its next barrier (or its end); then let due async work land.
static void emu_step(EmuSched& S, int t) {
    EmuFiber& f = S.f[t];
    f.state = EMU_RUN;
    S.cur = t; threadIdx = f.tid; emu_lane = t % 32; emu_warp = t / 32;
    emu_ctx_switch(S.main, f.ctx);
    if (emu_smem_ndirty | emu_smem_nhot) emu_smem_flush(t);  // what it stored since it last synchronised
    ++emu_tick;
    if (S.next_due <= emu_tick) emu_deliver_due(S);
    if (emu_hooks.tick) emu_hooks.tick();
}
// One scheduling pass over block S; false if no fiber could move. A pass either steps every ready
// fiber once in a fresh random order, or lets whole warps in a random order run as far as they
// can (to the next __syncthreads or mbarrier wait): one warp a phase ahead. Fibers held back
// (emu_lag) are left out; when nothing else can move, one of them goes on, which one the seed picks
// (always the most recent first would resume the threads held after releasing a slot before a
// publisher held earlier, every time: an early release would never meet the refill).
static bool emu_pass(EmuSched& S, std::vector<int>& order) {
    bool progress = false;
    const int n = (int)S.f.size();
    auto runnable = [&](int t) { return !S.f[t].lag && emu_fiber_ready(S, t); };
    if (emu_pick(2) == 0) {
        std::shuffle(order.begin(), order.end(), emu_rng);
        for (int t : order)
            if (runnable(t)) { emu_step(S, t); progress = true; }
    } else {
        std::vector<int> warps(S.warps.size());
        for (size_t w = 0; w < warps.size(); ++w) warps[w] = (int)w;
        std::shuffle(warps.begin(), warps.end(), emu_rng);
        for (int w : warps) {
            const int lo = 32 * w, hi = std::min(n, lo + 32);
            for (bool moved = true; moved && !S.failed;) {
                moved = false;
                const unsigned r = emu_pick(32);  // lanes start from a random one
                for (int i = 0; i < hi - lo; ++i) {
                    const int t = lo + (int)((i + r) % (unsigned)(hi - lo));
                    if (runnable(t)) { emu_step(S, t); moved = progress = true; }
                }
            }
        }
    }
    if (progress || S.lagging == 0) return progress;
    int held = 0, pick = -1;
    for (int t = 0; t < n; ++t)  // one of the ready held fibers, uniformly (reservoir sampling)
        if (S.f[t].lag && emu_fiber_ready(S, t) && emu_pick((unsigned)++held) == 0) pick = t;
    if (pick < 0) return false;
    S.f[pick].lag = 0;
    --S.lagging;
    emu_step(S, pick);
    return true;
}

static std::string emu_waits(const EmuSched& S) {
    std::string why;  // what EMU_WAIT_COND fibers wait for, each kind once
    for (const EmuFiber& g : S.f)
        if (g.state == EMU_WAIT_COND && why.find(g.waiting_on->what()) == std::string::npos)
            why += "; " + g.waiting_on->what();
    return why;
}
static std::string emu_block_name(uint3 b) {
    return "(" + std::to_string(b.x) + "," + std::to_string(b.y) + "," + std::to_string(b.z) + ")";
}
static std::string emu_deadlock(const EmuSched& S) {
    return "deadlock in block " + emu_block_name(S.block) + ": threads wait at a barrier that other threads of the "
           "block or warp never reach" + emu_waits(S);
}
// A pass of S moved nothing: a deadlock of the block, unless a thread waits for another block.
static bool emu_waits_for_another_block(const EmuSched& S) {
    for (const EmuFiber& g : S.f)
        if (g.state == EMU_WAIT_COND && g.waiting_on->global()) return true;
    return false;
}

// The launch (emu_runtime.h says what it does).
int emu_launch_erased(void (*run)(const void*), const void* kernel, dim3 g, dim3 b, size_t smem,
                      char* err, int errlen, unsigned long long seed, const unsigned long long* regions,
                      int nregions, int paged, int capacity, const EmuHooks& hooks) {
    gridDim = g; blockDim = b;
    emu_hooks = hooks;
    const int n = (int)(b.x * b.y * b.z);
    if (smem > EMU_DYN_SMEM) {
        std::snprintf(err, errlen, "dynamic shared memory %zu B exceeds 228 KB", smem);
        return 1;
    }
    emu_dyn_smem_bytes = smem;
    emu_rng.seed(seed);
    emu_tick = 0;
    const unsigned long long nblocks = (unsigned long long)g.x * g.y * g.z;
    const int max_slots = std::max(1, std::min({capacity, EMU_MAX_SLOTS, EMU_MAX_FIBERS / n}));
    int slots = 1 + (int)emu_pick(EMU_START_SLOTS);
    slots = (int)std::min<unsigned long long>({(unsigned long long)slots, nblocks, (unsigned long long)max_slots});
    // block order: 0 grid order, 1 reversed, 2 shuffled (grids of at most 2^20 blocks)
    const unsigned order_kind = emu_pick(nblocks <= (1u << 20) ? 3 : 2);
    std::vector<unsigned> perm;
    if (order_kind == 2) {
        perm.resize(nblocks);
        for (unsigned i = 0; i < nblocks; ++i) perm[i] = i;
        std::shuffle(perm.begin(), perm.end(), emu_rng);
    }
    auto block_of = [&](unsigned long long i) {
        const unsigned long long j = order_kind == 0 ? i : order_kind == 1 ? nblocks - 1 - i : perm[i];
        return uint3{(unsigned)(j % g.x), (unsigned)(j / g.x % g.y), (unsigned)(j / ((unsigned long long)g.x * g.y))};
    };
    emu_gm_begin(regions, nregions, paged != 0);
    emu_smem.on = hooks.smem_store != nullptr;
    emu_smem.bytes = emu_smem.on ? (smem + 4095) / 4096 * 4096 : 0;
    emu_smem_ndirty = emu_smem_nhot = 0;
    emu_smem.hot.clear();
    if (emu_smem.on) emu_fault_handler(true);
    std::vector<EmuSched> S;
    S.reserve(max_slots);  // fibers hold references into it: never reallocated
    auto call = [run, kernel] { run(kernel); };
    std::vector<int> order(n);
    for (int t = 0; t < n; ++t) order[t] = t;
    std::vector<int> active;
    unsigned long long next_block = 0;
    auto add_slot = [&] {
        const int s = (int)S.size();
        S.emplace_back();
        S[s].slot = s;
        S[s].f.resize(n);
        S[s].warps.resize((n + 31) / 32);
        S[s].call = call;
        // Poison the whole dynamic buffer: a read of shared memory nobody wrote sees NaN / -1, and a
        // write past the `smem` bytes the host launched with is reported after the launch.
        std::memset(emu_dyn_smem_buf[s], 0xFF, EMU_DYN_SMEM);
        emu_static_arena[s] = {};
        if (emu_smem.on) {
            if (emu_smem.shadow.size() <= (size_t)s) emu_smem.shadow.resize(s + 1);
            emu_smem.shadow[s].assign(emu_smem.bytes, 0xFF);
        }
        while ((int)emu_stacks.size() < (s + 1) * n) emu_stacks.push_back((char*)std::malloc(EMU_STACK));
        emu_block_start(S[s], block_of(next_block++), n, smem, emu_stacks);
        active.push_back(s);
    };
    for (int s = 0; s < slots; ++s) add_slot();
    std::string fail;
    std::vector<int> can;
    while (!active.empty() && fail.empty()) {
        can.clear();
        for (int s : active)
            if (!S[s].stalled || S[s].stall_gen != emu_gm.gen) can.push_back(s);
        if (can.empty()) {  // every block in flight waits for another block
            if (next_block < nblocks && (int)S.size() < max_slots) { add_slot(); continue; }
            fail = "deadlock: every block in flight waits for a value another block must write";
            for (int s : active) {
                emu_enter_slot(S[s]);  // what() of an mbarrier wait reads its block's Hopper state
                fail += "; block " + emu_block_name(S[s].block) + emu_waits(S[s]);
            }
            if (next_block < nblocks)
                fail += "; the grid's other " + std::to_string(nblocks - next_block) + " blocks cannot start: the "
                        "emulated device holds " + std::to_string(max_slots) + " resident blocks of " +
                        std::to_string(n) + " threads (its SMs, one block each; CUPYATTN_EMU_SMS sets them), and a "
                        "kernel whose blocks wait on each other needs all of them resident";
            break;
        }
        EmuSched& B = S[can[emu_pick((unsigned)can.size())]];
        emu_enter_slot(B);
        emu_gm_switch(B.slot);
        const bool progress = emu_pass(B, order);
        if (B.failed) { fail = B.msg; break; }
        if (B.live > 0) {
            B.stalled = !progress;
            B.stall_gen = emu_gm.gen;
            if (!progress && !emu_waits_for_another_block(B)) fail = emu_deadlock(B);
            continue;
        }
        if (emu_hooks.block_end) {
            const std::string e = emu_hooks.block_end();
            if (!e.empty()) { fail = e; break; }
        }
        emu_gm_block_end(B.slot);
        if (next_block < nblocks) emu_block_start(B, block_of(next_block++), n, smem, emu_stacks);
        else active.erase(std::find(active.begin(), active.end(), B.slot));
    }
    emu_gm_end();
    if (emu_smem.on) {
        for (size_t s = 0; s < S.size(); ++s) emu_smem_protect((int)s, false);
        emu_fault_handler(false);
        emu_smem.on = false;
        emu_smem.bytes = 0;
        emu_smem_ndirty = emu_smem_nhot = 0;
        emu_smem.hot.clear();
    }
    emu_s = nullptr;
    emu_hooks = EmuHooks();
    if (!fail.empty()) { std::snprintf(err, errlen, "%s", fail.c_str()); return 1; }
    for (size_t s = 0; s < S.size(); ++s)
        for (size_t i = smem; i < EMU_DYN_SMEM; ++i)
            if (emu_dyn_smem_buf[s][i] != 0xFF) {
                std::snprintf(err, errlen, "wrote dynamic shared memory at byte %zu, past the %zu B the launch "
                              "asked for (shared_mem=)", i, smem);
                return 1;
            }
    return 0;
}
