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

Expert parallelism is searched for a mixture of experts only (a dense model's layouts
have ep = etp = 1, so its search is unchanged): the expert grid ``etp x ep`` of each
stage (:func:`expert_grids`) takes every ep that divides the experts and the stage's tp x
cp x dp ranks over etp (:func:`ep_sizes`): where ep x etp divides dp x cp it is laid over
each dp x cp group, else folded over the stage's tp ranks too (MoE parallel folding, with
sequence parallelism where tp > 1); etp takes 1 and the divisors of the experts' width
(:func:`etp_sizes`). Beside ep x etp > 1 every ZeRO stage, over the whole group only (the
runtime refuses ``--zero-shard-size`` with expert parallelism): the experts' part of
ZeRO's state, collectives and gathers is over their expert-data-parallel group. A fixed
``ep`` or ``etp`` is taken as given.

For a mixture of experts the space is pruned where a searched dimension cannot win
(DeepSeek-V3 on 1,024 GPUs: 707,243 layouts and 23 s of CPU unpruned, 163,373 and 13 s
pruned, the same best layouts; Kimi K2 on 2,048 GPUs 21 s and 10 s, the same):

* etp > 1 only where it spreads a layer's experts over more ranks than ep alone can (ep x
  etp above the largest ep the stage allows: Mixtral's 8 experts on 64 ranks, not
  DeepSeek-V3's 256), and only within a node (its row collectives run in every MoE layer,
  as tp's do); Megatron-core's guidance is the same: etp 1 unless the experts are few;
* with tp > 1 only sequence-parallel layouts (without SP every tp rank routes and runs
  the same tokens through the experts, the work and the all-to-all bytes tp times over;
  Megatron-core requires SP beside MoE and tp);
* no GPipe (its step is 1F1B's in the cost model and it holds every micro-batch).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields, replace
from itertools import islice

from gridtrain.config import ZERO_STAGES, ModelConfig
from gridtrain.memory.cp import CP_COMM_MODES
from gridtrain.parallel.pipeline.schedules import ScheduleError, check_sizes
from gridtrain.planner.cost import (Job, Layout, Prediction, block_cost, embedding_cost, head_cost, memory_breakdown,
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
    etp: int | None = None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _given_or(value: int | None, choices: tuple[int, ...]) -> tuple[int, ...]:
    """A fixed field's value (any, not only the searched ones), else the choices."""
    return choices if value is None else (value,)


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
    """The expert-parallel sizes to try over ``group`` ranks (the tp x cp x dp ranks of a
    stage over etp: the expert grid may fold over all of them): the divisors of the group
    that divide the experts (1 alone for a dense model; a fixed ep: itself, where it is
    one of them)."""
    sizes = [ep for ep in divisors(group) if m.n_experts % ep == 0] if m.n_experts else [1]
    if fixed.ep is not None:
        return [fixed.ep] if fixed.ep in sizes else []
    return sizes


def etp_sizes(m: ModelConfig, fixed: Fixed = Fixed(), most: int = 8) -> list[int]:
    """The expert-tensor-parallel sizes to try: 1, and for a model whose experts etp can
    split (SwiGLU experts, no capacity factor) the divisors of the experts' width up to
    ``most`` (a node: etp's row collectives run in every MoE layer, as tp's do, so the
    search keeps them on NVLink); a fixed etp: itself, where the model allows it."""
    allowed = bool(m.n_experts) and m.arch == "llama" and m.moe_capacity_factor is None
    sizes = [etp for etp in divisors(m.moe_ffn_size) if etp <= most] if allowed else [1]
    if fixed.etp is not None:
        return [fixed.etp] if fixed.etp == 1 or (allowed and m.moe_ffn_size % fixed.etp == 0) else []
    return sizes


def expert_grids(m: ModelConfig, stage: int, node: int, fixed: Fixed = Fixed(), *, tp: int = 1,
                 group: int | None = None) -> list[tuple[int, int]]:
    """The (ep, etp) to try for a pipeline stage of ``stage`` = tp x cp x dp ranks (the
    dp x cp ``group`` of them): ep x etp divides the stage, ep the experts, etp the
    experts' width (:func:`etp_sizes`, :func:`ep_sizes`); where ep x etp does not divide
    dp x cp the grid folds over tp, and a searched etp > 1 keeps its group within a node
    (its members ``tp`` apart unfolded, neighbours folded). (1, 1) alone for a dense model."""
    group = stage // tp if group is None else group
    grids = []
    alone = max(ep_sizes(m, stage))  # the most ranks ep alone spreads a layer's experts over
    for etp in etp_sizes(m, fixed):
        if stage % etp:
            continue
        for ep in ep_sizes(m, stage // etp, fixed):
            if etp > 1 and fixed.etp is None and fixed.ep is None and ep * etp <= alone:
                continue  # searched, etp only spreads the experts further than ep alone can
            folded = ep * etp > 1 and group % (ep * etp) != 0
            if fixed.etp is None and etp > 1 and etp * (1 if folded else tp) > node:
                continue
            grids.append((ep, etp))
    return grids


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
        for vpp in _given_or(fixed.vpp, VIRTUAL_STAGES):
            if m.n_layer < pp * vpp or (vpp > 1 and pp == 1):
                continue
            if vpp > 1 and fixed.vpp is None and m.n_layer % (pp * vpp):
                continue  # searched, interleaving with equal chunks; a given --vpp takes any split
            # layers that do not divide evenly over the (virtual) stages: the runtime's
            # balanced split by parameters (--pp-layers printed), as BLOOM and Llama 3.1
            # 405B ran, and as a 94-layer model runs on pp 8 x vpp 4
            split = "uniform" if m.n_layer % (pp * vpp) == 0 else "parameters"
            for mbs in _given_or(fixed.micro_batch_size, MICRO_BATCHES):
                if job.global_batch_size % (mbs * dp):
                    continue
                for ep, etp in expert_grids(m, tp * cp * dp, job.node, fixed, tp=tp, group=dp * cp):
                    yield from _variants(job, Layout(dp=dp, tp=tp, pp=pp, vpp=vpp, micro_batch_size=mbs,
                                                     pp_partition=split, cp=cp, ep=ep, etp=etp), fixed)


def _variants(job: Job, base: Layout, fixed: Fixed) -> Iterable[Layout]:
    mbs = micro_batches(job, base)
    for schedule in SCHEDULES:
        if fixed.schedule is not None and schedule != fixed.schedule:
            continue
        if base.pp == 1 and schedule != "1f1b" and fixed.schedule is None:
            continue  # one stage: every schedule is the same accumulation loop
        if job.model.n_experts and schedule == "gpipe" and fixed.schedule is None:
            continue  # MoE (large searches): GPipe's step is 1F1B's and it holds every micro-batch
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
                if base.folded and base.tp > 1 and not sp:
                    continue  # experts folded over tp route each tp rank's own tokens: SP
                if job.model.n_experts and base.tp > 1 and not sp and fixed.sequence_parallel is None:
                    continue  # MoE with tp: SP (module docstring)
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
    apart = lay.ep * lay.etp > 1  # experts reduced over their own group
    if fixed.zero_shard_size is not None:
        fits = 1 <= fixed.zero_shard_size and group % fixed.zero_shard_size == 0 and not apart
        shards = [fixed.zero_shard_size] if fits else []
    elif apart:
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
           lay.sequence_parallel, lay.cp_comm, lay.pp_partition, lay.ep, lay.etp)
    model = job.model
    got = None if parts is None else parts.get(key)
    if got is None:
        block = _cached(parts, ("block", lay.micro_batch_size, lay.cp, lay.cp_comm, lay.tp, lay.sequence_parallel,
                                lay.recompute), lambda: block_cost(job, lay))
        moe_key = (lay.micro_batch_size, lay.cp, lay.cp_comm, lay.tp, lay.sequence_parallel, lay.recompute, lay.ep,
                   lay.etp, lay.dp)

        def moe_block():
            return _cached(parts, ("moe", *moe_key), lambda: block_cost(job, lay, moe=True))
        # (with multi-token prediction the head runs its blocks too: keyed as a MoE block is)
        kinds = {False: block, **({True: moe_block()} if model.n_experts else {})}
        hf, hb, hw_ = _cached(parts, ("head", *moe_key),
                              lambda: head_cost(job, lay, kinds) if model.mtp_layers else head_cost(job, lay))
        ef, eb = embedding_cost(job, lay)
        blocks = math.ceil(model.n_layer / lay.pp)
        per_mb = blocks * (block.f + block.b + block.w) + (hf + hb + hw_) / lay.pp
        forward, backward = blocks * block.f + ef, blocks * (block.b + block.w) + eb
        moe_layers = _cached(parts, ("moe layers",), lambda: len(model.moe_layers))
        moe_blocks = round(blocks * moe_layers / model.n_layer)  # a stage's share of the MoE blocks
        if moe_blocks:
            moe = moe_block()
            per_mb += moe_blocks * (moe.f + moe.b + moe.w - block.f - block.b - block.w)
            forward += moe_blocks * (moe.f - block.f)
            backward += moe_blocks * (moe.b + moe.w - block.b - block.w)
        got = (blocks, per_mb, forward, backward, moe_blocks)
        if parts is not None:
            parts[key] = got
    blocks, per_mb, forward, backward, moe_blocks = got
    if lay.zero >= 2:  # ZeRO-2/3's exposed collectives on the first stage (per micro-batch)
        zkey = (lay.dp * lay.cp, lay.tp, lay.zero, lay.zero_shard_size, lay.zero3_keep_gathered, blocks, lay.pp,
                lay.ep, lay.etp)
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


_FLAGS = {"micro_batch_size": "--micro-batch-size", "cp_comm": "--cp-comm", "zero_shard_size": "--zero-shard-size",
          "zero3_keep_gathered": "--zero3-keep-gathered", "sequence_parallel": "--sequence-parallel"}


def why_none(job: Job, gpus: int, fixed: Fixed) -> str:
    """Why no layout of ``gpus`` devices has the ``fixed`` fields, as one line: the given
    field without which layouts exist (the first in the order of :class:`Fixed`) and
    what it breaks, else that the model, GPU count and batch admit none."""
    m = job.model
    given = [f.name for f in fields(Fixed) if getattr(fixed, f.name) is not None]
    for name in given:
        if not any(True for _ in layouts(job, gpus, replace(fixed, **{name: None}))):
            continue
        value = getattr(fixed, name)
        flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
        reason = {
            "tp": lambda: f"tp must divide the {m.n_head} heads, the {m.kv_heads} key/value heads (or be a multiple "
                          f"of them) and stay within a node of {job.node}",
            "cp": lambda: f"cp must divide the GPUs and cut the {m.seq_len}-token sequence into 2 x cp equal chunks",
            "pp": lambda: f"pp x vpp must divide the GPUs left by tp x cp and be at most the {m.n_layer} layers",
            "vpp": lambda: f"vpp needs pp > 1 and pp x vpp at most the {m.n_layer} layers",
            "micro_batch_size": lambda: f"micro-batch x dp must divide the global batch of {job.global_batch_size}",
            "schedule": lambda: "the schedule's micro-batch count and stage rules (gridtrain schedule --help) rule it out",
            "ep": lambda: f"ep x etp must divide tp x cp x dp of a stage and ep the {m.n_experts} experts",
            "etp": lambda: "etp needs SwiGLU experts without a capacity factor, dividing their width",
            "zero_shard_size": lambda: "the shard group must divide dp x cp and experts (ep > 1) are not hybrid-sharded",
        }.get(name, lambda: "with the other given fields it admits no layout")()
        return f"plan: {flag} {value} leaves no layout of {gpus} GPUs with the other given fields: {reason}"
    return (f"plan: no layout of {gpus} GPUs divides this model and batch with the given fields; change --gpus, "
            "--global-batch-size or the fixed layout flags")


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
        pool = sorted(((lay, memory_breakdown(job, lay, peaks)) for lay in every),
                      key=lambda c: sum(c[1].values()))[:top]
    predicted = [predict(job, lay, memory=mem) for lay, mem in pool]  # the simulator: the costly part
    predicted.sort(key=lambda p: (not p.fits, p.step_time_s if p.fits else p.memory_bytes))
    return predicted[:top]


def _fitting(job: Job, ranked: Iterable[Layout], every: set[Layout],
             peaks: dict) -> Iterator[tuple[Layout, dict[str, float]]]:
    """The layouts whose memory fits the device and that no fitting layout of ``every``
    dominates (:func:`dominated`), in the given order, with their memory by kind."""
    usable = job.hardware.usable_memory_bytes
    memory: dict[Layout, dict[str, float]] = {}

    def parts(lay: Layout) -> dict[str, float]:
        if lay not in memory:
            memory[lay] = memory_breakdown(job, lay, peaks)
        return memory[lay]

    def need(lay: Layout) -> float:
        return sum(parts(lay).values())

    for lay in ranked:
        if need(lay) <= usable and not any(d in every and need(d) <= usable for d in dominated(lay)):
            yield lay, parts(lay)
