"""Muon: momentum orthogonalised by Newton-Schulz, for the hidden matrices.

Muon (Jordan et al., 2024; "Muon is Scalable for LLM Training", Liu et al., 2025) keeps one
momentum buffer per weight matrix and steps along an orthogonalised copy of it:

    B <- mu B + (1 - mu) G             (torch.optim.Muon's ``lerp`` form)
    U <- (1 - mu) G + mu B             (Nesterov; plain momentum: U <- B)
    O <- NewtonSchulz_k(U)             (k quintic iterations: O ~ U V^T of U's SVD)
    W <- W (1 - lr wd) - lr a(shape) O

``a`` is the per-shape adjustment (``original``: sqrt(max(1, rows / cols)); ``match-rms``:
0.2 sqrt(max(rows, cols)), so that the update's RMS is AdamW's and Muon can take AdamW's
learning rate and weight decay). What is Muon's and what is AdamW's is
:func:`uses_muon`: the 2-D weights of the transformer blocks (attention projections,
MLP and expert matrices, multi-token-prediction blocks) take Muon; embeddings, the head,
norms, biases and routers take AdamW.

**A matrix is the one-process matrix.** The elementwise steps (momentum, Nesterov,
decay, the final add) run on whatever part of a parameter a rank holds; Newton-Schulz
does not: it needs the whole matrix, as one process has it. :class:`MatrixExchange`
brings each matrix whole to one rank and its orthogonalised update back, in two stages
that undo the two ways a matrix is split:

1. **over the data-parallel group that shards it** (ZeRO 1-3, hybrid sharding, experts'
   expert-data-parallel group): every rank holds a slice of each gradient bucket; each
   matrix (a tensor-parallel shard here) has an owner in the group, chosen to balance
   the Newton-Schulz work (:func:`balanced_owners`), and one ``all_to_all`` per group
   brings every rank's slices of each matrix to its owner;
2. **over the tensor-parallel group that splits it** (``--tp``, or an expert's
   ``--etp`` group): on the rank that owns the shard, one ``all_to_all`` of the tp group
   brings the shards of each parameter to an owner among the tp ranks, which assembles
   the one-process tensor (tensor_parallel.unshard).

A fused tensor is cut into the separate matrices one process would hold before the
iterations: GPT-2's QKV into Q, K and V (its ``parts``); every other parameter is one
matrix. The update then travels back the same way (the transposed exchanges) and each
rank applies its own elements. Without sharding every data-parallel replica holds the
whole shard and orthogonalises it itself (the result is the same on every replica);
pipeline stages each do their own parameters.

**Rounds.** The matrices go in a few rounds (:func:`exchange_rounds`): the next round's
data-parallel gather is issued before this round's iterations and this round's scatter
right after them, so both travel behind the iterations of other matrices (NCCL's
stream, gloo's thread) and only a round's matrices are whole at once; each matrix is
computed as in a single exchange. The tensor-parallel stage waits.

The exchanged vectors travel in the Newton-Schulz dtype (:func:`ns_dtype_of`: bf16 on
GPUs, fp32 on CPUs, fp64 in fp64 runs, or ``--muon-ns-dtype``): the iterations begin by
casting to it, so a narrower payload loses nothing. Bytes per step are counted (:attr:`MatrixExchange.sent_bytes`)
and tested against their closed form.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from gridtrain.parallel.comm import CommGroup
from gridtrain.parallel.tensor_parallel import ShardSpec, shard, unshard

# the quintic's coefficients (Jordan et al., 2024; torch.optim.Muon's defaults)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
# parameters that stay with AdamW whatever their shape: the token table, the head, routers
ADAMW_ALWAYS = ("embedding", "head", "router")


def uses_muon(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the parameter ``name`` of ``shape`` (whole on this rank: ZeRO-3 empties it
    between uses) steps with Muon: a 2-D weight of a transformer block (or of a
    multi-token-prediction module), not a router; all else steps with AdamW."""
    parts = name.split(".")
    return len(shape) == 2 and not any(p in ADAMW_ALWAYS for p in parts) and (
        "blocks" in parts or parts[0] == "mtp")


def ns_dtype_of(setting: str, master_dtype: torch.dtype, device: torch.device | str = "cuda") -> torch.dtype:
    """The Newton-Schulz dtype: ``auto`` is fp64 for fp64 runs (their parity), bf16 on a
    GPU (torch.optim.Muon's), fp32 on a CPU (whose bf16 matrix products have no fast
    kernel on most machines: 130x slower than fp32 for a 512 x 2048 matrix on this
    project's CI host)."""
    if setting == "auto":
        if master_dtype == torch.float64:
            return torch.float64
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    return NS_DTYPES[setting]


def default_muon_lr(lr: float, adjust: str, d_model: int) -> float:
    """Muon's peak learning rate when ``--muon-lr`` is not given: ``lr`` under match-rms
    (its point: AdamW's rate), else the rate at which ``original`` gives a d x d matrix
    the update RMS that match-rms gives it at ``lr`` (0.2 sqrt(d) x lr)."""
    return lr if adjust == "match-rms" else 0.2 * math.sqrt(d_model) * lr


def lr_ratio(adjust: str, shape: tuple[int, int]) -> float:
    """The per-matrix factor on Muon's learning rate (torch's ``adjust_lr_fn``)."""
    rows, cols = shape
    if adjust == "match-rms":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


@torch.no_grad()
def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonalised ``g`` (2-D) after ``steps`` quintic iterations in ``dtype``:
    normalised by its Frobenius norm, iterated on the wide orientation (rows <= cols) with
    X <- a X + (b A + c A^2) X, A = X X^T; the same operations, in the same order, as
    torch.optim.Muon, so that bf16 runs match it bit for bit."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=NS_EPS))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def ns_flops(shape: tuple[int, int], steps: int) -> int:
    """Floating-point operations of :func:`newton_schulz` on a ``rows x cols`` matrix:
    per iteration X X^T (2 m^2 n), A A (2 m^3) and the product with X (2 m^2 n), m the
    shorter side."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


def matrix_shapes(whole_shape: tuple[int, ...], spec: ShardSpec | None) -> list[tuple[int, int]]:
    """The one-process matrices of a parameter of ``whole_shape``: its ``parts`` (fused QKV:
    three) along the split dimension, else the parameter itself."""
    parts = spec.parts if spec is not None else 1
    shape = list(whole_shape)
    shape[spec.dim if spec is not None else 0] //= parts
    return [tuple(shape)] * parts


def orthogonalise(whole: torch.Tensor, spec: ShardSpec | None, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz of each one-process matrix of ``whole`` (a parameter's update, its
    whole shape), put back in place, in ``dtype``."""
    if spec is None or spec.parts == 1:
        return newton_schulz(whole, steps, dtype)
    return torch.cat([newton_schulz(m, steps, dtype) for m in whole.chunk(spec.parts, dim=spec.dim)], dim=spec.dim)


def balanced_owners(costs: list[float], n: int) -> list[int]:
    """An owner in ``range(n)`` for each item: the largest first, each to the least loaded
    owner so far (ties: the lowest index). Pure arithmetic, so every rank computes the
    same assignment."""
    owners = [0] * len(costs)
    heap = [(0.0, r) for r in range(n)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    return owners


# ---- the exchange ------------------------------------------------------------------------------

@dataclass
class Matrix:
    """One Muon parameter of this rank: ``numel`` elements of its local (tensor-parallel)
    shard, its split ``spec`` over ``tp`` (None: whole on every tp rank), and its
    data-parallel sharding: the element ranges ``held[r]`` that member r of ``dp`` holds
    (one range per bucket it crosses; this rank's own in :attr:`mine`)."""

    param: nn.Parameter
    local_shape: tuple[int, ...]
    spec: ShardSpec | None
    tp: CommGroup
    dp: CommGroup
    held: list[list[tuple[int, int]]]
    dp_owner: int = 0
    tp_owner: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def whole_shape(self) -> tuple[int, ...]:
        """The one-process shape."""
        return self.spec.full_shape(self.local_shape, self.tp.size) if self.split_over_tp else self.local_shape

    @property
    def mine(self) -> list[tuple[int, int]]:
        return self.held[self.dp.rank]

    @property
    def split_over_tp(self) -> bool:
        return self.spec is not None and self.tp.size > 1

    def cost(self, steps: int) -> int:
        return sum(ns_flops(s, steps) for s in matrix_shapes(self.whole_shape, self.spec))


def _size(ranges: list[tuple[int, int]]) -> int:
    return sum(hi - lo for lo, hi in ranges)


@dataclass
class MatrixExchange:
    """Each Muon matrix whole on one rank and its update back (the module docstring).
    ``matrices`` are this rank's, in the same order on every rank of their groups."""

    matrices: list[Matrix]
    steps: int
    dtype: torch.dtype
    rounds: int = 4  # see exchange_rounds
    sent_bytes: dict[str, int] = field(default_factory=dict)  # this step's, by stage (to other ranks)

    def __post_init__(self) -> None:
        for group in _groups(self.matrices, "dp"):
            ms = [m for m in self.matrices if m.dp is group]
            for m, o in zip(ms, balanced_owners([m.cost(self.steps) for m in ms], group.size)):
                m.dp_owner = o
        # on each data-parallel owner, an owner among the tp ranks for the shards it assembles
        for group in _groups(self.matrices, "tp"):
            ms = [m for m in self.matrices if m.tp is group and m.split_over_tp and m.dp_owner == m.dp.rank]
            for m, o in zip(ms, balanced_owners([m.cost(self.steps) for m in ms], group.size)):
                m.tp_owner = o

    def orthogonalised(self, updates: dict[nn.Parameter, dict[tuple[int, int], torch.Tensor]]
                       ) -> dict[nn.Parameter, dict[tuple[int, int], torch.Tensor]]:
        """``updates``: per parameter, this rank's ranges (:attr:`Matrix.mine`) of its
        momentum update. Returns the orthogonalised update on the same ranges.

        In rounds (:func:`exchange_rounds`): the next round's data-parallel gather is
        issued before this round's iterations and its scatter after them, so both travel
        while other matrices iterate; every rank issues the same collectives in the same
        order, and each matrix is computed as in one exchange."""
        self.sent_bytes = {"dp": 0, "tp": 0}
        rounds = exchange_rounds(self.matrices, self.rounds)
        out: dict[nn.Parameter, dict[tuple[int, int], torch.Tensor]] = {}
        if not rounds:
            return out
        gathering, scattering = self._start_gather_dp(rounds[0], updates), []
        for k, ms in enumerate(rounds):
            shards = _finish(gathering)  # param -> its whole local shard, on its dp owner
            wholes = self._gather_tp(ms, shards)  # param -> the whole tensor, on its owner
            if k + 1 < len(rounds):
                gathering = self._start_gather_dp(rounds[k + 1], updates)
            done = {p: orthogonalise(w, m.spec, self.steps, self.dtype).reshape(-1)
                    for p, (m, w) in wholes.items()}
            scattering.append(self._start_scatter_dp(ms, self._scatter_tp(ms, done, shards)))
        for pending in scattering:
            out.update(_finish(pending))
        return out

    # data parallel: slices of a bucket <-> the whole shard on its owner

    def _start_gather_dp(self, matrices: list[Matrix], updates) -> list:
        """Issue the gathers of ``matrices``' slices to their owners; :func:`_finish` gives
        param -> its whole local shard (on its owner)."""
        started = []
        for group, ms in self._by_group(matrices, "dp"):
            me = group.rank
            if group.size == 1:
                shards = {m.param: _assemble(m.numel, [(m.mine, [updates[m.param][r] for r in m.mine])], self.dtype)
                          for m in ms}
                started.append(lambda shards=shards: shards)
                continue
            send = [_cat([updates[m.param][r].to(self.dtype) for m in ms if m.dp_owner == o for r in m.mine],
                         self.dtype, group) for o in range(group.size)]
            pending = self._start_exchange(group, send, [sum(_size(m.held[s]) for m in ms if m.dp_owner == me)
                                                         for s in range(group.size)], "dp")

            def assemble(pending=pending, ms=ms, group=group):
                got, out = pending.wait(), {}
                for m in (m for m in ms if m.dp_owner == group.rank):
                    pieces = []
                    for s in range(group.size):
                        n = _size(m.held[s])
                        pieces.append((m.held[s], _cut(got[s][:n], m.held[s])))
                        got[s] = got[s][n:]
                    out[m.param] = _assemble(m.numel, pieces, self.dtype)
                return out
            started.append(assemble)
        return started

    def _start_scatter_dp(self, matrices: list[Matrix], shards) -> list:
        """Issue the return of the owners' orthogonalised shards to the ranks holding each
        slice; :func:`_finish` gives param -> {range: update} for this rank's ranges."""
        started = []
        for group, ms in self._by_group(matrices, "dp"):
            me = group.rank
            if group.size == 1:
                ranges = {m.param: {r: shards[m.param][r[0]:r[1]] for r in m.mine} for m in ms}
                started.append(lambda ranges=ranges: ranges)
                continue
            send = [_cat([shards[m.param][lo:hi] for m in ms if m.dp_owner == me for lo, hi in m.held[s]],
                         self.dtype, group) for s in range(group.size)]
            pending = self._start_exchange(group, send, [sum(_size(m.mine) for m in ms if m.dp_owner == o)
                                                         for o in range(group.size)], "dp")

            def cut(pending=pending, ms=ms):
                got, out = pending.wait(), {}
                for m in ms:
                    o, ranges = m.dp_owner, {}
                    for lo, hi in m.mine:
                        ranges[(lo, hi)], got[o] = got[o][:hi - lo], got[o][hi - lo:]
                    out[m.param] = ranges
                return out
            started.append(cut)
        return started

    # tensor parallel: each rank's shard <-> the whole tensor on its owner

    def _gather_tp(self, matrices: list[Matrix], shards):
        wholes = {}
        for m in matrices:  # whole on this rank already
            if m.param in shards and not m.split_over_tp:
                wholes[m.param] = (m, shards[m.param].view(m.whole_shape))
        for group, ms in self._by_group(matrices, "tp", lambda m: m.split_over_tp and m.param in shards):
            me = group.rank
            send = [_cat([shards[m.param] for m in ms if m.tp_owner == o], self.dtype, group)
                    for o in range(group.size)]
            mine = [m for m in ms if m.tp_owner == me]
            got = self._exchange(group, send, [sum(m.numel for m in mine)] * group.size, "tp")
            for m in mine:
                parts = []
                for s in range(group.size):
                    parts.append(got[s][:m.numel].view(m.local_shape))
                    got[s] = got[s][m.numel:]
                wholes[m.param] = (m, unshard(parts, m.spec))
        return wholes

    def _scatter_tp(self, matrices: list[Matrix], done, shards):
        split = {m.param for m in matrices if m.split_over_tp}
        out = {p: whole for p, whole in done.items() if p not in split}  # orthogonalised here, whole
        for group, ms in self._by_group(matrices, "tp", lambda m: m.split_over_tp and m.param in shards):
            me = group.rank
            send = [_cat([shard(done[m.param].view(m.whole_shape), m.spec, t, group.size).reshape(-1)
                          for m in ms if m.tp_owner == me], self.dtype, group) for t in range(group.size)]
            got = self._exchange(group, send, [sum(m.numel for m in ms if m.tp_owner == o)
                                               for o in range(group.size)], "tp")
            for m in ms:
                o = m.tp_owner
                out[m.param], got[o] = got[o][:m.numel], got[o][m.numel:]
        return out

    @staticmethod
    def _by_group(matrices: list[Matrix], which: str, keep=lambda m: True):
        """(group, its matrices that ``keep`` admits) for each distinct group of ``which``
        (``dp`` or ``tp``) among ``matrices``, in order; groups left with none skipped."""
        for group in _groups(matrices, which):
            ms = [m for m in matrices if getattr(m, which) is group and keep(m)]
            if ms:
                yield group, ms

    def _start_exchange(self, group: CommGroup, send: list[torch.Tensor], recv: list[int], stage: str):
        """One ``all_to_all`` of flat vectors, issued: ``send[r]`` to member r; waiting
        gives what each member sent here (``recv[r]`` elements from member r)."""
        self.sent_bytes[stage] += sum(t.numel() for r, t in enumerate(send) if r != group.rank) * \
            torch.empty((), dtype=self.dtype).element_size()
        flat = torch.cat(send)
        return group.start_all_to_all(flat, [t.numel() for t in send], recv).then(lambda got: list(got.split(recv)))

    def _exchange(self, group: CommGroup, send: list[torch.Tensor], recv: list[int], stage: str) -> list[torch.Tensor]:
        """:meth:`_start_exchange`, waited for."""
        return self._start_exchange(group, send, recv, stage).wait()


def exchange_rounds(matrices: list[Matrix], rounds: int) -> list[list[Matrix]]:
    """``matrices`` (in their order, the same on every rank) cut into at most ``rounds``
    consecutive runs of about equal count: a round's gathers travel while the round
    before it iterates, so more rounds hide more of the exchange behind the iterations
    and hold fewer matrices whole at once, for more, smaller collectives."""
    n = min(rounds, len(matrices))
    return [matrices[k * len(matrices) // n:(k + 1) * len(matrices) // n] for k in range(n)] if n else []


def _finish(started: list) -> dict:
    """What :meth:`MatrixExchange._start_gather_dp` or ``_start_scatter_dp`` issued,
    waited for: one dict over every group."""
    out = {}
    for finish in started:
        out.update(finish())
    return out


def _groups(matrices: list[Matrix], which: str) -> list[CommGroup]:
    """The distinct groups of ``which`` (``dp`` or ``tp``) among ``matrices``, in order."""
    seen: list[CommGroup] = []
    for m in matrices:
        g = getattr(m, which)
        if all(g is not s for s in seen):
            seen.append(g)
    return seen


def _cat(tensors: list[torch.Tensor], dtype: torch.dtype, group: CommGroup) -> torch.Tensor:
    """``tensors`` end to end (an empty vector on the group's device when there are none)."""
    return torch.cat(tensors) if tensors else torch.empty(0, dtype=dtype, device=group.device)


def _cut(flat: torch.Tensor, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    out, at = [], 0
    for lo, hi in ranges:
        out.append(flat[at:at + hi - lo])
        at += hi - lo
    return out


def _assemble(numel: int, pieces, dtype: torch.dtype) -> torch.Tensor:
    """A flat vector of ``numel`` from ``(ranges, tensors)`` pairs that cover it."""
    first = next(t for _, ts in pieces for t in ts) if any(ts for _, ts in pieces) else None
    out = torch.empty(numel, dtype=dtype, device=first.device if first is not None else None)
    for ranges, tensors in pieces:
        for (lo, hi), t in zip(ranges, tensors):
            out[lo:hi] = t
    return out
