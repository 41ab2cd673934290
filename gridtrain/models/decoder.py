"""The decoder: GPT-2 (pre-LayerNorm blocks, GELU MLP, learned positions, tied embeddings)
or Llama (the same blocks with the parts of :mod:`gridtrain.models.llama`), chosen by ``cfg.arch``.

One model class serves both, so that pipeline chunks, the head and loss, initialisation,
parameter counts, checkpoints and generation are written once.

Two properties matter more than anything else here:

* **Global parameter names.** Blocks live in a ``ModuleDict`` keyed by their global
  layer index, so ``blocks.7.attn.qkv.weight`` means the same tensor whichever stage
  holds layer 7. Checkpoints and the initialisation below key on these names.
* **Layout-independent initialisation.** :func:`initial_tensor` draws every parameter
  whole from a generator seeded by (seed, name), as Megatron's CPU initialisation does,
  so any split of the model over devices starts from the same numbers. The model can be
  built on the meta device (no memory; buffers, derived from the config, are computed
  on the host even then) and each rank then materialises only its own pieces.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gridtrain.models import llama, mla, qk_clip
from gridtrain.models import mtp as multi_token  # (``mtp``: the counts' keyword)
from gridtrain.runtime import activation_meter as memory
from gridtrain.models.head_loss import fused_head_loss, worth_fusing
from gridtrain.models.attention import Documents, KVCache, LayerCache, SelfAttention
from gridtrain.config import ModelConfig
from gridtrain.parallel.context_parallel import ContextParallel
from gridtrain.parallel.experts import ExpertParallel
from gridtrain.models.moe import MoE
from gridtrain.parallel.recompute import Recomputation
from gridtrain.parallel.tensor_parallel import (IGNORE_INDEX, ColumnParallelLinear, RowParallelLinear, ShardSpec,  # noqa: F401
                                       TensorParallel, VocabParallelEmbedding, gather_logits,
                                       one_rank_cross_entropy, parallel_lm_logits, shard, shard_spec,
                                       vocab_parallel_cross_entropy)
from gridtrain.runtime.timing import clock_for, median_seconds


class CausalSelfAttention(SelfAttention):
    """GPT-2's causal self-attention: a fused column-parallel QKV with biases (each TP
    rank owns ``n_head / tp`` whole heads) and a row-parallel output projection. The core
    (scores, softmax, dropout, weighted sum of values) is attention.SelfAttention's:
    torch's fused kernel or op by op (``attention="math"``); selective recomputation
    recomputes exactly this core.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, recompute: Recomputation,
                 cp: ContextParallel | None = None):
        super().__init__(cfg, tp, recompute, cp)
        self.qkv = ColumnParallelLinear(cfg.d_model, 3 * cfg.d_model, tp, parts=3)
        self.proj = RowParallelLinear(cfg.d_model, cfg.d_model, tp)
        self.proj.weight.residual_projection = True  # scaled init, see init_parameters

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        qkv = self.qkv(x)
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return self.proj(self.attend(q, k, v, cache, documents))

    def qk_rows(self, gamma: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """The fused QKV's q and k parts (weight rows and bias entries) times sqrt(gamma)
        per head; v's left alone."""
        half = qk_clip.rows(gamma.sqrt(), self.head_dim)
        factor = torch.cat([half, half, torch.ones_like(half)])
        return [(self.qkv.weight, factor), (self.qkv.bias, factor)]


class MLP(nn.Module):
    """GELU MLP: column-parallel expansion, row-parallel contraction."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, width: int | None = None):
        super().__init__()
        f = width or cfg.ffn_size  # a MoE layer's shared experts: their own width
        self.fc = ColumnParallelLinear(cfg.d_model, f, tp)
        self.proj = RowParallelLinear(f, cfg.d_model, tp)
        self.proj.weight.residual_projection = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


def layer_norm(cfg: ModelConfig, tp: TensorParallel) -> nn.LayerNorm:
    """A LayerNorm, replicated over TP; under sequence parallelism its grads are partial."""
    norm = nn.LayerNorm(cfg.d_model, eps=cfg.layernorm_eps)
    for p in norm.parameters():
        p.sequence_parallel = tp.sequence_parallel
    return norm


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``, with
    GPT-2's parts (LayerNorm, attention with biases, GELU MLP) or Llama's (RMSNorm,
    grouped-query attention with rotary positions from the shared ``rotary``, SwiGLU)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, recompute: Recomputation,
                 rotary: llama.Rotary | None = None, cp: ContextParallel | None = None, *,
                 layer: int = 0, ep: ExpertParallel | None = None):
        super().__init__()
        self.tp = tp
        is_llama = cfg.arch == "llama"
        norm = llama.rms_norm if is_llama else layer_norm
        self.ln1 = norm(cfg, tp)
        if is_llama:  # grouped-query attention, or latent attention (--attention mla)
            self.attn = (mla.LatentAttention if cfg.mla else llama.Attention)(cfg, tp, recompute, rotary, cp)
        else:
            self.attn = CausalSelfAttention(cfg, tp, recompute, cp)
        self.ln2 = norm(cfg, tp)
        dense = llama.SwiGLU if is_llama else MLP
        if cfg.is_moe_layer(layer):
            shared = dense(cfg, tp, cfg.moe_shared_experts * cfg.moe_ffn_size) if cfg.moe_shared_experts else None
            self.mlp = MoE(cfg, layer, tp, ep or ExpertParallel(), recompute, shared)
        else:
            self.mlp = dense(cfg, tp)
        self.dropout = nn.Dropout(cfg.dropout)
        self.compiled: Callable | None = None  # see compile_blocks

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        if cache is None and documents is None and self.compiled is not None:
            return self.compiled(x)
        return self.layer(x, cache, documents)  # (--compile with --document-mask is refused: validate.py)

    def layer(self, x: torch.Tensor, cache: LayerCache | None = None,
              documents: Documents | None = None) -> torch.Tensor:
        x = x + self._dropout(self.attn(self.ln1(x), cache, documents))
        return x + self._dropout(self.mlp(self.ln2(x)))

    def _dropout(self, h: torch.Tensor) -> torch.Tensor:
        with self.tp.sharded_dropout():
            return self.dropout(h)


class Embedding(nn.Module):
    """Token embedding, plus a learned position embedding for GPT-2 (Llama's positions are
    rotary, inside attention); the token table is padded (see ModelConfig) and split over
    TP by vocabulary rows."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int, tp: TensorParallel, cp: ContextParallel | None = None):
        super().__init__()
        self.tp, self.cp = tp, cp or ContextParallel()
        self.word = VocabParallelEmbedding(padded_vocab, cfg.d_model, tp)
        self.word.weight.vocab_rows = cfg.vocab_size  # rows past this are padding
        if cfg.arch == "gpt2":
            self.position = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.position.weight.sequence_parallel = tp.sequence_parallel
        else:
            self.position = None
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor, offset: int = 0, documents: Documents | None = None) -> torch.Tensor:
        """``tokens`` at positions ``offset`` on (after those in a key/value cache); under
        context parallelism, at this cp rank's true positions; with ``documents``, at
        each token's position within its document (this cp rank's, this tp rank's share
        under SP)."""
        x = self.word(tokens)  # [b, s / tp, d] under sequence parallelism
        if self.position is not None:
            first = self.tp.rank * x.shape[1] if self.tp.sequence_parallel else offset
            if documents is not None:
                positions = documents.local_positions(self.cp)[:, first:first + x.shape[1]]
            elif self.cp.size > 1:  # the cp rank's chunks (its tp share of them under SP)
                positions = self.cp.positions(tokens.shape[1], tokens.device)[first:first + x.shape[1]]
            else:
                if first + x.shape[1] > self.position.num_embeddings:
                    raise ValueError(f"{first + x.shape[1]} positions: the learned position table holds "
                                     f"{self.position.num_embeddings} (the model's --seq-len); pass at most "
                                     f"{self.position.num_embeddings} tokens")
                positions = torch.arange(first, first + x.shape[1], device=tokens.device)
            x = x + self.position(positions)
        with self.tp.sharded_dropout():
            return self.dropout(x)


@dataclass(frozen=True)
class ChunkSpec:
    """One model chunk a pipeline rank runs: which blocks, and whether it embeds / ends."""

    layer_ids: tuple[int, ...]
    pre_process: bool = True
    post_process: bool = True


class Decoder(nn.Module):
    """A GPT-2 or Llama decoder (``cfg.arch``), or the chunks of one that a pipeline rank holds.

    Each :class:`ChunkSpec` names its blocks by global index and says whether it holds
    the embedding (``pre_process``) or the final norm, head and loss (``post_process``),
    as Megatron's model_provider flags do. A rank with several chunks (interleaved
    schedule) holds them in one module, so parameter names stay global. ``tp`` says how
    each layer is split (default: not at all), ``cp`` over which ranks each sequence is
    split (default: none; then inputs and labels are this cp rank's two chunks,
    context_parallel.split_sequence), ``recompute`` which activations are recomputed
    rather than kept (default: none).
    """

    def __init__(self, cfg: ModelConfig, *, layer_ids: Iterable[int] | None = None,
                 pre_process: bool = True, post_process: bool = True,
                 tp: TensorParallel | None = None, chunks: list[ChunkSpec] | None = None,
                 recompute: Recomputation | None = None, cp: ContextParallel | None = None,
                 ep: ExpertParallel | None = None, loss_chunks: int | None = None):
        super().__init__()
        self.cfg = cfg
        # the summed loss's fused head + cross entropy (head_loss.py): chunks per micro-batch,
        # None automatic, 0 the unfused head (the whole micro-batch's logits, torch's cross entropy)
        self.loss_chunks = loss_chunks
        self.tp = tp = tp or TensorParallel()
        self.cp = cp = cp or ContextParallel()
        self.ep = ep = ep or ExpertParallel()
        self.recompute = recompute = recompute or Recomputation(rng=tp.rng)
        ids = tuple(range(cfg.n_layer) if layer_ids is None else layer_ids)
        self.chunks = chunks or [ChunkSpec(ids, pre_process, post_process)]
        has_embedding = any(c.pre_process for c in self.chunks)
        has_head = any(c.post_process for c in self.chunks)
        self.padded_vocab = cfg.padded_vocab_size(tp.size)
        self.embedding = Embedding(cfg, self.padded_vocab, tp, cp) if has_embedding else None
        rotary = llama.Rotary(cfg) if cfg.arch == "llama" else None  # one table for all blocks
        def block(i: int) -> Block:
            return Block(cfg, tp, recompute, rotary, cp, layer=i, ep=ep)
        self.blocks = nn.ModuleDict({str(i): block(i) for c in self.chunks for i in c.layer_ids})
        self.final_norm = (llama.rms_norm if cfg.arch == "llama" else layer_norm)(cfg, tp) if has_head else None
        if has_head and not (cfg.tie_embeddings and has_embedding):
            # Untied head, or a last pipeline stage that keeps its own copy of the tied
            # table (kept equal to the first stage's by summing their gradients).
            self.head = nn.Parameter(torch.empty(self.padded_vocab // tp.size, cfg.d_model))
            self.head.tp_spec = ShardSpec(0)
            self.head.vocab_rows = cfg.vocab_size
            self.head.tied_copy = cfg.tie_embeddings
        else:
            self.head = None
        # multi-token prediction (mtp.py) on the stage with the head; where that stage holds
        # neither the token table nor a tied head copy of it, a copy of the table for its lookups
        self.mtp = nn.ModuleList([multi_token.MTPModule(cfg, tp, block(i)) for i in multi_token.layer_ids(cfg)]) \
            if has_head and cfg.mtp_layers else None
        copied = has_embedding or (self.head is not None and self.head.tied_copy)
        self.embedding_copy = multi_token.embedding_copy(cfg, self.padded_vocab, tp) \
            if self.mtp is not None and not copied else None
        self.mtp_loss_sum: torch.Tensor | None = None  # this step's so far (mtp.take_loss_sum)
        self.compiled_loss: Callable | None = None  # see compile_blocks

    def output_weight(self) -> torch.Tensor:
        return self.embedding.word.weight if self.head is None else self.head

    def input_weight(self) -> torch.Tensor:
        """This rank's token table for lookups: the embedding's, else a last stage's copy
        (the tied head, or ``embedding_copy``) for multi-token prediction."""
        if self.embedding is not None:
            return self.embedding.word.weight
        return self.embedding_copy if self.embedding_copy is not None else self.head

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None, *,
                chunk: int = 0, cache: KVCache | None = None, documents: torch.Tensor | None = None,
                reduction: str = "none", tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids in, logits ``[b, s, vocab]`` out, or per-token losses ``[b, s]`` (at
        least fp32) when labels are given; with ``reduction="sum"`` their sum, a scalar,
        computed by the fused, chunked head + loss (head_loss.py: the micro-batch's logits
        never exist at once) unless ``loss_chunks`` is 0. A chunk without the embedding takes hidden
        states; a chunk without the head returns them. With a ``cache`` (from
        :meth:`new_cache`; whole one-process models only), ``inputs`` are the tokens
        after the cached ones, and their keys and values join the cache.

        ``documents`` (``--document-mask``): the document id of every token of the whole
        sequence, ``[b, seq_len]`` int64, non-decreasing (the data's ``documents`` key;
        whole under context parallelism, where ``inputs`` are this rank's chunks). Then
        attention stays within each document and positions restart at 0 at each one:
        every document's tokens get the numbers they would get alone. Every chunk of a
        pipeline takes them (each stage's attention is masked).

        Multi-token prediction (``cfg.mtp_layers``, mtp.py) runs in training only (the
        module in train mode, ``reduction="sum"``, gradients enabled): its loss joins the
        returned main loss's backward, not its value. A last chunk without the embedding
        then needs the micro-batch's ``tokens`` (a first chunk's are its ``inputs``)."""
        spec = self.chunks[chunk]
        if cache is not None:
            self._check_cache(cache, inputs.shape[1])
            if documents is not None:
                raise ValueError("a key/value cache holds one sequence: generation takes no documents")
        docs = None if documents is None else Documents(documents)  # once per micro-batch and chunk
        if spec.pre_process:
            with memory.layer_scope("embedding"):
                x = self.embedding(inputs, 0 if cache is None else cache.length, docs)
        else:
            x = inputs
        if cache is None:
            x = self._run_blocks(x, spec.layer_ids, docs)
        else:
            for i in spec.layer_ids:
                x = self.blocks[str(i)](x, cache.layer(i))
            cache.advance(x.shape[1])
        if not spec.post_process:
            return x
        with memory.layer_scope("head"):
            x = self.final_norm(x)
            out = self.head_loss(x, labels, reduction)
        if (self.mtp is not None and labels is not None and reduction == "sum" and self.training
                and torch.is_grad_enabled()):
            out = multi_token.add_mtp_loss(self, out, x, inputs if spec.pre_process else tokens, labels, docs)
        return out

    def head_loss(self, x: torch.Tensor, labels: torch.Tensor | None, reduction: str = "none") -> torch.Tensor:
        """The output head on normed hidden states ``x``: gathered logits without labels,
        else per-token losses or (``reduction="sum"``) their sum, by the fused, chunked
        head where :meth:`fuses_loss` says so (the main head's and each MTP depth's)."""
        if labels is not None and reduction == "sum" and self.fuses_loss(labels.numel()):
            return fused_head_loss(x, self.output_weight(), labels, self.cfg.vocab_size, self.tp, self.loss_chunks)
        # a head weight used once per micro-batch defers its gradient under a split backward; one
        # that is also the lookup table, or serves the MTP depths too, must not (a count per backward)
        in_place = self.head is None or self.mtp is not None
        logits = parallel_lm_logits(x, self.output_weight(), self.tp, tied_in_place=in_place)
        if labels is None:
            return gather_logits(logits, self.cfg.vocab_size, self.tp)
        if self.compiled_loss is not None:
            losses = self.compiled_loss(logits, labels, self.cfg.vocab_size)
        else:
            losses = vocab_parallel_cross_entropy(logits, labels, self.cfg.vocab_size, self.tp)
        return losses.sum() if reduction == "sum" else losses

    def fuses_loss(self, tokens: int) -> bool:
        """Whether the summed loss of a micro-batch of ``tokens`` tokens runs through the
        fused, chunked head (head_loss.py): ``loss_chunks`` >= 1; left automatic, where
        the logits outgrow one chunk (head_loss.worth_fusing), except under ``--compile``
        without TP (the compiled cross entropy fuses the upcast and softmax itself)."""
        if self.loss_chunks is None:
            local_vocab = self.cfg.padded_vocab_size(self.tp.size) // self.tp.size
            return self.compiled_loss is None and worth_fusing(tokens, local_vocab)
        return self.loss_chunks > 0

    def _run_blocks(self, x: torch.Tensor, layer_ids: tuple[int, ...],
                    documents: Documents | None = None) -> torch.Tensor:
        """Blocks ``layer_ids`` in turn, recomputed as the recomputation policy says."""
        for ids, recomputed in self.recompute.policy.block_runs(layer_ids):
            if recomputed and self.recompute.full:
                with memory.layer_scope(f"blocks.{ids[0]}"):
                    x = self.recompute.checkpoint(self._blocks(ids, documents), x)
                continue
            for i in ids:
                with memory.layer_scope(f"blocks.{i}"):
                    x = self.blocks[str(i)](x, documents=documents)
        return x

    def new_cache(self, batch: int) -> KVCache:
        """An empty key/value cache for ``batch`` sequences of up to ``seq_len`` tokens
        (the positions GPT-2's table and Llama's rotary table hold), in the model's dtype
        and on its device; with latent attention, a cache of latents (mla.LatentCache)."""
        self._check_cache(None, 0)
        weight = self.output_weight()
        if self.cfg.mla:
            return mla.new_cache(self.cfg, batch, dtype=weight.dtype, device=weight.device)
        return KVCache(self.cfg.n_layer, batch, self.cfg.kv_heads, self.cfg.head_dim, self.cfg.seq_len,
                       dtype=weight.dtype, device=weight.device)

    def _check_cache(self, cache: KVCache | None, tokens: int) -> None:
        """A key/value cache serves only a whole model in one process, within its context."""
        whole = len(self.chunks) == 1 and self.chunks[0].pre_process and self.chunks[0].post_process
        if (self.tp.size != 1 or self.tp.sequence_parallel or self.cp.size != 1 or not whole
                or len(self.blocks) != self.cfg.n_layer):
            raise ValueError("a key/value cache needs the whole model in one process (tp 1, no pipeline stages, "
                             "no sequence parallelism): gather it first (checkpoint.gather_model)")
        if cache is not None and cache.length + tokens > cache.max_len:
            raise ValueError(f"a key/value cache holds {cache.max_len} positions: {cache.length} cached + "
                             f"{tokens} new tokens do not fit (slide a window without the cache)")

    def _blocks(self, ids: tuple[int, ...], documents: Documents | None = None):
        """A function running blocks ``ids`` in turn: one recomputed region. The
        micro-batch's ``documents`` are bound in, so that the rebuild in backward masks
        as its forward did, whatever ran in between."""
        def run(x: torch.Tensor) -> torch.Tensor:
            for i in ids:
                x = self.blocks[str(i)](x, documents=documents)
            return x
        return run


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """``--compile``: ``torch.compile`` each transformer block's training forward, and so
    its backward (AOTAutograd), and, without tensor parallelism, the cross entropy (its
    upcast to fp32, log-sum-exp and gather fuse: eager, a 50k vocabulary's logits and
    their gradient exist in fp32, the largest tensors of a small model's step),
    leaving the rest of the step eager: the embedding, the head's matrix product, the
    pipeline runtime, gradient hooks and the optimizer. Returns the number of blocks
    compiled. ``backend``: torch.compile's (``aot_eager``: the same capture and
    AOTAutograd backward, eager kernels).

    Blocks are where the time is and they are all alike, so one compiled graph serves
    every block of a rank (parameters are the graph's inputs). Calls with a key/value
    cache (generation) stay eager: their shapes change every token. Random draws fall
    back to eager kernels (inductor's ``fallback_random``) so that dropout masks are the
    eager ones: recomputation replays them and runs on any layout draw them alike.
    Full recomputation recompiles nothing new: its first pass runs the block without a
    graph, its rebuild with one. What a compiled block saves for backward is its
    partitioner's choice, not the eager list the activation-memory formula counts.
    """
    import torch._inductor.config as inductor

    from gridtrain.parallel.split_backward import keep_out_of_compiled_graphs

    inductor.fallback_random = True
    keep_out_of_compiled_graphs()  # zero-bubble schedules: deferrable linears stay eager
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        block.compiled = torch.compile(block.layer, backend=backend)
    for decoder in (m for m in model.modules() if isinstance(m, Decoder)):
        if decoder.tp.size == 1 and any(c.post_process for c in decoder.chunks):
            decoder.compiled_loss = torch.compile(one_rank_cross_entropy, backend=backend)
    return len(blocks)


def parameter_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one parameter: the same in every process and layout."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_std(name: str, param: torch.Tensor, cfg: ModelConfig) -> float | None:
    """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer); None =
    constant (biases 0; norms 1: the block norms, the final norm, and every ``*_norm``:
    query/key norms, latent attention's latent norms)."""
    if getattr(param, "residual_projection", False):
        return 0.02 / math.sqrt(2 * cfg.n_layer)
    if (name.endswith(".bias") or ".ln" in name or name.startswith("final_norm") or name.endswith("_norm.weight")
            or name.endswith((".enorm.weight", ".hnorm.weight"))):  # multi-token prediction's input norms
        return None
    return 0.02


def initial_tensor(name: str, param: torch.Tensor, shape: tuple[int, ...], cfg: ModelConfig,
                   seed: int) -> torch.Tensor:
    """The whole tensor parameter ``name`` starts from (global ``shape``, no vocabulary
    padding), in fp32 on the host: drawn from a generator of its own, seeded by (seed,
    name), or constant (norms 1, biases 0). Every layout slices its shards from it."""
    std = _init_std(name, param, cfg)
    if std is None:
        return torch.full(shape, 1.0 if name.endswith("weight") else 0.0)
    gen = torch.Generator().manual_seed(parameter_seed(seed, canonical_name(name)))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_parameters(model: Decoder, seed: int) -> None:
    """Draw each parameter whole (:func:`initial_tensor`), then copy in the local shard:
    the one-process reference of initialisation, for models built with memory. A
    training run builds on the meta device and each rank reads only its own pieces of
    the same tensors (gridtrain.checkpoint.materialise); tests hold the two equal.

    Values are drawn in fp32 on the CPU so every dtype, device and TP layout starts from
    the same numbers; vocabulary padding rows are zero (they never receive a gradient).
    """
    tp = model.tp
    for name, param in model.named_parameters():
        spec = shard_spec(param)
        full_shape = spec.full_shape(param.shape, tp.size) if spec else tuple(param.shape)
        rows = getattr(param, "vocab_rows", full_shape[0])
        full = torch.zeros(full_shape)
        full[:rows] = initial_tensor(name, param, (rows, *full_shape[1:]), model.cfg, seed)
        param.copy_(shard(full, spec, tp.rank, tp.size) if spec else full)


def canonical_name(name: str) -> str:
    """A last stage's copy of the tied table (the head, or multi-token prediction's
    ``embedding_copy``) starts from the same numbers as the original."""
    return "embedding.word.weight" if name in ("head", "embedding_copy") else name


def mlp_parameters(cfg: ModelConfig, width: int, tp: int = 1) -> int:
    """An MLP ``width`` wide on one TP rank: Llama's gate, up and down (1/tp, no biases);
    GPT-2's expansion (weight and bias 1/tp) and projection (weight 1/tp, bias whole).
    Experts are whole on their rank: ``tp`` 1."""
    d = cfg.d_model
    if cfg.arch == "llama":
        return 3 * d * width // tp
    return (d * width + width) // tp + width * d // tp + d


def block_parameters(cfg: ModelConfig, tp: int = 1, layer: int = 0, ep: int = 1) -> int:
    """Parameters of block ``layer`` on one TP rank (and, for a MoE block, one ep rank).
    GPT-2: two LayerNorms (whole), column-parallel QKV (weights and biases / tp),
    row-parallel projection (weight / tp, bias whole); Llama: two RMSNorms and the
    attention of llama.attention_parameters (mla.attention_parameters for latent
    attention). Then the MLP: a dense block's
    (:func:`mlp_parameters`), or a MoE block's router ``[E, d]`` (whole), its ``E / ep``
    experts (whole, ``moe_ffn_size`` wide) and its shared experts (one MLP ``S x H``
    wide, split over tp). Dense models' blocks are all alike; a MoE model's layer 0 is a
    MoE block."""
    d = cfg.d_model
    if cfg.arch == "llama":
        attention = 2 * d + (mla if cfg.mla else llama).attention_parameters(cfg, tp)
    else:
        attention = 4 * d + (3 * d * d + 3 * d) // tp + d * d // tp + d
    if not cfg.is_moe_layer(layer):
        return attention + mlp_parameters(cfg, cfg.ffn_size, tp)
    shared = cfg.moe_shared_experts * cfg.moe_ffn_size
    return (attention + cfg.n_experts * d + cfg.n_experts // ep * mlp_parameters(cfg, cfg.moe_ffn_size)
            + (mlp_parameters(cfg, shared, tp) if shared else 0))


def count_parameters(cfg: ModelConfig, *, exclude_embeddings: bool = False, mtp: bool = True) -> int:
    """Parameters of the whole (unpadded) model, from its shape alone (every expert);
    with ``mtp`` (default) the multi-token prediction modules' too (:func:`mtp_parameters`:
    what the model holds). Published sizes leave them out (DeepSeek-V3's 671B is without
    its MTP module): ``mtp=False``."""
    d = cfg.d_model
    norm = d if cfg.arch == "llama" else 2 * d  # the final norm: RMSNorm has no bias
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    total = sum(block_parameters(cfg, layer=i) for i in range(cfg.n_layer)) + norm + head
    total += mtp_parameters(cfg) if mtp else 0
    return total if exclude_embeddings else total + embedding_parameters(cfg)


def active_parameters(cfg: ModelConfig, *, exclude_embeddings: bool = False, mtp: bool = True) -> int:
    """Parameters one token goes through: :func:`count_parameters` with ``k`` of the ``E``
    experts of each MoE layer (router and shared experts included): Mixtral 8x7B's 12.9B
    of 46.7B. The same as count_parameters for a dense model. ``mtp``: as there (the MTP
    blocks' MoE layers count ``k`` experts too)."""
    moe_layers = len(cfg.moe_layers) + (sum(map(cfg.is_moe_layer, multi_token.layer_ids(cfg))) if mtp else 0)
    unused = moe_layers * (cfg.n_experts - cfg.moe_top_k) * mlp_parameters(cfg, cfg.moe_ffn_size)
    return count_parameters(cfg, exclude_embeddings=exclude_embeddings, mtp=mtp) - unused


def mtp_parameters(cfg: ModelConfig, tp: int = 1, ep: int = 1) -> int:
    """The multi-token prediction modules' parameters (mtp.py) on one TP rank (and ep
    rank): per depth three RMSNorms and the ``[d, 2d]`` projection (replicated over TP)
    and its block (:func:`block_parameters` of layer ``n_layer + k - 1``). The embedding
    and the head are the main model's: not counted again (a last stage's copy of the
    table neither, as a tied head copy is not)."""
    d = cfg.d_model
    return sum(3 * d + 2 * d * d + block_parameters(cfg, tp, layer=i, ep=ep) for i in multi_token.layer_ids(cfg))


def embedding_parameters(cfg: ModelConfig) -> int:
    """The token table, and GPT-2's position table."""
    return (cfg.vocab_size + (cfg.seq_len if cfg.arch == "gpt2" else 0)) * cfg.d_model


def parameter_costs(cfg: ModelConfig, ep: int = 1) -> tuple[list[float], float, float]:
    """Parameters per block (a MoE block's ``E / ep`` experts), in the embedding and in the
    head (untied copy counted; with the multi-token prediction modules, which run with
    it on the last stage): the costs of ``--pp-partition parameters``."""
    d = cfg.d_model
    head = cfg.vocab_size * d + (d if cfg.arch == "llama" else 2 * d) + mtp_parameters(cfg, ep=ep)
    blocks = [float(block_parameters(cfg, layer=i, ep=ep)) for i in range(cfg.n_layer)]
    return blocks, embedding_parameters(cfg), head


def profile_units(cfg: ModelConfig, micro_batch_size: int, steps: int = 3, *,
                  device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> tuple[list[float], float, float]:
    """Measured forward+backward seconds of each block, the embedding and the head + loss,
    on the training ``device`` and ``dtype``, with random tokens (median of ``steps`` runs,
    each timed to the end of the device's work: timing.py): the costs of
    ``--pp-partition time``."""
    clock = clock_for(device)
    model = Decoder(cfg)
    init_parameters(model, 0)
    model.to(device=device, dtype=dtype)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch_size, cfg.seq_len), device=device)

    def timed(fn) -> float:
        return median_seconds(fn, steps, clock)

    hidden = model.embedding(tokens).detach()
    embedding = timed(lambda: model.embedding(tokens).sum().backward())
    blocks = [timed(lambda b=b: b(hidden.requires_grad_()).sum().backward()) for b in model.blocks.values()]
    head_chunk = Decoder(cfg, layer_ids=[], pre_process=False).to(device=device, dtype=dtype)
    with_mtp = dict(tokens=tokens, reduction="sum") if cfg.mtp_layers else {}  # the MTP depths run with the head
    head = timed(lambda: head_chunk(hidden.requires_grad_(), tokens, **with_mtp).sum().backward())
    return blocks, embedding, head


def training_flops_per_token(cfg: ModelConfig) -> float:
    """Model FLOPs per trained token: forward plus backward (3x forward), no recompute.

    Per token and layer the forward pass does 24 d^2 (QKV, projection, 4x MLP matmuls,
    each FLOP counted as 2 for multiply-add) plus 4 s d for the attention scores and the
    weighted sum; the logits add 2 d V. Backward costs twice the forward. This is the
    formula of Narayanan et al. (2021): 72 B s L d^2 (1 + s/(6d)) + 6 B s d V per batch.
    Llama's grouped-query attention and three-matrix MLP: llama.attention_flops_per_token
    (mla.attention_flops_per_token for latent attention) and 6 d ffn. A MoE layer counts
    what a token goes through (active parameters): the router's 2 d E, and k routed
    experts plus the shared ones in place of the dense MLP. Each multi-token prediction
    depth adds its block (layer ``n_layer + k - 1``), its ``[d, 2d]`` projection (4 d^2)
    and another pass through the head (2 d V).
    """
    d, s, V = cfg.d_model, cfg.seq_len, cfg.vocab_size
    if cfg.arch == "llama":
        attention, mlp = (mla if cfg.mla else llama).attention_flops_per_token(cfg), 6.0 * d
    else:
        attention, mlp = 8.0 * d * d + 4.0 * s * d, 4.0 * d
    moe = 2.0 * d * cfg.n_experts + mlp * cfg.moe_ffn_size * (cfg.moe_top_k + cfg.moe_shared_experts)
    blocks = range(cfg.n_layer + cfg.mtp_layers)  # the MTP blocks follow the main ones (mtp.layer_ids)
    layers = sum(attention + (moe if cfg.is_moe_layer(i) else mlp * cfg.ffn_size) for i in blocks)
    return 3.0 * (layers + (1 + cfg.mtp_layers) * 2 * d * V + cfg.mtp_layers * 4 * d * d)


@torch.no_grad()
def generate(model: Decoder, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None,
             use_cache: bool = True) -> torch.Tensor:
    """Sample continuations of ``prompt`` ([b, t] token ids); returns prompt + new tokens.

    With ``use_cache`` (a whole one-process model), the prompt runs once and each later
    step runs only the newest token over a key/value cache; past the context
    (``seq_len`` tokens) every step runs the last ``seq_len`` tokens without it, as
    without the cache."""
    was_training = model.training
    model.eval()
    ids = prompt
    seq_len = model.cfg.seq_len
    cache = model.new_cache(prompt.shape[0]) if use_cache else None
    with model.tp.without_sequence_parallel():
        for _ in range(max_new_tokens):
            if cache is not None and ids.shape[1] <= seq_len:
                logits = model(ids[:, cache.length:], cache=cache)[:, -1, :].float()
            else:
                logits = model(ids[:, -seq_len:])[:, -1, :].float()
            ids = torch.cat([ids, sample_next(logits, temperature, top_k, generator)], dim=1)
    model.train(was_training)
    return ids


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from last-position logits: greedy at temperature 0, else top-k sampling."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).to(logits.device)
