"""``gridtrain plan``: the best layouts for N GPUs, each with its predicted step, memory
and the command that runs it."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Callable

from gridtrain.config import (FP8_RECIPES, OPTIMIZERS, PRESETS, STATE_DTYPES, ConfigError, ModelConfig, declared_fields,
                              flag_of, load_config)
from gridtrain.planner import fp8
from gridtrain.planner.cost import MEMORY_PARTS, Job, Prediction
from gridtrain.planner.machine import MACHINES, machine
from gridtrain.planner.search import CP_COMM, RECOMPUTE, SCHEDULES, ZERO, Fixed, search, why_none

def _model_fields() -> list[dataclasses.Field]:
    """The model fields ``train`` has a flag for: each is a ``plan`` flag too, so any shape
    a run can state a plan can (the sequence length is plan's own, required)."""
    return [f for section, f in declared_fields() if section == "model" and flag_of(f) and f.name != "seq_len"]


def add_plan_parser(sub, field_flag: Callable[[argparse.ArgumentParser, str, dataclasses.Field], None]) -> None:
    """``field_flag(parser, section, field)`` adds a declared field's flag as ``train`` does."""
    p = sub.add_parser("plan", help="choose the layout for N GPUs: predicted step time and memory")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the job")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: the hardware's (8)")
    p.add_argument("--hardware", required=True, help=f"{' | '.join([*MACHINES, 'cpu'])} (cpu: profiled here)")
    p.add_argument("--model", help=f"preset: {', '.join(PRESETS)}")
    m = p.add_argument_group("model", "a preset's fields, or a whole shape without --model (the flags of train)")
    for f in _model_fields():
        field_flag(m, "model", f)
    m.add_argument("--ffn-size", dest="ffn_hidden", type=int, help=argparse.SUPPRESS)  # --ffn-hidden's old name
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS,
                   help="adamw | muon: its state (memory) and its step (Muon: Newton-Schulz and the exchange)")
    p.add_argument("--optimizer-state-dtype", default="fp32", choices=STATE_DTYPES,
                   help="the moments' dtype (bf16: 2 bytes an element)")
    p.add_argument("--optimizer-offload", action="store_true",
                   help="the optimizer's state in host memory: none on the GPU (its copies are not costed)")
    p.add_argument("--fp8", default="none", choices=FP8_RECIPES, metavar="none|tensorwise|rowwise",
                   help="float8 GEMMs in the blocks' linear layers, as train's --fp8 (needs --dtype bf16 and FP8 "
                        "Tensor Cores: h100-sxm, h200)")
    p.add_argument("--fp8-all-gather", action="store_true",
                   help="with --fp8: ZeRO-3 layouts gather the float8 weights as float8 (half the bytes)")
    g = p.add_argument_group("layout", "given fields are fixed; the others are searched")
    g.add_argument("--tp", type=int)
    g.add_argument("--cp", type=int, help="context parallel: ranks that split each sequence (1: none)")
    g.add_argument("--cp-comm", choices=CP_COMM, help="how the cp ranks' attention exchanges keys and values")
    g.add_argument("--ep", type=int, help="expert parallel: ranks that split each MoE layer's experts (1: none); "
                                          "ep x etp divides tp x cp x dp (folded over tp where it does not divide "
                                          "dp x cp)")
    g.add_argument("--etp", type=int, help="expert tensor parallel: ranks that split each expert's MLP (1: none)")
    g.add_argument("--pp", type=int)
    g.add_argument("--vpp", type=int)
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--recompute", choices=RECOMPUTE)
    g.add_argument("--sequence-parallel", action="store_true", default=None)
    g.add_argument("--zero", type=int, choices=ZERO, help="ZeRO stage (0-3)")
    g.add_argument("--zero-shard-size", type=int, metavar="N",
                   help="ZeRO shards within groups of N dp (x cp) ranks, replicated across them (HSDP)")
    g.add_argument("--zero3-keep-gathered", action="store_true", default=None,
                   help="ZeRO-3 keeps a stage's parameters gathered through the step")
    g.add_argument("--schedule", choices=SCHEDULES)
    p.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    p.add_argument("--json", action="store_true", help="print the layouts as JSON")
    p.add_argument("--explain", metavar="FILE.png", nargs="?", const="",
                   help="print why the first layout beats the runner-up, part by part; with FILE.png also draw "
                        "the top layouts' breakdowns")
    p.add_argument("--measure", action="store_true",
                   help="with --hardware cpu: run the top layouts here for a few steps, measured beside predicted")
    p.add_argument("--measure-steps", type=int, default=6, help="steps per measured run (default 6)")


def _value(args: argparse.Namespace, f: dataclasses.Field):
    """The value the field's flag gave (None: not given); the flag's name is its dest, as in ``train``."""
    return getattr(args, flag_of(f)[2:].replace("-", "_"), None)


def _given(args: argparse.Namespace) -> dict[str, object]:
    return {f.name: _value(args, f) for f in _model_fields() if _value(args, f) is not None}


def model_of(args: argparse.Namespace) -> ModelConfig:
    given = _given(args)
    if not args.model:
        missing = [f"--{k.replace('_', '-')}" for k in ("n_layer", "d_model", "n_head", "vocab_size") if k not in given]
        if missing:
            raise ConfigError(f"plan: no model: pass --model PRESET or {' '.join(missing)}")
    model = load_config(None, {"model": {**given, "seq_len": args.seq_len, "dropout": 0.0}},
                        preset=args.model or "tiny").model
    if model.d_model % model.n_head and model.attn_head_dim is None and model.attention_type != "mla":
        raise ConfigError(f"plan: --d-model {model.d_model} is not a multiple of --n-head {model.n_head}; "
                          "give --head-dim")
    return model


def torchrun_command(args: argparse.Namespace, p: Prediction, node: int) -> str:
    lay = p.layout
    nodes = max(1, p.gpus // node)
    parts = [f"torchrun --nnodes {nodes} --nproc-per-node {min(node, p.gpus)} -m gridtrain train",
             " ".join(model_flags(args)),
             f"--seq-len {args.seq_len} --global-batch-size {args.global_batch_size} --dtype {args.dtype}",
             f"--tp {lay.tp} --pp {lay.pp} --micro-batch-size {lay.micro_batch_size} --schedule {lay.schedule}",
             f"--cp {lay.cp}" if lay.cp > 1 else "",
             f"--cp-comm {lay.cp_comm}" if lay.cp > 1 and lay.cp_comm != "ring" else "",
             f"--ep {lay.ep}" if lay.ep > 1 or p.moe else "",
             f"--etp {lay.etp}" if lay.etp > 1 else "",
             f"--vpp {lay.vpp}" if lay.vpp > 1 else "",
             f"--pp-layers {','.join(map(str, p.pp_layers))}" if lay.pp_partition != "uniform" else "",
             f"--recompute {lay.recompute}",
             "--sequence-parallel" if lay.sequence_parallel else "", " ".join(lay.zero_flags()),
             f"--optimizer {p.optimizer}" if p.optimizer != "adamw" else "",
             f"--optimizer-state-dtype {args.optimizer_state_dtype}" if args.optimizer_state_dtype != "fp32" else "",
             "--optimizer-offload" if args.optimizer_offload else "", " ".join(p.fp8_flags())]
    return " ".join(x for x in parts if x)


def describe(p: Prediction) -> str:
    lay = p.layout
    name = (f"dp {lay.dp}" + (f" x cp {lay.cp} ({lay.cp_comm})" if lay.cp > 1 else "")
            + f" x tp {lay.tp} x pp {lay.pp}" + (f" x vpp {lay.vpp}" if lay.vpp > 1 else "")
            + (f", ep {lay.ep}" if lay.ep > 1 or p.moe else "") + (f" x etp {lay.etp}" if lay.etp > 1 else "")
            + (" (folded)" if lay.folded else "")
            + (f" (layers {','.join(map(str, p.pp_layers))})" if lay.pp_partition != "uniform" else "")
            + f", micro-batch {lay.micro_batch_size}, {lay.schedule}, recompute {lay.recompute}"
            + (", SP" if lay.sequence_parallel else "") + (f", {lay.zero_name()}" if lay.zero else ""))
    fits = "fits" if p.fits else "DOES NOT FIT"
    cp = (f", exposed CP communication {p.cp_comm_s:.3f}" if lay.cp > 1 else "") \
        + (f", exposed ZeRO communication {p.zero_comm_s:.3f}" if lay.zero >= 2 else "") \
        + (f", MoE communication {p.ep_comm_s:.3f}" if p.moe else "")
    return (f"{name}\n    step {p.step_time_s:.3f} s: compute {p.compute_s:.3f} (of which TP communication "
            f"{p.tp_comm_s:.3f}{cp}), pipeline bubble {p.bubble_s:.3f}, exposed DP communication "
            f"{p.dp_exposed_s:.3f}, optimizer {p.optimizer_s:.3f}\n"
            f"    {p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, {p.model_tflops_per_gpu:.1f} model TFLOP/s per GPU "
            f"({p.hardware_tflops_per_gpu:.1f} with recomputation), MFU {100 * p.mfu:.1f}%; memory "
            f"{p.memory_bytes / 1e9:.1f} GB per GPU ({fits})")


def plan_command(args: argparse.Namespace) -> int:
    model = model_of(args)
    if args.measure and (args.hardware != "cpu" or args.gpus > 8):
        raise ConfigError("plan --measure runs the layouts on this machine: needs --hardware cpu and --gpus <= 8")
    try:
        hw = machine(args.hardware, args.gpus)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    problem = fp8.refusal(args.fp8, args.fp8_all_gather, args.dtype, hw, args.zero)
    if problem:
        raise ConfigError(problem)
    job = Job(model=model, global_batch_size=args.global_batch_size, hardware=hw, dtype=args.dtype,
              gpus_per_node=args.gpus_per_node, optimizer=args.optimizer,
              optimizer_state_dtype=args.optimizer_state_dtype, optimizer_offload=args.optimizer_offload,
              fp8=args.fp8, fp8_all_gather=args.fp8_all_gather)
    fixed = Fixed(tp=args.tp, pp=args.pp, vpp=args.vpp, micro_batch_size=args.micro_batch_size,
                  schedule=args.schedule, recompute=args.recompute, sequence_parallel=args.sequence_parallel,
                  zero=args.zero, cp=args.cp, cp_comm=args.cp_comm, zero_shard_size=args.zero_shard_size,
                  zero3_keep_gathered=args.zero3_keep_gathered, ep=args.ep, etp=args.etp)
    best = search(job, args.gpus, fixed, top=args.top)
    if not best:
        raise ConfigError(why_none(job, args.gpus, fixed))
    if args.json:
        print(json.dumps({"fp8": args.fp8, "fp8_all_gather": args.fp8_all_gather,
                          "layouts": [{**p.as_json(), "command": torchrun_command(args, p, job.node)} for p in best]},
                         indent=1))
    else:
        experts = (f", {model.n_experts} experts (top {model.moe_top_k}) in {len(model.moe_layers)} layers"
                   if model.n_experts else "")
        extras = (", latent attention" if getattr(model, "mla", False) else "") \
            + (f", {model.mtp_layers} MTP" if getattr(model, "mtp_layers", 0) else "")
        print(f"gridtrain plan: {args.gpus} x {hw.name} ({job.node} per node), {model.arch} {model.n_layer} layers "
              f"d {model.d_model}{extras}{experts}, seq {model.seq_len}, global batch {args.global_batch_size}, "
              f"{args.dtype}" + (f", fp8 {args.fp8}{' (float8 all-gathers)' if args.fp8_all_gather else ''}"
                                 if job.fp8_on else ""))
        for i, p in enumerate(best, 1):
            print(f"{i}. {describe(p)}\n    {torchrun_command(args, p, job.node)}")
    if args.explain is not None:
        print("\n".join(explain(best[:2])))
        if args.explain:
            draw(best, Path(args.explain))
    if args.measure:
        from gridtrain.planner.measure import measure, table

        fitting = [p for p in best if p.fits]
        results = measure(model_flags(args), fitting, args.global_batch_size, args.seq_len, args.dtype,
                          args.measure_steps)  # (each prediction carries its --fp8 flags: train_args)
        print("\n".join(table(results)))
    return 0


def model_flags(args: argparse.Namespace) -> list[str]:
    """The model as ``gridtrain train`` flags."""
    flags = ["--model", args.model] if args.model else []
    for f in _model_fields():
        value = _value(args, f)
        if value is None:
            continue
        if isinstance(f.default, bool):
            flags.append(flag_of(f))  # a switch: given, it sets the opposite of the default
        else:
            flags += [flag_of(f), ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return flags


# a step's seconds by part: they add up to the step (compute is the busiest stage's own
# work, its communication apart)
STEP_PARTS = [("compute", lambda p: p.compute_s - p.tp_comm_s - p.cp_comm_s - p.zero_comm_s - p.ep_comm_s),
              ("TP communication", lambda p: p.tp_comm_s), ("exposed CP communication", lambda p: p.cp_comm_s),
              ("exposed ZeRO communication", lambda p: p.zero_comm_s), ("MoE communication", lambda p: p.ep_comm_s),
              ("pipeline bubble", lambda p: p.bubble_s), ("exposed DP communication", lambda p: p.dp_exposed_s),
              ("optimizer", lambda p: p.optimizer_s)]


def explain(best: list[Prediction]) -> list[str]:
    """The chosen layout beside the runner-up, part by part (seconds per step, then
    memory per GPU by kind), with their difference: where the winner gains and loses."""
    if not best:
        return []
    names = [f"{i}. {_label(p)}" for i, p in enumerate(best, 1)]
    lines = ["why " + (f"1 beats 2 ({names[0]} against {names[1]})" if len(best) > 1 else f"{names[0]}") + ":"]
    head = f"    {'seconds per step':<28}" + "".join(f"{i:>12}" for i in range(1, len(best) + 1))
    lines.append(head + (f"{'1 - 2':>12}" if len(best) > 1 else ""))

    def row(name: str, values: list[float], fmt: str = "{:12.3f}") -> str:
        cells = "".join(fmt.format(v) for v in values)
        diff = fmt.replace(":", ":+").format(values[0] - values[1]) if len(values) > 1 else ""
        return f"    {name:<28}{cells}{diff}"

    for name, part in STEP_PARTS:
        lines.append(row(name, [part(p) for p in best]))
    lines.append(row("step", [p.step_time_s for p in best]))
    lines.append(f"    {'memory GB per GPU':<28}")
    for kind in MEMORY_PARTS:
        lines.append(row(kind, [p.memory_parts.get(kind, 0.0) / 1e9 for p in best], "{:12.2f}"))
    lines.append(row("total", [p.memory_bytes / 1e9 for p in best], "{:12.2f}"))
    return lines


def _label(p: Prediction) -> str:
    lay = p.layout
    return (f"dp{lay.dp}{_cp_label(lay)} tp{lay.tp} pp{lay.pp}" + (f" v{lay.vpp}" if lay.vpp > 1 else "")
            + f" mb{lay.micro_batch_size} {lay.schedule} {lay.recompute}{' sp' if lay.sequence_parallel else ''}"
            + _zero_label(lay))


def draw(best: list[Prediction], path: Path) -> None:
    """Stacked bars of each layout's step: compute, TP and exposed CP and ZeRO-2/3
    communication, MoE communication, bubble, exposed DP communication, optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = STEP_PARTS
    fig, ax = plt.subplots(figsize=(9, 1 + 0.6 * len(best)))
    labels = [_label(p) for p in best]
    left = [0.0] * len(best)
    for name, part in parts:
        widths = [part(p) for p in best]
        ax.barh(labels, widths, left=left, label=name)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("predicted seconds per step")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _zero_label(lay) -> str:
    return (f" z{lay.zero}{f' s{lay.zero_shard_size}' if lay.zero_shard_size else ''}"
            f"{' keep' if lay.zero3_keep_gathered else ''}") if lay.zero else ""


def _cp_label(lay) -> str:
    return (f" cp{lay.cp}{'' if lay.cp_comm == 'ring' else ' ag'}" if lay.cp > 1 else "") \
        + (f" ep{lay.ep}" if lay.ep > 1 else "") + (f" etp{lay.etp}" if lay.etp > 1 else "")
