"""Every published layout can be stated and planned: each model field is a ``plan`` flag
(a head width of its own, q/k norms, MoE and latent-attention fields), fixed fields
take any value (a micro-batch of 12, not only the searched ones), interleaved schedules
split layers that do not divide evenly, experts fold over tp, and a refusal names the
field that makes the layout impossible. ``--json`` gives each layout its memory by kind;
``--explain`` sets the chosen layout beside the runner-up. No process is started."""

from __future__ import annotations

import json
import shlex

import pytest

from gridtrain.cli import parser as cli
from gridtrain.planner.cost import MEMORY_PARTS
from gridtrain.training.validate import validate

H100 = ["--hardware", "h100-sxm"]
# Qwen3-235B-A22B by its fields (no preset): 94 layers, head width 128 beside d_model / n_head = 64
QWEN3_235B = ["--arch", "llama", "--n-layer", "94", "--d-model", "4096", "--n-head", "64", "--n-kv-head", "4",
              "--head-dim", "128", "--qk-norm", "head", "--ffn-hidden", "12288", "--vocab-size", "151936",
              "--untie-embeddings", "--n-experts", "128", "--moe-top-k", "8", "--moe-ffn-hidden", "1536"]
# Mixtral 8x22B by its fields
MIXTRAL_8X22B = ["--arch", "llama", "--n-layer", "56", "--d-model", "6144", "--n-head", "48", "--n-kv-head", "8",
                 "--ffn-hidden", "16384", "--vocab-size", "32768", "--untie-embeddings", "--n-experts", "8",
                 "--moe-top-k", "2"]


def _plan(capsys, argv: list[str]) -> list[dict]:
    assert cli.main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["layouts"]


def _train_config(command: str, world: int):
    words = shlex.split(command)
    return validate(cli.config_from_args(cli.build_parser().parse_args(words[words.index("gridtrain") + 1:])), world)


def test_torchtitans_fsdp_8_by_tp_8_run_is_planned_as_published(capsys, no_process_may_start):
    """A fixed micro-batch of 12 (not one the search tries) is taken as given."""
    rows = _plan(capsys, ["--model", "llama3-8b", "--gpus", "64", *H100, "--tp", "8", "--pp", "1", "--cp", "1",
                          "--zero", "3", "--micro-batch-size", "12", "--global-batch-size", "96", "--seq-len", "8192",
                          "--top", "1"])
    r = rows[0]
    assert (r["dp"], r["tp"], r["pp"], r["zero"], r["micro_batch_size"]) == (8, 8, 1, 3, 12)
    cfg = _train_config(r["command"], 64)
    assert cfg.training.micro_batch_size == 12 and cfg.parallel.zero == 3


def test_a_model_stated_by_its_fields_plans_as_its_preset(capsys, no_process_may_start):
    """Qwen3-30B-A3B's fields as flags (head width 128, per-head q/k norms) give the
    preset's numbers, and the printed command carries them."""
    layout = ["--gpus", "64", *H100, "--seq-len", "4096", "--global-batch-size", "512", "--tp", "1", "--pp", "1",
              "--ep", "8", "--zero", "1", "--micro-batch-size", "2", "--recompute", "full", "--top", "1"]
    fields = ["--arch", "llama", "--n-layer", "48", "--d-model", "2048", "--n-head", "32", "--n-kv-head", "4",
              "--head-dim", "128", "--qk-norm", "head", "--ffn-size", "6144", "--vocab-size", "151936",
              "--untie-embeddings", "--n-experts", "128", "--moe-top-k", "8", "--moe-ffn-hidden", "768"]
    by_fields, = _plan(capsys, [*fields, *layout])
    preset, = _plan(capsys, ["--model", "qwen3-30b-a3b", *layout])
    assert by_fields["step_time_s"] == pytest.approx(preset["step_time_s"], rel=1e-12)
    assert by_fields["memory_gb_per_gpu"] == pytest.approx(preset["memory_gb_per_gpu"], rel=1e-12)
    words = shlex.split(by_fields["command"])
    for flag, value in (("--head-dim", "128"), ("--qk-norm", "head"), ("--ffn-hidden", "6144")):
        assert words[words.index(flag) + 1] == value
    cfg = _train_config(by_fields["command"], 64)
    assert cfg.model.attn_head_dim == 128 and cfg.model.qk_norm == "head" and not cfg.model.tie_embeddings


def test_94_layers_interleave_on_pp_8_by_vpp_4(capsys, no_process_may_start):
    """32 virtual stages for 94 layers: the balanced split by parameters, printed as
    --pp-layers, which the runtime accepts."""
    r, = _plan(capsys, [*QWEN3_235B, "--gpus", "256", *H100, "--seq-len", "4096", "--global-batch-size", "1024",
                        "--tp", "2", "--pp", "8", "--vpp", "4", "--ep", "8", "--sequence-parallel",
                        "--micro-batch-size", "1", "--recompute", "full", "--top", "1"])
    assert (r["pp"], r["vpp"], r["schedule"]) == (8, 4, "interleaved-1f1b")
    assert len(r["pp_layers"]) == 32 and sum(r["pp_layers"]) == 94 and set(r["pp_layers"]) == {2, 3}
    cfg = _train_config(r["command"], 256)
    assert cfg.parallel.pp_layers == r["pp_layers"] and cfg.parallel.vpp == 4


def test_experts_fold_over_tp_where_dp_is_smaller_than_ep(capsys, no_process_may_start):
    """Mixtral 8x22B on 128 GPUs as tp 4 x pp 8 with ep 8: dp is 4, so the experts fold
    over tp (with sequence parallelism, which the plan turns on)."""
    r, = _plan(capsys, [*MIXTRAL_8X22B, "--gpus", "128", *H100, "--seq-len", "4096", "--global-batch-size", "256",
                        "--tp", "4", "--pp", "8", "--ep", "8", "--top", "1"])
    assert (r["dp"], r["tp"], r["pp"], r["ep"], r["sequence_parallel"]) == (4, 4, 8, 8, True)
    assert _train_config(r["command"], 128).parallel.ep == 8


@pytest.mark.parametrize("argv,field", [
    (["--tp", "16"], "--tp 16"),
    (["--tp", "8", "--micro-batch-size", "5"], "--micro-batch-size 5"),
    (["--cp", "3"], "--cp 3"),
    (["--pp", "64"], "--pp 64"),
])
def test_a_refusal_names_the_field_that_makes_the_layout_impossible(capsys, argv, field):
    assert cli.main(["plan", "--model", "llama3-8b", "--gpus", "64", *H100, "--seq-len", "8192",
                     "--global-batch-size", "96", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"gridtrain: error: plan: {field} leaves no layout of 64 GPUs"), err


def test_json_gives_memory_by_kind_summing_to_the_figure(capsys):
    rows = _plan(capsys, ["--model", "llama3-8b", "--gpus", "16", *H100, "--seq-len", "8192",
                          "--global-batch-size", "32", "--tp", "1", "--pp", "1", "--top", "3"])
    for r in rows:
        parts = r["memory_breakdown_gb"]
        assert list(parts) == list(MEMORY_PARTS) and all(v >= 0 for v in parts.values())
        assert sum(parts.values()) == pytest.approx(r["memory_gb_per_gpu"], rel=1e-12)


def test_explain_sets_the_winner_beside_the_runner_up(capsys):
    assert cli.main(["plan", "--model", "llama3-8b", "--gpus", "64", *H100, "--seq-len", "8192",
                     "--global-batch-size", "96", "--tp", "8", "--top", "2", "--explain"]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("why 1 beats 2"):].splitlines()
    split = next(i for i, line in enumerate(lines) if "memory GB per GPU" in line)
    rows, memory = ({line[:32].strip(): line[32:].split() for line in part}
                    for part in (lines[2:split], lines[split + 1:]))
    for table, parts in ((rows, ("compute", "TP communication", "pipeline bubble", "exposed DP communication",
                                 "optimizer", "step")), (memory, (*MEMORY_PARTS, "total"))):
        for part in parts:
            first, second, diff = map(float, table[part])
            assert diff == pytest.approx(first - second, abs=2e-2)
    assert float(memory["total"][0]) == pytest.approx(sum(float(memory[k][0]) for k in MEMORY_PARTS), abs=3e-2)
    # the parts add up to the step
    steps = [sum(float(rows[p][i]) for p in ("compute", "TP communication", "exposed CP communication",
                                              "exposed ZeRO communication", "MoE communication", "pipeline bubble",
                                              "exposed DP communication", "optimizer")) for i in (0, 1)]
    assert steps == pytest.approx([float(x) for x in rows["step"][:2]], abs=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3-8b dp 8 ZeRO-2", "llama3-8b HSDP 8 of 16", "mixtral-8x7b tp 2 x ep 8 pp 4"])
def test_the_planned_memory_is_the_dry_runs_step_peak(name):
    """benchmarks/planner_memory.py's layouts whose peak is a transient (a few seconds of
    dry run each): ZeRO-2's publication of the weights at the step's end, ZeRO-3's root
    unit staged twice in fp32 beside a block's buffer, Mixtral's expert gradients summed
    over TP in buckets (once copied whole: 2.2 GB more) then published. The planner's
    figure is the dry run's step peak within 3% (docs/memory.md has all 13 layouts)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import planner_memory

    case = next(c for c in planner_memory.CASES if c.name == name)
    r = planner_memory.compare(case)
    assert r["planned"] == pytest.approx(r["peak"], rel=0.03), (r["parts"], r["peak"])
