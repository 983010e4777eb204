"""tinylm's decode step as one persistent kernel launch (cupyattn.megakernel): the Llama op list.

Opt-in (``Transformer(megakernel=True)``, ``load(..., megakernel=True)``,
``python -m tinylm --megakernel``, or ``TINYLM_MEGAKERNEL=1``: cupyattn.config.TINYLM_MEGAKERNEL);
the fused step (5 kernels per layer) stays the default and the reference.

:func:`llama_ops` turns ModelArgs into the op list the host plans into per-block queues
(cupyattn.persistent): per layer the fused step's five kernels become five ops of many small
tiles (QKV with RoPE and the cache append, attention partials, their merge when the keys are
split, O projection + residual, gate|up + SwiGLU, down + residual), after an embedding op and
before the LM head and the sampling ops. Dependencies are as fine as the data allows: a kv head's
attention waits for the QKV tiles of its own heads only, a merge for its own partials; the
projections need whole vectors, so they wait for all tiles of the op before. Any Llama-family
model with 16-byte rows and head_dim a multiple of 16 (at most 128) runs through the same CUDA.

The split count of a step's attention depends only on its context bucket (as the other decode
steps' does, tinylm.model.context_bucket), so eager steps and graph replays of a bucket agree.
"""
from __future__ import annotations


from cupyattn import config
from cupyattn.megakernel import OPCODES, TILE_ROWS, LlamaStep
from cupyattn.persistent import Dep, Op, plan


def llama_ops(args, batch: int, splits: int, sample: bool = True) -> list[Op]:
    """The decode step of a Llama-style model (``args``: tinylm.config.ModelArgs) for ``batch``
    sequences with attention over ``splits`` key splits, as a topologically ordered op list;
    ``sample``: end with one sampling op per sequence (else the step stops at the logits)."""
    a, B = args, int(batch)
    hq, hkv, d, G = a.n_heads, a.n_kv_heads, a.head_dim, a.n_heads // a.n_kv_heads
    per_head = d // 16  # QKV tiles of one head (8 rotation pairs each)
    qkv_heads = hq + 2 * hkv
    # the kv group of each QKV tile's head: q head h -> h // G, k and v heads of kv head j -> j
    qkv_group = tuple((h // G if h < hq else (h - hq) % hkv) for h in range(qkv_heads) for _ in range(per_head))
    n_attn = B * hkv * splits
    ops = [Op("embed", OPCODES["embed"], 1)]
    prev = "embed"
    for i in range(a.n_layers):
        ops.append(Op(f"qkv.{i}", OPCODES["qkv"], qkv_heads * per_head, i, group_of=qkv_group, deps=(Dep(prev),)))
        # attention tile t = (b * Hkv + kvh) * splits + split waits for its kv group's QKV tiles
        attn_groups = tuple(((t // splits) % hkv,) for t in range(n_attn))
        ops.append(Op(f"attn.{i}", OPCODES["attn"], n_attn, i,
                      group_of=tuple(t // splits for t in range(n_attn)) if splits > 1 else None,
                      deps=(Dep(f"qkv.{i}", attn_groups),)))
        att = f"attn.{i}"
        if splits > 1:  # merge tile b * Hkv + kvh waits for its own splits' partials
            ops.append(Op(f"reduce.{i}", OPCODES["reduce"], B * hkv, i,
                          deps=(Dep(att, tuple((t,) for t in range(B * hkv))),)))
            att = f"reduce.{i}"
        ops.append(Op(f"oproj.{i}", OPCODES["oproj"], -(-a.dim // TILE_ROWS), i, deps=(Dep(att),)))
        ops.append(Op(f"gate_up.{i}", OPCODES["gate_up"], -(-a.ffn_dim // 8), i, deps=(Dep(f"oproj.{i}"),)))
        ops.append(Op(f"down.{i}", OPCODES["down"], -(-a.dim // TILE_ROWS), i, deps=(Dep(f"gate_up.{i}"),)))
        prev = f"down.{i}"
    ops.append(Op("lm_head", OPCODES["lm_head"], -(-a.vocab_size // TILE_ROWS), deps=(Dep(prev),)))
    if sample:
        ops.append(Op("sample", OPCODES["sample"], B, deps=(Dep("lm_head"),)))
    return ops


def step_splits(args, batch: int, length: int, blocks: int, most: int) -> int:
    """Key splits of a step whose longest sequence holds ``length`` keys (the lower end of its
    context bucket): at least config.MEGAKERNEL_MIN_KEYS_PER_SPLIT keys per split, no more
    attention tiles than blocks, at most config.MEGAKERNEL_MAX_SPLITS and ``most`` (the
    partials' room)."""
    want = -(-int(length) // config.MEGAKERNEL_MIN_KEYS_PER_SPLIT)
    room = max(1, blocks // (batch * args.n_kv_heads))
    return max(1, min(want, room, config.MEGAKERNEL_MAX_SPLITS, most))


class MegaDecoder:
    """The megakernel of one RunState: its LlamaStep (the state's buffers, the model's weights)
    and the plans it has uploaded, one per (split count, sampling)."""

    def __init__(self, model, state):
        a, p = model.args, model.params
        worst = plan(llama_ops(a, state.batch, 2, True), 1)  # merges present: the most counters
        self.args, self.batch = a, state.batch
        self.step = LlamaStep(tok_embd=p.tok_embd, output_norm=p.output_norm, output=p.output, layers=p.layers,
                              cache=state.cache, num_heads=a.n_heads, eps=a.norm_eps, rope_base=a.rope_base,
                              rope_style=a.rope_style, tokens=state.tokens, x=state.x, q=state.q_rot, att=state.att,
                              ffn=state.ffn, logits=state.logits, o_part=state.workspace[0],
                              lse_part=state.workspace[1], sampling=state.sampling,
                              counter_capacity=worst.n_counters)
        self.plans = {}

    def splits(self, length: int) -> int:
        from .model import context_bucket

        return step_splits(self.args, self.batch, 1 << (context_bucket(length) - 1), self.step.blocks,
                           self.step.max_splits)

    def run(self, length: int, sample: bool) -> None:
        """One step whose longest sequence then holds ``length`` keys: logits (and with
        ``sample`` the next ids in state.tokens); every layer's lengths advance by one."""
        splits = self.splits(length)
        key = (splits, bool(sample))
        dplan = self.plans.get(key)
        if dplan is None:
            dplan = self.plans[key] = self.step.plan(llama_ops(self.args, self.batch, splits, sample))
        self.step.launch(dplan, splits)


def instruction_counts(ops) -> dict:
    """Instructions per op kind (the part of an op's name before the layer), for reports."""
    out: dict = {}
    for op in ops:
        kind = op.name.split(".")[0]
        out[kind] = out.get(kind, 0) + op.tiles
    return out


__all__ = ["llama_ops", "step_splits", "MegaDecoder", "instruction_counts"]
