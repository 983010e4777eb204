"""GPU backend for tinylm on cupyattn kernels.

Weights are uploaded once in the chosen dtype (float16 / bfloat16 / float32) and every op runs
on the backend's own CUDA stream (``ops.stream()``; a stream, because the legacy default stream
cannot be captured into a CUDA graph). Projections are cupyattn.gemm_nt (x @ W^T with W shared
by the batch), the step after the QKV projection is KVCache.append_qkv (RoPE + append + length
advance in one kernel), prefill attention is cupyattn.attention(causal=True) with the dtype's
default kernel, decode attention is cupyattn.decode_attention into preallocated partials, the
block boundaries are cupyattn.add_rmsnorm, and sampling is cupyattn.sample. A decode step
through these ops allocates nothing and needs no host input, so it can be captured
(tinylm.generate). Nothing moves data to the host except ``to_numpy`` and ``read_tokens``.
"""
from __future__ import annotations

import cupy
import numpy as np

import cupyattn
from cupyattn import fused, layers
from cupyattn.config import DECODE_MAX_SPLITS

_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": cupyattn.bfloat16}


class CupyOps:
    """The ops interface (see tinylm.model) over CuPy arrays and cupyattn kernels."""

    name = "cupy"
    xp = cupy
    fused_decode = True  # has the fused decode step's ops (cupyattn.fused)
    graphs = True  # its forward passes can be captured and replayed (tinylm.graphs, tinylm.prefill)

    def __init__(self, dtype="float16"):
        key = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
        if key not in _DTYPES:
            raise ValueError(f"the cupy backend supports float32, float16 and bfloat16, not {dtype!r}")
        self.dtype = _DTYPES[key]
        # A blocking (not non_blocking) stream: work on the legacy default stream, e.g. a
        # caller's cupy ops on our outputs, stays ordered after ours.
        self._stream = cupy.cuda.Stream()
        self._merge_index = {}  # (B, H, T) -> merge_heads' row order on the device

    # --- memory (tinylm.generate sizes its batches with these) ---------------------------
    @staticmethod
    def free_memory():
        """Bytes the current device can still give: free device memory plus the blocks CuPy's
        pool holds unused."""
        return int(cupy.cuda.runtime.memGetInfo()[0]) + int(cupy.get_default_memory_pool().free_bytes())

    @staticmethod
    def attention_scratch_bytes(n_heads, t, s):
        """Fused (flash) attention keeps no score matrix."""
        return 0

    # --- stream, weights, cache, host transfers ------------------------------------------
    def stream(self):
        """The CUDA stream every op of this backend runs on (use as ``with ops.stream():``)."""
        return self._stream

    def upload(self, a):
        """Host array -> device array of the compute dtype (rounded on the host, copied once)."""
        return cupy.asarray(np.ascontiguousarray(np.asarray(a, dtype=np.float32).astype(self.dtype)))

    def new_cache(self, n_layers, batch, n_kv_heads, max_seq, head_dim):
        return cupyattn.KVCache(n_layers, batch, n_kv_heads, max_seq, head_dim, self.dtype)

    def upload_f32(self, a):
        """Host array -> float32 device array whatever the compute dtype (RoPE divisors)."""
        return cupy.asarray(np.ascontiguousarray(a, dtype=np.float32))

    def empty(self, shape):
        return cupy.empty(shape, dtype=self.dtype)

    def ids(self, ids):
        return cupy.asarray(np.ascontiguousarray(ids, dtype=np.int32))

    def token_buffer(self, batch):
        """[B, 1] int32 on the device: the next decode step's input ids (the sampler writes it)."""
        return cupy.zeros((batch, 1), dtype=cupy.int32)

    def set_tokens(self, buf, ids):
        buf.set(np.asarray(ids, dtype=np.int32).reshape(buf.shape))

    def read_tokens(self, buf):
        """The ids in ``buf`` on the host (waits for the stream's work up to here)."""
        return buf.get(stream=self._stream).astype(np.int64).reshape(-1)

    def to_numpy(self, x):
        return x.get(stream=self._stream).astype(np.float32)

    def synchronize(self):
        self._stream.synchronize()

    def contiguous(self, x):
        return cupy.ascontiguousarray(x)

    def decode_workspace(self, batch, n_heads, head_dim):
        """Split-KV partials for decode_attention, sized for any split count it accepts, and the
        fused combine's counters (zero; every call leaves them zero)."""
        return (cupy.empty((DECODE_MAX_SPLITS, batch, n_heads, head_dim), dtype=np.float32),
                cupy.empty((DECODE_MAX_SPLITS, batch, n_heads), dtype=np.float32),
                cupy.zeros((batch, n_heads), dtype=np.uint32))

    def decode_splits(self, batch, n_heads, n_kv_heads, head_dim, length):
        """Split-KV count for a decode step whose longest sequence holds ``length`` keys: the
        one decode_attention would pick itself (same kernel plan, SM count and occupancy)."""
        return cupyattn.auto_num_splits(batch, n_heads, n_kv_heads, head_dim, self.dtype, length)

    # --- layer ops ------------------------------------------------------------------------
    def embedding(self, ids, table, out=None):
        return layers.embedding(ids, table, out=out)

    def matmul(self, x, w, out=None):
        """x [..., K] @ w^T, w [N, K] -> [..., N] (w broadcast over the leading dims)."""
        return cupyattn.gemm_nt(x, w, out=out)

    def rmsnorm(self, x, weight, eps, out=None):
        return layers.rmsnorm(x, weight, eps=eps, out=out)

    def add_rmsnorm(self, x, r, weight, eps, out=None):
        return layers.add_rmsnorm(x, r, weight, eps=eps, out=out)

    def qkv_rope_append(self, qkv, cache, layer, n_heads, base, style, num_new=None, out=None, factors=None):
        return cache.append_qkv(layer, qkv, n_heads, rope_base=base, rope_style=style,
                                num_new=num_new, q_out=out, rope_freq_div=factors)

    def attend_prefill(self, q, cache, layer, start, key_lengths=None, out=None, **options):
        """Causal flash attention of q [B, Hq, T, D] over the cached keys 0..start+T-1 (read in
        place: attention takes strided K/V); key_lengths [B] hides keys past each sequence's
        own end (right-padded prompts). options: scale, window, softcap (a family's)."""
        s = start + q.shape[2]
        return cupyattn.attention(q, cache.k[layer, :, :, :s], cache.v[layer, :, :, :s], causal=True,
                                  key_lengths=key_lengths, out=out, **options)

    def merge_heads(self, o, out=None):
        """o [B, H, T, D] -> [B, T, H * D] C-contiguous (the O projection's input). T = 1 is a
        view; otherwise one copy kernel, the embedding gather of rows (b, h, t) in (b, t, h)
        order: it takes ``out`` and an index built once per shape, so it can be captured."""
        b, h, t, d = o.shape
        if out is None and t == 1:
            return o.reshape(b, 1, h * d)
        key = (b, h, t)
        idx = self._merge_index.get(key)
        if idx is None:
            rows = np.arange(b * h * t, dtype=np.int32).reshape(b, h, t).transpose(0, 2, 1)
            idx = self._merge_index[key] = cupy.asarray(np.ascontiguousarray(rows).reshape(-1))
        dst = None if out is None else out.reshape(b * t * h, d)
        return layers.embedding(idx, o.reshape(b * h * t, d), out=dst).reshape(b, t, h * d)

    def attend_decode(self, q, cache, layer, out=None, workspace=None, num_splits=None, fused_combine=None,
                      **options):
        """q [B, Hq, 1, D] over the cache's layer: KVCache and PagedKVCache (continuous batching,
        tinylm.serve) decode through the same method. options: scale, window, softcap (a family's)."""
        return cache.decode(q, layer, num_splits=num_splits, out=out, workspace=workspace, fused_combine=fused_combine,
                            **options)

    # --- a family's extra ops (tinylm.config.ModelArgs) ------------------------------------
    def add_bias(self, x, bias):
        return layers.bias_add(x, bias)

    def head_rmsnorm(self, qkv, q_weight, k_weight, n_heads, n_kv_heads, eps):
        """Query heads by q_weight, key heads by k_weight, of qkv [B, T, (Hq + 2 Hkv) D], in place."""
        b, t, w = qkv.shape
        d = q_weight.shape[0]
        heads = qkv.reshape(b * t, w // d, d)
        layers.head_rmsnorm(heads[:, :n_heads], q_weight, eps)
        layers.head_rmsnorm(heads[:, n_heads:n_heads + n_kv_heads], k_weight, eps)
        return qkv

    def geglu(self, gate, up, out=None):
        return layers.geglu(gate, up, out=out)

    def softcap(self, x, cap):
        return layers.softcap(x, cap)

    def swiglu(self, gate, up, out=None):
        return layers.swiglu(gate, up, out=out)

    def gather_rows(self, x, idx, out=None):
        """x [B, T, D] contiguous, idx [B] host ints -> rows x[b, idx[b]] as [B, 1, D]. A device
        idx (int32) holds the flat row numbers ``b * T + idx[b]`` already (a captured prefill)."""
        b, t, d = x.shape
        if isinstance(idx, cupy.ndarray):
            flat = idx
        else:
            flat = cupy.asarray(np.arange(b, dtype=np.int32) * t + np.asarray(idx, dtype=np.int32))
        dst = None if out is None else out.reshape(b, d)
        return layers.embedding(flat, x.reshape(b * t, d), out=dst).reshape(b, 1, d)

    # --- the fused decode step (tinylm.model.Transformer._decode_fused) -------------------
    def norm_qkv_rope_append(self, x, norm_w, wqkv, cache, layer, n_heads, eps, base, style, out=None, factors=None):
        return fused.rmsnorm_qkv_rope_append(x, norm_w, wqkv, cache, layer, n_heads, eps, base, style, q_out=out,
                                             rope_freq_div=factors)

    def matmul_residual(self, x, a, w):
        """x += a @ w^T, in place."""
        return fused.gemm_residual(x, a, w)

    def norm_gate_up_swiglu(self, x, norm_w, w_gate_up, eps, out=None):
        return fused.rmsnorm_gate_up_swiglu(x, norm_w, w_gate_up, eps, out=out)

    def norm_matmul(self, x, norm_w, w, eps, out=None):
        return fused.rmsnorm_gemm(x, norm_w, w, eps, out=out)

    # --- sampling -------------------------------------------------------------------------
    def sampling_params(self, batch):
        return cupyattn.SamplingParams(batch)

    def sample(self, logits, params, out):
        """One id per row of logits [B, 1, V] into out [B, 1] (int32, on the device)."""
        return cupyattn.sample(logits, params, out=out)
