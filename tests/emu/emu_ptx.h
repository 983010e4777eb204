// emu_ptx.h: the instruction wrappers of kernels_cu/ptx_insn.cuh for the CPU emulator, written from
// the PTX ISA's definitions. fakecupy swaps the inlined ptx_insn.cuh for this file and keeps
// ptx.cuh (the arch-aware helpers the kernels call), so ptx.cuh's Turing branches run here too.
//
// Targets: fakecupy defines __CUDA_ARCH__ from the emulated device (CUPYATTN_EMU_ARCH, default
// 90); each wrapper refuses, as ptx_insn.cuh does under NVRTC, a target the ISA does not allow
// it on, so a kernel built for sm_75 that reaches an sm_80-only instruction fails to build here.
//
// What the emulation checks that a synchronous copy would not:
//   - cp.async copies land at a moment the seeded schedule picks (emu_async_due): at issue, at a
//     scheduling point before the wait, or at the cp.async.wait_group that retires their group
//     (the latest moment allowed); a destination not written at issue is poisoned (0xFF) or keeps
//     its old bytes until then. A kernel that reads a stage before waiting for it, before the
//     barrier after another thread's wait, or refills a stage other threads may still read, reads
//     wrong shared memory under some schedule and fails its test; copies never retired by a wait
//     are dropped at the end of the thread;
//   - alignment: cp.async needs both addresses aligned to its size, ldmatrix 16-byte rows, as a
//     GPU does (it faults on a misaligned address);
//   - ldmatrix and mma.sync are warp-collective (.aligned): the 32 lanes meet at the same one;
//   - the counters between blocks (signal_release, wait_acquire, ...) with the release / acquire
//     semantics of the memory model emu_memory.h emulates.
#pragma once

#if defined(CUPYATTN_TARGET_SM)
#define PTX_SM CUPYATTN_TARGET_SM
#elif defined(__CUDA_ARCH__)
#define PTX_SM __CUDA_ARCH__
#else
#error "emu_ptx.h: fakecupy defines __CUDA_ARCH__ for the emulated device"
#endif

template <int NEED, typename Dep>
constexpr bool ptx_sm_at_least() { return PTX_SM >= NEED && sizeof(Dep) > 0; }

template <typename T> struct ptx_mma_type { enum { f16 = 0, bf16 = 0 }; };
template <> struct ptx_mma_type<__half> { enum { f16 = 1, bf16 = 0 }; };
template <> struct ptx_mma_type<__nv_bfloat16> { enum { f16 = 0, bf16 = 1 }; };

inline unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// --- %globaltimer: here the launch's scheduling tick, a clock every block of the launch shares -----
inline unsigned long long globaltimer_ns() { return emu_tick; }

inline void emu_check_align(const void* p, int n, const char* what) {
    if ((uintptr_t)p % (uintptr_t)n)
        throw std::runtime_error(std::string(what) + ": address not aligned to " + std::to_string(n) + " bytes");
}

// --- cp.async ----------------------------------------------------------------------------------
template <int BYTES>
inline void cp_async_sm80(void* smem, const void* gmem, int src_bytes) {
    static_assert(ptx_sm_at_least<800, char[BYTES]>(), "cp.async requires sm_80 or higher");
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
    emu_check_align(smem, BYTES, "cp.async shared destination");
    if (src_bytes > 0) emu_check_align(gmem, BYTES, "cp.async global source");
    if (src_bytes < 0 || src_bytes > BYTES) throw std::runtime_error("cp.async: src-size outside [0, cp-size]");
    EmuFiber& f = emu_s->f[emu_s->cur];
    const EmuCopy c{(unsigned char*)smem, (const unsigned char*)gmem, BYTES, src_bytes, f.committed, emu_async_due()};
    if (c.due == 0) {  // lands at issue
        std::memcpy(c.dst, c.src, (size_t)c.src_bytes);
        std::memset(c.dst + c.src_bytes, 0, (size_t)(c.bytes - c.src_bytes));
        return;
    }
    if (emu_pick(2)) std::memset(c.dst, 0xFF, BYTES);  // in flight: poison, or the old bytes
    f.pending.push_back(c);
    emu_s->next_due = std::min(emu_s->next_due, c.due);
}

// Close the group of copies issued since the last commit (group ids count commits).
template <int DUMMY = 0>
inline void cp_async_commit_sm80() {
    static_assert(ptx_sm_at_least<800, char[DUMMY + 1]>(), "cp.async.commit_group requires sm_80 or higher");
    ++emu_s->f[emu_s->cur].committed;
}

// Deliver every copy of the committed groups except the N most recent.
template <int N>
inline void cp_async_wait_sm80() {
    static_assert(ptx_sm_at_least<800, char[N + 1]>(), "cp.async.wait_group requires sm_80 or higher");
    EmuFiber& f = emu_s->f[emu_s->cur];
    const int done_below = f.committed - N;  // groups with id < done_below must be complete
    std::vector<EmuCopy> keep;
    for (const EmuCopy& c : f.pending) {
        if (c.group < done_below) {
            std::memcpy(c.dst, c.src, (size_t)c.src_bytes);
            std::memset(c.dst + c.src_bytes, 0, (size_t)(c.bytes - c.src_bytes));
        } else {
            keep.push_back(c);
        }
    }
    f.pending.swap(keep);
}

// --- ldmatrix ----------------------------------------------------------------------------------
// Lanes 8i..8i+7 give the row addresses of matrix i. Without TRANS lane l receives (row l/4,
// cols 2(l%4), 2(l%4)+1) of matrix i in r[i]; with TRANS (rows 2(l%4), 2(l%4)+1, col l/4).
template <int NUM, bool TRANS = false>
inline void ldmatrix(unsigned (&r)[NUM], const void* smem) {
    static_assert(ptx_sm_at_least<750, char[NUM]>(), "ldmatrix requires sm_75 or higher");
    static_assert(NUM == 1 || NUM == 2 || NUM == 4, "ldmatrix loads 1, 2 or 4 matrices");
    EmuWarp& w = emu_s->warps[emu_warp];
    if (emu_lane < 8 * NUM) emu_check_align(smem, 16, "ldmatrix row address");
    const unsigned b = emu_xchg_begin(w);
    const auto& x = w.xchg[b];
    w.xchg[b][emu_lane][8] = smem_u32(smem);
    emu_warp_barrier(0xffffffffu, -1, "ldmatrix");
    const int g = emu_lane / 4, t = emu_lane % 4;
    for (int i = 0; i < NUM; ++i) {
        if (!TRANS) {
            std::memcpy(&r[i], emu_shared_ptr(x[8 * i + g][8]) + 4 * t, 4);
        } else {
            uint16_t lo, hi;
            std::memcpy(&lo, emu_shared_ptr(x[8 * i + 2 * t][8]) + 2 * g, 2);
            std::memcpy(&hi, emu_shared_ptr(x[8 * i + 2 * t + 1][8]) + 2 * g, 2);
            r[i] = (unsigned)lo | ((unsigned)hi << 16);
        }
    }
    emu_xchg_end(w, b);
}

// --- mma.sync.m16n8k{8,16}.row.col.f32.{f16,bf16}.{f16,bf16}.f32 -------------------------------
// d = A (16xK) B (Kx8) + d, g = lane/4, t = lane%4. K = 16: a0 = A[g][2t..2t+1], a1 = A[g+8][2t..],
// a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]; b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]. K = 8: a0,
// a1 and b0 only. d0,d1 = [g][2t..2t+1], d2,d3 = [g+8][2t..2t+1]. Products are exact in float32
// (11- or 8-bit significands); the sum is taken in float32, in k order.
inline float emu_b16(unsigned bits, __half) { return __half2float(__half{(uint16_t)bits}); }
inline float emu_b16(unsigned bits, __nv_bfloat16) { return __bfloat162float(__nv_bfloat16{(uint16_t)bits}); }

template <typename T, int K>
inline void emu_mma(float (&d)[4], const unsigned* a, const unsigned* b) {
    static_assert(ptx_mma_type<T>::f16 || ptx_mma_type<T>::bf16, "mma.sync: f16 or bf16");
    EmuWarp& w = emu_s->warps[emu_warp];
    const unsigned x = emu_xchg_begin(w);
    for (int i = 0; i < K / 4; ++i) w.xchg[x][emu_lane][i] = a[i];
    for (int i = 0; i < K / 8; ++i) w.xchg[x][emu_lane][4 + i] = b[i];
    emu_warp_barrier(0xffffffffu, -2, "mma.sync");
    float A[16][16], B[16][8];
    for (int src = 0; src < 32; ++src) {
        const int g = src / 4, t = src % 4;
        const unsigned* ra = w.xchg[x][src];
        const unsigned* rb = w.xchg[x][src] + 4;
        for (int h = 0; h < 2; ++h) {
            A[g][2 * t + h] = emu_b16(ra[0] >> (16 * h) & 0xffff, T());
            A[g + 8][2 * t + h] = emu_b16(ra[1] >> (16 * h) & 0xffff, T());
            B[2 * t + h][g] = emu_b16(rb[0] >> (16 * h) & 0xffff, T());
            if (K == 16) {
                A[g][2 * t + 8 + h] = emu_b16(ra[2] >> (16 * h) & 0xffff, T());
                A[g + 8][2 * t + 8 + h] = emu_b16(ra[3] >> (16 * h) & 0xffff, T());
                B[2 * t + 8 + h][g] = emu_b16(rb[1] >> (16 * h) & 0xffff, T());
            }
        }
    }
    emu_xchg_end(w, x);
    const int g = emu_lane / 4, t = emu_lane % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
        float acc = d[i];
        for (int k = 0; k < K; ++k) acc += A[row][k] * B[k][col];
        d[i] = acc;
    }
}

template <typename T>
inline void mma_m16n8k8(float (&d)[4], const unsigned (&a)[2], const unsigned (&b)[1]) {
    if constexpr (ptx_mma_type<T>::f16)
        static_assert(ptx_sm_at_least<750, T>(), "mma.sync.m16n8k8.f16 requires sm_75 or higher");
    else
        static_assert(ptx_sm_at_least<800, T>(), "mma.sync with bf16 inputs requires sm_80 or higher");
    emu_mma<T, 8>(d, a, b);
}

template <typename T>
inline void mma_m16n8k16_sm80(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    static_assert(ptx_sm_at_least<800, T>(), "mma.sync.m16n8k16 requires sm_80 or higher");
    emu_mma<T, 16>(d, a, b);
}

// --- griddepcontrol ---------------------------------------------------------------------------
// The emulator runs launches one after another, so the previous kernel has always completed:
// both are no-ops, as they are on a GPU for a launch without the PDL attribute.
template <int DUMMY = 0>
inline void griddepcontrol_wait() {
    static_assert(ptx_sm_at_least<900, char[DUMMY + 1]>(), "griddepcontrol requires sm_90 or higher");
}
template <int DUMMY = 0>
inline void griddepcontrol_launch_dependents() {
    static_assert(ptx_sm_at_least<900, char[DUMMY + 1]>(), "griddepcontrol requires sm_90 or higher");
}

// --- counters between blocks (the model: emu_memory.h) -------------------------------
// The same six functions as ptx_insn.cuh, with the semantics the PTX ISA gives them: a release
// publishes the block's stores, an acquire makes visible the releases its strong reads observed;
// wait_acquire parks the thread until the counter's latest value reaches the target, so other
// blocks run (and start, up to the device's resident blocks) meanwhile.
inline void signal_release(unsigned* counter, unsigned inc) {
    emu_gm_rmw(counter, [inc](unsigned o) { return o + inc; }, EMU_RELEASE, "signal_release", true);
}
inline unsigned load_acquire(const unsigned* p) { return emu_gm_load(p, EMU_ACQUIRE, "load_acquire"); }
inline void wait_acquire(const unsigned* counter, unsigned target, unsigned /*max_ns: the backoff, not modelled*/ = 1024u) {
    EmuCounterWait w(counter, emu_gm_strong_index(counter, sizeof(unsigned), "wait_acquire", false), target);
    emu_wait_until(w);
    emu_gm_load(counter, EMU_ACQUIRE, "wait_acquire");  // the read that saw it, then the acquire
}
inline unsigned atomic_add_relaxed(unsigned* p, unsigned v) {
    return emu_gm_rmw(p, [v](unsigned o) { return o + v; }, EMU_RELAXED, "atomic_add_relaxed", true);
}
inline unsigned atomic_add_acq_rel(unsigned* p, unsigned v) {
    return emu_gm_rmw(p, [v](unsigned o) { return o + v; }, EMU_ACQ_REL, "atomic_add_acq_rel", true);
}
inline void fence_acq_rel_gpu() { emu_gm_fence(); }
