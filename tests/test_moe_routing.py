"""DeepSeek-V3 routing (docs/moe.md, "DeepSeek-V3 routing"): the sigmoid router with
group-limited top-k, the expert bias and the routed scale as data against Hugging Face's
DeepseekV3TopkRouter; the sequence-wise balance loss's value and gradient against the
loss written out per sequence; aux-loss-free balancing's bias trained the same on every
layout (one process against dp 2 x ep 2 with cp 2, with tp 2 under sequence
parallelism, with pp 2: fp64, 1e-9, every step's losses, grad norms, routing and bias),
saved and resumed on another layout, kept in fp32 by casts, and moving the load towards
balance on the built-in corpus."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch

from gridtrain.config import Config, preset_config, set_fields
from gridtrain.models.moe import MoE, route
from gridtrain.parallel.experts import ExpertParallel
from gridtrain.parallel.grid import ProcessGrid
from gridtrain.parallel.tensor_parallel import TensorParallel
from tests.training import SharedSpawns, assert_rank_matches, relative_difference, train_in_process

# DeepSeek-V3's routing on moe-tiny (8 experts, top-2): sigmoid scores, 2 groups of 4 of
# which each token uses 1, the expert bias moving by 0.01, weights times 2.5, the
# sequence-wise loss, the first of 3 layers dense
DEEPSEEK = dict(moe_router="sigmoid", moe_expert_bias_rate=0.01, moe_groups=2, moe_group_top_k=1,
                moe_routed_scale=2.5, moe_seq_aux_loss_coeff=0.001, moe_dense_layers=1, n_layer=3)
MICRO_BATCHES = 2
STEPS = 4


def deepseek_config(**fields) -> Config:
    """moe-tiny with DeepSeek-V3's routing and the parity recipe (fp64, 8 sequences a step
    in MICRO_BATCHES micro-batches on every layout)."""
    dp = fields.get("dp", 1)
    recipe = dict(dtype="fp64", steps=STEPS, global_batch_size=8, micro_batch_size=8 // (MICRO_BATCHES * dp),
                  eval_interval=0, eval_iters=1, progress=False, lr=3e-3, warmup_steps=2)
    return set_fields(preset_config("moe-tiny"), **{**recipe, **DEEPSEEK, **fields})


# ---- the router as data -----------------------------------------------------------------------------

def _hf_router(e: int, k: int, groups: int, top_groups: int, scale: float, norm: bool, d: int = 16):
    hf = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    config = hf.DeepseekV3Config(hidden_size=d, n_routed_experts=e, num_experts_per_tok=k, n_group=groups,
                              topk_group=top_groups, routed_scaling_factor=scale, norm_topk_prob=norm)
    router = hf.DeepseekV3TopkRouter(config)
    torch.manual_seed(e + k + groups)
    with torch.no_grad():
        router.weight.normal_(std=0.5)
        router.e_score_correction_bias.normal_(std=0.1)
    return router


@pytest.mark.parametrize("e, k, groups, top_groups, scale, norm", [
    (16, 4, 4, 2, 2.5, True),  # DeepSeek-V3's shape, scaled down
    (16, 4, 4, 4, 2.5, True),  # every group: plain top-k on the biased scores
    (8, 2, 1, 1, 1.0, True),  # no groups
    (8, 3, 2, 1, 1.5, False),  # weights as the sigmoid gave them
])
def test_the_sigmoid_router_is_hugging_faces_deepseek_v3_router(e, k, groups, top_groups, scale, norm):
    """The same experts chosen and the same weights (fp32, as Hugging Face computes) as
    transformers' DeepseekV3TopkRouter: sigmoid scores, the bias added for the choice
    only, a group's score its two best, the best groups' experts, the chosen scores
    renormalised over their sum + 1e-20, times the routed scale."""
    router = _hf_router(e, k, groups, top_groups, scale, norm)
    x = torch.randn(64, 16)
    with torch.no_grad():
        _, theirs_weights, theirs = router(x)
        probs, chosen, weights = route(torch.nn.functional.linear(x, router.weight), k, norm, sigmoid=True,
                                       bias=router.e_score_correction_bias, groups=groups, group_top_k=top_groups,
                                       scale=scale)
    ours, order = chosen.sort(1)
    theirs, their_order = theirs.sort(1)  # Hugging Face leaves the k unsorted
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(weights.gather(1, order), theirs_weights.gather(1, their_order), rtol=1e-6, atol=0)
    scores = torch.sigmoid(torch.nn.functional.linear(x, router.weight))
    torch.testing.assert_close(probs, scores / scores.sum(-1, keepdim=True))  # what the balance losses take


def test_the_softmax_router_limits_groups_by_their_best_expert():
    """DeepSeek-V2's group-limited routing for a softmax router: a group's score is its
    best expert's, the bias chooses and does not weigh."""
    logits = torch.tensor([[3.0, -2.0, 2.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    p = torch.softmax(logits, -1)[0]
    # groups {0, 1}, {2, 3}, {4, 5}: the best is {0, 1} (max), though {2, 3} sums more
    _, chosen, weights = route(logits, 2, False, groups=3, group_top_k=1)
    assert sorted(chosen[0].tolist()) == [0, 1]
    # two groups: {0, 1} and {2, 3}; a bias lifting expert 2 over expert 0 changes the
    # choice, not the weights (the scores without bias, renormalised)
    bias = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.0])
    _, chosen, weights = route(logits, 1, True, bias=bias, groups=3, group_top_k=2)
    assert chosen.tolist() == [[2]] and weights.tolist() == [[1.0]]
    _, chosen, weights = route(logits, 2, False, bias=bias, scale=2.0)
    assert chosen.tolist() == [[2, 0]]
    torch.testing.assert_close(weights[0], 2.0 * p[[2, 0]])


# ---- the sequence-wise balance loss -----------------------------------------------------------------

def _layer(**fields) -> MoE:
    cfg = set_fields(preset_config("moe-tiny"), **{**DEEPSEEK, **fields}).model
    torch.manual_seed(0)
    layer = MoE(cfg, 1, TensorParallel(), ExpertParallel()).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        layer.expert_bias.normal_(std=0.05)
    return layer.train()


def _sequence_loss(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The sequence-wise loss written out, one sequence at a time (DeepSeek-V3's eq. 17-20):
    ``sum_i f_i P_i`` with ``f_i = E / (k T) x`` the times expert ``i`` is chosen among
    the sequence's ``T`` tokens, ``P_i`` the mean of ``s_i / sum_j s_j``; the mean over
    sequences."""
    cfg = layer.cfg
    e, k = cfg.n_experts, cfg.moe_top_k
    losses = []
    for seq in x:
        scores = torch.sigmoid(layer.router(seq))
        _, chosen, _ = route(layer.router(seq), k, True, sigmoid=True, bias=layer.expert_bias, groups=cfg.moe_groups,
                             group_top_k=cfg.moe_group_top_k)
        f = torch.bincount(chosen.reshape(-1), minlength=e).double() * e / (k * seq.shape[0])
        losses.append((f * (scores / scores.sum(-1, keepdim=True)).mean(0)).sum())
    return torch.stack(losses).mean()


def test_the_sequence_loss_is_the_per_sequence_formula_value_and_gradient():
    """The logged value is the per-sequence loss written out, and with the gradient
    injected at the layer's output (scale = coefficient) the parameters' gradients equal
    autograd of ``out . g + C x loss``."""
    layer = _layer(moe_seq_aux_loss_coeff=0.3, moe_aux_loss_coeff=0.0)
    d = layer.cfg.d_model
    torch.manual_seed(1)
    x = torch.randn(3, 10, d, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 10, d, dtype=torch.float64)
    (layer(x) * g).sum().backward()
    (stats,) = layer.ep.log.layers.values()
    reference = _sequence_loss(layer, x).detach()
    assert abs(float(stats.seq_aux) - float(reference)) <= 1e-12 * float(reference)
    assert torch.equal(stats.bias, layer.expert_bias)  # the bias the step routed with
    injected = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    x.grad = None
    layer.cfg = set_fields(preset_config("moe-tiny"), **{**DEEPSEEK, "moe_seq_aux_loss_coeff": 0.0,
                                                         "moe_aux_loss_coeff": 0.0}).model
    ((layer(x) * g).sum() + 0.3 * _sequence_loss(layer, x)).backward()
    written_out = [p.grad for p in layer.parameters()] + [x.grad]
    for a, b in zip(injected, written_out):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    assert injected[0].abs().sum() > 0  # the router learns from it


def test_the_expert_bias_moves_by_the_rate_against_the_load_and_stays_fp32():
    """``bias += G sign(mean load - load)``: up where an expert got fewer than the mean,
    down where more, unchanged at the mean; a buffer (no gradient) that casts to bf16
    leave in fp32 and the state dict holds as ``expert_bias``."""
    layer = _layer(moe_expert_bias_rate=0.25)
    before = layer.expert_bias.clone()
    layer.update_expert_bias(torch.tensor([4.0, 0.0, 2.0, 2.0, 1.0, 3.0, 2.0, 2.0], dtype=torch.float64))
    assert (layer.expert_bias - before).tolist() == [-0.25, 0.25, 0.0, 0.0, 0.25, -0.25, 0.0, 0.0]
    assert "expert_bias" in layer.state_dict() and "expert_bias" not in dict(layer.named_parameters())
    assert layer.to(torch.bfloat16).expert_bias.dtype == torch.float64  # at least fp32: as it was
    assert MoE(layer.cfg, 1, TensorParallel(), ExpertParallel()).to(torch.bfloat16).expert_bias.dtype == torch.float32
    softmax = MoE(preset_config("moe-tiny").model, 0, TensorParallel(), ExpertParallel())
    assert softmax.expert_bias is None and "expert_bias" not in softmax.state_dict()


# ---- every layout trains the one-process model --------------------------------------------------------

RUNS: dict[str, tuple[int, dict]] = {
    "dp2-cp2-ep2": (4, dict(dp=2, cp=2, ep=2)),  # a sequence over two cp ranks
    "dp2-tp2-sp-ep2": (4, dict(dp=2, tp=2, sequence_parallel=True, ep=2)),  # ... over two tp ranks; saves
    "dp2-pp2-ep2": (4, dict(dp=2, pp=2, ep=2, schedule="1f1b")),  # the MoE layers on two stages
}
SAVED_AT = 2


@functools.cache
def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="gridtrain-moe-routing-"))


def _config(name: str) -> Config:
    cfg = deepseek_config(**RUNS[name][1])
    if name == "dp2-tp2-sp-ep2":
        cfg.checkpoint.save, cfg.checkpoint.save_interval = str(_tmp() / name), SAVED_AT
    return cfg


run = SharedSpawns(RUNS, _config).run


@functools.cache
def reference() -> dict:
    return train_in_process(deepseek_config())


def _assert_same_routing(mine: list[dict], theirs: list[dict]) -> None:
    assert len(mine) == len(theirs) == STEPS
    for step, (a, b) in enumerate(zip(mine, theirs), 1):
        assert a.keys() == b.keys() == {1, 2}
        for layer in a:
            x, y = a[layer], b[layer]
            assert x.tokens_per_expert == y.tokens_per_expert, f"step {step} layer {layer}"
            assert x.expert_bias == y.expert_bias, f"step {step} layer {layer}"
            for what in ("aux_loss", "seq_aux_loss"):
                assert abs(getattr(x, what) - getattr(y, what)) <= 1e-9 * getattr(y, what), (step, layer, what)


@pytest.mark.spawn
@pytest.mark.parametrize("name", list(RUNS))
def test_deepseek_routing_trains_the_one_process_model(name):
    """Every rank: losses, grad norms, validation loss and the weights and expert biases
    it holds equal one process's within 1e-9, and every step's routing (tokens per
    expert, the bias it routed with, both balance losses) is one process's."""
    cfg = _config(name)
    p = cfg.parallel
    grid = ProcessGrid.build(RUNS[name][0], tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp)
    ref = reference()
    assert any(r.expert_bias != [0.0] * 8 for r in ref["routing"][-1].values())  # the bias did move
    assert all(r.seq_aux_loss > 0 for r in ref["routing"][-1].values())
    for rank, rank_run in enumerate(run(name)):
        assert_rank_matches(rank_run, ref, cfg, grid.tp_rank(rank))
        assert any(n.endswith("mlp.expert_bias") for n in rank_run["state"])
        _assert_same_routing(rank_run["routing"], ref["routing"])


@pytest.mark.spawn
def test_the_expert_bias_resumes_on_another_layout():
    """Saved at step 2 on dp 2 x tp 2 (sequence parallel) x ep 2, resumed by one process:
    the checkpoint holds each layer's bias once, and the resumed steps (losses, routing,
    bias) are the uninterrupted run's."""
    run("dp2-tp2-sp-ep2")
    resumed = deepseek_config()
    resumed.checkpoint.load = str(_tmp() / "dp2-tp2-sp-ep2" / f"step_{SAVED_AT:07d}")
    after = train_in_process(resumed)
    assert relative_difference(after["losses"], reference()["losses"][SAVED_AT:]) <= 1e-9
    for mine, theirs in zip(after["routing"], reference()["routing"][SAVED_AT:]):
        assert {k: r.expert_bias for k, r in mine.items()} == {k: r.expert_bias for k, r in theirs.items()}
    for name in ("blocks.1.mlp.expert_bias", "blocks.2.mlp.expert_bias"):
        assert relative_difference(after["state"][name], reference()["state"][name]) <= 1e-9


# ---- aux-loss-free balancing balances ------------------------------------------------------------------

@pytest.mark.slow
def test_the_expert_bias_moves_the_load_towards_balance():
    """On the built-in corpus, without balance losses, the busiest expert's load over the
    mean (averaged over layers and the last steps) is lower with the bias moving than
    without it."""
    def load(rate: float) -> float:
        cfg = deepseek_config(steps=8, global_batch_size=4, micro_batch_size=4, moe_expert_bias_rate=rate,
                              moe_aux_loss_coeff=0.0, moe_seq_aux_loss_coeff=0.0, lr=1e-3)
        last = train_in_process(cfg)["routing"][-3:]
        return sum(r.max_load for step in last for r in step.values()) / sum(len(step) for step in last)

    fixed, moving = load(0.0), load(0.01)  # about 3.9 and 2.3
    assert moving < 0.75 * fixed, (moving, fixed)
