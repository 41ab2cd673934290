"""Mixtures of experts train the one-process model on every layout (DESIGN.md, "The
invariant"): fp64, 1e-9 relative, per-step losses and grad norms, validation loss and
every rank's final weights (its own experts, its tp shard of the rest), dropless and with
capacity (the same tokens dropped on every layout), with
expert parallelism at ep 2 and 4 (dp 4), with tp 2 (with and without sequence
parallelism), pp 2 (1f1b, interleaved, zb-h1), cp 2, ZeRO-1, 2 and 3, both recomputations,
shared experts, GPT-2 experts with the embedding tied across stages, and MoE every other
layer; checkpoints moving between ep 2 and one process both ways.

Every run takes its routing statistics over global micro-batches, so every layout here
runs the same number of micro-batches per step (2: the micro-batch size is 8 / (2 dp)).
Also counted, not timed: tokens per expert and the load-balancing loss are the same on
every layout; the all-to-all bytes per rank per step are the closed form of the rows its
experts received."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

from gridtrain.config import Config, preset_config, set_fields
from gridtrain.parallel.grid import ProcessGrid
from tests.training import SharedSpawns, assert_rank_matches, relative_difference, train_in_process

MICRO_BATCHES = 2

# name -> (world size, fields): moe-tiny (Llama, 2 layers, 8 experts of width 32, top-2,
# grouped kv heads), 6 steps of 8 sequences in 2 micro-batches, fp64, unless said otherwise
RUNS: dict[str, tuple[int, dict]] = {
    "dp2": (2, dict(dp=2)),
    "ep2": (2, dict(dp=2, ep=2)),
    "ep2-zero1": (2, dict(dp=2, ep=2, zero=1)),
    "ep2-zero2": (2, dict(dp=2, ep=2, zero=2)),
    "ep2-zero3": (2, dict(dp=2, ep=2, zero=3)),
    "dp2-zero3": (2, dict(dp=2, zero=3)),  # experts not split: sharded with the rest
    "ep2-full": (2, dict(dp=2, ep=2, recompute="full")),
    "ep2-selective": (2, dict(dp=2, ep=2, recompute="selective")),
    "ep2-shared": (2, dict(dp=2, ep=2, moe_shared_experts=1)),
    "ep2-every2": (2, dict(dp=2, ep=2, moe_every=2)),
    "ep2-capacity": (2, dict(dp=2, ep=2, moe_capacity_factor=1.0)),
    "ep2-bf16": (2, dict(dp=2, ep=2, dtype="bf16")),
    "ep2-save": (2, dict(dp=2, ep=2)),  # saves at step 3
    "ep2-from-one": (2, dict(dp=2, ep=2)),  # resumes the one-process checkpoint of step 3
    "ep4": (4, dict(dp=4, ep=4)),
    "ep2-dp4": (4, dict(dp=4, ep=2)),
    "ep2-dp4-zero1": (4, dict(dp=4, ep=2, zero=1)),
    "ep2-dp4-zero3": (4, dict(dp=4, ep=2, zero=3)),  # experts sharded over their pairs
    "ep2-pp2-zbh1-zero3": (4, dict(dp=2, ep=2, pp=2, schedule="zb-h1", zero=3)),
    "ep2-tp2": (4, dict(dp=2, ep=2, tp=2)),
    "ep2-tp2-sp": (4, dict(dp=2, ep=2, tp=2, sequence_parallel=True)),
    "ep2-pp2-1f1b": (4, dict(dp=2, ep=2, pp=2, schedule="1f1b")),
    "ep2-pp2-interleaved": (4, dict(dp=2, ep=2, pp=2, vpp=2, schedule="interleaved-1f1b", n_layer=4)),
    "ep2-pp2-zbh1": (4, dict(dp=2, ep=2, pp=2, schedule="zb-h1")),
    "ep2-cp2": (4, dict(dp=2, cp=2, ep=2)),
    "gpt2-ep2-pp2-tied": (4, dict(dp=2, ep=2, pp=2, arch="gpt2", n_kv_head=None, tie_embeddings=True)),
    "ep2-capacity-cp2": (4, dict(dp=2, cp=2, ep=2, moe_capacity_factor=1.0)),
    "ep2-capacity-tp2-sp": (4, dict(dp=2, ep=2, tp=2, sequence_parallel=True, moe_capacity_factor=1.0)),
    # MoE parallel folding: ep 4 over dp 2 x tp 2 (every rank its own experts, none replicated)
    "ep4-folded-tp2-sp": (4, dict(dp=2, ep=4, tp=2, sequence_parallel=True)),
    "ep4-folded-tp2-sp-zero3": (4, dict(dp=2, ep=4, tp=2, sequence_parallel=True, zero=3)),
    # expert tensor parallelism: each expert's MLP split over 2 ranks, within dp 4 and folded over tp 2
    "etp2-ep2-dp4": (4, dict(dp=4, ep=2, etp=2)),
    "etp2-ep2-tp2-sp-save": (4, dict(dp=2, ep=2, etp=2, tp=2, sequence_parallel=True)),  # saves at step 3
}
REFERENCE_FIELDS = ("arch", "n_kv_head", "n_layer", "moe_shared_experts", "moe_every", "tie_embeddings",
                    "global_batch_size", "moe_capacity_factor")
NOT_PARITY = ("ep2-save", "ep2-from-one", "ep2-bf16")


def moe_config(**fields) -> Config:
    """moe-tiny with the parity recipe; the micro-batch size keeps MICRO_BATCHES per step."""
    cfg = preset_config("moe-tiny")
    dp, batch = fields.get("dp", 1), fields.get("global_batch_size", 8)
    recipe = dict(dtype="fp64", steps=6, global_batch_size=batch, micro_batch_size=batch // (MICRO_BATCHES * dp),
                  eval_interval=0, eval_iters=1, progress=False, lr=3e-3, warmup_steps=2)
    return set_fields(cfg, **{**recipe, **fields})


@functools.cache
def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="gridtrain-moe-"))


@functools.cache
def reference(**fields) -> dict:
    return train_in_process(moe_config(**fields))


def _reference_of(name: str) -> dict:
    return reference(**{k: v for k, v in RUNS[name][1].items() if k in REFERENCE_FIELDS})


@functools.cache
def _one_process_checkpoint() -> Path:
    cfg = moe_config()
    cfg.checkpoint.save, cfg.checkpoint.save_interval = str(_tmp() / "one"), 3
    train_in_process(cfg)
    return _tmp() / "one" / "step_0000003"


def _config(name: str) -> Config:
    cfg = moe_config(**RUNS[name][1])
    if name.endswith("-save"):
        cfg.checkpoint.save, cfg.checkpoint.save_interval = str(_tmp() / name), 3
    if name == "ep2-from-one":
        cfg.checkpoint.load = str(_one_process_checkpoint())
    return cfg


run = SharedSpawns(RUNS, _config).run


@pytest.mark.spawn
@pytest.mark.parametrize("name", [n for n in RUNS if n not in NOT_PARITY])
def test_moe_layouts_train_the_one_process_model(name):
    """Every rank: losses, grad norms, validation loss and the weights it holds equal one
    process's within 1e-9; the routing (tokens per expert, load-balancing loss) of every
    step equals one process's."""
    world, _ = RUNS[name]
    cfg = _config(name)
    p = cfg.parallel
    grid = ProcessGrid.build(world, tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp)
    ref = _reference_of(name)
    for rank, rank_run in enumerate(run(name)):
        (etp_group,) = [g for g in grid.all_etp_groups(p.ep, p.etp) if rank in g]
        assert_rank_matches(rank_run, ref, cfg, grid.tp_rank(rank), etp_rank=etp_group.index(rank))
        for mine, theirs in zip(rank_run["routing"], ref["routing"]):
            assert mine.keys() == theirs.keys()
            for layer in mine:
                assert mine[layer].tokens_per_expert == theirs[layer].tokens_per_expert
                assert mine[layer].dropped == theirs[layer].dropped
                assert abs(mine[layer].aux_loss - theirs[layer].aux_loss) <= 1e-9 * theirs[layer].aux_loss


@pytest.mark.spawn
def test_bf16_moe_follows_fp64():
    """bf16 parameters and compute (fp32 master weights and gradient buffers, experts in
    their own buckets): every step's loss within 2% of the fp64 one-process run's."""
    for rank_run in run("ep2-bf16"):
        for step, (x, y) in enumerate(zip(rank_run["losses"], reference()["losses"]), 1):
            assert abs(x - y) <= 0.02 * y, f"step {step}: {x} vs {y}"


@pytest.mark.spawn
def test_capacity_drops_tokens():
    """The capacity runs do drop assignments (factor 1 with an unbalanced router), so
    their parity above covers which ones."""
    assert sum(r.dropped for step in _reference_of("ep2-capacity")["routing"] for r in step.values()) > 0


@pytest.mark.spawn
def test_experts_are_split_over_ep():
    """Each ep rank holds its E / ep experts of every MoE layer, by global index."""
    for rank, rank_run in enumerate(run("ep4")):
        experts = {n.split(".")[4] for n in rank_run["state"] if ".experts." in n}
        assert experts == {str(2 * rank), str(2 * rank + 1)}


@pytest.mark.spawn
def test_a_checkpoint_moves_between_ep2_and_one_process():
    """Saved at step 3 on dp 2 x ep 2 (each rank its own experts), resumed on one
    process; saved by one process, resumed on ep 2: the remaining steps are the
    uninterrupted run's (fp64, 1e-9)."""
    run("ep2-save")
    resumed = moe_config()
    resumed.checkpoint.load = str(_tmp() / "ep2-save" / "step_0000003")
    assert relative_difference(train_in_process(resumed)["losses"], reference()["losses"][3:]) <= 1e-9
    for rank_run in run("ep2-from-one"):
        assert relative_difference(rank_run["losses"], reference()["losses"][3:]) <= 1e-9


@pytest.mark.spawn
def test_expert_tensor_parallel_checkpoint_resumes_on_one_process():
    """Saved at step 3 with each expert split over etp 2 (ep 2 folded over dp 2 x tp 2),
    resumed on one process: the slices join into the whole experts and the remaining
    steps are the uninterrupted run's (fp64, 1e-9)."""
    run("etp2-ep2-tp2-sp-save")
    resumed = moe_config()
    resumed.checkpoint.load = str(_tmp() / "etp2-ep2-tp2-sp-save" / "step_0000003")
    assert relative_difference(train_in_process(resumed)["losses"], reference()["losses"][3:]) <= 1e-9


def _all_to_all_bytes(name: str) -> list[int]:
    return [r["step_bytes"][-1].get("all_to_all/ep", 0) for r in run(name)]


@pytest.mark.spawn
@pytest.mark.parametrize("name", ["ep2", "ep4", "ep2-full"])
def test_all_to_all_bytes_are_the_closed_form_of_the_routing(name):
    """Per MoE layer and micro-batch a rank sends, forward: its E counts (int64) and every
    one of its N k rows (dispatch), then the rows its experts received back (combine);
    backward the same rows' gradients the other way; full recomputation repeats the
    forward. Rows are d wide in fp64. ``received`` is what the rank's experts got over the
    step (summed over micro-batches): so the bytes follow from the routing counts."""
    cfg = _config(name)
    m, d, e, k = cfg.model, cfg.model.d_model, cfg.model.n_experts, cfg.model.moe_top_k
    rows_sent = cfg.training.micro_batch_size * m.seq_len * k  # N k per micro-batch
    forwards = 2 if cfg.activations.recompute == "full" else 1
    for rank_run, counted in zip(run(name), _all_to_all_bytes(name)):
        expected = 0
        for layer in m.moe_layers:
            received = rank_run["received"][layer]
            expected += MICRO_BATCHES * (forwards * (8 * e + 8 * d * rows_sent) + 8 * d * rows_sent)
            expected += (forwards + 1) * 8 * d * received
        assert counted == expected


@pytest.mark.spawn
def test_recomputation_counts_routing_once():
    """Full recomputation reruns every MoE forward in backward; the step's routing
    statistics count each micro-batch once (the same as without recomputation)."""
    for with_, without in zip(run("ep2-full")[0]["routing"], run("ep2")[0]["routing"]):
        assert {k: v.tokens_per_expert for k, v in with_.items()} == \
            {k: v.tokens_per_expert for k, v in without.items()}


@pytest.mark.spawn
def test_the_end_of_run_sample_gathers_every_expert():
    """`gridtrain train` on dp 2 x ep 2 ends with a sample from the whole model: each
    expert gathered once, from the first of the ranks holding it."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "gridtrain", "train", "--model", "moe-tiny", "--nproc", "2", "--ep", "2",
                          "--steps", "2", "--sample-tokens", "5", "--no-progress", "--eval-interval", "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--- sample (5 tokens" in out.stdout and "experts (max/mean tokens per expert" in out.stdout
