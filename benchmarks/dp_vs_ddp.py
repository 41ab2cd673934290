"""Data parallelism side by side: gridtrain's GradientReducer against torch DistributedDataParallel.

The same Decoder (shape, initial weights, batch, loss, optimizer) is trained for a few steps
on two gloo processes, one data-parallel replica each, in several ways, alternating
inside the same two processes:

* ``gridtrain dp=2``: the real training step, built by ``gridtrain.training.trainer.build`` on a
  config with ``parallel.dp = 2, bucket_mb = B`` (``decoder_model_provider``,
  ``broadcast_parameters``, the one-stage pipeline: a plain gradient-accumulation loop,
  ``GradientReducer(model, ctx.dp, accumulations=m, bucket_mb=B)``, AdamW) and stepped
  with ``Trainer.train_step``: per step the global token count
  (one scalar all-reduce), the micro-batches' forwards and backwards, during which the
  reducer's hooks move each gradient into its fp32 buffer and start a bucket's
  asynchronous all-reduce as soon as its parameters have all received their last
  micro-batch's gradient; then ``finish`` (wait, divide by dp), the global gradient norm
  (``grad_clip = 0``: computed, not applied, to match the other side), AdamW, and the
  mean loss (one scalar all-reduce).
* ``DDP dp=2``: ``torch.nn.parallel.DistributedDataParallel(Decoder(cfg.model),
  bucket_cap_mb=B)`` around gridtrain's own Decoder initialised with ``init_parameters``
  (so the math and the starting weights are identical), the same micro-batches with
  ``no_sync()`` on all but the last, each micro-batch's summed token loss scaled by
  ``1 / tokens per rank`` (= gridtrain's ``dp / global tokens``), AdamW with gridtrain's
  parameter groups, and the mean loss all-reduced for the log (as gridtrain does).
* ``dp=2, no gradient sync``: the same two processes training a plain Decoder on the same
  micro-batches with no collective at all: the compute floor of a dp=2 step on this
  machine. A setup's step time minus this one's (paired per round) is the communication
  it left exposed, whatever its cause (``--no-floor`` skips it).
* ``gridtrain 1 process``: the same ``train_step`` with dp=1 (built on a one-rank grid)
  over all 2m micro-batches of the global batch, on rank 0 with every core, while rank 1 waits in a barrier
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

Timing (benchmarks/common.py): every setup first runs ``--warmup`` untimed steps (DDP
rebuilds its buckets in gradient-ready order after its first step); then ``--repeats`` rounds, each timing
``--steps`` steps of every setup in turn (the order reversed every other round),
between two barriers, with ``time.perf_counter`` on rank 0. Reported: medians over
rounds, the best round, the tokens/s ratio gridtrain / DDP paired per round, the exposed
communication, and for gridtrain, per timed step, the share of its all-reduce time that
its reducer measured as hidden behind backward (``reducer.stats``, reset every step),
the time spent in ``reducer.finish`` (wrapped with a clock;
``gridtrain.optim.grads.reduce_gradients`` calls it after backward) and the DP payload bytes
from its ``ByteCounter``.

Run from the repository root::

    python3 benchmarks/dp_vs_ddp.py          # `small` shape: ~35 s on 2 idle cores
    python3 benchmarks/dp_vs_ddp.py --bucket-mb 0.25,0.26 --no-reference
    python3 benchmarks/dp_vs_ddp.py --d-model 256 --n-layer 8 --bucket-mb 25,1 --steps 2 --repeats 6
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import common  # benchmarks/common.py: the script's own folder is on sys.path
from common import Side, format_bytes, med
from gridtrain.config import Config, ParallelConfig
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.optim.optimizer import build_optimizer
from gridtrain.training.trainer import Trainer

DP = 2


@dataclass(kw_only=True)
class Setup(Side):
    step_fn: Callable[[], tuple[float | None, dict]]  # one step -> (global mean loss, extras)
    kind: str  # "gridtrain", "ddp", "floor", "reference"
    bucket_mb: float | None = None
    losses: list[float | None] = field(default_factory=list)  # every step, warm-up included
    extras: list[dict] = field(default_factory=list)  # per timed step, this rank
    info: dict = field(default_factory=dict)


# ---- the gridtrain side --------------------------------------------------------------------------

def gridtrain_setup(name: str, trainer: Trainer, batches: list[dict], kind: str, **side) -> Setup:
    """``trainer.train_step(batches)`` with ``reducer.finish`` (called by
    ``gridtrain.optim.grads.reduce_gradients`` once backward has ended) timed, and per step the
    reducer's overlap measures and the payload bytes of the ``ByteCounter``."""
    ctx, reducer = trainer.ctx, trainer.reducer
    finish = reducer.finish
    clock = {"finish_s": 0.0}

    def timed_finish() -> None:  # the wait for the buckets still in flight when backward ends
        clock["finish_at"] = began = time.perf_counter()
        finish()
        clock["finish_s"] = time.perf_counter() - began

    reducer.finish = timed_finish  # an instance attribute shadows the method

    def step() -> tuple[float, dict]:
        before, calls_before = dict(ctx.bytes.bytes), dict(ctx.bytes.calls)
        loss = trainer.train_step(batches).loss
        if reducer.dp.size == 1:  # nothing to reduce, nothing to measure
            return loss, {}
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

    s = Setup(name=name, step_fn=step, kind=kind, bucket_mb=trainer.cfg.parallel.bucket_mb, **side)
    element = torch.empty((), dtype=reducer.dtype).element_size()  # (one process: no buffer, autograd's .grad)
    s.info["buckets"] = [(b.end - b.start) * element for b in reducer.buckets]
    s.info["buffer_bytes"] = reducer.padded * element
    return s


# ---- the torch DDP side --------------------------------------------------------------------------

def ddp_setup(cfg: Config, batches: list[dict], n_mb: int, bucket_mb: float, seed: int) -> tuple[Setup, object]:
    gpt = Decoder(cfg.model)
    init_parameters(gpt, seed)
    ddp = DistributedDataParallel(gpt, bucket_cap_mb=bucket_mb)
    opt = build_optimizer(gpt, cfg.optim)
    local_tokens = sum(b["labels"].numel() for b in batches)
    global_tokens = DP * local_tokens

    def step() -> tuple[float, dict]:
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for i, b in enumerate(batches):
            with ddp.no_sync() if i < n_mb - 1 else contextlib.nullcontext():
                summed = ddp(b["tokens"], b["labels"]).sum()  # gridtrain's decoder_forward_step
                (summed * (1.0 / local_tokens)).backward()
            loss_sum += summed.detach().to(torch.float64)  # as gridtrain's pipeline adds it up
        opt.step()
        dist.all_reduce(loss_sum)  # the global mean loss, for the log (gridtrain does the same)
        return float(loss_sum) / global_tokens, {}

    s = Setup(name=f"DDP dp={DP}, {bucket_mb:g} MiB", step_fn=step, kind="ddp", bucket_mb=bucket_mb)
    s.info["ddp"] = ddp
    return s, gpt


def ddp_buckets(ddp: DistributedDataParallel) -> list[int]:
    """DDP's bucket sizes in bytes, after its rebuild (from its own logging data)."""
    data = ddp._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(x) for x in str(sizes).replace(",", " ").split()]


# ---- the compute floor -------------------------------------------------------------------------

def floor_setup(cfg: Config, batches: list[dict], seed: int) -> Setup:
    gpt = Decoder(cfg.model)
    init_parameters(gpt, seed)
    opt = build_optimizer(gpt, cfg.optim)
    local_tokens = sum(b["labels"].numel() for b in batches)

    def step() -> tuple[None, dict]:
        opt.zero_grad(set_to_none=True)
        for b in batches:
            (gpt(b["tokens"], b["labels"]).sum() * (1.0 / local_tokens)).backward()
        opt.step()
        return None, {}

    return Setup(name=f"dp={DP} ranks, no gradient sync (floor)", step_fn=step, kind="floor")


# ---- the worker ----------------------------------------------------------------------------------

def _worker(rank: int, world: int, opts: dict) -> dict:
    n_mb, mbs = opts["microbatches"], opts["micro_batch_size"]
    cfg = _config(opts, opts["bucket_mb"][0])
    everything = common.random_batches(cfg, DP * n_mb * mbs)  # the global batch
    mine = everything[rank * n_mb:(rank + 1) * n_mb]

    setups: list[Setup] = []
    pairs: list[tuple[object, object]] = []  # (gridtrain model, DDP's module) per bucket size
    for b in opts["bucket_mb"]:
        gt = common.build_gpt(_config(opts, b))  # dp=2 grid, its groups and ByteCounter, model, reducer, ...
        dd, dd_model = ddp_setup(cfg, mine, n_mb, b, opts["seed"])
        setups += [gridtrain_setup(f"gridtrain dp={DP}, {b:g} MiB", gt, mine, "gridtrain"), dd]
        pairs.append((gt.model, dd_model))
    if opts["floor"]:
        setups.append(floor_setup(cfg, mine, opts["seed"]))

    # one-process reference: train_step with dp=1 on rank 0, all micro-batches, every core
    if opts["reference"]:
        setups.append(gridtrain_setup("gridtrain 1 process", common.build_gpt_one_process(cfg), everything,
                                      "reference", active=rank == 0, threads=common.reference_threads(opts)))

    def run_block(s: Setup, steps: int, timed: bool = True) -> tuple[float, None]:
        def run() -> None:
            for _ in range(steps):
                loss, extra = s.step_fn()
                s.losses.append(loss)
                if timed:
                    s.extras.append(extra)
                elif len(s.losses) == 1:
                    s.info["first_step"] = extra
        return common.between_barriers(s, run)

    for s in setups:
        run_block(s, opts["warmup"], timed=False)

    # isolated gloo all-reduces: the whole gradient buffer, and one bucket of the smallest size
    def allreduce_ms(nbytes: int) -> float:
        x = torch.zeros(max(1, nbytes // 4))
        return common.isolated_seconds(lambda: dist.all_reduce(x), samples=20) * 1e3

    buffer_bytes = setups[0].info["buffer_bytes"]
    small = int(min(opts["bucket_mb"]) * 2 ** 20)
    isolated = {buffer_bytes: allreduce_ms(buffer_bytes)}
    if small < buffer_bytes:
        isolated[small] = allreduce_ms(small)

    common.timed_rounds(setups, opts, run_block)

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
        "threads_per_rank": torch.get_num_threads(),
        "isolated_ms": isolated,
        "buffer_bytes": buffer_bytes,
        "weight_diffs": weight_diffs,
        "params": sum(p.numel() for p in pairs[0][0].parameters()),
        "padded_vocab": pairs[0][0].padded_vocab,
    }


# ---- parent: configuration and report ---------------------------------------------------------

def _config(opts: dict, bucket_mb: float) -> Config:
    mbs = opts["micro_batch_size"]
    return common.make_config(opts, ParallelConfig(nproc=DP, dp=DP, bucket_mb=bucket_mb), micro_batch_size=mbs,
                              global_batch_size=DP * opts["microbatches"] * mbs)


def _buckets(sizes: list[int] | None) -> str:
    if not sizes:
        return "?"
    small = sum(1 for x in sizes if x < 16 * 1024)
    return f"{len(sizes)}" + (f" ({small} < 16 kB)" if small else "")


def _reducer_lines(r: dict, per_rank: list[list[dict]], firsts: list[dict]) -> list[str]:
    """gridtrain's reducer per timed step (medians, rank 0 / rank 1) and in its first step."""
    def both(key: str, fmt: Callable[[float], str], agg=med) -> str:
        return " / ".join(fmt(agg(e[key] for e in ex)) for ex in per_rank)

    pct, ms = (lambda x: f"{100 * x:.0f}%"), (lambda x: f"{x * 1e3:.1f}")
    ratio = " / ".join(f"{100 * sum(e['hidden_s'] for e in ex) / sum(e['in_flight_s'] for e in ex):.0f}%"
                       for ex in per_rank)
    return [
        f"{r['name']} (per timed step, median; rank 0 / rank 1):",
        f"  reducer.stats hidden fraction of this step {both('fraction', pct)} (over all timed steps: {ratio}); "
        f"bucket in-flight time summed over buckets {both('in_flight_s', ms)} ms, "
        f"max {both('in_flight_s', ms, max)} ms",
        f"  wall clock: all-reduce window (first launch to last completion) {both('window_s', ms)} ms, "
        f"{both('wall_fraction', pct)} of it before backward ended; time in reducer.finish (exposed wait) "
        f"{both('finish_s', ms)} ms, max {both('finish_s', ms, max)} ms",
        "  its first (warm-up) step: reducer.stats hidden " + " / ".join(pct(f["fraction"]) for f in firsts) +
        ", in flight summed " + " / ".join(ms(f["in_flight_s"]) for f in firsts) + " ms, finish " +
        " / ".join(ms(f["finish_s"]) for f in firsts) + " ms",
    ]


def report(run: common.Run, opts: dict) -> str:
    results = run.results
    r0 = results[0]
    rows = r0["setups"]
    n_mb, mbs, seq = opts["microbatches"], opts["micro_batch_size"], opts["seq_len"]
    tokens = DP * n_mb * mbs * seq
    floor = next((r for r in rows if r["kind"] == "floor"), None)
    lines = common.header(
        run, opts,
        shape=f"{opts['n_layer']} layers, d_model {opts['d_model']}, {opts['n_head']} heads, seq {seq}, vocab 257 "
              f"(table padded to {r0['padded_vocab']}), {r0['params']:,} parameters "
              f"({format_bytes(r0['buffer_bytes'])} of fp32 gradients), fp32; global batch {DP} ranks x {n_mb} "
              f"micro-batches x {mbs} sequences = {tokens:,} tokens/step",
        threads=f"gloo; dp ranks use {r0['threads_per_rank']} torch thread(s) each (plus gloo's own threads), "
                f"the one-process reference {common.reference_threads(opts)}")
    lines += ["| setup | buckets | tokens/s | step ms | best step ms | exposed comm ms | gridtrain / DDP tokens/s |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        t = med(r["times"])
        exposed = "" if floor is None or r is floor or r["kind"] == "reference" else \
            f"{med((x - f) * 1e3 for x, f in zip(r['times'], floor['times'])):.1f}"
        ratio = ""
        if r["kind"] == "gridtrain":
            ddp = next(d for d in rows if d["kind"] == "ddp" and d["bucket_mb"] == r["bucket_mb"])
            ratio = f"**{common.paired_ratio(ddp['times'], r['times']):.2f}x**"
        buckets = _buckets(r["buckets"]) if r["kind"] in ("gridtrain", "ddp") else ""
        lines.append(f"| {r['name']} | {buckets} | {tokens / t:,.0f} | {t * 1e3:.1f} | "
                     f"{min(r['times']) * 1e3:.1f} | {exposed} | {ratio} |")
    lines += ["", "exposed comm = step time minus the no-sync floor's, paired per round (median); "
                  "gridtrain / DDP = median of the per-round tokens/s ratios"]
    lines += common.per_round("tokens/s per round:", ((r["name"], r["times"]) for r in rows),
                              lambda t: f"{tokens / t:,.0f}")
    lines.append("")
    for r in rows:
        if r["kind"] in ("gridtrain", "ddp"):
            lines.append(f"{r['name']} bucket bytes: " + ", ".join(f"{x:,}" for x in r["buckets"] or []))
    for idx, r in enumerate(rows):
        if r["kind"] != "gridtrain":
            continue
        lines += _reducer_lines(r, [res["setups"][idx]["extras"] for res in results],
                                [res["setups"][idx]["first_step"] for res in results])
        last = r["extras"][-1]
        moved = ", ".join(f"{k} {v:,} in {last['calls'].get(k, 0)} call(s)" for k, v in sorted(last["bytes"].items()))
        dp_bytes = sum(v for k, v in last["bytes"].items() if k.endswith("/dp"))
        exp = r0["buffer_bytes"] + 8 + 24
        lines.append(f"  DP payload bytes per step (ByteCounter, rank 0): {moved}; dp total {dp_bytes:,} "
                     f"(expected gradient buffer {r0['buffer_bytes']:,} + token count 8 + step scalars 24 = {exp:,}: "
                     f"{'match' if dp_bytes == exp else 'MISMATCH'})")
    iso = ", ".join(f"{format_bytes(n)} {ms:.2f} ms" for n, ms in sorted(r0["isolated_ms"].items(), reverse=True))
    lines.append(f"one isolated gloo all-reduce (median of 20, after a barrier): {iso}")
    lines.append(loss_check(rows))
    lines.append("weights after all steps, max |gridtrain - DDP| per bucket size: " +
                 ", ".join(f"{b:g} MiB {d:.1e}" for b, d in zip(opts["bucket_mb"], r0["weight_diffs"])))
    return "\n".join(lines + common.footer(run))


def loss_check(rows: list[dict]) -> str:
    """Every setup starts from the same weights and trains on the same global batch."""
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
    return (f"loss check, step 1 from the same weights and batch: {verdict}; {rows[0]['name']} {ref[0]:.6f}; "
            + "; ".join(parts) + f"; last step {ref[-1]:.4f}")


def _bucket_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of MiB") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("bucket sizes must be > 0 MiB")
    return values


def parse_args(argv: list[str] | None = None) -> dict:
    p = common.benchmark_parser(__doc__, steps=3, warmup=3, repeats=8)
    common.add_micro_batch_arguments(p, microbatches=4, per="rank and step")
    p.add_argument("--bucket-mb", type=_bucket_list, default=[25.0, 0.25],
                   help="comma-separated bucket sizes in MiB, one gridtrain and one DDP setup each "
                        "(default: 25,0.25)")
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help="skip the no-gradient-sync floor (and the exposed-communication column)")
    return common.parse(p, argv, "microbatches")


def main(argv: list[str] | None = None) -> int:
    return common.benchmark_main("dp_vs_ddp", argv, parse_args,
                                 lambda opts: [_config(opts, b) for b in opts["bucket_mb"]], DP, _worker, report)


if __name__ == "__main__":
    sys.exit(main())
