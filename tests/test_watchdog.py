"""Hang detection (watchdog.py): the flight recorder and the report as data, then real
jobs with a stopped rank.

The first half needs no process group: the recorder is a ring buffer with per-group
sequence numbers, and "who never arrived" is a pure function of the published reports.
The second half runs ``gridtrain train`` through the CLI, stops one worker with SIGSTOP
once training has started, and checks that the job ends within ``--timeout`` + 10 s with
the hang exit status and a report naming the stopped rank (issue 11).
"""

from __future__ import annotations

import sys
import time

import pytest

from gridtrain.runtime import watchdog
from gridtrain.selfcheck.hang import named_within, stop_a_rank_and_wait
from gridtrain.runtime.watchdog import (HANG_EXIT_CODE, FlightRecorder, Watchdog, analyse, backstop_timeout_s,
                                format_report, headline)

# ---- the recorder --------------------------------------------------------------------------


def test_ring_buffer_keeps_the_last_operations_and_numbers_them_per_group():
    rec = FlightRecorder(size=4)
    rec.set_step(3)
    rec.set_action("F(mb 0, chunk 0)")
    for _ in range(5):
        r = rec.blocking("all_reduce", "tp", (0, 1), None, 128)
        rec.done(r)
    send = rec.issue("send", "pp", (0, 2), 64, peer=2)
    assert [op.seq for op in rec.ops] == [3, 4, 5, 1]
    assert rec.seqs == {"tp": 5, "send:pp:2": 1}
    assert send.step == 3 and send.action == "F(mb 0, chunk 0)" and send.peer == 2
    assert rec.waiting() == []  # issued, not yet waited for: an async op in flight is no hang
    rec.wait(send)
    assert rec.waiting() == [send]
    rec.done(send)
    assert rec.waiting() == [] and not rec.pending
    rec.set_step(4)
    assert rec.action is None


def test_an_op_still_pending_is_reported_even_when_pushed_out_of_the_ring():
    rec = FlightRecorder(size=2)
    bucket = rec.issue("all_reduce", "dp", (0, 1), 1000)
    for _ in range(3):
        rec.done(rec.blocking("all_reduce", "tp", (0, 2), None, 8))
    rec.wait(bucket)
    snap = rec.snapshot(rank=0, timeout_s=10)
    assert [op["group"] for op in snap["ops"]] == ["dp", "tp", "tp"]
    assert snap["waiting"][0]["seq"] == 1 and snap["waiting"][0]["wait_ago"] >= 0


def test_backstop_is_longer_than_the_watchdog_and_its_grace():
    for t in (1, 10, 60, 300, 3600):
        assert backstop_timeout_s(t) >= t + 30 and backstop_timeout_s(t) >= 2 * t


# ---- analysis and report, from published reports ------------------------------------------


def _op(kind, group, ranks, seq, peer=None, wait_ago=None, done_ago=None, step=3, action="B(mb 1, chunk 0)"):
    return {"seq": seq, "kind": kind, "group": group, "ranks": ranks, "peer": peer, "bytes": 4096,
            "step": step, "action": action, "issued_ago": 12.0, "wait_ago": wait_ago, "done_ago": done_ago}


def _report(rank, seqs, waiting=(), ops=(), step=3, action="B(mb 1, chunk 0)"):
    return {"rank": rank, "host": "h", "pid": 100 + rank, "timeout_s": 10.0, "step": step, "action": action,
            "seqs": seqs, "waiting": list(waiting), "ops": list(ops) + list(waiting)}


def test_a_member_that_published_nothing_never_arrived():
    wait = _op("all_reduce", "dp", [0, 1], 57, wait_ago=10.2)
    reports = {0: _report(0, {"dp": 57}, [wait])}
    [m] = analyse(reports)
    assert (m.rank, m.waiter, m.report) == (1, 0, None)
    line = headline(reports, 10.0, first=0)
    assert line == ("gridtrain: hang: rank 1 never arrived at all_reduce #57 of group dp [0, 1] "
                    "(step 3, B(mb 1, chunk 0)); rank 0 waited 10.2 s (--timeout 10)")
    text = format_report(reports, 2, 10.0, first=0)
    assert "never arrived: rank 1 (published no report" in text
    assert "rank 1: no report (never arrived)" in text
    assert "WAITING 10.2 s" in text and f"exit code {HANG_EXIT_CODE}" in text


def test_members_that_issued_the_op_have_arrived_and_laggards_say_where_they_are():
    # pp 2 x tp 2, rank 1 stopped: rank 0 waits for it in TP; rank 2 waits for rank 0's
    # activation (rank 0 never sent it: it is stuck in TP), rank 3 for rank 1's.
    tp01 = _op("all_reduce", "tp", [0, 1], 9, wait_ago=10.1, action="F(mb 2, chunk 0)")
    recv20 = _op("recv", "pp", [0, 2], 3, peer=0, wait_ago=9.5, action="RECV_F(mb 2, chunk 0)")
    recv31 = _op("recv", "pp", [1, 3], 3, peer=1, wait_ago=9.4, action="RECV_F(mb 2, chunk 0)")
    reports = {0: _report(0, {"tp": 9, "send:pp:2": 2}, [tp01], action="F(mb 2, chunk 0)"),
               2: _report(2, {"tp": 20, "recv:pp:0": 3}, [recv20]),
               3: _report(3, {"tp": 20, "recv:pp:1": 3}, [recv31])}
    found = [(m.rank, m.waiter) for m in analyse(reports)]
    assert found == [(1, 0), (1, 3), (0, 2)]  # silent ranks first
    assert headline(reports, 10, first=0).startswith(
        "gridtrain: hang: rank 1 never arrived at all_reduce #9 of group tp [0, 1] (step 3, F(mb 2, chunk 0))")
    text = format_report(reports, 4, 10, first=0)
    assert ("rank 0 has not reached send #3 to rank 2 on group pp [0, 2]: it is waiting in "
            "all_reduce #9 of group tp [0, 1] (step 3, F(mb 2, chunk 0))") in text
    assert "rank 3 waits for rank 1 in recv #3 from rank 1 on group pp [1, 3]" in text
    # the rank that fired first sets the headline; a receive names the missing send
    assert headline(reports, 10, first=3).startswith(
        "gridtrain: hang: rank 1 never arrived at send #3 to rank 3 on group pp [1, 3] "
        "(step 3, RECV_F(mb 2, chunk 0)); rank 3 waited 9.4 s")
    # a send is matched by the peer's receive, a collective by the group's count
    reports[0]["seqs"]["send:pp:2"] = 3
    assert [(m.rank, m.waiter) for m in analyse(reports)] == [(1, 0), (1, 3)]


def test_every_member_arrived_is_said_so():
    wait = _op("broadcast", "tp", [0, 1], 4, wait_ago=11.0)
    reports = {0: _report(0, {"tp": 4}, [wait]), 1: _report(1, {"tp": 4})}
    assert analyse(reports) == []
    assert "though every member issued it" in headline(reports, 10)


def test_large_worlds_show_only_the_ranks_involved():
    wait = _op("all_reduce", "dp", list(range(0, 64, 2)), 5, wait_ago=10.0)
    reports = {r: _report(r, {"dp": 5}) for r in range(64) if r != 6}
    reports[0] = _report(0, {"dp": 5}, [wait])
    reports[4]["seqs"] = {"dp": 4}  # behind, but it reported
    text = format_report(reports, 64, 10, first=0)
    shown = [line for line in text.splitlines() if line.startswith("  rank ") and "(host" in line]
    assert [int(line.split()[1]) for line in shown] == [0, 4]
    assert "rank 6: no report (never arrived)" in text and "more ranks not shown" in text


def test_a_rank_without_a_store_reports_alone_and_exits_with_the_hang_code(capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    rec = FlightRecorder()
    rec.set_step(2)
    op = rec.issue("all_reduce", "dp", (0, 1), 8)
    rec.wait(op)
    codes = []
    dog = Watchdog(rec, rank=0, world_size=2, timeout_s=0.2, poll_s=0.02, exit_fn=codes.append).start()
    deadline = time.monotonic() + 5
    while not codes and time.monotonic() < deadline:
        time.sleep(0.02)
    dog.stop()
    assert codes == [HANG_EXIT_CODE]
    err = capsys.readouterr().err
    assert err.startswith("gridtrain: hang: rank 1 never arrived at all_reduce #1 of group dp [0, 1] (step 2)")


class _PollOnlyStore:
    """A store client that answers ``check`` and refuses ``wait``: a blocking wait that
    times out makes torch's store client log a warning (c10d "waitForInput ... timed
    out"), printed every minute on every rank of a healthy run."""

    def __init__(self):
        self.checks, self.triggered = 0, False

    def check(self, keys):
        self.checks += 1
        return self.triggered

    def wait(self, *args, **kwargs):
        raise AssertionError("the listener blocked in store.wait")


def test_the_listener_polls_the_trigger_and_never_blocks_in_a_store_wait(monkeypatch):
    store = _PollOnlyStore()
    monkeypatch.setattr(watchdog, "LISTEN_POLL_S", 0.01)
    dog = Watchdog(FlightRecorder(), rank=1, world_size=2, timeout_s=60)
    fired = []
    monkeypatch.setattr(dog, "_fire", lambda detected: fired.append(detected))
    monkeypatch.setattr(dog, "_connect", lambda: store)
    dog.start()
    deadline = time.monotonic() + 5
    while store.checks < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.checks >= 5 and fired == []  # polled quietly while nothing happened
    store.triggered = True  # another rank fired
    while not fired and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.stop()
    assert fired == [False]


def test_the_watchdog_waits_for_the_wait_not_the_issue(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    rec = FlightRecorder()
    rec.issue("all_reduce", "dp", (0, 1), 8)  # in flight during "backward", never waited for
    codes = []
    dog = Watchdog(rec, rank=0, world_size=2, timeout_s=0.1, poll_s=0.02, exit_fn=codes.append).start()
    time.sleep(0.4)
    dog.stop()
    assert codes == []


# ---- real jobs with a stopped rank ---------------------------------------------------------

TIMEOUT_S = 10


@pytest.mark.spawn
@pytest.mark.parametrize("stop_rank,nproc,layout", [
    (1, 4, ("--pp", "2", "--tp", "2")),
    (1, 2, ("--arch", "llama", "--n-experts", "4", "--ep", "2", "--moe-ffn-hidden", "32"))],
    ids=["pp2xtp2", "dp2-moe-ep2"])
def test_a_stopped_rank_is_named_within_the_timeout(tmp_path, stop_rank, nproc, layout):
    """A pipeline with tensor parallelism, and data parallelism with experts over ep 2,
    where most of a step's collectives are the experts' all-to-alls (recorded as such,
    with the ep group's ranks) beside the gradient all-reduce."""
    run = stop_a_rank_and_wait(tmp_path, stop_rank, nproc, TIMEOUT_S, *layout)
    print(run.err[-4000:], f"\nelapsed {run.elapsed_s:.1f} s", file=sys.stderr)
    assert named_within(run, stop_rank, TIMEOUT_S, HANG_EXIT_CODE) is None, run.err[-3000:]
