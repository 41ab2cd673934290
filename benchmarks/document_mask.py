"""What ``--document-mask`` costs: the whole ``gridtrain train`` loop with and without it,
side by side, in one process and on cp 2 (ring), at one sequence length.

Every side is ``pretrain`` with the built-in corpus and providers, as the command runs
it: a small GPT at ``--seq-len`` (default 2048), one sequence per micro-batch, the same
global batch and seed everywhere; the one-process sides with every core's threads, the
cp sides with one thread per rank (as ``gridtrain train --nproc 2`` gives them). With
the mask each window's documents are those of the corpus (the built-in corpus's files
are long, so a window holds one to a few), and the mask's cost does not depend on how
many there are: the attention reads a ``[b, s, s]`` boolean mask instead of running
the causal kernel (one process: torch's ``scaled_dot_product_attention`` with
``attn_mask``; cp: every chunk pair through the matrix-product block kernel with its
mask, instead of torch's fused CPU kernel). The sides run in turn, the order reversed
every other round; per side, the median over rounds of the run's tokens/s (median step
after the first) and the peak bytes saved for backward per rank at step 1.

    python3 benchmarks/document_mask.py                   # ~1 min on 2 CPU cores
    python3 benchmarks/document_mask.py --seq-len 4096 --rounds 1
"""

from __future__ import annotations

import os
import statistics
import sys

import common  # benchmarks/common.py: the script's own folder is on sys.path
from gridtrain.config import ConfigError

SIDES = {  # name -> (world size, parallel fields, document mask)
    "one process": (1, {}, False),
    "one process, --document-mask": (1, {}, True),
    "cp 2 ring": (2, dict(cp=2, cp_comm="ring"), False),
    "cp 2 ring, --document-mask": (2, dict(cp=2, cp_comm="ring"), True),
}


def main(argv: list[str] | None = None) -> int:
    opts = common.long_sequence_parser(__doc__, seq_len=2048, steps=5).parse_args(argv)
    try:
        sides = {side: (world, common.long_sequence_config(opts, world, parallel, document_mask=masked))
                 for side, (world, parallel, masked) in SIDES.items()}
    except ConfigError as e:
        print(f"document_mask: error: {e}", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    print(common.long_sequence_header(opts))
    measured = common.rounds_of_sides(sides, opts.rounds)
    print()
    print("| side | tokens/s | vs the same layout without the mask | peak activations per rank |")
    print("| --- | --- | --- | --- |")
    for side, rounds in measured.items():
        tps = statistics.median(r[0]["tokens_per_s"] for r in rounds)
        plain = side.removesuffix(", --document-mask")
        base = statistics.median(r[0]["tokens_per_s"] for r in measured[plain])
        peak = max(rank["peak_activation_bytes"] for r in rounds for rank in r)
        print(f"| {side} | {tps:,.0f} | {tps / base:.2f}x | {common.mib(peak)} |")
    print(f"\n1-minute load average: {load:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
