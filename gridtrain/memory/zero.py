"""ZeRO in closed form: what a rank holds and what it sends per step, stage by stage.

ZeRO (Rajbhandari et al., 2020) shards the training state over the ``dp x cp`` ranks that
hold the same parameters: stage 1 the optimizer's state (fp32 master weights and Adam's
two moments), stage 2 also the gradients, stage 3 also the parameters, which are then
gathered block by block while they are used (as FSDP does). With ``--zero-shard-size s``
the state is sharded within groups of ``s`` consecutive dp (x cp) ranks and replicated
across the ``dp cp / s`` groups (hybrid sharding, HSDP): every ``/ s`` below is over the
group, and each step adds one all-reduce of the rank's gradient shard across the groups.

For ``P`` parameters of a rank (one pipeline stage's, after tp), parameters of ``e`` bytes
(2 for bf16 and fp16, 4 for fp32, 8 for fp64), gradients and master weights of ``w`` bytes
(4, or 8 in fp64), held all along (between steps):

* stage 0: parameters ``e P``; gradients ``w P`` (the reducer's buffer); optimizer: in
  fp32 and fp64 torch's AdamW, two moments ``2 e P`` and a 4-byte step count per tensor,
  in 16-bit the flat optimizer's master weights and moments ``3 w P``;
* stage 1: ``e P`` (the parameters are views of one flat buffer laid out as the
  gradients, into which the optimizer all-gathers the updated weights in place); ``w P``
  (one buffer, each bucket reduce-scattered in place into the rank's own slice);
  ``3 w P / s``, master weights included in every dtype;
* stage 2: ``e P`` (the same flat buffer); no gradient memory between steps;
  ``3 w P / s``;
* stage 3: ``w P / s``, the rank's parameter shard, in the master weights' dtype: it *is*
  the optimizer's master (fp32, fp64 for fp64 runs), cast to the parameters' dtype as it
  is gathered; no gradient memory between steps; ``2 w P / s``, the moments. With
  ``--optimizer-offload`` the shard stays in the parameters' dtype (``e P / s``) and the
  masters and moments are in host memory.

ZeRO-2 and 3's gradient shard (``w P / s``: :func:`zero_state_bytes`' ``gradient_shard_bytes``)
exists only within a step: each bucket's slice of it is allocated when the bucket's
first reduce-scatter is launched in backward, and all of it is freed after the optimizer
step. It grows bucket by bucket through the step's first backward of each micro-batch
round 0 (with more than one micro-batch it is whole from the end of the first backward
on) and is whole at the end of backward.

Beside them, transiently within a step (:func:`zero_state_bytes`' ``gathered_bytes`` and
``staging_bytes``): ZeRO-2 and 3 add each micro-batch's gradients into staging buffers of
a bucket (``--bucket-mb``, in ``w`` bytes, or the whole gradient where that is smaller;
under ZeRO-3 a bucket is a unit) that are reduce-scattered as they fill, about
``STAGING_BUCKETS`` of them at once (the one filling and the one in flight); ZeRO-3 holds
the parameters it has gathered, in ``e`` bytes: two blocks (the one running and the one
prefetched) and the root unit (the stage's final norm and head, and what is neither a
block nor the token table's own unit), or, with ``--zero3-keep-gathered``, the whole
stage from its first forward to its last backward. A token table that is a unit of its
own (not tied to the head on the same stage, no multi-token prediction) is gathered for
its forward only, at the step's start, when nothing else is held: not part of the
gathered set beside the activations (``alone``).

Nothing is allocated when the optimizer publishes the weights: ZeRO-1/2 all-gather them
in place into the parameters' flat buffer, ZeRO-3 writes its shard, which is the master.

Under expert parallelism (``ep`` > 1) a rank's experts are in buckets of their own, and
every form here applies twice: to the dense parameters over the ``dp x cp`` shard group
and to the experts over their expert-data-parallel group (the ``dp x cp / ep`` ranks
holding the same experts; memory/model.py, planner/cost.py). ZeRO-3's gathered blocks
are whole blocks either way (a MoE block's dense bucket and its expert bucket, each
gathered over its group), and the staging buffers are buckets of one kind.

Per step, with ``m`` micro-batches per rank (:func:`zero_step_collectives`): stage 0
all-reduces the gradients once; stage 1 reduce-scatters them once and all-gathers the
updated parameters once; stage 2 reduce-scatters each micro-batch's gradients (``m``
times) and gathers once; stage 3 gathers every parameter before each forward and again
before each backward (``2 m``; once a step when kept gathered) and reduce-scatters ``m``
times.

These forms are kept apart from the runtime (optim/, parallel/fully_sharded.py) so that
the memory model, the planner (which times the collectives) and the runtime's tests (which
count what its reducers allocate and send) hold one definition, as memory/cp.py does for
context parallelism.
"""

from __future__ import annotations

from typing import NamedTuple

from gridtrain.config import ZERO_STAGES
from gridtrain.memory.cp import wide_bytes
from gridtrain.memory.optimizer import optimizer_state_bytes
from gridtrain.parallel.distributed import TORCH_DTYPES

STAGING_BUCKETS = 2  # gradient staging buffers a ZeRO-2/3 rank holds at once, about
GATHERED_BLOCKS = 2  # blocks a ZeRO-3 rank holds gathered: the running one and the prefetched one


class Collective(NamedTuple):
    """Collectives of one kind and purpose in a step: ``count`` of them, each of ``nbytes``
    (the whole tensor: a reduce-scatter's input, an all-gather's output) over ``ranks``."""

    kind: str  # all_reduce | reduce_scatter | all_gather
    count: int
    nbytes: int
    ranks: int


def element_bytes(dtype) -> int:
    """Bytes of a parameter of ``dtype``: a name (bf16, fp16, fp32, fp64) or a torch dtype."""
    return (TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype).itemsize


def _check(zero: int, shard: int) -> None:
    if zero not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage {zero} is not one of {ZERO_STAGES}")
    if shard < 1:
        raise ValueError(f"a ZeRO shard group needs at least one rank, not {shard}")


def zero_state_bytes(params: int, dtype, zero: int, shard: int, *, padded: int | None = None, tensors: int = 0,
                     bucket_mb: float = 25.0, block_params: int = 0, blocks: int = 0,
                     keep_gathered: bool = False, in_blocks: int | None = None,
                     largest_bucket: int | None = None, optimizer: str = "adamw",
                     matrices: int = 0, moment_bytes: int | None = None, alone: int = 0, root: int = 0,
                     offload: bool = False) -> dict[str, int]:
    """Bytes a rank holds for ``params`` parameters of ``dtype`` under ZeRO stage ``zero``
    with its state sharded over ``shard`` ranks (the table of the module docstring):
    ``parameter_bytes``, ``gradient_bytes``, ``optimizer_bytes`` (held all along, between
    steps too) and, within a step, ``gradient_shard_bytes`` (ZeRO-2/3's gradient shard,
    from backward to the optimizer step), ``gathered_bytes`` (ZeRO-3's gathered
    parameters) and ``staging_bytes`` (ZeRO-2/3's gradient staging buffers).

    ``padded``: the flat buffer's length, a multiple of ``shard`` (default ``params``
    rounded up to one), whose ``padded / shard`` elements a rank owns; ``tensors``: the
    parameter tensors (torch's AdamW keeps a 4-byte step count per tensor: stage 0 in
    fp32 and fp64); ``bucket_mb``: a gradient bucket in MiB; ``block_params`` and
    ``blocks``: one transformer block's parameters and how many of ``params`` are in
    blocks (ZeRO-3 gathers two of them at a time; the rest of ``params`` is gathered
    while the stage runs); ``keep_gathered``: ZeRO-3 keeps all ``params`` gathered;
    ``in_blocks``: how many of ``params`` are in blocks where the blocks differ (a MoE
    model's; ``block_params`` is then the largest block's; default ``blocks x
    block_params``); ``alone``: how many of the rest are a unit gathered on its own
    when nothing else is (the token table's unit, for its forward at the step's start),
    left out of ``gathered_bytes``; ``root``: how many of the rest are a root unit
    gathered only from the final norm's forward to the head's backward (where the table
    is a unit of its own) and freed once its gradients are in, before the blocks'
    backward gathers them: ``gathered_bytes`` is then that unit or the two blocks (and
    what else is outside them), the larger; ``largest_bucket``: the largest gradient bucket's
    elements, where the caller knows the layout's buckets (memory/model.py; default:
    ``bucket_mb``, or the whole buffer where that is smaller); ``optimizer`` ``muon``:
    Muon for ``matrices`` of ``params`` (memory.optimizer: the flat optimizer in every
    layout, one buffer per Muon element, two moments per AdamW element);
    ``moment_bytes``: 2 for bf16 moments (``--optimizer-state-dtype bf16``: the flat
    optimizer in every layout, masters as before), default the masters' width;
    ``offload``: ``--optimizer-offload``, where ZeRO-3's parameter shard stays in the
    parameters' dtype beside masters of their own (the caller counts the optimizer's
    state off the device)."""
    _check(zero, shard)
    e = element_bytes(dtype)
    w = wide_bytes(e)
    if padded is None:
        padded = -(-params // shard) * shard
    owned = padded // shard
    full_precision = e >= 4  # fp32 and fp64: no separate master copy where ZeRO allows
    # ZeRO-3's parameter shard is the master (in its dtype), unless offloaded in a narrower one
    shard_is_master = zero == 3 and (full_precision or not offload)
    if optimizer == "muon" or moment_bytes is not None:  # the flat optimizer whatever the stage
        held = owned if zero else params  # ZeRO 0: every rank all of it
        mine = matrices * held // params if params else 0  # the share of the Muon matrices
        state = optimizer_state_bytes(optimizer, held, mine, masters=not shard_is_master, element=w,
                                      moment_element=moment_bytes or w)
    elif zero == 0:
        state = 2 * params * e + 4 * tensors if full_precision else 3 * params * w
    elif shard_is_master:
        state = 2 * owned * w  # two moments: the parameter shard is the master
    else:
        state = 3 * owned * w
    gathered = 0
    if zero == 3:
        in_blocks = blocks * block_params if in_blocks is None else in_blocks
        gathered = params if keep_gathered else \
            max(min(blocks, GATHERED_BLOCKS) * block_params + params - in_blocks - alone - root, root)
    bucket = min(int(bucket_mb * 2 ** 20), padded * w) if largest_bucket is None else largest_bucket * w
    staging = STAGING_BUCKETS * bucket if zero >= 2 else 0
    return {"parameter_bytes": owned * (w if shard_is_master else e) if zero == 3 else params * e,
            "gradient_bytes": {0: params, 1: padded}.get(zero, 0) * w,
            "optimizer_bytes": state,
            "gradient_shard_bytes": owned * w if zero >= 2 else 0,
            "gathered_bytes": gathered * e,
            "staging_bytes": staging}


def zero_step_collectives(params: int, dtype, zero: int, micro_batches: int, group: int, *,
                          shard: int | None = None, keep_gathered: bool = False) -> dict[str, Collective]:
    """The collectives of one optimizer step on the gradient path of a rank holding
    ``params`` parameters, under ZeRO stage ``zero``, the gradients reduced over
    ``group`` (dp x cp) ranks and the state sharded over ``shard`` of them (default: all),
    with ``micro_batches`` micro-batches per step:

    * ``gradients``: stage 0 one all-reduce of the ``w P`` gradient bytes over the group;
      stage 1 one reduce-scatter over the shard group; stages 2 and 3 one per micro-batch;
    * ``parameters``: the all-gather of the ``e P`` parameter bytes over the shard group:
      once per step (stages 1 and 2, after the optimizer; stage 3 kept gathered, before
      the first forward), twice per micro-batch for stage 3 (before its forward and
      before its backward);
    * ``replicas``: with ``shard < group`` (HSDP), one all-reduce of the rank's gradient
      shard (``w P / shard`` bytes) across the ``group / shard`` groups.

    Nothing where the group is one rank."""
    shard = group if shard is None else shard
    _check(zero, shard)
    if group % shard:
        raise ValueError(f"a ZeRO shard group of {shard} ranks does not divide the {group} data-parallel ranks")
    if group == 1:
        return {}
    e = element_bytes(dtype)
    w = wide_bytes(e)
    grads = params * w
    if zero == 0:
        return {"gradients": Collective("all_reduce", 1, grads, group)}
    out = {"gradients": Collective("reduce_scatter", 1 if zero == 1 else micro_batches, grads, shard),
           "parameters": Collective("all_gather", 2 * micro_batches if zero == 3 and not keep_gathered else 1,
                                    params * e, shard)}
    if shard < group:
        out["replicas"] = Collective("all_reduce", 1, -(-params // shard) * w, group // shard)
    return out
