"""The planner against published runs (benchmarks/calibration_rows.py): each bf16 row's
own layout predicted on its hardware, beside the published throughput, and the error
by axis group (dense 3D, cp, ZeRO-2/3/HSDP, MoE). A prediction from the cost model, not
a measurement; no process is started.

    python3 benchmarks/planner_calibration.py              # the calibration rows (a few seconds)
    python3 benchmarks/planner_calibration.py --holdout    # also the held-out Model Zoo rows

Per row: the published layout's fields are fixed (tp, pp, cp, dp, ep, etp, ZeRO stage,
micro-batch, recomputation, the cp exchange and vpp where printed); what the source does
not print (a micro-batch, the recomputation) is left to the search, whose fastest fitting
layout is the prediction, and an interleaved run's unprinted chunk count is tried over
``VPP_CANDIDATES``. Throughput is compared as printed: tokens/s per GPU as tokens/s per
GPU, TFLOP/s per GPU as model TFLOP/s (6 N per token and the attention's, no
recomputation; what Megatron's counter and the Llama 3 paper's MFU count). Rows that
cannot be predicted are listed with the reason: fp8 (no FP8 costs yet), hardware without
a profile (GB200, H800), a metric without a step (GPU hours). torchtitan's H100s (96 GB
HBM2e at 500 W) are costed as ``TT_H100`` below, its selective checkpointing as
:func:`predict` says, and its ``--compile`` rows are compared with the same eager
prediction. docs/planner.md sets the table beside what was fit on it.
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

# torchtitan's Grand Teton H100s (96 GB HBM2e, 500 W): "the actual peak TFLOPs should be
# between SXM and NVL, and we don't know the exact value" (torchtitan, arXiv 2410.06511).
# Costed as the h100-sxm machine with the H100 NVL's dense bf16 peak (NVIDIA H100 datasheet:
# 1,671 TFLOPS with sparsity, dense half: the low end of that range) and the HBM2e bandwidth
# of the H100 PCIe (datasheet: 80 GB HBM2e, 2.0 TB/s), 96 GB: datasheet figures of the
# nearest parts, not fit to the rows.
TT_H100 = dataclasses.replace(MACHINES["h100-sxm"], name="h100-96gb-hbm2e-500w",
                              peak={**MACHINES["h100-sxm"].peak, "bf16": 835.5e12, "fp16": 835.5e12},
                              memory_bandwidth=2.0e12, memory=96e9)
HARDWARE = {"h100-96gb-hbm2e-500w": TT_H100}
METRICS = ("tokens_per_s_per_gpu", "tflops_per_gpu")
VPP_CANDIDATES = (2, 3, 4, 5, 6, 8)  # chunks per pipeline rank tried where a run interleaves an unprinted number


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
    if row.hardware not in HARDWARE and row.hardware not in MACHINES:
        return f"no profile for {row.hardware}"
    if row.metric not in METRICS:
        return f"metric {row.metric}"
    if global_batch(row) is None:
        return "no global batch printed or derived"
    return None


def predict_row(row: Row):
    """The fastest fitting layout with the row's printed fields fixed (None: none fits).
    An interleaved run whose chunk count is not printed (vpp 0) tries each of
    ``VPP_CANDIDATES`` that leaves every chunk a layer, uneven splits included (as a
    given ``--vpp`` does), and keeps the fastest."""
    model = model_of(row)
    job = Job(model=model, global_batch_size=global_batch(row),
              hardware=HARDWARE.get(row.hardware) or machine(row.hardware, row.gpus), dtype="bf16")
    interleaved = row.vpp != 1 and row.pp > 1
    vpps = [v for v in VPP_CANDIDATES if model.n_layer >= row.pp * v] if row.vpp == 0 and interleaved \
        else [None if row.vpp == 0 else row.vpp]
    found = []
    for vpp in vpps:
        fixed = Fixed(tp=row.tp, pp=row.pp, cp=row.cp, vpp=vpp,
                      micro_batch_size=row.micro_batch_size, ep=row.ep, etp=row.etp, zero=row.zero,
                      recompute=None if row.recompute == "unknown" else row.recompute,
                      schedule="interleaved-1f1b" if interleaved else None,
                      zero_shard_size=row.zero_shard_size or None,
                      zero3_keep_gathered=row.keep_gathered if row.zero == 3 else None,
                      cp_comm=row.cp_comm or None)
        found += search(job, row.gpus, fixed, top=1)
    # the fastest: where none fits the planner's memory (a published run did fit: the table
    # says so beside it), the fastest of each chunk count's least-memory layouts
    return min(found, key=lambda p: (not p.fits, p.step_time_s), default=None)


def predict(row: Row):
    """(the prediction, its step time). torchtitan's selective activation checkpointing
    (``row.sac``) is not a gridtrain mode: "layer" checkpoints every second block whole
    (torchtitan's default frequency; the rows do not print theirs), "op" recomputes every
    second matmul's output and the cheap operations around them, about as much. Their
    rows have one pipeline stage, where a step is the sum of its blocks' costs, so its
    step time is the mean of the same layout's without recomputation and with full."""
    if not row.sac:
        p = predict_row(row)
        return p, p.step_time_s if p else None
    assert row.pp == 1, f"{row.name}: torchtitan's selective checkpointing is costed for one stage only"
    none, full = (predict_row(dataclasses.replace(row, recompute=r, sac="")) for r in ("none", "full"))
    if none is None or full is None:
        return None, None
    return none, (none.step_time_s + full.step_time_s) / 2


def predicted_value(row: Row, p, step: float) -> float:
    """The row's metric of prediction ``p`` at a step of ``step`` seconds."""
    rate = p.tokens_per_s_per_gpu if row.metric == "tokens_per_s_per_gpu" else p.model_tflops_per_gpu
    return rate * p.step_time_s / step


def evaluate(rows) -> tuple[list[tuple], list[tuple[str, str]]]:
    """Each predictable row as (row, prediction, predicted value, error), and the others
    as (name, why not)."""
    done, skipped = [], []
    for row in rows:
        reason = why_not(row)
        p, step = (None, None) if reason else predict(row)
        if reason or p is None:
            skipped.append((row.name, reason or "the planner finds no layout with these fields"))
            continue
        got = predicted_value(row, p, step)
        done.append((row, p, got, got / row.value - 1))
    return done, skipped


def group_errors(done) -> dict[str, tuple[int, float, float]]:
    """(rows, median and worst absolute error) by axis group."""
    errors: dict[str, list[float]] = {}
    for row, _, _, error in done:
        errors.setdefault(row.group, []).append(abs(error))
    return {g: (len(e), statistics.median(e), max(e)) for g, e in sorted(errors.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--holdout", action="store_true", help="also the held-out rows")
    args = ap.parse_args()
    done, skipped = evaluate(list(ROWS) + (list(HOLDOUT) if args.holdout else []))
    print("| row | group | GPUs | layout | metric | published | predicted | error |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: |")
    for row, p, got, error in done:
        lay = p.layout
        recompute = f"torchtitan SAC ({row.sac})" if row.sac else lay.recompute
        cp = f"{lay.cp} {lay.cp_comm}" if lay.cp > 1 else "1"
        layout = (f"dp {lay.dp} tp {lay.tp} pp {lay.pp} vpp {lay.vpp} cp {cp} ep {lay.ep}"
                  f" mb {lay.micro_batch_size} {recompute} {lay.zero_name() or 'ZeRO-0'}"
                  f"{' fits' if p.fits else ' DOES NOT FIT'}")
        print(f"| {row.name} | {row.group} | {row.gpus} | {layout} | {row.metric} | {row.value:,.0f} | "
              f"{got:,.0f} | {100 * error:+.1f}% |")
    print("\n| group | rows | median abs error | worst |")
    print("| --- | ---: | ---: | ---: |")
    for group, (n, median, worst) in group_errors(done).items():
        print(f"| {group} | {n} | {100 * median:.1f}% | {100 * worst:.1f}% |")
    print("\nnot predicted:")
    for name, reason in skipped:
        print(f"  {name}: {reason}")


if __name__ == "__main__":
    main()
