"""Configuration: dataclasses, presets, YAML files and command-line overrides.

Everything a run needs is decided here; :mod:`gridtrain.validate_config` checks it before
any process is spawned or any collective starts. This module imports nothing else of the
package, so that every other module may import it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DTYPES = ("fp32", "bf16", "fp16", "fp64")
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
ATTENTION = ("sdpa", "math")
DEVICES = ("cpu", "cuda")


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line naming problem and fix."""


@dataclass
class ModelConfig:
    """Shape of a GPT-2 style decoder (pre-LayerNorm, GELU MLP, learned positions)."""

    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    seq_len: int = 64
    vocab_size: int = 257
    ffn_hidden: int | None = None  # defaults to 4 * d_model
    dropout: float = 0.0
    attention: str = "sdpa"  # sdpa: torch's fused kernel | math: unfused ops (Megatron's core attention)
    vocab_pad_multiple: int = 64  # padded vocab is a multiple of this times tp
    layernorm_eps: float = 1e-5
    tie_embeddings: bool = True

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocabulary rounded up so every TP rank owns an equal, aligned slice.

        The padding rows are never looked up and are masked out of the softmax, so
        the padded size may depend on the layout without changing the model.
        """
        multiple = self.vocab_pad_multiple * tp
        return -(-self.vocab_size // multiple) * multiple


@dataclass
class ParallelConfig:
    """Sizes of the device grid and how the work is scheduled on it."""

    nproc: int | None = None  # local workers to spawn; None = one, or torchrun's world
    dp: int | None = None  # inferred from the world size when None
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    schedule: str = "1f1b"
    sequence_parallel: bool = False  # LayerNorm/dropout on sequence shards (needs tp > 1)
    pp_layers: list[int] | None = None  # blocks per virtual stage, e.g. [3, 4, 4, 3]
    pp_partition: str = "uniform"  # uniform | parameters | time, when pp_layers is not given
    bucket_mb: float = 25.0  # gradient all-reduce bucket size (DDP's default)


@dataclass
class TrainingConfig:
    """The optimisation recipe and the run's bookkeeping."""

    steps: int = 100
    micro_batch_size: int = 4
    global_batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None  # default: 5% of steps, at least 1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1234
    dtype: str = "fp32"
    recompute: str = "none"  # none | selective (attention core) | full (whole blocks)
    recompute_method: str = "uniform"  # full: uniform (groups of N blocks) | block (first N per chunk)
    recompute_layers: int = 1  # the N of recompute_method
    recompute_keep_last: bool = False  # the last micro-batch of a step is not recomputed (GPipe)
    recompute_early: bool = False  # recompute while the output gradient is on its way (pp > 1)
    offload_activations: bool = False  # saved activations to host memory and back (GPU only)
    memory_report: bool = False  # print saved-activation bytes per layer and stage
    zero: int = 0  # 1: shard master weights and Adam state over data parallel (ZeRO-1)
    loss_scale: float = 2.0 ** 16  # fp16: initial dynamic loss scale
    loss_scale_window: int = 1000  # fp16: good steps before the scale doubles
    device: str | None = None  # cuda when available, else cpu
    eval_interval: int = 50
    eval_iters: int = 4
    metrics_file: str | None = None
    save: str | None = None
    save_interval: int = 0  # 0: save only at the end (when --save is given)
    load: str | None = None
    sample_tokens: int = 0  # print this many sampled tokens after training
    prompt: str = ""
    temperature: float = 0.8
    top_k: int | None = 40
    peak_tflops: float | None = None  # per device, for MFU; known GPUs are looked up
    dist_timeout_s: float = 300.0
    progress: bool = True
    trace: str | None = None  # directory for per-rank Chrome traces of pipeline actions
    tensorboard: str | None = None  # directory for TensorBoard event files (per-step metrics)

    @property
    def warmup(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return max(1, self.steps // 20)


@dataclass
class DataConfig:
    """Where tokens come from: None means the built-in corpus (Python's stdlib sources)."""

    path: str | None = None
    tokenizer: str | None = None  # a Hugging Face tokenizer.json; default: bytes
    valid_every: int = 100  # every Nth window of the corpus is held out


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    preset: str = "tiny"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Config":
        cfg = cls(preset=raw.get("preset", "tiny"))
        for section in ("model", "parallel", "training", "data"):
            _update_section(cfg, section, raw.get(section) or {})
        unknown = set(raw) - {"model", "parallel", "training", "data", "preset"}
        if unknown:
            raise ConfigError(f"unknown config section(s) {sorted(unknown)}; "
                              "use model, parallel, training, data")
        return cfg


# Model shapes. `tiny` is for tests, `small` is what `make train` trains in a few minutes
# on two CPU cores, the gpt2* entries are the Hugging Face GPT-2 shapes.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=2, n_head=4, d_model=64, seq_len=64, vocab_size=257),
    "small": dict(n_layer=4, n_head=4, d_model=128, seq_len=128, vocab_size=257),
    "gpt2": dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=50257),
    "gpt2-medium": dict(n_layer=24, n_head=16, d_model=1024, seq_len=1024, vocab_size=50257),
    "gpt2-large": dict(n_layer=36, n_head=20, d_model=1280, seq_len=1024, vocab_size=50257),
    "gpt2-xl": dict(n_layer=48, n_head=25, d_model=1600, seq_len=1024, vocab_size=50257),
}


def preset_config(name: str) -> Config:
    """A fresh Config whose model section is the named preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return Config(model=ModelConfig(**PRESETS[name]), preset=name)


def _update_section(cfg: Config, section: str, values: dict[str, Any]) -> None:
    target = getattr(cfg, section)
    names = {f.name for f in dataclasses.fields(target)}
    for key, value in values.items():
        key = key.replace("-", "_")
        if key not in names:
            raise ConfigError(f"unknown key {section}.{key}; known keys: {', '.join(sorted(names))}")
        setattr(target, key, value)


def load_config(path: str | None, overrides: dict[str, dict[str, Any]] | None = None,
                preset: str | None = None) -> Config:
    """Preset, then the YAML file, then command-line overrides (later wins).

    The preset comes from ``preset`` (a --model flag) or the file's ``preset`` key.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"--config {path}: no such file")
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"--config {path}: expected a mapping with sections model, "
                              "parallel, training, data")
    cfg = preset_config(preset or raw.get("preset", "tiny"))
    file_cfg = {k: v for k, v in raw.items() if k != "preset"}
    for section in ("model", "parallel", "training", "data"):
        _update_section(cfg, section, file_cfg.pop(section, None) or {})
    if file_cfg:
        raise ConfigError(f"--config {path}: unknown section(s) {sorted(file_cfg)}; "
                          "use model, parallel, training, data")
    for section, values in (overrides or {}).items():
        _update_section(cfg, section, {k: v for k, v in values.items() if v is not None})
    return cfg


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def world_size_of(cfg: Config) -> int:
    """The world the run will have: torchrun's WORLD_SIZE, else --nproc, else 1."""
    if under_torchrun() or cfg.parallel.nproc is None:
        return int(os.environ.get("WORLD_SIZE", "1"))
    return cfg.parallel.nproc
