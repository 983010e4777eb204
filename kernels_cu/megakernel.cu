// megakernel.cu: one persistent kernel per decode step of a Llama-style model (spec "megakernel",
// cupyattn/megakernel.py; the plan: cupyattn/persistent.py; the Llama op list:
// cupyattn/megakernel_llama.py). Correct on an H100, slower than the fused step there (2026-11-27):
// opt-in (config.TINYLM_MEGAKERNEL) until a GPU run shows it faster.
//
// One block per SM; block k interprets its queue instr[queue[k] .. queue[k+1]) of fixed-size
// instructions (persistent.py's table: opcode, layer, tile, arg0, arg1, signal, wait_begin,
// wait_count) in order. The instruction set (opcodes are -D options from cupyattn/megakernel.py):
//
//   opcode            file                       what one instruction does
//   MK_OP_EMBED       here                       x[b] = tok_embd[tokens[b]] for every b
//   MK_OP_QKV         megakernel_gemv.cuh        RMSNorm + 16 rows of the QKV projection + RoPE +
//                                                KV-cache append (8 rotation pairs of one head)
//   MK_OP_ATTN        megakernel_attention.cuh   attention of some query heads of a kv head over
//                                                one split of the keys (v1, or the ring: arg1)
//   MK_OP_REDUCE      megakernel_attention.cuh   the splits merged into att
//   MK_OP_OPROJ       megakernel_gemv.cuh        16 outputs of att Wo^T (one column chunk of kc)
//                                                added to x, or into a partial slot
//   MK_OP_GATE_UP     megakernel_gemv.cuh        RMSNorm + 8 gate and 8 up rows + SwiGLU
//   MK_OP_DOWN        megakernel_gemv.cuh        16 outputs of ffn Wdown^T (one column chunk of kc)
//                                                added to x, or into a partial slot
//   MK_OP_LM_HEAD     megakernel_gemv.cuh        final RMSNorm + 16 logits (and their largest)
//   MK_OP_SAMPLE      here / megakernel_sample   one sequence's next token: from its whole row
//                                                (arg0 = 0) or from its chunks' answers
//   MK_OP_SAMPLE_PART megakernel_sample.cuh      one vocabulary chunk's max, top-k or top-p
//                                                candidates and mass
//
// Instruction arguments (the op list, cupyattn/megakernel_llama.py, writes them; LlamaStep.plan
// checks them against the step's buffers):
//   MK_OP_ATTN                  arg0 head splits (>= 1), arg1 0 = v1, 1 = ring
//   MK_OP_OPROJ, MK_OP_DOWN     arg0 column chunks kc; arg1 = KO | KD << 8 | flags << 16, flags bit
//                               0: merge the split attention on load (O only), bit 1: write the
//                               float32 partial to slot c (O) / KO + c (down) of part[layer & 1]
//   MK_OP_QKV, _GATE_UP, _LM_HEAD  arg0 input mode: 0 x as it is; 1 x_s + the O slots of layer s;
//                               2 that + the down slots of layer s (s = arg1 >> 16; KO, KD as above)
//   MK_OP_SAMPLE_PART           arg0 chunks P, arg1 logits per chunk C;  MK_OP_SAMPLE: arg0 P, arg1 C, or 0, 0
//
// Dependencies are counters in global memory, never grid barriers: an instruction waits until
// each counter of its waits[] rows reaches its target (wait_acquire: ld.acquire.gpu poll, one
// thread per counter, sleeping at most m.spin_ns between polls, then the block barrier passes
// what they acquired to every thread), runs, and
// after a block barrier (every thread's writes done) thread 0 bumps its signal counter
// (signal_release: red.release.gpu). Targets are step-relative; the counters are reset inside the
// kernel with no race by keeping two sets (the step's epoch picks one) and having every block clear
// its share of the other set, which the next launch uses and nobody touches in this one.
// Activations written by other blocks during the launch are read through L2 (__ldcg, cp.async.cg):
// an SM's L1 is not coherent with other SMs' stores.
//
// Resources (who owns what, when):
//   dynamic smem  ring [MK_STAGES][16][512 B]   the weight stream (megakernel_gemv.cuh), alive
//                                               across instructions: chunks of the next GEMV are in
//                                               flight during any instruction and any wait
//                 xs [B][K] T (offset xs_off)   a GEMV's input rows, from its load to the last
//                                               consecutive tile of the same op and chunk on the
//                                               block; or, during a ring attention instruction,
//                                               its two K/V chunk slots (then xs holds nothing)
//   static smem   MkScratch (a union)           one instruction's scratch: GEMV sums, attention
//                                               state, the sampler's; free after the instruction's
//                                               closing barrier
//   global        counters [2][n_alloc] u32     set (epoch & 1) this step; the other set cleared
//                 step [2] u32                  epoch (steps done), ticket (blocks done this step)
//                 xalt, part                    the split projections' residual buffer and partial
//                                               slots: layer s writes parity s & 1, which layer s + 2
//                                               reuses only after every reader of layer s is done
//                                               (each waits, through layer s + 1's device-wide waits)
//
// End of the step: each block takes a ticket (atom.acq_rel) after its queue; the last one (every
// other block's work now happens-before it) advances every layer's cache lengths by one, resets
// the ticket and bumps the epoch, so a CUDA graph of the launch replays without host help.
// Profiling: with MkModel.timings set, thread 0 stamps each instruction (%globaltimer) when it
// starts waiting, when its waits are done and when its work is (LlamaStep.profile).
// Layouts: MkModel below (all 8-byte fields: the host packs them as uint64 words): what the step
// only reads, passed by value. What it writes and another block reads in the same launch (MkState)
// comes as pointer arguments of its own: on the CPU emulator those arrays are the ones its memory
// model tracks (tests/emu/README.md), so a missing release or acquire reads poison there.
#include "common.cuh"
#include "ptx.cuh"
#include "sampling.cuh"
#if !defined(MK_THREADS) || !defined(MK_STAGES) || !defined(MK_MAX_BATCH) || !defined(MK_MAX_HEAD_DIM) || \
    !defined(MK_HEAD_TILE) || !defined(MK_INSTR_WORDS) || !defined(MK_OP_SAMPLE_PART) || !defined(MK_TILE_ROWS) || \
    !defined(MK_GATE_UP_ROWS) || !defined(MK_CHUNK_BYTES) || !defined(MK_ATTN_MAX_KEYS) || !defined(MK_SAMPLE_CAND) || \
    !defined(MK_SAMPLE_MAX_CANDS) || !defined(MK_SAMPLE_MAX_PARTS) || !defined(MK_SAMPLE_CHUNK) || \
    !defined(MK_LOAD_BATCH) || !defined(MK_SAMPLE_HEAD)
#error "compile with the -D options of cupyattn/megakernel.py (the megakernel KernelSpec passes them)"
#endif
#define MK_WARPS (MK_THREADS / 32)

// --- the model and the instruction --------------------------------------------------------------
struct MkLayer {           // one layer's weights (element type T, the model's)
    const void* attn_norm;  // [dim]
    const void* wqkv;       // [(Hq + 2 Hkv) D, dim] rows of Wq | Wk | Wv
    const void* wo;         // [dim, Hq D]
    const void* ffn_norm;   // [dim]
    const void* w_gate_up;  // [2F, dim] rows of Wgate | Wup
    const void* w_down;     // [dim, F]
};

struct MkModel {
    const MkLayer* layers;  // [L]
    const void* tok_embd;   // [V, dim]
    const void* out_norm;   // [dim]
    const void* out_w;      // [V, dim] (tok_embd when the embeddings are tied)
    const float* fparams;   // [B, 2] SamplingParams (beta, top_p)
    int* iparams;           // [B, 4] (top_k, seed lo, seed hi, step): row b is read and advanced
                            // by sequence b's sampling instruction only
    unsigned long long* timings;  // [n, 4] per queue row: start, ready, done (globaltimer ns), block;
                                  // or null. Written by thread 0 of the row's block, read by nobody.
    const float* rope_div;  // [L, D/2] per layer, each pair's frequency divisor (as rope_freqs), or null
    long long B, dim, Hq, Hkv, D, F, V, L, max_seq, splits, neox;
    long long spin_ns;    // a waiter's longest sleep between polls (0: none)
    long long attn_keys;  // keys per staged chunk of the ring attention
    long long parts;      // vocabulary chunks the sampler's buffers hold per sequence
    double eps, freq_scale, scale_log2;  // RMSNorm eps; RoPE -log2(base) / (D/2); softmax scale * log2(e)
};

// The step's buffers (the kernel's pointer arguments, element type T unless said).
struct MkState {
    void* x;          // [B, dim] residual stream
    void* q;          // [B, Hq, D] rotated queries
    void* att;        // [B, Hq D] attention output, heads merged
    float* o_part;    // [splits, B, Hq, D] normalised split partials
    float* lse_part;  // [splits, B, Hq] their log-sum-exp (natural log)
    void* ffn;        // [B, F] silu(gate) * up
    void* logits;     // [B, V]
    int* tokens;      // [B] this step's input ids; the sampled ids replace them
    void* k_cache;    // [L, B, Hkv, max_seq, D]
    void* v_cache;    // [L, B, Hkv, max_seq, D]
    int* lengths;     // [L, B] tokens cached before this step (advanced at its end)
    void* xalt;       // [B, dim] the residual of odd layers (split projections; x holds even ones)
    float* part;      // [2, KO + KD, B, dim] the split projections' partial slots, by layer parity
    float* sp_val;    // [B, parts, 1 + MK_SAMPLE_CAND] the two-level sampler's chunk answers
    int* sp_idx;      // [B, parts, MK_SAMPLE_HEAD + MK_SAMPLE_CAND] (megakernel_sample.cuh)
    float* sp_tmax;   // [B, ceil(V / MK_TILE_ROWS)] each LM-head tile's largest logit, as stored
};

// Layer l of a cache (MkState.k_cache or v_cache): [B, Hkv, max_seq, D].
template <typename T>
__device__ __forceinline__ T* mk_layer_cache(const MkModel& m, void* cache, int l) {
    return (T*)cache + (size_t)l * m.B * m.Hkv * m.max_seq * m.D;
}

struct MkIns {
    int op, layer, tile, arg0, arg1, signal, wait_begin, wait_count;
};

__device__ __forceinline__ MkIns mk_ins(const int* instr, int row) {
    const int4* p = reinterpret_cast<const int4*>(instr + (size_t)row * MK_INSTR_WORDS);
    const int4 a = p[0], b = p[1];
    return MkIns{a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
}

#include "megakernel_gemv.cuh"
#include "megakernel_attention.cuh"
#include "megakernel_sample.cuh"

// One instruction's scratch (static shared memory, reused by every instruction).
union MkScratch {
    GemvSmem gemv;
    AttnSmem attn;
    AttnRingSmem ring;
    SamplePartSmem sample_part;
    SampleMergeSmem sample_merge;
};

// --- small instructions -------------------------------------------------------------------------
// x[b] = tok_embd[tokens[b]] for every b; an id outside [0, V) gives a zero row (embedding_kernel).
template <typename T>
__device__ void mk_embed(const MkModel& m, const MkState& st) {
    constexpr int VEC = 16 / sizeof(T);
    const int nc = (int)m.dim / VEC;
    for (int i = threadIdx.x; i < (int)m.B * nc; i += MK_THREADS) {
        const int b = i / nc, c = i % nc;
        const int id = __ldcg(st.tokens + b);
        uint4 v = {0u, 0u, 0u, 0u};
        if (id >= 0 && id < m.V) v = *(reinterpret_cast<const uint4*>((const T*)m.tok_embd + (size_t)id * m.dim) + c);
        *(reinterpret_cast<uint4*>((T*)st.x + (size_t)b * m.dim) + c) = v;
    }
}

// The end of a block's step: a ticket; the last block advances the lengths and the epoch.
// Memory order: thread 0 takes the ticket (last_block_ticket, ptx.cuh: atom.acq_rel.gpu) after the
// block's closing barrier. Its release half publishes the block's work, as a signal does. The last
// ticket's acquire half reads the value the ticket before it wrote, which ends a release sequence
// headed by every other block's ticket (the tickets are one chain of RMWs), so it synchronizes with
// all of them: every read of the lengths in this step happens before they advance. The lengths,
// the ticket and the epoch are then written with plain stores: nothing in this launch reads them
// again, and the kernel boundary publishes them to the next launch.
__device__ __forceinline__ void mk_end_of_step(const MkModel& m, const MkState& st, unsigned* step, unsigned epoch) {
    if (!last_block_ticket(step + 1, gridDim.x)) return;  // resets step[1]
    for (int i = threadIdx.x; i < (int)(m.L * m.B); i += MK_THREADS) st.lengths[i] += 1;
    if (threadIdx.x == 0) step[0] = epoch + 1u;
}

// --- the kernel -----------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(MK_THREADS, 1) megakernel(
    const __grid_constant__ MkModel m,
    void* x, void* q, void* att, float* o_part, float* lse_part, void* ffn, void* logits,  // MkState
    int* tokens, void* k_cache, void* v_cache, int* lengths, void* xalt, float* part, float* sp_val, int* sp_idx,
    float* sp_tmax,
    const int* __restrict__ instr,   // [n, MK_INSTR_WORDS] the queues back to back
    const int* __restrict__ queue,   // [gridDim.x + 1] block k's rows: queue[k] .. queue[k+1]
    const int* __restrict__ waits,   // [n_waits, 2] (counter, target)
    unsigned* __restrict__ counters, // [2, n_alloc]
    int n_alloc,
    unsigned* __restrict__ step,     // [2] epoch, ticket
    int xs_off) {                    // byte offset of xs in dynamic smem (after the ring)
    extern __shared__ uint4 mk_smem_u4[];
    __shared__ MkScratch scratch;
    const MkState st{x, q, att, o_part, lse_part, ffn, logits, tokens, k_cache, v_cache, lengths, xalt, part, sp_val,
                     sp_idx, sp_tmax};
    unsigned char* smem = reinterpret_cast<unsigned char*>(mk_smem_u4);
    T* xs = reinterpret_cast<T*>(smem + xs_off);
    // Counter sets: this step counts in set (epoch & 1). The other set, the previous step's and the
    // next one's, is cleared with plain stores: no block reads or bumps it during this launch, and
    // the kernel boundary makes the zeros visible to the next launch (as it does the epoch, written
    // by the previous launch's last block).
    const unsigned epoch = __ldcg(step);
    unsigned* ctr = counters + (size_t)(epoch & 1u) * n_alloc;
    unsigned* other = counters + (size_t)((epoch + 1u) & 1u) * n_alloc;
    for (int i = blockIdx.x * MK_THREADS + threadIdx.x; i < n_alloc; i += gridDim.x * MK_THREADS) other[i] = 0u;

    const int q0 = queue[blockIdx.x], q1 = queue[blockIdx.x + 1];
    WeightStream<T> ws(m, st, instr, q0, q1, smem);  // the first weight chunks in flight before any wait
    // Per thread, the last counter it acquired and the target it saw reached: consecutive tiles of
    // one op on a block wait for the same counters, and a wait already seen satisfied needs no
    // second trip to L2 (the earlier acquire still orders this thread's later reads).
    int seen_ctr = -1;
    unsigned seen_val = 0u;
    long long xs_key = -1;  // (op, layer, column chunk) whose input rows xs holds: the same for every tile
    unsigned long long* prof = m.timings;  // profiling (LlamaStep.profile): thread 0 stamps each instruction
    for (int row = q0; row < q1; ++row) {
        const MkIns ins = mk_ins(instr, row);
        if (prof != nullptr && threadIdx.x == 0) prof[4 * row] = globaltimer_ns();
        // Acquire side. Thread i spins with ld.acquire.gpu on the instruction's i-th counter until
        // it reaches its target. The acquire that reads a value the producers' red.release wrote
        // (or a later one of the counter's RMW chain: a release sequence) synchronizes with each
        // of those releases: their blocks' writes happen before this thread's later accesses (PTX
        // ISA, Memory Consistency Model: release and acquire patterns, causality order). The
        // bar.sync below carries that to every thread of the block (causality order is
        // transitive through a CTA barrier). The reads of other blocks' outputs still go through
        // L2 (__ldcg, cp.async.cg): L1 is not coherent across SMs, and this order says the data
        // reached L2, not that no stale line sits in this SM's L1.
        if ((int)threadIdx.x < ins.wait_count) {  // the host keeps wait_count <= MK_THREADS
            const int* w = waits + 2 * (ins.wait_begin + threadIdx.x);
            if (w[0] != seen_ctr || (int)(seen_val - (unsigned)w[1]) < 0) {
                wait_acquire(ctr + w[0], (unsigned)w[1], (unsigned)m.spin_ns);
                seen_ctr = w[0];
                seen_val = (unsigned)w[1];
            }
        }
        __syncthreads();
        if (prof != nullptr && threadIdx.x == 0) prof[4 * row + 1] = globaltimer_ns();
        if (mk_is_gemv(ins.op)) {
            // the block's queue follows the global order, so its consecutive tiles of one op (and
            // column chunk) see the same input (no other op's write comes between them): load it once
            const int chunk = (ins.op == MK_OP_OPROJ || ins.op == MK_OP_DOWN) && ins.arg0 > 1 ? ins.tile % ins.arg0 : 0;
            const long long key = ((long long)ins.op * 65536 + ins.layer) * 65536 + chunk;
            mk_gemv<T>(m, st, ins, ws, xs, key != xs_key, scratch.gemv);
            xs_key = key;
        } else {
            xs_key = -1;  // a ring attention reuses xs' memory; nothing else keeps it valid either
            if (ins.op == MK_OP_ATTN) {
                if (ins.arg1 == 1) mk_attention_ring<T>(m, st, ins, scratch.ring, reinterpret_cast<unsigned char*>(xs));
                else mk_attention<T>(m, st, ins, scratch.attn);
            } else if (ins.op == MK_OP_REDUCE) {
                mk_attention_reduce<T>(m, st, ins, &scratch.gemv.red[0][0][0],
                                       (int)(sizeof(scratch.gemv.red) / sizeof(float)));
            } else if (ins.op == MK_OP_EMBED) {
                mk_embed<T>(m, st);
            } else if (ins.op == MK_OP_SAMPLE_PART) {
                mk_sample_part<T>(m, st, ins, scratch.sample_part);
            } else if (ins.op == MK_OP_SAMPLE) {
                mk_sample<T>(m, st, ins, scratch.sample_merge);
            }
        }
        __syncthreads();  // every thread's writes of the instruction precede the release
        if (prof != nullptr && threadIdx.x == 0) {
            prof[4 * row + 2] = globaltimer_ns();
            prof[4 * row + 3] = blockIdx.x;
        }
        // Release side: thread 0's red.release.gpu after the barrier. The release is cumulative:
        // it orders before the increment every write thread 0 has observed, which the barrier
        // made every thread's write of the instruction; a consumer whose acquire sees the
        // increment sees them all. One increment per tile; the host set the target to the tiles
        // that signal this counter in one step.
        if (threadIdx.x == 0 && ins.signal >= 0) signal_release(ctr + ins.signal, 1u);
    }
    cp_async_wait<0>();  // the stream's tail groups are empty; nothing is left in flight
    mk_end_of_step(m, st, step, epoch);
}
