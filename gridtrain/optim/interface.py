"""What the trainer, the gradient path and checkpoints ask of an optimizer, whichever it is.

gridtrain steps with one of two optimizers: torch's AdamW on the parameters (fp32/fp64
without sharding; :class:`~gridtrain.optim.optimizer.AdamW` wraps it) and AdamW on flat
master weights, sharded over data parallel with ZeRO-1
(:class:`~gridtrain.optim.distributed_optimizer.DistributedOptimizer`). They differ in
where gradients and state live (each parameter's ``.grad`` and ``state``; slices of one
flat buffer), not in what the step needs from them, so the callers ask this interface
and never which optimizer they hold. A further kind (ZeRO-2/3) is one more class here,
not a branch in each caller:

* **the gradient norm**: :meth:`Optimizer.grad_norm_squared` is this rank's share of the
  squared global norm, each gradient element of the grid counted on exactly one rank
  (TP-replicated parameters on the first TP rank, the tied head copy never, DP replicas
  on the first DP rank unless ZeRO-1 has split them); the shares are summed over the
  grid in grads.step_scalars. With it the fp16 overflow flag (:meth:`nonfinite`) and
  the loss scale's :meth:`unscale`;
* **clipping**: :meth:`clip_to` scales what this rank holds of the gradients;
* **parameters ready**: :meth:`gather_before` makes a module's forward wait until its
  parameters hold the last step's weights (ZeRO-1 gathers them after the step), and
  :meth:`parameters_ready` waits for all of them before anything else reads them;
* **the step**: :meth:`step` at the learning rate of ``param_groups[0]["lr"]``;
* **checkpoints**: :meth:`state_pieces` (what to save: moments, and master weights where
  they are not the parameters), :meth:`load_targets` and :meth:`loaded` (where a load
  reads into, and what it then takes over), :meth:`load_state_by_param` (whole
  per-parameter tensors: old checkpoints, ``--init-from``), :attr:`steps`,
  :attr:`shards_over_dp` (whether DP ranks hold different parts of the state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class StatePiece:
    """Optimizer state of elements ``lo:lo + n`` of one parameter (flattened), as flat
    tensors of ``n`` elements by name (``exp_avg``, ``exp_avg_sq``, ``master``): views of
    the memory that holds them, so that a checkpoint writes from and reads into them."""

    param: nn.Parameter
    lo: int
    tensors: dict[str, torch.Tensor]


class Optimizer(Protocol):
    param_groups: list[dict]  # the learning rate is set in these (optimizer.set_lr)
    shards_over_dp: bool  # DP ranks hold different parts of the state (ZeRO-1)

    @property
    def steps(self) -> int:
        """Updates applied so far (fp16 steps skipped on overflow not counted)."""

    def grad_norm_squared(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (fp64 scalar on the device)."""

    def nonfinite(self) -> torch.Tensor:
        """1.0 when this rank's gradients hold an inf or NaN, else 0.0 (fp64, on the device)."""

    def unscale(self, scale: float) -> None:
        """Divide this rank's gradients by the fp16 loss scale."""

    def clip_to(self, norm: float, max_norm: float) -> None:
        """Scale this rank's gradients, of global norm ``norm``, to at most ``max_norm``."""

    def gather_before(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        """Make each forward of ``module`` wait until ``params`` hold the last step's weights."""

    def parameters_ready(self) -> None:
        """Wait until every parameter holds the last step's weights."""

    def step(self, row_scales: dict[nn.Parameter, torch.Tensor] | None = None) -> None:
        """Update the parameters from their gradients; then multiply the rows of the
        parameters in ``row_scales`` by their factors (``--qk-clip``: one per row of the
        rank's local tensor; masters and published weights alike)."""

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of state kept between steps (memory accounting)."""

    def state_pieces(self) -> list[StatePiece]:
        """The state to save, as views of the memory that holds it."""

    def load_targets(self) -> list[StatePiece]:
        """Zeroed state to load into; handed back to :meth:`loaded` once read."""

    def loaded(self, step: int | None, filled: list[StatePiece]) -> None:
        """Take over the state read into ``filled`` (of :meth:`load_targets`) and the saved
        step count (None: a checkpoint without optimizer state)."""

    def load_state_by_param(self, states: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Load whole per-parameter state (AdamW's names, plus ``master``)."""

    def weight_pieces(self) -> list[StatePiece] | None:
        """Where the weights live when the parameters do not hold them (ZeRO-3: this
        rank's pieces of the parameter shard, each tensor named ``model``); None: the
        parameters themselves."""
