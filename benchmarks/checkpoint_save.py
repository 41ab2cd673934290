"""Checkpoint saves, synchronous against asynchronous (``--save-async``), end to end.

The same ``gridtrain train`` command is run as users run it (a subprocess: ``python -m
gridtrain train --nproc N --dp D --tp T ... --save DIR --save-interval K``), once as is
and once with ``--save-async``, in interleaved rounds (the order reversed every other
round: sync, async, async, sync, ...). Default: the GPT-2 small shape (``--model gpt2``,
124M parameters, vocabulary 50,257) at dp 2 x tp 2 on 4 local gloo processes, fp32 on
the CPU, a short sequence (``--seq-len 64``) and a global batch of 2 sequences so that
a step is cheap next to a save; 6 steps, a save every 2 (steps 2, 4 and 6), ``--keep-last
1``, one batch of validation at the end.

What each run reports, and where it comes from:

* **blocked per save (gridtrain)**: the run summary's ``checkpoints:`` line, which
  ``Trainer.save`` fills: synchronously, the whole write; with ``--save-async``, the
  staging copy of the rank's state into host memory (``BackgroundSaver.save`` times the
  staging only, after it has waited for the previous write to finish);
* **pause per save (measured)**: what the training loop actually lost, seen from
  outside: the script watches the metrics file (``--metrics-file``, one JSON line per
  step, written and flushed at the step's end; each line timed by the file's
  modification time, see ``Watcher``) and takes, for a save after step k, the time
  between the lines of steps k and k+1 minus step k+1's own ``step_time_s`` (the loop
  runs the save, and nothing long besides, in that gap). This includes an asynchronous
  save's wait for the previous write, which gridtrain's number leaves out. The save
  after the last step has no next line; it is in the tail;
* **between other steps**: the same gap after steps with no save (the loop's own
  overhead: health check, preemption agreement, learning rate);
* **write per save**: the summary line's median (synchronously, the same as blocked);
* **step time**: ``step_time_s`` from the metrics file, median and mean over steps 2 to
  N (the first step warms up; an asynchronous write runs beside the steps that follow
  its save, on the same cores);
* **tail**: from the last metrics line to the end of the process (the last save, or
  with ``--save-async`` its staging and the wait for its write; the final validation
  batch; the summary; the shutdown);
* **wall**: the whole command, start-up included;
* **checkpoint size**: the bytes of the last step directory (``--keep-last 1``);
* **peak RSS**: the largest sum of resident memory over the command's process tree,
  sampled every 0.25 s (shared pages, torch's libraries, counted once per process).

Ratios are async / sync per round (each pair ran next to each other in time), median
over rounds. The 1-minute load average is printed at the start and end and per run.

Run from the repository root::

    python3 benchmarks/checkpoint_save.py                  # ~4 min on 2 busy CPU cores (4 runs of ~1 min); ~9.5 GiB
    python3 benchmarks/checkpoint_save.py --rounds 3 --steps 8 --save-interval 2
    python3 benchmarks/checkpoint_save.py --model tiny --steps 2 --save-interval 1 --rounds 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import common

from gridtrain.config import ConfigError
from gridtrain.training.report import format_bytes

ROOT = Path(__file__).resolve().parents[1]
MODES = ("sync", "async")
SUMMARY = re.compile(r"checkpoints: (\d+) saved (?:in the background \(--save-async\)|synchronously); training "
                     r"blocked ([\d.]+) s per save \(median; max ([\d.]+) s, in order: ([\d., ]+?)(?: \.\.\.)?\), "
                     r"writing took ([\d.]+) s \(median\)")
PER_RANK = re.compile(r"([\d,]+) parameters per rank")
POLL_S = 0.01


# ---- one run --------------------------------------------------------------------------------------

@dataclass
class Result:
    mode: str
    round: int
    load: float  # 1-minute load average when it started
    wall_s: float = 0.0
    saves: int = 0
    blocked: list[float] = field(default_factory=list)  # gridtrain's, per save in order (first 8)
    blocked_median: float = 0.0
    write_median: float = 0.0
    pauses: list[float] = field(default_factory=list)  # measured, per save except after the last step
    other_gaps: list[float] = field(default_factory=list)  # the same gap after steps without a save
    step_times: list[float] = field(default_factory=list)  # steps 2..N
    tail_s: float = 0.0
    checkpoint_bytes: int = 0
    checkpoint_files: int = 0
    peak_rss: int = 0
    params_per_rank: int = 0
    late: int = 0  # metrics lines timed when seen (see Watcher)


def command(opts: dict, mode: str, save: Path, metrics: Path) -> list[str]:
    """The ``gridtrain train`` command line of one run."""
    cmd = [sys.executable, "-m", "gridtrain", "train", "--model", opts["model"],
           "--nproc", str(opts["dp"] * opts["tp"]), "--dp", str(opts["dp"]), "--tp", str(opts["tp"]),
           "--seq-len", str(opts["seq_len"]), "--micro-batch-size", str(opts["micro_batch_size"]),
           "--global-batch-size", str(opts["global_batch_size"]), "--steps", str(opts["steps"]),
           "--dtype", "fp32", "--device", "cpu", "--eval-interval", "0", "--eval-iters", "1", "--no-progress",
           "--save", str(save), "--save-interval", str(opts["save_interval"]), "--keep-last", "1",
           "--metrics-file", str(metrics)]
    return cmd + (["--save-async"] if mode == "async" else [])


def shown(cmd: list[str]) -> str:
    """A command line as it would be typed from the repository root."""
    return " ".join(["python3", *cmd[1:]]).replace(str(ROOT) + os.sep, "")


class Watcher:
    """On a thread while the command runs: when each metrics line was written, and the
    peak resident memory of the command's process tree.

    A line's time is the file's modification time when that line is the only new one
    and the file did not change while it was read (the writer flushes each line with one
    write, which sets the time); otherwise, when the poll first saw it (later, by the
    scheduling delay of this process on a busy machine: counted in ``late``)."""

    def __init__(self, metrics: Path, root_pid: int):
        self.metrics, self.root_pid = metrics, root_pid
        self.lines: list[tuple[float, dict]] = []  # (time.time() when written, the row)
        self.late = 0  # lines timed when seen, not by the file's modification time
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._read_lines(final=True)

    def _run(self) -> None:
        next_rss = 0.0
        while not self._stop.wait(POLL_S):
            self._read_lines()
            now = time.perf_counter()
            if now >= next_rss:
                self.peak_rss = max(self.peak_rss, tree_rss(self.root_pid))
                next_rss = now + 0.25

    def _read_lines(self, final: bool = False) -> None:
        try:
            before = self.metrics.stat().st_mtime_ns
            text = self.metrics.read_text()
            after = self.metrics.stat().st_mtime_ns
        except OSError:
            return
        seen = time.time()
        new = text.split("\n")[:-1][len(self.lines):]  # complete lines only
        if not new or (before != after and not final):
            return  # nothing new, or written while read: the next poll sees it whole
        for i, row in enumerate(new):
            exact = i == len(new) - 1 and before == after
            self.late += not exact
            self.lines.append((after / 1e9 if exact else seen, json.loads(row)))


def tree_rss(root: int) -> int:
    """Resident bytes summed over ``root`` and its descendants (from /proc; 0 elsewhere)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for pid, fields in common.proc_stats().items():
        children.setdefault(int(fields[1]), []).append(pid)  # fields[1]: the parent's pid
        rss[pid] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # fields[21]: resident pages
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += children.get(pid, [])
    return total


def run_one(opts: dict, mode: str, rnd: int, work: Path) -> tuple[Result, list[str]]:
    save, metrics = work / f"ckpt-{mode}", work / f"metrics-{mode}.jsonl"
    shutil.rmtree(save, ignore_errors=True)
    metrics.unlink(missing_ok=True)
    cmd = command(opts, mode, save, metrics)
    res = Result(mode=mode, round=rnd, load=os.getloadavg()[0])
    began = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watcher = Watcher(metrics, proc.pid)
    try:
        out, _ = proc.communicate(timeout=opts["timeout"])
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        watcher.stop()
        raise RuntimeError(f"{mode} run took longer than --timeout {opts['timeout']:g} s:\n{out[-4000:]}") from None
    ended = time.time()
    watcher.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed (exit {proc.returncode}): {shown(cmd)}\n{out[-4000:]}")
    res.wall_s, res.peak_rss, res.late = ended - began, watcher.peak_rss, watcher.late

    summary = SUMMARY.search(out)
    if summary is None:
        raise RuntimeError(f"no 'checkpoints:' line in the {mode} run's output:\n{out[-4000:]}")
    res.saves = int(summary.group(1))
    res.blocked_median, res.write_median = float(summary.group(2)), float(summary.group(5))
    res.blocked = [float(x) for x in summary.group(4).split(",")]
    per_rank = PER_RANK.search(out)
    res.params_per_rank = int(per_rank.group(1).replace(",", "")) if per_rank else 0

    lines = watcher.lines
    if [row["step"] for _, row in lines] != list(range(1, opts["steps"] + 1)):
        raise RuntimeError(f"the {mode} run's metrics file has steps {[row['step'] for _, row in lines]}")
    interval = opts["save_interval"]
    for (seen, row), (next_seen, next_row) in zip(lines, lines[1:]):
        gap = next_seen - seen - next_row["step_time_s"]
        (res.pauses if row["step"] % interval == 0 else res.other_gaps).append(gap)
    res.step_times = [row["step_time_s"] for _, row in lines[1:]]
    res.tail_s = ended - lines[-1][0]

    latest = save / (save / "latest").read_text().strip()
    files = [f for f in latest.rglob("*") if f.is_file()]
    res.checkpoint_bytes, res.checkpoint_files = sum(f.stat().st_size for f in files), len(files)
    shutil.rmtree(save, ignore_errors=True)  # before the next run: a GPT-2 checkpoint is 1.5 GB
    return res, cmd


# ---- the report -------------------------------------------------------------------------------------

med = common.med


def mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


def _s(x: float) -> str:
    return f"{x:.3f}"


def _row(r: Result) -> str:
    blocked = ", ".join(_s(x) for x in r.blocked) + (" ..." if r.saves > len(r.blocked) else "")
    pauses = ", ".join(_s(x) for x in r.pauses) or "-"
    return (f"| {r.round} | {r.mode} | {r.load:.1f} | {r.saves} | {_s(r.blocked_median)} ({blocked}) | {pauses} | "
            f"{_s(med(r.other_gaps))} | {_s(r.write_median)} | {_s(med(r.step_times))} / {_s(mean(r.step_times))} | "
            f"{r.tail_s:.1f} | {r.wall_s:.1f} | {format_bytes(r.checkpoint_bytes)} | {r.peak_rss / 2**30:.2f} GiB |")


def _mode_line(mode: str, rs: list[Result]) -> str:
    """One mode's medians over rounds."""
    def m(key) -> float:
        return med(key(r) for r in rs)
    return (f"  {mode}: blocked per save (gridtrain) {_s(m(lambda r: r.blocked_median))} s, pause per save (measured) "
            f"{_s(m(lambda r: med(r.pauses)))} s, write {_s(m(lambda r: r.write_median))} s, step "
            f"{_s(m(lambda r: med(r.step_times)))} s (mean {_s(m(lambda r: mean(r.step_times)))} s), tail "
            f"{m(lambda r: r.tail_s):.1f} s, wall {m(lambda r: r.wall_s):.1f} s, peak RSS "
            f"{m(lambda r: r.peak_rss) / 2**30:.2f} GiB")


def _ratio(results: list[Result], key) -> str:
    """async / sync of ``key(result)``, per round, median over rounds (and each round's)."""
    by_round: dict[int, dict[str, Result]] = {}
    for r in results:
        by_round.setdefault(r.round, {})[r.mode] = r
    ratios = [key(pair["async"]) / key(pair["sync"]) for pair in by_round.values()
              if len(pair) == 2 and key(pair["sync"]) > 0]
    if not ratios:
        return "n/a"
    return f"**{med(ratios):.3f}x** (per round: {', '.join(f'{x:.3f}' for x in ratios)})"


def report(results: list[Result], cmds: dict[str, list[str]], opts: dict, load: tuple[float, float],
           wall: float) -> str:
    first = results[0]
    staged = first.params_per_rank * 3 * 4  # weights + two Adam moments, fp32
    lines = [
        f"shape: --model {opts['model']}, seq {opts['seq_len']}, global batch {opts['global_batch_size']} "
        f"sequences in micro-batches of {opts['micro_batch_size']}, fp32, CPU; dp {opts['dp']} x tp {opts['tp']} = "
        f"{opts['dp'] * opts['tp']} processes, {first.params_per_rank:,} parameters per rank; {opts['steps']} steps, "
        f"a save every {opts['save_interval']} ({first.saves} per run), --keep-last 1",
        f"machine: {os.cpu_count()} CPU cores; 1-min load average at start / end {load[0]:.1f} / {load[1]:.1f}",
        f"gridtrain: {common.gridtrain_version()}",
        f"protocol: {opts['rounds']} rounds of one run per mode, interleaved (order reversed every other round); "
        "ratios async / sync per round, median over rounds",
        "commands (DIR: a temporary directory):",
        *(f"  {mode}: {shown(cmds[mode]).replace(str(opts['work']), 'DIR')}" for mode in MODES if mode in cmds),
        "",
        "| round | mode | load | saves | blocked per save, gridtrain s: median (in order) | pause per save, "
        "measured s (in order, all but the last) | gap between other steps s (median) | write per save s (median) "
        "| step s: median / mean | tail s | wall s | checkpoint | peak RSS (tree) |",
        "| ---: | --- | ---: | ---: | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
        *(_row(r) for r in results),
        "",
        "metrics lines timed by the file's modification time: " +
        ("all" if not any(r.late for r in results) else
         "all but " + ", ".join(f"{r.late} in round {r.round} {r.mode}" for r in results if r.late) +
         " (timed when seen: later by this process's scheduling delay)"),
        "medians over rounds, per mode:",
    ]
    lines += [_mode_line(mode, [r for r in results if r.mode == mode]) for mode in MODES
              if any(r.mode == mode for r in results)]
    lines += [
        "async / sync:",
        f"  blocked per save (gridtrain's median) {_ratio(results, lambda r: r.blocked_median)}",
        f"  pause per save (measured, median) {_ratio(results, lambda r: med(r.pauses))}",
        f"  step time (median) {_ratio(results, lambda r: med(r.step_times))}",
        f"  step time (mean) {_ratio(results, lambda r: mean(r.step_times))}",
        f"  wall {_ratio(results, lambda r: r.wall_s)}",
        f"  peak RSS {_ratio(results, lambda r: r.peak_rss)}",
        "",
        f"each rank holds {format_bytes(staged)} of state (parameters per rank x 12 bytes: fp32 weights + two "
        f"Adam moments) and writes, and with --save-async stages, only the pieces it writes (a replicated piece is "
        f"written by one replica): {format_bytes(first.checkpoint_bytes / (opts['dp'] * opts['tp']))} per rank on "
        f"average; the checkpoint holds every tensor once: "
        f"{format_bytes(first.checkpoint_bytes)} in {first.checkpoint_files} files",
        f"wall time {wall:.0f} s",
    ]
    return "\n".join(lines)


# ---- command line --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2", help="preset (default: %(default)s, 124M parameters)")
    p.add_argument("--dp", type=int, default=2, help="default: %(default)s")
    p.add_argument("--tp", type=int, default=2, help="default: %(default)s")
    p.add_argument("--seq-len", type=int, default=64, help="default: %(default)s")
    p.add_argument("--micro-batch-size", type=int, default=1, help="default: %(default)s")
    p.add_argument("--global-batch-size", type=int, default=2, help="default: %(default)s")
    p.add_argument("--steps", type=int, default=6, help="steps per run (default: %(default)s)")
    p.add_argument("--save-interval", type=int, default=2, help="default: %(default)s")
    p.add_argument("--rounds", type=int, default=2, help="runs per mode, interleaved (default: %(default)s)")
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run (default: %(default)s)")
    opts = vars(p.parse_args(argv))
    if any(opts[n] < 1 for n in ("dp", "tp", "steps", "save_interval", "rounds")):
        p.error("--dp, --tp, --steps, --save-interval and --rounds must be >= 1")
    if opts["save_interval"] > opts["steps"]:
        p.error("--save-interval must be <= --steps (the benchmark needs saves)")
    return opts


def check(opts: dict, work: Path) -> None:
    """Validate the command as ``gridtrain train`` would (raises ConfigError)."""
    from gridtrain.cli.parser import build_parser, config_from_args
    from gridtrain.training.validate import validate

    args = build_parser().parse_args(command(opts, "async", work / "ckpt", work / "metrics.jsonl")[3:])
    validate(config_from_args(args))


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    base = Path(opts["workdir"]) if opts["workdir"] else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    work = opts["work"] = Path(tempfile.mkdtemp(prefix="gridtrain-checkpoint-bench-", dir=base))
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    results, cmds = [], {}
    try:
        check(opts, work)
        for rnd in range(1, opts["rounds"] + 1):
            for mode in (MODES if rnd % 2 else MODES[::-1]):
                res, cmds[mode] = run_one(opts, mode, rnd, work)
                results.append(res)
                print(f"round {rnd} {mode}: wall {res.wall_s:.1f} s, blocked {res.blocked_median:.3f} s per save "
                      f"(gridtrain), pauses {', '.join(_s(x) for x in res.pauses)} s", file=sys.stderr, flush=True)
    except ConfigError as e:
        print(f"checkpoint_save: error: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(report(results, cmds, opts, (load_before, os.getloadavg()[0]), time.perf_counter() - began))
    return 0


if __name__ == "__main__":
    sys.exit(main())
