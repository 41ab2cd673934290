"""The dry run (gridtrain/dryrun.py): one step of chosen ranks of an N-rank layout on fake
tensors with a fake process group, in this process.

What is checked: the bytes it reports equal the closed forms (and a real gloo run's), the
activation peak follows the formula of docs/memory.md, the step's host reads are the
named ones and any other fails the dry run, a tensor on the wrong device handed to a
collective is caught, and the command line writes the report.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from gridtrain import dryrun
from gridtrain.memory.model import expected_activation_peak, expected_bytes, expected_startup_bytes
from gridtrain.runtime import host_sync
from gridtrain.config import ConfigError, preset_config, set_fields
from gridtrain.parallel.grid import ProcessGrid
from tests.harness import run_on_ranks


def _cfg(preset="tiny", *, tp=1, pp=1, **changes):
    cfg = preset_config(preset)
    cfg.parallel.tp, cfg.parallel.pp = tp, pp
    cfg.training.device = "cpu"
    return set_fields(cfg, **changes)


def test_choose_ranks():
    grid = ProcessGrid.build(640, tp=5, pp=8)
    assert dryrun.choose_ranks(grid, "edges") == [0, 320, 560]  # stages 0, 4, 7 at dp 0, tp 0
    assert dryrun.choose_ranks(ProcessGrid.build(4, pp=2), "edges") == [0, 2]
    assert dryrun.choose_ranks(grid, "3,1,3") == [3, 1]
    assert len(dryrun.choose_ranks(ProcessGrid.build(8, tp=2), "all")) == 8
    with pytest.raises(ConfigError, match="outside"):
        dryrun.choose_ranks(grid, "640")


CASES = {
    "fp32": {},
    "bf16": {"dtype": "bf16"},
    "fp16-zero": {"dtype": "fp16", "zero": 1},
    "zero-sp-full": {"zero": 1, "sequence_parallel": True, "recompute": "full"},
    "gpipe-selective": {"schedule": "gpipe", "recompute": "selective", "attention": "math", "dropout": 0.1},
    "zb-h1": {"schedule": "zb-h1"},
    "interleaved": {"schedule": "interleaved-1f1b", "vpp": 2, "n_layer": 4, "global_batch_size": 16},
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_bytes_equal_closed_forms(case):
    """Every rank of dp 2 x pp 2 x tp 2: parameters, gradient and optimizer bytes as the
    closed forms say, and the step's host reads are exactly the named ones."""
    cfg = _cfg(tp=2, pp=2, **CASES[case])
    grid = ProcessGrid.build(8, tp=2, pp=2)
    report = dryrun.dry_run(cfg, 8, "all", out=lambda *_: None)
    assert [r["rank"] for r in report["ranks"]] == list(range(8))
    for r in report["ranks"]:
        expected = expected_bytes(cfg, grid, r["rank"])
        assert {k: r[k] for k in expected} == expected, r["rank"]
        assert set(r["sync_points"]) == {"step_scalars"} | ({"token_count"} if r["pp"] == 1 else set())
        assert r["peak_bytes"] >= r["parameter_bytes"] + r["gradient_bytes"] + r["activation_peak_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_peak_follows_the_formula(recompute, schedule):
    """Every stage of a 4-stage pipeline: the activation peak is within 5% of the
    formula of docs/memory.md walked along the schedule (memory.model.expected_activation_peak)."""
    cfg = _cfg("small", pp=4, attention="math", dropout=0.1, recompute=recompute, schedule=schedule,
               global_batch_size=16)
    grid = ProcessGrid.build(4, pp=4)
    report = dryrun.dry_run(cfg, 4, "all", out=lambda *_: None)
    for r in report["ranks"]:
        formula = expected_activation_peak(cfg, grid, r["rank"], "cpu")
        assert r["activation_peak_bytes"] == pytest.approx(formula, rel=0.05), r


LARGE = {  # the layouts of 512 to 1024 ranks; about 10 s each here
    "gpt2-xl-640-1f1b-bf16": ("gpt2-xl", 640, dict(tp=5, pp=8, dtype="bf16")),
    "gpt2-xl-640-interleaved-full-fp16": ("gpt2-xl", 640, dict(tp=5, pp=8, dtype="fp16", vpp=2, recompute="full",
                                                               schedule="interleaved-1f1b")),
    "gpt2-large-1024-zero-sp-selective": ("gpt2-large", 1024, dict(tp=4, pp=4, dtype="bf16", zero=1,
                                                                   sequence_parallel=True, recompute="selective")),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", LARGE)
def test_large_layouts(case):
    """The edge ranks of N = 640 and 1024 layouts: bytes exactly the closed forms, the
    activation peak within 5% of the formula, the named host reads only."""
    preset, world, changes = LARGE[case]
    cfg = _cfg(preset, attention="math", micro_batch_size=1, **changes)
    grid = ProcessGrid.build(world, tp=cfg.parallel.tp, pp=cfg.parallel.pp)
    cfg.training.global_batch_size = 8 * grid.dp  # 8 micro-batches per step
    report = dryrun.dry_run(cfg, world, "edges", out=lambda *_: None)
    assert [r["pp"] for r in report["ranks"]] == sorted({0, grid.pp // 2, grid.pp - 1})
    for r in report["ranks"]:
        expected = expected_bytes(cfg, grid, r["rank"])
        assert {k: r[k] for k in expected} == expected, r["rank"]
        formula = expected_activation_peak(cfg, grid, r["rank"], "cpu")
        assert r["activation_peak_bytes"] == pytest.approx(formula, rel=0.05), r
        assert set(r["sync_points"]) <= {"token_count", "step_scalars"}


def test_an_unnamed_host_read_fails_the_dry_run(monkeypatch):
    """A ``float()`` of device data inside the step that is not a named point is found."""
    import gridtrain.training.trainer as trainer_module

    real = trainer_module.step_scalars

    def reads_the_norm(optimizer, *args, **kwargs):
        float(optimizer.grad_norm_squared())  # the kind of read the dry run exists to find
        return real(optimizer, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "step_scalars", reads_the_norm)
    with pytest.raises(dryrun.UnnamedHostSync, match="test_dryrun.py"):
        dryrun.dry_run(_cfg(), 1, "all", out=lambda *_: None)


def test_named_reads_return_real_values_outside_a_dry_run():
    assert host_sync.read("loss", torch.tensor(2.5), float, stand_in=0.0) == 2.5
    with host_sync.allowing() as hits:
        assert host_sync.read("loss", torch.tensor(2.5), float, stand_in=0.0) == 0.0
    assert hits == ["loss"]


def test_a_cpu_tensor_in_a_cuda_collective_is_caught():
    """Fake CUDA tensors can be made without a GPU (no autograd needed here); the check
    names the operation and the device."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        cuda = torch.device("cuda", 0)
        with FakeTensorMode(), dryrun._CollectiveDevices(cuda) as check:
            dist.all_reduce(torch.zeros(3, device=cuda))
            assert check.calls == 1
            with pytest.raises(dryrun.DeviceDisciplineError, match="allreduce_ got a cpu tensor"):
                dist.all_reduce(torch.zeros(3))
            with pytest.raises(dryrun.DeviceDisciplineError, match="send got a cpu tensor"):
                dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.zeros(2), 1)])
    finally:
        dist.destroy_process_group()


def test_which_device_the_dry_run_plans_for(monkeypatch):
    """cpu by default on a CPU build, cuda on a CUDA build; a cuda layout without a GPU
    (a login node) or without CUDA kernels (a CPU build) runs what it can on fake CUDA and
    the rest on fake CPU, and says so."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    assert dryrun.dry_run_device(None) == dryrun.DryRunDevices("cpu")
    cpu_build = dryrun.dry_run_device("cuda")
    assert cpu_build.split and cpu_build.cpu_build and "a CPU build of torch" in cpu_build.describe()
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    login = dryrun.dry_run_device(None)
    assert login.device == "cuda" and login.split and not login.cpu_build and "no GPU here" in login.describe()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not dryrun.dry_run_device(None).split


def test_command_line_writes_the_report(tmp_path, capsys):
    from gridtrain.cli.parser import main

    out = tmp_path / "report.json"
    assert main(["train", "--model", "tiny", "--tp", "2", "--pp", "2", "--device", "cpu", "--dry-run",
                 "--world-size", "16", "--global-batch-size", "32", "--dry-run-report", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["world_size"] == 16
    assert [(r["rank"], r["pp"]) for r in report["ranks"]] == [(0, 0), (8, 1)]
    keys = {"rank", "dp", "pp", "tp", "parameters", "parameter_bytes", "gradient_bytes", "optimizer_bytes",
            "activation_peak_bytes", "peak_bytes", "communicators"}
    assert keys <= set(report["ranks"][0])
    # tp, dp, pp and mp; the embedding group is the pipeline (pp 2) and shares it
    assert [r["communicators"] for r in report["ranks"]] == [{"created": 4, "member": 4}] * 2
    printed = capsys.readouterr().out
    assert "dry run: 16 ranks" in printed and "    4/4 " in printed
    assert main(["train", "--world-size", "4"]) == 2
    assert main(["train", "--dry-run"]) == 2


# ---- process groups at scale ------------------------------------------------------------------------

LAYOUTS_1024 = {  # 1,024 ranks, dp fills the rest: (flags, every group of every kind, docs/dryrun.md's "before")
    "tp8-pp4-cp2-dp16": (dict(tp=8, pp=4, cp=2, global_batch_size=64), 1280),
    "tp8-dp128": (dict(tp=8, pp=1, cp=1, global_batch_size=128), 2312),  # pp, cp 1: their groups are one rank
    "pp2-dp512": (dict(tp=1, pp=2, cp=1, global_batch_size=1024), 2562),  # tp 1; the embedding group = pipeline
}


def _distinct_groups(grid: ProcessGrid, rank: int) -> set[tuple[int, ...]]:
    """The distinct groups of more than one rank that hold ``rank``, from the grid's
    arithmetic: its tp, dp, pp, model-parallel group, its cp ring and dp x cp group when
    cp splits, and the embedding group on the first and last stage."""
    kinds = [grid.tp_group, grid.dp_group, grid.pp_group, grid.model_parallel_group]
    if grid.cp > 1:
        kinds += [grid.cp_group, grid.dp_cp_group]
    if grid.is_first_stage(rank) or grid.is_last_stage(rank):
        kinds.append(grid.embedding_group)
    return {g for g in (tuple(kind(rank)) for kind in kinds) if len(g) > 1}


@pytest.mark.parametrize("layout", LAYOUTS_1024)
def test_a_rank_makes_one_communicator_per_distinct_group_at_1024_ranks(layout):
    """Each edge rank (first, middle, last stage) asks torch for exactly one group per
    distinct group of more than one rank that holds it (a middle stage for one more, of its
    own, where the others make the embedding group); before, every rank asked for every
    group of every kind, most of them other ranks' (LAYOUTS_1024)."""
    from gridtrain.parallel.grid import _group_kinds

    flags, every_group = LAYOUTS_1024[layout]
    cfg = _cfg(n_head=8, n_layer=4, micro_batch_size=1, **flags)
    grid = ProcessGrid.build(1024, **{k: v for k, v in flags.items() if k in ("tp", "pp", "cp")})
    report = dryrun.dry_run(cfg, 1024, "edges", out=lambda line: None)
    assert [r["rank"] for r in report["ranks"]] == dryrun.choose_ranks(grid, "edges")
    for row in report["ranks"]:
        mine = len(_distinct_groups(grid, row["rank"]))
        middle = row["rank"] not in grid.embedding_group(row["rank"])  # makes one group of its own, unused
        assert row["communicators"] == {"created": mine + middle, "member": mine}, (layout, row["rank"])
        assert mine + middle <= len(_group_kinds(grid))
    assert sum(len(groups) for _, groups in _group_kinds(grid)) == every_group  # what every rank made before


# ---- against a real run ---------------------------------------------------------------------------

def _real_rank(rank: int, world_size: int, cfg) -> dict:
    """One real step of this rank (gloo, real tensors) measured as the dry run measures."""
    from dataclasses import asdict

    from gridtrain.parallel.distributed import shutdown
    from gridtrain.training.providers import decoder_forward_step, decoder_model_provider
    from gridtrain.training.trainer import build

    trainer = build(cfg, decoder_model_provider, decoder_forward_step)
    try:
        return asdict(dryrun.measure_step(trainer, dryrun._fake_batches(cfg, trainer), fake=False))
    finally:
        shutdown()


@pytest.mark.spawn
@pytest.mark.parametrize("changes", [{}, {"dtype": "bf16", "zero": 1}])
def test_same_bytes_as_a_real_run(changes):
    """dp 2 x pp 2 (4 gloo processes): parameter, gradient and optimizer bytes and the
    activation meter's peak are those of the real run, rank by rank."""
    cfg = _cfg(pp=2, attention="math", **changes)
    real = run_on_ranks(_real_rank, 4, cfg)
    dry = dryrun.dry_run(cfg, 4, "all", out=lambda *_: None)["ranks"]
    keys = ("parameters", "parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_peak_bytes")
    for r, d in zip(real, dry):
        assert {k: r[k] for k in keys} == {k: d[k] for k in keys}, r["rank"]


def test_moving_a_fake_model_to_cuda_moves_it_and_keeps_the_parameters_marks():
    """The dry run's swap keeps a parameter's own attributes (tp_spec, ...) but took the
    fake tensor's device with them: on a GPU machine the model stayed on cpu while the
    batches went to cuda:0 (found by the GPU self-check)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with dryrun._patched(fake, "cuda"), fake:
        layer = torch.nn.Linear(3, 4)
        layer.weight.tp_spec = "marked"
        layer.to(device=torch.device("cuda", 0), dtype=torch.bfloat16)
        assert layer.weight.device == torch.device("cuda", 0) and layer.weight.dtype == torch.bfloat16
        assert layer.weight.tp_spec == "marked"
        assert torch.cuda.device_count() >= 1  # this rank's cuda:0, GPU or not


STARTS = {  # 8 ranks each: a Llama 256 wide with an 2048-token vocabulary (its largest tensor)
    "zero3 dp8 bf16": dict(zero=3, dp=8, dtype="bf16"),
    "tp2 pp2 dp2 fp32": dict(zero=0, tp=2, pp=2, dp=2, dtype="fp32"),
    "zero1 tp2 dp4 bf16": dict(zero=1, dp=4, tp=2, dtype="bf16"),
    "zero2 dp8 bf16": dict(zero=2, dp=8, dtype="bf16"),
    "zero3 tp2 pp2 dp2 bf16": dict(zero=3, dp=2, tp=2, pp=2, dtype="bf16"),
    "moe zero3 dp8 ep4 bf16": dict(zero=3, dp=8, ep=4, dtype="bf16", n_experts=8, moe_ffn_hidden=128),
}


@pytest.mark.parametrize("name", STARTS)
def test_startup_peak_is_the_memory_models(name):
    """The dry run follows each rank's build: its start-up peak (each rank materialising
    only its own pieces, one whole tensor at a time) is expected_startup_bytes' within
    1% (the rotary tables are the difference)."""
    cfg = set_fields(preset_config("tiny"), arch="llama", n_layer=4, d_model=256, n_head=2, n_kv_head=2,
                     ffn_hidden=1024, vocab_size=2048, seq_len=32, global_batch_size=8, micro_batch_size=1,
                     tie_embeddings=False, device="cpu", **STARTS[name])
    p = cfg.parallel
    grid = ProcessGrid.build(8, tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp)
    for rank in (0, 7):
        measured = dryrun.run_rank(cfg, 8, rank, "cpu").startup_peak_bytes
        expected = expected_startup_bytes(cfg, grid, rank)
        assert abs(measured - expected) <= 0.01 * expected, (rank, measured, expected)
    # the whole model is never on a rank: 4 bytes a parameter in fp32 is far above any rank's start
    whole = 4 * sum(math.prod(t) for t in _shapes(cfg))
    assert expected < 0.75 * whole or p.zero < 3


def _shapes(cfg):
    with torch.device("meta"):
        from gridtrain.models.decoder import Decoder
        return [tuple(q.shape) for q in Decoder(cfg.model).parameters()]
