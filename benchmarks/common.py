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
