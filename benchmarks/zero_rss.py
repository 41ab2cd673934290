"""ZeRO-1/2/3 peak host memory of a real gloo run against the dry run's prediction, and
the run's per-step losses, for a before/after comparison of a change to the ZeRO runtime.

For each ZeRO stage (``--zero-stages``, default 1,2,3) the script runs, as a subprocess
from the repository that holds this file (``cwd`` and ``PYTHONPATH`` are that checkout,
so a copy of the script in another worktree measures that worktree's gridtrain):

1. the real run: ``python -m gridtrain train --nproc 4 --dp 4 --zero Z`` of a
   Llama-style model of 100,682,496 parameters (``--arch llama --n-layer 12 --d-model 768
   --n-head 12 --n-kv-head 4 --vocab-size 16384 --untie-embeddings``: 12 x 6.29M in the
   blocks, two untied 12.6M embedding/head tables), ``--dtype bf16`` (16-bit weights
   and fp32 master weights, so the two are told apart; bf16 is fast enough on this
   CPU, which has AVX512-BF16), ``--seq-len 128``, micro-batch 1, global batch 4 (one
   micro-batch per rank per step), 4 steps, validation off (``--eval-interval 0``),
   ``--device cpu``, with ``--metrics-file``. gridtrain itself reports each rank's
   peak resident memory only up to the first step (the metrics' ``startup.host_peak_bytes``,
   kept in the results as ``startup_host_peak_bytes``), not over the steps. So the
   script samples the process tree from /proc every ``--interval`` s (0.1): the
   workers are the children of the process with the most children under the launcher
   (the warm forkserver, or the launcher under ``GRIDTRAIN_START_METHOD=spawn``), and
   each worker's Linux ``VmHWM`` (its peak resident set over its whole life: a
   high-water mark, so sparse sampling misses nothing but the shutdown after the last
   sample) is kept as its ``peak_rss_bytes``. Workers are listed in the order they
   started, which is rank order (the launcher starts rank 0 first), but /proc does not
   say which rank a pid is; the ranks are symmetric here (dp 4, nothing else), and the
   table uses the largest over the ranks.

   Each stage's real run is made once per ``--malloc`` mode (default: both):

   * ``mmap``: ``MALLOC_MMAP_THRESHOLD_=131072`` in the run's environment: every block
     of 128 KiB or more (every tensor that matters here) is mapped on its own and
     unmapped when freed, and glibc's dynamic threshold is off, so the resident set
     follows the live tensors page for page. This is the mode that checks the dry run:
     VmHWM is reproducible to a few MiB (rank spread 3-9 MiB, run to run < 3 MiB, at a
     load average of 6-15 on 2 cores);
   * ``glibc``: glibc's defaults, what a user's run sees. The threshold grows to 32 MiB
     as blocks are freed, freed heap memory stays resident and is reused depending on
     the threads' arenas and timing: the same run's VmHWM varies by 30-215 MiB from
     rank to rank and by up to ~60 MiB from run to run, so a fall of less than ~100 MiB
     cannot be told from noise in this mode.

2. the dry run of the same flags: ``--dry-run --world-size 4 --dry-run-report F.json``
   (no ``--nproc``), whose rank 0 row gives ``peak_bytes`` (the step's peak of live
   tensor bytes), its parts and ``startup_peak_bytes`` (the build's peak).

Results go to ``--out FILE.json``: per stage the command lines, the per-step losses
and gradient norms (exact floats from the metrics file), the per-rank peak RSS per
malloc mode, the dry run's rank 0 row, and the wall time of each run.
``--compare BEFORE.json`` then prints, per malloc mode found on both sides::

    stage | RSS before | RSS after | measured fall | dry-run peak before | after | predicted fall | fall ratio | losses identical

(RSS: the largest VmHWM over the ranks; losses identical: the metrics' ``loss`` of
every step equal as floats, bit for bit, and the same number of steps; repeated runs
of one checkout give identical losses, with either malloc mode).
``--compare BEFORE.json --after AFTER.json`` compares two saved files without running.

How the measured fall relates to the prediction. A worker's VmHWM is the Python/torch
baseline (interpreter, torch's libraries, the pages it shares with the forkserver it
was forked from) plus the largest resident heap of its life: the dry run's step peak
(or its build peak, ``startup_peak_bytes``, where that is larger) plus what lives
outside the tensors the dry run sees (gloo's transport buffers, Python objects) and,
in the ``glibc`` mode, what the allocator keeps. The baseline is the same before and
after and cancels in the difference: the measured fall should equal the fall of the
dry run's peak (of max(step peak, start-up peak)), as long as the change does not
alter what the process holds beside the dry run's tensors. Measured before the change
(mmap mode): gridtrain's own start-up peak is the dry run's start-up peak + 313 MiB on
every stage (the baseline, to 1 MiB), and the step's VmHWM is the dry run's step peak
+ 313 MiB + 185 MiB (ZeRO-1), + 64 MiB (ZeRO-2), + 78 MiB (ZeRO-3): memory the real
step holds that the dry run does not count, which a change may also move. A match, in
the ``mmap`` mode: the measured fall within 10% of the predicted fall, or within
16 MiB where the predicted fall is small. A measured fall much smaller than predicted
means that what the dry run no longer counts is still resident (or the high-water
mark is set elsewhere, e.g. by something outside the dry run's tensors); much larger,
that the old code also held something the dry run does not see.

Run from the repository root (the runs go one after the other, never two at once)::

    python3 benchmarks/zero_rss.py --out benchmarks/results/zero_rss_after.json \\
        --compare benchmarks/results/zero_rss_before.json
    # ~4 min on 2 idle CPU cores, ~6.5 min at a load average of 6-15: per stage ~7-12 s for the
    # dry run and 35-80 s per real run (two: --malloc mmap,glibc; ~12 s of each is start-up);
    # up to ~1.9 GB resident per worker, ~7.5 GB in all at ZeRO-1
    python3 benchmarks/zero_rss.py --malloc mmap --out /tmp/after.json    # the check alone, ~2.5 min
    python3 benchmarks/zero_rss.py --zero-stages 3 --out /tmp/z3.json     # one stage
    python3 benchmarks/zero_rss.py --compare BEFORE.json --after AFTER.json  # tables only

The "before" numbers were produced by copying this script into a pristine worktree of
the commit before the change and running it there (its own ``gridtrain`` is imported by
the subprocesses because ``cwd`` and ``PYTHONPATH`` are the script's checkout; the
results record ``gridtrain_origin`` and the checkout's commit to show it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

import common  # benchmarks/common.py: the script's own folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
NPROC = 4
MIB = 1 << 20
MMAP_THRESHOLD = 128 << 10  # glibc's default threshold, fixed (setting it turns off its growth)

SHAPE = ["--arch", "llama", "--n-layer", "12", "--d-model", "768", "--n-head", "12", "--n-kv-head", "4",
         "--vocab-size", "16384", "--untie-embeddings"]


def train_flags(opts: argparse.Namespace, zero: int) -> list[str]:
    """The flags shared by the real run and the dry run of one stage."""
    return [*SHAPE, "--seq-len", str(opts.seq_len), "--micro-batch-size", "1",
            "--global-batch-size", str(NPROC), "--dp", str(NPROC), "--zero", str(zero),
            "--dtype", opts.dtype, "--device", "cpu", "--steps", str(opts.steps), "--seed", str(opts.seed),
            "--eval-interval", "0", "--no-progress"]


MALLOC_MODES = {  # the real run's glibc settings, by name
    "mmap": {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)},
    "glibc": {},
}


def environment(malloc: str | None = None) -> dict[str, str]:
    """This checkout's gridtrain first on the subprocesses' path; with ``malloc``, glibc's
    settings of that mode (any MALLOC_* of this environment dropped)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if malloc is not None:
        env = {k: v for k, v in env.items() if not k.startswith("MALLOC_")} | MALLOC_MODES[malloc]
    return env


def shown(cmd: list[str]) -> str:
    return " ".join(["python3", *cmd[1:]])


# ---- /proc ------------------------------------------------------------------------------------------

def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) for every process now."""
    return {pid: (int(fields[1]), int(fields[19])) for pid, fields in common.proc_stats().items()}


def _status_kib(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Sampler:
    """On a thread while the command runs: every descendant of ``root`` with its parent,
    start time and the last VmHWM read from it (its high-water mark, so the last read
    before it exits is its peak up to that moment)."""

    def __init__(self, root: int, interval: float):
        self.root, self.interval = root, interval
        self.seen: dict[int, dict] = {}  # pid -> {"ppid", "start", "hwm_kib", "samples"}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        todo = list(children.get(self.root, []))
        while todo:
            pid = todo.pop()
            todo += children.get(pid, [])
            hwm = _status_kib(pid, "VmHWM")
            if hwm is None:
                continue
            row = self.seen.setdefault(pid, {"ppid": table[pid][0], "start": table[pid][1], "hwm_kib": 0,
                                             "samples": 0})
            if row["start"] != table[pid][1]:
                continue  # a reused pid: not ours
            row["hwm_kib"] = max(row["hwm_kib"], hwm)
            row["samples"] += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def workers(self) -> list[dict]:
        """The worker processes, in the order they started: the children of the process
        with the most children (the forkserver; the launcher under spawn), leaving out
        multiprocessing's resource tracker, which never imports torch."""
        by_parent: dict[int, list[int]] = {}
        for pid, row in self.seen.items():
            by_parent.setdefault(row["ppid"], []).append(pid)
        parent = max(by_parent, key=lambda p: len(by_parent[p]))
        pids = [p for p in by_parent[parent] if not _is_resource_tracker(p)]
        pids.sort(key=lambda p: (self.seen[p]["start"], p))
        return [{"pid": p, **self.seen[p]} for p in pids]


def _is_resource_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except OSError:
        return False


# ---- one stage -------------------------------------------------------------------------------------

def real_run(opts: argparse.Namespace, zero: int, malloc: str, work: Path) -> dict:
    metrics = work / f"metrics-zero{zero}-{malloc}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "gridtrain", "train", *train_flags(opts, zero), "--nproc", str(NPROC),
           "--metrics-file", str(metrics)]
    load = os.getloadavg()[0]
    began = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=environment(malloc), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    sampler = Sampler(proc.pid, opts.interval)
    try:
        out, _ = proc.communicate(timeout=opts.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        sampler.stop()
        raise SystemExit(f"ZeRO-{zero} ({malloc}): the run took longer than --timeout {opts.timeout:g} s:\n{out[-4000:]}")
    sampler.stop()
    wall = time.time() - began
    if proc.returncode != 0:
        raise SystemExit(f"ZeRO-{zero} ({malloc}): the run failed (exit {proc.returncode}):\n{shown(cmd)}\n{out[-4000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    workers = sampler.workers()
    if len(workers) != NPROC:
        raise SystemExit(f"ZeRO-{zero} ({malloc}): found {len(workers)} worker processes in /proc, expected {NPROC}: {workers}")
    startup = next((r["startup"] for r in rows if "startup" in r), {})
    return {
        "command": " ".join([*(f"{k}={v}" for k, v in MALLOC_MODES[malloc].items()), shown(cmd)]),
        "malloc": malloc,
        "wall_s": round(wall, 2),
        "load_at_start": load,
        "steps": [r["step"] for r in rows],
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["grad_norm"] for r in rows],
        "step_time_s": [round(r["step_time_s"], 3) for r in rows],
        "peak_rss_bytes": [w["hwm_kib"] * 1024 for w in workers],  # per worker, in start (= rank) order
        "rss_samples": [w["samples"] for w in workers],
        "startup_host_peak_bytes": startup.get("host_peak_bytes"),  # gridtrain's own, per rank, up to step 1
        "summary": [line for line in out.splitlines() if line.startswith(("gridtrain:", "start-up:", "throughput:"))],
    }


def dry_run(opts: argparse.Namespace, zero: int, work: Path) -> dict:
    report = work / f"dryrun-zero{zero}.json"
    report.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "gridtrain", "train", *train_flags(opts, zero), "--dry-run", "--world-size",
           str(NPROC), "--dry-run-report", str(report)]
    began = time.time()
    done = subprocess.run(cmd, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=opts.timeout)
    if done.returncode != 0:
        raise SystemExit(f"ZeRO-{zero}: the dry run failed (exit {done.returncode}):\n{shown(cmd)}\n"
                         f"{(done.stdout + done.stderr)[-4000:]}")
    rank0 = next(r for r in json.loads(report.read_text())["ranks"] if r["rank"] == 0)
    keep = ("parameters", "parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_peak_bytes",
            "peak_bytes", "startup_peak_bytes")
    return {"command": shown(cmd), "wall_s": round(time.time() - began, 2), "rank0": {k: rank0.get(k) for k in keep}}


def provenance() -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""
    origin = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('gridtrain').origin)"],
                            cwd=ROOT, env=environment(), capture_output=True, text=True).stdout.strip()
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "?"
    return {"checkout": str(ROOT), "commit": git("rev-parse", "HEAD"),
            "dirty_files": [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines()],
            "gridtrain_origin": origin, "python": platform.python_version(), "torch": torch,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def run_all(opts: argparse.Namespace) -> dict:
    stages = [int(z) for z in opts.zero_stages.split(",")]
    modes = opts.malloc.split(",")
    results = {"provenance": provenance(),
               "config": {"shape": " ".join(SHAPE), "seq_len": opts.seq_len, "steps": opts.steps, "dtype": opts.dtype,
                          "nproc": NPROC, "micro_batch_size": 1, "global_batch_size": NPROC, "seed": opts.seed,
                          "malloc_modes": {m: MALLOC_MODES[m] for m in modes}},
               "stages": {}}
    print(f"gridtrain from {results['provenance']['gridtrain_origin']} "
          f"(commit {results['provenance']['commit'][:10]}); load {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="zero_rss-") as tmp:
        for zero in stages:
            dry = dry_run(opts, zero, Path(tmp))
            print(f"ZeRO-{zero}: dry-run step peak {dry['rank0']['peak_bytes'] / MIB:.1f} MiB (start-up "
                  f"{dry['rank0']['startup_peak_bytes'] / MIB:.1f}); {dry['wall_s']:.0f} s", flush=True)
            results["stages"][str(zero)] = {"dry_run": dry, "real": {}}
            for malloc in modes:
                real = real_run(opts, zero, malloc, Path(tmp))
                results["stages"][str(zero)]["real"][malloc] = real
                print(f"ZeRO-{zero} {malloc}: peak RSS per rank "
                      f"{', '.join(f'{b / MIB:.1f}' for b in real['peak_rss_bytes'])} MiB (gridtrain's start-up peak "
                      f"{', '.join(f'{b / MIB:.1f}' for b in real['startup_host_peak_bytes'] or [])} MiB); "
                      f"losses {real['losses']}; {real['wall_s']:.0f} s (load {real['load_at_start']:.2f})",
                      flush=True)
    return results


# ---- comparison ------------------------------------------------------------------------------------

def compare(before: dict, after: dict) -> None:
    def mib(b: float) -> str:
        return f"{b / MIB:,.1f}"

    print(f"before: {before['provenance']['commit'][:10]} ({before['provenance']['checkout']}), "
          f"after: {after['provenance']['commit'][:10]} ({after['provenance']['checkout']}"
          f"{', uncommitted changes' if after['provenance'].get('dirty_files') else ''})")
    cb = {k: v for k, v in before["config"].items() if k != "malloc_modes"}
    ca = {k: v for k, v in after["config"].items() if k != "malloc_modes"}
    if cb != ca:
        print(f"WARNING: the configurations differ: {cb} vs {ca}")
    stages = sorted(set(before["stages"]) & set(after["stages"]), key=int)
    modes = [m for m in MALLOC_MODES if all(m in before["stages"][z]["real"] and m in after["stages"][z]["real"]
                                            for z in stages)]
    head = ["stage", "RSS before", "RSS after", "measured fall", "dry-run peak before", "after", "predicted fall",
            "fall ratio", "losses identical"]
    for malloc in modes:
        rows, notes = [], []
        for stage in stages:
            b, a = before["stages"][stage], after["stages"][stage]
            rb, ra = b["real"][malloc], a["real"][malloc]
            rss_b, rss_a = max(rb["peak_rss_bytes"]), max(ra["peak_rss_bytes"])
            dry_b, dry_a = b["dry_run"]["rank0"]["peak_bytes"], a["dry_run"]["rank0"]["peak_bytes"]
            measured, predicted = rss_b - rss_a, dry_b - dry_a
            lb, la = rb["losses"], ra["losses"]
            same = len(lb) == len(la) and all(x == y for x, y in zip(lb, la))
            ratio = f"{measured / predicted:.2f}" if predicted else "-"
            rows.append([f"ZeRO-{stage}", mib(rss_b), mib(rss_a), mib(measured), mib(dry_b), mib(dry_a),
                         mib(predicted), ratio,
                         "yes" if same else f"NO ({sum(x != y for x, y in zip(lb, la))} of {len(lb)} differ"
                                            f"{', step counts differ' if len(lb) != len(la) else ''})"])
            for side, s in (("before", b), ("after", a)):
                r0 = s["dry_run"]["rank0"]
                if r0["startup_peak_bytes"] > r0["peak_bytes"]:
                    notes.append(f"ZeRO-{stage} {side}: the dry run's start-up peak ({mib(r0['startup_peak_bytes'])} "
                                 "MiB) exceeds its step peak; the RSS high-water mark follows the larger")
            spread = [max(x) - min(x) for x in (rb["peak_rss_bytes"], ra["peak_rss_bytes"])]
            notes.append(f"ZeRO-{stage}: rank spread of peak RSS {mib(spread[0])} MiB before, "
                         f"{mib(spread[1])} MiB after")
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        env = " ".join(f"{k}={v}" for k, v in MALLOC_MODES[malloc].items()) or "glibc's defaults"
        print(f"\nmalloc mode '{malloc}' ({env}); MiB")
        print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
        print("-|-".join("-" * w for w in widths))
        for r in rows:
            print(" | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        print("RSS: the largest VmHWM over the 4 ranks; dry-run peak: rank 0's step peak; fall ratio: "
              "measured / predicted" + (" (a match: within 10% of the predicted fall, or 16 MiB for small falls)"
                                        if malloc == "mmap" else " (indicative only: see the docstring)"))
        for n in notes:
            print("  " + n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zero-stages", default="1,2,3", help="comma-separated ZeRO stages (default: %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=128, help="default: %(default)s")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="default: %(default)s")
    p.add_argument("--seed", type=int, default=1234, help="default: %(default)s")
    p.add_argument("--malloc", default="mmap,glibc",
                   help="the real runs' glibc settings, comma-separated: mmap (MALLOC_MMAP_THRESHOLD_=131072: every "
                        "block of 128 KiB or more mapped on its own and unmapped when freed), glibc (the defaults) "
                        "(default: %(default)s, one real run per mode and stage)")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between /proc samples (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run (default: %(default)s)")
    p.add_argument("--out", type=Path, help="write the results here (JSON)")
    p.add_argument("--compare", type=Path, metavar="BEFORE.json", help="print the before/after table against this file")
    p.add_argument("--after", type=Path, metavar="AFTER.json",
                   help="with --compare: take the 'after' side from this file instead of running")
    opts = p.parse_args()
    if not opts.malloc or any(m not in MALLOC_MODES for m in opts.malloc.split(",")):
        p.error(f"--malloc takes a comma-separated list of {', '.join(MALLOC_MODES)}")
    if opts.after and not opts.compare:
        p.error("--after needs --compare BEFORE.json")
    if not os.path.isdir("/proc"):
        p.error("the peak RSS is read from /proc (Linux only)")
    if opts.after:
        compare(json.loads(opts.compare.read_text()), json.loads(opts.after.read_text()))
        return
    began = time.time()
    results = run_all(opts)
    results["wall_s"] = round(time.time() - began, 1)
    if opts.out:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {opts.out} ({results['wall_s']:.0f} s)")
    if opts.compare:
        compare(json.loads(opts.compare.read_text()), results)


if __name__ == "__main__":
    main()
