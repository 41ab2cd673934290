"""Build once, then step: everything a training step needs, created in one place.

:func:`build` makes, in the order each depends on the one before, the parts that the
loop (train.py), the benchmarks and the tests share:

1. the process groups, device and RNG streams of this rank (distributed.py);
2. the model from the user's ``model_provider``, the same on every DP replica: built on
   the meta device, each rank gives memory and values only to what it owns
   (checkpoint/materialise.py: the initialisation, or ``--init-from``'s weights);
3. the data and the global-batch sampler (optional: benchmarks bring their own batches);
4. this rank's pipeline stage running the schedule's action list (pipeline/runtime.py);
5. the gradient reducer: flat buffer, buckets, hooks (data_parallel.py);
6. the optimizer (AdamW, or flat master weights with ZeRO-1 / 16-bit parameters) and the
   fp16 loss scaler;
7. the checkpoint to resume from, if any; ``--init-from``'s master weights at the
   source's precision; with ``--save-async``, the background checkpoint writer and its process group.

A :class:`Trainer` then runs one optimizer step (:meth:`Trainer.train_step`), a
validation pass, or a save. The loss is defined once: the mean over every loss-bearing
token of the global batch. Each micro-batch's summed loss is scaled by
``dp x cp / global_tokens`` before backward, so that averaging gradients over the
dp x cp group yields exactly that mean's gradient for any number of DP ranks, cp ranks
and micro-batches (cp ranks hold the same parameters and part of every sequence).
Multi-token prediction's loss (models/mtp.py) is normalised by the same token count,
joins backward only, and is reported apart (``StepOutput.mtp_loss``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from gridtrain import checkpoint
from gridtrain.runtime import host_sync
from gridtrain.checkpoint.background import BackgroundSaver
from gridtrain.checkpoint.sharded import SaveReport
from gridtrain.config import Config
from gridtrain.data import Batch, Datasets, GlobalBatchSampler, TokenIdError, collate, count_loss_tokens
from gridtrain.parallel.context_parallel import split_sequence
from gridtrain.parallel.float8 import padding_note as float8_padding_note
from gridtrain.parallel.data_parallel import GradientReducer, broadcast_parameters
from gridtrain.parallel.distributed import DistributedContext, setup_distributed
from gridtrain.parallel.meta import is_meta, on_meta, stand_in
from gridtrain.parallel.experts import LayerRouting, step_routing
from gridtrain.parallel.fully_sharded import ShardedGradientReducer
from gridtrain.parallel.float8 import kind_of, refresh_weight_scales
from gridtrain.parallel.zero3 import ParameterShards, attach_buckets, make_units
from gridtrain.optim.distributed_muon import DistributedMuon
from gridtrain.optim.distributed_optimizer import DistributedOptimizer, LossScaler
from gridtrain.optim.grads import reduce_gradients, step_scalars, tied_parameter
from gridtrain.optim.interface import Optimizer
from gridtrain.checkpoint.huggingface import open_source
from gridtrain.checkpoint.materialise import Start, move_buffers
from gridtrain.models import qk_clip
from gridtrain.models.attention import SelfAttention
from gridtrain.models.decoder import IGNORE_INDEX, Block, compile_blocks
from gridtrain.models.mtp import take_loss_sum
from gridtrain.models.moe import update_expert_biases
from gridtrain.optim.optimizer import AdamW, build_optimizer, counts_towards_norm, lr_at, set_lr
from gridtrain.parallel.pipeline.runtime import PipelineStage, StageStats
from gridtrain.parallel.pipeline.schedules import build_schedule, uses_split_backward
from gridtrain.runtime.stops import EXIT_BAD_INPUT, Diverged, EmptyBatch, RunStopped
from gridtrain.parallel.tensor_parallel import broadcast_batches

ModelProvider = Callable[[Config, DistributedContext], nn.Module]
DatasetsProvider = Callable[[Config], Datasets]
ForwardStep = Callable[[nn.Module, Batch], torch.Tensor]


@dataclass
class StepOutput:
    """One optimizer step, as every rank sees it."""

    loss: float  # mean token loss of the global batch (the same on every rank)
    grad_norm: float  # global norm before clipping; inf for an fp16 step skipped on overflow
    stage: StageStats  # what this rank's pipeline stage did
    loss_scale: float | None = None  # fp16: the loss scale this step ran with
    routing: dict[int, LayerRouting] = field(default_factory=dict)  # MoE layers' routing, by layer index
    mtp_loss: float | None = None  # multi-token prediction: mean over depths of each depth's loss (mtp.py)


@dataclass
class Trainer:
    cfg: Config
    ctx: DistributedContext
    model: nn.Module
    pipeline: PipelineStage
    reducer: GradientReducer
    optimizer: Optimizer
    scaler: LossScaler | None
    num_micro_batches: int  # per step on this DP rank
    data: Datasets | None = None
    sampler: GlobalBatchSampler | None = None
    start_step: int = 0  # steps already taken (resumed from a checkpoint)
    resumed_from: Path | None = None  # the checkpoint this run started from
    saver: BackgroundSaver | None = None  # --save-async's writer
    saves: list[SaveReport] = field(default_factory=list)  # every save of this run, in order
    param_shards: ParameterShards | None = None  # ZeRO-3's (zero3.py)
    notes: list[str] = field(default_factory=list)  # what the run report should say about the setup
    valid_by_source: dict[str, float] = field(default_factory=dict)  # the last validation, per source

    @property
    def step_tokens(self) -> int:
        """Tokens in one global batch."""
        return self.cfg.training.global_batch_size * int(self.data.train[0]["labels"].numel())

    @property
    def loss_scale(self) -> float | None:
        """fp16's current dynamic loss scale (None for other dtypes)."""
        return self.scaler.scale if self.scaler is not None else None

    def set_lr(self, step: int) -> float:
        lr = lr_at(step, self.cfg.optim, self.cfg.training.steps)
        set_lr(self.optimizer, lr)
        return lr

    def read_batches(self, step: int) -> list[Batch] | None:
        """This rank's micro-batches of the global batch of ``step``."""
        return read_micro_batches(self.data.train, self.sampler, step, self.ctx, batch_shapes(self.cfg),
                                  count_tokens=not self.data.every_label_counts, vocab_size=self.cfg.model.vocab_size)

    def train_step(self, batches: list[Batch] | None) -> StepOutput:
        """One optimizer step: the stage's schedule (forward, backward and gradient
        reduction of every micro-batch), clipping, the optimizer; then the gradient
        memory that is not kept between steps goes back (ZeRO-2/3's shards)."""
        try:
            return self._train_step(batches)
        finally:
            self.reducer.release()

    def _train_step(self, batches: list[Batch] | None) -> StepOutput:
        ctx = self.ctx
        self.refresh_fp8()
        self.reducer.zero()
        holds_loss = ctx.grid.is_last_stage(ctx.rank)
        every_label_counts = self.data is not None and self.data.every_label_counts
        global_tokens = _global_token_count(batches, ctx, every_label_counts) if holds_loss else 1
        scale = self.scaler.scale if self.scaler is not None else 1.0
        # MoE: the load-balancing loss's gradient, per micro-batch, in the loss's scale
        ctx.ep.aux_grad_scale = ctx.dp_cp.size * scale / self.num_micro_batches
        ctx.ep.log.reset()
        loss_sum, stats = self.pipeline.run(batches, ctx.dp_cp.size / global_tokens * scale,
                                            lambda: reduce_gradients(self.model, self.reducer, ctx))
        routing = step_routing(ctx.ep.log, self.cfg.model.moe_layers, self.cfg.model.n_experts, ctx.pp, ctx.device,
                               ctx.ep.token_groups)
        if self.scaler is not None:
            self.optimizer.unscale(scale)
        max_norm = self.cfg.optim.grad_clip
        mtp_sum = take_loss_sum(self.model)  # the last stage's, normalised as the main loss (mtp.py)
        s = step_scalars(self.optimizer, ctx, loss_sum / global_tokens if holds_loss else None,
                         check_finite=self.scaler is not None, max_norm=max_norm, mtp=self.cfg.model.mtp_layers > 0,
                         mtp_loss=mtp_sum / global_tokens if mtp_sum is not None else None)
        tau = self.cfg.optim.qk_clip  # the step's largest logits per head, over dp x cp (models/qk_clip.py)
        rows = qk_clip.row_scales(self.model, tau, ctx.dp_cp) if tau > 0 else None
        used_scale = self.loss_scale
        if self.scaler is not None:
            self.scaler.update(s.finite)
            if not s.finite:
                return StepOutput(s.loss, float("inf"), stats, used_scale, routing, s.mtp_loss)
        self.optimizer.clip_to(s.grad_norm, max_norm)
        if math.isfinite(s.loss) and math.isfinite(s.grad_norm):  # never apply a NaN (stops.py stops the run)
            self.optimizer.step(**({"row_scales": rows} if rows else {}))
            if self.cfg.model.moe_expert_bias_rate > 0:  # aux-loss-free balancing, from the step's counts
                update_expert_biases(self.model, ctx.ep.log)
        return StepOutput(s.loss, s.grad_norm, stats, used_scale, routing, s.mtp_loss)

    @property
    def source_names(self) -> list[str]:
        """The training sources' names (one source: its own name is not needed)."""
        return list(getattr(self.data.train, "names", [""]))

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean token loss over the first ``eval_iters`` global batches of each validation
        set, forward-only through the pipeline; with several sets (a mixture's sources, or
        ``--valid-data``) each one's mean lands in :attr:`valid_by_source` and the return
        value is the mean over all their tokens. The same samples are used whatever the
        layout, each DP rank taking its fixed slice; one all-reduce and one host read.
        A set whose batches hold no label that carries a loss has no mean: None (printed
        n/a), never 0 / 0."""
        t, ctx, valid = self.cfg.training, self.ctx, self.data.valid
        sets = valid if isinstance(valid, dict) else {"": valid}
        ctx.recorder.set_action("validation")
        self.refresh_fp8()
        self.model.eval()
        holds_loss = ctx.grid.is_last_stage(ctx.rank)
        totals = torch.zeros(len(sets), 2, dtype=torch.float64, device=ctx.device)
        for row, dataset in enumerate(sets.values()):
            sampler = GlobalBatchSampler(len(dataset), t.global_batch_size, t.micro_batch_size,
                                         ctx.grid.dp, ctx.coords.dp, t.seed, shuffle=False)
            for step in range(min(self.cfg.eval.eval_iters, max(1, len(dataset) // t.global_batch_size))):
                batches = read_micro_batches(dataset, sampler, step, ctx, batch_shapes(self.cfg),
                                             vocab_size=self.cfg.model.vocab_size)
                loss_sum = self.pipeline.forward_only(batches)
                if holds_loss:
                    totals[row, 0] += loss_sum
                    for b in batches:  # counted on the device: no host read per micro-batch
                        totals[row, 1] += (b["labels"] != IGNORE_INDEX).sum()
        self.model.train()
        if holds_loss:
            ctx.dp_cp.all_reduce(totals)
        sums = torch.cat([totals.sum(0, keepdim=True), totals]) if len(sets) > 1 else totals
        means = ctx.pp.broadcast(torch.stack([sums[:, 0] / sums[:, 1].clamp(min=1), sums[:, 1]]),
                                 src_index=ctx.grid.pp - 1)
        means, counts = host_sync.read("valid_loss", means, lambda m: m.tolist(),
                                       stand_in=[[0.0] * len(sums), [1.0] * len(sums)])
        values = [mean if count > 0 else None for mean, count in zip(means, counts)]
        values = values if len(sets) > 1 else values * 2  # [overall, per set...]
        self.valid_by_source = dict(zip(sets, values[1:])) if len(sets) > 1 or "" not in sets else {}
        return values[0]

    def save(self, step: int) -> None:
        """Write a checkpoint after ``step`` steps, unless some weight is not finite (e.g. an
        fp16 copy of a master weight beyond fp16's range): then the run has diverged, and
        ``latest`` stays the last finite checkpoint. The time the loop is blocked (the
        finiteness check, building the state, waiting for the previous background write,
        staging or writing) is recorded per save for the run summary."""
        began = time.perf_counter()
        self.ctx.recorder.set_action("checkpoint save")
        self.optimizer.parameters_ready()
        if not self._weights_finite():
            raise Diverged(f"step {step}: some weights are not finite (inf or NaN); not saved, the latest "
                           f"checkpoint in {self.cfg.checkpoint.save} is from before; lower --lr", step)
        c = self.cfg.checkpoint
        state = checkpoint.state_to_save(self.model, self.optimizer, self.ctx)
        meta = checkpoint.meta_of(step, self.cfg, self.ctx, self.optimizer, self.scaler)
        if self.sampler is not None:  # the data position per source: a resumed run reads on from it
            meta["data"].update(self.sampler.state(step), sources=self.source_names)
        if self.saver is not None:
            report = self.saver.save(c.save, step, state, meta, keep_last=c.keep_last)
        else:
            report = SaveReport(step=step)
            written = time.perf_counter()
            report.path = checkpoint.write_state(c.save, step, state, meta, keep_last=c.keep_last)
            report.write_s = time.perf_counter() - written
        report.blocked_s = time.perf_counter() - began
        self.saves.append(report)

    def refresh_fp8(self) -> None:
        """``--fp8``: every float8 weight's scales from the weights as they are now (the
        last step's, or the loaded ones): once per step, before its first forward, and
        before evaluation and sampling (parallel/float8.py). Read from ZeRO-3's parameter
        shard, or from ZeRO-1/2's master shard, whose parameter gathers then stay in
        flight behind the next forward; otherwise from the parameters themselves."""
        fp8 = self.ctx.tp.fp8
        if fp8 is None:
            return
        if self.param_shards is not None:
            refresh_weight_scales(self.model, fp8, self.param_shards.shard, self.reducer)
            return
        master = getattr(self.optimizer, "master", None)
        if isinstance(self.optimizer, DistributedOptimizer) and self.reducer.shard and master is not None \
                and master.numel() == self.reducer.shard_numel and master.device == self.ctx.device:
            refresh_weight_scales(self.model, fp8, master, self.reducer)
            return
        self.parameters_ready()
        refresh_weight_scales(self.model, fp8)

    def parameters_ready(self) -> None:
        """Wait for ZeRO-1's parameter gathers still in flight after the last step (the
        next forward would wait for them itself; anything else reading the weights calls
        this first). ZeRO-3's parameters stay sharded: evaluation and saves read them
        block by block or from the shard; :meth:`gather_weights` makes them whole."""
        self.optimizer.parameters_ready()

    def gather_weights(self) -> None:
        """Every parameter of this rank's stage whole, until the next step (ZeRO-3: the
        whole stage on every rank of its dp x cp group; a model that only fits sharded
        cannot): for reading the weights after the run, e.g. the end-of-run sample."""
        self.parameters_ready()
        if self.param_shards is not None:
            self.param_shards.gather_all()
        self.refresh_fp8()

    def finish_saves(self) -> None:
        """Wait for a background save in flight; raise its failure (never silent)."""
        if self.saver is not None:
            self.saver.wait()

    def _weights_finite(self) -> bool:
        """Whether every rank's parameters are all finite (collective over the world)."""
        flag = torch.ones(1, device=self.ctx.device)
        held = [self.param_shards.shard] if self.param_shards is not None else self.model.parameters()
        for p in held:  # on the device: one host read, below
            flag.mul_(torch.isfinite(p).all())
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return host_sync.read("weights_finite", flag, bool, stand_in=True)


def build(cfg: Config, model_provider: ModelProvider, forward_step: ForwardStep,
          datasets_provider: DatasetsProvider | None = None, *,
          ctx: DistributedContext | None = None) -> Trainer:
    """Everything a step needs on this rank (see the module docstring for the order).
    ``ctx``: a context already set up (e.g. a one-rank grid inside a larger world, as the
    benchmarks' single-process references use); default: :func:`setup_distributed`."""
    t = cfg.training
    ctx = ctx if ctx is not None else setup_distributed(cfg)
    model = model_provider(cfg, ctx)
    if t.compile and compile_blocks(model, t.compile_backend) == 0:
        raise ValueError("--compile compiles gridtrain's transformer blocks (model.Block), and this model has "
                         "none; drop --compile or torch.compile your model in its provider")
    source = resume_source(cfg)
    init = open_source(cfg.checkpoint.init_from, "--init-from") if source is None and cfg.checkpoint.init_from else None
    start_from = Start.of(cfg, model, source, init)  # where the first weights come from
    place_parameters(model, start_from, cfg, ctx)
    data = datasets_provider(cfg) if datasets_provider is not None else None
    sampler = train_sampler(data, cfg, ctx) if data is not None else None
    micro_batches = t.global_batch_size // (t.micro_batch_size * ctx.grid.dp)
    pipeline = build_pipeline(model, cfg, ctx, forward_step, micro_batches)
    reducer, param_shards = make_reducer(model, cfg, ctx, micro_batches, start_from)
    optimizer = make_optimizer(model, reducer, cfg, ctx, param_shards)
    if cfg.optim.qk_clip > 0:  # the attention layers record their largest logits (models/qk_clip.py)
        for layer in model.modules():
            if isinstance(layer, SelfAttention):
                layer.records_logits = True
    start_from.finish(model, optimizer, ctx)  # --init-from: the optimizer's masters at the source's precision
    gather_before_forwards(model, optimizer)
    scaler = LossScaler(t.loss_scale, t.loss_scale_window, t.min_loss_scale) if t.dtype == "fp16" else None
    # the scaler resumes too: a fresh loss scale would skip steps the saved run did not
    start, notes = 0, []
    if cfg.optim.optimizer_offload and ctx.device.type == "cpu":
        notes.append("--optimizer-offload: on cpu the optimizer's state is in host memory already; nothing moves")
    if t.fp8 != "none" and ctx.device.type == "cuda":
        note = float8_padding_note(model, t.micro_batch_size * cfg.model.seq_len // cfg.parallel.cp)
        notes += [note] if note else []
    if source is not None:
        with whole_parameters(param_shards, when=_whole_format(source)):
            start = checkpoint.load_checkpoint(source, model, optimizer, ctx, scaler=scaler,
                                               reset_optimizer=cfg.checkpoint.reset_optimizer)
        if sampler is not None:  # the data order continues from the checkpoint's per-source counts
            note = sampler.restore(checkpoint.read_meta(source).get("data"), start)
            notes += [note] if note else []
    saver = BackgroundSaver() if cfg.checkpoint.save and cfg.checkpoint.save_async else None  # collective: its own process group
    return Trainer(cfg=cfg, ctx=ctx, model=model, pipeline=pipeline, reducer=reducer, optimizer=optimizer,
                   scaler=scaler, param_shards=param_shards, num_micro_batches=micro_batches, data=data, sampler=sampler,
                   start_step=start, resumed_from=source, saver=saver, notes=notes)


@contextlib.contextmanager
def whole_parameters(param_shards: ParameterShards | None, when: bool = True):
    """Under ZeRO-3, for code that writes whole parameters (a whole-tensor checkpoint,
    ``--init-from``): every parameter gathered before, their new values taken into the
    parameter shard after (the stage is whole on the rank meanwhile)."""
    if param_shards is None or not when:
        yield
        return
    param_shards.gather_all()
    yield
    param_shards.take_params()


def _whole_format(path: Path) -> bool:
    """Whether ``path`` is a whole-tensor checkpoint (False where it cannot be read:
    loading it then says why)."""
    try:
        return not checkpoint.is_sharded(path)
    except Exception:
        return False


def resume_source(cfg: Config) -> Path | None:
    """The checkpoint to start from: ``--load``; with ``--auto-resume``, else the newest
    complete checkpoint in the ``--save`` directory (None there: a fresh start)."""
    c = cfg.checkpoint
    if c.load:
        return Path(c.load)
    if c.auto_resume and c.save:
        return checkpoint.latest_step_dir(c.save)
    return None


def train_sampler(data: Datasets, cfg: Config, ctx: DistributedContext) -> GlobalBatchSampler:
    """The global-batch sampler of the training set: over its sources with their weights
    when it is a mixture (data.mixture.MixtureDataset), else over its samples."""
    t = cfg.training
    sizes, weights = getattr(data.train, "sizes", len(data.train)), getattr(data.train, "weights", None)
    return GlobalBatchSampler(sizes, t.global_batch_size, t.micro_batch_size, ctx.grid.dp, ctx.coords.dp, t.seed,
                              weights=weights)


def build_pipeline(model: nn.Module, cfg: Config, ctx: DistributedContext, forward_step: ForwardStep,
                   num_micro_batches: int) -> PipelineStage:
    """This rank's stage of the schedule; with one stage, a plain gradient-accumulation loop."""
    p, v, m = ctx.grid.pp, cfg.parallel.vpp, num_micro_batches
    actions = build_schedule(cfg.parallel.schedule, p, m, v)[ctx.coords.pp]
    seq = cfg.model.seq_len // ctx.cp.size // (ctx.tp.size if ctx.tp.sequence_parallel else 1)
    return PipelineStage(model, actions, stage=ctx.coords.pp, num_stages=p, chunks=v, pp=ctx.pp,
                         activation_shape=(cfg.training.micro_batch_size, seq, cfg.model.d_model),
                         activation_dtype=ctx.param_dtype, device=ctx.device,
                         weight_grads=ctx.tp.weight_grads, forward_step=forward_step,
                         trace=cfg.metrics.trace is not None, recompute=ctx.recompute)


def place_parameters(model: nn.Module, start_from: Start, cfg: Config, ctx: DistributedContext) -> None:
    """Parameters on the meta device get memory for what this rank owns: their whole
    local tensors, filled from ``start_from``; under ZeRO-3 stand-ins without memory
    (the parameter shards take the values: :func:`make_reducer`). A model built with
    memory starts from its first dp x cp rank's weights, or ``--init-from``'s."""
    if not is_meta(model):
        broadcast_parameters(model, ctx.dp_cp, ctx.expert_dp_cp)
    if cfg.parallel.zero == 3:
        for p in model.parameters():
            if on_meta(p):
                stand_in(p, device=ctx.device, dtype=ctx.param_dtype)
        move_buffers(model, ctx.device)
        return
    start_from.materialise(model, ctx)


def make_reducer(model: nn.Module, cfg: Config, ctx: DistributedContext, micro_batches: int,
                 start_from: Start | None = None) -> tuple[GradientReducer, ParameterShards | None]:
    """The gradient reducer of the run's ZeRO stage: all-reduce into a whole buffer (0),
    reduce-scatter of it (1), gradient shards reduce-scattered per micro-batch (2); and
    for ZeRO-3 the parameter shards, gathered block by block (a bucket per block), each
    rank's filled from ``start_from`` (default: the parameters' values)."""
    p = cfg.parallel
    alone = [q for q in [tied_parameter(model, ctx.embedding)] if q is not None]
    common = dict(accumulations=micro_batches, bucket_mb=p.bucket_mb, device=ctx.device, alone=alone)
    if p.zero == 0:  # (expert parallelism: a rank's experts in buckets of their own, reduced over their group)
        split = uses_split_backward(p.schedule)
        return GradientReducer(model, ctx.dp_cp, in_place=not split, experts=ctx.expert_dp,
                               direct=not split and torch_adamw(cfg, ctx), **common), None
    # ZeRO shards over dp x cp, or under hybrid sharding over a part of it (replicated across the parts)
    common["replicas"] = ctx.zero_replica
    # ZeRO-1/2: the parameters in a buffer laid out as the gradients, for in-place gathers
    common["param_buffer"] = p.zero in (1, 2) and ctx.shard_group.size > 1
    if p.zero == 1:
        return GradientReducer(model, ctx.shard_group, shard=True, in_place=not uses_split_backward(p.schedule),
                               experts=ctx.expert_dp, **common), None
    if p.zero == 2:
        return ShardedGradientReducer(model, ctx.shard_group, experts=ctx.expert_dp, **common), None
    table = _table_unit(model)
    # without the token table the root holds the final norm, the head and what follows
    # them: gathered for the loss only
    root_holds_table = getattr(model, "embedding", None) is not None and table is None
    final_norm = None if root_holds_table or not hasattr(model, "embedding") else getattr(model, "final_norm", None)
    units, unit_of = make_units(model, Block, leading=[table] if table is not None else [], root_from=final_norm)
    fp8_gather = cfg.training.fp8_all_gather
    if fp8_gather:  # a unit's float8 weights in buckets of their own: they travel as float8 (zero3.py)
        unit_of = {q: (i, kind_of(q) is not None) for q, i in unit_of.items()}
    reducer = ShardedGradientReducer(model, ctx.shard_group, **{**common, "bucket_mb": math.inf, "param_buffer": False},
                                     units=unit_of,
                                     experts=ctx.expert_dp)
    attach_buckets(units, reducer)
    by_module = {id(u.module): u for u in units}
    chunks = getattr(model, "chunks", None)
    mtp = [by_module[id(m.block)] for m in getattr(model, "mtp", None) or ()]  # after the head's chunk's blocks
    first = [by_module[id(table)]] if table is not None else []  # the token table's unit prefetches block 0
    sequences = None if chunks is None else \
        [(first if c.pre_process else []) + [by_module[id(model.blocks[str(i)])] for i in c.layer_ids]
         + (mtp if c.post_process else []) for c in chunks]
    shards = ParameterShards(model, reducer, units, ctx.shard_group, keep_gathered=p.zero3_keep_gathered,
                             sequences=sequences, fill=start_from.shard_filler(model, ctx) if start_from else None,
                             fp8_gather=fp8_gather, shard_dtype=None if cfg.optim.optimizer_offload else master_dtype(ctx))
    reducer.after_grad = shards.after_grad
    ctx.recompute.early_limit = 1  # a region rebuilt ahead stays gathered until its backward (zero3.py)
    return reducer, shards


def _table_unit(model: nn.Module) -> nn.Module | None:
    """The model's embedding, when ZeRO-3 can gather it for its own forward only: a
    stage's token table that is not also its head (tied) and that multi-token
    prediction does not read again after the blocks; else None (it joins the root)."""
    embedding = getattr(model, "embedding", None)
    if embedding is None or getattr(model, "mtp", None) is not None:
        return None
    tied_here = getattr(model, "final_norm", None) is not None and getattr(model, "head", None) is None
    return None if tied_here else embedding


def torch_adamw(cfg: Config, ctx: DistributedContext) -> bool:
    """Whether the run steps with torch's AdamW on the parameters' own gradients (fp32 and
    fp64 without ZeRO, fp32 moments, the state on the device), not the flat optimizer."""
    return cfg.optim.optimizer != "muon" and cfg.parallel.zero == 0 \
        and ctx.param_dtype in (torch.float32, torch.float64) \
        and cfg.optim.optimizer_state_dtype == "fp32" and not cfg.optim.optimizer_offload


def master_dtype(ctx: DistributedContext) -> torch.dtype:
    """The master weights' dtype: fp64 for fp64 runs, else fp32."""
    return torch.float64 if ctx.param_dtype == torch.float64 else torch.float32


def make_optimizer(model: nn.Module, reducer: GradientReducer, cfg: Config, ctx: DistributedContext,
                   param_shards: ParameterShards | None = None) -> Optimizer:
    """torch's AdamW on the parameters for fp32/fp64 without sharding and fp32 moments;
    otherwise AdamW on flat master weights, sharded over DP with ZeRO-1 and up
    (distributed_optimizer.py);
    Muon beside AdamW on flat master weights in every case (distributed_muon.py)."""
    master = master_dtype(ctx)
    if cfg.optim.optimizer == "muon":
        return DistributedMuon(reducer, cfg.optim, dp=reducer.dp, mp=ctx.mp, tp=ctx.tp, d_model=cfg.model.d_model,
                               master_dtype=master, param_shards=param_shards)
    if torch_adamw(cfg, ctx):
        # each gradient counted once in the norm: on the first of the ranks holding it
        counted = [p for p in model.parameters() if p.requires_grad and counts_towards_norm(p, ctx.tp.rank)
                   and reducer.group_of(p).rank == 0]
        return AdamW(build_optimizer(model, cfg.optim), counted, ctx.device)
    return DistributedOptimizer(reducer, cfg.optim, dp=reducer.dp, mp=ctx.mp, tp_rank=ctx.tp.rank, master_dtype=master,
                                param_shards=param_shards)


def gather_before_forwards(model: nn.Module, optimizer: Optimizer) -> None:
    """Parameters ready before each forward: each transformer block waits for its own
    parameters (ZeRO-1's gathers) when its forward starts, the stage's model for the rest
    (embedding, final norm, head), so the gathers of later blocks overlap the forward of
    earlier ones. Waits sit on whole blocks, outside what ``--compile`` compiles
    (``Block.layer``)."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    inside = {id(p) for b in blocks for p in b.parameters()}
    for block in blocks:
        optimizer.gather_before(block, list(block.parameters()))
    optimizer.gather_before(model, [p for p in model.parameters() if id(p) not in inside])


def batch_shapes(cfg: Config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each key of a micro-batch (data.collate) with its shape and dtype, known to every
    rank from the configuration (so TP ranks need not be told them)."""
    shape = (cfg.training.micro_batch_size, cfg.model.seq_len)
    shapes = {"tokens": (shape, torch.int64), "labels": (shape, torch.int64)}
    if cfg.data.document_mask:  # each token's document, the whole sequence (own_chunks leaves it whole)
        shapes["documents"] = (shape, torch.int64)
    return shapes


class StepBatches(list):
    """A rank's micro-batches of one step, and the loss-bearing tokens of the whole global
    batch where the data could count them on the host (``loss_tokens``; None: counted
    in the step, :func:`_global_token_count`)."""

    def __init__(self, batches: list[Batch], loss_tokens: int | None = None):
        super().__init__(batches)
        self.loss_tokens = loss_tokens


class BadTokenId(TokenIdError, RunStopped):
    """A batch's id outside the vocabulary (data.check_token_ids) stops the run with exit
    status 2 (bad input), in one line: a RunStopped reaches the launcher from a worker
    as it is (launch.py), and the CLI prints a data error as one line."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, step: int | None = None):
        RunStopped.__init__(self, message, step)


def read_micro_batches(dataset, sampler: GlobalBatchSampler, step: int, ctx: DistributedContext,
                       shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None, *,
                       count_tokens: bool = False, vocab_size: int | None = None) -> list[Batch] | None:
    """This rank's micro-batches of ``step``, on the stages that embed tokens or compute
    the loss (None elsewhere; on every stage with documents, whose attention each stage
    masks): read by the TP group's first rank and broadcast (``shapes``: see
    :func:`batch_shapes`; None: they are broadcast too), then cut to this cp rank's
    chunks (:func:`own_chunks`). Documents a dataset gives without ``--document-mask``
    (``shapes`` without them) are dropped: the flag decides, the same on every layout.
    ``count_tokens`` (the last stage, where not every label counts): the global batch's
    loss-bearing tokens from the dataset's host-side counts (data.datasets.count_loss_tokens),
    so the step needs no collective for them. ``vocab_size``: every token id and label is
    checked on the host before it goes to the device (:class:`BadTokenId`)."""
    documents = shapes is not None and "documents" in shapes
    if not (documents or ctx.grid.is_first_stage(ctx.rank) or ctx.grid.is_last_stage(ctx.rank)):
        return None
    ids = sampler.micro_batches(step)
    batches = None
    if ctx.tp.rank == 0:
        try:
            batches = [{k: v.to(ctx.device, non_blocking=True) for k, v in collate(dataset, i, vocab_size).items()
                        if k != "documents" or documents or shapes is None} for i in ids]
        except TokenIdError as e:
            raise BadTokenId(str(e), ctx.recorder.step) from None
        if documents and "documents" not in batches[0]:
            raise ValueError("--document-mask: the datasets provider's samples have no \"documents\" key (each "
                             "token's document index); give them one or drop --document-mask")
    batches = own_chunks(broadcast_batches(batches, len(ids), ctx.tp, ctx.device, shapes), ctx)
    counted = count_tokens and ctx.grid.is_last_stage(ctx.rank)
    return StepBatches(batches, count_loss_tokens(dataset, sampler.global_batch(step)) if counted else None)


def own_chunks(batches: list[Batch], ctx: DistributedContext) -> list[Batch]:
    """Each micro-batch cut to the two chunks of every sequence this cp rank holds (the
    whole of it without context parallelism); ``documents`` stay whole: a cp rank masks
    its chunk pairs and finds its tokens' positions from every token's document."""
    if ctx.cp.size == 1:
        return batches
    return [{k: v if k == "documents" else split_sequence(v, ctx.cp.size, ctx.cp.rank) for k, v in b.items()}
            for b in batches]


def _global_token_count(batches: list[Batch], ctx: DistributedContext, every_label_counts: bool = False) -> int:
    """Loss-bearing tokens in the whole global batch (all DP ranks and cp chunks), known
    before backward: every label when the datasets say so (``Datasets.every_label_counts``:
    no collective, no host read); else as the data counted them on the host
    (:class:`StepBatches`: again no collective); else counted and summed over DP x CP.

    The last is the one collective a step would issue before its first forward: under
    ZeRO-1/2 it would queue on the dp x cp communicator behind the parameter gathers the
    last step left in flight, so the host would wait for all of them before the forward
    (the gathers are meant to hide behind it). The data's own counts avoid it; only a
    dataset that cannot count (a user's, without ``count_loss_tokens``) pays it."""
    every_label = ctx.dp_cp.size * sum(b["labels"].numel() for b in batches)  # also the dry run's stand-in
    if every_label_counts:
        return every_label
    known = getattr(batches, "loss_tokens", None)
    if known is not None:
        if known == 0:
            raise _empty_batch(ctx)
        return known
    # summed on the device: one host read for the whole step, not one per micro-batch
    local = torch.stack([(b["labels"] != IGNORE_INDEX).sum() for b in batches]).sum()
    count = local.reshape(1).to(device=ctx.device, dtype=torch.int64)
    ctx.dp_cp.all_reduce(count)
    tokens = host_sync.read("token_count", count, int, stand_in=every_label)
    if tokens == 0:
        raise _empty_batch(ctx)
    return tokens


def _empty_batch(ctx: DistributedContext) -> EmptyBatch:
    step = ctx.recorder.step
    return EmptyBatch(f"step {step}: the global batch has no token that counts in the loss (every label is a "
                      "prompt or padding); pass a longer --seq-len, or give the fine-tuning sources more "
                      "completion tokens (or less weight in the mixture)", step)
