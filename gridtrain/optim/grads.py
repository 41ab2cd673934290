"""Everything a gradient goes through after backward, in the order it must happen.

When a stage's last backward (or, under ZB-H1, its last W) has run, each parameter's
gradient is a local sum over this rank's micro-batches. Before the optimizer may use it,
it still has to be combined with its copies and partial sums elsewhere on the grid:

1. **sequence-parallel sums** (TP group): under sequence parallelism LayerNorm weights,
   row-parallel biases and the position embedding see 1/tp of the tokens on each rank,
   so each TP rank holds a partial gradient; their sum over TP is the whole gradient.
   Likewise **replicated slices** (Llama's key/value heads when tp exceeds their count):
   each rank holding a copy has the gradient of its own query heads only, and their sum
   over the ranks sharing the head is the whole gradient;
2. **tied-embedding sums** (embedding group: first and last pipeline stage): the token
   table and the last stage's copy of it as the output head are one parameter, so their
   two gradients are summed and both copies take the same step;
3. **data-parallel average** (DP group): the reducer (data_parallel.py) started most of
   it during backward, bucket by bucket; ``finish`` waits for the rest and divides by dp.
   Under ZeRO-1 it reduce-scatters instead, leaving each DP rank only the average of its
   own 1/dp slice of each bucket;
4. **the step's scalars and clipping**: one norm over every parameter of the whole model
   (TP-replicated parameters and the tied head copy counted once), the mean loss and the
   fp16 overflow flag, each rank's shares summed as one vector over the model-parallel
   group and DP and read once (:func:`step_scalars`); then each rank clips what it holds
   (the optimizer's ``clip_to``).

Why this order: the sums of 1 and 2 and the average of 3 are linear, so they commute, and
the DP average comes first because most of its buckets are already in flight when
backward ends. Under ZeRO-1 a rank then holds only its 1/dp slice of each bucket
(data_parallel.py); the sums of 1 and 2 act on those slices, which is right because the
ranks they sum over hold the same slices: TP peers of one DP rank have identical buffer
layouts, and the tied embedding has a bucket of its own on both stages
(:func:`tied_parameter`), so its slice is the same elements there. Clipping needs the
final gradients, so it is last of all.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from gridtrain.runtime import host_sync
from gridtrain.parallel.comm import CommGroup
from gridtrain.parallel.data_parallel import GradientReducer
from gridtrain.parallel.distributed import DistributedContext
from gridtrain.optim.interface import Optimizer
from gridtrain.parallel.tensor_parallel import TensorParallel, shard_spec


def reduce_gradients(model: nn.Module, reducer: GradientReducer, ctx: DistributedContext) -> None:
    """Steps 1 to 3 (the schedule's ALLREDUCE_GRADS): this stage's gradients become the
    gradients of the mean loss of the global batch. The DP reduction comes first (its
    buckets are mostly in flight already); the TP and tied sums then act on what this
    rank holds of each gradient (``reducer.grad_parts``: under ZeRO-1 only its slices)."""
    reducer.finish()  # waits for the buckets in flight before touching the gradients
    parts = reducer.grad_parts
    allreduce_sequence_parallel_grads(model, ctx.tp, parts)
    allreduce_replicated_grads(model, ctx.tp, parts)
    sum_tied_embedding_grads(model, ctx.embedding, parts)


@dataclass(frozen=True)
class StepScalars:
    """The numbers a step reports and decides by, the same on every rank."""

    loss: float  # mean token loss of the global batch
    grad_norm: float  # global gradient norm before clipping
    finite: bool  # every rank's gradients finite (checked for fp16 only; else True)
    mtp_loss: float | None = None  # multi-token prediction's loss, normalised as ``loss`` (None: none)


def step_scalars(optimizer: Optimizer, ctx: DistributedContext, loss: torch.Tensor | None, *,
                 check_finite: bool, max_norm: float, mtp: bool = False,
                 mtp_loss: torch.Tensor | None = None) -> StepScalars:
    """Step 4's numbers in one reduction and one host read, instead of a collective (or
    two) and a read for each: this rank's share of the squared global norm, of the mean
    loss (``loss``: this DP rank's loss sum over the global token count, on the last
    stage; None elsewhere) and of the non-finite flags, as one fp64 vector summed over
    the model-parallel group, then over DP x CP (each cp rank's loss sum is over its own
    chunks of the sequences: their sum is the whole batch's).

    Each share is counted once: the optimizer says which gradients this rank counts in
    the norm (interface.py: TP-replicated copies beyond the first TP rank, the tied head
    copy and DP replicas beyond the first are not); the loss comes from the first TP rank
    of the last stage of every DP replica. An fp16 overflow anywhere makes the flag sum
    positive. ``mtp`` (a run with multi-token prediction: every rank alike): the vector
    gains the MTP loss, ``mtp_loss`` shared as ``loss`` is (None where not computed).
    """
    device = ctx.device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    def share(x: torch.Tensor | None) -> torch.Tensor:  # a last stage's loss, from its first TP rank
        return x.to(device=device, dtype=torch.float64) if x is not None and ctx.tp.rank == 0 else zero

    parts = [optimizer.grad_norm_squared().to(device=device, dtype=torch.float64), share(loss),
             optimizer.nonfinite().to(device=device) if check_finite else zero] + ([share(mtp_loss)] if mtp else [])
    sums = torch.stack(parts)
    ctx.mp.all_reduce(sums)
    ctx.dp_cp.all_reduce(sums)
    # the dry run's stand-in: a norm above the clip limit (so clipping runs), finite
    stand_in = [(2.0 * max_norm if max_norm > 0 else 1.0) ** 2, 0.0, 0.0] + ([0.0] if mtp else [])
    norm_sq, mean_loss, bad, *mtp_mean = host_sync.read("step_scalars", sums, lambda t: t.tolist(), stand_in=stand_in)
    return StepScalars(mean_loss, math.sqrt(norm_sq) if norm_sq >= 0 else float("nan"), bad == 0.0,
                       mtp_mean[0] if mtp else None)


Parts = Callable[[nn.Parameter], list[torch.Tensor]]


def _whole(p: nn.Parameter) -> list[torch.Tensor]:
    """The gradient being accumulated, whole: the reducer's buffer view when there is one."""
    grad = getattr(p, "main_grad", None)
    grad = grad if grad is not None else p.grad
    return [grad] if grad is not None else []


def allreduce_sequence_parallel_grads(model: nn.Module, tp: TensorParallel, parts: Parts = _whole) -> None:
    """Sum over TP the gradients of replicated weights that saw only a sequence shard.

    Under sequence parallelism LayerNorm, the row-parallel biases and the position
    embedding each see 1/tp of the tokens on each rank, so each rank holds a partial
    gradient; their sum is the gradient of the whole sequence.
    """
    if not tp.sequence_parallel or tp.size == 1:
        return
    all_reduce_in_place(tp.comm, [g for p in model.parameters() if getattr(p, "sequence_parallel", False)
                                  for g in parts(p)])


SUM_BUCKET_BYTES = 64 * 2 ** 20  # the most a sum of small gradients packs into one all-reduce


def all_reduce_in_place(comm: CommGroup, grads: list[torch.Tensor]) -> None:
    """Sum each of ``grads`` over ``comm``, in place: a gradient of ``SUM_BUCKET_BYTES``
    or more by itself, the smaller ones packed into flat buffers of at most that size
    (one collective for many norms' gains), so the transient is a bucket, not all of
    them (a MoE stage's experts under SP are gigabytes). Each element's sum is the
    same however they are packed."""
    group: list[torch.Tensor] = []

    def flush() -> None:
        if group:
            flat = torch.cat([g.reshape(-1) for g in group])
            comm.all_reduce(flat)
            _copy_back(group, flat)
            group.clear()

    packed = 0
    for g in grads:
        size = g.numel() * g.element_size()
        if size >= SUM_BUCKET_BYTES and g.is_contiguous():
            comm.all_reduce(g)
            continue
        if packed + size > SUM_BUCKET_BYTES:
            flush()
            packed = 0
        group.append(g)
        packed += size
    flush()


def _copy_back(grads: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Each of ``grads`` takes its piece of ``flat`` (their concatenation, in order): one
    multi-tensor copy, not a copy per gradient (a kernel launch each on a GPU)."""
    pieces = flat.split([g.numel() for g in grads])
    torch._foreach_copy_(grads, [piece.view_as(g) for piece, g in zip(pieces, grads)])


def allreduce_replicated_grads(model: nn.Module, tp: TensorParallel, parts: Parts = _whole) -> None:
    """Sum the gradients of replicated slices over the TP ranks that hold each slice.

    A slice held by ``replicas`` ranks (ShardSpec.replicas: Llama's key/value heads when
    tp exceeds their count) gets, on each of them, the gradient of that rank's query
    heads only. Each rank writes its gradient into its slice's row of a zero buffer with
    one row per slice; one all-reduce over TP then sums every row over exactly the ranks
    holding that slice, and each rank takes its row back. (A process group per set of
    sharing ranks would move 1/slices of the bytes, but kv weights are small and this
    needs no groups beyond TP.)
    """
    if tp.size == 1:
        return
    replicated = [(p, shard_spec(p)) for p in model.parameters()
                  if shard_spec(p) is not None and shard_spec(p).replicas > 1]
    grads = [(g, spec) for p, spec in replicated for g in parts(p)]
    if not grads:
        return
    # one zero buffer of every gradient's rows (in the dtype their concatenation would
    # take), this rank's row of each filled and taken back by one multi-tensor copy each
    dtype = functools.reduce(torch.promote_types, [g.dtype for g, _ in grads])
    shapes = [(spec.slices(tp.size), g.numel()) for g, spec in grads]
    flat = torch.zeros(sum(s * n for s, n in shapes), dtype=dtype, device=grads[0][0].device)
    rows = [r.view(shape) for r, shape in zip(flat.split([s * n for s, n in shapes]), shapes)]
    mine = [row[tp.rank // spec.replicas] for row, (_, spec) in zip(rows, grads)]
    torch._foreach_copy_(mine, [g.reshape(-1) for g, _ in grads])
    tp.comm.all_reduce(flat)
    torch._foreach_copy_([g for g, _ in grads], [m.view_as(g) for m, (g, _) in zip(mine, grads)])


def tied_parameter(model: nn.Module, embedding: CommGroup | None) -> nn.Parameter | None:
    """This stage's copy of a token table shared across pipeline stages (the first
    stage's table; the last stage's copy: the tied head, or multi-token prediction's
    ``embedding_copy``), or None: no pipeline, no embedding group, a model whose last
    stage keeps no copy (untied, Llama's default, without multi-token prediction) or a
    middle stage."""
    cfg = getattr(model, "cfg", None)
    shared = getattr(cfg, "tie_embeddings", True) or getattr(cfg, "mtp_layers", 0) > 0
    if embedding is None or embedding.size == 1 or not shared:
        return None
    for copy in (getattr(model, "head", None), getattr(model, "embedding_copy", None)):
        if copy is not None and getattr(copy, "tied_copy", False):
            return copy
    return model.embedding.word.weight


def sum_tied_embedding_grads(model: nn.Module, embedding: CommGroup | None, parts: Parts = _whole) -> None:
    """The first stage's token embedding and the last stage's copy of it as the output
    head are one parameter in the model: sum their gradients over the embedding group
    (first and last stage) so that both copies take the same step and stay equal. An
    untied model (Llama's default) has no copies: both stages skip the sum."""
    tied = tied_parameter(model, embedding)
    if tied is None:
        return
    grads = parts(tied)
    if not grads and tied.grad is None and getattr(tied, "main_grad", None) is None:
        tied.grad = torch.zeros_like(tied)
        grads = [tied.grad]
    for grad in grads:
        embedding.all_reduce(grad)
