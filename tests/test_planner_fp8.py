"""``gridtrain plan --fp8``, as data: the FP8 peaks of the hardware table, which GEMMs run
in float8, their compute at the FP8 peak (half the bf16 time at the same efficiency),
the casts' bytes, the experts' bf16 weight gradient, ZeRO-3's block gathers at one byte
under ``--fp8-all-gather``, the weights' scale all-reduce, the ``fp8`` JSON field, the
printed command, and the one-line refusals. No process is started; searches stay small."""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import replace

import pytest

from gridtrain.cli import parser as cli
from gridtrain.config import ModelConfig
from gridtrain.memory.model import stage_parameters
from gridtrain.models.decoder import block_parameters
from gridtrain.parallel.pipeline.simulate import Costs
from gridtrain.planner import fp8
from gridtrain.planner.command import torchrun_command
from gridtrain.planner.cost import (Job, Layout, block_cost, block_gemms, data_parallel_seconds, expert_gemm_passes,
                                    fp8_scale_seconds, gemm_seconds, linear_seconds, mlp_gemms, moe_routing,
                                    predict, ring_link, zero_chunk_seconds, zero_links, zero_units)
from gridtrain.planner.hardware import DEVICE_TAGS, HARDWARE, hardware_key
from gridtrain.planner.machine import machine, machine_from_profile
from gridtrain.planner.measure import train_args

H100, H200, A100 = machine("h100-sxm"), machine("h200"), machine("a100-80gb")
LLAMA = ModelConfig(arch="llama", n_layer=4, n_head=8, n_kv_head=2, d_model=512, ffn_hidden=1376, seq_len=1024,
                    vocab_size=1000, tie_embeddings=False)
BIG = ModelConfig(arch="llama", n_layer=4, n_head=32, n_kv_head=8, d_model=4096, ffn_hidden=14336, seq_len=8192,
                  vocab_size=128256, tie_embeddings=False)  # Llama 3 8B's blocks
MOE = ModelConfig(arch="llama", n_layer=2, n_head=8, n_kv_head=2, d_model=512, ffn_hidden=1376, seq_len=1024,
                  vocab_size=1000, n_experts=8, moe_top_k=2, moe_ffn_hidden=256, tie_embeddings=False)
PLAN = ["plan", "--arch", "llama", "--n-layer", "4", "--n-head", "8", "--n-kv-head", "2", "--d-model", "512",
        "--ffn-size", "1376", "--vocab-size", "1000", "--seq-len", "1024", "--global-batch-size", "64",
        "--gpus", "8"]


def job(model=LLAMA, hw=H100, recipe="tensorwise", gather=False, batch=64) -> Job:
    return Job(model, batch, hw, "bf16", fp8=recipe, fp8_all_gather=gather)


# ---- the hardware table ------------------------------------------------------------------------------

def test_fp8_peaks_dense_hopper_only():
    """H100 SXM and H200: 1,979 dense (NVIDIA's 3,958 with sparsity, halved), twice bf16;
    A100: none, refused by name."""
    for key in ("h100-sxm", "h200"):
        hw = HARDWARE[key]
        assert hw.peak_tflops("fp8") == hw.peak_tflops("float8_e4m3fn") == 1979.0
        assert hw.peak_tflops("fp8") == 2 * hw.peak_tflops("bf16")
        assert "3,958" in hw.notes and "planner-sources" in hw.notes
        assert machine(key).peak["fp8"] == 1979e12
    for key in ("a100-40gb", "a100-80gb"):
        assert HARDWARE[key].peak_tflops_fp8 is None and "fp8" not in machine(key).peak
        with pytest.raises(ValueError, match="no FP8 Tensor Cores"):
            HARDWARE[key].peak_tflops("fp8")
    assert [hardware_key(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla T4")] \
        == ["h200", "h100-sxm", "a100-80gb", None]


def test_a_cpu_emulates_fp8_at_its_fp32_rate():
    profile = {"cores": 2, "gemm_flops": {"256": 5e10, "1024": 1e11}, "link": {"all_reduce": [1e-4, 1e9]},
               "bandwidth": 1e10, "kernel_s": 1e-5}
    cpu = machine_from_profile(profile, 1)
    assert cpu.peak["fp8"] == cpu.peak["fp32"]


# ---- which GEMMs, and how fast ------------------------------------------------------------------------

def test_which_block_gemms_run_in_float8():
    """All of a block's linears but a column layer whose slice several tp ranks hold."""
    assert fp8.block_float8(LLAMA, 1) == [True] * 7  # q, k, v, o, gate, up, down
    assert fp8.block_float8(LLAMA, 2) == [True] * 7  # 2 kv heads over tp 2: a head each
    assert fp8.block_float8(LLAMA, 4) == [True, False, False, True, True, True, True]  # k, v replicated
    assert fp8.block_float8(LLAMA, 4, mlp=False) == [True, False, False, True]
    gpt = ModelConfig(n_layer=2, n_head=4, d_model=128, seq_len=64, vocab_size=100)
    assert fp8.block_float8(gpt, 2) == [True] * 4
    mla = ModelConfig(arch="llama", attention_type="mla", n_layer=2, n_head=4, d_model=256, seq_len=64,
                      vocab_size=100, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
                      v_head_dim=32)
    for tp in (1, 2):
        flags = fp8.block_float8(mla, tp)
        assert len(flags) == len(block_gemms(mla, 8, tp))
        assert flags[:5] == [tp == 1, True, tp == 1, True, True]  # q_a, q_b, kv_a, kv_b, proj


@pytest.mark.parametrize("recipe,speed", [("tensorwise", 1.0), ("rowwise", 0.9)])
def test_the_linear_compute_halves_at_the_same_efficiency(recipe, speed):
    """A compute-bound GEMM at the FP8 peak (twice bf16's) times the same efficiency takes
    half the bf16 time (rowwise: at 0.9 of tensorwise's rate); the block's float8 GEMMs
    add their casts as memory traffic and kernel launches, forward and backward, and
    nothing else."""
    m, n, k = 8192, 4096, 14336
    wide = gemm_seconds(m, n, k, H100, "bf16") - H100.kernel_s
    narrow = gemm_seconds(m, n, k, H100, "fp8", speed=speed) - H100.kernel_s
    assert narrow / wide == pytest.approx(0.5 / speed, rel=1e-12)
    assert fp8.RECIPE_SPEED[recipe] == speed
    shapes = block_gemms(BIG, 8192, 1)
    bf16 = linear_seconds(job(BIG, recipe="none"), shapes, fp8.block_float8(BIG, 1))
    f, b, w = linear_seconds(job(BIG, recipe=recipe), shapes, fp8.block_float8(BIG, 1))
    kernels = len(shapes) * H100.kernel_s
    casts = [sum(fp8.cast_bytes(recipe, *s)[i] for s in shapes) / H100.memory_bandwidth
             + len(shapes) * fp8.cast_kernels(recipe)[i] * H100.kernel_s for i in (0, 1)]
    assert bf16[0] == bf16[1] == bf16[2]
    assert (f - casts[0] - kernels) / (bf16[0] - kernels) == pytest.approx(0.5 / speed, rel=1e-12)
    assert (b - casts[1] - kernels) / (bf16[1] - kernels) == pytest.approx(0.5 / speed, rel=1e-12)
    assert (w - kernels) / (bf16[2] - kernels) == pytest.approx(0.5 / speed, rel=1e-12)
    # without --fp8 the flags change nothing
    assert linear_seconds(job(BIG, recipe="none"), shapes) == bf16


def test_cast_bytes_per_operand():
    """8 rows of 2 features into 4: x 16, w 8, g 32 elements. Tensorwise: x amax + cast (5)
    and w cast (3) forward; g amax + cast (5), transposed copies of w, g, x (2 each)
    backward. Rowwise: every GEMM casts its own operands; experts skip the weight
    gradient's casts (it runs in bf16)."""
    assert fp8.cast_bytes("tensorwise", 8, 4, 2) == (5 * 16 + 3 * 8, 5 * 32 + 2 * 8 + 2 * 32 + 2 * 16)
    assert fp8.cast_bytes("rowwise", 8, 4, 2) == (5 * 16 + 3 * 8, 5 * 32 + 3 * 8 + 5 * 32 + 5 * 16)
    assert fp8.cast_bytes("tensorwise", 8, 4, 2, grad_weight=False) == (104, 5 * 32 + 2 * 8)
    assert fp8.cast_bytes("rowwise", 8, 4, 2, grad_weight=False) == (104, 5 * 32 + 3 * 8)


def test_the_attention_core_and_head_stay_bf16():
    """A block's float8 step differs from its bf16 one by its linears only."""
    lay = Layout(dp=1, tp=1, pp=1, micro_batch_size=1)
    shapes = block_gemms(BIG, BIG.seq_len, 1)
    flags = fp8.block_float8(BIG, 1)
    for recipe in ("tensorwise", "rowwise"):
        a, b = block_cost(job(BIG, recipe="none"), lay), block_cost(job(BIG, recipe=recipe), lay)
        wide, narrow = linear_seconds(job(BIG, recipe="none"), shapes, flags), \
            linear_seconds(job(BIG, recipe=recipe), shapes, flags)
        assert b.f - a.f == pytest.approx(narrow[0] - wide[0], rel=1e-9)
        assert b.b - a.b == pytest.approx(narrow[1] - wide[1], rel=1e-9)
        assert b.w - a.w == pytest.approx(narrow[2] - wide[2], rel=1e-9)


def test_experts_run_dequantised_bf16_gemms_with_a_bf16_weight_gradient():
    """The runtime's experts: casts per token, dequantised to bf16, bf16 grouped GEMMs
    (no scaled grouped GEMM yet): slower than bf16 by exactly the casts' and the
    dequantisation's traffic; the weight gradient bf16's."""
    lay = Layout(dp=8, tp=1, pp=1, ep=8)
    j = job(MOE)
    bf16, f8 = expert_gemm_passes(job(MOE, recipe="none"), lay), expert_gemm_passes(j, lay)
    assert f8[2] == pytest.approx(bf16[2], rel=1e-12)  # the weight gradient: bf16
    rows = max(1, round(moe_routing(j, lay)[2]))
    shapes = mlp_gemms(MOE, rows, MOE.moe_ffn_size)
    extra_f = sum(fp8.cast_bytes("tensorwise", *s, grad_weight=False)[0] + fp8.dequantised_bytes(*s)[0]
                  for s in shapes)
    extra_b = sum(fp8.cast_bytes("tensorwise", *s, grad_weight=False)[1] + fp8.dequantised_bytes(*s)[1]
                  for s in shapes)
    per_rank = MOE.n_experts // lay.ep
    bandwidth = j.hardware.memory_bandwidth
    launches = [len(shapes) * n * j.hardware.kernel_s for n in fp8.cast_kernels("tensorwise", grad_weight=False)]
    assert f8[0] - bf16[0] == pytest.approx(per_rank * (extra_f / bandwidth + launches[0]), rel=1e-9)
    assert f8[1] - bf16[1] == pytest.approx(per_rank * (extra_b / bandwidth + launches[1]), rel=1e-9)


def test_a_float8_step_is_faster_and_mfu_stays_against_the_bf16_peak():
    lay = Layout(dp=1, tp=1, pp=1, micro_batch_size=1)
    steps = {r: predict(job(BIG, recipe=r, batch=1), lay, memory=False) for r in ("none", "tensorwise", "rowwise")}
    assert steps["tensorwise"].step_time_s < steps["rowwise"].step_time_s < steps["none"].step_time_s
    assert all(p.peak_flops == H100.peak["bf16"] for p in steps.values())
    assert steps["tensorwise"].model_flops == steps["none"].model_flops
    assert steps["none"].fp8_flags() == [] and steps["rowwise"].fp8_flags() == ["--fp8", "rowwise"]


# ---- ZeRO-3's gathers and the scales ------------------------------------------------------------------

def test_fp8_all_gather_halves_the_block_gathers():
    """ZeRO-3 per micro-batch: the blocks' units gather one byte an element, the
    embedding's (and the head's) two; the reduce-scatters are unchanged. Without
    --fp8-all-gather, or not ZeRO-3, the bf16 bytes."""
    lay = Layout(dp=8, tp=1, pp=2, zero=3)
    link = zero_links(job(), lay)[0]
    units = zero_units(LLAMA, 1, 2, True, False)
    assert units[1:] == [block_parameters(LLAMA, 1)] * 2
    scatters = sum(link.collective(4 * u, 8, "reduce_scatter") for u in units)
    bf16 = [link.collective(2 * u, 8, "all_gather") for u in units]
    narrow = [bf16[0]] + [link.collective(1 * u, 8, "all_gather") for u in units[1:]]
    assert zero_chunk_seconds(job(gather=True), lay, 2, True, False) == pytest.approx(
        (sum(narrow), narrow[0], sum(narrow) + scatters))
    assert zero_chunk_seconds(job(), lay, 2, True, False) == pytest.approx((sum(bf16), bf16[0], sum(bf16) + scatters))
    # the chunk that ends the model: its blocks first (gathered at one byte), then the head
    ending = zero_units(LLAMA, 1, 2, False, True)
    first = zero_chunk_seconds(job(gather=True), lay, 2, False, True)[1]
    assert first == pytest.approx(link.collective(ending[0], 8, "all_gather"))
    assert job(gather=True).fp8_gathers(lay) and not job(gather=True).fp8_gathers(replace(lay, zero=2))
    # kept gathered: the step's one gather, the blocks' share at one byte
    kept = replace(lay, pp=1, zero3_keep_gathered=True)
    params = 10 ** 8
    outside = stage_parameters(LLAMA, 1, 0, True, True)

    def idle(stage, chunk):  # nothing to hide behind
        return Costs(f=0.0, b=0.0, w=0.0)
    wide = data_parallel_seconds(job(), kept, params, idle, 25.0)[1]
    half = data_parallel_seconds(job(gather=True), kept, params, idle, 25.0)[1]
    share = (outside + (params - outside) / 2) / params
    assert (wide, half) == pytest.approx((link.collective(2 * params, 8, "all_gather"),
                                          link.collective(2 * params * share, 8, "all_gather")))


def test_the_weight_scales_are_one_small_all_reduce_a_step():
    """Tensorwise: one fp32 amax per float8 weight of the stage (a Llama block's 7), over
    the ZeRO-3 shard group as a tree; rowwise: one per row and column. Nothing without
    --fp8, and nothing where no rank splits a weight (ZeRO-0/1/2 at tp 1)."""
    lay = Layout(dp=8, tp=1, pp=1, zero=3)
    link = ring_link(H100, 8, 1, 8)
    latency, bandwidth = link.rates("all_reduce")
    tree = 2 * math.ceil(math.log2(8)) * latency
    assert fp8_scale_seconds(job(), lay, 4) == pytest.approx(tree + 2 * 4 * (7 * 4) / bandwidth)
    rows_cols = sum(n + k for _, n, k in block_gemms(LLAMA, 1, 1))
    assert fp8_scale_seconds(job(recipe="rowwise"), lay, 4) == pytest.approx(tree + 2 * 4 * (rows_cols * 4) / bandwidth)
    assert fp8_scale_seconds(job(recipe="none"), lay, 4) == 0.0
    assert fp8_scale_seconds(job(), replace(lay, zero=1), 4) == 0.0
    p = predict(job(), lay, memory=False)
    assert p.fp8_scales_s == pytest.approx(fp8_scale_seconds(job(), lay, 4)) and p.fp8_scales_s < 1e-3
    assert p.as_json()["breakdown_s"]["fp8_scales"] == p.fp8_scales_s


# ---- the command ---------------------------------------------------------------------------------------

def test_plan_json_has_fp8_and_the_commands_carry_the_flags(capsys, no_process_may_start):
    assert cli.main([*PLAN, "--hardware", "h100-sxm", "--fp8", "tensorwise", "--fp8-all-gather", "--zero", "3",
                     "--top", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fp8"] == "tensorwise" and data["fp8_all_gather"] is True
    for row in data["layouts"]:
        assert row["zero"] == 3 and row["fp8_all_gather"] is True
        assert row["command"].endswith("--fp8 tensorwise --fp8-all-gather")
        words = shlex.split(row["command"])
        cfg = cli.config_from_args(cli.build_parser().parse_args(words[words.index("gridtrain") + 1:]))
        assert (cfg.training.fp8, cfg.training.fp8_all_gather, cfg.parallel.zero) == ("tensorwise", True, 3)
    assert cli.main([*PLAN, "--hardware", "h100-sxm", "--fp8", "rowwise", "--zero", "1", "--top", "1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["layouts"][0]
    assert row["command"].endswith("--zero 1 --fp8 rowwise") and row["fp8_all_gather"] is False
    assert cli.main([*PLAN, "--hardware", "h100-sxm", "--top", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fp8"] == "none"


def test_fp8_all_gather_is_carried_by_zero_3_layouts_only():
    args = cli.build_parser().parse_args([*PLAN, "--hardware", "h100-sxm", "--fp8", "tensorwise",
                                          "--fp8-all-gather"])
    for zero, flags in ((3, "--fp8 tensorwise --fp8-all-gather"), (1, "--fp8 tensorwise")):
        p = predict(job(gather=True), Layout(dp=8, tp=1, pp=1, zero=zero), memory=False)
        assert torchrun_command(args, p, 8).endswith(flags)
        assert " ".join(train_args([], p, 64, 1024, "bf16", 3)).endswith(flags)


REFUSED = {
    "A100": (["--hardware", "a100-80gb", "--fp8", "tensorwise"], "needs FP8 Tensor Cores, which the a100-80gb"),
    "fp16": (["--hardware", "h100-sxm", "--fp8", "rowwise", "--dtype", "fp16"], "pass --dtype bf16"),
    "gather without fp8": (["--hardware", "h100-sxm", "--fp8-all-gather"], "--fp8 none"),
    "gather without zero 3": (["--hardware", "h100-sxm", "--fp8", "tensorwise", "--fp8-all-gather", "--zero", "2"],
                              "pass --zero 3"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bad_fp8_plans_are_one_line(case, capsys, no_process_may_start):
    flags, expected = REFUSED[case]
    assert cli.main([*PLAN, *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and expected in captured.err, captured.err


def test_the_training_report_names_both_peaks_of_an_fp8_run():
    """MFU of an --fp8 run: against the bf16 peak, said so, and the FP8 peak (the planner's
    table) beside it; an unknown FP8 peak is said in words. Off CUDA no FP8 peak."""
    import torch

    from gridtrain.training.report import PEAK_FP8_TFLOPS, fp8_peak_tflops, mfu_fp8_line

    for tag, key in DEVICE_TAGS:  # the report's table is the planner's (A100: none in either)
        assert HARDWARE[key].peak_tflops_fp8 == PEAK_FP8_TFLOPS.get(tag)

    assert mfu_fp8_line(405.0, 989.0, 1979.0) == \
        "MFU 41.0% of the bf16 peak (989 TFLOP/s), 20.5% of the fp8 peak (1979 TFLOP/s)"
    assert mfu_fp8_line(10.0, 100.0, None) == "MFU 10.0% of the bf16 peak (100 TFLOP/s), fp8 peak not known for this device"
    assert fp8_peak_tflops(torch.device("cpu")) is None
