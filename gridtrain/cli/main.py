"""The ``gridtrain`` command: train, generate, prepare, import-hf, export-hf, schedule, plot.

The flags are a stable contract (see the README): each maps onto one field of the
config dataclasses, and overrides the preset and the YAML file. Every configuration
error is reported as one line on stderr, exit status 2, before any process starts.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gridtrain.checkpoint import CheckpointError
from gridtrain.config import (ARCHS, ATTENTION, DTYPES, PRESETS, RECOMPUTE, RECOMPUTE_METHODS, Config, ConfigError,
                              given_model_fields, load_config)
from gridtrain.data import DataError, prepare
from gridtrain.models.hf_mapping import HFError
from gridtrain.runtime.launch import WorkerError, WorkerTimeout
from gridtrain.runtime.stops import EXIT_CRASH, EXIT_INTERRUPTED, RunStopped
from gridtrain.parallel.pipeline.draw import add_schedule_parser, schedule_command
from gridtrain.planner.command import add_plan_parser
from gridtrain.parallel.pipeline.schedules import ORDERS
from gridtrain.cli.plot import PlotError, add_plot_parser, plot_command
from gridtrain.training.validate import validate

def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


_int_list.__name__ = "comma-separated integer list"  # what argparse's error message calls it

# flag -> (section, field, type, help)
TRAIN_FLAGS: list[tuple[str, str, str, Any, str]] = [  # noqa: E501
    ("--nproc", "parallel", "nproc", int, "spawn N local worker processes (not under torchrun)"),
    ("--dp", "parallel", "dp", int, "data-parallel size (default: world / (tp * pp))"),
    ("--tp", "parallel", "tp", int, "tensor-parallel size"),
    ("--pp", "parallel", "pp", int, "pipeline-parallel size"),
    ("--vpp", "parallel", "vpp", int, "model chunks per pipeline rank (interleaved schedule)"),
    ("--schedule", "parallel", "schedule", str, " | ".join(ORDERS)),
    ("--pp-layers", "parallel", "pp_layers", _int_list,
     "blocks per virtual stage, e.g. 3,4,4,3"),
    ("--pp-partition", "parallel", "pp_partition", str, "uniform | parameters | time"),
    ("--bucket-mb", "parallel", "bucket_mb", float,
     "gradient bucket size in MiB (all-reduce; ZeRO-1: reduce-scatter and parameter gather)"),
    ("--arch", "model", "arch", str, " | ".join(ARCHS) + " (default: the preset's)"),
    ("--n-layer", "model", "n_layer", int, "transformer blocks"),
    ("--n-head", "model", "n_head", int, "attention heads"),
    ("--n-kv-head", "model", "n_kv_head", int, "key/value heads (llama: grouped-query attention)"),
    ("--d-model", "model", "d_model", int, "hidden size"),
    ("--ffn-hidden", "model", "ffn_hidden", int, "MLP width (default: 4 d_model for gpt2, 8/3 d_model for llama)"),
    ("--rope-theta", "model", "rope_theta", float, "rotary base (llama)"),
    ("--seq-len", "model", "seq_len", int, "sequence length"),
    ("--vocab-size", "model", "vocab_size", int, "vocabulary size (before padding)"),
    ("--dropout", "model", "dropout", float, "dropout probability"),
    ("--attention", "model", "attention", str, " | ".join(ATTENTION) + " (math: op by op, as the memory formula)"),
    ("--micro-batch-size", "training", "micro_batch_size", int, "sequences per micro-batch"),
    ("--global-batch-size", "training", "global_batch_size", int, "sequences per optimizer step"),
    ("--recompute", "training", "recompute", str, " | ".join(RECOMPUTE)),
    ("--recompute-method", "training", "recompute_method", str,
     " | ".join(RECOMPUTE_METHODS) + " (full: groups of N blocks | the first N blocks of each chunk)"),
    ("--recompute-layers", "training", "recompute_layers", int, "the N of --recompute-method (default 1)"),
    ("--dtype", "training", "dtype", str, " | ".join(DTYPES)),
    ("--zero", "training", "zero", int, "1: shard optimizer state over data parallel (ZeRO-1)"),
    ("--loss-scale", "training", "loss_scale", float, "fp16: initial dynamic loss scale"),
    ("--min-loss-scale", "training", "min_loss_scale", float,
     "fp16: overflowing at this loss scale stops the run (exit 3)"),
    ("--steps", "training", "steps", int, "optimizer steps"),
    ("--lr", "training", "lr", float, "peak learning rate"),
    ("--warmup-steps", "training", "warmup_steps", int, "linear warm-up steps (default 5%% of steps)"),
    ("--weight-decay", "training", "weight_decay", float, "AdamW weight decay"),
    ("--grad-clip", "training", "grad_clip", float, "global gradient-norm clip (0: off)"),
    ("--seed", "training", "seed", int, "seed for init, data order and dropout"),
    ("--device", "training", "device", str, "cpu | cuda (default: cuda when available)"),
    ("--eval-interval", "training", "eval_interval", int, "steps between validation passes"),
    ("--eval-iters", "training", "eval_iters", int, "global batches per validation pass"),
    ("--metrics-file", "training", "metrics_file", str, "JSON lines, one per optimizer step"),
    ("--save", "training", "save", str, "checkpoint directory"),
    ("--save-interval", "training", "save_interval", int, "steps between checkpoints (0: at end)"),
    ("--keep-last", "training", "keep_last", int, "keep only the newest K checkpoints in --save (0: all)"),
    ("--load", "training", "load", str, "resume from this checkpoint directory"),
    ("--init-from", "training", "init_from", str,
     "start from these weights (a checkpoint or a Hugging Face directory; step 0, fresh optimizer)"),
    ("--sample-tokens", "training", "sample_tokens", int, "print a sample this long after training"),
    ("--prompt", "training", "prompt", str, "prompt for the closing sample"),
    ("--peak-tflops", "training", "peak_tflops", float, "device peak for MFU"),
    ("--timeout", "training", "dist_timeout_s", float, "collective timeout in seconds"),
    ("--trace", "training", "trace", str, "write a Chrome trace of pipeline actions per rank here"),
    ("--tensorboard", "training", "tensorboard", str, "write per-step metrics as TensorBoard events here"),
    ("--data", "data", "path", str, "text file, folder of text, or token file (default: built-in corpus)"),
    ("--tokenizer", "data", "tokenizer", str, "Hugging Face tokenizer.json (default: bytes)"),
]


# on/off flags of the training section: flag -> help
SWITCHES: dict[str, str] = {
    "--recompute-keep-last": "the last micro-batch of a step keeps its activations (GPipe)",
    "--recompute-early": "with --pp > 1: recompute while the output gradient is on its way",
    "--offload-activations": "keep saved activations in host memory until backward (GPU)",
    "--memory-report": "print saved-activation bytes per layer and stage, beside the formula",
    "--save-async": "write checkpoints in the background: training waits only while the state is "
                    "copied to host memory",
    "--compile": "torch.compile each transformer block (forward and backward; the first step compiles)",
    "--auto-resume": "resume from the --save directory's latest checkpoint when there is one, "
                     "else start fresh (the same command restarts a preempted job)",
}


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model", argument_default=argparse.SUPPRESS)
    p.add_argument("--config", help="YAML file with sections model, parallel, training, data")
    p.add_argument("--model", help=f"preset: {', '.join(PRESETS)}")
    for flag, _, _, typ, help_text in TRAIN_FLAGS:
        p.add_argument(flag, type=typ, help=help_text)
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp > 1: LayerNorm and dropout on sequence shards")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for flag, help_text in SWITCHES.items():
        p.add_argument(flag, action="store_true", help=help_text)
    g = p.add_argument_group("dry run", "one training step of chosen ranks of an N-rank layout, in this "
                             "process, on fake tensors with a fake process group (gridtrain/dryrun.py)")
    g.add_argument("--dry-run", action="store_true", help="measure memory per rank; allocate nothing")
    g.add_argument("--world-size", type=int, help="ranks of the layout to simulate (with --dry-run)")
    g.add_argument("--dry-run-ranks", help="edges (default) | all | R,R,...")
    g.add_argument("--dry-run-report", help="write the per-rank memory as JSON here")


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a saved model")
    p.add_argument("--load", required=True, help="checkpoint directory written by --save, or a Hugging Face directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the model's own, else bytes)")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu | cuda")


def _prepare_parser(sub) -> None:
    p = sub.add_parser("prepare", help="tokenize text into a memory-mapped token file")
    p.add_argument("--data", default=None, help="text file or folder (default: built-in corpus)")
    p.add_argument("--out", required=True, help="output path; writes OUT.bin and OUT.json")
    p.add_argument("--tokenizer", default=None, help="Hugging Face tokenizer.json (default: bytes)")


def _hf_parsers(sub) -> None:
    p = sub.add_parser("import-hf", help="a Hugging Face model directory -> a gridtrain checkpoint (step 0)")
    p.add_argument("hf_dir", metavar="HF_DIR", help="directory with config.json and model.safetensors (or an index)")
    p.add_argument("--out", required=True, help="new save directory for the checkpoint")
    p = sub.add_parser("export-hf", help="a gridtrain checkpoint -> a Hugging Face model directory")
    p.add_argument("--load", required=True, help="checkpoint directory written by --save or import-hf")
    p.add_argument("--out", required=True, help="directory for config.json, the safetensors and the tokenizer")
    p.add_argument("--max-shard-size", default="5GB", help="largest weights file before sharding (default 5GB)")


def _checkpoint_parser(sub) -> None:
    p = sub.add_parser("checkpoint", help="inspect a checkpoint")
    actions = p.add_subparsers(dest="action", required=True)
    info = actions.add_parser("info", help="step, the layout that wrote it, model, sizes, integrity")
    info.add_argument("dir", metavar="DIR", help="a save directory (its latest) or a step directory")
    info.add_argument("--json", action="store_true", help="print the same as JSON")
    info.add_argument("--no-verify", action="store_true", help="check file sizes only, not their sha256")


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line like every other bad input (exit status 2),
    not the usage block; ``--help`` still shows everything."""

    def error(self, message: str):
        print(f"gridtrain: error: {message}; see `{self.prog} --help`", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gridtrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _generate_parser(sub)
    _prepare_parser(sub)
    _hf_parsers(sub)
    _checkpoint_parser(sub)
    add_plan_parser(sub)
    add_schedule_parser(sub)
    add_plot_parser(sub)
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    overrides = _overrides(args)
    cfg = load_config(getattr(args, "config", None), overrides, getattr(args, "model", None))
    if cfg.training.init_from is not None:  # the model's shape comes from the source
        from gridtrain.checkpoint.huggingface import apply_init_from

        apply_init_from(cfg, given_model_fields(getattr(args, "config", None), overrides, getattr(args, "model", None)))
    return cfg


def _overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    overrides: dict[str, dict[str, Any]] = {}
    for flag, section, name, _, _ in TRAIN_FLAGS:
        dest = flag[2:].replace("-", "_")
        if hasattr(args, dest):
            overrides.setdefault(section, {})[name] = getattr(args, dest)
    if getattr(args, "sequence_parallel", False):
        overrides.setdefault("parallel", {})["sequence_parallel"] = True
    if getattr(args, "no_progress", False):
        overrides.setdefault("training", {})["progress"] = False
    for flag in SWITCHES:
        dest = flag[2:].replace("-", "_")
        if getattr(args, dest, False):
            overrides.setdefault("training", {})[dest] = True
    return overrides


def _train(args: argparse.Namespace) -> int:
    dry = getattr(args, "dry_run", False)
    for flag in ("world_size", "dry_run_ranks", "dry_run_report"):
        if hasattr(args, flag) and not dry:
            raise ConfigError(f"--{flag.replace('_', '-')} needs --dry-run")
    if dry:
        return _dry_run(args)
    from gridtrain.cli.commands import train_command

    return train_command(validate(config_from_args(args)))


def _dry_run(args: argparse.Namespace) -> int:
    """``train --dry-run``: validated as an N-rank job would be (its data is not read:
    the step runs on made-up token ids), then gridtrain.dryrun."""
    import copy

    from gridtrain.dryrun import dry_run

    world = getattr(args, "world_size", None)
    if world is None or world < 1:
        raise ConfigError("--dry-run needs --world-size N (N >= 1): the number of ranks of the layout")
    cfg = config_from_args(args)  # with --init-from: the source's model, checked
    cfg.training.init_from = None  # its shape is all a dry run needs, not its weights
    if cfg.parallel.nproc is not None:
        raise ConfigError("--dry-run runs in this process; drop --nproc (use --world-size for the layout)")
    if cfg.training.compile:
        raise ConfigError("--dry-run measures the eager blocks (what a compiled block keeps for backward is "
                          "inductor's choice); drop --compile")
    checked = copy.deepcopy(cfg)
    checked.training.device = None  # the dry run needs no GPU, even for cuda
    validate(checked, world, data=False)
    dry_run(cfg, world, getattr(args, "dry_run_ranks", None) or "edges", getattr(args, "dry_run_report", None))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from gridtrain.cli.commands import generate_command

    return generate_command(args)


def _prepare(args: argparse.Namespace) -> int:
    print(f"wrote {prepare(args.data, args.out, args.tokenizer)}")
    return 0


def _import_hf(args: argparse.Namespace) -> int:
    from gridtrain.checkpoint.huggingface import import_hf

    print(f"wrote {import_hf(args.hf_dir, args.out)}")
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from gridtrain.checkpoint.huggingface import export_hf, parse_size

    print(f"wrote {export_hf(args.load, args.out, parse_size(args.max_shard_size))}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from gridtrain.planner.command import plan_command

    return plan_command(args)


def _checkpoint(args: argparse.Namespace) -> int:
    from gridtrain.checkpoint.reader import info_command

    print(info_command(args.dir, as_json=args.json, verify=not args.no_verify))
    return 0


COMMANDS = {"train": _train, "generate": _generate, "prepare": _prepare, "import-hf": _import_hf,
            "export-hf": _export_hf, "checkpoint": _checkpoint, "plan": _plan, "schedule": schedule_command, "plot": plot_command}
USER_ERRORS = (ConfigError, DataError, CheckpointError, PlotError, HFError)  # one line, exit status 2


def main(argv: list[str] | None = None) -> int:
    """Run one command; the exit status says how it ended (stops.py has the table)."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except USER_ERRORS as e:
        print(f"gridtrain: error: {e}", file=sys.stderr)
        return 2
    except RunStopped as e:
        print(f"gridtrain: stopped: {e}", file=sys.stderr)
        return e.exit_code
    except (WorkerError, WorkerTimeout) as e:
        print(f"gridtrain: a worker failed: {e}", file=sys.stderr)
        return EXIT_CRASH
    except KeyboardInterrupt:
        print("gridtrain: interrupted (Ctrl-C); nothing was saved", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
