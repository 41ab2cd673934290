"""Token files: a corpus tokenized once (``gridtrain prepare``), memory-mapped by every run.

A token file is a pair: ``OUT.bin``, the token ids as one little-endian array of the
vocabulary's width (:func:`~gridtrain.data.tokenizers.token_dtype`), and ``OUT.json``,
its header (format, version, dtype, count, vocabulary size, tokenizer). Reading maps the
array without copying it, so a huge corpus costs no RAM and starts at once; the header's
tokenizer must match the run's, because token ids mean nothing under another one.
Writing is atomic, the header last (:func:`write_token_file`); ``prepare``
(:mod:`gridtrain.data.corpora`) tokenizes a corpus and writes it here.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from gridtrain.data.errors import DataError
from gridtrain.data.tokenizers import Tokenizer, token_dtype

TOKEN_FILE_FORMAT = "gridtrain-tokens"
TOKEN_FILE_VERSION = 1


def _token_paths(output_path: str | os.PathLike) -> tuple[Path, Path]:
    """``OUT``, ``OUT.bin`` and ``OUT.json`` all name the pair (OUT.bin, OUT.json)."""
    path = Path(output_path)
    if path.suffix in (".bin", ".json"):
        path = path.with_suffix("")
    return Path(f"{path}.bin"), Path(f"{path}.json")


def find_token_header(path: str | os.PathLike) -> Path | None:
    """The JSON header if ``path`` names a token file (its .bin, its .json, or the stem)."""
    path = Path(path)
    if path.suffix == ".json":
        candidates = [path]
    elif path.suffix == ".bin":
        candidates = [path.with_suffix(".json")]
    elif not path.exists():
        candidates = [Path(f"{path}.json")]
    else:
        return None
    for candidate in candidates:
        if _read_header(candidate) is not None:
            return candidate
    return None


def _read_header(path: Path) -> dict | None:
    """The header dict, or None when the file is absent or is not a token-file header."""
    try:
        if not path.is_file() or path.stat().st_size > 65536:
            return None
        header = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(header, dict) and header.get("format") == TOKEN_FILE_FORMAT:
        return header
    return None


def read_token_file(path: str | os.PathLike) -> tuple[np.memmap, dict]:
    """Memory-map a token file so that huge corpora cost no RAM and start instantly."""
    bin_path, json_path = _token_paths(path)
    header = _read_header(json_path)
    if header is None:
        raise DataError(f"--data {path}: no token-file header {json_path}; run `gridtrain prepare`")
    supported_dtype = header.get("dtype") in ("uint16", "uint32")
    if header.get("version") != TOKEN_FILE_VERSION or not supported_dtype:
        raise DataError(
            f"--data {path}: unsupported token file (version {header.get('version')}, "
            f"dtype {header.get('dtype')}); re-run `gridtrain prepare`"
        )
    dtype = np.dtype("<u2") if header["dtype"] == "uint16" else np.dtype("<u4")
    num_tokens = int(header["num_tokens"])
    expected = num_tokens * dtype.itemsize
    actual = bin_path.stat().st_size if bin_path.is_file() else None
    if actual != expected:
        raise DataError(
            f"--data {path}: {bin_path} has {actual} bytes but the header says {expected}; "
            "re-run `gridtrain prepare`"
        )
    if num_tokens == 0:
        raise DataError(f"--data {path}: the token file is empty; prepare a non-empty corpus")
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(num_tokens,)), header


def _check_vocab(header: dict, tokenizer: Tokenizer, path) -> None:
    """Token ids only mean something under the tokenizer that produced them."""
    was_byte = header.get("tokenizer") == "byte"
    is_byte = tokenizer.name == "byte"
    if header.get("vocab_size") != tokenizer.vocab_size or was_byte != is_byte:
        raise DataError(
            f"--data {path}: token file was made with tokenizer {header.get('tokenizer')} "
            f"(vocab {header.get('vocab_size')}) but the tokenizer in use is {tokenizer.name} "
            f"(vocab {tokenizer.vocab_size}); pass the matching --tokenizer or re-run prepare"
        )


def open_token_file(path: str | os.PathLike | None, tokenizer: Tokenizer) -> np.ndarray | None:
    """The memory-mapped tokens when ``path`` names a token file, else None.

    A ``.bin`` is always a token file: without its ``.json`` header it is refused,
    because reading it as text would train on the bytes of the token ids.
    """
    if path is None:
        return None
    header_path = find_token_header(path)
    if header_path is None:
        if Path(path).suffix == ".bin" and Path(path).is_file():
            raise DataError(
                f"--data {path}: a .bin token file is not UTF-8 text and needs its header "
                f"{Path(path).with_suffix('.json')}, which is missing or not a gridtrain token header; "
                "re-run `gridtrain prepare` (or rename the file if it is text)"
            )
        return None
    tokens, header = read_token_file(header_path)
    _check_vocab(header, tokenizer, path)
    return tokens


def write_token_file(tokens: np.ndarray, output_path: str | os.PathLike, tokenizer: Tokenizer) -> Path:
    """Write ``tokens`` as ``OUT.bin`` + ``OUT.json``; returns the .bin path.

    Both files are written atomically, the header last, so a reader never sees a header
    that describes a half-written array.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    bin_path, json_path = _token_paths(output_path)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "format": TOKEN_FILE_FORMAT,
        "version": TOKEN_FILE_VERSION,
        "dtype": "uint16" if dtype.itemsize == 2 else "uint32",
        "num_tokens": int(len(tokens)),
        "vocab_size": int(tokenizer.vocab_size),
        "tokenizer": tokenizer.name,
    }
    _write_atomic(bin_path, np.ascontiguousarray(tokens, dtype=dtype).tobytes())
    _write_atomic(json_path, (json.dumps(header, indent=1) + "\n").encode("utf-8"))
    return bin_path


def _write_atomic(path: Path, data: bytes) -> None:
    """mkstemp creates its file 0600; the result gets the mode of a plain new file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask (reading it means setting it; put straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
