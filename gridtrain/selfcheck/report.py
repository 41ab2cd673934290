"""The self-check's report: report.md for people, report.json with the same numbers.

Both are rewritten whole (to a temporary file, then renamed) after every step, so a
check killed at any moment leaves a complete report of the steps it finished and lists
the ones it did not reach as ``not run``.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

GIB = 2 ** 30


@dataclass
class StepResult:
    name: str
    what: str
    status: str  # pass | fail | timeout | skipped
    seconds: float
    detail: str = ""
    tail: str = ""  # the last lines of its log, when it did not pass
    data: dict = field(default_factory=dict)  # a check's measurements


class Report:
    def __init__(self, out: Path, command: str, device: str, planned: list[tuple[str, str]]):
        self.out = Path(out)
        self.command = command
        self.device = device
        self.planned = planned
        self.started = _now()
        self.finished: str | None = None
        self.steps: list[StepResult] = []

    def add(self, result: StepResult) -> None:
        """A finished step; the report lists steps in the planned order (steps run side by
        side finish in any)."""
        self.steps.append(result)
        order = {name: i for i, (name, _) in enumerate(self.planned)}
        self.steps.sort(key=lambda s: order.get(s.name, len(order)))

    def finish(self) -> None:
        self.finished = _now()

    def all_passed(self) -> bool:
        return len(self.steps) == len(self.planned) and all(s.status == "pass" for s in self.steps)

    def summary(self) -> str:
        counts = {}
        for s in self.steps:
            counts[s.status] = counts.get(s.status, 0) + 1
        return ", ".join(f"{n} {status}" for status, n in counts.items()) or "nothing run"

    # ---- what the steps measured -------------------------------------------------------------

    def rows(self, key: str) -> list[dict]:
        """Every step's measurements under ``key`` (throughput, memory, planner, parity)."""
        return [row for s in self.steps for row in s.data.get(key, [])]

    def environment(self) -> dict:
        return next((s.data.get("environment", {}) for s in self.steps if s.name == "environment"), {})

    def as_json(self) -> dict:
        done = {s.name for s in self.steps}
        return {"command": self.command, "device": self.device, "started": self.started, "finished": self.finished,
                "environment": self.environment(),
                "steps": [asdict(s) for s in self.steps]
                + [{"name": n, "what": w, "status": "not run"} for n, w in self.planned if n not in done],
                "throughput": self.rows("throughput"), "memory": self.rows("memory"),
                "planner": self.rows("planner"), "parity": self.rows("parity"), "attention": self.rows("attention"),
                "fp8": self.rows("fp8"), "semantics": self.rows("semantics")}

    # ---- writing ----------------------------------------------------------------------------------

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        _replace(self.out / "report.json", json.dumps(self.as_json(), indent=1) + "\n")
        _replace(self.out / "report.md", "\n".join(self.markdown()) + "\n")

    def markdown(self) -> list[str]:
        d = self.as_json()
        env = d["environment"]
        title = env.get("gpu") or self.device
        lines = [f"# gridtrain self-check: {title}", "",
                 f"`{self.command}`, started {self.started}, "
                 + (f"finished {self.finished}." if self.finished else "**still running or killed** (steps not "
                                                                        "reached are listed as not run)."), ""]
        if env:
            lines += ["## Environment", "", "| | |", "| --- | --- |"]
            lines += [f"| {k} | {v} |" for k, v in env.items()]
            lines.append("")
        lines += ["## Steps", "", "| step | what | result | seconds |", "| --- | --- | --- | --- |"]
        for s in d["steps"]:
            result = s["status"] + (f": {s['detail']}" if s.get("detail") else "")
            lines.append(f"| {s['name']} | {s['what']} | {result} | {s.get('seconds', '')} |")
        lines.append("")
        lines += _table("What only a GPU shows", d["semantics"],
                        [("check", "check", "{}"), ("case", "case", "{}"), ("quantity", "quantity", "{}"),
                         ("value", "value", _value), ("limit", "limit", _value), ("ok", "ok", "{}")],
                        "gridtrain/selfcheck/cuda_semantics.py: relative differences are the largest difference "
                        "over the largest reference value; a row with a limit fails its step above it, a row "
                        "without one is reported only.")
        lines += _table("Parity against fp64 on the CPU", d["parity"],
                        [("dtype", "dtype", "{}"), ("device", "device", "{}"),
                         ("max relative loss difference", "max_rel_diff", "{:.2e}"),
                         ("tolerance", "tolerance", "{:.0e}"), ("steps", "steps", "{}")])
        lines += _table("Throughput (one device)", d["throughput"],
                        [("model", "model", "{}"), ("compile", "compile", "{}"), ("loop", "loop", "{}"),
                         ("tokens/step", "tokens_per_step", "{:,}"), ("step ms", "step_ms", "{:.1f}"),
                         ("tokens/s", "tokens_per_s", "{:,.0f}"), ("model TFLOP/s", "tflops", "{:.1f}"),
                         ("MFU", "mfu", "{:.1%}"), ("against", "baseline", "{}"), ("speed vs it", "vs", "{:.3f}x")],
                        "Median step after the warm-up steps, rounds interleaved (plain, gridtrain, plain, "
                        "gridtrain; causal, masked, causal, masked); model FLOPs per token by the Narayanan et "
                        "al. formula, the same for both loops (and for a masked run, which does less attention "
                        "work); MFU against the device's dense bf16 peak.")
        lines += _table("Float8 against bf16 (one device)", d["fp8"],
                        [("run", "run", "{}"), ("tokens/s", "tokens_per_s", "{:,.0f}"),
                         ("speed vs bf16", "vs_bf16", "{:.3f}x"), ("planner's", "predicted_vs_bf16", "{:.3f}x"),
                         ("final loss", "final_loss", "{:.4f}"), ("vs bf16", "final_loss_rel_diff", "{:.2%}"),
                         ("largest step difference", "max_loss_rel_diff", "{:.2%}"), ("steps", "steps", "{}"),
                         ("peak GiB", "peak_gib", "{:.2f}"), ("memory vs bf16", "memory_vs_bf16", "{:.3f}x"),
                         ("target", "target", "{}")],
                        "Each float8 recipe against bf16 of the same compile mode, the same seed and data, run "
                        "back to back; target: compiled at 1.25x bf16's tokens/s or more with the final loss "
                        "within 1% (reported, not failed on). MFU stays against the bf16 peak.")
        lines += _table("Attention at long context: context parallelism's blocks vs fused SDPA", d["attention"],
                        [("run", "run", "{}"), ("path", "path", "{}"), ("ms (fwd + bwd)", "ms", "{:.1f}"),
                         ("attention TFLOP/s", "tflops", "{:.1f}"), ("transient GiB", "transient_gib", "{:.2f}"),
                         ("speed vs fused SDPA", "vs_fused_sdpa", "{:.3f}x"),
                         ("largest output difference", "max_abs_diff", "{:.2e}")],
                        "One layer, one process: every cp rank's visible chunk pairs through the block kernel "
                        "and merged by log-sum-exp, against scaled_dot_product_attention over the whole "
                        "sequence; the same causal work. Transient: peak allocated above what was allocated "
                        "before the pass.")
        lines += _table("Peak memory: measured vs the dry run", d["memory"],
                        [("run", "run", "{}"), ("measured GiB", "measured_gib", "{:.2f}"),
                         ("dry run GiB", "predicted_gib", "{:.2f}"), ("measured / predicted", "ratio", "{:.3f}"),
                         ("plain PyTorch GiB", "plain_gib", "{:.2f}")],
                        "Measured: torch.cuda.max_memory_allocated over the whole gridtrain run, less what "
                        "was allocated when it started; predicted: `gridtrain train --dry-run` of the same "
                        "layout (fake tensors).")
        lines += _table("Step time: planner vs measured", d["planner"],
                        [("run", "run", "{}"), ("hardware", "hardware", "{}"),
                         ("predicted ms", "predicted_ms", "{:.1f}"), ("measured ms", "measured_ms", "{:.1f}"),
                         ("measured / predicted", "ratio", "{:.3f}")])
        failed = [s for s in d["steps"] if s.get("tail")]
        if failed:
            lines += ["## The last lines of each step that did not pass", ""]
            for s in failed:
                lines += [f"### {s['name']} ({s['status']})", "", "```", s["tail"], "```", ""]
        return lines


def _table(title: str, rows: list[dict], columns: list[tuple], note: str = "") -> list[str]:
    if not rows:
        return []
    lines = [f"## {title}", ""] + ([note, ""] if note else [])
    lines += ["| " + " | ".join(c[0] for c in columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        cells = []
        for _, key, fmt in columns:
            value = row.get(key)
            cells.append("n/a" if value is None else fmt(value) if callable(fmt) else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _value(value) -> str:
    """A measured number in three significant digits; anything else as it is."""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
