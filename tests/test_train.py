"""The training loop on one process and on a data-parallel grid of real gloo processes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gridtrain import checkpoint
from gridtrain.config import OptimConfig
from gridtrain.optim.optimizer import AdamW, lr_at
from tests.training import tiny_config, train_in_process


@pytest.mark.slow
def test_fp64_training_is_deterministic(tmp_path):
    """Same seed, same run: metrics files agree exactly in losses and grad norms."""
    rows = []
    for name in ("a", "b"):
        cfg = tiny_config()
        cfg.metrics.metrics_file = str(tmp_path / f"{name}.jsonl")
        train_in_process(cfg)
        rows.append([json.loads(line) for line in open(cfg.metrics.metrics_file)])
    assert len(rows[0]) == 10
    for a, b in zip(*rows):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])


def test_metrics_file_has_the_contract_keys(tmp_path):
    cfg = tiny_config(steps=3)
    cfg.metrics.metrics_file = str(tmp_path / "m.jsonl")
    train_in_process(cfg)
    rows = [json.loads(line) for line in open(cfg.metrics.metrics_file)]
    required = {"step", "loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s"}
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(required <= r.keys() for r in rows)
    assert ["startup" in r for r in rows] == [True, False, False]  # the start-up, once, on the first step
    up = rows[0]["startup"]
    assert up["time_s"] > 0 and up["time_s"] == pytest.approx(sum(up["phases"].values()))
    assert list(up["phases"])[-5:] == ["distributed", "model", "data", "optimizer", "loop"]
    assert len(up["host_peak_bytes"]) == 1 and up["host_peak_bytes"][0] > 0 and up["device_peak_bytes"] is None
    tokens_per_step = cfg.training.global_batch_size * cfg.model.seq_len
    assert [r["tokens"] for r in rows] == [tokens_per_step * k for k in (1, 2, 3)]


def test_loss_goes_down():
    cfg = tiny_config(steps=30, dtype="fp32")
    result = train_in_process(cfg)
    assert np.mean(result["losses"][-5:]) < result["losses"][0] - 0.8


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    """Resuming from step 5 of a 10-step run reproduces steps 6-10 (weights, Adam, data order)."""
    cfg = tiny_config()
    cfg.checkpoint.save, cfg.checkpoint.save_interval = str(tmp_path), 5
    straight = train_in_process(cfg)
    assert checkpoint.resolve(tmp_path).name == "step_0000010"
    resumed_cfg = tiny_config()
    resumed_cfg.checkpoint.load = str(checkpoint.step_dir(tmp_path, 5))
    resumed = train_in_process(resumed_cfg)
    assert resumed["losses"] == straight["losses"][5:]
    for name, value in straight["state"].items():
        np.testing.assert_array_equal(resumed["state"][name], value)


def test_lr_schedule_warms_up_then_decays_to_floor():
    o = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(k, o, 100) for k in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_adamw_norm_and_clipping_match_torch():
    """The optimizer interface's norm share and clip on one rank are torch's clip_grad_norm_."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params):
        c.grad = p.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(copies, 1.0)
    optimizer = AdamW(torch.optim.AdamW(params))
    norm = float(optimizer.grad_norm_squared()) ** 0.5
    optimizer.clip_to(norm, 1.0)
    assert norm == pytest.approx(float(expected), rel=1e-6)
    for c, p in zip(copies, params):
        torch.testing.assert_close(p.grad, c.grad)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_finished_run_frees_its_model(dtype):
    """Found on a GPU: device memory grew by one model per ``pretrain`` call in a process
    (the gradient hooks made a cycle through autograd's C++ nodes, which Python's
    collector cannot see)."""
    import gc
    import weakref

    from gridtrain.training.loop import pretrain
    from gridtrain.training.providers import decoder_forward_step, decoder_model_provider, text_datasets_provider

    result = pretrain(decoder_model_provider, text_datasets_provider, decoder_forward_step,
                      tiny_config(dtype=dtype, steps=2))
    model = weakref.ref(result.model)
    parameter = weakref.ref(next(result.model.parameters()))
    del result
    gc.collect()
    assert model() is None and parameter() is None
