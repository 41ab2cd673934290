"""ZeRO-2 and ZeRO-3 train the one-process model (DESIGN.md, "The invariant"): fp64,
1e-9 relative, per-step losses and grad norms, validation loss and every rank's final
weights, at dp 2 and 4, with tp 2 + SP, pp 2 (1f1b, interleaved, zb-h1), cp 2, both
recomputations, ZeRO-3 with its parameters kept gathered, Llama with grouped kv heads;
bf16 within 2% per step; checkpoints moving between ZeRO-3 dp 4 and one process, and a
bf16 ZeRO-3 run resumed bit-exact. The runs of one world size share one spawn.

Also counted, not timed: the all-gathers and reduce-scatters per step (closed forms:
none repeated for a block still gathered) and the gradient and optimizer bytes a rank
holds."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

from gridtrain.config import Config
from gridtrain.parallel.grid import ProcessGrid
from tests.training import SharedSpawns, assert_rank_matches, relative_difference, tiny_config, train_in_process

# name -> (world size, fields); the tiny model (2 layers, 4 heads, seq 64), 10 steps of
# 8 sequences in micro-batches of 2, fp64, unless its fields say otherwise
RUNS: dict[str, tuple[int, dict]] = {
    "z2-dp2": (2, dict(dp=2, zero=2)),
    "z3-dp2": (2, dict(dp=2, zero=3)),
    "z3-dp2-keep": (2, dict(dp=2, zero=3, zero3_keep_gathered=True)),
    "z3-dp2-full": (2, dict(dp=2, zero=3, recompute="full")),
    "z3-dp2-selective": (2, dict(dp=2, zero=3, recompute="selective")),
    "z3-dp2-llama-gqa": (2, dict(dp=2, zero=3, arch="llama", n_kv_head=2)),
    "z3-dp2-bf16": (2, dict(dp=2, zero=3, dtype="bf16")),
    "z3-dp2-bf16-save": (2, dict(dp=2, zero=3, dtype="bf16")),  # saves at step 5
    "z3-dp2-bf16-resumed": (2, dict(dp=2, zero=3, dtype="bf16")),  # resumes it
    "z2-dp4": (4, dict(dp=4, zero=2)),
    "z3-dp4": (4, dict(dp=4, zero=3)),
    "z3-dp4-save": (4, dict(dp=4, zero=3)),  # saves at step 5 for the one-process resume
    "z3-dp4-from-z0": (4, dict(dp=4, zero=3)),  # resumes the one-process checkpoint of step 5
    "z2-dp2-tp2-from-z3": (4, dict(dp=2, tp=2, zero=2)),  # resumes z3-dp4-save's checkpoint
    "z2-dp2-tp2-sp": (4, dict(dp=2, tp=2, sequence_parallel=True, zero=2)),
    "z3-dp2-tp2-sp": (4, dict(dp=2, tp=2, sequence_parallel=True, zero=3)),
    "z3-dp2-pp2-1f1b": (4, dict(dp=2, pp=2, zero=3, schedule="1f1b")),
    "z3-dp2-pp2-zbh1": (4, dict(dp=2, pp=2, zero=3, schedule="zb-h1")),
    "z3-dp2-pp2-full-early": (4, dict(dp=2, pp=2, zero=3, schedule="1f1b", recompute="full", recompute_early=True)),
    "z3-dp2-pp2-zbh1-keep": (4, dict(dp=2, pp=2, zero=3, schedule="zb-h1", zero3_keep_gathered=True)),
    "z2-dp2-pp2-zbh1": (4, dict(dp=2, pp=2, zero=2, schedule="zb-h1")),
    "z3-dp2-pp2-interleaved": (4, dict(dp=2, pp=2, vpp=2, zero=3, schedule="interleaved-1f1b", n_layer=4,
                                       global_batch_size=16)),
    "z3-dp2-cp2": (4, dict(dp=2, cp=2, zero=3)),
    "z1-dp4-hsdp2": (4, dict(dp=4, zero=1, zero_shard_size=2)),
    "z2-dp4-hsdp2": (4, dict(dp=4, zero=2, zero_shard_size=2)),
    "z3-dp4-hsdp2": (4, dict(dp=4, zero=3, zero_shard_size=2)),
    "z3-dp2-cp2-hsdp2": (4, dict(dp=2, cp=2, zero=3, zero_shard_size=2)),
    "z3-dp4-hsdp2-save": (4, dict(dp=4, zero=3, zero_shard_size=2)),  # saves at step 5
}
REFERENCE_FIELDS = ("arch", "n_kv_head", "n_layer", "global_batch_size")
NOT_PARITY = ("z3-dp2-bf16", "z3-dp2-bf16-save", "z3-dp2-bf16-resumed", "z3-dp4-save", "z3-dp4-from-z0",
              "z2-dp2-tp2-from-z3",
              "z3-dp4-hsdp2-save")


@functools.cache
def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="gridtrain-zero-"))


@functools.cache
def reference(**fields) -> dict:
    return train_in_process(tiny_config(**fields))


def _reference_of(name: str) -> dict:
    return reference(**{k: v for k, v in RUNS[name][1].items() if k in REFERENCE_FIELDS})


@functools.cache
def _one_process_checkpoint() -> Path:
    cfg = tiny_config()
    cfg.checkpoint.save, cfg.checkpoint.save_interval = str(_tmp() / "z0"), 5
    train_in_process(cfg)
    return _tmp() / "z0" / "step_0000005"


def _config(name: str) -> Config:
    cfg = tiny_config(**RUNS[name][1])
    if name.endswith("-save"):
        cfg.checkpoint.save, cfg.checkpoint.save_interval = str(_tmp() / name), 5
    if name == "z3-dp2-bf16-resumed":
        cfg.checkpoint.load = str(_tmp() / "z3-dp2-bf16-save" / "step_0000005")
    if name == "z3-dp4-from-z0":
        cfg.checkpoint.load = str(_one_process_checkpoint())
    if name == "z2-dp2-tp2-from-z3":
        cfg.checkpoint.load = str(_tmp() / "z3-dp4-save" / "step_0000005")
    return cfg


run = SharedSpawns(RUNS, _config).run


@pytest.mark.spawn
@pytest.mark.parametrize("name", [n for n in RUNS if n not in NOT_PARITY])
def test_zero_2_and_3_train_the_one_process_model(name):
    """Every rank: losses, grad norms, validation loss and the weights it holds (its TP
    shard of its stage's, gathered whole at the end of the run) equal one process's,
    within 1e-9."""
    world, _ = RUNS[name]
    cfg = _config(name)
    grid = ProcessGrid.build(world, tp=cfg.parallel.tp, pp=cfg.parallel.pp, dp=cfg.parallel.dp, cp=cfg.parallel.cp)
    for rank, rank_run in enumerate(run(name)):
        assert_rank_matches(rank_run, _reference_of(name), cfg, grid.tp_rank(rank))


@pytest.mark.spawn
def test_bf16_zero3_follows_fp64_and_resumes_bit_exact():
    """bf16 ZeRO-3 (parameters gathered in bf16 from fp32 master shards): every step's
    loss within 2% of the fp64 one-process run's; resumed from its step-5 checkpoint,
    the remaining steps are bit for bit the uninterrupted run's."""
    for rank_run in run("z3-dp2-bf16"):
        for step, (x, y) in enumerate(zip(rank_run["losses"], reference()["losses"]), 1):
            assert abs(x - y) <= 0.02 * y, f"step {step}: {x} vs {y}"
    assert run("z3-dp2-bf16-save")[0]["losses"] == run("z3-dp2-bf16")[0]["losses"]
    assert run("z3-dp2-bf16-resumed")[0]["losses"] == run("z3-dp2-bf16")[0]["losses"][5:]


@pytest.mark.spawn
def test_a_checkpoint_moves_between_zero3_dp4_and_one_process():
    """Saved at step 5 by ZeRO-3 on dp 4 (each rank its own shard pieces, nothing
    gathered), resumed on one process without ZeRO and on ZeRO-2 dp 2 x tp 2; saved by
    one process, resumed on ZeRO-3 dp 4: every way the remaining steps are the
    uninterrupted run's."""
    run("z3-dp4-save")
    resumed = tiny_config()
    resumed.checkpoint.load = str(_tmp() / "z3-dp4-save" / "step_0000005")
    assert relative_difference(train_in_process(resumed)["losses"], reference()["losses"][5:]) <= 1e-9
    for rank_run in run("z3-dp4-from-z0"):
        assert relative_difference(rank_run["losses"], reference()["losses"][5:]) <= 1e-9
    for rank_run in run("z2-dp2-tp2-from-z3"):  # and into ZeRO-2 on dp 2 x tp 2
        assert relative_difference(rank_run["losses"], reference()["losses"][5:]) <= 1e-9


@pytest.mark.spawn
def test_a_hybrid_sharded_checkpoint_resumes_on_one_process():
    """Hybrid sharding (ZeRO-3 over pairs of dp 4): the first replica of each shard
    writes it; one process resumes the remaining steps of the uninterrupted run."""
    run("z3-dp4-hsdp2-save")
    resumed = tiny_config()
    resumed.checkpoint.load = str(_tmp() / "z3-dp4-hsdp2-save" / "step_0000005")
    assert relative_difference(train_in_process(resumed)["losses"], reference()["losses"][5:]) <= 1e-9


def _calls(name: str, kind: str, group: str = "dp") -> set[int]:
    """The number of ``kind`` collectives on ``group`` per step, over every step and rank."""
    return {calls.get(f"{kind}/{group}", 0) for r in run(name) for calls in r["step_calls"]}


@pytest.mark.spawn
def test_gathers_and_reduce_scatters_per_step_are_the_closed_form():
    """The tiny model on one stage has three ZeRO-3 units, a bucket each: two blocks and
    the root (embedding, final norm; laid out as one run, last in gradient order). Per
    micro-batch (2 per rank at dp 2): the root is gathered once (kept from its forward
    to its backward), each block twice (forward, backward): 5 all-gathers, 10 per step
    (FSDP2's count for the same wrapping); with --zero3-keep-gathered once per step: 3.
    Every bucket is reduce-scattered once per micro-batch: 6 per step (ZeRO-3), 2 for
    ZeRO-2's one bucket; ZeRO-2 gathers its one bucket once, after the optimizer."""
    assert _calls("z3-dp2", "all_gather") == {2 * (1 + 2 * 2)}
    assert _calls("z3-dp2-keep", "all_gather") == {1 + 2}
    assert _calls("z3-dp2", "reduce_scatter") == {2 * 3}
    assert _calls("z2-dp2", "reduce_scatter") == {2}
    assert _calls("z2-dp2", "all_gather") == {1}


@pytest.mark.spawn
def test_early_recomputation_gathers_a_unit_once():
    """pp 2 (a block and the root per stage), full recomputation rebuilt ahead of
    backward on the first stage: the rebuilt block stays gathered from its early forward
    to its backward, so every rank gathers as often as without recomputation (8 a step),
    not 10 (a third gather of the first stage's block per micro-batch)."""
    assert sum(r["rebuilt_early"] for r in run("z3-dp2-pp2-full-early")) > 0
    assert _calls("z3-dp2-pp2-full-early", "all_gather") == _calls("z3-dp2-pp2-1f1b", "all_gather") == {8}


@pytest.mark.spawn
def test_hybrid_sharding_collectives_per_step():
    """ZeRO-3 sharded over pairs of dp 4 (one micro-batch per rank): a micro-batch's
    gathers (5) and reduce-scatters (3) of the closed form above, inside the pair; an
    all-reduce of each bucket's slice of the gradient shard across the two pairs (the
    shard is made bucket by bucket); nothing over the whole dp group but the step's
    scalars."""
    assert _calls("z3-dp4-hsdp2", "all_gather", "zero_shard") == {1 + 2 * 2}
    assert _calls("z3-dp4-hsdp2", "reduce_scatter", "zero_shard") == {3}
    assert _calls("z3-dp4-hsdp2", "all_reduce", "zero_replica") == {3}
    assert _calls("z3-dp4-hsdp2", "all_gather") == _calls("z3-dp4-hsdp2", "reduce_scatter") == {0}


@pytest.mark.spawn
def test_zero3_keeps_the_activations_of_zero2():
    """Saved activations per layer are the same bytes under ZeRO-3 as under ZeRO-2:
    weights saved by reference to gathered memory are not activations, and the
    activation meter is not confused by the sharded parameters' empty tensors."""
    for z3, z2 in zip(run("z3-dp2"), run("z2-dp2")):
        assert [m.kept for m in z3["memory"]] == [m.kept for m in z2["memory"]]
