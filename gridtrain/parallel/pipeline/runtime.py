"""Executing one stage's action list: forward and backward of model chunks, with
point-to-point communication on the pipeline group.

This is where the pipeline sends activations (SEND_F) and gradients (SEND_B). The
schedule decides the order; the runtime only interprets it:

* a run of consecutive SEND/RECV actions is posted as one ``batch_isend_irecv`` and
  waited for as a whole (the validator proves this cannot deadlock), except a run of
  sends only, which the stage leaves in flight and waits for at its next batch (or the
  end of the schedule): a send completes only when the peer posts its receive, and
  waiting there would idle the stage, e.g. ZB-H1's W behind a lone SEND_B. Waiting later
  cannot deadlock: every operation is posted in the same order as before, and a stage
  waits for nothing it did not wait for before, only later; shapes are known in
  advance (``[micro-batch, seq (/ tp under SP), hidden]``), so nothing is exchanged but
  the tensors. Messages carry no tags: NCCL ignores them and pairs the messages between
  two ranks by the order in which they are posted, whatever their direction, so the
  runtime relies, on gloo too, on what the validator proves: on every pair of ranks the
  sends and the receives name the same (micro-batch, chunk, direction) in the same order;
* once an output has been sent, its data is freed (only its autograd graph is kept,
  which is all backward needs), as Megatron's ``deallocate_output_tensor`` does;
* the last virtual stage turns per-token losses into ``sum * loss_scale``, so that the
  gradient is that of the mean over the global batch;
* gradients accumulate over micro-batches (the reducer's buffer, data_parallel.py); at
  ALLREDUCE_GRADS the caller's ``reduce_grads`` runs (grads.py);
* with a split backward (ZB-H1), B computes input gradients and queues the linear
  layers' weight gradients, which W computes;
* each forward runs inside ``recompute.micro_batch`` (recompute.py): the policy may keep
  the step's last micro-batch, and with early recomputation a micro-batch's recomputed
  regions are rebuilt right after the receive of its output gradient is posted, while
  that gradient is still travelling.

Per step the stage counts the most micro-batches whose activations it held, and times
its actions with the device's clock (timing.py: CUDA events on a GPU, where host time
measures only the launches) for the idle fraction and, with ``trace``, the Chrome trace.

For hang reports (watchdog.py) the runtime tells the flight recorder which action it is
running (so that the collectives inside a forward say ``F(mb 3, chunk 0)``), and records
every send and receive with its peer, from posting to the end of the batch's wait. The
waits have the process groups' timeout and the watchdog's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from gridtrain.parallel.comm import CommGroup
from gridtrain.data import Batch
from gridtrain.parallel.pipeline.schedules import (ALLREDUCE_GRADS, B, COMM, COMPUTE, F, OPTIMIZER_STEP, RECV_B, RECV_F, SEND_B,
                                          SEND_F, W, Action, virtual_stage)
from gridtrain.parallel.recompute import Recomputation
from gridtrain.parallel.split_backward import WeightGradStore
from gridtrain.runtime.timing import Clock, HostClock, Mark, clock_for


@dataclass
class StageStats:
    """What one step of this stage did: a count, and its timings as clock marks
    (timing.py), turned into seconds only when read (after the step, so that reading
    CUDA events never stalls the step)."""

    peak_in_flight: int = 0  # micro-batch chunks with forward done and backward not
    clock: Clock = field(default_factory=HostClock)
    spans: list[tuple[str, Mark, Mark]] = field(default_factory=list)  # (action, start, end)
    began: Mark = None  # the schedule's first and last marks
    ended: Mark = None
    began_host: float = 0.0  # perf_counter at ``began``: where the trace's times start
    tracing: bool = False

    @property
    def busy_s(self) -> float:
        """Time in F, B, W (compute); the rest of the step is waiting."""
        return sum(self.clock.seconds(s, e) for name, s, e in self.spans if name[0] in COMPUTE)

    @property
    def wall_s(self) -> float:
        return self.clock.seconds(self.began, self.ended) if self.ended is not None else 0.0

    @property
    def trace(self) -> list[tuple[str, float, float]]:
        """(action, start, end) in perf_counter seconds, when tracing; empty otherwise."""
        if not self.tracing:
            return []
        at = lambda m: self.began_host + self.clock.seconds(self.began, m)  # noqa: E731
        return [(name, at(s), at(e)) for name, s, e in self.spans]


class PipelineStage:
    def __init__(self, model: nn.Module, actions: list[Action], *, stage: int, num_stages: int,
                 chunks: int, pp: CommGroup, activation_shape: tuple[int, ...],
                 activation_dtype: torch.dtype, device: torch.device,
                 weight_grads: WeightGradStore | None = None,
                 forward_step: Callable[[nn.Module, Batch], torch.Tensor] | None = None,
                 trace: bool = False, recompute: Recomputation | None = None):
        self.model, self.actions = model, actions
        self.stage, self.p, self.v = stage, num_stages, chunks
        self.pp, self.device = pp, device
        self.shape, self.dtype = activation_shape, activation_dtype
        self.weight_grads = weight_grads
        self.forward_step = forward_step
        self.tracing = trace
        self.recompute = recompute or Recomputation()
        self.clock = clock_for(device)
        self.num_micro_batches = 1 + max((a.mb for a in actions if a.kind == F), default=-1)
        self.recorder = pp.recorder
        self.names = {a: _describe(a) for a in actions}  # for the flight recorder, made once

    # ---- one optimizer step -------------------------------------------------------------

    def run(self, batches: list[Batch] | None, loss_scale: float,
            reduce_grads: Callable[[], None]) -> tuple[torch.Tensor | None, StageStats]:
        """Execute the action list; returns the summed (unscaled) loss on the last stage."""
        self.batches, self.loss_scale = batches, loss_scale
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.grads: dict[tuple[int, int], torch.Tensor] = {}
        self.loss_sum: torch.Tensor | None = None
        self.pending_sends: list[tuple] = []  # posted batches of sends only, not yet waited for
        self.stats = StageStats(clock=self.clock, tracing=self.tracing)
        self.in_flight = 0
        self.stats.began, self.stats.began_host = self.clock.mark(), time.perf_counter()
        i = 0
        while i < len(self.actions):
            if self.actions[i].kind in COMM:
                j = i
                while j < len(self.actions) and self.actions[j].kind in COMM:
                    j += 1
                self._timed("P2P", self._communicate, self.actions[i:j])
                i = j
                continue
            a = self.actions[i]
            self.recorder.set_action(self.names[a])
            if a.kind == F:
                self._timed(str(a), self._forward, a.mb, a.chunk)
            elif a.kind == B:
                self._timed(str(a), self._backward, a.mb, a.chunk)
            elif a.kind == W:
                self._timed(str(a), self._weight_grad, a.mb, a.chunk)
            elif a.kind == ALLREDUCE_GRADS:
                self._timed(str(a), reduce_grads)
            elif a.kind != OPTIMIZER_STEP:  # the caller steps after clipping
                raise ValueError(f"unknown pipeline action {a}")
            i += 1
        for batch in self.pending_sends:
            self._finish(*batch)
        self.pending_sends = []
        self.recorder.set_action("after the schedule (loss, clipping, optimizer)")
        self.stats.ended = self.clock.mark()
        return self.loss_sum, self.stats

    def _timed(self, name: str, fn, *args) -> None:
        began = self.clock.mark()
        fn(*args)
        self.stats.spans.append((name, began, self.clock.mark()))

    def forward_only(self, batches: list[Batch] | None) -> torch.Tensor | None:
        """Run only the forwards (and their sends/receives), without autograd; returns the
        summed loss on the last stage. Used for validation."""
        actions = [a for a in self.actions if a.kind in (F, RECV_F, SEND_F)]
        saved = self.actions
        self.actions = actions
        try:
            with torch.no_grad():
                loss, _ = self.run(batches, 1.0, lambda: None)
        finally:
            self.actions = saved
        return loss

    # ---- compute -------------------------------------------------------------------------

    def _virtual(self, chunk: int) -> int:
        return virtual_stage(self.stage, chunk, self.p)

    def _is_first(self, chunk: int) -> bool:
        return self._virtual(chunk) == 0

    def _is_last(self, chunk: int) -> bool:
        return self._virtual(chunk) == self.p * self.v - 1

    def _forward(self, mb: int, chunk: int) -> None:
        with self.recompute.micro_batch((mb, chunk), last=mb == self.num_micro_batches - 1):
            self._forward_chunk(mb, chunk)
        self.in_flight += 1
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, self.in_flight)

    def _forward_chunk(self, mb: int, chunk: int) -> None:
        batch = self.batches[mb] if self.batches is not None else None
        first, last = self._is_first(chunk), self._is_last(chunk)
        if first and last:  # the whole model here: the user's forward_step defines the loss
            loss_sum = self.forward_step(self.model, batch)
            out = loss_sum * self.loss_scale
        else:
            x = batch["tokens"] if first else self.inputs[(mb, chunk)]
            # the last chunk returns its summed loss (the Decoder's fused, chunked head + loss)
            extra = {"reduction": "sum"} if last else {}
            if last and getattr(self.model, "mtp", None) is not None:  # multi-token prediction embeds later tokens
                extra["tokens"] = batch["tokens"]
            if batch is not None and "documents" in batch:  # --document-mask: every chunk's attention
                extra["documents"] = batch["documents"]
            out = self.model(x, batch["labels"] if last else None, chunk=chunk, **extra)
            if out is x:  # a chunk with no blocks: its output must own its storage (it is freed)
                out = x.clone()
            if last:
                loss_sum = out.sum()
                out = loss_sum * self.loss_scale
        if last:
            detached = loss_sum.detach().to(torch.float64)
            self.loss_sum = detached if self.loss_sum is None else self.loss_sum + detached
        self.outputs[(mb, chunk)] = out

    def _backward(self, mb: int, chunk: int) -> None:
        out = self.outputs.pop((mb, chunk))
        grad = None if self._is_last(chunk) else self.grads.pop((mb, chunk))
        key = (mb, chunk)
        if self.weight_grads is not None:
            with self.weight_grads.defer(key):
                _run_backward(out, grad)
        else:
            _run_backward(out, grad)
        self.recompute.forget(key)
        self.in_flight -= 1

    def _weight_grad(self, mb: int, chunk: int) -> None:
        self.weight_grads.flush((mb, chunk))

    # ---- communication ---------------------------------------------------------------------

    def _communicate(self, actions: list[Action]) -> None:
        ops, received, records = [], [], []
        for a in actions:  # posted in list order: the order that pairs them with the peer's
            self.recorder.set_action(self.names[a])
            if a.kind == SEND_F:
                op = self._p2p(dist.isend, self.outputs[(a.mb, a.chunk)].detach(), self.stage + 1)
            elif a.kind == SEND_B:
                op = self._p2p(dist.isend, self.inputs.pop((a.mb, a.chunk)).grad, self.stage - 1)
            else:
                buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                peer = self.stage + 1 if a.kind == RECV_B else self.stage - 1
                op = self._p2p(dist.irecv, buffer, peer)
                received.append((a, buffer, op.tensor))
            ops.append(op)
            records.append(self.recorder.issue("send" if op.op is dist.isend else "recv", self.pp.name,
                                               self.pp.ranks, op.tensor.numel() * op.tensor.element_size(),
                                               peer=op.peer))
        works = dist.batch_isend_irecv(ops)
        if self.recompute.policy.early:  # rebuild while the gradients are on their way
            for a in actions:
                if a.kind == RECV_B:
                    self.recompute.rebuild((a.mb, a.chunk))
        finishing, self.pending_sends = self.pending_sends, []
        for batch in finishing:  # the sends left in flight at the previous batch
            self._finish(*batch)
        if not received:  # only sends: let them travel while this stage computes on
            self.pending_sends.append((works, records, ops, actions))
            return
        self._finish(works, records, ops, actions)
        for a, buffer, landed in received:
            if landed is not buffer:  # staged through host memory (gloo on cuda)
                buffer.copy_(landed)
            if a.kind == RECV_F:
                self.inputs[(a.mb, a.chunk)] = buffer.requires_grad_()
            else:
                self.grads[(a.mb, a.chunk)] = buffer

    def _finish(self, works: list, records: list, ops: list, actions: list[Action]) -> None:
        """Wait for a posted batch; then free what it sent: only the graph is needed now."""
        self._wait(works, records, ops[0].tensor)
        for a in actions:
            if a.kind == SEND_F:
                _free_data(self.outputs[(a.mb, a.chunk)])

    def _wait(self, works: list, records: list, tensor: torch.Tensor) -> None:
        """Wait for a posted batch, recording each operation's wait. Backends that coalesce
        the batch (NCCL) return fewer works than operations: then all end together."""
        for rec in records:
            self.recorder.wait(rec, tensor)
        pairs = zip(works, records) if len(works) == len(records) else [(w, None) for w in works]
        try:
            for work, rec in pairs:
                work.wait()
                if rec is not None:
                    self.recorder.done(rec, tensor)
        finally:
            for rec in records:
                if rec.done is None and rec.finished is None:
                    self.recorder.done(rec, tensor)

    def _p2p(self, op, tensor: torch.Tensor, peer_stage: int) -> dist.P2POp:
        self.pp.check_device("send" if op is dist.isend else "recv", tensor)
        if op is dist.isend:
            tensor = tensor.contiguous()
            if tensor.dtype != self.dtype or tuple(tensor.shape) != self.shape:
                raise RuntimeError(f"pipeline stage {self.stage}: sending {tuple(tensor.shape)} "
                                   f"{tensor.dtype}, expected {self.shape} {self.dtype}")
            self.pp.counter.add("send", self.pp.name, tensor)
        if self.pp.p2p_via_host(tensor):
            tensor = tensor.cpu() if op is dist.isend else torch.empty_like(tensor, device="cpu")
        return dist.P2POp(op, tensor, self.pp.global_rank(peer_stage % self.p), self.pp.group)


def _describe(a: Action) -> str:
    """An action as the hang report shows it: ``F(mb 3, chunk 0)``, ``SEND_B(mb 2, chunk 1)``."""
    return a.kind if a.mb < 0 else f"{a.kind}(mb {a.mb}, chunk {a.chunk})"


def _free_data(out: torch.Tensor) -> None:
    """Drop a sent activation's storage but keep its graph (Megatron's trick)."""
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def _run_backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``out.backward(grad)`` without the shape check, which a freed ``out`` would fail."""
    if grad is None:  # the scaled loss: a scalar that was never sent
        out.backward()
        return
    Variable._execution_engine.run_backward((out,), (grad,), False, False, (), True, True)


