"""Learning-rate schedules: the learning rate as a pure function of the step.

Every schedule warms up linearly over the first W steps (``--warmup-steps``, default 5%
of the run, at least 1), from lr / W at step 0 to the peak ``--lr`` at step W - 1; then,
in a run of N steps, with the floor lr x ``--min-lr-ratio``:

* ``cosine`` (default): half a cosine from lr down to the floor over the steps after the
  warm-up, progress (step - W) / (N - W); its last step is one short of the floor, as
  gridtrain's schedule has always been;
* ``linear``: a straight line from lr to the floor, reached at the last step;
* ``constant``: lr;
* ``wsd`` (warmup-stable-decay: MiniCPM, Hu et al. 2024; Hägele et al. 2024, "Scaling
  Laws and Compute-Optimal Training Beyond Fixed Training Durations"): lr until the last
  D = round(F x N) steps (F: ``--lr-decay-fraction``, default 0.2), then a decay of
  shape ``--lr-decay-shape`` to the floor, reached at the last step: ``1-sqrt`` (default,
  the shape Hägele et al. found best; lr falls as 1 - sqrt(progress)), ``linear`` or
  ``cosine``. Decay step j (1..D) has progress j / D (torchtitan's WSD divides by D + 1
  and so never reaches its floor).

Because the curve depends on N, a run resumed with other ``--steps`` (or another
schedule) follows another curve from where it resumes; checkpoints record the schedule
(:meth:`Schedule.meta`, meta.json's ``lr_schedule``) so that the resumed run can say so
(:func:`resume_note`). Extending a WSD run in its stable phase is the intended case: the
decay moves to the new end.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from gridtrain.config import LR_DECAY_SHAPES, LR_SCHEDULES, Config, OptimConfig

__all__ = ["LR_DECAY_SHAPES", "LR_SCHEDULES", "DEFAULT_DECAY_FRACTION", "DEFAULT_DECAY_SHAPE", "Schedule",
           "decay_factor", "schedule_of", "schedule_in_meta", "resume_note", "wsd_problem"]

DEFAULT_DECAY_FRACTION = 0.2  # of the run: the cooldown length Hägele et al. found to match cosine
DEFAULT_DECAY_SHAPE = "1-sqrt"


def decay_factor(shape: str, progress: float) -> float:
    """How much of the way from the floor to the peak the lr still is, at ``progress``
    through a decay (1 at 0, 0 at 1)."""
    p = min(1.0, max(0.0, progress))
    if shape == "linear":
        return 1.0 - p
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(p)
    raise ValueError(f"unknown decay shape {shape!r}; use one of {', '.join(LR_DECAY_SHAPES)}")


@dataclass(frozen=True)
class Schedule:
    """One run's schedule, resolved: every default filled in, as a checkpoint records it."""

    kind: str  # one of LR_SCHEDULES
    peak_lr: float
    total_steps: int
    warmup_steps: int  # used (the default resolved)
    min_lr_ratio: float
    decay_steps: int  # steps that decay, ending at the last: N - W (cosine, linear), D (wsd), 0 (constant)
    decay_fraction: float | None = None  # wsd only
    decay_shape: str | None = None  # wsd only

    @property
    def floor(self) -> float:
        return self.peak_lr * self.min_lr_ratio

    def lr(self, step: int) -> float:
        """The learning rate of ``step`` (0-based: the first step is 0, the last N - 1)."""
        lr, warmup = self.peak_lr, self.warmup_steps
        if step < warmup:
            return lr * (step + 1) / warmup
        floor = self.floor
        if self.kind == "cosine":  # kept term by term as before schedules were chosen: the same floats
            progress = (step - warmup) / max(1, self.total_steps - warmup)
            return floor + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (lr - floor)
        start = self.total_steps - self.decay_steps
        if self.kind == "constant" or step < start:
            return lr
        shape = "linear" if self.kind == "linear" else self.decay_shape
        return floor + decay_factor(shape, (step - start + 1) / self.decay_steps) * (lr - floor)

    def meta(self) -> dict:
        """What a checkpoint records (meta.json's ``lr_schedule``)."""
        return asdict(self)

    def describe(self) -> str:
        """One phrase: ``wsd 1-sqrt decay over the last 4 of 20 steps, warm-up 1, lr 0.003 to x0.1``."""
        if self.kind == "constant":
            shape = "constant"
        elif self.kind == "wsd":
            shape = f"wsd {self.decay_shape} decay over the last {self.decay_steps} of {self.total_steps} steps"
        else:
            shape = f"{self.kind} decay over the {self.decay_steps} steps after the warm-up"
        floor = "" if self.kind == "constant" else f" to x{self.min_lr_ratio:g}"
        return f"{shape}, warm-up {self.warmup_steps}, lr {self.peak_lr:g}{floor}"


def schedule_of(o: OptimConfig, steps: int) -> Schedule:
    """The schedule of a run of ``steps`` with the optimizer settings ``o``."""
    warmup = o.warmup(steps)
    fraction = shape = None
    if o.lr_schedule == "wsd":
        fraction = DEFAULT_DECAY_FRACTION if o.lr_decay_fraction is None else o.lr_decay_fraction
        shape = o.lr_decay_shape or DEFAULT_DECAY_SHAPE
        decay = max(1, round(fraction * steps))
    elif o.lr_schedule == "constant":
        decay = 0
    else:
        decay = max(0, steps - warmup)
    return Schedule(kind=o.lr_schedule, peak_lr=o.lr, total_steps=steps, warmup_steps=warmup,
                    min_lr_ratio=o.min_lr_ratio, decay_steps=decay, decay_fraction=fraction, decay_shape=shape)


def wsd_problem(o: OptimConfig, steps: int) -> str | None:
    """Why a wsd schedule cannot fit a run of ``steps`` (None: it fits): its warm-up and
    its decay must not overlap."""
    if o.lr_schedule != "wsd":
        return None
    s = schedule_of(o, steps)
    if s.warmup_steps + s.decay_steps <= steps:
        return None
    room = steps - s.warmup_steps
    fix = (f"lower --lr-decay-fraction to at most {_down(room / steps)} or --warmup-steps to at most "
           f"{steps - s.decay_steps}" if room > 0 else "lower --warmup-steps")
    return (f"--lr-schedule wsd: warm-up ({s.warmup_steps} steps) and decay ({s.decay_steps} steps, "
            f"--lr-decay-fraction {s.decay_fraction:g} of --steps {steps}) do not fit in {steps} steps; {fix}")


def _down(x: float, digits: int = 4) -> str:
    """``x`` > 0 cut (never rounded up) to ``digits`` significant digits: a fraction that fits."""
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(x)))
    return f"{math.floor(x * scale) / scale:g}"


def schedule_in_meta(meta: dict) -> Schedule | None:
    """The schedule a checkpoint's meta.json records; for one written before schedules
    were recorded (always cosine), the schedule its config implies; None if unreadable."""
    saved = meta.get("lr_schedule")
    try:
        if isinstance(saved, dict):
            known = {f.name for f in fields(Schedule)}
            return Schedule(**{k: v for k, v in saved.items() if k in known})
        cfg = Config.from_dict(meta["config"])
        return schedule_of(cfg.optim, cfg.training.steps)
    except Exception:  # a checkpoint of another version: no note rather than no run
        return None


def resume_note(saved: Schedule, run: Schedule, start_step: int) -> str | None:
    """One line when a run resumed after ``start_step`` steps follows another schedule
    than the checkpoint's run did (None: the same curve)."""
    if saved == run:
        return None
    ours, theirs = run.meta(), saved.meta()
    changed = ", ".join(f"{k} {theirs[k]!r} -> {ours[k]!r}" for k in ours if ours[k] != theirs.get(k))
    first = start_step + 1  # as the metrics count steps; the 0-based index is start_step
    return (f"learning-rate schedule changed on resume ({changed}): from step {first} the lr follows this run's "
            f"schedule ({run.describe()}); step {first}'s lr is {run.lr(start_step):.4g} "
            f"(the saved run's: {saved.lr(start_step):.4g})")
