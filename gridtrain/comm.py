"""Collectives for model parallelism, as autograd functions in conjugate pairs, with byte counts.

Tensor parallelism moves activations between the ranks of a TP group inside the
forward pass, and the backward pass must move their gradients the opposite way:

    copy_to_tp          forward: identity            backward: all-reduce
    reduce_from_tp      forward: all-reduce          backward: identity
    split_last_dim      forward: keep own slice      backward: all-gather last dim
    gather_last_dim     forward: all-gather last dim backward: keep own slice
    scatter_to_seq      forward: keep own seq slice  backward: all-gather sequence
    gather_from_seq     forward: all-gather sequence backward: reduce-scatter sequence
    reduce_scatter_seq  forward: reduce-scatter seq  backward: all-gather sequence

Activations are ``[batch, seq, hidden]``; the sequence dimension is 1.

Every collective records the bytes of its payload in the group's :class:`ByteCounter`,
by kind and group: the full tensor being all-reduced, the gathered output of an
all-gather, the unreduced input of a reduce-scatter, the broadcast tensor. That is the
volume the textbook formulas count (a ring moves 2(n-1)/n of it per rank for an
all-reduce, (n-1)/n for the others), so tests compare it with closed forms.

Every collective is also recorded in the process's flight recorder (watchdog.py): when it
was issued, when the rank began to wait for it and when it returned, with its group's
global ranks and a per-group sequence number, so that a hung job can say which rank
never arrived. A recorded op costs a few ``perf_counter`` calls and a deque append.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gridtrain.watchdog import FlightRecorder, process_recorder


class ByteCounter:
    """Payload bytes per (kind, group name); read by tests, benchmarks and the summary."""

    def __init__(self) -> None:
        self.bytes: Counter[tuple[str, str]] = Counter()
        self.calls: Counter[tuple[str, str]] = Counter()

    def add(self, kind: str, group: str, tensor: torch.Tensor, copies: int = 1) -> None:
        self.bytes[(kind, group)] += copies * tensor.numel() * tensor.element_size()
        self.calls[(kind, group)] += 1

    def total(self, kind: str | None = None, group: str | None = None) -> int:
        return sum(n for (k, g), n in self.bytes.items()
                   if (kind is None or k == kind) and (group is None or g == group))

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


@dataclass
class CommGroup:
    """A process group with its name, this rank's index in it, and the byte counter.

    ``group=None`` with size 1 stands for "no parallelism": every collective is then the
    identity and nothing is counted or recorded, so layers need no special case for one
    rank. ``ranks`` are the group's global ranks (for the hang report); ``recorder`` is
    the process's flight recorder unless a test gives its own.
    """

    name: str
    group: dist.ProcessGroup | None = None
    size: int = 1
    rank: int = 0
    counter: ByteCounter = field(default_factory=ByteCounter)
    recorder: FlightRecorder = field(default_factory=process_recorder)
    ranks: tuple[int, ...] = ()

    @classmethod
    def of(cls, name: str, group: dist.ProcessGroup, counter: ByteCounter,
           recorder: FlightRecorder | None = None) -> "CommGroup":
        return cls(name, group, dist.get_world_size(group), dist.get_rank(group), counter,
                   recorder if recorder is not None else process_recorder(),
                   tuple(dist.get_process_group_ranks(group)))

    def global_rank(self, index: int) -> int:
        return dist.get_global_rank(self.group, index)

    def record(self, kind: str, tensor: torch.Tensor | None, nbytes: int):
        """Record a blocking collective about to be issued; pass the result to ``done``."""
        return self.recorder.blocking(kind, self.name, self.ranks, tensor, nbytes)

    def done(self, rec, tensor: torch.Tensor | None = None) -> None:
        """The collective returned (or raised: a failed op is not a hang)."""
        self.recorder.done(rec, tensor)

    # ---- plain (non-autograd) collectives, counted and recorded ---------------------

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1:
            self.counter.add("all_reduce", self.name, tensor)
            rec = self.record("all_reduce", tensor, _nbytes(tensor))
            try:
                dist.all_reduce(tensor, op=op, group=self.group)
            finally:
                self.done(rec, tensor)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src_index: int = 0) -> torch.Tensor:
        if self.size > 1:
            self.counter.add("broadcast", self.name, tensor)
            rec = self.record("broadcast", tensor, _nbytes(tensor))
            try:
                dist.broadcast(tensor, src=self.global_rank(src_index), group=self.group)
            finally:
                self.done(rec, tensor)
        return tensor

    def all_gather_list(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor``, in rank order."""
        if self.size == 1:
            return [tensor]
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        rec = self.record("all_gather", tensor, _nbytes(tensor) * self.size)
        try:
            dist.all_gather(parts, tensor, group=self.group)
        finally:
            self.done(rec, tensor)
        self.counter.add("all_gather", self.name, tensor, copies=self.size)
        return parts

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` (rank order)."""
        return torch.cat(self.all_gather_list(tensor), dim=dim) if self.size > 1 else tensor

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum over ranks, keep this rank's slice of ``dim``."""
        if self.size == 1:
            return tensor
        self.counter.add("reduce_scatter", self.name, tensor)
        parts = [p.contiguous() for p in tensor.chunk(self.size, dim=dim)]
        out = torch.empty_like(parts[self.rank])
        rec = self.record("reduce_scatter", tensor, _nbytes(tensor))
        try:
            dist.reduce_scatter(out, parts, group=self.group)
        finally:
            self.done(rec, tensor)
        return out

    def own_slice(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return tensor
        return tensor.chunk(self.size, dim=dim)[self.rank].contiguous()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def single(name: str = "single") -> CommGroup:
    """The one-rank group: collectives are identities."""
    return CommGroup(name)


# ---- autograd mappings --------------------------------------------------------------

def _mapping(name: str, forward, backward):
    """An autograd function doing ``forward(comm, x)`` and, for the gradient,
    ``backward(comm, grad)``; the identity (no function at all) on a one-rank group."""

    class Mapping(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, comm):
            ctx.comm = comm
            return forward(comm, x)

        @staticmethod
        def backward(ctx, grad):
            return backward(ctx.comm, grad), None

    Mapping.__name__ = Mapping.__qualname__ = name

    def apply(x: torch.Tensor, comm: CommGroup) -> torch.Tensor:
        return x if comm.size == 1 else Mapping.apply(x, comm)

    apply.__name__ = name
    return apply


def _identity(comm: CommGroup, x: torch.Tensor) -> torch.Tensor:
    return x.view_as(x)


def _sum(comm: CommGroup, x: torch.Tensor) -> torch.Tensor:
    return comm.all_reduce(x.contiguous().clone())  # a fresh buffer: autograd may hold x


# name                  forward                                   backward
copy_to_tp = _mapping("copy_to_tp", _identity, _sum)
reduce_from_tp = _mapping("reduce_from_tp", _sum, lambda c, g: g)
split_last_dim = _mapping("split_last_dim", lambda c, x: c.own_slice(x, -1), lambda c, g: c.all_gather(g, -1))
gather_last_dim = _mapping("gather_last_dim", lambda c, x: c.all_gather(x, -1), lambda c, g: c.own_slice(g, -1))
scatter_to_seq = _mapping("scatter_to_seq", lambda c, x: c.own_slice(x, 1), lambda c, g: c.all_gather(g, 1))
gather_from_seq = _mapping("gather_from_seq", lambda c, x: c.all_gather(x, 1), lambda c, g: c.reduce_scatter(g, 1))
reduce_scatter_seq = _mapping("reduce_scatter_seq", lambda c, x: c.reduce_scatter(x, 1), lambda c, g: c.all_gather(g, 1))
