"""Activation bytes per transformer layer: what one block saves for backward, per
micro-batch, as a function of the model's shape and the layout.

:func:`korthikanti_bytes` is the formula of Korthikanti et al. (2022), adapted to this
implementation term by term (docs/memory.md), for GPT-2's and Llama's blocks, each
recomputation mode, tensor and sequence parallelism, and the op-by-op or fused attention
core. :func:`expected_by_layer` applies it to a stage's blocks as its recomputation
policy runs them (what the run report prints beside its measurement);
:func:`rebuilt_core_bytes` is the transient a selectively recomputed block adds in
backward. The per-rank totals (parameters, gradients, optimizer state and the activation
peak along the schedule) are in :mod:`gridtrain.memory.model`; the measurement these
are checked against is :mod:`gridtrain.runtime.activation_meter`.

Under context parallelism (``cp`` > 1) a block runs on the ``S / cp`` tokens its rank
holds, so every per-token term is the same with ``seq`` the local length, and the
attention core is the cp core of gridtrain/parallel/context_parallel.py: blockwise, it
keeps its inputs, its output and a log-sum-exp per query (nothing of ``seq x seq``), with
the gathered keys and values under ``--cp-comm allgather`` (:mod:`gridtrain.memory.cp`).
With documents it keeps the same (each chunk pair is a union of per-document blocks of the
same fused kernel); a block's transient memory is the fused kernel's own (on CUDA flash
or memory-efficient attention, parallel/attention_blocks.py), plus its output and
log-sum-exp merged in the accumulation dtype.
"""

from __future__ import annotations

import torch

from gridtrain.memory.cp import wide_bytes as _wide_bytes
from gridtrain.memory.moe import moe_mlp_bytes_per_token


def dropout_mask_bytes(device: torch.device, element_bytes: int) -> int:
    """Bytes per element of the mask dropout saves: CUDA's fused kernel keeps a bool mask;
    on CPU torch multiplies by a scaled mask of the activation's own dtype and keeps that."""
    return 1 if torch.device(device).type == "cuda" else element_bytes


def korthikanti_bytes(*, seq: int, batch: int, hidden: int, heads: int, ffn: int, tp: int = 1,
                      sequence_parallel: bool = False, recompute: str = "none", element_bytes: int = 2,
                      mask_bytes: int = 1, dropout: bool = True, arch: str = "gpt2",
                      kv_hidden: int | None = None, attention: str = "math", cp: int = 1,
                      cp_comm: str = "ring", attn_hidden: int | None = None, qk_norm: str | None = None,
                      mlp_bytes: float | None = None, value_hidden: int | None = None,
                      latent: int = 0) -> float:
    """Activation bytes one transformer layer saves for backward, per micro-batch.

    Korthikanti et al. count, in 16-bit with 1-byte dropout masks and ffn = 4h,
    ``sbh (34 + 5as/h)``, with TP ``sbh (10 + 24/t + 5as/(ht))``. Term by term, for
    element size e and mask size m:

    * the two norms' inputs 2e, the inputs of QKV and of the first MLP linear(s) 2e, and
      the residual dropout masks 2m: replicated over TP, split by sequence parallelism (a
      column-parallel layer keeps its input shard and all-gathers it again in backward);
    * Q, K, V 3e and the output projection's input e, split over TP. Llama's keys and
      values are its kv heads repeated for their query heads inside the attention core,
      so they cost as much as GPT-2's; with selective recomputation the core's inputs
      are kept instead: the un-repeated keys and values, 2e ``kv_hidden`` (this rank's
      kv heads times head size, whole kv heads per rank);
    * the MLP, split over TP: GPT-2 keeps GELU's input and output, 2e * ffn/h; Llama's
      SwiGLU keeps gate's output (silu's input), silu's output, up's output and their
      product (down's input), 4e * ffn/h;
    * attention scores: softmax output e, and with dropout its mask m and its output e,
      per (head, query, key): ``a s^2 b / t`` of them.

    That is the op-by-op core (``attention="math"``). Torch's fused kernel (``sdpa``)
    keeps no scores: it saves its inputs (the un-repeated keys and values: it reads
    shared kv heads in place), its output (a tensor of its own: the projection keeps
    the copy that joins the heads) and one fp32 log-sum-exp per (head, query); dropout
    is drawn again from the RNG state in backward. That assumes torch runs a fused
    kernel (flash or memory-efficient) for the shapes at hand. ``--document-mask`` keeps
    the same: the fused core then runs one fused causal block per document
    (parallel/attention_blocks.document_attention), keeping the inputs, one output (laid
    out as the fused kernel's, so the projection's input is a view of it) and one
    log-sum-exp per (head, query); no mask. (The op-by-op core with documents keeps its
    ``s x s`` scores as without them; its boolean ``[b, 1, s, s]`` mask is one tensor
    per micro-batch, shared by the layers, and not counted here.)

    ``selective`` drops the attention-score terms (they are recomputed); ``full`` keeps
    only the layer input, ``e sbh`` (``/ t`` under sequence parallelism). The norms'
    per-token statistics (one or two numbers a token) are left out.

    Context parallelism (``cp`` > 1; ``seq`` is then the rank's ``S / cp`` tokens): the
    cp attention core (whatever ``attention`` says) keeps q, the un-repeated k and v
    (``kv_hidden``; under ``cp_comm="allgather"`` the gathered ones, ``cp`` times as
    many, instead: Llama's, whose k and v are tensors of their own; GPT-2's local k and v
    are views of the fused q/k/v output that q keeps, so they stay), its output and one
    log-sum-exp per (query head, token) in the accumulation dtype (``max(e, 4)`` bytes). ``selective`` does not recompute that core
    (it already keeps no ``seq x seq`` tensor), so it keeps what ``none`` keeps.

    ``attn_hidden``: the width of the query heads together (``n_head x head_dim``; default
    ``hidden``), where a model sets its own head size (Qwen3: 32 heads of 128 on
    ``d = 2048``): q, the core's output and the output projection's input have it.
    ``qk_norm`` (``head``: Qwen3's, ``full``: OLMoE's): the queries' and keys' norms keep
    their inputs, ``e`` times the rank's query and key widths (``full`` under tp > 1: its
    input widened to fp32 and its normalised output, ``max(e, 4) + e``; the per-head
    statistics are left out, as the block norms' are). ``mlp_bytes``: per token, what the layer keeps
    in the place of the dense MLP's intermediates (``(4|2) e ffn / t``): a MoE layer's
    router, permuted rows and expert intermediates (:func:`gridtrain.memory.moe.
    moe_activation_terms`).

    Latent attention (MLA, models/mla.py): ``attn_hidden`` is the queries' and keys'
    width (``n_head x qk_head_dim``; ``kv_hidden`` the rank's keys', every head its own),
    ``value_hidden`` the values' (``n_head x v_head_dim``): the projection's input, the
    op-by-op core's values and those selective recomputation keeps have it, while the
    fused and cp cores take values padded to the keys' width and give an output that
    wide. ``latent``: features per token that the down-projections leave, whole on every
    tp rank and for the whole sequence (the norms' inputs and the up-projections'
    inputs: ``2 q_lora_rank + 2 kv_lora_rank + qk_rope_head_dim``).
    """
    tokens = seq * batch
    if recompute == "full":
        return tokens * hidden * element_bytes / (tp if sequence_parallel else 1)
    t = _terms(seq=seq, hidden=hidden, heads=heads, ffn=ffn, tp=tp, sequence_parallel=sequence_parallel,
               element_bytes=element_bytes, mask_bytes=mask_bytes, dropout=dropout, arch=arch, kv_hidden=kv_hidden,
               attention=attention, cp=cp, cp_comm=cp_comm, attn_hidden=attn_hidden, qk_norm=qk_norm,
               mlp_bytes=mlp_bytes, value_hidden=value_hidden, latent=latent)
    if recompute == "selective":
        return tokens * (t["before_core"] + t["core_inputs"] + t["after_core"])
    return tokens * (t["before_core"] + t["q_k_v"] + t["scores"] + t["after_core"])


def rebuilt_core_bytes(**shape) -> float:
    """Under selective recomputation, how far one layer's rebuilt attention core (held
    while its backward runs) lifts the bytes held above what the layer keeps: the core
    saves its scores terms again (and, for Llama, its repeated keys and values), while
    backward has already released everything the layer saved after its core (the
    projection's input, the second norm, the MLP, the dropout masks). Zero when the
    release is larger; per micro-batch, for the last block of a chunk (the worst). Zero
    under context parallelism: its core is not recomputed."""
    if shape.get("cp", 1) > 1:
        return 0.0
    t = _terms(**{k: v for k, v in shape.items() if k not in ("batch", "recompute")})
    return shape["seq"] * shape["batch"] * max(0.0, t["scores"] + t["repeated_kv"] - t["after_core"])


def _terms(*, seq: int, hidden: int, heads: int, ffn: int, tp: int, sequence_parallel: bool,
           element_bytes: int, mask_bytes: int, dropout: bool, arch: str = "gpt2",
           kv_hidden: int | None = None, attention: str = "math", cp: int = 1,
           cp_comm: str = "ring", attn_hidden: int | None = None, qk_norm: str | None = None,
           mlp_bytes: float | None = None, value_hidden: int | None = None, latent: int = 0) -> dict[str, float]:
    """Bytes per token of each part of a layer (see korthikanti_bytes)."""
    e, m, d = element_bytes, mask_bytes, int(dropout)
    sp = tp if sequence_parallel else 1
    llama = arch == "llama"
    fused = attention != "math"
    a = attn_hidden or hidden  # the query heads' width
    repeated = llama and kv_hidden is not None and kv_hidden < a / tp and not fused  # shared kv heads
    kv = kv_hidden if llama else a / tp  # this rank's keys (and values, but latent attention's)
    v = (value_hidden or a) / tp  # the values' width (of the output projection's input)
    padded = e * a / tp + 2 * e * kv  # q, k and v as the fused kernels take them
    core_inputs = padded - e * (kv - v) if value_hidden else padded
    mlp = (4 if llama else 2) * e * ffn / tp if mlp_bytes is None else mlp_bytes
    # the q/k norms' inputs; OLMoE's norm over a projection split over tp keeps its input
    # widened to fp32 and its normalised output instead (llama.ProjectionNorm)
    per_feature = e + _wide_bytes(e) if qk_norm == "full" and tp > 1 else e
    norms = per_feature * (a / tp + (kv_hidden if llama and kv_hidden is not None else a / tp)) if qk_norm else 0.0
    terms = {
        # first norm's input, q/k/v's input (and the q/k norms' inputs)
        "before_core": 2 * e * hidden / sp + norms + e * latent,
        # the core's q, k, v (op by op, Llama's k and v repeated per query head); fused, its
        # inputs as they are and its own output
        "q_k_v": padded + e * a / tp if fused else 2 * e * a / tp + e * v,
        "core_inputs": core_inputs,  # kept by selective
        "scores": heads / tp * 4 if fused else heads * seq / tp * (e + d * (e + m)),  # fused: fp32 log-sum-exp
        "repeated_kv": 2 * e * a / tp if repeated else 0.0,
        "after_core": e * v + hidden * (2 * e + 2 * m * d) / sp + mlp,
    }
    if cp > 1:
        terms.update(_cp_core(hidden=a, heads=heads, tp=tp, e=e,
                              kv_hidden=kv_hidden if llama and kv_hidden is not None else hidden / tp,
                              gathered=cp if cp_comm == "allgather" else 0, fused_qkv=not llama))
    return terms


def _cp_core(*, hidden: int, heads: int, tp: int, e: int, kv_hidden: float, gathered: int,
             fused_qkv: bool) -> dict[str, float]:
    """The attention core's terms under context parallelism (the rest of the layer is
    :func:`_terms`'s on the local tokens): the cp core keeps q, the local k and v (the
    ring's), or under all-gather the ``gathered`` ranks' k and v instead, its output and
    a wide log-sum-exp per query head; all of it also under selective recomputation
    (``core_inputs``), which leaves that core alone; no scores, no repeated kv heads.
    GPT-2's q, k and v are views of one fused projection's output, which the kept q holds
    whole, so there the local k and v stay beside the gathered ones."""
    local = 2 * e * kv_hidden if gathered == 0 or fused_qkv else 0.0
    kept = e * hidden / tp + local + 2 * e * kv_hidden * gathered + e * hidden / tp + heads / tp * _wide_bytes(e)
    return {"q_k_v": kept, "core_inputs": kept, "scores": 0.0, "repeated_kv": 0.0}


def layer_shape(m, *, batch: int, tp: int, sequence_parallel: bool, element_bytes: int,
                mask_bytes: int, cp: int = 1, cp_comm: str = "ring", layer: int | None = None,
                ep: int = 1, etp: int = 1) -> dict:
    """The keyword arguments of :func:`korthikanti_bytes` for model config ``m``
    (config.ModelConfig) at micro-batch ``batch`` on ``tp`` ranks; with ``cp`` > 1 for
    the ``seq_len / cp`` tokens of one cp rank (the keys ``cp`` and ``cp_comm`` are
    only there then: one rank's shape is the shape without context parallelism).
    ``layer``: the shape of that block, a MoE block's (``mlp_bytes``) where
    ``m.is_moe_layer(layer)`` (``ep``, ``etp``: its expert-parallel and expert-tensor-parallel
    sizes); without it, a dense
    block's. ``attn_hidden`` and
    ``qk_norm`` only where the model has them (its own head size, q/k norms)."""
    kv_per_rank = max(m.kv_heads // tp, 1)  # whole kv heads per rank: replicated when tp exceeds them
    shape = dict(seq=m.seq_len // cp, batch=batch, hidden=m.d_model, heads=m.n_head, ffn=m.ffn_size, tp=tp,
                 sequence_parallel=sequence_parallel, element_bytes=element_bytes, mask_bytes=mask_bytes,
                 dropout=m.dropout > 0, arch=m.arch, kv_hidden=kv_per_rank * m.head_dim, attention=m.attention)
    if cp > 1:
        shape.update(cp=cp, cp_comm=cp_comm)
    if m.n_head * m.head_dim != m.d_model:
        shape.update(attn_hidden=m.n_head * m.head_dim)
    if getattr(m, "mla", False):  # latent attention: every head its own key and value
        shape.update(attn_hidden=m.n_head * m.qk_head_dim, kv_hidden=m.n_head // tp * m.qk_head_dim,
                     value_hidden=m.n_head * m.v_head_dim,
                     latent=2 * m.q_lora_rank + 2 * m.kv_lora_rank + m.qk_rope_head_dim)
    if getattr(m, "qk_norm", None):
        shape.update(qk_norm=m.qk_norm)
    if layer is not None and m.is_moe_layer(layer):
        shape.update(mlp_bytes=moe_mlp_bytes_per_token(m, tp=tp, sequence_parallel=sequence_parallel and tp > 1,
                                                       element_bytes=element_bytes, ep=ep, etp=etp))
    return shape


def expected_by_layer(runs: list[tuple[tuple[int, ...], bool]], mode: str, micro_batches: int,
                      keep_last: bool, shape_of=None, **shape) -> dict[str, float]:
    """The formula's bytes per micro-batch for each block of a stage, given which runs of
    blocks are recomputed regions (charged to their first block) and whether the last
    micro-batch keeps everything. ``shape_of``: block id -> that block's shape, where
    the blocks differ (a MoE model's: :func:`layer_shape` with ``layer``); else every
    block has ``shape``."""
    kept_mode = "selective" if mode == "selective" else "none"
    out: dict[str, float] = {}
    for ids, recomputed in runs:
        for n, i in enumerate(ids):
            block = shape if shape_of is None else shape_of(i)
            value = (korthikanti_bytes(recompute="full", **block) if n == 0 else 0.0) if recomputed \
                else korthikanti_bytes(recompute=kept_mode, **block)
            if keep_last and mode != "none":
                value = ((micro_batches - 1) * value + korthikanti_bytes(recompute="none", **block)) / micro_batches
            out[f"blocks.{i}"] = value
    return out
