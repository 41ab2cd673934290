"""The planner against Narayanan et al. 2021 (Megatron-LM, PTD-P), Tables 1 and 2 only
(gridtrain/planner/published.py): each published run's own layout predicted on the
``a100-80gb`` machine, predicted beside published TFLOP/s per GPU, and the layouts the
planner ranks first for the same model, GPU count and batch beside the paper's. A
prediction from the cost model, not a measurement; no process is started.

    python3 benchmarks/planner_published.py                 # every row, paper-feature search
    python3 benchmarks/planner_published.py --search none   # the predictions alone (~30 s)
    python3 benchmarks/planner_published.py --search all    # also gridtrain's newer options (slow)
    python3 benchmarks/planner_published.py --score-passes 2,3   # sensitivity: Megatron's fused softmax
    python3 benchmarks/planner_published.py --attention sdpa     # sensitivity: a fused attention kernel

The paper's settings (section 5.1; ``published.py``): sequence 2048, vocabulary 51,200,
16-bit mixed precision (fp16 here: the authors' scripts pass ``--fp16``), full activation
recomputation, GPT-2-shaped models (4h MLP, learned positions, tied embeddings). What the
paper does not state is taken from the scripts its authors published to reproduce it,
NVIDIA/Megatron-LM ``examples/sc21/run_table_1.sh`` and ``run_figure_12.sh`` ("scripts
that were used to produce the results in the Megatron paper", ``examples/sc21/README.md``):

* micro-batch size per Table 1 row: 16, 16, 16, 8, 4, 2, 2, 1, 1, 1 (Table 2 prints 1 for
  every PTD-P row);
* the interleaved schedule's chunks per stage (``--num-layers-per-virtual-pipeline-stage``):
  76.1B 5 layers of 15 (v = 3), 145.6B 5 of 10 (v = 2), 310.1B 3 of 6 (v = 2), 529.6B 1 of
  3 (v = 3); the 39.1B and 1T runs pass no chunking (v = 1, plain 1F1B), the p = 1 runs
  have no pipeline. Table 2's 529.6B rows are Table 1 row 9's model and split (v = 3); its
  175B rows take Figure 12's setting for the same model and split (t 8, p 12, 2 layers
  per chunk: v = 4), an assumption: Table 2 does not say.
* dropout 0.1 on hidden states and attention probabilities: Megatron-LM's default, which
  the scripts do not change;
* the attention core op by op (gridtrain's ``--attention math``): Megatron-LM of 2021 ran
  the two batched GEMMs and a fused scale-mask-softmax kernel with the ``s x s`` scores in
  memory (there was no fused attention kernel); ``--score-passes`` sets the cost model's
  passes over the scores (default gridtrain's op-by-op 7 forward and 5 backward, Megatron's
  fused kernel makes about 2 and 3).

TFLOP/s are hardware FLOPs, the paper's equation (3) (recomputation's extra forward
counted), per GPU: ``Prediction.hardware_tflops_per_gpu``. Table 2's ZeRO-3 rows
(DeepSpeed, no model parallelism) are listed but not predicted: gridtrain has no ZeRO-3
and the planner does not model it.

The search for the planner's own pick: ``--search paper`` (default) searches t, p, v and
the micro-batch size with the paper's features (full recomputation, 1F1B or interleaved
1F1B, no sequence parallelism, no ZeRO); ``--search all`` adds what gridtrain has beyond
them (selective or no recomputation, ZB-H1, GPipe, SP, ZeRO-1), which is slow at 1000+
GPUs (thousands of layouts, each's memory from the dry run's closed forms).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from gridtrain.config import ModelConfig
from gridtrain.planner import cost, published
from gridtrain.planner.cost import Job, Layout, Prediction, predict
from gridtrain.planner.machine import machine
from gridtrain.planner.search import Fixed, layouts, search

HARDWARE = "a100-80gb"
DTYPE = "fp16"
WITHIN = 0.15
# the authors' examples/sc21 scripts: micro-batch size, and layers per virtual stage (None: not interleaved)
SC21_TABLE1 = {1.7: (16, None), 3.6: (16, None), 7.5: (16, None), 18.4: (8, None), 39.1: (4, None), 76.1: (2, 5),
               145.6: (2, 5), 310.1: (1, 3), 529.6: (1, 1), 1008.0: (1, None)}
SC21_TABLE2_LAYERS_PER_CHUNK = {174.6: 2, 529.6: 1}  # run_figure_12.sh (175B), run_table_1.sh row 9 (530B)
SC21_SOURCE = ("NVIDIA/Megatron-LM examples/sc21/run_table_1.sh (commit cf547dea839f709ec2f147da0679d663da3c20da) "
               "and run_figure_12.sh (commit f010997311b62da855e6c1263bcefa2a0187eb28)")


@dataclasses.dataclass(frozen=True)
class Row:
    label: str  # "T1 r1"
    source: str
    params_billion: float
    heads: int
    hidden: int
    layers: int
    gpus: int
    batch: int
    published_tflops: float
    layout: Layout | None  # None: not predicted (ZeRO-3)
    note: str = ""

    def model(self, attention: str = "math") -> ModelConfig:
        return ModelConfig(n_layer=self.layers, n_head=self.heads, d_model=self.hidden,
                           seq_len=published.SEQUENCE_LENGTH, vocab_size=published.VOCAB_SIZE, dropout=0.1,
                           attention=attention)


def paper_layout(t: int, p: int, gpus: int, mbs: int, layers_per_chunk: int | None, layers: int) -> Layout:
    v = layers // p // layers_per_chunk if layers_per_chunk else 1
    return Layout(dp=gpus // (t * p), tp=t, pp=p, vpp=v, micro_batch_size=mbs,
                  schedule="interleaved-1f1b" if v > 1 else "1f1b", recompute="full")


def rows() -> list[Row]:
    out = []
    for i, r in enumerate(published.TABLE1, 1):
        mbs, per_chunk = SC21_TABLE1[r.params_billion]
        out.append(Row(f"T1 r{i}", r.source, r.params_billion, r.attention_heads, r.hidden_size, r.num_layers,
                       r.num_gpus, r.batch_size, r.tflops_per_gpu,
                       paper_layout(r.tensor_parallel, r.pipeline_parallel, r.num_gpus, mbs, per_chunk, r.num_layers)))
    for i, r in enumerate(published.TABLE2, 1):
        arch = published.TABLE2_ARCHITECTURES[r.params_billion]
        lay = None if r.scheme == "zero3" else paper_layout(
            r.tensor_parallel, r.pipeline_parallel, r.num_gpus, r.microbatch_size,
            SC21_TABLE2_LAYERS_PER_CHUNK[r.params_billion], arch["num_layers"])
        out.append(Row(f"T2 r{i}", r.source, r.params_billion, arch["attention_heads"], arch["hidden_size"],
                       arch["num_layers"], r.num_gpus, r.batch_size, r.tflops_per_gpu, lay,
                       "ZeRO-3, micro-batch %d: not modelled" % r.microbatch_size if lay is None else ""))
    return out


def name(lay: Layout) -> str:
    return (f"t{lay.tp} p{lay.pp} d{lay.dp}" + (f" v{lay.vpp}" if lay.vpp > 1 else "") + f" mb{lay.micro_batch_size}"
            + ("" if lay.schedule in ("1f1b", "interleaved-1f1b") else f" {lay.schedule}")
            + ("" if lay.recompute == "full" else f" rc-{lay.recompute}")
            + (" SP" if lay.sequence_parallel else "") + (" Z1" if lay.zero else ""))


def planner_picks(job: Job, gpus: int, mode: str, top: int) -> list[Prediction]:
    """The planner's best layouts: with the paper's features (both of its schedules
    searched, merged) or with everything gridtrain offers."""
    if mode == "all":
        return search(job, gpus, top=top)
    found = []
    for schedule in ("1f1b", "interleaved-1f1b"):
        found += search(job, gpus, PAPER_FEATURES[schedule], top=3 * top)
    found.sort(key=lambda p: (not p.fits, p.step_time_s))
    unique, seen = [], set()
    for p in found:  # interleaving with one chunk is 1F1B: keep each layout once
        key = dataclasses.replace(p.layout, schedule="1f1b") if p.layout.vpp == 1 else p.layout
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique[:top]


PAPER_FEATURES = {s: Fixed(schedule=s, recompute="full", sequence_parallel=False, zero=0)
                  for s in ("1f1b", "interleaved-1f1b")}


def searched(job: Job, gpus: int, lay: Layout, mode: str) -> bool:
    """Whether ``lay`` is among the layouts the search considers."""
    if mode == "all":
        return lay in layouts(job, gpus)
    return any(lay in layouts(job, gpus, fixed) for fixed in PAPER_FEATURES.values())


def evaluate(row: Row, mode: str, top: int, passes: tuple[int, int] | None, attention: str = "math") -> dict:
    if passes:
        cost.SCORE_PASSES_FORWARD, cost.SCORE_PASSES_BACKWARD = passes
    started = time.perf_counter()
    out = {"row": row}
    if row.layout is None:
        return out
    job = Job(row.model(attention), row.batch, machine(HARDWARE), DTYPE)
    out["paper"] = predict(job, row.layout)
    if mode != "none":
        out["picks"] = planner_picks(job, row.gpus, mode, top)
        out["searched"] = searched(job, row.gpus, row.layout, mode)
    out["seconds"] = time.perf_counter() - started
    print(f"  {row.label}: {out['seconds']:.0f} s", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--search", choices=("paper", "all", "none"), default="paper",
                    help="the planner's own pick: the paper's features (default), all of gridtrain's, or none")
    ap.add_argument("--top", type=int, default=3, help="planner layouts per row (default 3)")
    ap.add_argument("--rows", help="comma-separated labels, e.g. 'T1 r1,T2 r7' (default: all)")
    ap.add_argument("--score-passes", help="F,B passes over the attention scores (default: cost.py's)")
    ap.add_argument("--attention", choices=("math", "sdpa"), default="math",
                    help="the attention core: op by op as Megatron-LM ran it (default) or torch's fused kernel")
    ap.add_argument("--jobs", type=int, default=1, help="rows evaluated in parallel processes (default 1)")
    args = ap.parse_args(argv)
    passes = tuple(int(x) for x in args.score_passes.split(",")) if args.score_passes else None
    if passes:
        cost.SCORE_PASSES_FORWARD, cost.SCORE_PASSES_BACKWARD = passes
    todo = rows()
    if args.rows:
        wanted = {x.strip() for x in args.rows.split(",")}
        todo = [r for r in todo if r.label in wanted]
    hw = machine(HARDWARE)
    print(f"planner vs {published.PAPER_TITLE} (arXiv:{published.ARXIV_ID}), Tables 1 and 2")
    print(f"machine {HARDWARE}: peak {hw.peak_flops(DTYPE) / 1e12:.0f} TFLOP/s {DTYPE}, gemm_efficiency "
          f"{hw.gemm_efficiency}, gemm_half {hw.gemm_half}, kernel_s {hw.kernel_s}, HBM {hw.memory_bandwidth / 1e9:.0f}"
          f" GB/s, NVLink {hw.nvlink.bandwidth / 1e9:.0f} GB/s, network {hw.network.bandwidth / 1e9:.0f} GB/s per GPU")
    print(f"cost.py: ELEMENTWISE_PASSES {cost.ELEMENTWISE_PASSES}, KERNELS_PER_BLOCK {cost.KERNELS_PER_BLOCK}, "
          f"SCORE_PASSES forward {cost.SCORE_PASSES_FORWARD} backward {cost.SCORE_PASSES_BACKWARD}")
    print(f"settings: seq {published.SEQUENCE_LENGTH}, vocab {published.VOCAB_SIZE}, {DTYPE}, full recomputation, "
          f"dropout 0.1, attention {args.attention}; micro-batch and chunks from {SC21_SOURCE}")
    started = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(evaluate, todo, [args.search] * len(todo), [args.top] * len(todo),
                                    [passes] * len(todo), [args.attention] * len(todo)))
    else:
        results = [evaluate(r, args.search, args.top, passes, args.attention) for r in todo]

    print("\n| row | model | GPUs | batch | paper's layout (t p d v mb) | published TFLOP/s | predicted | ratio |"
          " step s | compute | TP comm | bubble | DP exposed | memory GB |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    ratios = []
    for res in results:
        r = res["row"]
        if "paper" not in res:
            print(f"| {r.label} | {r.params_billion}B | {r.gpus} | {r.batch} | - | {r.published_tflops:g} | - | - |"
                  f" | | | | | {r.note} |")
            continue
        p = res["paper"]
        ratio = p.hardware_tflops_per_gpu / r.published_tflops
        ratios.append((r.label, ratio))
        flag = "" if abs(ratio - 1) <= WITHIN else " **outside 15%**"
        print(f"| {r.label} | {r.params_billion}B | {r.gpus} | {r.batch} | {name(p.layout)} | {r.published_tflops:g} |"
              f" {p.hardware_tflops_per_gpu:.1f} | {ratio:.3f}{flag} | {p.step_time_s:.2f} | {p.compute_s:.2f} |"
              f" {p.tp_comm_s:.2f} | {p.bubble_s:.2f} | {p.dp_exposed_s:.2f} | {p.memory_bytes / 1e9:.1f}"
              f"{'' if p.fits else ' (does not fit)'} |")
    if ratios:
        values = [x for _, x in ratios]
        inside = sum(abs(x - 1) <= WITHIN for x in values)
        print(f"\npredicted / published: {min(values):.3f} to {max(values):.3f}, mean {sum(values) / len(values):.3f};"
              f" {inside} of {len(values)} rows within {WITHIN:.0%}")

    if args.search != "none":
        what = "the paper's features" if args.search == "paper" else "all of gridtrain's options"
        print(f"\nplanner's top layouts ({what}) beside the paper's; 'vs paper' = the paper layout's predicted step"
              " / this layout's (above 1: the planner's is predicted faster)")
        print("| row | paper's layout | in the searched space | planner #1 | #2 | #3 | #1 model TFLOP/s | #1 vs paper |")
        print("| --- | --- | --- | --- | --- | --- | ---: | ---: |")
        for res in results:
            if "picks" not in res:
                continue
            r, p, picks = res["row"], res["paper"], res["picks"]
            cells = [name(x.layout) + ("" if x.fits else " (no fit)") for x in picks] + [""] * (3 - len(picks))
            best = picks[0] if picks else None
            print(f"| {r.label} | {name(p.layout)} | {'yes' if res['searched'] else 'no'} | " + " | ".join(cells[:3])
                  + (f" | {best.model_tflops_per_gpu:.1f} | {p.step_time_s / best.step_time_s:.3f} |" if best else " | | |"))
    print(f"\nwall time {time.perf_counter() - started:.0f} s"
          + "".join(f"; {res['row'].label} {res['seconds']:.0f} s" for res in results if res.get("seconds", 0) > 30))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
