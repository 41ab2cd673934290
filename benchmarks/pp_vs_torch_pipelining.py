"""Pipeline parallelism side by side: gridtrain's 1F1B runtime against torch.distributed.pipelining.

The same Decoder (shape, initial weights, batch, loss, optimizer) is trained for a few steps
on two gloo processes, one pipeline stage each, in several ways, alternating inside the
same two processes:

* ``gridtrain pp=2 1f1b``: the real training step, built by ``gridtrain.training.trainer.build``
  (``decoder_model_provider``: this rank's chunk of the Decoder, stage 0 the embedding and the
  first half of the blocks, stage 1 the rest, the final LayerNorm and its own copy of
  the tied token table as the LM head; ``decoder_forward_step``) on a config with
  ``parallel.pp = 2, schedule = "1f1b"`` and stepped with ``Trainer.train_step``: the
  schedule's forwards, backwards and batched point-to-point transfers, the tied
  embedding gradient summed over the first and last stage (one all-reduce), the global
  gradient norm (one scalar all-reduce; clipping is off, ``grad_clip = 0``, to match
  the other side), AdamW, and the mean loss broadcast to every stage.
* ``torch 1F1B``: ``torch.distributed.pipelining``: each rank builds the same stage
  module from gridtrain's own ``Decoder(cfg.model, chunks=[ChunkSpec(...)])`` with
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
* ``gridtrain 1 process``: the same ``train_step`` with pp=1, built on a one-rank grid (a
  plain gradient accumulation loop over the same micro-batches), on rank 0 with every
  core, while rank 1 waits in a barrier (``--no-reference`` skips it).

A step is: zero grads, 1F1B over ``--microbatches`` micro-batches of
``--micro-batch-size`` sequences (mean token cross entropy over the whole batch), AdamW
(lr 1e-3, betas (0.9, 0.95), weight decay 0.1 on matrices). fp32, no dropout, no LR
schedule, no data loading: the batch is fixed random token ids (same seed everywhere).

Timing (benchmarks/common.py): every setup first runs ``--warmup`` untimed steps
(torch's first step also infers the stage shapes); then ``--repeats`` rounds, each timing ``--steps`` steps of every
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

import dataclasses
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import common  # benchmarks/common.py: the script's own folder is on sys.path
from common import Side, med, mib
from gridtrain.config import Config, ParallelConfig
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.optim.optimizer import build_optimizer

PP = 2


# ---- the torch.distributed.pipelining side ---------------------------------------------------

class OneTensorStage(nn.Module):
    """gridtrain's Decoder chunk behind a forward that takes one tensor and returns one.

    Stage 0: token ids [b, s] -> hidden states [b, s, d]. Last stage: hidden states ->
    logits [b, s, vocab] (the padding columns of the table dropped, as gridtrain's loss
    drops them). The loss is the schedule's ``loss_fn``.
    """

    def __init__(self, gpt: Decoder):
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


# ---- setups ----------------------------------------------------------------------------------

@dataclasses.dataclass
class StepTimes:
    total: float  # this rank's whole step
    schedule: float  # inside the pipeline schedule (pipeline.run / schedule.step)
    busy: float  # of which forward, loss and backward compute
    actions: list[tuple[str, float]]  # (kind, seconds): F, B, loss, P2P waits, gradient reduction


@dataclasses.dataclass(kw_only=True)
class Setup(Side):
    step_fn: Callable[[], tuple[float | None, StepTimes]]
    losses: list[float | None] = dataclasses.field(default_factory=list)
    actions: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # kind -> durations, timed steps
    # Side.rounds: per round, this rank's (total, schedule, busy) seconds per step


def gridtrain_setup(name: str, trainer, batches: list[dict], moved: dict | None = None, **side) -> Setup:
    """``trainer.train_step(batches)``, timed: the step, the schedule (``StageStats.wall_s``),
    its compute (``busy_s``) and every action (``StageStats.trace``); ``moved`` receives the
    payload bytes of the last step by "kind/group" (from the ``ByteCounter``)."""
    trainer.pipeline.tracing = True  # StageStats.trace: (action, start, end) of every action, cheap
    counter = trainer.ctx.bytes

    def step() -> tuple[float | None, StepTimes]:
        before = dict(counter.bytes)
        began = time.perf_counter()
        out = trainer.train_step(batches)
        total = time.perf_counter() - began
        if moved is not None:
            moved.clear()
            moved.update({f"{k}/{g}": n - before.get((k, g), 0) for (k, g), n in counter.bytes.items()
                          if n - before.get((k, g), 0)})
        return out.loss, StepTimes(total, out.stage.wall_s, out.stage.busy_s, _gridtrain_actions(out.stage.trace))

    return Setup(name=name, step_fn=step, **side)


def _gridtrain_actions(trace: list[tuple[str, float, float]]) -> list[tuple[str, float]]:
    """gridtrain's trace as (kind, seconds): F, B, W, P2P (a batch of sends and receives,
    waited for as a whole), ALLREDUCE_GRADS (here: the tied-embedding all-reduce)."""
    return [(name if name in ("P2P", "ALLREDUCE_GRADS") else name[0], ended - began)
            for name, began, ended in trace]


def _worker(rank: int, world: int, opts: dict) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    cfg = _config(opts)
    m = cfg.model
    n_mb, mbs = opts["microbatches"], opts["micro_batch_size"]
    batches = common.random_batches(cfg, n_mb * mbs)
    tokens, labels = torch.cat([b["tokens"] for b in batches]), torch.cat([b["labels"] for b in batches])
    notes: list[str] = []

    # (a) gridtrain pp=2, 1f1b: pp=2 grid and its groups (pp, embedding, mp, dp), this rank's
    # chunk, pipeline, reducer and optimizer, built as pretrain builds them
    gt = common.build_gpt(cfg)
    spec = gt.model.chunks[0]  # this rank's blocks, and whether it embeds / ends
    gt_bytes: dict = {}
    setups = [gridtrain_setup(f"gridtrain pp={PP} 1f1b", gt, batches, gt_bytes)]

    # (b) torch.distributed.pipelining, Schedule1F1B, same stage modules and weights
    def torch_setup(name: str, tie: bool) -> Setup:
        gpt = Decoder(m, chunks=[spec])
        init_parameters(gpt, opts["seed"])  # the last stage's head starts as the token table
        module = OneTensorStage(gpt)
        opt = build_optimizer(module, cfg.optim)
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

        return Setup(name=name, step_fn=step)

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
        setups.append(gridtrain_setup("gridtrain 1 process", common.build_gpt_one_process(cfg), batches,
                                      active=rank == 0, threads=common.reference_threads(opts)))

    def run_block(s: Setup, steps: int, timed: bool = True) -> tuple[float, tuple[float, float, float]]:
        def run() -> tuple[float, float, float]:
            sums = [0.0, 0.0, 0.0]
            for _ in range(steps):
                loss, t = s.step_fn()
                s.losses.append(loss)
                sums = [sums[0] + t.total, sums[1] + t.schedule, sums[2] + t.busy]
                for kind, took in t.actions if timed else ():
                    s.actions.setdefault(kind, []).append(took)
            return sums[0] / steps, sums[1] / steps, sums[2] / steps
        return common.between_barriers(s, run)

    for s in setups:
        run_block(s, opts["warmup"], timed=False)
    warm_bytes = dict(gt_bytes)  # gridtrain's counted payload of its last warm-up step

    # the cost of one activation-sized point-to-point message, for the reading
    x = torch.randn(mbs, m.seq_len, m.d_model)

    def ping_pong() -> None:
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)

    p2p_s = common.isolated_seconds(ping_pong) / 2
    common.timed_rounds(setups, opts, run_block)
    return {
        "setups": [{"name": s.name, "times": s.times, "phases": s.rounds, "losses": s.losses,
                    "active": s.active, "actions": s.actions} for s in setups],
        "notes": notes,
        "threads_per_rank": torch.get_num_threads(),
        "p2p_s": p2p_s,
        "gridtrain_bytes": warm_bytes,
        "layers": list(spec.layer_ids),
        "padded_vocab": gt.model.padded_vocab,
    }


# ---- parent: configuration and report ---------------------------------------------------------

def _config(opts: dict) -> Config:
    mbs = opts["micro_batch_size"]
    return common.make_config(opts, ParallelConfig(nproc=PP, pp=PP, schedule="1f1b"), micro_batch_size=mbs,
                              global_batch_size=opts["microbatches"] * mbs)


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


def report(run: common.Run, opts: dict) -> str:
    results = run.results
    r0 = results[0]
    rows = _merge(results)
    n_mb, mbs, seq = opts["microbatches"], opts["micro_batch_size"], opts["seq_len"]
    tokens = n_mb * mbs * seq
    layers = [res["layers"] for res in results]
    lines = common.header(
        run, opts,
        shape=f"{opts['n_layer']} layers, d_model {opts['d_model']}, {opts['n_head']} heads, seq {seq}, vocab 257 "
              f"(table padded to {r0['padded_vocab']}), fp32; {n_mb} micro-batches of {mbs} sequences = {tokens} "
              f"tokens/step; stage 0: embedding + blocks {layers[0]}, stage 1: blocks {layers[1]} + final norm + "
              "head + loss",
        threads=f"gloo; pipeline ranks use {r0['threads_per_rank']} thread(s) each, the one-process reference "
                f"{common.reference_threads(opts)}")
    base = next((r for r in rows if r["name"].startswith("torch 1F1B")), rows[0])
    lines += [f"| setup | tokens/s | step ms | best step ms | stage 0: schedule / compute / rest ms "
              f"| stage 1: schedule / compute / rest ms | vs {base['name']} |",
              "| --- | ---: | ---: | ---: | --- | --- | ---: |"]
    for r in rows:
        t = med(r["times"])
        cells = []
        for ph in r["phases"]:
            total, sched, busy = (med(p[i] for p in ph) * 1e3 for i in range(3))
            cells.append(f"{sched:.1f} / {busy:.1f} / {total - sched:.1f}")
        while len(cells) < 2:
            cells.append("(idle)")
        lines.append(f"| {r['name']} | {tokens / t:,.0f} | {t * 1e3:.1f} | {min(r['times']) * 1e3:.1f} | "
                     f"{cells[0]} | {cells[1]} | {common.paired_ratio(base['times'], r['times']):.2f}x |")
    lines.append("")
    gt = rows[0]
    for r in rows:
        if r["name"].startswith("torch"):
            lines.append(f"ratio {gt['name']} / {r['name']} (tokens/s): "
                         f"{common.paired_ratio(r['times'], gt['times']):.2f}x median of the per-round "
                         f"ratios, {min(r['times']) / min(gt['times']):.2f}x best round vs best round")
    lines.append("schedule = inside pipeline.run / schedule.step; compute = forwards, loss and backwards in "
                 "it (the rest of the schedule is waiting and transfers); rest = the step outside the "
                 "schedule (zero_grad, token count, tied all-reduce where done by hand, grad norm, AdamW, "
                 "loss broadcast)")
    lines += common.per_round("tokens/s per round:", ((r["name"], r["times"]) for r in rows),
                              lambda t: f"{tokens / t:,.0f}")
    lines.append("")
    for r in rows:
        if len(r["phases"]) == PP:
            idle = [f"{100 * (1 - med(p[2] for p in ph) / med(p[1] for p in ph)):.0f}%" for ph in r["phases"]]
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
            cells = [f"{k} {len(acts[k]) / timed_steps:.0f} x {med(acts[k]) * 1e3:.2f} = "
                     f"{sum(acts[k]) / timed_steps * 1e3:.1f}" for k in sorted(acts, key=order.index)]
            lines.append(f"  {r['name']}, stage {stage}: " + "; ".join(cells))
    act = mbs * seq * opts["d_model"] * 4
    moved = ", ".join(f"{k} {v:,}" for k, v in sorted(r0["gridtrain_bytes"].items()))
    lines.append(f"gridtrain payload bytes/step on rank 0 (ByteCounter): {moved}; expected pp sends "
                 f"{n_mb} x {act:,} = {n_mb * act:,} per stage; torch pipelining moves the same activations "
                 "and gradients")
    lines.append(f"one gloo send of a [{mbs}, {seq}, {opts['d_model']}] activation ({mib(act)}): "
                 f"{r0['p2p_s'] * 1e3:.2f} ms one way (median of 30 ping-pongs, after a barrier)")
    ref = gt["losses"]
    parts = []
    for r in rows[1:]:
        pairs = [(a, b) for a, b in zip(ref, r["losses"]) if a is not None and b is not None]
        if pairs:
            parts.append(f"{r['name']} {r['losses'][0]:.6f} (diff {abs(pairs[0][0] - pairs[0][1]):.1e}; "
                         f"largest over {len(pairs)} steps {max(abs(a - b) for a, b in pairs):.1e})")
    lines.append("; ".join([f"loss check, step 1 from the same weights and batch: {gt['name']} {ref[0]:.6f}",
                            *parts, f"last step {ref[-1]:.4f}"]))
    return "\n".join(lines + common.footer(run, (n for res in results for n in res["notes"])))


def parse_args(argv: list[str] | None = None) -> dict:
    p = common.benchmark_parser(__doc__, steps=3, warmup=3, repeats=10)
    common.add_micro_batch_arguments(p, microbatches=8)
    p.add_argument("--no-tied-variant", dest="tied_variant", action="store_false",
                   help="skip torch pipelining with the tied-embedding all-reduce done by hand")
    opts = common.parse(p, argv)
    if opts["microbatches"] < PP:
        p.error(f"--microbatches must be >= {PP} (Schedule1F1B needs at least one per stage)")
    return opts


def main(argv: list[str] | None = None) -> int:
    return common.benchmark_main("pp_vs_torch_pipelining", argv, parse_args, lambda opts: [_config(opts)], PP,
                                 _worker, report)


if __name__ == "__main__":
    sys.exit(main())
