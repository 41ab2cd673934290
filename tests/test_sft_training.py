"""Fine-tuning runs (prompt/completion JSON lines, packed with document masks, the loss
over completion tokens only as a global token count) train the one-process model on
every layout: dp 2, tp 2 with sequence parallelism, pp 2 with full recomputation, cp 2;
and a mixture of fine-tuning and pretraining sources on dp 2. One spawn of 2 ranks."""

from __future__ import annotations

import functools
import json
import random

import pytest

from tests.training import assert_rank_matches, tiny_config, train_in_process, train_layouts

LAYOUTS = {
    "dp2": dict(dp=2),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "pp2-full": dict(pp=2, schedule="1f1b", recompute="full"),
    "cp2": dict(cp=2),
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
    results = train_layouts(list(cfgs.values()), 2, timeout_s=600)
    references = {kind: train_in_process(_config(data[kind])) for kind in ("sft", "mixture")}
    return {name: (cfg, runs, references["mixture" if name.startswith("mixture") else "sft"])
            for (name, cfg), runs in zip(cfgs.items(), results)}


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
