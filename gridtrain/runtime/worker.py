"""The worker side of ``launch.run_workers``: what a worker process runs.

The first thing it does is arrange to die with its parent, and only then import.

A worker is forked by the warm server (warm.py), which has imported torch already, or,
under ``GRIDTRAIN_START_METHOD=spawn``, spawned cold and spends its first seconds
importing torch. If the launcher is killed (kill -9) in that window, a worker that has
not yet asked Linux to kill it with its parent lives on as an orphan; with many workers
that is many orphans. So this module imports nothing heavy at the top: :func:`main` sets
the parent-death signal, checks the parent is still there, takes on what the launcher
sent for this run (:class:`Start`: environment, standard output and error), and only
then unpickles the work (whose function and arguments import torch and the rest of the
package); torch is imported inside the functions that need it. Keep it that way: the
warm server imports this module before anything else.

After that, the worker joins the parent's store (stamping the start-up's phases that end
before the run: startup.py), runs the function and sends back its result, its deliberate
stop or its traceback (the parent side is launch.py).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a spawned worker needs; pickled once per worker by multiprocessing."""

    fn: Callable[..., Any]
    args: tuple
    rank: int
    world_size: int
    port: int
    backend: str
    collective_timeout_s: float
    env: dict[str, str] = field(default_factory=dict)


def _set_worker_env(spec: WorkerSpec) -> None:
    """Export the torchrun-style variables, so code inside fn can read them as usual."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spec.port),
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(spec.rank),
        LOCAL_WORLD_SIZE=str(spec.world_size),
    )
    os.environ.update(spec.env)


def _init_worker_process_group(spec: WorkerSpec) -> None:
    """Join the parent's store and create the default process group.

    Threads are capped at cores / workers: N workers each using every core
    oversubscribe the CPU and run many times slower than N single-threaded ones.

    Under NCCL the worker binds its GPU first and passes it as ``device_id``; the GPU
    is chosen by the package's one rule (``devices.local_device_index`` of LOCAL_RANK
    among LOCAL_WORLD_SIZE, which :func:`_set_worker_env` has just set), the same that
    distributed.py uses for the tensors, so the group and the tensors agree. More
    workers than GPUs is refused there with one line (validate_config.py refuses it
    earlier, before spawning; this is the backstop for the Python API).
    """
    import torch
    import torch.distributed as dist

    from gridtrain.runtime.devices import process_group_device

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    device_id = process_group_device(spec.backend, same_gpus=True)  # all workers see the same GPUs
    timeout = timedelta(seconds=spec.collective_timeout_s)
    store = dist.TCPStore("127.0.0.1", spec.port, spec.world_size, is_master=False, timeout=timeout)
    extra = {"device_id": device_id} if device_id is not None else {}
    dist.init_process_group(
        spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout, **extra
    )


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _pickle_result(value: Any) -> bytes:
    """Pickle fn's return value here, so an unpicklable one is reported as this rank's error."""
    try:
        return pickle.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"fn returned a {type(value).__name__} that cannot be pickled to send it "
            f"to the parent ({exc}); return plain data, e.g. tensors, numbers, dicts"
        ) from exc


def _report(results: Any, message: tuple[int, str, Any]) -> None:
    """Send one message and wait until it is in the pipe, not just in the feeder's buffer,
    so that it reaches the parent before anything this worker does next (e.g. closing
    its connections, which makes its peers fail and report too)."""
    results.put(message)
    results.close()
    results.join_thread()


def worker_main(spec: WorkerSpec, results: Any) -> None:
    """Run fn and report its result, its deliberate stop (:class:`RunStopped`) or its
    traceback.

    The result is pickled here with plain pickle, not by the queue's feeder
    thread: a feeder-side pickling error is only printed, and the parent would
    wait for a message that never comes (torch's queue pickler would also
    share tensors through memory that dies with this process). An error is
    reported before tearing down the process group, so the parent hears about
    the root cause before the other ranks (blocked in a collective with this
    one) fail in turn.
    """
    from gridtrain.runtime import startup
    from gridtrain.runtime.stops import RunStopped

    _set_worker_env(spec)
    try:
        startup.stamp("imports")  # the start-up's phases until the run (startup.py)
        _init_worker_process_group(spec)
        startup.stamp("process_group")
        value = spec.fn(spec.rank, spec.world_size, *spec.args)
        _destroy_process_group()
        payload = _pickle_result(value)
    except RunStopped as stop:
        _report(results, (spec.rank, "stop", pickle.dumps(stop)))
        _destroy_process_group()
        return
    except BaseException:  # noqa: BLE001 -- every failure must reach the parent
        _report(results, (spec.rank, "error", traceback.format_exc()))
        try:
            _destroy_process_group()
        except BaseException:  # noqa: BLE001 -- already reporting the first failure
            pass
        return
    _report(results, (spec.rank, "ok", payload))


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


class StdioFds:
    """The launcher's standard output and error *now*, sent to a worker as file
    descriptors. A spawned worker inherits them anyway; a forked one would otherwise
    write wherever the warm server's were when it started (e.g. an earlier test's
    output capture)."""

    def __init__(self, fds: tuple[Any, ...] = ()):
        self.fds = fds  # in the worker: multiprocessing's wrappers of the received descriptors

    def __reduce__(self):
        from multiprocessing import reduction

        # Called while multiprocessing pickles the process object: DupFd queues each
        # descriptor to be passed along with it.
        return StdioFds, (tuple(reduction.DupFd(fd) for fd in (1, 2)),)

    def adopt(self) -> None:
        for target, wrapped in zip((1, 2), self.fds):
            (sys.stdout if target == 1 else sys.stderr).flush()
            fd = wrapped.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


@dataclass(frozen=True)
class Start:
    """What a worker takes from the launcher before it opens its work: the pid of the
    process that started it (the launcher, or the warm server that forked it), the
    launcher's environment and its standard output and error."""

    parent_pid: int
    environ: dict[str, str]
    stdio: StdioFds = field(default_factory=StdioFds)

    def adopt(self) -> None:
        if os.environ != self.environ:  # a forked worker has the server's environment
            os.environ.clear()
            os.environ.update(self.environ)
        self.stdio.adopt()


def main(start: Start, payload: bytes, results) -> None:
    """Process target: ``payload`` is the pickled worker spec, opened only after the
    parent-death signal is in place and the launcher's environment and output are this
    process's."""
    die_with_parent(start.parent_pid)
    # Ctrl-C reaches every process of the terminal's group; the launcher alone answers it
    # (it stops the workers), so no worker prints a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the warm server ignores it (warm.py)
    start.adopt()
    worker_main(pickle.loads(payload), results)
