"""Pipeline parallelism on real gloo processes: parity with one process for every
schedule, the activations a stage holds (counted), forward-only validation, partitions,
the split backward, and checkpoints that move between layouts."""

from __future__ import annotations

import functools
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from gridtrain.config import Config, preset_config
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.parallel.pipeline.partition import PartitionError, balanced, partition, uniform
from gridtrain.parallel.pipeline.validate import in_flight_bound
from gridtrain.training.providers import unit_costs
from gridtrain.parallel.split_backward import WeightGradStore
from gridtrain.parallel.tensor_parallel import TensorParallel
from tests.training import relative_difference, tiny_config, train_in_process, train_layouts

N_LAYER = 8  # enough blocks for 4 stages x 2 chunks


MATRIX_STEPS = 6  # the schedule matrix: 18 runs per depth share the budget; a wrong gradient shows at step 2


def _config(micro_batches: int, steps: int = 10, **parallel) -> Config:
    cfg = tiny_config(global_batch_size=2 * micro_batches, micro_batch_size=2, steps=steps)
    cfg.model.n_layer = N_LAYER
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


_references: dict[tuple[int, int], dict] = {}


def _reference(micro_batches: int, steps: int = 10) -> dict:
    """One process, same model and batches (cached: several layouts compare to it)."""
    if (micro_batches, steps) not in _references:
        _references[micro_batches, steps] = train_in_process(_config(micro_batches, steps))
    return _references[micro_batches, steps]


def assert_stage_matches(run: dict, reference: dict, rtol: float = 1e-9) -> None:
    """Losses, grad norms and validation loss agree, and every weight this stage holds
    equals the one-process weight of the same name (a last stage's tied head copy equals
    the embedding)."""
    for name in ("losses", "grad_norms"):
        assert relative_difference(run[name], reference[name]) <= rtol, name
    assert abs(run["valid_loss"] - reference["valid_loss"]) <= rtol * reference["valid_loss"]
    for name, value in run["state"].items():
        expected = reference["state"]["embedding.word.weight" if name == "head" else name]
        assert relative_difference(value, expected) <= rtol, name


CASES = [(pp, schedule, m) for pp in (2, 4) for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
         for m in (4, 8)]


@pytest.mark.spawn
@pytest.mark.parametrize("pp,schedule,micro_batches", CASES)
def test_pipeline_trains_the_single_process_model(pp, schedule, micro_batches):
    """DESIGN.md invariant (fp64, 1e-9, 6 steps) for every schedule, the counted peak of
    micro-batches whose activations a stage holds equals the schedule's bound, and the
    collectives per step are counted: the tied embedding's sum on the first and last
    stage and one all-reduce of the step's scalars (norm, loss, flag), besides the
    point-to-point sends (one per micro-batch, chunk and direction)."""
    vpp = 2 if schedule == "interleaved-1f1b" else 1
    runs = _pipeline_runs(pp)[schedule, micro_batches]
    reference = _reference(micro_batches, MATRIX_STEPS)
    held = set()
    for stage, run in enumerate(runs):
        assert_stage_matches(run, reference)
        assert run["peak_in_flight"] == in_flight_bound(schedule, pp, micro_batches, vpp, stage)
        held |= run["state"].keys()
        sends = micro_batches * (vpp * 2 - (stage == 0) - (stage == pp - 1))
        tied = {"all_reduce/embedding": 1} if stage in (0, pp - 1) else {}
        for calls in run["step_calls"]:
            assert calls == {"all_reduce/mp": 1, "send/pp": sends, **tied}, stage
    assert held - {"head"} == reference["state"].keys()  # no layer dropped or duplicated


UNEVEN = {2: [3, 5], 4: [1, 3, 0, 4]}


@functools.cache
def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="gridtrain-pp-"))


def _four_rank_extras() -> dict[str, Config]:
    """The other 4-rank runs of this file: pp 2 x tp 2 with SP on ZB-H1, and pp 2 x tp 2
    saving at step 5 (for the one-process resume)."""
    saving = _config(4, pp=2, tp=2, schedule="1f1b")
    saving.checkpoint.save, saving.checkpoint.save_interval = str(_tmp() / "pp2-tp2"), 5
    return {"pp2-tp2-sp-zbh1": _config(4, pp=2, tp=2, sequence_parallel=True, schedule="zb-h1"),
            "pp2-tp2-save": saving}


@functools.cache
def _pipeline_runs(pp: int) -> dict:
    """Every schedule case of ``pp`` stages and its uneven split (and at 4 ranks the
    file's other 4-rank runs), trained one after another on the same spawned ranks (one
    spawn per pipeline depth, not one per case)."""
    cases = [(schedule, m) for p, schedule, m in CASES if p == pp]
    cfgs = {case: _config(case[1], MATRIX_STEPS, pp=pp, vpp=2 if case[0] == "interleaved-1f1b" else 1,
                          schedule=case[0]) for case in cases}
    cfgs["uneven"] = _config(8, MATRIX_STEPS, pp=pp, pp_layers=UNEVEN[pp], schedule="1f1b")
    if pp == 4:
        cfgs.update(_four_rank_extras())
    return dict(zip(cfgs, train_layouts(list(cfgs.values()), pp, timeout_s=900)))


@pytest.mark.spawn
@pytest.mark.parametrize("pp,layers", list(UNEVEN.items()))
def test_uneven_layer_split_trains_the_same_model(pp, layers):
    runs = _pipeline_runs(pp)["uneven"]
    for stage, run in enumerate(runs):
        assert_stage_matches(run, _reference(8, MATRIX_STEPS))
        blocks = {int(n.split(".")[1]) for n in run["state"] if n.startswith("blocks.")}
        assert len(blocks) == layers[stage]


@pytest.mark.spawn
def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_p():
    """Counted on the real runtime, not timed: GPipe keeps all m, 1F1B at most p - s."""
    m, pp = 8, 4
    peaks = {s: [r["peak_in_flight"] for r in _pipeline_runs(pp)[s, m]] for s in ("gpipe", "1f1b")}
    assert peaks["gpipe"] == [m] * pp
    assert peaks["1f1b"] == [pp - s for s in range(pp)]


@pytest.mark.spawn
def test_pipeline_with_tensor_and_sequence_parallelism():
    for run in _pipeline_runs(4)["pp2-tp2-sp-zbh1"]:
        assert relative_difference(run["losses"], _reference(4)["losses"]) <= 1e-9


# ---- pieces, without processes --------------------------------------------------------------


def test_split_backward_gives_the_plain_gradients():
    """B (input gradients, weight gradients queued) then W equals one plain backward."""
    cfg = preset_config("tiny").model
    store = WeightGradStore()
    plain, split = (Decoder(cfg, tp=TensorParallel(weight_grads=w)).double() for w in (None, store))
    init_parameters(plain, 0)
    init_parameters(split, 0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    plain(tokens, tokens).sum().backward()
    with store.defer("mb0"):
        split(tokens, tokens).sum().backward()
    deferred = [n for n, p in split.named_parameters() if p.grad is None]
    assert "blocks.0.attn.qkv.weight" in deferred and "blocks.0.ln1.weight" not in deferred
    store.flush("mb0")
    for (name, a), (_, b) in zip(plain.named_parameters(), split.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-15, msg=name)


def test_partitions_place_every_block_once():
    cfg = preset_config("tiny")
    cfg.model.n_layer, cfg.training.micro_batch_size = 10, 1
    assert uniform(10, 4) == [3, 3, 2, 2]
    for method in ("uniform", "parameters", "time"):
        stages = partition(10, 4, costs=unit_costs(cfg, method))
        assert [b for stage in stages for b in stage] == list(range(10)), method
    assert partition(10, 3, explicit=[2, 0, 8]) == [[0, 1], [], list(range(2, 10))]
    with pytest.raises(PartitionError, match="add up to --n-layer 10"):
        partition(10, 3, explicit=[2, 2, 2])


def test_balanced_partition_is_optimal():
    """The DP finds the smallest possible largest stage, checked by brute force."""
    import itertools

    rng = np.random.default_rng(0)
    for _ in range(20):
        costs = list(rng.integers(1, 10, size=7).astype(float))
        first, last = float(rng.integers(0, 10)), float(rng.integers(0, 10))
        counts = balanced(costs, 3, first, last)

        def worst(c):
            bounds = np.cumsum([0, *c])
            loads = [sum(costs[bounds[i]:bounds[i + 1]]) for i in range(3)]
            return max(loads[0] + first, loads[1], loads[2] + last)
        best = min(worst(c) for c in itertools.product(range(1, 6), repeat=3) if sum(c) == 7)
        assert sum(counts) == 7 and worst(counts) == best


# ---- checkpoints and generation across layouts ------------------------------------------------


@pytest.mark.spawn
def test_pipeline_checkpoint_resumes_in_another_layout_and_generates():
    """A pp=2 x tp=2 run saved at step 5 resumes on one process like the one-process run,
    and `gridtrain generate` samples from it."""
    straight = _reference(4)
    _pipeline_runs(4)["pp2-tp2-save"]
    saved = _tmp() / "pp2-tp2"
    resumed = _config(4)
    resumed.checkpoint.load = str(saved / "step_0000005")
    run = train_in_process(resumed)
    assert relative_difference(run["losses"], straight["losses"][5:]) <= 1e-9
    gen = subprocess.run([sys.executable, "-m", "gridtrain", "generate", "--load", str(saved),
                          "--prompt", "def ", "--max-new-tokens", "8"], capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("def ")


@pytest.mark.spawn
def test_trace_records_every_action_the_schedule_ran(tmp_path):
    """--trace writes one Chrome trace per rank whose F/B boxes are the schedule's, per step."""
    import json

    proc = subprocess.run([sys.executable, "-m", "gridtrain", "train", "--model", "tiny", "--n-layer", "4",
                           "--nproc", "2", "--pp", "2", "--steps", "2", "--global-batch-size", "8",
                           "--micro-batch-size", "2", "--trace", str(tmp_path), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "measured idle fraction per stage 0:" in proc.stdout + proc.stderr
    for rank in (0, 1):
        events = json.load(open(tmp_path / f"rank{rank:03d}.json"))["traceEvents"]
        boxes = [e["name"] for e in events if e.get("ph") == "X" and e["name"][0] in "FB"]
        assert sorted(boxes) == sorted([f"{k}{mb}" for k in "FB" for mb in range(4)] * 2)
