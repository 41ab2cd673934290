"""Datasets: the token array cut into fixed windows, split, batched.

A window is a fixed function of the token array (``seq_len + 1`` tokens, no overlap), and
every ``valid_every``-th window is held out for validation, so a sample index means the
same text on every rank and every run. :class:`Datasets` is what a datasets provider
hands the loop (gridtrain.training.loop.pretrain); :func:`collate` stacks samples into a
:data:`Batch`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from gridtrain.data.corpora import check_enough_tokens, load_tokens
from gridtrain.data.errors import DataError
from gridtrain.data.tokenizers import Tokenizer

Batch = dict[str, torch.Tensor]  # a micro-batch: "tokens", "labels", ... each [b, s]


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
