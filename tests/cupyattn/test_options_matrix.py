"""Every kernel path x every option: compared with the float64 reference, or refused.

The cases are generated from cupyattn/options.py, the table the dispatch reads: for each entry
point and each impl the current device can run (plus the dispatch's own choice, impl=None /
"auto"), every option the entry point takes alone, every pair of them together (a greedy
covering by blocks of up to ``BLOCK`` options: each pair shares at least one case), and each
refused option beside ``out=`` (:func:`cases` says which paths need each option alone only). A
case whose options the table says the impl implements is compared with the float64 reference
(outputs NaN-poisoned first); a case with a refused option must raise a ValueError naming it
(or, for a layout, the stride) and leave ``out`` untouched. So a path that silently ignores an
option fails here, and turning a refusal into support in the table makes this test compare it.

Tiny shapes and one head dim per tile class keep the emulator's cost in seconds per path; the
CPU tier runs this file on emulated sm_90 (the GPU tier), sm_80 and sm_75
(tests/tiers.py's emulated_runs()).
"""
from __future__ import annotations

import itertools
import re
import zlib

import numpy as np
import pytest

from conftest import assert_close, device_cannot_run, nan_like, np_dtype, rand_with_outliers, to_host
from cupyattn import options as O
from cupyattn import reference as ref

BLOCK = 5  # options per combined case: every pair of options meets in at least one of them
# per impl: (dtype, head dim); one head dim per tile class (wgmma's smallest is 64)
SETUP = {"flash": ("float32", 32), "flash_mma": ("float16", 32), "naive": ("float16", 32),
         "wgmma": ("float16", 64), "wgmma_persistent": ("float16", 64),
         None: ("float16", 64),   # attention's impl=None: wgmma's pairs on sm_90
         # the packed entry points' impl=None: pairs where sm_90 takes wgmma_persistent
         # (config.ATTN_AUTO_PERSISTENT), flash_mma elsewhere
         ("attention_varlen", None): ("float16", 64), ("attention_paged", None): ("float16", 128),
         "simt": ("float32", 32), "mma": ("float16", 32), "auto": ("float16", 32)}
# options whose absence changes the reference: a path that ignores one of them cannot pass
CHANGES_VALUES = ("causal", "window", "softcap", "scale", "mask", "key_lengths")
# what a refusal of a layout names (call options are named as "<option>=")
LAYOUT_REFUSAL = {"broadcast": r"stride of 0 bytes", "negative_stride": r"stride of -\d+ bytes"}
ENTRIES = dict(O.ENTRY_IMPLS)
ENTRIES["PagedKVCache.decode"] = O.ENTRY_IMPLS["decode_attention_paged"]  # forwards to it


def table_entry(entry):
    """The options-table row of a matrix entry (PagedKVCache.decode is decode_attention_paged's)."""
    return "decode_attention_paged" if entry == "PagedKVCache.decode" else entry


def setup(entry, impl):
    """(dtype, head dim) of a path; impl None is the dispatch's choice: as attention's at D = 64
    (where sm_90 takes wgmma), for the packed entry points where sm_90 takes wgmma_persistent,
    "auto" for decode."""
    if impl is None and entry != "attention":
        return SETUP.get((entry, None)) or SETUP["auto"]
    return SETUP[impl]


def covering(opts, size=BLOCK):
    """Blocks of at most ``size`` of ``opts`` in which every pair of them meets once at least
    (greedy and deterministic: a block starts from the first pair not yet covered and adds the
    option that covers most new pairs)."""
    uncovered = list(itertools.combinations(opts, 2))
    blocks = []
    while uncovered:
        block = list(uncovered[0])
        while len(block) < size:
            gain = {o: sum((min(o, x, key=opts.index), max(o, x, key=opts.index)) in uncovered for x in block)
                    for o in opts if o not in block}
            best = max(gain, key=lambda o: (gain[o], -opts.index(o)), default=None)
            if best is None or gain[best] == 0:
                break
            block.append(best)
        block.sort(key=opts.index)
        blocks.append(tuple(block))
        uncovered = [p for p in uncovered if not set(p) <= set(block)]
    return blocks


def cases(entry, impl):
    """The option sets to run for ``impl`` of ``entry``: none, each alone, the pair covering of
    those it implements, each refused one beside out=. Where the path is another's under a
    choice that no option refuses (impl=None of the packed and decode entry points: an explicit
    impl's path, or its fallback where the kernel cannot take the call; PagedKVCache.decode:
    decode_attention_paged's), each option alone."""
    opts = [o for o in O.ENTRY_OPTIONS[table_entry(entry)]
            if not (entry == "PagedKVCache.decode" and o == "device_lengths")]  # the cache's are on the device
    singles = [()] + [(o,) for o in opts]
    if entry == "PagedKVCache.decode" or (impl is None and entry != "attention"):
        return singles
    refused = [o for o in opts if impl is not None and O.refused(table_entry(entry), impl, o)]
    ok = [o for o in opts if o not in refused]
    return singles + covering(ok) + [(o, "out") for o in refused if "out" in opts]


# --- inputs --------------------------------------------------------------------------------------
def place(rng, shape, dtype, *, seq_axis, strided=False, reverse=False, bcast=None):
    """A device array of ``shape`` (random, with outliers) laid out as an option asks: rows along
    ``seq_axis`` 2 apart in a larger buffer (strided), stored in reverse and read through a
    negative stride (reverse), one slice repeated along axis ``bcast`` by a 0 stride (broadcast).
    Returns it and the float64 values it holds."""
    import cupy

    src_shape = list(shape)
    if bcast is not None:
        src_shape[bcast] = 1
    src = rand_with_outliers(rng, tuple(src_shape)).astype(np_dtype(dtype))
    store = np.flip(src, seq_axis) if reverse else src
    if strided:
        wide = list(store.shape)
        wide[seq_axis] *= 2
        buf = cupy.asarray(np.zeros(wide, dtype=store.dtype))
        idx = [slice(None)] * len(shape)
        idx[seq_axis] = slice(None, None, 2)
        buf[tuple(idx)] = cupy.asarray(store)
        dev = buf[tuple(idx)]
    else:
        dev = cupy.asarray(np.ascontiguousarray(store))
    if reverse:
        idx = [slice(None)] * len(shape)
        idx[seq_axis] = slice(None, None, -1)
        dev = dev[tuple(idx)]
    if bcast is not None:
        dev = cupy.broadcast_to(dev, shape)
    return dev, to_host(dev)


def _layout(opts, name):
    """Which layouts of ``opts`` apply to input ``name`` of attention (q, k, v): broadcast -> k, v
    (over the batch); strided -> q, k; negative_stride -> v. (The packed and decode entry points
    apply every layout to q: Case._q_layout.)"""
    return dict(strided="strided" in opts and name in ("q", "k"),
                reverse="negative_stride" in opts and name == "v",
                broadcast="broadcast" in opts and name in ("k", "v"))


# --- one builder per entry point: (call, outputs to compare, reference) ---------------------------
class Case:
    """The inputs of one case, the call and its float64 reference."""

    def __init__(self, entry, impl, opts, rng):
        self.entry, self.impl, self.opts, self.rng = entry, impl, set(opts), rng
        self.dtype, self.d = setup(entry, impl)
        # 2 query heads for attention (each (batch, head) is a block: the emulator's cost), 4 for
        # decode (whose "auto" takes the mma kernel from a GQA group of 4); gqa: 1 kv head
        self.hq, self.hkv = (2 if entry.startswith("attention") else 4), (1 if "gqa" in self.opts else 2)
        self.kw = {} if impl is None else {"impl": impl}
        on = self.opts.__contains__
        if on("causal"):
            self.kw["causal"] = True
        if on("window"):
            self.kw["window"] = (4, 1)
        if on("softcap"):
            self.kw["softcap"] = 2.0
        if on("scale"):
            self.kw["scale"] = 0.3
        getattr(self, "_" + entry.replace(".", "_"))()

    def _q_layout(self, shape, seq_axis, head_axis):
        """q of the packed and decode entry points: every layout applies to it."""
        on = self.opts.__contains__
        return place(self.rng, shape, self.dtype, seq_axis=seq_axis, strided=on("strided"),
                     reverse=on("negative_stride"), bcast=head_axis if on("broadcast") else None)

    def _out(self, shape):
        if "out" in self.opts:
            self.kw["out"] = nan_like(shape, self.dtype)

    def _attention(self):
        import cupy

        import cupyattn

        b, sq, sk, d = 2, 9, 17, self.d
        arrays = {}
        for name, h, s in (("q", self.hq, sq), ("k", self.hkv, sk), ("v", self.hkv, sk)):
            lay = _layout(self.opts, name)
            arrays[name] = place(self.rng, (b, h, s, d), self.dtype, seq_axis=2, strided=lay["strided"],
                                 reverse=lay["reverse"], bcast=0 if lay["broadcast"] else None)
        (q, qh), (k, kh), (v, vh) = arrays["q"], arrays["k"], arrays["v"]
        mask = kl = None
        if "mask" in self.opts:
            m = np.where(self.rng.random((1, self.hq, sq, sk)) < 0.15, -np.inf, self.rng.standard_normal((1, self.hq, sq, sk)))
            self.kw["mask"], mask = cupy.asarray(m.astype(np.float32)), m.astype(np.float32)
        if "key_lengths" in self.opts:
            self.kw["key_lengths"] = kl = [sk, 6]
        self._out((b, self.hq, sq, d))
        lse = "return_lse" in self.opts
        if lse:
            self.kw["return_lse"] = True
        self.call = lambda: cupyattn.attention(q, k, v, **self.kw)
        self.reference = lambda kw: ref.attention(qh, kh, vh, causal=kw.get("causal", False), scale=kw.get("scale"),
                                                  mask=mask if "mask" in kw else None, key_lengths=kw.get("key_lengths"),
                                                  window=kw.get("window"), softcap=kw.get("softcap"), return_lse=lse)

    def _packed(self, lens_q, lens_k):
        """q [total_q, Hq, D] and k, v [total_k, Hkv, D] for attention_varlen."""
        d = self.d
        q, qh = self._q_layout((sum(lens_q), self.hq, d), 0, 1)
        lay = _layout(self.opts, "k")
        k, kh = place(self.rng, (sum(lens_k), self.hkv, d), self.dtype, seq_axis=0, strided=lay["strided"])
        v, vh = place(self.rng, (sum(lens_k), self.hkv, d), self.dtype, seq_axis=0,
                      reverse=_layout(self.opts, "v")["reverse"])
        return (q, qh), (k, kh), (v, vh)

    def _offsets(self, lens):
        import cupy

        cu = np.cumsum([0] + lens).astype(np.int32)
        return (cupy.asarray(cu) if "device_lengths" in self.opts else cu), cu

    def _attention_varlen(self):
        import cupyattn

        lens_q, lens_k = [3, 1, 5], [6, 4, 9]
        (q, qh), (k, kh), (v, vh) = self._packed(lens_q, lens_k)
        (cq, cqh), (ck, ckh) = self._offsets(lens_q), self._offsets(lens_k)
        self._out(q.shape)
        lse = "return_lse" in self.opts
        if lse:
            self.kw["return_lse"] = True
        self.call = lambda: cupyattn.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), **self.kw)
        self.reference = lambda kw: ref.attention_varlen(qh, kh, vh, cqh, ckh, kw.get("causal", False), kw.get("scale"),
                                                         kw.get("window"), kw.get("softcap"), lse)

    def _pages(self, lens):
        """Shuffled pages of 4 tokens holding ``lens`` keys and values (test_varlen_paged's), of 8 for
        wgmma_persistent, which takes no smaller page (config.ATTN_WGMMA_MIN_PAGE), and for
        impl=None, which takes it there on sm_90; in the HND layout under hnd_pages."""
        import cupy
        from test_varlen_paged import _shuffled_pages

        page = 8 if self.impl in ("wgmma_persistent", None) else 4
        layout = "HND" if "hnd_pages" in self.opts else "NHD"
        if layout == "HND":
            self.kw["layout"] = layout
        kp, vp, table, kh, vh, th = _shuffled_pages(self.rng, lens, page, self.hkv, self.d, self.dtype, layout=layout)
        dev_lens = cupy.asarray(np.asarray(lens, dtype=np.int32)) if "device_lengths" in self.opts else lens
        return kp, vp, table, kh, vh, th, dev_lens

    def _attention_paged(self):
        import cupyattn

        lens, b, d, sq = [6, 9], 2, self.d, 3
        kp, vp, table, kh, vh, th, sl = self._pages(lens)
        if "packed_q" in self.opts:  # 2 and 3 new tokens
            lens_q = [2, 3]
            q, qh = self._q_layout((sum(lens_q), self.hq, d), 0, 1)
            (cq, cqh) = self._offsets(lens_q)
            self.kw.update(cu_seqlens_q=cq, max_seqlen_q=max(lens_q))
            packed, unpack, unpack_lse = qh, (lambda o: o), (lambda l: l)
        else:  # q [B, Hq, Sq, D]: every sequence adds Sq tokens
            q, qh = self._q_layout((b, self.hq, sq, d), 2, 1)
            cqh = np.arange(b + 1) * sq
            packed = qh.transpose(0, 2, 1, 3).reshape(-1, self.hq, d)
            unpack = lambda o: o.reshape(b, sq, self.hq, d).transpose(0, 2, 1, 3)  # noqa: E731
            unpack_lse = lambda l: l.reshape(self.hq, b, sq).transpose(1, 0, 2)  # noqa: E731
        self._out(q.shape)
        lse = "return_lse" in self.opts
        if lse:
            self.kw["return_lse"] = True
        self.call = lambda: cupyattn.attention_paged(q, kp, vp, table, sl, **self.kw)

        def reference(kw):
            r = ref.attention_paged(packed, cqh, kh, vh, th, lens, kw.get("causal", False), kw.get("scale"),
                                    kw.get("window"), kw.get("softcap"), lse)
            return (unpack(r[0]), unpack_lse(r[1])) if lse else unpack(r)
        self.reference = reference

    def _decode_common(self, lens):
        """q [B, Hq, D] and the decode options (splits, workspace, fused combine)."""
        import cupy

        b, d = len(lens), self.d
        q, qh = self._q_layout((b, self.hq, d), 0, 1)  # strided, reversed over the batch
        splits = 3 if {"num_splits", "workspace"} & self.opts else None
        if splits:
            self.kw["num_splits"] = splits
        if "fused_combine" in self.opts:
            self.kw["fused_combine"] = True
        if "split_rule" in self.opts:  # (its combine is fused unless told otherwise)
            self.kw["split_rule"] = "waves"
        if "workspace" in self.opts:
            ws = (cupy.full((splits, b, self.hq, d), np.nan, np.float32), cupy.full((splits, b, self.hq), np.nan, np.float32))
            if {"fused_combine", "split_rule"} & self.opts:
                ws += (cupy.zeros((b, self.hq), np.uint32),)
            self.kw["workspace"] = ws
        return q, qh

    def _decode_reference(self, qh, kh, vh, lens):
        """Decode as packed attention: one query per sequence at position len - 1."""
        cq = np.arange(len(lens) + 1)
        return lambda kw: ref.attention_varlen(qh, kh, vh, cq, np.cumsum([0] + lens), False, kw.get("scale"),
                                               (kw["window"][0], -1) if "window" in kw else None, kw.get("softcap"))

    def _decode_attention(self):
        import cupyattn

        lens, d = [13, 5], self.d
        q, qh = self._decode_common(lens)
        cache = cupyattn.KVCache(1, len(lens), self.hkv, 32, d, np_dtype(self.dtype))
        k, kh = place(self.rng, (len(lens), self.hkv, 13, d), self.dtype, seq_axis=2)
        v, vh = place(self.rng, (len(lens), self.hkv, 13, d), self.dtype, seq_axis=2)
        cache.append(0, k, v, num_new=lens)
        packed = [np.concatenate([x[i, :, :n].transpose(1, 0, 2) for i, n in enumerate(lens)]) for x in (kh, vh)]
        self._out((len(lens), self.hq, 1, d))
        self.call = lambda: cupyattn.decode_attention(q[:, :, None], cache, 0, **self.kw)
        r = self._decode_reference(qh, *packed, lens)
        self.reference = lambda kw: r(kw)[:, :, None]

    def _decode_attention_paged(self):
        import cupyattn

        lens = [13, 5]
        q, qh = self._decode_common(lens)
        kp, vp, table, kh, vh, th, sl = self._pages(lens)
        self._out((len(lens), self.hq, self.d))
        self.call = lambda: cupyattn.decode_attention_paged(q, kp, vp, table, sl, **self.kw)
        packed = [np.concatenate(ref.paged_gather(x, th, lens)) for x in (kh, vh)]
        self.reference = self._decode_reference(qh, *packed, lens)

    def _PagedKVCache_decode(self):
        import cupyattn

        lens, d = [13, 5], self.d
        q, qh = self._decode_common(lens)
        cache = cupyattn.PagedKVCache(1, 2, self.hkv, d, num_pages=8, page_size=4, dtype=np_dtype(self.dtype),
                                      layout="HND" if "hnd_pages" in self.opts else "NHD")
        k, kh = place(self.rng, (2, self.hkv, 13, d), self.dtype, seq_axis=2)
        v, vh = place(self.rng, (2, self.hkv, 13, d), self.dtype, seq_axis=2)
        cache.append(0, k, v, num_new=lens)
        packed = [np.concatenate([x[i, :, :n].transpose(1, 0, 2) for i, n in enumerate(lens)]) for x in (kh, vh)]
        self._out((2, self.hq, d))
        self.call = lambda: cache.decode(q, 0, **self.kw)
        self.reference = self._decode_reference(qh, *packed, lens)


# --- the matrix ----------------------------------------------------------------------------------
def _paths():
    return [pytest.param(e, i, id=f"{e}-{i}") for e, impls in ENTRIES.items() for i in (None,) + impls]


def _op(entry):
    return "attention" if entry.startswith("attention") else "decode"


def _refusal(entry, impl, opts):
    """The ValueError pattern a case must raise, or None when the path implements every option
    (impl=None never refuses one)."""
    fn = table_entry(entry)
    bad = [o for o in opts if impl is not None and O.refused(fn, impl, o)]
    return "|".join(LAYOUT_REFUSAL.get(o, rf"{fn}\(\): impl='{impl}' does not implement {re.escape(O.argument(o))}")
                    for o in bad) or None


def _compare(case, got, want):
    import cupy

    lse = case.kw.get("return_lse")
    out, want_out = (got[0], want[0]) if lse else (got, want)
    if "out" in case.kw:
        assert out is case.kw["out"], "out= was not the returned array"
    assert_close(out, want_out, case.dtype)
    if lse:
        l, wl = to_host(got[1]), want[1]
        assert np.array_equal(np.isfinite(l), np.isfinite(wl)), "lse: rows that see no key differ"
        fin = np.isfinite(wl)
        np.testing.assert_allclose(l[fin], wl[fin], rtol=2e-3, atol=2e-3)
    if "workspace" in case.kw:  # the call used the caller's partials, not buffers of its own
        assert not bool(cupy.isnan(case.kw["workspace"][0]).all()), "workspace[0] was never written"
        if len(case.kw["workspace"]) == 3:
            assert not bool(case.kw["workspace"][2].any()), "the fused combine's counters are not back at 0"


@pytest.mark.gpu
@pytest.mark.parametrize("entry,impl", _paths())
def test_every_option_on_every_path(entry, impl):
    """Each generated case of (entry, impl) on this device: the reference, or the refusal the
    table states; all failures of the path are reported together."""
    import cupy

    dtype, d = setup(entry, impl)
    if impl is not None and (why := device_cannot_run(_op(entry), impl, dtype, d)):
        pytest.skip(why)
    failures = []
    for opts in cases(entry, impl):
        name = "+".join(opts) or "plain"
        rng = np.random.default_rng(zlib.crc32(f"{entry}/{impl}/{name}".encode()))
        case = Case(entry, impl, opts, rng)
        pattern = _refusal(entry, impl, opts)
        try:
            if pattern:
                with pytest.raises(ValueError, match=pattern):
                    case.call()
                if "out" in case.kw:
                    assert bool(cupy.isnan(case.kw["out"]).all()), "a refused call wrote out"
                continue
            want = case.reference(case.kw)
            _compare(case, case.call(), want)
            if len(opts) == 1 and opts[0] in CHANGES_VALUES:  # the option matters for these inputs
                plain = case.reference({k: v for k, v in case.kw.items() if k != opts[0]})
                w, p = (want[0], plain[0]) if case.kw.get("return_lse") else (want, plain)
                assert not np.allclose(np.nan_to_num(w), np.nan_to_num(p), rtol=0.05, atol=0.05), \
                    f"{opts[0]} does not change the reference here: ignoring it could pass"
        except (Exception, pytest.fail.Exception) as e:  # collected, reported below with the case
            failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    assert not failures, f"{len(failures)} case(s) of {entry} impl={impl!r} failed:\n" + "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["decode_attention_paged", "attention_paged"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_a_paged_cache_layout_travels_with_its_pages(entry, layout):
    """A PagedKVCache's pages are read in its layout: given the cache itself (``f(q, cache,
    layer)``), its pages with no layout (looked up from the cache they belong to) or with the
    right one; a layout that contradicts the cache's is refused naming ``layout``, before anything
    is written. 2 kv heads and pages of 4 tokens: HND pages read as NHD would pass the shape checks."""
    import cupy

    import cupyattn

    dtype, d = "float32", 32
    impl = "simt" if entry.startswith("decode") else "flash"
    rng = np.random.default_rng(59)
    lens, hq, hkv = [13, 5], 4, 2
    cache = cupyattn.PagedKVCache(1, 2, hkv, d, num_pages=8, page_size=4, dtype=np_dtype(dtype), layout=layout)
    k, kh = place(rng, (2, hkv, 13, d), dtype, seq_axis=2)
    v, vh = place(rng, (2, hkv, 13, d), dtype, seq_axis=2)
    cache.append(0, k, v, num_new=lens)
    kp = [np.concatenate([x[i, :, :n].transpose(1, 0, 2) for i, n in enumerate(lens)]) for x in (kh, vh)]
    if entry.startswith("decode"):
        q, qh = place(rng, (2, hq, d), dtype, seq_axis=0)
        want = ref.attention_varlen(qh, kp[0], kp[1], np.arange(3), np.cumsum([0] + lens), False)
        call = cupyattn.decode_attention_paged
    else:  # 2 new tokens per sequence (the last two cached), causal
        q, qh = place(rng, (2, hq, 2, d), dtype, seq_axis=2)
        packed = qh.transpose(0, 2, 1, 3).reshape(-1, hq, d)
        want = ref.attention_varlen(packed, kp[0], kp[1], np.arange(3) * 2, np.cumsum([0] + lens), True)
        want = want.reshape(2, 2, hq, d).transpose(0, 2, 1, 3)
        call = lambda *a, **kw: cupyattn.attention_paged(*a, causal=True, **kw)  # noqa: E731
    raw = (cache.k[0], cache.v[0], cache.block_table, cache.lengths[0])
    for args, kw in (((cache, 0), {}), (raw, {}), (raw, {"layout": layout}), ((cache, 0), {"layout": layout})):
        assert_close(call(q, *args, impl=impl, **kw), want, dtype)
    wrong = "NHD" if layout == "HND" else "HND"
    out = nan_like(want.shape, dtype)
    with pytest.raises(ValueError, match=rf"{entry}\(\): .*layout='{wrong}'.*pass layout='{layout}'"):
        call(q, *raw, impl=impl, layout=wrong, out=out)
    with pytest.raises(ValueError, match=rf"{entry}\(\): layout='{wrong}' but the PagedKVCache passed holds {layout}"):
        call(q, cache, 0, impl=impl, layout=wrong, out=out)
    with pytest.raises(TypeError, match=rf"{entry}\(\): block_table and seq_lens come from the PagedKVCache"):
        call(q, cache, 0, cache.block_table, impl=impl, out=out)
    assert bool(cupy.isnan(out).all()), "a refused call wrote out"


# --- CPU tier: the generation and the documentation ---------------------------------------------
def test_covering_meets_every_pair_in_few_blocks():
    opts = list("abcdefghijkl")
    blocks = covering(opts)
    assert all(2 <= len(b) <= BLOCK for b in blocks)
    for p in itertools.combinations(opts, 2):
        assert any(set(p) <= set(b) for b in blocks), p
    assert len(blocks) <= 12  # 66 pairs, 10 per block of 5: 8 at best (Schoenheim's bound)
    assert covering(["a"]) == [] and covering(["a", "b"]) == [("a", "b")]


def test_cases_cover_every_option_of_every_path():
    for entry, impls in ENTRIES.items():
        for impl in (None,) + impls:
            cs = cases(entry, impl)
            opts = set(itertools.chain(*cs))
            assert opts == set(O.ENTRY_OPTIONS[table_entry(entry)]) - ({"device_lengths"} if "." in entry else set())
            assert all((o,) in cs for o in opts)
            if impl is not None and "." not in entry:  # every pair of implemented options meets in a case
                ok = [o for o in opts if not O.refused(entry, impl, o)]
                assert all(any(set(p) <= set(c) for c in cs) for p in itertools.combinations(ok, 2)), (entry, impl)
                assert all((o, "out") in cs for o in opts if O.refused(entry, impl, o))


def test_docs_options_table_is_generated_and_current():
    """docs/options.md is `python -m cupyattn options`'s output, from the table the dispatch
    reads (regenerate it with that command)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "options.md"
    assert path.read_text() == O.markdown(), "docs/options.md is stale: python -m cupyattn options > docs/options.md"


def test_options_table_matches_the_entry_points():
    """Every option of the table is one the entry point's signature takes (or a layout of its
    inputs), and every impl one its impl= accepts; the dispatch's refusal names the option."""
    import inspect

    import cupyattn
    from cupyattn import varlen

    params = {"packed_q": "cu_seqlens_q", "device_lengths": None, "scale": "scale", "hnd_pages": "layout"}
    for entry, opts in O.ENTRY_OPTIONS.items():
        sig = inspect.signature(getattr(cupyattn, entry)).parameters
        for o in opts:
            if o in O.LAYOUTS or params.get(o, o) is None:
                continue
            assert params.get(o, o) in sig, (entry, o)
        for impl in O.ENTRY_IMPLS[entry]:
            for o, why in O.REFUSED.get((entry, impl), {}).items():
                assert o in opts and why, (entry, impl, o)
    assert O.ENTRY_IMPLS["attention"] == cupyattn.ATTENTION_IMPLS
    assert O.ENTRY_IMPLS["attention_varlen"] == O.ENTRY_IMPLS["attention_paged"] == varlen.IMPLS
    with pytest.raises(ValueError, match=r"f\(\): impl='wgmma' does not implement window= \(not in kernels_cu.*\); "
                                         r"impl='flash', impl='flash_mma', impl='wgmma_persistent' or impl=None"):
        O.check("f", "attention", "wgmma", ["causal", "window"])
    # a refusal names the caller's argument, not the table's key
    with pytest.raises(ValueError, match=r"does not implement layout='HND' .*impl='flash', impl='flash_mma' or"):
        O.check("attention_paged", "attention_paged", "wgmma_persistent", ["hnd_pages"])
    for entry, opts in O.ENTRY_OPTIONS.items():
        for o in opts:
            arg = O.argument(o)
            assert o in O.LAYOUTS or o == "device_lengths" or arg.rstrip("=").split("=")[0] in params.values() \
                or arg.rstrip("=") in inspect.signature(getattr(cupyattn, entry)).parameters, (entry, o, arg)
    assert O.supports("attention", "wgmma", ["causal", "mask"]) and not O.supports("attention", "naive", ["softcap"])
    assert "| `wgmma` | yes | no | no |" in O.markdown()
    assert O.supports("attention", "wgmma_persistent", ["causal", "window", "softcap", "mask", "key_lengths"])
    assert "| `wgmma_persistent` | yes | yes | yes |" in O.markdown()
