"""Context parallelism's arithmetic as data (gridtrain/parallel/context_parallel.py): the
load-balanced split and its inverse, true positions, equal causal work on every rank, and
attention over key/value blocks merged exactly (ring order and all-gathered), fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gridtrain.parallel.context_parallel import (attend, causal_pairs, chunk_ids, join_sequence, local_positions,
                                                 merge, ring_source, split_problem, split_sequence)

CPS = [1, 2, 3, 4]


@pytest.mark.parametrize("cp", CPS)
def test_the_split_is_a_permutation_that_keeps_true_positions(cp):
    s = 8 * cp
    x = torch.arange(2 * s).reshape(2, s)  # two sequences
    parts = [split_sequence(x, cp, r) for r in range(cp)]
    assert all(p.shape == (2, s // cp) for p in parts)
    assert torch.equal(join_sequence(parts), x)
    for r, part in enumerate(parts):
        assert torch.equal(part[0], local_positions(s, cp, r))  # the tokens' own positions
    assert sorted({c for r in range(cp) for c in chunk_ids(cp, r)}) == list(range(2 * cp))


@pytest.mark.parametrize("cp", CPS)
def test_every_rank_does_the_same_causal_work(cp):
    s = 16 * cp
    work = [causal_pairs(s, cp, r) for r in range(cp)]
    assert len(set(work)) == 1 and sum(work) == s * (s + 1) // 2
    counted = []
    for r in range(cp):  # counted from the mask itself
        q = local_positions(s, cp, r)
        counted.append(int((torch.arange(s)[None, :] <= q[:, None]).sum()))
    assert counted == work
    if cp > 1:  # a contiguous split would give the last rank 2 cp - 1 times the first's work
        n = s // cp
        contiguous = [n * n * r + n * (n + 1) // 2 for r in range(cp)]
        assert contiguous[-1] / contiguous[0] > 2 * cp - 2


def test_a_sequence_that_does_not_split_is_one_line_with_the_fix():
    assert split_problem(64, 4) is None
    problem = split_problem(60, 4)
    assert "\n" not in problem and "multiple of 8" in problem
    with pytest.raises(ValueError, match="not divisible by 2 x cp = 8"):
        split_sequence(torch.zeros(1, 60), 4, 0)


def _qkv(s: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, s, 8, generator=g, dtype=torch.float64) for _ in range(3)]


def test_attention_over_blocks_merges_to_the_whole():
    s = 24
    q, k, v = _qkv(s)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    pos = torch.arange(s)
    out, lse = attend(q, k, v, pos, pos)
    assert torch.allclose(out, full, rtol=0, atol=1e-12)
    cuts = [0, 5, 11, 24]
    merged = None
    for a, b in zip(cuts, cuts[1:]):
        part = attend(q, k[..., a:b, :], v[..., a:b, :], pos, pos[a:b])
        merged = part if merged is None else merge(*merged, *part)
    assert torch.allclose(merged[0], full, rtol=0, atol=1e-12)
    assert torch.allclose(merged[1], lse, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cp", CPS)
def test_ring_and_all_gather_attention_equal_one_process(cp):
    """Each rank's queries against every rank's key/value block in ring order (blocks
    wholly above the diagonal skipped), or against the all-gathered keys and values: the
    rows of one process's causal attention at the rank's positions."""
    s = 8 * cp
    q, k, v = _qkv(s, seed=cp)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ks = [split_sequence(k, cp, r, dim=2) for r in range(cp)]
    vs = [split_sequence(v, cp, r, dim=2) for r in range(cp)]
    skipped = 0
    for r in range(cp):
        mine = split_sequence(q, cp, r, dim=2)
        q_pos = local_positions(s, cp, r)
        expected = split_sequence(full, cp, r, dim=2)
        result = None
        for step in range(cp):
            src = ring_source(cp, r, step)
            k_pos = local_positions(s, cp, src)
            if k_pos.min() > q_pos.max():  # nothing visible: the ring skips the block
                skipped += 1
                continue
            part = attend(mine, ks[src], vs[src], q_pos, k_pos)
            result = part if result is None else merge(*result, *part)
        assert torch.allclose(result[0], expected, rtol=0, atol=1e-12)
        gathered = attend(mine, join_sequence(ks, dim=2), join_sequence(vs, dim=2), q_pos, torch.arange(s))
        assert torch.allclose(gathered[0], expected, rtol=0, atol=1e-12)
    assert [ring_source(cp, 0, t) for t in range(cp)] == [0, *range(cp - 1, 0, -1)]
    assert skipped == 0  # zig-zag: every rank's second chunk sees every block in part
