"""The attention core that GPT-2 and Llama share: softmax(q k^T / sqrt(d) + causal) v.

It is the part of a transformer layer that selective recomputation recomputes
(Korthikanti et al.: the ``s x s`` scores are most of a layer's activations and cheap to
rebuild), so both architectures call it through one function. It is written two ways:

* ``sdpa``: torch's ``scaled_dot_product_attention`` (a fused kernel that keeps no
  ``s x s`` tensors where one applies); grouped-query attention is its ``enable_gqa``;
* ``math``: op by op (Megatron's unfused core attention), which is what the
  activation-memory formula (memory.activations.korthikanti_bytes) counts; grouped-query attention
  repeats each key/value head for the query heads that share it, inside the core, so
  selective recomputation keeps only the un-repeated keys and values.

Dropout on the attention probabilities draws from this TP rank's own stream of the RNG
tracker: each rank's heads are different heads.

For generation, a :class:`KVCache` keeps every layer's keys and values of the tokens seen
so far, so that each new token's queries attend over them without recomputing them
(one-process models only: tp 1, no pipeline). The core needs no flag for it: keys longer
than the queries mean the queries are the last positions.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from torch import nn

from gridtrain.config import ModelConfig
from gridtrain.parallel import context_parallel
from gridtrain.parallel.context_parallel import ContextParallel
from gridtrain.parallel.recompute import Recomputation
from gridtrain.parallel.rng import RNGStatesTracker
from gridtrain.parallel.tensor_parallel import TensorParallel


def causal_bias(seq_len: int) -> torch.Tensor:
    """Added to the scores of the op-by-op core: -inf above the diagonal (an add saves nothing)."""
    return torch.full((seq_len, seq_len), float("-inf")).triu(1)


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout: float, training: bool,
                   rng: RNGStatesTracker, bias: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of ``q`` ``[b, heads, s, d]`` over ``k``, ``v`` ``[b, kv_heads, t, d]``
    (``heads`` a multiple of ``kv_heads``: query head i reads key/value head
    ``i // (heads / kv_heads)``; ``t >= s``: the queries are the last ``s`` of the ``t``
    positions, as when decoding with a :class:`KVCache`); dropout ``dropout`` on the
    probabilities while ``training``. ``bias`` (from :func:`causal_bias`) selects the
    op-by-op form."""
    p = dropout if training else 0.0
    group = q.shape[1] // k.shape[1]
    s, t = q.shape[-2], k.shape[-2]
    # this rank's heads: its own dropout stream (no draws without dropout: no fork, which
    # also keeps a compiled block in one graph)
    with rng.fork() if p > 0 else contextlib.nullcontext():
        if bias is None:
            # torch's is_causal aligns the mask top-left: after cached positions, say which keys each query sees
            mask = None if s == t else torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=p,
                                                  enable_gqa=group > 1)
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        probs = torch.softmax(scores + bias[t - s:t, :t].to(scores.dtype), dim=-1)
        return torch.matmul(F.dropout(probs, p, training), v)


class SelfAttention(nn.Module):
    """What both architectures' attention layers share: ``n_head / tp`` whole query heads
    per TP rank, the core (recomputed under selective recomputation) and, for the
    op-by-op core, the causal bias. Subclasses make q, k, v and project the result.

    Under context parallelism (``cp`` of more than one rank) the core is
    :func:`context_parallel.attention` over every cp rank's keys and values, for either
    core kind. Selective recomputation does not recompute it: it keeps no ``s x s``
    tensor to drop, and recomputing it would repeat its communication."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, recompute: Recomputation,
                 cp: ContextParallel | None = None):
        super().__init__()
        self.tp, self.recompute = tp, recompute
        self.cp = cp or ContextParallel()
        self.local_heads = cfg.n_head // tp.size
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.math = cfg.attention == "math"
        if self.math:
            self.register_buffer("causal_bias", causal_bias(cfg.seq_len), persistent=False)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: LayerCache | None = None) -> torch.Tensor:
        """The core over ``[b, heads, s, d]`` inputs, as ``[b, s, heads * d]``; with a
        ``cache``, ``k`` and ``v`` join the cached ones and the queries attend over all."""
        if cache is not None:
            y = self.core(*cache.append(q, k, v))
        elif self.cp.size > 1:
            y = context_parallel.attention(q, k, v, self.cp)
        elif self.recompute.selective:
            y = self.recompute.checkpoint(self.core, q, k, v)
        else:
            y = self.core(q, k, v)
        b, _, s, _ = q.shape
        return y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + causal) v with dropout on the probabilities, [b, heads, s, d]."""
        return core_attention(q, k, v, dropout=self.dropout, training=self.training, rng=self.tp.rng,
                              bias=self.causal_bias if self.math else None)


class KVCache:
    """Every layer's keys and values of the tokens a one-process model has seen, for
    generation: ``[n_layer, b, kv_heads, max_len, head_dim]`` each, allocated once
    (grouped-query attention caches only its ``kv_heads`` heads). The model's forward
    with ``cache=`` writes the new tokens' keys and values at positions ``length`` on and
    then advances ``length``, the position of the next token."""

    def __init__(self, n_layer: int, batch: int, kv_heads: int, head_dim: int, max_len: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.keys = torch.zeros(n_layer, batch, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)

    def advance(self, tokens: int) -> None:
        self.length += tokens


class LayerCache:
    """One layer's view of a :class:`KVCache`: where its new tokens go (``offset``)."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    @property
    def offset(self) -> int:
        return self.cache.length

    def append(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """``q`` and the keys and values of all positions so far, ``k`` and ``v`` (the new
        tokens', ``[b, kv_heads, s, d]``) written in place."""
        start, end = self.offset, self.offset + k.shape[-2]
        keys, values = self.cache.keys[self.index], self.cache.values[self.index]
        keys[:, :, start:end], values[:, :, start:end] = k, v
        return q, keys[:, :, :end], values[:, :, :end]
