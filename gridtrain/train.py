"""The training loop, in Megatron-LM's shape: ``pretrain(model_provider, datasets_provider,
forward_step, config)``.

Read it top to bottom: build everything once (trainer.py), then for each step set the
learning rate, take this rank's micro-batches of the global batch and run the schedule
(forward, backward, gradient reduction, clipping, optimizer), validate and save when
due. What the run reports, and how, is reporting.py's business: the loop only hands it
each step.
"""

from __future__ import annotations

from collections.abc import Callable

from gridtrain.config import Config
from gridtrain.data import Datasets
from gridtrain.reporting import RunReport, TrainResult
from gridtrain.trainer import ForwardStep, ModelProvider, build

__all__ = ["Datasets", "TrainResult", "pretrain"]


def pretrain(model_provider: ModelProvider, datasets_provider: Callable[[Config], Datasets],
             forward_step: ForwardStep, cfg: Config) -> TrainResult:
    """Train ``cfg.training.steps`` steps on the grid this process belongs to."""
    trainer = build(cfg, model_provider, forward_step, datasets_provider)
    report = RunReport(trainer)
    t, validates = cfg.training, trainer.data.valid is not None
    for step in range(trainer.start_step, t.steps):
        lr = trainer.set_lr(step)
        with report.step_window(first=step == trainer.start_step):
            out = trainer.train_step(trainer.read_batches(step))
        done = step + 1
        valid_loss = trainer.evaluate() if validates and _due(done, t.eval_interval) else None
        report.step(done, lr, out, valid_loss)
        if t.save and _due(done, t.save_interval):
            trainer.save(done)
    report.end_of_steps()
    final_valid = trainer.evaluate() if validates and not _due(t.steps, t.eval_interval) else None
    if t.save and not _due(t.steps, t.save_interval):
        trainer.save(t.steps)
    return report.finish(final_valid)


def _due(step: int, interval: int) -> bool:
    """Every ``interval`` steps (never when 0)."""
    return bool(interval) and step % interval == 0
