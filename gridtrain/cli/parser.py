"""The ``gridtrain`` command: train, generate, prepare, import-hf, export-hf, schedule, plot.

The flags are a stable contract (see the README): each maps onto one field of the
config dataclasses, and overrides the preset and the YAML file. Every configuration
error is reported as one line on stderr, exit status 2, before any process starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from typing import Any

from gridtrain.checkpoint import CheckpointError
from gridtrain.config import (PRESETS, SECTION_CLASSES, SECTIONS, Config, ConfigError, declared_fields, field_types, flag_of,
                              given_model_fields, load_config)
from gridtrain.data import DataError, prepare
from gridtrain.models.hf_mapping import HFError
from gridtrain.runtime.launch import WorkerError, WorkerTimeout
from gridtrain.runtime.stops import EXIT_CRASH, EXIT_INTERRUPTED, RunStopped
from gridtrain.parallel.pipeline.draw import add_schedule_parser, schedule_command
from gridtrain.planner.command import add_plan_parser
from gridtrain.cli.plot import PlotError, add_plot_parser, plot_command
from gridtrain.training.validate import validate

def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


_int_list.__name__ = "comma-separated integer list"  # what argparse's error message calls it
PARSE = {int: int, float: float, str: str, list[int]: _int_list}  # a field's type -> how its flag is read
METAVARS = {int: "N", float: "X", str: "TEXT", list[int]: "N,N,..."}  # unless the declaration names one


def _field_flag(p: argparse.ArgumentParser, section: str, f: dataclasses.Field) -> None:
    """The flag of a declared config field: a switch for a bool (it sets the opposite of
    the default), else a value read as the field's type."""
    help_text = f.metadata["help"].replace("%", "%%")
    annotation = field_types(SECTION_CLASSES[section])[f.name]
    if annotation is bool:
        p.add_argument(flag_of(f), action="store_const", const=not f.default, help=help_text)
        return
    value_type = next((a for a in typing.get_args(annotation) if a is not type(None)), annotation)
    metavar = f.metadata["metavar"] or METAVARS[value_type]
    p.add_argument(flag_of(f), type=PARSE[value_type], metavar=metavar, help=help_text)


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model", argument_default=argparse.SUPPRESS)
    p.add_argument("--config", metavar="FILE.yaml", help=f"YAML file with sections {', '.join(SECTIONS)}")
    p.add_argument("--model", metavar="NAME", help=f"preset: {', '.join(PRESETS)}")
    for section, f in declared_fields():
        if flag_of(f):
            _field_flag(p, section, f)
    g = p.add_argument_group("dry run", "one training step of chosen ranks of an N-rank layout, in this "
                             "process, on fake tensors with a fake process group (gridtrain/dryrun.py)")
    g.add_argument("--dry-run", action="store_true", help="measure memory per rank; allocate nothing")
    g.add_argument("--world-size", type=int, metavar="N", help="ranks of the layout to simulate (with --dry-run)")
    g.add_argument("--dry-run-ranks", metavar="edges|all|R,R,...", help="edges (default) | all | R,R,...")
    g.add_argument("--dry-run-report", metavar="FILE.json", help="write the per-rank memory as JSON here")


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
    p.add_argument("--out", required=True, help="output path; writes OUT.bin, OUT.idx (document starts) and OUT.json")
    p.add_argument("--tokenizer", default=None, help="Hugging Face tokenizer.json (default: bytes)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes tokenizing contiguous shares of the corpus (default: 1); same output")


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
    add_plan_parser(sub, _field_flag)
    add_schedule_parser(sub)
    add_plot_parser(sub)
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    overrides = _overrides(args)
    cfg = load_config(getattr(args, "config", None), overrides, getattr(args, "model", None))
    if cfg.checkpoint.init_from is not None:  # the model's shape comes from the source
        from gridtrain.checkpoint.huggingface import apply_init_from

        apply_init_from(cfg, given_model_fields(getattr(args, "config", None), overrides, getattr(args, "model", None)))
    return cfg


def _overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The values the flags give, by section and field."""
    overrides: dict[str, dict[str, Any]] = {}
    for section, f in declared_fields():
        dest = (flag_of(f) or "")[2:].replace("-", "_")
        if dest and hasattr(args, dest):
            overrides.setdefault(section, {})[f.name] = getattr(args, dest)
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
    from gridtrain.runtime.cuda_rules import CudaRuleError

    world = getattr(args, "world_size", None)
    if world is None or world < 1:
        raise ConfigError("--dry-run needs --world-size N (N >= 1): the number of ranks of the layout")
    cfg = config_from_args(args)  # with --init-from: the source's model, checked
    cfg.checkpoint.init_from = None  # its shape is all a dry run needs, not its weights
    if cfg.parallel.nproc is not None:
        raise ConfigError("--dry-run runs in this process; drop --nproc (use --world-size for the layout)")
    if cfg.training.compile:
        raise ConfigError("--dry-run measures the eager blocks (what a compiled block keeps for backward is "
                          "inductor's choice); drop --compile")
    checked = copy.deepcopy(cfg)
    checked.training.device = None  # the dry run needs no GPU, even for cuda
    validate(checked, world, data=False)
    try:
        dry_run(cfg, world, getattr(args, "dry_run_ranks", None) or "edges", getattr(args, "dry_run_report", None))
    except CudaRuleError as e:  # what a GPU would refuse or pay for, found on fake tensors: no traceback
        print(f"gridtrain: dry run: {e}", file=sys.stderr)
        return 1
    return 0


def _generate(args: argparse.Namespace) -> int:
    from gridtrain.cli.commands import generate_command

    return generate_command(args)


def _prepare(args: argparse.Namespace) -> int:
    bin_path = prepare(args.data, args.out, args.tokenizer, workers=args.workers)
    header = json.loads(bin_path.with_suffix(".json").read_text("utf-8"))
    print(f"wrote {bin_path} ({header['num_tokens']:,} tokens, {header['num_documents']:,} documents)")
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
