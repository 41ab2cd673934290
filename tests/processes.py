"""Real `gridtrain` commands in subprocesses, for fault tests: start one, wait until it has
trained some steps, find its workers, signal them, and check that none is left behind.

Workers are found through /proc (Linux): a process's children are the processes whose
parent pid is its pid. `--nproc` workers are the children of the launcher's warm server
(or the launcher's own, under GRIDTRAIN_START_METHOD=spawn); torchrun's workers are the
torchrun agent's children.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gridtrain.runtime import procs

GRIDTRAIN = [sys.executable, "-m", "gridtrain"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def start(argv: list[str], **kwargs) -> subprocess.Popen:
    """A command in its own session (signals to it do not reach pytest), output captured,
    with SIGINT's default disposition, as a terminal's foreground job has it (a suite
    started in the background by a non-interactive shell runs with SIGINT ignored, and
    an ignored disposition is inherited)."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_sigint, **kwargs)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


children, alive = procs.children, procs.alive


def servers(pid: int) -> list[int]:
    """The warm servers (multiprocessing's forkserver) among the children of ``pid``."""
    return [child for child in children(pid) if procs.is_server(child)]


def workers(pid: int) -> list[int]:
    """The gridtrain worker processes started by the launcher or torchrun agent ``pid``,
    in rank order."""
    return procs.local_workers(pid)


def metrics_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return rows


def wait_for_rows(path: Path, count: int, proc: subprocess.Popen, timeout_s: float = 180) -> list[dict]:
    """Wait until the metrics file holds ``count`` steps (the run is training)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = metrics_rows(path)
        if len(rows) >= count:
            return rows
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before step {count}:\n"
                                 f"{proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no step {count} in {path} after {timeout_s} s")


def finish(proc: subprocess.Popen, timeout_s: float = 180) -> tuple[int, str, str]:
    """Wait for the command; (exit status, stdout, stderr)."""
    out, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, out, err


def kill_tree(pids: list[int]) -> None:
    """Clean-up after a failed test: SIGKILL whatever is left."""
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass


def losses_by_step(path: Path) -> dict[int, float]:
    """Step -> loss from a metrics file, asserting that each step appears exactly once."""
    rows = metrics_rows(path)
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"steps repeated in {path}: {steps}"
    return {r["step"]: r["loss"] for r in rows}
