"""Attention blocks: fused kernels that return the log-sum-exp, and the documents of a
packed window as the blocks they leave visible.

Context parallelism (:mod:`gridtrain.parallel.context_parallel`) and document masking
(``--document-mask``, :mod:`gridtrain.models.attention`) both cut attention into blocks
of (query range, key range): a block's output and log-sum-exp are merged exactly with the
others' (``context_parallel.merge``), and its backward takes the *whole* attention's
output and log-sum-exp, so that its probabilities and row sums are the whole's. This
module holds the two things they share.

**The block kernel** (:func:`block_kernel`: a pure function of device type, dtype and
head size, so that the choice is data a test reads):

* ``flash_cpu``: torch's fused CPU flash kernel (``_scaled_dot_product_flash_attention_
  for_cpu``), any float dtype, statistics in fp32 (fp64 for fp64); it reads shared
  key/value heads in place (grouped-query attention without repeating them).
* ``flash`` (CUDA, bf16/fp16, head size a multiple of 8 up to 256, a GPU with flash
  attention: sm80 and later): ``_scaled_dot_product_flash_attention``; log-sum-exp
  ``[b, heads, n]`` fp32; reads shared key/value heads in place (flash attention 2's
  grouped-query support).
* ``efficient`` (CUDA: fp32, or bf16/fp16 where flash is not available; head size a
  multiple of 8): the memory-efficient kernel ``_scaled_dot_product_efficient_attention``,
  fp32 arithmetic for fp32 inputs (no TF32). Its log-sum-exp has its rows padded to a
  multiple of 32 (``[b, heads, ceil(n / 32) 32]``): cut on the way out, padded again for its
  backward. It takes equal head counts, so shared key/value heads are repeated for it (the
  block's copy only) and their gradients summed back. Its CUDA backward reads the output
  with rows ``heads x d`` apart, as its forward lays it out, whatever strides it is given:
  :func:`efficient_backward_inputs` hands it the output (and its gradient) so laid out.
* ``matmul``: matrix products in fp32 (fp64 for fp64), exact on any device: fp64 on CUDA
  and every other device. The ``g = heads / kv_heads`` query heads that read one
  key/value head are folded into its rows, so one product serves them. It materialises
  the block's ``n x n`` scores: the fallback, not the plan.

cuDNN's attention (``_scaled_dot_product_cudnn_attention``, log-sum-exp ``[b, heads, n,
1]``) is not used: flash covers the same dtypes on the GPUs that have it. A causal block is
always square (a chunk's diagonal, or one document's span within it) and runs as the
kernel's own causal variant, whose top-left alignment is then the diagonal.

Nothing here has run on a GPU yet (there is none at hand): the CUDA kernels' shapes,
dtypes and layouts are checked under ``FakeTensorMode`` with fake CUDA tensors (the aten
ops' meta kernels), and ``make gpu-check`` checks their numbers on the first GPU.

**Documents as blocks.** A packed window's visible (query, key) pairs are block-diagonal by
documents: query i sees key j when both lie in one document and ``j <= i``. So document-masked
attention is plain causal attention on each document's contiguous span (one process:
:func:`document_attention`, a loop of fused causal blocks, no ``s x s`` mask), and under
context parallelism a chunk pair's visible region is a union of per-document rectangles
(:func:`pair_blocks`: all of the document's keys in the key chunk where that chunk precedes
the query chunk, its causal square on the diagonal), each one fused block merged as any
other; a pair with no rectangle is skipped. The spans are read on the host once per
micro-batch (:func:`document_spans`; on CUDA that is one device-to-host read of the ids,
cached by the micro-batch's ``Documents``).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from gridtrain.runtime import host_sync

aten = torch.ops.aten

KERNELS = ("flash_cpu", "flash", "efficient", "matmul")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# one row group's documents: (start, end) token spans, in order, covering the window
Spans = tuple[tuple[int, int], ...]


def block_kernel(device_type: str, dtype: torch.dtype, head_dim: int, *, flash: bool = True) -> str:
    """The kernel attention blocks run on a ``device_type`` device for ``dtype`` inputs of
    head size ``head_dim`` (``flash``: whether the GPU has flash attention). See the
    module docstring."""
    if device_type == "cpu":
        return "flash_cpu" if dtype in _FLOATS else "matmul"
    if device_type == "cuda" and head_dim % 8 == 0:
        if dtype in (torch.float16, torch.bfloat16) and flash and head_dim <= 256:
            return "flash"
        if dtype in (torch.float16, torch.bfloat16, torch.float32):
            return "efficient"
    return "matmul"


@lru_cache(maxsize=8)
def _cuda_has_flash(index: int | None) -> bool:
    """Whether CUDA device ``index`` runs torch's flash kernel (sm80 and later). Without a
    GPU (fake CUDA tensors in a dry run) the plan is for the GPUs the product runs on:
    yes."""
    if not torch.cuda.is_available():
        return True
    if not torch.backends.cuda.is_flash_attention_available():
        return False
    return torch.cuda.get_device_capability(index) >= (8, 0)


def kernel_for(q: torch.Tensor) -> str:
    """:func:`block_kernel` for the queries ``q`` at hand."""
    device = q.device
    flash = _cuda_has_flash(device.index) if device.type == "cuda" else True
    return block_kernel(device.type, q.dtype, q.shape[-1], flash=flash)


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype of scores, log-sum-exps and accumulators: fp32, or fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def every_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads that read them (none to repeat: ``x``)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def per_kv_head(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The inverse of :func:`every_head` for gradients: summed over the query heads."""
    return grad if grad.shape[1] == kv_heads else grad.unflatten(1, (kv_heads, -1)).sum(2)


def block_forward(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``q`` ``[b, heads, nq, d]`` over keys and values ``[b, kv_heads, nk, d]``
    (``causal``: a square diagonal block): the output (the kernel's dtype: ``q``'s for
    fused kernels, the wide one for ``matmul``) and the log-sum-exp ``[b, heads, nq]``
    in the wide dtype."""
    lse_dtype = wide(q.dtype)
    if kernel == "flash_cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.to(lse_dtype)
    if kernel == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse.to(lse_dtype)
    if kernel == "efficient":
        heads = q.shape[1]
        out, lse = aten._scaled_dot_product_efficient_attention(q, every_head(k, heads), every_head(v, heads), None,
                                                                True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., :q.shape[2]].to(lse_dtype)
    if kernel == "matmul":
        return _matmul_forward(q, k, v, causal, scale)
    raise ValueError(f"unknown attention block kernel {kernel!r}: one of {', '.join(KERNELS)}")


def block_backward(kernel: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block's queries, keys and values (the keys' and values' per kv
    head) given the *whole* attention's output ``out`` (``q``'s dtype) and log-sum-exp
    ``lse`` (wide, finite: every query sees itself) for these query rows."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if kernel == "flash_cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse.contiguous(), 0.0,
                                                                         causal, scale=scale)
    if kernel == "flash":
        # no dropout: the random state the forward would return is read by nothing
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.float().contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, seed,
            offset, scale=scale)
    if kernel == "efficient":
        n = q.shape[2]
        padded = torch.nn.functional.pad(lse.float(), (0, -n % 32)).contiguous()  # its rows in blocks of 32
        seed = torch.empty((), dtype=torch.int64)  # as its forward makes it without dropout: unread
        dout, q, k, v, out = efficient_backward_inputs(dout, q, every_head(k, heads), every_head(v, heads), out)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, padded, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, per_kv_head(dk, kv_heads), per_kv_head(dv, kv_heads)
    if kernel == "matmul":
        return _matmul_backward(dout, q, k, v, out, lse, causal, scale)
    raise ValueError(f"unknown attention block kernel {kernel!r}: one of {', '.join(KERNELS)}")


def in_forward_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[b, heads, n, d]`` laid out as the efficient kernel's forward lays out its
    output: ``[b, n, heads, d]`` contiguous in memory, seen transposed (``x`` itself where it
    is already, else a copy)."""
    t = x.transpose(1, 2)
    return x if t.is_contiguous() else t.contiguous().transpose(1, 2)


def efficient_backward_inputs(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The efficient kernel's backward inputs (``[b, heads, n, d]``, equal head counts) in
    the layouts its CUDA kernel reads correctly. ``_scaled_dot_product_efficient_attention_
    backward`` hands each one transposed to ``[b, n, heads, d]`` to ``_efficient_attention_
    backward`` (aten/src/ATen/native/transformers/cuda/attention_backward.cu), which copies
    ``grad_out`` to contiguous, requires ``q``, ``k``, ``v`` contiguous in the last
    dimension, and passes ``out``'s batch and head strides to the kernel but not its row
    stride: the kernel takes it to be ``heads x d`` (``o_strideM()`` in mem_eff_attention/
    kernel_backward.h), as in the forward's own output. An ``out`` laid out otherwise (a
    contiguous ``[b, heads, n, d]``, as context parallelism's merged output is) is read at
    the wrong places: wrong gradients, no error (torch's meta function checks no strides).
    So: ``out`` keeps its layout where its rows are ``heads x d`` apart (the forward's
    output, or a slice of it along the rows), else is copied to the forward's layout;
    ``dout`` in the forward's layout too (the copy the kernel would make); ``q``, ``k``,
    ``v`` contiguous in the last dimension."""
    heads, d = out.shape[1], out.shape[3]
    if out.stride(3) != 1 or out.stride(2) != heads * d:
        out = in_forward_layout(out)
    last = [x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v)]
    return (in_forward_layout(dout), *last, out)


# ---- the matrix-product kernel ------------------------------------------------------------------


def _fold(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, heads, n, d]`` -> ``[b, kv_heads, g n, d]`` in the wide dtype."""
    b, heads, n, d = x.shape
    return x.unflatten(1, (kv_heads, heads // kv_heads)).to(wide(x.dtype)).reshape(b, kv_heads, -1, d)


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


def _scores(qf: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(qf, k.transpose(-1, -2)) * scale
    if causal:
        n = k.shape[-2]
        s = s.masked_fill(_above_diagonal(n, qf.shape[-2] // n, qf.device), float("-inf"))
    return s


def _matmul_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    w = wide(q.dtype)
    s = _scores(_fold(q, k.shape[1]), k.to(w), causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]), v.to(w))
    return _unfold(out, q.shape[1]), _unfold(lse, q.shape[1])


def _matmul_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    w, heads, kv_heads = wide(q.dtype), q.shape[1], k.shape[1]
    qf, dof = _fold(q, kv_heads), _fold(dout, kv_heads)
    rowsum = (dof * _fold(out, kv_heads)).sum(-1)
    lse_f = lse.to(w).unflatten(1, (kv_heads, -1)).reshape(lse.shape[0], kv_heads, -1)
    kw, vw = k.to(w), v.to(w)
    p = torch.exp(_scores(qf, kw, causal, scale) - lse_f[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dof)
    ds = p * (torch.matmul(dof, vw.transpose(-1, -2)) - rowsum[..., None])
    dq = torch.matmul(ds, kw) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    return _unfold(dq, heads), dk, dv


# ---- documents as blocks ------------------------------------------------------------------------


def document_spans(ids: torch.Tensor) -> tuple[Spans, ...]:
    """Per row of ``ids`` (``[b, s]`` document ids, non-decreasing: a document starts where
    the id changes), its documents' ``(start, end)`` spans, read on the host (the named
    host read ``document_spans``: free on CPU, one device-to-host copy of the ids per
    micro-batch on a GPU). In a dry run (fake ids) the stand-in is one document per row,
    the causal worst case."""
    b, s = ids.shape
    return host_sync.read("document_spans", ids, _spans_of, stand_in=lambda: tuple(((0, s),) for _ in range(b)))


def _spans_of(ids: torch.Tensor) -> tuple[Spans, ...]:
    host = ids.detach().to("cpu")
    s = host.shape[1]
    changes = torch.nonzero(host[:, 1:] != host[:, :-1]).tolist()  # (row, index before a new document)
    starts: list[list[int]] = [[0] for _ in range(host.shape[0])]
    for row, i in changes:
        starts[row].append(i + 1)
    return tuple(tuple(zip(row, row[1:] + [s])) for row in starts)


def row_groups(spans: tuple[Spans, ...]) -> list[tuple[slice, Spans]]:
    """The batch rows that share documents, as slices: all rows at once where every row
    has the same spans (one block call serves them), else one row at a time."""
    if all(row == spans[0] for row in spans):
        return [(slice(None), spans[0])]
    return [(slice(r, r + 1), row) for r, row in enumerate(spans)]


def pair_blocks(spans: Spans, n: int, q_chunk: int, k_chunk: int) -> list[tuple[int, int, int, int, bool]]:
    """The visible blocks of a query chunk's queries over a key chunk's keys (chunks of
    ``n`` tokens, by index along the sequence) for a row with documents ``spans``:
    ``(q_start, q_end, k_start, k_end, causal)`` within the chunks. Empty where the key
    chunk follows the query chunk or no document spans both."""
    if k_chunk > q_chunk:
        return []
    q0, k0 = q_chunk * n, k_chunk * n
    blocks = []
    for start, end in spans:
        qa, qb = max(start, q0), min(end, q0 + n)
        ka, kb = max(start, k0), min(end, k0 + n)
        if qa < qb and ka < kb:
            blocks.append((qa - q0, qb - q0, ka - k0, kb - k0, q_chunk == k_chunk))
    return blocks


class _DocumentAttention(torch.autograd.Function):
    """Causal attention within each document's span, one fused block per (row group,
    document); keeps q, k, v, the output and one log-sum-exp per query (as the fused
    causal kernel does)."""

    @staticmethod
    def forward(ctx, q, k, v, spans, scale):
        kernel = kernel_for(q)
        groups = row_groups(spans)
        b, heads, s, d = q.shape
        # [b, s, heads, d] in memory, as torch's fused CPU kernel lays its output out: the
        # heads then join for the output projection as a view (no copy kept beside it)
        out = q.new_empty(b, s, heads, d, dtype=q.dtype if kernel != "matmul" else wide(q.dtype)).transpose(1, 2)
        lse = q.new_empty(b, heads, s, dtype=wide(q.dtype))
        for rows, row_spans in groups:
            for a, e in row_spans:
                o, l = block_forward(kernel, q[rows, :, a:e], k[rows, :, a:e], v[rows, :, a:e], True, scale)
                out[rows, :, a:e] = o
                lse[rows, :, a:e] = l
        out = out.to(q.dtype)
        ctx.kernel, ctx.groups, ctx.scale = kernel, groups, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for rows, row_spans in ctx.groups:
            for a, e in row_spans:
                g = block_backward(ctx.kernel, dout[rows, :, a:e], q[rows, :, a:e], k[rows, :, a:e], v[rows, :, a:e],
                                   out[rows, :, a:e], lse[rows, :, a:e], True, ctx.scale)
                dq[rows, :, a:e], dk[rows, :, a:e], dv[rows, :, a:e] = g
        return dq, dk, dv, None, None


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: tuple[Spans, ...],
                       scale: float | None = None) -> torch.Tensor:
    """Document-masked attention of ``q`` ``[b, heads, s, d]`` over ``k``, ``v`` ``[b,
    kv_heads, s, d]`` with each row's documents ``spans`` (:func:`document_spans`):
    plain causal attention on each document's span, through the fused block kernel
    (no ``s x s`` tensor; shared key/value heads read in place where the kernel can)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _DocumentAttention.apply(q, k, v, spans, scale)
