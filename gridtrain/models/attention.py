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

**Document masking** (``--document-mask``): a packed sequence holds several documents
end to end; :class:`Documents` (made once per micro-batch from the data's document ids)
gives each token its position within its document, and the core then lets a query see
only the keys of its own document at or before it ("same document and key position <=
query position"; within a document the true order and the document's order agree). The
visible pairs are block-diagonal by documents, so the sdpa core runs plain causal
attention on each document's span, one fused block each
(parallel/attention_blocks.document_attention: torch's fused kernel with its log-sum-exp,
no ``s x s`` mask, shared key/value heads read in place where the kernel can): a window
of several documents does less work than a causal one, and keeps what the fused causal
kernel keeps. The spans are read on the host once per micro-batch (:meth:`Documents.spans`).
With attention dropout the sdpa core calls ``scaled_dot_product_attention`` per document
instead (its dropout, autograd's backward). The op-by-op core, which materialises its
``s x s`` scores anyway (it is the reference the activation formula counts), masks them
with -inf outside a dense ``[b, 1, s, s]`` mask (:meth:`Documents.visible`).

For generation, a :class:`KVCache` keeps every layer's keys and values of the tokens seen
so far, so that each new token's queries attend over them without recomputing them
(one-process models only: tp 1, no pipeline). The core needs no flag for it: keys longer
than the queries mean the queries are the last positions.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F

from torch import nn

from gridtrain.config import ModelConfig
from gridtrain.models import qk_clip
from gridtrain.parallel import attention_blocks, context_parallel
from gridtrain.parallel.context_parallel import ContextParallel
from gridtrain.parallel.recompute import Recomputation
from gridtrain.parallel.rng import RNGStatesTracker
from gridtrain.parallel.tensor_parallel import TensorParallel


def causal_bias(seq_len: int) -> torch.Tensor:
    """Added to the scores of the op-by-op core: -inf above the diagonal (an add saves nothing)."""
    return torch.full((seq_len, seq_len), float("-inf"), device="cpu").triu(1)  # real in a meta-device build too


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout: float, training: bool,
                   rng: RNGStatesTracker, bias: torch.Tensor | None,
                   documents: Documents | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention of ``q`` ``[b, heads, s, d]`` over ``k``, ``v`` ``[b, kv_heads, t, d]``
    (``heads`` a multiple of ``kv_heads``: query head i reads key/value head
    ``i // (heads / kv_heads)``; ``t >= s``: the queries are the last ``s`` of the ``t``
    positions, as when decoding with a :class:`KVCache`); dropout ``dropout`` on the
    probabilities while ``training``. ``bias`` (from :func:`causal_bias`) selects the
    op-by-op form. ``documents`` (:class:`Documents`; no cache): each query sees only its
    own document's keys, in place of the causal mask (module docstring). ``scale``: of
    the scores (default ``1 / sqrt(d)``; latent attention's is its own, models/mla.py).
    ``v`` may be narrower than ``q`` and ``k`` for the op-by-op form; the fused kernels
    take one head width (:meth:`SelfAttention.core` pads values to it)."""
    p = dropout if training else 0.0
    group = q.shape[1] // k.shape[1]
    s, t = q.shape[-2], k.shape[-2]
    # this rank's heads: its own dropout stream (no draws without dropout: no fork, which
    # also keeps a compiled block in one graph)
    with rng.fork() if p > 0 else contextlib.nullcontext():
        if bias is None:
            if documents is not None:
                return _per_document(q, k, v, documents.spans(), p, scale)
            # torch's is_causal aligns the mask top-left: after cached positions, say which keys each query sees
            mask = None if s == t else torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=p,
                                                  enable_gqa=group > 1, scale=scale)
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        if documents is not None:  # -inf outside the mask (adding 0 inside it changes nothing)
            scores = scores.masked_fill(~documents.visible(), float("-inf"))
        else:
            scores = scores + bias[t - s:t, :t].to(scores.dtype)
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(F.dropout(probs, p, training), v)


def _per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans, dropout: float,
                  scale: float | None = None) -> torch.Tensor:
    """Causal attention within each document's span (``spans``: :meth:`Documents.spans`):
    the fused block kernel without dropout, else ``scaled_dot_product_attention`` per
    document (in the caller's RNG fork) joined along the sequence."""
    if dropout == 0:
        return attention_blocks.document_attention(q, k, v, spans, scale)
    gqa = q.shape[1] != k.shape[1]
    rows = []
    for sel, row in attention_blocks.row_groups(spans):
        rows.append(torch.cat([F.scaled_dot_product_attention(q[sel, :, a:e], k[sel, :, a:e], v[sel, :, a:e],
                                                              is_causal=True, dropout_p=dropout, enable_gqa=gqa,
                                                              scale=scale)
                               for a, e in row], dim=2))
    return torch.cat(rows) if len(rows) > 1 else rows[0]


class Documents:
    """The documents of a micro-batch's packed sequences (``--document-mask``), made once
    per micro-batch (and model chunk) from the data's ``documents`` ids ``[b, seq_len]``
    (non-decreasing along each sequence: a document starts where the id changes).

    ``ids`` and ``positions`` cover the whole sequence whatever the layout: a cp rank
    needs every token's document to choose its chunk pairs' blocks, and cuts out its own
    positions (:meth:`local_positions`). ``positions`` restart at 0 at each document's
    first token (the index minus the index of that token), so learned and rotary
    positions see each document as if it began the sequence. The documents' spans
    (:meth:`spans`, read on the host) are made on first use and kept here, so every layer
    of the chunk shares them, and a recomputed region, which holds this object (bound
    into the function it replays), masks with its own micro-batch's documents even when
    later micro-batches ran forward in between (1F1B).
    """

    def __init__(self, ids: torch.Tensor):
        if ids.dim() != 2:
            raise ValueError(f"documents must be [batch, seq_len] document ids, got shape {tuple(ids.shape)}")
        self.ids = ids
        index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
        self.positions = index - first  # [b, s]: the position within the token's document
        self._spans: tuple | None = None
        self._visible: torch.Tensor | None = None

    def spans(self) -> tuple[attention_blocks.Spans, ...]:
        """Per row, its documents' ``(start, end)`` token spans (host integers; one named
        host read of the ids, ``document_spans``, on first use)."""
        if self._spans is None:
            self._spans = attention_blocks.document_spans(self.ids)
        return self._spans

    def visible(self) -> torch.Tensor:
        """``[b, 1, s, s]``: True where query i sees key j (same document, ``j <= i``): the
        op-by-op core's mask (and the tests' reference); the fused cores never make it."""
        if self._visible is None:
            s = self.ids.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=self.ids.device).tril()
            self._visible = ((self.ids[:, :, None] == self.ids[:, None, :]) & causal)[:, None]
        return self._visible

    def local_positions(self, cp: ContextParallel) -> torch.Tensor:
        """The document positions of this cp rank's tokens (its two chunks), ``[b, s / cp]``."""
        if cp.size == 1:
            return self.positions
        return context_parallel.split_sequence(self.positions, cp.size, cp.rank)


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
        self.scale: float | None = None  # of the scores: None is 1 / sqrt(query width)
        self.dropout = cfg.dropout
        self.math = cfg.attention == "math"
        if self.math:
            self.register_buffer("causal_bias", causal_bias(cfg.seq_len), persistent=False)
        # --qk-clip (models/qk_clip.py): the step's largest logit per local head, recorded in training
        self.records_logits = False
        self.logit_max: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: LayerCache | None = None, documents: Documents | None = None) -> torch.Tensor:
        """The core over ``[b, heads, s, d]`` inputs (values may be narrower: latent
        attention's), as ``[b, s, heads * d_v]``; with a
        ``cache``, ``k`` and ``v`` join the cached ones and the queries attend over all;
        with ``documents``, each query sees only its own document's keys. Selective
        recomputation replays the core with the micro-batch's ``documents`` bound in."""
        if self.records_logits and self.training and cache is None:
            seen = qk_clip.max_logits(q, k, self.scale or q.shape[-1] ** -0.5, self.cp, documents)
            self.logit_max = seen if self.logit_max is None else torch.maximum(self.logit_max, seen)
        if cache is not None:
            if documents is not None:
                raise ValueError("a key/value cache holds one sequence: generation takes no documents")
            y = self.core(*cache.append(q, k, v))
        elif self.cp.size > 1:
            y = context_parallel.attention(q, k, _to_width(v, q.shape[-1]), self.cp,
                                           None if documents is None else documents.spans(), self.scale)
            y = _cut(y, v.shape[-1])
        elif self.recompute.selective:
            core = self.core if documents is None else functools.partial(self.core, documents=documents)
            y = self.recompute.checkpoint(core, q, k, v)
        else:
            y = self.core(q, k, v, documents)
        b, _, s, _ = q.shape
        return y.transpose(1, 2).reshape(b, s, -1)

    def qk_rows(self, gamma: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Per-row factors of this layer's query and key weights that scale head h's
        logits by ``gamma[h]`` (models/qk_clip.py); each architecture's layout."""
        raise NotImplementedError(f"{type(self).__name__} does not rescale its heads (--qk-clip)")

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             documents: Documents | None = None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + causal) v with dropout on the probabilities, [b, heads, s, d];
        with ``documents``, the document mask in place of the causal one. Values narrower
        than the queries (latent attention's) are padded with zeros to the query width
        for the fused kernels, which take one head width, and the output cut back (inside
        the core, so selective recomputation keeps the narrow values)."""
        y = core_attention(q, k, v if self.math else _to_width(v, q.shape[-1]), dropout=self.dropout,
                           training=self.training, rng=self.tp.rng, bias=self.causal_bias if self.math else None,
                           documents=documents, scale=self.scale)
        return _cut(y, v.shape[-1])


def _to_width(v: torch.Tensor, width: int) -> torch.Tensor:
    """Values ``[..., d_v]`` padded with zeros to ``width`` (the queries'), for kernels that
    take one head width: the padded columns of the output are zero and are cut off."""
    return v if v.shape[-1] == width else F.pad(v, (0, width - v.shape[-1]))


def _cut(y: torch.Tensor, width: int) -> torch.Tensor:
    """The first ``width`` columns of a core's output (the values' own, before padding)."""
    return y if y.shape[-1] == width else y[..., :width]


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
