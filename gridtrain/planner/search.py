"""Every layout of N GPUs that divides and fits, ranked by predicted step time.

A layout is valid when the sizes divide (tp divides the heads and the key/value heads
or is a multiple of them, and fits one node; pp x vpp divides the layers; the global
batch divides into micro-batches over dp; the schedule accepts the micro-batch count)
and when its predicted memory fits the device. The space is large at scale (thousands
of layouts for 1024 GPUs), so the search runs in two passes: every valid layout gets
its memory (the memory model's closed forms, about a millisecond each) and those that fit a
rough time (the schedule's closed-form bubble), then the best
``shortlist`` are predicted in full (the simulator on the schedule's action lists, the
dry run's memory forms) and ranked by predicted step time; layouts that do not fit come
after every one that does.
"""

from __future__ import annotations

import math

from collections.abc import Iterable
from dataclasses import dataclass, replace

from gridtrain.config import ModelConfig
from gridtrain.parallel.pipeline.schedules import ScheduleError, check_sizes
from gridtrain.planner.cost import (Job, Layout, Prediction, block_cost, head_cost, memory_bytes, micro_batches,
                                    predict)

SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "gpipe")
RECOMPUTE = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16)
VIRTUAL_STAGES = (1, 2, 3, 4)


@dataclass(frozen=True)
class Fixed:
    """Layout fields the user gave (None: searched)."""

    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    micro_batch_size: int | None = None
    schedule: str | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    zero: int | None = None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_fits(m: ModelConfig, tp: int) -> bool:
    kv = m.kv_heads
    return m.n_head % tp == 0 and (kv % tp == 0 or tp % kv == 0) and m.padded_vocab_size(tp) % tp == 0


def layouts(job: Job, gpus: int, fixed: Fixed = Fixed()) -> Iterable[Layout]:
    """Every valid layout of ``gpus`` devices (memory not yet checked)."""
    m = job.model
    for tp in divisors(min(gpus, job.node)):
        if (fixed.tp is not None and tp != fixed.tp) or not tp_fits(m, tp):
            continue
        for pp in divisors(gpus // tp):
            if fixed.pp is not None and pp != fixed.pp:
                continue
            dp = gpus // (tp * pp)
            for vpp in VIRTUAL_STAGES:
                if (fixed.vpp is not None and vpp != fixed.vpp) or m.n_layer < pp * vpp or (vpp > 1 and pp == 1):
                    continue
                if vpp > 1 and m.n_layer % (pp * vpp):
                    continue  # interleaving only with equal chunks
                # layers that do not divide evenly over the stages: the runtime's balanced
                # split by parameters (--pp-layers printed), as BLOOM and Llama 3.1 405B ran
                split = "uniform" if m.n_layer % pp == 0 else "parameters"
                for mbs in MICRO_BATCHES:
                    if fixed.micro_batch_size is not None and mbs != fixed.micro_batch_size:
                        continue
                    if job.global_batch_size % (mbs * dp):
                        continue
                    yield from _variants(job, Layout(dp=dp, tp=tp, pp=pp, vpp=vpp, micro_batch_size=mbs,
                                                     pp_partition=split), fixed)


def _variants(job: Job, base: Layout, fixed: Fixed) -> Iterable[Layout]:
    mbs = micro_batches(job, base)
    for schedule in SCHEDULES:
        if fixed.schedule is not None and schedule != fixed.schedule:
            continue
        if base.pp == 1 and schedule != "1f1b" and fixed.schedule is None:
            continue  # one stage: every schedule is the same accumulation loop
        try:
            check_sizes(schedule, base.pp, mbs, base.vpp)
        except ScheduleError:
            continue
        for recompute in RECOMPUTE:
            if fixed.recompute is not None and recompute != fixed.recompute:
                continue
            for sp in ((False, True) if base.tp > 1 else (False,)):
                if fixed.sequence_parallel is not None and sp != fixed.sequence_parallel:
                    continue
                for zero in ((0, 1) if base.dp > 1 else (0,)):
                    if fixed.zero is not None and zero != fixed.zero:
                        continue
                    yield replace(base, schedule=schedule, recompute=recompute, sequence_parallel=sp, zero=zero)


def rough_step(job: Job, lay: Layout) -> float:
    """A cheap estimate for the first pass: one stage's compute for every micro-batch,
    stretched by the schedule's closed-form bubble."""
    block = block_cost(job, lay)
    hf, hb, hw_ = head_cost(job, lay)
    m = micro_batches(job, lay)
    per_mb = math.ceil(job.model.n_layer / lay.pp) * (block.f + block.b + block.w) + (hf + hb + hw_) / lay.pp
    # ZB-H1 as 1F1B: the runtime's blocking sends hold its deferred weight gradients back
    # (pipeline/simulate.py, rendezvous), so only the simulator can tell them apart
    bubble = (lay.pp - 1) / (lay.vpp * m)
    return m * per_mb * (1 + bubble)


def search(job: Job, gpus: int, fixed: Fixed = Fixed(), top: int = 5, shortlist: int = 40) -> list[Prediction]:
    """The ``top`` layouts by predicted step time among those that fit (when none fits,
    the ones needing the least memory, marked as not fitting)."""
    candidates = [(lay, memory_bytes(job, lay)) for lay in layouts(job, gpus, fixed)]  # ~ms each
    if not candidates:
        return []
    usable = job.hardware.usable_memory_bytes
    fitting = [c for c in candidates if c[1] <= usable]
    pool = sorted(fitting, key=lambda c: rough_step(job, c[0]))[:shortlist] if fitting else \
        sorted(candidates, key=lambda c: c[1])[:top]
    predicted = [predict(job, lay, memory=mem) for lay, mem in pool]  # the simulator: the costly part
    predicted.sort(key=lambda p: (not p.fits, p.step_time_s if p.fits else p.memory_bytes))
    return predicted[:top]
