"""Datasets: the token array cut into fixed windows, split, batched.

A window is a fixed function of the token array (``seq_len + 1`` tokens, no overlap), and
every ``valid_every``-th window is held out for validation, so a sample index means the
same text on every rank and every run. :class:`Datasets` is what a datasets provider
hands the loop (gridtrain.training.loop.pretrain); :func:`collate` stacks samples into a
:data:`Batch`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from gridtrain.data.corpora import check_enough_tokens, load_tokens
from gridtrain.data.errors import DataError, TokenIdError
from gridtrain.data.sft import IGNORE_INDEX
from gridtrain.data.token_files import entropy_from_counts
from gridtrain.data.tokenizers import Tokenizer

Batch = dict[str, torch.Tensor]  # a micro-batch: "tokens", "labels", ... each [b, s]


@dataclass
class Datasets:
    """What a datasets provider returns (see gridtrain.training.loop.pretrain).

    ``train``/``valid`` are map-style datasets whose items are dicts of equal-shape
    tensors with at least ``labels`` (positions equal to IGNORE_INDEX carry no loss).
    ``reference_loss`` (e.g. the corpus's unigram entropy) is printed beside the final
    validation loss: a number, or a function that gives it, called only by the rank that
    prints (a pass over the whole corpus need not run on every rank);
    ``tokenizer`` lets the run print a sample at the end.
    ``valid`` may also be a dict of named validation sets (a mixture's sources, or
    ``--valid-data``): each is evaluated and reported on its own. A ``train`` with
    ``sizes`` and ``weights`` (data.mixture.MixtureDataset) is sampled as a mixture.
    ``every_label_counts``: the provider promises that no label is IGNORE_INDEX (windows
    of a token stream), so the global batch's loss-bearing tokens are known without
    counting them: the step skips the token-count all-reduce and its host read.
    """

    train: Any
    valid: Any = None
    tokenizer: Any = None
    reference_loss: float | Callable[[], float] | None = None
    loss_unit: str = "nats/token"
    every_label_counts: bool = False
    notes: list[str] = field(default_factory=list)  # lines the run report prints about the data


class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens; the extra token is the last label.

    Windows are a fixed function of the token array, so a sample index means the same
    text on every rank and every run. With ``documents`` each window also says which
    document each input token belongs to (``"documents"``: 0 for the window's first,
    counting up at each document start; what ``--document-mask`` masks attention and
    restarts positions by). A document begins at the end-of-text token that separates
    it from the one before (the token opens it, as a BOS would: the previous document's
    last label is the end of text, predicted from inside that document), found in the
    window itself when the tokenizer has one (``eot``), else in the document index
    (``starts``: token offsets, as ``gridtrain prepare`` writes them). ``source`` names
    the corpus in messages (a token file names itself: its ``.bin``).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, *, documents: bool = False, eot: int | None = None,
                 starts: np.ndarray | None = None, source: str | None = None) -> None:
        if seq_len < 1:
            raise DataError(f"--seq-len {seq_len}: must be at least 1")
        if documents and eot is None and starts is None:
            raise DataError("--document-mask needs document boundaries, but the tokenizer has no end-of-text token "
                            "and the corpus no document index; prepare it with `gridtrain prepare` (which writes "
                            "one) or use a tokenizer with an end-of-text token")
        self.tokens = tokens
        self.seq_len = seq_len
        self.documents, self.eot, self.starts = documents, eot, starts
        self.source = source

    def __len__(self) -> int:
        return max((len(self.tokens) - 1) // self.seq_len, 0)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range [0, {len(self)})")
        start = i * self.seq_len
        raw = np.asarray(self.tokens[start : start + self.seq_len + 1]).astype(np.int64)
        window = torch.from_numpy(raw)
        item = {"tokens": window[:-1], "labels": window[1:]}
        if self.documents:
            item["documents"] = torch.from_numpy(self._documents(raw[:-1], start))
        return item

    def count_loss_tokens(self, ids: np.ndarray) -> int:
        """Every label of a window carries a loss."""
        return len(ids) * self.seq_len

    def token_place(self, i: int, key: str, position: int) -> tuple[str, str]:
        """Where ``key[position]`` of window ``i`` comes from (the label at ``position``
        is the window's token ``position + 1``), and what to do about a bad id there."""
        offset = int(i) * self.seq_len + position + (key == "labels")
        if isinstance(self.tokens, np.memmap) and self.tokens.filename:
            return (f"{self.tokens.filename}: token {offset} (counting from 0)",
                    "the .bin does not match its header (corrupt, or overwritten since it was prepared); "
                    "re-run `gridtrain prepare`")
        return (f"{self.source or 'the corpus'}: token {offset} of the tokenized corpus",
                "pass the --vocab-size of the tokenizer")

    def _documents(self, inputs: np.ndarray, start: int) -> np.ndarray:
        if self.eot is not None:
            opened = np.cumsum(inputs == self.eot)
        else:
            opened = np.searchsorted(self.starts, np.arange(start, start + len(inputs)), side="right")
        return (opened - opened[0]).astype(np.int64)


class WindowSubset(torch.utils.data.Dataset):
    """A view of some windows of a dataset, addressed 0..len(ids)-1."""

    def __init__(self, dataset: TokenWindows, ids: np.ndarray) -> None:
        self.dataset = dataset
        self.ids = np.asarray(ids, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.dataset[self.ids[int(i)]]

    def token_place(self, i: int, key: str, position: int) -> tuple[str, str] | None:
        return token_place(self.dataset, int(self.ids[int(i)]), key, position)

    def count_loss_tokens(self, ids: np.ndarray) -> int | None:
        return count_loss_tokens(self.dataset, self.ids[np.asarray(ids, dtype=np.int64)])


class HeldOut(torch.utils.data.Dataset):
    """The training (``held=False``) or validation (``held=True``) part of a dataset whose
    every ``valid_every``-th item is held out, addressed 0..len-1 by arithmetic: the
    same items :func:`split_windows` lists, with no index array (a 10 GB token file's
    millions of windows cost nothing here)."""

    def __init__(self, dataset, valid_every: int, held: bool) -> None:
        if valid_every < 2:
            raise DataError(f"valid_every={valid_every}: must be at least 2 to leave training data")
        self.dataset, self.valid_every, self.held = dataset, valid_every, held
        valid = len(dataset) // valid_every
        self.length = valid if held else len(dataset) - valid

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        if not 0 <= i < self.length:
            raise IndexError(f"item {i} out of range [0, {self.length})")
        return self.dataset[int(self._inner(np.int64(i)))]

    def _inner(self, ids: np.ndarray) -> np.ndarray:
        every = self.valid_every
        return ids * every + every - 1 if self.held else ids + ids // (every - 1)

    def token_place(self, i: int, key: str, position: int) -> tuple[str, str] | None:
        return token_place(self.dataset, int(self._inner(np.int64(i))), key, position)

    def count_loss_tokens(self, ids: np.ndarray) -> int | None:
        return count_loss_tokens(self.dataset, self._inner(np.asarray(ids, dtype=np.int64)))


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
    windows = TokenWindows(tokens, seq_len, source=None if data_path is None else str(data_path))
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
    return entropy_from_counts(counts)


def count_loss_tokens(dataset, ids: Sequence[int] | np.ndarray) -> int | None:
    """The labels that carry a loss in samples ``ids`` of ``dataset``, counted on the host
    without reading the samples, or None where the dataset cannot say (it has no
    ``count_loss_tokens(ids)``, as a user's dataset may not).

    Every rank knows every step's global batch (the sampler is a function of the seed),
    so with these counts the trainer knows the step's loss-bearing tokens before the
    step with no collective and no read of device memory (trainer.py)."""
    count = getattr(dataset, "count_loss_tokens", None)
    return None if count is None else count(np.asarray(ids, dtype=np.int64))


def collate(dataset: torch.utils.data.Dataset, ids: Sequence[int], vocab_size: int | None = None) -> Batch:
    """Stack the samples ``ids`` into a batch of shape [len(ids), seq_len], every key
    the samples have ("tokens", "labels", with document masking "documents"). With
    ``vocab_size``, every token id and label is checked on the host
    (:func:`check_token_ids`)."""
    samples = [dataset[int(i)] for i in ids]
    batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
    if vocab_size is not None:
        check_token_ids(batch, dataset, ids, vocab_size)
    return batch


def check_token_ids(batch: Batch, dataset, ids: Sequence[int], vocab_size: int) -> None:
    """Raise :class:`TokenIdError` when a token id of ``batch`` (samples ``ids`` of
    ``dataset``) is outside ``[0, vocab_size)``, or a label is, other than IGNORE_INDEX.

    The embedding would fail on such an id with an index error (on a GPU, a device-side
    assert that kills the process), and the loss would gather outside the logits; here,
    before the batch leaves the host, it costs a min and a max per key. The message names
    the first bad id's place: the dataset's ``token_place(i, key, position)`` where it
    has one (a token file: its .bin and the token's offset in it), else the sample and
    the position.
    """
    for key in ("tokens", "labels"):
        values = batch.get(key)
        if values is None or values.numel() == 0:
            continue
        low, high = (int(v) for v in torch.aminmax(values))
        below = low < 0 and (key == "tokens" or bool(((values < 0) & (values != IGNORE_INDEX)).any()))
        if high < vocab_size and not below:
            continue
        bad = (values < 0) | (values >= vocab_size)
        if key == "labels":
            bad &= values != IGNORE_INDEX
        row, position = (int(x) for x in bad.nonzero()[0])
        sample = int(ids[row])
        place, fix = token_place(dataset, sample, key, position) or (
            f"sample {sample} of the data, {key} position {position}",
            "fix the data, or pass the model's --vocab-size")
        allowed = f"ids 0..{vocab_size - 1}" + (f", and {IGNORE_INDEX} for no loss" if key == "labels" else "")
        raise TokenIdError(f"{place} is id {int(values[row, position])}, outside the vocabulary "
                           f"(--vocab-size {vocab_size}: {allowed}); {fix}")


def token_place(dataset, i: int, key: str, position: int) -> tuple[str, str] | None:
    """Where ``key[position]`` of sample ``i`` of ``dataset`` comes from and how to fix a
    bad id there, as the dataset (or the one it wraps) says, or None where it cannot."""
    locate = getattr(dataset, "token_place", None)
    return None if locate is None else locate(i, key, position)
