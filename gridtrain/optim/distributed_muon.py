"""Muon beside AdamW on the flat master weights of distributed_optimizer.py, on every
layout (``--optimizer muon``).

The shard's pieces (data_parallel.Piece: the parameter elements this rank updates) are
split by :func:`gridtrain.optim.muon.uses_muon`: AdamW's pieces keep two moments, Muon's
one momentum buffer, each packed in its own flat vector (so a rank holds exactly
``master + 2 x AdamW's elements + Muon's elements``: :meth:`DistributedMuon.state_bytes`).
A step runs AdamW on its pieces as DistributedOptimizer does, and Muon in three parts:
the momentum and its Nesterov update on this rank's pieces, the orthogonalisation of
every one-process matrix on its owner (muon.MatrixExchange: the data-parallel slices
and the tensor-parallel shards brought together, the update sent back), and decay and
update on the pieces. The masters are then published as for AdamW (ZeRO-1's gathers,
ZeRO-3's shard).

Muon's learning rate follows the schedule of ``--lr``: each step's Muon rate is the
step's AdamW rate times ``muon_lr / lr``. Checkpoints store Muon's buffer per parameter
as ``optim/<param>/momentum_buffer`` (torch.optim.Muon's name), in the same boxes as
AdamW's moments, so it reshards across layouts as they do.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gridtrain.config import OptimConfig
from gridtrain.optim.distributed_optimizer import DistributedOptimizer, _runs, adam_update_
from gridtrain.optim.interface import StatePiece
from gridtrain.optim.muon import Matrix, MatrixExchange, default_muon_lr, lr_ratio, matrix_shapes, ns_dtype_of, \
    uses_muon
from gridtrain.optim.optimizer import MOMENTS
from gridtrain.parallel.comm import CommGroup
from gridtrain.parallel.data_parallel import Piece
from gridtrain.parallel.tensor_parallel import TensorParallel, split_over
from gridtrain.parallel.zero3 import whole_shape

MOMENTUM = "momentum_buffer"  # Muon's state per parameter, as torch names it


class DistributedMuon(DistributedOptimizer):
    """Muon for the blocks' matrices, AdamW for the rest (the module docstring)."""

    def __init__(self, reducer, o: OptimConfig, *, tp: TensorParallel, d_model: int, **kwargs):
        super().__init__(reducer, o, tp_rank=tp.rank, **kwargs)
        names = reducer.names
        self.muon_params = {p for p in self.params if uses_muon(names[p], tuple(whole_shape(p)))}
        self.adam_pieces = [q for q in self.pieces if q.param not in self.muon_params]
        self.muon_pieces = [q for q in self.pieces if q.param in self.muon_params]
        dtype = self.state_dtype  # the masters', or bf16 (--optimizer-state-dtype)
        # state packed per kind: AdamW's moments over its pieces, Muon's buffer over its own
        self.exp_avg = torch.zeros(_numel(self.adam_pieces), dtype=dtype, device=self.state_device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.momentum = torch.zeros(_numel(self.muon_pieces), dtype=dtype, device=self.state_device)
        self._adam_at = _packed(self.adam_pieces)
        self._muon_at = _packed(self.muon_pieces)
        self._decayed = [self.master[a:b] for a, b in _runs([q for q in self.adam_pieces
                                                             if len(whole_shape(q.param)) >= 2])]
        self.muon_lr = o.muon_lr if o.muon_lr is not None else default_muon_lr(o.lr, o.muon_adjust_lr, d_model)
        matrices = self._matrices(tp)
        self.ratios = {m.param: lr_ratio(o.muon_adjust_lr, matrix_shapes(m.whole_shape, m.spec)[0]) for m in matrices}
        ns_dtype = ns_dtype_of(o.muon_ns_dtype, self.master.dtype, self.device)
        self.exchange = MatrixExchange(matrices, o.muon_ns_steps, ns_dtype)

    def _matrices(self, tp: TensorParallel) -> list[Matrix]:
        """This rank's Muon parameters as the exchange sees them, in the reducer's order
        (the same on every rank of a data-parallel and a tensor-parallel group)."""
        r = self.reducer
        out = []
        for p in r.params:
            if p not in self.muon_params:
                continue
            spec, group = split_over(p, tp)
            if getattr(p, "tp_distinct", False):  # folded experts: each tp rank its own matrices
                spec = None
            dp = r.group_of(p) if r.shard else _alone(r.group_of(p))
            held: list[list[tuple[int, int]]] = [[] for _ in range(dp.size)]
            begin, end = r.offsets[p], r.offsets[p] + math.prod(whole_shape(p))
            for b in r.buckets_of[p]:
                size = (b.end - b.start) // (b.group.size if r.shard else 1)
                for member in range(dp.size):
                    lo = b.start + member * size
                    first, last = max(lo, begin), min(lo + size, end)
                    if first < last:
                        held[member].append((first - begin, last - begin))
            out.append(Matrix(p, tuple(whole_shape(p)), spec, group, dp, held))
        return out

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.master, self.exp_avg, self.exp_avg_sq, self.momentum]

    @torch.no_grad()
    def step(self, row_scales: dict[nn.Parameter, torch.Tensor] | None = None) -> None:
        o = self.o
        lr, step_size, correction = self._begin_step()  # AdamW's decayed pieces decayed
        pieces = [(q, at, q.hi - q.lo) for q, at in zip(self.adam_pieces, self._adam_at)]
        # (the gradients moved to the masters' device there: --optimizer-offload)
        adam_update_([self.master[q.at:q.end] for q, _, _ in pieces], [self._grad(q) for q, _, _ in pieces],
                     [self.exp_avg[at:at + n] for _, at, n in pieces], [self.exp_avg_sq[at:at + n] for _, at, n in pieces],
                     o, step_size, correction)
        updates: dict[nn.Parameter, dict[tuple[int, int], torch.Tensor]] = {p: {} for p in self.muon_params}
        for q, at in zip(self.muon_pieces, self._muon_at):
            stored = self.momentum[at:at + q.hi - q.lo]
            buf = stored.to(self.master.dtype)  # itself unless the state is narrower (bf16)
            grad = self._grad(q).to(buf.device, buf.dtype)
            buf.lerp_(grad, 1 - o.muon_momentum)
            if buf is not stored:
                stored.copy_(buf)
            update = grad.lerp(buf, o.muon_momentum) if o.muon_nesterov else buf
            updates[q.param][(q.lo, q.hi)] = update.to(self.device)  # the exchange's collectives are the device's
        done = self.exchange.orthogonalised(updates)
        muon_lr = lr * (self.muon_lr / o.lr)  # Muon's rate on --lr's schedule
        for q in self.muon_pieces:
            master = self.master[q.at:q.end]
            master.mul_(1 - muon_lr * o.weight_decay)
            master.add_(done[q.param][(q.lo, q.hi)].to(master.device), alpha=-muon_lr * self.ratios[q.param])
        self._scale_rows(row_scales)
        self._publish()

    def _grad(self, q: Piece) -> torch.Tensor:
        views = self.reducer.shard_view(q.at, q.end)
        return views[0] if len(views) == 1 else torch.cat(views)

    # ---- checkpoints ----------------------------------------------------------------------

    def state_pieces(self) -> list[StatePiece]:
        """Each piece of the shard: AdamW's moments or Muon's buffer, and its master
        weights where they are not the parameters' values (16-bit parameters)."""
        out = []
        adam = dict(zip(map(id, self.adam_pieces), self._adam_at))
        muon = dict(zip(map(id, self.muon_pieces), self._muon_at))
        for q in self.pieces:
            n = q.hi - q.lo
            if id(q) in muon:
                at = muon[id(q)]
                tensors = {MOMENTUM: self.momentum[at:at + n]}
            else:
                at = adam[id(q)]
                tensors = {what: getattr(self, what)[at:at + n] for what in MOMENTS}
            if self.separate_masters:
                tensors["master"] = self.master[q.at:q.end]
            out.append(StatePiece(q.param, q.lo, tensors))
        return out

    def load_targets(self) -> list[StatePiece]:
        self.momentum.zero_()
        return super().load_targets()

    @torch.no_grad()
    def load_state_by_param(self, states: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Whole per-parameter state (AdamW's names or Muon's ``momentum_buffer``, plus
        ``master``: the master weights) into this rank's pieces; what is missing starts
        at zero, masters from the parameters."""
        for flat in (self.exp_avg, self.exp_avg_sq, self.momentum):
            flat.zero_()
        self._master_from_params()
        for q, piece in zip(self.pieces, self.state_pieces()):
            state = states.get(q.param) or {}
            if "step" in state:
                self.steps = int(state["step"])
            if "master" in state:
                self.master[q.at:q.end] = state["master"].reshape(-1)[q.lo:q.hi].to(self.master.dtype)
            for what, flat in piece.tensors.items():
                if what != "master" and what in state:
                    flat.copy_(state[what].reshape(-1)[q.lo:q.hi].to(flat.dtype))


def _numel(pieces: list[Piece]) -> int:
    return sum(q.hi - q.lo for q in pieces)


def _packed(pieces: list[Piece]) -> list[int]:
    """Where each piece starts in a vector that packs ``pieces`` in order."""
    out, at = [], 0
    for q in pieces:
        out.append(at)
        at += q.hi - q.lo
    return out


def _alone(group: CommGroup) -> CommGroup:
    """A group of one for a parameter every member of ``group`` holds whole (no sharding):
    each orthogonalises it itself."""
    return CommGroup.alone(group.name, group.global_rank(group.rank) if group.size > 1 else 0, group.counter,
                           device=group.device)
