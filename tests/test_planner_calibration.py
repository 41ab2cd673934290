"""The planner against the published runs it is calibrated on (benchmarks/calibration_rows.py,
benchmarks/planner_calibration.py): the error bounds docs/planner.md states, by axis group,
and the rows' mapping onto gridtrain's layouts. Predictions of the cost model: no process,
no timing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import calibration_rows  # noqa: E402
import planner_calibration as calibration  # noqa: E402


@pytest.fixture(scope="module")
def done():
    rows, _ = calibration.evaluate(calibration_rows.ROWS)
    return rows


def test_every_axis_group_within_ten_percent_median_and_twenty_five_worst(done):
    groups = calibration.group_errors(done)
    assert set(groups) == {"dense3d", "cp", "zero", "moe"}
    for group, (n, median, worst) in groups.items():
        assert median <= 0.10 and worst <= 0.25, (group, n, median, worst)


def test_the_rows_take_the_published_layouts(done):
    """Every printed field is the predicted layout's; an unprinted chunk count is searched."""
    for row, p, _, _ in done:
        lay = p.layout
        assert (lay.tp, lay.pp, lay.cp, lay.ep, lay.zero) == (row.tp, row.pp, row.cp, row.ep, row.zero), row.name
        assert lay.dp == row.dp, row.name
        if row.vpp:
            assert lay.vpp == row.vpp, row.name
        if row.micro_batch_size:
            assert lay.micro_batch_size == row.micro_batch_size, row.name
        if row.cp_comm:
            assert lay.cp_comm == row.cp_comm, row.name


def test_torchtitan_selective_checkpointing_costs_half_the_blocks_recomputed():
    """One stage: a step is its blocks' sum, so every second block recomputed whole costs
    the mean of no recomputation and full."""
    row = calibration_rows.row("tt-a100-llama2-13b-fsdp64-sel-layer")
    p, step = calibration.predict(row)
    none, _ = calibration.predict(calibration.dataclasses.replace(row, recompute="none", sac=""))
    full, _ = calibration.predict(calibration.dataclasses.replace(row, recompute="full", sac=""))
    assert p.layout.recompute == "none" and step == pytest.approx((none.step_time_s + full.step_time_s) / 2)
    assert none.step_time_s < step < full.step_time_s


def test_llama3_fsdp_is_recorded_with_zero_1_collectives():
    """Gradients accumulated whole over the micro-batches and reduce-scattered once,
    parameters gathered once a step: ZeRO-1's step, as the row's note quotes."""
    for name in ("llama3-paper-405b-8192gpu-8k", "llama3-paper-405b-16384gpu-8k",
                 "llama3-paper-405b-16384gpu-128k-cp16"):
        row = calibration_rows.row(name)
        assert row.zero == 1 and "reduce-scatter gradients in FP32" in row.notes
