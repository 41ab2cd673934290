"""Saving and loading training state without ever leaving a half-written checkpoint.

Layout of a save directory::

    DIR/latest                    name of the newest complete step directory
    DIR/step_0000200/model.safetensors   weights, keyed by global parameter names
    DIR/step_0000200/trainer.pt          optimizer state, RNG state
    DIR/step_0000200/meta.json           step, full config, tokenizer

A step directory is written under a temporary name and renamed into place only when
complete, and ``latest`` is replaced atomically after that, so a crash at any moment
leaves the previous checkpoint loadable. Every rank holds the whole model until tensor
or pipeline parallelism splits it, so rank 0 writes alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from gridtrain.config import Config

LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message names the path and the fix."""


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:07d}"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(directory: str | Path, step: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None, cfg: Config) -> Path:
    """Write the state after ``step`` completed steps; collective over the default group."""
    final = step_dir(directory, step)
    if not dist.is_initialized() or dist.get_rank() == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(weights, tmp / "model.safetensors", metadata={"format": "gridtrain"})
        if optimizer is not None:
            torch.save({"optimizer": optimizer.state_dict(),
                        "torch_rng": torch.get_rng_state()}, tmp / "trainer.pt")
        meta = {"step": step, "config": cfg.to_dict()}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomically(final.parent / LATEST, final.name)
    if dist.is_initialized():
        dist.barrier()
    return final


def resolve(directory: str | Path) -> Path:
    """A step directory, given either it or a save directory with a ``latest`` pointer."""
    path = Path(directory)
    if (path / "model.safetensors").is_file():
        return path
    pointer = path / LATEST
    if not pointer.is_file():
        raise CheckpointError(f"--load {directory}: no checkpoint there (no {LATEST} file "
                              "and no model.safetensors); pass a directory written by --save")
    return path / pointer.read_text().strip()


def read_meta(directory: str | Path) -> dict[str, Any]:
    return json.loads((resolve(directory) / "meta.json").read_text())


def load_checkpoint(directory: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load weights (and optimizer/RNG state when given); returns the completed step count."""
    path = resolve(directory)
    weights = load_file(path / "model.safetensors")
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise CheckpointError(f"--load {path}: weights do not match this model ({first}); "
                              "use the same model flags as the saved run") from None
    trainer = path / "trainer.pt"
    if optimizer is not None and trainer.is_file():
        state = torch.load(trainer, weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
    return int(read_meta(path)["step"])
