"""A kill -9 at any moment of a save leaves a loadable ``latest``, synchronous or not.

One save directory, a run that saves after every step (so that most of its time is spent
saving), killed with SIGKILL (launcher and workers at once, as a lost node) at random
moments, alternately without and with ``--save-async``; after each kill the newest
checkpoint must pass every check (manifest, sizes, sha256, model) and load, and the next
run resumes from it with ``--auto-resume``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gridtrain import checkpoint
from gridtrain.config import preset_config
from gridtrain.models.decoder import Decoder

ROOT = Path(__file__).resolve().parents[1]
KILLS = 3


def _command(save: Path, background: bool, steps: int) -> list[str]:
    return [sys.executable, "-m", "gridtrain", "train", "--model", "tiny", "--nproc", "2", "--tp", "2",
            "--steps", str(steps), "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-interval", "0",
            "--save", str(save), "--save-interval", "1", "--keep-last", "2", "--auto-resume", "--no-progress",
            "--sample-tokens", "0"] + (["--save-async"] if background else [])


def _loads(save: Path) -> int:
    step = checkpoint.latest_step_dir(save, verify_data=True)
    assert step is not None
    model = Decoder(preset_config("tiny").model)
    return checkpoint.load_checkpoint(step, model, torch.optim.AdamW(model.parameters()))


@pytest.mark.spawn
def test_kill_9_during_saves_always_leaves_a_loadable_latest(tmp_path):
    rng = random.Random(14)
    save = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    resumed: list[int] = []
    for kill in range(KILLS):
        log = tmp_path / f"run{kill}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(_command(save, kill % 2 == 1, 10_000), cwd=ROOT, env=env,
                                    start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while _newest(save) <= (resumed[-1] if resumed else 0):
                assert proc.poll() is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, "no checkpoint written"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 1.0))  # somewhere in a save, most likely
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if resumed:  # this run continued from the checkpoint the previous kill left
            assert f"resuming from {checkpoint.step_dir(save, resumed[-1])} after step {resumed[-1]}" in log.read_text()
        resumed.append(_loads(save))
        # --keep-last 2; a kill between a save's move into place and its pruning leaves one more
        assert len([p for p in save.iterdir() if p.name.startswith("step_")]) <= 2 + 1
    assert resumed == sorted(resumed)


def _newest(save: Path) -> int:
    step = checkpoint.latest_step_dir(save)
    return int(step.name[5:]) if step is not None else -1
