"""Data parallelism: keep the DP replicas identical.

This is the plain, synchronous version: parameters are broadcast from the DP group's
first rank at start, and after the last micro-batch's backward all gradients are
flattened into one buffer and averaged with a single all-reduce. It is correct for any
model and is the baseline that a bucketed reducer overlapped with backward replaces.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def broadcast_parameters(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Make every DP replica start from the DP group's first rank's weights."""
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor, src=src, group=group)


def allreduce_gradients(params: list[torch.Tensor], group: dist.ProcessGroup) -> int:
    """Average gradients over the DP group in one coalesced all-reduce; returns bytes reduced.

    A parameter without a gradient takes part with zeros, so every rank reduces the same
    buffer layout (a rank-dependent layout would mismatch the collective).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return 0
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat.div_(world)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)
    return flat.numel() * flat.element_size()
