"""The self-check's ``fp8`` step: ``gridtrain train --fp8`` against bf16 on one device.

``python -m gridtrain.selfcheck.fp8 --device D --result FILE [--tiny] [--peak-tflops T]``

TinyLlama-1.1B's layers (the ``tinyllama-1.1b`` preset: d 2048, 32 heads, 4 key/value
heads, ffn 5632, 2,048 tokens, its 32K vocabulary), 8 of its 22 so that the step fits its
time box (runner.py: every run draws its weights on the host, every compiled one
compiles), train 16 steps in bf16, with ``--fp8 tensorwise`` and with ``--fp8
rowwise``: compiled first, bf16 then tensorwise (the target compares compiled with
compiled, and a short GPU lease should measure that before anything else), then eager,
bf16, tensorwise and rowwise; each mode's recipes back to back (interleaved), the same
seed and data, ``torch._dynamo.reset()`` between compiled runs (one process: no run
inherits another's graphs or recompile counts). Each run reports its median step
(tokens/s), its loss curve and its peak device memory; each recipe its speed against
bf16 of the same compile mode, its final-loss and largest per-step loss difference
against that bf16 run, its memory against it, and the planner's predicted speed-up
beside the measured one.

The target (issue 44) is a compiled float8 run at 1.25x or more of compiled bf16's
tokens/s with a loss curve within 1% (over 100 steps there; fewer here, to fit the
lease): it is reported as ``target`` pass/fail for compiled tensorwise, and does not
fail the step. A run that raises does. Without torchao's float8 (``import
torchao.float8``) the step is skipped in one line (the result's ``skipped``, which the
runner reports as such).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from gridtrain.config import set_fields
from gridtrain.models.decoder import training_flops_per_token
from gridtrain.selfcheck.baseline import median_after, throughput_row
from gridtrain.selfcheck.checks import (GIB, LLAMA_LAYERS, Result, _device, _free, _run_config, fresh_compile,
                                        gridtrain_rows, hardware_key, predicted_step_s, relative_difference)
from gridtrain.training.metrics import peak_tflops

# (preset, micro-batch size, steps, warm-up steps left out of the median); the full run
# keeps LLAMA_LAYERS of the preset's layers
FP8_RUN, TINY_FP8_RUN = ("tinyllama-1.1b", 4, 16, 4), ("llama-tiny", 4, 6, 2)
RECIPES = ("none", "tensorwise", "rowwise")  # bf16 first: the others are measured against it
COMPILED_RECIPES = ("none", "tensorwise")  # compiled: bf16 and one float8 recipe (each compile costs tens of s)
TARGET_SPEEDUP = 1.25  # compiled float8 over compiled bf16, tokens/s
TARGET_LOSS = 0.01  # the final loss's relative difference from bf16's


def torchao_missing() -> str | None:
    """Why float8 cannot run here (one line), or None."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # noqa: BLE001 -- any failure to import is the same answer
        return f"fp8: skipped: torchao's float8 does not import here ({type(e).__name__}: {e}); pip install torchao"
    return None


def compile_modes(device: torch.device) -> tuple[bool, ...]:
    """Compiled then eager on a GPU; eager only on a CPU (float8 emulated there: numerics
    only, and inductor's CPU compile of every run would take the rehearsal's time)."""
    return (True, False) if device.type == "cuda" else (False,)


def label(recipe: str, compiled: bool) -> str:
    return ("bf16" if recipe == "none" else f"fp8 {recipe}") + (" compile" if compiled else "")


def summary_row(recipe: str, compiled: bool, run: dict, base: dict, predicted: float | None) -> dict:
    """One recipe against bf16 of the same compile mode: speed, loss, memory, target."""
    speed = run["tokens_per_s"] / base["tokens_per_s"]
    final = abs(run["losses"][-1] - base["losses"][-1]) / abs(base["losses"][-1])
    row = {"run": label(recipe, compiled), "fp8": recipe, "compile": compiled, "tokens_per_s": run["tokens_per_s"],
           "step_ms": run["step_ms"], "mfu": run["mfu"], "vs_bf16": speed, "final_loss": run["losses"][-1],
           "final_loss_rel_diff": final, "max_loss_rel_diff": relative_difference(run["losses"], base["losses"]),
           "steps": len(run["losses"]), "peak_gib": run["peak_gib"],
           "memory_vs_bf16": run["peak_gib"] / base["peak_gib"] if base["peak_gib"] else None,
           "predicted_vs_bf16": predicted, "target": "n/a"}
    if recipe != "none" and compiled:
        row["target"] = "pass" if speed >= TARGET_SPEEDUP and final <= TARGET_LOSS else "fail"
    return row


def run_configs(args, device: torch.device) -> list[tuple[bool, str, object]]:
    """(compiled, recipe, config) of every run in the order they run: per compile mode
    (:func:`compile_modes`) bf16 then the float8 recipes (compiled: tensorwise; eager:
    tensorwise, rowwise); one micro-batch per step."""
    preset, mbs, steps, _ = TINY_FP8_RUN if args.tiny else FP8_RUN
    base = _run_config(args, preset, mbs, steps)
    if not args.tiny:
        base.model = dataclasses.replace(base.model, n_layer=LLAMA_LAYERS)
    return [(compiled, recipe, set_fields(copy.deepcopy(base), compile=compiled, fp8=recipe))
            for compiled in compile_modes(device) for recipe in (COMPILED_RECIPES if compiled else RECIPES)]


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.3f}x"


def fp8_check(args, result: Result) -> int:
    problem = torchao_missing()
    if problem:
        print(problem)
        result.set("skipped", problem)
        return 0
    device = _device(args)
    preset, mbs, steps, warmup = TINY_FP8_RUN if args.tiny else FP8_RUN
    planned = run_configs(args, device)
    m = planned[0][2].model
    flops, peak = training_flops_per_token(m), peak_tflops(device, args.peak_tflops)
    hardware = hardware_key(device)
    print(f"fp8: {preset} ({m.n_layer} layers), {mbs} x {m.seq_len} tokens per step, {steps} steps a run: "
          + ", then ".join(f"{'compiled' if c else 'eager'} {', '.join(COMPILED_RECIPES if c else RECIPES)}"
                           for c in compile_modes(device)))
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for compiled in compile_modes(device):
            runs: dict[str, dict] = {}
            for recipe, cfg in ((r, c) for done, r, c in planned if done == compiled):
                name = label(recipe, compiled)
                fresh_compile(compiled)
                try:
                    rows, used = gridtrain_rows(cfg, device, Path(tmp), name.replace(" ", "-"))
                except Exception as e:  # noqa: BLE001 -- reported; the other runs go on
                    failed += 1
                    print(f"{name}: failed\n{traceback.format_exc()}")
                    result.add("errors", {"run": name, "error": str(e).splitlines()[0][:300] if str(e) else repr(e)})
                    continue
                finally:
                    fresh_compile(compiled)
                    _free(device)
                step = median_after([r["step_time_s"] for r in rows], warmup)
                run = throughput_row(preset, compiled, name, step, mbs * m.seq_len, flops, peak)
                run.update(losses=[r["loss"] for r in rows], peak_gib=used / GIB)
                runs[recipe] = run
                result.add("fp8_runs", run)
                print(f"{name}: {run['tokens_per_s']:,.0f} tokens/s, final loss {run['losses'][-1]:.4f}, "
                      f"peak {run['peak_gib']:.2f} GiB")
            if "none" not in runs:
                continue
            base = runs["none"]
            bf16_s = predicted_step_s(m, mbs, "bf16", hardware) if hardware else None
            for recipe, run in runs.items():
                predicted = bf16_s / predicted_step_s(m, mbs, "bf16", hardware, fp8=recipe) if bf16_s else None
                row = summary_row(recipe, compiled, run, base, predicted)
                result.add("fp8", row)
                if recipe != "none":
                    print(f"{row['run']}: {row['vs_bf16']:.3f}x bf16's tokens/s (planner: "
                          f"{_times(row['predicted_vs_bf16'])}), final loss {row['final_loss_rel_diff']:.2%} from "
                          f"bf16's, largest step difference {row['max_loss_rel_diff']:.2%}, memory "
                          f"{_times(row['memory_vs_bf16'])}; target ({TARGET_SPEEDUP}x at {TARGET_LOSS:.0%}): "
                          f"{row['target']}")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m gridtrain.selfcheck.fp8")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--result", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.set_defaults(dtype="bf16", compile=False)  # what _run_config reads; each run sets its own compile
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return fp8_check(args, Result(args.result))


if __name__ == "__main__":
    sys.exit(main())
