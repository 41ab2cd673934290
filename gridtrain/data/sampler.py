"""The global-batch sampler: which samples an optimizer step reads, whatever the layout.

The design invariant "any parallel layout trains the same model as one process" needs
step k to see the same global batch whatever the data-parallel size or micro-batch size;
data-parallel ranks and micro-batches only ever take fixed slices of it.
"""

from __future__ import annotations

import numpy as np

from gridtrain.data.errors import DataError


class GlobalBatchSampler:
    """Maps an optimizer step to sample indices, independently of the parallel layout.

    The sample stream is the concatenation of per-epoch permutations, each seeded by
    (seed, epoch); step k's global batch is positions [k*G, (k+1)*G) of that stream (it
    may straddle an epoch boundary). The global batch is cut micro-batch-major, as
    Megatron's sampler does: the j-th *global micro-batch* is slice [j*G/m, (j+1)*G/m)
    (m micro-batches per step) and DP rank r takes its slice [r*M, (r+1)*M) of it. So
    the j-th micro-batches of all DP ranks together are the same samples for every dp
    with the same m: what a mixture-of-experts layer takes its routing statistics over
    (parallel/experts.py). Nothing depends on how many steps ran before, so resuming at
    step k reproduces the same batches.
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
        """This DP rank's samples of step ``step``: its micro-batches, in order."""
        return np.concatenate(self.micro_batches(step))

    def micro_batches(self, step: int) -> list[np.ndarray]:
        """This DP rank's slice of each global micro-batch of step ``step``."""
        batch, m = self.global_batch(step), self.micro_batch_size
        span = m * self.dp_size  # one global micro-batch
        first = self.dp_rank * m
        return [batch[j * span + first: j * span + first + m] for j in range(self.num_micro_batches)]


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
