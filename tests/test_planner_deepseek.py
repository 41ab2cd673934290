"""DeepSeek-V3-class models in the memory model and ``gridtrain plan``, as data: latent
attention (its parameters split over tp, its GEMMs and core), multi-token prediction (its
modules on the last stage: parameters, activations, the table's copy, the head again),
sigmoid routing, dense first layers, expert tensor parallelism (``--etp``: expert slices,
pooled rows, the etp group's row collectives) and experts folded over tp (their
expert-data-parallel group over tp x dp x cp); the search over ep and etp (folded layouts
with SP), the JSON's ``etp`` and the printed ``--etp``; and the dry run holding the closed
forms on deepseek-tiny and on DeepSeek-V3 at 1,024 ranks (the slow tier). No process is
started."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

from gridtrain.cli import parser as cli
from gridtrain.config import preset_config, set_fields
from gridtrain.memory import activations
from gridtrain.memory.model import (expected_activation_peak, expected_bytes, expected_parameters, expert_shards,
                                    stage_parameter_split, stage_parameters)
from gridtrain.memory.moe import (INDEX_BYTES, dense_block_parameters, expert_parameters, model_flops_per_token,
                                  moe_activation_terms, moe_active_parameters, moe_block_parameters,
                                  moe_total_parameters)
from gridtrain.models import decoder
from gridtrain.parallel.grid import ProcessGrid
from gridtrain.planner.cost import (Job, Layout, all_to_all_seconds, block_gemms, config_of, etp_seconds,
                                    expert_gemm_seconds, expert_tp_seconds, grid_of, head_cost, moe_routing,
                                    ring_link)
from gridtrain.planner.machine import machine
from gridtrain.planner.search import Fixed, expert_grids, layouts
from gridtrain.training.validate import validate

H100 = machine("h100-sxm")
V3 = preset_config("deepseek-v3").model
TINY = preset_config("deepseek-tiny").model
DEEPSEEK = ["deepseek-tiny", "deepseek-v3", "deepseek-v2-lite", "moonlight-16b-a3b", "kimi-k2"]


# ---- parameters, FLOPs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", DEEPSEEK)
def test_the_closed_forms_are_the_models_counts(name):
    """memory.moe's counts and FLOPs against models/' own (the MTP modules included, as
    the model holds them); a MoE block (the first after the dense ones) on tp and ep ranks."""
    m = preset_config(name).model
    assert moe_total_parameters(m) == decoder.count_parameters(m)
    assert moe_total_parameters(m, mtp=False) == decoder.count_parameters(m, mtp=False)
    assert moe_active_parameters(m) == decoder.active_parameters(m)
    assert model_flops_per_token(m) == pytest.approx(decoder.training_flops_per_token(m), rel=1e-12)
    first = m.moe_layers[0]
    assert first == m.moe_dense_layers and not m.is_moe_layer(first - 1)
    for tp, ep in ((1, 1), (2, 2), (4, 8)):
        assert sum(moe_block_parameters(m, tp, ep)) == decoder.block_parameters(m, tp, layer=first, ep=ep)
        assert dense_block_parameters(m, tp) == decoder.block_parameters(m, tp, layer=0)


def test_deepseek_v3_counts_671b_parameters_37b_active():
    """Without its MTP module, as published: 671.0 B parameters, 37.6 B active."""
    assert moe_total_parameters(V3, mtp=False) == 671_026_404_352
    assert moe_active_parameters(V3, mtp=False) == 37_552_282_624


def test_latent_attention_splits_by_heads_and_keeps_the_down_projections_whole():
    """DeepSeek-V3's block on tp 8: q_a [1536, d], kv_a [576, d] and the two latent norms
    whole on every rank; q_b [128 x 192, 1536], kv_b [128 x 256, 512] and proj [d, 128 x
    128] by heads; two RMSNorms; the dense MLP (18432 wide) by tp."""
    d, tp = 7168, 8
    attention = 1536 * d + 1536 + 576 * d + 512 + (128 * 192 * 1536 + 128 * 256 * 512 + d * 128 * 128) // tp
    assert dense_block_parameters(V3, tp) == 2 * d + attention + 3 * d * 18432 // tp
    # a MoE block: the dense MLP out, the router [256, d], the shared expert (2048 wide) by tp
    dense, experts = moe_block_parameters(V3, tp, 64)
    assert dense == 2 * d + attention + 256 * d + 3 * d * 2048 // tp
    assert experts == 4 * 3 * d * 2048


def test_a_last_stage_holds_the_mtp_module_and_a_copy_of_the_table():
    """deepseek-tiny on pp 2: stage 1 holds block 1 (MoE), the final norm, the untied head,
    the MTP depth (three norms, the [d, 2d] projection, block 2: MoE) and, not embedding,
    a copy of the token table for the depth's lookups; on pp 1 the table is the
    embedding's. Stage 0 holds the embedding and block 0 (dense)."""
    d, table = 64, 320 * 64  # the vocabulary 257 padded to 320
    moe_block = sum(moe_block_parameters(TINY, 1, 1))
    assert stage_parameters(TINY, 1, 2, False, True, moe_blocks=2) == 2 * moe_block + d + table + 3 * d + 2 * d * d \
        + table
    assert stage_parameters(TINY, 1, 3, True, True, moe_blocks=2) == dense_block_parameters(TINY) + 2 * moe_block \
        + table + d + table + 3 * d + 2 * d * d
    cfg = _tiny(dict(world=2, pp=2))[0]
    grid = ProcessGrid.build(2, pp=2)
    assert expected_parameters(cfg, grid, 0) == table + dense_block_parameters(TINY)
    assert expected_parameters(cfg, grid, 1) == stage_parameters(TINY, 1, 2, False, True, moe_blocks=2)
    assert sum(expected_parameters(cfg, grid, r) for r in (0, 1)) == decoder.count_parameters(TINY) + 2 * 63 * d \
        + table  # the padded rows of the table and the head, and the copy


@pytest.mark.parametrize("world,tp,ep,etp,folded,edp", [
    (4, 1, 2, 2, False, 1),   # etp 2 x ep 2 over dp 4
    (8, 1, 2, 2, False, 2),
    (4, 2, 4, 1, True, 1),    # ep 4 over tp 2 x dp 2: folded
    (8, 2, 2, 2, False, 1),   # dp 4 holds etp 2 x ep 2
    (8, 2, 4, 2, True, 1),    # 8 ranks of a stage, folded
    (16, 2, 2, 1, False, 4),
    (16, 4, 8, 1, True, 2),
])
def test_expert_slices_and_their_group(world, tp, ep, etp, folded, edp):
    """A rank's experts are ``E / ep`` slices of ``3 d H / etp``; their gradients are
    reduced (and ZeRO shards their state) over ``dp x cp / (ep x etp)`` ranks, or folded
    over tp ``tp x dp x cp / (ep x etp)``, the runtime's expert-data-parallel group."""
    grid = ProcessGrid.build(world, tp=tp)
    cfg = _tiny(dict(world=world, tp=tp, ep=ep, etp=etp, sp=True))[0]
    assert grid.folds_experts(ep, etp) == folded
    assert expert_shards(cfg, grid) == edp == len(grid.all_expert_dp_groups(ep, etp)[0])
    assert expert_parameters(TINY, etp) == 3 * 64 * 32 // etp
    dense, experts = stage_parameter_split(cfg, grid, 0)
    assert experts == 2 * 8 // ep * 3 * 64 * 32 // etp  # block 1 and the MTP's block 2


# ---- activations ------------------------------------------------------------------------------------------

def test_activation_terms_of_sigmoid_routing_and_pooled_rows():
    """deepseek-tiny (d 64, E 8, k 2, H 32, one shared expert), bf16, per token: the
    sigmoid router keeps its fp32 scores and their fp32 sum per token beside the
    softmax's terms; under etp the pooled rows, combine weights and all but the top-k's
    indices are ``etp`` times the rank's own, the experts' intermediates the same."""
    one = moe_activation_terms(TINY, element_bytes=2)
    assert one == {"router": 8 * 4 + 4 + 2 * (4 + 2) + 4, "indices": 4 * INDEX_BYTES * 2, "rows": 3 * 2 * 64 * 2,
                   "experts": 4 * 2 * 2 * 32, "shared": 4 * 2 * 32}
    softmax = moe_activation_terms(dataclasses.replace(TINY, moe_router="softmax"), element_bytes=2)
    assert one["router"] - softmax["router"] == 4
    pooled = moe_activation_terms(TINY, element_bytes=2, etp=2)
    assert pooled["rows"] == 2 * one["rows"] and pooled["experts"] == one["experts"]
    assert pooled["router"] - one["router"] == 2 * 2 and pooled["indices"] == (1 + 3 * 2) * INDEX_BYTES * 2
    both = moe_activation_terms(TINY, element_bytes=2, ep=2, etp=2)
    assert both["rows"] == 2 * 4 * 2 * 64 * 2 and both["indices"] == (1 + 4 * 2) * INDEX_BYTES * 2
    # latent attention: its latents whole on every rank, values v_head_dim wide
    shape = activations.layer_shape(TINY, batch=1, tp=2, sequence_parallel=True, element_bytes=2, mask_bytes=1)
    assert shape["latent"] == 2 * 32 + 2 * 16 + 8 and shape["attn_hidden"] == 4 * 24
    assert shape["kv_hidden"] == 2 * 24 and shape["value_hidden"] == 4 * 16


# ---- the cost model ---------------------------------------------------------------------------------------

def test_latent_attention_gemms():
    """(m, n, k) of DeepSeek-V3's attention on tp 8 for 4096 rows: q_a and kv_a whole,
    q_b, kv_b and proj by heads (16 of 128 a rank)."""
    t = 4096
    assert block_gemms(V3, t, 8, mlp=False) == [(t, 1536, 7168), (t, 16 * 192, 1536), (t, 576, 7168),
                                                 (t, 16 * 256, 512), (t, 7168, 16 * 128)]


def test_expert_tensor_parallelism_pools_rows_and_splits_the_experts():
    """etp 2 x ep 4 on dp 8: each rank's 2 experts (of 8) run 1/2 of their width on the
    etp group's pooled rows (twice its own), the all-to-alls carry them, and the etp
    group's all-gather of the rows (with their choices and weights) and reduce-scatter of
    the outputs run each way over the group's link (members tp apart)."""
    m = dataclasses.replace(TINY, seq_len=1024, moe_ffn_hidden=2048, d_model=1024)
    job = Job(m, 64, H100)
    one, two = Layout(dp=8, tp=1, pp=1, ep=4), Layout(dp=8, tp=1, pp=1, ep=4, etp=2)
    n, rows, per_expert = moe_routing(job, two)
    assert (n, rows, per_expert) == (1024, 2 * 1024 * 2, 2 * 1024 * 2 * 4 / 8)
    assert etp_seconds(job, one) == 0.0
    link = ring_link(H100, 2, 1, 8)
    assert etp_seconds(job, two) == pytest.approx(link.collective(2 * n * 1024 * 2 + 2 * n * 2 * 10, 2, "all_gather")
                                                  + link.collective(2 * n * 1024 * 2, 2, "reduce_scatter"))
    # twice the rows, half the width: the same FLOPs (and here the same roofline)
    assert expert_gemm_seconds(job, two) == pytest.approx(expert_gemm_seconds(job, one))
    assert all_to_all_seconds(job, two, 1e6) > 0.0


def test_folded_experts_span_tp_and_skip_the_tp_sum():
    """ep 8 on tp 4 x dp 2 (SP): folded, the ep group's members are neighbours (a node:
    NVLink), the expert-data-parallel group is the 2 ranks holding the same experts, and
    no sum of expert gradients over tp follows the backward (unfolded with SP there is)."""
    job = Job(TINY, 64, H100)
    folded = Layout(dp=2, tp=4, pp=1, ep=8, sequence_parallel=True)
    assert folded.folded and folded.expert_stride == 1 and folded.expert_dp == 1
    assert expert_tp_seconds(job, folded, 10 ** 6) == 0.0
    unfolded = Layout(dp=2, tp=4, pp=1, ep=2, sequence_parallel=True)
    assert not unfolded.folded and unfolded.expert_stride == 4 and unfolded.expert_dp == 1
    assert expert_tp_seconds(job, unfolded, 10 ** 6) > 0.0
    cfg, grid = config_of(job, folded), grid_of(folded)
    assert expert_shards(cfg, grid) == folded.expert_dp


def test_the_mtp_depths_run_with_the_head():
    """The chunk that ends the model runs each MTP depth: its block, projection, lookup
    and head again; without MTP the head alone."""
    m = dataclasses.replace(V3, seq_len=4096)
    lay = Layout(dp=64, tp=1, pp=16, ep=8)
    with_mtp, without = head_cost(Job(m, 1024, H100), lay), head_cost(Job(dataclasses.replace(m, mtp_layers=0),
                                                                           1024, H100), lay)
    assert all(a > 2 * b for a, b in zip(with_mtp, without))


# ---- the search -------------------------------------------------------------------------------------------

def test_expert_grids():
    """(ep, etp): ep x etp divides the stage's ranks, ep the experts; a searched etp > 1
    only spreads the experts further than ep alone can and keeps its group in a node;
    fixed ones as given."""
    small = dataclasses.replace(TINY, moe_ffn_hidden=64)
    grids = expert_grids(small, 16, 8)  # 8 experts: ep alone reaches 8 of 16 ranks
    assert {ep for ep, etp in grids if etp == 1} == {1, 2, 4, 8}
    assert {(ep, etp) for ep, etp in grids if etp > 1} == {(8, 2), (4, 4), (2, 8)}  # 16 ranks each
    assert all(16 % (ep * etp) == 0 and 8 % ep == 0 for ep, etp in grids)
    assert expert_grids(small, 16, 8, Fixed(ep=2, etp=2)) == [(2, 2)]
    assert expert_grids(V3, 64, 8) == [(ep, 1) for ep in (1, 2, 4, 8, 16, 32, 64)]  # 256 experts: ep reaches all
    assert expert_grids(dataclasses.replace(TINY, n_experts=0), 16, 8) == [(1, 1)]


def test_layouts_fold_with_sp_and_try_etp():
    """Every layout's expert grid divides the stage; folded over tp only with SP (and
    MoE with tp only with SP); etp > 1 layouts are there for a model with few experts."""
    m = dataclasses.replace(TINY, n_layer=4, seq_len=1024, moe_ffn_hidden=64, mtp_layers=0)
    every = list(layouts(Job(m, 64, H100), 16))
    assert any(lay.folded for lay in every) and any(lay.etp > 1 for lay in every)
    for lay in every:
        assert (lay.tp * lay.dp * lay.cp) % (lay.ep * lay.etp) == 0
        assert lay.tp == 1 or lay.sequence_parallel
        if lay.ep * lay.etp > 1:
            assert lay.zero_shard_size is None
    assert {lay.etp for lay in layouts(Job(m, 64, H100), 16, Fixed(etp=2))} == {2}


PLAN = ["plan", "--gpus", "16", "--hardware", "h100-sxm", "--model", "deepseek-tiny", "--seq-len", "1024",
        "--global-batch-size", "64", "--d-model", "1024", "--n-head", "16", "--n-layer", "4",
        "--vocab-size", "32000", "--moe-ffn-hidden", "512"]


def test_plan_json_has_etp_and_the_command_carries_it(capsys, no_process_may_start):
    assert cli.main([*PLAN, "--top", "2", "--json", "--etp", "2", "--ep", "4"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert rows and all(r["etp"] == 2 and r["ep"] == 4 for r in rows)
    # ep 8 on tp 4 x dp 4: folded over tp, with SP
    assert cli.main([*PLAN, "--top", "2", "--tp", "4", "--ep", "8", "--etp", "1"]) == 0
    out = capsys.readouterr().out
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("torchrun ")]
    assert commands and "latent attention, 1 MTP" in out.splitlines()[0] and "(folded)" in out
    for command in commands:
        words = shlex.split(command)
        assert "--sequence-parallel" in words and words[words.index("--ep") + 1] == "8"
        cfg = validate(cli.config_from_args(cli.build_parser().parse_args(words[words.index("gridtrain") + 1:])), 16)
        assert ProcessGrid.build(16, tp=cfg.parallel.tp, pp=cfg.parallel.pp).folds_experts(8, 1)
    assert cli.main([*PLAN, "--top", "1", "--etp", "2", "--ep", "4"]) == 0
    assert "--etp 2" in capsys.readouterr().out


# ---- the dry run holds the closed forms (slow: a dry run each, seconds) -------------------------------------

def _tiny(c: dict):
    """deepseek-tiny laid out as a case says, and its grid."""
    cfg = preset_config("deepseek-tiny")
    cfg.model = dataclasses.replace(cfg.model, **c.get("model", {}))
    p = cfg.parallel
    p.tp, p.pp, p.cp, p.ep, p.etp = c.get("tp", 1), c.get("pp", 1), c.get("cp", 1), c.get("ep", 1), c.get("etp", 1)
    p.sequence_parallel = c.get("sp", False)
    p.schedule = c.get("schedule", "1f1b")
    cfg.training.micro_batch_size, cfg.training.global_batch_size = 2, c.get("batch", 8)
    cfg.activations.recompute = c.get("recompute", "none")
    cfg = set_fields(cfg, dtype=c.get("dtype", "bf16"), zero=c.get("zero", 0), device="cpu")
    return cfg, ProcessGrid.build(c["world"], tp=p.tp, pp=p.pp, cp=p.cp)


DRY_RUNS = {  # every rank of each
    "one rank fp32": dict(world=1, dtype="fp32"),
    "dp2 ep2 zero1": dict(world=2, ep=2, zero=1),
    "pp2: MTP and the table's copy on the last stage": dict(world=2, pp=2, zero=1),
    "pp2 dp2 ep2 zero3 fp32": dict(world=4, pp=2, ep=2, zero=3, dtype="fp32"),
    "etp2 ep2 dp4 zero1": dict(world=4, ep=2, etp=2, zero=1),
    "etp2 dp4 zero2": dict(world=4, etp=2, zero=2),
    "folded ep4 over tp2 sp zero1": dict(world=4, tp=2, sp=True, ep=4, zero=1),
    "folded etp2 ep2 over tp2 sp zero3": dict(world=4, tp=2, sp=True, ep=2, etp=2, zero=3),
    "tp2 without sp zero1": dict(world=4, tp=2, zero=1),
    "cp2 ep2 zero1": dict(world=4, cp=2, ep=2, zero=1),
    "pp2 ep2 full recompute zb-h1": dict(world=4, pp=2, ep=2, zero=1, recompute="full", schedule="zb-h1"),
    "pp2 selective": dict(world=2, pp=2, recompute="selective"),
    "pp2 tp2 sp ep4 zero2": dict(world=8, pp=2, tp=2, sp=True, ep=4, zero=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(DRY_RUNS))
def test_the_dry_run_holds_the_memory_model(case):
    """Parameter, gradient and optimizer bytes of every rank to the byte; the activation
    peak within 1% (the norms' statistics; 2% under cp, whose core keeps a few more bytes
    than its terms, dense models too). ZeRO-3 with full recomputation is left out of
    the activation check, as everywhere (tests/test_planner_moe.py)."""
    from gridtrain import dryrun

    c = DRY_RUNS[case]
    cfg, grid = _tiny(c)
    ranks = dryrun.dry_run(cfg, c["world"], "all", out=lambda *_: None)["ranks"]
    assert len(ranks) == c["world"]
    _hold_the_closed_forms(ranks, cfg, grid, rel=0.02 if c.get("cp") else 0.01)


def _hold_the_closed_forms(ranks: list[dict], cfg, grid, rel: float) -> None:
    """Each dry-run rank's parameter, gradient and optimizer bytes are the closed forms';
    its activation peak within ``rel`` of the formula (above it but for rounding: the
    formula leaves out the norms' statistics)."""
    for r in ranks:
        expected = expected_bytes(cfg, grid, r["rank"])
        assert {k: r[k] for k in expected} == expected, r["rank"]
        peak = expected_activation_peak(cfg, grid, r["rank"], "cpu")
        assert (1 - 1e-4) * peak <= r["activation_peak_bytes"] <= (1 + rel) * peak, \
            (r["rank"], r["activation_peak_bytes"], peak)


def _v3(argv: list[str], world: int, micro_batches: int = 1):
    """A DeepSeek-V3 layout from ``gridtrain train`` flags, with the global batch cut to
    ``micro_batches`` micro-batches a step: what a rank holds does not depend on it, and
    the dry run runs every micro-batch of the step."""
    cfg = cli.config_from_args(cli.build_parser().parse_args(argv))
    p = cfg.parallel
    grid = ProcessGrid.build(world, tp=p.tp, pp=p.pp, cp=p.cp)
    cfg.training.global_batch_size = grid.dp * cfg.training.micro_batch_size * micro_batches
    cfg.training.device = "cpu"
    return validate(cfg, world), grid


V3_LAYOUTS = {  # 1,024 ranks; the first and the last stage (MTP, the table's copy)
    "dp64 pp16 ep8 zb-h1": (["--tp", "1", "--pp", "16", "--micro-batch-size", "1", "--schedule", "zb-h1", "--ep", "8",
                             "--pp-layers", "6,3,3,3,4,4,4,4,4,4,4,4,4,4,4,2", "--recompute", "full", "--zero", "1"],
                            (0, 960)),
    "tp2 sp dp32 pp16 ep32 x etp2 folded": (["--tp", "2", "--sequence-parallel", "--pp", "16", "--micro-batch-size",
                                             "1", "--ep", "32", "--etp", "2", "--pp-partition", "parameters",
                                             "--recompute", "full", "--zero", "1"], (0, 961)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(V3_LAYOUTS))
def test_deepseek_v3_at_1024_ranks_holds_the_closed_forms(case):
    """DeepSeek-V3 (671 B and its MTP module) on 1,024 ranks, the first and the last
    stage's rank (about 5 s each): parameter, gradient and optimizer bytes as the closed
    forms say; the activation peak within 1%."""
    from gridtrain import dryrun

    flags, ranks = V3_LAYOUTS[case]
    cfg, grid = _v3(["train", "--model", "deepseek-v3", "--dtype", "bf16", *flags], 1024, micro_batches=2)
    report = dryrun.dry_run(cfg, 1024, ",".join(map(str, ranks)), out=lambda *_: None)
    assert [r["pp"] for r in report["ranks"]] == [0, 15]
    _hold_the_closed_forms(report["ranks"], cfg, grid, rel=0.01)


@pytest.mark.slow
def test_the_deepseek_v3_plan_for_1024_gpus_fits_and_runs_as_printed(capsys):
    """``gridtrain plan --model deepseek-v3 --gpus 1024 --hardware h100-sxm --seq-len 4096
    --global-batch-size 8192 --json`` (about 15 s) gives a layout that fits, whose
    command the trainer accepts at 1,024 ranks, and whose parameter, gradient and
    optimizer bytes are the closed forms' of the rank 0 of one of its stages (the one
    that needs the most; the dry runs above hold them at 1,024 ranks to the byte)."""
    argv = ["plan", "--model", "deepseek-v3", "--gpus", "1024", "--hardware", "h100-sxm", "--seq-len", "4096",
            "--global-batch-size", "8192", "--top", "1"]
    assert cli.main([*argv, "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["layouts"][0]
    assert best["fits"] and best["memory_gb_per_gpu"] <= H100.usable_memory_bytes / 1e9
    words = shlex.split(best["command"])
    # (a micro-batch per stage: what an interleaved schedule needs at least)
    cfg, grid = _v3(words[words.index("gridtrain") + 1:], 1024, micro_batches=best["pp"])
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.etp) == \
        (best["tp"], best["pp"], best["ep"], best["etp"])
    parts = best["memory_breakdown_gb"]
    held = [(parts[part] * 1e9, key) for part, key in (("parameters", "parameter_bytes"),
                                                        ("gradients", "gradient_bytes"),
                                                        ("optimizer", "optimizer_bytes"))]
    stages = [expected_bytes(cfg, grid, grid.rank_of(dp=0, pp=s, tp=0)) for s in range(grid.pp)]
    assert any(all(got == pytest.approx(e[key], rel=1e-12) for got, key in held) for e in stages), (held, stages)
