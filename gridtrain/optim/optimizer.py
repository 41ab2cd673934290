"""Optimizer, learning-rate schedule and gradient clipping.

Clipping needs one norm for the whole model even when its parameters are spread over
devices, so :func:`clip_grad_norm` takes the group over which the squared norms of the
local shards are summed; each parameter must be counted exactly once in that sum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from gridtrain.runtime import host_sync
from gridtrain.parallel.comm import CommGroup
from gridtrain.config import TrainingConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; never biases or LayerNorm gains (GPT-2/3 practice)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, t: TrainingConfig) -> torch.optim.Optimizer:
    """torch's AdamW, fused (one kernel over all parameters) where torch has it for the
    parameters' device: a per-parameter Python loop costs more than the update on small
    models (on 2 CPU cores, 50 fp32 tensors of 256 x 256: ~14x)."""
    groups = param_groups(model, t.weight_decay)
    params = [p for g in groups for p in g["params"]]
    # plain tensors only: torch's fused kernel takes no DTensor (nor the dry run's fake tensors)
    fused = bool(params) and all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda")
                                 and p.is_floating_point() for p in params)
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps, fused=fused or None)


def lr_at(step: int, t: TrainingConfig) -> float:
    """Linear warm-up from lr/warmup to lr, then cosine decay to lr * min_lr_ratio."""
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    progress = (step - t.warmup) / max(1, t.steps - t.warmup)
    floor = t.lr * t.min_lr_ratio
    return floor + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (t.lr - floor)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def grad_norm_squared(params: Iterable[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """Sum of squared gradient entries as an fp64 scalar (the same dtype on every rank, so
    it can be summed across ranks; a rank with no gradients contributes 0)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm([g.to(torch.promote_types(g.dtype, torch.float32)) for g in grads])
    return torch.stack([n.double() for n in norms]).square().sum()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, group: CommGroup | None = None,
                   norm_params: list[torch.Tensor] | None = None,
                   device: torch.device | str | None = None) -> float:
    """Clip ``params`` to a global norm; returns the norm before clipping.

    The norm is taken over ``norm_params`` (default: ``params``) and ``group`` sums the
    squared norms of this rank's parameters with its peers' (the model-parallel group
    once the model is split). A parameter replicated over that group must appear in
    ``norm_params`` on one rank only, so that nothing is counted twice.

    A rank whose stage holds no parameters still takes part in that sum with a zero, and
    the zero must be on the rank's device (NCCL refuses a CPU tensor): ``device`` when
    given, else ``group.device``; the parameters' device is used only when neither is
    known (no group, or a group without a device), and CPU only when nothing says.
    """
    total_sq = grad_norm_squared(params if norm_params is None else norm_params,
                                 _norm_device(device, group, params))
    if group is not None:
        group.all_reduce(total_sq)
    # the dry run's stand-in is above the limit, so that the clipping path runs too
    norm = host_sync.read("grad_norm", total_sq.sqrt(), float, stand_in=2.0 * max_norm if max_norm > 0 else 1.0)
    clip_to(params, norm, max_norm)
    return norm


def clip_coefficient(norm: float, max_norm: float) -> float | None:
    """The factor that brings gradients of global norm ``norm`` down to ``max_norm``, as
    torch's ``clip_grad_norm_`` (None: leave them; ``max_norm`` 0 is off)."""
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        return max_norm / (norm + 1e-6)
    return None


def clip_to(params: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale ``params``' gradients, whose global norm is ``norm``, to at most ``max_norm``."""
    coef = clip_coefficient(norm, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    if coef is not None and grads:
        torch._foreach_mul_(grads, coef)


def _norm_device(device: torch.device | str | None, group: CommGroup | None,
                 params: list[torch.Tensor]) -> torch.device:
    if device is not None:
        return torch.device(device)
    if group is not None and group.device is not None:
        return group.device
    return params[0].device if params else torch.device("cpu")
