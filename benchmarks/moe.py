"""Mixture of experts: gridtrain's MoE layer against a plain loop over experts, against a
dense model of the same active parameters, and expert parallelism against replicated
experts.

One small Llama-MoE (RMSNorm, grouped-query attention with rotary positions, untied
head; every block's MLP a mixture of ``--n-experts`` SwiGLU experts ``--moe-ffn-hidden``
wide, top-``--moe-top-k`` routing with the weights renormalised, dropless, the
load-balancing loss on at ``--aux-loss-coeff``) is trained for a few steps in several
ways, alternating inside the same two gloo processes:

* ``gridtrain MoE``: the real training step, built by ``gridtrain.training.trainer.build``
  (``decoder_model_provider``, ``decoder_forward_step``) on a one-rank grid and stepped
  with ``Trainer.train_step``: each MoE layer routes (router, softmax, top-k), sorts the
  (token, expert) assignments by expert (one stable argsort), gathers their rows once,
  runs all experts at once on their contiguous rows as grouped GEMMs (``torch.
  _grouped_mm``: gate and up joined, then down; the weights read as strided views of
  the experts' packed parameters, no host read at ep 1) and adds the weighted outputs
  back with one ``index_add`` (``parallel/experts.py: dispatch_combine``); the
  load-balancing loss's gradient joins at the layer's output.
* ``loop MoE``: the same model, weights and trainer, with every MoE layer's ``forward``
  replaced (after the build) by the loop a first implementation writes, in the style of
  Hugging Face Mixtral's eager loop: the same router and top-k (``models.moe.route``),
  then for each expert, ``nonzero`` of the tokens that chose it, the expert on those
  rows, ``index_add_`` of weight x output into the tokens' rows (every expert runs, on
  zero rows if none chose it, as gridtrain's does: the gradient reducer expects every
  weight's gradient). Its load-balancing loss is the plain one (``E sum_e f_e P_e`` over
  the micro-batch's assignments and mean probabilities), joined to backward with
  ``experts.with_aux_loss`` at the trainer's per-step scale, as gridtrain's is: the
  same math, so its losses must equal ``gridtrain MoE``'s to fp32 rounding (checked).
* ``dense``: a dense Llama of the same shape whose SwiGLU MLP is ``k x --moe-ffn-hidden``
  wide: the same parameters per token as the MoE's active ones but the router's ``E x d``
  per layer (printed), the "what does MoE cost over the dense compute" reference.
  Its own weights; its losses are printed, not compared.
* ``gridtrain MoE dp 2 x ep 1``: ``train_step`` at dp 2 on the two processes, every rank
  holding every expert (gradients all-reduced over dp); the baseline of
* ``gridtrain MoE dp 2 x ep 2``: the same at ``--ep 2``: each rank holds half of each
  layer's experts; the rows of a token go to the ranks of its experts and back by two
  ``all_to_all_single`` with variable splits per layer (and two more in backward), the
  expert gradients are reduced over their expert-data-parallel group (here one rank:
  nothing), the rest over dp.

The three one-process sides run on rank 0 with every core's threads (``--ref-threads``)
while rank 1 waits in a barrier (``--no-reference`` skips them); the dp 2 sides use one
thread per rank. Every MoE side trains the same model on the same global batch: each
step is ``--microbatches`` global micro-batches of 2 x ``--micro-batch-size`` sequences
(the one-process sides take each whole; dp rank r takes its r-th half), so the routing
statistics behind the load-balancing loss, taken over a global micro-batch, are the same
on every side, and so are the losses: checked against ``gridtrain MoE``'s (``dp 2 x ep
1``'s without the one-process sides), with the gradient norms, within 1e-5 relative at
every step while the side routes every token as the reference does (the tokens per
expert of every layer, from each step's routing report; the loop side counts its own).
Routing is a discrete choice: once a router's top-k meets a near-tie that fp32 rounding
decides (the sides sum in different orders), one token goes to another expert and the
trajectories part for good; the step where that happens and the differences after it
are printed, not checked (at the default shape: the dp 2 sides from step 9, while the
model memorises the fixed batch).

A step is: the global token count, every micro-batch's forward and backward (mean token
cross entropy; the load-balancing loss's gradient per MoE layer), the gradient reduction,
the global gradient norm (``grad_clip = 0``: computed, not applied), AdamW (lr 1e-3,
betas (0.9, 0.95), weight decay 0.1). fp32, no dropout, no LR schedule, no data loading:
fixed random token ids (the same seed everywhere).

Timing (benchmarks/common.py): ``--warmup`` untimed steps per side (the last one also
counts each side's collective bytes per rank from its ``ctx.bytes``); then ``--repeats``
rounds, each timing ``--steps`` steps of every side in turn (the order reversed every
other round), between two barriers, with ``time.perf_counter`` on rank 0. Reported: two
tables, one for the one-process sides (tokens/s ratio to ``loop MoE`` and to ``dense``)
and one for the two-process sides (ratio to ``dp 2 x ep 1``, and to the one-process
``gridtrain MoE``); ratios are medians of the per-round ratios (> 1: the row is faster).
Also: the all-to-all bytes of the ep side per step and rank against the closed form
(summed over the two ranks: ``MoE layers x micro-batches x (4 x tokens x k x d x 4 B +
2 x E x 8 B)``: the rows out and back, forward and backward, plus the counts exchange),
the parameters (total and active) and model FLOPs per token of the MoE and the dense
model, the busiest expert's load at the last step, and the loss check.

Run from the repository root::

    python3 benchmarks/moe.py                # d 256, 4 layers, 8 experts top-2: ~2 min on 2 cores
    python3 benchmarks/moe.py --ref-threads 1   # steadier one-process rounds on a busy machine
    python3 benchmarks/moe.py --n-experts 64 --moe-top-k 8 --moe-ffn-hidden 128   # fine-grained, ~3 min
    python3 benchmarks/moe.py --no-reference  # the dp 2 sides only
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

import common  # benchmarks/common.py: the script's own folder is on sys.path
from common import Side, format_bytes, med
from gridtrain.config import Config, ModelConfig, ParallelConfig
from gridtrain.models.decoder import active_parameters, count_parameters, training_flops_per_token
from gridtrain.models.moe import MoE, route
from gridtrain.parallel.experts import with_aux_loss
from gridtrain.training.trainer import Trainer
from gridtrain.training.validate import validate

DP = 2
EP = 2
FP32_TOLERANCE = 1e-5  # relative, per step: the project's fp32 parity bound
ONE = "gridtrain MoE"
LOOP = "loop MoE"
DENSE = "dense"
EP1 = f"gridtrain MoE dp {DP} x ep 1"
EP2 = f"gridtrain MoE dp {DP} x ep {EP}"


# ---- the plain loop ---------------------------------------------------------------------------

def loop_forward(self: MoE, x: torch.Tensor) -> torch.Tensor:
    """A MoE layer's forward as a first implementation writes it: route, then one pass per
    expert over the tokens that chose it (bound to a gridtrain ``MoE`` as its ``forward``)."""
    cfg = self.cfg
    b, s, d = x.shape
    tokens = x.reshape(-1, d)
    probs, chosen, weights = route(self.router(tokens), cfg.moe_top_k, cfg.moe_norm_topk)
    out = torch.zeros_like(tokens)
    for e in range(cfg.n_experts):
        token, slot = (chosen == e).nonzero(as_tuple=True)  # the tokens that picked e, in token order
        rows = self.experts[str(e)](tokens[token])
        out.index_add_(0, token, rows * weights[token, slot, None])
    counts = torch.bincount(chosen.reshape(-1), minlength=cfg.n_experts)
    self.loop_counts = self.loop_counts + counts if hasattr(self, "loop_counts") else counts  # read by Setup.step
    if cfg.moe_aux_loss_coeff:
        f = counts.to(probs.dtype) / chosen.numel()
        aux = cfg.n_experts * (f * probs.mean(0)).sum()
        out = with_aux_loss(out, aux, cfg.moe_aux_loss_coeff * self.ep.aux_grad_scale)
    out = out.view(b, s, d)
    return out if self.shared is None else out + self.shared(x)


def use_loop(model: nn.Module) -> int:
    """Every MoE layer of ``model`` runs :func:`loop_forward`; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for m in layers:
        m.forward = types.MethodType(loop_forward, m)
    return len(layers)


# ---- the sides ------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class Setup(Side):
    trainer: Trainer
    batches: list[dict]
    kind: str  # "one" (one process, rank 0) or "two" (dp 2)
    losses: list[float] = field(default_factory=list)  # every step, warm-up included
    norms: list[float] = field(default_factory=list)
    comm: dict[str, int] = field(default_factory=dict)  # "kind group" -> bytes in the last warm-up step
    max_load: list[float] = field(default_factory=list)  # per MoE layer, at the last step
    routing: list[list[list[int]]] = field(default_factory=list)  # every step: assignments per layer and expert

    def step(self) -> None:
        out = self.trainer.train_step(self.batches)
        self.losses.append(out.loss)
        self.norms.append(out.grad_norm)
        looped = [m for m in self.trainer.model.modules() if isinstance(m, MoE) and hasattr(m, "loop_counts")]
        if looped:  # the loop side counts its own (gridtrain's routing log is not fed)
            self.routing.append([m.loop_counts.tolist() for m in looped])
            for m in looped:
                del m.loop_counts
        else:
            self.routing.append([r.tokens_per_expert for _, r in sorted(out.routing.items())])
            self.max_load = [r.max_load for _, r in sorted(out.routing.items())]


def one_process(cfg: Config, loop: bool = False) -> Trainer:
    """``common.build_gpt_one_process`` (its MoE layers take their routing statistics
    over rank 0's own tokens); with ``loop``, every MoE layer runs :func:`loop_forward`."""
    trainer = common.build_gpt_one_process(cfg)
    if loop and use_loop(trainer.model) != len(cfg.model.moe_layers):
        raise RuntimeError("the loop side did not replace every MoE layer")
    return trainer


def _worker(rank: int, world: int, opts: dict) -> dict:
    one = _config(opts, one=True)
    everything = common.random_batches(one, DP * opts["microbatches"] * opts["micro_batch_size"])
    half = opts["micro_batch_size"]
    mine = [{k: v[rank * half:(rank + 1) * half].contiguous() for k, v in b.items()} for b in everything]
    setups: list[Setup] = []
    if opts["reference"]:
        ref = dict(batches=everything, kind="one", active=rank == 0, threads=common.reference_threads(opts))
        setups.append(Setup(name=ONE, trainer=one_process(one), **ref))
        setups.append(Setup(name=LOOP, trainer=one_process(one, loop=True), **ref))
        setups.append(Setup(name=DENSE, trainer=one_process(_config(opts, one=True, dense=True)), **ref))
    for ep, name in ((1, EP1), (EP, EP2)):
        setups.append(Setup(name=name, trainer=common.build_gpt(_config(opts, ep=ep)), batches=mine, kind="two"))

    for s in setups:
        for i in range(opts["warmup"]):
            if i == opts["warmup"] - 1:
                s.trainer.ctx.bytes.reset()
            common.between_barriers(s, s.step)
        s.comm = {f"{k} {g}": n for (k, g), n in s.trainer.ctx.bytes.bytes.items() if n}

    def run_block(s: Setup, steps: int) -> tuple[float, None]:
        def run() -> None:
            for _ in range(steps):
                s.step()
        return common.between_barriers(s, run)

    common.timed_rounds(setups, opts, run_block)
    return {"setups": [{"name": s.name, "kind": s.kind, "active": s.active, "times": s.times, "losses": s.losses,
                        "norms": s.norms, "comm": s.comm, "max_load": s.max_load, "routing": s.routing}
                       for s in setups],
            "threads_per_rank": torch.get_num_threads()}


# ---- configuration --------------------------------------------------------------------------------

def _config(opts: dict, *, ep: int = 1, one: bool = False, dense: bool = False) -> Config:
    """The MoE (or ``dense``) model at dp 2 x ``ep``, or on one process (``one``: micro-batches
    of the whole global micro-batch)."""
    model = dict(arch="llama", tie_embeddings=False, layernorm_eps=1e-5, n_kv_head=opts["n_kv_head"])
    if dense:
        model["ffn_hidden"] = opts["moe_top_k"] * opts["moe_ffn_hidden"]
    else:
        model.update(n_experts=opts["n_experts"], moe_top_k=opts["moe_top_k"], moe_ffn_hidden=opts["moe_ffn_hidden"],
                     moe_aux_loss_coeff=opts["aux_loss_coeff"])
    mbs, m = opts["micro_batch_size"], opts["microbatches"]
    parallel = ParallelConfig(nproc=1, dp=1) if one else ParallelConfig(nproc=DP, dp=DP, ep=ep)
    return common.make_config(opts, parallel, model, micro_batch_size=DP * mbs if one else mbs,
                              global_batch_size=DP * m * mbs)


def _configs(opts: dict) -> Iterator[Config]:
    """The dp 2 configurations (``benchmark_main`` validates them at world size 2), once the
    one-process ones are validated here at world size 1 (a ConfigError from here is reported
    by ``benchmark_main`` as from its own checks)."""
    if opts["reference"]:
        for dense in (False, True):
            validate(_config(opts, one=True, dense=dense), world_size=1)
    yield _config(opts, ep=1)
    yield _config(opts, ep=EP)


# ---- report ----------------------------------------------------------------------------------------

def a2a_closed_form(opts: dict) -> int:
    """All-to-all bytes per step of the dp 2 x ep 2 side, summed over both ranks: per MoE
    layer and micro-batch, the global micro-batch's rows out and back, forward and backward
    (4 x tokens x k x d fp32 values), and each rank's counts (E int64)."""
    tokens = DP * opts["micro_batch_size"] * opts["seq_len"]
    per = 4 * tokens * opts["moe_top_k"] * opts["d_model"] * 4 + EP * opts["n_experts"] * 8
    return opts["n_layer"] * opts["microbatches"] * per


def _ratio(rows: list[dict], r: dict, base: str) -> str:
    peer = next((x for x in rows if x["name"] == base), None)
    if peer is None:
        return ""
    return "1.00x" if r is peer else f"{common.paired_ratio(peer['times'], r['times']):.2f}x"


def _comm(c: dict[str, int]) -> str:
    return ", ".join(f"{k} {format_bytes(n)}" for k, n in sorted(c.items())) or "none"


def report(run: common.Run, opts: dict) -> str:
    r0, r1 = (res["setups"] for res in run.results)
    mbs, m, seq, k = opts["micro_batch_size"], opts["microbatches"], opts["seq_len"], opts["moe_top_k"]
    tokens = DP * m * mbs * seq
    moe, dense = _config(opts, ep=1).model, _config(opts, ep=1, dense=True).model
    threads = common.reference_threads(opts)
    lines = common.header(
        run, opts,
        shape=f"Llama-MoE, {opts['n_layer']} layers (all MoE), d_model {opts['d_model']}, {opts['n_head']} heads "
              f"({moe.kv_heads} kv), seq {seq}, vocab 257, {opts['n_experts']} experts top-{k} "
              f"(renormalised, dropless), expert width {opts['moe_ffn_hidden']}, load-balancing loss "
              f"{opts['aux_loss_coeff']:g}; dense: SwiGLU width {dense.ffn_size} (= {k} x {opts['moe_ffn_hidden']}); "
              f"fp32; global batch {m} global micro-batches x {DP * mbs} sequences = {tokens:,} tokens/step "
              f"(dp ranks: {m} x {mbs} sequences each)",
        threads=f"gloo; the one-process sides on rank 0 with {threads} torch thread(s) while rank 1 waits in a "
                f"barrier, the dp {DP} sides {run.results[0]['threads_per_rank']} thread(s) per rank")

    def table(kind: str, ratios: list[tuple[str, str]]) -> list[str]:
        rows = [r for r in r0 if r["kind"] == kind]
        head = "| side | tokens/s | step ms | best step ms |" + "".join(f" {t} |" for t, _ in ratios)
        out = [head, "| --- | ---: | ---: | ---: |" + " ---: |" * len(ratios)]
        for r in rows:
            t = med(r["times"])
            cells = "".join(f" {_ratio(r0, r, base)} |" for _, base in ratios)
            out.append(f"| {r['name']} | {tokens / t:,.0f} | {t * 1e3:.1f} | {min(r['times']) * 1e3:.1f} |{cells}")
        return out

    has_one = any(r["kind"] == "one" for r in r0)
    if has_one:
        lines += [f"One process ({threads} threads on rank 0):", *table("one", [("vs loop MoE", LOOP),
                                                                              ("vs dense", DENSE)]), ""]
    lines += [f"Two processes (dp {DP}, one thread each):",
              *table("two", [("vs ep 1", EP1)] + ([("vs gridtrain MoE 1 process", ONE)] if has_one else [])), "",
              "ratios: tokens/s of the row / tokens/s of the column's side, the median of the per-round ratios "
              "(> 1: the row is faster)"]

    # the ep side's all-to-all bytes, and every dp 2 side's collectives per rank
    by_name = [{r["name"]: r for r in res} for res in (r0, r1)]
    a2a = [by[EP2]["comm"].get("all_to_all ep", 0) for by in by_name]
    closed = a2a_closed_form(opts)
    lines.append(f"{EP2} all-to-all bytes per step (ctx.bytes, group ep, rows sent incl. a rank's own): rank 0 "
                 f"{format_bytes(a2a[0])}, rank 1 {format_bytes(a2a[1])}; sum {sum(a2a):,} B (closed form "
                 f"{closed:,} B: {'match' if sum(a2a) == closed else 'MISMATCH'})")
    lines.append("collective bytes per step and rank (last warm-up step; rank 0 / rank 1):")
    for name in (EP1, EP2):
        lines.append(f"  {name}: {_comm(by_name[0][name]['comm'])} / {_comm(by_name[1][name]['comm'])}")

    total, active = count_parameters(moe), active_parameters(moe)
    router = len(moe.moe_layers) * opts["n_experts"] * opts["d_model"]
    dense_total = count_parameters(dense)
    lines += [
        f"parameters: MoE {total:,} ({active:,} active per token), dense {dense_total:,} (active MoE - dense = "
        f"{active - dense_total:,}: the routers' {router:,}); model FLOPs per token (training) MoE "
        f"{training_flops_per_token(moe) / 1e6:.1f} M, dense {training_flops_per_token(dense) / 1e6:.1f} M",
    ]
    routed = next((r for r in r0 if r["name"] in (ONE, EP1) and r["max_load"]), None)
    if routed is not None:
        lines.append(f"busiest expert over the mean at the last step ({routed['name']}), per layer: "
                     + ", ".join(f"{x:.2f}" for x in routed["max_load"]))
    lines += common.per_round("tokens/s per round:", ((r["name"], r["times"]) for r in r0),
                              lambda t: f"{tokens / t:,.0f}")
    lines += loss_check(r0, opts)
    return "\n".join(lines + common.footer(run))


def loss_check(rows: list[dict], opts: dict) -> list[str]:
    """Every MoE side trains the same model from the same weights on the same global
    micro-batches: its losses must agree with the reference's at every step while it
    routes every token as the reference does. Once a router's top-k meets a near-tie that
    fp32 rounding decides (the sides sum in different orders), one token goes to another
    expert and the trajectories part for good: from that step on, the difference is
    printed, not checked. A side whose routing differs from the first step fails."""
    ref = next(r for r in rows if r["name"] == (ONE if any(x["name"] == ONE for x in rows) else EP1))

    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(b), 1e-30)

    lines, verdicts = [], []
    for r in rows:
        if r is ref or r["name"] == DENSE:
            continue
        same = next((i for i, (a, b) in enumerate(zip(r["routing"], ref["routing"])) if a != b), len(ref["losses"]))
        loss = max((rel(a, b) for a, b in zip(r["losses"][:same], ref["losses"])), default=float("nan"))
        norm = max((rel(a, b) for a, b in zip(r["norms"][:same], ref["norms"])), default=float("nan"))
        ok = loss <= FP32_TOLERANCE and norm <= FP32_TOLERANCE  # False for a NaN (nothing compared) too
        verdicts.append(ok)
        text = f"  {r['name']}: steps 1-{same} routed alike, largest loss difference {loss:.1e}" + \
            (" (bit for bit)" if loss == 0 else "") + f", gradient norm {norm:.1e}"
        if same < len(ref["losses"]):
            after = [rel(a, b) for a, b in zip(r["losses"][same:], ref["losses"][same:])]
            text += f"; routing first differs at step {same + 1}, the losses then by {after[0]:.1e} " \
                    f"(largest {max(after):.1e} by the last step)"
        lines.append(text)
    timed = opts["repeats"] * opts["steps"]
    lines.insert(0, f"loss check over {len(ref['losses'])} steps ({opts['warmup']} warm-up + {timed} timed), every "
                    f"MoE side against {ref['name']} while its routing is the same (tokens per expert, every "
                    f"layer): {'AGREE' if all(verdicts) else 'DISAGREE'} (bound {FP32_TOLERANCE:g} relative)")
    lines.append(f"  {ref['name']} losses: first {ref['losses'][0]:.6f}, last {ref['losses'][-1]:.6f}")
    dense = next((r for r in rows if r["name"] == DENSE), None)
    if dense is not None:
        lines.append(f"  {DENSE} losses (another model): first {dense['losses'][0]:.6f}, "
                     f"last {dense['losses'][-1]:.6f}")
    return lines


def parse_args(argv: list[str] | None = None) -> dict:
    p = common.benchmark_parser(__doc__, steps=2, warmup=2, repeats=8)
    p.set_defaults(d_model=256, n_layer=4, n_head=4)
    p.add_argument("--n-kv-head", type=int, default=None, help="key/value heads (default: --n-head)")
    p.add_argument("--microbatches", type=int, default=2,
                   help="global micro-batches per step (default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=4,
                   help=f"sequences per micro-batch of a dp rank; the one-process sides take micro-batches of "
                        f"{DP} x this, a whole global micro-batch (default: %(default)s)")
    p.add_argument("--n-experts", type=int, default=8, help="experts per MoE layer (default: %(default)s)")
    p.add_argument("--moe-top-k", type=int, default=2, help="experts per token (default: %(default)s)")
    p.add_argument("--moe-ffn-hidden", type=int, default=512, help="each expert's width (default: %(default)s)")
    p.add_argument("--aux-loss-coeff", type=float, default=ModelConfig.moe_aux_loss_coeff,
                   help="load-balancing loss coefficient, both sides (default: %(default)s, gridtrain's)")
    opts = common.parse(p, argv, "microbatches", "micro_batch_size", "n_experts", "moe_top_k", "moe_ffn_hidden")
    if opts["aux_loss_coeff"] < 0:
        p.error("--aux-loss-coeff must be >= 0")
    return opts


def main(argv: list[str] | None = None) -> int:
    return common.benchmark_main("moe", argv, parse_args, _configs, DP, _worker, report)


if __name__ == "__main__":
    sys.exit(main())
