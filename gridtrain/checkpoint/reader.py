"""Reading a checkpoint one tensor at a time, in one process, without its layout:
``export-hf``, ``generate``, :func:`gridtrain.load_model`, ``--init-from`` and
``gridtrain checkpoint info``.

:class:`ShardedTensors` offers a format-2 checkpoint's weights by global name through the
same small interface as :class:`~gridtrain.checkpoint.tensor_files.TensorFiles` (``names``,
``spec``, ``meta``, ``get``): shapes and dtypes come from DCP's index without reading
data, and ``get`` asks DCP for one whole tensor, which reads the parts of the chunks
that make it up (from every rank's file) and nothing else. A reader's memory is the
tensor it asked for plus the largest stored chunk, whatever the model's size.

:func:`describe` is what ``gridtrain checkpoint info DIR`` prints: the step, the layout
that wrote it, the model, the bytes of weights and optimizer state and of each rank's
file, and the integrity check (every file's size and sha256 against the manifest).

DCP is imported only when a sharded checkpoint is read (about 1 s per process otherwise).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from gridtrain.checkpoint.loadable import check_loadable, model_of_meta
from gridtrain.checkpoint.manifest import (DCP_METADATA, MANIFEST, is_sharded, read_manifest, read_meta_file,
                                           weight_files)
from gridtrain.checkpoint.shards import single_process
from gridtrain.checkpoint.sharded import stored_index
from gridtrain.checkpoint.tensor_files import TensorFiles

MODEL_PREFIX = "model/"


class ShardedTensors:
    """A format-2 checkpoint's weights by global name, each read whole on demand."""

    def __init__(self, step: Path):
        self.step = Path(step)
        self.index = stored_index(self.step)
        self.keys = {k[len(MODEL_PREFIX):]: k for k in self.index if k.startswith(MODEL_PREFIX)}
        from gridtrain.checkpoint.dcp_io import IndexedReader
        self._reader = IndexedReader(self.step)

    def names(self) -> list[str]:
        return list(self.keys)

    def __contains__(self, name: str) -> bool:
        return name in self.keys

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        md = self.index[self.keys[name]]
        return md.properties.dtype, tuple(md.size)

    def meta(self, name: str) -> torch.Tensor:
        dtype, shape = self.spec(name)
        return torch.empty(shape, dtype=dtype, device="meta")

    def get(self, name: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        from gridtrain.checkpoint.dcp_io import LoadPlanner
        dtype, shape = self.spec(name)
        tensor = torch.empty(shape, dtype=dtype)
        with single_process():
            dcp.load({self.keys[name]: tensor}, storage_reader=self._reader, planner=LoadPlanner(), no_dist=True)
        return tensor

    __getitem__ = get


def weight_tensors(step: Path) -> ShardedTensors | TensorFiles:
    """A checked step directory's weights by global name, read one at a time (either format)."""
    return ShardedTensors(step) if is_sharded(step) else TensorFiles.of_files(weight_files(step))


# ---- gridtrain checkpoint info ------------------------------------------------------------------


def _chunk_bytes(md) -> int:
    return sum(math.prod(c.sizes) for c in md.chunks) * md.properties.dtype.itemsize


def describe(directory: str | Path, *, verify: bool = True) -> dict[str, Any]:
    """What a checkpoint holds, as JSON-able data (``gridtrain checkpoint info``). With
    ``verify`` every file is hashed against the manifest first (else sizes only); a
    damaged checkpoint is a one-line :class:`~gridtrain.checkpoint.errors.CheckpointError`."""
    step = check_loadable(directory, verify_data=verify, flag="checkpoint info")
    meta = read_meta_file(step, "checkpoint info")
    model = model_of_meta(meta, f"checkpoint info {directory}")
    files = read_manifest(step, "checkpoint info")
    info: dict[str, Any] = {
        "path": str(step), "step": meta["step"], "format": meta.get("version", 1),
        "layout": meta.get("layout"), "model": {k: v for k, v in vars(model).items() if v is not None},
        "optimizer_step": (meta.get("optimizer") or {}).get("step"), "scaler": meta.get("scaler"),
        "data": meta.get("data"),
        "integrity": {"files": len(files) + 1, "checked": "sha256" if verify else "sizes",
                      "bytes_on_disk": sum(e["size"] for e in files.values()) + (step / MANIFEST).stat().st_size},
    }
    if is_sharded(step):
        index = stored_index(step)
        tensors = {k: v for k, v in index.items() if hasattr(v, "chunks")}
        weights = {k: v for k, v in tensors.items() if k.startswith(MODEL_PREFIX)}
        info["parameters"] = sum(math.prod(v.size) for v in weights.values())
        info["bytes"] = {"weights": sum(_chunk_bytes(v) for v in weights.values()),
                         "optimizer": sum(_chunk_bytes(v) for k, v in tensors.items() if k.startswith("optim/")),
                         "other": sum(_chunk_bytes(v) for k, v in tensors.items()
                                      if not k.startswith((MODEL_PREFIX, "optim/")))}
        info["dtypes"] = sorted({str(v.properties.dtype).replace("torch.", "") for v in weights.values()})
        info["files"] = {name: e["size"] for name, e in sorted(files.items()) if name.endswith(".distcp")}
        info["files"][DCP_METADATA] = files[DCP_METADATA]["size"]
    else:
        source = TensorFiles.of_files(weight_files(step))
        specs = [source.spec(n) for n in source.names()]
        info["parameters"] = sum(math.prod(shape) for _, shape in specs)
        info["bytes"] = {"weights": sum(math.prod(shape) * dtype.itemsize for dtype, shape in specs)}
        info["dtypes"] = sorted({str(dtype).replace("torch.", "") for dtype, _ in specs})
        info["files"] = {name: e["size"] for name, e in sorted(files.items())}
    return info


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def format_info(info: dict[str, Any]) -> str:
    """``describe``'s data as the lines ``checkpoint info`` prints."""
    m, layout = info["model"], info.get("layout")
    lines = [f"checkpoint {info['path']}: step {info['step']}, format {info['format']} "
             f"({'sharded, torch.distributed.checkpoint' if info['format'] >= 2 else 'whole tensors'})"]
    if layout:
        lines.append("written by: " + ", ".join(f"{k} {v}" for k, v in layout.items()))
    heads = f"{m['n_head']} heads" + (f", {m['n_kv_head']} kv heads" if m.get("n_kv_head") else "")
    lines.append(f"model: {m.get('arch', 'gpt2')}, {m['n_layer']} layers, d_model {m['d_model']}, {heads}, "
                 f"vocabulary {m['vocab_size']}, seq_len {m['seq_len']}; {info['parameters']:,} parameters "
                 f"({', '.join(info['dtypes'])})")
    sizes = ", ".join(f"{k} {_size(v)}" for k, v in info["bytes"].items() if v)
    lines.append(f"state: {sizes}" + (f"; optimizer step {info['optimizer_step']}"
                                      if info.get("optimizer_step") is not None else ""))
    if info.get("data"):
        lines.append("data: " + ", ".join(f"{k} {v}" for k, v in info["data"].items()))
    if info.get("scaler"):
        lines.append("fp16 loss scaler: " + ", ".join(f"{k} {v}" for k, v in info["scaler"].items()))
    lines.append("files: " + ", ".join(f"{k} {_size(v)}" for k, v in info["files"].items()))
    integrity = info["integrity"]
    lines.append(f"integrity: ok ({integrity['files']} files, {integrity['checked']} checked against "
                 f"{MANIFEST}, {_size(integrity['bytes_on_disk'])} on disk)")
    return "\n".join(lines)


def info_command(directory: str, as_json: bool = False, verify: bool = True) -> str:
    info = describe(directory, verify=verify)
    return json.dumps(info, indent=1) if as_json else format_info(info)
