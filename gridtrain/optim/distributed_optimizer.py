"""AdamW on flat master weights, optionally sharded over data parallel (ZeRO-1), for
16-bit parameters.

Megatron's distributed optimizer in miniature. The gradient reducer's buffer gives
every parameter a fixed offset in one flat vector; this optimizer keeps, for the part of
that vector it owns, the master weights (fp32, or fp64 for fp64 runs) and AdamW's two
moments:

* without sharding a rank owns the whole vector: this is the mixed-precision optimizer
  (bf16/fp16 parameters for compute, fp32 master weights for the update);
* with ZeRO-1 (``--zero 1``) DP rank r owns the r-th 1/dp of every gradient bucket
  (data_parallel.py): the reducer reduce-scatters each bucket as soon as backward has
  finished it, so that each rank receives just its averaged slices, each rank updates
  only those slices of master weights and moments (1/dp of the optimizer memory), and
  the updated slices are all-gathered back, bucket by bucket, into every rank's
  parameters. The rank's slices, concatenated, are its shard; ``pieces`` (the
  reducer's) says which parameter elements each part of it holds.

For fp16 a :class:`LossScaler` scales the loss and this optimizer unscales the gradients
and skips steps whose gradients overflowed anywhere on the grid.

The update is AdamW exactly as ``torch.optim.AdamW`` computes it (decoupled weight decay
on matrices and embeddings only, bias-corrected moments), so a sharded run trains the
same model as an unsharded one. Clipping takes one norm over the owned slices of all DP
ranks and all model-parallel ranks, counting TP-replicated parameters and the tied head
copy once.

**Memory.** The only tensors this optimizer keeps are its three shard-sized vectors:
master weights and the two moments, ``3 x padded / dp`` elements (12 bytes per
parameter over dp for fp32 masters; :meth:`DistributedOptimizer.state_bytes`). Which
elements are weight-decayed and which count towards the gradient norm is a per-parameter
property, so it is kept as a few ``(begin, end)`` ranges of the shard rather than as
dense masks: dense masks would cost another 8 bytes per owned element, and a mask built
for the whole model and then sliced (a view keeps its whole storage alive) 8 bytes per
parameter on every rank whatever dp is. The updated weights are all-gathered in the
parameters' own dtype (half the bytes of gathering fp32 masters for bf16/fp16), in place:
the parameters are views of one flat buffer laid out as the gradients (the reducer's
``param_buffer``), so each rank writes its updated slice of a bucket into its own place
there and the all-gather fills the rest, with no second copy of the model.

**Checkpoints** store each parameter's optimizer state by name through
torch.distributed.checkpoint (gridtrain/checkpoint/), whatever the layout: each DP rank
writes the boxes of its own pieces of the master weights and both moments
(gridtrain/checkpoint/shards.py), and reads back into them the parts it owns, so
nothing is gathered, with ZeRO-1 or without. The master weights are stored beside the
moments, so that a bf16 or fp16 run resumes from its fp32 masters instead of from the
rounded 16-bit parameters. :meth:`DistributedOptimizer.load_state_by_param` takes whole
per-parameter tensors instead (the whole-tensor checkpoints of earlier versions,
``--init-from``). :class:`LossScaler` has its own ``state_dict`` for the same reason:
an fp16 run resumed with a fresh scale would skip steps the uninterrupted run did not.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from gridtrain.parallel.comm import CommGroup, Pending
from gridtrain.config import OptimConfig
from gridtrain.parallel.data_parallel import GradientReducer, Piece
from gridtrain.parallel.zero3 import ParameterShards, whole_shape
from gridtrain.optim.interface import StatePiece
from gridtrain.optim.optimizer import MOMENTS, clip_coefficient, counts_towards_norm, squared_norm


def _runs(pieces: list[Piece]) -> list[tuple[int, int]]:
    """The pieces' shard ranges, adjacent ones merged (fewer, longer operations)."""
    runs: list[tuple[int, int]] = []
    for piece in pieces:
        if runs and runs[-1][1] == piece.at:
            runs[-1] = (runs[-1][0], piece.end)
        else:
            runs.append((piece.at, piece.end))
    return runs


def adam_update_(master: list[torch.Tensor], grad: list[torch.Tensor], exp_avg: list[torch.Tensor],
                 exp_avg_sq: list[torch.Tensor], o: OptimConfig, step_size: float, correction: float) -> None:
    """One AdamW step of the ``master`` slices (decay applied before), as
    torch.optim.AdamW computes it, ``step_size`` = lr / (1 - beta1^t), ``correction`` =
    sqrt(1 - beta2^t): multi-tensor operations over the slices (a handful of kernels
    whatever their number; the same arithmetic per element as one slice at a time).
    Moments narrower than the masters (``--optimizer-state-dtype bf16``) are updated in
    the masters' precision and rounded when stored back."""
    if not master:
        return
    dtype, device = master[0].dtype, master[0].device
    grad = [g.to(device=device, dtype=dtype) for g in grad]  # themselves, or (--optimizer-offload) on the host
    m, v = [t.to(dtype) for t in exp_avg], [t.to(dtype) for t in exp_avg_sq]  # themselves unless narrower
    torch._foreach_lerp_(m, grad, 1 - o.beta1)
    torch._foreach_mul_(v, o.beta2)
    torch._foreach_addcmul_(v, grad, grad, value=1 - o.beta2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, correction)
    torch._foreach_add_(denom, o.adam_eps)
    torch._foreach_addcdiv_(master, m, denom, value=-step_size)
    if m[0] is not exp_avg[0]:
        torch._foreach_copy_(exp_avg, m)
        torch._foreach_copy_(exp_avg_sq, v)


def state_dtype_of(o: OptimConfig, master_dtype: torch.dtype) -> torch.dtype:
    """The moments' dtype: bf16 when asked (``--optimizer-state-dtype``), else the masters'."""
    return torch.bfloat16 if o.optimizer_state_dtype == "bf16" else master_dtype


class DistributedOptimizer:
    """AdamW on flat master weights, sharded over DP with ZeRO-1 (the module docstring),
    behind the optimizer interface (interface.py)."""

    def __init__(self, reducer: GradientReducer, o: OptimConfig, *, dp: CommGroup, mp: CommGroup,
                 tp_rank: int, master_dtype: torch.dtype, param_shards: ParameterShards | None = None):
        self.reducer, self.o, self.dp, self.mp = reducer, o, dp, mp
        self.param_shards = param_shards
        # this rank's shard is its own, or the first of its hybrid-sharding replicas: it
        # counts its slices in the gradient norm and writes them into checkpoints
        self.writes_shard = reducer.replicas is None or reducer.replicas.rank == 0
        self.shards_over_dp = reducer.shard
        self.params = reducer.params
        self.offsets = [reducer.offsets[p] for p in self.params]  # where each starts in the buffer
        size = reducer.shard_numel
        self.device = reducer.device
        # --optimizer-offload: the state (and the step) in host memory; on a CPU it is there already
        self.state_device = torch.device("cpu") if o.optimizer_offload else self.device
        self.pieces = reducer.pieces  # the parameter elements this rank updates, in shard order
        if param_shards is not None and param_shards.shard.dtype == master_dtype \
                and self.state_device == self.device:
            self.master = param_shards.shard  # ZeRO-3 in fp32/fp64: the parameter shard is the master
        else:
            self.master = torch.zeros(size, dtype=master_dtype, device=self.state_device)
            self._master_from_params()
        # the moments: the masters' dtype, or bf16 (--optimizer-state-dtype)
        self.state_dtype = state_dtype_of(o, master_dtype)
        self.exp_avg = torch.zeros_like(self.master, dtype=self.state_dtype)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        # masters of their own (fp32 beside 16-bit parameters), not just the parameters' values
        self.separate_masters = bool(self.params) and master_dtype != self.params[0].dtype
        # views of the master weights (no memory of their own): the decayed elements
        self._decayed = [self.master[a:b] for a, b in _runs([q for q in self.pieces if len(whole_shape(q.param)) >= 2])]
        # where the gradient of the shard lives: this rank's slices of the buffer's buckets
        # (ZeRO-1 reduces into them in place), or the whole buffer, in shard order
        self._grads = reducer.shard_views
        # the parts of them that count towards the gradient norm; none on DP replicas other
        # than the first, which hold the same whole gradient when ZeRO-1 does not split it
        # (under hybrid sharding the replicas of a shard hold the same slices: the first counts them)
        # (under expert parallelism a rank's experts are replicated over their own group)
        def counts(p: nn.Parameter) -> bool:
            return self.writes_shard if reducer.shard else reducer.group_of(p).rank == 0
        # (as shard ranges: ZeRO-2/3's gradient shard exists only from backward to the step)
        self._counted = _runs([q for q in self.pieces if counts(q.param) and counts_towards_norm(q.param, tp_rank)])
        if reducer.shard and dp.size > 1 and param_shards is None and reducer.param_buffer is None:
            reducer.bind_parameters()  # (the trainer asks for it up front: before the gradient memory)
        self.steps = 0
        self._gathering: dict[int, Pending] = {}  # bucket id -> its parameters' gather in flight
        self._waits_in_forward = False  # gather_before was called: step leaves gathers in flight
        self.lr = o.lr
        self.param_groups = [{"lr": o.lr}]  # read by set_lr

    @torch.no_grad()
    def _master_from_params(self) -> None:
        if self.param_shards is not None:  # ZeRO-3: the parameters' values are the shard's
            self.param_shards.shard_from_params()  # where whole parameters were just written
            if self.master is not self.param_shards.shard:
                self.master.copy_(self.param_shards.shard)
            return
        for q in self.pieces:
            self.master[q.at:q.end] = q.param.detach().reshape(-1)[q.lo:q.hi]

    def state_bytes(self) -> int:
        """Bytes of every tensor storage this optimizer keeps alive between steps, each
        counted once and whole (a view of a larger tensor counts that tensor's storage):
        ``3 x padded / dp`` elements of the master dtype, nothing else."""
        held = [*self.state_tensors(), *self._decayed]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
        return sum(storages.values())

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.master, self.exp_avg, self.exp_avg_sq]

    def unscale(self, scale: float) -> None:
        """Divide this rank's gradient slice by the fp16 loss scale."""
        if scale != 1.0:
            torch._foreach_div_(self._grads, scale)

    def nonfinite(self) -> torch.Tensor:
        """1.0 when this rank's gradient slice holds an inf or NaN, else 0.0 (fp64, on the
        device: summed with the other ranks' in grads.step_scalars)."""
        finite = torch.stack([torch.isfinite(g).all() for g in self._grads]).all()  # empty slices: finite
        return finite.logical_not().to(torch.float64)

    def grad_norm_squared(self) -> torch.Tensor:
        """This rank's share of the squared global norm (fp64, on the device): its slice,
        without TP-replicated copies held by a TP rank other than the first and the last
        stage's tied head copy. Under ZeRO-1 the DP ranks' slices add up; otherwise every
        DP replica holds the same whole gradient, counted on the first."""
        counted = [view for a, b in self._counted for view in self.reducer.shard_view(a, b)]
        return squared_norm([g.to(self.master.dtype) for g in counted], self.device)

    def clip_to(self, norm: float, max_norm: float) -> None:
        """Scale this rank's gradient slice, of global norm ``norm``, to at most ``max_norm``."""
        coef = clip_coefficient(norm, max_norm)
        if coef is not None:
            torch._foreach_mul_(self._grads, coef)

    def _begin_step(self) -> tuple[float, float, float]:
        """Count the step and decay the decayed masters; returns the step's learning rate
        and AdamW's step size and bias correction."""
        o, lr = self.o, self.param_groups[0]["lr"]
        self.steps += 1
        if self._decayed and lr * o.weight_decay != 0:
            torch._foreach_mul_(self._decayed, 1 - lr * o.weight_decay)
        return lr, lr / (1 - o.beta1 ** self.steps), math.sqrt(1 - o.beta2 ** self.steps)

    @torch.no_grad()
    def step(self, row_scales: dict[nn.Parameter, torch.Tensor] | None = None) -> None:
        o = self.o
        _, step_size, correction = self._begin_step()
        # the slices in groups of at most the largest slice's elements: a few kernels per
        # group, temporaries no larger than one slice's (offloaded: each slice as it lands,
        # computed while the next copies travel)
        limit = 0 if self.state_device != self.device else max((g.numel() for g in self._grads), default=0)
        at, group, size = 0, ([], [], [], []), 0
        for grad in self._host_grads():
            n = grad.numel()
            if size and size + n > limit:
                adam_update_(*group, o, step_size, correction)
                group, size = ([], [], [], []), 0
            for into, t in zip(group, (self.master[at:at + n], grad, self.exp_avg[at:at + n],
                                       self.exp_avg_sq[at:at + n])):
                into.append(t)
            at, size = at + n, size + n
        adam_update_(*group, o, step_size, correction)
        self._scale_rows(row_scales)
        self._publish()

    def _host_grads(self) -> Iterator[torch.Tensor]:
        """The gradient shard's slices where the state is: the buffer's views, or with the
        state offloaded to the host their copies there, all issued before the first is
        used (the copies travel while the step begins on the first). A copy to the host
        with ``non_blocking`` returns before its data lands: each slice is yielded only
        once the event recorded after its copy has completed."""
        if self.state_device == self.device:
            yield from self._grads
            return
        copies = []
        for g in self._grads:
            host = g.to(self.state_device, non_blocking=True)
            landed = torch.cuda.Event() if g.is_cuda else None
            if landed is not None:
                landed.record()
            copies.append((host, landed))
        for host, landed in copies:
            if landed is not None:
                landed.synchronize()
            yield host

    def _scale_rows(self, row_scales: dict[nn.Parameter, torch.Tensor] | None) -> None:
        """Multiply the masters' rows of the parameters in ``row_scales`` (a factor per row
        of the rank's local tensor) on the pieces this rank owns (``--qk-clip``)."""
        for q in self.pieces if row_scales else []:
            factor = row_scales.get(q.param)
            if factor is None:
                continue
            cols = math.prod(whole_shape(q.param)[1:])
            first, last = q.lo // cols, (q.hi - 1) // cols
            per_element = factor[first:last + 1].to(self.master.device, self.master.dtype).repeat_interleave(cols)
            self.master[q.at:q.end].mul_(per_element[q.lo - first * cols:q.hi - first * cols])

    @torch.no_grad()
    def _publish(self) -> None:
        """Copy the master weights into the model's parameters. With ZeRO-1/2, each
        rank's slice of a bucket, rounded to the parameters' dtype, is written into its
        place in the parameters' memory (the reducer's parameter buffer, laid out as the
        gradients) and all-gathered there in place, bucket by bucket, in the order the
        forward uses them (the first layers' are the gradient buffer's last buckets): no
        second copy of the model exists at any point (Megatron's way). Where
        :meth:`gather_before` has put waits before the model's forwards, the gathers are
        left in flight: each part of the next forward waits only for its own buckets, so
        the rest travels behind its computation (Megatron's overlapped parameter gather)."""
        if not self.params:
            return
        if self.param_shards is not None:  # ZeRO-3: into the shard; blocks gather it when they run
            if self.master is not self.param_shards.shard:  # (non_blocking: from the host, no stream sync)
                self.param_shards.shard.copy_(self.master, non_blocking=True)
            self.param_shards.step_done()
            return
        if not (self.reducer.shard and self.dp.size > 1):
            for p, o in zip(self.params, self.offsets):
                p.copy_(self.master[o: o + p.numel()].view_as(p), non_blocking=True)
            return
        self.parameters_ready()  # a bucket the last forward never needed (unused parameters)
        for b in reversed(self.reducer.buckets):
            whole = self.reducer.bucket_params(b)  # the parameters' own memory (the reducer's parameter buffer)
            size = (b.end - b.start) // b.group.size
            own = whole[b.group.rank * size:(b.group.rank + 1) * size]
            own.copy_(self.master[b.at:b.at + size], non_blocking=True)  # rounded to the parameters' dtype
            self._gathering[id(b)] = b.group.start_all_gather_into(whole, own)  # in place: own is its slice
        if not self._waits_in_forward:
            self.parameters_ready()

    @torch.no_grad()
    def parameters_ready(self, params: list[nn.Parameter] | None = None) -> None:
        """Wait for the gathers still in flight (those holding ``params``, or all): they
        write into the parameters themselves. Anything that reads the parameters other
        than through a forward (a checkpoint, the end of the run) calls this first."""
        if not self._gathering:
            return
        ids = list(self._gathering) if params is None else \
            [id(b) for p in params for b in self.reducer.buckets_of.get(p, ())]
        for key in ids:
            pending = self._gathering.pop(key, None)
            if pending is not None:  # (a bucket shared by two of the parameters is waited for once)
                pending.wait()

    def gather_before(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        """Before each forward of ``module``, wait for the gathers of ``params`` (the
        parameters that forward uses first-hand). Only under ZeRO-1 with dp > 1 (the
        only case with gathers); from then on :meth:`step` leaves its gathers in flight."""
        if not (self.reducer.shard and self.dp.size > 1) or self.param_shards is not None:
            return
        params = [p for p in params if p in self.reducer.buckets_of]
        module.register_forward_pre_hook(lambda _module, _args: self.parameters_ready(params))
        self._waits_in_forward = True

    # ---- checkpoints ----------------------------------------------------------------------

    def state_pieces(self) -> list[StatePiece]:
        """Each piece of the shard: its moments, and its master weights where they are
        not the parameters' values (16-bit parameters)."""
        flats = [(what, getattr(self, what)) for what in MOMENTS]
        flats += [("master", self.master)] if self.separate_masters else []
        return [StatePiece(q.param, q.lo, {what: flat[q.at:q.end] for what, flat in flats}) for q in self.pieces]

    def weight_pieces(self) -> list[StatePiece] | None:
        """ZeRO-3: this rank's pieces of the parameter shard (the parameters are empty
        between uses), in the parameters' dtype: where the shard holds fp32 masters
        beside 16-bit parameters, casts of them (what a gather gives; a load reads the
        masters into the shard itself, :meth:`state_pieces`); otherwise None, the
        parameters hold the weights."""
        if self.param_shards is None:
            return None
        shard, dtype = self.param_shards.shard, self.param_shards.dtype
        return [StatePiece(q.param, q.lo, {"model": shard[q.at:q.end].to(dtype)}) for q in self.pieces]

    def weights_loaded(self) -> None:
        """The parameter shard was written (a checkpoint read): nothing gathered is current."""
        if self.param_shards is not None:
            self.param_shards.step_done()

    def load_targets(self) -> list[StatePiece]:
        """The shard's own memory, the moments zeroed (a checkpoint without them starts there)."""
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        return self.state_pieces()

    def loaded(self, step: int | None, filled: list[StatePiece]) -> None:
        """Master weights that are the parameters' values are taken from the parameters
        as loaded; ``filled`` is the shard's memory already."""
        if not self.separate_masters:
            self._master_from_params()
        if step is not None:
            self.steps = step

    # ---- whole per-parameter state (format-1 checkpoints, --init-from) --------------------

    @torch.no_grad()
    def load_state_by_param(self, states: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Load AdamW state given whole per parameter (as torch.optim.AdamW names it, plus
        ``master``: the master weights) into whatever this rank owns: each parameter's
        state sliced to the pieces of it in this rank's shard. Master weights come from
        ``master`` where the checkpoint has them, else from the parameters as loaded;
        moments from the checkpoint, else zero."""
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self._master_from_params()
        for q in self.pieces:
            state = states.get(q.param) or {}
            if "step" in state:
                self.steps = int(state["step"])
            for key, flat in (("master", self.master), ("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                if key in state:
                    flat[q.at:q.end] = state[key].reshape(-1)[q.lo:q.hi].to(flat.dtype)


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al., 2018): multiply the loss by S so
    that small gradients survive fp16's narrow range; on an overflow skip the step and
    halve S; after ``growth_interval`` good steps in a row double it.

    Its state (the scale, the good steps since the last change, the steps skipped) is
    saved with checkpoints: a resumed fp16 run must scale, skip and grow exactly when the
    uninterrupted run would."""

    def __init__(self, initial: float = 2.0 ** 16, growth_interval: int = 1000, min_scale: float = 1.0):
        self.scale, self.growth_interval, self.min_scale = initial, growth_interval, min_scale
        self.good_steps = 0
        self.skipped = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(self.min_scale, self.scale / 2)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """The saved scale and counters; the growth interval and minimum stay this run's
        (they are flags, and a resumed run may change them)."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state["skipped"])
