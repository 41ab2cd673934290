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
from gridtrain.models.head_loss import chunk_rows, fused_head_loss
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
    vocabulary) that any operation produced."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # e.g. the head weight transposed: no new memory
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_full_logits_never_exist():
    """A whole Decoder's training forward and backward: with 4 loss chunks no tensor holds
    more than a quarter of the micro-batch's logits (forward or backward); unfused, the
    full logits exist."""
    cfg = preset_config("tiny").model
    cfg.dropout, cfg.vocab_size = 0.0, 1000  # a vocabulary wider than any other dimension
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    rows = {}
    for chunks in (0, 4):
        model = Decoder(cfg, loss_chunks=chunks)
        init_parameters(model, 0)
        with _LogitRows(cfg.padded_vocab_size(1)) as seen:
            model(tokens, tokens, reduction="sum").backward()
        rows[chunks] = seen.rows
    assert rows == {0: 2 * cfg.seq_len, 4: 2 * cfg.seq_len // 4}


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
    x, w, labels = _inputs()
    loss, gx, gw = _unfused(x, w, labels)
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
