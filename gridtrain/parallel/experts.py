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
2. **exchange counts** (ep > 1): each rank sends every peer how many rows it has for each
   of the peer's experts (an ``all_to_all`` of ``E`` integers), so every rank knows the
   splits of the exchange and how its received rows divide among its experts. It is
   started as soon as the counts exist (:func:`start_counts_exchange`, before the
   routing statistics' all-reduce) and travels while the rows are gathered. Then the
   layer's one host read (``moe_routing``: the exchanged counts and this rank's, read
   together): ``all_to_all_single`` takes its splits as host integers (Megatron's
   dropless dispatch syncs here too). Everything after it that depends on the counts
   (the regrouping below, the experts' offsets) is made on the device from the
   exchanged tensor, not from the host lists;
3. **dispatch**: the rows to their ranks; received rows come source-rank-major and are
   regrouped expert-major (a stable sort of the rows by their expert), and the local
   experts run on them. Every expert runs every micro-batch, on zero rows if none came,
   so each expert weight gets a gradient per micro-batch as the gradient reducer counts on;
4. **combine**: outputs back the reverse way, weighted by the router's weights and summed
   into each token's row in expert order (the same order on every layout, so sums round
   alike; :func:`token_sums`: a gather and ``k - 1`` additions, no atomic ``index_add``,
   so a GPU sums in that order too, run after run; the permutation's gradient likewise).

With one rank the same code runs with the exchanges left out, so one process and every
ep size share the permutation, the experts and the combine.

**The experts as grouped GEMMs.** Where ``torch._grouped_mm`` takes the dtype (fp32 and
bf16 on CPU, bf16 on CUDA; :func:`grouped_gemm_fits`) and, on CUDA, runs it as a grouped
kernel (compute capability 9.0 or 10.x: :func:`grouped_gemm_fast_on`; an A100's falls back
to a host read and a GEMM per expert, for each GEMM) the local experts run as one
grouped GEMM per weight kind (models/moe.py), cut at ``offs``, each expert's end row,
int32, on the device. One GEMM for all experts instead of one (and its Python and
autograd overhead) per expert, and, with the offsets on the device, no host read at
ep 1: a dropless layer at ep 1 needs no host-sized tensor at all (``N k`` rows, known
from the shapes). Under capacity at ep 1 the dropped rows stay at the end of the sorted
rows, run through the last expert and are weighted zero in the combine (exactly zero
contributions, forward and backward) instead of being cut off by a host-sized slice.
fp64 (and widths whose rows are not 16-byte aligned, and GPUs before Hopper) keeps the
per-expert loop, which splits the rows by host sizes (one read per layer and micro-batch
at ep 1 too): it is the parity reference the grouped GEMMs are tested against
(tests/test_moe_grouped.py).

**Capacity without loops over tokens.** Each token's place in the global micro-batch
(:meth:`ExpertParallel.token_key_tensor`) and the runs of consecutive places
(:func:`run_tensors`) are tensor arithmetic on an ``arange``: no Python loop over
tokens and no host-to-device copy of a list in the step (the plain-integer versions
stay as their reference).

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

DeepSeek-V3's sequence-wise balance loss takes the same statistics per sequence: each
rank's per-sequence counts and probability sums are all-reduced over the groups that
split a sequence (:meth:`ExpertParallel.start_sequence_sum`: cp, and tp under sequence
parallelism), started beside the global sum; sequences on other dp ranks are theirs.

The loss's gradient is injected at the layer's output (:func:`with_aux_loss`), scaled so
that, after the data-parallel average, each layer contributes ``coeff x (1 / m) x
d aux / d theta`` per micro-batch: the aux loss is summed over layers and averaged over the
step's ``m`` micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch._subclasses.fake_tensor import is_fake

from gridtrain.runtime import host_sync
from gridtrain.parallel.comm import CommGroup, OnGroup, all_to_all, single


@dataclass
class LayerStats:
    """One MoE layer's routing over a step (global micro-batches summed)."""

    counts: torch.Tensor  # [E] assignments per expert (before capacity), fp64
    aux: torch.Tensor  # sum over micro-batches of E sum_e f_e P_e (without the coefficient)
    dropped: torch.Tensor  # assignments dropped by capacity
    micro_batches: int = 0
    # rows this rank's experts received (its own and its ep peers'), all micro-batches; a
    # device tensor where counting them would need a host read (capacity at ep 1)
    received: int | torch.Tensor = 0
    # DeepSeek-V3's sequence-wise balance loss (without the coefficient), this rank's share
    # of the global micro-batches' mean (step_routing sums the shares over the token groups)
    seq_aux: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # the expert bias the step routed with (aux-loss-free balancing)


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
               received: int | torch.Tensor, seq_aux: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> None:
        s = self.layers.get(layer)
        if s is None:
            self.layers[layer] = LayerStats(counts.clone(), aux.clone(), dropped.clone(), 1, received,
                                            None if seq_aux is None else seq_aux.clone(),
                                            None if bias is None else bias.clone())
            return
        s.counts += counts
        s.aux += aux
        s.dropped += dropped
        s.micro_batches += 1
        s.received += received
        if seq_aux is not None:
            s.seq_aux += seq_aux


@dataclass
class ExpertParallel(OnGroup):
    """What a MoE layer needs from the grid: its expert-parallel group (``comm``; one rank
    when ``--ep`` is 1), the groups a global micro-batch's tokens are spread over
    (``token_groups``: dp x cp, plus tp under sequence parallelism) and those one
    sequence's tokens are spread over (``sequence_groups``: cp, plus tp under sequence
    parallelism), the gradient scale of the load-balancing loss this step, and the step's
    routing log."""

    comm: CommGroup = field(default_factory=lambda: single("ep"))
    token_groups: tuple[CommGroup, ...] = ()
    sequence_groups: tuple[CommGroup, ...] = ()
    aux_grad_scale: float = 1.0  # set by the trainer each step: dp x cp x loss scale / micro-batches
    log: RoutingLog = field(default_factory=RoutingLog)
    # where this rank's tokens sit in the global micro-batch (capacity's drop order):
    # its dp index, its cp group and, under sequence parallelism, its tp share
    dp_rank: int = 0
    dp_size: int = 1
    cp_size: int = 1
    cp_rank: int = 0
    sp_size: int = 1
    sp_rank: int = 0
    # MoE parallel folding (grid.ProcessGrid.folds_experts): the ep group spans tp ranks, whose
    # experts then differ (never summed over tp, counted and written by every tp rank)
    folded: bool = False
    # expert tensor parallelism (--etp): the ranks that split each of this rank's experts' MLPs
    etp: CommGroup = field(default_factory=lambda: single("etp"))

    def local_experts(self, n_experts: int) -> range:
        """The experts this rank holds: ``E / ep`` consecutive ones."""
        per = n_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def token_keys(self, batch: int, local_len: int) -> list[int]:
        """Each of this rank's ``batch x local_len`` tokens' place in the global micro-batch,
        ``sample x seq_len + true position``, in the rank's token order: its samples are
        the dp rank's slice of the global micro-batch (data/sampler.py), its positions its
        cp chunks, cut to its tp share under sequence parallelism. Plain integers: they
        follow from the layout alone (and a dry run's tensors could not be read). The
        reference for :meth:`token_key_tensor`, which the layer uses."""
        cp_len = local_len * self.sp_size  # the cp rank's tokens of a sequence
        seq_len = cp_len * self.cp_size
        n = seq_len // (2 * self.cp_size)  # a cp chunk
        chunks = (self.cp_rank, 2 * self.cp_size - 1 - self.cp_rank)
        positions = [c * n + i for c in chunks for i in range(n)] if self.cp_size > 1 else list(range(seq_len))
        positions = positions[self.sp_rank * local_len:(self.sp_rank + 1) * local_len]
        return [s * seq_len + p for s in range(self.dp_rank * batch, (self.dp_rank + 1) * batch) for p in positions]

    def token_key_tensor(self, batch: int, local_len: int, device: torch.device | str) -> torch.Tensor:
        """:meth:`token_keys` as an int64 tensor made on ``device`` by arithmetic on an
        ``arange``: no Python loop over tokens and no host-to-device copy in the step."""
        cp_len = local_len * self.sp_size
        seq_len = cp_len * self.cp_size
        i = torch.arange(batch * local_len, dtype=torch.int64, device=device)
        sample, q = i // local_len + self.dp_rank * batch, i % local_len + self.sp_rank * local_len
        if self.cp_size > 1:
            n = seq_len // (2 * self.cp_size)
            second = q >= n  # the rank's second chunk: 2 cp - 1 - cp_rank
            chunk = torch.where(second, 2 * self.cp_size - 1 - self.cp_rank, self.cp_rank)
            q = chunk * n + q - second.to(torch.int64) * n
        return sample * seq_len + q

    def start_global_sum(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start summing ``t`` over every rank holding tokens of this global micro-batch;
        returns the wait, which gives ``t`` summed (the first group's all-reduce travels
        meanwhile: the experts' dispatch and compute hide it)."""
        return _start_sum(t, self.token_groups)

    def start_sequence_sum(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """:meth:`start_global_sum` over the ranks holding parts of this rank's sequences
        (their cp chunks and, under sequence parallelism, tp shares): per-sequence sums."""
        return _start_sum(t, self.sequence_groups)


def _start_sum(t: torch.Tensor, groups: tuple[CommGroup, ...]) -> Callable[[], torch.Tensor]:
    """Start summing ``t`` in place over ``groups`` (the first one's all-reduce now, the
    others' at the wait); returns the wait, which gives ``t`` summed."""
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


def token_sums(rows: torch.Tensor, token_of_row: torch.Tensor, k: int, n_tokens: int) -> torch.Tensor:
    """Each of the ``n_tokens`` tokens' sum of its rows (``rows[i]`` is token
    ``token_of_row[i]``'s; at most ``k`` a token: the assignments dropped by capacity have
    none), added in the order the rows lie (expert order), one slot at a time.
    Deterministic on every device: a stable sort of the rows by token gives each token's
    rows in that order, they are gathered into ``k`` slots (a missing row reads zero) and
    added by ``k - 1`` elementwise additions, where an ``index_add`` would add them with
    atomics, in whatever order a GPU's threads arrive (floating-point sums that differ
    between runs). 16-bit rows are summed in fp32 and rounded once, as torch's CPU
    ``index_add`` does: on CPU the same sums, bit for bit, as ``index_add`` in row order."""
    m, d = rows.shape
    by_token = torch.argsort(token_of_row, stable=True)  # each token's rows together, in row order
    if m == n_tokens * k:  # every token has its k rows
        where = by_token.view(n_tokens, k)
    else:  # a slot per row within its token's (counts are integers: exact in any order); the rest read zeros
        counts = torch.zeros(n_tokens, dtype=torch.int64, device=rows.device)
        counts.index_add_(0, token_of_row, torch.ones_like(token_of_row))
        sorted_tokens = token_of_row.index_select(0, by_token)
        slot = torch.arange(m, device=rows.device) - (torch.cumsum(counts, 0) - counts).index_select(0, sorted_tokens)
        where = torch.full((n_tokens * k,), m, dtype=torch.int64, device=rows.device)
        where[sorted_tokens * k + slot] = by_token  # distinct places: no sum
        where = where.view(n_tokens, k)
        rows = torch.cat([rows, rows.new_zeros((1, d))])
    wide = torch.promote_types(rows.dtype, torch.float32)
    out = rows.index_select(0, where[:, 0]).to(wide)
    for s in range(1, k):
        out.add_(rows.index_select(0, where[:, s]))
    return out.to(rows.dtype)


class _Permute(torch.autograd.Function):
    """``tokens[order // k]``; its gradient is each token's rows' gradients summed by
    :func:`token_sums` (an ``index_select``'s own backward would ``index_add`` them).
    Keeps the rows' tokens (``order // k``), as the ``index_select`` did."""

    @staticmethod
    def forward(ctx, tokens, order, k):
        token_of_row = order // k
        ctx.k, ctx.n = k, tokens.shape[0]
        ctx.save_for_backward(token_of_row)
        return tokens.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad):
        (token_of_row,) = ctx.saved_tensors
        return token_sums(grad, token_of_row, ctx.k, ctx.n), None, None


class _Combine(torch.autograd.Function):
    """:func:`token_sums` of the weighted ``rows``; its gradient is each row's token's
    gradient (a gather by ``order // k``). It keeps what the ``index_add`` it replaces kept,
    the rows' tokens and the weighted rows (unread: memory.moe's ``rows`` term counts
    them; dropping them saves ``N k d`` elements a MoE layer, with that term)."""

    @staticmethod
    def forward(ctx, rows, order, k, n_tokens):
        token_of_row = order // k
        ctx.save_for_backward(token_of_row, rows)
        return token_sums(rows, token_of_row, k, n_tokens)

    @staticmethod
    def backward(ctx, grad):
        token_of_row, _ = ctx.saved_tensors
        return grad.index_select(0, token_of_row), None, None, None


def permute(tokens: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """The rows of the sorted assignments: ``tokens[order // k]`` (its gradient summed per
    token deterministically: :func:`token_sums`)."""
    return _Permute.apply(tokens, order, k)


def unpermute(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, k: int, n_tokens: int,
              keep: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's sum of its rows times their routing weights (``weights`` [N, k]),
    added in expert order (:func:`token_sums`: a fixed order on every device, no atomics):
    the inverse of :func:`permute` when every weight is 1 and k is 1. ``keep`` (bool, one
    per row): rows whose weight counts (the others add zero)."""
    w = weights.reshape(-1).index_select(0, order)
    if keep is not None:
        w = w * keep.to(w.dtype)
    return _Combine.apply(rows * w.unsqueeze(-1), order, k, n_tokens)


def _uniform(total: int, parts: int) -> list[int]:
    """``total`` split as evenly as possible into ``parts`` (the dry run's stand-in)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16), "cuda": (torch.bfloat16,)}  # what torch._grouped_mm takes


def grouped_gemm_fast_on(capability: tuple[int, int]) -> bool:
    """Whether torch's CUDA ``_grouped_mm`` runs its grouped kernel on a GPU of compute
    ``capability``: 9.0 (Hopper) and 10.x (Blackwell) only. Elsewhere (A100: 8.0) torch
    falls back to ``offs.cpu()`` (a device-to-host copy, a sync) and one GEMM per group
    (aten/src/ATen/native/cuda/GroupedBlas.cpp, ``_grouped_mm_cuda``: the fast path needs
    ``_scaled_mm_allowed_device(sm90_only, sm100_only)``, device major 9 or 10), which
    for a layer's six grouped GEMMs is six host reads where the per-expert loop makes
    one."""
    major, minor = capability
    return major == 10 or (major, minor) == (9, 0)


@lru_cache(maxsize=16)
def _device_capability(index: int) -> tuple[int, int]:
    """CUDA device ``index``'s compute capability, read once (a host-side query of the
    device's properties, no sync) and cached."""
    return tuple(torch.cuda.get_device_capability(index))


def cuda_capability(device: torch.device | str) -> tuple[int, int]:
    """The compute capability the grouped-GEMM choice plans for on CUDA ``device``: the
    GPU's own (cached per device), or, where there is no GPU (a dry run's fake CUDA
    tensors), the dry run's planned target, ``runtime.cuda_rules.PLANNED_CAPABILITY``
    (a Hopper-class GPU unless set otherwise: set it to plan for another GPU)."""
    if not torch.cuda.is_available():
        from gridtrain.runtime import cuda_rules  # the dry run's planned GPU
        return tuple(cuda_rules.PLANNED_CAPABILITY)
    index = torch.device(device).index
    return _device_capability(torch.cuda.current_device() if index is None else index)


def grouped_gemm_fits(dtype: torch.dtype, device: torch.device | str, *widths: int) -> bool:
    """Whether the local experts run as ``torch._grouped_mm`` on rows of ``dtype`` on
    ``device`` whose widths are ``widths``: fp32 or bf16 on CPU, bf16 on CUDA (the CUDA
    kernel, and torch's meta function that the dry run runs, take nothing else) and there
    only on a GPU where torch runs it as a grouped kernel (:func:`grouped_gemm_fast_on`;
    elsewhere the per-expert loop, with its one host read per layer and micro-batch, is
    the faster path), never fp64 (the per-expert loop stays its path, and the parity
    reference); every row stride a multiple of 16 bytes, as the op requires. Decided
    from the dtype, the device and the shapes alone: no device data is read."""
    device = torch.device(device)
    return hasattr(torch, "_grouped_mm") and dtype in GROUPED_DTYPES.get(device.type, ()) and \
        all(w * dtype.itemsize % 16 == 0 for w in widths) and \
        (device.type != "cuda" or grouped_gemm_fast_on(cuda_capability(device)))


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of one ``torch._grouped_mm`` (``torch.utils.flop_counter`` has no formula for
    it): ``2 M K N`` over the groups, whichever operand the groups cut: rows [M, K] by
    per-group [G, K, N] (forward, input gradient), or [N, M] by [M, K] cut along M into
    [G, N, K] (weight gradient); a batch of G products when both are 3-d."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 2:
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]


if hasattr(torch.ops.aten, "_grouped_mm"):
    from torch.utils import flop_counter as _flop_counter

    if torch.ops.aten._grouped_mm not in _flop_counter.flop_registry:
        _flop_counter.register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` (outside autograd: models/moe.py's experts
    hold its backward): rows ``a`` [M, K] sorted by group times each group's own ``b``
    [G, K, N]; or ``a`` [N, M] times ``b`` [M, K] cut along M at the offsets, [G, N, K].
    Where a dry run's fake tensors hold a dtype torch's meta function refuses (it takes
    bf16 only, CUDA's rule; fp32 runs on CPU), an empty result of the right shape."""
    if a.dtype != torch.bfloat16 and is_fake(a):
        shape = (a.shape[0], b.shape[-1]) if b.dim() == 3 else (offs.shape[0], a.shape[0], b.shape[1])
        return a.new_empty(shape)
    return torch._grouped_mm(a, b, offs=offs)


def group_offsets(sizes: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """``torch._grouped_mm``'s ``offs``: each group's end row, int32, on the device (no
    host read). ``rows``: the last group ends there whatever ``sizes`` say (rows past the
    kept ones run through the last group, their results weighted zero)."""
    offs = torch.cumsum(sizes, 0).to(torch.int32)
    if rows is not None and offs.numel():
        offs[-1] = rows
    return offs


def start_counts_exchange(counts: torch.Tensor, ep: ExpertParallel) -> "Pending | None":
    """Start sending every ep peer how many rows this rank has for each of its experts
    (``counts`` [E], rank-major); the wait gives ``ep x E/ep`` counts: what each peer
    sends to each of this rank's experts (flat, peer-major). Started as soon as the counts
    exist, so that it travels while the rows are gathered (None with one rank: nothing to
    exchange)."""
    if ep.size == 1:
        return None
    per = counts.numel() // ep.size
    return ep.comm.start_all_to_all(counts, [per] * ep.size, [per] * ep.size)


def dispatch_combine(tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, n_experts: int,
                     ep: ExpertParallel, run_expert,
                     kept: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                     run_grouped=None, exchange=None, dropless: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, int | torch.Tensor]:
    """The routed experts' weighted sum for every token (``tokens`` [N, d], ``chosen`` and
    ``weights`` [N, k]). ``run_grouped(rows, offs)`` runs every local expert at once on
    ``rows`` sorted expert-major (``offs``: :func:`group_offsets`), by grouped GEMMs;
    without it ``run_expert(e, rows)`` runs local expert ``e`` (global id), one at a time.
    ``kept``: capacity's (order, counts) from :func:`capacity_order` (the kept
    assignments first; ``dropless``: it kept them all); default every assignment
    (:func:`permutation`). ``exchange``: :func:`start_counts_exchange` of the kept
    counts, if the caller started it already.
    Returns (output [N, d], this rank's counts per expert [E], the rows its experts ran:
    an int, or a device tensor where knowing it would need a host read)."""
    n, k = chosen.shape
    order, counts = kept if kept is not None else permutation(chosen, n_experts)
    local = ep.local_experts(n_experts)
    per = len(local)
    if ep.size == 1:
        if run_grouped is not None:  # no host read: the grouped GEMM takes the offsets on the device
            rows = permute(tokens, order, k)
            if kept is None or dropless:
                return unpermute(run_grouped(rows, group_offsets(counts)), order, weights, k, n), counts, n * k
            kept_rows = counts.sum()  # the dropped rows run through the last expert, weighted zero
            keep = torch.arange(n * k, device=tokens.device) < kept_rows
            out = run_grouped(rows, group_offsets(counts, n * k))
            return unpermute(out, order, weights, k, n, keep), counts, kept_rows
        sizes = host_sync.read("moe_routing", counts, lambda t: t.tolist(), stand_in=lambda: _uniform(n * k, n_experts))
        order = order[:sum(sizes)]
        outs = [run_expert(e, part) for e, part in zip(local, permute(tokens, order, k).split(sizes))]
        return unpermute(torch.cat(outs), order, weights, k, n), counts, sum(sizes)
    # how many rows each peer sends to each of my experts (ep x E/ep, peer-major), travelling
    # while the rows are gathered (every assignment's; the dropped ones are cut off after)
    exchange = start_counts_exchange(counts, ep) if exchange is None else exchange
    rows = permute(tokens, order, k)
    received = exchange.wait()
    # the one host read of the layer: the exchange's splits
    both = host_sync.read("moe_routing", torch.cat([counts, received]), lambda t: t.tolist(),
                          stand_in=lambda: _uniform(n * k, n_experts) * 2)
    mine, theirs = both[:n_experts], both[n_experts:]
    order, rows = order[:sum(mine)], rows[:sum(mine)]
    send = [sum(mine[r * per:(r + 1) * per]) for r in range(ep.size)]
    recv = [sum(theirs[r * per:(r + 1) * per]) for r in range(ep.size)]
    arrived = all_to_all(rows, ep.comm, send, recv)  # source-major, expert-major within a source
    # regroup expert-major (each expert's rows from every source, in source order): a
    # stable sort of the arrived rows by their local expert, made on the device
    experts_of = torch.arange(per, device=tokens.device).repeat(ep.size)
    expert_of_row = torch.repeat_interleave(experts_of, received.reshape(-1), output_size=sum(recv))
    regroup = torch.argsort(expert_of_row, stable=True)
    grouped = arrived.index_select(0, regroup)
    if run_grouped is not None:
        outs = run_grouped(grouped, group_offsets(received.view(ep.size, per).sum(0)))
    else:
        sizes = [sum(theirs[r * per + j] for r in range(ep.size)) for j in range(per)]
        outs = torch.cat([run_expert(e, part) for e, part in zip(local, grouped.split(sizes))])
    back = torch.empty_like(outs).index_copy(0, regroup, outs)  # source-major again
    returned = all_to_all(back, ep.comm, recv, send)
    return unpermute(returned, order, weights, k, n), counts, sum(recv)


# ---- capacity -------------------------------------------------------------------------------------

def token_runs(keys: list[int], most: int) -> tuple[list[int], list[int]]:
    """This rank's tokens cut into runs of consecutive keys (a sample's positions, broken
    at its cp chunks): (each token's run, each run's first key, ``most`` of them, padded
    with a key past every token). The plain-integer reference of :func:`run_tensors`."""
    runs, starts = [], []
    for i, key in enumerate(keys):
        if i == 0 or key != keys[i - 1] + 1:
            starts.append(key)
        runs.append(len(starts) - 1)
    if len(starts) > most:
        raise ValueError(f"{len(starts)} runs of tokens, more than the {most} expected")
    return runs, starts + [2 ** 63 - 1] * (most - len(starts))


def run_tensors(keys: torch.Tensor, most: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_runs` on the device: a run starts where a key does not follow its
    predecessor; each token's run is the running count of starts, each run's first key
    its smallest (a ``scatter_reduce``), the ``most`` slots padded with a key past every
    token. The layout bounds the runs (a sample's positions, at most two cp chunks of
    it), so ``most`` is never exceeded and nothing is read back to check it."""
    starts_here = torch.ones_like(keys, dtype=torch.bool)
    starts_here[1:] = keys[1:] != keys[:-1] + 1
    run = torch.cumsum(starts_here, 0) - 1
    firsts = torch.full((most,), 2 ** 63 - 1, dtype=torch.int64, device=keys.device)
    return run, firsts.scatter_reduce(0, run, keys, "amin")


def capacity_order(chosen: torch.Tensor, n_experts: int, factor: float, ep: ExpertParallel,
                   keys: list[int] | torch.Tensor, most_runs: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert capacity, the same tokens dropped on every layout: each expert takes at most
    ``C = ceil(factor x N x k / E)`` assignments of the global micro-batch (``N`` tokens),
    the first ones in token order (``keys``: sample, then true position; ExpertParallel.
    token_key_tensor, or the plain integers of token_keys). Each rank's tokens form runs
    of consecutive keys; the runs' first keys and per-expert counts are all-gathered over
    the ranks holding the micro-batch, so each rank knows how many assignments to each
    expert come before each of its runs. All of it tensor arithmetic on the device: no
    loop over tokens, no host read (the kept counts stay on the device too).

    Returns (order, kept counts [E], C, counts before dropping [E]): ``order`` lists the
    kept assignments sorted by expert (token order within one), then the dropped ones."""
    n, k = chosen.shape
    device = chosen.device
    order, counts = permutation(chosen, n_experts)
    if not isinstance(keys, torch.Tensor):
        keys = torch.tensor(keys, dtype=torch.int64, device=device)
    run_of_token, starts = run_tensors(keys, most_runs)
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
    coefficient; 1.0 is perfect balance), the assignments capacity dropped, DeepSeek-V3's
    sequence-wise balance loss (mean over the global micro-batches' sequences, without
    the coefficient; 0 when off) and the expert bias the step routed with (None without
    one)."""

    tokens_per_expert: list[int]
    aux_loss: float
    dropped: int = 0
    seq_aux_loss: float = 0.0
    expert_bias: list[float] | None = None

    @property
    def max_load(self) -> float:
        """The busiest expert's assignments over the mean (1.0: perfectly even)."""
        mean = sum(self.tokens_per_expert) / max(1, len(self.tokens_per_expert))
        return max(self.tokens_per_expert) / mean if mean else 0.0

    def as_json(self) -> dict:
        row = {"tokens_per_expert": self.tokens_per_expert, "max_load": self.max_load, "aux_loss": self.aux_loss,
               "dropped": self.dropped}
        if self.seq_aux_loss:
            row["seq_aux_loss"] = self.seq_aux_loss
        if self.expert_bias is not None:
            row["expert_bias"] = self.expert_bias
        return row


def step_routing(log: RoutingLog, moe_layers: list[int], n_experts: int, pp: CommGroup,
                 device: torch.device, token_groups: tuple[CommGroup, ...] = ()) -> dict[int, LayerRouting]:
    """Every MoE layer's routing this step, the same on every rank: each stage fills the
    rows of its own layers (their counts are global already; the sequence-wise loss's
    shares are summed over ``token_groups`` first, where any layer has them), one
    all-reduce over the pipeline brings them together, one host read
    (``moe_routing_stats``). A row: the counts, the load-balancing loss, the drops, the
    sequence-wise loss, whether the layer has an expert bias, the bias."""
    if not moe_layers:
        return {}
    e = n_experts
    rows = torch.zeros(len(moe_layers), 2 * e + 4, dtype=torch.float64, device=device)
    for i, layer in enumerate(moe_layers):
        s = log.layers.get(layer)
        if s is not None:
            rows[i, :e] = s.counts
            rows[i, e] = s.aux / max(1, s.micro_batches)
            rows[i, e + 1] = s.dropped
            if s.seq_aux is not None:
                rows[i, e + 2] = s.seq_aux / max(1, s.micro_batches)
            if s.bias is not None:
                rows[i, e + 3] = 1.0
                rows[i, e + 4:] = s.bias
    if any(s.seq_aux is not None for s in log.layers.values()):  # the same on every rank of a stage
        rows[:, e + 2] = _start_sum(rows[:, e + 2].contiguous(), token_groups)()
    pp.all_reduce(rows)
    table = host_sync.read("moe_routing_stats", rows, lambda t: t.tolist(),
                           stand_in=lambda: [[1.0] * e + [1.0, 0.0, 0.0, 0.0] + [0.0] * e] * len(moe_layers))
    return {layer: LayerRouting([int(c) for c in row[:e]], row[e], int(row[e + 1]), row[e + 2],
                                row[e + 4:] if row[e + 3] else None)
            for layer, row in zip(moe_layers, table)}
