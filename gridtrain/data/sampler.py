"""The global-batch sampler: which samples an optimizer step reads, whatever the layout.

The design invariant "any parallel layout trains the same model as one process" needs
step k to see the same global batch whatever the data-parallel size or micro-batch size;
data-parallel ranks and micro-batches only ever take fixed slices of it.

A run may draw from several sources with weights (a *mixture*: web, code, math, ...).
Each source has its own stream of samples (:class:`SourceStream`: one shuffle per
epoch), and each position of the global sample stream is given to one source by
largest deficit: the source furthest below its share of the positions so far
(``weight x positions - drawn``) takes the next one. That is a pure function of the
per-source counts, so a source's share never drifts from its weight by as much as one
sample at any point, however small the source, and the counts are the whole state of
the data order: a checkpoint records them (:meth:`GlobalBatchSampler.state`) and a run
resumed on any layout continues with exactly the samples an uninterrupted run would
have read next.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from gridtrain.data.errors import DataError


class SourceStream:
    """One source's samples in training order: the concatenation of per-epoch
    permutations, epoch ``e`` shuffled by a generator seeded ``(seed, e)`` for the first
    source of a run and ``(seed, e, i)`` for source ``i > 0`` (so a one-source run and
    the first source of a mixture read in the same order). Position ``n`` of the stream
    is sample ``perm_{n // size}[n % size]``: when a source runs out it wraps into a new
    epoch with a new shuffle."""

    def __init__(self, size: int, seed: int, index: int = 0, shuffle: bool = True) -> None:
        self.size, self.seed, self.index, self.shuffle = size, seed, index, shuffle
        self._perms: dict[int, np.ndarray] = {}  # memo only: at most two recent epochs

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            key = [self.seed, epoch] if self.index == 0 else [self.seed, epoch, self.index]
            self._perms[epoch] = np.random.default_rng(key).permutation(self.size)
        return self._perms[epoch]

    def take(self, start: int, count: int) -> np.ndarray:
        """Sample ids at stream positions ``[start, start + count)``."""
        epochs, offsets = np.divmod(np.arange(start, start + count, dtype=np.int64), self.size)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self.epoch_permutation(int(epoch))[offsets[mask]]
        return out


def largest_deficit(weights: np.ndarray, drawn: np.ndarray, base_drawn: np.ndarray, count: int) -> np.ndarray:
    """The sources of the next ``count`` positions: each goes to the source with the
    largest ``weight x (positions since base + 1) - drawn since base`` (ties: the lower
    index). ``drawn`` is updated in place. Megatron's blended datasets assign samples
    the same way; counting from a *base* (where the mixture last changed) lets a resumed
    run change its weights without the new mixture paying back the old one's counts."""
    w, since = weights.tolist(), (drawn - base_drawn).tolist()  # plain floats: no numpy call per position
    out, r, sources = [], sum(since), range(len(w))
    for _ in range(count):
        r += 1
        best, pick = -math.inf, 0
        for i in sources:
            deficit = w[i] * r - since[i]
            if deficit > best:
                best, pick = deficit, i
        out.append(pick)
        since[pick] += 1
    drawn[:] = base_drawn + np.asarray(since, dtype=np.int64)
    return np.asarray(out, dtype=np.int64)


class GlobalBatchSampler:
    """Maps an optimizer step to sample indices, independently of the parallel layout.

    ``num_samples``: the size of one source, or a list of sizes with ``weights`` (a
    mixture; sample ids are then flat: source ``i``'s sample ``j`` is
    ``sum(sizes[:i]) + j``, as :class:`~gridtrain.data.mixture.MixtureDataset` reads them).

    Step k's global batch is positions [k*G, (k+1)*G) of the global stream; each
    position is given to a source (:func:`largest_deficit`; with one source, all of
    them) and takes that source's next sample (:class:`SourceStream`). With several
    sources the batch is then shuffled by ``(seed, step)``, so that every micro-batch
    mixes the sources rather than following the assignment's pattern. The global batch
    is cut micro-batch-major, as Megatron's sampler does: the j-th *global micro-batch*
    is slice [j*G/m, (j+1)*G/m) (m micro-batches per step) and DP rank r takes its slice
    [r*M, (r+1)*M) of it. So the j-th micro-batches of all DP ranks together are the
    same samples for every dp with the same m: what a mixture-of-experts layer takes its
    routing statistics over (parallel/experts.py).

    The per-source counts before step k are the whole state: computed forward from the
    nearest step known (0, or the one a checkpoint restored) and memoised, so the loop's
    step-by-step reads cost one step's assignment each.
    """

    def __init__(
        self,
        num_samples: int | Sequence[int],
        global_batch_size: int,
        micro_batch_size: int,
        dp_size: int = 1,
        dp_rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        weights: Sequence[float] | None = None,
    ) -> None:
        sizes = [int(num_samples)] if np.isscalar(num_samples) else [int(n) for n in num_samples]
        for size in sizes:
            _check_sizes(size, global_batch_size, micro_batch_size, dp_size, dp_rank, seed)
        self.sizes = sizes
        self.weights = _normalized(weights, len(sizes))
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.shuffle = shuffle  # False: each stream is 0, 1, 2, ... (validation sets)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.streams = [SourceStream(size, seed, i, shuffle) for i, size in enumerate(sizes)]
        self._drawn: dict[int, np.ndarray] = {0: np.zeros(len(sizes), dtype=np.int64)}  # before step k
        self._base = (0, np.zeros(len(sizes), dtype=np.int64))  # (step, drawn) where the weights took effect

    @property
    def num_samples(self) -> int:
        return sum(self.sizes)

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.dp_size

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """The first source's order in epoch ``epoch``."""
        return self.streams[0].epoch_permutation(epoch)

    # ---- the state: samples drawn per source ----------------------------------------------

    def drawn(self, step: int) -> np.ndarray:
        """Samples each source gave to steps ``0..step-1`` (a copy)."""
        if step < 0:
            raise ValueError(f"step {step} must be >= 0")
        if len(self.sizes) == 1:
            return np.array([step * self.global_batch_size], dtype=np.int64)
        known = max((k for k in self._drawn if k <= step), default=None)
        if known is None:
            raise ValueError(f"step {step} is before the step this sampler was restored at "
                             f"({min(self._drawn)}); the counts before it are not known")
        drawn = self._drawn[known].copy()
        for k in range(known, step):
            self._assign(k, drawn)
            self._remember(k + 1, drawn)
        return drawn.copy()

    def _remember(self, step: int, drawn: np.ndarray) -> None:
        self._drawn[step] = drawn.copy()
        if len(self._drawn) > 4:  # the loop reads forward: keep the newest few and the restore point
            for k in sorted(self._drawn)[1:-3]:
                del self._drawn[k]

    def _assign(self, step: int, drawn: np.ndarray) -> np.ndarray:
        """The sources of step ``step``'s positions, given the counts before it; advances ``drawn``."""
        return largest_deficit(self.weights, drawn, self._base[1], self.global_batch_size)

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint after ``step`` steps records to continue the data order."""
        drawn = self.drawn(step)
        return {"drawn": drawn.tolist(), "weights": self.weights.tolist(), "sizes": list(self.sizes),
                "epochs": [int(d) // s for d, s in zip(drawn, self.sizes)],
                "mixture_base": {"step": self._base[0], "drawn": self._base[1].tolist()}}

    def restore(self, state: dict[str, Any] | None, step: int) -> str | None:
        """Continue from a checkpoint's :meth:`state` taken after ``step`` steps. Returns a
        one-line note when the checkpoint's mixture had other weights (the new weights
        apply from ``step`` on) or None. A checkpoint without counts (one source, or an
        older version) restarts nothing: one source's counts follow from the step."""
        if len(self.sizes) == 1:
            return None
        if not state or "drawn" not in state:
            raise DataError(f"the checkpoint records no per-source data position, so this {len(self.sizes)}-source "
                            "mixture cannot continue it exactly; start the mixture from --init-from instead")
        drawn = np.asarray(state["drawn"], dtype=np.int64)
        if len(drawn) != len(self.sizes):
            raise DataError(f"the checkpoint's data mixture has {len(drawn)} sources but --data names "
                            f"{len(self.sizes)}; resume with the same sources (weights may change)")
        self._drawn = {step: drawn}
        saved = np.asarray(state.get("weights", self.weights), dtype=np.float64)
        base = state.get("mixture_base") or {"step": 0, "drawn": [0] * len(drawn)}
        if np.allclose(saved, self.weights, rtol=0, atol=1e-12):
            self._base = (int(base["step"]), np.asarray(base["drawn"], dtype=np.int64))
            return None
        self._base = (step, drawn.copy())
        return ("data mixture weights changed at step "
                f"{step}: {', '.join(f'{w:.3g}' for w in saved)} -> {', '.join(f'{w:.3g}' for w in self.weights)} "
                "(the new weights apply to the samples from here on)")

    # ---- batches ---------------------------------------------------------------------------

    def global_batch(self, step: int) -> np.ndarray:
        if len(self.sizes) == 1:
            return self.streams[0].take(step * self.global_batch_size, self.global_batch_size)
        drawn = self.drawn(step)
        before = drawn.copy()
        sources = self._assign(step, drawn)
        self._remember(step + 1, drawn)
        out = np.empty(self.global_batch_size, dtype=np.int64)
        for i, stream in enumerate(self.streams):
            mask = sources == i
            out[mask] = self.offsets[i] + stream.take(int(before[i]), int(mask.sum()))
        if self.shuffle:
            out = out[np.random.default_rng([self.seed, step, len(self.sizes)]).permutation(len(out))]
        return out

    def source_of(self, ids: np.ndarray) -> np.ndarray:
        """The source of each flat sample id."""
        return np.searchsorted(self.offsets, ids, side="right") - 1

    def wrapped(self, step: int) -> list[tuple[int, int]]:
        """``(source, epoch)`` for each source that began a new epoch (a new shuffle of
        it, after its first) during step ``step``."""
        def last_epoch(drawn: int, size: int) -> int:
            return (drawn - 1) // size if drawn else 0
        before, after = self.drawn(step), self.drawn(step + 1)
        return [(i, last_epoch(int(a), s)) for i, (b, a, s) in enumerate(zip(before, after, self.sizes))
                if last_epoch(int(a), s) > last_epoch(int(b), s)]

    def local_batch(self, step: int) -> np.ndarray:
        """This DP rank's samples of step ``step``: its micro-batches, in order."""
        return np.concatenate(self.micro_batches(step))

    def micro_batches(self, step: int) -> list[np.ndarray]:
        """This DP rank's slice of each global micro-batch of step ``step``."""
        batch, m = self.global_batch(step), self.micro_batch_size
        span = m * self.dp_size  # one global micro-batch
        first = self.dp_rank * m
        return [batch[j * span + first: j * span + first + m] for j in range(self.num_micro_batches)]


def _normalized(weights: Sequence[float] | None, count: int) -> np.ndarray:
    if weights is None:
        if count != 1:
            raise DataError(f"{count} sources need weights; write --data W:PATH,W:PATH,...")
        return np.ones(1)
    w = np.asarray(weights, dtype=np.float64)
    if len(w) != count or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise DataError(f"mixture weights {list(weights)} must be {count} positive numbers, one per source")
    return w / w.sum()


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
