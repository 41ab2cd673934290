"""What a run writes out besides checkpoints: TensorBoard scalars from MetricsLogger, and
the ``gridtrain plot`` picture of metrics files, with its one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gridtrain.cli import parser as cli
from gridtrain.training.metrics import MISSING_TENSORBOARD, MetricsLogger, StepRecord, require_tensorboard
from gridtrain.cli.plot import PlotError, plot_runs, read_metrics, run_labels, series

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _record(step: int) -> StepRecord:
    return StepRecord(step=step, loss=4.0 - 0.25 * step, grad_norm=1.0 + step, lr=1e-3 * step,
                      tokens=4096 * step, step_time_s=0.5 / step, tokens_per_s=8192.0 * step)


# ---- TensorBoard ----------------------------------------------------------------------------

def _read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_match_the_records(tmp_path):
    logdir, metrics = tmp_path / "tb", tmp_path / "metrics.jsonl"
    extras = {1: {"comm_bytes": {"dp": 1000, "pp": 24}, "loss_scale": 65536.0},
              2: {"comm_bytes": {"dp": 2000}},
              3: {"comm_bytes": {"dp": 3000, "pp": 72}, "valid_loss": 3.5}}
    log = MetricsLogger(True, str(metrics), total_steps=3, start_step=0, show_progress=False,
                        tensorboard=str(logdir))
    for step in (1, 2, 3):
        log.step(_record(step), extras[step])
    log.close()

    scalars = _read_scalars(logdir)
    assert set(scalars) == {"train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s",
                            "train/step_time_s", "train/tokens", "valid/loss", "train/loss_scale",
                            "comm_bytes/dp", "comm_bytes/pp"}
    for name in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "tokens"):
        expected = [(s, getattr(_record(s), name)) for s in (1, 2, 3)]
        got = scalars[f"train/{name}"]
        assert [s for s, _ in got] == [1, 2, 3], name
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6), name
    assert scalars["valid/loss"] == [(3, 3.5)]
    assert scalars["train/loss_scale"] == [(1, 65536.0)]
    assert scalars["comm_bytes/dp"] == [(1, 1000.0), (2, 2000.0), (3, 3000.0)]
    assert scalars["comm_bytes/pp"] == [(1, 24.0), (3, 72.0)]
    # the JSON lines file is unchanged by the TensorBoard option
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rows[2] == {**_record(3).__dict__, **extras[3]}


def test_inactive_logger_writes_no_tensorboard_files(tmp_path):
    log = MetricsLogger(False, None, total_steps=1, start_step=0, show_progress=False,
                        tensorboard=str(tmp_path / "tb"))
    log.step(_record(1), {"valid_loss": 1.0})
    log.close()
    assert not (tmp_path / "tb").exists()


def test_require_tensorboard_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # makes `import tensorboard` fail
    with pytest.raises(ImportError) as info:
        require_tensorboard()
    message = str(info.value)
    assert message == MISSING_TENSORBOARD
    assert "\n" not in message and "pip install tensorboard" in message and "--tensorboard" in message
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    with pytest.raises(ImportError, match="needs the tensorboard package"):
        MetricsLogger(True, str(metrics), total_steps=1, start_step=0, show_progress=False,
                      tensorboard=str(tmp_path / "tb"))
    assert metrics.read_text() == '{"step": 1}\n'  # the failed logger truncated nothing


# ---- gridtrain plot -------------------------------------------------------------------------

def _write_run(path: Path, steps: int, valid_every: int | None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        row = dict(_record(step).__dict__)
        if valid_every and step % valid_every == 0:
            row["valid_loss"] = row["loss"] + 0.1
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def runs(tmp_path) -> tuple[str, str]:
    return (str(_write_run(tmp_path / "dp2.jsonl", 10, valid_every=None)),
            str(_write_run(tmp_path / "pp2.jsonl", 12, valid_every=4)))


@pytest.fixture
def saved_figures(monkeypatch) -> list:
    """Records every figure plot_runs saves, then saves it as usual."""
    from matplotlib.figure import Figure

    figures, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figures.append(self), save(self, *a, **k))[1])
    return figures


@pytest.mark.spawn
def test_plot_runs_writes_a_png_with_one_line_per_run(runs, tmp_path, saved_figures):
    out = tmp_path / "runs.png"
    plot_runs(list(runs), str(out))
    assert out.read_bytes()[:8] == PNG_SIGNATURE and out.stat().st_size > 1000
    train, valid, speed = saved_figures[0].axes
    assert [line.get_label() for line in train.lines] == ["dp2", "pp2"]
    assert [line.get_label() for line in valid.lines] == ["pp2"]  # dp2 has no validation rows
    assert list(valid.lines[0].get_xdata()) == [4, 8, 12]
    assert [line.get_label() for line in speed.lines] == ["dp2", "pp2"]
    assert len(train.lines[0].get_xdata()) == 10 and len(train.lines[1].get_xdata()) == 12
    # a run keeps its colour in every panel, also where an earlier run has no line
    assert train.lines[1].get_color() == valid.lines[0].get_color() == speed.lines[1].get_color()
    assert train.lines[0].get_color() != train.lines[1].get_color()


@pytest.mark.spawn
def test_plot_says_when_no_run_has_validation(tmp_path, saved_figures):
    run = _write_run(tmp_path / "a.jsonl", 5, valid_every=None)
    plot_runs([str(run)], str(tmp_path / "a.png"))
    valid = saved_figures[0].axes[1]
    assert not valid.lines
    assert any("valid_loss" in text.get_text() for text in valid.texts)


@pytest.mark.spawn
def test_cli_plot(runs, tmp_path, capsys):
    out = tmp_path / "cli.png"
    assert cli.main(["plot", *runs, "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_labels_use_the_folder_when_stems_collide(tmp_path):
    assert run_labels(["a/metrics.jsonl", "b/other.jsonl"]) == ["metrics", "other"]
    assert run_labels([tmp_path / "run1" / "metrics.jsonl", tmp_path / "run2" / "metrics.jsonl"]) == ["run1", "run2"]


def test_series_sorts_and_keeps_the_resumed_row():
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "loss": 1.5, "valid_loss": 1.7}]
    assert series(rows, "loss") == ([1, 2], [3.0, 1.5])
    assert series(rows, "valid_loss") == ([2], [1.7])


# case -> (a metrics file's name and content (None: not written), or None for a bad --out;
#          expected part of the message)
BAD_PLOT_INPUTS = {
    "missing file": (("nope.jsonl", None), "nope.jsonl: no such file"),
    "empty file": (("empty.jsonl", "\n\n"), "empty.jsonl: empty"),
    "not JSON": (("bad.jsonl", '{"step": 1, "loss": 2.0}\n{"step": 2, loss\n'), "bad.jsonl:2: not JSON"),
    "no step": (("nostep.jsonl", '{"loss": 2.0}\n'), "nostep.jsonl:1: row has no numeric 'step'"),
    "no loss": (("noloss.jsonl", '{"step": 1, "loss": 2.0}\n{"step": 2}\n'),
                "noloss.jsonl:2: row has no numeric 'loss'"),
    "not an object": (("list.jsonl", "[1, 2]\n"), "list.jsonl:1: not a JSON object"),
    "out folder missing": (None, "does not exist"),
    "out is a directory": (None, "is a directory"),
}


def _bad_input(tmp_path: Path, case: str, good: str) -> tuple[list[str], str]:
    """(plot arguments, expected part of the message) for one kind of bad input."""
    source, expected = BAD_PLOT_INPUTS[case]
    out = {"out folder missing": str(tmp_path / "nowhere" / "x.png"),
           "out is a directory": str(tmp_path)}.get(case, str(tmp_path / "out.png"))
    if source is None:
        return [good, "--out", out], expected
    name, content = source
    if content is not None:
        (tmp_path / name).write_text(content)
    return [good, str(tmp_path / name), "--out", out], expected


@pytest.mark.parametrize("case", sorted(BAD_PLOT_INPUTS))
def test_cli_plot_bad_input_is_one_line(case, runs, tmp_path, capsys):
    args, expected = _bad_input(tmp_path, case, runs[0])
    assert cli.main(["plot", *args]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("gridtrain: error: ") and "\n" not in err, err
    assert expected in err, err
    assert "Traceback" not in err and not captured.out
    assert not (tmp_path / "out.png").exists()


def test_cli_plot_without_matplotlib_is_one_line(runs, tmp_path, capsys, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    assert cli.main(["plot", runs[0], "--out", str(tmp_path / "x.png")]) == 2
    expected = "gridtrain: error: gridtrain plot needs matplotlib; pip install matplotlib"
    assert capsys.readouterr().err.strip() == expected


def test_read_metrics_returns_rows_and_raises_plot_error(runs, tmp_path):
    rows = read_metrics(runs[1])
    assert len(rows) == 12 and rows[3]["valid_loss"] == pytest.approx(rows[3]["loss"] + 0.1)
    with pytest.raises(PlotError, match="no such file"):
        read_metrics(tmp_path / "absent.jsonl")


# ---- through `gridtrain train` -------------------------------------------------------------------

def test_train_writes_the_metrics_file_steps_to_tensorboard(tmp_path, capsys):
    board, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    assert cli.main(["train", "--model", "tiny", "--steps", "3", "--eval-interval", "2", "--no-progress",
                     "--tensorboard", str(board), "--metrics-file", str(metrics)]) == 0
    rows = read_metrics(metrics)
    scalars = _read_scalars(board)
    assert scalars["train/loss"] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    assert scalars["valid/loss"] == [(2, pytest.approx(rows[1]["valid_loss"], rel=1e-6))]


def test_train_without_tensorboard_installed_stops_before_any_process(tmp_path, capsys, monkeypatch):
    import torch.distributed as dist

    from gridtrain.runtime import launch

    def forbidden(*args, **kwargs):
        raise AssertionError("a process group or worker was started for a bad configuration")

    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(launch, "run_workers", forbidden)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert cli.main(["train", "--nproc", "2", "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert err == f"gridtrain: error: {MISSING_TENSORBOARD}\n"
    assert not (tmp_path / "tb").exists()
