"""What the ranks of a save tell each other: small Python objects, not tensors.

A save is collective, and any rank's failure to write must reach every rank, which all
raise the same error (:func:`raise_everywhere`); the previous checkpoint stays as it
was. Without a process group (one process, ``import-hf``) each helper is the identity.
"""

from __future__ import annotations

import torch.distributed as dist

from gridtrain.checkpoint.errors import CheckpointError

def broadcast_from_rank0(value, group=None):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather(value, group=None) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def raise_everywhere(errors: list[str | None], own: BaseException | None, where: str) -> None:
    """Every rank raises when any rank failed: a writing error (OSError) becomes one line;
    the rank that hit anything else re-raises it with its traceback."""
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if own is not None and not isinstance(own, OSError):
        raise own
    rank, error = failed[0]
    raise CheckpointError(f"{where}: rank {rank} could not write the checkpoint ({error}); "
                          "the previous checkpoint is unchanged; fix the cause (space, permissions) and re-run")
