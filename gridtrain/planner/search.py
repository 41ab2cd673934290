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

ZeRO is searched per layout: stage 0 and, where the dp x cp group has more than one
rank, stages 1, 2 and 3, each sharded over the whole group and, where the group spans
more than a node, over the dp (x cp) ranks of one node (``gpus_per_node / tp``: hybrid
sharding); ZeRO-3 with and without ``zero3_keep_gathered``. Within one layout and shard
group the stages form a chain, ZeRO-1, ZeRO-2, ZeRO-3 kept gathered, ZeRO-3, along which
the cost model's step never gets shorter and memory (but for tiny models, whose staging
buffers outweigh their gradients) shrinks; so a stage is only kept when no earlier one
of its chain fits (:func:`dominated`): ZeRO-2 and 3 come in where memory forbids ZeRO-1,
and win where they let a layout with less tp or pp fit. ZeRO-0 is always tried (it can
be faster or slower than ZeRO-1: no parameter gather, but an unsharded optimizer step).

Context parallelism is searched where it can pay: cp > 1 only while each rank keeps at
least ``CP_MIN_TOKENS`` tokens of a sequence (below that a step's attention is too short
to hide its key/value transfer, and the sequences that need cp are far longer), each
with both ``--cp-comm`` modes; selective recomputation is left out under cp (the cp core
is not recomputed, so it would be ``none`` again). A fixed ``cp`` is taken as given.

Expert parallelism is searched for a mixture of experts only: ep takes every divisor of
the ``dp x cp`` group that divides the experts (:func:`ep_sizes`; a dense model's layouts
have ep 1, so its search is unchanged), and beside ep > 1 every ZeRO stage, over the
whole group only (the runtime refuses ``--zero-shard-size`` with expert parallelism): the
experts' part of ZeRO's state, collectives and gathers is over their expert-data-parallel
group (``dp x cp / ep``). A fixed ``ep`` is taken as given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import islice

from gridtrain.config import ZERO_STAGES, ModelConfig
from gridtrain.memory.cp import CP_COMM_MODES
from gridtrain.parallel.pipeline.schedules import ScheduleError, check_sizes
from gridtrain.planner.cost import (Job, Layout, Prediction, block_cost, embedding_cost, head_cost, memory_bytes,
                                    micro_batches, predict, zero_chunk_seconds, zero_exposed_seconds)

SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "gpipe")
RECOMPUTE = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16)
VIRTUAL_STAGES = (1, 2, 3, 4)
CP_COMM = CP_COMM_MODES
CP_MIN_TOKENS = 1024  # the fewest tokens of a sequence a cp rank is left with, searching
ZERO = ZERO_STAGES
# (zero, keep gathered) in the order of the chain of the module docstring: step time up, memory down
ZERO_CHAIN = ((1, False), (2, False), (3, True), (3, False))


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
    zero_shard_size: int | None = None
    zero3_keep_gathered: bool | None = None
    ep: int | None = None


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


def ep_sizes(m: ModelConfig, group: int, fixed: Fixed = Fixed()) -> list[int]:
    """The expert-parallel sizes to try for a ``dp x cp`` group of ``group`` ranks: the
    divisors of the group that divide the experts (1 alone for a dense model; a fixed
    ep: itself, where it is one of them)."""
    sizes = [ep for ep in divisors(group) if m.n_experts % ep == 0] if m.n_experts else [1]
    if fixed.ep is not None:
        return [fixed.ep] if fixed.ep in sizes else []
    return sizes


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
                for ep in ep_sizes(m, dp * cp, fixed):
                    yield from _variants(job, Layout(dp=dp, tp=tp, pp=pp, vpp=vpp, micro_batch_size=mbs,
                                                     pp_partition=split, cp=cp, ep=ep), fixed)


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
                for comm in (fixed.cp_comm,) if fixed.cp_comm else CP_COMM if base.cp > 1 else ("ring",):
                    lay = replace(base, schedule=schedule, recompute=recompute, sequence_parallel=sp, cp_comm=comm)
                    for zero, shard, keep in zero_options(job, lay, fixed):
                        yield replace(lay, zero=zero, zero_shard_size=shard, zero3_keep_gathered=keep)


def zero_options(job: Job, lay: Layout, fixed: Fixed = Fixed()) -> Iterator[tuple[int, int | None, bool]]:
    """(zero, zero_shard_size, zero3_keep_gathered) to try for a layout: ZeRO-0; with more
    than one dp x cp rank ZeRO-1, 2 and 3 (3 kept gathered first), each over the whole
    group and, where the group spans more than a node, over the ``node / tp`` ranks of one
    node (hybrid sharding). Fixed fields narrow them; a fixed shard size must divide the
    group. With ep > 1 every stage over the whole group only (the runtime refuses hybrid
    sharding with expert parallelism; a rank's experts are sharded over their own
    expert-data-parallel group)."""
    group = lay.dp * lay.cp
    local = job.node // lay.tp
    if fixed.zero_shard_size is not None:
        fits = 1 <= fixed.zero_shard_size and group % fixed.zero_shard_size == 0 and lay.ep == 1
        shards = [fixed.zero_shard_size] if fits else []
    elif lay.ep > 1:
        shards = [None]
    else:
        shards = [None] + ([local] if 1 < local < group and group % local == 0 else [])
    for zero in ZERO if group > 1 else (0,):
        if fixed.zero is not None and zero != fixed.zero:
            continue
        for keep in (True, False) if zero == 3 else (False,):
            if fixed.zero3_keep_gathered is not None and keep != fixed.zero3_keep_gathered:
                continue
            if zero == 0:
                if fixed.zero_shard_size is None:
                    yield 0, None, False
                continue
            for shard in shards:
                yield zero, shard, keep


def dominated(lay: Layout) -> list[Layout]:
    """The layouts that make ``lay`` not worth predicting when they fit: the earlier ZeRO
    stages of its chain (module docstring) with the same shard group."""
    chain = [replace(lay, zero=z, zero3_keep_gathered=k) for z, k in ZERO_CHAIN]
    return chain[:chain.index(lay)] if lay in chain else []


def rough_step(job: Job, lay: Layout, parts: dict | None = None) -> float:
    """A cheap estimate for the first pass: one stage's compute for every micro-batch
    (with ZeRO-2/3's exposed collectives), stretched by the schedule's closed-form bubble.
    ``parts``: a cache of the compute by layout without its ZeRO fields, which a search
    shares between a layout's ZeRO stages."""
    key = (lay.dp, lay.cp, lay.tp, lay.pp, lay.vpp, lay.micro_batch_size, lay.schedule, lay.recompute,
           lay.sequence_parallel, lay.cp_comm, lay.pp_partition, lay.ep)
    model = job.model
    got = None if parts is None else parts.get(key)
    if got is None:
        block = _cached(parts, ("block", lay.micro_batch_size, lay.cp, lay.cp_comm, lay.tp, lay.sequence_parallel,
                                lay.recompute), lambda: block_cost(job, lay))
        hf, hb, hw_ = head_cost(job, lay)
        ef, eb = embedding_cost(job, lay)
        blocks = math.ceil(model.n_layer / lay.pp)
        per_mb = blocks * (block.f + block.b + block.w) + (hf + hb + hw_) / lay.pp
        forward, backward = blocks * block.f + ef, blocks * (block.b + block.w) + eb
        moe_blocks = round(blocks * len(model.moe_layers) / model.n_layer)  # a stage's share of the MoE blocks
        if moe_blocks:
            moe = _cached(parts, ("moe", lay.micro_batch_size, lay.cp, lay.cp_comm, lay.tp, lay.sequence_parallel,
                                  lay.recompute, lay.ep, lay.dp), lambda: block_cost(job, lay, moe=True))
            per_mb += moe_blocks * (moe.f + moe.b + moe.w - block.f - block.b - block.w)
            forward += moe_blocks * (moe.f - block.f)
            backward += moe_blocks * (moe.b + moe.w - block.b - block.w)
        got = (blocks, per_mb, forward, backward, moe_blocks)
        if parts is not None:
            parts[key] = got
    blocks, per_mb, forward, backward, moe_blocks = got
    if lay.zero >= 2:  # ZeRO-2/3's exposed collectives on the first stage (per micro-batch)
        zkey = (lay.dp * lay.cp, lay.tp, lay.zero, lay.zero_shard_size, lay.zero3_keep_gathered, blocks, lay.pp,
                lay.ep)
        comm = None if parts is None else parts.get(zkey)
        if comm is None:
            comm = zero_chunk_seconds(job, lay, blocks, True, lay.pp == 1, moe_blocks)
            if parts is not None:
                parts[zkey] = comm
        per_mb += sum(zero_exposed_seconds(comm, forward, backward))
    m = micro_batches(job, lay)
    # ZB-H1 as 1F1B: the runtime's blocking sends hold its deferred weight gradients back
    # (pipeline/simulate.py, rendezvous), so only the simulator can tell them apart
    bubble = (lay.pp - 1) / (lay.vpp * m)
    return m * per_mb * (1 + bubble)


def _cached(parts: dict | None, key: tuple, make):
    """``parts[key]``, made first where it is missing (no cache: made every time). A
    block's cost depends on fewer fields than the layout's rough step (not on dp, pp,
    vpp or the schedule; a MoE block's also on ep and dp), so the search's layouts share
    a few hundred of them."""
    if parts is None:
        return make()
    if key not in parts:
        parts[key] = make()
    return parts[key]


def search(job: Job, gpus: int, fixed: Fixed = Fixed(), top: int = 5, shortlist: int = 40) -> list[Prediction]:
    """The ``top`` layouts by predicted step time among those that fit (when none fits,
    the ones needing the least memory, marked as not fitting)."""
    every = list(layouts(job, gpus, fixed))
    if not every:
        return []
    parts: dict = {}
    ranked = sorted(every, key=lambda lay: rough_step(job, lay, parts))  # stable: ties keep the layouts' order
    peaks: dict = {}
    pool = list(islice(_fitting(job, ranked, set(every), peaks), shortlist))
    if not pool:
        pool = sorted(((lay, memory_bytes(job, lay, peaks)) for lay in every), key=lambda c: c[1])[:top]
    predicted = [predict(job, lay, memory=mem) for lay, mem in pool]  # the simulator: the costly part
    predicted.sort(key=lambda p: (not p.fits, p.step_time_s if p.fits else p.memory_bytes))
    return predicted[:top]


def _fitting(job: Job, ranked: Iterable[Layout], every: set[Layout], peaks: dict) -> Iterator[tuple[Layout, float]]:
    """The layouts whose memory fits the device and that no fitting layout of ``every``
    dominates (:func:`dominated`), in the given order, with their memory."""
    usable = job.hardware.usable_memory_bytes
    memory: dict[Layout, float] = {}

    def need(lay: Layout) -> float:
        if lay not in memory:
            memory[lay] = memory_bytes(job, lay, peaks)
        return memory[lay]

    for lay in ranked:
        if need(lay) <= usable and not any(d in every and need(d) <= usable for d in dominated(lay)):
            yield lay, need(lay)
