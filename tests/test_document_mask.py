"""Document masking (``--document-mask``): a packed window trains each of its documents as
if alone. As data, in one process, fp64: per-token losses and gradients of a packed
window equal those of each document's piece run as its own sequence (GPT-2 and Llama,
both attention cores, selective and full recomputation, a recomputed micro-batch rebuilt
after a later one ran forward); context parallelism's chunk-pair kernels with documents
equal one process's masked attention for cp 2 and 4 (forward and gradients). Spawned
(one world of 4 ranks): document-masked runs on tp 2 + SP, pp 4 (1f1b, full
recomputation, middle stages), cp 2 ring and cp 2 all-gather x tp 2 train the
one-process model (1e-9)."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gridtrain.config import ConfigError, preset_config, set_fields
from gridtrain.data import Datasets
from gridtrain.models.attention import Documents
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.parallel import context_parallel
from gridtrain.parallel.attention_blocks import document_spans
from gridtrain.parallel.context_parallel import (_backward_blocks, _forward_blocks, attend, document_blocks,
                                                 local_positions, ring_source, split_sequence, visible_pairs)
from gridtrain.parallel.grid import ProcessGrid
from gridtrain.parallel.recompute import Recomputation, RecomputePolicy
from gridtrain.training.validate import validate

# ---- documents as data ---------------------------------------------------------------------------

# two packed windows of 64 tokens: document lengths along each
LENGTHS = [[5, 20, 1, 30, 8], [64]]


def _documents(lengths: list[list[int]]) -> torch.Tensor:
    return torch.tensor([sum(([d] * n for d, n in enumerate(row)), []) for row in lengths])


def test_positions_restart_at_each_document_and_the_mask_stays_inside_it():
    docs = Documents(torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3]]))
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    visible = docs.visible()[0, 0]
    assert visible.shape == (8, 8)
    assert visible[4].tolist() == [False, False, False, True, True, False, False, False]
    assert visible[5].tolist() == [False] * 5 + [True, False, False]
    assert torch.equal(visible, visible.tril())


def _model(arch: str, attention: str, recompute: str = "none") -> Decoder:
    cfg = preset_config("llama-tiny" if arch == "llama" else "tiny").model
    cfg.attention = attention
    policy = RecomputePolicy(recompute)
    model = Decoder(cfg, recompute=Recomputation(policy))
    init_parameters(model, 0)
    return model.double()


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 257, (2, 65), generator=g)
    return tokens[:, :-1], tokens[:, 1:], _documents(LENGTHS)


def _alone(model: Decoder, tokens, labels, lengths) -> tuple[torch.Tensor, dict]:
    """Per-token losses of each document's piece run as its own sequence, and the
    gradients of their sum."""
    model.zero_grad()
    rows = []
    for r, row in enumerate(lengths):
        pieces, start = [], 0
        for n in row:
            pieces.append(model(tokens[r:r + 1, start:start + n], labels[r:r + 1, start:start + n]))
            start += n
        rows.append(torch.cat(pieces, dim=1))
    losses = torch.cat(rows)
    losses.sum().backward()
    return losses.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _packed(model: Decoder, tokens, labels, documents) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    losses = model(tokens, labels, documents=documents)
    losses.sum().backward()
    return losses.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-9, what: str = "") -> None:
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-30)
    assert (a - b).abs().max().item() <= rtol * scale, what


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_packed_window_trains_each_document_as_if_alone(arch, attention, recompute):
    """Per-token losses and every gradient of a packed window with documents equal
    those of each document's piece run alone (fp64, 1e-9), and the same with
    recomputation; without documents, the window's losses differ (attention crosses)."""
    model = _model(arch, attention, recompute)
    tokens, labels, documents = _batch()
    alone, alone_grads = _alone(model, tokens, labels, LENGTHS)
    packed, grads = _packed(model, tokens, labels, documents)
    _assert_close(packed, alone)
    for name, g in grads.items():
        _assert_close(g, alone_grads[name], what=name)
    assert (model(tokens, labels) - alone).abs().max() > 1e-3  # unmasked: a different model input


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_a_recomputed_micro_batch_masks_with_its_own_documents(recompute):
    """Two micro-batches with different documents run forward in turn, then backward in
    turn (as 1F1B's warm-up does): the first one's recomputation, after the second ran
    forward, rebuilds with the first one's documents."""
    model = _model("llama", "sdpa", recompute)
    reference = _model("llama", "sdpa")
    batches = [_batch(0), (*_batch(1)[:2], _documents([[64], [10, 10, 44]]))]
    expected = {k: torch.zeros_like(p) for k, p in reference.named_parameters()}
    for tokens, labels, documents in batches:
        for k, g in _packed(reference, tokens, labels, documents)[1].items():
            expected[k] += g
    model.zero_grad()
    losses = [model(t, y, documents=d).sum() for t, y, d in batches]
    for loss in losses:
        loss.backward()
    assert model.recompute.recomputed > 0
    for name, p in model.named_parameters():
        _assert_close(p.grad, expected[name], what=name)


def test_attention_dropout_with_documents_runs_per_document():
    """With attention dropout the fused core calls scaled_dot_product_attention per
    document (its own dropout): a training step runs forward and backward, and in eval
    mode (no dropout) the losses equal the dropout-free model's."""
    tokens, labels, documents = _batch()
    plain = _model("llama", "sdpa")
    cfg = preset_config("llama-tiny").model
    cfg.attention, cfg.dropout = "sdpa", 0.1
    model = Decoder(cfg, recompute=Recomputation(RecomputePolicy("none")))
    init_parameters(model, 0)
    model.double().train()
    model(tokens, labels, documents=documents).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    model.eval()
    _assert_close(model(tokens, labels, documents=documents).detach(),
                  plain(tokens, labels, documents=documents).detach())


def test_generation_with_a_cache_takes_no_documents():
    model = _model("gpt2", "sdpa")
    tokens, _, documents = _batch()
    with pytest.raises(ValueError, match="generation takes no documents"):
        model(tokens, cache=model.new_cache(2), documents=documents)


# ---- context parallelism's chunk pairs with documents --------------------------------------------


def _masked_attention(q, k, v, documents):
    """One process: grouped-query attention within documents, with the inputs' gradients."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=Documents(documents).visible(), enable_gqa=True)
    return out, leaves


def _cp_attention_of_every_rank(q, k, v, documents, cp: int, w):
    """Every cp rank's output and input gradients for upstream gradient ``w``, from the
    chunk-pair kernels the cp attention runs (ring order), in one process: the
    gradients of each rank's keys and values summed over the ranks that read them."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    wide = torch.promote_types(q.dtype, torch.float32)  # accumulators, as the cp attention keeps them
    kv = [torch.stack([split_sequence(k, cp, r, dim=2), split_sequence(v, cp, r, dim=2)]) for r in range(cp)]
    outs, dqs, dkv = [], [], [torch.zeros(b.shape, dtype=wide, device=b.device) for b in kv]
    spans = None if documents is None else document_spans(documents)  # None: causal

    def blocks(r: int, src: int):
        return None if spans is None else document_blocks(spans, cp, r, src)

    for r in range(cp):
        qh = split_sequence(q, cp, r, dim=2).chunk(2, dim=2)
        acc = [None, None]
        for step in range(cp):
            src = ring_source(cp, r, step)
            _forward_blocks(qh, kv[src], visible_pairs(cp, r, src), acc, scale, blocks(r, src))
        out = torch.cat([a[0] for a in acc], dim=2).to(q.dtype)
        doh = split_sequence(w, cp, r, dim=2).chunk(2, dim=2)
        dqh = [torch.zeros(h.shape, dtype=wide, device=h.device) for h in qh]
        for src in range(cp):
            dkv[src] += _backward_blocks(qh, doh, out.chunk(2, dim=2), [acc[0][1], acc[1][1]], kv[src],
                                         visible_pairs(cp, r, src), dqh, scale, blocks(r, src))
        outs.append(out)
        dqs.append(torch.cat(dqh, dim=2))
    return outs, dqs, [d[0] for d in dkv], [d[1] for d in dkv]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kernel", ["fused", "matmul"])
def test_cp_chunk_pairs_with_documents_equal_one_process(cp, kernel, monkeypatch):
    """Each cp rank's zig-zag chunks attend over every rank's key/value chunks masked by
    true positions and documents (grouped queries: 4 heads, 2 kv heads; documents that
    start inside chunks, span several, and a query chunk that sees nothing of a key
    chunk): outputs and the gradients of queries, keys and values equal one process's
    masked attention (fp64, 1e-12), whichever kernel unmasked pairs would use."""
    if kernel == "matmul":
        monkeypatch.setattr(context_parallel, "_fused", lambda q: False)
    s, b, heads, kv_heads, d = 8 * cp, 2, 4, 2, 8
    g = torch.Generator().manual_seed(cp)
    q = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, kv_heads, s, d, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64)
    cut = [3, s // 2 - 3, 1, s // 2 - 1]  # row 0: four documents; row 1: a document per 5 tokens
    documents = torch.stack([_documents([cut])[0], torch.arange(s) // 5])
    full, leaves = _masked_attention(q, k, v, documents)
    (full * w).sum().backward()
    outs, dqs, dks, dvs = _cp_attention_of_every_rank(q, k, v, documents, cp, w)
    for r in range(cp):
        for got, want in [(outs[r], full), (dqs[r], leaves[0].grad), (dks[r], leaves[1].grad),
                          (dvs[r], leaves[2].grad)]:
            assert (got - split_sequence(want.detach(), cp, r, dim=2)).abs().max() < 1e-12


def test_attend_with_documents_sees_only_the_querys_document():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    documents = torch.arange(16)[None] // 6
    out, lse = attend(q, k, v, torch.arange(16), torch.arange(16), q_doc=documents[0], k_doc=documents[0])
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=Documents(documents).visible())
    assert torch.allclose(out, expected, rtol=0, atol=1e-12) and torch.isfinite(lse).all()
    positions = local_positions(16, 2, 1)
    assert len(positions) == 8


def test_compile_with_document_mask_is_refused_in_one_line():
    cfg = set_fields(preset_config("tiny"), compile=True, document_mask=True)
    with pytest.raises(ConfigError, match="--compile does not take --document-mask") as e:
        validate(cfg, 1, data=False)
    assert "\n" not in str(e.value)


# ---- spawned: document-masked runs on a 4-rank world train the one-process model -----------------


class PackedDocuments(torch.utils.data.Dataset):
    """Windows of a random token stream, cut into documents of 3 to 24 tokens (a
    window holds several), as a document-masking dataset gives them."""

    def __init__(self, windows: int, seq_len: int, seed: int):
        rng = np.random.default_rng(seed)
        self.tokens = torch.from_numpy(rng.integers(0, 257, windows * seq_len + 1))
        lengths = rng.integers(3, 25, windows * seq_len)
        doc_of_token = np.repeat(np.arange(len(lengths)), lengths)[:windows * seq_len]
        self.documents = torch.from_numpy(doc_of_token)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict:
        a, b = i * self.seq_len, (i + 1) * self.seq_len
        docs = self.documents[a:b]
        return {"tokens": self.tokens[a:b], "labels": self.tokens[a + 1:b + 1], "documents": docs - docs[0]}


def packed_datasets_provider(cfg) -> Datasets:
    return Datasets(train=PackedDocuments(64, cfg.model.seq_len, 0), valid=PackedDocuments(8, cfg.model.seq_len, 1),
                    every_label_counts=True)


# name -> fields (world size 4); 4 steps of 4 windows (micro-batches of 1), fp64
RUNS: dict[str, dict] = {
    "tp2-sp-dp2": dict(tp=2, sequence_parallel=True, dp=2),
    "pp4-1f1b-full": dict(pp=4, schedule="1f1b", recompute="full", n_layer=4),
    "cp2-ring-dp2-llama": dict(cp=2, dp=2, arch="llama", n_kv_head=2),
    "cp2-allgather-tp2-sp-llama": dict(cp=2, tp=2, sequence_parallel=True, cp_comm="allgather", arch="llama",
                                       n_kv_head=2, recompute="selective"),
}
REFERENCE_FIELDS = ("arch", "n_kv_head", "n_layer")


def _config(fields: dict):
    from tests.training import tiny_config

    return tiny_config(**{"steps": 4, "global_batch_size": 4, "micro_batch_size": 1, "document_mask": True,
                          **fields})


@functools.cache
def _spawned() -> dict[str, list[dict]]:
    from tests.training import train_layouts_with

    names = list(RUNS)
    return dict(zip(names, train_layouts_with([_config(RUNS[n]) for n in names], 4, packed_datasets_provider)))


@functools.cache
def _reference(arch: str = "gpt2", n_kv_head: int | None = None, n_layer: int = 2) -> dict:
    from tests.training import train_in_process_with

    fields = {"arch": arch, "n_layer": n_layer} | ({"n_kv_head": n_kv_head} if n_kv_head else {})
    return train_in_process_with(_config(fields), packed_datasets_provider)


@pytest.mark.spawn
@pytest.mark.parametrize("name", list(RUNS))
def test_document_masked_layouts_train_the_one_process_model(name):
    """Every rank: losses, grad norms, validation loss and the weights it holds (its TP
    shard of its stage's) equal one process's document-masked run (1e-9)."""
    from tests.training import assert_rank_matches

    fields = RUNS[name]
    cfg = _config(fields)
    p = cfg.parallel
    grid = ProcessGrid.build(4, tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp)
    ref = _reference(**{k: v for k, v in fields.items() if k in REFERENCE_FIELDS})
    for rank, rank_run in enumerate(_spawned()[name]):
        assert_rank_matches(rank_run, ref, cfg, grid.tp_rank(rank))
