"""Multi-token prediction (--mtp-layers, models/mtp.py): the loss against a plain-torch
reference, the counts, and DeepSeek-V3's modules trained on every axis as on one process.

The parity runs (fp64, 1e-9) share one spawned world of 4 ranks: tp 2 with sequence
parallelism x pp 2 under full recomputation (the MTP modules and the copy of the token
table on the last stage), cp 2 x dp 2 under ZeRO-3, tp 2 x cp 2 (the shifted tokens
gathered over cp, the shifted embeddings through the vocabulary-parallel lookup), pp 2
x dp 2 under ZeRO-1 with ZB-H1's split backward and tied embeddings (the tied head copy
is the last stage's table), and pp 2 resuming the one process's checkpoint.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from gridtrain.config import preset_config, set_fields
from gridtrain.models import mtp
from gridtrain.models.decoder import (IGNORE_INDEX, Decoder, active_parameters, count_parameters, init_parameters,
                                      mtp_parameters, parameter_costs, training_flops_per_token)
from gridtrain.parallel.split_backward import WeightGradStore
from gridtrain.parallel.tensor_parallel import TensorParallel
from tests.training import assert_rank_matches, relative_difference, train_in_process, train_layouts

TINY = dataclasses.replace(preset_config("llama-tiny").model, mtp_layers=2)


@pytest.fixture(autouse=True)
def one_thread():
    """In-process runs use one thread, as each spawned worker does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(cfg=TINY) -> Decoder:
    model = Decoder(cfg)
    init_parameters(model, 0)
    return model.double()


def _batch(b: int = 2, s: int = TINY.seq_len) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels, some labels ignored (a fine-tuning prompt's: the tokens stay real)."""
    window = torch.randint(0, TINY.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(1))
    labels = window[:, 1:].clone()
    labels[0, 5:20] = IGNORE_INDEX
    return window[:, :-1], labels


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + TINY.layernorm_eps) * w


def _reference(model: Decoder, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The main summed loss and each depth's, in plain torch over the model's tensors:
    depth k reads token i + k and predicts label i + k (token i + 1 + k)."""
    V, W, head = TINY.vocab_size, model.embedding.word.weight, model.head
    h = F.embedding(tokens, W)
    for block in model.blocks.values():
        h = block(h)
    def loss(h: torch.Tensor, norm: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = _rms(h, norm) @ head[:V].T
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")

    main, depths, s = loss(h, model.final_norm.weight, labels), [], tokens.shape[1]
    h = _rms(h, model.final_norm.weight)  # h_0: what the main head reads, after the final norm
    for k, m in enumerate(model.mtp, 1):
        inputs = torch.zeros_like(tokens)
        inputs[:, :s - k] = tokens[:, k:]
        targets = torch.full_like(labels, IGNORE_INDEX)
        targets[:, :s - k] = labels[:, k:]
        e = F.embedding(inputs, W)
        h = m.block(torch.cat([_rms(e, m.enorm.weight), _rms(h, m.hnorm.weight)], -1) @ m.proj.weight.T)
        depths.append(loss(h, m.final_norm.weight, targets))
    return main, depths


def test_the_loss_is_a_direct_computation_of_each_depth():
    """One process: the returned value is the main summed loss alone, the recorded MTP
    sum is the depths' mean (plain torch, loop over depths), and the gradients are those
    of main + C x mean over depths."""
    model = _model()
    tokens, labels = _batch()
    out = model(tokens, labels, reduction="sum")
    main, depths = _reference(model, tokens, labels)
    assert relative_difference(out.item(), main.item()) <= 1e-12
    assert relative_difference(mtp.take_loss_sum(model).item(), (sum(depths) / 2).item()) <= 1e-12
    assert mtp.take_loss_sum(model) is None  # taken: the next step starts from zero
    params = [model.embedding.word.weight, model.head, model.mtp[0].proj.weight, model.mtp[1].block.mlp.up.weight,
              model.blocks["0"].attn.q.weight]
    got = torch.autograd.grad(out, params)
    expected = torch.autograd.grad(main + TINY.mtp_loss_coeff * sum(depths) / 2, params)
    for g, e in zip(got, expected):
        assert relative_difference(g, e) <= 1e-12


def test_validation_and_generation_use_the_main_head_only():
    """In eval mode (validation) and without labels (generation) the MTP modules do not
    run: the numbers are those of the model without them."""
    model = _model()
    plain = Decoder(dataclasses.replace(TINY, mtp_layers=0)).double()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    tokens, labels = _batch()
    model.eval()
    with torch.no_grad():
        assert model(tokens, labels, reduction="sum").item() == plain(tokens, labels, reduction="sum").item()
        assert torch.equal(model(tokens), plain(tokens))
    assert model.mtp_loss_sum is None


def test_the_shared_head_takes_its_gradient_in_the_input_backward():
    """Under a split backward (ZB-H1) a linear weight's gradient waits for W, one
    accumulation per use; the head serves the main loss and every depth, and the
    gradient reducer counts one gradient per micro-batch: its gradient comes in B, once
    (on gloo an early-counted bucket still sums the right numbers; on NCCL it would not)."""
    store = WeightGradStore()
    model = Decoder(TINY, tp=TensorParallel(weight_grads=store))
    init_parameters(model, 0)
    tokens, labels = _batch()
    with store.defer("mb"):
        model.double()(tokens, labels, reduction="sum").backward()
    assert model.head.grad is not None and model.mtp[0].block.mlp.up.weight.grad is None  # the block's waits for W
    store.flush("mb")
    assert model.mtp[0].block.mlp.up.weight.grad is not None


def test_counts_include_the_modules():
    """count_parameters is the module's numel with the MTP modules (mtp=False: without,
    as published sizes count); MoE models' MTP blocks are MoE; FLOPs and the
    --pp-partition head cost grow by what the depths run."""
    for cfg in (TINY, dataclasses.replace(preset_config("moe-tiny").model, mtp_layers=1)):
        model = Decoder(cfg)
        padding = (model.padded_vocab - cfg.vocab_size) * cfg.d_model * 2  # embedding and untied head
        assert sum(p.numel() for p in model.parameters()) - padding == count_parameters(cfg)
        without = dataclasses.replace(cfg, mtp_layers=0)
        assert count_parameters(cfg, mtp=False) == count_parameters(without)
        assert count_parameters(cfg) - count_parameters(without) == mtp_parameters(cfg) == \
            sum(p.numel() for p in model.mtp.parameters())
        assert active_parameters(cfg, mtp=False) == active_parameters(without)
        assert parameter_costs(cfg)[2] - parameter_costs(without)[2] == mtp_parameters(cfg)
        d, V = cfg.d_model, cfg.vocab_size
        extra = training_flops_per_token(cfg) - training_flops_per_token(without)
        assert extra > 3 * cfg.mtp_layers * (2 * d * V + 4 * d * d)
    moe = dataclasses.replace(preset_config("moe-tiny").model, mtp_layers=1)
    assert type(Decoder(moe).mtp[0].block.mlp).__name__ == "MoE"
    assert count_parameters(moe) - active_parameters(moe) == \
        (len(moe.moe_layers) + 1) * (moe.n_experts - moe.moe_top_k) * 3 * moe.d_model * moe.moe_ffn_size


SEQ, STEPS, HALF = 32, 5, 3  # the one process saves after HALF steps; pp 2 resumes from there


def _config(**changes):
    """llama-tiny with two MTP depths, 32-token windows and the parity recipe (fp64)."""
    cfg = preset_config("llama-tiny")
    cfg.model.seq_len, cfg.model.mtp_layers = SEQ, 2
    return set_fields(cfg, dtype="fp64", steps=STEPS, global_batch_size=8, micro_batch_size=2, eval_interval=0,
                      eval_iters=1, progress=False, lr=3e-3, warmup_steps=2, **changes)


LAYOUTS = [dict(tp=2, sequence_parallel=True, pp=2, schedule="1f1b", recompute="full"),
           dict(cp=2, dp=2, zero=3),
           dict(tp=2, cp=2, recompute="selective"),
           dict(pp=2, dp=2, zero=1, schedule="zb-h1", tie_embeddings=True)]  # the tied head copy is the table


@pytest.mark.spawn
def test_every_axis_trains_the_single_process_model(tmp_path):
    """DESIGN.md's invariant with --mtp-layers 2: every rank's losses, MTP losses, grad
    norms, validation loss and weights within 1e-9 of one process (the last stage's copy
    of the token table equal to the embedding); the one process's metrics file carries
    ``mtp_loss``, and its first loss is that of the same model without MTP (``loss`` is
    the main head's). pp 2 resumes the one process's checkpoint: the last stage's copy
    of the table and its optimizer state come from the embedding's."""
    metrics = tmp_path / "metrics.jsonl"
    reference = train_in_process(_config(metrics_file=str(metrics), save=str(tmp_path / "one"), save_interval=HALF))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["mtp_loss"] for r in rows] == reference["mtp_losses"] and len(rows) == STEPS
    assert all(m > 0 for m in reference["mtp_losses"])
    without = train_in_process(set_fields(_config(), steps=1, mtp_layers=0))
    assert without["losses"][0] == reference["losses"][0]
    tied = train_in_process(_config(tie_embeddings=True))
    cfgs = [_config(**layout) for layout in LAYOUTS] + [_config(pp=2, load=str(tmp_path / "one" / f"step_{HALF:07d}"))]
    for cfg, runs in zip(cfgs, train_layouts(cfgs, 4)):
        one = tied if cfg.model.tie_embeddings else reference
        if cfg.checkpoint.load is not None:  # resumed after step HALF
            one = {**one, **{k: one[k][HALF:] for k in ("losses", "grad_norms", "mtp_losses")}}
        for rank, run in enumerate(runs):
            try:
                assert_rank_matches(run, one, cfg, rank % cfg.parallel.tp)
                assert relative_difference(run["mtp_losses"], one["mtp_losses"]) <= 1e-9
            except AssertionError as e:
                raise AssertionError(f"{cfg.parallel} rank {rank}: {e}") from None
        held = set().union(*(r["state"].keys() for r in runs))
        assert held - {"embedding_copy", "head"} == one["state"].keys() - {"head"}
        assert ("embedding_copy" in held) == (cfg.parallel.pp > 1 and not cfg.model.tie_embeddings)
