"""The fused, chunked LM head + cross entropy (models/head_loss.py): the same loss and
gradients as the unfused head (fp64, 1e-9) in one process and vocabulary-parallel over
tp 2 (with and without sequence parallelism), ignored labels and padding columns
included; the micro-batch's full logits never exist (counted with a dispatch mode, no
timings); the memory model counts what it keeps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from gridtrain.config import preset_config
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.models.head_loss import (chunk_rows, defers_weight_gradient, fused_head_loss, head_loss_traffic_bytes,
                                        weight_grad_rows)
from gridtrain.parallel.comm import ByteCounter, CommGroup
from gridtrain.parallel.tensor_parallel import IGNORE_INDEX, TensorParallel, vocab_parallel_cross_entropy
from tests.harness import run_on_ranks

VOCAB, PADDED, D, B, S = 11, 16, 6, 2, 7  # padding columns on the last TP slice


def _inputs():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, S, D, dtype=torch.float64, generator=gen)
    w = torch.randn(PADDED, D, dtype=torch.float64, generator=gen)
    labels = torch.randint(0, VOCAB, (B, S), generator=gen)
    labels[0, 2] = labels[1, 0] = labels[1, 6] = IGNORE_INDEX  # fine-tuning: prompts ignored
    return x, w, labels


def _wide_inputs():
    """:func:`_inputs` widened to d_model 22 (14 tokens, fp64): the micro-batch's logits'
    gradients fit one weight-gradient buffer, so the weight gradient waits for backward."""
    x, w, labels = _inputs()
    x, w = torch.cat([x, x.flip(-1), x, -x[..., :4]], -1), torch.cat([w, -w, w.flip(-1), w[:, :4]], -1)
    assert x.shape[-1] == 22 and defers_weight_gradient(B * S, 22, 8) and not defers_weight_gradient(B * S, D, 8)
    return x, w, labels


def _unfused(x, w, labels, scale=1.7):
    """Loss, and gradients of x and w, through the full logits and torch's cross entropy."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x @ w.t(), labels, VOCAB, TensorParallel()).sum()
    (loss * scale).backward()
    return loss.detach(), x.grad, w.grad


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("chunks", [None, 1, 3, 14, 100])
def test_one_process_matches_the_unfused_loss(chunks):
    x, w, labels = _inputs()
    loss, gx, gw = _unfused(x, w, labels)
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    fused = fused_head_loss(xf, wf, labels, VOCAB, TensorParallel(), chunks)
    (fused * 1.7).backward()
    _close(fused, loss)
    _close(xf.grad, gx)
    _close(wf.grad, gw)
    assert (xf.grad[0, 2] == 0).all() and (wf.grad[VOCAB:] == 0).all()  # ignored token, padding rows


def test_without_autograd_only_the_loss():
    x, w, labels = _inputs()
    with torch.no_grad():
        fused = fused_head_loss(x, w, labels, VOCAB, TensorParallel(), 3)
    _close(fused, _unfused(x, w, labels)[0])


def test_chunk_rows():
    assert chunk_rows(14, 16, 3) == 5 and chunk_rows(14, 16, 100) == 1 and chunk_rows(14, 16, 1) == 14
    assert chunk_rows(512, 257, None) == 512  # small: one chunk
    assert chunk_rows(8 * 1024, 50304, None) == 164  # 1.6 GB of fp32 logits: 50 chunks of 164 tokens


class _LogitRows(TorchDispatchMode):
    """The most rows of logits (new tensors, not views, whose last dimension is the padded
    vocabulary) that any operation computed, and the rows of each such tensor allocated
    empty (the weight gradient's buffer of logits' gradients, filled chunk by chunk)."""

    ALLOCATIONS = ("empty", "new_empty", "empty_strided", "empty_like")

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows, self.allocated = vocab, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # e.g. the head weight transposed: no new memory
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                if func.overloadpacket.__name__ in self.ALLOCATIONS:
                    self.allocated.append(t.numel() // self.vocab)
                else:
                    self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_full_logits_never_exist():
    """A whole Decoder's training forward and backward: with 4 loss chunks no operation
    computes more than a quarter of the micro-batch's logits (forward or backward), and
    the one buffer that gathers the logits' gradients for the weight gradient's GEMMs
    holds half the micro-batch (tiny: d_model 64 fp32 tokens, the bytes of the [vocab, d]
    fp32 accumulator); unfused, the full logits exist."""
    cfg = preset_config("tiny").model
    cfg.dropout, cfg.vocab_size = 0.0, 1000  # a vocabulary wider than any other dimension
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    rows, allocated = {}, {}
    for chunks in (0, 4):
        model = Decoder(cfg, loss_chunks=chunks)
        init_parameters(model, 0)
        with _LogitRows(cfg.padded_vocab_size(1)) as seen:
            model(tokens, tokens, reduction="sum").backward()
        rows[chunks], allocated[chunks] = seen.rows, seen.allocated
    assert rows == {0: 2 * cfg.seq_len, 4: 2 * cfg.seq_len // 4}
    assert allocated[4] == [cfg.d_model] == [weight_grad_rows(2 * cfg.seq_len, 2 * cfg.seq_len // 4, cfg.d_model, 4)]


def test_the_weight_gradient_moves_about_the_unfused_heads_bytes():
    """Issue 54: each weight-gradient GEMM writes the whole [vocab, d] (and, summed in
    fp32, reads and writes it again), so one per 32 MiB chunk of logits (64 rows at a
    128K vocabulary) moved ~150 times the unfused head's bytes. Llama 3 8B's head (vocab
    131072, d 4096) on an 8K-token bf16 micro-batch: the logits' gradients of all 8192
    tokens take the fp32 accumulator's bytes, so they are kept and the weight gradient is
    one GEMM in backward: within 15% of the unfused head's bytes (6.1 GB against 5.4 GB;
    per chunk: 834 GB). GPT-2's head (50304 x 768) at 8K tokens keeps the accumulator and
    runs one GEMM per 1476 tokens (six): under 3x the unfused head's (4.8 GB against 1.7
    GB; per chunk: 25 GB). The flag's chunks (the logits' memory) are unchanged."""
    t, v, d = 8192, 131072, 4096
    rows = chunk_rows(t, v, None)
    assert rows == 64 and defers_weight_gradient(t, d, 2)
    unfused = head_loss_traffic_bytes(t, v, d, 2, fused=False)
    fused = head_loss_traffic_bytes(t, v, d, 2)
    per_chunk = head_loss_traffic_bytes(t, v, d, 2, group=rows)
    assert fused <= 2 * unfused and fused <= 1.15 * unfused and per_chunk >= 100 * unfused
    assert (round(unfused / 1e9, 1), round(fused / 1e9, 1), round(per_chunk / 1e9)) == (5.4, 6.1, 834)
    assert t * v * 2 <= v * d * 4  # what is kept instead of the fp32 accumulator: no more bytes
    t, v, d = 8192, 50304, 768
    rows = chunk_rows(t, v, None)
    assert not defers_weight_gradient(t, d, 2) and weight_grad_rows(t, rows, d, 2) == 9 * rows == 1476
    unfused, fused = head_loss_traffic_bytes(t, v, d, 2, fused=False), head_loss_traffic_bytes(t, v, d, 2)
    assert fused <= 3 * unfused and head_loss_traffic_bytes(t, v, d, 2, group=rows) >= 5 * fused


@pytest.mark.parametrize("chunks", [1, 3, 14])
def test_the_deferred_weight_gradient_keeps_no_more_than_the_accumulator(chunks):
    """fp64 with d_model 22 against 14 tokens: the logits' gradients of the micro-batch fit
    one buffer (no more bytes than the fp64 [vocab, d] accumulator), kept for backward with
    the hidden states instead of the accumulator; the loss and gradients still the
    unfused head's."""
    x, w, labels = _wide_inputs()
    kept = []
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        fused = fused_head_loss(xf, wf, labels, VOCAB, TensorParallel(), chunks)
    (fused * 1.7).backward()
    assert sum(kept) == B * S * PADDED * 8 + 2 * B * S * 22 * 8 and B * S * PADDED * 8 <= PADDED * 22 * 8
    loss, gx, gw = _unfused(x, w, labels)
    _close(fused, loss)
    _close(xf.grad, gx)
    _close(wf.grad, gw)


def test_decoder_summed_loss_matches_per_token_losses():
    """``reduction="sum"`` (fused, 3 chunks) against the per-token losses summed, fp64:
    the loss and every parameter's gradient (tied embedding included)."""
    cfg = preset_config("tiny").model
    cfg.dropout = 0.0
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)
    labels = tokens.roll(-1, 1).masked_fill(torch.rand(tokens.shape, generator=gen) < 0.3, IGNORE_INDEX)
    runs = []
    for chunks, reduction in ((3, "sum"), (0, "none")):
        model = Decoder(cfg, loss_chunks=chunks).double()
        init_parameters(model, 0)
        loss = model(tokens, labels, reduction=reduction).sum()
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    _close(runs[0][0], runs[1][0])
    for name, grad in runs[1][1].items():
        _close(runs[0][1][name], grad)


def _tp_parity(rank: int, world: int) -> None:
    for inputs in (_inputs, _wide_inputs):  # the weight gradient summed in the forward, and deferred
        _tp_parity_of(rank, *inputs())


def _tp_parity_of(rank: int, x, w, labels) -> None:
    loss, gx, gw = _unfused(x, w, labels)
    D = x.shape[-1]
    for sp in (False, True):
        tp = TensorParallel(CommGroup.of("tp", dist.group.WORLD, ByteCounter()), sp)
        for chunks in (1, 4):
            local_w = w[rank * PADDED // 2:(rank + 1) * PADDED // 2].clone().requires_grad_()
            xs = x.clone()
            if sp:  # a sequence shard in, the gathered whole sequence's gradient reduce-scattered out
                xs = torch.cat([xs, xs[:, :1]], 1)[:, rank * 4:(rank + 1) * 4]  # S 7 -> 8 for an even split
            xs = xs.contiguous().requires_grad_()
            lab = torch.cat([labels, torch.full((B, 1), IGNORE_INDEX)], 1) if sp else labels
            fused = fused_head_loss(xs, local_w, lab, VOCAB, tp, chunks)
            (fused * 1.7).backward()
            _close(fused, loss)
            _close(local_w.grad, gw[rank * PADDED // 2:(rank + 1) * PADDED // 2])
            expected = torch.cat([gx, torch.zeros(B, 1, D, dtype=gx.dtype)], 1)[:, rank * 4:(rank + 1) * 4] if sp \
                else gx
            _close(xs.grad, expected)


@pytest.mark.spawn
def test_vocab_parallel_matches_one_process_on_two_ranks():
    run_on_ranks(_tp_parity, 2)


def test_memory_model_counts_the_fused_head():
    """The activation formula's head term: the fused head keeps [tokens, d] + [vocab, d]
    instead of the fp32 softmax [tokens, vocab]."""
    from gridtrain.memory.model import expected_activation_peak
    from gridtrain.parallel.grid import ProcessGrid

    cfg = preset_config("small")
    cfg.training.device = "cpu"
    grid = ProcessGrid.build(1)
    automatic = expected_activation_peak(cfg, grid, 0, "cpu")
    cfg.activations.loss_chunks = 1
    fused = expected_activation_peak(cfg, grid, 0, "cpu")
    cfg.activations.loss_chunks = 0
    unfused = expected_activation_peak(cfg, grid, 0, "cpu")
    assert automatic == unfused  # logits within one chunk: nothing to save, the unfused head
    m, t = cfg.model, cfg.training
    tokens = m.seq_len * t.micro_batch_size
    e = 4
    diff = tokens * (m.padded_vocab_size(1) * 4 + 10) + tokens * m.d_model * e \
        - tokens * m.d_model * e - m.padded_vocab_size(1) * m.d_model * 4
    assert unfused - fused == pytest.approx(diff)


def test_memory_model_counts_the_deferred_weight_gradient():
    """Where the micro-batch's logits' gradients fit the weight gradient's buffer (small,
    fp32, one sequence of 128 tokens against d_model 128) the fused head keeps them and
    its input instead of the [vocab, d] accumulator: the activation formula's head term
    says so, and is what the fused head saves for backward."""
    from gridtrain.memory.model import expected_activation_peak, head_activation_bytes
    from gridtrain.parallel.grid import ProcessGrid

    cfg = preset_config("small")
    cfg.training.device, cfg.training.micro_batch_size = "cpu", 1
    grid = ProcessGrid.build(1)
    m, tokens, e = cfg.model, cfg.model.seq_len, 4
    vocab = m.padded_vocab_size(1)
    assert defers_weight_gradient(tokens, m.d_model, e)
    cfg.activations.loss_chunks = 1
    fused, fused_head = expected_activation_peak(cfg, grid, 0, "cpu"), head_activation_bytes(cfg, 1, False, tokens, e)
    cfg.activations.loss_chunks = 0
    unfused = expected_activation_peak(cfg, grid, 0, "cpu")
    assert unfused - fused == pytest.approx(tokens * (vocab * 4 + 10) - tokens * m.d_model * e - tokens * vocab * e)
    x = torch.randn(1, tokens, m.d_model, requires_grad=True)
    w = torch.randn(vocab, m.d_model, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        fused_head_loss(x, w, torch.randint(0, m.vocab_size, (1, tokens)), m.vocab_size, TensorParallel(), 1)
    assert sum(kept) == fused_head - tokens * m.d_model * e  # the final norm's input is the norm's


def test_the_automatic_choice_fuses_where_the_logits_outgrow_a_chunk():
    """Unset, --loss-chunks fuses where a micro-batch's fp32 logits exceed one chunk
    (32 MiB): GPT-2's vocabulary at 1024 tokens, not the tiny models' (which keep the
    numbers of a plain PyTorch loss bit for bit)."""
    from gridtrain.memory.model import fuses_loss
    from gridtrain.models.head_loss import worth_fusing

    assert worth_fusing(1024, 50304) and not worth_fusing(128, 320)
    cfg = preset_config("gpt2")
    assert fuses_loss(cfg, 1, 1024) and not fuses_loss(cfg, 1, 128)
    cfg.activations.loss_chunks = 0
    assert not fuses_loss(cfg, 1, 1024)
