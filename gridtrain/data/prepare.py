"""``gridtrain prepare``: a corpus of any size tokenized once into a token file, in bounded memory.

The output is the token file that :func:`~gridtrain.data.corpora.load_tokens` would give
for the same source, token for token (tested): files in the same sorted order, JSON lines
line by line, the end-of-text token (eot) between documents, none after the last, empty
documents adding nothing. It is built without holding the corpus:

* **pieces**: every source file is cut into pieces of about ``piece_bytes`` (4 MiB). A
  JSON-lines file is cut after a line break, so a piece holds whole records. A text file
  is one document however large it is (one eot before it, one index entry), but one
  larger than a piece is tokenized piece by piece, each cut after a line break between
  two printable ASCII characters (``x\\nx``; else after any line break, else before a
  character, never inside one). For the byte tokenizer that changes nothing. For a
  GPT-2 or Llama-3 style byte-level tokenizer.json, such a line break is always a
  pre-tokenizer boundary, so the tokens equal the whole file's (tested); a tokenizer
  whose merges may cross line breaks (no pre-tokenizer, or a SentencePiece ``Metaspace``
  one) can tokenize the text next to a cut differently, once per 4 MiB;
* **validation first**: a file that is not UTF-8 is skipped in a folder and refused when
  named directly, as in memory; every piece is checked before any is tokenized (a cut is
  never inside a character of valid text, so the pieces are valid exactly when the file is);
* **shares**: the pieces are split into ``workers`` contiguous shares of about equal
  bytes; each is tokenized by one process (``workers=1``: this one) into a part file,
  appending as it goes; the parts are concatenated in order into a temporary file with
  the eot between two shares' documents, then moved into place. Peak memory is a few
  pieces per process, whatever the corpus's size;
* **document index** (``OUT.idx``) and **unigram entropy** (counts summed per piece) are
  made on the way; see :mod:`gridtrain.data.token_files` for the format.

A document is what :func:`~gridtrain.data.corpora.load_tokens` calls one: a non-empty
UTF-8 text file, or the non-empty ``text`` of one JSON line.
"""

from __future__ import annotations

import codecs
import multiprocessing
import os
import re
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gridtrain.data.corpora import JSONL_SHAPE, JSONL_SUFFIX, _empty, _no_text_in_folder, _text_files, text_of_line
from gridtrain.data.errors import DataError
from gridtrain.data.token_files import (IndexWriter, _token_paths, finish_token_file,
                                        open_token_file, read_document_index, read_token_file)
from gridtrain.data.tokenizers import ByteTokenizer, Tokenizer, load_tokenizer, token_dtype

PIECE_BYTES = 4 << 20  # a piece of a file: the unit of reading, tokenizing (text) and sharing
READ_BYTES = 1 << 20  # the byte tokenizer reads, and a batch of JSON lines is tokenized, this much at a time
COUNT_SLICE = 1 << 18  # bincount makes an int64 temporary of its input's length
_GOOD_CUT = re.compile(rb"[\x21-\x7e]\n[\x21-\x7e]")


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of ``file``; ``first``: the piece begins its file."""

    file: str
    start: int
    end: int
    jsonl: bool

    @property
    def first(self) -> bool:
        return self.start == 0


@dataclass
class Part:
    """What one share's worker wrote: tokens and document starts relative to the part."""

    tokens_path: str
    index_path: str
    num_tokens: int = 0
    num_starts: int = 0
    leading_doc: bool = False  # its first document begins at token 0 (no eot written before it)
    has_doc: bool = False  # it holds a document, or the rest of one begun in an earlier share
    counts: np.ndarray | None = field(default=None, repr=False)


def prepare(
    input_path: str | os.PathLike | None,
    output_path: str | os.PathLike,
    tokenizer_path: str | os.PathLike | None = None,
    *,
    workers: int = 1,
    piece_bytes: int = PIECE_BYTES,
) -> Path:
    """Tokenize a corpus once into ``OUT.bin`` + ``OUT.idx`` + ``OUT.json`` (``gridtrain
    prepare``) in bounded memory, with ``workers`` processes; returns the .bin path."""
    if workers < 1:
        raise DataError(f"--workers {workers}: give 1 or more processes")
    if piece_bytes < 64:
        raise DataError(f"piece_bytes {piece_bytes}: give at least 64")
    tokenizer = load_tokenizer(tokenizer_path)
    bin_path, _ = _token_paths(output_path)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    source = open_token_file(input_path, tokenizer)
    if source is not None:
        return _copy_token_file(input_path, source, bin_path, tokenizer)
    files, skip_non_text = _text_files(input_path)
    pieces = _plan(files, piece_bytes)
    shares = _split(pieces, workers)
    tokenizer_arg = None if tokenizer_path is None else str(tokenizer_path)
    work_dir = Path(tempfile.mkdtemp(dir=bin_path.parent, prefix=f".{bin_path.name}.", suffix=".tmp"))
    try:
        with _pool(len(shares)) as pool:
            bad = set().union(*_map(pool, _invalid_files, shares))
            pieces = _drop_non_text(pieces, bad, skip_non_text, input_path)
            shares = _split(pieces, workers)
            jobs = [(share, tokenizer_arg, str(work_dir / f"part{k}")) for k, share in enumerate(shares)]
            parts = list(_map(pool, _tokenize_share, jobs, star=True))
        if not parts:
            parts = [_tokenize_share([], tokenizer_arg, str(work_dir / "part0"))]
        return _concatenate(parts, bin_path, tokenizer, input_path)
    finally:
        for leftover in work_dir.iterdir() if work_dir.is_dir() else ():
            leftover.unlink(missing_ok=True)
        work_dir.rmdir() if work_dir.is_dir() else None


# ---- planning: pieces and shares ---------------------------------------------------------------

def _plan(files: list[Path], piece_bytes: int) -> list[Piece]:
    pieces = []
    for file in files:
        size = _file_size(file)
        jsonl = file.suffix == JSONL_SUFFIX
        with _open(file) as f:
            start = 0
            while start < size:
                end = _cut(f, start + piece_bytes, size, jsonl, piece_bytes) if start + piece_bytes < size else size
                pieces.append(Piece(str(file), start, end, jsonl))
                start = end
    return pieces


def _cut(f, at: int, size: int, jsonl: bool, piece_bytes: int) -> int:
    """Where the piece that reaches ``at`` ends (see the module's docstring)."""
    if jsonl:  # after the first line break at or after at - 1, wherever it is
        f.seek(at - 1)
        pos = at - 1
        while True:
            chunk = f.read(READ_BYTES)
            if not chunk:
                return size
            i = chunk.find(b"\n")
            if i >= 0:
                return pos + i + 1
            pos += len(chunk)
    f.seek(at - 2)
    window = f.read(min(piece_bytes // 2, READ_BYTES) + 2)
    match = _GOOD_CUT.search(window)
    if match is not None:
        return at - 2 + match.start() + 2
    i = window.find(b"\n", 1)
    if i >= 0 and at - 2 + i + 1 < size:
        return at - 2 + i + 1
    for k in range(2, min(len(window), 6)):  # before the character that holds byte at
        if window[k] & 0xC0 != 0x80:
            return at - 2 + k
    return at  # not UTF-8 there: the file is refused or skipped anyway


def _split(pieces: list[Piece], workers: int) -> list[list[Piece]]:
    """Contiguous shares of about equal bytes (empty ones dropped)."""
    total = sum(p.end - p.start for p in pieces)
    shares: list[list[Piece]] = [[] for _ in range(workers)]
    done = 0
    for piece in pieces:
        shares[min(done * workers // max(total, 1), workers - 1)].append(piece)
        done += piece.end - piece.start
    return [share for share in shares if share]


def _drop_non_text(pieces: list[Piece], bad: set[str], skip_non_text: bool, input_path) -> list[Piece]:
    if bad and not skip_non_text:
        raise DataError(
            f"--data {sorted(bad)[0]}: not UTF-8 text (if it is a token file, its .json header "
            "is missing; otherwise convert it to UTF-8)"
        )
    pieces = [p for p in pieces if p.file not in bad]
    if not pieces:
        raise _no_text_in_folder(input_path) if input_path is not None and Path(input_path).is_dir() \
            else _empty(input_path)
    return pieces


def _file_size(file: Path) -> int:
    try:
        return file.stat().st_size
    except OSError as e:
        raise DataError(f"--data {file}: cannot read it ({e.strerror or e}); fix its permissions") from None


def _open(file):
    try:
        return open(file, "rb")
    except OSError as e:
        raise DataError(f"--data {file}: cannot read it ({e.strerror or e}); fix its permissions") from None


class _Inline:
    """workers=1: the shares run in this process."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _pool(num_shares: int):
    if num_shares <= 1:
        return _Inline()
    # fork: the parent has only read file names, so a child starts at once (spawn would
    # import torch again in each); elsewhere, the platform's default
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    return ProcessPoolExecutor(max_workers=num_shares, mp_context=multiprocessing.get_context(method))


def _map(pool, fn, items, star: bool = False):
    if pool is None:
        return [fn(*item) if star else fn(item) for item in items]
    return pool.map(fn, *zip(*items)) if star else pool.map(fn, items)


# ---- the workers ---------------------------------------------------------------------------------

def _invalid_files(share: list[Piece]) -> set[str]:
    """The files of ``share`` with a piece that is not UTF-8 (read in bounded chunks)."""
    bad = set()
    for piece in share:
        if piece.file in bad:
            continue
        decoder = codecs.getincrementaldecoder("utf-8")()
        with _open(Path(piece.file)) as f:
            f.seek(piece.start)
            try:
                for start in range(piece.start, piece.end, READ_BYTES):
                    chunk = f.read(min(READ_BYTES, piece.end - start))
                    if not chunk.isascii() or decoder.getstate()[0]:
                        decoder.decode(chunk)  # a str the chunk's size, dropped at once
                decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                bad.add(piece.file)
    return bad


def _read_exact(f, piece: Piece) -> bytes:
    data = f.read(piece.end - piece.start)
    if len(data) != piece.end - piece.start:
        raise DataError(f"--data {piece.file}: the file changed while it was read; run prepare again")
    return data


class _PartWriter:
    """Appends one share's tokens (documents joined by eot) and document starts to its part."""

    def __init__(self, part: Part, tokenizer: Tokenizer):
        self.part = part
        self.eot = tokenizer.eot_id
        self.vocab_size = tokenizer.vocab_size
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.tokens = open(part.tokens_path, "wb")
        self.index = open(part.index_path, "wb")
        part.counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)

    def append(self, parts: list[np.ndarray], new_doc: list[bool]) -> None:
        """Token arrays in order; ``new_doc[k]``: ``parts[k]`` begins a document (an eot
        first when a document came before in this share), else it continues one."""
        part = self.part
        eots = 0 if self.eot is None else sum(new_doc) - (not part.has_doc and new_doc[0])
        out = np.empty(sum(len(p) for p in parts) + eots, dtype=self.dtype)
        starts = []
        pos = 0
        for ids, begins in zip(parts, new_doc):
            if begins:
                starts.append(part.num_tokens + pos)
                if not part.has_doc:
                    part.leading_doc = part.has_doc = True
                elif self.eot is not None:
                    out[pos] = self.eot
                    pos += 1
            out[pos: pos + len(ids)] = ids
            pos += len(ids)
        for start in range(0, len(out), COUNT_SLICE):
            counts = np.bincount(out[start: start + COUNT_SLICE], minlength=self.vocab_size)
            if len(counts) > self.vocab_size:
                raise DataError(f"token id {len(counts) - 1} is outside vocab {self.vocab_size}")
            part.counts += counts
        self.tokens.write(memoryview(out).cast("B"))
        part.num_tokens += len(out)
        if starts:
            self.index.write(np.asarray(starts, dtype="<i8").tobytes())
            part.num_starts += len(starts)

    def close(self) -> None:
        self.tokens.close()
        self.index.close()


class _Batch:
    """Texts tokenized and written together (a Hugging Face tokenizer's ``encode_batch``
    runs them in parallel); each is a whole document, a JSON line's, or a piece of a
    text file (``new_doc`` False: it continues the document before)."""

    def __init__(self, tokenizer: Tokenizer, writer: _PartWriter):
        self.tokenizer, self.writer = tokenizer, writer
        self.items: list[bytes] = []
        self.new_doc: list[bool] = []
        self.size = 0

    def add(self, data: bytes, new_doc: bool) -> None:
        if self.size and self.size + len(data) > READ_BYTES:
            self.flush()
        self.items.append(data)
        self.new_doc.append(new_doc)
        self.size += len(data)
        if self.size >= READ_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.items:
            return
        tok = self.tokenizer
        if isinstance(tok, ByteTokenizer):
            ids = [np.frombuffer(data, dtype=np.uint8) for data in self.items]
        else:
            texts = [data.decode("utf-8") for data in self.items]
            encoded = tok.encode_batch(texts) if hasattr(tok, "encode_batch") else [tok.encode(t) for t in texts]
            ids = [np.asarray(one, dtype=np.int64) for one in encoded]
        self.writer.append(ids, self.new_doc)
        self.items, self.new_doc, self.size = [], [], 0


def _tokenize_share(share: list[Piece], tokenizer_path: str | None, part_stem: str) -> Part:
    tokenizer = load_tokenizer(tokenizer_path)
    part = Part(tokens_path=f"{part_stem}.bin", index_path=f"{part_stem}.idx")
    part.has_doc = bool(share) and not share[0].first  # the rest of a text file begun in an earlier share
    writer = _PartWriter(part, tokenizer)
    batch = _Batch(tokenizer, writer)
    try:
        for piece in share:
            with _open(Path(piece.file)) as f:
                f.seek(piece.start)
                if piece.jsonl:
                    for text in _jsonl_texts(f, piece):
                        batch.add(text, new_doc=True)
                elif isinstance(tokenizer, ByteTokenizer):  # bytes: any cut tokenizes the same
                    for start in range(piece.start, piece.end, READ_BYTES):
                        data = f.read(min(READ_BYTES, piece.end - start))
                        batch.add(data, new_doc=start == 0)
                else:
                    batch.add(_read_exact(f, piece), new_doc=piece.first)
        batch.flush()
    finally:
        writer.close()
    return part


def _jsonl_texts(f, piece: Piece):
    """The non-empty ``text`` of each line of the piece, UTF-8 encoded; lines as
    ``bytes.splitlines`` cuts the whole file (corpora.py), numbered the same way."""
    number = 0
    while f.tell() < piece.end:
        chunk = f.readline()
        if not chunk:
            break
        for line in chunk.splitlines():
            number += 1
            try:
                text = text_of_line(line)
            except ValueError as e:
                raise _jsonl_error(piece, number, str(e)) from None
            if text:
                yield text


def _jsonl_error(piece: Piece, number: int, what: str) -> DataError:
    """The message of corpora.py, with the line numbered from the file's start."""
    before = 0
    if piece.start:
        with open(piece.file, "rb") as f:
            while f.tell() < piece.start:
                before += len(f.readline().splitlines())
    return DataError(f"--data {piece.file}: line {before + number} {what}; {JSONL_SHAPE}")


# ---- the output ------------------------------------------------------------------------------------

def _concatenate(parts: list[Part], bin_path: Path, tokenizer: Tokenizer, input_path) -> Path:
    """The parts in order into the first one (eot between two shares' documents), then
    the token file written into place, the header last."""
    eot = tokenizer.eot_id
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    dtype = token_dtype(tokenizer.vocab_size)
    index_path = Path(parts[0].tokens_path).with_suffix(".index")
    total = 0
    has_doc = False
    with open(parts[0].tokens_path, "ab") as out, IndexWriter(index_path) as index:
        for k, part in enumerate(parts):
            lead_eot = part.leading_doc and has_doc and eot is not None
            if lead_eot:
                out.write(np.array([eot], dtype=dtype).tobytes())
                counts[eot] += 1
                total += 1
            if k:
                _append_file(out, part.tokens_path)
            for starts in _read_chunks(part.index_path, "<i8"):
                starts = starts + total
                if lead_eot:
                    starts[0] -= 1  # the leading document begins at the eot just written
                    lead_eot = False
                index.add(starts)
            total += part.num_tokens
            counts += part.counts
            has_doc = has_doc or part.has_doc
        index.finish(total)
    if total == 0:
        raise _empty(input_path)
    return finish_token_file(Path(parts[0].tokens_path), index_path, bin_path, tokenizer, total, counts)


def _append_file(out, path: str) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(READ_BYTES * 4):
            out.write(chunk)
    os.unlink(path)


def _read_chunks(path: str, dtype: str, items: int = 1 << 17):
    size = np.dtype(dtype).itemsize
    with open(path, "rb") as f:
        while chunk := f.read(items * size):
            yield np.frombuffer(chunk, dtype=dtype)


def _copy_token_file(input_path, tokens: np.ndarray, bin_path: Path, tokenizer: Tokenizer) -> Path:
    """A token file given as the source: its tokens and index copied in bounded pieces
    (a version-1 source gets the index its eot tokens imply)."""
    _, header = read_token_file(input_path)
    starts = read_document_index(input_path)
    fd, tmp = tempfile.mkstemp(dir=bin_path.parent, prefix=f".{bin_path.name}.", suffix=".tmp")
    index_path = Path(f"{tmp}.index")
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    try:
        with os.fdopen(fd, "wb") as out, IndexWriter(index_path) as index:
            step = 1 << 22
            for start in range(0, len(tokens), step):
                piece = np.asarray(tokens[start: start + step])
                out.write(piece.tobytes())
                for s in range(0, len(piece), COUNT_SLICE):
                    counts += np.bincount(piece[s: s + COUNT_SLICE], minlength=tokenizer.vocab_size)
                if starts is None:
                    begins = np.flatnonzero(piece == tokenizer.eot_id) + start if tokenizer.eot_id is not None \
                        else np.array([], dtype=np.int64)
                    index.add(np.concatenate([[0], begins]) if start == 0 else begins)
            if starts is not None:
                for s in range(0, len(starts), 1 << 17):
                    index.add(np.asarray(starts[s: s + (1 << 17)]))
            index.finish(len(tokens))
        return finish_token_file(Path(tmp), index_path, bin_path, tokenizer, len(tokens), counts)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        index_path.unlink(missing_ok=True)
        raise


__all__ = ["PIECE_BYTES", "prepare"]
