"""Context parallelism's arithmetic: which tokens a cp rank holds, and how attention over
key/value blocks held by other ranks is put together exactly.

Pure functions on tensors (no process group), each checked against one process's
attention (tests/test_context_parallel.py). Training does not use them yet: there is no
``--cp`` axis so far.

**The load-balanced split.** Causal attention's work grows along the sequence: a
contiguous split into ``cp`` pieces gives the last rank about ``2cp - 1`` times the
first's. Cut each sequence into ``2 cp`` chunks instead; cp rank ``r`` holds chunks ``r``
and ``2cp - 1 - r``. Queries of chunk ``c`` (``n`` tokens each) attend ``n^2 c + n(n+1)/2``
(query, key) pairs, so a rank's two chunks attend ``n^2 (2cp - 1) + n(n + 1)`` pairs,
the same on every rank (:func:`causal_pairs`). The tokens keep their true positions
(:func:`local_positions`): learned and rotary positions and the causal mask are taken
from them, never from the order of the tokens in the rank's tensor.

**The exact merge.** Attention of a query over a key set split in blocks ``K1, K2``:
with each block's output ``o_i`` (softmax-weighted values over ``K_i`` alone) and the
log-sum-exp ``l_i`` of its scores, the whole is ``o = (e^{l1} o1 + e^{l2} o2) /
(e^{l1} + e^{l2})`` and ``l = log(e^{l1} + e^{l2})`` (computed from the larger ``l``, so
nothing overflows). A block with no visible key (above the causal diagonal) has
``l = -inf`` and contributes nothing, so it may be skipped (:func:`merge`).
"""

from __future__ import annotations

import math

import torch


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2 cp``) that cp rank ``rank`` holds."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is outside 0..{cp - 1}")
    return rank, 2 * cp - 1 - rank


def split_problem(seq_len: int, cp: int) -> str | None:
    """Why a sequence of ``seq_len`` tokens cannot be split over ``cp`` ranks (one line
    with the fix), or None."""
    if cp < 1:
        return f"--cp {cp} must be >= 1"
    if seq_len % (2 * cp):
        return (f"--seq-len {seq_len} is not divisible by 2 x cp = {2 * cp} (each sequence is cut into 2 cp "
                f"chunks); use a sequence length that is a multiple of {2 * cp}")
    return None


def _chunk_len(seq_len: int, cp: int) -> int:
    problem = split_problem(seq_len, cp)
    if problem:
        raise ValueError(problem)
    return seq_len // (2 * cp)


def local_positions(seq_len: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The true positions of cp rank ``rank``'s tokens, in the order it holds them."""
    n = _chunk_len(seq_len, cp)
    first, second = chunk_ids(cp, rank)
    return torch.cat([torch.arange(first * n, (first + 1) * n, device=device),
                      torch.arange(second * n, (second + 1) * n, device=device)])


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s share of ``x`` along its sequence dimension ``dim``: its two chunks."""
    n = _chunk_len(x.shape[dim], cp)
    first, second = chunk_ids(cp, rank)
    return torch.cat([x.narrow(dim, first * n, n), x.narrow(dim, second * n, n)], dim=dim)


def join_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every cp rank's share (``parts[r]`` from rank ``r``): the
    inverse of :func:`split_sequence`."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        a, b = chunk_ids(cp, rank)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)


def causal_pairs(seq_len: int, cp: int, rank: int) -> int:
    """(query, key) pairs that cp rank ``rank``'s queries attend under the causal mask."""
    n = _chunk_len(seq_len, cp)
    return sum(n * n * c + n * (n + 1) // 2 for c in chunk_ids(cp, rank))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries ``q [..., sq, d]`` at positions ``q_pos`` over keys and
    values ``k, v [..., sk, d]`` at ``k_pos`` (a query sees keys at its position or
    before): the output and the log-sum-exp of each query's scores (``-inf`` and a zero
    output for a query that sees none of these keys). Scores and softmax in fp32 or
    wider."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(wide) @ k.to(wide).transpose(-1, -2)) * scale
    visible = k_pos[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return (weights @ v.to(wide)).to(q.dtype), lse


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint key blocks from each block's (output, log-sum-exp)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    wa = torch.exp(lse_a - safe)[..., None]
    wb = torch.exp(lse_b - safe)[..., None]
    wide = torch.promote_types(out_a.dtype, torch.float32)
    return (wa * out_a.to(wide) + wb * out_b.to(wide)).to(out_a.dtype), lse


def ring_source(cp: int, rank: int, step: int) -> int:
    """Whose key/value block cp rank ``rank`` holds at step ``step`` of the ring (each step
    every rank passes its block to ``rank + 1``): its own at step 0."""
    return (rank - step) % cp
