"""The Decoder model: shapes, causality, initialisation that ignores the layout, FLOPs formula."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gridtrain.config import ModelConfig, preset_config
from gridtrain.models.decoder import (Decoder, IGNORE_INDEX, count_parameters, init_parameters, parameter_seed,
                             training_flops_per_token)

TINY = preset_config("tiny").model


def build(cfg: ModelConfig = TINY, seed: int = 0, **kwargs) -> Decoder:
    model = Decoder(cfg, **kwargs)
    init_parameters(model, seed)
    return model


def test_parameter_count_formula_matches_the_module():
    for name in ("tiny", "small", "gpt2"):
        cfg = preset_config(name).model
        model = Decoder(cfg)
        padding = (model.padded_vocab - cfg.vocab_size) * cfg.d_model
        assert sum(p.numel() for p in model.parameters()) - padding == count_parameters(cfg)


def test_gpt2_preset_has_the_known_size():
    assert count_parameters(preset_config("gpt2").model) == 124_439_808  # HF GPT-2 small


def test_logits_are_causal():
    model = build().double()
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % TINY.vocab_size
    a, b = model(tokens), model(changed)
    assert a.shape == (2, 16, TINY.vocab_size)  # padding columns never leave the model
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_loss_ignores_masked_labels_and_matches_cross_entropy():
    model = build().double()
    tokens = torch.randint(0, TINY.vocab_size, (2, 8))
    labels = torch.randint(0, TINY.vocab_size, (2, 8))
    labels[0, :3] = IGNORE_INDEX
    losses = model(tokens, labels)
    assert (losses[0, :3] == 0).all()
    expected = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(),
                                                 ignore_index=IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(losses.sum(), expected)


def test_init_depends_on_seed_and_name_only():
    """A stage holding only block 1 starts with the same numbers as the whole model's block 1."""
    whole = dict(build(seed=7).named_parameters())
    part = dict(build(seed=7, layer_ids=[1], pre_process=False, post_process=False).named_parameters())
    assert part.keys() == {k for k in whole if k.startswith("blocks.1.")}
    for name, value in part.items():
        torch.testing.assert_close(value, whole[name], rtol=0, atol=0)
    other = dict(build(seed=8).named_parameters())
    assert not torch.equal(other["blocks.1.attn.qkv.weight"], whole["blocks.1.attn.qkv.weight"])
    assert parameter_seed(7, "a") == parameter_seed(7, "a") != parameter_seed(7, "b")


def test_last_stage_head_starts_equal_to_the_embedding():
    """Pipelines keep a copy of the tied table on the last stage; both start identical."""
    first = build(layer_ids=[0], post_process=False)
    last = build(layer_ids=[1], pre_process=False)
    torch.testing.assert_close(last.head, first.embedding.word.weight, rtol=0, atol=0)


def test_padding_rows_are_zero_and_get_no_gradient():
    model = build()
    table = model.embedding.word.weight
    assert model.padded_vocab % 64 == 0 and model.padded_vocab > TINY.vocab_size
    assert (table[TINY.vocab_size:] == 0).all()
    tokens = torch.randint(0, TINY.vocab_size, (2, 8))
    model(tokens, tokens).sum().backward()
    assert (table.grad[TINY.vocab_size:] == 0).all()


def test_gpt2_init_scales_residual_projections():
    cfg = preset_config("small").model
    model = build(cfg)
    assert model.blocks["0"].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    expected = 0.02 / (2 * cfg.n_layer) ** 0.5
    assert model.blocks["0"].mlp.proj.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert (model.blocks["0"].ln1.weight == 1).all() and (model.blocks["0"].attn.qkv.bias == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_backward_in_dtype(dtype):
    model = build().to(dtype)
    tokens = torch.randint(0, TINY.vocab_size, (2, 8))
    loss = model(tokens, tokens).sum()
    loss.backward()
    assert loss.dtype == torch.promote_types(dtype, torch.float32)  # never below fp32
    assert model.blocks["0"].mlp.fc.weight.grad.dtype == dtype


def test_bf16_autocast_runs_and_stays_close_to_fp32():
    model = build()
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    reference = model(tokens, tokens).mean().detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(tokens, tokens).mean().detach()
    assert abs(float(low) - float(reference)) < 0.05 * float(reference)


def test_flops_formula_matches_counted_flops():
    """The documented per-token formula equals what torch's FLOP counter sees (fwd + bwd).

    On CPU the fused attention kernel is invisible to the counter, so its term (2 s d for
    scores plus 2 s d for the weighted sum, per layer, forward; twice that backward) is
    added back by hand.
    """
    cfg = ModelConfig(n_layer=2, n_head=4, d_model=64, seq_len=32, vocab_size=256, vocab_pad_multiple=1)
    model = build(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with FlopCounterMode(display=False) as counter:
        model(tokens, tokens).sum().backward()
    attention = 3 * cfg.n_layer * 4 * cfg.seq_len * cfg.d_model
    per_token = counter.get_total_flops() / tokens.numel() + attention
    assert per_token == pytest.approx(training_flops_per_token(cfg), rel=1e-9)
