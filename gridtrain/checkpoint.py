"""Saving and loading training state without ever leaving a half-written checkpoint.

Layout of a save directory::

    DIR/latest                           name of the newest complete step directory
    DIR/step_0000200/model.safetensors   whole weights by global name, no vocabulary padding
    DIR/step_0000200/trainer.pt          optimizer state by parameter name, every rank's RNG
    DIR/step_0000200/meta.json           step, full config

Checkpoints hold whole tensors, whatever the layout that wrote them: TP shards are
gathered on save and re-sliced on load (through each parameter's ShardSpec), so a run
may resume on another tensor-parallel size, and ``gridtrain generate`` needs no grid.
Gathering costs one all-gather per sharded tensor; sharded files are the way for models
too large for one host's memory, and are not built yet.

A step directory is written under a temporary name and renamed into place only when
complete, and ``latest`` is replaced atomically after that, so a crash at any moment
leaves the previous checkpoint loadable.
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
from gridtrain.tensor_parallel import TensorParallel, shard, shard_spec, unshard

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


def _tp_of(ctx) -> TensorParallel:
    return ctx.tp if ctx is not None else TensorParallel()


def _full(local: torch.Tensor, param: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The whole tensor of which ``local`` is this rank's shard (shaped like ``param``),
    without vocabulary padding rows (their number depends on the layout)."""
    spec = shard_spec(param)
    if spec is None or tp.size == 1:
        full = local.detach().cpu()
    else:
        full = unshard([p.cpu() for p in tp.comm.all_gather_list(local.detach())], spec)
    return full[: getattr(param, "vocab_rows", full.shape[0])]


def _local(full: torch.Tensor, param: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's shard of a saved whole tensor, re-padded to this layout's vocabulary."""
    spec = shard_spec(param)
    padded_rows = spec.full_shape(param.shape, tp.size)[0] if spec is not None else param.shape[0]
    if hasattr(param, "vocab_rows") and full.shape[0] < padded_rows:
        full = torch.cat([full, full.new_zeros((padded_rows - full.shape[0], *full.shape[1:]))])
    return full if spec is None or tp.size == 1 else shard(full, spec, tp.rank, tp.size)


def full_model_state(model: nn.Module, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """Whole weights by name; collective over the TP group."""
    return {name: _full(p, p, tp) for name, p in model.named_parameters()}


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         tp: TensorParallel) -> dict[str, dict[str, Any]]:
    """Per-parameter optimizer state by name, with shards made whole; collective over TP."""
    out = {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {})
        out[name] = {k: _full(v, p, tp) if torch.is_tensor(v) and v.shape == p.shape else v
                     for k, v in state.items()}
    return out


def save_checkpoint(directory: str | Path, step: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None, cfg: Config, ctx=None) -> Path:
    """Write the state after ``step`` completed steps; collective over the default group."""
    tp = _tp_of(ctx)
    final = step_dir(directory, step)
    weights = full_model_state(model, tp)
    opt_state = full_optimizer_state(model, optimizer, tp) if optimizer is not None else None
    rng = _gather_rng_states(ctx)
    if not dist.is_initialized() or dist.get_rank() == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file({k: v.contiguous() for k, v in weights.items()}, tmp / "model.safetensors",
                  metadata={"format": "gridtrain"})
        if opt_state is not None:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            torch.save({"state": opt_state, "param_groups": groups, "rng": rng}, tmp / "trainer.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, "config": cfg.to_dict()}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomically(final.parent / LATEST, final.name)
    if dist.is_initialized():
        dist.barrier()
    return final


def _gather_rng_states(ctx) -> list[dict] | None:
    """Every rank's generator states, so that a resume on the same layout replays dropout."""
    mine = {"torch": torch.get_rng_state(),
            "tracker": ctx.tp.rng.get_states() if ctx is not None else {}}
    if ctx is not None and ctx.device.type == "cuda":
        mine["cuda"] = torch.cuda.get_rng_state(ctx.device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _restore_rng(states: list[dict] | None, ctx) -> None:
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not states or len(states) != world:
        return  # another layout: its streams do not map onto this one's
    mine = states[dist.get_rank() if dist.is_initialized() else 0]
    torch.set_rng_state(mine["torch"])
    if ctx is not None:
        ctx.tp.rng.set_states(mine["tracker"])
        if "cuda" in mine and ctx.device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda"], ctx.device)


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


@torch.no_grad()
def load_checkpoint(directory: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, ctx=None) -> int:
    """Load weights (and optimizer/RNG state when given); returns the completed step count."""
    tp = _tp_of(ctx)
    path = resolve(directory)
    weights = load_file(path / "model.safetensors")
    params = dict(model.named_parameters())
    missing, unexpected = params.keys() - weights.keys(), weights.keys() - params.keys()
    if missing or unexpected:
        detail = f"missing {sorted(missing)[:3]}" if missing else f"unexpected {sorted(unexpected)[:3]}"
        raise CheckpointError(f"--load {path}: weights do not match this model ({detail}); "
                              "use the same model flags as the saved run")
    for name, p in params.items():
        local = _local(weights[name], p, tp)
        if local.shape != p.shape:
            raise CheckpointError(f"--load {path}: {name} has shape {tuple(weights[name].shape)}, "
                                  "which does not fit this model; use the same model flags as the saved run")
        p.copy_(local)
    trainer = path / "trainer.pt"
    if optimizer is not None and trainer.is_file():
        saved = torch.load(trainer, weights_only=False)
        for name, p in params.items():
            state = saved["state"].get(name)
            if state:
                optimizer.state[p] = {k: _local(v, p, tp).to(p.device) if torch.is_tensor(v) and v.dim() else v
                                      for k, v in state.items()}
        for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
            group.update(saved_group)
        _restore_rng(saved.get("rng"), ctx)
    return int(read_meta(path)["step"])
