"""Mixtures of experts in closed form: parameters, FLOPs, what a rank holds and sends.

A MoE block (``ModelConfig.is_moe_layer``) is the dense block with its MLP replaced by
a router (a ``[E, d]`` weight, replicated over tp and dp, computed in the model dtype, its
softmax in fp32), ``E`` expert MLPs of width ``H`` (``moe_ffn_size``; Llama: SwiGLU,
``3 d H`` weights, no bias; GPT-2: GELU, ``2 d H + H + d``) and, with ``S`` shared
experts, one dense MLP of width ``S H`` that every token goes through, split over tp as
the dense MLP is. Experts are not split over tp: every tp rank holds whole experts, and
under sequence parallelism routes its own ``1/tp`` of the tokens (without it the tp ranks
route the same tokens, redundantly). Expert parallelism (``ep``) splits each MoE layer's
experts over ``ep`` consecutive members of a ``dp x cp`` group (the same tp and pp
coordinates): ``E / ep`` experts a rank. Their gradients are reduced, ZeRO-1 shards their
optimizer state, over the expert-data-parallel group, the other ``dp cp / ep`` ranks
holding the same experts; the dense parameters over all ``dp x cp``.

Per MoE layer and micro-batch a rank routes ``N`` tokens (its ``b S / cp``, ``/ tp``
under sequence parallelism) to ``k`` experts each: ``N k`` rows of ``d`` elements go to
the experts' ranks by an all-to-all (dispatch) and come back by another (combine); the
backward runs both again, full recomputation repeats the forward's. With balanced
routing ``(ep - 1) / ep`` of the rows leave the rank, and each rank's experts process
``N k`` rows in all (``N k ep / E`` per expert), as grouped GEMMs (one per weight kind
for all ``E / ep`` experts; fp64 runs one GEMM per expert). Beside them a tiny
all-to-all of the ``E`` counts (whose values the host reads under ep > 1: one
synchronisation per layer and micro-batch; none at ep 1, where the grouped GEMMs take
the counts on the device) and an all-reduce of ``2 E`` routing
statistics (fp64 counts and probability sums) over ``dp x cp`` (and tp under sequence
parallelism).

Model FLOPs count the active parameters: attention as the dense model's, the router's
``2 d E``, ``k`` expert MLPs and the shared MLP per token (:func:`model_flops_per_token`).

These forms are kept apart from the runtime (models/, parallel/) so that the memory
model, the planner (which times them) and the runtime's tests hold one definition, as
:mod:`gridtrain.memory.cp` and :mod:`gridtrain.memory.zero` do.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from gridtrain.config import ModelConfig
from gridtrain.memory.cp import wide_bytes
from gridtrain.models.decoder import block_parameters, count_parameters, training_flops_per_token

INDEX_BYTES = 8  # an int64 index
# index tensors of N k entries a MoE layer keeps for backward (parallel/experts.py): the
# top-k's choices, the permutation's rows (order // k), the combine's gather of the weights
# (order) and its sum back into tokens (order // k again); under ep > 1 the regrouping of
# the received rows keeps one more
ROUTING_INDICES = 4


# ---- parameters -----------------------------------------------------------------------------------


def dense_model(m: ModelConfig) -> ModelConfig:
    """The same model without experts: every block a dense one (``m`` itself when it has
    none)."""
    return dataclasses.replace(m, n_experts=0) if m.n_experts else m


def mlp_parameters(m: ModelConfig, width: int, tp: int = 1) -> int:
    """An MLP of ``width`` on one tp rank, split as the dense MLP is: Llama's gate, up and
    down (no biases); GPT-2's expansion (weight and bias) and projection (weight split,
    bias whole)."""
    d = m.d_model
    if m.arch == "llama":
        return 3 * d * width // tp
    return (d * width + width) // tp + width * d // tp + d


def expert_parameters(m: ModelConfig, etp: int = 1) -> int:
    """One expert's MLP on one rank: whole (experts are not split over tp), or under expert
    tensor parallelism (``etp`` > 1, SwiGLU) its ``1 / etp`` slice: gate and up by rows,
    down by columns, ``3 d H / etp``."""
    return mlp_parameters(m, m.moe_ffn_size // etp)


def router_parameters(m: ModelConfig) -> int:
    """The router's ``[E, d]`` weight (no bias), whole on every rank."""
    return m.n_experts * m.d_model


def shared_expert_parameters(m: ModelConfig, tp: int = 1) -> int:
    """The shared experts: one MLP of width ``S H`` on one tp rank (none when S = 0)."""
    return mlp_parameters(m, m.moe_shared_experts * m.moe_ffn_size, tp) if m.moe_shared_experts else 0


def qk_norm_parameters(m: ModelConfig, tp: int = 1) -> int:
    """The query and key norms' weights on one tp rank, where
    ``models.decoder.block_parameters`` does not count them already: ``head`` (Qwen3) one
    ``head_dim`` weight each, whole; ``full`` (OLMoE) one over all query heads and one
    over all key/value heads, split over tp as the heads are."""
    if m.arch != "llama" or not getattr(m, "qk_norm", None):
        return 0
    if block_parameters(m, tp) != block_parameters(dataclasses.replace(m, qk_norm=None), tp):
        return 0  # counted by the model's own block count
    if m.qk_norm == "head":
        return 2 * m.head_dim
    return (m.n_head * m.head_dim + m.kv_heads * m.head_dim) // tp


def dense_block_parameters(m: ModelConfig, tp: int = 1) -> int:
    """A dense block of ``m`` on one tp rank (q/k norms included)."""
    if not m.n_experts and not getattr(m, "qk_norm", None):
        return block_parameters(m, tp)
    dense = dense_model(m)
    return block_parameters(dense, tp) + qk_norm_parameters(dense, tp)


def moe_block_parameters(m: ModelConfig, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
    """A MoE block on one tp and ep rank, as (dense part, experts): attention, norms,
    router and shared MLP (the dense part, reduced over ``dp x cp``), and the rank's
    ``E / ep`` experts, each its ``1 / etp`` slice (reduced over the expert-data-parallel
    group)."""
    dense = dense_block_parameters(m, tp) - mlp_parameters(m, m.ffn_size, tp) + router_parameters(m) \
        + shared_expert_parameters(m, tp)
    return dense, m.n_experts // ep * expert_parameters(m, etp)


def layer_parameters(m: ModelConfig, layer: int, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
    """Block ``layer`` on one tp and ep rank, as (dense part, experts)."""
    if m.is_moe_layer(layer):
        return moe_block_parameters(m, tp, ep, etp)
    return dense_block_parameters(m, tp), 0


def mtp_layers(m: ModelConfig) -> range:
    """The multi-token prediction modules' blocks (models/mtp.py): layers ``n_layer`` ..
    ``n_layer + N - 1``, MoE where ``is_moe_layer`` says so; none without MTP."""
    return range(m.n_layer, m.n_layer + getattr(m, "mtp_layers", 0))


def moe_total_parameters(m: ModelConfig, mtp: bool = True) -> int:
    """Parameters of the whole (unpadded) model, every expert counted: embedding, blocks,
    final norm and (untied) head; with ``mtp`` (as ``models.decoder.count_parameters``)
    the multi-token prediction modules: per depth three norms, the ``[d, 2d]``
    projection and a block (published sizes leave them out: ``mtp=False``)."""
    dense = dense_model(m)
    outside = count_parameters(dense, mtp=False) - m.n_layer * block_parameters(dense)
    blocks = range(m.n_layer + (len(mtp_layers(m)) if mtp else 0))
    depths = len(mtp_layers(m)) if mtp else 0
    return outside + sum(sum(layer_parameters(m, i)) for i in blocks) + depths * (3 * m.d_model + 2 * m.d_model ** 2)


def moe_active_parameters(m: ModelConfig, mtp: bool = True) -> int:
    """Parameters one token goes through: :func:`moe_total_parameters` with ``k`` of the
    ``E`` experts of each MoE layer (the router and the shared experts included; the
    multi-token prediction blocks' too, with ``mtp``)."""
    unused = (m.n_experts - m.moe_top_k) * expert_parameters(m) if m.n_experts else 0
    layers = len(m.moe_layers) + (sum(map(m.is_moe_layer, mtp_layers(m))) if mtp else 0)
    return moe_total_parameters(m, mtp) - layers * unused


# ---- FLOPs ----------------------------------------------------------------------------------------


def mlp_flops_per_token(m: ModelConfig, width: int) -> float:
    """Forward matmul FLOPs of one token through an MLP of ``width``: SwiGLU three
    ``d x width`` matrices, GELU two."""
    return (6.0 if m.arch == "llama" else 4.0) * m.d_model * width


def model_flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token (forward and backward, 3x the forward, no recomputation),
    counting active parameters: the dense model's (``models.decoder.
    training_flops_per_token``: latent attention's own, the multi-token prediction
    depths' blocks, projections and heads) with each MoE layer's MLP (the MTP blocks'
    too) replaced by the router (``2 d E``), ``k`` expert MLPs and the shared MLP. The
    dense model's own for a model without experts."""
    if not m.n_experts:
        return training_flops_per_token(m)
    per_moe_layer = 2.0 * m.d_model * m.n_experts + mlp_flops_per_token(m, m.moe_ffn_size) \
        * (m.moe_top_k + m.moe_shared_experts) - mlp_flops_per_token(m, m.ffn_size)
    layers = len(m.moe_layers) + sum(map(m.is_moe_layer, mtp_layers(m)))
    return training_flops_per_token(dense_model(m)) + 3.0 * layers * per_moe_layer


# ---- what a rank routes and sends -----------------------------------------------------------------


def routed_tokens(micro_batch_size: int, seq_len: int, *, tp: int = 1, cp: int = 1,
                  sequence_parallel: bool = False) -> int:
    """Tokens a rank routes per MoE layer and micro-batch: its ``b S / cp``, a ``1 / tp``
    shard of them under sequence parallelism."""
    tokens = micro_batch_size * seq_len // cp
    return tokens // tp if sequence_parallel and tp > 1 else tokens


def all_to_all_payload(tokens: int, top_k: int, d_model: int, element_bytes: int) -> int:
    """Bytes of one dispatch (or combine) all-to-all's send buffer: ``tokens x k`` rows of
    ``d`` elements, the rank's own rows included (what ``comm.all_to_all`` counts)."""
    return tokens * top_k * d_model * element_bytes


def all_to_all_bytes(tokens: int, top_k: int, d_model: int, ep: int, element_bytes: int) -> float:
    """Bytes one dispatch (or combine) all-to-all sends off the rank, with balanced
    routing: ``(ep - 1) / ep`` of its payload goes to the other ranks of the ep group
    (none with ep = 1: no all-to-all)."""
    return all_to_all_payload(tokens, top_k, d_model, element_bytes) * (ep - 1) / ep


class MoeTraffic(NamedTuple):
    """A rank's expert-parallel all-to-alls of rows in a step, balanced routing."""

    payload: int  # one dispatch or combine of one MoE layer and micro-batch: its send buffer
    sent: float  # of which off the rank: (ep - 1) / ep
    forward: int  # all-to-alls in one MoE layer's forward: dispatch and combine (twice with full recomputation)
    backward: int  # in its backward: the two again, reversed
    count: int  # in a step: every MoE layer the rank holds, every micro-batch

    @property
    def step_payload(self) -> int:
        return self.count * self.payload

    @property
    def step_sent(self) -> float:
        return self.count * self.sent


def moe_step_all_to_all(m: ModelConfig, *, micro_batch_size: int, micro_batches: int, moe_layers: int, tp: int = 1,
                        cp: int = 1, ep: int = 1, sequence_parallel: bool = False, element_bytes: int = 2,
                        recompute_full: bool = False) -> MoeTraffic:
    """The all-to-alls of rows of a rank holding ``moe_layers`` MoE layers, with
    ``micro_batches`` micro-batches of ``micro_batch_size`` sequences a step: each one's
    payload and bytes off the rank, how many a layer's forward and backward run and how
    many a step does. None with ep = 1. Left out: the routing counts' all-to-all (``E``
    int64 a layer's forward) and the statistics' all-reduce (``2 E`` fp64)."""
    if ep == 1:
        return MoeTraffic(0, 0.0, 0, 0, 0)
    n = routed_tokens(micro_batch_size, m.seq_len, tp=tp, cp=cp, sequence_parallel=sequence_parallel)
    payload = all_to_all_payload(n, m.moe_top_k, m.d_model, element_bytes)
    forward = 4 if recompute_full else 2
    return MoeTraffic(payload, payload * (ep - 1) / ep, forward, 2, micro_batches * moe_layers * (forward + 2))


def edp_size(dp: int, cp: int, ep: int, etp: int = 1, folded_tp: int = 1) -> int:
    """The expert-data-parallel group: the ranks holding the same expert slices, ``dp x cp
    / (ep x etp)``; where the expert grid is folded over the tp ranks too
    (``grid.ProcessGrid.folds_experts``: ``folded_tp`` the tp size), ``tp x dp x cp / (ep x
    etp)``."""
    return folded_tp * dp * cp // (ep * etp)


# ---- activations ----------------------------------------------------------------------------------


def moe_activation_terms(m: ModelConfig, *, tp: int = 1, sequence_parallel: bool = False,
                         element_bytes: int = 2, ep: int = 1, etp: int = 1) -> dict[str, float]:
    """Bytes a MoE layer saves for backward beyond its attention, per token of the rank's
    sequence shard (:mod:`gridtrain.memory.activations` multiplies by the tokens), with
    balanced routing (a rank's experts receive as many rows as it sends). They take the
    place of the dense MLP's intermediates (parallel/experts.py, models/moe.py):

    * ``router``: the softmax's fp32 probabilities ``[N, E]`` (a sigmoid router's scores,
      and the fp32 sum per token that turns them into probabilities), per routed row the
      top-k probability in fp32 and the combine weight in the model dtype, and with
      ``moe_norm_topk`` the renormalisation's fp32 sum per token;
    * ``indices``: ``ROUTING_INDICES`` int64 indices per routed row, one more under
      ep > 1 (the received rows' regrouping);
    * ``rows``: tensors of ``[N k, d]``: the rows the experts run on (their first linears
      keep them), the rows that come back (the weighting keeps them for the router's
      gradient) and the weighted rows (``index_add``, the sum into tokens, keeps its
      source); under ep > 1 also the experts' outputs put back in send order
      (``index_copy`` keeps its source);
    * ``experts``: the expert MLPs' intermediates over ``[N k, H]``, as the dense MLP
      formula counts them (SwiGLU 4, GELU 2 per element);
    * ``shared``: the shared MLP's, over ``S H / tp`` per token (every token).

    ``N`` is a ``1 / tp`` share of the tokens under sequence parallelism (each tp rank
    routes its own) and all of them without (the tp ranks repeat the work), so all but
    ``shared`` are divided by tp only under SP.

    Expert tensor parallelism (``etp`` > 1): the etp group pools its members' rows (and
    their combine weights) before the dispatch, so everything kept per routed row but the
    top-k's choices and probabilities is over ``etp`` times the rank's own rows (the rows,
    the combine weights, the permutation's, gather's and sum's indices), while the
    experts' intermediates stay the same bytes (``etp`` times the rows, ``H / etp`` wide).
    Measured on the runtime's own layer (the dry run, tests/test_planner_moe.py) these are
    exact (beyond them a few ``[E]`` vectors of the balance losses)."""
    e, w = element_bytes, wide_bytes(element_bytes)
    k, d, h = m.moe_top_k, m.d_model, m.moe_ffn_size
    sp = tp if sequence_parallel else 1
    per_element = 4 if m.arch == "llama" else 2
    apart = int(ep > 1)
    norm = w if getattr(m, "moe_norm_topk", True) else 0
    sigmoid = w if getattr(m, "moe_router", "softmax") == "sigmoid" else 0
    pooled = ROUTING_INDICES - 1 + apart  # per routed row: indices over the etp group's pooled rows
    return {"router": (w * m.n_experts + sigmoid + k * (w + e * etp) + norm) / sp,
            "indices": (1 + pooled * etp) * INDEX_BYTES * k / sp,
            "rows": (3 + apart) * k * d * e * etp / sp,
            "experts": per_element * e * k * h / sp,
            "shared": per_element * e * m.moe_shared_experts * h / tp}


def moe_mlp_bytes_per_token(m: ModelConfig, **kw) -> float:
    """:func:`moe_activation_terms` summed: what a MoE layer keeps in the place of the
    dense MLP's ``(4|2) e ffn / tp`` per token."""
    return sum(moe_activation_terms(m, **kw).values())
