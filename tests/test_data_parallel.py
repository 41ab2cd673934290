"""Data parallelism and the full 3D grid on real gloo processes: parity with one process,
equality with torch DDP, bytes per step, buckets launched during backward, unused
parameters."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gridtrain.parallel.comm import ByteCounter, CommGroup
from gridtrain.config import Config, preset_config
from gridtrain.parallel.data_parallel import GradientReducer, bucket_bounds
from gridtrain.models.decoder import Decoder, init_parameters
from tests.harness import run_on_ranks
from tests.training import SharedSpawns, relative_difference, tiny_config, train_in_process


def _config(**fields) -> Config:
    return tiny_config(global_batch_size=16, micro_batch_size=2, n_layer=4, **fields)


_reference: dict[int, dict] = {}


def reference(steps: int = 10) -> dict:
    if steps not in _reference:
        cfg = _config()
        cfg.training.steps = steps
        _reference[steps] = train_in_process(cfg)
    return _reference[steps]


def assert_matches_reference(run: dict, rtol: float = 1e-9) -> None:
    ref = reference(len(run["losses"]))
    for name in ("losses", "grad_norms"):
        assert relative_difference(run[name], ref[name]) <= rtol, name
    assert abs(run["valid_loss"] - ref["valid_loss"]) <= rtol * ref["valid_loss"]


LAYOUTS = [(2, 2, 2), (2, 2, 1), (1, 2, 2), (2, 1, 2), (2, 4, 1), (4, 1, 2)]  # (dp, pp, tp)
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
CELLS = {f"3d-{dp}-{pp}-{tp}-{s}": ((dp, pp, tp), s) for dp, pp, tp in LAYOUTS for s in SCHEDULES}

# Every multi-rank run of this file: name -> (world size, fields of _config). The runs of
# one world size train one after another on the same ranks (SharedSpawns): one spawn for
# each of 2, 4 and 8 ranks, each test still its own test reading its runs.
RUNS: dict[str, tuple[int, dict]] = {
    "dp2": (2, dict(dp=2)),
    "dp4": (4, dict(dp=4)),
    "dp8": (8, dict(dp=8)),
    "dp2-small-buckets": (2, dict(dp=2, bucket_mb=0.01)),
    "dp2-2-steps": (2, dict(dp=2, steps=2)),
    **{f"zero1-{dp}-{pp}-{tp}": (dp * pp * tp, dict(dp=dp, pp=pp, tp=tp, sequence_parallel=tp > 1, zero=1,
                                                     bucket_mb=0.01))
       for dp, pp, tp in [(2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2)]},
    "zero1-dp2-2-steps": (2, dict(dp=2, zero=1, steps=2)),
    "zero1-dp2-save": (2, dict(dp=2, zero=1, save_interval=5)),  # saved for the one-process resume
    "zero1-dp2-bf16": (2, dict(dp=2, zero=1, dtype="bf16")),
    "fp16-dp2-overflow": (2, dict(dp=2, zero=1, dtype="fp16", loss_scale=2.0 ** 40, steps=30)),
    **{name: (dp * pp * tp, {}) for name, ((dp, pp, tp), _) in CELLS.items()},
}


@functools.cache
def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="gridtrain-dp-"))


def _run_config(name: str) -> Config:
    if name in CELLS:
        return _cell_config(*CELLS[name])
    cfg = _config(**RUNS[name][1])
    if name.endswith("-save"):
        cfg.checkpoint.save = str(_tmp() / name)
    return cfg


run = SharedSpawns(RUNS, _run_config, timeout_s=1800).run


@pytest.mark.spawn
@pytest.mark.parametrize("dp", [2, 4, 8])
def test_data_parallel_trains_the_single_process_model(dp):
    """16 sequences in micro-batches of 2: 4, 2 and 1 micro-batches accumulated per rank;
    weights equal the one-process weights on every rank."""
    for rank_run in run(f"dp{dp}"):
        assert_matches_reference(rank_run)
        for name, value in rank_run["state"].items():
            assert relative_difference(value, reference()["state"][name]) <= 1e-9, name


@pytest.mark.spawn
def test_small_buckets_give_the_same_model():
    for rank_run in run("dp2-small-buckets"):
        assert_matches_reference(rank_run)


RECOMPUTE = ["none", "selective", "full"]
MATRIX_STEPS = 4  # a wrong gradient at step 1 already shows in step 2's loss; 24 cells share the budget


def _recompute_mode(layout: tuple[int, int, int], schedule: str) -> str:
    """One recomputation mode per cell, rotating so that every layout meets every mode
    (over its 4 schedules) and every schedule meets every mode (over its 6 layouts): the
    pairs the matrix exists to check, at a third of the runs (the suite's time budget).
    Each mode against one process is also checked on its own in test_recompute.py."""
    return RECOMPUTE[(LAYOUTS.index(layout) + SCHEDULES.index(schedule)) % len(RECOMPUTE)]


def test_the_recompute_rotation_covers_every_pair():
    modes = {(layout, s): _recompute_mode(layout, s) for layout in LAYOUTS for s in SCHEDULES}
    assert all({modes[layout, s] for s in SCHEDULES} == set(RECOMPUTE) for layout in LAYOUTS)
    assert all({modes[layout, s] for layout in LAYOUTS} == set(RECOMPUTE) for s in SCHEDULES)


@pytest.mark.spawn
@pytest.mark.parametrize("dp,pp,tp", LAYOUTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_3d_layout_trains_the_single_process_model(dp, pp, tp, schedule):
    """DESIGN.md invariant over the 3D matrix (fp64, 1e-9, 4 steps), sequence parallel on
    whenever tp > 1, with the cell's recomputation mode (none, selective or full, see
    :func:`_recompute_mode`; the reference recomputes nothing); interleaving uses 2 chunks
    per rank at pp 2 (at pp 4 the 4 blocks leave one per rank, so one chunk: the schedule
    without interleaving)."""
    for rank_run in run(f"3d-{dp}-{pp}-{tp}-{schedule}"):
        assert_matches_reference(rank_run)


def _cell_config(layout: tuple[int, int, int], schedule: str) -> Config:
    dp, pp, tp = layout
    vpp = 2 if schedule == "interleaved-1f1b" and pp > 1 and 4 % (2 * pp) == 0 else 1
    return _config(dp=dp, pp=pp, tp=tp, vpp=vpp, schedule=schedule, sequence_parallel=tp > 1,
                   recompute=_recompute_mode(layout, schedule), steps=MATRIX_STEPS)


# ---- the reducer against torch DDP, and its counts --------------------------------------------


def _ddp_check(rank: int, world_size: int) -> dict:
    """Same model, same local batches: gridtrain's reducer and torch DDP agree exactly."""
    cfg = preset_config("tiny").model
    ours, theirs = Decoder(cfg).double(), Decoder(cfg).double()
    init_parameters(ours, 0)
    init_parameters(theirs, 0)
    counter = ByteCounter()
    dp = CommGroup.of("dp", dist.group.WORLD, counter)
    reducer = GradientReducer(ours, dp, accumulations=2, bucket_mb=0.02)
    ddp = nn.parallel.DistributedDataParallel(theirs, bucket_cap_mb=0.02)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, cfg.vocab_size, (2, 16), generator=gen) for _ in range(2)]
    reducer.zero()
    for tokens in batches:  # gridtrain: sum of token losses scaled by dp / global tokens
        (ours(tokens, tokens).sum() * world_size / (2 * 2 * 16 * world_size)).backward()
    launched_during_backward = sum(b.pending is not None for b in reducer.buckets)
    reducer.finish()
    with ddp.no_sync():  # DDP: mean loss per rank, averaged by DDP
        (ddp(batches[0], batches[0]).mean() / 2).backward()
    (ddp(batches[1], batches[1]).mean() / 2).backward()
    worst = max(relative_difference(a.grad.numpy(), b.grad.numpy())
                for a, b in zip(ours.parameters(), theirs.parameters()))
    return {"worst": worst, "bytes": counter.bytes[("all_reduce", "dp")],
            "buffer_bytes": reducer.buffer.numel() * 8, "buckets": len(reducer.buckets),
            "launched_during_backward": launched_during_backward, "unused": reducer.stats.unused,
            "zero": _zero_check(rank, world_size, batches, dict(theirs.named_parameters()))}


def _zero_check(rank: int, world_size: int, batches: list[torch.Tensor], reference: dict) -> dict:
    """ZeRO-1's reducer on the same batches: each bucket reduce-scattered as soon as
    backward has finished it, this rank's slices equal to DDP's averaged gradients."""
    cfg = preset_config("tiny").model
    model = Decoder(cfg).double()
    init_parameters(model, 0)
    counter = ByteCounter()
    tied = model.embedding.word.weight  # a parameter with a bucket of its own, as a tied table has
    reducer = GradientReducer(model, CommGroup.of("dp", dist.group.WORLD, counter), accumulations=2,
                              bucket_mb=0.02, shard=True, alone=[tied])
    reducer.zero()
    for tokens in batches:
        (model(tokens, tokens).sum() * world_size / (2 * 2 * 16 * world_size)).backward()
    launched_during_backward = sum(b.pending is not None for b in reducer.buckets)
    reducer.finish()
    worst = 0.0
    for q in reducer.pieces:
        name = reducer.names[q.param]
        expected = reference[name].grad.reshape(-1)[q.lo:q.hi]
        held = torch.cat(reducer.shard_view(q.at, q.end))
        worst = max(worst, relative_difference(held.numpy(), expected.numpy()))
        # reduced in place: the rank's slice of the buffer is where the parameter's gradient lives
        assert [g.data_ptr() for g in reducer.grad_parts(q.param)].count(reducer.shard_view(q.at, q.end)[0].data_ptr()) == 1
        assert reducer.shard_view(q.at, q.end)[0].data_ptr() == q.param.main_grad.view(-1)[q.lo:].data_ptr()
    tied_bucket = [b for b in reducer.buckets if any(p is tied for p in b.params)]
    return {"worst": worst, "bytes": counter.bytes[("reduce_scatter", "dp")],
            "buffer_bytes": reducer.buffer.numel() * 8, "buckets": len(reducer.buckets),
            "launched_during_backward": launched_during_backward,
            "tied_alone": len(tied_bucket) == 1 and len(tied_bucket[0].params) == 1
            and tied_bucket[0].start % world_size == 0,
            "pieces": [(reducer.names[q.param], q.lo, q.hi) for q in reducer.pieces],
            "numel": {reducer.names[p]: p.numel() for p in reducer.params}}


@functools.cache
def _ddp_ranks() -> list[dict]:
    return run_on_ranks(_ddp_check, 2)  # one spawn for the two tests below


@pytest.mark.spawn
def test_reducer_gradients_equal_torch_ddp():
    for result in _ddp_ranks():
        assert result["worst"] <= 1e-12
        assert result["bytes"] == result["buffer_bytes"]  # the whole buffer, once
        assert result["buckets"] > 2 and result["launched_during_backward"] == result["buckets"]
        assert result["unused"] == []


@pytest.mark.spawn
def test_zero1_reducer_reduce_scatters_buckets_during_backward_into_the_ranks_slices():
    """ZeRO-1 (Megatron's layout, counted): every bucket's reduce-scatter is issued
    during backward (none waits for the end), the whole buffer is sent once, bucket
    the tied table has a bucket of its own, and the ranks' pieces tile every parameter
    exactly once, each equal to torch DDP's averaged gradient."""
    ranks = [r["zero"] for r in _ddp_ranks()]
    covered: dict[str, list[tuple[int, int]]] = {}
    for z in ranks:
        assert z["worst"] <= 1e-12
        assert z["bytes"] == z["buffer_bytes"]
        assert z["buckets"] > 2 and z["launched_during_backward"] == z["buckets"]
        assert z["tied_alone"]
        for name, lo, hi in z["pieces"]:
            covered.setdefault(name, []).append((lo, hi))
    for name, numel in ranks[0]["numel"].items():
        spans = sorted(covered[name])
        assert spans[0][0] == 0 and spans[-1][1] == numel, name
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), name


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()

    def forward(self, x):
        return self.used(x).sum()


def _unused_check(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = _WithUnused()
    reducer = GradientReducer(model, CommGroup.of("dp", dist.group.WORLD, ByteCounter()), accumulations=1)
    reducer.zero()
    model(torch.full((2, 4), float(rank + 1), dtype=torch.float64)).backward()
    reducer.finish()
    return {"unused": reducer.stats.unused, "grad": model.used.bias.grad.tolist(),
            "zeros": bool((model.unused.weight.grad == 0).all())}


@pytest.mark.spawn
def test_parameters_without_gradient_take_part_with_zeros_and_are_named():
    for result in run_on_ranks(_unused_check, 2):
        assert result["unused"] == ["unused.weight", "unused.bias"]
        assert result["zeros"] and result["grad"] == [2.0] * 4  # mean of 2 and 2 rows


@pytest.mark.spawn
def test_dp_bytes_per_step_equal_the_gradient_buffer():
    """One all-reduce of every gradient (fp64 here) per step, in one bucket, plus the
    step's scalars (the squared norm, the loss and the non-finite flag: 3 x 8 bytes) in
    one collective; nothing per micro-batch, and no token count (the built-in corpus's
    labels all count: ``Datasets.every_label_counts``)."""
    params = sum(p.numel() for p in Decoder(_config().model).parameters())
    for rank_run in run("dp2-2-steps"):
        for step_bytes, calls in zip(rank_run["step_bytes"], rank_run["step_calls"]):
            assert step_bytes == {"all_reduce/dp": params * 8 + 24}  # gradients; norm, loss, flag
            assert calls == {"all_reduce/dp": 1 + 1}  # no token count: every label of the corpus counts


@pytest.mark.slow
def test_bf16_training_follows_fp32():
    """bf16 parameters and compute, fp32 master weights and gradient accumulation, on CPU:
    per-step losses within 2% of fp32 over 10 steps. bf16 keeps 8 bits of mantissa
    (relative rounding 2^-9 = 0.2% per operation); over a forward and backward through a
    few layers the loss moves by a fraction of a percent (0.03% measured), and the
    updates then diverge slowly; 2% bounds that with room, far below the loss changes
    training makes (over 20% in 10 steps here)."""
    fp32 = train_in_process(tiny_config(dtype="fp32"))
    bf16 = train_in_process(tiny_config(dtype="bf16"))
    assert relative_difference(fp32["losses"][0], fp32["losses"][-1]) > 0.2
    for a, b in zip(fp32["losses"], bf16["losses"]):
        assert abs(a - b) <= 0.02 * a


# ---- ZeRO-1 and mixed precision ---------------------------------------------------------------


@pytest.mark.spawn
@pytest.mark.parametrize("dp,pp,tp", [(2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2)])
def test_zero1_trains_the_single_process_model(dp, pp, tp):
    """ZeRO-1 (sharded master weights and Adam state) is the same optimizer, split; with
    small buckets, so that many reduce-scatters run during backward (and under pp the
    tied table's bucket of its own is summed slice by slice)."""
    for rank_run in run(f"zero1-{dp}-{pp}-{tp}"):
        assert_matches_reference(rank_run)
        for name, value in rank_run["state"].items():
            expected = reference()["state"]["embedding.word.weight" if name == "head" else name]
            if tp == 1:
                assert relative_difference(value, expected) <= 1e-9, name


@pytest.mark.spawn
def test_zero1_moves_gradients_and_weights_once_each():
    """Per step: a reduce-scatter of the (padded) gradient buffer and an all-gather of the
    updated weights, instead of an all-reduce: the same bytes, split in two."""
    params = sum(p.numel() for p in Decoder(_config().model).parameters())
    padded = -(-params // 2) * 2
    for rank_run in run("zero1-dp2-2-steps"):
        for step_bytes, calls in zip(rank_run["step_bytes"], rank_run["step_calls"]):
            assert step_bytes["reduce_scatter/dp"] == padded * 8
            assert step_bytes["all_gather/dp"] == padded * 8
            assert step_bytes["all_reduce/dp"] == 24  # norm, loss, flag (no token count needed)
            assert calls == {"reduce_scatter/dp": 1, "all_gather/dp": 1, "all_reduce/dp": 1}


@pytest.mark.spawn
def test_zero1_checkpoint_resumes_without_sharding():
    """Adam state saved from 2 shards resumes on one process exactly."""
    run("zero1-dp2-save")
    resumed = _config()
    resumed.checkpoint.load = str(_tmp() / "zero1-dp2-save" / "step_0000005")
    one = train_in_process(resumed)
    assert relative_difference(one["losses"], reference()["losses"][5:]) <= 1e-9


@pytest.mark.spawn
def test_bf16_parameters_with_fp32_master_follow_fp32_under_zero1():
    fp32 = train_in_process(_fp32_reference())
    for rank_run in run("zero1-dp2-bf16"):
        for a, b in zip(fp32["losses"], rank_run["losses"]):
            assert abs(a - b) <= 0.02 * a


def _fp32_reference():
    return _config(dtype="fp32")


@pytest.mark.spawn
def test_fp16_dynamic_loss_scaling_skips_overflowing_steps():
    """fp16 parameters and compute: a scale far too large overflows the gradients, every
    rank skips the step (weights untouched) and the scale halves until gradients fit;
    training then goes on (the following test compares fp16 with fp32 step by step)."""
    runs = run("fp16-dp2-overflow")
    norms = runs[0]["grad_norms"]
    skipped = [n == float("inf") for n in norms]
    assert skipped[0] and not skipped[-1] and 0 < sum(skipped) < 30
    assert skipped == sorted(skipped, reverse=True)  # skips only at the start, until the scale fits
    assert runs[0]["losses"] == runs[1]["losses"]
    assert runs[0]["losses"][-1] < runs[0]["losses"][0] - 0.2  # and then it trains


@pytest.mark.slow
def test_fp16_without_overflow_follows_fp32():
    fp32 = train_in_process(_fp32_reference())
    fp16 = train_in_process(_config(dtype="fp16", loss_scale=1024.0))  # a scale that never overflows here
    assert not any(n == float("inf") for n in fp16["grad_norms"])
    for a, b in zip(fp32["losses"], fp16["losses"]):
        assert abs(a - b) <= 0.02 * a


class _Two(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4).to(dtype), nn.Linear(4, 1).to(dtype)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).sum()


@pytest.mark.parametrize("dtype,in_place", [(torch.float64, True), (torch.float32, True),
                                            (torch.bfloat16, False), (torch.float64, False)])
def test_gradients_accumulate_straight_into_the_buffer(dtype, in_place, monkeypatch):
    """Counted, one process: with ``in_place`` and the buffer's dtype, ``param.grad`` is
    the parameter's view of the flat buffer through every micro-batch and the reducer
    copies nothing (no ``add_`` into the buffer); 16-bit parameters (fp32 buffer) or
    ``in_place=False`` (a split backward) take the hook's copy. The accumulated gradient
    is the same either way: the sum over micro-batches."""
    torch.manual_seed(0)
    model = _Two(dtype)
    reducer = GradientReducer(model, CommGroup("dp", size=1), accumulations=3, in_place=in_place)
    copies = []
    add = torch.Tensor.add_
    monkeypatch.setattr(torch.Tensor, "add_", lambda self, *a, **k: copies.append(1) or add(self, *a, **k))
    direct = dtype != torch.bfloat16 and in_place
    xs = [torch.randn(2, 4, dtype=dtype) for _ in range(3)]
    reducer.zero()
    for x in xs:
        model(x).backward()
        for p in model.parameters():
            assert (p.grad is not None and p.grad.data_ptr() == p.main_grad.data_ptr()) == direct
    assert len(copies) == (0 if direct else 3 * 4)
    monkeypatch.undo()
    reducer.finish()
    ref = _Two(dtype)
    ref.load_state_dict(model.state_dict())
    for x in xs:
        ref(x).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.main_grad, q.grad.to(p.main_grad.dtype), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)


# ---- ZeRO-1's bucket layout, as data -------------------------------------------------------


def test_bucket_bounds_end_buckets_on_multiples_of_dp_and_pad_only_the_end():
    numels = [5, 3, 7, 2]
    assert bucket_bounds(numels, 6) == ([0, 5, 8, 15], [(0, 8), (8, 15), (15, 17)], 17)  # DDP: at parameters
    # ZeRO-1 over 4 ranks: boundaries on multiples of 4, the last parameter starts inside
    # the second bucket, padding only at the end: ceil(17 / 4) * 4
    assert bucket_bounds(numels, 6, multiple=4) == ([0, 5, 8, 15], [(0, 8), (8, 16), (16, 20)], 20)
    # a parameter alone (a tied table): last, in its own bucket starting on a multiple
    assert bucket_bounds(numels, 100, multiple=4, alone=[3]) == ([0, 5, 8, 16], [(0, 16), (16, 20)], 20)
    assert bucket_bounds(numels, 6, multiple=4, alone=[0, 3]) == ([12, 0, 3, 20], [(0, 12), (12, 20), (20, 24)], 24)
    assert bucket_bounds([], 6, multiple=4) == ([], [], 0)


@pytest.mark.parametrize("dp", [3, 4])
def test_zero1_pieces_tile_every_parameter_once_across_ranks(dp):
    """Each DP rank owns the r-th 1/dp of every bucket; on the tiny model with small
    buckets and dp 3 some boundaries fall inside parameters, and still every element of every
    parameter belongs to exactly one rank, at a distinct place of its shard, and the
    shard is ``padded / dp`` elements (a stand-in DP group: building issues no collective)."""
    model = Decoder(preset_config("tiny").model)
    tied = model.embedding.word.weight
    numel = sum(p.numel() for p in model.parameters())
    owners = {n: torch.zeros(p.numel(), dtype=torch.int64) for n, p in model.named_parameters()}
    for rank in range(dp):
        reducer = GradientReducer(model, CommGroup("dp", size=dp, rank=rank), accumulations=1, bucket_mb=0.01,
                                  shard=True, alone=[tied])
        assert all((b.end - b.start) % dp == 0 for b in reducer.buckets)
        assert reducer.padded == -(-(numel - tied.numel()) // dp) * dp + -(-tied.numel() // dp) * dp
        # the tiny model's sizes are multiples of 4: only dp 3 puts a boundary inside a parameter
        assert any(len(reducer.buckets_of[p]) > 1 for p in reducer.params) == (dp == 3)
        assert reducer.shard_numel == reducer.padded // dp
        places = torch.zeros(reducer.shard_numel, dtype=torch.int64)
        for q in reducer.pieces:
            owners[reducer.names[q.param]][q.lo:q.hi] += 1
            places[q.at:q.end] += 1
        assert places.max() <= 1
        for p in model.parameters():
            p.main_grad = None  # the next stand-in rank's reducer makes its own buffer
    assert all(bool((o == 1).all()) for o in owners.values())


class _Gathers(CommGroup):
    """A stand-in DP group of 2 that logs when each parameter gather is issued and waited
    for; a gather brings this rank's slice into both halves of the bucket."""

    def __init__(self, log: list):
        super().__init__("dp", size=2, rank=0)
        self.log = log

    def start_all_gather_into(self, out: torch.Tensor, tensor: torch.Tensor):
        log, index = self.log, sum(1 for e in self.log if e[0] == "issue")
        log.append(("issue", index))

        class _Later:
            def wait(self):
                log.append(("wait", index))
                out.view(2, -1).copy_(tensor.reshape(1, -1).expand(2, -1))
                return out
        return _Later()


def test_zero1_parameter_gathers_overlap_the_next_forward_block_by_block():
    """Counted, one process: ``step`` issues one gather per bucket in forward order and
    waits for none; the next forward waits for each block's buckets just before that
    block runs (the first block starts while later blocks' gathers are in flight); the
    parameters then hold the updated master weights; ``parameters_ready`` waits for the
    rest, and a gather is never waited for twice."""
    from gridtrain.optim.distributed_optimizer import DistributedOptimizer
    from gridtrain.training.trainer import gather_before_forwards

    cfg = preset_config("tiny")
    model = Decoder(cfg.model)
    init_parameters(model, 0)
    log: list = []
    reducer = GradientReducer(model, _Gathers(log), accumulations=1, bucket_mb=0.02, shard=True)
    opt = DistributedOptimizer(reducer, cfg.optim, dp=reducer.dp, mp=CommGroup("mp"), tp_rank=0,
                               master_dtype=torch.float32)
    gather_before_forwards(model, opt)
    for name, block in model.blocks.items():
        block.register_forward_pre_hook(lambda *_, name=name: log.append(("block", int(name))))
    for view in reducer.shard_views:
        view.normal_()
    opt.step()
    issued = len(reducer.buckets)
    assert issued > 3 and log == [("issue", i) for i in range(issued)]
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long))
    first_block = log.index(("block", 0))
    waits_before = [e for e in log[:first_block] if e[0] == "wait"]
    assert 0 < len(waits_before) < issued  # the embedding's and block 0's buckets only
    assert [e[0] for e in log[issued:]].count("block") == len(model.blocks)
    waited = [e[1] for e in log if e[0] == "wait"]
    opt.parameters_ready()
    waited_all = [e[1] for e in log if e[0] == "wait"]
    assert sorted(waited_all) == list(range(issued)) and len(waited) <= issued  # each once
    for q in reducer.pieces:  # this rank's slices arrived in the parameters
        assert torch.equal(q.param.detach().reshape(-1)[q.lo:q.hi], opt.master[q.at:q.end])
