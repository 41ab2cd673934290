"""Activation recomputation: keep a region's inputs, rebuild its activations in backward.

GPipe and Chen et al. ("Training Deep Nets with Sublinear Memory Cost") trade compute for
memory: a checkpointed region runs its forward without recording a graph and keeps only
its inputs; when backward reaches it, the forward is run again, this time recording, and
backward continues through the rebuilt graph. Megatron-LM's modes are built on it:

* ``full``: whole transformer blocks are regions. ``uniform`` cuts each model chunk into
  groups of ``layers`` consecutive blocks, each group one region (``layers=1``: every
  block); ``block`` makes regions of the first ``layers`` blocks of each chunk only and
  keeps the rest, so memory can be traded block by block (Megatron's two methods);
* ``selective`` (Korthikanti et al., 2022): only the attention core (scores, softmax,
  dropout, weighted sum) is a region; it is cheap to recompute and, at ``a s / h`` per
  token, the largest thing a layer keeps.

**RNG replay.** Dropout inside a region must draw the same masks the second time. A
region captures the CPU generator, the CUDA generator of its device and every stream of
the tensor-parallel tracker at forward (``rng.RNGState``), restores them around the
recomputation, and then puts back the states of the moment (``rng.replaying``), so the
run's random stream is untouched.

**Pipelines.** The runtime tells :class:`Recomputation` which micro-batch is running. With
``keep_last`` the last micro-batch of a step keeps its activations (GPipe: its backward
is the next thing to run, so recomputing would only redo what was just done). With
``early`` the runtime recomputes a micro-batch's regions as soon as it has posted the
receive of its output gradient, so the recomputation overlaps the wait for the next stage
(torchgpipe splits checkpoint and recompute for the same purpose).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch

from gridtrain.runtime import activation_meter as memory
from gridtrain.parallel.rng import RNGState, RNGStatesTracker, replaying


_ahead = 0  # > 0 while regions are rebuilt ahead of their backward (Recomputation.rebuild)


def rebuilding_ahead() -> bool:
    """Whether the forward running now is a region rebuilt ahead of its backward (early
    recomputation): outside autograd's backward, yet its backward comes next."""
    return _ahead > 0


# ---- one recomputed region ------------------------------------------------------------------------

class _Region:
    """A region's kept inputs and RNG state; rebuilds its graph once, on demand."""

    def __init__(self, fn: Callable, inputs: Sequence[torch.Tensor], rng: RNGState,
                 owner: "Recomputation"):
        self.fn, self.rng, self.owner = fn, rng, owner
        self.scope = memory.current_scope()
        self.needs_grad = [x.requires_grad for x in inputs]
        self.kept = [memory.save(x.detach()) for x in inputs]
        self.rebuilt: tuple[list[torch.Tensor], tuple[torch.Tensor, ...]] | None = None

    def rebuild(self) -> None:
        """Run the forward again, recording the graph (the RNG replayed)."""
        if self.rebuilt is not None or self.fn is None:
            return
        inputs = [memory.load(k).detach().requires_grad_(g) for k, g in zip(self.kept, self.needs_grad)]
        self.kept = []
        self.owner.rebuilding = True
        try:
            with replaying(self.rng, self.owner.rng, self.owner.device), torch.enable_grad(), \
                    memory.layer_scope(self.scope, "recompute"):
                outputs = self.fn(*inputs)
        finally:
            self.owner.rebuilding = False
        self.rebuilt = (inputs, outputs if isinstance(outputs, tuple) else (outputs,))
        self.owner.recomputed += 1

    def backward(self, grads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, ...]:
        self.rebuild()
        inputs, outputs = self.rebuilt
        self.rebuilt, self.fn = None, None  # done: a late rebuild() is a no-op
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return tuple(x.grad if x.requires_grad else None for x in inputs)


class _Checkpoint(torch.autograd.Function):
    """The autograd node of a region: forward without a graph, backward by rebuilding it."""

    @staticmethod
    def forward(ctx, region: _Region, _anchor: torch.Tensor, *inputs: torch.Tensor):
        ctx.region = region
        outputs = region.fn(*inputs)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        region, ctx.region = ctx.region, None
        return (None, None, *region.backward(grads))


# ---- the policy and its state ------------------------------------------------------------------

@dataclass(frozen=True)
class RecomputePolicy:
    mode: str = "none"  # none | selective | full
    method: str = "uniform"  # uniform | block (full only)
    layers: int = 1  # uniform: blocks per region; block: recomputed blocks per chunk
    keep_last: bool = False  # the step's last micro-batch is not recomputed (GPipe)
    early: bool = False  # recompute while the output gradient is still on its way

    def block_runs(self, layer_ids: Sequence[int]) -> list[tuple[tuple[int, ...], bool]]:
        """A chunk's blocks as consecutive runs ``(ids, recomputed)``; each recomputed run
        is one region."""
        ids = tuple(layer_ids)
        if self.mode != "full":
            return [(ids, False)] if ids else []
        if self.method == "block":
            head, tail = ids[:self.layers], ids[self.layers:]
            return [((i,), True) for i in head] + ([(tail, False)] if tail else [])
        return [(ids[i:i + self.layers], True) for i in range(0, len(ids), self.layers)]


def policy_from(a) -> RecomputePolicy:
    """The policy of a run's ActivationsConfig."""
    return RecomputePolicy(a.recompute, a.recompute_method, a.recompute_layers, a.recompute_keep_last,
                           a.recompute_early)


def _device_of(inputs: Sequence[torch.Tensor], default: torch.device) -> torch.device:
    """The device of a region's first tensor input, else ``default`` (the rank's)."""
    return next((t.device for t in inputs if isinstance(t, torch.Tensor)), default)


class Recomputation:
    """The recomputation of one model replica: its policy, the generators it replays, and
    which micro-batch is running (set by the pipeline runtime)."""

    def __init__(self, policy: RecomputePolicy | None = None, rng: RNGStatesTracker | None = None):
        self.policy = policy or RecomputePolicy()
        self.rng = rng
        self.device = rng.device if rng is not None else torch.device("cpu")
        self.keeping = False  # this micro-batch keeps its activations
        self.rebuilding = False  # a region's forward is running again (statistics must not count it twice)
        self.key: Hashable | None = None
        self.pending: dict[Hashable, list[_Region]] = defaultdict(list)
        self.recomputed = 0  # regions rebuilt so far (counts for tests and reports) ...
        self.rebuilt_early = 0  # ... of which ahead of their backward
        # regions of a micro-batch rebuilt ahead (None: all). ZeRO-3 sets 1: a region
        # rebuilt ahead keeps its parameters gathered until its backward (gathering them
        # again there would double the step's gathers), so only the first one backward
        # needs is, as the prefetch would have gathered it anyway.
        self.early_limit: int | None = None

    @property
    def full(self) -> bool:
        return self.policy.mode == "full" and not self.keeping

    @property
    def selective(self) -> bool:
        return self.policy.mode == "selective" and not self.keeping

    @contextlib.contextmanager
    def micro_batch(self, key: Hashable, last: bool) -> Iterator[None]:
        """The forward of micro-batch ``key`` runs inside; ``last``: the step's last one."""
        self.key, self.keeping = key, last and self.policy.keep_last
        try:
            yield
        finally:
            self.key, self.keeping = None, False

    def checkpoint(self, fn: Callable, *inputs: torch.Tensor):
        """``fn(*inputs)``, keeping only ``inputs`` for backward (when a graph is being
        recorded at all). ``fn`` must depend on nothing but its inputs, parameters and
        random draws."""
        if not torch.is_grad_enabled():
            return fn(*inputs)
        region = _Region(fn, inputs, RNGState.capture(self.rng, self.device), self)
        if self.policy.early and self.key is not None:
            self.pending[self.key].append(region)
        # The anchor makes the outputs require grad even when no input does (parameters
        # inside the region still need their gradients). It lives on the inputs' device:
        # a CPU tensor among a CUDA function's inputs would give its backward node a CPU
        # input and a CUDA one, and the engine a CPU gradient to route.
        anchor = torch.empty(0, device=_device_of(inputs, self.device), requires_grad=True)
        return _Checkpoint.apply(region, anchor, *inputs)

    def rebuild(self, key: Hashable) -> None:
        """Recompute the regions of micro-batch ``key`` now, ahead of its backward: every
        one, or with :attr:`early_limit` only that many of the last (the first that
        backward needs); the others rebuild in backward as usual."""
        global _ahead
        regions = self.pending.pop(key, [])
        if self.early_limit is not None:
            regions = regions[len(regions) - self.early_limit:] if self.early_limit else []
        _ahead += 1
        try:
            for region in regions:
                region.rebuild()
                self.rebuilt_early += 1
        finally:
            _ahead -= 1

    def forget(self, key: Hashable) -> None:
        self.pending.pop(key, None)
