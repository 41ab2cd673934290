"""The command line: the flag contract, one-line errors before any process starts, end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gridtrain.cli import parser as cli
from gridtrain.config import ConfigError, load_config

BAD_CONFIGS = {
    "heads do not divide d_model": (["--n-head", "5", "--d-model", "64"], "--n-head 5 does not divide --d-model 64"),
    "tp does not divide the world": (["--tp", "3", "--nproc", "4"], "tp=3"),
    "missing data": (["--data", "/nonexistent"], "--data /nonexistent: no such file or directory"),
    "unknown preset": (["--model", "gpt5"], "unknown model preset 'gpt5'"),
    "batch does not split": (["--global-batch-size", "6", "--micro-batch-size", "4"], "--global-batch-size 6"),
    "unknown schedule": (["--schedule", "fastest"], "--schedule 'fastest'"),
    "unknown dtype": (["--dtype", "fp8"], "--dtype 'fp8'"),
    "tp does not divide heads": (["--tp", "3", "--nproc", "3"], "--tp 3 does not divide --n-head 4"),
    "interleaving needs m a multiple of pp": (["--pp", "2", "--nproc", "2", "--vpp", "2", "--schedule",
                                               "interleaved-1f1b", "--global-batch-size", "6",
                                               "--micro-batch-size", "2"], "multiple of --pp 2"),
    "vpp without interleaving": (["--pp", "2", "--nproc", "2", "--vpp", "2"], "--vpp 2 needs --schedule"),
    "bad layer split": (["--pp", "2", "--nproc", "2", "--pp-layers", "1,2"], "add up to --n-layer 2"),
    "more stages than layers": (["--pp", "4", "--nproc", "4"], "--n-layer 2 is fewer than pp x vpp = 4"),
    "sequence parallel needs divisible seq": (["--tp", "4", "--nproc", "4", "--seq-len", "30", "--sequence-parallel"],
                                              "--tp 4 does not divide --seq-len 30"),
    "vocabulary too small for bytes": (["--vocab-size", "100"], "pass --vocab-size 257"),
    "no validation batches": (["--eval-iters", "0"], "use --eval-interval 0 to turn validation off"),
    "empty global batch": (["--global-batch-size", "0"], "--global-batch-size must be >= 1"),
    "checkpoint output onto a file": (["--save", __file__], f"--save {__file__}: exists and is not a directory"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_is_one_line_before_any_process(case, capsys, no_process_may_start):
    argv, expected = BAD_CONFIGS[case]
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gridtrain: error: "), err
    assert expected in err


@pytest.mark.spawn
def test_bad_config_from_a_real_shell():
    proc = subprocess.run([sys.executable, "-m", "gridtrain", "train", "--tp", "3", "--nproc", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "tp=3" in proc.stderr


def test_yaml_file_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: small\nmodel:\n  n_layer: 3\ntraining:\n  steps: 7\n  lr: 0.01\n")
    cfg = load_config(str(path), {"training": {"steps": 9}})
    assert (cfg.preset, cfg.model.n_layer, cfg.model.d_model) == ("small", 3, 128)
    assert (cfg.training.steps, cfg.optim.lr) == (9, 0.01)
    path.write_text("model:\n  n_layers: 3\n")
    with pytest.raises(ConfigError, match="unknown key model.n_layers"):
        load_config(str(path))


def test_flags_map_onto_config_fields():
    args = cli.build_parser().parse_args(
        ["train", "--model", "tiny", "--dp", "2", "--n-layer", "3", "--dtype", "fp64", "--data", "x.txt",
         "--micro-batch-size", "2", "--metrics-file", "m.jsonl", "--no-progress"])
    cfg = cli.config_from_args(args)
    assert (cfg.parallel.dp, cfg.model.n_layer, cfg.training.dtype) == (2, 3, "fp64")
    assert (cfg.data.path, cfg.training.micro_batch_size) == ("x.txt", 2)
    assert cfg.metrics.metrics_file == "m.jsonl" and cfg.metrics.progress is False


def test_recompute_and_memory_flags_reach_the_config():
    args = cli.build_parser().parse_args(
        ["train", "--recompute", "full", "--recompute-method", "block", "--recompute-layers", "2",
         "--recompute-keep-last", "--offload-activations", "--memory-report", "--attention", "math"])
    cfg = cli.config_from_args(args)
    a = cfg.activations
    assert (a.recompute, a.recompute_method, a.recompute_layers) == ("full", "block", 2)
    assert a.recompute_keep_last and a.offload_activations and cfg.metrics.memory_report and not a.recompute_early
    assert cli.config_from_args(args).model.attention == "math"


def test_memory_report_prints_each_layer_beside_the_formula(capsys):
    assert cli.main(["train", "--model", "tiny", "--steps", "1", "--attention", "math", "--recompute", "selective",
                     "--memory-report", "--no-progress", "--eval-interval", "0", "--global-batch-size", "4",
                     "--micro-batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "activations saved for backward (step 1): stage 0 peak" in out
    assert "memory report (step 1; recompute selective, 4-byte activations" in out
    rows = [line.split() for line in out.splitlines() if line.split()[1:2] in (["blocks.0"], ["blocks.1"])]
    assert len(rows) == 2 and all(0.9 <= float(row[-1]) <= 1.1 for row in rows), rows


@pytest.mark.spawn
def test_train_two_processes_then_generate(tmp_path):
    """`gridtrain train --nproc 2` end to end, then `gridtrain generate` from its checkpoint."""
    metrics, save = tmp_path / "m.jsonl", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "gridtrain", "train", "--model", "tiny", "--nproc", "2", "--steps", "4",
           "--global-batch-size", "4", "--micro-batch-size", "2", "--metrics-file", str(metrics),
           "--save", str(save), "--sample-tokens", "20", "--prompt", "import ", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "dp 2 x pp 1 x tp 1" in proc.stdout + proc.stderr
    assert "--- sample" in proc.stdout and "import " in proc.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # the start-up, once: from the launcher's start, with each worker's peak memory
    assert ["startup" in r for r in rows] == [True, False, False, False]
    up = rows[0]["startup"]
    assert up["time_s"] > 0 and up["time_s"] == pytest.approx(sum(up["phases"].values()))
    assert list(up["phases"])[:3] == ["launch", "imports", "process_group"] and up["phases"]["launch"] > 0
    assert len(up["host_peak_bytes"]) == 2 and all(n > 0 for n in up["host_peak_bytes"])
    assert proc.stdout.count("start-up: ") == 1 and "peak host memory: max " in proc.stdout
    gen = subprocess.run([sys.executable, "-m", "gridtrain", "generate", "--load", str(save),
                          "--prompt", "class ", "--max-new-tokens", "16"],
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("class ")


@pytest.mark.spawn
def test_prepare_then_train_on_the_token_file(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    assert cli.main(["prepare", "--data", str(text), "--out", str(tmp_path / "tok")]) == 0
    assert (tmp_path / "tok.bin").is_file() and (tmp_path / "tok.json").is_file()
    proc = subprocess.run([sys.executable, "-m", "gridtrain", "train", "--model", "tiny", "--steps", "2",
                           "--data", str(tmp_path / "tok.bin"), "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_generate_without_a_checkpoint_is_one_line(tmp_path, capsys):
    assert cli.main(["generate", "--load", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint there" in err


@pytest.mark.spawn
def test_under_torchrun_the_world_comes_from_the_environment(tmp_path):
    metrics = tmp_path / "m.jsonl"
    config = tmp_path / "run.yaml"
    config.write_text("parallel:\n  nproc: 2\n")  # a config's nproc equal to the world is fine
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "gridtrain", "train", "--model", "tiny", "--steps", "2", "--global-batch-size", "4",
                           "--micro-batch-size", "2", "--metrics-file", str(metrics), "--no-progress",
                           "--config", str(config), "--sample-tokens", "5", "--pp", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks = dp 1 x pp 2 x tp 1" in proc.stdout + proc.stderr
    # printed by rank 0 only, from the whole model gathered over the launcher's group,
    # which the loop leaves to its caller
    assert proc.stdout.count("--- sample") == 1
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 2 and "startup" not in rows[1]
    up = rows[0]["startup"]  # from each worker's own start: no launch phase
    assert up["time_s"] > 0 and list(up["phases"])[0] == "imports" and len(up["host_peak_bytes"]) == 2
