"""The first code a spawned worker runs: arrange to die with the launcher, then import.

A spawned worker spends its first seconds importing torch. If the launcher is killed
(kill -9) in that window, a worker that has not yet asked Linux to kill it with its
parent lives on as an orphan; with many workers that is many orphans. So the entry
point lives in this module, which imports nothing heavy: it sets the parent-death
signal, checks the parent is still there, and only then unpickles the work (whose
function and arguments import torch and the rest of the package). Keep it that way.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so no orphan outlives a
    crashed or killed launcher (the parent's ``finally`` cannot run after SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def main(parent_pid: int, payload: bytes, results) -> None:
    """Spawn target: ``payload`` is the pickled worker spec, opened only after the
    parent-death signal is in place."""
    die_with_parent(parent_pid)
    from gridtrain.launch import worker_main

    worker_main(pickle.loads(payload), results)
