"""The process grid: which rank holds which (dp, pp, tp, cp) coordinate, and its groups.

The first half of this module is pure rank arithmetic. It never touches
``torch.distributed``, so every layout can be checked in a unit test without
starting a process, and a bad layout is rejected with one clear line before any
collective is started.

The second half turns the arithmetic into live ``torch.distributed`` groups:
:func:`group_plan` (still pure) says which kinds of group a run uses and which of them
need communicators of their own (none for a group of one rank; one set for kinds with
the same groups), and :func:`create_process_groups` makes them, one call per kind, in
the plan's order on every rank.

Layout (Megatron's order): TP varies fastest, then CP (context parallel: ranks that
split a sequence), then DP, then PP::

    rank = pp_idx * (dp * cp * tp) + dp_idx * (cp * tp) + cp_idx * tp + tp_idx

TP neighbours are adjacent ranks (on GPUs: the same node, the fastest links,
which TP needs most), CP next (its ring passes keys and values every layer);
pipeline stages are the furthest apart (PP sends the least data). With cp = 1 the
layout is the three-axis one. Every cp rank holds whole layers, as a dp rank does, so
dense gradients are reduced over the dp x cp group (:meth:`ProcessGrid.dp_cp_group`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class GridError(ValueError):
    """A grid that cannot be built or used; the message names the problem and the fix."""


class GridCoord(NamedTuple):
    """Where a rank sits in the grid: its data, pipeline, tensor and context parallel indices."""

    dp: int
    pp: int
    tp: int
    cp: int = 0


def _check_positive(name: str, value: Any) -> None:
    """Reject sizes that are not positive integers (bool is an int but never a size)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise GridError(f"{name}={value!r} is not an integer; pass a whole number >= 1")
    if value < 1:
        raise GridError(f"{name}={value} must be >= 1; pass a whole number >= 1")


@dataclass(frozen=True)
class ProcessGrid:
    """A ``dp x pp x cp x tp`` grid of ``world_size`` ranks; construct with :meth:`build`.

    The grid is a value: pass it explicitly to whatever needs rank arithmetic
    instead of keeping a module-level "current grid".
    """

    world_size: int
    tp: int
    pp: int
    dp: int
    cp: int = 1

    def __post_init__(self) -> None:
        """Validate here too, so a grid made without ``build`` cannot be inconsistent."""
        for name in ("world_size", "tp", "pp", "dp", "cp"):
            _check_positive(name, getattr(self, name))
        if self.tp * self.pp * self.dp * self.cp != self.world_size:
            cp = f" x cp={self.cp}" if self.cp > 1 else ""
            raise GridError(
                f"dp={self.dp} x pp={self.pp}{cp} x tp={self.tp} = "
                f"{self.dp * self.pp * self.cp * self.tp} does not equal world size "
                f"{self.world_size}; choose sizes whose product is the world size"
            )

    @classmethod
    def build(
        cls, world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1
    ) -> ProcessGrid:
        """Build a grid, inferring ``dp = world_size / (tp * cp * pp)`` when dp is None.

        Inferring dp is what users expect from Megatron and torchrun: they pick
        the model-parallel sizes and let the world size set the replica count.
        """
        _check_positive("world_size", world_size)
        _check_positive("tp", tp)
        _check_positive("pp", pp)
        _check_positive("cp", cp)
        if dp is None:
            if world_size % (tp * cp * pp) != 0:
                with_cp = f" x cp={cp}" if cp > 1 else ""
                raise GridError(
                    f"world size {world_size} is not divisible by tp={tp}{with_cp} x pp={pp}; "
                    "choose sizes whose product divides the world size"
                )
            dp = world_size // (tp * cp * pp)
        _check_positive("dp", dp)
        return cls(world_size=world_size, tp=tp, pp=pp, dp=dp, cp=cp)

    # ---- coordinates -------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise GridError(
                f"rank {rank!r} is not an integer; pass a rank in [0, {self.world_size})"
            )
        if not 0 <= rank < self.world_size:
            raise GridError(
                f"rank {rank} is outside the grid of {self.world_size} ranks; "
                f"pass a rank in [0, {self.world_size})"
            )

    def coords(self, rank: int) -> GridCoord:
        """The (dp, pp, tp, cp) coordinate of ``rank``."""
        self._check_rank(rank)
        pp_idx, rest = divmod(rank, self.dp * self.cp * self.tp)
        dp_idx, rest = divmod(rest, self.cp * self.tp)
        cp_idx, tp_idx = divmod(rest, self.tp)
        return GridCoord(dp=dp_idx, pp=pp_idx, tp=tp_idx, cp=cp_idx)

    def rank_of(self, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        """The rank at coordinate (dp, pp, tp, cp); the inverse of :meth:`coords`."""
        for name, idx, size in (("dp", dp, self.dp), ("pp", pp, self.pp), ("tp", tp, self.tp),
                                ("cp", cp, self.cp)):
            if not 0 <= idx < size:
                raise GridError(
                    f"{name} index {idx} is outside [0, {size}); pass an index below {name}={size}"
                )
        return pp * (self.dp * self.cp * self.tp) + dp * (self.cp * self.tp) + cp * self.tp + tp

    def dp_rank(self, rank: int) -> int:
        """Index of ``rank`` within its data-parallel group (which replica it is)."""
        return self.coords(rank).dp

    def pp_rank(self, rank: int) -> int:
        """Index of ``rank`` within its pipeline (which stage it runs)."""
        return self.coords(rank).pp

    def tp_rank(self, rank: int) -> int:
        """Index of ``rank`` within its tensor-parallel group (which shard it holds)."""
        return self.coords(rank).tp

    def cp_rank(self, rank: int) -> int:
        """Index of ``rank`` within its context-parallel group (which sequence chunks it holds)."""
        return self.coords(rank).cp

    # ---- groups of one rank ------------------------------------------------

    def tp_group(self, rank: int) -> list[int]:
        """Ranks that split the same layers: same dp, pp and cp, every tp index."""
        c = self.coords(rank)
        return [self.rank_of(c.dp, c.pp, t, c.cp) for t in range(self.tp)]

    def cp_group(self, rank: int) -> list[int]:
        """Ranks that split the same sequences: same dp, pp and tp, every cp index (the ring)."""
        c = self.coords(rank)
        return [self.rank_of(c.dp, c.pp, c.tp, k) for k in range(self.cp)]

    def dp_group(self, rank: int) -> list[int]:
        """Ranks that hold replicas of the same shard and the same tokens' positions: same
        pp, tp and cp, every dp index."""
        c = self.coords(rank)
        return [self.rank_of(d, c.pp, c.tp, c.cp) for d in range(self.dp)]

    def dp_cp_group(self, rank: int) -> list[int]:
        """Ranks whose gradients of the same shard are summed: same pp and tp, every dp and
        cp index (each cp rank holds the whole layer but only part of the tokens)."""
        c = self.coords(rank)
        return sorted(self.rank_of(d, c.pp, c.tp, k) for d in range(self.dp) for k in range(self.cp))

    def pp_group(self, rank: int) -> list[int]:
        """The stages of rank's pipeline, first stage first: same dp, tp and cp, every pp index."""
        c = self.coords(rank)
        return [self.rank_of(c.dp, p, c.tp, c.cp) for p in range(self.pp)]

    def model_parallel_group(self, rank: int) -> list[int]:
        """All ranks that together hold one whole model replica (same dp and cp index).

        Gradient-norm clipping and loss reporting reduce over this group.
        """
        c = self.coords(rank)
        return sorted(self.rank_of(c.dp, p, t, c.cp) for p in range(self.pp) for t in range(self.tp))

    def embedding_group(self, rank: int) -> list[int]:
        """First and last stage of rank's pipeline (just the one stage when pp == 1).

        With tied input/output embeddings, these two stages each hold a copy of
        the embedding and all-reduce its gradient over this group.
        """
        stages = self.pp_group(rank)
        return sorted({stages[0], stages[-1]})

    # ---- all groups of one kind, in a fixed order --------------------------

    def all_tp_groups(self) -> list[list[int]]:
        """Every TP group, ordered by (pp, dp, cp); the same order on every rank."""
        first_ranks = [self.rank_of(d, p, 0, k) for p in range(self.pp) for d in range(self.dp)
                       for k in range(self.cp)]
        return [self.tp_group(r) for r in first_ranks]

    def all_cp_groups(self) -> list[list[int]]:
        """Every CP group, ordered by (pp, dp, tp)."""
        first_ranks = [self.rank_of(d, p, t, 0) for p in range(self.pp) for d in range(self.dp)
                       for t in range(self.tp)]
        return [self.cp_group(r) for r in first_ranks]

    def all_dp_groups(self) -> list[list[int]]:
        """Every DP group, ordered by (pp, cp, tp)."""
        first_ranks = [self.rank_of(0, p, t, k) for p in range(self.pp) for k in range(self.cp)
                       for t in range(self.tp)]
        return [self.dp_group(r) for r in first_ranks]

    def all_dp_cp_groups(self) -> list[list[int]]:
        """Every DP x CP group, ordered by (pp, tp)."""
        return [self.dp_cp_group(self.rank_of(0, p, t, 0)) for p in range(self.pp) for t in range(self.tp)]

    def all_zero_shard_groups(self, size: int) -> list[list[int]]:
        """Hybrid sharding's groups: each dp x cp group cut into runs of ``size``
        consecutive members (in a run of tp-strided ranks, a node's when tp x size fits
        one), ordered by (pp, tp, run)."""
        return self._runs(size)

    def all_zero_replica_groups(self, size: int) -> list[list[int]]:
        """Hybrid sharding's replica groups: the members of a dp x cp group holding the
        same shard (the same place in their runs of ``size``), ordered by (pp, tp, place)."""
        return self._strided(size)

    def folds_experts(self, ep: int, etp: int = 1) -> bool:
        """Whether the expert grid (``etp x ep`` ranks per copy of the experts) is laid
        over all tp x cp x dp ranks of a stage (MoE parallel folding, as Megatron-core's)
        rather than over the dp x cp ranks of each tp index: where dp x cp cannot hold it
        (``ep x etp`` does not divide dp x cp). Folded, a rank's experts differ from its
        tp neighbours'; unfolded, the tp ranks of a dp x cp position hold the same ones."""
        return ep * etp > 1 and (self.dp * self.cp) % (ep * etp) != 0

    def _expert_bases(self, ep: int, etp: int) -> list[list[int]]:
        """The rank lists an expert grid tiles: each stage's ranks when folded, else each
        dp x cp group (one per (pp, tp))."""
        return self._stages() if self.folds_experts(ep, etp) else self.all_dp_cp_groups()

    def all_etp_groups(self, ep: int, etp: int) -> list[list[int]]:
        """Expert-tensor-parallel groups: runs of ``etp`` consecutive members of each base
        (:meth:`_expert_bases`), which split each of their experts' MLPs between them."""
        return [g[i:i + etp] for g in self._expert_bases(ep, etp) for i in range(0, len(g), etp)]

    def all_ep_groups(self, ep: int, etp: int = 1) -> list[list[int]]:
        """Expert-parallel groups, each holding every expert once between them (each
        expert split over its etp group): within each run of ``ep x etp`` consecutive
        members of a base, the members at the same place of their etp runs. Unfolded with
        etp 1: runs of ``ep`` consecutive dp x cp members (same tp and pp), ordered by (pp,
        tp, run); folded: runs of ``ep`` consecutive ranks of each stage (tp fastest)."""
        n = ep * etp
        return [g[b + j:b + n:etp] for g in self._expert_bases(ep, etp) for b in range(0, len(g), n)
                for j in range(etp)]

    def all_expert_dp_groups(self, ep: int, etp: int = 1) -> list[list[int]]:
        """Expert-data-parallel groups: the members of a base at the same place of their
        runs of ``ep x etp`` (they hold the same expert slices), over which expert
        gradients are reduced; ordered by (pp, tp, place) unfolded."""
        n = ep * etp
        return [g[i::n] for g in self._expert_bases(ep, etp) for i in range(n)]

    def _stages(self) -> list[list[int]]:
        """The ranks of each pipeline stage, in rank order (tp fastest, then cp, then dp)."""
        n = self.tp * self.cp * self.dp
        return [list(range(p * n, (p + 1) * n)) for p in range(self.pp)]

    def _runs(self, size: int) -> list[list[int]]:
        """Each dp x cp group cut into runs of ``size`` consecutive members."""
        return [g[i:i + size] for g in self.all_dp_cp_groups() for i in range(0, len(g), size)]

    def _strided(self, size: int) -> list[list[int]]:
        """The members of each dp x cp group at the same place in their runs of ``size``."""
        return [g[i::size] for g in self.all_dp_cp_groups() for i in range(size)]

    def all_pp_groups(self) -> list[list[int]]:
        """Every pipeline, ordered by (dp, cp, tp), i.e. by its first-stage rank."""
        first_ranks = [self.rank_of(d, 0, t, k) for d in range(self.dp) for k in range(self.cp)
                       for t in range(self.tp)]
        return [self.pp_group(r) for r in first_ranks]

    def all_model_parallel_groups(self) -> list[list[int]]:
        """Every model-parallel group, ordered by (dp, cp)."""
        return [self.model_parallel_group(self.rank_of(d, 0, 0, k)) for d in range(self.dp)
                for k in range(self.cp)]

    def all_embedding_groups(self) -> list[list[int]]:
        """Every embedding group, one per pipeline, in :meth:`all_pp_groups` order."""
        return [self.embedding_group(stages[0]) for stages in self.all_pp_groups()]

    # ---- pipeline neighbours and sources -----------------------------------

    def is_first_stage(self, rank: int) -> bool:
        """True on the stage that embeds tokens."""
        return self.coords(rank).pp == 0

    def is_last_stage(self, rank: int) -> bool:
        """True on the stage that computes the loss."""
        return self.coords(rank).pp == self.pp - 1

    def next_pp_rank(self, rank: int) -> int:
        """The rank of the next stage, wrapping from the last stage to the first.

        Wrapping (as in Megatron) keeps the function total; interleaved
        schedules do send from the last stage's chunk to the first stage's next chunk.
        """
        c = self.coords(rank)
        return self.rank_of(c.dp, (c.pp + 1) % self.pp, c.tp, c.cp)

    def prev_pp_rank(self, rank: int) -> int:
        """The rank of the previous stage, wrapping from the first stage to the last."""
        c = self.coords(rank)
        return self.rank_of(c.dp, (c.pp - 1) % self.pp, c.tp, c.cp)

    def tp_src_rank(self, rank: int) -> int:
        """First rank of rank's TP group: it reads the batch and broadcasts it to the group."""
        return self.tp_group(rank)[0]

    def describe(self) -> str:
        """A short human summary, e.g. ``"16 ranks = dp 2 x pp 4 x tp 2"`` (``x cp C`` when
        the sequence is split)."""
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        return f"{self.world_size} ranks = dp {self.dp} x pp {self.pp}{cp} x tp {self.tp}"


# ---- which groups a run makes (pure) --------------------------------------


@dataclass(frozen=True)
class GroupKind:
    """One kind of group (tp, dp, ...): all of its groups, and which communicators serve it.

    ``made_as`` is the kind whose torch groups this kind uses: the kind itself; an earlier
    kind with exactly the same groups (mp is tp when pp is 1, the embedding group is the
    pipeline when pp is 2, dp x cp is cp when dp is 1), whose groups are shared; or None
    when every group of the kind is one rank, for which no torch group is made at all.
    Groups of one kind are translates of each other on the grid, so two kinds share
    either all their groups or none, and comparing whole kinds finds every shared group.
    """

    name: str
    groups: tuple[tuple[int, ...], ...]
    made_as: str | None

    def group_of(self, rank: int) -> tuple[int, ...] | None:
        """The group of this kind that holds ``rank`` (None: a middle pipeline stage has no
        embedding group)."""
        return next((g for g in self.groups if rank in g), None)


def _group_kinds(grid: ProcessGrid, zero_shard_size: int | None = None,
                 ep: int = 1, etp: int = 1) -> list[tuple[str, list[list[int]]]]:
    """Every kind of group with all of its rank lists, in the one order all ranks use.
    The cp and dp x cp groups exist only when cp > 1 (with cp 1 the dp group is the
    dp x cp group); the hybrid-sharding groups only when ``zero_shard_size`` cuts dp x cp;
    the expert groups only when ``ep`` > 1 (with ep 1 experts are reduced over dp x cp,
    as dense weights)."""
    kinds = [
        ("tp", grid.all_tp_groups()),
        ("dp", grid.all_dp_groups()),
        ("pp", grid.all_pp_groups()),
        ("mp", grid.all_model_parallel_groups()),
        ("embedding", grid.all_embedding_groups()),
    ]
    if grid.cp > 1:
        kinds += [("cp", grid.all_cp_groups()), ("dp_cp", grid.all_dp_cp_groups())]
    if zero_shard_size is not None and zero_shard_size < grid.dp * grid.cp:
        kinds += [("zero_shard", grid.all_zero_shard_groups(zero_shard_size)),
                  ("zero_replica", grid.all_zero_replica_groups(zero_shard_size))]
    if ep * etp > 1:
        kinds += [("ep", grid.all_ep_groups(ep, etp)), ("expert_dp", grid.all_expert_dp_groups(ep, etp))]
    if etp > 1:
        kinds += [("etp", grid.all_etp_groups(ep, etp))]
    return kinds


def group_plan(grid: ProcessGrid, zero_shard_size: int | None = None, ep: int = 1,
               etp: int = 1) -> list[GroupKind]:
    """Every kind of group the run uses, in the one order all ranks walk, each marked with
    the kind whose torch groups serve it (:class:`GroupKind`): one-rank groups are not
    made, and a kind with the same groups as an earlier one shares them."""
    plan: list[GroupKind] = []
    made: dict[frozenset, str] = {}  # the groups of each kind that is made -> its name
    for name, rank_lists in _group_kinds(grid, zero_shard_size, ep, etp):
        groups = tuple(tuple(sorted(g)) for g in rank_lists)
        if all(len(g) == 1 for g in groups):
            plan.append(GroupKind(name, groups, None))
            continue
        made_as = made.setdefault(frozenset(groups), name)
        plan.append(GroupKind(name, groups, made_as))
    return plan


# ---- live process groups ---------------------------------------------------


@dataclass
class ProcessGroups:
    """This rank's live ``torch.distributed`` groups and its coordinate.

    ``members`` holds this rank's group of every kind the run uses, one-rank groups
    included; ``live`` the torch group of each kind where the rank is not alone (kinds
    with the same groups share one object). :meth:`group` is None where the rank is alone
    in its group, and collectives there are identities
    (:meth:`gridtrain.parallel.comm.CommGroup.alone`)."""

    grid: ProcessGrid
    rank: int
    coord: GridCoord
    members: dict[str, tuple[int, ...]]
    live: dict[str, ProcessGroup]

    def group(self, kind: str) -> ProcessGroup | None:
        """The torch group of this rank's ``kind`` group; None where the rank is alone in it
        or the run has no such kind (a middle stage's embedding group, cp when cp is 1)."""
        return self.live.get(kind)


def _check_world(grid: ProcessGrid, rank: int) -> None:
    """Fail with one clear line unless the default group matches the grid and rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise GridError(
            "torch.distributed is not initialized; call init_process_group "
            "(or gridtrain.runtime.launch.init_from_env) before create_process_groups"
        )
    world = dist.get_world_size()
    if world != grid.world_size:
        raise GridError(
            f"the process group has {world} ranks but the grid "
            f"({grid.describe()}) needs {grid.world_size}; launch "
            f"{grid.world_size} processes or change dp/pp/tp"
        )
    if dist.get_rank() != rank:
        raise GridError(
            f"create_process_groups was given rank {rank} but this process is rank "
            f"{dist.get_rank()}; pass torch.distributed.get_rank()"
        )


def splits_communicators(backend: str | None = None) -> bool:
    """Whether a kind's groups are made by splitting the world's communicator
    (``torch.distributed.split_group``, one collective call per kind on every rank): NCCL
    with the default group bound to a device (``init_process_group(device_id=...)``, as
    every launch path here does), asked for the world's own backend. ``split_group``
    supports no other backend (gloo, the dry run's fake one); there each rank creates its
    own groups (``new_group`` with ``use_local_synchronization``).

    Not ``new_group`` on every rank for every group: on a bound NCCL group each such call
    is an ``ncclCommSplit`` over the whole world, non-members included (thousands at
    1,024 ranks). Nor ``new_group(use_local_synchronization=True)`` there: its members
    would split the world's communicator without the others, and wait for them forever.
    """
    import torch.distributed as dist

    world = dist.group.WORLD
    device = getattr(world, "bound_device_id", None)
    if device is None or backend not in (None, dist.get_backend()) or not hasattr(dist, "split_group"):
        return False
    try:
        return bool(world._get_backend(device).supports_splitting)  # what split_group itself asks
    except RuntimeError:  # no backend for the device
        return False


def _make(kind: GroupKind, rank: int, world_size: int, split: bool, timeout: timedelta | None,
          backend: str | None) -> ProcessGroup:
    """This rank's group of ``kind``, made with one call on every rank: a split of the world,
    or ``new_group`` of the rank's own group.

    A rank in no group of the kind (a middle stage: the embedding kind) gets a group of its
    own, never used. torch names a group from its ranks and the number of groups the
    process already has (``_hash_ranks_to_str``), and members of a group must agree on its
    name (gloo's members meet under it in the store: a mismatch hangs the next layout made
    in the same world), so every rank must make the same number of groups, in order."""
    import torch.distributed as dist

    if split:
        covered = {r for g in kind.groups for r in g}
        split_ranks = [list(g) for g in kind.groups] + [[r] for r in range(world_size) if r not in covered]
        return dist.split_group(split_ranks=split_ranks, timeout=timeout, group_desc=kind.name)
    mine = kind.group_of(rank) or (rank,)
    return dist.new_group(ranks=list(mine), timeout=timeout, backend=backend, use_local_synchronization=True,
                          group_desc=kind.name)


def create_process_groups(
    grid: ProcessGrid,
    rank: int,
    backend: str | None = None,
    timeout: timedelta | None = None,
    zero_shard_size: int | None = None,
    ep: int = 1,
    etp: int = 1,
) -> ProcessGroups:
    """Make this rank's groups of every kind of :func:`group_plan` and return them.

    One call per kind whose groups are made, on every rank, in the plan's order, so that
    ranks agree which call makes which group (:func:`splits_communicators`: a split of the
    world, or ``new_group`` of the rank's own group only, :func:`_make`). No group of one
    rank is made (the rank is alone: its collectives are identities), and a kind with the
    same groups as an earlier one shares them, so a rank makes one communicator per
    distinct group of more than one rank it is in (and a middle pipeline stage one of its
    own for the embedding kind), instead of every group of every kind.

    ``timeout`` is every group's backend timeout. ``None`` means torch's default for
    the backend (10 minutes for NCCL and gloo, much longer than most users' --timeout),
    so callers should pass one: setup_distributed gives the backstop of watchdog.py,
    ``--timeout`` plus a margin, so that the watchdog's hang report comes first.
    """
    _check_world(grid, rank)
    plan = group_plan(grid, zero_shard_size, ep, etp)
    split = splits_communicators(backend)
    made = {k.name: _make(k, rank, grid.world_size, split, timeout, backend) for k in plan if k.made_as == k.name}
    members = {k.name: mine for k in plan if (mine := k.group_of(rank)) is not None}
    live = {k.name: made[k.made_as] for k in plan if k.made_as is not None and k.name in members}
    return ProcessGroups(grid=grid, rank=rank, coord=grid.coords(rank), members=members, live=live)
