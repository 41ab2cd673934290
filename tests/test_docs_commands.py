"""Every `gridtrain` command the documentation shows is one the real command line accepts.

Where the commands come from: README.md and docs/*.md, in fenced and indented code
blocks and in inline code spans. A command is a line (backslash continuations joined,
``#`` comments dropped) that starts with ``gridtrain SUBCOMMAND``, after an optional
``$ `` prompt and ``NAME=value`` environment prefixes (``GRIDTRAIN_START_METHOD=spawn
gridtrain train ...``), or that runs ``-m gridtrain SUBCOMMAND`` after a launcher
(``python -m gridtrain``, ``torchrun ... -m gridtrain``, ``srun ... torchrun ... -m
gridtrain``). Output lines such as ``gridtrain: error: ...`` or ``gridtrain plan: 1024 x
...`` are not commands; but a ``gridtrain: error: MESSAGE`` line right after a command in
a code block says that the command is refused with MESSAGE, and the test expects exactly
that refusal.

What is checked, each command its own test (its id is FILE:LINE):

* a **synopsis** (a command with placeholders: ``[--json]``, ``A|B``, ``<any train
  flags>``, upper-case metavariables such as ``N``, ``DIR`` or ``FILE.png``): its
  subcommand exists and every ``--flag`` it names is an option of that subcommand;
* a **partial** command (a standalone ``...`` stands for more flags, e.g. ``gridtrain
  train --data 0.7:web.bin,0.3:code.bin ...``): parsed by the real parser with the
  arguments it requires made optional (flag names, values and choices are checked);
* a **mention** (an inline span naming a command without arguments, e.g.
  ``gridtrain prepare``): the subcommand exists;
* every other command is **parsed** by the real parser (gridtrain/cli/parser.py's
  ``build_parser``), exactly as ``gridtrain`` parses its argv;
* a ``train`` command is then also **validated** as ``gridtrain train`` validates it before
  starting anything: the configuration is built from the flags, the preset and the
  ``--config`` file (``config_from_args``) and checked by gridtrain.training.validate
  (sizes against the world, ranges, the schedule, outputs, ...). The world is the
  command's own: ``--nproc``, torchrun's ``--nnodes x --nproc-per-node``, or a dry
  run's ``--world-size`` (a dry run goes through the real ``--dry-run`` path with the
  fake step itself left out). What the documentation's machine would have and this one
  need not is left out: the host's capacity for ``--nproc`` workers, GPUs (a ``cuda``
  command is validated for this machine's device), and the inputs the examples only
  name: data files and tokenizers that do not exist skip the data check
  (``validate(..., data=False)``), a ``--load`` checkpoint that does not exist is dropped
  from the check, and a command whose ``--config`` file or ``--init-from`` source does
  not exist (its model comes from there) is parsed only.

Nothing starts: no process, no process group (``no_process_may_start``); the run, the
dry run's step and the data are never touched beyond the checks.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest
import torch

from gridtrain.cli import parser as cli
from gridtrain.config import ConfigError
from gridtrain.data import DataError, count_tokens
from gridtrain.training import validate as validation
from gridtrain.data.mixture import parse_sources

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

SUBCOMMAND = re.compile(r"^[a-z][a-z0-9-]*$")
METAVAR = re.compile(r"^[A-Z][A-Z0-9_]*(\.[A-Za-z0-9]+)?$")  # N, DIR, HF_DIR, FILE.png, METRICS.jsonl
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SPAN = re.compile(r"`([^`]+)`")
REFUSED = "gridtrain: error: "


class DocCommandError(AssertionError):
    """A documented command that the command line would refuse."""


@dataclasses.dataclass(frozen=True)
class DocCommand:
    where: str  # FILE:LINE
    text: str  # as the documentation spells it (continuations joined)
    launcher: tuple[str, ...]  # what comes before `-m gridtrain` (torchrun and its flags), or ()
    argv: tuple[str, ...]  # what gridtrain receives ("..." tokens left out)
    inline: bool
    partial: bool = False  # a standalone "..." stood for more flags
    refused: str | None = None  # the `gridtrain: error:` message the docs show for it

    @property
    def placeholders(self) -> list[str]:
        return [t for t in self.argv if re.search(r"[\[\]<>|]", t) or "..." in t or METAVAR.match(t)]

    @property
    def kind(self) -> str:
        if self.placeholders:
            return "synopsis"
        if self.partial:
            return "partial"
        if self.inline and all(SUBCOMMAND.match(t) for t in self.argv):
            return "mention"
        return "command"


def command_in(text: str, where: str, inline: bool) -> DocCommand | None:
    """The gridtrain command in one line or code span, or None if it holds none."""
    text = text.strip()
    if text.startswith("$ "):
        text = text[2:]
    if "gridtrain" not in text:
        return None
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:
        if re.match(r"^gridtrain [a-z]|.* -m gridtrain [a-z]", text):
            raise DocCommandError(f"{where}: cannot be split like a shell line: {text}") from None
        return None
    while tokens and ENV.match(tokens[0]):
        tokens.pop(0)
    launcher: list[str] = []
    if tokens[:1] == ["gridtrain"]:
        argv = tokens[1:]
    else:
        at = next((i for i in range(len(tokens) - 1) if tokens[i:i + 2] == ["-m", "gridtrain"]), None)
        if at is None:
            return None
        launcher, argv = tokens[:at], tokens[at + 2:]
    partial = "..." in argv
    argv = [t for t in argv if t != "..."]
    if not argv or not SUBCOMMAND.match(argv[0]):
        return None  # `python -m gridtrain`, `gridtrain: error: ...`, `gridtrain plan: 1024 x ...`
    return DocCommand(where, " ".join(text.split()), tuple(launcher), tuple(argv), inline, partial)


def extract(markdown: str, name: str) -> list[DocCommand]:
    """Every gridtrain command of a markdown text, in order."""
    lines = markdown.split("\n")
    found: list[DocCommand] = []
    fence = False
    code_block = False  # an indented code block continues
    prose: list[tuple[int, str]] = []  # the current paragraph's lines, with their numbers

    def flush_prose():
        if not prose:
            return
        first = prose[0][0]
        paragraph = "\n".join(line for _, line in prose)
        for m in SPAN.finditer(paragraph):
            line_no = first + paragraph.count("\n", 0, m.start())
            span = m.group(1).replace("\n", " ")
            if paragraph.lstrip().startswith("|"):
                span = span.replace("\\|", "|")  # a table cell's escaped bar
            cmd = command_in(span, f"{name}:{line_no}", inline=True)
            if cmd:
                found.append(cmd)
        prose.clear()

    i = 0
    while i < len(lines):
        line, line_no = lines[i], i + 1
        i += 1
        if line.lstrip().startswith("```"):
            flush_prose()
            fence = not fence
            continue
        indented = line.startswith("    ") and (code_block or not prose)
        if fence or indented:
            flush_prose()
            code_block = indented
            while line.rstrip().endswith("\\") and i < len(lines):
                line = line.rstrip()[:-1] + " " + lines[i].strip()
                i += 1
            cmd = command_in(line, f"{name}:{line_no}", inline=False)
            if cmd:
                after = lines[i].strip() if i < len(lines) else ""
                if after.startswith(REFUSED):  # the documented refusal of this command
                    cmd = dataclasses.replace(cmd, refused=after[len(REFUSED):])
                found.append(cmd)
            continue
        code_block = False
        if line.strip():
            prose.append((line_no, line))
        else:
            flush_prose()
    flush_prose()
    return found


def documented_commands() -> list[DocCommand]:
    return [c for path in DOCS for c in extract(path.read_text(encoding="utf-8"), path.relative_to(REPO).as_posix())]


COMMANDS = documented_commands()


def _subparser(argv: tuple[str, ...], where: str, root=None):
    """The parser (of ``root``, default a new one) of the (nested) subcommand ``argv``
    starts with, and the rest of argv."""
    import argparse

    current, rest = root or cli.build_parser(), list(argv)
    while True:
        subs = next((a for a in current._actions if isinstance(a, argparse._SubParsersAction)), None)
        if subs is None or not rest or not SUBCOMMAND.match(rest[0]) or rest[0] not in subs.choices:
            if subs is not None:
                raise DocCommandError(f"{where}: `gridtrain {' '.join(argv)}`: no such command "
                                      f"(choices: {', '.join(subs.choices)})")
            return current, rest
        current = subs.choices[rest.pop(0)]


def _check_synopsis(cmd: DocCommand) -> None:
    sub, rest = _subparser(cmd.argv, cmd.where)
    known = set(sub._option_string_actions)
    for token in rest:
        flag = token.strip("[]()|,").split("=")[0]
        if flag.startswith("--") and flag not in known:
            raise DocCommandError(f"{cmd.where}: `{cmd.text}`: {flag} is not an option of "
                                  f"`gridtrain {sub.prog.split(' ', 1)[1]}`")


def _parse(cmd: DocCommand, capsys):
    parser = cli.build_parser()
    if cmd.partial:  # what the "..." stands for may hold the required arguments
        sub, _ = _subparser(cmd.argv, cmd.where, parser)
        for action in sub._actions:
            if action.option_strings:
                action.required = False
            elif action.nargs is None:
                action.nargs = "?"
    try:
        return parser.parse_args(list(cmd.argv))
    except SystemExit:
        message = capsys.readouterr().err.strip()
        raise DocCommandError(f"{cmd.where}: `{cmd.text}` does not parse: {message}") from None


def _launcher_world(launcher: tuple[str, ...]) -> int | None:
    """torchrun's ``--nnodes x --nproc-per-node`` (None where they are not plain numbers)."""
    if not any(t == "torchrun" or t.endswith("torch.distributed.run") for t in launcher):
        return None
    sizes = {"--nnodes": "1", "--nproc-per-node": "1"}
    for i, token in enumerate(launcher):
        name, _, value = token.partition("=")
        name = name.replace("_", "-")
        if name in sizes:
            sizes[name] = value or (launcher[i + 1] if i + 1 < len(launcher) else "")
    if not all(v.isdigit() for v in sizes.values()):
        return None
    return int(sizes["--nnodes"]) * int(sizes["--nproc-per-node"])


def inputs_exist(args) -> bool:
    """Whether the inputs a train command's model comes from exist (its --config file,
    its --init-from source); the commands of the docs that only name them are parsed only."""
    return all(Path(getattr(args, flag)).exists() for flag in ("config", "init_from") if hasattr(args, flag))


def _data_exists(cfg) -> bool:
    d = cfg.data
    try:
        paths = [s.path for s in parse_sources(d.path)]
        paths += [s.path for s in parse_sources(d.valid_data, "--valid-data")] if d.valid_data else []
    except DataError as e:
        raise ConfigError(str(e)) from None
    paths.append(d.tokenizer)
    return all(p is None or Path(p).exists() for p in paths)


_COUNTS: dict = {}  # (corpus, tokenizer) -> count_tokens' answer: the built-in corpus is read once, not per command


def _counted_once(path, tokenizer):
    key = (path, type(tokenizer).__name__, tokenizer.vocab_size)
    if key not in _COUNTS:
        _COUNTS[key] = count_tokens(path, tokenizer)
    return _COUNTS[key]


def _validate_train(cmd: DocCommand, args, monkeypatch) -> None:
    """``gridtrain train``'s own path up to the point where it would start something."""
    monkeypatch.setattr(validation, "count_tokens", _counted_once)
    if hasattr(args, "load") and not Path(args.load).exists():
        delattr(args, "load")  # a checkpoint the example only names: not checked
    if getattr(args, "dry_run", False):
        import gridtrain.dryrun

        monkeypatch.setattr(gridtrain.dryrun, "dry_run", lambda *a, **k: None)  # the checks, not the step
        cli._train(args)
        return
    import gridtrain.cli.commands

    real_validate = cli.validate

    def validate_here(cfg, world_size=None, *, data=True):
        world = _launcher_world(cmd.launcher) or cfg.parallel.nproc or 1
        cfg.parallel.nproc = None  # this host's room for workers is not the documentation's business
        if cfg.training.device == "cuda" and not torch.cuda.is_available():
            cfg.training.device = None  # validated for this machine's device
            if cfg.training.backend == "nccl":
                cfg.training.backend = None
        return real_validate(cfg, world, data=data and _data_exists(cfg))

    monkeypatch.setattr(cli, "validate", validate_here)
    monkeypatch.setattr(gridtrain.cli.commands, "train_command", lambda cfg: 0)
    cli._train(args)


def _parse_and_validate(cmd: DocCommand, capsys, monkeypatch) -> str:
    args = _parse(cmd, capsys)
    if args.command != "train" or cmd.partial or not inputs_exist(args):
        return "parsed"
    try:
        _validate_train(cmd, args, monkeypatch)
    except cli.USER_ERRORS as e:
        raise DocCommandError(f"{cmd.where}: `{cmd.text}` is refused: {e}") from None
    return "validated"


def check(cmd: DocCommand, capsys, monkeypatch) -> str:
    """Check one documented command; return how far it went (synopsis, mention, parsed,
    validated, or refused as documented); raise DocCommandError where the command line
    would refuse it (or, for a documented refusal, would not refuse it so)."""
    if cmd.kind == "synopsis":
        _check_synopsis(cmd)
        return "synopsis"
    if cmd.kind == "mention":
        _subparser(cmd.argv, cmd.where)
        return "mention"
    try:
        level = _parse_and_validate(cmd, capsys, monkeypatch)
    except DocCommandError as e:
        if cmd.refused is not None and cmd.refused in str(e):
            return "refused"
        raise
    if cmd.refused is not None:
        raise DocCommandError(f"{cmd.where}: `{cmd.text}` is shown refused ({cmd.refused}) but was {level}")
    return level


@pytest.fixture
def in_a_clean_directory(tmp_path, monkeypatch):
    """Relative paths resolve as in a checkout (configs/ is there), but no checkpoint or
    output of a local run can change the outcome."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_documented_command_is_accepted(cmd, capsys, monkeypatch, in_a_clean_directory, no_process_may_start):
    try:
        check(cmd, capsys, monkeypatch)
        error = None
    except DocCommandError as e:
        error = str(e)
    if error:
        pytest.fail(error, pytrace=False)


def test_the_extractor_finds_the_documented_commands():
    """A guard: the test above cannot pass on nothing."""
    kinds = [c.kind for c in COMMANDS]
    assert len(COMMANDS) >= 100, len(COMMANDS)
    assert kinds.count("command") >= 70 and kinds.count("synopsis") >= 10, kinds
    files = {c.where.split(":")[0] for c in COMMANDS}
    assert {"README.md", "docs/cli.md", "docs/parallelism.md", "docs/gpus.md", "docs/data.md"} <= files, files
    launched = [c for c in COMMANDS if c.launcher]
    assert any("torchrun" in c.launcher for c in launched)
    assert any(t.startswith("GRIDTRAIN_START_METHOD") for c in COMMANDS for t in c.text.split()[:1])
    trains = [c for c in COMMANDS if c.kind == "command" and c.argv[0] == "train"]
    assert len(trains) >= 40, len(trains)


def test_extraction_rules():
    doc = "\n".join([
        "Text with `gridtrain prepare` and `gridtrain plot runs/a.jsonl --out x.png` in it,",
        "and a span that wraps: `gridtrain train --model",
        "tiny`.",
        "",
        "    $ gridtrain train --steps 3 \\",
        "        --seed 1   # a comment",
        "    gridtrain: error: not a command",
        "    GRIDTRAIN_START_METHOD=spawn gridtrain train --nproc 2",
        "",
        "```",
        "srun --nodes 2 torchrun --nnodes 2 --nproc-per-node 4 -m gridtrain train --tp 2",
        "gridtrain plan: 8 x h100-sxm (output, not a command)",
        "python -m gridtrain.cli.flag_table",
        "```",
        "| cell | `gridtrain schedule ... --out FILE.png` and `--cp-comm ring\\|allgather` |",
    ])
    got = [(c.where, c.kind, c.launcher[:1], c.argv) for c in extract(doc, "x.md")]
    assert got == [
        ("x.md:1", "mention", (), ("prepare",)),
        ("x.md:1", "command", (), ("plot", "runs/a.jsonl", "--out", "x.png")),
        ("x.md:2", "command", (), ("train", "--model", "tiny")),
        ("x.md:5", "command", (), ("train", "--steps", "3", "--seed", "1")),
        ("x.md:8", "command", (), ("train", "--nproc", "2")),
        ("x.md:11", "command", ("srun",), ("train", "--tp", "2")),
        ("x.md:15", "synopsis", (), ("schedule", "--out", "FILE.png")),
    ]
    assert _launcher_world(extract(doc, "x.md")[5].launcher) == 8


@pytest.mark.parametrize("line, problem", [
    ("    gridtrain train --model tiny --no-such-flag 3", "unrecognized arguments: --no-such-flag"),
    ("    gridtrain trian --model tiny", "invalid choice: 'trian'"),
    ("`gridtrain plan --gpus N --hardware NAME --no-such-flag`", "--no-such-flag is not an option"),
    ("`gridtrain chekpoint`", "no such command"),
    ("    gridtrain train --tp 3 --nproc 4", "not divisible by tp=3"),
    ("    gridtrain train --model no-such-preset", "no-such-preset"),
    ("    torchrun --nproc-per-node 8 -m gridtrain train --model tiny --tp 3", "world size 8 is not divisible"),
    ("    gridtrain train --model tiny --dry-run --world-size 8 --tp 3", "not divisible by tp=3"),
])
def test_a_wrong_command_is_caught(line, problem, capsys, monkeypatch, in_a_clean_directory, no_process_may_start):
    """The same check as above refuses what the command line refuses."""
    (cmd,) = extract(line, "wrong.md")
    with pytest.raises(DocCommandError, match=re.escape(problem)):
        check(cmd, capsys, monkeypatch)
