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

It also measures how much of the all-reduce time was hidden behind backward.

Each bucket's all-reduce is recorded in the flight recorder (watchdog.py) when it is
launched, and its wait when :meth:`GradientReducer.finish` blocks on it: the watchdog
counts a hang from that wait, never from the launch (a bucket is legitimately in flight
for the rest of backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from gridtrain.comm import CommGroup
from gridtrain.timing import Clock, HostClock, Mark, clock_for


def broadcast_parameters(model: nn.Module, dp: CommGroup) -> None:
    """Make every DP replica start from the DP group's first rank's weights."""
    if dp.size == 1:
        return
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dp.broadcast(tensor)


@dataclass
class Bucket:
    params: list[nn.Parameter]
    start: int
    end: int
    ready: int = 0
    work: object | None = None
    record: object | None = None  # the flight recorder's entry (watchdog.py)
    launched_at: Mark = None  # clock marks (timing.py)
    done_at: Mark = None


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
    """See the module docstring. With ``shard=True`` (ZeRO-1) the buffer is padded to a
    multiple of the DP size and :meth:`finish` reduce-scatters it instead: each DP rank
    receives the average of its own 1/dp slice (``shard_grad``), which is all its
    optimizer shard needs.

    The buffer lives on ``device``: by default the DP group's device (the rank's device,
    set by ``setup_distributed``), else the parameters' device. It must not be inferred
    from the parameters alone: a pipeline stage may hold none (``--pp-layers 1,3,0,4``)
    and still takes part in the DP group's collectives (an empty all-reduce, or ZeRO's
    reduce-scatter of padding), and a CPU buffer there is refused by NCCL.
    """

    def __init__(self, model: nn.Module, dp: CommGroup, *, accumulations: int, bucket_mb: float = 25.0,
                 grad_dtype: torch.dtype | None = None, shard: bool = False,
                 device: torch.device | str | None = None, in_place: bool = True):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = {p: n for n, p in named}
        self.dp, self.accumulations, self.shard = dp, accumulations, shard
        self.params = [p for _, p in reversed(named)]  # the buffer's order
        params = self.params
        dtype = grad_dtype or _grad_dtype(params)
        device = _buffer_device(device, dp, params)
        numel = sum(p.numel() for p in params)
        self.padded = -(-numel // dp.size) * dp.size if shard else numel
        self.buffer = torch.zeros(self.padded, dtype=dtype, device=device)
        self.shard_grad: torch.Tensor | None = None
        self.buckets = self._make_buckets(params, bucket_mb * 2 ** 20 / self.buffer.element_size())
        # parameters whose .grad is their view of the buffer (same dtype and device)
        self.in_place = {p for p in params if in_place and p.dtype == dtype and p.device == device}
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.counts = {p: 0 for p in params}
        self.next_bucket = 0
        self.clock = clock_for(device)
        self.stats = OverlapStats(self.clock)
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)
            p.grad_ready_hook = self._on_grad  # for gradients accumulated outside autograd (ZB's W)

    def _make_buckets(self, params: list[nn.Parameter], bucket_elems: float) -> list[Bucket]:
        """Consecutive parameters until a bucket reaches the cap (the parameter that
        fills it closes it, as in DDP, so small biases do not get buckets of their own)."""
        buckets, offset = [], 0
        for p in params:
            p.main_grad = self.buffer[offset: offset + p.numel()].view_as(p)
            if not buckets or buckets[-1].end - buckets[-1].start >= bucket_elems:
                buckets.append(Bucket([], offset, offset))
            buckets[-1].params.append(p)
            buckets[-1].end = offset = offset + p.numel()
        return buckets

    # ---- during backward ------------------------------------------------------------------

    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is None:  # a backward that deferred this weight's gradient (ZB's B)
            return
        if p.grad is not p.main_grad:
            p.main_grad.add_(p.grad)  # not accumulated in the buffer by autograd: move it there
            p.grad = p.main_grad if p in self.in_place else None
        self.counts[p] += 1
        if self.counts[p] == self.accumulations and self.dp.size > 1 and not self.shard:
            self.bucket_of[p].ready += 1
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
        view = self.buffer[bucket.start: bucket.end]
        self.dp.check_device("all_reduce (gradient bucket)", view)
        self.dp.counter.add("all_reduce", self.dp.name, view)
        bucket.record = self.dp.recorder.issue("all_reduce", self.dp.name, self.dp.ranks,
                                               view.numel() * view.element_size())
        bucket.work = dist.all_reduce(view, group=self.dp.group, async_op=True)
        bucket.launched_at = self.clock.mark()

    def _poll(self) -> None:
        """Note when in-flight buckets complete (for the overlap measurement). Only on
        the host clock: on a GPU, completion is an event recorded after the wait."""
        if not self.clock.on_host:
            return
        now = None
        for b in self.buckets:
            if b.work is not None and b.done_at is None and b.work.is_completed():
                b.done_at = now = now or self.clock.mark()

    # ---- after the last backward ------------------------------------------------------------

    def finish(self) -> None:
        """Wait for every bucket, average, and point ``param.grad`` at the reduced buffer
        (or, sharded, reduce-scatter the buffer into this rank's averaged slice)."""
        self.stats.unused = [name for p, name in self.names.items() if self.counts[p] == 0]
        if self.shard:
            self.shard_grad = self.dp.reduce_scatter(self.buffer, 0).div_(self.dp.size)
            return
        if self.dp.size > 1:
            self._poll()
            waiting_from = self.clock.mark()
            for b in self.buckets[self.next_bucket:]:
                self._launch(b)
            self.next_bucket = len(self.buckets)
            for b in self.buckets:
                self.dp.recorder.wait(b.record, self.buffer)
                try:
                    b.work.wait()
                finally:
                    self.dp.recorder.done(b.record, self.buffer)
                if b.done_at is None:
                    b.done_at = self.clock.mark()
                self.stats.buckets.append((b.launched_at, b.done_at, waiting_from))
            self.buffer.div_(self.dp.size)
        for p in self.counts:
            p.grad = p.main_grad if p.main_grad.dtype == p.dtype else None

    def zero(self) -> None:
        """Start a step: empty buffer, no counts, no bucket in flight."""
        self.buffer.zero_()
        for p in self.counts:
            self.counts[p] = 0
            p.grad = p.main_grad if p in self.in_place else None  # autograd adds into the buffer
        for b in self.buckets:
            b.ready, b.work, b.record, b.done_at = 0, None, None, None
        self.next_bucket = 0
        self.stats = OverlapStats(self.clock)  # per step

    def bytes_per_step(self) -> int:
        return self.buffer.numel() * self.buffer.element_size() if self.dp.size > 1 else 0


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
