"""Fully sharded data parallelism: ZeRO-2's gradient shards (and ZeRO-3's, with its
parameter shards in zero3.py).

ZeRO-1 (data_parallel.py) keeps one whole gradient buffer per rank, accumulates every
micro-batch into it and reduce-scatters each bucket once per step. ZeRO-2 (Rajbhandari
et al., 2020) keeps only the rank's own slices: a gradient shard of ``padded / dp``
elements, laid out exactly as ZeRO-1's (the r-th 1/dp slice of every bucket, so the
optimizer, checkpoints and the TP/tied sums of grads.py treat both alike). No whole
buffer persists; instead, each micro-batch's gradients are reduce-scattered as soon as
backward has produced them:

* autograd gives each parameter its gradient (``param.grad``); the hook takes it (and
  drops ``param.grad``) and keeps it beside its bucket until the bucket's reduce-scatter
  is due; then one concatenation writes the bucket's gradients, cast to the reduction's
  dtype, into the bucket's *staging* buffer (a kernel per bucket and micro-batch, not
  one per parameter: FSDP2's ``chunk_cat``). A gradient that comes once the staging
  buffer exists (a second one of a parameter before its bucket's turn) is added into it;
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
  gradients in B and its matrices theirs in W, later: the vectors' gradients (a few
  kilobytes) wait beside the bucket with the others, so no bucket-sized buffer waits for
  a deferred W.

**When gradient memory exists.** Only from backward to the optimizer step: a bucket's
slice of the shard is made when its first reduce-scatter is launched and every slice is
dropped after the step (:meth:`ShardedGradientReducer.release`), so the shard grows
bucket by bucket as backward completes them and nothing is held across the forward, the
part of the step where activations peak (FSDP2 likewise allocates sharded gradients in
backward and frees them at ``zero_grad``).

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
                 replicas: CommGroup | None = None, experts: CommGroup | None = None, param_buffer: bool = False):
        self._staging: dict[int, torch.Tensor] = {}  # bucket index -> gradients for its next reduce-scatter
        self._arrived: dict[int, dict[nn.Parameter, torch.Tensor]] = {}  # bucket index -> gradients awaiting staging
        self._in_flight: list[_Staged] = []
        self.next_launch = (0, 0)  # the next (round, bucket index) to launch
        self.reduce_scatters = 0  # launched this step (counted for tests and reports)
        self.after_grad: Callable[[nn.Parameter], None] | None = None  # ZeRO-3: may free the unit
        super().__init__(model, dp, accumulations=accumulations, bucket_mb=bucket_mb, grad_dtype=grad_dtype,
                         shard=True, device=device, in_place=False, alone=alone, units=units,
                         replicas=replicas, experts=experts, param_buffer=param_buffer)
        self._index = {id(b): i for i, b in enumerate(self.buckets)}
        sink = weak_hook(self.accumulate)
        for p in self.params:
            p.grad_sink = sink  # deferred weight gradients come here without touching .grad

    def _allocate(self) -> list[torch.Tensor | None]:
        """No whole buffer (the module docstring), and no gradient shard yet: a bucket's
        slice of it is made when its first reduce-scatter is launched (``_own``) and
        dropped after the optimizer step (:meth:`release`), so that a rank holds
        gradient memory only from the first bucket's reduction to the step, growing
        bucket by bucket through backward, as FSDP2 does."""
        self.buffer = None
        return [None] * len(self.buckets)

    def _own(self, i: int) -> torch.Tensor:
        """This rank's slice of bucket ``i``'s gradient, made if needed: zeros where it
        takes a local sum (a group of one); else the reduce-scatter of round 0 writes it
        whole (the round every bucket starts with)."""
        own = self.shard_views[i]
        if own is None:
            b = self.buckets[i]
            make = torch.zeros if b.group.size == 1 else torch.empty
            own = self.shard_views[i] = make(self.slice_size(b), dtype=self.dtype, device=self.device)
        return own

    def held_tensors(self) -> list[torch.Tensor]:
        """Nothing between steps: the gradient shard lives from backward to the step."""
        return []

    def release(self) -> None:
        """After the optimizer step: the gradient shard's memory back to the allocator."""
        for i in range(len(self.shard_views)):
            self.shard_views[i] = None

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
            arrived = self._arrived.setdefault(i, {})
            if i not in self._staging and p not in arrived:
                arrived[p] = flat  # staged with the bucket's others when its reduce-scatter is due
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
        """Bucket ``i``'s staging buffer, made if needed from the gradients that arrived
        for it: one concatenation (cast to the reduction's dtype) where they tile the
        bucket from its start, as its parameters do; zeros where none came."""
        staging = self._staging.get(i)
        if staging is not None:
            return staging
        b = self.buckets[i]
        staging = self._staging[i] = torch.empty(b.end - b.start, dtype=self.dtype, device=self.device)
        parts, end = [], 0
        for p, flat in sorted(self._arrived.pop(i, {}).items(), key=lambda item: self.offsets[item[0]]):
            o = self.offsets[p]
            lo, hi = max(b.start, o), min(b.end, o + flat.numel())
            parts.append((lo - b.start, flat[lo - o: hi - o]))
            end = hi - b.start
        if parts and all(start == (parts[k - 1][0] + parts[k - 1][1].numel() if k else 0)
                         for k, (start, _) in enumerate(parts)):
            torch.cat([part for _, part in parts], out=staging[:end])
            if end < staging.numel():
                staging[end:].zero_()  # the bucket's padding
        else:  # (gaps between them: parameters still to come at the step's end)
            staging.zero_()
            for start, part in parts:
                staging[start:start + part.numel()].copy_(part)
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
        own = self._own(staged.index)
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
        self.release()  # (a step that never reached the optimizer)
        self._staging.clear()
        self._arrived.clear()
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
