"""The planner's memory per GPU beside the dry run's measured step peak, layout by
layout (dp, tp, pp, cp, ep, ZeRO 0-3, every schedule), at the scale the plans are for.

For each layout, ``gridtrain plan``'s figure (gridtrain/planner/cost.py
``memory_breakdown``: parameters, gradients, optimizer, activations, transients) of the
stage that needs the most, and the dry run (gridtrain/dryrun.py: one step on fake
tensors with a fake process group, in this process) of rank 0 of the first, the last
and the heaviest pipeline stage: its step peak (every storage alive on the device at
the step's high point). Counts, not timings: the table is the same on any machine.
The dry run runs on this host's torch (``--device cpu``: the fused attention kernels
save the same log-sum-exp rows on both devices; dropout is off in plans).

    python3 benchmarks/planner_memory.py            # every layout (~10 min on 2 CPU cores)
    python3 benchmarks/planner_memory.py --only 8b  # the layouts whose name holds 8b
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import common  # noqa: F401  benchmarks/common.py: the script's own folder is on sys.path
from gridtrain.config import ModelConfig, preset_config
from gridtrain.planner.cost import Job, Layout, _heaviest_stage, config_of, grid_of, memory_breakdown
from gridtrain.planner.machine import machine


@dataclass(frozen=True)
class Case:
    name: str
    model: str | ModelConfig
    gpus: int
    seq_len: int
    global_batch_size: int
    layout: Layout
    hardware: str = "h100-sxm"


L = Layout
CASES = [
    Case("llama3-8b dp 8 ZeRO-1", "llama3-8b", 8, 8192, 16, L(dp=8, tp=1, pp=1, micro_batch_size=1, zero=1,
                                                               recompute="selective")),
    Case("llama3-8b dp 8 ZeRO-2", "llama3-8b", 8, 8192, 16, L(dp=8, tp=1, pp=1, micro_batch_size=1, zero=2,
                                                               recompute="full")),
    Case("llama3-8b tp 8 x dp 8 ZeRO-3 (torchtitan)", "llama3-8b", 64, 8192, 96,
         L(dp=8, tp=8, pp=1, micro_batch_size=12, zero=3, sequence_parallel=True, recompute="none")),
    Case("llama3-8b HSDP 8 of 16", "llama3-8b", 16, 8192, 32, L(dp=16, tp=1, pp=1, micro_batch_size=1, zero=3,
                                                                 zero_shard_size=8, recompute="full")),
    Case("llama3-8b cp 8 ring 128K", "llama3-8b", 64, 131072, 8,
         L(dp=1, tp=8, pp=1, cp=8, micro_batch_size=1, zero=1, sequence_parallel=True, recompute="full")),
    Case("llama3-8b cp 4 all-gather 32K", "llama3-8b", 32, 32768, 8,
         L(dp=2, tp=4, pp=1, cp=4, cp_comm="allgather", micro_batch_size=1, zero=1, sequence_parallel=True,
           recompute="selective")),
    Case("llama3-70b tp 8 x pp 4 interleaved", "llama3-70b", 64, 8192, 64,
         L(dp=2, tp=8, pp=4, vpp=2, micro_batch_size=1, schedule="interleaved-1f1b", zero=1, sequence_parallel=True,
           recompute="selective")),
    Case("llama3-70b tp 8 x pp 4 ZB-H1", "llama3-70b", 64, 8192, 64,
         L(dp=2, tp=8, pp=4, micro_batch_size=1, schedule="zb-h1", zero=1, sequence_parallel=True,
           recompute="full")),
    Case("llama3-70b dp 64 ZeRO-3", "llama3-70b", 64, 8192, 128,
         L(dp=64, tp=1, pp=1, micro_batch_size=1, zero=3, recompute="full")),
    Case("gpt2-xl pp 4 GPipe ZeRO-0", "gpt2-xl", 8, 1024, 32, L(dp=2, tp=1, pp=4, micro_batch_size=4,
                                                                schedule="gpipe", recompute="none")),
    Case("mixtral-8x7b tp 2 x ep 8 pp 4", "mixtral-8x7b", 64, 4096, 64,
         L(dp=8, tp=2, pp=4, ep=8, micro_batch_size=1, zero=1, sequence_parallel=True, recompute="full")),
    Case("qwen3-30b-a3b ep 8 ZeRO-3 (NeMo)", "qwen3-30b-a3b", 8, 4096, 32,
         L(dp=8, tp=1, pp=1, ep=8, micro_batch_size=4, zero=3, recompute="full")),
    Case("deepseek-v2-lite ep 4 ZeRO-2 pp 2", "deepseek-v2-lite", 16, 4096, 32,
         L(dp=8, tp=1, pp=2, ep=4, micro_batch_size=1, zero=2, recompute="selective")),
]


def job_of(case: Case) -> Job:
    """The case's job; ``model`` a preset's name or a ModelConfig."""
    model = preset_config(case.model).model if isinstance(case.model, str) else case.model
    model = dataclasses.replace(model, seq_len=case.seq_len, dropout=0.0)
    return Job(model=model, global_batch_size=case.global_batch_size, hardware=machine(case.hardware, case.gpus),
               dtype="bf16")


def measured(job: Job, lay: Layout) -> dict[int, dict]:
    """The dry run's ranks (rank 0 of the first, the last and the heaviest stage), by stage."""
    from gridtrain.dryrun import dry_run

    cfg, grid = config_of(job, lay), grid_of(lay)
    cfg.training.device = "cpu"
    cfg.metrics.progress = False
    stages = sorted({0, lay.pp - 1, _heaviest_stage(job, lay, None, lambda: (cfg, grid))})
    ranks = {grid.rank_of(dp=0, pp=s, tp=0): s for s in stages}
    data = dry_run(cfg, lay.gpus, ",".join(map(str, ranks)), out=lambda *a, **k: None)
    return {ranks[r["rank"]]: r for r in data["ranks"]}


def compare(case: Case) -> dict:
    """The planner's breakdown and figure, the dry run's largest step peak, their ratio."""
    job = job_of(case)
    lay = case.layout
    parts = memory_breakdown(job, lay)
    began = time.perf_counter()
    ranks = measured(job, lay)
    peak = max(r["peak_bytes"] for r in ranks.values())
    return {"case": case, "parts": parts, "planned": sum(parts.values()), "peak": peak, "ranks": ranks,
            "seconds": time.perf_counter() - began}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="the layouts whose name holds this text")
    args = ap.parse_args()
    gb = lambda n: f"{n / 1e9:.2f}"  # noqa: E731
    print("| layout | GPUs | params | grads | optimizer | activations | transients | planned GB | "
          "dry-run step peak GB | planned / peak | dry run s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for case in CASES:
        if args.only not in case.name:
            continue
        r = compare(case)
        p = r["parts"]
        print(f"| {case.name} | {case.gpus} | {gb(p['parameters'])} | {gb(p['gradients'])} | {gb(p['optimizer'])} | "
              f"{gb(p['activations'])} | {gb(p['transients'])} | {gb(r['planned'])} | {gb(r['peak'])} | "
              f"{r['planned'] / r['peak']:.3f} | {r['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
