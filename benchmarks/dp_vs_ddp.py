"""Data parallelism side by side: gridtrain's GradientReducer against torch DistributedDataParallel.

The same GPT (shape, initial weights, batch, loss, optimizer) is trained for a few steps
on two gloo processes, one data-parallel replica each, in several ways, alternating
inside the same two processes:

* ``gridtrain dp=2``: the real training step. ``setup_distributed`` on a config with
  ``parallel.dp = 2``, ``gpt_model_provider``, ``broadcast_parameters`` (as ``pretrain``
  does), ``build_optimizer``, ``build_pipeline`` (with one stage: a plain
  gradient-accumulation loop), ``GradientReducer(model, ctx.dp, accumulations=m,
  bucket_mb=B)`` and ``gridtrain.train.train_step``: per step the global token count
  (one scalar all-reduce), the micro-batches' forwards and backwards, during which the
  reducer's hooks move each gradient into its fp32 buffer and start a bucket's
  asynchronous all-reduce as soon as its parameters have all received their last
  micro-batch's gradient; then ``finish`` (wait, divide by dp), the global gradient norm
  (``grad_clip = 0``: computed, not applied, to match the other side), AdamW, and the
  mean loss (one scalar all-reduce).
* ``DDP dp=2``: ``torch.nn.parallel.DistributedDataParallel(GPT(cfg.model),
  bucket_cap_mb=B)`` around gridtrain's own GPT initialised with ``init_parameters``
  (so the math and the starting weights are identical), the same micro-batches with
  ``no_sync()`` on all but the last, each micro-batch's summed token loss scaled by
  ``1 / tokens per rank`` (= gridtrain's ``dp / global tokens``), AdamW with gridtrain's
  parameter groups, and the mean loss all-reduced for the log (as gridtrain does).
* ``dp=2, no gradient sync``: the same two processes training a plain GPT on the same
  micro-batches with no collective at all: the compute floor of a dp=2 step on this
  machine. A setup's step time minus this one's (paired per round) is the communication
  it left exposed, whatever its cause (``--no-floor`` skips it).
* ``gridtrain 1 process``: the same ``train_step`` with dp=1 over all 2m micro-batches of
  the global batch, on rank 0 with every core, while rank 1 waits in a barrier
  (``--no-reference`` skips it).

Each bucket size in ``--bucket-mb`` (default ``25,0.25``) gets its own gridtrain and DDP
setup. 25 MiB holds the whole ``small`` model's gradient (3.4 MB) in one bucket, so
nothing can start before backward ends; 0.25 MiB cuts it into many buckets that can be
all-reduced while backward goes on.

A step is: zero grads, m micro-batches of forward + backward (mean token cross entropy
over the global batch), gradient averaging over the 2 ranks, AdamW (lr 1e-3, betas
(0.9, 0.95), weight decay 0.1 on matrices). fp32, no dropout, no LR schedule, no data
loading: the global batch is fixed random token ids (same seed everywhere); rank r
trains its m micro-batches r*m .. r*m + m - 1.

Timing: every setup first runs ``--warmup`` untimed steps (DDP rebuilds its buckets in
gradient-ready order after its first step); then ``--repeats`` rounds, each timing
``--steps`` steps of every setup in turn (the order reversed every other round),
between two barriers, with ``time.perf_counter`` on rank 0. Reported: medians over
rounds, the best round, the tokens/s ratio gridtrain / DDP paired per round, the exposed
communication, and for gridtrain, per timed step, the share of its all-reduce time that
its reducer measured as hidden behind backward (``reducer.stats``), the time spent in
``reducer.finish`` and the DP payload bytes from its ``ByteCounter``.

Run from the repository root::

    python3 benchmarks/dp_vs_ddp.py          # `small` shape: ~35 s on 2 idle cores
    python3 benchmarks/dp_vs_ddp.py --bucket-mb 0.25,0.26 --no-reference
    python3 benchmarks/dp_vs_ddp.py --d-model 256 --n-layer 8 --bucket-mb 25,1 --steps 2 --repeats 6
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common import add_shape_and_timing_arguments, run_benchmark  # benchmarks/common.py: the script's own folder is on sys.path
from gridtrain.comm import single
from gridtrain.config import Config, ParallelConfig, TrainingConfig, preset_config
from gridtrain.data_parallel import GradientReducer, broadcast_parameters
from gridtrain.distributed import setup_distributed
from gridtrain.grid import ProcessGrid
from gridtrain.model import GPT, init_parameters
from gridtrain.optim import build_optimizer
from gridtrain.providers import gpt_forward_step, gpt_model_provider
from gridtrain.tensor_parallel import TensorParallel
from gridtrain.train import build_pipeline, train_step

DP = 2


@dataclass
class Setup:
    name: str
    step_fn: Callable[[], tuple[float | None, dict]]  # one step -> (global mean loss, extras)
    kind: str  # "gridtrain", "ddp", "floor", "reference"
    bucket_mb: float | None = None
    active: bool = True
    threads: int | None = None
    times: list[float] = field(default_factory=list)  # per round: seconds per step (rank 0)
    losses: list[float | None] = field(default_factory=list)  # every step, warm-up included
    extras: list[dict] = field(default_factory=list)  # per timed step, this rank
    info: dict = field(default_factory=dict)


# ---- the gridtrain side --------------------------------------------------------------------------

def gridtrain_setup(cfg: Config, ctx, batches: list[dict], n_mb: int, bucket_mb: float) -> tuple[Setup, object]:
    """gridtrain's provider, optimizer, pipeline, reducer and train_step, as pretrain builds them."""
    model = gpt_model_provider(cfg, ctx)
    broadcast_parameters(model, ctx.dp)
    opt = build_optimizer(model, cfg.training)
    pipe = build_pipeline(model, cfg, ctx, gpt_forward_step, n_mb)
    reducer = GradientReducer(model, ctx.dp, accumulations=n_mb, bucket_mb=bucket_mb)
    finish = reducer.finish
    clock = {"finish_s": 0.0}

    def timed_finish() -> None:  # the wait for the buckets still in flight when backward ends
        clock["finish_at"] = began = time.perf_counter()
        finish()
        clock["finish_s"] = time.perf_counter() - began

    reducer.finish = timed_finish  # reduce_gradients calls reducer.finish()

    def step() -> tuple[float, dict]:
        before = dict(ctx.bytes.bytes)
        calls_before = dict(ctx.bytes.calls)
        loss, _, _ = train_step(model, opt, pipe, reducer, batches, ctx, cfg.training.grad_clip)
        d_in, d_hid = reducer.stats.in_flight_s, reducer.stats.hidden_s  # the reducer's stats are per step
        moved = {f"{k}/{g}": n - before.get((k, g), 0) for (k, g), n in ctx.bytes.bytes.items()
                 if n - before.get((k, g), 0)}
        calls = {f"{k}/{g}": n - calls_before.get((k, g), 0) for (k, g), n in ctx.bytes.calls.items()
                 if n - calls_before.get((k, g), 0)}
        # wall clock, from the buckets' own timestamps: the window from the first launch to the
        # last completion, and how much of it passed before backward ended (finish was called)
        first = min(b.launched_at for b in reducer.buckets)
        last = max(b.done_at for b in reducer.buckets)
        window = last - first
        before_finish = max(0.0, min(clock["finish_at"], last) - first)
        return loss, {"fraction": d_hid / d_in if d_in > 0 else 0.0, "in_flight_s": d_in, "hidden_s": d_hid,
                      "finish_s": clock["finish_s"], "bytes": moved, "calls": calls,
                      "window_s": window,
                      "wall_fraction": before_finish / window if window > 0 else 0.0}

    s = Setup(f"gridtrain dp={DP}, {bucket_mb:g} MiB", step, "gridtrain", bucket_mb)
    s.info["buckets"] = [(b.end - b.start) * reducer.buffer.element_size() for b in reducer.buckets]
    s.info["buffer_bytes"] = reducer.buffer.numel() * reducer.buffer.element_size()
    return s, model


# ---- the torch DDP side --------------------------------------------------------------------------

def ddp_setup(cfg: Config, batches: list[dict], n_mb: int, bucket_mb: float, seed: int) -> tuple[Setup, object]:
    gpt = GPT(cfg.model)
    init_parameters(gpt, seed)
    ddp = DistributedDataParallel(gpt, bucket_cap_mb=bucket_mb)
    opt = build_optimizer(gpt, cfg.training)
    local_tokens = sum(b["labels"].numel() for b in batches)
    global_tokens = DP * local_tokens

    def step() -> tuple[float, dict]:
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for i, b in enumerate(batches):
            with ddp.no_sync() if i < n_mb - 1 else contextlib.nullcontext():
                summed = ddp(b["tokens"], b["labels"]).sum()  # gridtrain's gpt_forward_step
                (summed * (1.0 / local_tokens)).backward()
            loss_sum += summed.detach().to(torch.float64)  # as gridtrain's pipeline adds it up
        opt.step()
        dist.all_reduce(loss_sum)  # the global mean loss, for the log (gridtrain does the same)
        return float(loss_sum) / global_tokens, {}

    s = Setup(f"DDP dp={DP}, {bucket_mb:g} MiB", step, "ddp", bucket_mb)
    s.info["ddp"] = ddp
    return s, gpt


def ddp_buckets(ddp: DistributedDataParallel) -> list[int]:
    """DDP's bucket sizes in bytes, after its rebuild (from its own logging data)."""
    data = ddp._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(x) for x in str(sizes).replace(",", " ").split()]


# ---- the compute floor -------------------------------------------------------------------------

def floor_setup(cfg: Config, batches: list[dict], seed: int) -> Setup:
    gpt = GPT(cfg.model)
    init_parameters(gpt, seed)
    opt = build_optimizer(gpt, cfg.training)
    local_tokens = sum(b["labels"].numel() for b in batches)

    def step() -> tuple[None, dict]:
        opt.zero_grad(set_to_none=True)
        for b in batches:
            (gpt(b["tokens"], b["labels"]).sum() * (1.0 / local_tokens)).backward()
        opt.step()
        return None, {}

    return Setup(f"dp={DP} ranks, no gradient sync (floor)", step, "floor")


# ---- the worker ----------------------------------------------------------------------------------

def _worker(rank: int, world: int, opts: dict) -> dict:
    base_threads = torch.get_num_threads()
    n_mb, mbs = opts["microbatches"], opts["micro_batch_size"]
    cfg = _config(opts, opts["bucket_mb"][0])
    ctx = setup_distributed(cfg)  # dp=2 grid, its groups, the ByteCounter, seeds
    m = cfg.model
    gen = torch.Generator().manual_seed(opts["seed"])
    data = torch.randint(0, m.vocab_size, (DP * n_mb * mbs, m.seq_len + 1), generator=gen)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    everything = [{"tokens": tokens[i * mbs:(i + 1) * mbs], "labels": labels[i * mbs:(i + 1) * mbs]}
                  for i in range(DP * n_mb)]
    mine = everything[rank * n_mb:(rank + 1) * n_mb]

    setups: list[Setup] = []
    pairs: list[tuple[object, object]] = []  # (gridtrain model, DDP's module) per bucket size
    for b in opts["bucket_mb"]:
        gt, gt_model = gridtrain_setup(_config(opts, b), ctx, mine, n_mb, b)
        dd, dd_model = ddp_setup(cfg, mine, n_mb, b, opts["seed"])
        setups += [gt, dd]
        pairs.append((gt_model, dd_model))
    if opts["floor"]:
        setups.append(floor_setup(cfg, mine, opts["seed"]))

    # one-process reference: train_step with dp=1 on rank 0, all micro-batches, every core
    if opts["reference"]:
        cfg1 = replace(cfg, parallel=ParallelConfig(nproc=1, dp=1, bucket_mb=opts["bucket_mb"][0]))
        # A one-rank context: the grid is 1 x 1 x 1 and every group is the identity, so
        # train_step runs without collectives while rank 1 waits in the barrier.
        ctx1 = replace(ctx, grid=ProcessGrid.build(1), rank=0, tp=TensorParallel(), dp=single("dp"),
                       mp=single("mp"), pp=single("pp"), embedding=None)
        ref_model = gpt_model_provider(cfg1, ctx1)
        ref_opt = build_optimizer(ref_model, cfg1.training)
        ref_pipe = build_pipeline(ref_model, cfg1, ctx1, gpt_forward_step, DP * n_mb)
        ref_reducer = GradientReducer(ref_model, ctx1.dp, accumulations=DP * n_mb,
                                      bucket_mb=cfg1.parallel.bucket_mb)

        def reference_step() -> tuple[float, dict]:
            loss, _, _ = train_step(ref_model, ref_opt, ref_pipe, ref_reducer, everything, ctx1, 0.0)
            return loss, {}

        cores = opts["ref_threads"] or os.cpu_count() or 1
        setups.append(Setup("gridtrain 1 process", reference_step, "reference", active=rank == 0,
                            threads=cores))

    def run_block(s: Setup, steps: int, timed: bool) -> float:
        torch.set_num_threads(s.threads or base_threads)
        dist.barrier()
        start = time.perf_counter()
        if s.active:
            for _ in range(steps):
                loss, extra = s.step_fn()
                s.losses.append(loss)
                if timed:
                    s.extras.append(extra)
                elif len(s.losses) == 1:
                    s.info["first_step"] = extra
        dist.barrier()
        elapsed = time.perf_counter() - start
        torch.set_num_threads(base_threads)
        return elapsed

    for s in setups:
        run_block(s, opts["warmup"], timed=False)

    # isolated gloo all-reduces: the whole gradient buffer, and one bucket of the smallest size
    def allreduce_ms(nbytes: int) -> float:
        x = torch.zeros(max(1, nbytes // 4))
        samples = []
        for _ in range(20):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples) * 1e3

    buffer_bytes = setups[0].info["buffer_bytes"]
    small = int(min(opts["bucket_mb"]) * 2 ** 20)
    isolated = {buffer_bytes: allreduce_ms(buffer_bytes)}
    if small < buffer_bytes:
        isolated[small] = allreduce_ms(small)

    for r in range(opts["repeats"]):
        for s in (setups if r % 2 == 0 else setups[::-1]):
            s.times.append(run_block(s, opts["steps"], timed=True) / opts["steps"])

    # the same math on both sides: after the same steps, compare the weights
    weight_diffs = []
    with torch.no_grad():
        for gt_model, dd_model in pairs:
            a, b = dict(gt_model.named_parameters()), dict(dd_model.named_parameters())
            weight_diffs.append(max(float((a[n] - b[n]).abs().max()) for n in a))

    for s in setups:
        if s.kind == "ddp":
            s.info["buckets"] = ddp_buckets(s.info.pop("ddp"))
    return {
        "setups": [{"name": s.name, "kind": s.kind, "bucket_mb": s.bucket_mb, "times": s.times,
                    "losses": s.losses, "extras": s.extras,
                    "buckets": s.info.get("buckets"), "first_step": s.info.get("first_step"),
                    "active": s.active} for s in setups],
        "threads_per_rank": base_threads,
        "isolated_ms": isolated,
        "buffer_bytes": buffer_bytes,
        "weight_diffs": weight_diffs,
        "params": sum(p.numel() for p in pairs[0][0].parameters()),
        "padded_vocab": pairs[0][0].padded_vocab,
    }


# ---- parent: configuration and report ---------------------------------------------------------

def _config(opts: dict, bucket_mb: float) -> Config:
    cfg = preset_config("small")
    cfg.model = replace(cfg.model, n_layer=opts["n_layer"], d_model=opts["d_model"],
                        n_head=opts["n_head"], seq_len=opts["seq_len"], dropout=0.0)
    cfg.parallel = ParallelConfig(nproc=DP, dp=DP, bucket_mb=bucket_mb)
    n = DP * opts["microbatches"] * opts["micro_batch_size"]
    cfg.training = TrainingConfig(steps=100, warmup_steps=1, micro_batch_size=opts["micro_batch_size"],
                                  global_batch_size=n, seed=opts["seed"], dtype="fp32", device="cpu",
                                  grad_clip=0.0, dist_timeout_s=opts["timeout"], progress=False)
    return cfg


def gridtrain_version() -> str:
    """The commit measured, and whether gridtrain/ has local edits (read-only git queries)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "gridtrain"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" with uncommitted changes under gridtrain/" if dirty else "")


def _fmt_bytes(n: float) -> str:
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _buckets(sizes: list[int] | None) -> str:
    if not sizes:
        return "?"
    small = sum(1 for x in sizes if x < 16 * 1024)
    return f"{len(sizes)}" + (f" ({small} < 16 kB)" if small else "")


def _med(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def report(results: list[dict], opts: dict, wall_s: float, load: tuple[float, float]) -> str:
    r0 = results[0]
    rows = r0["setups"]
    n_mb, mbs, seq = opts["microbatches"], opts["micro_batch_size"], opts["seq_len"]
    tokens = DP * n_mb * mbs * seq
    floor = next((r for r in rows if r["kind"] == "floor"), None)
    lines = [
        f"shape: {opts['n_layer']} layers, d_model {opts['d_model']}, {opts['n_head']} heads, seq {seq}, "
        f"vocab 257 (table padded to {r0['padded_vocab']}), {r0['params']:,} parameters "
        f"({_fmt_bytes(r0['buffer_bytes'])} of fp32 gradients), fp32; global batch {DP} ranks x {n_mb} "
        f"micro-batches x {mbs} sequences = {tokens:,} tokens/step",
        f"machine: {os.cpu_count()} CPU cores, gloo, torch {torch.__version__}; dp ranks use "
        f"{r0['threads_per_rank']} torch thread(s) each (plus gloo's own threads), the one-process reference "
        f"{opts['ref_threads'] or os.cpu_count()}; 1-min load average at start / end {load[0]:.1f} / {load[1]:.1f}",
        f"gridtrain: {gridtrain_version()}",
        f"timing: {opts['warmup']} warm-up steps, then {opts['repeats']} repeats x {opts['steps']} steps per "
        "setup, interleaved (order reversed every other repeat); medians over repeats",
        "",
        "| setup | buckets | tokens/s | step ms | best step ms | exposed comm ms | gridtrain / DDP tokens/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        t = _med(r["times"])
        exposed = "" if floor is None or r is floor or r["kind"] == "reference" else \
            f"{_med((x - f) * 1e3 for x, f in zip(r['times'], floor['times'])):.1f}"
        ratio = ""
        if r["kind"] == "gridtrain":
            ddp = next(d for d in rows if d["kind"] == "ddp" and d["bucket_mb"] == r["bucket_mb"])
            ratio = f"**{_med(d / g for g, d in zip(r['times'], ddp['times'])):.2f}x**"
        buckets = _buckets(r["buckets"]) if r["kind"] in ("gridtrain", "ddp") else ""
        lines.append(f"| {r['name']} | {buckets} | {tokens / t:,.0f} | {t * 1e3:.1f} | "
                     f"{min(r['times']) * 1e3:.1f} | {exposed} | {ratio} |")
    lines.append("")
    lines.append("exposed comm = step time minus the no-sync floor's, paired per round (median); "
                 "gridtrain / DDP = median of the per-round tokens/s ratios")
    lines.append("tokens/s per repeat:")
    for r in rows:
        lines.append(f"  {r['name']}: " + ", ".join(f"{tokens / t:,.0f}" for t in r["times"]))
    lines.append("")
    for r in rows:
        if r["kind"] in ("gridtrain", "ddp"):
            lines.append(f"{r['name']} bucket bytes: " + ", ".join(f"{x:,}" for x in r["buckets"] or []))
    for idx, r in enumerate(rows):
        if r["kind"] != "gridtrain":
            continue
        per_rank = [res["setups"][idx]["extras"] for res in results]

        def both(key: str, fmt: Callable[[float], str], agg=_med, per_rank=per_rank) -> str:
            return " / ".join(fmt(agg(e[key] for e in ex)) for ex in per_rank)

        pct, ms = (lambda x: f"{100 * x:.0f}%"), (lambda x: f"{x * 1e3:.1f}")
        ratio = " / ".join(f"{100 * sum(e['hidden_s'] for e in ex) / sum(e['in_flight_s'] for e in ex):.0f}%"
                           for ex in per_rank)
        lines.append(f"{r['name']} (per timed step, median; rank 0 / rank 1):")
        lines.append(f"  reducer.stats hidden fraction of this step {both('fraction', pct)} (over all timed "
                     f"steps: {ratio}); bucket in-flight time summed over buckets {both('in_flight_s', ms)} ms, "
                     f"max {both('in_flight_s', ms, max)} ms")
        lines.append(f"  wall clock: all-reduce window (first launch to last completion) {both('window_s', ms)} ms, "
                     f"{both('wall_fraction', pct)} of it before backward ended; time in reducer.finish "
                     f"(exposed wait) {both('finish_s', ms)} ms, max {both('finish_s', ms, max)} ms")
        firsts = [res["setups"][idx]["first_step"] for res in results]
        lines.append("  its first (warm-up) step: reducer.stats hidden " +
                     " / ".join(pct(f["fraction"]) for f in firsts) + ", in flight summed " +
                     " / ".join(ms(f["in_flight_s"]) for f in firsts) + " ms, finish " +
                     " / ".join(ms(f["finish_s"]) for f in firsts) + " ms")
        last = per_rank[0][-1]
        moved = ", ".join(f"{k} {v:,} in {last['calls'].get(k, 0)} call(s)" for k, v in sorted(last["bytes"].items()))
        dp_bytes = sum(v for k, v in last["bytes"].items() if k.endswith("/dp"))
        exp = r0["buffer_bytes"] + 8 + 8
        lines.append(f"  DP payload bytes per step (ByteCounter, rank 0): {moved}; dp total {dp_bytes:,} "
                     f"(expected gradient buffer {r0['buffer_bytes']:,} + token count 8 + loss 8 = {exp:,}: "
                     f"{'match' if dp_bytes == exp else 'MISMATCH'})")
    iso = ", ".join(f"{_fmt_bytes(n)} {ms:.2f} ms" for n, ms in sorted(r0["isolated_ms"].items(), reverse=True))
    lines.append(f"one isolated gloo all-reduce (median of 20, after a barrier): {iso}")
    # loss check: every setup starts from the same weights and trains on the same global batch
    ref = rows[0]["losses"]
    parts = []
    for r in rows[1:]:
        if r["kind"] == "floor":
            continue
        ls = r["losses"]  # rank 0's: every setup that computes a loss runs there
        pairs = [(a, b) for a, b in zip(ref, ls) if a is not None and b is not None]
        parts.append(f"{r['name']} {ls[0]:.6f} (diff {abs(pairs[0][0] - pairs[0][1]):.1e}, "
                     f"largest over {len(pairs)} steps {max(abs(a - b) for a, b in pairs):.1e})")
    firsts = [r["losses"][0] for r in rows if r["kind"] != "floor" and r["losses"]]
    if all(x == ref[0] for x in firsts):
        verdict = "AGREE, bit for bit"
    elif all(abs(x - ref[0]) <= 1e-5 * abs(ref[0]) for x in firsts):
        verdict = "AGREE within 1e-5 relative"
    else:
        verdict = "DISAGREE (more than 1e-5 relative)"
    lines.append(f"loss check, step 1 from the same weights and batch: {verdict}; "
                 f"{rows[0]['name']} {ref[0]:.6f}; " + "; ".join(parts) + f"; last step {ref[-1]:.4f}")
    lines.append("weights after all steps, max |gridtrain - DDP| per bucket size: " +
                 ", ".join(f"{b:g} MiB {d:.1e}" for b, d in zip(opts["bucket_mb"], r0["weight_diffs"])))
    lines.append(f"wall time {wall_s:.0f} s")
    return "\n".join(lines)


def _bucket_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of MiB") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("bucket sizes must be > 0 MiB")
    return values


def parse_args(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_and_timing_arguments(p, steps=3, warmup=3, repeats=8)
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per rank and step (default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch (default: %(default)s)")
    p.add_argument("--bucket-mb", type=_bucket_list, default=[25.0, 0.25],
                   help="comma-separated bucket sizes in MiB, one gridtrain and one DDP setup each "
                        "(default: 25,0.25)")
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help="skip the no-gradient-sync floor (and the exposed-communication column)")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the one-process reference")
    p.add_argument("--ref-threads", type=int, default=0,
                   help="torch threads of the one-process reference (default: every core)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="collective timeout in seconds (default: %(default)s)")
    opts = vars(p.parse_args(argv))
    if opts["warmup"] < 1 or opts["steps"] < 1 or opts["repeats"] < 1 or opts["microbatches"] < 1:
        p.error("--warmup, --steps, --repeats and --microbatches must be >= 1")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    ran = run_benchmark("dp_vs_ddp", _config(opts, opts["bucket_mb"][0]), DP, _worker, opts)
    if ran is None:
        return 2
    results, wall_s, load = ran
    print(report(results, opts, wall_s, load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
