"""A mixture-of-experts MLP: a router picks ``k`` of ``E`` expert MLPs for each token.

Mixtral, Qwen3-MoE, OLMoE and DeepSeek-V3 layers (docs/moe.md), in place of a block's
dense MLP:

* **router** (:func:`route`): a linear map to ``E`` logits (no bias), scores in at least
  fp32, the top ``k``: softmax over the experts, or each expert's sigmoid
  (``moe_router``, DeepSeek-V3). With ``moe_norm_topk`` (Mixtral, Qwen3-MoE, DeepSeek-V3)
  the ``k`` weights are renormalised to sum to 1, without it (OLMoE) they are the scores
  as they are; times ``moe_routed_scale``. DeepSeek's selection: group-limited routing
  (``moe_groups``, ``moe_group_top_k``: a token's experts come from its best groups)
  and the aux-loss-free bias (``expert_bias``, a buffer added to the scores for the
  choice only, moved after each step towards balance by ``moe_expert_bias_rate``:
  :meth:`MoE.update_expert_bias`);
* **experts**: ``E`` MLPs of the architecture's kind (SwiGLU for Llama, GELU with biases
  for GPT-2), ``moe_ffn_size`` wide, kept whole on a rank (no expert tensor
  parallelism): each rank of an expert-parallel group holds ``E / ep`` of them, keyed by
  their global index so that parameter names (``blocks.N.mlp.experts.e.gate.weight``)
  are the same on every layout and checkpoints reshard across ep by name;
* **shared experts** (``moe_shared_experts S``): one dense MLP ``S x H`` wide through which
  every token goes, split over tp as a dense MLP is;
* **load balancing**: the Switch/GShard loss and the capacity, from the routing counts of
  the whole global micro-batch, and DeepSeek-V3's sequence-wise loss, from each
  sequence's counts summed over the ranks holding its tokens (parallel/experts.py), so
  every layout trains the same model.

**The local experts run as grouped GEMMs** (``torch._grouped_mm``: fp32 and bf16 on CPU,
bf16 on CUDA GPUs of compute capability 9.0 or 10.x, where torch has a grouped kernel;
the per-expert loop for fp64, the parity reference, and on earlier GPUs, where torch's
fallback would read the offsets back per GEMM): SwiGLU experts as two
(gate and up joined into one ``[E, 2H, d]`` operand, then down), GELU experts as two with
per-expert biases. The grouped GEMM wants each weight kind as one ``[E, ...]`` tensor, and
stacking ``E`` separate parameters would copy every expert weight per layer and
micro-batch (and keep the copy for backward). So the experts' parameters stay separate
``nn.Parameter`` objects with their names (checkpoints, Hugging Face mapping and the
gradient reducer see nothing new) but their memory is laid out one expert after another
in one storage (:func:`pack`, once the parameters have memory); each weight kind is then
one strided view of it, no copy. Under ZeRO-3 the gathered unit's layout decides: a view
where it allows one, else a stacked copy (not kept: backward stacks again); its units
hold the parameters in reverse registration order, so today that is a copy per GEMM. The
autograd functions here keep what the ``nn.Linear`` loop keeps, so the memory model's
activation terms hold for both paths. A GEMM's weight gradient is added into the
parameters' gradients in one operator where those lie as one stacked view too
(:func:`accumulate_stacked`), instead of autograd's one addition per expert weight; the
gradient buffer's reversed order keeps that from happening today as well.

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
from gridtrain.parallel import float8
from gridtrain.parallel.meta import on_meta
from gridtrain.parallel.experts import (ExpertParallel, RoutingLog, capacity_order, dispatch_combine,
                                       grouped_gemm_fits, grouped_mm, permutation, start_counts_exchange,
                                       with_aux_loss)
from gridtrain.parallel.recompute import Recomputation
from gridtrain.parallel.comm import CommGroup, gather_rows, reduce_scatter_rows, single
from gridtrain.parallel.tensor_parallel import ShardSpec, TensorParallel


class Expert(nn.Module):
    """One expert: SwiGLU (``down(silu(gate(x)) * up(x))``, no biases) for Llama, GELU
    (``proj(gelu(fc(x)))`` with biases) for GPT-2; whole on its rank, or under expert
    tensor parallelism (``etp``, a group of more than one rank; SwiGLU only) this rank's
    slice of it: ``1 / etp`` of the hidden width, gate and up by rows, down by columns
    (its output a partial sum over the etp group, summed by the MoE layer)."""

    def __init__(self, cfg: ModelConfig, etp: CommGroup | None = None):
        super().__init__()
        etp = etp or single("etp")
        d, h = cfg.d_model, cfg.moe_ffn_size // etp.size
        self.llama = cfg.arch == "llama"
        if self.llama:
            self.gate = nn.Linear(d, h, bias=False)
            self.up = nn.Linear(d, h, bias=False)
            self.down = nn.Linear(h, d, bias=False)
            if etp.size > 1:  # where each slice lies in the whole expert (checkpoints, initialisation)
                for linear, dim in ((self.gate, 0), (self.up, 0), (self.down, 1)):
                    linear.weight.etp_shard = (ShardSpec(dim), etp)
        else:
            self.fc = nn.Linear(d, h)
            self.proj = nn.Linear(h, d)
            self.proj.weight.residual_projection = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.llama:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


# ---- the local experts as grouped GEMMs ----------------------------------------------------------

def _owns_storage(p: torch.Tensor) -> bool:
    """Whether ``p`` is a whole tensor of its own (not a view into a larger storage)."""
    return p.numel() > 0 and p.is_contiguous() and p.storage_offset() == 0 and \
        p.untyped_storage().nbytes() == p.numel() * p.element_size()


def pack(per_expert: list[list[torch.Tensor]]) -> bool:
    """Lay the experts' parameters (``per_expert[e]``: expert ``e``'s, in registration
    order) out one expert after another in one new storage, each parameter keeping its
    object, name, attributes and values (only its ``.data`` moves). Done only where each
    parameter owns its whole storage (not under ZeRO-3, whose gathered units are laid
    out by the parameter shards, nor for meta parameters). Returns whether it packed."""
    flat = [p for ps in per_expert for p in ps]
    first = flat[0]
    if on_meta(first) or not all(_owns_storage(p) and p.dtype == first.dtype and p.device == first.device
                                 for p in flat):
        return False
    with torch.no_grad():
        buffer = first.new_empty(sum(p.numel() for p in flat))
        at = 0
        for p in flat:
            view = buffer[at:at + p.numel()].view(p.shape)
            view.copy_(p)
            p.data = view
            at += p.numel()
    return True


def packed(per_expert: list[list[torch.Tensor]]) -> bool:
    """Whether the experts' parameters lie as :func:`pack` lays them out."""
    first = per_expert[0][0]
    if on_meta(first):
        return False
    storage, at = first.untyped_storage()._cdata, first.storage_offset()
    for ps in per_expert:
        for p in ps:
            if p.storage_offset() != at or not p.is_contiguous() or p.untyped_storage()._cdata != storage:
                return False
            at += p.numel()
    return True


def stacked_layout(groups: list[list[torch.Tensor]]):
    """``groups[e]``: tensors of expert ``e`` to be joined along their first dimension
    (SwiGLU's gate and up; a weight alone). If one strided ``[E, rows, ...]`` view reaches
    them all (one storage, each group's tensors one right after the other, the groups at
    a fixed positive spacing, 16-byte aligned: what :func:`pack` lays out), its
    ``(size, stride, offset)``; else None."""
    first = groups[0][0]
    if on_meta(first):
        return None
    storage, size = first.untyped_storage()._cdata, first.element_size()
    starts = [g[0].storage_offset() for g in groups]
    spacing = starts[1] - starts[0] if len(groups) > 1 else sum(p.numel() for p in groups[0])
    for e, g in enumerate(groups):
        at = starts[0] + e * spacing
        for p, q in zip(g, groups[0]):
            if p.storage_offset() != at or p.shape != q.shape or not p.is_contiguous() or \
                    p.untyped_storage()._cdata != storage:
                return None
            at += p.numel()
    if any(p.shape[1:] != first.shape[1:] for p in groups[0]) or spacing <= 0 or spacing * size % 16 or \
            starts[0] * size % 16:
        return None
    return (len(groups), sum(p.shape[0] for p in groups[0]), *first.shape[1:]), (spacing, *first.stride()), starts[0]


def stacked(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    """The groups (:func:`stacked_layout`) as one ``[E, rows, ...]`` tensor, outside
    autograd: a view where the layout allows (no copy), else a stacked copy (a ZeRO-3
    unit laid out otherwise)."""
    layout = stacked_layout(groups)
    if layout is not None:
        return groups[0][0].detach().as_strided(*layout)
    return torch.stack([torch.cat([p.detach() for p in g], 0) for g in groups])


def accumulate_stacked(groups: list[list[torch.Tensor]], stacked_grad: torch.Tensor) -> bool:
    """Add ``stacked_grad`` (``[E, rows, ...]``: expert ``e``'s gradient of the tensors of
    ``groups[e]``, joined along their first dimension) into those parameters' ``.grad``
    in one operator, where autograd would add it parameter by parameter (a kernel launch
    each on a GPU: three per expert and layer, every micro-batch). Returns whether it
    did; if not, nothing was touched and the caller hands the gradients to autograd.

    Only where this is exactly what autograd would do: each parameter's ``.grad`` exists
    in the gradient's dtype (autograd would add into it in place: the gradient reducer's
    buffer views of fp32 and fp64 runs), the ``.grad`` tensors lie as one strided
    ``[E, rows, ...]`` view (:func:`stacked_layout`: each expert's parameters in
    registration order, one expert after another), no hook would change the gradient
    before it is added and no higher-order graph is being built. The sums are the same
    additions, element by element, so the values are autograd's, bit for bit. The caller
    then returns None for these parameters: autograd still runs their accumulation node
    with nothing to add, and with it their post-accumulate hooks (the reducer's count of
    gradients received, data_parallel.py), once per backward as before. Elsewhere (a
    gradient sink: ZeRO-2/3; 16-bit parameters, whose gradients reach an fp32 buffer
    through ``.grad``; a buffer in another order) autograd accumulates as before."""
    params = [p for g in groups for p in g]
    if torch.is_grad_enabled() or not params:
        return False
    for p in params:
        if p.grad is None or p.grad.dtype != stacked_grad.dtype or p._backward_hooks \
                or getattr(p, "grad_sink", None) is not None:
            return False
    layout = stacked_layout([[p.grad for p in g] for g in groups])
    if layout is None or tuple(layout[0]) != tuple(stacked_grad.shape):
        return False
    params[0].grad.as_strided(*layout).add_(stacked_grad)
    return True


def _expert_sums(rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Each group's rows summed (``rows`` sorted by group, ``offs`` each group's end row):
    ``[groups, width]``. A segment reduction, which sums each group's rows in row order on
    every device (torch's CUDA kernel: one thread per output element, a loop over its
    rows), where a floating-point ``index_add_`` adds them with atomics in whatever order
    a GPU's threads arrive. ``unsafe``: the offsets are not checked, which would read them
    back to the host."""
    starts = torch.cat([offs.new_zeros(1), offs])
    return torch.segment_reduce(rows, "sum", offsets=starts, axis=0, unsafe=True)


def _group_of_rows(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's group, from the groups' end rows."""
    return torch.searchsorted(offs, torch.arange(rows, dtype=offs.dtype, device=offs.device), right=True)


class _GroupedLinear(torch.autograd.Function):
    """Every local expert's linear map on its rows: ``rows`` [M, K] sorted expert-major
    (``offs``: each expert's end row), ``params``: per expert, ``width`` weights [N_i, K]
    joined along N (SwiGLU's gate and up: one GEMM for both), then its bias [N] when
    ``bias``. Forward one grouped GEMM; backward two (the rows' gradient, and all the
    weights' at once, ``grad^T x rows`` cut at the offsets). Keeps the rows, the offsets
    (on ``ctx``: ``E`` integers, which the per-token memory model leaves out) and the
    parameters themselves (never a stacked copy: under ZeRO-3 they are gathered again for
    backward, as an ``nn.Linear``'s are), as the per-expert loop does."""

    @staticmethod
    def forward(ctx, rows, offs, width, bias, f8, *params):
        per = width + int(bias)
        fp8 = f8.fp8
        ctx.width, ctx.bias, ctx.rows, ctx.f8 = width, bias, [p.shape[0] for p in params[:width]], f8
        groups = [params[i:i + per] for i in range(0, len(params), per)]
        weights = stacked([g[:width] for g in groups])
        if fp8 is not None:  # rows per token, weights per expert (row), dequantised: float8.py's experts
            scales = torch.stack([float8.expert_scales(g[:width], fp8, "rows") for g in groups])
            out = _grouped_dequantised(float8.quantised_rows(rows, fp8, groups=f8.rows),
                                       float8.quantised_experts(weights, scales, 1).transpose(1, 2), offs, rows.dtype)
        else:
            out = grouped_mm(rows, weights.transpose(1, 2), offs)
        if bias:
            out += stacked([g[width:] for g in groups]).index_select(0, _group_of_rows(offs, rows.shape[0]))
        ctx.offs = offs  # E int32, held beside the saved tensors (the memory model counts per token)
        ctx.save_for_backward(rows, *params)
        return out

    @staticmethod
    def backward(ctx, grad):
        (rows, *params), offs = ctx.saved_tensors, ctx.offs
        width, per = ctx.width, ctx.width + int(ctx.bias)
        groups = [params[i:i + per] for i in range(0, len(params), per)]
        grad, fp8 = grad.contiguous(), ctx.f8.fp8
        d_rows = None
        if ctx.needs_input_grad[0] and fp8 is None:
            d_rows = grouped_mm(grad, stacked([g[:width] for g in groups]), offs)
        elif ctx.needs_input_grad[0]:
            scales = torch.stack([float8.expert_scales(g[:width], fp8, "cols") for g in groups])
            d_rows = _grouped_dequantised(float8.quantised_rows(grad, fp8, fp8.grad_dtype, ctx.f8.gradients),
                                          float8.quantised_experts(stacked([g[:width] for g in groups]), scales, 2),
                                          offs, grad.dtype)
        d_weights = grouped_mm(grad.t(), rows, offs)  # [E, N, K]; float8 too: a sum over the tokens, in bf16
        d_bias = _expert_sums(grad, offs) if ctx.bias else None  # each expert's rows summed in row order
        # (a float index_add_ would add with atomics on CUDA)
        wanted = all(ctx.needs_input_grad[5:])
        weights_done = wanted and accumulate_stacked([g[:width] for g in groups], d_weights)
        biases_done = wanted and ctx.bias and accumulate_stacked([g[width:] for g in groups], d_bias)
        grads = []
        for e, d in enumerate(d_weights.unbind(0)):
            if weights_done:
                grads.extend([None] * width)
            else:
                grads.extend(d.split(ctx.rows, 0) if width > 1 else (d,))
            if ctx.bias:
                grads.append(None if biases_done else d_bias[e])
        return (d_rows, None, None, None, None, *grads)


class _Float8Rows:
    """A grouped linear's float8 recipe (None: bf16) and the groups holding the rest of
    each token's row of its input (``rows``: a down projection's slice under etp) and of
    its output gradient (``gradients``: gate and up's slices)."""

    def __init__(self, fp8: float8.Float8 | None, rows: CommGroup | None = None,
                 gradients: CommGroup | None = None):
        self.fp8 = fp8
        self.rows = (rows,) if rows is not None else ()
        self.gradients = (gradients,) if gradients is not None else ()


def _grouped_dequantised(rows: torch.Tensor, weights: torch.Tensor, offs: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """The grouped GEMM of dequantised float8 operands (fp32): in fp32 where the grouped
    GEMM takes it (CPU), else in bf16 (CUDA's grouped GEMM: the dequantised values
    rounded once more); the result in ``dtype``."""
    if not grouped_gemm_fits(torch.float32, rows.device, 16, 16):
        rows, weights = rows.to(torch.bfloat16), weights.to(torch.bfloat16)
    return grouped_mm(rows, weights, offs).to(dtype)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` from the grouped GEMM's joined ``[rows, 2H]`` output (gate
    columns first). Autograd of the two slices would fill two zero ``[rows, 2H]`` tensors
    in backward and add them; this writes both halves of the gradient into one. It keeps
    what the ``nn.Linear`` loop keeps (the joined output and ``silu(gate)``; the product is
    kept by the next GEMM)."""

    @staticmethod
    def forward(ctx, gate_up):
        h = gate_up.shape[-1] // 2
        gate, up = gate_up[:, :h], gate_up[:, h:]
        act = F.silu(gate)
        ctx.save_for_backward(gate_up, act)
        return act * up

    @staticmethod
    def backward(ctx, grad):
        gate_up, act = ctx.saved_tensors
        h = gate_up.shape[-1] // 2
        out = torch.empty_like(gate_up)  # no other temporary: each half written in place
        d_gate = torch.mul(grad, gate_up[:, h:], out=out[:, :h])
        torch.ops.aten.silu_backward.grad_input(d_gate, gate_up[:, :h], grad_input=d_gate)
        torch.mul(grad, act, out=out[:, h:])
        return out


class Router(nn.Module):
    """The gate: ``E`` logits per token, no bias (Hugging Face's ``gate``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def route(logits: torch.Tensor, k: int, renormalize: bool, *, sigmoid: bool = False,
          bias: torch.Tensor | None = None, groups: int = 1, group_top_k: int | None = None,
          scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (probabilities [N, E] in at least fp32, the top-k experts
    [N, k], their weights [N, k] in the logits' dtype).

    Scores in at least fp32: the softmax (Mixtral, Qwen3-MoE, OLMoE) or each expert's
    sigmoid (DeepSeek-V3); the probabilities the balance losses take are the softmax, or
    the sigmoid scores over their sum. The experts are chosen by the scores plus ``bias``
    (aux-loss-free balancing; none: the scores), among the ``group_top_k`` best of
    ``groups`` groups of consecutive experts (a group's score: its two best choice scores
    for sigmoid, DeepSeek-V3; its best for softmax, DeepSeek-V2). The weights are the
    scores (without bias) of the chosen experts, with ``renormalize`` over their sum
    (sigmoid: plus 1e-20, as Hugging Face's DeepseekV3TopkRouter), times ``scale``."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if sigmoid:
        scores = torch.sigmoid(x)
        probs = scores / scores.sum(dim=-1, keepdim=True)
    else:
        scores = probs = torch.softmax(x, dim=-1)
    with torch.no_grad():
        choice = scores if bias is None else scores + bias
        top_groups = group_top_k or groups
        if top_groups < groups:
            n, e = choice.shape
            by_group = choice.view(n, groups, e // groups)
            group_scores = by_group.topk(2, dim=-1).values.sum(-1) if sigmoid else by_group.amax(-1)
            kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_scores.topk(top_groups, -1)[1],
                                                                             True)
            choice = choice.masked_fill(~kept.repeat_interleave(e // groups, dim=1), float("-inf"))
        chosen = choice.topk(k, dim=-1).indices
    top = scores.gather(1, chosen)
    if renormalize:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20) if sigmoid else top / top.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        top = top * scale
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
        self.experts = nn.ModuleDict({str(e): Expert(cfg, ep.etp) for e in ep.local_experts(cfg.n_experts)})
        for p in [*self.router.parameters(), *self.experts.parameters()]:
            p.sequence_parallel = tp.sequence_parallel  # partial sums over tp under SP
        for p in self.experts.parameters():
            p.expert = True  # reduced over the expert-data-parallel group, not dp x cp
            if tp.fp8 is not None and p.dim() == 2:  # their grouped GEMMs in float8 (float8.py: experts)
                float8.mark(p, "expert")
            if ep.folded:  # the expert grid spans tp: a rank's experts are its own, not copies of its tp peers'
                p.tp_distinct, p.sequence_parallel = True, False
        self.shared = shared
        self.grouped_gemm = True  # False: the per-expert loop in every dtype (tests compare the two)
        # aux-loss-free balancing's per-expert selection bias (Hugging Face's
        # e_score_correction_bias): model state, not a parameter (no gradient, no optimizer
        # state), the same on every rank, in at least fp32; real even in a model built on
        # the meta device (it moves with the model)
        bias = None
        if cfg.moe_router == "sigmoid" or cfg.moe_expert_bias_rate > 0:
            with torch.device("cpu"):
                bias = torch.zeros(cfg.n_experts, dtype=torch.float32)
        self.register_buffer("expert_bias", bias)

    def _apply(self, fn, recurse=True):
        """Casts leave the expert bias in at least fp32 (bf16 would round its steps away)."""
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if bias is not None and self.expert_bias.dtype.itemsize < 4:
            self.expert_bias = bias.to(self.expert_bias.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        logits = self.router(tokens)
        probs, chosen, weights = route(logits, cfg.moe_top_k, cfg.moe_norm_topk, sigmoid=cfg.moe_router == "sigmoid",
                                       bias=self.expert_bias, groups=cfg.moe_groups,
                                       group_top_k=cfg.moe_group_top_k, scale=cfg.moe_routed_scale)
        capacity = None
        if cfg.moe_capacity_factor is not None and self.training:  # inference is dropless
            order, used, capacity, counts = capacity_order(
                chosen, cfg.n_experts, cfg.moe_capacity_factor, self.ep,
                self.ep.token_key_tensor(b, s, tokens.device), most_runs=b * (2 if self.ep.cp_size > 1 else 1))
        else:
            order, counts = permutation(chosen, cfg.n_experts)
            used = counts
        # expert tensor parallelism: the etp group pools its rows (each member runs its slice
        # of its experts on all of them) while the routing statistics stay this rank's own
        etp = self.ep.etp
        rows, picks, gains = (tokens, chosen, weights) if etp.size == 1 else \
            (gather_rows(tokens, etp), etp.all_gather(chosen, 0), gather_rows(weights, etp))
        if etp.size > 1:
            order, used = permutation(picks, cfg.n_experts)
        exchange = start_counts_exchange(used, self.ep)  # first: the dispatch waits on it
        # the global micro-batch's counts (before capacity) and probability sums travel
        # while the experts run
        stats = torch.cat([counts.to(torch.float64), probs.detach().sum(0).to(torch.float64)])
        summed = self.ep.start_global_sum(stats)
        # the sequence-wise loss's per-sequence counts and probability sums, likewise
        per_sequence = self.ep.start_sequence_sum(_sequence_stats(chosen, probs, b, cfg.n_experts)) \
            if cfg.moe_seq_aux_loss_coeff > 0 and self.training else None
        grouped = self._run_grouped if self.grouped(tokens.dtype, tokens.device) else None
        out, _, received = dispatch_combine(rows, picks, gains, cfg.n_experts, self.ep,
                                            lambda e, r: self.experts[str(e)](r), (order, used),
                                            run_grouped=grouped, exchange=exchange, dropless=capacity is None)
        out = reduce_scatter_rows(out, etp)  # the slices' partial outputs summed, each member its own rows
        out = self._balance(out, probs, summed(), received, capacity,
                            per_sequence() if per_sequence is not None else None).view(b, s, d)
        if self.shared is not None:
            out = out + self.shared(x)
        return out

    def grouped(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the local experts run as grouped GEMMs (``torch._grouped_mm``) on rows of
        ``dtype``: fp32 and bf16 on CPU, bf16 on CUDA (a GPU of compute capability 9.0 or
        10.x, read once per device; a dry run without a GPU plans for a Hopper-class one),
        with 16-byte aligned widths, unless ``grouped_gemm`` was turned off; otherwise (fp64:
        the parity reference; an A100) the per-expert loop, one host read per layer and
        micro-batch (:func:`grouped_gemm_fits`)."""
        return self.grouped_gemm and len(self.experts) > 0 and \
            grouped_gemm_fits(dtype, device, self.cfg.d_model, self.cfg.moe_ffn_size // self.ep.etp.size)

    def lay_out_parameters(self) -> None:
        """Put the local experts' parameters one expert after another in one storage
        (:func:`pack`), so that the grouped GEMMs read each weight kind as one strided view.
        Called once the parameters have memory (checkpoint/materialise.py), before
        anything records which storages are parameters (the activation meter, offloading);
        :meth:`_expert_parameters` does it at the first forward otherwise."""
        self._expert_parameters()

    def _expert_parameters(self) -> list[list[torch.Tensor]]:
        """Each local expert's parameters, in registration order (SwiGLU: gate, up, down;
        GELU: fc weight and bias, proj weight and bias), packed into one storage
        (:func:`pack`) when found apart (after a dtype change, or a model built with
        memory and never materialised)."""
        per_expert = [[p for linear in m._modules.values() for p in linear._parameters.values() if p is not None]
                      for m in self.experts.values()]
        if not packed(per_expert):
            pack(per_expert)
        return per_expert

    def _run_grouped(self, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Every local expert on its rows (``rows`` sorted expert-major, ``offs`` each
        expert's end row) by grouped GEMMs: SwiGLU as two (gate and up joined: their
        weights lie one after the other), GELU as two with per-expert biases."""
        per_expert, fp8 = self._expert_parameters(), self.tp.fp8
        if self.cfg.arch == "llama":  # gate, up, down (under etp: slices by rows, by columns)
            etp = self.ep.etp if fp8 is not None and self.ep.etp.size > 1 else None
            gate_up = _GroupedLinear.apply(rows, offs, 2, False, _Float8Rows(fp8, gradients=etp),
                                           *[p for ps in per_expert for p in ps[:2]])
            return _GroupedLinear.apply(_SwiGLU.apply(gate_up), offs, 1, False, _Float8Rows(fp8, rows=etp),
                                        *[ps[2] for ps in per_expert])
        # fc weight and bias, proj weight and bias
        hidden = _GroupedLinear.apply(rows, offs, 1, True, _Float8Rows(fp8), *[p for ps in per_expert for p in ps[:2]])
        return _GroupedLinear.apply(F.gelu(hidden, approximate="tanh"), offs, 1, True, _Float8Rows(fp8),
                                    *[p for ps in per_expert for p in ps[2:]])

    def _balance(self, out: torch.Tensor, probs: torch.Tensor, stats: torch.Tensor, received: int | torch.Tensor,
                 capacity: torch.Tensor | None, per_sequence: torch.Tensor | None = None) -> torch.Tensor:
        """From the global micro-batch's counts (before capacity) and probability sums
        (``stats``), and each of this rank's sequences' (``per_sequence`` [b, 2E], summed
        over the ranks holding the sequence; None without the sequence-wise loss): the
        step's routing log (with the assignments beyond ``capacity``), and the balance
        losses' gradients joined to ``out``."""
        cfg, e = self.cfg, self.cfg.n_experts
        assignments = stats[:e].sum()
        tokens = assignments / cfg.moe_top_k
        f = stats[:e] / assignments  # fraction of the assignments each expert got
        sequence = self._sequence_loss(probs, per_sequence) if per_sequence is not None else None
        if self.training and not (self.recompute is not None and self.recompute.rebuilding):
            aux_value = e * (f * stats[e:] / tokens).sum()
            dropped = torch.zeros((), dtype=torch.float64, device=stats.device) if capacity is None else \
                (stats[:e] - capacity).clamp(min=0).sum()
            self.ep.log.record(self.layer, stats[:e], aux_value, dropped, received,
                               sequence[1] if sequence is not None else None, self.expert_bias)
        if not self.training:  # training objectives: not in evaluation
            return out
        if sequence is not None:
            out = with_aux_loss(out, sequence[0], cfg.moe_seq_aux_loss_coeff * self.ep.aux_grad_scale)
        if cfg.moe_aux_loss_coeff == 0.0:
            return out
        # this rank's share: its tokens' probabilities against the global fractions
        local = e * (f.to(probs.dtype) * probs.sum(0)).sum() / tokens.to(probs.dtype)
        return with_aux_loss(out, local, cfg.moe_aux_loss_coeff * self.ep.aux_grad_scale)

    def _sequence_loss(self, probs: torch.Tensor, per_sequence: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's sequence-wise balance loss (without its coefficient): the mean over
        the global micro-batch's ``B`` sequences of ``sum_i f_i P_i``, with ``f_i = E / (k T)
        x`` the times expert ``i`` was chosen among the sequence's ``T`` tokens and ``P_i``
        the mean of its probability over them. Returns (this rank's share, with gradient:
        its tokens' probabilities against their sequences' ``f``; summed over the ranks it
        is the loss), and this rank's share of the value (its sequences' mean, divided over
        the cp x sp ranks that hold them and the global micro-batch's sequences: the shares
        summed over the token groups give the mean)."""
        e, ep = self.cfg.n_experts, self.ep
        b = per_sequence.shape[0]
        length = probs.shape[0] // b * ep.cp_size * ep.sp_size  # T: a sequence's tokens, all ranks
        sequences = b * ep.dp_size  # B
        f = per_sequence[:, :e] * (e / (self.cfg.moe_top_k * length))  # [b, E]
        local = (f.to(probs.dtype) * probs.view(b, -1, e).sum(1)).sum() / (length * sequences)
        value = (f * per_sequence[:, e:]).sum() / (length * sequences * ep.cp_size * ep.sp_size)
        return local, value

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor) -> None:
        """Aux-loss-free balancing (DeepSeek-V3), after an optimizer step: each expert's bias
        moves by ``moe_expert_bias_rate`` towards balance, ``+G`` where the step's load
        (``counts`` [E]: assignments of the step's global micro-batches, the same on every
        rank) is below the mean, ``-G`` above it. Exact arithmetic on counts every layout
        shares, so every layout holds the same bias."""
        rate = self.cfg.moe_expert_bias_rate
        if rate > 0 and self.expert_bias is not None:
            self.expert_bias += rate * torch.sign(counts.mean() - counts).to(self.expert_bias.dtype)


def _sequence_stats(chosen: torch.Tensor, probs: torch.Tensor, batch: int, n_experts: int) -> torch.Tensor:
    """Per sequence of this rank's ``batch`` (tokens sequence-major): how many of its
    assignments went to each expert, then each expert's probability summed over its
    tokens; [batch, 2E], fp64."""
    experts = chosen.reshape(batch, -1)
    counts = torch.zeros(batch, n_experts, dtype=torch.float64, device=chosen.device)
    counts.scatter_add_(1, experts, torch.ones(experts.shape, dtype=torch.float64, device=chosen.device))
    sums = probs.detach().reshape(batch, -1, n_experts).sum(1).to(torch.float64)
    return torch.cat([counts, sums], dim=1)


def update_expert_biases(model: nn.Module, log: RoutingLog) -> None:
    """Every MoE layer of ``model`` moves its expert bias from the step's routing counts
    (``log``, recorded during the step: :meth:`MoE.update_expert_bias`)."""
    for module in model.modules():
        if isinstance(module, MoE) and module.layer in log.layers:
            module.update_expert_bias(log.layers[module.layer].counts)
