"""Pure tests of the process grid's rank arithmetic: no processes, no torch.distributed."""

from __future__ import annotations

import itertools

import pytest

from gridtrain.parallel.grid import GridCoord, GridError, ProcessGrid

# The worked example of DESIGN.md: 16 ranks, tp=2, dp=2, pp=4.
TP_GROUPS_16 = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
DP_GROUPS_16 = [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
PP_GROUPS_16 = [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
MP_GROUPS_16 = [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
EMBEDDING_GROUPS_16 = [[0, 12], [1, 13], [2, 14], [3, 15]]

LAYOUTS = [  # (world_size, tp, pp, dp)
    (1, 1, 1, 1),
    (2, 2, 1, 1),
    (2, 1, 2, 1),
    (2, 1, 1, 2),
    (8, 2, 2, 2),
    (12, 3, 2, 2),
    (16, 2, 4, 2),
    (24, 4, 3, 2),
    (30, 5, 3, 2),
]

KINDS = ("tp_group", "dp_group", "pp_group", "model_parallel_group", "embedding_group")
ALL_KINDS = {
    "tp_group": "all_tp_groups",
    "dp_group": "all_dp_groups",
    "pp_group": "all_pp_groups",
    "model_parallel_group": "all_model_parallel_groups",
    "embedding_group": "all_embedding_groups",
}


@pytest.fixture
def grid16() -> ProcessGrid:
    return ProcessGrid.build(16, tp=2, pp=4)


def test_design_example_all_groups(grid16: ProcessGrid) -> None:
    assert (grid16.dp, grid16.pp, grid16.tp) == (2, 4, 2)
    assert grid16.all_tp_groups() == TP_GROUPS_16
    assert grid16.all_dp_groups() == DP_GROUPS_16
    assert grid16.all_pp_groups() == PP_GROUPS_16
    assert grid16.all_model_parallel_groups() == MP_GROUPS_16
    assert grid16.all_embedding_groups() == EMBEDDING_GROUPS_16


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("tp_group", TP_GROUPS_16),
        ("dp_group", DP_GROUPS_16),
        ("pp_group", PP_GROUPS_16),
        ("model_parallel_group", MP_GROUPS_16),
    ],
)
def test_design_example_group_of_each_rank(grid16: ProcessGrid, kind: str, expected: list[list[int]]) -> None:
    for rank in range(16):
        (group,) = [g for g in expected if rank in g]
        assert getattr(grid16, kind)(rank) == group


def test_design_example_embedding_group_of_every_stage(grid16: ProcessGrid) -> None:
    """Middle stages are not members, but still know their pipeline's embedding group."""
    for rank in range(16):
        (pipeline,) = [g for g in PP_GROUPS_16 if rank in g]
        assert grid16.embedding_group(rank) == [pipeline[0], pipeline[-1]]
    assert grid16.embedding_group(5) == [1, 13]


def test_design_example_stages_and_neighbours(grid16: ProcessGrid) -> None:
    assert [r for r in range(16) if grid16.is_first_stage(r)] == [0, 1, 2, 3]
    assert [r for r in range(16) if grid16.is_last_stage(r)] == [12, 13, 14, 15]
    assert [grid16.next_pp_rank(r) for r in (1, 5, 9, 13)] == [5, 9, 13, 1]
    assert [grid16.prev_pp_rank(r) for r in (1, 5, 9, 13)] == [13, 1, 5, 9]
    assert [grid16.tp_src_rank(r) for r in range(16)] == [r - r % 2 for r in range(16)]
    assert grid16.coords(13) == GridCoord(dp=0, pp=3, tp=1)
    assert grid16.coords(6) == GridCoord(dp=1, pp=1, tp=0)
    assert (grid16.dp_rank(6), grid16.pp_rank(6), grid16.tp_rank(6)) == (1, 1, 0)
    assert grid16.describe() == "16 ranks = dp 2 x pp 4 x tp 2"


@pytest.mark.parametrize("world_size, tp, pp, dp", LAYOUTS)
def test_coords_round_trip(world_size: int, tp: int, pp: int, dp: int) -> None:
    grid = ProcessGrid.build(world_size, tp=tp, pp=pp)
    assert grid.dp == dp
    seen = set()
    for rank in range(world_size):
        c = grid.coords(rank)
        assert 0 <= c.dp < dp and 0 <= c.pp < pp and 0 <= c.tp < tp
        assert grid.rank_of(*c) == rank
        assert rank == c.pp * dp * tp + c.dp * tp + c.tp
        seen.add(c)
    assert seen == {
        GridCoord(d, p, t) for d, p, t in itertools.product(range(dp), range(pp), range(tp))
    }


@pytest.mark.parametrize("world_size, tp, pp, dp", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_rank_in_exactly_one_group_of_each_kind(
    world_size: int, tp: int, pp: int, dp: int, kind: str
) -> None:
    grid = ProcessGrid.build(world_size, tp=tp, pp=pp, dp=dp)
    groups = getattr(grid, ALL_KINDS[kind])()
    for group in groups:
        assert group == sorted(group)
    if kind != "embedding_group":  # embedding groups skip middle stages
        assert sorted(r for g in groups for r in g) == list(range(world_size))
    for rank in range(world_size):
        containing = [g for g in groups if rank in g]
        member = getattr(grid, kind)(rank)
        assert containing == ([member] if rank in member else [])


@pytest.mark.parametrize("world_size, tp, pp, dp", LAYOUTS)
def test_group_sizes_and_shared_coordinates(world_size: int, tp: int, pp: int, dp: int) -> None:
    grid = ProcessGrid.build(world_size, tp=tp, pp=pp, dp=dp)
    for rank in range(world_size):
        c = grid.coords(rank)
        assert len(grid.tp_group(rank)) == tp
        assert len(grid.dp_group(rank)) == dp
        assert len(grid.pp_group(rank)) == pp
        assert len(grid.model_parallel_group(rank)) == tp * pp
        assert len(grid.embedding_group(rank)) == min(pp, 2)
        assert {grid.coords(r)[:2] for r in grid.tp_group(rank)} == {(c.dp, c.pp)}
        assert {(grid.coords(r).pp, grid.coords(r).tp) for r in grid.dp_group(rank)} == {(c.pp, c.tp)}
        assert {grid.coords(r).dp for r in grid.model_parallel_group(rank)} == {c.dp}
        assert grid.prev_pp_rank(grid.next_pp_rank(rank)) == rank
        assert grid.tp_src_rank(rank) == grid.rank_of(c.dp, c.pp, 0)


def test_single_stage_pipeline() -> None:
    grid = ProcessGrid.build(4, tp=2)
    assert grid.dp == 2 and grid.pp == 1
    assert grid.all_embedding_groups() == [[0], [1], [2], [3]]
    for rank in range(4):
        assert grid.is_first_stage(rank) and grid.is_last_stage(rank)
        assert grid.next_pp_rank(rank) == rank == grid.prev_pp_rank(rank)


def test_explicit_consistent_dp_is_accepted() -> None:
    assert ProcessGrid.build(8, tp=2, pp=2, dp=2) == ProcessGrid(world_size=8, tp=2, pp=2, dp=2)


def test_world_not_divisible_by_tp_pp() -> None:
    with pytest.raises(GridError) as info:
        ProcessGrid.build(4, tp=3)
    message = str(info.value)
    assert "world size 4" in message and "tp=3" in message and "divisible" in message
    assert "\n" not in message


@pytest.mark.parametrize("name", ["world_size", "tp", "pp", "dp"])
@pytest.mark.parametrize("bad", [0, -2])
def test_non_positive_sizes(name: str, bad: int) -> None:
    sizes = {"world_size": 4, "tp": 1, "pp": 1, "dp": 4}
    sizes[name] = bad
    with pytest.raises(GridError) as info:
        ProcessGrid.build(**sizes)
    assert f"{name}={bad}" in str(info.value) and ">= 1" in str(info.value)


def test_non_integer_size() -> None:
    with pytest.raises(GridError, match=r"tp=2\.0 is not an integer"):
        ProcessGrid.build(4, tp=2.0)  # type: ignore[arg-type]


def test_inconsistent_dp() -> None:
    with pytest.raises(GridError) as info:
        ProcessGrid.build(8, tp=2, pp=2, dp=3)
    message = str(info.value)
    assert "dp=3" in message and "world size 8" in message and "12" in message


def test_direct_construction_is_validated() -> None:
    with pytest.raises(GridError, match="does not equal world size 8"):
        ProcessGrid(world_size=8, tp=2, pp=2, dp=1)


def test_grid_error_is_a_value_error() -> None:
    assert issubclass(GridError, ValueError)


@pytest.mark.parametrize("rank", [-1, 8])
def test_rank_out_of_range(rank: int) -> None:
    grid = ProcessGrid.build(8, tp=2, pp=2)
    with pytest.raises(GridError, match=f"rank {rank} is outside the grid of 8 ranks"):
        grid.coords(rank)


def test_coordinate_out_of_range() -> None:
    grid = ProcessGrid.build(8, tp=2, pp=2)
    with pytest.raises(GridError, match=r"pp index 2 is outside \[0, 2\)"):
        grid.rank_of(dp=0, pp=2, tp=0)


# ---- the context-parallel dimension (rank arithmetic) ----------------------------------------------

def test_cp_sits_between_tp_and_dp_as_in_megatron():
    grid = ProcessGrid.build(16, tp=2, pp=2, cp=2)
    assert grid.dp == 2 and grid.describe() == "16 ranks = dp 2 x pp 2 x cp 2 x tp 2"
    assert [tuple(grid.coords(r)) for r in (1, 2, 4, 8)] == [(0, 0, 1, 0), (0, 0, 0, 1), (1, 0, 0, 0),
                                                             (0, 1, 0, 0)]  # (dp, pp, tp, cp)
    assert grid.cp_group(5) == [5, 7]  # the ring: tp apart
    assert grid.dp_cp_group(5) == [1, 3, 5, 7]  # where dense gradients are summed
    assert grid.tp_group(5) == [4, 5] and grid.dp_group(5) == [1, 5] and grid.pp_group(5) == [5, 13]
    assert grid.model_parallel_group(5) == [4, 5, 12, 13]  # one replica of the model for cp rank 1


@pytest.mark.parametrize("tp,cp,dp,pp", [(1, 2, 1, 1), (2, 2, 1, 2), (1, 4, 2, 1), (2, 3, 2, 2)])
def test_every_group_kind_tiles_the_world_once_with_cp(tp, cp, dp, pp):
    world = tp * cp * dp * pp
    grid = ProcessGrid.build(world, tp=tp, pp=pp, cp=cp)
    assert grid.dp == dp
    assert sorted(grid.coords(r) for r in range(world)) == sorted(
        GridCoord(d, p, t, k) for d, p, t, k in itertools.product(range(dp), range(pp), range(tp), range(cp)))
    for r in range(world):
        assert grid.rank_of(*grid.coords(r)) == r
    for groups, size in ((grid.all_tp_groups(), tp), (grid.all_cp_groups(), cp), (grid.all_dp_groups(), dp),
                         (grid.all_dp_cp_groups(), dp * cp), (grid.all_pp_groups(), pp),
                         (grid.all_model_parallel_groups(), tp * pp)):
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world))
    for r in range(world):
        assert set(grid.dp_cp_group(r)) == {x for k in grid.cp_group(r) for x in grid.dp_group(k)}


def test_a_grid_without_cp_is_unchanged():
    grid = ProcessGrid.build(8, tp=2, pp=2)
    assert grid.cp == 1 and grid.all_dp_cp_groups() == grid.all_dp_groups()
    assert grid.all_cp_groups() == [[r] for r in range(8)]
    assert grid.describe() == "8 ranks = dp 2 x pp 2 x tp 2"


def test_cp_sizes_are_checked_in_one_line():
    with pytest.raises(GridError, match=r"^world size 12 is not divisible by tp=2 x cp=4 x pp=1;"):
        ProcessGrid.build(12, tp=2, cp=4)
    with pytest.raises(GridError, match="cp=0 must be >= 1"):
        ProcessGrid.build(8, cp=0)
    with pytest.raises(GridError, match="cp index 2 is outside"):
        ProcessGrid.build(4, cp=2).rank_of(0, 0, 0, 2)


def test_the_cp_groups_are_made_only_when_cp_splits():
    """Every rank walks the same list of groups: with cp 1 exactly the groups a
    three-axis run makes; with cp > 1 the cp rings and the dp x cp groups after them."""
    from gridtrain.parallel.grid import _group_kinds

    assert [kind for kind, _ in _group_kinds(ProcessGrid.build(8, tp=2, pp=2))] == ["tp", "dp", "pp", "mp",
                                                                                      "embedding"]
    kinds = dict(_group_kinds(ProcessGrid.build(8, tp=2, cp=2, pp=2)))
    assert kinds["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert kinds["dp_cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


PLANS = [  # (layout, options, the kind whose torch groups serve each kind: None = every group is one rank)
    (dict(world_size=16, tp=2, pp=4), {}, dict(tp="tp", dp="dp", pp="pp", mp="mp", embedding="embedding")),
    (dict(world_size=16, tp=2, pp=2), {}, dict(tp="tp", dp="dp", pp="pp", mp="mp", embedding="pp")),
    (dict(world_size=8, tp=2), {}, dict(tp="tp", dp="dp", pp=None, mp="tp", embedding=None)),
    (dict(world_size=8, pp=2, cp=2), {},
     dict(tp=None, dp="dp", pp="pp", mp="pp", embedding="pp", cp="cp", dp_cp="dp_cp")),
    (dict(world_size=8, tp=2, cp=4), {}, dict(tp="tp", dp=None, pp=None, mp="tp", embedding=None, cp="cp",
                                               dp_cp="cp")),
    (dict(world_size=16, tp=2, cp=2, dp=4), dict(zero_shard_size=1, ep=8),
     dict(tp="tp", dp="dp", pp=None, mp="tp", embedding=None, cp="cp", dp_cp="dp_cp", zero_shard=None,
          zero_replica="dp_cp", ep="dp_cp", expert_dp=None)),
    (dict(world_size=16, tp=2, cp=2, dp=4), dict(zero_shard_size=4, ep=4),
     dict(tp="tp", dp="dp", pp=None, mp="tp", embedding=None, cp="cp", dp_cp="dp_cp", zero_shard="zero_shard",
          zero_replica="zero_replica", ep="zero_shard", expert_dp="zero_replica")),
]


@pytest.mark.parametrize("layout, options, made_as", PLANS)
def test_the_plan_makes_no_group_of_one_rank_and_shares_equal_kinds(layout, options, made_as):
    """No torch group for a group of one rank (pp and the embedding when pp is 1, ...);
    a kind with the same groups as an earlier one shares its groups (mp is tp when pp is
    1, the embedding group is the pipeline when pp is 2, dp x cp is cp when dp is 1)."""
    from gridtrain.parallel.grid import _group_kinds, group_plan

    grid = ProcessGrid.build(**layout)
    plan = group_plan(grid, **options)
    assert {k.name: k.made_as for k in plan} == made_as
    assert [k.name for k in plan] == [name for name, _ in _group_kinds(grid, **options)]  # the same order
    kinds = {k.name: k for k in plan}
    for kind in plan:
        if kind.made_as is None:
            assert all(len(g) == 1 for g in kind.groups)
        else:
            assert set(kinds[kind.made_as].groups) == set(kind.groups)
            assert kinds[kind.made_as].made_as == kind.made_as  # shares a kind that is made itself
    assert all(kinds["tp"].group_of(r) == tuple(grid.tp_group(r)) for r in range(grid.world_size))


def test_a_middle_stage_has_no_embedding_group():
    from gridtrain.parallel.grid import group_plan

    embedding = {k.name: k for k in group_plan(ProcessGrid.build(16, tp=2, pp=4))}["embedding"]
    assert embedding.group_of(0) == (0, 12) and embedding.group_of(13) == (1, 13)
    assert embedding.group_of(4) is None and embedding.group_of(9) is None  # stages 1 and 2


def test_hybrid_sharding_groups_cut_dp_x_cp_into_consecutive_runs():
    """16 ranks, tp 2 x cp 2 x dp 4, ZeRO sharded over 4: each dp x cp group (8 ranks,
    tp-strided) cut into two runs of 4 consecutive members, and the replica groups pair
    the members at the same place in the two runs."""
    g = ProcessGrid.build(16, tp=2, pp=1, dp=4, cp=2)
    assert g.all_dp_cp_groups() == [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]]
    assert g.all_zero_shard_groups(4) == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert g.all_zero_replica_groups(4) == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]


def test_expert_groups_of_the_design_example():
    """16 ranks, tp 2 x cp 2 x dp 2 x pp 2, ep 2: each (pp, tp) position's dp x cp group
    (4 ranks, tp-strided) splits into expert-parallel runs of 2 consecutive members (the
    two cp ranks of one dp index here) and expert-data-parallel groups of the members at
    the same place (which hold the same experts)."""
    g = ProcessGrid.build(16, tp=2, pp=2, dp=2, cp=2)
    assert g.all_dp_cp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g.all_ep_groups(2) == [[0, 2], [4, 6], [1, 3], [5, 7], [8, 10], [12, 14], [9, 11], [13, 15]]
    assert g.all_expert_dp_groups(2) == [[0, 4], [2, 6], [1, 5], [3, 7], [8, 12], [10, 14], [9, 13], [11, 15]]
    assert g.all_ep_groups(4) == g.all_dp_cp_groups()  # ep = dp x cp: every rank holds distinct experts
    assert g.all_expert_dp_groups(4) == [[r] for grp in g.all_dp_cp_groups() for r in grp]


def test_folded_expert_groups_of_the_design_example():
    """ep 8 on the 16-rank example: dp x cp (4) cannot hold 8 expert ranks, so the expert
    grid folds over tp too: each stage's 8 ranks are one expert-parallel group and every
    rank holds distinct experts (no expert-data-parallel replicas). ep 4 divides dp x cp
    there and stays unfolded; other grids fold where ep does not divide dp x cp."""
    g = ProcessGrid.build(16, tp=2, pp=2, dp=2, cp=2)
    assert not g.folds_experts(4) and g.folds_experts(8)
    assert g.all_ep_groups(8) == [list(range(8)), list(range(8, 16))]
    assert g.all_expert_dp_groups(8) == [[r] for r in range(16)]
    g = ProcessGrid.build(8, tp=2, pp=1, dp=4)
    assert g.folds_experts(8) and not g.folds_experts(4)
    g = ProcessGrid.build(4, tp=2, dp=2)  # the parity test's layout: ep 4 folded over dp 2 x tp 2
    assert g.all_ep_groups(4) == [[0, 1, 2, 3]]
    g = ProcessGrid.build(12, tp=2, dp=3, pp=2)  # ep 3 divides dp: unfolded; ep 6 and ep 2 fold
    assert g.all_ep_groups(6) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert g.all_ep_groups(3) == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert g.all_ep_groups(2) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    g = ProcessGrid.build(8, tp=4, dp=2)  # ep 4 of 8 stage ranks: two runs, replicas at the same place
    assert g.all_ep_groups(4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g.all_expert_dp_groups(4) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_expert_tensor_parallel_groups():
    """etp 2 x ep 2 on dp 4 (tp 1): each expert split over a pair of consecutive ranks,
    the pairs' same places forming the ep groups; on tp 2 x dp 2 with etp 2 x ep 2 the
    grid folds over the stage (tp fastest); etp x ep x expert-dp tiles every base."""
    g = ProcessGrid.build(4, dp=4)
    assert not g.folds_experts(2, 2)
    assert g.all_etp_groups(2, 2) == [[0, 1], [2, 3]]
    assert g.all_ep_groups(2, 2) == [[0, 2], [1, 3]]
    assert g.all_expert_dp_groups(2, 2) == [[0], [1], [2], [3]]
    g = ProcessGrid.build(8, dp=8)
    assert g.all_etp_groups(2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.all_ep_groups(2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.all_expert_dp_groups(2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    g = ProcessGrid.build(8, tp=2, dp=2, pp=2)
    assert g.folds_experts(2, 2) and g.all_etp_groups(2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.all_ep_groups(2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    for ep, etp in ((2, 2), (4, 1), (1, 4), (1, 2)):
        g = ProcessGrid.build(16, tp=2, pp=2, dp=2, cp=2)
        for rank in range(16):
            (e,) = [x for x in g.all_ep_groups(ep, etp) if rank in x]
            (t,) = [x for x in g.all_etp_groups(ep, etp) if rank in x]
            (d,) = [x for x in g.all_expert_dp_groups(ep, etp) if rank in x]
            assert len(e) == ep and len(t) == etp and len(e) * len(t) * len(d) == (8 if g.folds_experts(ep, etp)
                                                                                  else 4)
            assert set(e) & set(t) == set(e) & set(d) == set(t) & set(d) == {rank}


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_groups_tile_each_dp_cp_group(ep):
    """Every rank is in exactly one ep group and one expert-dp group, both inside its dp x
    cp group, and the two meet in exactly that rank."""
    g = ProcessGrid.build(16, tp=2, pp=2, dp=2, cp=2)
    eps, edps = g.all_ep_groups(ep), g.all_expert_dp_groups(ep)
    for rank in range(16):
        (mine,) = [e for e in eps if rank in e]
        (replicas,) = [e for e in edps if rank in e]
        assert len(mine) == ep and len(replicas) == 4 // ep
        assert set(mine) | set(replicas) <= set(g.dp_cp_group(rank))
        assert set(mine) & set(replicas) == {rank}
