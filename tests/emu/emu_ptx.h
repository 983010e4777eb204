// emu_ptx.h: the functions of kernels_cu/ptx.cuh for the CPU emulator, written from the PTX ISA's
// definitions. fakecupy swaps the inlined ptx.cuh for this file; kernels call the same names.
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
//   - ldmatrix and mma.sync are warp-collective (.aligned): the 32 lanes meet at the same one.
#pragma once

inline unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

inline void emu_check_align(const void* p, int n, const char* what) {
    if ((uintptr_t)p % (uintptr_t)n)
        throw std::runtime_error(std::string(what) + ": address not aligned to " + std::to_string(n) + " bytes");
}

// --- cp.async ----------------------------------------------------------------------------------
template <int BYTES>
inline void cp_async_zfill(void* smem, const void* gmem, int src_bytes) {
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

template <int BYTES>
inline void cp_async(void* smem, const void* gmem) { cp_async_zfill<BYTES>(smem, gmem, BYTES); }

// Close the group of copies issued since the last commit (group ids count commits).
inline void cp_async_commit() { ++emu_s->f[emu_s->cur].committed; }

// Deliver every copy of the committed groups except the N most recent.
template <int N>
inline void cp_async_wait() {
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
    static_assert(NUM == 1 || NUM == 2 || NUM == 4, "ldmatrix loads 1, 2 or 4 matrices");
    EmuWarp& w = emu_s->warps[emu_warp];
    if (emu_lane < 8 * NUM) emu_check_align(smem, 16, "ldmatrix row address");
    w.xchg[emu_lane][8] = smem_u32(smem);
    emu_warp_barrier(0xffffffffu, -1, "ldmatrix");
    const int g = emu_lane / 4, t = emu_lane % 4;
    unsigned vals[NUM];
    for (int i = 0; i < NUM; ++i) {
        if (!TRANS) {
            std::memcpy(&vals[i], emu_shared_ptr(w.xchg[8 * i + g][8]) + 4 * t, 4);
        } else {
            uint16_t lo, hi;
            std::memcpy(&lo, emu_shared_ptr(w.xchg[8 * i + 2 * t][8]) + 2 * g, 2);
            std::memcpy(&hi, emu_shared_ptr(w.xchg[8 * i + 2 * t + 1][8]) + 2 * g, 2);
            vals[i] = (unsigned)lo | ((unsigned)hi << 16);
        }
    }
    emu_warp_barrier(0xffffffffu, -1, "ldmatrix");  // every lane has read the addresses before any publishes new ones
    for (int i = 0; i < NUM; ++i) r[i] = vals[i];
}

// --- mma.sync.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 -----------------------------------
// d = A (16x16) B (16x8) + d, g = lane/4, t = lane%4: a0 = A[g][2t..2t+1], a1 = A[g+8][2t..],
// a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]; b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g];
// d0,d1 = [g][2t..2t+1], d2,d3 = [g+8][2t..2t+1]. Products are exact in float32 (11- or 8-bit
// significands); the sum is taken in float32, in k order.
inline float emu_b16(unsigned bits, __half) { return __half2float(__half{(uint16_t)bits}); }
inline float emu_b16(unsigned bits, __nv_bfloat16) { return __bfloat162float(__nv_bfloat16{(uint16_t)bits}); }

template <typename T>
inline void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "mma.sync: f16 or bf16");
    EmuWarp& w = emu_s->warps[emu_warp];
    for (int i = 0; i < 4; ++i) w.xchg[emu_lane][i] = a[i];
    for (int i = 0; i < 2; ++i) w.xchg[emu_lane][4 + i] = b[i];
    emu_warp_barrier(0xffffffffu, -2, "mma.sync");
    float A[16][16], B[16][8];
    for (int src = 0; src < 32; ++src) {
        const int g = src / 4, t = src % 4;
        const unsigned* ra = w.xchg[src];
        const unsigned* rb = w.xchg[src] + 4;
        for (int h = 0; h < 2; ++h) {
            A[g][2 * t + h] = emu_b16(ra[0] >> (16 * h) & 0xffff, T());
            A[g + 8][2 * t + h] = emu_b16(ra[1] >> (16 * h) & 0xffff, T());
            A[g][2 * t + 8 + h] = emu_b16(ra[2] >> (16 * h) & 0xffff, T());
            A[g + 8][2 * t + 8 + h] = emu_b16(ra[3] >> (16 * h) & 0xffff, T());
            B[2 * t + h][g] = emu_b16(rb[0] >> (16 * h) & 0xffff, T());
            B[2 * t + 8 + h][g] = emu_b16(rb[1] >> (16 * h) & 0xffff, T());
        }
    }
    emu_warp_barrier(0xffffffffu, -2, "mma.sync");  // nobody overwrites xchg before all have read it
    const int g = emu_lane / 4, t = emu_lane % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
        float acc = d[i];
        for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
        d[i] = acc;
    }
}

// --- programmatic dependent launch ------------------------------------------------------------
// The emulator runs launches one after another, so the previous kernel has always completed:
// both are no-ops, as they are on a GPU for a launch without the PDL attribute.
inline void pdl_wait() {}
inline void pdl_launch_dependents() {}
