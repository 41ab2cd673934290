"""The ``cpu`` machine: this host, measured, so that the planner can be checked against
runs it can make (``gridtrain plan --hardware cpu``, ``--measure``).

A short profile (a few seconds, then cached in ``~/.cache/gridtrain`` per host, core
count and torch version) measures, on one thread of each of ``cores`` processes running
at once (a training run keeps every core busy), the median of a few repeats:

* GEMM throughput at several sizes: the largest gives the peak (``gemm_efficiency``
  1), the others fit ``gemm_half`` of the cost model's ``x / (x + gemm_half)``;
* memory bandwidth: copying a 64 MiB tensor;
* the cost of one small op through autograd (the eager overhead every kernel pays);
* gloo between two local processes that compute between operations, as training does:
  all-reduce, all-gather, reduce-scatter and send at 64 KiB to 2 MiB, each kind's
  latency and bandwidth fitted to the (trimmed) mean times. Measured between idle
  processes the latency was ~0.1 ms; between computing ones it is several times that
  (each waits for its peer to be scheduled), and gloo's all-gather and reduce-scatter
  run at rates of their own (not the all-reduce's).

A "GPU" is one worker process. gridtrain's workers take ``cores // world`` threads each
(worker.py), and more workers than cores share them, so machine.cpu_machine scales the
single-thread figures by ``max(1, cores // world)`` and by ``min(1, cores / world)``
(every worker computing at once). While some wait (on a peer, in a pipeline bubble) the
others get more: not modelled, so layouts with more workers than cores are predicted
somewhat slow (docs/planner.md).
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


SIZES = (32, 64, 128, 256, 512)
PROFILE_VERSION = 3  # bump when what is measured changes: older caches are measured again
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gridtrain"


def _typical(fn, repeats: int = 5) -> float:
    """The median time of ``fn``: what a run sustains, not the best moment."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def profile_compute(dtype=torch.float32) -> dict[str, float]:
    """Single-thread GEMM FLOP/s by size, copy bandwidth and the per-op overhead, in this
    process (see :func:`profile_compute_loaded`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flops = {}
        for n in SIZES:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            reps = max(1, int(2e8 / (2 * n ** 3)))
            seconds = _typical(lambda: [a @ b for _ in range(reps)]) / reps
            flops[n] = 2 * n ** 3 / seconds
        big = torch.empty(16 << 20, dtype=torch.float32)
        bandwidth = 2 * big.nbytes / _typical(lambda: big.clone())
        x = torch.ones(8, requires_grad=True)
        overhead = _typical(lambda: [(x * 2).sum().backward() for _ in range(100)]) / 100 / 4  # ~4 kernels
    finally:
        torch.set_num_threads(threads)
    return {"gemm_flops": {str(k): v for k, v in flops.items()}, "bandwidth": bandwidth, "kernel_s": overhead}


def _compute_worker(barrier, out) -> None:
    barrier.wait()
    out.put(profile_compute())


def profile_compute_loaded() -> dict:
    """:func:`profile_compute` in one process per core, all at once, averaged: a worker
    computes while the others do (training keeps every core busy), so the shared caches,
    memory bandwidth and the host's other tenants weigh on the figures as they do in a
    run. (One process alone measured 5-25% faster on the 2-core test host.)"""
    import torch.multiprocessing as mp

    cores = os.cpu_count() or 1
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(cores), ctx.Queue()
    procs = [ctx.Process(target=_compute_worker, args=(barrier, out)) for _ in range(cores)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return {"gemm_flops": {k: statistics.mean(r["gemm_flops"][k] for r in results) for k in results[0]["gemm_flops"]},
            "bandwidth": statistics.mean(r["bandwidth"] for r in results),
            "kernel_s": statistics.mean(r["kernel_s"] for r in results)}


KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send")
LINK_SIZES = (64 << 10, 512 << 10, 2 << 20)  # bytes of the whole tensor: a block's activations
LINK_REPEATS = 40


def _gloo_worker(rank: int, port: int, out) -> None:
    """Time each kind of operation between two processes that compute between them, as
    training does (a GEMM of a few milliseconds): the time includes waiting for the peer
    to be scheduled, which between idle processes it would not."""
    import torch.distributed as dist

    from gridtrain.parallel.comm import _ALL_GATHER_SINGLE, _REDUCE_SCATTER_SINGLE

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    a, b = torch.randn(512, 256), torch.randn(256, 512)
    samples: dict[str, list[tuple[int, float]]] = {k: [] for k in KINDS}
    for nbytes in LINK_SIZES:
        x = torch.zeros(nbytes // 4)
        ops = {"all_reduce": (nbytes, lambda: dist.all_reduce(x)),
               "all_gather": (nbytes, lambda: _ALL_GATHER_SINGLE(torch.empty(nbytes // 4), x[: nbytes // 8])),
               "reduce_scatter": (nbytes, lambda: _REDUCE_SCATTER_SINGLE(x[: nbytes // 8].clone(), x)),
               "send": (nbytes, lambda: dist.send(x, 1) if rank == 0 else dist.recv(x, 0))}
        for kind, (whole, op) in ops.items():
            op()  # warm up
            times = []
            for _ in range(LINK_REPEATS):
                a @ b
                began = time.perf_counter()
                op()
                times.append(time.perf_counter() - began)
            samples[kind].append((whole, _trimmed_mean(times)))
    if rank == 0:
        out.put({kind: _fit(kind, points) for kind, points in samples.items()})
    dist.destroy_process_group()


def _trimmed_mean(times: list[float], cut: float = 0.1) -> float:
    """The mean without the slowest and fastest ``cut``: a step pays the waits (so not
    the median), but not a rare stall of the profile's own."""
    times = sorted(times)
    k = int(len(times) * cut)
    return statistics.mean(times[k: len(times) - k])


def _fit(kind: str, points: list[tuple[int, float]]) -> list[float]:
    """(latency per ring step, bandwidth) from ``t = a + c x`` fitted to (bytes, seconds):
    between two ranks an all-reduce is 2 ring steps sending the whole tensor once, an
    all-gather or reduce-scatter 1 step sending half of it, a send 1 step sending all."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    slope = max(slope, 1e-12)
    intercept = max(my - slope * mx, 1e-6)
    steps, share = {"all_reduce": (2, 1.0), "send": (1, 1.0)}.get(kind, (1, 0.5))
    return [intercept / steps, share / slope]


def profile_link() -> dict[str, list[float]]:
    """gloo between two local processes, each kind of operation (``_gloo_worker``):
    ``{kind: [latency per ring step, bandwidth]}``."""
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
        result = out.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return result


def host_profile(refresh: bool = False) -> dict:
    """The profile of this host, cached (see the module docstring)."""
    key = f"{PROFILE_VERSION}-{platform.node()}-{os.cpu_count()}-{torch.__version__}".replace("/", "_")
    path = CACHE / f"cpu-profile-{key}.json"
    if path.is_file() and not refresh:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    profile = {"cores": os.cpu_count() or 1, **profile_compute_loaded(), "link": profile_link()}
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile, indent=1))
    except OSError:
        pass  # a read-only home: profile again next time
    return profile
