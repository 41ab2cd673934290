"""``gridtrain prepare`` throughput: streaming with 1 and 2 workers against the in-memory path.

A corpus is generated (seeded): a folder of text files of random sizes (0.25-1.25 MB)
and one JSON-lines file (a quarter of the bytes, ~2 KB documents), built from a
Zipf-distributed vocabulary of made-up words. Each side tokenizes the whole folder into
a token file:

* **in-memory** (the baseline, what ``prepare`` did before streaming):
  ``write_token_file(load_tokens(folder, tokenizer), out, tokenizer)``;
* **prepare w1**, **prepare w2**: ``gridtrain.data.prepare(folder, out, workers=N)``.

Tokenizers: the byte tokenizer, and a Hugging Face ``tokenizer.json`` (``--tokenizer``;
default: a GPT-2-style byte-level BPE of ``--vocab`` tokens trained here on a sample of
the corpus, as the tests do, because no real one is stored offline), on a smaller corpus
(``--hf-mb``) since it is slower. Every run is a fresh Python process (not timed: the
time is taken inside it around the call) so that its peak resident memory
(``ru_maxrss`` of the process and of its worker processes) is its own. Rounds are
interleaved, the order reversed every other round; the table shows medians over rounds,
MB/s of input, tokens/s, and the ratio to the in-memory side (median of per-round
ratios). The outputs of all sides are checked identical (bytes of ``OUT.bin``).

Run from the repository root::

    python3 benchmarks/prepare.py                          # ~4 min on 2 busy CPU cores
    python3 benchmarks/prepare.py --mb 8 --hf-mb 2 --rounds 1   # smoke
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("in-memory", "prepare w1", "prepare w2")
RUN = r"""
import json, resource, sys, time
from gridtrain.data import load_tokenizer, load_tokens, prepare, read_token_file, write_token_file
side, data, out, tok = sys.argv[1:5]
tok = None if tok == "byte" else tok
began = time.perf_counter()
if side == "in-memory":
    tokenizer = load_tokenizer(tok)
    write_token_file(load_tokens(data, tokenizer), out, tokenizer)
else:
    prepare(data, out, tok, workers=int(side[-1]))
seconds = time.perf_counter() - began
peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps({"seconds": seconds, "tokens": read_token_file(out)[1]["num_tokens"], "peak_kib": peak}))
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=64, help="corpus size for the byte tokenizer (default: %(default)s)")
    p.add_argument("--hf-mb", type=float, default=4, help="corpus size for the tokenizer.json (default: %(default)s; 0: skip)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: train a byte-level BPE here)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary of the trained BPE (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_corpus(folder: Path, megabytes: float, seed: int) -> int:
    """The folder described in the module docstring; returns its size in bytes."""
    rng = np.random.default_rng(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(list(letters), rng.integers(1, 10))) for _ in range(20000)]
    ranks = np.minimum(rng.zipf(1.2, 400_000), len(words)) - 1
    seps = rng.choice([" ", " ", " ", " ", ", ", ".\n", "\n\n"], len(ranks))
    base = "".join(w + s for w, s in zip((words[r] for r in ranks), seps)).encode()  # ~2.5 MB
    total = int(megabytes * 1e6)
    folder.mkdir(parents=True)
    written, k = 0, 0

    def piece(n: int) -> bytes:
        start = int(rng.integers(0, len(base) - n))
        return base[start: start + n]

    while written < total * 3 // 4:
        n = min(int(rng.integers(250_000, 1_250_000)), total * 3 // 4 - written + 1)
        (folder / f"doc{k:05d}.txt").write_bytes(piece(n))
        written += n
        k += 1
    with open(folder / "records.jsonl", "w") as f:
        while written < total:
            text = piece(2000).decode()
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)
    return sum(p.stat().st_size for p in folder.iterdir())


def train_bpe(path: Path, sample: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(p) for p in sorted(sample.glob("*.txt"))[:4]], trainer)
    tok.save(str(path))
    return path


def run(side: str, data: Path, out: Path, tokenizer: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", RUN, side, str(data), str(out), tokenizer],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"prepare benchmark: {side} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["sha256"] = hashlib.sha256(Path(f"{out}.bin").read_bytes()).hexdigest()
    return result


def bench(name: str, data: Path, size: int, tokenizer: str, rounds: int, work: Path) -> None:
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    for r in range(rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            results[side].append(run(side, data, work / side.replace(" ", "_"), tokenizer))
    digests = {res["sha256"] for side in SIDES for res in results[side]}
    tokens = results[SIDES[0]][0]["tokens"]
    print(f"\n{name}: {size / 1e6:.1f} MB, {tokens:,} tokens; outputs identical: {'yes' if len(digests) == 1 else 'NO'}")
    print(f"{'side':<12} {'seconds':>8} {'MB/s':>8} {'Mtokens/s':>10} {'vs in-memory':>13} {'peak RSS':>10}   per round (s)")
    for side in SIDES:
        secs = [res["seconds"] for res in results[side]]
        ratio = statistics.median(base["seconds"] / res["seconds"]
                                  for base, res in zip(results[SIDES[0]], results[side]))
        med = statistics.median(secs)
        peak = max(res["peak_kib"] for res in results[side]) / 1024
        print(f"{side:<12} {med:>8.2f} {size / 1e6 / med:>8.1f} {tokens / 1e6 / med:>10.2f} {ratio:>12.2f}x "
              f"{peak:>7.0f} MiB   {', '.join(f'{s:.2f}' for s in secs)}")


def main(argv=None) -> int:
    opts = parse_args(argv)
    began = time.time()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"protocol: {opts.rounds} interleaved rounds, a fresh process per run, medians; ratio = in-memory s / side s")
    with tempfile.TemporaryDirectory(prefix="gridtrain-prepare-bench-") as tmp:
        work = Path(tmp)
        size = make_corpus(work / "byte-corpus", opts.mb, opts.seed)
        bench("byte tokenizer", work / "byte-corpus", size, "byte", opts.rounds, work)
        if opts.hf_mb > 0:
            size = make_corpus(work / "hf-corpus", opts.hf_mb, opts.seed + 1)
            tokenizer = opts.tokenizer or str(train_bpe(work / "tokenizer.json", work / "hf-corpus", opts.vocab))
            label = opts.tokenizer or f"byte-level BPE, vocab {opts.vocab}, trained here"
            bench(f"tokenizer.json ({label})", work / "hf-corpus", size, tokenizer, opts.rounds, work)
    print(f"\nload at end {os.getloadavg()[0]:.2f}")
    print(f"wall time {time.time() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
