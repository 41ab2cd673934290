"""Activation recomputation: the step time each mode costs, beside the memory it saves.

One GPT (shape, initial weights, batch, dropout masks, optimizer) is trained in one
process three ways, alternating step blocks inside the same process:

* ``none``: every block keeps what autograd saves for backward;
* ``selective``: the attention core (scores, softmax, dropout, weighted sum) of every
  block is recomputed in backward (Korthikanti et al.); the rest is kept;
* ``full``: every block is one recomputed region (``recompute_method = "uniform"``,
  ``recompute_layers = 1``): only its input is kept, its whole forward runs again in
  backward.

Each setup is built once, as ``pretrain`` builds it: ``setup_distributed`` (a one-rank
gloo world; its ``Recomputation`` carries the setup's policy), ``gpt_model_provider``,
``build_pipeline`` (one stage: a gradient-accumulation loop over the micro-batches),
``GradientReducer``, ``make_optimizer``; a step is ``gridtrain.train.train_step``:
forward and backward of every micro-batch, the gradient norm and clipping, AdamW.
fp32, ``--dropout`` in the attention and residual dropouts, a fixed batch of random
token ids, no learning-rate schedule, no data loading.

The setups run interleaved, so each one's random generators (the CPU generator and the
tensor-parallel tracker's streams) are swapped in before its steps and saved after
them: every setup draws the same dropout masks at the same step, and since a recomputed
region replays the masks it drew at forward, all three compute the same losses. The run
checks that, step by step.

Timing: every setup first runs ``--warmup`` untimed steps (the first of them inside
gridtrain's saved-tensor hooks, which measure the bytes kept for backward); then
``--repeats`` rounds, each timing ``--steps`` steps of every setup in turn with
``time.perf_counter`` (the order reversed every other round). Reported: median step
time over rounds, the ratio to ``none`` (median of the per-round ratios, since a round's
setups run next to each other in time), and the measured saved-activation bytes.

Run from the repository root::

    python3 benchmarks/recompute_cost.py                     # `small` shape, math attention: ~35 s on 2 idle cores
    python3 benchmarks/recompute_cost.py --attention sdpa
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

from common import add_shape_and_timing_arguments  # benchmarks/common.py: the script's own folder is on sys.path
from gridtrain import memory
from gridtrain.config import Config, ConfigError, ParallelConfig, TrainingConfig, preset_config, validate
from gridtrain.data_parallel import GradientReducer
from gridtrain.distributed import DistributedContext, setup_distributed, shutdown
from gridtrain.model import IGNORE_INDEX
from gridtrain.pipeline.runtime import PipelineStage
from gridtrain.providers import gpt_forward_step, gpt_model_provider
from gridtrain.recompute import RNGState
from gridtrain.train import build_pipeline, make_optimizer, train_step

MODES = ("none", "selective", "full")


@dataclass
class Setup:
    """One recomputation mode's model, optimizer and pipeline, kept for the whole run,
    and its own random state between its blocks of steps."""

    mode: str
    cfg: Config
    ctx: DistributedContext
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    pipeline: PipelineStage
    reducer: GradientReducer
    rng: RNGState | None = None
    times: list[float] = field(default_factory=list)  # per round: seconds per step
    losses: list[float] = field(default_factory=list)  # every step, warm-up included
    saved: memory.StageMemory | None = None  # measured at the first warm-up step
    regions_per_step: int = 0


# ---- building and stepping ------------------------------------------------------------------

def make_config(opts: dict, mode: str) -> Config:
    """The `small` preset with the shape flags, one process, recompute ``mode``."""
    cfg = preset_config("small")
    m = cfg.model
    m.n_layer, m.d_model, m.n_head, m.seq_len = opts["n_layer"], opts["d_model"], opts["n_head"], opts["seq_len"]
    m.dropout, m.attention = opts["dropout"], opts["attention"]
    cfg.parallel = ParallelConfig(nproc=1)
    cfg.training = TrainingConfig(steps=100, warmup_steps=1, micro_batch_size=opts["micro_batch_size"],
                                  global_batch_size=opts["global_batch_size"], seed=opts["seed"],
                                  dtype="fp32", device="cpu", recompute=mode, progress=False)
    return cfg


def build_setup(opts: dict, mode: str) -> Setup:
    """The objects ``pretrain`` builds, for a one-rank world. Each setup gets its own
    context, so its ``Recomputation`` (policy, RNG tracker) is its own."""
    cfg = make_config(opts, mode)
    ctx = setup_distributed(cfg)
    model = gpt_model_provider(cfg, ctx)  # init_parameters: the same weights for every mode
    n_mb = cfg.training.global_batch_size // cfg.training.micro_batch_size
    pipeline = build_pipeline(model, cfg, ctx, gpt_forward_step, n_mb)
    reducer = GradientReducer(model, ctx.dp, accumulations=n_mb, bucket_mb=cfg.parallel.bucket_mb)
    optimizer = make_optimizer(model, reducer, cfg, ctx)
    return Setup(mode, cfg, ctx, model, optimizer, pipeline, reducer)


def make_batches(cfg: Config) -> list[dict]:
    """A fixed global batch of random token ids, cut into micro-batches."""
    t, m = cfg.training, cfg.model
    gen = torch.Generator().manual_seed(t.seed)
    data = torch.randint(0, m.vocab_size, (t.global_batch_size, m.seq_len + 1), generator=gen)
    mbs = t.micro_batch_size
    return [{"tokens": data[i:i + mbs, :-1].contiguous(), "labels": data[i:i + mbs, 1:].contiguous()}
            for i in range(0, t.global_batch_size, mbs)]


def run_steps(s: Setup, batches: list[dict], steps: int) -> float:
    """``steps`` training steps of ``s``; returns the seconds they took.

    The setup's random state is restored first and saved after, outside the timed
    region, so the setups' interleaving does not change the dropout masks any of them
    draws (and recomputation would be compared on different masks otherwise)."""
    device = s.ctx.device
    s.rng.restore(s.ctx.tp.rng, device)
    began = time.perf_counter()
    for _ in range(steps):
        loss, _, _ = train_step(s.model, s.optimizer, s.pipeline, s.reducer, batches, s.ctx,
                                s.cfg.training.grad_clip)
        s.losses.append(loss)
    elapsed = time.perf_counter() - began
    s.rng = RNGState.capture(s.ctx.tp.rng, device)
    return elapsed


def measure_memory(s: Setup, batches: list[dict]) -> None:
    """One (warm-up) step inside gridtrain's saved-tensor hooks, as ``pretrain`` measures
    its first step: bytes kept per layer, bytes saved while recomputing, the peak. The
    hooks cost time, so this step is never timed."""
    meter = memory.ActivationMeter.for_model(s.model)
    rebuilt_before = s.ctx.recompute.recomputed
    with memory.saved_activations(meter):
        run_steps(s, batches, 1)
    s.regions_per_step = s.ctx.recompute.recomputed - rebuilt_before
    s.saved = memory.StageMemory(stage=0, micro_batches=len(batches), kept=meter.by_layer(),
                                  recomputed=meter.by_layer("recompute"), peak_bytes=meter.peak_bytes)


def run(opts: dict) -> tuple[list[Setup], dict]:
    """Build the setups, warm up (measuring memory), then the timed, interleaved rounds."""
    torch.set_num_threads(opts["threads"])
    setups = [build_setup(opts, mode) for mode in MODES]
    batches = make_batches(setups[0].cfg)
    for s in setups:  # the same starting random state everywhere (the trackers are seeded alike)
        torch.manual_seed(opts["seed"])
        s.rng = RNGState.capture(s.ctx.tp.rng, s.ctx.device)
    for s in setups:
        measure_memory(s, batches)
        run_steps(s, batches, opts["warmup"] - 1)
    for r in range(opts["repeats"]):
        for s in (setups if r % 2 == 0 else setups[::-1]):
            s.times.append(run_steps(s, batches, opts["steps"]) / opts["steps"])
    tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    info = {"tokens": tokens, "params": sum(p.numel() for p in setups[0].model.parameters()),
            "micro_batches": len(batches), "threads": torch.get_num_threads(),
            "sdpa_kernel": sdpa_kernel(setups[0].cfg)}
    return setups, info


# ---- the report -------------------------------------------------------------------------------

def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _med(values) -> float:
    return statistics.median(list(values))


def block_bytes(stage: memory.StageMemory, which: dict[str, int]) -> float:
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


def gridtrain_version() -> str:
    """The commit measured, and whether gridtrain/ has local edits (read-only git queries)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "gridtrain")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" with uncommitted changes under gridtrain/" if dirty else "")


def table(setups: list[Setup]) -> list[str]:
    none = setups[0]
    math = none.cfg.model.attention == "math"
    lines = ["| setup | median step s | best step s | vs none | saved per micro-batch (blocks) | "
             + ("formula (blocks) | " if math else "") + "recomputed per micro-batch | peak saved |",
             "| --- | ---: | ---: | ---: | ---: | " + ("---: | " if math else "") + "---: | ---: |"]
    for s in setups:
        ratio = _med(t / n for t, n in zip(s.times, none.times))
        formula = f"{_mib(formula_bytes(s.cfg, s.mode))} | " if math else ""
        lines.append(f"| {s.mode} | {_med(s.times):.3f} | {min(s.times):.3f} | **{ratio:.2f}x** | "
                     f"{_mib(block_bytes(s.saved, s.saved.kept))} | {formula}"
                     f"{_mib(block_bytes(s.saved, s.saved.recomputed))} | {_mib(s.saved.peak_bytes)} |")
    return lines


def loss_check(setups: list[Setup]) -> str:
    ref = setups[0].losses
    diffs = {s.mode: max(abs(a - b) for a, b in zip(ref, s.losses)) for s in setups[1:]}
    same_length = all(len(s.losses) == len(ref) for s in setups)
    verdict = "IDENTICAL" if same_length and not any(diffs.values()) else \
        "DIFFERENT" if not same_length or max(diffs.values()) > 1e-5 * abs(ref[0]) else "AGREE within 1e-5 relative"
    return (f"loss check over all {len(ref)} steps (warm-up included), the same weights, batch and "
            f"dropout masks: {verdict}; max |loss - none's|: " +
            ", ".join(f"{mode} {d:.1e}" for mode, d in diffs.items()) +
            f"; step 1 {ref[0]:.6f}, last step {ref[-1]:.6f}")


def report(setups: list[Setup], info: dict, opts: dict, wall_s: float, load: tuple[float, float]) -> str:
    m, t = setups[0].cfg.model, setups[0].cfg.training
    lines = [
        f"shape: {m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads, seq {m.seq_len}, vocab {m.vocab_size}, "
        f"{info['params']:,} parameters, fp32; attention {m.attention}, dropout {m.dropout}; "
        f"{info['micro_batches']} micro-batches x {t.micro_batch_size} sequences = {info['tokens']:,} tokens/step",
        f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, one process with {info['threads']} "
        f"torch thread(s); 1-min load average at start / end {load[0]:.1f} / {load[1]:.1f}",
        f"gridtrain: {gridtrain_version()}",
        f"timing: {opts['warmup']} warm-up steps per setup (the first one measures memory), then "
        f"{opts['repeats']} rounds x {opts['steps']} steps per setup, interleaved (order reversed every other "
        "round); a step = gridtrain.train.train_step (forward + backward of every micro-batch, grad norm and "
        "clipping, AdamW); medians over rounds; vs none = median of the per-round ratios",
        "",
        *table(setups),
        "",
        "saved = bytes autograd keeps for backward at forward (gridtrain.memory hooks, one storage counted once), "
        "per micro-batch, summed over the blocks; recomputed = bytes saved again while a region is rebuilt in "
        "backward (transient); peak = most bytes held at once during the step, embedding and head included",
    ]
    if m.attention != "math":
        lines.append("no formula column: Korthikanti et al.'s formula describes the op-by-op attention "
                     "(--attention math); a fused kernel keeps no s x s tensors")
        lines.append(f"sdpa kernel for this shape and dropout {m.dropout} (autograd node of a probe call): "
                     f"{info['sdpa_kernel']}")
    lines.append("regions recomputed per step: " +
                 ", ".join(f"{s.mode} {s.regions_per_step}" for s in setups) +
                 f" ({m.n_layer} blocks x {info['micro_batches']} micro-batches = "
                 f"{m.n_layer * info['micro_batches']} expected for selective and full)")
    lines.append("step s per round:")
    lines += [f"  {s.mode}: " + ", ".join(f"{x:.3f}" for x in s.times) for s in setups]
    lines.append(loss_check(setups))
    lines.append(f"wall time {wall_s:.0f} s")
    return "\n".join(lines)


# ---- command line -----------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_and_timing_arguments(p, steps=4, warmup=3, repeats=16)
    p.add_argument("--attention", choices=("sdpa", "math"), default="math",
                   help="attention core: op by op (math, what the memory formula describes) or torch's "
                        "fused kernel (default: %(default)s)")
    p.add_argument("--dropout", type=float, default=0.1, help="default: %(default)s")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch (default: %(default)s)")
    p.add_argument("--global-batch-size", type=int, default=16,
                   help="sequences per step, a multiple of --micro-batch-size (default: %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of the one process (default: every core, %(default)s)")
    opts = vars(p.parse_args(argv))
    if opts["warmup"] < 1 or opts["steps"] < 1 or opts["repeats"] < 1 or opts["threads"] < 1:
        p.error("--warmup, --steps, --repeats and --threads must be >= 1")
    if opts["global_batch_size"] % opts["micro_batch_size"]:
        p.error("--global-batch-size must be a multiple of --micro-batch-size")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        for mode in MODES:
            validate(make_config(opts, mode), world_size=1)
    except ConfigError as e:
        print(f"recompute_cost: error: {e}", file=sys.stderr)
        return 2
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    try:
        setups, info = run(opts)
    finally:
        shutdown()
    load = (load_before, os.getloadavg()[0])
    print(report(setups, info, opts, time.perf_counter() - began, load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
