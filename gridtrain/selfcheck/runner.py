"""The self-check's steps, their time boxes, their order and the command line.

A step is a list of commands run one after the other in a fresh process group; it
passes when each exits 0 within the step's time box. A step that overruns is killed
with its whole process group (spawned ranks included) and marked ``timeout``; the next
step starts anyway. The whole check has a budget too (``--budget-s``, 9.5 minutes by
default, inside the 10 that a lent GPU machine allows one command): a step never gets
more than what is left, and steps that no time is left for are marked ``skipped``.

**Every step fits the budget.** The plan is a sequence of stages: a step alone, or a
batch of steps started side by side (``Step.batch``: consecutive steps of one batch
name), each in its own time box, the batch over when its last step is. A stage costs
at most its longest box, and a box that overruns costs at most 2 x ``KILL_GRACE_S``
more (SIGTERM, then SIGKILL), so::

    sum over stages of (longest box in the stage) + RESERVE_S  <=  DEFAULT_BUDGET_S

(:func:`plan_seconds`; tests/test_selfcheck.py holds it for the default plan on cuda)
guarantees that every step starts, with its whole box, in one call (``RESERVE_S``: the
runner's own seconds between steps and one kill's grace). For the cuda plan
(boxes in seconds; measured: the H200 runs of docs/gpu/, else an estimate)::

    environment 8 (measured 3-5)             float8-gemms 15        grouped-gemm 15
    efficient-attention-bwd 15               head-loss 20
    side by side 75: offload 40, fp8-zero 60, optimizers 75, one-rank 60 (measured
      28-33 alone), tp-sp-pp 45 (18), dp-zero1-dcp 60 (32), zb-h1 45 (17), parity 40
      (15), gpu-tests 75 (28 for test_gpu.py), watchdog 60 (39)
    compile-fp8 45          fp8 95                 cp-attention 20
    document-mask 30        moe 40                 throughput-gpt2 40 (35 measured)
    throughput-gpt2-compile 45 (46-53 with two)    throughput-llama 30
    throughput-llama-compile 60
    = 553 s of stages + RESERVE_S 10 = 563 s <= 570 s

Only steps that measure no speed share a stage: they are launches of tiny models whose
seconds go to process start-up, rendezvous and compilation far more than to the GPU
(the H200 runs: 15-17 s a launch); one after another they would take about 300 s of the
570. Speed, memory and timing measurements run alone. Cheap and most telling first:
the environment, then the one-process checks of what only a GPU shows
(:mod:`cuda_semantics`), the multi-process runs, compiled float8, then the
measurements, largest last.

Steps that measure (``gridtrain.selfcheck.checks``, ``gridtrain.selfcheck.fp8``,
``gridtrain.selfcheck.cuda_semantics``) write a JSON result beside their log as they
go (a step killed at its box keeps what it measured); the report merges it. A result
that names a reason under ``skipped`` (the fp8 step without torchao) marks its step
skipped, with that one line. Nothing here imports torch at the top: on a machine without
torch or without CUDA ``--gpu`` must refuse in one line (exit 2), not with a traceback.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from gridtrain.selfcheck.report import Report, StepResult

REPO = Path(__file__).resolve().parents[2]
GPU_TEST_FILES = ("tests/test_gpu.py", "tests/test_attention_blocks.py")  # the tests that need CUDA (skipped without)
EXIT_REFUSED = 2
DEFAULT_BUDGET_S = 570.0  # 9.5 minutes: a lent GPU machine allows one command 10
RESERVE_S = 10.0  # of the budget, kept for the runner between steps and a kill's grace (module docstring)
FP8_TIMEOUT_S = 95  # two compiled and three eager runs of 8 TinyLlama layers, 16 steps each (selfcheck/fp8.py)
CPU_BOX_SCALE = 6  # the CPU rehearsal's boxes: the GPU's, this many times
SIDE_BY_SIDE = "side by side"  # the batch of steps that measure no speed (module docstring)
TAIL_LINES = 30
KILL_GRACE_S = 5.0
_RUNNING: set[subprocess.Popen] = set()  # every step's command in flight (several, in a batch)
_RUNNING_LOCK = threading.Lock()


@dataclass
class Step:
    """One time-boxed step: ``commands`` run in order, each must exit 0."""

    name: str
    what: str
    timeout_s: float
    commands: list[list[str]]
    result_file: str | None = None  # a check's JSON result, merged into the report
    env: dict[str, str] = field(default_factory=dict)
    batch: str | None = None  # consecutive steps of one batch run side by side, each in its own box


def stages(steps: list[Step]) -> list[list[Step]]:
    """The plan as it runs: each step alone, or consecutive steps of one batch together."""
    out: list[list[Step]] = []
    for step in steps:
        if out and step.batch is not None and out[-1][0].batch == step.batch:
            out[-1].append(step)
        else:
            out.append([step])
    return out


def plan_seconds(steps: list[Step]) -> float:
    """The longest the plan can take, its stages one after another (a kill's grace and
    the runner's own seconds aside: ``RESERVE_S``)."""
    return sum(max(s.timeout_s for s in stage) for stage in stages(steps))


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
    with _RUNNING_LOCK:
        _RUNNING.add(proc)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return None
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)


def kill_running() -> None:
    """End every step command still in flight, with its process group (an interrupted
    batch: its steps run in threads, which the interrupt does not reach)."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for proc in running:
        _kill_group(proc)


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


CHECKS_MODULE, SEMANTICS_MODULE, FP8_MODULE = ("gridtrain.selfcheck.checks", "gridtrain.selfcheck.cuda_semantics",
                                               "gridtrain.selfcheck.fp8")


def _check(name: str, out: Path, device: str, *flags: str, module: str = CHECKS_MODULE) -> tuple[list[str], str]:
    """A measuring step's command: ``MODULE NAME`` (``gridtrain.selfcheck.checks`` or
    ``.cuda_semantics``), or a module of its own that takes no name (``.fp8``)."""
    result = str(out / "results" / f"{name}.json")
    head = ["-m", module] + ([] if module == FP8_MODULE else [name])
    return [sys.executable, *head, "--device", device, "--result", result, *flags], result


def plan_steps(device: str, out: Path, *, tiny: bool, peak_tflops: float | None) -> list[Step]:
    """The steps, in the order they run (the module docstring: stages, boxes, budget).
    ``device`` is where the model computes (cuda, or cpu for the rehearsal); ``tiny``
    shrinks the measured models."""
    cuda = device == "cuda"
    work = out / "work"
    gloo = ["--backend", "gloo"] if cuda else []  # gloo on cuda: the ranks share the one GPU
    offload = ["--offload-activations"] if cuda else []
    extra = (["--tiny"] if tiny else []) + (["--peak-tflops", str(peak_tflops)] if peak_tflops else [])
    steps = []

    def check(name, what, timeout_s, *flags, module=CHECKS_MODULE, batch=None):
        command, result = _check(name, out, device, *flags, *extra, module=module)
        steps.append(Step(name, what, timeout_s, [command], result, batch=batch))

    def semantics(name, what, timeout_s, batch=None):
        check(name, what, timeout_s, module=SEMANTICS_MODULE, batch=batch)

    check("environment", "versions of the GPU, driver, torch, CUDA, NCCL", 8)
    # what only a GPU shows, one process each, seconds apiece (issue 54)
    semantics("float8-gemms", "torch._scaled_mm (Float8.mm, real) vs the emulated GEMM of the same float8 operands, "
              "tensorwise and rowwise, forward and weight-gradient orientations, 256 and 1000 tokens (not a multiple "
              "of 16): relative difference < 1e-2, no shape raises", 15)
    semantics("grouped-gemm", "the experts' torch._grouped_mm vs the per-expert loop in bf16, three experts without "
              "tokens: output and gradient differences, zero gradients where no token went; the compute capability "
              "and the path gridtrain picks there", 15)
    semantics("efficient-attention-bwd", "gridtrain's efficient attention block (forward, backward with the "
              "non-contiguous output it keeps) in bf16 vs fp64, head size 64 and 320: dq, dk, dv within 2e-2 of "
              "the largest value; torch's SDPA with the efficient backend beside it", 15)
    semantics("head-loss", "the fused, chunked head + cross entropy vs the unfused one (--loss-chunks 0) at a 128K "
              "vocabulary, d 2048, 8K tokens, bf16: time and peak memory of forward + backward, their ratios; "
              "losses within 1e-2", 20)
    # tiny models' launches that measure no speed, side by side (their seconds are start-up)
    batch = SIDE_BY_SIDE
    semantics("offload", f"gridtrain train, AdamW, ZeRO-1, fp32, one rank on {device}, with and without "
              "--optimizer-offload: every step's loss within 1e-6", 40, batch)
    semantics("fp8-zero", f"gridtrain train --fp8 tensorwise, dp 2 (2 gloo ranks on {device}), with --zero 1 and "
              "--zero 3: both run with finite losses; skipped without torchao or below compute capability 8.9",
              60, batch)
    ck0 = str(work / "muon-offload")
    steps.append(Step("optimizers", f"Muon on {device}: one rank ({'NCCL' if cuda else 'gloo'}) with bf16 states and "
                      "the optimizer offloaded to the host, saved and resumed; 2 gloo ranks, ZeRO-3, QK-clip", 75,
                      [_train("--nproc", "1", "--device", device, "--dtype", "bf16", "--optimizer", "muon",
                              "--optimizer-state-dtype", "bf16", "--optimizer-offload", "--steps", "6", "--save",
                              ck0, "--save-interval", "3"),
                       _train("--nproc", "1", "--device", device, "--dtype", "bf16", "--optimizer", "muon",
                              "--optimizer-state-dtype", "bf16", "--optimizer-offload", "--load", ck0, "--steps", "8"),
                       _train("--nproc", "2", "--device", device, *gloo, "--dtype", "bf16", "--optimizer", "muon",
                              "--zero", "3", "--qk-clip", "0.05", "--optimizer-offload", "--steps", "4")],
                      batch=batch))
    ck = str(work / "one-rank")
    steps.append(Step("one-rank", f"one rank on {device} ({'NCCL' if cuda else 'gloo'}): ZeRO-1, selective "
                      "recomputation, async DCP save from device memory, resume",
                      60, [_train("--nproc", "1", "--device", device, "--zero", "1", "--recompute", "selective",
                                  *offload, "--steps", "6", "--save", ck, "--save-interval", "3", "--save-async"),
                           _train("--nproc", "1", "--device", device, "--load", ck, "--steps", "8")], batch=batch))
    steps.append(Step("tp-sp-pp", f"4 gloo ranks on {device}: tp 2 + sequence parallel x pp 2, 1F1B", 45,
                      [_train("--nproc", "4", "--device", device, *gloo, "--tp", "2", "--sequence-parallel",
                              "--pp", "2", "--schedule", "1f1b", "--global-batch-size", "8", "--steps", "4")],
                      batch=batch))
    ck2 = str(work / "dp-zero1")
    steps.append(Step("dp-zero1-dcp", f"2 gloo ranks on {device}: dp 2 + ZeRO-1, offloaded activations, "
                      "async sharded checkpoint, resume", 60,
                      [_train("--nproc", "2", "--device", device, *gloo, "--zero", "1", *offload, "--steps", "4",
                              "--save", ck2, "--save-async"),
                       _train("--nproc", "2", "--device", device, *gloo, "--zero", "1", "--load", ck2,
                              "--steps", "6")], batch=batch))
    steps.append(Step("zb-h1", f"2 gloo ranks on {device}: pp 2, ZB-H1 schedule, full recomputation", 45,
                      [_train("--nproc", "2", "--device", device, *gloo, "--pp", "2", "--schedule", "zb-h1",
                              "--recompute", "full", "--global-batch-size", "8", "--steps", "4")], batch=batch))
    check("parity", f"tiny model, fp32 and bf16 on {device} against fp64 on the CPU (loss curves)", 40, batch=batch)
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GPU_TEST_FILES]
    steps.append(Step("gpu-tests", f"the CUDA tests ({', '.join(GPU_TEST_FILES)})", 75, [tests], batch=batch))
    check("watchdog", f"2 gloo ranks on {device}, rank 1 stopped: the hang is named within the timeout", 60,
          batch=batch)
    # compiled float8, then float8's speed
    semantics("compile-fp8", "gridtrain train --compile --fp8 tensorwise (llama-tiny, bf16, 5 steps) with "
              "TORCH_LOGS=recompiles,graph_breaks: graph breaks and recompiles counted; fails only if the run does",
              45)
    check("fp8", "gridtrain train --fp8 vs bf16 (8 TinyLlama-1.1B layers): compiled bf16 and tensorwise, then "
          "eager bf16, tensorwise and rowwise, back to back: tokens/s ratio, loss curve, peak memory; target 1.25x "
          "compiled bf16 within 1% loss (reported, not failed on); skipped without torchao", FP8_TIMEOUT_S,
          module=FP8_MODULE)
    # the measurements, largest last
    check("cp-attention", "one layer's causal attention at 32K tokens, bf16: context parallelism's fused blocks "
          "(cp 4's chunk pairs, one process) vs fused SDPA on the whole sequence; time, memory, outputs", 20)
    check("document-mask", "gridtrain train --document-mask vs the causal run of the same length (8 TinyLlama "
          "layers, 8K tokens); memory vs the dry run; step time vs the planner", 30, "--rounds", "1")
    check("moe", "gridtrain train vs a plain PyTorch loop of the same small Qwen3-MoE (grouped-GEMM experts); "
          "memory vs the dry run; step time vs the planner", 40, "--model", "moe", "--rounds", "1")
    boxes = {("gpt2", False): 40, ("gpt2", True): 45, ("llama", False): 30, ("llama", True): 60}
    for model in ("gpt2", "llama"):
        for compiled in (False, True):
            name = f"throughput-{model}" + ("-compile" if compiled else "")
            rounds = "1" if compiled else "2"
            flags = ["--compile"] if compiled else (["--profile"] if model == "gpt2" else [])
            shape = "GPT-2 124M" if model == "gpt2" else "8 TinyLlama-1.1B layers"
            check(name, f"gridtrain train vs a plain PyTorch loop, {shape}{' --compile' if compiled else ''}, "
                  f"{'interleaved x 2' if rounds == '2' else 'one run each'}; memory vs the dry run; step time vs "
                  "the planner", boxes[model, compiled], "--model", model, "--rounds", rounds, *flags)
    if not cuda:  # the rehearsal: tiny models, but on a CPU (two cores, perhaps shared), not budgeted
        for step in steps:
            step.timeout_s *= CPU_BOX_SCALE
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
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help=f"wall-clock budget of the whole check (default {DEFAULT_BUDGET_S:.0f})")
    ap.add_argument("--only", default=None, help="comma-separated step names to run (default: all)")
    ap.add_argument("--tiny", action="store_true", help="tiny throughput models (implied by --device cpu)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU where it is not known")
    return ap


def _outcome(result: StepResult) -> str:
    return f"{result.status} ({result.seconds:.0f} s){': ' + result.detail if result.detail else ''}"


def run_side_by_side(stage: list[Step], logs: Path, budget_left_s: float, report: Report) -> None:
    """Start every step of a batch at once, each under min(its box, the budget left);
    each result joins the report as its step ends."""
    print(f"gpu-check: side by side: {', '.join(s.name for s in stage)}", flush=True)
    pool = ThreadPoolExecutor(max_workers=len(stage))
    try:
        pending = {pool.submit(run_step, step, logs, budget_left_s) for step in stage}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                result = future.result()
                print(f"gpu-check: {result.name}: {_outcome(result)}", flush=True)
                report.add(result)
                report.write()
    except BaseException:  # an interrupt: the threads' commands end with it, then the threads
        kill_running()
        raise
    finally:
        pool.shutdown(wait=True)


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
    try:
        for stage in stages(steps):
            left = args.budget_s - (time.monotonic() - began)
            if left < 5:
                for step in stage:
                    report.add(StepResult(step.name, step.what, "skipped", 0.0, "no time left in --budget-s", "", {}))
                report.write()
            elif len(stage) == 1:
                print(f"gpu-check: {stage[0].name} ... ", end="", flush=True)
                result = run_step(stage[0], out / "logs", left)
                print(_outcome(result), flush=True)
                report.add(result)
                report.write()
            else:
                run_side_by_side(stage, out / "logs", left, report)
    except BaseException:
        kill_running()
        raise
    report.finish()
    report.write()
    print(f"gpu-check: {report.summary()}; report: {out / 'report.md'}")
    return 0 if report.all_passed() else 1
