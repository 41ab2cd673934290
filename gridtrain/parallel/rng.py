"""Random number streams: the tracker that gives dropout under tensor parallelism a
per-rank stream, and the capture / replay of every generator that activation
recomputation needs.

Dropout on activations that every TP rank holds alike (the residual stream without
sequence parallelism) must draw the same mask on every rank: it uses the default
generator, seeded alike over TP. Dropout on what differs per TP rank (this rank's
attention heads, a sequence shard) must draw differently: it forks into the tracker's
model-parallel stream, seeded per TP rank (Megatron's ``get_cuda_rng_tracker``).
Recomputation captures all of them at a region's forward and replays them when the
region is rebuilt, so its masks are the same both times.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

MODEL_PARALLEL_RNG = "model-parallel"
MODEL_PARALLEL_SEED_OFFSET = 2718  # Megatron's offset between the default and TP streams


# ---- named streams ---------------------------------------------------------------------

class RNGStatesTracker:
    """Named RNG streams for regions that must draw differently per TP rank.

    Dropout outside TP regions uses the default generator, seeded alike on every TP
    rank, so replicated activations get the same mask. Inside a TP region (attention
    probabilities of this rank's heads, or anything under sequence parallelism) ``fork``
    swaps in this rank's own stream and swaps it back after. ``get_states``/``set_states``
    let activation recomputation replay the exact masks.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = self._get()
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = self._get()
        self._set(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            yield  # no tracker stream set up (single process): the default generator
            return
        saved = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(saved)


# ---- capture and replay ------------------------------------------------------------------

@dataclass
class RNGState:
    """Every generator a region may draw from, at one moment."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    tracker: dict[str, torch.Tensor]

    @classmethod
    def capture(cls, tracker: RNGStatesTracker | None, device: torch.device) -> "RNGState":
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, tracker.get_states() if tracker is not None else {})

    def restore(self, tracker: RNGStatesTracker | None, device: torch.device) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, device)
        if tracker is not None:
            tracker.set_states(self.tracker)


@contextlib.contextmanager
def replaying(state: RNGState, tracker: RNGStatesTracker | None, device: torch.device) -> Iterator[None]:
    """Draw as at ``state`` inside the block; afterwards, as if the block never ran."""
    now = RNGState.capture(tracker, device)
    state.restore(tracker, device)
    try:
        yield
    finally:
        now.restore(tracker, device)
