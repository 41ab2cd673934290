"""What ``--document-mask`` costs: the whole ``gridtrain train`` loop with and without it,
side by side, in one process and on cp 2 (ring), at one sequence length.

Every side is ``pretrain`` with the text providers, as the command runs it: a small GPT
at ``--seq-len`` (default 2048), one sequence per micro-batch, the same global batch and
seed everywhere; the one-process sides with every core's threads, the cp sides with one
thread per rank (as ``gridtrain train --nproc 2`` gives them). The data: with
``--doc-bytes N`` (default 512) a JSON-lines corpus of documents of N/2 to 3N/2 bytes cut
from the built-in corpus (a 2048-token window then holds about four: a packed
pre-training window of short documents); with ``--doc-bytes 0`` the built-in corpus's
files whole (long: a window holds one to a few). Both sides of a pair read the same
data. With the mask, attention is causal attention on each document's span, one fused
block per document (parallel/attention_blocks.py), so a window of several documents
does less attention work than the causal window. The sides run in turn, the order
reversed every other round; per side, the median over rounds of the run's tokens/s
(median step after the first), the spread over rounds, and the peak bytes saved for
backward per rank at step 1.

    python3 benchmarks/document_mask.py                   # ~2 min on 2 CPU cores
    python3 benchmarks/document_mask.py --doc-bytes 0     # the built-in corpus's documents
    python3 benchmarks/document_mask.py --seq-len 4096 --rounds 1
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile

import common  # benchmarks/common.py: the script's own folder is on sys.path
from gridtrain.config import ConfigError

SIDES = {  # name -> (world size, parallel fields, document mask)
    "one process": (1, {}, False),
    "one process, --document-mask": (1, {}, True),
    "cp 2 ring": (2, dict(cp=2, cp_comm="ring"), False),
    "cp 2 ring, --document-mask": (2, dict(cp=2, cp_comm="ring"), True),
}


def short_documents(doc_bytes: int, total_bytes: int = 4 << 20, seed: int = 0) -> str:
    """A JSON-lines corpus (written once to the temporary folder) of documents of
    ``doc_bytes / 2`` to ``3 doc_bytes / 2`` bytes cut in order from the built-in corpus."""
    from gridtrain.data.corpora import builtin_bytes

    path = os.path.join(tempfile.gettempdir(), f"gridtrain-documents-{doc_bytes}-{total_bytes}-{seed}.jsonl")
    if os.path.exists(path):
        return path
    text = bytes(int(t) for t in builtin_bytes()[:total_bytes] if t < 128).decode("ascii")
    rng, start, lines = random.Random(seed), 0, []
    while start < len(text):
        n = rng.randint(doc_bytes // 2, 3 * doc_bytes // 2)
        lines.append(json.dumps({"text": text[start:start + n]}))
        start += n
    with open(path + ".part", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".part", path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = common.long_sequence_parser(__doc__, seq_len=2048, steps=5)
    parser.add_argument("--doc-bytes", type=int, default=512,
                        help="documents of N/2..3N/2 bytes cut from the built-in corpus (0: its files whole)")
    opts = parser.parse_args(argv)
    data = {"path": short_documents(opts.doc_bytes)} if opts.doc_bytes > 0 else {}
    try:
        sides = {side: (world, common.long_sequence_config(opts, world, parallel, document_mask=masked, **data))
                 for side, (world, parallel, masked) in SIDES.items()}
    except ConfigError as e:
        print(f"document_mask: error: {e}", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    print(common.long_sequence_header(opts))
    print(f"data: {data['path'] if data else 'the built-in corpus'}")
    measured = common.rounds_of_sides(sides, opts.rounds)
    print()
    print("| side | tokens/s (rounds) | vs the same layout without the mask (per round) | peak activations per rank |")
    print("| --- | --- | --- | --- |")
    for side, rounds in measured.items():
        each = [r[0]["tokens_per_s"] for r in rounds]
        tps = statistics.median(each)
        plain = side.removesuffix(", --document-mask")
        base_each = [r[0]["tokens_per_s"] for r in measured[plain]]
        base = statistics.median(base_each)
        ratios = ", ".join(f"{a / b:.2f}" for a, b in zip(each, base_each))
        peak = max(rank["peak_activation_bytes"] for r in rounds for rank in r)
        spread = f"{min(each):,.0f}-{max(each):,.0f}"
        print(f"| {side} | {tps:,.0f} ({spread}) | {tps / base:.2f}x ({ratios}) | {common.mib(peak)} |")
    print(f"\n1-minute load average: {load:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
