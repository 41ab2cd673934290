"""Sharded checkpoints on torch.distributed.checkpoint (DCP): every rank writes only what
it owns, and any layout reads just the slices it needs.

Layout of a step directory (format 2)::

    DIR/latest                           name of the newest complete step directory
    DIR/step_0000200/.metadata           DCP's index: each tensor's global shape and dtype,
                                         and where each of its chunks is stored
    DIR/step_0000200/__<rank>_0.distcp   the chunks rank <rank> wrote
    DIR/step_0000200/meta.json           format, step, config, the layout that wrote it,
                                         optimizer step and groups, loss scaler, data position,
                                         the learning-rate schedule (resolved)
    DIR/step_0000200/manifest.json       size and sha256 of every other file; written last

Keys are global names, the same whatever the layout (the global layer index, no ``pp``
or ``tp`` in them):

* ``model/<param>``: the weights in the run's dtype, vocabulary padding cut off; a last
  stage's copy of the tied embedding is not stored (it is ``embedding.word.weight``);
  also the model's persistent buffers (a MoE layer's ``expert_bias``), whole;
* ``optim/<param>/exp_avg``, ``.../exp_avg_sq``: AdamW's moments, per parameter also
  under ZeRO-1 (each DP rank writes the boxes of its flat range: shards.py); under
  ``--optimizer muon`` a Muon matrix's ``.../momentum_buffer`` instead;
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
and the manifest (manifest.py) and moves the directory into place (directories.py), so a
checkpoint is ``latest`` only when every rank's part and the metadata are complete.

torch.distributed.checkpoint is imported inside the functions that write or read (about
1 s per process, not paid by runs that never save or load).
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gridtrain.checkpoint.collective import all_gather, broadcast_from_rank0, raise_everywhere
from gridtrain.checkpoint.directories import new_tmp_dir, step_dir, swap_into_place
from gridtrain.checkpoint.errors import REDO, CheckpointError, first_line
from gridtrain.checkpoint.manifest import DCP_METADATA, META, seal, write_atomically, write_manifest_entries
from gridtrain.checkpoint.shards import Placement, Slab, single_process
from gridtrain.config import Config
from gridtrain.optim.interface import Optimizer, StatePiece
from gridtrain.optim.schedules import schedule_of
from gridtrain.parallel.tensor_parallel import TensorParallel, shard_spec, split_over
from gridtrain.parallel.zero3 import whole_shape

FORMAT = "gridtrain-checkpoint"
VERSION = 2


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


def source_name(name: str, param: torch.Tensor) -> str:
    """A last stage's tied head is stored as the embedding it is a copy of."""
    return "embedding.word.weight" if getattr(param, "tied_copy", False) else name


def placement(param: torch.Tensor, tp: TensorParallel) -> Placement:
    spec, group = split_over(param, tp)  # over tp, or an expert's slice over its etp group
    return Placement.of(tuple(whole_shape(param)), spec, group.rank, group.size, getattr(param, "vocab_rows", None))


def layout_of(cfg: Config, ctx) -> dict[str, Any]:
    """The layout a checkpoint was written by (meta.json; ``checkpoint info``)."""
    grid = getattr(ctx, "grid", None)
    return {"world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "dp": grid.dp if grid else 1, "tp": grid.tp if grid else 1, "pp": grid.pp if grid else 1,
            "cp": getattr(grid, "cp", 1), "ep": cfg.parallel.ep, "vpp": cfg.parallel.vpp, "schedule": cfg.parallel.schedule, "zero": cfg.parallel.zero,
            "sequence_parallel": cfg.parallel.sequence_parallel, "dtype": cfg.training.dtype}


# ---- what a rank writes ------------------------------------------------------------------------


def writes(key: str, param: torch.Tensor, ctx, dp_copies: bool = True) -> bool:
    """Whether this rank writes ``key``'s pieces of ``param``: of the ranks that hold the
    same pieces (its DP and CP replicas when ``dp_copies``, or for a rank's experts under
    expert parallelism the ranks holding the same experts; and the TP ranks holding the
    same slice: all of them for a replicated parameter, ``spec.replicas`` for shared kv
    heads), the one a stable hash of the key picks, so that every piece is written once
    and the writes spread over the replicas. Decided before anything is staged: a rank
    copies to host memory only what it writes."""
    if ctx is None:
        return True
    spec, tp = shard_spec(param), ctx.tp
    tp_copies = tp.size if spec is None else (spec.replicas if tp.size > 1 else 1)
    if getattr(param, "tp_distinct", False):  # folded experts: no tp rank holds another's
        tp_copies = 1
    # the dp x cp replicas all hold the same pieces (the expert-data-parallel ones a
    # rank's experts); this rank's index among them
    expert_dp = getattr(ctx, "expert_dp", None) if getattr(param, "expert", False) else None
    if expert_dp is not None:
        dp, place = (expert_dp.size, expert_dp.rank) if dp_copies else (1, 0)
    else:
        cp, cp_index = getattr(ctx.grid, "cp", 1), getattr(ctx.coords, "cp", 0)
        dp, place = (ctx.grid.dp * cp, ctx.coords.dp * cp + cp_index) if dp_copies else (1, 0)
    index = place * tp_copies + tp.rank % tp_copies
    return zlib.crc32(key.encode()) % (dp * tp_copies) == index


def state_to_save(model: nn.Module, optimizer: Optimizer | None, ctx) -> dict[str, Any]:
    """The pieces this rank writes (:func:`writes`), by global key, as :class:`Slab` views
    of the memory that holds them (nothing is copied), plus its RNG states. Optimizer
    state is written per parameter whatever the optimizer holds it as: each DP rank its
    own part under ZeRO-1, one of the DP replicas otherwise."""
    tp = _tp_of(ctx)
    names = {p: name for name, p in model.named_parameters()}
    state: dict[str, Any] = {}
    weights = optimizer.weight_pieces() if optimizer is not None else None
    # hybrid sharding: the replicas of a shard hold the same pieces; the first writes them
    own_pieces = getattr(optimizer, "writes_shard", True)
    if weights is None:
        for name, p in model.named_parameters():
            if not getattr(p, "tied_copy", False) and writes(model_key(name), p, ctx):
                state[model_key(name)] = Slab.of(p.detach(), placement(p, tp))
    for name, b in model_buffers(model):  # replicated on every rank of the stage, never sharded
        if writes(model_key(name), b, ctx):
            state[model_key(name)] = Slab.of(b.detach(), placement(b, tp))
    for piece in weights if weights is not None and own_pieces else []:  # ZeRO-3: each its shard's pieces
        key = model_key(names[piece.param])
        if not getattr(piece.param, "tied_copy", False) and writes(key, piece.param, ctx, dp_copies=False):
            state[key] = piece_slab(piece, piece.tensors["model"], tp)
    for piece in optimizer.state_pieces() if optimizer is not None else []:
        if getattr(piece.param, "tied_copy", False) or (optimizer.shards_over_dp and not own_pieces):
            continue
        for what, flat in piece.tensors.items():
            key = optim_key(names[piece.param], what)
            if writes(key, piece.param, ctx, dp_copies=not optimizer.shards_over_dp):
                state[key] = piece_slab(piece, flat, tp)
    state[rng_key(_rank())] = _rng_state(ctx)
    return state


def model_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's persistent buffers by global name (a MoE layer's ``expert_bias``):
    model state beside the parameters, stored as ``model/<name>`` like a parameter that
    is never sharded (not under ZeRO-3 either), and loaded with the weights."""
    return [(f"{prefix}.{key}" if prefix else key, b) for prefix, module in model.named_modules()
            for key, b in module._buffers.items() if b is not None and key not in module._non_persistent_buffers_set]


def piece_slab(piece: StatePiece, flat: torch.Tensor, tp: TensorParallel) -> Slab:
    return Slab.of_flat(flat, piece.lo, tuple(whole_shape(piece.param)), placement(piece.param, tp))


def optimizer_meta(optimizer: Optimizer | None) -> dict[str, Any] | None:
    """The optimizer's step count and hyper-parameters (the same on every rank)."""
    if optimizer is None:
        return None
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"step": optimizer.steps, "param_groups": json.loads(json.dumps(groups, default=list))}


def meta_of(step: int, cfg: Config, ctx, optimizer, scaler) -> dict[str, Any]:
    t = cfg.training
    return {"format": FORMAT, "version": VERSION, "step": step, "config": cfg.to_dict(),
            "layout": layout_of(cfg, ctx), "optimizer": optimizer_meta(optimizer),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "data": {"next_step": step, "samples_seen": step * t.global_batch_size, "seed": t.seed},
            "lr_schedule": schedule_of(cfg.optim, t.steps).meta()}  # every default resolved (schedules.py)


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
    from torch.distributed.checkpoint.api import CheckpointException  # loaded by the save that raised
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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from gridtrain.checkpoint.dcp_io import SavePlanner, Writer

    final = step_dir(directory, step)
    where = f"--save {directory}"
    rank = _rank(group)
    rank0 = rank == 0
    tmp, error = None, None
    if rank0:
        try:
            tmp = new_tmp_dir(final)
        except OSError as exc:
            error = exc
    tmp, tmp_error = broadcast_from_rank0((tmp, None if error is None else first_line(error)), group)
    if tmp_error is not None:
        raise_everywhere([tmp_error], error, where)

    entries: dict[str, dict[str, Any]] = {}
    own: BaseException | None = None
    try:
        with single_process():
            dcp.save(state, storage_writer=Writer(tmp), planner=SavePlanner(), process_group=group,
                     no_dist=not dist.is_initialized())
        for file in sorted(tmp.glob(f"__{rank}_*.distcp")):
            entries[file.name] = seal(file)
        if rank0:
            entries[DCP_METADATA] = seal(tmp / DCP_METADATA)
    except (Exception, CheckpointException) as exc:  # reported to every rank below, so that none waits forever
        own = _own_failure(exc, rank)
    results = all_gather((entries, None if own is None else first_line(own)), group)
    try:
        raise_everywhere([e for _, e in results], own, where)
    except BaseException:
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    error_line = None
    if rank0:
        try:
            everything = {name: entry for files, _ in results for name, entry in files.items()}
            file = tmp / META
            write_atomically(file, json.dumps(meta, indent=2))
            everything[META] = seal(file)
            write_manifest_entries(tmp, step, everything)  # last: its presence means complete
            swap_into_place(tmp, final, keep_last)
        except Exception as exc:
            own, error_line = exc, first_line(exc)
            if tmp.exists() and not (tmp / "manifest.json").exists():
                shutil.rmtree(tmp, ignore_errors=True)
    error_line = broadcast_from_rank0(error_line, group)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    raise_everywhere([error_line] + [None] * (world - 1), own if rank0 else None, where)
    return final


# ---- what a rank reads -------------------------------------------------------------------------


def stored_index(path: Path):
    """DCP's metadata of a checked step directory: key -> storage metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    try:
        return FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(f"--load {path}: {DCP_METADATA} cannot be read ({type(exc).__name__}: "
                              f"{first_line(exc)}); {REDO}") from None


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
def load_sharded(path: Path, meta: dict[str, Any], model: nn.Module, optimizer: Optimizer | None = None, ctx=None, *,
                 scaler=None, group=None, where: str | None = None, reset_optimizer: bool = False) -> None:
    """Load a checked format-2 step directory into this rank's part of the model (and
    its optimizer, loss scaler and RNG state when given), in whatever layout; collective
    over ``group`` (default: the world).

    Each part says where its tensors come from (:func:`_request_weights`,
    :func:`_request_optimizer`), so that no precision is lost on any change of dtype;
    every rank checks its requests against the stored index and learns of any rank's
    problem before the collective read; then each part takes what was read
    (:func:`_take_optimizer`, :func:`_take_rng`, the scaler).
    """
    where = where or f"--load {path}"
    stored = stored_index(path)
    request, second = _Request(stored, where), _Request(stored, where)
    saved_opt = (meta.get("optimizer") or None) if optimizer is not None else None
    resumes = bool(saved_opt)  # the RNG streams continue (with or without the optimizer's state)
    if reset_optimizer:
        saved_opt = None  # the optimizer keeps its zero state and step count; masters still from the weights
    filled: list[StatePiece] = []
    rng = None

    weights = optimizer.weight_pieces() if optimizer is not None else None

    def plan() -> bool:
        nonlocal filled, rng
        _request_weights(request, model, _tp_of(ctx), weights)
        if optimizer is not None:
            filled = _request_optimizer(request, second, model, optimizer, _tp_of(ctx), moments=bool(saved_opt))
        rng = _request_rng(request, meta, model, ctx) if resumes else None
        return bool(second.state)

    second_read = _agreed(plan, group)
    _zero_vocabulary_padding(model, weights)
    _read(path, request.state, group, where)
    if second_read:
        _read(path, second.state, group, where)
    if weights is not None:
        optimizer.weights_loaded()
    if optimizer is not None:
        _take_optimizer(optimizer, saved_opt, filled)
    if rng is not None:
        _restore_rng(request.state[rng], ctx)
    if scaler is not None and meta.get("scaler"):
        scaler.load_state_dict(meta["scaler"])


def _agreed(plan: Callable[[], bool], group) -> bool:
    """Run ``plan``, which builds this rank's requests and says whether it needs a second
    read. Every rank learns of any rank's problem before any rank starts the collective
    read (which would otherwise wait for it), and whether any rank needs a second one."""
    problem: BaseException | None = None
    second = False
    try:
        second = plan()
    except Exception as exc:
        problem = exc
    results = all_gather((None if problem is None else first_line(problem), second), group)
    failed = [(r, e) for r, (e, _) in enumerate(results) if e]
    if problem is not None:
        raise problem
    if failed:
        raise CheckpointError(f"rank {failed[0][0]}: {failed[0][1]}")
    return any(wants for _, wants in results)


def _request_weights(request: _Request, model: nn.Module, tp: TensorParallel,
                     weights: list[StatePiece] | None = None) -> None:
    """Parameters in a master weights' dtype (fp32/fp64 runs) take ``optim/<n>/master``
    where it is stored (a bf16 or fp16 checkpoint resumed in fp32 continues from its
    fp32 weights), else ``model/<n>``; 16-bit parameters take ``model/<n>``. Each into
    the parameter, or under ZeRO-3 (``weights``: the optimizer's weight pieces) into this
    rank's pieces of the parameter shard."""
    names = {p: name for name, p in model.named_parameters()}
    targets = [(p, Slab.of(p.detach(), placement(p, tp))) for p in names] if weights is None else \
        [(q.param, piece_slab(q, q.tensors["model"], tp)) for q in weights]
    for p, slab in targets:
        name = names[p]
        src = source_name(name, p)
        from_master = request.has(optim_key(src, "master")) and p.dtype in (torch.float32, torch.float64)
        request.add(optim_key(src, "master") if from_master else model_key(src), slab, f"weights for {name}")
    for name, b in model_buffers(model):
        request.add(model_key(name), Slab.of(b, placement(b, tp)), f"state {name}")


def _request_optimizer(request: _Request, second: _Request, model: nn.Module, optimizer: Optimizer,
                       tp: TensorParallel, moments: bool) -> list[StatePiece]:
    """The optimizer's state, piece by piece (its :meth:`load_targets`); returns the
    pieces that take moments. Moments come from the checkpoint where it has them
    (``moments``: it has optimizer state), else stay zero. Master weights of their own
    (beside 16-bit parameters) come from ``optim/<n>/master``, else (a checkpoint
    without masters: an fp32 run's) from ``model/<n>`` at its stored precision, in the
    ``second`` read (one rank never reads one key into two places in one read)."""
    names = {p: name for name, p in model.named_parameters()}
    masters_stored = any(k.startswith("optim/") and k.endswith("/master") for k in request.stored)
    filled = []
    for piece in optimizer.load_targets():
        name = names[piece.param]
        src = source_name(name, piece.param)
        if "master" in piece.tensors:
            into, key = (request, optim_key(src, "master")) if masters_stored else (second, model_key(src))
            into.add(key, piece_slab(piece, piece.tensors["master"], tp), f"master weights for {name}")
        kept = [what for what in piece.tensors if what != "master"]  # AdamW's moments, or Muon's buffer
        if not (moments and all(request.has(optim_key(src, what)) for what in kept)):
            continue
        for what in kept:
            request.add(optim_key(src, what), piece_slab(piece, piece.tensors[what], tp), f"{what} of {name}")
        filled.append(piece)
    return filled


def _take_optimizer(optimizer: Optimizer, saved: dict[str, Any] | None, filled: list[StatePiece]) -> None:
    """The optimizer takes the state read into ``filled``, the saved step count and
    hyper-parameters (``saved``: meta.json's, None when the checkpoint has none)."""
    optimizer.loaded(int(saved["step"]) if saved else None, filled)
    for group_, saved_group in zip(optimizer.param_groups, saved["param_groups"] if saved else []):
        group_.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved_group.items()})


def _request_rng(request: _Request, meta: dict[str, Any], model: nn.Module, ctx) -> str | None:
    """This rank's RNG states, only on the layout that wrote them: their key, or None."""
    key = rng_key(_rank())
    if not (_same_layout(meta, model, ctx) and request.has(key)):
        return None
    request.state[key] = None  # bytes: DCP puts the loaded object here
    return key


def _zero_vocabulary_padding(model: nn.Module, weights: list[StatePiece] | None = None) -> None:
    """Vocabulary padding is never stored and is zero; the read fills the real rows."""
    for p in model.parameters():
        if hasattr(p, "vocab_rows"):
            p.zero_()
    for q in weights or []:
        if hasattr(q.param, "vocab_rows"):
            q.tensors["model"].zero_()


def _read(path: Path, state: dict[str, Any], group, where: str) -> None:
    """DCP's collective read of ``state``'s keys into its destinations; a failure on any
    rank is one line on every rank, naming the file where one could not be read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from gridtrain.checkpoint.dcp_io import LoadPlanner, Reader, Unreadable
    try:
        with single_process():
            dcp.load(state, storage_reader=Reader(path), planner=LoadPlanner(),
                     process_group=group, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as exc:
        failures = exc.failures if isinstance(exc, CheckpointException) else {}
        cause = failures[min(failures)][0] if failures else exc
        what = str(cause) if isinstance(cause, Unreadable) else \
            f"reading failed ({type(cause).__name__}: {first_line(cause)})"
        raise CheckpointError(f"{where}: {what}; {REDO}") from None


def _same_layout(meta: dict[str, Any], model: nn.Module, ctx) -> bool:
    """Whether the checkpoint was written by this run's layout (so that each rank's RNG
    streams continue on the same rank)."""
    saved = meta.get("layout") or {}
    grid = getattr(ctx, "grid", None)
    here = {"world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "dp": grid.dp if grid else 1, "tp": grid.tp if grid else 1, "pp": grid.pp if grid else 1,
            "vpp": len(getattr(model, "chunks", [None])), "cp": getattr(grid, "cp", 1)}
    return all(saved.get(k, 1 if k == "cp" else None) == v for k, v in here.items())
