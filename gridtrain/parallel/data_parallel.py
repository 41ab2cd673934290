"""Data parallelism: gradients averaged over the DP group, overlapped with backward.

The reducer is the one PyTorch DDP describes (Li et al., 2020), built to compose with
pipeline micro-batches and tensor parallelism:

* every parameter's gradient lives in one contiguous buffer (``param.main_grad`` is a
  view into it), in fp32 for 16-bit parameters, so accumulation over micro-batches never
  loses precision;
* the buffer is cut into buckets of about ``--bucket-mb`` in *reverse registration
  order*, roughly the order in which backward produces gradients;
* autograd accumulates each new gradient straight into the buffer: ``param.grad`` *is*
  the parameter's view of it (DDP's ``gradient_as_bucket_view``), so nothing is copied
  per micro-batch. Where that cannot be (16-bit parameters with an fp32 buffer; a split
  backward, whose deferred weight gradients the hook must tell apart) a hook on each
  parameter moves each new gradient into the buffer instead. When a parameter
  has received all of its step's contributions (one per micro-batch through its chunk,
  whatever the schedule: the last B, or the last W of a split backward), it is ready,
  and a bucket whose parameters are all ready starts its asynchronous all-reduce at
  once, while backward goes on. Earlier micro-batches never trigger a reduction: that is
  DDP's ``no_sync`` without a context manager to forget;
* :meth:`finish` (the schedule's ALLREDUCE_GRADS) launches what never became ready
  (parameters that got no gradient this step take part with zeros), waits for all
  buckets and divides by the DP size.

With ZeRO-1 (``shard=True``) a ready bucket is reduce-scattered instead, the same way:
each DP rank owns the r-th 1/dp slice *of every bucket* (Megatron's distributed-optimizer
layout), so a bucket's reduce-scatter delivers exactly the part of it that this rank's
optimizer updates, in place: into the rank's own slice of the bucket in the buffer
(:attr:`GradientReducer.shard_views`; the rank's slices, bucket after bucket, are its
shard). No second gradient copy exists: a rank holds the buffer's 4 bytes per
parameter (8 in fp64) and nothing per shard, as Megatron's distributed optimizer does;
the rest of the buffer holds unreduced partial sums after the step's reductions, read
by no one. For that every bucket's size is a multiple of dp: bucket boundaries fall
on multiples of dp, inside a parameter if need be, and only the buffer's end is padded
(the same ``ceil(n / dp) * dp`` elements as one whole-buffer reduce-scatter). A parameter
listed in ``alone`` (the tied embedding on a pipeline's first and last stage, whose two
copies are summed slice by slice after the reduce-scatter) gets a bucket and padding of
its own, so that this rank's slice of it is the same elements on both stages.

It also measures how much of the reduction time was hidden behind backward.

Each bucket's collective is recorded in the flight recorder (watchdog.py) when it is
launched, and its wait when :meth:`GradientReducer.finish` blocks on it: the watchdog
counts a hang from that wait, never from the launch (a bucket is legitimately in flight
for the rest of backward).
"""

from __future__ import annotations

import weakref
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import nn

from gridtrain.parallel.comm import CommGroup, Pending
from gridtrain.runtime.timing import Clock, HostClock, Mark, clock_for


def broadcast_parameters(model: nn.Module, dp: CommGroup, experts: CommGroup | None = None) -> None:
    """Make every DP replica start from the DP group's first rank's weights; a rank's
    experts (which differ across the expert-parallel group) from the first rank of
    ``experts``, the ranks holding the same ones."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            group = experts if experts is not None and getattr(tensor, "expert", False) else dp
            if group.size > 1:
                group.broadcast(tensor)


@dataclass
class Bucket:
    """Elements ``start:end`` of the buffer and the parameters with elements there. Under
    ZeRO-1 this rank's slice of it is elements ``at:at + (end - start) // dp`` of the
    rank's shard."""

    params: list[nn.Parameter]
    start: int
    end: int
    at: int = 0
    ready: int = 0
    group: CommGroup | None = None  # whose members sum it: the reducer's, or the experts' (set by the reducer)
    pending: Pending | None = None  # its collective, once launched (comm.py)
    launched_at: Mark = None  # clock marks (timing.py)
    done_at: Mark = None


@dataclass(frozen=True)
class Piece:
    """The part of one parameter in this rank's shard: elements ``lo:hi`` of the flattened
    parameter are elements ``at:at + hi - lo`` of the shard (the reducer's
    ``shard_views`` concatenated; the optimizer's flat master weights and moments use the
    same positions)."""

    param: nn.Parameter
    lo: int
    hi: int
    at: int

    @property
    def end(self) -> int:
        return self.at + self.hi - self.lo


def bucket_bounds(numels: list[int], cap: float, *, multiple: int = 1, alone: Collection[int] = (),
                  units: list[int] | None = None) -> tuple[list[int], list[tuple[int, int]], int]:
    """The buffer's layout as pure arithmetic: each parameter's offset (``numels`` in
    buffer order), the buckets' ``(start, end)``, and the padded size.

    Consecutive parameters fill a bucket until it holds at least ``cap`` elements (the
    parameter that fills it closes it, as in DDP, so small biases do not get buckets of
    their own). With ``multiple`` > 1 (ZeRO-1: dp) a bucket ends at the next multiple of
    it, inside the following parameter if need be, and the buffer's end is padded to a
    multiple. The parameters at the indices in ``alone`` come last, each in a bucket of
    its own that starts on a multiple and is padded to one. With ``units`` (a unit id per
    parameter: ZeRO-3's blocks) a bucket also ends, padded, wherever the unit changes, and
    no parameter crosses a bucket boundary."""
    def up(x: int) -> int:
        return -(-x // multiple) * multiple

    alone = set(alone)
    offsets, bounds = [0] * len(numels), []
    offset = start = 0  # the next parameter's offset; the open bucket's start
    previous = None  # the unit of the parameter before
    for i in [i for i in range(len(numels)) if i not in alone] + sorted(alone):
        new_unit = units is not None and previous is not None and units[i] != previous
        if (i in alone or new_unit) and up(offset) > start:  # close the open bucket, pad to a multiple
            bounds.append((start, up(offset)))
            start = up(offset)
        previous = units[i] if units is not None else None
        offset = max(offset, start) if (i in alone or units is not None) else offset
        offsets[i] = offset
        offset += numels[i]
        if i in alone or offset - start >= cap:
            bounds.append((start, up(offset)))
            start = up(offset)
    if up(offset) > start:
        bounds.append((start, up(offset)))
    return offsets, bounds, max(start, up(offset))


@dataclass
class OverlapStats:
    """Seconds of all-reduce in flight, and how many of them passed before the step
    started waiting (hidden behind backward) rather than while it waited (exposed).

    Kept as clock marks per bucket (launch, done, start of the wait) and turned into
    seconds when read. On the host clock "done" is when polling first saw the bucket
    complete; on a GPU it is an event recorded after the bucket's wait, which completes
    when both the all-reduce and the backward queued before it have: a bucket that
    finished during backward then counts as in flight until backward's end, all of it
    hidden (the hidden fraction stays right; the in-flight seconds are an upper bound)."""

    clock: Clock = field(default_factory=HostClock)
    buckets: list[tuple[Mark, Mark, Mark]] = field(default_factory=list)  # (launched, done, waiting from)
    unused: list[str] = field(default_factory=list)  # parameters that got no gradient

    @property
    def in_flight_s(self) -> float:
        return sum(self.clock.seconds(launched, done) for launched, done, _ in self.buckets)

    @property
    def hidden_s(self) -> float:
        return sum(max(0.0, min(self.clock.seconds(launched, done), self.clock.seconds(launched, waiting)))
                   for launched, done, waiting in self.buckets)

    @property
    def fraction(self) -> float:
        in_flight = self.in_flight_s
        return self.hidden_s / in_flight if in_flight > 0 else 0.0


class GradientReducer:
    """See the module docstring. With ``shard=True`` (ZeRO-1) the buckets are
    reduce-scattered: each DP rank receives the average of its own 1/dp slice of every
    bucket in that slice of the buffer (:attr:`shard_views`), which is all its optimizer
    shard needs; :attr:`pieces` says which parameter elements those are.

    The buffer lives on ``device``: by default the DP group's device (the rank's device,
    set by ``setup_distributed``), else the parameters' device. It must not be inferred
    from the parameters alone: a pipeline stage may hold none (``--pp-layers 1,3,0,4``)
    and still takes part in the DP group's collectives, and a CPU buffer there is refused
    by NCCL.
    """

    def __init__(self, model: nn.Module, dp: CommGroup, *, accumulations: int, bucket_mb: float = 25.0,
                 grad_dtype: torch.dtype | None = None, shard: bool = False,
                 device: torch.device | str | None = None, in_place: bool = True,
                 alone: Collection[nn.Parameter] = (), units: dict[nn.Parameter, int] | None = None,
                 replicas: CommGroup | None = None, experts: CommGroup | None = None,
                 param_buffer: bool = False, direct: bool = False):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # nothing to reduce and an optimizer that reads ``.grad`` (one process, torch's
        # AdamW): autograd's own gradients, no buffer (the first micro-batch's gradient
        # is taken as it is, later ones added: a plain loop's kernels)
        self.direct = direct and dp.size == 1 and not shard and replicas is None and experts in (None, dp)
        self.names = {p: n for n, p in named}
        self.dp, self.accumulations, self.shard = dp, accumulations, shard
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        # expert parallelism: a rank's experts are summed over the ranks holding the same
        # experts (a part of dp x cp), in buckets of their own (see group_of)
        self.experts = experts if experts is not None and experts is not dp else None
        self.params = params = _unit_order(_gradient_order([p for _, p in named]), units)
        dtype = grad_dtype or _grad_dtype(params)
        device = _buffer_device(device, dp, params)
        element = torch.empty((), dtype=dtype).element_size()
        alone_ids = {id(p) for p in alone}
        kinds = None if units is None and self.experts is None else \
            [(units[p] if units is not None else 0, self._is_expert(p)) for p in params]
        offsets, bounds, self.padded = bucket_bounds(
            [p.numel() for p in params], bucket_mb * 2 ** 20 / element, multiple=dp.size if shard else 1,
            alone=[i for i, p in enumerate(params) if id(p) in alone_ids], units=kinds)
        self.offsets = dict(zip(params, offsets))  # where each parameter starts in the buffer
        self.dtype, self.device = dtype, device
        self.buckets = self._make_buckets(bounds)
        self.pieces = self._pieces()
        self._pieces_of: dict[nn.Parameter, list[Piece]] = {p: [] for p in params}
        for q in self.pieces:
            self._pieces_of[q.param].append(q)
        # ZeRO-1/2: the parameters' memory laid out as the gradients' (before the gradient
        # memory exists: moving the parameters in briefly holds them twice)
        self.param_buffer: torch.Tensor | None = None
        if param_buffer:
            self.bind_parameters()
        # this rank's slice of each bucket, in shard order: where its reduce-scatter lands
        self.shard_views = self._allocate()
        self.shard_numel = sum(self.slice_size(b) for b in self.buckets) if shard else self.padded
        # parameters whose .grad is their view of the buffer (same dtype and device)
        self.in_place = {p for p in params if in_place and p.dtype == dtype and p.device == device}
        self.buckets_of: dict[nn.Parameter, list[Bucket]] = {p: [] for p in params}
        for b in self.buckets:
            for p in b.params:
                self.buckets_of[p].append(b)
        self.counts = {p: 0 for p in params}
        self.next_bucket = 0
        self.clock = clock_for(device)
        self.stats = OverlapStats(self.clock)
        hook = weak_hook(self._on_grad)
        for p in params:
            p.register_post_accumulate_grad_hook(hook)
            p.grad_ready_hook = hook  # for gradients accumulated outside autograd (ZB's W)

    def _allocate(self) -> list[torch.Tensor]:
        """The gradient buffer, each parameter's ``main_grad`` view of it, and the
        shard's views (this rank's slice of each bucket under ZeRO-1, else the buffer)."""
        if self.direct:
            self.buffer = None
            return []
        self.buffer = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.main_grad = self.buffer[self.offsets[p]: self.offsets[p] + p.numel()].view_as(p)
        return [self._own_slice(b) for b in self.buckets] if self.shard else [self.buffer]

    @torch.no_grad()
    def bind_parameters(self) -> None:
        """One flat tensor in the parameters' dtype with the gradient buffer's layout, each
        parameter's memory a view of it (Megatron's parameter buffer): under ZeRO-1/2 a
        bucket's updated slices are all-gathered straight into the parameters
        (optim/distributed_optimizer.py), with no second copy of the model."""
        dtype = self.params[0].dtype if self.params else self.dtype
        flat = torch.zeros(self.padded, dtype=dtype, device=self.device)
        for p in self.params:
            view = flat[self.offsets[p]: self.offsets[p] + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view
        self.param_buffer = flat

    def bucket_params(self, b: Bucket) -> torch.Tensor:
        """Bucket ``b``'s part of the parameter buffer (every rank's slices)."""
        return self.param_buffer[b.start:b.end]

    def slice_size(self, b: Bucket) -> int:
        """Elements of bucket ``b`` in this rank's shard: a 1/group slice when sharded."""
        return (b.end - b.start) // (b.group.size if self.shard else 1)

    def held_tensors(self) -> list[torch.Tensor]:
        """The gradient memory this reducer keeps between steps (direct: the
        parameters' ``.grad``, autograd's)."""
        return [] if self.direct else [self.buffer]

    def release(self) -> None:
        """After the optimizer step: drop gradient memory that is not kept between
        steps (none here: the buffer is; ZeRO-2/3's shards are not, fully_sharded.py)."""

    def _is_expert(self, p: nn.Parameter) -> bool:
        return self.experts is not None and getattr(p, "expert", False)

    def group_of(self, p: nn.Parameter) -> CommGroup:
        """The ranks ``p``'s gradient is summed over: the expert-data-parallel group for a
        rank's experts under expert parallelism, else the reducer's group. The sum is
        divided by the reducer's group size either way: the loss is scaled for that
        average, and an expert's gradient already holds every token that reached it from
        the whole expert-parallel group."""
        return self.experts if self._is_expert(p) else self.dp

    def _make_buckets(self, bounds: list[tuple[int, int]]) -> list[Bucket]:
        buckets, at = [], 0
        for start, end in bounds:
            inside = [p for p in self.params
                      if self.offsets[p] < end and self.offsets[p] + p.numel() > start]
            group = self.group_of(inside[0]) if inside else self.dp
            buckets.append(Bucket(inside, start, end, at, group=group))
            at += (end - start) // (group.size if self.shard else 1)
        return buckets

    def _own_slice(self, b: Bucket) -> torch.Tensor:
        size = (b.end - b.start) // b.group.size
        return self.buffer[b.start + b.group.rank * size: b.start + (b.group.rank + 1) * size]

    def shard_view(self, begin: int, end: int) -> list[torch.Tensor]:
        """Views of the buffer holding elements ``begin:end`` of this rank's shard (one
        per bucket the range crosses)."""
        views, at = [], 0
        for view in self.shard_views:
            lo, hi = max(begin, at), min(end, at + view.numel())
            if lo < hi:
                views.append(view[lo - at: hi - at])
            at += view.numel()
        return views

    def _pieces(self) -> list[Piece]:
        """The parameter elements this rank's optimizer owns, in shard order: the r-th
        1/dp slice of every bucket under ZeRO-1, else everything."""
        pieces = []
        for b in self.buckets:
            if self.shard:
                size = (b.end - b.start) // b.group.size
                lo, hi = b.start + b.group.rank * size, b.start + (b.group.rank + 1) * size
            else:
                lo, hi = b.start, b.end
            for p in b.params:
                first, last = max(lo, self.offsets[p]), min(hi, self.offsets[p] + p.numel())
                if first < last:
                    pieces.append(Piece(p, first - self.offsets[p], last - self.offsets[p], b.at + first - lo))
        return pieces

    def grad_parts(self, p: nn.Parameter) -> list[torch.Tensor]:
        """After :meth:`finish`: the tensors holding the reduced gradient of the part of
        ``p`` this rank owns (its own slices of the buckets under ZeRO-1; else the whole
        gradient in the buffer). Further sums over the grid (grads.py) act on these."""
        if self.shard:
            return [v for q in self._pieces_of.get(p, ()) for v in self.shard_view(q.at, q.end)]
        return [p.grad] if self.direct else [p.main_grad]

    # ---- during backward ------------------------------------------------------------------

    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is None:  # a backward that deferred this weight's gradient (ZB's B)
            return
        if self.direct:
            self.counts[p] += 1
            return
        if p.grad is not p.main_grad:
            p.main_grad.add_(p.grad)  # not accumulated in the buffer by autograd: move it there
            p.grad = p.main_grad if p in self.in_place else None
        self.counts[p] += 1
        if self.counts[p] == self.accumulations and self.dp.size > 1:
            for b in self.buckets_of[p]:
                b.ready += 1
            self._launch_ready()
        self._poll()

    def _launch_ready(self) -> None:
        """Launch complete buckets strictly in bucket order: collectives pair up by issue
        order, so every DP rank must issue them in the same order whatever order its
        hooks fired in."""
        while self.next_bucket < len(self.buckets):
            bucket = self.buckets[self.next_bucket]
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket)
            self.next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        """The bucket's all-reduce, or under ZeRO-1 its reduce-scatter into this rank's
        own slice of it (in place), issued without waiting."""
        view = self.buffer[bucket.start: bucket.end]
        if self.shard:
            bucket.pending = bucket.group.start_reduce_scatter(view, 0, out=self._own_slice(bucket))
        else:
            bucket.pending = bucket.group.start_all_reduce(view)
        bucket.launched_at = self.clock.mark()

    def _poll(self) -> None:
        """Note when in-flight buckets complete (for the overlap measurement). Only on
        the host clock: on a GPU, completion is an event recorded after the wait."""
        if not self.clock.on_host:
            return
        now = None
        for b in self.buckets:
            if b.pending is not None and b.done_at is None and b.pending.is_completed():
                b.done_at = now = now or self.clock.mark()

    # ---- after the last backward ------------------------------------------------------------

    def finish(self) -> None:
        """Launch what never became ready (parameters that got no gradient this step take
        part with zeros), wait for every bucket and average: the whole buffer, with
        ``param.grad`` pointed at it, or under ZeRO-1 this rank's slices of it."""
        self.stats.unused = [name for p, name in self.names.items() if self.counts[p] == 0]
        if self.direct:  # a parameter without a gradient takes part with zeros, as in the buffer
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return
        if self.dp.size > 1:
            self._poll()
            waiting_from = self.clock.mark()
            for b in self.buckets[self.next_bucket:]:
                self._launch(b)
            self.next_bucket = len(self.buckets)
            for b in self.buckets:
                b.pending.wait()
                if b.done_at is None:
                    b.done_at = self.clock.mark()
                self.stats.buckets.append((b.launched_at, b.done_at, waiting_from))
        self._average()
        if self.shard:
            return  # the whole-parameter gradients are not reduced: no .grad
        for p in self.counts:
            p.grad = p.main_grad if p.main_grad.dtype == p.dtype else None

    def _average(self) -> None:
        """Sums over the shard group done: under hybrid sharding sum this rank's shard
        over its replicas too (one all-reduce per slice, all in flight at once), then
        divide by every rank that contributed."""
        total = self.dp.size
        if self.replicas is not None:
            pending = [self.replicas.start_all_reduce(v) for v in self.shard_views if v.numel()]
            for work in pending:
                work.wait()
            total *= self.replicas.size
        if total > 1:
            torch._foreach_div_(self.shard_views, total)

    def zero(self) -> None:
        """Start a step: empty buffer, no counts, no bucket in flight."""
        if self.buffer is not None:
            self.buffer.zero_()
        for p in self.counts:
            self.counts[p] = 0
            p.grad = p.main_grad if p in self.in_place and not self.direct else None  # autograd adds into the buffer
        for b in self.buckets:
            b.ready, b.pending, b.done_at = 0, None, None
        self.next_bucket = 0
        self.stats = OverlapStats(self.clock)  # per step

    def bytes_per_step(self) -> int:
        return self.buffer.numel() * self.buffer.element_size() if self.dp.size > 1 and self.buffer is not None else 0


def _gradient_order(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """``params`` (registration order) reversed, roughly the order backward produces
    their gradients, except that each run of a layer's experts keeps its registration
    order: one expert's parameters after another's, so that the layer's gathered weights
    and gradients lie as one stacked ``[experts, ...]`` tensor for the grouped GEMMs
    (models/moe.py stacked_layout) instead of being copied into one per GEMM."""
    out: list[nn.Parameter] = []
    run: list[nn.Parameter] = []
    for p in reversed(params):
        if getattr(p, "expert", False):
            run.append(p)
            continue
        out += run[::-1] + [p]
        run = []
    return out + run[::-1]


def _unit_order(params: list[nn.Parameter], units: dict[nn.Parameter, int] | None) -> list[nn.Parameter]:
    """``params`` (gradient order) with each unit's parameters together, units in the
    order of their ids: the order in which backward completes them (ZeRO-3's
    zero3.make_units numbers them so), so that each unit's buckets are reduce-scattered
    as soon as its last gradient comes."""
    if units is None:
        return params
    order = sorted(range(len(params)), key=lambda i: (units[params[i]], i))
    return [params[i] for i in order]


def weak_hook(method):
    """A gradient hook that calls ``method`` while its object lives. Hooks live on the
    parameters, which autograd's C++ nodes also hold, so a cycle parameter -> hook ->
    reducer -> parameter is invisible to Python's collector: with a strong hook every
    finished run in a process kept its model, gradient buffer and optimizer alive (seen
    on a GPU as device memory growing by one model per ``pretrain`` call)."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        if bound is not None:
            bound(*args)

    return hook


def _buffer_device(device: torch.device | str | None, dp: CommGroup,
                   params: list[nn.Parameter]) -> torch.device:
    """Where the gradient buffer lives: the device given, else the DP group's, else the
    parameters' (CPU only when none of them says: a one-process CPU run or a test)."""
    if device is not None:
        return torch.device(device)
    if dp.device is not None:
        return dp.device
    return params[0].device if params else torch.device("cpu")


def _grad_dtype(params: list[nn.Parameter]) -> torch.dtype:
    """fp32 accumulation for 16-bit parameters; fp64 stays fp64."""
    if params and params[0].dtype == torch.float64:
        return torch.float64
    return torch.float32
