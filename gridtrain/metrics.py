"""What a run reports: per-step JSON lines, the progress bar and the closing summary.

Only the logging rank (the last pipeline stage's first DP/TP rank, which holds the loss)
writes; every other rank gets a logger that does nothing, so the loop never branches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

# Dense bf16 peak TFLOP/s per device, from vendor data sheets (SXM parts).
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0}


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """The device's peak for MFU, or None when unknown (CPUs, unlisted GPUs)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


@dataclass
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int  # tokens consumed so far, all ranks together
    step_time_s: float
    tokens_per_s: float

    def as_json(self, extra: dict | None = None) -> str:
        row = dict(self.__dict__)
        row.update(extra or {})
        return json.dumps(row)


@dataclass
class RunStats:
    """Throughput over the steady part of the run (the first step warms up and is left out)."""

    flops_per_token: float
    world_size: int
    records: list[StepRecord] = field(default_factory=list)

    def steady(self) -> list[StepRecord]:
        return self.records[1:] if len(self.records) > 1 else self.records

    def tokens_per_s(self) -> float:
        rows = self.steady()
        seconds = sum(r.step_time_s for r in rows)
        tokens = sum(r.tokens_per_s * r.step_time_s for r in rows)
        return tokens / seconds if seconds > 0 else 0.0

    def tflops_per_device(self) -> float:
        return self.tokens_per_s() * self.flops_per_token / self.world_size / 1e12


class MetricsLogger:
    """JSON lines file plus a tqdm bar on the logging rank; silent elsewhere."""

    def __init__(self, active: bool, metrics_file: str | None, total_steps: int,
                 start_step: int, show_progress: bool):
        self.active = active
        self._file = None
        self._bar = None
        if not active:
            return
        if metrics_file:
            Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(metrics_file, "a" if start_step else "w")
        self._bar_args = dict(total=total_steps, initial=start_step, disable=not show_progress,
                              dynamic_ncols=True, desc="train", unit="step")

    def _progress(self) -> tqdm:
        """Created at the first step so that set-up messages print above the bar."""
        if self._bar is None:
            self._bar = tqdm(**self._bar_args)
        return self._bar

    def step(self, record: StepRecord, extra: dict | None = None) -> None:
        if not self.active:
            return
        if self._file:
            self._file.write(record.as_json(extra) + "\n")
            self._file.flush()
        bar = self._progress()
        bar.set_postfix(loss=f"{record.loss:.4f}", tok_s=f"{record.tokens_per_s:,.0f}", refresh=False)
        bar.update(1)

    def print(self, message: str) -> None:
        if self.active:
            tqdm.write(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
