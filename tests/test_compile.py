"""``--compile``: compiled blocks train the same model as eager ones (fp64, 1e-9), keep
ZB-H1's deferred weight gradients, and refuse what they cannot do yet."""

from __future__ import annotations

import pytest
import torch

from gridtrain.config import ModelConfig
from gridtrain.models.decoder import Decoder, compile_blocks, init_parameters
from gridtrain.parallel.split_backward import WeightGradStore
from gridtrain.parallel.tensor_parallel import TensorParallel
from gridtrain.training.validate import ConfigError, validate
from tests.training import assert_same_training, tiny_config, train_in_process, train_layouts


@pytest.mark.spawn
def test_compiled_blocks_train_the_eager_model_on_every_kind_of_layout():
    """One spawn of two ranks: DP with full recomputation and ZeRO-1, TP with and without
    sequence parallelism, a ZB-H1 pipeline (whose weight gradients a compiled backward
    must still defer), cp 2 (a compiled block breaks around the ring) and ZeRO-3 (a
    compiled block's parameters gathered and freed around it), each compiled, against
    the eager model in one process. Every step moves the same bytes: a collective traced
    into a compiled graph would be counted (and recorded) only when it was traced. The
    data-parallel and ZB-H1 layouts compile with inductor, the others with ``aot_eager``
    (the same capture, graph breaks and AOTAutograd backward, which is where a layout
    meets compilation, without inductor's kernel builds)."""
    reference = train_in_process(tiny_config())
    layouts = [dict(recompute="full", zero=1), dict(tp=2, sequence_parallel=True), dict(tp=2),
               dict(pp=2, schedule="zb-h1"), dict(cp=2), dict(zero=3)]
    inductor = [True, False, False, True, False, False]
    cfgs = []
    for layout, fused in zip(layouts, inductor):
        cfg = tiny_config(compile=True, **{k: v for k, v in layout.items() if k in ("recompute", "zero")})
        cfg.training.compile_backend = "inductor" if fused else "aot_eager"
        for key in ("tp", "pp", "schedule", "sequence_parallel", "cp"):
            if key in layout:
                setattr(cfg.parallel, key, layout[key])
        cfgs.append(cfg)
    for layout, runs in zip(layouts, train_layouts(cfgs, 2, timeout_s=600)):
        for run in runs:
            assert all(step == run["step_bytes"][0] for step in run["step_bytes"]), layout
            # every weight this rank holds whole (TP shards, the last stage's tied head: the losses say it)
            held = {k: v for k, v in run["state"].items()
                    if k in reference["state"] and v.shape == reference["state"][k].shape}
            try:
                assert_same_training(dict(run, state=held), dict(reference, state={k: reference["state"][k]
                                                                                  for k in held}), rtol=1e-9)
            except AssertionError as e:
                raise AssertionError(f"{layout}: {e}") from None


@pytest.mark.spawn
def test_a_compiled_backward_defers_weight_gradients_when_it_runs():
    """ZB-H1's B defers linear weight gradients only while the store is deferring, which
    a compiled backward traced once would fix at tracing time (here: traced inside
    ``defer``, it would drop them)."""
    cfg = ModelConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64, dropout=0.0)
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    grads, deferred = [], []
    for compiled in (False, True):
        store = WeightGradStore()
        tp = TensorParallel(weight_grads=store)
        model = Decoder(cfg, tp=tp)
        init_parameters(model, 0)
        model = model.double()
        if compiled:
            assert compile_blocks(model) == 2
        for key in range(2):  # the second call runs the compiled graph traced by the first
            model.zero_grad(set_to_none=True)
            with store.defer(key):
                model(x, y).sum().backward()
            deferred.append(len(store.pending[key]))
            store.flush(key)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert deferred == [8, 8, 8, 8]  # qkv, proj, fc, proj of 2 blocks, every time
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-12, atol=1e-12, msg=name)


def test_compile_says_so_when_a_users_model_has_no_gridtrain_blocks():
    """``--compile`` compiles gridtrain's blocks; a provider's own model has none, and the
    run stops with one line saying what to do instead of silently running eager."""
    from torch import nn

    from gridtrain.training.providers import decoder_forward_step, text_datasets_provider
    from gridtrain.training.loop import pretrain

    with pytest.raises(ValueError, match="torch.compile your model in its provider"):
        pretrain(lambda cfg, ctx: nn.Linear(4, 4), text_datasets_provider, decoder_forward_step,
                 tiny_config(compile=True))
    assert not torch.distributed.is_initialized()  # the failed run ended the group it made


def test_compile_refuses_selective_recomputation_and_the_dry_run(capsys):
    with pytest.raises(ConfigError, match="--compile does not take --recompute selective"):
        validate(tiny_config(compile=True, recompute="selective"), 1, data=False)
    from gridtrain.cli.parser import main

    assert main(["train", "--model", "tiny", "--dry-run", "--world-size", "2", "--compile"]) == 2
    assert "--dry-run measures the eager blocks" in capsys.readouterr().err


@pytest.mark.spawn  # inductor compiles in worker processes
def test_compile_fuses_the_one_rank_loss_and_leaves_pipeline_middles_and_tp_alone():
    """Without tensor parallelism the cross entropy is compiled with the blocks (on an H200
    the eager loss made a compiled GPT-2 124M step 0.73x the plain compiled loop's)."""
    from gridtrain.models.decoder import ChunkSpec

    cfg = ModelConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=50)
    whole = Decoder(cfg)
    middle = Decoder(cfg, chunks=[ChunkSpec((0,), pre_process=True, post_process=False)])
    compile_blocks(whole)
    compile_blocks(middle)
    assert whole.compiled_loss is not None and middle.compiled_loss is None
    init_parameters(whole, 0)
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    compiled = whole(tokens, tokens)
    whole.compiled_loss = None
    for block in whole.blocks.values():
        block.compiled = None
    assert torch.allclose(compiled, whole(tokens, tokens), rtol=1e-5, atol=1e-6)
