"""NumPy float64 references for every op in cupyattn. These are what the kernels are held to.

Everything here takes NumPy (or anything ``np.asarray`` accepts, e.g. ml_dtypes bfloat16),
computes in float64 and returns float64. Layouts match the kernels: attention is
``[B, H, S, D]``; causal masks for Sq != Sk are aligned bottom-right (query i sees keys
``j <= i + Sk - Sq``), and a row that sees no key produces zeros (its log-sum-exp is -inf).

Non-finite values (the semantics every kernel follows; docs/api.md "Non-finite values"):
- a hidden score (causal, key_lengths, an additive mask of -inf) is -inf whatever q . k is, so a
  NaN in a hidden key's K never matters, and softmax gives hidden positions exactly 0;
- keys hidden by ``key_lengths`` (or a KV cache's length) never contribute at all: their V rows
  are not read (the kernels zero-fill them), so even NaN there changes nothing;
- a NaN in a visible score (or a +inf, whose exp is undefined against the others) makes that
  row NaN at its visible positions (softmax) / in its whole output (attention, lse NaN);
- a NaN in a visible V row reaches the outputs of the rows that see it. (A V row hidden from a
  row only by the causal or additive mask may still reach it as 0 * NaN, as in FlashAttention
  and PyTorch: the row is visible to other queries.)
"""
from __future__ import annotations

import math

import numpy as np


def _f64(x):
    return np.asarray(x).astype(np.float64)


# --- GEMM -----------------------------------------------------------------------------------
def gemm_nt(a, b):
    """``a @ b^T`` over the last two dims: a [..., M, K], b [..., N, K] -> [..., M, N]."""
    return _f64(a) @ np.swapaxes(_f64(b), -1, -2)


def gemm_nn(a, b):
    """``a @ b``: a [..., M, K], b [..., K, N] -> [..., M, N]."""
    return _f64(a) @ _f64(b)


# --- softmax and masks ----------------------------------------------------------------------
def causal_allowed(sq: int, sk: int):
    """Bool [sq, sk]: True where query i may see key j (bottom-right aligned)."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    return j <= i + (sk - sq)


def _normalise(s, hidden, axis):
    """exp(s - max) / sum over ``axis`` with the module's semantics: hidden -> 0, a row that
    sees nothing -> 0, a NaN or +inf among the visible scores -> NaN at the visible positions.
    Returns (p, m_safe, l): probabilities, the max used, and the row sums (NaN for NaN rows)."""
    s = np.where(hidden, -np.inf, s)
    m = np.max(s, axis=axis, keepdims=True, initial=-np.inf)  # NaN if a visible score is NaN; -inf if none
    m_safe = np.where(m == -np.inf, 0.0, m)  # nothing visible: exp(-inf - 0) = 0
    with np.errstate(invalid="ignore"):
        e = np.where(hidden, 0.0, np.exp(s - m_safe))  # +inf - +inf = NaN, as on the device
    l = np.sum(e, axis=axis, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(l > 0, e / np.where(l > 0, l, 1.0), np.where(np.isnan(l), np.nan, 0.0))
    return np.where(hidden, 0.0, p), m_safe, l


def softmax(x, axis=-1, scale=1.0, causal=False, mask=None):
    """``softmax(x * scale + mask)`` along ``axis``, max-subtracted; fully masked rows -> 0.

    ``causal`` masks the last two dims as [..., Sq, Sk] (requires axis = -1). A mask entry of
    -inf hides its position whatever ``x`` holds there.
    """
    s = _f64(x) * scale
    hidden = np.zeros(s.shape, dtype=bool)
    if mask is not None:
        mask = _f64(mask)
        hidden = hidden | (mask == -np.inf)
        s = np.where(hidden, -np.inf, s + mask)
    if causal:
        if axis not in (-1, s.ndim - 1):
            raise ValueError("causal softmax needs axis=-1")
        hidden = hidden | ~causal_allowed(s.shape[-2], s.shape[-1])
    return _normalise(s, hidden, axis)[0]


# --- attention ------------------------------------------------------------------------------
def _expand_kv(q, k, v):
    """Repeat K/V heads for GQA/MQA: query head h uses kv head h // (Hq // Hkv)."""
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")
    g = hq // hkv
    return np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)


def attention_bias(b, h, sq, sk, causal=False, mask=None, key_lengths=None):
    """Additive float64 bias [B, H, Sq, Sk] (0 or -inf, plus ``mask``) for the options; -inf
    marks a hidden key (whatever its score)."""
    bias = np.zeros((b, h, sq, sk))
    if mask is not None:
        bias = bias + _f64(mask)
    if causal:
        bias = np.where(causal_allowed(sq, sk), bias, -np.inf)
    if key_lengths is not None:
        kl = np.asarray(key_lengths).reshape(b, 1, 1, 1)
        bias = np.where(np.arange(sk)[None, None, None, :] < kl, bias, -np.inf)
    return bias


def _live_values(v, key_lengths):
    """V with the rows hidden by key_lengths zeroed: those keys are never read."""
    if key_lengths is None:
        return v
    kl = np.asarray(key_lengths).reshape(v.shape[0], 1, 1, 1)
    return np.where(np.arange(v.shape[2])[None, None, :, None] < kl, v, 0.0)


def window_allowed(sq: int, sk: int, window):
    """Bool [sq, sk]: True where query i may see key j under flash-attention's
    ``window=(left, right)`` (-1: unbounded), counted from the bottom-right-aligned position
    ``i + sk - sq``: ``i + sk - sq - left <= j <= i + sk - sq + right``."""
    left, right = window
    i = np.arange(sq)[:, None] + (sk - sq)
    j = np.arange(sk)[None, :]
    return ((left < 0) | (j >= i - left)) & ((right < 0) | (j <= i + right))


def attention(q, k, v, causal=False, scale=None, mask=None, key_lengths=None, return_lse=False,
              window=None, softcap=None):
    """``softmax(q k^T * scale + bias) v`` with S materialised. q [B,Hq,Sq,D], k/v [B,Hkv,Sk,D].

    ``mask`` is additive, broadcastable to [B, Hq, Sq, Sk]; ``key_lengths`` [B] hides keys
    j >= key_lengths[b]; ``window`` (left, right) hides keys outside it (window_allowed);
    ``softcap`` (> 0) turns each score s = q.k * scale into softcap * tanh(s / softcap) before
    the mask (flash-attention and Gemma 2: the scale is applied first). Returns out
    [B,Hq,Sq,D] (and lse [B,Hq,Sq], natural log, -inf for rows that see no key, NaN for rows
    with a NaN among their visible scores).
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    k, v = _expand_kv(q, k, v)
    b, h, sq, d = q.shape
    sk = k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    bias = attention_bias(b, h, sq, sk, causal, mask, key_lengths)
    if window is not None:
        bias = np.where(window_allowed(sq, sk, window), bias, -np.inf)
    s = q @ np.swapaxes(k, -1, -2) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    p, m_safe, l = _normalise(s + bias, bias == -np.inf, -1)
    out = p @ _live_values(v, key_lengths)
    if not return_lse:
        return out
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(l[..., 0] > 0, m_safe[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)),
                       np.where(np.isnan(l[..., 0]), np.nan, -np.inf))
    return out, lse


def flash_attention_tiled(q, k, v, causal=False, scale=None, mask=None, key_lengths=None,
                          block_m=64, block_n=64, return_lse=False):
    """FlashAttention-2 forward (Algorithm 1) in NumPy, tile by tile, never forming full S.

    For each query tile Q_i and key tile K_j: S_ij = Q_i K_j^T * scale + bias, m_new =
    max(m_i, rowmax S_ij), P = exp(S_ij - m_new), l_i = exp(m_i - m_new) l_i + rowsum P,
    O_i = exp(m_i - m_new) O_i + P V_j; at the end O_i / l_i and lse = m_i + log l_i.
    With causal, key tiles entirely above the (bottom-right) diagonal are skipped.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    k, v = _expand_kv(q, k, v)
    b, h, sq, d = q.shape
    sk = k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    bias_full = attention_bias(b, h, sq, sk, False, mask, key_lengths)  # causal handled by tiles
    v = _live_values(v, key_lengths)
    out = np.zeros((b, h, sq, d))
    lse = np.full((b, h, sq), -np.inf)
    for i0 in range(0, sq, block_m):
        i1 = min(i0 + block_m, sq)
        qi = q[:, :, i0:i1]
        m_i = np.full((b, h, i1 - i0, 1), -np.inf)
        l_i = np.zeros((b, h, i1 - i0, 1))
        o_i = np.zeros((b, h, i1 - i0, d))
        # last key any row of this tile may see under the bottom-right causal mask
        k_end = min(sk, i1 - 1 + sk - sq + 1) if causal else sk
        for j0 in range(0, max(k_end, 0), block_n):
            j1 = min(j0 + block_n, sk)
            bias = bias_full[:, :, i0:i1, j0:j1]
            if causal:
                bias = np.where(causal_allowed(sq, sk)[i0:i1, j0:j1], bias, -np.inf)
            hidden = bias == -np.inf  # hidden whatever the score (NaN in K included)
            s_ij = np.where(hidden, -np.inf, qi @ np.swapaxes(k[:, :, j0:j1], -1, -2) * scale + bias)
            m_new = np.maximum(m_i, np.max(s_ij, axis=-1, keepdims=True))  # NaN propagates
            m_safe = np.where(m_new == -np.inf, 0.0, m_new)  # rows with nothing seen yet
            with np.errstate(invalid="ignore"):
                p = np.where(hidden, 0.0, np.exp(s_ij - m_safe))
                alpha = np.exp(np.where(m_i == -np.inf, -np.inf, m_i - m_safe))  # rescale old O, l
            l_i = alpha * l_i + np.sum(p, axis=-1, keepdims=True)
            o_i = alpha * o_i + p @ v[:, :, j0:j1]
            m_i = m_new
        ok, nan = l_i > 0, np.isnan(l_i)
        out[:, :, i0:i1] = np.where(ok, o_i / np.where(ok, l_i, 1.0), np.where(nan, np.nan, 0.0))
        with np.errstate(divide="ignore"):
            lse[:, :, i0:i1] = np.where(ok, m_i + np.log(np.where(ok, l_i, 1.0)),
                                        np.where(nan, np.nan, -np.inf))[..., 0]
    return (out, lse) if return_lse else out


# --- decode with a KV cache, split-KV ------------------------------------------------------
def decode_attention(q, k_cache, v_cache, lengths, scale=None):
    """One query token per sequence. q [B,Hq,1,D]; caches [B,Hkv,max_seq,D]; lengths [B]."""
    return attention(q, k_cache, v_cache, causal=False, scale=scale, key_lengths=lengths)


def decode_split_partials(q, k_cache, v_cache, lengths, num_splits, scale=None):
    """Flash-decoding step 1: attention over each of ``num_splits`` chunks of every sequence.

    Chunk c of sequence b covers keys [c*chunk, (c+1)*chunk) with chunk = ceil(len_b / splits).
    Returns o [splits, B, Hq, 1, D] and lse [splits, B, Hq, 1] (-inf for empty chunks).
    """
    lengths = np.asarray(lengths)
    b = q.shape[0]
    outs, lses = [], []
    for c in range(num_splits):
        lo = np.zeros(b, dtype=np.int64)
        hi = np.zeros(b, dtype=np.int64)
        for bi in range(b):
            chunk = -(-int(lengths[bi]) // num_splits)
            lo[bi], hi[bi] = min(c * chunk, lengths[bi]), min((c + 1) * chunk, lengths[bi])
        j = np.arange(k_cache.shape[2])[None, None, None, :]
        inside = (j >= lo.reshape(b, 1, 1, 1)) & (j < hi.reshape(b, 1, 1, 1))
        o, lse = attention(q, k_cache, v_cache, scale=scale, mask=np.where(inside, 0.0, -np.inf),
                           return_lse=True)
        outs.append(o)
        lses.append(lse)
    return np.stack(outs), np.stack(lses)


def merge_partials(o_parts, lse_parts):
    """Flash-decoding step 2: O = sum_c exp(lse_c - lse) O_c with lse = logsumexp_c lse_c."""
    o_parts, lse_parts = _f64(o_parts), _f64(lse_parts)
    m = np.max(lse_parts, axis=0)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lse_parts - m_safe)  # [splits, ...]
    total = np.sum(w, axis=0)
    out = np.sum(w[..., None] * o_parts, axis=0) / np.where(total > 0, total, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, m_safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    return np.where(total[..., None] > 0, out, 0.0), lse


# --- serving: packed sequences, paged caches (cupyattn.varlen, cupyattn.paged) ---------------
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, window=None,
                     softcap=None, return_lse=False):
    """flash_attn_varlen_func: q [total_q, Hq, D], k/v [total_k, Hkv, D] packed; sequence b is
    rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k/v,
    causal and window aligned bottom-right per sequence. Returns out [total_q, Hq, D] (and lse
    [Hq, total_q])."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    out = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if q1 == q0:
            continue
        o, l = attention(q[None, q0:q1].transpose(0, 2, 1, 3), k[None, k0:k1].transpose(0, 2, 1, 3),
                         v[None, k0:k1].transpose(0, 2, 1, 3), causal, scale, return_lse=True,
                         window=window, softcap=softcap)
        out[q0:q1] = o[0].transpose(1, 0, 2)
        lse[:, q0:q1] = l[0]
    return (out, lse) if return_lse else out


def paged_gather(pages, block_table, seq_lens):
    """The keys (or values) of each sequence from a paged cache: pages [num_pages, page_size,
    Hkv, D], block_table [B, max_pages] page ids, seq_lens [B] -> list of [seq_lens[b], Hkv, D]:
    position p of sequence b is row p % page_size of page block_table[b, p // page_size]."""
    pages = _f64(pages)
    ps = pages.shape[1]
    out = []
    for b, n in enumerate(np.asarray(seq_lens)):
        pos = np.arange(int(n))
        out.append(pages[np.asarray(block_table)[b, pos // ps], pos % ps])
    return out


def attention_paged(q, cu_seqlens_q, k_pages, v_pages, block_table, seq_lens, causal=False, scale=None,
                    window=None, softcap=None, return_lse=False):
    """Queries [total_q, Hq, D] (packed by cu_seqlens_q) over paged keys/values: sequence b has
    seq_lens[b] keys (its new tokens included, last), so causal is bottom-right per sequence
    (chunked prefill). Returns out [total_q, Hq, D] (and lse [Hq, total_q])."""
    ks, vs = paged_gather(k_pages, block_table, seq_lens), paged_gather(v_pages, block_table, seq_lens)
    cu_k = np.concatenate([[0], np.cumsum([len(x) for x in ks])]).astype(np.int64)
    hkv, d = k_pages.shape[2], k_pages.shape[3]
    cat = (lambda xs: np.concatenate(xs) if xs else np.zeros((0, hkv, d)))
    return attention_varlen(q, cat(ks), cat(vs), cu_seqlens_q, cu_k, causal, scale, window, softcap,
                            return_lse)


def decode_attention_paged(q, k_pages, v_pages, block_table, seq_lens, scale=None, window=None,
                           softcap=None):
    """One query per sequence, q [B, Hq, D], over seq_lens[b] paged keys -> [B, Hq, D]."""
    b = q.shape[0]
    return attention_paged(q, np.arange(b + 1), k_pages, v_pages, block_table, seq_lens, False, scale,
                           window, softcap)


def paged_append_qkv(qkv, k_pages, v_pages, block_table, seq_lens, num_heads, base=10000.0,
                     style="adjacent", num_new=None):
    """``PagedKVCache.append_qkv``: qkv [B, T, (Hq + 2 Hkv) D]; token t < num_new[b] (default T)
    of sequence b goes, RoPE'd at position seq_lens[b] + t, to that position's page row. Returns
    (q [B, Hq, T, D] rotated, k_pages, v_pages, seq_lens + num_new) as new float64 arrays."""
    ps = k_pages.shape[1]
    q, k, v, lens, counts = _rope_qkv(qkv, num_heads, k_pages.shape[2], seq_lens, num_new, base, style)
    kp, vp = _f64(k_pages).copy(), _f64(v_pages).copy()
    for i in range(len(lens)):
        for tt in range(int(counts[i])):
            p = int(lens[i]) + tt
            page = int(np.asarray(block_table)[i, p // ps])
            kp[page, p % ps] = k[i, :, tt]
            vp[page, p % ps] = v[i, :, tt]
    return q, kp, vp, lens + counts


# --- layer ops of a Llama-style model -------------------------------------------------------
def rmsnorm(x, weight, eps=1e-5):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim."""
    x = _f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f64(weight)


def rope(x, positions, base=10000.0, style="adjacent", freq_div=None, rotary_dim=None):
    """Rotary embedding of x [B, H, T, D] at integer positions [B, T].

    ``adjacent`` rotates pairs (x[2i], x[2i+1]) (GGUF / llama.cpp "normal"); ``neox`` rotates
    (x[i], x[i + D/2]). Pair i turns by angle ``pos * base**(-2i/D) / freq_div[i]`` (freq_div
    None: 1). ``rotary_dim`` (None: D): only the first rotary_dim dims turn, as if they were
    the row (D = rotary_dim above); the others are copied.
    """
    x = _f64(x)
    if rotary_dim is not None and rotary_dim != x.shape[-1]:
        head = rope(x[..., :rotary_dim], positions, base, style, freq_div)
        return np.concatenate([head, x[..., rotary_dim:]], axis=-1)
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [D/2]
    if freq_div is not None:
        inv = inv / _f64(freq_div)
    ang = np.asarray(positions, dtype=np.float64)[:, None, :, None] * inv  # [B,1,T,D/2]
    c, s = np.cos(ang), np.sin(ang)
    if style == "adjacent":
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out
    if style == "neox":
        x0, x1 = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
    raise ValueError(f"unknown rope style {style!r}")


def silu(x):
    x = _f64(x)
    return x / (1.0 + np.exp(-x))


def swiglu(gate, up):
    """``silu(gate) * up``."""
    return silu(gate) * _f64(up)


def geglu(gate, up):
    """``gelu(gate) * up`` with GELU's tanh form (Gemma's gate)."""
    g = _f64(gate)
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3))) * _f64(up)


def softcap(x, cap):
    """``cap * tanh(x / cap)``."""
    return cap * np.tanh(_f64(x) / cap)


def embedding(ids, table):
    """Rows of table [V, D] picked by integer ids [...] -> [..., D]."""
    return _f64(table)[np.asarray(ids)]


def add_rmsnorm(x, r, weight, eps=1e-5):
    """Residual add then RMSNorm: returns (x + r, rmsnorm(x + r, weight, eps))."""
    s = _f64(x) + _f64(r)
    return s, rmsnorm(s, weight, eps)


def _rope_qkv(qkv, num_heads, hkv, lengths, num_new, base, style, freq_div=None):
    """Split qkv [B, T, (Hq + 2 Hkv) D] into heads and rotate q and k at positions lengths[b] + t
    (``freq_div`` as :func:`rope`'s): -> (q [B, Hq, T, D], k [B, Hkv, T, D], v, lengths int64,
    counts int64 (num_new or T))."""
    qkv = _f64(qkv)
    b, t, width = qkv.shape
    heads = qkv.reshape(b, t, num_heads + 2 * hkv, width // (num_heads + 2 * hkv)).transpose(0, 2, 1, 3)
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = np.full(b, t) if num_new is None else np.asarray(num_new, dtype=np.int64)
    pos = lengths[:, None] + np.arange(t)[None, :]
    q = rope(heads[:, :num_heads], pos, base, style, freq_div)
    k = rope(heads[:, num_heads:num_heads + hkv], pos, base, style, freq_div)
    return q, k, heads[:, num_heads + hkv:], lengths, counts


def qkv_rope_append(qkv, k_cache, v_cache, lengths, num_heads, base=10000.0, style="adjacent",
                    num_new=None, freq_div=None):
    """The fused RoPE + KV-cache append of one layer (``KVCache.append_qkv``).

    qkv [B, T, (Hq + 2 Hkv) D] packs q | k | v heads; caches [B, Hkv, S, D]; lengths [B]. Token t
    of sequence b sits at position lengths[b] + t; tokens t < num_new[b] (default all T) are
    appended; ``freq_div``: per-pair frequency divisors as :func:`rope`'s. Returns (q [B, Hq, T,
    D] rotated, k_cache, v_cache, lengths) as new float64 arrays.
    """
    q, k, v, lengths, counts = _rope_qkv(qkv, num_heads, k_cache.shape[1], lengths, num_new, base, style,
                                         freq_div)
    kc, vc = _f64(k_cache).copy(), _f64(v_cache).copy()
    for i in range(len(lengths)):
        n, p0 = int(counts[i]), int(lengths[i])
        kc[i, :, p0:p0 + n] = k[i, :, :n]
        vc[i, :, p0:p0 + n] = v[i, :, :n]
    return q, kc, vc, lengths + counts


# --- sampling (cupyattn.sampling) -------------------------------------------------------------
PHILOX_M = (0xD2511F53, 0xCD9E8D57)   # Philox-4x32 multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)   # key schedule increments (Weyl sequence)


def philox4x32(counter, key, rounds=10):
    """Philox-4x32-R (Salmon et al., SC'11, as in Random123): counter [..., 4], key [..., 2]
    uint32 -> [..., 4] uint32."""
    m32 = np.uint64(0xFFFFFFFF)
    c = [np.asarray(counter, dtype=np.uint64)[..., j] for j in range(4)]
    k0, k1 = (np.asarray(key, dtype=np.uint64)[..., j] for j in range(2))
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + np.uint64(PHILOX_W[0])) & m32, (k1 + np.uint64(PHILOX_W[1])) & m32
        p0, p1 = np.uint64(PHILOX_M[0]) * c[0], np.uint64(PHILOX_M[1]) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & m32, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & m32]
    return np.stack(c, axis=-1).astype(np.uint32)


def sampling_uniform(seed, step):
    """The device sampler's uniform in [0, 1) for a 64-bit seed at a step: 53 bits from the
    first two words of Philox-4x32-10(counter=(step, 0, 0, 0), key=(seed lo, seed hi))."""
    x, y = (int(w) for w in philox4x32([step, 0, 0, 0], [seed & 0xFFFFFFFF, seed >> 32])[:2])
    return ((x >> 5) * 67108864.0 + (y >> 6)) / 9007199254740992.0


def _keep_mask(z, weights, top_k, top_p, exact):
    """Bool mask of the device sampler's cuts (ties kept) on values z with masses ``weights``
    (Python ints when ``exact``: the kernel's integer cut ``ceil(top_p * total)``)."""
    keep = ~np.isnan(z)
    if 0 < top_k < z.size and keep.sum() >= top_k:  # else the k-th largest is NaN: no cut
        keep &= z >= np.sort(z[keep])[::-1][top_k - 1]
    if top_p < 1.0:
        total = weights[keep].sum()
        need = max(1, min(total, math.ceil(top_p * total))) if exact else top_p * total
        cum = 0
        for value in np.unique(z[keep])[::-1]:  # distinct values, largest first
            cum += weights[keep & (z == value)].sum()
            if cum >= need:
                keep &= z >= value
                break
    return keep


def sampling_beta(temperature) -> np.float32:
    """The inverse temperature the samplers use, float32: +inf (greedy) for T = 0 or when 1/T
    overflows float32 (T below about 2.9e-39); 0 (every candidate equally likely) when 1/T is
    below float32's smallest normal number (T above about 8.5e37); else float32(1/T)."""
    t = float(temperature)
    if t <= 0.0:
        return np.float32(np.inf)
    with np.errstate(over="ignore"):
        inv32 = np.float32(1.0 / t)  # Python's 1/t is inf past float64; the cast rounds to nearest
    return np.float32(0.0) if inv32 < np.finfo(np.float32).tiny else inv32


def sampling_probs(logits, temperature, top_k=0, top_p=1.0):
    """float64 [V]: the distribution the samplers draw from (the device sampler before its 40-bit
    fixed point): softmax(logits * beta) over the candidates (logits neither NaN nor -inf), with
    beta = ``sampling_beta(temperature)``, cut to the top-k logits (ties at the k-th value kept)
    and then to the smallest most-likely set reaching top_p (ties at the cut kept whole).
    Greedy (beta = +inf): all mass on the first argmax. +inf logits, if any, share all the mass.
    No candidate: all zeros (the device sampler returns -1, the host Sampler raises)."""
    z = _f64(logits).reshape(-1)
    p = np.zeros_like(z)
    safe = np.where(np.isnan(z), -np.inf, z)
    if z.size == 0 or not safe.max() > -np.inf:
        return p
    beta = float(sampling_beta(temperature))
    if beta == np.inf:
        p[int(np.argmax(safe))] = 1.0
        return p
    top = safe.max()
    with np.errstate(invalid="ignore", over="ignore"):
        if top == np.inf:
            w = (safe == np.inf).astype(np.float64)
        else:
            w = np.where(safe > -np.inf, np.exp((safe - top) * beta), 0.0)
    keep = _keep_mask(z, w, top_k, top_p, exact=False)
    p[keep] = w[keep] / w[keep].sum()
    return p


def sampling_masses(logits, temperature, top_k=0, top_p=1.0, mass_bits=40) -> np.ndarray:
    """The device sampler's integer masses of one row after both cuts, re-implemented on the
    host (object array of Python ints, [V]; all 0 when nothing can be drawn): float32 logits,
    ``m_i = floor(exp((l_i - l_max) * beta) * 2^bits)`` in float32 as the kernel forms it (the
    difference halved first where it overflows float32), integer cuts. ``m / m.sum()`` is the
    distribution a sampled draw follows; greedy (beta = +inf) puts all of it on the first argmax."""
    l = np.asarray(logits).astype(np.float32).reshape(-1)
    safe = np.where(np.isnan(l), np.float32(-np.inf), l)
    w = np.zeros(l.size, dtype=object)
    w[:] = 0
    if not safe.max() > -np.inf:
        return w
    beta = sampling_beta(temperature)
    if beta == np.inf:
        w[int(np.argmax(safe))] = 1
        return w
    lmax = safe.max()
    full = 2 ** mass_bits
    f32 = np.float32
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        d = (safe - lmax).astype(f32)  # float32 subtraction, as the kernel
        x = (d * beta).astype(f32)
        # |l - l_max| beyond float32's range: (l/2 - l_max/2) * beta * 2, each step in float32
        wide = (d == -np.inf) & (safe > -np.inf) & (lmax < np.inf)
        x[wide] = ((f32(0.5) * safe[wide] - f32(0.5) * lmax).astype(f32) * beta).astype(f32) * f32(2.0)
        e = np.exp(x).astype(f32) * f32(2.0 ** mass_bits)
    for i in range(l.size):
        if not safe[i] > -np.inf or (d[i] == -np.inf and not wide[i]):
            continue  # NaN, -inf, or l_max = +inf over a finite logit: no mass
        w[i] = full if safe[i] >= lmax else int(np.floor(e[i]))
    keep = _keep_mask(l.astype(np.float64), w, top_k, float(np.float32(top_p)), exact=True)
    return np.where(keep, w, 0)


def sample_token(logits, temperature, top_k=0, top_p=1.0, seed=0, step=0, mass_bits=40):
    """The device sampler's exact choice for one row, re-implemented on the host: the masses of
    :func:`sampling_masses`, the Philox uniform of (seed, step), inverse CDF in id order. -1 for
    a row with no candidate (every logit NaN or -inf)."""
    mass = sampling_masses(logits, temperature, top_k, top_p, mass_bits)
    total = int(mass.sum())
    if total == 0:
        return -1
    if sampling_beta(temperature) == np.inf:
        return int(np.argmax(mass > 0))
    r = min(int(sampling_uniform(seed, step) * float(total)), total - 1)
    cum = np.cumsum(mass)
    return int(np.argmax(cum > r))
