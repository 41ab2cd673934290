"""Pipeline parallelism side by side: gridtrain's 1F1B runtime against torch.distributed.pipelining.

The same GPT (shape, initial weights, batch, loss, optimizer) is trained for a few steps
on two gloo processes, one pipeline stage each, in several ways, alternating inside the
same two processes:

* ``gridtrain pp=2 1f1b``: the real training step. ``setup_distributed`` on a config with
  ``parallel.pp = 2, schedule = "1f1b"``, ``gpt_model_provider`` (this rank's chunk of
  the GPT: stage 0 the embedding and the first half of the blocks, stage 1 the rest, the
  final LayerNorm and its own copy of the tied token table as the LM head),
  ``build_optimizer``, ``build_pipeline`` and ``gridtrain.train.train_step``: the
  schedule's forwards, backwards and batched point-to-point transfers, the tied
  embedding gradient summed over the first and last stage (one all-reduce), the global
  gradient norm (one scalar all-reduce; clipping is off, ``grad_clip = 0``, to match
  the other side), AdamW, and the mean loss broadcast to every stage.
* ``torch 1F1B``: ``torch.distributed.pipelining``: each rank builds the same stage
  module from gridtrain's own ``GPT(cfg.model, chunks=[ChunkSpec(...)])`` with
  ``init_parameters`` (so the math and the starting weights are identical), wrapped in
  a module whose forward takes one tensor, in ``PipelineStage(module, stage_index,
  num_stages, device)``, driven by ``Schedule1F1B(stage, n_microbatches, loss_fn=...)``:
  ``schedule.step(tokens)`` on stage 0, ``schedule.step(target=labels, losses=...)`` on
  stage 1, then AdamW (gridtrain's parameter groups) on each stage. pipelining has no
  notion of weights shared between stages, so here the LM head is *untied*: it starts
  equal to the token table but is never summed with it (no all-reduce). The losses agree
  with gridtrain at step 1 and drift apart after that (a different model is trained).
* ``torch 1F1B + tied all-reduce``: the same, plus gridtrain's tie done by hand after
  ``schedule.step``: the token-table gradient on stage 0 and the head gradient on stage 1
  are summed with one ``all_reduce``. This is exactly gridtrain's math (the losses must
  agree on every step, to fp32 rounding) and the like-for-like comparison
  (``--no-tied-variant`` skips it).
* ``gridtrain 1 process``: the same ``train_step`` with pp=1 (a plain gradient
  accumulation loop over the same micro-batches) on rank 0 with every core, while rank 1
  waits in a barrier (``--no-reference`` skips it).

A step is: zero grads, 1F1B over ``--microbatches`` micro-batches of
``--micro-batch-size`` sequences (mean token cross entropy over the whole batch), AdamW
(lr 1e-3, betas (0.9, 0.95), weight decay 0.1 on matrices). fp32, no dropout, no LR
schedule, no data loading: the batch is fixed random token ids (same seed everywhere).

Timing: every setup first runs ``--warmup`` untimed steps (torch's first step also infers
the stage shapes); then ``--repeats`` rounds, each timing ``--steps`` steps of every
setup in turn (the order reversed every other round), between two barriers, with
``time.perf_counter`` on rank 0. Reported: medians over rounds, the best round, per
stage the time inside the schedule, the compute part of it (forwards, loss, backwards)
and the rest of the step, the tokens/s ratio to ``torch 1F1B`` paired per round, and per
stage the count, median and total time of each kind of action (F, B, loss, waits on
batched P2P, the tied-embedding all-reduce).

Run from the repository root::

    python3 benchmarks/pp_vs_torch_pipelining.py        # `small` shape: ~30 s on 2 quiet cores
    python3 benchmarks/pp_vs_torch_pipelining.py --d-model 256 --n-layer 8 --steps 2 --repeats 6
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common import add_shape_and_timing_arguments, run_benchmark  # benchmarks/common.py: the script's own folder is on sys.path
from gridtrain.comm import single
from gridtrain.config import Config, ParallelConfig, TrainingConfig, preset_config
from gridtrain.distributed import setup_distributed
from gridtrain.grid import ProcessGrid
from gridtrain.model import GPT, init_parameters
from gridtrain.optim import build_optimizer
from gridtrain.providers import gpt_forward_step, gpt_model_provider
from gridtrain.tensor_parallel import TensorParallel
from gridtrain.train import build_pipeline, train_step

PP = 2


# ---- the torch.distributed.pipelining side ---------------------------------------------------

class OneTensorStage(nn.Module):
    """gridtrain's GPT chunk behind a forward that takes one tensor and returns one.

    Stage 0: token ids [b, s] -> hidden states [b, s, d]. Last stage: hidden states ->
    logits [b, s, vocab] (the padding columns of the table dropped, as gridtrain's loss
    drops them). The loss is the schedule's ``loss_fn``.
    """

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt(x)


def mean_token_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """One micro-batch's mean token loss; the schedule divides gradients by the micro-batch
    count (``scale_grads=True``), so the step's gradient is that of the batch mean, as in
    gridtrain (every micro-batch has the same token count here)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


class ActionClock:
    """What a torch pipelining stage does in a step, timed: its compute (``forward_one_chunk``,
    ``backward_one_chunk``, the loss) and its waits for point-to-point transfers."""

    current: ActionClock | None = None  # the clock of the schedule now stepping (for P2P waits)

    def __init__(self):
        self.busy = 0.0
        self.actions: list[tuple[str, float]] = []

    def reset(self) -> None:
        self.busy, self.actions = 0.0, []

    def wrap(self, kind: str, fn: Callable, busy: bool = True) -> Callable:
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - began
                self.actions.append((kind, took))
                self.busy += took if busy else 0.0
        return timed


def _time_p2p_waits() -> None:
    """Route pipelining's waits on batched P2P work through the stepping stage's clock.
    ``_wait_batch_p2p`` is private to torch.distributed.pipelining.schedules (torch 2.13);
    if it is not there, the P2P line is simply missing from the report."""
    from torch.distributed.pipelining import schedules

    original = getattr(schedules, "_wait_batch_p2p", None)
    if original is None or getattr(original, "_timed", False):
        return

    def timed(work):
        clock = ActionClock.current
        if clock is None or not work:
            return original(work)
        return clock.wrap("P2P", original, busy=False)(work)

    timed._timed = True
    schedules._wait_batch_p2p = timed


# ---- the gridtrain side -----------------------------------------------------------------------

def gridtrain_train_step(model: nn.Module, optimizer, pipeline, ctx, cfg: Config, n_mb: int):
    """``batches -> gridtrain.train.train_step(...)`` for this model, with the gradient
    reducer built as ``pretrain`` builds it."""
    from gridtrain.data_parallel import GradientReducer

    reducer = GradientReducer(model, ctx.dp, accumulations=n_mb, bucket_mb=cfg.parallel.bucket_mb)
    return lambda batches: train_step(model, optimizer, pipeline, reducer, batches, ctx, cfg.training.grad_clip)


# ---- setups ----------------------------------------------------------------------------------

@dataclasses.dataclass
class StepTimes:
    total: float  # this rank's whole step
    schedule: float  # inside the pipeline schedule (pipeline.run / schedule.step)
    busy: float  # of which forward, loss and backward compute
    actions: list[tuple[str, float]]  # (kind, seconds): F, B, loss, P2P waits, gradient reduction


class Setup:
    def __init__(self, name: str, step: Callable[[], tuple[float | None, StepTimes]], *,
                 active: bool = True, threads: int | None = None):
        self.name, self.step_fn, self.active, self.threads = name, step, active, threads
        self.times: list[float] = []  # per round: seconds per step between barriers (rank 0)
        self.rank_phases: list[tuple[float, float, float]] = []  # per round: this rank's means
        self.losses: list[float | None] = []
        self.actions: dict[str, list[float]] = {}  # kind -> durations over the timed steps


def _worker(rank: int, world: int, opts: dict) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    base_threads = torch.get_num_threads()
    cfg = _config(opts)
    m = cfg.model
    n_mb, mbs = opts["microbatches"], opts["micro_batch_size"]
    ctx = setup_distributed(cfg)  # pp=2 grid, its groups (pp, embedding, mp, dp), seeds
    gen = torch.Generator().manual_seed(opts["seed"])
    data = torch.randint(0, m.vocab_size, (n_mb * mbs, m.seq_len + 1), generator=gen)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    batches = [{"tokens": tokens[i * mbs:(i + 1) * mbs], "labels": labels[i * mbs:(i + 1) * mbs]}
               for i in range(n_mb)]
    notes: list[str] = []
    setups: list[Setup] = []

    # (a) gridtrain pp=2, 1f1b: its provider, optimizer, pipeline and training step
    gt_model = gpt_model_provider(cfg, ctx)
    gt_opt = build_optimizer(gt_model, cfg.training)
    gt_pipe = build_pipeline(gt_model, cfg, ctx, gpt_forward_step, n_mb)
    gt_pipe.tracing = True  # StageStats.trace: (action, start, end) of every action, cheap
    gt_train_step = gridtrain_train_step(gt_model, gt_opt, gt_pipe, ctx, cfg, n_mb)
    spec = gt_model.chunks[0]  # this rank's blocks, and whether it embeds / ends
    gt_bytes: dict = {}

    def gridtrain_step() -> tuple[float | None, StepTimes]:
        before = dict(ctx.bytes.bytes)
        began = time.perf_counter()
        loss, _, stats = gt_train_step(batches)
        total = time.perf_counter() - began
        gt_bytes.clear()
        gt_bytes.update({f"{k}/{g}": n - before.get((k, g), 0) for (k, g), n in ctx.bytes.bytes.items()
                         if n - before.get((k, g), 0)})
        return loss, StepTimes(total, stats.wall_s, stats.busy_s, _gridtrain_actions(stats.trace))

    setups.append(Setup(f"gridtrain pp={PP} 1f1b", gridtrain_step))

    # (b) torch.distributed.pipelining, Schedule1F1B, same stage modules and weights
    def torch_setup(name: str, tie: bool) -> Setup:
        gpt = GPT(m, chunks=[spec])
        init_parameters(gpt, opts["seed"])  # the last stage's head starts as the token table
        module = OneTensorStage(gpt)
        opt = build_optimizer(module, cfg.training)
        stage = PipelineStage(module, rank, PP, torch.device("cpu"))
        clock = ActionClock()
        stage.forward_one_chunk = clock.wrap("F", stage.forward_one_chunk)
        stage.backward_one_chunk = clock.wrap("B", stage.backward_one_chunk)
        schedule = Schedule1F1B(stage, n_mb, loss_fn=clock.wrap("loss", mean_token_cross_entropy))
        tied = gpt.embedding.word.weight if spec.pre_process else gpt.head
        first, last = spec.pre_process, spec.post_process

        def step() -> tuple[float | None, StepTimes]:
            began = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            clock.reset()
            losses: list[torch.Tensor] = []
            ActionClock.current = clock
            t0 = time.perf_counter()
            try:
                if first:
                    schedule.step(tokens, return_outputs=False)
                else:
                    schedule.step(target=labels, losses=losses, return_outputs=False)
            finally:
                ActionClock.current = None
            t1 = time.perf_counter()
            if tie:  # gridtrain's tied embedding: sum the two copies' gradients
                dist.all_reduce(tied.grad)
                clock.actions.append(("tied all-reduce", time.perf_counter() - t1))
            opt.step()
            total = time.perf_counter() - began
            loss = float(torch.stack(losses).detach().mean()) if last else None
            return loss, StepTimes(total, t1 - t0, clock.busy, clock.actions)

        return Setup(name, step)

    torch_setups: list[Setup] = []
    _time_p2p_waits()
    try:  # building the stages communicates nothing; their first step infers the shapes
        torch_setups.append(torch_setup("torch 1F1B (untied head)", tie=False))
        if opts["tied_variant"]:
            torch_setups.append(torch_setup("torch 1F1B + tied all-reduce", tie=True))
    except Exception:  # noqa: BLE001 -- record it; the report says so
        notes.append(f"rank {rank}: torch.distributed.pipelining setup failed, its setups are skipped:\n"
                     + traceback.format_exc(limit=4))
        torch_setups = []
    built = torch.tensor([int(bool(torch_setups))])
    dist.all_reduce(built, op=dist.ReduceOp.MIN)  # both ranks keep the same list of setups
    if int(built):
        setups += torch_setups

    # (c) one-process reference: gridtrain's train_step with pp=1 on rank 0, every core
    if opts["reference"]:
        cfg1 = replace(cfg, parallel=ParallelConfig(nproc=1, pp=1))
        # A one-rank context: the grid is 1 x 1 x 1 and every group is the identity, so
        # train_step runs without collectives while rank 1 waits in the barrier.
        ctx1 = replace(ctx, grid=ProcessGrid.build(1), rank=0, tp=TensorParallel(), dp=single("dp"),
                       mp=single("mp"), pp=single("pp"), embedding=None)
        ref_model = gpt_model_provider(cfg1, ctx1)
        ref_opt = build_optimizer(ref_model, cfg1.training)
        ref_pipe = build_pipeline(ref_model, cfg1, ctx1, gpt_forward_step, n_mb)
        ref_train_step = gridtrain_train_step(ref_model, ref_opt, ref_pipe, ctx1, cfg1, n_mb)

        def reference_step() -> tuple[float | None, StepTimes]:
            began = time.perf_counter()
            loss, _, stats = ref_train_step(batches)
            return loss, StepTimes(time.perf_counter() - began, stats.wall_s, stats.busy_s, [])

        cores = opts["ref_threads"] or os.cpu_count() or 1
        setups.append(Setup("gridtrain 1 process", reference_step, active=rank == 0, threads=cores))

    def run_block(s: Setup, steps: int, timed: bool = True) -> tuple[float, tuple[float, float, float]]:
        torch.set_num_threads(s.threads or base_threads)
        sums = [0.0, 0.0, 0.0]
        dist.barrier()
        start = time.perf_counter()
        if s.active:
            for _ in range(steps):
                loss, t = s.step_fn()
                s.losses.append(loss)
                sums[0] += t.total
                sums[1] += t.schedule
                sums[2] += t.busy
                for kind, took in t.actions if timed else ():
                    s.actions.setdefault(kind, []).append(took)
        dist.barrier()
        elapsed = time.perf_counter() - start
        torch.set_num_threads(base_threads)
        return elapsed, (sums[0] / steps, sums[1] / steps, sums[2] / steps)

    for s in setups:
        run_block(s, opts["warmup"], timed=False)
    warm_bytes = dict(gt_bytes)  # gridtrain's counted payload of its last warm-up step

    # the cost of one activation-sized point-to-point message, for the reading
    x = torch.randn(mbs, m.seq_len, m.d_model)
    samples = []
    for _ in range(30):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
        samples.append((time.perf_counter() - t0) / 2)
    p2p_s = statistics.median(samples)

    for r in range(opts["repeats"]):
        for s in (setups if r % 2 == 0 else setups[::-1]):
            elapsed, phases = run_block(s, opts["steps"])
            s.times.append(elapsed / opts["steps"])
            s.rank_phases.append(phases)

    return {
        "setups": [{"name": s.name, "times": s.times, "phases": s.rank_phases, "losses": s.losses,
                    "active": s.active, "actions": s.actions} for s in setups],
        "notes": notes,
        "threads_per_rank": base_threads,
        "p2p_s": p2p_s,
        "gridtrain_bytes": warm_bytes,
        "layers": list(spec.layer_ids),
        "padded_vocab": gt_model.padded_vocab,
    }


def _gridtrain_actions(trace: list[tuple[str, float, float]]) -> list[tuple[str, float]]:
    """gridtrain's trace as (kind, seconds): F, B, W, P2P (a batch of sends and receives,
    waited for as a whole), ALLREDUCE_GRADS (here: the tied-embedding all-reduce)."""
    out = []
    for name, began, ended in trace:
        kind = name if name in ("P2P", "ALLREDUCE_GRADS") else name[0]
        out.append((kind, ended - began))
    return out


# ---- parent: configuration and report ---------------------------------------------------------

def _config(opts: dict) -> Config:
    cfg = preset_config("small")
    cfg.model = replace(cfg.model, n_layer=opts["n_layer"], d_model=opts["d_model"],
                        n_head=opts["n_head"], seq_len=opts["seq_len"], dropout=0.0)
    cfg.parallel = ParallelConfig(nproc=PP, pp=PP, schedule="1f1b")
    n = opts["microbatches"] * opts["micro_batch_size"]
    cfg.training = TrainingConfig(steps=100, warmup_steps=1, micro_batch_size=opts["micro_batch_size"],
                                  global_batch_size=n, seed=opts["seed"], dtype="fp32", device="cpu",
                                  grad_clip=0.0, dist_timeout_s=opts["timeout"], progress=False)
    return cfg


def _merge(results: list[dict]) -> list[dict]:
    """Per setup: rank 0's timings, both ranks' phase splits, the loss from whichever rank has it."""
    rows = []
    for per_rank in zip(*(r["setups"] for r in results)):
        r0 = per_rank[0]
        losses = [next((x[i] for x in (p["losses"] for p in per_rank) if i < len(x) and x[i] is not None),
                       None) for i in range(max(len(p["losses"]) for p in per_rank))]
        rows.append({"name": r0["name"], "times": r0["times"], "losses": losses,
                     "phases": [p["phases"] for p in per_rank if p["active"]],
                     "actions": [p["actions"] for p in per_rank if p["active"]]})
    return rows


def gridtrain_version() -> str:
    """The commit of the gridtrain being measured, and whether its files have local edits
    (read-only git queries; "unknown" outside a checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "gridtrain"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" with uncommitted changes under gridtrain/" if dirty else "")


def report(results: list[dict], opts: dict, wall_s: float, load: tuple[float, float]) -> str:
    r0 = results[0]
    rows = _merge(results)
    n_mb, mbs, seq = opts["microbatches"], opts["micro_batch_size"], opts["seq_len"]
    tokens = n_mb * mbs * seq
    layers = [res["layers"] for res in results]
    lines = [
        f"shape: {opts['n_layer']} layers, d_model {opts['d_model']}, {opts['n_head']} heads, seq {seq}, "
        f"vocab 257 (table padded to {r0['padded_vocab']}), fp32; {n_mb} micro-batches of {mbs} "
        f"sequences = {tokens} tokens/step; stage 0: embedding + blocks {layers[0]}, stage 1: blocks "
        f"{layers[1]} + final norm + head + loss",
        f"machine: {os.cpu_count()} CPU cores, gloo, torch {torch.__version__}; pipeline ranks use "
        f"{r0['threads_per_rank']} thread(s) each, the one-process reference "
        f"{opts['ref_threads'] or os.cpu_count()}; 1-min load average at start / end {load[0]:.1f} / {load[1]:.1f}",
        f"gridtrain: {gridtrain_version()}; train_step{inspect.signature(train_step)}",
        f"timing: {opts['warmup']} warm-up steps, then {opts['repeats']} repeats x {opts['steps']} steps per "
        "setup, interleaved (order reversed every other repeat); medians over repeats",
        "",
    ]
    base = next((r for r in rows if r["name"].startswith("torch 1F1B")), rows[0])
    lines += [f"| setup | tokens/s | step ms | best step ms | stage 0: schedule / compute / rest ms "
              f"| stage 1: schedule / compute / rest ms | vs {base['name']} |",
              "| --- | ---: | ---: | ---: | --- | --- | ---: |"]
    for r in rows:
        t = statistics.median(r["times"])
        ratio = statistics.median(b / x for b, x in zip(base["times"], r["times"]))
        cells = []
        for ph in r["phases"]:
            total, sched, busy = (statistics.median(p[i] for p in ph) * 1e3 for i in range(3))
            cells.append(f"{sched:.1f} / {busy:.1f} / {total - sched:.1f}")
        while len(cells) < 2:
            cells.append("(idle)")
        lines.append(f"| {r['name']} | {tokens / t:,.0f} | {t * 1e3:.1f} | {min(r['times']) * 1e3:.1f} | "
                     f"{cells[0]} | {cells[1]} | {ratio:.2f}x |")
    lines.append("")
    for r in rows:
        if r["name"].startswith("torch"):
            gt = rows[0]
            paired = statistics.median(x / g for g, x in zip(gt["times"], r["times"]))
            lines.append(f"ratio {gt['name']} / {r['name']} (tokens/s): {paired:.2f}x median of the per-round "
                         f"ratios, {min(r['times']) / min(gt['times']):.2f}x best round vs best round")
    lines.append("schedule = inside pipeline.run / schedule.step; compute = forwards, loss and backwards in "
                 "it (the rest of the schedule is waiting and transfers); rest = the step outside the "
                 "schedule (zero_grad, token count, tied all-reduce where done by hand, grad norm, AdamW, "
                 "loss broadcast)")
    lines.append("tokens/s per repeat:")
    for r in rows:
        lines.append(f"  {r['name']}: " + ", ".join(f"{tokens / t:,.0f}" for t in r["times"]))
    lines.append("")
    for r in rows:
        if len(r["phases"]) == PP:
            idle = []
            for ph in r["phases"]:
                sched = statistics.median(p[1] for p in ph)
                busy = statistics.median(p[2] for p in ph)
                idle.append(f"{100 * (1 - busy / sched):.0f}%")
            lines.append(f"{r['name']}: idle share of the schedule per stage {' / '.join(idle)} "
                         f"(1F1B's bubble alone: (p-1)/(m+p-1) = {100 * (PP - 1) / (n_mb + PP - 1):.0f}% "
                         "with equal stages)")
    timed_steps = opts["repeats"] * opts["steps"]
    lines.append("per stage and step (timed steps): count x median ms = total ms of each kind of action")
    order = ("F", "loss", "B", "W", "P2P", "ALLREDUCE_GRADS", "tied all-reduce")
    for r in rows:
        for stage, acts in enumerate(r["actions"]):
            if not acts:
                continue
            cells = [f"{k} {len(acts[k]) / timed_steps:.0f} x {statistics.median(acts[k]) * 1e3:.2f} = "
                     f"{sum(acts[k]) / timed_steps * 1e3:.1f}" for k in sorted(acts, key=order.index)]
            lines.append(f"  {r['name']}, stage {stage}: " + "; ".join(cells))
    act = mbs * seq * opts["d_model"] * 4
    moved = ", ".join(f"{k} {v:,}" for k, v in sorted(r0["gridtrain_bytes"].items()))
    lines.append(f"gridtrain payload bytes/step on rank 0 (ByteCounter): {moved}; expected pp sends "
                 f"{n_mb} x {act:,} = {n_mb * act:,} per stage; torch pipelining moves the same activations "
                 "and gradients")
    lines.append(f"one gloo send of a [{mbs}, {seq}, {opts['d_model']}] activation ({act / 2**20:.2f} MiB): "
                 f"{r0['p2p_s'] * 1e3:.2f} ms one way (median of 30 ping-pongs, after a barrier)")
    ref = rows[0]["losses"]
    parts = []
    for r in rows[1:]:
        pairs = [(a, b) for a, b in zip(ref, r["losses"]) if a is not None and b is not None]
        if pairs:
            parts.append(f"{r['name']} {r['losses'][0]:.6f} (diff {abs(pairs[0][0] - pairs[0][1]):.1e}; "
                         f"largest over {len(pairs)} steps {max(abs(a - b) for a, b in pairs):.1e})")
    lines.append("; ".join([f"loss check, step 1 from the same weights and batch: {rows[0]['name']} {ref[0]:.6f}",
                            *parts, f"last step {ref[-1]:.4f}"]))
    for note in (n for res in results for n in res["notes"]):
        lines.append("NOTE " + note.rstrip())
    lines.append(f"wall time {wall_s:.0f} s")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_and_timing_arguments(p, steps=3, warmup=3, repeats=10)
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch (default: %(default)s)")
    p.add_argument("--no-tied-variant", dest="tied_variant", action="store_false",
                   help="skip torch pipelining with the tied-embedding all-reduce done by hand")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the one-process reference")
    p.add_argument("--ref-threads", type=int, default=0,
                   help="torch threads of the one-process reference (default: every core)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="collective timeout in seconds (default: %(default)s)")
    opts = vars(p.parse_args(argv))
    if opts["warmup"] < 1 or opts["steps"] < 1 or opts["repeats"] < 1:
        p.error("--warmup, --steps and --repeats must be >= 1")
    if opts["microbatches"] < PP:
        p.error(f"--microbatches must be >= {PP} (Schedule1F1B needs at least one per stage)")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    ran = run_benchmark("pp_vs_torch_pipelining", _config(opts), PP, _worker, opts)
    if ran is None:
        return 2
    results, wall_s, load = ran
    print(report(results, opts, wall_s, load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
