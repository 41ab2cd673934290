"""Configuration: dataclasses, presets, YAML files and command-line overrides.

Everything a run needs is decided here; :mod:`gridtrain.training.validate` checks it before
any process is spawned or any collective starts. Every value is checked against its
field's type where it enters (YAML file, flags, or :func:`check_types` for configs built
in Python), because a wrong type found later is a traceback inside a worker. This
module imports nothing else of the package, so that every other module may import it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DTYPES = ("fp32", "bf16", "fp16", "fp64")
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
ATTENTION = ("sdpa", "math")
ARCHS = ("gpt2", "llama")
ROPE_SCALINGS = ("llama3",)
DEVICES = ("cpu", "cuda")


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line naming problem and fix."""


@dataclass
class ModelConfig:
    """Shape of a decoder: GPT-2 (pre-LayerNorm, GELU MLP, learned positions, biases) or
    Llama (RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no biases)."""

    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    seq_len: int = 64
    vocab_size: int = 257
    ffn_hidden: int | None = None  # defaults: 4 * d_model (gpt2); 8/3 * d_model rounded up to 256 (llama)
    dropout: float = 0.0
    attention: str = "sdpa"  # sdpa: torch's fused kernel | math: unfused ops (Megatron's core attention)
    vocab_pad_multiple: int = 64  # padded vocab is a multiple of this times tp
    layernorm_eps: float = 1e-5  # epsilon of the block norms: LayerNorm (gpt2) or RMSNorm (llama)
    tie_embeddings: bool = True
    arch: str = "gpt2"  # gpt2 | llama
    # llama only (docs/llama.md): key/value heads (grouped-query attention; None = n_head),
    # rotary base, Llama 3's rope scaling ("llama3" or None) and its parameters, and the
    # context the model was published for (Hugging Face's max_position_embeddings; None = seq_len)
    n_kv_head: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: str | None = None
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    max_positions: int | None = None

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.arch == "llama":  # Meta's rule: two thirds of 4 d, rounded up to a multiple of 256
            return -(-8 * self.d_model // (3 * 256)) * 256
        return 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head for llama (default n_head), n_head for GPT-2."""
        return self.n_kv_head or self.n_head

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
    bucket_mb: float = 25.0  # gradient bucket size (DDP's default): all-reduce, or ZeRO-1 reduce-scatter + gather


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
    compile: bool = False  # torch.compile each transformer block (model.compile_blocks)
    zero: int = 0  # 1: shard master weights and Adam state over data parallel (ZeRO-1)
    loss_scale: float = 2.0 ** 16  # fp16: initial dynamic loss scale
    loss_scale_window: int = 1000  # fp16: good steps before the scale doubles
    min_loss_scale: float = 1.0  # fp16: still overflowing at this scale stops the run (diverged)
    device: str | None = None  # cuda when available, else cpu
    eval_interval: int = 50
    eval_iters: int = 4
    metrics_file: str | None = None
    save: str | None = None
    save_interval: int = 0  # 0: save only at the end (when --save is given)
    keep_last: int = 0  # keep only the newest K complete checkpoints in --save (0: keep all)
    save_async: bool = False  # write checkpoints in the background; the step waits only for staging
    load: str | None = None
    init_from: str | None = None  # weights only, step 0: a gridtrain checkpoint or a Hugging Face directory
    auto_resume: bool = False  # resume from --save's latest checkpoint when there is one
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
        cfg = cls(preset=_preset_name(raw.get("preset", "tiny"), ""))
        for section in SECTIONS:
            _update_section(cfg, section, raw.get(section))
        unknown = set(raw) - {*SECTIONS, "preset"}
        if unknown:
            raise ConfigError(f"unknown config section(s) {sorted(map(str, unknown))}; "
                              "use model, parallel, training, data")
        return cfg


# Model shapes. `tiny` is for tests, `small` is what `make train` trains in a few minutes
# on two CPU cores, the gpt2* entries are the Hugging Face GPT-2 shapes. The Llama
# entries are the published shapes (Hugging Face config.json: vocab_size, hidden_size,
# num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
# rope_theta, rms_norm_eps, tie_word_embeddings, max_position_embeddings, rope_scaling);
# their seq_len is the context they were pre-trained at, and `llama-tiny` is for tests.
_LLAMA = dict(arch="llama", tie_embeddings=False, layernorm_eps=1e-5)
_LLAMA3 = dict(_LLAMA, vocab_size=128256, n_kv_head=8, rope_theta=500000.0, seq_len=8192, max_positions=8192)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=2, n_head=4, d_model=64, seq_len=64, vocab_size=257),
    "small": dict(n_layer=4, n_head=4, d_model=128, seq_len=128, vocab_size=257),
    "gpt2": dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=50257),
    "gpt2-medium": dict(n_layer=24, n_head=16, d_model=1024, seq_len=1024, vocab_size=50257),
    "gpt2-large": dict(n_layer=36, n_head=20, d_model=1280, seq_len=1024, vocab_size=50257),
    "gpt2-xl": dict(n_layer=48, n_head=25, d_model=1600, seq_len=1024, vocab_size=50257),
    "llama-tiny": dict(_LLAMA, n_layer=2, n_head=8, n_kv_head=2, d_model=64, ffn_hidden=160, seq_len=64,
                       vocab_size=257),
    "smollm2-135m": dict(_LLAMA, n_layer=30, n_head=9, n_kv_head=3, d_model=576, ffn_hidden=1536,
                         vocab_size=49152, rope_theta=100000.0, tie_embeddings=True, seq_len=2048,
                         max_positions=8192),
    "tinyllama-1.1b": dict(_LLAMA, n_layer=22, n_head=32, n_kv_head=4, d_model=2048, ffn_hidden=5632,
                           vocab_size=32000, seq_len=2048, max_positions=2048),
    "llama2-7b": dict(_LLAMA, n_layer=32, n_head=32, n_kv_head=32, d_model=4096, ffn_hidden=11008,
                      vocab_size=32000, seq_len=4096, max_positions=4096),
    "llama3-8b": dict(_LLAMA3, n_layer=32, n_head=32, d_model=4096, ffn_hidden=14336),
    "llama3-70b": dict(_LLAMA3, n_layer=80, n_head=64, d_model=8192, ffn_hidden=28672),
    # Llama 3.1: the 128K context by Llama 3's rope scaling of the 8K one
    "llama3-405b": dict(_LLAMA3, n_layer=126, n_head=128, d_model=16384, ffn_hidden=53248, max_positions=131072,
                        rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                        rope_high_freq_factor=4.0, rope_original_max_positions=8192),
}


def preset_config(name: str) -> Config:
    """A fresh Config whose model section is the named preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return Config(model=ModelConfig(**PRESETS[name]), preset=name)


SECTIONS = ("model", "parallel", "training", "data")


def _preset_name(name: Any, source: str) -> str:
    if not isinstance(name, str):
        raise ConfigError(f"{source}preset must be a string, got {name!r}; choose one of {', '.join(PRESETS)}")
    return name


# ------------------------------------------------------------------------ field types
#
# YAML gives whatever its parser makes of the text: PyYAML reads ``lr: 1e-3`` as the
# string "1e-3" (YAML 1.1 wants a dot in a float), ``steps: 2.5`` as a float and
# ``model: 5`` as an int. Each value is therefore checked against its field's annotation
# where it enters the config, so that a wrong type is one line naming ``section.key``
# instead of a traceback deep inside a worker, or after the whole run.


@functools.cache
def field_types(section_class: type) -> dict[str, Any]:
    """Each field's annotation as a type (the annotations are strings in this module)."""
    return typing.get_type_hints(section_class)


def _describe_type(annotation: Any) -> str:
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) and type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        return f"{_describe_type(inner)} or null"
    if typing.get_origin(annotation) is list:
        return f"a list of {_describe_type(typing.get_args(annotation)[0]).split(' ', 1)[1]}s"
    return {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}[annotation]


def _as_type(value: Any, annotation: Any) -> Any:
    """``value`` as ``annotation`` wants it; raises TypeError when it is not one.

    Numbers are accepted where floats are expected, and so are strings that spell a
    finite number (YAML's ``1e-3``); bools are never numbers, floats never integers.
    """
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) and type(None) in args:
        if value is None:
            return None
        (annotation,) = (a for a in args if a is not type(None))
    if annotation is bool and isinstance(value, bool):
        return value
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation is str and isinstance(value, str):
        return value
    if annotation is float and not isinstance(value, bool) and isinstance(value, (int, float, str)):
        try:
            number = float(value)
        except ValueError:
            raise TypeError from None
        if not math.isfinite(number):
            raise TypeError
        return number
    if typing.get_origin(annotation) is list and isinstance(value, list):
        return [_as_type(v, typing.get_args(annotation)[0]) for v in value]
    raise TypeError


def typed_value(section: str, key: str, value: Any, annotation: Any, source: str = "") -> Any:
    """``value`` converted to the field's type, or ConfigError naming section.key."""
    try:
        return _as_type(value, annotation)
    except TypeError:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ConfigError(f"{source}{section}.{key} must be {_describe_type(annotation)}, got {shown} "
                          f"({type(value).__name__}); correct the value") from None


def check_types(cfg: Config) -> Config:
    """Every field of ``cfg`` has its annotated type (numbers normalised to float where a
    float is wanted); for configs built in Python rather than read from YAML or flags."""
    _preset_name(cfg.preset, "")
    for section in SECTIONS:
        target = getattr(cfg, section)
        for key, annotation in field_types(type(target)).items():
            setattr(target, key, typed_value(section, key, getattr(target, key), annotation))
    return cfg


def _update_section(cfg: Config, section: str, values: Any, source: str = "") -> None:
    if values is None:
        return
    if not isinstance(values, dict):
        raise ConfigError(f"{source}section {section} must be a mapping of keys to values, got {values!r}; "
                          f"write it as {section}: {{key: value, ...}}")
    target = getattr(cfg, section)
    annotations = field_types(type(target))
    for key, value in values.items():
        key = str(key).replace("-", "_")
        if key not in annotations:
            raise ConfigError(f"{source}unknown key {section}.{key}; known keys: {', '.join(sorted(annotations))}")
        setattr(target, key, typed_value(section, key, value, annotations[key], source))


def _read_yaml(path: str) -> dict[str, Any]:
    """The file's mapping; a syntax error is one line naming the file and the line."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = " ".join(str(e.problem or e.context or "invalid YAML").split())
        if e.problem and e.context and e.context_mark is not None:
            problem += f" ({e.context}, from line {e.context_mark.line + 1})"
        raise ConfigError(f"--config {path}: {where}{problem}; fix the YAML syntax there") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({' '.join(str(e).split())})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not UTF-8 text; save it as UTF-8 YAML") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping with sections model, "
                          "parallel, training, data")
    return raw


def load_config(path: str | None, overrides: dict[str, dict[str, Any]] | None = None,
                preset: str | None = None) -> Config:
    """Preset, then the YAML file, then command-line overrides (later wins).

    The preset comes from ``preset`` (a --model flag) or the file's ``preset`` key.
    """
    raw = _read_yaml(path) if path is not None else {}
    source = f"--config {path}: "
    file_preset = _preset_name(raw.get("preset", "tiny"), source)
    cfg = preset_config(preset or file_preset)
    file_cfg = {k: v for k, v in raw.items() if k != "preset"}
    for section in SECTIONS:
        _update_section(cfg, section, file_cfg.pop(section, None), source)
    if file_cfg:
        raise ConfigError(f"--config {path}: unknown section(s) {sorted(map(str, file_cfg))}; "
                          "use model, parallel, training, data")
    for section, values in (overrides or {}).items():
        _update_section(cfg, section, {k: v for k, v in values.items() if v is not None})
    return cfg


def given_model_fields(path: str | None, overrides: dict[str, dict[str, Any]] | None = None,
                       preset: str | None = None) -> set[str]:
    """The model fields a run sets itself, by flag, config file or a named preset: what
    ``--init-from`` (which takes the model's shape from its source) must not contradict."""
    raw = _read_yaml(path) if path is not None else {}
    given = {k for k, v in ((overrides or {}).get("model") or {}).items() if v is not None}
    model = raw.get("model")
    given |= {str(k).replace("-", "_") for k in model} if isinstance(model, dict) else set()
    name = preset or raw.get("preset")
    return given | set(PRESETS.get(name, {})) if isinstance(name, str) else given


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def world_size_of(cfg: Config) -> int:
    """The world the run will have: torchrun's WORLD_SIZE, else --nproc, else 1."""
    if under_torchrun() or cfg.parallel.nproc is None:
        return int(os.environ.get("WORLD_SIZE", "1"))
    return cfg.parallel.nproc
