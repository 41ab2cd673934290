"""The examples in examples/ run and do what their docstrings say (the README links them)."""

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
