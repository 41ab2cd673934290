"""Mixtures of experts in the memory model and ``gridtrain plan``, as data: the closed
forms of gridtrain/memory/moe.py (total and active parameters, model FLOPs over active
parameters, a rank's experts, the all-to-all bytes, the activation terms), the memory
model against the runtime's own MoE layer and its dry run, the cost model's MoE block
(expert GEMMs one by one, all-to-alls on the link the ep group spans, the TP collectives
a routed layer does without, the statistics' all-reduce hidden behind the experts),
ZeRO-2/3 beside ep > 1 (the experts' shards, gathers and reduce-scatters over their
expert-data-parallel group; the dry run of every rank to the byte), the search over ep
(divisibility, every ZeRO stage but no hybrid sharding beside ep > 1), the JSON's ``ep``
and the printed ``--ep``, and dense plans exactly as before. No process is started;
searches stay small."""

from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import replace

import pytest
import torch

from gridtrain.cli import parser as cli
from gridtrain.config import ModelConfig, preset_config
from gridtrain.memory import activations
from gridtrain.memory.model import (expected_activation_peak, expected_bytes, expected_parameters,
                                    expected_state_bytes, stage_parameter_split)
from gridtrain.memory.moe import (INDEX_BYTES, ROUTING_INDICES, all_to_all_bytes, all_to_all_payload,
                                  dense_block_parameters, expert_parameters, model_flops_per_token,
                                  moe_activation_terms, moe_active_parameters, moe_block_parameters,
                                  moe_mlp_bytes_per_token, moe_step_all_to_all, moe_total_parameters,
                                  routed_tokens)
from gridtrain.memory.zero import STAGING_BUCKETS
from gridtrain.models import decoder
from gridtrain.models.decoder import block_parameters, count_parameters, training_flops_per_token
from gridtrain.planner.cost import (EXPERT_KERNELS, HOST_SYNC_S, MOE_BLOCK_COLLECTIVES, Job, Layout,
                                    all_to_all_seconds, block_cost, config_of, data_parallel_seconds,
                                    expert_gemm_seconds, expert_tp_seconds, grid_of, memory_bytes, moe_comm_seconds,
                                    moe_gemm_seconds, moe_routing, predict, ring_link, statistics_seconds,
                                    tiny_all_reduce_seconds, tp_collectives, zero_chunk_seconds, zero_unit_parts,
                                    zero_units)
from gridtrain.planner import cost
from gridtrain.planner.machine import machine
from gridtrain.planner.search import Fixed, ep_sizes, layouts, search
from gridtrain.training.validate import validate

H100 = machine("h100-sxm")
MIXTRAL = preset_config("mixtral-8x7b").model
# Qwen3-30B-A3B (Hugging Face config.json), built here whatever the presets hold
QWEN3 = ModelConfig(arch="llama", n_layer=48, n_head=32, n_kv_head=4, d_model=2048, attn_head_dim=128, qk_norm="head",
                    ffn_hidden=6144, vocab_size=151936, tie_embeddings=False, seq_len=4096, n_experts=128,
                    moe_top_k=8, moe_ffn_hidden=768)
# a small MoE for the searches: 8 layers, 8 experts of top 2
SMALL = ModelConfig(arch="llama", n_layer=8, n_head=16, n_kv_head=4, d_model=1024, ffn_hidden=2816, seq_len=2048,
                    vocab_size=32000, tie_embeddings=False, attention="sdpa", dropout=0.0, n_experts=8, moe_top_k=2)


# ---- parameters and FLOPs --------------------------------------------------------------------------------

def test_mixtral_8x7b_counts_46_7b_parameters_12_9b_active():
    """Per layer: attention 2 x 4096^2 + 2 x 4096 x 1024, two RMSNorms, the router 8 x 4096
    and 8 SwiGLU experts of 3 x 4096 x 14336; the embedding and the untied head 32000 x
    4096 each and the final norm. Active: 2 experts of 8."""
    d, f, layers = 4096, 14336, 32
    attention, norms, router, expert = 2 * d * d + 2 * d * 1024, 2 * d, 8 * d, 3 * d * f
    outside = 2 * 32000 * d + d
    assert expert_parameters(MIXTRAL) == expert == 176_160_768
    assert moe_total_parameters(MIXTRAL) == layers * (attention + norms + router + 8 * expert) + outside \
        == 46_702_792_704
    assert moe_active_parameters(MIXTRAL) == layers * (attention + norms + router + 2 * expert) + outside \
        == 12_879_925_248


def test_qwen3_30b_a3b_counts_30_5b_parameters_3_3b_active():
    """Qwen3's own head size (q 32 x 128 = 4096 wide on d 2048) and per-head q/k norms."""
    d, hd = 2048, 128
    attention = 2 * d * 32 * hd + 2 * d * 4 * hd
    per_layer = attention + 2 * d + 2 * hd + 128 * d
    expert = 3 * d * 768
    outside = 2 * 151936 * d + d
    assert moe_total_parameters(QWEN3) == 48 * (per_layer + 128 * expert) + outside == 30_532_122_624
    assert moe_active_parameters(QWEN3) == 48 * (per_layer + 8 * expert) + outside == 3_353_032_704


def test_dense_models_count_as_before():
    for m in (MIXTRAL, QWEN3):
        dense = replace(m, n_experts=0, qk_norm=None)
        assert moe_total_parameters(dense) == moe_active_parameters(dense) == count_parameters(dense)
        assert model_flops_per_token(dense) == training_flops_per_token(dense)


def test_moe_every_and_shared_experts_and_gpt2_experts():
    m = replace(SMALL, moe_every=2, moe_shared_experts=2, moe_ffn_hidden=512)
    d, h = 1024, 512
    dense_mlp, router, shared, expert = 3 * d * 2816, 8 * d, 3 * d * 2 * h, 3 * d * h
    assert moe_block_parameters(m, 1, 1) == (dense_block_parameters(m) - dense_mlp + router + shared, 8 * expert)
    assert moe_block_parameters(m, 2, 4) == (dense_block_parameters(m, 2) - dense_mlp // 2 + router + shared // 2,
                                             2 * expert)
    dense = replace(m, n_experts=0)
    assert moe_total_parameters(m) == count_parameters(dense) + 4 * (router + shared + 8 * expert - dense_mlp)
    assert moe_active_parameters(m) == count_parameters(dense) + 4 * (router + shared + 2 * expert - dense_mlp)
    gpt = ModelConfig(n_layer=2, n_head=4, d_model=64, seq_len=64, vocab_size=257, n_experts=4, moe_top_k=1,
                      moe_ffn_hidden=96)
    assert expert_parameters(gpt) == 2 * 64 * 96 + 96 + 64  # fc with bias, proj with bias


@pytest.mark.parametrize("m", [MIXTRAL, QWEN3], ids=["mixtral", "qwen3"])
def test_model_flops_count_the_active_parameters(m):
    """6 FLOPs per active matmul weight and token (the router, k experts, attention and
    head: not the token table or the norms), plus the attention core's 12 s x n_head x
    head_dim per layer."""
    d = m.d_model
    norms = m.n_layer * (2 * d + (2 * m.head_dim if m.qk_norm else 0)) + d
    weights = moe_active_parameters(m) - m.vocab_size * d - norms
    core = 12 * m.n_layer * m.seq_len * m.n_head * m.head_dim
    assert model_flops_per_token(m) == pytest.approx(6 * weights + core, rel=1e-12)


# ---- what a rank holds -------------------------------------------------------------------------------------

def _cfg(m: ModelConfig, lay: Layout, dtype: str = "bf16"):
    cfg = config_of(Job(m, 64, H100, dtype), lay)
    return cfg


def test_a_rank_holds_its_e_over_ep_experts_and_shards_them_over_edp():
    """dp 8 x pp 2, ep 4: each rank holds 4 of the layers, 2 of 8 experts each; ZeRO-1
    shards the dense state over the 8 dp ranks and the experts' over the 2 holding the
    same experts (bf16: 2 + 4 bytes a parameter, 12 / shard)."""
    lay = Layout(dp=8, tp=1, pp=2, ep=4, zero=1)
    cfg, grid = _cfg(SMALL, lay), grid_of(lay)
    expert = expert_parameters(SMALL)
    for stage in (0, 1):
        rank = grid.rank_of(dp=0, pp=stage, tp=0)
        dense, experts = stage_parameter_split(cfg, grid, rank)
        assert experts == 4 * 2 * expert
        assert dense + experts == expected_parameters(cfg, grid, rank)
        held = expected_bytes(cfg, grid, rank)
        up8, up2 = -(-dense // 8) * 8, -(-experts // 2) * 2
        assert held["parameter_bytes"] == 2 * (dense + experts)
        assert held["gradient_bytes"] == 4 * (up8 + up2)
        assert held["optimizer_bytes"] == 12 * (up8 // 8 + up2 // 2)
    one = expected_bytes(_cfg(SMALL, replace(lay, ep=1)), grid, 0)  # ep 1: every expert, one group
    assert one["parameters"] == stage_parameter_split(cfg, grid, 0)[0] + 4 * 8 * expert


@pytest.mark.parametrize("zero,keep", [(2, False), (3, False), (3, True)])
def test_zero_2_and_3_shard_the_experts_over_edp(zero, keep):
    """dp 8 x pp 2, ep 4, bf16: ZeRO-2 keeps gradient shards, the dense parameters' over
    the 8 dp ranks and the experts' over the 2 holding the same ones, and ZeRO-3
    parameter shards too (2 + 4 + 12 bytes an owned parameter); ZeRO-3 gathers two whole
    blocks (a MoE block's dense bucket and its expert bucket) and the stage's embedding or
    head, or kept gathered the whole stage. The staging is two of the largest bucket
    (fp32): ZeRO-3's are units, the largest the token table (stage 0) or the final norm
    and head (stage 1), above a block's two experts (17.3 M); ZeRO-2's buckets of one
    kind close at the parameter that reaches --bucket-mb, so the table's or head's bucket
    is 25 MiB of parameters and the 32.8 M table, within the dense parameters' whole."""
    lay = Layout(dp=8, tp=1, pp=2, ep=4, zero=zero, zero3_keep_gathered=keep)
    cfg, grid = _cfg(SMALL, lay), grid_of(lay)
    block = sum(moe_block_parameters(SMALL, 1, 4))
    table, cap = 32000 * 1024, 25 * 2 ** 20 // 4
    assert moe_block_parameters(SMALL, 1, 4)[1] == 2 * 3 * 1024 * 2816 < table
    for stage in (0, 1):
        rank = grid.rank_of(dp=0, pp=stage, tp=0)
        dense, experts = stage_parameter_split(cfg, grid, rank)
        owned = -(-dense // 8) + -(-experts // 2)
        held = expected_state_bytes(cfg, grid, rank)
        # ZeRO-3: the fp32 shard is the master (and the first stage's token table, a unit of
        # its own, is one bf16 zero element between uses)
        assert held["parameter_bytes"] == (4 * owned + (2 if stage == 0 else 0) if zero == 3 else 2 * (dense + experts))
        assert held["gradient_bytes"] == 0 and held["gradient_shard_bytes"] == 4 * owned
        assert held["optimizer_bytes"] == (8 if zero == 3 else 12) * owned
        outside = dense + experts - 4 * block  # the token table, or the final norm and the head
        # the table (its own unit) is gathered for its forward only, the root (final norm and
        # head) from the final norm's forward to the head's backward, not beside the blocks
        gathered = {2: 0, 3: 2 * (dense + experts) if keep else 2 * max(2 * block, stage * outside)}[zero]
        assert held["gathered_bytes"] == gathered
        assert outside == table + stage * 1024
        largest = outside if zero == 3 else min(dense, cap + table)
        assert dense > cap + table and held["staging_bytes"] == STAGING_BUCKETS * 4 * largest
        # a cap above everything: ZeRO-2's largest bucket is the dense parameters' whole
        wide = expected_state_bytes(_with(cfg, bucket_mb=10 ** 4), grid, rank)
        assert wide["staging_bytes"] == STAGING_BUCKETS * 4 * (outside if zero == 3 else -(-dense // 8) * 8)
    # ep 1: one buffer, one group, as a dense model of the same parameters (ZeRO-3's units
    # are whole blocks, each with its 8 experts, above the table)
    one = expected_state_bytes(_cfg(SMALL, replace(lay, ep=1)), grid, 0)
    n, whole = one["parameters"], sum(moe_block_parameters(SMALL, 1, 1))
    assert one["gradient_shard_bytes"] == 4 * -(-n // 8)
    assert one["optimizer_bytes"] == (8 if zero == 3 else 12) * -(-n // 8)
    # ZeRO-2: the bucket that the 32.8 M table closes (no parameter split)
    assert whole > table and one["staging_bytes"] == STAGING_BUCKETS * 4 * (whole if zero == 3 else cap + table)


def _with(cfg, **parallel):
    cfg = dataclasses.replace(cfg)
    cfg.parallel = dataclasses.replace(cfg.parallel, **parallel)
    return cfg


# the runtime's own code on fake tensors (gridtrain/dryrun.py): held bytes exactly, the
# activation peak within 1% (the norms' statistics are left out, as for dense blocks)
DRY_RUNS = {
    "dp4 ep2 zero1": dict(world=4, ep=2, zero=1),
    "dp4 ep4 fp32": dict(world=4, ep=4, dtype="fp32"),
    "dp2 tp2 sp ep2 zero1": dict(world=4, tp=2, ep=2, zero=1, sp=True),
    "shared, every 2nd, ep2": dict(world=4, ep=2, zero=1, model=dict(moe_shared_experts=1, moe_every=2, n_layer=4)),
    "gpt2 shared ep1": dict(world=4, zero=1, model=dict(arch="gpt2", tie_embeddings=True, n_kv_head=None,
                                                       moe_shared_experts=2)),
    "full recompute ep2": dict(world=4, ep=2, zero=1, recompute="full"),
    "qwen3-like q/k norms ep2": dict(world=4, ep=2, zero=1, qk=True, model=dict(qk_norm="head", attn_head_dim=16)),
    "olmoe-like q/k norms tp2 sp ep2": dict(world=4, tp=2, ep=2, zero=1, sp=True, qk=True,
                                            model=dict(qk_norm="full", n_kv_head=8, moe_norm_topk=False)),
}


def _tiny(c: dict):
    """moe-tiny (``--attention math``) laid out as a case of the dry-run tables says, and
    its grid."""
    from gridtrain.config import set_fields
    from gridtrain.parallel.grid import ProcessGrid

    cfg = preset_config("moe-tiny")
    cfg.model = dataclasses.replace(cfg.model, attention="math", **c.get("model", {}))
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep = c.get("tp", 1), c.get("pp", 1), c.get("ep", 1)
    cfg.parallel.sequence_parallel = c.get("sp", False)
    cfg.parallel.schedule = c.get("schedule", "1f1b")
    cfg.parallel.zero3_keep_gathered = c.get("keep", False)
    cfg.training.micro_batch_size, cfg.training.global_batch_size = 2, c.get("batch", 8)
    cfg.activations.recompute = c.get("recompute", "none")
    cfg = set_fields(cfg, dtype=c.get("dtype", "bf16"), zero=c.get("zero", 0))
    return cfg, ProcessGrid.build(c["world"], tp=cfg.parallel.tp, pp=cfg.parallel.pp)


@pytest.mark.slow  # a dry run each, about a second
@pytest.mark.parametrize("case", sorted(DRY_RUNS))
def test_the_dry_run_holds_the_memory_model(case):
    from gridtrain import dryrun

    c = dict(DRY_RUNS[case])
    cfg, grid = _tiny(c)
    for r in dryrun.dry_run(cfg, c["world"], "0", out=lambda *_: None)["ranks"]:
        expected = expected_bytes(cfg, grid, r["rank"])
        assert {k: r[k] for k in expected} == expected
        peak = expected_activation_peak(cfg, grid, r["rank"], "cpu")
        assert r["activation_peak_bytes"] == pytest.approx(peak, rel=0.01)


# ZeRO-2 and 3 beside expert parallelism, every rank: a rank's experts in buckets of their
# own, their gradient (and ZeRO-3 parameter) shards over the expert-data-parallel group
SHARDED_DRY_RUNS = {
    "dp4 ep2 zero3": dict(world=4, ep=2, zero=3),
    "dp4 ep2 zero3 fp32": dict(world=4, ep=2, zero=3, dtype="fp32"),  # the parameter shard is the master
    "dp4 ep2 zero3 kept gathered": dict(world=4, ep=2, zero=3, keep=True),
    "dp8 ep4 zero3": dict(world=8, ep=4, zero=3, batch=16),
    "dp4 pp2 zb-h1 ep2 zero3": dict(world=8, pp=2, ep=2, zero=3, schedule="zb-h1"),
    "dp2 tp2 sp ep2 zero2": dict(world=4, tp=2, ep=2, zero=2, sp=True),  # ep = dp: one-rank expert groups
    "gpt2 tied pp2 ep2 zero3": dict(world=8, pp=2, ep=2, zero=3,
                                    model=dict(arch="gpt2", tie_embeddings=True, n_kv_head=None,
                                               moe_shared_experts=2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SHARDED_DRY_RUNS))
def test_the_dry_run_holds_zero_2_and_3_beside_ep(case):
    """Parameter, gradient and optimizer bytes of every rank to the byte; the activation
    peak within 1%. (Under ZeRO-3 with full recomputation the dry run's activation meter
    also counts the rebuilt blocks' saved views of gathered weights, dense or MoE: left out.)"""
    from gridtrain import dryrun

    c = SHARDED_DRY_RUNS[case]
    cfg, grid = _tiny(c)
    ranks = dryrun.dry_run(cfg, c["world"], "all", out=lambda *_: None)["ranks"]
    assert len(ranks) == c["world"]
    for r in ranks:
        expected = expected_bytes(cfg, grid, r["rank"])
        assert {k: r[k] for k in expected} == expected, r["rank"]
        peak = expected_activation_peak(cfg, grid, r["rank"], "cpu")
        assert r["activation_peak_bytes"] == pytest.approx(peak, rel=0.01)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "moe-tiny"])
def test_the_closed_forms_are_the_models_counts(name):
    """memory.moe's counts and FLOPs against models/' own."""
    m = preset_config(name).model
    assert moe_total_parameters(m) == decoder.count_parameters(m)
    assert moe_active_parameters(m) == decoder.active_parameters(m)
    assert model_flops_per_token(m) == pytest.approx(decoder.training_flops_per_token(m), rel=1e-12)
    for tp, ep in ((1, 1), (2, 2), (4, 8)):
        if m.n_experts % ep == 0 and m.n_head % tp == 0:
            assert sum(moe_block_parameters(m, tp, ep)) == decoder.block_parameters(m, tp, layer=0, ep=ep)


def test_the_moe_layer_saves_what_the_terms_say():
    """The runtime's MoE layer (one rank), each tensor its autograd keeps counted once by
    storage: the input it routes (the block's MLP input, counted with the block) and the
    terms of moe_activation_terms, per token."""
    from gridtrain.models.moe import MoE
    from gridtrain.parallel.experts import ExpertParallel
    from gridtrain.parallel.tensor_parallel import TensorParallel

    m = preset_config("moe-tiny").model
    layer = MoE(m, 0, TensorParallel(), ExpertParallel()).to(torch.bfloat16)
    x = torch.randn(2, 64, m.d_model, dtype=torch.bfloat16, requires_grad=True)
    kept: dict[int, int] = {}

    def pack(t):
        kept.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved = sum(n for ptr, n in kept.items() if ptr not in weights)
    tokens = 2 * 64
    formula = tokens * (m.d_model * 2 + moe_mlp_bytes_per_token(m, element_bytes=2))
    assert 0 <= saved - formula <= 8 * m.n_experts  # beyond: the load-balancing loss's [E] vectors


def test_activation_terms_by_hand():
    """moe-tiny shapes (d 64, E 8, k 2, H 32), bf16, per token: fp32 probabilities 8 x 4,
    per row a fp32 top-k probability and a bf16 weight, the fp32 renormalising sum; 4 (5
    under ep) int64 indices per row; 3 (4 under ep) rows of 64 bf16; SwiGLU 4 x 32 bf16
    per row. Under SP a tp rank routes 1/tp of the tokens; the shared MLP splits over tp."""
    m = preset_config("moe-tiny").model
    terms = moe_activation_terms(m, element_bytes=2)
    assert terms == {"router": 8 * 4 + 2 * (4 + 2) + 4, "indices": ROUTING_INDICES * INDEX_BYTES * 2,
                     "rows": 3 * 2 * 64 * 2, "experts": 4 * 2 * 2 * 32, "shared": 0}
    ep = moe_activation_terms(m, element_bytes=2, ep=2)
    assert ep["rows"] - terms["rows"] == 2 * 64 * 2 and ep["indices"] - terms["indices"] == 2 * 8
    shared = replace(m, moe_shared_experts=2)
    sp = moe_activation_terms(shared, tp=2, sequence_parallel=True, element_bytes=2)
    assert sp["experts"] == terms["experts"] / 2 and sp["shared"] == 4 * 2 * 2 * 32 / 2
    # a MoE block's shape: the dense MLP's 4 e ffn / t replaced by these
    shape = activations.layer_shape(m, batch=1, tp=1, sequence_parallel=False, element_bytes=2, mask_bytes=1,
                                     layer=0)
    dense = activations.layer_shape(m, batch=1, tp=1, sequence_parallel=False, element_bytes=2, mask_bytes=1)
    assert activations.korthikanti_bytes(**shape) - activations.korthikanti_bytes(**dense) == \
        m.seq_len * (sum(terms.values()) - 4 * 2 * m.ffn_size)


# ---- the all-to-alls ---------------------------------------------------------------------------------------

def test_all_to_all_bytes_by_hand():
    """d 64, k 2, micro-batch 2 x 64 tokens, tp 2 with SP (a rank routes 64 of the 128
    tokens), ep 4, bf16: each dispatch or combine sends 64 x 2 rows x 64 x 2 bytes =
    16 KiB, 3/4 of it off the rank; a step of 3 micro-batches through 2 MoE layers with
    full recomputation runs (2 + 2 forward + 2 backward) x 6 of them."""
    m = preset_config("moe-tiny").model
    assert routed_tokens(2, 64, tp=2, sequence_parallel=True) == 64
    assert routed_tokens(2, 64, tp=2) == 128 and routed_tokens(2, 64, cp=2) == 64
    assert all_to_all_payload(64, 2, 64, 2) == 16384 and all_to_all_bytes(64, 2, 64, 4, 2) == 12288
    t = moe_step_all_to_all(m, micro_batch_size=2, micro_batches=3, moe_layers=2, tp=2, ep=4, sequence_parallel=True,
                            element_bytes=2, recompute_full=True)
    assert (t.payload, t.sent, t.forward, t.backward, t.count) == (16384, 12288, 4, 2, 36)
    assert t.step_payload == 36 * 16384 and t.step_sent == 36 * 12288
    assert moe_step_all_to_all(m, micro_batch_size=2, micro_batches=3, moe_layers=2, ep=1).count == 0


def test_all_to_all_time_on_the_link_the_ep_group_spans():
    """Within a node (tp x ep <= 8) every share over NVLink; across nodes the shares for
    other nodes' members through the GPU's NIC (the slower side), one latency."""
    job = Job(SMALL, 64, H100)
    nbytes = 8e8
    inside = all_to_all_seconds(job, Layout(dp=8, tp=1, pp=1, ep=8), nbytes)
    assert inside == pytest.approx(7 / 8 * nbytes / H100.nvlink.bandwidth + H100.nvlink.latency)
    across = all_to_all_seconds(job, Layout(dp=8, tp=2, pp=1, ep=8), nbytes)  # 4 members a node, 2 nodes
    assert across == pytest.approx(4 / 8 * nbytes / H100.network.bandwidth + H100.network.latency)
    assert all_to_all_seconds(job, Layout(dp=8, tp=1, pp=1, ep=1), nbytes) == 0.0


def test_a_moe_block_adds_its_all_to_alls_and_expert_gemms():
    job = Job(SMALL, 64, H100)
    lay = Layout(dp=8, tp=1, pp=1, ep=4)
    f, b = moe_comm_seconds(job, lay)
    rows = 2048 * 2
    one = all_to_all_seconds(job, lay, rows * 1024 * 2)
    assert b == pytest.approx(2 * one) and f > 2 * one  # + the counts, the host read, the statistics
    assert f - 2 * one == pytest.approx(f - b)
    block = block_cost(job, lay, moe=True)
    assert (block.ep_comm_f, block.ep_comm_b) == (f, b)
    # full recomputation repeats the forward's all-to-alls in B
    full = block_cost(job, replace(lay, recompute="full"), moe=True)
    assert full.b == pytest.approx(block.b + block.f)
    # ep 1: no all-to-all, only the statistics' all-reduce and the host read
    assert moe_comm_seconds(job, replace(lay, ep=1))[1] == 0.0
    # fewer experts a rank, fewer (larger) GEMMs: each expert's GEMMs on N k ep / E rows
    more = moe_gemm_seconds(job, replace(lay, ep=1)) - moe_gemm_seconds(job, lay)
    assert more > (8 - 2) * 3 * H100.kernel_s  # 6 more experts, 3 GEMMs each, a launch each at least
    assert EXPERT_KERNELS > 0
    # the dense block is the dense block
    assert block_cost(job, lay) == block_cost(Job(replace(SMALL, n_experts=0), 64, H100), replace(lay, ep=1))


def test_the_statistics_all_reduce_is_latency_only():
    job = Job(SMALL, 64, H100)
    lay = Layout(dp=64, tp=1, pp=1)
    assert tiny_all_reduce_seconds(job, lay) == pytest.approx(2 * 6 * H100.network.latency)
    assert tiny_all_reduce_seconds(job, Layout(dp=1, tp=1, pp=1)) == 0.0
    sp = Layout(dp=8, tp=2, pp=1, sequence_parallel=True)
    assert statistics_seconds(job, sp) == pytest.approx((2 * 3 * H100.network.latency, 2 * H100.nvlink.latency))


def test_the_statistics_all_reduce_travels_while_the_experts_run():
    """Started before the dispatch and waited after the combine: the dp x cp all-reduce
    costs only what outlasts the counts, the all-to-alls and the experts' GEMMs; under SP
    the tp one follows, whole."""
    def parts(job, lay):
        rows = moe_routing(job, lay)[1]
        one = all_to_all_seconds(job, lay, all_to_all_payload(rows, 1, job.model.d_model, 2))
        dispatch = all_to_all_seconds(job, lay, 0.0) + HOST_SYNC_S + 2 * one
        return dispatch, expert_gemm_seconds(job, lay), statistics_seconds(job, lay)

    job = Job(SMALL, 64, H100)
    for lay in (Layout(dp=64, tp=1, pp=1, ep=8), Layout(dp=32, tp=2, pp=1, ep=8, sequence_parallel=True)):
        dispatch, experts, (group, tp) = parts(job, lay)
        assert 0 < group < dispatch + experts  # hidden
        assert moe_comm_seconds(job, lay)[0] == pytest.approx(dispatch + tp)
    # a tiny MoE on 1024 ranks without ep: ten tree levels across nodes outlast the host read
    tiny = Job(preset_config("moe-tiny").model, 1024, H100)
    lay = Layout(dp=1024, tp=1, pp=1)
    dispatch, experts, (group, tp) = parts(tiny, lay)
    assert group > dispatch + experts and tp == 0.0
    assert moe_comm_seconds(tiny, lay)[0] == pytest.approx(group - experts)  # dispatch + what outlasts it
    assert expert_gemm_seconds(job, Layout(dp=8, tp=1, pp=1, ep=4)) < moe_gemm_seconds(job, Layout(dp=8, tp=1, pp=1,
                                                                                                  ep=4))


def test_a_routed_only_moe_block_leaves_the_tp_region_for_attention_only():
    job = Job(SMALL, 64, H100)
    for sp in (False, True):
        lay = Layout(dp=2, tp=4, pp=1, sequence_parallel=sp, ep=2)
        act = 2048 * 1024 * 2
        assert block_cost(job, lay, moe=True).tp_comm_f == pytest.approx(
            tp_collectives(job, lay, act, MOE_BLOCK_COLLECTIVES)[0])
        assert 2 * block_cost(job, lay, moe=True).tp_comm_b == pytest.approx(block_cost(job, lay).tp_comm_b)
        shared = Job(replace(SMALL, moe_shared_experts=1), 64, H100)  # shared experts: the dense block's
        assert block_cost(shared, lay, moe=True).tp_comm_f == pytest.approx(block_cost(shared, lay).tp_comm_f)


def test_expert_gradients_over_the_expert_data_parallel_group_and_tp_under_sp():
    job = Job(SMALL, 64, H100)
    free = lambda stage, chunk: type("C", (), {"f": 0.0, "b": 0.0, "w": 0.0})()  # noqa: E731
    lay = Layout(dp=16, tp=1, pp=1, ep=8, zero=1)
    dense, experts = 10 ** 8, 4 * 10 ** 8
    both = data_parallel_seconds(job, lay, dense, free, 25.0, experts)
    alone = data_parallel_seconds(job, lay, dense, free, 25.0)
    assert both[0] > alone[0] and both[1] > alone[1]
    # ZeRO-1's optimizer owns dense / 16 + experts / 2
    assert both[2] == pytest.approx((dense / 16 + experts / 2) * (4 + 24 + 2) / H100.memory_bandwidth)
    # ep 1: the experts ride with the dense parameters
    assert data_parallel_seconds(job, replace(lay, ep=1), dense, free, 25.0, experts) == \
        data_parallel_seconds(job, replace(lay, ep=1), dense + experts, free, 25.0)
    assert expert_tp_seconds(job, Layout(dp=4, tp=2, pp=1, sequence_parallel=False), experts) == 0.0
    assert expert_tp_seconds(job, Layout(dp=4, tp=2, pp=1, sequence_parallel=True), experts) == pytest.approx(
        H100.nvlink.collective(experts * 4, 2, "all_reduce"))


def test_zero_2_and_3_collectives_of_experts_run_over_the_edp_link():
    """dp 16, ep 8: a MoE block's dense bucket is gathered and reduce-scattered over the
    16 ranks (two nodes: NVLink-fed rings through every NIC), its experts over the 2
    holding the same ones, 8 apart (one a node: one NIC); ZeRO-2 reduce-scatters the
    chunk's gradients, each kind over its group. ep 1: one bucket a block over dp; ep =
    dp: the experts are not reduced at all."""
    job = Job(SMALL, 64, H100)
    lay = Layout(dp=16, tp=1, pp=1, ep=8, zero=3)
    parts = zero_unit_parts(SMALL, 1, 2, True, False, 2, 8)
    table, (dense, experts) = parts[0][0], moe_block_parameters(SMALL, 1, 8)
    assert parts == [(table, 0), (dense, experts), (dense, experts)]
    assert zero_units(SMALL, 1, 2, True, False, 2, 8) == [sum(u) for u in parts]
    link, xlink = ring_link(H100, 16, 1, 8), ring_link(H100, 2, 8, 8)
    assert xlink == H100.network

    def both(d: int, x: int, nbytes: int, kind: str) -> float:
        return link.collective(d * nbytes, 16, kind) + (xlink.collective(x * nbytes, 2, kind) if x else 0.0)

    gathers = both(table, 0, 2, "all_gather") + 2 * both(dense, experts, 2, "all_gather")
    scatters = both(table, 0, 4, "reduce_scatter") + 2 * both(dense, experts, 4, "reduce_scatter")
    assert zero_chunk_seconds(job, lay, 2, True, False, 2) == pytest.approx(
        (gathers, link.collective(table * 2, 16, "all_gather"), gathers + scatters))
    assert zero_chunk_seconds(job, replace(lay, zero3_keep_gathered=True), 2, True, False, 2) == \
        pytest.approx((0.0, 0.0, scatters))
    assert zero_chunk_seconds(job, replace(lay, zero=2), 2, True, False, 2) == pytest.approx(
        (0.0, 0.0, both(table + 2 * dense, 2 * experts, 4, "reduce_scatter")))
    one = replace(lay, ep=1)
    whole = sum(moe_block_parameters(SMALL, 1, 1))
    assert zero_chunk_seconds(job, replace(one, zero=2), 2, True, False, 2) == pytest.approx(
        (0.0, 0.0, link.collective((table + 2 * whole) * 4, 16, "reduce_scatter")))
    alone = replace(lay, dp=8, zero=2)  # ep 8 = dp 8: each rank alone with its experts
    assert zero_chunk_seconds(job, alone, 2, True, False, 2)[2] == pytest.approx(
        ring_link(H100, 8, 1, 8).collective((table + 2 * dense) * 4, 8, "reduce_scatter"))


def test_zero_2_and_3_step_collectives_of_experts():
    """ZeRO-2's once-a-step gather of the updated shards: the experts' over their group
    beside the dense one; ZeRO-3's gathers are per micro-batch (in the pipeline), kept
    gathered once a step; the optimizer's pass over dense / 16 + experts / 2."""
    job = Job(SMALL, 64, H100)
    free = lambda stage, chunk: type("C", (), {"f": 0.0, "b": 0.0, "w": 0.0})()  # noqa: E731
    dense, experts = 10 ** 8, 4 * 10 ** 8
    for zero, keep in ((2, False), (3, False), (3, True)):
        lay = Layout(dp=16, tp=1, pp=1, ep=8, zero=zero, zero3_keep_gathered=keep)
        both = data_parallel_seconds(job, lay, dense, free, 25.0, experts)
        alone = data_parallel_seconds(job, lay, dense, free, 25.0)
        if zero == 3 and not keep:
            assert both[1] == alone[1] == 0.0
        else:
            assert both[1] == pytest.approx(alone[1] + H100.network.collective(experts * 2, 2, "all_gather"))
        assert both[2] == pytest.approx((dense / 16 + experts / 2) * (4 + 24 + 2) / H100.memory_bandwidth)


def _tight(job: Job, need: float) -> Job:
    """The job on a device whose usable memory is ``need``."""
    return replace(job, hardware=replace(job.hardware, memory=need / job.hardware.usable_fraction))


def test_the_search_takes_zero_2_beside_ep_where_zero_1_does_not_fit():
    job = Job(SMALL, 64, H100)
    base = Layout(dp=16, tp=1, pp=1, ep=8)
    z1, z2 = (memory_bytes(job, replace(base, zero=z)) for z in (1, 2))
    assert z2 < z1
    fixed = Fixed(tp=1, pp=1, cp=1, ep=8, micro_batch_size=1, recompute="none")
    best = search(_tight(job, (z1 + z2) / 2), 16, fixed, top=2)
    assert [(p.layout.zero, p.layout.zero3_keep_gathered, p.fits) for p in best][0] == (2, False, True)
    assert best[0].step_time_s >= predict(job, replace(base, zero=1)).step_time_s
    validate(config_of(job, best[0].layout), 16)
    assert {p.layout.zero for p in search(job, 16, fixed)} <= {0, 1}  # where ZeRO-1 fits, it is kept


# ---- the search ----------------------------------------------------------------------------------------------

def test_ep_sizes_divide_the_group_and_the_experts():
    assert ep_sizes(SMALL, 16) == [1, 2, 4, 8]
    assert ep_sizes(SMALL, 12) == [1, 2, 4]
    assert ep_sizes(replace(SMALL, n_experts=0), 16) == [1]
    assert ep_sizes(SMALL, 16, Fixed(ep=4)) == [4] and ep_sizes(SMALL, 6, Fixed(ep=4)) == []


def test_layouts_keep_the_rules():
    """ep x etp divides the stage's tp x cp x dp ranks and ep the experts (folded over tp
    where it does not divide dp x cp: then with SP); beside ep > 1 every ZeRO stage
    (ZeRO-3 kept gathered or not), over the whole group only (no hybrid sharding); every
    valid ep of a layout is there; a dense model's layouts are all ep 1."""
    job = Job(replace(SMALL, n_experts=4), 64, H100)
    every = list(layouts(job, 32))
    assert {lay.ep for lay in every} == {1, 2, 4}
    for lay in every:
        stage = lay.tp * lay.dp * lay.cp
        assert stage % (lay.ep * lay.etp) == 0 and 4 % lay.ep == 0
        assert lay.folded == ((lay.dp * lay.cp) % (lay.ep * lay.etp) != 0)
        assert not (lay.folded and lay.tp > 1) or lay.sequence_parallel
        assert lay.tp == 1 or lay.sequence_parallel  # MoE with tp: SP
        if lay.ep * lay.etp > 1:
            assert lay.zero_shard_size is None
    assert any(lay.folded for lay in every) and any(lay.etp > 1 for lay in every)
    with_ep = {(lay.zero, lay.zero3_keep_gathered) for lay in every if lay.ep > 1}
    assert with_ep == {(0, False), (1, False), (2, False), (3, True), (3, False)}
    assert any(lay.zero_shard_size for lay in every if lay.ep == 1)  # hybrid sharding at ep 1 still
    assert {lay.ep for lay in layouts(Job(replace(SMALL, n_experts=0), 64, H100), 32)} == {1}
    assert {lay.ep for lay in layouts(job, 32, Fixed(ep=2))} == {2}
    assert not list(layouts(job, 32, Fixed(ep=2, zero_shard_size=8)))
    assert {lay.zero for lay in layouts(job, 32, Fixed(ep=2, zero=3))} == {3}


def test_the_search_predicts_moe_layouts_that_validate():
    job = Job(SMALL, 64, H100)
    best = search(job, 16, top=3)
    assert best and all(p.fits and p.moe for p in best)
    for p in best:
        assert p.as_json()["ep"] == p.layout.ep and "ep_comm" in p.as_json()["breakdown_s"]
        assert p.ep_comm_s <= p.compute_s
        cfg = config_of(job, p.layout)
        validate(cfg, p.gpus)


MOE_PLAN = ["plan", "--gpus", "16", "--hardware", "h100-sxm", "--model", "moe-tiny", "--seq-len", "1024",
            "--global-batch-size", "64", "--d-model", "1024", "--n-head", "16", "--n-kv-head", "4", "--ffn-size",
            "2816", "--n-layer", "8", "--vocab-size", "32000", "--n-experts", "8", "--moe-top-k", "2",
            "--moe-ffn-hidden", "2816"]


def test_plan_json_has_ep_and_the_command_carries_it(capsys, no_process_may_start):
    assert cli.main([*MOE_PLAN, "--top", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert rows and all(isinstance(r["ep"], int) and (r["dp"] * r["cp"]) % r["ep"] == 0 for r in rows)
    assert cli.main([*MOE_PLAN, "--top", "2", "--ep", "4"]) == 0
    out = capsys.readouterr().out
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("torchrun ")]
    assert len(commands) == 2 and "8 experts (top 2)" in out.splitlines()[0]
    for command in commands:  # parses and validates as printed
        words = shlex.split(command)
        assert words[words.index("--ep") + 1] == "4"
        cfg = validate(cli.config_from_args(cli.build_parser().parse_args(words[words.index("gridtrain") + 1:])), 16)
        assert (cfg.parallel.ep, cfg.model.n_experts, cfg.model.moe_ffn_size) == (4, 8, 2816)


def test_a_dense_plan_carries_ep_1_and_no_ep_flag(capsys, no_process_may_start):
    assert cli.main(["plan", "--gpus", "8", "--hardware", "a100-80gb", "--model", "gpt2", "--seq-len", "1024",
                     "--global-batch-size", "32", "--top", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert all(r["ep"] == 1 and r["breakdown_s"]["ep_comm"] == 0.0 for r in rows)
    assert cli.main(["plan", "--gpus", "8", "--hardware", "a100-80gb", "--model", "gpt2", "--seq-len", "1024",
                     "--global-batch-size", "32", "--top", "1"]) == 0
    assert "--ep" not in capsys.readouterr().out


# the predictions of the planner before MoE (commit 912ff2e), to the bit: step seconds and
# bytes per GPU of the best layouts of two dense searches (the bytes since the fused,
# chunked loss, which keeps no logits: 0.8-1.8 GB less, the same layouts and times)
DENSE_LLAMA = ModelConfig(arch="llama", n_layer=8, n_head=16, n_kv_head=4, d_model=2048, ffn_hidden=5632,
                          seq_len=4096, vocab_size=32000, tie_embeddings=False, attention="sdpa", dropout=0.0)
DENSE_GPT = ModelConfig(n_layer=12, n_head=16, d_model=2048, seq_len=2048, vocab_size=50257, attention="math",
                        dropout=0.0)
BEFORE = {
    "llama": (DENSE_LLAMA, 16, 64, [(dict(dp=16, micro_batch_size=4, zero=1), 0.10632167425255748, 13656757760.0),
                                    (dict(dp=16, micro_batch_size=4, zero=1, zero_shard_size=8), 0.10664398129643655,
                                     14025620480.0),
                                    (dict(dp=16, micro_batch_size=2, zero=1), 0.10950167425255747, 8619333120.0)]),
    "gpt2": (DENSE_GPT, 32, 128, [(dict(dp=16, micro_batch_size=8, zero=1, cp=2), 0.07985994264452927,
                                   11866610176.0),
                                  (dict(dp=16, micro_batch_size=8, zero=1, cp=2, cp_comm="allgather"),
                                   0.07985994264452927, 13477222912.0),
                                  (dict(dp=16, micro_batch_size=8, zero=1, cp=2, zero_shard_size=8),
                                   0.08053231849181618, 12667070464.0)]),
}


@pytest.mark.parametrize("case", sorted(BEFORE))
def test_dense_plans_are_unchanged(case, monkeypatch):
    """With the constants of that commit (an H100 GEMM at 80% of peak, hidden
    communication free: the calibration since changed both, docs/planner.md)."""
    monkeypatch.setattr(cost, "OVERLAP_COST", 0.0)
    m, gpus, batch, expected = BEFORE[case]
    got = search(Job(m, batch, replace(H100, gemm_efficiency=0.8)), gpus, top=3)
    assert [(p.layout, p.step_time_s, p.memory_bytes) for p in got] == \
        [(Layout(tp=1, pp=1, **lay), step, mem) for lay, step, mem in expected]


def test_block_parameters_of_a_dense_block_are_the_models():
    for tp in (1, 2, 4):
        assert dense_block_parameters(SMALL, tp) == block_parameters(replace(SMALL, n_experts=0), tp)
