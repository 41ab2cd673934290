"""Long sequences on 2 CPU cores: context parallelism (cp 2, ring and all-gather) against one
process and against tensor parallelism (tp 2 + SP) at the same sequence length.

Every side is the whole ``gridtrain train`` loop (``pretrain`` with the built-in corpus and
providers, as the command runs it): a small GPT at ``--seq-len`` (default 8192), one
sequence per micro-batch, the same global batch and seed everywhere. The one-process side
runs with every core's threads, the two-rank sides with one thread per rank, as
``gridtrain train --nproc 2`` gives them. The sides run in turn, the order reversed
every other round; per side, the median over rounds of:

* tokens/s: the median step after the first (the run's own step timer);
* peak activation bytes per rank: bytes held for backward at once during step 1 (the
  saved-tensor meter of ``--memory-report``);
* for cp: the share of the attention's transfer time hidden behind attention and the
  milliseconds of it exposed per step (the run's own timers, ``context_parallel.TransferTimes``);
* bytes each rank moves per step, by group (counted).

    python3 benchmarks/cp_long_context.py                        # ~6 min on 2 CPU cores
    python3 benchmarks/cp_long_context.py --seq-len 16384 --rounds 1
"""

from __future__ import annotations

import os
import statistics
import sys

import common  # benchmarks/common.py: the script's own folder is on sys.path
from gridtrain.config import ConfigError

SIDES = {  # name -> (world size, parallel fields)
    "one process": (1, {}),
    "tp 2 + SP": (2, dict(tp=2, sequence_parallel=True)),
    "cp 2 ring": (2, dict(cp=2, cp_comm="ring")),
    "cp 2 allgather": (2, dict(cp=2, cp_comm="allgather")),
}


def main(argv: list[str] | None = None) -> int:
    opts = common.long_sequence_parser(__doc__, seq_len=8192, steps=4).parse_args(argv)
    try:
        sides = {side: (world, common.long_sequence_config(opts, world, parallel))
                 for side, (world, parallel) in SIDES.items()}
    except ConfigError as e:
        print(f"cp_long_context: error: {e}", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    print(common.long_sequence_header(opts))
    measured = common.rounds_of_sides(sides, opts.rounds)
    base = statistics.median(r[0]["tokens_per_s"] for r in measured["one process"])
    tp = statistics.median(r[0]["tokens_per_s"] for r in measured["tp 2 + SP"])
    print()
    print("| side | tokens/s | vs one process | vs tp 2 + SP | peak activations per rank | hidden cp transfer "
          "| exposed cp ms/step | bytes per step per rank |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for side, rounds in measured.items():
        tps = statistics.median(r[0]["tokens_per_s"] for r in rounds)
        peak = max(rank["peak_activation_bytes"] for r in rounds for rank in r)
        overlap = [o for r in rounds for rank in r for o in rank["cp_overlap"]] if "cp" in SIDES[side][1] else []
        hidden = f"{100 * statistics.mean(h for h, _ in overlap):.0f}%" if overlap else "-"
        exposed = f"{1000 * statistics.mean(e for _, e in overlap):.0f}" if overlap else "-"
        moved = ", ".join(f"{g} {common.mib(n)}" for g, n in sorted(rounds[-1][0]["bytes"].items())) or "-"
        print(f"| {side} | {tps:,.0f} | {tps / base:.2f}x | {tps / tp:.2f}x | {common.mib(peak)} | {hidden} | "
              f"{exposed} | {moved} |")
    print(f"\n1-minute load average: {load:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
