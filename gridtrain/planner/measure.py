"""``gridtrain plan --measure``: run predicted CPU layouts here and put the measured step
time beside the prediction.

Each layout runs as its own ``gridtrain train --nproc N`` (the command the plan prints,
local workers instead of torchrun) for a few steps on the built-in corpus; the measured
step time is the median ``step_time_s`` of the metrics file's steps after the first
(warm-up: allocation, first-touch, the profile of lazily built kernels).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gridtrain.planner.cost import Prediction

MAX_WORLD = 8


@dataclass
class Measured:
    prediction: Prediction
    step_time_s: float

    @property
    def ratio(self) -> float:
        return self.prediction.step_time_s / self.step_time_s


def train_args(model_args: list[str], p: Prediction, global_batch_size: int, seq_len: int, dtype: str,
               steps: int) -> list[str]:
    lay = p.layout
    args = ["train", *model_args, "--nproc", str(p.gpus), "--tp", str(lay.tp), "--pp", str(lay.pp),
            "--seq-len", str(seq_len), "--global-batch-size", str(global_batch_size),
            "--micro-batch-size", str(lay.micro_batch_size), "--schedule", lay.schedule,
            "--recompute", lay.recompute, "--dtype", dtype, "--steps", str(steps), "--device", "cpu",
            "--eval-interval", "0", "--eval-iters", "1", "--no-progress", "--sample-tokens", "0", "--dropout", "0"]
    if lay.vpp > 1:
        args += ["--vpp", str(lay.vpp)]
    if lay.cp > 1:
        args += ["--cp", str(lay.cp), "--cp-comm", lay.cp_comm]
    if lay.ep > 1:
        args += ["--ep", str(lay.ep)]
    if lay.etp > 1:
        args += ["--etp", str(lay.etp)]
    if lay.sequence_parallel:
        args.append("--sequence-parallel")
    return args + lay.zero_flags() + p.fp8_flags()


def measure_one(args: list[str], timeout_s: float = 600) -> float:
    """Median step time (after the first step) of one ``gridtrain`` run."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        done = subprocess.run([sys.executable, "-m", "gridtrain", *args, "--metrics-file", str(metrics)],
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"gridtrain {' '.join(args)} failed: {done.stderr.strip()[-500:]}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return statistics.median(r["step_time_s"] for r in rows[1:] or rows)


def measure(model_args: list[str], predictions: list[Prediction], global_batch_size: int, seq_len: int,
            dtype: str, steps: int = 6) -> list[Measured]:
    out = []
    for p in predictions:
        if p.gpus > MAX_WORLD:
            raise ValueError(f"--measure runs at most {MAX_WORLD} local processes; --gpus {p.gpus} is too many")
        out.append(Measured(p, measure_one(train_args(model_args, p, global_batch_size, seq_len, dtype, steps))))
    return out


def table(results: list[Measured]) -> list[str]:
    lines = ["| layout | predicted s/step | measured s/step | predicted / measured |", "| --- | ---: | ---: | ---: |"]
    for r in results:
        lay = r.prediction.layout
        name = (f"dp {lay.dp} tp {lay.tp} pp {lay.pp}" + (f" vpp {lay.vpp}" if lay.vpp > 1 else "")
                + f" mb {lay.micro_batch_size} {lay.schedule} {lay.recompute}"
                + (" SP" if lay.sequence_parallel else "") + (f" {lay.zero_name()}" if lay.zero else ""))
        lines.append(f"| {name} | {r.prediction.step_time_s:.4f} | {r.step_time_s:.4f} | {r.ratio:.3f} |")
    return lines
