"""How a Hugging Face model's tensors and ``config.json`` correspond to gridtrain's, per
architecture, written as data.

An :class:`Architecture` is a table of :class:`Rule` s plus two config translations.
Each rule pairs some gridtrain tensors (global names, as checkpoints store them: whole,
no vocabulary padding) with some Hugging Face tensors, and a :class:`Transform` that
turns one side into the other. Names may hold ``{i}``, the layer index; a rule may
apply only to some models (``when``: e.g. an untied head). The converters in
:mod:`gridtrain.checkpoint.huggingface` walk a table rule by rule, so a conversion holds one rule's tensors
at a time, whatever the model's size.

GPT-2 needs only one-to-one rules: its Hugging Face checkpoints store linear weights in
``Conv1D`` layout ``[in, out]`` (transposed from ``nn.Linear``'s ``[out, in]``), and
its fused ``c_attn`` is ``[q | k | v]`` along the output, head after head: exactly
gridtrain's ``qkv``, once transposed. Llama's are one to one and not even transposed
(gridtrain keeps ``q``, ``k``, ``v`` and ``gate``, ``up`` as separate tensors, as
Hugging Face does). A fused gridtrain tensor built from several Hugging Face ones would
be a rule with several names on the Hugging Face side and a :func:`concat` transform.

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

# ---- Llama -----------------------------------------------------------------------------------


def _number(c: dict[str, Any], key: str, default: float, where: str = "config.json") -> float:
    value = c.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise HFError(f"{where}: {key} is {value!r}, expected a positive number; fix config.json")
    return float(value)


def _llama_rope(c: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and Llama 3's scaling, from transformers 4's ``rope_theta`` and
    ``rope_scaling`` or transformers 5's ``rope_parameters``."""
    params = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else None
    scaling = c.get("rope_scaling") if c.get("rope_scaling") is not None else params
    theta = _number(params if params and "rope_theta" in params else c, "rope_theta", 10000.0)
    if scaling is None:
        return dict(rope_theta=theta)
    if not isinstance(scaling, dict):
        raise HFError(f"config.json: rope_scaling is {scaling!r}, expected an object; fix config.json")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return dict(rope_theta=theta)
    if kind != "llama3":
        raise HFError(f"config.json: rope_scaling type {kind!r} is not supported by gridtrain's llama "
                      "(it supports 'default', 'llama3')")
    where = "config.json rope_scaling"
    original = scaling.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise HFError(f"{where}: original_max_position_embeddings is {original!r}, expected int; fix config.json")
    return dict(rope_theta=theta, rope_scaling="llama3", rope_factor=_number(scaling, "factor", 8.0, where),
                rope_low_freq_factor=_number(scaling, "low_freq_factor", 1.0, where),
                rope_high_freq_factor=_number(scaling, "high_freq_factor", 4.0, where),
                rope_original_max_positions=original)


def _llama_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    _must_be(c, "hidden_act", ("silu",), "silu")
    _must_be(c, "attention_bias", (False,), False)
    _must_be(c, "mlp_bias", (False,), False)
    d, heads = _required(c, "hidden_size"), _required(c, "num_attention_heads")
    kv = c.get("num_key_value_heads")
    kv = heads if kv is None else _required(c, "num_key_value_heads")
    if kv < 1 or heads % kv:
        raise HFError(f"config.json: num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    head_dim = c.get("head_dim")
    if head_dim is not None and heads and head_dim * heads != d:
        raise HFError(f"config.json: head_dim {head_dim!r} is not hidden_size / num_attention_heads "
                      f"({d} / {heads}); gridtrain's llama needs that")
    positions = _required(c, "max_position_embeddings")
    return dict(arch="llama", n_layer=_required(c, "num_hidden_layers"), n_head=heads, n_kv_head=kv, d_model=d,
                ffn_hidden=_required(c, "intermediate_size"), vocab_size=_required(c, "vocab_size"),
                seq_len=positions, max_positions=positions, layernorm_eps=_number(c, "rms_norm_eps", 1e-6),
                tie_embeddings=bool(c.get("tie_word_embeddings", False)), **_llama_rope(c))


def _llama_to_hf(m: ModelConfig) -> dict[str, Any]:
    scaling = None
    if m.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": m.rope_factor, "low_freq_factor": m.rope_low_freq_factor,
                   "high_freq_factor": m.rope_high_freq_factor,
                   "original_max_position_embeddings": m.rope_original_max_positions}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.vocab_size,
            "hidden_size": m.d_model, "intermediate_size": m.ffn_size, "num_hidden_layers": m.n_layer,
            "num_attention_heads": m.n_head, "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim,
            "hidden_act": "silu", "max_position_embeddings": m.max_positions or m.seq_len,
            "rms_norm_eps": m.layernorm_eps, "rope_theta": m.rope_theta, "rope_scaling": scaling,
            "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "mlp_bias": False,
            "attention_dropout": m.dropout, "pretraining_tp": 1, "initializer_range": 0.02, "use_cache": True}


def _layer(ours: str, theirs: str) -> Rule:
    return rule(f"blocks.{{i}}.{ours}.weight", f"model.layers.{{i}}.{theirs}.weight")


# Hugging Face's names, one to one; nn.Linear layout on both sides, so nothing is transposed.
LLAMA = Architecture(
    name="llama", model_type="llama", hf_class="LlamaForCausalLM",
    rules=(
        rule("embedding.word.weight", "model.embed_tokens.weight"),
        _layer("ln1", "input_layernorm"),
        _layer("attn.q", "self_attn.q_proj"),
        _layer("attn.k", "self_attn.k_proj"),
        _layer("attn.v", "self_attn.v_proj"),
        _layer("attn.proj", "self_attn.o_proj"),
        _layer("ln2", "post_attention_layernorm"),
        _layer("mlp.gate", "mlp.gate_proj"),
        _layer("mlp.up", "mlp.up_proj"),
        _layer("mlp.down", "mlp.down_proj"),
        rule("final_norm.weight", "model.norm.weight"),
        rule("head", "lm_head.weight", when=_untied),
    ),
    from_hf_config=_llama_from_hf, to_hf_config=_llama_to_hf,
    ignored=((r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq", None),  # older files: a buffer
             (r"lm_head\.weight", _tied)),
)

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (GPT2, LLAMA)}


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
    if m.n_head < 1 or m.d_model % m.n_head:
        raise HFError(f"config.json: {m.n_head} heads do not divide the hidden size {m.d_model}")
    return m
