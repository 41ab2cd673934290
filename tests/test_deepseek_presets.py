"""The DeepSeek-V3-class presets (gridtrain/config.py) are the published models: each
preset is what its published Hugging Face config.json reads as (hf_mapping), its
parameter count is transformers' own model's, built from that config.json on the meta
device, exactly, and both agree with the sizes the publishers state.

The config.json values below are the published files' (deepseek-ai/DeepSeek-V3,
deepseek-ai/DeepSeek-V2-Lite, moonshotai/Moonlight-16B-A3B, moonshotai/Kimi-K2-Instruct
on the Hugging Face Hub), the keys that shape the model and its routing.

Derived counts (count_parameters with mtp=False; active: active_parameters with
exclude_embeddings=True, the token table looked up, not multiplied):

======================  ==================  ================  ==========================================
preset                  total               active            published (total / active)
======================  ==================  ================  ==========================================
deepseek-v3             671,026,404,352     36,625,603,584    671B / 37B (36.7B in README_WEIGHTS)
deepseek-v2-lite        15,706,484,224      2,451,435,008     15.7B / 2.4B
moonlight-16b-a3b       15,960,108,544      2,579,230,208     16B / 3B
kimi-k2                 1,026,408,209,408   31,687,072,768    1T / 32B (1.04T / 32.6B in its report)
======================  ==================  ================  ==========================================

DeepSeek-V3's MTP module: 11,610,067,968 parameters of its own (README_WEIGHTS: "11.5B
unique"); with the copies of the embedding and the head its files also hold, the Hub's
685B (684,489,830,400).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
from gridtrain.config import preset_config  # noqa: E402
from gridtrain.models.decoder import active_parameters, count_parameters, mtp_parameters  # noqa: E402
from gridtrain.models.hf_mapping import architecture_for, model_config_from_hf  # noqa: E402

_V3_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "type": "yarn"}
PUBLISHED = {  # preset: config.json as published (the keys that shape the model and its routing)
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
        "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "aux_loss_alpha": 0.001,
        "seq_aux": True, "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
        "rope_theta": 10000, "rope_scaling": _V3_YARN, "tie_word_embeddings": False, "attention_bias": False},
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
        "scoring_func": "softmax", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
        "rope_scaling": {**_V3_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}, "tie_word_embeddings": False,
        "attention_bias": False},
    "moonlight-16b-a3b": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 163840,
        "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_nextn_predict_layers": 0, "num_attention_heads": 16, "num_key_value_heads": 16,
        "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 2.446, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6, "moe_layer_freq": 1,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid", "aux_loss_alpha": 0.001,
        "seq_aux": True, "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
        "rope_theta": 50000.0, "tie_word_embeddings": False, "attention_bias": False},
    "kimi-k2": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_nextn_predict_layers": 0, "num_attention_heads": 64, "num_key_value_heads": 64,
        "n_shared_experts": 1, "n_routed_experts": 384, "routed_scaling_factor": 2.827, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "moe_layer_freq": 1,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid", "aux_loss_alpha": 0.001,
        "seq_aux": True, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-06,
        "rope_theta": 50000.0, "rope_scaling": {**_V3_YARN, "beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0},
        "tie_word_embeddings": False, "attention_bias": False},
}
# (total, its tolerance, active, its tolerance): the publishers' rounded sizes, each within half a
# unit of its last digit (0.5% of DeepSeek-V3's 671B; 2.5% of V2-Lite's 2.4B, a truncated 2.45B)
STATED = {
    "deepseek-v3": (671e9, 3.4e9, 37e9, 0.5e9),  # Liu et al. (2024): 671B total, 37B activated per token
    "deepseek-v2-lite": (15.7e9, 0.05e9, 2.4e9, 0.06e9),  # model card: 15.7B total, 2.4B activated
    "moonlight-16b-a3b": (16e9, 0.5e9, 3e9, 0.5e9),  # model card: 16B total, 3B activated
    "kimi-k2": (1e12, 0.05e12, 32e9, 0.5e9),  # model card: 1T total, 32B activated (report: 1.04T, 32.6B)
}
TRAINING_FIELDS = ("seq_len", "moe_expert_bias_rate", "moe_seq_aux_loss_coeff")  # choices config.json does not hold
HF_CLASSES = {"deepseek_v3": "DeepseekV3", "kimi_k2": "DeepseekV3", "deepseek_v2": "DeepseekV2"}


def transformers_model(published: dict):
    """transformers' own model of a published config.json, on the meta device."""
    family = HF_CLASSES[published["model_type"]]
    config = getattr(transformers, f"{family}Config")(**{k: v for k, v in published.items() if k != "model_type"})
    with torch.device("meta"):
        return getattr(transformers, f"{family}ForCausalLM")(config)


@pytest.mark.parametrize("preset", PUBLISHED)
def test_preset_is_the_published_config(preset):
    """import-hf reads the published config.json as the preset's model (the training
    choices config.json does not hold aside), and export writes config.json back with
    the same model."""
    model = preset_config(preset).model
    family = "deepseek_v2" if preset == "deepseek-v2-lite" else "deepseek_v3"
    assert architecture_for(PUBLISHED[preset]).name == family
    imported = model_config_from_hf(PUBLISHED[preset])
    kept = {k: getattr(model, k) for k in TRAINING_FIELDS}
    assert dataclasses.replace(imported, **kept) == model
    exported = architecture_for(PUBLISHED[preset]).to_hf_config(model)
    assert dataclasses.replace(model_config_from_hf(exported), **kept) == model


@pytest.mark.parametrize("preset", PUBLISHED)
def test_parameter_counts_are_transformers_and_the_published_sizes(preset):
    """count_parameters (without the MTP modules, as sizes are published) is exactly the
    parameter count of transformers' model built from the published config.json, and
    active_parameters is that less the unchosen experts; both are the published sizes
    within their rounding."""
    cfg = preset_config(preset).model
    hf = transformers_model(PUBLISHED[preset])
    total = sum(p.numel() for p in hf.parameters())
    assert count_parameters(cfg, mtp=False) == total
    expert = 3 * cfg.d_model * cfg.moe_ffn_size
    unchosen = len(cfg.moe_layers) * (cfg.n_experts - cfg.moe_top_k) * expert
    active = active_parameters(cfg, exclude_embeddings=True, mtp=False)
    assert active == total - unchosen - cfg.vocab_size * cfg.d_model
    stated_total, total_tolerance, stated_active, active_tolerance = STATED[preset]
    assert abs(total - stated_total) <= total_tolerance, total
    assert abs(active - stated_active) <= active_tolerance, active


def test_deepseek_v3_mtp_module_is_its_published_size():
    """DeepSeek-V3's one MTP module: a MoE block with its two input norms, projection and
    output norm, 11.6B parameters of its own (README_WEIGHTS: 11.5B); with the embedding
    and head copies its files hold, the 685B the Hub shows."""
    cfg = preset_config("deepseek-v3").model
    module = mtp_parameters(cfg)
    layer = sum(p.numel() for p in transformers_model(PUBLISHED["deepseek-v3"]).model.layers[-1].parameters())
    assert module == layer + 3 * cfg.d_model + 2 * cfg.d_model ** 2 == 11_610_067_968
    assert abs(module - 11.5e9) <= 0.01 * 11.5e9
    assert count_parameters(cfg) == count_parameters(cfg, mtp=False) + module
    on_the_hub = count_parameters(cfg) + 2 * cfg.vocab_size * cfg.d_model
    assert on_the_hub == 684_489_830_400 and abs(on_the_hub - 685e9) <= 0.001 * 685e9


def test_tiny_preset_has_every_feature():
    m = preset_config("deepseek-tiny").model
    assert m.mla and m.q_lora_rank > 0 and m.moe_groups > 1 and m.moe_group_top_k and m.moe_shared_experts
    assert m.moe_router == "sigmoid" and m.moe_expert_bias_rate > 0 and m.mtp_layers == 1 and m.rope_scaling == "yarn"
    assert m.moe_layers == [1] and (m.d_model, m.seq_len, m.vocab_size) == (64, 64, 257)
