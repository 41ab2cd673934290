"""Run a test function on several real processes (gloo on CPU) from inside pytest.

A thin layer over ``gridtrain.runtime.launch.run_workers``: the worker function must be
a module-level function of an importable test module (the ``tests`` directory
is a package, so children can ``import tests.test_x``). A failing rank raises
``WorkerError`` whose message holds that rank's traceback, which pytest shows
as the failure; a hung world raises ``WorkerTimeout`` instead of stalling CI.
"""

from __future__ import annotations

from typing import Any, Callable

from gridtrain.runtime.launch import run_workers


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120,
    collective_timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; results by rank.

    The collective timeout is kept below ``timeout_s`` by default so that a
    mismatched collective shows up as an error with a traceback rather than as
    a bare timeout.
    """
    return run_workers(
        fn,
        world_size,
        args,
        backend="gloo",
        timeout_s=timeout_s,
        collective_timeout_s=min(collective_timeout_s, timeout_s),
    )
