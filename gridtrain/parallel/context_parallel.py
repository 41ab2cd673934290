"""Context parallelism: which tokens a cp rank holds, and attention over the key/value
blocks every cp rank holds, put together exactly.

The split and the merge are pure functions on tensors (no process group), each checked
against one process's attention (tests/test_context_parallel.py); :func:`attention` puts
them to work across the ranks of a cp group, in one of two ways (``--cp-comm``).

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

**Documents** (``--document-mask``): with the whole sequence's document ids (every cp rank
holds them all), a query sees a key when both lie in the same document and the key's
true position is at or before the query's. Chunk pairs wholly above the diagonal are
still skipped; every other pair is masked by documents and true positions, with the
matrix-product block kernel (torch's fused CPU kernel takes no mask). A query row that
sees no key of a pair has ``l = -inf`` there, and the merge drops it; every query sees
at least itself, so the merged result is always defined.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from gridtrain.parallel.comm import CommGroup, OnGroup, single
from gridtrain.parallel.split_backward import outside_compiled_graphs


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
           scale: float | None = None, q_doc: torch.Tensor | None = None,
           k_doc: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries ``q [..., sq, d]`` at positions ``q_pos`` over keys and
    values ``k, v [..., sk, d]`` at ``k_pos`` (a query sees keys at its position or
    before): the output and the log-sum-exp of each query's scores (``-inf`` and a zero
    output for a query that sees none of these keys). Scores and softmax in fp32 or
    wider. With documents ``q_doc [sq]`` and ``k_doc [sk]``, only keys of the query's own
    document are seen."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(wide) @ k.to(wide).transpose(-1, -2)) * scale
    visible = k_pos[None, :] <= q_pos[:, None]
    if q_doc is not None:
        visible = visible & (k_doc[None, :] == q_doc[:, None])
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


# ---- the cp group as the layers see it ----------------------------------------------------


@dataclass
class ContextParallel(OnGroup):
    """The cp group a layer's sequence is split over and how its attention communicates
    (``mode``: ``ring`` or ``allgather``). One rank (the default) splits nothing: every
    layer then runs exactly as without context parallelism."""

    comm: CommGroup = field(default_factory=lambda: single("cp"))
    mode: str = "ring"
    transfers: TransferTimes = field(default_factory=lambda: TransferTimes())

    def positions(self, local_len: int, device: torch.device | str) -> torch.Tensor:
        """The true positions of this rank's ``local_len`` tokens (its two chunks of a
        sequence of ``local_len x size`` tokens)."""
        return _positions(local_len * self.size, self.size, self.rank, torch.device(device))


@dataclass
class TransferTimes:
    """How long the attention's transfers were in flight and how long the rank waited for
    them, on the host clock (meaningful where communication blocks the host: CPU/gloo; on
    GPUs use the profiler). The rest of the in-flight time was hidden behind attention."""

    in_flight_s: float = 0.0
    exposed_s: float = 0.0

    def hidden_fraction(self) -> float:
        return 1.0 - self.exposed_s / self.in_flight_s if self.in_flight_s > 0 else 0.0

    def take(self) -> tuple[float, float]:
        """(hidden fraction, exposed seconds) since the last call; then start again."""
        out = (self.hidden_fraction(), self.exposed_s)
        self.in_flight_s = self.exposed_s = 0.0
        return out


class _Timed:
    """A transfer just issued; :meth:`wait` waits for it and adds its times."""

    def __init__(self, times: TransferTimes, pending):
        self.times, self.pending, self.issued = times, pending, time.perf_counter()

    def wait(self):
        began = time.perf_counter()
        result = self.pending.wait()
        end = time.perf_counter()
        self.times.in_flight_s += end - self.issued
        self.times.exposed_s += end - began
        return result


@lru_cache(maxsize=32)
def _positions(seq_len: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    return local_positions(seq_len, cp, rank, device)


# ---- attention across the cp group --------------------------------------------------------
#
# A rank's queries and keys are two chunks each (``n`` tokens). For a query chunk ``a``
# and a key chunk ``c`` (their indices among the ``2 cp``): ``c < a`` every key is seen,
# ``c == a`` the causal triangle, ``c > a`` nothing (the pair is skipped). Each visible
# pair is one block of a blockwise ("flash") attention: it gives an output and a
# log-sum-exp per query, merged into the query chunk's running result with
# :func:`merge`; no ``s x s`` tensor outlives its block. The backward of a pair takes the
# final output and log-sum-exp, so that its probabilities ``exp(s - lse)`` and row sums
# ``D = sum(dO * O)`` are the whole attention's: ``dV = p^T dO``, ``dS = p * (dO V^T -
# D)``, ``dQ = dS K``, ``dK = dS^T Q`` (scaled), summed over the pairs.
#
# The block kernel: on CPU, torch's fused flash-attention kernel (the one
# ``scaled_dot_product_attention`` runs there; its forward returns the log-sum-exp and its
# backward takes it), in the tensors' own dtype with fp32 (fp64) statistics. Elsewhere, a
# kernel of matrix products in fp32 (fp64 for fp64), exact on any device; there the
# ``g = heads / kv_heads`` query heads that read one key/value head are folded into its
# rows (``[b, kv_heads, g n, d]``), so one product serves them and the key/value
# gradients sum over them in it. Either way only the ``kv_heads`` heads travel.

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def visible_pairs(cp: int, q_rank: int, k_rank: int) -> list[tuple[int, int, bool]]:
    """The (query half, key half, causal) chunk pairs in which cp rank ``q_rank``'s
    queries see keys held by ``k_rank`` (halves 0 and 1 of each rank's tokens);
    ``causal``: the diagonal block, else every key is seen."""
    pairs = []
    for qi, qc in enumerate(chunk_ids(cp, q_rank)):
        for ki, kc in enumerate(chunk_ids(cp, k_rank)):
            if kc <= qc:
                pairs.append((qi, ki, kc == qc))
    return pairs


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and _FLASH_CPU is not None and _FLASH_CPU_BACKWARD is not None


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _every_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads that read them (none to repeat: ``x``)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _per_kv_head(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The inverse of :func:`_every_head` for gradients: summed over the query heads."""
    return grad if grad.shape[1] == kv_heads else grad.unflatten(1, (kv_heads, -1)).sum(2)


def _fold(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, heads, n, d]`` -> ``[b, kv_heads, g n, d]`` in the wide dtype."""
    b, heads, n, d = x.shape
    return x.unflatten(1, (kv_heads, heads // kv_heads)).to(_wide(x.dtype)).reshape(b, kv_heads, -1, d)


def _unfold(x: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`_fold` (any trailing shape after the rows)."""
    b, kv_heads, rows = x.shape[:3]
    g = heads // kv_heads
    return x.reshape(b, kv_heads, g, rows // g, *x.shape[3:]).flatten(1, 2)


@lru_cache(maxsize=16)
def _above_diagonal(n: int, g: int, device: torch.device) -> torch.Tensor:
    """``[g * n, n]``: True where key j lies after query row i's position (``i mod n``)."""
    i = torch.arange(n, device=device)
    return (i[None, :] > i[:, None]).repeat(g, 1)


def pair_masks(documents: torch.Tensor, cp: int, q_rank: int, k_rank: int) -> dict[tuple[int, int], torch.Tensor]:
    """For the visible chunk pairs of ``q_rank``'s queries and ``k_rank``'s keys: which
    (query, key) pairs are seen, ``[b, n, n]``, from the whole sequence's document ids
    ``documents`` ``[b, seq_len]`` and the tokens' true positions."""
    seq_len = documents.shape[1]
    q_pos = local_positions(seq_len, cp, q_rank, documents.device).chunk(2)
    k_pos = local_positions(seq_len, cp, k_rank, documents.device).chunk(2)
    q_doc = split_sequence(documents, cp, q_rank).chunk(2, dim=1)
    k_doc = split_sequence(documents, cp, k_rank).chunk(2, dim=1)
    return {(qi, ki): (k_pos[ki][None, None, :] <= q_pos[qi][None, :, None])
            & (k_doc[ki][:, None, :] == q_doc[qi][:, :, None])
            for qi, ki, _ in visible_pairs(cp, q_rank, k_rank)}


def _scores(qf: torch.Tensor, k: torch.Tensor, causal: bool, scale: float,
            visible: torch.Tensor | None = None) -> torch.Tensor:
    s = torch.matmul(qf, k.transpose(-1, -2)) * scale
    if visible is not None:  # [b, n, n] for each of the g query heads folded into the rows
        return s.masked_fill(~visible.repeat(1, qf.shape[-2] // k.shape[-2], 1)[:, None], float("-inf"))
    if causal:
        n = k.shape[-2]
        s = s.masked_fill(_above_diagonal(n, qf.shape[-2] // n, qf.device), float("-inf"))
    return s


def _pair_forward(q, k, v, causal: bool, scale: float,
                  visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``q`` ``[b, heads, n, d]`` over one chunk's keys and values ``[b, kv_heads,
    n, d]``: (output, log-sum-exp) in the wide dtype. ``visible`` (``[b, n, n]``, document
    masking): which keys each query sees, in place of ``causal``; a query that sees none
    gets a zero output and ``-inf``."""
    wide = _wide(q.dtype)
    if visible is None and _fused(q):
        out, lse = _FLASH_CPU(q, _every_head(k, q.shape[1]), _every_head(v, q.shape[1]), 0.0, causal, scale=scale)
        return out.to(wide), lse.to(wide)
    s = _scores(_fold(q, k.shape[1]), k.to(wide), causal, scale, visible)
    lse = torch.logsumexp(s, dim=-1)
    safe = lse if visible is None else lse.masked_fill(torch.isinf(lse), 0.0)  # rows with no key: exp(-inf) = 0
    out = torch.matmul(torch.exp(s - safe[..., None]), v.to(wide))
    return _unfold(out, q.shape[1]), _unfold(lse, q.shape[1])


def _pair_backward(dout, q, k, v, out, lse, causal: bool, scale: float, visible: torch.Tensor | None = None):
    """Gradients of one pair (queries, keys, values; the keys' and values' per kv head)
    given the whole attention's output ``out`` and log-sum-exp ``lse`` (finite: every
    query sees itself); wide."""
    wide, heads, kv_heads = _wide(q.dtype), q.shape[1], k.shape[1]
    if visible is None and _fused(q):
        dq, dk, dv = _FLASH_CPU_BACKWARD(dout, q, _every_head(k, heads), _every_head(v, heads), out, lse, 0.0,
                                          causal, scale=scale)
        return dq.to(wide), _per_kv_head(dk, kv_heads).to(wide), _per_kv_head(dv, kv_heads).to(wide)
    qf, dof = _fold(q, kv_heads), _fold(dout, kv_heads)
    rowsum = (dof * _fold(out, kv_heads)).sum(-1)
    lse_f = lse.unflatten(1, (kv_heads, -1)).reshape(lse.shape[0], kv_heads, -1)
    kw, vw = k.to(wide), v.to(wide)
    p = torch.exp(_scores(qf, kw, causal, scale, visible) - lse_f[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dof)
    ds = p * (torch.matmul(dof, vw.transpose(-1, -2)) - rowsum[..., None])
    dq = torch.matmul(ds, kw) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    return _unfold(dq, heads), dk, dv


def _forward_blocks(qh: list[torch.Tensor], kv: torch.Tensor, pairs, acc: list, scale: float,
                    masks: dict[tuple[int, int], torch.Tensor] | None = None) -> None:
    """Merge the visible pairs of one rank's key/value block ``kv`` (``[2, b, kv_heads,
    2n, d]``) into ``acc`` (per query half: (output, log-sum-exp) so far, or None);
    ``masks``: each pair's document mask (:func:`pair_masks`), or None (causal)."""
    k_halves, v_halves = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
    for qi, ki, causal in pairs:
        visible = None if masks is None else masks[qi, ki]
        out, lse = _pair_forward(qh[qi], k_halves[ki], v_halves[ki], causal, scale, visible)
        acc[qi] = (out, lse) if acc[qi] is None else merge(*acc[qi], out, lse)


def _backward_blocks(qh, doh, oh, lse, kv: torch.Tensor, pairs, dqh, scale: float,
                     masks: dict[tuple[int, int], torch.Tensor] | None = None) -> torch.Tensor:
    """Gradients of the visible pairs with block ``kv``: added into ``dqh`` (per query
    half); returned for the block's keys and values, ``[2, b, kv_heads, 2n, d]`` wide."""
    k_halves, v_halves = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
    dkv = torch.zeros(kv.shape, dtype=dqh[0].dtype, device=kv.device)
    dk_halves, dv_halves = dkv[0].chunk(2, dim=2), dkv[1].chunk(2, dim=2)
    for qi, ki, causal in pairs:
        visible = None if masks is None else masks[qi, ki]
        dq, dk, dv = _pair_backward(doh[qi], qh[qi], k_halves[ki], v_halves[ki], oh[qi], lse[qi], causal, scale,
                                    visible)
        dqh[qi].add_(dq)
        dk_halves[ki].add_(dk)
        dv_halves[ki].add_(dv)
    return dkv


class _CPAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the keys and values of the whole cp
    group; ``cp.mode`` says how the other ranks' blocks arrive (see :func:`attention`)."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, documents: torch.Tensor | None = None):
        with _named(cp, "forward"):
            return _CPAttention._forward(ctx, q, k, v, cp, documents)

    @staticmethod
    def _forward(ctx, q, k, v, cp: ContextParallel, documents: torch.Tensor | None):
        scale = 1.0 / math.sqrt(q.shape[-1])
        size, rank = cp.size, cp.rank

        def masks(src: int):  # each pair's document mask with rank src's keys (None: causal)
            return None if documents is None else pair_masks(documents, size, rank, src)

        qh = q.chunk(2, dim=2)
        acc: list = [None, None]
        kv = torch.stack([k, v])  # [2, b, kv_heads, 2n, d]: one message per block
        if cp.mode == "ring":
            for step in range(size):
                # pass the block on while attending over it: the next one arrives meanwhile
                nxt = _ring_step(cp, kv) if step < size - 1 else None
                src = ring_source(size, rank, step)
                _forward_blocks(qh, kv, visible_pairs(size, rank, src), acc, scale, masks(src))
                if nxt is not None:
                    kv = nxt.wait()
            saved = (k, v)
        else:
            gathering = _Timed(cp.transfers, cp.comm.start_all_gather_into(kv.new_empty((size, *kv.shape)), kv))
            _forward_blocks(qh, kv, visible_pairs(size, rank, rank), acc, scale, masks(rank))  # while the gather travels
            gathered = gathering.wait()
            for src in range(size):
                if src != rank:
                    _forward_blocks(qh, gathered[src], visible_pairs(size, rank, src), acc, scale, masks(src))
            saved = (gathered,)
        out = torch.cat([a[0] for a in acc], dim=2).to(q.dtype)
        ctx.cp, ctx.kv_dtype, ctx.documents = cp, k.dtype, documents  # (integer ids: no gradient)
        ctx.save_for_backward(q, out, acc[0][1], acc[1][1], *saved)
        return out

    @staticmethod
    def backward(ctx, dout):
        with _named(ctx.cp, "backward"):
            return _CPAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, out, lse0, lse1, *saved = ctx.saved_tensors
        cp, size, rank = ctx.cp, ctx.cp.size, ctx.cp.rank
        scale = 1.0 / math.sqrt(q.shape[-1])
        qh, doh, oh = q.chunk(2, dim=2), dout.contiguous().chunk(2, dim=2), out.chunk(2, dim=2)
        lse = [lse0, lse1]
        dqh = [torch.zeros(h.shape, dtype=lse0.dtype, device=h.device) for h in qh]
        documents = ctx.documents

        def masks(src: int):
            return None if documents is None else pair_masks(documents, size, rank, src)

        if cp.mode == "ring":
            kv, incoming = torch.stack(saved), None
            for step in range(size):
                nxt = _ring_step(cp, kv) if step < size - 1 else None
                src = ring_source(size, rank, step)
                dkv = _backward_blocks(qh, doh, oh, lse, kv, visible_pairs(size, rank, src), dqh, scale, masks(src))
                if incoming is not None:  # what the ranks before added to this block's gradient
                    dkv += incoming.wait()
                # the gradient travels with its block, and after the last step reaches its owner
                incoming = _ring_step(cp, dkv)
                if nxt is not None:
                    kv = nxt.wait()
            own = incoming.wait()
        else:
            (gathered,) = saved
            dkv = torch.stack([_backward_blocks(qh, doh, oh, lse, gathered[src], visible_pairs(size, rank, src),
                                                dqh, scale, masks(src)) for src in range(size)])
            own = _Timed(cp.transfers, cp.comm.start_reduce_scatter(dkv, dim=0)).wait()[0]
        return torch.cat(dqh, dim=2).to(q.dtype), own[0].to(ctx.kv_dtype), own[1].to(ctx.kv_dtype), None, None


def _ring_step(cp: ContextParallel, block: torch.Tensor) -> _Timed:
    """Pass ``block`` to the next cp rank and receive the previous rank's."""
    return _Timed(cp.transfers, cp.comm.start_ring_step(block, torch.empty_like(block)))


@contextmanager
def _named(cp: ContextParallel, phase: str):
    """What the flight recorder says this rank is doing while the attention's transfers
    are in flight, e.g. ``F(mb 3, chunk 0): cp ring attention forward`` (a hang report
    names the ring and the pass)."""
    recorder = cp.comm.recorder
    before = recorder.action
    recorder.set_action(f"{before + ': ' if before else ''}cp {cp.mode} attention {phase}")
    try:
        yield
    finally:
        recorder.set_action(before)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel,
              documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's queries ``q`` ``[b, heads, 2n, d]`` over the
    keys and values ``k``, ``v`` ``[b, kv_heads, 2n, d]`` of every rank of ``cp``: the
    same numbers as one process attending over the whole sequence, for this rank's
    tokens (its two chunks, :func:`split_sequence`).

    ``cp.mode == "ring"``: each of ``cp`` steps attends over one rank's block while
    passing it on to the next rank (the transfer hides behind the attention); the
    backward passes the blocks around again, each with its gradient, which reaches the
    block's owner after the last step. ``"allgather"``: one all-gather of every rank's
    keys and values (the local block is attended while it travels), one reduce-scatter
    of their gradients. Either way only ``kv_heads`` heads travel, and what is kept for
    the backward is ``q``, the output, one log-sum-exp per query and the keys and values
    (the gathered ones under all-gather): nothing of size ``s x s``. Scores and sums are
    computed in fp32 or wider; gradients of keys and values travel in that width.

    ``documents`` (``[b, seq_len]``, the whole sequence's document ids, ``--document-mask``):
    each query sees only its own document's keys (module docstring, "Documents").

    Outside ``torch.compile``'s graphs (a compiled block breaks around it: see
    split_backward.outside_compiled_graphs, which imports dynamo only when compiling):
    its point-to-point sends are not traceable."""
    return outside_compiled_graphs(_CPAttention.apply, q, k, v, cp, documents)
