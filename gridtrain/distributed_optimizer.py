"""AdamW on flat master weights, optionally sharded over data parallel (ZeRO-1), for
16-bit parameters.

Megatron's distributed optimizer in miniature. The gradient reducer's buffer gives
every parameter a fixed offset in one flat vector; this optimizer keeps, for the part of
that vector it owns, the master weights (fp32, or fp64 for fp64 runs) and AdamW's two
moments:

* without sharding a rank owns the whole vector: this is the mixed-precision optimizer
  (bf16/fp16 parameters for compute, fp32 master weights for the update);
* with ZeRO-1 (``--zero 1``) DP rank r owns the r-th 1/dp of it: the reducer
  reduce-scatters the gradients so that each rank receives just its averaged slice, each
  rank updates only its slice of master weights and moments (1/dp of the optimizer
  memory), and the updated slices are all-gathered back into every rank's parameters.

For fp16 a :class:`LossScaler` scales the loss and this optimizer unscales the gradients
and skips steps whose gradients overflowed anywhere on the grid.

The update is AdamW exactly as ``torch.optim.AdamW`` computes it (decoupled weight decay
on matrices and embeddings only, bias-corrected moments), so a sharded run trains the
same model as an unsharded one. Clipping takes one norm over the owned slices of all DP
ranks and all model-parallel ranks, counting TP-replicated parameters and the tied head
copy once (a per-element mask).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gridtrain import host_sync
from gridtrain.comm import CommGroup
from gridtrain.config import TrainingConfig
from gridtrain.data_parallel import GradientReducer
from gridtrain.tensor_parallel import is_tp_duplicate


class DistributedOptimizer:
    def __init__(self, reducer: GradientReducer, t: TrainingConfig, *, dp: CommGroup, mp: CommGroup,
                 tp_rank: int, master_dtype: torch.dtype):
        self.reducer, self.t, self.dp, self.mp = reducer, t, dp, mp
        self.params = reducer.params
        self.offsets, offset = [], 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        size = reducer.padded // (dp.size if reducer.shard else 1)
        self.start = dp.rank * size if reducer.shard else 0
        self.end = self.start + size
        device = reducer.buffer.device
        self.master = self._flat(lambda p: p.detach(), master_dtype, device)[self.start:self.end].clone()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.decay = self._flat(lambda p: torch.full_like(p, float(p.ndim >= 2)), master_dtype, device)[self.start:self.end]
        counted = lambda p: torch.full_like(p, float(not is_tp_duplicate(p, tp_rank)  # noqa: E731
                                                    and not getattr(p, "tied_copy", False)))
        self.count_once = self._flat(counted, master_dtype, device)[self.start:self.end]
        self.steps = 0
        self.lr = t.lr
        self.param_groups = [{"lr": t.lr}]  # read by set_lr

    def _flat(self, fn, dtype: torch.dtype, device) -> torch.Tensor:
        out = torch.zeros(self.reducer.padded, dtype=dtype, device=device)
        for p, o in zip(self.params, self.offsets):
            out[o: o + p.numel()] = fn(p).reshape(-1).to(dtype)
        return out

    def _grad(self) -> torch.Tensor:
        if self.reducer.shard:
            return self.reducer.shard_grad
        return self.reducer.buffer[self.start:self.end]

    def unscale_and_check(self, scale: float) -> bool:
        """Divide this rank's gradient slice by the loss scale; True when every rank's
        gradients are finite (an fp16 overflow anywhere makes every rank skip the step)."""
        grad = self._grad()
        if scale != 1.0:
            grad.div_(scale)
        bad = (~torch.isfinite(grad).all()).to(torch.float64)  # on the device: no host read here
        self.dp.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        self.mp.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return host_sync.read("fp16_overflow", bad, float, stand_in=0.0) == 0.0

    def clip_grad_norm(self, max_norm: float) -> float:
        """One global norm (DP shards x model-parallel ranks); clip this rank's slice."""
        grad = self._grad()
        sq = (grad.to(self.master.dtype).square() * self.count_once).sum().double()
        if self.reducer.shard:
            self.dp.all_reduce(sq)
        self.mp.all_reduce(sq)
        stand_in = (2.0 * max_norm if max_norm > 0 else 1.0) ** 2  # the dry run's: above the limit
        norm = math.sqrt(host_sync.read("grad_norm", sq, float, stand_in=stand_in))
        if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
            grad.mul_(max_norm / (norm + 1e-6))
        return norm

    @torch.no_grad()
    def step(self) -> None:
        t, lr = self.t, self.param_groups[0]["lr"]
        self.steps += 1
        grad = self._grad().to(self.master.dtype)
        self.master.mul_(1 - lr * t.weight_decay * self.decay)
        self.exp_avg.lerp_(grad, 1 - t.beta1)
        self.exp_avg_sq.mul_(t.beta2).addcmul_(grad, grad, value=1 - t.beta2)
        step_size = lr / (1 - t.beta1 ** self.steps)
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(1 - t.beta2 ** self.steps)).add_(t.adam_eps)
        self.master.addcdiv_(self.exp_avg, denom, value=-step_size)
        self._publish()

    def _publish(self) -> None:
        """Copy the (gathered) master weights into the model's parameters."""
        full = self.dp.all_gather(self.master, 0) if self.reducer.shard else self.master
        for p, o in zip(self.params, self.offsets):
            p.copy_(full[o: o + p.numel()].view_as(p))

    # ---- checkpoints: whole per-parameter state, whatever the sharding --------------------

    def state_by_param(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """AdamW state per parameter, as torch.optim.AdamW names it; collective over DP."""
        moments = [self.dp.all_gather(m, 0) if self.reducer.shard else m for m in (self.exp_avg, self.exp_avg_sq)]
        # one step tensor per parameter (torch's AdamW increments each in place) and
        # copies rather than views (views would share one storage when saved)
        return {p: {"step": torch.tensor(float(self.steps)),
                    "exp_avg": moments[0][o: o + p.numel()].view_as(p).clone(),
                    "exp_avg_sq": moments[1][o: o + p.numel()].view_as(p).clone()}
                for p, o in zip(self.params, self.offsets)}

    def load_state_by_param(self, states: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """The inverse of :meth:`state_by_param`; master weights restart from the parameters."""
        full = [torch.zeros(self.reducer.padded, dtype=self.master.dtype, device=self.master.device)
                for _ in range(2)]
        for p, o in zip(self.params, self.offsets):
            state = states.get(p)
            if state:
                self.steps = int(state["step"])
                for flat, key in zip(full, ("exp_avg", "exp_avg_sq")):
                    flat[o: o + p.numel()] = state[key].reshape(-1).to(flat.dtype)
        self.exp_avg, self.exp_avg_sq = (f[self.start:self.end].clone() for f in full)
        self.master = self._flat(lambda p: p.detach(), self.master.dtype, self.master.device)[self.start:self.end].clone()


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al., 2018): multiply the loss by S so
    that small gradients survive fp16's narrow range; on an overflow skip the step and
    halve S; after ``growth_interval`` good steps in a row double it."""

    def __init__(self, initial: float = 2.0 ** 16, growth_interval: int = 1000, min_scale: float = 1.0):
        self.scale, self.growth_interval, self.min_scale = initial, growth_interval, min_scale
        self.good_steps = 0
        self.skipped = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(self.min_scale, self.scale / 2)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2
