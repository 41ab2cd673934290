"""``gridtrain plan``'s deterministic parts, as data: ring collective volumes and times,
the GEMMs of a block on one TP rank and their FLOPs against the model's own count, the
pipeline bubble from the simulator on the schedules' action lists (with equal costs
the closed forms; with per-(stage, chunk) costs those costs), memory per GPU as the dry
run's closed forms, the search's validity, ordering and fixed fields, the JSON keys of
the issue, and the command line. No process is started; searches stay small."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from fractions import Fraction

import pytest

from gridtrain.cli import parser as cli
from gridtrain.config import ModelConfig, preset_config
from gridtrain.memory.model import expected_activation_peak, expected_bytes, expected_state_bytes
from gridtrain.parallel.grid import ProcessGrid
from gridtrain.models.decoder import training_flops_per_token
from gridtrain.parallel.pipeline.schedules import B, F, W, build_schedule
from gridtrain.parallel.pipeline.simulate import Costs, simulate
from gridtrain.planner import cost, published
from gridtrain.planner.cost import (Job, Layout, block_cost, block_gemms, bubble_closed_form, config_of,
                                    memory_bytes, predict, ring_link, ring_seconds)
from gridtrain.planner.machine import machine
from gridtrain.planner.search import Fixed, layouts, search
from gridtrain.training.validate import validate

A100 = machine("a100-80gb")
GPT = ModelConfig(n_layer=8, n_head=8, d_model=512, seq_len=256, vocab_size=1000)
LLAMA = ModelConfig(arch="llama", n_layer=8, n_head=8, n_kv_head=2, d_model=512, ffn_hidden=1376, seq_len=256,
                    vocab_size=1000, tie_embeddings=False)

ISSUE_KEYS = {"dp", "tp", "pp", "vpp", "micro_batch_size", "schedule", "recompute", "sequence_parallel", "zero",
              "step_time_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "hardware_tflops_per_gpu", "mfu",
              "memory_gb_per_gpu", "fits"}
CP_KEYS = {"cp", "cp_comm"}  # context parallelism's (tests/test_planner_cp.py)
ZERO_KEYS = {"zero_shard_size", "zero3_keep_gathered"}  # ZeRO-2/3 and hybrid sharding's (tests/test_planner_zero.py)
EP_KEYS = {"ep", "etp"}  # expert (tensor) parallelism's (tests/test_planner_moe.py, test_planner_deepseek.py)
FP8_KEYS = {"fp8_all_gather"}  # --fp8-all-gather's, per layout (tests/test_planner_fp8.py)


# ---- communication ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 8, 32])
def test_ring_all_reduce_sends_2_n_minus_1_over_n(n):
    nbytes, bandwidth, latency = 3e9, 2e11, 7e-6
    assert ring_seconds(nbytes, n, bandwidth, latency) == \
        pytest.approx(2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency)
    for kind in ("all_gather", "reduce_scatter"):
        assert ring_seconds(nbytes, n, bandwidth, latency, kind) == \
            pytest.approx((n - 1) / n * nbytes / bandwidth + (n - 1) * latency)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter"])
def test_a_ring_of_one_rank_is_free(kind):
    assert ring_seconds(1e12, 1, 1.0, 1.0, kind) == 0.0


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_collectives_of_a_block(tp):
    """Two all-reduces of the block's activations (b s d elements) per forward and per
    backward, over NVLink inside a node; with SP two all-gathers and two reduce-scatters,
    the same volume and steps, so the same time."""
    job = Job(GPT, 64, A100, "bf16")
    lay = Layout(dp=1, tp=tp, pp=1, micro_batch_size=2)
    act = 2 * GPT.seq_len * GPT.d_model * 2
    expected = 2 * ring_seconds(act, tp, A100.nvlink.bandwidth, A100.nvlink.latency)
    block = block_cost(job, lay)
    assert block.tp_comm_f == pytest.approx(expected) and block.tp_comm_b == pytest.approx(expected)
    assert block_cost(job, replace(lay, sequence_parallel=True)).tp_comm_f == pytest.approx(expected)
    assert (expected == 0.0) == (tp == 1)


@pytest.mark.parametrize("tp", [2, 8])
def test_sequence_parallel_backward_gathers_again(tp):
    """Under SP a block's backward all-gathers its two column layers' inputs again (each
    kept only its shard), beside the two reduce-scatters and two all-gathers that mirror
    the forward: 4 all-gathers and 2 reduce-scatters."""
    job = Job(GPT, 64, A100, "bf16")
    lay = Layout(dp=1, tp=tp, pp=1, micro_batch_size=2, sequence_parallel=True)
    act, link = 2 * GPT.seq_len * GPT.d_model * 2, A100.nvlink
    ag, rs = link.collective(act, tp, "all_gather"), link.collective(act, tp, "reduce_scatter")
    block = block_cost(job, lay)
    assert block.tp_comm_f == pytest.approx(2 * ag + 2 * rs)
    assert block.tp_comm_b == pytest.approx(4 * ag + 2 * rs)


def test_a_link_can_time_each_kind_of_operation_at_its_own_rates():
    from gridtrain.planner.machine import Link

    link = Link(1e9, 1e-4, (("reduce_scatter", 2e-3, 3e8), ("send", 5e-4, 2e9)))
    assert link.collective(1e6, 2) == pytest.approx(ring_seconds(1e6, 2, 1e9, 1e-4))
    assert link.collective(1e6, 4, "reduce_scatter") == pytest.approx(ring_seconds(1e6, 4, 3e8, 2e-3, "reduce_scatter"))
    assert link.send(1e6) == pytest.approx(1e6 / 2e9 + 5e-4)


def test_tp_beyond_a_node_goes_over_the_network():
    job = Job(GPT, 64, A100, "bf16", gpus_per_node=4)
    act = GPT.seq_len * GPT.d_model * 2
    expected = 2 * ring_seconds(act, 8, A100.network.bandwidth, A100.network.latency)
    assert block_cost(job, Layout(dp=1, tp=8, pp=1)).tp_comm_f == pytest.approx(expected)


def test_dp_ring_link_by_ranks_per_node():
    """Inside a node NVLink; across nodes each of the group's ranks on a node drives its
    own NIC, so k ranks per node move k times one GPU's network bandwidth."""
    net = A100.network.bandwidth
    assert ring_link(A100, 8, 1, 8) is A100.nvlink
    assert ring_link(A100, 2, 4, 8) is A100.nvlink
    assert ring_link(A100, 32, 8, 8) is A100.network  # tp 8: one rank of the group per node
    for stride, k in ((4, 2), (2, 4), (1, 8)):
        link = ring_link(A100, 32, stride, 8)
        assert link.bandwidth == pytest.approx(k * net) and link.latency == A100.network.latency
    assert ring_link(A100, 2, 1, 1).bandwidth == pytest.approx(net)  # one GPU per node


# ---- compute: the GEMMs of a block --------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_gpt2_block_gemms_under_tp(tp):
    t, d, f = 4 * GPT.seq_len, GPT.d_model, GPT.ffn_size
    assert block_gemms(GPT, t, tp) == [(t, 3 * d // tp, d), (t, d, d // tp), (t, f // tp, d), (t, d, f // tp)]


@pytest.mark.parametrize("tp,kv_heads", [(1, 2), (2, 1), (4, 1), (8, 1)])
def test_llama_block_gemms_under_tp_replicate_kv_heads_beyond_their_count(tp, kv_heads):
    """q, k, v, o, gate, up, down; a rank holds n_kv_head / tp key/value heads, or one
    whole (replicated) head when tp exceeds n_kv_head (2 here)."""
    t, d, f, hd = 2 * LLAMA.seq_len, LLAMA.d_model, LLAMA.ffn_size, LLAMA.head_dim
    kv = kv_heads * hd
    assert block_gemms(LLAMA, t, tp) == [(t, d // tp, d), (t, kv, d), (t, kv, d), (t, d, d // tp),
                                         (t, f // tp, d), (t, f // tp, d), (t, d, f // tp)]


def _layer_flops(m: ModelConfig, tp: int) -> float:
    """Per token, forward and backward, over all TP ranks: 2 m n k per GEMM, x3, and the
    attention core's 4 s d."""
    gemms = tp * sum(2 * a * b * c for a, b, c in block_gemms(m, 1, tp))
    return 3 * (gemms + 4 * m.seq_len * m.d_model)


def _model_layer_flops(m: ModelConfig) -> float:
    return (training_flops_per_token(m) - 3 * 2 * m.d_model * m.vocab_size) / m.n_layer


@pytest.mark.parametrize("m,tps", [(GPT, (1, 2, 4, 8)), (LLAMA, (1, 2)),
                                   (preset_config("gpt2-medium").model, (1, 2, 4, 8)),
                                   (preset_config("tinyllama-1.1b").model, (1, 2, 4)),
                                   (preset_config("llama3-8b").model, (1, 2, 4, 8))])
def test_block_gemm_flops_are_the_models_per_layer_flops(m, tps):
    for tp in tps:
        assert _layer_flops(m, tp) == pytest.approx(_model_layer_flops(m), rel=1e-12), tp


@pytest.mark.parametrize("tp", [4, 8])
def test_replicated_kv_heads_cost_their_extra_flops(tp):
    """Past n_kv_head, every rank projects one whole k and v head: tp heads where the
    model has n_kv_head, 2 (k, v) x 2 d head_dim FLOPs per token and extra head, x3."""
    extra = 3 * 2 * 2 * LLAMA.d_model * LLAMA.head_dim * (tp - LLAMA.kv_heads)
    assert _layer_flops(LLAMA, tp) - _model_layer_flops(LLAMA) == pytest.approx(extra)


def test_attention_scores_cost_only_the_op_by_op_core():
    """attention="math" passes over b x local heads x s^2 scores (SCORE_PASSES_*, dropout
    adding a read, a write and a one-byte mask); the fused kernel keeps none."""
    math = replace(GPT, attention="math", dropout=0.1)
    for tp in (1, 2, 4):
        scores = 2 * (GPT.n_head // tp) * GPT.seq_len ** 2
        f, b = cost.attention_score_seconds(math, 2, tp, A100, "bf16")
        assert f == pytest.approx(scores * (cost.SCORE_PASSES_FORWARD * 2 + 5) / A100.memory_bandwidth)
        assert b == pytest.approx(scores * (cost.SCORE_PASSES_BACKWARD * 2 + 5) / A100.memory_bandwidth)
    assert cost.attention_score_seconds(replace(math, dropout=0.0), 2, 1, A100, "bf16")[0] == \
        pytest.approx(2 * 8 * 256 ** 2 * cost.SCORE_PASSES_FORWARD * 2 / A100.memory_bandwidth)
    assert cost.attention_score_seconds(GPT, 2, 1, A100, "bf16") == (0.0, 0.0)
    lay = Layout(dp=1, tp=1, pp=1, micro_batch_size=2)
    slower = block_cost(Job(math, 8, A100), lay).f - block_cost(Job(replace(GPT, dropout=0.1), 8, A100), lay).f
    assert slower == pytest.approx(cost.attention_score_seconds(math, 2, 1, A100, "bf16")[0])


def test_a_gemm_runs_further_from_peak_when_a_dimension_is_small():
    """eff = gemm_efficiency x / (x + gemm_half), x the smallest dimension."""
    big = 2 * 4096 ** 3 / (cost.gemm_seconds(4096, 4096, 4096, A100, "bf16") - A100.kernel_s)
    assert big == pytest.approx(A100.peak_flops("bf16") * A100.gemm_efficiency * 4096 / (4096 + A100.gemm_half))
    small = 2 * 4096 * 4096 * 256 / (cost.gemm_seconds(4096, 4096, 256, A100, "bf16") - A100.kernel_s)
    assert small < big


# ---- the pipeline: the simulator on the schedules' action lists --------------------------------------------

@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (8, 16), (3, 7)])
def test_bubble_with_equal_costs_is_p_minus_1_over_m(name, p, m):
    c = Costs(f=1, b=2, w=0)
    timeline = simulate(build_schedule(name, p, m), c)
    ideal = m * (c.f + c.b)
    assert Fraction(timeline.makespan - ideal) / ideal == Fraction(p - 1, m)
    assert bubble_closed_form(Layout(dp=1, tp=1, pp=p), m) == pytest.approx((p - 1) / m)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 9, 3), (8, 16, 2)])
def test_interleaved_bubble_with_equal_costs_is_p_minus_1_over_v_m(p, m, v):
    c = Costs(f=1, b=2, w=0)  # per chunk: each of the v chunks is 1/v of the stage
    timeline = simulate(build_schedule("interleaved-1f1b", p, m, v), c, chunks=v)
    ideal = m * v * (c.f + c.b)
    assert Fraction(timeline.makespan - ideal) / ideal == Fraction(p - 1, v * m)
    assert bubble_closed_form(Layout(dp=1, tp=1, pp=p, vpp=v), m) == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)])
def test_per_stage_chunk_costs_are_honoured(name, v):
    p, m = 3, 6
    table = {(s, c): Costs(f=1 + s + 10 * c, b=2 + s + 10 * c, w=0.5 * (1 + c), latency=0.25 * (1 + s))
             for s in range(p) for c in range(v)}
    timeline = simulate(build_schedule(name, p, m, v), lambda s, c: table[(s, c)], v)
    split = name == "zb-h1"
    end = {}
    for i in timeline.intervals:
        c = table[(i.stage, i.action.chunk)]
        expected = {F: c.f, B: c.b if split else c.b + c.w, W: c.w}[i.action.kind]
        assert i.end - i.start == pytest.approx(expected), i
        end[(i.action.kind, i.action.mb, i.action.chunk * p + i.stage)] = (i.start, i.end)
    for (kind, mb, virtual), (start, _) in end.items():  # a forward waits for the previous chunk + latency
        if kind == F and virtual > 0:
            stage, chunk = virtual % p, virtual // p
            assert start >= end[(F, mb, virtual - 1)][1] + table[(stage, chunk)].latency - 1e-12
    for s in range(p):
        assert timeline.busy(s) == pytest.approx(m * sum(table[(s, c)].f + table[(s, c)].b + table[(s, c)].w
                                                         for c in range(v)))


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 9), (8, 16)])
def test_rendezvous_keeps_the_closed_form_bubbles_when_messages_are_free(name, v, p, m):
    """Waiting for send/receive batches as the runtime does costs these schedules nothing
    when a message takes no time: each send meets a receive its peer has already posted."""
    if m % p and name == "interleaved-1f1b":
        pytest.skip("interleaving needs m divisible by p")
    schedule = build_schedule(name, p, m, v)
    c = Costs(f=1, b=2, w=0)
    assert simulate(schedule, c, v, rendezvous=True).makespan == simulate(schedule, c, v).makespan


def test_rendezvous_lets_zb_h1_fill_its_bubble():
    """ZB-H1's stage 1 runs B1, then posts SEND_B1 alone before W0. The runtime leaves a
    batch of sends only in flight (it completes only when stage 0 posts RECV_B1, after
    its F2) and runs W0 meanwhile, so the weight gradients fill the bubble: with equal
    F, B, W and free messages ZB-H1 takes 3m + (p - 1) against 1F1B's 3m + 3(p - 1). A
    runtime that waited for that send there ran ZB-H1 no faster than 1F1B."""
    p, m = 2, 4
    c = Costs(f=1, b=1, w=1)
    assert simulate(build_schedule("zb-h1", p, m), c, rendezvous=True).makespan == 3 * m + (p - 1)
    assert simulate(build_schedule("1f1b", p, m), c, rendezvous=True).makespan == 3 * m + 3 * (p - 1)


def test_rendezvous_waits_for_sends_in_flight_at_the_next_batch():
    """A batch of sends only does not hold its stage; the stage's next batch (or the end
    of the schedule) waits for them."""
    from gridtrain.parallel.pipeline.schedules import RECV_F, SEND_F, Action

    schedule = [[Action(F, 0), Action(SEND_F, 0), Action(F, 1), Action(SEND_F, 1)],
                [Action(RECV_F, 0), Action(F, 0), Action(RECV_F, 1), Action(F, 1)]]
    timeline = simulate(schedule, lambda s, ch: Costs(f=1 if s == 0 else 5, b=0, w=0, latency=0.5), rendezvous=True)
    spans = sorted((i.stage, i.action.mb, i.start, i.end) for i in timeline.intervals)
    # stage 0 computes F1 while SEND_F0 waits for stage 1's receive (posted at 0): it
    # arrives at 1.5; F1 runs 1-2; SEND_F1 meets RECV_F1 (posted at 6.5) and arrives at 7
    assert spans == [(0, 0, 0, 1), (0, 1, 1, 2), (1, 0, 1.5, 6.5), (1, 1, 7.0, 12.0)]
    assert timeline.makespan == 12.0


def test_rendezvous_message_time_and_deadlock():
    """A message leaves when both sides have posted and takes the receiver's latency; two
    stages that both wait to receive first never proceed."""
    from gridtrain.parallel.pipeline.schedules import RECV_F, SEND_F, Action
    from gridtrain.parallel.pipeline.simulate import DeadlockError

    schedule = [[Action(F, 0), Action(SEND_F, 0)], [Action(RECV_F, 0), Action(F, 0)]]
    timeline = simulate(schedule, lambda s, c: Costs(f=1 + s, b=0, w=0, latency=0.5), rendezvous=True)
    assert [(i.stage, i.start, i.end) for i in timeline.intervals] == [(0, 0, 1), (1, 1.5, 3.5)]
    stuck = [[Action(RECV_F, 0), Action(F, 0)], [Action(RECV_F, 0), Action(F, 0)]]
    with pytest.raises(DeadlockError):
        simulate(stuck, Costs(), rendezvous=True)


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)])
def test_predicted_bubble_is_the_simulators(name, v, monkeypatch):
    """With the head and the stage-to-stage transfer costing nothing, every chunk is its
    blocks' F, B and W: the predicted bubble is (p - 1) / v of one micro-batch's stage time."""
    monkeypatch.setattr(cost, "head_cost", lambda job, lay: (0.0, 0.0, 0.0))
    monkeypatch.setattr(cost, "p2p_seconds", lambda job, lay: 0.0)
    p, m = 4, 8
    job = Job(GPT, m, A100, "bf16")
    lay = Layout(dp=1, tp=1, pp=p, vpp=v, schedule=name)
    block = block_cost(job, lay)
    per_microbatch = GPT.n_layer // p * (block.f + block.b + block.w)
    pred = predict(job, lay, memory=False)
    assert pred.bubble_s == pytest.approx((p - 1) * per_microbatch / v)
    assert pred.compute_s == pytest.approx(m * per_microbatch)


# ---- memory: the dry run's closed forms ---------------------------------------------------------------------

BIG = ModelConfig(n_layer=32, n_head=32, d_model=4096, seq_len=2048, vocab_size=51200)
MEMORY_CASES = [
    (GPT, 16, Layout(dp=2, tp=2, pp=2, micro_batch_size=2, recompute="selective", sequence_parallel=True, zero=1)),
    (GPT, 16, Layout(dp=4, tp=1, pp=2, schedule="zb-h1")),
    (LLAMA, 16, Layout(dp=1, tp=2, pp=4, vpp=2, schedule="interleaved-1f1b", recompute="full")),
    (BIG, 512, Layout(dp=16, tp=8, pp=8, vpp=2, schedule="interleaved-1f1b", recompute="full",
                      sequence_parallel=True, zero=1)),  # 1024 GPUs
    (BIG, 1024, Layout(dp=128, tp=8, pp=1, micro_batch_size=2, recompute="selective")),  # 1024 GPUs
]


@pytest.mark.parametrize("model,batch,lay", MEMORY_CASES)
def test_memory_is_the_dry_runs_closed_forms(model, batch, lay):
    """Parameters, gradient buffer and optimizer state (expected_bytes) plus the
    schedule's activation peak (expected_activation_peak; ZB-H1's with the inputs its
    deferred weight gradients keep), on the worst stage of the pipeline: ZeRO-0 and 1
    hold nothing else within a step (ZeRO-1 publishes the weights in place)."""
    job = Job(model, batch, A100, "bf16")
    cfg = config_of(job, lay)
    grid = ProcessGrid(world_size=lay.gpus, tp=lay.tp, pp=lay.pp, dp=lay.dp)
    per_stage = []
    for s in range(lay.pp):
        rank = grid.rank_of(dp=0, pp=s, tp=0)
        held = expected_bytes(cfg, grid, rank)
        peak = expected_activation_peak(cfg, grid, rank, "cuda", weight_inputs=lay.schedule == "zb-h1")
        per_stage.append(held["parameter_bytes"] + held["gradient_bytes"] + held["optimizer_bytes"]
                         + peak)
        assert not any(expected_state_bytes(cfg, grid, rank)[k] for k in ("gradient_shard_bytes", "gathered_bytes",
                                                                            "staging_bytes"))
    assert memory_bytes(job, lay) == pytest.approx(max(per_stage), rel=1e-12)
    assert predict(job, lay).memory_bytes == memory_bytes(job, lay)


# ---- FLOP counts and the JSON of a prediction ---------------------------------------------------------------

def test_hardware_flops_with_full_recompute_are_the_papers_equation_3():
    """Model FLOPs exclude recomputation; with full recomputation hardware FLOPs add one
    forward of the blocks: 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)) for GPT-2's shape."""
    m = ModelConfig(n_layer=24, n_head=24, d_model=2304, seq_len=2048, vocab_size=51200)
    batch = 64
    lay = Layout(dp=4, tp=2, pp=1, micro_batch_size=4, recompute="full")
    p = predict(Job(m, batch, A100, "fp16"), lay, memory=False)
    paper = eval(published.FLOPS_PER_ITERATION_FORMULA, {}, {"B": batch, "s": 2048, "l": 24, "h": 2304, "V": 51200})
    assert p.hardware_flops == pytest.approx(paper, rel=1e-12)
    assert p.model_flops == pytest.approx(training_flops_per_token(m) * batch * 2048, rel=1e-12)
    none = predict(Job(m, batch, A100, "fp16"), replace(lay, recompute="none"), memory=False)
    assert none.hardware_flops == none.model_flops


def test_prediction_json_has_the_issues_keys():
    job = Job(GPT, 32, A100, "bf16")
    p = predict(job, Layout(dp=2, tp=2, pp=2, micro_batch_size=2, recompute="selective", sequence_parallel=True,
                            zero=1))
    data = p.as_json()
    assert set(data) == ISSUE_KEYS | CP_KEYS | ZERO_KEYS | EP_KEYS | FP8_KEYS | {"breakdown_s", "pp_layers",
                                                                                 "memory_breakdown_gb", "optimizer"}
    assert data["pp_layers"] == [4, 4]
    assert set(data["breakdown_s"]) == {"compute", "tp_comm", "cp_comm", "zero_comm", "ep_comm", "bubble",
                                        "dp_exposed", "optimizer", "fp8_scales"}
    assert (data["dp"], data["tp"], data["pp"], data["micro_batch_size"], data["zero"]) == (2, 2, 2, 2, 1)
    assert data["tokens_per_s_per_gpu"] == pytest.approx(32 * GPT.seq_len / p.step_time_s / 8)
    assert data["model_tflops_per_gpu"] == pytest.approx(p.model_flops / p.step_time_s / 8 / 1e12)
    assert data["hardware_tflops_per_gpu"] > data["model_tflops_per_gpu"]  # selective recomputes the core
    assert data["mfu"] == pytest.approx(data["model_tflops_per_gpu"] * 1e12 / A100.peak_flops("bf16"))
    assert data["memory_gb_per_gpu"] == pytest.approx(memory_bytes(job, p.layout) / 1e9)
    assert data["fits"] is True
    json.dumps(data)


# ---- the search -------------------------------------------------------------------------------------------

def _divides(lay: Layout, m: ModelConfig, gpus: int, batch: int, node: int = 8) -> bool:
    even = m.n_layer % (lay.pp * lay.vpp) == 0
    return (lay.dp * lay.tp * lay.pp == gpus and (even or (lay.vpp == 1 and lay.pp_partition == "parameters"))
            and batch % (lay.micro_batch_size * lay.dp) == 0 and m.n_head % lay.tp == 0 and lay.tp <= node
            and (lay.vpp == 1 or lay.schedule == "interleaved-1f1b"))


def test_search_returns_layouts_that_divide_and_fit_best_first():
    """With the device's memory set to the median layout's need, only those below it come
    back, fastest first."""
    fixed = Fixed(sequence_parallel=False, zero=0)
    job = Job(GPT, 32, A100, "bf16")
    needs = sorted(memory_bytes(job, lay) for lay in layouts(job, 8, fixed))
    limit = needs[len(needs) // 2]
    small = Job(GPT, 32, replace(A100, memory=limit / A100.usable_fraction), "bf16")
    best = search(small, 8, fixed, top=12)
    assert len(best) == 12
    for p in best:
        assert p.fits and p.memory_bytes <= limit * (1 + 1e-12), p.layout
        assert _divides(p.layout, GPT, 8, 32), p.layout
    steps = [p.step_time_s for p in best]
    assert steps == sorted(steps)


def test_search_ranks_by_the_full_prediction():
    """With a shortlist that keeps every fitting layout, the ranking is the full
    prediction's: the same as predicting each one and sorting."""
    fixed = Fixed(tp=2, recompute="none", sequence_parallel=False, zero=0)
    job = Job(GPT, 16, A100, "bf16")
    every = sorted((predict(job, lay) for lay in layouts(job, 8, fixed)), key=lambda p: p.step_time_s)
    found = search(job, 8, fixed, top=len(every), shortlist=10 ** 6)
    assert [p.layout for p in found] == [p.layout for p in every]


@pytest.mark.parametrize("fixed", [Fixed(tp=2, pp=2), Fixed(pp=4, vpp=2, recompute="full"),
                                   Fixed(micro_batch_size=2, schedule="gpipe", zero=1),
                                   Fixed(tp=4, sequence_parallel=True)])
def test_search_keeps_the_fixed_fields(fixed):
    best = search(Job(LLAMA, 32, A100, "bf16"), 16, fixed, top=6, shortlist=12)
    assert best
    for p in best:
        for name, value in vars(fixed).items():
            assert value is None or getattr(p.layout, name) == value, (name, p.layout)
        assert _divides(p.layout, LLAMA, 16, 32) and p.fits


def test_search_when_nothing_fits_returns_the_smallest_marked():
    tiny = Job(GPT, 16, replace(A100, memory=1e6), "bf16")
    best = search(tiny, 4, Fixed(recompute="full"), top=3)
    assert best and not any(p.fits for p in best)
    needs = [p.memory_bytes for p in best]
    assert needs == sorted(needs)


def test_search_finds_nothing_for_an_impossible_tp():
    assert search(Job(GPT, 16, A100, "bf16"), 8, Fixed(tp=3)) == []


# ---- the command line ---------------------------------------------------------------------------------

PLAN = ["plan", "--gpus", "8", "--hardware", "a100-80gb", "--model", "gpt2", "--seq-len", "1024",
        "--global-batch-size", "32"]


def test_plan_prints_k_layouts_with_their_torchrun_commands(capsys, no_process_may_start):
    assert cli.main([*PLAN, "--top", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gridtrain plan: 8 x a100-80gb")
    assert [line.split(".")[0] for line in lines if line[:1].isdigit()] == ["1", "2", "3"]
    commands = [line.strip() for line in lines if line.strip().startswith("torchrun ")]
    assert len(commands) == 3
    for command in commands:  # each runs exactly as printed: the train parser and validation accept it
        words = shlex.split(command)
        world = int(words[words.index("--nnodes") + 1]) * int(words[words.index("--nproc-per-node") + 1])
        args = cli.build_parser().parse_args(words[words.index("gridtrain") + 1:])
        cfg = validate(cli.config_from_args(args), world)
        assert world == 8 and world % (cfg.parallel.tp * cfg.parallel.pp) == 0


def test_plan_json_parses(capsys, no_process_may_start):
    assert cli.main([*PLAN, "--top", "2", "--json", "--recompute", "full"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["layouts"]) == 2 and (data["fp8"], data["fp8_all_gather"]) == ("none", False)
    for row in data["layouts"]:
        assert set(row) == ISSUE_KEYS | CP_KEYS | ZERO_KEYS | EP_KEYS | FP8_KEYS | {
            "breakdown_s", "pp_layers", "command", "memory_breakdown_gb", "optimizer"}
        assert row["recompute"] == "full" and row["fits"] and row["dp"] * row["tp"] * row["pp"] == 8
    assert data["layouts"][0]["step_time_s"] <= data["layouts"][1]["step_time_s"]


BAD_PLANS = {
    "no model": (["plan", "--gpus", "8", "--hardware", "a100-80gb", "--seq-len", "1024", "--global-batch-size", "32"],
                 "no model"),
    "impossible fixed tp": ([*PLAN, "--tp", "5"], "no layout of 8 GPUs"),
    "tp beyond a node": ([*PLAN, "--tp", "16", "--gpus", "16"], "no layout of 16 GPUs"),
    "unknown hardware": ([*PLAN[:4], "tpu-v9", *PLAN[5:]], "tpu-v9"),
}


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_bad_plan_is_one_line_with_status_2(case, capsys, no_process_may_start):
    argv, expected = BAD_PLANS[case]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("gridtrain: error: "), captured.err
    assert expected in captured.err


def test_layers_that_do_not_divide_over_the_stages_get_the_runtimes_balanced_split():
    """BLOOM-176B (70 layers on pp 12) and Llama 3.1 405B (126 on pp 16) trained with
    uneven stages; the planner plans them with the runtime's split by parameters and
    prints it as --pp-layers, which gridtrain train accepts and runs as planned."""
    from gridtrain.memory.model import block_partition
    from gridtrain.parallel.pipeline.partition import check_counts
    from gridtrain.planner.command import torchrun_command

    model = replace(LLAMA, n_layer=10)
    job = Job(model, 16, A100, "bf16")
    found = list(layouts(job, 8, Fixed(tp=2, pp=4)))
    assert found and all(lay.pp_partition == "parameters" and lay.vpp == 1 for lay in found)
    # interleaved when --vpp is given: 8 virtual stages of 10 layers, split the same way
    # (tests/test_planner_layouts.py: a 94-layer model on pp 8 x vpp 4)
    assert all(lay.pp_partition == "parameters" for lay in layouts(job, 8, Fixed(tp=2, pp=4, vpp=2)))
    p = predict(job, found[0])
    assert sum(p.pp_layers) == 10 and len(p.pp_layers) == 4 and max(p.pp_layers) - min(p.pp_layers) <= 1
    grid = ProcessGrid(world_size=8, tp=2, pp=4, dp=1)
    assert [len(ids) for ids in block_partition(config_of(job, p.layout), grid)] == p.pp_layers
    check_counts(p.pp_layers, 4, 10)
    args = cli.build_parser().parse_args(["plan", "--arch", "llama", "--n-layer", "10", "--seq-len", "64",
                                          "--global-batch-size", "16", "--gpus", "8", "--hardware", "a100-80gb"])
    command = torchrun_command(args, p, 8)
    assert f"--pp-layers {','.join(map(str, p.pp_layers))}" in command
    train = cli.config_from_args(cli.build_parser().parse_args(command.split("-m gridtrain ")[1].split()))
    assert train.parallel.pp_layers == p.pp_layers
    assert p.as_json()["pp_layers"] == p.pp_layers
    # evenly divided layouts keep the uniform split and print no --pp-layers
    even = predict(job, next(iter(layouts(job, 8, Fixed(tp=4, pp=2)))))
    assert even.layout.pp_partition == "uniform" and "--pp-layers" not in torchrun_command(args, even, 8)
