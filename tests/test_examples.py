"""The examples in examples/ run and do what their docstrings say (the docs link them)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.spawn
def test_custom_model_example_learns_to_count():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_model.py")],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    first, last, valid = map(float, re.search(r"loss (\S+) -> (\S+), valid (\S+)", proc.stdout).groups())
    assert last < 0.1 * first and valid < 0.1 * first


@pytest.mark.spawn
def test_finetune_hf_example_tunes_a_llama_on_tp2_pp2_then_samples_and_exports(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "finetune_hf.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    first, last = map(float, re.search(r"fine-tuning loss (\S+) -> (\S+) over 60 steps", proc.stdout).groups())
    assert last < 0.6 * first
    assert re.search(r"sample: 'Q: 3 plus 4\? A:.+'", proc.stdout), proc.stdout
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "tuned-hf").iterdir()}


def _sbatch_command(tmp_path: Path, *flags: str) -> list[str]:
    """The command examples/slurm/train.sbatch would run on a 2-node allocation (a fake
    ``scontrol`` expands the node list)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\n[ \"$1 $2 $3\" = \"show hostnames gpu[07-08]\" ] && printf 'gpu07\\ngpu08\\n'\n")
    scontrol.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "gpt2", "SLURM_GPUS_ON_NODE": "8", "PYTHON": "python3",
           "GRIDTRAIN_PRINT_ONLY": "1"}
    proc = subprocess.run(["bash", str(ROOT / "examples" / "slurm" / "train.sbatch"), *flags], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.spawn
def test_the_slurm_example_starts_one_torchrun_per_node_with_the_rendezvous_on_the_first(tmp_path):
    from torch.distributed.run import get_args_parser

    from gridtrain.cli.parser import build_parser, config_from_args

    cmd = _sbatch_command(tmp_path)
    assert cmd[:4] == ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1", "python3"]
    assert cmd[4:6] == ["-m", "torch.distributed.run"]
    split = cmd.index("-m", 6)
    launcher = get_args_parser().parse_args([*cmd[6:split], "placeholder.py"])
    assert (launcher.nnodes, launcher.nproc_per_node) == ("2", "8")
    assert (launcher.rdzv_backend, launcher.rdzv_endpoint, launcher.rdzv_id) == ("c10d", "gpu07:29500", "4242")
    assert cmd[split:split + 3] == ["-m", "gridtrain", "train"]
    cfg = config_from_args(build_parser().parse_args(cmd[split + 2:]))  # the flags gridtrain would read
    assert (cfg.model.n_layer, cfg.training.dtype, cfg.training.global_batch_size) == (12, "bf16", 512)
    assert cfg.checkpoint.save == "runs/gpt2" and cfg.checkpoint.auto_resume
    # flags after the script name replace the default run's
    cmd = _sbatch_command(tmp_path, "--model", "llama3-8b", "--tp", "8", "--pp", "2")
    assert cmd[cmd.index("gridtrain") + 1:] == ["train", "--model", "llama3-8b", "--tp", "8", "--pp", "2"]
