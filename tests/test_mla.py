"""Multi-head latent attention (``--attention mla``, models/mla.py, docs/mla.md): the same
numbers as transformers' DeepseekV3Attention for the same weights (with and without query
compression, with and without YaRN, both cores); the same training as one process on tp 2
with sequence parallelism and ZeRO-1, cp 2 (ring with tp 2, all-gather, ring with document
masks) and pp 2 (fp64, 1e-9; one spawn of 4 ranks); both recomputations and the op-by-op
core; generation from a cache of latents; names, sizes, FLOPs, initialisation and saved
activation bytes against their formulas."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from gridtrain.config import ModelConfig, preset_config
from gridtrain.models import llama, mla
from gridtrain.models.decoder import Decoder, block_parameters, generate, init_parameters
from gridtrain.parallel.grid import ProcessGrid
from gridtrain.training.providers import text_datasets_provider
from tests.training import (assert_rank_matches, assert_same_training, fake_tp, saved_bytes_and_formula, tiny_config,
                            train_in_process, train_in_process_with, train_layouts_with)

# a llama-tiny-shaped model with latent attention and query compression
MLA = dict(arch="llama", attention_type="mla", n_head=4, n_kv_head=None, d_model=64, ffn_hidden=160, kv_lora_rank=32,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=24)
YARN = dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_positions=16, rope_beta_fast=32.0,
            rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=0.8)


def model_config(**fields) -> ModelConfig:
    return dataclasses.replace(preset_config("llama-tiny").model, **{**MLA, **fields})


# ---- against transformers ------------------------------------------------------------------------


def _hf_attention(cfg: ModelConfig):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
                "original_max_position_embeddings": cfg.rope_original_max_positions,
                "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow, "mscale": cfg.rope_mscale,
                "mscale_all_dim": cfg.rope_mscale_all_dim}
    hf = DeepseekV3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_attention_heads=cfg.n_head,
                          num_key_value_heads=cfg.n_head, q_lora_rank=cfg.q_lora_rank or None,
                          kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                          qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rope_interleave=False,
                          max_position_embeddings=cfg.seq_len, rope_parameters=rope, attention_bias=False)
    hf._attn_implementation = "sdpa"  # eager takes the softmax in fp32, even for fp64 inputs
    return DeepseekV3Attention(hf, 0), DeepseekV3RotaryEmbedding(hf)


@pytest.mark.parametrize("q_lora_rank", [0, 24])
@pytest.mark.parametrize("scaling", [None, "yarn"])
@pytest.mark.parametrize("core", ["sdpa", "math"])
def test_latent_attention_is_transformers_deepseek_v3_attention(q_lora_rank, scaling, core, monkeypatch):
    """Same weights, same input: the same output as DeepseekV3Attention (rope_interleave
    off, torch sdpa), in fp64 within 1e-10, through either core (values padded for the
    fused one). transformers' RMSNorm normalises in fp32 whatever the input's dtype (1e-8
    apart in fp64), so here it normalises in the input's dtype, as gridtrain's does."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_deepseek_v3.DeepseekV3RMSNorm, "forward", rms_norm)
    fields = dict(q_lora_rank=q_lora_rank, attention=core) | (YARN if scaling else {})
    cfg = model_config(**fields)
    model = Decoder(cfg, layer_ids=[0], pre_process=False, post_process=False)
    init_parameters(model, 0)
    model.double()
    ours = model.blocks["0"].attn
    theirs, rotary = _hf_attention(cfg)
    names = {"kv_a_proj_with_mqa": "kv_a", "kv_a_layernorm": "kv_a_norm", "kv_b_proj": "kv_b", "o_proj": "proj"}
    names |= {"q_a_proj": "q_a", "q_a_layernorm": "q_a_norm", "q_b_proj": "q_b"} if q_lora_rank else {"q_proj": "q"}
    with torch.no_grad():
        for hf_name, name in names.items():
            getattr(theirs, hf_name).weight.copy_(getattr(ours, name).weight)
    theirs.double()
    b, s = 2, cfg.seq_len
    x = torch.randn(b, s, cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    position_embeddings = rotary(x, torch.arange(s).expand(b, s))
    mask = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1).expand(b, 1, s, s)
    expected, _ = theirs(x, position_embeddings, mask)
    got = ours(x)
    assert (got - expected).abs().max() <= 1e-10 * expected.abs().max()


def test_yarn_frequencies_and_factors_are_transformers():
    """YaRN's frequencies and cos/sin factor equal ``_compute_yarn_parameters``'s (bit for
    bit, fp32), and the softmax scale its ``yarn_apply_mscale``'s."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    cfg = model_config(**YARN)
    rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.rope_original_max_positions, "beta_fast": cfg.rope_beta_fast,
            "beta_slow": cfg.rope_beta_slow, "mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim}
    hf = DeepseekV3Config(hidden_size=cfg.d_model, num_attention_heads=cfg.n_head, qk_rope_head_dim=8,
                          qk_nope_head_dim=16, rope_parameters=rope)
    freqs, factor = _compute_yarn_parameters(hf)
    assert torch.equal(llama.rope_frequencies(cfg), freqs)
    assert llama.rotary_attention_factor(cfg) == factor != 1.0
    assert mla.softmax_scale(cfg) == yarn_apply_mscale(rope, cfg.qk_head_dim ** -0.5) != cfg.qk_head_dim ** -0.5
    assert mla.softmax_scale(model_config()) == cfg.qk_head_dim ** -0.5


# ---- sizes and initialisation -----------------------------------------------------------------------


@pytest.mark.parametrize("q_lora_rank", [0, 24])
@pytest.mark.parametrize("tp", [1, 2])
def test_parameter_names_shapes_counts_and_init(q_lora_rank, tp):
    """The parameter names and shapes the checkpoints and the Hugging Face mapping key
    on; block_parameters counts what a tp rank holds; the replicated pieces are one slice
    on every rank; norms start at 1, proj at the scaled residual std."""
    cfg = model_config(q_lora_rank=q_lora_rank)
    model = Decoder(cfg, tp=fake_tp(tp, 0))
    attn = {n.removeprefix("blocks.0.attn."): p for n, p in model.named_parameters() if n.startswith("blocks.0.attn.")}
    h, qk = cfg.n_head, cfg.qk_head_dim
    shapes = {"kv_a.weight": (40, 64), "kv_a_norm.weight": (32,), "kv_b.weight": (h * 32 // tp, 32),
              "proj.weight": (64, h * 16 // tp)}
    shapes |= ({"q_a.weight": (24, 64), "q_a_norm.weight": (24,), "q_b.weight": (h * qk // tp, 24)} if q_lora_rank
               else {"q.weight": (h * qk // tp, 64)})
    assert {n: tuple(p.shape) for n, p in attn.items()} == shapes
    for name in ("kv_a.weight", "kv_a_norm.weight") + (("q_a.weight", "q_a_norm.weight") if q_lora_rank else ()):
        assert attn[name].tp_spec.replicas == tp and attn[name].tp_spec.slices(tp) == 1, name
        assert not getattr(attn[name], "sequence_parallel", False)
    block = sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks.0."))
    assert block == block_parameters(cfg, tp)
    if tp == 1:
        init_parameters(model, 0)
        assert torch.equal(attn["kv_a_norm.weight"], torch.ones(32))
        assert attn["proj.weight"].std().item() == pytest.approx(0.02 / 2, rel=0.2)  # 0.02 / sqrt(2 n_layer)
        assert attn["kv_b.weight"].std().item() == pytest.approx(0.02, rel=0.2)


@pytest.mark.parametrize("core", ["sdpa", "math"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_saved_bytes_follow_the_formula(core, recompute):
    """One process: the meter's bytes per block are the activation formula's (latent
    attention's widths and latents, memory.activations.layer_shape) within 0.5% (the
    norms' per-token statistics are left out of it)."""
    cfg = model_config(attention=core)
    measured, expected = saved_bytes_and_formula(cfg, recompute)
    for i in range(cfg.n_layer):
        assert measured[f"blocks.{i}"] == pytest.approx(expected, rel=0.005)


def test_attention_flops_are_the_matrix_products():
    """mla.attention_flops_per_token counts what the op-by-op forward multiplies, per token
    (torch's FLOP counter over one block's attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = model_config(attention="math")
    attn = Decoder(cfg, layer_ids=[0], pre_process=False, post_process=False).blocks["0"].attn
    x = torch.randn(1, cfg.seq_len, cfg.d_model)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        attn(x)
    assert counter.get_total_flops() == mla.attention_flops_per_token(cfg) * cfg.seq_len


# ---- generation -------------------------------------------------------------------------------------


def test_generation_from_a_cache_of_latents():
    """Greedy generation with the cache gives the tokens of generation without it; the
    cache holds, per layer, the normalised latents and the rotated shared keys only."""
    cfg = model_config(seq_len=32)
    model = Decoder(cfg)
    init_parameters(model, 0)
    model.double()
    prompt = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    cached = generate(model, prompt, 12, temperature=0)
    assert torch.equal(cached, generate(model, prompt, 12, temperature=0, use_cache=False))
    cache = model.new_cache(2)
    assert isinstance(cache, mla.LatentCache)
    assert cache.latents.shape == (cfg.n_layer, 2, cfg.seq_len, cfg.kv_lora_rank)
    assert cache.rope_keys.shape == (cfg.n_layer, 2, cfg.seq_len, cfg.qk_rope_head_dim)
    assert not hasattr(cache, "keys")
    model(prompt, cache=cache)  # the prompt's latents are written in place
    assert cache.length == 5 and cache.latents[:, :, 5:].abs().sum() == 0 < cache.latents[:, :, :5].abs().sum()


# ---- training ------------------------------------------------------------------------------------------

# name -> fields; four ranks each, in one spawn (dp fills the rest of the world)
LAYOUTS = {  # (the op-by-op core where the run reports the memory formula beside its measurement)
    "tp2-sp-zero1": dict(tp=2, sequence_parallel=True, zero=1, attention="math"),
    "cp2-tp2-sp-ring": dict(cp=2, tp=2, sequence_parallel=True, attention="math"),
    "cp2-allgather": dict(cp=2, cp_comm="allgather"),
    "pp2-1f1b": dict(pp=2, schedule="1f1b"),
    # packed windows of several documents (tests/test_document_mask.py's): 4 steps of 4 windows
    "cp2-ring-documents": dict(cp=2, document_mask=True, steps=4, global_batch_size=4, micro_batch_size=1),
}


def datasets_provider(cfg):
    """The built-in corpus; packed documents for the document-masked run."""
    if cfg.data.document_mask:
        from tests.test_document_mask import packed_datasets_provider

        return packed_datasets_provider(cfg)
    return text_datasets_provider(cfg)


def _config(name: str):
    return tiny_config(**MLA, **LAYOUTS[name])


@functools.cache
def reference(documents: bool = False) -> dict:
    fields = {k: v for k, v in LAYOUTS["cp2-ring-documents"].items() if k != "cp"} if documents else {}
    return train_in_process_with(tiny_config(**MLA, **fields), datasets_provider)


@functools.cache
def layouts() -> dict[str, list[dict]]:
    return dict(zip(LAYOUTS, train_layouts_with([_config(n) for n in LAYOUTS], 4, datasets_provider)))


@pytest.mark.spawn
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_latent_attention_trains_the_one_process_model(name):
    """Every rank of each layout: losses, grad norms, validation loss and the weights it
    holds (its TP shard; the replicated down-projections and norms whole) equal one
    process's within 1e-9 over 10 fp64 steps (4 for the document-masked run); with the
    op-by-op core, each block's saved bytes are the activation formula's within 3% (the
    norms' statistics and, under cp, the rotary tables' rows at the rank's positions are
    left out of it)."""
    cfg = _config(name)
    p = cfg.parallel
    grid = ProcessGrid.build(4, tp=p.tp, pp=p.pp, cp=p.cp, dp=4 // (p.tp * p.pp * p.cp))
    for rank, run in enumerate(layouts()[name]):
        assert_rank_matches(run, reference(cfg.data.document_mask), cfg, grid.tp_rank(rank))
        for stage in run["memory"]:  # the activation formula (memory.activations, latent terms) per block
            for layer, expected in stage.expected.items():
                assert stage.per_micro_batch(layer) == pytest.approx(expected, rel=0.03), (rank, layer)


@pytest.mark.parametrize("fields", [dict(recompute="selective"), dict(recompute="full"), dict(attention="math"),
                                    dict(attention="math", recompute="selective")])
def test_recomputation_and_cores_train_alike(fields):
    """Selective and full recomputation, and the op-by-op core (narrow values as they
    are), train as the fused core without recomputation: same losses, gradient norms and
    weights (fp64, 1e-9)."""
    steps = dict(steps=3)
    assert_same_training(train_in_process(tiny_config(**MLA, **steps, **fields)), _short_reference(), 1e-9)


@functools.cache
def _short_reference() -> dict:
    return train_in_process(tiny_config(**MLA, steps=3))


def test_document_masked_cores_agree():
    """With documents, the fused core (one fused block per document, values padded) and
    the op-by-op one (a dense mask, narrow values) give the same logits and gradients."""
    documents = torch.tensor([[0] * 5 + [1] * 20 + [2] * 39, [0] * 64])
    tokens = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(0))
    results = []
    for core in ("sdpa", "math"):
        model = Decoder(model_config(attention=core))
        init_parameters(model, 0)
        model.double()
        model(tokens, tokens, documents=documents, reduction="sum").backward()
        results.append([model(tokens, documents=documents)] + [p.grad for p in model.parameters()])
    for fused, op_by_op in zip(*results):
        assert (fused - op_by_op).abs().max() <= 1e-10 * op_by_op.abs().max()
