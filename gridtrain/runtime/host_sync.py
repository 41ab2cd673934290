"""Named host synchronisation points of a training step.

Reading a device value on the host (``float(t)``, ``int(t)``, ``bool(t)``, ``t.item()``)
makes the host wait for the device to finish everything queued before it. On a GPU that
stalls the launch of the next kernels, so a training step should do it only where it
must, and say where. The step's few such reads go through :func:`read`, each under a
name:

* ``token_count``: the loss-bearing tokens of the global batch (the loss is divided by
  it before backward, and a batch with none is an error);
* ``step_scalars``: the step's mean loss (logging, the divergence check), the global
  gradient norm (compared with ``--grad-clip``) and whether any rank's fp16 gradients
  overflowed (skip the step), reduced together as one vector (grads.step_scalars).

Outside the step, one read each where a whole pass would otherwise read per tensor:

* ``valid_loss``: the validation loss, summed and token-counted on the device over all
  of its micro-batches first;
* ``weights_finite``: before a save, whether every rank's weights are finite.

Outside a dry run :func:`read` is just ``convert(tensor)``. In a dry run
(gridtrain/dryrun.py) tensors are fake and cannot be read: :func:`allowing` makes
:func:`read` record the name and return the caller's ``stand_in`` (a plausible value that
keeps the step on its normal path, e.g. a token count of every label). Any other read of
device data inside the step fails there, which is how the dry run finds unnamed syncs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

_hits: list[str] | None = None  # names read during a dry run; None outside one


def read(name: str, tensor: torch.Tensor, convert: Callable[[torch.Tensor], Any] = float, *,
         stand_in: Any) -> Any:
    """``convert(tensor)`` (a host synchronisation named ``name``); in a dry run,
    ``stand_in`` (called first when callable) and the name is recorded."""
    if _hits is None:
        return convert(tensor)
    _hits.append(name)
    return stand_in() if callable(stand_in) else stand_in


@contextlib.contextmanager
def allowing() -> Iterator[list[str]]:
    """Inside: the named points return their stand-ins; yields the list of names hit."""
    global _hits
    saved, _hits = _hits, []
    try:
        yield _hits
    finally:
        _hits = saved
