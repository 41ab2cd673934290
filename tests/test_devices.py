"""Device discipline for NCCL, checked on a CPU machine (issue 12, items 1, 2 and 7).

gloo forgives what NCCL refuses: a CPU tensor in a collective, two ranks on one GPU, a
GPU index that does not exist. None of that can fail here, so these tests check the
decisions as data instead:

* where tensors that reach a collective are allocated on a pipeline stage without
  parameters (the gradient-norm scalar, the reducer's buffer): on the device the caller
  or the group names, shown with the ``meta`` device, which nothing would pick by
  accident;
* that a group with a device refuses, naming the collective and the group, a tensor
  that lives elsewhere;
* the one rank-to-GPU rule (``devices.local_device_index``, re-exported by launch) and every path that uses it
  (``--nproc`` workers, torchrun's ``init_from_env``, the training context), with
  ``torch.cuda.is_available`` / ``device_count`` / ``set_device`` and
  ``init_process_group`` replaced by recorders: no GPU and no process group needed;
* that ``make train`` (4 processes) on a host with 1, 2 or 3 GPUs is refused before any
  worker is spawned, with one line, while a launcher's process that sees one GPU (Slurm
  ``--gpus-per-task=1``, one container per GPU) takes it whatever its LOCAL_RANK;
* and, on two real gloo processes, that the single-tensor gather and reduce-scatter of
  comm.py return exactly what the list forms plus ``cat`` / ``chunk`` returned, with the
  same byte counts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gridtrain.cli import parser as cli
from gridtrain.parallel import comm
from gridtrain.parallel import distributed
from gridtrain.runtime import launch
from gridtrain.runtime import worker
from gridtrain.parallel.comm import ByteCounter, CommGroup, DeviceMismatch, same_device
from gridtrain.config import ConfigError, load_config, set_fields
from gridtrain.parallel.data_parallel import GradientReducer
from gridtrain.runtime.devices import DeviceError, cuda_device_from_env, local_device_index
from gridtrain.optim.optimizer import AdamW
from gridtrain.training.validate import _validate_cuda
from gridtrain.runtime.watchdog import FlightRecorder
from tests.harness import run_on_ranks

REPO = Path(__file__).resolve().parents[1]
META = torch.device("meta")
LAUNCH_VARIABLES = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def gpus(monkeypatch):
    """A pretend CUDA host: ``gpus(n)`` makes torch see ``n`` GPUs; ``set_device`` calls are
    recorded in the returned list. Launcher variables of the test process are cleared."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    chosen: list[torch.device] = []

    def pretend(n: int) -> list[torch.device]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
        return chosen

    return pretend


class _Sent(Exception):
    """Raised by :class:`_Recording` in place of the collective, to stop the caller there."""


class _Recording(CommGroup):
    """A group that records the tensors handed to its all-reduce instead of reducing."""

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM):
        self.sent = tensor
        raise _Sent


# ---- item 1: a stage without parameters allocates on the rank's device -------------------

def test_reducer_buffer_of_a_stage_without_parameters_is_on_the_groups_device():
    """Before: ``device = params[0].device if params else "cpu"``: a CPU buffer in an NCCL
    all-reduce (or ZeRO's reduce-scatter) on a ``--pp-layers 1,3,0,4`` stage."""
    empty = nn.Module()
    for shard in (False, True):
        reducer = GradientReducer(empty, CommGroup("dp", size=2, device=META), accumulations=2, shard=shard)
        assert reducer.buffer.device == META and reducer.buffer.numel() == 0
    explicit = GradientReducer(empty, CommGroup("dp", size=2), accumulations=1, device="meta")
    assert explicit.buffer.device == META  # the device passed wins over "cpu"


def test_gradient_norm_of_a_stage_without_parameters_is_on_the_ranks_device():
    """The zero a parameter-less stage (or a DP replica that counts nothing) adds to the
    norm sum is an fp64 scalar on the rank's device, the tensor the all-reduce gets."""
    inner = torch.optim.AdamW([nn.Parameter(torch.ones(3))])
    for optimizer in (AdamW(inner, [], META), AdamW(torch.optim.AdamW([torch.zeros(0, requires_grad=True)]), [], META)):
        share = optimizer.grad_norm_squared()
        assert share.device == META and share.dtype == torch.float64 and share.shape == ()


# ---- the check every collective makes ---------------------------------------------------

@pytest.mark.parametrize("call", ["all_reduce", "broadcast", "all_gather", "all_gather_list", "reduce_scatter"])
def test_a_group_refuses_a_tensor_on_another_device(call):
    """A CPU tensor handed to a group on another device is refused before anything is
    issued (the group here has no process group at all), naming the call and the group."""
    group = CommGroup("tp", None, size=2, recorder=FlightRecorder(), device=META)
    args = {"all_gather": (1,), "reduce_scatter": (1,)}.get(call, ())
    with pytest.raises(DeviceMismatch) as err:
        getattr(group, call)(torch.zeros(1, 4, 2), *args)
    message = str(err.value)
    assert call.replace("_list", "") in message and "'tp'" in message and "cpu" in message and "meta" in message
    assert "\n" not in message
    assert group.counter.total() == 0 and not list(group.recorder.ops)  # nothing counted or recorded


def test_device_check_is_silent_where_it_should_be():
    group = CommGroup("dp", None, size=2, device=torch.device("cuda", 0))
    assert same_device(torch.device("cuda"), torch.device("cuda", 3))  # an unindexed device matches any index
    assert same_device(torch.device("cuda", 1), torch.device("cuda", 1))
    assert not same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not same_device(torch.device("cpu"), torch.device("cuda", 0))
    CommGroup("dp", None, size=2).check_device("all_reduce", torch.zeros(1))  # no device: no check
    CommGroup("dp", None, size=2, device=torch.device("cpu")).check_device("all_reduce", torch.zeros(1))
    assert CommGroup("one").all_reduce(torch.zeros(1)).device.type == "cpu"  # one rank: identity
    with pytest.raises(DeviceMismatch, match="all_reduce on group 'dp'"):
        group.check_device("all_reduce", torch.zeros(1))


# ---- item 2: one rank-to-GPU rule ------------------------------------------------------

def test_each_local_rank_gets_the_gpu_of_its_index():
    assert [local_device_index(r, 4, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [local_device_index(r, 4, 8) for r in range(4)] == [0, 1, 2, 3]  # spare GPUs stay unused
    assert local_device_index(0, 1, 1) == 0
    assert launch.local_device_index is local_device_index  # the launcher's name for the same rule


@pytest.mark.parametrize("found", [1, 2, 3])
def test_more_nproc_workers_than_gpus_is_refused_in_one_line(found):
    """NCCL refuses two ranks on one GPU; ``rank % device_count`` used to put them there.
    ``--nproc``'s workers all see the same GPUs (``same_gpus``), so every one of them is
    refused, one visible GPU included."""
    for rank in range(4):
        with pytest.raises(DeviceError) as err:
            local_device_index(rank, 4, found, "--nproc 4", same_gpus=True)
        message = str(err.value)
        assert "\n" not in message
        assert "--nproc 4 needs 4 CUDA devices" in message and f"found {found}" in message
        assert f"at most {found} workers per node" in message


def test_no_gpu_and_an_inconsistent_local_rank_are_refused():
    with pytest.raises(DeviceError, match="no CUDA device is visible.*--device cpu"):
        local_device_index(0, 1, 0)
    with pytest.raises(DeviceError, match="LOCAL_RANK=4 is outside 0..3"):
        local_device_index(4, 4, 4)


def test_torchrun_maps_local_rank_not_global_rank():
    """Node 2 of a 2 x 4 job with 8 visible GPUs: global rank 5 is local rank 1 and takes
    GPU 1 (the old launcher rule, ``rank % device_count``, gave GPU 5)."""
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert cuda_device_from_env(env, device_count=8) == torch.device("cuda", 1)
    assert [cuda_device_from_env({**env, "LOCAL_RANK": str(r)}, device_count=4).index for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(DeviceError, match="LOCAL_WORLD_SIZE=4 .*LOCAL_RANK=3 .* found 2"):
        cuda_device_from_env({**env, "LOCAL_RANK": "3"}, device_count=2)
    assert cuda_device_from_env({}, device_count=1) == torch.device("cuda", 0)  # a plain process


def test_one_visible_gpu_per_process_is_that_process_own():
    """Slurm ``--gpus-per-task=1`` / ``--gpu-bind`` or one container per GPU: each of a
    node's 8 processes sees exactly one GPU (cuda:0), its own. It used to be refused
    ("LOCAL_WORLD_SIZE=8 needs 8 CUDA devices, found 1")."""
    node = {"LOCAL_WORLD_SIZE": "8"}
    assert [cuda_device_from_env({**node, "LOCAL_RANK": str(r)}, device_count=1) for r in range(8)] == \
        [torch.device("cuda", 0)] * 8
    assert [cuda_device_from_env({**node, "LOCAL_RANK": str(r)}, device_count=8).index for r in range(8)] == \
        list(range(8))  # all 8 visible to every process: the one of its local rank
    with pytest.raises(DeviceError) as err:
        cuda_device_from_env({**node, "LOCAL_RANK": "5"}, device_count=4)
    message = str(err.value)
    assert "\n" not in message
    assert "LOCAL_RANK=5" in message and "found 4" in message and "LOCAL_WORLD_SIZE=8" in message
    assert "at most 4 workers per node" in message and "--gpus-per-task=1" in message
    assert cuda_device_from_env({**node, "LOCAL_RANK": "3"}, device_count=4) == torch.device("cuda", 3)


def test_torchrun_with_one_gpu_per_process_passes_the_check_before_start(gpus, monkeypatch):
    """Before start, a launcher's LOCAL_WORLD_SIZE=8 with one visible GPU is the binding
    above, not a shortage; with 2 to 7 visible GPUs every worker sees the same ones, and
    the node is short."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = _make_train_config()
    gpus(1)
    _validate_cuda(cfg.parallel, cfg.training)
    gpus(2)
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE=8 .* found 2"):
        _validate_cuda(cfg.parallel, cfg.training)


def test_nproc_workers_bind_their_gpu_and_pass_device_id(gpus, monkeypatch):
    """worker.py on nccl: GPU = local rank (set before the group, and ``device_id``);
    on gloo: no GPU, no ``device_id``."""
    chosen = gpus(4)
    inits = []
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **k: "store")
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: inits.append((a, k)))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "0")  # restored after the test; _set_worker_env overwrites them
    for rank in range(4):
        spec = worker.WorkerSpec(fn=print, args=(), rank=rank, world_size=4, port=1, backend="nccl",
                                 collective_timeout_s=1.0)
        worker._set_worker_env(spec)
        worker._init_worker_process_group(spec)
    assert chosen == [torch.device("cuda", r) for r in range(4)]
    assert [k["device_id"] for _, k in inits] == [torch.device("cuda", r) for r in range(4)]
    gloo = worker.WorkerSpec(print, (), 1, 4, 1, "gloo", 1.0)
    worker._set_worker_env(gloo)
    worker._init_worker_process_group(gloo)
    assert "device_id" not in inits[-1][1] and len(chosen) == 4
    for found in (3, 1):  # the workers all see the same GPUs: rank 0 is refused too, one GPU included
        gpus(found)
        spec = worker.WorkerSpec(print, (), 0, 4, 1, "nccl", 1.0)
        worker._set_worker_env(spec)
        with pytest.raises(DeviceError, match=f"needs 4 CUDA devices.*found {found}"):
            worker._init_worker_process_group(spec)


def test_init_from_env_binds_local_rank_and_passes_device_id(gpus, monkeypatch):
    chosen = gpus(4)
    inits = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: inits.append((a, k)))
    for name, value in {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    assert launch.init_from_env("nccl") == (6, 8, 2)
    assert chosen == [torch.device("cuda", 2)] and inits[-1][1]["device_id"] == torch.device("cuda", 2)
    assert launch.init_from_env("gloo") == (6, 8, 2)
    assert "device_id" not in inits[-1][1] and len(chosen) == 1


def test_training_context_uses_the_same_rule(gpus):
    gpus(4)
    env = {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}
    assert distributed.rank_device("cuda", env) == torch.device("cuda", 3)
    assert distributed.rank_device("cpu", env) == torch.device("cpu")
    gpus(2)
    with pytest.raises(DeviceError, match="found 2"):
        distributed.rank_device("cuda", env)


def test_gloo_ranks_may_share_a_gpu(gpus):
    """``--backend gloo --device cuda`` (the GPU self-check): round-robin over the GPUs."""
    assert [local_device_index(r, 4, 1, shared=True) for r in range(4)] == [0, 0, 0, 0]
    assert [local_device_index(r, 4, 2, shared=True) for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(DeviceError, match="no CUDA device is visible"):
        local_device_index(0, 2, 0, shared=True)
    gpus(2)
    env = {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}
    assert distributed.rank_device("cuda", env, backend="gloo") == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match="found 2"):
        distributed.rank_device("cuda", env, backend="nccl")
    gpus(1)
    assert distributed.rank_device("cuda", env, backend="gloo") == torch.device("cuda", 0)
    cfg = _make_train_config()  # --nproc 4
    set_fields(cfg, device="cuda", backend="gloo")
    _validate_cuda(cfg.parallel, cfg.training)  # four gloo ranks on one GPU: allowed
    cfg.training.backend = None
    with pytest.raises(ConfigError, match="found 1"):
        _validate_cuda(cfg.parallel, cfg.training)


def test_nccl_on_cpu_is_refused_in_one_line(gpus):
    gpus(0)
    cfg = set_fields(_make_train_config(), device="cpu", backend="nccl")
    with pytest.raises(ConfigError, match="^--backend nccl needs --device cuda; use --backend gloo"):
        _validate_cuda(cfg.parallel, cfg.training)


def test_gloo_point_to_point_of_cuda_tensors_goes_through_host_memory():
    """gloo's send/recv of a CUDA pointer fails ("writev ... Bad address", torch 2.11 on
    an H200); its collectives copy through the host themselves."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        on_gpu, on_cpu = torch.empty(4, device="cuda"), torch.empty(4)
    group = CommGroup("pp", object(), size=2, _backend="gloo")
    assert group.p2p_via_host(on_gpu) and not group.p2p_via_host(on_cpu)
    assert not CommGroup("pp", object(), size=2, _backend="nccl").p2p_via_host(on_gpu)
    assert not CommGroup("pp").p2p_via_host(on_gpu)  # the one-rank group sends nothing


# ---- the same rule before anything is spawned -----------------------------------------------

def _make_train_config():
    return load_config(str(REPO / "configs" / "small.yaml"))


@pytest.mark.parametrize("found", [1, 2, 3])
def test_make_train_on_a_host_with_too_few_gpus_is_refused_before_spawning(found, gpus, no_process_may_start,
                                                                           capsys):
    """``make train`` (4 workers, --device not given: cuda where a GPU is visible)."""
    gpus(found)
    assert cli.main(["train", "--config", str(REPO / "configs" / "small.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err == (f"gridtrain: error: --nproc 4 needs 4 CUDA devices on this node (one per rank: NCCL cannot "
                   f"put two ranks on one GPU), found {found}; use at most {found} workers per node, or --device cpu")


def test_make_train_with_four_gpus_passes_the_gpu_check(gpus):
    gpus(4)
    cfg = _make_train_config()
    _validate_cuda(cfg.parallel, cfg.training)
    gpus(0)  # no GPU: the default is cpu, nothing to check
    _validate_cuda(cfg.parallel, cfg.training)


def test_explicit_cuda_without_a_gpu_is_refused(gpus):
    gpus(0)
    cfg = _make_train_config()
    cfg.training.device = "cuda"
    with pytest.raises(ConfigError, match="no CUDA device is available"):
        _validate_cuda(cfg.parallel, cfg.training)


def test_torchrun_checks_its_local_world_against_the_gpus(gpus, monkeypatch):
    gpus(4)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = _make_train_config()  # --nproc 4 in the file is ignored under torchrun
    with pytest.raises(ConfigError, match=r"LOCAL_WORLD_SIZE=8 \(torchrun --nproc-per-node\) needs 8 CUDA "
                                          r"devices.*found 4; use at most 4"):
        _validate_cuda(cfg.parallel, cfg.training)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    _validate_cuda(cfg.parallel, cfg.training)


# ---- item 7: single-tensor gather and reduce-scatter equal the list forms -----------------

def _gather_and_scatter_as_before(rank: int, world: int) -> None:
    """On every dtype and dim the callers use, the new collectives return what
    ``all_gather`` (list) + ``cat`` and ``chunk`` + list ``reduce_scatter`` returned, and
    count the same bytes; so does the list-form fallback for backends without
    ``reduce_scatter_tensor`` (forced here for gloo, which has it in torch 2.13)."""
    counter = ByteCounter()
    group = CommGroup.of("tp", dist.group.WORLD, counter, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(rank)
    for fallback in (False, True):
        if fallback:
            comm._LIST_REDUCE_SCATTER.add(group.backend)
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            base = (torch.randn(3, 4 * world, 6, generator=gen) * 10).to(dtype)
            for x in (base, base.transpose(0, 2)):  # contiguous and not
                for dim in (0, 1, -1, 2):
                    parts = [torch.empty_like(x.contiguous()) for _ in range(world)]
                    dist.all_gather(parts, x.contiguous())
                    expected = torch.cat(parts, dim=dim)
                    before = counter.total("all_gather")
                    got = group.all_gather(x, dim)
                    assert got.dtype == dtype and got.is_contiguous() and torch.equal(got, expected), (dtype, dim)
                    assert counter.total("all_gather") - before == expected.numel() * expected.element_size()
                    if x.shape[dim] % world:
                        continue
                    chunks = [c.contiguous() for c in x.chunk(world, dim=dim)]
                    want = torch.empty_like(chunks[rank])
                    dist.reduce_scatter(want, chunks)
                    before = counter.total("reduce_scatter")
                    got = group.reduce_scatter(x, dim)
                    assert got.is_contiguous() and torch.equal(got, want), (dtype, dim, fallback)
                    assert counter.total("reduce_scatter") - before == x.numel() * x.element_size()
        listed = group.all_gather_list(base)
        assert len(listed) == world and torch.equal(torch.cat(listed, 0), group.all_gather(base, 0))


@pytest.mark.spawn
def test_single_tensor_collectives_equal_the_list_forms():
    run_on_ranks(_gather_and_scatter_as_before, 2)


def test_a_resumed_adam_step_count_sits_where_torch_puts_it():
    """Resuming on a GPU, the fused AdamW refused a step count left on the CPU ("state_steps
    is on cpu", found by the GPU self-check); it belongs on the parameter's device for the
    fused and capturable kernels, on the CPU otherwise, as torch's own AdamW keeps it."""
    from gridtrain.optim.optimizer import AdamW, adam_step_tensor
    from gridtrain.optim.interface import StatePiece

    on_meta = torch.nn.Parameter(torch.empty(3, device=META))
    assert adam_step_tensor(7, on_meta, {"fused": True}).device == META
    assert adam_step_tensor(7, on_meta, {"fused": None, "capturable": True}).device == META
    assert adam_step_tensor(7, on_meta, {"fused": None, "capturable": False}).device.type == "cpu"
    for fused in (True, False):
        p = torch.nn.Parameter(torch.ones(3))
        inner = torch.optim.AdamW([p], fused=fused or None)
        p.grad = torch.ones(3)
        inner.step()
        torch_kept = inner.state[p]["step"]
        wrapped = AdamW(torch.optim.AdamW([p], fused=fused or None))
        wrapped.loaded(5, [StatePiece(p, 0, {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)})])
        step = wrapped.inner.state[p]["step"]
        assert (step.device, step.dtype, float(step)) == (torch_kept.device, torch_kept.dtype, 5.0)
        wrapped.step()  # the kernel takes it
