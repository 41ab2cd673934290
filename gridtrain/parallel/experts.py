"""Expert parallelism: tokens to the ranks of their experts and back, and the routing
statistics every layout agrees on.

A mixture-of-experts layer (models/moe.py) routes each token to ``k`` of ``E`` experts.
With ``--ep P`` each rank of an expert-parallel group (``P`` consecutive members of a
dp x cp group, grid.py) holds ``E / P`` of them, and a token's rows travel to the ranks of
its experts and back by two ``all_to_all_single`` with variable splits (comm.all_to_all,
whose backward is the same exchange reversed):

1. **permute**: the ``N k`` (token, expert) assignments sorted by expert, stably, so each
   expert's rows are consecutive and in token order, and the rows bound for one rank are
   one block (experts are numbered rank-major);
2. **exchange counts**: each rank sends every peer how many rows it has for each of the
   peer's experts (an ``all_to_all`` of ``E`` integers), so every rank knows the splits of
   the exchange and how its received rows divide among its experts. One host read per
   layer and micro-batch: dropless routing sizes tensors by the counts (Megatron's
   dropless dispatch syncs here too);
3. **dispatch**: the rows to their ranks; received rows come source-rank-major and are
   regrouped expert-major, each local expert runs once on its rows (every expert runs
   every micro-batch, on zero rows if none came, so each expert weight gets a gradient
   per micro-batch as the gradient reducer counts on);
4. **combine**: outputs back the reverse way, weighted by the router's weights and summed
   into each token's row in expert order (the same order on every layout, so sums round
   alike).

With one rank the same code runs with the exchanges left out, so one process and every
ep size share the permutation, the expert loop and the combine.

**Routing statistics over a global micro-batch.** The load-balancing loss (Switch / GShard:
``E sum_e f_e P_e``, ``f_e`` the fraction of assignments that went to expert ``e``, ``P_e``
its mean router probability) and the capacity depend on the batch they are taken over. A
per-rank (or per-micro-batch on one rank) statistic makes the model depend on the layout.
gridtrain takes them over the *global micro-batch*: the ``j``-th micro-batch of every
data-parallel rank together, whose tokens are spread over dp x cp (and over tp under
sequence parallelism). The sampler orders each global batch micro-batch-major (data/
sampler.py, as Megatron's does), so global micro-batch ``j`` is the same samples for every
dp, and the counts and probability sums are all-reduced over those groups: every layout
with the same number of micro-batches per step computes the same loss. (Statistics of the
whole global batch would need every micro-batch routed before any backward: GPipe's
memory; 1F1B runs a micro-batch's backward before later ones exist.)

The loss's gradient is injected at the layer's output (:func:`with_aux_loss`), scaled so
that, after the data-parallel average, each layer contributes ``coeff x (1 / m) x
d aux / d theta`` per micro-batch: the aux loss is summed over layers and averaged over the
step's ``m`` micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gridtrain.runtime import host_sync
from gridtrain.parallel.comm import CommGroup, OnGroup, all_to_all, single


@dataclass
class LayerStats:
    """One MoE layer's routing over a step (global micro-batches summed)."""

    counts: torch.Tensor  # [E] assignments per expert (before capacity), fp64
    aux: torch.Tensor  # sum over micro-batches of E sum_e f_e P_e (without the coefficient)
    dropped: torch.Tensor  # assignments dropped by capacity
    micro_batches: int = 0
    received: int = 0  # rows this rank's experts received (its own and its ep peers'), all micro-batches


@dataclass
class RoutingLog:
    """Per-step routing statistics of this rank's MoE layers, by global layer index.
    Recorded once per micro-batch forward (never by a recomputation's rebuild, never in
    validation), from the globally reduced counts: every rank of a stage holds the same
    numbers."""

    layers: dict[int, LayerStats] = field(default_factory=dict)

    def reset(self) -> None:
        self.layers.clear()

    def record(self, layer: int, counts: torch.Tensor, aux: torch.Tensor, dropped: torch.Tensor,
               received: int) -> None:
        s = self.layers.get(layer)
        if s is None:
            self.layers[layer] = LayerStats(counts.clone(), aux.clone(), dropped.clone(), 1, received)
            return
        s.counts += counts
        s.aux += aux
        s.dropped += dropped
        s.micro_batches += 1
        s.received += received


@dataclass
class ExpertParallel(OnGroup):
    """What a MoE layer needs from the grid: its expert-parallel group (``comm``; one rank
    when ``--ep`` is 1), the groups a global micro-batch's tokens are spread over
    (``token_groups``: dp x cp, plus tp under sequence parallelism), the gradient scale of
    the load-balancing loss this step, and the step's routing log."""

    comm: CommGroup = field(default_factory=lambda: single("ep"))
    token_groups: tuple[CommGroup, ...] = ()
    aux_grad_scale: float = 1.0  # set by the trainer each step: dp x cp x loss scale / micro-batches
    log: RoutingLog = field(default_factory=RoutingLog)
    # where this rank's tokens sit in the global micro-batch (capacity's drop order):
    # its dp index, its cp group and, under sequence parallelism, its tp share
    dp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    sp_size: int = 1
    sp_rank: int = 0

    def local_experts(self, n_experts: int) -> range:
        """The experts this rank holds: ``E / ep`` consecutive ones."""
        per = n_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def token_keys(self, batch: int, local_len: int) -> list[int]:
        """Each of this rank's ``batch x local_len`` tokens' place in the global micro-batch,
        ``sample x seq_len + true position``, in the rank's token order: its samples are
        the dp rank's slice of the global micro-batch (data/sampler.py), its positions its
        cp chunks, cut to its tp share under sequence parallelism. Plain integers: they
        follow from the layout alone (and a dry run's tensors could not be read)."""
        cp_len = local_len * self.sp_size  # the cp rank's tokens of a sequence
        seq_len = cp_len * self.cp_size
        n = seq_len // (2 * self.cp_size)  # a cp chunk
        chunks = (self.cp_rank, 2 * self.cp_size - 1 - self.cp_rank)
        positions = [c * n + i for c in chunks for i in range(n)] if self.cp_size > 1 else list(range(seq_len))
        positions = positions[self.sp_rank * local_len:(self.sp_rank + 1) * local_len]
        return [s * seq_len + p for s in range(self.dp_rank * batch, (self.dp_rank + 1) * batch) for p in positions]

    def start_global_sum(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start summing ``t`` over every rank holding tokens of this global micro-batch;
        returns the wait, which gives ``t`` summed (the first group's all-reduce travels
        meanwhile: the experts' dispatch and compute hide it)."""
        groups = self.token_groups
        pending = groups[0].start_all_reduce(t) if groups else None

        def wait() -> torch.Tensor:
            if pending is not None:
                pending.wait()
            for g in groups[1:]:
                g.all_reduce(t)
            return t
        return wait


# ---- permutation ------------------------------------------------------------------------------------

def permutation(chosen: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``chosen`` [N, k] expert ids -> (order, counts): ``order`` lists the N k assignments
    (``token * k + slot``) sorted by expert, stably (token order within an expert);
    ``counts`` [E] how many each expert got."""
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=chosen.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


def permute(tokens: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """The rows of the sorted assignments: ``tokens[order // k]``."""
    return tokens.index_select(0, order // k)


def unpermute(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, k: int, n_tokens: int) -> torch.Tensor:
    """Each token's sum of its rows times their routing weights (``weights`` [N, k]),
    added in expert order: the inverse of :func:`permute` when every weight is 1 and k is 1."""
    w = weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    out = rows.new_zeros((n_tokens, rows.shape[-1]))
    return out.index_add(0, order // k, rows * w)


def _uniform(total: int, parts: int) -> list[int]:
    """``total`` split as evenly as possible into ``parts`` (the dry run's stand-in)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def dispatch_combine(tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, n_experts: int,
                     ep: ExpertParallel, run_expert,
                     kept: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The routed experts' weighted sum for every token (``tokens`` [N, d], ``chosen`` and
    ``weights`` [N, k]); ``run_expert(e, rows)`` runs local expert ``e`` (global id).
    ``kept``: capacity's (order, counts) from :func:`capacity_order` (the kept
    assignments first); default every assignment (:func:`permutation`).
    Returns (output [N, d], this rank's counts per expert [E], the rows its experts ran)."""
    n, k = chosen.shape
    order, counts = kept if kept is not None else permutation(chosen, n_experts)
    local = ep.local_experts(n_experts)
    per = len(local)
    if ep.size == 1:
        sizes = host_sync.read("moe_routing", counts, lambda t: t.tolist(), stand_in=lambda: _uniform(n * k, n_experts))
        order = order[:sum(sizes)]
        outs = [run_expert(e, part) for e, part in zip(local, permute(tokens, order, k).split(sizes))]
        return unpermute(torch.cat(outs), order, weights, k, n), counts, sum(sizes)
    # how many rows each peer sends to each of my experts: [ep, E/ep]
    received = ep.comm.all_to_all(counts, [per] * ep.size, [per] * ep.size)
    both = host_sync.read("moe_routing", torch.cat([counts, received]), lambda t: t.tolist(),
                          stand_in=lambda: _uniform(n * k, n_experts) * 2)
    mine, theirs = both[:n_experts], both[n_experts:]
    order = order[:sum(mine)]
    rows = permute(tokens, order, k)
    send = [sum(mine[r * per:(r + 1) * per]) for r in range(ep.size)]
    grid = [theirs[r * per:(r + 1) * per] for r in range(ep.size)]  # grid[src][local expert]
    recv = [sum(row) for row in grid]
    arrived = all_to_all(rows, ep.comm, send, recv)  # source-major, expert-major within a source
    starts, at = [], 0
    for src in range(ep.size):
        starts.append([])
        for j in range(per):
            starts[src].append(at)
            at += grid[src][j]
    # regroup expert-major (each expert's rows from every source, in source order)
    segments = [(starts[src][j], grid[src][j]) for j in range(per) for src in range(ep.size)]
    regroup = torch.cat([torch.arange(s, s + c, device=tokens.device) for s, c in segments]) if segments else \
        torch.zeros(0, dtype=torch.int64, device=tokens.device)
    grouped = arrived.index_select(0, regroup)
    sizes = [sum(grid[src][j] for src in range(ep.size)) for j in range(per)]
    outs = torch.cat([run_expert(e, part) for e, part in zip(local, grouped.split(sizes))])
    back = torch.empty_like(outs).index_copy(0, regroup, outs)  # source-major again
    returned = all_to_all(back, ep.comm, recv, send)
    return unpermute(returned, order, weights, k, n), counts, sum(recv)


# ---- capacity -------------------------------------------------------------------------------------

def token_runs(keys: list[int], most: int) -> tuple[list[int], list[int]]:
    """This rank's tokens cut into runs of consecutive keys (a sample's positions, broken
    at its cp chunks): (each token's run, each run's first key, ``most`` of them, padded
    with a key past every token)."""
    runs, starts = [], []
    for i, key in enumerate(keys):
        if i == 0 or key != keys[i - 1] + 1:
            starts.append(key)
        runs.append(len(starts) - 1)
    if len(starts) > most:
        raise ValueError(f"{len(starts)} runs of tokens, more than the {most} expected")
    return runs, starts + [2 ** 63 - 1] * (most - len(starts))


def capacity_order(chosen: torch.Tensor, n_experts: int, factor: float, ep: ExpertParallel,
                   keys: list[int], most_runs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert capacity, the same tokens dropped on every layout: each expert takes at most
    ``C = ceil(factor x N x k / E)`` assignments of the global micro-batch (``N`` tokens),
    the first ones in token order (``keys``: sample, then true position; ExpertParallel.
    token_keys). Each rank's tokens form runs of consecutive keys; the runs' first keys
    and per-expert counts are all-gathered over the ranks holding the micro-batch, so
    each rank knows how many assignments to each expert come before each of its runs.

    Returns (order, kept counts [E], C, counts before dropping [E]): ``order`` lists the
    kept assignments sorted by expert (token order within one), then the dropped ones."""
    n, k = chosen.shape
    device = chosen.device
    order, counts = permutation(chosen, n_experts)
    runs, firsts = token_runs(keys, most_runs)
    run_of_token = torch.tensor(runs, dtype=torch.int64, device=device)
    starts = torch.tensor(firsts, dtype=torch.int64, device=device)
    sorted_experts = chosen.reshape(-1).index_select(0, order)
    run = run_of_token.index_select(0, order // k)
    table = torch.zeros(most_runs, n_experts, dtype=torch.int64, device=device)
    table.index_put_((run, sorted_experts), torch.ones_like(run), accumulate=True)  # [runs, E] counts
    everyone = torch.cat([starts[:, None], table], dim=1)
    for g in ep.token_groups:  # every run of the global micro-batch: [ranks x runs, 1 + E]
        everyone = g.all_gather(everyone, 0)
    before = (everyone[None, :, 0] < starts[:, None]).to(torch.float64)  # exact as fp64 (counts < 2^53)
    earlier = (before @ everyone[:, 1:].to(torch.float64)).round().to(torch.int64)  # [runs, E]
    mine_before = torch.cumsum(table, 0) - table  # this rank's own earlier runs, already in 'earlier'
    segment_start = torch.cumsum(counts, 0) - counts
    within = torch.arange(n * k, device=device) - segment_start.index_select(0, sorted_experts)
    place = earlier[run, sorted_experts] - mine_before[run, sorted_experts] + within
    capacity = torch.ceil(factor * everyone[:, 1:].sum() / n_experts)
    keep = place < capacity
    kept_first = torch.argsort((~keep).to(torch.int8), stable=True)
    kept_counts = torch.zeros_like(counts).index_add_(0, sorted_experts, keep.to(torch.int64))
    return order.index_select(0, kept_first), kept_counts, capacity, counts


# ---- the load-balancing loss -----------------------------------------------------------------------

class _AuxLossGrad(torch.autograd.Function):
    """Identity on ``out``; in backward, ``scale`` as the gradient of ``aux`` (a scalar
    computed from the router's probabilities), so the load-balancing loss trains the
    router without being added to the loss the pipeline carries."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale = scale
        ctx.aux_meta = (aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.aux_meta
        return grad, torch.full((), ctx.scale, dtype=dtype, device=device), None


def with_aux_loss(out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    """``out``, with ``scale x d aux`` joining backward where ``out``'s gradient arrives."""
    if scale == 0.0 or not torch.is_grad_enabled() or not aux.requires_grad:
        return out
    return _AuxLossGrad.apply(out, aux, scale)


# ---- what a step's routing looked like -----------------------------------------------------------

@dataclass(frozen=True)
class LayerRouting:
    """One MoE layer over one step: assignments per expert (all ranks, every micro-batch),
    its load-balancing loss (mean over the step's global micro-batches, without the
    coefficient; 1.0 is perfect balance) and the assignments capacity dropped."""

    tokens_per_expert: list[int]
    aux_loss: float
    dropped: int = 0

    @property
    def max_load(self) -> float:
        """The busiest expert's assignments over the mean (1.0: perfectly even)."""
        mean = sum(self.tokens_per_expert) / max(1, len(self.tokens_per_expert))
        return max(self.tokens_per_expert) / mean if mean else 0.0

    def as_json(self) -> dict:
        return {"tokens_per_expert": self.tokens_per_expert, "max_load": self.max_load, "aux_loss": self.aux_loss,
                "dropped": self.dropped}


def step_routing(log: RoutingLog, moe_layers: list[int], n_experts: int, pp: CommGroup,
                 device: torch.device) -> dict[int, LayerRouting]:
    """Every MoE layer's routing this step, the same on every rank: each stage fills the
    rows of its own layers (their counts are global already), one all-reduce over the
    pipeline brings them together, one host read (``moe_routing_stats``)."""
    if not moe_layers:
        return {}
    rows = torch.zeros(len(moe_layers), n_experts + 2, dtype=torch.float64, device=device)
    for i, layer in enumerate(moe_layers):
        s = log.layers.get(layer)
        if s is not None:
            rows[i, :n_experts] = s.counts
            rows[i, n_experts] = s.aux / max(1, s.micro_batches)
            rows[i, n_experts + 1] = s.dropped
    pp.all_reduce(rows)
    table = host_sync.read("moe_routing_stats", rows, lambda t: t.tolist(),
                           stand_in=lambda: [[1.0] * n_experts + [1.0, 0.0]] * len(moe_layers))
    return {layer: LayerRouting([int(c) for c in row[:n_experts]], row[n_experts], int(row[n_experts + 1]))
            for layer, row in zip(moe_layers, table)}
