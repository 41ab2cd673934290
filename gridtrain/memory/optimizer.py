"""What each optimizer keeps, and Muon's matrices, in closed form (optim/muon.py).

AdamW keeps two moments per parameter; Muon (``--optimizer muon``) one momentum buffer
per element of the blocks' 2-D weights and AdamW's two moments for the rest, beside the
flat master weights in every layout (optim/distributed_muon.py). What Muon takes is the
blocks' matrices: :func:`block_matrices` lists their one-process shapes (the shapes
Newton-Schulz runs on: GPT-2's QKV as Q, K and V), the same the planner's GEMMs read.
"""

from __future__ import annotations

from gridtrain.config import ModelConfig
from gridtrain.memory.moe import dense_block_parameters, moe_block_parameters
from gridtrain.models import mtp as multi_token


def block_matrices(m: ModelConfig, layer: int) -> list[tuple[int, int]]:
    """The one-process (rows, cols) of every matrix of block ``layer``: attention
    projections (latent attention's five), then the MLP's, or a MoE block's experts'
    (``E`` times gate, up, down) and its shared experts' (one MLP ``S x H`` wide); the
    router is AdamW's."""
    d = m.d_model
    if getattr(m, "mla", False):
        h = m.n_head
        q = [(m.q_lora_rank, d), (h * m.qk_head_dim, m.q_lora_rank)] if m.q_lora_rank else [(h * m.qk_head_dim, d)]
        attention = q + [(m.kv_lora_rank + m.qk_rope_head_dim, d), (h * (m.qk_nope_head_dim + m.v_head_dim),
                                                                     m.kv_lora_rank), (d, h * m.v_head_dim)]
    elif m.arch == "llama":
        a, kv = m.n_head * m.head_dim, m.kv_heads * m.head_dim
        attention = [(a, d), (kv, d), (kv, d), (d, a)]
    else:
        attention = [(d, d)] * 4
    if m.n_experts and m.is_moe_layer(layer):
        mlp = _mlp(m, m.moe_ffn_size) * m.n_experts + (_mlp(m, m.moe_shared_experts * m.moe_ffn_size)
                                                        if m.moe_shared_experts else [])
    else:
        mlp = _mlp(m, m.ffn_size)
    return attention + mlp


def mlp_matrices(m: ModelConfig, width: int) -> list[tuple[int, int]]:
    """An MLP's matrices, ``width`` wide (one expert's at the experts' width)."""
    return _mlp(m, width)


def _mlp(m: ModelConfig, width: int) -> list[tuple[int, int]]:
    d = m.d_model
    return [(width, d), (width, d), (d, width)] if m.arch == "llama" else [(width, d), (d, width)]


def model_matrices(m: ModelConfig) -> list[tuple[tuple[int, int], int]]:
    """Every Muon matrix of the model (one process) as (shape, how many): its blocks', and
    per multi-token prediction depth its block's and its ``[d, 2d]`` projection."""
    layers = [*range(m.n_layer), *(multi_token.layer_ids(m) if getattr(m, "mtp_layers", 0) else [])]
    moe = sum(1 for i in layers if m.n_experts and m.is_moe_layer(i))
    kinds = [(i, n) for i, n in ((_first(m, True), moe), (_first(m, False), len(layers) - moe)) if n]
    counts: dict[tuple[int, int], int] = {}
    for layer, n in kinds:
        for shape in block_matrices(m, layer):
            counts[shape] = counts.get(shape, 0) + n
    depths = getattr(m, "mtp_layers", 0)
    if depths:
        shape = (m.d_model, 2 * m.d_model)
        counts[shape] = counts.get(shape, 0) + depths
    return list(counts.items())


def _first(m: ModelConfig, moe: bool) -> int:
    """A layer of the kind (a MoE block or a dense one; any layer of a dense model)."""
    return next((i for i in range(m.n_layer) if bool(m.n_experts and m.is_moe_layer(i)) == moe), 0)


_FRACTIONS: dict[str, float] = {}


def matrix_fraction(m: ModelConfig) -> float:
    """The share of the blocks' dense parameters (all but a MoE block's routed experts)
    that are Muon's: the rest are norms, biases and routers."""
    key = repr(m)
    if key not in _FRACTIONS:
        moe_layers = sum(1 for i in range(m.n_layer) if m.n_experts and m.is_moe_layer(i))
        dense_layers = m.n_layer - moe_layers
        total = sum(r * c for r, c in block_matrices(m, _first(m, False))) * dense_layers
        params = dense_block_parameters(m) * dense_layers
        if moe_layers:
            dense_part, experts = moe_block_parameters(m)
            total += (sum(r * c for r, c in block_matrices(m, _first(m, True))) - experts) * moe_layers
            params += dense_part * moe_layers
        _FRACTIONS[key] = total / params if params else 0.0
    return _FRACTIONS[key]


def optimizer_state_bytes(optimizer: str, owned: int, matrices: int, *, masters: bool, element: int,
                          moment_element: int | None = None) -> int:
    """The flat optimizer's state for ``owned`` shard elements of which ``matrices`` are
    Muon's: master weights of ``element`` bytes (unless the parameter shard is the
    master: ``masters`` False) and, of ``moment_element`` bytes (default ``element``),
    two moments per element, or under Muon two per AdamW element and one per Muon
    element (Muon keeps no state for the padding)."""
    moments = 2 * owned if optimizer != "muon" else 2 * (owned - matrices) + matrices
    return element * (owned if masters else 0) + (moment_element or element) * moments
