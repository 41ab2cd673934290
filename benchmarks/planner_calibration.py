"""The planner against published runs (benchmarks/calibration_rows.py): each bf16 row's
own layout predicted on its hardware, beside the published throughput, and the error
by axis group (dense 3D, cp, ZeRO-2/3/HSDP, MoE). A prediction from the cost model, not
a measurement; no process is started.

    python3 benchmarks/planner_calibration.py              # the calibration rows (~1 min)
    python3 benchmarks/planner_calibration.py --holdout    # also the held-out Model Zoo rows

Per row: the published layout's fields are fixed (tp, pp, cp, dp, ep, etp, ZeRO stage,
micro-batch, recomputation, vpp where printed); what the source does not print (a
micro-batch, vpp of an interleaved run, the recomputation) is left to the search, whose
fastest fitting layout is the prediction. Throughput is compared as printed: tokens/s
per GPU as tokens/s per GPU, TFLOP/s per GPU as model TFLOP/s (6 N per token and the
attention's, no recomputation; what Megatron's counter and the Llama 3 paper's MFU
count). Rows that cannot be predicted are listed with the reason: fp8 (no FP8 costs
yet), hardware without a profile (GB200, H800), a metric without a step (GPU hours).
torchtitan's H100s are 96 GB HBM2e cards at 500 W, costed as ``h100-sxm`` (faster), and
its ``--compile`` rows are compared with the same eager prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import common  # noqa: F401  benchmarks/common.py: the script's own folder is on sys.path
from calibration_rows import HOLDOUT, ROWS, Row
from gridtrain.config import PRESETS, ModelConfig, preset_config
from gridtrain.planner.cost import Job
from gridtrain.planner.machine import MACHINES, machine
from gridtrain.planner.search import Fixed, search

HARDWARE = {"h100-96gb-hbm2e-500w": "h100-sxm"}  # the nearest profile (see the docstring)
METRICS = ("tokens_per_s_per_gpu", "tflops_per_gpu")


def model_of(row: Row) -> ModelConfig:
    """The row's model: its preset with the fields the run changed, or its shape alone."""
    base = preset_config(row.model).model if row.model in PRESETS else ModelConfig()
    return dataclasses.replace(base, **row.shape, seq_len=row.seq_len, dropout=0.0)


def global_batch(row: Row) -> int | None:
    if row.global_batch_size:
        return row.global_batch_size
    for name, value, _ in row.derived:
        if name == "global_batch_size":
            return int(value)
    return None


def why_not(row: Row) -> str | None:
    """Why a row is not predicted, or None."""
    if row.dtype != "bf16":
        return f"{row.dtype}: no FP8 costs yet"
    if HARDWARE.get(row.hardware, row.hardware) not in MACHINES:
        return f"no profile for {row.hardware}"
    if row.metric not in METRICS:
        return f"metric {row.metric}"
    if global_batch(row) is None:
        return "no global batch printed or derived"
    return None


def predict_row(row: Row):
    """The fastest fitting layout with the row's printed fields fixed (None: none fits)."""
    model = model_of(row)
    job = Job(model=model, global_batch_size=global_batch(row),
              hardware=machine(HARDWARE.get(row.hardware, row.hardware), row.gpus), dtype="bf16")
    fixed = Fixed(tp=row.tp, pp=row.pp, cp=row.cp, vpp=None if row.vpp == 0 else row.vpp,
                  micro_batch_size=row.micro_batch_size, ep=row.ep, etp=row.etp, zero=row.zero,
                  recompute=None if row.recompute == "unknown" else row.recompute,
                  schedule="interleaved-1f1b" if row.vpp != 1 and row.pp > 1 else None,
                  zero_shard_size=row.zero_shard_size or None)
    best = search(job, row.gpus, fixed, top=1)
    return best[0] if best else None


def predicted_value(row: Row, p) -> float:
    return p.tokens_per_s_per_gpu if row.metric == "tokens_per_s_per_gpu" else p.model_tflops_per_gpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--holdout", action="store_true", help="also the held-out rows")
    args = ap.parse_args()
    rows = list(ROWS) + (list(HOLDOUT) if args.holdout else [])
    errors: dict[str, list[float]] = {}
    skipped = []
    print("| row | group | GPUs | layout | metric | published | predicted | error |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: |")
    for row in rows:
        reason = why_not(row)
        if reason:
            skipped.append((row.name, reason))
            continue
        p = predict_row(row)
        if p is None:
            skipped.append((row.name, "the planner finds no layout with these fields"))
            continue
        lay = p.layout
        got = predicted_value(row, p)
        error = got / row.value - 1
        errors.setdefault(row.group, []).append(abs(error))
        layout = (f"dp {lay.dp} tp {lay.tp} pp {lay.pp} vpp {lay.vpp} cp {lay.cp} ep {lay.ep} mb "
                  f"{lay.micro_batch_size} {lay.recompute} z{lay.zero}{' fits' if p.fits else ' DOES NOT FIT'}")
        print(f"| {row.name} | {row.group} | {row.gpus} | {layout} | {row.metric} | {row.value:,.0f} | "
              f"{got:,.0f} | {100 * error:+.1f}% |", flush=True)
    print("\n| group | rows | median abs error | worst |")
    print("| --- | ---: | ---: | ---: |")
    for group, errs in sorted(errors.items()):
        print(f"| {group} | {len(errs)} | {100 * statistics.median(errs):.1f}% | {100 * max(errs):.1f}% |")
    print("\nnot predicted:")
    for name, reason in skipped:
        print(f"  {name}: {reason}")


if __name__ == "__main__":
    main()
