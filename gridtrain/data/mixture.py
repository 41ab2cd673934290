"""Mixtures: several weighted sources behind one dataset, each with its own validation.

``--data 0.7:web.bin,0.2:code.bin,0.1:math.jsonl`` (or a YAML list) names the sources
and their weights; each is any corpus gridtrain reads (a token file, a folder or file of
text, JSON lines, or fine-tuning JSON lines: :mod:`gridtrain.data.sft`). Each source
becomes its own train and validation sets (every ``valid_every``-th sample held out, or
``--valid-data`` sources instead), and :class:`MixtureDataset` puts the training sets
behind one flat index for the sampler (:class:`~gridtrain.data.sampler.GlobalBatchSampler`
with weights decides which source each position of a global batch reads).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from gridtrain.config import WEIGHTED_SOURCE as _WEIGHTED
from gridtrain.data import sft, token_files  # sft: fine-tuning records (prompt/completion or messages)
from gridtrain.data.corpora import check_enough_tokens, load_tokens
from gridtrain.data.datasets import (HeldOut, TokenWindows, WindowSubset, count_loss_tokens, split_windows, token_place,
                                     unigram_entropy)
from gridtrain.data.errors import DataError


@dataclass(frozen=True)
class Source:
    """One corpus of a mixture: its path (None: the built-in corpus) and weight."""

    path: str | None
    weight: float = 1.0

    @property
    def label(self) -> str:
        """How messages and reports name it."""
        return "built-in corpus" if self.path is None else str(self.path)


def parse_sources(text: str | None, flag: str = "--data") -> list[Source]:
    """``PATH`` (one source) or ``W:PATH,W:PATH,...`` (a mixture; weights need not sum to
    1). A text that does not split into weighted parts is one path, so a file name with
    a comma still works as a single source."""
    if text is None:
        return [Source(None)]
    parts = [_WEIGHTED.match(piece) for piece in text.split(",")]
    if all(parts):
        sources = [Source(m.group(2).strip(), float(m.group(1))) for m in parts]
    elif any(parts) and len(parts) > 1:
        bad = next(piece for piece, m in zip(text.split(","), parts) if not m)
        raise DataError(f"{flag} {text}: {bad.strip()!r} has no weight; write every source as WEIGHT:PATH "
                        "(e.g. 0.7:web.bin,0.3:code.bin)")
    else:
        return [Source(text)]
    for s, m in zip(sources, parts):
        if not math.isfinite(s.weight):
            raise DataError(f"{flag} {text}: source {s.path} has a weight that is not finite ({m.group(1).strip()}); "
                            "give every source a finite positive weight")
        if s.weight < 0:
            raise DataError(f"{flag} {text}: source {s.path} has a negative weight ({s.weight:g}); "
                            "weights must be positive")
        if s.weight == 0:
            raise DataError(f"{flag} {text}: source {s.path} has weight 0; weights must be positive "
                            "(leave the source out instead)")
    paths = [s.path for s in sources]
    if len(set(paths)) != len(paths):
        raise DataError(f"{flag} {text}: a source is named twice; give each source once with its total weight")
    return sources


def source_names(sources: list[Source]) -> list[str]:
    """Short unique names for reports and metrics: the file or folder name without its
    suffix, numbered where two would clash."""
    stems = ["builtin" if s.path is None else (Path(s.path).stem or Path(s.path).name or str(s.path))
             for s in sources]
    return [stem if stems.count(stem) == 1 else f"{stem}.{i}" for i, stem in enumerate(stems)]


class MixtureDataset(torch.utils.data.Dataset):
    """Several datasets behind one flat index: source ``i``'s item ``j`` is item
    ``offsets[i] + j`` (the ids the weighted sampler hands out)."""

    def __init__(self, parts: list[Any], names: list[str], weights: list[float]) -> None:
        self.parts, self.names, self.weights = parts, names, weights
        self.sizes = [len(p) for p in parts]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)

    def __len__(self) -> int:
        return int(sum(self.sizes))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        source = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.parts[source][i - int(self.offsets[source])]

    def token_place(self, i: int, key: str, position: int) -> tuple[str, str] | None:
        source = int(np.searchsorted(self.offsets, int(i), side="right")) - 1
        return token_place(self.parts[source], int(i) - int(self.offsets[source]), key, position)

    def count_loss_tokens(self, ids: np.ndarray) -> int | None:
        sources = np.searchsorted(self.offsets, ids, side="right") - 1
        total = 0
        for s in np.unique(sources).tolist():
            count = count_loss_tokens(self.parts[s], ids[sources == s] - self.offsets[s])
            if count is None:
                return None
            total += count
        return total



@dataclass
class SourceSets:
    """One source's training and validation sets, as :func:`build_sources` makes them."""

    name: str
    weight: float
    train: Any
    valid: Any  # None: nothing held out (a fine-tuning file too small to spare a sample)
    reference_loss: Callable[[], float] | None = None  # the corpus's unigram entropy (pretraining text), on demand
    every_label_counts: bool = True  # False: some labels are ignored (fine-tuning prompts, padding)
    note: str | None = None  # something the run report should say about it


def build_source(source: Source, name: str, tokenizer, seq_len: int, *, valid_every: int, split: bool = True,
                 documents: bool = False, enough_for: int = 1) -> SourceSets:
    """A source's sets: its windows (or packed fine-tuning samples), every
    ``valid_every``-th held out when ``split`` (else all of them in ``train``; a
    ``--valid-data`` source puts all of them in ``valid``). ``enough_for``: the training
    samples it must hold (one global batch for a run's only source: fewer would repeat
    samples within a step; one for a mixture's, which wraps and says so)."""
    if source.path is not None and sft.is_sft_jsonl(source.path):
        packed = sft.SFTDataset(source.path, tokenizer, seq_len)
        note = f"{name}: {packed.summary()}"
        if not documents:
            packed = WithoutDocuments(packed)
        if not split:
            return SourceSets(name, source.weight, packed, None, every_label_counts=False, note=note)
        train_ids, valid_ids = split_windows(len(packed), valid_every)
        if len(train_ids) < enough_for:
            raise DataError(f"--data {source.label}: {len(train_ids)} training samples, fewer than {enough_for}; "
                            "use more examples, a smaller --seq-len or a smaller --global-batch-size")
        valid = WindowSubset(packed, valid_ids) if len(valid_ids) else None
        return SourceSets(name, source.weight, WindowSubset(packed, train_ids), valid, every_label_counts=False,
                          note=note)
    tokens = load_tokens(source.path, tokenizer)
    starts = _document_index(source.path) if documents and tokenizer.eot_id is None else None
    windows = TokenWindows(tokens, seq_len, documents=documents, eot=tokenizer.eot_id, starts=starts,
                           source=source.label)
    recorded = _header_entropy(source.path)
    if recorded is None:  # counted when printed, by the rank that prints it (a pass over every token)
        reference = functools.cache(functools.partial(unigram_entropy, tokens, tokenizer.vocab_size))
    else:
        reference = functools.partial(float, recorded)
    check_enough_tokens(len(tokens), source.path, seq_len, enough_for, valid_every if split else None)
    if not split:
        return SourceSets(name, source.weight, windows, windows, reference)
    return SourceSets(name, source.weight, HeldOut(windows, valid_every, held=False),
                      HeldOut(windows, valid_every, held=True), reference)


def build_sources(data, tokenizer, seq_len: int, global_batch_size: int, documents: bool = False
                  ) -> tuple[list[SourceSets], list[SourceSets]]:
    """The training sources of ``data`` (a DataConfig) and the validation ones (the
    training sources' held-out parts, or ``--valid-data``'s sources whole)."""
    sources = parse_sources(data.path)
    separate = data.valid_data is not None
    enough = global_batch_size if len(sources) == 1 else 1
    train = [build_source(s, name, tokenizer, seq_len, valid_every=data.valid_every, split=not separate,
                          documents=documents, enough_for=enough)
             for s, name in zip(sources, source_names(sources))]
    if not separate:
        return train, [s for s in train if s.valid is not None]
    held = parse_sources(data.valid_data, "--valid-data")
    valid = [build_source(s, name, tokenizer, seq_len, valid_every=data.valid_every, split=False, documents=documents)
             for s, name in zip(held, source_names(held))]
    for v in valid:
        v.train, v.valid = None, v.valid if v.valid is not None else v.train
    return train, valid


class WithoutDocuments(torch.utils.data.Dataset):
    """A dataset's items without their ``documents`` key (document masking off)."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.dataset[i].items() if k != "documents"}

    def token_place(self, i: int, key: str, position: int) -> tuple[str, str] | None:
        return token_place(self.dataset, i, key, position)

    def count_loss_tokens(self, ids: np.ndarray) -> int | None:
        return count_loss_tokens(self.dataset, ids)


def _header_entropy(path) -> float | None:
    """The unigram entropy ``gridtrain prepare`` recorded in a token file's header (so a
    huge file is not read through at start), or None."""
    found = token_files.find_token_header(path) if path is not None else None
    value = json.loads(found.read_text("utf-8")).get("unigram_entropy") if found is not None else None
    return float(value) if value is not None else None


def _document_index(path) -> np.ndarray | None:
    """A token file's document index (None: no token file, or one without an index)."""
    if path is None or token_files.find_token_header(path) is None:
        return None
    return token_files.read_document_index(path)
