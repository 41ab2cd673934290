"""Fine-tune a model from a Hugging Face-format directory on prompt/completion JSON lines
(the loss on the completions only, examples masked from each other), on tp 2 x pp 2,
then sample from the result and export it back to Hugging Face's format.

The steps a user takes with a model downloaded from the Hub (say SmolLM2 or TinyLlama),
with a stand-in for the download (this example runs offline): a small Llama trained here
for one step and exported with ``gridtrain export-hf``. With a real download, start at
step 3 with its directory. ``--arch gpt2`` makes the stand-in a GPT-2 (the source's
config.json decides the architecture of everything after it).

    python examples/finetune_hf.py [WORK_DIR] [--arch llama|gpt2]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

BASE = {"gpt2": ["--model", "tiny"], "llama": ["--model", "llama-tiny"]}  # the stand-in's preset, by --arch
GRIDTRAIN = [sys.executable, "-m", "gridtrain"]
QUIET = ["--no-progress", "--eval-interval", "0"]


def gridtrain(*args: str) -> str:
    proc = subprocess.run([*GRIDTRAIN, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"gridtrain {args[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def additions(n: int, seed: int = 0) -> list[dict]:
    """The fine-tuning set: one small sum per example, as prompt/completion records."""
    rng = random.Random(seed)
    return [{"prompt": f"Q: {a} plus {b}? A:", "completion": f" {a + b}."} for a, b in
            ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(n))]


def losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def main(work: Path, arch: str = "llama") -> None:
    # 1-2. the stand-in for a downloaded model: a brief base run, exported
    gridtrain("train", *BASE[arch], "--steps", "1", "--save", str(work / "base"), *QUIET)
    gridtrain("export-hf", "--load", str(work / "base"), "--out", str(work / "base-hf"))
    # 3. fine-tuning data: prompt/completion JSON lines; the loss counts the completions only, and
    #    --document-mask keeps the examples packed into one sequence from seeing each other
    data = work / "sums.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in additions(600)))
    # 4. fine-tune from the Hugging Face directory: the model's shape comes from its config.json
    metrics = work / "tune.jsonl"
    gridtrain("train", "--init-from", str(work / "base-hf"), "--data", str(data), "--tp", "2", "--pp", "2",
              "--nproc", "4", "--steps", "60", "--lr", "1e-2", "--global-batch-size", "8", "--document-mask",
              "--micro-batch-size", "2", "--save", str(work / "tuned"), "--metrics-file", str(metrics), *QUIET)
    tuned = losses(metrics)
    print(f"fine-tuning loss {tuned[0]:.3f} -> {tuned[-1]:.3f} over {len(tuned)} steps on tp 2 x pp 2")
    # 5. sample from the fine-tuned checkpoint, and hand it back to the Hugging Face world
    sample = gridtrain("generate", "--load", str(work / "tuned"), "--prompt", "Q: 3 plus 4? A:",
                       "--max-new-tokens", "24", "--temperature", "0.7")
    print(f"sample: {sample.rstrip(chr(10))!r}")
    gridtrain("export-hf", "--load", str(work / "tuned"), "--out", str(work / "tuned-hf"))
    print(f"exported to {work / 'tuned-hf'}: {', '.join(sorted(p.name for p in (work / 'tuned-hf').iterdir()))}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work", nargs="?", type=Path, help="keep the files here (default: a temporary directory)")
    parser.add_argument("--arch", choices=sorted(BASE), default="llama")
    args = parser.parse_args()
    if args.work is not None:
        main(args.work, args.arch)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp), args.arch)
