"""MoE and Qwen3/OLMoE model shapes: parameter counts (the published checkpoints', the
modules' at every tp and ep), active parameters and FLOPs; query/key norms and heads
wider or narrower than d_model / n_head, as formulas and under tensor parallelism.

The published counts are those of transformers' own models, built from the published
``config.json`` on the meta device (nothing allocated), so a preset that drifts from the
published shape fails here by the count.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gridtrain.config import ConfigError, ModelConfig, preset_config, set_fields
from gridtrain.models import llama
from gridtrain.models.decoder import (Decoder, active_parameters, block_parameters, count_parameters,
                                      init_parameters, parameter_costs, training_flops_per_token)
from gridtrain.parallel.tensor_parallel import ShardSpec, shard_spec
from gridtrain.training.validate import validate
from tests import test_llama
from tests.training import assert_rank_matches, fake_tp, relative_difference, train_in_process, train_layouts

MOE_TINY = preset_config("moe-tiny").model
# Qwen3's features, small: 12-wide heads beside a 64-wide model (8 x 12 = 96), per-head q/k norms;
# and MoE every second layer with a shared expert
QWENISH = dataclasses.replace(MOE_TINY, n_layer=3, attn_head_dim=12, qk_norm="head", moe_every=2,
                              moe_shared_experts=1, vocab_pad_multiple=1, vocab_size=256)
OLMOISH = dataclasses.replace(MOE_TINY, qk_norm="full", moe_norm_topk=False, vocab_pad_multiple=1, vocab_size=256)
GPT2_MOE = ModelConfig(n_layer=3, n_head=4, d_model=32, seq_len=16, vocab_size=256, vocab_pad_multiple=1,
                       n_experts=4, moe_top_k=2, moe_ffn_hidden=24, moe_every=2, moe_shared_experts=2)

one_thread = test_llama.one_thread  # autouse: in-process runs on one thread, as tests/test_llama.py's


def build(cfg: ModelConfig, seed: int = 0, **kwargs) -> Decoder:
    model = Decoder(cfg, **kwargs)
    init_parameters(model, seed)
    return model


def _numel(model: Decoder, cfg: ModelConfig) -> int:
    """The module's parameters less the vocabulary padding rows (table and untied head)."""
    padding = (model.padded_vocab - cfg.vocab_size) * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    return sum(p.numel() for p in model.parameters()) - padding


# ---- the published sizes ------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

PUBLISHED = {  # preset: (transformers class, config.json of the published checkpoint, parameters, active)
    "mixtral-8x7b": ("MixtralForCausalLM", dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5, router_aux_loss_coef=0.02,
        sliding_window=None, tie_word_embeddings=False), 46_702_792_704, 12_879_925_248),
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, router_aux_loss_coef=0.001,
        use_sliding_window=False, tie_word_embeddings=False), 30_532_122_624, 3_353_032_704),
    "olmoe-1b-7b": ("OlmoeForCausalLM", dict(
        model_type="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=False, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
        router_aux_loss_coef=0.01, clip_qkv=None, tie_word_embeddings=False), 6_919_161_856, 1_282_017_280),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_presets_have_the_published_sizes(name):
    """count_parameters equals transformers' own model of the published config.json
    (built on the meta device: Mixtral 8x7B's 46,702,792,704), and the 'active'
    parameters are the published ones (12.9B, 3.3B, 1.3B)."""
    cls, config, total, active = PUBLISHED[name]
    model_type = config.pop("model_type") if "model_type" in config else None
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **config)
    finally:
        config["model_type"] = model_type
    with torch.device("meta"):
        hf = getattr(transformers, cls)(hf_config)
    cfg = preset_config(name).model
    assert sum(p.numel() for p in hf.parameters()) == total == count_parameters(cfg)
    assert active_parameters(cfg) == active
    assert count_parameters(cfg, exclude_embeddings=True) == total - cfg.vocab_size * cfg.d_model


def test_presets_say_what_the_published_configs_say():
    """The preset is what import-hf makes of the published config.json (the window it
    trains at aside: rotary models take any)."""
    from gridtrain.models.hf_mapping import model_config_from_hf

    for name, (_, config, _, _) in PUBLISHED.items():
        imported = model_config_from_hf(config)
        preset = preset_config(name).model
        assert dataclasses.replace(imported, seq_len=preset.seq_len) == preset, name


# ---- parameter counts of the modules ---------------------------------------------------------------

SHAPES = {"moe-tiny": MOE_TINY, "qwenish": QWENISH, "olmoish": OLMOISH, "gpt2-moe": GPT2_MOE,
          "dense-head-norm": dataclasses.replace(preset_config("llama-tiny").model, qk_norm="head", attn_head_dim=4)}


@pytest.mark.parametrize("shape", SHAPES)
def test_parameter_formulas_count_the_modules(shape):
    """count_parameters is the module's numel; block_parameters each block's, on every tp
    rank (q/k norms whole or split, kv heads replicated at tp 4) and ep rank; the costs
    of --pp-partition parameters are the blocks' own."""
    cfg = SHAPES[shape]
    model = Decoder(cfg)
    assert _numel(model, cfg) == count_parameters(cfg)
    assert parameter_costs(cfg)[0] == [sum(p.numel() for p in b.parameters()) for b in model.blocks.values()]
    for tp in (1, 2, 4):
        for rank in range(tp):
            blocks = Decoder(cfg, tp=fake_tp(tp, rank)).blocks
            for i, block in blocks.items():
                assert sum(p.numel() for p in block.parameters()) == block_parameters(cfg, tp, int(i)), (tp, i)
    if cfg.n_experts:  # half the experts on each of two ep ranks
        experts = sum(p.numel() for n, p in model.blocks["0"].named_parameters() if ".experts." in n)
        assert block_parameters(cfg, layer=0) - block_parameters(cfg, layer=0, ep=2) == experts // 2


def test_active_parameters_take_k_experts_per_moe_layer():
    cfg = QWENISH  # layers 0 and 2 are MoE: 8 experts of 3 x 64 x 32, top 2
    assert count_parameters(cfg) - active_parameters(cfg) == 2 * 6 * 3 * 64 * 32
    dense = preset_config("llama-tiny").model
    assert active_parameters(dense) == count_parameters(dense)


# ---- FLOPs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["qwenish", "olmoish", "gpt2-moe"])
def test_flops_formula_counts_the_active_matmuls(shape):
    """Per token: 3 x (attention, the router's 2 d E, k experts and the shared ones, the
    dense MLP of the dense layers) + the logits, as torch's FLOP counter sees a forward
    and backward (op-by-op attention, so the scores are counted; every token goes to
    exactly k experts, whatever the routing)."""
    cfg = dataclasses.replace(SHAPES[shape], attention="math", moe_aux_loss_coeff=0.0)
    model = build(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with FlopCounterMode(display=False) as counter:
        model(tokens, tokens).sum().backward()
    assert counter.get_total_flops() / tokens.numel() == pytest.approx(training_flops_per_token(cfg), rel=1e-9)


def test_mixtral_flops_are_those_of_its_active_parameters():
    """Mixtral 8x7B at 4K: within 5% of 6 x active parameters (less the embedding) plus
    attention, and a quarter of the dense-equivalent's."""
    cfg = dataclasses.replace(preset_config("mixtral-8x7b").model, seq_len=4096)
    d, L = cfg.d_model, cfg.n_layer
    six_n = 6 * (active_parameters(cfg) - cfg.vocab_size * d) + 3 * L * 4 * cfg.seq_len * d
    assert training_flops_per_token(cfg) == pytest.approx(six_n, rel=0.05)
    all_experts = dataclasses.replace(cfg, moe_top_k=8)
    assert training_flops_per_token(cfg) < 0.35 * training_flops_per_token(all_experts)


# ---- query/key norms and head widths --------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("qk_norm", ["head", "full"])
def test_qk_norms_normalise_before_the_rotary_positions(qk_norm):
    """``head``: each head of q and k by itself over head_dim (weights [head_dim]);
    ``full``: all of q's features together, all of k's (weights [n_head hd], [n_kv hd]);
    both start at ones and act before the rotation (the written-out attention agrees)."""
    cfg = dataclasses.replace(preset_config("llama-tiny").model, qk_norm=qk_norm, attn_head_dim=12)
    model = build(cfg).double()
    attn = model.blocks["0"].attn
    hd, heads, kv = 12, cfg.n_head, cfg.kv_heads
    widths = (hd, hd) if qk_norm == "head" else (heads * hd, kv * hd)
    assert (attn.q_norm.weight.shape[0], attn.k_norm.weight.shape[0]) == widths
    assert torch.equal(attn.q_norm.weight, torch.ones(widths[0], dtype=torch.float64))
    with torch.no_grad():
        for p in (attn.q_norm.weight, attn.k_norm.weight):
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 10, cfg.d_model, dtype=torch.float64)
    q, k, v = x @ attn.q.weight.t(), x @ attn.k.weight.t(), x @ attn.v.weight.t()
    eps = cfg.layernorm_eps
    if qk_norm == "full":
        q, k = _rms(q, attn.q_norm.weight, eps), _rms(k, attn.k_norm.weight, eps)
    q, k, v = (t.view(2, 10, -1, hd) for t in (q, k, v))
    if qk_norm == "head":
        q, k = _rms(q, attn.q_norm.weight, eps), _rms(k, attn.k_norm.weight, eps)
    q, k = attn.rotary(q.transpose(1, 2)), attn.rotary(k.transpose(1, 2))
    k, v = k.repeat_interleave(heads // kv, 1), v.transpose(1, 2).repeat_interleave(heads // kv, 1)
    scores = (q @ k.transpose(-1, -2)) / hd ** 0.5 + torch.full((10, 10), float("-inf")).triu(1)
    expected = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 10, heads * hd) @ attn.proj.weight.t()
    torch.testing.assert_close(attn(x), expected, rtol=1e-12, atol=1e-12)
    assert attn.proj.weight.shape == (cfg.d_model, heads * hd)


@pytest.mark.parametrize("shape", ["qwenish", "olmoish"])
def test_cached_generation_equals_the_full_forward(shape):
    """Heads 12 wide (qwenish) and both norms with experts: the key/value cache holds
    normalised, rotated keys, and token-by-token logits equal the whole forward's."""
    cfg = SHAPES[shape]
    model = build(cfg).double().eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    cache = model.new_cache(2)
    assert cache.keys.shape[-1] == cfg.head_dim
    steps = [model(tokens[:, :5], cache=cache)] + [model(tokens[:, i:i + 1], cache=cache) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), model(tokens), rtol=1e-12, atol=1e-12)


def test_qk_norm_weights_are_one_slice_replicated_over_tp():
    """head: whole on every tp rank, marked as one slice held by all of them (their
    partial gradients are summed over tp); full: split as q, and as k with its kv heads
    replicated at tp 4 (2 kv heads)."""
    for tp in (2, 4):
        head = Decoder(dataclasses.replace(MOE_TINY, qk_norm="head"), tp=fake_tp(tp, 1)).blocks["0"].attn
        assert shard_spec(head.q_norm.weight) == ShardSpec(0, replicas=tp) == shard_spec(head.k_norm.weight)
        assert head.q_norm.weight.shape == (MOE_TINY.head_dim,)
        full = Decoder(OLMOISH, tp=fake_tp(tp, 1)).blocks["0"].attn
        assert full.q_norm.weight.shape == (8 * 8 // tp,)
        assert shard_spec(full.k_norm.weight) == ShardSpec(0, replicas=llama.kv_replicas(2, tp))
        assert full.k_norm.weight.shape == (2 * 8 // (tp // llama.kv_replicas(2, tp)),)


@pytest.mark.parametrize("changes, words", [
    (dict(arch="gpt2", n_kv_head=None, qk_norm="head"), "model.qk_norm and model.attn_head_dim are for --arch llama"),
    (dict(arch="gpt2", n_kv_head=None, attn_head_dim=16), "model.qk_norm and model.attn_head_dim are for --arch llama"),
    (dict(attn_head_dim=7), "head size model.attn_head_dim = 7 is odd"),
])
def test_what_the_norms_and_head_widths_do_not_fit_is_one_line(changes, words):
    cfg = preset_config("llama-tiny")
    cfg.model = dataclasses.replace(cfg.model, **changes)
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        validate(cfg, world_size=1)


def test_heads_need_not_divide_d_model_when_their_width_is_given():
    cfg = preset_config("llama-tiny")
    cfg.model = dataclasses.replace(cfg.model, d_model=60, n_head=8, attn_head_dim=8)
    validate(cfg, world_size=1)
    model = build(cfg.model)
    assert model(torch.randint(0, 257, (1, 8))).shape == (1, 8, 257)


# ---- under tensor parallelism: the one-process model ------------------------------------------------

QK_CELLS = [  # (qk_norm, n_kv_head, attn_head_dim, parallel changes): tp 2 on 8 heads
    ("head", 2, 12, dict(tp=2)),
    ("head", 1, None, dict(tp=2, sequence_parallel=True)),  # one kv head, replicated: k_norm's copies
    ("full", 2, None, dict(tp=2, sequence_parallel=True, recompute="full")),
    ("full", 1, 12, dict(tp=2, recompute="selective")),  # k_norm over one kv head on both ranks
]


def _qk_config(qk_norm, n_kv_head, head_dim, **changes):
    cfg = preset_config("llama-tiny")
    cfg.model = dataclasses.replace(cfg.model, n_layer=2, seq_len=32, n_kv_head=n_kv_head, qk_norm=qk_norm,
                                    attn_head_dim=head_dim)
    return set_fields(cfg, dtype="fp64", steps=6, global_batch_size=8, micro_batch_size=2, eval_interval=0,
                      eval_iters=1, progress=False, lr=3e-3, warmup_steps=2, **changes)


@pytest.mark.spawn
def test_qk_norms_and_head_widths_train_the_one_process_model_on_tp2():
    """Losses, grad norms and every weight shard within 1e-9 of one process (fp64), both
    norms, with and without sequence parallelism, kv heads split and replicated,
    recomputation: the head norm's partial gradients summed over tp, the full norm's
    mean square across the ranks' features both ways."""
    cfgs = [_qk_config(*cell[:3], **cell[3]) for cell in QK_CELLS]
    results = train_layouts(cfgs, 2, timeout_s=600)
    for cell, cfg, runs in zip(QK_CELLS, cfgs, results):
        reference = train_in_process(_qk_config(*cell[:3]))
        for rank, run in enumerate(runs):
            try:
                assert_rank_matches(run, reference, cfg, rank)
            except AssertionError as e:
                raise AssertionError(f"{cell} rank {rank}: {e}") from None
        assert relative_difference(runs[0]["losses"], reference["losses"]) <= 1e-9
