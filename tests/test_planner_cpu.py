"""The planner's ``cpu`` machine and ``--measure``, as data: a host profile becomes one
worker's share of the host, and a predicted layout becomes the ``gridtrain train``
command that runs exactly it (checked by the CLI's own parser and validation, nothing
run)."""

from __future__ import annotations

import pytest

from gridtrain.cli import parser as cli
from gridtrain.config import ModelConfig
from gridtrain.planner.cost import Job, Layout, predict
from gridtrain.planner.machine import machine_from_profile
from gridtrain.planner.measure import train_args
from gridtrain.planner.profile import _fit
from gridtrain.training.validate import validate

PROFILE = {"cores": 4, "gemm_flops": {"32": 2e9, "64": 4e9, "128": 6e9, "512": 8e9}, "bandwidth": 1e10,
           "kernel_s": 2e-5, "link": {"all_reduce": [1e-4, 1e9], "all_gather": [2e-4, 5e8],
                                      "reduce_scatter": [3e-4, 4e8], "send": [5e-5, 2e9]}}


@pytest.mark.parametrize("world,share", [(1, 4), (2, 2), (4, 1), (8, 0.5)])
def test_a_worker_gets_its_share_of_the_host(world, share):
    """gridtrain's workers take cores // world threads; more workers than cores share them."""
    m = machine_from_profile(PROFILE, world)
    assert m.peak_flops("fp32") == pytest.approx(8e9 * share)
    assert m.memory_bandwidth == pytest.approx(1e10 * share)
    assert m.gemm_efficiency == 1.0 and m.kernel_s == 2e-5
    assert m.link(2) == m.link(64)  # one host: every group on the same (gloo) link


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_each_kind_of_gloo_operation_keeps_its_measured_rates(world):
    """Latency as measured; bandwidth shared when more workers than cores copy through
    the loopback."""
    link = machine_from_profile(PROFILE, world).link(2)
    crowd = max(1, world / 4)
    for kind, (latency, bandwidth) in PROFILE["link"].items():
        assert link.rates(kind) == pytest.approx((latency, bandwidth / crowd))
    assert (link.latency, link.bandwidth) == pytest.approx((1e-4, 1e9 / crowd))


@pytest.mark.parametrize("kind,steps,share", [("all_reduce", 2, 1.0), ("all_gather", 1, 0.5),
                                              ("reduce_scatter", 1, 0.5), ("send", 1, 1.0)])
def test_rates_are_fitted_to_two_rank_timings(kind, steps, share):
    """t = a + c x over (bytes, seconds): a is ``steps`` ring-step latencies, and the
    bytes a rank sends (all of them for an all-reduce or a send, half for an all-gather
    or a reduce-scatter between two ranks) move at the bandwidth."""
    latency, bandwidth = 7e-4, 3e8
    points = [(x, steps * latency + share * x / bandwidth) for x in (1 << 16, 1 << 19, 1 << 21)]
    assert _fit(kind, points) == pytest.approx([latency, bandwidth])


def test_gemm_half_is_fitted_to_the_measured_sizes():
    """x / (x + h) = f(x) / peak at each size below the peak's; h is their median."""
    m = machine_from_profile(PROFILE, 1)
    # 32: h = 32 (8/2 - 1) = 96; 64: 64 (2 - 1) = 64; 128: 128 (8/6 - 1) = 42.7
    assert m.gemm_half == pytest.approx(64.0)


LAYOUTS = [
    Layout(dp=1, tp=2, pp=2, vpp=2, micro_batch_size=1, schedule="interleaved-1f1b", recompute="selective",
           sequence_parallel=True),
    Layout(dp=2, tp=1, pp=2, micro_batch_size=2, schedule="zb-h1", recompute="full", zero=1),
]


@pytest.mark.parametrize("lay", LAYOUTS)
def test_measure_runs_exactly_the_predicted_layout(lay):
    model = ModelConfig(n_layer=4, n_head=4, d_model=64, seq_len=32, vocab_size=257)
    p = predict(Job(model, 8, machine_from_profile(PROFILE, lay.gpus), "fp32"), lay, memory=False)
    argv = train_args(["--n-layer", "4", "--n-head", "4", "--d-model", "64", "--vocab-size", "257"], p, 8, 32,
                      "fp32", 3)
    cfg = validate(cli.config_from_args(cli.build_parser().parse_args(argv)), lay.gpus)
    par, t = cfg.parallel, cfg.training
    assert (par.nproc, par.tp, par.pp, par.vpp, par.schedule, par.sequence_parallel) == \
        (lay.gpus, lay.tp, lay.pp, lay.vpp, lay.schedule, lay.sequence_parallel)
    assert (t.micro_batch_size, t.global_batch_size, cfg.activations.recompute, par.zero, t.dtype, t.steps) == \
        (lay.micro_batch_size, 8, lay.recompute, lay.zero, "fp32", 3)
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.seq_len) == (4, 64, 32)
