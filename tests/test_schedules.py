"""Pure tests of the pipeline schedules as data: no processes, no torch.distributed.

The runtime executes exactly these lists, so what is proved here (complete, ordered,
matched, deadlock-free, memory within bound, bubble as the textbook says) holds for
every run. Loops live inside a few tests, not in thousands of parametrized cases, to
keep the whole file at a few seconds.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from fractions import Fraction

import pytest

from gridtrain.parallel.pipeline import draw
from gridtrain.parallel.pipeline.schedules import (
    RECV_F,
    Action,
    B,
    F,
    ScheduleError,
    W,
    build_schedule,
    check_sizes,
    interleaved_order,
    with_communication,
)
from gridtrain.parallel.pipeline.simulate import Costs, simulate
from gridtrain.parallel.pipeline.validate import InvalidSchedule, in_flight_bound, peak_held, validate_schedule

STAGES = range(1, 9)
MICROBATCHES = range(1, 33)
FLAT = ("gpipe", "1f1b", "zb-h1")  # the schedules with one chunk per stage


def interleaved_cases() -> list[tuple[int, int, int]]:
    """(p, m, v) for interleaved 1F1B: m a multiple of p, as check_sizes demands."""
    return [(p, m, v) for p in STAGES if p > 1 for v in (2, 3) for m in range(p, 33, p)]


# ---- every schedule is valid and within its memory bound ----------------------------------

@pytest.mark.parametrize("name", FLAT)
def test_flat_schedules_are_valid_and_within_bound(name: str) -> None:
    for p in STAGES:
        for m in MICROBATCHES:
            report = validate_schedule(build_schedule(name, p, m), m)
            assert report.peak_in_flight == [in_flight_bound(name, p, m, 1, s) for s in range(p)], (p, m)
            if name == "zb-h1":
                assert report.peak_until_w == [min(m, p)] * p, (p, m)
                assert report.peak_until_w == [in_flight_bound(name, p, m, 1, s, until_w=True) for s in range(p)]
            else:
                assert report.peak_until_w is None


def test_interleaved_schedule_is_valid() -> None:
    for p, m, v in interleaved_cases():
        validate_schedule(build_schedule("interleaved-1f1b", p, m, v), m, v)


def test_interleaved_is_valid_where_it_has_no_steady_state() -> None:
    """m == p: all forwards first, no steady state."""
    for p, m, v in interleaved_cases():
        if m == p:
            validate_schedule(build_schedule("interleaved-1f1b", p, m, v), m, v)


def test_interleaved_in_flight_is_megatrons_bound_except_when_m_equals_p() -> None:
    """Megatron's warm-up 2(p-s-1) + (v-1)p chunk-forwards plus one is the peak, but with
    m == p every forward runs first and every stage holds all m*v units."""
    for p, m, v in interleaved_cases():
        peaks = [peak_held(actions) for actions in build_schedule("interleaved-1f1b", p, m, v)]
        assert peaks == [in_flight_bound("interleaved-1f1b", p, m, v, s) for s in range(p)], (p, m, v)
        megatron = [min(m * v, 2 * (p - s - 1) + (v - 1) * p + 1) for s in range(p)]
        if m != p:
            assert peaks == megatron
        else:
            assert peaks == [m * v] * p
            assert any(peak > bound for peak, bound in zip(peaks, megatron)) == (p > 1)


def test_interleaving_on_one_stage_is_refused() -> None:
    """p = 1 would hand chunks over to itself: nothing to interleave with, so it is an error."""
    with pytest.raises(ScheduleError, match="--vpp 2 needs --pp > 1"):
        build_schedule("interleaved-1f1b", 1, 3, 2)


# ---- the simulator agrees with the closed forms --------------------------------------------

@pytest.mark.parametrize("name", ("gpipe", "1f1b"))
def test_gpipe_and_1f1b_idle_fraction(name: str) -> None:
    for costs in (Costs(1, 1, 1), Costs(1, 2, 1), Costs(2, 1, 0)):
        for p in STAGES:
            for m in MICROBATCHES:
                timeline = simulate(build_schedule(name, p, m), costs)
                assert timeline.idle_fraction() == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (costs, p, m)


def test_interleaved_bubble_is_a_vth_of_1f1b() -> None:
    """Exact when each chunk costs 1/v of the stage (the same model cut finer): with
    integer per-chunk times t, the stage's time per micro-batch is v*t and the bubble
    is (p-1)*t, so (makespan - ideal) / ideal = (p-1) / (v m)."""
    for costs in (Costs(1, 1, 1), Costs(1, 2, 1)):
        for p, m, v in interleaved_cases():
            timeline = simulate(build_schedule("interleaved-1f1b", p, m, v), costs, chunks=v)
            ideal = m * v * (costs.f + costs.b + costs.w)
            assert Fraction(timeline.makespan - ideal) / ideal == Fraction(p - 1, v * m), (costs, p, m, v)


def test_interleaved_bubble_with_costs_scaled_per_chunk() -> None:
    p, m, v = 4, 8, 3
    timeline = simulate(build_schedule("interleaved-1f1b", p, m, v), Costs(1 / v, 1 / v, 1 / v), chunks=v)
    assert (timeline.makespan - 3 * m) / (3 * m) == pytest.approx((p - 1) / (v * m), rel=1e-12)


@pytest.mark.slow
def test_zb_h1_bubble_is_a_third_of_1f1b() -> None:
    """(p-1)(F+B-W) once m >= p and W <= min(F, B); with F = B = W, a third of 1F1B's."""
    for p in STAGES:
        for m in range(p, 33):
            zb = simulate(build_schedule("zb-h1", p, m), Costs(1, 1, 1)).makespan - 3 * m
            one_f_one_b = simulate(build_schedule("1f1b", p, m), Costs(1, 1, 1)).makespan - 3 * m
            assert zb == p - 1 and one_f_one_b == 3 * (p - 1), (p, m)
    for f, b, w in ((1, 2, 1), (2, 2, 1), (1, 1, 0.5), (3, 2, 2)):
        for p in STAGES:
            for m in range(p, 33):
                bubble = simulate(build_schedule("zb-h1", p, m), Costs(f, b, w)).makespan - m * (f + b + w)
                assert bubble == pytest.approx((p - 1) * (f + b - w)), (f, b, w, p, m)


def test_zb_h1_bubble_is_larger_with_fewer_microbatches_than_stages() -> None:
    for p in range(2, 9):
        for m in range(1, p):
            bubble = simulate(build_schedule("zb-h1", p, m), Costs(1, 1, 1)).makespan - 3 * m
            assert bubble > p - 1, (p, m)


# ---- hand-broken schedules are rejected, naming the problem --------------------------------

def one_f_one_b(p: int = 2, m: int = 2) -> list[list[Action]]:
    return build_schedule("1f1b", p, m)


def replace(actions: list[Action], old: Action, new: list[Action]) -> list[Action]:
    i = actions.index(old)
    return actions[:i] + new + actions[i + 1:]


def test_rejects_a_backward_before_its_forward() -> None:
    schedule = one_f_one_b()
    last = schedule[1]  # RECV_F0 F0 B0 SEND_B0 ...
    last[1], last[2] = last[2], last[1]
    with pytest.raises(InvalidSchedule, match=r"^stage 1, action 1 \(B0\): comes before F0 \(action 2\)$"):
        validate_schedule(schedule, 2)


def test_rejects_a_missing_receive() -> None:
    schedule = one_f_one_b()
    schedule[1] = replace(schedule[1], Action(RECV_F, 1), [])
    with pytest.raises(InvalidSchedule, match=r"^stage 1: RECV_F1 is missing \(F1 is at action \d+\)$"):
        validate_schedule(schedule, 2)


def test_rejects_sends_and_receives_in_different_orders() -> None:
    """Stage 0 computes and sends micro-batch 1 first; stage 1 expects 0 first."""
    schedule = build_schedule("gpipe", 2, 2)
    schedule[0][0:4] = schedule[0][2:4] + schedule[0][0:2]  # F1 SEND_F1 F0 SEND_F0
    with pytest.raises(InvalidSchedule, match=r"^stage 0, action 1 \(SEND_F1\): the 1st message sent to "
                                              r"stage 1 .* \(RECV_F0\), which expects RECV_F1: sends and "
                                              r"receives are in different orders$"):
        validate_schedule(schedule, 2)


def test_rejects_an_activation_and_a_gradient_swapped_between_the_same_two_ranks() -> None:
    """Interleaved, pp 2: stage 1 sends stage 0 both activations (its chunk 0 feeds stage
    0's chunk 1) and gradients. NCCL pairs the messages of one pair of ranks by order,
    whatever their direction, so sending gradient 0 before activation 2 while stage 0
    receives them the other way round would swap two equal-shaped tensors silently."""
    schedule = build_schedule("interleaved-1f1b", 2, 4, 2)
    stage1 = [str(a) for a in schedule[1]]
    i = stage1.index("SEND_F2")
    assert stage1[i + 1] == "SEND_B0"
    validate_schedule(schedule, 4, 2)  # as built: in order
    schedule[1][i], schedule[1][i + 1] = schedule[1][i + 1], schedule[1][i]
    with pytest.raises(InvalidSchedule, match=rf"^stage 1, action {i} \(SEND_B0\): the \d+(st|nd|rd|th) message "
                                              r"sent to stage 0 meets .* \(RECV_F2\.1\), which expects RECV_B0: "
                                              r"sends and receives are in different orders$"):
        validate_schedule(schedule, 4, 2)


def test_rejects_a_rank_sending_to_itself() -> None:
    """Two chunks on one rank would hand activations to themselves; torch.distributed
    cannot, and the runtime does not pretend to (check_sizes refuses --vpp with --pp 1)."""
    schedule = [with_communication(interleaved_order(1, 2, 2, 0), 0, 1, 2)]
    with pytest.raises(InvalidSchedule, match=r"^stage 0, action \d+ \(SEND_F0\): a rank cannot send to itself"):
        validate_schedule(schedule, 2, 2)


def test_rejects_an_order_that_deadlocks() -> None:
    """Stage 0 waits for micro-batch 0's gradient before it sends its activation."""
    schedule = one_f_one_b(m=1)  # stage 0: F0 SEND_F0 RECV_B0 B0 ...
    assert [str(a) for a in schedule[0][:4]] == ["F0", "SEND_F0", "RECV_B0", "B0"]
    schedule[0][1:4] = [schedule[0][2], schedule[0][3], schedule[0][1]]  # F0 RECV_B0 B0 SEND_F0
    with pytest.raises(InvalidSchedule, match=r"^deadlock: stage 0 stuck at action 1 waiting for RECV_B0 "
                                              r"\(stage 1 posts SEND_B0 only at action 3\); stage 1 stuck at "
                                              r"action 0 waiting for RECV_F0 "):
        validate_schedule(schedule, 1)


def test_rejects_two_blocking_sends_towards_each_other() -> None:
    """Each order is fine on its own and every send has its receive, yet stage 0 waits
    to send activation 1 while stage 1 waits to send gradient 0, and each posts the
    other's receive only after its own send: a send completes only when matched."""
    orders = [[Action(F, 0), Action(F, 1), Action(F, 2), Action(B, 0), Action(W, 0), Action(B, 1), Action(W, 1),
               Action(B, 2), Action(W, 2)],
              [Action(F, 0), Action(B, 0), Action(W, 0), Action(F, 1), Action(B, 1), Action(W, 1), Action(F, 2),
               Action(B, 2), Action(W, 2)]]
    schedule = [with_communication(order, s, 2, 1) for s, order in enumerate(orders)]
    with pytest.raises(InvalidSchedule, match=r"^deadlock: stage 0 stuck at action 3 waiting for SEND_F1 \(stage 1 "
                                              r"posts RECV_F1 only at action 5\); stage 1 stuck at action 3 waiting "
                                              r"for SEND_B0 \(stage 0 posts RECV_B0 only at action 6\)$"):
        validate_schedule(schedule, 3)


def test_rejects_a_duplicated_microbatch() -> None:
    schedule = one_f_one_b()
    schedule[0] = replace(schedule[0], Action(F, 1), [Action(F, 0)])
    with pytest.raises(InvalidSchedule, match=r"^stage 0, action 2 \(F0\): appears twice \(first at action 0\)$"):
        validate_schedule(schedule, 2)


@pytest.mark.parametrize("broken, message", [
    (lambda s: s[0].insert(0, Action("NAP", 0)), r"stage 0, action 0 .*unknown action kind 'NAP'"),
    (lambda s: s[0].insert(0, Action(F, 2)), r"stage 0, action 0 \(F2\): micro-batch 2 is outside 0\.\.1"),
    (lambda s: s[0].insert(0, Action(F, 0, 1)), r"stage 0, action 0 \(F0\.1\): chunk 1 is outside 0\.\.0"),
    (lambda s: s[0].insert(0, Action(RECV_F, 0)), r"stage 0, action 0 \(RECV_F0\): virtual stage 0 is the first"),
    (lambda s: s[1].remove(Action(B, 1)), r"stage 1: B1 is missing"),
    (lambda s: s[0].insert(0, s[0].pop(-2)), r"stage 0, action 0 \(ALLREDUCE_GRADS\): comes before the stage's "
                                             r"last gradient action B1"),
    (lambda s: s[0].insert(0, s[0].pop()), r"stage 0, action 0 \(OPTIMIZER_STEP\): is not the stage's last"),
    (lambda s: s[1].append(Action(W, 0)), r"stage 0: W0 is missing"),
])
def test_rejects_other_broken_lists(broken: Callable[[list[list[Action]]], None], message: str) -> None:
    schedule = one_f_one_b()
    broken(schedule)
    with pytest.raises(InvalidSchedule, match=message):
        validate_schedule(schedule, 2)


# ---- sizes that cannot work are refused before anything is built ----------------------------

def test_check_sizes_refuses_what_cannot_run() -> None:
    with pytest.raises(ScheduleError, match=r"micro-batch count \(6\) to be a multiple of --pp 4"):
        check_sizes("interleaved-1f1b", 4, 6, 2)
    with pytest.raises(ScheduleError, match=r"--vpp 2 needs --schedule interleaved-1f1b"):
        check_sizes("1f1b", 4, 8, 2)
    with pytest.raises(ScheduleError, match=r"--schedule 'fastest'"):
        check_sizes("fastest", 4, 8, 1)


def test_interleaved_order_has_megatrons_warmup() -> None:
    order = interleaved_order(4, 8, 2, 0)
    first_b = next(i for i, a in enumerate(order) if a.kind == B)
    assert first_b == 2 * (4 - 0 - 1) + (2 - 1) * 4 + 1  # warm-up forwards, then one more F


# ---- the command -------------------------------------------------------------------------

def schedule_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    draw.add_schedule_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["schedule", *argv])


SCHEDULE_ARGS = {
    "gpipe": ["--schedule", "gpipe"],
    "1f1b": ["--schedule", "1f1b"],
    "interleaved-1f1b": ["--schedule", "interleaved-1f1b", "--vpp", "2"],
    "zb-h1": ["--schedule", "zb-h1"],
}


@pytest.mark.spawn
@pytest.mark.parametrize("name", sorted(SCHEDULE_ARGS))
def test_schedule_command_writes_a_picture(name: str, tmp_path, capsys) -> None:
    import matplotlib  # noqa: F401  (in the test extra: pictures are part of the contract)
    out = tmp_path / f"{name}.png"
    draw.schedule_command(schedule_args(*SCHEDULE_ARGS[name], "--pp", "4", "--microbatches", "8", "--out", str(out)))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize("name", [*FLAT, "interleaved-1f1b"])
def test_schedule_command_reports_a_valid_schedule(name: str, capsys) -> None:
    assert draw.schedule_command(schedule_args(*SCHEDULE_ARGS[name], "--pp", "4", "--microbatches", "8")) == 0


def test_schedule_command_prints_the_closed_form(capsys) -> None:
    assert draw.schedule_command(schedule_args("--schedule", "1f1b", "--pp", "4", "--microbatches", "8")) == 0
    out = capsys.readouterr().out
    assert "makespan 33 (ideal 24); idle fraction 0.2727" in out
    assert "closed form (p-1)/(m+p-1) = 0.2727" in out
    assert "peak in-flight (F done, B not) per stage: [4, 3, 2, 1]; bound [4, 3, 2, 1]" in out


def test_schedule_command_refuses_bad_sizes_in_one_line(capsys) -> None:
    args = schedule_args("--schedule", "interleaved-1f1b", "--pp", "4", "--microbatches", "6", "--vpp", "2")
    assert draw.schedule_command(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "multiple of --pp 4" in err[0]


def test_bad_costs_are_refused() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="three numbers F,B,W"):
        draw.parse_costs("1,2")


def test_pictures_without_matplotlib_say_how_to_get_it(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    timeline = simulate(build_schedule("1f1b", 2, 2))
    with pytest.raises(ImportError, match=r"^matplotlib is needed for pictures: pip install matplotlib$"):
        draw.draw_timeline(timeline, tmp_path / "x.png", "1f1b")
