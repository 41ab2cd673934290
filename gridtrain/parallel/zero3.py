"""ZeRO-3: every data-parallel rank stores 1/dp of each parameter; a block's parameters
are all-gathered just before they are used and freed just after.

The shards follow the gradient layout (data_parallel.py, fully_sharded.py): the reducer's
buckets, each cut into dp slices, rank r owning slice r. ZeRO-3 gives every *unit* (a
transformer block; the token table, where the head does not share it; the stage's
remaining parameters, its final norm and head, form the root unit) buckets of its own,
so a unit's parameters are whole buckets and a parameter lies in one bucket. Rank r's
slices are its *parameter shard* (``padded / dp`` elements), and it is the optimizer's
master weights (fp32, fp64 for fp64 runs): the only copy of the weights a rank keeps,
4 bytes per parameter over dp, cast to the parameters' dtype (bf16) slice by slice as
it is gathered, as FSDP2 casts its fp32 shards. A bf16 shard beside the masters would
save the cast (one small kernel per gather, of 1/dp of the unit) and half of the
gather's input, for 2 bytes per parameter over dp held all the time: it does not pay.
Only with the optimizer's state in host memory (``--optimizer-offload``) is the shard
kept in the parameters' dtype on the device. A model built on the meta device never
holds its parameters whole: the shard is filled piece by piece from the values the run
starts from (``fill``: gridtrain.checkpoint.materialise.fill_pieces), rounded to the
parameters' dtype (as masters made from 16-bit parameters are).

**Gather and free.** Between uses a parameter's ``.data`` is an empty tensor. A unit's
forward pre-hook waits for its gather (launching it if no one has) and starts the next
block's gather, so that it travels while this block computes (prefetch). After the
forward the unit is freed again, unless ``keep_gathered`` (``--zero3-keep-gathered``):
then it stays gathered until its last backward of the step. When backward reaches the
unit (a hook on its output's gradient) it is gathered again and the previous block's
gather starts; when every parameter of the unit has received this backward's gradient
(the reducer's counts), the unit is freed. The root unit is gathered when the final
norm's forward starts (where the token table is a unit of its own: the root is then only
what the loss uses) and is not freed between its forward and its backward (they follow
each other at once: FSDP2 does the same for its root). The token table's unit is
gathered for its forward only: a lookup's backward reads no weight, so its gradient
arrives while the table is freed (its parameter then a zero-stride view of one zero
element, of the table's shape, which is all autograd checks) and the unit is not
gathered again in backward, where FSDP2 gathers it.
A unit gathered already is never gathered again: a gather per use at most, counted in
:attr:`ParameterShards.gathers`.

**What backward keeps.** Autograd would keep the gathered parameters alive from forward
to backward (operations save their weights), which would make freeing pointless.
While a unit runs, a saved-tensor hook replaces any saved tensor that views a gathered
unit's memory by a reference (unit, bucket, strides); in backward the reference is
resolved on the unit's gathered memory of that moment. Weights that a layer keeps as
the parameter object (tensor_parallel.py's linears) read the parameter's ``.data`` in
backward, gathered by then.

**Recomputation.** A recomputed block (``--recompute full``) runs its forward again
inside backward: it finds its unit gathered by the backward hook (or gathers it) and is
not freed after that forward: its gradients are next. Rebuilt ahead of its backward
(``--recompute-early``, outside autograd's backward) it is treated the same: kept
gathered, no prefetch of the block after it, so backward finds it ready and the unit is
gathered once; the trainer lets only the region backward needs first be rebuilt ahead
(recompute.Recomputation.early_limit), so no more than that region stays gathered.

**Zero-bubble.** A deferred weight gradient (ZB-H1's W) needs no parameter, only the
layer's input and output gradient: it goes straight to the reducer (split_backward.py
``_accumulate``), and a unit is freed after its B once each of its parameters has this
backward's gradient or has it deferred (``grad_deferred_hook``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from gridtrain.parallel import float8
from gridtrain.parallel.comm import CommGroup, Pending
from gridtrain.parallel.data_parallel import Bucket, GradientReducer, weak_hook
from gridtrain.parallel.recompute import rebuilding_ahead
from gridtrain.runtime import activation_meter


def whole_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's shape on this rank when whole (under ZeRO-3, also while sharded)."""
    return getattr(p, "whole_shape", p.shape)


@dataclass(eq=False)
class Unit:
    """A module whose parameters are gathered together, and their buckets."""

    name: str
    module: nn.Module
    params: list[nn.Parameter]
    buckets: list[Bucket]
    root: bool = False
    starts: nn.Module | None = None  # whose forward first uses the parameters (default: ``module``)
    # whether its backward reads the parameters (a token table's does not: not gathered for it)
    backward_reads: bool = True
    gathered: list[torch.Tensor] | None = None  # one tensor per bucket while gathered
    lossy: bool = False  # gathered in float8 (--fp8-all-gather): the values are not the shard's
    pending: list[Pending] = field(default_factory=list)  # gathers in flight
    ready: bool = False  # gathered and waited for: the parameters point into ``gathered``


class ParameterShards:
    """The parameter shards of one pipeline stage and the gathers that rebuild its
    parameters (the module docstring)."""

    def __init__(self, model: nn.Module, reducer: GradientReducer, units: list[Unit], dp: CommGroup, *,
                 keep_gathered: bool = False, sequences: list[list[Unit]] | None = None,
                 fill: Callable[[torch.Tensor, list], None] | None = None, fp8_gather: bool = False,
                 shard_dtype: torch.dtype | None = None):
        self.model, self.reducer, self.units, self.dp = model, reducer, units, dp
        self.keep_gathered = keep_gathered
        # --fp8-all-gather: buckets of float8 weights (make_reducer gives them their own)
        # travel as float8, cast with each weight's scales of the step (float8.py)
        self.fp8_buckets = {id(b) for u in units for b in u.buckets
                            if fp8_gather and b.params and all(float8.kind_of(p) for p in b.params)}
        self._exact = False  # gather_all: the shard's values, never float8
        self.dtype = reducer.params[0].dtype if reducer.params else torch.float32
        self.device = reducer.device
        self.unit_of = {p: u for u in units for p in u.params}
        self.gathers = 0  # unit gathers launched this step (tests and reports)
        self.gathers_total = 0
        self.pinned = False  # gather_all: whole until the next step
        self._storages: dict[int, tuple[Unit, int]] = {}  # gathered memory -> (unit, bucket)
        # the blocks that run one after another (a model chunk's), for prefetching
        self._neighbours: dict[int, tuple[Unit | None, Unit | None]] = {}
        for run in sequences if sequences is not None else [[u for u in units if not u.root]]:
            for i, u in enumerate(run):
                self._neighbours[id(u)] = (run[i - 1] if i > 0 else None, run[i + 1] if i + 1 < len(run) else None)
        # in the master weights' dtype where the optimizer's masters are this shard (the
        # only persistent copy of the weights: cast to the parameters' dtype when gathered)
        self.shard = torch.zeros(reducer.shard_numel, dtype=shard_dtype or self.dtype, device=self.device)
        if fill is not None:  # parameters built on the meta device: only the shard gets values
            fill(self.shard, reducer.pieces)
            self._round_shard()
        else:
            with torch.no_grad():
                for q in reducer.pieces:
                    self.shard[q.at:q.end] = q.param.detach().reshape(-1)[q.lo:q.hi]
        self._deferred: dict[nn.Parameter, int] = {}  # gradients deferred to W, not yet come
        deferred_hook = weak_hook(self._grad_deferred)
        for p in reducer.params:
            p.whole_shape = p.shape  # what the parameter is when gathered (checkpoints read it)
            p.grad_deferred_hook = deferred_hook
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        # the one element every freed token table views (one storage for the run: the
        # activation meter excludes the parameters' storages by identity)
        self._zero = torch.zeros((), dtype=self.dtype, device=self.device)
        for u in units:
            self._free(u)
            (u.starts or u.module).register_forward_pre_hook(self._make_pre_forward(u))
            u.module.register_forward_hook(self._make_post_forward(u), always_call=True)
        self._hooks: list = []
        # saved views of gathered memory become references for the whole forward
        model.register_forward_pre_hook(lambda _module, _args: self._enter_packing())
        model.register_forward_hook(lambda _module, _args, _output: self._exit_packing(), always_call=True)

    @torch.no_grad()
    def _round_shard(self) -> None:
        """A shard wider than the parameters starts from the parameters' values (as
        masters made from 16-bit parameters do), bucket by bucket."""
        if self.shard.dtype == self.dtype:
            return
        for b in self.reducer.buckets:
            part = self.shard[b.at:b.at + self.reducer.slice_size(b)]
            part.copy_(part.to(self.dtype))

    def _own(self, b: Bucket) -> torch.Tensor:
        """This rank's slice of bucket ``b`` in the parameters' dtype (a cast of the
        master shard's slice where it is wider: the gather's input, alive until it lands)."""
        own = self.shard[b.at:b.at + self.reducer.slice_size(b)]
        return own if own.dtype == self.dtype else own.to(self.dtype)

    # ---- gather and free ------------------------------------------------------------------

    def _gather(self, u: Unit) -> None:
        """Start the gathers of ``u``'s buckets (nothing if gathered or on its way)."""
        if u.gathered is not None:
            return
        u.gathered = []
        u.lossy = False
        for b in u.buckets:
            group = b.group  # the shard group, or for a rank's experts their expert-data-parallel group
            own = self._own(b)
            if id(b) in self.fp8_buckets and not self._exact:
                whole = torch.empty(b.end - b.start, dtype=torch.uint8, device=self.device)
                own = self._float8_slice(b, own)
                u.lossy = True
            else:
                whole = torch.empty(b.end - b.start, dtype=self.dtype, device=self.device)
            if group.size == 1:
                whole.copy_(own)
            else:
                u.pending.append(group.start_all_gather_into(whole, own))
            u.gathered.append(whole)
        self.gathers += 1
        self.gathers_total += 1

    @torch.no_grad()
    def _ready(self, u: Unit) -> None:
        """Gather ``u`` if needed, wait for it, point its parameters into it."""
        if u.ready:
            return
        self._gather(u)
        for pending in u.pending:
            pending.wait()
        u.pending = []
        for i, (b, whole) in enumerate(zip(u.buckets, u.gathered)):
            if whole.dtype == torch.uint8:  # float8 bytes: the weights dequantised for the layers
                whole = u.gathered[i] = self._dequantised(b, whole)
            self._storages[whole.untyped_storage()._cdata] = (u, i)
            for p in b.params:
                o = self.reducer.offsets[p] - b.start
                p.data = whole[o:o + math.prod(p.whole_shape)].view(p.whole_shape)
        u.ready = True

    def _float8_slice(self, b: Bucket, own: torch.Tensor) -> torch.Tensor:
        """This rank's slice of float8 bucket ``b`` as float8 bytes: each piece cast with
        its weight's scales of the step (per row, rowwise: the row of each element)."""
        out = torch.zeros(own.numel(), dtype=torch.uint8, device=own.device)
        for p in b.params:
            scales = p.fp8_scales
            for q in self.reducer._pieces_of[p]:
                lo, hi = q.at - b.at, q.end - b.at
                if scales.tensor is not None:
                    scale = scales.tensor
                else:
                    k = p.whole_shape[-1]
                    scale = scales.rows[:, 0][torch.arange(q.lo, q.hi, device=own.device) // k]
                out[lo:hi] = float8.cast_with(own[lo:hi], scale, float8.E4M3).view(torch.uint8)
        return out

    def _dequantised(self, b: Bucket, gathered: torch.Tensor) -> torch.Tensor:
        """The whole bucket in the parameters' dtype from its float8 bytes: each weight's
        values over its scales. Cast again with the same scales (as the float8 layers
        do), each gives back exactly the float8 value it travelled as: the layers compute
        what they would from the bf16 gather, from half the bytes."""
        whole = torch.empty(gathered.numel(), dtype=self.dtype, device=self.device)
        values = gathered.view(float8.E4M3)
        for p in b.params:
            o, n = self.reducer.offsets[p] - b.start, math.prod(p.whole_shape)
            scales = p.fp8_scales
            scale = scales.tensor if scales.tensor is not None else scales.rows
            whole[o:o + n] = (values[o:o + n].view(p.whole_shape).float() / scale).reshape(-1).to(self.dtype)
        return whole

    def _free(self, u: Unit) -> None:
        if u.pending:  # a prefetch never used: let it land before dropping its memory
            for pending in u.pending:
                pending.wait()
            u.pending = []
        for whole in u.gathered or ():
            self._storages.pop(whole.untyped_storage()._cdata, None)
        u.gathered, u.ready, u.lossy = None, False, False
        for p in u.params:
            # a unit whose backward reads no parameter gets its gradients while freed:
            # autograd wants the parameter's shape then, given by a view of one zero element
            p.data = self._empty.new_empty(0) if u.backward_reads else self._zero.expand(p.whole_shape)

    def _next(self, u: Unit, step: int) -> Unit | None:
        """The block after (``step`` 1) or before (-1) ``u`` in its chunk's forward order."""
        before, after = self._neighbours.get(id(u), (None, None))
        return after if step == 1 else before

    # ---- hooks ----------------------------------------------------------------------------

    def _make_pre_forward(self, u: Unit) -> Callable:
        def pre_forward(_module, _args):
            self._ready(u)
            after = self._next(u, 1)
            if after is not None and not _recomputing():
                self._gather(after)  # prefetch: it travels while this block computes
        return pre_forward

    def _make_post_forward(self, u: Unit) -> Callable:
        def post_forward(module, _args, output):
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled() and u.backward_reads:
                out.register_hook(lambda grad: self._before_backward(u))
                backward_next = u.root  # the root's backward follows its forward at once
            else:
                backward_next = False
            keep = self.pinned or _recomputing() or backward_next or (self.keep_gathered and module.training)
            if not keep:
                self._free(u)
            return output
        return post_forward

    def _before_backward(self, u: Unit) -> None:
        self._ready(u)
        before = self._next(u, -1)
        if before is not None and before.backward_reads:
            self._gather(before)

    def after_grad(self, p: nn.Parameter) -> None:
        """Called by the reducer after each gradient of ``p`` (and by split_backward.py
        when one is deferred to W): free ``p``'s unit once all of its parameters have this
        backward's gradient or have it deferred (W needs no parameter; with
        ``keep_gathered``: the step's last backward's)."""
        u = self.unit_of.get(p)
        if u is None or not u.ready:
            return
        counts, deferred = self.reducer.counts, self._deferred
        n = counts[p] + deferred.get(p, 0)
        if any(counts[q] + deferred.get(q, 0) != n for q in u.params):
            return
        if not self.keep_gathered or n == self.reducer.accumulations:
            self._free(u)

    def _grad_deferred(self, p: nn.Parameter, change: int) -> None:
        self._deferred[p] = self._deferred.get(p, 0) + change
        if change > 0:
            self.after_grad(p)

    # ---- saved tensors ----------------------------------------------------------------------

    def _enter_packing(self) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)

    def _exit_packing(self) -> None:
        if self._hooks:
            self._hooks.pop().__exit__(None, None, None)

    def _pack(self, t: torch.Tensor):
        """A view of gathered parameters is kept as a reference to them; anything else
        goes on to the activation meter's hooks, when installed (only the innermost
        hooks see a tensor)."""
        found = self._storages.get(t.untyped_storage()._cdata) if t.device == self.device else None
        if found is None:
            return activation_meter.save(t)
        u, i = found
        return _GatheredView(u, i, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, packed):
        if not isinstance(packed, _GatheredView):
            return activation_meter.load(packed)
        self._ready(packed.unit)  # gathered by the backward hook already
        return packed.unit.gathered[packed.bucket].as_strided(packed.size, packed.stride, packed.offset)

    # ---- the step ---------------------------------------------------------------------------

    def step_done(self) -> None:
        """The optimizer has written new values into the shard: nothing gathered is
        current any more."""
        self.pinned = False
        for u in self.units:
            if u.gathered is not None:
                self._free(u)
        self.gathers = 0

    @torch.no_grad()
    def gather_all(self) -> None:
        """Every parameter whole, and left so until the next step: the end of a run (its
        evaluation, sample and export read the weights), whole-tensor loads. Always the
        shard's own values: a unit gathered in float8 is gathered again."""
        self._exact = True
        try:
            for u in self.units:
                if u.lossy:
                    self._free(u)
                self._ready(u)
        finally:
            self._exact = False
        self.pinned = True

    @torch.no_grad()
    def shard_from_params(self) -> None:
        """While gathered whole (:meth:`gather_all`): the parameters' values, perhaps
        written since, into the shard."""
        if self.pinned:
            for q in self.reducer.pieces:
                self.shard[q.at:q.end] = q.param.detach().reshape(-1)[q.lo:q.hi]

    def take_params(self) -> None:
        """After writing whole parameters (gather_all first): their values into the
        shard, and the parameters sharded again."""
        self.shard_from_params()
        self.step_done()

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.shard]


def _recomputing() -> bool:
    """A block's forward that runs again for its backward (inside autograd's backward, or
    rebuilt ahead of it): its gradients are next."""
    return torch._C._current_graph_task_id() != -1 or rebuilding_ahead()


@dataclass(frozen=True)
class _GatheredView:
    """What backward keeps of a saved view of gathered parameters."""

    unit: Unit
    bucket: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def make_units(model: nn.Module, block_type: type, *, leading: list[nn.Module] = (),
               root_from: nn.Module | None = None) -> tuple[list[Unit], dict[nn.Parameter, int]]:
    """Each ``block_type`` module of ``model`` a unit (forward order: registration order),
    each module of ``leading`` a unit of its own too (a token table that the head does not
    share: gathered for its forward only, as its backward reads no weight; its gradient
    reduced on its own at the end of backward), the rest of its trainable parameters the root unit (the model
    itself, gathered when ``root_from``'s forward starts: the final norm, where the root
    holds only what the loss uses; default the model's); also each parameter's unit
    index, for the reducer's layout."""
    modules = [(f"block {i}", m) for i, m in enumerate(m for m in model.modules() if isinstance(m, block_type))]
    modules += [(f"{type(m).__name__.lower()}", m) for m in leading]
    # each unit's index is its place in backward's order (the reducer's layout follows
    # it): the root first where it is only what the loss uses, else last (its token
    # table's gradient comes at the very end); the blocks from the last to the first;
    # the token table last
    blocks = len(modules) - len(leading)
    root_at = 0 if root_from is not None else len(modules) + 1
    units, index = [], {}
    inside = set()
    for i, (name, module) in enumerate(modules):
        params = [p for p in module.parameters() if p.requires_grad]
        units.append(Unit(name, module, params, [], backward_reads=i < blocks))
        for p in params:
            index[p] = blocks - i if i < blocks else i + 1
            inside.add(id(p))
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in inside]
    units.append(Unit("root", model, rest, [], root=True, starts=root_from))
    for p in rest:
        index[p] = root_at
    return units, index


def attach_buckets(units: list[Unit], reducer: GradientReducer) -> None:
    """Each unit's buckets (the reducer laid them out unit by unit)."""
    for u in units:
        ids = {id(p) for p in u.params}
        u.buckets = [b for b in reducer.buckets if any(id(p) in ids for p in b.params)]
