"""Muon against AdamW on the built-in corpus: steps to AdamW's final validation loss, step
time, and bf16 optimizer states against fp32 ones.

Every run is the whole ``gridtrain train`` loop on one process (the same model, data,
seed, batch and schedule; only the optimizer flags differ), its metrics file read
afterwards. Three comparisons, the runs of each interleaved (A B, then B A):

1. **convergence** (``--steps``, the ``small`` preset): the validation loss every
   ``--eval-interval`` steps; the ratio is the first step at which Muon's validation loss
   is at or below AdamW's final one, over AdamW's steps (below 1: Muon gets there sooner);
2. **step time** at ``--time-d-model`` (default 512): the median step time after the
   first ``--time-warmup`` steps, Muon over AdamW, over ``--rounds`` rounds;
3. **bf16 states**: ``--optimizer-state-dtype bf16`` against fp32 for each optimizer,
   the final training loss's relative difference after ``--steps`` steps.

    python3 benchmarks/muon.py                 # ~6 min on 2 CPU cores
    python3 benchmarks/muon.py --steps 100     # a quick look

AdamW runs at ``--lr``; Muon at its default rate for that ``--lr`` (0.2 x sqrt(d_model) x
lr for the ``original`` adjustment: docs/optimizers.md), AdamW for its other parameters
at ``--lr``. Timings depend on the machine; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="steps of the convergence runs (default: %(default)s)")
    p.add_argument("--eval-interval", type=int, default=20, help="(default: %(default)s)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW's peak rate (default: %(default)s)")
    p.add_argument("--model", default="small", help="preset of the convergence runs (default: %(default)s)")
    p.add_argument("--time-d-model", type=int, default=512, help="width of the timing runs (default: %(default)s)")
    p.add_argument("--time-steps", type=int, default=12, help="steps per timing run (default: %(default)s)")
    p.add_argument("--time-warmup", type=int, default=2, help="steps left out of the median (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="timing rounds (default: %(default)s)")
    return p.parse_args(argv)


def train(args: list[str], metrics: Path) -> list[dict]:
    """One ``gridtrain train`` run; its metrics rows."""
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "gridtrain", "train", *args, "--no-progress", "--sample-tokens", "0",
           "--metrics-file", str(metrics)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[2:])}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def interleaved(sides: dict[str, list[str]], rounds: int, metrics: Path) -> dict[str, list[list[dict]]]:
    """Each side's runs, ``rounds`` of them, the order reversed every other round."""
    out: dict[str, list[list[dict]]] = {name: [] for name in sides}
    order = list(sides)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            began = time.perf_counter()
            out[name].append(train(sides[name], metrics))
            print(f"  {name}: {time.perf_counter() - began:.0f} s", flush=True)
    return out


def valid_curve(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["valid_loss"]) for r in rows if r.get("valid_loss") is not None]


def main(argv=None) -> int:
    o = parse_args(argv)
    common = ["--model", o.model, "--steps", str(o.steps), "--lr", str(o.lr), "--eval-interval",
              str(o.eval_interval), "--seed", "1234"]
    adamw, muon = ["--optimizer", "adamw"], ["--optimizer", "muon"]
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        print(f"1. convergence: gridtrain train {' '.join(common)} [--optimizer adamw | muon]")
        runs = interleaved({"adamw": common + adamw, "muon": common + muon}, 1, metrics)
        a, m = valid_curve(runs["adamw"][0]), valid_curve(runs["muon"][0])
        target = a[-1][1]
        reached = next((step for step, loss in m if loss <= target), None)
        print(f"   validation loss at the end: adamw {target:.4f}, muon {m[-1][1]:.4f} nats/byte")
        print("   step:  " + " ".join(f"{s:>6}" for s, _ in a))
        print("   adamw: " + " ".join(f"{v:6.3f}" for _, v in a))
        print("   muon:  " + " ".join(f"{v:6.3f}" for _, v in m))
        if reached is None:
            print(f"   muon did not reach adamw's final validation loss in {o.steps} steps")
        else:
            print(f"   muon reaches adamw's final validation loss at step {reached}: "
                  f"{reached / a[-1][0]:.2f} of adamw's steps")

        timing = ["--model", o.model, "--d-model", str(o.time_d_model), "--n-head", str(o.time_d_model // 64),
                  "--steps", str(o.time_steps), "--eval-interval", "0"]
        print(f"2. step time: gridtrain train {' '.join(timing)} [--optimizer adamw | muon]")
        runs = interleaved({"adamw": timing + adamw, "muon": timing + muon}, o.rounds, metrics)
        med = {name: [statistics.median(r["step_time_s"] for r in rows[o.time_warmup:]) for rows in rs]
               for name, rs in runs.items()}
        ratios = [mu / ad for mu, ad in zip(med["muon"], med["adamw"])]
        for name, values in med.items():
            print(f"   {name}: median step {statistics.median(values) * 1e3:.1f} ms "
                  f"(rounds {', '.join(f'{v * 1e3:.1f}' for v in values)})")
        print(f"   muon / adamw step time: {statistics.median(ratios):.3f} "
              f"(rounds {', '.join(f'{r:.3f}' for r in ratios)})")

        print(f"3. bf16 states: gridtrain train {' '.join(common)} --optimizer O "
              "[--optimizer-state-dtype fp32 | bf16]")
        for name, flags in (("adamw", adamw), ("muon", muon)):
            runs = interleaved({"fp32": common + flags, "bf16": common + flags + ["--optimizer-state-dtype", "bf16"]},
                               1, metrics)
            full, half = runs["fp32"][0][-1]["loss"], runs["bf16"][0][-1]["loss"]
            print(f"   {name}: final training loss fp32 states {full:.4f}, bf16 states {half:.4f}: "
                  f"{100 * abs(half - full) / full:.2f}% apart")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
