"""Whether a checkpoint can be loaded by this run: found, complete and undamaged, and
holding the same model.

:func:`check_loadable` runs before any worker starts and again in each process that
loads. The checkpoint's model config (meta.json) must equal the run's on every field
that changes the weights' shapes or meaning (all of :class:`~gridtrain.config.ModelConfig`
except dropout, attention, vocab_pad_multiple and max_positions, with ffn_hidden compared
as the resolved ffn_size and n_kv_head as the resolved key/value head count); one line
names each differing field with both values (:func:`compare_models`).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from gridtrain.checkpoint.directories import LATEST, find_step_dir, resolve
from gridtrain.checkpoint.errors import CheckpointError
from gridtrain.checkpoint.manifest import META, read_meta_file, verify
from gridtrain.config import Config, ModelConfig

# Model fields that do not change the weights' shapes or meaning (compared: all others);
# the balance losses' coefficients, the expert bias's rate, the expert capacity and the
# multi-token prediction loss's weight are training choices.
_NOT_COMPARED = {"dropout", "attention", "vocab_pad_multiple", "ffn_hidden", "max_positions", "moe_ffn_hidden",
                 "moe_aux_loss_coeff", "moe_capacity_factor", "moe_seq_aux_loss_coeff", "moe_expert_bias_rate",
                 "mtp_loss_coeff"}
_MODEL_FLAGS = {"n_layer": "--n-layer", "n_head": "--n-head", "d_model": "--d-model",
                "seq_len": "--seq-len", "vocab_size": "--vocab-size", "arch": "--arch", "n_kv_head": "--n-kv-head",
                "rope_theta": "--rope-theta"}


def read_meta(directory: str | Path) -> dict[str, Any]:
    """The checkpoint's ``meta.json`` (step, config), once its manifest lists every file
    at its size and meta.json's checksum matches; one-line errors."""
    path = resolve(directory)
    verify(path, "--load", data=False)
    return read_meta_file(path, "--load")


def model_of_meta(meta: dict[str, Any], where: str) -> ModelConfig:
    """The model config a checkpoint's meta.json holds; refused if it has fields this version lacks."""
    raw = meta["config"].get("model") or {}
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise CheckpointError(f"{where}: the checkpoint's model has fields this version does not know "
                              f"({', '.join(unknown)}); load it with the gridtrain version that wrote it")
    return ModelConfig(**raw)


def _compared(m: ModelConfig) -> dict[str, Any]:
    values = {f.name: getattr(m, f.name) for f in fields(ModelConfig) if f.name not in _NOT_COMPARED}
    values["ffn_size"] = m.ffn_size
    values["moe_ffn_size"] = m.moe_ffn_size
    values["n_kv_head"] = m.kv_heads  # None means one per query head
    return values


def compare_models(saved: ModelConfig, run: ModelConfig, where: str, label: str = "flags") -> None:
    """Raise one line naming every field on which ``run`` would build other weights than
    ``saved`` holds (see the module docstring for which fields)."""
    a, b = _compared(saved), _compared(run)
    differ = [name for name in a if a[name] != b[name]]
    if not differ:
        return
    pairs = [f"{name} {a[name]!r} vs {b[name]!r}" for name in differ]
    pairs[0] = f"{differ[0]} {a[differ[0]]!r} (checkpoint) vs {b[differ[0]]!r} ({label})"
    flags = [f"{_MODEL_FLAGS[n]} {a[n]}" for n in differ if n in _MODEL_FLAGS]
    widths = {"ffn_size": "ffn_hidden", "moe_ffn_size": "moe_ffn_hidden"}  # set by these keys
    keys = [f"model.{widths.get(n, n)}: {a[n]}" for n in differ if n not in _MODEL_FLAGS]
    fixes = ([f"pass the checkpoint's model flags ({' '.join(flags)})"] if flags else []) + \
            ([f"set {', '.join(keys)} in --config"] if keys else [])
    raise CheckpointError(f"{where}: the checkpoint's model differs from this run's: {', '.join(pairs)}; "
                          f"{' and '.join(fixes)}")


def check_loadable(directory: str | Path, cfg: Config | ModelConfig | None = None, *,
                   verify_data: bool = True, flag: str = "--load") -> Path:
    """The step directory ``directory`` means (itself, or its save directory's latest),
    once it is complete and undamaged and, when ``cfg`` is given, holds the same model as
    ``cfg.model``; else a one-line :class:`CheckpointError`. Cheap enough to run before
    any worker starts: ``verify_data`` hashes every file (about 0.6 s per GB; a process
    hashes an unchanged file once), without it only presence and sizes are checked.
    ``flag`` is how messages name the option that gave the path (``--init-from``)."""
    path = find_step_dir(directory, flag)
    if path is None:
        raise CheckpointError(f"{flag} {directory}: no checkpoint there (no {LATEST} file "
                              f"and no {META}); pass a directory written by --save")
    verify(path, flag, data=verify_data)
    meta = read_meta_file(path, flag)
    if cfg is not None:
        run = cfg.model if isinstance(cfg, Config) else cfg
        compare_models(model_of_meta(meta, f"{flag} {directory}"), run, f"{flag} {directory}")
    if isinstance(cfg, Config) and flag == "--load":
        compare_optimizers(meta, cfg, f"{flag} {directory}")
    return path


def saved_optimizer(meta: dict) -> str:
    """The optimizer a checkpoint's run stepped with (``adamw`` before there was a choice)."""
    return ((meta.get("config") or {}).get("optim") or {}).get("optimizer", "adamw")


def compare_optimizers(meta: dict, cfg: Config, where: str) -> None:
    """Refuse, in one line, to resume one optimizer's state into another, unless
    ``--reset-optimizer`` starts the state afresh."""
    saved, run = saved_optimizer(meta), cfg.optim.optimizer
    if saved != run and not cfg.checkpoint.reset_optimizer:
        raise CheckpointError(f"{where}: the checkpoint's optimizer is {saved} and this run's is {run}; pass "
                              f"--optimizer {saved} to resume it, or --reset-optimizer to keep its weights and "
                              f"start {run}'s state from zero")


def saved_model(directory: str | Path, flag: str = "--load") -> ModelConfig:
    """The model a checkpoint holds (from its meta.json, once its files are checked)."""
    path = check_loadable(directory, flag=flag, verify_data=False)
    return model_of_meta(read_meta_file(path, flag), f"{flag} {directory}")
