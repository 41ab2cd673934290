"""Peak host memory of each worker of ``gridtrain train --nproc N`` for a model that only
fits sharded: a Llama whose whole fp32 size is several times one rank's ZeRO-3 share,
trained two steps under ``--zero 3 --dtype bf16``, from its initialisation and from a
Hugging Face directory of the same model (``--init-from``).

Each worker's peak resident set (``VmHWM``, kept by the kernel) is sampled from outside
the process, through /proc, every 20 ms while the command runs (*whole run*), and read
from the run's own start-up record, each rank's VmHWM when its first step began (*at the
first step*); the table gives each side's largest and smallest worker peak as a
fraction of the model's whole fp32 size. The commands run with glibc's mmap threshold
fixed at 1 MiB (:data:`MEASURED_ENV`), so that what the allocator keeps of freed blocks,
which varies with the CPU's kernels, is not counted. ``--before DIR`` runs the same commands from another checkout of
gridtrain (``PYTHONPATH=DIR``), e.g. one that built each rank's whole stage before
sharding it.

Run from the repository root::

    python3 benchmarks/start_memory.py                  # ~3 min on 2 CPU cores, ~16 GB of memory
    python3 benchmarks/start_memory.py --n-layer 4 --d-model 256 --nproc 2   # smoke
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=8, help="worker processes (default: %(default)s)")
    p.add_argument("--n-layer", type=int, default=40, help="(default: %(default)s)")
    p.add_argument("--d-model", type=int, default=1024, help="(default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=8192, help="(default: %(default)s)")
    p.add_argument("--before", metavar="DIR", help="also run the commands from this checkout of gridtrain")
    return p.parse_args(argv)


def model_flags(n_layer: int, d_model: int, vocab_size: int) -> list[str]:
    """A Llama of ``n_layer`` blocks ``d_model`` wide (heads of 128, an MLP 4 x d_model wide)."""
    return ["--arch", "llama", "--n-layer", str(n_layer), "--d-model", str(d_model), "--n-head", str(d_model // 128),
            "--n-kv-head", str(d_model // 128), "--ffn-hidden", str(4 * d_model), "--vocab-size", str(vocab_size),
            "--seq-len", "32"]


def fp32_bytes(n_layer: int, d_model: int, vocab_size: int) -> int:
    """The whole model in fp32: per block four d x d projections, three d x 4d MLP matrices
    and two norms; an untied embedding and head; the final norm."""
    block = 4 * d_model * d_model + 3 * d_model * 4 * d_model + 2 * d_model
    return 4 * (n_layer * block + 2 * vocab_size * d_model + d_model)


def train_argv(nproc: int, model: list[str], extra: list[str] = (), dtype: str = "bf16") -> list[str]:
    return [sys.executable, "-m", "gridtrain", "train", *model, "--nproc", str(nproc), "--dp", str(nproc),
            "--zero", "3", "--dtype", dtype, "--steps", "2", "--global-batch-size", str(nproc),
            "--micro-batch-size", "1", "--eval-interval", "0", "--eval-iters", "1", "--no-progress",
            "--sample-tokens", "0", *extra]


# glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), so
# that later blocks below it come from the heap, where freed memory stays resident; how
# much a worker then keeps depends on the CPU's kernels and the timing of frees (seen: the
# same fp32 run 0.8 to 1.6 of the added blocks' size, worker to worker, with AVX2
# kernels; 0.80 to 0.82 on every worker with the threshold fixed). A fixed threshold
# returns every freed block of 1 MiB or more at once, so that the peaks measure what the
# run holds, the same on every host (``MALLOC_MMAP_THRESHOLD_`` is glibc's documented
# tunable; setting it turns the dynamic threshold off).
MEASURED_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def measured_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the allocator fixed as above."""
    return {**(os.environ if env is None else env), **MEASURED_ENV}


def _hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def worker_peaks(argv: list[str], *, env: dict[str, str] | None = None, cwd: Path = ROOT,
                 interval_s: float = 0.02, timeout_s: float = 900) -> tuple[list[int], subprocess.CompletedProcess]:
    """Run ``argv`` (a ``gridtrain train --nproc`` command) and sample its workers' peak
    resident sets until it exits; returns them (one per worker, in start order) and the
    finished process (its output in ``stdout``). The command runs with :data:`MEASURED_ENV`."""
    from gridtrain.runtime import procs

    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True, env=measured_env(env),
                                cwd=cwd)
        peaks: dict[int, int] = {}
        began = time.monotonic()
        looked, workers = began - 1.0, []
        while proc.poll() is None:
            now = time.monotonic()
            if now - looked >= 0.5:  # a scan of all /proc costs far more than a worker's status: twice a second
                workers, looked = procs.local_workers(proc.pid), now
            for pid in workers:
                if (hwm := _hwm(pid)) is not None:
                    peaks[pid] = max(peaks.get(pid, 0), hwm)
            if now - began > timeout_s:
                proc.kill()
            time.sleep(interval_s)
        out.seek(0)
        done = subprocess.CompletedProcess(argv, proc.returncode, out.read(), "")
    return [peaks[pid] for pid in sorted(peaks)], done


def write_hf_llama(path: Path, n_layer: int, d_model: int, vocab_size: int, seed: int = 0) -> Path:
    """A Hugging Face Llama directory of that shape (bf16 weights, drawn tensor by tensor
    and written through one safetensors file per block, so that this process never holds
    the model)."""
    import json

    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    heads = d_model // 128
    weight_map, files = {}, []
    outer = {"model.embed_tokens.weight": draw(vocab_size, d_model), "lm_head.weight": draw(vocab_size, d_model),
             "model.norm.weight": torch.ones(d_model, dtype=torch.bfloat16)}
    files.append(("model-outer.safetensors", outer))
    for i in range(n_layer):
        p = f"model.layers.{i}."
        files.append((f"model-layer{i:03d}.safetensors", {
            p + "self_attn.q_proj.weight": draw(d_model, d_model), p + "self_attn.k_proj.weight": draw(d_model, d_model),
            p + "self_attn.v_proj.weight": draw(d_model, d_model), p + "self_attn.o_proj.weight": draw(d_model, d_model),
            p + "mlp.gate_proj.weight": draw(4 * d_model, d_model), p + "mlp.up_proj.weight": draw(4 * d_model, d_model),
            p + "mlp.down_proj.weight": draw(d_model, 4 * d_model),
            p + "input_layernorm.weight": torch.ones(d_model, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(d_model, dtype=torch.bfloat16)}))
    total = 0
    for name, tensors in files:  # drawn and written one file at a time
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    files.clear()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d_model,
              "intermediate_size": 4 * d_model, "num_hidden_layers": n_layer, "num_attention_heads": heads,
              "num_key_value_heads": heads, "vocab_size": vocab_size, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
              "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _ratio(peaks: list[int] | None, whole: int) -> str:
    if not peaks:
        return "n/a"
    return f"{max(peaks) / whole:.2f}x / {min(peaks) / whole:.2f}x"


def startup_peaks(metrics: Path) -> list[int] | None:
    """Each rank's peak resident set when its first step began (its own VmHWM then: the
    metrics file's ``startup`` record), or None from a gridtrain without it."""
    import json

    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    startup = json.loads(lines[0]).get("startup") if lines else None
    return startup["host_peak_bytes"] if startup else None


def main(argv=None) -> int:
    opts = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    whole = fp32_bytes(opts.n_layer, opts.d_model, opts.vocab_size)
    model = model_flags(opts.n_layer, opts.d_model, opts.vocab_size)
    checkouts = {"this checkout": ROOT}
    if opts.before:
        checkouts["--before"] = Path(opts.before).resolve()
    print(f"model: Llama, {opts.n_layer} layers x d_model {opts.d_model}, vocabulary {opts.vocab_size}: "
          f"{_gb(whole)} in fp32; --nproc {opts.nproc} --zero 3 --dtype bf16, 2 steps")
    print("command:", " ".join(train_argv(opts.nproc, model)[2:]))
    print(f"{'side':<52} {'at the first step':>26} {'whole run':>26}")
    print(f"{'':<52} {'(largest / smallest worker)':>26} {'(largest / smallest)':>26}")
    with tempfile.TemporaryDirectory() as tmp:
        hf = write_hf_llama(Path(tmp) / "hf", opts.n_layer, opts.d_model, opts.vocab_size)
        runs = {"initialised": [], "--init-from a Hugging Face directory": ["--init-from", str(hf)]}
        for where, checkout in checkouts.items():
            env = {**os.environ, "PYTHONPATH": str(checkout)}
            for what, extra in runs.items():
                metrics = Path(tmp) / "metrics.jsonl"
                metrics.unlink(missing_ok=True)
                argv = train_argv(opts.nproc, model if not extra else ["--seq-len", "32"], extra)
                peaks, done = worker_peaks(argv + ["--metrics-file", str(metrics)], env=env, cwd=checkout)
                if done.returncode != 0:
                    print(f"{where}, {what}: exit {done.returncode}\n{done.stdout[-2000:]}")
                    continue
                start = startup_peaks(metrics)
                print(f"{where + ', ' + what:<52} {_ratio(start, whole):>26} {_ratio(peaks, whole):>26}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
