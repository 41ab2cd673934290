"""Faults with real processes: divergence, preemption, a killed worker under torchrun, a
killed launcher; and the exit status each one ends with (stops.py).

The resumed runs are compared with one uninterrupted run of the same command, step by
step, in fp64: a restart must change nothing but the wall clock.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from gridtrain import checkpoint
from gridtrain.cli import parser as cli
from gridtrain.training.metrics import open_metrics_file
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.runtime.stops import EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_PREEMPTED, Diverged, Health
from tests import processes

# Slow enough to be signalled mid-run (a step takes tens of milliseconds), small enough to be quick.
RUN = ["train", "--model", "tiny", "--dtype", "fp64", "--steps", "120", "--global-batch-size", "8",
       "--micro-batch-size", "2", "--no-progress", "--eval-interval", "0", "--eval-iters", "1", "--lr", "3e-3"]
REL = 1e-12  # fp64, same layout: a resume repeats the same arithmetic


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """Per-step losses of the run that nothing interrupts (dp 2, like the faulted runs)."""
    metrics = tmp_path_factory.mktemp("reference") / "m.jsonl"
    proc = processes.start([*processes.GRIDTRAIN, *RUN, "--nproc", "2", "--metrics-file", str(metrics)])
    code, _, err = processes.finish(proc)
    assert code == 0, err[-3000:]
    return processes.losses_by_step(metrics)


def _assert_same_losses(metrics, reference: dict[int, float]) -> None:
    losses = processes.losses_by_step(metrics)
    assert sorted(losses) == sorted(reference), "every step once, none missing"
    for step, loss in reference.items():
        assert abs(losses[step] - loss) <= REL * abs(loss), f"step {step}: {losses[step]!r} vs {loss!r}"


# ---- divergence -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, message", [("fp32", "step 2: loss nan and gradient norm nan"),
                                            ("fp16", "step 1: some weights are not finite")])
def test_huge_lr_stops_and_keeps_the_last_finite_checkpoint(dtype, message, tmp_path, capsys):
    save = tmp_path / "ckpt"
    code = cli.main(["train", "--model", "tiny", "--lr", "1e6", "--dtype", dtype, "--steps", "30",
                     "--save", str(save), "--save-interval", "1", "--no-progress", "--eval-interval", "0"])
    err = capsys.readouterr().err
    assert code == EXIT_DIVERGED, err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    if dtype == "fp32":  # step 1 was finite and saved; step 2 was not applied
        assert (save / "latest").read_text().strip() == "step_0000001"
        model = Decoder(checkpoint.saved_model(save))
        init_parameters(model, 0)
        fresh = [p.detach().clone() for p in model.parameters()]
        assert checkpoint.load_checkpoint(save, model) == 1
        assert all(bool(p.isfinite().all()) for p in model.parameters())
        assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), fresh))  # the trained weights
    else:  # fp16: the first update already overflows the fp16 weights: nothing is saved
        assert not (save / "latest").exists()


def test_fp16_stops_when_the_loss_scale_cannot_help():
    """Overflows with a finite loss skip steps while the scale halves; one at the minimum
    scale stops the run, as do too many skips in a row."""
    health = Health("fp16", min_loss_scale=1.0, max_skipped=5)
    for step, scale in enumerate([8.0, 4.0, 2.0], 1):  # skipped steps while the scale halves: fine
        health.check(step, 3.0, float("inf"), scale)
    health.check(4, 3.0, 1.5, 1.0)  # a good step at the floor is fine
    with pytest.raises(Diverged, match="step 5: fp16 gradients overflow at the minimum loss scale 1 "):
        health.check(5, 3.0, float("inf"), 1.0)  # an overflow at the floor: nothing left to halve
    many = Health("fp16", max_skipped=3)
    with pytest.raises(Diverged, match="4 fp16 steps in a row skipped"):
        for step in range(1, 5):
            many.check(step, 1.0, float("inf"), 2.0 ** 20)


def test_fp16_non_finite_loss_stops_as_other_dtypes_do():
    with pytest.raises(Diverged, match="step 2: loss nan; the run diverged"):
        Health("fp16").check(2, float("nan"), float("inf"), 2.0 ** 15)


def test_diverged_fp16_run_exits_3_with_one_line(capsys):
    """The run of the issue: fp16 at a learning rate of 1e6 once trained on with a NaN
    loss and exited 0; now the first non-finite loss stops it, in one line."""
    code = cli.main(["train", "--model", "tiny", "--lr", "1e6", "--dtype", "fp16", "--steps", "8",
                     "--no-progress", "--eval-interval", "0"])
    err = capsys.readouterr().err
    assert code == EXIT_DIVERGED, err
    assert err.count("\n") == 1 and "loss nan" in err and "Traceback" not in err


def _prompt_only(path, long: int, short: int = 1):
    """A fine-tuning file of ``long`` examples whose prompts fill a 32-token window (their
    completions cut away) and ``short`` ones that keep their completions."""
    import json
    lines = [{"prompt": f"question {i}: " + "why " * 20, "completion": " because."} for i in range(long)]
    lines += [{"prompt": "q?", "completion": " yes."} for _ in range(short)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


@pytest.mark.parametrize("layout", [(), pytest.param(("--nproc", "2"), marks=pytest.mark.spawn),
                                    pytest.param(("--nproc", "2", "--pp", "2"), marks=pytest.mark.spawn)],
                         ids=["one process", "dp 2", "pp 2"])
def test_a_global_batch_without_loss_bearing_tokens_stops_the_run_in_one_line(tmp_path, capsys, layout):
    """The file has loss-bearing tokens (so it starts), but most samples are prompts only:
    the first global batch with none is a step that cannot be taken (its loss would be
    0 / 0), exit 3 in one line, not a traceback, from one process or two (under pp only
    the last stage counts the tokens; the first stage's workers end with it)."""
    batch = "2" if layout == ("--nproc", "2") else "1"
    code = cli.main(["train", "--model", "tiny", "--seq-len", "32", "--data", _prompt_only(tmp_path / "sft.jsonl", 40),
                     "--global-batch-size", batch, "--micro-batch-size", "1", "--steps", "20", "--no-progress",
                     "--eval-interval", "0", "--sample-tokens", "0", *layout])
    err = capsys.readouterr().err
    assert code == EXIT_DIVERGED, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "the global batch has no token that counts in the loss" in err and "--seq-len" in err


def test_validation_batches_without_loss_bearing_tokens_say_n_a(tmp_path, capsys):
    """--valid-data whose first validation batch is prompts only (the file itself has a
    completion further on, so it is not refused): the value is n/a, not 0.0000."""
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    code = cli.main(["train", "--model", "tiny", "--seq-len", "32", "--data", str(tmp_path / "text.txt"),
                     "--valid-data", _prompt_only(tmp_path / "valid.jsonl", 4), "--global-batch-size", "1",
                     "--micro-batch-size", "1", "--steps", "2", "--no-progress", "--eval-interval", "1",
                     "--eval-iters", "1", "--sample-tokens", "0"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "validation loss n/a (no token of the validation batches carries a loss)" in out, out
    assert "valid loss n/a" in out and "0.0000" not in out, out


def test_fp16_at_the_minimum_loss_scale_exits_3_with_one_line(capsys):
    """A loss scale already at --min-loss-scale that still overflows stops the run
    (a huge initial scale with its minimum as high: the first step overflows there)."""
    code = cli.main(["train", "--model", "tiny", "--dtype", "fp16", "--loss-scale", "1e30", "--min-loss-scale",
                     "1e30", "--steps", "3", "--no-progress", "--eval-interval", "0"])
    err = capsys.readouterr().err
    assert code == EXIT_DIVERGED, err
    assert err.count("\n") == 1 and "fp16 gradients overflow at the minimum loss scale 1e+30" in err


def test_finite_steps_pass_and_fp32_names_the_bad_number():
    health = Health("bf16")
    health.check(1, 2.5, 0.5)
    with pytest.raises(Diverged, match="step 7: gradient norm inf"):
        health.check(7, 2.5, float("inf"))


# ---- the metrics file after a resume --------------------------------------------------------

def test_metrics_file_keeps_each_step_once_after_a_resume(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(f'{{"step": {s}, "loss": {s}}}\n' for s in range(1, 8)) + '{"step": 8, "lo')
    with open_metrics_file(str(path), start_step=5) as f:  # the checkpoint was after step 5
        f.write('{"step": 6, "loss": 60}\n')
    assert [r["step"] for r in processes.metrics_rows(path)] == [1, 2, 3, 4, 5, 6]
    with open_metrics_file(str(path), start_step=0):  # a fresh run starts a fresh file
        pass
    assert path.read_text() == ""


# ---- preemption ---------------------------------------------------------------------------------

@pytest.mark.spawn
@pytest.mark.parametrize("target", ["launcher", "one worker"])
def test_sigterm_saves_and_the_same_command_resumes_to_the_same_losses(target, uninterrupted, tmp_path):
    """SIGTERM to the launcher or to one worker (schedulers do either): every worker saves
    after the same step and the job exits 75; the same command (with --auto-resume)
    finishes the run as if nothing happened."""
    metrics, save = tmp_path / "m.jsonl", tmp_path / "ckpt"
    argv = [*processes.GRIDTRAIN, *RUN, "--nproc", "2", "--metrics-file", str(metrics), "--save", str(save),
            "--auto-resume"]
    proc = processes.start(argv)
    try:
        processes.wait_for_rows(metrics, 5, proc)
        os.kill(proc.pid if target == "launcher" else processes.workers(proc.pid)[-1], signal.SIGTERM)
        code, _, err = processes.finish(proc)
    finally:
        processes.kill_tree([proc.pid])
    assert code == EXIT_PREEMPTED, err[-3000:]
    assert "stopped by SIGTERM after step" in err and "Traceback" not in err
    saved = int((save / "latest").read_text().strip().split("_")[1])
    assert 5 <= saved < 120
    code, out, err = processes.finish(processes.start(argv))
    assert code == 0, err[-3000:]
    assert f"resuming from {save}" in out + err
    _assert_same_losses(metrics, uninterrupted)


@pytest.mark.spawn
def test_killed_worker_under_torchrun_restarts_and_resumes(uninterrupted, tmp_path):
    """kill -9 of one worker: torchrun (--max-restarts 1) restarts both, they resume from
    the latest checkpoint by themselves, and the run ends as the uninterrupted one."""
    metrics, save = tmp_path / "m.jsonl", tmp_path / "ckpt"
    proc = processes.start([*processes.TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                            "--monitor-interval", "0.2", "-m", "gridtrain", *RUN, "--metrics-file", str(metrics),
                            "--save", str(save), "--save-interval", "10", "--auto-resume"])
    try:
        processes.wait_for_rows(metrics, 25, proc)
        victim = processes.workers(proc.pid)[-1]
        os.kill(victim, signal.SIGKILL)
        code, out, err = processes.finish(proc, timeout_s=300)
    finally:
        processes.kill_tree([proc.pid, *processes.children(proc.pid)])
    assert code == 0, err[-3000:]
    assert f"resuming from {save}" in out + err
    _assert_same_losses(metrics, uninterrupted)


# ---- the launcher itself -----------------------------------------------------------------------

@pytest.mark.spawn
def test_ctrl_c_is_one_line_and_leaves_no_worker(tmp_path):
    """Ctrl-C in a terminal signals the launcher and every worker (one process group)."""
    metrics = tmp_path / "m.jsonl"
    proc = processes.start([*processes.GRIDTRAIN, *RUN, "--nproc", "2", "--metrics-file", str(metrics)])
    try:
        processes.wait_for_rows(metrics, 2, proc)
        spawned = processes.workers(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        code, _, err = processes.finish(proc, timeout_s=60)
    finally:
        processes.kill_tree([proc.pid])
    assert code == EXIT_INTERRUPTED, err[-3000:]
    assert "interrupted" in err and "Traceback" not in err, err[-3000:]
    assert not any(processes.alive(p) for p in spawned)


@pytest.mark.spawn
def test_killing_the_launcher_while_workers_import_leaves_no_worker(tmp_path):
    """Workers tie their life to their parent's before they open their work (worker.py),
    and their parent, the warm server, ties its own to the launcher's (warm.py), so a
    kill -9 in the first second of a run leaves neither a worker nor the server."""
    proc = processes.start([*processes.GRIDTRAIN, *RUN, "--nproc", "2"])
    deadline = time.monotonic() + 30
    while len(processes.workers(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    spawned = processes.workers(proc.pid)
    assert len(spawned) == 2
    spawned += processes.servers(proc.pid)
    assert len(spawned) == 3, "the workers were not forked by a warm server"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 0.5  # at once: importing torch alone takes longer than this
    while any(processes.alive(p) for p in spawned) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in spawned if processes.alive(p)]
    processes.kill_tree(left)
    assert not left, f"workers {left} outlived the launcher"
