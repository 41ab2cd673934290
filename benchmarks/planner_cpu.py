"""The planner against this machine: predicted beside measured step time for a dozen gloo
layouts (world <= 8, several schedules and recompute modes), and predicted memory beside
the dry run's for the same layouts and for 1024-GPU layouts. A measurement, not a test.

    python3 benchmarks/planner_cpu.py [--steps 8] [--refresh-profile]

Every layout runs as the ``gridtrain train --nproc N`` the planner would print (local
workers), fp32 on the CPU, built-in corpus; its step time is the median of the metrics
file's steps after the first. The prediction is ``gridtrain.planner.cost.predict`` with
the ``cpu`` machine profiled on this host (gridtrain/planner/profile.py). This host's
speed drifts by a quarter over minutes (a shared virtual machine: the same one-process
run took 0.36 to 0.61 s a step within an hour), so every layout runs ``--rounds`` times
in turn (the mean of their medians) and the profile is taken before each round and after
the last (their mean): typical speed against typical speed. Memory: ``cost.memory_bytes`` beside the dry
run's measured bytes (parameters + gradients + optimizer + activation peak of the
largest rank, fake tensors) of the same layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

from gridtrain.config import ModelConfig, preset_config
from gridtrain.planner.cost import Job, Layout, config_of, memory_bytes, predict
from gridtrain.planner.machine import machine, machine_from_profile
from gridtrain.planner.measure import measure_one, train_args
from gridtrain.planner.profile import host_profile, profile_compute_loaded, profile_link

MODEL = ModelConfig(n_layer=4, n_head=8, d_model=256, seq_len=128, vocab_size=257, dropout=0.0)
GLOBAL_BATCH = 16
LAYOUTS = [
    Layout(dp=1, tp=1, pp=1, micro_batch_size=4),
    Layout(dp=1, tp=1, pp=1, micro_batch_size=4, recompute="full"),
    Layout(dp=2, tp=1, pp=1, micro_batch_size=4),
    Layout(dp=1, tp=2, pp=1, micro_batch_size=4),
    Layout(dp=1, tp=2, pp=1, micro_batch_size=4, recompute="selective", sequence_parallel=True),
    Layout(dp=1, tp=1, pp=2, micro_batch_size=2),
    Layout(dp=1, tp=1, pp=2, micro_batch_size=2, schedule="gpipe", recompute="full"),
    Layout(dp=1, tp=1, pp=2, vpp=2, micro_batch_size=2, schedule="interleaved-1f1b"),
    Layout(dp=1, tp=1, pp=2, micro_batch_size=2, schedule="zb-h1"),
    Layout(dp=2, tp=1, pp=2, micro_batch_size=2, zero=1),
    Layout(dp=1, tp=2, pp=2, micro_batch_size=2, recompute="full"),
    Layout(dp=2, tp=2, pp=1, micro_batch_size=2),
    Layout(dp=1, tp=1, pp=4, micro_batch_size=2),
]
BIG = [  # (preset, seq, global batch, layout) at 1024 GPUs, for memory only
    ("gpt2-large", 1024, 512, Layout(dp=64, tp=4, pp=4, micro_batch_size=1, recompute="selective")),
    ("llama3-70b", 8192, 1024, Layout(dp=32, tp=4, pp=8, micro_batch_size=1, schedule="zb-h1",
                                       recompute="selective", sequence_parallel=True, zero=1)),
    ("llama3-8b", 8192, 1024, Layout(dp=128, tp=8, pp=1, micro_batch_size=1, recompute="full", zero=1)),
]


def name(lay: Layout) -> str:
    return (f"dp{lay.dp} tp{lay.tp} pp{lay.pp}" + (f" v{lay.vpp}" if lay.vpp > 1 else "")
            + f" mb{lay.micro_batch_size} {lay.schedule} {lay.recompute}" + (" SP" if lay.sequence_parallel else "")
            + (" Z1" if lay.zero else ""))


def describe(profile: dict) -> str:
    return (f"GEMM peak {max(profile['gemm_flops'].values()) / 1e9:.1f} GFLOP/s per thread, copy "
            f"{profile['bandwidth'] / 1e9:.2f} GB/s, op {profile['kernel_s'] * 1e6:.0f} us; gloo under load "
            + ", ".join(f"{kind} {bw / 1e9:.2f} GB/s + {lat * 1e6:.0f} us" for kind, (lat, bw) in profile["link"].items()))


def average_profile(profiles: list[dict]) -> dict:
    """The mean of several profiles, figure by figure."""
    mean = statistics.mean
    return {"cores": profiles[0]["cores"],
            "gemm_flops": {k: mean(p["gemm_flops"][k] for p in profiles) for k in profiles[0]["gemm_flops"]},
            "bandwidth": mean(p["bandwidth"] for p in profiles), "kernel_s": mean(p["kernel_s"] for p in profiles),
            "link": {k: [mean(p["link"][k][i] for p in profiles) for i in range(2)] for k in profiles[0]["link"]}}


def dry_run_bytes(job: Job, lay: Layout) -> float:
    """The dry run's measured bytes of the largest rank (parameters, gradients, optimizer,
    activation peak), in this process on fake tensors."""
    from gridtrain.dryrun import dry_run

    cfg = config_of(job, lay)
    cfg.training.device = "cpu"
    cfg.metrics.progress = False
    data = dry_run(cfg, lay.gpus, "edges", None, out=lambda *a, **k: None)
    return max(r["parameter_bytes"] + r["gradient_bytes"] + r["optimizer_bytes"] + r["activation_peak_bytes"]
               for r in data["ranks"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--refresh-profile", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every layout, in turn (their mean)")
    ap.add_argument("--memory-only", action="store_true")
    args = ap.parse_args()
    began = time.time()
    profile = host_profile(refresh=args.refresh_profile)
    print(f"machine: {profile['cores']} cores; load average {os.getloadavg()[0]:.1f}")
    print(f"model: {MODEL.n_layer} layers, d {MODEL.d_model}, {MODEL.n_head} heads, seq {MODEL.seq_len}, "
          f"vocab {MODEL.vocab_size}; global batch {GLOBAL_BATCH}; fp32")
    flags = ["--n-layer", str(MODEL.n_layer), "--n-head", str(MODEL.n_head), "--d-model", str(MODEL.d_model),
             "--vocab-size", str(MODEL.vocab_size)]
    rows, ratios = [], []
    jobs = [Job(MODEL, GLOBAL_BATCH, machine("cpu", lay.gpus), "fp32") for lay in LAYOUTS]
    memory = [(memory_bytes(job, lay), dry_run_bytes(job, lay)) for job, lay in zip(jobs, LAYOUTS)]
    times: list[list[float]] = [[] for _ in LAYOUTS]
    profiles = []
    for _ in range(0 if args.memory_only else args.rounds):
        profiles.append({"cores": profile["cores"], **profile_compute_loaded(), "link": profile_link()})
        for i, (job, lay) in enumerate(zip(jobs, LAYOUTS)):
            p = predict(job, lay, memory=False)
            times[i].append(measure_one(train_args(flags, p, GLOBAL_BATCH, MODEL.seq_len, "fp32", args.steps)))
            print(f"{name(lay)}: {times[i][-1]:.4f} s/step", flush=True)
    if profiles:
        profiles.append({"cores": profile["cores"], **profile_compute_loaded(), "link": profile_link()})
        profile = average_profile(profiles)
        print(f"profile averaged over {len(profiles)} (before each round and after the last): " + describe(profile))
    for job, lay, (mem, dry), runs in zip(jobs, LAYOUTS, memory, times):
        if not runs:
            rows.append(f"| {name(lay)} | | | | {mem / 2**20:.1f} | {dry / 2**20:.1f} | {mem / dry:.3f} |")
            continue
        p = predict(dataclasses.replace(job, hardware=machine_from_profile(profile, lay.gpus)), lay, memory=mem)
        measured = statistics.mean(runs)
        ratios.append(p.step_time_s / measured)
        rows.append(f"| {name(lay)} | {p.step_time_s:.4f} | {measured:.4f} ({' '.join(f'{t:.3f}' for t in runs)}) | "
                    f"{p.step_time_s / measured:.3f} | {mem / 2**20:.1f} | {dry / 2**20:.1f} | {mem / dry:.3f} |")
    print("\n| layout | predicted s/step | measured s/step (rounds) | predicted / measured | "
          "predicted MiB | dry run MiB | predicted / dry run |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    if ratios:
        within = sum(abs(r - 1) <= 0.15 for r in ratios)
        print(f"\nstep time within 15%: {within} of {len(ratios)} layouts; median ratio {statistics.median(ratios):.3f}")
    print("\n| 1024-GPU layout | predicted GiB | dry run GiB | ratio |\n| --- | ---: | ---: | ---: |")
    for preset, seq, batch, lay in BIG:
        model = dataclasses.replace(preset_config(preset).model, seq_len=seq, dropout=0.0)
        job = Job(model, batch, machine("h100-sxm"), "bf16")
        predicted, dry = memory_bytes(job, lay), dry_run_bytes(job, lay)
        print(f"| {preset} seq {seq} {name(lay)} | {predicted / 2**30:.2f} | {dry / 2**30:.2f} | {predicted / dry:.4f} |")
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}; wall time {time.time() - began:.0f} s")


if __name__ == "__main__":
    main()
