"""ZeRO-2, ZeRO-3 and hybrid sharding (HSDP) in the memory model and ``gridtrain plan``, as
data: the per-rank closed forms of gridtrain/memory/zero.py (parameters, gradients,
optimizer state, ZeRO-3's gathered set, the gradient staging) for every stage and dtype,
the collectives of a step per stage, the memory model of a layout (a hybrid shard group
of s ranks holds what s data-parallel ranks hold), the cost model's overlap of the
per-micro-batch collectives, the search over stages, shard groups and keep-gathered (it
takes ZeRO-3 where nothing else fits), and the JSON and the command it prints. No process
is started; searches stay small."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from fractions import Fraction

import pytest

from gridtrain.cli import parser as cli
from gridtrain.config import ModelConfig
from gridtrain.memory.model import expected_bytes, expected_parameters, expected_state_bytes, stage_parameters
from gridtrain.memory.zero import (GATHERED_BLOCKS, STAGING_BUCKETS, Collective, zero_state_bytes,
                                   zero_step_collectives)
from gridtrain.models.decoder import block_parameters
from gridtrain.parallel.pipeline.simulate import Costs
from gridtrain.planner import cost
from gridtrain.planner.command import describe, torchrun_command
from gridtrain.planner.cost import (Job, Layout, config_of, data_parallel_seconds, grid_of,
                                    memory_breakdown, memory_bytes, predict, ring_link, zero_chunk_seconds, zero_exposed_seconds,
                                    zero_links, zero_units)
from gridtrain.planner.machine import machine
from gridtrain.planner.measure import train_args
from gridtrain.planner.search import Fixed, dominated, layouts, search, zero_options
from gridtrain.training.validate import validate

H100 = machine("h100-sxm")
MiB = 2 ** 20
P = 3 * MiB  # parameters of a rank: divisible by every shard group below
LLAMA = ModelConfig(arch="llama", n_layer=4, n_head=8, n_kv_head=2, d_model=512, ffn_hidden=1376, seq_len=1024,
                    vocab_size=1000, tie_embeddings=False, attention="sdpa", dropout=0.0)
GPT = ModelConfig(n_layer=8, n_head=16, d_model=2048, seq_len=512, vocab_size=32000, attention="sdpa", dropout=0.0)


# ---- what a rank holds: the closed forms ----------------------------------------------------------------

# bytes per parameter of (parameters, gradients, optimizer state) held between steps, and
# which are over the shard group s: the table of gridtrain/memory/zero.py. ZeRO-2 and 3
# hold no gradient memory between steps: their w P / s gradient shard lives from backward
# to the optimizer step (gradient_shard_bytes, checked below)
HELD = {
    ("bf16", 0): ((2, 4, 12), (False, False, False)),
    ("fp16", 0): ((2, 4, 12), (False, False, False)),
    ("fp32", 0): ((4, 4, 8), (False, False, False)),  # torch's AdamW: two moments (+ 4 bytes a tensor)
    ("fp64", 0): ((8, 8, 16), (False, False, False)),
    ("bf16", 1): ((2, 4, 12), (False, False, True)),
    ("fp32", 1): ((4, 4, 12), (False, False, True)),  # ZeRO-1 keeps an fp32 master in fp32 runs too
    ("fp64", 1): ((8, 8, 24), (False, False, True)),
    ("bf16", 2): ((2, 0, 12), (False, True, True)),
    ("fp32", 2): ((4, 0, 12), (False, True, True)),
    ("fp64", 2): ((8, 0, 24), (False, True, True)),
    # the parameter shard is the master, in its dtype, in every dtype
    ("bf16", 3): ((4, 0, 8), (True, True, True)),
    ("fp16", 3): ((4, 0, 8), (True, True, True)),
    ("fp32", 3): ((4, 0, 8), (True, True, True)),
    ("fp64", 3): ((8, 0, 16), (True, True, True)),
}


@pytest.mark.parametrize("shard", [1, 4, 8])
@pytest.mark.parametrize("dtype,zero", sorted(HELD))
def test_zero_state_closed_forms(dtype, zero, shard):
    per_param, sharded = HELD[(dtype, zero)]
    tensors = 10
    got = zero_state_bytes(P, dtype, zero, shard, tensors=tensors)
    expected = [Fraction(b * P, shard if s else 1) for b, s in zip(per_param, sharded)]
    if zero == 0 and dtype in ("fp32", "fp64"):
        expected[2] += 4 * tensors  # AdamW's step count per tensor
    assert [got["parameter_bytes"], got["gradient_bytes"], got["optimizer_bytes"]] == expected
    assert got["gradient_shard_bytes"] == (Fraction(per_param[2] // 3 if zero < 3 else per_param[2] // 2, 1) * P
                                           / shard if zero >= 2 else 0)  # w P / s
    assert got["gathered_bytes"] == 0 or zero == 3
    assert (got["staging_bytes"] > 0) == (zero >= 2)


def test_bf16_zero_3_is_12_bytes_over_s_plus_the_working_set():
    """bf16 ZeRO-3 holds 4P/s (the fp32 parameter shard, the master) + 8P/s (the moments)
    all along, and within a step the 4P/s gradient shard, two gathered blocks and the
    non-block parameters (or, kept gathered, all of P), plus two fp32 buckets of gradient
    staging; a token table that is a unit of its own is not gathered beside them, and a
    root unit gathered only around the head is gathered instead of the blocks."""
    s, block, blocks = 8, 100_000, 24
    other = P - blocks * block  # embedding, final norm, head
    got = zero_state_bytes(P, "bf16", 3, s, block_params=block, blocks=blocks, bucket_mb=0.5)
    assert got["parameter_bytes"] + got["gradient_bytes"] + got["optimizer_bytes"] == 12 * P // s
    assert got["gradient_shard_bytes"] == 4 * P // s
    table = other // 3
    apart = zero_state_bytes(P, "bf16", 3, s, block_params=block, blocks=blocks, alone=table, root=other - table)
    assert apart["gathered_bytes"] == 2 * max(2 * block, other - table)
    assert GATHERED_BLOCKS == 2 and STAGING_BUCKETS == 2
    assert got["gathered_bytes"] == 2 * (2 * block + other)
    assert got["staging_bytes"] == 2 * MiB // 2
    kept = zero_state_bytes(P, "bf16", 3, s, block_params=block, blocks=blocks, keep_gathered=True)
    assert kept["gathered_bytes"] == 2 * P
    assert {k: v for k, v in kept.items() if k != "gathered_bytes"} == \
        {k: v for k, v in zero_state_bytes(P, "bf16", 3, s, block_params=block, blocks=blocks).items()
         if k != "gathered_bytes"}
    one = zero_state_bytes(P, "bf16", 3, s, block_params=block, blocks=1)  # fewer blocks than two
    assert one["gathered_bytes"] == 2 * P


def test_padding_staging_cap_and_bad_arguments():
    """A rank owns padded / s elements of the flat buffer (ZeRO-1 keeps the whole padded
    buffer); a staging buffer is a bucket or the whole gradient, whichever is smaller;
    stages and groups are checked."""
    got = zero_state_bytes(10, "bf16", 2, 4, padded=12)
    assert got == {"parameter_bytes": 20, "gradient_bytes": 0, "optimizer_bytes": 36, "gradient_shard_bytes": 12,
                   "gathered_bytes": 0, "staging_bytes": 2 * 48}
    assert zero_state_bytes(10, "bf16", 1, 4)["gradient_bytes"] == 48  # 10 rounded up to 12, whole
    assert zero_state_bytes(10, "bf16", 3, 4)["parameter_bytes"] == 12  # ceil(10 / 4) = 3 each, in fp32
    assert zero_state_bytes(10, "bf16", 3, 4, offload=True)["parameter_bytes"] == 6  # offloaded: in bf16
    with pytest.raises(ValueError, match="stage 4"):
        zero_state_bytes(P, "bf16", 4, 8)
    with pytest.raises(ValueError, match="at least one rank"):
        zero_state_bytes(P, "bf16", 1, 0)


# ---- what a rank sends: collectives per step -------------------------------------------------------------

M = 4  # micro-batches per step


def _traffic(zero, keep=False):
    """(kind, count, bytes, ranks) per purpose, for P bf16 parameters over 16 ranks."""
    g, e = 4 * P, 2 * P
    return {
        0: {"gradients": ("all_reduce", 1, g, 16)},
        1: {"gradients": ("reduce_scatter", 1, g, 16), "parameters": ("all_gather", 1, e, 16)},
        2: {"gradients": ("reduce_scatter", M, g, 16), "parameters": ("all_gather", 1, e, 16)},
        3: {"gradients": ("reduce_scatter", M, g, 16), "parameters": ("all_gather", 1 if keep else 2 * M, e, 16)},
    }[zero]


@pytest.mark.parametrize("zero,keep", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_collectives_per_step(zero, keep):
    got = zero_step_collectives(P, "bf16", zero, M, 16, keep_gathered=keep)
    assert got == {k: Collective(*v) for k, v in _traffic(zero, keep).items()}
    # hybrid sharding: the same within groups of 4, plus the gradient shard's all-reduce across the 4 groups
    hsdp = zero_step_collectives(P, "bf16", zero, M, 16, shard=4, keep_gathered=keep)
    if zero == 0:
        assert hsdp == got
    else:
        assert hsdp.pop("replicas") == Collective("all_reduce", 1, 4 * P // 4, 4)
        assert hsdp == {k: c._replace(ranks=4) for k, c in got.items()}


def test_no_collectives_on_one_rank_and_groups_that_divide():
    assert zero_step_collectives(P, "bf16", 3, M, 1) == {}
    assert zero_step_collectives(P, "fp64", 0, M, 2) == {"gradients": Collective("all_reduce", 1, 8 * P, 2)}
    assert zero_step_collectives(P, "fp32", 2, M, 2)["parameters"].nbytes == 4 * P
    with pytest.raises(ValueError, match="does not divide"):
        zero_step_collectives(P, "bf16", 2, M, 16, shard=6)


# ---- the memory model of a layout --------------------------------------------------------------------

def _cfg(model: ModelConfig, lay: Layout, dtype: str = "bf16"):
    return config_of(Job(model, 16, H100, dtype), lay)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_a_hybrid_shard_group_holds_what_as_many_dp_ranks_hold(zero):
    """dp 8 sharded in groups of 4 (and dp 2 x cp 2 sharded whole) holds, stage by stage,
    what dp 4 sharded whole holds: the state depends on the shard group only."""
    four = Layout(dp=4, tp=2, pp=2, zero=zero)
    for other in (replace(four, dp=8, zero_shard_size=4), replace(four, dp=2, cp=2)):
        for stage in (0, 1):
            a = expected_state_bytes(_cfg(LLAMA, four), grid_of(four), grid_of(four).rank_of(0, stage, 1))
            b = expected_state_bytes(_cfg(LLAMA, other), grid_of(other), grid_of(other).rank_of(1, stage, 1))
            assert a == b, (other, stage)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("keep", [False, True])
def test_the_memory_model_is_the_closed_forms(dtype, keep):
    """expected_state_bytes is zero_state_bytes of the rank's parameters, blocks and
    buffer; expected_bytes its held part (what the dry run measures), ZeRO-1's as before."""
    lay = Layout(dp=4, tp=2, pp=2, zero=3, zero3_keep_gathered=keep)
    cfg, grid = _cfg(LLAMA, lay, dtype), grid_of(lay)
    for stage in (0, 1):
        rank = grid.rank_of(0, stage, 0)
        n = expected_parameters(cfg, grid, rank)
        state = expected_state_bytes(cfg, grid, rank)
        # ZeRO-3's buckets are its units: a block, the first stage's token table (a unit of
        # its own: the head is not tied to it), or the last stage's root unit (final norm and
        # head, gathered from the final norm's forward only)
        table = stage_parameters(LLAMA, 2, 0, True, False) if stage == 0 else 0
        root = stage_parameters(LLAMA, 2, 0, stage == 0, stage == 1) - table
        closed = zero_state_bytes(n, dtype, 3, 4, bucket_mb=cfg.parallel.bucket_mb,
                                  block_params=block_parameters(LLAMA, 2), blocks=2, keep_gathered=keep,
                                  largest_bucket=max(root, table, block_parameters(LLAMA, 2)), alone=table,
                                  root=root)
        # between uses the table's parameter is a zero-stride view of one zero element
        closed["parameter_bytes"] += {"bf16": 2, "fp32": 4}[dtype] if table else 0
        assert state == {"parameters": n, **closed}
        assert expected_bytes(cfg, grid, rank) == {k: state[k] for k in ("parameters", "parameter_bytes",
                                                                          "gradient_bytes", "optimizer_bytes")}
    one = replace(lay, zero=1, zero3_keep_gathered=False)
    held = expected_bytes(_cfg(LLAMA, one, dtype), grid, 0)
    assert held["gradient_bytes"] == 4 * held["parameters"] and held["optimizer_bytes"] == 12 * held["parameters"] // 4


def test_planner_memory_adds_zero_s_transients():
    """The planner's memory per GPU: held state, ZeRO-2/3's gradient shard (whole beside
    the activation peak of a step of several micro-batches), ZeRO-3's gathered set and
    the staging, and the activation peak; each stage of the chain needs less (for a model
    whose gradients outweigh two buckets)."""
    job = Job(GPT, 32, H100)
    base = Layout(dp=8, tp=1, pp=1, recompute="full")
    needs = [memory_bytes(job, replace(base, zero=z, zero3_keep_gathered=k)) for z, k in
             ((0, False), (1, False), (2, False), (3, False))]
    assert needs == sorted(needs, reverse=True)
    kept = memory_bytes(job, replace(base, zero=3, zero3_keep_gathered=True))
    # kept gathered: the parameters whole beside ZeRO-3's shards
    assert needs[3] < kept and needs[3] < needs[2]
    cfg = config_of(job, replace(base, zero=3))
    state = expected_state_bytes(cfg, grid_of(base), 0)
    three, zero = memory_breakdown(job, replace(base, zero=3)), memory_breakdown(job, base)
    assert three["transients"] == state["gathered_bytes"] + state["staging_bytes"]
    assert three["activations"] == zero["activations"]
    assert three["gradients"] == state["gradient_shard_bytes"] > 0 == state["gradient_bytes"]
    assert needs[3] - needs[0] == pytest.approx(
        sum(state[k] for k in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "gradient_shard_bytes",
                               "gathered_bytes", "staging_bytes"))
        - sum(expected_state_bytes(config_of(job, base), grid_of(base), 0)[k]
              for k in ("parameter_bytes", "gradient_bytes", "optimizer_bytes")))
    # ZeRO-1 and 2 publish the weights in place (the parameters' flat buffer): nothing beside
    # them at the step's end, whose high point is the activations'
    one = memory_breakdown(job, replace(base, zero=1))
    assert one["activations"] == zero["activations"] and one["transients"] == 0


# ---- the cost model ----------------------------------------------------------------------------------

def test_hybrid_sharding_links():
    """The shard group is node / tp consecutive dp ranks tp apart (NVLink); the groups'
    all-reduce joins one rank of each node (one NIC)."""
    job = Job(LLAMA, 64, H100)
    whole, local = zero_links(job, Layout(dp=32, tp=2, pp=1, zero=3))
    assert whole == ring_link(H100, 32, 2, 8) and whole != H100.nvlink
    hsdp = Layout(dp=32, tp=2, pp=1, zero=3, zero_shard_size=4)
    shard, across = zero_links(job, hsdp)
    assert (shard, across) == (H100.nvlink, H100.network)
    assert hsdp.zero_shard == 4 and Layout(dp=8, tp=2, pp=1, cp=2).zero_shard == 16


def test_zero_3_gathers_unit_by_unit():
    """Per micro-batch and chunk ZeRO-3 gathers the embedding's parameters, each block's
    and the head's (forward, and again for the backward) and reduce-scatters each unit's
    gradients; kept gathered only the reduce-scatters; ZeRO-2 only the reduce-scatter of
    the chunk's gradients; ZeRO-0 and 1 nothing per micro-batch."""
    job = Job(LLAMA, 64, H100)
    lay = Layout(dp=8, tp=1, pp=2, zero=3)
    units = zero_units(LLAMA, 1, 2, True, False)
    assert units == [LLAMA.padded_vocab_size(1) * 512, block_parameters(LLAMA, 1), block_parameters(LLAMA, 1)]
    assert zero_units(LLAMA, 1, 2, False, True) == \
        [block_parameters(LLAMA, 1)] * 2 + [512 + LLAMA.padded_vocab_size(1) * 512]  # final norm, head
    link = zero_links(job, lay)[0]
    gathers = [link.collective(2 * u, 8, "all_gather") for u in units]
    scatters = sum(link.collective(4 * u, 8, "reduce_scatter") for u in units)
    assert zero_chunk_seconds(job, lay, 2, True, False) == pytest.approx((sum(gathers), gathers[0],
                                                                          sum(gathers) + scatters))
    kept = replace(lay, zero3_keep_gathered=True)
    assert zero_chunk_seconds(job, kept, 2, True, False) == pytest.approx((0.0, 0.0, scatters))
    two = replace(lay, zero=2)
    assert zero_chunk_seconds(job, two, 2, True, False) == pytest.approx(
        (0.0, 0.0, link.collective(4 * sum(units), 8, "reduce_scatter")))
    for zero in (0, 1):
        assert zero_chunk_seconds(job, replace(lay, zero=zero), 2, True, False) == (0.0, 0.0, 0.0)
    assert zero_chunk_seconds(job, replace(lay, dp=1), 2, True, False) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("comm,forward,backward,exposed,hidden", [
    ((3.0, 1.0, 5.0), 10.0, 10.0, (1.0, 0.0), (2.0, 5.0)),  # hidden but for the forward's first gather
    ((3.0, 1.0, 5.0), 1.5, 2.0, (1.5, 3.0), (1.5, 2.0)),  # the excess over the compute
    ((0.0, 0.0, 5.0), 1.0, 4.0, (0.0, 1.0), (0.0, 4.0)),  # ZeRO-2 / kept gathered: nothing in the forward
])
def test_collectives_hide_behind_the_chunk_up_to_its_compute(comm, forward, backward, exposed, hidden):
    """The excess over the compute is exposed; what hides costs OVERLAP_COST of its time."""
    assert 0 < cost.OVERLAP_COST < 1
    assert zero_exposed_seconds(comm, forward, backward) == pytest.approx(
        tuple(e + cost.OVERLAP_COST * h for e, h in zip(exposed, hidden)))


def test_data_parallel_seconds_per_stage():
    """Once per step: ZeRO-0's all-reduce and ZeRO-1's reduce-scatter (HSDP: and the
    all-reduce across the groups) behind the last backward; ZeRO-2/3 only the groups'
    all-reduce (and the last bucket); the parameter gather behind the first forward for
    ZeRO-1, 2 and 3 kept gathered, none for ZeRO-3 (its gathers are in F and B)."""
    job = Job(replace(LLAMA, seq_len=4096), 64, H100)
    params = 10 ** 9

    def idle(stage: int, chunk: int) -> Costs:  # nothing to hide behind
        return Costs(f=0.0, b=0.0, w=0.0)

    lay = Layout(dp=16, tp=1, pp=1)
    hsdp = replace(lay, zero_shard_size=8)
    shard, across = zero_links(job, hsdp)
    whole = zero_links(job, lay)[0]
    rs = shard.collective(4 * params, 8, "reduce_scatter")
    ag = shard.collective(2 * params, 8, "all_gather")
    ar = across.collective(4 * params // 8, 2, "all_reduce")
    opt = data_parallel_seconds(job, replace(lay, zero=1), params, idle, 25.0)[2]
    assert data_parallel_seconds(job, lay, params, idle, 25.0) == pytest.approx(
        (whole.collective(4 * params, 16), 0.0, 16 * opt))
    assert data_parallel_seconds(job, replace(hsdp, zero=1), params, idle, 25.0) == pytest.approx(
        (rs + ar, ag, 2 * opt))
    bucket = 25 * MiB / (4 * params)
    for zero, keep, gather in ((2, False, ag), (3, True, ag), (3, False, 0.0)):
        got = data_parallel_seconds(job, replace(hsdp, zero=zero, zero3_keep_gathered=keep), params, idle, 25.0)
        assert got == pytest.approx((max(ar, (rs + ar) * bucket), gather, 2 * opt)), (zero, keep)


def test_zero_3_costs_ride_in_the_pipeline():
    """A small model at a short sequence: ZeRO-3's gathers do not hide behind its compute;
    the exposed part is inside the chunks' F and B (the step grows by it) and reported."""
    job = Job(replace(LLAMA, seq_len=256), 16, H100)
    one = predict(job, Layout(dp=8, tp=1, pp=1, zero=1), memory=False)
    three = predict(job, Layout(dp=8, tp=1, pp=1, zero=3), memory=False)
    assert one.zero_comm_s == 0.0 and three.zero_comm_s > 0.0
    assert three.compute_s == pytest.approx(one.compute_s + three.zero_comm_s, rel=1e-9)
    assert three.as_json()["breakdown_s"]["zero_comm"] == three.zero_comm_s


# ---- the search --------------------------------------------------------------------------------------

def test_zero_options_and_the_chain():
    job = Job(LLAMA, 64, H100)
    opts = list(zero_options(job, Layout(dp=16, tp=1, pp=1)))
    assert opts == [(0, None, False), (1, None, False), (1, 8, False), (2, None, False), (2, 8, False),
                    (3, None, True), (3, 8, True), (3, None, False), (3, 8, False)]
    assert [o[1] for o in zero_options(job, Layout(dp=8, tp=2, pp=1))] == [None, None, 4, None, 4, None, 4, None, 4]
    assert list(zero_options(job, Layout(dp=8, tp=1, pp=1)))[1:3] == [(1, None, False), (2, None, False)]  # a node
    assert list(zero_options(job, Layout(dp=1, tp=8, pp=1))) == [(0, None, False)]
    assert list(zero_options(job, Layout(dp=16, tp=1, pp=1), Fixed(zero=3, zero3_keep_gathered=False))) == \
        [(3, None, False), (3, 8, False)]
    assert list(zero_options(job, Layout(dp=16, tp=1, pp=1), Fixed(zero_shard_size=4))) == \
        [(1, 4, False), (2, 4, False), (3, 4, True), (3, 4, False)]
    assert list(zero_options(job, Layout(dp=16, tp=1, pp=1), Fixed(zero_shard_size=6))) == []
    lay = Layout(dp=16, tp=1, pp=1, zero=3, zero_shard_size=8)
    assert dominated(lay) == [replace(lay, zero=1), replace(lay, zero=2),
                              replace(lay, zero3_keep_gathered=True)]
    assert dominated(replace(lay, zero=1)) == [] and dominated(replace(lay, zero=0, zero_shard_size=None)) == []


def _tight(job: Job, need: float) -> Job:
    """The job on a device whose usable memory is ``need``."""
    return replace(job, hardware=replace(job.hardware, memory=need / job.hardware.usable_fraction))


def test_search_takes_zero_3_where_nothing_else_fits():
    """With tp = pp = 1 on 8 GPUs and a device between ZeRO-3's need and ZeRO-2's,
    ZeRO-0, 1, 2 and 3 kept gathered do not fit, ZeRO-3 does: the search returns it."""
    job = Job(GPT, 32, H100)
    base = Layout(dp=8, tp=1, pp=1, recompute="full")
    z2, z3 = (memory_bytes(job, replace(base, zero=z)) for z in (2, 3))
    small = _tight(job, (z2 + z3) / 2)
    best = search(small, 8, Fixed(tp=1, pp=1, cp=1, micro_batch_size=1, recompute="full"))
    assert [(p.layout.zero, p.layout.zero3_keep_gathered, p.fits) for p in best] == [(3, False, True)]
    roomy = search(job, 8, Fixed(tp=1, pp=1, cp=1, micro_batch_size=1, recompute="full"))
    assert {p.layout.zero for p in roomy} == {0, 1}  # where ZeRO-1 fits, ZeRO-2 and 3 only cost more
    assert roomy[0].step_time_s < predict(job, replace(base, zero=3)).step_time_s


def test_zero_3_lets_a_smaller_tp_fit_and_win():
    """On a device too small for tp 1 under ZeRO-1 and 2, the search without ZeRO-2/3
    needs tp 2; with them tp 1 fits under ZeRO-3 and is the faster layout."""
    job = Job(GPT, 32, H100)
    fixed = dict(pp=1, cp=1, micro_batch_size=1, recompute="full", sequence_parallel=False)
    z2 = memory_bytes(job, Layout(dp=8, tp=1, pp=1, recompute="full", zero=2))
    z3 = memory_bytes(job, Layout(dp=8, tp=1, pp=1, recompute="full", zero=3))
    small = _tight(job, (z2 + z3) / 2)
    without = search(small, 8, Fixed(zero=1, **fixed), top=1)[0]
    assert without.fits and without.layout.tp > 1
    best = search(small, 8, Fixed(**fixed), top=1)[0]
    assert (best.layout.tp, best.layout.zero, best.fits) == (1, 3, True)
    assert best.step_time_s < without.step_time_s


def test_keep_gathered_is_chosen_under_zero_3_where_it_fits():
    """Kept gathered, ZeRO-3 gathers once a step instead of twice a micro-batch: faster,
    and chosen under --zero 3 when it fits; where it does not, ZeRO-3 gathers per block."""
    job = Job(GPT, 32, H100)
    fixed = dict(tp=1, pp=1, cp=1, micro_batch_size=1, recompute="full", zero=3)
    base = Layout(dp=8, tp=1, pp=1, recompute="full", zero=3)
    kept = replace(base, zero3_keep_gathered=True)
    assert predict(job, kept).step_time_s < predict(job, base).step_time_s
    assert [p.layout.zero3_keep_gathered for p in search(job, 8, Fixed(**fixed))] == [True]
    tight = _tight(job, (memory_bytes(job, kept) + memory_bytes(job, base)) / 2)
    assert [p.layout.zero3_keep_gathered for p in search(tight, 8, Fixed(**fixed))] == [False]


def test_hybrid_sharding_is_searched_beyond_a_node():
    job = Job(LLAMA, 64, H100)
    found = list(layouts(job, 16, Fixed(tp=1, pp=1, cp=1, micro_batch_size=4, recompute="none")))
    assert {(lay.zero, lay.zero_shard_size, lay.zero3_keep_gathered) for lay in found} == \
        set(zero_options(job, Layout(dp=16, tp=1, pp=1)))
    assert all(lay.zero_shard_size is None for lay in layouts(job, 8, Fixed(tp=1, pp=1)))


# ---- the command line ---------------------------------------------------------------------------------

PLAN = ["plan", "--arch", "llama", "--n-layer", "4", "--n-head", "8", "--n-kv-head", "2", "--d-model", "512",
        "--ffn-size", "1376", "--vocab-size", "1000", "--seq-len", "1024", "--global-batch-size", "64",
        "--hardware", "h100-sxm"]


def test_plan_json_carries_zero_and_hybrid_sharding(capsys, no_process_may_start):
    fixed = [*PLAN, "--gpus", "16", "--tp", "1", "--pp", "1", "--cp", "1", "--micro-batch-size", "4",
             "--recompute", "none", "--json"]
    assert cli.main([*fixed, "--zero", "3", "--zero-shard-size", "8", "--top", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert rows and all((r["zero"], r["zero_shard_size"]) == (3, 8) for r in rows)
    assert all(isinstance(r["zero3_keep_gathered"], bool) and "zero_comm" in r["breakdown_s"] for r in rows)
    assert cli.main([*fixed, "--zero", "1", "--top", "1"]) == 0
    plain = json.loads(capsys.readouterr().out)["layouts"][0]
    assert (plain["zero"], plain["zero3_keep_gathered"]) == (1, False) and plain["zero_shard_size"] in (None, 8)
    assert cli.main([*PLAN, "--gpus", "8", "--top", "1", "--json"]) == 0  # one node: no hybrid sharding to try
    assert json.loads(capsys.readouterr().out)["layouts"][0]["zero_shard_size"] is None


@pytest.mark.parametrize("lay,flags", [
    (Layout(dp=16, tp=1, pp=1, zero=3, zero_shard_size=8, zero3_keep_gathered=True),
     "--zero 3 --zero-shard-size 8 --zero3-keep-gathered"),
    (Layout(dp=16, tp=1, pp=1, zero=2), "--zero 2"),
    (Layout(dp=8, tp=2, pp=1, zero=1, zero_shard_size=4), "--zero 1 --zero-shard-size 4"),
    (Layout(dp=16, tp=1, pp=1), ""),
])
def test_the_command_carries_the_zero_flags(lay, flags):
    """The printed command and --measure's run name the ZeRO stage, the shard group and
    keep-gathered; the training parser and validation take them as printed."""
    args = cli.build_parser().parse_args([*PLAN, "--gpus", "16"])
    p = predict(Job(LLAMA, 64, H100), lay, memory=False)
    command = torchrun_command(args, p, 8)
    assert command.endswith(flags) if flags else "--zero" not in command
    words = shlex.split(command)
    cfg = cli.config_from_args(cli.build_parser().parse_args(words[words.index("gridtrain") + 1:]))
    if not lay.zero_shard_size:  # the runtime refuses hybrid sharding until it is built
        cfg = validate(cfg, 16)
    par = cfg.parallel
    assert (par.zero, par.zero_shard_size, par.zero3_keep_gathered) == \
        (lay.zero, lay.zero_shard_size, lay.zero3_keep_gathered)
    assert " ".join(lay.zero_flags()) == flags
    assert flags in " ".join(train_args([], p, 64, 1024, "bf16", 3))
    assert (lay.zero_name() in describe(p)) and (("ZeRO" in describe(p)) == bool(lay.zero))
    if lay.zero_shard_size:
        assert f"shard {lay.zero_shard_size}" in lay.zero_name()


DOCUMENTED = ["plan", "--model", "llama3-8b", "--seq-len", "8192", "--global-batch-size", "64", "--gpus", "8",
              "--hardware", "h100-sxm", "--top", "1", "--json"]


@pytest.mark.slow
def test_llama3_8b_on_8_h100s_takes_zero_3(capsys, no_process_may_start):
    """docs/planner.md's example: on one node of H100s Llama 3 8B at 8192 tokens runs as
    dp 8 under ZeRO-3 without recomputation, faster than the best with ZeRO-1 or ZeRO-2
    (dp 4 with two ranks a sequence), whose gradient reduction and parameter gather at
    the step's end nothing hides. (It was dp 4 x tp 2 under ZeRO-2 while ZeRO-3 kept a
    bf16 parameter shard beside its fp32 masters and its root unit held the token table
    too, staged in fp32 through backward: dp 8 then fitted only with recomputation. Now
    the shard is the master, the table is a unit of its own and the root's staging is
    the head's: 6 GB of transients beside 48 GB of activations fit.)"""
    assert cli.main(DOCUMENTED) == 0
    best = json.loads(capsys.readouterr().out)["layouts"][0]
    assert (best["dp"], best["tp"] * best["cp"], best["pp"], best["zero"], best["zero_shard_size"],
            best["fits"]) == (8, 1, 1, 3, None, True)
    assert best["recompute"] == "none"
    for zero in ("1", "2"):
        assert cli.main([*DOCUMENTED, "--zero", zero]) == 0
        other = json.loads(capsys.readouterr().out)["layouts"][0]
        assert other["zero"] == int(zero) and other["dp"] * other["tp"] * other["cp"] == 8
        assert best["step_time_s"] < other["step_time_s"]


DRY_RUNS = {  # preset, ZeRO fields, dtype: every rank of dp 2 x tp 2 x pp 2
    "gpt2-zero2-bf16": ("tiny", dict(zero=2), "bf16"),
    "gpt2-zero3-kept-bf16": ("tiny", dict(zero=3, zero3_keep_gathered=True), "bf16"),
    "llama-zero3-fp32": ("llama-tiny", dict(zero=3), "fp32"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", DRY_RUNS)
def test_held_bytes_are_the_dry_runs(case):
    """The runtime's own code on fake tensors (gridtrain/dryrun.py) holds exactly the
    parameter, gradient and optimizer bytes of expected_bytes under ZeRO-2 and 3 (the
    rank's gradient shard, ZeRO-3's parameter shard, no fp32 master beside an fp32 shard)."""
    from gridtrain import dryrun
    from gridtrain.config import preset_config, set_fields
    from gridtrain.parallel.grid import ProcessGrid

    preset, zero, dtype = DRY_RUNS[case]
    cfg = preset_config(preset)
    cfg.parallel.tp, cfg.parallel.pp = 2, 2
    cfg.training.device = "cpu"
    cfg = set_fields(cfg, dtype=dtype, **zero)
    grid = ProcessGrid.build(8, tp=2, pp=2)
    for r in dryrun.dry_run(cfg, 8, "all", out=lambda *_: None)["ranks"]:
        expected = expected_bytes(cfg, grid, r["rank"])
        assert {k: r[k] for k in expected} == expected, r["rank"]
