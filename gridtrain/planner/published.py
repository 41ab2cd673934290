"""Reference numbers from Narayanan et al. 2021 (Megatron-LM, PTD-P), as plain data.

Paper: D. Narayanan, M. Shoeybi, J. Casper, P. LeGresley, M. Patwary, V. Korthikanti,
D. Vainbrand, P. Kashinkunti, J. Bernauer, B. Catanzaro, A. Phanishayee, M. Zaharia,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
SC '21 (doi:10.1145/3458817.3476209), arXiv:2104.04473.

What is here:

* ``TABLE1``: the ten weak-scaling runs of the paper's Table 1 (1.7B to 1008B parameters,
  32 to 3072 A100 GPUs), one frozen ``Table1Row`` each, in the paper's row order.
* ``TABLE2``: the twelve rows of Table 2 (PTD-P against ZeRO-3 for the 174.6B and 529.6B
  models), one ``Table2Row`` each, ZeRO-3 rows first as in the paper.
* The settings the paper fixes for those runs (sequence length, vocabulary, cluster,
  schedule, recomputation, the FLOP-count formula) as module constants.

The planner uses these as a yardstick: given the same model, GPU count and batch size it
should propose layouts the paper found good (for instance t = 8 inside a node, p grown
only as far as the model needs). Nothing here is computed; derived quantities (data
parallel size d = n / (t * p), FLOPs per iteration) are left to the code that uses them.

Provenance conventions. Every row carries a ``source`` naming the table, the row (counted
from the top of the table body, 1-based) and the page of the arXiv PDF. The table contents
were read from a text conversion of the paper's PDF and cross-checked against a second,
separately made transcription; both agree on every cell (see docs/planner-sources.md).
Page numbers were inferred from the page markers of that conversion and are marked
"page unverified". As an independent internal check, equation (2) of the paper reproduces
every parameter count in both tables to the printed precision from the layer count and
hidden size, and per-GPU throughput x GPU count reproduces the aggregate column to within
the rounding of the per-GPU figure.

Units: teraFLOP/s and petaFLOP/s as the paper prints them (10**12 and 10**15 FLOP/s); the
paper counts a FLOP as one floating-point operation whatever its precision.
"""

from dataclasses import dataclass

# --- The paper ---------------------------------------------------------------------------

PAPER_TITLE = "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
ARXIV_ID = "2104.04473"
# The latest arXiv revision, which matches the SC21 camera-ready text. One transcription
# names v5 of 23 Aug 2021; not confirmed from the arXiv listing itself (unverified).
ARXIV_VERSION = "v5"
ARXIV_URL = "https://arxiv.org/abs/2104.04473"
SC21_DOI = "10.1145/3458817.3476209"

# --- Fixed settings of the Table 1 / Table 2 runs (paper section 5 and 5.1) ---------------

SEQUENCE_LENGTH = 2048  # s, all Table 1 models (section 5.1)
VOCAB_SIZE = 51_200  # V, all Table 1 models; a multiple of 1024 (section 5.1)
FFN_HIDDEN_MULTIPLIER = 4  # the MLP widens h to 4h (appendix, FLOP derivation)

CLUSTER = "Selene (NVIDIA DGX A100 SuperPOD)"
GPU = "NVIDIA A100 SXM 80 GB"  # "8 NVIDIA 80-GB A100 GPUs" per node (section 5)
GPUS_PER_NODE = 8
INTRA_NODE_LINK = "NVLink + NVSwitch"
# Per node: eight 200 Gb/s HDR InfiniBand HCAs for the job's traffic (one per GPU), plus
# two more reserved for storage (section 5).
INFINIBAND_HCAS_PER_NODE = 8
INFINIBAND_STORAGE_HCAS_PER_NODE = 2
INFINIBAND_GBIT_PER_HCA = 200  # HDR, gigabits per second
NETWORK_TOPOLOGY = "three-level (leaf, spine, core) fat tree, 850 switches"
PEAK_TFLOPS_16BIT = 312.0  # the paper's "theoretical peak" for an A100 at 16-bit precision

MIXED_PRECISION = True  # "run with mixed precision" (section 5)
# Whether the 16-bit type was fp16 or bf16 is not stated for these runs (unverified; the
# later MT-NLG 530B paper, a different work on the same cluster, used bf16).
HALF_PRECISION_DTYPE: str | None = None

# Table 1 runs use the interleaved 1F1B schedule with the scatter/gather optimization
# (section 5.1). The number of model chunks per device (v) is not given for them.
TABLE1_SCHEDULE = "interleaved-1f1b"
TABLE1_SCATTER_GATHER = True
TABLE1_CHUNKS_PER_DEVICE: int | None = None  # not stated (unverified)
# The microbatch size of the Table 1 runs is not stated in the paper (unverified).
# Table 2 gives it per row (1 for every PTD-P row).
TABLE1_MICROBATCH_SIZE: int | None = None

# Activation recomputation is on: the FLOP count below includes the extra forward pass
# it costs (section 5.1 and appendix).
ACTIVATION_RECOMPUTATION = True

# Equation (3): FLOPs of one iteration (global batch B) counting only the GEMMs of the
# transformer layers and the logit layer, with recomputation (forward counted twice,
# backward twice a forward, so 4x the forward GEMM FLOPs). A lower bound on the true count.
#   per layer, forward: 24*B*s*h^2 + 4*B*s^2*h  -> x4 with backward and recomputation
#   logit layer: 2*B*s*h*V forward + 4*B*s*h*V backward (not recomputed)
FLOPS_PER_ITERATION_FORMULA = "96*B*s*l*h**2 * (1 + s/(6*h) + V/(16*l*h))"
# Equation (2): parameter count (weights and biases of l layers, embeddings incl. position).
PARAMETER_COUNT_FORMULA = "12*l*h**2 * (1 + 13/(12*h) + (V + s)/(12*l*h))"
# Equation (4): end-to-end time for T tokens on n GPUs at X FLOP/s each, valid when
# 6h >> s, 16lh >> V + s and 12lh >> V.
TRAINING_TIME_FORMULA = "8*T*P/(n*X)"

# Worked examples of equation (4) in section 5.1.
GPT3_175B_EXAMPLE = {
    "tokens": 300e9, "gpus": 1024, "batch_size": 1536, "tflops_per_gpu": 140, "days": 34
}
GPT_1T_EXAMPLE = {"tokens": 450e9, "gpus": 3072, "tflops_per_gpu": 163, "days": 84}

# Measured on the 1T model / 3072 GPUs (section 5.9); the introduction rounds the second to 13 TB/s.
PIPELINE_BISECTION_GBS = 892.0
DATA_PARALLEL_BISECTION_TBS = 12.9


# --- Table 1: weak scaling, 1.7B to 1T parameters -----------------------------------------


@dataclass(frozen=True)
class Table1Row:
    """One weak-scaling run (paper Table 1). Fields in the table's column order."""

    params_billion: float
    attention_heads: int
    hidden_size: int
    num_layers: int
    tensor_parallel: int
    pipeline_parallel: int
    num_gpus: int
    batch_size: int  # global batch, in sequences of SEQUENCE_LENGTH tokens
    tflops_per_gpu: float  # achieved, end to end (data loading, optimizer, logging included)
    percent_of_peak: int  # of PEAK_TFLOPS_16BIT, as printed (44 means 44%)
    aggregate_pflops: float
    source: str


def _t1(row: int) -> str:
    return f"arXiv:2104.04473v5, Table 1 (section 5.1), p. 8 (page unverified), row {row}"


TABLE1: tuple[Table1Row, ...] = (
    Table1Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4, _t1(1)),
    Table1Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8, _t1(2)),
    Table1Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2, _t1(3)),
    Table1Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6, _t1(4)),
    Table1Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8, _t1(5)),
    Table1Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8, _t1(6)),
    Table1Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1, _t1(7)),
    Table1Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4, _t1(8)),
    Table1Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2, _t1(9)),
    Table1Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0, _t1(10)),
)


# --- Table 2: PTD-P against ZeRO-3 (no model parallelism) --------------------------------


@dataclass(frozen=True)
class Table2Row:
    """One row of paper Table 2.

    ``model_parallel_size`` is the column the paper prints (t * p). The paper does not
    split it for the PTD-P rows; ``tensor_parallel`` / ``pipeline_parallel`` give the
    split with ``tp_pp_stated`` saying whether the paper states it (see ``note``).
    ``training_days_300b`` is the paper's estimate for 300 billion tokens, not a
    measured end-to-end run.
    """

    scheme: str  # "zero3" (ZeRO-3, no model parallelism) or "ptd-p"
    params_billion: float
    model_parallel_size: int
    tensor_parallel: int
    pipeline_parallel: int
    tp_pp_stated: bool
    batch_size: int
    num_gpus: int
    microbatch_size: int
    tflops_per_gpu: float
    training_days_300b: float
    note: str
    source: str


def _t2(row: int) -> str:
    return f"arXiv:2104.04473v5, Table 2 (section 5.2), p. 9 (page unverified), row {row}"


_ZERO3 = "ZeRO-3 through DeepSpeed, data parallel only; model-parallel size 1 means t = p = 1."
_ZERO3_530B_640 = (
    "The paper marks this row with *: with microbatch 4 the 529.6B model did not fit on 560 "
    "GPUs under ZeRO-3, so it used 640 GPUs and a global batch of 2560 instead of 2240."
)
_PTD_175B = (
    "GPT-3 architecture (96 layers, 96 heads, h 12288). Only t * p = 96 is printed; t = 8, "
    "p = 12 is inferred (t = 8 per the paper's rule of tensor parallelism within a node; "
    "the same split appears in a third-party reproduction, cli99/llm-analysis) - unverified."
)
_PTD_530B = (
    "Same 529.6B model as Table 1 row 9 (t = 8, p = 35 there). Only t * p = 280 is printed; "
    "t = 8, p = 35 follows from Table 1 but is not stated in Table 2 - unverified."
)

TABLE2: tuple[Table2Row, ...] = (
    Table2Row("zero3", 174.6, 1, 1, 1, True, 1536, 384, 4, 144, 90, _ZERO3, _t2(1)),
    Table2Row("zero3", 174.6, 1, 1, 1, True, 1536, 768, 2, 88, 74, _ZERO3, _t2(2)),
    Table2Row("zero3", 174.6, 1, 1, 1, True, 1536, 1536, 1, 44, 74, _ZERO3, _t2(3)),
    Table2Row("zero3", 529.6, 1, 1, 1, True, 2560, 640, 4, 138, 169, _ZERO3_530B_640, _t2(4)),
    Table2Row("zero3", 529.6, 1, 1, 1, True, 2240, 1120, 2, 98, 137, _ZERO3, _t2(5)),
    Table2Row("zero3", 529.6, 1, 1, 1, True, 2240, 2240, 1, 48, 140, _ZERO3, _t2(6)),
    Table2Row("ptd-p", 174.6, 96, 8, 12, False, 1536, 384, 1, 153, 84, _PTD_175B, _t2(7)),
    Table2Row("ptd-p", 174.6, 96, 8, 12, False, 1536, 768, 1, 149, 43, _PTD_175B, _t2(8)),
    Table2Row("ptd-p", 174.6, 96, 8, 12, False, 1536, 1536, 1, 141, 23, _PTD_175B, _t2(9)),
    Table2Row("ptd-p", 529.6, 280, 8, 35, False, 2240, 560, 1, 171, 156, _PTD_530B, _t2(10)),
    Table2Row("ptd-p", 529.6, 280, 8, 35, False, 2240, 1120, 1, 167, 80, _PTD_530B, _t2(11)),
    Table2Row("ptd-p", 529.6, 280, 8, 35, False, 2240, 2240, 1, 159, 42, _PTD_530B, _t2(12)),
)

# Architectures behind Table 2 (section 5.3.2 for GPT-3; Table 1 row 9 for 529.6B).
TABLE2_ARCHITECTURES = {
    174.6: {"num_layers": 96, "attention_heads": 96, "hidden_size": 12288},
    529.6: {"num_layers": 105, "attention_heads": 128, "hidden_size": 20480},
}

# Section 5.2's summary of Table 2: at the smallest GPU count (microbatch 4 for ZeRO-3)
# PTD-P is 6% (175B) and 24% (530B) faster; with twice the GPUs at the same batch size it
# is about 70% faster for both.
TABLE2_PTDP_GAIN_FEWEST_GPUS = {174.6: 0.06, 529.6: 0.24}
TABLE2_PTDP_GAIN_DOUBLED_GPUS = 0.70
