"""Muon (``--optimizer muon``): gridtrain's one process equals torch.optim.Muon (with
torch.optim.AdamW for the rest) on the same model, and every layout equals one process
(DESIGN.md, "The invariant": fp64, 1e-9, per-step losses, grad norms and every rank's
weights) at dp 2, ZeRO-1/2/3 at dp 2 and 4, tp 2 + SP, GPT-2's fused QKV under tp 2,
pp 2, cp 2, ep 2 and dp 2 x tp 2 x pp 2. Also as data: the Newton-Schulz iterations, the
parameter split, the owners, the state bytes and the exchange's bytes per step; and
checkpoints: Muon resumes bit-exact, reshards, and refuses to resume AdamW's state
unless --reset-optimizer. The runs of one world size share one spawn."""

from __future__ import annotations

import functools
import math
import tempfile
from pathlib import Path

import pytest
import torch

import gridtrain.training.trainer as trainer_module
from gridtrain.checkpoint import CheckpointError, check_loadable
from gridtrain.config import Config, preset_config, set_fields
from gridtrain.models.decoder import Decoder
from gridtrain.optim import muon
from gridtrain.optim.optimizer import AdamW as AdamWInterface
from gridtrain.parallel.comm import CommGroup, Pending
from gridtrain.parallel.grid import ProcessGrid
from gridtrain.parallel.distributed import shutdown
from gridtrain.parallel.tensor_parallel import ShardSpec
from tests.training import SharedSpawns, assert_rank_matches, train_in_process

RECIPE = dict(dtype="fp64", steps=6, global_batch_size=8, micro_batch_size=2, eval_interval=0, eval_iters=1,
              progress=False, lr=3e-3, warmup_steps=1)


def muon_config(preset: str = "llama-tiny", **fields) -> Config:
    return set_fields(preset_config(preset), **{**RECIPE, "optimizer": "muon", **fields})


# ---- the pieces, as data -----------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch >= 2.9")
@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 32)])
def test_newton_schulz_is_torchs_bit_for_bit_in_bf16(shape):
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert muon.NS_COEFFICIENTS == (DEFAULT_A, DEFAULT_B, DEFAULT_C) and muon.NS_EPS == EPS
    expected = _zeropower_via_newtonschulz(g, muon.NS_COEFFICIENTS, 5, EPS)
    assert torch.equal(muon.newton_schulz(g, 5, torch.bfloat16), expected)


def test_newton_schulz_orthogonalises():
    """Five quintic steps bring every singular value near 1 (0.5-1.5: the quintic's band)."""
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    s = torch.linalg.svdvals(muon.newton_schulz(g, 5, torch.float64))
    assert 0.5 < s.min() and s.max() < 1.5
    assert muon.ns_flops((24, 40), 5) == 5 * (4 * 24 * 24 * 40 + 2 * 24 ** 3)


def test_the_blocks_matrices_take_muon_and_the_rest_adamw():
    for preset in ("tiny", "llama-tiny", "moe-tiny", "deepseek-tiny"):
        model = Decoder(preset_config(preset).model)
        for name, p in model.named_parameters():
            expected = p.ndim == 2 and (name.startswith("blocks.") or name.startswith("mtp.")) and "router" not in name
            assert muon.uses_muon(name, tuple(p.shape)) == expected, name
    model = Decoder(preset_config("deepseek-tiny").model)
    names = {n for n, p in model.named_parameters() if muon.uses_muon(n, tuple(p.shape))}
    assert "blocks.1.mlp.experts.3.down.weight" in names and "mtp.0.proj.weight" in names
    assert not names & {"head", "embedding.word.weight", "blocks.1.mlp.router.weight", "blocks.0.attn.q_a_norm.weight"}


def test_learning_rate_rules():
    assert muon.lr_ratio("original", (64, 16)) == 2.0 and muon.lr_ratio("original", (16, 64)) == 1.0
    assert muon.lr_ratio("match-rms", (16, 64)) == pytest.approx(0.2 * 8)
    assert muon.default_muon_lr(1e-3, "match-rms", 1024) == 1e-3
    assert muon.default_muon_lr(1e-3, "original", 1024) == pytest.approx(0.2 * 32 * 1e-3)
    if hasattr(torch.optim, "Muon"):
        from torch.optim._muon import _adjust_lr
        for shape in ((64, 16), (16, 64)):
            assert muon.lr_ratio("original", shape) == _adjust_lr(1.0, "original", torch.Size(shape))
            assert muon.lr_ratio("match-rms", shape) == _adjust_lr(1.0, "match_rms_adamw", torch.Size(shape))


def test_owners_balance_the_work_and_agree_everywhere():
    costs = [8.0, 1.0, 4.0, 4.0, 2.0, 1.0]
    owners = muon.balanced_owners(costs, 2)
    assert owners == muon.balanced_owners(list(costs), 2)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)]
    assert loads == [10.0, 10.0]
    assert muon.balanced_owners([1.0], 4) == [0]


def test_exchange_rounds_cover_the_matrices_in_order():
    assert muon.exchange_rounds(list(range(10)), 4) == [[0, 1], [2, 3, 4], [5, 6], [7, 8, 9]]
    assert muon.exchange_rounds(list(range(3)), 4) == [[0], [1], [2]]
    assert muon.exchange_rounds([], 4) == []
    from gridtrain.planner.cost import MUON_EXCHANGE_ROUNDS
    assert MUON_EXCHANGE_ROUNDS == muon.MatrixExchange.__dataclass_fields__["rounds"].default  # the planner's


class _Issued(CommGroup):
    """A data-parallel group of two whose all_to_alls are logged, not sent (what comes
    back is zeros of the right size: the order of the calls is under test)."""

    def start_all_to_all(self, tensor, send_splits, recv_splits):
        self.log.append("exchange")
        return Pending.ready(torch.zeros(sum(recv_splits), dtype=tensor.dtype))


def test_the_next_rounds_gather_travels_while_a_round_iterates(monkeypatch):
    """Rank 0 of dp 2, owning every other matrix: round k+1's gather is issued before
    round k's iterations and round k's scatter right after them, so on a device both
    travel behind Newton-Schulz of other matrices (NCCL's stream, gloo's thread)."""
    log: list[str] = []
    dp = _Issued("dp", size=2, rank=0)
    dp.log = log
    tp = CommGroup("tp")
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(8)]
    matrices = [muon.Matrix(p, (4, 4), None, tp, dp, [[(0, 8)], [(8, 16)]]) for p in params]
    exchange = muon.MatrixExchange(matrices, steps=1, dtype=torch.float32, rounds=4)
    owned = [m.dp_owner == 0 for m in matrices]
    assert owned.count(True) == 4
    iterated = muon.orthogonalise
    monkeypatch.setattr(muon, "orthogonalise", lambda *a: log.append("iterate") or iterated(*a))
    exchange.orthogonalised({m.param: {(0, 8): torch.randn(8)} for m in matrices})
    rounds = muon.exchange_rounds(matrices, 4)
    expected = ["exchange"]  # round 0's gather; then per round k: round k+1's gather, k's iterations, k's scatter
    for k, ms in enumerate(rounds):
        expected += ["exchange"] * (k + 1 < len(rounds)) + ["iterate"] * sum(m.dp_owner == 0 for m in ms)
        expected.append("exchange")
    assert log == expected


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch >= 2.9")
def test_a_fused_qkv_is_orthogonalised_as_three_matrices():
    """GPT-2's QKV (parts 3 along the rows): Newton-Schulz on Q, K and V apart, as
    torch.optim.Muon steps three separate parameters."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    qkv = torch.randn(3 * 16, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    done = muon.orthogonalise(qkv, ShardSpec(dim=0, parts=3), 5, torch.bfloat16)
    for part, got in zip(qkv.chunk(3), done.chunk(3)):
        assert torch.equal(got, _zeropower_via_newtonschulz(part, muon.NS_COEFFICIENTS, 5, muon.NS_EPS))
    assert muon.matrix_shapes((48, 16), ShardSpec(dim=0, parts=3)) == [(16, 16)] * 3


# ---- one process against torch ----------------------------------------------------------------

class _TorchPair:
    """torch.optim.Muon on the Muon parameters and torch.optim.AdamW on the rest (decay on
    matrices and embeddings), behind gridtrain's torch-optimizer wrapper."""

    def __init__(self, model, o, d_model: int):
        names = {p: n for n, p in model.named_parameters()}
        matrices = [p for p in model.parameters() if muon.uses_muon(names[p], tuple(p.shape))]
        rest = [p for p in model.parameters() if not muon.uses_muon(names[p], tuple(p.shape))]
        self.ratio = muon.default_muon_lr(o.lr, o.muon_adjust_lr, d_model) / o.lr
        self.muon = torch.optim.Muon(matrices, lr=o.lr * self.ratio, weight_decay=o.weight_decay,
                                     momentum=o.muon_momentum, nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps,
                                     adjust_lr_fn={"original": "original", "match-rms": "match_rms_adamw"}[
                                         o.muon_adjust_lr])
        self.adam = torch.optim.AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": o.weight_decay},
                                       {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}],
                                      lr=o.lr, betas=(o.beta1, o.beta2), eps=o.adam_eps)
        self.param_groups = [{"lr": o.lr, "params": matrices + rest}]
        self.state: dict = {}

    def step(self):
        lr = self.param_groups[0]["lr"]
        for g in self.adam.param_groups:
            g["lr"] = lr
        for g in self.muon.param_groups:
            g["lr"] = lr * self.ratio
        self.muon.step()
        self.adam.step()


def _torch_reference(cfg: Config, monkeypatch) -> dict:
    cfg = set_fields(cfg, optimizer="adamw")
    monkeypatch.setattr(trainer_module, "make_optimizer", lambda model, reducer, c, ctx, shards=None: AdamWInterface(
        _TorchPair(model, c.optim, c.model.d_model), None, ctx.device))
    return train_in_process(cfg)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch >= 2.9")
@pytest.mark.parametrize("preset,fields", [("llama-tiny", {}), ("moe-tiny", {"muon_adjust_lr": "match-rms"}),
                                           ("deepseek-tiny", {"muon_nesterov": False})])
def test_one_process_is_torchs_muon_and_adamw(preset, fields, monkeypatch):
    """Newton-Schulz in bf16 as torch runs it: the same numbers bit for bit (latent
    attention, multi-token prediction and experts included). Without clipping: the flat
    gradient's norm sums in another order than a per-parameter one (the last bit)."""
    cfg = muon_config(preset, muon_ns_dtype="bf16", grad_clip=0.0, **fields)
    mine = train_in_process(cfg)
    expected = _torch_reference(cfg, monkeypatch)
    assert mine["losses"] == expected["losses"]
    for name, value in expected["state"].items():
        assert (mine["state"][name] == value).all(), name


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch >= 2.9")
def test_one_process_in_fp64_is_torchs_muon_iterated_in_fp64(monkeypatch):
    """fp64 runs iterate in fp64 (the parity runs' precision): torch's Muon with its
    iterations in fp64 instead of bf16, within 1e-9."""
    import torch.optim._muon as torch_muon
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz",
                        lambda g, coefficients, steps, eps: muon.newton_schulz(g, steps, torch.float64))
    cfg = muon_config()
    mine = train_in_process(cfg)
    expected = _torch_reference(cfg, monkeypatch)
    assert max(abs(a - b) / b for a, b in zip(mine["losses"], expected["losses"])) <= 1e-12
    for name, value in expected["state"].items():
        assert abs(mine["state"][name] - value).max() <= 1e-9 * abs(value).max(), name


# ---- every layout equals one process ----------------------------------------------------------

# name -> (world size, fields): llama-tiny unless "preset" says otherwise
RUNS: dict[str, tuple[int, dict]] = {
    "dp2": (2, dict(dp=2)),
    "z1-dp2": (2, dict(dp=2, zero=1)),
    "z2-dp2": (2, dict(dp=2, zero=2)),
    "z3-dp2": (2, dict(dp=2, zero=3)),
    "z3-dp2-save": (2, dict(dp=2, zero=3)),  # saves at step 3 for the one-process resume
    "tp2-sp": (2, dict(tp=2, sequence_parallel=True)),
    "gpt2-tp2": (2, dict(preset="tiny", tp=2)),  # fused QKV split over tp
    "pp2": (2, dict(pp=2)),
    "cp2": (2, dict(cp=2)),
    # MoE: the same micro-batches per step on every layout (their load-balancing loss is per micro-batch)
    "ep2": (2, dict(preset="moe-tiny", dp=2, ep=2, micro_batch_size=1)),
    "z1-dp4": (4, dict(dp=4, zero=1)),
    "z3-dp4": (4, dict(dp=4, zero=3, recompute="full")),
    "ep2-z2-dp4": (4, dict(preset="moe-tiny", dp=4, ep=2, zero=2, global_batch_size=16, micro_batch_size=1)),
    "3d": (8, dict(dp=2, tp=2, pp=2, zero=1, sequence_parallel=True)),
}


@functools.cache
def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="gridtrain-muon-"))


def _config(name: str) -> Config:
    fields = dict(RUNS[name][1])
    cfg = muon_config(fields.pop("preset", "llama-tiny"), **fields)
    if name.endswith("-save"):
        cfg.checkpoint.save, cfg.checkpoint.save_interval = str(_tmp() / name), 3
    return cfg


@functools.cache
def reference(preset: str, global_batch_size: int = 8, micro_batch_size: int = 2) -> dict:
    return train_in_process(muon_config(preset, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size))


def _reference_of(name: str) -> dict:
    """One process with the run's micro-batches per step (MoE) or the recipe's."""
    fields = RUNS[name][1]
    preset = fields.get("preset", "llama-tiny")
    if preset != "moe-tiny":
        return reference(preset)
    batch = fields.get("global_batch_size", 8)
    return reference(preset, batch, fields["micro_batch_size"] * fields.get("dp", 1))


run = SharedSpawns(RUNS, _config).run


@pytest.mark.spawn
@pytest.mark.parametrize("name", [n for n in RUNS if not n.endswith("-save")])
def test_every_layout_trains_the_one_process_model(name):
    world = RUNS[name][0]
    cfg = _config(name)
    p = cfg.parallel
    grid = ProcessGrid.build(world, tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp)
    for rank, rank_run in enumerate(run(name)):
        assert_rank_matches(rank_run, _reference_of(name), cfg, grid.tp_rank(rank))


def _muon_numel(preset: str, tp: int = 1) -> int:
    """Elements of the Muon matrices of one tp rank's model (tp-split ones / tp)."""
    model = Decoder(preset_config(preset).model)
    return sum(p.numel() for n, p in model.named_parameters() if muon.uses_muon(n, tuple(p.shape))) // tp


@pytest.mark.spawn
def test_the_exchange_moves_each_matrix_to_its_owner_and_back_once():
    """Counted per step (all_to_all payload, a rank's own part included): over the ZeRO
    group every rank sends its slices of the Muon matrices and every owner sends back
    what it owns, 2 x 8 bytes x the Muon elements in all; over tp every rank sends its
    shards and each owner returns tp shards of what it owns: 2 x 8 bytes x the
    one-process elements of the tp-split matrices. Without sharding nothing moves."""
    def total(name: str, group: str) -> set[int]:
        ranks = run(name)
        return {sum(r["step_bytes"][k].get(f"all_to_all/{group}", 0) for r in ranks) for k in range(RECIPE["steps"])}
    n = _muon_numel("llama-tiny")
    assert total("z1-dp2", "dp") == {2 * 8 * n}
    assert total("z3-dp2", "dp") == {2 * 8 * n}
    assert total("z1-dp4", "dp") == {2 * 8 * n}
    assert total("dp2", "dp") == {0}
    assert total("tp2-sp", "tp") == {2 * 8 * n}  # every llama-tiny matrix is split over tp


@pytest.mark.parametrize("optimizer,state", [("adamw", "fp32"), ("muon", "fp32"), ("adamw", "bf16"),
                                             ("muon", "bf16")])
def test_state_bytes_are_the_closed_form(optimizer, state):
    """A rank keeps fp32 masters for its shard, two AdamW moments for AdamW's elements
    and one buffer for Muon's, 4 bytes each or 2 with --optimizer-state-dtype bf16; the
    memory model says the same."""
    from gridtrain.memory.model import expected_bytes
    from gridtrain.training.providers import decoder_forward_step, decoder_model_provider
    from gridtrain.training.trainer import build
    cfg = muon_config(dtype="bf16", optimizer=optimizer, optimizer_state_dtype=state)
    try:
        trainer = build(cfg, decoder_model_provider, decoder_forward_step)
        total = sum(p.numel() for p in trainer.model.parameters())
        matrices = _muon_numel("llama-tiny") if optimizer == "muon" else 0
        shard = trainer.reducer.shard_numel
        moment = 2 if state == "bf16" else 4
        moments = 2 * (total - matrices) + matrices if optimizer == "muon" else 2 * shard
        assert trainer.optimizer.state_bytes() == 4 * shard + moment * moments
        modelled = expected_bytes(cfg, ProcessGrid.build(1), 0)["optimizer_bytes"]
        assert modelled == pytest.approx(trainer.optimizer.state_bytes(), rel=0.01)
    finally:
        shutdown()


# ---- checkpoints ------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [{}, {"optimizer_state_dtype": "bf16", "dtype": "bf16"}])
def test_muon_resumes_bit_exact(tmp_path, fields):
    cfg = muon_config(**fields)
    cfg.checkpoint.save, cfg.checkpoint.save_interval = str(tmp_path), 3
    straight = train_in_process(cfg)
    resumed_cfg = muon_config(**fields)
    resumed_cfg.checkpoint.load = str(tmp_path / "step_0000003")
    resumed = train_in_process(resumed_cfg)
    assert resumed["losses"] == straight["losses"][3:]
    for name, value in straight["state"].items():
        assert (resumed["state"][name] == value).all(), name


@pytest.mark.spawn
def test_a_zero3_muon_checkpoint_resumes_on_one_process():
    run("z3-dp2-save")
    cfg = muon_config()
    cfg.checkpoint.load = str(_tmp() / "z3-dp2-save" / "step_0000003")
    resumed = train_in_process(cfg)
    straight = reference("llama-tiny")
    assert max(abs(a - b) / b for a, b in zip(resumed["losses"], straight["losses"][3:])) <= 1e-9


def test_switching_optimizer_on_resume_needs_reset_optimizer(tmp_path):
    cfg = muon_config(optimizer="adamw", steps=2)
    cfg.checkpoint.save = str(tmp_path)
    adamw = train_in_process(cfg)
    switched = muon_config(steps=4)
    switched.checkpoint.load = str(tmp_path)
    with pytest.raises(CheckpointError, match="optimizer is adamw and this run's is muon.*--reset-optimizer"):
        check_loadable(tmp_path, switched)
    switched.checkpoint.reset_optimizer = True
    check_loadable(tmp_path, switched)
    resumed = train_in_process(switched)
    assert len(resumed["losses"]) == 2 and math.isfinite(resumed["losses"][-1])
    assert resumed["losses"][0] != adamw["losses"][-1]


# ---- planned ----------------------------------------------------------------------------------

def test_the_memory_model_holds_the_dry_runs_muon_state():
    """The dry run of Muon's optimizer (its real code on fake tensors, every rank) against
    the memory model's closed form, ZeRO 0, 1 and 3, summed over the ranks: within the
    blocks' vectors. (A rank's own share of the matrices depends on where its bucket
    slices fall: near the mean for models of many buckets, not for this one of one.)"""
    from gridtrain.dryrun import dry_run
    from gridtrain.memory.model import expected_bytes
    for fields in (dict(dp=4, zero=1), dict(dp=4, zero=3), dict(tp=2, dp=2)):
        cfg = muon_config(dtype="bf16", device="cpu", **fields)
        grid = ProcessGrid.build(4, tp=cfg.parallel.tp, pp=1, dp=cfg.parallel.dp)
        ranks = dry_run(cfg, 4, "all", out=lambda *a, **k: None)["ranks"]
        measured = sum(r["optimizer_bytes"] for r in ranks)
        modelled = sum(expected_bytes(cfg, grid, r)["optimizer_bytes"] for r in range(4))
        assert modelled == pytest.approx(measured, rel=0.01), fields


def test_plan_costs_muon_and_reports_it(capsys, no_process_may_start):
    import json

    from gridtrain.cli import parser as cli
    from gridtrain.planner.cost import Job, Layout, muon_seconds, predict
    from gridtrain.planner.machine import machine
    plan = ["plan", "--model", "llama3-8b", "--gpus", "64", "--hardware", "h100-sxm", "--seq-len", "8192",
            "--global-batch-size", "128", "--zero", "1", "--tp", "1", "--pp", "1", "--top", "1", "--json"]
    rows = {}
    for optimizer in ("adamw", "muon"):
        assert cli.main([*plan, "--optimizer", optimizer]) == 0
        rows[optimizer] = json.loads(capsys.readouterr().out)["layouts"][0]
    mu, adam = rows["muon"]["optimizer"], rows["adamw"]["optimizer"]
    assert mu["name"] == "muon" and adam["name"] == "adamw" and adam["newton_schulz_s"] == 0
    assert mu["state_gb"] < adam["state_gb"]  # one buffer per matrix element, not two moments
    assert mu["step_s"] == pytest.approx(adam["step_s"] + mu["newton_schulz_s"] + mu["exchange_s"])
    assert "--optimizer muon" in rows["muon"]["command"]
    job = Job(preset_config("llama3-8b").model, 128, machine("h100-sxm", 64), optimizer="muon")
    one, spread = (muon_seconds(job, Layout(dp=64, tp=1, pp=1, micro_batch_size=1, zero=z)) for z in (0, 1))
    assert spread[0] == pytest.approx(one[0] / 64) and one[2] == 0  # the iterations shared by ZeRO's owners
    assert predict(job, Layout(dp=64, tp=1, pp=1, micro_batch_size=1, zero=1)).optimizer == "muon"


# ---- optimizer offload ---------------------------------------------------------------------------

def test_offload_on_cpu_changes_nothing_and_says_so():
    from gridtrain.training.providers import decoder_forward_step, decoder_model_provider
    from gridtrain.training.trainer import build
    for optimizer in ("adamw", "muon"):
        plain = train_in_process(muon_config(dtype="bf16", optimizer=optimizer))
        offloaded = train_in_process(muon_config(dtype="bf16", optimizer=optimizer, optimizer_offload=True))
        assert offloaded["losses"] == plain["losses"]
    try:
        trainer = build(muon_config(optimizer_offload=True), decoder_model_provider, decoder_forward_step)
        assert any("--optimizer-offload" in note and "nothing moves" in note for note in trainer.notes)
    finally:
        shutdown()


def test_plan_counts_bf16_states_and_offload(capsys, no_process_may_start):
    import json

    from gridtrain.cli import parser as cli
    plan = ["plan", "--model", "llama3-8b", "--gpus", "8", "--hardware", "h100-sxm", "--seq-len", "8192",
            "--global-batch-size", "64", "--zero", "1", "--tp", "1", "--pp", "1", "--cp", "1", "--micro-batch-size",
            "1", "--recompute", "full", "--top", "1", "--json", "--optimizer", "muon"]
    state = {}
    for extra in ((), ("--optimizer-state-dtype", "bf16"), ("--optimizer-offload",)):
        assert cli.main([*plan, *extra]) == 0
        row = json.loads(capsys.readouterr().out)["layouts"][0]
        state[extra] = row["optimizer"]["state_gb"]
        assert all(flag in row["command"] for flag in extra)
    full, half, off = state.values()
    # masters 4 bytes and moments 4 -> 2: (4 + 2 m) / (4 + 4 m) of it, m the moments per element (~1)
    assert 0.7 * full < half < 0.8 * full and off == 0
