"""Kernel launches per step, counted as operators (gridtrain/runtime/op_count.py), against
the peers a user would otherwise run: a plain PyTorch loop on one process and FSDP2 under
ZeRO-3, on the same tiny Decoder, batch and recipe.

Launch counts cost nothing on a CPU, so nothing else in the suite would notice a loop
over parameters creeping into a step; on a GPU each is a few microseconds. The counts
are taken on the CPU, one step after a warm-up step (AdamW's state exists), in this
process: dp 2 runs as rank 0 of torch's fake process group (every collective returns at
once, as the dry run uses it), whose counts are those of a real rank.

The peers: ``clip_grad_norm_`` and ``torch.optim.AdamW``, both ``foreach``, as
benchmarks/speed_vs_torch.py and benchmarks/fsdp_vs_torch.py build them (gridtrain's
Decoder and parameter groups; FSDP2: ``fully_shard`` on every block, then the root).
docs/results.md ("Kernel launches per step") has the numbers.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

from gridtrain.config import preset_config, set_fields
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.models.moe import MoE, accumulate_stacked
from gridtrain.optim.optimizer import param_groups, squared_norm
from gridtrain.parallel.experts import ExpertParallel
from gridtrain.parallel.tensor_parallel import TensorParallel
from gridtrain.runtime.op_count import OpCounter, excess

MICRO_BATCHES = 2


def _config(**fields):
    cfg = set_fields(preset_config("tiny"), **fields)
    cfg.training.device = "cpu"
    cfg.parallel.nproc = None
    return cfg


def _batches(cfg, seed: int = 0) -> list[dict]:
    """This rank's micro-batches: random token ids and their next-token labels."""
    m, mbs = cfg.model, cfg.training.micro_batch_size
    data = torch.randint(0, m.vocab_size, (MICRO_BATCHES * mbs, m.seq_len + 1),
                         generator=torch.Generator().manual_seed(seed))
    return [{"tokens": data[i:i + mbs, :-1].contiguous(), "labels": data[i:i + mbs, 1:].contiguous()}
            for i in range(0, len(data), mbs)]


def _gridtrain(cfg, batches, monkeypatch) -> OpCounter:
    """One counted ``train_step`` after a warm-up one; the optimizer's norm and clipping
    (``clip``) and its step (``optimizer``) as phases."""
    from gridtrain.parallel.distributed import shutdown
    from gridtrain.training.providers import decoder_forward_step, decoder_model_provider
    from gridtrain.training.trainer import build

    counter = OpCounter()
    trainer = build(cfg, decoder_model_provider, decoder_forward_step)
    try:
        opt = trainer.optimizer
        for method, phase in (("grad_norm_squared", "clip"), ("clip_to", "clip"), ("step", "optimizer")):
            def marked(*args, _run=getattr(opt, method), _phase=phase, **kwargs):
                with counter.phase(_phase):
                    return _run(*args, **kwargs)
            monkeypatch.setattr(opt, method, marked)
        trainer.set_lr(1)
        trainer.train_step(batches)
        counter.reset()
        with counter:
            trainer.train_step(batches)
    finally:
        shutdown()
    return counter


def _peer_step(model, cfg, batches, counter: OpCounter, tokens: int):
    """The plain loop's step on ``model`` (a Decoder, or one under ``fully_shard``)."""
    o = cfg.optim
    opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2),
                            eps=o.adam_eps, foreach=True)
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = torch.zeros((), dtype=torch.float64)
        for b in batches:
            summed = model(b["tokens"], b["labels"]).sum()
            (summed * (1.0 / tokens)).backward()
            loss += summed.detach().double()
        with counter.phase("clip"):
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip, foreach=True)
        with counter.phase("optimizer"):
            opt.step()
        if dist.is_initialized():
            dist.all_reduce(loss)  # the mean loss for the log, as gridtrain's step has it
        float(loss)

    return step


def _counted(step, counter: OpCounter) -> OpCounter:
    step()
    counter.reset()
    with counter:
        step()
    return counter


def _message(mine: OpCounter, peer: OpCounter, name: str) -> str:
    return (f"gridtrain: {mine.summary()}\n{name}: {peer.summary()}\n"
            f"gridtrain runs more of: {excess(mine, peer)}")


# ---- one process against a plain loop -------------------------------------------------------------

@pytest.fixture(scope="module")
def one_process():
    monkeypatch = pytest.MonkeyPatch()
    try:
        cfg = _config(global_batch_size=MICRO_BATCHES * 4)
        batches = _batches(cfg)
        mine = _gridtrain(cfg, batches, monkeypatch)
    finally:
        monkeypatch.undo()
    model = Decoder(cfg.model)
    init_parameters(model, cfg.training.seed)
    tokens = sum(b["labels"].numel() for b in batches)
    counter = OpCounter()
    peer = _counted(_peer_step(model, cfg, batches, counter, tokens), counter)
    return mine, peer


def test_one_process_norm_clip_and_optimizer_launch_no_more_than_a_plain_loop(one_process):
    """The gradient norm and clipping (one ``_foreach_norm``, not a cast and a norm per
    parameter) and the optimizer step (fused AdamW) against ``clip_grad_norm_`` and
    AdamW, both ``foreach``."""
    mine, peer = one_process
    for phase in ("clip", "optimizer"):
        assert 0 < mine.phases[phase] <= peer.phases[phase], (phase, _message(mine, peer, "plain loop"))
    assert mine.categories["norm"] <= peer.categories["norm"], _message(mine, peer, "plain loop")


def test_one_process_step_launches_no_more_than_a_plain_loop(one_process):
    """The whole step: with nothing to reduce the gradients are autograd's own (the first
    micro-batch's taken as they are, as a plain loop's), not added into a buffer."""
    mine, peer = one_process
    assert mine.total <= peer.total, _message(mine, peer, "plain loop")


# ---- ZeRO-3 against FSDP2, dp 2 ----------------------------------------------------------------

@pytest.fixture(scope="module")
def zero3_and_fsdp2():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg = _config(dp=2, zero=3, global_batch_size=2 * MICRO_BATCHES * 4)
    batches = _batches(cfg)
    monkeypatch = pytest.MonkeyPatch()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mine = _gridtrain(cfg, batches, monkeypatch)  # destroys the group after
    finally:
        monkeypatch.undo()
        if dist.is_initialized():
            dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            model = Decoder(cfg.model)
            init_parameters(model, cfg.training.seed)
            mesh = init_device_mesh("cpu", (2,))
            for block in model.blocks.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            tokens = 2 * sum(b["labels"].numel() for b in batches)
            counter = OpCounter()
            peer = _counted(_peer_step(model, cfg, batches, counter, tokens), counter)
    finally:
        dist.destroy_process_group()
    return mine, peer


def test_zero3_norm_and_clip_launch_no_more_than_fsdp2(zero3_and_fsdp2):
    """ZeRO-3's gradient norm over its gradient shard and its clipping against
    ``clip_grad_norm_`` (foreach) on FSDP2's sharded gradients."""
    mine, peer = zero3_and_fsdp2
    assert 0 < mine.phases["clip"] <= peer.phases["clip"], _message(mine, peer, "FSDP2")
    assert mine.categories["norm"] <= peer.categories["norm"], _message(mine, peer, "FSDP2")
    assert mine.categories["comm"] <= peer.categories["comm"], _message(mine, peer, "FSDP2")


def test_zero3_step_launches_no_more_than_fsdp2(zero3_and_fsdp2):
    """The whole step: a unit's gradients staged by one concatenation per micro-batch
    (FSDP2's chunk_cat), AdamW's arithmetic as multi-tensor operations over groups of
    shard slices (its step alone takes a few more operators than FSDP2's one fused
    kernel per parameter group: a group per unit-sized slice)."""
    mine, peer = zero3_and_fsdp2
    assert mine.total <= peer.total, _message(mine, peer, "FSDP2")


# ---- the pieces -------------------------------------------------------------------------------

def _squared_norm_per_tensor(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The norm as it was: an upcast copy and a norm per tensor."""
    norms = torch._foreach_norm([t.to(torch.promote_types(t.dtype, torch.float32)) for t in tensors])
    return torch.stack([n.double() for n in norms]).square().sum()


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float64,),
                                    (torch.float32, torch.bfloat16)])
def test_the_gradient_norm_is_a_fixed_number_of_operators(dtypes):
    """Bit for bit the per-tensor norm's value, in a handful of operators however many
    tensors: per run of tensors of one dtype the norms, their stack and its cast, then
    the square and the sum (and a concatenation of the runs)."""
    gen = torch.Generator().manual_seed(0)
    for n in (4, 60):
        tensors = [torch.randn(17 * (i % 5 + 1), generator=gen).mul(10.0 ** (i % 7 - 3))
                   .to(dtypes[i * len(dtypes) // n]) for i in range(n)]
        with OpCounter() as counter:
            got = squared_norm(tensors, torch.device("cpu"))
        assert torch.equal(got, _squared_norm_per_tensor(tensors)) and got.dtype == torch.float64
        assert counter.total <= 3 * len(dtypes) + 3, counter.ops


def _moe_layer() -> MoE:
    cfg = set_fields(preset_config("moe-tiny"), moe_aux_loss_coeff=0.1).model
    torch.manual_seed(0)
    layer = MoE(cfg, 0, TensorParallel(), ExpertParallel())
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _buffer_grads(layer: MoE, reverse: bool) -> dict:
    """Give the experts' parameters ``.grad`` views of one zero buffer, as the gradient
    reducer does (``reverse``: in reversed registration order, as it lays them out now;
    else each expert's parameters in registration order, one expert after another), and
    the reducer's post-accumulate hook; returns the hook calls per parameter."""
    params = [p for ps in layer._expert_parameters() for p in ps]
    order = list(reversed(params)) if reverse else params
    buffer = torch.zeros(sum(p.numel() for p in params))
    calls = {p: 0 for p in params}

    def ready(p):
        calls[p] += 1

    at = 0
    for p in order:
        p.grad = buffer[at:at + p.numel()].view_as(p)
        at += p.numel()
        p.register_post_accumulate_grad_hook(ready)
    return calls


@pytest.mark.parametrize("reverse", [False, True])
def test_stacked_expert_gradients_accumulate_in_one_operator(reverse):
    """Grouped experts whose gradients lie as one stacked view (each expert's parameters
    in registration order) take each GEMM's weight gradient in one ``add_``, not one per
    parameter, with the values autograd's accumulation gives, bit for bit, and the
    reducer told once per parameter and backward; laid out otherwise (the reducer's
    reversed order) autograd accumulates them as before."""
    layer = _moe_layer()
    reference = copy.deepcopy(layer)
    calls = _buffer_grads(layer, reverse)
    x = torch.randn(2, 24, layer.cfg.d_model, generator=torch.Generator().manual_seed(1))
    counters = []
    for _ in range(2):  # the second backward adds to the first's gradients
        for model in (layer, reference):
            counter = OpCounter()
            out = model(x)
            with counter:
                out.backward(torch.ones_like(out))
            counters.append(counter)
        for q in reference.parameters():  # tensors of their own (autograd took views of one stacked gradient)
            q.grad = q.grad.clone()
    for p, q in zip(layer.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert set(calls.values()) == {2}
    experts = 3 * len(layer.experts)
    added, autograd_added = counters[2].ops["add_"], counters[3].ops["add_"]
    if reverse:
        assert added == autograd_added
    else:
        assert added <= autograd_added - experts + 2, (added, autograd_added)


def test_stacking_takes_no_gradient_it_cannot_add_exactly():
    """Nothing is touched where autograd's accumulation would differ: no ``.grad`` yet,
    another dtype, a hook that may change the gradient first, a higher-order graph."""
    layer = _moe_layer()
    groups = [ps[2:] for ps in layer._expert_parameters()]  # the down projections
    d = torch.ones(len(groups), *groups[0][0].shape)
    with torch.no_grad():  # as in backward
        assert not accumulate_stacked(groups, d)  # no .grad
        _buffer_grads(layer, reverse=False)
        assert not accumulate_stacked(groups, d.double())
        with torch.enable_grad():
            assert not accumulate_stacked(groups, d)
        assert accumulate_stacked(groups, d)
        assert all(torch.equal(g[0].grad, torch.ones_like(g[0])) for g in groups)
        groups[1][0].register_hook(lambda g: 2 * g)
        assert not accumulate_stacked(groups, d)


if __name__ == "__main__":  # the numbers of docs/results.md: python tests/test_launch_counts.py
    for title, (mine, peer), name in (("one process", one_process.__wrapped__(), "plain loop"),
                                      ("dp 2, ZeRO-3", zero3_and_fsdp2.__wrapped__(), "FSDP2")):
        print(f"{title}\n  gridtrain: {mine.summary()}\n  {name}: {peer.summary()}\n"
              f"  gridtrain runs more of: {excess(mine, peer)}")
