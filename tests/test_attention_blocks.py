"""Attention blocks (gridtrain/parallel/attention_blocks.py) as data: which kernel runs on
which device and dtype; the CUDA kernels' shapes, dtypes and log-sum-exp layouts under
fake CUDA tensors (no GPU here: their numbers are gpu-check's); documents as spans and
as each chunk pair's blocks; document-masked attention of one process equal to the
masked reference (fp64, forward and gradients, grouped queries) without an ``s x s``
tensor."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from gridtrain.parallel import attention_blocks, context_parallel
from gridtrain.parallel.attention_blocks import (block_kernel, document_attention, document_spans, pair_blocks,
                                                 row_groups)
from gridtrain.parallel.context_parallel import document_blocks, visible_pairs

bf16, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def test_the_block_kernel_of_each_device_and_dtype():
    table = {(device, dtype, d, flash): block_kernel(device, dtype, d, flash=flash)
             for device in ("cpu", "cuda", "mps") for dtype in (bf16, f16, f32, f64) for d in (64, 100, 512)
             for flash in (True, False)}
    for (device, dtype, d, flash), kernel in table.items():
        if device == "cpu":
            expected = "flash_cpu"
        elif device == "mps" or d % 8 or dtype == f64:
            expected = "matmul"  # no fused kernel: fp64 on CUDA, other devices, odd head sizes
        elif dtype in (bf16, f16) and flash and d <= 256:
            expected = "flash"
        else:
            expected = "efficient"  # fp32 on CUDA; bf16/fp16 without flash or with heads over 256
        assert kernel == expected, (device, dtype, d, flash)


def _fake_cuda_blocks(kernel: str, dtype: torch.dtype, device: str):
    """One causal and one rectangular block forward and backward on fake CUDA tensors, or
    on meta tensors (the same meta kernels; a CPU build of torch makes fake CUDA tensors
    but cannot view them, and the efficient kernel's log-sum-exp is cut by a view):
    4 query heads, 2 kv heads, 40 queries (not a multiple of 32)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    results = []
    with FakeTensorMode() if device == "cuda" else contextlib.nullcontext():
        for causal, nq, nk in [(True, 40, 40), (False, 25, 17)]:
            q = torch.empty(2, 4, nq, 64, dtype=dtype, device=device)
            k, v = (torch.empty(2, 2, nk, 64, dtype=dtype, device=device) for _ in range(2))
            out, lse = attention_blocks.block_forward(kernel, q, k, v, causal, 0.125)
            dout = torch.empty(2, 4, nq, 64, dtype=dtype, device=device)
            grads = attention_blocks.block_backward(kernel, dout, q, k, v, dout, lse, causal, 0.125)
            results.append(((out.shape, out.dtype, out.device.type), (lse.shape, lse.dtype),
                            [(g.shape, g.dtype) for g in grads]))
    return results


CUDA_CASES = [("flash", bf16, "cuda"), ("flash", f16, "cuda"), ("flash", bf16, "meta"), ("efficient", f32, "meta"),
              ("efficient", bf16, "meta"), ("matmul", f64, "meta")]
if torch.backends.cuda.is_built():
    CUDA_CASES += [("efficient", f32, "cuda"), ("matmul", f64, "cuda")]


@pytest.mark.parametrize("kernel, dtype, device", CUDA_CASES)
def test_cuda_block_kernels_have_the_shapes_of_the_cpu_kernel(kernel, dtype, device):
    """Under fake CUDA tensors (or meta ones): the output in the inputs' dtype (the
    matmul kernel's in the wide one), one log-sum-exp per (query head, query) in fp32 (the
    efficient kernel's 32-row padding cut off, and padded again for its backward),
    key/value gradients per kv head."""
    wide = torch.float64 if dtype == f64 else torch.float32
    for (nq, nk), got in zip([(40, 40), (25, 17)], _fake_cuda_blocks(kernel, dtype, device)):
        out, lse, grads = got
        assert out == (torch.Size([2, 4, nq, 64]), dtype if kernel != "matmul" else wide, device)
        assert lse == (torch.Size([2, 4, nq]), wide)
        expected = [torch.Size([2, 4, nq, 64]), torch.Size([2, 2, nk, 64]), torch.Size([2, 2, nk, 64])]
        assert [g[0] for g in grads] == expected


def test_cp_attention_blocks_run_the_flash_kernel_with_documents():
    """A cp rank's forward and backward blocks (cp 2, documents, grouped queries) through
    the CUDA flash kernel's meta kernels (meta bf16 tensors: a CPU build of torch cannot
    view fake CUDA ones): every block's shapes hold, the output and the gradients come
    out whole."""
    spans = ((0, 5), (5, 30), (30, 32))
    b, heads, kv_heads, n2, d = 1, 4, 2, 16, 64
    q = torch.empty(b, heads, n2, d, dtype=bf16, device="meta")
    kv = torch.empty(2, b, kv_heads, n2, d, dtype=bf16, device="meta")
    qh, acc = q.chunk(2, dim=2), [None, None]
    for src in (0, 1):
        context_parallel._forward_blocks(qh, kv, visible_pairs(2, 0, src), acc, 0.125,
                                         document_blocks((spans,), 2, 0, src), "flash")
    out = torch.cat([a[0] for a in acc], dim=2).to(bf16)
    dqh = [torch.zeros(h.shape, dtype=f32, device="meta") for h in qh]
    for src in (0, 1):
        dkv = context_parallel._backward_blocks(qh, out.chunk(2, dim=2), out.chunk(2, dim=2),
                                                [acc[0][1], acc[1][1]], kv, visible_pairs(2, 0, src), dqh, 0.125,
                                                document_blocks((spans,), 2, 0, src), "flash")
        assert dkv.shape == kv.shape and dkv.dtype == f32
    assert out.shape == q.shape and acc[0][1].shape == (b, heads, n2 // 2) and acc[0][1].dtype == f32


def _forward_layout(b: int, heads: int, n: int, d: int, **kw) -> torch.Tensor:
    """A ``[b, heads, n, d]`` tensor as the efficient kernel's forward makes its output."""
    return torch.randn(b, n, heads, d, **kw).transpose(1, 2)


def _kernel_reads_correctly(out: torch.Tensor) -> bool:
    """What the efficient kernel's CUDA backward assumes of ``out``, seen as it sees it
    (``[b, n, heads, d]``): the last dimension contiguous, rows ``heads x d`` apart."""
    t = out.transpose(1, 2)
    return t.stride(3) == 1 and t.stride(1) == t.shape[2] * t.shape[3]


def test_the_efficient_backward_gets_its_inputs_in_the_forwards_layout():
    """Issue 54, as data on CPU tensors: the efficient kernel's CUDA backward reads ``out``
    with rows ``heads x d`` apart whatever its strides (attention_backward.cu passes no
    row stride; kernel_backward.h's o_strideM() is heads x d). A context-parallel output
    (contiguous [b, heads, n, d], halves of it) is laid out again as the forward lays it
    out; the forward's own output and its row slices (document blocks) are handed on as
    they are (no copy); the output's gradient comes in the forward's layout (the copy the
    kernel makes otherwise); q, k, v contiguous in the last dimension. Values unchanged."""
    b, heads, n, d = 2, 4, 12, 8
    q, k, v = (torch.randn(b, heads, n, d) for _ in range(3))
    merged = torch.randn(b, heads, 2 * n, d)  # context parallelism: torch.cat of the halves
    assert not _kernel_reads_correctly(merged.chunk(2, dim=2)[1])
    outs = (merged.chunk(2, dim=2)[1], _forward_layout(b, heads, n, d),
            _forward_layout(b, heads, 3 * n, d)[:, :, 5:17], _forward_layout(b, heads, n, d)[1:])
    for out in outs:
        dout = torch.randn(b, heads, 2 * n, d)[:, :, :n] if out.shape[0] == b else torch.randn(1, heads, n, d)
        qb, kb, vb = (x[:out.shape[0]] for x in (q, k, v.transpose(-1, -2).contiguous().transpose(-1, -2)))
        got = attention_blocks.efficient_backward_inputs(dout, qb, kb, vb, out)
        g_dout, g_q, g_k, g_v, g_out = got
        assert _kernel_reads_correctly(g_out) and torch.equal(g_out, out)
        assert g_dout.transpose(1, 2).is_contiguous() and torch.equal(g_dout, dout)
        assert all(x.stride(-1) == 1 and torch.equal(x, y) for x, y in zip((g_q, g_k, g_v), (qb, kb, vb)))
        if _kernel_reads_correctly(out):
            assert g_out.data_ptr() == out.data_ptr()  # the forward's layout: no copy
    assert g_q.data_ptr() == qb.data_ptr()  # already contiguous in the last dimension: no copy
    ready = _forward_layout(b, heads, n, d)
    assert attention_blocks.efficient_backward_inputs(ready, q, k, v, ready)[0] is ready


@pytest.mark.skipif(not torch.backends.cuda.is_built(),
                    reason="needs a CUDA build of torch (fake CUDA tensors that views and the efficient kernel's "
                           "meta functions accept); the CPU build's check is "
                           "test_the_efficient_backward_gets_its_inputs_in_the_forwards_layout")
@pytest.mark.parametrize("whose", ["cp", "documents"])
def test_the_efficient_cuda_backward_is_handed_the_forwards_layout(whose):
    """Issue 54, on fake CUDA tensors (bf16, head size 320: past flash's 256, so the
    efficient kernel): gridtrain's block backward as context parallelism calls it (the
    merged output, contiguous [b, heads, n, d], in halves) and as document attention does
    (the forward's layout, in row slices) hands _scaled_dot_product_efficient_attention_
    backward an output whose transpose, what _efficient_attention_backward receives, has
    rows heads x d apart and the strides the forward produced (up to the slice), and an
    output gradient already contiguous in that layout."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.args = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (aten._scaled_dot_product_efficient_attention_backward.default,
                        aten._efficient_attention_backward.default):
                self.args.append((func, args))
            return func(*args, **(kwargs or {}))

    aten = torch.ops.aten
    b, heads, kv_heads, n, d = 2, 4, 2, 40, 320
    with FakeTensorMode():
        q = torch.empty(b, heads, 2 * n, d, dtype=bf16, device="cuda")
        k, v = (torch.empty(b, kv_heads, 2 * n, d, dtype=bf16, device="cuda") for _ in range(2))
        assert attention_blocks.kernel_for(q) == "efficient"
        out, lse = attention_blocks.block_forward("efficient", q, k, v, True, 0.125)
        forward_strides = out.stride()
        assert _kernel_reads_correctly(out)
        if whose == "cp":  # _CPAttention: torch.cat of the merged halves, chunked again for backward
            out, dout = out.contiguous(), torch.empty(b, heads, 2 * n, d, dtype=bf16, device="cuda")
            blocks = [(slice(None), 0, n, 0, n, True), (slice(None), n, 2 * n, 0, 2 * n, False)]
        else:  # _DocumentAttention: the forward's layout, one block per document, a row group of one row
            dout = torch.empty(b, heads, 2 * n, d, dtype=bf16, device="cuda")
            blocks = [(slice(1, 2), 0, 17, 0, 17, True), (slice(None), 17, 2 * n, 17, 2 * n, True)]
        with Calls() as calls:
            for rows, qa, qb, ka, kb, causal in blocks:
                grads = attention_blocks.block_backward(
                    "efficient", dout[rows, :, qa:qb], q[rows, :, qa:qb], k[rows, :, ka:kb], v[rows, :, ka:kb],
                    out[rows, :, qa:qb], lse[rows, :, qa:qb], causal, 0.125)
                assert [g.shape for g in grads] == [q[rows, :, qa:qb].shape, k[rows, :, ka:kb].shape,
                                                    v[rows, :, ka:kb].shape]
    assert len(calls.args) == len(blocks)
    for func, args in calls.args:
        dout_arg, q_arg, k_arg, v_arg = args[:4]
        out_arg = args[5]
        if func is aten._scaled_dot_product_efficient_attention_backward.default:  # what it hands on
            dout_arg, q_arg, k_arg, v_arg, out_arg = (x.transpose(1, 2) for x in (dout_arg, q_arg, k_arg, v_arg,
                                                                                  out_arg))
        rows, h, dim = out_arg.shape[1], out_arg.shape[2], out_arg.shape[3]
        assert out_arg.stride()[1:] == (h * dim, dim, 1) == (forward_strides[2], forward_strides[1],
                                                             forward_strides[3])
        assert dout_arg.is_contiguous() and dout_arg.shape == out_arg.shape
        assert all(x.stride(-1) == 1 for x in (q_arg, k_arg, v_arg)) and rows > 0


def test_documents_as_spans_and_as_the_blocks_of_chunk_pairs():
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 3, 3, 3, 3, 3, 3, 3],
                        [0] * 16])
    spans = document_spans(ids)
    assert spans == (((0, 3), (3, 8), (8, 9), (9, 16)), ((0, 16),))
    assert row_groups(spans) == [(slice(0, 1), spans[0]), (slice(1, 2), spans[1])]
    assert row_groups((spans[1], spans[1])) == [(slice(None), spans[1])]
    # chunks of 4: a document's causal square on the diagonal, its whole keys before it
    assert pair_blocks(spans[0], 4, 1, 1) == [(0, 4, 0, 4, True)]
    assert pair_blocks(spans[0], 4, 1, 0) == [(0, 4, 3, 4, False)]
    assert pair_blocks(spans[0], 4, 3, 2) == [(0, 4, 1, 4, False)]
    assert pair_blocks(spans[0], 4, 2, 1) == []  # no document spans chunks 1 and 2
    assert pair_blocks(spans[0], 4, 2, 2) == [(0, 1, 0, 1, True), (1, 4, 1, 4, True)]
    assert pair_blocks(spans[0], 4, 3, 0) == [] and pair_blocks(spans[0], 4, 0, 1) == []
    # cp 2: rank 1 holds chunks 1 and 2; against rank 0's chunks 0 and 3 only (1, 0) and (2, 0) may see
    blocks = document_blocks((spans[0],), 2, 1, 0)
    assert blocks == {(0, 0): [(slice(None), 0, 4, 3, 4, False)]}  # chunk 2 sees nothing of chunk 0: skipped


def _masked_reference(q, k, v, ids):
    visible = (ids[:, :, None] == ids[:, None, :]) & torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=visible[:, None], enable_gqa=True)
    return out, leaves


@pytest.mark.parametrize("kernel", ["flash_cpu", "matmul"])
def test_document_attention_equals_the_masked_reference_and_keeps_no_square(kernel, monkeypatch):
    """fp64, grouped queries (4 heads, 2 kv heads), rows with different documents: the
    output and the gradients of q, k and v equal masked attention's to 1e-12; nothing it
    keeps for backward has ``s x s`` elements or more."""
    monkeypatch.setattr(attention_blocks, "kernel_for", lambda q: kernel)
    s, b, heads, kv_heads, d = 48, 2, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, heads, s, d, generator=g, dtype=f64)
    k, v = (torch.randn(b, kv_heads, s, d, generator=g, dtype=f64) for _ in range(2))
    w = torch.randn(b, heads, s, d, generator=g, dtype=f64)
    ids = torch.stack([torch.arange(s) // 7, (torch.arange(s) >= 30).long()])
    ref, leaves = _masked_reference(q, k, v, ids)
    (ref * w).sum().backward()
    mine = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t):
        out = document_attention(*mine, document_spans(ids), 1 / math.sqrt(d))
    (out * w).sum().backward()
    assert (out - ref).abs().max() < 1e-12
    for m, leaf in zip(mine, leaves):
        assert (m.grad - leaf.grad).abs().max() < 1e-12
    assert kept and max(kept) < s * s * b * heads / 2  # q, k, v, the output, the log-sum-exp


# ---- on a GPU (make gpu-check; skipped without one) ------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check runs it)")
TOLERANCE = {bf16: 3e-2, f16: 5e-3, f32: 1e-4}  # of the largest reference value


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    err = (got.double().cpu() - want.double().cpu()).abs().max().item()
    assert err <= TOLERANCE[dtype] * max(want.abs().max().item(), 1e-6), (what, err)


@cuda
@pytest.mark.parametrize("dtype", [bf16, f16, f32])
def test_cuda_block_kernels_equal_the_exact_kernel(dtype):
    """The kernel chosen for CUDA (flash for bf16/fp16, memory-efficient for fp32) on a
    causal block and a rectangular one (grouped queries, rows not a multiple of 32):
    output, log-sum-exp and gradients (given the block's own output and log-sum-exp)
    equal the fp64 matrix-product kernel's on the same (rounded) inputs."""
    kernel = attention_blocks.kernel_for(torch.empty(1, 1, 1, 64, dtype=dtype, device="cuda"))
    assert kernel == ("efficient" if dtype == f32 else "flash") or not attention_blocks._cuda_has_flash(None)
    g = torch.Generator().manual_seed(0)
    for causal, nq, nk in [(True, 72, 72), (False, 45, 100)]:
        q = torch.randn(2, 8, nq, 64, generator=g).to(dtype)
        k, v = (torch.randn(2, 2, nk, 64, generator=g).to(dtype) for _ in range(2))
        dout = torch.randn(2, 8, nq, 64, generator=g).to(dtype)
        ref_out, ref_lse = attention_blocks.block_forward("matmul", q.double(), k.double(), v.double(), causal, 0.125)
        ref = attention_blocks.block_backward("matmul", dout.double(), q.double(), k.double(), v.double(), ref_out,
                                              ref_lse, causal, 0.125)
        qc, kc, vc, dc = (x.cuda() for x in (q, k, v, dout))
        out, lse = attention_blocks.block_forward(kernel, qc, kc, vc, causal, 0.125)
        assert lse.dtype == f32 and lse.shape == (2, 8, nq)
        _close(out, ref_out, dtype, "output")
        _close(lse, ref_lse, f32, "log-sum-exp")
        grads = attention_blocks.block_backward(kernel, dc, qc, kc, vc, out.to(dtype), lse, causal, 0.125)
        for got, want, name in zip(grads, ref, ("dq", "dk", "dv")):
            _close(got, want, dtype, name)


@cuda
@pytest.mark.parametrize("dtype", [bf16, f32])
def test_cuda_document_attention_and_cp_blocks_equal_the_masked_reference(dtype):
    """On the GPU: one process's document attention, and cp 2's and 4's chunk-pair blocks
    with and without documents (every rank's, ring order), equal masked attention in fp64
    on the CPU (outputs and gradients) to the dtype's rounding."""
    from tests.test_document_mask import _cp_attention_of_every_rank

    s, b, heads, kv_heads, d = 128, 2, 8, 2, 64
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, heads, s, d, generator=g).to(dtype)
    k, v = (torch.randn(b, kv_heads, s, d, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(b, heads, s, d, generator=g).to(dtype)
    ids = torch.stack([torch.arange(s) // 37, (torch.arange(s) >= 70).long()])
    ref, leaves = _masked_reference(q.double(), k.double(), v.double(), ids)
    (ref * w.double()).sum().backward()
    mine = [x.cuda().requires_grad_() for x in (q, k, v)]
    out = document_attention(*mine, document_spans(ids))
    (out * w.cuda()).sum().backward()
    for got, want, name in [(out, ref, "output"), *[(m.grad, leaf.grad, "grad") for m, leaf in zip(mine, leaves)]]:
        _close(got.detach(), want.detach(), dtype, name)
    causal, causal_leaves = _masked_reference(q.double(), k.double(), v.double(), torch.zeros_like(ids))
    (causal * w.double()).sum().backward()
    for cp in (2, 4):
        for docs, want, want_leaves in [(ids, ref, leaves), (None, causal, causal_leaves)]:
            outs, dqs, dks, dvs = _cp_attention_of_every_rank(q.cuda(), k.cuda(), v.cuda(), docs, cp, w.cuda())
            for r in range(cp):
                for got, full in [(outs[r], want), (dqs[r], want_leaves[0].grad), (dks[r], want_leaves[1].grad),
                                  (dvs[r], want_leaves[2].grad)]:
                    _close(got, context_parallel.split_sequence(full.detach(), cp, r, dim=2), dtype, f"cp {cp}")
