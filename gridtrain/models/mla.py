"""Multi-head latent attention (MLA: DeepSeek-V2 and V3), ``--attention mla`` (docs/mla.md).

Keys and values come from one low-rank latent per token, shared by every head: the
input is projected down to ``kv_lora_rank`` features (and, beside them, one rotary key
of ``qk_rope_head_dim`` features shared by all heads), the latent is normalised
(RMSNorm) and projected up to each head's unrotated key (``qk_nope_head_dim``) and value
(``v_head_dim``). Queries are projected directly, or (``q_lora_rank`` > 0) down to a
normalised latent of their own and up again. Per head, a query and a key are
``[unrotated | rotary]`` (``qk_head_dim`` = nope + rope), the rotary part turned by the
token's position (gridtrain's rotate_half convention, llama.Rotary, over the rotary
width; the Hugging Face importer de-interleaves DeepSeek's interleaved rows).

Parameter names (checkpoints and the Hugging Face mapping key on them), block N:
``blocks.N.attn.q.weight`` ``[n_head qk_head_dim, d]`` (no query compression) or
``blocks.N.attn.q_a.weight`` ``[q_lora_rank, d]``, ``q_a_norm.weight``
``[q_lora_rank]`` and ``q_b.weight`` ``[n_head qk_head_dim, q_lora_rank]``;
``kv_a.weight`` ``[kv_lora_rank + qk_rope_head_dim, d]`` (rows: the latent, then the
shared rotary key), ``kv_a_norm.weight`` ``[kv_lora_rank]``, ``kv_b.weight``
``[n_head (qk_nope_head_dim + v_head_dim), kv_lora_rank]`` (per head: the key's
unrotated part, then the value), ``proj.weight`` ``[d, n_head v_head_dim]``.

**Tensor parallelism.** Each rank computes ``n_head / tp`` whole heads, as
llama.Attention does: q (or q_b) and kv_b are column-parallel by heads, proj
row-parallel. The down-projections q_a and kv_a and the two latent norms are whole on
every rank (every head reads the latents), and each rank's copy sees only its own
heads, so its gradient is a partial sum: they carry ``ShardSpec(0, replicas=tp)`` (one
slice held by every rank, as llama.head_norm's weight) and their gradients are summed
over TP after backward (grads.allreduce_replicated_grads). The input enters the TP
region once for q (or q_a) and kv_a (tensor_parallel.column_linears: one all-gather
under sequence parallelism, one all-reduce of the input gradient, which also sums the
partial gradients that flow back through the replicated linears); q_b and kv_b read
latents already inside the region, so they are plain local products. Everything after
the entry acts on whole sequences, so no weight here is a sequence-parallel partial sum
(no ``sequence_parallel`` marking).

**The core** is SelfAttention's (torch's fused kernel, op by op, per document, or the
context-parallel ring or all-gather), with the softmax scale ``qk_head_dim^-0.5``, times
``mscale(factor, mscale_all_dim)^2`` under YaRN with ``rope_mscale_all_dim`` (transformers'
``yarn_apply_mscale``). Values are ``v_head_dim`` wide, queries and keys ``qk_head_dim``:
torch's fused kernels (CPU flash, CUDA flash) and the context-parallel block kernels take
one head width (the cp ring also stacks keys and values into one message), so for them
values are padded with zeros to the query width and the output's padded columns cut off
(SelfAttention.core, inside the recomputed core; the op-by-op core takes the narrow
values as they are). Selective recomputation recomputes only the core, as for any
attention.

**Context parallelism: what travels** is each head's full key and (padded) value, the
existing ring or all-gather unchanged, not the compressed latent and rotary key. The
latent is far smaller (DeepSeek-V3: 576 numbers a token against 2 x 128 heads x 192 / tp),
but sending it would put the up-projection kv_b inside the ring: every rank would
up-project every other rank's latents (cp times kv_b's work), and the backward would
carry latent gradients around the ring and sum kv_b's weight gradient from every
block, a second, MLA-only ring kernel. Reusing the exact, tested kernels is the simple
correct choice; the latent ring is the optimisation to make when cp traffic matters.

**Generation cache**: :class:`LatentCache` keeps per layer the normalised latent
``[b, max_len, kv_lora_rank]`` and the rotated shared key ``[b, max_len,
qk_rope_head_dim]``, not per-head keys and values; each step up-projects the cached
latents through kv_b (no absorption of kv_b into the queries: the same products as in
training, so cached and uncached generation agree).
"""

from __future__ import annotations

import torch

from gridtrain.config import ModelConfig
from gridtrain.models import llama
from gridtrain.models.attention import Documents, KVCache, LayerCache, SelfAttention
from gridtrain.parallel.context_parallel import ContextParallel
from gridtrain.parallel.recompute import Recomputation
from gridtrain.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallel, column_linears,
                                                local_linear)


# the latent norms' epsilon: DeepSeek's (its q_a_layernorm and kv_a_layernorm take the
# RMSNorm default whatever rms_norm_eps says; so do transformers' and the reference code)
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: ModelConfig) -> float:
    """``qk_head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` under YaRN with
    ``rope_mscale_all_dim`` set (transformers' DeepseekV3Attention ``yarn_apply_mscale``)."""
    scale = cfg.qk_head_dim ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        mscale = llama.yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


class LatentAttention(SelfAttention):
    """Multi-head latent attention, ``n_head / tp`` heads per TP rank (module docstring)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, recompute: Recomputation, rotary: llama.Rotary,
                 cp: ContextParallel | None = None):
        super().__init__(cfg, tp, recompute, cp)
        self.rotary = rotary
        self.head_dim = cfg.qk_head_dim
        self.scale = softmax_scale(cfg)
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank, self.q_rank = cfg.kv_lora_rank, cfg.q_lora_rank
        d, h, eps = cfg.d_model, cfg.n_head, LATENT_NORM_EPS
        # the down-projections: one slice held whole by every rank (replicas = tp), as the norms
        if self.q_rank:
            self.q_a = ColumnParallelLinear(d, self.q_rank, tp, bias=False, replicas=tp.size)
            self.q_a_norm = llama.replicated_norm(self.q_rank, eps, tp)
            self.q_b = ColumnParallelLinear(self.q_rank, h * self.head_dim, tp, bias=False)
        else:
            self.q = ColumnParallelLinear(d, h * self.head_dim, tp, bias=False)
        self.kv_a = ColumnParallelLinear(d, self.kv_rank + self.rope, tp, bias=False, replicas=tp.size)
        self.kv_a_norm = llama.replicated_norm(self.kv_rank, eps, tp)
        self.kv_b = ColumnParallelLinear(self.kv_rank, h * (self.nope + self.v_dim), tp, bias=False)
        self.proj = RowParallelLinear(h * self.v_dim, d, tp, bias=False)
        self.proj.weight.residual_projection = True  # scaled init (decoder.init_parameters)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        first = self.q_a if self.q_rank else self.q
        q, kv = column_linears(x, [first.weight, self.kv_a.weight], self.tp)  # one entry into the TP region
        if self.q_rank:
            q = self._local(self.q_a_norm(q), self.q_b)
        b, s, _ = q.shape
        latent, k_rope = kv.split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_norm(latent)
        offset, positions = llama.rotary_positions(self.cp, s, x.device, cache, documents)
        q = q.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, self.rotary(q_rope, offset, positions)], dim=-1)
        k_rope = self.rotary(k_rope.unsqueeze(1), offset, positions)  # [b, 1, s, rope]: one head, shared
        if cache is not None:  # the latents and rotary keys of every position so far
            latent, k_rope = cache.append(latent, k_rope)
        k, v = self.keys_values(latent, k_rope)
        return self.proj(self.attend(q, k, v, documents=documents))

    def qk_rows(self, gamma: torch.Tensor) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Per head: the query's non-rotary rows and kv_b's key rows times sqrt(gamma), the
        query's rotary rows times gamma; kv_b's value rows and the shared rotary key
        (kv_a) left alone (Kimi K2's rule for latent attention)."""
        half, ones = gamma.sqrt()[:, None], torch.ones_like(gamma)[:, None]
        query = torch.cat([half.expand(-1, self.nope), gamma[:, None].expand(-1, self.rope)], dim=1)
        key = torch.cat([half.expand(-1, self.nope), ones.expand(-1, self.v_dim)], dim=1)
        first = self.q_b if self.q_rank else self.q
        return [(first.weight, query.reshape(-1)), (self.kv_b.weight, key.reshape(-1))]

    def keys_values(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's heads' keys ``[b, heads, t, qk_head_dim]`` and values ``[b, heads,
        t, v_head_dim]`` from the normalised latents ``[b, t, kv_lora_rank]`` and the
        rotated shared key ``[b, 1, t, qk_rope_head_dim]``."""
        b, t, _ = latent.shape
        kv = self._local(latent, self.kv_b).view(b, t, self.local_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(b, self.local_heads, t, self.rope)], dim=-1)
        # values of their own: what keeps them (selective recomputation's core inputs, the
        # op-by-op core) then keeps v_head_dim features a head, not kv_b's whole output
        return k, v.contiguous()

    def _local(self, x: torch.Tensor, layer: ColumnParallelLinear) -> torch.Tensor:
        """A column-parallel up-projection of a latent already inside the TP region (whole
        sequence, the same on every rank): no entry, a local product."""
        return local_linear(x, layer.weight, None, self.tp, self.tp.weight_grads)


class LatentCache(KVCache):
    """Every layer's normalised latents ``[n_layer, b, max_len, kv_lora_rank]`` and rotated
    shared keys ``[n_layer, b, max_len, qk_rope_head_dim]`` of the tokens seen so far, for
    generation with latent attention (one-process models only): per token
    ``kv_lora_rank + qk_rope_head_dim`` numbers a layer, where a key/value cache would
    keep ``n_head (qk_head_dim + v_head_dim)``. Each step's attention up-projects them."""

    def __init__(self, n_layer: int, batch: int, kv_lora_rank: int, rope_dim: int, max_len: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.latents = torch.zeros(n_layer, batch, max_len, kv_lora_rank, dtype=dtype, device=device)
        self.rope_keys = torch.zeros(n_layer, batch, max_len, rope_dim, dtype=dtype, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.latents.shape[2]

    def layer(self, index: int) -> LatentLayerCache:
        return LatentLayerCache(self, index)


class LatentLayerCache(LayerCache):
    """One layer's view of a :class:`LatentCache`."""

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' latents ``[b, s, kv_lora_rank]`` and rotary keys ``[b, 1, s,
        rope]`` written in place; returns those of all positions so far (same shapes)."""
        start, end = self.offset, self.offset + latent.shape[1]
        latents, keys = self.cache.latents[self.index], self.cache.rope_keys[self.index]
        latents[:, start:end], keys[:, start:end] = latent, k_rope.squeeze(1)
        return latents[:, :end], keys[:, :end].unsqueeze(1)


def new_cache(cfg: ModelConfig, batch: int, *, dtype: torch.dtype, device: torch.device | str) -> LatentCache:
    """An empty :class:`LatentCache` for ``batch`` sequences of up to ``seq_len`` tokens."""
    return LatentCache(cfg.n_layer, batch, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.seq_len,
                       dtype=dtype, device=device)


# ---- sizes ---------------------------------------------------------------------------------------------


def attention_parameters(cfg: ModelConfig, tp: int = 1) -> int:
    """Parameters of one block's latent attention on one TP rank: q (or q_b) and kv_b and
    proj split by heads (1/tp); q_a, kv_a and the two latent norms whole."""
    d, h = cfg.d_model, cfg.n_head
    if cfg.q_lora_rank:
        q = cfg.q_lora_rank * d + cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim // tp
    else:
        q = d * h * cfg.qk_head_dim // tp
    kv = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * d + cfg.kv_lora_rank
    return q + kv + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) // tp + h * cfg.v_head_dim * d // tp


def attention_flops_per_token(cfg: ModelConfig) -> float:
    """Forward matmul FLOPs per token of one block's latent attention (2 per multiply-add):
    the projections (q or q_a and q_b, kv_a, kv_b, proj) and the scores (``qk_head_dim``
    wide) and weighted sum (``v_head_dim`` wide) over ``s`` keys per head, as
    llama.attention_flops_per_token counts them (no causal halving). The norms and the
    rotation are not matrix products."""
    d, h, s = cfg.d_model, cfg.n_head, cfg.seq_len
    qk, v = cfg.qk_head_dim, cfg.v_head_dim
    q = d * cfg.q_lora_rank + cfg.q_lora_rank * h * qk if cfg.q_lora_rank else d * h * qk
    kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + v)
    projections = q + kv + h * v * d
    return 2.0 * projections + 2.0 * s * h * (qk + v)
