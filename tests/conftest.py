"""Fixtures shared by the test modules, and the test tiers.

Tests that start processes (worker processes, ``gridtrain`` or ``torchrun`` in a
subprocess) carry ``@pytest.mark.spawn``; in-process tests that take seconds (whole
training runs, dry runs of 1,024-rank layouts) carry ``@pytest.mark.slow``. The rest is
the fast tier: ``make test-fast`` (``pytest -m "not spawn and not slow"``) runs it in
under a minute on 2 cores (about 50 s); ``make test`` runs everything (about 20
minutes). The spawn marking is enforced: a test without the mark that starts a process
fails, naming it.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest
import torch.distributed as dist

from gridtrain.runtime import launch, warm


def pytest_configure(config):
    # Every multi-process test forks its workers from one warm server per session
    # (gridtrain/runtime/warm.py); what the tests' workers import besides the package
    # is imported there once, checkpoints' DCP included, and the built-in corpus read.
    warm.preload("pytest", "tests.harness", "tests.training", "gridtrain.checkpoint.dcp_io",
                 "gridtrain.data.corpora:builtin_bytes")
    config.addinivalue_line("markers", "spawn: starts processes (workers or subprocesses); "
                                       "make test-fast leaves it out")
    config.addinivalue_line("markers", "slow: starts no process but takes seconds; make test-fast leaves it out")


@pytest.fixture(autouse=True)
def _processes_only_in_spawn_tests(request, monkeypatch):
    """A test that starts a process must say so with ``@pytest.mark.spawn``."""
    if request.node.get_closest_marker("spawn") is not None:
        return
    test = request.node.nodeid

    def refuse(*args, **kwargs):
        raise AssertionError(f"{test} starts a process: mark it @pytest.mark.spawn (the slow tier)")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture
def no_process_may_start(monkeypatch):
    """Fail the test if anything tries to start a process group or spawn workers: the
    bad inputs of tests/test_cli.py and tests/test_validation.py are refused before."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a process group or worker was started for a bad configuration")

    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(launch, "run_workers", forbidden)
