"""The local experts as grouped GEMMs (``torch._grouped_mm``) against the per-expert loop
(the fp64 path and parity reference) in fp32: forward and every gradient to rounding,
with experts that get no rows, dropless and with capacity, SwiGLU and GELU experts; the
packed parameter layout the grouped GEMMs read without copies; capacity's token keys and
runs made on the device; and, counted on dry runs, the host reads of a MoE layer: one per
layer and micro-batch under expert parallelism, none at ep 1."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from gridtrain import dryrun
from gridtrain.config import preset_config, set_fields
from gridtrain.models.moe import MoE, packed, stacked_layout
from gridtrain.parallel.experts import (ExpertParallel, capacity_order, dispatch_combine, grouped_gemm_fits,
                                       run_tensors, token_runs)
from gridtrain.parallel.tensor_parallel import TensorParallel
from gridtrain.runtime import host_sync


def assert_close_fp32(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal to fp32 rounding: the largest difference within 1e-5 of the largest value
    (the grouped GEMMs and the loop sum the same products, blocked differently)."""
    assert a.shape == b.shape
    assert (a - b).abs().max() <= 1e-5 * b.abs().max().clamp(min=1e-30)


def _layer(arch: str = "llama", **fields) -> MoE:
    cfg = set_fields(preset_config("moe-tiny"), moe_aux_loss_coeff=0.1, **fields).model
    if arch == "gpt2":
        cfg = dataclasses.replace(cfg, arch="gpt2", n_kv_head=None)
    torch.manual_seed(0)
    layer = MoE(cfg, 0, TensorParallel(), ExpertParallel())
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _grads(layer: MoE, x: torch.Tensor, run) -> list[torch.Tensor]:
    """Output, input gradient and every parameter's gradient of ``run(layer, x)``."""
    x = x.clone().requires_grad_()
    layer.zero_grad()
    out = run(layer, x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return [out.detach(), x.grad, *(p.grad if p.grad is not None else torch.zeros_like(p)
                                    for p in layer.parameters())]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("capacity", [None, 1.0])
def test_the_grouped_layer_equals_the_loop_in_fp32(arch, capacity):
    """The whole layer (router, load-balancing gradient, experts, combine): grouped GEMMs
    give the loop's output and gradients to fp32 rounding, dropless and with tokens
    dropped by capacity (the dropped rows run through the last expert weighted zero)."""
    grouped = _layer(arch, moe_capacity_factor=capacity)
    loop = copy.deepcopy(grouped)
    loop.grouped_gemm = False
    grouped.train(), loop.train()
    x = torch.randn(2, 24, grouped.cfg.d_model)
    assert grouped.grouped(x.dtype, x.device) and not loop.grouped(x.dtype, x.device)
    forward = lambda layer, x: layer(x)  # noqa: E731
    for a, b in zip(_grads(grouped, x, forward), _grads(loop, x, forward)):
        assert_close_fp32(a, b)
    if capacity is not None:
        (stats,) = grouped.ep.log.layers.values()
        assert float(stats.dropped) > 0  # the case exercises dropping
        assert int(stats.received) < x.shape[0] * x.shape[1] * grouped.cfg.moe_top_k


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_experts_that_get_no_rows_are_run_on_none_and_get_zero_gradients(arch):
    """Tokens routed to experts 0, 3 and 4 only: the grouped GEMMs take empty groups
    (first, middle and last experts among them), and equal the loop there too."""
    layer = _layer(arch)
    cfg = layer.cfg
    x = torch.randn(30, cfg.d_model)
    gen = torch.Generator().manual_seed(2)
    used = torch.tensor([0, 3, 4])
    chosen = torch.stack([used[torch.randperm(3, generator=gen)[:cfg.moe_top_k]] for _ in range(30)])
    weights = torch.softmax(torch.randn(30, cfg.moe_top_k, generator=gen), -1)

    def grouped(layer, x):
        return dispatch_combine(x, chosen, weights, cfg.n_experts, layer.ep, None, run_grouped=layer._run_grouped)[0]

    def loop(layer, x):
        return dispatch_combine(x, chosen, weights, cfg.n_experts, layer.ep,
                                lambda e, rows: layer.experts[str(e)](rows))[0]

    results = [_grads(layer, x, run) for run in (grouped, loop)]
    for a, b in zip(*results):
        assert_close_fp32(a, b)
    for e in set(range(cfg.n_experts)) - set(used.tolist()):
        for p in layer.experts[str(e)].parameters():
            assert p.grad is not None and not p.grad.any()


def test_the_experts_are_packed_one_after_another_and_read_as_views():
    """Once laid out (materialisation, or the first forward) each expert's parameters lie
    one after another in one storage, values unchanged; the grouped GEMMs read gate and
    up as one strided [E, 2H, d] view and down as [E, d, H], no copy; a dtype change
    unpacks them and the next forward packs them again."""
    layer = _layer()
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    layer.lay_out_parameters()
    per_expert = layer._expert_parameters()
    assert len({p.untyped_storage().data_ptr() for ps in per_expert for p in ps}) == 1
    for n, p in layer.named_parameters():
        assert torch.equal(p, before[n])
    e, d, h = layer.cfg.n_experts, layer.cfg.d_model, layer.cfg.moe_ffn_size
    assert stacked_layout([ps[:2] for ps in per_expert]) == ((e, 2 * h, d), (3 * h * d, d, 1), 0)
    assert stacked_layout([ps[2:] for ps in per_expert]) == ((e, d, h), (3 * h * d, h, 1), 2 * h * d)
    layer.to(torch.bfloat16)
    assert not packed([list(m.parameters()) for m in layer.experts.values()])
    layer(torch.randn(1, 8, d, dtype=torch.bfloat16))
    assert packed([list(m.parameters()) for m in layer.experts.values()])  # packed again


def test_what_the_grouped_gemm_takes():
    """fp32 and bf16 on CPU, bf16 on CUDA, never fp64; row strides of 16 bytes."""
    assert grouped_gemm_fits(torch.float32, "cpu", 64, 32) and grouped_gemm_fits(torch.bfloat16, "cpu", 64, 32)
    assert not grouped_gemm_fits(torch.float64, "cpu", 64, 32)
    assert grouped_gemm_fits(torch.bfloat16, "cuda", 64, 32) and not grouped_gemm_fits(torch.float32, "cuda", 64, 32)
    assert not grouped_gemm_fits(torch.float32, "cpu", 64, 30)  # 120 bytes
    assert grouped_gemm_fits(torch.bfloat16, "cpu", 64, 24) and not grouped_gemm_fits(torch.bfloat16, "cpu", 64, 12)


@pytest.mark.parametrize("where", [dict(), dict(dp_rank=1, cp_size=2, cp_rank=1), dict(cp_size=4, cp_rank=3),
                                   dict(sp_size=2, sp_rank=1),
                                   dict(dp_rank=1, cp_size=2, cp_rank=0, sp_size=2, sp_rank=1)])
def test_token_keys_and_runs_are_made_on_the_device_as_the_plain_integers_say(where):
    """The capacity's token keys and runs as tensor arithmetic equal the per-token loops
    they replace, and capacity_order takes either."""
    ep = ExpertParallel(**where)
    batch, local_len = 3, 8
    most = batch * (2 if ep.cp_size > 1 else 1)
    keys = ep.token_key_tensor(batch, local_len, "cpu")
    assert keys.tolist() == ep.token_keys(batch, local_len)
    runs, starts = run_tensors(keys, most)
    assert (runs.tolist(), starts.tolist()) == token_runs(ep.token_keys(batch, local_len), most)
    gen = torch.Generator().manual_seed(3)
    chosen = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(batch * local_len)])
    from_list = capacity_order(chosen, 4, 0.75, ep, ep.token_keys(batch, local_len), most)
    from_tensor = capacity_order(chosen, 4, 0.75, ep, keys, most)
    for a, b in zip(from_list, from_tensor):
        assert torch.equal(a, b)


# ---- host reads, counted on dry runs ------------------------------------------------------------

def _count_reads(monkeypatch, **fields) -> tuple[int, int, int]:
    """A dry run of rank 0 of moe-tiny (2 MoE layers, 2 micro-batches a step) with
    ``fields``: (moe_routing host reads, MoE layers on the rank, micro-batches)."""
    names = []
    read = host_sync.read

    def counting(name, *args, **kwargs):
        names.append(name)
        return read(name, *args, **kwargs)

    monkeypatch.setattr(host_sync, "read", counting)
    world = fields.pop("world")
    cfg = preset_config("moe-tiny")
    cfg.model = dataclasses.replace(cfg.model, attention="math")
    cfg = set_fields(cfg, micro_batch_size=2, global_batch_size=4 * fields.get("dp", 1), device="cpu", **fields)
    dryrun.dry_run(cfg, world, "0", out=lambda *_: None)
    return names.count("moe_routing"), len(cfg.model.moe_layers), 2


@pytest.mark.parametrize("fields", [
    dict(world=1, dtype="fp32"),
    dict(world=1, dtype="bf16", moe_capacity_factor=1.0),
])
def test_no_host_read_at_ep_1(monkeypatch, fields):
    """At ep 1 the grouped GEMMs take the experts' offsets on the device: no MoE layer
    reads anything back, dropless or with capacity."""
    reads, _, _ = _count_reads(monkeypatch, **fields)
    assert reads == 0


def test_one_host_read_per_moe_layer_and_micro_batch_under_ep(monkeypatch):
    """Under ep > 1 the all-to-all's splits must be on the host: one read per layer and
    micro-batch (the exchanged counts and this rank's, read together), with capacity too."""
    reads, layers, micro_batches = _count_reads(monkeypatch, world=2, dp=2, ep=2, dtype="bf16",
                                                moe_capacity_factor=1.0)
    assert reads == layers * micro_batches


def test_the_fp64_loop_reads_once_per_layer_and_micro_batch_at_ep_1(monkeypatch):
    """The per-expert loop (fp64, the parity reference) splits rows by host sizes: one
    read per layer and micro-batch, as before grouped GEMMs."""
    reads, layers, micro_batches = _count_reads(monkeypatch, world=1, dtype="fp64")
    assert reads == layers * micro_batches
