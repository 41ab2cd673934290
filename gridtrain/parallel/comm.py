"""Collectives for model parallelism, as autograd functions in conjugate pairs, with byte counts.

Tensor parallelism moves activations between the ranks of a TP group inside the
forward pass, and the backward pass must move their gradients the opposite way:

    copy_to_tp          forward: identity            backward: all-reduce
    reduce_from_tp      forward: all-reduce          backward: identity
    split_last_dim      forward: keep own slice      backward: all-gather last dim
    gather_last_dim     forward: all-gather last dim backward: keep own slice
    all_to_all          forward: rows to their ranks backward: rows back (splits swapped)
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

Asynchronous collectives. ``start_all_reduce`` / ``start_all_gather`` /
``start_reduce_scatter`` issue the operation and return a :class:`Pending` at once, so
that the caller computes while it travels (the TP backward, tensor_parallel.py); the
blocking methods are ``start_*(...).wait()``, one code path for both.

Device discipline. gloo accepts a CPU tensor wherever it is handed one; NCCL does not,
and the first GPU run would find out. A group that knows its rank's device (``device``,
set by :func:`gridtrain.parallel.distributed.setup_distributed`) therefore refuses, before
issuing anything, a tensor that lives elsewhere, with an error naming the collective
and the group (:meth:`CommGroup.check_device`). The check is one device comparison, so
it stays on in every run.

Gathers and reduce-scatters use the single-tensor collectives
(``all_gather_into_tensor`` / ``reduce_scatter_tensor``, which torch 2.13 renames
``all_gather_single`` / ``reduce_scatter_single``): one output buffer instead of a
list of per-rank tensors and a ``cat`` (or ``chunk`` + per-chunk copies), which is what
NCCL implements natively. The ranks' slices must sit one after the other in memory, so
the gathered or scattered dimension is moved to the front for the transfer and back
after it; the results are exactly those of ``cat`` / ``chunk`` along ``dim``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gridtrain.runtime.watchdog import FlightRecorder, process_recorder


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
    the process's flight recorder unless a test gives its own. ``device``, when set, is
    the device every tensor handed to this group's collectives must live on (the rank's
    GPU under NCCL, the CPU under gloo); it also tells code that has no tensor of its
    own to take a device from (a pipeline stage without parameters) where to allocate
    what it hands to a collective. ``None`` (tests, the one-rank group) checks nothing.
    """

    name: str
    group: dist.ProcessGroup | None = None
    size: int = 1
    rank: int = 0
    counter: ByteCounter = field(default_factory=ByteCounter)
    recorder: FlightRecorder = field(default_factory=process_recorder)
    ranks: tuple[int, ...] = ()
    device: torch.device | None = None
    _backend: str | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, name: str, group: dist.ProcessGroup, counter: ByteCounter,
           recorder: FlightRecorder | None = None,
           device: torch.device | str | None = None) -> "CommGroup":
        return cls(name, group, dist.get_world_size(group), dist.get_rank(group), counter,
                   recorder if recorder is not None else process_recorder(),
                   tuple(dist.get_process_group_ranks(group)),
                   torch.device(device) if device is not None else None)

    @classmethod
    def alone(cls, name: str, rank: int, counter: ByteCounter, recorder: FlightRecorder | None = None,
              device: torch.device | str | None = None) -> "CommGroup":
        """Global rank ``rank``'s group of one, for which no torch group is made (at scale a
        communicator each would cost every rank a collective split, grid.py): every
        collective is the identity; the rank and device are kept for reports and for code
        that allocates on the group's device."""
        return cls(name, None, 1, 0, counter, recorder if recorder is not None else process_recorder(), (rank,),
                   torch.device(device) if device is not None else None)

    def global_rank(self, index: int) -> int:
        if self.group is None:  # one rank: itself
            return self.ranks[index] if self.ranks else index
        return dist.get_global_rank(self.group, index)

    def check_device(self, kind: str, tensor: torch.Tensor) -> None:
        """Refuse a tensor that is not on this group's device (when the group has one).

        Called before every collective this group issues (and by other modules before
        theirs: the reducer's buckets, point-to-point transfers), so that a CPU tensor
        meant for NCCL fails here, naming the call, instead of deep inside the backend
        (or, under gloo, not at all until the first GPU run).
        """
        if self.device is not None and not same_device(tensor.device, self.device):
            raise DeviceMismatch(
                f"{kind} on group {self.name!r}: the tensor ({tuple(tensor.shape)}, {tensor.dtype}) is on "
                f"{tensor.device}, but this group's device is {self.device}; allocate it on the rank's "
                "device (ctx.device, or the group's .device)")

    def record(self, kind: str, tensor: torch.Tensor | None, nbytes: int):
        """Record a blocking collective about to be issued; pass the result to ``done``."""
        return self.recorder.blocking(kind, self.name, self.ranks, tensor, nbytes)

    def done(self, rec, tensor: torch.Tensor | None = None) -> None:
        """The collective returned (or raised: a failed op is not a hang)."""
        self.recorder.done(rec, tensor)

    @property
    def backend(self) -> str:
        """The group's backend name ("gloo", "nccl", "fake", ...), looked up once."""
        if self._backend is None:
            self._backend = str(dist.get_backend(self.group))
        return self._backend

    def p2p_via_host(self, tensor: torch.Tensor) -> bool:
        """Whether a point-to-point transfer of ``tensor`` must be staged through host
        memory: gloo runs collectives on CUDA tensors (copying through the host itself)
        but its send and receive read and write the pointer they are given, so a CUDA
        tensor fails ("writev ... Bad address", seen on torch 2.11). Only runs that share
        one GPU between ranks (``--backend gloo --device cuda``) take this path."""
        return tensor.is_cuda and self.group is not None and self.backend == "gloo"

    # ---- plain (non-autograd) collectives, counted and recorded ---------------------

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        return self.start_all_reduce(tensor, op).wait()

    def start_all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> "Pending":
        """Issue an in-place all-reduce of ``tensor`` and return at once; ``wait()`` on the
        result returns ``tensor`` reduced. Work done between the two overlaps the transfer."""
        if self.size == 1:
            return Pending.ready(tensor)
        self.check_device("all_reduce", tensor)
        self.counter.add("all_reduce", self.name, tensor)
        rec = self.recorder.issue("all_reduce", self.name, self.ranks, _nbytes(tensor))
        return Pending(self, rec, tensor, lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True),
                       tensor)

    def broadcast(self, tensor: torch.Tensor, src_index: int = 0) -> torch.Tensor:
        if self.size > 1:
            self.check_device("broadcast", tensor)
            self.counter.add("broadcast", self.name, tensor)
            rec = self.record("broadcast", tensor, _nbytes(tensor))
            try:
                dist.broadcast(tensor, src=self.global_rank(src_index), group=self.group)
            finally:
                self.done(rec, tensor)
        return tensor

    def all_gather_into(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` into ``out`` (allocated by the caller, ``size`` times
        ``tensor``'s elements, contiguous), rank r's copy as the r-th consecutive block:
        one ``all_gather_into_tensor``, no per-rank tensors. Returns ``out``.

        For callers that own the output buffer (ZeRO's parameter publish gathers straight
        into a buffer of the parameters' dtype); counted and recorded as :meth:`all_gather`.
        """
        return self.start_all_gather_into(out, tensor).wait()

    def start_all_gather_into(self, out: torch.Tensor, tensor: torch.Tensor) -> "Pending":
        """:meth:`all_gather_into`, issued without waiting (see :meth:`start_all_reduce`)."""
        if self.size == 1:
            return Pending.ready(out.view(-1).copy_(tensor.reshape(-1)).view_as(out))
        self.check_device("all_gather", tensor)
        self.check_device("all_gather", out)
        tensor = tensor.contiguous()
        if out.numel() != tensor.numel() * self.size or not out.is_contiguous() or out.dtype != tensor.dtype:
            raise ValueError(f"all_gather on group {self.name!r}: the output must be contiguous, "
                             f"{tensor.dtype}, with {self.size} x {tensor.numel()} elements; got "
                             f"{tuple(out.shape)} {out.dtype}")
        self.counter.add("all_gather", self.name, tensor, copies=self.size)
        rec = self.recorder.issue("all_gather", self.name, self.ranks, _nbytes(tensor) * self.size)
        # flat views: the "concatenate along dim 0" form every backend accepts
        return Pending(self, rec, tensor,
                       lambda: _ALL_GATHER_SINGLE(out.view(-1), tensor.view(-1), group=self.group, async_op=True), out)

    def _gather_stacked(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension, ``[size, *shape]``,
        gathered into a buffer allocated once (rank r's copy is the r-th block)."""
        return self.all_gather_into(tensor.new_empty((self.size, *tensor.shape)), tensor)

    def all_gather_list(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor``, in rank order (views into one gathered buffer)."""
        if self.size == 1:
            return [tensor]
        return list(self._gather_stacked(tensor).unbind(0))

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` (rank order): the same tensor as
        ``torch.cat([rank 0's, rank 1's, ...], dim)``, from one gathered buffer.

        Along dim 0 the buffer is the result (no copy); along another dimension the
        ranks' blocks are interleaved into it with one copy, as ``cat`` would make.
        """
        return self.start_all_gather(tensor, dim).wait()

    def start_all_gather(self, tensor: torch.Tensor, dim: int) -> "Pending":
        """:meth:`all_gather`, issued without waiting (see :meth:`start_all_reduce`)."""
        if self.size == 1:
            return Pending.ready(tensor)
        stacked = self.start_all_gather_into(tensor.new_empty((self.size, *tensor.shape)), tensor)  # [size, *shape]
        dim = dim % tensor.dim()
        return stacked.then(lambda out: out.movedim(0, dim).flatten(dim, dim + 1))  # [..., size * shape[dim], ...]

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum over ranks, keep this rank's slice of ``dim``: the same tensor as
        ``sum over ranks of tensor.chunk(size, dim)[rank]``, contiguous.

        ``tensor.shape[dim]`` must divide by the group's size (every caller pads or
        validates: ZeRO's buffer is padded to a multiple of dp, sequence lengths are
        checked against tp). The slices are made consecutive blocks of one buffer
        (``dim`` split into ``(size, shape[dim] / size)``, the ``size`` part moved to the
        front: a copy unless ``dim`` is 0) and reduced with one single-tensor
        reduce-scatter (``reduce_scatter_single``, called ``reduce_scatter_tensor`` before
        torch 2.13), whose output is this rank's slice in its natural layout.

        Every backend takes the tensor form in torch 2.13, gloo included (checked on CPU:
        tests/test_devices.py compares it with the list form on fp32, fp64 and bf16). A
        backend that refuses it as unsupported (gloo in some older torch that
        pyproject.toml still allows) falls back, once and for all, to the list form
        ``reduce_scatter`` over the same blocks (:func:`_reduce_scatter_blocks`).
        """
        return self.start_reduce_scatter(tensor, dim).wait()

    def start_reduce_scatter(self, tensor: torch.Tensor, dim: int, *, out: torch.Tensor | None = None) -> "Pending":
        """:meth:`reduce_scatter`, issued without waiting (see :meth:`start_all_reduce`).
        ``out``: where this rank's slice goes (contiguous, its shape; a caller-owned
        buffer, or, in place, this rank's own block of ``tensor`` itself, as ZeRO-1's
        buckets are reduced: every backend's tensor form takes that, as NCCL defines
        it), instead of a new tensor."""
        if self.size == 1:
            return Pending.ready(tensor if out is None else out.copy_(tensor))
        self.check_device("reduce_scatter", tensor)
        dim = dim % tensor.dim()
        if tensor.shape[dim] % self.size:
            raise ValueError(f"reduce_scatter on group {self.name!r}: dimension {dim} of {tuple(tensor.shape)} "
                             f"does not divide by the group's size {self.size}")
        self.counter.add("reduce_scatter", self.name, tensor)
        blocks = tensor.unflatten(dim, (self.size, tensor.shape[dim] // self.size)).movedim(dim, 0).contiguous()
        if out is None:
            out = blocks.new_empty(blocks.shape[1:])
        elif out.shape != blocks.shape[1:] or not out.is_contiguous() or out.dtype != tensor.dtype:
            raise ValueError(f"reduce_scatter on group {self.name!r}: the output must be contiguous, "
                             f"{tensor.dtype}, of shape {tuple(blocks.shape[1:])}; got {tuple(out.shape)} {out.dtype}")
        rec = self.recorder.issue("reduce_scatter", self.name, self.ranks, _nbytes(tensor))
        return Pending(self, rec, tensor, lambda: _reduce_scatter_blocks(self, out, blocks), out)

    def start_ring_step(self, send: torch.Tensor, recv: torch.Tensor) -> "Pending":
        """One step of a ring: send ``send`` to the next member (``rank + 1``) and receive
        ``recv`` (a buffer of the same shape and dtype) from the previous one, posted as
        one ``batch_isend_irecv``; ``wait()`` returns ``recv`` filled. Counted as a
        ``send`` of ``send``'s bytes; recorded as a send and a receive with their peers.

        Every member must post its ring steps in the same order (point-to-point messages
        between two ranks are matched in the order they are posted). Under gloo on CUDA
        both are staged through host memory (:meth:`p2p_via_host`)."""
        if self.size == 1:
            return Pending.ready(recv.copy_(send))
        self.check_device("send", send)
        self.check_device("recv", recv)
        send = send.contiguous()
        self.counter.add("send", self.name, send)
        staged_send, landed = send, recv
        if self.p2p_via_host(send):
            staged_send, landed = send.cpu(), torch.empty_like(recv, device="cpu")
        to = self.global_rank((self.rank + 1) % self.size)
        frm = self.global_rank((self.rank - 1) % self.size)
        nbytes = _nbytes(send)
        recs = [self.recorder.issue("send", self.name, self.ranks, nbytes, peer=to),
                self.recorder.issue("recv", self.name, self.ranks, nbytes, peer=frm)]
        ops = [dist.P2POp(dist.isend, staged_send, to, self.group), dist.P2POp(dist.irecv, landed, frm, self.group)]
        pending = Pending(self, recs, send, lambda: dist.batch_isend_irecv(ops), recv)
        if landed is not recv:
            pending.then(lambda r: r.copy_(landed))
        return pending

    def all_to_all(self, tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Rows ``tensor[first:first + send_splits[r]]`` to member r, for every r; returns the
        rows received, ``recv_splits[r]`` of them from member r, in member order
        (``all_to_all_single`` with variable splits: expert parallelism's token dispatch).
        Counted as an ``all_to_all`` of the rows this rank sends (its own included: the
        payload the formula counts; (n-1)/n of it crosses a link when the rows spread
        evenly), recorded with the group's ranks."""
        if self.size == 1:
            return tensor
        self.check_device("all_to_all", tensor)
        tensor = tensor.contiguous()
        if sum(send_splits) != tensor.shape[0] or len(send_splits) != self.size or len(recv_splits) != self.size:
            raise ValueError(f"all_to_all on group {self.name!r}: {len(send_splits)} send splits summing to "
                             f"{sum(send_splits)} for {tuple(tensor.shape)} rows over {self.size} ranks")
        out = tensor.new_empty((sum(recv_splits), *tensor.shape[1:]))
        self.counter.add("all_to_all", self.name, tensor)
        rec = self.record("all_to_all", tensor, _nbytes(tensor))
        try:
            dist.all_to_all_single(out, tensor, output_split_sizes=list(recv_splits),
                                   input_split_sizes=list(send_splits), group=self.group)
        finally:
            self.done(rec, tensor)
        return out

    def start_all_to_all(self, tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> "Pending":
        """:meth:`all_to_all`, issued without waiting (see :meth:`start_all_reduce`): MoE
        layers start their routing counts' exchange before gathering the rows."""
        if self.size == 1:
            return Pending.ready(tensor)
        self.check_device("all_to_all", tensor)
        tensor = tensor.contiguous()
        out = tensor.new_empty((sum(recv_splits), *tensor.shape[1:]))
        self.counter.add("all_to_all", self.name, tensor)
        rec = self.recorder.issue("all_to_all", self.name, self.ranks, _nbytes(tensor))
        return Pending(self, rec, tensor, lambda: dist.all_to_all_single(
            out, tensor, output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits), group=self.group,
            async_op=True), out)

    def own_slice(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return tensor
        return tensor.chunk(self.size, dim=dim)[self.rank].contiguous()


class OnGroup:
    """What a layer's view of its group (TensorParallel, ContextParallel) shares: the
    size and this rank's index, read from its ``comm``."""

    comm: CommGroup

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank


class DeviceMismatch(RuntimeError):
    """A tensor handed to a collective is not on its group's device."""


def same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` is ``b``, where a device without an index (``cuda``) matches any index of its
    type: ``torch.device("cuda") != torch.device("cuda", 0)`` would refuse what is fine."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


# torch 2.13 renamed the single-tensor collectives (the old names still work but warn);
# the older torch versions pyproject.toml allows have only the old names.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_LIST_REDUCE_SCATTER: set[str] = set()  # backends found not to support the tensor form


def _reduce_scatter_blocks(group: CommGroup, out: torch.Tensor, blocks: torch.Tensor):
    """Issue the reduce-scatter of ``blocks`` (``[size, *out.shape]``, contiguous) into
    ``out``; returns its work handle.

    The tensor form where the backend supports it; where it says it does not (an error
    raised on every rank alike before anything is sent), the list form, remembered for
    the backend so that the failed attempt is made once per process.

    Gloo's tensor form copies its whole input when issued and all-reduces the copy,
    which lives until the work is dropped: with ZeRO-1's buckets in flight through
    backward, a second gradient buffer. Where the output is this rank's block of the
    input (in place: the caller gives up the rest of it), the same all-reduce runs on
    the input itself: the same sums, bit for bit, and no copy.
    """
    if group.backend == "gloo" and out.data_ptr() == blocks[group.rank].data_ptr():
        return dist.all_reduce(blocks.view(-1), group=group.group, async_op=True)
    if group.backend not in _LIST_REDUCE_SCATTER:
        try:
            return _REDUCE_SCATTER_SINGLE(out.view(-1), blocks.view(-1), group=group.group, async_op=True)
        except (RuntimeError, NotImplementedError) as exc:
            if "support" not in str(exc).lower():
                raise
            _LIST_REDUCE_SCATTER.add(group.backend)
    if not _shares_memory(out, blocks):
        return dist.reduce_scatter(out, list(blocks.unbind(0)), group=group.group, async_op=True)
    # in place (ZeRO-1 reduces each bucket into the rank's own slice of it): the list form
    # promises nothing about an output inside its inputs, so reduce into a copy, waited for here
    reduced = torch.empty_like(out)
    dist.reduce_scatter(reduced, [b.clone() for b in blocks.unbind(0)], group=group.group)
    out.copy_(reduced)
    return _Done()


class _Done:
    """A work handle for an operation already completed."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class Pending:
    """Collectives or point-to-point operations issued asynchronously (``async_op``):
    :meth:`wait` waits for them, once, and returns the result.

    The flight recorder sees each operation issued when it is issued and waited for from
    the moment :meth:`wait` is called, so a hang report tells an op still travelling
    behind computation from one this rank is blocked on. ``issue`` is called at once and
    returns a work handle or a list of them (a batch of sends and receives); ``rec`` is
    one record or a list. An op that raises while being issued is recorded as done (it
    failed, it does not hang)."""

    def __init__(self, group: CommGroup | None, rec, tensor: torch.Tensor | None, issue, result) -> None:
        self.group, self.tensor, self._then = group, tensor, None
        self.recs = [] if rec is None else list(rec) if isinstance(rec, list) else [rec]
        self.result = result
        self.works: list = []
        if issue is not None:
            try:
                work = issue()
            except BaseException:
                for r in self.recs:
                    group.done(r, tensor)
                raise
            self.works = list(work) if isinstance(work, list) else [work]

    @classmethod
    def ready(cls, result) -> "Pending":
        """Nothing to wait for (a one-rank group)."""
        return cls(None, None, None, None, result)

    def then(self, fn) -> "Pending":
        """Apply ``fn`` to the result once it has arrived (a layout change after a gather)."""
        previous = self._then
        self._then = fn if previous is None else (lambda x: fn(previous(x)))
        return self

    def is_completed(self) -> bool:
        """Whether the operations have finished (without waiting; True once waited for)."""
        return all(w.is_completed() for w in self.works)

    def wait(self):
        if self.works:
            for rec in self.recs:
                self.group.recorder.wait(rec, self.tensor)
            try:
                for work in self.works:  # NCCL coalesces a batch into fewer works than operations
                    work.wait()
            finally:
                for rec in self.recs:
                    self.group.done(rec, self.tensor)
            self.works = []
        if self._then is not None:
            self.result, self._then = self._then(self.result), None
        return self.result


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def single(name: str = "single") -> CommGroup:
    """The one-rank group: collectives are identities."""
    return CommGroup(name)


# ---- autograd mappings --------------------------------------------------------------

def _mapping(name: str, forward, backward, forward_in_place: bool = False):
    """An autograd function doing ``forward(comm, x)`` and, for the gradient,
    ``backward(comm, grad)``; the identity (no function at all) on a one-rank group.

    ``forward_in_place``: ``forward`` overwrites a contiguous ``x`` (no copy before the
    collective); autograd is told (``mark_dirty``), so that a backward that needed the
    old ``x`` fails loudly instead of reading the sum."""

    class Mapping(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, comm):
            ctx.comm = comm
            if forward_in_place:
                if not _may_overwrite(x):
                    return forward(comm, x.clone(memory_format=torch.contiguous_format))
                ctx.mark_dirty(x)
            return forward(comm, x)

        @staticmethod
        def backward(ctx, grad):
            return backward(ctx.comm, grad), None

    Mapping.__name__ = Mapping.__qualname__ = name

    def apply(x: torch.Tensor, comm: CommGroup) -> torch.Tensor:
        return x if comm.size == 1 else Mapping.apply(x, comm)

    apply.__name__ = name
    return apply


def _may_overwrite(x: torch.Tensor) -> bool:
    """A computed, contiguous tensor that is not a view: what a layer's fresh partial
    product is. Leaves (parameters, inputs that require grad) and views keep their data."""
    return x.is_contiguous() and x._base is None and not (x.is_leaf and x.requires_grad)


def _identity(comm: CommGroup, x: torch.Tensor) -> torch.Tensor:
    return x.view_as(x)


def _sum(comm: CommGroup, x: torch.Tensor) -> torch.Tensor:
    return comm.all_reduce(x.contiguous().clone())  # a fresh buffer: autograd may hold x


# name                  forward                                   backward
copy_to_tp = _mapping("copy_to_tp", _identity, _sum)
reduce_from_tp = _mapping("reduce_from_tp", lambda c, x: c.all_reduce(x), lambda c, g: g, forward_in_place=True)
split_last_dim = _mapping("split_last_dim", lambda c, x: c.own_slice(x, -1), lambda c, g: c.all_gather(g, -1))
gather_last_dim = _mapping("gather_last_dim", lambda c, x: c.all_gather(x, -1), lambda c, g: c.own_slice(g, -1))
scatter_to_seq = _mapping("scatter_to_seq", lambda c, x: c.own_slice(x, 1), lambda c, g: c.all_gather(g, 1))
gather_from_seq = _mapping("gather_from_seq", lambda c, x: c.all_gather(x, 1), lambda c, g: c.reduce_scatter(g, 1))
reduce_scatter_seq = _mapping("reduce_scatter_seq", lambda c, x: c.reduce_scatter(x, 1), lambda c, g: c.all_gather(g, 1))
gather_rows = _mapping("gather_rows", lambda c, x: c.all_gather(x, 0), lambda c, g: c.reduce_scatter(g, 0))
reduce_scatter_rows = _mapping("reduce_scatter_rows", lambda c, x: c.reduce_scatter(x, 0), lambda c, g: c.all_gather(g, 0))


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks that need them and, for the gradient, the same rows' gradients
    back: the backward is the forward with the splits swapped (expert parallelism sends
    tokens to their experts' ranks with it, and the experts' outputs home)."""

    @staticmethod
    def forward(ctx, x, comm, send_splits, recv_splits):
        ctx.comm, ctx.splits = comm, (send_splits, recv_splits)
        return comm.all_to_all(x, send_splits, recv_splits)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return ctx.comm.all_to_all(grad, recv_splits, send_splits), None, None, None


def all_to_all(x: torch.Tensor, comm: CommGroup, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
    """``send_splits[r]`` rows of ``x`` (in order) to member r; ``recv_splits[r]`` rows come
    from member r. Differentiable; the identity on a one-rank group."""
    return x if comm.size == 1 else _AllToAll.apply(x, comm, list(send_splits), list(recv_splits))
