"""Context parallelism in closed form: the bytes a cp rank's attention sends, step by step.

Under context parallelism (``--cp C``) each sequence is cut into ``2C`` chunks and cp rank
``r`` holds chunks ``r`` and ``2C - 1 - r`` (gridtrain/parallel/context_parallel.py), so
every rank holds ``L = S / C`` tokens and does the same causal work. Its queries need the
keys and values of every rank; how they travel is ``--cp-comm``:

* ``ring``: the key/value block (kv heads only, this tp rank's share) passes around the
  cp ring, one point-to-point send to the next rank per step while the step's attention
  runs; the backward passes the blocks around again, each with its gradient accumulator
  (in the accumulation dtype), which after the last step reaches the block's owner;
* ``allgather``: one all-gather of every rank's keys and values (the local block is
  attended while it travels), one reduce-scatter of their gradients.

These forms are kept apart from the runtime so that the planner (which times them), the
memory model and the runtime's tests (which count the bytes its sends and collectives
move) hold one definition.
"""

from __future__ import annotations

from gridtrain.config import CP_COMM_MODES


def wide_bytes(element_bytes: int) -> int:
    """Bytes of the accumulation dtype for a compute dtype of ``element_bytes``: fp32 for
    bf16, fp16 and fp32, fp64 for fp64 (scores, log-sum-exps and key/value gradients)."""
    return max(element_bytes, 4)


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """Key/value heads one tp rank holds: its share, or one replicated head when tp
    exceeds them."""
    return max(kv_heads // tp, 1)


def kv_elements(batch: int, local_tokens: int, kv_heads: int, head_dim: int) -> int:
    """Elements of one rank's key/value block: k and v for its ``local_tokens`` tokens."""
    return 2 * batch * kv_heads * local_tokens * head_dim


def ring_transfers(cp: int, kv: int, element_bytes: int, wide_bytes: int) -> dict[str, list[int]]:
    """Bytes in flight during each of the ``cp`` ring steps of one layer (``kv``: the
    elements of one key/value block), as the runtime overlaps them:

    * ``forward``: while step ``i`` attends over one block, the block travels on to the
      next rank (every step but the last);
    * ``backward``: while step ``i`` computes one block's gradients, the block travels on
      (every step but the last) and the gradient accumulator of the step before travels
      with it (every step but the first), in the wide dtype;
    * ``backward_tail``: the last accumulator's trip to its owner, after the last step,
      with nothing left to hide behind.
    """
    if cp <= 1:
        return {"forward": [], "backward": [], "backward_tail": [0]}
    block, grad = kv * element_bytes, kv * wide_bytes
    forward = [block] * (cp - 1) + [0]
    backward = [(block if i < cp - 1 else 0) + (grad if i > 0 else 0) for i in range(cp)]
    return {"forward": forward, "backward": backward, "backward_tail": [grad]}


def cp_attention_bytes(mode: str, cp: int, batch: int, local_tokens: int, kv_heads: int, head_dim: int,
                       element_bytes: int, wide_bytes: int, recompute_full: bool = False) -> dict[str, int]:
    """Bytes one cp rank's attention communicates per layer and micro-batch.

    ``kv_heads``: the kv heads this tp rank holds (:func:`kv_heads_per_rank`);
    ``local_tokens``: ``S / cp``; ``element_bytes`` the compute dtype's size,
    ``wide_bytes`` the accumulation dtype's (:func:`wide_bytes`). With
    ``kv = 2 b kv_heads L head_dim``:

    * ``ring``: the bytes this rank sends to the next: forward ``(cp-1) kv e``, backward
      ``(cp-1) kv e + cp kv w``;
    * ``allgather``: the collectives' tensor sizes (a ring all-gather or reduce-scatter
      over cp ranks moves ``(cp-1)/cp`` of it per rank): forward the gathered
      ``cp kv e``, backward the reduce-scatter's input ``cp kv w``.

    ``recompute_full``: the backward re-runs the forward first, its communication with it.
    One rank (``cp == 1``) communicates nothing."""
    if mode not in CP_COMM_MODES:
        raise ValueError(f"cp-comm {mode!r} is not one of {', '.join(CP_COMM_MODES)}")
    if cp <= 1:
        return {"forward": 0, "backward": 0}
    kv = kv_elements(batch, local_tokens, kv_heads, head_dim)
    if mode == "ring":
        steps = ring_transfers(cp, kv, element_bytes, wide_bytes)
        forward = sum(steps["forward"])
        backward = sum(steps["backward"]) + sum(steps["backward_tail"])
    else:
        forward, backward = cp * kv * element_bytes, cp * kv * wide_bytes
    return {"forward": forward, "backward": backward + (forward if recompute_full else 0)}
