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


# ---- across processes: the autograd attention of the cp group -------------------------------


def _one_process_attention(q, k, v):
    """Causal grouped-query attention of one process, with its input gradients for the
    upstream gradient ``w`` (the same on every rank's share)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    return out, leaves


def _check_cp_attention(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from gridtrain.parallel import context_parallel
    from gridtrain.parallel.comm import ByteCounter, CommGroup
    from gridtrain.parallel.context_parallel import ContextParallel, attention

    results = {}
    groups = {4: dist.new_group([0, 1, 2, 3]), 2: [dist.new_group([0, 1]), dist.new_group([2, 3])]}
    b, heads, kv_heads, d = 2, 4, 2, 8
    for cp in (2, 4):
        group = groups[4] if cp == 4 else groups[2][rank // 2]
        r = rank % cp
        s = 4 * cp
        g = torch.Generator().manual_seed(cp)
        q = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64)
        k, v = (torch.randn(b, kv_heads, s, d, generator=g, dtype=torch.float64) for _ in range(2))
        w = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64)
        full, leaves = _one_process_attention(q, k, v)
        (full * w).sum().backward()
        for mode, kernel in [(m, k) for m in ("ring", "allgather") for k in ("fused", "matmul")]:
            counter = ByteCounter()
            ctx = ContextParallel(CommGroup.of("cp", group, counter), mode)
            mine = [split_sequence(x, cp, r, dim=2).requires_grad_() for x in (q, k, v)]
            fused = context_parallel._fused
            if kernel == "matmul":  # the kernel of devices without torch's fused CPU kernel
                context_parallel._fused = lambda q: False
            try:
                out = attention(*mine, ctx)
                (out * split_sequence(w, cp, r, dim=2)).sum().backward()
            finally:
                context_parallel._fused = fused
            errors = [(out - split_sequence(full, cp, r, dim=2)).abs().max().item()]
            errors += [(m.grad - split_sequence(leaf.grad, cp, r, dim=2)).abs().max().item()
                       for m, leaf in zip(mine, leaves)]
            named = {(op.kind, op.action) for op in ctx.comm.recorder.ops if op.group == "cp"}
            results[(cp, mode, kernel)] = (max(errors), dict(counter.bytes), named)
            ctx.comm.recorder.ops.clear()
    return results


@pytest.mark.spawn
def test_cp_attention_across_ranks_equals_one_process_and_counts_its_bytes():
    """Ring and all-gather attention on live cp groups of 2 and 4 gloo ranks (grouped
    queries: 4 heads reading 2 key/value heads), fp64: outputs and the gradients of
    queries, keys and values equal one process's to 1e-12, with torch's fused CPU block
    kernel and with the matrix-product kernel other devices use; the bytes each rank
    sends are the closed forms (only the 2 kv heads travel; their gradients in the fp64
    width); the flight recorder names each transfer's pass."""
    from tests.harness import run_on_ranks

    per_rank = run_on_ranks(_check_cp_attention, 4)
    b, kv_heads, d, e = 2, 2, 8, 8
    for cp in (2, 4):
        local = 4 * cp // cp
        kv = 2 * b * kv_heads * local * d * e  # one rank's keys and values
        for rank_results, kernel in [(r, k) for r in per_rank for k in ("fused", "matmul")]:
            err, counted, named = rank_results[(cp, "ring", kernel)]
            assert err < 1e-12
            assert named == {(kind, f"cp ring attention {phase}") for kind in ("send", "recv")
                             for phase in ("forward", "backward")}
            # forward: cp - 1 passes; backward: cp - 1 passes of the block, cp of its gradient
            assert counted == {("send", "cp"): (cp - 1) * kv + (cp - 1) * kv + cp * kv}
            err, counted, named = rank_results[(cp, "allgather", kernel)]
            assert err < 1e-12
            assert named == {("all_gather", "cp allgather attention forward"),
                             ("reduce_scatter", "cp allgather attention backward")}
            assert counted == {("all_gather", "cp"): cp * kv, ("reduce_scatter", "cp"): cp * kv}


def test_transfer_times_come_from_the_devices_clock(monkeypatch):
    """On a GPU the host does not wait for NCCL, so a transfer's times are marks on the
    device's clock (CUDA events there), read once per step: in flight from issue to the
    end of its wait, exposed from the start of the wait to its end. As data, with a clock
    whose marks are numbers."""
    from gridtrain.parallel.context_parallel import TransferTimes, _Timed

    class Clock:
        now = 0.0

        def mark(self):
            return self.now

        def seconds(self, start, end):
            return end - start

    clock = Clock()
    times = TransferTimes()

    class Pending:
        def wait(self):
            clock.now += 1.0  # the wait itself: exposed
            return "done"

    monkeypatch.setattr("gridtrain.parallel.context_parallel.clock_for", lambda device: clock)
    timed = _Timed(times, Pending(), torch.device("cpu"))
    clock.now += 3.0  # attention while the transfer travels: hidden
    assert timed.wait() == "done"
    assert times.take() == (pytest.approx(0.75), pytest.approx(1.0))
    assert times.take() == (0.0, 0.0)
