"""The training loop, in Megatron-LM's shape: ``pretrain(model_provider, datasets_provider,
forward_step, config)``.

Read it top to bottom: set up the grid, build the model, optimizer and data from the
providers, then for each step take this rank's micro-batches of the global batch, run
forward and backward on each, reduce gradients over data parallel, clip, step.

The loss is defined once: the mean over every loss-bearing token of the global batch.
Each micro-batch's summed loss is scaled by ``dp / global_tokens`` before backward, so
that averaging gradients over the DP group yields exactly that mean's gradient for any
number of DP ranks and micro-batches.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gridtrain import checkpoint, memory
from gridtrain.config import Config
from gridtrain.data import GlobalBatchSampler, collate
from gridtrain.data_parallel import GradientReducer, broadcast_parameters
from gridtrain.distributed_optimizer import DistributedOptimizer, LossScaler
from gridtrain.distributed import DistributedContext, setup_distributed
from gridtrain.metrics import MetricsLogger, RunStats, StepRecord, peak_tflops
from gridtrain.model import IGNORE_INDEX
from gridtrain.optim import build_optimizer, clip_grad_norm, lr_at, set_lr
from gridtrain.pipeline.runtime import PipelineStage, StageStats, sum_tied_embedding_grads, write_chrome_trace
from gridtrain.pipeline.schedules import build_schedule, uses_split_backward
from gridtrain.pipeline.weight_grad import WeightGradStore
from gridtrain.tensor_parallel import allreduce_sequence_parallel_grads, broadcast_batches, is_tp_duplicate

Batch = dict[str, torch.Tensor]
ModelProvider = Callable[[Config, DistributedContext], nn.Module]
ForwardStep = Callable[[nn.Module, Batch], torch.Tensor]

@dataclass
class Datasets:
    """What a datasets provider returns.

    ``train``/``valid`` are map-style datasets whose items are dicts of equal-shape
    tensors with at least ``labels`` (positions equal to IGNORE_INDEX carry no loss).
    ``reference_loss`` (e.g. the corpus's unigram entropy) is printed beside the final
    validation loss; ``tokenizer`` lets the run print a sample at the end.
    """

    train: Any
    valid: Any = None
    tokenizer: Any = None
    reference_loss: float | None = None
    loss_unit: str = "nats/token"

@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    valid_loss: float | None = None
    tokens_per_s: float = 0.0
    model: nn.Module | None = None
    step_bytes: list[dict[str, int]] = field(default_factory=list)  # "kind/group" -> bytes
    peak_in_flight: int = 0  # most micro-batch chunks whose activations this stage held
    stage_busy_s: float = 0.0  # time this stage spent computing (F, B, W) ...
    stage_wall_s: float = 0.0  # ... out of the time its schedule took
    overlap: list[float] = field(default_factory=list)  # DP all-reduce hidden behind backward, per step
    skipped_steps: int = 0  # fp16 steps skipped on gradient overflow
    trace_events: list[tuple[int, str, float, float]] = field(default_factory=list)  # (step, action, start, end)
    memory: list[memory.StageMemory] = field(default_factory=list)  # every stage's, measured at step 1

    def add_step(self, record: StepRecord, stage: StageStats, reducer: GradientReducer, counter,
                 bytes_before: dict, scaler: LossScaler | None) -> dict:
        """Keep one step's numbers; returns the extra fields of its metrics line."""
        self.losses.append(record.loss)
        self.grad_norms.append(record.grad_norm)
        self.overlap.append(reducer.stats.fraction)
        self.peak_in_flight = max(self.peak_in_flight, stage.peak_in_flight)
        self.stage_busy_s += stage.busy_s
        self.stage_wall_s += stage.wall_s
        self.trace_events += [(record.step, *event) for event in stage.trace]
        moved = {f"{k}/{g}": n - bytes_before.get((k, g), 0) for (k, g), n in counter.bytes.items()}
        self.step_bytes.append({k: n for k, n in moved.items() if n})
        extra = {"comm_bytes": _bytes_by_group(self.step_bytes[-1])}
        if scaler is not None:
            extra["loss_scale"] = scaler.scale
            self.skipped_steps = scaler.skipped
        return extra
    ctx: DistributedContext | None = None

def pretrain(model_provider: ModelProvider, datasets_provider: Callable[[Config], Datasets],
             forward_step: ForwardStep, cfg: Config) -> TrainResult:
    """Train ``cfg.training.steps`` steps on the grid this process belongs to."""
    ctx = setup_distributed(cfg)
    t = cfg.training
    model = model_provider(cfg, ctx)
    broadcast_parameters(model, ctx.dp)
    data = datasets_provider(cfg)
    dp = ctx.grid.dp
    sampler = GlobalBatchSampler(len(data.train), t.global_batch_size, t.micro_batch_size,
                                 dp, ctx.coords.dp, t.seed)
    pipeline = build_pipeline(model, cfg, ctx, forward_step, sampler.num_micro_batches)
    reducer = GradientReducer(model, ctx.dp, accumulations=sampler.num_micro_batches,
                              bucket_mb=cfg.parallel.bucket_mb, shard=t.zero == 1)
    optimizer = make_optimizer(model, reducer, cfg, ctx)
    scaler = LossScaler(t.loss_scale, t.loss_scale_window) if t.dtype == "fp16" else None
    start = checkpoint.load_checkpoint(t.load, model, optimizer, ctx) if t.load else 0
    stats = RunStats(flops_per_token=_flops_per_token(model), world_size=ctx.grid.world_size)
    log = MetricsLogger(ctx.is_logging_rank, t.metrics_file, t.steps, start, t.progress)
    offload = t.offload_activations and ctx.device.type == "cuda"
    if t.offload_activations and not offload:
        log.print("--offload-activations: activations already live in host memory on the CPU; nothing to offload")
    log.print(f"gridtrain: {ctx.grid.describe()}, {_count(model):,} parameters per rank, "
              f"{sampler.num_micro_batches} micro-batches of {t.micro_batch_size} per step, "
              f"device {ctx.device.type}, dtype {t.dtype}")
    result = TrainResult(model=model, ctx=ctx)
    step_tokens = t.global_batch_size * _sample_tokens(data.train)
    tokens_seen = start * step_tokens
    for step in range(start, t.steps):
        lr = lr_at(step, t)
        set_lr(optimizer, lr)
        began, bytes_before = time.perf_counter(), dict(ctx.bytes.bytes)
        batches = read_micro_batches(data.train, sampler, step, ctx)
        measuring = step == start  # the counts are the same every step: measure the first
        meter = memory.ActivationMeter.for_model(model) if measuring or offload else None
        with memory.saved_activations(meter, offload), _device_peak(ctx.device, measuring) as device_peak:
            loss, grad_norm, stage_stats = train_step(model, optimizer, pipeline, reducer, batches, ctx,
                                                      t.grad_clip, scaler)
        if measuring:
            mine = _stage_memory(meter, device_peak, model, cfg, ctx, sampler.num_micro_batches)
        elapsed = time.perf_counter() - began
        tokens_seen += step_tokens
        record = StepRecord(step=step + 1, loss=loss, grad_norm=grad_norm, lr=lr, tokens=tokens_seen,
                            step_time_s=elapsed, tokens_per_s=step_tokens / elapsed)
        extra = result.add_step(record, stage_stats, reducer, ctx.bytes, bytes_before, scaler)
        stats.records.append(record)
        if data.valid is not None and t.eval_interval and (step + 1) % t.eval_interval == 0:
            result.valid_loss = extra["valid_loss"] = evaluate(pipeline, data.valid, ctx, cfg)
            log.print(f"step {step + 1}: train loss {loss:.4f}, valid loss {result.valid_loss:.4f}")
        log.step(record, extra)
        if t.save and t.save_interval and (step + 1) % t.save_interval == 0:
            checkpoint.save_checkpoint(t.save, step + 1, model, optimizer, cfg, ctx)
    log.close()
    if data.valid is not None and (not t.eval_interval or t.steps % t.eval_interval != 0):
        result.valid_loss = evaluate(pipeline, data.valid, ctx, cfg)
    if t.save and not (t.save_interval and t.steps % t.save_interval == 0):
        checkpoint.save_checkpoint(t.save, t.steps, model, optimizer, cfg, ctx)
    result.tokens_per_s = stats.tokens_per_s()
    if t.trace:
        Path(t.trace).mkdir(parents=True, exist_ok=True)
        write_chrome_trace(Path(t.trace) / f"rank{ctx.rank:03d}.json", result.trace_events, ctx.rank,
                           ctx.coords.pp)
    idle = _stage_idle_fractions(result, ctx)
    if t.steps > start:
        result.memory = _gather_stage_memory(mine, ctx)
    _print_summary(log, stats, result, data, ctx, t.peak_tflops)
    if result.memory:
        log.print(memory.summary_line(result.memory))
        if t.memory_report:
            for line in memory.report_lines(result.memory, _memory_note(cfg, ctx)):
                log.print(line)
    if ctx.grid.pp > 1:
        log.print("pipeline: measured idle fraction per stage " +
                  ", ".join(f"{s}: {f:.3f}" for s, f in enumerate(idle)) +
                  f"; peak micro-batches held on this stage {result.peak_in_flight}")
    return result

def build_pipeline(model: nn.Module, cfg: Config, ctx: DistributedContext, forward_step: ForwardStep,
                   num_micro_batches: int) -> PipelineStage:
    """This rank's stage of the schedule; with one stage, a plain gradient-accumulation loop."""
    p, v, m = ctx.grid.pp, cfg.parallel.vpp, num_micro_batches
    actions = build_schedule(cfg.parallel.schedule, p, m, v)[ctx.coords.pp]
    if uses_split_backward(cfg.parallel.schedule):
        ctx.tp.weight_grads = WeightGradStore()
    seq = cfg.model.seq_len // (ctx.tp.size if ctx.tp.sequence_parallel else 1)
    return PipelineStage(model, actions, stage=ctx.coords.pp, num_stages=p, chunks=v, pp=ctx.pp,
                         activation_shape=(cfg.training.micro_batch_size, seq, cfg.model.d_model),
                         activation_dtype=ctx.param_dtype, device=ctx.device,
                         weight_grads=ctx.tp.weight_grads, forward_step=forward_step,
                         trace=cfg.training.trace is not None, recompute=ctx.recompute)

def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, pipeline: PipelineStage,
               reducer: GradientReducer, batches: list[Batch] | None, ctx: DistributedContext,
               grad_clip: float, scaler: LossScaler | None = None) -> tuple[float, float, StageStats]:
    """One optimizer step: the stage's schedule (forward, backward and gradient reduction
    of every micro-batch), clipping, the optimizer. Returns the global batch's mean token
    loss (the same on every rank), the gradient norm (inf for a step skipped on fp16
    overflow) and what the stage did."""
    reducer.zero()
    holds_loss = ctx.grid.is_last_stage(ctx.rank)
    global_tokens = _global_token_count(batches, ctx) if holds_loss else 1
    scale = scaler.scale if scaler is not None else 1.0
    loss_sum, stats = pipeline.run(batches, ctx.grid.dp / global_tokens * scale, ctx.autocast,
                                   lambda: reduce_gradients(model, reducer, ctx))
    loss = _mean_loss(loss_sum, global_tokens, holds_loss, ctx)
    if scaler is not None:
        finite = optimizer.unscale_and_check(scale)
        scaler.update(finite)
        if not finite:
            return loss, float("inf"), stats
    if isinstance(optimizer, DistributedOptimizer):
        grad_norm = optimizer.clip_grad_norm(grad_clip)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        counted_once = [p for p in params if not is_tp_duplicate(p, ctx.tp.rank)
                        and not getattr(p, "tied_copy", False)]
        grad_norm = clip_grad_norm(params, grad_clip, ctx.mp, norm_params=counted_once)
    optimizer.step()
    return loss, grad_norm, stats

def make_optimizer(model: nn.Module, reducer: GradientReducer, cfg: Config, ctx: DistributedContext):
    """torch's AdamW on the parameters for fp32/fp64 without sharding; otherwise AdamW on
    flat master weights, sharded over DP with ZeRO-1 (distributed_optimizer.py)."""
    t = cfg.training
    if t.zero == 0 and ctx.param_dtype in (torch.float32, torch.float64):
        return build_optimizer(model, t)
    master = torch.float64 if ctx.param_dtype == torch.float64 else torch.float32
    return DistributedOptimizer(reducer, t, dp=ctx.dp, mp=ctx.mp, tp_rank=ctx.tp.rank, master_dtype=master)

def reduce_gradients(model: nn.Module, reducer: GradientReducer, ctx: DistributedContext) -> None:
    """A stage's gradients are complete: finish averaging over data parallel (most of it
    already ran during backward), then sum the partial ones over TP (sequence
    parallelism) and the tied embedding copies over the first and last stage. The sums
    and the average commute."""
    if reducer.shard:  # ZeRO-1: the buffer is reduce-scattered, so sum over TP/PP first
        allreduce_sequence_parallel_grads(model, ctx.tp)
        sum_tied_embedding_grads(model, ctx.embedding)
        reducer.finish()
        return
    reducer.finish()  # waits for the buckets in flight before touching the buffer
    allreduce_sequence_parallel_grads(model, ctx.tp)
    sum_tied_embedding_grads(model, ctx.embedding)

def _mean_loss(loss_sum: torch.Tensor | None, global_tokens: int, holds_loss: bool,
               ctx: DistributedContext) -> float:
    """The last stage sums its DP group's losses; every stage then receives the mean."""
    value = torch.zeros((), dtype=torch.float64, device=ctx.device)
    if holds_loss:
        value = ctx.dp.all_reduce(loss_sum) / global_tokens
    return float(ctx.pp.broadcast(value, src_index=ctx.grid.pp - 1))

@torch.no_grad()
def evaluate(pipeline: PipelineStage, dataset, ctx: DistributedContext, cfg: Config) -> float:
    """Mean token loss over the first ``eval_iters`` global batches of the validation set,
    forward-only through the pipeline. The same windows are used whatever the layout,
    each DP rank taking its fixed slice."""
    t = cfg.training
    pipeline.model.eval()
    sampler = GlobalBatchSampler(len(dataset), t.global_batch_size, t.micro_batch_size,
                                 ctx.grid.dp, ctx.coords.dp, t.seed, shuffle=False)
    holds_loss = ctx.grid.is_last_stage(ctx.rank)
    totals = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    for step in range(min(t.eval_iters, max(1, len(dataset) // t.global_batch_size))):
        batches = read_micro_batches(dataset, sampler, step, ctx)
        loss_sum = pipeline.forward_only(batches, ctx.autocast)
        if holds_loss:
            totals[0] += loss_sum
            totals[1] += sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    pipeline.model.train()
    if holds_loss:
        ctx.dp.all_reduce(totals)
    return float(ctx.pp.broadcast(totals[0] / totals[1].clamp(min=1), src_index=ctx.grid.pp - 1))

def read_micro_batches(dataset, sampler: GlobalBatchSampler, step: int,
                       ctx: DistributedContext) -> list[Batch] | None:
    """This rank's micro-batches of ``step``, on the stages that embed tokens or compute
    the loss (None elsewhere): read by the TP group's first rank and broadcast."""
    if not (ctx.grid.is_first_stage(ctx.rank) or ctx.grid.is_last_stage(ctx.rank)):
        return None
    ids = sampler.micro_batches(step)
    batches = None
    if ctx.tp.rank == 0:
        batches = [_to_device(collate(dataset, i), ctx.device) for i in ids]
    return broadcast_batches(batches, len(ids), ctx.tp, ctx.device)

def _global_token_count(batches: list[Batch], ctx: DistributedContext) -> int:
    """Loss-bearing tokens in the whole global batch (all DP ranks), known before backward."""
    local = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    count = torch.tensor([local], dtype=torch.int64, device=ctx.device)
    ctx.dp.all_reduce(count)
    if int(count) == 0:
        raise ValueError("the global batch has no loss-bearing tokens (all labels are ignored)")
    return int(count)

def _bytes_by_group(moved: dict[str, int]) -> dict[str, int]:
    """Payload bytes this step per group (tp, dp, ...), summed over collective kinds."""
    out: dict[str, int] = {}
    for key, n in moved.items():
        group = key.split("/", 1)[1]
        out[group] = out.get(group, 0) + n
    return out

def _stage_idle_fractions(result: TrainResult, ctx: DistributedContext) -> list[float]:
    """Each pipeline stage's share of schedule time spent not computing (waiting for
    activations or gradients, or communicating), gathered over the pipeline group."""
    mine = 1.0 - result.stage_busy_s / result.stage_wall_s if result.stage_wall_s else 0.0
    if ctx.grid.pp == 1:
        return [mine]
    return [float(x) for x in ctx.pp.all_gather(torch.tensor([mine], dtype=torch.float64, device=ctx.device), 0)]

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

def _stage_memory(meter: memory.ActivationMeter, device_peak: list, model: nn.Module, cfg: Config,
                  ctx: DistributedContext, micro_batches: int) -> memory.StageMemory:
    """This stage's measured saved-activation bytes, beside the formula for its blocks
    (the formula describes the op-by-op attention, so it is given for --attention math)."""
    expected = {}
    chunks = getattr(model, "chunks", None)
    if chunks is not None and cfg.model.attention == "math":
        e = torch.finfo(ctx.param_dtype).bits // 8
        m = cfg.model
        shape = dict(seq=m.seq_len, batch=cfg.training.micro_batch_size, hidden=m.d_model, heads=m.n_head,
                     ffn=m.ffn_size, tp=ctx.tp.size, sequence_parallel=ctx.tp.sequence_parallel,
                     element_bytes=e, mask_bytes=memory.dropout_mask_bytes(ctx.device, e),
                     dropout=m.dropout > 0)
        policy = ctx.recompute.policy
        for spec in chunks:
            expected.update(memory.expected_by_layer(policy.block_runs(spec.layer_ids), policy.mode,
                                                     micro_batches, policy.keep_last, **shape))
    return memory.StageMemory(stage=ctx.coords.pp, micro_batches=micro_batches, kept=meter.by_layer(),
                              recomputed=meter.by_layer("recompute"), peak_bytes=meter.peak_bytes,
                              expected=expected, device_peak_bytes=device_peak[0])

def _gather_stage_memory(mine: memory.StageMemory, ctx: DistributedContext) -> list[memory.StageMemory]:
    stages: list = [None] * ctx.grid.pp
    torch.distributed.all_gather_object(stages, mine, group=ctx.pp.group)
    return stages

def _memory_note(cfg: Config, ctx: DistributedContext) -> str:
    t, m = cfg.training, cfg.model
    e = torch.finfo(ctx.param_dtype).bits // 8
    mask = memory.dropout_mask_bytes(ctx.device, e)
    formula = ("formula: Korthikanti et al. adapted, docs/memory.md" if m.attention == "math"
               else "no formula for --attention sdpa (fused kernel); use --attention math to compare")
    return (f"recompute {t.recompute}, {e}-byte activations, dropout {m.dropout} "
            f"({mask}-byte masks), micro-batch {t.micro_batch_size}, tp {ctx.tp.size}"
            f"{' + SP' if ctx.tp.sequence_parallel else ''}; {formula}")

def _format_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"

def _to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

def _sample_tokens(dataset) -> int:
    return int(dataset[0]["labels"].numel())

def _flops_per_token(model: nn.Module) -> float:
    """The GPT formula for the built-in model; 6 x parameters for anyone else's."""
    from gridtrain.config import ModelConfig
    from gridtrain.model import training_flops_per_token

    cfg = getattr(model, "cfg", None)
    return training_flops_per_token(cfg) if isinstance(cfg, ModelConfig) else 6.0 * _count(model)

def _print_summary(log: MetricsLogger, stats: RunStats, result: TrainResult, data: Datasets,
                   ctx: DistributedContext, peak_override: float | None) -> None:
    if not stats.records:
        return
    tps = stats.tokens_per_s()
    tflops = stats.tflops_per_device()
    peak = peak_tflops(ctx.device, peak_override)
    mfu = f"MFU {100 * tflops / peak:.1f}% of {peak:g} TFLOP/s" if peak else \
        f"MFU n/a (no known peak for {ctx.device.type}; pass --peak-tflops)"
    log.print(f"throughput: {tps:,.0f} tokens/s, {tflops:.4f} TFLOP/s per device "
              f"({stats.flops_per_token / 1e6:.2f} MFLOP per token), {mfu}")
    if ctx.grid.dp > 1 and len(result.overlap) > 1:
        steady = result.overlap[1:]
        log.print(f"data parallel: {100 * sum(steady) / len(steady):.0f}% of gradient all-reduce time "
                  "hidden behind backward (mean over steps after the first)")
    moved = _bytes_by_group(result.step_bytes[-1]) if result.step_bytes else {}
    if moved:
        log.print("communication per step (payload bytes, this rank): " +
                  ", ".join(f"{g} {_format_bytes(n)}" for g, n in sorted(moved.items())))
    if ctx.dtype == "fp16":
        log.print(f"fp16: {result.skipped_steps} step(s) skipped on gradient overflow")
    log.print(f"final train loss {result.losses[-1]:.4f} {data.loss_unit}")
    if result.valid_loss is not None:
        ref = "" if data.reference_loss is None else \
            f" (corpus unigram entropy {data.reference_loss:.4f} {data.loss_unit})"
        log.print(f"validation loss {result.valid_loss:.4f} {data.loss_unit}{ref}")
