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
from torch.utils._python_dispatch import TorchDispatchMode

from gridtrain import dryrun
from gridtrain.config import preset_config, set_fields
from gridtrain.models.moe import MoE, packed, stacked_layout
from gridtrain.parallel import experts
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


class _AnyOp(TorchDispatchMode):
    """Every tensor operation run inside (a device read needs one)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def gpu(monkeypatch):
    """A stand-in CUDA runtime with GPUs of a chosen compute capability: returns the
    setter and the list of devices whose capability was asked."""
    asked, capability = [], [(9, 0)]

    def get_device_capability(device=None):
        asked.append(device)
        return capability[0]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)
    experts._device_capability.cache_clear()

    def on(major: int, minor: int) -> list:
        capability[0] = (major, minor)
        experts._device_capability.cache_clear()
        asked.clear()
        return asked
    yield on
    experts._device_capability.cache_clear()


@pytest.mark.parametrize("capability, grouped", [((8, 0), False), ((8, 6), False), ((8, 9), False),
                                                 ((9, 0), True), ((10, 0), True), ((10, 3), True),
                                                 ((12, 0), False)])
def test_grouped_gemms_on_cuda_only_where_torch_has_the_grouped_kernel(gpu, capability, grouped):
    """Issue 54: torch's CUDA _grouped_mm runs a grouped kernel on compute capability 9.0
    and 10.x only; elsewhere (A100: 8.0) its fallback reads the offsets back and runs a
    GEMM per expert, for each of a layer's grouped GEMMs. So bf16 experts on CUDA take the
    grouped GEMMs exactly there and the per-expert loop (one host read per layer and
    micro-batch: test_the_fp64_loop_reads_once_per_layer_and_micro_batch_at_ep_1) elsewhere;
    the capability is read once per device, from the host, no tensor touched."""
    asked = gpu(*capability)
    layer = _layer()
    with _AnyOp() as seen:
        for _ in range(3):  # every micro-batch's forward asks; the device is asked once
            assert grouped_gemm_fits(torch.bfloat16, "cuda", 64, 32) is grouped
            assert grouped_gemm_fits(torch.bfloat16, torch.device("cuda", 0), 64, 32) is grouped
            assert layer.grouped(torch.bfloat16, torch.device("cuda", 0)) is grouped
    assert seen.ops == [] and asked == [0]
    assert grouped_gemm_fits(torch.bfloat16, "cuda:1", 64, 32) is grouped and asked == [0, 1]  # per device
    assert not grouped_gemm_fits(torch.float32, "cuda", 64, 32)  # fp32: never on CUDA
    assert grouped_gemm_fits(torch.float32, "cpu", 64, 32)  # CPU: no capability involved


def test_without_a_gpu_the_dry_run_plans_for_a_hopper_class_one(monkeypatch):
    """A dry run's fake CUDA tensors on a machine without a GPU: the capability cannot be
    read, so the choice plans for the run's target, runtime.cuda_rules.PLANNED_CAPABILITY
    (9.0: grouped GEMMs); set to an A100's, the per-expert loop."""
    from gridtrain.runtime import cuda_rules

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: pytest.fail("no GPU to ask"))
    assert cuda_rules.PLANNED_CAPABILITY == (9, 0) and grouped_gemm_fits(torch.bfloat16, "cuda", 64, 32)
    monkeypatch.setattr(cuda_rules, "PLANNED_CAPABILITY", (8, 0))
    assert not grouped_gemm_fits(torch.bfloat16, "cuda", 64, 32)


def test_the_grouped_bias_gradient_adds_no_two_values_at_one_index():
    """Issue 54: GELU experts' bias gradients (each expert's rows summed) by a segment
    reduction, in row order, not a floating-point index_add_ (atomics on CUDA): the whole
    grouped backward adds no two values at one index, and the sums are, bit for bit, each
    expert's rows added one after another (empty experts: zero)."""
    from gridtrain.models.moe import _expert_sums
    from tests.test_moe import _IndexedSums

    layer = _layer("gpt2")
    offs = torch.tensor([3, 3, 7, 7, 12, 20, 20, 30], dtype=torch.int32)  # experts 1, 3 and 6 get no rows
    assert layer.cfg.n_experts == offs.numel()
    rows = torch.randn(30, layer.cfg.d_model, requires_grad=True)
    with _IndexedSums() as sums:
        out = layer._run_grouped(rows, offs)
        out.backward(torch.randn(out.shape))
    assert sums.seen == []
    g = torch.randn(30, 5)
    want = torch.zeros(offs.numel(), 5)
    for e, (a, b) in enumerate(zip([0] + offs.tolist()[:-1], offs.tolist())):
        for r in range(a, b):
            want[e] = want[e] + g[r]
    assert torch.equal(_expert_sums(g, offs), want)


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
