"""Generation with a key/value cache: incremental decoding equals the full forward, for
GPT-2 (learned positions) and Llama (rotary positions, grouped-query attention)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gridtrain.config import preset_config
from gridtrain.models.decoder import Decoder, generate, init_parameters
from gridtrain.models.llama import Rotary

PRESETS = ("tiny", "llama-tiny")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny fp64 models: one intra-op thread is fastest (and does not fight a busy CI host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(preset: str, attention: str = "sdpa") -> Decoder:
    cfg = dataclasses.replace(preset_config(preset).model, attention=attention)
    model = Decoder(cfg)
    init_parameters(model, 0)
    return model.double().eval()


def tokens(model: Decoder, batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, model.cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("preset", PRESETS)
@torch.no_grad()
def test_cached_logits_equal_the_full_forward_at_every_step(preset, attention):
    model = build(preset, attention)
    ids = tokens(model, 2, model.cfg.seq_len)
    cache = model.new_cache(2)
    # a prompt of 5, then one token at a time, a chunk of 3 after cached tokens, to the end of the context
    steps = [5] + [1] * 20 + [3] + [1] * (model.cfg.seq_len - 28)
    for n in steps:
        start = cache.length
        cached = model(ids[:, start:start + n], cache=cache)
        full = model(ids[:, :start + n])[:, start:]
        torch.testing.assert_close(cached, full, rtol=0, atol=1e-12)
    assert cache.length == model.cfg.seq_len


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_tokens_are_the_same_with_and_without_the_cache_past_the_context(preset):
    model = build(preset)
    prompt = tokens(model, 2, 7)
    new = model.cfg.seq_len + 9  # past the context: a sliding window without the cache
    with_cache = generate(model, prompt, new, temperature=0)
    assert with_cache.shape == (2, 7 + new)
    assert torch.equal(with_cache, generate(model, prompt, new, temperature=0, use_cache=False))


def test_grouped_query_attention_caches_only_the_kv_heads():
    model = build("llama-tiny")
    cfg = model.cfg
    assert cfg.kv_heads < cfg.n_head
    cache = model.new_cache(3)
    assert cache.keys.shape == cache.values.shape == (cfg.n_layer, 3, cfg.kv_heads, cfg.seq_len, cfg.head_dim)
    assert cache.keys.dtype == torch.float64


@pytest.mark.parametrize("preset", PRESETS)
def test_seeded_sampling_is_reproducible(preset):
    model = build(preset)
    prompt = tokens(model, 1, 4)

    def sample(seed: int, use_cache: bool = True) -> torch.Tensor:
        return generate(model, prompt, 30, temperature=0.9, top_k=20, use_cache=use_cache,
                        generator=torch.Generator().manual_seed(seed))

    first = sample(3)
    assert torch.equal(first, sample(3))
    assert torch.equal(first, sample(3, use_cache=False))
    assert not torch.equal(first, sample(4))


def test_the_cache_is_refused_for_a_pipeline_stage_and_past_its_length():
    stage = Decoder(preset_config("tiny").model, layer_ids=[0], post_process=False)
    with pytest.raises(ValueError, match="whole model in one process"):
        stage.new_cache(1)
    model = build("tiny")
    cache = model.new_cache(1)
    with torch.no_grad():
        model(tokens(model, 1, model.cfg.seq_len - 1), cache=cache)
        with pytest.raises(ValueError, match="do not fit"):
            model(tokens(model, 1, 2), cache=cache)


@pytest.mark.parametrize("preset", ["llama-tiny", "moe-tiny"])
@torch.no_grad()
def test_a_rotary_model_reads_inputs_longer_than_it_was_trained_on(preset):
    """Rotary positions come from a formula (as in transformers): past ``--seq-len`` the
    tables grow, and the first ``seq_len`` positions' logits are the short input's."""
    model = build(preset)
    n = model.cfg.seq_len
    long = tokens(model, 2, n + 8)
    assert model(long).shape[:2] == (2, n + 8)
    assert torch.allclose(model(long)[:, :n], model(long[:, :n]), rtol=0, atol=1e-12)
    assert {m.cos.shape[0] for m in model.modules() if isinstance(m, Rotary)} == {n + 8}


def test_a_learned_position_model_refuses_a_longer_input_in_one_line():
    model = build("tiny")
    n = model.cfg.seq_len
    with pytest.raises(ValueError, match=f"^{n + 1} positions: the learned position table holds {n} "):
        model(tokens(model, 1, n + 1))
