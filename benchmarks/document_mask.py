"""What ``--document-mask`` costs: the whole ``gridtrain train`` loop with and without it,
side by side, in one process and on cp 2 (ring), at one sequence length.

Every side is ``pretrain`` with the built-in corpus and providers, as the command runs
it: a small GPT at ``--seq-len`` (default 2048), one sequence per micro-batch, the same
global batch and seed everywhere; the one-process sides with every core's threads, the
cp sides with one thread per rank (as ``gridtrain train --nproc 2`` gives them). With
the mask each window's documents are those of the corpus (the built-in corpus's files
are long, so a window holds one to a few), and the mask's cost does not depend on how
many there are: the attention reads a ``[b, s, s]`` boolean mask instead of running
the causal kernel (one process: torch's ``scaled_dot_product_attention`` with
``attn_mask``; cp: every chunk pair through the matrix-product block kernel with its
mask, instead of torch's fused CPU kernel). The sides run in turn, the order reversed
every other round; per side, the median over rounds of the run's tokens/s (median step
after the first) and the peak bytes saved for backward per rank at step 1.

    python3 benchmarks/document_mask.py                   # ~1 min on 2 CPU cores
    python3 benchmarks/document_mask.py --seq-len 4096 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import common  # benchmarks/common.py: the script's own folder is on sys.path
from gridtrain.config import ConfigError, preset_config, set_fields
from gridtrain.training.loop import pretrain
from gridtrain.training.providers import decoder_forward_step, decoder_model_provider, text_datasets_provider
from gridtrain.training.validate import validate

SIDES = {  # name -> (world size, parallel fields, document mask)
    "one process": (1, {}, False),
    "one process, --document-mask": (1, {}, True),
    "cp 2 ring": (2, dict(cp=2, cp_comm="ring"), False),
    "cp 2 ring, --document-mask": (2, dict(cp=2, cp_comm="ring"), True),
}


def _config(side: str, opts: argparse.Namespace):
    world, parallel, masked = SIDES[side]
    cfg = preset_config("tiny")
    set_fields(cfg, n_layer=opts.n_layer, d_model=opts.d_model, n_head=opts.n_head, seq_len=opts.seq_len,
               dtype="fp32", steps=opts.steps, micro_batch_size=1, global_batch_size=opts.global_batch_size,
               eval_interval=0, eval_iters=1, progress=False, lr=1e-3, warmup_steps=1, document_mask=masked)
    cfg.parallel.nproc = world if world > 1 else None
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return validate(cfg, world_size=world)


def _worker(rank: int, world_size: int, cfg) -> dict:
    if world_size == 1:
        torch.set_num_threads(os.cpu_count() or 1)
    result = pretrain(decoder_model_provider, text_datasets_provider, decoder_forward_step, cfg)
    return {"tokens_per_s": result.tokens_per_s,
            "peak_activation_bytes": max(s.peak_bytes for s in result.memory) if result.memory else 0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    opts = p.parse_args(argv)
    try:
        cfgs = {side: _config(side, opts) for side in SIDES}
    except ConfigError as e:
        print(f"document_mask: error: {e}", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    print(f"GPT: {opts.n_layer} layers, d {opts.d_model}, {opts.n_head} heads, seq {opts.seq_len}, "
          f"{opts.global_batch_size} sequences per step (micro-batch 1), fp32, {opts.steps} steps per run "
          f"(step 1 untimed), {opts.rounds} rounds; torch {torch.__version__}, {os.cpu_count()} CPU cores, "
          f"gridtrain {common.gridtrain_version()}")
    measured: dict[str, list[list[dict]]] = {side: [] for side in SIDES}
    order = list(SIDES)
    for round_ in range(opts.rounds):
        for side in order if round_ % 2 == 0 else order[::-1]:
            began = time.perf_counter()
            ranks = common.run_ranks(_worker, SIDES[side][0], cfgs[side], timeout_s=1800)
            print(f"  round {round_ + 1}: {side}: {ranks[0]['tokens_per_s']:,.0f} tokens/s "
                  f"({time.perf_counter() - began:.0f} s with start-up)", flush=True)
            measured[side].append(ranks)
    print()
    print("| side | tokens/s | vs the same layout without the mask | peak activations per rank |")
    print("| --- | --- | --- | --- |")
    for side, rounds in measured.items():
        tps = statistics.median(r[0]["tokens_per_s"] for r in rounds)
        plain = side.removesuffix(", --document-mask")
        base = statistics.median(r[0]["tokens_per_s"] for r in measured[plain])
        peak = max(rank["peak_activation_bytes"] for r in rounds for rank in r)
        print(f"| {side} | {tps:,.0f} | {tps / base:.2f}x | {common.mib(peak)} |")
    print(f"\n1-minute load average: {load:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
