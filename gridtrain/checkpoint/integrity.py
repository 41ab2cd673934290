"""Checkpoint integrity: never a half-written checkpoint, never a damaged or mismatched
one loaded. Independent of how the tensors are stored (sharded.py, whole.py).

**Writing.** A save goes into a hidden directory with a name unique to that save
(``.step_0000200.tmp-<pid>-<random>``), so the leftovers of a crashed save never mix with
a new one. Each writing rank writes, fsyncs and hashes its own files (in parallel); rank
0 gathers the sizes and checksums, writes ``meta.json``, and then ``manifest.json`` last
(temporary file, fsync, rename). Only then is the directory renamed into place and
``latest`` replaced atomically. Re-saving a step that exists never deletes the complete
old directory first: old renamed aside (``.step_X.old-...``), new renamed into place,
``latest`` updated, old deleted. At every instant a complete checkpoint is reachable
from ``latest``, with one window: between the two renames ``step_X`` is missing, and if
``latest`` names it, :func:`resolve` falls back to the complete hidden copy of that step
(the one whose manifest is newest). A successful save removes every hidden leftover of
the directory, so a save directory must have one writer at a time (one run), and, with
``--keep-last K``, every complete step directory but the newest K. Any rank's failure to
write reaches every rank, which all raise the same error; the previous checkpoint stays
as it was.

**Reading.** Nothing is read before the manifest is checked: every listed file must be
there with its size and sha256 (extra files are ignored, and never loaded). Each
problem, and each file that cannot be read, is a :class:`CheckpointError` of one line
naming the file, what is wrong and the fix. The checkpoint's model config (meta.json)
must equal the run's on every field that changes the weights' shapes or meaning (all of
:class:`~gridtrain.config.ModelConfig` except dropout, attention, vocab_pad_multiple and
max_positions, with ffn_hidden compared as the resolved ffn_size and n_kv_head as the
resolved key/value head count); one line names each differing field with both values.

**Checksum cost.** sha256 (hashlib) hashes about 1.7 GB/s in memory on this project's
CPU hosts (SHA extensions; blake2b 0.8 GB/s, md5 0.7 GB/s, crc32 3.5 GB/s but weaker),
and verifying a file from the page cache (read + hash) runs at about 1.3 GB/s, i.e.
about 0.8 s per GB, so sha256 it is. Sealing a file on save (read back, hash, fsync)
ran at 0.8 GB/s, mostly the fsync. :func:`check_loadable` (run before any worker is
spawned) hashes everything; loading verifies again in each process, but a process never
hashes the same unchanged file twice (a per-process record keyed by path, size, mtime
and inode), so a torchrun worker that validated its own config loads without hashing
again. ``check_loadable(..., verify_data=False)`` checks presence and sizes only (and
meta.json's checksum).

**Checkpoints from before manifests** (no ``manifest.json``) are refused, because a
missing manifest is also what an incomplete or foreign directory looks like. The
message gives the fix for a trusted old checkpoint: :func:`write_manifest` on its step
directory.
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

import torch.distributed as dist

from gridtrain.config import Config, ModelConfig

LATEST = "latest"
MANIFEST = "manifest.json"
META = "meta.json"
MANIFEST_FORMAT = "gridtrain-checkpoint-manifest"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of every stored chunk
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
    the manifest and hidden ones, DCP's ``.metadata`` included): the way to adopt a
    checkpoint written before manifests, once you trust it. Returns the manifest's path."""
    path = Path(directory)
    entries = {f.name: _seal(f) for f in sorted(path.iterdir())
               if f.is_file() and f.name != MANIFEST and (f.name == DCP_METADATA or not f.name.startswith("."))}
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
        raise CheckpointError(f"{where}: {MANIFEST} lists no {META}, or neither {DCP_METADATA} nor "
                              f"model-pp*.safetensors; {_REDO}")
    return files


def _is_weights(name: str) -> bool:
    """A file that indexes weights: DCP's metadata (format 2) or a whole-tensor file (format 1)."""
    return name == DCP_METADATA or (name.startswith("model-pp") and name.endswith(".safetensors"))


def is_sharded(step: Path) -> bool:
    """Whether a checked step directory is in the sharded format (torch.distributed.checkpoint)."""
    return DCP_METADATA in _read_manifest(step, "--load")


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


# ---- writing a step directory ----------------------------------------------------------------




def _broadcast_from_rank0(value, group=None):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _all_gather(value, group=None) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value, group=group)
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


def _swap_into_place(tmp: Path, final: Path, keep_last: int = 0) -> None:
    """Complete ``tmp`` becomes ``final``; an existing ``final`` is removed only after the
    new one is in place and ``latest`` names it (see the module docstring); then, with
    ``keep_last`` > 0, every complete step directory but the newest ``keep_last``."""
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
    if keep_last > 0:
        for old in _complete_step_dirs(final.parent)[:-keep_last]:
            if old != final:  # `latest` names final; never delete it
                shutil.rmtree(old, ignore_errors=True)


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


# ---- finding and checking a checkpoint ------------------------------------------------------


def _looks_like_step_dir(path: Path) -> bool:
    return ((path / MANIFEST).is_file() or (path / META).is_file() or (path / DCP_METADATA).is_file()
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


