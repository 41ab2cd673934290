"""Where per-step metrics go: JSON lines, the progress bar, optional TensorBoard scalars;
and the throughput they add up to. (What is reported, and the closing summary, is
reporting.py's business.)

Only the logging rank (the last pipeline stage's first DP/TP rank, which holds the loss)
writes; every other rank gets a logger that does nothing, so the loop never branches.
TensorBoard is optional (the ``tensorboard`` extra): it is imported only when a run asks
for it, so the package trains without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

MISSING_TENSORBOARD = ('--tensorboard needs the tensorboard package; '
                       'pip install tensorboard (or pip install -e ".[tensorboard]")')

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


def require_tensorboard() -> None:
    """Raise a one-line ImportError unless the ``tensorboard`` package can be imported."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ImportError(MISSING_TENSORBOARD) from None


def tensorboard_scalars(record: StepRecord, extra: dict | None = None) -> dict[str, float]:
    """The TensorBoard tag -> value pairs of one step's metrics line."""
    extra = extra or {}
    scalars = {f"train/{name}": float(getattr(record, name))
               for name in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "tokens")}
    if extra.get("valid_loss") is not None:
        scalars["valid/loss"] = float(extra["valid_loss"])
    for name, value in (extra.get("valid_loss_by_source") or {}).items():
        if value is not None:  # None: no token of that source's validation batches carried a loss
            scalars[f"valid/{name}/loss"] = float(value)
    if extra.get("loss_scale") is not None:
        scalars["train/loss_scale"] = float(extra["loss_scale"])
    if extra.get("mtp_loss") is not None:
        scalars["train/mtp_loss"] = float(extra["mtp_loss"])
    for group, n in (extra.get("comm_bytes") or {}).items():
        scalars[f"comm_bytes/{group}"] = float(n)
    for layer, r in (extra.get("moe") or {}).items():
        scalars[f"moe/layer{layer}/max_load"] = float(r["max_load"])
        scalars[f"moe/layer{layer}/aux_loss"] = float(r["aux_loss"])
        if "seq_aux_loss" in r:
            scalars[f"moe/layer{layer}/seq_aux_loss"] = float(r["seq_aux_loss"])
    return scalars


class MetricsLogger:
    """JSON lines file, optional TensorBoard scalars and a tqdm bar on the logging rank;
    silent elsewhere."""

    def __init__(self, active: bool, metrics_file: str | None, total_steps: int,
                 start_step: int, show_progress: bool, tensorboard: str | None = None):
        self.active = active
        self._file = None
        self._bar = None
        self._writer = None
        if not active:
            return
        if tensorboard:  # first: a missing package must not truncate the metrics file
            self._writer = _summary_writer(tensorboard)
        if metrics_file:
            self._file = open_metrics_file(metrics_file, start_step)
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
        if self._writer is not None:
            for tag, value in tensorboard_scalars(record, extra).items():
                self._writer.add_scalar(tag, value, global_step=record.step)
        bar = self._progress()
        load = {"load": f"{extra['max_load']:.2f}"} if extra and "max_load" in extra else {}  # MoE: max/mean
        mtp = {"mtp": f"{extra['mtp_loss']:.4f}"} if extra and extra.get("mtp_loss") is not None else {}
        bar.set_postfix(loss=f"{record.loss:.4f}", **mtp, tok_s=f"{record.tokens_per_s:,.0f}", **load, refresh=False)
        bar.update(1)

    def print(self, message: str) -> None:
        if self.active:
            tqdm.write(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


def open_metrics_file(path: str, start_step: int):
    """The metrics file, ready to append the rows after ``start_step``.

    A fresh run (``start_step`` 0) starts an empty file. A resumed run keeps the rows of
    the steps its checkpoint includes and drops any later ones, which the run that
    crashed or was preempted wrote after its last checkpoint and which this run is about
    to train again: every step appears once, whatever happened in between. The kept rows
    are written to a temporary file that replaces the old one, so a crash here loses
    nothing.
    """
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    if start_step and file.is_file():
        kept = [line for line in file.read_text().splitlines(keepends=True) if _row_step(line) <= start_step]
        tmp = file.with_name(f".{file.name}.tmp")
        tmp.write_text("".join(kept))
        tmp.replace(file)
    return open(file, "a" if start_step else "w")


def _row_step(line: str) -> float:
    """The step of one metrics line; a damaged line (a crash mid-write) sorts last, to be dropped."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


def _summary_writer(logdir: str):
    """A TensorBoard SummaryWriter for ``logdir``, imported only here."""
    require_tensorboard()
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=logdir)
