"""Pictures of pipeline schedules, and the ``gridtrain schedule`` command that prints
and draws one.

A timeline picture is the quickest review of a schedule: one row per stage, a box per
compute action, and the bubble is the white space. The command builds the very action
lists the runtime executes, validates them, simulates them and compares the simulated
bubble with the schedule's closed form, so a schedule change that costs time or memory
shows up as numbers, not only as a picture.

matplotlib is optional (the ``plots`` extra): it is imported only when a picture is
drawn, and only its object-oriented API is used (no pyplot, no global backend switch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gridtrain.parallel.pipeline.schedules import (
    ORDERS,
    Action,
    B,
    F,
    ScheduleError,
    W,
    build_schedule,
    uses_split_backward,
)
from gridtrain.parallel.pipeline.simulate import Costs, Timeline, simulate
from gridtrain.parallel.pipeline.validate import InvalidSchedule, in_flight_bound, peak_held, validate_schedule

COLOURS = {F: "#4c8bd6", B: "#f0a040", W: "#5cb85c"}  # blue, orange, green: distinct, also in greyscale
ROW_BACKGROUND = "#f2f2f2"  # idle time shows as this empty band
MISSING_MATPLOTLIB = "matplotlib is needed for pictures: pip install matplotlib"


# ---- the picture --------------------------------------------------------------------------

def draw_timeline(timeline: Timeline, path: str | Path, title: str) -> None:
    """Write ``timeline`` as a PNG: stage 0 on top, F/B/W boxes labelled with their
    micro-batch, later chunks of interleaved schedules in lighter shades, and the idle
    fraction appended to ``title``."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError(MISSING_MATPLOTLIB) from None
    p, span = timeline.num_stages, timeline.makespan
    chunks = 1 + max(i.action.chunk for i in timeline.intervals)
    handles = _legend(timeline, chunks, Patch)
    width = min(max(8.0, 0.42 * span), 22.0)
    legend_rows = 1 if width >= 1.8 * len(handles) else 2
    left, right, top, bottom = 0.9, 0.2, 0.7, 0.75 + 0.25 * legend_rows  # margins in inches
    height = top + bottom + 0.5 * p
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes((left / width, bottom / height, 1 - (left + right) / width, 0.5 * p / height))
    points_per_unit = (width - left - right) * 72 / span
    for s in range(p):
        ax.barh(s, span, left=0, height=0.8, color=ROW_BACKGROUND, edgecolor="none")
    for interval in timeline.intervals:
        _draw_box(ax, interval.stage, interval.action, interval.start, interval.end, chunks, points_per_unit)
    ax.set_xlim(0, span)
    ax.set_ylim(p - 0.5, -0.5)  # stage 0 on top
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.set_xlabel("time (units of --costs)")
    ax.spines[["top", "right", "left"]].set_visible(False)
    ax.set_title(f"{title}\nmakespan {span:.4g}, idle {100 * timeline.idle_fraction():.1f}% of stage-time")
    fig.legend(handles=handles, loc="lower center", ncol=-(-len(handles) // legend_rows), frameon=False,
               fontsize=9)
    fig.savefig(path, dpi=110)


def _draw_box(ax, stage: int, a: Action, start: float, end: float, chunks: int, points_per_unit: float) -> None:
    ax.barh(stage, end - start, left=start, height=0.8, color=_shade(COLOURS[a.kind], a.chunk, chunks),
            edgecolor="#333333", linewidth=0.6)
    label = str(a.mb)
    size = min(9.0, (end - start) * points_per_unit / (0.62 * len(label) + 0.8))
    if size >= 5:  # too narrow a box stays unlabelled rather than overlapping its neighbours
        ax.text((start + end) / 2, stage, label, ha="center", va="center", fontsize=size)


def _shade(colour: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """Chunk 0 in the full colour, each later chunk mixed further towards white."""
    rgb = [int(colour[k:k + 2], 16) / 255 for k in (1, 3, 5)]
    mix = 0.55 * chunk / max(chunks - 1, 1)
    return tuple(c + (1 - c) * mix for c in rgb)  # type: ignore[return-value]


def _legend(timeline: Timeline, chunks: int, patch) -> list:
    split = any(i.action.kind == W for i in timeline.intervals)
    names = {F: "F forward", B: "B input grad" if split else "B backward", W: "W weight grad"}
    kinds = [F, B, W] if split else [F, B]
    if chunks == 1:
        return [patch(facecolor=COLOURS[k], edgecolor="#333333", label=names[k]) for k in kinds]
    return [patch(facecolor=_shade(COLOURS[k], c, chunks), edgecolor="#333333", label=f"{names[k]}, chunk {c}")
            for k in kinds for c in range(chunks)]


# ---- the command --------------------------------------------------------------------------

def add_schedule_parser(subparsers) -> argparse.ArgumentParser:
    """``gridtrain schedule``: validate, simulate and (with --out) draw one schedule."""
    parser = subparsers.add_parser("schedule", help="validate, simulate and draw a pipeline schedule")
    parser.add_argument("--schedule", default="1f1b", help=" | ".join(ORDERS))
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per optimizer step")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per stage (interleaved-1f1b)")
    parser.add_argument("--costs", type=parse_costs, default=Costs(),
                        help="F,B,W: time of one micro-batch's forward, input-gradient and weight-gradient "
                             "on one stage (default 1,1,1); each interleaved chunk takes 1/vpp of it")
    parser.add_argument("--latency", type=float, default=0.0, help="transfer time between stages")
    parser.add_argument("--out", help="write the timeline picture here (PNG)")
    return parser


def parse_costs(text: str) -> Costs:
    try:
        f, b, w = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--costs {text!r}: give three numbers F,B,W, e.g. 1,2,1") from None
    if min(f, b, w) < 0 or f + b + w <= 0:
        raise argparse.ArgumentTypeError(f"--costs {text!r}: times must be >= 0 and not all 0")
    return Costs(f, b, w)


def schedule_command(args: argparse.Namespace) -> int:
    """Print the schedule's makespan, bubble, closed form and memory; draw it with
    --out. Exit 0 if the schedule is valid, 1 if the validator rejects it (the report
    and picture are still produced, to help find why), 2 for a bad configuration."""
    name, p, m, v = args.schedule, args.pp, args.microbatches, args.vpp
    try:
        schedule = build_schedule(name, p, m, v)
    except ScheduleError as e:
        print(f"gridtrain: error: {e}", file=sys.stderr)
        return 2
    stage_costs: Costs = args.costs
    costs = Costs(stage_costs.f / v, stage_costs.b / v, stage_costs.w / v, args.latency)
    timeline = simulate(schedule, costs, chunks=v)
    status = _report(name, p, m, v, schedule, stage_costs, timeline)
    if args.out:
        try:
            draw_timeline(timeline, args.out, f"{name}: pp={p}, microbatches={m}" + (f", vpp={v}" if v > 1 else ""))
        except ImportError as e:
            print(f"gridtrain: error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {args.out}")
    return status


def _report(name: str, p: int, m: int, v: int, schedule: list[list[Action]], costs: Costs,
            timeline: Timeline) -> int:
    split = "" if uses_split_backward(name) else " (B runs B+W)"
    print(f"schedule {name}: pp={p} microbatches={m} vpp={v} costs F={costs.f:g} B={costs.b:g} W={costs.w:g}{split}")
    status = 0
    try:
        report = validate_schedule(schedule, m, v)
        print(f"valid: {report.num_messages} transfers, communication batches per stage {report.num_batches}")
    except InvalidSchedule as e:
        print(f"INVALID: {e}")
        status = 1
    ideal = m * (costs.f + costs.b + costs.w)
    print(f"makespan {timeline.makespan:.4g} (ideal {ideal:.4g}); idle fraction {timeline.idle_fraction():.4f}")
    print(closed_form(name, p, m, v, costs, timeline))
    peaks = [peak_held(actions) for actions in schedule]
    bounds = [in_flight_bound(name, p, m, v, s) for s in range(p)]
    print(f"peak in-flight (F done, B not) per stage: {peaks}; bound {bounds}")
    if uses_split_backward(name):
        print(f"peak in-flight until W per stage: {[peak_held(actions, until=W) for actions in schedule]}; "
              f"bound {[in_flight_bound(name, p, m, v, s, until_w=True) for s in range(p)]}")
    return status


def closed_form(name: str, p: int, m: int, v: int, costs: Costs, timeline: Timeline) -> str:
    """One line comparing the simulated bubble with the schedule's textbook formula.
    ``costs`` are per stage (all chunks); the formulas assume zero latency."""
    ideal = m * (costs.f + costs.b + costs.w)
    bubble = timeline.makespan - ideal
    if name in ("gpipe", "1f1b"):
        return (f"closed form (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.4f}; "
                f"simulated idle fraction {timeline.idle_fraction():.4f}")
    if name == "interleaved-1f1b":
        return (f"closed form bubble/ideal = (p-1)/(v m) = {(p - 1) / (v * m):.4f}; "
                f"simulated (makespan-ideal)/ideal {bubble / ideal:.4f}")
    one_f_one_b = (p - 1) * (costs.f + costs.b + costs.w)
    ratio = f" = {bubble / one_f_one_b:.3f} of 1F1B's (p-1)(F+B+W) = {one_f_one_b:.4g}" if p > 1 else ""
    return (f"closed form bubble (p-1)(F+B-W) = {(p - 1) * (costs.f + costs.b - costs.w):.4g} "
            f"(for m >= p, W <= min(F, B)); simulated makespan-ideal {bubble:.4g}{ratio}")
