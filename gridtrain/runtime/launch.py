"""Run a function on N local worker processes, or join a job started by torchrun.

``run_workers`` backs both ``gridtrain train --nproc N`` and the test suite's
multi-process harness, so it is built to start fast, fail loudly and never hang:

* workers start warm: a server that has imported torch and the package forks them
  (warm.py), with this process's environment and output sent along;

* the parent hosts the rendezvous store itself (a ``TCPStore`` on a port the OS
  picks), so there is no window in which another job can grab a port chosen by
  ``find_free_port`` -- test suites running side by side do not collide;
* each worker sends back either its pickled result or its formatted traceback;
  the parent polls that queue *and* the workers' liveness, so a worker that
  raises, is killed or segfaults is reported by rank instead of leaving the
  parent blocked on ``queue.get`` or the other ranks blocked in a collective;
* whatever happens (error, timeout, Ctrl-C in the parent), the parent
  terminates every worker it started before returning or raising, and on Linux
  workers also die if the parent is killed outright (from their first instruction:
  worker.py sets that up before it opens its work; the warm server dies with the
  launcher, and its workers with it);
* a worker that stops on purpose (stops.py: diverged, preempted) sends its
  :class:`~gridtrain.runtime.stops.RunStopped` back, which the parent raises as it is, so the
  exit status means the same with ``--nproc`` as in one process; a worker that exits
  with the hang status (the watchdog has printed its report) is reported as a hang;
* SIGTERM to the parent (a scheduler preempting the job) is forwarded to every
  worker, so that they save at the next step boundary; the parent then exits with
  the preempted status.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_lib
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from gridtrain.runtime import warm, worker
from gridtrain.runtime.devices import (DeviceError, cuda_device_from_env, gpu_shortage, local_device_index,  # noqa: F401
                               local_placement, process_group_device)
from gridtrain.runtime.stops import EXIT_HANG, Hang, Preempted, RunStopped
from gridtrain.runtime.worker import WorkerSpec

_POLL_S = 0.05          # how often the parent checks the queue and worker liveness
_DRAIN_GRACE_S = 1.0    # how long to wait for a dead worker's last message in the pipe
_EXIT_GRACE_S = 10.0    # how long finished workers get to tear down before termination
_KILL_GRACE_S = 3.0     # how long a terminated worker gets before SIGKILL
_FAILURE_GRACE_S = 0.25 # how long to gather further reports after a first failure


class LaunchError(RuntimeError):
    """The workers could not be started or did not all finish successfully."""


class WorkerError(LaunchError):
    """A worker raised or died; ``rank``, ``exitcode`` and ``worker_traceback`` say how."""

    def __init__(
        self, message: str, rank: int, worker_traceback: str = "", exitcode: int | None = None
    ):
        super().__init__(message)
        self.rank = rank
        self.worker_traceback = worker_traceback
        self.exitcode = exitcode


class WorkerTimeout(LaunchError):
    """Some workers had not finished within ``timeout_s``; ``ranks`` lists them."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    Another process may take it before it is used; ``run_workers`` avoids that
    race by letting its store bind port 0 instead. This is for callers that
    need a port number up front (e.g. to pass MASTER_PORT to torchrun).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- parent side -------------------------------------------------------------


def _describe_exit(exitcode: int | None) -> str:
    """Exit code in words; negative codes are signals (e.g. -9 is SIGKILL)."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"exit code {exitcode}, killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"exit code {exitcode}"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _drain(results: Any, wait_s: float) -> list[tuple[int, str, Any]]:
    """Every message already in the queue, waiting up to ``wait_s`` for the first one."""
    messages = []
    deadline = time.monotonic() + wait_s
    while True:
        try:
            messages.append(results.get(timeout=max(0.0, deadline - time.monotonic())))
        except queue_lib.Empty:
            return messages
        deadline = time.monotonic()  # after the first hit, only take what is already there


def _silent_deaths(procs: Sequence[Any], reported: set[int]) -> list[int]:
    """Ranks whose process has exited without sending any message."""
    return [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]


def _death_message(rank: int, exitcode: int | None) -> str:
    return f"worker rank {rank} died without reporting a result ({_describe_exit(exitcode)})"


def _failure(
    procs: Sequence[Any], errors: dict[int, str], done: dict[int, Any], results: Any,
    sigterm: "_SigtermForwarder",
) -> LaunchError | RunStopped:
    """Build the error for a failed run, naming the most likely root cause first.

    A rank that exited with the hang status has printed the watchdog's report: the run
    stopped on a hang, whatever its peers said. After a SIGTERM to the launcher, workers
    that died of it (no ``--save``, so no handler) mean a preempted run, not a crash.

    When one rank fails, its peers usually fail soon after with "connection
    closed" errors from the collective they shared. So: wait briefly for
    further reports, then blame a rank that died silently (killed, segfault --
    its peers can only have failed because of it) or else the first rank that
    reported, and list the others in one line each.
    """
    for rank, kind, body in _drain(results, _FAILURE_GRACE_S):
        if kind == "error":
            errors.setdefault(rank, body)
    dead = _silent_deaths(procs, set(done) | set(errors))
    hung = [r for r in dead if procs[r].exitcode == EXIT_HANG]
    if hung:
        return Hang(f"rank(s) {hung} found a communication wait longer than --timeout and stopped the "
                    "run; the hang report above says which rank waited on what and who never arrived")
    if sigterm.received or any(procs[r].exitcode == -signal.SIGTERM for r in dead):
        return Preempted("stopped by SIGTERM before a checkpoint could be saved (pass --save to save "
                         "at the next step boundary on SIGTERM)")
    if dead:
        rank, exitcode = dead[0], procs[dead[0]].exitcode
        message, tb = _death_message(rank, exitcode), ""
    else:
        rank, exitcode = next(iter(errors)), None
        tb = errors[rank]
        message = f"worker rank {rank} failed:\n{tb.rstrip()}"
    others = {r: _last_line(t) for r, t in errors.items() if r != rank}
    others.update({r: _death_message(r, procs[r].exitcode) for r in dead[1:]})
    if others:
        also = "; ".join(f"rank {r}: {line}" for r, line in sorted(others.items()))
        message += f"\n(other failures, probably consequences: {also})"
    return WorkerError(message, rank=rank, worker_traceback=tb, exitcode=exitcode)


def _start_workers(ctx: Any, parent_pid: int, specs: Sequence[WorkerSpec], results: Any, procs: list) -> None:
    """Start one process per spec, appending each to ``procs`` as soon as it exists,
    so the caller's cleanup sees every started worker even if a later start fails."""
    start = worker.Start(parent_pid, dict(os.environ), worker.StdioFds())
    for spec in specs:
        try:
            payload = pickle.dumps(spec)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise LaunchError(
                f"cannot send fn/args to the workers ({exc}); fn must be a module-level "
                "function and args must be picklable"
            ) from exc
        proc = ctx.Process(target=worker.main, args=(start, payload, results),
                           name=f"gridtrain-rank{spec.rank}")
        proc.start()
        procs.append(proc)


def _terminate(procs: Sequence[Any]) -> None:
    """Stop every worker still alive: SIGTERM, then SIGKILL after a grace period; a
    stopped worker (SIGSTOP, a debugger) cannot act on SIGTERM, so it is killed at once."""
    for proc in procs:
        if proc.is_alive():
            if _is_stopped(proc.pid):
                proc.kill()
            else:
                proc.terminate()
    deadline = time.monotonic() + _KILL_GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _is_stopped(pid: int | None) -> bool:
    """Whether process ``pid`` is stopped (state T or t in /proc; False where unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _collect(results: Any, procs: Sequence[Any], timeout_s: float | None,
             sigterm: "_SigtermForwarder") -> dict[int, Any]:
    """Poll the queue and the workers until every rank reported, one failed or stopped,
    or time ran out."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    done: dict[int, Any] = {}
    while len(done) < len(procs):
        messages = _drain(results, _POLL_S)
        if not messages and _silent_deaths(procs, set(done)):
            messages = _drain(results, _DRAIN_GRACE_S)  # its last words may still be in the pipe
        errors: dict[int, str] = {}
        for rank, kind, body in messages:
            if kind == "ok":
                done[rank] = pickle.loads(body)
            elif kind == "stop":  # every rank stops at the same step: let them all finish
                _wait_for_exit(procs)
                raise pickle.loads(body)
            else:
                errors[rank] = body
        if errors or _silent_deaths(procs, set(done)):
            raise _failure(procs, errors, done, results, sigterm)
        if deadline is not None and time.monotonic() > deadline and len(done) < len(procs):
            raise _timeout(timeout_s, done, len(procs))
    return done


def _timeout(timeout_s: float | None, done: dict[int, Any], nproc: int) -> WorkerTimeout:
    pending = [r for r in range(nproc) if r not in done]
    return WorkerTimeout(
        f"timed out after {timeout_s:g} s: ranks {pending} had not finished "
        f"(ranks {sorted(done)} had); all workers were terminated",
        ranks=pending,
    )


class _SigtermForwarder:
    """While the workers run, SIGTERM to the launcher is passed on to each of them (they
    save at the next step boundary and stop); ``received`` remembers that it came."""

    def __init__(self, procs: Sequence[Any]):
        self.procs = procs
        self.received = False
        self._previous = None

    def __enter__(self) -> "_SigtermForwarder":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._forward)
        return self

    def _forward(self, signum, frame) -> None:
        self.received = True
        for proc in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _wait_for_exit(procs: Sequence[Any]) -> None:
    """Give workers that already reported a moment to finish tearing down cleanly."""
    deadline = time.monotonic() + _EXIT_GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))


def run_workers(
    fn: Callable[..., Any],
    nproc: int,
    args: tuple = (),
    *,
    backend: str = "gloo",
    timeout_s: float | None = None,
    collective_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` fresh processes; return results by rank.

    Workers are forked by the warm server (warm.py: a process that imported torch and
    the package once; forking this process itself is unsafe once torch has started
    threads), or spawned where it is not available, so ``fn`` must be a module-level
    function of an importable module (not a lambda or closure, and when defined in a
    script, the script must guard its entry point with ``if __name__ == "__main__":``),
    and ``args`` and the return values must be picklable. Each worker sees this
    process's environment now, the torchrun variables (MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) and ``env``, writes to this process's
    standard output and error, and has an initialized default process group.

    Raises ``WorkerError`` (naming the rank, with its full traceback or exit
    code) as soon as any worker fails, ``WorkerTimeout`` (naming the
    unfinished ranks) when ``timeout_s`` passes, and the workers' own
    :class:`RunStopped` when they stop on purpose (or :class:`Hang` /
    :class:`Preempted`, see :func:`_failure`); in every case, all workers are
    terminated first. ``collective_timeout_s`` bounds each collective inside
    the workers, so a mismatched collective fails instead of hanging.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise LaunchError(f"nproc={nproc!r} must be an integer >= 1")
    ctx, parent_pid = warm.context()
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    specs = [
        WorkerSpec(fn, tuple(args), rank, nproc, store.port, backend, collective_timeout_s, dict(env or {}))
        for rank in range(nproc)
    ]
    results = ctx.Queue()
    procs: list[Any] = []
    try:
        with _SigtermForwarder(procs) as sigterm:
            _start_workers(ctx, parent_pid, specs, results, procs)
            done = _collect(results, procs, timeout_s, sigterm)
            _wait_for_exit(procs)
    finally:
        _terminate(procs)
        results.close()
        results.cancel_join_thread()
        del store
    return [done[rank] for rank in range(nproc)]


def resolve_device_type(requested: str | None) -> str:
    """``--device``, or by default cuda when a GPU is visible, else cpu.

    Every place that needs the run's device type asks here (the launcher's backend, the
    workers' device, the pre-spawn checks), so a default of cuda is treated exactly as
    ``--device cuda``.
    """
    if requested is not None:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device_type: str, requested: str | None = None) -> str:
    """The collective backend: ``--backend`` where given, else NCCL for GPUs and gloo for
    CPUs."""
    if requested is not None:
        return requested
    return "nccl" if device_type == "cuda" else "gloo"


def init_from_env(
    backend: str | None = None, collective_timeout_s: float = 600.0
) -> tuple[int, int, int]:
    """Join a job launched by torchrun (or any launcher that sets RANK/WORLD_SIZE).

    Picks nccl when CUDA is available and gloo otherwise unless ``backend`` is
    given. Under NCCL it binds this process to its GPU (:func:`cuda_device_from_env`,
    LOCAL_RANK among LOCAL_WORLD_SIZE) before creating the group and passes it as
    ``device_id``. Returns (rank, world_size, local_rank).
    """
    required = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [name for name in required if name not in os.environ]
    if missing:
        raise LaunchError(
            f"environment variables {missing} are not set; launch with torchrun "
            "or use --nproc to spawn local workers"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, _ = local_placement()
    if backend is None:
        backend = backend_for(resolve_device_type(None))
    device_id = process_group_device(backend)  # NCCL needs the device set first
    if not dist.is_initialized():
        timeout = timedelta(seconds=collective_timeout_s)
        extra = {"device_id": device_id} if device_id is not None else {}
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                store=job_store(timeout), **extra)
    return rank, world_size, local_rank


def job_store(timeout: timedelta = timedelta(seconds=300)) -> dist.Store | None:
    """Under torchrun, the agent's store seen through a prefix of this restart attempt
    (None elsewhere: torch's env:// rendezvous then does as usual).

    torchrun keeps one store for the whole job and hands it to every attempt. The keys in
    which a group's ranks publish their addresses do not change from one attempt to the
    next, so after ``--max-restarts`` restarts a worker a new worker can read the address
    of a peer that died with the last attempt and fail to connect ("Connection refused"
    in gloo's connectFullMesh; NCCL's bootstrap likewise). A prefix per attempt
    (TORCHELASTIC_RESTART_COUNT) gives every attempt fresh keys.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"gridtrain/attempt_{attempt}", store)
