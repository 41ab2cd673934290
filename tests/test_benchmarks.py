"""The benchmarks in benchmarks/ still parse, validate, build gridtrain's side with
``gridtrain.training.trainer.build`` and run end to end at their smallest size (the numbers they
time are not checked here: only that the run completes and its own checks agree)."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TINY = ["--n-layer", "2", "--d-model", "64", "--seq-len", "32", "--steps", "1", "--repeats", "1", "--warmup", "1"]
COMPARISONS = ["tp_vs_dtensor", "pp_vs_torch_pipelining", "dp_vs_ddp", "recompute_cost"]


def _load(name: str):
    """A benchmark script as a module (its folder on sys.path, as when it is run)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _run(name: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *TINY, *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert re.search(r"^wall time \d+ s$", proc.stdout, re.M), proc.stdout
    return proc.stdout


@pytest.mark.parametrize("name", COMPARISONS)
def test_default_flags_parse_and_validate(name):
    from gridtrain.training.validate import validate

    module = _load(name)
    opts = module.parse_args([])
    world = 1 if name == "recompute_cost" else 2
    configs = ([module.make_config(opts, mode) for mode in module.MODES] if name == "recompute_cost"
               else [module._config(opts, b) for b in opts["bucket_mb"]] if name == "dp_vs_ddp"
               else [module._config(opts)])
    for cfg in configs:
        validate(cfg, world_size=world)


@pytest.mark.spawn
@pytest.mark.parametrize("name", COMPARISONS)
def test_a_bad_shape_is_one_line_and_status_2(name):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--n-head", "5", "--d-model", "64"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"{name}: error: --n-head 5 does not divide --d-model 64; "
                                   "choose a head count that divides d_model")


@pytest.mark.spawn
def test_recompute_cost_runs_and_the_modes_agree():
    out = _run("recompute_cost", "--global-batch-size", "4", "--micro-batch-size", "2")
    assert all(f"| {mode} |" in out for mode in ("none", "selective", "full"))
    assert "dropout masks: IDENTICAL" in out
    assert "none 0, selective 4, full 4 (2 blocks x 2 micro-batches = 4 expected" in out


@pytest.mark.spawn
def test_dp_vs_ddp_runs_and_agrees_with_ddp_bit_for_bit():
    out = _run("dp_vs_ddp", "--microbatches", "2", "--micro-batch-size", "2", "--bucket-mb", "0.25", "--no-floor")
    assert "loss check, step 1 from the same weights and batch: AGREE, bit for bit" in out
    assert "+ token count 8 + step scalars 24 = " in out and "MISMATCH" not in out
    assert "max |gridtrain - DDP| per bucket size: 0.25 MiB 0.0e+00" in out


@pytest.mark.spawn
def test_tp_vs_dtensor_runs_and_counts_the_closed_form():
    out = _run("tp_vs_dtensor", "--batch", "2", "--no-variant")
    assert re.search(r"gridtrain TP bytes/step \(ByteCounter, tp group\): [\d,]+ \(closed form [\d,]+: match\)", out)
    assert "| gridtrain 1 process |" in out


@pytest.mark.spawn
def test_pp_vs_torch_pipelining_runs_and_the_tied_variant_agrees():
    out = _run("pp_vs_torch_pipelining", "--microbatches", "2", "--micro-batch-size", "2", "--no-reference")
    diff = re.search(r"torch 1F1B \+ tied all-reduce \S+ \(diff \S+; largest over 2 steps (\S+)\)", out)
    assert diff and float(diff.group(1)) < 1e-4, out


def test_checkpoint_save_reads_gridtrain_s_summary_line():
    """The benchmark parses the run summary's `checkpoints:` line: the format it expects is gridtrain's."""
    from gridtrain.checkpoint.sharded import SaveReport
    from gridtrain.training.report import save_summary

    module = _load("checkpoint_save")
    saves = [SaveReport(step=2 * i, blocked_s=0.1 * i, write_s=1.0 + i) for i in (1, 2, 3)]
    for background in (False, True):
        found = module.SUMMARY.search(save_summary(saves, background))
        assert found and found.groups() == ("3", "0.200", "0.300", "0.100, 0.200, 0.300", "3.000")


@pytest.mark.spawn
def test_checkpoint_save_default_command_validates_and_a_bad_one_is_status_2(tmp_path):
    module = _load("checkpoint_save")
    module.check(module.parse_args([]), tmp_path)  # gpt2 at dp 2 x tp 2: what gridtrain train checks
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "checkpoint_save.py"), "--model", "tiny", "--tp", "3",
                           "--dp", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.startswith("checkpoint_save: error: ") and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.spawn
def test_checkpoint_save_runs_both_modes():
    """One process, the tiny model, one round: both modes run, are measured and reported."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "checkpoint_save.py"), "--model", "tiny", "--dp", "1",
                           "--tp", "1", "--seq-len", "32", "--steps", "3", "--save-interval", "1", "--rounds", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for mode in ("sync", "async"):
        assert re.search(rf"^\| 1 \| {mode} \| [\d.]+ \| 3 \| ", proc.stdout, re.M), proc.stdout
    assert re.search(r"^  pause per save \(measured, median\) \S+", proc.stdout, re.M), proc.stdout
    assert re.search(r"^wall time \d+ s$", proc.stdout, re.M)


@pytest.mark.spawn
def test_cp_long_context_runs_every_side_and_refuses_a_bad_shape():
    """At a tiny size: one round of the four sides, a table row each, the cp rows with
    their hidden share of the transfers; a sequence that does not cut into 2 x cp chunks
    is one line and status 2."""
    base = [sys.executable, str(BENCHMARKS / "cp_long_context.py"), "--d-model", "32", "--n-head", "2",
            "--steps", "2", "--rounds", "1"]
    proc = subprocess.run([*base, "--seq-len", "64"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| one process", "| tp 2 + SP", "| cp 2 ring", "| cp 2 allgather"]
    assert all(re.search(r"\| \d+% \|", r) for r in rows[2:]) and "| - |" in rows[0]
    bad = subprocess.run([*base, "--seq-len", "66"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("cp_long_context: error: --cp 2: --seq-len 66 is not divisible by 2 x cp = 4")


@pytest.mark.spawn
def test_startup_times_warm_and_cold_workers_that_train_the_same_losses():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "startup.py"), "--nproc", "1", "--rounds", "1",
                           "--steps", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for side in ("warm (forkserver)", "cold (spawn)"):
        assert re.search(rf"^\| {re.escape(side)} \| [\d.]+ s \| [\d.]+ s \| [\d.]+x \|$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^a worker's imports, cold, this checkout: [\d.]+ s", proc.stdout, re.M)
    assert re.search(r"^wall time \d+ s$", proc.stdout, re.M)
