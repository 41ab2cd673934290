"""Multi-process tests of gridtrain.runtime.launch and the live process groups of gridtrain.parallel.grid.

Every worker function is module-level so that spawned children can import it
from ``tests.test_launch``. Each spawn of torch processes costs seconds on a
small CPU machine, so the group checks share one 8-rank world.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

from gridtrain.parallel.grid import GridError, ProcessGrid, create_process_groups
from gridtrain.runtime.launch import (
    LaunchError,
    WorkerError,
    WorkerTimeout,
    find_free_port,
    init_from_env,
    run_workers,
)
from gridtrain.runtime import warm
from tests.harness import run_on_ranks

GROUP_KINDS = {  # kind -> ProcessGrid method giving a rank's group of that kind
    "tp": "tp_group",
    "dp": "dp_group",
    "pp": "pp_group",
    "mp": "model_parallel_group",
    "embedding": "embedding_group",
    "cp": "cp_group",
    "dp_cp": "dp_cp_group",
}
LAYOUTS_8 = [  # (layout, the kinds a rank has, the kinds sharing one group), made in turn in one world
    (dict(tp=2, pp=4), ["tp", "dp", "pp", "mp", "embedding"], []),  # middle stages: no embedding group
    (dict(tp=2, pp=2), ["tp", "dp", "pp", "mp", "embedding"], [("embedding", "pp")]),  # pp 2: embedding = pp
    (dict(tp=2, cp=2), ["tp", "dp", "pp", "mp", "embedding", "cp", "dp_cp"], [("mp", "tp")]),  # pp 1: alone
]


def _all_reduce_every_group(rank: int, world_size: int) -> dict:
    """For each layout of LAYOUTS_8 in turn, in one world: sum the rank over each of this
    rank's groups (a rank alone in its group keeps its own value); report the sums, the
    group objects shared between kinds, the new_group calls made, env and threads.

    Higher ranks return first, so that an ordering by arrival would be caught.
    """
    calls = []
    new_group = dist.new_group

    def counted(*args, **kwargs):
        calls.append(kwargs.get("ranks"))
        return new_group(*args, **kwargs)

    dist.new_group = counted
    layouts = []
    for layout, _, _ in LAYOUTS_8:
        calls.clear()
        groups = create_process_groups(ProcessGrid.build(world_size, **layout), rank)
        sums, sizes = {}, {}
        for kind in groups.members:
            value = torch.tensor([float(rank)], dtype=torch.float64)
            group = groups.group(kind)
            if group is not None:
                dist.all_reduce(value, group=group)
            sums[kind], sizes[kind] = value.item(), 1 if group is None else dist.get_world_size(group)
        shared = sorted((a, b) for a in groups.live for b in groups.live if a < b and groups.live[a] is groups.live[b])
        layouts.append({"sums": sums, "sizes": sizes, "shared": shared, "calls": list(calls),
                        "coord": tuple(groups.coord)})
    dist.new_group = new_group
    time.sleep(0.05 * (world_size - rank))
    return {
        "rank": rank,
        "layouts": layouts,
        "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")},
        "threads": torch.get_num_threads(),
    }


@pytest.mark.spawn
def test_all_reduce_over_every_group_kind_of_8_rank_grids() -> None:
    """Every kind's group sums what the grid says it holds; no group of one rank is made
    and kinds with the same groups share them, so a rank calls new_group once per distinct
    group of more than one rank that holds it, and a middle stage once more for a group of
    its own in place of the embedding group (so that all ranks make as many groups: torch
    names them by that count, and a later layout in the same world must still meet)."""
    results = run_on_ranks(_all_reduce_every_group, 8)
    assert [r["rank"] for r in results] == list(range(8))  # ordered by rank, not arrival
    for index, (layout, kinds, shared) in enumerate(LAYOUTS_8):
        grid = ProcessGrid.build(8, **layout)
        for rank, result in enumerate(results):
            got = result["layouts"][index]
            middle = rank not in grid.embedding_group(rank)  # a middle stage holds no embedding
            mine = [kind for kind in kinds if not (middle and kind == "embedding")]
            assert sorted(got["sums"]) == sorted(mine), (layout, rank)
            for kind in mine:
                ranks = getattr(grid, GROUP_KINDS[kind])(rank)
                assert got["sums"][kind] == sum(ranks) and got["sizes"][kind] == len(ranks), (layout, rank, kind)
            assert got["shared"] == shared, (layout, rank)
            distinct = {tuple(getattr(grid, GROUP_KINDS[kind])(rank)) for kind in mine}
            own = [(rank,)] if middle else []
            assert sorted(map(tuple, got["calls"])) == sorted([g for g in distinct if len(g) > 1] + own), (layout, rank)
            assert got["coord"] == tuple(grid.coords(rank))
    for rank, result in enumerate(results):
        assert result["env"] == {
            "RANK": str(rank), "WORLD_SIZE": "8", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "8",
        }
        assert result["threads"] == max(1, (os.cpu_count() or 1) // 8)


def _single_rank_world(rank: int, world_size: int) -> dict:
    """A 1-rank grid makes no groups (the rank is alone in each); a wrong grid is refused;
    init_from_env joins a torchrun-style environment (here: a fresh 1-rank job)."""
    groups = create_process_groups(ProcessGrid.build(1), rank)
    alone = {kind: (groups.members[kind], groups.group(kind)) for kind in groups.members}
    try:
        create_process_groups(ProcessGrid.build(2, tp=2), rank)
    except GridError as exc:
        refusal = str(exc)
    already = init_from_env()  # already initialized by the launcher: only reads the env
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(find_free_port())  # the launcher's store holds its port
    fresh = init_from_env(collective_timeout_s=30)
    total = torch.tensor([5.0])
    dist.all_reduce(total)
    return {"alone": alone, "refusal": refusal, "already": already,
            "fresh": fresh, "backend": dist.get_backend(), "total": total.item()}


@pytest.mark.spawn
def test_single_rank_world_groups_and_init_from_env() -> None:
    [result] = run_on_ranks(_single_rank_world, 1)
    assert result["alone"] == {kind: ((0,), None) for kind in ("tp", "dp", "pp", "mp", "embedding")}
    assert "has 1 ranks but the grid" in result["refusal"] and "needs 2" in result["refusal"]
    assert result["already"] == result["fresh"] == (0, 1, 0)
    assert result["backend"] == "gloo" and result["total"] == 5.0


def test_nccl_splits_the_world_once_per_kind(monkeypatch) -> None:
    """With a device-bound NCCL world (as every launch path binds it) each kind's groups
    come from one ``split_group`` call on every rank, with all of the kind's groups (and
    the ranks in none, alone), in the plan's order; new_group is not called. Here the world is torch's fake one (one
    rank of 16 in this process) and split_group a recorder; the predicate is checked apart."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gridtrain.parallel import grid as grid_module

    grid = ProcessGrid.build(16, tp=2, pp=4)
    splits = []

    def split_group(split_ranks, timeout=None, group_desc=None):
        splits.append((group_desc, split_ranks))
        return f"{group_desc} group"  # what this rank would get: its group of the kind

    monkeypatch.setattr(dist, "split_group", split_group)
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: pytest.fail("new_group called on the split path"))
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
    try:
        assert not grid_module.splits_communicators()  # the fake backend cannot split
        monkeypatch.setattr(grid_module, "splits_communicators", lambda backend=None: True)
        groups = create_process_groups(grid, 5)
    finally:
        dist.destroy_process_group()
    middle = [(r,) for r in range(4, 12)]  # stages 1 and 2 split off alone for the embedding kind
    assert [(kind, [tuple(g) for g in ranks]) for kind, ranks in splits] == [
        (kind.name, list(kind.groups) + (middle if kind.name == "embedding" else []))
        for kind in grid_module.group_plan(grid)]
    assert {kind: groups.group(kind) for kind in groups.members} == {k: f"{k} group" for k in ("tp", "dp", "pp", "mp")}
    assert "embedding" not in groups.members  # rank 5 is on stage 1 of 4


def test_init_from_env_without_launcher_env_names_missing_variables(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LaunchError, match=r"\['RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\] are not set"):
        init_from_env()


def test_unpicklable_fn_and_bad_nproc_fail_before_spawning() -> None:
    with pytest.raises(LaunchError, match="module-level function"):
        run_workers(lambda rank, world_size: rank, 1)
    with pytest.raises(LaunchError, match="nproc=0"):
        run_workers(_rank_1_hangs, 0)
    assert multiprocessing.active_children() == []


def _rank_1_raises(rank: int, world_size: int) -> None:
    """Rank 1 raises while rank 0 waits for it in a collective that will never complete."""
    if rank == 1:
        raise ValueError("boom from the test on rank 1")
    dist.barrier()


@pytest.mark.spawn
def test_raising_rank_gives_worker_error_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_workers(_rank_1_raises, 2, timeout_s=60, collective_timeout_s=60)
    message = str(info.value)
    assert info.value.rank == 1
    assert "rank 1" in message
    assert "ValueError: boom from the test on rank 1" in message
    assert "_rank_1_raises" in message  # the full traceback, not only the last line
    assert time.monotonic() - start < 30  # rank 0 was not left to hit its collective timeout
    assert multiprocessing.active_children() == []  # no orphans


def _rank_1_is_killed(rank: int, world_size: int) -> None:
    """Rank 1 dies without a word (as under the OOM killer); rank 0 waits in a barrier."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@pytest.mark.spawn
def test_rank_killed_without_report_is_named_with_its_exit_code() -> None:
    with pytest.raises(WorkerError) as info:
        run_on_ranks(_rank_1_is_killed, 2, timeout_s=60)
    assert info.value.rank == 1
    assert info.value.exitcode == -signal.SIGKILL
    assert "rank 1 died without reporting" in str(info.value)
    assert "SIGKILL" in str(info.value)
    assert multiprocessing.active_children() == []


def _rank_1_hangs(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


@pytest.mark.spawn
def test_hanging_rank_gives_worker_timeout_naming_it() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerTimeout) as info:
        run_on_ranks(_rank_1_hangs, 2, timeout_s=6)
    assert info.value.ranks == [1]
    assert "ranks [1] had not finished" in str(info.value)
    assert time.monotonic() - start < 20
    assert multiprocessing.active_children() == []


# ---- warm workers (gridtrain/runtime/warm.py) ---------------------------------------------------

def _what_the_worker_sees(rank: int, world_size: int, name: str) -> dict:
    print(f"rank {rank} writes to stdout", flush=True)
    print(f"rank {rank} writes to stderr", file=sys.stderr, flush=True)
    from gridtrain.data.corpora import builtin_bytes

    return {"value": os.environ.get(name), "parent": os.getppid(), "cwd": os.getcwd(),
            "rank_env": os.environ["RANK"], "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "corpus_read": builtin_bytes.cache_info().currsize}


@pytest.mark.spawn
def test_warm_workers_take_the_launchers_environment_cwd_and_output_of_now(monkeypatch, capfd, tmp_path) -> None:
    """The warm server forked them from its state of when it started; what differs per run
    (environment, working directory, standard output and error) comes from the launcher
    as it is at the run, and SIGTERM (ignored by the server) is theirs again. The server
    made the call this session asked it to (tests/conftest.py): the built-in corpus was
    read before the fork."""
    run_on_ranks(_returns_rank, 1)  # the server runs (started here or by an earlier test)
    server = warm.ensure_server(multiprocessing.get_context("forkserver"))
    monkeypatch.setenv("GRIDTRAIN_TEST_VALUE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    results = run_on_ranks(_what_the_worker_sees, 2, "GRIDTRAIN_TEST_VALUE")
    assert [r["value"] for r in results] == ["set after the server started"] * 2
    assert [r["rank_env"] for r in results] == ["0", "1"]
    assert all(r["parent"] == server != os.getpid() for r in results)  # forked by the warm server
    assert all(r["cwd"] == str(tmp_path) and r["sigterm"] for r in results)
    assert [r["corpus_read"] for r in results] == [1, 1]
    out, err = capfd.readouterr()
    assert "rank 0 writes to stdout" in out and "rank 1 writes to stdout" in out
    assert "rank 1 writes to stderr" in err


def _returns_rank(rank: int, world_size: int) -> int:
    return rank


@pytest.mark.spawn
def test_cold_spawned_workers_still_work_on_request(monkeypatch) -> None:
    monkeypatch.setenv(warm.START_METHOD_ENV, "spawn")
    results = run_on_ranks(_what_the_worker_sees, 2, warm.START_METHOD_ENV)
    assert [r["parent"] for r in results] == [os.getpid()] * 2  # spawned by this process
    assert [r["value"] for r in results] == ["spawn"] * 2


def test_an_unknown_start_method_is_one_line_before_any_process(monkeypatch, capsys) -> None:
    """Refused where run_workers starts, before its store or any process (the conftest
    fixture fails this test if a process starts); on the command line, one line, exit 2."""
    from gridtrain.cli.parser import main

    monkeypatch.setenv(warm.START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match=r"GRIDTRAIN_START_METHOD='fork' is not available here; use one of"):
        warm.start_method()
    assert main(["train", "--model", "tiny", "--nproc", "2", "--steps", "1", "--global-batch-size", "4",
                 "--micro-batch-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gridtrain: error: GRIDTRAIN_START_METHOD='fork'"), err


@pytest.mark.spawn
def test_the_launcher_tells_a_stopped_worker_from_a_running_one():
    """A stopped process cannot act on SIGTERM (it would sit out the 3 s grace): the
    launcher tells it from a running one by its state in /proc."""
    import subprocess

    from gridtrain.runtime import launch
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not launch._is_stopped(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not launch._is_stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert launch._is_stopped(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not launch._is_stopped(proc.pid)  # gone: not stopped
