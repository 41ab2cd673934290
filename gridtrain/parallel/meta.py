"""Parameters built on the meta device, and how they get memory of their own.

A rank builds its model on the meta device (shapes, dtypes and attributes, no memory)
and then gives each parameter memory only for what it owns: the whole local tensor, or
under ZeRO-3 nothing but an empty placeholder beside its slice of the parameter shard
(zero3.py). The values come from elsewhere (gridtrain.checkpoint.materialise).

A meta tensor's ``.data`` cannot be replaced by a real tensor (torch refuses to mix the
two tensor types), and a new ``nn.Parameter`` would break every reference to the old
one (hooks, the tied head, the optimizer's lists) and lose the attributes gridtrain
keeps on parameters (``tp_spec``, ``vocab_rows``, ``expert`` ...). So
:func:`set_storage` swaps the new tensor into the parameter object itself
(``torch.utils.swap_tensors``) and keeps its attributes. It must run before any hook is
registered on the parameter (autograd's hooks stay with the swapped-out tensor).

Under ZeRO-3 the parameter never gets its whole tensor: :func:`stand_in` gives it one
element expanded to its shape, real (the gradient reducer lays it out and hooks it) at
no memory, until the parameter shards replace it by an empty tensor between uses.
"""

from __future__ import annotations

import torch
from torch import nn


def on_meta(t: torch.Tensor) -> bool:
    """Whether ``t`` is on the meta device (by its device: a fake tensor of the dry run
    is meta underneath whatever device it stands for)."""
    return t.device.type == "meta"


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is still on the meta device."""
    return any(on_meta(p) for p in module.parameters())


def set_storage(param: torch.Tensor, tensor: torch.Tensor) -> None:
    """``param`` (same object, same attributes, same ``requires_grad``) now holds ``tensor``."""
    if not on_meta(param):
        param.data = tensor
        return
    attributes = dict(param.__dict__)
    new = nn.Parameter(tensor, requires_grad=param.requires_grad) if isinstance(param, nn.Parameter) else tensor
    torch.utils.swap_tensors(param, new)
    for key, value in attributes.items():  # gridtrain's; not the tensor's own (a fake tensor's device)
        param.__dict__.setdefault(key, value)


def stand_in(param: torch.Tensor, *, device: torch.device | str, dtype: torch.dtype) -> None:
    """A meta ``param`` becomes one element of ``dtype`` on ``device``, expanded to its shape."""
    set_storage(param, torch.zeros((), dtype=dtype, device=device).expand(param.shape))
