"""Checkpoints: sharded on torch.distributed.checkpoint, checked, atomic, resharded on load.

* manifest.py: every file's size and sha256, written last and checked before any read;
  durable writes (any format);
* directories.py: step directories, atomic moves into place, ``latest``, ``--keep-last``,
  finding the step directory a path means;
* loadable.py: whether a checkpoint can be loaded by this run (complete, undamaged, the
  same model: :func:`compare_models`);
* collective.py: what the ranks of a save tell each other, so a failure reaches them all;
* errors.py: :class:`CheckpointError`, one line naming the path and the fix;
* shards.py: where a rank's pieces lie in the global tensors (pure arithmetic), and the
  :class:`~gridtrain.checkpoint.shards.Slab` that hands them to DCP;
* sharded.py: format 2, what every save writes: each rank its own shards through DCP;
* background.py: ``--save-async``: stage to host memory, write on a thread of its own;
* reader.py: tensors by name, one at a time, from either format (export, generate,
  ``load_model``, ``gridtrain checkpoint info``);
* materialise.py: a model built on the meta device takes its first values, each rank
  only its own pieces (the initialisation, ``--init-from``);
* whole.py: whole tensors by name (the end-of-run sample) and the reader of format 1 (the whole-tensor checkpoints of earlier versions, and ``import-hf``'s).

This module is the entry point: :func:`save_checkpoint`, :func:`load_checkpoint`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from gridtrain.checkpoint.directories import (LATEST, latest_step_dir, resolve, step_dir,  # noqa: F401
                                              write_weights_checkpoint)
from gridtrain.checkpoint.errors import CheckpointError, first_line  # noqa: F401
from gridtrain.checkpoint.loadable import check_loadable, compare_models, read_meta, saved_model  # noqa: F401
from gridtrain.checkpoint.manifest import (DCP_METADATA, MANIFEST, META, is_sharded, read_meta_file,  # noqa: F401
                                           weight_files, write_manifest)
from gridtrain.checkpoint.sharded import (SaveReport, load_sharded, meta_of, model_buffers, state_to_save,  # noqa: F401
                                          write_state)
from gridtrain.checkpoint.reader import weight_tensors  # noqa: F401
from gridtrain.checkpoint.whole import copy_weights, gather_model, load_whole  # noqa: F401
from gridtrain.config import Config, ModelConfig
from gridtrain.optim.optimizer import as_optimizer


def save_checkpoint(directory: str | Path, step: int, model: nn.Module, optimizer, cfg: Config, ctx=None, *,
                    scaler=None, keep_last: int | None = None) -> Path:
    """Write the state after ``step`` completed steps in the sharded format, each rank
    its own pieces; collective over the world. Returns the step directory. ``optimizer``:
    gridtrain's (gridtrain.optim.interface) or a torch optimizer of a loop of your own.
    ``keep_last``: default ``cfg.checkpoint.keep_last`` (0 keeps every checkpoint)."""
    keep = cfg.checkpoint.keep_last if keep_last is None else keep_last
    optimizer = as_optimizer(optimizer)
    return write_state(directory, step, state_to_save(model, optimizer, ctx),
                       meta_of(step, cfg, ctx, optimizer, scaler), keep_last=keep)


@torch.no_grad()
def load_checkpoint(directory: str | Path, model: nn.Module, optimizer=None, ctx=None, *, scaler=None,
                    reset_optimizer: bool = False) -> int:
    """Load weights (and optimizer, loss-scaler and RNG state when given) into whatever
    part of the model this rank holds, in whatever layout; returns the completed step
    count. Either format; checked first through :func:`check_loadable` (the manifest,
    every file hashed once per process; the model config when ``model.cfg`` is one).
    ``reset_optimizer``: the optimizer keeps its fresh state (its masters still come
    from the checkpoint's weights)."""
    optimizer = as_optimizer(optimizer)
    run_model = getattr(model, "cfg", None)
    path = check_loadable(directory, run_model if isinstance(run_model, ModelConfig) else None)
    meta = read_meta_file(path, "--load")
    if is_sharded(path):
        load_sharded(path, meta, model, optimizer, ctx, scaler=scaler, reset_optimizer=reset_optimizer)
    else:
        load_whole(path, model, None if reset_optimizer else optimizer, ctx, scaler=scaler)
    return int(meta["step"])
