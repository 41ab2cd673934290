"""The Llama architecture's layers, split over TP the way GPT-2's are (docs/llama.md).

A Llama block is a GPT-2 block with other parts: RMSNorm instead of LayerNorm, rotary
position embeddings (Hugging Face's convention: the two halves of each head rotated
together) instead of a learned position table, grouped-query attention (``n_kv_head``
key/value heads, each shared by ``n_head / n_kv_head`` query heads), a SwiGLU MLP
(``down(silu(gate(x)) * up(x))``) and no biases. :mod:`gridtrain.models.decoder` builds blocks,
embedding, head, pipeline chunks and initialisation for both architectures; this module
holds only what is Llama's own.

How the parts split over TP (Megatron's rules, docs/llama.md):

* query heads: ``n_head / tp`` whole heads per rank (column-parallel ``q``);
* key/value heads: ``n_kv_head / tp`` per rank when tp divides their count; when tp
  exceeds it, each kv head is **replicated** on the ``tp / n_kv_head`` consecutive ranks
  whose query heads read it (:func:`kv_heads_of_rank`). The copies' gradients are
  partial sums, summed over the ranks sharing the head after backward
  (grads.allreduce_replicated_grads), so every copy takes the same step;
* gate and up are two column-parallel linears (not one fused tensor), so a checkpoint's
  whole tensors are the same whatever the tp; ``down`` and the attention output ``proj``
  are row-parallel;
* RMSNorm weights are replicated; under sequence parallelism each rank sees 1/tp of the
  tokens and their gradients are summed over TP (as LayerNorm's are);
* query/key norms (``cfg.qk_norm``, docs/llama.md) act after q and k leave the TP entry,
  on whole sequences. ``head`` (Qwen3: one ``head_dim`` weight shared by every head) is
  replicated, and each rank's copy sees only its own heads, so its gradient is a partial
  sum: the weight carries ``ShardSpec(0, replicas=tp)`` (one slice held by every rank),
  and the copies' gradients are summed over TP with the replicated kv heads'. ``full``
  (OLMoE: one weight over all of q's features, one over all of k's) is split as q and k
  are, and its mean square spans every rank's features: the local sums of squares are
  summed over TP, differentiably both ways (:class:`ProjectionNorm`).

``q``, ``k`` and ``v`` (and ``gate`` and ``up``) read the same input: one entry into the
TP region serves them (tensor_parallel.column_linears: one all-gather under SP).

Parameter names (global, stable: checkpoints and the Hugging Face mapping key on them),
for block N: ``blocks.N.ln1.weight`` (input_layernorm), ``blocks.N.attn.{q,k,v}.weight``
(q_proj, k_proj, v_proj), ``blocks.N.attn.proj.weight`` (o_proj),
``blocks.N.ln2.weight`` (post_attention_layernorm), ``blocks.N.mlp.{gate,up,down}.weight``
(gate_proj, up_proj, down_proj), with ``cfg.qk_norm`` ``blocks.N.attn.q_norm.weight`` and
``blocks.N.attn.k_norm.weight`` (self_attn.q_norm, k_norm); ``embedding.word.weight`` (embed_tokens),
``final_norm.weight`` (norm), ``head`` (lm_head, absent when tied).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gridtrain.models import qk_clip
from gridtrain.models.attention import Documents, LayerCache, SelfAttention
from gridtrain.config import ModelConfig
from gridtrain.parallel.context_parallel import ContextParallel
from gridtrain.parallel.recompute import Recomputation
from gridtrain.parallel.comm import copy_to_tp, reduce_from_tp
from gridtrain.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, ShardSpec, TensorParallel,
                                                column_linears)

# ---- which heads a TP rank holds ---------------------------------------------------------------


def kv_replicas(n_kv_head: int, tp: int) -> int:
    """How many TP ranks hold each key/value head: 1 when tp divides the kv head count,
    ``tp / n_kv_head`` when tp exceeds it (tp must then be a multiple of it)."""
    return max(1, tp // n_kv_head)


def query_heads_of_rank(n_head: int, tp: int, rank: int) -> range:
    """The query heads TP rank ``rank`` computes: ``n_head / tp`` consecutive ones."""
    per_rank = n_head // tp
    return range(rank * per_rank, (rank + 1) * per_rank)


def kv_heads_of_rank(n_head: int, n_kv_head: int, tp: int, rank: int) -> range:
    """The key/value heads TP rank ``rank`` holds: those its query heads read (query head
    i reads kv head ``i // (n_head / n_kv_head)``)."""
    group = n_head // n_kv_head
    queries = query_heads_of_rank(n_head, tp, rank)
    return range(queries.start // group, (queries.stop - 1) // group + 1)


# ---- RMSNorm ---------------------------------------------------------------------------------------


class _RMSNorm(torch.autograd.Function):
    """``w * x / sqrt(mean(x^2) + eps)``, normalised in at least fp32 (as Hugging Face
    does), keeping only the input and one number per token for backward (as fused
    kernels do): the normalised value is rebuilt there."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (wide * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        normed = x.to(rstd.dtype) * rstd
        grad_weight = (grad * normed.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0)
        g = (grad * weight).to(rstd.dtype)
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


def rms_norm(cfg: ModelConfig, tp: TensorParallel) -> RMSNorm:
    """An RMSNorm, replicated over TP; under sequence parallelism its grads are partial."""
    norm = RMSNorm(cfg.d_model, cfg.layernorm_eps)
    norm.weight.sequence_parallel = tp.sequence_parallel
    return norm


def head_norm(cfg: ModelConfig, tp: TensorParallel) -> RMSNorm:
    """Qwen3's query or key norm: an RMSNorm over ``head_dim``, applied to each head. Every
    TP rank holds the whole weight but applies it to its own heads only, so the copies'
    gradients are partial sums: one slice replicated on all tp ranks (ShardSpec), summed
    over TP after backward (grads.allreduce_replicated_grads). It acts on whole
    sequences (after the TP entry), so sequence parallelism adds nothing."""
    return replicated_norm(cfg.head_dim, cfg.layernorm_eps, tp)


def replicated_norm(width: int, eps: float, tp: TensorParallel) -> RMSNorm:
    """An RMSNorm over ``width`` features after the TP entry, whole on every TP rank, each
    copy applied to that rank's heads' share only (:func:`head_norm`; latent attention's
    latent norms): one slice replicated on all tp ranks, its gradients summed over TP."""
    norm = RMSNorm(width, eps)
    norm.weight.tp_spec = ShardSpec(0, replicas=tp.size)
    return norm


class ProjectionNorm(nn.Module):
    """OLMoE's query or key norm: an RMSNorm over a whole projection (``width`` features:
    every head's), whose output rows are split over TP as the projection's are (each
    slice held by ``replicas`` ranks: the key/value heads' rule). The mean square needs
    every rank's features: each rank's sum of squares is summed over TP (each replicated
    slice counted ``replicas`` times, so divided by it), forward and, for the gradient,
    backward (reduce_from_tp then copy_to_tp). On one rank it is the plain RMSNorm."""

    def __init__(self, width: int, eps: float, tp: TensorParallel, replicas: int = 1):
        super().__init__()
        slices = tp.size // replicas
        if width % slices:
            raise ValueError(f"a norm over {width} features does not split into {slices} slices over tp {tp.size}")
        self.width, self.eps, self.tp, self.replicas = width, eps, tp, replicas
        self.weight = nn.Parameter(torch.ones(width // slices))
        self.weight.tp_spec = ShardSpec(0, replicas=replicas)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return _RMSNorm.apply(x, self.weight, self.eps)
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        squares = wide.pow(2).sum(-1, keepdim=True)
        total = copy_to_tp(reduce_from_tp(squares, self.tp.comm), self.tp.comm)
        rstd = torch.rsqrt(total / (self.width * self.replicas) + self.eps)
        return self.weight * (wide * rstd).to(x.dtype)


# ---- rotary position embeddings ------------------------------------------------------------------


def rotary_width(cfg: ModelConfig) -> int:
    """How many features of a head turn with its position: the whole head, or latent
    attention's rotary part (``qk_rope_head_dim``, models/mla.py)."""
    return cfg.qk_rope_head_dim if cfg.mla else cfg.head_dim


def rope_frequencies(cfg: ModelConfig, dim: int | None = None) -> torch.Tensor:
    """The rotation frequency of each of the ``dim / 2`` pairs (default
    :func:`rotary_width`), in fp32: ``theta^(-2i/dim)``, with Llama 3's scaling when
    ``cfg.rope_scaling == "llama3"``, YaRN's (:func:`yarn_frequencies`) when ``"yarn"``."""
    dim = dim or rotary_width(cfg)
    if cfg.rope_scaling == "yarn":
        return yarn_frequencies(dim, cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max_positions,
                                cfg.rope_beta_fast, cfg.rope_beta_slow)
    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope_scaling == "llama3":
        freqs = llama3_scaled(freqs, cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                              cfg.rope_original_max_positions)
    return freqs


def llama3_scaled(freqs: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_max_positions: int) -> torch.Tensor:
    """Llama 3's rope scaling (rope_type "llama3"): wavelengths shorter than
    ``original / high_freq_factor`` are kept, those longer than ``original /
    low_freq_factor`` are divided by ``factor``, and the band between is interpolated
    linearly in ``original / wavelength``."""
    wavelength = 2 * math.pi / freqs
    smooth = (original_max_positions / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    out = torch.where(wavelength > original_max_positions / low_freq_factor, freqs / factor, blended)
    return torch.where(wavelength < original_max_positions / high_freq_factor, freqs, out)


def yarn_frequencies(dim: int, theta: float, factor: float, original_max_positions: int, beta_fast: float,
                     beta_slow: float) -> torch.Tensor:
    """YaRN's frequencies (rope_type "yarn"; Peng et al. 2023), as transformers'
    ``_compute_yarn_parameters`` computes them (truncated correction range): pairs that
    turn more than ``beta_fast`` times over the original context keep their frequency
    (extrapolation), those turning fewer than ``beta_slow`` times are divided by
    ``factor`` (interpolation), with a linear ramp over the pairs between."""
    def correction_dim(rotations: float) -> float:  # the pair that turns ``rotations`` times over the context
        return dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no division by zero
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    kept = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - kept) + extrapolation * kept


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale ``0.1 mscale ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (transformers' ``attention_factor``):
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` where both are set, else
    ``mscale(factor)``; 1 without YaRN."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return float(yarn_mscale(cfg.rope_factor, cfg.rope_mscale) / yarn_mscale(cfg.rope_factor,
                                                                                 cfg.rope_mscale_all_dim))
    return yarn_mscale(cfg.rope_factor)


class Rotary(nn.Module):
    """cos and sin of every position's angles, ``[seq_len, dim]`` (``dim``: default
    :func:`rotary_width`; each frequency twice: the two halves turn together), computed
    once in fp32 as Hugging Face does (times YaRN's :func:`rotary_attention_factor`) and
    cast with the model; one instance is shared by all of a model's blocks. A forward
    past ``seq_len`` (a model used on longer inputs than it was trained on, as
    transformers allows) extends the tables with the same formula: the first
    ``seq_len`` rows are unchanged."""

    def __init__(self, cfg: ModelConfig, dim: int | None = None):
        super().__init__()
        with torch.device("cpu"):  # derived from the config: real even in a model built on the meta device
            self._frequencies = rope_frequencies(cfg, dim)
            self._factor = rotary_attention_factor(cfg)
            cos, sin = self._tables(cfg.seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions 0..n-1, in fp32 on the CPU."""
        angles = torch.outer(torch.arange(n, dtype=torch.float32, device="cpu"), self._frequencies)
        angles = torch.cat([angles, angles], dim=-1)
        factor = self._factor
        return (angles.cos() * factor, angles.sin() * factor) if factor != 1 else (angles.cos(), angles.sin())

    def _extend(self, n: int) -> None:
        """Tables for at least ``n`` positions (computed in fp32, cast as the model's)."""
        cos, sin = self._tables(n)
        self.cos, self.sin = cos.to(self.cos), sin.to(self.sin)

    def forward(self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[b, heads, s, dim]`` at positions offset..offset+s-1 (or at
        ``positions``: ``[s]``, a context-parallel rank's true positions, or ``[b, s]``,
        each token's own, e.g. its position within its document), rotated."""
        if positions is not None:
            cos, sin = self.cos[positions], self.sin[positions]
            if positions.dim() == 2:  # per sequence: the same for every head
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        else:
            end = offset + x.shape[-2]
            if end > self.cos.shape[0]:
                self._extend(end)
            cos, sin = self.cos[offset:end], self.sin[offset:end]
        return x * cos + rotate_half(x) * sin


def rotary_positions(cp: ContextParallel, s: int, device: torch.device, cache: LayerCache | None,
                     documents: Documents | None) -> tuple[int, torch.Tensor | None]:
    """Where ``s`` tokens of an attention layer's input sit, as :meth:`Rotary.forward`
    takes it: after the cached tokens (``offset``), each at its position within its
    document (``[b, s]``, this cp rank's chunks), or this cp rank's chunks' true
    positions (``[s]``); None: positions ``offset`` on."""
    offset = 0 if cache is None else cache.offset
    if documents is not None:
        return offset, documents.local_positions(cp)
    return offset, cp.positions(s, device) if cp.size > 1 else None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


# ---- attention and MLP ---------------------------------------------------------------------------


class Attention(SelfAttention):
    """Grouped-query causal self-attention with rotary positions, no biases; under TP
    each rank computes ``n_head / tp`` query heads and holds the key/value heads they
    read (replicated when tp exceeds the kv head count). Heads are ``cfg.head_dim`` wide
    (``attn_head_dim``: Qwen3's 128 beside a 2048-wide model), so q and the output
    projection are ``n_head x head_dim`` wide, whatever d_model is. ``cfg.qk_norm``
    normalises queries and keys before the rotary positions: per head (``head``, Qwen3)
    or over the whole projection (``full``, OLMoE)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, recompute: Recomputation, rotary: Rotary,
                 cp: ContextParallel | None = None):
        super().__init__(cfg, tp, recompute, cp)
        self.rotary = rotary
        kv = cfg.kv_heads
        self.local_kv_heads = len(kv_heads_of_rank(cfg.n_head, kv, tp.size, tp.rank))
        d, kv_dim, replicas = cfg.d_model, kv * cfg.head_dim, kv_replicas(kv, tp.size)
        self.q = ColumnParallelLinear(d, cfg.n_head * cfg.head_dim, tp, bias=False)
        self.k = ColumnParallelLinear(d, kv_dim, tp, bias=False, replicas=replicas)
        self.v = ColumnParallelLinear(d, kv_dim, tp, bias=False, replicas=replicas)
        self.proj = RowParallelLinear(cfg.n_head * cfg.head_dim, d, tp, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = head_norm(cfg, tp), head_norm(cfg, tp)
        elif cfg.qk_norm == "full":
            self.q_norm = ProjectionNorm(cfg.n_head * cfg.head_dim, cfg.layernorm_eps, tp)
            self.k_norm = ProjectionNorm(kv_dim, cfg.layernorm_eps, tp, replicas)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        q, k, v = column_linears(x, [self.q.weight, self.k.weight, self.v.weight], self.tp)
        b, s, _ = q.shape
        if self.qk_norm == "full":  # over every head's features (all ranks')
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.local_heads, self.head_dim)
        k = k.view(b, s, self.local_kv_heads, self.head_dim)
        if self.qk_norm == "head":  # each head by itself
            q, k = self.q_norm(q), self.k_norm(k)
        offset, positions = rotary_positions(self.cp, s, x.device, cache, documents)
        q = self.rotary(q.transpose(1, 2), offset, positions)
        k = self.rotary(k.transpose(1, 2), offset, positions)
        v = v.view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        return self.proj(self.attend(q, k, v, cache, documents))

    def qk_rows(self, gamma: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """q's rows by query head, k's by key head (models/qk_clip.grouped_scales: the
        key head takes its group's smallest factor, each query head the rest)."""
        q, k = qk_clip.grouped_scales(gamma, self.local_kv_heads)
        return [(self.q.weight, qk_clip.rows(q, self.head_dim)), (self.k.weight, qk_clip.rows(k, self.head_dim))]


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: gate and up column-parallel (separate tensors),
    down row-parallel, no biases."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, width: int | None = None):
        super().__init__()
        self.tp = tp
        f = width or cfg.ffn_size  # a MoE layer's shared experts: their own width
        self.gate = ColumnParallelLinear(cfg.d_model, f, tp, bias=False)
        self.up = ColumnParallelLinear(cfg.d_model, f, tp, bias=False)
        self.down = RowParallelLinear(f, cfg.d_model, tp, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = column_linears(x, [self.gate.weight, self.up.weight], self.tp)
        return self.down(F.silu(gate) * up)


# ---- sizes ---------------------------------------------------------------------------------------------


def attention_parameters(cfg: ModelConfig, tp: int = 1) -> int:
    """Parameters of one block's attention on one TP rank: q and proj (1/tp), k and v
    (the rank's kv heads), and the query/key norms: ``head`` two whole ``head_dim``
    weights, ``full`` the rank's slices of the two projection-wide ones."""
    d, hd, kv = cfg.d_model, cfg.head_dim, cfg.kv_heads
    local_kv = len(kv_heads_of_rank(cfg.n_head, kv, tp, 0))
    n = 2 * d * cfg.n_head * hd // tp + 2 * d * local_kv * hd
    if cfg.qk_norm == "head":
        n += 2 * hd
    elif cfg.qk_norm == "full":
        n += cfg.n_head * hd // tp + local_kv * hd
    return n


def attention_flops_per_token(cfg: ModelConfig) -> float:
    """Forward matmul FLOPs per token of one block's attention: q, k, v and the output
    projection (2 d (2 n_head + 2 n_kv_head) head_dim) and the attention scores and
    weighted sum (4 s n_head head_dim). The norms are not matrix products."""
    d, hd, s = cfg.d_model, cfg.head_dim, cfg.seq_len
    return 2 * d * (2 * cfg.n_head + 2 * cfg.kv_heads) * hd + 4 * s * cfg.n_head * hd
