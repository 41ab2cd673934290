"""A mixture-of-experts MLP: a router picks ``k`` of ``E`` expert MLPs for each token.

Mixtral, Qwen3-MoE and OLMoE layers (docs/moe.md), in place of a block's dense MLP:

* **router**: a linear map to ``E`` logits (no bias), softmax over the experts in at
  least fp32, the top ``k``; with ``moe_norm_topk`` (Mixtral, Qwen3-MoE) the ``k`` weights
  are renormalised to sum to 1, without it (OLMoE) they are the probabilities as they
  are. Those are the two normalisations supported (no sigmoid routers, no grouped
  top-k, no aux-loss-free bias);
* **experts**: ``E`` MLPs of the architecture's kind (SwiGLU for Llama, GELU with biases
  for GPT-2), ``moe_ffn_size`` wide, kept whole on a rank (no expert tensor
  parallelism): each rank of an expert-parallel group holds ``E / ep`` of them, keyed by
  their global index so that parameter names (``blocks.N.mlp.experts.e.gate.weight``)
  are the same on every layout and checkpoints reshard across ep by name;
* **shared experts** (``moe_shared_experts S``): one dense MLP ``S x H`` wide through which
  every token goes, split over tp as a dense MLP is;
* **load balancing**: the Switch/GShard loss and the capacity, from the routing counts of
  the whole global micro-batch (parallel/experts.py), so every layout trains the same
  model.

Under tensor parallelism the experts see the tokens of the rank's sequence shard (with
sequence parallelism) or all of them (without: every tp rank then computes the same
experts on the same tokens); the router's and experts' gradients are partial sums under
sequence parallelism and summed over tp, as LayerNorm's are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gridtrain.config import ModelConfig
from gridtrain.parallel.experts import (ExpertParallel, capacity_order, dispatch_combine, permutation,
                                       with_aux_loss)
from gridtrain.parallel.recompute import Recomputation
from gridtrain.parallel.tensor_parallel import TensorParallel


class Expert(nn.Module):
    """One expert: SwiGLU (``down(silu(gate(x)) * up(x))``, no biases) for Llama, GELU
    (``proj(gelu(fc(x)))`` with biases) for GPT-2; whole on its rank."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h = cfg.d_model, cfg.moe_ffn_size
        self.llama = cfg.arch == "llama"
        if self.llama:
            self.gate = nn.Linear(d, h, bias=False)
            self.up = nn.Linear(d, h, bias=False)
            self.down = nn.Linear(h, d, bias=False)
        else:
            self.fc = nn.Linear(d, h)
            self.proj = nn.Linear(h, d)
            self.proj.weight.residual_projection = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.llama:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Router(nn.Module):
    """The gate: ``E`` logits per token, no bias (Hugging Face's ``gate``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (probabilities [N, E] in at least fp32, the top-k experts
    [N, k], their weights [N, k] in the logits' dtype)."""
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    top, chosen = probs.topk(k, dim=-1)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return probs, chosen, top.to(logits.dtype)


class MoE(nn.Module):
    """A block's MLP as a mixture of experts (module docstring). ``layer``: the block's
    global index (the routing log keys on it)."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel, ep: ExpertParallel,
                 recompute: Recomputation | None = None, shared: nn.Module | None = None):
        super().__init__()
        if cfg.n_experts % ep.size:
            raise ValueError(f"{cfg.n_experts} experts do not split over ep {ep.size}; choose --ep dividing "
                             f"--n-experts")
        self.cfg, self.layer, self.tp, self.ep, self.recompute = cfg, layer, tp, ep, recompute
        self.router = Router(cfg)
        self.experts = nn.ModuleDict({str(e): Expert(cfg) for e in ep.local_experts(cfg.n_experts)})
        for p in [*self.router.parameters(), *self.experts.parameters()]:
            p.sequence_parallel = tp.sequence_parallel  # partial sums over tp under SP
        for p in self.experts.parameters():
            p.expert = True  # reduced over the expert-data-parallel group, not dp x cp
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        logits = self.router(tokens)
        probs, chosen, weights = route(logits, cfg.moe_top_k, cfg.moe_norm_topk)
        capacity = None
        if cfg.moe_capacity_factor is not None and self.training:  # inference is dropless
            order, used, capacity, counts = capacity_order(
                chosen, cfg.n_experts, cfg.moe_capacity_factor, self.ep, self.ep.token_keys(b, s),
                most_runs=b * (2 if self.ep.cp_size > 1 else 1))
        else:
            order, counts = permutation(chosen, cfg.n_experts)
            used = counts
        # the global micro-batch's counts (before capacity) and probability sums travel
        # while the experts run
        stats = torch.cat([counts.to(torch.float64), probs.detach().sum(0).to(torch.float64)])
        summed = self.ep.start_global_sum(stats)
        out, _, received = dispatch_combine(tokens, chosen, weights, cfg.n_experts, self.ep,
                                            lambda e, rows: self.experts[str(e)](rows), (order, used))
        out = self._balance(out, probs, summed(), received, capacity).view(b, s, d)
        if self.shared is not None:
            out = out + self.shared(x)
        return out

    def _balance(self, out: torch.Tensor, probs: torch.Tensor, stats: torch.Tensor, received: int,
                 capacity: torch.Tensor | None) -> torch.Tensor:
        """From the global micro-batch's counts (before capacity) and probability sums
        (``stats``): the step's routing log (with the assignments beyond ``capacity``),
        and the load-balancing loss's gradient joined to ``out``."""
        cfg, e = self.cfg, self.cfg.n_experts
        assignments = stats[:e].sum()
        tokens = assignments / cfg.moe_top_k
        f = stats[:e] / assignments  # fraction of the assignments each expert got
        if self.training and not (self.recompute is not None and self.recompute.rebuilding):
            aux_value = e * (f * stats[e:] / tokens).sum()
            dropped = torch.zeros((), dtype=torch.float64, device=stats.device) if capacity is None else \
                (stats[:e] - capacity).clamp(min=0).sum()
            self.ep.log.record(self.layer, stats[:e], aux_value, dropped, received)
        if cfg.moe_aux_loss_coeff == 0.0 or not self.training:  # a training objective: not in evaluation
            return out
        # this rank's share: its tokens' probabilities against the global fractions
        local = e * (f.to(probs.dtype) * probs.sum(0)).sum() / tokens.to(probs.dtype)
        return with_aux_loss(out, local, cfg.moe_aux_loss_coeff * self.ep.aux_grad_scale)
