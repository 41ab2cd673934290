"""Check a schedule before any process runs it: the action lists are data, so every
property the runtime relies on can be proved on the lists themselves.

:func:`validate_schedule` checks, in this order (the first problem found is raised as
one line naming the stage, the action index and the problem):

1. contents: each stage holds, for each of its (micro-batch, chunk) units, exactly one
   F and one B (and one W when the schedule splits its backward), exactly the sends and
   receives its position in the pipeline needs, one ALLREDUCE_GRADS and one
   OPTIMIZER_STEP, and nothing else;
2. order on each stage: receive before compute before send, F before B before W, the
   gradient reduction after the last gradient action, the optimizer step last;
3. matching: on every pair of ranks (sender, receiver), the sequence of sends equals the
   sequence of receives, activations and gradients together, in the same order: NCCL
   pairs the point-to-point messages between two ranks by the order in which they are
   posted, ignoring tags, and an activation and a gradient have the same shape, so a
   swap would go unnoticed; no rank sends to itself;
4. progress: under the runtime's semantics (a run of consecutive SEND/RECV actions is
   posted as one batch and waited for as a whole) every stage reaches its end;

and measures the peak number of activations each stage holds (memory).

Pure Python on purpose: no torch, no processes, so the test suite can check thousands
of (schedule, p, m, v) combinations in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from gridtrain.parallel.pipeline.schedules import (
    ALLREDUCE_GRADS,
    COMM,
    OPTIMIZER_STEP,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    W,
    stage_and_chunk,
    virtual_stage,
)

PER_UNIT = (F, B, W, SEND_F, RECV_F, SEND_B, RECV_B)  # kinds that name a (mb, chunk)
SENDS = {SEND_F: F, SEND_B: B}  # send kind -> direction
RECVS = {RECV_F: F, RECV_B: B}
DIRECTION_NOUN = {F: "activation", B: "gradient"}

Key = tuple[str, int, int]  # (kind, mb, chunk)
Op = tuple[int, int]  # (stage, action index)


class InvalidSchedule(ValueError):
    """A schedule the runtime must not run; the message is one line naming the stage,
    the action index and the problem."""


@dataclass(frozen=True)
class ScheduleReport:
    """What a valid schedule costs, read off its action lists.

    ``peak_in_flight[s]``: the most (micro-batch, chunk) units stage s holds between
    their F and their B (their activations are alive). ``peak_until_w[s]``: the same up
    to their W, for split-backward schedules (W needs the layer inputs too); else None.
    ``num_batches[s]``: how many communication batches stage s posts and waits for.
    ``num_messages``: point-to-point transfers in one step, all stages together.
    """

    num_stages: int
    num_microbatches: int
    chunks: int
    split_backward: bool
    peak_in_flight: list[int]
    peak_until_w: list[int] | None
    num_batches: list[int]
    num_messages: int


def validate_schedule(schedule: list[list[Action]], num_microbatches: int, chunks: int = 1) -> ScheduleReport:
    """Raise :class:`InvalidSchedule` unless ``schedule`` is complete, ordered, matched
    and deadlock-free for ``num_microbatches`` micro-batches on ``chunks`` chunks per
    stage; return its :class:`ScheduleReport`."""
    p, m, v = len(schedule), num_microbatches, chunks
    if p < 1 or m < 1 or v < 1:
        raise InvalidSchedule(f"a schedule needs >= 1 stage, micro-batch and chunk (got {p}, {m}, {v})")
    split = any(getattr(a, "kind", None) == W for stage in schedule for a in stage)
    positions = [_check_contents(actions, s, p, m, v, split) for s, actions in enumerate(schedule)]
    for s, actions in enumerate(schedule):
        _check_order(actions, positions[s], s)
    peer = _match_messages(schedule)
    num_batches = _check_progress(schedule, peer)
    return ScheduleReport(
        num_stages=p,
        num_microbatches=m,
        chunks=v,
        split_backward=split,
        peak_in_flight=[peak_held(actions, until=B) for actions in schedule],
        peak_until_w=[peak_held(actions, until=W) for actions in schedule] if split else None,
        num_batches=num_batches,
        num_messages=len(peer) // 2,
    )


# ---- 1. contents ------------------------------------------------------------------------

def _needed_kinds(s: int, chunk: int, p: int, v: int, split: bool) -> tuple[str, ...]:
    """The actions a stage owes one (mb, chunk) unit: the first virtual stage receives
    no activation and sends no gradient; the last sends no activation and receives no
    gradient (its backward starts from the loss)."""
    virtual = virtual_stage(s, chunk, p)
    first, last = virtual == 0, virtual == p * v - 1
    kinds = [F, B] + ([W] if split else [])
    kinds += [] if first else [RECV_F, SEND_B]
    kinds += [] if last else [SEND_F, RECV_B]
    return tuple(kinds)


def _check_contents(actions: list[Action], s: int, p: int, m: int, v: int, split: bool) -> dict[Key, int]:
    """Every action known, in range, owed and not repeated; nothing owed missing.
    Returns each action's index on the stage, for the order check."""
    where: dict[Key, int] = {}
    for i, a in enumerate(actions):
        key = _key_of(a, i, s, m, v)
        if a.kind in PER_UNIT and a.kind not in _needed_kinds(s, a.chunk, p, v, split):
            raise InvalidSchedule(f"stage {s}, action {i} ({a}): {_why_not_owed(a, s, p, v)}")
        if key in where:
            raise InvalidSchedule(f"stage {s}, action {i} ({a}): appears twice (first at action {where[key]})")
        where[key] = i
    for mb in range(m):
        for chunk in range(v):
            for kind in _needed_kinds(s, chunk, p, v, split):
                if (kind, mb, chunk) not in where:
                    raise InvalidSchedule(f"stage {s}: {Action(kind, mb, chunk)} is missing"
                                          f"{_missing_context(kind, mb, chunk, where)}")
    for kind in (ALLREDUCE_GRADS, OPTIMIZER_STEP):
        if (kind, -1, 0) not in where:
            raise InvalidSchedule(f"stage {s}: {kind} is missing")
    return where


def _key_of(a: object, i: int, s: int, m: int, v: int) -> Key:
    """The identity of an action on its stage; rejects what no stage may hold."""
    kind = getattr(a, "kind", None)
    if kind in (ALLREDUCE_GRADS, OPTIMIZER_STEP):
        return (kind, -1, 0)
    if kind not in PER_UNIT:
        raise InvalidSchedule(f"stage {s}, action {i} ({a!r}): unknown action kind {kind!r}")
    assert isinstance(a, Action)
    if not 0 <= a.mb < m:
        raise InvalidSchedule(f"stage {s}, action {i} ({a}): micro-batch {a.mb} is outside 0..{m - 1}")
    if not 0 <= a.chunk < v:
        raise InvalidSchedule(f"stage {s}, action {i} ({a}): chunk {a.chunk} is outside 0..{v - 1}")
    return (a.kind, a.mb, a.chunk)


def _why_not_owed(a: Action, s: int, p: int, v: int) -> str:
    """Only transfers can be unowed (any W makes the schedule split): the first virtual
    stage has no RECV_F/SEND_B, the last no SEND_F/RECV_B."""
    virtual = virtual_stage(s, a.chunk, p)
    place = "first" if virtual == 0 else "last"
    return f"virtual stage {virtual} is the {place} one and has no {a.kind}"


def _missing_context(kind: str, mb: int, chunk: int, where: dict[Key, int]) -> str:
    """For a missing transfer, point at the compute action that needed it."""
    compute = {RECV_F: F, SEND_F: F, RECV_B: B, SEND_B: B}.get(kind)
    if compute and (compute, mb, chunk) in where:
        return f" ({Action(compute, mb, chunk)} is at action {where[(compute, mb, chunk)]})"
    return ""


# ---- 2. order on a stage ------------------------------------------------------------------

# kind -> the kinds of the same unit that must come before it (when the stage owes them)
PREREQUISITES: dict[str, tuple[str, ...]] = {
    F: (RECV_F,),
    SEND_F: (F,),
    RECV_B: (),
    B: (F, RECV_B),
    SEND_B: (B,),
    W: (B,),
    RECV_F: (),
}


def _check_order(actions: list[Action], where: dict[Key, int], s: int) -> None:
    """Data flows forward in the list: an action comes after every action whose result
    it consumes. The gradient reduction waits for every gradient; the step comes last."""
    last_gradient = max(i for (kind, _, _), i in where.items() if kind in (B, W))
    for i, a in enumerate(actions):
        if a.kind in PREREQUISITES:
            for before in PREREQUISITES[a.kind]:
                j = where.get((before, a.mb, a.chunk))
                if j is not None and j > i:
                    raise InvalidSchedule(f"stage {s}, action {i} ({a}): comes before "
                                          f"{Action(before, a.mb, a.chunk)} (action {j})")
        elif a.kind == ALLREDUCE_GRADS and i < last_gradient:
            raise InvalidSchedule(f"stage {s}, action {i} ({a}): comes before the stage's last "
                                  f"gradient action {actions[last_gradient]} (action {last_gradient})")
        elif a.kind == OPTIMIZER_STEP and i != len(actions) - 1:
            raise InvalidSchedule(f"stage {s}, action {i} ({a}): is not the stage's last action")


# ---- 3. matching ------------------------------------------------------------------------

def _route(a: Action, s: int, p: int) -> tuple[int, int, Action]:
    """(sender, receiver, the action as the receiver names it) for a send or a receive
    on stage s. Activations go to virtual stage + 1, gradients to - 1."""
    direction = SENDS.get(a.kind) or RECVS[a.kind]
    step = 1 if direction == F else -1
    here = virtual_stage(s, a.chunk, p)
    if a.kind in SENDS:
        other, chunk = stage_and_chunk(here + step, p)
        return s, other, Action(RECV_F if direction == F else RECV_B, a.mb, chunk)
    other, _ = stage_and_chunk(here - step, p)
    return other, s, a


def _match_messages(schedule: list[list[Action]]) -> dict[Op, Op]:
    """Pair the k-th send from one rank to another with the k-th receive of that rank
    from the first, whatever their direction, and require both to name the same
    (direction, micro-batch, chunk). Returns each transfer action's counterpart."""
    p = len(schedule)
    sends: dict[tuple[int, int], list[tuple[int, Action]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, Action]]] = {}
    for s, actions in enumerate(schedule):
        for i, a in enumerate(actions):
            if a.kind in COMM:
                src, dst, as_received = _route(a, s, p)
                if src == dst:
                    raise InvalidSchedule(f"stage {s}, action {i} ({a}): a rank cannot send to itself; "
                                          "interleaving needs --pp > 1")
                side = sends if a.kind in SENDS else recvs
                side.setdefault((src, dst), []).append((i, as_received))
    peer: dict[Op, Op] = {}
    for link in sorted(set(sends) | set(recvs)):
        _match_link(link, sends.get(link, []), recvs.get(link, []), schedule, peer)
    return peer


def _match_link(link: tuple[int, int], sent: list[tuple[int, Action]], received: list[tuple[int, Action]],
                schedule: list[list[Action]], peer: dict[Op, Op]) -> None:
    src, dst = link
    for k, ((i, expected), (j, got)) in enumerate(zip(sent, received)):
        if expected != got:
            raise InvalidSchedule(
                f"stage {src}, action {i} ({schedule[src][i]}): the {_ordinal(k)} message sent to stage {dst} "
                f"meets that stage's {_ordinal(k)} receive from stage {src}, action {j} ({got}), "
                f"which expects {expected}: sends and receives are in different orders")
        peer[(src, i)], peer[(dst, j)] = (dst, j), (src, i)
    if len(sent) != len(received):
        kinds = {DIRECTION_NOUN[SENDS[schedule[src][i].kind]] for i, _ in sent}
        noun = " and ".join(sorted(kinds)) if kinds else "message"
        raise InvalidSchedule(f"stage {src} sends {len(sent)} messages ({noun}s) to stage {dst}, "
                              f"which receives {len(received)}")


def _ordinal(k: int) -> str:
    n = k + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


# ---- 4. progress (no deadlock) ------------------------------------------------------------

def _steps(actions: list[Action]) -> list[list[int]]:
    """Split a stage's list into what it waits for one at a time: a compute or reduction
    action alone, or a maximal run of consecutive transfers (one batch)."""
    steps: list[list[int]] = []
    for i, a in enumerate(actions):
        if a.kind in COMM and steps and actions[steps[-1][-1]].kind in COMM:
            steps[-1].append(i)
        else:
            steps.append([i])
    return steps


def _check_progress(schedule: list[list[Action]], peer: dict[Op, Op]) -> list[int]:
    """Run every stage to a fixpoint: a batch completes when each of its transfers is
    matched, i.e. its counterpart is posted in the peer's current batch or already done.
    Returns the number of transfer batches per stage."""
    steps = [_steps(actions) for actions in schedule]
    step_of = [{i: k for k, step in enumerate(stage) for i in step} for stage in steps]
    at = [0] * len(schedule)
    moved = True
    while moved:
        moved = False
        for s, stage in enumerate(steps):
            while at[s] < len(stage) and not _waiting_for(s, stage[at[s]], schedule, peer, step_of, at):
                at[s] += 1
                moved = True
    stuck = [_describe_stuck(s, steps[s][at[s]], schedule, peer, step_of, at)
             for s in range(len(schedule)) if at[s] < len(steps[s])]
    if stuck:
        raise InvalidSchedule("deadlock: " + "; ".join(stuck))
    return [sum(1 for step in stage if schedule[s][step[0]].kind in COMM) for s, stage in enumerate(steps)]


def _waiting_for(s: int, step: list[int], schedule: list[list[Action]], peer: dict[Op, Op],
                 step_of: list[dict[int, int]], at: list[int]) -> list[int]:
    """The transfers of the current step that are not matched yet (empty: it completes)."""
    waiting = []
    for i in step:
        if schedule[s][i].kind not in COMM:
            continue
        t, j = peer[(s, i)]
        if step_of[t][j] > at[t]:
            waiting.append(i)
    return waiting


def _describe_stuck(s: int, step: list[int], schedule: list[list[Action]], peer: dict[Op, Op],
                    step_of: list[dict[int, int]], at: list[int]) -> str:
    waits = []
    for i in _waiting_for(s, step, schedule, peer, step_of, at):
        t, j = peer[(s, i)]
        waits.append(f"{schedule[s][i]} (stage {t} posts {schedule[t][j]} only at action {j})")
    return f"stage {s} stuck at action {step[0]} waiting for " + ", ".join(waits)


# ---- memory -------------------------------------------------------------------------------

def peak_held(actions: list[Action], until: str = B) -> int:
    """The most (micro-batch, chunk) units of one stage's list whose F has run and whose
    ``until`` action (B: activations; W: the inputs the weight gradient needs) has not.
    Public so that the runtime and the tests can size memory without a full validation."""
    held: set[tuple[int, int]] = set()
    peak = 0
    for a in actions:
        if a.kind == F:
            held.add((a.mb, a.chunk))
            peak = max(peak, len(held))
        elif a.kind == until:
            held.discard((a.mb, a.chunk))
    return peak


def in_flight_bound(name: str, p: int, m: int, v: int, stage: int, *, until_w: bool = False) -> int | None:
    """The documented peak of units between F and B on ``stage`` (what the tests hold
    the schedules to); None for an unknown schedule. With ``until_w``, the peak between
    F and W, which only split-backward schedules have (else None).

    GPipe keeps every micro-batch. 1F1B and ZB-H1 keep at most p - stage (the warm-up
    forwards plus one). Interleaved 1F1B keeps its warm-up, 2(p-stage-1) + (v-1)p
    chunk-forwards, plus one, i.e. Megatron's bound; except when m == p, where Megatron
    (and our schedule) runs every forward first, so every stage keeps all m*v units.
    ZB-H1 lets stage s defer up to s weight gradients, so between F and W it keeps
    min(m, p) on every stage: the deferral costs memory exactly where 1F1B had slack.
    """
    if until_w:
        return min(m, p) if name == "zb-h1" else None
    if name == "gpipe":
        return m
    if name in ("1f1b", "zb-h1"):
        return min(m, p - stage)
    if name == "interleaved-1f1b":
        if m == p:
            return m * v
        return min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
    return None
