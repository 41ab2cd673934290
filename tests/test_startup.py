"""The start-up's clock and memory readings (gridtrain/runtime/startup.py) and its summary
line; a whole run's start-up record is checked by the runs that write a metrics file
(tests/test_train.py in one process, tests/test_cli.py on two workers and under torchrun)."""

from __future__ import annotations

import os
import time

import pytest

from gridtrain.runtime import startup
from gridtrain.runtime.startup import Startup, StartupClock, start_from_stat, vm_hwm_bytes
from gridtrain.training.report import startup_line

# /proc/PID/stat of a process whose name holds a space and a parenthesis; starttime
# (field 22) is 12345 ticks after boot.
STAT = ("4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 1234 0 0 0 12 3 0 0 20 0 1 0 12345 "
        "2000000 500 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n")

STATUS = "Name:\tpython\nVmPeak:\t  900000 kB\nVmSize:\t  800000 kB\nVmHWM:\t  312500 kB\nVmRSS:\t  300000 kB\n"


def test_start_from_stat_reads_field_22_after_the_name():
    # 12345 ticks at 100 per second: 123.45 s after boot; 1000 s since boot now
    assert start_from_stat(STAT, 100, boot_now=1000.0, now=50_000.0) == pytest.approx(50_000.0 - 876.55)


def test_vm_hwm_is_read_in_bytes():
    assert vm_hwm_bytes(STATUS) == 312500 * 1024
    assert vm_hwm_bytes("Name:\tpython\n") is None


def test_this_process_started_before_now_and_holds_memory():
    """From /proc on Linux (CI); where there is none, no start time (a run then counts
    from its own call) rather than a wrong one."""
    started = startup.process_start_time()
    if os.path.exists("/proc/self/stat"):
        assert started is not None and time.time() - 24 * 3600 < started <= time.time()
    else:
        assert started is None
    assert startup.host_peak_bytes() > 10 * 2**20  # the interpreter and pytest alone


def test_launch_time_from_the_environment(monkeypatch):
    monkeypatch.setenv(startup.LAUNCH_TIME_ENV, "1000.5")
    assert startup.launch_time(default=2.0) == 1000.5
    for bad in ("soon", "nan", repr(time.time() + 3600)):  # not a time, or one still to come
        monkeypatch.setenv(startup.LAUNCH_TIME_ENV, bad)
        assert startup.launch_time(default=2.0) == 2.0
    monkeypatch.delenv(startup.LAUNCH_TIME_ENV)
    assert startup.launch_time(default=2.0) == 2.0
    assert float(startup.launch_environment()[startup.LAUNCH_TIME_ENV]) <= time.time()


def test_phases_add_up_and_a_stamp_out_of_order_adds_nothing():
    clock = StartupClock(100.0, [("launch", 102.0), ("imports", 102.5)])
    clock.stamps += [("process_group", 102.25), ("model", 104.0)]
    assert clock.phases() == {"launch": 2.0, "imports": 0.5, "process_group": 0.0, "model": 1.5}
    clock.stamp("loop")
    clock.stamp("loop")  # once
    assert [name for name, _ in clock.stamps].count("loop") == 1


def test_the_first_run_in_a_process_counts_from_its_start_a_later_one_from_its_call(monkeypatch):
    monkeypatch.setattr(startup, "_runs", 0)
    monkeypatch.setattr(startup, "_early", [("imports", time.time() - 2), ("process_group", time.time() - 1)])
    monkeypatch.setenv(startup.LAUNCH_TIME_ENV, repr(time.time() - 5))
    monkeypatch.setattr(startup, "process_start_time", lambda: time.time() - 3)
    first = StartupClock.begin()
    assert [name for name, _ in first.stamps] == ["launch", "imports", "process_group"]
    assert sum(first.phases().values()) == pytest.approx(4.0, abs=0.1)
    later = StartupClock.begin()
    assert later.stamps == [] and time.time() - later.origin < 1
    calls = []
    timed = later.timed(lambda x: calls.append(x) or x, before="model", after="data")
    assert timed(3) == 3 and calls == [3]
    assert [name for name, _ in later.stamps] == ["model", "data"]


def test_startup_line_names_the_ranks_with_the_most_and_least_memory():
    s = Startup(time_s=4.25, phases={"launch": 3.0, "process_group": 1.25}, host_peak_bytes=[300e6, 500e6, 400e6],
                device_peak_bytes=[2e9, 1e9, 3e9])
    assert startup_line(s) == ("start-up: 4.25 s from the launch to the first step (launch 3.00, process group "
                               "1.25 s); peak host memory: max 500.00 MB (rank 1), min 300.00 MB (rank 0); "
                               "peak device memory: max 3.00 GB (rank 2), min 1.00 GB (rank 1)")
    one = Startup(time_s=1.0, phases={"imports": 1.0}, host_peak_bytes=[300e6], device_peak_bytes=None)
    assert startup_line(one).endswith("(imports 1.00 s); peak host memory 300.00 MB")
    assert one.as_json() == {"time_s": 1.0, "phases": {"imports": 1.0}, "host_peak_bytes": [300e6],
                             "device_peak_bytes": None}
