"""Which transformer blocks go to which virtual pipeline stage.

The model is a chain of units: the embedding, the blocks, and the final norm with the
head and loss. The embedding always opens virtual stage 0 and the head always closes
the last one; the blocks are cut into ``p * v`` contiguous runs, one per virtual stage:

* ``uniform``: equal block counts (the remainder goes to the first stages);
* ``parameters``: balance parameter counts, embedding and head included;
* ``time``: balance measured forward+backward times of each unit;
* an explicit list of block counts (``--pp-layers 3,4,4,3``).

The costs of the units come from the model (``gridtrain.models.decoder.parameter_costs`` and
``profile_units``); this module only cuts a chain of costs, so it knows no model.

Balancing is the classic linear partition problem: minimise the largest stage cost
over contiguous cuts, solved exactly by dynamic programming. Every block is placed
exactly once; a list that drops or repeats a block is an error.
"""

from __future__ import annotations

from collections.abc import Sequence

METHODS = ("uniform", "parameters", "time")

UnitCosts = tuple[Sequence[float], float, float]  # (each block, the embedding, the head and loss)


class PartitionError(ValueError):
    """A partition that cannot be used; one line naming the fix."""


def uniform(n_layer: int, stages: int) -> list[int]:
    base, extra = divmod(n_layer, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def balanced(block_costs: Sequence[float], stages: int, first_extra: float = 0.0,
             last_extra: float = 0.0) -> list[int]:
    """Block counts per stage minimising the most expensive stage.

    ``first_extra`` / ``last_extra`` are the costs of the embedding and the head, which
    always sit on the first and last stage. Each stage gets at least one block when
    there are enough blocks.
    """
    n = len(block_costs)
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)
    min_blocks = 1 if n >= stages else 0
    inf = float("inf")
    # best[k][i]: the smallest possible max cost placing the first i blocks on k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(n + 1):
            for j in range(i - min_blocks + 1):
                if best[k - 1][j] == inf:
                    continue
                cost = prefix[i] - prefix[j] + (first_extra if k == 1 else 0.0) + (last_extra if k == stages else 0.0)
                value = max(best[k - 1][j], cost)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(stages, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def check_counts(counts: Sequence[int], stages: int, n_layer: int) -> None:
    """An explicit split (``--pp-layers``) must place every block exactly once."""
    if len(counts) != stages or any(c < 0 for c in counts) or sum(counts) != n_layer:
        raise PartitionError(
            f"--pp-layers {','.join(map(str, counts))} must give {stages} non-negative block counts "
            f"(pp x vpp) that add up to --n-layer {n_layer}")


def partition(n_layer: int, stages: int, *, explicit: Sequence[int] | None = None,
              costs: UnitCosts | None = None) -> list[list[int]]:
    """Global block ids of each virtual stage, in pipeline order: the ``explicit`` counts,
    else the split balancing ``costs``, else equal counts."""
    if explicit is not None:
        check_counts(explicit, stages, n_layer)
        counts = list(explicit)
    elif costs is not None:
        blocks, embedding, head = costs
        if len(blocks) != n_layer:
            raise PartitionError(f"{len(blocks)} block costs given for {n_layer} blocks")
        counts = balanced(blocks, stages, first_extra=embedding, last_extra=head)
    else:
        counts = uniform(n_layer, stages)
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out
