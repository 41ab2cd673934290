"""Pipeline schedules as data: for each stage, the ordered list of actions it executes.

A schedule is a function ``(num_stages p, num_microbatches m, chunks_per_stage v) ->
list (one per stage) of lists of Action``. The runtime only interprets actions; the
validator, the simulator, the pictures and the tests read the very same lists.

Actions, executed in list order by one pipeline rank (``chunk`` is the local model chunk;
chunk c of stage s is *virtual stage* ``c * p + s``, the layers in pipeline order):

    F(mb, c)        forward of micro-batch mb through chunk c
    B(mb, c)        backward; the full backward, or only the input gradient when the
                    schedule also has W actions (zero-bubble schedules)
    W(mb, c)        weight gradient of a split backward
    RECV_F / SEND_F receive the input activation of (mb, c) / send the output of (mb, c)
    RECV_B / SEND_B receive the gradient of (mb, c)'s output / send its input gradient
    ALLREDUCE_GRADS the stage's gradients are final: reduce them (DP, tied embeddings)
    OPTIMIZER_STEP

Communication semantics: a maximal run of consecutive SEND/RECV actions is posted as one
batch of non-blocking operations and waited for as a whole (Megatron's combined
``send_forward_recv_backward``); the validator checks that this cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
ALLREDUCE_GRADS, OPTIMIZER_STEP = "ALLREDUCE_GRADS", "OPTIMIZER_STEP"
COMPUTE = (F, B, W)
COMM = (SEND_F, RECV_F, SEND_B, RECV_B)


class ScheduleError(ValueError):
    """A (schedule, p, m, v) combination that cannot run; one line naming the fix."""


@dataclass(frozen=True)
class Action:
    kind: str
    mb: int = -1
    chunk: int = 0

    def __str__(self) -> str:
        if self.mb < 0:
            return self.kind
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def virtual_stage(stage: int, chunk: int, p: int) -> int:
    return chunk * p + stage


def stage_and_chunk(virtual: int, p: int) -> tuple[int, int]:
    """Inverse of :func:`virtual_stage`: which rank and local chunk hold a virtual stage."""
    return virtual % p, virtual // p


# ---- compute orders ------------------------------------------------------------------------

def gpipe_order(p: int, m: int, v: int, s: int) -> list[Action]:
    """GPipe: every forward, then every backward (in the same micro-batch order)."""
    return [Action(F, i) for i in range(m)] + [Action(B, i) for i in range(m)]


def one_f_one_b_order(p: int, m: int, v: int, s: int) -> list[Action]:
    """PipeDream-flush: p-s-1 warm-up forwards, then one forward one backward, then the
    remaining backwards. At most p - s micro-batches are in flight on stage s."""
    warmup = min(p - s - 1, m)
    order = [Action(F, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(F, warmup + i), Action(B, i)]
    return order + [Action(B, i) for i in range(m - warmup, m)]


def interleaved_order(p: int, m: int, v: int, s: int) -> list[Action]:
    """Megatron's interleaved 1F1B: each rank holds v chunks; micro-batches go through
    the chunks in groups of p. Warm-up is 2(p-s-1) + (v-1)p chunk-forwards."""
    total = m * v

    def chunk(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def mb(k: int) -> int:
        return (k // (p * v)) * p + k % p

    warmup = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
    order = [Action(F, mb(k), chunk(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [Action(F, mb(warmup + k), chunk(warmup + k, True)), Action(B, mb(k), chunk(k, False))]
    return order + [Action(B, mb(k), chunk(k, False)) for k in range(total - warmup, total)]


def zb_h1_order(p: int, m: int, v: int, s: int) -> list[Action]:
    """ZB-H1 (Qi et al., 2023): 1F1B with the backward split into B (input gradient, on the
    critical path) and W (weight gradient, deferrable).

    Stage s runs 1F1B's warm-up and F-then-B steady state, and lets up to s weight
    gradients wait: the later the stage, the sooner its B reaches the stages before it.
    In the cool-down every B is followed by one waiting W, and the rest close the step,
    filling the time 1F1B spends waiting for gradients. With F = B = W the bubble is
    (p-1)(F+B-W), a third of 1F1B's (p-1)(F+B+W). In-flight forwards (F done, B not) stay
    within 1F1B's p - s; a micro-batch's weight-gradient inputs are kept until its W."""
    warmup = min(p - s - 1, m)
    order = [Action(F, i) for i in range(warmup)]
    forwards, backwards, weights = warmup, 0, 0
    while backwards < m:
        if forwards < m:
            order.append(Action(F, forwards))
            forwards += 1
        order.append(Action(B, backwards))
        backwards += 1
        if backwards - weights > s or forwards == m:
            order.append(Action(W, weights))
            weights += 1
    return order + [Action(W, i) for i in range(weights, m)]


ORDERS: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "gpipe": gpipe_order,
    "1f1b": one_f_one_b_order,
    "interleaved-1f1b": interleaved_order,
    "zb-h1": zb_h1_order,
}


# ---- communication ------------------------------------------------------------------------

def _receives(step: list[Action], s: int, p: int, v: int) -> list[Action]:
    last = p * v - 1
    return [Action(RECV_F if a.kind == F else RECV_B, a.mb, a.chunk) for a in step
            if (a.kind == F and virtual_stage(s, a.chunk, p) > 0)
            or (a.kind == B and virtual_stage(s, a.chunk, p) < last)]


def _sends(step: list[Action], s: int, p: int, v: int) -> list[Action]:
    last = p * v - 1
    return [Action(SEND_F if a.kind == F else SEND_B, a.mb, a.chunk) for a in step
            if (a.kind == F and virtual_stage(s, a.chunk, p) < last)
            or (a.kind == B and virtual_stage(s, a.chunk, p) > 0)]


def _steps(order: list[Action], paired: bool) -> list[list[Action]]:
    """Units between which communication happens: single actions, or (``paired``) each
    steady-state forward together with the backward that follows it."""
    if not paired or not any(a.kind == B for a in order):
        return [[a] for a in order]
    first_b = next(i for i, a in enumerate(order) if a.kind == B)
    steps = [[a] for a in order[:first_b - 1]]
    i = first_b - 1
    while i + 1 < len(order) and order[i].kind == F and order[i + 1].kind == B:
        steps.append(order[i:i + 2])
        i += 2
    return steps + [[a] for a in order[i:]]


def with_communication(order: list[Action], s: int, p: int, v: int, paired: bool = False) -> list[Action]:
    """Insert each step's receives before it and its sends after it, then the gradient
    reduction and the optimizer step.

    With ``paired`` (interleaved 1F1B), the sends of one steady-state F+B pair and the
    receives of the next pair form a single batch, as Megatron's
    ``send_forward_backward_recv_forward_backward`` does: gradients travel round the
    ring of stages (the first stage's chunk 1 feeds the last stage's chunk 0), and
    posting each send in a batch of its own would wait for a receive that the peer only
    posts after its next forward: a deadlock.
    """
    steps = _steps(order, paired)
    out = _receives(steps[0], s, p, v) if steps else []
    for k, step in enumerate(steps):
        out += step + _sends(step, s, p, v)
        if k + 1 < len(steps):
            out += _receives(steps[k + 1], s, p, v)
    return out + [Action(ALLREDUCE_GRADS), Action(OPTIMIZER_STEP)]


def check_sizes(name: str, p: int, m: int, v: int) -> None:
    if name not in ORDERS:
        raise ScheduleError(f"--schedule {name!r} is not one of {', '.join(ORDERS)}")
    if p < 1 or m < 1 or v < 1:
        raise ScheduleError(f"pipeline sizes must be >= 1 (pp={p}, micro-batches={m}, vpp={v})")
    if v > 1 and name != "interleaved-1f1b":
        raise ScheduleError(f"--vpp {v} needs --schedule interleaved-1f1b; use --vpp 1 with {name}")
    if v > 1 and p == 1:
        raise ScheduleError(f"--vpp {v} needs --pp > 1 (chunks interleave across pipeline ranks); use --vpp 1")
    if name == "interleaved-1f1b" and p > 1 and m % p:
        raise ScheduleError(f"interleaved-1f1b needs the micro-batch count ({m}) to be a multiple of "
                            f"--pp {p}; change --global-batch-size or --micro-batch-size")


def build_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Each stage's full action list for one optimizer step."""
    check_sizes(name, p, m, v)
    paired = name == "interleaved-1f1b" and m > p
    return [with_communication(ORDERS[name](p, m, v, s), s, p, v, paired) for s in range(p)]


def uses_split_backward(name: str) -> bool:
    return name == "zb-h1"
