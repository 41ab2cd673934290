"""Fully sharded data parallelism: ZeRO-2's gradient shards (and ZeRO-3's, with its
parameter shards in zero3.py).

ZeRO-1 (data_parallel.py) keeps one whole gradient buffer per rank, accumulates every
micro-batch into it and reduce-scatters each bucket once per step. ZeRO-2 (Rajbhandari
et al., 2020) keeps only the rank's own slices: a gradient shard of ``padded / dp``
elements, laid out exactly as ZeRO-1's (the r-th 1/dp slice of every bucket, so the
optimizer, checkpoints and the TP/tied sums of grads.py treat both alike). No whole
buffer persists; instead, each micro-batch's gradients are reduce-scattered as soon as
backward has produced them:

* autograd gives each parameter its gradient (``param.grad``); the hook adds it into the
  *staging* buffer of its bucket (one per bucket, made when the bucket's first matrix
  gradient arrives) and drops ``param.grad``;
* the k-th reduce-scatter of a bucket may start once each of its parameters has
  received k gradients in the step (micro-batch k's, whatever the schedule): it runs,
  asynchronously, into this rank's slice of the staging buffer, which is then handed to
  the collective, and the next gradients start a new one. When it completes the slice is
  added to the shard and the buffer freed; the first reduce-scatter of a step lands in
  the shard itself. At most one is in flight besides the one being launched
  (``MAX_IN_FLIGHT``): staging memory stays at about two buckets;
* collectives pair up by issue order, so every rank launches them in one order:
  the k-th reduce-scatter of every bucket in bucket order, then the (k+1)-th. A bucket
  whose turn has not come keeps accumulating: a gradient belongs to whichever
  reduce-scatter of its bucket has not started yet (an interleaved schedule finishing a
  later micro-batch of one chunk first just sums it in; every gradient is in exactly one
  reduce-scatter, and each rank does the same);
* zero-bubble schedules (ZB-H1) give a block's vectors (norm gains, biases) their
  gradients in B and its matrices theirs in W, later: the vectors' gradients wait beside
  the bucket (``_early``, a few kilobytes) until its matrices open its staging buffer,
  so no bucket-sized buffer waits for a deferred W.

**What accumulation costs.** A step with m micro-batches per rank reduce-scatters every
bucket m times (m x the gradient bytes, as DeepSpeed's ZeRO-2 does by default), against
once for ZeRO-1; in exchange a rank holds ``4 / dp`` gradient bytes per parameter (8 in
fp64) plus the staging buffers in flight (a few buckets), not ``4``. With one
micro-batch per step the traffic is ZeRO-1's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from gridtrain.parallel.comm import CommGroup, Pending
from gridtrain.parallel.data_parallel import Bucket, GradientReducer, weak_hook
from gridtrain.parallel.zero3 import whole_shape


MAX_IN_FLIGHT = 1  # reduce-scatters in flight while another is launched (each holds a bucket's gradients)


@dataclass
class _Staged:
    """A bucket's gradients on their way to the shard: its ``round``-th reduce-scatter."""

    bucket: Bucket
    index: int
    round: int
    tensor: torch.Tensor
    pending: Pending | None = None


class ShardedGradientReducer(GradientReducer):
    """ZeRO-2's reducer (the module docstring): the layout of ZeRO-1's, a gradient shard
    instead of a buffer, a reduce-scatter per bucket and micro-batch.

    ``units``: a unit per parameter (ZeRO-3: the block holding it); each unit's
    parameters get buckets of their own, each parameter inside one bucket."""

    def __init__(self, model: nn.Module, dp: CommGroup, *, accumulations: int, bucket_mb: float = 25.0,
                 grad_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 alone: Collection[nn.Parameter] = (), units: dict[nn.Parameter, int] | None = None,
                 replicas: CommGroup | None = None, experts: CommGroup | None = None):
        self._staging: dict[int, torch.Tensor] = {}  # bucket index -> gradients for its next reduce-scatter
        self._early: dict[nn.Parameter, torch.Tensor] = {}  # vectors' gradients before their bucket's staging
        self._in_flight: list[_Staged] = []
        self.next_launch = (0, 0)  # the next (round, bucket index) to launch
        self.reduce_scatters = 0  # launched this step (counted for tests and reports)
        self.after_grad: Callable[[nn.Parameter], None] | None = None  # ZeRO-3: may free the unit
        super().__init__(model, dp, accumulations=accumulations, bucket_mb=bucket_mb, grad_dtype=grad_dtype,
                         shard=True, device=device, in_place=False, alone=alone, units=units,
                         replicas=replicas, experts=experts)
        self._index = {id(b): i for i, b in enumerate(self.buckets)}
        # a vector (norm gain, bias) alone in one bucket may wait in _early
        self._vector = {p for p in self.params if len(whole_shape(p)) < 2 and len(self.buckets_of[p]) == 1}
        sink = weak_hook(self.accumulate)
        for p in self.params:
            p.grad_sink = sink  # deferred weight gradients come here without touching .grad

    def _allocate(self) -> list[torch.Tensor]:
        self.buffer = None  # no whole buffer: see the module docstring
        sizes = [(b.end - b.start) // b.group.size for b in self.buckets]  # this rank's slice of each
        self.grad_shard = torch.zeros(sum(sizes), dtype=self.dtype, device=self.device)
        return [self.grad_shard[b.at: b.at + n] for b, n in zip(self.buckets, sizes)]

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.grad_shard]

    def _average(self) -> None:
        """As ZeRO-1's, with one all-reduce of the whole shard over the replicas."""
        total = self.dp.size
        if self.replicas is not None:
            self.replicas.all_reduce(self.grad_shard)
            total *= self.replicas.size
        if total > 1:
            self.grad_shard.div_(total)

    # ---- during backward ------------------------------------------------------------------

    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is None:  # a backward that deferred this weight's gradient (ZB's B)
            return
        grad, p.grad = p.grad, None
        self.accumulate(p, grad)

    def accumulate(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Take ``grad``, the next gradient of ``p`` (from autograd's hook, or straight
        from a deferred weight gradient: split_backward.py)."""
        flat = grad.reshape(-1)
        for b in self.buckets_of[p]:
            i = self._index[id(b)]
            if p in self._vector and i not in self._staging:
                early = self._early.get(p)
                self._early[p] = flat.to(self.dtype, copy=True) if early is None else early.add_(flat)
                continue
            o = self.offsets[p]
            lo, hi = max(b.start, o), min(b.end, o + flat.numel())
            self._staging_of(i)[lo - b.start: hi - b.start].add_(flat[lo - o: hi - o])
        self.counts[p] += 1
        self._launch_ready()
        self._fold(wait=False)
        if self.after_grad is not None:
            self.after_grad(p)

    def _staging_of(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s staging buffer, made (zero, with the vectors that waited) if needed."""
        staging = self._staging.get(i)
        if staging is None:
            b = self.buckets[i]
            staging = self._staging[i] = torch.zeros(b.end - b.start, dtype=self.dtype, device=self.device)
            for p in b.params:
                early = self._early.pop(p, None)
                if early is not None:
                    o = self.offsets[p] - b.start
                    staging[o:o + early.numel()].add_(early)
        return staging

    def _launch_ready(self, everything: bool = False) -> None:
        """Launch, in (round, bucket) order, the reduce-scatters whose bucket holds enough
        gradients; ``everything``: the rest too (the step's end: parameters that got no
        gradient take part with zeros)."""
        while self.next_launch[0] < self.accumulations:
            k, i = self.next_launch
            b = self.buckets[i]
            if not everything and any(self.counts[p] <= k for p in b.params):
                return
            self._start(_Staged(b, i, k, self._staging_of(i)))
            del self._staging[i]
            self.next_launch = (k, i + 1) if i + 1 < len(self.buckets) else (k + 1, 0)

    def _start(self, staged: _Staged) -> None:
        if len(self._in_flight) >= MAX_IN_FLIGHT:  # bound the staging memory: the oldest lands first
            self._fold(wait=True, keep=MAX_IN_FLIGHT - 1)
        b = staged.bucket
        group = b.group  # the reducer's, or for a rank's experts their expert-data-parallel group
        size = (b.end - b.start) // group.size
        own = self.shard_views[staged.index]
        if group.size == 1:
            own.add_(staged.tensor)  # nothing to reduce: the local sum is the sum
            return
        out = own if staged.round == 0 else staged.tensor[group.rank * size: (group.rank + 1) * size]
        staged.pending = group.start_reduce_scatter(staged.tensor, 0, out=out)
        self.reduce_scatters += 1
        if b.launched_at is None:
            b.launched_at = self.clock.mark()
        self._in_flight.append(staged)

    def _fold(self, wait: bool, keep: int = 0) -> None:
        """Add the reduce-scatters that have completed into the shard, oldest first and
        in launch order only (the same additions in the same order every run, and round
        0, which lands in the shard itself, before anything is added to it), freeing
        their staging buffers; with ``wait``, wait for all but the newest ``keep``."""
        while self._in_flight:
            staged = self._in_flight[0]
            if not (wait and len(self._in_flight) > keep) and not staged.pending.is_completed():
                return
            staged.pending.wait()
            b = staged.bucket
            if staged.round > 0:
                size = (b.end - b.start) // b.group.size
                self.shard_views[staged.index].add_(staged.tensor[b.group.rank * size: (b.group.rank + 1) * size])
            if b.done_at is None or staged.round == self.accumulations - 1:
                b.done_at = self.clock.mark()
            self._in_flight.pop(0)

    # ---- after the last backward ----------------------------------------------------------

    def finish(self) -> None:
        """Launch what never became ready, fold every round into the shard, average."""
        self.stats.unused = [name for p, name in self.names.items() if self.counts[p] == 0]
        waiting_from = self.clock.mark()
        self._launch_ready(everything=True)
        self._fold(wait=True)
        for b in self.buckets:
            if b.launched_at is not None:
                self.stats.buckets.append((b.launched_at, b.done_at, waiting_from))
        self._average()

    def zero(self) -> None:
        self.grad_shard.zero_()
        self._staging.clear()
        self._early.clear()
        self._in_flight = []
        self.next_launch = (0, 0)
        self.reduce_scatters = 0
        for p in self.counts:
            self.counts[p] = 0
            p.grad = None
        for b in self.buckets:
            b.ready, b.pending, b.launched_at, b.done_at = 0, None, None, None
        self.next_bucket = 0
        self.stats = type(self.stats)(self.clock)

    def bytes_per_step(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.padded * element * self.accumulations if self.dp.size > 1 else 0
