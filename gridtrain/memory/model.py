"""The memory model: the bytes a rank holds, as closed forms of the layout.

From the configuration (the model's shape, the parallel sizes and schedule, the
recomputation policy, the dtype, ZeRO) and a rank of the grid, without building anything:

* :func:`chunks_of_stage`: the model chunks of a pipeline stage, from the partition of
  the blocks into ``pp x vpp`` virtual stages (which blocks, whether the chunk embeds,
  whether it ends the model). The built-in model provider builds its chunks from it too,
  so the model counted here is the model that runs;
* :func:`expected_parameters` and :func:`expected_bytes`: parameters, the gradients
  (ZeRO's padding and shards included) and the optimizer's state, as the code allocates
  them, for every ZeRO stage and shard group (the closed forms of
  :mod:`gridtrain.memory.zero`); :func:`expected_state_bytes` adds what ZeRO-2 and 3
  hold only within a step (the gradient shard, gathered parameters, gradient staging
  buffers);
* :func:`expected_activation_peak`: the most bytes saved for backward at once, the
  schedule's action list walked with each chunk's per-layer bytes
  (:mod:`gridtrain.memory.activations`, docs/memory.md).

Context parallelism (the grid's ``cp``; ``cfg.parallel.cp_comm``, ring by default) enters
in two places: a rank's blocks run on ``seq_len / cp`` tokens with the cp attention core
(:mod:`gridtrain.memory.activations`), and the gradients are reduced, ZeRO's state
sharded, over the ``dp x cp`` ranks that hold the same shard (each cp rank holds the
whole layer), or with ``--zero-shard-size`` over groups of that many of them. With cp = 1 every form is the three-axis one.

A mixture of experts (:mod:`gridtrain.memory.moe`): a rank holds its ``E / ep`` experts
of each MoE block it holds; with ``ep`` > 1 their gradients are reduced and ZeRO shards
their state (ZeRO-1 the optimizer's, ZeRO-2 the gradients too, ZeRO-3 the parameters
too) over the expert-data-parallel group (``dp x cp / ep``), the rest over ``dp x cp``;
a MoE block keeps its router's, permutation's and experts' tensors instead of the dense
MLP's. Under expert tensor parallelism (``etp``) a rank's experts are ``1 / etp`` slices
and their group is ``dp x cp / (ep x etp)``; where the expert grid folds over the tp ranks
(``grid.folds_experts``) it is ``tp x dp x cp / (ep x etp)``; any ``ep x etp`` > 1 puts
the experts in buckets of their own.

DeepSeek-V3's other parts: latent attention's blocks (their parameters from
``mla.attention_parameters``, their activations from the latent terms of
:mod:`gridtrain.memory.activations`), dense first layers (``is_moe_layer``), and the
multi-token prediction modules on the stage that ends the model (:func:`mtp_blocks`:
their blocks among the stage's, their norms and projections, the table's copy where the
stage does not embed, their activations beside the head's).

The dry run measures the same quantities on fake tensors, and the tests hold them equal
(the activation peak within a few percent: the norms' per-token statistics are left
out); the planner reads these forms to decide whether a layout fits. The module describes
``parallel`` and ``models`` (the partition, the schedules, the recomputation policy, the
blocks' parameter counts), so it sits above them and below training, the dry run and the
planner.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

from gridtrain.config import Config, ModelConfig
from gridtrain.memory.optimizer import matrix_fraction
from gridtrain.models.head_loss import defers_weight_gradient, worth_fusing
from gridtrain.memory import activations
from gridtrain.memory.cp import wide_bytes
from gridtrain.memory.moe import dense_block_parameters, edp_size, moe_block_parameters
from gridtrain.memory.zero import zero_state_bytes
from gridtrain.models import mtp as multi_token
from gridtrain.models.decoder import ChunkSpec, parameter_costs
from gridtrain.parallel.distributed import TORCH_DTYPES
from gridtrain.parallel.grid import ProcessGrid
from gridtrain.parallel.pipeline.partition import UnitCosts, partition
from gridtrain.parallel.pipeline.schedules import ORDERS, B, F, W, check_sizes
from gridtrain.parallel.recompute import policy_from


# ---- where the blocks are ------------------------------------------------------------------------

def block_partition(cfg: Config, grid: ProcessGrid, costs: UnitCosts | None = None) -> list[list[int]]:
    """Global block ids of each of the ``pp x vpp`` virtual stages: ``--pp-layers``, or
    the ``--pp-partition`` method's split (uniform; parameters, from the model's shape).
    A measured (``time``) partition has no closed form: its ``costs`` must be given.
    The split by parameters is remembered per model shape and stage count
    (:data:`_PARTITIONS`): balancing 61 blocks over the stages takes about 10 ms, and the
    planner asks for the same few splits thousands of times."""
    explicit, method = cfg.parallel.pp_layers, cfg.parallel.pp_partition
    parts = grid.pp * cfg.parallel.vpp
    if explicit is None and costs is None:
        if method == "time":
            raise ValueError("no closed form for --pp-partition time (measured)")
        if method == "parameters":
            key = (repr(cfg.model), parts)
            if key not in _PARTITIONS:
                if len(_PARTITIONS) >= 1024:
                    _PARTITIONS.clear()
                _PARTITIONS[key] = partition(cfg.model.n_layer, parts, costs=parameter_costs(cfg.model))
            return [list(stage) for stage in _PARTITIONS[key]]
    return partition(cfg.model.n_layer, parts, explicit=explicit, costs=costs)


# the split by parameters of each (model shape, virtual stages) asked for (block_partition)
_PARTITIONS: dict[tuple[str, int], list[list[int]]] = {}


def chunks_of_stage(cfg: Config, grid: ProcessGrid, stage: int,
                    layers: Sequence[Sequence[int]] | None = None) -> list[ChunkSpec]:
    """The model chunks of pipeline stage ``stage``, one per virtual stage it holds
    (chunk ``c`` is virtual stage ``c * pp + stage``): from ``layers``, each virtual
    stage's blocks where the caller has them (a measured partition), else
    :func:`block_partition`."""
    p, v = grid.pp, cfg.parallel.vpp
    if layers is None:
        layers = block_partition(cfg, grid)
    return [ChunkSpec(tuple(layers[c * p + stage]), c * p + stage == 0, c * p + stage == p * v - 1)
            for c in range(v)]


def cp_layout(cfg: Config, grid: ProcessGrid) -> tuple[int, str]:
    """The context-parallel size (the grid's) and how its attention communicates
    (``cfg.parallel.cp_comm``; ring where the configuration has no such field)."""
    return grid.cp, getattr(cfg.parallel, "cp_comm", "ring")


def gradient_shards(grid: ProcessGrid) -> int:
    """The ranks a dense gradient is reduced over: the ``dp x cp`` group (cp ranks hold
    the same parameters and different tokens)."""
    return grid.dp * grid.cp


def zero_shards(cfg: Config, grid: ProcessGrid) -> int:
    """The ranks ZeRO shards its state over: ``--zero-shard-size`` (hybrid sharding), else
    the whole ``dp x cp`` group."""
    return getattr(cfg.parallel, "zero_shard_size", None) or gradient_shards(grid)


def expert_parallel(cfg: Config) -> int:
    """The expert-parallel size (``cfg.parallel.ep``; 1 where the configuration has none)."""
    return getattr(cfg.parallel, "ep", 1) or 1


def expert_tensor_parallel(cfg: Config) -> int:
    """The expert-tensor-parallel size (``cfg.parallel.etp``; 1 where the configuration has none)."""
    return getattr(cfg.parallel, "etp", 1) or 1


def experts_apart(cfg: Config) -> bool:
    """Whether a rank's experts are reduced over a group of their own, in buckets of their
    own (the runtime's expert-data-parallel group exists): ``ep x etp`` > 1."""
    return expert_parallel(cfg) * expert_tensor_parallel(cfg) > 1


def expert_shards(cfg: Config, grid: ProcessGrid) -> int:
    """The ranks an expert's gradient is reduced (and ZeRO shards its state) over: the
    expert-data-parallel group, ``dp x cp / (ep x etp)``, or folded over the tp ranks too
    (``grid.folds_experts``: ``ep x etp`` does not divide dp x cp) ``tp x dp x cp / (ep x
    etp)``."""
    ep, etp = expert_parallel(cfg), expert_tensor_parallel(cfg)
    return edp_size(grid.dp, grid.cp, ep, etp, grid.tp if grid.folds_experts(ep, etp) else 1)


def mtp_blocks(m: ModelConfig, ends: bool) -> list[int]:
    """The multi-token prediction blocks' layer ids (models/mtp.py: ``n_layer`` .. ``n_layer
    + N - 1``) on a stage that ``ends`` the model (they run with the head); none elsewhere."""
    return list(multi_token.layer_ids(m)) if ends and getattr(m, "mtp_layers", 0) else []


def _holds(cfg: Config, grid: ProcessGrid, rank: int) -> tuple[int, bool, bool]:
    """How many blocks rank ``rank`` holds (the multi-token prediction modules' blocks
    included, on the stage with the head), and whether it holds the embedding and the head."""
    chunks = chunks_of_stage(cfg, grid, grid.coords(rank).pp)
    ends = any(c.post_process for c in chunks)
    return (sum(len(c.layer_ids) for c in chunks) + len(mtp_blocks(cfg.model, ends)),
            any(c.pre_process for c in chunks), ends)


def moe_blocks_held(cfg: Config, grid: ProcessGrid, rank: int) -> int:
    """How many of rank ``rank``'s blocks are MoE blocks (none for a dense model; the
    multi-token prediction blocks included)."""
    if not cfg.model.n_experts:
        return 0
    chunks = chunks_of_stage(cfg, grid, grid.coords(rank).pp)
    ends = any(c.post_process for c in chunks)
    return sum(cfg.model.is_moe_layer(i) for i in [*(i for c in chunks for i in c.layer_ids),
                                                   *mtp_blocks(cfg.model, ends)])


# ---- parameters, gradients, optimizer state ------------------------------------------------------

def expected_parameters(cfg: Config, grid: ProcessGrid, rank: int) -> int:
    """Parameters rank ``rank`` holds, from the model's shape and the layout
    (:func:`stage_parameters` of the blocks, embedding and head it holds; of a MoE
    model's blocks, its ``E / ep`` experts of each MoE block)."""
    return sum(stage_parameter_split(cfg, grid, rank))


def stage_parameter_split(cfg: Config, grid: ProcessGrid, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s parameters as (dense, experts): the ones reduced over ``dp x cp``
    and its experts, reduced over the expert-data-parallel group
    (:func:`expert_shards`); experts 0 for a dense model."""
    moe, ep, etp = moe_blocks_held(cfg, grid, rank), expert_parallel(cfg), expert_tensor_parallel(cfg)
    n = stage_parameters(cfg.model, grid.tp, *_holds(cfg, grid, rank), moe_blocks=moe, ep=ep, etp=etp)
    experts = moe * moe_block_parameters(cfg.model, grid.tp, ep, etp)[1]
    return n - experts, experts


def stage_parameters(m: ModelConfig, tp: int, blocks: int, embeds: bool, ends: bool, *, moe_blocks: int = 0,
                     ep: int = 1, etp: int = 1) -> int:
    """Parameters of a TP rank holding ``blocks`` blocks, and the embedding and the head
    if it ``embeds`` and ``ends``: per block (models.decoder.block_parameters), GPT-2's
    column-parallel QKV and MLP expansion (weights and biases / t), row-parallel
    projections (weights / t, whole biases), whole LayerNorms, or Llama's q, proj, gate,
    up, down / t, the rank's whole key/value heads and two whole RMSNorms; the
    vocabulary-parallel token table (padded vocabulary / t rows) and GPT-2's whole
    position table where it embeds; the final norm and, unless it also embeds, a copy of
    the (tied) table or the untied head where it ends. ``moe_blocks`` of the blocks are
    MoE blocks (gridtrain.memory.moe.moe_block_parameters: their dense part and
    ``E / ep`` experts, each ``1 / etp`` of one). Latent attention's blocks count
    mla.attention_parameters (q_a, kv_a and their norms whole, the rest by heads).
    Multi-token prediction (``m.mtp_layers``, models/mtp.py) where it ends: its blocks are
    among ``blocks`` (and ``moe_blocks``), and per depth three RMSNorms and the ``[d, 2d]``
    projection, whole on every tp rank; a stage that ends but does not embed an untied
    model keeps a copy of its token table for the depths' lookups (``embedding_copy``; a
    tied model's head copy serves)."""
    d = m.d_model
    table = m.padded_vocab_size(tp) // tp * d
    n = dense_block_parameters(m, tp) * (blocks - moe_blocks)
    if moe_blocks:
        n += sum(moe_block_parameters(m, tp, ep, etp)) * moe_blocks
    gpt2 = m.arch == "gpt2"
    if embeds:
        n += table + (m.seq_len * d if gpt2 else 0)
    if ends:
        n += (2 * d if gpt2 else d) + (table if not (m.tie_embeddings and embeds) else 0)
        depths = getattr(m, "mtp_layers", 0)
        n += depths * (3 * d + 2 * d * d) + (table if depths and not embeds and not m.tie_embeddings else 0)
    return n


def expected_bytes(cfg: Config, grid: ProcessGrid, rank: int) -> dict[str, int]:
    """parameter, gradient and optimizer bytes a rank holds between steps, as the code
    allocates them (:func:`gridtrain.memory.zero.zero_state_bytes` for the rank's
    parameters and ZeRO stage, sharded over :func:`zero_shards` ranks):

    * parameters in the run's dtype (ZeRO-1/2: views of one flat buffer laid out as the
      gradients, into which the optimizer all-gathers in place); ZeRO-3: the rank's
      parameter shard, in the master weights' dtype (it is the optimizer's master; with
      ``--optimizer-offload`` in the run's dtype);
    * gradients: the reducer's flat buffer (fp32 for 16-bit parameters, else the
      parameters' dtype); with ZeRO-1 padded to a multiple of the shard group
      (:func:`_padded_buffer`), each bucket reduce-scattered into the rank's own slice;
      none under ZeRO-2 and 3, whose gradient shard lives from backward to the optimizer
      step (:func:`expected_state_bytes`' ``gradient_shard_bytes``);
    * optimizer: torch's AdamW (fp32/fp64 without ZeRO) keeps two moments per parameter
      and a 4-byte step count per parameter tensor; the flat optimizer (16-bit or ZeRO)
      keeps master weights and two moments for its slice (all of it without ZeRO) and
      nothing else (``DistributedOptimizer.state_bytes``); ZeRO-3 keeps no master copy
      beside its parameter shard (but for ``--optimizer-offload``'s, in host memory)."""
    state = expected_state_bytes(cfg, grid, rank)
    return {k: state[k] for k in ("parameters", "parameter_bytes", "gradient_bytes", "optimizer_bytes")}


def expected_state_bytes(cfg: Config, grid: ProcessGrid, rank: int) -> dict[str, int]:
    """:func:`expected_bytes` and what a rank holds only within a step, beyond the
    activations: ZeRO-2/3's gradient shard (``gradient_shard_bytes``: each bucket's slice
    made at its first reduce-scatter in backward, all of it freed after the optimizer
    step), ZeRO-3's gathered parameters (``gathered_bytes``: two blocks and the root
    unit's parameters, or the whole stage with ``--zero3-keep-gathered``; a token table
    that is a unit of its own, :func:`table_unit_parameters`, is gathered for its
    forward only, at the step's start, and is left out) and ZeRO-2/3's gradient staging
    buffers (``staging_bytes``); all zero for ZeRO-0 and 1. Nothing for the
    optimizer's publication of the weights: ZeRO-1/2 gather them in place into the
    parameters' flat buffer, ZeRO-3 into its shard.

    A MoE model's experts (``stage_parameter_split``): with ``ep`` = 1 in the one
    buffer with the rest (the expert-data-parallel group is then all of ``dp x cp``);
    with ``ep`` > 1 in buckets of their own (a bucket holds dense parameters or experts,
    never both), reduced and sharded over the expert-data-parallel group
    (``dp x cp / ep``), every ZeRO stage: ZeRO-1 their optimizer state, ZeRO-2 also their
    gradients, ZeRO-3 also their parameters, each over that group (``e X / (n / ep)``
    where the dense part holds ``e D / n``), the dense parameters' as before. ZeRO-3
    gathers the stage's largest block twice, a MoE block's dense bucket over ``dp x cp``
    and its expert bucket over the expert group (the same bytes gathered); the staging
    buffers are two of the largest bucket (:func:`_largest_bucket`: under ZeRO-3 a unit,
    the stage's root unit or token table where that is larger than a block; under
    ZeRO-2 a bucket closed by the parameter that reaches ``--bucket-mb``, the head or the
    table where they are held)."""
    holds = _holds(cfg, grid, rank)
    m, par = cfg.model, cfg.parallel
    dense, experts = stage_parameter_split(cfg, grid, rank)
    moe, ep, etp = moe_blocks_held(cfg, grid, rank), expert_parallel(cfg), expert_tensor_parallel(cfg)
    n = dense + experts
    moe_block = sum(moe_block_parameters(m, grid.tp, ep, etp))
    blocks = (holds[0] - moe) * dense_block_parameters(m, grid.tp) + moe * moe_block
    largest = max(dense_block_parameters(m, grid.tp) if holds[0] > moe else 0, moe_block if moe else 0)
    dtype, keep = TORCH_DTYPES[cfg.training.dtype], bool(getattr(par, "zero3_keep_gathered", False))
    apart = experts_apart(cfg) and experts > 0  # the experts in buckets of their own
    own = dense if apart else n
    padded = _padded_buffer(cfg, grid, holds, own) if par.zero else own
    bucket = _largest_bucket(cfg, grid, holds, moe, padded) if par.zero >= 2 else None
    # Muon's share (memory.optimizer): the blocks' matrices, the experts whole
    kind = getattr(getattr(cfg, "optim", None), "optimizer", "adamw")
    muon = kind == "muon"
    moments = 2 if getattr(getattr(cfg, "optim", None), "optimizer_state_dtype", "fp32") == "bf16" else None
    dense_matrices = int((blocks - experts) * matrix_fraction(m)) if muon else 0
    offload = bool(getattr(getattr(cfg, "optim", None), "optimizer_offload", False))
    # ZeRO-3's units outside the blocks: the token table's own (where it is one) and the
    # root (the rest: final norm, head, GPT-2's positions where the table is in it), which
    # is gathered from the final norm's forward only where it does not hold the table
    table = table_unit_parameters(cfg, grid, holds) if par.zero == 3 else 0
    root = stage_parameters(m, grid.tp, 0, holds[1], holds[2]) - table
    state = zero_state_bytes(own, dtype, par.zero, zero_shards(cfg, grid), padded=padded,
                             tensors=_parameter_tensors(cfg, holds, moe), bucket_mb=par.bucket_mb,
                             block_params=largest, blocks=holds[0], keep_gathered=keep,
                             in_blocks=blocks - (experts if apart else 0), largest_bucket=bucket, optimizer=kind,
                             matrices=dense_matrices + (0 if apart or not muon else experts), moment_bytes=moments,
                             alone=table, root=root if table or not holds[1] else 0, offload=offload)
    if apart:
        # the experts' own shards; their share of the gathered blocks is in the dense
        # call's (``largest`` is a whole block), and the staging is counted once, above
        xs = zero_state_bytes(experts, dtype, par.zero, expert_shards(cfg, grid), bucket_mb=par.bucket_mb,
                              keep_gathered=keep, in_blocks=experts, optimizer=kind,
                              matrices=experts if muon else 0, moment_bytes=moments, offload=offload)
        state = {k: state[k] + (xs[k] if k != "staging_bytes" else 0) for k in state}
    if table:
        # between uses the token table's parameters are zero-stride views of one zero
        # element (their backward reads no weight, yet autograd checks the gradient's
        # shape against them: parallel/zero3.py ``_free``)
        state["parameter_bytes"] += dtype.itemsize
    if par.zero == 3 and table and not m.n_experts and bucket and largest and bucket > largest:
        # the root (final norm and head) is the buffer's first bucket, reduce-scattered as
        # backward starts: beside the largest bucket's staging in flight (the last micro-
        # batch's token table, then this one's root) only a block's staging fills
        state["staging_bytes"] = (bucket + largest) * wide_bytes(dtype.itemsize)
    if par.zero == 3 and not m.n_experts and largest and root > largest and holds[1] and not table:
        # a dense model's root unit that holds the token table (tied to the head) is the
        # buffer's last bucket (the table's gradient comes at the end of backward), so its
        # reduce-scatter waits for every other bucket of the round: its staging is held
        # through backward beside the previous micro-batch's in flight (the two buffers
        # above) while a block's staging fills beside them (measured by the dry run; a
        # MoE model's step peak is held without it). A root without the table is the
        # buffer's first bucket, reduce-scattered as backward starts
        state["staging_bytes"] += largest * wide_bytes(dtype.itemsize)
    if getattr(getattr(cfg, "optim", None), "optimizer_offload", False) and cfg.training.device != "cpu":
        state["optimizer_bytes"] = 0  # in host memory (--optimizer-offload)
    return {"parameters": n, **state}


def table_unit_parameters(cfg: Config, grid: ProcessGrid, holds: tuple[int, bool, bool]) -> int:
    """The parameters of a rank's token table where ZeRO-3 makes it a unit of its own
    (training.trainer._table_unit): a stage that embeds, unless it also ends a model
    whose head is the table (tied) or that has multi-token prediction (which reads the
    table again after the blocks); else 0 (the table, if any, is in the root unit). Its
    unit is the embedding: the token table's rows of this tp rank, and GPT-2's position
    table."""
    _, embeds, ends = holds
    m = cfg.model
    if not embeds or (ends and (m.tie_embeddings or getattr(m, "mtp_layers", 0))):
        return 0
    return m.padded_vocab_size(grid.tp) // grid.tp * m.d_model + (m.seq_len * m.d_model if m.arch == "gpt2" else 0)


def expected_startup_bytes(cfg: Config, grid: ProcessGrid, rank: int) -> int:
    """A rank's peak while it starts, in the order the trainer builds it
    (gridtrain.checkpoint.materialise): its parameters (under ZeRO-3 its parameter shard,
    the master weights' dtype) filled piece by piece, beside one whole tensor in fp32 at
    a time, the largest of its stage *before* any split (a parameter is drawn whole, or
    read whole where a source cannot read slices, then cut to the rank's pieces), which
    goes before the gradient memory and the optimizer's state are allocated (torch's
    AdamW, fp32 and fp64 without ZeRO, allocates its state at the first step, not here).
    Under ZeRO-1/2 over more than one rank the parameters then move into the flat buffer
    the optimizer gathers into (held twice for a moment), before the gradient buffer
    exists; ZeRO-2/3 allocate no gradient memory until backward, and ZeRO-3 no master
    weights beside its shard (but with ``--optimizer-offload``). Nothing else of the
    model is ever whole on the rank, so start-up grows with the rank's share and with
    the largest single tensor (the token table or the head), not with the model. Host
    memory on the CPU; on a GPU the whole tensor is on the host."""
    state = expected_bytes(cfg, grid, rank)
    holds = _holds(cfg, grid, rank)
    whole = 4 * largest_parameter(cfg.model, 1, holds, moe_blocks_held(cfg, grid, rank))
    params, grads = state["parameter_bytes"], state["gradient_bytes"]
    # the flat optimizer allocates its state when built; torch's AdamW (fp32/fp64 without
    # ZeRO) at its first step
    o = getattr(cfg, "optim", None)
    zero = cfg.parallel.zero
    flat = zero > 0 or cfg.training.dtype not in ("fp32", "fp64") or \
        getattr(o, "optimizer", "adamw") == "muon" or getattr(o, "optimizer_state_dtype", "fp32") == "bf16"
    optim = state["optimizer_bytes"] if flat else 0
    # ZeRO-1/2's parameter buffer (the reducer's layout: padded as the gradients)
    bound = params * _padded_buffer(cfg, grid, holds, state["parameters"]) // max(state["parameters"], 1) \
        if zero in (1, 2) and zero_shards(cfg, grid) > 1 else 0
    return params + max(whole, bound, grads + optim)


def _largest_bucket(cfg: Config, grid: ProcessGrid, holds: tuple[int, bool, bool], moe_blocks: int,
                    dense: int) -> int | None:
    """The largest gradient bucket of a rank under ZeRO-2/3 (its staging buffers are
    buckets), from the reducer's layout (parallel/data_parallel.py ``bucket_bounds``),
    ``dense`` being the rank's dense parameters (padded) under ep > 1 and all of them at
    ep 1:

    * ZeRO-3 (a bucket per unit, no ``--bucket-mb`` cap): a block, or under ep > 1 a
      block's dense part or its ``E / ep`` experts, or the token table where it is a
      unit of its own (:func:`table_unit_parameters`), or the stage's root unit (its
      final norm and head, and the token table where it is not a unit);
    * ZeRO-2 (a bucket of one kind, closed by the parameter that reaches
      ``--bucket-mb``, no parameter split): at most the cap and one parameter
      (:func:`largest_parameter`: on the first and last stage, the token table or the
      head), at most a kind's whole (the dense parameters, one block's experts)."""
    m, tp, etp, apart = cfg.model, grid.tp, expert_tensor_parallel(cfg), experts_apart(cfg)
    w = wide_bytes(TORCH_DTYPES[cfg.training.dtype].itemsize)
    blocks, embeds, ends = holds
    moe_dense, experts = moe_block_parameters(m, tp, expert_parallel(cfg), etp) if m.n_experts else (0, 0)
    cap = int(cfg.parallel.bucket_mb * 2 ** 20) // w
    if cfg.parallel.zero == 3:
        table = table_unit_parameters(cfg, grid, holds)
        root = stage_parameters(m, tp, 0, embeds, ends) - table
        whole = [dense_block_parameters(m, tp)] if blocks > moe_blocks else []
        if moe_blocks:
            whole += [moe_dense, experts] if apart else [moe_dense + experts]
        return max([root, table, *whole])
    return min(max(dense, experts if moe_blocks and apart else 0),
               cap + largest_parameter(m, tp, holds, moe_blocks, etp))


def largest_parameter(m: ModelConfig, tp: int, holds: tuple[int, bool, bool], moe_blocks: int = 0,
                      etp: int = 1) -> int:
    """The largest parameter tensor of a tp rank holding ``holds`` (:func:`_holds`),
    ``moe_blocks`` of its blocks MoE blocks: the token table (or the head, or a tied
    table's copy, or multi-token prediction's copy of it) where it embeds or ends, GPT-2's
    position table, attention's largest projection (latent attention's: q or q_b, kv_b
    and proj by heads, q_a and kv_a whole), the dense MLP's matrices, an expert's (its
    ``1 / etp`` slice), the shared experts', multi-token prediction's ``[d, 2d]``
    projection."""
    blocks, embeds, ends = holds
    d = m.d_model
    sizes = [m.padded_vocab_size(tp) // tp * d if embeds or ends else 0,
             m.seq_len * d if m.arch == "gpt2" and embeds else 0,
             2 * d * d if ends and getattr(m, "mtp_layers", 0) else 0]
    if blocks and getattr(m, "mla", False):
        h = m.n_head
        sizes += [(m.q_lora_rank or d) * h * m.qk_head_dim // tp, m.kv_lora_rank * h * (m.qk_nope_head_dim
                  + m.v_head_dim) // tp, h * m.v_head_dim * d // tp, m.q_lora_rank * d,
                  (m.kv_lora_rank + m.qk_rope_head_dim) * d]
    elif blocks:
        sizes.append(d * m.n_head * m.head_dim // tp if m.arch == "llama" else 3 * d * d // tp)
    if blocks > moe_blocks:
        sizes.append(d * m.ffn_size // tp)
    if moe_blocks:
        sizes += [d * (m.moe_ffn_size // etp), d * m.moe_shared_experts * m.moe_ffn_size // tp]
    return max(sizes)


def _padded_buffer(cfg: Config, grid: ProcessGrid, holds: tuple[int, bool, bool], n: int) -> int:
    """ZeRO's gradient buffer (data_parallel.bucket_bounds): padded to a multiple of its
    shard group (:func:`zero_shards`) at its end, and a token table tied across pipeline
    stages in a bucket padded on its own (on the first and last stage)."""
    shards = zero_shards(cfg, grid)

    def up(x: int) -> int:
        return -(-x // shards) * shards

    _, embeds, ends = holds
    m = cfg.model
    # the table the first and last stage share: a tied head, or multi-token prediction's lookups
    if (m.tie_embeddings or getattr(m, "mtp_layers", 0)) and grid.pp > 1 and (embeds or ends):
        table = m.padded_vocab_size(grid.tp) // grid.tp * m.d_model
        return up(n - table) + up(table)
    return up(n)


def _parameter_tensors(cfg: Config, holds: tuple[int, bool, bool], moe_blocks: int = 0) -> int:
    """Parameter tensors of a rank holding ``holds`` (:func:`_holds`; AdamW keeps one
    step count per tensor), ``moe_blocks`` of its blocks MoE blocks: the MLP's tensors
    replaced by the router's weight, each of its ``E / ep`` experts' and the shared MLP's.
    Latent attention: q_a, its norm and q_b (or q), kv_a, its norm, kv_b and proj in the
    place of q, k, v and proj. Multi-token prediction, where it ends: per depth its block
    (among ``blocks``), three norms and the projection, and the table's copy on a stage
    that does not embed an untied model."""
    blocks, embeds, ends = holds
    m = cfg.model
    gpt2 = m.arch == "gpt2"
    # GPT-2: 2 LayerNorms x 2, 4 linears x (weight, bias); Llama: 2 RMSNorms, 7 linears
    n = (12 if gpt2 else 9) * blocks + (2 * blocks if getattr(m, "qk_norm", None) else 0)
    if getattr(m, "mla", False):
        n += blocks * (3 if m.q_lora_rank else 1)
    mlp = 4 if gpt2 else 3  # GPT-2: two linears with biases; Llama: gate, up, down
    n += moe_blocks * (1 - mlp + mlp * (m.n_experts // expert_parallel(cfg) + (m.moe_shared_experts > 0)))
    n += (2 if gpt2 else 1) if embeds else 0  # token (and position) table
    n += ((2 if gpt2 else 1) + (0 if cfg.model.tie_embeddings and embeds else 1)) if ends else 0
    depths = getattr(m, "mtp_layers", 0) if ends else 0
    n += 4 * depths + (1 if depths and not embeds and not m.tie_embeddings else 0)
    return n


# ---- activations ---------------------------------------------------------------------------------

def expected_activation_peak(cfg: Config, grid: ProcessGrid, rank: int, device_type: str, *,
                             weight_inputs: bool = False) -> float:
    """The formula's activation peak of a stage: the schedule's action list walked, each
    F adding and each B removing its chunk's bytes: the per-block bytes of
    activations.korthikanti_bytes (docs/memory.md) summed over the chunk's blocks, plus,
    for the chunk that ends the model, the head (the loss's fp32 softmax over the
    vocabulary slice dominates it); with full recomputation plus one region's rebuilt
    activations (held transiently in backward), with selective recomputation plus what
    one block's rebuilt attention core holds beyond what its backward has released
    (activations.rebuilt_core_bytes), and for the chunk that embeds, the token ids,
    positions and dropout mask of the embedding.
    Describes ``--attention math`` (the fused kernel keeps no s x s scores) and
    ``--recompute-keep-last`` off. Under context parallelism everything per token is for
    the rank's ``seq_len / cp`` tokens (the micro-batches are still the global batch's
    split over dp only). A MoE model's MoE blocks have their own bytes (layer_shape with
    ``layer``), with balanced routing.
    ``weight_inputs``: also what a zero-bubble schedule's deferred weight gradients keep
    from each B to its W (:func:`deferred_weight_input_bytes`; not saved tensors, so not
    the activation meter's: the planner adds it as a transient)"""
    m, t = cfg.model, cfg.training
    e = TORCH_DTYPES[t.dtype].itemsize
    sp = cfg.parallel.sequence_parallel and grid.tp > 1
    cp, cp_comm = cp_layout(cfg, grid)
    shape = activations.layer_shape(m, batch=t.micro_batch_size, tp=grid.tp, sequence_parallel=sp, element_bytes=e,
                                    mask_bytes=activations.dropout_mask_bytes(torch.device(device_type), e),
                                    cp=cp, cp_comm=cp_comm)
    # a MoE model's MoE blocks keep their router, routed rows and expert intermediates instead
    # of the dense MLP's (memory.moe.moe_activation_terms)
    moe_shape = activations.layer_shape(m, batch=t.micro_batch_size, tp=grid.tp, sequence_parallel=sp,
                                        element_bytes=e, mask_bytes=shape["mask_bytes"], cp=cp, cp_comm=cp_comm,
                                        layer=m.moe_layers[0], ep=expert_parallel(cfg),
                                        etp=expert_tensor_parallel(cfg)) if m.n_experts else shape

    def shape_of(i: int) -> dict:
        return moe_shape if m.is_moe_layer(i) else shape

    def shapes(c: ChunkSpec) -> list[dict]:  # the kinds of block a chunk has
        return [x for x in (shape, moe_shape) if any(shape_of(i) is x for i in c.layer_ids)] or [shape]
    stage = grid.coords(rank).pp
    micro_batches = t.global_batch_size // (t.micro_batch_size * grid.dp)
    actions = _forwards_and_backwards(cfg.parallel.schedule, grid.pp, micro_batches, cfg.parallel.vpp, stage)
    policy = policy_from(cfg.activations)
    chunks = chunks_of_stage(cfg, grid, stage)
    local = m.seq_len // cp  # the tokens of a sequence this rank holds
    tokens = local * t.micro_batch_size
    head = head_activation_bytes(cfg, grid.tp, sp, tokens, e)
    # the embedding: the token ids and positions its lookups keep (int64), under TP the
    # shifted ids and the out-of-range flags, and with dropout the mask
    sp_div = grid.tp if sp else 1
    positions = local // sp_div * 8 if m.arch == "gpt2" else 0  # Llama's are rotary (no lookup)
    embedding = tokens * 8 + positions + (tokens * 9 if grid.tp > 1 else 0) \
        + (tokens * m.d_model * shape["mask_bytes"] / sp_div if m.dropout > 0 else 0.0)
    # multi-token prediction (models/mtp.py) on the chunk that ends the model, per depth: the
    # shifted tokens' lookup (as the embedding's), their embedding (the first norm's input),
    # the projection's [d, 2d] input, the block (its input alone under full recomputation)
    # and a head and loss as the main one's; the main hidden state the second norm reads
    # is the head's already
    kept = {"full": "full", "selective": "selective"}.get(policy.mode, "none")
    mtp = sum(activations.korthikanti_bytes(recompute=kept, **shape_of(i)) + tokens * (8 + (9 if grid.tp > 1 else 0))
              + 3 * tokens * m.d_model * e / sp_div + head for i in mtp_blocks(m, True))
    cost = [sum(activations.expected_by_layer(policy.block_runs(c.layer_ids), policy.mode, micro_batches, False,
                                              shape_of=shape_of if m.n_experts else None, **shape).values())
            + (head + mtp if c.post_process else 0.0) + (embedding if c.pre_process else 0.0)
            for c in chunks]
    # with full recomputation, B rebuilds one region (the longest) on top of what is held;
    # its input is already counted (kept), and on the chunk that ends the model the
    # head's backward has released the softmax by then
    region = max((len(r) for c in chunks for r, redo in policy.block_runs(c.layer_ids) if redo), default=0)
    # (of a MoE model, the largest kind of block the chunk has)
    rebuilt = [max(region * activations.korthikanti_bytes(recompute="none", **x) for x in shapes(c))
               - activations.korthikanti_bytes(recompute="full", **shape) - (head if c.post_process else 0.0)
               if region else 0.0 for c in chunks]
    if policy.mode == "selective":  # B rebuilds one block's attention core at a time
        rebuilt = [max(0.0, max(activations.rebuilt_core_bytes(**x) for x in shapes(c))
                       - (head if c.post_process else 0.0)) if c.layer_ids else 0.0 for c in chunks]
    # zero-bubble schedules: from a chunk's B to its W each linear keeps its input and its
    # output's gradient (parallel/split_backward.py), whatever the recomputation
    deferred = [sum(deferred_weight_input_bytes(m, tokens, grid.tp, e, m.is_moe_layer(i) and bool(m.n_experts),
                                                expert_tensor_parallel(cfg)) for i in c.layer_ids) for c in chunks]
    held = peak = 0.0
    for kind, chunk in actions:  # what the schedule holds between each F and its B (and W), chunk by chunk
        if kind == F:
            held += cost[chunk]
            peak = max(peak, held)
        elif kind == B:
            peak = max(peak, held + rebuilt[chunk])
            held -= cost[chunk]
            if weight_inputs:
                held += deferred[chunk]
                peak = max(peak, held)
        else:
            held -= deferred[chunk]
    return peak


def deferred_weight_input_bytes(m: ModelConfig, tokens: int, tp: int, e: int, moe: bool, etp: int = 1) -> float:
    """What one block keeps from its B to its W under a zero-bubble schedule, for
    ``tokens`` tokens of a micro-batch on a tp rank: each linear's input (the attention's
    and the MLP's first linears read the whole sequence, gathered under SP) and its
    output's gradient. Attention: the input, the q/k/v projections' gradients, the output
    projection's input and gradient; MLP (a MoE block's routed experts: ``k`` rows a
    token): the input, gate and up's gradients, down's input and gradient."""
    d = m.d_model
    qkv = (m.n_head + 2 * m.kv_heads) * m.head_dim if not getattr(m, "mla", False) \
        else m.n_head * (m.qk_head_dim + m.qk_head_dim + m.v_head_dim)
    attention = 2 * d + (qkv + m.n_head * m.head_dim) / tp
    if moe:
        rows, width = m.moe_top_k, m.moe_ffn_size / etp
        mlp = rows * (2 * d + 3 * width) + 3 * m.moe_shared_experts * m.moe_ffn_size / tp + 2 * d
    else:
        mlp = 2 * d + 3 * m.ffn_size / tp
    return tokens * e * (attention + mlp)


def fuses_loss(cfg: Config, tp: int, tokens: int) -> bool:
    """Whether the run's summed loss over a micro-batch of ``tokens`` tokens goes through
    the fused, chunked head (models/head_loss.py), as ``Decoder.fuses_loss`` decides."""
    chunks = cfg.activations.loss_chunks
    if chunks is None:
        local_vocab = cfg.model.padded_vocab_size(tp) // tp
        return not (cfg.training.compile and tp == 1) and worth_fusing(tokens, local_vocab)
    return chunks > 0


def head_activation_bytes(cfg: Config, tp: int, sp: bool, tokens: int, e: int) -> float:
    """What the chunk that ends the model keeps for backward beyond its blocks, for a
    micro-batch of ``tokens`` tokens on this rank (per sequence-parallel rank: /tp).

    Unfused: the softmax over this rank's vocabulary slice in fp32 (kept by the cross
    entropy), the target index (int64) and two flags per token, the final norm's input
    and the head's input (a sequence shard under SP). Fused (head_loss.py): the final
    norm's input, and the gradients the forward already computed: the hidden states'
    (the whole sequence, in the model's dtype) and the head weight's (this rank's
    vocabulary rows, in fp32 or wider); or, where the micro-batch's logits' gradients fit
    the weight gradient's buffer (head_loss.defers_weight_gradient), instead of the
    weight's gradient those logits' gradients (this rank's vocabulary slice, in the
    model's dtype) and the head's input (the whole sequence), for its one GEMM in
    backward. No fp32 logits: a chunk's are freed in the forward."""
    m = cfg.model
    vocab, norm_input = m.padded_vocab_size(tp) // tp, tokens * m.d_model * e / (tp if sp else 1)
    if fuses_loss(cfg, tp, tokens):
        if defers_weight_gradient(tokens, m.d_model, e):
            return norm_input + 2 * tokens * m.d_model * e + tokens * vocab * e
        return norm_input + tokens * m.d_model * e + vocab * m.d_model * max(e, 4)
    return tokens * (vocab * 4 + 8 + 2) + 2 * norm_input


@lru_cache(maxsize=4096)
def _forwards_and_backwards(schedule: str, pp: int, micro_batches: int, vpp: int,
                            stage: int) -> tuple[tuple[str, int], ...]:
    """The (kind, chunk) of each F, B and W of one stage's action list, in order: all the
    activation walk reads. Cached: the planner walks thousands of layouts that share a
    few schedules, and building the action lists is most of a walk's time."""
    check_sizes(schedule, pp, micro_batches, vpp)
    # the stage's compute order alone: build_schedule adds only communication around it, for every stage
    return tuple((a.kind, a.chunk) for a in ORDERS[schedule](pp, micro_batches, vpp, stage) if a.kind in (F, B, W))
