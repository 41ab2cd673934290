"""A model built on the meta device takes its values on each rank, and only what the rank
owns: the same arithmetic that tells a checkpoint where a rank's pieces lie.

Every rank builds its chunks on the meta device (gridtrain.parallel.meta). What it then
holds is a list of pieces of global tensors, by name: its TP shard of each of its
parameters (vocabulary padding cut off), or under ZeRO-3 its elements of each
parameter's flattened shard (sharded.py's :func:`piece_slab`, the boxes DCP reads and
writes). Each piece is filled from a *source of values*, which reads boxes of whole
tensors by global name:

* :class:`Drawn`: the initialisation (models.decoder.initial_tensor): each tensor is drawn
  whole (one at a time: the only whole tensor a rank ever holds while it starts) and cut;
* :class:`Stored`: ``--init-from`` a Hugging Face directory or a whole-tensor checkpoint:
  each box read from the safetensors files where the source can read slices (a
  parameter's rows or columns, an expert's part of a stacked tensor), else the tensor
  converted whole and cut;
* :class:`Zeros`: a checkpoint will overwrite everything (resume, and ``--init-from`` a
  sharded checkpoint, which DCP reads piece by piece: load_sharded).

So a rank's start-up memory is what it owns plus at most one whole tensor, and every
layout's initial weights are the one-process weights bit for bit (the pieces are cut
from the same tensors that :func:`gridtrain.models.decoder.init_parameters` copies
whole).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from gridtrain.checkpoint.errors import CheckpointError
from gridtrain.checkpoint.manifest import is_sharded, read_meta_file
from gridtrain.checkpoint.sharded import load_sharded, model_buffers, piece_slab, placement, source_name
from gridtrain.checkpoint.shards import Slab
from gridtrain.config import Config, ModelConfig
from gridtrain.models.decoder import canonical_name, initial_tensor
from gridtrain.parallel.meta import is_meta, on_meta, set_storage
from gridtrain.parallel.tensor_parallel import TensorParallel

Box = tuple[tuple[int, ...], tuple[int, ...]]  # offsets, sizes


class Values(Protocol):
    """Boxes of whole tensors by the name of the parameter they initialise."""

    def read(self, name: str, param: torch.Tensor, shape: tuple[int, ...], box: Box) -> torch.Tensor:
        """The ``box`` of the global tensor (``shape``) that parameter ``name`` starts from."""


def _cut(whole: torch.Tensor, box: Box) -> torch.Tensor:
    offsets, sizes = box
    return whole[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


class _LastWhole:
    """The last whole tensor made, kept while its pieces are cut (a parameter's pieces
    are consecutive): each tensor is made once, and one at a time."""

    def __init__(self):
        self.key, self.tensor = None, None

    def get(self, key: str, make) -> torch.Tensor:
        if key != self.key:
            self.clear()  # the old one goes before the new one is made
            self.tensor, self.key = make(), key
        return self.tensor

    def clear(self) -> None:
        self.key, self.tensor = None, None


class _FromWhole:
    """A source that makes each tensor whole and cuts boxes from it, keeping the last one
    made while its pieces are filled (:class:`_LastWhole`)."""

    def __init__(self):
        self._last = _LastWhole()

    def release(self) -> None:
        """Drop the last whole tensor (filling is done)."""
        self._last.clear()


class Drawn(_FromWhole):
    """The initialisation of ``cfg`` with ``seed``: each tensor drawn whole, then cut."""

    def __init__(self, cfg: ModelConfig, seed: int):
        super().__init__()
        self.cfg, self.seed = cfg, seed

    def read(self, name: str, param: torch.Tensor, shape: tuple[int, ...], box: Box) -> torch.Tensor:
        whole = self._last.get(canonical_name(name), lambda: initial_tensor(name, param, shape, self.cfg, self.seed))
        return _cut(whole, box)


class Stored(_FromWhole):
    """Whole tensors by global name from a source (a Hugging Face directory converted on
    demand, a checkpoint's files): boxes read as slices where the source can
    (``box(name, box)``, None where it cannot), else cut from the whole tensor.
    ``fresh``: where the source has no multi-token prediction modules (``mtp.*``: a
    model published without them, a run that adds them), theirs are drawn from it."""

    def __init__(self, tensors, where: str, fresh: "Drawn | None" = None):
        super().__init__()
        self.tensors, self.where, self.fresh = tensors, where, fresh

    def release(self) -> None:
        super().release()
        if self.fresh is not None:
            self.fresh.release()

    def read(self, name: str, param: torch.Tensor, shape: tuple[int, ...], box: Box) -> torch.Tensor:
        src = source_name(name, param)
        if src not in self.tensors and self.fresh is not None and src.startswith("mtp."):
            return self.fresh.read(name, param, shape, box)
        if src not in self.tensors:
            raise CheckpointError(f"{self.where}: the checkpoint has no weights for {src}; use the same model "
                                  "flags as the saved run")
        reader = getattr(self.tensors, "box", None)
        out = reader(src, box) if reader is not None else None
        if out is None:
            whole = self._last.get(src, lambda: self.tensors[src])
            if tuple(whole.shape) != tuple(shape):
                raise CheckpointError(f"{self.where}: {src} has shape {tuple(whole.shape)}, which does not fit this "
                                      f"model ({tuple(shape)}); use the same model flags as the saved run")
            out = _cut(whole, box)
        if tuple(out.shape) != tuple(box[1]):
            raise CheckpointError(f"{self.where}: {src} does not fit this model (a {tuple(box[1])} piece of "
                                  f"{tuple(shape)} read as {tuple(out.shape)}); use the same model flags as the saved run")
        return out


class Zeros:
    """Zeros everywhere: what a rank starts from when a checkpoint will overwrite it."""

    def read(self, name: str, param: torch.Tensor, shape: tuple[int, ...], box: Box) -> torch.Tensor:
        return torch.zeros(box[1])


@torch.no_grad()
def fill(slab: Slab, name: str, param: torch.Tensor, values: Values) -> None:
    """Each piece of ``slab`` (views of the memory that holds them) from ``values``."""
    for offsets, view in slab.pieces.items():
        view.copy_(values.read(name, param, tuple(slab.global_shape), (tuple(offsets), tuple(view.shape))))


@torch.no_grad()
def materialise(model: nn.Module, values: Values, *, device: torch.device | str, dtype: torch.dtype,
                tp: TensorParallel, overwrite: bool = False) -> None:
    """Give every parameter still on the meta device its whole local tensor (this rank's
    TP shard, vocabulary padding zero) on ``device`` in ``dtype``, filled from ``values``
    (``overwrite``: parameters that have memory already take them too); persistent
    buffers (a MoE layer's expert bias) take a stored source's values where it has them;
    buffers (computed from the config when the model was built) move to ``device``."""
    for name, p in model.named_parameters():
        if on_meta(p):
            local = torch.zeros(p.shape, dtype=dtype, device=device)
            if not isinstance(values, Zeros):
                fill(Slab.of(local, placement(p, tp)), name, p, values)
            set_storage(p, local)
        elif overwrite:
            fill(Slab.of(p.data, placement(p, tp)), name, p, values)
    if isinstance(values, Stored):  # model state a checkpoint holds beside the weights (a MoE layer's expert bias)
        for name, b in model_buffers(model):
            if name in values.tensors:
                b.copy_(values.read(name, b, tuple(b.shape), ((0,) * b.dim(), tuple(b.shape))))
    _release(values)
    move_buffers(model, device)
    for module in model.modules():
        lay_out = getattr(module, "lay_out_parameters", None)  # a MoE layer's experts in one storage
        if lay_out is not None:
            lay_out()


def move_buffers(model: nn.Module, device: torch.device | str) -> None:
    """The model's buffers (computed on the host when it was built: rotary tables, expert
    biases) onto ``device``."""
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.device != torch.device(device):
                module._buffers[key] = buffer.to(device)


@torch.no_grad()
def fill_pieces(flat: torch.Tensor, pieces: Iterable, model: nn.Module, values: Values, tp: TensorParallel) -> None:
    """Elements ``at:end`` of ``flat`` (a parameter shard, or master weights at the same
    positions) from ``values``: each piece (``param``, ``lo``, ``at``, ``end``, as the
    gradient reducer's) holds elements ``lo:`` of its flattened parameter."""
    if isinstance(values, Zeros):
        return
    names = {p: name for name, p in model.named_parameters()}
    for q in pieces:
        fill(piece_slab(q, flat[q.at:q.end], tp), names[q.param], q.param, values)
    _release(values)


def _release(values: Values) -> None:
    """The source's last whole tensor goes once the pieces are filled, before the rest of
    the rank's state (gradients, optimizer) is allocated."""
    release = getattr(values, "release", None)
    if release is not None:
        release()


@dataclass
class Start:
    """Where a run's first weights come from (:meth:`of`), and how they reach what each
    rank owns: the parameters it holds whole (:meth:`materialise`), its ZeRO-3 shard
    (:meth:`shard_filler`), its optimizer's master weights (:meth:`finish`)."""

    values: Values
    built_on_meta: bool = True  # the model has no values yet (else only --init-from overwrites it)
    overwrite: bool = False  # --init-from a source of whole tensors: every parameter takes them
    sharded: Path | None = None  # --init-from a sharded checkpoint: DCP reads the pieces (finish)

    @classmethod
    def of(cls, cfg: Config, model: nn.Module, resume: Path | None = None, init=None) -> "Start":
        """Zeros when resuming (the checkpoint overwrites them); the weights of ``init``
        (``--init-from``'s source, opened: huggingface.open_source), weights only (step
        0, a fresh optimizer); else the initialisation of the seed."""
        built_on_meta = is_meta(model)
        if resume is not None:
            return cls(Zeros(), built_on_meta)
        if init is None:
            return cls(Drawn(cfg.model, cfg.training.seed), built_on_meta)
        step = getattr(init, "step", None)  # a gridtrain checkpoint's step directory
        if step is not None and is_sharded(step):
            return cls(Zeros(), built_on_meta, sharded=step)
        return cls(Stored(init.tensors, init.where, fresh=Drawn(cfg.model, cfg.training.seed)), built_on_meta,
                   overwrite=True)

    def materialise(self, model: nn.Module, ctx) -> None:
        materialise(model, self.values, device=ctx.device, dtype=ctx.param_dtype, tp=ctx.tp,
                    overwrite=self.overwrite)

    def shard_filler(self, model: nn.Module, ctx) -> Callable[[torch.Tensor, list], None] | None:
        """What fills a ZeRO-3 parameter shard: the values, or None where the parameters
        hold them (a model built with memory and no --init-from)."""
        if not (self.built_on_meta or self.overwrite):
            return None
        return lambda flat, pieces: fill_pieces(flat, pieces, model, self.values, ctx.tp)

    @torch.no_grad()
    def finish(self, model: nn.Module, optimizer, ctx) -> None:
        """Once the optimizer exists: ``--init-from``'s weights in its master weights at the
        source's precision (not the parameters' rounding); from a sharded checkpoint,
        DCP's read of this rank's pieces of weights and masters (no moments, no step)."""
        if self.sharded is not None:
            meta = {**read_meta_file(self.sharded, "--init-from"), "optimizer": None}
            load_sharded(self.sharded, meta, model, optimizer, ctx, where=f"--init-from {self.sharded}")
            return
        if not (self.overwrite and getattr(optimizer, "separate_masters", False)):
            return
        names = {p: name for name, p in model.named_parameters()}
        for piece in optimizer.load_targets():
            if "master" in piece.tensors:
                fill(piece_slab(piece, piece.tensors["master"], ctx.tp), names[piece.param], piece.param, self.values)
        _release(self.values)
        optimizer.loaded(None, [])
