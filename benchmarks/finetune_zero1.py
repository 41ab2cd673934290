"""ZeRO-1 step time with fine-tuning data, this checkout against another (``--before DIR``).

Fine-tuning data (prompt/completion JSON lines) leaves some labels out of the loss, so
the step must know the global batch's loss-bearing tokens before backward. Counted in
the step, that is an all-reduce over dp x cp and a host read, issued before the forward
on the communicator where ZeRO-1 left the last step's parameter gathers in flight: the
host waits for every gather before the forward instead of letting them hide behind it.
Counted by the data on the host (``data.datasets.count_loss_tokens``), the step issues
nothing before its forward.

Both sides run the same command, ``gridtrain train --nproc 2 --dp 2 --zero 1`` on the
same generated fine-tuning file (a GPT-2-shaped model, fp32), alternating in rounds; the
time of a side is the median step time of its metrics file after the first step. The
ratio is before / this (above 1: this checkout is faster).

Run from the repository root::

    git worktree add /tmp/before <commit> && ln -s $PWD/.venv /tmp/before/.venv
    python3 benchmarks/finetune_zero1.py --before /tmp/before     # ~4 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", metavar="DIR", help="the other checkout of gridtrain (PYTHONPATH=DIR)")
    p.add_argument("--rounds", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--steps", type=int, default=12, help="steps per run (default: %(default)s)")
    p.add_argument("--n-layer", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--d-model", type=int, default=384, help="(default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=256, help="(default: %(default)s)")
    return p.parse_args(argv)


def write_examples(path: Path, count: int = 3000) -> Path:
    """Arithmetic questions and answers: a prompt that carries no loss, a short completion."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(count):
            a, b = rng.randint(0, 9999), rng.randint(0, 9999)
            f.write(json.dumps({"prompt": f"Question: what is {a} plus {b}? Answer:", "completion": f" {a + b}."})
                    + "\n")
    return path


def command(opts: argparse.Namespace, data: Path, metrics: Path) -> list[str]:
    return [sys.executable, "-m", "gridtrain", "train", "--nproc", "2", "--dp", "2", "--zero", "1",
            "--data", str(data), "--n-layer", str(opts.n_layer), "--d-model", str(opts.d_model),
            "--n-head", str(opts.d_model // 64), "--seq-len", str(opts.seq_len), "--vocab-size", "257",
            "--steps", str(opts.steps), "--global-batch-size", "8", "--micro-batch-size", "2",
            "--eval-interval", "0", "--eval-iters", "1", "--sample-tokens", "0", "--no-progress",
            "--metrics-file", str(metrics)]


def median_step_s(metrics: Path) -> float:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return statistics.median(r["step_time_s"] for r in rows[1:])


def main(argv=None) -> int:
    opts = parse_args(argv)
    sides = {"this checkout": ROOT}
    if opts.before:
        sides["--before"] = Path(opts.before).resolve()
    times: dict[str, list[float]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_examples(Path(tmp) / "sums.jsonl")
        print("command:", " ".join(command(opts, Path("sums.jsonl"), Path("metrics.jsonl"))[2:]))
        order = list(sides)
        for round_ in range(opts.rounds):
            for side in order if round_ % 2 == 0 else order[::-1]:
                metrics = Path(tmp) / "metrics.jsonl"
                metrics.unlink(missing_ok=True)
                done = subprocess.run(command(opts, data, metrics), cwd=sides[side], capture_output=True, text=True,
                                      env={**os.environ, "PYTHONPATH": str(sides[side])})
                if done.returncode != 0:
                    print(f"{side}: exit {done.returncode}\n{done.stderr[-2000:]}")
                    return 1
                times[side].append(median_step_s(metrics))
                print(f"  round {round_ + 1}: {side}: {times[side][-1] * 1e3:.1f} ms per step", flush=True)
    for side, values in times.items():
        print(f"{side:<16} median step {statistics.median(values) * 1e3:.1f} ms "
              f"(rounds {', '.join(f'{v * 1e3:.1f}' for v in values)})")
    if opts.before:
        ratios = [b / t for b, t in zip(times["--before"], times["this checkout"])]
        print(f"before / this: {statistics.median(ratios):.3f}x (rounds {', '.join(f'{r:.3f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
