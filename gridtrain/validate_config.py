"""Everything about a configuration that can be checked before a process starts.

:func:`validate` runs in the launching process, before any worker is spawned or any
collective is issued, so a bad configuration costs one line on stderr (exit status 2)
and nothing else: sizes that do not divide, an unknown preset or schedule, a layer split
that does not add up, a missing data path, a tokenizer larger than the vocabulary.
Each message names the problem and the fix.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gridtrain.config import (ATTENTION, DEVICES, DTYPES, RECOMPUTE, RECOMPUTE_METHODS, Config, ConfigError,
                              DataConfig, ModelConfig, ParallelConfig, TrainingConfig, under_torchrun,
                              world_size_of)
from gridtrain.data import DataError, load_tokenizer
from gridtrain.grid import GridError, ProcessGrid
from gridtrain.metrics import require_tensorboard
from gridtrain.pipeline.partition import METHODS, PartitionError, check_counts
from gridtrain.pipeline.schedules import ORDERS, ScheduleError, check_sizes


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _validate_model(m: ModelConfig) -> None:
    for name in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size", "vocab_pad_multiple"):
        _require(getattr(m, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(m, name)}")
    _require(m.d_model % m.n_head == 0,
             f"--n-head {m.n_head} does not divide --d-model {m.d_model}; "
             "choose a head count that divides d_model")
    _require(0.0 <= m.dropout < 1.0, f"--dropout must be in [0, 1), got {m.dropout}")
    _require(m.attention in ATTENTION, f"--attention {m.attention!r} is not one of {', '.join(ATTENTION)}")


def _validate_training(t: TrainingConfig) -> None:
    _require(t.steps >= 1, f"--steps must be >= 1, got {t.steps}")
    _require(t.lr > 0, f"--lr must be > 0, got {t.lr}")
    _require(t.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {t.micro_batch_size}")
    _require(t.dtype in DTYPES, f"--dtype {t.dtype!r} is not one of {', '.join(DTYPES)}")
    _require(t.recompute in RECOMPUTE, f"--recompute {t.recompute!r} is not one of {', '.join(RECOMPUTE)}")
    _require(t.zero in (0, 1), f"--zero {t.zero} is not supported; use 0 or 1 (ZeRO-1)")
    _validate_recompute(t)
    _require(t.device in (None, *DEVICES), f"--device {t.device!r} is not one of cpu, cuda")
    _require(t.warmup < t.steps or t.steps == 1,
             f"warm-up ({t.warmup} steps) must be shorter than --steps {t.steps}")


def _validate_recompute(t: TrainingConfig) -> None:
    _require(t.recompute_method in RECOMPUTE_METHODS,
             f"--recompute-method {t.recompute_method!r} is not one of {', '.join(RECOMPUTE_METHODS)}")
    _require(t.recompute_layers >= 1, f"--recompute-layers must be >= 1, got {t.recompute_layers}")
    _require(t.recompute == "full" or (t.recompute_method == "uniform" and t.recompute_layers == 1),
             f"--recompute-method/--recompute-layers choose blocks for --recompute full, "
             f"not --recompute {t.recompute}; pass --recompute full or drop them")
    for flag, on in (("--recompute-keep-last", t.recompute_keep_last), ("--recompute-early", t.recompute_early)):
        _require(not on or t.recompute != "none",
                 f"{flag} needs recomputation; pass --recompute selective or full")


def _validate_parallel(p: ParallelConfig, world_size: int) -> None:
    _require(p.schedule in ORDERS, f"--schedule {p.schedule!r} is not one of {', '.join(ORDERS)}")
    try:
        ProcessGrid.build(world_size, tp=p.tp, pp=p.pp, dp=p.dp)
    except GridError as e:
        raise ConfigError(str(e)) from None


def _validate_tensor_parallel(m: ModelConfig, p: ParallelConfig) -> None:
    """Each TP rank must own whole heads, an equal MLP slice and (under SP) sequence slice."""
    _require(m.n_head % p.tp == 0,
             f"--tp {p.tp} does not divide --n-head {m.n_head}; choose a tp that divides the head count")
    _require(m.ffn_size % p.tp == 0,
             f"--tp {p.tp} does not divide the MLP width {m.ffn_size}; choose a tp that divides it")
    _require(not p.sequence_parallel or m.seq_len % p.tp == 0,
             f"--sequence-parallel: --tp {p.tp} does not divide --seq-len {m.seq_len}; "
             "choose a sequence length that tp divides")


def _validate_pipeline(m: ModelConfig, p: ParallelConfig, t: TrainingConfig, dp: int) -> None:
    """Schedule, chunk count and layer split fit the model and the micro-batch count."""
    _require(p.vpp >= 1, f"--vpp must be >= 1, got {p.vpp}")
    stages = p.pp * p.vpp
    if t.global_batch_size % (t.micro_batch_size * dp) == 0:
        try:
            check_sizes(p.schedule, p.pp, t.global_batch_size // (t.micro_batch_size * dp), p.vpp)
        except ScheduleError as e:
            raise ConfigError(str(e)) from None
    if p.pp_layers is not None:
        try:
            check_counts(p.pp_layers, stages, m.n_layer)
        except PartitionError as e:
            raise ConfigError(str(e)) from None
    else:
        _require(p.pp_partition in METHODS,
                 f"--pp-partition {p.pp_partition!r} is not one of {', '.join(METHODS)}")
        _require(m.n_layer >= stages, f"--n-layer {m.n_layer} is fewer than pp x vpp = {stages} stages; "
                                      "lower --pp/--vpp or give --pp-layers")


def _validate_data(d: DataConfig, vocab_size: int) -> None:
    """Paths exist and the tokenizer fits the model's vocabulary (reads no corpus)."""
    if d.path is not None:
        _require(Path(d.path).exists(), f"--data {d.path}: no such file or directory")
    if d.tokenizer is not None:
        _require(Path(d.tokenizer).is_file(), f"--tokenizer {d.tokenizer}: no such file")
    try:
        tokens = load_tokenizer(d.tokenizer).vocab_size
    except DataError as e:
        raise ConfigError(str(e)) from None
    _require(tokens <= vocab_size, f"the tokenizer has {tokens} tokens but --vocab-size is "
                                   f"{vocab_size}; pass --vocab-size {tokens}")


def _validate_outputs(t: TrainingConfig) -> None:
    """Optional outputs whose packages must be installed before the run starts."""
    if t.tensorboard is not None:
        try:
            require_tensorboard()
        except ImportError as e:
            raise ConfigError(str(e)) from None


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Check everything that can be checked without starting a process; raise ConfigError."""
    if world_size is None:
        world_size = world_size_of(cfg)
    p, t, m = cfg.parallel, cfg.training, cfg.model
    _require(p.nproc is None or p.nproc >= 1, f"--nproc must be >= 1, got {p.nproc}")
    _require(p.nproc is None or not under_torchrun() or p.nproc == world_size,
             f"--nproc {p.nproc} differs from torchrun's {world_size} workers; drop --nproc under torchrun")
    _validate_model(m)
    _validate_training(t)
    _validate_parallel(p, world_size)
    _validate_tensor_parallel(m, p)
    dp = world_size // (p.tp * p.pp)
    _validate_pipeline(m, p, t, dp)
    _require(not t.recompute_early or p.pp > 1,
             "--recompute-early overlaps recomputation with the wait for the next stage's gradient; "
             "it needs --pp > 1")
    _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
             f"--global-batch-size {t.global_batch_size} is not divisible by "
             f"--micro-batch-size {t.micro_batch_size} x dp {dp}; make it a multiple of "
             f"{t.micro_batch_size * dp}")
    _validate_data(cfg.data, m.vocab_size)
    _validate_outputs(t)
    if t.device == "cuda":
        _require(torch.cuda.is_available(), "--device cuda: no CUDA device is available; use --device cpu")
        found = torch.cuda.device_count()
        _require(p.nproc is None or found >= p.nproc,
                 f"--nproc {p.nproc} needs {p.nproc} CUDA devices, found {found}; lower --nproc")
    return cfg
