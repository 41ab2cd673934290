"""Everything a gradient goes through after backward, in the order it must happen.

When a stage's last backward (or, under ZB-H1, its last W) has run, each parameter's
gradient is a local sum over this rank's micro-batches. Before the optimizer may use it,
it still has to be combined with its copies and partial sums elsewhere on the grid:

1. **sequence-parallel sums** (TP group): under sequence parallelism LayerNorm weights,
   row-parallel biases and the position embedding see 1/tp of the tokens on each rank,
   so each TP rank holds a partial gradient; their sum over TP is the whole gradient;
2. **tied-embedding sums** (embedding group: first and last pipeline stage): the token
   table and the last stage's copy of it as the output head are one parameter, so their
   two gradients are summed and both copies take the same step;
3. **data-parallel average** (DP group): the reducer (data_parallel.py) started most of
   it during backward, bucket by bucket; ``finish`` waits for the rest and divides by dp.
   Under ZeRO-1 it reduce-scatters instead, leaving each DP rank only the average of its
   own 1/dp slice of the flat buffer;
4. **the global norm and clipping** (model-parallel group, and DP under ZeRO-1): one norm
   over every parameter of the whole model, counting TP-replicated parameters and the
   tied head copy once; the fp16 overflow check reduces over the same groups.

Why this order: the sums of 1 and 2 and the average of 3 are linear, so they commute.
Without ZeRO the DP average comes first, because most of its buckets are already in
flight when backward ends (waiting for them first lets the TP and tied sums work on the
finished buffer). Under ZeRO-1 it must come last: the TP and tied sums need the whole
gradient of the parameters they touch, and after the reduce-scatter a rank holds only
its 1/dp slice of the buffer. Clipping needs the final gradients, so it is last of all.
"""

from __future__ import annotations

import torch
from torch import nn

from gridtrain.comm import CommGroup
from gridtrain.data_parallel import GradientReducer
from gridtrain.distributed import DistributedContext
from gridtrain.distributed_optimizer import DistributedOptimizer
from gridtrain.optim import clip_grad_norm
from gridtrain.tensor_parallel import TensorParallel, is_tp_duplicate


def reduce_gradients(model: nn.Module, reducer: GradientReducer, ctx: DistributedContext) -> None:
    """Steps 1 to 3 (the schedule's ALLREDUCE_GRADS): this stage's gradients become the
    gradients of the mean loss of the global batch."""
    if reducer.shard:  # ZeRO-1: sum over TP and PP while the buffer is whole
        allreduce_sequence_parallel_grads(model, ctx.tp)
        sum_tied_embedding_grads(model, ctx.embedding)
        reducer.finish()
        return
    reducer.finish()  # waits for the buckets in flight before touching the buffer
    allreduce_sequence_parallel_grads(model, ctx.tp)
    sum_tied_embedding_grads(model, ctx.embedding)


def clip_gradients(model: nn.Module, optimizer, ctx: DistributedContext, max_norm: float) -> float:
    """Step 4: the global gradient norm before clipping; clips to ``max_norm`` (> 0)."""
    if isinstance(optimizer, DistributedOptimizer):  # flat buffers: a per-element mask counts once
        return optimizer.clip_grad_norm(max_norm)
    params = [p for p in model.parameters() if p.requires_grad]
    counted_once = [p for p in params if not is_tp_duplicate(p, ctx.tp.rank)
                    and not getattr(p, "tied_copy", False)]
    return clip_grad_norm(params, max_norm, ctx.mp, norm_params=counted_once)


def allreduce_sequence_parallel_grads(model: nn.Module, tp: TensorParallel) -> None:
    """Sum over TP the gradients of replicated weights that saw only a sequence shard.

    Under sequence parallelism LayerNorm, the row-parallel biases and the position
    embedding each see 1/tp of the tokens on each rank, so each rank holds a partial
    gradient; their sum is the gradient of the whole sequence.
    """
    if not tp.sequence_parallel or tp.size == 1:
        return
    grads = [_grad_of(p) for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    tp.comm.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def _grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient being accumulated: the reducer's fp32 buffer view when there is one."""
    return getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad


def sum_tied_embedding_grads(model: nn.Module, embedding: CommGroup | None) -> None:
    """The first stage's token embedding and the last stage's copy of it as the output
    head are one parameter in the model: sum their gradients over the embedding group
    (first and last stage) so that both copies take the same step and stay equal."""
    if embedding is None or embedding.size == 1:
        return
    tied = getattr(model, "head", None)
    if tied is None or not getattr(tied, "tied_copy", False):
        tied = model.embedding.word.weight
    grad = getattr(tied, "main_grad", None)
    if grad is None:
        if tied.grad is None:
            tied.grad = torch.zeros_like(tied)
        grad = tied.grad
    embedding.all_reduce(grad)
