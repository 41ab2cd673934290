"""Where this rank's pieces of each tensor sit in the global tensor: the boxes that
torch.distributed.checkpoint (DCP) records, so that any layout can read any other's.

DCP stores each tensor as chunks, each a box (offsets and sizes) of the global tensor,
and reads, for every box a loading rank asks for, the parts of the stored boxes that
overlap it. All a layout has to say is where its pieces lie, as pure arithmetic here:

* a **tensor-parallel shard** is a box of the global tensor along the split dimension;
  a fused tensor (GPT-2's QKV, ``parts`` > 1) is one box per part, since rank r holds
  the r-th slice of Q, of K and of V; replicated slices (Llama's shared key/value heads)
  are the same box on several ranks, which DCP writes once;
* **vocabulary padding** rows (their number depends on tp) are cut off: the global
  tensor has the real vocabulary's rows, and a shard that is all padding has no box;
* a **ZeRO-1 shard** owns a range of the flat concatenation of the local parameters:
  a contiguous run of a row-major tensor is at most ``2 x ndim - 1`` boxes
  (:func:`flat_boxes`: a partial first row, whole rows, a partial last row,
  recursively), so optimizer state is stored per parameter by name, not as flat buffers.

:class:`Slab` hands such pieces to DCP (its ``__create_write_items__`` /
``__create_chunk_list__`` / ``__get_tensor_shard__`` protocol, the one DTensor
implements) without a device mesh: each piece is a view of the memory it is written
from or read into, so neither save nor load copies a whole tensor. DCP's planners and
writer that take them are in dcp_io.py, and DCP is imported here only inside the protocol
methods: importing it costs about 1 s per process, which runs that never save or read
a checkpoint do not pay.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gridtrain.parallel.tensor_parallel import ShardSpec

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem


@dataclass(frozen=True)
class Box:
    """``sizes`` elements from ``offsets``; ``start``: the flat index of its first element
    in the tensor it was cut from (a box from :func:`flat_boxes` is a contiguous run)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Elements ``lo:hi`` of a row-major tensor of ``shape`` as boxes, in order."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [Box((lo,) if shape else (), (hi - lo,) if shape else (), lo)]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    whole_rows = lo % inner == 0 and hi % inner == 0
    if first == last and not whole_rows:  # within one row: recurse into it
        return [Box((first, *b.offsets), (1, *b.sizes), b.start + first * inner)
                for b in flat_boxes(shape[1:], lo - first * inner, hi - first * inner)]
    a, b = -(-lo // inner) * inner, hi // inner * inner  # the whole rows in between
    boxes = flat_boxes(shape, lo, a) if lo < a else []
    if a < b:
        boxes.append(Box((a // inner,) + (0,) * (len(shape) - 1), ((b - a) // inner, *shape[1:]), a))
    return boxes + (flat_boxes(shape, b, hi) if b < hi else [])


@dataclass(frozen=True)
class Placement:
    """Where a rank's local tensor lies in the global one: along ``dim``, local indices
    ``[local, local + length)`` are global ``[global_, global_ + length)`` for each
    segment; the global tensor's first dimension is cut to ``rows`` (vocabulary padding)."""

    global_shape: tuple[int, ...]
    dim: int
    segments: tuple[tuple[int, int, int], ...]  # (local, global_, length)

    @classmethod
    def of(cls, local_shape: tuple[int, ...], spec: ShardSpec | None, tp_rank: int, tp_size: int,
           rows: int | None = None) -> "Placement":
        """The placement of a parameter with TP ``spec`` on TP rank ``tp_rank`` of ``tp_size``;
        ``rows``: the real vocabulary for a padded table (None: no padding)."""
        local_shape = tuple(local_shape)
        if spec is None or tp_size == 1:
            dim, n, i, parts = 0, 1, 0, 1
        else:
            dim, n, i, parts = spec.dim, spec.slices(tp_size), tp_rank // spec.replicas, spec.parts
        length = local_shape[dim] // parts if local_shape else 1
        segments = tuple((p * length, p * length * n + i * length, length) for p in range(parts))
        full = list(local_shape)
        if full:
            full[dim] = local_shape[dim] * n
            if rows is not None:
                full[0] = rows
        return cls(tuple(full), dim, segments)

    def pieces(self, view: torch.Tensor, box: Box) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """The parts of local ``box`` (whose data ``view`` is, box-shaped) as (global
        offsets, view) pairs: split where it crosses segments, cut at the vocabulary."""
        if not box.offsets:
            return [((), view)]
        out = []
        lo, size = box.offsets[self.dim], box.sizes[self.dim]
        for local, global_, length in self.segments:
            a, b = max(lo, local), min(lo + size, local + length)
            if a >= b:
                continue
            piece = view.narrow(self.dim, a - lo, b - a)
            offsets = list(box.offsets)
            offsets[self.dim] = a - local + global_
            rows = self.global_shape[0] - offsets[0]  # vocabulary padding is never stored
            if rows <= 0:
                continue
            if piece.shape[0] > rows:
                piece = piece.narrow(0, 0, rows)
            out.append((tuple(offsets), piece))
        return out


class Slab:
    """Pieces of one global tensor held by this rank, for DCP to write from or read into
    (each piece a view; see the module docstring)."""

    def __init__(self, global_shape: tuple[int, ...], dtype: torch.dtype,
                 pieces: list[tuple[tuple[int, ...], torch.Tensor]]):
        self.global_shape = torch.Size(global_shape)
        self.dtype = dtype
        self.pieces = {torch.Size(offsets): view for offsets, view in pieces}

    @classmethod
    def of(cls, tensor: torch.Tensor, placement: Placement, dtype: torch.dtype | None = None) -> "Slab":
        """The whole local ``tensor`` (shaped as the parameter) at ``placement``."""
        box = Box((0,) * tensor.dim(), tuple(tensor.shape))
        return cls(placement.global_shape, dtype or tensor.dtype, placement.pieces(tensor, box))

    @classmethod
    def of_flat(cls, flat: torch.Tensor, lo: int, local_shape: tuple[int, ...], placement: Placement) -> "Slab":
        """Elements ``lo:lo + len(flat)`` of the flattened local tensor, held in ``flat``."""
        pieces = []
        for box in flat_boxes(tuple(local_shape), lo, lo + flat.numel()):
            view = flat[box.start - lo: box.start - lo + box.numel].view(box.sizes)
            pieces += placement.pieces(view, box)
        return cls(placement.global_shape, flat.dtype, pieces)

    def size(self) -> torch.Size:
        return self.global_shape

    def nbytes(self) -> int:
        return sum(v.numel() for v in self.pieces.values()) * self.dtype.itemsize

    def to_host(self) -> "Slab":
        """A copy of the pieces in host memory (pinned beside a GPU), for a background write."""
        def copy(v: torch.Tensor) -> torch.Tensor:
            if v.device.type == "cpu":
                return v.clone()
            host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            return host.copy_(v, non_blocking=True)
        return Slab(self.global_shape, self.dtype, [(tuple(o), copy(v)) for o, v in self.pieces.items()])

    # ---- the protocol DCP's planners call (as DTensor implements it) ----------------------

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, view.shape),
                                                      properties=props, size=self.global_shape))
                for offsets, view in self.pieces.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets, view.shape) for offsets, view in self.pieces.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[torch.Size(index.offset)]


@contextmanager
def single_process():
    """Silence DCP's warning that no process group is initialised (a one-process save or
    read is meant to be one)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield

