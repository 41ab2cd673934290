"""A DeepSeek-V3-class model trains the one-process model on every layout (DESIGN.md,
"The invariant"): `deepseek-tiny` uses every part at once - latent attention with query
compression and YaRN, a dense first layer, sigmoid routing over groups with a shared
expert, the routed scale, the aux-loss-free expert bias, the sequence-wise balance loss,
and one multi-token prediction module - and each layout below must give, on every rank,
the one-process losses, MTP losses, grad norms, validation loss, weights (its own experts
or expert slices, its tp shard of the rest) and expert bias, and every step's tokens per
expert, in fp64 within 1e-9.

The layouts are the ones the model's parts split over: dp 2 x ep 2; tp 2 with sequence
parallelism (heads split, the latent projections replicated); pp 2 (the MTP module on the
last stage, beside a copy of the embedding); cp 2 in both modes (latent attention over
the ring and all-gathered); dp 2 with ZeRO-3; ep 4 folded over dp 2 x tp 2; etp 2 with tp
2; with full and selective recomputation among them. Every run has 2 micro-batches per
step (the routing statistics are per global micro-batch)."""

from __future__ import annotations

import functools

import pytest

from gridtrain.config import Config, preset_config, set_fields
from gridtrain.parallel.grid import ProcessGrid
from tests.training import SharedSpawns, assert_rank_matches, relative_difference, train_in_process

MICRO_BATCHES = 2

RUNS: dict[str, tuple[int, dict]] = {
    "dp2-ep2": (2, dict(dp=2, ep=2)),
    "tp2-sp-full": (2, dict(tp=2, sequence_parallel=True, recompute="full")),
    "pp2": (2, dict(pp=2)),
    "cp2-ring-selective": (2, dict(cp=2, recompute="selective")),
    "cp2-allgather": (2, dict(cp=2, cp_comm="allgather")),
    "dp2-zero3-selective": (2, dict(dp=2, zero=3, recompute="selective")),
    "ep4-folded-dp2-tp2-sp": (4, dict(dp=2, tp=2, ep=4, sequence_parallel=True)),
    "etp2-ep2-tp2-sp-full": (4, dict(dp=2, tp=2, ep=2, etp=2, sequence_parallel=True, recompute="full")),
    "pp2-dp2-ep2-selective": (4, dict(pp=2, dp=2, ep=2, recompute="selective")),
}


def deepseek_config(**fields) -> Config:
    """deepseek-tiny, fp64, 6 steps of 8 sequences in 2 micro-batches."""
    dp = fields.get("dp", 1)
    recipe = dict(dtype="fp64", steps=6, global_batch_size=8, micro_batch_size=8 // (MICRO_BATCHES * dp),
                  eval_interval=0, eval_iters=1, progress=False, lr=3e-3, warmup_steps=2)
    return set_fields(preset_config("deepseek-tiny"), **{**recipe, **fields})


@functools.cache
def reference() -> dict:
    return train_in_process(deepseek_config())


run = SharedSpawns(RUNS, lambda name: deepseek_config(**RUNS[name][1])).run


@pytest.mark.spawn
@pytest.mark.parametrize("name", list(RUNS))
def test_deepseek_layouts_train_the_one_process_model(name):
    world, _ = RUNS[name]
    cfg = deepseek_config(**RUNS[name][1])
    p = cfg.parallel
    grid = ProcessGrid.build(world, tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp)
    ref = reference()
    for rank, rank_run in enumerate(run(name)):
        (etp_group,) = [g for g in grid.all_etp_groups(p.ep, p.etp) if rank in g]
        assert_rank_matches(rank_run, ref, cfg, grid.tp_rank(rank), etp_rank=etp_group.index(rank))
        assert relative_difference(rank_run["mtp_losses"], ref["mtp_losses"]) <= 1e-9
        for mine, theirs in zip(rank_run["routing"], ref["routing"]):
            assert mine.keys() <= theirs.keys()  # a pipeline stage logs its own layers
            for layer in mine:
                assert mine[layer].tokens_per_expert == theirs[layer].tokens_per_expert


def test_the_reference_uses_every_part():
    """The one-process run routes through the MoE block after the dense one (the routing
    report's; the MTP module's MoE block moves its bias too), its expert biases move, and
    its MTP loss is reported apart."""
    ref = reference()
    assert all(set(step) == {1} for step in ref["routing"])
    assert any(abs(v).max() > 0 for k, v in ref["state"].items() if k.endswith("expert_bias"))
    assert len(ref["mtp_losses"]) == len(ref["losses"]) and all(x > 0 for x in ref["mtp_losses"])
