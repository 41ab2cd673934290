"""The MoE layer as data, in one process: permutation and its inverse, the dispatch against
a plain loop over tokens and experts, the routing normalisations, the load-balancing
loss's gradient against autograd of the loss written out, and the configurations that
are refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gridtrain.config import ConfigError, preset_config, set_fields
from gridtrain.models.moe import MoE, route
from gridtrain.parallel.experts import (ExpertParallel, capacity_order, dispatch_combine, permutation, permute,
                                       unpermute)
from gridtrain.parallel.tensor_parallel import TensorParallel
from gridtrain.training.validate import validate


def _layer(seed: int = 0, **fields) -> MoE:
    cfg = set_fields(preset_config("moe-tiny"), **fields).model
    torch.manual_seed(seed)
    layer = MoE(cfg, 0, TensorParallel(), ExpertParallel()).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def test_permute_then_unpermute_is_the_identity_forward_and_backward():
    """Each token copied to its k experts' rows (sorted by expert, token order within
    one) and summed back with weights summing to 1 is the token again; the gradient of
    that round trip is the identity too."""
    torch.manual_seed(0)
    n, d, k, e = 37, 5, 3, 6
    x = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    chosen = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    weights = torch.softmax(torch.randn(n, k, dtype=torch.float64), -1)
    order, counts = permutation(chosen, e)
    assert counts.tolist() == torch.bincount(chosen.reshape(-1), minlength=e).tolist()
    experts_in_order = chosen.reshape(-1)[order]
    assert torch.all(experts_in_order[1:] >= experts_in_order[:-1])  # grouped by expert
    rows = permute(x, order, k)
    back = unpermute(rows, order, weights, k, n)
    assert torch.allclose(back, x, rtol=1e-15, atol=1e-15)
    g = torch.randn(n, d, dtype=torch.float64)
    (grad,) = torch.autograd.grad(back, x, g)
    assert torch.allclose(grad, g, rtol=1e-15, atol=1e-15)


class _IndexedSums(TorchDispatchMode):
    """The indexed additions (``index_add``, ``index_put`` with ``accumulate``,
    ``scatter_add``, ``scatter_reduce``) that add two or more floating-point values into one
    place: a GPU adds those with atomics, in whatever order its threads arrive. (One value
    per place is exact whatever the order: ``0 + x`` is ``x``.)"""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__.rstrip("_")
        index = None
        if name == "index_add":
            index = args[2]
        elif name in ("index_put", "_index_put_impl") and kwargs.get("accumulate", len(args) > 3 and args[3]):
            index = args[1][0]
        elif name in ("scatter_add", "scatter_reduce"):
            index = args[2]
        if index is not None and args[0].is_floating_point() and index.unique().numel() < index.numel():
            self.seen.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.parametrize("dropped", [0, 9])
def test_the_combine_and_the_permutations_gradient_are_fixed_order_sums(k, dropped):
    """Issue 54: the combine (each token's weighted rows summed) and the permutation's
    gradient (each token's rows' gradients summed) add a token's rows in expert order, one
    slot at a time, with no indexed addition of two values into one place (index_add,
    scatter_add, accumulating index_put: atomics, in arrival order, on a GPU): bit for bit
    the explicit per-token sum in that order, in fp64, with assignments dropped by
    capacity adding nothing. (The old ``index_add`` combine is caught by the same check.)"""
    gen = torch.Generator().manual_seed(k)
    n, d, e = 23, 6, 10
    chosen = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    weights = torch.rand(n, k, dtype=torch.float64, generator=gen).requires_grad_()
    order, _ = permutation(chosen, e)
    order = order[:n * k - dropped]  # the first assignments in expert order are kept
    x = torch.randn(n, d, dtype=torch.float64, generator=gen, requires_grad=True)
    g = torch.randn(n, d, dtype=torch.float64, generator=gen)
    with _IndexedSums() as ops:
        rows = permute(x, order, k) * torch.arange(1, order.numel() + 1, dtype=torch.float64)[:, None]
        out = unpermute(rows, order, weights, k, n)
        gx, gw = torch.autograd.grad(out, (x, weights), g)
    assert ops.seen == []
    with _IndexedSums() as old:  # the combine as it was: index_add of each token's k rows
        torch.zeros(n, d, dtype=torch.float64).index_add(0, order // k, rows.detach())
    assert old.seen == (["index_add"] if k > 1 else [])
    place = {int(a): i for i, a in enumerate(order)}  # assignment -> its row (expert order)
    flat_w = weights.detach().reshape(-1)
    for t in range(n):
        mine = sorted(place[t * k + j] for j in range(k) if t * k + j in place)  # the token's rows, expert order
        want_out = torch.zeros(d, dtype=torch.float64)
        want_gx = torch.zeros(d, dtype=torch.float64)
        for i in mine:
            a = int(order[i])
            want_out = want_out + rows[i].detach() * flat_w[a]
            want_gx = want_gx + g[t] * flat_w[a] * (i + 1)
        assert torch.equal(out[t].detach(), want_out) and torch.equal(gx[t], want_gx), t
        for j in range(k):
            a = t * k + j
            want = (g[t] * rows[place[a]].detach()).sum() if a in place else torch.zeros((), dtype=torch.float64)
            assert torch.equal(gw[t, j], want), (t, j)


def test_dispatch_equals_a_loop_over_tokens_and_experts():
    """The permuted, grouped computation gives each token the weighted sum of its experts'
    outputs, as a per-token loop (the first implementation anyone writes) does."""
    layer = _layer()
    cfg = layer.cfg
    x = torch.randn(20, cfg.d_model, dtype=torch.float64)
    _, chosen, weights = route(layer.router(x), cfg.moe_top_k, cfg.moe_norm_topk)
    out, counts, received = dispatch_combine(x, chosen, weights, cfg.n_experts, layer.ep,
                                             lambda e, rows: layer.experts[str(e)](rows))
    loop = torch.stack([sum(weights[t, j] * layer.experts[str(int(chosen[t, j]))](x[t])
                            for j in range(cfg.moe_top_k)) for t in range(x.shape[0])])
    assert torch.allclose(out, loop, rtol=1e-12, atol=1e-14)
    assert int(counts.sum()) == received == 20 * cfg.moe_top_k


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5])
def test_capacity_keeps_each_experts_first_assignments_in_token_order(factor):
    """Each expert keeps the first ceil(F N k / E) assignments of the micro-batch in token
    order (a loop over tokens, counting), the same whichever order the rank holds its runs
    in; the kept ones come first in ``order``, sorted by expert."""
    torch.manual_seed(1)
    n, k, e = 50, 2, 4
    chosen = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    keys = list(range(n))
    order, kept, capacity, counts = capacity_order(chosen, e, factor, ExpertParallel(), keys, most_runs=1)
    limit = -(-factor * n * k // e)
    assert float(capacity) == limit
    seen, expected = [0] * e, []
    for t in range(n):
        for j in range(k):
            x = int(chosen[t, j])
            if seen[x] < limit:
                expected.append(t * k + j)
            seen[x] += 1
    assert counts.tolist() == seen
    n_kept = int(kept.sum())
    assert sorted(order[:n_kept].tolist()) == expected
    experts_kept = chosen.reshape(-1)[order[:n_kept]]
    assert torch.all(experts_kept[1:] >= experts_kept[:-1])
    assert kept.tolist() == [min(c, int(limit)) for c in seen]


def test_token_keys_follow_the_global_micro_batch():
    """A rank's tokens are its dp slice's samples at its cp chunks' true positions, cut to
    its tp share under sequence parallelism."""
    ep = ExpertParallel(dp_rank=1, cp_size=2, cp_rank=0, sp_size=2, sp_rank=1)
    # seq 16: cp rank 0 holds chunks 0 and 3 (positions 0-3, 12-15); tp rank 1 the second half
    assert ep.token_keys(batch=2, local_len=4) == [2 * 16 + p for p in (12, 13, 14, 15)] + \
        [3 * 16 + p for p in (12, 13, 14, 15)]


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_weights_are_softmax_top_k_optionally_renormalized(renormalize):
    """Mixtral / Qwen3-MoE renormalise the k chosen probabilities to sum to 1; OLMoE takes
    them as the softmax gave them."""
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0]], dtype=torch.float64)
    probs, chosen, weights = route(logits, 2, renormalize)
    p = torch.softmax(logits, -1)[0]
    assert chosen.tolist() == [[0, 2]]
    expected = p[[0, 2]] / (p[0] + p[2]) if renormalize else p[[0, 2]]
    assert torch.allclose(weights[0], expected)
    assert torch.allclose(probs, torch.softmax(logits, -1))


def test_the_load_balancing_gradient_is_the_switch_loss_gradient():
    """With the gradient injected at the layer's output (scale = coefficient), the
    parameters' gradients equal autograd of ``out . g + C E sum_e f_e P_e`` written out,
    ``f`` the (constant) fraction of assignments per expert, ``P`` the mean probability."""
    layer = _layer(moe_aux_loss_coeff=0.3)
    cfg = layer.cfg
    x = torch.randn(2, 9, cfg.d_model, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 9, cfg.d_model, dtype=torch.float64)
    layer.train()
    (layer(x) * g).sum().backward()
    injected = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    x.grad = None
    layer.cfg = set_fields(preset_config("moe-tiny"), moe_aux_loss_coeff=0.0).model  # no injection
    out = layer(x)
    probs, chosen, _ = route(layer.router(x.reshape(-1, cfg.d_model)), cfg.moe_top_k, True)
    f = torch.bincount(chosen.reshape(-1), minlength=cfg.n_experts).double() / chosen.numel()
    aux = cfg.n_experts * (f * probs.mean(0)).sum()
    ((out * g).sum() + 0.3 * aux).backward()
    written_out = [p.grad for p in layer.parameters()] + [x.grad]
    for a, b in zip(injected, written_out):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-15)


def test_the_logged_aux_loss_is_one_for_perfect_balance():
    """E sum_e f_e P_e is 1 when assignments and probabilities are uniform (a zero router)."""
    layer = _layer(moe_top_k=2)
    torch.nn.init.zeros_(layer.router.weight)
    layer.train()
    layer(torch.randn(1, 16, layer.cfg.d_model, dtype=torch.float64))
    (stats,) = layer.ep.log.layers.values()
    assert abs(float(stats.aux) - 1.0) < 1e-12


@pytest.mark.parametrize("fields, message", [
    (dict(ep=2, nproc=2), "--ep 2 splits experts, and this model has none"),
    (dict(n_experts=8, ep=3, nproc=3), "--ep 3 does not divide --n-experts 8"),
    (dict(n_experts=8, ep=4, nproc=2), "--ep 4 x --etp 1 does not divide the 2 tp x cp x dp ranks"),
    (dict(n_experts=8, ep=4, nproc=4, tp=2), "so experts fold over tp, and without --sequence-parallel"),
    (dict(n_experts=8, etp=2, nproc=2, moe_ffn_hidden=33), "--etp 2 does not divide the experts' width 33"),
    (dict(n_experts=8, etp=2, nproc=2, arch="gpt2", n_kv_head=None), "--etp 2 with --arch gpt2"),
    (dict(n_experts=8, etp=2, nproc=2, moe_capacity_factor=1.0), "--etp 2 with --moe-capacity-factor"),
    (dict(n_experts=8, etp=2, nproc=4, zero=1, zero_shard_size=2), "--zero-shard-size with --etp 2"),
    (dict(n_experts=4, moe_top_k=5), "--moe-top-k 5 exceeds --n-experts 4"),
    (dict(n_experts=8, ep=2, nproc=4, zero=1, zero_shard_size=2), "--zero-shard-size with --ep 2"),
    (dict(n_experts=8, compile=True), "--compile with --n-experts"),
])
def test_moe_configurations_refused_in_one_line(fields, message):
    cfg = set_fields(preset_config("llama-tiny"), **fields)
    with pytest.raises(ConfigError, match=message) as e:
        validate(cfg, data=False)
    assert "\n" not in str(e.value)
