"""Step timings go through a clock (timing.py): host time on CPU, CUDA events on a GPU.

The arithmetic that turns marks into busy time, wall time, traces and the data-parallel
overlap is tested as data, with a clock whose marks are opaque objects (as CUDA events
are): every duration must come from ``clock.seconds``, never from subtracting marks.
"""

import pytest
import torch

from gridtrain.runtime import timing
from gridtrain.config import ModelConfig
from gridtrain.parallel.data_parallel import OverlapStats
from gridtrain.models.decoder import profile_units
from gridtrain.parallel.pipeline.runtime import StageStats


class Event:
    """An opaque mark, like a CUDA event: only the clock knows its time."""

    def __init__(self, t: float):
        self._t = t

    def __sub__(self, other):  # pragma: no cover - a test failure if ever called
        raise AssertionError("durations must come from clock.seconds, not mark subtraction")


class EventClock:
    on_host = False

    def seconds(self, start: Event, end: Event) -> float:
        return end._t - start._t


@pytest.mark.parametrize("clock, mark", [(timing.HostClock(), float), (EventClock(), Event)])
def test_stage_stats_from_marks(clock, mark):
    stats = StageStats(clock=clock, began=mark(0.5), ended=mark(6.0), began_host=100.0, tracing=True,
                       spans=[("F(mb 0)", mark(1.0), mark(2.0)), ("P2P", mark(2.0), mark(3.0)),
                              ("B(mb 0)", mark(3.0), mark(5.0)), ("W(mb 0)", mark(5.0), mark(5.5))])
    assert stats.busy_s == pytest.approx(3.5)  # F, B, W; not the P2P wait
    assert stats.wall_s == pytest.approx(5.5)
    assert [name for name, _, _ in stats.trace] == ["F(mb 0)", "P2P", "B(mb 0)", "W(mb 0)"]
    assert stats.trace[0][1:] == pytest.approx((100.5, 101.5))
    assert stats.trace[-1][1:] == pytest.approx((104.5, 105.0))
    stats.tracing = False
    assert stats.trace == []


@pytest.mark.parametrize("clock, mark", [(timing.HostClock(), float), (EventClock(), Event)])
def test_overlap_stats_from_marks(clock, mark):
    # bucket 1: launched at 0, done at 1, the step began waiting at 3: all hidden;
    # bucket 2: launched at 2, done at 5: 1 s hidden (2 to 3), 2 s exposed
    stats = OverlapStats(clock, [(mark(0), mark(1), mark(3)), (mark(2), mark(5), mark(3))])
    assert stats.in_flight_s == pytest.approx(4.0)
    assert stats.hidden_s == pytest.approx(2.0)
    assert stats.fraction == pytest.approx(0.5)
    assert OverlapStats(clock).fraction == 0.0


def test_clock_for_chooses_events_only_where_cuda_records_them(monkeypatch):
    assert isinstance(timing.clock_for("cpu"), timing.HostClock)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert isinstance(timing.clock_for("cuda"), timing.HostClock)  # the dry run's fake CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert isinstance(timing.clock_for(torch.device("cuda", 1)), timing.CudaClock)
    assert isinstance(timing.clock_for("cpu"), timing.HostClock)


def test_time_profile_runs_on_the_training_device_and_dtype(monkeypatch):
    """--pp-partition time profiles with the run's device and dtype: every unit's
    parameters and inputs are in the training dtype when timed."""
    seen = []
    original = timing.median_seconds

    def spy(fn, runs, clock):
        seen.append(clock)
        return original(fn, runs, clock)

    monkeypatch.setattr("gridtrain.models.decoder.median_seconds", spy)
    cfg = ModelConfig(vocab_size=64, seq_len=8, d_model=16, n_layer=2, n_head=2)
    dtypes = []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, args: dtypes.extend(p.dtype for p in m.parameters(recurse=False)))
    try:
        blocks, embedding, head = profile_units(cfg, 2, steps=1, device="cpu", dtype=torch.float64)
    finally:
        handle.remove()
    assert len(blocks) == 2 and min(blocks + [embedding, head]) > 0
    assert set(dtypes) == {torch.float64}
    assert len(seen) == 4 and all(isinstance(c, timing.HostClock) for c in seen)
