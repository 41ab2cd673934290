"""Published training-throughput measurements to calibrate the planner against: plain data.

Every row is one published number with the layout it was measured on, read from these public
sources (and only these), each row saying where its number was printed:

1. torchtitan's own benchmark files (pytorch/torchtitan ``benchmarks/*.md``,
   ``docs/performance.md``): Llama 3.1 8B/70B/405B on H100 (FSDP, TP, PP, CP, async TP,
   float8) and Llama 3/Llama 2 with FSDP on 64 A100s; Llama 3.1 8B with FSDP on H200 (fp8).
2. Megatron-LM (NVIDIA/Megatron-LM): the MoE README's Mixtral 8x7B figure with its reference
   parallel mapping, and the DeepSeek-V3-on-GB200 discussion in ``docs/discussions``; the
   Qwen3-235B table comes from the Megatron MoE Model Zoo (yanring/Megatron-MoE-ModelZoo), the
   best-practice repository the Megatron-LM README links to ("[2025/06] Megatron MoE Model
   Zoo") and the GB200 discussion cites for its scripts. It is a separate repository: its rows
   are a separate block below, kept out of ``ROWS`` (``HOLDOUT``: runs to check the calibrated
   planner on, not to calibrate it).
3. The Llama 3 paper (Llama Team, "The Llama 3 Herd of Models", arXiv 2407.21783), section
   3.3.2, Table 4.
4. The DeepSeek-V3 technical report (arXiv 2412.19437), sections 1, 3.1, 3.2, 3.2.3, 3.3
   and 4.2.

What could not be read, and so is not here:

* The Megatron-LM README's weak-scaling table (GPT 2B..462B on up to 6,144 H100s, tp/pp/dp,
  MFU) and its strong-scaling figure are images (``images/model_table.png``,
  ``weak_scaling.png``, ``strong_scaling.png``) in every stored README version; the only text
  is "MFU increases from 41% for the smallest model considered to 47-48% for the largest" and
  "strong scaled the standard GPT-3 model ... from 96 H100 GPUs to 4608 GPUs, using the same
  batch size of 1152 sequences ... MFU from 47% to 42%", with no layouts, so no row.
* torchtitan's async-TP benchmark (``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md``)
  prints its results only as an image (``assets/images/async-tp-perf-06-14-2025.png``); the
  file gives the commands (70B FSDP 32 x TP 8, 8B FSDP 8 x TP 8) but no numbers.
* The Megatron MoE README's Mixtral 8x22B mapping (128 GPUs, TP 4, EP 2, PP 8, VP 7, MBS 1,
  GBS 256) has no throughput printed beside it; the Model Zoo's Qwen3-Next-80B-A3B row (89 TF,
  "not well tuned", Gated DeltaNet layers gridtrain does not have) is left out.
* No stored text of the DeepSeek-V3 report prints a TFLOP/s or MFU figure for DeepSeek's own
  run (the GB200 discussion says so too and quotes a third-party estimate of ~380 TFLOP/s,
  not recorded); the report's only throughput figure is GPU hours per trillion tokens.
* arxiv.org itself was not fetched: the two papers were read from copies of their text in the
  stored index (PDF text extractions and arXiv-HTML transcriptions kept in public GitHub
  repositories), cross-checked against each other where they differ (see the Llama 3 rows).

Provenance conventions:

* ``value`` is the number exactly as printed; ``where`` quotes the cell or sentence it came
  from (numbers and labels only). Anything computed from printed numbers is in ``derived`` as
  ``(name, value, arithmetic)`` triples, never in ``value``, ``global_batch_size`` or
  ``micro_batch_size``.
* Layout fields are what the source prints. Where a degree is forced by the others
  (``dp = gpus / (tp * pp * cp)``) and not printed, it is filled in and ``notes`` says so.
  ``ep`` is the expert-parallel degree inside the data-parallel ranks (Megatron's folding:
  ``gpus = tp * cp * pp * dp`` for attention, ``= etp * ep * pp * edp`` for experts).
* ``vpp`` is model chunks per pipeline rank: 1 = not interleaved, 0 = interleaved but the
  source does not say into how many chunks.
* ``zero``: 3 = FSDP/ZeRO-3 (torchtitan FSDP2, Megatron-FSDP), 1 = ZeRO-1/Megatron's distributed
  optimizer and Llama 3's FSDP (gathered once a step, gradients accumulated whole and
  reduce-scattered once: ZeRO-1's collectives), 0 = none; ``keep_gathered``: a zero 3 run whose
  parameters stay gathered from the forward to the backward (torchtitan's FSDP2 under PP);
  ``zero_shard_size`` 0 = shards over the whole data-parallel group (no HSDP in any row here).
* ``model`` is a gridtrain preset (``gridtrain/config.py`` PRESETS) when the shape is the
  preset's; ``shape`` is then empty, or holds only the preset fields the measured run
  changed (DeepSeek-V3 without its MTP module). Otherwise ``model`` describes the model and
  ``shape`` gives gridtrain ModelConfig fields (``attn_head_dim`` is the head width).
  Llama 3.1 8B/70B are recorded as ``llama3-8b``/``llama3-70b``: same shapes, only the
  rope scaling (no compute effect) differs.
* ``metric``: "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu" (a fraction), or, for the
  DeepSeek-V3 report, "gpu_hours_per_1t_tokens" (the only throughput figure it prints; the
  tokens/s it implies is in ``derived``).
* ``hardware``: "h100-sxm" (80 GB HBM3, 700 W), "h100-96gb-hbm2e-500w" (torchtitan's Grand
  Teton H100s: 96 GB HBM2e at a 500 W limit, peak "between SXM and NVL" per torchtitan;
  nearest gridtrain key h100-sxm overstates it), "h200", "a100-80gb", "h800" (Hopper compute
  as H100 but NVLink cut: the DeepSeek-V3 report gives NVLink 160 GB/s, IB 50 GB/s), "gb200".
  gridtrain has keys only for the a100/h100/h200 ones.

FLOP-counting conventions (see METRIC_CONVENTIONS): torchtitan reports tokens/s per GPU and
(docs/performance.md) MFU = (6 N + 12 L H Q T) x tokens/s / peak, peak 312 TFLOP/s for A100
and 989 TFLOP/s for H100 SXM and H200 (its ``get_peak_flops``); its Dec-2024 H100 file
reports no MFU because float8 mixes peaks. Llama 3 prints TFLOPs/GPU and "BF16 MFU" (model
FLOPs per Chowdhery et al. 2023; 430 / 43% implies a 1000 TFLOP/s peak). Megatron and the
Model Zoo print TFLOP/s per GPU from Megatron's ``--log-throughput`` count; these sources do
not restate the formula. MXFP8 TFLOP/s (GB200) are not comparable with bf16 peaks.

No logic beyond the two small lookups at the bottom (rows_in, row).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Row:
    name: str  # short id
    group: str  # "dense3d" | "cp" | "zero" | "moe"
    model: str  # gridtrain preset name, or a description
    shape: dict  # ModelConfig fields when not a preset (or a preset's overrides); {} for a preset
    gpus: int
    hardware: str
    seq_len: int
    global_batch_size: int | None  # sequences, as printed; None if not printed
    micro_batch_size: int | None  # as printed; None if not printed
    tp: int
    pp: int
    vpp: int  # 1 = not interleaved; 0 = interleaved, chunk count not stated
    cp: int
    dp: int
    ep: int
    etp: int
    zero: int  # 0 none, 1 ZeRO-1 / distributed optimizer, 3 FSDP / ZeRO-3
    zero_shard_size: int  # HSDP shard group size, 0 if none
    recompute: str  # "none" | "selective" | "full" | "unknown"
    dtype: str  # "bf16" | "fp8"
    compile: bool | None
    metric: str  # "tokens_per_s_per_gpu" | "tflops_per_gpu" | "mfu" | "gpu_hours_per_1t_tokens"
    value: float  # as printed
    source: str  # repo + path + commit (or paper + section) + table
    where: str  # the cell or line the number was read from
    notes: str = ""
    derived: tuple[tuple[str, float, str], ...] = field(default=())  # (name, value, arithmetic)
    keep_gathered: bool = False  # zero 3 whose parameters stay gathered from forward to backward
    cp_comm: str = ""  # how cp exchanges keys and values where printed: "ring" | "allgather"; "" not printed
    sac: str = ""  # torchtitan's selective activation checkpointing: "layer" | "op"; "" none of it


# ---------------------------------------------------------------------------------------------
# Model shapes that are not gridtrain presets
# ---------------------------------------------------------------------------------------------

# torchtitan's llama2_configs (torchtitan/models/llama/__init__.py, commit 537b9132): 13B is
# ModelArgs(dim=5120, n_layers=40, n_heads=40) with the default multiple_of=256, so its FFN width
# is 256 * ceil(int(2 * 4 * 5120 / 3) / 256) = 256 * ceil(13653 / 256) = 13824; vocabulary 32000
# (the Llama 2 tokenizer; torchtitan takes it from the tokenizer, an assumption here).
LLAMA2_13B = dict(arch="llama", n_layer=40, d_model=5120, n_head=40, n_kv_head=40, ffn_hidden=13824,
                  vocab_size=32000, tie_embeddings=False, rope_theta=10000.0)
# 70B: ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
# multiple_of=4096): int(2 * 4 * 8192 / 3) = 21845, x 1.3 -> 28398, rounded up to 4096s -> 28672.
LLAMA2_70B = dict(arch="llama", n_layer=80, d_model=8192, n_head=64, n_kv_head=8, ffn_hidden=28672,
                  vocab_size=32000, tie_embeddings=False, rope_theta=10000.0)
# Qwen3-235B-A22B as the Model Zoo benchmarks it (yanring/Megatron-MoE-ModelZoo
# model_configs/benchmarking/Qwen3-235B-A22B.yaml, commit 1ed4179f): --num-layers 94, --hidden-size
# 4096, --ffn-hidden-size 12288 (unused: every layer is MoE, no --moe-layer-freq), --num-attention-heads
# 64, --kv-channels 128, --num-query-groups 4, --qk-layernorm, --rotary-base 1000000, --norm-epsilon
# 1e-06, --untie-embeddings-and-output-weights, --num-experts 128, --moe-router-topk 8,
# --moe-ffn-hidden-size 1536, --moe-router-pre-softmax false (top-k then softmax: renormalised),
# --moe-aux-loss-coeff 1e-3. Vocabulary: --make-vocab-size-divisible-by 1187 (x TP) pads to
# 151936 = 1187 x 128 at TP 2 and TP 4, the padded size (derived, not printed).
QWEN3_235B_A22B = dict(arch="llama", n_layer=94, d_model=4096, n_head=64, n_kv_head=4, attn_head_dim=128,
                       ffn_hidden=12288, vocab_size=151936, rope_theta=1000000.0, layernorm_eps=1e-6,
                       qk_norm="head", tie_embeddings=False, n_experts=128, moe_top_k=8, moe_ffn_hidden=1536,
                       moe_norm_topk=True, moe_aux_loss_coeff=1e-3)
# DeepSeek-V3 as Megatron's GB200 reproduce guide runs it: the preset's shape (61 layers, 7168 wide,
# 128 heads, q_lora 1536, kv_lora 512, 256 experts top 8 of 2048 wide, 1 shared, 3 dense layers of
# 18432, groups 8 top 4, sigmoid router, scale 2.5) but its launch script passes no
# --mtp-num-layers, so no MTP module.
DEEPSEEK_V3_NO_MTP = dict(mtp_layers=0)


# ---------------------------------------------------------------------------------------------
# Source 1: torchtitan
# ---------------------------------------------------------------------------------------------

TT_H100 = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 31a17bfdb70b; runs at "
           "torchtitan 9dec370, torch 1963fc8, torchao eab345c, Dec 2024)")
TT_H100_HW = ("Grand Teton: 8 x H100 96GB HBM2e per host, NVLink; 400 Gb/s RDMA per GPU; 500 W power limit. "
              "TPS/GPU read at the 90th iteration. ")
TT_SEQ = ("seq_len 8192 is not printed in the table: it is torchtitan's llama3 train_configs default "
          "(every stored version of llama3_8b/70b/405b.toml has seq_len = 8192). ")
TT_PP_FSDP = ("torchtitan's FSDP2 default keeps parameters gathered after forward when PP is on "
              "(reshard_after_forward = not pp_enabled), i.e. ZeRO-3 at rest, not re-gathered for backward. ")

TORCHTITAN_H100 = (
    # Table 1: 8 GPUs, FSDP, local batch 2, global 16, selective AC
    Row("tt-h100-llama3.1-8b-fsdp8", "zero", "llama3-8b", {}, 8, "h100-96gb-hbm2e-500w", 8192, 16, 2,
        1, 1, 1, 1, 8, 1, 1, 3, 0, "selective", "bf16", False, "tokens_per_s_per_gpu", 5762.0,
        TT_H100 + ", Table 1", "Table 1 | FSDP | 5,762 | 82.4 GiB",
        TT_H100_HW + TT_SEQ + "Llama 3.1 8B. Selective AC option (op vs layer) not printed; the toml default is 'op'. "
        "Micro-batch = local batch 2 (no gradient accumulation). The file notes 1D 8B without Float8 reaches "
        "'33% to 39% MFU (with or without torch.compile, respectively)' against the SXM peak.", sac="op"),
    Row("tt-h100-llama3.1-8b-fsdp8-compile", "zero", "llama3-8b", {}, 8, "h100-96gb-hbm2e-500w", 8192, 16, 2,
        1, 1, 1, 1, 8, 1, 1, 3, 0, "selective", "bf16", True, "tokens_per_s_per_gpu", 6667.0,
        TT_H100 + ", Table 1", "Table 1 | FSDP + torch.compile | 6,667 | 77.0 GiB",
        TT_H100_HW + TT_SEQ + "Llama 3.1 8B.", sac="op"),
    Row("tt-h100-llama3.1-8b-fsdp8-compile-fp8", "zero", "llama3-8b", {}, 8, "h100-96gb-hbm2e-500w", 8192, 16, 2,
        1, 1, 1, 1, 8, 1, 1, 3, 0, "selective", "fp8", True, "tokens_per_s_per_gpu", 8532.0,
        TT_H100 + ", Table 1", "Table 1 | FSDP + torch.compile + Float8 | 8,532 | 76.8 GiB",
        TT_H100_HW + TT_SEQ + "Llama 3.1 8B; Float8 on nn.Linear (torchao, tensorwise).", sac="op"),
    # Table 3: 128 GPUs, FSDP, local batch 2, global 256, selective AC
    Row("tt-h100-llama3.1-8b-fsdp128", "zero", "llama3-8b", {}, 128, "h100-96gb-hbm2e-500w", 8192, 256, 2,
        1, 1, 1, 1, 128, 1, 1, 3, 0, "selective", "bf16", False, "tokens_per_s_per_gpu", 5605.0,
        TT_H100 + ", Table 3", "Table 3 | FSDP | 5,605 | 67.0 GiB", TT_H100_HW + TT_SEQ + "Llama 3.1 8B.", sac="op"),
    Row("tt-h100-llama3.1-8b-fsdp128-compile", "zero", "llama3-8b", {}, 128, "h100-96gb-hbm2e-500w", 8192, 256, 2,
        1, 1, 1, 1, 128, 1, 1, 3, 0, "selective", "bf16", True, "tokens_per_s_per_gpu", 6514.0,
        TT_H100 + ", Table 3", "Table 3 | FSDP + torch.compile | 6,514 | 62.0 GiB",
        TT_H100_HW + TT_SEQ + "Llama 3.1 8B.", sac="op"),
    Row("tt-h100-llama3.1-8b-fsdp128-compile-fp8", "zero", "llama3-8b", {}, 128, "h100-96gb-hbm2e-500w", 8192, 256,
        2, 1, 1, 1, 1, 128, 1, 1, 3, 0, "selective", "fp8", True, "tokens_per_s_per_gpu", 8380.0,
        TT_H100 + ", Table 3", "Table 3 | FSDP + torch.compile + Float8 | 8,380 | 61.8 GiB",
        TT_H100_HW + TT_SEQ + "Llama 3.1 8B.", sac="op"),
    # Table 2: 8 GPUs, FSDP + CP + compile + Float8, local batch 1, full AC
    Row("tt-h100-llama3.1-8b-fsdp8-cp1-32k-fp8", "cp", "llama3-8b", {}, 8, "h100-96gb-hbm2e-500w", 32768, None, 1,
        1, 1, 1, 1, 8, 1, 1, 3, 0, "full", "fp8", True, "tokens_per_s_per_gpu", 3890.0,
        TT_H100 + ", Table 2", "Table 2 | FSDP 8, CP 1 | 32768 | 3,890 | 83.9 GiB",
        TT_H100_HW + "Llama 3.1 8B; CP is torch's context parallel. Global batch not printed.",
        (("global_batch_size", 8, "local batch 1 x FSDP 8"),)),
    Row("tt-h100-llama3.1-8b-fsdp4-cp2-64k-fp8", "cp", "llama3-8b", {}, 8, "h100-96gb-hbm2e-500w", 65536, None, 1,
        1, 1, 1, 2, 4, 1, 1, 3, 0, "full", "fp8", True, "tokens_per_s_per_gpu", 2540.0,
        TT_H100 + ", Table 2", "Table 2 | FSDP 4, CP 2 | 65536 | 2,540 | 84.2 GiB",
        TT_H100_HW + "Llama 3.1 8B at 64K (the preset's 8K max_positions does not bound compute).",
        (("global_batch_size", 4, "local batch 1 x FSDP 4"),)),
    Row("tt-h100-llama3.1-8b-fsdp2-cp4-128k-fp8", "cp", "llama3-8b", {}, 8, "h100-96gb-hbm2e-500w", 131072, None, 1,
        1, 1, 1, 4, 2, 1, 1, 3, 0, "full", "fp8", True, "tokens_per_s_per_gpu", 1071.0,
        TT_H100 + ", Table 2", "Table 2 | FSDP 2, CP 4 | 131072 | 1,071 | 84.0 GiB", TT_H100_HW + "Llama 3.1 8B.",
        (("global_batch_size", 2, "local batch 1 x FSDP 2"),)),
    Row("tt-h100-llama3.1-8b-fsdp1-cp8-256k-fp8", "cp", "llama3-8b", {}, 8, "h100-96gb-hbm2e-500w", 262144, None, 1,
        1, 1, 1, 8, 1, 1, 1, 3, 0, "full", "fp8", True, "tokens_per_s_per_gpu", 548.0,
        TT_H100 + ", Table 2", "Table 2 | FSDP 1, CP 8 | 262144 | 548 | 84.5 GiB",
        TT_H100_HW + "Llama 3.1 8B. FSDP 1: parameters still wrapped by FSDP2 but nothing sharded.",
        (("global_batch_size", 1, "local batch 1 x FSDP 1"),)),
    # Table 4: 70B, 256 GPUs (FSDP 32, TP 8) + compile + Float8, local 16, global 512, full AC
    Row("tt-h100-llama3.1-70b-fsdp32-tp8-fp8", "dense3d", "llama3-70b", {}, 256, "h100-96gb-hbm2e-500w", 8192, 512,
        16, 8, 1, 1, 1, 32, 1, 1, 3, 0, "full", "fp8", True, "tokens_per_s_per_gpu", 829.0,
        TT_H100 + ", Table 4", "Table 4 | 2D | 829 | 71.9 GiB",
        TT_H100_HW + TT_SEQ + "Llama 3.1 70B; TP with sequence parallel (torchtitan's default). "
        "Micro-batch = local batch 16 (no PP, no accumulation)."),
    Row("tt-h100-llama3.1-70b-fsdp32-tp8-asynctp-fp8", "dense3d", "llama3-70b", {}, 256, "h100-96gb-hbm2e-500w",
        8192, 512, 16, 8, 1, 1, 1, 32, 1, 1, 3, 0, "full", "fp8", True, "tokens_per_s_per_gpu", 876.0,
        TT_H100 + ", Table 4", "Table 4 | 2D + AsyncTP | 876 | 67.6 GiB",
        TT_H100_HW + TT_SEQ + "Llama 3.1 70B; async TP (symmetric-memory collective matmul)."),
    # Table 5: 405B, 512 GPUs (FSDP 8, TP 8, PP 8) + compile + Float8 + AsyncTP, local 32, global 256, full AC
    Row("tt-h100-llama3.1-405b-fsdp8-tp8-pp8-1f1b-fp8", "dense3d", "llama3-405b", {}, 512, "h100-96gb-hbm2e-500w",
        8192, 256, None, 8, 8, 1, 1, 8, 1, 1, 3, 0, "full", "fp8", True, "tokens_per_s_per_gpu", 100.0,
        TT_H100 + ", Table 5", "Table 5 | 1F1B | 100 | 82.5 GiB",
        TT_H100_HW + TT_SEQ + TT_PP_FSDP + "Local batch 32 per DP rank; the micro-batch count/size is not printed. "
        "Memory is the max over PP ranks.", keep_gathered=True),
    Row("tt-h100-llama3.1-405b-fsdp8-tp8-pp8-interleaved-fp8", "dense3d", "llama3-405b", {}, 512,
        "h100-96gb-hbm2e-500w", 8192, 256, None, 8, 8, 0, 1, 8, 1, 1, 3, 0, "full", "fp8", True,
        "tokens_per_s_per_gpu", 128.0, TT_H100 + ", Table 5", "Table 5 | Interleaved 1F1B | 128 | 72.7 GiB",
        TT_H100_HW + TT_SEQ + TT_PP_FSDP + "Interleaved 1F1B; stages per rank not printed (vpp 0). "
        "Local batch 32 per DP rank; micro-batches not printed.", keep_gathered=True),
    # Table 6: 405B, 512 GPUs (TP 8, PP 8) + FSDP x CP + compile + Float8 + AsyncTP + 1F1B, local 8, full AC
    Row("tt-h100-llama3.1-405b-fsdp8-cp1-tp8-pp8-32k-fp8", "cp", "llama3-405b", {}, 512, "h100-96gb-hbm2e-500w",
        32768, None, None, 8, 8, 1, 1, 8, 1, 1, 3, 0, "full", "fp8", True, "tokens_per_s_per_gpu", 76.0,
        TT_H100 + ", Table 6", "Table 6 | FSDP 8, CP 1 | 32768 | 76 | 75.3 GiB",
        TT_H100_HW + TT_PP_FSDP + "Local batch 8 per DP rank; micro-batches not printed.",
        (("global_batch_size", 64, "local batch 8 x FSDP 8"),), keep_gathered=True),
    Row("tt-h100-llama3.1-405b-fsdp4-cp2-tp8-pp8-64k-fp8", "cp", "llama3-405b", {}, 512, "h100-96gb-hbm2e-500w",
        65536, None, None, 8, 8, 1, 2, 4, 1, 1, 3, 0, "full", "fp8", True, "tokens_per_s_per_gpu", 47.0,
        TT_H100 + ", Table 6", "Table 6 | FSDP 4, CP 2 | 65536 | 47 | 75.9 GiB",
        TT_H100_HW + TT_PP_FSDP + "Local batch 8 per DP rank.",
        (("global_batch_size", 32, "local batch 8 x FSDP 4"),), keep_gathered=True),
    Row("tt-h100-llama3.1-405b-fsdp2-cp4-tp8-pp8-128k-fp8", "cp", "llama3-405b", {}, 512, "h100-96gb-hbm2e-500w",
        131072, None, None, 8, 8, 1, 4, 2, 1, 1, 3, 0, "full", "fp8", True, "tokens_per_s_per_gpu", 31.0,
        TT_H100 + ", Table 6", "Table 6 | FSDP 2, CP 4 | 131072 | 31 | 77.1 GiB",
        TT_H100_HW + TT_PP_FSDP + "Local batch 8 per DP rank.",
        (("global_batch_size", 16, "local batch 8 x FSDP 2"),), keep_gathered=True),
    Row("tt-h100-llama3.1-405b-fsdp1-cp8-tp8-pp8-256k-fp8", "cp", "llama3-405b", {}, 512, "h100-96gb-hbm2e-500w",
        262144, None, None, 8, 8, 1, 8, 1, 1, 1, 3, 0, "full", "fp8", True, "tokens_per_s_per_gpu", 16.0,
        TT_H100 + ", Table 6", "Table 6 | FSDP 1, CP 8 | 262144 | 16 | 84.9 GiB",
        TT_H100_HW + TT_PP_FSDP + "Local batch 8 per DP rank. 262144 exceeds the preset's 131072 max_positions.",
        (("global_batch_size", 8, "local batch 8 x FSDP 1"),), keep_gathered=True),
)

TT_H200 = ("pytorch/torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md (commit bcdeaa37c92d; the same "
           "table is in llama3-8b_h200_202506_trainy-whitefiber.md and "
           "llama3_8b_h200_2025-06_torchtitan_trainy_whitefiber.md; runs at torchtitan e7c0cae, torch 2.8.0a0, "
           "Jun 2025, by the Trainy team)")
TT_H200_NOTE = ("8 x H200 per host over NVLink, 400 Gb/s CX-7 per GPU. --training.local_batch_size=2 "
                "--training.compile --model.converters=float8 --float8.enable_fsdp_float8_all_gather (fp8 all-gather) "
                "--float8.precompute_float8_dynamic_scale_for_fsdp --float8.force_recompute_fp8_weight_in_bwd; "
                "TPS read at the 100th iteration. seq_len 8192 and selective (op) AC are the llama3_8b.toml "
                "defaults (assumed: the command does not override them). Llama 3.1 8B. ")

TORCHTITAN_H200 = (
    Row("tt-h200-llama3.1-8b-fsdp32-compile-fp8", "zero", "llama3-8b", {}, 32, "h200", 8192, None, 2,
        1, 1, 1, 1, 32, 1, 1, 3, 0, "selective", "fp8", True, "tokens_per_s_per_gpu", 10938.0,
        TT_H200, "NUM_NODES 4 | 10938 | 47.96 GiB", TT_H200_NOTE,
        (("global_batch_size", 64, "local batch 2 x 32 FSDP ranks"),), sac="op"),
    Row("tt-h200-llama3.1-8b-fsdp64-compile-fp8", "zero", "llama3-8b", {}, 64, "h200", 8192, None, 2,
        1, 1, 1, 1, 64, 1, 1, 3, 0, "selective", "fp8", True, "tokens_per_s_per_gpu", 10753.0,
        TT_H200, "NUM_NODES 8 | 10753 | 46.97 GiB", TT_H200_NOTE,
        (("global_batch_size", 128, "local batch 2 x 64 FSDP ranks"),), sac="op"),
)

TT_A100 = ("pytorch/torchtitan docs/performance.md (commit 041336434916), 'Llama 3 performance numbers' / "
           "'Llama 2 performance numbers' tables")
TT_A100_NOTE = ("64 A100 80GB, FSDP2 (1D). WPS = tokens/s per GPU and MFU as computed in torchtitan's train.py "
                "(6 x params + 12 x layers x heads x head_dim x seq per token, over the A100 bf16 peak 312 TFLOP/s). "
                "compile not printed (the tomls of the time default to compile = false). ")
TT_SEL_LAYER = "'selective layer' = torchtitan's layer-wise selective AC (checkpoint every Nth layer; N not printed). "
TT_SEL_OP = "'selective op' = torchtitan's op-level selective AC. "

TORCHTITAN_A100 = (
    Row("tt-a100-llama3-8b-fsdp64-sel-layer", "zero", "llama3-8b", {}, 64, "a100-80gb", 8192, 64, 1,
        1, 1, 1, 1, 64, 1, 1, 3, 0, "selective", "bf16", None, "tokens_per_s_per_gpu", 2904.0,
        TT_A100, "8B | 1 | selective layer | 2904 | 56.8%",
        TT_A100_NOTE + TT_SEL_LAYER + "Global batch 'local batch size 1 * number of FSDP ranks 64 = 64' as printed; "
        "seq 8192 from 'the default sequence length in Llama 2 is 4096 which is halved compared with Llama 3'.",
        (("mfu", 0.568, "printed 56.8%"),
         ("flops_per_token_check", 6.1e10, "6 x 8.03e9 + 12 x 32 x 32 x 128 x 8192 = 4.82e10 + 1.29e10; "
          "x 2904 tok/s / 312e12 = 0.569, matching the printed 56.8% only if N includes the embeddings")), sac="layer"),
    Row("tt-a100-llama3-8b-fsdp64-sel-op", "zero", "llama3-8b", {}, 64, "a100-80gb", 8192, 64, 1,
        1, 1, 1, 1, 64, 1, 1, 3, 0, "selective", "bf16", None, "tokens_per_s_per_gpu", 2973.0,
        TT_A100, "8B | 1 | selective op | 2973 | 58.2%", TT_A100_NOTE + TT_SEL_OP,
        (("mfu", 0.582, "printed 58.2%"),), sac="op"),
    Row("tt-a100-llama3-70b-fsdp64-full", "zero", "llama3-70b", {}, 64, "a100-80gb", 8192, 64, 1,
        1, 1, 1, 1, 64, 1, 1, 3, 0, "full", "bf16", None, "tokens_per_s_per_gpu", 331.0,
        TT_A100, "70B | 1 | full | 331 | 51.7%", TT_A100_NOTE, (("mfu", 0.517, "printed 51.7%"),)),
    Row("tt-a100-llama2-13b-fsdp64-noac", "zero", "llama2-13b (torchtitan llama2 '13B')", LLAMA2_13B, 64,
        "a100-80gb", 4096, 128, 2, 1, 1, 1, 1, 64, 1, 1, 3, 0, "none", "bf16", None, "tokens_per_s_per_gpu", 2162.0,
        TT_A100, "13B | 2 | no | 2162 | 61.1%",
        TT_A100_NOTE + "Global batch 128 printed ('local batch size 2 (global batch size 128)'); seq 4096 "
        "('the default sequence length in Llama 2 is 4096').", (("mfu", 0.611, "printed 61.1%"),)),
    Row("tt-a100-llama2-13b-fsdp64-sel-layer", "zero", "llama2-13b (torchtitan llama2 '13B')", LLAMA2_13B, 64,
        "a100-80gb", 4096, 128, 2, 1, 1, 1, 1, 64, 1, 1, 3, 0, "selective", "bf16", None, "tokens_per_s_per_gpu",
        1914.0, TT_A100, "13B | 2 | selective layer | 1914 | 54.1%", TT_A100_NOTE + TT_SEL_LAYER,
        (("mfu", 0.541, "printed 54.1%"),), sac="layer"),
    Row("tt-a100-llama2-13b-fsdp64-sel-op", "zero", "llama2-13b (torchtitan llama2 '13B')", LLAMA2_13B, 64,
        "a100-80gb", 4096, 128, 2, 1, 1, 1, 1, 64, 1, 1, 3, 0, "selective", "bf16", None, "tokens_per_s_per_gpu",
        1904.0, TT_A100, "13B | 2 | selective op | 1904 | 53.8%", TT_A100_NOTE + TT_SEL_OP,
        (("mfu", 0.538, "printed 53.8%"),), sac="op"),
    Row("tt-a100-llama2-70b-fsdp64-sel-op", "zero", "llama2-70b (torchtitan llama2 '70B')", LLAMA2_70B, 64,
        "a100-80gb", 4096, None, 1, 1, 1, 1, 1, 64, 1, 1, 3, 0, "selective", "bf16", None, "tokens_per_s_per_gpu",
        355.0, TT_A100, "70B | 1[^1] | selective op | 355 | 50.8%",
        TT_A100_NOTE + TT_SEL_OP + "Footnote: local batch 2 OOMs with selective AC, so local batch 1.",
        (("mfu", 0.508, "printed 50.8%"), ("global_batch_size", 64, "local batch 1 x 64 FSDP ranks")), sac="op"),
    Row("tt-a100-llama2-70b-fsdp64-full", "zero", "llama2-70b (torchtitan llama2 '70B')", LLAMA2_70B, 64,
        "a100-80gb", 4096, 128, 2, 1, 1, 1, 1, 64, 1, 1, 3, 0, "full", "bf16", None, "tokens_per_s_per_gpu", 353.0,
        TT_A100, "70B | 2 | full | 353 | 50.5%",
        TT_A100_NOTE + "The text adds that with full AC 'the MFU can go up to 54% when local batch size is higher' "
        "(batch not printed; not recorded).", (("mfu", 0.505, "printed 50.5%"),)),
)


# ---------------------------------------------------------------------------------------------
# Source 2: Megatron-LM (and, separately, the Megatron MoE Model Zoo it links to)
# ---------------------------------------------------------------------------------------------

MEG_MOE_V08 = ("NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md (commit 0b4c4cfced47, MCore v0.8 "
               "text), intro + 'Reference Best Parallel Mapping'")
MEG_MOE_V09 = ("NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md (commit 022bcb5afe88, MCore v0.9+ "
               "text), intro + 'Reference Best Parallel Mapping'")
MEG_MIXTRAL_NOTE = ("The number is the README's headline sentence; attaching it to the table's Mixtral 8x7B row "
                    "(64 GPUs, TP 1, EP 8, PP 4, VP 8, MBS 1, GBS 256, seq 4096, 32K vocab, All-to-All, BF16, "
                    "dropless) is an assumption: the README does not say which run gave it. Server: 8 x H100 80GB "
                    "HBM3, NVLink 4, IB 8 x 400 Gbit/s. VP: the table prints 8; the README's own Mixtral script "
                    "passes --num-layers-per-virtual-pipeline-stage 8 with PP 4 on 32 layers (8 layers per virtual "
                    "stage = 1 chunk per rank), so VP is read as layers per virtual stage and vpp = 1 (if VP meant "
                    "chunks per rank it would be 8). dp = 64 / (tp 1 x pp 4) = 16 (derived). Distributed optimizer "
                    "(zero 1) and SP are from the README's example script, assumed for the benchmark. Recompute "
                    "not stated. ")

MEGATRON = (
    Row("megatron-mcore0.8-mixtral-8x7b-64gpu", "moe", "mixtral-8x7b", {}, 64, "h100-sxm", 4096, 256, 1,
        1, 4, 1, 1, 16, 8, 1, 1, 0, "unknown", "bf16", None, "tflops_per_gpu", 438.0, MEG_MOE_V08,
        "'This boosts Mixtral 8X7B bf16 training to achieve **438 TFLOPS** as of MCore v0.8'; table row "
        "'Mixtral 8x7B(Dropless) | 32K | All-to-All | BF16 | 64 | 4096 | 1 | 8 | 4 | 8 | 1 | 256'",
        MEG_MIXTRAL_NOTE + "Docker: PyTorch 24.04 with TransformerEngine v1.9."),
    Row("megatron-mcore0.9-mixtral-8x7b-64gpu", "moe", "mixtral-8x7b", {}, 64, "h100-sxm", 4096, 256, 1,
        1, 4, 1, 1, 16, 8, 1, 1, 0, "unknown", "bf16", None, "tflops_per_gpu", 468.0, MEG_MOE_V09,
        "'With MCore v0.9, we've achieved remarkable performance of **468 TFLOPS** for Mixtral 8X7B bf16 "
        "training'; same table row (now 'reference parallel mappings of MCore v0.8')",
        MEG_MIXTRAL_NOTE + "Docker: PyTorch 24.09 with TransformerEngine v1.11."),
)

MEG_GB200 = ("NVIDIA/Megatron-LM docs/discussions/deepseek-v3-gb200-optimization/deepseek-v3-gb200-optimization.md "
             "(commit 1d9edcf8c7c1), sections 1 and 3 table; launch script from "
             "deepseek-v3-gb200-reproduce-guide.md (commit 32ea0afdbf6b)")
MEG_GB200_NOTE = ("256 GB200 (NVL72; every 32 GPUs in one NVLink domain for EP 32). MXFP8 recipe (1x32 blocks, "
                  "E8M0 scales): linear layers in FP8, SDPA/embedding/head/router/loss/optimizer in high precision; "
                  "FP8 primary weights (--fp8-param-gather); BF16 Adam moments. seq 4096, MBS 1, GBS 2048 from the "
                  "reproduce guide's script. PP layout 'Et|(tt|)*30L' = 32 stages on PP 8 (4 per rank; wandb name "
                  "'TP1PP8EP32CP1VPP4'): first stage embedding + 1 layer, last stage loss only, 30 stages of 2 "
                  "layers. dp = 256 / 8 = 32 (derived); distributed optimizer (zero 1). No --mtp-num-layers in the "
                  "script, so no MTP module (shape override). TFLOP/s are MXFP8 Megatron-counted, not comparable "
                  "with a bf16 peak. ")

MEGATRON_GB200 = (
    Row("megatron-dsv3-gb200-256gpu-mxfp8-baseline", "moe", "deepseek-v3", DEEPSEEK_V3_NO_MTP, 256, "gb200", 4096,
        2048, 1, 1, 8, 4, 1, 32, 32, 1, 1, 0, "selective", "fp8", None, "tflops_per_gpu", 494.46, MEG_GB200,
        "'TP1/PP8/VPP4/EP32/MBS1/GBS2048 on 256 GB200s ... (--recompute-modules mlp up_proj) ... AlltoAll token "
        "dispatcher (NCCL backend) ... BF16 optimizer states, we achieved a performance of 494 TFLOPS/GPU'; "
        "table 'DeepSeek-V3 | GB200 | MXFP8 | AlltoAll | Baseline | 494.46'",
        MEG_GB200_NOTE + "Baseline: NCCL all-to-all dispatcher, recompute of dense-layer MLP and MLA up-projection, "
        "no CUDA graphs. Whether forced load balancing was on for this figure is not stated (assumed same script)."),
    Row("megatron-dsv3-gb200-256gpu-mxfp8-final", "moe", "deepseek-v3", DEEPSEEK_V3_NO_MTP, 256, "gb200", 4096,
        2048, 1, 1, 8, 4, 1, 32, 32, 1, 1, 0, "selective", "fp8", None, "tflops_per_gpu", 970.01, MEG_GB200,
        "table 'DeepSeek-V3 | GB200 | MXFP8 | HybridEP | Fuse quantization to normalization (cuDNN 9.14) | 970.01'; "
        "'Our current parallel configuration ... (EP32 * PP8 = 256 GPUs)'",
        MEG_GB200_NOTE + "Final: HybridEP dispatcher (flex), --recompute-modules moe_act mlp, partial CUDA graphs "
        "(attn moe_router moe_preprocess), router/permute/CE fusions, bindpcie CPU binding. The reproduce script "
        "passes --moe-router-force-load-balancing (benchmark-only balanced routing)."),
)

ZOO_QWEN3 = ("yanring/Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md (commit c1ad0b5c89f4), 'Performance "
             "Results' table [Model Zoo: linked from the NVIDIA/Megatron-LM README, not part of it]")
ZOO_QWEN3_NOTE = ("Qwen3-235B-A22B, 256 H100 (NVLink 4, IB 8 x 50 GB/s), BF16, seq 4096. Columns 'TP CP EP PP "
                  "EDP ETP VPP DP FSDP MBS GBS GA recompute | Step time (sec) | Per GPU TF'. Distributed optimizer "
                  "on (model yaml --use-distributed-optimizer) unless FSDP. ")
ZOO_QWEN3_LC = ("yanring/Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md (commit c1ad0b5c89f4), 'Long Context' "
                "table and its command [Model Zoo: linked from the NVIDIA/Megatron-LM README, not part of it]")
ZOO_QWEN3_LC_NOTE = ("Qwen3-235B-A22B, H100, NNODES 32 (256 GPUs), DeepEP dispatcher, bf16. PP 8, VPP 4, EP 8 and "
                     "'--recompute-granularity selective --recompute-modules layernorm moe' from the printed command "
                     "(MODEL=Qwen3-235B-A22B PP=8 VPP=4 TP=${TP} EP=8 CP=${CP} ...); ETP 1 from the model yaml. "
                     "dp = 256 / (tp 4 x cp x pp 8) (derived). MBS not printed (command leaves it to the runtime "
                     "config). ")

MODEL_ZOO = (
    Row("zoo-qwen3-235b-256gpu-tp2-ep32-pp8-vpp4-deepep", "moe", "qwen3-235b-a22b", QWEN3_235B_A22B, 256,
        "h100-sxm", 4096, 2048, 1, 2, 8, 4, 1, 16, 32, 1, 1, 0, "selective", "bf16", None, "tflops_per_gpu", 245.0,
        ZOO_QWEN3, "235B | DeepEP | H100 | BF16 | 256 | 4096 | 2 | 1 | 32 | 8 | 1 | 1 | 4 | 16 | / | 1 | 2048 | 128 "
        "| norm, act | 19.7 | 245 (cross-node EP strategy)",
        ZOO_QWEN3_NOTE + "Recompute 'norm, act' (layernorm + MoE activation).",
        (("tokens_per_s_per_gpu", 1663.4, "2048 x 4096 / (19.7 s x 256)"), ("step_time_s", 19.7, "printed"))),
    Row("zoo-qwen3-235b-256gpu-tp2-ep32-pp8-vpp4-deepep-a2a-overlap", "moe", "qwen3-235b-a22b", QWEN3_235B_A22B,
        256, "h100-sxm", 4096, 2048, 1, 2, 8, 4, 1, 16, 32, 1, 1, 0, "selective", "bf16", None, "tflops_per_gpu",
        276.0, ZOO_QWEN3, "235B | DeepEP | ... | 2 | 1 | 32 | 8 | 1 | 1 | 4 | 16 | / | 1 | 2048 | 128 | norm, act | "
        "17.6 | 276 | +1f1b overlap",
        ZOO_QWEN3_NOTE + "'+1f1b overlap': EP all-to-all overlapped with the other micro-batch's compute.",
        (("tokens_per_s_per_gpu", 1861.8, "2048 x 4096 / (17.6 s x 256)"), ("step_time_s", 17.6, "printed"))),
    Row("zoo-qwen3-235b-256gpu-tp2-ep8-fsdp-full", "moe", "qwen3-235b-a22b", QWEN3_235B_A22B, 256, "h100-sxm",
        4096, 2048, 4, 2, 1, 1, 1, 128, 8, 1, 3, 0, "full", "bf16", None, "tflops_per_gpu", 276.0, ZOO_QWEN3,
        "235B | DeepEP | H100 | BF16 | 256 | 4096 | 2 | 1 | 8 | 1 | 32 | 1 | 1 | 128 | On | 4 | 2048 | 4 | full | "
        "17.6 | 276 | disable log para norm (intra-node EP strategy)",
        ZOO_QWEN3_NOTE + "Megatron-FSDP on (zero 3), no PP, EDP 32, full recompute; 'disable log para norm'.",
        (("tokens_per_s_per_gpu", 1861.8, "2048 x 4096 / (17.6 s x 256)"), ("step_time_s", 17.6, "printed"))),
    Row("zoo-qwen3-235b-256gpu-tp2-ep8-pp32-vpp3-a2a", "moe", "qwen3-235b-a22b", QWEN3_235B_A22B, 256, "h100-sxm",
        4096, 2048, 1, 2, 32, 3, 1, 4, 8, 1, 1, 0, "selective", "bf16", None, "tflops_per_gpu", 200.0, ZOO_QWEN3,
        "235B | A2A | H100 | BF16 | 256 | 4096 | 2 | 1 | 8 | 32 | 1 | 1 | 3 | 4 | / | 1 | 2048 | 512 | norm, act | "
        "24.2 | 200",
        ZOO_QWEN3_NOTE + "NCCL all-to-all dispatcher; 94 layers over 32 x 3 virtual stages (uneven; the yaml "
        "accounts for embedding and loss in the split).",
        (("tokens_per_s_per_gpu", 1354.0, "2048 x 4096 / (24.2 s x 256)"), ("step_time_s", 24.2, "printed"))),
    Row("zoo-qwen3-235b-256gpu-tp4-ep8-pp8-vpp4-deepep-norecompute", "moe", "qwen3-235b-a22b", QWEN3_235B_A22B,
        256, "h100-sxm", 4096, 2048, 1, 4, 8, 4, 1, 8, 8, 1, 1, 0, "none", "bf16", None, "tflops_per_gpu", 167.0,
        ZOO_QWEN3, "235B | DeepEP | H100 | BF16 | 256 | 4096 | 4 | 1 | 8 | 8 | 4 | 1 | 4 | 8 | / | 1 | 2048 | 256 |  "
        "| 29.0 | 167",
        ZOO_QWEN3_NOTE + "Recompute cell empty, read as none.",
        (("tokens_per_s_per_gpu", 1129.9, "2048 x 4096 / (29.0 s x 256)"), ("step_time_s", 29.0, "printed"))),
    # Long context: TP 4, CP 1..8, GBS 256; forced-balance and dropless figures
    Row("zoo-qwen3-235b-256gpu-16k-tp4-cp1-forced", "cp", "qwen3-235b-a22b", QWEN3_235B_A22B, 256, "h100-sxm",
        16384, 256, None, 4, 8, 4, 1, 8, 8, 1, 1, 0, "selective", "bf16", None, "tflops_per_gpu", 295.0,
        ZOO_QWEN3_LC, "H100 | 16384 | 32 | 4 | 1 | 256 | 295 (forced balance) / 237 (dropless)",
        ZOO_QWEN3_LC_NOTE + "Forced balance: --moe-router-force-load-balancing (benchmark-only routing)."),
    Row("zoo-qwen3-235b-256gpu-16k-tp4-cp1-dropless", "cp", "qwen3-235b-a22b", QWEN3_235B_A22B, 256, "h100-sxm",
        16384, 256, None, 4, 8, 4, 1, 8, 8, 1, 1, 0, "selective", "bf16", None, "tflops_per_gpu", 237.0,
        ZOO_QWEN3_LC, "H100 | 16384 | 32 | 4 | 1 | 256 | 295 (forced balance) / 237 (dropless)",
        ZOO_QWEN3_LC_NOTE + "Dropless: the trained router's own (imbalanced) routing."),
    Row("zoo-qwen3-235b-256gpu-32k-tp4-cp2-forced", "cp", "qwen3-235b-a22b", QWEN3_235B_A22B, 256, "h100-sxm",
        32768, 256, None, 4, 8, 4, 2, 4, 8, 1, 1, 0, "selective", "bf16", None, "tflops_per_gpu", 335.0,
        ZOO_QWEN3_LC, "H100 | 32768 | 32 | 4 | 2 | 256 | 335 (forced balance) / 277 (dropless)",
        ZOO_QWEN3_LC_NOTE + "Forced balance."),
    Row("zoo-qwen3-235b-256gpu-32k-tp4-cp2-dropless", "cp", "qwen3-235b-a22b", QWEN3_235B_A22B, 256, "h100-sxm",
        32768, 256, None, 4, 8, 4, 2, 4, 8, 1, 1, 0, "selective", "bf16", None, "tflops_per_gpu", 277.0,
        ZOO_QWEN3_LC, "H100 | 32768 | 32 | 4 | 2 | 256 | 335 (forced balance) / 277 (dropless)",
        ZOO_QWEN3_LC_NOTE + "Dropless."),
    Row("zoo-qwen3-235b-256gpu-64k-tp4-cp4-forced", "cp", "qwen3-235b-a22b", QWEN3_235B_A22B, 256, "h100-sxm",
        65536, 256, None, 4, 8, 4, 4, 2, 8, 1, 1, 0, "selective", "bf16", None, "tflops_per_gpu", 368.0,
        ZOO_QWEN3_LC, "H100 | 65536 | 32 | 4 | 4 | 256 | 368 (forced balance) / 320 (dropless)",
        ZOO_QWEN3_LC_NOTE + "Forced balance. 65536 exceeds Qwen3's 40960 max_position_embeddings in the yaml; "
        "the command overrides SEQ_LEN."),
    Row("zoo-qwen3-235b-256gpu-64k-tp4-cp4-dropless", "cp", "qwen3-235b-a22b", QWEN3_235B_A22B, 256, "h100-sxm",
        65536, 256, None, 4, 8, 4, 4, 2, 8, 1, 1, 0, "selective", "bf16", None, "tflops_per_gpu", 320.0,
        ZOO_QWEN3_LC, "H100 | 65536 | 32 | 4 | 4 | 256 | 368 (forced balance) / 320 (dropless)",
        ZOO_QWEN3_LC_NOTE + "Dropless."),
    Row("zoo-qwen3-235b-256gpu-128k-tp4-cp8-forced", "cp", "qwen3-235b-a22b", QWEN3_235B_A22B, 256, "h100-sxm",
        131072, 256, None, 4, 8, 4, 8, 1, 8, 1, 1, 0, "selective", "bf16", None, "tflops_per_gpu", 389.0,
        ZOO_QWEN3_LC, "H100 | 131072 | 32 | 4 | 8 | 256 | 389 (forced balance) / 357 (dropless)",
        ZOO_QWEN3_LC_NOTE + "Forced balance. dp 1: the distributed optimizer shards over nothing on the dense "
        "side (experts still have EDP 4)."),
    Row("zoo-qwen3-235b-256gpu-128k-tp4-cp8-dropless", "cp", "qwen3-235b-a22b", QWEN3_235B_A22B, 256, "h100-sxm",
        131072, 256, None, 4, 8, 4, 8, 1, 8, 1, 1, 0, "selective", "bf16", None, "tflops_per_gpu", 357.0,
        ZOO_QWEN3_LC, "H100 | 131072 | 32 | 4 | 8 | 256 | 389 (forced balance) / 357 (dropless)",
        ZOO_QWEN3_LC_NOTE + "Dropless."),
)


# ---------------------------------------------------------------------------------------------
# Source 3: the Llama 3 paper, Table 4
# ---------------------------------------------------------------------------------------------

LLAMA3 = ("Llama Team, 'The Llama 3 Herd of Models', arXiv 2407.21783, section 3.3.2 'Parallelism for Model "
          "Scaling', Table 4 'Scaling configurations and MFU for each stage of Llama 3 405B pre-training' (p. 10); "
          "read from stored copies of the paper's text (PDF extraction and arXiv-HTML transcriptions)")
LLAMA3_NOTE = ("Columns 'GPUs | TP | CP | PP | DP | Seq. Len. | Batch size/DP | Tokens/Batch | TFLOPs/GPU | BF16 "
               "MFU'. H100 80GB HBM3 at 700 W TDP, Grand Teton (8 GPUs/server, NVLink), RoCE 400 Gbps (section "
               "3.3.1). DP is FSDP that 'shards optimizer states and gradients, but for model shards we do not "
               "reshard after forward computation', and 'we use FP32 gradient accumulation during backward "
               "computation over multiple micro-batches and also reduce-scatter gradients in FP32 across data "
               "parallel workers in FSDP': "
               "parameters gathered once a step and kept, gradients accumulated whole and reduce-scattered once, the "
               "step's collectives and peak state of ZeRO-1 (zero 1 recorded; sharded only at rest). PP is their "
               "interleaved schedule 'with V pipeline stages on one pipeline rank' (V not printed: vpp 0), one "
               "fewer layer on the first and last stages, a tunable number of micro-batches (micro-batch not "
               "printed). MFU per Chowdhery et al. (2023); 'overall BF16 MFU of 38-43%'. ")

LLAMA3_PAPER = (
    Row("llama3-paper-405b-8192gpu-8k", "dense3d", "llama3-405b", {}, 8192, "h100-sxm", 8192, None, None,
        8, 16, 0, 1, 64, 1, 1, 1, 0, "none", "bf16", None, "tflops_per_gpu", 430.0, LLAMA3,
        "8,192 | 8 | 1 | 16 | 64 | 8,192 | 32 | 16M | 430 | 43%",
        LLAMA3_NOTE + "Recompute none: 'we could pre-train Llama 3 on sequences of 8K tokens without activation "
        "checkpointing'.",
        (("mfu", 0.43, "printed 43%"), ("global_batch_size", 2048, "Batch size/DP 32 x DP 64"),
         ("tokens_per_batch", 16777216, "2048 x 8192 (printed '16M')"),
         ("implied_peak_tflops", 1000.0, "430 / 0.43"))),
    Row("llama3-paper-405b-16384gpu-8k", "dense3d", "llama3-405b", {}, 16384, "h100-sxm", 8192, None, None,
        8, 16, 0, 1, 128, 1, 1, 1, 0, "none", "bf16", None, "tflops_per_gpu", 400.0, LLAMA3,
        "16,384 | 8 | 1 | 16 | 128 | 8,192 | 16 | 16M | 400 | 41%",
        LLAMA3_NOTE + "'The slight drop in MFU to 41% on 16K GPUs with DP=128 ... is due to the lower batch size "
        "per DP group needed to keep the global tokens per batch constant'.",
        (("mfu", 0.41, "printed 41%"), ("global_batch_size", 2048, "Batch size/DP 16 x DP 128"),
         ("implied_peak_tflops", 975.6, "400 / 0.41"))),
    Row("llama3-paper-405b-16384gpu-128k-cp16", "cp", "llama3-405b", {}, 16384, "h100-sxm", 131072, None, None,
        8, 16, 0, 16, 8, 1, 1, 1, 0, "none", "bf16", None, "tflops_per_gpu", 380.0, LLAMA3,
        "16,384 | 8 | 16 | 16 | 8 | 131,072 | 16 | 16M | 380 | 38%",
        LLAMA3_NOTE + "DP: a transcription citing arXiv v3 prints 8, which 16,384 / (8 x 16 x 16) and 16 x DP x "
        "131,072 = 16M require; a PDF text extraction and an arXiv-HTML copy (earlier version) print 4. Recorded 8. "
        "CP is all-gather based (K/V all-gathered, 2 x CP load-balanced chunks per rank). Recompute not stated: "
        "recorded none, as a rank holds 131,072 / 16 = 8,192 tokens of each sequence, what the 8K runs hold, which "
        "the paper trains 'without activation checkpointing'.",
        (("mfu", 0.38, "printed 38%"), ("global_batch_size", 128, "Batch size/DP 16 x DP 8"),
         ("implied_peak_tflops", 1000.0, "380 / 0.38")), cp_comm="allgather"),
)


# ---------------------------------------------------------------------------------------------
# Source 4: the DeepSeek-V3 technical report
# ---------------------------------------------------------------------------------------------

DSV3 = ("DeepSeek-AI, 'DeepSeek-V3 Technical Report', arXiv 2412.19437: section 1 (training cost, Table 1), 3.1 "
        "(cluster), 3.2 (training framework), 3.2.3 (memory), 3.3 (FP8), 4.2 (hyper-parameters); read from stored "
        "copies of the report's text")

DEEPSEEK_REPORT = (
    Row("deepseek-v3-report-2048xh800-pretrain", "moe", "deepseek-v3", {}, 2048, "h800", 4096, 15360, None,
        1, 16, 1, 1, 128, 64, 1, 1, 0, "selective", "fp8", None, "gpu_hours_per_1t_tokens", 180000.0, DSV3,
        "'training DeepSeek-V3 on each trillion tokens requires only 180K H800 GPU hours, i.e., 3.7 days on our "
        "cluster with 2048 H800 GPUs'; 'pre-training stage ... costs 2664K GPU hours'; 'pre-train DeepSeek-V3 on "
        "14.8T tokens'; '16-way Pipeline Parallelism (PP), 64-way Expert Parallelism (EP) spanning 8 nodes, and "
        "ZeRO-1 Data Parallelism (DP)'; 'maximum sequence length to 4K'; 'batch size is gradually increased from "
        "3072 to 15360 in the training of the first 469B tokens, and then keeps 15360'",
        "HAI-LLM framework. No TP ('train DeepSeek-V3 without using costly Tensor Parallelism'); CP not mentioned "
        "(cp 1 assumed); dp = 2048 / 16 = 128 (derived; the DP degree is not printed), EP 64 over 8 nodes inside "
        "it. DualPipe bidirectional PP schedule (two parameter copies; no gridtrain equivalent, vpp 1 recorded). "
        "Recompute of all RMSNorm and MLA up-projections. FP8 mixed precision: GEMMs in FP8 (E4M3, 1x128 "
        "activation tiles, 128x128 weight blocks, CUDA-core promotion every 128), embedding/head/gating/norm/"
        "attention in BF16/FP32, BF16 Adam moments, FP8-cached and FP8-dispatched activations. Routing limited to "
        "4 nodes per token; no token dropping; MTP depth 1 (the preset). global_batch_size is the steady-state "
        "15360 (3072 ramped over the first 469B tokens). H800: NVLink 160 GB/s, IB 50 GB/s per the report. The "
        "figure is a whole-run average (includes the batch ramp and any downtime).",
        (("tokens_per_s_per_gpu", 1543.2, "1e12 tokens / (180e3 GPU-h x 3600 s/h) = 1e12 / 6.48e8"),
         ("gpu_hours_per_1t_tokens_check", 180.0e3, "2664K GPU-h / 14.8T tokens = 180.0K"),
         ("days_per_1t_tokens", 3.66, "180e3 / 2048 / 24 (printed '3.7 days')"))),
)


# ---------------------------------------------------------------------------------------------

# the calibration rows: the four sources the planner is calibrated on
ROWS: tuple[Row, ...] = (TORCHTITAN_H100 + TORCHTITAN_H200 + TORCHTITAN_A100 + MEGATRON + MEGATRON_GB200
                         + LLAMA3_PAPER + DEEPSEEK_REPORT)
# the Model Zoo's rows are not calibrated on: a held-out check of the calibrated planner
HOLDOUT: tuple[Row, ...] = MODEL_ZOO

METRIC_CONVENTIONS: dict[str, str] = {
    "torchtitan benchmarks/*.md": "TPS/GPU = tokens per second per GPU, read at one iteration (90th; 100th for "
                                  "H200); no MFU ('not well-defined' with Float8). Memory is the max over ranks.",
    "torchtitan docs/performance.md": "WPS = tokens/s per GPU; MFU = (6 N + 12 L H Q T) tokens/s / peak "
                                      "(torchtitan get_num_flop_per_token / get_peak_flops: A100 312e12, "
                                      "H100 SXM and H200 989e12).",
    "Megatron-LM / Model Zoo": "TFLOP/s per GPU from Megatron's --log-throughput FLOP count (these files do not "
                               "restate the formula or say whether recompute is counted); GB200 figures are MXFP8.",
    "Llama 3 paper": "TFLOPs/GPU and BF16 MFU (model FLOPs, Chowdhery et al. 2023); 430 / 0.43 = 1000 TFLOP/s peak.",
    "DeepSeek-V3 report": "Only H800 GPU hours per trillion tokens (180K) and totals (2664K pre-training, 2.788M "
                          "overall); no TFLOP/s or MFU printed.",
}


def rows_in(group: str) -> tuple[Row, ...]:
    """The rows of one group ("dense3d", "cp", "zero", "moe")."""
    return tuple(r for r in ROWS if r.group == group)


def row(name: str) -> Row:
    """The row with this name."""
    return next(r for r in ROWS if r.name == name)
