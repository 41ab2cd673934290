"""Saving and loading training state: never a half-written checkpoint, never a damaged
or mismatched one loaded.

Layout of a save directory::

    DIR/latest                                 name of the newest complete step directory
    DIR/step_0000200/model-pp000.safetensors   one file per pipeline stage: whole tensors
                                               by global name, no vocabulary padding
    DIR/step_0000200/trainer-pp000.pt          optimizer state by parameter name (Adam's
                                               moments; 16-bit runs: fp32 master weights),
                                               fp16's loss-scaler state, and, in stage 0's
                                               file, every rank's RNG state
    DIR/step_0000200/meta.json                 step, full config
    DIR/step_0000200/manifest.json             every other file's name, size in bytes and
                                               sha256; written last

Checkpoints hold whole tensors with global names, whatever the layout that wrote them:
TP shards are gathered on save and re-sliced on load (through each parameter's
ShardSpec), the stages' files are merged on load, so a run may resume on another
tensor- or pipeline-parallel layout, and ``gridtrain generate`` needs no grid.
Gathering costs one all-gather per sharded tensor; sharded files are the way for models
too large for one host's memory, and are not built yet.

**Writing.** A save goes into a hidden directory with a name unique to that save
(``.step_0000200.tmp-<pid>-<random>``), so the leftovers of a crashed save never mix with
a new one. Each writing rank writes, fsyncs and hashes its own files (the stages hash in
parallel); rank 0 gathers the sizes and checksums, writes ``meta.json``, and then
``manifest.json`` last (temporary file, fsync, rename). Only then is the directory
renamed into place and ``latest`` replaced atomically. Re-saving a step that exists
never deletes the complete old directory first: old renamed aside
(``.step_X.old-...``), new renamed into place, ``latest`` updated, old deleted. At every
instant a complete checkpoint is reachable from ``latest``, with one window: between
the two renames ``step_X`` is missing, and if ``latest`` names it, :func:`resolve` falls
back to the complete hidden copy of that step (the one whose manifest is newest). A
successful save removes every hidden leftover of the directory, so a save directory
must have one writer at a time (one run). Any rank's failure to write reaches every
rank, which all raise the same error; the previous checkpoint stays as it was.

**Reading.** Nothing is read before the manifest is checked: every listed file must be
there with its size and sha256 (extra files are ignored, and never loaded). Each
problem, and each file that json, safetensors or torch.load cannot read, is a
:class:`CheckpointError` of one line naming the file, what is wrong and the fix. The
checkpoint's model config (meta.json) must equal the run's on every field that changes
the weights' shapes or meaning (all of :class:`~gridtrain.config.ModelConfig` except
dropout, attention, vocab_pad_multiple and max_positions, with ffn_hidden compared as the
resolved ffn_size and n_kv_head as the resolved key/value head count); one line names
each differing field with both values.

**Checksum cost.** sha256 (hashlib) hashes about 1.7 GB/s in memory on this project's
CPU hosts (SHA extensions; blake2b 0.8 GB/s, md5 0.7 GB/s, crc32 3.5 GB/s but weaker),
and verifying a file from the page cache (read + hash) runs at about 1.3 GB/s, i.e.
about 0.8 s per GB, so sha256 it is. Sealing a file on save (read back, hash, fsync)
ran at 0.8 GB/s, mostly the fsync. :func:`check_loadable` (run before any worker is
spawned) hashes everything; :func:`load_checkpoint` verifies again in each process, but
a process never hashes the same unchanged file twice (a per-process record keyed by
path, size, mtime and inode), so a torchrun worker that validated its own config loads
without hashing again. Spawned workers do hash once more each: every rank reads every
file anyway (the layout-free format), and the hash adds a fraction of a second per GB
to that read, on every rank in parallel. ``check_loadable(..., verify_data=False)``
checks presence and sizes only (and meta.json's checksum).

**Checkpoints from before manifests** (no ``manifest.json``) are refused, because a
missing manifest is also what an incomplete or foreign directory looks like, and
nothing in this repository keeps such checkpoints. The message gives the fix for a
trusted old checkpoint: :func:`write_manifest` on its step directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from gridtrain.config import Config, ModelConfig
from gridtrain.tensor_parallel import TensorParallel, shard, shard_spec, unshard

LATEST = "latest"
MANIFEST = "manifest.json"
META = "meta.json"
MANIFEST_FORMAT = "gridtrain-checkpoint-manifest"
_STEP_NAME = re.compile(r"step_\d+")
_LEFTOVER_PATTERNS = (".step_*.tmp-*", ".step_*.old-*")
_CHUNK = 8 << 20
_REDO = "use an earlier checkpoint or re-save"

# Model fields that do not change the weights' shapes or meaning (compared: all others).
_NOT_COMPARED = {"dropout", "attention", "vocab_pad_multiple", "ffn_hidden", "max_positions"}
_MODEL_FLAGS = {"n_layer": "--n-layer", "n_head": "--n-head", "d_model": "--d-model",
                "seq_len": "--seq-len", "vocab_size": "--vocab-size", "arch": "--arch", "n_kv_head": "--n-kv-head",
                "rope_theta": "--rope-theta"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message names the path and the fix."""


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:07d}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def first_line(exc: BaseException, limit: int = 160) -> str:
    """An exception's message as one line of at most ``limit`` characters (for errors)."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text if len(text) <= limit else text[:limit] + "..."


_first_line = first_line


# ---- file integrity: sizes and checksums ---------------------------------------------------

_verified: set[tuple] = set()  # (path, size, mtime_ns, inode, sha256) hashed by this process


def _stat_key(path: Path, digest: str) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, digest)


def _seal(path: Path) -> dict[str, Any]:
    """A just-written file's manifest entry (size, sha256), after syncing it to disk."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    entry = {"size": size, "sha256": h.hexdigest()}
    _verified.add(_stat_key(path, entry["sha256"]))
    return entry


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(path: Path, step: int | None, entries: dict[str, dict[str, Any]]) -> None:
    manifest = {"format": MANIFEST_FORMAT, "version": 1, "step": step, "checksum": "sha256",
                "files": dict(sorted(entries.items()))}
    _write_atomically(path / MANIFEST, json.dumps(manifest, indent=1))
    _fsync_dir(path)


def write_manifest(directory: str | Path) -> Path:
    """Write ``manifest.json`` for a step directory as it is now (every regular file but
    the manifest and hidden ones): the way to adopt a checkpoint written before
    manifests, once you trust it. Returns the manifest's path."""
    path = Path(directory)
    entries = {f.name: _seal(f) for f in sorted(path.iterdir())
               if f.is_file() and f.name != MANIFEST and not f.name.startswith(".")}
    step = None
    try:
        step = int(json.loads((path / META).read_text())["step"])
    except Exception:
        pass
    _write_manifest(path, step, entries)
    return path / MANIFEST


def _read_manifest(path: Path, flag: str) -> dict[str, dict[str, Any]]:
    """The manifest's file entries, its shape checked."""
    where = f"{flag} {path}"
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(
            f"{where}: no {MANIFEST}, so it is incomplete, not written by gridtrain, or from before "
            f"checkpoint manifests; {_REDO} (for an old checkpoint you trust: python -c \"from "
            f"gridtrain.checkpoint import write_manifest; write_manifest('{path}')\")")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {MANIFEST} cannot be read ({_first_line(exc)}); {_REDO}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT
            or not isinstance(files, dict)):
        raise CheckpointError(f"{where}: {MANIFEST} is not a gridtrain checkpoint manifest; {_REDO}")
    for name, entry in files.items():
        if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
                or not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get("sha256"), str)):
            raise CheckpointError(f"{where}: {MANIFEST} has a malformed entry {str(name)[:60]!r}; {_REDO}")
    if META not in files or not any(_is_weights(n) for n in files):
        raise CheckpointError(f"{where}: {MANIFEST} lists no {META} or no model-pp*.safetensors; {_REDO}")
    return files


def _is_weights(name: str) -> bool:
    return name.startswith("model-pp") and name.endswith(".safetensors")


def _is_trainer(name: str) -> bool:
    return name.startswith("trainer-pp") and name.endswith(".pt")


def _verify(path: Path, flag: str, data: bool) -> dict[str, dict[str, Any]]:
    """Check every listed file's presence and size, and (``data``) its sha256; returns
    the manifest's entries. ``meta.json`` is always hashed (it is small)."""
    files = _read_manifest(path, flag)
    where = f"{flag} {path}"
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{where}: {name} is missing (the manifest lists it); {_REDO}")
        size = file.stat().st_size
        if size != entry["size"]:
            what = "truncated" if size < entry["size"] else "longer than written"
            raise CheckpointError(f"{where}: {name} is {size} bytes, the manifest says "
                                  f"{entry['size']} ({what}); {_REDO}")
    for name, entry in files.items():
        if not (data or name == META):
            continue
        file = path / name
        if _stat_key(file, entry["sha256"]) in _verified:
            continue
        try:
            digest = _sha256(file)
        except OSError as exc:
            raise CheckpointError(f"{where}: {name} cannot be read ({_first_line(exc)}); {_REDO}") from None
        if digest != entry["sha256"]:
            raise CheckpointError(f"{where}: {name} has sha256 {digest[:12]}..., the manifest says "
                                  f"{entry['sha256'][:12]}... (its bytes changed since it was written); {_REDO}")
        _verified.add(_stat_key(file, digest))
    return files


# ---- whole tensors from any layout -----------------------------------------------------------


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


def full_optimizer_state(model: nn.Module, states: dict[nn.Parameter, dict[str, Any]],
                         tp: TensorParallel) -> dict[str, dict[str, Any]]:
    """Per-parameter optimizer state by name, with TP shards made whole; collective over TP.
    ``states`` maps each parameter to its state as torch's AdamW keeps it (``step``,
    ``exp_avg``, ``exp_avg_sq``), plus ``master`` for 16-bit runs (see
    :func:`_optimizer_states`)."""
    out = {}
    for name, p in model.named_parameters():
        state = states.get(p, {})
        out[name] = {k: _full(v, p, tp) if torch.is_tensor(v) and v.shape == p.shape else v
                     for k, v in state.items()}
    return out


def _optimizer_states(optimizer) -> dict[nn.Parameter, dict[str, Any]] | None:
    """The optimizer's per-parameter state where it is written (the DP group's first rank;
    None elsewhere for the distributed optimizer, which gathers its ZeRO shards only
    there); collective over DP for the distributed optimizer."""
    if hasattr(optimizer, "state_by_param"):
        return optimizer.state_by_param()
    return optimizer.state


# ---- saving ---------------------------------------------------------------------------------


def _broadcast_from_rank0(value):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(value) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _raise_everywhere(errors: list[str | None], own: BaseException | None, where: str) -> None:
    """Every rank raises when any rank failed: a writing error (OSError) becomes one line;
    the rank that hit anything else re-raises it with its traceback."""
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if own is not None and not isinstance(own, OSError):
        raise own
    rank, error = failed[0]
    raise CheckpointError(f"{where}: rank {rank} could not write the checkpoint ({error}); "
                          "the previous checkpoint is unchanged; fix the cause (space, permissions) and re-run")


def _new_tmp_dir(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def _swap_into_place(tmp: Path, final: Path) -> None:
    """Complete ``tmp`` becomes ``final``; an existing ``final`` is removed only after the
    new one is in place and ``latest`` names it (see the module docstring)."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{tmp.name.rsplit('.tmp-', 1)[1]}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    _write_atomically(final.parent / LATEST, final.name)
    _fsync_dir(final.parent)
    for pattern in _LEFTOVER_PATTERNS:  # this one's old copy and crashed saves' leftovers
        for leftover in final.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def save_checkpoint(directory: str | Path, step: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None, cfg: Config, ctx=None, *,
                    scaler=None) -> Path:
    """Write the state after ``step`` completed steps; collective over the default group.

    The first DP/TP rank of each pipeline stage writes that stage's tensors (TP shards
    gathered whole; a last stage's copy of the tied embedding is left out, it equals the
    first stage's) into a directory of this save's own, fsyncs and hashes them; rank 0
    adds meta.json and then manifest.json, and renames the directory into place (see the
    module docstring). A failure on any rank raises on every rank and leaves the previous
    checkpoint as it was.

    Only the first DP rank's TP group assembles whole tensors (the other DP replicas hold
    the same weights and write nothing); a ZeRO-1 optimizer sends its shards there. The
    trainer file holds, per parameter, the moments and (16-bit runs) the fp32 master
    weights, and the fp16 loss ``scaler``'s state when given: without them a resumed
    bf16/fp16 run would restart from rounded weights and a fresh loss scale.
    """
    tp = _tp_of(ctx)
    final = step_dir(directory, step)
    where = f"--save {directory}"
    stage = ctx.coords.pp if ctx is not None else 0
    writer = ctx is None or (ctx.coords.dp == 0 and ctx.coords.tp == 0)
    assembles = ctx is None or ctx.coords.dp == 0  # the writer's TP group: TP gathers are collective there
    weights = full_model_state(model, tp) if assembles else {}
    states = _optimizer_states(optimizer) if optimizer is not None else None  # collective over DP
    opt_state = full_optimizer_state(model, states, tp) if states is not None and assembles else None
    rng = _gather_rng_states(ctx)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0

    tmp, error = None, None
    if rank0:
        try:
            tmp = _new_tmp_dir(final)
        except OSError as exc:
            error = exc
    tmp, tmp_error = _broadcast_from_rank0((tmp, None if error is None else _first_line(error)))
    if tmp_error is not None:
        _raise_everywhere([tmp_error], error, where)

    entries: dict[str, dict[str, Any]] = {}
    own: BaseException | None = None
    if writer:
        try:
            file = tmp / f"model-pp{stage:03d}.safetensors"
            save_file({k: v.contiguous() for k, v in weights.items()}, file, metadata={"format": "gridtrain"})
            entries[file.name] = _seal(file)
            if opt_state is not None:
                groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
                state = {k: v for k, v in opt_state.items() if k in weights}
                file = tmp / f"trainer-pp{stage:03d}.pt"
                torch.save({"state": state, "param_groups": groups, "rng": rng if rank0 else None,
                            "scaler": scaler.state_dict() if scaler is not None else None}, file)
                entries[file.name] = _seal(file)
        except Exception as exc:  # reported to every rank below, so that none waits forever
            own = exc
    results = _all_gather((entries, None if own is None else _first_line(own)))
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
            meta = tmp / META
            _write_atomically(meta, json.dumps({"step": step, "config": cfg.to_dict()}, indent=2))
            everything[META] = _seal(meta)
            _write_manifest(tmp, step, everything)  # last: its presence means complete
            _swap_into_place(tmp, final)
        except Exception as exc:
            own, error_line = exc, _first_line(exc)
            if tmp.exists() and not (tmp / MANIFEST).exists():
                shutil.rmtree(tmp, ignore_errors=True)
    error_line = _broadcast_from_rank0(error_line)
    errors = [error_line] + [None] * (dist.get_world_size() - 1 if dist.is_initialized() else 0)
    _raise_everywhere(errors, own if rank0 else None, where)
    return final


def write_weights_checkpoint(directory: str | Path, step: int, cfg: Config, write_files) -> Path:
    """A checkpoint written by one process without training (``gridtrain import-hf``):
    ``write_files(tmp)`` writes ``model-pp000.safetensors`` (and any file that travels
    with the weights, e.g. ``tokenizer.json``) into the new step directory; this adds
    meta.json and the manifest and moves it into place exactly as :func:`save_checkpoint`
    does, so every reader treats it as a run's checkpoint with no optimizer state."""
    final = step_dir(directory, step)
    tmp = _new_tmp_dir(final)
    try:
        write_files(tmp)
        entries = {f.name: _seal(f) for f in sorted(tmp.iterdir()) if f.is_file()}
        meta = tmp / META
        _write_atomically(meta, json.dumps({"step": step, "config": cfg.to_dict()}, indent=2))
        entries[META] = _seal(meta)
        _write_manifest(tmp, step, entries)
        _swap_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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


# ---- finding and checking a checkpoint ------------------------------------------------------


def _looks_like_step_dir(path: Path) -> bool:
    return ((path / MANIFEST).is_file() or (path / META).is_file()
            or any(path.glob("model-pp*.safetensors")))


def _complete_step_dirs(directory: Path) -> list[Path]:
    """Visible step directories that have a manifest, oldest step first."""
    found = [p for p in directory.iterdir() if p.is_dir() and _STEP_NAME.fullmatch(p.name)]
    return sorted((p for p in found if (p / MANIFEST).is_file()), key=lambda p: int(p.name[5:]))


def _hidden_copy(directory: Path, name: str) -> Path | None:
    """A complete hidden copy of step directory ``name``: what a crash between the two
    renames of a re-save leaves (the old one aside, the new one not yet in place)."""
    copies = [p for pattern in (f".{name}.tmp-*", f".{name}.old-*") for p in directory.glob(pattern)
              if (p / MANIFEST).is_file()]
    return max(copies, key=lambda p: (p / MANIFEST).stat().st_mtime_ns, default=None)


def _resolve(directory: str | Path, flag: str) -> Path | None:
    """The step directory that ``directory`` means; None for a save directory with no
    checkpoint in it yet (no ``latest``, no step directories)."""
    path = Path(directory)
    where = f"{flag} {directory}"
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise CheckpointError(f"{where}: {what}; pass a directory written by --save")
    if _looks_like_step_dir(path):
        return path
    pointer = path / LATEST
    if not pointer.exists():
        complete = _complete_step_dirs(path)
        if complete:
            return complete[-1]  # saved, but the crash came before `latest` was written
        if any(_STEP_NAME.fullmatch(p.name) for p in path.iterdir()):
            raise CheckpointError(f"{where}: no {LATEST} file and no complete step directory (none has a "
                                  f"{MANIFEST}); pass a step directory, or {_REDO}")
        return None
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        name, garbage = None, _first_line(exc)
    else:
        garbage = None
    newest = _complete_step_dirs(path)
    hint = (f"pass a step directory (the newest complete one here is {newest[-1]})" if newest
            else "pass a step directory, or re-save")
    if not name:
        what = f"cannot be read ({garbage})" if garbage else "is empty"
        raise CheckpointError(f"{where}: {LATEST} {what}; {hint}")
    if len(name) > 255 or "/" in name or "\\" in name or "\0" in name or name in (".", ".."):
        raise CheckpointError(f"{where}: {LATEST} holds {name[:40]!r}, not a step directory name; {hint}")
    target = path / name
    if target.is_dir():
        return target
    copy = _hidden_copy(path, name)
    if copy is not None:
        return copy
    raise CheckpointError(f"{where}: {LATEST} names {name[:40]!r}, which does not exist; {hint}")


def resolve(directory: str | Path) -> Path:
    """A step directory, given either it or a save directory with a ``latest`` pointer.
    Reads only names; the files are checked by :func:`check_loadable`."""
    path = _resolve(directory, "--load")
    if path is None:
        raise CheckpointError(f"--load {directory}: no checkpoint there (no {LATEST} file "
                              f"and no {META}); pass a directory written by --save")
    return path


def _read_meta_file(path: Path, flag: str) -> dict[str, Any]:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{flag} {path}: {META} cannot be read ({_first_line(exc)}); {_REDO}") from None
    if (not isinstance(meta, dict) or not isinstance(meta.get("step"), int)
            or not isinstance(meta.get("config"), dict)
            or not isinstance(meta["config"].get("model", {}), dict)):
        raise CheckpointError(f"{flag} {path}: {META} lacks an integer step or a config; {_REDO}")
    return meta


def read_meta(directory: str | Path) -> dict[str, Any]:
    """The checkpoint's ``meta.json`` (step, config), once its manifest lists every file
    at its size and meta.json's checksum matches; one-line errors."""
    path = resolve(directory)
    _verify(path, "--load", data=False)
    return _read_meta_file(path, "--load")


def _saved_model(meta: dict[str, Any], where: str) -> ModelConfig:
    raw = meta["config"].get("model") or {}
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise CheckpointError(f"{where}: the checkpoint's model has fields this version does not know "
                              f"({', '.join(unknown)}); load it with the gridtrain version that wrote it")
    return ModelConfig(**raw)


def _compared(m: ModelConfig) -> dict[str, Any]:
    values = {f.name: getattr(m, f.name) for f in fields(ModelConfig) if f.name not in _NOT_COMPARED}
    values["ffn_size"] = m.ffn_size
    values["n_kv_head"] = m.kv_heads  # None means one per query head
    return values


def compare_models(saved: ModelConfig, run: ModelConfig, where: str, label: str = "flags") -> None:
    """Raise one line naming every field on which ``run`` would build other weights than
    ``saved`` holds (see the module docstring for which fields)."""
    a, b = _compared(saved), _compared(run)
    differ = [name for name in a if a[name] != b[name]]
    if not differ:
        return
    pairs = [f"{name} {a[name]!r} vs {b[name]!r}" for name in differ]
    pairs[0] = f"{differ[0]} {a[differ[0]]!r} (checkpoint) vs {b[differ[0]]!r} ({label})"
    flags = [f"{_MODEL_FLAGS[n]} {a[n]}" for n in differ if n in _MODEL_FLAGS]
    keys = [f"model.{'ffn_hidden' if n == 'ffn_size' else n}: {a[n]}" for n in differ if n not in _MODEL_FLAGS]
    fixes = ([f"pass the checkpoint's model flags ({' '.join(flags)})"] if flags else []) + \
            ([f"set {', '.join(keys)} in --config"] if keys else [])
    raise CheckpointError(f"{where}: the checkpoint's model differs from this run's: {', '.join(pairs)}; "
                          f"{' and '.join(fixes)}")


def check_loadable(directory: str | Path, cfg: Config | ModelConfig | None = None, *,
                   verify_data: bool = True, flag: str = "--load") -> Path:
    """The step directory ``directory`` means (itself, or its save directory's latest),
    once it is complete and undamaged and, when ``cfg`` is given, holds the same model as
    ``cfg.model``; else a one-line :class:`CheckpointError`. Cheap enough to run before
    any worker starts: ``verify_data`` hashes every file (about 0.6 s per GB; a process
    hashes an unchanged file once), without it only presence and sizes are checked.
    ``flag`` is how messages name the option that gave the path (``--init-from``)."""
    path = _resolve(directory, flag)
    if path is None:
        raise CheckpointError(f"{flag} {directory}: no checkpoint there (no {LATEST} file "
                              f"and no {META}); pass a directory written by --save")
    _verify(path, flag, data=verify_data)
    meta = _read_meta_file(path, flag)
    if cfg is not None:
        run = cfg.model if isinstance(cfg, Config) else cfg
        compare_models(_saved_model(meta, f"{flag} {directory}"), run, f"{flag} {directory}")
    return path


def saved_model(directory: str | Path, flag: str = "--load") -> ModelConfig:
    """The model a checkpoint holds (from its meta.json, once its files are checked)."""
    path = check_loadable(directory, flag=flag, verify_data=False)
    return _saved_model(_read_meta_file(path, flag), f"{flag} {directory}")


def weight_files(step: Path) -> list[Path]:
    """A checked step directory's weight files (one per pipeline stage), as its manifest lists them."""
    return [step / name for name in sorted(_read_manifest(step, "--load")) if _is_weights(name)]


def latest_step_dir(save_dir: str | Path, *, verify_data: bool = False) -> Path | None:
    """The newest complete checkpoint of a save directory, for resuming automatically:
    the one ``latest`` names (or, without ``latest``, the highest complete step
    directory); None where there is none (no such directory yet, or nothing saved in it).
    Raises :class:`CheckpointError` only for something there that is damaged: a broken
    ``latest``, a checkpoint with missing, truncated or (``verify_data``) altered files."""
    path = Path(save_dir)
    if not path.exists():
        return None
    if _looks_like_step_dir(path):
        raise CheckpointError(f"--save {save_dir}: this is a step directory; pass the directory "
                              "that --save wrote it into")
    found = _resolve(path, "--save")
    if found is None:
        return None
    _verify(found, "--save", data=verify_data)
    _read_meta_file(found, "--save")
    return found


# ---- loading --------------------------------------------------------------------------------


def _read_file(path: Path, name: str, read):
    try:
        return read(path / name)
    except Exception as exc:  # safetensors, pickle, zip: whatever the damage, one line
        raise CheckpointError(f"--load {path}: {name} cannot be read ({type(exc).__name__}: "
                              f"{_first_line(exc)}); {_REDO}") from None


def _source_name(name: str, param: torch.Tensor) -> str:
    """A last stage's tied head loads the embedding it is a copy of."""
    return "embedding.word.weight" if getattr(param, "tied_copy", False) else name


@torch.no_grad()
def copy_weights(weights, model: nn.Module, tp: TensorParallel, where: str) -> dict[nn.Parameter, torch.Tensor]:
    """Copy this rank's shard of each parameter from ``weights`` (whole tensors by global
    name: a dict, or any mapping that makes each on demand, as a Hugging Face source
    does); returns each parameter's shard at the saved precision (master weights)."""
    params = dict(model.named_parameters())
    missing = sorted(n for n, p in params.items() if _source_name(n, p) not in weights)
    if missing:
        raise CheckpointError(f"{where}: the checkpoint has no weights for {', '.join(missing[:3])}"
                              f"{' ...' if len(missing) > 3 else ''}; use the same model flags as the saved run")
    saved_local: dict[nn.Parameter, torch.Tensor] = {}
    for name, p in params.items():
        saved = weights[_source_name(name, p)]
        local = _local(saved, p, tp)
        if local.shape != p.shape:
            raise CheckpointError(f"{where}: {name} has shape {tuple(saved.shape)}, "
                                  "which does not fit this model; use the same model flags as the saved run")
        p.copy_(local)
        saved_local[p] = local
    return saved_local


@torch.no_grad()
def init_weights(weights, model: nn.Module, optimizer=None, ctx=None, *, where: str) -> None:
    """Weights only (``--init-from``): this rank's shards from ``weights`` (see
    :func:`copy_weights`); an optimizer that keeps master weights takes them at the
    source's precision, not rounded to this run's dtype. Optimizer state stays fresh."""
    saved_local = copy_weights(weights, model, _tp_of(ctx), where)
    if optimizer is not None and hasattr(optimizer, "load_state_by_param"):
        optimizer.load_state_by_param({p: {"master": local.to(p.device)} for p, local in saved_local.items()})


@torch.no_grad()
def load_checkpoint(directory: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, ctx=None, *, scaler=None) -> int:
    """Load weights (and optimizer/RNG state when given) into whatever part of the model
    this rank holds, in whatever layout; returns the completed step count.

    Checks first, through :func:`check_loadable`: the manifest (every file hashed, once
    per process), meta.json, and the model config when ``model`` carries one
    (``model.cfg``, as :class:`~gridtrain.model.GPT` does). Only files the manifest
    lists are read.

    Master weights: an optimizer that keeps them (``load_state_by_param``) takes the
    saved ``master`` tensors, or, from a checkpoint without them (an fp32 run's), the
    saved weights at their full precision rather than the parameters already rounded to
    this run's dtype. A plain optimizer's parameters take the saved masters where there
    are some (a bf16/fp16 checkpoint resumed in fp32 continues from its fp32 weights).
    ``scaler`` (fp16's :class:`~gridtrain.distributed_optimizer.LossScaler`) takes the
    saved scale and counters when the checkpoint has them."""
    tp = _tp_of(ctx)
    run_model = getattr(model, "cfg", None)
    path = check_loadable(directory, run_model if isinstance(run_model, ModelConfig) else None)
    files = sorted(_read_manifest(path, "--load"))
    weights: dict[str, torch.Tensor] = {}
    for name in filter(_is_weights, files):  # the union of every stage's file (names are global)
        weights.update(_read_file(path, name, load_file))
    saved_local = copy_weights(weights, model, tp, f"--load {path}")
    params = dict(model.named_parameters())
    trainers = [_read_file(path, name, lambda f: torch.load(f, weights_only=False))
                for name in filter(_is_trainer, files)]
    if optimizer is not None:
        try:
            state_by_name = {k: v for t in trainers for k, v in t["state"].items()}
            groups = trainers[0]["param_groups"] if trainers else []
            rng = trainers[0].get("rng") if trainers else None
        except (KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"--load {path}: a trainer-pp*.pt file lacks optimizer state "
                                  f"({_first_line(exc)}); {_REDO}") from None
        keeps_masters = hasattr(optimizer, "load_state_by_param")
        states = {}
        for name, p in params.items():
            state = {k: _local(v, p, tp).to(p.device) if torch.is_tensor(v) and v.dim() else v
                     for k, v in (state_by_name.get(_source_name(name, p)) or {}).items()}
            if keeps_masters and "master" not in state:
                state["master"] = saved_local[p].to(p.device)
            elif not keeps_masters and "master" in state:
                p.copy_(state.pop("master"))
            if state:
                states[p] = state
        if keeps_masters:
            optimizer.load_state_by_param(states)
        else:
            optimizer.state.update(states)
        if trainers:
            for group, saved_group in zip(optimizer.param_groups, groups):
                group.update(saved_group)
            _restore_rng(rng, ctx)
    saved_scaler = trainers[0].get("scaler") if trainers and isinstance(trainers[0], dict) else None
    if scaler is not None and saved_scaler:
        scaler.load_state_dict(saved_scaler)
    return int(_read_meta_file(path, "--load")["step"])
