"""One harness for the benchmarks: everything the scripts share, so that each keeps only
its peer's model and step and its own table.

* the command line: the shape and timing flags, the flags of the multi-process
  comparisons, the checks, and the ``main`` skeleton (parse, validate, run the ranks,
  print the report);
* the configuration those flags describe, and a fixed batch of random token ids;
* gridtrain's side, built once by ``gridtrain.training.trainer.build`` with the Decoder providers (also
  as a one-process reference inside the benchmark's world) and stepped with
  ``Trainer.train_step``;
* the timing protocol: blocks of steps between two barriers, interleaved rounds with the
  order reversed every other round, isolated collectives, medians and paired ratios;
* the report's common lines: shape, machine, load average, the gridtrain commit, the
  protocol, the per-round numbers, notes and the wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from gridtrain.parallel.comm import single
from gridtrain.config import Config, ConfigError, ParallelConfig, TrainingConfig, preset_config, set_fields
from gridtrain.parallel.distributed import DistributedContext, setup_distributed, shutdown
from gridtrain.parallel.experts import ExpertParallel
from gridtrain.parallel.grid import ProcessGrid
from gridtrain.runtime.launch import run_workers
from gridtrain.training.providers import decoder_forward_step, decoder_model_provider
from gridtrain.training.report import format_bytes
from gridtrain.parallel.tensor_parallel import TensorParallel
from gridtrain.training.trainer import Trainer, build
from gridtrain.training.validate import validate

__all__ = ["Run", "Side", "benchmark_main", "benchmark_parser", "add_micro_batch_arguments", "parse",
           "make_config", "random_batches", "build_gpt", "build_gpt_one_process", "between_barriers",
           "timed_rounds", "isolated_seconds", "reference_threads", "run_ranks", "med", "paired_ratio",
           "format_bytes", "mib", "gridtrain_version", "header", "per_round", "footer", "long_sequence_parser",
           "long_sequence_config", "long_sequence_header", "pretrain_worker", "rounds_of_sides"]


# ---- command line ------------------------------------------------------------------------------

def benchmark_parser(doc: str, *, steps: int, warmup: int, repeats: int,
                     ranks: bool = True) -> argparse.ArgumentParser:
    """--n-layer --d-model --n-head --seq-len (default: the `small` preset), --steps --warmup
    --repeats (per benchmark) and --seed; with ``ranks`` (the comparisons on several
    processes) also --no-reference, --ref-threads and --timeout."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    small = preset_config("small").model
    p.add_argument("--n-layer", type=int, default=small.n_layer, help="default: %(default)s (small preset)")
    p.add_argument("--d-model", type=int, default=small.d_model, help="default: %(default)s")
    p.add_argument("--n-head", type=int, default=small.n_head, help="default: %(default)s")
    p.add_argument("--seq-len", type=int, default=small.seq_len, help="default: %(default)s")
    p.add_argument("--steps", type=int, default=steps, help="timed steps per round and setup (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps per setup first (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=repeats, help="timed rounds (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1234, help="weights and batch (default: %(default)s)")
    if ranks:
        p.add_argument("--no-reference", dest="reference", action="store_false",
                       help="skip the one-process reference(s) on rank 0")
        p.add_argument("--ref-threads", type=int, default=0,
                       help="torch threads of the one-process reference(s) (default: every core)")
        p.add_argument("--timeout", type=float, default=1800.0,
                       help="collective timeout in seconds (default: %(default)s)")
    return p


def add_micro_batch_arguments(p: argparse.ArgumentParser, *, microbatches: int | None = None,
                              per: str = "step", size: int = 4) -> None:
    """--micro-batch-size, and --microbatches (per ``per``) when it has a default."""
    if microbatches is not None:
        p.add_argument("--microbatches", type=int, default=microbatches,
                       help=f"micro-batches per {per} (default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=size, help="sequences per micro-batch (default: %(default)s)")


def parse(p: argparse.ArgumentParser, argv: list[str] | None, *positive: str) -> dict:
    """The flags as a dict; --warmup, --steps, --repeats and the ``positive`` ones must be >= 1."""
    opts = vars(p.parse_args(argv))
    names = ("warmup", "steps", "repeats", *positive)
    if any(opts[n] < 1 for n in names):
        p.error(", ".join("--" + n.replace("_", "-") for n in names) + " must be >= 1")
    return opts


# ---- configuration and data --------------------------------------------------------------------

def make_config(opts: dict, parallel: ParallelConfig, model: dict | None = None, **training: Any) -> Config:
    """The `small` preset with the shape flags and ``model``'s fields (default: no dropout),
    the ``parallel`` sizes, and a fixed-batch recipe: fp32 on the CPU, the flags' seed, no
    clipping (the peers clip nothing; the norm is still computed), progress off; the
    ``training`` fields (batch sizes at least) complete or override it."""
    cfg = preset_config("small")
    cfg.model = replace(cfg.model, n_layer=opts["n_layer"], d_model=opts["d_model"], n_head=opts["n_head"],
                        seq_len=opts["seq_len"], **{"dropout": 0.0, **(model or {})})
    cfg.parallel = parallel
    recipe = dict(steps=100, warmup_steps=1, seed=opts["seed"], dtype="fp32", device="cpu", grad_clip=0.0,
                  dist_timeout_s=opts.get("timeout", TrainingConfig.dist_timeout_s), progress=False)
    return set_fields(cfg, **{**recipe, **training})


def random_batches(cfg: Config, sequences: int) -> list[dict]:
    """``sequences`` random token sequences (the config's seed: the same everywhere), as
    micro-batches of the config's size, each with its next-token labels."""
    m, mbs = cfg.model, cfg.training.micro_batch_size
    gen = torch.Generator().manual_seed(cfg.training.seed)
    data = torch.randint(0, m.vocab_size, (sequences, m.seq_len + 1), generator=gen)
    return [{"tokens": data[i:i + mbs, :-1].contiguous(), "labels": data[i:i + mbs, 1:].contiguous()}
            for i in range(0, sequences, mbs)]


# ---- gridtrain's side ----------------------------------------------------------------------------

def build_gpt(cfg: Config, ctx: DistributedContext | None = None) -> Trainer:
    """gridtrain's Decoder and everything its training step needs on this rank, as ``pretrain``
    builds them (no datasets: the benchmarks bring their batches)."""
    return build(cfg, decoder_model_provider, decoder_forward_step, ctx=ctx)


def build_gpt_one_process(cfg: Config) -> Trainer:
    """:func:`build_gpt` for ``cfg`` on one process (dp = tp = pp = 1), inside the
    benchmark's world of several ranks: the reference that rank 0 runs with every core
    while the others wait in a barrier. Every rank must call it (the groups it makes are
    collective); each gets a one-rank grid whose groups are identities.

    ``setup_distributed`` lays the grid over the whole world; so the world is set up as DP
    replicas (every rank seeded as a lone process: stage 0, TP rank 0) and ``build`` is
    handed a one-rank context whose groups are identities."""
    one = replace(cfg, parallel=ParallelConfig(nproc=1, dp=1, bucket_mb=cfg.parallel.bucket_mb))
    world = setup_distributed(replace(one, parallel=ParallelConfig()))
    ctx = replace(world, grid=ProcessGrid.build(1), rank=0, tp=TensorParallel(rng=world.tp.rng),
                  dp=single("dp"), mp=single("mp"), pp=single("pp"), embedding=None,
                  ep=ExpertParallel(), expert_dp=None)  # MoE: routing statistics over this rank's tokens
    return build_gpt(one, ctx)


# ---- the timing protocol -------------------------------------------------------------------------

@dataclass(kw_only=True)
class Side:
    """One way of training, as the harness times it (scripts add their own fields)."""

    name: str
    active: bool = True  # False: this rank only waits in the barriers (a one-process reference)
    threads: int | None = None  # torch threads while it runs (default: the rank's own)
    times: list[float] = field(default_factory=list)  # per round: seconds per step between barriers
    rounds: list = field(default_factory=list)  # per round: what the script's block returned


def between_barriers(side: Side, run: Callable[[], Any]) -> tuple[float, Any]:
    """``run()`` (where ``side`` is active) between two barriers, with the side's threads;
    returns the seconds between the barriers and what ``run`` returned (None if idle)."""
    base = torch.get_num_threads()
    torch.set_num_threads(side.threads or base)
    try:
        dist.barrier()
        began = time.perf_counter()
        out = run() if side.active else None
        dist.barrier()
        return time.perf_counter() - began, out
    finally:
        torch.set_num_threads(base)


def timed_rounds(sides: Sequence[Side], opts: dict, block: Callable[[Side, int], tuple[float, Any]]) -> None:
    """--repeats rounds, each timing --steps steps of every side in turn, the order reversed
    every other round (so no side always runs first). ``block(side, steps)`` returns the
    seconds the steps took and anything else: appended to ``side.times`` (per step) and
    ``side.rounds``."""
    steps = opts["steps"]
    for r in range(opts["repeats"]):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            seconds, extra = block(side, steps)
            side.times.append(seconds / steps)
            side.rounds.append(extra)


def isolated_seconds(fn: Callable[[], Any], samples: int = 30) -> float:
    """Median seconds of ``fn()`` (one collective, for the reading), each started after a barrier."""
    took = []
    for _ in range(samples):
        dist.barrier()
        began = time.perf_counter()
        fn()
        took.append(time.perf_counter() - began)
    return statistics.median(took)


def reference_threads(opts: dict) -> int:
    """Torch threads of the one-process references: --ref-threads, or every core."""
    return opts.get("ref_threads") or os.cpu_count() or 1


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def med(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """Median over rounds of numerator / denominator: two setups compared within each round,
    where they ran next to each other in time (for tokens/s of B vs A: ``paired_ratio(A.times, B.times)``)."""
    return med(n / d for n, d in zip(numerators, denominators))


# ---- running -----------------------------------------------------------------------------------

@dataclass
class Run:
    results: list  # what the worker returned, by rank
    wall_s: float
    load: tuple[float, float]  # 1-minute load average before and after


def run_ranks(worker: Callable, world_size: int, arg: Any, timeout_s: float | None = None) -> list:
    """``worker(rank, world_size, arg)`` on ``world_size`` gloo processes; with one rank, in
    this process (a one-rank world, shut down after). Results by rank."""
    if world_size == 1:
        try:
            return [worker(0, 1, arg)]
        finally:
            shutdown()
    timeout = {} if timeout_s is None else {"collective_timeout_s": timeout_s}
    return run_workers(worker, world_size, (arg,), **timeout)


def benchmark_main(name: str, argv: list[str] | None, parse_args: Callable[[list[str] | None], dict],
                   configs: Callable[[dict], Iterable[Config]], world_size: int, worker: Callable,
                   report: Callable[[Run, dict], str]) -> int:
    """Parse the flags; validate every configuration the run will build (one clear line and
    exit status 2 for a bad shape, before any process starts); run ``worker(rank, world,
    opts)`` on ``world_size`` ranks, timing the whole and noting the load average; print
    ``report``."""
    opts = parse_args(argv)
    try:
        for cfg in configs(opts):
            validate(cfg, world_size=world_size)
    except ConfigError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    results = run_ranks(worker, world_size, opts, opts.get("timeout"))
    print(report(Run(results, time.perf_counter() - began, (load_before, os.getloadavg()[0])), opts))
    return 0


# ---- the report ----------------------------------------------------------------------------------

def gridtrain_version() -> str:
    """The commit measured, and whether gridtrain/ has local edits (read-only git queries;
    "unknown" outside a checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "gridtrain")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" with uncommitted changes under gridtrain/" if dirty else "")


def header(run: Run, opts: dict, *, shape: str, threads: str, timing: str = "") -> list[str]:
    """The lines every report opens with: the shape, the machine and its load, the gridtrain
    measured, the timing protocol."""
    return [
        f"shape: {shape}",
        f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}; {threads}; 1-min load average "
        f"at start / end {run.load[0]:.1f} / {run.load[1]:.1f}",
        f"gridtrain: {gridtrain_version()}",
        f"timing: {opts['warmup']} warm-up steps per setup, then {opts['repeats']} rounds x {opts['steps']} "
        f"steps per setup, interleaved (order reversed every other round); medians over rounds{timing}",
        "",
    ]


def per_round(title: str, rows: Iterable[tuple[str, Sequence[float]]], fmt: Callable[[float], str]) -> list[str]:
    """``title``, then one line per setup with its number for every round."""
    return [title, *(f"  {name}: " + ", ".join(fmt(x) for x in values) for name, values in rows)]


def footer(run: Run, notes: Iterable[str] = ()) -> list[str]:
    return [*("NOTE " + note.rstrip() for note in notes), f"wall time {run.wall_s:.0f} s"]


# ---- whole-loop sides at long sequences (cp_long_context.py, document_mask.py) -----------------


def long_sequence_parser(doc: str, *, seq_len: int, steps: int) -> argparse.ArgumentParser:
    """The flags of a small GPT trained whole (``pretrain``) at one long sequence length."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--rounds", type=int, default=2)
    return p


def long_sequence_config(opts: argparse.Namespace, world: int, parallel: dict, **fields: Any) -> Config:
    """The run of those flags on ``world`` ranks with ``parallel``'s layout (validated:
    ConfigError names a bad shape): one sequence per micro-batch, fp32, no validation."""
    cfg = preset_config("tiny")
    set_fields(cfg, n_layer=opts.n_layer, d_model=opts.d_model, n_head=opts.n_head, seq_len=opts.seq_len,
               dtype="fp32", steps=opts.steps, micro_batch_size=1, global_batch_size=opts.global_batch_size,
               eval_interval=0, eval_iters=1, progress=False, lr=1e-3, warmup_steps=1, **fields)
    cfg.parallel.nproc = world if world > 1 else None
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return validate(cfg, world_size=world)


def long_sequence_header(opts: argparse.Namespace) -> str:
    return (f"GPT: {opts.n_layer} layers, d {opts.d_model}, {opts.n_head} heads, seq {opts.seq_len}, "
            f"{opts.global_batch_size} sequences per step (micro-batch 1), fp32, {opts.steps} steps per run "
            f"(step 1 untimed), {opts.rounds} rounds; torch {torch.__version__}, {os.cpu_count()} CPU cores, "
            f"gridtrain {gridtrain_version()}")


def pretrain_worker(rank: int, world_size: int, cfg: Config) -> dict:
    """The whole loop on the built-in corpus, as ``gridtrain train`` runs it (one rank:
    every core's threads): its tokens/s, peak bytes saved for backward, cp transfer
    overlap per step after the first, and bytes moved per group in the last step."""
    from gridtrain.training.loop import pretrain
    from gridtrain.training.providers import text_datasets_provider
    from gridtrain.training.report import bytes_by_group
    if world_size == 1:
        torch.set_num_threads(os.cpu_count() or 1)
    result = pretrain(decoder_model_provider, text_datasets_provider, decoder_forward_step, cfg)
    return {"tokens_per_s": result.tokens_per_s,
            "peak_activation_bytes": max(s.peak_bytes for s in result.memory) if result.memory else 0,
            "cp_overlap": result.cp_overlap[1:], "bytes": bytes_by_group(result.step_bytes[-1])}


def rounds_of_sides(sides: dict[str, tuple[int, Config]], rounds: int) -> dict[str, list[list[dict]]]:
    """Each side (name -> world size, config) trained by :func:`pretrain_worker` in turn,
    the order reversed every other round; per side, every round's results by rank."""
    measured: dict[str, list[list[dict]]] = {side: [] for side in sides}
    order = list(sides)
    for round_ in range(rounds):
        for side in order if round_ % 2 == 0 else order[::-1]:
            began = time.perf_counter()
            world, cfg = sides[side]
            ranks = run_ranks(pretrain_worker, world, cfg, timeout_s=1800)
            print(f"  round {round_ + 1}: {side}: {ranks[0]['tokens_per_s']:,.0f} tokens/s "
                  f"({time.perf_counter() - began:.0f} s with start-up)", flush=True)
            measured[side].append(ranks)
    return measured


def proc_stats() -> dict[int, list[str]]:
    """Every process's /proc/PID/stat fields after the command name (``fields[1]`` is
    the parent's pid, ``fields[19]`` the start time in clock ticks, ``fields[21]`` the
    resident pages); empty where there is no /proc."""
    stats = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stats[int(entry)] = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
    return stats
