"""The self-check's measuring steps, each run in a process of its own by the runner:
``python -m gridtrain.selfcheck.checks NAME --device D --result FILE [--tiny] [--model M]``.

Each writes its measurements to ``--result`` (JSON: lists of rows under ``parity``,
``throughput``, ``memory``, ``planner``, or the ``environment``) as soon as it has them,
so a step killed at its time box still reports what it measured, and exits non-zero
when what it checks does not hold.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from gridtrain.config import ModelConfig, preset_config, set_fields
from gridtrain.models.decoder import training_flops_per_token
from gridtrain.selfcheck.baseline import median_after, plain_loop, throughput_row
from gridtrain.training.metrics import peak_tflops

GIB = 2 ** 30
PARITY_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}
WATCHDOG_TIMEOUT_S = 10

# The throughput runs: preset, micro-batch size (one micro-batch per step), steps, warm-up
# steps left out of the median. GPT-2 124M at seq 1024 and TinyLlama 1.1B's layers at seq
# 2048 on one GPU; their tiny stand-ins for the CPU rehearsal.
RUNS = {"gpt2": ("gpt2", 16, 12, 4), "llama": ("tinyllama-1.1b", 4, 12, 4), "moe": ("qwen3-30b-a3b", 2, 12, 4)}
TINY_RUNS = {"gpt2": ("tiny", 4, 6, 2), "llama": ("llama-tiny", 4, 6, 2), "moe": ("moe-tiny", 4, 6, 2)}
# Qwen3-30B-A3B's layers (128 experts, top 8, 128-wide heads, q/k norms) cut to two, so that
# the model and both loops' optimizer states fit one 80 GB GPU: a small Qwen3-MoE. TinyLlama
# cut to 8 of its 22 layers (its layer, vocabulary and sequence as they are): every run of it
# draws its weights on the host, and the check has 9.5 minutes for everything (runner.py).
MODEL_FIELDS = {"moe": dict(n_layer=2), "llama": dict(n_layer=8)}
LLAMA_LAYERS = MODEL_FIELDS["llama"]["n_layer"]
# --document-mask against the causal run of the same length: TinyLlama's layers at 8K tokens
DOCUMENT_RUN, TINY_DOCUMENT_RUN = ("tinyllama-1.1b", 1, 8192, 10, 3), ("llama-tiny", 4, 64, 6, 2)
ROUNDS = 2  # plain, gridtrain, plain, gridtrain (--rounds: the plan runs compiled ones once)


class Result:
    """The step's JSON result, rewritten whenever a row is added."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.data: dict = {}
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, key: str, row: dict) -> None:
        self.data.setdefault(key, []).append(row)
        self.write()

    def set(self, key: str, value) -> None:
        self.data[key] = value
        self.write()

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)


# ---- environment --------------------------------------------------------------------------------

def environment(args, result: Result) -> int:
    env = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
           "CUDA (torch build)": torch.version.cuda or "none", "CPU cores": os.cpu_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update({"gpu": props.name, "GPUs visible": torch.cuda.device_count(),
                    "GPU memory GiB": round(props.total_memory / GIB, 1),
                    "compute capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count,
                    "driver": _nvidia_smi("driver_version"), "cuDNN": torch.backends.cudnn.version(),
                    "NCCL": ".".join(map(str, torch.cuda.nccl.version())),
                    "peak bf16 TFLOP/s (for MFU)": peak_tflops(torch.device("cuda", 0), args.peak_tflops)})
    env["gridtrain commit"] = _git("rev-parse", "--short", "HEAD")
    result.set("environment", env)
    for k, v in env.items():
        print(f"{k}: {v}")
    return 0


def _nvidia_smi(field: str) -> str:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no nvidia-smi)"


def _git(*args: str) -> str:
    """``git args`` in this package's checkout; "unknown" where the package is not the
    root of one (a copied tree inside another repository would name that one's commit)."""
    root = Path(__file__).resolve().parents[2]
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=10,
                             cwd=root).stdout.strip()
        if not top or Path(top).resolve() != root:
            return "unknown (not a git checkout)"
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=root)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


# ---- parity -------------------------------------------------------------------------------------

def _tiny_run(dtype: str, device: str) -> list[float]:
    from gridtrain.training.loop import pretrain
    from gridtrain.training.providers import decoder_forward_step, decoder_model_provider, text_datasets_provider

    cfg = set_fields(preset_config("tiny"), dtype=dtype, device=device, steps=10, global_batch_size=8,
                     micro_batch_size=2, eval_interval=0, eval_iters=1, progress=False, lr=3e-3, warmup_steps=2,
                     sample_tokens=0)
    return pretrain(decoder_model_provider, text_datasets_provider, decoder_forward_step, cfg).losses


def relative_difference(a: list[float], b: list[float]) -> float:
    """max |a - b| over the curve, relative to its largest value."""
    scale = max(max(map(abs, a)), max(map(abs, b)), 1e-30)
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) / scale


def parity(args, result: Result) -> int:
    reference = _tiny_run("fp64", "cpu")
    failed = 0
    for dtype, tolerance in PARITY_TOLERANCE.items():
        losses = _tiny_run(dtype, args.device)
        diff = relative_difference(losses, reference)
        ok = diff < tolerance and losses[-1] < losses[0]
        failed += not ok
        result.add("parity", {"dtype": dtype, "device": args.device, "max_rel_diff": diff, "tolerance": tolerance,
                              "steps": len(losses), "ok": ok})
        print(f"{dtype} on {args.device}: max relative loss difference {diff:.2e} (tolerance {tolerance:.0e})"
              f"{'' if ok else ' FAILED'}")
    return 1 if failed else 0


# ---- the watchdog ---------------------------------------------------------------------------------

def watchdog(args, result: Result) -> int:
    from gridtrain.runtime.watchdog import HANG_EXIT_CODE
    from gridtrain.selfcheck.hang import named_within, stop_a_rank_and_wait

    flags = ["--device", args.device] + (["--backend", "gloo"] if args.device == "cuda" else [])
    with tempfile.TemporaryDirectory() as work:
        run = stop_a_rank_and_wait(Path(work), 1, 2, WATCHDOG_TIMEOUT_S, *flags)
    print(run.err[-4000:])
    problem = named_within(run, 1, WATCHDOG_TIMEOUT_S, HANG_EXIT_CODE)
    print(f"rank 1 stopped; the job ended after {run.elapsed_s:.1f} s with exit code {run.code}: "
          f"{problem or 'the hang was named'}")
    return 1 if problem else 0


# ---- throughput, memory, planner ------------------------------------------------------------------

def _gridtrain_run(cfg, device: torch.device, work: Path, label: str) -> tuple[list[float], int]:
    """``gridtrain train`` (the whole loop: data, step, report) in this process; each step's
    seconds from its metrics file, and the peak device memory."""
    rows, peak = gridtrain_rows(cfg, device, work, label)
    return [r["step_time_s"] for r in rows], peak


def gridtrain_rows(cfg, device: torch.device, work: Path, label: str) -> tuple[list[dict], int]:
    """:func:`_gridtrain_run` with each step's whole metrics row (loss, seconds, ...)."""
    from gridtrain.training.loop import pretrain
    from gridtrain.training.providers import decoder_forward_step, decoder_model_provider, text_datasets_provider

    metrics = work / f"{label}.jsonl"
    cfg = set_fields(copy.deepcopy(cfg), metrics_file=str(metrics))
    before = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)  # what earlier runs left: not this run's
    result = pretrain(decoder_model_provider, text_datasets_provider, decoder_forward_step, cfg)
    del result
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return rows, peak


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fresh_compile(compiled: bool) -> None:
    """Before (and after) a compiled run in a process that runs several: forget what
    torch.compile traced for the last one (its graphs, guards and recompile counts), so
    that no run inherits another's cache entries or runs into the recompile limit
    (the compiled code on disk, inductor's cache, still serves a graph seen before)."""
    if compiled:
        import torch._dynamo

        torch._dynamo.reset()


def hardware_key(device: torch.device) -> str | None:
    """The planner's hardware for this device ("cpu" off CUDA; None for an unlisted GPU)."""
    from gridtrain.planner.hardware import hardware_key as by_name

    return "cpu" if device.type != "cuda" else by_name(torch.cuda.get_device_name(device))


def predicted_step_s(model_cfg: ModelConfig, micro_batch_size: int, dtype: str, hardware: str,
                     fp8: str = "none") -> float:
    """The planner's step time for one device, one micro-batch per step (``fp8``: its recipe)."""
    from gridtrain.planner.cost import Job, Layout, predict
    from gridtrain.planner.machine import machine

    job = Job(model_cfg, global_batch_size=micro_batch_size, hardware=machine(hardware, 1), dtype=dtype, fp8=fp8)
    return predict(job, Layout(dp=1, tp=1, pp=1, micro_batch_size=micro_batch_size), memory=False).step_time_s


def predicted_peak_bytes(cfg, device_type: str) -> int:
    """The dry run's peak for this one-rank layout (fake tensors; compile left out, which
    the dry run does not take)."""
    from gridtrain.dryrun import run_rank

    cfg = set_fields(copy.deepcopy(cfg), compile=False)
    return run_rank(cfg, 1, 0, device_type).peak_bytes


def _run_config(args, preset: str, mbs: int, steps: int, **fields):
    """One micro-batch per step of ``preset`` on the check's device, nothing but the steps."""
    return set_fields(preset_config(preset), dtype=args.dtype, device=args.device, micro_batch_size=mbs,
                      global_batch_size=mbs, steps=steps, warmup_steps=1, eval_interval=0, eval_iters=1,
                      sample_tokens=0, progress=False, compile=args.compile, dropout=0.0,
                      peak_tflops=args.peak_tflops, **fields)


def _device(args) -> torch.device:
    return torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")


def _memory_row(result: Result, label: str, cfg, device: torch.device, peaks: list[int], **extra) -> int:
    """The measured device peak beside the dry run's for the same layout; 1 if the dry run
    failed (reported, and the step fails), else 0. Nothing to compare off CUDA."""
    if device.type != "cuda":
        return 0
    measured, failed = max(peaks), 0
    try:
        predicted = predicted_peak_bytes(cfg, device.type) if not cfg.training.compile else None
    except Exception as e:  # noqa: BLE001 -- reported, and the step fails
        predicted, failed = None, 1
        print(f"the dry run failed: {traceback.format_exc()}")
        result.add("errors", {"run": label, "what": "dry run", "error": str(e).splitlines()[0][:300]})
    result.add("memory", {"run": label, "measured_gib": measured / GIB,
                          "predicted_gib": predicted / GIB if predicted else None,
                          "ratio": measured / predicted if predicted else None, **extra})
    return failed


def _planner_row(result: Result, label: str, cfg, device: torch.device, measured_s: float) -> None:
    hardware = hardware_key(device)
    if hardware:
        expected = predicted_step_s(cfg.model, cfg.training.micro_batch_size, cfg.training.dtype, hardware)
        result.add("planner", {"run": label, "hardware": hardware, "predicted_ms": expected * 1e3,
                               "measured_ms": measured_s * 1e3, "ratio": measured_s / expected})


def throughput(args, result: Result) -> int:
    device = _device(args)
    preset, mbs, steps, warmup = (TINY_RUNS if args.tiny else RUNS)[args.model]
    cfg = _run_config(args, preset, mbs, steps)
    if not args.tiny and args.model in MODEL_FIELDS:
        cfg.model = dataclasses.replace(cfg.model, **MODEL_FIELDS[args.model])
    rounds = args.rounds
    m = cfg.model
    label = f"{args.model}{' compile' if args.compile else ''}"
    tokens_per_step = mbs * m.seq_len
    flops = training_flops_per_token(m)
    peak = peak_tflops(device, args.peak_tflops)
    print(f"{label}: {preset} ({m.n_layer} layers), {mbs} x {m.seq_len} tokens per step, {flops / 1e9:.2f} GFLOP "
          f"per token, peak {peak} TFLOP/s, {rounds} round(s)")
    gridtrain_times, plain_times, peaks, plain_peaks = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            fresh_compile(args.compile)
            times, plain_peak = plain_loop(m, device, args.dtype, mbs, steps, compile=args.compile, seed=r)
            plain_times.append(times)
            plain_peaks.append(plain_peak)
            _free(device)
            fresh_compile(args.compile)
            times, used = _gridtrain_run(cfg, device, Path(tmp), f"round{r}")
            gridtrain_times.append(times)
            peaks.append(used)
            _free(device)
            print(f"round {r}: plain {median_after(plain_times[-1], warmup) * 1e3:.1f} ms, gridtrain "
                  f"{median_after(times, warmup) * 1e3:.1f} ms per step")
    ours = median_after([t for ts in gridtrain_times for t in ts[warmup:]], 0)
    theirs = median_after([t for ts in plain_times for t in ts[warmup:]], 0)
    plain_row = throughput_row(args.model, args.compile, "plain PyTorch", theirs, tokens_per_step, flops, peak)
    our_row = throughput_row(args.model, args.compile, "gridtrain train", ours, tokens_per_step, flops, peak)
    our_row.update(vs_plain=theirs / ours, baseline="plain PyTorch", vs=theirs / ours)
    result.add("throughput", plain_row)
    result.add("throughput", our_row)
    print(f"{label}: gridtrain {our_row['tokens_per_s']:,.0f} tokens/s, plain {plain_row['tokens_per_s']:,.0f} "
          f"tokens/s, ratio {our_row['vs_plain']:.3f}")
    # the predictions come after the measurement: one that fails costs its own row only
    failed = _memory_row(result, label, cfg, device, peaks, plain_gib=max(plain_peaks) / GIB if plain_peaks else 0)
    _planner_row(result, label, cfg, device, ours)
    if args.profile:
        profile_both(cfg, device, args.dtype, warmup + 2)
    return 1 if failed else 0


def profile_both(cfg, device: torch.device, dtype: str, steps: int) -> None:
    """Where each loop's time goes: torch.profiler's top operators over a short run of
    each (printed to the step's log; not part of the measurement above)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = set_fields(copy.deepcopy(cfg), steps=steps)
    m, mbs = cfg.model, cfg.training.micro_batch_size
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in (("plain PyTorch", lambda: plain_loop(m, device, dtype, mbs, steps, cfg.training.compile)),
                          ("gridtrain train", lambda: _gridtrain_run(cfg, device, Path(tmp), "profile"))):
            fresh_compile(cfg.training.compile)
            with profile(activities=activities) as prof:
                run()
            _free(device)
            print(f"--- profile: {name}, {steps} steps (model build included), by {key} ---")
            print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60))


# ---- the new axes at speed: document masks (and below, cp attention blocks) -----------------------

def document_mask(args, result: Result) -> int:
    """``gridtrain train --document-mask`` against the causal run of the same length and
    model, interleaved: tokens/s of each and their ratio (a window of several documents
    is less attention work than a causal one: it should not be slower), the masked run's
    memory against the dry run's (which masks four documents a sequence), and the
    planner's step time for both."""
    device = _device(args)
    preset, mbs, seq, steps, warmup = TINY_DOCUMENT_RUN if args.tiny else DOCUMENT_RUN
    runs = {"causal": _run_config(args, preset, mbs, steps, seq_len=seq),
            "document mask": _run_config(args, preset, mbs, steps, seq_len=seq, document_mask=True)}
    for cfg in runs.values():
        if cfg.model.max_positions is not None:
            cfg.model = dataclasses.replace(cfg.model, max_positions=max(cfg.model.max_positions, seq))
        if not args.tiny:
            cfg.model = dataclasses.replace(cfg.model, n_layer=LLAMA_LAYERS)
    m = runs["causal"].model
    flops, peak = training_flops_per_token(m), peak_tflops(device, args.peak_tflops)
    times: dict[str, list[float]] = {k: [] for k in runs}
    peaks: dict[str, list[int]] = {k: [] for k in runs}
    print(f"document-mask: {preset} ({m.n_layer} layers) at {seq} tokens, {mbs} sequence(s) per step, "
          f"{'interleaved x ' if args.rounds > 1 else ''}{args.rounds} round(s)")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for label, cfg in runs.items():
                step_times, used = _gridtrain_run(cfg, device, Path(tmp), f"{label.replace(' ', '-')}-{r}")
                times[label] += step_times[warmup:]
                peaks[label].append(used)
                _free(device)
    medians = {k: median_after(v, 0) for k, v in times.items()}
    for label, cfg in runs.items():
        row = throughput_row(preset, False, label, medians[label], mbs * seq, flops, peak)
        if label != "causal":
            row.update(baseline="causal", vs=medians["causal"] / medians[label])
        result.add("throughput", row)
        print(f"{label}: {row['tokens_per_s']:,.0f} tokens/s ({medians['causal'] / medians[label]:.3f}x the "
              "causal run)")
    failed = 0
    for label, cfg in runs.items():
        failed += _memory_row(result, f"{preset} {label}", cfg, device, peaks[label])
        _planner_row(result, f"{preset} {label}", cfg, device, medians[label])
    return 1 if failed else 0


# One layer's attention at long context, as context parallelism runs it: every cp rank's
# chunk pairs through the fused block kernel, in one process. (tokens, cp, heads, kv heads,
# head size, rounds): Llama 3 8B's heads at 32K tokens over cp 4; a tiny stand-in.
CP_ATTENTION, TINY_CP_ATTENTION = (32768, 4, 32, 8, 128, 5), (512, 2, 4, 2, 32, 3)


def _cp_blocks_step(q, k, v, cp: int) -> torch.Tensor:
    """Forward and backward of causal attention over ``q, k, v`` ``[1, heads, s, d]``
    computed as ``cp`` ranks would (context_parallel: each rank's two chunks, every
    visible chunk pair one fused block, merged by log-sum-exp; the backward of each pair
    from the whole output and log-sum-exp), in this process; returns the output."""
    from gridtrain.parallel import attention_blocks as blocks
    from gridtrain.parallel.context_parallel import join_sequence, merge, split_sequence, visible_pairs

    kernel, scale = blocks.kernel_for(q), 1.0 / q.shape[-1] ** 0.5
    mine = [[split_sequence(x, cp, r, dim=2).chunk(2, dim=2) for x in (q, k, v)] for r in range(cp)]
    outs = []
    for r in range(cp):
        qh = mine[r][0]
        acc: list = [None, None]
        for src in range(cp):
            for qi, ki, causal in visible_pairs(cp, r, src):
                out, lse = blocks.block_forward(kernel, qh[qi], mine[src][1][ki], mine[src][2][ki], causal, scale)
                acc[qi] = (out.to(blocks.wide(q.dtype)), lse) if acc[qi] is None else merge(*acc[qi], out, lse)
        oh = [a[0].to(q.dtype) for a in acc]
        dout = [torch.ones_like(o) for o in oh]
        for src in range(cp):
            for qi, ki, causal in visible_pairs(cp, r, src):
                blocks.block_backward(kernel, dout[qi], qh[qi], mine[src][1][ki], mine[src][2][ki], oh[qi],
                                      acc[qi][1], causal, scale)
        outs.append(torch.cat(oh, dim=2))
    return join_sequence(outs, dim=2)


def cp_attention(args, result: Result) -> int:
    """The ring's block path against plain fused SDPA on the same work: one layer's causal
    attention at 32K tokens in bf16, forward and backward, by the chunk pairs of cp 4 (the
    kernel context parallelism runs on this device, ``attention_blocks.block_kernel``)
    and by ``scaled_dot_product_attention`` on the whole sequence; time, attention
    TFLOP/s, the transient device memory of each, and the largest difference of their
    outputs (what the merge costs in bf16)."""
    import time

    from gridtrain.parallel import attention_blocks as blocks

    device = _device(args)
    seq, cp, heads, kv_heads, d, rounds = TINY_CP_ATTENTION if args.tiny else CP_ATTENTION
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, seq, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, kv_heads, seq, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, kv_heads, seq, d, device=device, dtype=dtype, generator=g)

    def sdpa() -> torch.Tensor:
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))
        return out.detach()

    sides = {"fused SDPA, whole sequence": sdpa, f"cp {cp} blocks ({blocks.kernel_for(q)})": lambda: _cp_blocks_step(
        q, k, v, cp)}
    flops = 2 * 2 * heads * d * seq * seq / 2 * 3.5  # causal: half the pairs; backward 2.5x the forward
    times: dict[str, list[float]] = {name: [] for name in sides}
    transient: dict[str, int] = {}
    outputs = {}
    for r in range(rounds + 1):
        for name, run in sides.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            began = time.perf_counter()
            outputs[name] = run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                transient[name] = torch.cuda.max_memory_allocated(device) - base
            if r:  # the first round warms the kernels up
                times[name].append(time.perf_counter() - began)
    reference = next(iter(sides))
    for name in sides:
        step = median_after(times[name], 0)
        row = {"run": f"attention {seq} tokens, {heads}/{kv_heads} heads of {d}, {args.dtype}", "path": name,
               "ms": step * 1e3, "tflops": flops / step / 1e12, "transient_gib": transient.get(name, 0) / GIB,
               "vs_fused_sdpa": median_after(times[reference], 0) / step,
               "max_abs_diff": float((outputs[name].float() - outputs[reference].float()).abs().max())}
        result.add("attention", row)
        print(f"{name}: {row['ms']:.1f} ms forward + backward, {row['tflops']:.1f} TFLOP/s, transient "
              f"{row['transient_gib']:.2f} GiB, {row['vs_fused_sdpa']:.3f}x fused SDPA's speed, largest output "
              f"difference {row['max_abs_diff']:.2e}")
    worst = max(r["max_abs_diff"] for r in result.data["attention"])
    return 0 if worst < (5e-2 if dtype != torch.float32 else 1e-4) else 1


CHECKS = {"environment": environment, "cp-attention": cp_attention, "parity": parity, "watchdog": watchdog, "document-mask": document_mask,
          "moe": throughput}
for _name in ("gpt2", "llama"):
    CHECKS[f"throughput-{_name}"] = throughput
    CHECKS[f"throughput-{_name}-compile"] = throughput


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gridtrain.selfcheck.checks")
    ap.add_argument("name", choices=sorted(CHECKS))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--result", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model", choices=sorted(RUNS), default="gpt2")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--profile", action="store_true", help="throughput: print both loops' top operators")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help="throughput, document-mask: rounds of the interleaved runs (default 2)")
    args = ap.parse_args(argv)
    return CHECKS[args.name](args, Result(args.result))


if __name__ == "__main__":
    sys.exit(main())
