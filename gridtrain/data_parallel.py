"""Data parallelism: keep the DP replicas identical.

This is the plain, synchronous version: parameters are broadcast from the DP group's
first rank at start, and after the last micro-batch's backward all gradients are
flattened into one buffer and averaged with a single all-reduce. It is correct for any
model and is the baseline that a bucketed reducer overlapped with backward replaces.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gridtrain.comm import CommGroup


def broadcast_parameters(model: nn.Module, dp: CommGroup) -> None:
    """Make every DP replica start from the DP group's first rank's weights."""
    if dp.size == 1:
        return
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dp.broadcast(tensor)


def allreduce_gradients(params: list[torch.Tensor], dp: CommGroup) -> None:
    """Average gradients over the DP group in one coalesced all-reduce.

    A parameter without a gradient takes part with zeros, so every rank reduces the same
    buffer layout (a rank-dependent layout would mismatch the collective).
    """
    if dp.size == 1:
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = _flatten_dense_tensors(grads)
    dp.all_reduce(flat)
    flat.div_(dp.size)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)
