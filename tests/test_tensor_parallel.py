"""Tensor parallelism: shards as data, the RNG tracker, parity with one process, bytes moved."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from gridtrain.parallel.comm import CommGroup
from gridtrain.config import Config
from gridtrain.models.decoder import Decoder
from gridtrain.parallel.rng import MODEL_PARALLEL_RNG, RNGStatesTracker
from gridtrain.parallel.tensor_parallel import ShardSpec, TensorParallel, shard, shard_spec, unshard
from tests.training import FP32_WEIGHT_RTOL, assert_same_training, tiny_config, train_in_process, train_layouts

# ---- shards and RNG as data (no processes) -------------------------------------------------


@pytest.mark.parametrize("spec,shape", [(ShardSpec(0), (8, 3)), (ShardSpec(1), (3, 8)),
                                        (ShardSpec(0, parts=3), (12, 5)), (ShardSpec(0), (8,))])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_shard_then_unshard_is_the_identity(spec, shape, size):
    full = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape)
    shards = [shard(full, spec, r, size) for r in range(size)]
    assert all(s.shape == shards[0].shape for s in shards)
    assert spec.full_shape(shards[0].shape, size) == shape
    torch.testing.assert_close(unshard(shards, spec), full, rtol=0, atol=0)


def test_fused_qkv_shards_hold_whole_heads_of_q_k_and_v():
    """Rank r of a [q; k; v] weight gets rows of q, k and v for the same heads."""
    d, tp = 8, 2
    full = torch.cat([torch.full((d, 1), float(i)) for i in range(3)])  # q rows 0, k rows 1, v rows 2
    full = full + torch.arange(3 * d).unsqueeze(1) % d / 100  # row index within q/k/v
    local = shard(full, ShardSpec(0, parts=3), rank=1, size=tp)
    q, k, v = local.chunk(3)
    for part, tensor in enumerate((q, k, v)):
        assert (tensor.floor() == part).all()
        assert torch.allclose(tensor - part, torch.arange(d // tp, d).unsqueeze(1) / 100)


def test_rng_tracker_forks_a_separate_stream_and_replays_it():
    tracker = RNGStatesTracker(torch.device("cpu"))
    torch.manual_seed(0)
    tracker.add(MODEL_PARALLEL_RNG, 123)
    default_before = torch.get_rng_state()
    saved = tracker.get_states()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), default_before)  # default stream untouched
    with tracker.fork():
        b = torch.rand(4)
    assert not torch.equal(a, b)  # the stream advanced
    tracker.set_states(saved)
    with tracker.fork():
        torch.testing.assert_close(torch.rand(4), a)  # replayed
    with pytest.raises(ValueError, match="already exists"):
        tracker.add(MODEL_PARALLEL_RNG, 1)


def _fake_tp(size: int, rank: int) -> TensorParallel:
    """Layers only need the size and rank to shape themselves; no process group."""
    return TensorParallel(CommGroup("tp", None, size=size, rank=rank))


def test_tp_layers_have_megatron_shapes():
    cfg = tiny_config().model
    model = Decoder(cfg, tp=_fake_tp(4, 2))
    h, f = cfg.d_model, cfg.ffn_size
    block = model.blocks["0"]
    assert block.attn.qkv.weight.shape == (3 * h // 4, h) and block.attn.local_heads == cfg.n_head // 4
    assert block.attn.proj.weight.shape == (h, h // 4) and block.attn.proj.bias.shape == (h,)
    assert block.mlp.fc.weight.shape == (f // 4, h) and block.mlp.proj.weight.shape == (h, f // 4)
    assert model.padded_vocab == 512 and model.embedding.word.weight.shape == (128, h)
    assert model.embedding.word.start == 256  # rank 2 owns rows 256..383: one real row, 127 padding


# ---- parity with one process (real gloo processes) ------------------------------------------


def _parity_config(tp: int, sequence_parallel: bool, dtype: str) -> Config:
    cfg = tiny_config(dtype=dtype)
    cfg.parallel.tp, cfg.parallel.sequence_parallel = tp, sequence_parallel
    assert cfg.model.vocab_size == 257  # bytes + end-of-text: no TP size divides it
    return cfg


def _reference_shards(reference: dict, cfg: Config, tp: int, rank: int) -> dict[str, np.ndarray]:
    """The single-process weights cut the way TP rank ``rank`` holds them (padding zero-filled)."""
    layout = dict(Decoder(cfg.model, tp=_fake_tp(tp, rank)).named_parameters())
    out = {}
    for name, value in reference["state"].items():
        spec = shard_spec(layout[name])
        full = torch.from_numpy(value)
        if spec is None:
            out[name] = value
            continue
        full_shape = spec.full_shape(layout[name].shape, tp)
        padded = torch.zeros(full_shape, dtype=full.dtype)
        padded[tuple(slice(0, n) for n in full.shape)] = full
        out[name] = shard(padded, spec, rank, tp).numpy()
    return out


PARITY = [(2, False, "fp64"), (2, True, "fp64"), (4, False, "fp64"), (4, True, "fp64"),
          (2, True, "fp32"), (4, False, "fp32")]


@pytest.mark.spawn
@pytest.mark.parametrize("tp,sequence_parallel,dtype", PARITY)
def test_tensor_parallel_trains_the_single_process_model(tp, sequence_parallel, dtype):
    """DESIGN.md invariant: same losses and grad norms (fp64 within 1e-9, fp32 within 1e-5)
    and, on every rank, shards equal to the slices of the single-process weights (fp64
    within 1e-9; fp32 see FP32_WEIGHT_RTOL)."""
    rtol, weight_rtol = (1e-9, 1e-9) if dtype == "fp64" else (1e-5, FP32_WEIGHT_RTOL)
    cfg = _parity_config(tp, sequence_parallel, dtype)
    reference = train_in_process(tiny_config(dtype=dtype))
    runs = _tp_runs(tp)[sequence_parallel, dtype]
    for rank, run in enumerate(runs):
        expected = dict(reference, state=_reference_shards(reference, cfg, tp, rank))
        assert_same_training(run, expected, rtol, weight_rtol)


def _traffic_config(sequence_parallel: bool) -> Config:
    cfg = _parity_config(2, sequence_parallel, "fp64")
    cfg.training.steps = 2
    return cfg


@functools.cache
def _saved() -> Path:
    """Where the tp 2 (+SP) run that saves at step 5 writes."""
    return Path(tempfile.mkdtemp(prefix="gridtrain-tp-"))


def _saving_config() -> Config:
    cfg = _parity_config(2, True, "fp64")
    cfg.checkpoint.save, cfg.checkpoint.save_interval = str(_saved()), 5
    return cfg


@functools.cache
def _tp_runs(tp: int) -> dict:
    """The parity cases of ``tp`` ranks (and, at tp 2, the traffic counts' runs and the
    saving run) trained one after another on the same spawned ranks: one spawn per tp size."""
    cases = [(sp, dtype) for t, sp, dtype in PARITY if t == tp]
    cfgs = [_parity_config(tp, sp, dtype) for sp, dtype in cases]
    extras = [("traffic", False), ("traffic", True), ("save", True)] if tp == 2 else []
    cfgs += [_traffic_config(sp) if kind == "traffic" else _saving_config() for kind, sp in extras]
    return dict(zip(cases + extras, train_layouts(cfgs, tp, timeout_s=900)))


# ---- bytes moved --------------------------------------------------------------------------


def expected_tp_bytes(cfg: Config, sequence_parallel: bool, element_size: int) -> dict[str, int]:
    """Analytic TP payload of one training step (see comm.py for what a payload is).

    Per micro-batch of b sequences of s tokens, hidden h, L layers:
    without SP, 2 all-reduces of s*b*h per layer forward (attention and MLP outputs) and
    2 backward (their inputs), plus one each for the embedding (forward) and the LM head's
    input (backward); with SP the same volume as all-gathers and reduce-scatters, plus
    one more all-gather per column-parallel input in backward (each keeps only its
    shard for backward and gathers it again: QKV, fc, the LM head). The
    vocab-parallel cross entropy adds 3 all-reduces of b*s numbers. Under SP the gradients
    of replicated weights fed by shards are all-reduced once per step. The first TP rank
    broadcasts tokens and labels (int64).
    """
    m, t = cfg.model, cfg.training
    b, s, h, L = t.micro_batch_size, m.seq_len, m.d_model, m.n_layer
    n_micro = t.global_batch_size // t.micro_batch_size  # dp = 1
    activation = (2 * L + 1) * b * s * h * element_size  # one direction, one micro-batch
    ce = 3 * b * s * element_size
    out = {"broadcast/tp": n_micro * 2 * b * s * 8}
    if sequence_parallel:
        sp_grads = (L * (2 * 2 * h + 2 * h) + 2 * h + m.seq_len * h) * element_size  # LN, row biases, final LN, positions
        out["all_gather/tp"] = n_micro * 3 * activation
        out["reduce_scatter/tp"] = n_micro * 2 * activation
        out["all_reduce/tp"] = n_micro * ce + sp_grads
    else:
        out["all_reduce/tp"] = n_micro * (2 * activation + ce)
    return out


def _tp_bytes(step_bytes: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in step_bytes.items() if k.endswith("/tp")}


@pytest.mark.spawn
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_traffic_of_a_step_equals_the_analytic_count(sequence_parallel):
    cfg = _traffic_config(sequence_parallel)
    runs = _tp_runs(2)["traffic", sequence_parallel]
    expected = expected_tp_bytes(cfg, sequence_parallel, element_size=8)
    for run in runs:
        for step_bytes in run["step_bytes"]:
            assert _tp_bytes(step_bytes) == expected
    if sequence_parallel:  # the all-reduces' volume, and the re-gathered inputs
        plain = expected_tp_bytes(cfg, False, 8)["all_reduce/tp"] - 2 * 3 * 4 * 64 * 8
        assert expected["all_gather/tp"] + expected["reduce_scatter/tp"] == 2 * plain + plain // 2


@pytest.mark.spawn
def test_checkpoint_written_under_tp_resumes_on_one_process():
    """Checkpoints hold whole tensors: a tp=2 (+SP) run saved at step 5 resumes on one
    process exactly as the one-process run continues (fp64 1e-9), Adam state included."""
    straight = train_in_process(tiny_config())
    _tp_runs(2)["save", True]
    resumed_cfg = tiny_config()
    resumed_cfg.checkpoint.load = str(_saved() / "step_0000005")
    resumed = train_in_process(resumed_cfg)
    assert_same_training(resumed, dict(straight, losses=straight["losses"][5:],
                                       grad_norms=straight["grad_norms"][5:]), rtol=1e-9)


class _EventComm:
    """A two-rank TP group played by one process (the other rank holds the same data),
    logging when each collective is issued and when it is waited for."""

    size, rank, name = 2, 0, "tp"

    def __init__(self, events: list[str]):
        self.events = events

    def _pending(self, kind: str, result: torch.Tensor):
        self.events.append(f"issue {kind}")
        events = self.events

        class Pending:
            def wait(self):
                events.append(f"wait {kind}")
                return result

        return Pending()

    def start_all_reduce(self, t):
        return self._pending("all_reduce", t.mul_(2))

    def start_all_gather(self, t, dim):
        return self._pending("all_gather", torch.cat([t, t], dim))

    def start_reduce_scatter(self, t, dim):
        return self._pending("reduce_scatter", 2 * t.chunk(2, dim)[0].contiguous())

    def all_gather(self, t, dim):
        return self.start_all_gather(t, dim).wait()

    def all_reduce(self, t):
        return self.start_all_reduce(t).wait()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_backward_overlaps_its_collective_with_the_weight_gradients(monkeypatch, sequence_parallel):
    """Megatron's asynchronous TP backward, as data: the input gradient's all-reduce (SP:
    reduce-scatter) is issued before the weight-gradient GEMMs and waited for after them;
    under SP the input's re-gather is issued before the input gradient is computed."""
    import gridtrain.parallel.tensor_parallel as tp_module

    events: list[str] = []
    original = tp_module.weight_grad_of
    monkeypatch.setattr(tp_module, "weight_grad_of",
                        lambda *a: events.append("weight_grad") or original(*a))
    tp = TensorParallel(comm=_EventComm(events), sequence_parallel=sequence_parallel)
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(6, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    outs = tp_module.column_linears(x, weights, tp)
    events.clear()  # the forward's gather (SP) is not the point here
    sum(o.square().sum() for o in outs).backward()
    if sequence_parallel:
        assert events == ["issue all_gather", "issue reduce_scatter", "wait all_gather",
                          "weight_grad", "weight_grad", "wait reduce_scatter"]
    else:
        assert events == ["issue all_reduce", "weight_grad", "weight_grad", "wait all_reduce"]
    assert x.grad is not None and all(w.grad is not None for w in weights)
    # the same gradients as autograd's own linears over the emulated collectives
    total = torch.cat([x, x], 1) if sequence_parallel else x
    ref_x = x.detach().clone().requires_grad_()
    ref_w = [w.detach().clone().requires_grad_() for w in weights]
    ref_total = torch.cat([ref_x, ref_x], 1) if sequence_parallel else ref_x
    sum(torch.nn.functional.linear(ref_total, w).square().sum() for w in ref_w).backward()
    assert total.shape == ref_total.shape
    expected_x = ref_x.grad if sequence_parallel else 2 * ref_x.grad  # TP: the other rank's equal share summed
    torch.testing.assert_close(x.grad, expected_x, rtol=1e-12, atol=1e-12)
    for w, r in zip(weights, ref_w):
        torch.testing.assert_close(w.grad, r.grad, rtol=1e-12, atol=1e-12)


def test_row_parallel_sum_reduces_a_computed_partial_in_place():
    """No copy before the forward all-reduce of a row-parallel layer: its fresh partial
    product is summed in place; a leaf (or a view) is copied first, never overwritten."""
    from gridtrain.parallel import comm

    group = _EventComm([])
    w = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    partial = torch.nn.functional.linear(torch.randn(2, 5, dtype=torch.float64), w)
    before = partial.detach().clone()
    summed = comm.reduce_from_tp(partial, group)
    assert summed.data_ptr() == partial.data_ptr()
    torch.testing.assert_close(summed, 2 * before)
    summed.sum().backward()  # autograd was told: the graph stays valid
    assert w.grad is not None
    leaf = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    kept = leaf.detach().clone()
    out = comm.reduce_from_tp(leaf, group)
    assert out.data_ptr() != leaf.data_ptr()
    torch.testing.assert_close(leaf.detach(), kept)
    view = partial.detach()[:, :2]
    assert comm.reduce_from_tp(view, group).data_ptr() != view.data_ptr()


def test_sequence_parallel_sums_pack_small_gradients_and_sum_large_ones_in_place(monkeypatch):
    """grads.all_reduce_in_place: small gradients packed into buffers of at most
    SUM_BUCKET_BYTES, one at or above it summed in place (no copy of it), every element
    summed once, in one order on every rank."""
    from gridtrain.optim import grads as grads_module

    calls = []

    class Doubling:  # a two-rank sum of equal halves
        def all_reduce(self, t):
            calls.append((t.numel(), t.untyped_storage().data_ptr()))
            return t.mul_(2)

    monkeypatch.setattr(grads_module, "SUM_BUCKET_BYTES", 64)  # 16 fp32 values
    small = [torch.full((3,), float(i)) for i in range(7)]  # 12 bytes each: five fit a bucket
    large = torch.arange(20, dtype=torch.float32)  # 80 bytes: alone, in place
    grads = small[:3] + [large] + small[3:]
    expect = [g * 2 for g in grads]
    grads_module.all_reduce_in_place(Doubling(), grads)
    assert all(torch.equal(g, e) for g, e in zip(grads, expect))
    assert [n for n, _ in calls] == [20, 15, 6]  # the large one first, as it comes; then 5 + 2 small
    assert calls[0][1] == large.untyped_storage().data_ptr()
