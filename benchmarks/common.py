"""What the side-by-side benchmarks share: the model-shape and timing flags."""

from __future__ import annotations

import argparse

from gridtrain.config import preset_config


def add_shape_and_timing_arguments(p: argparse.ArgumentParser, *, steps: int, warmup: int,
                                   repeats: int) -> None:
    """--n-layer --d-model --n-head --seq-len (default: the `small` preset), --steps
    --warmup --repeats (per benchmark) and --seed."""
    small = preset_config("small").model
    p.add_argument("--n-layer", type=int, default=small.n_layer, help="default: %(default)s (small preset)")
    p.add_argument("--d-model", type=int, default=small.d_model, help="default: %(default)s")
    p.add_argument("--n-head", type=int, default=small.n_head, help="default: %(default)s")
    p.add_argument("--seq-len", type=int, default=small.seq_len, help="default: %(default)s")
    p.add_argument("--steps", type=int, default=steps, help="timed steps per round and setup (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps per setup first (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=repeats, help="timed rounds (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1234, help="weights and batch (default: %(default)s)")


def run_benchmark(name: str, cfg, world_size: int, worker, opts: dict):
    """Validate ``cfg`` (one clear line for a bad shape, before any process starts), run
    ``worker`` on ``world_size`` gloo ranks; returns (per-rank results, wall seconds,
    (load average before, after)), or None after printing the configuration error."""
    import os
    import sys
    import time

    from gridtrain.config import ConfigError, validate
    from gridtrain.launch import run_workers

    try:
        validate(cfg, world_size=world_size)
    except ConfigError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return None
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    results = run_workers(worker, world_size, (opts,), collective_timeout_s=opts["timeout"])
    return results, time.perf_counter() - began, (load_before, os.getloadavg()[0])
