"""The manifest: every file of a checkpoint with its size and sha256, written last,
checked before anything is read. Independent of how the tensors are stored (sharded.py,
whole.py).

**Writing.** Each writing rank writes, fsyncs and hashes its own files (:func:`seal`);
rank 0 gathers the entries, writes ``meta.json``, and then ``manifest.json`` last
(:func:`write_manifest_entries`: temporary file, fsync, rename), so a manifest's presence
means the directory is complete (directories.py moves it into place).

**Reading.** Nothing is read before the manifest is checked (:func:`verify`): every
listed file must be there with its size and sha256 (extra files are ignored, and never
loaded). Each problem, and each file that cannot be read, is a
:class:`~gridtrain.checkpoint.errors.CheckpointError` of one line naming the file, what
is wrong and the fix.

**Checksum cost.** sha256 (hashlib) hashes about 1.7 GB/s in memory on this project's
CPU hosts (SHA extensions; blake2b 0.8 GB/s, md5 0.7 GB/s, crc32 3.5 GB/s but weaker),
and verifying a file from the page cache (read + hash) runs at about 1.3 GB/s, i.e.
about 0.8 s per GB, so sha256 it is. Sealing a file on save (read back, hash, fsync)
ran at 0.8 GB/s, mostly the fsync. ``check_loadable`` (run before any worker is
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
from pathlib import Path
from typing import Any

from gridtrain.checkpoint.errors import REDO, CheckpointError, first_line

MANIFEST = "manifest.json"
META = "meta.json"
MANIFEST_FORMAT = "gridtrain-checkpoint-manifest"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of every stored chunk
_CHUNK = 8 << 20


# ---- writing files durably -------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (where the file system can)."""
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


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` all at once: a reader sees the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---- sizes and checksums ----------------------------------------------------------------------

_verified: set[tuple] = set()  # (path, size, mtime_ns, inode, sha256) hashed by this process


def _stat_key(path: Path, digest: str) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, digest)


def seal(path: Path) -> dict[str, Any]:
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


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest_entries(path: Path, step: int | None, entries: dict[str, dict[str, Any]]) -> None:
    manifest = {"format": MANIFEST_FORMAT, "version": 1, "step": step, "checksum": "sha256",
                "files": dict(sorted(entries.items()))}
    write_atomically(path / MANIFEST, json.dumps(manifest, indent=1))
    fsync_dir(path)


def write_manifest(directory: str | Path) -> Path:
    """Write ``manifest.json`` for a step directory as it is now (every regular file but
    the manifest and hidden ones, DCP's ``.metadata`` included): the way to adopt a
    checkpoint written before manifests, once you trust it. Returns the manifest's path."""
    path = Path(directory)
    entries = {f.name: seal(f) for f in sorted(path.iterdir())
               if f.is_file() and f.name != MANIFEST and (f.name == DCP_METADATA or not f.name.startswith("."))}
    step = None
    try:
        step = int(json.loads((path / META).read_text())["step"])
    except Exception:
        pass
    write_manifest_entries(path, step, entries)
    return path / MANIFEST


def read_manifest(path: Path, flag: str) -> dict[str, dict[str, Any]]:
    """The manifest's file entries, its shape checked."""
    where = f"{flag} {path}"
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(
            f"{where}: no {MANIFEST}, so it is incomplete, not written by gridtrain, or from before "
            f"checkpoint manifests; {REDO} (for an old checkpoint you trust: python -c \"from "
            f"gridtrain.checkpoint import write_manifest; write_manifest('{path}')\")")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {MANIFEST} cannot be read ({first_line(exc)}); {REDO}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT
            or not isinstance(files, dict)):
        raise CheckpointError(f"{where}: {MANIFEST} is not a gridtrain checkpoint manifest; {REDO}")
    for name, entry in files.items():
        if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
                or not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get("sha256"), str)):
            raise CheckpointError(f"{where}: {MANIFEST} has a malformed entry {str(name)[:60]!r}; {REDO}")
    if META not in files or not any(is_weights(n) for n in files):
        raise CheckpointError(f"{where}: {MANIFEST} lists no {META}, or neither {DCP_METADATA} nor "
                              f"model-pp*.safetensors; {REDO}")
    return files


def is_weights(name: str) -> bool:
    """A file that indexes weights: DCP's metadata (format 2) or a whole-tensor file (format 1)."""
    return name == DCP_METADATA or (name.startswith("model-pp") and name.endswith(".safetensors"))


def is_sharded(step: Path) -> bool:
    """Whether a checked step directory is in the sharded format (torch.distributed.checkpoint)."""
    return DCP_METADATA in read_manifest(step, "--load")


def is_trainer(name: str) -> bool:
    return name.startswith("trainer-pp") and name.endswith(".pt")


def verify(path: Path, flag: str, data: bool) -> dict[str, dict[str, Any]]:
    """Check every listed file's presence and size, and (``data``) its sha256; returns
    the manifest's entries. ``meta.json`` is always hashed (it is small)."""
    files = read_manifest(path, flag)
    where = f"{flag} {path}"
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{where}: {name} is missing (the manifest lists it); {REDO}")
        size = file.stat().st_size
        if size != entry["size"]:
            what = "truncated" if size < entry["size"] else "longer than written"
            raise CheckpointError(f"{where}: {name} is {size} bytes, the manifest says "
                                  f"{entry['size']} ({what}); {REDO}")
    for name, entry in files.items():
        if not (data or name == META):
            continue
        file = path / name
        if _stat_key(file, entry["sha256"]) in _verified:
            continue
        try:
            digest = sha256(file)
        except OSError as exc:
            raise CheckpointError(f"{where}: {name} cannot be read ({first_line(exc)}); {REDO}") from None
        if digest != entry["sha256"]:
            raise CheckpointError(f"{where}: {name} has sha256 {digest[:12]}..., the manifest says "
                                  f"{entry['sha256'][:12]}... (its bytes changed since it was written); {REDO}")
        _verified.add(_stat_key(file, digest))
    return files


def weight_files(step: Path) -> list[Path]:
    """A checked step directory's weight files (one per pipeline stage), as its manifest lists them."""
    return [step / name for name in sorted(read_manifest(step, "--load")) if is_weights(name)]


def read_meta_file(path: Path, flag: str) -> dict[str, Any]:
    """A step directory's ``meta.json`` (step, config), its shape checked; one-line errors."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{flag} {path}: {META} cannot be read ({first_line(exc)}); {REDO}") from None
    if (not isinstance(meta, dict) or not isinstance(meta.get("step"), int)
            or not isinstance(meta.get("config"), dict)
            or not isinstance(meta["config"].get("model", {}), dict)):
        raise CheckpointError(f"{flag} {path}: {META} lacks an integer step or a config; {REDO}")
    return meta
