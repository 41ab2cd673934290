"""Why a run stops before its last step, and the exit status that says so.

A training job ends in one of a few ways, and whatever restarts it (a person, a batch
scheduler, ``torchrun --max-restarts``) must be able to tell them apart from the exit
status alone:

====  ===========================================================================
code  meaning
====  ===========================================================================
0     finished every step
1     a worker crashed (its traceback is printed)
2     bad input: refused before start, or (a token id outside the vocabulary) when a batch is read (one line names it and the fix)
3     diverged: a non-finite loss or gradient norm, or an fp16 loss scale that
      collapsed; ``latest`` is the last checkpoint saved before it (all finite)
4     hang: a rank waited longer than ``--timeout`` (watchdog.py prints who waited
      on what, and which ranks never arrived)
75    preempted: SIGTERM arrived, a checkpoint was saved at the next step boundary
      (when ``--save`` is set); rerun the same command with ``--auto-resume``
130   interrupted with Ctrl-C (nothing saved)
====  ===========================================================================

75 is ``EX_TEMPFAIL`` from sysexits.h, "try again later", which is what a preempted
job should do. The codes are raised as :class:`RunStopped` exceptions in the workers,
carried to the launcher as such (launch.py), and turned into the exit status by the CLI.

Two checks live here because the loop calls them at every step boundary:

* :class:`Health` refuses non-finite numbers. Every rank sees the same loss and the same
  global gradient norm (both are reduced before the loop sees them), so every rank stops
  at the same step without a further collective. In fp16 an overflowing step is skipped
  by design (its norm is inf); there the run stops when the loss scale has fallen to its
  floor and still overflows, or after many skipped steps in a row.
* :class:`Preemption` turns SIGTERM (sent by schedulers before they kill a job, and
  forwarded by the launcher and by torchrun to every worker) into a flag. The ranks may
  receive it at different moments, so at each step boundary they agree with one
  all-reduce (MAX) of the flag over the world, and then all save and stop after the same
  step. The all-reduce is only issued when there is something to save (``--save``);
  without it SIGTERM stops at once.
"""

from __future__ import annotations

import math
import signal
import threading

import torch

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_HANG = 4
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130

MAX_SKIPPED_IN_A_ROW = 50  # fp16: more overflowing steps in a row than this is a diverged run
# (halving from the largest sensible initial scale, 2**40, reaches the floor in 40)


class RunStopped(Exception):
    """The run stopped on purpose before its last step; ``exit_code`` says why.

    The message is one line for the user. Raised in a worker, it reaches the launcher
    intact (launch.py pickles it), so the CLI prints it and exits with ``exit_code``.
    """

    exit_code = EXIT_CRASH

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step

    def __reduce__(self):
        return (type(self), (str(self), self.step))


class Diverged(RunStopped):
    exit_code = EXIT_DIVERGED


class EmptyBatch(RunStopped):
    """A global batch none of whose labels carries a loss (fine-tuning prompts and padding
    only): its loss would be 0 / 0. Exit 3, as a diverged run: the step cannot be taken."""

    exit_code = EXIT_DIVERGED


class Preempted(RunStopped):
    exit_code = EXIT_PREEMPTED


class Hang(RunStopped):
    exit_code = EXIT_HANG


class Health:
    """Stops the run when it has diverged: a non-finite loss (every dtype) or gradient norm
    (fp32/bf16/fp64), or an fp16 loss scale that can no longer help.

    fp16 gradients that overflow while the loss is finite only skip the step (the loss
    scaler halves its scale); but an overflow at the minimum loss scale, where there is
    nothing left to halve, stops the run, as do more than ``max_skipped`` skips in a row.
    """

    def __init__(self, dtype: str, min_loss_scale: float = 1.0, max_skipped: int = MAX_SKIPPED_IN_A_ROW):
        self.fp16 = dtype == "fp16"
        self.min_loss_scale = min_loss_scale
        self.max_skipped = max_skipped
        self.skipped_in_a_row = 0

    def check(self, step: int, loss: float, grad_norm: float, loss_scale: float | None = None) -> None:
        """Raise :class:`Diverged` naming ``step`` (1-based, as the metrics file counts);
        ``loss_scale``: the fp16 scale this step ran with."""
        bad = [f"{name} {value}" for name, value in (("loss", loss), ("gradient norm", grad_norm))
               if not math.isfinite(value) and (name == "loss" or not self.fp16)]
        if bad:
            raise Diverged(f"step {step}: {' and '.join(bad)}; the run diverged and was stopped before "
                           "the optimizer applied it (the latest checkpoint is from before this step); "
                           "lower --lr, raise --warmup-steps or clip with --grad-clip", step)
        if self.fp16:
            self._check_overflow(step, loss_scale, skipped=not math.isfinite(grad_norm))

    def _check_overflow(self, step: int, loss_scale: float | None, skipped: bool) -> None:
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if not skipped:
            return
        if loss_scale is not None and loss_scale <= self.min_loss_scale:
            raise Diverged(f"step {step}: fp16 gradients overflow at the minimum loss scale "
                           f"{self.min_loss_scale:g} (--min-loss-scale); the run diverged and was stopped; lower "
                           "--lr or train in bf16", step)
        if self.skipped_in_a_row > self.max_skipped:
            raise Diverged(f"step {step}: {self.skipped_in_a_row} fp16 steps in a row skipped on overflow "
                           f"(loss scale {loss_scale:g}); the run diverged and was stopped; lower --lr "
                           "or train in bf16", step)


class Preemption:
    """SIGTERM as a request to save and stop at the next step boundary, agreed by all ranks.

    Installed only in the main thread (Python delivers signals there); elsewhere, and in
    threads, it is inert and SIGTERM keeps its default action.
    """

    def __init__(self, world=None):
        self.world = world  # a CommGroup over every rank, or None for one process
        self.requested = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """True on every rank when any rank has received SIGTERM (collective over the world)."""
        if self.world is None or self.world.size == 1:
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        self.world.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
