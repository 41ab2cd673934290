"""Tensor parallelism side by side: gridtrain's Megatron-style TP against PyTorch DTensor TP.

The same GPT (shape, initial weights, batch, loss, optimizer) is trained for a few steps
on two gloo processes in two ways, alternating inside the same two processes:

* ``gridtrain tp=2``: ``gridtrain.model.GPT`` built on the ``TensorParallel`` context of
  ``gridtrain.distributed.setup_distributed`` (column/row-parallel linears with fused
  QKV, vocabulary-parallel embedding and cross entropy, hand-written autograd
  collectives counted by a ``ByteCounter``);
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
  barrier): gridtrain's GPT and the plain GPT.

A step is: zero grads, forward (embedding, blocks, final LayerNorm, LM head, mean token
cross entropy), backward, AdamW step (gridtrain's parameter groups and defaults: lr 1e-3,
betas (0.9, 0.95), weight decay 0.1 on matrices). No clipping, no LR schedule.

Both models start from the same numbers (gridtrain's ``init_parameters``, copied into the
plain model; the fused QKV split into q, k, v) and see the same batch, so their losses
must agree step for step (to fp32 rounding); the run prints the differences.

Timing: every setup first runs ``--warmup`` untimed steps (the last one also counts the
collectives); then ``--repeats`` rounds, each timing ``--steps`` steps of every setup in
turn (the order reversed every other round), between two barriers, with
``time.perf_counter`` on rank 0. Reported: medians over rounds, the best round, the
forward / backward / AdamW split, and the tokens/s ratio to DTensor paired per round.

Vocabulary: gridtrain pads 257 to ``padded_vocab_size(tp)`` (384 at tp=2) and masks the
padding columns to -inf in its cross entropy. The DTensor model uses the same padded
table and adds a fixed, sharded 0/-inf mask to its logits, so both compute the same
matmuls and the same loss.

Run from the repository root::

    python3 benchmarks/tp_vs_dtensor.py        # `small` preset shape: ~30 s on 2 idle cores
    python3 benchmarks/tp_vs_dtensor.py --d-model 512 --n-head 8 --steps 5 --repeats 4 --warmup 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import traceback
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from common import add_shape_and_timing_arguments, run_benchmark  # benchmarks/common.py: the script's own folder is on sys.path
from gridtrain.config import Config, ParallelConfig, TrainingConfig, preset_config
from gridtrain.distributed import setup_distributed
from gridtrain.model import GPT, init_parameters
from gridtrain.optim import build_optimizer

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


class PlainMLP(nn.Module):
    def __init__(self, d_model: int, ffn: int):
        super().__init__()
        self.fc = nn.Linear(d_model, ffn)
        self.proj = nn.Linear(ffn, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class PlainBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, ffn: int, eps: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=eps)
        self.attn = PlainAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model, eps=eps)
        self.mlp = PlainMLP(d_model, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


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
def plain_from_gridtrain(gt: GPT) -> PlainGPT:
    """A PlainGPT holding exactly the weights of a one-rank gridtrain GPT."""
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
        for lin, src in ((mine.attn.out, theirs.attn.proj), (mine.mlp.fc, theirs.mlp.fc),
                         (mine.mlp.proj, theirs.mlp.proj)):
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
                     f"{p}.mlp.fc": ColwiseParallel(), f"{p}.mlp.proj": RowwiseParallel()})
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


# ---- the setups ------------------------------------------------------------------------------------

class Setup:
    """One way of training the model: ``step()`` runs one full training step."""

    def __init__(self, name: str, model: nn.Module, loss_fn: Callable[[], torch.Tensor],
                 *, active: bool = True, threads: int | None = None,
                 context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.name = name
        self.model = model
        self.loss_fn = loss_fn
        self.opt = build_optimizer(model, TrainingConfig())
        self.active = active  # False: this rank only waits (one-process references)
        self.threads = threads
        self.context = context
        self.losses: list[torch.Tensor] = []
        self.times: list[float] = []  # seconds per step, one entry per repeat
        self.phases: list[tuple[float, float, float]] = []  # fwd, bwd, opt per step, per repeat
        self.bytes_per_step: int | None = None
        self.calls_per_step: dict[str, int] = {}
        self.comm_fraction: tuple[float, float] | None = None  # (s in collectives, s) per step

    def step(self) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        with self.context():
            loss = self.loss_fn()
            t1 = time.perf_counter()
            loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        self.losses.append(loss.detach())
        return t1 - t0, t2 - t1, t3 - t2


def _loss_value(loss: torch.Tensor) -> float:
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def _worker(rank: int, world: int, opts: dict) -> dict | None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    base_threads = torch.get_num_threads()
    cfg = _config(opts)
    m = cfg.model
    ctx = setup_distributed(cfg)  # grid, groups, TensorParallel with a ByteCounter, RNG streams
    gen = torch.Generator().manual_seed(opts["seed"])
    data = torch.randint(0, m.vocab_size, (opts["batch"], m.seq_len + 1), generator=gen)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    notes: list[str] = []

    # gridtrain tp=2
    gt = GPT(m, tp=ctx.tp)
    init_parameters(gt, opts["seed"])
    setups = [Setup("gridtrain tp=2", gt, lambda: gt(tokens, labels).mean())]

    # DTensor tp=2: the plain model with the same padded vocabulary and the same numbers
    mesh = init_device_mesh("cpu", (TP,))

    def make_dtensor(lp: bool, prep: bool) -> PlainGPT:
        whole = GPT(replace(m, vocab_pad_multiple=m.vocab_pad_multiple * TP))  # same padding, one rank
        init_parameters(whole, opts["seed"])
        assert whole.padded_vocab == gt.padded_vocab
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
        if lp:
            fn = lambda: F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())  # noqa: E731
            return Setup(name, model, fn, context=loss_parallel)
        name += " (replicated logits)"
        return Setup(name, model, lambda: F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()))

    setups.append(dtensor_setup("DTensor tp=2", prep=False))
    if opts["dtensor_variant"]:
        setups.append(dtensor_setup("DTensor tp=2, attn PrepareModuleInput", prep=True))

    # one-process references, computed on rank 0 with every core while rank 1 waits
    if opts["reference"]:
        ref_gt = GPT(m)  # padded vocabulary of one rank (320 for 257), masked like the others
        init_parameters(ref_gt, opts["seed"])
        ref_plain = plain_from_gridtrain(ref_gt)
        cores = opts["ref_threads"] or os.cpu_count() or 1
        setups.append(Setup("gridtrain 1 process", ref_gt, lambda: ref_gt(tokens, labels).mean(),
                            active=rank == 0, threads=cores))
        setups.append(Setup("plain PyTorch 1 process", ref_plain,
                            lambda: F.cross_entropy(ref_plain(tokens).flatten(0, 1), labels.flatten()),
                            active=rank == 0, threads=cores))

    def run_block(s: Setup, steps: int, instrument: bool = False) -> tuple[float, list[float]]:
        """``steps`` steps of one setup between two barriers; ``instrument`` counts and times
        the collectives (untimed warm-up only: the dispatch mode adds its own overhead)."""
        torch.set_num_threads(s.threads or base_threads)
        phases = [0.0, 0.0, 0.0]
        is_gt = s.model is gt
        # gridtrain: its ByteCounter plus a timer around its all-reduces (cheap); DTensor: a
        # dispatch mode that sees every op (counts are exact, but it slows the step down)
        mode = CollectiveBytes() if instrument and not is_gt else contextlib.nullcontext()
        timer = timed_collectives(ctx.tp.comm) if instrument and is_gt else contextlib.nullcontext()
        ctx.bytes.reset()
        dist.barrier()
        start = time.perf_counter()
        if s.active:
            with mode, timer as clock:
                for _ in range(steps):
                    for i, t in enumerate(s.step()):
                        phases[i] += t
        dist.barrier()
        elapsed = time.perf_counter() - start
        torch.set_num_threads(base_threads)
        if instrument and s.active:
            if is_gt:
                s.bytes_per_step = ctx.bytes.total() // steps
                s.calls_per_step = {k: v // steps for (k, _), v in ctx.bytes.calls.items()}
                s.comm_fraction = (clock["seconds"] / steps, elapsed / steps)
            elif mode.calls:
                s.bytes_per_step = mode.bytes // steps
                s.calls_per_step = {k: v // steps for k, v in mode.calls.items()}
        return elapsed, phases

    # warm-up: every setup its own steps; all but the first count and time the collectives
    for s in setups:
        run_block(s, 1, instrument=opts["warmup"] == 1)
        if opts["warmup"] > 1:
            run_block(s, opts["warmup"] - 1, instrument=True)

    # the cost of one all-reduce of a [b, s, d] activation on this group, for the reading
    x = torch.randn(opts["batch"], m.seq_len, m.d_model)
    samples = []
    for _ in range(30):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        samples.append(time.perf_counter() - t0)
    allreduce_s = statistics.median(samples)

    # timed: interleaved, order reversed every other repeat
    for r in range(opts["repeats"]):
        for s in (setups if r % 2 == 0 else setups[::-1]):
            elapsed, phases = run_block(s, opts["steps"])
            s.times.append(elapsed / opts["steps"])
            s.phases.append(tuple(p / opts["steps"] for p in phases))

    if rank != 0:
        return None
    return {
        "setups": [{"name": s.name, "times": s.times, "phases": s.phases,
                    "losses": [_loss_value(x) for x in s.losses],
                    "bytes_per_step": s.bytes_per_step, "calls_per_step": s.calls_per_step,
                    "comm_fraction": s.comm_fraction}
                   for s in setups],
        "notes": notes,
        "padded_vocab": gt.padded_vocab,
        "threads_per_rank": base_threads,
        "allreduce_s": allreduce_s,
    }


# ---- parent: configuration and report ---------------------------------------------------------------

def _config(opts: dict) -> Config:
    cfg = preset_config("small")
    cfg.model = replace(cfg.model, n_layer=opts["n_layer"], d_model=opts["d_model"],
                        n_head=opts["n_head"], seq_len=opts["seq_len"], dropout=0.0)
    cfg.parallel = ParallelConfig(nproc=TP, tp=TP)
    cfg.training = TrainingConfig(steps=2, micro_batch_size=opts["batch"], global_batch_size=opts["batch"],
                                  seed=opts["seed"], dtype="fp32", device="cpu",
                                  dist_timeout_s=opts["timeout"])
    return cfg


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


def report(result: dict, opts: dict, wall_s: float) -> str:
    tokens = opts["batch"] * opts["seq_len"]
    rows = result["setups"]
    dt = next(r for r in rows if r["name"].startswith("DTensor tp=2"))
    lines = [
        f"shape: {opts['n_layer']} layers, d_model {opts['d_model']}, {opts['n_head']} heads, "
        f"seq {opts['seq_len']}, vocab 257 (padded to {result['padded_vocab']} at tp=2), "
        f"batch {opts['batch']} sequences = {tokens} tokens/step, fp32",
        f"machine: {os.cpu_count()} CPU cores, gloo, torch {torch.__version__}; "
        f"tp=2 ranks use {result['threads_per_rank']} thread(s) each, one-process references "
        f"{opts['ref_threads'] or os.cpu_count()}; 1-min load average at start / end "
        f"{result['load'][0]:.1f} / {result['load'][1]:.1f}",
        f"timing: {opts['warmup']} warm-up steps, then {opts['repeats']} repeats x {opts['steps']} steps "
        "per setup, interleaved (order reversed every other repeat); medians over repeats",
        "",
        f"| setup | tokens/s | step ms | best step ms | fwd / bwd / AdamW ms | vs {dt['name']} |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        t = statistics.median(r["times"])
        ph = [statistics.median(p[i] for p in r["phases"]) * 1e3 for i in range(3)]
        # tokens/s ratio against DTensor, paired within each repeat (adjacent in time), median
        ratio = statistics.median(d / x for d, x in zip(dt["times"], r["times"]))
        lines.append(f"| {r['name']} | {tokens / t:,.0f} | {t * 1e3:.1f} | {min(r['times']) * 1e3:.1f} | "
                     f"{ph[0]:.1f} / {ph[1]:.1f} / {ph[2]:.1f} | {ratio:.2f}x |")
    lines.append("")
    lines.append("tokens/s per repeat:")
    for r in rows:
        lines.append(f"  {r['name']}: " + ", ".join(f"{tokens / t:,.0f}" for t in r["times"]))
    gt_row = rows[0]
    exp = expected_gridtrain_bytes(opts)
    lines.append("")
    lines.append(f"gridtrain TP bytes/step (ByteCounter): {gt_row['bytes_per_step']:,} "
                 f"(closed form {exp:,}: {'match' if gt_row['bytes_per_step'] == exp else 'MISMATCH'}); "
                 f"{_fmt_calls(gt_row['calls_per_step'])}")
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
    lines.append(f"one gloo all-reduce of a [b, s, d] activation ({act / 2**20:.2f} MiB): "
                 f"{result['allreduce_s'] * 1e3:.2f} ms (median of 30, after a barrier)")
    ref = gt_row["losses"]
    diffs = [f"{r['name']} {abs(ref[0] - r['losses'][0]):.1e} / "
             f"{max(abs(a - b) for a, b in zip(ref, r['losses'])):.1e}" for r in rows[1:]]
    lines.append(f"loss check ({len(ref)} steps on each setup from the same weights and batch; loss "
                 f"{ref[0]:.4f} at step 1, {ref[-1]:.4f} at the last): |loss - gridtrain tp=2 loss| "
                 "at step 1 / largest over all steps: " + "; ".join(diffs))
    for note in result["notes"]:
        lines.append("NOTE " + note.rstrip())
    lines.append(f"wall time {wall_s:.0f} s")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_and_timing_arguments(p, steps=10, warmup=5, repeats=6)
    p.add_argument("--batch", type=int, default=8, help="sequences per step, one micro-batch (default: %(default)s)")
    p.add_argument("--loss", choices=("parallel", "replicated"), default="parallel",
                   help="DTensor loss: loss_parallel() on vocabulary-sharded logits (default), "
                        "or all-gathered logits and a plain cross entropy")
    p.add_argument("--no-variant", dest="dtensor_variant", action="store_false",
                   help="skip the DTensor variant with PrepareModuleInput on each attention module")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the one-process references")
    p.add_argument("--ref-threads", type=int, default=0,
                   help="torch threads of the one-process references (default: every core)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="collective timeout in seconds (default: %(default)s)")
    opts = vars(p.parse_args(argv))
    if opts["warmup"] < 1 or opts["steps"] < 1 or opts["repeats"] < 1:
        p.error("--warmup, --steps and --repeats must be >= 1")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    ran = run_benchmark("tp_vs_dtensor", _config(opts), TP, _worker, opts)
    if ran is None:
        return 2
    results, wall_s, load = ran
    result = dict(results[0], load=load)
    print(report(result, opts, wall_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
