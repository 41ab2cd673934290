"""Whole tensors by global name, whatever the layout: what the end-of-run sample needs,
and the loader of format 1 (the whole-tensor
checkpoints written before the sharded format, and by ``gridtrain import-hf``).

Format 1 step directories hold ``model-pp<stage>.safetensors`` (each stage's whole
tensors by global name, no vocabulary padding) and ``trainer-pp<stage>.pt`` (optimizer
state by parameter name, fp16's loss scaler, every rank's RNG state in stage 0's file).
Every rank reads every file and slices its shard; that is only right for models that fit
one host, which is why gridtrain now writes the sharded format (sharded.py) and keeps
this reader so that old checkpoints still load.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from gridtrain.checkpoint.errors import REDO, CheckpointError, first_line
from gridtrain.checkpoint.manifest import is_trainer, is_weights, read_manifest
from gridtrain.checkpoint.sharded import model_buffers, source_name
from gridtrain.parallel.tensor_parallel import TensorParallel, shard, split_over, unshard
from gridtrain.optim.interface import Optimizer



def _tp_of(ctx) -> TensorParallel:
    return ctx.tp if ctx is not None else TensorParallel()


def _full(local: torch.Tensor, param: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The whole tensor of which ``local`` is this rank's shard (shaped like ``param``),
    without vocabulary padding rows (their number depends on the layout)."""
    spec, group = split_over(param, tp)  # over tp, or an expert's slice over its etp group
    if spec is None or group.size == 1:
        full = local.detach().cpu()
    else:
        full = unshard([p.cpu() for p in group.all_gather_list(local.detach())], spec)
    return full[: getattr(param, "vocab_rows", full.shape[0])]


def _local(full: torch.Tensor, param: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's shard of a saved whole tensor, re-padded to this layout's vocabulary."""
    spec, group = split_over(param, tp)  # over tp, or an expert's slice over its etp group
    padded_rows = spec.full_shape(param.shape, group.size)[0] if spec is not None else param.shape[0]
    if hasattr(param, "vocab_rows") and full.shape[0] < padded_rows:
        full = torch.cat([full, full.new_zeros((padded_rows - full.shape[0], *full.shape[1:]))])
    return full if spec is None or group.size == 1 else shard(full, spec, group.rank, group.size)


def full_model_state(model: nn.Module, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This stage's whole weights by global name (TP shards gathered, padding dropped, a
    tied head copy left out); collective over the TP group."""
    return {**{name: _full(p, p, tp) for name, p in model.named_parameters() if not getattr(p, "tied_copy", False)},
            **{name: b.detach().cpu() for name, b in model_buffers(model)}}  # replicated: a MoE's expert bias


def gather_model(model: nn.Module, ctx) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on rank 0 (None elsewhere), from any layout; collective
    over the world. For models that fit one host (sampling at the end of a run)."""
    mine = full_model_state(model, _tp_of(ctx))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    # one copy of each weight: the first dp x cp replica's, and of a rank's experts (which
    # differ across the expert-parallel group) the first of the ranks holding them
    first_tp = ctx.coords.tp == 0
    dense = first_tp and ctx.coords.dp == 0 and getattr(ctx.coords, "cp", 0) == 0
    experts = getattr(ctx, "expert_dp_cp", None)
    folded = getattr(getattr(ctx, "ep", None), "folded", False)  # experts differ across tp too
    expert_writer = (first_tp or folded) and (experts.rank == 0 if experts is not None else dense)
    params = dict(model.named_parameters())
    sent = {k: v for k, v in mine.items()
            if (expert_writer if getattr(params.get(k), "expert", False) else dense)}
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(sent, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts is not None else None


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





def _read_file(path: Path, name: str, read):
    try:
        return read(path / name)
    except Exception as exc:  # safetensors, pickle, zip: whatever the damage, one line
        raise CheckpointError(f"--load {path}: {name} cannot be read ({type(exc).__name__}: "
                              f"{first_line(exc)}); {REDO}") from None


@torch.no_grad()
def copy_weights(weights, model: nn.Module, tp: TensorParallel, where: str) -> dict[nn.Parameter, torch.Tensor]:
    """Copy this rank's shard of each parameter from ``weights`` (whole tensors by global
    name: a dict, or any mapping that makes each on demand, as a Hugging Face source
    does); returns each parameter's shard at the saved precision (master weights)."""
    params = dict(model.named_parameters())
    missing = sorted(n for n, p in params.items() if source_name(n, p) not in weights)
    if missing:
        raise CheckpointError(f"{where}: the checkpoint has no weights for {', '.join(missing[:3])}"
                              f"{' ...' if len(missing) > 3 else ''}; use the same model flags as the saved run")
    saved_local: dict[nn.Parameter, torch.Tensor] = {}
    for name, p in params.items():
        saved = weights[source_name(name, p)]
        local = _local(saved, p, tp)
        if local.shape != p.shape:
            raise CheckpointError(f"{where}: {name} has shape {tuple(saved.shape)}, "
                                  "which does not fit this model; use the same model flags as the saved run")
        p.copy_(local)
        saved_local[p] = local
    return saved_local


@torch.no_grad()
def load_whole(path: Path, model: nn.Module, optimizer: Optimizer | None = None, ctx=None, *,
               scaler=None) -> None:
    """Load a checked format-1 step directory into whatever part of the model this rank
    holds, in whatever layout (every rank reads every file and slices its shard).

    Master weights: the optimizer (``load_state_by_param``) takes the saved ``master``
    tensors, or, from a checkpoint without them (an fp32 run's), the saved weights at
    their full precision rather than the parameters already rounded to this run's dtype
    (AdamW on the parameters copies them into the parameters). ``scaler`` takes the saved scale and counters when the checkpoint has them."""
    tp = _tp_of(ctx)
    files = sorted(read_manifest(path, "--load"))
    weights: dict[str, torch.Tensor] = {}
    for name in filter(is_weights, files):  # the union of every stage's file (names are global)
        weights.update(_read_file(path, name, load_file))
    saved_local = copy_weights(weights, model, tp, f"--load {path}")
    params = dict(model.named_parameters())
    trainers = [_read_file(path, name, lambda f: torch.load(f, weights_only=False))
                for name in filter(is_trainer, files)]
    if optimizer is not None:
        try:
            state_by_name = {k: v for t in trainers for k, v in t["state"].items()}
            groups = trainers[0]["param_groups"] if trainers else []
            rng = trainers[0].get("rng") if trainers else None
        except (KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"--load {path}: a trainer-pp*.pt file lacks optimizer state "
                                  f"({first_line(exc)}); {REDO}") from None
        states = {}
        for name, p in params.items():
            state = {k: _local(v, p, tp).to(p.device) if torch.is_tensor(v) and v.dim() else v
                     for k, v in (state_by_name.get(source_name(name, p)) or {}).items()}
            state.setdefault("master", saved_local[p].to(p.device))  # an fp32 run saved no masters
            states[p] = state
        optimizer.load_state_by_param(states)
        if trainers:
            for group, saved_group in zip(optimizer.param_groups, groups):
                group.update(saved_group)
            _restore_rng(rng, ctx)
    saved_scaler = trainers[0].get("scaler") if trainers and isinstance(trainers[0], dict) else None
    if scaler is not None and saved_scaler:
        scaler.load_state_dict(saved_scaler)
