"""Start-up of ``gridtrain train --nproc N``: warm workers (forked by the server that has
imported torch and gridtrain once) against cold ones (each spawned worker imports them).

Each side runs the same command in a fresh process, the only difference being the
environment's ``GRIDTRAIN_START_METHOD`` (``forkserver``, the default, or ``spawn``)::

    python -m gridtrain train --nproc N --model tiny --steps S --metrics-file F ...

and measures, from just before the command is started: the time until the metrics file
holds step 1 (*first step*: the launcher's imports and checks, the workers' start, the
process groups, the model's build and one training step) and the time until the command
exits (*wall*). Rounds are interleaved, the order reversed every other round; the table
gives medians over rounds and each side's ratio to the warm one (median of per-round ratios).

It also times what a worker imports cold (the modules the warm server preloads,
``gridtrain.runtime.warm.PRELOAD``), in a fresh interpreter each round.

``--before DIR`` adds a third side: the same command run from another checkout of
gridtrain (``PYTHONPATH=DIR``), e.g. the commit before warm workers, whose imports are
timed the same way.

Run from the repository root::

    python3 benchmarks/startup.py                      # ~2 min on 2 CPU cores
    python3 benchmarks/startup.py --nproc 1 --rounds 1 --steps 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = {"warm (forkserver)": "forkserver", "cold (spawn)": "spawn"}
IMPORTS = ("import time; t = time.perf_counter(); import gridtrain.cli.commands, torch._dynamo; "
           "print(time.perf_counter() - t)")  # what warm.PRELOAD names (asserted in main)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=8, help="worker processes (default: %(default)s)")
    p.add_argument("--steps", type=int, default=2, help="training steps per run (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--before", metavar="DIR", help="also run the command from this checkout of gridtrain")
    return p.parse_args(argv)


def sides(opts: argparse.Namespace) -> dict[str, tuple[dict[str, str], Path]]:
    """side -> (environment it runs with, the folder it runs in: the checkout it imports)."""
    out = {name: ({"GRIDTRAIN_START_METHOD": method}, ROOT) for name, method in SIDES.items()}
    if opts.before:
        before = Path(opts.before).resolve()
        out[f"before ({opts.before})"] = ({"PYTHONPATH": str(before)}, before)
    return out


def command(nproc: int, steps: int, metrics: Path) -> list[str]:
    return [sys.executable, "-m", "gridtrain", "train", "--nproc", str(nproc), "--dp", str(nproc), "--model", "tiny",
            "--steps", str(steps), "--global-batch-size", str(2 * nproc), "--micro-batch-size", "2",
            "--eval-interval", "0", "--sample-tokens", "0", "--no-progress", "--metrics-file", str(metrics)]


def run_once(side: str, extra_env: dict[str, str], cwd: Path, opts: argparse.Namespace,
             folder: Path) -> dict[str, float]:
    """One command: seconds to the first metrics row and to the exit."""
    metrics = folder / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = {**os.environ, **extra_env}
    began = time.perf_counter()
    proc = subprocess.Popen(command(opts.nproc, opts.steps, metrics), cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None:
        if first is None and metrics.is_file() and metrics.read_text().strip():
            first = time.perf_counter() - began
        time.sleep(0.005)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"startup: the {side} run failed (exit {proc.returncode}):\n{proc.stderr.read()[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    if first is None:  # the run ended between two polls of a step's row
        first = wall
    return {"first": first, "wall": wall, "loss": rows[-1]["loss"]}


def import_seconds(extra_env: dict[str, str], cwd: Path) -> float:
    out = subprocess.run([sys.executable, "-c", IMPORTS], cwd=cwd, capture_output=True, text=True, check=True,
                         env={**os.environ, **extra_env})
    return float(out.stdout.strip())


def main(argv=None) -> int:
    opts = parse_args(argv)
    from gridtrain.runtime import warm

    assert warm.PRELOAD == ["gridtrain.cli.commands", "torch._dynamo"], "IMPORTS times another list than the preload"
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    envs = sides(opts)
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in envs}
    imports: dict[str, list[float]] = {"this checkout": [], **({"before": []} if opts.before else {})}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(opts.rounds):
            order = list(envs) if round_ % 2 == 0 else list(envs)[::-1]
            for side in order:
                runs[side].append(run_once(side, *envs[side], opts, Path(tmp)))
            imports["this checkout"].append(import_seconds({}, ROOT))
            if opts.before:
                imports["before"].append(import_seconds(*envs[list(envs)[-1]]))
    losses = {side: [r["loss"] for r in rs] for side, rs in runs.items()}
    if len({tuple(v) for v in losses.values()}) != 1:
        raise SystemExit(f"startup: the sides trained different losses: {losses}")
    warm_runs = runs["warm (forkserver)"]
    print(f"command: {' '.join(command(opts.nproc, opts.steps, Path('F'))[1:])}")
    print(f"machine: {os.cpu_count()} CPU cores, {platform.python_implementation()} {platform.python_version()}; "
          f"1-min load average {load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end; {opts.rounds} rounds")
    for name, seconds in imports.items():
        print(f"a worker's imports, cold, {name}: {statistics.median(seconds):.2f} s "
              f"(median of {len(seconds)} fresh interpreters)")
    print()
    print("| side | first step | wall | this side / warm (first step) |")
    print("| --- | --- | --- | --- |")
    for side, rs in runs.items():
        ratio = statistics.median(r["first"] / w["first"] for r, w in zip(rs, warm_runs))
        print(f"| {side} | {statistics.median(r['first'] for r in rs):.2f} s | "
              f"{statistics.median(r['wall'] for r in rs):.2f} s | {ratio:.2f}x |")
    print(f"\nwall time {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
