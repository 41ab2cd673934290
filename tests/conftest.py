"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from gridtrain.runtime import launch


@pytest.fixture
def no_process_may_start(monkeypatch):
    """Fail the test if anything tries to start a process group or spawn workers: the
    bad inputs of tests/test_cli.py and tests/test_validation.py are refused before."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a process group or worker was started for a bad configuration")

    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(launch, "run_workers", forbidden)
