"""The self-check's steps, their time boxes and the command line.

A step is a list of commands run one after the other in a fresh process group; it
passes when each exits 0 within the step's time box. A step that overruns is killed
with its whole process group (spawned ranks included) and marked ``timeout``; the next
step starts anyway. The whole check has a budget too (``--budget-s``, 9.5 minutes by
default, inside the 10 that a lent GPU machine allows one command): a step never gets
more than what is left, and steps that no time is left for are marked ``skipped``.

Steps that measure (``gridtrain.selfcheck.checks``, ``gridtrain.selfcheck.fp8``) write a
JSON result beside their log; the report merges it. A result that names a reason under
``skipped`` (the fp8 step without torchao) marks its step skipped, with that one line. Nothing here imports torch at the top: on a machine without torch
or without CUDA ``--gpu`` must refuse in one line (exit 2), not with a traceback.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gridtrain.selfcheck.report import Report, StepResult

REPO = Path(__file__).resolve().parents[2]
GPU_TEST_FILES = ("tests/test_gpu.py", "tests/test_attention_blocks.py")  # the tests that need CUDA (skipped without)
EXIT_REFUSED = 2
FP8_TIMEOUT_S = 300  # three compiled and three eager TinyLlama runs of 40 steps (selfcheck/fp8.py)
TAIL_LINES = 30
KILL_GRACE_S = 5.0


@dataclass
class Step:
    """One time-boxed step: ``commands`` run in order, each must exit 0."""

    name: str
    what: str
    timeout_s: float
    commands: list[list[str]]
    result_file: str | None = None  # a check's JSON result, merged into the report
    env: dict[str, str] = field(default_factory=dict)


def run_step(step: Step, logs: Path, budget_left_s: float) -> StepResult:
    """Run ``step`` under min(its time box, the budget left); never raises for the
    step's own failure."""
    limit = min(step.timeout_s, budget_left_s)
    log = logs / f"{step.name}.log"
    began = time.monotonic()
    status, detail = "pass", ""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", **step.env}
    with open(log, "w") as out:
        for command in step.commands:
            left = limit - (time.monotonic() - began)
            if left <= 0:
                status, detail = "timeout", f"time box of {limit:.0f} s spent before: {' '.join(command[:6])}"
                break
            out.write(f"$ {' '.join(command)}\n")
            out.flush()
            code = _run_boxed(command, out, env, left)
            if code is None:
                status, detail = "timeout", f"killed after its time box of {limit:.0f} s: {' '.join(command[:6])} ..."
                break
            if code != 0:
                status, detail = "fail", f"exit code {code}: {' '.join(command[:6])} ..."
                break
    seconds = time.monotonic() - began
    data = {}
    if step.result_file and Path(step.result_file).exists():
        try:
            data = json.loads(Path(step.result_file).read_text())
        except ValueError as e:
            status, detail = "fail", f"its result file is not JSON ({e})"
    if status == "pass" and isinstance(data.get("skipped"), str):
        status, detail = "skipped", data["skipped"]
    tail = _tail(log) if status not in ("pass", "skipped") else ""
    return StepResult(step.name, step.what, status, round(seconds, 1), detail, tail, data)


def _run_boxed(command: list[str], out, env: dict, timeout_s: float) -> int | None:
    """The command's exit code, or None when it overran and was killed (with its group)."""
    proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return None
    except BaseException:
        _kill_group(proc)
        raise


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(log: Path, lines: int = TAIL_LINES) -> str:
    text = log.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


# ---- the steps ---------------------------------------------------------------------------------

def _train(*flags: str) -> list[str]:
    return [sys.executable, "-m", "gridtrain", "train", "--model", "tiny", "--no-progress", "--sample-tokens", "0",
            "--eval-interval", "0", "--eval-iters", "1", *flags]


def _check(name: str, out: Path, device: str, *flags: str, module: str = "") -> tuple[list[str], str]:
    """A measuring step's command: ``gridtrain.selfcheck.checks NAME``, or a module of its own."""
    result = str(out / "results" / f"{name}.json")
    head = ["-m", module] if module else ["-m", "gridtrain.selfcheck.checks", name]
    return [sys.executable, *head, "--device", device, "--result", result, *flags], result


def plan_steps(device: str, out: Path, *, tiny: bool, peak_tflops: float | None) -> list[Step]:
    """The steps, in the order they run. ``device`` is where the model computes (cuda,
    or cpu for the rehearsal); ``tiny`` shrinks the throughput models."""
    cuda = device == "cuda"
    work = out / "work"
    gloo = ["--backend", "gloo"] if cuda else []  # gloo on cuda: the ranks share the one GPU
    offload = ["--offload-activations"] if cuda else []
    extra = (["--tiny"] if tiny else []) + (["--peak-tflops", str(peak_tflops)] if peak_tflops else [])
    steps = []

    def check(name, what, timeout_s, *flags, module=""):
        command, result = _check(name, out, device, *flags, *extra, module=module)
        steps.append(Step(name, what, timeout_s, [command], result))

    # first of all (issue 44): float8 against bf16, the newest path, measured before anything else
    check("fp8", "gridtrain train --fp8 tensorwise and rowwise vs bf16 (TinyLlama-1.1B shape), compiled then "
          "eager, interleaved: tokens/s ratio, loss curve, peak memory; target 1.25x compiled bf16 within 1% loss "
          "(reported, not failed on); skipped without torchao", FP8_TIMEOUT_S, module="gridtrain.selfcheck.fp8")
    check("environment", "versions of the GPU, driver, torch, CUDA, NCCL", 60)
    # the newest paths first: a short GPU lease measures them before anything else
    ck0 = str(work / "muon-offload")
    steps.append(Step("optimizers", f"Muon on {device}: one rank ({'NCCL' if cuda else 'gloo'}) with bf16 states and "
                      "the optimizer offloaded to the host, saved and resumed; 2 gloo ranks, ZeRO-3, QK-clip", 120,
                      [_train("--nproc", "1", "--device", device, "--dtype", "bf16", "--optimizer", "muon",
                              "--optimizer-state-dtype", "bf16", "--optimizer-offload", "--steps", "6", "--save",
                              ck0, "--save-interval", "3"),
                       _train("--nproc", "1", "--device", device, "--dtype", "bf16", "--optimizer", "muon",
                              "--optimizer-state-dtype", "bf16", "--optimizer-offload", "--load", ck0, "--steps", "8"),
                       _train("--nproc", "2", "--device", device, *gloo, "--dtype", "bf16", "--optimizer", "muon",
                              "--zero", "3", "--qk-clip", "0.05", "--optimizer-offload", "--steps", "4")]))
    check("cp-attention", "one layer's causal attention at 32K tokens, bf16: context parallelism's fused blocks "
          "(cp 4's chunk pairs, one process) vs fused SDPA on the whole sequence; time, memory, outputs", 120)
    check("document-mask", "gridtrain train --document-mask vs the causal run of the same length (TinyLlama, "
          "8K tokens), interleaved; memory vs the dry run; step time vs the planner", 240)
    check("moe", "gridtrain train vs a plain PyTorch loop of the same small Qwen3-MoE (grouped-GEMM experts), "
          "interleaved; memory vs the dry run; step time vs the planner", 240, "--model", "moe")
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GPU_TEST_FILES]
    steps.append(Step("gpu-tests", f"the CUDA tests ({', '.join(GPU_TEST_FILES)})", 150, [tests]))
    check("parity", f"tiny model, fp32 and bf16 on {device} against fp64 on the CPU (loss curves)", 90)
    ck = str(work / "one-rank")
    steps.append(Step("one-rank", f"one rank on {device} ({'NCCL' if cuda else 'gloo'}): ZeRO-1, selective "
                      "recomputation, async DCP save from device memory, resume",
                      90, [_train("--nproc", "1", "--device", device, "--zero", "1", "--recompute", "selective",
                                  *offload, "--steps", "6", "--save", ck, "--save-interval", "3", "--save-async"),
                           _train("--nproc", "1", "--device", device, "--load", ck, "--steps", "8")]))
    steps.append(Step("tp-sp-pp", f"4 gloo ranks on {device}: tp 2 + sequence parallel x pp 2, 1F1B", 90,
                      [_train("--nproc", "4", "--device", device, *gloo, "--tp", "2", "--sequence-parallel",
                              "--pp", "2", "--schedule", "1f1b", "--global-batch-size", "8", "--steps", "4")]))
    ck2 = str(work / "dp-zero1")
    steps.append(Step("dp-zero1-dcp", f"2 gloo ranks on {device}: dp 2 + ZeRO-1, offloaded activations, "
                      "async sharded checkpoint, resume", 90,
                      [_train("--nproc", "2", "--device", device, *gloo, "--zero", "1", *offload, "--steps", "4",
                              "--save", ck2, "--save-async"),
                       _train("--nproc", "2", "--device", device, *gloo, "--zero", "1", "--load", ck2,
                              "--steps", "6")]))
    steps.append(Step("zb-h1", f"2 gloo ranks on {device}: pp 2, ZB-H1 schedule, full recomputation", 90,
                      [_train("--nproc", "2", "--device", device, *gloo, "--pp", "2", "--schedule", "zb-h1",
                              "--recompute", "full", "--global-batch-size", "8", "--steps", "4")]))
    check("watchdog", f"2 gloo ranks on {device}, rank 1 stopped: the hang is named within the timeout", 90)
    for model in ("gpt2", "llama"):
        for compiled in (False, True):
            name = f"throughput-{model}" + ("-compile" if compiled else "")
            check(name, f"gridtrain train vs a plain PyTorch loop, {model}{' --compile' if compiled else ''}, "
                  "interleaved; memory vs the dry run; step time vs the planner", 240 if compiled else 150,
                  "--model", model, *(["--compile"] if compiled else ["--profile"]))
    return steps


# ---- the command -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m gridtrain.selfcheck",
                                 description="check gridtrain on this machine's GPU; writes report.md and "
                                             "report.json under --out")
    ap.add_argument("--gpu", action="store_true", help="require a CUDA GPU (exit 2 in one line without one)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="where the checks compute (cpu: a rehearsal of the check itself on tiny models)")
    ap.add_argument("--out", default=None, help="report directory (default: gpu-check/<date>-<host>)")
    ap.add_argument("--budget-s", type=float, default=570.0, help="wall-clock budget of the whole check")
    ap.add_argument("--only", default=None, help="comma-separated step names to run (default: all)")
    ap.add_argument("--tiny", action="store_true", help="tiny throughput models (implied by --device cpu)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU where it is not known")
    return ap


def refusal(gpu: bool, device: str) -> str | None:
    """Why this machine cannot run the check as asked (one line), or None."""
    try:
        import torch
    except ImportError as e:
        return f"gpu-check: this python ({sys.executable}) cannot import torch ({e}); run it with the interpreter " \
               "that has PyTorch"
    if (gpu or device == "cuda") and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return (f"gpu-check: no CUDA device is visible (torch {torch.__version__}, {build}); run it on a machine "
                "with an NVIDIA GPU, or rehearse it with --device cpu")
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.gpu and args.device != "cuda":
        print("gpu-check: --gpu checks the GPU; drop --device cpu, or drop --gpu to rehearse on the CPU",
              file=sys.stderr)
        return EXIT_REFUSED
    problem = refusal(args.gpu, args.device)
    if problem:
        print(problem, file=sys.stderr)
        return EXIT_REFUSED
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    out = Path(args.out or REPO / "gpu-check" / f"{stamp}-{os.uname().nodename}").resolve()
    for sub in ("logs", "results", "work"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    steps = plan_steps(args.device, out, tiny=args.tiny or args.device == "cpu", peak_tflops=args.peak_tflops)
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {s.name for s in steps})
        if unknown:
            print(f"gpu-check: unknown step(s) {unknown}; choose from {', '.join(s.name for s in steps)}",
                  file=sys.stderr)
            return EXIT_REFUSED
        steps = [s for s in steps if s.name in wanted]
    report = Report(out, command=" ".join([Path(sys.executable).name, "-m", "gridtrain.selfcheck", *(argv or
                                                                                                      sys.argv[1:])]),
                    device=args.device, planned=[(s.name, s.what) for s in steps])
    report.write()
    began = time.monotonic()
    for step in steps:
        left = args.budget_s - (time.monotonic() - began)
        if left < 5:
            result = StepResult(step.name, step.what, "skipped", 0.0, "no time left in --budget-s", "", {})
        else:
            print(f"gpu-check: {step.name} ... ", end="", flush=True)
            result = run_step(step, out / "logs", left)
            print(f"{result.status} ({result.seconds:.0f} s){': ' + result.detail if result.detail else ''}",
                  flush=True)
        report.add(result)
        report.write()
    report.finish()
    report.write()
    print(f"gpu-check: {report.summary()}; report: {out / 'report.md'}")
    return 0 if report.all_passed() else 1
