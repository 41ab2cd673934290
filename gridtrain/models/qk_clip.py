"""QK-clip (``--qk-clip TAU``; Kimi K2's MuonClip): a head whose largest attention logit of
the step exceeds TAU has its query and key weights scaled down after the update, so that
the same input would reach TAU exactly.

**The statistic.** Each attention layer (models/attention.py ``SelfAttention.attend``)
records, per local head, the largest logit ``q . k * scale`` its queries reached over
the keys they attend to, over the step's micro-batches (:func:`max_logits`; a no-grad
product beside the fused kernel, which keeps no logits). Under context parallelism the
rank's queries meet every cp rank's keys: the keys are all-gathered for it, each with
its true position, so the causal (and document) mask is the one-process one. Before the
optimizer step the layers' maxima are reduced (MAX) over the data-parallel x cp ranks:
every layout sees the global batch's maximum of each head. Tensor parallelism splits
heads, so a head's maximum is whole on its tp rank; pipeline stages do their own layers.

**The rescaling** of head h with maximum S_h: gamma_h = min(1, TAU / S_h), applied to the
master weights after the optimizer's update (the optimizers' ``step(row_scales=...)``), row by row
(:meth:`SelfAttention.qk_rows`):

* multi-head attention: the head's query and key rows times sqrt(gamma_h) (GPT-2's
  fused QKV: its q and k parts, biases included);
* grouped-query attention (a key head g shared by query heads G): the key rows times
  sqrt(min over G of gamma), each query head's rows times gamma_h / sqrt(min_G gamma), so
  every head's logits scale by its own gamma_h;
* latent attention: the query's non-rotary rows (q_b, or q) and the key's (kv_b's
  k_nope rows) times sqrt(gamma_h), the query's rotary rows times gamma_h; the shared
  rotary key (kv_a) and the values are left alone (Kimi K2's rule).

Models with q/k norms (their logits do not scale with the weights) and key heads
replicated over tp ranks are refused before start.
"""

from __future__ import annotations

import torch
from torch import nn

from gridtrain.parallel import context_parallel
from gridtrain.parallel.comm import CommGroup


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, scale: float, cp, documents=None) -> torch.Tensor:
    """Per head of ``q`` ``[b, H, s, d]``, the largest ``q . k * scale`` over the keys
    ``k`` ``[b, KV, s, d]`` (KV dividing H: grouped heads) each query sees: causal, within
    its document (``documents``), over every cp rank's keys (all-gathered) at their true
    positions. In fp32 at least."""
    wide = torch.promote_types(q.dtype, torch.float32)
    s = q.shape[2]
    if cp.size > 1:
        k = cp.comm.all_gather(k.contiguous(), 2)
        q_pos = cp.positions(s, q.device)
        k_pos = torch.cat([context_parallel.local_positions(s * cp.size, cp.size, r, q.device)
                           for r in range(cp.size)])
    else:
        q_pos = k_pos = torch.arange(s, device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]  # [s_q, s_k]
    if documents is not None:
        ids = documents.ids
        visible = visible & (ids[:, q_pos][:, :, None] == ids[:, k_pos][:, None, :])  # [b, s_q, s_k]
    group = q.shape[1] // k.shape[1]  # query heads per key head
    out = []
    for h in range(q.shape[1]):  # one head's [b, s_q, s_k] at a time
        logits = (q[:, h].to(wide) @ k[:, h // group].to(wide).transpose(-1, -2)) * scale
        out.append(logits.masked_fill(~visible, float("-inf")).amax())
    return torch.stack(out)


def gammas(maxima: torch.Tensor, tau: float) -> torch.Tensor:
    """min(1, tau / S) per head (1 where the head stayed at or below tau)."""
    return torch.where(maxima > tau, tau / maxima, torch.ones_like(maxima))


def grouped_scales(gamma: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(per query head, per key head) factors for grouped-query attention: the key head
    takes sqrt of its group's smallest gamma, each query head the rest of its own, so
    that the product is each head's gamma (multi-head: sqrt(gamma) both)."""
    group = gamma.view(kv_heads, -1)
    k = group.min(dim=1).values.sqrt()
    return (group / k[:, None]).reshape(-1), k


def rows(per_head: torch.Tensor, width: int) -> torch.Tensor:
    """Per-head factors repeated over each head's ``width`` rows."""
    return per_head.repeat_interleave(width)


def layers(model: nn.Module) -> list[nn.Module]:
    """The model's attention layers that record logits (models/attention.py)."""
    return [m for m in model.modules() if getattr(m, "records_logits", False)]


def row_scales(model: nn.Module, tau: float, group: CommGroup) -> dict[nn.Parameter, torch.Tensor]:
    """The step's per-row factors of the query and key weights (the module docstring):
    the layers' maxima reduced over ``group`` (data parallel x cp) in one collective,
    then each layer's rows. Resets the layers' maxima for the next step. Only parameters
    with a factor below 1 somewhere are listed."""
    attn = layers(model)
    if not attn:
        return {}
    maxima = torch.stack([a.logit_max for a in attn])
    group.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX)
    out: dict[nn.Parameter, torch.Tensor] = {}
    for a, m in zip(attn, maxima):
        a.logit_max = None
        gamma = gammas(m, tau)
        for param, factor in a.qk_rows(gamma):
            out[param] = out[param] * factor if param in out else factor
    return out
