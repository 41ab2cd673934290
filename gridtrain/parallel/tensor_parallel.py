"""Tensor parallelism, Megatron style: every transformer layer split across the TP group.

* :class:`ColumnParallelLinear` splits the output features (each rank computes a slice of
  the columns); :class:`RowParallelLinear` splits the input features and sums the partial
  products. Attention is a column-parallel QKV (each rank owns whole heads) and a
  row-parallel output projection; the MLP is column then row. One all-reduce in the
  forward pass and one in the backward per pair, and none in between.
* :class:`VocabParallelEmbedding` gives each rank a range of the (padded) vocabulary; ids
  outside it look up zeros and the partial tables are summed.
* :func:`vocab_parallel_cross_entropy` computes the loss from vocabulary-sharded logits
  with three all-reduces of ``[b, s]`` numbers (max, target logit, sum of exponentials),
  in fp32, never building the full ``[b, s, V]`` logits.
* Sequence parallelism (``TensorParallel.sequence_parallel``) runs LayerNorm and dropout on
  sequence shards: the all-reduce around a column/row pair becomes an all-gather before
  the column layer and a reduce-scatter after the row layer (same bytes), and the
  gradients of weights replicated across TP but fed by shards are summed over TP
  after backward (``grads.allreduce_sequence_parallel_grads``).
  A column layer keeps only its input *shard* for backward and all-gathers it again
  there (Megatron does the same): one more all-gather per column layer buys (t-1)/t of
  its saved input, which is what makes every saved activation 1/t (Korthikanti et al.).
* dropout inside TP regions draws from this rank's own stream of the RNG tracker
  (:mod:`gridtrain.parallel.rng`).

Every sharded parameter carries a :class:`ShardSpec`, so the whole-tensor initialisation,
checkpoints and tests can move between the full tensor and any rank's shard.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from gridtrain.parallel import comm
from gridtrain.parallel.comm import CommGroup, OnGroup
from gridtrain.parallel.float8 import Float8, Float8Linear, kind_of, mark
from gridtrain.parallel.rng import RNGStatesTracker
from gridtrain.parallel.split_backward import WeightGradStore, linear, outside_compiled_graphs, weight_grad_of

IGNORE_INDEX = -100


# ---- shards ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardSpec:
    """How a parameter is split over TP: along ``dim``, part by part, each slice held by
    ``replicas`` consecutive ranks.

    A fused tensor such as QKV holds ``parts`` tensors stacked along ``dim``; each part is
    split separately so that rank r holds the r-th slice of Q, of K and of V (whole heads).
    ``replicas > 1`` describes a tensor with fewer slices than TP ranks (Llama's key/value
    heads when tp exceeds their count, docs/llama.md): it is cut into ``size / replicas``
    slices and rank r holds slice ``r // replicas``; the ranks sharing a slice hold
    copies, whose gradients are partial sums (grads.allreduce_replicated_grads).
    """

    dim: int
    parts: int = 1
    replicas: int = 1

    def slices(self, size: int) -> int:
        """How many different slices ``size`` TP ranks hold."""
        return size // self.replicas

    def full_shape(self, local_shape: torch.Size, size: int) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] *= self.slices(size)
        return tuple(shape)


def shard(full: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full``."""
    parts = full.chunk(spec.parts, dim=spec.dim)
    n, i = spec.slices(size), rank // spec.replicas
    return torch.cat([p.chunk(n, dim=spec.dim)[i] for p in parts], dim=spec.dim)


def unshard(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The full tensor from every rank's shard (inverse of :func:`shard`)."""
    split = [s.chunk(spec.parts, dim=spec.dim) for s in shards[::spec.replicas]]
    return torch.cat([torch.cat([s[p] for s in split], dim=spec.dim) for p in range(spec.parts)],
                     dim=spec.dim)


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    return getattr(param, "tp_spec", None)


def split_over(param: torch.Tensor, tp: "TensorParallel") -> tuple[ShardSpec | None, "CommGroup"]:
    """How ``param`` is split and over which group: its TP spec over ``tp``'s group, or,
    for an expert's slice under expert tensor parallelism (``--etp``), its spec over its
    etp group (``param.etp_shard``: (spec, group), set by models/moe.py). What places a
    rank's piece in the whole tensor (checkpoints, initialisation, gathers) asks this."""
    etp = getattr(param, "etp_shard", None)
    return etp if etp is not None else (shard_spec(param), tp.comm)


def is_tp_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    """True for a copy of a parameter that another TP rank also holds, on any rank but
    the first of those holding it: count it only once (replicated parameters, and
    replicated slices such as shared key/value heads)."""
    spec = shard_spec(param)
    if getattr(param, "tp_distinct", False):  # folded experts: each tp rank holds its own
        return False
    if spec is None:
        return tp_rank != 0
    return tp_rank % spec.replicas != 0


# ---- the TP context a model is built with ------------------------------------------------

@dataclass
class TensorParallel(OnGroup):
    """What TP layers need: the group, whether sequence parallelism is on, the RNG streams."""

    comm: CommGroup = field(default_factory=lambda: comm.single("tp"))
    sequence_parallel: bool = False
    rng: RNGStatesTracker = field(default_factory=lambda: RNGStatesTracker(torch.device("cpu")))
    weight_grads: WeightGradStore | None = None  # zero-bubble schedules: queue weight gradients here
    fp8: Float8 | None = None  # --fp8: the blocks' linears run float8 GEMMs (float8.py)

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        """Out of a row-parallel layer: sum partial results (keeping a sequence shard under SP)."""
        if self.sequence_parallel:
            return comm.reduce_scatter_seq(partial, self.comm)
        return comm.reduce_from_tp(partial, self.comm)

    def sharded_dropout(self):
        """Dropout on sequence shards draws per rank; on replicated activations, alike."""
        return self.rng.fork() if self.sequence_parallel else contextlib.nullcontext()

    @contextlib.contextmanager
    def without_sequence_parallel(self):
        """Run on full sequences (generation takes prompts of any length); same model."""
        saved, self.sequence_parallel = self.sequence_parallel, False
        try:
            yield
        finally:
            self.sequence_parallel = saved


# ---- layers -----------------------------------------------------------------------------

def _param(*shape: int, spec: ShardSpec | None = None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape))
    if spec is not None:
        p.tp_spec = spec
    return p


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A's output rows (and b) split over TP; y stays split.

    ``replicas``: each slice of A is held by that many consecutive ranks (see ShardSpec)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, *, parts: int = 1,
                 bias: bool = True, replicas: int = 1):
        super().__init__()
        slices = tp.size // replicas
        if out_features % (parts * slices) or tp.size % replicas:
            raise ValueError(f"{out_features} output features do not split into {parts} x {slices} slices "
                             f"over tp {tp.size}")
        self.tp = tp
        spec = ShardSpec(0, parts, replicas)
        self.weight = _param(out_features // slices, in_features, spec=spec)
        self.bias = _param(out_features // slices, spec=spec) if bias else None
        if tp.fp8 is not None and replicas == 1:  # a slice held by several ranks gets partial output gradients
            mark(self.weight, "column")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_linear(x, self.weight, self.bias, self.tp)


class _ColumnLinears(torch.autograd.Function):
    """One or more column-parallel linears reading the same input ``x`` (Llama's q, k, v or
    gate and up share one entry into the TP region): ``x`` whole under TP, a sequence
    shard all-gathered once under SP (only the shard is kept for backward).

    The backward overlaps its communication with computation, as Megatron's
    ``LinearWithGradAccumulationAndAsyncCommunication`` does: the input gradient
    ``sum_i g_i A_i`` is computed first and its all-reduce (TP) or reduce-scatter (SP)
    issued at once, and the weight gradients ``g_i^T x`` are computed while it travels;
    under SP the input is re-gathered while its gradient is being computed. Under a split
    backward (ZB-H1's B) the weight gradients are queued instead (split_backward.py)."""

    @staticmethod
    def forward(ctx, x, comm, sequence_parallel, store, fp8, *weights):
        ctx.weights, ctx.comm, ctx.store, ctx.fp8 = weights, comm, store, fp8  # the parameters themselves (see split_backward.py)
        ctx.sequence_parallel = sequence_parallel
        total = comm.all_gather(x, 1) if sequence_parallel else x
        outputs, scales = [], []
        for w in weights:  # float8 weights cast the gathered input (its scale: the whole sequences')
            if fp8 is not None and kind_of(w):
                y, s = fp8.forward(total, w, "column")
                outputs.append(y)
                scales.append(s)
            else:
                outputs.append(F.linear(total, w))
        ctx.save_for_backward(x, *scales)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outs):
        (x, *scales), comm, sp, fp8 = ctx.saved_tensors, ctx.comm, ctx.sequence_parallel, ctx.fp8
        gathering = comm.start_all_gather(x, 1) if sp else None  # again: the price of keeping 1/t of the input
        grad_in, kept = None, []
        for w, g in zip(ctx.weights, grad_outs):
            if fp8 is not None and kind_of(w):
                part, k = fp8.grad_input(g, w, "column")
                kept.append(k)
            else:
                part = g @ w.to(g.dtype)
            grad_in = part if grad_in is None else grad_in + part
        reducing = comm.start_reduce_scatter(grad_in, 1) if sp else comm.start_all_reduce(grad_in)
        total = gathering.wait() if sp else x
        grad_weights, scales, kept = [], iter(scales), iter(kept)
        for w, g in zip(ctx.weights, grad_outs):
            product = fp8.grad_weight(g, total, next(scales), next(kept)) if fp8 is not None and kind_of(w) else None
            grad_weights.append(weight_grad_of(w, g, total, ctx.store, product))
        return reducing.wait(), None, None, None, None, *grad_weights


def column_linears(x: torch.Tensor, weights: list[torch.Tensor], tp: TensorParallel,
                   defer: bool = True) -> list[torch.Tensor]:
    """``x A_i^T`` for column-parallel weights ``A_i`` that read the same input, ``x`` whole
    (TP) or a sequence shard (SP): one entry into the TP region (one all-gather under SP,
    one all-reduce of the input gradient without) for all of them, overlapped in
    backward with the weight gradients (:class:`_ColumnLinears`).

    The same operations with and without autograd recording, so that a recomputed region
    rebuilds exactly the values its forward produced. ``defer=False`` keeps the weight
    gradients in B under a split backward (see :func:`parallel_lm_logits`)."""
    store = tp.weight_grads if defer else None
    if tp.size == 1:
        return [local_linear(x, w, None, tp, store) for w in weights]
    apply, sp = _ColumnLinears.apply, tp.sequence_parallel
    outputs = apply(x, tp.comm, sp, None, tp.fp8, *weights) if store is None else \
        outside_compiled_graphs(apply, x, tp.comm, sp, store, tp.fp8, *weights)
    return list(outputs)


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  tp: TensorParallel, defer: bool = True) -> torch.Tensor:
    """``x A^T + b`` for one column-parallel weight (see :func:`column_linears`)."""
    if tp.size == 1:
        return local_linear(x, weight, bias, tp, tp.weight_grads if defer else None)
    (y,) = column_linears(x, [weight], tp, defer)
    return y if bias is None else y + bias


def local_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel,
                 store: WeightGradStore | None) -> torch.Tensor:
    """``x A^T + b`` on this rank's input as it is (a row-parallel layer, a column layer at
    tp 1 or fed a replicated input): split_backward's :func:`linear`, or in float8 where
    the weight is a float8 operand (float8.py), its weight gradient deferrable alike."""
    kind = kind_of(weight) if tp.fp8 is not None else None
    if kind is None:
        return linear(x, weight, bias, store)
    apply = Float8Linear.apply
    y = apply(x, weight, tp.fp8, kind, store) if store is None else \
        outside_compiled_graphs(apply, x, weight, tp.fp8, kind, store)
    return y if bias is None else y + bias


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A's input columns split over TP; x arrives split, y is summed."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, *, bias: bool = True):
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"{in_features} input features do not split over tp {tp.size}")
        self.tp = tp
        self.weight = _param(out_features, in_features // tp.size, spec=ShardSpec(1))
        self.bias = _param(out_features) if bias else None  # added once, after the sum
        if bias:
            self.bias.sequence_parallel = tp.sequence_parallel
        if tp.fp8 is not None:
            mark(self.weight, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.leave(local_linear(x, self.weight, None, self.tp, self.tp.weight_grads))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose (padded) vocabulary rows are split over TP."""

    def __init__(self, padded_vocab: int, dim: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.rows = padded_vocab // tp.size
        self.start = tp.rank * self.rows
        self.weight = _param(self.rows, dim, spec=ShardSpec(0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(tokens, self.weight, self.tp)


def vocab_parallel_embedding(tokens: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The lookup of ``tokens`` in a table whose rows are split over TP (``weight``: this
    rank's ``padded_vocab / tp`` rows): each rank looks up its own rows, zeros elsewhere,
    summed over TP (reduce-scattered over the sequence under sequence parallelism)."""
    if tp.size == 1:
        return F.embedding(tokens, weight)
    rows = weight.shape[0]
    local = tokens - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    out = F.embedding(local.masked_fill(outside, 0), weight)
    return tp.leave(out.masked_fill(outside.unsqueeze(-1), 0.0))


def parallel_lm_logits(x: torch.Tensor, weight: torch.Tensor, tp: TensorParallel, *,
                       tied_in_place: bool = False) -> torch.Tensor:
    """This rank's vocabulary slice of the logits, ``[b, s, padded_vocab / tp]``.

    ``tied_in_place``: ``weight`` is this rank's token embedding table, which also gets a
    gradient from the lookup in the same backward. Its head gradient is then not deferred
    to W, so both arrive in one autograd accumulation: the gradient reducer counts one
    contribution per micro-batch and must not see the table ready before the lookup's."""
    return column_linear(x, weight, None, tp, defer=not tied_in_place)


def gather_logits(logits: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    """Full logits without padding columns (for sampling; training never builds them)."""
    return comm.gather_last_dim(logits, tp.comm)[..., :vocab_size]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy from vocabulary-sharded logits (fp32 or fp64).

    loss = log(sum_v exp(z_v - m)) - (z_target - m) with m the global max; each term is a
    local reduction followed by one all-reduce. Padding columns (global index >= vocab)
    are set to -inf first, so they contribute nothing and get no gradient.
    """

    @staticmethod
    def forward(ctx, logits, labels, vocab_size, tp_comm):
        rows = logits.shape[-1]
        start = tp_comm.rank * rows
        logits = logits.clone()
        if start + rows > vocab_size:
            logits[..., max(0, vocab_size - start):] = float("-inf")
        logits_max = logits.max(dim=-1).values
        tp_comm.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX)
        logits.sub_(logits_max.unsqueeze(-1))
        local_target = labels - start
        mine = (local_target >= 0) & (local_target < rows) & (labels != IGNORE_INDEX)
        index = local_target.masked_fill(~mine, 0).unsqueeze(-1)
        target_logit = logits.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0)
        tp_comm.all_reduce(target_logit)
        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        tp_comm.all_reduce(sum_exp)
        ignored = labels == IGNORE_INDEX
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, mine, ignored = ctx.saved_tensors
        grad = softmax  # reused in place: backward runs once
        grad.scatter_add_(-1, index, -mine.unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                                 tp: TensorParallel) -> torch.Tensor:
    """Per-token losses ``[b, s]`` (0 where the label is IGNORE_INDEX), in fp32 or wider."""
    if tp.size == 1:
        return one_rank_cross_entropy(logits, labels, vocab_size)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return _VocabParallelCrossEntropy.apply(logits, labels, vocab_size, tp.comm)


def one_rank_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The whole vocabulary on one rank: torch's cross entropy over the unpadded columns,
    in fp32 or wider. Eager, it materializes the logits in fp32 (and their gradient): with
    GPT-2's 50k vocabulary that is most of a small model's activation memory; compiled
    (``--compile``: ``Decoder.compiled_loss``), the upcast, log-sum-exp and gather fuse."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if logits.shape[-1] > vocab_size:
        # the padding columns out of the softmax, in place: exp(-inf) adds exactly 0 and
        # gets a zero gradient; slicing them off instead hands the kernels a
        # non-contiguous tensor, which they copy whole (forward and backward)
        logits[..., vocab_size:] = float("-inf")
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return losses.view_as(labels)


# ---- data ------------------------------------------------------------------------------------

def broadcast_batches(batches: list[dict[str, torch.Tensor]] | None, n: int, tp: TensorParallel,
                      device: torch.device,
                      shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
                      ) -> list[dict[str, torch.Tensor]]:
    """The TP group's first rank reads the step's micro-batches; the others receive them.

    One tensor per key travels, holding all ``n`` micro-batches stacked (as Megatron's
    broadcast_data does). Every rank must know each key's micro-batch shape and dtype:
    ``shapes`` when the caller knows them (the training loop does: ``[micro-batch,
    seq]`` int64), so that nothing passes through the host; otherwise they travel first
    as a small object broadcast (pickled on the host: a host synchronisation). Both are
    recorded in the flight recorder, so a TP rank that never comes for its batch is
    named in a hang report.
    """
    if tp.size == 1:
        return batches
    src = tp.rank == 0
    meta = [shapes]
    if shapes is None:
        if src:
            meta[0] = {k: (tuple(v.shape), v.dtype) for k, v in batches[0].items()}
        rec = tp.comm.record("broadcast_object", None, 0)  # flight recorder (watchdog.py); size unknown
        try:
            torch.distributed.broadcast_object_list(meta, src=tp.comm.global_rank(0), group=tp.comm.group,
                                                    device=device if device.type == "cuda" else None)
        finally:
            tp.comm.done(rec)
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for key, (shape, dtype) in sorted(meta[0].items()):
        stacked = (torch.stack([b[key] for b in batches]).to(device) if src
                   else torch.empty((n, *shape), dtype=dtype, device=device))
        tp.comm.broadcast(stacked)
        for i in range(n):
            out[i][key] = stacked[i]
    return out
