"""The ``cpu`` machine: this host, measured, so that the planner can be checked against
runs it can make (``gridtrain plan --hardware cpu``, ``--measure``).

A short profile (a few seconds, then cached in ``~/.cache/gridtrain`` per host, core
count and torch version) measures, on one thread:

* GEMM throughput at several sizes: the largest gives the peak (``gemm_efficiency``
  1), the others fit ``gemm_half`` of the cost model's ``x / (x + gemm_half)``;
* memory bandwidth: copying a 64 MiB tensor;
* the cost of one small op through autograd (the eager overhead every kernel pays);
* gloo between two local processes: an all-reduce of 8 B (latency per ring step) and of
  8 MiB (bandwidth).

A "GPU" is one worker process. gridtrain's workers take ``cores // world`` threads each
(worker.py), and more workers than cores share them, so :func:`cpu_machine` scales the
single-thread figures by ``max(1, cores // world)`` and by ``min(1, cores / world)``.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import torch

from gridtrain.planner.machine import Link, Machine

SIZES = (32, 64, 128, 256, 512)
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gridtrain"


def _best(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


def profile_compute(dtype=torch.float32) -> dict[str, float]:
    """Single-thread GEMM FLOP/s by size, copy bandwidth and the per-op overhead."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flops = {}
        for n in SIZES:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            reps = max(1, int(2e8 / (2 * n ** 3)))
            seconds = _best(lambda: [a @ b for _ in range(reps)]) / reps
            flops[n] = 2 * n ** 3 / seconds
        big = torch.empty(16 << 20, dtype=torch.float32)
        bandwidth = 2 * big.nbytes / _best(lambda: big.clone())
        x = torch.ones(8, requires_grad=True)
        overhead = _best(lambda: [(x * 2).sum().backward() for _ in range(100)]) / 100 / 4  # ~4 kernels
    finally:
        torch.set_num_threads(threads)
    return {"gemm_flops": {str(k): v for k, v in flops.items()}, "bandwidth": bandwidth, "kernel_s": overhead}


def _gloo_worker(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    small, large = torch.zeros(1, dtype=torch.float64), torch.zeros(1 << 20, dtype=torch.float64)
    for t in (small, large):
        dist.all_reduce(t)  # warm up
    small_s = statistics.median(_timed(dist, small) for _ in range(50))
    large_s = statistics.median(_timed(dist, large) for _ in range(10))
    if rank == 0:
        out.put({"latency": small_s / 2, "bandwidth": large.numel() * 8 / max(large_s - small_s, 1e-9)})
    dist.destroy_process_group()


def _timed(dist, t) -> float:
    dist.barrier()
    began = time.perf_counter()
    dist.all_reduce(t)
    return time.perf_counter() - began


def profile_link() -> dict[str, float]:
    """gloo all-reduce between two local processes: seconds per ring step (latency) and
    bytes/s (an all-reduce of 2 ranks sends the whole tensor once each way)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return result


def host_profile(refresh: bool = False) -> dict:
    """The profile of this host, cached (see the module docstring)."""
    key = f"{platform.node()}-{os.cpu_count()}-{torch.__version__}".replace("/", "_")
    path = CACHE / f"cpu-profile-{key}.json"
    if path.is_file() and not refresh:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    profile = {"cores": os.cpu_count() or 1, **profile_compute(), "link": profile_link()}
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile, indent=1))
    except OSError:
        pass  # a read-only home: profile again next time
    return profile


def machine_from_profile(profile: dict, world: int) -> Machine:
    """One worker's share of the host for a job of ``world`` local workers."""
    cores = profile["cores"]
    threads = max(1, cores // max(world, 1))
    share = threads * min(1.0, cores / max(world, 1))
    flops = {int(k): v for k, v in profile["gemm_flops"].items()}
    peak = max(flops.values())
    # x / (x + h) = f(x) / peak  =>  h = x (peak / f(x) - 1), over the sizes below the peak's
    halves = [n * (peak / f - 1) for n, f in flops.items() if f < peak]
    half = statistics.median(halves) if halves else 1.0
    link = Link(profile["link"]["bandwidth"] * min(1.0, cores / max(world, 1)), profile["link"]["latency"])
    return Machine(name="cpu", peak={"fp32": peak * share, "fp64": peak * share / 2, "bf16": peak * share / 4,
                                     "fp16": peak * share / 8},
                   memory_bandwidth=profile["bandwidth"] * share, memory=_host_memory(), nvlink=link, network=link,
                   gpus_per_node=max(world, 1), gemm_efficiency=1.0, gemm_half=half, kernel_s=profile["kernel_s"],
                   usable_fraction=0.8, source=f"measured on this host ({cores} cores)")


def _host_memory() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16e9


def cpu_machine(world: int = 1, refresh: bool = False) -> Machine:
    return machine_from_profile(host_profile(refresh), world)
