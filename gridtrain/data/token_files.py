"""Token files: a corpus tokenized once (``gridtrain prepare``), memory-mapped by every run.

A token file is three files:

* ``OUT.bin``: the token ids as one little-endian array of the vocabulary's width
  (:func:`~gridtrain.data.tokenizers.token_dtype`);
* ``OUT.idx`` (version 2): the document index, a little-endian int64 array of the token
  offset where each document begins: the first entry 0, strictly increasing, each below
  the token count. A document after the first begins AT the end-of-text token (eot) that
  separates it from the one before (the eot opens a document, like a BOS token); with a
  tokenizer without eot, at its first token. Read it with :func:`read_document_index`;
* ``OUT.json``: the header: ``format``, ``version``, ``dtype``, ``num_tokens``,
  ``vocab_size``, ``tokenizer``, and since version 2 ``num_documents``, ``index`` (the
  index file's name, beside the .bin) and ``unigram_entropy`` (nats per token of the
  whole array, :func:`~gridtrain.data.datasets.unigram_entropy`, counted while writing);
  files written since also record ``max_id``, the largest id in the array (a run checks
  it against its vocabulary before start; older files are scanned once instead).

Reading maps the arrays without copying them, so a huge corpus costs no RAM and starts at
once; the header's tokenizer must match the run's, because token ids mean nothing under
another one. Version-1 files (no index, no entropy) are still read; their index is None.
Writing is atomic, the header last (:func:`write_token_file`, :func:`finish_token_file`);
:mod:`gridtrain.data.prepare` tokenizes a corpus of any size into one in bounded memory.
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
TOKEN_FILE_VERSION = 2
READABLE_VERSIONS = (1, 2)
INDEX_DTYPE = np.dtype("<i8")


def _token_paths(output_path: str | os.PathLike) -> tuple[Path, Path]:
    """``OUT``, ``OUT.bin``, ``OUT.idx`` and ``OUT.json`` all name the pair (OUT.bin, OUT.json)."""
    path = Path(output_path)
    if path.suffix in (".bin", ".json", ".idx"):
        path = path.with_suffix("")
    return Path(f"{path}.bin"), Path(f"{path}.json")


def _index_path(bin_path: Path) -> Path:
    return bin_path.with_suffix(".idx")


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
    if header.get("version") not in READABLE_VERSIONS or not supported_dtype:
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


def largest_id(path: str | os.PathLike) -> int:
    """The largest token id of the token file at ``path``: its header's ``max_id``, else
    (a file written before headers carried it) one pass over the memory-mapped array."""
    header_path = find_token_header(path)
    tokens, header = read_token_file(header_path)
    if "max_id" in header:
        return int(header["max_id"])
    return max(int(tokens[start: start + (1 << 24)].max()) for start in range(0, len(tokens), 1 << 24))


def max_id_of(counts: np.ndarray) -> int:
    """The largest id with a nonzero count."""
    nonzero = np.flatnonzero(counts)
    return int(nonzero[-1]) if len(nonzero) else 0


def read_document_index(path: str | os.PathLike) -> np.ndarray | None:
    """The memory-mapped document index of a token file (int64 token offsets, see the
    module's docstring), or None for a version-1 file, which has none."""
    bin_path, json_path = _token_paths(path)
    tokens, header = read_token_file(json_path)
    if header["version"] < 2:
        return None
    index_path = bin_path.parent / str(header.get("index", _index_path(bin_path).name))
    num_documents = header.get("num_documents")
    expected = num_documents * INDEX_DTYPE.itemsize if isinstance(num_documents, int) else None
    actual = index_path.stat().st_size if index_path.is_file() else None
    if expected is None or actual != expected or num_documents < 1:
        raise DataError(
            f"--data {path}: the document index {index_path} has {actual} bytes but the header says "
            f"{expected} ({num_documents} documents); re-run `gridtrain prepare`"
        )
    index = np.memmap(index_path, dtype=INDEX_DTYPE, mode="r", shape=(num_documents,))
    if index[0] != 0 or not 0 <= index[-1] < len(tokens):
        raise DataError(
            f"--data {path}: the document index {index_path} does not fit the tokens (first {index[0]}, "
            f"last {index[-1]}, {len(tokens)} tokens); re-run `gridtrain prepare`"
        )
    return index


def entropy_from_counts(counts: np.ndarray) -> float:
    """Unigram entropy in nats per token from token counts (as ``unigram_entropy``)."""
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


class IndexWriter:
    """Appends document starts to an index file: only strictly increasing ones are kept
    (a document with no tokens begins where the next one does), and a last start equal
    to the token count (an empty last document without eot) is dropped by :meth:`finish`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.file = open(self.path, "wb")
        self.count = 0
        self.last = -1
        self.held: int | None = None

    def __enter__(self) -> "IndexWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def add(self, starts: np.ndarray) -> None:
        starts = np.asarray(starts, dtype=np.int64)
        if len(starts) == 0:
            return
        keep = starts > np.maximum.accumulate(np.concatenate([[self.last], starts[:-1]]))
        starts = starts[keep]
        if len(starts) == 0:
            return
        if self.held is not None:
            self._write(np.asarray([self.held], dtype=np.int64))
        self._write(starts[:-1])
        self.held = int(starts[-1])
        self.last = self.held

    def finish(self, num_tokens: int) -> None:
        if self.held is not None and self.held < num_tokens:
            self._write(np.asarray([self.held], dtype=np.int64))
        self.held = None
        self.file.flush()
        os.fsync(self.file.fileno())

    def _write(self, starts: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(starts, dtype=INDEX_DTYPE).tobytes())
        self.count += len(starts)


def document_starts(tokens: np.ndarray, eot_id: int | None) -> np.ndarray:
    """The index of documents joined by eot: 0, then every eot (one document without eot)."""
    if len(tokens) == 0:
        return np.zeros(0, dtype=np.int64)
    eots = np.flatnonzero(np.asarray(tokens) == eot_id) if eot_id is not None else np.zeros(0, dtype=np.int64)
    return np.concatenate([[0], eots[eots > 0]]).astype(np.int64)


def write_token_file(tokens: np.ndarray, output_path: str | os.PathLike, tokenizer: Tokenizer,
                     starts: np.ndarray | None = None) -> Path:
    """Write ``tokens`` as ``OUT.bin`` + ``OUT.idx`` + ``OUT.json``; returns the .bin path.

    ``starts`` (the document index) defaults to :func:`document_starts` (documents joined by eot).
    Every file is written atomically, the header last, so a reader never sees a header
    that describes a half-written array.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    bin_path, _ = _token_paths(output_path)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    starts = document_starts(tokens, tokenizer.eot_id) if starts is None else starts
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for start in range(0, len(tokens), 1 << 24):
        counts += np.bincount(np.asarray(tokens[start: start + (1 << 24)]), minlength=tokenizer.vocab_size)
    _write_atomic(bin_path, np.ascontiguousarray(tokens, dtype=dtype).tobytes())
    _write_atomic(_index_path(bin_path), np.ascontiguousarray(starts, dtype=INDEX_DTYPE).tobytes())
    _write_header(bin_path, tokenizer, len(tokens), len(starts), entropy_from_counts(counts), max_id_of(counts))
    return bin_path


def finish_token_file(tokens_tmp: Path, index_tmp: Path, output_path: str | os.PathLike,
                      tokenizer: Tokenizer, num_tokens: int, counts: np.ndarray) -> Path:
    """Move a token array and index written elsewhere (in the output's folder) into place
    as ``OUT.bin`` and ``OUT.idx``, then write the header (``counts``: of each id, for the
    entropy and the largest id); returns the .bin path."""
    bin_path, _ = _token_paths(output_path)
    with open(tokens_tmp, "rb+") as f:
        os.fsync(f.fileno())
    for tmp, path in ((tokens_tmp, bin_path), (index_tmp, _index_path(bin_path))):
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    num_documents = _index_path(bin_path).stat().st_size // INDEX_DTYPE.itemsize
    _write_header(bin_path, tokenizer, num_tokens, num_documents, entropy_from_counts(counts), max_id_of(counts))
    return bin_path


def _write_header(bin_path: Path, tokenizer: Tokenizer, num_tokens: int, num_documents: int,
                  entropy: float, max_id: int) -> None:
    dtype = token_dtype(tokenizer.vocab_size)
    header = {
        "format": TOKEN_FILE_FORMAT,
        "version": TOKEN_FILE_VERSION,
        "dtype": "uint16" if dtype.itemsize == 2 else "uint32",
        "num_tokens": int(num_tokens),
        "vocab_size": int(tokenizer.vocab_size),
        "tokenizer": tokenizer.name,
        "num_documents": int(num_documents),
        "index": _index_path(bin_path).name,
        "unigram_entropy": float(entropy),
        "max_id": int(max_id),
    }
    _write_atomic(bin_path.with_suffix(".json"), (json.dumps(header, indent=1) + "\n").encode("utf-8"))


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
