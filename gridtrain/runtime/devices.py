"""Which device a rank computes on: one rule, as pure functions, used by every path.

A process reaches its GPU three ways: as a ``--nproc`` worker (worker.py binds it before
creating the NCCL group), under torchrun or another launcher that sets LOCAL_RANK
(``launch.init_from_env``) and in the training context (``distributed.setup_distributed``,
which puts the tensors there). They used to disagree (``rank % device_count`` in one,
LOCAL_RANK in the other); now all three call :func:`cuda_device_from_env`, and the
pre-spawn checks of validate.py apply the same :func:`gpu_shortage`.

The rule, from what this process sees:

* **one visible GPU: cuda:0**, whatever LOCAL_RANK and LOCAL_WORLD_SIZE say. This is how
  clusters bind GPUs: Slurm's ``--gpus-per-task=1`` / ``--gpu-bind``, or one container
  per GPU, show each of a node's 8 processes exactly one GPU, its own;
* **several visible GPUs: the one of index LOCAL_RANK** (torchrun, gridtrain's
  ``--nproc``: every worker of the node sees all of them); a LOCAL_RANK with no GPU of
  that index is a real shortage, refused in one line;
* gridtrain's own ``--nproc`` launcher knows that its workers all see the same GPUs, so
  there N workers need N GPUs, one visible GPU included (``same_gpus``), checked before
  anything is spawned.

What one process cannot see is an outside launcher that shows all of a node's workers the
same single GPU (``torchrun --nproc-per-node 8`` on a host with one): they all take cuda:0,
and NCCL refuses the duplicate GPU when the first communicator is set up.

Its own module, not launch.py, because worker.py needs it and launch.py imports
worker.py (the package keeps no import cycles); launch.py re-exports the names.
"""

from __future__ import annotations

import os

import torch


class DeviceError(RuntimeError):
    """This process has no GPU of its own (more workers than visible GPUs, or none), or
    the launcher's LOCAL_RANK / LOCAL_WORLD_SIZE contradict each other."""


def gpu_shortage(local_world_size: int, device_count: int, workers: str, same_gpus: bool = False) -> str | None:
    """Why this node's workers cannot each have a GPU of their own, in one line with the
    fix, or None when they can. ``workers`` names where the count came from (e.g.
    ``"--nproc 4"``, ``"LOCAL_WORLD_SIZE=8 (torchrun --nproc-per-node)"``).

    NCCL refuses two ranks of one communicator on one GPU, so workers that all see the
    same GPUs need one each; sharing them round-robin (``rank % device_count``) would
    only move the failure to the first collective. One visible GPU is the launcher's
    binding of a GPU to each process (see the module docstring) unless ``same_gpus``
    says the workers are known to see the same GPUs (gridtrain's ``--nproc``).
    """
    if device_count < 1:
        return (f"{workers} on cuda, but no CUDA device is visible on this node; "
                "use --device cpu, or run where GPUs are visible (check CUDA_VISIBLE_DEVICES)")
    if device_count == 1 and not same_gpus:
        return None
    if local_world_size > device_count:
        return (f"{workers} needs {local_world_size} CUDA devices on this node (one per rank: NCCL "
                f"cannot put two ranks on one GPU), found {device_count}; use at most {device_count} "
                "workers per node, or --device cpu")
    return None


def local_device_index(local_rank: int, local_world_size: int, device_count: int,
                       workers: str = "this node's workers", shared: bool = False, same_gpus: bool = False) -> int:
    """The GPU index of the worker with ``local_rank`` among ``local_world_size`` workers,
    when this process sees ``device_count`` GPUs: 0 when it sees one (its own), else its
    local rank (see the module docstring).

    This is the only rank-to-GPU rule in the package: the ``--nproc`` workers
    (worker.py), torchrun workers (:func:`gridtrain.runtime.launch.init_from_env`) and the training context
    (distributed.py) all call it, so the GPU a process binds before creating its NCCL
    group is the GPU its tensors are put on. Raises :class:`DeviceError` (one line with
    the fix) when no GPU is visible, or when several are and none has the index
    ``local_rank``; with ``same_gpus`` (the ``--nproc`` workers) when the node's workers
    outnumber its GPUs, on every worker alike.

    ``shared`` (gloo on cuda, :func:`shares_gpus`): workers share the GPUs round-robin
    (``local_rank % device_count``); only a node without a GPU is refused.
    """
    problem = gpu_shortage(1, device_count, workers)
    if problem is None and same_gpus and not shared:
        problem = gpu_shortage(local_world_size, device_count, workers, same_gpus=True)
    if problem is not None:
        raise DeviceError(problem)
    if not 0 <= local_rank < local_world_size:
        raise DeviceError(f"LOCAL_RANK={local_rank} is outside 0..{local_world_size - 1} "
                          f"(LOCAL_WORLD_SIZE={local_world_size}); the launcher's environment is inconsistent")
    if shared:
        return local_rank % device_count
    if device_count == 1:
        return 0
    if local_rank >= device_count:
        raise DeviceError(f"{workers}: LOCAL_RANK={local_rank} takes cuda:{local_rank}, but found {device_count} "
                          f"CUDA devices visible to this process; start at most {device_count} "
                          "workers per node, or show each worker one GPU of its own (Slurm --gpus-per-task=1, "
                          "CUDA_VISIBLE_DEVICES per worker)")
    return local_rank


def shares_gpus(backend: str | None) -> bool:
    """Whether ranks of this backend may share a GPU: gloo may (point-to-point transfers of
    CUDA tensors are staged through host memory, see ``comm.CommGroup.p2p_via_host``);
    NCCL refuses two ranks of one communicator on one GPU."""
    return backend == "gloo"


def local_placement(environ=None) -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) from the environment: torchrun and the ``--nproc``
    workers both set them; a plain process is local rank 0 of 1. Without
    LOCAL_WORLD_SIZE (launchers that set only LOCAL_RANK), the node is assumed to hold
    at least ``LOCAL_RANK + 1`` workers."""
    env = os.environ if environ is None else environ
    local_rank = int(env.get("LOCAL_RANK", "0"))
    return local_rank, int(env.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))


def cuda_device_from_env(environ=None, device_count: int | None = None, shared: bool = False,
                         same_gpus: bool = False) -> torch.device:
    """This process's GPU (:func:`local_device_index` of :func:`local_placement`), with its
    index: ``device_id`` of ``init_process_group`` and ``torch.cuda.set_device`` need one."""
    local_rank, local_world = local_placement(environ)
    count = torch.cuda.device_count() if device_count is None else device_count
    workers = f"LOCAL_WORLD_SIZE={local_world} (workers on this node)"
    return torch.device("cuda", local_device_index(local_rank, local_world, count, workers, shared, same_gpus))


def process_group_device(backend: str, environ=None, same_gpus: bool = False) -> torch.device | None:
    """What to pass as ``init_process_group(device_id=...)``: this process's GPU for NCCL
    (set as the current device too), None for every other backend.

    With ``device_id`` NCCL binds the group to that GPU at once (no guess from the
    current device at the first collective, no later warning about an unknown
    device-to-rank mapping, and ``barrier`` knows its device). ``same_gpus``: this
    process's launcher shows all its workers the same GPUs (gridtrain's ``--nproc``).
    """
    if backend != "nccl":
        return None
    device = cuda_device_from_env(environ, same_gpus=same_gpus)
    torch.cuda.set_device(device)
    return device
