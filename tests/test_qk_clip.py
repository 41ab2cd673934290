"""QK-clip (``--qk-clip TAU``, models/qk_clip.py): a rescaled head's largest logit on the
same input is TAU exactly, for multi-head (GPT-2's fused QKV), grouped-query (Llama)
and latent attention (DeepSeek-V3-class); the statistic is the one-process one under
context parallelism and document masks; and every layout trains the one-process model
with QK-clip on (fp64, 1e-9: dp 2, tp 2 + SP, cp 2, pp 2, ZeRO-3, ZeRO-2 at dp 4, ep 2,
GPT-2 under tp 2, latent attention under tp 2, dp 2 x cp 2), with Muon and with AdamW."""

from __future__ import annotations

import functools

import pytest
import torch

from gridtrain.config import ConfigError, preset_config, set_fields
from gridtrain.models import qk_clip
from gridtrain.models.attention import Documents
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.parallel.comm import single
from gridtrain.parallel.context_parallel import ContextParallel, split_sequence
from gridtrain.parallel.grid import ProcessGrid
from gridtrain.training.validate import validate
from tests.training import SharedSpawns, assert_rank_matches, train_in_process

TAU = 0.05  # below the tiny models' logits from the first step on, so that heads are clipped
RECIPE = dict(dtype="fp64", steps=6, global_batch_size=8, micro_batch_size=2, eval_interval=0, eval_iters=1,
              progress=False, lr=3e-3, warmup_steps=1, qk_clip=TAU)


def clip_config(preset: str = "llama-tiny", **fields):
    return set_fields(preset_config(preset), **{**RECIPE, **fields})


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny", "deepseek-tiny"])
def test_a_rescaled_head_reaches_tau_on_the_same_input(preset):
    """The first layer (its input unchanged by the rescaling): every head above tau is
    at tau after its rows are scaled (to rounding), every other head unchanged."""
    cfg = preset_config(preset).model
    model = Decoder(cfg)
    init_parameters(model, 0)
    model = model.double().train()
    first = qk_clip_layers(model)[0]
    first.records_logits = True
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(x)
    before = first.logit_max.clone()
    tau = float(before.median())
    assert (before > tau).any() and (before <= tau).any()
    with torch.no_grad():
        for p, factor in qk_clip.row_scales(model, tau, single()).items():
            p.mul_(factor.view(-1, *[1] * (p.ndim - 1)))
        model(x)
    torch.testing.assert_close(first.logit_max, before.clamp(max=tau), rtol=1e-12, atol=0)


def qk_clip_layers(model):
    from gridtrain.models.attention import SelfAttention
    return [m for m in model.modules() if isinstance(m, SelfAttention)]


def test_grouped_heads_scale_each_query_heads_logits_by_its_own_factor():
    gamma = torch.tensor([0.25, 1.0, 0.5, 0.8], dtype=torch.float64)
    q, k = qk_clip.grouped_scales(gamma, 2)  # kv head 0 serves query heads 0 and 1
    torch.testing.assert_close(k, torch.tensor([0.5, 0.5 ** 0.5], dtype=torch.float64))
    torch.testing.assert_close(q * k.repeat_interleave(2), gamma)
    torch.testing.assert_close(qk_clip.gammas(torch.tensor([0.5, 2.0]), 1.0), torch.tensor([1.0, 0.5]))


def test_the_statistic_is_the_one_process_one_under_cp_and_documents():
    """Per head, over the keys each query sees: cp ranks' queries against the gathered
    keys at their true positions (one rank playing each cp rank, the gather replaced by
    the whole keys in rank order), with a document mask, equal to the whole sequence's."""
    torch.manual_seed(0)
    b, h, s, d, cp = 2, 4, 16, 8, 2
    q, k = torch.randn(b, h, s, d, dtype=torch.float64), torch.randn(b, 2, s, d, dtype=torch.float64)
    ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])
    docs = Documents(ids)
    whole = qk_clip.max_logits(q, k, 0.3, ContextParallel(), docs)
    logits = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.3
    torch.testing.assert_close(whole, logits.masked_fill(~docs.visible(), float("-inf")).amax(dim=(0, 2, 3)))
    ranks = [split_sequence(k, cp, r, dim=2) for r in range(cp)]

    class _Gathered:  # a cp group whose all_gather hands over every rank's keys
        size = cp

        def __init__(self, rank):
            self.rank = rank

        def all_gather(self, _k, dim):
            return torch.cat(ranks, dim=dim)
    seen = []
    for r in range(cp):
        group = ContextParallel(comm=_Gathered(r))
        seen.append(qk_clip.max_logits(split_sequence(q, cp, r, dim=2), ranks[r], 0.3, group, docs))
    torch.testing.assert_close(torch.stack(seen).amax(dim=0), whole)


def test_qk_clip_is_refused_where_it_cannot_rescale():
    with pytest.raises(ConfigError, match="--qk-norm"):
        validate(clip_config(qk_norm="head"), 1)
    with pytest.raises(ConfigError, match="--tp 4 above the 2 key/value heads"):
        validate(clip_config(tp=4), 4)
    with pytest.raises(ConfigError, match="--muon-lr sets Muon's rate"):
        validate(clip_config(muon_lr=0.01), 1)


def test_qk_clip_changes_training_and_keeps_its_logits_near_tau():
    clipped = train_in_process(clip_config(optimizer="muon"))
    free = train_in_process(clip_config(optimizer="muon", qk_clip=0.0))
    assert clipped["losses"][0] == free["losses"][0] and clipped["losses"][-1] != free["losses"][-1]


# ---- every layout equals one process -----------------------------------------------------------

RUNS: dict[str, tuple[int, dict]] = {
    "dp2": (2, dict(dp=2)),
    "tp2-sp": (2, dict(tp=2, sequence_parallel=True)),
    "cp2": (2, dict(cp=2)),
    "pp2": (2, dict(pp=2)),
    "z3-dp2": (2, dict(dp=2, zero=3)),
    "gpt2-tp2": (2, dict(preset="tiny", tp=2)),
    "mla-tp2-sp": (2, dict(preset="deepseek-tiny", tp=2, sequence_parallel=True)),
    "ep2": (2, dict(preset="moe-tiny", dp=2, ep=2, micro_batch_size=1)),  # MoE: the same micro-batches per step
    "z2-dp4": (4, dict(dp=4, zero=2, micro_batch_size=1)),
    "adamw-dp2-cp2": (4, dict(dp=2, cp=2, optimizer="adamw", zero=1)),
    "muon-dp2-cp2": (4, dict(dp=2, cp=2, zero=1)),
}


def _config(name: str):
    fields = {"optimizer": "muon", **RUNS[name][1]}
    return clip_config(fields.pop("preset", "llama-tiny"), **fields)


@functools.cache
def reference(preset: str, optimizer: str, micro_batch_size: int = 2) -> dict:
    return train_in_process(clip_config(preset, optimizer=optimizer, micro_batch_size=micro_batch_size))


run = SharedSpawns(RUNS, _config).run


@pytest.mark.spawn
@pytest.mark.parametrize("name", list(RUNS))
def test_every_layout_clips_as_one_process(name):
    world, fields = RUNS[name]
    cfg = _config(name)
    p = cfg.parallel
    grid = ProcessGrid.build(world, tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp)
    preset = fields.get("preset", "llama-tiny")
    # a MoE's reference has the run's micro-batches per step (its load-balancing loss is per micro-batch)
    mbs = fields["micro_batch_size"] * p.dp if preset == "moe-tiny" else 2
    expected = reference(preset, fields.get("optimizer", "muon"), mbs)
    for rank, rank_run in enumerate(run(name)):
        assert_rank_matches(rank_run, expected, cfg, grid.tp_rank(rank))
