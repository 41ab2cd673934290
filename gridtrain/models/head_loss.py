"""The LM head and the cross entropy fused and run chunk by chunk: the logits of a whole
micro-batch never exist.

Why. The logits are the largest activation of a small or medium model: ``tokens x
vocabulary`` numbers, kept in fp32 by the cross entropy for its backward (the softmax),
and a gradient of the same size made in backward. GPT-2's 50k vocabulary at 8 x 1024
tokens is 1.6 GB of fp32 softmax per micro-batch in flight, more than the blocks of a
small model keep; Llama 3's 128k vocabulary makes it 4 GB at 8K tokens. None of it is
needed at once: the loss of a token reads only that token's row.

How. The summed loss of a micro-batch (what training differentiates) is linear in its
upstream gradient, a single number. So the forward, for each chunk of rows of the
flattened ``[b * s, d]`` hidden states, computes the chunk's logits, its log-sum-exp and
target logit (the loss), then at once the logits' gradient ``softmax - one_hot`` (in the
model's dtype, as the unfused head's GEMMs read it) and from it the chunk's rows of the
hidden states' gradient; the chunk's fp32 logits are freed before the next chunk. The
matrix products are the same three as the unfused head's (logits, input gradient, weight
gradient); no logits are recomputed, and the elementwise passes over the logits (upcast,
softmax, its gradient) run on chunk-sized pieces that stay in cache. A forward without
autograd (validation) computes the loss only.

**The weight gradient** (``[vocab / tp, d]``) is not made per chunk: each of its GEMMs
writes (and, summed in fp32, reads back and writes again) the whole ``[vocab / tp, d]``,
whatever the chunk's rows, so per-chunk GEMMs of a few dozen rows (Llama 3's 128K
vocabulary at 32 MiB chunks: 64 rows) moved ~0.8 TB per 8K-token micro-batch, some 150
times what the unfused head's one GEMM moves (:func:`head_loss_traffic_bytes`). Instead
the chunks' logits' gradients gather in a buffer of up to :func:`weight_grad_rows` rows,
as many as take the bytes of the fp32 weight-gradient accumulator (``2 d`` tokens in
bf16, ``d`` in fp32 and fp64), and one GEMM per full buffer adds them in. Where the whole
micro-batch fits in one buffer (:func:`defers_weight_gradient`: Llama 3 8B at 8K tokens)
the buffer is kept for backward in place of the accumulator and the weight gradient is
one GEMM in backward, over every token, with the upstream scalar folded into its
``[tokens, d]`` operand: about the unfused head's bytes (12% more at 8K tokens of Llama
3's head, from scaling that operand in fp32). Otherwise the buffer is
a transient of the forward (at most the accumulator's bytes) and the accumulator is
kept.

What is kept for backward is the hidden states' gradient ``[tokens, d]``, and either the
fp32 (or wider) weight gradient ``[vocab / tp, d]`` or, where deferred, the logits'
gradient ``[tokens, vocab / tp]`` in the model's dtype (no more bytes than the
accumulator) and the hidden states ``[tokens, d]``, instead of the unfused head's
``[tokens, vocab / tp]`` fp32 softmax (memory.model counts it).

With vocabulary-parallel TP each rank holds a slice of the vocabulary: per chunk the row
maxima are all-reduced (MAX) and the target logits and sums of exponentials together
(one SUM), as Megatron's vocab-parallel cross entropy does for the whole micro-batch. The
hidden states enter the TP region as the unfused head's input does (``copy_to_tp``, or
the sequence all-gather under SP), so their gradient is summed (reduce-scattered) over TP.

The per-token losses (``Decoder(..., reduction="none")``: generation-side uses, tests,
user forward steps that sum themselves) keep the unfused head: their upstream gradient
is a tensor, not one number.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gridtrain.parallel.comm import CommGroup, copy_to_tp, gather_from_seq
from gridtrain.parallel.tensor_parallel import IGNORE_INDEX, TensorParallel

# automatic chunking (--loss-chunks unset): chunks whose fp32 logits (this rank's
# vocabulary slice) are at most this large; small models run in one chunk
AUTO_CHUNK_BYTES = 32 * 2**20


def worth_fusing(tokens: int, local_vocab: int) -> bool:
    """The automatic choice: fuse where a micro-batch's fp32 logits (``tokens`` x this
    rank's ``local_vocab``) outgrow one chunk. Below that the fused head saves nothing
    (its one chunk is the whole logits) and the unfused one keeps the numbers of a plain
    PyTorch loss bit for bit (what the DDP and FSDP comparisons check)."""
    return tokens * local_vocab * 4 > AUTO_CHUNK_BYTES


def chunk_rows(tokens: int, local_vocab: int, chunks: int | None) -> int:
    """Rows (tokens) per chunk: ``chunks`` equal chunks (the last may be shorter), or,
    for None, as few chunks as keep each one's fp32 logits within AUTO_CHUNK_BYTES."""
    if chunks is None:
        chunks = max(1, math.ceil(tokens * local_vocab * 4 / AUTO_CHUNK_BYTES))
    return max(1, math.ceil(tokens / max(1, min(chunks, tokens))))


def weight_grad_rows(tokens: int, rows: int, d_model: int, element_bytes: int) -> int:
    """Tokens per weight-gradient GEMM for a micro-batch of ``tokens`` in chunks of
    ``rows``: at most as many as have logits' gradients (``element_bytes`` each, the
    model's dtype) taking the bytes of the weight gradient's accumulator (fp32, or fp64
    for fp64), ``d_model x acc / element_bytes``; all the tokens where they fit (then the
    GEMM waits for backward: :func:`defers_weight_gradient`), else whole chunks (at least
    one). Each GEMM then writes the ``[vocab, d]`` result once for about as many bytes of
    logits' gradient read."""
    most = d_model * max(element_bytes, 4) // element_bytes
    return tokens if tokens <= most else max(rows, most // rows * rows)


def defers_weight_gradient(tokens: int, d_model: int, element_bytes: int) -> bool:
    """Whether a micro-batch's ``tokens`` fit one weight-gradient buffer: its logits'
    gradients are then kept for backward (no more bytes than the fp32 accumulator they
    replace), with the hidden states, and the weight gradient is one GEMM there."""
    return weight_grad_rows(tokens, 1, d_model, element_bytes) == tokens


def head_loss_traffic_bytes(tokens: int, local_vocab: int, d_model: int, element_bytes: int,
                            chunks: int | None = None, *, fused: bool = True, weight_bytes: int | None = None,
                            group: int | None = None) -> int:
    """The bytes the head weight's gradient moves through memory for one micro-batch of
    ``tokens`` (this rank's ``local_vocab`` rows of the head, width ``d_model``, the model's
    dtype ``element_bytes`` wide, the weight's ``weight_bytes``): the logits' gradient in
    the model's dtype written and read by the GEMM(s), the hidden states read, and what the
    ``[vocab, d]`` result costs. Unfused (``fused=False``): one GEMM, its result written
    once. Fused: as the forward and backward here run it (``chunks``: ``--loss-chunks``;
    ``group``: rows per weight-gradient GEMM, default :func:`weight_grad_rows`; one chunk's
    rows reproduce the per-chunk GEMMs of before). Deferred (one group): the hidden states
    scaled by the upstream scalar (read, widened, scaled, rounded), one GEMM in backward,
    its result written once. Accumulated: the accumulator zeroed, per group one GEMM
    (16-bit: its product written and read, the fp32 accumulator read and written; fp32 and
    fp64: the accumulator read and written by ``addmm_``), in backward scaled and cast to
    the weight's dtype in one pass (in place where that is the accumulator's)."""
    t, v, d, e = tokens, local_vocab, d_model, element_bytes
    w = e if weight_bytes is None else weight_bytes
    acc = max(e, 4)
    logits_grad = 2 * t * v * e + t * d * e  # written in the model's dtype, read by the GEMM(s); the hidden states read
    cast = v * d * (e + w) if w != e else 0
    if not fused:
        return logits_grad + v * d * e + cast
    group = weight_grad_rows(t, chunk_rows(t, v, chunks), d, e) if group is None else group
    if group >= t:  # one GEMM in backward, after the hidden states are scaled (16-bit: widened and rounded back)
        return logits_grad + t * d * (2 * acc + (2 * e + 2 * acc if e != acc else 0)) + v * d * e + cast
    groups = math.ceil(t / group)
    per_group = 2 * v * d * acc + (2 * v * d * e if acc != e else 0)
    backward = 2 * v * d * acc if w == acc else v * d * (acc + w)
    return logits_grad + v * d * acc + groups * per_group + backward


def fused_head_loss(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                    tp: TensorParallel, chunks: int | None = None) -> torch.Tensor:
    """The summed token loss (0 for IGNORE_INDEX labels) of the final norm's output ``x``
    (``[b, s, d]``, a sequence shard under SP) through the head ``weight`` (this rank's
    ``[padded_vocab / tp, d]`` rows), in fp32 or wider: a scalar whose backward is the
    unfused head + cross entropy's, computed ``chunks`` (None: automatic) pieces at a time."""
    if tp.size > 1:
        x = gather_from_seq(x, tp.comm) if tp.sequence_parallel else copy_to_tp(x, tp.comm)
    h = x.reshape(-1, x.shape[-1])
    grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    rows = chunk_rows(h.shape[0], weight.shape[0], chunks)
    group = weight_grad_rows(h.shape[0], rows, h.shape[1], h.dtype.itemsize)
    return _FusedHeadLoss.apply(h, weight, labels.reshape(-1), vocab_size, tp.comm, rows, grads, group)


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, vocab_size, comm: CommGroup, rows: int, grads: bool, group: int):
        acc = torch.promote_types(h.dtype, torch.float32)  # the loss's dtype, as the unfused cross entropy's
        local, tokens = weight.shape[0], h.shape[0]
        start = comm.rank * local if comm.size > 1 else 0
        pad_from = max(0, vocab_size - start) if start + local > vocab_size else None
        total = torch.zeros((), dtype=acc, device=h.device)
        deferred = grads and group >= tokens  # the weight gradient: one GEMM in backward
        grad_h = torch.empty_like(h) if grads else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if grads and not deferred else None
        # the logits' gradients of up to `group` rows, in the model's dtype, for one weight-gradient GEMM
        buffer = h.new_empty((min(group, tokens), local)) if grads else None
        first = 0  # the buffer's first row
        for a in range(0, tokens, rows):
            hc, lc = h[a:a + rows], labels[a:a + rows]
            logits = (hc @ weight.t()).to(acc)
            if pad_from is not None:  # padding columns: out of the softmax, no gradient
                logits[:, pad_from:] = float("-inf")
            valid = lc != IGNORE_INDEX
            target = lc - start
            mine = valid & (target >= 0) & (target < local)
            index = target.masked_fill(~mine, 0).unsqueeze(1)
            if comm.size == 1:  # one fused pass (torch's log-softmax), then the softmax from it
                logp = torch.log_softmax(logits, dim=1)
                del logits
                total -= logp.gather(1, index).squeeze(1).masked_fill(~valid, 0.0).sum()
                probs = logp.exp_() if grads else None
            else:
                top = logits.max(dim=1).values
                comm.all_reduce(top, op=dist.ReduceOp.MAX)
                logits.sub_(top.unsqueeze(1))
                picked = logits.gather(1, index).squeeze(1).masked_fill(~mine, 0.0)
                exp = logits.exp_()  # in place of the logits
                stats = torch.stack([picked, exp.sum(dim=1)])
                comm.all_reduce(stats)  # the target logit (one rank has it) and the sum of exponentials
                total += (stats[1].log() - stats[0]).masked_fill(~valid, 0.0).sum()
                probs = exp.div_(stats[1].unsqueeze(1)) if grads else None
            if not grads:
                continue
            probs.scatter_add_(1, index, -mine.unsqueeze(1).to(acc))  # softmax - one_hot: the logits' gradient
            probs.masked_fill_(~valid.unsqueeze(1), 0.0)  # ignored tokens: no gradient
            end = a + hc.shape[0]
            g = buffer[a - first:end - first]
            g.copy_(probs)  # in the model's dtype, as the unfused head's GEMMs read it
            del probs
            torch.mm(g, weight.to(h.dtype), out=grad_h[a:end])
            if not deferred and (end - first == buffer.shape[0] or end == tokens):  # a full buffer: its GEMM
                if acc == h.dtype:
                    grad_w.addmm_(buffer[:end - first].t(), h[first:end])
                else:  # 16-bit: the product in the parameters' dtype, the sum over the GEMMs in fp32
                    grad_w.add_(buffer[:end - first].t() @ h[first:end])
                first = end
        if deferred:
            ctx.save_for_backward(grad_h, buffer, h)
        elif grads:
            ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes, ctx.deferred = (h.dtype, weight.dtype), deferred
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h_dtype, w_dtype = ctx.dtypes
        if ctx.deferred:  # one GEMM over every token, the upstream scalar folded into the hidden states
            grad_h, buffer, h = ctx.saved_tensors
            grad_w = None
            if ctx.needs_input_grad[1]:  # the scalar in full (a 16-bit one would scale every row a little off)
                scaled = (h.to(grad_total.dtype) * grad_total).to(h_dtype)
                grad_w = torch.mm(buffer.t(), scaled).to(w_dtype)
            return grad_h.mul_(grad_total.to(h_dtype)), grad_w, None, None, None, None, None, None
        grad_h, grad_w = ctx.saved_tensors
        if grad_w.dtype == w_dtype:
            grad_w = grad_w.mul_(grad_total)
        else:  # scaled and cast in one pass
            grad_w = torch.mul(grad_w, grad_total, out=torch.empty(grad_w.shape, dtype=w_dtype,
                                                                    device=grad_w.device))
        return grad_h.mul_(grad_total.to(h_dtype)), grad_w, None, None, None, None, None, None
