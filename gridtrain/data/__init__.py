"""Tokenizers, corpora, datasets and the global-batch sampler.

Everything here serves the design invariant "any parallel layout trains the same model as
one process": the corpus becomes one token array in a fixed order, the array is cut into
fixed windows, and :class:`GlobalBatchSampler` maps an optimizer step to the same global
batch whatever the data-parallel size or micro-batch size. Data-parallel ranks and
micro-batches only ever take fixed slices of that global batch.

Corpus sources, all turned into one 1-D token array:

* ``None``: the built-in corpus, the running Python's standard-library ``.py`` sources
  (present offline on every machine);
* a UTF-8 text file;
* a folder: every UTF-8 text file under it, recursively, in sorted order;
* JSON lines (a ``.jsonl`` file, alone or in a folder): one document per line, the
  ``text`` field of its object, as fine-tuning sets are published;
* a token file written by :func:`prepare` (``OUT.bin`` + ``OUT.json``), memory-mapped.
  A ``.bin`` without its header is refused: read as text it would train on the bytes of
  the token ids.

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

import json
import os
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
import torch

TOKEN_FILE_FORMAT = "gridtrain-tokens"
TOKEN_FILE_VERSION = 1
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
JSONL_SUFFIX = ".jsonl"


Batch = dict[str, torch.Tensor]  # a micro-batch: "tokens", "labels", ... each [b, s]


class DataError(ValueError):
    """A data or tokenizer problem the user can fix; the message is one line naming both."""


@dataclass
class Datasets:
    """What a datasets provider returns (see gridtrain.training.loop.pretrain).

    ``train``/``valid`` are map-style datasets whose items are dicts of equal-shape
    tensors with at least ``labels`` (positions equal to IGNORE_INDEX carry no loss).
    ``reference_loss`` (e.g. the corpus's unigram entropy) is printed beside the final
    validation loss; ``tokenizer`` lets the run print a sample at the end.
    ``every_label_counts``: the provider promises that no label is IGNORE_INDEX (windows
    of a token stream), so the global batch's loss-bearing tokens are known without
    counting them: the step skips the token-count all-reduce and its host read.
    """

    train: Any
    valid: Any = None
    tokenizer: Any = None
    reference_loss: float | None = None
    loss_unit: str = "nats/token"
    every_label_counts: bool = False


# ---------------------------------------------------------------------------- tokenizers


class Tokenizer(Protocol):
    """What the rest of gridtrain needs from a tokenizer."""

    name: str
    vocab_size: int
    eot_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus one end-of-text token.

    Needs no files and no training, so every machine can tokenize every corpus
    identically; 257 tokens keep the embedding tiny for tests.
    """

    name = "byte"
    eot_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Render eot as a newline so sampled documents stay readable."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                out.append(i)
            elif i == self.eot_id:
                out.extend(b"\n")
        return out.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (BPE, WordPiece, ...) via the ``tokenizers`` package.

    The package is imported lazily so that byte-level training never needs it.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError:
            raise DataError(
                f"the tokenizers package is needed for {path}: pip install tokenizers"
            ) from None
        if not path.is_file():
            raise DataError(f"--tokenizer {path}: no such file")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DataError(f"--tokenizer {path}: not a tokenizer.json file ({msg})") from None
        self.name = str(path.resolve())
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot_id: int | None = _find_eot(self._tok)

    def encode(self, text: str) -> list[int]:
        """No special tokens are added: documents are separated by eot in load_tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many documents at once; the Rust side parallelises them."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Special tokens are kept so that document boundaries stay visible."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token(self, token_id: int) -> str | None:
        """The text of one token id (e.g. the end-of-text token's, for an exported config)."""
        return self._tok.id_to_token(int(token_id))


def _find_eot(tok) -> int | None:
    for token in EOT_CANDIDATES:
        token_id = tok.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


def load_tokenizer(path: str | os.PathLike | None) -> ByteTokenizer | HFTokenizer:
    """``None`` (or ``"byte"``) gives the byte tokenizer; anything else is a tokenizer.json."""
    if path is None or str(path) == "byte":
        return ByteTokenizer()
    return HFTokenizer(path)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest little-endian unsigned dtype for the vocabulary (halves memory for GPT-2)."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


# ------------------------------------------------------------------------------- corpora


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
    token_file = _token_file(path, tokenizer)
    if token_file is not None:
        return token_file
    return _load_text(path, *_text_files(path), tokenizer)


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
    token_file = _token_file(path, tokenizer)
    if token_file is not None:
        return len(token_file), True
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
                        global_batch_size: int = 1, valid_every: int = 100, exact: bool = True) -> None:
    """The corpus holds one validation window and a global batch of training windows.

    With fewer training windows than one global batch, every step would repeat windows
    (the sampler wraps around), which is never what a user means. ``exact=False`` says
    ``num_tokens`` is an upper bound (see :func:`count_tokens`).
    """
    windows = max((num_tokens - 1) // seq_len, 0)
    valid = windows // valid_every
    count = f"{num_tokens} tokens" if exact else f"at most {num_tokens} tokens"
    if valid == 0:
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


def _token_file(path: str | os.PathLike | None, tokenizer: Tokenizer) -> np.ndarray | None:
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


def _jsonl_documents(file: Path, data: bytes) -> list[bytes]:
    """Each line's ``text`` field, UTF-8 encoded; blank lines and empty texts add nothing
    (no stray eot). A JSON string holds no raw newline, so a line is a record. Each
    document's byte count is below its line's, so a file's size still bounds its tokens
    plus separators (count_tokens)."""
    documents = []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise DataError(f"--data {file}: line {number} is not JSON ({getattr(e, 'msg', e)}); "
                            'every line must be an object like {"text": "..."}') from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise DataError(f'--data {file}: line {number} has no string "text" field; '
                            'every line must be an object like {"text": "..."}')
        if text:
            documents.append(text.encode("utf-8"))
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


# --------------------------------------------------------------------------- token files


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


def prepare(
    input_path: str | os.PathLike | None,
    output_path: str | os.PathLike,
    tokenizer_path: str | os.PathLike | None = None,
) -> Path:
    """Tokenize a corpus once into ``OUT.bin`` + ``OUT.json``; returns the .bin path.

    Both files are written atomically, the header last, so a reader never sees a header
    that describes a half-written array.
    """
    tokenizer = load_tokenizer(tokenizer_path)
    tokens = load_tokens(input_path, tokenizer)
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


# ------------------------------------------------------------------------------ datasets


class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens; the extra token is the last label.

    Windows are a fixed function of the token array, so a sample index means the same
    text on every rank and every run.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if seq_len < 1:
            raise DataError(f"--seq-len {seq_len}: must be at least 1")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max((len(self.tokens) - 1) // self.seq_len, 0)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range [0, {len(self)})")
        start = i * self.seq_len
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return {"tokens": window[:-1], "labels": window[1:]}


class WindowSubset(torch.utils.data.Dataset):
    """A view of some windows of a dataset, addressed 0..len(ids)-1."""

    def __init__(self, dataset: TokenWindows, ids: np.ndarray) -> None:
        self.dataset = dataset
        self.ids = np.asarray(ids, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.dataset[self.ids[int(i)]]


def split_windows(num_windows: int, valid_every: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Every ``valid_every``-th window is held out.

    Interleaving (rather than taking the tail) makes validation representative of the
    whole corpus, which for a sorted folder would otherwise be its last few files.
    """
    if valid_every < 2:
        raise DataError(f"valid_every={valid_every}: must be at least 2 to leave training data")
    ids = np.arange(num_windows, dtype=np.int64)
    is_valid = ids % valid_every == valid_every - 1
    return ids[~is_valid], ids[is_valid]


def build_datasets(
    data_path: str | os.PathLike | None,
    tokenizer: Tokenizer,
    seq_len: int,
    valid_every: int = 100,
    global_batch_size: int = 1,
) -> tuple[WindowSubset, WindowSubset, np.ndarray]:
    """Train and validation datasets over one corpus, plus the token array itself.

    The training split must hold at least ``global_batch_size`` windows (see
    :func:`check_enough_tokens`, which the pre-start validation also runs).
    """
    tokens = load_tokens(data_path, tokenizer)
    windows = TokenWindows(tokens, seq_len)
    train_ids, valid_ids = split_windows(len(windows), valid_every)
    check_enough_tokens(len(tokens), data_path, seq_len, global_batch_size, valid_every)
    return WindowSubset(windows, train_ids), WindowSubset(windows, valid_ids), tokens


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy of the token frequencies in nats per token.

    A model that ignores context can reach this loss and no lower, so a language model's
    loss must go below it to show it learned anything beyond frequencies.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    chunk = 1 << 24  # bounds the int64 temporary bincount makes from uint16 input
    for start in range(0, len(tokens), chunk):
        piece = np.asarray(tokens[start : start + chunk])
        piece_counts = np.bincount(piece, minlength=vocab_size)
        if len(piece_counts) > vocab_size:
            raise DataError(f"token id {len(piece_counts) - 1} is outside vocab {vocab_size}")
        counts += piece_counts
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def collate(dataset: torch.utils.data.Dataset, ids: Sequence[int]) -> Batch:
    """Stack the samples ``ids`` into a batch of shape [len(ids), seq_len]."""
    samples = [dataset[int(i)] for i in ids]
    return {key: torch.stack([s[key] for s in samples]) for key in ("tokens", "labels")}


# ------------------------------------------------------------------------------- sampler


class GlobalBatchSampler:
    """Maps an optimizer step to sample indices, independently of the parallel layout.

    The sample stream is the concatenation of per-epoch permutations, each seeded by
    (seed, epoch); step k's global batch is positions [k*G, (k+1)*G) of that stream (it
    may straddle an epoch boundary). DP rank r takes the fixed slice [r*G/dp, (r+1)*G/dp)
    and micro-batch j is slice [j*M, (j+1)*M) of the rank's slice. Nothing depends on how
    many steps ran before, so resuming at step k reproduces the same batches.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_size: int = 1,
        dp_rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        _check_sizes(num_samples, global_batch_size, micro_batch_size, dp_size, dp_rank, seed)
        self.shuffle = shuffle  # False: the stream is 0, 1, 2, ... (validation sets)
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self._perms: dict[int, np.ndarray] = {}  # memo only: at most two recent epochs

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.dp_size

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(self.num_samples)
        return self._perms[epoch]

    def global_batch(self, step: int) -> np.ndarray:
        if step < 0:
            raise ValueError(f"step {step} must be >= 0")
        start = step * self.global_batch_size
        positions = np.arange(start, start + self.global_batch_size, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.num_samples)
        out = np.empty(self.global_batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self.epoch_permutation(int(epoch))[offsets[mask]]
        return out

    def local_batch(self, step: int) -> np.ndarray:
        size = self.local_batch_size
        return self.global_batch(step)[self.dp_rank * size : (self.dp_rank + 1) * size]

    def micro_batches(self, step: int) -> list[np.ndarray]:
        local, m = self.local_batch(step), self.micro_batch_size
        return [local[j * m : (j + 1) * m] for j in range(self.num_micro_batches)]


def _check_sizes(num_samples, global_batch, micro_batch, dp_size, dp_rank, seed) -> None:
    if num_samples < 1:
        raise DataError(f"the dataset has {num_samples} samples; it needs at least one")
    if global_batch < 1 or micro_batch < 1 or dp_size < 1:
        raise DataError(
            f"global batch {global_batch}, micro-batch {micro_batch} and dp {dp_size} "
            "must all be positive"
        )
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp rank {dp_rank} is outside [0, {dp_size})")
    if seed < 0:
        raise DataError(f"--seed {seed}: must be non-negative")
    if global_batch % (micro_batch * dp_size):
        raise DataError(
            f"global batch {global_batch} is not divisible by micro-batch {micro_batch} x "
            f"dp {dp_size}; use a --global-batch-size that is a multiple of "
            f"{micro_batch * dp_size}"
        )
