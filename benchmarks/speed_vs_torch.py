"""End to end, as a user runs it: ``gridtrain train`` against PyTorch's own implementations written plainly.

Four comparisons, each a whole training run on each side, on the same Decoder shape (default:
4 layers, d_model 128, 4 heads, seq 128, vocabulary 257; the `small` preset), global batch
16 sequences in micro-batches of 4, fp32, CPU, gloo, dropout 0:

1. ``plain``: a plain PyTorch loop in one process vs ``gridtrain train --nproc 1``;
2. ``ddp``: ``DistributedDataParallel`` with ``no_sync`` accumulation, dp 2, vs
   ``gridtrain train --nproc 2`` (dp 2);
3. ``pp``: ``torch.distributed.pipelining`` ``Schedule1F1B``, pp 2, vs
   ``gridtrain train --nproc 2 --pp 2 --schedule 1f1b``;
4. ``tp``: DTensor tensor parallelism (``ColwiseParallel`` / ``RowwiseParallel``), tp 2,
   vs ``gridtrain train --nproc 2 --tp 2``.

gridtrain's side is the command line a user types, run as a subprocess::

    python -m gridtrain train --n-layer 4 --d-model 128 --n-head 4 --seq-len 128 --vocab-size 257
        --global-batch-size 16 --micro-batch-size 4 --dtype fp32 --device cpu --dropout 0 --steps N
        --eval-interval 0 --eval-iters 1 --no-progress --sample-tokens 0 --metrics-file F [layout flags]

on the built-in corpus (its step time includes reading each batch), with its default
recipe: AdamW (lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices and
embeddings), warm-up + cosine learning rate, gradients clipped to norm 1.0. Its
throughput is the median ``tokens_per_s`` of the metrics file's rows after ``--warmup``
steps.

Each peer is a full training loop in its own processes: this script with ``--peer NAME``,
in one process for ``plain`` and under ``python -m torch.distributed.run --standalone
--nproc-per-node 2`` for the others, each rank with ``cpu_count / world`` torch threads as
gridtrain's workers have. Same model shape and starting weights (gridtrain's
``init_parameters``), same recipe: ``torch.optim.AdamW`` as a user writes it (torch's
default implementation; no ``fused`` or ``foreach`` flag) with gridtrain's parameter
groups and hyper-parameters, ``LambdaLR`` over gridtrain's ``lr_at``, and the gradients
clipped to norm 1.0 (``clip_grad_norm_``; see ``pp`` and ``tp`` for the split models). Data: fixed random token ids (``common.random_batches``, a different global batch
every step), built before the loop, so the peers read no data at all. Per step: the
micro-batches' forwards and backwards with gradient accumulation (mean token cross
entropy over the global batch), clip, ``optimizer.step``, the LR scheduler,
``zero_grad``, and the loss read to the host once (as a loop that logs does). Each step
is timed with ``time.perf_counter`` on rank 0, no barrier; throughput = 16 x seq tokens
/ step time, median over the steps after ``--warmup``.

* ``plain``: gridtrain's ``Decoder`` used as a plain ``nn.Module`` (one process, tp 1), the
  per-token losses summed and scaled by 1 / global tokens, ``loss.backward()`` per
  micro-batch. ``--peer-model plain`` puts ``PlainGPT`` of benchmarks/tp_vs_dtensor.py
  (the same weights) in its place, here and in ``ddp``.
* ``ddp``: ``DistributedDataParallel(Decoder)`` (default 25 MiB buckets, as gridtrain's
  ``--bucket-mb``); rank r trains micro-batches 2r, 2r+1 of the global batch; the loss is
  all-reduced for the log (gridtrain does the same).
* ``pp``: gridtrain's ``Decoder`` chunk of each stage (stage 0: embedding + blocks 0-1,
  stage 1: blocks 2-3 + final norm + head, as gridtrain's uniform partition) behind
  ``OneTensorStage`` (benchmarks/pp_vs_torch_pipelining.py), ``Schedule1F1B`` over 4
  micro-batches; gridtrain's tied embedding done by hand (the token-table and head
  gradients summed with one ``all_reduce``); the clipping norm summed over both stages
  (the head copy counted once) with one scalar ``all_reduce``; the loss read on the last
  stage.
* ``tp``: ``PlainGPT`` of benchmarks/tp_vs_dtensor.py (``nn.Linear`` q/k/v, tied head,
  padded vocabulary masked as gridtrain's), parallelized by its ``parallelize_dtensor``
  (the torchtitan plan without sequence parallelism, vocabulary-parallel embedding, LM
  head ``Shard(-1)`` with ``loss_parallel()``), 4 micro-batches on both ranks. The plan
  leaves the LayerNorms and the position table plain replicated tensors, which
  ``clip_grad_norm_`` refuses beside DTensors, so the norm is taken over both kinds and
  each kind clipped with ``clip_grads_with_norm_``.

Rounds: ``--rounds R`` (default 3); in each round both sides of every comparison run,
gridtrain first in odd rounds and the peer first in even ones. Printed: every round's
tokens/s of both sides and the ratio gridtrain / peer; then a table with the medians over
rounds (the ratio is the median of the per-round ratios) against the issue's targets:
>= 0.97x the plain loop, >= 1.10x DDP, >= 1.10x pipelining, >= 1.30x DTensor.

Run from the repository root (``--only plain,ddp,pp,tp`` selects comparisons)::

    python3 benchmarks/speed_vs_torch.py                                  # ~5 min on 2 idle cores
    python3 benchmarks/speed_vs_torch.py --d-model 512 --n-head 8 --rounds 2
    python3 benchmarks/speed_vs_torch.py --gridtrain-flags=--compile     # gridtrain's blocks compiled
    python3 benchmarks/speed_vs_torch.py --only plain --steps 3 --warmup 1 --rounds 1   # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import common  # benchmarks/common.py: the script's own folder is on sys.path
from common import med
from gridtrain.config import Config, OptimConfig, ParallelConfig
from gridtrain.models.decoder import Decoder, ChunkSpec, init_parameters
from gridtrain.optim.optimizer import lr_at, param_groups
from gridtrain.parallel.pipeline.partition import uniform

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 257
GLOBAL_BATCH, MICRO_BATCH = 16, 4


@dataclass(frozen=True)
class Comparison:
    key: str
    peer: str  # what the peer is, in the report
    nproc: int
    layout: tuple[str, ...]  # gridtrain's layout flags besides --nproc
    target: float  # the bound on gridtrain / peer tokens/s


COMPARISONS = (
    Comparison("plain", "plain PyTorch loop, 1 process", 1, (), 0.97),
    Comparison("ddp", "torch DDP + no_sync, dp 2", 2, (), 1.10),
    Comparison("pp", "torch pipelining Schedule1F1B, pp 2", 2, ("--pp", "2", "--schedule", "1f1b"), 1.10),
    Comparison("tp", "DTensor Colwise/RowwiseParallel, tp 2", 2, ("--tp", "2"), 1.30),
)


# ---- gridtrain's side: the command line ---------------------------------------------------------

def shape_flags(opts: dict) -> list[str]:
    return ["--n-layer", str(opts["n_layer"]), "--d-model", str(opts["d_model"]), "--n-head", str(opts["n_head"]),
            "--seq-len", str(opts["seq_len"])]


def gridtrain_args(opts: dict) -> list[str]:
    """``gridtrain train``'s flags common to every comparison."""
    return ["train", *shape_flags(opts), "--vocab-size", str(VOCAB), "--global-batch-size", str(GLOBAL_BATCH),
            "--micro-batch-size", str(MICRO_BATCH), "--dtype", "fp32", "--device", "cpu", "--dropout", "0",
            "--steps", str(opts["steps"]), "--eval-interval", "0", "--eval-iters", "1", "--no-progress",
            "--sample-tokens", "0", "--seed", str(opts["seed"])]


def gridtrain_command(opts: dict, c: Comparison, metrics: Path) -> list[str]:
    return [sys.executable, "-m", "gridtrain", *gridtrain_args(opts), "--metrics-file", str(metrics),
            "--nproc", str(c.nproc), *c.layout, *opts["gridtrain_flags"]]


def peer_command(opts: dict, c: Comparison, out: Path) -> list[str]:
    script = [str(Path(__file__).resolve()), "--peer", c.key, "--peer-out", str(out), *shape_flags(opts),
              "--steps", str(opts["steps"]), "--warmup", str(opts["warmup"]), "--seed", str(opts["seed"]),
              "--peer-model", opts["peer_model"]]
    if c.nproc == 1:
        return [sys.executable, *script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(c.nproc), *script]


def run_side(cmd: list[str], out: Path, timeout_s: float) -> list[dict]:
    """Run ``cmd`` (from the repository root, this checkout's gridtrain first on the path);
    its per-step rows from ``out`` (gridtrain's metrics file, or the peer's JSON lines)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed (exit {done.returncode}):\n"
                           f"{(done.stdout + done.stderr).strip()[-3000:]}")
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


@dataclass
class Measured:
    tokens_per_s: float  # median over the steps after the warm-up
    losses: tuple[float, float]  # first and last step


def measure(opts: dict, c: Comparison, side: str) -> Measured:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.jsonl"
        cmd = gridtrain_command(opts, c, out) if side == "gridtrain" else peer_command(opts, c, out)
        rows = run_side(cmd, out, opts["timeout"])
    if len(rows) != opts["steps"]:
        raise RuntimeError(f"{side} {c.key}: {len(rows)} step rows, expected {opts['steps']}")
    return Measured(med(r["tokens_per_s"] for r in rows[opts["warmup"]:]), (rows[0]["loss"], rows[-1]["loss"]))


# ---- the peers: plain PyTorch training loops ------------------------------------------------------

Step = Callable[[list[dict]], float]  # one optimizer step on this rank's micro-batches -> the loss read on the host


def recipe(opts: dict, parallel: ParallelConfig) -> Config:
    """The model and recipe of ``gridtrain train`` with the flags above: default grad clip,
    warm-up and cosine over --steps, the seed."""
    o = OptimConfig()
    return common.make_config(opts, parallel, {"vocab_size": VOCAB}, micro_batch_size=MICRO_BATCH,
                              global_batch_size=GLOBAL_BATCH, steps=opts["steps"], warmup_steps=o.warmup_steps,
                              grad_clip=o.grad_clip)


def finish_step(opt: torch.optim.Optimizer, sched, clip: Callable[[], object], loss: torch.Tensor,
                read: Callable[[torch.Tensor], float] = float) -> float:
    """After the micro-batches: clip, optimizer step, LR schedule, zero_grad, the loss to the host."""
    clip()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return read(loss)


def optimizer(model: torch.nn.Module, cfg: Config):
    """torch's AdamW as a user writes it (its default implementation) with gridtrain's
    hyper-parameters and parameter groups, and gridtrain's learning-rate schedule."""
    o, steps = cfg.optim, cfg.training.steps
    opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.adam_eps)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, o, steps) / o.lr)


def gpt(cfg: Config, chunk: ChunkSpec | None = None) -> Decoder:
    """gridtrain's Decoder (tp 1) with its initial weights, used as a plain ``nn.Module``."""
    model = Decoder(cfg.model, chunks=None if chunk is None else [chunk])
    init_parameters(model, cfg.training.seed)
    return model


def plain_gpt(cfg: Config, tp: int = 1):
    """``PlainGPT`` of benchmarks/tp_vs_dtensor.py holding :func:`gpt`'s weights, its
    vocabulary padded as gridtrain pads it at ``tp``."""
    from tp_vs_dtensor import plain_from_gridtrain

    m = cfg.model
    return plain_from_gridtrain(gpt(replace(cfg, model=replace(m, vocab_pad_multiple=m.vocab_pad_multiple * tp))))


def gpt_loss(model: torch.nn.Module, b: dict) -> torch.Tensor:
    return model(b["tokens"], b["labels"]).sum()  # gridtrain's Decoder: per-token losses


def plain_gpt_loss(model: torch.nn.Module, b: dict) -> torch.Tensor:
    return F.cross_entropy(model(b["tokens"]).flatten(0, 1), b["labels"].flatten(), reduction="sum")


def whole_model(cfg: Config, plain: bool) -> tuple[torch.nn.Module, Callable[[torch.nn.Module, dict], torch.Tensor]]:
    """The whole model of the ``plain`` and ``ddp`` peers (--peer-model) and its summed token loss."""
    return (plain_gpt(cfg), plain_gpt_loss) if plain else (gpt(cfg), gpt_loss)


def accumulation_step(model: torch.nn.Module, loss_of: Callable[[torch.nn.Module, dict], torch.Tensor],
                      cfg: Config, tokens_per_rank: int, global_tokens: int,
                      no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                      reduce_loss: Callable[[torch.Tensor], None] = lambda loss: None) -> Step:
    """Gradient accumulation over the micro-batches (``no_sync`` around all but the last),
    each micro-batch's summed token loss scaled by 1 / ``tokens_per_rank``; the loss read is
    the sum over ``reduce_loss``'s ranks / ``global_tokens``."""
    opt, sched = optimizer(model, cfg)
    params = list(model.parameters())

    def step(batches: list[dict]) -> float:
        loss = torch.zeros((), dtype=torch.float64)
        for i, b in enumerate(batches):
            with no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                summed = loss_of(model, b)
                (summed * (1.0 / tokens_per_rank)).backward()
            loss += summed.detach().double()
        reduce_loss(loss)
        return finish_step(opt, sched, lambda: torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip), loss,
                           lambda x: float(x) / global_tokens)

    return step


def plain_peer(cfg: Config, rank: int, world: int, plain_model: bool) -> Step:
    tokens = GLOBAL_BATCH * cfg.model.seq_len
    return accumulation_step(*whole_model(cfg, plain_model), cfg, tokens, tokens)


def ddp_peer(cfg: Config, rank: int, world: int, plain_model: bool) -> Step:
    from torch.nn.parallel import DistributedDataParallel

    model, loss_of = whole_model(cfg, plain_model)
    ddp = DistributedDataParallel(model)
    tokens = GLOBAL_BATCH * cfg.model.seq_len
    return accumulation_step(ddp, loss_of, cfg, tokens // world, tokens, ddp.no_sync, dist.all_reduce)


def pp_peer(cfg: Config, rank: int, world: int, plain_model: bool) -> Step:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from pp_vs_torch_pipelining import OneTensorStage, mean_token_cross_entropy

    counts = uniform(cfg.model.n_layer, world)
    first, last = rank == 0, rank == world - 1
    model = gpt(cfg, ChunkSpec(tuple(range(sum(counts[:rank]), sum(counts[:rank + 1]))), first, last))
    module = OneTensorStage(model)
    opt, sched = optimizer(module, cfg)
    schedule = Schedule1F1B(PipelineStage(module, rank, world, torch.device("cpu")), GLOBAL_BATCH // MICRO_BATCH,
                            loss_fn=mean_token_cross_entropy)
    tied = model.embedding.word.weight if first else model.head
    params = list(module.parameters())
    counted = [p for p in params if not (last and p is model.head)]  # the tied table counted once, on stage 0

    def clip() -> None:
        norm_sq = torch.nn.utils.get_total_norm([p.grad for p in counted]).square()
        dist.all_reduce(norm_sq)
        torch.nn.utils.clip_grads_with_norm_(params, cfg.optim.grad_clip, norm_sq.sqrt())

    def step(batches: list[dict]) -> float:
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(torch.cat([b["tokens"] for b in batches]), return_outputs=False)
        else:
            schedule.step(target=torch.cat([b["labels"] for b in batches]), losses=losses, return_outputs=False)
        dist.all_reduce(tied.grad)  # gridtrain's tied embedding: the two copies' gradients summed
        loss = torch.stack(losses).detach().mean() if last else torch.zeros(())
        return finish_step(opt, sched, clip, loss, float if last else (lambda _: float("nan")))

    return step


def tp_peer(cfg: Config, rank: int, world: int, plain_model: bool) -> Step:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import loss_parallel

    from tp_vs_dtensor import _loss_value, parallelize_dtensor

    model = plain_gpt(cfg, world)
    mesh = init_device_mesh("cpu", (world,))
    parallelize_dtensor(model, mesh, loss_parallel=True, prepare_attn_input=False)
    opt, sched = optimizer(model, cfg)
    # the plan turns the linears and the embedding into DTensors; the norms and the position
    # table stay plain replicated tensors, and clip_grad_norm_ refuses the mix: clip each
    # kind with the norm over both
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    replicated = [p for p in model.parameters() if not isinstance(p, DTensor)]

    def clip() -> None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in sharded]).full_tensor().hypot(
            torch.nn.utils.get_total_norm([p.grad for p in replicated]))
        torch.nn.utils.clip_grads_with_norm_(replicated, cfg.optim.grad_clip, norm)
        torch.nn.utils.clip_grads_with_norm_(sharded, cfg.optim.grad_clip,
                                             DTensor.from_local(norm, mesh, [Replicate()]))

    def step(batches: list[dict]) -> float:
        loss = None
        with loss_parallel():
            for b in batches:
                mb = F.cross_entropy(model(b["tokens"]).flatten(0, 1), b["labels"].flatten()) / len(batches)
                mb.backward()
                loss = mb.detach() if loss is None else loss + mb.detach()
        return finish_step(opt, sched, clip, loss, _loss_value)

    return step


PEERS: dict[str, tuple[Callable[[Config, int, int, bool], Step], Callable[[int], ParallelConfig]]] = {
    "plain": (plain_peer, lambda w: ParallelConfig()),
    "ddp": (ddp_peer, lambda w: ParallelConfig(nproc=w, dp=w)),
    "pp": (pp_peer, lambda w: ParallelConfig(nproc=w, pp=w, schedule="1f1b")),
    "tp": (tp_peer, lambda w: ParallelConfig(nproc=w, tp=w)),
}


def peer_main(opts: dict) -> int:
    """One rank of a peer (``--peer NAME``; torchrun's variables say which): the whole
    training loop, each step timed; rank 0 writes one JSON line per step to --peer-out."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as gridtrain's workers
    if world > 1:
        dist.init_process_group("gloo")
    build, parallel = PEERS[opts["peer"]]
    cfg = recipe(opts, parallel(world))
    step = build(cfg, rank, world, opts["peer_model"] == "plain")
    n_mb = GLOBAL_BATCH // MICRO_BATCH
    batches = common.random_batches(cfg, opts["steps"] * GLOBAL_BATCH)  # a new global batch every step
    mine = slice(rank * n_mb // world, (rank + 1) * n_mb // world) if opts["peer"] == "ddp" else slice(0, n_mb)
    tokens = GLOBAL_BATCH * cfg.model.seq_len
    rows = []
    for i in range(opts["steps"]):
        began = time.perf_counter()
        loss = step(batches[i * n_mb:(i + 1) * n_mb][mine])
        took = time.perf_counter() - began
        rows.append({"step": i + 1, "loss": loss, "step_time_s": took, "tokens_per_s": tokens / took})
    if opts["peer"] == "pp":  # rank 0 reports the last stage's losses
        losses = torch.tensor([r["loss"] for r in rows], dtype=torch.float64)
        dist.broadcast(losses, world - 1)
        for r, x in zip(rows, losses.tolist()):
            r["loss"] = x
    if world > 1:
        dist.destroy_process_group()
    if rank == 0:
        Path(opts["peer_out"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


# ---- the rounds and the report --------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> dict:
    p = common.benchmark_parser(__doc__, steps=12, warmup=2, repeats=3, ranks=False)
    p.set_defaults(n_layer=4, d_model=128, n_head=4, seq_len=128)  # the shape (= the small preset)
    for a in p._actions:  # --steps and --warmup mean what they mean to `gridtrain train` here
        if a.dest == "steps":
            a.help = "optimizer steps per run, warm-up included (default: %(default)s)"
        elif a.dest == "warmup":
            a.help = "first steps of each run left out of the median (default: %(default)s)"
        elif a.dest == "repeats":
            a.help = argparse.SUPPRESS
    p.add_argument("--rounds", dest="repeats", metavar="R", type=int, default=argparse.SUPPRESS,
                   help="interleaved rounds (default: 3)")
    p.add_argument("--only", default="plain,ddp,pp,tp",
                   help="comparisons to run, comma-separated from plain,ddp,pp,tp (default: all)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is stopped")
    p.add_argument("--peer-model", choices=("gridtrain", "plain"), default="gridtrain",
                   help="model of the plain and ddp peers: gridtrain's Decoder as a plain nn.Module (default), or "
                        "PlainGPT of tp_vs_dtensor.py (nn.Linear q/k/v, F.cross_entropy on masked logits)")
    p.add_argument("--gridtrain-flags", default="",
                   help="more flags for every gridtrain run, e.g. '--compile' (the peers stay as written)")
    p.add_argument("--peer", choices=sorted(PEERS), help=argparse.SUPPRESS)
    p.add_argument("--peer-out", help=argparse.SUPPRESS)
    opts = common.parse(p, argv)
    opts["only"] = [c.strip() for c in opts["only"].split(",") if c.strip()]
    opts["gridtrain_flags"] = shlex.split(opts["gridtrain_flags"])
    unknown = [c for c in opts["only"] if c not in PEERS]
    if unknown or not opts["only"]:
        p.error(f"--only: unknown comparison(s) {unknown}; choose from plain,ddp,pp,tp")
    if opts["steps"] <= opts["warmup"]:
        p.error("--steps must be larger than --warmup")
    return opts


def fmt(x: float) -> str:
    return f"{x:,.0f}"


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts["peer"]:
        return peer_main(opts)
    began, load_start = time.perf_counter(), os.getloadavg()
    comparisons = [c for c in COMPARISONS if c.key in opts["only"]]
    tokens = GLOBAL_BATCH * opts["seq_len"]
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"shape: {opts['n_layer']} layers, d_model {opts['d_model']}, {opts['n_head']} heads, seq "
          f"{opts['seq_len']}, vocab {VOCAB}; global batch {GLOBAL_BATCH} in micro-batches of {MICRO_BATCH} = "
          f"{tokens} tokens/step; fp32, CPU gloo, dropout 0")
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}; load average at start "
          f"{' '.join(f'{x:.2f}' for x in load_start)}")
    print(f"gridtrain: {common.gridtrain_version()}")
    print(f"timing: {opts['steps']} steps per run, the first {opts['warmup']} left out, median tokens/s of the "
          f"rest; {opts['repeats']} rounds, gridtrain first in odd rounds, the peer first in even ones")
    print(f"gridtrain runs: python -m gridtrain {shlex.join(gridtrain_args(opts))} --metrics-file F "
          f"--nproc N [layout flags] {shlex.join(opts['gridtrain_flags'])}", flush=True)
    results: dict[str, dict[str, list[Measured]]] = {c.key: {"gridtrain": [], "peer": []} for c in comparisons}
    for r in range(opts["repeats"]):
        for c in comparisons:
            order = ("gridtrain", "peer") if r % 2 == 0 else ("peer", "gridtrain")
            for side in order:
                results[c.key][side].append(measure(opts, c, side))
            g, p = results[c.key]["gridtrain"][-1], results[c.key]["peer"][-1]
            print(f"round {r + 1} {c.key:5} ({order[0]} first): gridtrain {fmt(g.tokens_per_s)} tokens/s, "
                  f"{c.peer} {fmt(p.tokens_per_s)} tokens/s, ratio {g.tokens_per_s / p.tokens_per_s:.3f}x "
                  f"(loss first/last step: gridtrain {g.losses[0]:.3f}/{g.losses[1]:.3f}, "
                  f"peer {p.losses[0]:.3f}/{p.losses[1]:.3f})", flush=True)
    print()
    print("| comparison | gridtrain tokens/s | peer tokens/s | gridtrain / peer | target | met |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for c in comparisons:
        g = [m.tokens_per_s for m in results[c.key]["gridtrain"]]
        p = [m.tokens_per_s for m in results[c.key]["peer"]]
        ratio = med(a / b for a, b in zip(g, p))
        layout = " ".join(("--nproc", str(c.nproc), *c.layout))
        print(f"| gridtrain {layout} vs {c.peer} | {fmt(med(g))} | {fmt(med(p))} | {ratio:.3f}x | "
              f">= {c.target:.2f}x | {'yes' if ratio >= c.target else 'NO'} |")
    print()
    print("tokens/s: median over rounds of each run's median after the warm-up; ratio: median of the per-round "
          "ratios. gridtrain reads the built-in corpus; the peers use random token ids built before the loop.")
    print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"wall time {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
