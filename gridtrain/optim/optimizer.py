"""AdamW on the parameters, the learning rate of a step and the clipping factor.

:class:`AdamW` puts torch's AdamW behind the optimizer interface (interface.py) that the
trainer, the gradient path and checkpoints use: fp32/fp64 runs without ZeRO step with
it, the others with the flat master weights of distributed_optimizer.py.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gridtrain.config import OptimConfig
from gridtrain.optim.interface import Optimizer, StatePiece
from gridtrain.optim.schedules import schedule_of
from gridtrain.parallel.tensor_parallel import is_tp_duplicate

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state per parameter, as torch names it


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; never biases or LayerNorm gains (GPT-2/3 practice)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, o: OptimConfig) -> torch.optim.Optimizer:
    """torch's AdamW, fused (one kernel over all parameters) where torch has it for the
    parameters' device: a per-parameter Python loop costs more than the update on small
    models (on 2 CPU cores, 50 fp32 tensors of 256 x 256: ~14x)."""
    groups = param_groups(model, o.weight_decay)
    params = [p for g in groups for p in g["params"]]
    # plain tensors only: torch's fused kernel takes no DTensor (nor the dry run's fake tensors)
    fused = bool(params) and all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda")
                                 and p.is_floating_point() for p in params)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.adam_eps, fused=fused or None)


def lr_at(step: int, o: OptimConfig, steps: int) -> float:
    """The learning rate of ``step`` (0-based) of a run of ``steps``: linear warm-up, then
    ``o.lr_schedule`` (cosine, linear, wsd or constant; schedules.py)."""
    return schedule_of(o, steps).lr(step)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_coefficient(norm: float, max_norm: float) -> float | None:
    """The factor that brings gradients of global norm ``norm`` down to ``max_norm``, as
    torch's ``clip_grad_norm_`` (None: leave them; ``max_norm`` 0 is off)."""
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        return max_norm / (norm + 1e-6)
    return None


def counts_towards_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank counts ``param`` in the global gradient norm: not a TP-replicated
    copy held by a TP rank other than the first, nor the last stage's tied head copy."""
    return not is_tp_duplicate(param, tp_rank) and not getattr(param, "tied_copy", False)


def squared_norm(tensors: list[torch.Tensor], device: torch.device,
                 at_least: torch.dtype = torch.float32) -> torch.Tensor:
    """Sum of squared entries as an fp64 scalar on ``device`` (the same dtype on every
    rank, so that it can be summed across ranks; nothing to count contributes 0).

    Each tensor's norm is taken in its dtype or ``at_least``, whichever is wider, then
    squared in fp64 and summed in the tensors' order. A fixed number of operators
    whatever the number of tensors (one ``_foreach_norm`` per run of tensors of one
    dtype, in practice one; no cast per tensor: on a GPU each would be a kernel launch,
    ~800 per step for a large model): ``_foreach_norm``'s ``dtype`` casts as it reads,
    the same values as the norm of an upcast copy, bit for bit."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    runs: list[list[torch.Tensor]] = []  # consecutive tensors of one dtype (kept in order: the sum's order)
    for t in tensors:
        if runs and runs[-1][0].dtype == t.dtype:
            runs[-1].append(t)
        else:
            runs.append([t])
    parts = []
    for run in runs:
        dtype = run[0].dtype
        wider = torch.promote_types(dtype, at_least)
        parts.append(torch.stack(torch._foreach_norm(run, dtype=None if wider == dtype else wider)))
    norms = parts[0] if len(parts) == 1 else torch.cat([n.to(torch.float64) for n in parts])
    return norms.to(torch.float64).square().sum()


class AdamW:
    """torch's AdamW on the parameters behind the optimizer interface (interface.py).

    Every DP rank holds every parameter's whole gradient and state, so the norm is
    counted on one DP rank only: ``counted`` are the parameters this rank counts (none
    on DP ranks other than the first; default: all). The parameters are updated in
    place by :meth:`step`, so they are always ready for the next forward."""

    shards_over_dp = False

    def __init__(self, inner: torch.optim.Optimizer, counted: list[nn.Parameter] | None = None,
                 device: torch.device | str | None = None):
        self.inner = inner
        self.params = [p for group in inner.param_groups for p in group["params"]]
        self.counted = self.params if counted is None else counted
        default = self.params[0].device if self.params else "cpu"
        self.device = torch.device(device if device is not None else default)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def steps(self) -> int:
        return max((int(s["step"]) for s in self.inner.state.values() if "step" in s), default=0)

    def _grads(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        return [p.grad for p in params if p.grad is not None]

    def grad_norm_squared(self) -> torch.Tensor:
        return squared_norm(self._grads(self.counted), self.device)

    def nonfinite(self) -> torch.Tensor:
        flags = [torch.isfinite(g).all() for g in self._grads(self.params)]
        finite = torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=self.device)
        return finite.logical_not().to(torch.float64)

    def unscale(self, scale: float) -> None:
        grads = self._grads(self.params)
        if scale != 1.0 and grads:
            torch._foreach_div_(grads, scale)

    def clip_to(self, norm: float, max_norm: float) -> None:
        coef, grads = clip_coefficient(norm, max_norm), self._grads(self.params)
        if coef is not None and grads:
            torch._foreach_mul_(grads, coef)

    def weight_pieces(self) -> None:
        """The parameters hold the weights."""

    def gather_before(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        """Nothing to wait for: :meth:`step` updates the parameters themselves."""

    def parameters_ready(self) -> None:
        """Nothing to wait for: :meth:`step` updates the parameters themselves."""

    def step(self, row_scales: dict[nn.Parameter, torch.Tensor] | None = None) -> None:
        self.inner.step()
        with torch.no_grad():
            for p, factor in (row_scales or {}).items():  # --qk-clip: rows rescaled after the update
                p.mul_(factor.to(p.dtype).view(-1, *[1] * (p.ndim - 1)))

    def state_tensors(self) -> list[torch.Tensor]:
        return [v for state in self.inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]

    def state_pieces(self) -> list[StatePiece]:
        """The moments of every parameter that has taken a step (AdamW makes its state at
        a parameter's first update)."""
        return [StatePiece(p, 0, {what: self.inner.state[p][what].view(-1) for what in MOMENTS})
                for p in self.params if self.inner.state.get(p)]

    def load_targets(self) -> list[StatePiece]:
        """Fresh zero moments for every parameter; :meth:`loaded` keeps those filled."""
        return [StatePiece(p, 0, {what: torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for what in MOMENTS})
                for p in self.params]

    def loaded(self, step: int | None, filled: list[StatePiece]) -> None:
        for piece in filled:
            p = piece.param
            self.inner.state[p] = {"step": adam_step_tensor(step or 0, p, self._group_of(p)),
                                   **{what: flat.view_as(p) for what, flat in piece.tensors.items()}}

    def _group_of(self, p: nn.Parameter) -> dict:
        return next(g for g in self.inner.param_groups if any(q is p for q in g["params"]))

    @torch.no_grad()
    def load_state_by_param(self, states: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Master weights (``master``) are copied into the parameters, the rest is AdamW's."""
        for p, state in states.items():
            state = dict(state)
            master = state.pop("master", None)
            if master is not None:
                p.copy_(master)
            if "step" in state:
                state["step"] = adam_step_tensor(float(state["step"]), p, self._group_of(p))
            if state:
                self.inner.state[p] = state


def adam_step_tensor(step: float, param: torch.Tensor, group: dict) -> torch.Tensor:
    """AdamW's step count as torch keeps it: on the parameter's device (fp32) for the
    fused and capturable kernels, which refuse it anywhere else ("state_steps is on cpu",
    found resuming on a GPU), on the CPU otherwise."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(step), dtype=torch.float32, device=param.device)
    return torch.tensor(float(step))


def as_optimizer(optimizer: torch.optim.Optimizer | Optimizer | None) -> Optimizer | None:
    """The optimizer interface over what a caller of the checkpoint API hands it: a bare
    torch optimizer (a loop of the user's own) is wrapped, gridtrain's pass as they are."""
    return AdamW(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else optimizer
