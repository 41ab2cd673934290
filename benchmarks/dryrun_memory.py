"""Per-rank memory of gpt2-xl, gpt2-large and llama3-405b (the largest preset) on 512 to
1024 ranks,
from the dry run (gridtrain/dryrun.py), beside the closed forms and the formula.

Counts, not timings: each layout runs one step of its edge ranks (first, middle and last
pipeline stage, DP/TP rank 0) on fake tensors with a fake process group, in this
process. bf16 with fp32 master weights, micro-batch 1 of the preset's sequence (1024
tokens for GPT-2, 8192 for Llama 3), 8 micro-batches
per step, 1F1B, ``--attention math`` (what the formula describes). The table is the same
on any machine; ``seconds`` is this machine's time for the whole layout.

    python3 benchmarks/dryrun_memory.py            # ~4 min on 2 CPU cores
"""

from __future__ import annotations

import time

import common  # noqa: F401  benchmarks/common.py: the script's own folder is on sys.path
from gridtrain import dryrun
from gridtrain.memory.model import expected_activation_peak, expected_bytes
from gridtrain.config import preset_config, set_fields
from gridtrain.parallel.grid import ProcessGrid

LAYOUTS = [  # (preset, world, tp, pp, extra training settings)
    ("gpt2-xl", 640, 5, 8, {}),
    ("gpt2-xl", 640, 5, 8, {"zero": 1}),
    ("gpt2-xl", 1000, 5, 8, {"zero": 1, "recompute": "selective"}),
    ("gpt2-xl", 800, 5, 16, {"recompute": "full"}),
    ("gpt2-large", 1024, 4, 4, {"zero": 1, "recompute": "selective"}),
    ("gpt2-large", 512, 4, 4, {}),
    ("llama3-405b", 1024, 8, 16, {"zero": 1, "recompute": "selective"}),
    ("llama3-405b", 1024, 8, 16, {"zero": 1, "recompute": "selective", "sequence_parallel": True}),
    ("llama3-405b", 512, 8, 16, {"zero": 1, "recompute": "full", "sequence_parallel": True}),
]


def main() -> None:
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    print("| model | layout (dp x pp x tp) | ZeRO | recompute | stage | parameters | params GiB | grads GiB "
          "| optimizer GiB | activation peak GiB | formula GiB | ratio | step peak GiB | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for preset, world, tp, pp, extra in LAYOUTS:
        cfg = preset_config(preset)
        cfg.parallel.tp, cfg.parallel.pp = tp, pp
        cfg.model.attention = "math"
        cfg.training.device, cfg.training.dtype, cfg.training.micro_batch_size = "cpu", "bf16", 1
        set_fields(cfg, **extra)
        grid = ProcessGrid.build(world, tp=tp, pp=pp)
        cfg.training.global_batch_size = 8 * grid.dp
        began = time.perf_counter()
        report = dryrun.dry_run(cfg, world, "edges", out=lambda *_: None)
        seconds = time.perf_counter() - began
        for r in report["ranks"]:
            assert {k: r[k] for k in expected_bytes(cfg, grid, r["rank"])} == expected_bytes(cfg, grid, r["rank"])
            formula = expected_activation_peak(cfg, grid, r["rank"], "cpu")
            print(f"| {preset} | {grid.dp} x {pp} x {tp} ({world}) | {cfg.parallel.zero} | "
                  f"{cfg.activations.recompute}{' + SP' if cfg.parallel.sequence_parallel else ''} | {r['pp']} | {r['parameters']:,} | {gib(r['parameter_bytes'])} | "
                  f"{gib(r['gradient_bytes'])} | {gib(r['optimizer_bytes'])} | "
                  f"{gib(r['activation_peak_bytes'])} | {gib(formula)} | "
                  f"{r['activation_peak_bytes'] / formula:.4f} | {gib(r['peak_bytes'])} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
