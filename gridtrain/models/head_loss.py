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
target logit (the loss), then at once the logits' gradient ``softmax - one_hot`` and from
it the chunk's rows of the hidden states' gradient and its share of the head weight's
gradient; the chunk's logits are freed before the next chunk. Backward only multiplies
the two saved gradients by the upstream scalar. What is kept for backward is
``[tokens, d]`` + ``[vocab / tp, d]`` (in the accumulation dtype) instead of
``[tokens, vocab / tp]`` in fp32: less whenever a micro-batch has more tokens than
``d_model`` (memory.model counts it). The matrix products are the same three as the
unfused head's (logits, input gradient, weight gradient); no logits are recomputed, and
the elementwise passes over the logits (upcast, softmax, its gradient) run on
chunk-sized pieces that stay in cache. A forward without autograd (validation) computes
the loss only.

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
    return _FusedHeadLoss.apply(h, weight, labels.reshape(-1), vocab_size, tp.comm, rows, grads)


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, vocab_size, comm: CommGroup, rows: int, grads: bool):
        acc = torch.promote_types(h.dtype, torch.float32)  # the loss's dtype, as the unfused cross entropy's
        local = weight.shape[0]
        start = comm.rank * local if comm.size > 1 else 0
        pad_from = max(0, vocab_size - start) if start + local > vocab_size else None
        total = torch.zeros((), dtype=acc, device=h.device)
        grad_h = torch.empty_like(h) if grads else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if grads else None
        for a in range(0, h.shape[0], rows):
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
            g = probs.to(h.dtype)
            keep = valid.unsqueeze(1).to(h.dtype)  # ignored tokens: no gradient (rows of [rows, d], not of g)
            torch.mm(g, weight.to(h.dtype), out=grad_h[a:a + rows])
            grad_h[a:a + rows].mul_(keep)
            if acc == h.dtype:
                grad_w.addmm_(g.t(), hc * keep)
            else:  # 16-bit: the product in the parameters' dtype, the sum over chunks in fp32
                grad_w.add_(g.t() @ (hc * keep))
            del probs, g
        if grads:
            ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return (grad_h.mul_(grad_total.to(h_dtype)), grad_w.mul_(grad_total).to(w_dtype),
                None, None, None, None, None)
