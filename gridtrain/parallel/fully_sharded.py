"""Fully sharded data parallelism: ZeRO-2's gradient shards (and ZeRO-3's, with its
parameter shards in zero3.py).

ZeRO-1 (data_parallel.py) keeps one whole gradient buffer per rank, accumulates every
micro-batch into it and reduce-scatters each bucket once per step. ZeRO-2 (Rajbhandari
et al., 2020) keeps only the rank's own slices: a gradient shard of ``padded / dp``
elements, laid out exactly as ZeRO-1's (the r-th 1/dp slice of every bucket, so the
optimizer, checkpoints and the TP/tied sums of grads.py treat both alike). No whole
buffer persists; instead, each micro-batch's gradients are reduce-scattered as soon as
backward has produced them:

* autograd gives each parameter its gradient (``param.grad``); the hook adds it into a
  *staging* buffer of its bucket for the round it belongs to (the k-th gradient a
  parameter receives in a step is round k: micro-batch k's, whatever the schedule), and
  drops ``param.grad``;
* when a bucket's staging buffer of round k holds all of its parameters' gradients, its
  reduce-scatter starts, asynchronously, into this rank's slice of that buffer; when it
  completes, the slice is added to the shard and the staging buffer is freed. Round 0
  reduce-scatters straight into the shard (it starts the step at zero);
* collectives pair up by issue order, so every rank launches them in one order:
  rounds in turn, buckets in order within a round (an interleaved or zero-bubble schedule
  that finishes a later round of one chunk before an earlier round of another keeps that
  staging buffer until its turn: memory, never a reordering).

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
from gridtrain.parallel.data_parallel import Bucket, GradientReducer, _weak_hook


@dataclass
class _Staged:
    """One bucket's gradients of one round, on their way to the shard."""

    bucket: Bucket
    round: int
    tensor: torch.Tensor  # the bucket's elements (the round's local sum)
    ready: int = 0  # parameters of the bucket whose round-``round`` gradient is in
    pending: Pending | None = None


class ShardedGradientReducer(GradientReducer):
    """ZeRO-2's reducer (the module docstring): the layout of ZeRO-1's, a gradient shard
    instead of a buffer, a reduce-scatter per bucket and micro-batch.

    ``layout_units``: a unit per parameter (ZeRO-3: the block holding it); each unit's
    parameters get buckets of their own, each parameter inside one bucket."""

    def __init__(self, model: nn.Module, dp: CommGroup, *, accumulations: int, bucket_mb: float = 25.0,
                 grad_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 alone: Collection[nn.Parameter] = (), units: dict[nn.Parameter, int] | None = None,
                 replicas: CommGroup | None = None):
        self._staged: dict[tuple[int, int], _Staged] = {}  # (round, bucket index) -> staging
        self._in_flight: list[_Staged] = []
        self.next_staged = (0, 0)  # the next (round, bucket index) to launch
        self.reduce_scatters = 0  # launched this step (counted for tests and reports)
        self.after_grad: Callable[[nn.Parameter], None] | None = None  # ZeRO-3: may free the unit
        super().__init__(model, dp, accumulations=accumulations, bucket_mb=bucket_mb, grad_dtype=grad_dtype,
                         shard=True, device=device, in_place=False, alone=alone, units=units,
                         replicas=replicas)
        self._index = {id(b): i for i, b in enumerate(self.buckets)}
        sink = _weak_hook(self.accumulate)
        for p in self.params:
            p.grad_sink = sink  # deferred weight gradients come here without touching .grad

    def _allocate(self) -> list[torch.Tensor]:
        self.buffer = None  # no whole buffer: see the module docstring
        self.grad_shard = torch.zeros(self.padded // self.dp.size, dtype=self.dtype, device=self.device)
        return [self.grad_shard[b.at: b.at + (b.end - b.start) // self.dp.size] for b in self.buckets]

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
        k = self.counts[p]
        flat = grad.reshape(-1)
        for b in self.buckets_of[p]:
            staged = self._staging(k, b)
            o = self.offsets[p]
            lo, hi = max(b.start, o), min(b.end, o + p.numel())
            staged.tensor[lo - b.start: hi - b.start].add_(flat[lo - o: hi - o])
            staged.ready += 1
        self.counts[p] += 1
        self._launch_ready()
        self._fold(wait=False)
        if self.after_grad is not None:
            self.after_grad(p)

    def _staging(self, k: int, b: Bucket) -> _Staged:
        key = (k, self._index[id(b)])
        staged = self._staged.get(key)
        if staged is None:
            staged = self._staged[key] = _Staged(b, k, torch.zeros(b.end - b.start, dtype=self.dtype,
                                                                    device=self.device))
        return staged

    def _launch_ready(self, everything: bool = False) -> None:
        """Launch complete staging buffers in (round, bucket) order; ``everything``: the
        rest too (the step's end: parameters that got no gradient take part with zeros)."""
        while self.next_staged[0] < self.accumulations:
            k, i = self.next_staged
            b = self.buckets[i]
            staged = self._staged.get((k, i))
            if not everything and (staged is None or staged.ready < len(b.params)):
                return
            staged = staged or self._staging(k, b)
            self._start(staged)
            self.next_staged = (k, i + 1) if i + 1 < len(self.buckets) else (k + 1, 0)

    def _start(self, staged: _Staged) -> None:
        b = staged.bucket
        size = (b.end - b.start) // self.dp.size
        own = self.shard_views[self._index[id(b)]]
        if self.dp.size == 1:
            own.add_(staged.tensor)  # nothing to reduce: the local sum is the sum
        else:
            out = own if staged.round == 0 else staged.tensor[self.dp.rank * size: (self.dp.rank + 1) * size]
            staged.pending = self.dp.start_reduce_scatter(staged.tensor, 0, out=out)
            self.reduce_scatters += 1
            if b.launched_at is None:
                b.launched_at = self.clock.mark()
            self._in_flight.append(staged)
        del self._staged[(staged.round, self._index[id(b)])]

    def _fold(self, wait: bool) -> None:
        """Add the reduce-scatters that have completed (all of them with ``wait``) into the
        shard, freeing their staging buffers."""
        still = []
        for staged in self._in_flight:
            if not wait and not staged.pending.is_completed():
                still.append(staged)
                continue
            staged.pending.wait()
            b = staged.bucket
            if staged.round > 0:
                size = (b.end - b.start) // self.dp.size
                self.shard_views[self._index[id(b)]].add_(staged.tensor[self.dp.rank * size:
                                                                        (self.dp.rank + 1) * size])
            if b.done_at is None or staged.round == self.accumulations - 1:
                b.done_at = self.clock.mark()
        self._in_flight = still

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
        self._staged.clear()
        self._in_flight = []
        self.next_staged = (0, 0)
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
