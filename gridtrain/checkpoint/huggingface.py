"""Hugging Face interop: ``import-hf``, ``export-hf``, ``--init-from`` and :func:`load_model`.

A model's weights come from a *source*: a Hugging Face directory (``config.json`` and
``model.safetensors``, or shards listed by ``model.safetensors.index.json``) or a
gridtrain checkpoint. Either way a source offers the model's
:class:`~gridtrain.config.ModelConfig`, its tokenizer file when it has one, and its
tensors by gridtrain's global names, made one at a time on demand (a Hugging Face
source converts each through its architecture's table in
:mod:`gridtrain.models.hf_mapping`). Everything here is built on that one view:

* ``import-hf`` writes the source's tensors, in turn, into one checkpoint file
  (:class:`~gridtrain.checkpoint.tensor_files.StreamingWriter`) and seals it as a step-0
  checkpoint without optimizer state (:func:`gridtrain.checkpoint.write_weights_checkpoint`),
  the tokenizer beside it;
* ``export-hf`` walks the table the other way, shard by shard;
* ``--init-from`` fills each rank's pieces from the source in
  :func:`gridtrain.training.trainer.build` (weights only, step 0, a fresh optimizer);
* :func:`load_model` builds the whole model in one process.

So no conversion holds two copies of a model: a tensor is read, converted and written
(or copied into its parameter) before the next is read; :func:`load_model` builds on the meta device and holds the
model it returns and one tensor besides. ``--init-from`` reads, on each rank, only the
pieces that rank owns (checkpoint/materialise.py): as slices of the stored tensors where
a rule is a renaming or a transposition (:meth:`ConvertedTensors.box`).

A Hugging Face directory is checked whole before anything is written or any process
starts (:meth:`HFDirectory.check`): config, index, every tensor the table needs present
with its shape, no tensor left over that the table does not know (an architecture
variant gridtrain would silently drop). Every problem is one :class:`HFError` line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from gridtrain import checkpoint
from gridtrain.checkpoint.materialise import Stored, materialise
from gridtrain.checkpoint.reader import weight_tensors
from gridtrain.checkpoint.sharded import model_buffers
from gridtrain.config import Config, ModelConfig
from gridtrain.data import ByteTokenizer, load_tokenizer
from gridtrain.models.hf_mapping import SAME, TRANSPOSE, HFError, Rule, architecture_for, architecture_of, model_config_from_hf
from gridtrain.models.decoder import Decoder
from gridtrain.checkpoint.tensor_files import StreamingWriter, TensorFiles, TensorSpec, nbytes, plan_of
from gridtrain.parallel.tensor_parallel import TensorParallel

__all__ = ["HFError", "export_hf", "import_hf", "load_model", "open_source", "apply_init_from"]

CONFIG, WEIGHTS, INDEX, TOKENIZER = "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json"
DEFAULT_MAX_SHARD = 5 * 10 ** 9  # bytes, as Hugging Face counts "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}
_DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def parse_size(text: str) -> int:
    """``5GB`` (decimal, as Hugging Face writes sizes), ``500MiB``, or bytes."""
    raw = str(text).strip().upper().replace(" ", "")
    digits = raw.rstrip("KMGTIB")
    unit = raw[len(digits):]
    try:
        value = float(digits) * _UNITS[unit]
    except (ValueError, KeyError):
        raise HFError(f"--max-shard-size {text}: not a size; write e.g. 5GB, 500MB or 2GiB") from None
    if value < 1:
        raise HFError(f"--max-shard-size {text}: must be at least one byte")
    return int(value)


def expected_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``m`` holds, with its shape (no vocabulary padding):
    the weights and the persistent buffers (a MoE layer's expert bias); built on the
    meta device, so nothing is allocated."""
    with torch.device("meta"):
        model = Decoder(m)
    shapes = {name: (getattr(p, "vocab_rows", p.shape[0]), *p.shape[1:]) for name, p in model.named_parameters()
              if not getattr(p, "tied_copy", False)}
    return {**shapes, **{name: tuple(b.shape) for name, b in model_buffers(model)}}


# ---- sources: Hugging Face directories and gridtrain checkpoints -------------------------------


def is_hf_dir(path: str | Path) -> bool:
    """A directory with a config.json that is not a gridtrain checkpoint."""
    p = Path(path)
    return (p / CONFIG).is_file() and not any((p / n).exists() for n in (checkpoint.META, checkpoint.MANIFEST,
                                                                       checkpoint.LATEST))


class ConvertedTensors(Mapping):
    """A Hugging Face directory's tensors by gridtrain name, each converted when asked for
    (one expert of a stack of them read from its slice of the stored tensor)."""

    def __init__(self, directory: "HFDirectory"):
        self.directory = directory
        self.rule_of = {name: r for r in directory.rules for name in r.ours}

    def __getitem__(self, name: str) -> torch.Tensor:
        r = self.rule_of[name]
        if r.transform.part is not None:
            return r.transform.part([self.directory.view(n) for n in r.theirs], self.directory.model,
                                    r.ours.index(name))
        return self.directory.convert(r)[r.ours.index(name)]

    def box(self, name: str, box: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor | None:
        """Only the elements of ``box`` (offsets, sizes) of gridtrain's tensor, read as a
        slice of the stored one where the rule is a renaming or a transposition; None
        where the tensor must be converted whole."""
        r = self.rule_of[name]
        if len(r.theirs) != 1 or r.transform not in (SAME, TRANSPOSE):
            return None
        stored = self.directory.stored_name(r.theirs[0])
        if r.transform is SAME:
            return self.directory.files.box(stored, box)
        return self.directory.files.box(stored, (box[0][::-1], box[1][::-1])).t()

    def __contains__(self, name: object) -> bool:
        return name in self.rule_of

    def __iter__(self) -> Iterator[str]:
        return iter(self.rule_of)

    def __len__(self) -> int:
        return len(self.rule_of)


class HFDirectory:
    """A Hugging Face model directory as a source (see the module docstring)."""

    def __init__(self, path: str | Path, flag: str = "import-hf"):
        self.path = Path(path)
        self.where = f"{flag} {path}"
        self.config = self._read_config()
        self.arch = architecture_for(self.config)
        self.model = model_config_from_hf(self.config)
        self.files = self._tensor_files()
        self.model = self._present_depths(self.model)
        self.layout = self._layout()
        self.rules = self.arch.rules_for(self.model, self.layout, self.config)
        self.tensors = ConvertedTensors(self)
        self.tokenizer = self.path / TOKENIZER if (self.path / TOKENIZER).is_file() else None

    def _fail(self, what: str) -> HFError:
        return HFError(f"{self.where}: {what}")

    def _read_config(self) -> dict[str, Any]:
        if not self.path.is_dir():
            raise self._fail("does not exist" if not self.path.exists() else "is not a directory")
        if not (self.path / CONFIG).is_file():
            raise self._fail(f"no {CONFIG}, so not a Hugging Face model directory; pass the directory "
                             "save_pretrained wrote")
        try:
            config = json.loads((self.path / CONFIG).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise self._fail(f"{CONFIG} cannot be read ({_first_line(exc)}); fix or re-save it") from None
        if not isinstance(config, dict):
            raise self._fail(f"{CONFIG} is not a JSON object; fix or re-save it")
        return config

    def _tensor_files(self) -> TensorFiles:
        index = self.path / INDEX
        if index.is_file():
            where = self._read_index(index)
        elif (self.path / WEIGHTS).is_file():
            where = {name: self.path / WEIGHTS for name in self._names_in(self.path / WEIGHTS)}
        else:
            other = [p.name for p in self.path.glob("*.bin")] + [p.name for p in self.path.glob("*.pt*")]
            hint = (f" ({other[0]} is a pickle: gridtrain reads safetensors only; re-save it with "
                    "save_pretrained(..., safe_serialization=True))") if other else ""
            raise self._fail(f"no {WEIGHTS} and no {INDEX}{hint}")
        return TensorFiles(where)

    def _names_in(self, file: Path) -> list[str]:
        try:
            return list(TensorFiles.of_files([file]).names())
        except Exception as exc:  # safetensors raises its own error types for damaged files
            raise self._fail(f"{file.name} cannot be read ({type(exc).__name__}: {_first_line(exc)}); "
                             "re-download or re-save it") from None

    def _read_index(self, index: Path) -> dict[str, Path]:
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
            raise self._fail(f"{INDEX} cannot be read ({_first_line(exc)}); fix or re-save it") from None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise self._fail(f"{INDEX} has no weight_map of tensor names to file names; fix or re-save it")
        where: dict[str, Path] = {}
        for file_name in sorted(set(weight_map.values())):
            file = self.path / file_name
            if "/" in file_name or "\\" in file_name or not file.is_file():
                raise self._fail(f"{INDEX} names {file_name!r}, which is not a file in this directory; "
                                 "the download is incomplete or the index is wrong")
            stored = set(self._names_in(file))
            listed = sorted(n for n, f in weight_map.items() if f == file_name)
            absent = [n for n in listed if n not in stored]
            if absent:
                raise self._fail(f"{INDEX} puts {absent[0]} in {file_name}, which does not hold it; "
                                 "the index is wrong or the shard is from another model")
            where.update((n, file) for n in listed)
        return where

    def _present_depths(self, m: ModelConfig) -> ModelConfig:
        """The model with the multi-token prediction modules these files hold: config.json
        counts the modules its model was trained with, and files saved without them
        (transformers' own save_pretrained: its model has none) are the main model alone."""
        probe = self.arch.depth_probe
        if probe is None or not getattr(m, "mtp_layers", 0):
            return m
        held = 0
        while held < m.mtp_layers and self.stored_name(probe.replace("{J}", str(m.n_layer + held))) is not None:
            held += 1
        return dataclasses.replace(m, mtp_layers=held)

    def _layout(self) -> str:
        """The first of the architecture's file layouts whose own tensors (those of rules
        marked with it) are all stored here; else the first layout, which check() then
        finds wanting. (Mixtures of experts: one tensor per expert, or transformers 5's
        stacks.)"""
        for layout in self.arch.layouts:
            own = [n for r in self.arch.rules_for(self.model, layout, self.config) if r.layout == layout
                   for n in r.theirs]
            if own and all(self.stored_name(n) is not None for n in own):
                return layout
        return self.arch.layouts[0]

    def view(self, name: str):
        """The stored tensor as a safetensors slice: indexing it reads only those rows."""
        return self.files._file(self.stored_name(name)).get_slice(self.stored_name(name))

    def stored_name(self, name: str) -> str | None:
        """The name a table entry has in these files (some lack the optional prefix)."""
        if name in self.files:
            return name
        short = name.removeprefix(self.arch.optional_prefix) if self.arch.optional_prefix else name
        return short if short in self.files else None

    def convert(self, r: Rule) -> list[torch.Tensor]:
        return r.transform.from_hf([self.files.get(self.stored_name(n)) for n in r.theirs], self.model)

    def check(self) -> "HFDirectory":
        """Every tensor the table needs is there with the right shape, and no other weight."""
        expected = expected_shapes(self.model)
        used: set[str] = set()
        what = f"a {self.arch.model_type} with n_layer {self.model.n_layer}"
        for r in self.rules:
            stored = [self.stored_name(n) for n in r.theirs]
            if None in stored:
                missing = r.theirs[stored.index(None)]
                raise self._fail(f"the weights have no tensor {missing}, which {what} needs; "
                                 f"the weights do not match {CONFIG}")
            used.update(stored)
            outs = r.transform.from_hf([self.files.meta(n) for n in stored], self.model)
            shown = ", ".join(f"{n} {tuple(self.files.spec(n)[1])}" for n in stored)
            for name, out in zip(r.ours, outs):
                if tuple(out.shape) != expected[name]:
                    raise self._fail(f"{shown}: does not fit the model {CONFIG} describes (its {name} is "
                                     f"{expected[name]}); the weights do not match {CONFIG}")
                if not out.dtype.is_floating_point:
                    raise self._fail(f"{shown}: {out.dtype}, not floating-point weights")
        unknown = sorted(n for n in self.files.names() if n not in used and not self.arch.is_ignored(n, self.model))
        if unknown:
            raise self._fail(f"the weights hold {len(unknown)} tensor(s) gridtrain's {self.arch.name} has no "
                             f"place for ({', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}); "
                             "this variant of the architecture is not supported")
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.files.spec(self.stored_name(self.rules[0].theirs[0]))[0]


class CheckpointSource:
    """A gridtrain checkpoint as a source: tensors are already by global name."""

    def __init__(self, path: str | Path, flag: str = "--load", verify_data: bool = True):
        self.path = path
        self.where = f"{flag} {path}"
        self.step = checkpoint.check_loadable(path, flag=flag, verify_data=verify_data)
        self.config = Config.from_dict(checkpoint.read_meta(self.step)["config"])
        self.model = checkpoint.saved_model(self.step, flag)
        self.files = weight_tensors(self.step)  # either format, one tensor at a time
        self.tensors = self.files
        own = self.step / TOKENIZER
        listed = own.is_file() and TOKENIZER in json.loads((self.step / checkpoint.MANIFEST).read_text())["files"]
        given = self.config.data.tokenizer
        self.tokenizer = own if listed else (Path(given) if given not in (None, "byte") else None)

    @property
    def dtype(self) -> torch.dtype:
        return self.files.spec("embedding.word.weight")[0]


Source = HFDirectory | CheckpointSource


def open_source(path: str | Path, flag: str = "--load", *, verify_data: bool = True) -> Source:
    """A Hugging Face directory (checked whole) or a gridtrain checkpoint (checked by
    its manifest) at ``path``; one-line HFError or CheckpointError otherwise."""
    p = Path(path)
    if is_hf_dir(p):
        return HFDirectory(p, flag).check()
    if p.is_dir() and not ((p / checkpoint.LATEST).exists() or (p / checkpoint.META).exists()
                           or any(p.glob("step_*"))):
        raise HFError(f"{flag} {path}: no checkpoint there: neither a Hugging Face model directory (no {CONFIG}) nor a gridtrain "
                      f"checkpoint (no {checkpoint.LATEST} or {checkpoint.META}); pass one of those")
    return CheckpointSource(p, flag, verify_data)


def source_tokenizer(source: Source, override: str | None = None):
    """The tokenizer that goes with a source's model: ``override``, else the source's
    ``tokenizer.json``, else bytes (refused for a vocabulary bytes do not fit)."""
    path = override or source.tokenizer
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size > source.model.vocab_size:
        raise HFError(f"{source.where}: no tokenizer.json, and the byte tokenizer's {tokenizer.vocab_size} tokens "
                      f"do not fit its vocabulary of {source.model.vocab_size}; pass --tokenizer")
    return tokenizer


# ---- import ------------------------------------------------------------------------------------


def import_hf(hf_dir: str | Path, out: str | Path) -> Path:
    """Write the Hugging Face model in ``hf_dir`` as a gridtrain checkpoint (step 0, no
    optimizer state, its tokenizer.json beside the weights) in the save directory
    ``out``; returns the step directory."""
    source = HFDirectory(hf_dir).check()
    _check_new_save_dir(out)
    cfg = Config(model=source.model, preset="")
    plan = plan_of((name, out_) for r in source.rules
                   for name, out_ in zip(r.ours, r.transform.from_hf([source.files.meta(source.stored_name(n))
                                                                      for n in r.theirs], source.model)))

    def write(tmp: Path) -> None:
        with StreamingWriter(tmp / "model-pp000.safetensors", plan, {"format": "gridtrain"}) as writer:
            for r in source.rules:
                for name, tensor in zip(r.ours, source.convert(r)):
                    writer.write(name, tensor)
        if source.tokenizer is not None:
            shutil.copyfile(source.tokenizer, tmp / TOKENIZER)

    return checkpoint.write_weights_checkpoint(out, 0, cfg, write)


def _check_new_save_dir(out: str | Path) -> None:
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise HFError(f"--out {out}: exists and is not an empty directory; choose a new directory")
    ancestor = path.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise HFError(f"--out {out}: cannot be created ({ancestor} is not a writable directory); choose another path")


# ---- export ------------------------------------------------------------------------------------


def _shards(specs: list[TensorSpec], limit: int) -> list[list[TensorSpec]]:
    """Consecutive runs of tensors of at most ``limit`` bytes (a larger tensor alone)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + nbytes(spec) > limit:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes(spec)
    return shards


def export_hf(load: str | Path, out: str | Path, max_shard_size: int = DEFAULT_MAX_SHARD) -> Path:
    """Write the checkpoint ``load`` as a Hugging Face directory ``out`` that
    ``AutoModelForCausalLM.from_pretrained`` reads: config.json, the weights (sharded
    above ``max_shard_size`` bytes, with model.safetensors.index.json) and the run's
    tokenizer when it had one. Returns ``out``."""
    source = CheckpointSource(load)
    arch = architecture_of(source.model)
    m, files = source.model, source.files
    config = {**arch.to_hf_config(m), "dtype": _DTYPE_NAMES.get(source.dtype, "float32")}  # refusals before any write
    rules = arch.rules_for(m)
    specs = plan_of((name, t) for r in rules
                    for name, t in zip(r.theirs, r.transform.to_hf([files.meta(n) for n in r.ours], m)))
    shards = _shards(specs, max_shard_size)
    names = ([WEIGHTS] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    for stale in [*path.glob("model-*-of-*.safetensors"), path / WEIGHTS, path / INDEX]:
        stale.unlink(missing_ok=True)  # a former export's shards would mix with these
    converted = ((name, t) for r in rules for name, t in zip(r.theirs, r.transform.to_hf([files.get(n) for n in r.ours], m)))
    for file_name, plan in zip(names, shards):
        with StreamingWriter(path / file_name, plan, {"format": "pt"}) as writer:
            for _ in plan:
                writer.write(*next(converted))
    if len(shards) > 1:
        weight_map = {spec[0]: file_name for file_name, plan in zip(names, shards) for spec in plan}
        index = {"metadata": {"total_size": sum(map(nbytes, specs))}, "weight_map": weight_map}
        (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    tokenizer = _export_tokenizer(source, path)
    if tokenizer is None and m.vocab_size == ByteTokenizer.vocab_size:
        tokenizer = ByteTokenizer()  # a byte-level run: its end-of-text token is 256
    eot = tokenizer.eot_id if tokenizer is not None else None
    config.update(bos_token_id=eot, eos_token_id=eot)  # not GPT-2's 50256 where the vocabulary is other
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return path


def _export_tokenizer(source: CheckpointSource, path: Path):
    """Copy the run's tokenizer.json with a tokenizer_config.json (so that
    ``AutoTokenizer`` reads it too); None for byte-level runs, which have no file."""
    if source.tokenizer is None:
        return None
    if not source.tokenizer.is_file():
        raise HFError(f"{source.where}: the run's tokenizer {source.tokenizer} no longer exists; put it back "
                      "or copy it into the export yourself")
    tokenizer = load_tokenizer(source.tokenizer)
    if source.tokenizer.resolve() != (path / TOKENIZER).resolve():
        shutil.copyfile(source.tokenizer, path / TOKENIZER)
    eot = tokenizer.token(tokenizer.eot_id) if tokenizer.eot_id is not None else None
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": source.model.seq_len,
                **({"bos_token": eot, "eos_token": eot} if eot else {})}
    (path / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return tokenizer


# ---- loading and fine-tuning ---------------------------------------------------------------------


def load_model(path: str | Path, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None) -> Decoder:
    """The whole model of a gridtrain checkpoint or a Hugging Face directory, in one
    process: an ``nn.Module`` whose ``forward(tokens)`` returns logits ``[b, s, vocab]``
    (and per-token losses given labels). ``dtype`` defaults to fp32, ``device`` to the CPU;
    dropout is off and attention is torch's fused kernel."""
    source = open_source(path, "load_model")
    with torch.device("meta"):
        model = Decoder(dataclasses.replace(source.model, dropout=0.0, attention="sdpa"))
    materialise(model, Stored(source.tensors, source.where), device=device or "cpu", dtype=dtype or torch.float32,
                tp=TensorParallel())
    return model.eval()


_SHAPE_FLAGS = {"n_layer": "--n-layer", "n_head": "--n-head", "d_model": "--d-model", "seq_len": "--seq-len",
                "vocab_size": "--vocab-size"}
_RUN_FIELDS = ("dropout", "attention", "vocab_pad_multiple")  # the run's own, whatever the source
# the run's where it sets them, else the source's: training choices, and the multi-token prediction
# modules, which the main model does not read (a source without them: drawn, materialise.Stored's
# fresh; a run without them: the source's are not read); and --seq-len for a rotary model, which has no
# position weights
_TRAINING_FIELDS = ("moe_aux_loss_coeff", "moe_capacity_factor", "moe_seq_aux_loss_coeff", "moe_expert_bias_rate",
                    "mtp_layers", "mtp_loss_coeff")


def apply_init_from(cfg: Config, given: set[str] | frozenset[str] = frozenset()) -> Config:
    """``--init-from``: the run's model becomes the source's (dropout, attention and
    padding stay the run's; so do the balancing coefficients, the expert capacity, the
    bias update speed and the multi-token prediction modules where the run sets them:
    training choices, not the main model's shape), and its tokenizer the source's when
    the run names none.
    ``given`` are the model fields the user set (flags, config file, preset): each must
    equal the source's, else one line says which."""
    path = cfg.checkpoint.init_from
    source = open_source(path, "--init-from", verify_data=False)
    own = _RUN_FIELDS + _TRAINING_FIELDS + (("seq_len",) if _rotary(source.model) else ())
    differ = [name for name in sorted(given) if name not in own
              and hasattr(source.model, name) and getattr(source.model, name) != getattr(cfg.model, name)]
    if differ:
        pairs = ", ".join(f"{_SHAPE_FLAGS.get(n, 'model.' + n)} {getattr(cfg.model, n)!r} (source: "
                          f"{getattr(source.model, n)!r})" for n in differ)
        raise HFError(f"--init-from {path}: the run's model contradicts the source's: {pairs}; drop those "
                      "settings (the shape comes from the source) or make them equal")
    kept = {k: getattr(cfg.model, k) for k in _RUN_FIELDS + tuple(f for f in _TRAINING_FIELDS if f in given)}
    if _rotary(source.model) and "seq_len" in given:  # no position weights: any window
        kept.update(seq_len=cfg.model.seq_len, max_positions=source.model.max_positions or source.model.seq_len)
    cfg.model = dataclasses.replace(source.model, **kept)
    if cfg.data.tokenizer is None and source.tokenizer is not None:
        cfg.data.tokenizer = str(Path(source.tokenizer).resolve())
    return cfg


def check_init_from(cfg: Config) -> None:
    """The ``--init-from`` source is whole and holds the run's model (one line if not)."""
    source = open_source(cfg.checkpoint.init_from, "--init-from")
    saved = dataclasses.replace(source.model, seq_len=cfg.model.seq_len) if _rotary(source.model) else source.model
    saved = dataclasses.replace(saved, **{k: getattr(cfg.model, k) for k in _TRAINING_FIELDS if hasattr(saved, k)})
    checkpoint.compare_models(saved, cfg.model, source.where, "run")


def _rotary(m: ModelConfig) -> bool:
    """A model without position weights (Llama's rotary positions): its window is free."""
    return getattr(m, "arch", "gpt2") == "llama"


def _first_line(exc: BaseException) -> str:
    return checkpoint.first_line(exc)
