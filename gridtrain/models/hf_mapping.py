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

Mixtures of experts (Mixtral, Qwen3-MoE, OLMoE) add two things. Names may also hold
``{e}`` (one rule per expert) or ``{experts}`` (the name repeated for every expert, in
order, inside one rule), and a per-layer rule may apply to some layers only (``layers``:
a MoE layer's router and experts, a dense layer's MLP). And their files come in two
*layouts* (``Architecture.layouts``): the Hub's, one tensor per expert and matrix
(``block_sparse_moe.experts.3.w1.weight``, ``mlp.experts.3.gate_proj.weight``), which
transformers 4 and 5 both read and write and which export writes; and transformers 5's
own in-memory one, which ``save_pretrained(..., save_original_format=False)`` writes:
every expert of a layer in one tensor, ``experts.gate_up_proj`` ``[E, 2H, d]`` (each
expert's gate rows, then its up rows) and ``experts.down_proj`` ``[E, d, H]``. A rule
marked with a layout applies only to files in it; the reader picks the layout whose
tensors the files hold. Those stacked rules make one expert's tensor from its rows of
the stored stack (``Transform.part``), so loading a model reads each expert's rows, not
the whole stack once per expert.

DeepSeek-V3 and V2 (docs/hf.md) add three more. A rule may apply only to files whose
``config.json`` says so (``source``; export writes ``{}``'s choice): DeepSeek stores the
rotary rows of its query and key/value projections interleaved (``rope_interleave``),
gridtrain holds them in halves, and a row permutation (:func:`_rotary_rows`) turns one
into the other. Names may hold ``{j}``, a multi-token prediction module, and ``{J}``, the
layer DeepSeek's files store it as (``n_layer + j``); the module's block has a block's
rules (:func:`_depth`). And how many modules a directory holds is seen in its files
(``Architecture.depth_probe``): transformers saves a DeepSeek-V3 without them.
"""

from __future__ import annotations

import dataclasses
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
    """Inverse functions between a rule's gridtrain tensors and its Hugging Face tensors.
    ``part(views, m, j)``, where given, makes only the rule's ``j``-th gridtrain tensor
    from indexable views of the Hugging Face tensors (safetensors slices: only the rows
    asked for are read)."""

    name: str
    to_hf: Callable[[Tensors, ModelConfig], Tensors]
    from_hf: Callable[[Tensors, ModelConfig], Tensors]
    part: Callable[[list[Any], ModelConfig, int], torch.Tensor] | None = None


SAME = Transform("same", lambda ts, m: ts, lambda ts, m: ts)
# Hugging Face's GPT-2 Conv1D keeps weights as [in, out]; gridtrain's linears as [out, in].
TRANSPOSE = Transform("transpose", lambda ts, m: [t.t() for t in ts], lambda ts, m: [t.t() for t in ts])


def concat(sizes: Callable[[ModelConfig], Sequence[int]], dim: int = 0) -> Transform:
    """One gridtrain tensor that is several Hugging Face tensors side by side along
    ``dim`` (their sizes there, from the model): e.g. a fused QKV from q, k, v."""
    return Transform(f"concat{dim}",
                     lambda ts, m: list(torch.split(ts[0], list(sizes(m)), dim=dim)),
                     lambda ts, m: [torch.cat(ts, dim=dim)])


def _expert_stack() -> Transform:
    """E experts' tensors <-> one ``[E, ...]`` tensor (transformers 5's ``down_proj``)."""
    return Transform("stack", lambda ts, m: [torch.stack(ts)], lambda ts, m: [t.contiguous() for t in ts[0].unbind(0)],
                     part=lambda views, m, j: views[0][j])


def _gate_up_stack() -> Transform:
    """E experts' gate weights then their up weights <-> one ``[E, 2H, d]`` tensor, each
    expert's gate rows before its up rows (transformers 5's ``gate_up_proj``)."""
    def to_hf(ts: Tensors, m: ModelConfig) -> Tensors:
        e = m.n_experts
        return [torch.cat([torch.stack(ts[:e]), torch.stack(ts[e:])], dim=1)]

    def from_hf(ts: Tensors, m: ModelConfig) -> Tensors:
        gate, up = ts[0].split(ts[0].shape[1] // 2, dim=1)
        return [t.contiguous() for t in (*gate.unbind(0), *up.unbind(0))]

    def part(views: list[Any], m: ModelConfig, j: int) -> torch.Tensor:
        e, h = m.n_experts, m.moe_ffn_size
        return views[0][j, :h] if j < e else views[0][j - e, h:]

    return Transform("gate-up-stack", to_hf, from_hf, part)


STACK, GATE_UP_STACK = _expert_stack(), _gate_up_stack()

LayerTest = Callable[[ModelConfig, int], bool]


@dataclass(frozen=True)
class Rule:
    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    transform: Transform = SAME
    when: Callable[[ModelConfig], bool] | None = None
    layers: LayerTest | None = None  # a per-layer rule: the layers it applies to (None: all)
    layout: str | None = None  # only for files in this layout (None: every layout)
    source: Callable[[dict[str, Any]], bool] | None = None  # only for files whose config.json passes ({}: export)

    def applies(self, m: ModelConfig) -> bool:
        return self.when is None or self.when(m)

    def concrete(self, m: ModelConfig, i: int | None = None, e: int | None = None, j: int | None = None) -> "Rule":
        """The rule with ``{i}``, ``{e}``, ``{j}`` (a multi-token prediction depth) and
        ``{J}`` (that depth's layer in Hugging Face's files, ``n_layer + j``) filled in
        and ``{experts}`` names repeated for every expert of ``m``."""
        def names(templates: tuple[str, ...]) -> tuple[str, ...]:
            out: list[str] = []
            for n in templates:
                n = n.replace("{i}", str(i)) if i is not None else n
                n = n.replace("{e}", str(e)) if e is not None else n
                if j is not None:
                    n = n.replace("{j}", str(j)).replace("{J}", str(m.n_layer + j))
                if "{experts}" in n:
                    out.extend(n.replace("{experts}", str(k)) for k in range(m.n_experts))
                else:
                    out.append(n)
            return tuple(out)
        return dataclasses.replace(self, ours=names(self.ours), theirs=names(self.theirs))

    @property
    def per_layer(self) -> bool:
        return any("{i}" in n for n in self.ours + self.theirs)

    @property
    def per_expert(self) -> bool:
        return any("{e}" in n for n in self.ours + self.theirs)

    @property
    def per_depth(self) -> bool:
        """A rule of each multi-token prediction module (``{j}``); its layer test is asked
        about the module's block, global layer ``n_layer + j``."""
        return any("{j}" in n for n in self.ours)


def rule(ours: str | tuple[str, ...], theirs: str | tuple[str, ...], transform: Transform = SAME,
         when: Callable[[ModelConfig], bool] | None = None, *, layers: LayerTest | None = None,
         layout: str | None = None, source: Callable[[dict[str, Any]], bool] | None = None) -> Rule:
    as_tuple = lambda x: (x,) if isinstance(x, str) else tuple(x)  # noqa: E731
    return Rule(as_tuple(ours), as_tuple(theirs), transform, when, layers, layout, source)


@dataclass(frozen=True)
class Architecture:
    """One model family's mapping (see the module docstring)."""

    name: str  # how messages name it (the family)
    model_type: str  # config.json's "model_type"
    hf_class: str  # config.json's "architectures"
    rules: tuple[Rule, ...]
    from_hf_config: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> ModelConfig fields
    to_hf_config: Callable[[ModelConfig], dict[str, Any]]
    optional_prefix: str = ""  # a prefix of the table's names that some files leave out
    ignored: tuple[tuple[str, Callable[[ModelConfig], bool] | None], ...] = ()  # (regex, when) not weights
    layouts: tuple[str, ...] = ("",)  # the ways files lay the tensors out; export writes the first
    # a tensor every multi-token prediction module has ({J}: its layer in the files), by which a
    # directory shows how many of config.json's modules it holds (None: the family has none)
    depth_probe: str | None = None

    def rules_for(self, m: ModelConfig, layout: str | None = None,
                  config: dict[str, Any] | None = None) -> list[Rule]:
        """The table made concrete for one model, file layout (default: the first) and
        config.json (None: the files export writes): per-layer rules once per layer they
        apply to, per-expert rules once per expert, per-depth rules once per multi-token
        prediction module."""
        layout = self.layouts[0] if layout is None else layout
        out = []
        for r in self.rules:
            if not r.applies(m) or r.layout not in (None, layout) or not (r.source is None or r.source(config or {})):
                continue
            test = r.layers or (lambda m_, i: True)
            if r.per_depth:
                places = [(None, j) for j in range(getattr(m, "mtp_layers", 0)) if test(m, m.n_layer + j)]
            elif r.per_layer:
                places = [(i, None) for i in range(m.n_layer) if test(m, i)]
            else:
                places = [(None, None)]
            experts = range(m.n_experts) if r.per_expert else [None]
            out.extend(r.concrete(m, i, e, j) for i, j in places for e in experts)
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


def _flag(c: dict[str, Any], key: str, default: bool) -> bool:
    value = c.get(key, default)
    if not isinstance(value, bool):
        raise HFError(f"config.json: {key} is {value!r}, expected true or false; fix config.json")
    return value


def _number(c: dict[str, Any], key: str, default: float, where: str = "config.json") -> float:
    value = c.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise HFError(f"{where}: {key} is {value!r}, expected a positive number; fix config.json")
    return float(value)


def _rope_of(c: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """rope_theta, the scaling's type ("default": none) and its parameters, from
    transformers 4's ``rope_theta`` and ``rope_scaling`` or transformers 5's
    ``rope_parameters``."""
    params = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else None
    scaling = c.get("rope_scaling") if c.get("rope_scaling") is not None else params
    theta = _number(params if params and "rope_theta" in params else c, "rope_theta", 10000.0)
    if scaling is None:
        return theta, "default", {}
    if not isinstance(scaling, dict):
        raise HFError(f"config.json: rope_scaling is {scaling!r}, expected an object; fix config.json")
    return theta, scaling.get("rope_type", scaling.get("type", "default")), scaling


def _llama_rope(c: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and Llama 3's scaling (:func:`_rope_of`)."""
    theta, kind, scaling = _rope_of(c)
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


def _llama_common(c: dict[str, Any], *, eps: float = 1e-6, head_dim: int | None = None) -> dict[str, Any]:
    """What every Llama-like config.json says alike (Llama, Qwen3, Mixtral, Qwen3-MoE,
    OLMoE): the shape, norms, rope and tying. ``eps`` and ``head_dim`` are the defaults
    of the family's transformers config (None: hidden_size / num_attention_heads);
    ``attn_head_dim`` is set only where the head width differs from that."""
    _must_be(c, "hidden_act", ("silu",), "silu")
    _must_be(c, "attention_bias", (False,), False)
    _must_be(c, "mlp_bias", (False,), False)
    d, heads = _required(c, "hidden_size"), _required(c, "num_attention_heads")
    kv = c.get("num_key_value_heads")
    kv = heads if kv is None else _required(c, "num_key_value_heads")
    if heads < 1 or kv < 1 or heads % kv:
        raise HFError(f"config.json: num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    width = c.get("head_dim") if c.get("head_dim") is not None else head_dim
    if width is not None:
        width = _required({"head_dim": width}, "head_dim")
    if width is None and d % heads:
        raise HFError(f"config.json: {heads} heads do not divide the hidden size {d}, and no head_dim says their width")
    positions = _required(c, "max_position_embeddings")
    return dict(arch="llama", n_layer=_required(c, "num_hidden_layers"), n_head=heads, n_kv_head=kv, d_model=d,
                attn_head_dim=None if width is None or width * heads == d else width,
                ffn_hidden=_required(c, "intermediate_size"), vocab_size=_required(c, "vocab_size"),
                seq_len=positions, max_positions=positions, layernorm_eps=_number(c, "rms_norm_eps", eps),
                tie_embeddings=bool(c.get("tie_word_embeddings", False)), **_llama_rope(c))


def _llama_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    return _llama_common(c)


def _llama_common_to_hf(m: ModelConfig, hf_class: str, model_type: str) -> dict[str, Any]:
    """The keys every Llama-like config.json has (see :func:`_llama_common`)."""
    scaling = None
    if m.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": m.rope_factor, "low_freq_factor": m.rope_low_freq_factor,
                   "high_freq_factor": m.rope_high_freq_factor,
                   "original_max_position_embeddings": m.rope_original_max_positions}
    return {"architectures": [hf_class], "model_type": model_type, "vocab_size": m.vocab_size,
            "hidden_size": m.d_model, "intermediate_size": m.ffn_size, "num_hidden_layers": m.n_layer,
            "num_attention_heads": m.n_head, "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim,
            "hidden_act": "silu", "max_position_embeddings": m.max_positions or m.seq_len,
            "rms_norm_eps": m.layernorm_eps, "rope_theta": m.rope_theta, "rope_scaling": scaling,
            "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "attention_dropout": m.dropout,
            "initializer_range": 0.02, "use_cache": True}


def _llama_to_hf(m: ModelConfig) -> dict[str, Any]:
    return {**_llama_common_to_hf(m, "LlamaForCausalLM", "llama"), "mlp_bias": False, "pretraining_tp": 1}


def _layer(ours: str, theirs: str, layers: LayerTest | None = None, layout: str | None = None) -> Rule:
    return rule(f"blocks.{{i}}.{ours}.weight", f"model.layers.{{i}}.{theirs}.weight", layers=layers, layout=layout)


def _dense(m: ModelConfig, i: int) -> bool:
    return not m.is_moe_layer(i)


def _sparse(m: ModelConfig, i: int) -> bool:
    return m.is_moe_layer(i)


_EMBEDDING = rule("embedding.word.weight", "model.embed_tokens.weight")
_ATTENTION = (_layer("ln1", "input_layernorm"), _layer("attn.q", "self_attn.q_proj"),
              _layer("attn.k", "self_attn.k_proj"), _layer("attn.v", "self_attn.v_proj"),
              _layer("attn.proj", "self_attn.o_proj"), _layer("ln2", "post_attention_layernorm"))
_QK_NORMS = (_layer("attn.q_norm", "self_attn.q_norm"), _layer("attn.k_norm", "self_attn.k_norm"))
_DENSE_MLP = (_layer("mlp.gate", "mlp.gate_proj", _dense), _layer("mlp.up", "mlp.up_proj", _dense),
              _layer("mlp.down", "mlp.down_proj", _dense))
_ENDS = (rule("final_norm.weight", "model.norm.weight"), rule("head", "lm_head.weight", when=_untied))
_LLAMA_IGNORED = ((r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq", None),  # older files: a buffer
                  (r"lm_head\.weight", _tied))

# Hugging Face's names, one to one; nn.Linear layout on both sides, so nothing is transposed.
LLAMA = Architecture(
    name="llama", model_type="llama", hf_class="LlamaForCausalLM",
    rules=(_EMBEDDING, *_ATTENTION, *_DENSE_MLP, *_ENDS),
    from_hf_config=_llama_from_hf, to_hf_config=_llama_to_hf, ignored=_LLAMA_IGNORED,
)

# ---- Qwen3: Llama with per-head query/key norms and its own head width ---------------------------


def _no_sliding_window(c: dict[str, Any]) -> None:
    """Qwen's sliding-window attention (use_sliding_window, layer_types): refused."""
    _must_be(c, "use_sliding_window", (False,), False)
    kinds = c.get("layer_types") or []
    if any(kind != "full_attention" for kind in kinds):
        raise HFError(f"config.json: layer_types {sorted(set(kinds))} asks for sliding-window attention, which "
                      "gridtrain does not have (every layer attends causally over the whole context)")


def _qwen3_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    _no_sliding_window(c)
    return {**_llama_common(c, head_dim=128), "qk_norm": "head"}  # Qwen3Config's head_dim defaults to 128


def _qwen3_to_hf(m: ModelConfig) -> dict[str, Any]:
    return {**_llama_common_to_hf(m, "Qwen3ForCausalLM", "qwen3"), "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": m.n_layer, "layer_types": ["full_attention"] * m.n_layer}


QWEN3 = Architecture(
    name="qwen3", model_type="qwen3", hf_class="Qwen3ForCausalLM",
    rules=(_EMBEDDING, *_ATTENTION, *_QK_NORMS, *_DENSE_MLP, *_ENDS),
    from_hf_config=_qwen3_from_hf, to_hf_config=_qwen3_to_hf, ignored=_LLAMA_IGNORED,
)

# ---- mixtures of experts: Mixtral, Qwen3-MoE, OLMoE ---------------------------------------------

HUB, FUSED = "per-expert", "fused"  # the two file layouts (module docstring)


def _moe_from_hf(c: dict[str, Any], *, width: int | None, norm_topk: bool, aux: float) -> dict[str, Any]:
    """Experts, top-k, expert width (None: intermediate_size, as Mixtral's and OLMoE's,
    whose every layer is MoE), renormalisation and the load-balancing coefficient.
    The expert count is ``num_experts`` or ``num_local_experts`` (transformers 5 writes
    either for any of the three: each config maps one name to the other)."""
    given = {key: _required(c, key) for key in ("num_experts", "num_local_experts") if c.get(key) is not None}
    if not given:
        raise HFError("config.json: neither num_experts nor num_local_experts says how many experts a layer has; "
                      "fix config.json")
    if len(set(given.values())) > 1:
        raise HFError(f"config.json: num_experts {given['num_experts']} and num_local_experts "
                      f"{given['num_local_experts']} disagree; fix config.json")
    experts, k = next(iter(given.values())), _required(c, "num_experts_per_tok")
    if not 1 <= k <= experts:
        raise HFError(f"config.json: num_experts_per_tok {k} is not between 1 and the {experts} experts")
    coeff = c.get("router_aux_loss_coef", aux)
    if not isinstance(coeff, (int, float)) or isinstance(coeff, bool) or coeff < 0:
        raise HFError(f"config.json: router_aux_loss_coef is {coeff!r}, expected a number >= 0; fix config.json")
    return dict(n_experts=experts, moe_top_k=k, moe_ffn_hidden=width, moe_norm_topk=norm_topk,
                moe_aux_loss_coeff=float(coeff))


def _moe_to_hf(m: ModelConfig, family: str, *, every_layer: bool = True) -> dict[str, Any]:
    """The expert keys of config.json; refuses what the family cannot say (one line)."""
    problem = None
    if m.moe_shared_experts:
        problem = f"{m.moe_shared_experts} shared experts (model.moe_shared_experts), which {family} has not"
    elif every_layer and m.moe_layers != list(range(m.n_layer)):
        problem = f"dense layers between its MoE layers (--moe-every {m.moe_every}); {family} has experts in every layer"
    elif (getattr(m, "moe_router", "softmax") != "softmax" or getattr(m, "moe_groups", 1) != 1
          or getattr(m, "moe_routed_scale", 1.0) != 1.0 or getattr(m, "moe_expert_bias_rate", 0.0)):
        problem = (f"DeepSeek-V3's routing (a sigmoid router, expert groups, a routed scale or a selection bias), "
                   f"which {family} has not")
    if problem:
        raise HFError(f"export-hf: this model has {problem}; it has no Hugging Face counterpart gridtrain writes")
    return {"num_experts_per_tok": m.moe_top_k, "router_aux_loss_coef": m.moe_aux_loss_coeff,
            "output_router_logits": False}


def _moe_layout_rules(router: str, experts: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """A MoE layer's router and experts in both file layouts: the Hub's, ``router`` and
    ``experts.{e}.{gate,up,down}``; transformers 5's, ``mlp.gate`` and the two stacks."""
    return (
        _layer("mlp.router", router, _sparse, HUB),
        _layer("mlp.experts.{e}.gate", f"{experts}.{{e}}.{gate}", _sparse, HUB),
        _layer("mlp.experts.{e}.up", f"{experts}.{{e}}.{up}", _sparse, HUB),
        _layer("mlp.experts.{e}.down", f"{experts}.{{e}}.{down}", _sparse, HUB),
        _layer("mlp.router", "mlp.gate", _sparse, FUSED),
        rule(("blocks.{i}.mlp.experts.{experts}.gate.weight", "blocks.{i}.mlp.experts.{experts}.up.weight"),
             "model.layers.{i}.mlp.experts.gate_up_proj", GATE_UP_STACK, layers=_sparse, layout=FUSED),
        rule("blocks.{i}.mlp.experts.{experts}.down.weight", "model.layers.{i}.mlp.experts.down_proj", STACK,
             layers=_sparse, layout=FUSED),
    )


def _mixtral_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    _must_be(c, "router_jitter_noise", (0.0,), 0.0)
    values = _llama_common(c, eps=1e-5)
    window = c.get("sliding_window")
    if window is not None and window < values["max_positions"]:
        raise HFError(f"config.json: sliding_window {window!r} asks for sliding-window attention, which gridtrain "
                      "does not have; set it to null for a model trained without it")
    return {**values, **_moe_from_hf(c, width=None, norm_topk=True, aux=0.001)}


def _mixtral_to_hf(m: ModelConfig) -> dict[str, Any]:
    if not m.moe_norm_topk:
        raise HFError("export-hf: Mixtral renormalises its top-k routing weights, and this model does not "
                      "(model.moe_norm_topk false); it has no Hugging Face counterpart gridtrain writes")
    return {**_llama_common_to_hf(m, "MixtralForCausalLM", "mixtral"), **_moe_to_hf(m, "Mixtral"),
            "intermediate_size": m.moe_ffn_size, "num_local_experts": m.n_experts, "router_jitter_noise": 0.0,
            "sliding_window": None}


MIXTRAL = Architecture(
    name="mixtral", model_type="mixtral", hf_class="MixtralForCausalLM",
    rules=(_EMBEDDING, *_ATTENTION, *_moe_layout_rules("block_sparse_moe.gate", "block_sparse_moe.experts", "w1",
                                                      "w3", "w2"), *_ENDS),
    from_hf_config=_mixtral_from_hf, to_hf_config=_mixtral_to_hf, ignored=_LLAMA_IGNORED, layouts=(HUB, FUSED),
)


def _moe_every(c: dict[str, Any], layers: int) -> int:
    """Qwen3-MoE's MoE layers (``(i + 1) % decoder_sparse_step == 0`` and not in
    ``mlp_only_layers``) as gridtrain's ``moe_every`` (layers 0, N, 2N, ...), or a one-line
    refusal when they are not such a set."""
    step = _required(c, "decoder_sparse_step") if c.get("decoder_sparse_step") is not None else 1
    dense = c.get("mlp_only_layers") or []
    if step < 1 or not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise HFError(f"config.json: decoder_sparse_step {step!r} / mlp_only_layers {dense!r} are not a step >= 1 "
                      "and a list of layer indices; fix config.json")
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    every = sparse[1] - sparse[0] if len(sparse) > 1 else layers
    if not sparse or sparse != list(range(0, layers, every)):
        raise HFError(f"config.json: decoder_sparse_step {step} and mlp_only_layers {dense} put experts in layers "
                      f"{sparse}; gridtrain's MoE layers are every Nth from layer 0 (0, N, 2N, ...: "
                      "model.moe_every)")
    return every


def _qwen3_moe_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    _no_sliding_window(c)
    values = _llama_common(c)
    moe = _moe_from_hf(c, width=_required(c, "moe_intermediate_size"), norm_topk=_flag(c, "norm_topk_prob", False),
                       aux=0.001)
    return {**values, **moe, "moe_every": _moe_every(c, values["n_layer"]), "qk_norm": "head"}


def _qwen3_moe_to_hf(m: ModelConfig) -> dict[str, Any]:
    return {**_llama_common_to_hf(m, "Qwen3MoeForCausalLM", "qwen3_moe"),
            **_moe_to_hf(m, "Qwen3-MoE", every_layer=False), "num_experts": m.n_experts,
            "moe_intermediate_size": m.moe_ffn_size, "norm_topk_prob": m.moe_norm_topk, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(m.n_layer) if not m.is_moe_layer(i)],
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": m.n_layer}


QWEN3_MOE = Architecture(
    name="qwen3_moe", model_type="qwen3_moe", hf_class="Qwen3MoeForCausalLM",
    rules=(_EMBEDDING, *_ATTENTION, *_QK_NORMS, *_DENSE_MLP,
           *_moe_layout_rules("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj"), *_ENDS),
    from_hf_config=_qwen3_moe_from_hf, to_hf_config=_qwen3_moe_to_hf, ignored=_LLAMA_IGNORED, layouts=(HUB, FUSED),
)


def _olmoe_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    _must_be(c, "clip_qkv", (None,), None)
    values = _llama_common(c, eps=1e-5)
    if values["attn_head_dim"] is not None:  # its k_norm is sized hidden_size / heads x kv heads
        raise HFError(f"config.json: head_dim {c.get('head_dim')!r} is not hidden_size / num_attention_heads "
                      f"({values['d_model']} / {values['n_head']}), which OLMoE's query/key norms need")
    moe = _moe_from_hf(c, width=None, norm_topk=_flag(c, "norm_topk_prob", False), aux=0.01)
    return {**values, **moe, "qk_norm": "full"}


def _olmoe_to_hf(m: ModelConfig) -> dict[str, Any]:
    if m.head_dim * m.n_head != m.d_model:
        raise HFError(f"export-hf: OLMoE's heads are hidden_size / num_attention_heads wide, and this model's are "
                      f"{m.head_dim} (model.attn_head_dim); it has no Hugging Face counterpart gridtrain writes")
    return {**_llama_common_to_hf(m, "OlmoeForCausalLM", "olmoe"), **_moe_to_hf(m, "OLMoE"),
            "intermediate_size": m.moe_ffn_size, "num_experts": m.n_experts, "norm_topk_prob": m.moe_norm_topk,
            "clip_qkv": None}


OLMOE = Architecture(
    name="olmoe", model_type="olmoe", hf_class="OlmoeForCausalLM",
    rules=(_EMBEDDING, *_ATTENTION, *_QK_NORMS,
           *_moe_layout_rules("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj"), *_ENDS),
    from_hf_config=_olmoe_from_hf, to_hf_config=_olmoe_to_hf, ignored=_LLAMA_IGNORED, layouts=(HUB, FUSED),
)

# ---- DeepSeek-V3 and V2: latent attention, shared experts, multi-token prediction ----------------


def _rotary_order(m: ModelConfig, block: int, blocks: int, to_hf: bool) -> torch.Tensor:
    """Row indices that turn DeepSeek's interleaved rotary rows (features 0 1, 2 3, ...
    turned together) into gridtrain's halves (features ``i`` and ``i + r/2`` turned
    together: rows 0 2 4 ... then 1 3 5 ...), or back (``to_hf``), in the last
    ``qk_rope_head_dim`` rows of each of ``blocks`` blocks of ``block`` rows."""
    r = m.qk_rope_head_dim
    halves = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])
    order = torch.argsort(halves) if to_hf else halves
    rows = torch.arange(block * blocks).view(blocks, block)
    return torch.cat([rows[:, :block - r], rows[:, block - r:][:, order]], dim=1).flatten()


def _rotary_rows(query: bool) -> Transform:
    """A query projection (q_proj, q_b_proj: each head's rows are ``[unrotated |
    rotary]``) or the key/value down-projection (kv_a_proj_with_mqa: ``[latent | shared
    rotary key]``), its rotary rows de-interleaved on import and interleaved again on
    export (:func:`_rotary_order`): a permutation of rows, which changes no product
    but the rotation's pairing."""
    def rows(ts: Tensors, m: ModelConfig, to_hf: bool) -> Tensors:
        block, blocks = (m.qk_head_dim, m.n_head) if query else (m.kv_lora_rank + m.qk_rope_head_dim, 1)
        order = _rotary_order(m, block, blocks, to_hf)
        return [ts[0].index_select(0, order.to(ts[0].device))]
    return Transform("rotary-rows", lambda ts, m: rows(ts, m, True), lambda ts, m: rows(ts, m, False))


Q_ROTARY, KV_ROTARY = _rotary_rows(True), _rotary_rows(False)


def _interleaved(c: dict[str, Any]) -> bool:
    """Files whose rotary rows are DeepSeek's interleaved pairs: config.json's
    ``rope_interleave`` (default true, DeepSeek-V3's; DeepSeek-V2 always), and the files
    export writes ({})."""
    return c.get("rope_interleave", True) is not False


def _in_halves(c: dict[str, Any]) -> bool:
    return not _interleaved(c)


def _q_direct(m: ModelConfig) -> bool:
    return not m.q_lora_rank


def _q_compressed(m: ModelConfig) -> bool:
    return bool(m.q_lora_rank)


def _rotary_rule(ours: str, theirs: str, transform: Transform,
                 when: Callable[[ModelConfig], bool] | None = None) -> tuple[Rule, Rule]:
    """A projection with rotary rows, both ways a file may hold it: interleaved
    (DeepSeek's, and what export writes) or already in halves (``rope_interleave`` false)."""
    names = f"blocks.{{i}}.{ours}.weight", f"model.layers.{{i}}.{theirs}.weight"
    return rule(*names, transform, when, source=_interleaved), rule(*names, SAME, when, source=_in_halves)


_LATENT_ATTENTION = (
    _layer("ln1", "input_layernorm"),
    *_rotary_rule("attn.q", "self_attn.q_proj", Q_ROTARY, _q_direct),
    rule("blocks.{i}.attn.q_a.weight", "model.layers.{i}.self_attn.q_a_proj.weight", when=_q_compressed),
    rule("blocks.{i}.attn.q_a_norm.weight", "model.layers.{i}.self_attn.q_a_layernorm.weight", when=_q_compressed),
    *_rotary_rule("attn.q_b", "self_attn.q_b_proj", Q_ROTARY, _q_compressed),
    *_rotary_rule("attn.kv_a", "self_attn.kv_a_proj_with_mqa", KV_ROTARY),
    _layer("attn.kv_a_norm", "self_attn.kv_a_layernorm"),
    _layer("attn.kv_b", "self_attn.kv_b_proj"),
    _layer("attn.proj", "self_attn.o_proj"),
    _layer("ln2", "post_attention_layernorm"),
)
_SHARED_EXPERTS = tuple(rule(f"blocks.{{i}}.mlp.shared.{ours}.weight",
                             f"model.layers.{{i}}.mlp.shared_experts.{ours}_proj.weight",
                             when=lambda m: m.moe_shared_experts > 0, layers=_sparse) for ours in ("gate", "up", "down"))
_EXPERT_BIAS = rule("blocks.{i}.mlp.expert_bias", "model.layers.{i}.mlp.gate.e_score_correction_bias",
                    layers=_sparse)


def _depth(r: Rule) -> Rule:
    """A block's rule as the same rule of a multi-token prediction module's block:
    ``mtp.{j}.block.`` in gridtrain, layer ``n_layer + j`` in DeepSeek's files."""
    return dataclasses.replace(r, ours=tuple(n.replace("blocks.{i}.", "mtp.{j}.block.") for n in r.ours),
                               theirs=tuple(n.replace("model.layers.{i}.", "model.layers.{J}.") for n in r.theirs))


def _deepseek_rules(bias: bool) -> tuple[Rule, ...]:
    """Embedding, blocks (latent attention; dense MLPs in the first layers, then the
    router, the routed experts in either file layout, the shared experts and, with
    ``bias``, the selection bias), the ends, and each multi-token prediction module: its
    norms and projection, and a block of the same rules at layer ``n_layer + j``."""
    block = (*_LATENT_ATTENTION, *_DENSE_MLP,
             *_moe_layout_rules("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj"), *_SHARED_EXPERTS,
             *((_EXPERT_BIAS,) if bias else ()))
    depth = (rule("mtp.{j}.enorm.weight", "model.layers.{J}.enorm.weight"),
             rule("mtp.{j}.hnorm.weight", "model.layers.{J}.hnorm.weight"),
             rule("mtp.{j}.proj.weight", "model.layers.{J}.eh_proj.weight"),
             rule("mtp.{j}.final_norm.weight", "model.layers.{J}.shared_head.norm.weight"))
    return (_EMBEDDING, *block, *_ENDS, *depth, *map(_depth, block))


_DEEPSEEK_IGNORED = (*_LLAMA_IGNORED,  # a multi-token prediction module's copies of the embedding and the head
                     (r"model\.layers\.\d+\.(embed_tokens\.weight|shared_head\.head\.weight)", None))


def _count(c: dict[str, Any], key: str, default: int | None = None, low: int = 0) -> int:
    """An integer key of config.json at least ``low`` (``default`` where absent or null)."""
    value = c.get(key)
    if value is None and default is not None:
        return default
    value = _required(c, key)
    if value < low:
        raise HFError(f"config.json: {key} is {value}, expected at least {low}; fix config.json")
    return value


def _yarn_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and YaRN (``rope_scaling``, or transformers 5's ``rope_parameters``) as
    DeepSeek's code and transformers read them alike: ``mscale`` and ``mscale_all_dim``
    both given or both absent (one alone, the two read it differently)."""
    theta, kind, scaling = _rope_of(c)
    if kind == "default":
        return dict(rope_theta=theta)
    where = "config.json rope_scaling"
    if kind != "yarn":
        raise HFError(f"{where}: type {kind!r} is not supported by gridtrain's latent attention (it supports "
                      "'default', 'yarn')")
    for key, allowed in (("attention_factor", (None,)), ("truncate", (None, True))):
        if scaling.get(key) not in allowed:
            raise HFError(f"{where}: {key} {scaling.get(key)!r} is not supported by gridtrain's YaRN")
    original = _count(scaling, "original_max_position_embeddings", low=1)
    factor = scaling.get("factor")
    factor = _required(c, "max_position_embeddings") / original if factor is None else _number(scaling, "factor", 1.0,
                                                                                                  where)
    given = [key for key in ("mscale", "mscale_all_dim") if scaling.get(key) is not None]
    if len(given) == 1:
        raise HFError(f"{where}: {given[0]} without {({'mscale', 'mscale_all_dim'} - set(given)).pop()}; DeepSeek's "
                      "code and transformers read one alone differently, give both")
    mscale = {key: float(scaling[key]) for key in given}
    if any(v < 0 for v in mscale.values()):
        raise HFError(f"{where}: mscale {mscale} must not be negative; fix config.json")
    return dict(rope_theta=theta, rope_scaling="yarn", rope_factor=float(factor), rope_original_max_positions=original,
                rope_beta_fast=float(scaling.get("beta_fast") or 32.0),  # transformers: a falsy beta is the default
                rope_beta_slow=float(scaling.get("beta_slow") or 1.0), rope_mscale=mscale.get("mscale", 1.0),
                rope_mscale_all_dim=mscale.get("mscale_all_dim", 0.0))


def _deepseek_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    """What DeepSeek-V2 and V3 config.json files say alike: the shape, latent attention,
    rope, the dense first layers and the experts (routed, shared, their scale), and the
    multi-token prediction modules (``num_nextn_predict_layers``: the files hold them or
    not, HFDirectory counts). The balance loss is DeepSeek's sequence-wise one
    (``aux_loss_alpha`` with ``seq_aux``), not the Switch loss."""
    if c.get("quantization_config") is not None:
        raise HFError("config.json: quantization_config says the weights are quantized (DeepSeek's FP8 blocks); "
                      "gridtrain reads floating-point weights: convert them to bf16 first (DeepSeek's "
                      "inference/fp8_cast_bf16.py)")
    for key, allowed, default in (("hidden_act", ("silu",), "silu"), ("attention_bias", (False,), False),
                                  ("mlp_bias", (False,), False), ("moe_layer_freq", (1,), 1)):
        _must_be(c, key, allowed, default)
    d, heads = _required(c, "hidden_size"), _required(c, "num_attention_heads")
    layers = _required(c, "num_hidden_layers")
    kv = c.get("num_key_value_heads")
    if kv is not None and kv != heads:
        raise HFError(f"config.json: num_key_value_heads {kv!r} is not num_attention_heads {heads}: latent attention "
                      "has a key and a value per head; fix config.json")
    positions = _required(c, "max_position_embeddings")
    dense = _count(c, "first_k_dense_replace", 0)
    values = dict(arch="llama", attention_type="mla", n_layer=layers, n_head=heads, d_model=d,
                  vocab_size=_required(c, "vocab_size"), seq_len=positions, max_positions=positions,
                  layernorm_eps=_number(c, "rms_norm_eps", 1e-6), tie_embeddings=_flag(c, "tie_word_embeddings", False),
                  ffn_hidden=_required(c, "intermediate_size"), q_lora_rank=_count(c, "q_lora_rank", 0, low=1),
                  kv_lora_rank=_count(c, "kv_lora_rank", low=1), qk_nope_head_dim=_count(c, "qk_nope_head_dim", low=1),
                  qk_rope_head_dim=_count(c, "qk_rope_head_dim", low=2), v_head_dim=_count(c, "v_head_dim", low=1),
                  **_yarn_from_hf(c))
    if dense >= layers:  # every layer dense: a model without experts
        return values
    experts, k = _count(c, "n_routed_experts", low=1), _count(c, "num_experts_per_tok", low=1)
    if k > experts:
        raise HFError(f"config.json: num_experts_per_tok {k} is not between 1 and the {experts} experts")
    alpha = _number(c, "aux_loss_alpha", 0.001) if c.get("aux_loss_alpha") else 0.0
    return {**values, "n_experts": experts, "moe_top_k": k, "moe_ffn_hidden": _count(c, "moe_intermediate_size", low=1),
            "moe_shared_experts": _count(c, "n_shared_experts", low=1), "moe_dense_layers": dense,
            "moe_routed_scale": _number(c, "routed_scaling_factor", 1.0), "moe_aux_loss_coeff": 0.0,
            "moe_seq_aux_loss_coeff": alpha if _flag(c, "seq_aux", True) else 0.0}


def _deepseek_v3_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    """Sigmoid scores, a selection bias (noaux_tc), groups scored by their two best
    experts, top-k weights renormalised (norm_topk_prob), rotary rows interleaved or not
    (rope_interleave), multi-token prediction modules (num_nextn_predict_layers, or
    transformers' num_mtp_layers)."""
    _must_be(c, "scoring_func", ("sigmoid",), "sigmoid")
    _must_be(c, "topk_method", ("noaux_tc",), "noaux_tc")
    _flag(c, "rope_interleave", True)
    depths = c.get("num_nextn_predict_layers", c.get("num_mtp_layers"))
    values = {**_deepseek_from_hf(c), "mtp_layers": _count({"num_nextn_predict_layers": depths},
                                                           "num_nextn_predict_layers", 0)}
    if not values.get("n_experts"):
        return values
    groups, top = _count(c, "n_group", 1, low=1), _count(c, "topk_group", 1, low=1)
    if values["n_experts"] % groups or top > groups:
        raise HFError(f"config.json: n_group {groups} and topk_group {top} do not split the {values['n_experts']} "
                      "experts into groups and choose some of them; fix config.json")
    return {**values, "moe_router": "sigmoid", "moe_norm_topk": _flag(c, "norm_topk_prob", True), "moe_groups": groups,
            "moe_group_top_k": None if top == groups else top}


def _deepseek_v2_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    """Softmax scores, the top k taken as they are (transformers' DeepseekV2 never
    renormalises them, whatever norm_topk_prob says, so only false is read), no groups
    (topk_method greedy: group_limited_greedy scores a group by its best expert, where
    gridtrain's groups are DeepSeek-V3's, by their two best), always interleaved rotary
    rows, no multi-token prediction."""
    for key, allowed, default in (("scoring_func", ("softmax",), "softmax"), ("topk_method", ("greedy",), "greedy"),
                                  ("norm_topk_prob", (False,), False), ("rope_interleave", (True,), True),
                                  ("num_nextn_predict_layers", (0, None), None)):
        _must_be(c, key, allowed, default)
    values = _deepseek_from_hf(c)
    return {**values, "moe_router": "softmax", "moe_norm_topk": False} if values.get("n_experts") else values


def _deepseek_to_hf(m: ModelConfig, hf_class: str, model_type: str) -> dict[str, Any]:
    """The keys DeepSeek-V2 and V3 config.json files share; refuses what they cannot say.
    A model without experts is one whose every layer is dense (first_k_dense_replace =
    num_hidden_layers). Rotary rows are written interleaved (rope_interleave true)."""
    problem = None
    if m.kv_heads != m.n_head or m.qk_norm is not None:
        problem = "grouped key/value heads or query/key norms, which latent attention has not"
    elif m.n_experts and m.moe_every != 1:
        problem = f"dense layers between its MoE layers (--moe-every {m.moe_every}); DeepSeek's follow its first ones"
    elif m.n_experts and not m.moe_shared_experts:
        problem = "no shared expert, which every DeepSeek MoE layer has"
    elif m.rope_scaling not in (None, "yarn"):
        problem = f"{m.rope_scaling} rope scaling; DeepSeek's is YaRN"
    elif m.rope_scaling == "yarn" and not m.rope_mscale_all_dim and m.rope_mscale != 1.0:
        problem = "YaRN's mscale without mscale_all_dim, which DeepSeek's code reads otherwise than transformers"
    if problem:
        raise HFError(f"export-hf: this model has {problem}; it has no Hugging Face counterpart gridtrain writes")
    scaling = None
    if m.rope_scaling == "yarn":
        scaling = {"type": "yarn", "rope_type": "yarn", "factor": m.rope_factor,
                   "original_max_position_embeddings": m.rope_original_max_positions, "beta_fast": m.rope_beta_fast,
                   "beta_slow": m.rope_beta_slow, "mscale": m.rope_mscale, "mscale_all_dim": m.rope_mscale_all_dim}
    experts = m.n_experts or 1  # all layers dense: the expert keys are not read
    return {"architectures": [hf_class], "model_type": model_type, "vocab_size": m.vocab_size,
            "hidden_size": m.d_model, "intermediate_size": m.ffn_size, "num_hidden_layers": m.n_layer,
            "num_attention_heads": m.n_head, "num_key_value_heads": m.n_head, "hidden_act": "silu",
            "max_position_embeddings": m.max_positions or m.seq_len, "rms_norm_eps": m.layernorm_eps,
            "rope_theta": m.rope_theta, "rope_scaling": scaling, "tie_word_embeddings": m.tie_embeddings,
            "attention_bias": False, "attention_dropout": m.dropout, "initializer_range": 0.02, "use_cache": True,
            "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
            "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim, "head_dim": m.qk_rope_head_dim,
            "first_k_dense_replace": m.moe_dense_layers if m.n_experts else m.n_layer, "moe_layer_freq": 1,
            "n_routed_experts": experts, "num_experts_per_tok": min(m.moe_top_k, experts),
            "moe_intermediate_size": m.moe_ffn_size, "n_shared_experts": m.moe_shared_experts or 1,
            "routed_scaling_factor": m.moe_routed_scale, "aux_loss_alpha": m.moe_seq_aux_loss_coeff,
            "seq_aux": m.moe_seq_aux_loss_coeff > 0, "pretraining_tp": 1, "ep_size": 1}


def _deepseek_v3_to_hf(m: ModelConfig) -> dict[str, Any]:
    groups = m.moe_groups if m.n_experts else 1
    return {**_deepseek_to_hf(m, "DeepseekV3ForCausalLM", "deepseek_v3"), "scoring_func": "sigmoid",
            "topk_method": "noaux_tc", "norm_topk_prob": m.moe_norm_topk, "n_group": groups,
            "topk_group": (m.moe_group_top_k or groups) if m.n_experts else 1, "rope_interleave": True,
            "num_nextn_predict_layers": m.mtp_layers}


def _deepseek_v2_to_hf(m: ModelConfig) -> dict[str, Any]:
    problem = None
    if m.moe_norm_topk or m.moe_groups != 1:
        problem = "renormalised top-k weights or expert groups, which transformers' DeepseekV2 router has not"
    elif m.mtp_layers:
        problem = f"{m.mtp_layers} multi-token prediction modules, which DeepSeek-V2 has not"
    elif m.moe_expert_bias_rate:
        problem = "a selection bias (--moe-expert-bias-rate) with a softmax router, which DeepSeek-V2 has not"
    if problem:
        raise HFError(f"export-hf: this model has {problem}; it has no Hugging Face counterpart gridtrain writes")
    return {**_deepseek_to_hf(m, "DeepseekV2ForCausalLM", "deepseek_v2"), "scoring_func": "softmax",
            "topk_method": "greedy", "norm_topk_prob": False, "n_group": 1, "topk_group": 1}


DEEPSEEK_V3 = Architecture(
    name="deepseek_v3", model_type="deepseek_v3", hf_class="DeepseekV3ForCausalLM", rules=_deepseek_rules(bias=True),
    from_hf_config=_deepseek_v3_from_hf, to_hf_config=_deepseek_v3_to_hf, ignored=_DEEPSEEK_IGNORED,
    layouts=(HUB, FUSED), depth_probe="model.layers.{J}.eh_proj.weight",
)
DEEPSEEK_V2 = Architecture(
    name="deepseek_v2", model_type="deepseek_v2", hf_class="DeepseekV2ForCausalLM", rules=_deepseek_rules(bias=False),
    from_hf_config=_deepseek_v2_from_hf, to_hf_config=_deepseek_v2_to_hf, ignored=_LLAMA_IGNORED,
    layouts=(HUB, FUSED),
)

ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (GPT2, LLAMA, QWEN3, MIXTRAL, QWEN3_MOE, OLMOE,
                                                                     DEEPSEEK_V3, DEEPSEEK_V2)}


def architecture_of(m: ModelConfig) -> Architecture:
    """The Hugging Face family a gridtrain model is written as: GPT-2; a Llama by its
    query/key norms and experts: none (Llama, Mixtral), per head (Qwen3, Qwen3-MoE), over
    the whole projection with experts (OLMoE); with latent attention DeepSeek-V3, or
    DeepSeek-V2 for a softmax router. One line for a model no family fits."""
    arch = getattr(m, "arch", "gpt2")
    experts, qk = getattr(m, "n_experts", 0), getattr(m, "qk_norm", None)
    if getattr(m, "mla", False):
        return DEEPSEEK_V2 if experts and m.moe_router == "softmax" else DEEPSEEK_V3
    if arch == "gpt2":
        if experts:
            raise HFError("export-hf: a GPT-2 with experts has no Hugging Face counterpart gridtrain writes "
                          "(its MoE families are Llama-like: --arch llama)")
        return GPT2
    if arch != "llama":
        raise HFError(f"architecture {arch!r} has no Hugging Face mapping yet (mapped: gpt2, llama)")
    if qk == "full" and not experts:
        raise HFError("export-hf: a dense model with query/key norms over the whole projection (model.qk_norm "
                      "full) has no Hugging Face counterpart gridtrain writes (OLMoE's has experts)")
    return {(False, None): LLAMA, (False, "head"): QWEN3, (True, None): MIXTRAL, (True, "head"): QWEN3_MOE,
            (True, "full"): OLMOE}[(bool(experts), qk)]


def architecture_for(c: dict[str, Any]) -> Architecture:
    """The mapping named by a config.json's ``model_type``, or by its ``architectures``
    where the model type is a publisher's own name for a family's layout (Kimi K2's
    kimi_k2: DeepseekV3ForCausalLM)."""
    model_type = c.get("model_type")
    for arch in ARCHITECTURES.values():
        if arch.model_type == model_type:
            return arch
    classes = c.get("architectures") if isinstance(c.get("architectures"), list) else []
    for arch in (DEEPSEEK_V3,):  # its class is only ever DeepSeek-V3's layout
        if classes == [arch.hf_class]:
            return arch
    known = ", ".join(a.model_type for a in ARCHITECTURES.values())
    raise HFError(f"config.json: model_type {model_type!r} is not an architecture gridtrain knows "
                  f"(it imports {known})")


def model_config_from_hf(c: dict[str, Any]) -> ModelConfig:
    """The gridtrain model a config.json describes; one-line HFError for what does not fit."""
    values = architecture_for(c).from_hf_config(c)
    m = ModelConfig(**values)
    if m.n_head < 1 or (m.d_model % m.n_head and getattr(m, "attn_head_dim", None) is None and not m.mla):
        raise HFError(f"config.json: {m.n_head} heads do not divide the hidden size {m.d_model}")
    return m
