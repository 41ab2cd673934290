"""Which transformer blocks go to which virtual pipeline stage.

The model is a chain of units: the embedding, the blocks, and the final norm with the
head and loss. The embedding always opens virtual stage 0 and the head always closes
the last one; the blocks are cut into ``p * v`` contiguous runs, one per virtual stage:

* ``uniform``: equal block counts (the remainder goes to the first stages);
* ``parameters``: balance parameter counts, embedding and head included;
* ``time``: balance measured forward+backward times of each unit (see ``profile_units``);
* an explicit list of block counts (``--pp-layers 3,4,4,3``).

Balancing is the classic linear partition problem: minimise the largest stage cost
over contiguous cuts, solved exactly by dynamic programming. Every block is placed
exactly once; a list that drops or repeats a block is an error.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from gridtrain.config import ModelConfig

METHODS = ("uniform", "parameters", "time")


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


def parameter_costs(cfg: ModelConfig) -> tuple[list[float], float, float]:
    """Parameters per block, in the embedding and in the head (untied copy counted)."""
    from gridtrain.model import count_parameters

    d, L = cfg.d_model, cfg.n_layer
    per_block = (count_parameters(cfg, exclude_embeddings=True) - 2 * d
                 - (0 if cfg.tie_embeddings else cfg.vocab_size * d)) / L
    embedding = (cfg.vocab_size + cfg.seq_len) * d
    head = cfg.vocab_size * d + 2 * d
    return [per_block] * L, embedding, head


def profile_units(cfg: ModelConfig, micro_batch_size: int, steps: int = 3) -> tuple[list[float], float, float]:
    """Measured forward+backward seconds of the embedding, each block and the head + loss,
    on this process's CPU, with random tokens (median of ``steps`` runs)."""
    from gridtrain.model import GPT, init_parameters

    model = GPT(cfg)
    init_parameters(model, 0)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch_size, cfg.seq_len))

    def timed(fn) -> float:
        runs = []
        for _ in range(steps):
            began = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - began)
        return sorted(runs)[len(runs) // 2]

    hidden = model.embedding(tokens).detach()
    embedding = timed(lambda: model.embedding(tokens).sum().backward())
    blocks = [timed(lambda b=b: b(hidden.requires_grad_()).sum().backward()) for b in model.blocks.values()]
    head_chunk = GPT(cfg, layer_ids=[], pre_process=False)
    head = timed(lambda: head_chunk(hidden.requires_grad_(), tokens).sum().backward())
    return blocks, embedding, head


def partition(cfg: ModelConfig, stages: int, method: str = "uniform", explicit: Sequence[int] | None = None,
              micro_batch_size: int = 1) -> list[list[int]]:
    """Global block ids of each virtual stage, in pipeline order."""
    if explicit is not None:
        counts = list(explicit)
        if len(counts) != stages or any(c < 0 for c in counts) or sum(counts) != cfg.n_layer:
            raise PartitionError(
                f"--pp-layers {','.join(map(str, counts))} must give {stages} non-negative block counts "
                f"(pp x vpp) that add up to --n-layer {cfg.n_layer}")
    elif method == "uniform":
        counts = uniform(cfg.n_layer, stages)
    elif method in ("parameters", "time"):
        blocks, embedding, head = (parameter_costs(cfg) if method == "parameters"
                                   else profile_units(cfg, micro_batch_size))
        counts = balanced(blocks, stages, first_extra=embedding, last_extra=head)
    else:
        raise PartitionError(f"--pp-partition {method!r} is not one of {', '.join(METHODS)}")
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out
