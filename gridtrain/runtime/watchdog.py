"""Hang detection: a flight recorder of communication operations, a watchdog per rank,
and the hang report that names the rank(s) that never arrived.

Why this exists. A collective or a pipeline receive waits for its peers. When one rank
stops (a stopped or swapped-out process, a dead host, a rank stuck in a loop), its peers
wait, and without help the job waits with them, silently, until the backend's own
timeout (if any) turns it into a traceback that says *that* something timed out but not
*who* did not come. Large runs need the opposite: a short, greppable verdict within the
timeout, naming the missing rank, with what every rank that can still speak was doing.

The pieces, each small:

* :class:`FlightRecorder` -- one per process (:func:`process_recorder`), fed by the comm
  layer (comm.py's :class:`~gridtrain.parallel.comm.CommGroup`, the data-parallel reducer's
  asynchronous buckets, the pipeline's point-to-point messages). It keeps the last
  ``RING_SIZE`` operations in a ring buffer (a ``deque``) with kind, group, peer,
  bytes, the training step, the schedule action, a per-group sequence number, and the
  times it was issued, began to be waited for, and completed. Operations not yet
  complete are also kept in a small dict, so that a long-running one is never pushed
  out of the ring. Recording is a few ``perf_counter`` calls, an object and a deque
  append: no host-device synchronisation, no lock (the GIL orders the appends).
* :class:`Watchdog` -- a daemon thread per rank. It looks at the recorder once per
  ``poll_s`` and fires when an operation has been *waited for* longer than the timeout.
  The clock starts when the rank begins to wait, not at issue: an asynchronous
  all-reduce is legitimately in flight for the whole backward pass. On CUDA the host
  does not wait at all (NCCL work is enqueued on streams), so there the recorder puts
  CUDA events before and after the wait and the watchdog thread polls them
  (``Event.query`` never blocks): "waiting" then means the stream has reached the
  operation and it has not finished. Nothing in the watchdog is gloo-specific.
* The report. On firing, the rank publishes its recorder as JSON in the job's
  rendezvous store (its own ``TCPStore`` client: independent of the blocked main thread
  and of the process groups) and sets a trigger key. Every rank's watchdog has a
  listener thread that polls that key (``LISTEN_POLL_S``; a poll, not a blocking wait,
  whose timeouts the store client would log), so every rank that can still speak
  publishes its own recorder at once, even one that was not waiting. The first rank to fire waits a
  short grace (``GRACE_S``) for them, prints the combined report to stderr and sets a
  done key; every reporting rank then exits with :data:`HANG_EXIT_CODE` (``os._exit``:
  the main thread is blocked in C++ and cannot be unwound).
* Who never arrived is computed from the reports alone (:func:`analyse`), by matching
  sequence numbers, as NCCL's flight-recorder analysis does: every rank numbers the
  collectives it issues on each of its groups (``#57`` is its 57th collective on
  ``dp``), and its sends and receives per peer. A rank waiting in collective ``#n`` of
  a group is waiting for every member that has not issued ``#n`` on it: members that
  published nothing (stopped, dead, unreachable) and members that published a report
  showing fewer operations on that group (stuck elsewhere; the report shows where).
  A receive ``#n`` from a peer waits for that peer's send ``#n`` to this rank.

The backends' own timeouts stay as a backstop, set *longer* than the watchdog's
(:func:`backstop_timeout_s`): the process groups get ``--timeout`` plus a margin, so
that the watchdog always speaks first and a backend error ("Timed out waiting ...")
only appears if the watchdog itself could not run. The margin must cover the time an
asynchronous operation is in flight before the rank waits for it (the backend's clock
starts at issue; the watchdog's at the wait) plus the report's grace.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable

import torch

from gridtrain.runtime.stops import EXIT_HANG as HANG_EXIT_CODE  # 4: one table of exit codes

__all__ = ["HANG_EXIT_CODE", "FlightRecorder", "OpRecord", "Watchdog", "analyse", "backstop_timeout_s",
           "format_report", "process_recorder"]

RING_SIZE = 64  # operations kept per process
GRACE_S = 3.0  # how long the first rank to fire waits for the others' reports
LISTEN_POLL_S = 0.25  # how often each rank looks for another rank's trigger (well inside GRACE_S)
REPORT_OPS = 8  # operations shown per rank in the printed report
MAX_RANKS_SHOWN = 16  # beyond this, ranks not involved in the hang are summarised
_STORE_PREFIX = "gridtrain/hang"


def backstop_timeout_s(timeout_s: float) -> float:
    """The process groups' timeout: ``--timeout`` plus ``max(30 s, --timeout)``.

    The watchdog fires ``timeout_s`` after a rank began to wait; the backend's clock
    starts when the operation is issued, which for an asynchronous gradient all-reduce
    is up to a whole backward pass earlier. The margin covers that and the report's
    grace, so the backend's own timeout error only ever appears when the watchdog could
    not run.
    """
    return timeout_s + max(30.0, timeout_s)


# ---- the flight recorder ------------------------------------------------------------------

class OpRecord:
    """One communication operation. Times are ``time.perf_counter()`` values (None: not
    yet); ``ready`` and ``finished`` are CUDA events the watchdog resolves into
    ``wait_began`` and ``done`` on GPUs."""

    __slots__ = ("seq", "kind", "group", "ranks", "peer", "nbytes", "step", "action",
                 "issued", "wait_began", "done", "ready", "finished")

    def __init__(self, seq: int, kind: str, group: str, ranks: tuple[int, ...], peer: int | None,
                 nbytes: int, step: int | None, action: str | None, issued: float):
        self.seq, self.kind, self.group, self.ranks, self.peer = seq, kind, group, ranks, peer
        self.nbytes, self.step, self.action = nbytes, step, action
        self.issued = issued
        self.wait_began: float | None = None
        self.done: float | None = None
        self.ready = self.finished = None

    def as_dict(self, now: float) -> dict[str, Any]:
        """JSON-able, with times as seconds before ``now`` (clocks differ between hosts)."""
        def ago(t):
            return None if t is None else round(now - t, 4)
        return {"seq": self.seq, "kind": self.kind, "group": self.group, "ranks": list(self.ranks),
                "peer": self.peer, "bytes": self.nbytes, "step": self.step, "action": self.action,
                "issued_ago": ago(self.issued), "wait_ago": ago(self.wait_began), "done_ago": ago(self.done)}


def _seq_key(kind: str, group: str, peer: int | None) -> str:
    """Collectives are numbered per group, point-to-point messages per group, direction
    and peer (a receive #n from P matches P's send #n to this rank)."""
    if kind == "send":
        return f"send:{group}:{peer}"
    if kind == "recv":
        return f"recv:{group}:{peer}"
    return group


class FlightRecorder:
    """The last ``RING_SIZE`` communication operations of this process (module docstring).

    The comm layer calls :meth:`issue` when it starts an operation, :meth:`wait` just
    before it blocks on it (for a blocking collective: right after issue) and
    :meth:`done` when it returns. The loop sets :meth:`set_step`; the pipeline runtime
    sets :meth:`set_action`.
    """

    def __init__(self, size: int = RING_SIZE):
        self.ops: deque[OpRecord] = deque(maxlen=size)
        self.pending: dict[int, OpRecord] = {}  # id -> issued, not done (never evicted)
        self.seqs: dict[str, int] = {}
        self.step: int | None = None
        self.action: str | None = None
        self.rank = 0

    def set_step(self, step: int | None) -> None:
        """The optimizer step now running (as the metrics file counts, from 1)."""
        self.step = step
        self.action = None

    def set_action(self, action: str | None) -> None:
        """What the rank is doing, e.g. the pipeline action ``F(mb 3, chunk 0)``."""
        self.action = action

    def issue(self, kind: str, group: str, ranks: tuple[int, ...], nbytes: int,
              peer: int | None = None) -> OpRecord:
        key = _seq_key(kind, group, peer)
        seq = self.seqs.get(key, 0) + 1
        self.seqs[key] = seq
        rec = OpRecord(seq, kind, group, ranks, peer, nbytes, self.step, self.action, time.perf_counter())
        self.ops.append(rec)
        self.pending[id(rec)] = rec
        return rec

    def wait(self, rec: OpRecord, tensor: torch.Tensor | None = None) -> None:
        """The rank begins to wait for ``rec``. On CUDA the host does not: an event on the
        current stream marks the moment the stream reaches the wait."""
        if tensor is not None and tensor.is_cuda:
            rec.ready = torch.cuda.Event()
            rec.ready.record()
        else:
            rec.wait_began = time.perf_counter()

    def done(self, rec: OpRecord, tensor: torch.Tensor | None = None) -> None:
        """``rec``'s wait returned (on CUDA: an event completes when the stream is past it)."""
        if tensor is not None and tensor.is_cuda:
            rec.finished = torch.cuda.Event()
            rec.finished.record()
        else:
            rec.done = time.perf_counter()
            self.pending.pop(id(rec), None)

    def blocking(self, kind: str, group: str, ranks: tuple[int, ...], tensor: torch.Tensor | None,
                 nbytes: int, peer: int | None = None) -> OpRecord:
        """Issue a blocking operation: it is waited for from the start."""
        rec = self.issue(kind, group, ranks, nbytes, peer)
        self.wait(rec, tensor)
        return rec

    # ---- read by the watchdog thread ------------------------------------------------------

    def resolve_events(self, now: float) -> None:
        """Turn completed CUDA events into times (watchdog thread; ``query`` never blocks)."""
        for rec in list(self.pending.values()):
            if rec.ready is not None and rec.wait_began is None and rec.ready.query():
                rec.wait_began = now
            if rec.finished is not None and rec.finished.query():
                rec.wait_began = rec.wait_began if rec.wait_began is not None else now
                rec.done = now
                self.pending.pop(id(rec), None)

    def waiting(self) -> list[OpRecord]:
        """Operations this rank is waiting for now, longest wait first."""
        waits = [r for r in list(self.pending.values()) if r.wait_began is not None and r.done is None]
        return sorted(waits, key=lambda r: r.wait_began)

    def snapshot(self, rank: int, timeout_s: float, now: float | None = None) -> dict[str, Any]:
        """This rank's report, JSON-able."""
        now = time.perf_counter() if now is None else now
        recent = list(self.ops)
        inflight = [r for r in list(self.pending.values()) if r not in recent]
        return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "timeout_s": timeout_s,
                "step": self.step, "action": self.action, "seqs": dict(self.seqs),
                "waiting": [r.as_dict(now) for r in self.waiting()],
                "ops": [r.as_dict(now) for r in inflight + recent]}


_PROCESS_RECORDER = FlightRecorder()


def process_recorder() -> FlightRecorder:
    """This process's recorder: every CommGroup records into it unless given another."""
    return _PROCESS_RECORDER


# ---- analysis and formatting: pure functions of the published reports ---------------------

@dataclass
class Missing:
    """``waiter`` waits in ``op`` for ``rank``; ``report`` is that rank's (None: it sent none)."""

    rank: int
    waiter: int
    op: dict[str, Any]
    report: dict[str, Any] | None


def _arrived(member: dict[str, Any], op: dict[str, Any], waiter: int) -> bool:
    """Has ``member`` issued its side of the waiter's operation ``op``?"""
    if op["kind"] == "recv":
        return member["seqs"].get(f"send:{op['group']}:{waiter}", 0) >= op["seq"]
    if op["kind"] == "send":
        return member["seqs"].get(f"recv:{op['group']}:{waiter}", 0) >= op["seq"]
    return member["seqs"].get(op["group"], 0) >= op["seq"]


def analyse(reports: dict[int, dict[str, Any]]) -> list[Missing]:
    """Every (waiting rank, operation, member that has not arrived), silent members first."""
    found = []
    for waiter in sorted(reports):
        for op in reports[waiter]["waiting"]:
            members = [op["peer"]] if op["peer"] is not None else [r for r in op["ranks"] if r != waiter]
            for m in members:
                if m not in reports:
                    found.append(Missing(m, waiter, op, None))
                elif not _arrived(reports[m], op, waiter):
                    found.append(Missing(m, waiter, op, reports[m]))
    found.sort(key=lambda x: (x.report is not None, x.rank, x.waiter))
    return found


def describe_op(op: dict[str, Any]) -> str:
    """``all_reduce #57 of group dp [0, 1]``, ``recv #12 from rank 0 on group pp [0, 2]``."""
    ranks = f"{op['group']} {op['ranks']}"
    if op["kind"] == "recv":
        return f"recv #{op['seq']} from rank {op['peer']} on group {ranks}"
    if op["kind"] == "send":
        return f"send #{op['seq']} to rank {op['peer']} on group {ranks}"
    return f"{op['kind']} #{op['seq']} of group {ranks}"


def describe_side(op: dict[str, Any], waiter: int) -> str:
    """The missing rank's side of the waiter's ``op``: a receive waits for a send."""
    ranks = f"{op['group']} {op['ranks']}"
    if op["kind"] == "recv":
        return f"send #{op['seq']} to rank {waiter} on group {ranks}"
    if op["kind"] == "send":
        return f"recv #{op['seq']} from rank {waiter} on group {ranks}"
    return describe_op(op)


def _where(op: dict[str, Any]) -> str:
    parts = [f"step {op['step']}" if op.get("step") is not None else None, op.get("action")]
    return ", ".join(p for p in parts if p) or "outside the schedule"


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(set(ranks))
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def headline(reports: dict[int, dict[str, Any]], timeout_s: float, first: int | None = None) -> str:
    """The report's first line, greppable: ``gridtrain: hang: rank 1 never arrived at ...``."""
    missing = analyse(reports)
    if not missing:
        waits = [(r, op) for r, rep in sorted(reports.items()) for op in rep["waiting"]]
        if not waits:
            return f"gridtrain: hang: a wait longer than {timeout_s:g} s (--timeout {timeout_s:g}); no rank reported what it waited for"
        r, op = waits[0]
        return (f"gridtrain: hang: rank {r} waited {op['wait_ago']:.1f} s in {describe_op(op)} ({_where(op)}) "
                f"though every member issued it (--timeout {timeout_s:g})")
    # silent ranks first (analyse sorts them so), the first firing rank's own wait first
    silent = [m for m in missing if m.report is None] or missing
    lead = next((m for m in silent if m.waiter == first), silent[0])
    same = {m.rank for m in silent if m.waiter == lead.waiter and m.op is lead.op}
    return (f"gridtrain: hang: {_ranks(same)} never arrived at {describe_side(lead.op, lead.waiter)} "
            f"({_where(lead.op)}); rank {lead.waiter} waited {lead.op['wait_ago']:.1f} s "
            f"(--timeout {timeout_s:g})")


def format_op(op: dict[str, Any]) -> str:
    if op["done_ago"] is not None:
        state = f"done {op['done_ago']:.2f} s ago"
    elif op["wait_ago"] is not None:
        state = f"WAITING {op['wait_ago']:.1f} s"
    else:
        state = "in flight (not yet waited for)"
    peer = f" peer {op['peer']}" if op["peer"] is not None else ""
    return (f"{op['kind']:>14} #{op['seq']:<5} {op['group']} {op['ranks']}{peer}  {_bytes(op['bytes'])}  "
            f"[{_where(op)}]  issued {op['issued_ago']:.2f} s ago, {state}")


def format_report(reports: dict[int, dict[str, Any]], world_size: int, timeout_s: float,
                  first: int | None = None, ops_per_rank: int = REPORT_OPS) -> str:
    """The whole report: the headline, who waits for whom, then each rank's last operations."""
    missing = analyse(reports)
    lines = [headline(reports, timeout_s, first)]
    silent = sorted({m.rank for m in missing if m.report is None})
    if silent:
        lines.append(f"  never arrived: {_ranks(silent)} (published no report: stopped, dead, or unreachable)")
    for m in missing:
        if m.report is not None:
            now = m.report["waiting"][0] if m.report["waiting"] else None
            at = f"waiting in {describe_op(now)} ({_where(now)})" if now else \
                f"not communicating ({_where(m.report) if m.report['action'] else 'outside the schedule'})"
            lines.append(f"  rank {m.rank} has not reached {describe_side(m.op, m.waiter)}: it is {at}")
    for m in missing:
        lines.append(f"  rank {m.waiter} waits for rank {m.rank} in {describe_op(m.op)} ({_where(m.op)}), "
                     f"{m.op['wait_ago']:.1f} s")
    involved = {m.rank for m in missing} | {m.waiter for m in missing} | ({first} if first is not None else set())
    shown = sorted(range(world_size)) if world_size <= MAX_RANKS_SHOWN else sorted(involved)
    lines.append("last communication operations per rank (newest last; times before the report):")
    for r in shown:
        rep = reports.get(r)
        if rep is None:
            lines.append(f"  rank {r}: no report{' (never arrived)' if r in silent else ''}")
            continue
        at = ", ".join(p for p in (f"step {rep['step']}" if rep["step"] is not None else None,
                                   rep["action"] or "outside the schedule") if p)
        lines.append(f"  rank {r} (host {rep['host']}, pid {rep['pid']}), now at {at}:")
        ops = rep["ops"][-ops_per_rank:]
        lines.extend(f"    {format_op(op)}" for op in ops)
        if not ops:
            lines.append("    (no communication recorded)")
    hidden = world_size - len(shown)
    if hidden:
        quiet = sum(1 for r in reports if r not in shown)
        lines.append(f"  ({hidden} more ranks not shown: {quiet} of them reported and are not involved, "
                     f"{hidden - quiet} sent no report)")
    lines.append(f"(exit code {HANG_EXIT_CODE}; see docs/hangs.md)")
    return "\n".join(lines)


# ---- the watchdog -------------------------------------------------------------------------

def _store_prefix() -> str:
    """Keys of this attempt: torchrun keeps its store across restarts."""
    return f"{_STORE_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


class Watchdog:
    """The per-rank watchdog thread and its store listener (module docstring)."""

    def __init__(self, recorder: FlightRecorder, rank: int, world_size: int, timeout_s: float,
                 device: torch.device | None = None, poll_s: float | None = None,
                 grace_s: float = GRACE_S, exit_fn=os._exit):
        self.recorder, self.rank, self.world = recorder, rank, world_size
        self.timeout_s, self.device, self.grace_s = timeout_s, device, grace_s
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.05, timeout_s / 20))
        self.exit_fn = exit_fn
        self._stop = threading.Event()
        self._fired = threading.Lock()
        self.store = self._listen_store = None
        self.prefix = _store_prefix()

    def start(self) -> "Watchdog":
        self.store = self._connect()
        self._listen_store = self._connect()
        threading.Thread(target=self._watch, name="gridtrain-watchdog", daemon=True).start()
        if self._listen_store is not None:
            threading.Thread(target=self._listen, name="gridtrain-hang-listener", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop watching (at shutdown; a late trigger is then ignored)."""
        self._stop.set()

    def _connect(self):
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            return None
        try:
            return torch.distributed.TCPStore(addr, int(port), is_master=False, wait_for_workers=False,
                                              timeout=timedelta(seconds=30))
        except Exception as exc:  # noqa: BLE001 -- the watchdog still reports this rank alone
            print(f"gridtrain: watchdog on rank {self.rank}: no store at {addr}:{port} ({exc}); "
                  "a hang will be reported by this rank alone", file=sys.stderr, flush=True)
            return None

    def _bind_device(self) -> None:
        """On CUDA, query events on this rank's GPU (not a fresh context on GPU 0)."""
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _watch(self) -> None:
        self._bind_device()
        while not self._stop.wait(self.poll_s):
            now = time.perf_counter()
            self.recorder.resolve_events(now)
            waits = self.recorder.waiting()
            if waits and now - waits[0].wait_began > self.timeout_s:
                self._fire(detected=True)
                return

    def _listen(self) -> None:
        """Poll the trigger key; when another rank fires, publish and exit with it.

        A poll (``check``, which answers at once) rather than a blocking ``wait``: the
        store client logs a warning each time a wait times out ("waitForInput ... timed
        out"), which a healthy run would print every minute on every rank."""
        self._bind_device()
        key = f"{self.prefix}/trigger"
        while not self._stop.wait(LISTEN_POLL_S):
            try:
                fired = self._listen_store.check([key])
            except Exception:  # noqa: BLE001 -- the store is gone (the job is ending): done
                return
            if fired and not self._stop.is_set():
                self._fire(detected=False)
                return

    def _fire(self, detected: bool) -> None:
        """Publish this rank's report; the first detector prints them all; exit."""
        if not self._fired.acquire(blocking=False):
            return  # the other thread of this rank is already reporting
        try:
            self.recorder.resolve_events(time.perf_counter())
            mine = self.recorder.snapshot(self.rank, self.timeout_s)
            reports = {self.rank: mine}
            reporter = self.store is None
            if self.store is not None:
                try:
                    reporter = detected and self.store.add(f"{self.prefix}/detectors", 1) == 1
                    self.store.set(f"{self.prefix}/report/{self.rank}", json.dumps(mine))
                    self.store.add(f"{self.prefix}/reported", 1)
                    if reporter:
                        self.store.set(f"{self.prefix}/trigger", str(self.rank))
                        reports = self._gather(mine)
                    else:
                        self.store.wait([f"{self.prefix}/done"], timedelta(seconds=self.grace_s + 30))
                except Exception as exc:  # noqa: BLE001 -- the store went away: say what we know
                    reporter = True
                    print(f"gridtrain: watchdog on rank {self.rank}: store failed during the hang report ({exc})",
                          file=sys.stderr, flush=True)
            if reporter:
                text = format_report(reports, self.world, self.timeout_s, first=self.rank)
                sys.stderr.write(text + "\n")
                sys.stderr.flush()
                if self.store is not None:
                    try:
                        self.store.set(f"{self.prefix}/done", "1")
                    except Exception:  # noqa: BLE001
                        pass
        finally:
            self.exit_fn(HANG_EXIT_CODE)

    def _gather(self, mine: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """Wait up to the grace for every rank's report, then read those that came."""
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and self.store.add(f"{self.prefix}/reported", 0) < self.world:
            time.sleep(0.05)
        reports = {self.rank: mine}
        for r in range(self.world):
            key = f"{self.prefix}/report/{r}"
            if r != self.rank and self.store.check([key]):
                reports[r] = json.loads(self.store.get(key))
        return reports


_WATCHDOG: Watchdog | None = None


def start_watchdog(recorder: FlightRecorder, rank: int, world_size: int, timeout_s: float,
                   device: torch.device | None = None) -> Watchdog | None:
    """Start this process's watchdog (once; none for one rank: nothing to wait for)."""
    global _WATCHDOG
    if world_size <= 1 or _WATCHDOG is not None:
        return _WATCHDOG
    recorder.rank = rank
    _WATCHDOG = Watchdog(recorder, rank, world_size, timeout_s, device).start()
    return _WATCHDOG


def stop_watchdog() -> None:
    global _WATCHDOG
    if _WATCHDOG is not None:
        _WATCHDOG.stop()
        _WATCHDOG = None
