"""Where a run's start-up goes: the time from the launch to its first training step, in
named phases, and each process's peak memory until then.

The launch is the ``gridtrain train`` command's start. The launcher of ``--nproc`` workers
passes its own start time to them in ``GRIDTRAIN_LAUNCH_TIME`` (seconds since the epoch);
a process without it (one process, a torchrun worker, the Python API) counts from its own
start, read from /proc on Linux (from the moment training is called where /proc is
missing). A second run in the same process (the Python API called again) counts from its
own call.

A phase is the time between two stamps, named after what ended at the later one, so
the phases add up to the whole:

* ``launch``: the launch to this process's start (the launcher's imports and checks, the
  warm server's start, the fork);
* ``imports``: this process's start to its first step of set-up (the interpreter and the
  imports; next to nothing for a warm worker);
* ``process_group``: a ``--nproc`` worker's default process group;
* ``distributed``: the grid's process groups (with torchrun or in one process, the
  default group too);
* ``model``: the model provider (build, materialise, initialise) and the weights'
  broadcast;
* ``data``: the datasets provider;
* ``optimizer``: the pipeline schedule, gradient buffers, optimizer and a checkpoint
  loaded on resume or ``--init-from``;
* ``loop``: the training loop's own set-up before the first step begins.

Nothing here imports torch: worker.py stamps its phases before it opens its work.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

LAUNCH_TIME_ENV = "GRIDTRAIN_LAUNCH_TIME"

_early: list[tuple[str, float]] = []  # phases this process ended before its first run began
_runs = 0  # runs begun in this process


def stamp(phase: str) -> None:
    """``phase`` ends now: for what a worker does before the run is called (worker.py)."""
    _early.append((phase, time.time()))


# ---- /proc ---------------------------------------------------------------------------------------

def start_from_stat(stat: str, ticks_per_s: float, boot_now: float, now: float) -> float:
    """A process's start in seconds since the epoch, from its /proc/PID/stat line: field 22
    (``starttime``, clock ticks after boot), at ``now`` (``time.time()``) and ``boot_now``
    (seconds since boot, CLOCK_BOOTTIME, the clock ``starttime`` counts on). The boot
    clock read now gives the process's age to a tick, where /proc/stat's ``btime`` (whole
    seconds) would shift it by up to a second."""
    fields = stat[stat.rindex(")") + 2:].split()  # field 2, the name in parentheses, may hold spaces
    return now - (boot_now - int(fields[22 - 3]) / ticks_per_s)  # fields[0] is field 3


def vm_hwm_bytes(status: str) -> int | None:
    """The peak resident set (``VmHWM``) of a /proc/PID/status text, in bytes."""
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    return None


def process_start_time() -> float | None:
    """This process's start (seconds since the epoch), or None without /proc."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        boot_now = time.clock_gettime(time.CLOCK_BOOTTIME)
        started = start_from_stat(stat, os.sysconf("SC_CLK_TCK"), boot_now, time.time())
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc, no CLOCK_BOOTTIME (not Linux)
        return None
    return started if started <= time.time() else None


def host_peak_bytes() -> int | None:
    """This process's peak resident set so far: /proc's VmHWM, else getrusage's ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            peak = vm_hwm_bytes(f.read())
        if peak is not None:
            return peak
    except OSError:
        pass
    try:
        import resource
    except ImportError:  # not Unix
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB elsewhere


def launch_time(default: float) -> float:
    """``GRIDTRAIN_LAUNCH_TIME`` where it holds a time that has passed, else ``default``."""
    try:
        launched = float(os.environ.get(LAUNCH_TIME_ENV, ""))
    except ValueError:
        return default
    return launched if math.isfinite(launched) and launched <= time.time() else default


def launch_environment() -> dict[str, str]:
    """What a launcher passes its workers: the command's start (this process's)."""
    started = process_start_time()
    return {LAUNCH_TIME_ENV: repr(launch_time(started if started is not None else time.time()))}


# ---- one run -------------------------------------------------------------------------------------

@dataclass
class Startup:
    """A run's start-up: the launch to the first step, and every rank's peak memory by then."""

    time_s: float
    phases: dict[str, float]  # phase -> seconds, in order; they add up to time_s
    host_peak_bytes: list[int | None]  # per rank (None where the platform cannot tell)
    device_peak_bytes: list[int] | None  # per rank on GPUs (torch.cuda.max_memory_allocated), else None

    def as_json(self) -> dict:
        return {"time_s": self.time_s, "phases": dict(self.phases), "host_peak_bytes": list(self.host_peak_bytes),
                "device_peak_bytes": None if self.device_peak_bytes is None else list(self.device_peak_bytes)}


class StartupClock:
    """One run's stamps, from its origin (the launch, or the run's call) to its first step."""

    def __init__(self, origin: float, stamps: list[tuple[str, float]]):
        self.origin = origin
        self.stamps = stamps

    @classmethod
    def begin(cls) -> StartupClock:
        """At the run's call. The first run in a process counts from the launch and takes
        the phases the process stamped before it; a later one counts from now."""
        global _runs
        now = time.time()
        origin, stamps = now, []
        if _runs == 0:
            started = process_start_time()
            origin = launch_time(started if started is not None else now)
            if started is not None and started > origin:
                stamps.append(("launch", started))
            stamps += _early if _early else [("imports", now)]
        _early.clear()
        _runs += 1
        return cls(origin, stamps)

    def stamp(self, phase: str) -> None:
        """``phase`` ends now (once: a later call of the same phase is not set-up)."""
        if all(name != phase for name, _ in self.stamps):
            self.stamps.append((phase, time.time()))

    def timed(self, fn: Callable, before: str, after: str | None = None) -> Callable:
        """``fn``, stamping ``before`` when it is called and ``after`` when it returns."""
        @functools.wraps(fn)
        def call(*args, **kwargs):
            self.stamp(before)
            out = fn(*args, **kwargs)
            if after is not None:
                self.stamp(after)
            return out
        return call

    def phases(self) -> dict[str, float]:
        """Seconds per phase from the origin to the last stamp (a stamp out of order adds 0)."""
        out: dict[str, float] = {}
        last = self.origin
        for name, t in self.stamps:
            t = max(t, last)
            out[name] = out.get(name, 0.0) + (t - last)
            last = t
        return out
