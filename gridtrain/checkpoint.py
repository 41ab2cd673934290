"""Saving and loading training state without ever leaving a half-written checkpoint.

Layout of a save directory::

    DIR/latest                                 name of the newest complete step directory
    DIR/step_0000200/model-pp000.safetensors   one file per pipeline stage: whole tensors
                                               by global name, no vocabulary padding
    DIR/step_0000200/trainer-pp000.pt          optimizer state by parameter name (and, in
                                               stage 0's file, every rank's RNG state)
    DIR/step_0000200/meta.json                 step, full config

Checkpoints hold whole tensors with global names, whatever the layout that wrote them:
TP shards are gathered on save and re-sliced on load (through each parameter's
ShardSpec), the stages' files are merged on load, so a run may resume on another
tensor- or pipeline-parallel layout, and ``gridtrain generate`` needs no grid.
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
    """This stage's whole weights by global name (TP shards gathered, padding dropped, a
    tied head copy left out); collective over the TP group."""
    return {name: _full(p, p, tp) for name, p in model.named_parameters()
            if not getattr(p, "tied_copy", False)}


def gather_model(model: nn.Module, ctx) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on rank 0 (None elsewhere), from any layout; collective
    over the world. For models that fit one host (sampling at the end of a run)."""
    mine = full_model_state(model, _tp_of(ctx))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    writer = ctx.coords.dp == 0 and ctx.coords.tp == 0
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine if writer else {}, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts is not None else None


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         tp: TensorParallel) -> dict[str, dict[str, Any]]:
    """Per-parameter optimizer state by name, with shards made whole; collective over TP."""
    out = {}
    states = optimizer.state_by_param() if hasattr(optimizer, "state_by_param") else optimizer.state
    for name, p in model.named_parameters():
        state = states.get(p, {})
        out[name] = {k: _full(v, p, tp) if torch.is_tensor(v) and v.shape == p.shape else v
                     for k, v in state.items()}
    return out


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(directory: str | Path, step: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None, cfg: Config, ctx=None) -> Path:
    """Write the state after ``step`` completed steps; collective over the default group.

    The first DP/TP rank of each pipeline stage writes that stage's tensors (TP shards
    gathered whole; a last stage's copy of the tied embedding is left out, it equals the
    first stage's), into a temporary directory that rank 0 renames into place once all
    files are complete.
    """
    tp = _tp_of(ctx)
    final = step_dir(directory, step)
    tmp = final.with_name(f".{final.name}.tmp")
    stage = ctx.coords.pp if ctx is not None else 0
    writer = ctx is None or (ctx.coords.dp == 0 and ctx.coords.tp == 0)
    weights = full_model_state(model, tp)
    opt_state = full_optimizer_state(model, optimizer, tp) if optimizer is not None else None
    rng = _gather_rng_states(ctx)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    if writer:
        save_file({k: v.contiguous() for k, v in weights.items()}, tmp / f"model-pp{stage:03d}.safetensors",
                  metadata={"format": "gridtrain"})
        if opt_state is not None:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            state = {k: v for k, v in opt_state.items() if k in weights}
            torch.save({"state": state, "param_groups": groups, "rng": rng if rank0 else None},
                       tmp / f"trainer-pp{stage:03d}.pt")
    _barrier()
    if rank0:
        (tmp / "meta.json").write_text(json.dumps({"step": step, "config": cfg.to_dict()}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomically(final.parent / LATEST, final.name)
    _barrier()
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
    if (path / "meta.json").is_file():
        return path
    pointer = path / LATEST
    if not pointer.is_file():
        raise CheckpointError(f"--load {directory}: no checkpoint there (no {LATEST} file "
                              "and no meta.json); pass a directory written by --save")
    return path / pointer.read_text().strip()


def read_meta(directory: str | Path) -> dict[str, Any]:
    return json.loads((resolve(directory) / "meta.json").read_text())


def _merged(path: Path, pattern: str, read) -> dict[str, Any]:
    """The union of every pipeline stage's file (names are global)."""
    merged: dict[str, Any] = {}
    for file in sorted(path.glob(pattern)):
        merged.update(read(file))
    return merged


def _source_name(name: str, param: torch.Tensor) -> str:
    """A last stage's tied head loads the embedding it is a copy of."""
    return "embedding.word.weight" if getattr(param, "tied_copy", False) else name


@torch.no_grad()
def load_checkpoint(directory: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, ctx=None) -> int:
    """Load weights (and optimizer/RNG state when given) into whatever part of the model
    this rank holds, in whatever layout; returns the completed step count."""
    tp = _tp_of(ctx)
    path = resolve(directory)
    weights = _merged(path, "model-pp*.safetensors", load_file)
    params = dict(model.named_parameters())
    missing = sorted(n for n, p in params.items() if _source_name(n, p) not in weights)
    if missing:
        raise CheckpointError(f"--load {path}: weights do not match this model (missing {missing[:3]}); "
                              "use the same model flags as the saved run")
    for name, p in params.items():
        saved = weights[_source_name(name, p)]
        local = _local(saved, p, tp)
        if local.shape != p.shape:
            raise CheckpointError(f"--load {path}: {name} has shape {tuple(saved.shape)}, "
                                  "which does not fit this model; use the same model flags as the saved run")
        p.copy_(local)
    trainers = [torch.load(f, weights_only=False) for f in sorted(path.glob("trainer-pp*.pt"))]
    if optimizer is not None:
        state_by_name = {k: v for t in trainers for k, v in t["state"].items()}
        states = {}
        for name, p in params.items():
            state = state_by_name.get(_source_name(name, p))
            if state:
                states[p] = {k: _local(v, p, tp).to(p.device) if torch.is_tensor(v) and v.dim() else v
                             for k, v in state.items()}
        if hasattr(optimizer, "load_state_by_param"):
            optimizer.load_state_by_param(states)  # also restarts master weights from the loaded ones
        else:
            optimizer.state.update(states)
        if trainers:
            for group, saved_group in zip(optimizer.param_groups, trainers[0]["param_groups"]):
                group.update(saved_group)
            _restore_rng(trainers[0].get("rng"), ctx)
    return int(read_meta(path)["step"])
