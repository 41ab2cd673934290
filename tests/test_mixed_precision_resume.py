"""Exact resume of bf16 and fp16 runs, and the distributed optimizer's memory per rank.

A 16-bit run's state is more than its weights: the parameters are rounded copies of the
fp32 master weights, and fp16 also has a dynamic loss scale that decides which steps are
skipped. Checkpoints keep both, so a run stopped at step K and resumed on the same layout
continues bit for bit as the uninterrupted run: the tests compare steps K+1..N (losses
and gradient norms), the final weights and the final master weights exactly, in one
process and on dp 2 with ZeRO-1 (real gloo processes). A bf16 ZeRO-1 checkpoint also
loads on one process with its master weights intact.

The optimizer's memory is counted, not estimated: :meth:`DistributedOptimizer.state_bytes`
counts every storage it keeps alive, so a mask or a view of a whole-model tensor would
show up; with ZeRO-1 it must be exactly ``3 x 4 bytes x padded / dp`` for fp32 masters.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gridtrain import checkpoint
from gridtrain.parallel.comm import CommGroup, single
from gridtrain.config import Config, preset_config
from gridtrain.parallel.data_parallel import GradientReducer
from gridtrain.parallel.distributed import shutdown
from gridtrain.optim.distributed_optimizer import DistributedOptimizer
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.training.providers import decoder_forward_step, decoder_model_provider, text_datasets_provider
from gridtrain.training.loop import pretrain
from gridtrain.training.trainer import build
from tests.harness import run_on_ranks
from tests.training import relative_difference, summarize, tiny_config, train_in_process

N, K = 6, 3  # train N steps; the resumed run starts from the checkpoint after step K
# fp16: a first scale that overflows (the first two steps are skipped) and a short growth
# window (the scale doubles every two good steps): at step K the scaler has a scale
# other than the first and is half-way through a window, so a resume that lost its state
# would skip or scale other steps. Each micro-batch's loss is scaled by dp / tokens, so
# the same overflows need a first scale divided by dp (measured: 2^19 on one process
# skips steps 1 and 2, then trains).
FP16_SCALE, FP16_WINDOW = 2.0 ** 19, 2


def _pair(root, dtype: str, **parallel) -> tuple[Config, Config]:
    """An N-step run saving every K steps, and the same run resumed from its step K."""
    configs = []
    for name in ("straight", "resumed"):
        cfg = tiny_config(dtype=dtype, steps=N)
        if dtype == "fp16":
            cfg.training.loss_scale = FP16_SCALE / parallel.get("dp", 1)
            cfg.training.loss_scale_window = FP16_WINDOW
        for key, value in parallel.items():
            setattr(cfg.parallel, key, value)
        cfg.parallel.zero = 1 if parallel else 0
        cfg.checkpoint.save, cfg.checkpoint.save_interval = str(root / f"{dtype}-{name}"), K
        configs.append(cfg)
    configs[1].checkpoint.load = str(checkpoint.step_dir(configs[0].checkpoint.save, K))
    return configs[0], configs[1]


def _saved(cfg: Config, step: int) -> dict:
    """What the checkpoint after ``step`` holds beyond the weights: ``state``, each
    parameter's whole optimizer tensors by name (``optim/<name>/<what>`` read through
    DCP, whatever layout wrote them), and meta.json's ``optimizer`` and ``scaler``."""
    path = checkpoint.step_dir(cfg.checkpoint.save, step)
    index = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
               for key, md in index.items() if key.startswith("optim/")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: meant
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        _, name, what = key.split("/")
        state.setdefault(name, {})[what] = value
    meta = json.loads((path / checkpoint.META).read_text())
    return {"state": state, "optimizer": meta["optimizer"], "scaler": meta["scaler"]}


def _assert_continues_exactly(straight: dict, resumed: dict, cfgs: tuple[Config, Config]) -> None:
    assert resumed["losses"] == straight["losses"][K:]
    assert resumed["grad_norms"] == straight["grad_norms"][K:]
    for name, value in straight["state"].items():
        assert (resumed["state"][name] == value).all(), name
    a, b = (_saved(cfg, N) for cfg in cfgs)
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for name, state in a["state"].items():
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "master"], name
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], b["state"][name][key]), (name, key)
    assert a["scaler"] == b["scaler"]
    assert a["optimizer"] == b["optimizer"]  # step count (fp16: without the skipped steps), groups


def _assert_state_matters(cfg: Config, dtype: str) -> None:
    """What the checkpoint at K holds beyond the weights file, so that these tests would
    fail without it: masters that 16-bit weights cannot represent, and (fp16) a scaler
    that has skipped steps and no longer has its initial scale."""
    saved = _saved(cfg, K)
    master = saved["state"]["blocks.0.attn.qkv.weight"]["master"]
    assert master.dtype == torch.float32
    assert not torch.equal(master, master.to(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype])).float())
    if dtype == "fp16":
        scaler = saved["scaler"]
        assert scaler["skipped"] > 0 and scaler["scale"] != cfg.training.loss_scale, scaler
        assert scaler["good_steps"] % FP16_WINDOW, scaler
    else:
        assert saved["scaler"] is None


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16bit_run_resumes_bit_for_bit_on_one_process(tmp_path, dtype):
    cfgs = _pair(tmp_path, dtype)
    straight = train_in_process(cfgs[0])
    resumed = train_in_process(cfgs[1])
    _assert_state_matters(cfgs[0], dtype)
    if dtype == "fp16":
        skipped = [n == float("inf") for n in straight["grad_norms"]]
        assert any(skipped[:K]) and not all(skipped), straight["grad_norms"]
    _assert_continues_exactly(straight, resumed, cfgs)


def _dp2_worker(rank: int, world_size: int, cfgs: list[Config]) -> dict:
    """The runs in order on these ranks, and the optimizer's bytes on each rank."""
    trainer = build(cfgs[0], decoder_model_provider, decoder_forward_step)
    return {"state_bytes": trainer.optimizer.state_bytes(), "padded": trainer.reducer.padded,
            "runs": [summarize(pretrain(decoder_model_provider, text_datasets_provider, decoder_forward_step, cfg))
                     for cfg in cfgs]}


@pytest.mark.spawn
def test_16bit_zero1_runs_resume_bit_for_bit_on_dp2_and_load_on_one_process(tmp_path):
    """dp 2 + ZeRO-1 on real processes: each DP rank writes the pieces of its own shard
    and reads back those it owns; bf16 and fp16 resume bit for bit, and the bf16
    checkpoint loads on one process (no sharding) with the same masters and moments."""
    bf16, fp16 = _pair(tmp_path, "bf16", dp=2), _pair(tmp_path, "fp16", dp=2)
    ranks = run_on_ranks(_dp2_worker, 2, [*bf16, *fp16], timeout_s=600)
    for out in ranks:  # fp32 master + two moments, 1/2 of the padded vector each; nothing else
        assert out["state_bytes"] == 3 * 4 * out["padded"] // 2
    for rank, out in enumerate(ranks):
        for i, (cfgs, dtype) in enumerate([(bf16, "bf16"), (fp16, "fp16")]):
            straight, resumed = out["runs"][2 * i], out["runs"][2 * i + 1]
            _assert_continues_exactly(straight, resumed, cfgs)
            if rank == 0:
                _assert_state_matters(cfgs[0], dtype)

    # the dp 2 ZeRO-1 checkpoint on one process, without sharding: masters intact
    one = tiny_config(dtype="bf16", steps=N)
    one.checkpoint.load = bf16[1].checkpoint.load
    saved = _saved(bf16[0], K)["state"]
    try:
        trainer = build(one, decoder_model_provider, decoder_forward_step)
        opt = trainer.optimizer
        assert isinstance(opt, DistributedOptimizer) and not trainer.reducer.shard and opt.steps == K
        for p, o in zip(opt.params, opt.offsets):
            name = trainer.reducer.names[p]
            source = "embedding.word.weight" if name == "head" else name
            for key, flat in (("master", opt.master), ("exp_avg", opt.exp_avg), ("exp_avg_sq", opt.exp_avg_sq)):
                mine, rows = flat[o: o + p.numel()].view_as(p), saved[source][key].shape[0]
                assert torch.equal(mine[:rows], saved[source][key]), (name, key)
                assert not mine[rows:].any(), (name, key)  # vocabulary padding rows
    finally:
        shutdown()
    # and it trains on from there as the dp 2 run did (another layout: close, not bitwise)
    continued = train_in_process(one)
    assert relative_difference(continued["losses"], ranks[0]["runs"][0]["losses"][K:]) <= 0.01


# ---- optimizer memory per rank, counted ---------------------------------------------------


@pytest.mark.parametrize("dtype,dp,zero", [("bf16", 1, 0), ("bf16", 2, 1), ("bf16", 4, 1), ("bf16", 8, 1),
                                           ("fp64", 2, 1)])
def test_optimizer_bytes_per_rank_are_the_closed_form(dtype, dp, zero):
    """Each DP rank of a ZeRO-1 layout keeps master weights and two moments for its
    ``padded / dp`` elements and nothing else (no masks, no views of whole-model
    tensors); the ranks' shards tile the model, boundaries falling inside parameters;
    weight decay covers exactly the matrices' elements. The DP group is a stand-in of
    size dp (building the optimizer issues no collective), so every rank is checked in
    this process."""
    cfg = preset_config("tiny")
    param_dtype = {"bf16": torch.bfloat16, "fp64": torch.float64}[dtype]
    master_dtype = torch.float64 if dtype == "fp64" else torch.float32
    model = Decoder(cfg.model)
    init_parameters(model, 0)
    model = model.to(param_dtype)
    numel = sum(p.numel() for p in model.parameters())
    masters, decayed = [], []
    for rank in range(dp):
        group = CommGroup("dp", size=dp, rank=rank)
        reducer = GradientReducer(model, group, accumulations=1, shard=zero == 1)
        opt = DistributedOptimizer(reducer, cfg.optim, dp=group, mp=single("mp"), tp_rank=0,
                                   master_dtype=master_dtype)
        padded = -(-numel // dp) * dp if zero else numel
        assert reducer.padded == padded
        element = torch.finfo(master_dtype).bits // 8
        assert opt.state_bytes() == 3 * element * padded // (dp if zero else 1)
        masters.append(opt.master.clone())
        probe = torch.ones_like(opt.master)
        torch._foreach_mul_([probe[v.storage_offset(): v.storage_offset() + v.numel()] for v in opt._decayed], 0.0)
        decayed.append(probe == 0)
    flat = torch.cat([p.detach().reshape(-1).to(master_dtype) for p in opt.params])
    assert torch.equal(torch.cat(masters)[:numel], flat) and not torch.cat(masters)[numel:].any()
    matrix = torch.cat([torch.full((p.numel(),), p.ndim >= 2) for p in opt.params])
    assert torch.equal(torch.cat(decayed)[:numel], matrix)
