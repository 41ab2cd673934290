"""Tokenizers: text to token ids and back.

Two kinds, behind one small protocol (:class:`Tokenizer`): the byte tokenizer, which
needs no files and tokenizes every corpus identically on every machine, and a Hugging
Face ``tokenizer.json``. :func:`token_dtype` is the storage width every token array of a
vocabulary uses (in memory and in token files).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from gridtrain.data.errors import DataError

EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


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
        self.path = path
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot_id: int | None = _find_eot(self._tok)

    def encode(self, text: str) -> list[int]:
        """No special tokens are added: documents are separated by eot in load_tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many documents at once; the Rust side parallelises them."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Each text's token ids and each token's ``(start, end)`` character span in it
        (gridtrain.data.sft: which tokens of a chat an assistant wrote)."""
        return [(e.ids, e.offsets) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

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
