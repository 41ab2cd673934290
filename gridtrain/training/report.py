"""What a run reports: per-step records, and the summary, memory report, pipeline idle
fractions and traces at the end.

The training loop (train.py) hands a :class:`RunReport` what each step did; the report
keeps the numbers (:class:`TrainResult`, returned to the caller), writes the per-step
metrics (metrics.py: JSON lines, progress bar, TensorBoard), counts the payload bytes
each step moved per process group, measures saved-activation memory on the first step
(runtime/activation_meter.py; the memory report prints it beside the memory model's
per-layer formula, memory/activations.py), takes the start-up's time and every rank's
peak memory when the first step begins (runtime/startup.py; in the first step's record
and the summary) and prints the closing summary. Only the
logging rank prints; every rank keeps its own numbers, and the end-of-run gathers (idle
fractions, memory per stage) are collective over the pipeline group, so every rank
calls :meth:`RunReport.finish`.
"""

from __future__ import annotations

import math

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from gridtrain import checkpoint
from gridtrain.config import Config, ModelConfig
from gridtrain.memory.activations import dropout_mask_bytes, expected_by_layer, layer_shape
from gridtrain.parallel.comm import CommGroup
from gridtrain.parallel.zero3 import whole_shape
from gridtrain.parallel.distributed import DistributedContext
from gridtrain.parallel.experts import LayerRouting
from gridtrain.training.metrics import MetricsLogger, RunStats, StepRecord, peak_tflops
from gridtrain.models.decoder import training_flops_per_token
from gridtrain.optim.schedules import resume_note, schedule_in_meta, schedule_of
from gridtrain.runtime.activation_meter import ActivationMeter, saved_activations
from gridtrain.runtime.startup import Startup, StartupClock, host_peak_bytes
from gridtrain.training.trainer import StepOutput, Trainer


@dataclass
class TrainResult:
    ctx: DistributedContext
    model: nn.Module
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    valid_loss: float | None = None
    valid_by_source: dict[str, float] = field(default_factory=dict)  # the last validation, per named set
    tokens_per_s: float = 0.0
    step_bytes: list[dict[str, int]] = field(default_factory=list)  # "kind/group" -> bytes, per step
    step_calls: list[dict[str, int]] = field(default_factory=list)  # "kind/group" -> collectives, per step
    peak_in_flight: int = 0  # most micro-batch chunks whose activations this stage held
    stage_busy_s: float = 0.0  # time this stage spent computing (F, B, W) ...
    stage_wall_s: float = 0.0  # ... out of the time its schedule took
    overlap: list[float] = field(default_factory=list)  # DP all-reduce hidden behind backward, per step
    cp_overlap: list[tuple[float, float]] = field(default_factory=list)  # cp transfers: (hidden fraction, exposed s)
    skipped_steps: int = 0  # fp16 steps skipped on gradient overflow
    trace_events: list[tuple[int, str, float, float]] = field(default_factory=list)  # (step, action, start, end)
    memory: list[StageMemory] = field(default_factory=list)  # every stage's, measured at step 1
    routing: list[dict[int, LayerRouting]] = field(default_factory=list)  # MoE layers' routing, per step
    mtp_losses: list[float] = field(default_factory=list)  # multi-token prediction's loss, per step (if any)
    startup: Startup | None = None  # the launch to the first step, every rank's peak memory by then
    # ZeRO-3's parameters stay sharded after the run: this makes them whole (Trainer.gather_weights)
    gather_weights: Callable[[], None] = lambda: None


class RunReport:
    def __init__(self, trainer: Trainer, clock: StartupClock | None = None):
        self.trainer = trainer
        self.clock = clock  # the start-up's stamps, closed when the first step begins
        cfg, ctx, t, r = trainer.cfg, trainer.ctx, trainer.cfg.training, trainer.cfg.metrics
        model = trainer.model
        self.log = MetricsLogger(ctx.is_logging_rank, r.metrics_file, t.steps, trainer.start_step, r.progress,
                                 tensorboard=r.tensorboard)
        self.stats = RunStats(flops_per_token=_flops_per_token(model), world_size=ctx.grid.world_size)
        self.result = TrainResult(ctx=ctx, model=model, gather_weights=trainer.gather_weights)
        self.step_tokens = trainer.step_tokens
        self.tokens_seen = trainer.start_step * self.step_tokens
        self.offload = cfg.activations.offload_activations and ctx.device.type == "cuda"
        self.stage_memory: StageMemory | None = None  # this stage's, from the first step
        self.validated = False  # whether any validation ran (its value may be None: no loss-bearing token)
        self._bytes_before: dict = {}  # the byte and call counters when the current step began ...
        self._calls_before: dict = {}
        self._elapsed = 0.0  # ... and the seconds it took
        self._startup_pending = False  # the first step's record carries the start-up
        if cfg.activations.offload_activations and not self.offload:
            self.log.print("--offload-activations: activations already live in host memory on the CPU; "
                           "nothing to offload")
        self.log.print(f"gridtrain: {ctx.grid.describe()}, {_count(model):,} parameters per rank, "
                       f"{trainer.num_micro_batches} micro-batches of {t.micro_batch_size} per step, "
                       f"device {ctx.device.type}, dtype {t.dtype}")
        if trainer.resumed_from is not None:
            self.log.print(f"resuming from {trainer.resumed_from} after step {trainer.start_step}")
            note = _schedule_note(trainer) if ctx.is_logging_rank else None
            if note:
                self.log.print(note)
        elif cfg.checkpoint.auto_resume and cfg.checkpoint.save:
            self.log.print(f"--auto-resume: no checkpoint in {cfg.checkpoint.save} yet; starting from step 0")
        for line in _data_lines(trainer):
            self.log.print(line)

    # ---- per step --------------------------------------------------------------------------

    @contextlib.contextmanager
    def step_window(self, first: bool):
        """Around one step's reading and training: its time and bytes; on the ``first``
        step (the counts repeat) the bytes saved for backward, per layer."""
        trainer = self.trainer
        counter = trainer.ctx.bytes
        if first and self.clock is not None:  # before the step resets the device's peak
            self.result.startup, self._startup_pending = _startup(self.clock, trainer.ctx), True
        began, self._bytes_before, self._calls_before = time.perf_counter(), dict(counter.bytes), dict(counter.calls)
        meter = ActivationMeter.for_model(trainer.model) if first or self.offload else None
        with saved_activations(meter, self.offload), _device_peak(trainer.ctx.device, first) as peak:
            yield
        if first:
            self.stage_memory = _stage_memory(meter, peak[0], trainer)
        self._elapsed = time.perf_counter() - began

    def step(self, step: int, lr: float, out: StepOutput, valid_loss: float | None, validated: bool = False) -> None:
        """Keep and log the step that :meth:`step_window` just measured."""
        trainer, result = self.trainer, self.result
        self.tokens_seen += self.step_tokens
        record = StepRecord(step=step, loss=out.loss, grad_norm=out.grad_norm, lr=lr, tokens=self.tokens_seen,
                            step_time_s=self._elapsed, tokens_per_s=self.step_tokens / self._elapsed)
        self.stats.records.append(record)
        result.losses.append(out.loss)
        result.grad_norms.append(out.grad_norm)
        result.overlap.append(trainer.reducer.stats.fraction)
        result.cp_overlap.append(trainer.ctx.cp.transfers.take())
        result.peak_in_flight = max(result.peak_in_flight, out.stage.peak_in_flight)
        result.stage_busy_s += out.stage.busy_s
        result.stage_wall_s += out.stage.wall_s
        result.trace_events += [(step, *event) for event in out.stage.trace]
        result.step_bytes.append(_since(self._bytes_before, trainer.ctx.bytes.bytes))
        result.step_calls.append(_since(self._calls_before, trainer.ctx.bytes.calls))
        extra = {"comm_bytes": bytes_by_group(result.step_bytes[-1])}
        if self._startup_pending:
            extra["startup"], self._startup_pending = result.startup.as_json(), False
        result.routing.append(out.routing)
        if out.mtp_loss is not None:  # apart from ``loss``, which stays the main head's
            result.mtp_losses.append(extra.setdefault("mtp_loss", out.mtp_loss))
        if out.routing:
            extra["moe"] = {str(layer): r.as_json() for layer, r in out.routing.items()}
            extra["max_load"] = max(r.max_load for r in out.routing.values())  # the busiest layer's (plotted)
        if trainer.scaler is not None:
            extra["loss_scale"] = trainer.scaler.scale
            result.skipped_steps = trainer.scaler.skipped
        for source, epoch in _wraps(trainer, step):
            self.log.print(f"data: source {source} ran out during step {step}; epoch {epoch + 1} of it begins "
                           "(a new shuffle)")
        if validated:
            self.validated = True
            result.valid_loss = extra["valid_loss"] = valid_loss
            by_source = trainer.valid_by_source
            if by_source:
                extra["valid_loss_by_source"] = dict(by_source)
            self.log.print(f"step {step}: train loss {out.loss:.4f}, valid loss {loss_text(valid_loss)}"
                           + "".join(f", {name} {loss_text(v)}" for name, v in by_source.items()))
        self.log.step(record, extra)

    def end_of_steps(self) -> None:
        self.log.close()

    # ---- at the end --------------------------------------------------------------------------

    def finish(self, valid_loss: float | None, validated: bool = False) -> TrainResult:
        """The run's result; writes traces and prints the summary (collective over PP)."""
        trainer, result = self.trainer, self.result
        ctx, r = trainer.ctx, trainer.cfg.metrics
        if validated:
            result.valid_loss = valid_loss
            self.validated = True
        result.valid_by_source = dict(trainer.valid_by_source)
        result.tokens_per_s = self.stats.tokens_per_s()
        if r.trace:
            Path(r.trace).mkdir(parents=True, exist_ok=True)
            write_chrome_trace(Path(r.trace) / f"rank{ctx.rank:03d}.json", result.trace_events, ctx.rank,
                               ctx.coords.pp)
        idle = _stage_idle_fractions(result, ctx)
        if self.stage_memory is not None:
            result.memory = _gather_stage_memory(self.stage_memory, ctx)
        self._print_summary()
        if result.memory:
            self.log.print(summary_line(result.memory))
            if r.memory_report:
                for line in report_lines(result.memory, _memory_note(trainer.cfg, ctx)):
                    self.log.print(line)
        if ctx.grid.pp > 1:
            self.log.print("pipeline: measured idle fraction per stage " +
                           ", ".join(f"{s}: {f:.3f}" for s, f in enumerate(idle)) +
                           f"; peak micro-batches held on this stage {result.peak_in_flight}")
        return result

    def _print_summary(self) -> None:
        stats, result, log = self.stats, self.result, self.log
        ctx, data = self.trainer.ctx, self.trainer.data
        if not stats.records:
            return
        tflops = stats.tflops_per_device()
        peak = peak_tflops(ctx.device, self.trainer.cfg.metrics.peak_tflops)
        mfu = f"MFU {100 * tflops / peak:.1f}% of {peak:g} TFLOP/s" if peak else \
            f"MFU n/a (no known peak for {ctx.device.type}; pass --peak-tflops)"
        if peak and self.trainer.cfg.training.fp8 != "none":
            mfu = mfu_fp8_line(tflops, peak, fp8_peak_tflops(ctx.device))
        log.print(f"throughput: {stats.tokens_per_s():,.0f} tokens/s, {tflops:.4f} TFLOP/s per device "
                  f"({stats.flops_per_token / 1e6:.2f} MFLOP per token), {mfu}")
        if result.startup is not None:
            log.print(startup_line(result.startup))
        if ctx.grid.dp > 1 and len(result.overlap) > 1:
            steady = result.overlap[1:]
            log.print(f"data parallel: {100 * sum(steady) / len(steady):.0f}% of gradient all-reduce time "
                      "hidden behind backward (mean over steps after the first)")
        if ctx.cp.size > 1 and len(result.cp_overlap) > 1:
            steady = result.cp_overlap[1:]
            log.print(f"context parallel ({ctx.cp.mode}): {100 * sum(h for h, _ in steady) / len(steady):.0f}% of "
                      f"the attention's transfer time hidden behind attention, "
                      f"{1000 * sum(e for _, e in steady) / len(steady):.1f} ms exposed per step "
                      "(mean over steps after the first)")
        moved = bytes_by_group(result.step_bytes[-1]) if result.step_bytes else {}
        if moved:
            log.print("communication per step (payload bytes, this rank): " +
                      ", ".join(f"{g} {format_bytes(n)}" for g, n in sorted(moved.items())))
        if result.routing and result.routing[-1]:
            log.print(routing_summary(result.routing))
        if ctx.dtype == "fp16":
            log.print(f"fp16: {result.skipped_steps} step(s) skipped on gradient overflow")
        if self.trainer.saves:
            log.print(save_summary(self.trainer.saves, self.trainer.saver is not None))
        log.print(f"final train loss {result.losses[-1]:.4f} {data.loss_unit}")
        if self.validated:
            if log.active and result.valid_loss is None:
                log.print("validation loss n/a (no token of the validation batches carries a loss)")
            elif log.active:  # the reference may be a pass over the corpus: only where it is printed
                reference = data.reference_loss() if callable(data.reference_loss) else data.reference_loss
                ref = "" if reference is None else f" (corpus unigram entropy {reference:.4f} {data.loss_unit})"
                log.print(f"validation loss {result.valid_loss:.4f} {data.loss_unit}{ref}")
            if self.trainer.valid_by_source:
                log.print("validation loss per source: " + ", ".join(
                    f"{name} {loss_text(v)}" for name, v in self.trainer.valid_by_source.items()))
        epochs = _epochs_line(self.trainer, self.trainer.start_step + len(stats.records))
        if epochs:
            log.print(epochs)


def loss_text(value: float | None) -> str:
    """A validation loss as printed: n/a where no token carried a loss."""
    return "n/a" if value is None else f"{value:.4f}"


def _schedule_note(trainer: Trainer) -> str | None:
    """One line when the resumed run's learning-rate schedule is not the checkpoint's run's
    (allowed: e.g. a WSD run extended in its stable phase decays later)."""
    try:  # the checkpoint was loaded already: a meta.json that cannot be read now costs the note only
        saved = schedule_in_meta(checkpoint.read_meta(trainer.resumed_from))
    except (checkpoint.CheckpointError, OSError, ValueError):
        return None
    run = schedule_of(trainer.cfg.optim, trainer.cfg.training.steps)
    return resume_note(saved, run, trainer.start_step) if saved is not None else None


def _data_lines(trainer: Trainer) -> list[str]:
    """What the run says about its data at the start: the mixture and its sources'
    notes (fine-tuning examples packed, truncated), and a changed mixture on resume."""
    data, sampler = trainer.data, trainer.sampler
    if data is None:
        return []
    lines = list(data.notes) + list(trainer.notes)
    names = trainer.source_names
    if sampler is not None and len(names) > 1:
        lines.insert(0, "data mixture: " + ", ".join(
            f"{name} {w:.3g} ({n:,} samples)" for name, w, n in zip(names, sampler.weights, sampler.sizes)))
    return lines


def _wraps(trainer: Trainer, step: int) -> list[tuple[str, int]]:
    """The training sources that began a new epoch in step ``step`` (counted from 1)."""
    sampler = trainer.sampler
    if sampler is None:
        return []
    names = trainer.source_names
    return [(names[i] or "the corpus", epoch) for i, epoch in sampler.wrapped(step - 1)]


def _epochs_line(trainer: Trainer, steps_done: int) -> str | None:
    """Epochs of each training source read by the end of the run."""
    sampler = trainer.sampler
    if sampler is None or not steps_done:
        return None
    drawn = sampler.drawn(steps_done)
    if len(drawn) == 1:
        return f"data: {drawn[0] / sampler.sizes[0]:.2f} epochs of the training set read"
    return "data: epochs read per source: " + ", ".join(
        f"{name} {d / size:.2f}" for name, d, size in zip(trainer.source_names, drawn, sampler.sizes))


def routing_summary(steps: list[dict[int, LayerRouting]]) -> str:
    """One line: each MoE layer's load (busiest expert over the mean) and load-balancing
    loss, averaged over the run's steps, and the tokens capacity dropped."""
    parts = []
    for layer in steps[-1]:
        rows = [s[layer] for s in steps if layer in s]
        load = sum(r.max_load for r in rows) / len(rows)
        aux = sum(r.aux_loss for r in rows) / len(rows)
        seq_aux = sum(r.seq_aux_loss for r in rows) / len(rows)
        dropped = sum(r.dropped for r in rows)
        parts.append(f"layer {layer} load {load:.2f}, aux {aux:.3f}" + (f", seq aux {seq_aux:.3f}" if seq_aux else "")
                     + (f", {dropped} dropped" if dropped else ""))
    return "experts (max/mean tokens per expert, load-balancing loss; mean over steps): " + "; ".join(parts)


def save_summary(saves, background: bool) -> str:
    """One line: how long checkpoints blocked training, and how long they took to write."""
    blocked = sorted(s.blocked_s for s in saves)
    written = sorted(s.write_s for s in saves)
    how = "in the background (--save-async)" if background else "synchronously"
    return (f"checkpoints: {len(saves)} saved {how}; training blocked {blocked[len(blocked) // 2]:.3f} s per save "
            f"(median; max {blocked[-1]:.3f} s, in order: {', '.join(f'{s.blocked_s:.3f}' for s in saves[:8])}"
            f"{' ...' if len(saves) > 8 else ''}), writing took {written[len(written) // 2]:.3f} s (median)")


# ---- start-up ------------------------------------------------------------------------------------

def _startup(clock: StartupClock, ctx: DistributedContext) -> Startup:
    """The start-up, as the first step begins: this rank's phases, and every rank's peak
    host and device memory so far (gathered over the world: collective)."""
    clock.stamp("loop")
    phases = clock.phases()
    host = host_peak_bytes()
    device = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else -1
    world = CommGroup.of("world", torch.distributed.group.WORLD, ctx.bytes, device=ctx.device)
    mine = torch.tensor([[-1 if host is None else host, device]], dtype=torch.float64, device=ctx.device)
    ranks = [[int(v) for v in row] for row in world.all_gather(mine, 0).tolist()]
    return Startup(time_s=sum(phases.values()), phases=phases,
                   host_peak_bytes=[h if h >= 0 else None for h, _ in ranks],
                   device_peak_bytes=[d for _, d in ranks] if ctx.device.type == "cuda" else None)


def startup_line(s: Startup) -> str:
    """One line for the run summary: the start-up's time by phase and the ranks' peak memory."""
    phases = ", ".join(f"{name.replace('_', ' ')} {seconds:.2f}" for name, seconds in s.phases.items())
    line = f"start-up: {s.time_s:.2f} s from the launch to the first step ({phases} s)"
    for what, peaks in (("host", s.host_peak_bytes), ("device", s.device_peak_bytes)):
        known = sorted((n, rank) for rank, n in enumerate(peaks or []) if n is not None)
        if not known:
            continue
        (low, low_rank), (high, high_rank) = known[0], known[-1]
        line += (f"; peak {what} memory: max {format_bytes(high)} (rank {high_rank}), min {format_bytes(low)} "
                 f"(rank {low_rank})" if len(peaks) > 1 else f"; peak {what} memory {format_bytes(high)}")
    return line


# ---- byte accounting ---------------------------------------------------------------------------

def _since(before: dict, now: dict) -> dict[str, int]:
    """What a counter ("kind/group" keys) added since ``before``, without zeros."""
    moved = {f"{k}/{g}": n - before.get((k, g), 0) for (k, g), n in now.items()}
    return {k: n for k, n in moved.items() if n}


def bytes_by_group(moved: dict[str, int]) -> dict[str, int]:
    """Payload bytes per group (tp, dp, ...) from "kind/group" keys, summed over kinds."""
    out: dict[str, int] = {}
    for key, n in moved.items():
        group = key.split("/", 1)[1]
        out[group] = out.get(group, 0) + n
    return out


def format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:g} B"


# ---- pipeline ------------------------------------------------------------------------------------

def _stage_idle_fractions(result: TrainResult, ctx: DistributedContext) -> list[float]:
    """Each pipeline stage's share of schedule time spent not computing (waiting for
    activations or gradients, or communicating), gathered over the pipeline group."""
    mine = 1.0 - result.stage_busy_s / result.stage_wall_s if result.stage_wall_s else 0.0
    if ctx.grid.pp == 1:
        return [mine]
    return [float(x) for x in ctx.pp.all_gather(torch.tensor([mine], dtype=torch.float64, device=ctx.device), 0)]


def write_chrome_trace(path, events: list[tuple[int, str, float, float]], rank: int, stage: int) -> None:
    """``events`` (step, action, start, end in perf_counter seconds) as a Chrome trace
    (chrome://tracing, Perfetto): one row per rank, one box per action."""
    origin = min((e[2] for e in events), default=0.0)
    rows = [{"name": name, "cat": name.rstrip("0123456789.") or name, "ph": "X", "pid": rank,
             "tid": stage, "ts": (start - origin) * 1e6, "dur": (end - start) * 1e6, "args": {"step": step}}
            for step, name, start, end in events]
    rows.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} (stage {stage})"}})
    with open(path, "w") as f:
        json.dump({"traceEvents": rows, "displayTimeUnit": "ms"}, f)


# ---- memory --------------------------------------------------------------------------------------

@dataclass
class StageMemory:
    """One stage's measured activation memory over a step (picklable, gathered to print)."""

    stage: int
    micro_batches: int
    kept: dict[str, int]  # layer -> bytes saved at forward, summed over the step's micro-batches
    recomputed: dict[str, int]  # layer -> bytes saved while recomputing, summed likewise
    peak_bytes: int  # most bytes held for backward at once during the step
    expected: dict[str, float] = field(default_factory=dict)  # layer -> formula, per micro-batch
    device_peak_bytes: int | None = None  # torch.cuda.max_memory_allocated over the step

    def per_micro_batch(self, layer: str) -> float:
        return self.kept.get(layer, 0) / max(1, self.micro_batches)


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def summary_line(stages: list[StageMemory]) -> str:
    """One line for the run summary: each stage's peak and per-micro-batch bytes."""
    parts = []
    for s in stages:
        device = f", device peak {_mb(s.device_peak_bytes)}" if s.device_peak_bytes is not None else ""
        parts.append(f"stage {s.stage} peak {_mb(s.peak_bytes)} "
                     f"({_mb(sum(s.kept.values()) / max(1, s.micro_batches))} per micro-batch{device})")
    return "activations saved for backward (step 1): " + "; ".join(parts)


def report_lines(stages: list[StageMemory], note: str) -> list[str]:
    """The --memory-report table: per stage and layer, bytes kept per micro-batch, bytes
    saved while recomputing (transient), and the formula where one applies."""
    lines = [f"memory report (step 1; {note})",
             f"  {'stage':>5} {'layer':<12} {'kept/micro-batch':>17} {'recompute':>12} {'formula':>12} {'ratio':>6}"]
    for s in stages:
        for layer in sorted(set(s.kept) | set(s.recomputed), key=_layer_order):
            kept = s.per_micro_batch(layer)
            redo = s.recomputed.get(layer, 0) / max(1, s.micro_batches)
            expected = s.expected.get(layer)
            formula = f"{_mb(expected):>12}" if expected is not None else f"{'-':>12}"
            ratio = f"{kept / expected:6.3f}" if expected else f"{'-':>6}"
            lines.append(f"  {s.stage:>5} {layer:<12} {_mb(kept):>17} {_mb(redo):>12} {formula} {ratio}")
        lines.append(f"  {s.stage:>5} {'peak':<12} {_mb(s.peak_bytes):>17}")
    return lines


def _layer_order(name: str) -> tuple[int, int]:
    if name.startswith("blocks."):
        return (1, int(name.split(".")[1]))
    return ({"embedding": 0, "head": 2}.get(name, 3), 0)


# Dense FP8 Tensor Core peak TFLOP/s per device name tag, as training/metrics.py's bf16 table
# (the planner's hardware table holds the same figures with their sources; training may
# not import the planner, and tests/test_planner_fp8.py holds the two equal). Ampere and
# older have no FP8 Tensor Cores: no entry.
PEAK_FP8_TFLOPS = {"H200": 1979.0, "H100": 1979.0}


def fp8_peak_tflops(device: torch.device) -> float | None:
    """The device's dense FP8 Tensor Core peak, or None: a CPU (float8 emulated), an
    unlisted GPU, or one without FP8 Tensor Cores."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FP8_TFLOPS.items() if k in name), None)


def mfu_fp8_line(tflops: float, peak: float, fp8_peak: float | None) -> str:
    """MFU of an ``--fp8`` run: against the bf16 peak as every run's (the model FLOPs are
    the same; only the blocks' linears run in float8), named so, and against the FP8
    peak beside it where the device's is known."""
    line = f"MFU {100 * tflops / peak:.1f}% of the bf16 peak ({peak:g} TFLOP/s)"
    return line + (f", {100 * tflops / fp8_peak:.1f}% of the fp8 peak ({fp8_peak:g} TFLOP/s)" if fp8_peak else
                   ", fp8 peak not known for this device")


@contextlib.contextmanager
def _device_peak(device: torch.device, measuring: bool):
    """torch.cuda.max_memory_allocated over the block, on a GPU while measuring; yields a
    one-item list holding it (None elsewhere)."""
    peak: list[int | None] = [None]
    if not measuring or device.type != "cuda":
        yield peak
        return
    torch.cuda.reset_peak_memory_stats(device)
    yield peak
    peak[0] = torch.cuda.max_memory_allocated(device)


def _stage_memory(meter: ActivationMeter, device_peak: int | None, trainer: Trainer) -> StageMemory:
    """This stage's measured saved-activation bytes, beside the formula for its blocks
    (the formula describes the op-by-op attention, so it is given for --attention math)."""
    cfg, ctx, micro_batches = trainer.cfg, trainer.ctx, trainer.num_micro_batches
    expected = {}
    chunks = getattr(trainer.model, "chunks", None)
    if chunks is not None and cfg.model.attention == "math":
        e = torch.finfo(ctx.param_dtype).bits // 8
        shape = dict(batch=cfg.training.micro_batch_size, tp=ctx.tp.size, sequence_parallel=ctx.tp.sequence_parallel,
                     element_bytes=e, mask_bytes=dropout_mask_bytes(ctx.device, e), cp=ctx.cp.size,
                     cp_comm=ctx.cp.mode, ep=ctx.ep.size)

        def shape_of(layer: int) -> dict:  # a MoE block's differs from a dense one's
            return layer_shape(cfg.model, layer=layer, **shape)
        policy = ctx.recompute.policy
        for spec in chunks:
            expected.update(expected_by_layer(policy.block_runs(spec.layer_ids), policy.mode,
                                              micro_batches, policy.keep_last, shape_of=shape_of))
    return StageMemory(stage=ctx.coords.pp, micro_batches=micro_batches, kept=meter.by_layer(),
                       recomputed=meter.by_layer("recompute"), peak_bytes=meter.peak_bytes,
                       expected=expected, device_peak_bytes=device_peak)


def _gather_stage_memory(mine: StageMemory, ctx: DistributedContext) -> list[StageMemory]:
    if ctx.pp.size == 1:  # one stage: no torch group to gather over (grid.py makes none for one rank)
        return [mine]
    stages: list = [None] * ctx.grid.pp
    torch.distributed.all_gather_object(stages, mine, group=ctx.pp.group)
    return stages


def _memory_note(cfg: Config, ctx: DistributedContext) -> str:
    t, m = cfg.training, cfg.model
    e = torch.finfo(ctx.param_dtype).bits // 8
    mask = dropout_mask_bytes(ctx.device, e)
    formula = ("formula: Korthikanti et al. adapted, docs/memory.md" if m.attention == "math"
               else "no formula for --attention sdpa (fused kernel); use --attention math to compare")
    return (f"recompute {cfg.activations.recompute}, {e}-byte activations, dropout {m.dropout} "
            f"({mask}-byte masks), micro-batch {t.micro_batch_size}, tp {ctx.tp.size}"
            f"{' + SP' if ctx.tp.sequence_parallel else ''}; {formula}")


# ---- model ---------------------------------------------------------------------------------------

def _count(model: nn.Module) -> int:
    """Parameters of this rank's stage (whole: a ZeRO-3 shard counts as what it stands for)."""
    return sum(math.prod(whole_shape(p)) for p in model.parameters())


def _flops_per_token(model: nn.Module) -> float:
    """The Decoder formula for the built-in model; 6 x parameters for anyone else's."""
    cfg = getattr(model, "cfg", None)
    return training_flops_per_token(cfg) if isinstance(cfg, ModelConfig) else 6.0 * _count(model)
