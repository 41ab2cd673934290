"""Local processes seen through Linux's /proc: children, liveness, and the worker
processes of a launcher, for the tools that signal one rank (the self-check's frozen
rank, the fault tests).

``gridtrain train --nproc N`` workers are the children of the launcher's warm server
(warm.py), or the launcher's own under ``GRIDTRAIN_START_METHOD=spawn``; torchrun's are
the agent's children. Either way they start in rank order.
"""

from __future__ import annotations

import os


def _proc(pid: int) -> tuple[int, str, int, bytes] | None:
    """(parent pid, state letter, start time, command line) of a process, from Linux's
    /proc; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat, open(f"/proc/{pid}/cmdline", "rb") as cmd:
            text, cmdline = stat.read(), cmd.read().replace(b"\0", b" ")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return int(fields[1]), fields[0], int(fields[19]), cmdline


def children(pid: int) -> list[int]:
    """The live (not zombie) child processes of ``pid``, in the order they started."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _proc(int(entry))) and info[0] == pid and info[1] != "Z":
            found.append((info[2], int(entry)))
    return [child for _, child in sorted(found)]


def is_server(pid: int) -> bool:
    info = _proc(pid)
    return info is not None and b"multiprocessing.forkserver" in info[3]


def local_workers(launcher_pid: int) -> list[int]:
    """The worker processes of a launcher on this machine, in the order they started,
    which is rank order: the children of its warm server (or its own children, under
    spawn or for a torchrun agent), not multiprocessing's resource tracker."""
    workers = []
    for child in children(launcher_pid):
        if is_server(child):
            workers += children(child)
        elif (info := _proc(child)) and b"resource_tracker" not in info[3]:
            workers.append(child)
    return workers


def alive(pid: int) -> bool:
    info = _proc(pid)
    return info is not None and info[1] != "Z"
