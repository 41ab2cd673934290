"""DCP's planners, file writer and readers for :class:`~gridtrain.checkpoint.shards.Slab`
pieces: what sharded.py and reader.py hand to ``dcp.save`` and ``dcp.load``.

Imported only inside the functions that write or read a checkpoint: importing
torch.distributed.checkpoint costs about 1 s per process, which runs that never save
or load one (most spawned workers) do not pay.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import filesystem as dcp_files
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType

from gridtrain.checkpoint.errors import first_line
from gridtrain.checkpoint.shards import Slab


def _lookup(state_dict: dict, index: MetadataIndex):
    obj = state_dict[index.fqn]
    return obj.__get_tensor_shard__(index) if isinstance(obj, Slab) else obj


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner (replicas written once, by the least loaded rank holding
    them) with :class:`Slab` values."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        return _lookup(self.state_dict, index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with :class:`Slab` destinations."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # the default one first maps every value it does not know (a Slab) to None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index)


class Writer(FileSystemWriter):
    """DCP's file writer (one file per rank, synced), writing one chunk at a time.

    torch's own writer keeps every tensor it wrote in a dictionary until the rank's file
    is done (for its safetensors option), after cloning each view of a larger storage
    (so that ``torch.save`` does not write the whole storage): a rank whose pieces are
    views, a ZeRO-1 shard's boxes of its flat buffers, would hold a second copy of its
    whole state. Here each view is cloned, written and dropped before the next, so a
    save needs at most the largest piece on top of the rank's own state. The file format
    is torch's (``_write_item``), so DCP's reader reads it unchanged.
    """

    def __init__(self, path):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)

    def write_data(self, plan, planner) -> torch.futures.Future:
        name = f"{plan.storage_data.prefix}0{dcp_files.DEFAULT_SUFFIX}"
        results = []
        with open(self.fs.concat_path(self.path, name), "wb") as stream:
            for item in sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO):
                data = planner.resolve_data(item)
                if isinstance(data, torch.Tensor):
                    data = data.detach().cpu()
                    if data.untyped_storage().nbytes() != data.nbytes:
                        data = data.clone()  # a view: write its own elements only
                results.append(dcp_files._write_item(self.transforms, stream, data, item, name,
                                                     self.serialization_format))
                del data
            stream.flush()
            os.fsync(stream.fileno())
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(results)
        return future


class Unreadable(Exception):
    """A stored file that DCP could not read; the message names it."""


class Reader(FileSystemReader):
    """DCP's file reader, one file at a time, so that a failure names the file."""

    def read_data(self, plan, planner):
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(replace(plan, items=items), planner).wait()
            except Exception as exc:
                raise Unreadable(f"{name} cannot be read ({type(exc).__name__}: {first_line(exc)})") from None
        return super().read_data(replace(plan, items=[]), planner)


class IndexedReader(FileSystemReader):
    """DCP's file reader with its index read once (not once per tensor)."""

    def __init__(self, path: Path):
        super().__init__(path)
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata
