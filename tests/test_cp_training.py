"""Context parallelism trains the one-process model (DESIGN.md, "The invariant"): fp64,
1e-9 relative, per-step losses and grad norms, validation loss and final weights, over
cp 2 and 4 with both attention modes, with tp + SP, pp (1f1b, interleaved, zb-h1),
dp + ZeRO-1,
Llama's grouped and replicated key/value heads, both recomputations, and checkpoints
moving between cp 2 and cp 1. The runs of one world size share one spawn.

Also counted, not timed: the bytes each rank's attention sends per step (closed forms)
and the activations each rank keeps for backward (about 1/cp of one process's)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

from gridtrain.config import Config
from gridtrain.memory.cp import cp_attention_bytes
from gridtrain.parallel.grid import ProcessGrid
from tests.training import SharedSpawns, assert_rank_matches, relative_difference, tiny_config, train_in_process

# name -> (world size, fields); every run is the tiny model (2 layers, 4 heads, seq 64),
# 10 steps of 4 micro-batches of 2 in fp64 unless its fields say otherwise
RUNS: dict[str, tuple[int, dict]] = {
    "cp2-ring": (2, dict(cp=2)),
    "cp2-allgather": (2, dict(cp=2, cp_comm="allgather")),
    "cp2-selective": (2, dict(cp=2, recompute="selective")),
    "cp2-full-allgather": (2, dict(cp=2, cp_comm="allgather", recompute="full")),
    "cp2-llama-gqa": (2, dict(cp=2, arch="llama", n_kv_head=2)),
    "cp2-from-cp1": (2, dict(cp=2)),  # resumes the one-process checkpoint of step 5
    "cp2-save": (2, dict(cp=2)),  # saves at step 5 for the cp 1 resume
    "cp2-bf16": (2, dict(cp=2, dtype="bf16")),
    "cp4-ring": (4, dict(cp=4)),
    "cp4-allgather": (4, dict(cp=4, cp_comm="allgather")),
    "cp2-tp2-sp": (4, dict(cp=2, tp=2, sequence_parallel=True)),
    "cp2-pp2-1f1b": (4, dict(cp=2, pp=2, schedule="1f1b")),
    "cp2-pp2-zbh1": (4, dict(cp=2, pp=2, schedule="zb-h1", cp_comm="allgather")),
    "cp2-pp2-interleaved": (4, dict(cp=2, pp=2, vpp=2, schedule="interleaved-1f1b", n_layer=4)),
    "cp2-tp2-llama-kv-replicated": (4, dict(cp=2, tp=2, sequence_parallel=True, arch="llama", n_kv_head=1)),
    "dp2-cp2-tp2-zero1": (8, dict(dp=2, cp=2, tp=2, sequence_parallel=True, zero=1)),
}
REFERENCE_FIELDS = ("arch", "n_kv_head", "n_layer")  # what a run shares with its one-process reference


def _reference_fields(fields: dict) -> dict:
    return {k: v for k, v in fields.items() if k in REFERENCE_FIELDS}


@functools.cache
def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="gridtrain-cp-"))


@functools.cache
def reference(arch: str = "gpt2", n_kv_head: int | None = None, n_layer: int = 2) -> dict:
    fields = {"arch": arch, "n_layer": n_layer} | ({"n_kv_head": n_kv_head} if n_kv_head else {})
    return train_in_process(tiny_config(**fields))


def _config(name: str) -> Config:
    cfg = tiny_config(**RUNS[name][1])
    if name == "cp2-save":
        cfg.checkpoint.save, cfg.checkpoint.save_interval = str(_tmp() / "cp2"), 5
    if name == "cp2-from-cp1":
        cfg.checkpoint.load = str(_one_process_checkpoint())
    return cfg


@functools.cache
def _one_process_checkpoint() -> Path:
    cfg = tiny_config()
    cfg.checkpoint.save, cfg.checkpoint.save_interval = str(_tmp() / "cp1"), 5
    train_in_process(cfg)
    return _tmp() / "cp1" / "step_0000005"


run = SharedSpawns(RUNS, _config).run


@pytest.mark.spawn
@pytest.mark.parametrize("name", [n for n in RUNS if n not in ("cp2-from-cp1", "cp2-save", "cp2-bf16")])
def test_context_parallel_trains_the_one_process_model(name):
    """Every rank: losses, grad norms, validation loss and the weights it holds (its TP
    shard of its stage's) equal one process's, within 1e-9."""
    world, fields = RUNS[name]
    cfg = _config(name)
    grid = ProcessGrid.build(world, tp=cfg.parallel.tp, pp=cfg.parallel.pp, dp=cfg.parallel.dp, cp=cfg.parallel.cp)
    ref = reference(**_reference_fields(fields))
    for rank, rank_run in enumerate(run(name)):
        assert_rank_matches(rank_run, ref, cfg, grid.tp_rank(rank))


@pytest.mark.spawn
def test_bf16_on_cp2_follows_the_one_process_model():
    """bf16 parameters and compute (scores and statistics in fp32) on cp 2: every step's
    loss within 2% of one process's."""
    for rank_run in run("cp2-bf16"):
        for step, (x, y) in enumerate(zip(rank_run["losses"], reference()["losses"]), 1):
            assert abs(x - y) <= 0.02 * y, f"step {step}: {x} vs {y}"


@pytest.mark.spawn
def test_a_checkpoint_moves_between_cp_2_and_cp_1():
    """Saved at step 5 on cp 2, resumed on one process; saved on one process, resumed on
    cp 2: either way the remaining steps are the uninterrupted run's."""
    run("cp2-save")
    resumed = tiny_config()
    resumed.checkpoint.load = str(_tmp() / "cp2" / "step_0000005")
    assert relative_difference(train_in_process(resumed)["losses"], reference()["losses"][5:]) <= 1e-9
    for rank_run in run("cp2-from-cp1"):
        assert relative_difference(rank_run["losses"], reference()["losses"][5:]) <= 1e-9


def _attention_bytes(mode: str, cp: int, *, tp: int = 1, kv_heads: int = 4, recompute_full: bool = False) -> int:
    """What one rank's attention moves over cp in a step of the tiny model: 2 layers x 4
    micro-batches of 2 sequences, ``kv`` keys and values of a rank's 64 / cp tokens
    (head dim 16, fp64). Ring: cp - 1 block passes forward; cp - 1 block passes and cp
    gradient passes backward. All-gather: a gather of cp blocks, a reduce-scatter of cp
    gradients. Full recomputation runs each forward twice. The same as
    memory.cp.cp_attention_bytes, which the planner and the memory model use."""
    kv = 2 * 2 * (kv_heads // tp) * (64 // cp) * 16 * 8
    forwards = 2 if recompute_full else 1
    if mode == "ring":
        per_layer = forwards * (cp - 1) * kv + (cp - 1) * kv + cp * kv
    else:
        per_layer = forwards * cp * kv + cp * kv
    # the memory model's and the planner's closed form says the same
    model = cp_attention_bytes(mode, cp, 2, 64 // cp, kv_heads // tp, 16, 8, 8, recompute_full=recompute_full)
    assert model["forward"] + model["backward"] == per_layer
    return 2 * 4 * per_layer


@pytest.mark.spawn
@pytest.mark.parametrize("name,mode,kwargs", [
    ("cp2-ring", "ring", {}),
    ("cp4-ring", "ring", {}),
    ("cp4-allgather", "allgather", {}),
    ("cp2-full-allgather", "allgather", dict(recompute_full=True)),
    ("cp2-selective", "ring", {}),  # selective recomputation repeats no cp communication
    ("cp2-tp2-sp", "ring", dict(tp=2)),
])
def test_cp_bytes_per_step_equal_the_closed_form(name, mode, kwargs):
    cp = RUNS[name][1]["cp"]
    kinds = ("send/cp",) if mode == "ring" else ("all_gather/cp", "reduce_scatter/cp")
    for rank_run in run(name):
        for step in rank_run["step_bytes"]:
            counted = {k: v for k, v in step.items() if k.endswith("/cp")}
            assert sum(counted.values()) == _attention_bytes(mode, cp, **kwargs)
            assert set(counted) == set(kinds)


def _kept(rank_run: dict) -> int:
    return sum(rank_run["memory"][0].kept.values())


@pytest.mark.spawn
@pytest.mark.parametrize("name,cp", [("cp2-ring", 2), ("cp4-ring", 4)])
def test_each_cp_rank_keeps_about_one_cp_th_of_the_activations(name, cp):
    """Measured with the saved-tensor meter at step 1: within 10% of one process's / cp."""
    whole = _kept(reference())
    for rank_run in run(name):
        assert abs(_kept(rank_run) - whole / cp) <= 0.10 * whole / cp, (_kept(rank_run), whole / cp)


@pytest.mark.spawn
def test_all_gather_keeps_the_gathered_keys_and_values():
    """All-gather attention keeps every rank's keys and values for its backward (no second
    gather): exactly cp blocks per layer and micro-batch more than the ring, whose keys
    and values are views of GPT-2's fused qkv output, kept anyway."""
    kv = 2 * 2 * 4 * (64 // 4) * 16 * 8  # one rank's keys and values at cp 4, fp64
    for ring, gathered in zip(run("cp4-ring"), run("cp4-allgather")):
        assert _kept(gathered) - _kept(ring) == 2 * 4 * 4 * kv
