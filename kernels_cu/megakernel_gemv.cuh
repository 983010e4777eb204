// megakernel_gemv.cuh: the matrix-vector instructions of the megakernel (megakernel.cu) and the
// weight stream that feeds them.
//
//   opcode         rows of W (a 16-row tile t)              x rows (B of them)    epilogue
//   MK_OP_QKV      Wqkv: 8 rotation pairs of head h          rmsnorm(x, attn_norm) RoPE; q -> q buffer,
//                  (adjacent: rows hD+16j..+15; NeoX: hD+8j..+7                    k, v -> cache row
//                  and hD+D/2+8j..+7), t = h * D/16 + j                            lengths[b]
//   MK_OP_OPROJ    Wo rows 16r..16r+15, columns of chunk c   att (heads merged)    x += C, or C -> slot c
//   MK_OP_GATE_UP  gate rows 8t..+7, up rows F+8t..+7        rmsnorm(x, ffn_norm)  ffn = silu(g) * u
//                  (n sub-tiles, arg0 >> 4 = n > 1: the 8n rows from 8nt, as n tiles in turn)
//   MK_OP_DOWN     Wdown rows 16r..16r+15, columns of chunk c ffn                  x += C, or C -> slot KO + c
//   MK_OP_LM_HEAD  output rows 16t..16t+15 (the tied         rmsnorm(x, out_norm)  logits = C
//                  embedding when tied)
//
// Split projections (the op list's deps="fine"; instruction words as megakernel.cu's table): an
// O or down projection of kc column chunks has tiles t = r * kc + c, each the product of rows
// 16r.. with the columns of chunk c only, written in float32 to partial slot c (O: the kv head c's
// heads) or KO + c (down) of part[layer & 1] instead of added to x. The loaders that read the
// residual after them sum the slots in a fixed order (gemv_compose_rows: no atomics, the same sum
// on any number of blocks): mode 1 (gate|up of layer s) x' = T(x_s + T(sum of the O slots)); mode 2 (QKV
// of layer s + 1, the LM head) T(x' + T(sum of the down slots)), which the QKV tile 0 of layer s + 1
// also stores as x_{s+1} (buffer (s + 1) & 1 of x, xalt). The rounding is the fused step's, the
// float32 sums in another order. With the merge flag the O projection's input is the split
// attention's partials merged as they load (mk_merge_rows, as the reduce op merges), no att rows.
//
// Every rounding of the fused step (fused_decode.cu) is kept: the normalised rows are
// T(x * inv_rms * w) as rmsnorm writes them, C is rounded to T before RoPE / the residual add /
// SwiGLU, and each epilogue computes in float32. The products run on CUDA cores (float FMAs, one
// per weight element and row): at batch <= 8 a tensor-core tile would pad the 1-8 rows to 16, and
// 8 FMAs per weight element (about 37 us per SmolLM2 step at an H100's FP32 rate, against 90 us
// to read the weights) stay under the weight stream. Not yet run on a GPU: no measurement chose it.
//
// The weight stream (WeightStream): a block's GEMV instructions, in queue order, are one sequence
// of chunks, each 16 rows x MK_CHUNK_BYTES of W (8 KB), moved by cp.async into a ring of MK_STAGES
// slots that stays MK_STAGES - 1 chunks ahead of the math. Weights do not depend on activations, so
// the next instruction's first chunks are in flight while this one computes and while the block
// waits for the counters of the next: the wait hides the weight latency instead of adding to it.
// Ring protocol (as decode.cu's K/V ring): consuming chunk c waits until at most MK_STAGES - 2 copy
// groups are pending (chunk c has landed), a barrier (every thread's copies visible, every thread
// done with chunk c - 1), then the chunk MK_STAGES - 1 ahead goes into chunk c - 1's slot.
#pragma once
#include "common.cuh"
#include "ptx.cuh"
#include "rope.cuh"

// The geometry (cupyattn/megakernel.py GEOMETRY: MK_TILE_ROWS, MK_GATE_UP_ROWS, MK_CHUNK_BYTES) and
// what this file's code assumes of it: warp w owns tile rows 2w and 2w + 1, a gate|up tile is its
// two 8-row groups, a QKV tile 8 rotation pairs, a chunk a 16-byte vector per lane.
static_assert(MK_TILE_ROWS == 2 * MK_WARPS, "a GEMV tile is a row pair per warp");
static_assert(MK_GATE_UP_ROWS * 2 == MK_TILE_ROWS && MK_GATE_UP_ROWS == 8, "gate|up and QKV tiles are two groups of 8 rows");
static_assert(MK_CHUNK_BYTES == 32 * 16, "a weight chunk row is one 16-byte vector per lane");
#define MK_STAGE_BYTES (MK_TILE_ROWS * MK_CHUNK_BYTES)
// the loaders' input (GemvTile::src)
#define MK_SRC_PLAIN 0    // rows of x / att / ffn as they are
#define MK_SRC_COMPOSE 1  // the residual summed from a buffer and partial slots (mode 1 or 2)
#define MK_SRC_MERGE 2    // attention rows merged from the split partials

__device__ __forceinline__ bool mk_is_gemv(int op) {
    return op == MK_OP_QKV || op == MK_OP_OPROJ || op == MK_OP_GATE_UP || op == MK_OP_DOWN || op == MK_OP_LM_HEAD;
}

// --- what a GEMV instruction reads --------------------------------------------------------------
// Weight tile: rows row[g] .. row[g] + 7 of w (row stride wld, K columns used) for groups g = 0, 1
// (tile rows 8g .. 8g + 7), rows at or past end[g] read as zero. Input: x rows [B, K] at stride ld
// (src MK_SRC_PLAIN), normalised with norm (or not: null); col0 the first column of a chunk.
// Compose: mode 1/2, parity par of the slots and the source buffer, ko + kd slots, the loaded
// rows stored to xdst as well when not null. Epilogue: slot >= 0 writes C to that partial slot.
template <typename T>
struct GemvTile {
    const T* w;
    const T* x;
    const T* norm;
    T* xdst;
    int K, wld, ld, row[2], end[2], nchunks, src, mode, par, ko, kd, col0, slot, nsub;
};

// A gate|up instruction of n sub-tiles (arg0 >> 4 = n) runs as n tiles in turn: sub-tile s is the
// tile n t + s with the input mode alone in arg0 (every other instruction: itself).
__device__ __forceinline__ int mk_subtiles(const MkIns& ins) {
    return ins.op == MK_OP_GATE_UP ? max(1, ins.arg0 >> 4) : 1;
}
__device__ __forceinline__ MkIns mk_subtile(const MkIns& ins, int s) {
    MkIns r = ins;
    if (ins.op == MK_OP_GATE_UP) {
        r.tile = ins.tile * mk_subtiles(ins) + s;
        r.arg0 = ins.arg0 & 15;
    }
    return r;
}

template <typename T>
__device__ __forceinline__ GemvTile<T> gemv_tile(const MkModel& m, const MkState& st, const MkIns& ins) {
    constexpr int CH = MK_CHUNK_BYTES / sizeof(T);  // elements of a row per chunk
    const MkLayer* L = m.layers + ins.layer;
    const int t = ins.tile, dim = (int)m.dim, qd = (int)(m.Hq * m.D), F = (int)m.F;
    GemvTile<T> g;
    g.norm = nullptr;
    g.xdst = nullptr;
    g.src = MK_SRC_PLAIN;
    g.mode = 0;
    g.col0 = 0;
    g.slot = -1;
    g.ko = ins.arg1 & 255;
    g.kd = (ins.arg1 >> 8) & 255;
    g.nsub = mk_subtiles(ins);
    const int a0 = ins.op == MK_OP_GATE_UP ? ins.arg0 & 15 : ins.arg0;  // the input mode
    const int high = ins.arg1 >> 16;
    g.row[0] = MK_TILE_ROWS * t;
    g.row[1] = MK_TILE_ROWS * t + 8;
    if (ins.op == MK_OP_QKV) {
        const int D = (int)m.D, h = t / (D / 16), j = t % (D / 16);
        g.w = (const T*)L->wqkv; g.x = (const T*)st.x; g.norm = (const T*)L->attn_norm; g.K = dim; g.ld = dim;
        g.row[0] = h * D + (m.neox ? 8 * j : 16 * j);
        g.row[1] = m.neox ? h * D + D / 2 + 8 * j : g.row[0] + 8;
        g.end[0] = g.end[1] = (int)((m.Hq + 2 * m.Hkv) * m.D);
    } else if (ins.op == MK_OP_OPROJ || ins.op == MK_OP_DOWN) {
        // tile t = r * kc + c: rows 16r.., columns [c K, (c + 1) K) of the kc chunks
        const int kc = ins.arg0 > 1 ? ins.arg0 : 1, r = t / kc, c = t % kc, width = ins.op == MK_OP_OPROJ ? qd : F;
        g.K = width / kc;
        g.col0 = c * g.K;
        g.w = (const T*)(ins.op == MK_OP_OPROJ ? L->wo : L->w_down) + g.col0;
        g.x = (const T*)(ins.op == MK_OP_OPROJ ? st.att : st.ffn) + g.col0;
        g.ld = width;
        g.wld = width;
        g.row[0] = MK_TILE_ROWS * r;
        g.row[1] = MK_TILE_ROWS * r + 8;
        g.end[0] = g.end[1] = dim;
        if (ins.op == MK_OP_OPROJ && (high & 1)) g.src = MK_SRC_MERGE;
        if (high & 2) g.slot = ins.op == MK_OP_OPROJ ? c : g.ko + c;
        g.par = ins.layer & 1;
    } else if (ins.op == MK_OP_GATE_UP) {
        g.w = (const T*)L->w_gate_up; g.x = (const T*)st.x; g.norm = (const T*)L->ffn_norm; g.K = dim; g.ld = dim;
        g.row[0] = 8 * g.nsub * t; g.row[1] = F + 8 * g.nsub * t;  // sub-tile 0's (the stream: all)
        g.end[0] = F; g.end[1] = 2 * F;
    } else {  // MK_OP_LM_HEAD
        g.w = (const T*)m.out_w; g.x = (const T*)st.x; g.norm = (const T*)m.out_norm; g.K = dim; g.ld = dim;
        g.end[0] = g.end[1] = (int)m.V;
    }
    if (ins.op != MK_OP_OPROJ && ins.op != MK_OP_DOWN) {
        g.wld = g.K;
        if (a0 > 0) {  // the residual composed from a buffer and the partial slots of layer `high`
            g.src = MK_SRC_COMPOSE;
            g.mode = a0;
            g.par = high & 1;
            g.x = (const T*)(g.par ? st.xalt : st.x);
            if (ins.op == MK_OP_QKV && a0 == 2 && t == 0) g.xdst = (T*)(g.par ? st.x : st.xalt);
        }
    }
    g.nchunks = (g.K + CH - 1) / CH;
    return g;
}

// --- the weight stream --------------------------------------------------------------------------
template <typename T>
struct WeightRows {
    const T* w;
    int wld, K, row[2], end[2], nchunks, per;  // per: chunks of one sub-tile (the next sub-tile's rows: + 8)
};

// Every thread of the block holds the same copy (uniform control flow). `row` is the next queue
// row to look at for the issue side, `sub` the next chunk of `tile` to issue.
template <typename T>
struct WeightStream {
    const MkModel& m;
    const MkState& st;
    const int* instr;
    unsigned char* ring;  // smem [MK_STAGES][MK_TILE_ROWS][MK_CHUNK_BYTES]
    int row, end, sub, issued, consumed;
    WeightRows<T> tile;  // what the issue side needs of the current tile (the stream lives across the
                         // whole queue: a slim copy keeps its registers few)

    __device__ WeightStream(const MkModel& m_, const MkState& st_, const int* instr_, int q0, int q1,
                            unsigned char* ring_)
        : m(m_), st(st_), instr(instr_), ring(ring_), row(q0), end(q1), sub(0), issued(0), consumed(0) {
        tile.nchunks = 0;
        for (int s = 0; s < MK_STAGES - 1; ++s) issue_one();  // prologue: the first chunks in flight
    }

    // The next chunk of the block's GEMV sequence into slot issued % MK_STAGES (one commit group
    // per call, empty once the sequence is exhausted, so the group count stays what the wait in
    // next() assumes).
    __device__ void issue_one() {
        constexpr int VEC = 16 / sizeof(T), CH = MK_CHUNK_BYTES / sizeof(T);
        while (sub >= tile.nchunks && row < end) {
            const MkIns ins = mk_ins(instr, row++);
            if (mk_is_gemv(ins.op)) {
                const GemvTile<T> g = gemv_tile<T>(m, st, ins);
                tile = WeightRows<T>{g.w, g.wld, g.K, {g.row[0], g.row[1]}, {g.end[0], g.end[1]}, g.nchunks * g.nsub,
                                     g.nchunks};
                sub = 0;
            }
        }
        if (sub < tile.nchunks) {
            unsigned char* slot = ring + (issued % MK_STAGES) * MK_STAGE_BYTES;
#pragma unroll
            for (int u = 0; u < MK_STAGE_BYTES / 16 / MK_THREADS; ++u) {
                const int q = threadIdx.x + u * MK_THREADS, r = q / 32, cl = q % 32;
                const bool hi = r >= 8;  // group 1 (selects, not a dynamic index: no local memory)
                const int s = sub / tile.per, c = sub - s * tile.per;  // sub-tile, its chunk
                const int wrow = (hi ? tile.row[1] : tile.row[0]) + 8 * s + r % 8, col = c * CH + cl * VEC;
                const bool ok = wrow < (hi ? tile.end[1] : tile.end[0]) && col < tile.K;  // whole chunks
                cp_async_zfill<16>(slot + r * MK_CHUNK_BYTES + cl * 16,
                                   ok ? (const void*)(tile.w + (size_t)wrow * tile.wld + col) : (const void*)tile.w,
                                   ok ? 16 : 0);
            }
            ++sub;
        }
        cp_async_commit();
        ++issued;
    }

    // The slot holding the next chunk to compute, once it has landed and every thread is done
    // with the previous one (whose slot the chunk MK_STAGES - 1 ahead then refills).
    __device__ const unsigned char* next() {
        cp_async_wait<MK_STAGES - 2>();
        __syncthreads();
        const unsigned char* slot = ring + (consumed % MK_STAGES) * MK_STAGE_BYTES;
        ++consumed;
        issue_one();
        return slot;
    }
};

// --- the math -----------------------------------------------------------------------------------
// sum_e a[e] * b[e] over the T elements of two 16-byte chunks, in float32.
template <typename T>
__device__ __forceinline__ float chunk_dot(const uint4& a, const uint4& b) {
    const T* x = reinterpret_cast<const T*>(&a);
    const T* y = reinterpret_cast<const T*>(&b);
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < 16 / (int)sizeof(T); ++e) s = fmaf(to_float(x[e]), to_float(y[e]), s);
    return s;
}

// ss + the sum of squares of a 16-byte vector's elements.
template <typename T>
__device__ __forceinline__ float fmaf_chunk(const uint4& v, float ss) {
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 16 / (int)sizeof(T); ++i) ss = fmaf(to_float(e[i]), to_float(e[i]), ss);
    return ss;
}

// Four consecutive elements of T as one load or store (8 bytes for 16-bit types, 16 for float).
template <int BYTES>
struct MkQuadBits;
template <>
struct MkQuadBits<8> { typedef uint2 type; };
template <>
struct MkQuadBits<16> { typedef uint4 type; };

// The two loads below take the whole block: item (b, quad) is elements 4 quad .. 4 quad + 3 of
// row b, and an item's loads are issued MK_LOAD_BATCH slots or splits at a time (predicated, not
// branched: one round trip per batch) before any of them is summed. Read a warp per row, each
// vector's slots consumed as they arrived, a row cost one L2 round trip per two slots per vector
// (machine code of that version: the slot loop unrolled by 2; about 15 trips for SmolLM2's QKV
// tile at batch 1, 30 for a merged O tile).

// Composed rows (mode 1/2) into xs, and into xdst when set: per element the slots summed in order
// from 0, each sum rounded to T as the fused step rounds (the file's header).
template <typename T>
__device__ __forceinline__ void gemv_compose_rows(const MkModel& m, const MkState& st, const GemvTile<T>& g, T* xs) {
    typedef typename MkQuadBits<4 * sizeof(T)>::type Q;
    const int B = (int)m.B, nq = g.K / 4, ns = g.ko + (g.mode == 2 ? g.kd : 0);
    const size_t slot = (size_t)m.B * m.dim;  // one slot: [B, dim] floats
    const float* part = st.part + (size_t)g.par * (g.ko + g.kd) * slot;
    for (int it = threadIdx.x; it < B * nq; it += MK_THREADS) {
        const int b = it / nq, q = it % nq;
        const Q xq = __ldcg(reinterpret_cast<const Q*>(g.x + (size_t)b * g.ld) + q);
        const float* p = part + (size_t)b * m.dim + 4 * q;
        float so[4] = {0.f, 0.f, 0.f, 0.f}, sd[4] = {0.f, 0.f, 0.f, 0.f};
        for (int s0 = 0; s0 < ns; s0 += MK_LOAD_BATCH) {  // slots in order: a fixed sum
            float4 f[MK_LOAD_BATCH];
#pragma unroll
            for (int u = 0; u < MK_LOAD_BATCH; ++u)
                if (s0 + u < ns) f[u] = __ldcg(reinterpret_cast<const float4*>(p + (s0 + u) * slot));
#pragma unroll
            for (int u = 0; u < MK_LOAD_BATCH; ++u) {
                if (s0 + u >= ns) break;
                // selects, not branches; adding the other sum's +0 changes no bit (neither is -0)
                const bool o = s0 + u < g.ko;
                const float v[4] = {f[u].x, f[u].y, f[u].z, f[u].w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    so[e] += o ? v[e] : 0.f;
                    sd[e] += o ? 0.f : v[e];
                }
            }
        }
        const T* xe = reinterpret_cast<const T*>(&xq);
        Q out;
        T* o = reinterpret_cast<T*>(&out);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float r = to_float(from_float<T>(to_float(xe[e]) + to_float(from_float<T>(so[e]))));  // + O proj.
            if (g.mode == 2) r = to_float(from_float<T>(r + to_float(from_float<T>(sd[e]))));        // + down proj.
            o[e] = from_float<T>(r);
        }
        reinterpret_cast<Q*>(xs + (size_t)b * g.K)[q] = out;
        if (g.xdst != nullptr) reinterpret_cast<Q*>(g.xdst + (size_t)b * g.ld)[q] = out;
    }
    __syncthreads();  // warp b reads all of row b next
}

// Attention rows merged from the split partials: sequences b0 .. b0 + nb - 1, heads h0 .. h0 + nh - 1,
// row b - b0 to out + (b - b0) ld, head h at (h - h0) D. Per element lse = max_c lse_c, w_c =
// exp(lse_c - lse), out = sum_c w_c O_c / sum_c w_c (zeros when every split was empty). The reduce op
// and the O projection's merge on load both call it, so both round alike. Per pass over as many
// heads as `lse` holds (cap floats: every (b, head, split) log-sum-exp, one load each), then item
// (b, quad of 4 dims) with its splits' O loads MK_LOAD_BATCH at a time. One head always fits:
// LlamaStep keeps B x splits within 8 x config.MEGAKERNEL_MAX_SPLITS (32), cap 4224.
template <typename T>
__device__ __forceinline__ void mk_merge_rows(const MkModel& m, const MkState& st, int b0, int nb, int h0, int nh,
                                              T* out, size_t ld, float* lse, int cap) {
    typedef typename MkQuadBits<4 * sizeof(T)>::type Q;
    const int B = (int)m.B, Hq = (int)m.Hq, D = (int)m.D, S = (int)m.splits, per = max(1, cap / (nb * S));
    for (int ha = 0; ha < nh; ha += per) {
        const int hn = min(per, nh - ha), nq = hn * D / 4;
        for (int i = threadIdx.x; i < nb * hn * S; i += MK_THREADS) {  // lse[(b hn + head) S + split]
            const int c = i % S, hl = (i / S) % hn, b = b0 + i / (S * hn);
            lse[i] = __ldcg(st.lse_part + ((size_t)c * B + b) * Hq + h0 + ha + hl);
        }
        __syncthreads();
        for (int it = threadIdx.x; it < nb * nq; it += MK_THREADS) {
            const int bl = it / nq, k = 4 * (it % nq), hl = k / D, h = h0 + ha + hl;
            const float* l = lse + (bl * hn + hl) * S;
            const float* o = st.o_part + ((size_t)(b0 + bl) * Hq + h) * D + k % D;
            float M = -CUDART_INF_F;
            for (int c = 0; c < S; ++c) M = fmaxf(M, l[c]);
            float W = 0.f, O[4] = {0.f, 0.f, 0.f, 0.f};
            for (int c0 = 0; c0 < S && M > -CUDART_INF_F; c0 += MK_LOAD_BATCH) {
                float4 v[MK_LOAD_BATCH];
#pragma unroll
                for (int u = 0; u < MK_LOAD_BATCH; ++u)
                    if (c0 + u < S) v[u] = __ldcg(reinterpret_cast<const float4*>(o + (size_t)(c0 + u) * B * Hq * D));
#pragma unroll
                for (int u = 0; u < MK_LOAD_BATCH; ++u) {
                    if (c0 + u >= S) break;
                    const float w = expf(l[c0 + u] - M);
                    W += w;
                    O[0] = fmaf(w, v[u].x, O[0]); O[1] = fmaf(w, v[u].y, O[1]);
                    O[2] = fmaf(w, v[u].z, O[2]); O[3] = fmaf(w, v[u].w, O[3]);
                }
            }
            Q q;
            T* e = reinterpret_cast<T*>(&q);
#pragma unroll
            for (int j = 0; j < 4; ++j) e[j] = from_float<T>(W > 0.f ? O[j] / W : 0.f);
            reinterpret_cast<Q*>(out + bl * ld + (size_t)ha * D)[it % nq] = q;
        }
        __syncthreads();  // lse is refilled by the next pass; the rows are read by other threads
    }
}

// One 16-byte vector of a row normalised in place as rmsnorm writes it: T(x * inv_rms * w).
#define MK_NORM_PRE 3  // norm weight vectors a lane loads with the rows (SmolLM2's fp16 rows: all)
template <typename T>
__device__ __forceinline__ void gemv_norm_vec(uint4* v, const uint4& w, float inv_rms) {
    uint4 x = *v;
    T* e = reinterpret_cast<T*>(&x);
    const T* we = reinterpret_cast<const T*>(&w);
#pragma unroll
    for (int i = 0; i < 16 / (int)sizeof(T); ++i) e[i] = from_float<T>(to_float(e[i]) * inv_rms * to_float(we[i]));
    *v = x;
}

// xs [B][K] <- the tile's input rows, each normalised as rmsnorm writes it when norm is given:
// composed and merged rows by the whole block (above), plain rows and the norm by warp b for row b
// (B <= MK_WARPS), so the sum of squares needs no block barrier and each lane rescales exactly
// the chunks it sums. The rows were written by other blocks during this kernel: read through L2
// (__ldcg). `tmp` (cap floats) is scratch for the merge. The caller's next barrier makes xs
// visible to the block.
template <typename T>
__device__ __forceinline__ void gemv_load_rows(const MkModel& m, const MkState& st, const GemvTile<T>& g, T* xs,
                                               float* tmp, int cap) {
    constexpr int VEC = 16 / sizeof(T), BATCH = 4;
    const int B = (int)m.B;
    const int lane = threadIdx.x & 31, b = threadIdx.x >> 5, nc = g.K / VEC;
    // the norm weights of this lane's first MK_NORM_PRE vectors, loaded with the rows (their round
    // trip overlaps the rows' instead of following the sum of squares)
    uint4 wpre[MK_NORM_PRE];
#pragma unroll
    for (int j = 0; j < MK_NORM_PRE; ++j)
        if (g.norm != nullptr && b < B && lane + 32 * j < nc)
            wpre[j] = *(reinterpret_cast<const uint4*>(g.norm) + lane + 32 * j);
    if (g.src == MK_SRC_COMPOSE) gemv_compose_rows<T>(m, st, g, xs);  // every thread: barriers inside
    else if (g.src == MK_SRC_MERGE) mk_merge_rows<T>(m, st, 0, B, g.col0 / (int)m.D, g.K / (int)m.D, xs, g.K, tmp, cap);
    if (b >= B) return;  // whole warps leave together
    uint4* dst = reinterpret_cast<uint4*>(xs + (size_t)b * g.K);
    float ss = 0.f;
    if (g.src == MK_SRC_PLAIN) {
        const uint4* src = reinterpret_cast<const uint4*>(g.x + (size_t)b * g.ld);
        for (int c0 = lane; c0 < nc; c0 += 32 * BATCH) {
            uint4 v[BATCH];  // BATCH loads in flight before the first store
#pragma unroll
            for (int u = 0; u < BATCH; ++u)
                if (c0 + 32 * u < nc) v[u] = __ldcg(src + c0 + 32 * u);
#pragma unroll
            for (int u = 0; u < BATCH; ++u)
                if (c0 + 32 * u < nc) {
                    dst[c0 + 32 * u] = v[u];
                    ss = fmaf_chunk<T>(v[u], ss);
                }
        }
    } else if (g.norm != nullptr) {  // in xs already: the squares in the order the plain rows sum them
        for (int c = lane; c < nc; c += 32) ss = fmaf_chunk<T>(dst[c], ss);
    }
    if (g.norm == nullptr) return;
    const float inv_rms = 1.0f / sqrtf(warp_reduce_sum(ss) / (float)g.K + (float)m.eps);
#pragma unroll
    for (int j = 0; j < MK_NORM_PRE; ++j)
        if (lane + 32 * j < nc) gemv_norm_vec<T>(dst + lane + 32 * j, wpre[j], inv_rms);
    for (int c = lane + 32 * MK_NORM_PRE; c < nc; c += 32)
        gemv_norm_vec<T>(dst + c, *(reinterpret_cast<const uint4*>(g.norm) + c), inv_rms);
}

// The scratch of a GEMV instruction: the lanes' partial sums, then the finished tile C.
struct GemvSmem {
    float red[MK_TILE_ROWS][MK_MAX_BATCH][33];  // [tile row][b][lane], padded: conflict-free sums
    float c[MK_MAX_BATCH][MK_TILE_ROWS];        // C[b][tile row]
};

// C[b][r] = sum_k xs[b][k] * W[tile row r][k] for the B rows: warp w owns tile rows 2w, 2w + 1,
// lane l the 16-byte column chunk l of each ring chunk.
template <typename T>
__device__ __forceinline__ void gemv_product(WeightStream<T>& ws, const GemvTile<T>& g, int B, const T* xs,
                                             GemvSmem& sm) {
    constexpr int VEC = 16 / sizeof(T), CH = MK_CHUNK_BYTES / sizeof(T);
    const int lane = threadIdx.x & 31, r0 = 2 * (threadIdx.x >> 5);
    float acc[2][MK_MAX_BATCH];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int b = 0; b < MK_MAX_BATCH; ++b) acc[r][b] = 0.f;
    for (int c = 0; c < g.nchunks; ++c) {
        const unsigned char* slot = ws.next();
        const int col = c * CH + lane * VEC;
        if (col < g.K) {
            const uint4 w0 = *reinterpret_cast<const uint4*>(slot + r0 * MK_CHUNK_BYTES + lane * 16);
            const uint4 w1 = *reinterpret_cast<const uint4*>(slot + (r0 + 1) * MK_CHUNK_BYTES + lane * 16);
#pragma unroll
            for (int b = 0; b < MK_MAX_BATCH; ++b)
                if (b < B) {
                    const uint4 xv = *reinterpret_cast<const uint4*>(xs + (size_t)b * g.K + col);
                    acc[0][b] += chunk_dot<T>(w0, xv);
                    acc[1][b] += chunk_dot<T>(w1, xv);
                }
        }
    }
#pragma unroll
    for (int b = 0; b < MK_MAX_BATCH; ++b)
        if (b < B) {
            sm.red[r0][b][lane] = acc[0][b];
            sm.red[r0 + 1][b][lane] = acc[1][b];
        }
    __syncthreads();
    if (threadIdx.x < MK_TILE_ROWS * B) {
        const int r = threadIdx.x % MK_TILE_ROWS, b = threadIdx.x / MK_TILE_ROWS;
        float s = 0.f;
        for (int l = 0; l < 32; ++l) s += sm.red[r][b][l];
        sm.c[b][r] = s;
    }
    __syncthreads();
}

// --- epilogues ----------------------------------------------------------------------------------
// QKV: item (b, p), rotation pair p of the tile's 8 (fused_decode.cu's norm_qkv_rope_append_kernel),
// on thread 8 b + p; pos: lengths[layer][b], loaded by mk_gemv before the rows.
static_assert(8 * MK_MAX_BATCH <= MK_THREADS, "a QKV tile's items are one per thread");
template <typename T>
__device__ __forceinline__ void gemv_epilogue_qkv(const MkModel& m, const MkState& st, const MkIns& ins,
                                                  const GemvSmem& sm, int pos) {
    const int D = (int)m.D, Hq = (int)m.Hq, Hkv = (int)m.Hkv, half = D / 2, B = (int)m.B;
    const int h = ins.tile / (D / 16), j = ins.tile % (D / 16), it = threadIdx.x;
    if (it < 8 * B) {
        const int b = it / 8, p = it % 8, i = 8 * j + p;
        const int c0 = m.neox ? p : 2 * p, c1 = m.neox ? p + 8 : 2 * p + 1;
        const float x0 = to_float(from_float<T>(sm.c[b][c0])), x1 = to_float(from_float<T>(sm.c[b][c1]));
        int ia, ib;
        if (m.neox) rope_pair<true>(i, half, &ia, &ib);
        else rope_pair<false>(i, half, &ia, &ib);
        T* dst;
        if (h < Hq) {
            dst = (T*)st.q + ((size_t)b * Hq + h) * D;
        } else {
            const int hk = h < Hq + Hkv ? h - Hq : h - Hq - Hkv;
            dst = mk_layer_cache<T>(m, h < Hq + Hkv ? st.k_cache : st.v_cache, ins.layer) +
                  (((size_t)b * Hkv + hk) * (size_t)m.max_seq + pos) * D;
        }
        float y0 = x0, y1 = x1;
        if (h < Hq + Hkv) {  // q and k turn by the position; v is copied
            float s, c;
            rope_sincos(pos, rope_inv_freq(i, m.freq_scale, m.rope_div, (size_t)ins.layer * half), &s, &c);
            rope_rotate(x0, x1, s, c, &y0, &y1);
        }
        dst[ia] = from_float<T>(y0);
        dst[ib] = from_float<T>(y1);
    }
}

// OPROJ, DOWN (x += C, rounded as add(x, gemm_nt(a, w))), GATE_UP (SwiGLU), LM_HEAD (logits).
template <typename T>
__device__ __forceinline__ void gemv_epilogue(const MkModel& m, const MkState& st, const MkIns& ins,
                                              const GemvTile<T>& g, const GemvSmem& sm) {
    const int B = (int)m.B;
    if (ins.op == MK_OP_GATE_UP) {
        const int F = (int)m.F;
        for (int it = threadIdx.x; it < 8 * B; it += MK_THREADS) {
            const int b = it / 8, c = it % 8, j = 8 * ins.tile + c;
            if (j >= F) continue;
            const float gt = to_float(from_float<T>(sm.c[b][c])), up = to_float(from_float<T>(sm.c[b][c + 8]));
            // silu(g) * u as swiglu_kernel: g / (1 + e^-g) goes to -0 for g -> -inf, never NaN
            ((T*)st.ffn)[(size_t)b * F + j] = from_float<T>(gt / (1.0f + expf(-gt)) * up);
        }
        return;
    }
    const int N = g.end[0], n0 = g.row[0];
    for (int it = threadIdx.x; it < MK_TILE_ROWS * B; it += MK_THREADS) {
        const int b = it / MK_TILE_ROWS, n = n0 + it % MK_TILE_ROWS;
        if (n >= N) continue;
        const float c = sm.c[b][it % MK_TILE_ROWS];
        if (g.slot >= 0) {  // a column chunk's float32 partial into its slot (the file's header)
            st.part[(((size_t)g.par * (g.ko + g.kd) + g.slot) * B + b) * N + n] = c;
        } else if (ins.op == MK_OP_LM_HEAD) {
            ((T*)st.logits)[(size_t)b * N + n] = from_float<T>(c);
        } else {  // OPROJ, DOWN: the one thread that owns x[b][n] reads and writes it
            T* xe = (T*)st.x + (size_t)b * N + n;
            *xe = from_float<T>(to_float(__ldcg(xe)) + to_float(from_float<T>(c)));
        }
    }
    if (ins.op == MK_OP_LM_HEAD && (int)threadIdx.x < B) {
        // the tile's largest logit of sequence b as stored (NaN never wins): the two-level sampler's
        // chunks take the row's largest from these (megakernel_sample.cuh)
        const int b = threadIdx.x;
        float mx = -CUDART_INF_F;
        for (int r = 0; r < MK_TILE_ROWS && n0 + r < N; ++r) mx = fmaxf(mx, to_float(from_float<T>(sm.c[b][r])));
        st.sp_tmax[(size_t)b * ((N + MK_TILE_ROWS - 1) / MK_TILE_ROWS) + ins.tile] = mx;
    }
}

// One GEMV instruction: the input rows into xs (unless xs holds them already: `load`), the
// product streamed from the ring, the epilogue.
template <typename T>
__device__ void mk_gemv(const MkModel& m, const MkState& st, const MkIns& ins, WeightStream<T>& ws, T* xs,
                        bool load, GemvSmem& sm) {
    // The QKV epilogue's cache position, loaded before the rows so its round trip overlaps them: the
    // lengths change only at the end of the step (mk_end_of_step), after every block's last read.
    const int pos = ins.op == MK_OP_QKV && (int)threadIdx.x < 8 * (int)m.B
                        ? __ldcg(st.lengths + (size_t)ins.layer * m.B + threadIdx.x / 8) : 0;
    for (int s = 0; s < mk_subtiles(ins); ++s) {  // the input rows serve every sub-tile
        const MkIns is = mk_subtile(ins, s);
        const GemvTile<T> g = gemv_tile<T>(m, st, is);
        if (load && s == 0)  // ws.next()'s barrier publishes xs; the partial sums' buffer is free until the product
            gemv_load_rows<T>(m, st, g, xs, &sm.red[0][0][0], (int)(sizeof(sm.red) / sizeof(float)));
        gemv_product<T>(ws, g, (int)m.B, xs, sm);  // its first ws.next() waits out the last epilogue's reads
        if (is.op == MK_OP_QKV) gemv_epilogue_qkv<T>(m, st, is, sm, pos);
        else gemv_epilogue<T>(m, st, is, g, sm);
    }
}
