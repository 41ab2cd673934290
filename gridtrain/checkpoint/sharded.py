"""Sharded checkpoints on torch.distributed.checkpoint (DCP): every rank writes only what
it owns, and any layout reads just the slices it needs.

Layout of a step directory (format 2)::

    DIR/latest                           name of the newest complete step directory
    DIR/step_0000200/.metadata           DCP's index: each tensor's global shape and dtype,
                                         and where each of its chunks is stored
    DIR/step_0000200/__<rank>_0.distcp   the chunks rank <rank> wrote
    DIR/step_0000200/meta.json           format, step, config, the layout that wrote it,
                                         optimizer step and groups, loss scaler, data position
    DIR/step_0000200/manifest.json       size and sha256 of every other file; written last

Keys are global names, the same whatever the layout (the global layer index, no ``pp``
or ``tp`` in them):

* ``model/<param>``: the weights in the run's dtype, vocabulary padding cut off; a last
  stage's copy of the tied embedding is not stored (it is ``embedding.word.weight``);
* ``optim/<param>/exp_avg``, ``.../exp_avg_sq``: AdamW's moments, per parameter also
  under ZeRO-1 (each DP rank writes the boxes of its flat range: shards.py);
  ``.../master``: fp32 master weights where they differ from the weights (bf16, fp16);
* ``rng/<rank>``: each rank's generator states (CPU, CUDA, the TP tracker), restored
  when the layout is the same.

Tensor-parallel shards are boxes of the global tensors (shards.py); replicas (DP copies,
TP-replicated parameters, shared key/value heads) are the same box on several ranks, of
which one, picked by a stable hash of the key (:func:`writes`), offers it to DCP, so the
ranks' files sum to the model and optimizer state once, spread over the replicas, and a
rank stages for a background write only what it writes. No rank gathers a tensor: each piece is written
from, and read into, a view of the memory that holds it. Loading builds the same boxes
for the loading layout and DCP reads the overlapping parts of the stored chunks, which
is how a checkpoint moves between any dp, pp, vpp, tp, ZeRO and SP.

Files are sealed (fsync, sha256) by the rank that wrote them; rank 0 writes meta.json
and the manifest and moves the directory into place (integrity.py), so a checkpoint is
``latest`` only when every rank's part and the metadata are complete.
"""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from gridtrain.checkpoint.integrity import (DCP_METADATA, META, CheckpointError, _all_gather,
                                            _broadcast_from_rank0, _first_line, _new_tmp_dir, _raise_everywhere,
                                            _REDO, _seal, _swap_into_place, _write_atomically, _write_manifest,
                                            step_dir)
from gridtrain.checkpoint.shards import LoadPlanner, Placement, SavePlanner, Slab, Writer, single_process
from gridtrain.config import Config
from gridtrain.parallel.tensor_parallel import TensorParallel, shard_spec

FORMAT = "gridtrain-checkpoint"
VERSION = 2
MOMENTS = ("exp_avg", "exp_avg_sq")


def model_key(name: str) -> str:
    return f"model/{name}"


def optim_key(name: str, what: str) -> str:
    return f"optim/{name}/{what}"


def rng_key(rank: int) -> str:
    return f"rng/{rank}"


def _tp_of(ctx) -> TensorParallel:
    return ctx.tp if ctx is not None else TensorParallel()


def _rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _source_name(name: str, param: torch.Tensor) -> str:
    """A last stage's tied head is stored as the embedding it is a copy of."""
    return "embedding.word.weight" if getattr(param, "tied_copy", False) else name


def placement(param: torch.Tensor, tp: TensorParallel) -> Placement:
    return Placement.of(tuple(param.shape), shard_spec(param), tp.rank, tp.size, getattr(param, "vocab_rows", None))


def keeps_masters(optimizer) -> bool:
    """The flat-buffer optimizer (distributed_optimizer.py), as opposed to torch's AdamW."""
    return optimizer is not None and hasattr(optimizer, "pieces")


def layout_of(cfg: Config, ctx) -> dict[str, Any]:
    """The layout a checkpoint was written by (meta.json; ``checkpoint info``)."""
    grid = getattr(ctx, "grid", None)
    return {"world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "dp": grid.dp if grid else 1, "tp": grid.tp if grid else 1, "pp": grid.pp if grid else 1,
            "vpp": cfg.parallel.vpp, "schedule": cfg.parallel.schedule, "zero": cfg.training.zero,
            "sequence_parallel": cfg.parallel.sequence_parallel, "dtype": cfg.training.dtype}


# ---- what a rank writes ------------------------------------------------------------------------


def writes(key: str, param: torch.Tensor, ctx, dp_copies: bool = True) -> bool:
    """Whether this rank writes ``key``'s pieces of ``param``: of the ranks that hold the
    same pieces (its DP replicas when ``dp_copies``, and the TP ranks holding the same
    slice: all of them for a replicated parameter, ``spec.replicas`` for shared kv
    heads), the one a stable hash of the key picks, so that every piece is written once
    and the writes spread over the replicas. Decided before anything is staged: a rank
    copies to host memory only what it writes."""
    if ctx is None:
        return True
    spec, tp = shard_spec(param), ctx.tp
    tp_copies = tp.size if spec is None else (spec.replicas if tp.size > 1 else 1)
    dp = ctx.grid.dp if dp_copies else 1
    index = (ctx.coords.dp if dp_copies else 0) * tp_copies + tp.rank % tp_copies
    return zlib.crc32(key.encode()) % (dp * tp_copies) == index


def state_to_save(model: nn.Module, optimizer, ctx) -> dict[str, Any]:
    """The pieces this rank writes (:func:`writes`), by global key, as :class:`Slab` views
    of the memory that holds them (nothing is copied), plus its RNG states."""
    tp = _tp_of(ctx)
    names = {p: name for name, p in model.named_parameters()}
    state: dict[str, Any] = {}
    for name, p in model.named_parameters():
        if not getattr(p, "tied_copy", False) and writes(model_key(name), p, ctx):
            state[model_key(name)] = Slab.of(p.detach(), placement(p, tp))
    if keeps_masters(optimizer):
        masters = optimizer.master.dtype != optimizer.params[0].dtype if optimizer.params else False
        sharded = optimizer.reducer.shard  # ZeRO-1: each DP rank its own range; else DP replicas
        for q in optimizer.pieces:
            name = names[q.param]
            if getattr(q.param, "tied_copy", False):
                continue
            where = placement(q.param, tp)
            flats = [(m, getattr(optimizer, m)) for m in MOMENTS] + ([("master", optimizer.master)] if masters else [])
            for what, flat in flats:
                if writes(optim_key(name, what), q.param, ctx, dp_copies=not sharded):
                    state[optim_key(name, what)] = Slab.of_flat(flat[q.at:q.end], q.lo, tuple(q.param.shape), where)
    elif optimizer is not None:
        for name, p in model.named_parameters():
            saved = optimizer.state.get(p) or {}
            if getattr(p, "tied_copy", False) or not saved:
                continue
            for what in MOMENTS:
                if writes(optim_key(name, what), p, ctx):
                    state[optim_key(name, what)] = Slab.of(saved[what], placement(p, tp))
    state[rng_key(_rank())] = _rng_state(ctx)
    return state


def optimizer_meta(optimizer) -> dict[str, Any] | None:
    """The optimizer's step count and hyper-parameters (the same on every rank)."""
    if optimizer is None:
        return None
    if keeps_masters(optimizer):
        steps = optimizer.steps
    else:
        counts = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
        steps = max(counts, default=0)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"step": steps, "param_groups": json.loads(json.dumps(groups, default=list))}


def meta_of(step: int, cfg: Config, ctx, optimizer, scaler) -> dict[str, Any]:
    t = cfg.training
    return {"format": FORMAT, "version": VERSION, "step": step, "config": cfg.to_dict(),
            "layout": layout_of(cfg, ctx), "optimizer": optimizer_meta(optimizer),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "data": {"next_step": step, "samples_seen": step * t.global_batch_size, "seed": t.seed}}


def _rng_state(ctx) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "tracker": ctx.tp.rng.get_states() if ctx is not None else {}}
    if ctx is not None and ctx.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(ctx.device)
    return state


def _restore_rng(state: dict[str, Any], ctx) -> None:
    torch.set_rng_state(state["torch"])
    if ctx is not None:
        ctx.tp.rng.set_states(state["tracker"])
        if "cuda" in state and ctx.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], ctx.device)


def _own_failure(exc: BaseException, rank: int) -> BaseException | None:
    """This rank's part in a failure: DCP raises the same :class:`CheckpointException`
    (a BaseException, its message a traceback per rank) on every rank when any rank
    fails; the rank that failed takes its original exception, the others none (the
    failed rank reports it to them)."""
    if not isinstance(exc, CheckpointException) or not exc.failures:
        return exc
    mine = exc.failures.get(rank)
    return mine[0] if mine is not None else None


@dataclass
class SaveReport:
    """What one save cost: seconds the training loop was blocked (all of it, set by the
    trainer), of which staging to host memory (``--save-async``), and seconds to write."""

    step: int
    blocked_s: float = 0.0
    staged_s: float = 0.0
    write_s: float = 0.0
    path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def write_state(directory: str | Path, step: int, state: dict[str, Any], meta: dict[str, Any], *,
                group=None, keep_last: int = 0) -> Path:
    """Write ``state`` (this rank's pieces) as step ``step`` of ``directory``; collective
    over ``group`` (default: the world). Every rank writes its own file through DCP and
    seals it; rank 0 adds meta.json and the manifest and moves the directory into place.
    A failure on any rank raises on every rank and leaves the previous checkpoint as it was."""
    final = step_dir(directory, step)
    where = f"--save {directory}"
    rank = _rank(group)
    rank0 = rank == 0
    tmp, error = None, None
    if rank0:
        try:
            tmp = _new_tmp_dir(final)
        except OSError as exc:
            error = exc
    tmp, tmp_error = _broadcast_from_rank0((tmp, None if error is None else _first_line(error)), group)
    if tmp_error is not None:
        _raise_everywhere([tmp_error], error, where)

    entries: dict[str, dict[str, Any]] = {}
    own: BaseException | None = None
    try:
        with single_process():
            dcp.save(state, storage_writer=Writer(tmp), planner=SavePlanner(), process_group=group,
                     no_dist=not dist.is_initialized())
        for file in sorted(tmp.glob(f"__{rank}_*.distcp")):
            entries[file.name] = _seal(file)
        if rank0:
            entries[DCP_METADATA] = _seal(tmp / DCP_METADATA)
    except (Exception, CheckpointException) as exc:  # reported to every rank below, so that none waits forever
        own = _own_failure(exc, rank)
    results = _all_gather((entries, None if own is None else _first_line(own)), group)
    try:
        _raise_everywhere([e for _, e in results], own, where)
    except BaseException:
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    error_line = None
    if rank0:
        try:
            everything = {name: entry for files, _ in results for name, entry in files.items()}
            file = tmp / META
            _write_atomically(file, json.dumps(meta, indent=2))
            everything[META] = _seal(file)
            _write_manifest(tmp, step, everything)  # last: its presence means complete
            _swap_into_place(tmp, final, keep_last)
        except Exception as exc:
            own, error_line = exc, _first_line(exc)
            if tmp.exists() and not (tmp / "manifest.json").exists():
                shutil.rmtree(tmp, ignore_errors=True)
    error_line = _broadcast_from_rank0(error_line, group)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    _raise_everywhere([error_line] + [None] * (world - 1), own if rank0 else None, where)
    return final


# ---- what a rank reads -------------------------------------------------------------------------


def stored_index(path: Path):
    """DCP's metadata of a checked step directory: key -> storage metadata."""
    try:
        return dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(f"--load {path}: {DCP_METADATA} cannot be read ({type(exc).__name__}: "
                              f"{_first_line(exc)}); {_REDO}") from None


class _Request:
    """A load state dict built key by key, every destination's shape checked against the
    stored tensor's, so that a mismatch is one line before any read."""

    def __init__(self, stored, where: str):
        self.stored, self.where, self.state = stored, where, {}

    def has(self, key: str) -> bool:
        return key in self.stored

    def add(self, key: str, slab: Slab, label: str) -> None:
        md = self.stored.get(key)
        if md is None or not hasattr(md, "size"):
            raise CheckpointError(f"{self.where}: the checkpoint has no {label}; use the same model flags "
                                  "as the saved run")
        if tuple(md.size) != tuple(slab.global_shape):
            raise CheckpointError(f"{self.where}: {label} has shape {tuple(md.size)}, which does not fit this "
                                  f"model ({tuple(slab.global_shape)}); use the same model flags as the saved run")
        if key in self.state:  # one rank holding a tensor twice (never in the layouts gridtrain builds)
            raise CheckpointError(f"{self.where}: {key} is needed twice on one rank")
        self.state[key] = slab


@torch.no_grad()
def load_sharded(path: Path, meta: dict[str, Any], model: nn.Module, optimizer=None, ctx=None, *,
                 scaler=None, group=None) -> None:
    """Load a checked format-2 step directory into this rank's part of the model (and
    its optimizer and RNG state when given), in whatever layout; collective over
    ``group`` (default: the world).

    Where each tensor comes from, so that no precision is lost on any change of dtype:

    * parameters in the master weights' dtype (fp32/fp64 runs) take ``optim/<n>/master``
      where it is stored (a bf16 or fp16 checkpoint resumed in fp32 continues from its
      fp32 weights), else ``model/<n>``; 16-bit parameters take ``model/<n>``;
    * a flat-buffer optimizer's masters: in the parameters' dtype, the parameters as
      loaded; in fp32 beside 16-bit parameters, ``optim/<n>/master``, else (a checkpoint
      without masters: an fp32 run's) ``model/<n>`` at its stored precision, in a second
      read (one rank never reads one key into two places in one read);
    * moments from the checkpoint, else zero; RNG states only on the layout that wrote them.
    """
    tp = _tp_of(ctx)
    where = f"--load {path}"
    stored = stored_index(path)
    request, second = _Request(stored, where), _Request(stored, where)
    saved_opt = meta.get("optimizer") or None
    flat = keeps_masters(optimizer)
    sixteen = flat and bool(optimizer.params) and optimizer.master.dtype != optimizer.params[0].dtype
    masters_stored = any(k.startswith("optim/") and k.endswith("/master") for k in stored)
    fresh: list[tuple[nn.Parameter, dict]] = []
    rank = _rank()
    restore_rng = optimizer is not None and saved_opt is not None and _same_layout(meta, model, ctx)
    problem: BaseException | None = None
    try:
        names = {p: name for name, p in model.named_parameters()}
        for name, p in model.named_parameters():
            src = _source_name(name, p)
            from_master = request.has(optim_key(src, "master")) and p.dtype in (torch.float32, torch.float64)
            request.add(optim_key(src, "master") if from_master else model_key(src),
                        Slab.of(p.detach(), placement(p, tp)), f"weights for {name}")
        if flat:
            optimizer.exp_avg.zero_()
            optimizer.exp_avg_sq.zero_()
            for q in optimizer.pieces:
                src, at, shape = _source_name(names[q.param], q.param), placement(q.param, tp), tuple(q.param.shape)
                if sixteen:
                    into = request if masters_stored else second
                    key = optim_key(src, "master") if masters_stored else model_key(src)
                    into.add(key, Slab.of_flat(optimizer.master[q.at:q.end], q.lo, shape, at),
                             f"master weights for {names[q.param]}")
                for what in MOMENTS:
                    if saved_opt and request.has(optim_key(src, what)):
                        request.add(optim_key(src, what), Slab.of_flat(getattr(optimizer, what)[q.at:q.end], q.lo,
                                                                       shape, at), f"{what} of {names[q.param]}")
        elif optimizer is not None and saved_opt:
            for name, p in model.named_parameters():
                src = _source_name(name, p)
                if not request.has(optim_key(src, "exp_avg")):
                    continue
                state = {"step": torch.tensor(float(saved_opt["step"])),
                         **{what: torch.zeros_like(p, memory_format=torch.preserve_format) for what in MOMENTS}}
                for what in MOMENTS:
                    request.add(optim_key(src, what), Slab.of(state[what], placement(p, tp)), f"{what} of {name}")
                fresh.append((p, state))
        restore_rng = restore_rng and request.has(rng_key(rank))
        if restore_rng:
            request.state[rng_key(rank)] = None  # bytes: DCP puts the loaded object here
    except Exception as exc:
        problem = exc
    # every rank learns of any rank's problem before any rank starts the collective read
    failed = [(r, e) for r, e in enumerate(_all_gather(None if problem is None else _first_line(problem), group)) if e]
    if problem is not None:
        raise problem
    if failed:
        raise CheckpointError(f"rank {failed[0][0]}: {failed[0][1]}")
    for p in model.parameters():
        if hasattr(p, "vocab_rows"):
            p.zero_()  # vocabulary padding is never stored and is zero; the read fills the real rows
    _read(path, request.state, group, where)
    if sixteen and not masters_stored:
        _read(path, second.state, group, where)
    if flat:
        if not sixteen:
            optimizer._master_from_params()
        if saved_opt:
            optimizer.steps = int(saved_opt["step"])
    for p, state in fresh:
        optimizer.state[p] = state
    if optimizer is not None and saved_opt:
        for group_, saved in zip(optimizer.param_groups, saved_opt["param_groups"]):
            group_.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    if restore_rng:
        _restore_rng(request.state[rng_key(rank)], ctx)
    if scaler is not None and meta.get("scaler"):
        scaler.load_state_dict(meta["scaler"])


class _Unreadable(Exception):
    """A stored file that DCP could not read; the message names it."""


class _Reader(dcp.FileSystemReader):
    """DCP's file reader, one file at a time, so that a failure names the file."""

    def read_data(self, plan, planner):
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(replace(plan, items=items), planner).wait()
            except Exception as exc:
                raise _Unreadable(f"{name} cannot be read ({type(exc).__name__}: {_first_line(exc)})") from None
        return super().read_data(replace(plan, items=[]), planner)


def _read(path: Path, state: dict[str, Any], group, where: str) -> None:
    """DCP's collective read of ``state``'s keys into its destinations; a failure on any
    rank is one line on every rank, naming the file where one could not be read."""
    try:
        with single_process():
            dcp.load(state, storage_reader=_Reader(path), planner=LoadPlanner(),
                     process_group=group, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as exc:
        failures = exc.failures if isinstance(exc, CheckpointException) else {}
        cause = failures[min(failures)][0] if failures else exc
        what = str(cause) if isinstance(cause, _Unreadable) else \
            f"reading failed ({type(cause).__name__}: {_first_line(cause)})"
        raise CheckpointError(f"{where}: {what}; {_REDO}") from None


def _same_layout(meta: dict[str, Any], model: nn.Module, ctx) -> bool:
    """Whether the checkpoint was written by this run's layout (so that each rank's RNG
    streams continue on the same rank)."""
    saved = meta.get("layout") or {}
    grid = getattr(ctx, "grid", None)
    here = {"world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "dp": grid.dp if grid else 1, "tp": grid.tp if grid else 1, "pp": grid.pp if grid else 1,
            "vpp": len(getattr(model, "chunks", [None]))}
    return all(saved.get(k) == v for k, v in here.items())
