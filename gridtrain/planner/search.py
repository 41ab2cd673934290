"""Every layout of N GPUs that divides and fits, ranked by predicted step time.

A layout is valid when the sizes divide (tp divides the heads and the key/value heads
or is a multiple of them, and fits one node; cp cuts each sequence into 2 cp chunks;
pp x vpp divides the layers; the global batch divides into micro-batches over dp; the
schedule accepts the micro-batch count) and when its predicted memory fits the device.

The space is large at scale (tens of thousands of layouts for 1024 GPUs once cp is
searched), so the search runs in two passes: every valid layout gets a rough time (one
stage's block costs stretched by the schedule's closed-form bubble, a fraction of a
millisecond), then, in that order, the memory model's closed forms (about a millisecond
each) until ``shortlist`` layouts fit; those are predicted in full (the simulator on the
schedule's action lists) and ranked by predicted step time. When none fits, the ones
needing the least memory come back, marked as not fitting.

Context parallelism is searched where it can pay: cp > 1 only while each rank keeps at
least ``CP_MIN_TOKENS`` tokens of a sequence (below that a step's attention is too short
to hide its key/value transfer, and the sequences that need cp are far longer), each
with both ``--cp-comm`` modes; selective recomputation is left out under cp (the cp core
is not recomputed, so it would be ``none`` again). A fixed ``cp`` is taken as given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import islice

from gridtrain.config import ModelConfig
from gridtrain.memory.cp import CP_COMM_MODES
from gridtrain.parallel.pipeline.schedules import ScheduleError, check_sizes
from gridtrain.planner.cost import (Job, Layout, Prediction, block_cost, head_cost, memory_bytes, micro_batches,
                                    predict)

SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "gpipe")
RECOMPUTE = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16)
VIRTUAL_STAGES = (1, 2, 3, 4)
CP_COMM = CP_COMM_MODES
CP_MIN_TOKENS = 1024  # the fewest tokens of a sequence a cp rank is left with, searching


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
    cp: int | None = None
    cp_comm: str | None = None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_fits(m: ModelConfig, tp: int) -> bool:
    kv = m.kv_heads
    return m.n_head % tp == 0 and (kv % tp == 0 or tp % kv == 0) and m.padded_vocab_size(tp) % tp == 0


def cp_sizes(m: ModelConfig, gpus: int, fixed: Fixed = Fixed()) -> list[int]:
    """The context-parallel sizes to try among ``gpus`` ranks: those that cut a sequence
    into ``2 cp`` chunks and leave each rank ``CP_MIN_TOKENS`` tokens or more (a fixed cp:
    itself, where it divides)."""
    def splits(cp: int) -> bool:
        return cp == 1 or m.seq_len % (2 * cp) == 0

    if fixed.cp is not None:
        return [fixed.cp] if fixed.cp >= 1 and gpus % fixed.cp == 0 and splits(fixed.cp) else []
    return [cp for cp in divisors(gpus) if splits(cp) and (cp == 1 or m.seq_len // cp >= CP_MIN_TOKENS)]


def layouts(job: Job, gpus: int, fixed: Fixed = Fixed()) -> Iterable[Layout]:
    """Every valid layout of ``gpus`` devices (memory not yet checked)."""
    m = job.model
    for tp in divisors(min(gpus, job.node)):
        if (fixed.tp is not None and tp != fixed.tp) or not tp_fits(m, tp):
            continue
        for cp in cp_sizes(m, gpus // tp, fixed):
            yield from _pipelines(job, gpus, tp, cp, fixed)


def _pipelines(job: Job, gpus: int, tp: int, cp: int, fixed: Fixed) -> Iterable[Layout]:
    """The layouts with ``tp`` and ``cp`` fixed: every pp, vpp and micro-batch size."""
    m = job.model
    for pp in divisors(gpus // (tp * cp)):
        if fixed.pp is not None and pp != fixed.pp:
            continue
        dp = gpus // (tp * cp * pp)
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
                                                 pp_partition=split, cp=cp), fixed)


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
            if base.cp > 1 and recompute == "selective" and fixed.recompute is None:
                continue  # under cp the same as none (the cp core is not recomputed)
            for sp in ((False, True) if base.tp > 1 else (False,)):
                if fixed.sequence_parallel is not None and sp != fixed.sequence_parallel:
                    continue
                for zero in ((0, 1) if base.dp * base.cp > 1 else (0,)):
                    if fixed.zero is not None and zero != fixed.zero:
                        continue
                    for comm in (fixed.cp_comm,) if fixed.cp_comm else CP_COMM if base.cp > 1 else ("ring",):
                        yield replace(base, schedule=schedule, recompute=recompute, sequence_parallel=sp, zero=zero,
                                      cp_comm=comm)


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
    every = list(layouts(job, gpus, fixed))
    if not every:
        return []
    ranked = sorted(every, key=lambda lay: rough_step(job, lay))  # stable: ties keep the layouts' order
    pool = list(islice(_fitting(job, ranked), shortlist))
    if not pool:
        pool = sorted(((lay, memory_bytes(job, lay)) for lay in every), key=lambda c: c[1])[:top]
    predicted = [predict(job, lay, memory=mem) for lay, mem in pool]  # the simulator: the costly part
    predicted.sort(key=lambda p: (not p.fits, p.step_time_s if p.fits else p.memory_bytes))
    return predicted[:top]


def _fitting(job: Job, ranked: Iterable[Layout]) -> Iterator[tuple[Layout, float]]:
    """The layouts whose memory fits the device, in the given order, with their memory."""
    usable = job.hardware.usable_memory_bytes
    for lay in ranked:
        mem = memory_bytes(job, lay)
        if mem <= usable:
            yield lay, mem
