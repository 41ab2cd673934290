"""Activation recomputation: the step time each mode costs, beside the memory it saves.

One Decoder (shape, initial weights, batch, dropout masks, optimizer) is trained in one
process three ways, alternating step blocks inside the same process:

* ``none``: every block keeps what autograd saves for backward;
* ``selective``: the attention core (scores, softmax, dropout, weighted sum) of every
  block is recomputed in backward (Korthikanti et al.); the rest is kept;
* ``full``: every block is one recomputed region (``recompute_method = "uniform"``,
  ``recompute_layers = 1``): only its input is kept, its whole forward runs again in
  backward.

Each setup is built once by ``gridtrain.training.trainer.build``, as ``pretrain`` builds it (a
one-rank gloo world and its own context, whose ``Recomputation`` carries the setup's
policy; ``decoder_model_provider``; the one-stage pipeline: a gradient-accumulation loop
over the micro-batches; the reducer; the optimizer); a step is ``Trainer.train_step``:
forward and backward of every micro-batch, the gradient norm and clipping, AdamW.
fp32, ``--dropout`` in the attention and residual dropouts, a fixed batch of random
token ids, no learning-rate schedule, no data loading.

The setups run interleaved, so each one's random generators (the CPU generator and the
tensor-parallel tracker's streams) are swapped in before its steps and saved after
them: every setup draws the same dropout masks at the same step, and since a recomputed
region replays the masks it drew at forward, all three compute the same losses. The run
checks that, step by step.

Timing (benchmarks/common.py): every setup first runs ``--warmup`` untimed steps (the
first of them inside gridtrain's saved-tensor hooks, which measure the bytes kept for
backward); then
``--repeats`` rounds, each timing ``--steps`` steps of every setup in turn with
``time.perf_counter`` (the order reversed every other round). Reported: median step
time over rounds, the ratio to ``none`` (median of the per-round ratios, since a round's
setups run next to each other in time), and the measured saved-activation bytes.

Run from the repository root::

    python3 benchmarks/recompute_cost.py                     # `small` shape, math attention: ~35 s on 2 idle cores
    python3 benchmarks/recompute_cost.py --attention sdpa
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import torch

import common  # benchmarks/common.py: the script's own folder is on sys.path
from common import Side, med, mib
from gridtrain.memory import activations as memory
from gridtrain.config import Config, OptimConfig, ParallelConfig
from gridtrain.models.decoder import IGNORE_INDEX
from gridtrain.runtime.activation_meter import ActivationMeter, saved_activations
from gridtrain.parallel.rng import RNGState
from gridtrain.training.report import StageMemory
from gridtrain.training.trainer import Trainer

MODES = ("none", "selective", "full")


@dataclass(kw_only=True)
class Setup(Side):
    """One recomputation mode (its ``name``): what ``build`` made, kept for the whole run,
    and its own random state between its blocks of steps."""

    trainer: Trainer
    rng: RNGState | None = None
    losses: list[float] = field(default_factory=list)  # every step, warm-up included
    saved: StageMemory | None = None  # measured at the first warm-up step
    regions_per_step: int = 0


# ---- building and stepping ------------------------------------------------------------------

def make_config(opts: dict, mode: str) -> Config:
    """The `small` preset with the shape flags, one process, recompute ``mode``, clipping on."""
    model = {"dropout": opts["dropout"], "attention": opts["attention"]}
    return common.make_config(opts, ParallelConfig(nproc=1), model, micro_batch_size=opts["micro_batch_size"],
                              global_batch_size=opts["global_batch_size"], recompute=mode,
                              grad_clip=OptimConfig.grad_clip)


def run_steps(s: Setup, batches: list[dict], steps: int) -> float:
    """``steps`` training steps of ``s``; returns the seconds they took.

    The setup's random state is restored first and saved after, outside the timed
    region, so the setups' interleaving does not change the dropout masks any of them
    draws (and recomputation would be compared on different masks otherwise)."""
    ctx = s.trainer.ctx
    s.rng.restore(ctx.tp.rng, ctx.device)
    began = time.perf_counter()
    for _ in range(steps):
        s.losses.append(s.trainer.train_step(batches).loss)
    elapsed = time.perf_counter() - began
    s.rng = RNGState.capture(ctx.tp.rng, ctx.device)
    return elapsed


def measure_memory(s: Setup, batches: list[dict]) -> None:
    """One (warm-up) step inside gridtrain's saved-tensor hooks, as ``pretrain`` measures
    its first step: bytes kept per layer, bytes saved while recomputing, the peak. The
    hooks cost time, so this step is never timed."""
    meter = ActivationMeter.for_model(s.trainer.model)
    recompute = s.trainer.ctx.recompute
    rebuilt_before = recompute.recomputed
    with saved_activations(meter):
        run_steps(s, batches, 1)
    s.regions_per_step = recompute.recomputed - rebuilt_before
    s.saved = StageMemory(stage=0, micro_batches=len(batches), kept=meter.by_layer(),
                          recomputed=meter.by_layer("recompute"), peak_bytes=meter.peak_bytes)


def _worker(rank: int, world: int, opts: dict) -> tuple[list[Setup], dict]:
    """Build the setups, warm up (measuring memory), then the timed, interleaved rounds
    (in this process: a one-rank world)."""
    torch.set_num_threads(opts["threads"])
    setups = [Setup(name=mode, trainer=common.build_gpt(make_config(opts, mode))) for mode in MODES]
    cfg = setups[0].trainer.cfg
    batches = common.random_batches(cfg, cfg.training.global_batch_size)
    for s in setups:  # the same starting random state everywhere (the trackers are seeded alike)
        torch.manual_seed(opts["seed"])
        s.rng = RNGState.capture(s.trainer.ctx.tp.rng, s.trainer.ctx.device)
    for s in setups:
        measure_memory(s, batches)
        run_steps(s, batches, opts["warmup"] - 1)
    common.timed_rounds(setups, opts, lambda s, steps: (run_steps(s, batches, steps), None))
    tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    info = {"tokens": tokens, "params": sum(p.numel() for p in setups[0].trainer.model.parameters()),
            "micro_batches": len(batches), "threads": torch.get_num_threads(), "sdpa_kernel": sdpa_kernel(cfg)}
    return setups, info


# ---- the report -------------------------------------------------------------------------------

def block_bytes(stage: StageMemory, which: dict[str, int]) -> float:
    """Bytes per micro-batch summed over the transformer blocks (not embedding or head)."""
    return sum(n for layer, n in which.items() if layer.startswith("blocks.")) / stage.micro_batches


def formula_bytes(cfg: Config, mode: str) -> float:
    """Korthikanti et al.'s bytes per micro-batch for all blocks (gridtrain's adaptation,
    memory.korthikanti_bytes); it describes the op-by-op attention only."""
    m = cfg.model
    per_block = memory.korthikanti_bytes(
        seq=m.seq_len, batch=cfg.training.micro_batch_size, hidden=m.d_model, heads=m.n_head,
        ffn=m.ffn_size, recompute=mode, element_bytes=4,
        mask_bytes=memory.dropout_mask_bytes(torch.device("cpu"), 4), dropout=m.dropout > 0)
    return m.n_layer * per_block


def sdpa_kernel(cfg: Config) -> str:
    """Which kernel torch's ``scaled_dot_product_attention`` picks for this shape, read
    from the autograd node of one probe call. On the CPU the fused (flash) kernel takes
    no dropout, so with dropout > 0 torch runs its op-by-op math path, which saves what
    ``--attention math`` saves; this line says so instead of leaving it to be guessed."""
    m, b = cfg.model, cfg.training.micro_batch_size
    qkv = torch.randn(b, m.seq_len, 3, m.n_head, m.head_dim, requires_grad=True)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # the model's layout: views of one fused QKV output
    with torch.random.fork_rng(devices=[]):  # the probe's dropout draws must not move the run's stream
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=m.dropout)
    name = type(out.grad_fn).__name__
    fused = "Attention" in name  # e.g. ScaledDotProductFlashAttentionForCpuBackward0
    return f"{name} ({'fused kernel' if fused else 'math fallback: unfused ops, s x s tensors kept'})"


def table(setups: list[Setup]) -> list[str]:
    none = setups[0]
    math = none.trainer.cfg.model.attention == "math"
    lines = ["| setup | median step s | best step s | vs none | saved per micro-batch (blocks) | "
             + ("formula (blocks) | " if math else "") + "recomputed per micro-batch | peak saved |",
             "| --- | ---: | ---: | ---: | ---: | " + ("---: | " if math else "") + "---: | ---: |"]
    for s in setups:
        formula = f"{mib(formula_bytes(s.trainer.cfg, s.name))} | " if math else ""
        lines.append(f"| {s.name} | {med(s.times):.3f} | {min(s.times):.3f} | "
                     f"**{common.paired_ratio(s.times, none.times):.2f}x** | "
                     f"{mib(block_bytes(s.saved, s.saved.kept))} | {formula}"
                     f"{mib(block_bytes(s.saved, s.saved.recomputed))} | {mib(s.saved.peak_bytes)} |")
    return lines


def loss_check(setups: list[Setup]) -> str:
    ref = setups[0].losses
    diffs = {s.name: max(abs(a - b) for a, b in zip(ref, s.losses)) for s in setups[1:]}
    same_length = all(len(s.losses) == len(ref) for s in setups)
    verdict = "IDENTICAL" if same_length and not any(diffs.values()) else \
        "DIFFERENT" if not same_length or max(diffs.values()) > 1e-5 * abs(ref[0]) else "AGREE within 1e-5 relative"
    return (f"loss check over all {len(ref)} steps (warm-up included), the same weights, batch and "
            f"dropout masks: {verdict}; max |loss - none's|: " +
            ", ".join(f"{mode} {d:.1e}" for mode, d in diffs.items()) +
            f"; step 1 {ref[0]:.6f}, last step {ref[-1]:.6f}")


def report(run: common.Run, opts: dict) -> str:
    setups, info = run.results[0]
    m, t = setups[0].trainer.cfg.model, setups[0].trainer.cfg.training
    lines = common.header(
        run, opts,
        shape=f"{m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads, seq {m.seq_len}, vocab {m.vocab_size}, "
              f"{info['params']:,} parameters, fp32; attention {m.attention}, dropout {m.dropout}; "
              f"{info['micro_batches']} micro-batches x {t.micro_batch_size} sequences = {info['tokens']:,} tokens/step",
        threads=f"one process with {info['threads']} torch thread(s)",
        timing="; the first warm-up step measures memory; a step = Trainer.train_step (forward + backward of every "
               "micro-batch, grad norm and clipping, AdamW); vs none = median of the per-round ratios")
    lines += [
        *table(setups),
        "",
        "saved = bytes autograd keeps for backward at forward (gridtrain.runtime.activation_meter hooks, one storage counted once), "
        "per micro-batch, summed over the blocks; recomputed = bytes saved again while a region is rebuilt in "
        "backward (transient); peak = most bytes held at once during the step, embedding and head included",
    ]
    if m.attention != "math":
        lines.append("no formula column: Korthikanti et al.'s formula describes the op-by-op attention "
                     "(--attention math); a fused kernel keeps no s x s tensors")
        lines.append(f"sdpa kernel for this shape and dropout {m.dropout} (autograd node of a probe call): "
                     f"{info['sdpa_kernel']}")
    lines.append("regions recomputed per step: " +
                 ", ".join(f"{s.name} {s.regions_per_step}" for s in setups) +
                 f" ({m.n_layer} blocks x {info['micro_batches']} micro-batches = "
                 f"{m.n_layer * info['micro_batches']} expected for selective and full)")
    lines += common.per_round("step s per round:", ((s.name, s.times) for s in setups), lambda x: f"{x:.3f}")
    lines.append(loss_check(setups))
    return "\n".join(lines + common.footer(run))


# ---- command line -----------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> dict:
    p = common.benchmark_parser(__doc__, steps=4, warmup=3, repeats=16, ranks=False)
    p.add_argument("--attention", choices=("sdpa", "math"), default="math",
                   help="attention core: op by op (math, what the memory formula describes) or torch's "
                        "fused kernel (default: %(default)s)")
    p.add_argument("--dropout", type=float, default=0.1, help="default: %(default)s")
    common.add_micro_batch_arguments(p)
    p.add_argument("--global-batch-size", type=int, default=16,
                   help="sequences per step, a multiple of --micro-batch-size (default: %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of the one process (default: every core, %(default)s)")
    opts = common.parse(p, argv, "threads")
    if opts["global_batch_size"] % opts["micro_batch_size"]:
        p.error("--global-batch-size must be a multiple of --micro-batch-size")
    return opts


def main(argv: list[str] | None = None) -> int:
    return common.benchmark_main("recompute_cost", argv, parse_args,
                                 lambda opts: [make_config(opts, mode) for mode in MODES], 1, _worker, report)


if __name__ == "__main__":
    sys.exit(main())
