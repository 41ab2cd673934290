"""A real job with one rank frozen (SIGSTOP): what the watchdog must name within its
timeout. Used by the self-check's ``watchdog`` step (gloo ranks on CUDA: the watchdog's
CUDA-event waits) and by tests/test_watchdog.py (CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gridtrain.runtime.procs import alive, local_workers

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120


@dataclass
class StoppedRun:
    code: int  # the launcher's exit code
    elapsed_s: float  # from the SIGSTOP to the launcher's exit
    err: str  # the launcher's stderr (the workers' included)
    left: list[int]  # worker pids still alive half a second after the launcher exited (killed then)


def stop_a_rank_and_wait(workdir: Path, stop_rank: int, nproc: int, timeout_s: float, *flags: str) -> StoppedRun:
    """Start ``gridtrain train --nproc nproc flags`` on the tiny model, freeze rank
    ``stop_rank`` once two steps are done, and wait for the job to end (at most the
    timeout and 30 s more). Raises RuntimeError when the job does not start."""
    metrics = Path(workdir) / "metrics.jsonl"
    cmd = [sys.executable, "-m", "gridtrain", "train", "--nproc", str(nproc), *flags, "--model", "tiny",
           "--steps", "100000", "--timeout", str(timeout_s), "--no-progress", "--eval-interval", "0",
           "--sample-tokens", "0", "--metrics-file", str(metrics)]
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            if launcher.poll() is not None:
                raise RuntimeError(f"the job ended before its second step: {launcher.communicate()[1][-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job did not finish two steps in {START_TIMEOUT_S} s")
            time.sleep(0.1)
        workers = local_workers(launcher.pid)
        if len(workers) != nproc:
            raise RuntimeError(f"expected {nproc} worker processes, found {workers}")
        os.kill(workers[stop_rank], signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = launcher.communicate(timeout=timeout_s + 30)
        elapsed = time.monotonic() - stopped_at
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    time.sleep(0.5)
    left = [pid for pid in workers if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return StoppedRun(launcher.returncode, elapsed, err, left)


def named_within(run: StoppedRun, stop_rank: int, timeout_s: float, exit_code: int) -> str | None:
    """What is wrong with the job's end, or None when the watchdog named the frozen rank
    in time, exited with the hang code, and no worker or traceback was left behind."""
    hang = [line for line in run.err.splitlines() if line.startswith("gridtrain: hang: ")]
    if not hang or f"rank {stop_rank} never arrived at" not in hang[0]:
        return f"no hang report naming rank {stop_rank}"
    if f"never arrived: rank {stop_rank} (published no report" not in run.err:
        return f"the report does not say rank {stop_rank} published nothing"
    if run.code != exit_code:
        return f"exit code {run.code}, expected {exit_code}"
    if run.elapsed_s > timeout_s + 10:  # about 5 s measured: the reports' grace, then a stopped rank killed at once
        return f"named after {run.elapsed_s:.1f} s, more than the timeout {timeout_s} s + 10 s"
    if "Traceback" in run.err:
        return "a traceback was printed"
    if run.left:
        return f"workers {run.left} outlived the launcher"
    return None
