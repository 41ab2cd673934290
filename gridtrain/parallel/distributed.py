"""Where this process sits: the default process group, the grid, its groups, the device.

A run reaches here in one of three ways: as one of ``--nproc`` workers (the launcher
has already initialised the default group), under ``torchrun`` (the environment says
who we are), or as a plain single process (a one-rank gloo group on an in-memory store,
so that the same code path, collectives included, runs everywhere).

Every process group gets the backstop timeout of watchdog.py (``--timeout`` plus a
margin), and with more than one rank a watchdog thread is started here and stopped by
:func:`shutdown`: it turns a wait longer than ``--timeout`` into a hang report naming the
rank that never arrived (docs/hangs.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from gridtrain.runtime import watchdog
from gridtrain.parallel.comm import ByteCounter, CommGroup, single
from gridtrain.config import Config
from gridtrain.runtime.devices import cuda_device_from_env, process_group_device, shares_gpus
from gridtrain.parallel.context_parallel import ContextParallel
from gridtrain.parallel.float8 import Float8, ScaleLog
from gridtrain.parallel.experts import ExpertParallel
from gridtrain.parallel.grid import ProcessGrid, ProcessGroups, create_process_groups
from gridtrain.runtime.launch import backend_for, init_from_env, resolve_device_type
from gridtrain.parallel.recompute import Recomputation, policy_from
from gridtrain.parallel.rng import MODEL_PARALLEL_RNG, MODEL_PARALLEL_SEED_OFFSET, RNGStatesTracker
from gridtrain.parallel.tensor_parallel import TensorParallel
from gridtrain.parallel.pipeline.schedules import uses_split_backward
from gridtrain.parallel.split_backward import WeightGradStore

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


@dataclass
class DistributedContext:
    grid: ProcessGrid
    groups: ProcessGroups
    rank: int
    device: torch.device
    dtype: str  # the run's --dtype
    tp: TensorParallel  # the TP group, sequence parallelism, RNG streams
    recompute: Recomputation  # which activations are recomputed; replays tp's RNG streams
    dp: CommGroup
    mp: CommGroup  # model parallel: TP x PP, over which the gradient norm is summed
    pp: CommGroup
    embedding: CommGroup | None  # first and last pipeline stage (tied embeddings), if a member
    bytes: ByteCounter  # every counted collective of this rank
    recorder: watchdog.FlightRecorder = field(default_factory=watchdog.process_recorder)  # the flight recorder
    cp: ContextParallel = field(default_factory=ContextParallel)  # the cp ring the sequence is split over
    dp_x_cp: CommGroup | None = None  # the dp x cp group when cp > 1 (see dp_cp)
    zero_shard: CommGroup | None = None  # hybrid sharding: ZeRO shards within this part of dp x cp ...
    zero_replica: CommGroup | None = None  # ... replicated across these
    ep: ExpertParallel = field(default_factory=ExpertParallel)  # experts' group, global routing statistics
    expert_dp: CommGroup | None = None  # --ep > 1: the ranks holding this rank's experts (see expert_dp_cp)

    @property
    def expert_dp_cp(self) -> CommGroup:
        """The ranks whose gradients of this rank's experts are summed: its
        expert-data-parallel group, or dp x cp when the experts are not split."""
        return self.expert_dp if self.expert_dp is not None else self.dp_cp

    @property
    def shard_group(self) -> CommGroup:
        """The ranks ZeRO shards over: dp x cp, or its hybrid-sharding part."""
        return self.zero_shard if self.zero_shard is not None else self.dp_cp

    @property
    def dp_cp(self) -> CommGroup:
        """dp x cp, the ranks holding the same parameters, each with part of the global
        batch (its dp slice, its cp chunks): gradients are averaged, ZeRO-1 shards, losses
        and token counts are summed and checkpoint writes spread over it. The dp group
        itself when cp is 1 (also in a context derived with ``dataclasses.replace`` and
        another dp group, as the benchmarks' one-process references are)."""
        return self.dp if self.cp.size == 1 else self.dp_x_cp

    @property
    def param_dtype(self) -> torch.dtype:
        """The parameters' and the computation's dtype; bf16 runs keep fp32 master weights
        in the optimizer and accumulate gradients in fp32 (data_parallel.py)."""
        return TORCH_DTYPES[self.dtype]

    @property
    def coords(self):
        return self.grid.coords(self.rank)

    @property
    def is_logging_rank(self) -> bool:
        """The rank that holds the loss and writes progress: last stage, first DP/TP rank."""
        c = self.coords
        return self.grid.is_last_stage(self.rank) and c.dp == 0 and c.tp == 0 and c.cp == 0


def launched_by_env() -> bool:
    """A launcher (torchrun) set this process's rank and world: the default group is made
    from them and belongs to the launcher's run; else it is a one-rank group of its own."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_default_group(cfg: Config) -> None:
    """Initialise torch.distributed unless a launcher already did."""
    if dist.is_initialized():
        return
    backend = backend_for(resolve_device_type(cfg.training.device), cfg.training.backend)
    if launched_by_env():  # torchrun
        init_from_env(backend, watchdog.backstop_timeout_s(cfg.training.dist_timeout_s))
    else:
        device_id = process_group_device(backend)
        extra = {"device_id": device_id} if device_id is not None else {}
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=cfg.training.dist_timeout_s), **extra)


def rank_device(device_type: str, environ=None, backend: str | None = None) -> torch.device:
    """The device this rank computes on: its GPU by the launcher's rule
    (:func:`gridtrain.runtime.devices.cuda_device_from_env`, the one the process group was bound
    with; shared round-robin under gloo), else the CPU."""
    if device_type == "cuda":
        return cuda_device_from_env(environ, shared=shares_gpus(backend_for(device_type, backend)))
    return torch.device(device_type)


def setup_distributed(cfg: Config) -> DistributedContext:
    """Initialise (if needed) and build the grid's groups; seed this rank's generators;
    start the hang watchdog."""
    init_default_group(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    p = cfg.parallel
    grid = ProcessGrid.build(world, tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp)
    timeout_s = cfg.training.dist_timeout_s
    groups = create_process_groups(grid, rank, timeout=timedelta(seconds=watchdog.backstop_timeout_s(timeout_s)),
                                   zero_shard_size=p.zero_shard_size, ep=p.ep, etp=p.etp)
    device = rank_device(resolve_device_type(cfg.training.device), backend=cfg.training.backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Dropout masks differ between pipeline stages (they hold different layers) but not
    # between DP replicas or TP ranks, as in Megatron; TP regions draw from their own
    # per-rank stream. (cp > 1 runs without dropout: validate.py refuses it.)
    coords = grid.coords(rank)
    seed = cfg.training.seed + 100 * coords.pp
    torch.manual_seed(seed)
    rng = RNGStatesTracker(device)
    rng.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + coords.tp)
    counter = ByteCounter()
    recorder = watchdog.process_recorder()
    watchdog.start_watchdog(recorder, rank, world, timeout_s, device)
    # zero-bubble schedules split each backward: the layers queue their weight gradients
    # in this store for the schedule's W actions (PipelineStage gets the same store)
    weight_grads = WeightGradStore() if uses_split_backward(p.schedule) else None

    def comm(kind: str) -> CommGroup | None:
        # Every group knows the rank's device: its collectives refuse a tensor elsewhere, and
        # code with no tensor of its own (a stage without parameters) allocates there.
        return _comm(groups, kind, counter, device)

    tp = TensorParallel(comm("tp"), sequence_parallel=p.sequence_parallel and p.tp > 1, rng=rng,
                        weight_grads=weight_grads)
    dp, dp_x_cp, cp = comm("dp"), comm("dp_cp"), comm("cp")
    if cfg.training.fp8 != "none":  # the scales' groups: tp, and cp (a micro-batch's tokens)
        tp.fp8 = Float8(cfg.training.fp8, tp.comm, cp or single("cp"), emulate=device.type != "cuda",
                        log=ScaleLog())  # the first step's scales (tests)
    return DistributedContext(grid=grid, groups=groups, rank=rank, device=device,
                              dtype=cfg.training.dtype, tp=tp,
                              recompute=Recomputation(policy_from(cfg.activations), rng),
                              dp=dp, mp=comm("mp"), pp=comm("pp"),
                              embedding=comm("embedding") if grid.pp > 1 else None,  # None on middle stages too
                              bytes=counter, recorder=recorder,
                              cp=ContextParallel(cp, p.cp_comm) if cp is not None else ContextParallel(mode=p.cp_comm),
                              dp_x_cp=dp_x_cp, zero_shard=comm("zero_shard"), zero_replica=comm("zero_replica"),
                              ep=_expert_parallel(comm("ep") or single("ep"), tp, dp_x_cp or dp, coords, grid.cp,
                                                  grid.folds_experts(p.ep, p.etp), comm("etp") or single("etp"),
                                                  cp=cp),
                              expert_dp=comm("expert_dp"))


def _comm(groups: ProcessGroups, kind: str, counter: ByteCounter, device: torch.device) -> CommGroup | None:
    """This rank's group of ``kind`` for collectives: on its torch group, or the rank alone
    where the group is this one rank (no torch group is made for it, grid.py); None where
    the run has no such group (cp when cp is 1, a middle stage's embedding group)."""
    if kind not in groups.members:
        return None
    group = groups.group(kind)
    if group is None:
        return CommGroup.alone(kind, groups.rank, counter, device=device)
    return CommGroup.of(kind, group, counter, device=device)


def _expert_parallel(comm: CommGroup, tp: TensorParallel, dp_cp: CommGroup, coords, cp_size: int,
                     folded: bool = False, etp: CommGroup | None = None,
                     cp: CommGroup | None = None) -> ExpertParallel:
    """The ep group (one rank when --ep is 1), the groups a global micro-batch's tokens
    are spread over (dp x cp, and tp under sequence parallelism: without it the tp ranks
    hold the same tokens), those one sequence's tokens are (``cp``'s group, and tp under
    sequence parallelism) and where this rank's tokens sit in it."""
    spread = (dp_cp, tp.comm) if tp.sequence_parallel else (dp_cp,)
    sp = tp.sequence_parallel
    sequence = ((cp,) if cp is not None else ()) + ((tp.comm,) if sp else ())
    return ExpertParallel(comm, spread, dp_rank=coords.dp, cp_size=cp_size, cp_rank=coords.cp,
                          sp_size=tp.size if sp else 1, sp_rank=tp.rank if sp else 0, folded=folded,
                          etp=etp or single("etp"), sequence_groups=sequence, dp_size=dp_cp.size // cp_size)


def shutdown() -> None:
    """Stop the watchdog, then destroy the process groups."""
    watchdog.stop_watchdog()
    if dist.is_initialized():
        dist.destroy_process_group()
