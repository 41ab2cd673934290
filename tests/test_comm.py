"""The autograd collectives, vocab-parallel cross entropy, TP data broadcast and dropout
under TP, on a live 2-rank gloo group (one spawn runs every check)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gridtrain.parallel import comm
from gridtrain.parallel.comm import ByteCounter, CommGroup
from gridtrain.config import preset_config
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.parallel.rng import MODEL_PARALLEL_RNG, RNGStatesTracker
from gridtrain.parallel.tensor_parallel import (IGNORE_INDEX, TensorParallel, broadcast_batches,
                                       vocab_parallel_cross_entropy)
from tests.harness import run_on_ranks


def _tp(counter: ByteCounter, sequence_parallel: bool = False) -> TensorParallel:
    rng = RNGStatesTracker(torch.device("cpu"))
    rng.add(MODEL_PARALLEL_RNG, 1000 + dist.get_rank())
    return TensorParallel(CommGroup.of("tp", dist.group.WORLD, counter), sequence_parallel, rng)


def _check_mappings(rank: int, tp: TensorParallel) -> None:
    """Each mapping's forward and backward against what it must compute, for 2 ranks."""
    g = tp.comm
    x = torch.arange(8.0).view(1, 2, 4).requires_grad_() * (rank + 1)  # differs per rank
    out = {}
    for name, fn in [("copy", comm.copy_to_tp), ("reduce", comm.reduce_from_tp),
                     ("split", comm.split_last_dim), ("gather", comm.gather_last_dim),
                     ("scatter_seq", comm.scatter_to_seq), ("gather_seq", comm.gather_from_seq),
                     ("reduce_scatter_seq", comm.reduce_scatter_seq)]:
        leaf = x.detach().clone().requires_grad_()
        y = fn(leaf, g)
        (y * (rank + 1)).sum().backward()  # upstream gradient differs per rank too
        out[name] = (y.detach(), leaf.grad)
    base = torch.arange(8.0).view(1, 2, 4)
    ones = torch.ones(1, 2, 4)
    y, grad = out["copy"]
    assert torch.equal(y, base * (rank + 1)) and torch.equal(grad, 3 * ones)  # grad summed: 1 + 2
    y, grad = out["reduce"]
    assert torch.equal(y, 3 * base) and torch.equal(grad, (rank + 1) * ones)
    y, grad = out["split"]
    assert torch.equal(y, (base * (rank + 1))[..., 2 * rank: 2 * rank + 2])
    assert torch.equal(grad, torch.cat([ones[..., :2], 2 * ones[..., :2]], -1))  # gathered grads
    y, grad = out["gather"]
    assert torch.equal(y, torch.cat([base, 2 * base], -1)) and torch.equal(grad, (rank + 1) * ones)
    y, grad = out["scatter_seq"]
    assert torch.equal(y, (base * (rank + 1))[:, rank: rank + 1])
    assert torch.equal(grad, torch.cat([ones[:, :1], 2 * ones[:, :1]], 1))
    y, grad = out["gather_seq"]
    assert torch.equal(y, torch.cat([base, 2 * base], 1)) and torch.equal(grad, 3 * ones)
    y, grad = out["reduce_scatter_seq"]
    assert torch.equal(y, (3 * base)[:, rank: rank + 1])
    assert torch.equal(grad, torch.cat([ones[:, :1], 2 * ones[:, :1]], 1))


def _check_cross_entropy(rank: int, tp: TensorParallel) -> None:
    """Vocab-parallel loss and gradient equal the serial ones, padding and ignored labels included."""
    vocab, padded = 5, 8  # rank 1 owns ids 4..7: one real id, three padding columns
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(2, 3, padded, dtype=torch.float64, generator=gen)
    labels = torch.tensor([[0, 4, IGNORE_INDEX], [3, 1, 4]])
    local = full[..., 4 * rank: 4 * rank + 4].clone().requires_grad_()
    losses = vocab_parallel_cross_entropy(local, labels, vocab, tp)
    (losses * torch.arange(1.0, 7.0, dtype=torch.float64).view(2, 3)).sum().backward()
    serial = full.clone().requires_grad_()
    expected = F.cross_entropy(serial[..., :vocab].flatten(0, 1), labels.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="none").view(2, 3)
    (expected * torch.arange(1.0, 7.0, dtype=torch.float64).view(2, 3)).sum().backward()
    torch.testing.assert_close(losses, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(local.grad, serial.grad[..., 4 * rank: 4 * rank + 4], rtol=1e-12, atol=1e-12)
    assert losses[0, 2] == 0 and (local.grad[0, 2] == 0).all()


def _check_broadcast(rank: int, tp: TensorParallel) -> None:
    """Only the TP group's first rank supplies micro-batches; the others receive them."""
    mine = [{"tokens": torch.full((2, 3), 7 + i), "labels": torch.arange(6).view(2, 3) + i} for i in range(2)]
    got = broadcast_batches(mine if rank == 0 else None, 2, tp, torch.device("cpu"))
    for sent, received in zip(mine, got):
        assert all(torch.equal(sent[k], received[k]) for k in sent)
    assert tp.comm.counter.bytes[("broadcast", "tp")] == 2 * 2 * 6 * 8


def _check_dropout(rank: int, tp: TensorParallel) -> None:
    """With dropout on, replicated activations stay identical across TP ranks (same masks
    outside TP regions) while each rank's heads draw their own masks."""
    cfg = preset_config("tiny").model
    cfg.dropout = 0.5
    model = Decoder(cfg, tp=tp).double()
    init_parameters(model, 0)
    torch.manual_seed(5)  # the default stream: alike on every TP rank
    logits = model(torch.randint(0, cfg.vocab_size, (2, 16)))
    others = [torch.empty_like(logits) for _ in range(2)]
    dist.all_gather(others, logits)
    assert torch.equal(others[0], others[1])
    states = [None, None]
    dist.all_gather_object(states, tp.rng.get_states()[MODEL_PARALLEL_RNG])
    assert not torch.equal(states[0], states[1])


def _all_checks(rank: int, world_size: int) -> bool:
    counter = ByteCounter()
    tp = _tp(counter)
    _check_mappings(rank, tp)
    _check_cross_entropy(rank, tp)
    _check_broadcast(rank, _tp(ByteCounter()))
    _check_dropout(rank, tp)
    _check_dropout(rank, _tp(ByteCounter(), sequence_parallel=True))
    return True


@pytest.mark.spawn
def test_tp_collectives_loss_data_and_dropout_on_two_ranks():
    assert run_on_ranks(_all_checks, 2) == [True, True]


def test_a_collective_that_fails_while_being_issued_is_not_left_waiting():
    """Pending records an op that raised at issue as done: a failure, not a hang."""
    from gridtrain.parallel.comm import Pending
    from gridtrain.runtime.watchdog import FlightRecorder

    group = CommGroup("tp", size=2, recorder=FlightRecorder())
    rec = group.recorder.issue("all_reduce", group.name, (0, 1), 8)

    def refuse():
        raise RuntimeError("backend says no")

    with pytest.raises(RuntimeError, match="backend says no"):
        Pending(group, rec, torch.zeros(1), refuse, None)
    assert rec.done is not None and not group.recorder.pending  # resolved, not in flight
    assert Pending.ready(3).then(lambda x: x + 1).then(lambda x: 2 * x).wait() == 8


def test_reduce_scatter_into_a_wrong_output_is_refused_before_any_collective():
    """``start_reduce_scatter(out=)`` (ZeRO's buckets into ``shard_grad``): an output of the
    wrong shape or dtype is one clear error, raised before anything is sent."""
    group = CommGroup("dp", size=2, rank=0)
    bucket = torch.zeros(8)
    for out in (torch.zeros(3), torch.zeros(4, dtype=torch.float64)):
        with pytest.raises(ValueError, match="the output must be contiguous"):
            group.start_reduce_scatter(bucket, 0, out=out)
