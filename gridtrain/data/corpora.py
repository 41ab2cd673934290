"""Corpora: every data source turned into one 1-D token array, in a fixed order.

Sources:

* ``None``: the built-in corpus, the running Python's standard-library ``.py`` sources
  (present offline on every machine);
* a UTF-8 text file;
* a folder: every UTF-8 text file under it, recursively, in sorted order;
* JSON lines (a ``.jsonl`` file, alone or in a folder): one document per line, the
  ``text`` field of its object, as fine-tuning sets are published;
* a token file written by ``gridtrain prepare`` (:mod:`gridtrain.data.prepare`), memory-mapped
  (:mod:`gridtrain.data.token_files`). A ``.bin`` without its header is refused: read as
  text it would train on the bytes of the token ids.

Documents (files, JSON lines) are packed into the one array with an end-of-text token
between them, so a window may span two documents, as in GPT-2's training.

Files that are not valid UTF-8 are skipped in folders (they are almost always binaries:
images, archives, compiled files) and rejected when named directly; decoding them with
replacement characters would silently train on garbage.

A corpus too small for one validation window plus one global batch of training windows
is refused (:func:`check_enough_tokens`) rather than trained on with repeated windows.
The same check runs before any process starts (gridtrain.training.validate), on
:func:`count_tokens`, which counts without tokenizing; one implementation, two callers,
so the message is the same whether the launcher or a worker finds the problem.
"""

from __future__ import annotations

import functools
import json
import os
import sysconfig
from pathlib import Path

import numpy as np

from gridtrain.data.errors import DataError
from gridtrain.data.token_files import open_token_file
from gridtrain.data.tokenizers import ByteTokenizer, Tokenizer, token_dtype

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
JSONL_SUFFIX = ".jsonl"


def builtin_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def builtin_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path.

    Third-party packages are excluded so that the corpus depends only on the Python
    version, not on what happens to be installed.
    """
    root = builtin_corpus_root()
    return _walk_sorted(root, lambda name: name.endswith(".py"), skip_dirs=EXCLUDED_DIRS)


def corpus_files(folder: Path) -> list[Path]:
    """Every non-hidden regular file under ``folder``, sorted by relative path."""
    return _walk_sorted(folder, lambda name: not name.startswith("."), skip_dirs=frozenset())


def _walk_sorted(root: Path, keep, skip_dirs: frozenset) -> list[Path]:
    """Sorting full relative paths (not per-directory) makes the order a pure function
    of the file tree, independent of the file system's listing order."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if keep(name) and os.path.isfile(os.path.join(dirpath, name)):
                found.append((rel_dir / name).as_posix())
    return [root / rel for rel in sorted(found)]


def _is_utf8(data: bytes) -> bool:
    if data.isascii():
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _describe(path: str | os.PathLike | None) -> str:
    """How a data source is named in error messages."""
    if path is None:
        return f"built-in corpus ({builtin_corpus_root()})"
    return f"--data {path}"


def load_tokens(path: str | os.PathLike | None, tokenizer: Tokenizer) -> np.ndarray:
    """The whole corpus as one 1-D token array; documents are joined by eot when there is one.

    A token file is memory-mapped (no copy); everything else is tokenized in memory.
    """
    token_file = open_token_file(path, tokenizer)
    if token_file is not None:
        return token_file
    if path is None and type(tokenizer) is ByteTokenizer:
        return builtin_bytes()
    return _load_text(path, *_text_files(path), tokenizer)


@functools.cache
def builtin_bytes() -> np.ndarray:
    """The built-in corpus in bytes, read and tokenized once per process (half a second
    or more of CPU per rank otherwise; a warm server that read it gives it to every worker
    it forks). Read-only: every caller shares the one array, as a token file's callers
    share its memory map."""
    tokens = _load_text(None, *_text_files(None), ByteTokenizer())
    tokens.flags.writeable = False
    return tokens


def _load_text(path, files: list[Path], skip_non_text: bool, tokenizer: Tokenizer) -> np.ndarray:
    documents = _read_documents(files, skip_non_text)
    if not documents and path is not None and Path(path).is_dir():
        raise _no_text_in_folder(path)
    return _check_nonempty(_tokenize(documents, tokenizer), path)


def count_tokens(path: str | os.PathLike | None, tokenizer: Tokenizer,
                 read_limit: int = 256 << 20) -> tuple[int, bool]:
    """The corpus's token count without tokenizing it: ``(count, exact)``.

    What :func:`load_tokens` would refuse is refused here too, with the same message, so
    that a bad corpus is one line before any worker starts. A token file's count comes
    from its header; byte-level text up to ``read_limit`` bytes is read (tens of
    milliseconds for the built-in corpus) and counted exactly. Larger text, or text for
    another tokenizer, gets an upper bound instead: its size in bytes plus one eot per
    document (a tokenizer makes at most one token per byte), so a refusal based on it is
    always right, and :func:`build_datasets` repeats the check on the exact count.
    """
    token_file = open_token_file(path, tokenizer)
    if token_file is not None:
        return len(token_file), True
    if path is None and type(tokenizer) is ByteTokenizer:
        return len(builtin_bytes()), True
    files, skip_non_text = _text_files(path)
    sizes = [_size(file) for file in files]
    if isinstance(tokenizer, ByteTokenizer) and sum(sizes) <= read_limit:
        return len(_load_text(path, files, skip_non_text, tokenizer)), True
    if not files:
        raise _no_text_in_folder(path)
    jsonl = [(file, size) for file, size in zip(files, sizes) if file.suffix == JSONL_SUFFIX]
    if jsonl and sum(size for _, size in jsonl) <= read_limit:  # a bad line is refused before any worker starts
        _read_documents([file for file, _ in jsonl], skip_non_text)
    nonempty = sum(1 for size in sizes if size)
    bound = sum(sizes) + (max(nonempty - 1, 0) if tokenizer.eot_id is not None else 0)
    if bound == 0:
        raise _empty(path)
    return bound, False


def check_enough_tokens(num_tokens: int, path: str | os.PathLike | None, seq_len: int,
                        global_batch_size: int = 1, valid_every: int | None = 100, exact: bool = True) -> None:
    """The corpus holds one validation window and a global batch of training windows
    (``valid_every`` None: nothing is held out, the windows all train or all validate).

    With fewer training windows than one global batch, every step would repeat windows
    (the sampler wraps around), which is never what a user means. ``exact=False`` says
    ``num_tokens`` is an upper bound (see :func:`count_tokens`).
    """
    windows = max((num_tokens - 1) // seq_len, 0)
    valid = windows // valid_every if valid_every is not None else 0
    count = f"{num_tokens} tokens" if exact else f"at most {num_tokens} tokens"
    if valid == 0 and valid_every is not None:
        raise DataError(
            f"{_describe(path)}: {count} give {windows} windows of --seq-len {seq_len}, "
            f"but {valid_every} windows ({valid_every * seq_len + 1} tokens) are needed for one "
            "validation window; use more data or a smaller --seq-len"
        )
    if windows - valid < global_batch_size:
        raise DataError(
            f"{_describe(path)}: {count} give {windows - valid} training windows of --seq-len "
            f"{seq_len}, fewer than one global batch of {global_batch_size}; use more data, a smaller "
            "--seq-len or a smaller --global-batch-size"
        )


def _text_files(path: str | os.PathLike | None) -> tuple[list[Path], bool]:
    """The text files of a source, and whether non-UTF-8 ones are skipped (folders)."""
    if path is None:
        return builtin_corpus_files(), True
    path = Path(path)
    if path.is_dir():
        return corpus_files(path), True
    if path.is_file():
        return [path], False
    raise DataError(f"--data {path}: no such file or directory")


def _size(file: Path) -> int:
    if not os.access(file, os.R_OK):
        raise DataError(f"--data {file}: not readable (permission denied); fix its permissions")
    return file.stat().st_size


def _no_text_in_folder(path) -> DataError:
    return DataError(f"--data {path}: no UTF-8 text files in this folder "
                     "(hidden and binary files are skipped)")


def _empty(path) -> DataError:
    return DataError(f"{_describe(path)}: the corpus is empty; give it some text")


def _check_nonempty(tokens: np.ndarray, path) -> np.ndarray:
    if len(tokens) == 0:
        raise _empty(path)
    return tokens


def _read_documents(files: list[Path], skip_non_text: bool) -> list[bytes]:
    """Raw bytes of each UTF-8 file. Empty files are dropped so they add no stray eot."""
    documents = []
    for file in files:
        try:
            data = file.read_bytes()
        except OSError as e:
            raise DataError(f"--data {file}: cannot read it ({e.strerror or e}); fix its permissions") from None
        if not _is_utf8(data):
            if skip_non_text:
                continue
            raise DataError(
                f"--data {file}: not UTF-8 text (if it is a token file, its .json header "
                "is missing; otherwise convert it to UTF-8)"
            )
        if file.suffix == JSONL_SUFFIX:
            documents.extend(_jsonl_documents(file, data))
        elif data:
            documents.append(data)
    return documents


JSONL_SHAPE = 'every line must be an object like {"text": "..."}'


def text_of_line(line: bytes) -> bytes | None:
    """The UTF-8 ``text`` of one JSON-lines record; None for a blank line or an empty
    text (no stray eot). Raises ValueError saying what is wrong with the line."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except ValueError as e:
        raise ValueError(f"is not JSON ({getattr(e, 'msg', e)})") from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise ValueError('has no string "text" field')
    return text.encode("utf-8") if text else None


def _jsonl_documents(file: Path, data: bytes) -> list[bytes]:
    """Each line's ``text`` field (:func:`text_of_line`). A JSON string holds no raw
    newline, so a line is a record. Each document's byte count is below its line's, so a
    file's size still bounds its tokens plus separators (count_tokens)."""
    documents = []
    for number, line in enumerate(data.splitlines(), 1):
        try:
            text = text_of_line(line)
        except ValueError as e:
            raise DataError(f"--data {file}: line {number} {e}; {JSONL_SHAPE}") from None
        if text:
            documents.append(text)
    return documents


def _tokenize(documents: list[bytes], tokenizer: Tokenizer) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):
        parts = [np.frombuffer(doc, dtype=np.uint8) for doc in documents]
    elif hasattr(tokenizer, "encode_batch"):
        ids = tokenizer.encode_batch([doc.decode("utf-8") for doc in documents])
        parts = [np.asarray(x, dtype=np.int64) for x in ids]
    else:
        ids = [tokenizer.encode(doc.decode("utf-8")) for doc in documents]
        parts = [np.asarray(x, dtype=np.int64) for x in ids]
    return _join(parts, tokenizer.eot_id, token_dtype(tokenizer.vocab_size))


def _join(parts: list[np.ndarray], eot_id: int | None, dtype: np.dtype) -> np.ndarray:
    """Concatenate documents with eot between them, writing each part once into place."""
    sep = 0 if eot_id is None else 1
    total = sum(len(p) for p in parts) + sep * max(len(parts) - 1, 0)
    out = np.empty(total, dtype=dtype)
    pos = 0
    for k, part in enumerate(parts):
        if k and sep:
            out[pos] = eot_id
            pos += 1
        out[pos : pos + len(part)] = part
        pos += len(part)
    return out
