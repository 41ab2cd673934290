"""Where checkpoints live: step directories, ``latest``, atomic moves, ``--keep-last``,
and finding the step directory a path means.

**Writing.** A save goes into a hidden directory with a name unique to that save
(``.step_0000200.tmp-<pid>-<random>``), so the leftovers of a crashed save never mix with
a new one. When its files and manifest are complete (manifest.py), the directory is
renamed into place and ``latest`` replaced atomically (:func:`swap_into_place`).
Re-saving a step that exists never deletes the complete old directory first: old
renamed aside (``.step_X.old-...``), new renamed into place, ``latest`` updated, old
deleted. At every instant a complete checkpoint is reachable from ``latest``, with one
window: between the two renames ``step_X`` is missing, and if ``latest`` names it,
:func:`resolve` falls back to the complete hidden copy of that step (the one whose
manifest is newest). A successful save removes every hidden leftover of the directory,
so a save directory must have one writer at a time (one run), and, with
``--keep-last K``, every complete step directory but the newest K.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

from gridtrain.checkpoint.errors import REDO, CheckpointError, first_line
from gridtrain.checkpoint.manifest import (DCP_METADATA, MANIFEST, META, fsync_dir, read_meta_file, seal, verify,
                                           write_atomically, write_manifest_entries)
from gridtrain.config import Config

LATEST = "latest"
_STEP_NAME = re.compile(r"step_\d+")
_LEFTOVER_PATTERNS = (".step_*.tmp-*", ".step_*.old-*")


def step_dir(directory: str | Path, step: int) -> Path:
    """Where step ``step`` of a save directory lives (``step_0000200``)."""
    return Path(directory) / f"step_{step:07d}"


def new_tmp_dir(final: Path) -> Path:
    """A new hidden directory beside ``final``, unique to this save, to write it into."""
    final.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def swap_into_place(tmp: Path, final: Path, keep_last: int = 0) -> None:
    """Complete ``tmp`` becomes ``final``; an existing ``final`` is removed only after the
    new one is in place and ``latest`` names it (see the module docstring); then, with
    ``keep_last`` > 0, every complete step directory but the newest ``keep_last``."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{tmp.name.rsplit('.tmp-', 1)[1]}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    write_atomically(final.parent / LATEST, final.name)
    fsync_dir(final.parent)
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
    meta.json and the manifest and moves it into place exactly as :func:`~gridtrain.checkpoint.save_checkpoint`
    does, so every reader treats it as a run's checkpoint with no optimizer state."""
    final = step_dir(directory, step)
    tmp = new_tmp_dir(final)
    try:
        write_files(tmp)
        entries = {f.name: seal(f) for f in sorted(tmp.iterdir()) if f.is_file()}
        meta = tmp / META
        write_atomically(meta, json.dumps({"step": step, "config": cfg.to_dict()}, indent=2))
        entries[META] = seal(meta)
        write_manifest_entries(tmp, step, entries)
        swap_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


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


def find_step_dir(directory: str | Path, flag: str) -> Path | None:
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
                                  f"{MANIFEST}); pass a step directory, or {REDO}")
        return None
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        name, garbage = None, first_line(exc)
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
    Reads only names; the files are checked by
    :func:`~gridtrain.checkpoint.loadable.check_loadable`."""
    path = find_step_dir(directory, "--load")
    if path is None:
        raise CheckpointError(f"--load {directory}: no checkpoint there (no {LATEST} file "
                              f"and no {META}); pass a directory written by --save")
    return path


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
    found = find_step_dir(path, "--save")
    if found is None:
        return None
    verify(found, "--save", data=verify_data)
    read_meta_file(found, "--save")
    return found
