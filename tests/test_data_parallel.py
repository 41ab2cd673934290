"""Data parallelism and the full 3D grid on real gloo processes: parity with one process,
equality with torch DDP, bytes per step, buckets launched during backward, unused
parameters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gridtrain.comm import ByteCounter, CommGroup
from gridtrain.config import Config, preset_config
from gridtrain.data_parallel import GradientReducer
from gridtrain.model import GPT, init_parameters
from tests.harness import run_on_ranks
from tests.training import relative_difference, tiny_config, train_in_process, train_layout


def _config(**parallel) -> Config:
    cfg = tiny_config(global_batch_size=16, micro_batch_size=2)
    cfg.model.n_layer = 4
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


_reference: dict[str, dict] = {}


def reference() -> dict:
    if "run" not in _reference:
        _reference["run"] = train_in_process(_config())
    return _reference["run"]


def assert_matches_reference(run: dict, rtol: float = 1e-9) -> None:
    ref = reference()
    for name in ("losses", "grad_norms"):
        assert relative_difference(run[name], ref[name]) <= rtol, name
    assert abs(run["valid_loss"] - ref["valid_loss"]) <= rtol * ref["valid_loss"]


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_data_parallel_trains_the_single_process_model(dp):
    """16 sequences in micro-batches of 2: 4, 2 and 1 micro-batches accumulated per rank;
    weights equal the one-process weights on every rank."""
    runs = train_layout(_config(dp=dp), dp)
    for run in runs:
        assert_matches_reference(run)
        for name, value in run["state"].items():
            assert relative_difference(value, reference()["state"][name]) <= 1e-9, name


def test_small_buckets_give_the_same_model():
    for run in train_layout(_config(dp=2, bucket_mb=0.01), 2):
        assert_matches_reference(run)


LAYOUTS = [(2, 2, 2), (2, 2, 1), (1, 2, 2), (2, 1, 2), (2, 4, 1), (4, 1, 2)]  # (dp, pp, tp)
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]


RECOMPUTE = ["none", "selective", "full"]


def _recompute_mode(layout: tuple[int, int, int], schedule: str) -> str:
    """One recomputation mode per cell, rotating so that every layout meets every mode
    (over its 4 schedules) and every schedule meets every mode (over its 6 layouts): the
    pairs the matrix exists to check, at a third of the runs (the suite's time budget).
    Each mode against one process is also checked on its own in test_recompute.py."""
    return RECOMPUTE[(LAYOUTS.index(layout) + SCHEDULES.index(schedule)) % len(RECOMPUTE)]


def test_the_recompute_rotation_covers_every_pair():
    modes = {(layout, s): _recompute_mode(layout, s) for layout in LAYOUTS for s in SCHEDULES}
    assert all({modes[layout, s] for s in SCHEDULES} == set(RECOMPUTE) for layout in LAYOUTS)
    assert all({modes[layout, s] for layout in LAYOUTS} == set(RECOMPUTE) for s in SCHEDULES)


@pytest.mark.parametrize("dp,pp,tp", LAYOUTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_3d_layout_trains_the_single_process_model(dp, pp, tp, schedule):
    """DESIGN.md invariant over the 3D matrix (fp64, 1e-9, 10 steps), sequence parallel on
    whenever tp > 1, with the cell's recomputation mode (none, selective or full, see
    :func:`_recompute_mode`; the reference recomputes nothing); interleaving uses 2 chunks
    per rank at pp 2 (at pp 4 the 4 blocks leave one per rank, so one chunk: the schedule
    without interleaving)."""
    vpp = 2 if schedule == "interleaved-1f1b" and pp > 1 and 4 % (2 * pp) == 0 else 1
    cfg = _config(dp=dp, pp=pp, tp=tp, vpp=vpp, schedule=schedule, sequence_parallel=tp > 1)
    cfg.training.recompute = _recompute_mode((dp, pp, tp), schedule)
    for run in train_layout(cfg, dp * pp * tp):
        assert_matches_reference(run)


# ---- the reducer against torch DDP, and its counts --------------------------------------------


def _ddp_check(rank: int, world_size: int) -> dict:
    """Same model, same local batches: gridtrain's reducer and torch DDP agree exactly."""
    cfg = preset_config("tiny").model
    ours, theirs = GPT(cfg).double(), GPT(cfg).double()
    init_parameters(ours, 0)
    init_parameters(theirs, 0)
    counter = ByteCounter()
    dp = CommGroup.of("dp", dist.group.WORLD, counter)
    reducer = GradientReducer(ours, dp, accumulations=2, bucket_mb=0.02)
    ddp = nn.parallel.DistributedDataParallel(theirs, bucket_cap_mb=0.02)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, cfg.vocab_size, (2, 16), generator=gen) for _ in range(2)]
    reducer.zero()
    for tokens in batches:  # gridtrain: sum of token losses scaled by dp / global tokens
        (ours(tokens, tokens).sum() * world_size / (2 * 2 * 16 * world_size)).backward()
    launched_during_backward = sum(b.work is not None for b in reducer.buckets)
    reducer.finish()
    with ddp.no_sync():  # DDP: mean loss per rank, averaged by DDP
        (ddp(batches[0], batches[0]).mean() / 2).backward()
    (ddp(batches[1], batches[1]).mean() / 2).backward()
    worst = max(relative_difference(a.grad.numpy(), b.grad.numpy())
                for a, b in zip(ours.parameters(), theirs.parameters()))
    return {"worst": worst, "bytes": counter.bytes[("all_reduce", "dp")],
            "buffer_bytes": reducer.buffer.numel() * 8, "buckets": len(reducer.buckets),
            "launched_during_backward": launched_during_backward, "unused": reducer.stats.unused}


def test_reducer_gradients_equal_torch_ddp():
    for result in run_on_ranks(_ddp_check, 2):
        assert result["worst"] <= 1e-12
        assert result["bytes"] == result["buffer_bytes"]  # the whole buffer, once
        assert result["buckets"] > 2 and result["launched_during_backward"] == result["buckets"]
        assert result["unused"] == []


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()

    def forward(self, x):
        return self.used(x).sum()


def _unused_check(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = _WithUnused()
    reducer = GradientReducer(model, CommGroup.of("dp", dist.group.WORLD, ByteCounter()), accumulations=1)
    reducer.zero()
    model(torch.full((2, 4), float(rank + 1), dtype=torch.float64)).backward()
    reducer.finish()
    return {"unused": reducer.stats.unused, "grad": model.used.bias.grad.tolist(),
            "zeros": bool((model.unused.weight.grad == 0).all())}


def test_parameters_without_gradient_take_part_with_zeros_and_are_named():
    for result in run_on_ranks(_unused_check, 2):
        assert result["unused"] == ["unused.weight", "unused.bias"]
        assert result["zeros"] and result["grad"] == [2.0] * 4  # mean of 2 and 2 rows


def test_dp_bytes_per_step_equal_the_gradient_buffer():
    """One all-reduce of every gradient (fp64 here) per step, in one bucket, plus the token
    count (8 bytes) and the step's scalars (the squared norm, the loss and the non-finite
    flag: 3 x 8 bytes) in one collective; nothing per micro-batch."""
    cfg = _config(dp=2)
    cfg.training.steps = 2
    params = sum(p.numel() for p in GPT(cfg.model).parameters())
    for run in train_layout(cfg, 2):
        for step_bytes, calls in zip(run["step_bytes"], run["step_calls"]):
            assert step_bytes == {"all_reduce/dp": params * 8 + 8 + 24}
            assert calls == {"all_reduce/dp": 1 + 1 + 1}


def test_bf16_training_follows_fp32():
    """bf16 parameters and compute, fp32 master weights and gradient accumulation, on CPU:
    per-step losses within 2% of fp32 over 10 steps. bf16 keeps 8 bits of mantissa
    (relative rounding 2^-9 = 0.2% per operation); over a forward and backward through a
    few layers the loss moves by a fraction of a percent (0.03% measured), and the
    updates then diverge slowly; 2% bounds that with room, far below the loss changes
    training makes (over 20% in 10 steps here)."""
    fp32 = train_in_process(tiny_config(dtype="fp32"))
    bf16 = train_in_process(tiny_config(dtype="bf16"))
    assert relative_difference(fp32["losses"][0], fp32["losses"][-1]) > 0.2
    for a, b in zip(fp32["losses"], bf16["losses"]):
        assert abs(a - b) <= 0.02 * a


# ---- ZeRO-1 and mixed precision ---------------------------------------------------------------


@pytest.mark.parametrize("dp,pp,tp", [(2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2)])
def test_zero1_trains_the_single_process_model(dp, pp, tp):
    """ZeRO-1 (sharded master weights and Adam state) is the same optimizer, split."""
    cfg = _config(dp=dp, pp=pp, tp=tp, sequence_parallel=tp > 1)
    cfg.training.zero = 1
    for run in train_layout(cfg, dp * pp * tp):
        assert_matches_reference(run)
        for name, value in run["state"].items():
            expected = reference()["state"]["embedding.word.weight" if name == "head" else name]
            if tp == 1:
                assert relative_difference(value, expected) <= 1e-9, name


def test_zero1_moves_gradients_and_weights_once_each():
    """Per step: a reduce-scatter of the (padded) gradient buffer and an all-gather of the
    updated weights, instead of an all-reduce: the same bytes, split in two."""
    cfg = _config(dp=2)
    cfg.training.zero, cfg.training.steps = 1, 2
    params = sum(p.numel() for p in GPT(cfg.model).parameters())
    padded = -(-params // 2) * 2
    for run in train_layout(cfg, 2):
        for step_bytes, calls in zip(run["step_bytes"], run["step_calls"]):
            assert step_bytes["reduce_scatter/dp"] == padded * 8
            assert step_bytes["all_gather/dp"] == padded * 8
            assert step_bytes["all_reduce/dp"] == 8 + 24  # token count; norm, loss, flag
            assert calls == {"reduce_scatter/dp": 1, "all_gather/dp": 1, "all_reduce/dp": 2}


def test_zero1_checkpoint_resumes_without_sharding(tmp_path):
    """Adam state saved from 2 shards resumes on one process exactly."""
    cfg = _config(dp=2)
    cfg.training.zero = 1
    cfg.training.save, cfg.training.save_interval = str(tmp_path), 5
    train_layout(cfg, 2)
    resumed = _config()
    resumed.training.load = str(tmp_path / "step_0000005")
    run = train_in_process(resumed)
    assert relative_difference(run["losses"], reference()["losses"][5:]) <= 1e-9


def test_bf16_parameters_with_fp32_master_follow_fp32_under_zero1():
    cfg = _config(dp=2)
    cfg.training.dtype, cfg.training.zero = "bf16", 1
    fp32 = train_in_process(_fp32_reference())
    for run in train_layout(cfg, 2):
        for a, b in zip(fp32["losses"], run["losses"]):
            assert abs(a - b) <= 0.02 * a


def _fp32_reference():
    cfg = _config()
    cfg.training.dtype = "fp32"
    return cfg


def test_fp16_dynamic_loss_scaling_skips_overflowing_steps():
    """fp16 parameters and compute: a scale far too large overflows the gradients, every
    rank skips the step (weights untouched) and the scale halves until gradients fit;
    training then goes on (the following test compares fp16 with fp32 step by step)."""
    cfg = _config(dp=2)
    cfg.training.dtype, cfg.training.zero, cfg.training.loss_scale = "fp16", 1, 2.0 ** 40
    cfg.training.steps = 30
    runs = train_layout(cfg, 2)
    norms = runs[0]["grad_norms"]
    skipped = [n == float("inf") for n in norms]
    assert skipped[0] and not skipped[-1] and 0 < sum(skipped) < 30
    assert skipped == sorted(skipped, reverse=True)  # skips only at the start, until the scale fits
    assert runs[0]["losses"] == runs[1]["losses"]
    assert runs[0]["losses"][-1] < runs[0]["losses"][0] - 0.2  # and then it trains


def test_fp16_without_overflow_follows_fp32():
    fp32 = train_in_process(_fp32_reference())
    cfg = _config()
    cfg.training.dtype, cfg.training.loss_scale = "fp16", 1024.0  # a scale that never overflows here
    fp16 = train_in_process(cfg)
    assert not any(n == float("inf") for n in fp16["grad_norms"])
    for a, b in zip(fp32["losses"], fp16["losses"]):
        assert abs(a - b) <= 0.02 * a


class _Two(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4).to(dtype), nn.Linear(4, 1).to(dtype)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).sum()


@pytest.mark.parametrize("dtype,in_place", [(torch.float64, True), (torch.float32, True),
                                            (torch.bfloat16, False), (torch.float64, False)])
def test_gradients_accumulate_straight_into_the_buffer(dtype, in_place, monkeypatch):
    """Counted, one process: with ``in_place`` and the buffer's dtype, ``param.grad`` is
    the parameter's view of the flat buffer through every micro-batch and the reducer
    copies nothing (no ``add_`` into the buffer); 16-bit parameters (fp32 buffer) or
    ``in_place=False`` (a split backward) take the hook's copy. The accumulated gradient
    is the same either way: the sum over micro-batches."""
    torch.manual_seed(0)
    model = _Two(dtype)
    reducer = GradientReducer(model, CommGroup("dp", size=1), accumulations=3, in_place=in_place)
    copies = []
    add = torch.Tensor.add_
    monkeypatch.setattr(torch.Tensor, "add_", lambda self, *a, **k: copies.append(1) or add(self, *a, **k))
    direct = dtype != torch.bfloat16 and in_place
    xs = [torch.randn(2, 4, dtype=dtype) for _ in range(3)]
    reducer.zero()
    for x in xs:
        model(x).backward()
        for p in model.parameters():
            assert (p.grad is not None and p.grad.data_ptr() == p.main_grad.data_ptr()) == direct
    assert len(copies) == (0 if direct else 3 * 4)
    monkeypatch.undo()
    reducer.finish()
    ref = _Two(dtype)
    ref.load_state_dict(model.state_dict())
    for x in xs:
        ref(x).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.main_grad, q.grad.to(p.main_grad.dtype), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
