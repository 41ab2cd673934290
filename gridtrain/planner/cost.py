"""Step time and memory of a layout, predicted from the project's own parts.

One optimizer step of a ``dp x cp x tp x pp`` layout (with ``ep`` for a mixture of
experts) is modelled as gridtrain runs it:

* **compute** of one micro-batch through one model chunk, split as the schedules split
  it (forward F, input-gradient B, weight-gradient W; a schedule without W runs both in
  B), from the GEMMs a TP rank runs (shapes from the model and the layout) and the
  memory-bound work around them. A GEMM of ``m x k`` by ``k x n`` takes
  ``max(2 m n k / (peak x eff), bytes / bandwidth)``, a roofline whose compute side runs
  at ``eff = gemm_efficiency x x / (x + gemm_half)``, ``x`` the GEMM's smallest
  dimension: large GEMMs run at the hardware's achievable fraction of peak, the small
  per-rank matrices of a high TP degree run further from it (the tile and wave
  quantisation a small dimension wastes), and very thin ones are bandwidth-bound.
  Layer norms, activations, residual adds and the loss are memory-bound passes over
  the activations (``ELEMENTWISE_PASSES``), and every kernel costs a launch. The
  op-by-op attention core (``attention="math"``) also writes its ``s x s`` scores per
  local head and passes over them (scale, causal bias, softmax, dropout:
  ``SCORE_PASSES_*``), which for a small hidden size is a large share of a block;
  torch's fused kernel (``sdpa``) keeps no scores. Latent attention (models/mla.py): its
  down-projections (q_a, kv_a) whole on every tp rank, q_b, kv_b and proj by heads, the
  core ``qk_head_dim`` deep and ``v_head_dim`` wide. Multi-token prediction
  (models/mtp.py) runs on the chunk that ends the model: per depth a lookup, the ``[d,
  2d]`` projection, a block and the head and loss again (:func:`head_cost`).
  Recomputation adds what the layout recomputes: full, the whole forward of each block
  again in B; selective, the attention core's forward;
* **tensor-parallel communication**, in each F and B and not overlapped (gridtrain
  issues TP collectives synchronously): per block two all-reduces of the block's
  activations each way (with SP two all-gathers and two reduce-scatters forward, and
  backward two more all-gathers: a sequence-parallel column layer gathers its input
  again), the embedding's and the head's, and the loss's three small all-reduces
  (``BLOCK_COLLECTIVES`` and its neighbours); ring algorithm, over NVLink when the TP
  group fits a node; a link may time each kind of collective at its own rates (the
  ``cpu`` machine's gloo, measured: machine.Link);
* **the pipeline**: the schedule's own action lists (pipeline/schedules.py) run through
  the simulator (pipeline/simulate.py) with the per-chunk costs above, its send and
  receive batches waited for as the runtime waits for them (``rendezvous``: a send
  completes against a posted receive, and the stage waits for its batch), a message
  taking the point-to-point transfer of one micro-batch's activations; so bubbles,
  interleaving and ZB-H1 come from the schedule, not a formula (and ZB-H1's deferred
  weight gradients help only where no blocked send holds the stage);
* **data parallel** gradient all-reduce (ZeRO-1: reduce-scatter, then an all-gather of
  the updated parameters) of the reducer's fp32 gradient buffer, ring, over NVLink when
  the DP group fits a node and over the network otherwise, each of the group's ranks on
  a node driving its own NIC (``ring_link``: a group with k ranks per node moves at k
  times one GPU's network bandwidth, one rank per node at one NIC's); the reducer
  fires buckets during the last micro-batch's backward, so that much of it hides
  behind it, all but the last bucket; the ZeRO all-gathers, issued after the
  optimizer, hide likewise behind the next step's first forward, all but the first;
* **ZeRO-2 and 3** (the collectives of :mod:`gridtrain.memory.zero`): ZeRO-2
  reduce-scatters each micro-batch's gradients during its backward, ZeRO-3 also
  gathers each block's parameters (and the embedding's and the head's) before its
  forward and again before its backward, prefetched: per micro-batch and model chunk
  they hide behind the chunk's forward (gathers) and backward (gathers and
  reduce-scatters) up to their compute, the excess is exposed inside F and B (so the
  pipeline simulator sees it), and the forward's first gather is always exposed; with
  ``zero3_keep_gathered`` the parameters are gathered once a step, as ZeRO-1's. Under
  hybrid sharding (``zero_shard_size`` s) these run in groups of s consecutive dp (x cp)
  ranks and the gradient shard is all-reduced across the groups after the last
  micro-batch's backward, in what that backward leaves;
* **context parallelism** (cp > 1): each rank runs its blocks on ``S / cp`` tokens;
  its attention core runs in ``cp`` steps, each the local queries over one rank's
  key/value block, so the rank's attention is 1/cp of one process's (counted the way
  the cp = 1 core is counted: a causal kernel's whole square, as the model FLOPs count
  it, here the ``L x L`` square of a step). ``ring``: each step's key/value block (and
  in the backward the gradient accumulator of the step before) travels to the next rank
  while the step computes, over the link the cp group spans (NVLink when ``tp x cp``
  fits a node, else one GPU's network link); per step only ``max(0, transfer - the
  step's attention)`` is exposed, and the last accumulator's trip to its owner is.
  ``allgather``: the all-gather hides behind the local block's attention only, the
  gradients' reduce-scatter is exposed. Byte counts: :mod:`gridtrain.memory.cp`. The
  exposed time is inside F and B (with full recomputation the forward's again);
  selective recomputation leaves the cp core alone. Gradients are reduced over the
  ``dp x cp`` ranks;
* **mixtures of experts** (a model with ``n_experts``; :mod:`gridtrain.memory.moe`): a
  MoE block runs the attention's GEMMs, the router's, and each of its rank's ``E / ep``
  experts' MLP GEMMs on ``N k ep / E`` rows (balanced routing; one expert after another,
  no grouped GEMM: a launch per GEMM), the shared experts' MLP split over tp, the
  permutation's and combine's passes over the ``N k`` rows; its all-to-alls (dispatch and
  combine each way, full recomputation repeats the forward's) over the link the ep group
  spans (NVLink when ``tp x ep`` fits a node, else the GPU's NIC for the shares bound for
  other nodes), the routing counts' all-to-all and the host's read of them, synchronous,
  inside F and B; the statistics' tiny all-reduce over ``dp x cp`` travels while the
  experts run (only what outlasts the dispatch, the experts' GEMMs and the combine is
  exposed), under SP the one over tp follows; without shared experts the block's TP
  collectives are attention's only. Expert gradients are reduced over the
  expert-data-parallel group (``dp x cp / (ep x etp)``, folded ``tp x dp x cp / (ep x
  etp)``: :attr:`Layout.expert_dp`), every ZeRO stage sharding their state over it
  (ZeRO-2/3's per-micro-batch reduce-scatters and ZeRO-3's gathers of a MoE block's
  experts run over that group's link, after its dense bucket's), and under sequence
  parallelism summed over tp after the backward (not where the experts are folded over
  tp: a rank's experts are then its own). Expert tensor parallelism (``etp``): the etp
  group pools its rows before the dispatch (an all-gather, and a reduce-scatter of the
  partial outputs after the combine, each way: :func:`etp_seconds`), so the all-to-alls
  carry ``etp`` times the rank's rows and each expert slice runs ``H / etp`` wide on
  them; the expert grid's groups lie ``tp`` apart in a dp x cp group, or neighbours where
  folded over a stage's ranks (:attr:`Layout.expert_stride`);
* **float8 GEMMs** (``--fp8``; fp8.py): the blocks' linear GEMMs at the FP8 peak times
  the same efficiency, their casts as memory traffic, the weights' scales all-reduced
  once a step (in the optimizer's part), and under ``--fp8-all-gather`` ZeRO-3's block
  gathers at one byte an element;
* **the optimizer**: one memory-bound pass over the owned master weights, moments and
  gradients;
* **memory** per GPU: the memory model (memory/model.py, which the dry run is checked
  against: expected_state_bytes: parameters, gradients, optimizer state for every ZeRO
  stage, ZeRO-2/3's gradient shard (within the step only), ZeRO-3's gathered parameters
  and ZeRO-2/3's gradient staging;
  expected_activation_peak: the schedule's action list walked with each chunk's
  activation bytes for the recompute mode), for the first and last pipeline stage and
  the stage holding the most parameters, whichever is largest.

Everything is per GPU and in seconds and bytes; the constants are named and the
hardware's are in hardware.py (a ``cpu`` entry measured on the host, profile.py).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache

from gridtrain.config import Config, ModelConfig
from gridtrain.memory.cp import kv_elements, kv_heads_per_rank, ring_transfers, wide_bytes
from gridtrain.memory.model import (chunks_of_stage, expected_activation_peak, expected_state_bytes, mtp_blocks,
                                    stage_parameter_split, stage_parameters)
from gridtrain.memory.moe import (all_to_all_payload, dense_block_parameters, model_flops_per_token,
                                  moe_block_parameters, routed_tokens)
from gridtrain.memory.optimizer import mlp_matrices, model_matrices
from gridtrain.memory.zero import zero_step_collectives
from gridtrain.parallel.grid import ProcessGrid
from gridtrain.parallel.pipeline.schedules import build_schedule
from gridtrain.parallel.pipeline.simulate import Costs, simulate
from gridtrain.planner.fp8 import (FP8_GATHER_BYTES, RECIPE_SPEED, SCALE_BYTES, block_float8, cast_bytes,
                                  cast_kernels, dequantised_bytes, scale_count)
from gridtrain.planner.machine import Link, ring_seconds  # noqa: F401 (ring_seconds: re-exported)

# memory-bound passes over a block's activations (b s d elements each) in a forward:
# two norms (read, write), the bias/dropout/residual adds, the MLP activation (of 4 d
# per token: 4 passes), rotary/softmax bookkeeping; a backward makes twice as many
ELEMENTWISE_PASSES = 24
KERNELS_PER_BLOCK = 24  # launches in one block's forward (twice in backward)
# the op-by-op attention core (attention="math") writes the scores (b x local heads x s x s
# elements) and passes over them: in the forward the scale (read, write), the causal bias
# added (read scores and bias, write) and the softmax (read, write); in the backward the
# softmax's (read probabilities and gradient, write) and the scale's (read, write).
# Dropout on the probabilities adds a read and a write and a one-byte mask each way.
# torch's fused kernel (attention="sdpa") keeps no scores: none of this.
# a collective that runs beside compute slows it: its kernels hold SMs and HBM bandwidth
# the GEMMs would use. Per second of communication hidden behind compute, the compute
# takes this much longer (fit on the FSDP runs of benchmarks/calibration_rows.py, whose
# per-micro-batch gathers and reduce-scatters hide behind their blocks: docs/planner.md)
OVERLAP_COST = 0.3
SCORE_PASSES_FORWARD = 7
SCORE_PASSES_BACKWARD = 5
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8, "fp8": 1}


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    vpp: int = 1
    micro_batch_size: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"
    sequence_parallel: bool = False
    zero: int = 0
    pp_partition: str = "uniform"  # "parameters" where the layers do not divide evenly
    cp: int = 1  # context parallel: ranks that split each sequence
    cp_comm: str = "ring"  # how their attention exchanges keys and values: ring | allgather
    zero_shard_size: int | None = None  # ZeRO shards within groups of this many dp x cp ranks (HSDP); None: all
    zero3_keep_gathered: bool = False  # ZeRO-3: a stage's parameters stay gathered through the step
    ep: int = 1  # expert parallel: each MoE layer's experts split over this many of a dp x cp group
    etp: int = 1  # expert tensor parallel: each expert's MLP split over this many ranks

    @property
    def gpus(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def folded(self) -> bool:
        """Whether the expert grid (``etp x ep`` ranks a copy of the experts) is laid over
        all tp x cp x dp ranks of a stage (``grid.ProcessGrid.folds_experts``): where ep x
        etp does not divide dp x cp. Folded over tp > 1 needs sequence parallelism."""
        return self.ep * self.etp > 1 and (self.dp * self.cp) % (self.ep * self.etp) != 0

    @property
    def expert_stride(self) -> int:
        """Ranks between neighbours of the expert grid's base list (an etp group's
        members): 1 folded (a stage's ranks, tp fastest), tp unfolded (a dp x cp group).
        An ep group's members are ``etp`` times that apart, an expert-data-parallel
        group's ``ep x etp`` times."""
        return 1 if self.folded else self.tp

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel group (the ranks holding the same expert slices): ``dp
        x cp / (ep x etp)``, folded ``tp x dp x cp / (ep x etp)``."""
        return (self.tp if self.folded else 1) * self.dp * self.cp // (self.ep * self.etp)

    @property
    def zero_shard(self) -> int:
        """The ranks ZeRO shards over: ``zero_shard_size``, else the whole dp x cp group."""
        return self.zero_shard_size or self.dp * self.cp

    def zero_flags(self) -> list[str]:
        """The layout's ZeRO as ``gridtrain train`` flags (none for ZeRO-0)."""
        if not self.zero:
            return []
        return (["--zero", str(self.zero)]
                + (["--zero-shard-size", str(self.zero_shard_size)] if self.zero_shard_size else [])
                + (["--zero3-keep-gathered"] if self.zero3_keep_gathered else []))

    def zero_name(self) -> str:
        """``ZeRO-3 (shard 8, keep gathered)``; empty for ZeRO-0."""
        extra = ([f"shard {self.zero_shard_size}"] if self.zero_shard_size else []) \
            + (["keep gathered"] if self.zero3_keep_gathered else [])
        return f"ZeRO-{self.zero}" + (f" ({', '.join(extra)})" if extra else "") if self.zero else ""


@dataclass(frozen=True)
class Job:
    """What is trained and on what: the model, the global batch and the machine."""

    model: ModelConfig
    global_batch_size: int
    hardware: "Hardware"  # noqa: F821 (hardware.py)
    dtype: str = "bf16"
    gpus_per_node: int | None = None  # default: the hardware's
    optimizer: str = "adamw"  # adamw | muon (muon_seconds)
    optimizer_state_dtype: str = "fp32"  # the moments' (memory.optimizer)
    optimizer_offload: bool = False  # the optimizer's state in host memory (none on the GPU)
    fp8: str = "none"  # float8 GEMMs in the blocks' linears: none | tensorwise | rowwise (fp8.py)
    fp8_all_gather: bool = False  # ZeRO-3 layouts gather the float8 weights as float8

    @property
    def fp8_on(self) -> bool:
        return self.fp8 != "none"

    def fp8_gathers(self, lay: Layout) -> bool:
        """Whether this layout's ZeRO-3 gathers travel as float8 (--fp8-all-gather)."""
        return self.fp8_on and self.fp8_all_gather and lay.zero == 3

    @property
    def node(self) -> int:
        return self.gpus_per_node or self.hardware.gpus_per_node


@dataclass
class Prediction:
    """A layout's predicted step, broken down (seconds per step, bytes per GPU)."""

    layout: Layout
    step_time_s: float
    compute_s: float  # the busiest stage's F, B and W, communication inside them included
    tp_comm_s: float  # of which tensor-parallel collectives
    bubble_s: float  # the pipeline's idle time on the busiest stage (makespan - busy)
    dp_exposed_s: float  # data-parallel communication not hidden behind backward
    optimizer_s: float
    memory_bytes: float
    fits: bool
    model_flops: float  # per step, whole model, no recomputation
    hardware_flops: float  # per step, recomputation included
    tokens: int
    gpus: int
    peak_flops: float
    parts: dict[str, float] = field(default_factory=dict)
    pp_layers: list[int] = field(default_factory=list)  # blocks per virtual stage (--pp-layers)
    cp_comm_s: float = 0.0  # of compute: context-parallel communication not hidden behind attention
    zero_comm_s: float = 0.0  # of compute: ZeRO-2/3's per-micro-batch collectives not hidden behind the chunks
    ep_comm_s: float = 0.0  # of compute: MoE all-to-alls, routing counts and statistics (not overlapped)
    moe: bool = False  # the model has experts (the command and description then name ep)
    memory_parts: dict[str, float] = field(default_factory=dict)  # memory_bytes by kind (MEMORY_PARTS)
    optimizer: str = "adamw"
    newton_schulz_s: float = 0.0  # of optimizer_s: Muon's iterations on the matrices this rank owns
    muon_exchange_s: float = 0.0  # of optimizer_s: Muon's gathers and scatters the step waits for (muon_seconds)
    muon_exchange_bytes: float = 0.0  # what a rank sends of them per step
    fp8: str = "none"  # the job's --fp8 recipe
    fp8_all_gather: bool = False  # this (ZeRO-3) layout gathers float8 weights as float8
    fp8_scales_s: float = 0.0  # of optimizer_s: the float8 weights' scale all-reduces

    def fp8_flags(self) -> list[str]:
        """The float8 flags of ``gridtrain train`` for this layout (none without --fp8)."""
        if self.fp8 == "none":
            return []
        return ["--fp8", self.fp8] + (["--fp8-all-gather"] if self.fp8_all_gather else [])

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / self.step_time_s / self.gpus

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_time_s / self.gpus / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        return self.hardware_flops / self.step_time_s / self.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_tflops_per_gpu * 1e12 / self.peak_flops

    def as_json(self) -> dict:
        lay = self.layout
        return {"dp": lay.dp, "cp": lay.cp, "ep": lay.ep, "etp": lay.etp, "tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp,
                "micro_batch_size": lay.micro_batch_size, "schedule": lay.schedule, "recompute": lay.recompute,
                "sequence_parallel": lay.sequence_parallel, "zero": lay.zero, "cp_comm": lay.cp_comm,
                "zero_shard_size": lay.zero_shard_size, "zero3_keep_gathered": lay.zero3_keep_gathered,
                "pp_layers": self.pp_layers, "fp8_all_gather": self.fp8_all_gather, "step_time_s": self.step_time_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "model_tflops_per_gpu": self.model_tflops_per_gpu,
                "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu, "mfu": self.mfu,
                "memory_gb_per_gpu": self.memory_bytes / 1e9, "fits": self.fits,
                "memory_breakdown_gb": {k: v / 1e9 for k, v in self.memory_parts.items()},
                "breakdown_s": {"compute": self.compute_s, "tp_comm": self.tp_comm_s, "cp_comm": self.cp_comm_s,
                                "zero_comm": self.zero_comm_s, "ep_comm": self.ep_comm_s, "bubble": self.bubble_s,
                                "dp_exposed": self.dp_exposed_s, "optimizer": self.optimizer_s,
                                "fp8_scales": self.fp8_scales_s},
                "optimizer": {"name": self.optimizer, "state_gb": self.memory_parts.get("optimizer", 0.0) / 1e9,
                              "step_s": self.optimizer_s, "newton_schulz_s": self.newton_schulz_s,
                              "exchange_s": self.muon_exchange_s, "exchange_gb": self.muon_exchange_bytes / 1e9}}


# ---- compute --------------------------------------------------------------------------------------


def gemm_seconds(m: int, n: int, k: int, hw, dtype: str, batch: int = 1, speed: float = 1.0) -> float:
    """One (batched) GEMM, ``m x k`` by ``k x n``: the roofline of the module docstring.
    ``fp8``: one-byte operands, a bf16 output, the FP8 peak; ``speed``: a factor on the
    compute side's rate (fp8.RECIPE_SPEED)."""
    if min(m, n, k) <= 0:
        return 0.0
    if dtype == "fp8" and getattr(hw, "fp8_emulated", False):
        # emulated (parallel/float8.py on CPU): each one-byte operand read and written as
        # fp32, then an fp32 GEMM of those
        dequantised = 5.0 * (m * k + k * n) * batch / hw.memory_bandwidth
        return gemm_seconds(m, n, k, hw, "fp32", batch) + dequantised
    flops = 2.0 * m * n * k * batch
    out = DTYPE_BYTES["bf16" if dtype == "fp8" else dtype]
    moved = ((m * k + k * n) * DTYPE_BYTES[dtype] + m * n * out) * batch
    x = min(m, n, k)
    eff = hw.gemm_efficiency * x / (x + hw.gemm_half)
    return max(flops / (hw.peak_flops(dtype) * eff * speed), moved / hw.memory_bandwidth) + hw.kernel_s


def linear_seconds(job: Job, shapes: list[tuple[int, int, int]], flags: list[bool] | None = None,
                   grad_weight_fp8: bool = True) -> tuple[float, float, float]:
    """Linear layers' GEMMs (each its forward ``(m, n, k)``) as (forward, input gradient,
    weight gradient) seconds: in the job's dtype, each of the three as many FLOPs as the
    forward; under ``--fp8`` those ``flags`` marks in float8 (fp8.py: the recipe's speed,
    its casts as memory traffic, in the forward and the input gradient's backward), the
    weight gradient in bf16 where ``grad_weight_fp8`` is False (experts)."""
    hw, dt = job.hardware, job.dtype
    f = b = w = 0.0
    for (m, n, k), fp8 in zip(shapes, flags if job.fp8_on and flags is not None else [False] * len(shapes)):
        wide = gemm_seconds(m, n, k, hw, dt)
        if not fp8:
            f, b, w = f + wide, b + wide, w + wide
            continue
        narrow = gemm_seconds(m, n, k, hw, "fp8", speed=RECIPE_SPEED[job.fp8])
        cast_f, cast_b = cast_bytes(job.fp8, m, n, k, grad_weight_fp8)
        kernels_f, kernels_b = cast_kernels(job.fp8, grad_weight_fp8)
        f += narrow + cast_f / hw.memory_bandwidth + kernels_f * hw.kernel_s
        b += narrow + cast_b / hw.memory_bandwidth + kernels_b * hw.kernel_s
        w += narrow if grad_weight_fp8 else wide
    return f, b, w


def block_gemms(m: ModelConfig, tokens: int, tp: int, mlp: bool = True) -> list[tuple[int, int, int]]:
    """(m, n, k) of the GEMMs of one block's forward on one TP rank, for ``tokens`` rows
    (``mlp=False``: the attention's only). Llama's q and output projection are ``n_head x
    head_dim`` wide (``d`` unless the model sets its own head size). Latent attention
    (models/mla.py): q_a (or q) and kv_a on the whole sequence and whole on every rank,
    q_b, kv_b and proj by heads."""
    d = m.d_model
    if getattr(m, "mla", False):  # latent attention: the down-projections whole on every tp rank
        h = m.n_head // tp
        q = [(tokens, m.q_lora_rank, d), (tokens, h * m.qk_head_dim, m.q_lora_rank)] if m.q_lora_rank \
            else [(tokens, h * m.qk_head_dim, d)]
        attention = q + [(tokens, m.kv_lora_rank + m.qk_rope_head_dim, d),
                         (tokens, h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                         (tokens, d, h * m.v_head_dim)]
    elif m.arch == "llama":
        a = m.n_head * m.head_dim
        kv = max(1, m.kv_heads // tp) * m.head_dim  # replicated when tp exceeds the kv heads
        attention = [(tokens, a // tp, d), (tokens, kv, d), (tokens, kv, d), (tokens, d, a // tp)]
    else:
        attention = [(tokens, 3 * d // tp, d), (tokens, d, d // tp)]
    return attention + (mlp_gemms(m, tokens, m.ffn_size // tp) if mlp else [])


def mlp_gemms(m: ModelConfig, tokens: int, width: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of an MLP's forward GEMMs, ``width`` wide on this rank, for ``tokens`` rows:
    Llama's gate, up and down, GPT-2's expansion and projection."""
    d = m.d_model
    if m.arch == "llama":
        return [(tokens, width, d), (tokens, width, d), (tokens, d, width)]
    return [(tokens, width, d), (tokens, d, width)]


def attention_core_seconds(m: ModelConfig, b: int, tp: int, hw, dtype: str, seq: int | None = None) -> float:
    """Scores and weighted sum of one block's forward: two batched GEMMs per local head,
    ``seq`` queries over as many keys (default: the model's sequence). Latent attention:
    scores ``qk_head_dim`` deep, values ``v_head_dim`` wide (the fused kernels take them
    padded to the keys' width)."""
    heads = b * max(1, m.n_head // tp)
    s, hd = seq or m.seq_len, m.head_dim
    vd = hd
    if getattr(m, "mla", False):  # queries and keys qk_head_dim wide, values v_head_dim (padded, fused)
        hd = m.qk_head_dim
        vd = m.v_head_dim if m.attention == "math" else hd
    return gemm_seconds(s, s, hd, hw, dtype, heads) + gemm_seconds(s, vd, s, hw, dtype, heads)


def attention_score_seconds(m: ModelConfig, b: int, tp: int, hw, dtype: str) -> tuple[float, float]:
    """The memory-bound passes over one block's attention scores (forward, backward):
    ``SCORE_PASSES_*`` of the op-by-op core; nothing for the fused kernel."""
    if m.attention != "math":
        return 0.0, 0.0
    scores = b * max(1, m.n_head // tp) * m.seq_len * m.seq_len
    e = DTYPE_BYTES[dtype]
    dropout = 2 * e + 1 if m.dropout > 0 else 0
    return (scores * (SCORE_PASSES_FORWARD * e + dropout) / hw.memory_bandwidth,
            scores * (SCORE_PASSES_BACKWARD * e + dropout) / hw.memory_bandwidth)


def ring_link(hw, n: int, stride: int, node: int):
    """The link a ring of ``n`` ranks ``stride`` apart runs at: NVLink when the group fits
    a node; across nodes the network, where the group's ``k = node // stride`` members on
    each node each drive their own NIC and the ring's channels (NCCL runs one per NIC)
    cross between nodes through all of them, so a ring moves at ``k`` times one GPU's
    network bandwidth (at most NVLink's); ``k`` is 1 when the group has one rank per node."""
    if n * stride <= node:
        return hw.link(n * stride, node)
    k = max(1, min(n, node // stride))
    if k == 1:
        return hw.network
    return Link(min(k * hw.network.bandwidth, hw.nvlink.bandwidth), hw.network.latency, hw.network.measured)


@dataclass(frozen=True)
class BlockCost:
    f: float  # forward, TP communication included
    b: float  # input gradient (+ recomputation)
    w: float  # weight gradient
    tp_comm_f: float
    tp_comm_b: float
    cp_comm_f: float = 0.0  # exposed context-parallel communication, inside f
    cp_comm_b: float = 0.0  # and inside b (its recomputed forward's not included)
    ep_comm_f: float = 0.0  # a MoE block's all-to-alls and routing collectives, inside f
    ep_comm_b: float = 0.0  # and inside b (its recomputed forward's not included)


def local_seq(job: Job, lay: Layout) -> int:
    """Tokens of each sequence a rank holds: ``seq_len / cp``."""
    return job.model.seq_len // lay.cp


def block_cost(job: Job, lay: Layout, moe: bool = False) -> BlockCost:
    """One block's F, B and W for one micro-batch (``moe``: a MoE block of the model:
    :func:`moe_gemm_seconds`, :func:`moe_elementwise_seconds`, :func:`moe_comm_seconds`
    in the place of the dense MLP)."""
    m, hw, dt = job.model, job.hardware, job.dtype
    b, t = lay.micro_batch_size, lay.tp
    tokens = b * local_seq(job, lay)
    gemm_f, gemm_b, gemm_w = linear_seconds(job, block_gemms(m, tokens, t, mlp=not moe), block_float8(m, t, not moe))
    if moe:
        gemm_f, gemm_b, gemm_w = (a + x for a, x in zip((gemm_f, gemm_b, gemm_w), moe_gemm_passes(job, lay)))
    if lay.cp == 1:
        core = attention_core_seconds(m, b, t, hw, dt)
        scores_f, scores_b = attention_score_seconds(m, b, t, hw, dt)
    else:  # cp steps, each the local queries over one rank's block; a blockwise core, no scores kept
        core = lay.cp * attention_core_seconds(m, b, t, hw, dt, seq=local_seq(job, lay))
        scores_f = scores_b = 0.0
    cp_f, cp_b = cp_exposed_seconds(job, lay, core / lay.cp)
    act = tokens * m.d_model * DTYPE_BYTES[dt]
    elementwise = ELEMENTWISE_PASSES * act / (t if lay.sequence_parallel else 1) / hw.memory_bandwidth \
        + KERNELS_PER_BLOCK * hw.kernel_s
    ep_f = ep_b = 0.0
    if moe:
        elementwise += moe_elementwise_seconds(job, lay)
        ep_f, ep_b = moe_comm_seconds(job, lay)
    # a MoE block without shared experts leaves the TP region only for attention
    table = MOE_BLOCK_COLLECTIVES if moe and not m.moe_shared_experts else BLOCK_COLLECTIVES
    comm_f, comm_b = tp_collectives(job, lay, act, table)
    forward = gemm_f + core + scores_f + elementwise + comm_f + cp_f + ep_f
    # selective recomputes the attention core, but not the cp core (it keeps no scores)
    selective = core + scores_f if lay.cp == 1 else 0.0
    recompute = {"none": 0.0, "selective": selective, "full": forward}[lay.recompute]
    # backward: the input-gradient GEMMs (as many FLOPs as the forward's), the attention
    # core's backward (twice its forward, and its passes over the scores), twice the
    # elementwise work, the mirrored collectives; the weight-gradient GEMMs as many FLOPs again
    b_time = gemm_b + 2 * core + scores_b + 2 * elementwise + comm_b + cp_b + ep_b + recompute
    return BlockCost(f=forward, b=b_time, w=gemm_w, tp_comm_f=comm_f, tp_comm_b=comm_b, cp_comm_f=cp_f,
                     cp_comm_b=cp_b, ep_comm_f=ep_f, ep_comm_b=ep_b)


# ---- mixtures of experts --------------------------------------------------------------------------

# memory-bound passes over a MoE layer's routed rows (N k x d elements) in a forward
# (parallel/experts.py): the permutation into expert order (read, write), the experts'
# outputs joined (read, write), the weighting by the combine weights (read, write) and the
# sum back into token order (read); under ep > 1 the received rows regrouped expert-major
# and the outputs put back source-major (EP_ROW_PASSES: read, write each). A backward
# makes twice as many
MOE_ROW_PASSES = 7
EP_ROW_PASSES = 4
EXPERT_ACT_PASSES = 4  # over the experts' intermediates (N k x H): the activation and product
ROUTER_PASSES = 6  # over the router's fp32 [N, E]: the cast, softmax and top-k (read, write each)
# launches per MoE layer forward beyond the experts' GEMMs (router softmax, top-k, the
# counts, sort, permutation, combine) and per expert (its slice of rows, activation, product)
MOE_KERNELS = 16
EXPERT_KERNELS = 3
# the host reads the routing counts once per MoE layer forward (dropless dispatch sizes its
# tensors by them): the launch queue drains, and the GPU waits for the next launches
HOST_SYNC_S = 2e-5


def moe_routing(job: Job, lay: Layout) -> tuple[int, int, float]:
    """A MoE layer on one rank, per micro-batch: the tokens it routes (its ``1 / tp``
    share under SP, all of its ``b S / cp`` without), the rows its ``E / ep`` experts
    process in all (balanced routing: as many as it sends, ``N k``; under expert tensor
    parallelism its etp group's pooled rows, ``etp N k``, each through its ``1 / etp``
    slices) and the rows per expert (``N k ep etp / E``)."""
    m = job.model
    n = routed_tokens(lay.micro_batch_size, m.seq_len, tp=lay.tp, cp=lay.cp,
                      sequence_parallel=lay.sequence_parallel)
    rows = n * m.moe_top_k * lay.etp
    return n, rows, rows * lay.ep / m.n_experts


def moe_gemm_seconds(job: Job, lay: Layout) -> float:
    """A MoE layer's forward GEMMs on one rank: the router's (``N x E`` by ``d``), each
    of its ``E / ep`` experts' MLP GEMMs on its ``N k ep / E`` rows, one expert after
    another (no grouped GEMM), and the shared experts' MLP (``S H / tp`` wide, every
    token of the micro-batch, as the dense MLP)."""
    return moe_gemm_passes(job, lay)[0]


def moe_gemm_passes(job: Job, lay: Layout) -> tuple[float, float, float]:
    """:func:`moe_gemm_seconds` as (forward, input gradient, weight gradient): under
    ``--fp8`` the experts' and shared experts' GEMMs in float8 (the experts' weight
    gradient in bf16), the router's never."""
    m, hw, dt = job.model, job.hardware, job.dtype
    n = moe_routing(job, lay)[0]
    router = gemm_seconds(n, m.n_experts, m.d_model, hw, dt)
    passes = [router + e for e in expert_gemm_passes(job, lay)]
    if m.moe_shared_experts:
        tokens = lay.micro_batch_size * local_seq(job, lay)
        width = m.moe_shared_experts * m.moe_ffn_size // lay.tp
        shapes = mlp_gemms(m, tokens, width)
        passes = [p + s for p, s in zip(passes, linear_seconds(job, shapes, [True] * len(shapes)))]
    return tuple(passes)


def moe_elementwise_seconds(job: Job, lay: Layout) -> float:
    """A MoE layer's memory-bound forward work beyond the block's ``ELEMENTWISE_PASSES``:
    ``MOE_ROW_PASSES`` (and under ep > 1 ``EP_ROW_PASSES``) over the routed rows,
    ``EXPERT_ACT_PASSES`` over the experts' intermediates, ``ROUTER_PASSES`` over the
    fp32 router probabilities, and the launches (``MOE_KERNELS``, ``EXPERT_KERNELS`` per
    local expert). Under expert tensor parallelism the rows are the etp group's pooled
    ones, the intermediates ``H / etp`` wide."""
    m, hw = job.model, job.hardware
    e = DTYPE_BYTES[job.dtype]
    n, rows, _ = moe_routing(job, lay)
    passes = MOE_ROW_PASSES + (EP_ROW_PASSES if lay.ep > 1 else 0)
    moved = (passes * rows * m.d_model * e + EXPERT_ACT_PASSES * rows * (m.moe_ffn_size // lay.etp) * e
             + ROUTER_PASSES * n * m.n_experts * 4)
    return moved / hw.memory_bandwidth + (MOE_KERNELS + m.n_experts // lay.ep * EXPERT_KERNELS) * hw.kernel_s


def all_to_all_seconds(job: Job, lay: Layout, nbytes: float) -> float:
    """One all-to-all over the ep group of a send buffer of ``nbytes`` (the rank's own
    share included; balanced: ``nbytes / ep`` to each member). Its members are ``etp x
    tp`` apart (folded over a stage's ranks: ``etp``; :attr:`Layout.expert_stride`):
    within a node (the group spans one) every share travels over NVLink at once; across
    nodes the shares for the members on other nodes leave through the GPU's own NIC
    while those for its node's members cross NVLink, the slower of the two, plus one
    latency (the sends are posted together)."""
    ep = lay.ep
    if ep == 1:
        return 0.0
    hw, node = job.hardware, job.node
    share = nbytes / ep
    stride = lay.etp * lay.expert_stride
    if stride * ep <= node:
        latency, bandwidth = hw.nvlink.rates("all_to_all")
        return (ep - 1) * share / bandwidth + latency
    local = max(1, node // stride)  # the group's members on one node
    nv_bandwidth = hw.nvlink.rates("all_to_all")[1]
    latency, bandwidth = hw.network.rates("all_to_all")
    return max((local - 1) * share / nv_bandwidth, (ep - local) * share / bandwidth) + latency


def statistics_seconds(job: Job, lay: Layout) -> tuple[float, float]:
    """The routing statistics' all-reduces (``2 E`` numbers; ExpertParallel.
    start_global_sum): over ``dp x cp``, and over tp under sequence parallelism, as
    (the first, the second). Latency only, each as a tree (NCCL's choice for a few
    bytes): ``2 log2(n)`` latencies of its link."""
    return tree_all_reduce_seconds(job, lay.dp * lay.cp, lay.tp), \
        (tree_all_reduce_seconds(job, lay.tp, 1) if lay.sequence_parallel else 0.0)


def tree_all_reduce_seconds(job: Job, n: int, stride: int, nbytes: float = 0.0) -> float:
    """A small all-reduce over ``n`` ranks ``stride`` apart as a tree (NCCL's choice for a
    few bytes): ``2 log2(n)`` latencies of the group's link, and the bytes up and down."""
    if n <= 1:
        return 0.0
    link = ring_link(job.hardware, n, stride, job.node)
    latency, bandwidth = link.rates("all_reduce")
    return 2 * math.ceil(math.log2(n)) * latency + 2 * nbytes / bandwidth


def tiny_all_reduce_seconds(job: Job, lay: Layout) -> float:
    """Both of :func:`statistics_seconds`, back to back."""
    return sum(statistics_seconds(job, lay))


def expert_gemm_seconds(job: Job, lay: Layout) -> float:
    """The forward GEMMs of a rank's ``E / ep`` experts (of :func:`moe_gemm_seconds`),
    each its ``1 / etp`` slice on the etp group's pooled rows."""
    return expert_gemm_passes(job, lay)[0]


def expert_gemm_passes(job: Job, lay: Layout) -> tuple[float, float, float]:
    """:func:`expert_gemm_seconds` as (forward, input gradient, weight gradient); under
    ``--fp8`` in float8 but for the weight gradient (fp8.py)."""
    m = job.model
    rows = max(1, round(moe_routing(job, lay)[2]))
    shapes = mlp_gemms(m, rows, m.moe_ffn_size // lay.etp)
    f, b, w = linear_seconds(job, shapes)  # bf16 GEMMs: under --fp8 on dequantised operands (fp8.py)
    if job.fp8_on:
        for r, n, k in shapes:
            cast_f, cast_b = cast_bytes(job.fp8, r, n, k, grad_weight=False)
            deq_f, deq_b = dequantised_bytes(r, n, k)
            kernels_f, kernels_b = cast_kernels(job.fp8, grad_weight=False)
            f += (cast_f + deq_f) / job.hardware.memory_bandwidth + kernels_f * job.hardware.kernel_s
            b += (cast_b + deq_b) / job.hardware.memory_bandwidth + kernels_b * job.hardware.kernel_s
    return tuple(m.n_experts // lay.ep * x for x in (f, b, w))


def etp_seconds(job: Job, lay: Layout) -> float:
    """Expert tensor parallelism's row collectives of one MoE layer, each way (forward:
    the etp group's all-gather of its members' rows, ``etp N d`` elements with their
    choices and weights, and the reduce-scatter of the experts' partial outputs; backward
    the two conjugates), synchronous, over the link the etp group spans (its members
    :attr:`Layout.expert_stride` apart). Nothing at etp 1."""
    if lay.etp == 1:
        return 0.0
    m = job.model
    n, _, _ = moe_routing(job, lay)
    e = DTYPE_BYTES[job.dtype]
    rows = lay.etp * n * m.d_model * e
    picks = lay.etp * n * m.moe_top_k * (8 + e)  # the choices (int64) and weights gathered beside them
    link = ring_link(job.hardware, lay.etp, lay.expert_stride, job.node)
    return link.collective(rows + picks, lay.etp, "all_gather") + link.collective(rows, lay.etp, "reduce_scatter")


def moe_comm_seconds(job: Job, lay: Layout) -> tuple[float, float]:
    """A MoE layer's communication per micro-batch (forward, backward) that compute does
    not hide: forward, the counts' all-to-all (one latency) and the host's read of them
    (``HOST_SYNC_S``), the dispatch and the combine of the ``N k`` rows
    (:func:`all_to_all_seconds`), issued synchronously; the routing statistics'
    all-reduce over ``dp x cp``, started before the dispatch and waited after the
    combine, only where it outlasts them and the experts' GEMMs; the one over tp (under
    SP) whole, after it. Backward, the two all-to-alls again. Under expert tensor
    parallelism the all-to-alls carry the etp group's pooled rows, and the etp group's
    gather and reduce-scatter of them (:func:`etp_seconds`) run each way. Byte counts:
    :func:`gridtrain.memory.moe.moe_step_all_to_all`."""
    m = job.model
    _, rows, _ = moe_routing(job, lay)
    one = all_to_all_seconds(job, lay, all_to_all_payload(rows, 1, m.d_model, DTYPE_BYTES[job.dtype]))
    counts = all_to_all_seconds(job, lay, 0.0) + HOST_SYNC_S
    dispatch = counts + 2 * one + etp_seconds(job, lay)
    group, tp = statistics_seconds(job, lay)
    return dispatch + max(0.0, group - dispatch - expert_gemm_seconds(job, lay)) + tp, \
        2 * one + etp_seconds(job, lay)


def cp_kv_elements(job: Job, lay: Layout) -> int:
    """Elements of one rank's key/value block of one layer and micro-batch: k and v of its
    tp rank's kv heads for its ``seq_len / cp`` tokens."""
    m = job.model
    if getattr(m, "mla", False):  # every head its own key and (padded) value, qk_head_dim wide
        return kv_elements(lay.micro_batch_size, local_seq(job, lay), m.n_head // lay.tp, m.qk_head_dim)
    return kv_elements(lay.micro_batch_size, local_seq(job, lay), kv_heads_per_rank(m.kv_heads, lay.tp), m.head_dim)


def cp_exposed_seconds(job: Job, lay: Layout, step: float) -> tuple[float, float]:
    """The context-parallel communication of one block's forward and backward that its
    attention does not hide, ``step`` being one step's attention forward (the backward's
    is twice that). Ring: per step ``max(0, transfer - step)`` over the link the cp group
    spans, and the last gradient's trip home whole. All-gather: the gather hides behind
    the local block's attention (one step), the reduce-scatter of the gradients not at all."""
    if lay.cp == 1:
        return 0.0, 0.0
    hw, e = job.hardware, DTYPE_BYTES[job.dtype]
    kv = cp_kv_elements(job, lay)
    if lay.cp_comm == "ring":
        link = hw.link(lay.tp * lay.cp, job.node)  # a cp ring's ranks are tp apart
        steps = ring_transfers(lay.cp, kv, e, wide_bytes(e))

        def exposed(transfers: list[int], hidden: float) -> float:
            return sum(max(0.0, link.send(x) - hidden) for x in transfers if x)
        return exposed(steps["forward"], step), exposed(steps["backward"], 2 * step) \
            + exposed(steps["backward_tail"], 0.0)
    link = ring_link(hw, lay.cp, lay.tp, job.node)
    gather = link.collective(lay.cp * kv * e, lay.cp, "all_gather")
    return max(0.0, gather - step), link.collective(lay.cp * kv * wide_bytes(e), lay.cp, "reduce_scatter")


# The tensor-parallel collectives of one micro-batch over the activations (b s d) as
# gridtrain's layers issue them (comm.py's table of conjugate pairs), forward and backward:
# a block enters the TP region twice (q/k/v, the MLP's first linear(s)) and leaves it twice
# (attention's and the MLP's output projections). Without SP: the entries all-reduce in
# backward, the exits in forward. With SP: the entries all-gather the sequence in forward
# and reduce-scatter in backward, where they also all-gather their input again (each keeps
# only its shard: tensor_parallel._ColumnLinears); the exits reduce-scatter
# in forward and all-gather in backward.
BLOCK_COLLECTIVES = {False: ({"all_reduce": 2}, {"all_reduce": 2}),
                     True: ({"all_gather": 2, "reduce_scatter": 2}, {"all_gather": 4, "reduce_scatter": 2})}
# a MoE block without shared experts: attention's entry and exit only (each tp rank routes
# its own sequence shard under SP, and without SP the replicated tokens, so the routed
# experts need no TP collective)
MOE_BLOCK_COLLECTIVES = {False: ({"all_reduce": 1}, {"all_reduce": 1}),
                         True: ({"all_gather": 1, "reduce_scatter": 1}, {"all_gather": 2, "reduce_scatter": 1})}
# the embedding leaves the region (vocabulary-parallel lookup: all-reduce, or reduce-scatter
# under SP); the head enters it (all-reduce in backward; under SP as a block's entry)
EMBEDDING_COLLECTIVES = {False: ({"all_reduce": 1}, {}), True: ({"reduce_scatter": 1}, {"all_gather": 1})}
HEAD_COLLECTIVES = {False: ({}, {"all_reduce": 1}), True: ({"all_gather": 1}, {"all_gather": 1, "reduce_scatter": 1})}
# the vocabulary-parallel cross entropy: the max, the sum of exponentials, the target logit
LOSS_COLLECTIVES = {sp: ({"all_reduce": 3}, {}) for sp in (False, True)}


def tp_collectives(job: Job, lay: Layout, nbytes: float, table: dict) -> tuple[float, float]:
    """Seconds of the forward's and the backward's TP collectives in ``table`` (one of the
    tables above) over a tensor of ``nbytes``, ring, over NVLink when the group fits a node."""
    if lay.tp == 1:
        return 0.0, 0.0
    link = job.hardware.link(lay.tp, job.node)
    sp = lay.sequence_parallel
    return tuple(sum(n * link.collective(nbytes, lay.tp, kind) for kind, n in ops.items()) for ops in table[sp])


def head_cost(job: Job, lay: Layout, kinds: dict[bool, BlockCost] | None = None) -> tuple[float, float, float]:
    """The logits GEMM and the loss on the chunk that ends the model (f, b, w), with
    their TP collectives (the loss's are a few numbers per token: latency); and the
    multi-token prediction depths that run with it (models/mtp.py), each a lookup of the
    shifted tokens (the embedding's collectives), the ``[d, 2d]`` projection (on the
    rank's sequence shard under SP), a block (:func:`block_cost`, MoE where the layer is;
    ``kinds``: the block costs by whether MoE, where the caller has them) and the head
    and loss again."""
    m, hw, dt = job.model, job.hardware, job.dtype
    tokens = lay.micro_batch_size * local_seq(job, lay)
    vocab = m.padded_vocab_size(lay.tp) // lay.tp
    logits = gemm_seconds(tokens, vocab, m.d_model, hw, dt)
    loss = 3 * tokens * vocab * 4 / hw.memory_bandwidth  # fp32 softmax: read, exp, write
    comm_f, comm_b = tp_collectives(job, lay, tokens * m.d_model * DTYPE_BYTES[dt], HEAD_COLLECTIVES)
    loss_comm = tp_collectives(job, lay, tokens * 4, LOSS_COLLECTIVES)[0]  # one fp32 number per token
    f, b, w = logits + loss + comm_f + loss_comm, logits + loss + comm_b, logits
    depths = mtp_blocks(m, True)
    if depths:
        ef, eb = embedding_cost(job, lay)
        proj = gemm_seconds(tokens // lay.tp if lay.sequence_parallel else tokens, m.d_model, 2 * m.d_model, hw, dt)
        kinds = {moe: (kinds or {}).get(moe) or block_cost(job, lay, moe=moe) for moe in map(m.is_moe_layer, depths)}
        for i in depths:
            block = kinds[m.is_moe_layer(i)]
            f, b, w = f + block.f + proj + ef + logits + loss + comm_f + loss_comm, \
                b + block.b + proj + eb + logits + loss + comm_b, w + block.w + proj + logits
    return f, b, w


def embedding_cost(job: Job, lay: Layout) -> tuple[float, float]:
    """The lookup's TP collectives on the chunk that starts the model (f, b)."""
    m = job.model
    return tp_collectives(job, lay, lay.micro_batch_size * local_seq(job, lay) * m.d_model * DTYPE_BYTES[job.dtype],
                          EMBEDDING_COLLECTIVES)


def pipeline_costs(job: Job, lay: Layout, layers_per_chunk: list[int], moe_per_chunk: list[int] | None = None):
    """Per (stage, chunk) costs of one micro-batch, for the simulator, with ZeRO-2/3's
    exposed per-micro-batch collectives inside F and B (:func:`zero_exposed_seconds`);
    also the block's cost and each (stage, chunk)'s exposed ZeRO seconds (f, b).
    ``moe_per_chunk``: how many of each virtual stage's blocks are MoE blocks (a MoE
    model's; they cost :func:`block_cost` with ``moe``)."""
    block = block_cost(job, lay)
    moe = block_cost(job, lay, moe=True) if moe_per_chunk and any(moe_per_chunk) else None
    # (the multi-token prediction depths' blocks cost what the main ones do)
    hf, hb, hw_ = head_cost(job, lay, {False: block, **({True: moe} if moe is not None else {})}) \
        if mtp_blocks(job.model, True) else head_cost(job, lay)
    ef, eb = embedding_cost(job, lay)
    p, v = lay.pp, lay.vpp
    last = p * v - 1

    def exposed(stage: int, chunk: int) -> tuple[float, float]:
        c = compute(stage, chunk)
        virtual = chunk * p + stage
        comm = zero_chunk_seconds(job, lay, layers_per_chunk[virtual], virtual == 0, virtual == last,
                                  moe_per_chunk[virtual] if moe else 0)
        return zero_exposed_seconds(comm, c.f, c.b + c.w)

    def compute(stage: int, chunk: int) -> Costs:
        virtual = chunk * p + stage
        n = layers_per_chunk[virtual]
        ends, starts = virtual == last, virtual == 0
        c = Costs(f=n * block.f + (hf if ends else 0.0) + (ef if starts else 0.0),
                  b=n * block.b + (hb if ends else 0.0) + (eb if starts else 0.0),
                  w=n * block.w + (hw_ if ends else 0.0), latency=p2p_seconds(job, lay))
        k = moe_per_chunk[virtual] if moe else 0
        if k:  # k of the n blocks are MoE blocks
            c = replace(c, f=c.f + k * (moe.f - block.f), b=c.b + k * (moe.b - block.b),
                        w=c.w + k * (moe.w - block.w))
        return c

    def cost(stage: int, chunk: int) -> Costs:
        c = compute(stage, chunk)
        if lay.zero < 2:
            return c
        zf, zb = exposed(stage, chunk)
        return replace(c, f=c.f + zf, b=c.b + zb)
    return cost, (block, moe), exposed


def p2p_seconds(job: Job, lay: Layout) -> float:
    """One micro-batch's activations from one stage to the next: ``[b, seq_len / cp, d]``
    (a sequence shard of it under SP)."""
    if lay.pp == 1:
        return 0.0
    m = job.model
    nbytes = lay.micro_batch_size * local_seq(job, lay) * m.d_model * DTYPE_BYTES[job.dtype] \
        / (lay.tp if lay.sequence_parallel else 1)
    link = job.hardware.link(lay.tp * lay.cp * lay.dp + 1, job.node)  # neighbours are tp x cp x dp ranks apart
    return link.send(nbytes)


# ---- ZeRO -------------------------------------------------------------------------------------------


def zero_links(job: Job, lay: Layout) -> tuple[Link, Link]:
    """The links of ZeRO's collectives: the shard group's (``zero_shard`` consecutive dp x
    cp ranks, ``tp`` apart: the whole group's without hybrid sharding) and, under hybrid
    sharding, the all-reduce's across the groups (one rank of each, ``zero_shard x tp``
    apart)."""
    s = lay.zero_shard
    return (ring_link(job.hardware, s, lay.tp, job.node),
            ring_link(job.hardware, lay.dp * lay.cp // s, s * lay.tp, job.node))


def zero_units(m: ModelConfig, tp: int, blocks: int, embeds: bool, ends: bool, moe_blocks: int = 0,
               ep: int = 1, etp: int = 1) -> list[int]:
    """The parameters ZeRO-3 gathers one at a time for a model chunk, in forward order:
    the embedding's (where it embeds), each block's (``moe_blocks`` of them MoE blocks,
    with their ``E / ep`` experts, taken first), the final norm's and the head's (where
    it ends)."""
    return [sum(u) for u in zero_unit_parts(m, tp, blocks, embeds, ends, moe_blocks, ep, etp)]


def zero_unit_parts(m: ModelConfig, tp: int, blocks: int, embeds: bool, ends: bool, moe_blocks: int = 0,
                    ep: int = 1, etp: int = 1) -> list[tuple[int, int]]:
    """:func:`zero_units` as (dense, experts) parameters: a MoE block's dense part
    (attention, norms, router, shared experts) and its ``E / ep`` experts, which under
    expert parallelism are buckets of their own, gathered and reduce-scattered over the
    expert-data-parallel group; every other unit is dense. The chunk that ``ends`` the
    model also holds the multi-token prediction blocks (:func:`mtp_units`: pass their
    count among ``blocks`` and ``moe_blocks``), and its root (final norm, head) their
    norms, projections and table copy."""
    embedding = stage_parameters(m, tp, 0, embeds, False)
    head = stage_parameters(m, tp, 0, embeds, ends) - embedding
    moe = [moe_block_parameters(m, tp, ep, etp)] * moe_blocks
    dense = [(dense_block_parameters(m, tp), 0)] * (blocks - moe_blocks)
    return [u for u in ((embedding, 0), *moe, *dense, (head, 0)) if sum(u)]


def mtp_units(m: ModelConfig, ends: bool) -> tuple[int, int]:
    """The multi-token prediction blocks a chunk that ``ends`` the model holds beside its
    own (models/mtp.py), and how many of them are MoE blocks; (0, 0) elsewhere."""
    ids = mtp_blocks(m, ends)
    return len(ids), sum(map(m.is_moe_layer, ids))


def zero_chunk_seconds(job: Job, lay: Layout, blocks: int, embeds: bool, ends: bool,
                       moe_blocks: int = 0) -> tuple[float, float, float]:
    """ZeRO-2/3's collectives of one micro-batch through a model chunk of ``blocks``
    blocks (embedding and head as ``embeds`` and ``ends`` say): (the forward's gathers,
    the first of them, the backward's gathers and reduce-scatters). ZeRO-3 gathers and
    reduce-scatters unit by unit (:func:`zero_units`), ZeRO-2 reduce-scatters the chunk's
    gradients; like the once-a-step reduction of ZeRO-0 and 1, a unit's reduce-scatter
    is timed as one collective, not bucket by bucket. Under expert parallelism a MoE
    block's experts are a bucket of their own (:func:`zero_unit_parts`), gathered and
    reduce-scattered over the expert-data-parallel group (:attr:`Layout.expert_dp`
    ranks, ``ep x etp`` members of the expert grid's base apart, on the link that spans:
    :func:`ring_link`) after its dense bucket over ``dp x cp``, one after the other; a
    chunk that ends the model has the multi-token prediction blocks too. Nothing for ZeRO-0 and 1 or one dp x cp rank (their
    reduction is once a step: :func:`data_parallel_seconds`)."""
    if lay.zero < 2 or lay.dp * lay.cp == 1:
        return 0.0, 0.0, 0.0
    e = DTYPE_BYTES[job.dtype]
    w, s = wide_bytes(e), lay.zero_shard
    link = ring_link(job.hardware, s, lay.tp, job.node)  # the shard group's (zero_links)
    edp = lay.expert_dp
    expert_link = ring_link(job.hardware, edp, lay.expert_stride * lay.ep * lay.etp, job.node)
    extra, extra_moe = mtp_units(job.model, ends)
    units = zero_unit_parts(job.model, lay.tp, blocks + extra, embeds, ends, moe_blocks + extra_moe, lay.ep, lay.etp)
    if lay.ep * lay.etp == 1:  # the experts ride in their block's buckets
        units = [(dense + experts, 0) for dense, experts in units]

    def timed(unit: tuple[int, int], nbytes: int, kind: str) -> float:  # a unit's two buckets, ``nbytes`` each
        dense, experts = unit
        return link.collective(dense * nbytes, s, kind) \
            + (expert_link.collective(experts * nbytes, edp, kind) if experts else 0.0)

    if lay.zero == 2:
        return 0.0, 0.0, timed((sum(u[0] for u in units), sum(u[1] for u in units)), w, "reduce_scatter")
    # under --fp8-all-gather the blocks' units (all but the embedding's and the root's) gather as float8
    narrow = job.fp8_gathers(lay)
    first_block, end = (1 if embeds else 0), len(units) - (1 if ends else 0)
    counts: dict[tuple[tuple[int, int], int], int] = {}
    for i, u in enumerate(units):  # the blocks are alike: time each size once
        key = (u, FP8_GATHER_BYTES if narrow and first_block <= i < end else e)
        counts[key] = counts.get(key, 0) + 1
    scatters = sum(n * timed(u, w, "reduce_scatter") for (u, _), n in counts.items())
    if lay.zero3_keep_gathered:
        return 0.0, 0.0, scatters
    gathers = sum(n * timed(u, nbytes, "all_gather") for (u, nbytes), n in counts.items())
    first = timed(units[0], FP8_GATHER_BYTES if narrow and first_block == 0 < end else e, "all_gather") \
        if units else 0.0
    return gathers, first, gathers + scatters


def zero_exposed_seconds(comm: tuple[float, float, float], forward: float, backward: float) -> tuple[float, float]:
    """What a chunk's ZeRO-2/3 collectives of one micro-batch (``comm``, from
    :func:`zero_chunk_seconds`) add to its forward and backward: prefetched, they hide
    behind the chunk's compute (``forward``; ``backward``, B and W) up to it; the excess
    is exposed, and so is the forward's first gather, which nothing of the micro-batch
    precedes. What hides still slows the compute beside it by ``OVERLAP_COST`` of its
    own time."""
    gather, first, in_backward = comm
    f = max(gather - forward, first) if gather else 0.0
    b = max(0.0, in_backward - backward)
    return f + OVERLAP_COST * max(0.0, gather - f), b + OVERLAP_COST * (in_backward - b)


# ---- the whole step ----------------------------------------------------------------------------------


def config_of(job: Job, lay: Layout) -> Config:
    cfg = Config(model=job.model, preset="")
    # cp and cp_comm as fields where the configuration has them, else as plain attributes
    # (the memory model reads them with getattr)
    context = {"cp": lay.cp, "cp_comm": lay.cp_comm, "zero_shard_size": lay.zero_shard_size,
               "zero3_keep_gathered": lay.zero3_keep_gathered, "ep": lay.ep, "etp": lay.etp}
    known = {f.name for f in fields(cfg.parallel)}
    cfg.parallel = replace(cfg.parallel, tp=lay.tp, pp=lay.pp, dp=lay.dp, vpp=lay.vpp, schedule=lay.schedule,
                           sequence_parallel=lay.sequence_parallel, zero=lay.zero, pp_partition=lay.pp_partition,
                           **{k: v for k, v in context.items() if k in known})
    for k, v in context.items():
        if k not in known:
            setattr(cfg.parallel, k, v)
    cfg.training = replace(cfg.training, micro_batch_size=lay.micro_batch_size,
                           global_batch_size=job.global_batch_size, dtype=job.dtype, fp8=job.fp8,
                           fp8_all_gather=job.fp8_gathers(lay))
    cfg.optim = replace(cfg.optim, optimizer=job.optimizer, optimizer_state_dtype=job.optimizer_state_dtype,
                        optimizer_offload=job.optimizer_offload)
    cfg.activations = replace(cfg.activations, recompute=lay.recompute)
    return cfg


def grid_of(lay: Layout) -> ProcessGrid:
    return ProcessGrid(world_size=lay.gpus, tp=lay.tp, pp=lay.pp, dp=lay.dp, cp=lay.cp)


MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations", "transients")


def memory_bytes(job: Job, lay: Layout, activation_peaks: dict | None = None) -> float:
    """Bytes per GPU: the sum of :func:`memory_breakdown`."""
    return sum(memory_breakdown(job, lay, activation_peaks).values())


def memory_breakdown(job: Job, lay: Layout, activation_peaks: dict | None = None) -> dict[str, float]:
    """Bytes per GPU by kind (:data:`MEMORY_PARTS`), of the stage that needs the most of
    the first, the last (and the stage whose rank holds the most parameters,
    :func:`_heaviest_stage`): what a rank holds between steps (expected_state_bytes) and,
    at the higher of the step's two high points, either the activation peak with the
    transients beside it (ZeRO-3's gathered units, ZeRO-2/3's gradient staging, ZB-H1's
    inputs of deferred weight gradients) and, where a step has more than one
    micro-batch, ZeRO-2/3's whole gradient shard (made bucket by bucket in the first
    backward, held to the optimizer step: every later backward starts beside all of it;
    a schedule whose activation peak comes before its first backward, GPipe's, is
    over-counted by it), or the end of backward: no activations, the whole gradient
    shard and the staging. ``activation_peaks``: a cache of the peaks by
    layout without its ZeRO fields and ep (of ep, only whether it is above 1 changes
    them; etp changes them), for a search that tries every ZeRO stage and ep of a
    layout; the same dict keeps what a rank holds by layout without the fields it does
    not depend on (micro-batch, schedule, recomputation, SP, cp_comm), which a search's
    layouts share by the dozen."""
    cache = activation_peaks
    built: list = []

    def setup():  # the configuration and grid, made once and only where something is not cached
        if not built:
            built.extend((config_of(job, lay), grid_of(lay)))
        return built
    device = "cpu" if job.hardware.name == "cpu" else "cuda"
    base = replace(lay, zero=0, zero_shard_size=None, zero3_keep_gathered=False, ep=min(lay.ep, 2))  # (etp kept)
    state = replace(lay, micro_batch_size=1, schedule="1f1b", recompute="none", sequence_parallel=False,
                    cp_comm="ring")
    several = micro_batches(job, lay) > 1  # a backward before the last: the gradient shard whole by then
    worst: dict[str, float] = {}
    for stage in sorted({0, lay.pp - 1, _heaviest_stage(job, lay, cache, setup)}):
        key, held_key = (base, stage), ("held", state, stage)
        if cache is None or held_key not in cache:
            cfg, grid = setup()
            held = expected_state_bytes(cfg, grid, grid.rank_of(dp=0, pp=stage, tp=0))
            held = {"parameters": held["parameter_bytes"], "gradients": held["gradient_bytes"],
                    "optimizer": held["optimizer_bytes"], "shard": held["gradient_shard_bytes"],
                    "gathered": held["gathered_bytes"], "staging": held["staging_bytes"]}
            if cache is not None:
                cache[held_key] = held
        else:
            held = cache[held_key]
        if cache is None or key not in cache:
            cfg, grid = setup()
            rank = grid.rank_of(dp=0, pp=stage, tp=0)
            peak = expected_activation_peak(cfg, grid, rank, device)
            # a zero-bubble schedule's deferred weight gradients' inputs, from each B to its W
            deferred = expected_activation_peak(cfg, grid, rank, device, weight_inputs=True) - peak \
                if lay.schedule == "zb-h1" else 0.0
            peak = (peak, deferred)
            if cache is not None:
                cache[key] = peak
        else:
            peak = cache[key]
        kept = {k: held[k] for k in ("parameters", "optimizer")}
        # the step's two high points: its backward (the activations and what runs beside
        # them), and the end of backward, the gradient shard whole (ZeRO-2/3)
        for parts in ({**kept, "gradients": held["gradients"] + (held["shard"] if several else 0),
                       "activations": peak[0], "transients": held["gathered"] + held["staging"] + peak[1]},
                      {**kept, "gradients": held["gradients"] + held["shard"], "activations": 0.0,
                       "transients": held["staging"]}):
            if sum(parts.values()) > sum(worst.values()):
                worst = parts
    return {k: float(worst[k]) for k in MEMORY_PARTS}


def _heaviest_stage(job: Job, lay: Layout, cache: dict | None, setup) -> int:
    """The pipeline stage whose rank holds the most parameters (memory.model.
    stage_parameter_split): a middle stage where the partition leaves it more than the
    first and last (a MoE model's dense first layers, the embedding and head beside
    fewer blocks). Cached by the fields it depends on."""
    if lay.pp <= 2:
        return 0
    key = ("heaviest", lay.pp, lay.vpp, lay.tp, lay.dp, lay.cp, lay.ep, lay.etp, lay.pp_partition)
    if cache is None or key not in cache:
        cfg, grid = setup()
        sizes = [sum(stage_parameter_split(cfg, grid, grid.rank_of(dp=0, pp=s, tp=0))) for s in range(lay.pp)]
        heaviest = sizes.index(max(sizes))
        if cache is None:
            return heaviest
        cache[key] = heaviest
    return cache[key]


def micro_batches(job: Job, lay: Layout) -> int:
    return job.global_batch_size // (lay.micro_batch_size * lay.dp)


def predict(job: Job, lay: Layout, *, memory: bool | float | dict[str, float] = True) -> Prediction:
    """The layout's step (the schedule simulated) and memory: ``memory`` True computes
    :func:`memory_breakdown`; a breakdown or a number is taken as given (a search's)."""
    m, hw = job.model, job.hardware
    mbs = micro_batches(job, lay)
    cfg = config_of(job, lay)
    grid = grid_of(lay)
    chunks = [chunks_of_stage(cfg, grid, s) for s in range(lay.pp)]
    layers = [0] * (lay.pp * lay.vpp)
    moe_layers = [0] * (lay.pp * lay.vpp)  # of them MoE blocks
    for s, stage in enumerate(chunks):
        for c, chunk in enumerate(stage):
            layers[c * lay.pp + s] = len(chunk.layer_ids)
            moe_layers[c * lay.pp + s] = sum(m.is_moe_layer(i) for i in chunk.layer_ids)
    cost, (block, moe), zero_exposed = pipeline_costs(job, lay, layers, moe_layers)
    schedule = _schedule(lay.schedule, lay.pp, mbs, lay.vpp)
    timeline = simulate(schedule, cost, lay.vpp, rendezvous=True)
    busy = max(timeline.busy(s) for s in range(lay.pp))
    makespan = timeline.makespan
    forwards = 2 if lay.recompute == "full" else 1  # full recomputation runs each forward twice
    blocks_run = mbs * max(layers) * lay.vpp
    tp_comm = blocks_run * (block.tp_comm_f * forwards + block.tp_comm_b)
    cp_comm = blocks_run * (block.cp_comm_f * forwards + block.cp_comm_b)
    ep_comm = 0.0
    if moe is not None:  # of the busiest stage's blocks, its MoE blocks communicate as MoE blocks
        moe_run = mbs * max(moe_layers) * lay.vpp
        tp_comm += moe_run * ((moe.tp_comm_f - block.tp_comm_f) * forwards + moe.tp_comm_b - block.tp_comm_b)
        ep_comm = moe_run * (moe.ep_comm_f * forwards + moe.ep_comm_b)
    zero_comm = mbs * max(sum(sum(zero_exposed(s, c)) for c in range(lay.vpp)) for s in range(lay.pp)) \
        if lay.zero >= 2 else 0.0
    params, experts = _rank_parameters(cfg, grid)
    exposed, gather, optimizer = data_parallel_seconds(job, lay, params, cost, cfg.parallel.bucket_mb, experts)
    if moe is not None:
        exposed += expert_tp_seconds(job, lay, experts)
    ns, exchange, exchanged = muon_seconds(job, lay) if job.optimizer == "muon" else (0.0, 0.0, 0.0)
    stage_blocks = [(sum(layers[c * lay.pp + s] for c in range(lay.vpp)),
                     sum(moe_layers[c * lay.pp + s] for c in range(lay.vpp))) for s in range(lay.pp)]
    scales = fp8_scale_seconds(job, lay, *max(stage_blocks))
    optimizer += ns + exchange + scales
    step = makespan + exposed + gather + optimizer
    tokens = job.global_batch_size * m.seq_len
    flops_per_token = model_flops_per_token(m)
    model_flops = flops_per_token * tokens
    depths = getattr(m, "mtp_layers", 0)
    # per token, all blocks (the multi-token prediction depths' heads are not recomputed)
    forward_blocks = flops_per_token / 3 - (1 + depths) * 2 * m.d_model * m.vocab_size
    # the core's 4 s (n_head x head_dim) per layer (latent attention's 2 s n_head (qk + v)
    # head dims); the cp core is kept
    core = 2.0 * m.seq_len * m.n_head * (m.qk_head_dim + m.v_head_dim) if getattr(m, "mla", False) \
        else 4.0 * m.seq_len * m.n_head * m.head_dim
    selective = core * (m.n_layer + depths) if lay.cp == 1 else 0.0
    recomputed = {"none": 0.0, "selective": selective, "full": forward_blocks}[lay.recompute] * tokens
    hardware_flops = model_flops + recomputed
    parts = memory_breakdown(job, lay) if memory is True else memory if isinstance(memory, dict) else {}
    mem = sum(parts.values()) if memory is True or isinstance(memory, dict) else float(memory or 0.0)
    return Prediction(layout=lay, step_time_s=step, compute_s=busy, tp_comm_s=tp_comm, bubble_s=makespan - busy,
                      dp_exposed_s=exposed + gather, optimizer_s=optimizer, memory_bytes=mem,
                      fits=mem <= hw.usable_memory_bytes, model_flops=model_flops, hardware_flops=hardware_flops,
                      tokens=tokens, gpus=lay.gpus, peak_flops=hw.peak_flops(job.dtype), pp_layers=layers,
                      cp_comm_s=cp_comm, zero_comm_s=zero_comm, ep_comm_s=ep_comm, moe=bool(m.n_experts),
                      memory_parts=parts, optimizer=job.optimizer, newton_schulz_s=ns, muon_exchange_s=exchange,
                      muon_exchange_bytes=exchanged, fp8=job.fp8, fp8_all_gather=job.fp8_gathers(lay),
                      fp8_scales_s=scales)


def fp8_scale_seconds(job: Job, lay: Layout, blocks: int, moe_blocks: int = 0) -> float:
    """``--fp8``: the float8 weights' amaxes of a stage's ``blocks`` blocks (``moe_blocks``
    of them MoE blocks) all-reduced once a step after the optimizer (float8.
    refresh_weight_scales), over the ZeRO-3 shard group (its ranks hold pieces of each
    weight) and over tp (where tp splits what the scale reduces over; counted for every
    weight): one small tree all-reduce each (fp8.scale_count), not overlapped. Nothing
    without --fp8."""
    if not job.fp8_on or (lay.zero != 3 and lay.tp == 1):
        return 0.0
    m, tp, recipe = job.model, lay.tp, job.fp8
    count = (blocks - moe_blocks) * scale_count(recipe, block_gemms(m, 1, tp), block_float8(m, tp))
    if moe_blocks:
        shared = mlp_gemms(m, 1, m.moe_shared_experts * m.moe_ffn_size // tp) if m.moe_shared_experts else []
        experts = mlp_gemms(m, 1, m.moe_ffn_size // lay.etp)
        count += moe_blocks * (scale_count(recipe, block_gemms(m, 1, tp, mlp=False), block_float8(m, tp, False))
                               + scale_count(recipe, shared, [True] * len(shared))
                               + m.n_experts // lay.ep * scale_count(recipe, experts, [True] * len(experts)))
    nbytes = SCALE_BYTES * count
    shard = tree_all_reduce_seconds(job, lay.zero_shard, lay.tp, nbytes) if lay.zero == 3 else 0.0
    return shard + tree_all_reduce_seconds(job, tp, 1, nbytes)


@lru_cache(maxsize=256)
def _schedule(name: str, pp: int, micro_batches: int, vpp: int):
    """The schedule's action lists (the simulator only reads them): cached, as a search
    predicts several layouts of one schedule, pipeline and micro-batch count."""
    return build_schedule(name, pp, micro_batches, vpp)


def data_parallel_seconds(job: Job, lay: Layout, params: int, cost, bucket_mb: float,
                          experts: int = 0) -> tuple[float, float, float]:
    """The exposed gradient reduction, the exposed ZeRO parameter gather and the
    optimizer of a step, for ``params`` parameters reduced over the ``dp x cp`` ranks that
    hold them (``tp`` apart; :func:`gridtrain.memory.zero.zero_step_collectives`):

    * ZeRO-0 and 1: the reducer's fp32 buffer all-reduced (ZeRO-1: reduce-scattered in the
      shard group, and under hybrid sharding the shard all-reduced across the groups)
      behind the last micro-batch's backward, all but the last bucket;
    * ZeRO-2 and 3: the reduce-scatters ride in every micro-batch's backward
      (:func:`pipeline_costs`); what is left is the all-reduce across the groups under
      hybrid sharding, in what the last backward leaves, and the last bucket;
    * the parameters' all-gather (ZeRO-1 and 2 after the optimizer, ZeRO-3 kept gathered
      before the first forward) behind the next step's first forward, all but the first
      bucket; ZeRO-3's per-micro-batch gathers are in the pipeline's costs;
    * the optimizer: one memory-bound pass over the owned (ZeRO: the shard's) master
      weights, moments and gradients.

    ``experts``: a MoE model's expert parameters of the rank. With ep = etp = 1 they are
    reduced with the rest; else over the expert-data-parallel group
    (:attr:`Layout.expert_dp` ranks, ``ep x etp`` members of the expert grid's base
    apart) and, under ZeRO, sharded over it: their all-reduce (or
    reduce-scatter, and the step's gather) beside the dense one's; ZeRO-2/3's
    per-micro-batch collectives of them are in the pipeline's costs, as the dense ones
    (:func:`zero_chunk_seconds`)."""
    hw = job.hardware
    n = lay.dp * lay.cp
    e = DTYPE_BYTES[job.dtype]
    if lay.ep * lay.etp == 1:
        params, experts = params + experts, 0
    edp = lay.expert_dp
    owned = params / (lay.zero_shard if lay.zero else 1)
    if experts:
        owned += experts / (edp if lay.zero else 1)
    optimizer = owned * (4 + 3 * 8 + e) / hw.memory_bandwidth
    if n == 1:
        return 0.0, 0.0, optimizer
    traffic = zero_step_collectives(params, job.dtype, lay.zero, micro_batches(job, lay), n,
                                    shard=lay.zero_shard if lay.zero else None,
                                    keep_gathered=lay.zero3_keep_gathered)
    links = zero_links(job, lay)

    def one(name: str, share: float = 1.0) -> float:  # one of the step's collectives of that name
        c = traffic.get(name)
        return links[name == "replicas"].collective(c.nbytes * share, c.ranks, c.kind) if c else 0.0

    # --fp8-all-gather, ZeRO-3 kept gathered: the blocks' share of the step's gather at one byte an
    # element (the embedding, final norm and head of a one-stage model counted at e: a bound for a stage)
    narrow = FP8_GATHER_BYTES / e if job.fp8_gathers(lay) else 1.0
    outside = min(params, stage_parameters(job.model, lay.tp, 0, True, True)) if narrow < 1 else params
    share = (outside + narrow * (params - outside)) / params if params else 1.0
    grads, replicas, gather = one("gradients"), one("replicas"), one("parameters", share)
    if experts and edp > 1:  # the experts' own buffer, over the expert-data-parallel group
        link = ring_link(hw, edp, lay.expert_stride * lay.ep * lay.etp, job.node)
        apart = zero_step_collectives(experts, job.dtype, lay.zero, micro_batches(job, lay), edp)
        grads += link.collective(apart["gradients"].nbytes, edp, apart["gradients"].kind)
        if "parameters" in apart:
            gather += link.collective(apart["parameters"].nbytes * narrow, edp, "all_gather")
    backward = sum(cost(0, c).b + cost(0, c).w for c in range(lay.vpp))
    bucket = min(1.0, bucket_mb * 2**20 / max((params + experts) * wide_bytes(e), 1))
    if lay.zero < 2:
        reduce = grads + replicas
        exposed = max(reduce - backward, reduce * bucket)
        exposed += OVERLAP_COST * (reduce - exposed)  # what hides slows the backward beside it
    else:
        per_gather = lay.zero == 3 and not lay.zero3_keep_gathered
        in_backward = grads + (gather if per_gather else 0.0)
        exposed = max(replicas - max(0.0, backward - in_backward), (grads + replicas) * bucket)
        exposed += OVERLAP_COST * max(0.0, replicas - exposed)  # (the per-micro-batch ones: pipeline_costs)
        if per_gather:
            gather = 0.0
    # ZeRO's step gather travels behind the next step's first forward, all but the first bucket
    first_mb_forward = sum(cost(0, c).f for c in range(lay.vpp))
    hidden = gather
    gather = max(gather - first_mb_forward, gather * bucket)
    return exposed, gather + OVERLAP_COST * (hidden - gather), optimizer


def newton_schulz_seconds(shape: tuple[int, int], steps: int, hw) -> float:
    """One matrix's Newton-Schulz (optim/muon.py) in bf16: per iteration X X^T, A A and
    the product with X, on the wide orientation (m <= n)."""
    m, n = sorted(shape)
    return steps * (gemm_seconds(m, m, n, hw, "bf16") + gemm_seconds(m, m, m, hw, "bf16")
                    + gemm_seconds(m, n, m, hw, "bf16"))


MUON_EXCHANGE_ROUNDS = 4  # optim/muon.py MatrixExchange.rounds (tests hold the two equal)


def muon_seconds(job: Job, lay: Layout, steps: int = 5) -> tuple[float, float, float]:
    """Muon's work on a rank per step beyond AdamW's pass (optim/muon.py), as (Newton-Schulz
    seconds, exposed exchange seconds, exchange bytes sent): a stage's matrices (the model's
    ``1 / pp``), each orthogonalised whole on one owner, the owners spread over the ranks
    that share the matrix (tp, and under ZeRO the shard group; an expert's over etp and
    its expert-data-parallel shard group); without ZeRO every data-parallel replica
    iterates all of its own. The exchange: under ZeRO each rank sends its slices of the
    stage's matrices to their owners and receives its owned matrices' updates back (2 x
    (s - 1) / s of its share, bf16, over the shard group's link), then over tp the same
    for the shards (within a node). The ZeRO group's exchange runs in
    ``MUON_EXCHANGE_ROUNDS`` rounds, each round's gather and scatter travelling behind the
    iterations of the rounds beside it: the step waits for the first gather and the last
    scatter (1 / rounds of it) and for what the iterations do not cover; tp's stage is
    not overlapped."""
    m, hw = job.model, job.hardware
    shard = lay.zero_shard if lay.zero else 1
    layers = [*range(m.n_layer), *mtp_blocks(m, True)]  # the multi-token prediction blocks too
    moe_layers = sum(1 for i in layers if m.n_experts and m.is_moe_layer(i))
    per_expert = Counter(mlp_matrices(m, m.moe_ffn_size)) if moe_layers else Counter()
    ns = exchanged = 0.0
    dense_elements = 0.0
    for shape, count in model_matrices(m):
        routed = min(count, per_expert[shape] * m.n_experts * moe_layers)  # the routed experts' matrices
        dense = count - routed
        one = newton_schulz_seconds(shape, steps, hw)
        ns += dense * one / (lay.tp * shard) / lay.pp
        ns += routed * one / (lay.ep * lay.etp * (lay.expert_dp if lay.zero else 1)) / lay.pp
        dense_elements += dense * shape[0] * shape[1] / lay.tp / lay.pp
    bytes_ = 2  # the exchange travels in Newton-Schulz's bf16
    seconds = 0.0
    if shard > 1:
        sent = 2 * bytes_ * dense_elements / shard * (shard - 1) / shard
        exchanged += sent
        travel, rounds = sent / zero_links(job, lay)[0].bandwidth, MUON_EXCHANGE_ROUNDS
        seconds += travel / rounds + max(0.0, travel - ns) * (rounds - 1) / rounds
    if lay.tp > 1:
        sent = 2 * bytes_ * dense_elements / shard * (lay.tp - 1) / lay.tp
        exchanged += sent
        seconds += sent / ring_link(hw, lay.tp, 1, job.node).bandwidth
    return ns, seconds, exchanged


def _rank_parameters(cfg: Config, grid: ProcessGrid) -> tuple[int, int]:
    """Parameters of the largest stage's rank, as (dense, experts)
    (memory.model.stage_parameter_split; experts 0 for a dense model)."""
    return max((stage_parameter_split(cfg, grid, grid.rank_of(dp=0, pp=s, tp=0)) for s in range(grid.pp)), key=sum)


def expert_tp_seconds(job: Job, lay: Layout, experts: int) -> float:
    """Under sequence parallelism each tp rank's copy of an expert has seen only its own
    tokens, so the ``experts`` parameters' gradients are summed over tp after the
    backward (as the norms' are: optim/grads.py), an all-reduce of their ``w`` bytes
    each, not overlapped. Nothing without SP (the tp ranks computed the same rows), nor
    where the experts are folded over tp (a rank's experts are its own, not its tp
    neighbours')."""
    if not (lay.sequence_parallel and lay.tp > 1) or not experts or lay.folded:
        return 0.0
    link = job.hardware.link(lay.tp, job.node)
    return link.collective(experts * wide_bytes(DTYPE_BYTES[job.dtype]), lay.tp, "all_reduce")


def bubble_closed_form(lay: Layout, m: int) -> float:
    """(p - 1) / (v m): the 1F1B bubble as a fraction of the ideal time, for pruning only."""
    return (lay.pp - 1) / (lay.vpp * m)


def fraction(x: float, of: float) -> float:
    return x / of if of else math.nan
