"""The training loop, in Megatron-LM's shape: ``pretrain(model_provider, datasets_provider,
forward_step, config)``.

Read it top to bottom: check the configuration, build everything once (trainer.py), then
for each step set the learning rate, take this rank's micro-batches of the global batch
and run the schedule (forward, backward, gradient reduction, clipping, optimizer), stop
on a non-finite number, validate and save when due, and save and stop when the job is
being preempted (stops.py). What the run reports, and how, is reporting.py's business:
the loop only hands it each step, and the start-up's stamps (runtime/startup.py): the
providers are timed where build() calls them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from gridtrain.parallel.comm import CommGroup
from gridtrain.config import Config
from gridtrain.data import Datasets
from gridtrain.training.report import RunReport, TrainResult
from gridtrain.runtime.startup import StartupClock
from gridtrain.runtime.stops import Health, Preempted, Preemption
from gridtrain.parallel.distributed import launched_by_env, shutdown
from gridtrain.training.trainer import ForwardStep, ModelProvider, Trainer, build
from gridtrain.training.validate import validate

__all__ = ["Datasets", "TrainResult", "pretrain"]


def pretrain(model_provider: ModelProvider, datasets_provider: Callable[[Config], Datasets],
             forward_step: ForwardStep, cfg: Config) -> TrainResult:
    """Train ``cfg.training.steps`` steps on the grid this process belongs to.

    Called in one process with no process group and no launcher (the Python API), the
    loop makes a one-rank group and ends it before returning: a gloo group left to the
    interpreter's exit can abort the process ("terminate called without an active
    exception") after a run that succeeded. A group made by the caller, or from a
    launcher's environment (torchrun), outlives the loop: the caller may still gather or
    sample with it, and ends it (``distributed.shutdown``).
    """
    clock = StartupClock.begin()
    validate(cfg, data=False)  # the CLI checked the built-in provider's data; others bring their own
    owns_group = not dist.is_initialized() and not launched_by_env()
    try:
        # build() sets up the groups, then calls the model provider, then the datasets provider
        model_provider = clock.timed(model_provider, before="distributed")
        datasets_provider = clock.timed(datasets_provider, before="model", after="data")
        trainer = build(cfg, model_provider, forward_step, datasets_provider)
        clock.stamp("optimizer")
        return _train(cfg, trainer, clock)
    finally:
        if owns_group:
            shutdown()


def _train(cfg: Config, trainer: Trainer, clock: StartupClock) -> TrainResult:
    report = RunReport(trainer, clock)
    t, c, validates = cfg.training, cfg.checkpoint, trainer.data.valid is not None
    health = Health(t.dtype, t.min_loss_scale)
    world = CommGroup.of("world", dist.group.WORLD, trainer.ctx.bytes, device=trainer.ctx.device)
    preemption = Preemption(world) if c.save else None
    try:
        for step in range(trainer.start_step, t.steps):
            done = step + 1  # steps count from 1, as in the metrics file and the hang report
            trainer.ctx.recorder.set_step(done)
            lr = trainer.set_lr(step)
            with report.step_window(first=step == trainer.start_step):
                out = trainer.train_step(trainer.read_batches(step))
            health.check(done, out.loss, out.grad_norm, out.loss_scale)
            validating = validates and _due(done, cfg.eval.eval_interval)
            report.step(done, lr, out, trainer.evaluate() if validating else None, validating)
            preempted = preemption is not None and preemption.agreed(trainer.ctx.device)
            if c.save and (_due(done, c.save_interval) or (preempted and done < t.steps)):
                trainer.save(done)
            if preempted and done < t.steps:
                raise Preempted(f"stopped by SIGTERM after step {done} of {t.steps}; checkpoint saved in "
                                f"{c.save}; rerun the same command with --auto-resume to continue", done)
    finally:
        trainer.parameters_ready()  # ZeRO-1's last gathers: the weights are read from here on
        report.end_of_steps()
        if preemption is not None:
            preemption.close()
        trainer.finish_saves()  # a background write ends (or reports its failure) before anything exits
    validating = validates and not _due(t.steps, cfg.eval.eval_interval)
    final_valid = trainer.evaluate() if validating else None
    if c.save and not _due(t.steps, c.save_interval):
        trainer.save(t.steps)
    trainer.finish_saves()
    return report.finish(final_valid, validating)


def _due(step: int, interval: int) -> bool:
    """Every ``interval`` steps (never when 0)."""
    return bool(interval) and step % interval == 0
