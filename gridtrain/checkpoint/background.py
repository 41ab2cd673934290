"""Checkpoints written in the background (``--save-async``): the training loop waits
only while this rank's state is copied to host memory.

A save here is the synchronous one (sharded.py) split in two:

1. **staging**, on the training thread: every piece this rank writes is copied into
   host memory (pinned beside a GPU), and the metadata (step, config, optimizer and
   loss-scaler state) is taken as it is now; the step resumes once the copies are done.
   This is the time the run summary reports as blocked per save;
2. **writing**, on a thread of its own: DCP's planning collectives, the files, the
   seals, the manifest and the move into place, all over a process group created for
   checkpoints alone (gloo, the whole world). Training's collectives run on their own
   groups at the same time; sharing one group between the two threads is how async
   saves deadlock (a collective of the writer and one of the step meeting out of order).

The next save (and the end of the run) first waits for the previous write, so at most
one is in flight and the staged copy is freed before the next one is made. A failure in
the background is kept and raised on the training thread at that wait, on every rank
(the write's own collectives tell every rank of any rank's failure), never dropped: the
run stops with the error, and ``latest`` still names the previous complete checkpoint.
"""

from __future__ import annotations

import importlib
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gridtrain.checkpoint.errors import CheckpointError, first_line
from gridtrain.checkpoint.shards import Slab
from gridtrain.checkpoint.sharded import SaveReport, write_state


def stage(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` in host memory: every :class:`Slab`'s pieces copied, other values
    (RNG states, already on the host) kept."""
    staged = {k: v.to_host() if isinstance(v, Slab) else v for k, v in state.items()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the non-blocking copies to pinned memory are done
    return staged


class BackgroundSaver:
    """One checkpoint write at a time on a background thread (see the module docstring)."""

    def __init__(self, group=None):
        """``group``: the process group for the writes; default: a new gloo group over the
        world (collective: every rank constructs its saver at the same point)."""
        if group is None and dist.is_initialized() and dist.get_world_size() > 1:
            group = dist.new_group(backend="gloo")
        self.group = group
        # DCP is imported lazily (sharded.py); import it here, on the training thread, so that
        # a writer thread never imports it while a step runs
        importlib.import_module("torch.distributed.checkpoint")
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._current: SaveReport | None = None
        self.reports: list[SaveReport] = []

    def save(self, directory: str | Path, step: int, state: dict[str, Any], meta: dict[str, Any], *,
             keep_last: int = 0) -> SaveReport:
        """Wait for the previous write, stage ``state``, start writing it; returns the
        report, whose ``write_s`` is filled when the write ends."""
        self.wait()
        began = time.perf_counter()
        staged = stage(state)
        seconds = time.perf_counter() - began
        report = SaveReport(step=step, blocked_s=seconds, staged_s=seconds)
        self._current = report
        self._thread = threading.Thread(target=self._write, args=(directory, step, staged, meta, keep_last, report),
                                        name=f"gridtrain-save-{step}", daemon=True)
        self._thread.start()
        self.reports.append(report)
        return report

    def _write(self, directory, step: int, staged: dict[str, Any], meta: dict[str, Any], keep_last: int,
               report: SaveReport) -> None:
        began = time.perf_counter()
        try:
            report.path = write_state(directory, step, staged, meta, group=self.group, keep_last=keep_last)
        except BaseException as exc:  # kept for the training thread: never silent
            self._error = exc
        finally:
            report.write_s = time.perf_counter() - began

    def wait(self) -> None:
        """Block until the write in flight (if any) has ended; raise its failure here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            step = self._current.step if self._current is not None else "?"
            if isinstance(error, CheckpointError):
                raise CheckpointError(f"background save of step {step} failed: {first_line(error)}") from None
            raise CheckpointError(f"background save of step {step} failed ({type(error).__name__}: "
                                  f"{first_line(error)}); the previous checkpoint is unchanged") from error

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
