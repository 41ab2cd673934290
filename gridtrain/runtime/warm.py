"""Workers that start warm: a server process that has imported torch and the package
once, and forks every worker of a run from that state.

Why. A freshly spawned Python process spends about 3 s of CPU importing torch and
gridtrain before its first instruction of training; eight of them on a small machine
are ten seconds of start-up, paid again by every run and by every multi-process test.
multiprocessing's *forkserver* start method removes that cost: one server process is
started (with ``exec``, so it holds no thread and no state of the launcher), imports
the modules named in its preload list, and from then on forks a child per worker
request. A fork copies the imported interpreter in milliseconds.

What the server cannot know travels with each request, because the server's state is
that of the moment it started, not of the run:

* the environment (the launcher's ``os.environ`` now, with the run's torchrun
  variables added by worker.py) and standard output and error (the launcher's current
  descriptors, passed as file descriptors: a test's output capture, a redirection);
* the working directory and ``sys.path`` (multiprocessing sends them itself);
* the parent-death link: a worker asks Linux to kill it when *its* parent dies, and its
  parent is the server, so the server in turn is tied to the launcher
  (:func:`_become_server`, from its first import); a ``kill -9`` of the launcher takes
  the server and then every worker with it. The server ignores SIGTERM, which a
  scheduler may send to every process of the job: the launcher and the workers answer
  it (they save at the next step boundary); a server that died of it would kill the
  workers before they could.

The server must never initialise CUDA (a driver initialised before a fork is unusable in
the child): nothing it preloads asks for a GPU (tests/test_imports.py checks), and each
worker binds its GPU after the fork (worker.py).

``GRIDTRAIN_START_METHOD=spawn`` starts cold workers, as before, e.g. to rule the server
out when chasing a start-up problem; platforms without forkserver use spawn. torchrun
launches are unaffected: torchrun starts its own workers.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading

from gridtrain.config import ConfigError

START_METHOD_ENV = "GRIDTRAIN_START_METHOD"
_SERVER_ENV = "GRIDTRAIN_WARM_SERVER_OF"  # set only in the server's environment: the launcher's pid
_CALLS_ENV = "GRIDTRAIN_WARM_SERVER_CALLS"  # and the "module:function" entries it calls

# What every training worker imports before its first step: the train command's worker
# (the loop, the providers, the models, the parallel layers), and torch._dynamo, which
# torch imports when the first optimizer is built (torch.optim.Optimizer.__init__ goes
# through torch._disable_dynamo): a second or more of CPU per worker otherwise, although
# nothing is compiled. The launcher may add more (preload).
PRELOAD = ["gridtrain.cli.commands", "torch._dynamo"]
_extra: list[str] = []
_lock = threading.Lock()


def preload(*entries: str) -> None:
    """Add modules for the server to import before its first fork (e.g. a test suite's
    helpers), or ``"module:function"`` entries for it to call: state that every worker
    would otherwise build alike, such as the built-in corpus's tokens
    (``gridtrain.data.corpora:builtin_bytes``, a cached function). Takes effect for a
    server started after the call."""
    with _lock:
        _extra.extend(e for e in entries if e not in _extra)


def start_method() -> str:
    """forkserver where the platform has it (Linux, macOS), else spawn; the environment's
    ``GRIDTRAIN_START_METHOD`` (forkserver | spawn) decides where set (another value is a
    ConfigError: one line and exit status 2 from the command line, before any process)."""
    methods = mp.get_all_start_methods()
    requested = os.environ.get(START_METHOD_ENV, "").strip()
    if requested:
        if requested not in ("forkserver", "spawn") or requested not in methods:
            raise ConfigError(f"{START_METHOD_ENV}={requested!r} is not available here; "
                             f"use one of {[m for m in ('forkserver', 'spawn') if m in methods]}")
        return requested
    return "forkserver" if "forkserver" in methods else "spawn"


def context() -> tuple[mp.context.BaseContext, int]:
    """The multiprocessing context to start workers with, and the pid that will be each
    worker's parent (the warm server, or this process under spawn)."""
    method = start_method()
    ctx = mp.get_context(method)
    if method == "spawn":
        return ctx, os.getpid()
    return ctx, ensure_server(ctx)


def ensure_server(ctx: mp.context.BaseContext) -> int:
    """Start the warm server unless it runs; its pid.

    The server is multiprocessing's forkserver, one per launcher process, reused by every
    later run of that process (a test session pays for its imports once). The marker in
    the environment exists only while the server is being started, so that this module,
    imported first by the server, ties it to this process; nothing else sees it."""
    from multiprocessing import forkserver

    with _lock:
        modules = [e for e in _extra if ":" not in e]
        ctx.set_forkserver_preload(["__main__", __name__, *PRELOAD, *modules])
        os.environ[_SERVER_ENV] = str(os.getpid())
        os.environ[_CALLS_ENV] = ",".join(e for e in _extra if ":" in e)
        try:
            forkserver.ensure_running()  # a no-op while the server lives
        finally:
            os.environ.pop(_SERVER_ENV, None)
            os.environ.pop(_CALLS_ENV, None)
        return forkserver._forkserver._forkserver_pid


def _become_server(launcher_pid: int, calls: list[str]) -> None:
    """In the server, before it imports anything heavy: die with the launcher, and leave
    SIGTERM to the launcher and the workers (module docstring); then make the calls asked
    for. A call that fails costs the workers only the work it would have saved them."""
    import importlib

    from gridtrain.runtime.worker import die_with_parent

    die_with_parent(launcher_pid)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for call in calls:
        module, _, function = call.partition(":")
        try:
            getattr(importlib.import_module(module), function)()
        except Exception:  # noqa: BLE001 -- the worker will meet (and report) the same error itself
            pass


if os.environ.get(_SERVER_ENV):  # this process is the warm server, importing its preload list
    _become_server(int(os.environ.pop(_SERVER_ENV)), [c for c in os.environ.pop(_CALLS_ENV, "").split(",") if c])
