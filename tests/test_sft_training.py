"""Fine-tuning runs (prompt/completion JSON lines, packed with document masks, the loss
over completion tokens only as a global token count) train the one-process model on
every layout: dp 2, tp 2 with sequence parallelism, pp 2 with full recomputation, cp 2,
dp 2 with ZeRO-1; and a mixture of fine-tuning and pretraining sources on dp 2. The
step's loss-bearing tokens come from the data's host-side counts: no collective between
a step's end and the next forward (checked on the ZeRO-1 run's communicator). One spawn
of 2 ranks."""

from __future__ import annotations

import functools
import json
import random

import pytest

from tests.harness import run_on_ranks
from tests.training import _train_many_worker, assert_rank_matches, tiny_config, train_in_process

LAYOUTS = {
    "dp2": dict(dp=2),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "pp2-full": dict(pp=2, schedule="1f1b", recompute="full"),
    "cp2": dict(cp=2),
    "dp2-zero1": dict(dp=2, zero=1),
    "mixture-dp2": dict(dp=2),
}


def _write_data(root) -> dict[str, str]:
    rng = random.Random(0)
    with open(root / "sums.jsonl", "w") as f:
        for _ in range(240):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            f.write(json.dumps({"prompt": f"Q: {a} plus {b}? A:", "completion": f" {a + b}."}) + "\n")
    (root / "text.txt").write_text(" ".join(rng.choice(["red", "green", "blue", "cyan"]) for _ in range(4000)))
    return {"sft": str(root / "sums.jsonl"), "mixture": f"0.6:{root / 'sums.jsonl'},0.4:{root / 'text.txt'}"}


def _config(data: str, **parallel):
    cfg = tiny_config(steps=4, global_batch_size=8, micro_batch_size=2, eval_interval=4, eval_iters=1)
    cfg.model.n_layer = 2
    cfg.data.path, cfg.data.valid_every, cfg.data.document_mask = data, 10, True
    for key, value in parallel.items():
        section = cfg.activations if key == "recompute" else cfg.parallel
        setattr(section, key, value)
    return cfg


@functools.cache
def _runs(root: str) -> dict:
    from pathlib import Path
    data = _write_data(Path(root))
    cfgs = {name: _config(data["mixture" if name.startswith("mixture") else "sft"], **layout)
            for name, layout in LAYOUTS.items()}
    per_rank = run_on_ranks(_worker, 2, list(cfgs.values()), cfgs["dp2-zero1"], timeout_s=600)
    results = [[runs[i] for runs, _ in per_rank] for i in range(len(cfgs))]
    exposed = [seen for _, seen in per_rank]
    references = {kind: train_in_process(_config(data[kind])) for kind in ("sft", "mixture")}
    return {"exposed": exposed, **{name: (cfg, runs, references["mixture" if name.startswith("mixture") else "sft"])
                                   for (name, cfg), runs in zip(cfgs.items(), results)}}


def _worker(rank: int, world_size: int, cfgs: list, zero1) -> tuple[list[dict], list[int]]:
    """The layouts' runs, then the ZeRO-1 run stepped by hand: how many collectives its
    parameter gathers' communicator saw between each step's end (gathers in flight) and
    the next step's first block forward."""
    from gridtrain.parallel.distributed import shutdown
    from gridtrain.training.providers import decoder_forward_step, decoder_model_provider, text_datasets_provider
    from gridtrain.training.trainer import build

    runs = _train_many_worker(rank, world_size, cfgs)
    trainer = build(zero1, decoder_model_provider, decoder_forward_step, text_datasets_provider)
    try:
        gathers = trainer.reducer.buckets[0].group  # the group ZeRO-1 gathers on
        assert all(b.group is gathers for b in trainer.reducer.buckets)
        recorder, seen, after_step = gathers.recorder, [], {}
        first_block = next(iter(trainer.model.blocks.values()))

        def before_first_block(_module, _args):
            if after_step:
                seen.append(recorder.seqs.get(gathers.name, 0) - after_step["seq"])
                after_step.clear()

        first_block.register_forward_pre_hook(before_first_block)
        for step in range(3):
            trainer.set_lr(step)
            trainer.train_step(trainer.read_batches(step))
            after_step["seq"] = recorder.seqs.get(gathers.name, 0)
        assert gathers.size == 2
    finally:
        shutdown()
    return runs, seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _runs(str(tmp_path_factory.mktemp("sft")))


@pytest.mark.spawn
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_fine_tuning_run_trains_the_one_process_model(runs, name):
    cfg, ranks, reference = runs[name]
    for rank, run in enumerate(ranks):
        assert_rank_matches(run, reference, cfg, rank % cfg.parallel.tp)
        if name.startswith("mixture"):
            assert set(run["valid_by_source"]) == {"sums", "text"}
            for source, loss in reference["valid_by_source"].items():
                assert abs(run["valid_by_source"][source] - loss) <= 1e-9 * loss


@pytest.mark.spawn
def test_no_collective_waits_behind_the_zero1_gathers(runs):
    """Between a ZeRO-1 step's end (its parameter gathers left in flight to hide behind the
    next forward) and the next forward's first block, no collective is issued on the
    gathers' communicator: fine-tuning data says its loss-bearing tokens on the host
    (data.datasets.count_loss_tokens), so the step needs no token-count all-reduce, which
    would queue behind the gathers and make the host wait for all of them."""
    for seen in runs["exposed"]:
        assert seen == [0, 0], seen  # steps 2 and 3
