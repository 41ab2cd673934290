"""Tensor parallelism side by side: gridtrain's Megatron-style TP against PyTorch DTensor TP.

The same Decoder (shape, initial weights, batch, loss, optimizer) is trained for a few steps
on two gloo processes in two ways, alternating inside the same two processes:

* ``gridtrain tp=2``: gridtrain's real training step, built by ``gridtrain.training.trainer.build``
  (``decoder_model_provider``, ``decoder_forward_step``) on a config with ``parallel.tp = 2``
  and stepped with ``Trainer.train_step``: ``gridtrain.models.decoder.Decoder`` on the
  ``TensorParallel`` context (column/row-parallel linears with fused QKV,
  vocabulary-parallel embedding and cross entropy, hand-written autograd collectives
  counted by a ``ByteCounter``), one micro-batch through the one-stage pipeline, the
  gradient norm (one scalar all-reduce over the model-parallel group; ``grad_clip = 0``:
  computed, not applied, as the other side clips nothing), AdamW;
* ``DTensor tp=2``: a plain PyTorch GPT defined below (separate q/k/v linears),
  parallelized with ``torch.distributed.tensor.parallel.parallelize_module`` on
  ``init_device_mesh("cpu", (2,))``: q, k, v and the MLP's fc ``ColwiseParallel``, the
  attention output and the MLP's proj ``RowwiseParallel``, the token embedding
  ``RowwiseParallel`` (vocabulary-sharded, as gridtrain's), the LM head
  ``ColwiseParallel(output_layouts=Shard(-1))`` with the cross entropy computed under
  ``loss_parallel()``. The LM head is tied to the token embedding, as in gridtrain.
* the same DTensor model with one ``PrepareModuleInput`` on each attention module (skip
  with ``--no-variant``), so that the three q/k/v input gradients are summed before a
  single all-reduce instead of one all-reduce each;
* two one-process references without TP on rank 0 (all cores, the other rank idle in a
  barrier): gridtrain's ``train_step`` on a one-rank grid, and the plain GPT.

A step is: zero grads, forward (embedding, blocks, final LayerNorm, LM head, mean token
cross entropy), backward, AdamW step (gridtrain's parameter groups and defaults: lr 1e-3,
betas (0.9, 0.95), weight decay 0.1 on matrices). No clipping, no LR schedule.

Both models start from the same numbers (gridtrain's ``init_parameters``, copied into the
plain model; the fused QKV split into q, k, v) and see the same batch, so their losses
must agree step for step (to fp32 rounding); the run prints the differences.

Timing (benchmarks/common.py): every setup first runs ``--warmup`` untimed steps (the
last one also counts the collectives); then ``--repeats`` rounds, each timing ``--steps``
steps of every setup in turn (the order reversed every other round), between two
barriers, with ``time.perf_counter`` on rank 0. Reported: medians over rounds, the best
round, the forward / backward / AdamW split, and the tokens/s ratio to DTensor paired per
round.

Vocabulary: gridtrain pads 257 to ``padded_vocab_size(tp)`` (384 at tp=2) and masks the
padding columns to -inf in its cross entropy. The DTensor model uses the same padded
table and adds a fixed, sharded 0/-inf mask to its logits, so both compute the same
matmuls and the same loss.

Run from the repository root::

    python3 benchmarks/tp_vs_dtensor.py        # `small` preset shape: ~30 s on 2 idle cores
    python3 benchmarks/tp_vs_dtensor.py --d-model 512 --n-head 8 --steps 5 --repeats 4 --warmup 2
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import common  # benchmarks/common.py: the script's own folder is on sys.path
from common import Side, med, mib
from gridtrain.config import Config, OptimConfig, ParallelConfig
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.optim.optimizer import build_optimizer
from gridtrain.training.trainer import Trainer

TP = 2


# ---- a plain PyTorch GPT with the same shape and math as gridtrain's -------------------------

class PlainAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.head_dim = d_model // n_head
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # The head count is inferred (-1), not n_head: after ColwiseParallel each rank's
        # q/k/v outputs hold only its n_head / tp heads (torchtitan reshapes the same way).
        q = self.q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class PlainBlock(nn.Module):
    """Pre-LN: attention, then the MLP (``fc``, tanh-GELU, ``proj``), each with a residual."""

    def __init__(self, d_model: int, n_head: int, ffn: int, eps: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=eps)
        self.attn = PlainAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model, eps=eps)
        self.fc = nn.Linear(d_model, ffn)
        self.proj = nn.Linear(ffn, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """Token + position embedding, pre-LN blocks, final LN, LM head tied to the token table.

    ``logit_mask`` (0 for real vocabulary columns, -inf for padding) is added to the
    logits; it is a plain tensor here and a sharded DTensor once the model is parallelized.
    """

    def __init__(self, n_layer: int, d_model: int, n_head: int, ffn: int, seq_len: int,
                 vocab_size: int, padded_vocab: int, eps: float):
        super().__init__()
        self.tok = nn.Embedding(padded_vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(PlainBlock(d_model, n_head, ffn, eps) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model, eps=eps)
        self.head = nn.Linear(d_model, padded_vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        mask = torch.zeros(padded_vocab)
        mask[vocab_size:] = float("-inf")
        self.logit_mask = mask

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) + self.logit_mask


@torch.no_grad()
def plain_from_gridtrain(gt: Decoder) -> PlainGPT:
    """A PlainGPT holding exactly the weights of a one-rank gridtrain Decoder."""
    c = gt.cfg
    m = PlainGPT(c.n_layer, c.d_model, c.n_head, c.ffn_size, c.seq_len, c.vocab_size,
                 gt.padded_vocab, c.layernorm_eps)
    m.tok.weight.copy_(gt.embedding.word.weight)
    m.pos.weight.copy_(gt.embedding.position.weight)
    for mine, theirs in zip(m.blocks, gt.blocks.values()):
        mine.ln1.load_state_dict(theirs.ln1.state_dict())
        mine.ln2.load_state_dict(theirs.ln2.state_dict())
        for lin, w, b in zip((mine.attn.q, mine.attn.k, mine.attn.v),
                             theirs.attn.qkv.weight.chunk(3, 0), theirs.attn.qkv.bias.chunk(3, 0)):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        for lin, src in ((mine.attn.out, theirs.attn.proj), (mine.fc, theirs.mlp.fc), (mine.proj, theirs.mlp.proj)):
            lin.weight.copy_(src.weight)
            lin.bias.copy_(src.bias)
    m.ln_f.load_state_dict(gt.final_norm.state_dict())
    return m


# ---- DTensor tensor parallelism ------------------------------------------------------------------

def parallelize_dtensor(model: PlainGPT, mesh, *, loss_parallel: bool, prepare_attn_input: bool) -> None:
    """The torchtitan-style plan (without sequence parallelism) applied in place."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    plan: dict[str, Any] = {
        "tok": RowwiseParallel(input_layouts=Replicate()),  # vocab-sharded table, summed output
        "head": (ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if loss_parallel
                 else ColwiseParallel(output_layouts=Replicate())),
    }
    for i in range(len(model.blocks)):
        p = f"blocks.{i}"
        plan.update({f"{p}.attn.q": ColwiseParallel(), f"{p}.attn.k": ColwiseParallel(),
                     f"{p}.attn.v": ColwiseParallel(), f"{p}.attn.out": RowwiseParallel(),
                     f"{p}.fc": ColwiseParallel(), f"{p}.proj": RowwiseParallel()})
        if prepare_attn_input:
            # The attention input becomes one replicated DTensor shared by q, k and v, so
            # their partial input gradients are added up before a single all-reduce.
            plan[f"{p}.attn"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                   desired_input_layouts=(Replicate(),),
                                                   use_local_output=False)
    parallelize_module(model, mesh, plan)
    # parallelize_module replaces each module's parameters by new DTensor parameters, which
    # unties the head from the embedding; both are Shard(0) over the vocabulary: tie again.
    if model.head.weight.placements != model.tok.weight.placements:
        raise RuntimeError(f"cannot re-tie: head {model.head.weight.placements} vs "
                           f"embedding {model.tok.weight.placements}")
    model.head.weight = model.tok.weight
    if loss_parallel:
        model.logit_mask = distribute_tensor(model.logit_mask, mesh, [Shard(0)])


class CollectiveBytes(TorchDispatchMode):
    """Counts the functional collectives DTensor issues, with gridtrain's conventions: the
    full tensor of an all-reduce, the gathered output of an all-gather, the input of a
    reduce-scatter."""

    KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run first and lower itself to collectives on plain tensors
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "overloadpacket", func).__name__
        if getattr(func, "namespace", "") in ("_c10d_functional", "c10d_functional") and name.startswith(self.KINDS):
            t = out if name.startswith("all_gather") else args[0]
            tensors = t if isinstance(t, (list, tuple)) else [t]
            self.bytes += sum(x.numel() * x.element_size() for x in tensors)
            self.calls[name] = self.calls.get(name, 0) + 1
        return out


@contextlib.contextmanager
def timed_collectives(comm):
    """Time gridtrain's TP all-reduces (issue and wait) by wrapping this CommGroup's method."""
    clock = {"seconds": 0.0}

    def all_reduce(tensor, *args, **kwargs):
        began = time.perf_counter()
        try:
            return type(comm).all_reduce(comm, tensor, *args, **kwargs)
        finally:
            clock["seconds"] += time.perf_counter() - began

    comm.all_reduce = all_reduce  # an instance attribute shadows the method
    try:
        yield clock
    finally:
        del comm.all_reduce


# ---- the two kinds of step ---------------------------------------------------------------------------

Step = Callable[[], tuple[Any, tuple[float, float, float]]]  # one step -> (loss, forward / backward / AdamW s)


def plain_step(model: nn.Module, loss_fn: Callable[[], torch.Tensor],
               context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> Step:
    """The peers' step: zero grads, forward and loss (inside ``context``), backward, AdamW
    with gridtrain's parameter groups and defaults."""
    opt = build_optimizer(model, OptimConfig())

    def step():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with context():
            loss = loss_fn()
            t1 = time.perf_counter()
            loss.backward()
        t2 = time.perf_counter()
        opt.step()
        return loss.detach(), (t1 - t0, t2 - t1, time.perf_counter() - t2)

    return step


def gridtrain_step(trainer: Trainer, batches: list[dict]) -> Step:
    """``trainer.train_step(batches)``, split as the plain step is: forward = up to the end of
    the forward (zeroing, the token count), backward = from there to AdamW (backward, the
    gradient reduction, the gradient norm), AdamW = ``optimizer.step``, timed around it."""
    trainer.pipeline.tracing = True  # StageStats.trace: (action, start, end), cheap
    clock: dict[str, float] = {}
    adamw = trainer.optimizer.step

    def timed_adamw() -> None:
        clock["began"] = time.perf_counter()
        adamw()
        clock["ended"] = time.perf_counter()

    trainer.optimizer.step = timed_adamw

    def step():
        t0 = time.perf_counter()
        out = trainer.train_step(batches)
        t1 = max(end for name, _, end in out.stage.trace if name.startswith("F"))
        return out.loss, (t1 - t0, clock["began"] - t1, clock["ended"] - clock["began"])

    return step


@dataclass(kw_only=True)
class Setup(Side):
    """One way of training the model: ``step()`` runs one full training step."""

    step: Step
    losses: list = field(default_factory=list)
    bytes_per_step: int | None = None  # TP payload (gridtrain: its tp group)
    other_bytes: dict[str, int] = field(default_factory=dict)  # gridtrain: other groups' payload per step
    calls_per_step: dict[str, int] = field(default_factory=dict)
    comm_fraction: tuple[float, float] | None = None  # (s in collectives, s) per step


def _loss_value(loss) -> float:
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


# ---- the worker ------------------------------------------------------------------------------------

def _worker(rank: int, world: int, opts: dict) -> dict | None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    cfg = _config(opts)
    m = cfg.model
    batches = common.random_batches(cfg, opts["batch"])  # one micro-batch
    tokens, labels = batches[0]["tokens"], batches[0]["labels"]
    notes: list[str] = []

    # gridtrain tp=2: grid, groups, TensorParallel with a ByteCounter, model, pipeline, optimizer
    gt = common.build_gpt(cfg)
    setups = [Setup(name="gridtrain tp=2", step=gridtrain_step(gt, batches))]

    # DTensor tp=2: the plain model with the same padded vocabulary and the same numbers
    mesh = init_device_mesh("cpu", (TP,))

    def make_dtensor(lp: bool, prep: bool) -> PlainGPT:
        whole = Decoder(replace(m, vocab_pad_multiple=m.vocab_pad_multiple * TP))  # same padding, one rank
        init_parameters(whole, opts["seed"])
        assert whole.padded_vocab == gt.model.padded_vocab
        model = plain_from_gridtrain(whole)
        parallelize_dtensor(model, mesh, loss_parallel=lp, prepare_attn_input=prep)
        return model

    def dtensor_setup(name: str, prep: bool) -> Setup:
        lp = opts["loss"] == "parallel"
        model = make_dtensor(lp, prep)
        if lp:
            try:  # probe loss_parallel on this backend once (forward + backward, no update)
                with loss_parallel():
                    F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
                model.zero_grad(set_to_none=True)
            except Exception:  # noqa: BLE001 -- record and fall back to replicated logits
                notes.append(f"{name}: loss_parallel failed, fell back to replicated logits:\n"
                             + traceback.format_exc(limit=3))
                lp = False
                model = make_dtensor(False, prep)
        loss_fn = lambda: F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())  # noqa: E731
        if lp:
            return Setup(name=name, step=plain_step(model, loss_fn, loss_parallel))
        return Setup(name=name + " (replicated logits)", step=plain_step(model, loss_fn))

    setups.append(dtensor_setup("DTensor tp=2", prep=False))
    if opts["dtensor_variant"]:
        setups.append(dtensor_setup("DTensor tp=2, attn PrepareModuleInput", prep=True))

    # one-process references, computed on rank 0 with every core while rank 1 waits
    if opts["reference"]:
        ref = common.build_gpt_one_process(cfg)  # padded vocabulary of one rank (320 for 257), masked alike
        ref_plain = plain_from_gridtrain(ref.model)
        cores = common.reference_threads(opts)
        setups.append(Setup(name="gridtrain 1 process", step=gridtrain_step(ref, batches),
                            active=rank == 0, threads=cores))
        setups.append(Setup(name="plain PyTorch 1 process", active=rank == 0, threads=cores,
                            step=plain_step(ref_plain, lambda: F.cross_entropy(ref_plain(tokens).flatten(0, 1),
                                                                               labels.flatten()))))

    def run_block(s: Setup, steps: int, instrument: bool = False) -> tuple[float, tuple | None]:
        """``steps`` steps of one setup between two barriers; ``instrument`` counts and times
        the collectives (untimed warm-up only: the dispatch mode adds its own overhead)."""
        is_gt = s is setups[0]
        # gridtrain: its ByteCounter plus a timer around its TP all-reduces (cheap); DTensor: a
        # dispatch mode that sees every op (counts are exact, but it slows the step down)
        mode = CollectiveBytes() if instrument and not is_gt else contextlib.nullcontext()
        timer = timed_collectives(gt.ctx.tp.comm) if instrument and is_gt else contextlib.nullcontext()
        gt.ctx.bytes.reset()

        def run() -> tuple[list[float], dict | None]:
            phases = [0.0, 0.0, 0.0]
            with mode, timer as clock:
                for _ in range(steps):
                    loss, split = s.step()
                    s.losses.append(loss)
                    phases = [a + b for a, b in zip(phases, split)]
            return phases, clock

        elapsed, ran = common.between_barriers(s, run)
        if ran is None:
            return elapsed, None
        phases, clock = ran
        if instrument and is_gt:
            moved = {f"{k}/{g}": n // steps for (k, g), n in gt.ctx.bytes.bytes.items()}
            s.bytes_per_step = sum(n for key, n in moved.items() if key.endswith("/tp"))
            s.other_bytes = {key: n for key, n in moved.items() if not key.endswith("/tp")}
            s.calls_per_step = {f"{k}/{g}": v // steps for (k, g), v in gt.ctx.bytes.calls.items()}
            s.comm_fraction = (clock["seconds"] / steps, elapsed / steps)
        elif instrument and mode.calls:
            s.bytes_per_step = mode.bytes // steps
            s.calls_per_step = {k: v // steps for k, v in mode.calls.items()}
        return elapsed, tuple(p / steps for p in phases)

    # warm-up: every setup its own steps; all but the first count and time the collectives
    for s in setups:
        run_block(s, 1, instrument=opts["warmup"] == 1)
        if opts["warmup"] > 1:
            run_block(s, opts["warmup"] - 1, instrument=True)

    # the cost of one all-reduce of a [b, s, d] activation on this group, for the reading
    x = torch.randn(opts["batch"], m.seq_len, m.d_model)
    allreduce_s = common.isolated_seconds(lambda: dist.all_reduce(x))

    common.timed_rounds(setups, opts, run_block)
    if rank != 0:
        return None
    return {
        "setups": [{"name": s.name, "times": s.times, "phases": s.rounds,
                    "losses": [_loss_value(x) for x in s.losses], "bytes_per_step": s.bytes_per_step,
                    "other_bytes": s.other_bytes, "calls_per_step": s.calls_per_step,
                    "comm_fraction": s.comm_fraction}
                   for s in setups],
        "notes": notes,
        "padded_vocab": gt.model.padded_vocab,
        "threads_per_rank": torch.get_num_threads(),
        "allreduce_s": allreduce_s,
    }


# ---- parent: configuration and report ---------------------------------------------------------------

def _config(opts: dict) -> Config:
    return common.make_config(opts, ParallelConfig(nproc=TP, tp=TP), micro_batch_size=opts["batch"],
                              global_batch_size=opts["batch"])


def expected_gridtrain_bytes(opts: dict) -> int:
    """Closed form of gridtrain's TP payload per step (no sequence parallelism).

    Per layer two all-reduces of [b, s, d] forward (attention and MLP outputs) and two
    backward (inputs of QKV and fc); the embedding adds one forward, the LM head one
    backward; the vocabulary-parallel cross entropy three of [b, s] (max, target, sum).
    """
    b, s, d, L = opts["batch"], opts["seq_len"], opts["d_model"], opts["n_layer"]
    return 4 * ((4 * L + 2) * b * s * d + 3 * b * s)


def _fmt_calls(calls: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(calls.items()))


def report(run: common.Run, opts: dict) -> str:
    result = run.results[0]
    tokens = opts["batch"] * opts["seq_len"]
    rows = result["setups"]
    dt = next(r for r in rows if r["name"].startswith("DTensor tp=2"))
    lines = common.header(
        run, opts,
        shape=f"{opts['n_layer']} layers, d_model {opts['d_model']}, {opts['n_head']} heads, seq {opts['seq_len']}, "
              f"vocab 257 (padded to {result['padded_vocab']} at tp=2), batch {opts['batch']} sequences = "
              f"{tokens} tokens/step, fp32",
        threads=f"gloo; tp=2 ranks use {result['threads_per_rank']} thread(s) each, one-process references "
                f"{common.reference_threads(opts)}")
    lines += [f"| setup | tokens/s | step ms | best step ms | fwd / bwd / AdamW ms | vs {dt['name']} |",
              "| --- | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        t = med(r["times"])
        ph = [med(p[i] for p in r["phases"]) * 1e3 for i in range(3)]
        # tokens/s ratio against DTensor, paired within each round (adjacent in time), median
        lines.append(f"| {r['name']} | {tokens / t:,.0f} | {t * 1e3:.1f} | {min(r['times']) * 1e3:.1f} | "
                     f"{ph[0]:.1f} / {ph[1]:.1f} / {ph[2]:.1f} | {common.paired_ratio(dt['times'], r['times']):.2f}x |")
    lines += ["", "gridtrain's split: fwd = to the end of the forward (zeroing, token count), bwd = backward, "
                  "gradient reduction and norm, AdamW = optimizer.step; the others: zero_grad + forward, backward, "
                  "AdamW"]
    lines += common.per_round("tokens/s per round:", ((r["name"], r["times"]) for r in rows),
                              lambda t: f"{tokens / t:,.0f}")
    gt_row = rows[0]
    exp = expected_gridtrain_bytes(opts)
    others = ", ".join(f"{k} {v:,}" for k, v in sorted(gt_row["other_bytes"].items()))
    lines += ["", f"gridtrain TP bytes/step (ByteCounter, tp group): {gt_row['bytes_per_step']:,} (closed form "
                  f"{exp:,}: {'match' if gt_row['bytes_per_step'] == exp else 'MISMATCH'}); "
                  f"{_fmt_calls(gt_row['calls_per_step'])}" + (f"; other groups: {others} (the gradient norm)"
                                                                 if others else "")]
    for r in rows[1:]:
        if r["bytes_per_step"] is not None:
            lines.append(f"{r['name']} bytes/step (functional collectives, same convention): "
                         f"{r['bytes_per_step']:,}; {_fmt_calls(r['calls_per_step'])}")
    for r in rows:
        if r["comm_fraction"]:
            c, t = r["comm_fraction"]
            lines.append(f"{r['name']}: {c * 1e3:.1f} ms of a {t * 1e3:.1f} ms step ({100 * c / t:.0f}%) inside "
                         "its TP all-reduces, waiting included (timed in the warm-up steps)")
    act = opts["batch"] * opts["seq_len"] * opts["d_model"] * 4
    lines.append(f"one gloo all-reduce of a [b, s, d] activation ({mib(act)}): "
                 f"{result['allreduce_s'] * 1e3:.2f} ms (median of 30, after a barrier)")
    ref = gt_row["losses"]
    diffs = [f"{r['name']} {abs(ref[0] - r['losses'][0]):.1e} / "
             f"{max(abs(a - b) for a, b in zip(ref, r['losses'])):.1e}" for r in rows[1:]]
    lines.append(f"loss check ({len(ref)} steps on each setup from the same weights and batch; loss "
                 f"{ref[0]:.4f} at step 1, {ref[-1]:.4f} at the last): |loss - gridtrain tp=2 loss| "
                 "at step 1 / largest over all steps: " + "; ".join(diffs))
    return "\n".join(lines + common.footer(run, result["notes"]))


def parse_args(argv: list[str] | None = None) -> dict:
    p = common.benchmark_parser(__doc__, steps=10, warmup=5, repeats=6)
    p.add_argument("--batch", type=int, default=8, help="sequences per step, one micro-batch (default: %(default)s)")
    p.add_argument("--loss", choices=("parallel", "replicated"), default="parallel",
                   help="DTensor loss: loss_parallel() on vocabulary-sharded logits (default), "
                        "or all-gathered logits and a plain cross entropy")
    p.add_argument("--no-variant", dest="dtensor_variant", action="store_false",
                   help="skip the DTensor variant with PrepareModuleInput on each attention module")
    return common.parse(p, argv)


def main(argv: list[str] | None = None) -> int:
    return common.benchmark_main("tp_vs_dtensor", argv, parse_args, lambda opts: [_config(opts)], TP, _worker,
                                 report)


if __name__ == "__main__":
    sys.exit(main())
