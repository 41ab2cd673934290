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

**Documents** (``--document-mask``): with the whole sequence's document spans (every
cp rank holds them all: :func:`attention_blocks.document_spans`, read on the host once
per micro-batch), a query sees a key when both lie in the same document and the key's
true position is at or before the query's. A chunk pair's visible region is then a
union of per-document rectangles (:func:`document_blocks`): where the key chunk precedes
the query chunk, a document's queries in the query chunk see all of its keys in the key
chunk; on the diagonal, each document's causal square. Each rectangle is one block of
the fused kernel, merged into its query rows as any other block; a pair with no
rectangle is skipped (wholly above the diagonal, or no document spans both chunks). No
``s x s`` (or ``n x n``) mask exists anywhere, and a window of several documents does
less work than a causal one. Every query sees at least itself, so the merged result is
always defined.

**The kernels** (:mod:`gridtrain.parallel.attention_blocks`): torch's fused CPU flash
kernel on CPU; on CUDA flash for bf16/fp16 and the memory-efficient kernel for fp32;
matrix products in the wide dtype for fp64 on CUDA and on other devices. The CUDA
kernels have not run on a GPU here: their shapes are checked on fake tensors, their
numbers by ``make gpu-check``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from gridtrain.parallel import attention_blocks
from gridtrain.parallel.attention_blocks import Spans
from gridtrain.parallel.comm import CommGroup, OnGroup, single
from gridtrain.parallel.split_backward import outside_compiled_graphs
from gridtrain.runtime.timing import clock_for


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
    them; the rest of the in-flight time was hidden behind attention.

    Marked on the clock of the tensors' device (runtime/timing.py): the host's where
    communication blocks the host (CPU, gloo); on a GPU, where an NCCL ``wait()`` only
    makes the compute stream wait, CUDA events on the compute stream: one where the
    transfer is issued, one where the stream reaches the wait, one where it may go on;
    the gap between the last two is the stream standing idle for the transfer (exposed).
    The marks are read at :meth:`take`, once per step, after the step's own host read."""

    marks: list = field(default_factory=list)  # (clock, issued, waiting, done) not yet read
    in_flight_s: float = 0.0
    exposed_s: float = 0.0

    def hidden_fraction(self) -> float:
        for clock, issued, waiting, done in self.marks:
            self.in_flight_s += clock.seconds(issued, done)
            self.exposed_s += clock.seconds(waiting, done)
        self.marks.clear()
        return 1.0 - self.exposed_s / self.in_flight_s if self.in_flight_s > 0 else 0.0

    def take(self) -> tuple[float, float]:
        """(hidden fraction, exposed seconds) since the last call; then start again."""
        out = (self.hidden_fraction(), self.exposed_s)
        self.in_flight_s = self.exposed_s = 0.0
        return out


class _Timed:
    """A transfer just issued (its tensors on ``device``); :meth:`wait` waits for it and
    marks its times (:class:`TransferTimes`)."""

    def __init__(self, times: TransferTimes, pending, device: torch.device):
        self.times, self.pending, self.clock = times, pending, clock_for(device)
        self.issued = self.clock.mark()

    def wait(self):
        waiting = self.clock.mark()
        result = self.pending.wait()
        self.times.marks.append((self.clock, self.issued, waiting, self.clock.mark()))
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
# The block kernel (gridtrain/parallel/attention_blocks.py, ``block_kernel``): on CPU
# torch's fused CPU flash kernel; on CUDA the flash kernel for bf16/fp16 (sm80 and later),
# else the memory-efficient kernel (fp32 too, fp32 arithmetic); fp64 on CUDA and other
# devices, a kernel of matrix products in the wide dtype. Each returns a log-sum-exp per
# query, and its backward takes the whole attention's output and log-sum-exp. A diagonal
# pair runs as the kernel's causal variant; pairs wholly above the diagonal are never
# formed. Only the ``kv_heads`` heads travel, and the kernels read them in place where
# they can (flash): the memory-efficient kernel gets a repeated copy per block.
#
# With documents, a pair is the union of per-document rectangles (``document_blocks``),
# each one fused block, merged into its query rows; a pair without any is skipped.


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


# (rows, q_start, q_end, k_start, k_end, causal) within a pair's two halves
Block = tuple[slice, int, int, int, int, bool]


@lru_cache(maxsize=256)
def document_blocks(spans: tuple[Spans, ...], cp: int, q_rank: int,
                    k_rank: int) -> dict[tuple[int, int], list[Block]]:
    """For the chunk pairs of ``q_rank``'s queries and ``k_rank``'s keys: the blocks each
    pair's documents leave visible (:func:`attention_blocks.pair_blocks`, per group of
    batch rows with the same documents), from the whole sequence's document ``spans``
    (:func:`attention_blocks.document_spans`). Pairs that see nothing are left out (the
    ring skips them)."""
    n = _chunk_len(sum(e - a for a, e in spans[0]), cp)
    q_chunks, k_chunks = chunk_ids(cp, q_rank), chunk_ids(cp, k_rank)
    out: dict[tuple[int, int], list[Block]] = {}
    for qi, ki, _ in visible_pairs(cp, q_rank, k_rank):
        blocks = [(rows, *block) for rows, row in attention_blocks.row_groups(spans)
                  for block in attention_blocks.pair_blocks(row, n, q_chunks[qi], k_chunks[ki])]
        if blocks:
            out[qi, ki] = blocks
    return out


_wide = attention_blocks.wide


def _fused(q: torch.Tensor) -> bool:
    """Whether a fused kernel serves ``q``'s device and dtype (tests turn it off to run
    the matrix-product kernel on CPU)."""
    return attention_blocks.kernel_for(q) != "matmul"


def _kernel(q: torch.Tensor) -> str:
    return attention_blocks.kernel_for(q) if _fused(q) else "matmul"


def _forward_blocks(qh: list[torch.Tensor], kv: torch.Tensor, pairs, acc: list, scale: float,
                    blocks: dict[tuple[int, int], list[Block]] | None = None, kernel: str | None = None) -> None:
    """Merge the visible pairs of one rank's key/value block ``kv`` (``[2, b, kv_heads,
    2n, d]``) into ``acc`` (per query half: (output, log-sum-exp) so far, or None);
    ``blocks``: each pair's document blocks (:func:`document_blocks`; a pair not there
    is skipped), or None (causal: each pair whole)."""
    kernel = kernel or _kernel(qh[0])
    w = _wide(qh[0].dtype)
    k_halves, v_halves = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
    for qi, ki, causal in pairs:
        if blocks is None:
            out, lse = attention_blocks.block_forward(kernel, qh[qi], k_halves[ki], v_halves[ki], causal, scale)
            out = out.to(w)
            acc[qi] = (out, lse) if acc[qi] is None else merge(*acc[qi], out, lse)
            continue
        if (qi, ki) not in blocks:
            continue
        if acc[qi] is None:  # rows no block reaches stay (0, -inf): the merge drops them
            b, heads, n, d = qh[qi].shape
            acc[qi] = (qh[qi].new_zeros(b, heads, n, d, dtype=w), qh[qi].new_full((b, heads, n), float("-inf"),
                                                                                   dtype=w))
        acc_out, acc_lse = acc[qi]
        for rows, qa, qb, ka, kb, c in blocks[qi, ki]:
            out, lse = attention_blocks.block_forward(kernel, qh[qi][rows, :, qa:qb], k_halves[ki][rows, :, ka:kb],
                                                      v_halves[ki][rows, :, ka:kb], c, scale)
            merged, merged_lse = merge(acc_out[rows, :, qa:qb], acc_lse[rows, :, qa:qb], out.to(w), lse)
            acc_out[rows, :, qa:qb], acc_lse[rows, :, qa:qb] = merged, merged_lse


def _backward_blocks(qh, doh, oh, lse, kv: torch.Tensor, pairs, dqh, scale: float,
                     blocks: dict[tuple[int, int], list[Block]] | None = None,
                     kernel: str | None = None) -> torch.Tensor:
    """Gradients of the visible pairs with block ``kv``: added into ``dqh`` (per query
    half); returned for the block's keys and values, ``[2, b, kv_heads, 2n, d]`` wide."""
    kernel = kernel or _kernel(qh[0])
    k_halves, v_halves = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
    dkv = torch.zeros(kv.shape, dtype=dqh[0].dtype, device=kv.device)
    dk_halves, dv_halves = dkv[0].chunk(2, dim=2), dkv[1].chunk(2, dim=2)
    for qi, ki, causal in pairs:
        if blocks is None:
            whole = [(slice(None), 0, qh[qi].shape[2], 0, k_halves[ki].shape[2], causal)]
        elif (qi, ki) in blocks:
            whole = blocks[qi, ki]
        else:
            continue
        for rows, qa, qb, ka, kb, c in whole:
            dq, dk, dv = attention_blocks.block_backward(
                kernel, doh[qi][rows, :, qa:qb], qh[qi][rows, :, qa:qb], k_halves[ki][rows, :, ka:kb],
                v_halves[ki][rows, :, ka:kb], oh[qi][rows, :, qa:qb], lse[qi][rows, :, qa:qb], c, scale)
            dqh[qi][rows, :, qa:qb] += dq
            dk_halves[ki][rows, :, ka:kb] += dk
            dv_halves[ki][rows, :, ka:kb] += dv
    return dkv


class _CPAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the keys and values of the whole cp
    group; ``cp.mode`` says how the other ranks' blocks arrive (see :func:`attention`)."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, documents: tuple[Spans, ...] | None = None,
                scale: float | None = None):
        with _named(cp, "forward"):
            return _CPAttention._forward(ctx, q, k, v, cp, documents, scale)

    @staticmethod
    def _forward(ctx, q, k, v, cp: ContextParallel, documents: tuple[Spans, ...] | None, scale: float | None):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        size, rank = cp.size, cp.rank
        kernel = _kernel(q)

        def blocks(src: int):  # each pair's document blocks with rank src's keys (None: causal)
            return None if documents is None else document_blocks(documents, size, rank, src)

        qh = q.chunk(2, dim=2)
        acc: list = [None, None]
        kv = torch.stack([k, v])  # [2, b, kv_heads, 2n, d]: one message per block
        if cp.mode == "ring":
            for step in range(size):
                # pass the block on while attending over it: the next one arrives meanwhile
                nxt = _ring_step(cp, kv) if step < size - 1 else None
                src = ring_source(size, rank, step)
                _forward_blocks(qh, kv, visible_pairs(size, rank, src), acc, scale, blocks(src), kernel)
                if nxt is not None:
                    kv = nxt.wait()
            saved = (k, v)
        else:
            gathering = _Timed(cp.transfers, cp.comm.start_all_gather_into(kv.new_empty((size, *kv.shape)), kv),
                               kv.device)
            # while the gather travels
            _forward_blocks(qh, kv, visible_pairs(size, rank, rank), acc, scale, blocks(rank), kernel)
            gathered = gathering.wait()
            for src in range(size):
                if src != rank:
                    _forward_blocks(qh, gathered[src], visible_pairs(size, rank, src), acc, scale, blocks(src), kernel)
            saved = (gathered,)
        out = torch.cat([a[0] for a in acc], dim=2).to(q.dtype)
        ctx.cp, ctx.kv_dtype, ctx.documents, ctx.kernel, ctx.scale = cp, k.dtype, documents, kernel, scale
        ctx.save_for_backward(q, out, acc[0][1], acc[1][1], *saved)
        return out

    @staticmethod
    def backward(ctx, dout):
        with _named(ctx.cp, "backward"):
            return _CPAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, out, lse0, lse1, *saved = ctx.saved_tensors
        cp, size, rank, kernel, scale = ctx.cp, ctx.cp.size, ctx.cp.rank, ctx.kernel, ctx.scale
        qh, doh, oh = q.chunk(2, dim=2), dout.contiguous().chunk(2, dim=2), out.chunk(2, dim=2)
        lse = [lse0, lse1]
        dqh = [torch.zeros(h.shape, dtype=lse0.dtype, device=h.device) for h in qh]
        documents = ctx.documents

        def blocks(src: int):
            return None if documents is None else document_blocks(documents, size, rank, src)

        if cp.mode == "ring":
            kv, incoming = torch.stack(saved), None
            for step in range(size):
                nxt = _ring_step(cp, kv) if step < size - 1 else None
                src = ring_source(size, rank, step)
                dkv = _backward_blocks(qh, doh, oh, lse, kv, visible_pairs(size, rank, src), dqh, scale, blocks(src),
                                       kernel)
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
                                                dqh, scale, blocks(src), kernel) for src in range(size)])
            own = _Timed(cp.transfers, cp.comm.start_reduce_scatter(dkv, dim=0), dkv.device).wait()[0]
        return (torch.cat(dqh, dim=2).to(q.dtype), own[0].to(ctx.kv_dtype), own[1].to(ctx.kv_dtype), None, None,
                None)


def _ring_step(cp: ContextParallel, block: torch.Tensor) -> _Timed:
    """Pass ``block`` to the next cp rank and receive the previous rank's."""
    return _Timed(cp.transfers, cp.comm.start_ring_step(block, torch.empty_like(block)), block.device)


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
              documents: torch.Tensor | tuple[Spans, ...] | None = None,
              scale: float | None = None) -> torch.Tensor:
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

    ``documents`` (``--document-mask``): the whole sequence's document spans per row
    (:func:`attention_blocks.document_spans`; document ids ``[b, seq_len]`` are turned
    into them here): each query sees only its own document's keys (module docstring,
    "Documents"). ``scale``: of the scores (default ``1 / sqrt(d)``). Keys and values
    travel stacked in one message, so they have one head width (latent attention pads
    its values to the query width: models/attention.py).

    Outside ``torch.compile``'s graphs (a compiled block breaks around it: see
    split_backward.outside_compiled_graphs, which imports dynamo only when compiling):
    its point-to-point sends are not traceable."""
    if isinstance(documents, torch.Tensor):
        documents = attention_blocks.document_spans(documents)
    return outside_compiled_graphs(_CPAttention.apply, q, k, v, cp, documents, scale)
