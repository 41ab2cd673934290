"""The ``gridtrain plot`` command: training loss, validation loss and tokens/s against
step (and, for mixture-of-experts runs, the expert load: max/mean tokens per expert of
the busiest MoE layer), for one or several runs, in one picture.

Comparing runs (two layouts, two schedules, a resumed run) is the usual question after
training, and the metrics files written by ``gridtrain train --metrics-file`` already
hold the answer; this draws them side by side without a notebook. Bad input is reported
as one line naming the file (and line), never as a traceback.

matplotlib is optional (the ``plots`` extra): it is imported only here, with the Agg
canvas and the object-oriented API (no pyplot, no global backend switch).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MISSING_MATPLOTLIB = "gridtrain plot needs matplotlib; pip install matplotlib"
REQUIRED_KEYS = ("step", "loss")
# panel title -> metrics key plotted in it
PANELS = {"training loss": "loss", "validation loss": "valid_loss", "tokens/s": "tokens_per_s"}
# drawn where some run has the key: MoE runs' busiest layer's tokens per expert, max/mean
OPTIONAL_PANELS = {"MoE load (max/mean)": "max_load"}


class PlotError(ValueError):
    """A metrics file or an output path that cannot be plotted; one line, for the CLI."""


# ---- reading ------------------------------------------------------------------------------

def read_metrics(path: str | Path) -> list[dict]:
    """The rows of one JSON lines metrics file; blank lines are skipped."""
    path = Path(path)
    rows = [_parse_row(path, number, line) for number, line in enumerate(_read_lines(path), start=1)
            if line.strip()]
    if not rows:
        raise PlotError(f"{path}: empty, no metrics rows (write one with gridtrain train --metrics-file)")
    return rows


def _read_lines(path: Path) -> list[str]:
    if not path.exists():
        raise PlotError(f"{path}: no such file")
    if path.is_dir():
        raise PlotError(f"{path}: is a directory, not a metrics file")
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise PlotError(f"{path}: not a text file (not UTF-8)") from None
    except OSError as e:
        raise PlotError(f"{path}: cannot read ({e.strerror})") from None


def _parse_row(path: Path, number: int, line: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise PlotError(f"{path}:{number}: not JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise PlotError(f"{path}:{number}: not a JSON object")
    missing = [key for key in REQUIRED_KEYS if not _is_number(row.get(key))]
    if missing:
        raise PlotError(f"{path}:{number}: row has no numeric {' or '.join(repr(k) for k in missing)}")
    return row


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of ``key``, sorted by step; rows without it are left out, and when
    a resumed run repeated a step, its later row wins."""
    by_step = {row["step"]: row[key] for row in rows if _is_number(row.get(key))}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def run_labels(paths: list[str | Path]) -> list[str]:
    """Legend names: each file's stem, or its folder's name where stems collide (and
    the path itself where those collide too)."""
    paths = [Path(p) for p in paths]
    stems = [p.stem for p in paths]
    labels = [p.resolve().parent.name if stems.count(p.stem) > 1 else p.stem for p in paths]
    return [str(p) if labels.count(label) > 1 else label for p, label in zip(paths, labels)]


# ---- drawing ------------------------------------------------------------------------------

def plot_runs(paths: list[str], out: str) -> None:
    """Draw every run's training loss, validation loss and tokens/s (and the MoE load,
    where a run has it) against step into ``out``, one panel each, one line per run (the
    same colour in every panel)."""
    if not paths:
        raise PlotError("give at least one metrics file")
    _check_out(out)
    runs = [(label, read_metrics(p)) for label, p in zip(run_labels(paths), paths)]
    panels = {**PANELS, **{title: key for title, key in OPTIONAL_PANELS.items()
                           if any(series(rows, key)[0] for _, rows in runs)}}
    figure_cls, canvas_cls = _matplotlib()
    fig = figure_cls(figsize=(5 * len(panels), 4.4), layout="constrained")
    canvas = canvas_cls(fig)
    _check_format(out, canvas)
    for ax, (title, key) in zip(fig.subplots(1, len(panels)), panels.items()):
        _draw_panel(ax, title, key, runs)
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise PlotError(f"--out {out}: cannot write ({e.strerror})") from None


def _draw_panel(ax, title: str, key: str, runs: list[tuple[str, list[dict]]]) -> None:
    drawn = 0
    marker = "o" if key == "valid_loss" else None  # validation is sparse: show its points
    for i, (label, rows) in enumerate(runs):
        steps, values = series(rows, key)
        if steps:
            ax.plot(steps, values, color=f"C{i % 10}", label=label, marker=marker, markersize=3, linewidth=1.2)
            drawn += 1
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, f"no run has {key!r} rows", transform=ax.transAxes, ha="center", va="center",
                color="#666666")


def _matplotlib():
    """(Figure, FigureCanvasAgg), imported on first use."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(MISSING_MATPLOTLIB) from None
    return Figure, FigureCanvasAgg


def _check_out(out: str) -> None:
    path = Path(out)
    if path.is_dir():
        raise PlotError(f"--out {out}: is a directory; give a file name such as {path / 'metrics.png'}")
    folder = path.parent
    if not folder.is_dir():
        raise PlotError(f"--out {out}: folder {folder} does not exist")


def _check_format(out: str, canvas) -> None:
    suffix = Path(out).suffix.lower().lstrip(".")
    if suffix and suffix not in canvas.get_supported_filetypes():
        raise PlotError(f"--out {out}: unknown picture format .{suffix}; use .png (or .pdf, .svg)")


# ---- the command --------------------------------------------------------------------------

def add_plot_parser(subparsers) -> argparse.ArgumentParser:
    """``gridtrain plot``: compare the metrics files of one or several runs."""
    parser = subparsers.add_parser("plot", help="plot loss, validation loss and tokens/s of training runs")
    parser.add_argument("metrics", nargs="+", metavar="METRICS.jsonl",
                        help="metrics files written by gridtrain train --metrics-file")
    parser.add_argument("--out", required=True, help="picture to write (PNG)")
    return parser


def plot_command(args: argparse.Namespace) -> int:
    """Draw the runs into --out and say so; bad input raises PlotError (the CLI prints
    it as one line, exit status 2)."""
    try:
        plot_runs(args.metrics, args.out)
    except ImportError as e:
        raise PlotError(str(e)) from None
    print(f"wrote {args.out}")
    return 0
