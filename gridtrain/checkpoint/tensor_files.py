"""Safetensors files read and written one tensor at a time.

Converting a model between formats must never hold two copies of it (a 405B model is
800 GB in bf16), so both directions stream:

* :class:`TensorFiles` reads tensors by name from a set of safetensors files (one file,
  a sharded Hugging Face directory, or a checkpoint's per-stage files) through
  ``safe_open``, which memory-maps each file: only the tensor asked for is read, and
  shapes and dtypes come from the headers without reading any data;
* :class:`StreamingWriter` writes one safetensors file whose header is known in
  advance (names, dtypes and shapes: see :func:`plan_of`), then each tensor's bytes in
  turn, so a file of any size is written holding one tensor at a time.
  ``safetensors.torch.save_file`` would need the whole dictionary of tensors in memory.

The file format (safetensors' documented layout): an 8-byte little-endian header
length, a JSON header mapping each name to its dtype, shape and ``data_offsets``
(begin, end) into the byte buffer that follows, optional string ``__metadata__``; the
header is padded with spaces to a multiple of 8 bytes, so tensors stay aligned.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

# safetensors' dtype names
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
               torch.uint8: "U8", torch.bool: "BOOL"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]  # name, dtype, shape


class TensorFiles:
    """Tensors by name from several safetensors files, read lazily (see the module docstring).

    ``where`` maps each tensor name to the file that holds it; :meth:`of_files` builds it
    from the files' headers. Files are opened once each and kept open (memory-mapped).
    """

    def __init__(self, where: dict[str, Path]):
        self.where = dict(where)
        self._open: dict[Path, object] = {}
        self._headers: dict[Path, tuple[int, dict]] = {}  # data start, header (for box reads)

    @classmethod
    def of_files(cls, files: Iterable[Path]) -> "TensorFiles":
        where: dict[str, Path] = {}
        for file in files:
            for name in _handle(file).keys():
                where[name] = Path(file)
        return cls(where)

    def names(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _file(self, name: str):
        path = self.where[name]
        if path not in self._open:
            self._open[path] = _handle(path)
        return self._open[path]

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """Dtype and shape from the file's header; nothing is read."""
        view = self._file(name).get_slice(name)
        return DTYPES[view.get_dtype()], tuple(view.get_shape())

    def meta(self, name: str) -> torch.Tensor:
        """A tensor on the meta device with the stored dtype and shape (for planning)."""
        dtype, shape = self.spec(name)
        return torch.empty(shape, dtype=dtype, device="meta")

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)

    def box(self, name: str, box: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor:
        """Only the elements of ``box`` (offsets, sizes) of a stored tensor, read with
        ``pread`` (not through the memory map: the pages of a map count in the reading
        process's resident memory, and each rank of a layout reads its own part): one
        read per contiguous run of the box (the box whole when it spans whole rows)."""
        dtype, shape = self.spec(name)
        begin = self._data_start(name)
        out = torch.empty(box[1], dtype=dtype)
        with open(self.where[name], "rb") as f:
            for start, view in _runs(shape, box, out):
                data = os.pread(f.fileno(), view.numel() * dtype.itemsize, begin + start * dtype.itemsize)
                view.copy_(torch.frombuffer(bytearray(data), dtype=dtype).view(view.shape))
        return out

    def _data_start(self, name: str) -> int:
        """The byte where ``name``'s data begins in its file (from the header)."""
        path = self.where[name]
        if path not in self._headers:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                self._headers[path] = (8 + length, json.loads(f.read(length)))
        data, header = self._headers[path]
        return data + header[name]["data_offsets"][0]

    __getitem__ = get  # a mapping by name, as checkpoint.copy_weights reads weights


def _runs(shape: tuple[int, ...], box: tuple[tuple[int, ...], tuple[int, ...]], out: torch.Tensor):
    """The contiguous runs of ``box`` in a row-major tensor of ``shape``: (flat index of
    the run's first element, the view of ``out`` it fills). A box is one run when every
    dimension after its last partial one is whole and every one before it is a single
    index; otherwise it is cut into single indices along the first dimension that is not."""
    offsets, sizes = box
    partial = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    cut = next((d for d in range(partial[-1]) if sizes[d] > 1), None) if partial else None
    if cut is None:
        yield sum(o * math.prod(shape[d + 1:]) for d, o in enumerate(offsets)), out
        return
    for i in range(sizes[cut]):
        sub = (tuple(o + i if d == cut else o for d, o in enumerate(offsets)),
               tuple(1 if d == cut else n for d, n in enumerate(sizes)))
        yield from _runs(shape, sub, out.narrow(cut, i, 1))


def _handle(path: Path):
    return safe_open(str(path), framework="pt")


def plan_of(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """Name, dtype and shape of each tensor (meta tensors are fine: no data is touched)."""
    return [(name, t.dtype, tuple(t.shape)) for name, t in tensors]


def nbytes(spec: TensorSpec) -> int:
    _, dtype, shape = spec
    count = 1
    for n in shape:
        count *= n
    return count * dtype.itemsize


class StreamingWriter:
    """One safetensors file written tensor by tensor, in the order of ``plan``.

    Used as a context manager: the header is written on entry, :meth:`write` appends one
    tensor (which must be the next one of the plan, with its dtype and shape), and a
    clean exit checks that every planned tensor was written and syncs the file.
    """

    def __init__(self, path: Path, plan: list[TensorSpec], metadata: dict[str, str] | None = None):
        self.path, self.plan = Path(path), list(plan)
        header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for spec in self.plan:
            name, dtype, shape = spec
            size = nbytes(spec)
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        self._header = blob + b" " * (-len(blob) % 8)
        self._next = 0
        self._file = None

    def __enter__(self) -> "StreamingWriter":
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(self._header)))
        self._file.write(self._header)
        return self

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected, dtype, shape = self.plan[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (expected, dtype, shape):
            raise ValueError(f"{self.path.name}: got {name} {tensor.dtype} {tuple(tensor.shape)}, the plan says "
                             f"{expected} {dtype} {shape}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self._next += 1

    def __exit__(self, kind, value, traceback) -> None:
        try:
            if kind is None:
                if self._next != len(self.plan):
                    raise ValueError(f"{self.path.name}: {len(self.plan) - self._next} planned tensors not written")
                self._file.flush()
                os.fsync(self._file.fileno())
        finally:
            self._file.close()
