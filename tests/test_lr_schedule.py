"""Learning-rate schedules (gridtrain/optim/schedules.py): the curves as data, the bad
inputs refused before any process starts, and a resumed run that follows the same curve.

The values below are worked by hand from the definitions in schedules.py's docstring:
a run of N = 20 steps, peak lr 1, floor 0.1, warm-up W = 2 (0.5 at step 0, 1 at step 1);
wsd with --lr-decay-fraction 0.2 decays over the last D = 4 steps (16..19), at progress
1/4, 2/4, 3/4, 1.
"""

from __future__ import annotations

import json
import math

import pytest

from gridtrain import checkpoint
from gridtrain.cli import parser as cli
from gridtrain.config import LR_DECAY_SHAPES, LR_SCHEDULES, OptimConfig
from gridtrain.optim.optimizer import lr_at
from gridtrain.optim.schedules import Schedule, decay_factor, resume_note, schedule_in_meta, schedule_of
from gridtrain.training.validate import validate
from tests.training import tiny_config, train_in_process

N = 20
WARM = [0.5, 1.0]


def _curve(kind: str, shape: str | None = None, steps: int = N, **fields) -> list[float]:
    o = OptimConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.1, lr_schedule=kind, lr_decay_shape=shape, **fields)
    return [lr_at(k, o, steps) for k in range(steps)]


def _old_cosine(step: int, o: OptimConfig, steps: int) -> float:
    """lr_at before schedules could be chosen, verbatim: the default must stay this."""
    warmup = o.warmup(steps)
    if step < warmup:
        return o.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    floor = o.lr * o.min_lr_ratio
    return floor + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (o.lr - floor)


@pytest.mark.parametrize("steps, warmup", [(10, 2), (100, None), (7, 0), (3, 5), (1, None)])
def test_the_default_is_the_cosine_schedule_of_before_bit_for_bit(steps, warmup):
    o = OptimConfig(lr=3e-3, warmup_steps=warmup)
    assert o.lr_schedule == "cosine"
    assert [lr_at(k, o, steps) for k in range(steps)] == [_old_cosine(k, o, steps) for k in range(steps)]


def test_linear_and_constant_values():
    linear = _curve("linear")
    assert linear[:2] == WARM
    assert linear[2:] == pytest.approx([1.0 - 0.9 * j / 18 for j in range(1, 19)])  # 0.95, 0.90, ..., 0.1
    assert linear[-1] == pytest.approx(0.1, abs=1e-15)
    assert _curve("constant") == WARM + [1.0] * 18


@pytest.mark.parametrize("shape, decay", [
    ("1-sqrt", [1 - math.sqrt(p) for p in (0.25, 0.5, 0.75, 1.0)]),  # 0.5, 0.293, 0.134, 0
    ("linear", [0.75, 0.5, 0.25, 0.0]),
    ("cosine", [0.5 * (1 + math.cos(math.pi * p)) for p in (0.25, 0.5, 0.75, 1.0)]),
])
def test_wsd_warms_up_holds_then_decays_over_the_last_fifth(shape, decay):
    lrs = _curve("wsd", shape)
    assert lrs[:16] == WARM + [1.0] * 14
    assert lrs[16:] == pytest.approx([0.1 + 0.9 * f for f in decay])
    assert lrs[16] == pytest.approx({"1-sqrt": 0.55, "linear": 0.775, "cosine": 0.868198}[shape])


def test_wsd_defaults_are_a_fifth_and_1_sqrt():
    s = schedule_of(OptimConfig(lr_schedule="wsd"), 1000)
    assert (s.decay_fraction, s.decay_shape, s.decay_steps, s.warmup_steps) == (0.2, "1-sqrt", 200, 50)
    assert _curve("wsd") == _curve("wsd", "1-sqrt", lr_decay_fraction=0.2)


def test_decay_factor_shapes():
    for shape in LR_DECAY_SHAPES:
        assert decay_factor(shape, 0.0) == 1.0 and decay_factor(shape, 1.0) == pytest.approx(0.0, abs=1e-15)
    assert decay_factor("1-sqrt", 0.25) == 0.5 and decay_factor("linear", 0.25) == 0.75
    assert decay_factor("cosine", 0.5) == pytest.approx(0.5)
    # 1-sqrt falls fastest first: below linear everywhere inside the decay
    assert all(decay_factor("1-sqrt", p / 10) < decay_factor("linear", p / 10) for p in range(1, 10))


CASES = [(kind, shape, steps, fraction) for steps in (1, 2, 5, 20, 101) for kind in LR_SCHEDULES
         for shape in (LR_DECAY_SHAPES if kind == "wsd" else (None,))
         for fraction in ((0.1, 0.5) if kind == "wsd" else (None,))]


@pytest.mark.parametrize("kind, shape, steps, fraction", CASES)
def test_warm_up_rises_then_never_rises_and_decays_end_at_the_floor(kind, shape, steps, fraction):
    o = OptimConfig(lr=2.0, min_lr_ratio=0.25, lr_schedule=kind, lr_decay_shape=shape, lr_decay_fraction=fraction,
                    warmup_steps=None if steps > 2 else 0)
    s = schedule_of(o, steps)
    lrs = [s.lr(k) for k in range(steps)]
    w = s.warmup_steps
    assert lrs[:w] == [2.0 * (k + 1) / w for k in range(w)]
    assert all(a >= b for a, b in zip(lrs[w:], lrs[w + 1:]))
    assert all(0.5 <= lr <= 2.0 for lr in lrs[w:])
    if kind in ("linear", "wsd"):
        assert lrs[-1] == pytest.approx(0.5, abs=1e-12)  # the floor, at the last step
    elif kind == "constant":
        assert lrs[w:] == [2.0] * (steps - w)
    if kind == "wsd":
        assert s.decay_steps == max(1, round(fraction * steps))
        assert lrs[w:steps - s.decay_steps] == [2.0] * (steps - s.decay_steps - w)  # stable
        assert lrs[steps - s.decay_steps] < 2.0


def _refused(argv: list[str], expected: str, capsys) -> None:
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gridtrain: error: "), err
    assert expected in err, err


REFUSED = {
    "unknown schedule": (["--lr-schedule", "step"], "--lr-schedule 'step' is not one of cosine, linear, wsd"),
    "unknown shape": (["--lr-schedule", "wsd", "--lr-decay-shape", "sqrt"],
                      "--lr-decay-shape 'sqrt' is not one of linear, cosine, 1-sqrt"),
    "zero fraction": (["--lr-schedule", "wsd", "--lr-decay-fraction", "0"],
                      "--lr-decay-fraction must be in (0, 1], got 0"),
    "fraction above one": (["--lr-schedule", "wsd", "--lr-decay-fraction", "1.5"],
                           "--lr-decay-fraction must be in (0, 1], got 1.5"),
    "min ratio above one": (["--min-lr-ratio", "2"], "--min-lr-ratio must be in [0, 1], got 2"),
    "shape without wsd": (["--lr-decay-shape", "cosine"],
                          "--lr-decay-shape shapes the decay of --lr-schedule wsd, not --lr-schedule cosine; "
                          "pass --lr-schedule wsd or drop it"),
    "fraction and shape without wsd": (["--lr-schedule", "linear", "--lr-decay-fraction", "0.3",
                                        "--lr-decay-shape", "linear"],
                                       "--lr-decay-fraction and --lr-decay-shape shape the decay of --lr-schedule "
                                       "wsd, not --lr-schedule linear"),
    "warm-up and decay overlap": (["--lr-schedule", "wsd", "--steps", "10", "--warmup-steps", "9"],
                                  "--lr-schedule wsd: warm-up (9 steps) and decay (2 steps, --lr-decay-fraction 0.2 "
                                  "of --steps 10) do not fit in 10 steps; lower --lr-decay-fraction to at most 0.1 "
                                  "or --warmup-steps to at most 8"),
    "decay of the whole run after a warm-up": (["--lr-schedule", "wsd", "--steps", "100", "--lr-decay-fraction", "1"],
                                               "lower --lr-decay-fraction to at most 0.95 or --warmup-steps to "
                                               "at most 0"),
    "warm-up of the whole run": (["--lr-schedule", "wsd", "--steps", "10", "--warmup-steps", "10"],
                                 "do not fit in 10 steps; lower --warmup-steps"),
    "in a config file": (["--config", "{tmp}/wsd.yaml"], "wsd.yaml: optim.lr_decay_fraction must be in (0, 1], got 0.0"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_schedules_are_refused_before_any_process(case, tmp_path, capsys, no_process_may_start):
    (tmp_path / "wsd.yaml").write_text("optim: {lr_schedule: wsd, lr_decay_fraction: 0}\n")
    argv, expected = REFUSED[case]
    _refused([a.replace("{tmp}", str(tmp_path)) for a in argv], expected, capsys)


@pytest.mark.parametrize("argv", [["--lr-schedule", "wsd", "--steps", "100", "--lr-decay-fraction", "1",
                                   "--warmup-steps", "0"],
                                  ["--lr-schedule", "wsd", "--steps", "10", "--warmup-steps", "8"],
                                  ["--lr-schedule", "constant", "--min-lr-ratio", "0"]])
def test_schedules_that_fit_pass(argv):
    args = cli.build_parser().parse_args(["train", *argv])
    validate(cli.config_from_args(args), data=False)


def test_resume_notes_a_changed_schedule_and_reads_old_checkpoints():
    run = schedule_of(OptimConfig(lr=1.0, lr_schedule="wsd", warmup_steps=2), 20)
    assert resume_note(run, run, 5) is None
    longer = schedule_of(OptimConfig(lr=1.0, lr_schedule="wsd", warmup_steps=2), 40)
    note = resume_note(run, longer, 17)
    assert "\n" not in note and "total_steps 20 -> 40, decay_steps 4 -> 8" in note
    assert "from step 18" in note and "step 18's lr is 1 (the saved run's: 0.3636)" in note
    assert schedule_in_meta({"lr_schedule": run.meta()}) == run
    # a checkpoint of before schedules were recorded: cosine, from the config it holds
    old = tiny_config(steps=30, warmup_steps=None).to_dict()
    assert schedule_in_meta({"config": old}) == Schedule("cosine", 3e-3, 30, 1, 0.1, 29)
    assert schedule_in_meta({"config": {"nonsense": 1}}) is None


def _lrs(path) -> dict[int, float]:
    return {row["step"]: row["lr"] for row in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_a_resumed_run_follows_the_same_curve_and_an_extended_wsd_decays_later(tmp_path, capsys):
    """Straight: 10 steps of wsd (decay over the last 4), saved at step 5. Resumed at 5
    with the same flags: every step's lr (and loss) is the straight run's. Resumed at 5
    with --steps 14 (WSD extended in its stable phase): the run says so in one line, and
    its lrs are the 14-step schedule's."""
    wsd = dict(lr_schedule="wsd", lr_decay_fraction=0.4, lr_decay_shape="1-sqrt",
               global_batch_size=2, micro_batch_size=2, seq_len=32)  # small steps: the lr is the point
    straight = train_in_process(tiny_config(**wsd, save=str(tmp_path / "ckpt"), save_interval=5,
                                            metrics_file=str(tmp_path / "straight.jsonl")))
    meta = json.loads((checkpoint.step_dir(tmp_path / "ckpt", 5) / checkpoint.META).read_text())
    assert meta["lr_schedule"] == {"kind": "wsd", "peak_lr": 3e-3, "total_steps": 10, "warmup_steps": 2,
                                   "min_lr_ratio": 0.1, "decay_steps": 4, "decay_fraction": 0.4,
                                   "decay_shape": "1-sqrt"}
    capsys.readouterr()

    load = str(checkpoint.step_dir(tmp_path / "ckpt", 5))
    # the schedule is the run's choice: no schedule field makes a checkpoint unloadable
    other = tiny_config(lr_schedule="constant", lr=1e-2, steps=50, min_lr_ratio=0.0, seq_len=32)
    checkpoint.check_loadable(load, other)
    resumed = train_in_process(tiny_config(**wsd, load=load, metrics_file=str(tmp_path / "resumed.jsonl")))
    assert "schedule changed" not in capsys.readouterr().out
    lrs = _lrs(tmp_path / "straight.jsonl")
    assert _lrs(tmp_path / "resumed.jsonl") == {k: v for k, v in lrs.items() if k > 5}
    assert lrs[6] == 3e-3 and lrs[10] == pytest.approx(3e-4)
    assert resumed["losses"] == straight["losses"][5:]

    longer = tiny_config(**wsd, steps=14, load=load, metrics_file=str(tmp_path / "longer.jsonl"))
    train_in_process(longer)
    notes = [line for line in capsys.readouterr().out.splitlines() if "schedule changed" in line]
    assert len(notes) == 1 and "total_steps 10 -> 14, decay_steps 4 -> 6" in notes[0], notes
    assert _lrs(tmp_path / "longer.jsonl") == {k + 1: lr_at(k, longer.optim, 14) for k in range(5, 14)}
    assert [lr for k, lr in sorted(_lrs(tmp_path / "longer.jsonl").items()) if k <= 8] == [3e-3] * 3
