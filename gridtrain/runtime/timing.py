"""Clocks for the step's own timings: the host's where work runs on the host, CUDA
events where it runs on a GPU.

On a CPU (gloo) an operation is done when its Python call returns, so ``perf_counter``
around the call is its duration. On a GPU the call only *queues* kernels and returns at
once; ``work.wait()`` of an NCCL collective does not block the host either (it makes the
current stream wait). ``perf_counter`` there times the launches, not the work: a stage
would look busy for microseconds and idle for the rest of the step. So every timing of
the step (the pipeline stage's busy time and trace, runtime.py; the data-parallel
overlap, data_parallel.py) goes through a clock:

* :meth:`mark` returns a *mark*: a ``perf_counter`` value on :class:`HostClock`, a CUDA
  event recorded on the current stream on :class:`CudaClock` (it completes when the
  stream reaches it, i.e. when everything queued before it has run);
* :meth:`seconds` turns two marks into a duration. On the CUDA clock it waits for the
  later event, so durations are read *after* the step (``StageStats`` and
  ``OverlapStats`` resolve their marks when first asked): by then the step's named host
  read of the loss (host_sync.py) has made the device catch up and the wait is free. The
  marks themselves never synchronise.

``mark`` costs a few microseconds (an event record), once per pipeline action and per
gradient bucket. A wall time that must include the device's work (a profile, a
benchmark's step time) uses :meth:`wall`, which synchronises the device first.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class HostClock:
    """``perf_counter`` marks: exact when the work runs in the calling thread (CPU)."""

    on_host = True

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def wall(self) -> float:
        return time.perf_counter()


class CudaClock:
    """CUDA-event marks on the current stream of the current device."""

    on_host = False

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds

    def wall(self) -> float:
        torch.cuda.synchronize()
        return time.perf_counter()


Clock = HostClock | CudaClock
Mark = Any  # a float on the host clock, a torch.cuda.Event on the CUDA clock


def clock_for(device: torch.device | str) -> Clock:
    """The clock that times work on ``device`` (the host's where CUDA cannot record
    events: a CPU device, or the dry run's fake CUDA tensors on a machine without one)."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return CudaClock()
    return HostClock()


def median_seconds(fn, runs: int, clock: Clock) -> float:
    """The median wall time of ``runs`` calls of ``fn``, each including the device's work
    (``clock.wall`` synchronises before reading the time)."""
    times = []
    for _ in range(runs):
        began = clock.wall()
        fn()
        times.append(clock.wall() - began)
    return sorted(times)[len(times) // 2]
