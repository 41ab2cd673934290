"""Timelines from schedules: when each action of each stage would run, given its cost.

The simulator reads the same action lists the runtime executes. A compute action starts
when its stage is free and its input exists: a forward needs the previous virtual
stage's forward of the same micro-batch (plus the transfer latency), a backward needs
the next virtual stage's backward (or, on the last virtual stage, its own forward), a
weight-gradient step needs its own backward. Communication actions take no stage time;
their cost is the latency on the dependency.

With ``rendezvous=True`` the communication actions are simulated as the runtime runs
them (pipeline/runtime.py): a run of consecutive SEND/RECV actions is one batch, posted
when the stage reaches it; a message leaves when both its sender and its receiver have
posted theirs (a send completes only against a posted receive, on NCCL and on gloo) and
takes the receiving chunk's ``latency``. The stage waits until every message of a batch
with a receive has arrived; a batch of sends only it leaves in flight and waits for at
its next batch (or the end of the schedule). So a stage blocked on a receive, or on a
send still in flight at its next batch, is idle, as it is in the runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gridtrain.parallel.pipeline.schedules import B, COMM, COMPUTE, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, \
    stage_and_chunk, virtual_stage


@dataclass(frozen=True)
class Costs:
    """Time of one micro-batch through one chunk. ``b`` is the input-gradient part of the
    backward and ``w`` the weight-gradient part; a schedule without W actions runs both
    in its B."""

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    latency: float = 0.0


@dataclass
class Interval:
    stage: int
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    intervals: list[Interval] = field(default_factory=list)
    num_stages: int = 0

    @property
    def makespan(self) -> float:
        return max(i.end for i in self.intervals) - min(i.start for i in self.intervals)

    def busy(self, stage: int) -> float:
        return sum(i.end - i.start for i in self.intervals if i.stage == stage)

    def idle_fraction(self) -> float:
        """Idle stage-time over all stage-time, from the first action to the last."""
        total = self.num_stages * self.makespan
        return 1.0 - sum(self.busy(s) for s in range(self.num_stages)) / total


class DeadlockError(RuntimeError):
    """The compute orders wait on each other in a cycle."""


def simulate(schedule: list[list[Action]], costs: Costs | Callable[[int, int], Costs] = Costs(),
             chunks: int = 1, rendezvous: bool = False) -> Timeline:
    """``costs``: the same for every action, or per (stage, chunk) (the planner's: a
    chunk's blocks, and the head on the last); a dependency between stages waits for
    the receiving chunk's ``latency``. ``rendezvous``: simulate the communication
    batches as the runtime waits for them (module docstring)."""
    p = len(schedule)
    last_virtual = p * chunks - 1
    split = any(a.kind == W for stage in schedule for a in stage)
    cost_of = costs if callable(costs) else (lambda stage, chunk: costs)
    table = {(s, c): cost_of(s, c) for s in range(p) for c in range(chunks)}

    def duration(s: int, a: Action) -> float:
        c = table[(s, a.chunk)]
        return {F: c.f, B: c.b if split else c.b + c.w, W: c.w}[a.kind]
    if rendezvous:
        return _simulate_rendezvous(schedule, table, duration)
    orders = [[a for a in stage if a.kind in COMPUTE] for stage in schedule]
    done: dict[tuple[str, int, int], float] = {}  # (kind, mb, virtual stage) -> end time
    free = [0.0] * p
    cursor = [0] * p
    timeline = Timeline(num_stages=p)

    def ready(s: int, a: Action) -> float | None:
        v = virtual_stage(s, a.chunk, p)
        if a.kind == F:
            dep = None if v == 0 else (F, a.mb, v - 1)
        elif a.kind == B:
            dep = (F, a.mb, v) if v == last_virtual else (B, a.mb, v + 1)
        else:
            dep = (B, a.mb, v)
        if dep is None:
            return 0.0
        if dep not in done:
            return None
        same_stage = dep[2] == v
        return done[dep] + (0.0 if same_stage else table[(s, a.chunk)].latency)

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while cursor[s] < len(orders[s]):
                a = orders[s][cursor[s]]
                t = ready(s, a)
                if t is None:
                    break
                start = max(free[s], t)
                end = start + duration(s, a)
                free[s] = end
                done[(a.kind, a.mb, virtual_stage(s, a.chunk, p))] = end
                timeline.intervals.append(Interval(s, a, start, end))
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: str(orders[s][cursor[s]]) for s in range(p) if cursor[s] < len(orders[s])}
            raise DeadlockError(f"no stage can proceed; waiting: {stuck}")
    return timeline


def _message(s: int, a: Action, p: int) -> tuple[tuple[str, int, int], bool]:
    """The message a communication action sends or receives, named by (direction,
    micro-batch, receiving virtual stage), and whether this side sends it."""
    v = virtual_stage(s, a.chunk, p)
    return {SEND_F: ((F, a.mb, v + 1), True), RECV_F: ((F, a.mb, v), False),
            SEND_B: ((B, a.mb, v - 1), True), RECV_B: ((B, a.mb, v), False)}[a.kind]


def _simulate_rendezvous(schedule: list[list[Action]], table: dict, duration) -> Timeline:
    p = len(schedule)
    steps: list[list[list[Action]]] = []  # per stage: compute actions and communication batches
    for stage in schedule:
        out: list[list[Action]] = []
        for a in stage:
            if a.kind in COMM and out and out[-1][0].kind in COMM:
                out[-1].append(a)
            elif a.kind in COMPUTE or a.kind in COMM:
                out.append([a])
        steps.append(out)
    posted: dict[tuple[tuple[str, int, int], bool], float] = {}  # (message, sender side) -> time
    free, cursor = [0.0] * p, [0] * p
    in_flight: list[list[tuple[tuple[str, int, int], bool]]] = [[] for _ in range(p)]  # unwaited sends
    timeline = Timeline(num_stages=p)
    remaining = sum(len(x) for x in steps)

    def arrival(s: int, messages) -> float | None:
        """When the last of ``messages`` has arrived, or None while a peer has not posted."""
        peers = [posted.get((key, not sends)) for key, sends in messages]
        if any(t is None for t in peers):
            return None
        return max((max(posted[(key, sends)], t) + table[stage_and_chunk(key[2], p)].latency
                    for t, (key, sends) in zip(peers, messages)), default=free[s])

    while remaining or any(in_flight):
        progressed = False
        for s in range(p):
            while cursor[s] < len(steps[s]):
                step = steps[s][cursor[s]]
                if step[0].kind in COMPUTE:
                    a = step[0]
                    end = free[s] + duration(s, a)
                    timeline.intervals.append(Interval(s, a, free[s], end))
                    free[s] = end
                else:
                    messages = [_message(s, a, p) for a in step]
                    for m in messages:
                        posted.setdefault(m, free[s])
                    if all(sends for _, sends in messages):  # sends only: in flight until the next batch
                        done = arrival(s, in_flight[s])
                        if done is None:
                            break
                        free[s] = max(free[s], done)
                        in_flight[s] = messages
                    else:
                        done = arrival(s, in_flight[s] + messages)
                        if done is None:
                            break
                        free[s] = max(free[s], done)
                        in_flight[s] = []
                cursor[s] += 1
                remaining -= 1
                progressed = True
            if cursor[s] == len(steps[s]) and in_flight[s]:  # the schedule's end waits for them
                done = arrival(s, in_flight[s])
                if done is not None:
                    free[s] = max(free[s], done)
                    in_flight[s] = []
                    progressed = True
        if not progressed:
            stuck = {s: " ".join(map(str, steps[s][cursor[s]])) for s in range(p) if cursor[s] < len(steps[s])}
            raise DeadlockError(f"no stage can proceed; waiting: {stuck}")
    return timeline
