"""How a Hugging Face model's tensors and ``config.json`` correspond to gridtrain's, per
architecture, written as data.

An :class:`Architecture` is a table of :class:`Rule` s plus two config translations.
Each rule pairs some gridtrain tensors (global names, as checkpoints store them: whole,
no vocabulary padding) with some Hugging Face tensors, and a :class:`Transform` that
turns one side into the other. Names may hold ``{i}``, the layer index; a rule may
apply only to some models (``when``: e.g. an untied head). The converters in
:mod:`gridtrain.hf` walk a table rule by rule, so a conversion holds one rule's tensors
at a time, whatever the model's size.

GPT-2 needs only one-to-one rules: its Hugging Face checkpoints store linear weights in
``Conv1D`` layout ``[in, out]`` (transposed from ``nn.Linear``'s ``[out, in]``), and
its fused ``c_attn`` is ``[q | k | v]`` along the output, head after head: exactly
gridtrain's ``qkv``, once transposed. Another architecture adds a table: a fused
gridtrain tensor built from several Hugging Face ones (Llama's ``q_proj``,
``k_proj``, ``v_proj`` into one ``qkv``, if its model fuses them) is a rule with three
names on the Hugging Face side and a :func:`concat` transform.

Files written by older ``transformers`` versions (and the Hub's ``gpt2`` itself) name
GPT-2's tensors without the ``transformer.`` prefix and store the causal-mask buffers
``h.N.attn.bias``: ``optional_prefix`` and ``ignored`` say so.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from gridtrain.config import ModelConfig

Tensors = list[torch.Tensor]


class HFError(ValueError):
    """A Hugging Face directory or config that gridtrain cannot use: one line, with the fix."""


@dataclass(frozen=True)
class Transform:
    """Inverse functions between a rule's gridtrain tensors and its Hugging Face tensors."""

    name: str
    to_hf: Callable[[Tensors, ModelConfig], Tensors]
    from_hf: Callable[[Tensors, ModelConfig], Tensors]


SAME = Transform("same", lambda ts, m: ts, lambda ts, m: ts)
# Hugging Face's GPT-2 Conv1D keeps weights as [in, out]; gridtrain's linears as [out, in].
TRANSPOSE = Transform("transpose", lambda ts, m: [t.t() for t in ts], lambda ts, m: [t.t() for t in ts])


def concat(sizes: Callable[[ModelConfig], Sequence[int]], dim: int = 0) -> Transform:
    """One gridtrain tensor that is several Hugging Face tensors side by side along
    ``dim`` (their sizes there, from the model): e.g. a fused QKV from q, k, v."""
    return Transform(f"concat{dim}",
                     lambda ts, m: list(torch.split(ts[0], list(sizes(m)), dim=dim)),
                     lambda ts, m: [torch.cat(ts, dim=dim)])


@dataclass(frozen=True)
class Rule:
    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    transform: Transform = SAME
    when: Callable[[ModelConfig], bool] | None = None

    def applies(self, m: ModelConfig) -> bool:
        return self.when is None or self.when(m)

    def at_layer(self, i: int) -> "Rule":
        return Rule(tuple(n.format(i=i) for n in self.ours), tuple(n.format(i=i) for n in self.theirs),
                    self.transform, self.when)

    @property
    def per_layer(self) -> bool:
        return any("{i}" in n for n in self.ours + self.theirs)


def rule(ours: str | tuple[str, ...], theirs: str | tuple[str, ...], transform: Transform = SAME,
         when: Callable[[ModelConfig], bool] | None = None) -> Rule:
    as_tuple = lambda x: (x,) if isinstance(x, str) else tuple(x)  # noqa: E731
    return Rule(as_tuple(ours), as_tuple(theirs), transform, when)


@dataclass(frozen=True)
class Architecture:
    """One model family's mapping (see the module docstring)."""

    name: str  # gridtrain's name (--arch)
    model_type: str  # config.json's "model_type"
    hf_class: str  # config.json's "architectures"
    rules: tuple[Rule, ...]
    from_hf_config: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> ModelConfig fields
    to_hf_config: Callable[[ModelConfig], dict[str, Any]]
    optional_prefix: str = ""  # a prefix of the table's names that some files leave out
    ignored: tuple[tuple[str, Callable[[ModelConfig], bool] | None], ...] = ()  # (regex, when) not weights

    def rules_for(self, m: ModelConfig) -> list[Rule]:
        """The table made concrete for one model: per-layer rules once per layer."""
        out = []
        for r in self.rules:
            if not r.applies(m):
                continue
            if r.per_layer:
                out.extend(r.at_layer(i) for i in range(m.n_layer))
            else:
                out.append(r)
        return out

    def is_ignored(self, hf_name: str, m: ModelConfig) -> bool:
        return any(re.fullmatch(pattern, hf_name) and (when is None or when(m)) for pattern, when in self.ignored)


# ---- config.json <-> ModelConfig helpers -------------------------------------------------------


def _required(c: dict[str, Any], key: str, kind: type = int) -> Any:
    value = c.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise HFError(f"config.json: {key} is {value!r}, expected {kind.__name__}; fix config.json")
    return value


def _must_be(c: dict[str, Any], key: str, allowed: Sequence[Any], default: Any) -> None:
    value = c.get(key, default)
    if value not in allowed:
        raise HFError(f"config.json: {key} {value!r} is not supported by gridtrain's {c.get('model_type')} "
                      f"(it supports {', '.join(map(repr, allowed))})")


def with_arch(values: dict[str, Any], arch: str) -> dict[str, Any]:
    """``values`` plus ``arch`` where ModelConfig has that field (the Llama branch adds it)."""
    if "arch" in {f.name for f in fields(ModelConfig)}:
        return {**values, "arch": arch}
    return values


# ---- GPT-2 -----------------------------------------------------------------------------------


def _tied(m: ModelConfig) -> bool:
    return m.tie_embeddings


def _untied(m: ModelConfig) -> bool:
    return not m.tie_embeddings


def _gpt2_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    _must_be(c, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")  # GELU, tanh form
    _must_be(c, "scale_attn_weights", (True,), True)
    _must_be(c, "scale_attn_by_inverse_layer_idx", (False,), False)
    _must_be(c, "add_cross_attention", (False,), False)
    n_inner = c.get("n_inner")
    if n_inner is not None:
        n_inner = _required(c, "n_inner")
    eps = c.get("layer_norm_epsilon", 1e-5)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise HFError(f"config.json: layer_norm_epsilon is {eps!r}, expected a positive number; fix config.json")
    return with_arch(dict(n_layer=_required(c, "n_layer"), n_head=_required(c, "n_head"),
                          d_model=_required(c, "n_embd"), seq_len=_required(c, "n_positions"),
                          vocab_size=_required(c, "vocab_size"), ffn_hidden=n_inner, layernorm_eps=float(eps),
                          tie_embeddings=bool(c.get("tie_word_embeddings", True))), "gpt2")


def _gpt2_to_hf(m: ModelConfig) -> dict[str, Any]:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
            "n_positions": m.seq_len, "n_embd": m.d_model, "n_layer": m.n_layer, "n_head": m.n_head,
            "n_inner": m.ffn_hidden, "activation_function": "gelu_new", "layer_norm_epsilon": m.layernorm_eps,
            "tie_word_embeddings": m.tie_embeddings, "resid_pdrop": m.dropout, "embd_pdrop": m.dropout,
            "attn_pdrop": m.dropout, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "add_cross_attention": False, "initializer_range": 0.02,
            "use_cache": True}


def _with_bias(ours: str, theirs: str, weight: Transform = SAME) -> tuple[Rule, Rule]:
    """A layer's weight (through ``weight``) and its bias (as it is)."""
    return rule(f"{ours}.weight", f"{theirs}.weight", weight), rule(f"{ours}.bias", f"{theirs}.bias")


GPT2 = Architecture(
    name="gpt2", model_type="gpt2", hf_class="GPT2LMHeadModel",
    rules=(
        rule("embedding.word.weight", "transformer.wte.weight"),
        rule("embedding.position.weight", "transformer.wpe.weight"),
        *_with_bias("blocks.{i}.ln1", "transformer.h.{i}.ln_1"),
        *_with_bias("blocks.{i}.attn.qkv", "transformer.h.{i}.attn.c_attn", TRANSPOSE),
        *_with_bias("blocks.{i}.attn.proj", "transformer.h.{i}.attn.c_proj", TRANSPOSE),
        *_with_bias("blocks.{i}.ln2", "transformer.h.{i}.ln_2"),
        *_with_bias("blocks.{i}.mlp.fc", "transformer.h.{i}.mlp.c_fc", TRANSPOSE),
        *_with_bias("blocks.{i}.mlp.proj", "transformer.h.{i}.mlp.c_proj", TRANSPOSE),
        *_with_bias("final_norm", "transformer.ln_f"),
        rule("head", "lm_head.weight", when=_untied),
    ),
    from_hf_config=_gpt2_from_hf, to_hf_config=_gpt2_to_hf, optional_prefix="transformer.",
    ignored=((r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)", None),  # causal-mask buffers
             (r"lm_head\.weight", _tied)),  # a tied head some files store anyway: the embedding
)

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (GPT2,)}


def architecture_of(m: ModelConfig) -> Architecture:
    """The mapping of a gridtrain model (``arch``, GPT-2 where the field does not exist)."""
    name = getattr(m, "arch", "gpt2")
    if name not in ARCHITECTURES:
        raise HFError(f"architecture {name!r} has no Hugging Face mapping yet (mapped: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[name]


def architecture_for(c: dict[str, Any]) -> Architecture:
    """The mapping named by a config.json's ``model_type``."""
    model_type = c.get("model_type")
    for arch in ARCHITECTURES.values():
        if arch.model_type == model_type:
            return arch
    known = ", ".join(a.model_type for a in ARCHITECTURES.values())
    raise HFError(f"config.json: model_type {model_type!r} is not an architecture gridtrain knows "
                  f"(it imports {known})")


def model_config_from_hf(c: dict[str, Any]) -> ModelConfig:
    """The gridtrain model a config.json describes; one-line HFError for what does not fit."""
    values = architecture_for(c).from_hf_config(c)
    m = ModelConfig(**values)
    if m.d_model % m.n_head:
        raise HFError(f"config.json: {m.n_head} heads do not divide the hidden size {m.d_model}")
    return m
